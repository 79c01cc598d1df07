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
from ._checks import flag, real, real_or_schedule, scheduled, wrong_state
from .base import Stage
from .contract import ONE, Factor
from .declared import safe_increment
from .flat import FlatTree, to_device
from .fuse import Kernel, Scale
from .masking import MaskedState, _Masked
from .protocol import EmptyState, GradientTransformationExtraArgs
from .updates import ParamsRef, Spec

__all__ = [
    "ScaleByScheduleState",
    "WeightDecaySchedule",
    "add_decayed_weights",
    "identity",
    "scale",
    "scale_by_learning_rate",
]

ScalarOrSchedule = float | Callable[[Any], Any]


class _Identity(Stage):
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
    """Returns the updates unchanged: ``u = g``."""
    return _Identity().transformation()


class _Scale(Stage):
    """``u = step_size * g``: a pending factor that rides on the next kernel (no pass of its own)."""

    def __init__(self, step_size: float) -> None:
        self.step_size = real(step_size, "step_size")
        self.factor = Factor(1.0, self.step_size)

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def declare(self, spec: Spec, state: Any) -> Scale:
        return _passing(Scale(self.factor, None, "scale"))


def scale(step_size: float) -> GradientTransformationExtraArgs:
    """Scales the updates: ``u = step_size * g``. Stateless."""
    return _Scale(step_size).transformation()


class ScaleByScheduleState(NamedTuple):
    """Step count of a schedule (int32, saturating)."""

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax


class _ScaleBySchedule(Stage):
    """``u = sign * schedule(count) * g``; each step's tick calls the schedule."""

    def __init__(self, schedule: Callable[[Any], Any], sign: float) -> None:
        self.schedule = schedule
        self.sign = sign

    def init(self, params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(np.int32(0))

    def declare(self, spec: Spec, state: Any) -> Scale:
        if not isinstance(state, ScaleByScheduleState):
            raise wrong_state("ScaleByScheduleState", state)
        part = Scale(ONE, None, "scale_by_schedule")
        schedule, sign = self.schedule, self.sign

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not isinstance(state, ScaleByScheduleState):
                return False
            part.factor = Factor(1.0, sign * scheduled(schedule, state.count, "learning_rate"))
            part.new_state = ScaleByScheduleState(safe_increment(state.count))
            return True

        part.tick = tick
        return part


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformationExtraArgs:
    """``u = -learning_rate * g`` (``+`` with ``flip_sign=False``); ``learning_rate`` is a float
    or a callable of the step count (then the state is `ScaleByScheduleState`)."""
    sign = -1.0 if flag(flip_sign, "flip_sign") else 1.0
    learning_rate = real_or_schedule(learning_rate, "learning_rate")
    if not callable(learning_rate):
        return scale(sign * learning_rate)
    return _ScaleBySchedule(learning_rate, sign).transformation()


class WeightDecaySchedule(NamedTuple):
    """The step count of a scheduled weight decay."""

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax


class _AddDecayedWeights(Stage):
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
        missing ``params`` or a state of another kind."""
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
        if not callable(self.weight_decay):
            if not isinstance(state, EmptyState):
                raise wrong_state("EmptyState (add_decayed_weights)", state)
            return self.weight_decay, state
        if not isinstance(state, WeightDecaySchedule):
            raise wrong_state("WeightDecaySchedule (a scheduled weight decay)", state)
        wd = scheduled(self.weight_decay, state.count, "weight_decay")
        return wd, WeightDecaySchedule(safe_increment(state.count))

    def declare(self, spec: Spec, state: Any) -> Any:
        """A `Kernel` of ``g + wd * params`` (a `Scale` of one for a constant zero), whose tick
        calls the schedule; the state is checked here (`decay` checks it again each step)."""
        expected = WeightDecaySchedule if callable(self.weight_decay) else EmptyState
        if not isinstance(state, expected):
            if expected is EmptyState:
                raise wrong_state("EmptyState (add_decayed_weights)", state)
            raise wrong_state("WeightDecaySchedule (a scheduled weight decay)", state)
        groups = len(spec.layout.groups)
        part: Any
        if self.skip:
            part = Scale(ONE, None, "add_decayed_weights")
        else:
            part = Kernel(F.add_scaled, (), [], name="add_decayed_weights")

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not isinstance(state, expected):
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
    """Weight decay: ``u = g + weight_decay * params``. Needs ``params``.

    Args:
        weight_decay: the decay rate, or a schedule of the step (state `WeightDecaySchedule`);
            a constant 0 passes the updates through unchanged, as in optax.
        mask: None (every leaf), or a tree of bools of the params' structure (or a prefix of
            it), or a callable of the params returning one: only the leaves where it is True
            are decayed, the others pass through (optax's ``masked(add_decayed_weights(...),
            mask)``, with its state ``MaskedState(EmptyState())``; the usual way to keep biases
            and norm scales out of weight decay). See `numbaccum.masked`.
    """
    if mask is None:
        return _AddDecayedWeights(weight_decay).transformation()
    return _MaskedDecay(weight_decay, mask).transformation()
