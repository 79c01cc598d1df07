"""Kernels of the history-based clippers on CUDA: the twin of `numbaccum.cpu.adaptive`.

Elementwise kernels are grid-stride loops compiled per pending-factor mode, as in
`numbaccum.cuda.kernels`; the segmented EMA runs one CUDA block per fixed block of a segment.
"""

from __future__ import annotations

import math
from typing import Any

from numba import cuda

from .. import _config
from ..arrays import stream
from ..tables import segments
from . import reduce as _engine
from .kernels import LAUNCHES, _ByMode, _factor, _in, _segment_factor, _start_device

__all__ = ["abs_ema_clip_", "abs_ema_update_", "clip_by_", "growth_clip_", "segment_ema_update_"]


def _launch(kernel: Any, n: int, *args: Any) -> None:
    """One grid-stride launch over ``n`` elements (none for an empty buffer)."""
    if n == 0:
        return
    tpb = _config.CUDA_THREADS
    blocks = max(1, min(_config.CUDA_MAX_BLOCKS, -(-n // tpb)))
    LAUNCHES[0] += 1
    kernel[blocks, tpb, stream()](n, *args)


@cuda.jit(device=True, inline=True)
def _finite(v):  # pragma: no cover - compiled
    return v - v == 0


@cuda.jit(device=True, inline=True)
def _abs_ema(e, v, one_minus_decay, decay, init, fresh):  # pragma: no cover - compiled
    if not _finite(v):
        return e
    a = abs(v)
    if fresh:
        e = a * init
    return one_minus_decay * a + decay * e


@cuda.jit(device=True, inline=True)
def _clamp(v, bound):  # pragma: no cover - compiled
    if v > bound:
        return bound
    if v < -bound:
        return -bound
    return v




def _abs_ema_clip_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, ema, g, div, mul, fac, one_minus_decay, decay, init, fresh, out):  # pragma: no cover
        i, step = _start_device()
        while i < n:
            v = _in(g[i], div, mul, fac, mode)
            e = _abs_ema(ema[i], v, one_minus_decay, decay, init, fresh)
            ema[i] = e
            out[i] = _clamp(v, e)
            i += step

    return kernel


_ABS_EMA_CLIP = _ByMode(_abs_ema_clip_kernel)


def _abs_ema_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, ema, g, div, mul, fac, one_minus_decay, decay, init, fresh):  # pragma: no cover
        i, step = _start_device()
        while i < n:
            ema[i] = _abs_ema(ema[i], _in(g[i], div, mul, fac, mode), one_minus_decay, decay, init, fresh)
            i += step

    return kernel


_ABS_EMA = _ByMode(_abs_ema_kernel)


def _clip_by_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, out, x, div, mul, fac, bound):  # pragma: no cover - compiled
        i, step = _start_device()
        while i < n:
            out[i] = _clamp(_in(x[i], div, mul, fac, mode), bound[i])
            i += step

    return kernel


_CLIP_BY = _ByMode(_clip_by_kernel)


def _growth_clip_kernel(mode):  # pragma: no cover - compiled per mode
    @cuda.jit
    def kernel(n, prev, g, div, mul, fac, add, max_growth, min_value, max_decay, out):  # pragma: no cover
        i, step = _start_device()
        while i < n:
            v = _in(g[i], div, mul, fac, mode)
            p = prev[i]
            if p == 0:
                out[i] = v
                if _finite(v):
                    prev[i] = v
            else:
                a = abs(v)
                pa = abs(p)
                if a - pa > add:
                    a = pa + add
                pm = max(pa, min_value)
                growth = max(a / pm, 1e-8)
                if growth > max_growth:
                    a = max_growth * pm
                r = math.copysign(a, v)
                out[i] = r
                if _finite(v):
                    if growth < 1.0 / max_decay:
                        prev[i] = p / max_decay
                    else:
                        prev[i] = r
            i += step

    return kernel


_GROWTH_CLIP = _ByMode(_growth_clip_kernel)


# --- the contract (same names and signatures as numbaccum.cpu.adaptive) ----------------------


def segment_ema_update_(ema, g, div, mul, offsets, active, one_minus_decay, decay):
    """ema = (1 - decay) * g + decay * ema over each segment ``s`` with ``active[s] != 0``: the
    engine's per-slice EMA (`numbaccum.cuda.reduce.ema_update_`) over a segments table."""
    _engine.ema_update_(ema, g, _segment_factor(div, mul), segments(offsets), active, one_minus_decay, decay)


def abs_ema_clip_(ema, g, div, mul, one_minus_decay, decay, init, fresh, out):
    """ema = (1 - decay) * |g| + decay * (|g| * init if fresh else ema); out = clip(g, -ema, ema)."""
    d, m, fac, mode = _factor(div, mul, ema, g, out)
    _launch(_ABS_EMA_CLIP[mode], g.size, ema, g, d, m, fac, one_minus_decay, decay, init, fresh, out)


def abs_ema_update_(ema, g, div, mul, one_minus_decay, decay, init, fresh):
    """ema = (1 - decay) * |g| + decay * (|g| * init if fresh else ema); non-finite g skipped."""
    d, m, fac, mode = _factor(div, mul, ema, g)
    _launch(_ABS_EMA[mode], g.size, ema, g, d, m, fac, one_minus_decay, decay, init, fresh)


def clip_by_(out, x, div, mul, bound):
    """out = clip((x / div) * mul, -bound, bound) with a bound per element; NaN stays NaN."""
    d, m, fac, mode = _factor(div, mul, out, x)
    _launch(_CLIP_BY[mode], x.size, out, x, d, m, fac, bound)


def growth_clip_(prev, g, div, mul, add, max_growth, min_value, max_decay, out):
    """Clips the growth of each element over its history ``prev`` (see numbaccum.cpu.adaptive)."""
    d, m, fac, mode = _factor(div, mul, prev, g, out)
    _launch(_GROWTH_CLIP[mode], g.size, prev, g, d, m, fac, add, max_growth, min_value, max_decay, out)


KERNELS = (
    "segment_ema_update_",
    "abs_ema_clip_",
    "abs_ema_update_",
    "clip_by_",
    "growth_clip_",
)
