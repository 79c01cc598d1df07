"""The kernel contract on CUDA: ``numba.cuda`` kernels over flat 1-D device buffers.

Same names and signatures as `numbaccum.cpu`. Elementwise kernels are grid-stride loops with
int64 indices (a flat float32 buffer passes 2**31 elements at 2B parameters). Every kernel is
launched on `stream()` (the caller's stream, see `numbaccum.arrays`), once per call: one
launch per operation and dtype group, never per leaf. Reductions (``sumsq``, ``segment_*``, the
clip factor) are the one reduction engine, `numbaccum.cuda.reduce`, under their transitional
names; they return host values (a synchronisation), except the clip factor, which stays on the
device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

from .. import _config
from ..arrays import data_pointer, stream
from ..tables import segments, whole
from . import reduce as _engine

LAUNCHES = [0]  # kernel launches so far (tests count them per update)


def _grid(n: int) -> tuple[int, int]:
    tpb = _config.CUDA_THREADS
    return max(1, min(_config.CUDA_MAX_BLOCKS, -(-n // tpb))), tpb


def _launch(kernel: Any, work: int, args: tuple) -> None:
    """One launch with enough blocks for ``work`` grid-stride items (none when there is none)."""
    if work == 0:
        return
    blocks, tpb = _grid(work)
    LAUNCHES[0] += 1
    kernel[blocks, tpb, stream()](*args)


def _start() -> tuple[Any, Any]:
    """First index and stride of a grid-stride loop, as int64."""
    i = np.int64(cuda.blockIdx.x) * np.int64(cuda.blockDim.x) + np.int64(cuda.threadIdx.x)  # type: ignore[arg-type]
    return i, np.int64(cuda.gridDim.x) * np.int64(cuda.blockDim.x)  # type: ignore[arg-type]


_start_device = cuda.jit(device=True)(_start)


# --- elementwise ----------------------------------------------------------------------------
#
# Each operation is a formula on scalars (a device function) walked over the buffers by one of
# five memory patterns. float32 buffers are walked two elements per 8-byte access: the kernel
# views the even part of each buffer as complex64 pairs (thread 0 takes an odd last element).
# Measured on an H100 over 1.56B elements (`benchmarks/cuda_variants.py`): the mean-accumulate
# mini-step reads and writes at 0.93 of a device-to-device copy this way, 0.87 with four float32
# loads in flight per thread. The pending factor ``(g / div) * mul`` applies to the gradient input.


@cuda.jit(device=True, inline=True)
def _in(v, div, mul, fac, mode):  # pragma: no cover - compiled
    """The pending factor on a read: none (mode 0, two divisions saved), ``(v / div) * mul``
    (mode 1), or ``(v / fac[0]) * fac[1]`` with the factor on the device (mode 2: a clip whose
    norm never left the GPU)."""
    if mode == 1:
        return (v / div) * mul
    if mode == 2:
        return (v / fac[0]) * fac[1]
    return v


def _pairs(x, n):  # pragma: no cover - compiled
    """The first ``n - n % 2`` elements of a float32 buffer as complex64 pairs."""
    return x[: n - n % 2].view(np.complex64)


_pairs_device = cuda.jit(device=True, inline=True)(_pairs)


def _unary(f):
    """``out = f(g, p)`` for out, g (scale, clip, zero_nans)."""

    def make(mode, pairs):  # pragma: no cover - compiled per mode and width
        @cuda.jit
        def kernel(n, out, g, div, mul, fac, p):
            i, step = _start_device()
            if pairs:
                out2, g2 = _pairs_device(out, n), _pairs_device(g, n)
                j = i
                while j < out2.size:
                    v = g2[j]
                    a = f(_in(v.real, div, mul, fac, mode), p)
                    b = f(_in(v.imag, div, mul, fac, mode), p)
                    out2[j] = complex(a, b)
                    j += step
                i = n - 1 if i == 0 and n % 2 else n
            while i < n:
                out[i] = f(_in(g[i], div, mul, fac, mode), p)
                i += step

        return kernel

    return make


def _binary(f):
    """``out = f(g, y, p)`` for out, g, y (add_scaled)."""

    def make(mode, pairs):  # pragma: no cover - compiled per mode and width
        @cuda.jit
        def kernel(n, out, g, y, div, mul, fac, p):
            i, step = _start_device()
            if pairs:
                out2, g2, y2 = _pairs_device(out, n), _pairs_device(g, n), _pairs_device(y, n)
                j = i
                while j < out2.size:
                    v, w = g2[j], y2[j]
                    a = f(_in(v.real, div, mul, fac, mode), w.real, p)
                    b = f(_in(v.imag, div, mul, fac, mode), w.imag, p)
                    out2[j] = complex(a, b)
                    j += step
                i = n - 1 if i == 0 and n % 2 else n
            while i < n:
                out[i] = f(_in(g[i], div, mul, fac, mode), y[i], p)
                i += step

        return kernel

    return make


def _accumulate(f):
    """``acc = f(acc, g, p)`` in place (mean and sum accumulation)."""

    def make(mode, pairs):  # pragma: no cover - compiled per mode and width
        @cuda.jit
        def kernel(n, acc, g, div, mul, fac, p):
            i, step = _start_device()
            if pairs:
                acc2, g2 = _pairs_device(acc, n), _pairs_device(g, n)
                j = i
                while j < acc2.size:
                    u, v = acc2[j], g2[j]
                    a = f(u.real, _in(v.real, div, mul, fac, mode), p)
                    b = f(u.imag, _in(v.imag, div, mul, fac, mode), p)
                    acc2[j] = complex(a, b)
                    j += step
                i = n - 1 if i == 0 and n % 2 else n
            while i < n:
                acc[i] = f(acc[i], _in(g[i], div, mul, fac, mode), p)
                i += step

        return kernel

    return make


def _stateful(f):
    """``state, out = f(state, g, p)`` (trace, ema)."""

    def make(mode, pairs):  # pragma: no cover - compiled per mode and width
        @cuda.jit
        def kernel(n, state, g, out, div, mul, fac, p):
            i, step = _start_device()
            if pairs:
                s2, g2, out2 = _pairs_device(state, n), _pairs_device(g, n), _pairs_device(out, n)
                j = i
                while j < s2.size:
                    u, v = s2[j], g2[j]
                    sa, oa = f(u.real, _in(v.real, div, mul, fac, mode), p)
                    sb, ob = f(u.imag, _in(v.imag, div, mul, fac, mode), p)
                    s2[j] = complex(sa, sb)
                    out2[j] = complex(oa, ob)
                    j += step
                i = n - 1 if i == 0 and n % 2 else n
            while i < n:
                state[i], out[i] = f(state[i], _in(g[i], div, mul, fac, mode), p)
                i += step

        return kernel

    return make


def _two_states(f):
    """``mu, nu, out = f(mu, nu, g, p)`` (Adam)."""

    def make(mode, pairs):  # pragma: no cover - compiled per mode and width
        @cuda.jit
        def kernel(n, mu, nu, g, out, div, mul, fac, p):
            i, step = _start_device()
            if pairs:
                mu2, nu2 = _pairs_device(mu, n), _pairs_device(nu, n)
                g2, out2 = _pairs_device(g, n), _pairs_device(out, n)
                j = i
                while j < g2.size:
                    m, v, w = mu2[j], nu2[j], g2[j]
                    ma, va, oa = f(m.real, v.real, _in(w.real, div, mul, fac, mode), p)
                    mb, vb, ob = f(m.imag, v.imag, _in(w.imag, div, mul, fac, mode), p)
                    mu2[j] = complex(ma, mb)
                    nu2[j] = complex(va, vb)
                    out2[j] = complex(oa, ob)
                    j += step
                i = n - 1 if i == 0 and n % 2 else n
            while i < n:
                mu[i], nu[i], out[i] = f(mu[i], nu[i], _in(g[i], div, mul, fac, mode), p)
                i += step

        return kernel

    return make


class _Family:
    """One operation: its kernel compiled per pending-factor mode (0, 1, 2) and width (float32
    pairs or one element per access). Both are closure constants, so their branches fold away
    at compile time (a per-element branch on the mode cost 15% of the mini-step)."""

    def __init__(self, pattern: Any, formula: Any) -> None:
        self._make = pattern(cuda.jit(device=True, inline=True)(formula))
        self._kernels: dict[tuple[int, bool], Any] = {}

    def run(self, div: Any, mul: Any, arrays: tuple, p: tuple) -> None:
        """Launches the kernel over ``arrays`` (all of one size) with the factor and ``p``."""
        d, m, fac, mode = _factor(div, mul, *arrays)
        pairs = all(a.dtype == np.float32 and _aligned(a) for a in arrays)
        key = (mode, pairs)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = self._make(mode, pairs)
        n = arrays[0].size
        _launch(kernel, (n + 1) // 2 if pairs else n, (n, *arrays, d, m, fac, p))


_DUMMY: dict[np.dtype, Any] = {}


def _factor(div: Any, mul: Any, *arrays: Any) -> tuple[Any, Any, Any, int]:
    """Kernel arguments for a pending factor: scalars, or a dict dtype -> device [div, mul]."""
    ctype = np.result_type(*(a.dtype for a in arrays))
    if isinstance(div, dict):
        one = ctype.type(1)
        return one, one, div[ctype], 2
    dummy = _DUMMY.get(ctype)
    if dummy is None:
        dummy = _DUMMY[ctype] = cuda.device_array(2, ctype)  # never read in modes 0 and 1
    return div, mul, dummy, int(bool(div != 1 or mul != 1))


# The formulas: optax's order of operations, in the buffer dtype.


def _identity(g, p):  # pragma: no cover - compiled
    return g


def _clip(g, p):  # pragma: no cover - compiled
    (max_delta,) = p
    if g > max_delta:
        return max_delta
    if g < -max_delta:
        return -max_delta
    return g  # NaN stays NaN


def _zero_nans(g, p):  # pragma: no cover - compiled
    return g if g == g else 0.0  # (stored in g's dtype: exact)


def _add_scaled(g, y, p):  # pragma: no cover - compiled
    (s,) = p
    return g + s * y


def _mean_accumulate(acc, g, p):  # pragma: no cover - compiled
    count, fresh = p
    return g + 0 if fresh else acc + (g - acc) / count


def _sum_accumulate(acc, g, p):  # pragma: no cover - compiled
    (fresh,) = p
    return g + 0 if fresh else g + acc


def _trace(trace, g, p):  # pragma: no cover - compiled
    decay, nesterov = p
    t = g + decay * trace
    return t, (g + decay * t if nesterov else t)


def _ema(ema, g, p):  # pragma: no cover - compiled
    one_minus_decay, decay, bias_correction = p
    e = one_minus_decay * g + decay * ema
    return e, e / bias_correction


def _adam(mu, nu, g, p):  # pragma: no cover - compiled
    b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root, out_mul = p
    m = one_minus_b1 * g + b1 * mu
    v = one_minus_b2 * (g * g) + b2 * nu
    return m, v, ((m / bc1) / (math.sqrt(v / bc2 + eps_root) + eps)) * out_mul


_SCALE = _Family(_unary, _identity)
_CLIP = _Family(_unary, _clip)
_ZERO_NANS = _Family(_unary, _zero_nans)
_ADD_SCALED = _Family(_binary, _add_scaled)
_MEAN_ACCUMULATE = _Family(_accumulate, _mean_accumulate)
_SUM_ACCUMULATE = _Family(_accumulate, _sum_accumulate)
_TRACE = _Family(_stateful, _trace)
_EMA = _Family(_stateful, _ema)
_ADAM = _Family(_two_states, _adam)


@cuda.jit
def _fill(n, x, value):  # pragma: no cover - compiled
    i, step = _start_device()
    while i < n:
        x[i] = value
        i += step


class _ByMode:
    """A kernel compiled once per pending-factor mode (0, 1, 2)."""

    def __init__(self, factory: Any) -> None:
        self._factory = factory
        self._kernels: dict[int, Any] = {}

    def __getitem__(self, mode: int) -> Any:
        k = self._kernels.get(mode)
        if k is None:
            k = self._kernels[mode] = self._factory(mode)
        return k



# --- reductions: the one engine (numbaccum.cuda.reduce), by their transitional names ---------


def _aligned(x: Any) -> bool:
    """Whether float32 pairs can be read from ``x`` (an 8-byte aligned start)."""
    ptr = data_pointer(x)
    return ptr is None or ptr % 8 == 0


# --- the contract (same names and signatures as numbaccum.cpu) ------------------------------


def sumsq(x):
    """sum(x ** 2) in float64 (the engine, one slice)."""
    return float(_engine.reduce("sumsq", x, whole(x.size))[0])


def sumabs(x):
    """sum(|x|) in float64 (the engine, one slice)."""
    return float(_engine.reduce("sumabs", x, whole(x.size))[0])


def maxabs(x):
    """max(|x|) (0 for an empty buffer, NaN if any element is NaN)."""
    return float(_engine.reduce("maxabs", x, whole(x.size))[0])


def count_nonfinite(x):
    """Number of NaN and +-inf elements."""
    return int(_engine.reduce("nonfinite", x, whole(x.size))[0])


def segment_sumsq(x, offsets):
    """Per segment ``s``: sum(x[offsets[s]:offsets[s+1]] ** 2) in float64."""
    return _engine.reduce("sumsq", x, segments(offsets))


def segment_sumabs(x, offsets):
    """Per segment ``s``: sum(|x[offsets[s]:offsets[s+1]]|) in float64."""
    return _engine.reduce("sumabs", x, segments(offsets))


def segment_maxabs(x, offsets):
    """Per segment ``s``: max(|x[offsets[s]:offsets[s+1]]|) (0 if empty, NaN if any NaN)."""
    return _engine.reduce("maxabs", x, segments(offsets))


def segment_nancount(x, offsets):
    """Per segment ``s``: the number of NaN elements of x[offsets[s]:offsets[s+1]]."""
    return _engine.reduce("nancount", x, segments(offsets))


def sumsq_clip_factors_(leaf_sums, x, offsets, members, last, max_norm, fac32, fac64):
    """leaf_sums[members] = sum(x ** 2) per segment (the group's leaves); when ``last``, sets
    ``fac = [div, mul]`` of clip_by_global_norm, in float32 and float64, from ``norm =
    sqrt(sum(leaf_sums))`` in order. One launch, nothing comes to the host (see
    `numbaccum.cuda.reduce.clip_factors_`)."""
    _engine.clip_factors_(leaf_sums, x, segments(offsets), members, bool(last), max_norm, fac32, fac64)


def clip_(out, x, div, mul, max_delta):
    """out = clip((x / div) * mul, -max_delta, max_delta); NaN stays NaN."""
    _CLIP.run(div, mul, (out, x), (max_delta,))


def zero_nans_(out, x, div, mul):
    """out = 0 where (x / div) * mul is NaN, else that value (inf is kept)."""
    _ZERO_NANS.run(div, mul, (out, x), ())


def segment_divide_(out, x, div, mul, offsets, factors):
    """out = ((x / div) * mul) / factors[s] over each segment ``s`` (a per-leaf divisor)."""
    _engine.divide_(out, x, _segment_factor(div, mul), segments(offsets), factors)


def _segment_factor(div, mul):
    """A pending factor from the transitional ``div, mul`` arguments (a dict: on the device)."""
    from ..contract import Factor

    return Factor(device=div) if isinstance(div, dict) else Factor(div, mul)


def fill_(x, value):
    """x = value."""
    _launch(_fill, x.size, (x.size, x, value))


def scale_(out, x, div, mul):
    """out = (x / div) * mul (``out`` may be ``x``)."""
    _SCALE.run(div, mul, (out, x), ())


def add_scaled_(out, x, div, mul, y, s):
    """out = (x / div) * mul + s * y (``out`` may be ``x``)."""
    _ADD_SCALED.run(div, mul, (out, x, y), (s,))


def trace_update_(trace, g, div, mul, decay, nesterov, out):
    """trace = g + decay * trace; out = trace, or g + decay * trace if nesterov."""
    _TRACE.run(div, mul, (trace, g, out), (decay, nesterov))


def ema_update_(ema, g, div, mul, one_minus_decay, decay, bias_correction, out):
    """ema = (1 - decay) * g + decay * ema; out = ema / bias_correction."""
    _EMA.run(div, mul, (ema, g, out), (one_minus_decay, decay, bias_correction))


def mean_accumulate_(acc, g, div, mul, count, fresh):
    """acc = acc + (g - acc) / count, with acc read as 0 if ``fresh``."""
    _MEAN_ACCUMULATE.run(div, mul, (acc, g), (count, fresh))


def sum_accumulate_(acc, g, div, mul, fresh):
    """acc = g + acc, with acc read as 0 if ``fresh``."""
    _SUM_ACCUMULATE.run(div, mul, (acc, g), (fresh,))


def adam_update_(
    mu, nu, g, div, mul, b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root, out_mul, out
):
    """Adam moments in place; out = ((mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps)) * out_mul."""
    args = (b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root, out_mul)
    _ADAM.run(div, mul, (mu, nu, g, out), args)


__all__ = [  # the contract (what `from .kernels import *` brings)
    "sumsq",
    "sumabs",
    "maxabs",
    "count_nonfinite",
    "segment_sumsq",
    "segment_sumabs",
    "segment_maxabs",
    "segment_nancount",
    "sumsq_clip_factors_",
    "fill_",
    "segment_divide_",
    "clip_",
    "zero_nans_",
    "scale_",
    "add_scaled_",
    "trace_update_",
    "ema_update_",
    "mean_accumulate_",
    "sum_accumulate_",
    "adam_update_",
]
KERNELS = tuple(__all__)
