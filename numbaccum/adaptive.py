"""Stateful clipping with torchzero's semantics: by an EMA of past updates, and by growth.

Each clipper keeps a history: an EMA of the updates (a `FlatTree` shaped like params), the
previous update per element, or the previous norm per leaf (a small float64 array; a 0-d array
in global mode). torchzero's behaviour is followed except for its bugs (see
reference/declearn_torchzero.md, Part B):

* A stored previous norm (or element) of 0 means "no history yet": that step is not limited and
  the history restarts from it, so a zero first step never collapses the later ones.
* ``min_value`` bounds the allowed norm (``mul * max(prev, min_value)``), never the divisor.
* ``add=None, mul=None`` is the identity (torchzero crashes from its second step).
* A slice whose norm is non-finite or <= 1e-12 is left unchanged, and a non-finite update never
  enters a history (one inf would otherwise switch the clipper off for good).
* Every ``ord`` works in both per-leaf and global modes, and norms accumulate in float64.

Per-leaf norms come from segmented kernels (one launch per dtype group, never a Python loop over
leaves); they come back to the host, so on the GPU each update synchronises once.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import backend
from ._checks import non_negative, real
from .accumulation import check_decay, expect_state, safe_increment
from .base import (
    Flow,
    GradientTransformationExtraArgs,
    ParamsRef,
    flat_transformation,
    run_stage,
    with_extra_args_support,
)
from .flat import FlatTree, Layout, layout_and_device
from .norms import TINY, check_ord, leaf_norms, tree_norm

__all__ = [
    "ClipNormByEmaState",
    "ClipNormGrowthState",
    "ClipValueByEmaState",
    "ClipValueGrowthState",
    "NormalizeByEmaState",
    "clip_norm_by_ema",
    "clip_norm_growth",
    "clip_value_by_ema",
    "clip_value_growth",
    "normalize_by_ema",
]

# --- shared pieces --------------------------------------------------------------------------


def _positive(value: Any, name: str, strict: bool = True) -> float | None:
    """None, or ``value`` as a float after checking it is > 0 (>= 0 if not strict)."""
    if value is None:
        return None
    v = real(value, name)
    if not (v > 0 if strict else v >= 0):  # NaN fails both
        raise ValueError(f"{name} must be {'>' if strict else '>='} 0, got {value!r}")
    return v


def _history(state_field: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
    """A per-leaf (or 0-d global) float64 history array of a state, after checking it."""
    if not isinstance(state_field, np.ndarray) or state_field.dtype != np.float64:
        raise TypeError(f"state.{name}: expected a float64 NumPy array, got {type(state_field).__name__}")
    if state_field.shape != shape:
        what = f"one per leaf of {shape[0]} leaves" if shape else "a 0-d array (global mode)"
        raise ValueError(f"state.{name}: shape {state_field.shape} does not match the updates ({what})")
    return state_field


def _history_shape(layout: Layout, tensorwise: bool) -> tuple[int, ...]:
    return (layout.num_leaves,) if tensorwise else ()


def _group_factors(flat: FlatTree, gi: int, per_leaf: np.ndarray) -> np.ndarray:
    """The per-leaf values of group ``gi``, in the group's compute dtype (no float64 variant of a
    float32 kernel is compiled by accident)."""
    dt = flat.groups[gi].dtype
    return per_leaf[flat.layout.group_index[gi]].astype(np.float32 if dt == np.float16 else dt)


def _divide_leaves(flow: Flow, factors: np.ndarray) -> Flow:
    """``flow`` with each leaf divided by its factor (one segmented pass per group); the flow
    itself when every factor is 1."""
    if not np.any(factors != 1.0):
        return flow
    if isinstance(flow.div, dict):  # a device-resident pending factor: apply it first
        flow = flow.settled()
    out = flow.fresh()
    lay = flow.flat.layout
    for gi, (o, g) in enumerate(zip(out.groups, flow.flat.groups)):
        f = _group_factors(flow.flat, gi, factors)
        backend.call("segment_divide_", o, g, flow.div, flow.mul, lay.offsets[gi], f)
    return Flow(out, True, scratch=flow.scratch)


def _divide_all(flow: Flow, factor: float) -> Flow:
    """``flow`` divided by one factor: a pending factor that rides on the next kernel."""
    if factor == 1.0:
        return flow
    if flow.pending:
        flow = flow.settled()
    return flow.with_factor(factor, 1.0)


def _as_inner(inner: Any) -> Any:
    """torchzero's ``inner``: None, a transformation, or a list of them (chained)."""
    if inner is None:
        return None
    if isinstance(inner, (list, tuple)) and not hasattr(inner, "update"):
        from .base import chain

        return chain(*inner)
    if not hasattr(inner, "init") or not hasattr(inner, "update"):
        raise TypeError(f"inner: expected a GradientTransformation or a list of them, got {inner!r}")
    return with_extra_args_support(inner)


