"""Stateful clipping with torchzero's semantics: by an EMA of past updates, and by growth.

Each clipper keeps a history: an EMA of the updates (a `FlatTree` shaped like params), the
previous update per element, or the previous norm per leaf (a small float64 array; a 0-d array
in global mode). torchzero's behaviour is followed except for its bugs (see
reference/declearn_torchzero.md, Part B):

* The growth clippers' first step has no history (a flag in the state); from then on a previous
  norm (or element) of 0 is a history of 0, limited as in torchzero, except that a limit of
  ``mul * 0`` (``min_value=None``) is not applied: it would hold the value at 0 for good. The EMA
  clippers' stored norm of 0 means "no history yet", so a zero first step never collapses them.
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
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import formulas as F
from . import fuse
from ._checks import flag, non_negative, real, wrong_state
from .backend import Reductions, leaf_tables, ops_for, prepare_divide, prepare_ema
from .base import Stage, as_stage, with_extra_args_support
from .clipping import divide_leaves
from .contract import ONE, Factor
from .declared import check_decay, expect_state, field_owner, safe_increment
from .flat import FlatTree, layout_and_device
from .fuse import Host, Kernel, Scale
from .layout import Layout, compute_dtype
from .norms import TINY, check_ord, leaf_norms, tree_norm
from .protocol import GradientTransformationExtraArgs, state_class
from .runner import Plan, replay, undo_of
from .transaction import current
from .updates import ParamsRef, Spec, Updates

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
    return per_leaf[flat.layout.group_index[gi]].astype(compute_dtype(dt))


def _divide_all(u: Updates, factor: float) -> Updates:
    """``u`` divided by one factor: a pending factor that rides on the next kernel."""
    return u if factor == 1.0 else u.scaled(Factor(factor, 1.0))


def _as_inner(inner: Any) -> Stage | None:
    """torchzero's ``inner``: None, a transformation, or a list of them (chained); as a stage."""
    if inner is None:
        return None
    if isinstance(inner, (list, tuple)) and not hasattr(inner, "update"):
        from .base import chain

        return as_stage(chain(*inner))
    if not hasattr(inner, "init") or not hasattr(inner, "update"):
        raise TypeError(f"inner: expected a GradientTransformation or a list of them, got {inner!r}")
    return as_stage(with_extra_args_support(inner))


class _Inner:
    """An inner transformation of a declared stage (torchzero's ``inner`` or ``exp_avg_tfm``):
    declared once with the stage (its `numbaccum.runner.Plan`, kept in the stage's part,
    ticked each step with the inner state). It writes into ``scratch()`` (a workspace of the
    stage's state), never into the buffer it reads: the stage still needs its input's
    statistics."""

    __slots__ = ("plan", "scratch")

    def __init__(self, stage: Stage, spec: Spec, state: Any, scratch: Callable[[], FlatTree]) -> None:
        self.scratch = scratch
        root = stage.declare(spec, state)  # checks its state: raises naming what is wrong
        self.plan = Plan(root, spec, fuse.enabled(), [scratch] * len(fuse.leaves(root)))
        self.plan.undo = undo_of(stage, root)

    def tick(self, state: Any, params: ParamsRef | None, extra: dict) -> bool:
        """This step's values for the inner ``state`` (False: not the buffers declared for)."""
        return self.plan.tick(state, params, extra)

    def run(self, x: FlatTree, factor: Factor, state: Any) -> tuple[Updates, Any]:
        """The ticked inner step on ``factor(x)``, read-only: ``(updates, new inner state)``."""
        view = Updates(x, False, factor, returnable=False, scratch=self.scratch)
        return replay(self.plan, state, view, None, False)


def _inner_of(stage: Stage | None, spec: Spec, state: Any, owner: FlatTree, name: str) -> _Inner | None:
    """`_Inner` of ``stage`` (None: none), writing into ``owner``'s workspace ``name``."""
    return None if stage is None else _Inner(stage, spec, state, lambda: owner.workspace(name))


def _history_fits(x: Any, shape: tuple[int, ...]) -> bool:
    """Whether `_history` takes ``x`` (a tick's check: the declaration raises what is wrong)."""
    return isinstance(x, np.ndarray) and x.dtype == np.float64 and x.shape == shape


def _holds(state: Any, cls: type, field: str, storage: dict) -> bool:
    """Whether ``state`` is a ``cls`` whose buffer ``field`` has the storage declared for (its
    renewals share it)."""
    return isinstance(state, cls) and getattr(getattr(state, field), "__dict__", None) is storage


