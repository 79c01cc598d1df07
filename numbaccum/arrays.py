"""Array interop, in one place: which arrays live on a CUDA device, zero-copy views between
NumPy, numba, CuPy and PyTorch, device memory, pointers and the caller's stream.

Any array exposing ``__cuda_array_interface__`` (CuPy, PyTorch, numba) is viewed as a numba
device array with ``sync=False``: numba would otherwise synchronise on the producer's stream at
every conversion. Kernels are launched on the stream of the caller's framework (its current
stream), so the order with the caller's own work is kept without a host synchronisation. Results
go back as the caller's array type, again without a copy.

``numba.cuda`` (and torch, CuPy) are imported only inside the functions that need them, so
``import numbaccum`` and a NumPy-only program never import them. The storage layer
(`numbaccum.flat`) and the kernels of both backends call this module; it imports neither.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from . import tree as _tree
from .layout import FLOATS, Layout, check_float_dtype

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = [
    "INSTALL_HINT",
    "STREAM_KINDS",
    "as_device_array",
    "as_kind",
    "copy_",
    "cuda_api",
    "cuda_available",
    "data_pointer",
    "device_leaves",
    "device_pointers",
    "empty",
    "is_contiguous",
    "is_cuda_array",
    "is_device_array",
    "kind_of",
    "launch_context",
    "on_device",
    "on_stream",
    "raw_bits",
    "run_view",
    "simulated",
    "runs_of",
    "stream",
    "stream_handle",
    "to_device",
    "to_host",
    "view_from_pointer",
]

INSTALL_HINT = (
    "numbaccum's CUDA backend needs a working CUDA driver and numba-cuda that can compile "
    "kernels with your NumPy: pip install 'numbaccum[cuda]' (the CUDA 12 toolkit; 'numbaccum[cuda13]' "
    "for CUDA 13's; numba-cuda 0.30 needs numpy<2.5)"
)

STREAM_KINDS = ("cupy", "torch")  # array types whose current CUDA stream an update runs on

# The types of numba's device arrays, real and simulated: under NUMBA_ENABLE_CUDASIM=1 they have
# no ``__cuda_array_interface__``, so they are told by type (else the CUDA pass would silently
# run the CPU path).
_DEVICE_ARRAY_TYPES = ("DeviceNDArray", "FakeCUDAArray", "MappedNDArray", "ManagedNDArray")

_state = threading.local()  # the stream of the update running on this thread


# --- what an array is -------------------------------------------------------------------------


def is_cuda_array(x: Any) -> bool:
    """True for arrays that live on a CUDA device (without importing numba.cuda). An interface
    that raises (PyTorch's, for a bfloat16 CUDA tensor: the interface has no such dtype) counts:
    the array is on a device, and reading it then says why it cannot be read."""
    try:
        return hasattr(x, "__cuda_array_interface__") or type(x).__module__.startswith("numba.cuda")
    except Exception:
        return True


def is_device_array(x: Any) -> bool:
    """A numba device array (real or simulated)."""
    return type(x).__name__ in _DEVICE_ARRAY_TYPES


def on_device(x: Any) -> bool:
    """Whether a leaf as the storage layer holds it (a NumPy array or a numba device array)
    lives on a CUDA device."""
    return not isinstance(x, np.ndarray)


def kind_of(x: Any) -> str:
    """Which array type the caller uses: 'numba', 'cupy' or 'torch' for a CUDA array, 'numpy' for
    anything on the host (NumPy, and what NumPy reads: scalars, JAX CPU arrays, CPU tensors)."""
    if not is_cuda_array(x):
        return "numpy"
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    if isinstance(x, (np.ndarray, np.generic)):
        return "numpy"
    return "numba"


def is_contiguous(x: Any) -> bool:
    """Whether a NumPy or numba device array is C-contiguous."""
    return bool(x.flags.c_contiguous) if isinstance(x, np.ndarray) else bool(x.is_c_contiguous())


# --- numba.cuda, device memory and views ----------------------------------------------------


def cuda_api() -> Any:
    """``numba.cuda``, imported on first use; RuntimeError with the install hint when it cannot
    be imported. (Whether kernels compile here is checked once by `numbaccum.cuda.device`,
    before the first kernel runs.)"""
    try:
        from numba import cuda
    except Exception as e:  # pragma: no cover - depends on the installation
        raise RuntimeError(f"{INSTALL_HINT} (importing numba.cuda failed: {e})") from e
    return cuda


def simulated() -> bool:
    """Whether numba's CUDA simulator stands in for the GPU (``NUMBA_ENABLE_CUDASIM=1``)."""
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def cuda_available() -> bool:
    """Whether numba.cuda imports and finds a device (or the simulator) here."""
    try:
        from numba import cuda
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return bool(cuda.is_available())


def as_device_array(x: Any) -> Any:
    """A zero-copy numba view of a CUDA array (no synchronisation on its stream)."""
    if is_device_array(x):
        return x
    bf16 = _torch_bfloat16(x)
    if bf16 is not None:  # the interface has no bfloat16: its bits, viewed as ml_dtypes' type
        return cuda_api().as_cuda_array(x.view(bf16[0].int16), sync=False).view(bf16[1])
    return cuda_api().as_cuda_array(x, sync=False)


def _torch_bfloat16(x: Any) -> tuple[Any, np.dtype] | None:
    """``(torch, ml_dtypes' bfloat16 dtype)`` for a ``torch.bfloat16`` tensor, else None."""
    if type(x).__module__.split(".")[0] != "torch" or str(getattr(x, "dtype", "")) != "torch.bfloat16":
        return None
    import torch

    return torch, check_float_dtype("bfloat16", "a torch.bfloat16 tensor")


def as_kind(x: Any, kind: str) -> Any:
    """A zero-copy view of the device array ``x`` as the caller's array type ``kind`` ('cupy',
    'torch'; any other kind gives ``x`` itself)."""
    if kind == "cupy":
        import cupy

        return cupy.asarray(x)
    if kind == "torch":
        import torch

        if x.dtype.kind == "V":  # bfloat16: torch reads its bits as int16 (the interface has no bfloat16)
            return torch.as_tensor(x.view(np.int16), device="cuda").view(torch.bfloat16)
        return torch.as_tensor(x, device="cuda")
    return x


def data_pointer(x: Any) -> int | None:
    """Address of ``x``'s first element: in host memory for a NumPy array, on the device for a
    CUDA array (None in the simulator, which has no device addresses)."""
    if isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0])
    try:
        return int(x.device_ctypes_pointer.value or 0)  # 0.2 us; the interface dict costs 2.3 us
    except AttributeError:
        cai = getattr(x, "__cuda_array_interface__", None)
        return None if cai is None else int(cai["data"][0])


