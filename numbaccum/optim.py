"""Inner optimizers, so that MultiSteps is usable on its own: scale, sgd, adam and friends.

Each is a `Stage`. A learning rate is planned like any per-step scalar: a schedule is called by
the plan, before any buffer is written, so a schedule that raises leaves the state as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import formulas as F
from ._checks import flag, real, real_or_schedule, scheduled
from .accumulation import trace
from .backend import ops_for
from .base import Stage, Step, chain
from .contract import ONE, Factor, Ops
from .declared import Elementwise, bias_correction, check_decay, safe_increment
from .flat import FlatTree
from .fuse import Kernel, Scale
from .layout import check_float_dtype
from .masking import MaskedState, _Masked
from .protocol import EmptyState, GradientTransformationExtraArgs
from .updates import ParamsRef, Spec, Updates

__all__ = [
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "WeightDecaySchedule",
    "adam",
    "add_decayed_weights",
    "identity",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_nadam",
    "scale_by_sign",
    "sgd",
    "sign_sgd",
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
            raise TypeError(f"state: expected ScaleByScheduleState, got {type(state).__name__}")
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
                raise TypeError(f"state: add_decayed_weights expects EmptyState, got {type(state).__name__}")
            return self.weight_decay, state
        if not isinstance(state, WeightDecaySchedule):
            raise TypeError(
                f"state: a scheduled weight decay expects WeightDecaySchedule, got {type(state).__name__}"
            )
        wd = scheduled(self.weight_decay, state.count, "weight_decay")
        return wd, WeightDecaySchedule(safe_increment(state.count))

    def declare(self, spec: Spec, state: Any) -> Any:
        """A `Kernel` of ``g + wd * params`` (a `Scale` of one for a constant zero), whose tick
        calls the schedule; the state is checked here (`decay` checks it again each step)."""
        expected = WeightDecaySchedule if callable(self.weight_decay) else EmptyState
        if not isinstance(state, expected):
            if expected is EmptyState:
                raise TypeError(f"state: add_decayed_weights expects EmptyState, got {type(state).__name__}")
            raise TypeError(
                f"state: a scheduled weight decay expects WeightDecaySchedule, got {type(state).__name__}"
            )
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


class _MaskedDecay(_Masked):
    """``masked(add_decayed_weights(weight_decay), mask)`` without packing: the decay runs on
    each run of consecutive kept leaves of the flat buffers in place, the other leaves pass
    through (copied only when the output is a new buffer or a factor is pending)."""

    def __init__(self, weight_decay: ScalarOrSchedule, mask: Any) -> None:
        super().__init__(_AddDecayedWeights(weight_decay), mask, False)

    def plan(self, spec: Spec, state: Any, params: ParamsRef | None, extra: dict) -> Step:
        if not isinstance(state, MaskedState):
            raise TypeError(
                f"state: add_decayed_weights with a mask expects a MaskedState, got {type(state).__name__}"
            )
        inner: _AddDecayedWeights = self.inner  # type: ignore[assignment]
        wd, inner_state = inner.decay(state.inner_state, params)
        new_state = MaskedState(inner_state)
        m = self.resolve(spec.layout)
        if inner.skip:
            return Step(lambda u: (u, new_state))

        def run(u: Updates) -> tuple[Updates, Any]:
            p = params.flat()  # type: ignore[union-attr]
            out = u.fresh()
            x, o = u.flat.groups, out.groups
            if out is not u.flat or u.pending:
                for g, a, b in m.gaps:
                    ops_for(x[g]).scale_(o[g][a:b], x[g][a:b], u.factor)
            for g, a, b, _, _ in m.runs:
                ops_for(x[g]).add_scaled_(o[g][a:b], x[g][a:b], u.factor, p.groups[g][a:b], wd)
            return Updates(out, owned=True), new_state

        return Step(run)


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


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """Stochastic gradient descent: ``chain(trace(momentum, nesterov), scale_by_learning_rate)``
    (no trace when ``momentum`` is None): ``u = -lr * trace``."""
    if momentum is not None:
        check_decay(momentum, "momentum")  # named as the caller knows it (trace calls it decay)
    first = trace(momentum, nesterov, accumulator_dtype) if momentum is not None else identity()
    return chain(first, scale_by_learning_rate(learning_rate))


class _ScaleBySign(Elementwise):
    """``u = sign(g)`` per element (`numbaccum.formulas.sign`); stateless."""

    formula, name = F.sign, "scale_by_sign"

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return ()


def scale_by_sign() -> GradientTransformationExtraArgs:
    """The sign of each element: ``u = sign(g)`` (1, -1, and +-0 and NaN as they are, like
    ``jnp.sign``). Stateless."""
    return _ScaleBySign().transformation()


def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformationExtraArgs:
    """signSGD: ``u = -learning_rate * sign(g)``, i.e. ``chain(scale_by_sign(),
    scale_by_learning_rate(learning_rate))``; ``learning_rate`` is a float or a schedule."""
    return chain(scale_by_sign(), scale_by_learning_rate(learning_rate))


class ScaleByAdamState(NamedTuple):
    """Adam's step count and first and second moments."""

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: FlatTree
    nu: FlatTree


