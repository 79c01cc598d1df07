"""Kernels of the history-based clippers (`numbaccum.adaptive`) on the CPU.

Same conventions as `numbaccum.cpu.kernels`: flat 1-D buffers, the gradient read as
``(g / div) * mul`` (a pending factor), a trailing ``_`` for kernels that write their first
argument. A non-finite gradient element never enters a history buffer: one inf would otherwise
disable the clipper for that element (or leaf) for good.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..tables import segments
from . import reduce as _engine
from .kernels import _elementwise, _in, _run, _scaled, _segment_factor

__all__ = ["abs_ema_clip_", "abs_ema_update_", "clip_by_", "growth_clip_", "segment_ema_update_"]


@njit(inline="always", error_model="numpy")
def _finite(v):  # pragma: no cover - compiled
    return v - v == 0  # NaN for NaN and +-inf, 0 for every finite value


@njit(inline="always", error_model="numpy")
def _abs_ema(e, v, one_minus_decay, decay, init, fresh):  # pragma: no cover - compiled
    """The next EMA of |v| from ``e`` (from ``|v| * init`` when fresh); ``e`` for a non-finite v."""
    if not _finite(v):
        return e
    a = abs(v)
    if fresh:
        e = a * init
    return one_minus_decay * a + decay * e


@njit(inline="always", error_model="numpy")
def _clamp(v, bound):  # pragma: no cover - compiled
    """clip(v, -bound, bound); NaN stays NaN."""
    if v > bound:
        return bound
    if v < -bound:
        return -bound
    return v


@njit(error_model="numpy")
def _abs_ema_clip_body(
    lo, hi, ema, g, div, mul, scaled, one_minus_decay, decay, init, fresh, out
):  # pragma: no cover - compiled
    """e = EMA of |g|; out = clip(g, -e, e)."""
    em, gs, o = ema[lo:hi], g[lo:hi], out[lo:hi]
    for i in range(gs.size):
        v = _in(gs[i], div, mul, scaled)
        e = _abs_ema(em[i], v, one_minus_decay, decay, init, fresh)
        em[i] = e
        o[i] = _clamp(v, e)


@njit(error_model="numpy")
def _abs_ema_body(lo, hi, ema, g, div, mul, scaled, one_minus_decay, decay, init, fresh):  # pragma: no cover
    """e = EMA of |g|."""
    em, gs = ema[lo:hi], g[lo:hi]
    for i in range(gs.size):
        em[i] = _abs_ema(em[i], _in(gs[i], div, mul, scaled), one_minus_decay, decay, init, fresh)


@njit(error_model="numpy")
def _clip_by_body(lo, hi, out, x, div, mul, scaled, bound):  # pragma: no cover - compiled
    """out = clip(x, -bound, bound) elementwise."""
    o, xs, bs = out[lo:hi], x[lo:hi], bound[lo:hi]
    for i in range(xs.size):
        o[i] = _clamp(_in(xs[i], div, mul, scaled), bs[i])


@njit(error_model="numpy")
def _growth_clip_body(
    lo, hi, prev, g, div, mul, scaled, add, max_growth, min_value, max_decay, out
):  # pragma: no cover - compiled
    """|out| <= min(|prev| + add, max_growth * max(|prev|, min_value)); prev tracks out."""
    ps, gs, o = prev[lo:hi], g[lo:hi], out[lo:hi]
    for i in range(gs.size):
        v = _in(gs[i], div, mul, scaled)
        p = ps[i]
        if p == 0:  # no history yet: pass through, start the history (a 0 keeps waiting)
            o[i] = v
            if _finite(v):
                ps[i] = v
            continue
        a = abs(v)
        pa = abs(p)
        if a - pa > add:
            a = pa + add
        pm = max(pa, min_value)
        growth = max(a / pm, 1e-8)  # torchzero's floor, measured after the additive clip
        if growth > max_growth:
            a = max_growth * pm
        r = np.copysign(a, v)
        o[i] = r
        if _finite(v):
            if growth < 1.0 / max_decay:  # the history shrinks by at most max_decay per step
                ps[i] = p / max_decay
            else:
                ps[i] = r


_ABS_EMA_CLIP = _elementwise(_abs_ema_clip_body)
_ABS_EMA = _elementwise(_abs_ema_body)
_CLIP_BY = _elementwise(_clip_by_body)
_GROWTH_CLIP = _elementwise(_growth_clip_body)


# --- the contract (same names and signatures in numbaccum.cuda.adaptive) ---------------------


def segment_ema_update_(ema, g, div, mul, offsets, active, one_minus_decay, decay):
    """ema = (1 - decay) * g + decay * ema over each segment ``s`` with ``active[s] != 0``; the
    other segments are left as they are (their g is not even read). The reduction engine's
    per-slice EMA (`numbaccum.cpu.reduce.ema_update_`) over a segments table."""
    factor = _segment_factor(div, mul)
    _engine.ema_update_(ema, g, factor, segments(offsets), active, one_minus_decay, decay)


def abs_ema_clip_(ema, g, div, mul, one_minus_decay, decay, init, fresh, out):
    """ema = (1 - decay) * |g| + decay * (|g| * init if fresh else ema); out = clip(g, -ema, ema).

    A non-finite g leaves its ema element as it is (NaN stays NaN in out, inf is clipped)."""
    args = (one_minus_decay, decay, init, fresh, out)
    _run(_ABS_EMA_CLIP, g.size, ema, g, div, mul, _scaled(div, mul), *args)


def abs_ema_update_(ema, g, div, mul, one_minus_decay, decay, init, fresh):
    """ema = (1 - decay) * |g| + decay * (|g| * init if fresh else ema); non-finite g skipped."""
    _run(_ABS_EMA, g.size, ema, g, div, mul, _scaled(div, mul), one_minus_decay, decay, init, fresh)


def clip_by_(out, x, div, mul, bound):
    """out = clip((x / div) * mul, -bound, bound) with a bound per element; NaN stays NaN."""
    _run(_CLIP_BY, x.size, out, x, div, mul, _scaled(div, mul), bound)


def growth_clip_(prev, g, div, mul, add, max_growth, min_value, max_decay, out):
    """Clips the growth of each element over its history ``prev`` (torchzero's ClipValueGrowth):
    ``|out| <= min(|prev| + add, max_growth * max(|prev|, min_value))`` with g's sign; then
    ``prev = prev / max_decay`` if the growth was below ``1 / max_decay``, else ``out``.

    ``prev == 0`` means no history: g passes through and becomes the history. A non-finite g is
    clipped (NaN stays NaN) and leaves ``prev`` as it is. ``add = inf``, ``max_growth = inf``,
    ``min_value = 0`` and ``max_decay = inf`` switch the corresponding rule off."""
    args = (add, max_growth, min_value, max_decay, out)
    _run(_GROWTH_CLIP, g.size, prev, g, div, mul, _scaled(div, mul), *args)


KERNELS = (
    "segment_ema_update_",
    "abs_ema_clip_",
    "abs_ema_update_",
    "clip_by_",
    "growth_clip_",
)

# Arguments each in-place kernel writes (index into its argument list).
WRITES: dict[str, tuple[int, ...]] = {
    "segment_ema_update_": (0,),
    "abs_ema_clip_": (0, 8),
    "abs_ema_update_": (0,),
    "clip_by_": (0,),
    "growth_clip_": (0, 8),
}