def view_from_pointer(ptr: int, n: int, dtype: np.dtype, owner: Any) -> Any:
    """A 1-D device array of ``n`` elements at device address ``ptr``, kept alive by ``owner``."""
    dtype = np.dtype(dtype)
    desc = {
        "shape": (n,),
        "typestr": _raw(dtype).str,
        "data": (ptr, False),
        "version": 3,
        "strides": None,
    }
    return _logical(cuda_api().from_cuda_array_interface(desc, owner=owner, sync=False), dtype)


def empty(n: int, dtype: DTypeLike) -> Any:
    """An uninitialised 1-D device array, allocated in the order of the current stream."""
    dtype = np.dtype(dtype)
    return _logical(cuda_api().device_array(n, _raw(dtype), stream=stream()), dtype)


def to_device(x: np.ndarray) -> Any:
    """A device copy of the host array ``x``, on the current stream."""
    x = np.ascontiguousarray(x)
    return _logical(cuda_api().to_device(x.view(_raw(x.dtype)), stream=stream()), x.dtype)


# numba has no bfloat16 type: a bfloat16 device buffer is a numba device array whose dtype is
# ml_dtypes' bfloat16 (numba types an array only when a kernel takes it), allocated, copied and
# viewed as its raw bits, uint16, and passed to every kernel as a uint16 view
# (`numbaccum.cuda.driver` widens each element to float32 and rounds once when it stores).


