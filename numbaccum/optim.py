"""Inner optimizers, so that MultiSteps is usable on its own: scale, sgd, adam and friends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import backend
from ._checks import real, real_or_schedule
from .accumulation import bias_correction, check_decay, compute_dtype, expect_state, safe_increment, trace
from .base import (
    EmptyState,
    FlatTree,
    Flow,
    GradientTransformationExtraArgs,
    ParamsRef,
    chain,
    flat_transformation,
)
from .flat import check_float_dtype, layout_and_device

__all__ = [
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "adam",
    "add_decayed_weights",
    "identity",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "sgd",
]

ScalarOrSchedule = float | Callable[[Any], Any]


def _init_empty(params: Any) -> EmptyState:
    return EmptyState()


def _scaled(flow: Flow, factor: float) -> Flow:
    """``flow * factor`` without a pass of its own: the factor rides on the next kernel."""
    if flow.pending:
        flow = flow.settled()
    return flow.with_factor(1.0, float(factor))


def identity() -> GradientTransformationExtraArgs:
    """Returns the updates unchanged: ``u = g``."""
    return flat_transformation(_init_empty, lambda flow, state, params, extra: (flow, state))


def scale(step_size: float) -> GradientTransformationExtraArgs:
    """Scales the updates: ``u = step_size * g``. Stateless."""
    step_size = real(step_size, "step_size")
    return flat_transformation(
        _init_empty, lambda flow, state, params, extra: (_scaled(flow, step_size), state)
    )


class ScaleByScheduleState(NamedTuple):
    """Step count of a schedule (int32, saturating)."""

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformationExtraArgs:
    """``u = -learning_rate * g`` (``+`` with ``flip_sign=False``); ``learning_rate`` is a float
    or a callable of the step count (then the state is `ScaleByScheduleState`)."""
    sign = -1.0 if flip_sign else 1.0
    learning_rate = real_or_schedule(learning_rate, "learning_rate")
    if not callable(learning_rate):
        return scale(sign * learning_rate)
    schedule = learning_rate

    def init(params: Any) -> ScaleByScheduleState:
        return ScaleByScheduleState(np.int32(0))

    def flat_update(
        flow: Flow, state: Any, params: ParamsRef | None, extra: dict
    ) -> tuple[Flow, ScaleByScheduleState]:
        if not isinstance(state, ScaleByScheduleState):
            raise TypeError(f"state: expected ScaleByScheduleState, got {type(state).__name__}")
        factor = sign * float(schedule(state.count))
        return _scaled(flow, factor), ScaleByScheduleState(safe_increment(state.count))

    return flat_transformation(init, flat_update)


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformationExtraArgs:
    """Weight decay: ``u = g + weight_decay * params``. Needs ``params``."""
    weight_decay = real(weight_decay, "weight_decay")

    def flat_update(flow: Flow, state: Any, params: ParamsRef | None, extra: dict) -> tuple[Flow, Any]:
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
        p = params.flat()
        out = flow.fresh()
        for o, g, pg in zip(out.groups, flow.flat.groups, p.groups):
            backend.call("add_scaled_", o, g, flow.div, flow.mul, pg, weight_decay)
        return Flow(out, owned=True), state

    return flat_transformation(_init_empty, flat_update)


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """Stochastic gradient descent: ``chain(trace(momentum, nesterov), scale_by_learning_rate)``
    (no trace when ``momentum`` is None): ``u = -lr * trace``."""
    if momentum is not None:
        real(momentum, "momentum")  # named as the caller knows it (trace calls it decay)
    first = trace(momentum, nesterov, accumulator_dtype) if momentum is not None else identity()
    return chain(first, scale_by_learning_rate(learning_rate))


class ScaleByAdamState(NamedTuple):
    """Adam's step count and first and second moments."""

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: FlatTree
    nu: FlatTree


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Any = None
) -> GradientTransformationExtraArgs:
    """Adam's direction, as optax computes it:

    ``mu = (1 - b1) g + b1 mu``, ``nu = (1 - b2) g^2 + b2 nu``,
    ``u = (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``, one fused pass.

    Args:
        b1, b2: decay rates of the moments, in [0, 1].
        eps, eps_root: added outside and inside the square root.
        mu_dtype: storage dtype of ``mu``; None keeps each leaf's dtype.
    """
    b1 = check_decay(b1, "b1")
    b2 = check_decay(b2, "b2")
    eps, eps_root = real(eps, "eps"), real(eps_root, "eps_root")
    mu_dt = None if mu_dtype is None else check_float_dtype(mu_dtype, "mu_dtype")

    def init(params: Any) -> ScaleByAdamState:
        layout, device = layout_and_device(params, "params")
        mu = FlatTree.zeros(layout, mu_dt if mu_dt is not None else None, device)
        return ScaleByAdamState(np.int32(0), mu, FlatTree.zeros(layout, None, device))

    def flat_update(
        flow: Flow, state: Any, params: ParamsRef | None, extra: dict
    ) -> tuple[Flow, ScaleByAdamState]:
        return step(flow, state, 1.0)

    def step(flow: Flow, state: Any, out_mul: float) -> tuple[Flow, ScaleByAdamState]:
        """One Adam pass over every group, its output multiplied by ``out_mul``."""
        layout = flow.flat.layout
        mu = expect_state(state, ScaleByAdamState, "mu", layout)
        nu = expect_state(state, ScaleByAdamState, "nu", layout)
        count = safe_increment(state.count)
        out = nu.workspace("out", list(layout.group_dtypes))
        for m, v, g, o in zip(mu.groups, nu.groups, flow.flat.groups, out.groups):
            ct = compute_dtype(m, v, g)
            bc1, bc2 = bias_correction(b1, int(count), ct), bias_correction(b2, int(count), ct)
            args = (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc2, eps, eps_root, out_mul)
            backend.call("adam_update_", m, v, g, flow.div, flow.mul, *args, o)
        return Flow(out, owned=True), ScaleByAdamState(count, mu, nu)

    tx = flat_transformation(init, flat_update)
    tx.update._adam_step = step  # type: ignore[attr-defined]
    return tx


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
) -> GradientTransformationExtraArgs:
    """Adam: ``chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(lr))``.

    Same state and same bits as that chain, in one pass: the ``-lr`` step is applied inside the
    Adam kernel (``u = direction * -lr`` rounds exactly as a separate scaling pass would).
    """
    learning_rate = real_or_schedule(learning_rate, "learning_rate")
    direction = scale_by_adam(b1, b2, eps, eps_root)
    reference = chain(direction, scale_by_learning_rate(learning_rate))
    adam_step = direction.update._adam_step  # type: ignore[attr-defined]

    def flat_update(flow: Flow, state: Any, params: ParamsRef | None, extra: dict) -> tuple[Flow, tuple]:
        if not isinstance(state, tuple) or len(state) != 2:
            raise ValueError("state: adam expects the (ScaleByAdamState, learning-rate state) pair")
        lr_state = state[1]
        if isinstance(lr_state, ScaleByScheduleState) and callable(learning_rate):
            factor = -float(learning_rate(lr_state.count))
            lr_state = ScaleByScheduleState(safe_increment(lr_state.count))
        elif isinstance(lr_state, EmptyState) and not callable(learning_rate):
            factor = -float(learning_rate)
        else:
            raise TypeError(f"state[1]: unexpected learning-rate state {type(lr_state).__name__}")
        out, adam_state = adam_step(flow, state[0], factor)
        return out, (adam_state, lr_state)

    return flat_transformation(reference.init, flat_update)
