"""The kernel contract on CUDA: ``numba.cuda`` kernels over flat 1-D device buffers.

Same names and signatures as `numbaccum.cpu`. Elementwise kernels are grid-stride loops with
int64 indices (a flat float32 buffer passes 2**31 elements at 2B parameters). Every kernel is
launched on `stream()` (the caller's stream, see `numbaccum.cuda.device`), once per call: one
launch per operation and dtype group, never per leaf. Reductions cut each segment into fixed
blocks of ``CUDA_REDUCE_BLOCK`` elements; one CUDA block sums a block in float64 through a
shared-memory tree in a fixed order, and one thread per segment adds its block partials in index
order: no float atomics, so a norm has the same bits on every run. Reductions return host values
(a synchronisation): they serve `global_norm` and the skip predicates, which decide on the host.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
from numba import cuda

from .. import _config
from .device import stream

LAUNCHES = [0]  # kernel launches so far (tests count them per update)

_SUMSQ, _SUMABS, _MAXABS, _NONFINITE, _NANCOUNT = 0, 1, 2, 3, 4


def _grid(n: int) -> tuple[int, int]:
    tpb = _config.CUDA_THREADS
    return max(1, min(_config.CUDA_MAX_BLOCKS, -(-n // tpb))), tpb


def _launch(kernel: Any, n: int, *args: Any) -> None:
    if n == 0:
        return
    blocks, tpb = _grid(n)
    LAUNCHES[0] += 1
    kernel[blocks, tpb, stream()](n, *args)


def _start() -> tuple[Any, Any]:
    """First index and stride of a grid-stride loop, as int64."""
    i = np.int64(cuda.blockIdx.x) * np.int64(cuda.blockDim.x) + np.int64(cuda.threadIdx.x)  # type: ignore[arg-type]
    return i, np.int64(cuda.gridDim.x) * np.int64(cuda.blockDim.x)  # type: ignore[arg-type]


_start_device = cuda.jit(device=True)(_start)


# --- elementwise ----------------------------------------------------------------------------


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


class _ByMode:
    """A kernel compiled once per pending-factor mode (0, 1, 2): ``mode`` is a closure constant,
    so the per-element branch of `_in` folds away at compile time."""

    def __init__(self, factory: Any) -> None:
        self._factory = factory
        self._kernels: dict[int, Any] = {}

    def __getitem__(self, mode: int) -> Any:
        k = self._kernels.get(mode)
        if k is None:
            k = self._kernels[mode] = self._factory(mode)
        return k


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


@cuda.jit
def _fill(n, x, value):  # pragma: no cover - compiled
    i, step = _start_device()
    while i < n:
        x[i] = value
        i += step


def _scale_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, out, x, div, mul, fac):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            out[i] = _in(x[i], div, mul, fac, mode)
            i += step

    return kernel


_SCALE = _ByMode(_scale_kernel)


def _add_scaled_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, out, x, div, mul, fac, y, s):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            out[i] = _in(x[i], div, mul, fac, mode) + s * y[i]
            i += step

    return kernel


_ADD_SCALED = _ByMode(_add_scaled_kernel)


def _trace_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, trace, g, div, mul, fac, decay, nesterov, out):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            gi = _in(g[i], div, mul, fac, mode)
            t = gi + decay * trace[i]
            trace[i] = t
            if nesterov:
                out[i] = gi + decay * t
            else:
                out[i] = t
            i += step

    return kernel


_TRACE = _ByMode(_trace_kernel)


def _ema_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, ema, g, div, mul, fac, one_minus_decay, decay, bias_correction, out):  # pragma: no cover
        i, step = _start_device()
        while i < n:
            e = one_minus_decay * _in(g[i], div, mul, fac, mode) + decay * ema[i]
            ema[i] = e
            out[i] = e / bias_correction
            i += step

    return kernel


_EMA = _ByMode(_ema_kernel)


def _mean_accumulate_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, acc, g, div, mul, fac, count, fresh):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            gi = _in(g[i], div, mul, fac, mode)
            if fresh:
                acc[i] = gi + 0.0
            else:
                acc[i] = acc[i] + (gi - acc[i]) / count
            i += step

    return kernel


_MEAN_ACCUMULATE = _ByMode(_mean_accumulate_kernel)


def _sum_accumulate_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, acc, g, div, mul, fac, fresh):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            gi = _in(g[i], div, mul, fac, mode)
            if fresh:
                acc[i] = gi + 0.0
            else:
                acc[i] = gi + acc[i]
            i += step

    return kernel


_SUM_ACCUMULATE = _ByMode(_sum_accumulate_kernel)


def _adam_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(
        n,
        mu,
        nu,
        g,
        div,
        mul,
        fac,
        b1,
        one_minus_b1,
        b2,
        one_minus_b2,
        bc1,
        bc2,
        eps,
        eps_root,
        out_mul,
        out,
    ):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            gi = _in(g[i], div, mul, fac, mode)
            m = one_minus_b1 * gi + b1 * mu[i]
            v = one_minus_b2 * (gi * gi) + b2 * nu[i]
            mu[i] = m
            nu[i] = v
            out[i] = ((m / bc1) / (math.sqrt(v / bc2 + eps_root) + eps)) * out_mul
            i += step

    return kernel


_ADAM = _ByMode(_adam_kernel)


def _clip_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, out, x, div, mul, fac, max_delta):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            v = _in(x[i], div, mul, fac, mode)
            if v > max_delta:
                v = max_delta
            elif v < -max_delta:
                v = -max_delta
            out[i] = v
            i += step

    return kernel


_CLIP = _ByMode(_clip_kernel)


def _zero_nans_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, out, x, div, mul, fac):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            v = _in(x[i], div, mul, fac, mode)
            if v == v:
                out[i] = v
            else:
                out[i] = 0
            i += step

    return kernel


_ZERO_NANS = _ByMode(_zero_nans_kernel)


def _segment_divide_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(out, x, div, mul, fac, starts, stops, seg, factors):  # pragma: no cover - compiled
        b = cuda.blockIdx.x
        f = factors[seg[b]]
        i = starts[b] + cuda.threadIdx.x
        while i < stops[b]:
            out[i] = _in(x[i], div, mul, fac, mode) / f
            i += cuda.blockDim.x

    return kernel


_SEGMENT_DIVIDE = _ByMode(_segment_divide_kernel)


# --- reductions -----------------------------------------------------------------------------

_REDUCERS: dict[tuple[int, int], Any] = {}


def _reducer(kind: int, tpb: int) -> Any:
    """The block-partial kernel of one reduction kind for ``tpb`` threads (shared memory needs
    the size at compile time)."""
    key = (kind, tpb)
    if key in _REDUCERS:
        return _REDUCERS[key]

    @cuda.jit
    def partials(x, starts, stops, out):  # pragma: no cover - compiled
        shared = cuda.shared.array(tpb, np.float64)
        b = cuda.blockIdx.x
        t = cuda.threadIdx.x
        acc = 0.0
        i = starts[b] + t
        while i < stops[b]:
            v = np.float64(x[i])
            if kind == _SUMSQ:
                acc += v * v
            elif kind == _SUMABS:
                acc += abs(v)
            elif kind == _MAXABS:
                a = abs(v)
                if (a > acc or a != a) and acc == acc:
                    acc = a
            elif kind == _NONFINITE:
                if v - v != 0:
                    acc += 1.0
            elif v != v:
                acc += 1.0
            i += tpb
        shared[t] = acc
        cuda.syncthreads()
        half = tpb // 2
        while half > 0:  # fixed pairing: the same tree every run
            if t < half:
                a = shared[t]
                c = shared[t + half]
                if kind == _MAXABS:
                    if (c > a or c != c) and a == a:
                        shared[t] = c
                else:
                    shared[t] = a + c
            cuda.syncthreads()
            half //= 2
        if t == 0:
            out[b] = shared[0]

    _REDUCERS[key] = partials
    return partials


@cuda.jit
def _combine(first, partial, take_max, out):  # pragma: no cover - compiled
    s = cuda.grid(1)
    if s < out.size:
        acc = 0.0
        for b in range(first[s], first[s + 1]):
            v = partial[b]
            if take_max:
                if (v > acc or v != v) and acc == acc:
                    acc = v
            else:
                acc += v
        out[s] = acc


_TABLES: dict[tuple, tuple[Any, ...]] = {}


def _block_table(offsets: np.ndarray, block: int) -> tuple[Any, Any, Any, int, Any]:
    """Device copies of each block's start, stop, each segment's first block, the block count,
    and each block's segment (cached per offsets table: layouts keep theirs for life)."""
    key = (offsets.tobytes(), block)
    hit = _TABLES.get(key)
    if hit is None:
        sizes = np.diff(offsets)
        counts = -(-sizes // block)
        first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        starts = np.concatenate(
            [np.arange(o, o + s, block) for o, s in zip(offsets[:-1], sizes)] + [np.zeros(0)]
        )
        starts = starts.astype(np.int64)
        seg = np.repeat(np.arange(sizes.size), counts)
        stops = np.minimum(starts + block, offsets[1:][seg]).astype(np.int64)
        dev = cuda.to_device
        hit = (dev(starts), dev(stops), dev(first), int(starts.size), dev(seg.astype(np.int64)))
        if len(_TABLES) > 256:
            _TABLES.clear()
        _TABLES[key] = hit
    return hit  # type: ignore[return-value]


_SCRATCH: dict[tuple, Any] = {}


def _segmented_into(kind: int, out: Any, x: Any, offsets: np.ndarray) -> None:
    """Per-segment reduction of ``x`` into the device array ``out``; nothing comes to the host."""
    offsets = np.asarray(offsets, np.int64)
    nseg = offsets.size - 1
    starts, stops, first, nblocks, _ = _block_table(offsets, _config.CUDA_REDUCE_BLOCK)
    key = (threading.get_ident(), nblocks)  # the block partials, reused call after call
    partial = _SCRATCH.get(key)
    if partial is None:
        partial = _SCRATCH[key] = cuda.device_array(max(nblocks, 1), np.float64)
    tpb = _config.CUDA_THREADS
    if nblocks:
        LAUNCHES[0] += 1
        _reducer(kind, tpb)[nblocks, tpb, stream()](x, starts, stops, partial)
    if nseg:
        LAUNCHES[0] += 1
        _combine[-(-nseg // tpb), tpb, stream()](first, partial, kind == _MAXABS, out)


def _segmented(kind: int, x: Any, offsets: np.ndarray) -> np.ndarray:
    nseg = np.asarray(offsets).size - 1
    out = cuda.device_array(max(nseg, 1), np.float64, stream=stream())
    _segmented_into(kind, out, x, offsets)
    return out.copy_to_host(stream=stream())[:nseg]


@cuda.jit
def _clip_factors(fac, parts, max_norm):  # pragma: no cover - compiled
    if cuda.grid(1) == 0:
        total = 0.0
        for i in range(parts.size):  # in order: the same bits every run
            total += parts[i]
        norm = math.sqrt(total)
        if norm < max_norm:
            fac[0] = 1.0
            fac[1] = 1.0
        elif norm == 0.0:
            fac[0] = 1.0
            fac[1] = 0.0
        else:
            fac[0] = norm
            fac[1] = max_norm


def _whole(kind: int, x: Any) -> float:
    return float(_segmented(kind, x, np.array([0, x.size], np.int64))[0])


# --- the contract (same names and signatures as numbaccum.cpu) ------------------------------


def sumsq(x):
    """sum(x ** 2) in float64 over a fixed block partition."""
    return _whole(_SUMSQ, x)


def sumabs(x):
    """sum(|x|) in float64 over a fixed block partition."""
    return _whole(_SUMABS, x)


def maxabs(x):
    """max(|x|) (0 for an empty buffer, NaN if any element is NaN)."""
    return _whole(_MAXABS, x)


def count_nonfinite(x):
    """Number of NaN and +-inf elements."""
    return int(_whole(_NONFINITE, x))


def segment_sumsq(x, offsets):
    """Per segment ``s``: sum(x[offsets[s]:offsets[s+1]] ** 2) in float64."""
    return _segmented(_SUMSQ, x, offsets)


def segment_sumabs(x, offsets):
    """Per segment ``s``: sum(|x[offsets[s]:offsets[s+1]]|) in float64."""
    return _segmented(_SUMABS, x, offsets)


def segment_maxabs(x, offsets):
    """Per segment ``s``: max(|x[offsets[s]:offsets[s+1]]|) (0 if empty, NaN if any NaN)."""
    return _segmented(_MAXABS, x, offsets)


def segment_nancount(x, offsets):
    """Per segment ``s``: the number of NaN elements of x[offsets[s]:offsets[s+1]]."""
    return _segmented(_NANCOUNT, x, offsets)


def segment_sumsq_into_(out, x, offsets):
    """out[s] = sum(x[offsets[s]:offsets[s+1]] ** 2) in float64, on the device (no sync)."""
    _segmented_into(_SUMSQ, out, x, offsets)


def clip_factors_(fac, parts, max_norm):
    """fac = [div, mul] of clip_by_global_norm from the squared norms ``parts`` (summed in order):
    [1, 1] if norm < max_norm, [1, 0] if norm == 0, else [norm, max_norm]. On the device."""
    LAUNCHES[0] += 1
    _clip_factors[1, 1, stream()](fac, parts, max_norm)


def clip_(out, x, div, mul, max_delta):
    """out = clip((x / div) * mul, -max_delta, max_delta); NaN stays NaN."""
    d, m, fac, mode = _factor(div, mul, out, x)
    _launch(_CLIP[mode], x.size, out, x, d, m, fac, max_delta)


def zero_nans_(out, x, div, mul):
    """out = 0 where (x / div) * mul is NaN, else that value (inf is kept)."""
    d, m, fac, mode = _factor(div, mul, out, x)
    _launch(_ZERO_NANS[mode], x.size, out, x, d, m, fac)


def segment_divide_(out, x, div, mul, offsets, factors):
    """out = ((x / div) * mul) / factors[s] over each segment ``s`` (a per-leaf divisor)."""
    offsets = np.asarray(offsets, np.int64)
    d, m, fac, mode = _factor(div, mul, out, x)
    starts, stops, _, nblocks, seg = _block_table(offsets, _config.CUDA_REDUCE_BLOCK)
    if nblocks:
        if isinstance(factors, np.ndarray):
            factors = cuda.to_device(factors, stream=stream())
        LAUNCHES[0] += 1
        _SEGMENT_DIVIDE[mode][nblocks, _config.CUDA_THREADS, stream()](
            out, x, d, m, fac, starts, stops, seg, factors
        )


def fill_(x, value):
    """x = value."""
    _launch(_fill, x.size, x, value)


def scale_(out, x, div, mul):
    """out = (x / div) * mul (``out`` may be ``x``)."""
    d, m, fac, mode = _factor(div, mul, out, x)
    _launch(_SCALE[mode], x.size, out, x, d, m, fac)


def add_scaled_(out, x, div, mul, y, s):
    """out = (x / div) * mul + s * y (``out`` may be ``x``)."""
    d, m, fac, mode = _factor(div, mul, out, x, y)
    _launch(_ADD_SCALED[mode], x.size, out, x, d, m, fac, y, s)


def trace_update_(trace, g, div, mul, decay, nesterov, out):
    """trace = g + decay * trace; out = trace, or g + decay * trace if nesterov."""
    d, m, fac, mode = _factor(div, mul, trace, g, out)
    _launch(_TRACE[mode], g.size, trace, g, d, m, fac, decay, nesterov, out)


def ema_update_(ema, g, div, mul, one_minus_decay, decay, bias_correction, out):
    """ema = (1 - decay) * g + decay * ema; out = ema / bias_correction."""
    d, m, fac, mode = _factor(div, mul, ema, g, out)
    _launch(_EMA[mode], g.size, ema, g, d, m, fac, one_minus_decay, decay, bias_correction, out)


def mean_accumulate_(acc, g, div, mul, count, fresh):
    """acc = acc + (g - acc) / count, with acc read as 0 if ``fresh``."""
    d, m, fac, mode = _factor(div, mul, acc, g)
    _launch(_MEAN_ACCUMULATE[mode], g.size, acc, g, d, m, fac, count, fresh)


def sum_accumulate_(acc, g, div, mul, fresh):
    """acc = g + acc, with acc read as 0 if ``fresh``."""
    d, m, fac, mode = _factor(div, mul, acc, g)
    _launch(_SUM_ACCUMULATE[mode], g.size, acc, g, d, m, fac, fresh)


def adam_update_(
    mu, nu, g, div, mul, b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root, out_mul, out
):
    """Adam moments in place; out = ((mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps)) * out_mul."""
    args = (b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root, out_mul)
    d, m, fac, mode = _factor(div, mul, mu, nu, g, out)
    _launch(_ADAM[mode], g.size, mu, nu, g, d, m, fac, *args, out)


KERNELS = (
    "sumsq",
    "sumabs",
    "maxabs",
    "count_nonfinite",
    "segment_sumsq",
    "segment_sumabs",
    "segment_maxabs",
    "segment_nancount",
    "segment_sumsq_into_",
    "clip_factors_",
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
)
