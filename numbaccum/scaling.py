"""Factors on the updates: `identity`, `scale`, learning rates (`scale_by_learning_rate`, a
constant or a schedule) and decoupled weight decay (`add_decayed_weights`).

Each declares a part of the plan (`numbaccum.fuse`): a factor (`Scale`) that rides on the next
kernel instead of a pass of its own, or weight decay's kernel that reads the params. A schedule
is called by the part's tick, before any buffer is written, so a schedule that raises leaves the
state as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _bounded
from . import formulas as F
from ._checks import flag, real, real_or_schedule, scheduled, transformation, wrong_state
from .base import Stage
from .contract import ONE, Factor
from .declared import Elementwise, safe_increment
from .flat import FlatTree, to_device
from .formulas import formula
from .fuse import Kernel, Scale
from .masking import MaskedState, _mask_leaf, _Masked, _Partition, masked
from .protocol import EmptyState, GradientTransformationExtraArgs, state_class
from .traits import ELEMENT
from .tree import tree_map
from .updates import ParamsRef, Spec

__all__ = [
    "ScaleByScheduleState",
    "WeightDecaySchedule",
    "add_decayed_weights",
    "freeze",
    "identity",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "selective_transform",
    "set_to_zero",
]

ScalarOrSchedule = float | Callable[[Any], Any]


class _Identity(Stage):
    scope = ELEMENT
    complex_leaves = True  # optax defines it on complex leaves

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def declare(self, spec: Spec, state: Any) -> Scale:
        return _passing(Scale(ONE, None, "identity"))


def _passing(part: Scale) -> Scale:
    """``part`` with the tick of a stateless factor: the state passes through."""

    def tick(state: Any, params: Any, extra: dict) -> bool:
        part.new_state = state
        return True

    part.tick = tick
    return part


def identity() -> GradientTransformationExtraArgs:
    """Returns the updates unchanged.

    Each update returns ``u = g`` (the same values; no pass of its own inside a chain). It is
    stateless.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    References:
        optax.identity.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.identity()
        >>> state = tx.init({"w": np.zeros(2, np.float32)})
        >>> u, state = tx.update({"w": np.array([1.0, -2.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]
        [1.0, -2.0]
    """
    return _Identity().transformation()


class _Scale(Stage):
    """``u = step_size * g``: a pending factor that rides on the next kernel (no pass of its own)."""

    scope = ELEMENT
    complex_leaves = True  # optax defines it on complex leaves

    def __init__(self, step_size: float) -> None:
        self.step_size = real(step_size, "step_size")
        # cast to each leaf's dtype as optax's `step_size * g` casts it (issue 47: 1e-38 is a
        # float32 subnormal, 1e39 is inf), not balanced into float32's range
        self.factor = Factor(1.0, self.step_size, cast=True)

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def declare(self, spec: Spec, state: Any) -> Scale:
        return _passing(Scale(self.factor, None, "scale"))


def scale(step_size: float) -> GradientTransformationExtraArgs:
    """Scales the updates by a constant factor.

    Each update returns ``u = step_size * g``. It is stateless, and inside a chain the factor
    rides on the next kernel instead of a pass of its own.

    Args:
        step_size: the factor (a real number).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        TypeError: ``step_size`` is not a real number (a bool, a string, None, an array of
            several values).

    References:
        optax.scale.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale(0.5)
        >>> state = tx.init({"w": np.zeros(2, np.float32)})
        >>> u, state = tx.update({"w": np.array([1.0, -2.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]
        [0.5, -1.0]
    """
    return _Scale(step_size).transformation()


@state_class
class ScaleByScheduleState(NamedTuple):
    """The state of `scale_by_learning_rate` with a schedule: its step count.

    Attributes:
        count: updates so far, the argument of the schedule at the next update (int32,
            saturating at the int32 maximum); 0 after ``init``.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax


class _ScaleBySchedule(Stage):
    """``u = sign * schedule(count) * g``; each step's tick calls the schedule."""

    scope = ELEMENT
    complex_leaves = True  # optax defines it on complex leaves

    def __init__(self, schedule: Callable[[Any], Any], sign: float, what: str = "learning_rate") -> None:
        self.schedule = schedule
        self.sign = sign
        self.what = what  # the argument an error about the schedule's value names

    def init(self, params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(np.int32(0))

    def declare(self, spec: Spec, state: Any) -> Scale:
        if not isinstance(state, ScaleByScheduleState):
            raise wrong_state("ScaleByScheduleState", state)
        part = Scale(ONE, None, "scale_by_schedule")
        schedule, sign, what = self.schedule, self.sign, self.what

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not isinstance(state, ScaleByScheduleState):
                return False
            part.factor = Factor(1.0, sign * scheduled(schedule, state.count, what), cast=True)  # as `_Scale`
            part.new_state = ScaleByScheduleState(safe_increment(state.count))
            return True

        part.tick = tick
        return part


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformationExtraArgs:
    """Scales the updates by the learning rate, a constant or a schedule of the step count.

    Each update returns ``u = -learning_rate * g``, or ``u = learning_rate * g`` with
    ``flip_sign=False``. With a schedule, ``learning_rate`` is ``learning_rate(count)`` with the
    state's ``count`` (0 at the first update), then ``count = count + 1``.

    Args:
        learning_rate: a real number, or a schedule of the step count (``fn(count) -> float``).
            (optax also takes None, for no scaling at all: refused here, where it is more often
            a missing value than a wish; `adadelta` keeps optax's None.)
        flip_sign: negate the learning rate (descent), as optimizers do.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()`` for a constant (it is
            ``scale(-learning_rate)``), ``ScaleByScheduleState(count)`` for a schedule.

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor callable, or ``flip_sign`` is
            not a bool; at an update, a schedule returned something other than a real number.

    References:
        optax.scale_by_learning_rate.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_learning_rate(lambda count: 0.1 / (1 + count))
        >>> state = tx.init({"w": np.zeros(2, np.float32)})
        >>> g = {"w": np.array([1.0, -2.0], np.float32)}
        >>> u, state = tx.update(g, state)
        >>> [round(float(x), 4) for x in u["w"]]  # -0.1 * g
        [-0.1, 0.2]
        >>> u, state = tx.update(g, state)
        >>> [round(float(x), 4) for x in u["w"]]  # -0.05 * g
        [-0.05, 0.1]
    """
    sign = -1.0 if flag(flip_sign, "flip_sign") else 1.0
    learning_rate = real_or_schedule(learning_rate, "learning_rate")
    if not callable(learning_rate):
        return scale(sign * learning_rate)
    return _ScaleBySchedule(learning_rate, sign).transformation()


def scale_by_schedule(step_size_fn: Callable[[Any], Any]) -> GradientTransformationExtraArgs:
    """Scales the updates by a schedule of the step count.

    Each update returns ``u = step_size_fn(count) * g`` with the state's ``count`` (0 at the
    first update), then ``count = count + 1`` (no sign flip: `scale_by_learning_rate` is the
    descent step).

    Args:
        step_size_fn: a schedule: ``fn(count) -> float`` of the integer step count.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByScheduleState(count)``.

    Raises:
        TypeError: ``step_size_fn`` is not callable; at an update, it returned something other
            than a real number.

    References:
        optax.scale_by_schedule.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_schedule(nba.linear_schedule(1.0, 0.0, transition_steps=4))
        >>> g = {"w": np.array([2.0, -4.0], np.float32)}
        >>> state = tx.init(g)
        >>> for _ in range(3):
        ...     u, state = tx.update(g, state)
        >>> [float(x) for x in u["w"]], int(state.count)  # 0.5 * g at count 2
        ([1.0, -2.0], 3)
    """
    if not callable(step_size_fn):
        raise TypeError(f"step_size_fn must be a schedule (callable), got {type(step_size_fn).__name__}")
    return _ScaleBySchedule(step_size_fn, 1.0, "step_size_fn").transformation()


@formula(inputs=("x",), outputs=("out",))
def zero(x):
    """out = +0 (x is not used: the updates of `set_to_zero`)."""
    return 0.0  # stored in the buffer's dtype: exact


class _SetToZero(Elementwise):
    """``u = 0``, declared (stateless): fused, it costs its neighbours' pass nothing more."""

    complex_leaves = True  # optax defines it on complex leaves
    formula, name = zero, "set_to_zero"

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return ()


def set_to_zero() -> GradientTransformationExtraArgs:
    """Replaces the updates by zeros.

    ``u = 0`` (+0.0, whatever ``g`` holds, NaN and inf included). Stateless; with `masked`, it
    freezes the leaves the mask selects (`freeze`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``. Updates keep each
            leaf's dtype.

    References:
        optax.set_to_zero.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.set_to_zero()
        >>> g = {"w": np.array([1.0, np.nan, -np.inf], np.float32)}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> [float(x) for x in u["w"]]
        [0.0, 0.0, 0.0]
    """
    return _SetToZero().transformation()


@state_class
class WeightDecaySchedule(NamedTuple):
    """The state of `add_decayed_weights` with a scheduled weight decay: its step count.

    Attributes:
        count: updates so far, the argument of the schedule at the next update (int32,
            saturating at the int32 maximum); 0 after ``init``.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax


class _AddDecayedWeights(Stage):
    scope = ELEMENT
    complex_leaves = True  # optax defines it on complex leaves

    def __init__(self, weight_decay: ScalarOrSchedule) -> None:
        # optax skips a constant zero (a Python int or float): the updates pass unchanged (+-0
        # kept, inf params ignored).
        self.skip = (
            isinstance(weight_decay, (int, float))
            and not isinstance(weight_decay, bool)
            and weight_decay == 0
        )
        self.weight_decay = real_or_schedule(weight_decay, "weight_decay")

    def init(self, params: Any) -> Any:
        return WeightDecaySchedule(np.int32(0)) if callable(self.weight_decay) else EmptyState()

    def decay(self, state: Any, params: ParamsRef | None) -> tuple[float, Any]:
        """This step's weight decay and the new state (the schedule called); raises first on a
        missing ``params`` or a schedule's state of another kind. A constant decay is stateless:
        any state passes through, as in optax (whose tests pass ``0``) and the other stateless
        transformations."""
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
        if not callable(self.weight_decay):
            return self.weight_decay, state
        self.check_schedule_state(state)
        wd = scheduled(self.weight_decay, state.count, "weight_decay")
        return wd, WeightDecaySchedule(safe_increment(state.count))

    def check_schedule_state(self, state: Any) -> None:
        if not isinstance(state, WeightDecaySchedule):
            raise wrong_state("WeightDecaySchedule (a scheduled weight decay)", state)

    def declare(self, spec: Spec, state: Any) -> Any:
        """A `Kernel` of ``g + wd * params`` (a `Scale` of one for a constant zero), whose tick
        calls the schedule; a schedule's state is checked here (`decay` checks it again each
        step)."""
        scheduled_decay = callable(self.weight_decay)
        if scheduled_decay:
            self.check_schedule_state(state)
        groups = len(spec.layout.groups)
        part: Any
        if self.skip:
            part = Scale(ONE, None, "add_decayed_weights")
        else:
            part = Kernel(F.add_scaled, (), [], name="add_decayed_weights")

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if scheduled_decay and not isinstance(state, WeightDecaySchedule):
                return False
            wd, part.new_state = self.decay(state, params)
            if not self.skip:
                part.scalars = [(wd,)] * groups
                part.inputs = lambda: (params.flat(),)  # type: ignore[union-attr]
            return True

        part.tick = tick
        return part


@F.formula(inputs=("x", "y", "keep"), outputs=("out",), scalars=("s",))
def masked_add_scaled(x, y, keep, s):
    """out = x + s * y where ``keep`` is not 0, x itself elsewhere (whatever y holds there)."""
    if keep != 0:
        return x + s * y
    return x


class _MaskedDecay(_Masked):
    """``masked(add_decayed_weights(weight_decay), mask)`` declared as one kernel: ``g + wd *
    params`` on the kept leaves, ``g`` on the others (`masked_add_scaled`, which reads a float32
    buffer of ones on the kept leaves, made once per layout). It fuses into the chain's pass
    like the unmasked decay; its state is optax's ``MaskedState(inner state)``."""

    formula = masked_add_scaled

    def __init__(self, weight_decay: ScalarOrSchedule, mask: Any) -> None:
        super().__init__(_AddDecayedWeights(weight_decay), mask, False)
        self._keeps = _bounded.Bounded()  # (layout, device) -> the float32 mask buffer

    def keep(self, spec: Spec) -> FlatTree:
        """1.0 on the kept leaves of ``spec``'s layout, 0.0 elsewhere (read-only, shared)."""
        key = (spec.layout, spec.device)
        found = self._keeps.get(key)
        if found is not None:
            return found
        keep = FlatTree.zeros(spec.layout, np.float32)
        for g, a, b, _, _ in self.resolve(spec.layout).runs:
            keep.groups[g][a:b] = 1.0
        keep = to_device(keep) if spec.device else keep
        keep._mark_readonly()
        return self._keeps.put(key, keep)

    def declare(self, spec: Spec, state: Any) -> Any:
        if not isinstance(state, MaskedState):
            raise wrong_state("MaskedState (add_decayed_weights with a mask)", state)
        part = self.inner.declare(spec, state.inner_state)  # checks the inner state
        inner_tick = part.tick
        keep = None
        if type(part) is Kernel:
            part.formula, part.name, keep = self.formula, "add_decayed_weights (masked)", self.keep(spec)

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not isinstance(state, MaskedState) or not inner_tick(state.inner_state, params, extra):
                return False
            part.new_state = MaskedState(part.new_state)
            if keep is not None:
                part.inputs = lambda: (params.flat(), keep)  # type: ignore[union-attr]
            return True

        part.tick = tick
        return part


def add_decayed_weights(
    weight_decay: ScalarOrSchedule = 0.0, mask: Any = None
) -> GradientTransformationExtraArgs:
    """Decoupled weight decay: adds the params, scaled, to the updates.

    Each update returns ``u = g + weight_decay * params`` (on the leaves the mask keeps; ``u = g``
    on the others). With a schedule, ``weight_decay`` is ``weight_decay(count)`` with the state's
    ``count`` (0 at the first update), then ``count = count + 1``. It needs ``params``. Placed
    before the learning rate in a chain, it is AdamW's decay.

    Args:
        weight_decay: the decay rate, or a schedule of the step count (state
            `WeightDecaySchedule`); a constant 0 passes the updates through unchanged, as in optax.
        mask: None (every leaf), or a tree of bools of the params' structure (or a prefix of
            it), or a callable of the params returning one: only the leaves where it is True
            are decayed, the others pass through (optax's ``masked(add_decayed_weights(...),
            mask)``, with its state ``MaskedState(EmptyState())``; the usual way to keep biases
            and norm scales out of weight decay). See `numbaccum.masked`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()`` for a constant decay,
            ``WeightDecaySchedule(count)`` for a schedule, either wrapped in ``MaskedState(...)``
            with a mask.

    Raises:
        TypeError: ``weight_decay`` is neither a real number nor callable; at an update, a
            schedule returned something other than a real number; at ``init`` or an update, a
            mask leaf is not a bool.
        ValueError: at an update, ``params`` is not given; at ``init`` or an update, the mask is
            not a prefix of the params' structure.

    References:
        Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019
        (arXiv:1711.05101). optax.add_decayed_weights.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"b": np.ones(2, np.float32), "w": np.array([1.0, 2.0], np.float32)}
        >>> tx = nba.add_decayed_weights(0.1, mask={"b": False, "w": True})
        >>> state = tx.init(params)
        >>> g = {"b": np.ones(2, np.float32), "w": np.ones(2, np.float32)}
        >>> u, state = tx.update(g, state, params)
        >>> [round(float(x), 4) for x in u["w"]], [round(float(x), 4) for x in u["b"]]
        ([1.1, 1.2], [1.0, 1.0])
    """
    if mask is None:
        return _AddDecayedWeights(weight_decay).transformation()
    return _MaskedDecay(weight_decay, mask).transformation()


# --- freezing leaves (optax's freeze and selective_transform) ---------------------------------


def freeze(mask: Any) -> GradientTransformationExtraArgs:
    """Zeroes the updates of the leaves ``mask`` selects: those params stay as they are.

    ``masked(set_to_zero(), mask)``: ``u_i = 0`` where ``mask_i`` is True, ``g_i`` elsewhere.

    Args:
        mask: a bool (every leaf, or none), a tree of bools with the params' structure or a
            prefix of it, or a callable of the params returning one (as `masked`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``MaskedState(EmptyState())``.

    Raises:
        TypeError: at ``init`` or an update, a mask leaf is not a bool.

    References:
        optax.freeze.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> g = {"a": np.ones(1), "b": np.ones(2)}
        >>> tx = nba.freeze({"a": True, "b": False})
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["a"].tolist(), u["b"].tolist()
        ([0.0], [1.0, 1.0])
    """
    return masked(set_to_zero(), mask)


def selective_transform(optimizer: Any, *, freeze_mask: Any) -> GradientTransformationExtraArgs:
    """Runs ``optimizer`` on the leaves not frozen by ``freeze_mask``; the frozen ones get zero
    updates.

    ``partition({"train": optimizer, "freeze": set_to_zero()}, labels)`` with the label
    ``"freeze"`` where ``freeze_mask`` is True and ``"train"`` elsewhere: the optimizer's state
    covers the trained leaves only.

    Args:
        optimizer: the transformation of the trained leaves.
        freeze_mask: a bool (every leaf, or none) or a tree of bools with the params' structure
            or a prefix of it; True freezes.

    Returns:
        A `GradientTransformationExtraArgs`; its state is a `PartitionState` with the labels
            ``"train"`` and ``"freeze"``.

    Raises:
        TypeError: ``optimizer`` is not a transformation; at ``init`` or an update, a mask leaf
            is not a bool.

    References:
        optax.selective_transform.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"a": np.zeros(1), "b": np.zeros(2)}
        >>> tx = nba.selective_transform(nba.sgd(1.0), freeze_mask={"a": True, "b": False})
        >>> u, _ = tx.update({"a": np.ones(1), "b": np.ones(2)}, tx.init(params), params)
        >>> u["a"].tolist(), u["b"].tolist()
        ([0.0], [-1.0, -1.0])
    """

    def label(m: Any) -> str:
        return "freeze" if _mask_leaf(m, "freeze_mask") else "train"

    transformation(optimizer, "optimizer")
    if freeze_mask is None:
        raise TypeError("freeze_mask: a bool or a tree of bools, got None")
    labels = tree_map(label, freeze_mask)
    stages = {"train": optimizer, "freeze": set_to_zero()}
    return _Partition(stages, labels, False, "freeze_mask").transformation()