def _raw(dtype: np.dtype) -> np.dtype:
    """The dtype numba allocates and types for ``dtype``: uint16 for bfloat16, else itself."""
    return _U16 if dtype.kind == "V" else dtype


def _logical(x: Any, dtype: np.dtype) -> Any:
    """Device array ``x`` (of dtype `_raw` of ``dtype``) as an array of ``dtype`` (a view)."""
    return x.view(dtype) if dtype.kind == "V" else x


def raw_bits(x: Any) -> Any:
    """What a kernel takes for device (or host) array ``x``: a bfloat16 one's uint16 view, else
    ``x``."""
    return x.view(_U16) if x.dtype.kind == "V" else x


_U16 = np.dtype(np.uint16)


def to_host(x: Any) -> np.ndarray:
    """A host copy of the device array ``x``, on the current stream."""
    return x.copy_to_host(stream=stream())


def copy_(dst: Any, src: Any) -> None:
    """``dst[...] = src`` from host to device or device to host (same size and dtype): one
    transfer on the current stream."""
    if isinstance(dst, np.ndarray):
        src.copy_to_host(dst, stream=stream())
    else:
        dst.copy_to_device(src, stream=stream())


class DeviceScalar:
    """A number that a kernel left on the device (a clip's norm), read only when asked:
    ``float(x)`` or ``bool(x)`` copies it to the host, which waits for the stream; nothing before.
    ``value`` is the 1-element device array. A copy or a pickle holds the host value (a NumPy
    scalar of ``dtype``), as does a checkpoint."""

    __slots__ = ("value", "dtype")

    def __init__(self, value: Any, dtype: Any) -> None:
        self.value = value
        self.dtype = np.dtype(dtype)

    def host(self) -> np.generic:
        """The value as a NumPy scalar of ``dtype`` (a synchronisation)."""
        return self.dtype.type(to_host(self.value)[0])

    def __float__(self) -> float:
        return float(self.host())

    def __bool__(self) -> bool:
        return bool(self.host())

    def __reduce__(self) -> Any:
        return (self.dtype.type, (self.host(),))

    def __repr__(self) -> str:
        return f"DeviceScalar({self.dtype.name}, on the device)"


# --- streams ----------------------------------------------------------------------------------


def stream() -> Any:
    """The stream kernels are launched on: the caller's, or the default stream (0)."""
    return getattr(_state, "stream", 0)


def stream_handle(s: Any) -> int:
    """The CUDA handle of a numba stream (0 for the default stream)."""
    if isinstance(s, int):
        return s
    h = s.handle
    return int(h.value or 0) if hasattr(h, "value") else int(h)


class on_stream:
    """Context: launch on the current stream of the framework ``kind`` ('cupy' or 'torch')."""

    def __init__(self, kind: str) -> None:
        self._ptr = _framework_stream(kind)

    def __enter__(self) -> None:
        self._old = getattr(_state, "stream", 0)
        if self._ptr:
            _state.stream = cuda_api().external_stream(self._ptr)

    def __exit__(self, *exc: Any) -> None:
        _state.stream = self._old


def _framework_stream(kind: str) -> int:
    if kind == "torch":
        import torch

        return int(torch.cuda.current_stream().cuda_stream)
    if kind == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def launch_context(kind: str) -> Any:
    """Where an update's kernels go: the caller's current stream for CuPy and PyTorch arrays."""
    if kind in STREAM_KINDS:
        return on_stream(kind)
    return contextlib.nullcontext()


# --- leaves that are views of one buffer --------------------------------------------------------


