"""Trees of separate CUDA arrays: packed into the flat buffers and scattered back with one launch
per dtype group, over a table of the leaves' addresses (the way apex's ``multi_tensor_apply``
works).

A tree of CuPy arrays or PyTorch tensors that are not views of one buffer is copied into the
flat buffers before an update and, for an in-place update, back after it. A copy per leaf is a
launch per leaf (about 45 us each in numba, plus about 50 us to convert each leaf into a numba
array); here one launch covers a dtype group. Block ``b`` takes chunks ``b, b + grid, ...`` of
the group's chunk table, each chunk a run of at most `chunk` elements of one leaf, and reads or
writes that leaf through its address (`numbaccum.arrays.device_pointers`, about a microsecond a
leaf on the host).

The chunk table depends only on the layout and is built once per layout. The address table is
the call's own: 8 bytes a leaf, copied to the device only when the addresses change (CuPy's and
PyTorch's allocators hand the same ones back step after step, and params never move), each
distinct table its own device array, so a launch still queued on another stream never sees a
table overwritten.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from numba import config, cuda, types

from .. import _config, formulas
from .._bounded import Bounded
from ..arrays import raw_bits, stream
from ..layout import Layout
from . import driver

__all__ = ["chunk", "pack_", "scatter_"]


# --- a leaf's memory from its address ---------------------------------------------------------


def _simulated_at(addr: int, n: int, dtype: Any) -> np.ndarray:
    """The simulator's twin of `_at`: its "device" arrays live in host memory, so the address
    is a host address and ``n`` elements of ``dtype`` there are a NumPy view."""
    dt = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (int(n) * dt.itemsize)).from_address(int(addr)), dt)


def _device_at() -> Any:
    from numba.core.extending import intrinsic

    @intrinsic
    def at(typingctx, addr, n, dtype):
        """``n`` elements of ``dtype`` at device address ``addr``, as a typed pointer that the
        kernel indexes like an array (``n`` is only for the simulator's twin)."""
        elem = dtype.dtype if isinstance(dtype, types.NumberClass) else dtype
        sig = types.CPointer(elem)(addr, n, dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return at


_at = _simulated_at if getattr(config, "ENABLE_CUDASIM", False) else _device_at()


# --- the kernels --------------------------------------------------------------------------------


def _copy_kernel(leaf_dtype: np.dtype, flat_dtype: np.dtype, to_flat: bool) -> Any:
    """For every chunk of leaf ``k`` (of ``leaf_dtype``): ``flat[where[k, 0] + i] = leaf_k[i]``
    (``to_flat``: the leaves into a group's run of the flat buffer, of ``flat_dtype``, converted
    on the store), or the reverse. ``to_flat`` is a closure constant: its branch folds away. A
    bfloat16 side is read and written as its raw bits (uint16, `_converter`)."""
    conv = _converter(leaf_dtype, flat_dtype) if to_flat else _converter(flat_dtype, leaf_dtype)
    dt = _U16 if leaf_dtype.kind == "V" else leaf_dtype.type

    @cuda.jit
    def copy(flat, ptrs, where, chunks, size):  # pragma: no cover - compiled
        c = cuda.blockIdx.x
        while c < chunks.shape[0]:
            k, s = chunks[c, 0], chunks[c, 1]
            lo, n = where[k, 0], where[k, 1]
            leaf = _at(ptrs[k], n, dt)
            i = s + cuda.threadIdx.x
            end = min(s + size, n)
            while i < end:
                if to_flat:
                    flat[lo + i] = conv(leaf[i])
                else:
                    leaf[i] = conv(flat[lo + i])
                i += cuda.blockDim.x
            c += cuda.gridDim.x

    return copy


_U16 = np.uint16


def _converter(src: np.dtype, dst: np.dtype) -> Any:
    """A device function: an element of dtype ``src`` as ``dst`` stores it, a bfloat16 one as its
    raw bits (widened exactly; rounded once, to nearest even, `numbaccum.formulas.to_bf16`)."""
    dev = cuda.jit(device=True, inline=True)
    if src == dst:
        return dev(lambda v: v)
    if src.kind == "V":
        t = dst.type
        from_bf16 = formulas.compile_formula(formulas.from_bf16, dev)
        return dev(lambda h: t(from_bf16(h)))
    if dst.kind == "V":
        if src == np.float64:
            return formulas.compile_formula(formulas.to_bf16_from64, dev)
        to_bf16 = formulas.compile_formula(formulas.to_bf16, dev)
        return dev(lambda v: to_bf16(np.float32(v)))
    t = dst.type
    return dev(lambda v: t(v))


_KERNELS: dict[tuple[str, np.dtype, np.dtype], Any] = {}


def _kernel(direction: str, leaf_dtype: np.dtype, flat_dtype: np.dtype) -> Any:
    """The ``"pack"`` or ``"scatter"`` kernel for leaves of ``leaf_dtype`` and a flat buffer of
    ``flat_dtype``, compiled on first use."""
    key = (direction, np.dtype(leaf_dtype), np.dtype(flat_dtype))
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = _copy_kernel(key[1], key[2], direction == "pack")
    return k


# --- tables -------------------------------------------------------------------------------------


def chunk() -> int:
    """Elements per chunk: 64 per thread of a block (16,384 at 256 threads), so a block's
    threads read a long coalesced run and a large leaf spreads over many blocks."""
    return _config.CUDA_THREADS * 64


class _Part:
    """The leaves of one dtype within one dtype group (a group holds leaves of one dtype unless
    the layout stores them in another): their leaf numbers, ``where`` (group offset, size) per
    leaf and the chunk table ``(leaf k, start)``, on the device."""

    __slots__ = ("group", "leaves", "dtype", "where", "chunks", "nchunks")

    def __init__(self, layout: Layout, g: int, js: list[int], size: int) -> None:
        members = layout.groups[g]
        offsets = layout.offsets[g]
        self.group = g
        self.leaves = np.array([members[j] for j in js], np.int64)
        self.dtype = layout.dtypes[members[js[0]]]
        where = np.array([(offsets[j], offsets[j + 1] - offsets[j]) for j in js], np.int64).reshape(-1, 2)
        chunks = [(k, s) for k, (_, n) in enumerate(where) for s in range(0, int(n), size)]
        self.nchunks = len(chunks)
        self.where = cuda.to_device(where)
        self.chunks = cuda.to_device(np.array(chunks, np.int64).reshape(-1, 2))


def _parts(layout: Layout) -> list[_Part]:
    """The layout's parts (per group and leaf dtype, non-empty leaves only), built once."""
    size = chunk()
    key = (layout, size)
    parts = _PARTS.get(key)
    if parts is None:
        parts = []
        for g, members in enumerate(layout.groups):
            by_dtype: dict[np.dtype, list[int]] = {}
            for j, leaf in enumerate(members):
                if layout.sizes[leaf]:
                    by_dtype.setdefault(layout.dtypes[leaf], []).append(j)
            parts.extend(_Part(layout, g, js, size) for js in by_dtype.values())
        parts = _PARTS.put(key, parts)
    return parts


_PARTS = Bounded()  # (layout, chunk) -> its parts
_ADDRESSES = Bounded()  # the bytes of an address table -> its device copy


def _addresses(ptrs: list[int], part: _Part) -> Any:
    """The part's leaf addresses on the device (copied once per distinct table)."""
    host = np.array([ptrs[i] for i in part.leaves], np.int64)
    key = host.tobytes()
    dev = _ADDRESSES.get(key)
    if dev is None:
        dev = _ADDRESSES.put(key, cuda.to_device(host, stream=stream()))
    return dev


def _run(direction: str, groups: tuple, layout: Layout, ptrs: list[int]) -> None:
    size = np.int64(chunk())
    for part in _parts(layout):
        blocks = max(1, min(part.nchunks, _config.CUDA_MAX_BLOCKS))
        flat = groups[part.group]
        args = (raw_bits(flat), _addresses(ptrs, part), part.where, part.chunks, size)
        driver.LAUNCHES[0] += 1
        _kernel(direction, part.dtype, flat.dtype)[blocks, _config.CUDA_THREADS, stream()](*args)


def pack_(groups: tuple, layout: Layout, ptrs: list[int]) -> None:
    """Copies the leaves at device addresses ``ptrs`` (one per leaf of ``layout``, as
    `numbaccum.arrays.device_pointers` reads them) into ``groups`` (a FlatTree's group views),
    one launch per group (per leaf dtype within a group), on the current stream."""
    _run("pack", groups, layout, ptrs)


def scatter_(groups: tuple, layout: Layout, ptrs: list[int]) -> None:
    """Copies ``groups`` back into the leaves at ``ptrs``: the inverse of `pack_`."""
    _run("scatter", groups, layout, ptrs)
