"""The CUDA driver: compiles the formulas of `numbaccum.formulas` into ``numba.cuda`` kernels.

Each formula becomes a grid-stride kernel with int64 indices (a flat float32 buffer passes 2**31
elements at 2B parameters), launched on the caller's stream (`numbaccum.arrays.stream`),
once per call: one launch per operation and dtype group, never per leaf. float32 buffers are
walked two elements per 8-byte access: the kernel views the even part of each buffer as
complex64 pairs (thread 0 takes an odd last element). Measured on an H100 over 1.56B elements
(`benchmarks/cuda_variants.py`): the mean-accumulate mini-step reads and writes at 0.93 of a
device-to-device copy this way, 0.87 with four float32 loads in flight per thread.

A kernel is compiled per formula, pending-factor mode (0: none, two divisions saved; 1: host
``div, mul``; 2: ``[div, mul]`` read from the device, a clip whose norm never left the GPU) and
width (pairs or one element per access). Mode and width are closure constants, so their branches
fold away at compile time (a per-element branch on the mode cost 15% of the mini-step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from .. import _cache, _config, _locks, formulas
from ..arrays import data_pointer, raw_bits, stream
from ..contract import Factor
from ..formulas import Formula, compile_formula
from ..layout import compute_dtype, real_dtype
from .cache import cached

__all__ = ["LAUNCHES", "NAME", "launch", "map_", "start"]

NAME = "cuda"
LAUNCHES = [0]  # kernel launches so far (tests count them per update)


def grid(n: int) -> tuple[int, int]:
    """Blocks and threads per block for ``n`` grid-stride items (read at call time)."""
    tpb = _config.CUDA_THREADS
    return max(1, min(_config.CUDA_MAX_BLOCKS, -(-n // tpb))), tpb


def launch(kernel: Any, work: int, args: tuple) -> None:
    """One launch with enough blocks for ``work`` grid-stride items (none when there is none)."""
    if work == 0:
        return
    blocks, tpb = grid(work)
    LAUNCHES[0] += 1
    kernel[blocks, tpb, stream()](*args)


def _start() -> tuple[Any, Any]:  # pragma: no cover - compiled
    """First index and stride of a grid-stride loop, as int64."""
    i = np.int64(cuda.blockIdx.x) * np.int64(cuda.blockDim.x) + np.int64(cuda.threadIdx.x)  # type: ignore[arg-type]
    return i, np.int64(cuda.gridDim.x) * np.int64(cuda.blockDim.x)  # type: ignore[arg-type]


start = cuda.jit(device=True)(_start)


@cuda.jit(device=True, inline=True)
def read(v, div, mul, fac, mode):  # pragma: no cover - compiled
    """The pending factor on a read: none (mode 0), ``(v / div) * mul`` (mode 1), or
    ``(v / fac[0]) * fac[1]`` with the factor on the device (mode 2)."""
    if mode == 1:
        return (v / div) * mul
    if mode == 2:
        return (v / fac[0]) * fac[1]
    return v


@cuda.jit(device=True, inline=True)
def read_complex(v, div, mul, fac, mode):  # pragma: no cover - compiled
    """`read` of a complex v: divided by the real divisor part by part (`formulas.complex_quot`:
    the CPU's bits, and no complex division)."""
    if mode == 1:
        return complex(v.real / div, v.imag / div) * mul
    if mode == 2:
        return complex(v.real / fac[0], v.imag / fac[0]) * fac[1]
    return v


@cuda.jit(device=True, inline=True)
def pairs_of(x, n):  # pragma: no cover - compiled
    """The first ``n - n % 2`` elements of a float32 buffer as complex64 pairs."""
    return x[: n - n % 2].view(np.complex64)


# --- code generation --------------------------------------------------------------------------

_KERNEL = """
def make(mode, pairs):
    @jit
    def kernel(n, {arrays}, div, mul, fac, {scalars}):
        i, step = start()
        if pairs:
{pair_views}
            j = i
            while j < (n - n % 2) // 2:
{pair_loads}
                ra = fn({args_re})
                rb = fn({args_im})
{pair_stores}
                j += step
            i = n - 1 if i == 0 and n % 2 else n
        while i < n:
            r = fn({args})
{stores}
            i += step

    return kernel
"""


def _source(f: Formula, bf16: tuple = (), narrow: str = "to_bf16") -> str:
    """The generated kernel factory of formula ``f`` (Python source). ``bf16``: which arrays are
    bfloat16 (passed as their raw bits, uint16: each element widened to float32 when read,
    `formulas.from_bf16`, and rounded once when stored, by ``narrow``: `formulas.to_bf16`, or
    `to_bf16_from64` from a float64 computation); empty: none."""
    bf16 = bf16 or (False,) * len(f.arrays)
    arrays = [f"a{i}" for i in range(len(f.arrays))]
    scalars = [f"p{i}" for i in range(len(f.scalars))] or ["_unused"]
    ns, ni = len(f.states), len(f.inputs)
    reads_read = list(range(ns + ni))  # the arrays a formula reads: states and inputs
    written = list(f.writes)
    pad = " " * 12
    pair_views = "\n".join(f"{pad}w{i} = pairs_of({a}, n)" for i, a in enumerate(arrays))
    pair_loads = "\n".join(f"{pad}    u{i} = w{i}[j]" for i in reads_read) or f"{pad}    pass"
    p = [f"p{i}" for i in range(len(f.scalars))]

    def args(part: str | None) -> str:
        vals = []
        for i in reads_read:
            v = f"u{i}.{part}" if part else f"from_bf16(a{i}[i])" if bf16[i] else f"a{i}[i]"
            vals.append(f"read({v}, div, mul, fac, mode)" if i == ns else v)
        # An indexed formula's element index: a pair's two elements are 2j and 2j + 1.
        index = {"real": ["2 * j"], "imag": ["2 * j + 1"], None: ["i"]}[part] if f.indexed else []
        return ", ".join(vals + p + index)

    values = ["r"] if len(written) == 1 else [f"r[{k}]" for k in range(len(written))]
    if len(written) == 1:
        pair_stores = f"{pad}    w{written[0]}[j] = complex(ra, rb)"
    else:
        pair_stores = "\n".join(
            f"{pad}    w{w}[j] = complex(ra[{k}], rb[{k}])" for k, w in enumerate(written)
        )
    stores = "\n".join(
        f"{pad}a{w}[i] = {narrow}({r})" if bf16[w] else f"{pad}a{w}[i] = {r}" for w, r in zip(written, values)
    )
    return _KERNEL.format(
        arrays=", ".join(arrays),
        scalars=", ".join(scalars),
        pair_views=pair_views,
        pair_loads=pair_loads,
        args_re=args("real"),
        args_im=args("imag"),
        pair_stores=pair_stores,
        args=args(None),
        stores=stores,
    )


def _cached_jit(fn: Any) -> Any:
    return cached(cuda.jit(fn))


class _Family:
    """One formula's kernels, compiled on first use per (mode, pairs); a complex family (over
    complex buffers) compiles the formula with `numbaccum.formulas.COMPLEX_HELPERS`; a bfloat16
    family (``bf16``: which arrays are bfloat16, ``narrow``: how a value is rounded to one) reads
    and writes those arrays' raw bits (`_source`)."""

    def __init__(self, f: Formula, complex_: bool = False, bf16: tuple = (), narrow: str = "to_bf16") -> None:
        # With the kernel cache on, the generated module is a file in the cache (numba caches only
        # functions with a source file), named by a hash of its source and of ``f``. A complex
        # family's source says so: its helpers differ, so it never shares the real one's file.
        kind = " (complex helpers)" if complex_ else ""
        source = f"# numbaccum.cuda.driver: the kernels of formula {f.name}{kind}\n{_source(f, bf16, narrow)}"
        digest = _cache.code_digest(f)
        path = _cache.source_file(source, f"cuda_{f.name}", f"cuda\0{digest}") if digest else None
        ns = _cache.namespace(path, f"<numbaccum.cuda.driver {f.name}>")
        ns.update(
            cuda=cuda,
            jit=_cached_jit if path else cuda.jit,
            fn=compile_formula(f.fn, cuda.jit(device=True, inline=True), complex=complex_),
            read=read_complex if complex_ else read,
            pairs_of=pairs_of,
            start=start,
            **(formulas.bf16_conversions(cuda.jit(device=True, inline=True), _BF16) if bf16 else {}),
        )
        exec(compile(source, ns["__file__"], "exec"), ns)
        self._make = ns["make"]
        self._kernels: dict[tuple[int, bool], Any] = {}

    def kernel(self, mode: int, pairs: bool) -> Any:
        k = self._kernels.get((mode, pairs))
        if k is None:
            k = self._kernels[(mode, pairs)] = self._make(mode, pairs)
        return k


_FAMILIES: dict[tuple, _Family] = {}
_LOCK = _locks.lock()
_DUMMY: dict[np.dtype, Any] = {}
_BF16: dict[str, Any] = {}  # the bfloat16 conversions of a kernel (`formulas.bf16_conversions`)


def _family(f: Formula, complex_: bool = False, bf16: tuple = (), narrow: str = "to_bf16") -> _Family:
    key = (f, complex_, bf16, narrow)
    fam = _FAMILIES.get(key)
    if fam is None:
        with _LOCK:
            fam = _FAMILIES.get(key)
            if fam is None:
                fam = _FAMILIES[key] = _Family(f, complex_, bf16, narrow)
    return fam


def aligned(x: Any) -> bool:
    """Whether float32 pairs can be read from ``x`` (an 8-byte aligned start)."""
    ptr = data_pointer(x)
    return ptr is None or ptr % 8 == 0


def factor_args(factor: Factor, ctype: np.dtype) -> tuple[Any, Any, Any, int]:
    """Kernel arguments ``div, mul, fac, mode`` of a pending factor in compute dtype ``ctype``."""
    if factor.device is not None:
        one = ctype.type(1)
        return one, one, factor.device[ctype], 2
    dummy = _DUMMY.get(ctype)
    if dummy is None:
        dummy = _DUMMY[ctype] = cuda.device_array(2, ctype)  # never read in modes 0 and 1
    mode = int(not (factor.div == 1.0 and factor.mul == 1.0))
    return ctype.type(factor.div), ctype.type(factor.mul), dummy, mode


def map_(f: Formula, factor: Factor, arrays: tuple, scalars: tuple) -> None:
    """Runs formula ``f`` over the device ``arrays`` (states, inputs, outputs; one size), reading
    the first input through ``factor``; scalars cast to the compute dtype (bools and uint32
    words stay as they are)."""
    kinds = {a.dtype for a in arrays}
    bf16: tuple = ()
    narrow = "to_bf16"
    if any(d.kind == "V" for d in kinds):  # bfloat16: computed in float32 (or float64) on its bits
        ctype = compute_dtype(*kinds)
        bf16 = tuple(a.dtype.kind == "V" for a in arrays)
        narrow = "to_bf16_from64" if ctype == np.float64 else narrow
        arrays = tuple(raw_bits(a) for a in arrays)
    else:
        ctype = np.result_type(*kinds)
    complex_ = ctype.kind == "c"
    real = real_dtype(ctype)  # a complex call's scalars and factor are real, as on the CPU
    cast = real.type
    run_scalars = [s if isinstance(s, (bool, np.bool_, np.uint32)) else cast(s) for s in scalars] or [False]
    div, mul, fac, mode = factor_args(factor, real)
    pairs = all(a.dtype == np.float32 and aligned(a) for a in arrays)
    kernel = _family(f, complex_, bf16, narrow).kernel(mode, pairs)
    n = arrays[0].size
    launch(kernel, (n + 1) // 2 if pairs else n, (n, *arrays, div, mul, fac, *run_scalars))


def prepare(f: Formula, arrays: tuple) -> Any:
    """`map_` of formula ``f`` over these very device ``arrays``, as ``launch(factor, scalars)``
    (the CPU driver's twin; a launch here is derived from its arguments each time)."""
    return lambda factor, scalars: map_(f, factor, arrays, scalars)