def _run_inner(
    inner: Any, flow: Flow, inner_state: Any, params: ParamsRef | None, extra: dict
) -> tuple[Flow, Any]:
    """Runs ``inner`` on the updates without letting it overwrite them (their statistics and
    history still need them), as torchzero scales the inner output by the input's statistics."""
    if inner is None:
        return flow, inner_state
    lay, device = flow.flat.layout, flow.flat.device
    scratch = flow.scratch or (lambda: FlatTree.empty(lay, device=device))
    view = Flow(flow.flat, False, flow.div, flow.mul, returnable=False, scratch=scratch)
    return run_stage(inner, view, inner_state, params, extra, scratch)


# --- clip_norm_by_ema / normalize_by_ema ----------------------------------------------------


class ClipNormByEmaState(NamedTuple):
    """State of `clip_norm_by_ema` and `normalize_by_ema`.

    Attributes:
        exp_avg: the EMA of the updates (shaped like params, each leaf in its dtype).
        prev_ema_norm: float64 norm of the EMA after the last step, one per leaf (0-d in global
            mode); 0 means no history yet. Unused without ``max_ema_growth``.
        inner_state: the state of the ``inner`` transformation (torchzero's ``inner``), or None.
    """

    exp_avg: FlatTree
    prev_ema_norm: np.ndarray
    inner_state: Any = None


NormalizeByEmaState = ClipNormByEmaState


def _ema_norm_transformation(
    beta: float,
    ord: Any,
    tensorwise: bool,
    max_ema_growth: float | None,
    init: float,
    min_norm: float,
    normalize: bool,
    inner: Any = None,
) -> GradientTransformationExtraArgs:
    beta = check_decay(beta, "beta")
    ord = check_ord(ord)
    tensorwise = bool(tensorwise)
    growth = _positive(max_ema_growth, "max_ema_growth")
    min_norm = non_negative(min_norm, "min_norm")
    init = real(init, "init")
    if not math.isfinite(init):
        raise ValueError(f"init must be finite, got {init!r}")
    inner = _as_inner(inner)

    def init_fn(params: Any) -> ClipNormByEmaState:
        layout, device = layout_and_device(params, "params")
        exp_avg = FlatTree.zeros(layout, device=device)
        if init != 0.0:
            exp_avg.fill_(init)
        prev = np.zeros(_history_shape(layout, tensorwise), np.float64)
        return ClipNormByEmaState(exp_avg, prev, inner.init(params) if inner is not None else None)

    def flat_update(
        flow: Flow, state: Any, params: ParamsRef | None, extra: dict
    ) -> tuple[Flow, ClipNormByEmaState]:
        layout = flow.flat.layout
        exp_avg = expect_state(state, ClipNormByEmaState, "exp_avg", layout)
        prev = _history(state.prev_ema_norm, _history_shape(layout, tensorwise), "prev_ema_norm")
        flow = flow.settled()
        t = flow.flat
        # The statistics come from the input; an inner transformation runs before any state is
        # written, so a failing inner leaves the history as it was.
        n = leaf_norms(t, ord) if tensorwise else np.array(tree_norm(t, ord))
        out, inner_state = _run_inner(inner, flow, state.inner_state, params, extra)
        active = np.isfinite(n)
        for gi, (e, g) in enumerate(zip(exp_avg.groups, t.groups)):
            act = active[layout.group_index[gi]] if tensorwise else np.full(len(layout.groups[gi]), active)
            if act.any():
                flags = act.astype(np.uint8)
                backend.call(
                    "segment_ema_update_", e, g, 1.0, 1.0, layout.offsets[gi], flags, 1.0 - beta, beta
                )
        ema_norm = leaf_norms(exp_avg, ord) if tensorwise else np.array(tree_norm(exp_avg, ord))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if growth is not None:
                # No history (0) or a non-finite one: this step's EMA norm is not limited.
                fresh = ~(prev > 0) | ~np.isfinite(prev)
                allowed = np.where(fresh, np.inf, np.maximum(prev * growth, min_norm))
                over = np.isfinite(ema_norm) & (ema_norm > allowed)
                if over.any():
                    ratio = np.where(over, ema_norm / np.where(over, allowed, 1.0), 1.0)
                    _rescale_ema(exp_avg, ratio, tensorwise)
                    ema_norm = np.where(over, allowed, ema_norm)
                prev[...] = np.where(np.isfinite(ema_norm), ema_norm, prev)
            ok = active & (n > TINY) & np.isfinite(ema_norm)
            # An EMA metric of 0 (or a negative 'sum') allows nothing: inf, zeros out.
            denom = n / np.maximum(ema_norm, 0.0)
            if not normalize:
                denom = np.maximum(denom, 1.0)
            denom = np.where(ok, denom, 1.0)
        out = _divide_leaves(out, denom) if tensorwise else _divide_all(out, float(denom))
        return out, ClipNormByEmaState(exp_avg, prev, inner_state)

    return flat_transformation(init_fn, flat_update)


