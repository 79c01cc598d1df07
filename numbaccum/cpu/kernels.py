"""The kernel contract on the CPU: numba ``@njit`` loops over flat 1-D buffers.

Every elementwise kernel reads its gradient input as ``(g / div) * mul``: a pending
``clip_by_global_norm`` factor (or ``div = mul = 1``, which is exact) rides inside the next pass
instead of costing a pass of its own. Names ending in ``_`` write their first argument (and
``out`` when given). Scalars arrive already cast to the compute dtype (see `numbaccum.backend`).

Each loop body is written once over an index range ``[lo, hi)``; `_elementwise` turns it into a
parallel driver (``prange`` over fixed chunks) and a serial one for small buffers. Reductions
(``sumsq``, ``segment_*``, ...) are the one reduction engine, `numbaccum.cpu.reduce`, under their
transitional names. ``error_model="numpy"``: a division by zero gives inf or NaN as in
NumPy (optax's ``ema`` with ``decay = 1`` is NaN), never an exception.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _config
from ..tables import segments, sum_in_order, whole  # noqa: F401  (sum_in_order: transitional home)
from . import reduce as _engine


def _elementwise(body):
    """Parallel and serial drivers for ``body(lo, hi, *args)``."""

    @njit(parallel=True, error_model="numpy")
    def parallel(n, chunk, *args):  # pragma: no cover - compiled
        for c in prange((n + chunk - 1) // chunk):
            body(c * chunk, min(n, (c + 1) * chunk), *args)

    @njit(error_model="numpy")
    def serial(n, chunk, *args):  # pragma: no cover - compiled
        body(0, n, *args)

    return parallel, serial


# --- reductions: the one engine (numbaccum.cpu.reduce), by their transitional names ----------


def _segment_factor(div, mul):
    """A host pending factor from the transitional ``div, mul`` arguments."""
    from ..contract import Factor

    return Factor(div, mul)


# --- elementwise ----------------------------------------------------------------------------


@njit(inline="always", error_model="numpy")
def _in(v, div, mul, scaled):  # pragma: no cover - compiled
    """The pending factor on a read: (v / div) * mul, skipped (two divisions saved) when 1, 1."""
    return (v / div) * mul if scaled else v


def _scaled(div, mul):
    return bool(div != 1 or mul != 1)


# Bodies slice their arrays and loop from 0: an index that is provably non-negative lets LLVM
# drop numba's negative-index wraparound and vectorise (measured: 2x on a mean accumulate).


@njit(error_model="numpy")
def _fill_body(lo, hi, x, value):  # pragma: no cover - compiled
    """x = value."""
    xs = x[lo:hi]
    for i in range(xs.size):
        xs[i] = value


@njit(error_model="numpy")
def _scale_body(lo, hi, out, x, div, mul, scaled):  # pragma: no cover - compiled
    """out = (x / div) * mul."""
    o, xs = out[lo:hi], x[lo:hi]
    for i in range(xs.size):
        o[i] = _in(xs[i], div, mul, scaled)


@njit(error_model="numpy")
def _add_scaled_body(lo, hi, out, x, div, mul, scaled, y, s):  # pragma: no cover - compiled
    """out = (x / div) * mul + s * y."""
    o, xs, ys = out[lo:hi], x[lo:hi], y[lo:hi]
    for i in range(xs.size):
        o[i] = _in(xs[i], div, mul, scaled) + s * ys[i]


@njit(error_model="numpy")
def _trace_body(lo, hi, trace, g, div, mul, scaled, decay, nesterov, out):  # pragma: no cover
    """t = g + decay * trace; trace = t; out = g + decay * t if nesterov else t."""
    tr, gs, o = trace[lo:hi], g[lo:hi], out[lo:hi]
    for i in range(gs.size):
        gi = _in(gs[i], div, mul, scaled)
        t = gi + decay * tr[i]
        tr[i] = t
        if nesterov:
            o[i] = gi + decay * t
        else:
            o[i] = t


@njit(error_model="numpy")
def _ema_body(
    lo, hi, ema, g, div, mul, scaled, one_minus_decay, decay, bias_correction, out
):  # pragma: no cover
    """e = (1 - decay) * g + decay * ema; ema = e; out = e / bias_correction."""
    em, gs, o = ema[lo:hi], g[lo:hi], out[lo:hi]
    for i in range(gs.size):
        e = one_minus_decay * _in(gs[i], div, mul, scaled) + decay * em[i]
        em[i] = e
        o[i] = e / bias_correction


@njit(error_model="numpy")
def _mean_accumulate_body(lo, hi, acc, g, div, mul, scaled, count, fresh):  # pragma: no cover
    """acc = acc + (g - acc) / count (Welford); acc = g + 0 when fresh (acc == 0, count == 1)."""
    a, gs = acc[lo:hi], g[lo:hi]
    for i in range(gs.size):
        gi = _in(gs[i], div, mul, scaled)
        if fresh:
            # 0 + (g - 0) / 1 == g + 0.0 exactly (and -0 becomes +0), without reading acc.
            a[i] = gi + 0.0
        else:
            a[i] = a[i] + (gi - a[i]) / count


@njit(error_model="numpy")
def _sum_accumulate_body(lo, hi, acc, g, div, mul, scaled, fresh):  # pragma: no cover
    """acc = g + acc; acc = g + 0 when fresh (acc == 0)."""
    a, gs = acc[lo:hi], g[lo:hi]
    for i in range(gs.size):
        gi = _in(gs[i], div, mul, scaled)
        if fresh:
            a[i] = gi + 0.0
        else:
            a[i] = gi + a[i]


@njit(error_model="numpy")
def _adam_body(
    lo,
    hi,
    mu,
    nu,
    g,
    div,
    mul,
    scaled,
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
    """mu, nu = moments of g; out = ((mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps)) * out_mul."""
    ms, vs, gs, o = mu[lo:hi], nu[lo:hi], g[lo:hi], out[lo:hi]
    for i in range(gs.size):
        gi = _in(gs[i], div, mul, scaled)
        m = one_minus_b1 * gi + b1 * ms[i]
        v = one_minus_b2 * (gi * gi) + b2 * vs[i]
        ms[i] = m
        vs[i] = v
        o[i] = ((m / bc1) / (np.sqrt(v / bc2 + eps_root) + eps)) * out_mul


@njit(error_model="numpy")
def _clip_body(lo, hi, out, x, div, mul, scaled, max_delta):  # pragma: no cover - compiled
    """out = clip(x, -max_delta, max_delta); NaN stays NaN."""
    o, xs = out[lo:hi], x[lo:hi]
    for i in range(xs.size):
        v = _in(xs[i], div, mul, scaled)
        if v > max_delta:
            v = max_delta
        elif v < -max_delta:
            v = -max_delta
        o[i] = v


@njit(error_model="numpy")
def _zero_nans_body(lo, hi, out, x, div, mul, scaled):  # pragma: no cover - compiled
    """out = 0 where x is NaN, else x (inf is kept)."""
    o, xs = out[lo:hi], x[lo:hi]
    for i in range(xs.size):
        v = _in(xs[i], div, mul, scaled)
        if v == v:
            o[i] = v
        else:
            o[i] = 0


_FILL = _elementwise(_fill_body)
_CLIP = _elementwise(_clip_body)
_ZERO_NANS = _elementwise(_zero_nans_body)
_SCALE = _elementwise(_scale_body)
_ADD_SCALED = _elementwise(_add_scaled_body)
_TRACE = _elementwise(_trace_body)
_EMA = _elementwise(_ema_body)
_MEAN_ACC = _elementwise(_mean_accumulate_body)
_SUM_ACC = _elementwise(_sum_accumulate_body)
_ADAM = _elementwise(_adam_body)


def _pick(pair, n):
    return pair[1] if n < _config.SERIAL_BELOW else pair[0]


def _run(pair, n, *args):
    _pick(pair, n)(n, _config.CHUNK, *args)


# --- the contract (same names and signatures in numbaccum.cuda) -----------------------------


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
    sqrt(sum_in_order(leaf_sums))`` (`numbaccum.formulas.clip_factor`). The host twin of the
    CUDA kernel that keeps the factor on the device."""
    _engine.clip_factors_(leaf_sums, x, segments(offsets), members, bool(last), max_norm, fac32, fac64)