def run_view(leaves: list[Any], layout: Layout, g: int) -> Any:
    """A 1-D view of group ``g``'s run of memory when its leaves (NumPy arrays, or numba device
    arrays) are exactly consecutive views of one buffer, as the ``.tree`` of a FlatTree is; else
    None."""
    dt = layout.group_dtypes[g]
    offsets = layout.offsets[g]
    first: Any = None
    start = 0  # address of the group's first element
    for j, leaf in enumerate(layout.groups[g]):
        x = leaves[leaf]
        if x.size == 0:  # holds no data; it may be placed anywhere
            continue
        if first is None and isinstance(x, np.ndarray) and x.base is None:
            return None  # owns its memory: not a view into a flat buffer (a plain tree's leaf)
        addr = data_pointer(x)
        if addr is None or x.dtype != dt:
            return None
        if first is None:
            first = x
            start = addr - int(offsets[j]) * dt.itemsize
        elif addr - start != int(offsets[j]) * dt.itemsize:
            return None
        if isinstance(x, np.ndarray):
            if x.base is not first.base or not x.flags.c_contiguous:
                return None
        elif not x.is_c_contiguous():
            return None
    if first is None:
        return None
    n = layout.group_sizes[g]
    if not isinstance(first, np.ndarray):
        # The leaves sit back to back, so one view spans them; used only within this call.
        return view_from_pointer(start, n, dt, owner=first)
    base = first.base
    if not isinstance(base, np.ndarray) or base.ndim != 1 or base.dtype != dt or not base.flags.c_contiguous:
        return None
    lo, rem = divmod(start - data_pointer(base), dt.itemsize)  # type: ignore[operator]
    if rem or lo < 0 or lo + n > base.size:
        return None
    return base[lo : lo + n]


# --- trees of separate CUDA arrays: each leaf's address, read off its own attributes ----------
#
# Converting a leaf through ``__cuda_array_interface__`` into a numba device array costs about
# 50 us (7 ms a call for GPT-2 small's 148 leaves, around a 0.7 ms update). The address, shape,
# dtype and contiguity are all an update needs to pack the leaves with one launch over a table of
# addresses (`numbaccum.cuda.leaves`): each array type's own attributes give them in about a
# microsecond a leaf.

_TORCH_DTYPES: dict[Any, np.dtype] = {}


def _torch_dtype(dt: Any) -> np.dtype | None:
    if not _TORCH_DTYPES:
        import torch

        _TORCH_DTYPES.update({torch.float16: FLOATS[0], torch.float32: FLOATS[1], torch.float64: FLOATS[2]})
    if dt not in _TORCH_DTYPES and str(dt) == "torch.bfloat16":  # ml_dtypes imported only for one
        _TORCH_DTYPES[dt] = check_float_dtype("bfloat16", "a torch.bfloat16 leaf")
    return _TORCH_DTYPES.get(dt)


def _torch_leaf(x: Any) -> tuple | None:
    if not x.is_cuda or not x.is_contiguous():
        return None
    return x.data_ptr(), tuple(x.shape), _torch_dtype(x.dtype), x.get_device()


def _cupy_leaf(x: Any) -> tuple | None:
    if not x.flags.c_contiguous:
        return None
    return x.data.ptr, x.shape, x.dtype, x.device.id


def _numba_leaf(x: Any) -> tuple | None:
    if not x.is_c_contiguous():
        return None
    ary = getattr(x, "_ary", None)  # the simulator's array: its address is in host memory
    ptr = int(x.device_ctypes_pointer.value or 0) if ary is None else ary.__array_interface__["data"][0]
    return ptr, x.shape, x.dtype, 0