def _rescale_ema(exp_avg: FlatTree, ratio: np.ndarray, tensorwise: bool) -> None:
    """exp_avg /= ratio, per leaf or as a whole, in place."""
    lay = exp_avg.layout
    for gi, e in enumerate(exp_avg.groups):
        if tensorwise:
            f = _group_factors(exp_avg, gi, ratio)
            backend.call("segment_divide_", e, e, 1.0, 1.0, lay.offsets[gi], f)
        else:
            backend.call("scale_", e, e, float(ratio), 1.0)


def clip_norm_by_ema(
    beta: float = 0.99,
    ord: Any = 2,
    tensorwise: bool = True,
    max_ema_growth: float | None = 1.5,
    init: float = 0.0,
    min_norm: float = 1e-6,
) -> GradientTransformationExtraArgs:
    """Clips each update's norm to the norm of an EMA of past updates (torchzero's ClipNormByEMA):

    ``e = beta * e + (1 - beta) * g``; ``u = g / max(1, |g| / |e|)``, per leaf (``tensorwise``)
    or over the whole tree.

    With ``max_ema_growth`` the EMA's norm may grow by at most that factor per step: when
    ``|e| > max(prev * max_ema_growth, min_norm)`` the EMA itself is scaled down to that bound,
    and ``prev`` becomes ``|e|``. A ``prev`` of 0 means no history (the first step, or only zero
    updates so far): that step's EMA is not limited, so a zero first step does not hold the EMA
    at ``min_norm`` for the next ~40 steps as in torchzero. There is no bias correction: with
    ``init=0`` the first output has ``1 - beta`` of the input's norm, as in torchzero.

    A leaf whose norm is non-finite or <= 1e-12 passes through unchanged, and a non-finite leaf
    (or, in global mode, update) does not enter the EMA.

    Args:
        beta: EMA decay, in [0, 1].
        ord: norm order: a number (``inf`` too) or a name (``'l1'``, ``'mad'``, ``'std'``, ...;
            see `numbaccum.clip_norm`), per leaf and global alike.
        tensorwise: a norm per leaf (True) or one over the whole tree.
        max_ema_growth: the largest growth factor of the EMA's norm per step; None: unlimited.
        init: the EMA's initial value (every element).
        min_norm: the smallest norm the growth limit allows.

    Returns:
        A transformation with state `ClipNormByEmaState`.
    """
    return _ema_norm_transformation(beta, ord, tensorwise, max_ema_growth, init, min_norm, False)