def segment_divide_(out, x, div, mul, offsets, factors):
    """out = ((x / div) * mul) / factors[s] over each segment ``s`` (a per-leaf divisor)."""
    _engine.divide_(out, x, _segment_factor(div, mul), segments(offsets), factors)


def clip_(out, x, div, mul, max_delta):
    """out = clip((x / div) * mul, -max_delta, max_delta); NaN stays NaN."""
    _run(_CLIP, x.size, out, x, div, mul, _scaled(div, mul), max_delta)


def zero_nans_(out, x, div, mul):
    """out = 0 where (x / div) * mul is NaN, else that value (inf is kept)."""
    _run(_ZERO_NANS, x.size, out, x, div, mul, _scaled(div, mul))


def fill_(x, value):
    """x = value."""
    _run(_FILL, x.size, x, value)


def scale_(out, x, div, mul):
    """out = (x / div) * mul (``out`` may be ``x``)."""
    _run(_SCALE, x.size, out, x, div, mul, _scaled(div, mul))


def add_scaled_(out, x, div, mul, y, s):
    """out = (x / div) * mul + s * y (``out`` may be ``x``)."""
    _run(_ADD_SCALED, x.size, out, x, div, mul, _scaled(div, mul), y, s)


def trace_update_(trace, g, div, mul, decay, nesterov, out):
    """trace = g + decay * trace; out = trace, or g + decay * trace if nesterov."""
    _run(_TRACE, g.size, trace, g, div, mul, _scaled(div, mul), decay, nesterov, out)