def _is_flag(x: Any) -> bool:
    return isinstance(x, (bool, np.bool_))


def _started(x: Any) -> None:
    if not _is_flag(x):
        raise TypeError(f"state.started: expected a bool, got {type(x).__name__}")


# --- clip_norm_by_ema / normalize_by_ema ----------------------------------------------------


@state_class
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
    tensorwise = flag(tensorwise, "tensorwise")
    growth = _positive(max_ema_growth, "max_ema_growth")
    min_norm = non_negative(min_norm, "min_norm")
    init = real(init, "init")
    if not math.isfinite(init):
        raise ValueError(f"init must be finite, got {init!r}")
    return _EmaNorm(
        beta, ord, tensorwise, growth, init, min_norm, normalize, _as_inner(inner)
    ).transformation()


class _EmaNorm(Stage):
    """`clip_norm_by_ema` and `normalize_by_ema` (``normalize``); ``exp_avg`` owns the workspaces."""

    def __init__(
        self,
        beta: float,
        ord: float | str,
        tensorwise: bool,
        growth: float | None,
        init: float,
        min_norm: float,
        normalize: bool,
        inner: Stage | None,
    ) -> None:
        self.beta, self.ord, self.tensorwise, self.growth = beta, ord, tensorwise, growth
        self.init_value, self.min_norm, self.normalize, self.inner = init, min_norm, normalize, inner

    def init(self, params: Any) -> ClipNormByEmaState:
        layout, device = layout_and_device(params, "params")
        exp_avg = FlatTree.zeros(layout, device=device)
        if self.init_value != 0.0:
            exp_avg.fill_(self.init_value)
        prev = np.zeros(_history_shape(layout, self.tensorwise), np.float64)
        inner_state = self.inner.init(params) if self.inner is not None else None
        return ClipNormByEmaState(exp_avg, prev, inner_state)

    def owner(self, state: Any) -> FlatTree | None:
        return field_owner(state, ClipNormByEmaState, "exp_avg")

    def declare(self, spec: Spec, state: Any) -> Host:
        """A `numbaccum.fuse.Host` over ``state.exp_avg`` (checked here, with the history and
        the inner transformation, declared once too); its tick checks the state is the one
        declared for, renews the EMA and ticks the inner transformation."""
        exp_avg = expect_state(state, ClipNormByEmaState, "exp_avg", spec, renew=False)
        shape = _history_shape(spec.layout, self.tensorwise)
        _history(state.prev_ema_norm, shape, "prev_ema_norm")
        inner = _inner_of(self.inner, spec, state.inner_state, exp_avg, "inner")
        storage = exp_avg.__dict__
        now: list = [None, None, None]  # this step's EMA (renewed), history and inner state

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not _holds(state, ClipNormByEmaState, "exp_avg", storage):
                return False
            prev, inner_state = state.prev_ema_norm, state.inner_state
            if not _history_fits(prev, shape):
                return False
            if inner is not None and not inner.tick(inner_state, params, extra):
                return False
            now[:] = current(state.exp_avg, "exp_avg"), prev, inner_state
            return True

        passes = (
            ("reduction", "norms of the updates", 1.0, 0.0),
            ("kernel", "EMA", 2.0, 1.0),
            ("reduction", "norms of the EMA", 1.0, 0.0),
            ("kernel", "scale", 1.0, 1.0),
        )
        sums = Reductions()  # the EMA's update and the divisions, kept for their buffers
        run = lambda u: self._run(u, now[0], now[1], now[2], inner, sums)  # noqa: E731
        name = "normalize_by_ema" if self.normalize else "clip_norm_by_ema"
        return Host(run, passes, name, tick, pending=not self.tensorwise)

    def _run(
        self,
        u: Updates,
        exp_avg: FlatTree,
        prev: np.ndarray,
        inner_state: Any,
        inner: _Inner | None,
        sums: Reductions,
    ) -> tuple[Updates, ClipNormByEmaState]:
        beta, ord, tensorwise, growth = self.beta, self.ord, self.tensorwise, self.growth
        min_norm, normalize = self.min_norm, self.normalize
        layout = exp_avg.layout
        u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
        t = u.flat
        # The statistics come from the input, before the inner transformation runs.
        n = leaf_norms(t, ord) if tensorwise else np.array(tree_norm(t, ord))
        out = u
        if inner is not None:
            out, inner_state = inner.run(t, u.factor, inner_state)
        active = np.isfinite(n)
        for gi, (e, g, table) in enumerate(zip(exp_avg.groups, t.groups, leaf_tables(layout))):
            act = active[layout.group_index[gi]] if tensorwise else np.full(len(layout.groups[gi]), active)
            if act.any():
                sums.call(gi, prepare_ema, (e, g, table), ONE, act.astype(np.uint8), 1.0 - beta, beta)
        ema_norm = leaf_norms(exp_avg, ord) if tensorwise else np.array(tree_norm(exp_avg, ord))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if growth is not None:
                # No history (0) or a non-finite one: this step's EMA norm is not limited.
                fresh = ~(prev > 0) | ~np.isfinite(prev)
                allowed = np.where(fresh, np.inf, np.maximum(prev * growth, min_norm))
                over = np.isfinite(ema_norm) & (ema_norm > allowed)
                if over.any():
                    ratio = np.where(over, ema_norm / np.where(over, allowed, 1.0), 1.0)
                    _rescale_ema(exp_avg, ratio, tensorwise, sums)
                    ema_norm = np.where(over, allowed, ema_norm)
                prev[...] = np.where(np.isfinite(ema_norm), ema_norm, prev)
            ok = active & (n > TINY) & np.isfinite(ema_norm)
            # An EMA metric of 0 (or a negative 'sum') allows nothing: inf, zeros out.
            denom = n / np.maximum(ema_norm, 0.0)
            if not normalize:
                denom = np.maximum(denom, 1.0)
            denom = np.where(ok, denom, 1.0)
        out = divide_leaves(out, denom, sums) if tensorwise else _divide_all(out, float(denom))
        return out, ClipNormByEmaState(exp_avg, prev, inner_state)