def _interface_leaf(x: Any) -> tuple | None:
    cai = x.__cuda_array_interface__
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    dt = np.dtype(cai["typestr"])
    if strides is not None and tuple(strides) != _c_strides(shape, dt.itemsize):
        return None
    return int(cai["data"][0]), shape, dt, 0


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    out, step = [], itemsize
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def host_bfloat16(x: Any) -> np.ndarray | None:
    """A bfloat16 NumPy view of a CPU ``torch.bfloat16`` tensor (NumPy reads no such tensor: its
    bits are read as int16 and viewed as ml_dtypes' bfloat16), else None."""
    if type(x).__module__.split(".")[0] != "torch" or str(getattr(x, "dtype", "")) != "torch.bfloat16":
        return None
    if x.device.type != "cpu":
        return None
    import ml_dtypes
    import torch

    return x.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def _leaf_reader(x: Any) -> Any:
    mod = type(x).__module__
    if mod.startswith("torch"):
        return _torch_leaf
    if mod.startswith("cupy"):
        return _cupy_leaf
    if is_device_array(x):
        return _numba_leaf
    try:
        return _interface_leaf if hasattr(x, "__cuda_array_interface__") else None
    except Exception:  # an interface that fails: the general path says why (`flat._as_leaf`)
        return None


def device_pointers(tree: Any, layout: Layout) -> list[int] | None:
    """Each leaf's device address (0 for an empty leaf) when ``tree`` is a plain tree of CUDA
    arrays of one type (numba, CuPy, PyTorch or any ``__cuda_array_interface__``) with exactly
    the structure, shapes and dtypes of ``layout``, each C-contiguous and all on one device;
    else None, and the general path packs the tree or names what differs.

    Read off each array's own attributes, about a microsecond a leaf: no conversion, no
    synchronisation. In the simulator the address is that of the host memory behind the
    simulated array."""
    found = device_leaves(tree, layout)
    return None if found is None else found[0]


def device_leaves(tree: Any, layout: Layout) -> tuple[list[int], list[Any]] | None:
    """`device_pointers` and the leaves they were read from."""
    if isinstance(tree, np.ndarray) or not layout.num_leaves:
        return None
    raw = _tree.leaves_if_structure(tree, layout.treedef)
    if not raw:
        return None
    facts = device_facts(raw)
    if facts is None:
        return None
    ptrs, shapes, dtypes = facts
    if list(zip(shapes, dtypes)) != layout.shapes_dtypes:
        return None
    return [p if n else 0 for p, n in zip(ptrs, layout.sizes)], raw


def device_facts(leaves: list[Any]) -> tuple[tuple, tuple, tuple] | None:
    """``(addresses, shapes, dtypes)`` of CUDA arrays of one type, each C-contiguous and all on
    one device, read off their own attributes; None for anything else (NumPy arrays, mixed
    types, a strided array), which the general path handles or names."""
    read = _leaf_reader(leaves[0])
    if read is None:
        return None
    try:
        facts = [read(x) for x in leaves]
    except AttributeError:  # an array of another type among them
        return None
    if None in facts:
        return None
    ptrs, shapes, dtypes, devices = zip(*facts)
    if devices.count(devices[0]) != len(devices):
        return None
    return ptrs, shapes, dtypes


def runs_of(ptrs: list[int], layout: Layout) -> list[int] | None:
    """Per dtype group, the address of its run of memory when the leaves at ``ptrs`` sit back to
    back in group order (what ``FlatTree.tree_as`` hands out), else None (always in the
    simulator, whose addresses are host memory that no device view can be made of)."""
    if simulated():
        return None
    runs = []
    for g, members in enumerate(layout.groups):
        at, offsets, size = None, layout.offsets[g], layout.group_dtypes[g].itemsize
        for j, leaf in enumerate(members):
            if not layout.sizes[leaf]:  # holds no data; it may be placed anywhere
                continue
            if layout.dtypes[leaf] != layout.group_dtypes[g]:
                return None
            start = ptrs[leaf] - int(offsets[j]) * size
            if at is None:
                at = start
            elif start != at:
                return None
        if at is None:
            return None
        runs.append(at)
    return runs