def ema_update_(ema, g, div, mul, one_minus_decay, decay, bias_correction, out):
    """ema = (1 - decay) * g + decay * ema; out = ema / bias_correction."""
    _run(_EMA, g.size, ema, g, div, mul, _scaled(div, mul), one_minus_decay, decay, bias_correction, out)


def mean_accumulate_(acc, g, div, mul, count, fresh):
    """acc = acc + (g - acc) / count, with acc read as 0 if ``fresh``."""
    _run(_MEAN_ACC, g.size, acc, g, div, mul, _scaled(div, mul), count, fresh)


def sum_accumulate_(acc, g, div, mul, fresh):
    """acc = g + acc, with acc read as 0 if ``fresh``."""
    _run(_SUM_ACC, g.size, acc, g, div, mul, _scaled(div, mul), fresh)


def adam_update_(
    mu, nu, g, div, mul, b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root, out_mul, out
):
    """Adam moments in place; out = ((mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps)) * out_mul.

    ``out_mul`` is the learning-rate step of ``adam`` fused into the pass (1 for scale_by_adam);
    the product rounds exactly as a separate scaling pass would."""
    args = (b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root, out_mul)
    _run(_ADAM, g.size, mu, nu, g, div, mul, _scaled(div, mul), *args, out)


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

# Arguments each in-place kernel writes (index into its argument list).
WRITES: dict[str, tuple[int, ...]] = {
    "fill_": (0,),
    "segment_divide_": (0,),
    "clip_": (0,),
    "zero_nans_": (0,),
    "sumsq_clip_factors_": (0, 6, 7),
    "scale_": (0,),
    "add_scaled_": (0,),
    "trace_update_": (0, 6),
    "ema_update_": (0, 7),
    "mean_accumulate_": (0,),
    "sum_accumulate_": (0,),
    "adam_update_": (0, 1, 14),
}