def _rescale_ema(exp_avg: FlatTree, ratio: np.ndarray, tensorwise: bool, sums: Reductions) -> None:
    """exp_avg /= ratio, per leaf or as a whole, in place (``sums``: the stage's kept calls)."""
    for gi, (e, table) in enumerate(zip(exp_avg.groups, leaf_tables(exp_avg.layout))):
        if tensorwise:
            f = _group_factors(exp_avg, gi, ratio)
            sums.call(("ema", gi), prepare_divide, (e, e, table), ONE, f)
        else:
            ops_for(e).scale_(e, e, Factor(float(ratio), 1.0))


def clip_norm_by_ema(
    beta: float = 0.99,
    ord: Any = 2,
    tensorwise: bool = True,
    max_ema_growth: float | None = 1.5,
    init: float = 0.0,
    min_norm: float = 1e-6,
) -> GradientTransformationExtraArgs:
    """Clips each update's norm to the norm of an EMA of past updates (torchzero's ClipNormByEMA).

    ``e = beta * e + (1 - beta) * g``; ``u = g / max(1, |g| / |e|)``, per leaf (``tensorwise``)
    or over the whole tree, with ``|.|`` the norm ``ord`` and ``e`` the EMA after this step's
    update (and after the growth limit below).

    With ``max_ema_growth`` the EMA's norm may grow by at most that factor per step: when
    ``|e| > max(prev * max_ema_growth, min_norm)`` the EMA itself is scaled down to that bound,
    and ``prev`` becomes ``|e|``. A ``prev`` of 0 means no history (the first step, or only zero
    updates so far): that step's EMA is not limited, so a zero first step does not hold the EMA
    at ``min_norm`` for the next ~40 steps as in torchzero. There is no bias correction: with
    ``init=0`` the first output has ``1 - beta`` of the input's norm, as in torchzero.

    A leaf whose norm is non-finite or <= 1e-12 passes through unchanged, and a non-finite leaf
    (or, in global mode, update) does not enter the EMA.

    Args:
        beta: EMA decay, in 0 .. 1.
        ord: norm order: a number (``inf`` too) or a name (``'l1'``, ``'mad'``, ``'std'``, ...;
            see `numbaccum.clip_norm`), per leaf and global alike.
        tensorwise: a norm per leaf (True) or one over the whole tree.
        max_ema_growth: the largest growth factor of the EMA's norm per step; None: unlimited.
        init: the EMA's initial value (every element).
        min_norm: the smallest norm the growth limit allows.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ClipNormByEmaState(exp_avg,
            prev_ema_norm, inner_state=None)``.

    Raises:
        ValueError: ``beta`` outside 0 .. 1, an unknown ``ord``, ``max_ema_growth <= 0``, a
            negative ``min_norm``, or a non-finite ``init``.
        TypeError: a hyperparameter that is not a real number, or ``tensorwise`` not a bool.

    References:
        torchzero's ``ClipNormByEMA``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.clip_norm_by_ema(beta=0.5)
        >>> state = tx.init(params)
        >>> for g in ([3.0, 4.0], [6.0, 8.0]):
        ...     updates, state = tx.update({"w": np.array(g)}, state)
        ...     print([round(float(x), 4) for x in updates["w"]], float(state.prev_ema_norm[0]))
        [1.5, 2.0] 2.5
        [2.25, 3.0] 3.75

        The first EMA is ``(1.5, 2)`` (norm 2.5); the second would have norm 6.25, above
        ``2.5 * 1.5 = 3.75``, so it is scaled down to norm 3.75 and the update of norm 10 with it.
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
    """Scales each update to the norm of an EMA of past updates (torchzero's NormalizeByEMA).

    ``e = beta * e + (1 - beta) * g``; ``u = g / (|g| / |e|)``, per leaf or over the whole tree,
    with ``|.|`` the norm ``ord`` and ``e`` the EMA after this step's update (and after the
    growth limit).

    The EMA, its growth limit and the edge cases are those of `clip_norm_by_ema`; unlike it,
    updates smaller than the EMA are scaled up. A zero update stays zero.

    Args:
        beta: EMA decay, in 0 .. 1.
        ord: norm order: a number or a name, as in `clip_norm_by_ema`.
        tensorwise: a norm per leaf (True) or one over the whole tree.
        max_ema_growth: the largest growth factor of the EMA's norm per step; None: unlimited.
        init: the EMA's initial value (every element).
        min_norm: the smallest norm the growth limit allows.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``NormalizeByEmaState(exp_avg,
            prev_ema_norm, inner_state=None)`` (the same class as `ClipNormByEmaState`).

    Raises:
        ValueError: ``beta`` outside 0 .. 1, an unknown ``ord``, ``max_ema_growth <= 0``, a
            negative ``min_norm``, or a non-finite ``init``.
        TypeError: a hyperparameter that is not a real number, or ``tensorwise`` not a bool.

    References:
        torchzero's ``NormalizeByEMA``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.normalize_by_ema(beta=0.5)
        >>> state = tx.init(params)
        >>> for g in ([3.0, 4.0], [0.3, 0.4]):
        ...     updates, state = tx.update({"w": np.array(g)}, state)
        ...     print([round(float(x), 4) for x in updates["w"]])
        [1.5, 2.0]
        [0.9, 1.2]

        The second EMA is ``(0.9, 1.2)``, of norm 1.5: the small update is scaled up to it.
    """
    return _ema_norm_transformation(beta, ord, tensorwise, max_ema_growth, init, min_norm, True)


# --- clip_value_by_ema ----------------------------------------------------------------------


@state_class
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
    return _ValueEma(beta, init, _as_inner(inner), _as_inner(exp_avg_tfm)).transformation()


class _ValueEma(Stage):
    """`clip_value_by_ema` (with torchzero's ``inner`` and ``exp_avg_tfm``); ``exp_avg`` owns the
    workspaces."""

    formulas = (F.abs_ema_clip,)  # its kernel without inner transformations (`_value_ema_kernel`)

    def __init__(self, beta: float, init: float, inner: Stage | None, tfm: Stage | None) -> None:
        self.beta, self.init_value, self.inner, self.tfm = beta, init, inner, tfm

    def init(self, params: Any) -> ClipValueByEmaState:
        layout, device = layout_and_device(params, "params")
        return ClipValueByEmaState(
            np.int32(0),
            FlatTree.zeros(layout, device=device),
            self.inner.init(params) if self.inner is not None else None,
            self.tfm.init(params) if self.tfm is not None else None,
        )

    def owner(self, state: Any) -> FlatTree | None:
        return field_owner(state, ClipValueByEmaState, "exp_avg")

    def declare(self, spec: Spec, state: Any) -> Kernel | Host:
        """Over ``state.exp_avg`` (checked here): the `numbaccum.fuse.Kernel` of the EMA update
        and the clip in one pass (fused with its neighbours), or, with inner transformations
        (declared once too), a `numbaccum.fuse.Host`; its tick renews the EMA, counts and
        ticks them."""
        declared = expect_state(state, ClipValueByEmaState, "exp_avg", spec, renew=False)
        beta, init = self.beta, self.init_value
        if self.inner is None and self.tfm is None:
            return _value_ema_kernel(declared, beta, init, len(spec.layout.groups))
        inner = _inner_of(self.inner, spec, state.inner_state, declared, "inner")
        tfm = _inner_of(self.tfm, spec, state.exp_avg_tfm_state, declared, "tfm")
        storage = declared.__dict__
        now: list = [None] * 5  # this step's EMA (renewed), first step?, count, inner states

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not _holds(state, ClipValueByEmaState, "exp_avg", storage):
                return False
            if inner is not None and not inner.tick(state.inner_state, params, extra):
                return False
            if tfm is not None and not tfm.tick(state.exp_avg_tfm_state, params, extra):
                return False
            exp_avg = current(state.exp_avg, "exp_avg")
            fresh = int(state.count) == 0
            now[:] = exp_avg, fresh, safe_increment(state.count), state.inner_state, state.exp_avg_tfm_state
            return True

        def run(u: Updates) -> tuple[Updates, ClipValueByEmaState]:
            exp_avg, fresh, count, inner_state, tfm_state = now
            factor = u.factor
            if factor.device is not None:  # the inner transformation reads a settled value
                u, factor = u.settled(), ONE
            v = u
            if inner is not None:
                v, inner_state = inner.run(u.flat, factor, inner_state)
            for e, g in zip(exp_avg.groups, u.flat.groups):
                ops_for(e).abs_ema_update_(e, g, factor, 1.0 - beta, beta, init, fresh)
            bound = exp_avg
            if tfm is not None:  # the transform sees a copy: the EMA itself stays as it is
                b, tfm_state = tfm.run(exp_avg, ONE, tfm_state)
                bound = b.settled(tfm.scratch()).flat
            v_factor = v.factor
            if v_factor.device is not None:
                v, v_factor = v.settled(), ONE
            out = v.fresh()
            for o, x, bg in zip(out.groups, v.flat.groups, bound.groups):
                ops_for(x).clip_by_(o, x, v_factor, bg)
            return Updates(out, True), ClipValueByEmaState(count, exp_avg, inner_state, tfm_state)

        passes = (("kernel", "EMA of |updates|", 2.0, 1.0), ("kernel", "clip", 2.0, 1.0))
        return Host(run, passes, "clip_value_by_ema", tick, settles=False)


def _value_ema_kernel(exp_avg: FlatTree, beta: float, init: float, n_groups: int) -> Kernel:
    """`clip_value_by_ema` without inner transformations: the formula ``abs_ema_clip`` over
    ``exp_avg``; its tick renews the EMA and counts (the first step starts it from ``init``)."""
    part = Kernel(F.abs_ema_clip, (exp_avg,), [], name="clip_value_by_ema")
    storage = exp_avg.__dict__

    def tick(state: Any, params: Any, extra: dict) -> bool:
        if not _holds(state, ClipValueByEmaState, "exp_avg", storage):
            return False
        part.scalars = [(1.0 - beta, beta, init, int(state.count) == 0)] * n_groups
        part.new_state = ClipValueByEmaState(safe_increment(state.count), current(state.exp_avg, "exp_avg"))
        return True

    part.tick = tick
    return part


def clip_value_by_ema(beta: float = 0.99, init: float = 0.0) -> GradientTransformationExtraArgs:
    """Clips each element to the EMA of its past magnitudes (torchzero's ClipValueByEMA).

    ``e = beta * e + (1 - beta) * |g|``; ``u = clip(g, -e, e)``, element by element; the EMA
    includes this step.

    ``init`` is a multiplier, as in torchzero: the EMA starts at ``|g_1| * init`` (``init=1``
    leaves the first update unchanged). A non-finite element does not enter the EMA; it is
    clipped (an inf to ``+-e``; a NaN stays NaN). One fused pass over the buffer.

    Args:
        beta: EMA decay, in 0 .. 1.
        init: the EMA's start, as a multiple of the first update's magnitudes.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ClipValueByEmaState(count, exp_avg,
            inner_state=None, exp_avg_tfm_state=None)``.

    Raises:
        ValueError: ``beta`` outside 0 .. 1, or a non-finite ``init``.
        TypeError: ``beta`` or ``init`` is not a real number.

    References:
        torchzero's ``ClipValueByEMA``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.clip_value_by_ema(beta=0.5, init=1.0)
        >>> state = tx.init(params)
        >>> for g in ([1.0, -2.0], [4.0, -1.0]):
        ...     updates, state = tx.update({"w": np.array(g)}, state)
        ...     print([round(float(x), 4) for x in updates["w"]])
        [1.0, -2.0]
        [2.5, -1.0]

        The EMA starts at ``(1, 2)``, then becomes ``0.5 * (4, 1) + 0.5 * (1, 2) = (2.5, 1.5)``:
        4 is clipped to 2.5, -1 is kept.
    """
    return _value_ema_transformation(beta, init)


# --- clip_norm_growth -----------------------------------------------------------------------


@state_class
class ClipNormGrowthState(NamedTuple):
    """State of `clip_norm_growth`.

    Attributes:
        prev_norm: float64 norm of the previous (clipped) update, one per leaf (0-d in global
            mode).
        started: False until the first update: that update has no history (it passes and its
            norm becomes ``prev_norm``); from then on a ``prev_norm`` of 0 is a history of 0.
        layout: the layout of the tree the state was built for (an update of another tree,
            even with as many leaves, is refused).
    """

    prev_norm: np.ndarray
    started: np.bool_
    layout: Layout


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
    """Limits how fast the update's norm grows (torchzero's ClipNormGrowth).

    ``u = g / max(1, |g| / allowed)`` with ``allowed = min(p + add, mul * p)``,
    ``p = max(prev, min_value)``, per leaf (``tensorwise``) or over the whole tree.

    The history ``prev`` becomes the clipped norm, or ``prev / max_decay`` when the norm fell
    below ``prev / max_decay`` (the history shrinks by at most ``max_decay`` per step), floored
    at ``min_value``. The first update has no history (a flag in the state): it passes unchanged
    and its norm becomes ``prev``, as in torchzero. From then on torchzero's rule holds even from
    a ``prev`` of 0 (growth from zero is what the limit is for): after a zero first step the
    norm may grow to ``mul * min_value``, ``1.5e-4`` by default. ``min_value`` bounds the allowed
    norm from below, never the divisor: torchzero divides every step by ``min_value`` when it is
    above 1 (and zeroes the second step after a zero first one). Where the multiplicative limit
    would be ``mul * 0`` (``prev == 0`` with ``min_value=None``) it is not applied: torchzero
    would hold that leaf at 0 for good. With ``add=None, mul=None`` this is the identity. A leaf
    whose norm is non-finite or <= 1e-12 passes unchanged; a non-finite norm leaves its history
    as it was.

    Args:
        add: additive limit (``|u| <= prev + add``); None: none.
        mul: multiplicative limit (``|u| <= prev * mul``); None: none.
        min_value: floor of ``prev`` in the limits; None: none.
        max_decay: the history shrinks by at most this factor per step (>= 1); None: it follows
            the norm.
        ord: norm order: a number or a name, as in `clip_norm_by_ema`.
        tensorwise: a norm per leaf (True) or one over the whole tree.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ClipNormGrowthState(prev_norm,
            started, layout)``.

    Raises:
        ValueError: a negative ``add`` or ``min_value``, ``mul <= 0``, ``max_decay < 1``, an
            unknown ``ord``; at ``update``, a state built for another tree.
        TypeError: a hyperparameter that is not a real number, or ``tensorwise`` not a bool.

    References:
        torchzero's ``ClipNormGrowth``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.clip_norm_growth(mul=2.0)
        >>> state = tx.init(params)
        >>> for g in ([3.0, 4.0], [30.0, 40.0]):
        ...     updates, state = tx.update({"w": np.array(g)}, state)
        ...     print([round(float(x), 4) for x in updates["w"]], float(state.prev_norm[0]))
        [3.0, 4.0] 5.0
        [6.0, 8.0] 10.0

        The first update passes (norm 5); the second, of norm 50, is clipped to ``2 * 5``.
    """
    add, mul, min_value, max_decay = _growth_args(add, mul, min_value, max_decay)
    ord = check_ord(ord)
    tensorwise = flag(tensorwise, "tensorwise")
    return _NormGrowth(add, mul, min_value, max_decay, ord, tensorwise).transformation()


class _NormGrowth(Stage):
    """`clip_norm_growth`: the history is a small float64 array (no FlatTree, no workspace owner)."""

    def __init__(
        self,
        add: float | None,
        mul: float | None,
        min_value: float | None,
        max_decay: float | None,
        ord: float | str,
        tensorwise: bool,
    ) -> None:
        self.add, self.mul, self.min_value, self.max_decay = add, mul, min_value, max_decay
        self.ord, self.tensorwise = ord, tensorwise

    def init(self, params: Any) -> ClipNormGrowthState:
        layout, _ = layout_and_device(params, "params")
        prev = np.zeros(_history_shape(layout, self.tensorwise), np.float64)
        return ClipNormGrowthState(prev, np.bool_(False), layout)

    def declare(self, spec: Spec, state: Any) -> Host | Scale:
        """A `numbaccum.fuse.Host` (a `Scale` of one for the identity; the state checked here:
        its type, tree and history); its tick takes the step's state (of scalars: any state of
        the tree declared for)."""
        layout = spec.layout
        if not isinstance(state, ClipNormGrowthState):
            raise wrong_state("ClipNormGrowthState", state)
        if state.layout is not layout:  # as many leaves is not enough: the same tree
            raise ValueError(
                f"state: it was built for another tree ({state.layout!r}) than the updates ({layout!r})"
            )
        shape = _history_shape(layout, self.tensorwise)
        _history(state.prev_norm, shape, "prev_norm")
        _started(state.started)
        part: Any
        if self.add is None and self.mul is None:  # the identity: nothing at all, the state passes
            part = Scale(ONE, name="clip_norm_growth")
        else:

            sums = Reductions()  # the divisions, kept for their buffers

            def run(u: Updates) -> tuple[Updates, ClipNormGrowthState]:
                state = part.new_state  # the tick's
                return self._run(u, state.prev_norm, bool(state.started), layout, sums)

            passes = (("reduction", "norms", 1.0, 0.0), ("kernel", "scale", 1.0, 1.0))
            part = Host(run, passes, "clip_norm_growth", pending=not self.tensorwise)

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not isinstance(state, ClipNormGrowthState) or state.layout is not layout:
                return False
            if not _history_fits(state.prev_norm, shape) or not _is_flag(state.started):
                return False
            part.new_state = state  # (the Host's run replaces it by the state it returns)
            return True

        part.tick = tick
        return part

    def _run(
        self, u: Updates, prev: np.ndarray, started: bool, layout: Layout, sums: Reductions
    ) -> tuple[Updates, ClipNormGrowthState]:
        add, mul, min_value, max_decay = self.add, self.mul, self.min_value, self.max_decay
        ord, tensorwise = self.ord, self.tensorwise
        u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
        n = leaf_norms(u.flat, ord) if tensorwise else np.array(tree_norm(u.flat, ord))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            finite = np.isfinite(n)
            history = np.full(prev.shape, started)
            p = np.maximum(prev, min_value) if min_value is not None else prev
            allowed = np.full(prev.shape, np.inf)
            if add is not None:
                allowed = p + add
            if mul is not None:  # mul * 0 would hold the norm at 0 for good: not applied then
                allowed = np.minimum(allowed, np.where(p > 0, p * mul, np.inf))
            clipped = finite & history & (n > TINY) & (n > allowed)
            denom = np.where(clipped, n / np.where(clipped, allowed, 1.0), 1.0)
            new = np.where(clipped, allowed, n)
            if max_decay is not None:  # n / 0 is inf or NaN: never a decay
                new = np.where(history & (n / prev < 1.0 / max_decay), prev / max_decay, new)
            if min_value is not None:
                new = np.where(history, np.maximum(new, min_value), new)
            prev[...] = np.where(finite, new, prev)
        out = divide_leaves(u, denom, sums) if tensorwise else _divide_all(u, float(denom))
        return out, ClipNormGrowthState(prev, np.bool_(True), layout)


# --- clip_value_growth ----------------------------------------------------------------------


@state_class
class ClipValueGrowthState(NamedTuple):
    """State of `clip_value_growth`.

    Attributes:
        prev: the previous (clipped) update per element, shaped like params.
        started: False until the first update: that update has no history (it passes and becomes
            ``prev``); from then on a ``prev`` of 0 is a history of 0.
    """

    prev: FlatTree
    started: np.bool_


def clip_value_growth(
    add: float | None = None,
    mul: float | None = 1.5,
    min_value: float | None = 1e-4,
    max_decay: float | None = 2.0,
) -> GradientTransformationExtraArgs:
    """Limits how fast each element's magnitude grows (torchzero's ClipValueGrowth).

    ``|u| = min(|g|, |prev| + add, mul * max(|prev|, min_value))``, with g's sign, element by
    element (a limit that is None is not applied).

    The history ``prev`` becomes ``u``, or ``prev / max_decay`` when the element's growth was
    below ``1 / max_decay``. The first update has no history (a flag in the state): it passes
    unchanged and becomes ``prev``, as in torchzero. From then on torchzero's rule holds even
    from a ``prev`` of 0 (a sparse row of an embedding is the common case): ``0 -> 5`` gives
    ``1.5e-4`` by default and ``1`` with ``add=1, mul=None``. Where the multiplicative limit
    would be ``mul * 0`` (``prev == 0`` with ``min_value=None``) it is not applied: torchzero
    zeroes such an element for good. With ``add=None, mul=None`` this is the identity. A
    non-finite element never enters the history: with a history it is clipped (an inf to the
    bound, a NaN stays NaN), on the first update it passes. One fused pass over the buffer.

    Args:
        add: additive limit; None: none.
        mul: multiplicative limit; None: none.
        min_value: floor of ``|prev|`` in the multiplicative limit; None: none.
        max_decay: the history shrinks by at most this factor per step (>= 1); None: it follows
            the update.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ClipValueGrowthState(prev,
            started)``.

    Raises:
        ValueError: a negative ``add`` or ``min_value``, ``mul <= 0``, or ``max_decay < 1``.
        TypeError: a hyperparameter that is not a real number.

    References:
        torchzero's ``ClipValueGrowth``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.clip_value_growth(mul=2.0)
        >>> state = tx.init(params)
        >>> for g in ([1.0, -2.0], [5.0, -3.0]):
        ...     updates, state = tx.update({"w": np.array(g)}, state)
        ...     print([round(float(x), 4) for x in updates["w"]])
        [1.0, -2.0]
        [2.0, -3.0]

        The first update passes; then 5 may grow to at most ``2 * 1``, and -3 (1.5 times -2) is
        kept.
    """
    return _ValueGrowth(*_growth_args(add, mul, min_value, max_decay)).transformation()


class _ValueGrowth(Stage):
    """`clip_value_growth`: one fused pass; ``prev`` owns the workspaces."""

    formulas = (F.growth_clip,)  # the pass `declare` makes

    def __init__(
        self, add: float | None, mul: float | None, min_value: float | None, max_decay: float | None
    ) -> None:
        self.identity = add is None and mul is None
        # The kernel's neutral values: a rule set to these never fires.
        self.k_add = math.inf if add is None else add
        self.k_mul = math.inf if mul is None else mul
        self.k_min = 0.0 if min_value is None else min_value
        self.k_decay = math.inf if max_decay is None else max_decay

    def init(self, params: Any) -> ClipValueGrowthState:
        layout, device = layout_and_device(params, "params")
        return ClipValueGrowthState(FlatTree.zeros(layout, device=device), np.bool_(False))

    def owner(self, state: Any) -> FlatTree | None:
        return field_owner(state, ClipValueGrowthState, "prev")

    def declare(self, spec: Spec, state: Any) -> Kernel | Scale:
        """The `numbaccum.fuse.Kernel` of the formula ``growth_clip`` over ``state.prev``
        (checked here; fused with its neighbours), a `Scale` of one for the identity; its tick
        renews the buffer and gives the step's limits (the first step has no history)."""
        declared = expect_state(state, ClipValueGrowthState, "prev", spec, renew=False)
        _started(state.started)
        storage, n_groups = declared.__dict__, len(spec.layout.groups)
        limits = (self.k_add, self.k_mul, self.k_min, self.k_decay)
        identity = self.identity
        part: Any = Scale(ONE, name="clip_value_growth") if identity else None
        if not identity:
            part = Kernel(F.growth_clip, (declared,), [], name="clip_value_growth")

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not _holds(state, ClipValueGrowthState, "prev", storage) or not _is_flag(state.started):
                return False
            prev = current(state.prev, "prev")
            if identity:
                part.new_state = state._replace(prev=prev)
                return True
            part.scalars = [(*limits, not state.started)] * n_groups
            part.new_state = ClipValueGrowthState(prev, np.bool_(True))
            return True

        part.tick = tick
        return part