def normalize_by_ema(
    beta: float = 0.99,
    ord: Any = 2,
    tensorwise: bool = True,
    max_ema_growth: float | None = 1.5,
    init: float = 0.0,
    min_norm: float = 1e-6,
) -> GradientTransformationExtraArgs:
    """Scales each update to the norm of an EMA of past updates (torchzero's NormalizeByEMA):

    ``e = beta * e + (1 - beta) * g``; ``u = g / (|g| / |e|)``, per leaf or over the whole tree.

    The EMA, its growth limit and the edge cases are those of `clip_norm_by_ema`; unlike it,
    updates smaller than the EMA are scaled up. A zero update stays zero.

    Returns:
        A transformation with state `NormalizeByEmaState`.
    """
    return _ema_norm_transformation(beta, ord, tensorwise, max_ema_growth, init, min_norm, True)


# --- clip_value_by_ema ----------------------------------------------------------------------


class ClipValueByEmaState(NamedTuple):
    """State of `clip_value_by_ema`.

    Attributes:
        count: steps so far (int32, saturating).
        exp_avg: the EMA of ``|updates|`` (shaped like params).
        inner_state: the state of torchzero's ``inner``, or None.
        exp_avg_tfm_state: the state of torchzero's ``exp_avg_tfm``, or None.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    exp_avg: FlatTree
    inner_state: Any = None
    exp_avg_tfm_state: Any = None


def _value_ema_transformation(
    beta: float, init: float, inner: Any = None, exp_avg_tfm: Any = None
) -> GradientTransformationExtraArgs:
    beta = check_decay(beta, "beta")
    init = real(init, "init")
    if not math.isfinite(init):
        raise ValueError(f"init must be finite, got {init!r}")
    inner = _as_inner(inner)
    tfm = _as_inner(exp_avg_tfm)

    def init_fn(params: Any) -> ClipValueByEmaState:
        layout, device = layout_and_device(params, "params")
        return ClipValueByEmaState(
            np.int32(0),
            FlatTree.zeros(layout, device=device),
            inner.init(params) if inner is not None else None,
            tfm.init(params) if tfm is not None else None,
        )

    def flat_update(
        flow: Flow, state: Any, params: ParamsRef | None, extra: dict
    ) -> tuple[Flow, ClipValueByEmaState]:
        layout = flow.flat.layout
        exp_avg = expect_state(state, ClipValueByEmaState, "exp_avg", layout)
        fresh = int(state.count) == 0
        count = safe_increment(state.count)
        if inner is None and tfm is None:  # one fused pass: EMA update and clip
            out = flow.fresh()
            for e, g, o in zip(exp_avg.groups, flow.flat.groups, out.groups):
                backend.call("abs_ema_clip_", e, g, flow.div, flow.mul, 1.0 - beta, beta, init, fresh, o)
            return Flow(out, True, scratch=flow.scratch), ClipValueByEmaState(count, exp_avg)
        if isinstance(flow.div, dict):
            flow = flow.settled()
        u, inner_state = _run_inner(inner, flow, state.inner_state, params, extra)
        for e, g in zip(exp_avg.groups, flow.flat.groups):
            backend.call("abs_ema_update_", e, g, flow.div, flow.mul, 1.0 - beta, beta, init, fresh)
        bound, tfm_state = exp_avg, state.exp_avg_tfm_state
        if tfm is not None:  # the transform sees a copy: the EMA itself stays as it is
            view = Flow(exp_avg, False, returnable=False, scratch=lambda: exp_avg.workspace("tfm"))
            b, tfm_state = run_stage(tfm, view, tfm_state, params, extra, lambda: exp_avg.workspace("tfm"))
            bound = b.settled(exp_avg.workspace("tfm")).flat
        if isinstance(u.div, dict):
            u = u.settled()
        out = u.fresh()
        for o, x, bg in zip(out.groups, u.flat.groups, bound.groups):
            backend.call("clip_by_", o, x, u.div, u.mul, bg)
        new_state = ClipValueByEmaState(count, exp_avg, inner_state, tfm_state)
        return Flow(out, True, scratch=u.scratch), new_state

    return flat_transformation(init_fn, flat_update)


def clip_value_by_ema(beta: float = 0.99, init: float = 0.0) -> GradientTransformationExtraArgs:
    """Clips each element to the EMA of its past magnitudes (torchzero's ClipValueByEMA):

    ``e = beta * e + (1 - beta) * |g|``; ``u = clip(g, -e, e)``; the EMA includes this step.

    ``init`` is a multiplier, as in torchzero: the EMA starts at ``|g_1| * init`` (``init=1``
    leaves the first update unchanged). A non-finite element does not enter the EMA; it is
    clipped (an inf to ``+-e``; a NaN stays NaN). One fused pass over the buffer.

    Args:
        beta: EMA decay, in [0, 1].
        init: the EMA's start, as a multiple of the first update's magnitudes.

    Returns:
        A transformation with state `ClipValueByEmaState`.
    """
    return _value_ema_transformation(beta, init)


# --- clip_norm_growth -----------------------------------------------------------------------


class ClipNormGrowthState(NamedTuple):
    """State of `clip_norm_growth`.

    Attributes:
        prev_norm: float64 norm of the previous (clipped) update, one per leaf (0-d in global
            mode); 0 means no history yet.
    """

    prev_norm: np.ndarray


def _growth_args(
    add: Any, mul: Any, min_value: Any, max_decay: Any
) -> tuple[float | None, float | None, float | None, float | None]:
    add = _positive(add, "add", strict=False)
    mul = _positive(mul, "mul")
    min_value = _positive(min_value, "min_value", strict=False)
    max_decay = _positive(max_decay, "max_decay")
    if max_decay is not None and max_decay < 1.0:
        raise ValueError(f"max_decay must be >= 1 (the history shrinks by at most that), got {max_decay}")
    return add, mul, min_value, max_decay


def clip_norm_growth(
    add: float | None = None,
    mul: float | None = 1.5,
    min_value: float | None = 1e-4,
    max_decay: float | None = 2.0,
    ord: Any = 2,
    tensorwise: bool = True,
) -> GradientTransformationExtraArgs:
    """Limits how fast the update's norm grows (torchzero's ClipNormGrowth):

    ``u = g / max(1, |g| / allowed)`` with ``allowed = min(p + add, mul * p)``,
    ``p = max(prev, min_value)``, per leaf (``tensorwise``) or over the whole tree.

    The history ``prev`` becomes the clipped norm, or ``prev / max_decay`` when the norm fell
    below ``prev / max_decay`` (the history shrinks by at most ``max_decay`` per step). A ``prev``
    of 0 means no history: the first step (and zero updates before any other) pass unchanged.
    ``min_value`` bounds the allowed norm from below, never the divisor: torchzero divides every
    step by ``min_value`` when it is above 1, and collapses after a zero first step. With
    ``add=None, mul=None`` this is the identity. A leaf whose norm is non-finite or <= 1e-12
    passes unchanged; a non-finite norm leaves its history as it was.

    Args:
        add: additive limit (``|u| <= prev + add``); None: none.
        mul: multiplicative limit (``|u| <= prev * mul``); None: none.
        min_value: floor of ``prev`` in the limits; None: none.
        max_decay: the history shrinks by at most this factor per step (>= 1); None: it follows
            the norm.
        ord: norm order: a number or a name, as in `clip_norm_by_ema`.
        tensorwise: a norm per leaf (True) or one over the whole tree.

    Returns:
        A transformation with state `ClipNormGrowthState`.
    """
    add, mul, min_value, max_decay = _growth_args(add, mul, min_value, max_decay)
    ord = check_ord(ord)
    tensorwise = bool(tensorwise)
    identity = add is None and mul is None

    def init_fn(params: Any) -> ClipNormGrowthState:
        layout, _ = layout_and_device(params, "params")
        return ClipNormGrowthState(np.zeros(_history_shape(layout, tensorwise), np.float64))

    def flat_update(
        flow: Flow, state: Any, params: ParamsRef | None, extra: dict
    ) -> tuple[Flow, ClipNormGrowthState]:
        if not isinstance(state, ClipNormGrowthState):
            raise TypeError(f"state: expected ClipNormGrowthState, got {type(state).__name__}")
        layout = flow.flat.layout
        prev = _history(state.prev_norm, _history_shape(layout, tensorwise), "prev_norm")
        if identity:
            return flow, state
        flow = flow.settled()
        n = leaf_norms(flow.flat, ord) if tensorwise else np.array(tree_norm(flow.flat, ord))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            finite = np.isfinite(n)
            history = prev > 0
            p = np.maximum(prev, min_value) if min_value is not None else prev
            allowed = np.full(prev.shape, np.inf)
            if add is not None:
                allowed = p + add
            if mul is not None:
                allowed = np.minimum(allowed, p * mul)
            clipped = finite & history & (n > TINY) & (n > allowed)
            denom = np.where(clipped, n / np.where(clipped, allowed, 1.0), 1.0)
            new = np.where(clipped, allowed, n)
            if max_decay is not None:
                new = np.where(
                    history & (n / np.where(history, prev, 1.0) < 1.0 / max_decay), prev / max_decay, new
                )
            if min_value is not None:
                new = np.where(history, np.maximum(new, min_value), new)
            prev[...] = np.where(finite, new, prev)
        out = _divide_leaves(flow, denom) if tensorwise else _divide_all(flow, float(denom))
        return out, ClipNormGrowthState(prev)

    return flat_transformation(init_fn, flat_update)


# --- clip_value_growth ----------------------------------------------------------------------


class ClipValueGrowthState(NamedTuple):
    """State of `clip_value_growth`.

    Attributes:
        prev: the previous (clipped) update per element, shaped like params; 0 means no history.
    """

    prev: FlatTree


def clip_value_growth(
    add: float | None = None,
    mul: float | None = 1.5,
    min_value: float | None = 1e-4,
    max_decay: float | None = 2.0,
) -> GradientTransformationExtraArgs:
    """Limits how fast each element's magnitude grows (torchzero's ClipValueGrowth):

    ``|u| <= min(|prev| + add, mul * max(|prev|, min_value))``, with g's sign.

    The history ``prev`` becomes ``u``, or ``prev / max_decay`` when the element's growth was
    below ``1 / max_decay``. An element whose ``prev`` is 0 has no history: it passes unchanged
    and starts one (torchzero clips it to ``mul * min_value``, or zeroes it for good with
    ``min_value=None``). With ``add=None, mul=None`` this is the identity. A non-finite element
    never enters the history: with a history it is clipped (an inf to the bound, a NaN stays
    NaN), without one it passes. One fused pass over the buffer.

    Args:
        add: additive limit; None: none.
        mul: multiplicative limit; None: none.
        min_value: floor of ``|prev|`` in the multiplicative limit; None: none.
        max_decay: the history shrinks by at most this factor per step (>= 1); None: it follows
            the update.

    Returns:
        A transformation with state `ClipValueGrowthState`.
    """
    add, mul, min_value, max_decay = _growth_args(add, mul, min_value, max_decay)
    identity = add is None and mul is None
    # The kernel's neutral values: a rule set to these never fires.
    k_add = math.inf if add is None else add
    k_mul = math.inf if mul is None else mul
    k_min = 0.0 if min_value is None else min_value
    k_decay = math.inf if max_decay is None else max_decay

    def init_fn(params: Any) -> ClipValueGrowthState:
        layout, device = layout_and_device(params, "params")
        return ClipValueGrowthState(FlatTree.zeros(layout, device=device))

    def flat_update(
        flow: Flow, state: Any, params: ParamsRef | None, extra: dict
    ) -> tuple[Flow, ClipValueGrowthState]:
        prev = expect_state(state, ClipValueGrowthState, "prev", flow.flat.layout)
        if identity:
            return flow, state
        out = flow.fresh()
        for pg, g, o in zip(prev.groups, flow.flat.groups, out.groups):
            backend.call("growth_clip_", pg, g, flow.div, flow.mul, k_add, k_mul, k_min, k_decay, o)
        return Flow(out, True, scratch=flow.scratch), ClipValueGrowthState(prev)

    return flat_transformation(init_fn, flat_update)