class _ScaleByAdam(Elementwise):
    """`scale_by_adam`, declared: Adam's moments and direction in one formula."""

    formula, state_cls, fields, counted, name = F.adam, ScaleByAdamState, ("mu", "nu"), True, "scale_by_adam"

    def __init__(self, b1: float, b2: float, eps: float, eps_root: float, mu_dtype: Any) -> None:
        self.b1 = check_decay(b1, "b1")
        self.b2 = check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.mu_dtype = _mu_dtype(mu_dtype)

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2, t = self.b1, self.b2, int(count)
        bc1, bc2 = bias_correction(b1, t, ct), bias_correction(b2, t, ct)
        return (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc2, self.eps, self.eps_root)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """Adam's direction, as optax computes it:

    ``mu = (1 - b1) g + b1 mu``, ``nu = (1 - b2) g^2 + b2 nu``,
    ``u = (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``, one fused pass.

    Args:
        b1, b2: decay rates of the moments, in [0, 1].
        eps, eps_root: added outside and inside the square root.
        mu_dtype: storage dtype of ``mu``; None keeps each leaf's dtype.
        nesterov: NAdam's direction instead (`scale_by_nadam`).
    """
    if flag(nesterov, "nesterov"):
        return scale_by_nadam(b1, b2, eps, eps_root, mu_dtype)
    return _ScaleByAdam(b1, b2, eps, eps_root, mu_dtype).transformation()


class _Direction(Elementwise):
    """optax's ``scale_by_*`` directions with moments: declarations that count steps (for their
    bias corrections) unless they say otherwise."""

    counted = True


def _mu_dtype(mu_dtype: Any) -> np.dtype | None:
    return None if mu_dtype is None else check_float_dtype(mu_dtype, "mu_dtype")


class _ScaleByNadam(_Direction):
    state_cls, fields, formula, name = ScaleByAdamState, ("mu", "nu"), F.nadam, "scale_by_adam(nesterov)"
    op = Ops.nadam_update_

    def __init__(self, b1: float, b2: float, eps: float, eps_root: float, mu_dtype: Any) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.mu_dtype = _mu_dtype(mu_dtype)

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2, t = self.b1, self.b2, int(count)
        bc1, bc1_next = bias_correction(b1, t, ct), bias_correction(b1, int(safe_increment(count)), ct)
        bc2 = bias_correction(b2, t, ct)
        return (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc1_next, bc2, self.eps, self.eps_root)


def scale_by_nadam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Any = None
) -> GradientTransformationExtraArgs:
    """``scale_by_adam(..., nesterov=True)``: Adam's moments, the first one corrected with
    Nesterov's look-ahead, ``mu_hat = b1 mu / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t)``,
    ``u = mu_hat / (sqrt(nu / (1 - b2^t) + eps_root) + eps)`` (state `ScaleByAdamState`)."""
    return _ScaleByNadam(b1, b2, eps, eps_root, mu_dtype).transformation()


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """Adam: ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
    scale_by_learning_rate(lr))``.

    It is that chain, declared like any other: fused, the ``-lr`` step is applied inside the
    Adam pass (``u = direction * -lr`` rounds exactly as a separate scaling pass would); with
    ``NUMBACCUM_FUSE=0`` it is the chain's two passes. ``nesterov=True`` is `nadam`.
    """
    direction = scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)
    return chain(direction, scale_by_learning_rate(learning_rate))
