"""optax.contrib's optimizers that users ask for most: ADOPT, AdEMAMix and Sophia, each one
declared formula (fused with the learning rate and weight decay, as the optimizers of
`numbaccum.optimizers`; Sophia's Hessian estimate from the caller's Hessian-vector product or
gradients, on the host before the pass), and reduce_on_plateau (host logic on the objective's
values, its scale a pending factor).

Names, arguments, defaults and state classes are optax.contrib's; the order of the
floating-point operations is optax's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import arrays, runner
from ._checks import flag, integer, real, scheduled, transformation, wrong_state
from ._interrupts import user_code
from .backend import Reductions, ops_for
from .base import Stage, as_stage, chain, find_state, stage_of, with_extra_args_support
from .clipping import _objective_value
from .contract import ONE, Factor
from .declared import (
    Elementwise,
    bias_correction,
    check_decay,
    compute_dtype,
    expect_state,
    holds,
    safe_increment,
)
from .flat import FlatTree, as_flat, host_check, host_flat, layout_and_device, layout_of
from .formulas import abs_sq, formula, like, maximum, minimum, quot, re, sqrt
from .fuse import Host, Launches, Later, Scale
from .layout import check_float_dtype, check_storage, real_dtype
from .optimizers import ScaleByAdamState, ScaleByBeliefState, _mu_dtype, scale_by_rms, sgd
from .protocol import GradientTransformationExtraArgs, state_class
from .scaling import ScalarOrSchedule, add_decayed_weights, scale_by_learning_rate
from .schedules import warmup_constant_schedule
from .tables import whole
from .transaction import current
from .tree import tree_flatten, tree_map
from .updates import ParamsRef, Spec, Updates

__all__ = [
    "DAdaptAdamWState",
    "HutchinsonState",
    "ProdigyState",
    "ReduceLROnPlateauState",
    "ScaleByAdemamixState",
    "ScaleBySimplifiedAdEMAMixState",
    "ScheduleFreeState",
    "SophiaState",
    "acprop",
    "ademamix",
    "adopt",
    "dadapt_adamw",
    "hutchinson_estimator_diag_hessian",
    "prodigy",
    "reduce_on_plateau",
    "scale_by_acprop",
    "scale_by_ademamix",
    "scale_by_adopt",
    "scale_by_simplified_ademamix",
    "scale_by_sophia",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
    "simplified_ademamix",
    "sophia",
]


# --- ADOPT -------------------------------------------------------------------------------------


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "b2", "one_minus_b2", "eps", "clip_value", "clipping", "nesterov"),
)
def adopt_direction(mu, nu, g, b1, one_minus_b1, b2, one_minus_b2, eps, clip_value, clipping, nesterov):
    """ADOPT: the update normalised by the *previous* second moment, u = g / max(sqrt(nu), eps)
    (clipped to [-c, c]); mu = (1 - b1) u + b1 mu; nu = (1 - b2) g^2 + b2 nu; out = mu (nesterov:
    (1 - b1) u + b1 mu). At the first step b1 = 1 and b2 = 0 (optax's ``where``s)."""
    u = g / maximum(math.sqrt(re(nu)), eps)
    if clipping:
        u = minimum(maximum(u, -clip_value), clip_value)
    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)
    m = one_minus_b1 * u + b1 * mu
    out = one_minus_b1 * u + b1 * m if nesterov else m
    return m, v, out


class _ScaleByAdopt(Elementwise):
    state_cls, fields, formula, name = ScaleByAdamState, ("mu", "nu"), adopt_direction, "scale_by_adopt"
    counted = True
    dtype_options = {"mu": "mu_dtype"}  # nu: the leaves' dtype (optax's)

    def __init__(
        self, b1: Any, b2: Any, eps: Any, mu_dtype: Any, nesterov: Any, use_clipping: Any, clip_value_fn: Any
    ) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps = real(eps, "eps")
        self.mu_dtype = _mu_dtype(mu_dtype)
        self.nesterov, self.clipping = flag(nesterov, "nesterov"), flag(use_clipping, "use_clipping")
        if not callable(clip_value_fn):
            raise TypeError(f"clip_value_fn must be callable, got {type(clip_value_fn).__name__}")
        self.clip_value_fn = clip_value_fn

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        c = int(count) - 1  # optax's ``state.count``: the steps before this one
        t = ct.type
        # optax: ``where(count > 0, b, 1 or 0)`` is an array of the compute dtype, and 1 - it is
        # computed in that dtype (the cast first, then the subtraction).
        b1, b2 = (t(self.b1), t(self.b2)) if c > 0 else (t(1.0), t(0.0))
        clip = real(self.clip_value_fn(np.int32(c)), "clip_value_fn's value") if self.clipping else 0.0
        return (b1, t(1.0) - b1, b2, t(1.0) - b2, self.eps, clip, self.clipping, self.nesterov)


def scale_by_adopt(
    b1: float = 0.9,
    b2: float = 0.9999,
    eps: float = 1e-6,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[Any], Any] = lambda x: x**0.25,
) -> GradientTransformationExtraArgs:
    """Rescales the updates by ADOPT: Adam with the update normalised by the second moment of
    the steps before it.

    ``u = clip(g / max(sqrt(nu), eps), -c, c)`` with ``c = clip_value_fn(t - 1)`` (``t`` the new
    step count), then ``mu = (1 - b1) u + b1 mu`` and ``nu = (1 - b2) g^2 + b2 nu``; the output is
    ``mu`` (``nesterov``: ``(1 - b1) u + b1 mu``). At the first step only ``nu = g^2`` is set
    (the output is 0), as optax does. One fused pass.

    Args:
        b1: decay of the first moment, between 0 and 1.
        b2: decay of the second moment, between 0 and 1.
        eps: the floor of ``sqrt(nu)``.
        mu_dtype: storage dtype of ``mu`` (None: each leaf's).
        nesterov: Nesterov's momentum.
        use_clipping: clip the normalised update to ``[-c, c]``.
        clip_value_fn: ``c`` of the step count (``t - 1``); optax's default ``t^0.25``.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAdamState(count, mu, nu)``,
            as optax's.

    Raises:
        TypeError: a hyperparameter has the wrong type, ``clip_value_fn`` is not callable (or,
            at an update, returns no real number).
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Taniguchi et al., "ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal
        Rate", NeurIPS 2024 (arXiv:2411.02853). optax.contrib.scale_by_adopt.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_adopt()
        >>> g = {"w": np.array([0.5, -2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"]  # the first step only sets nu = g^2
        array([0., 0.])
        >>> u, state = tx.update(g, state)
        >>> [round(float(x), 4) for x in u["w"]]  # 0.1 * clip(g / |g|, -1, 1)
        [0.1, -0.1]
    """
    return _ScaleByAdopt(b1, b2, eps, mu_dtype, nesterov, use_clipping, clip_value_fn).transformation()


def adopt(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.9999,
    eps: float = 1e-6,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[Any], Any] = lambda x: x**0.25,
) -> GradientTransformationExtraArgs:
    """ADOPT: ``chain(scale_by_adopt(...), scale_by_learning_rate(learning_rate))``, one fused
    pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_adopt`.
        b2: as in `scale_by_adopt`.
        eps: as in `scale_by_adopt`.
        mu_dtype: as in `scale_by_adopt`.
        nesterov: as in `scale_by_adopt`.
        use_clipping: as in `scale_by_adopt`.
        clip_value_fn: as in `scale_by_adopt`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            EmptyState())`` (``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter has the wrong type.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Taniguchi et al., "ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal
        Rate", NeurIPS 2024 (arXiv:2411.02853). optax.contrib.adopt.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"x": np.array([1.0, 2.0, 3.0])}
        >>> tx = nba.adopt(learning_rate=0.003)
        >>> state = tx.init(params)
        >>> for _ in range(5):
        ...     state = nba.step_(tx, {"x": 2 * params["x"]}, state, params)
        >>> print(f"{float(np.sum(params['x'] ** 2)):.2f}")  # 14 before; the first step is 0
        13.97
    """
    return chain(
        scale_by_adopt(
            b1, b2, eps, mu_dtype, nesterov=nesterov, use_clipping=use_clipping, clip_value_fn=clip_value_fn
        ),
        scale_by_learning_rate(learning_rate),
    )


# --- ACProp ------------------------------------------------------------------------------------


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "b2", "one_minus_b2", "bc2", "eps", "eps_root", "first"),
)
def acprop_direction(mu, nu, g, b1, one_minus_b1, b2, one_minus_b2, bc2, eps, eps_root, first):
    """ACProp, in optax's order of operations: mu as Adam's; nu = ((1 - b2) (g - mu_prev)^2 +
    b2 nu) + eps_root (the *previous* mu; eps_root stored in nu); out = g / (sqrt(nu_prev / bc2)
    + eps), the *previous* nu, which optax's ``where`` makes 1 at the first step."""
    n = re(nu)
    m = one_minus_b1 * g + b1 * mu
    v = (one_minus_b2 * abs_sq(g - mu) + b2 * n) + eps_root
    h = like(n, 1.0) if first else n / bc2  # (the literal in n's dtype: a float32 step stays so)
    return m, v, quot(g, sqrt(h) + eps)


class _ScaleByAcprop(Elementwise):
    state_cls, fields, formula, name = ScaleByBeliefState, ("mu", "nu"), acprop_direction, "scale_by_acprop"
    counted = True
    complex_leaves = True  # optax's moments take complex leaves (abs_sq), as AdaBelief's

    def __init__(self, b1: Any, b2: Any, eps: Any, eps_root: Any) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        c = int(count) - 1  # optax's ``state.count``: the steps before this one
        b1, b2 = self.b1, self.b2
        bc2 = bias_correction(b2, c, ct)  # (unused at the first step, c = 0)
        return (b1, 1.0 - b1, b2, 1.0 - b2, bc2, self.eps, self.eps_root, c == 0)


def scale_by_acprop(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16, eps_root: float = 1e-16
) -> GradientTransformationExtraArgs:
    """Rescales the updates by ACProp: AdaBelief's moments, the update divided by the ones of
    the steps before it (asynchronous).

    ``u = g / (sqrt(nu / (1 - b2^(t-1))) + eps)`` with the state's ``nu`` (``t`` the new step
    count; at the first step ``u = g / (1 + eps)``, as optax's ``where``), then
    ``nu = ((1 - b2) (g - mu)^2 + b2 nu) + eps_root`` with the state's ``mu`` and
    ``mu = (1 - b1) g + b1 mu``. One fused pass.

    Args:
        b1: decay rate of the first moment, between 0 and 1.
        b2: decay rate of the second central moment, between 0 and 1.
        eps: added outside the square root.
        eps_root: added to the second central moment at each step (stored in ``nu``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByBeliefState(count, mu,
            nu)``, as optax.contrib's. Updates keep each leaf's dtype.

    Raises:
        TypeError: ``b1``, ``b2``, ``eps`` or ``eps_root`` is not a real number.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Zhuang et al., "Momentum Centering and Asynchronous Update for Adaptive Gradient
        Methods", NeurIPS 2021 (arXiv:2110.05454). optax.contrib.scale_by_acprop.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_acprop()
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # g itself at the first step
        [0.5, -2.0]
        >>> u, state = tx.update({"w": np.array([0.1, -1.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]  # g / |the first g|
        [0.2, -0.5]
    """
    return _ScaleByAcprop(b1, b2, eps, eps_root).transformation()


def acprop(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """ACProp: AdaBelief's centred second moment, the update divided by the steps before it:
    ``chain(scale_by_acprop(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, one fused pass.

    ``u = -lr (g / (sqrt(nu_prev / (1 - b2^(t-1))) + eps) + weight_decay p)``, ``nu_prev`` the
    second central moment of the steps before this one (see `scale_by_acprop`).

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_acprop`.
        b2: as in `scale_by_acprop`.
        eps: as in `scale_by_acprop`.
        eps_root: as in `scale_by_acprop`.
        weight_decay: the decay rate (multiplied by the learning rate, as in PyTorch).
        mask: which leaves decay (as `add_decayed_weights`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByBeliefState(count, mu, nu),
            EmptyState(), EmptyState())`` (``MaskedState`` for a masked decay,
            ``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter has the wrong type.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Zhuang et al., "Momentum Centering and Asynchronous Update for Adaptive Gradient
        Methods", NeurIPS 2021 (arXiv:2110.05454). optax.contrib.acprop.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.acprop(0.1)
        >>> state = tx.init(params)
        >>> for g in ([0.5, -2.0], [0.1, -1.0]):
        ...     state = nba.step_(tx, {"w": np.array(g, np.float32)}, state, params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 g, then 1 - 0.1 g / |the first g|
        [0.93, 1.25]
    """
    return chain(
        scale_by_acprop(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


# --- AdEMAMix -----------------------------------------------------------------------------------


@state_class
class ScaleByAdemamixState(NamedTuple):
    """AdEMAMix's state (optax.contrib's fields).

    Attributes:
        count: the number of updates so far (int32, saturating): the fast EMA's and the second
            moment's bias corrections.
        count_m2: the same count, the argument of the ``b3`` and ``alpha`` schedules.
        m1: the fast EMA of the gradients, a FlatTree of the params' layout.
        m2: the slow EMA.
        nu: the second moment.
    """

    count: np.int32  # type: ignore[assignment]
    count_m2: np.int32
    m1: FlatTree
    m2: FlatTree
    nu: FlatTree


@formula(
    states=("m1", "m2", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=(
        "b1",
        "one_minus_b1",
        "b2",
        "one_minus_b2",
        "b3",
        "one_minus_b3",
        "alpha",
        "bc1",
        "bc2",
        "eps",
        "eps_root",
    ),
)
def ademamix_direction(
    m1, m2, nu, g, b1, one_minus_b1, b2, one_minus_b2, b3, one_minus_b3, alpha, bc1, bc2, eps, eps_root
):
    """AdEMAMix: a fast and a slow EMA of g, mixed: m1 = (1 - b1) g + b1 m1; m2 = (1 - b3) g +
    b3 m2; nu = (1 - b2) g^2 + b2 nu; out = (m1 / bc1 + alpha m2) / (sqrt(nu / bc2 + eps_root)
    + eps) (the slow EMA is not bias-corrected)."""
    a = one_minus_b1 * g + b1 * m1
    s = one_minus_b3 * g + b3 * m2
    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)
    return a, s, v, (a / bc1 + alpha * s) / (math.sqrt(v / bc2 + eps_root) + eps)


class _ScaleByAdemamix(Elementwise):
    state_cls, fields, formula, name = (
        ScaleByAdemamixState,
        ("m1", "m2", "nu"),
        ademamix_direction,
        "scale_by_ademamix",
    )
    counted = True
    dtype_options = dict.fromkeys(("m1", "m2", "nu"), "mu_dtype")  # optax keeps all three in mu_dtype
    other_starts = {"count_m2": np.int32(0)}
    complex_leaves = True  # optax's moments of |g|^2

    def __init__(self, b1: Any, b2: Any, b3: Any, alpha: Any, eps: Any, eps_root: Any, mu_dtype: Any) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.b3 = b3 if callable(b3) else check_decay(b3, "b3")
        self.alpha = alpha if callable(alpha) else real(alpha, "alpha")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.mu_dtype = _mu_dtype(mu_dtype)

    def declare(self, spec: Any, state: Any) -> Any:
        part = super().declare(spec, state)
        ticked = part.tick
        assert ticked is not None  # (set by `Elementwise.declare`)

        def tick(state: Any, params: Any, extra: dict) -> bool:  # count_m2 advances with count
            if not ticked(state, params, extra):
                return False
            if int(state.count_m2) != int(state.count):
                raise ValueError(
                    f"state.count_m2 ({int(state.count_m2)}) differs from state.count ({int(state.count)}): "
                    "numbaccum advances them together (the schedules of b3 and alpha read it)"
                )
            part.new_state = part.new_state._replace(count_m2=part.new_state.count)
            return True

        part.tick = tick
        return part

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        t, c = int(count), int(count) - 1  # the schedules read optax's ``state.count_m2``
        b3 = check_decay(self.b3(c), "b3's value") if callable(self.b3) else self.b3
        alpha = real(self.alpha(c), "alpha's value") if callable(self.alpha) else self.alpha
        b1, b2 = self.b1, self.b2
        bc1, bc2 = bias_correction(b1, t, ct), bias_correction(b2, t, ct)
        return (b1, 1.0 - b1, b2, 1.0 - b2, b3, 1.0 - b3, alpha, bc1, bc2, self.eps, self.eps_root)


def scale_by_ademamix(
    b1: float = 0.9,
    b2: float = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 6.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """Rescales the updates by AdEMAMix: Adam's fast EMA plus ``alpha`` times a slow one.

    ``m1 = (1 - b1) g + b1 m1``, ``m2 = (1 - b3) g + b3 m2``, ``nu = (1 - b2) g^2 + b2 nu``, ``u =
    (m1 / (1 - b1^t) + alpha m2) / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``; the slow EMA is
    not bias-corrected, and ``b3`` and ``alpha`` may be schedules of the step count (optax's
    ``count_m2``, the steps before this one). One fused pass.

    Args:
        b1: decay of the fast EMA, between 0 and 1.
        b2: decay of the second moment, between 0 and 1.
        b3: decay of the slow EMA, between 0 and 1, or a schedule of it.
        alpha: the slow EMA's weight, or a schedule of it (6.0 by default, as optax.contrib's
            ``scale_by_ademamix``; its ``ademamix`` defaults to 5.0).
        eps: added to the square root.
        eps_root: added inside the square root.
        mu_dtype: storage dtype of the three buffers (None: each leaf's).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAdemamixState(count,
            count_m2, m1, m2, nu)``, as optax.contrib's.

    Raises:
        TypeError: a hyperparameter has the wrong type.
        ValueError: ``b1``, ``b2`` or ``b3`` (or a value of its schedule) is not between 0 and 1.

    References:
        Pagliardini, Ablin and Grangier, "The AdEMAMix Optimizer: Better, Faster, Older", 2024
        (arXiv:2409.03137). optax.contrib.scale_by_ademamix.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_ademamix(b3=0.5, alpha=2.0)
        >>> g = {"w": np.array([3.0, -4.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # (g + 2 * 0.5 g) / |g|
        [2.0, -2.0]
    """
    return _ScaleByAdemamix(b1, b2, b3, alpha, eps, eps_root, mu_dtype).transformation()


def ademamix(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 5.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """AdEMAMix with decoupled weight decay: ``chain(scale_by_ademamix(...),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``, one fused
    pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_ademamix`.
        b2: as in `scale_by_ademamix`.
        b3: as in `scale_by_ademamix`.
        alpha: as in `scale_by_ademamix`.
        eps: as in `scale_by_ademamix`.
        eps_root: as in `scale_by_ademamix`.
        mu_dtype: as in `scale_by_ademamix`.
        weight_decay: the decay rate.
        mask: which leaves decay (as `add_decayed_weights`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdemamixState(...),
            EmptyState(), EmptyState())`` (``MaskedState`` for a masked decay,
            ``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter has the wrong type.
        ValueError: ``b1``, ``b2`` or ``b3`` is not between 0 and 1.

    References:
        Pagliardini, Ablin and Grangier, "The AdEMAMix Optimizer: Better, Faster, Older", 2024
        (arXiv:2409.03137). optax.contrib.ademamix.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.ademamix(0.1, b3=0.5, alpha=2.0)
        >>> state = nba.step_(tx, {"w": np.array([3.0, -4.0])}, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]
        [-0.2, 0.2]
    """
    return chain(
        scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root, mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


# --- simplified AdEMAMix ------------------------------------------------------------------------


@state_class
class ScaleBySimplifiedAdEMAMixState(NamedTuple):
    """Simplified AdEMAMix's state (optax.contrib's fields).

    Attributes:
        t: the number of updates so far (int32, saturating).
        m: the EMA of the gradients without its ``1 - b1`` factor, a FlatTree of the params'
            layout.
        n: the second moment.
    """

    t: np.int32  # type: ignore[assignment]
    m: FlatTree
    n: FlatTree


@formula(
    states=("m", "n"),
    inputs=("g",),
    outputs=("out",),
    scalars=("b1", "b2", "alpha", "bc2", "eps", "eps_root"),
)
def simplified_ademamix_direction(m, n, g, b1, b2, alpha, bc2, eps, eps_root):
    """Simplified AdEMAMix, in optax's order of operations: m = g + b1 m; n = g^2 + b2 (n - g^2)
    (optax's ``lerp``); out = (m + alpha g) / (sqrt(n / bc2 + eps_root) + eps)."""
    a = g + b1 * m
    gg = g * g
    v = gg + b2 * (n - gg)
    return a, v, (a + alpha * g) / (math.sqrt(v / bc2 + eps_root) + eps)


class _ScaleBySimplifiedAdemamix(Elementwise):
    state_cls, fields, formula, name = (
        ScaleBySimplifiedAdEMAMixState,
        ("m", "n"),
        simplified_ademamix_direction,
        "scale_by_simplified_ademamix",
    )
    counted, count_field = True, "t"

    def __init__(self, b1: Any, b2: Any, alpha: Any, eps: Any, eps_root: Any) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.alpha = alpha if callable(alpha) else real(alpha, "alpha")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        t = int(count)
        alpha = real(self.alpha(t - 1), "alpha's value") if callable(self.alpha) else self.alpha  # optax: state.t
        return (self.b1, self.b2, alpha, bias_correction(self.b2, t, ct), self.eps, self.eps_root)


def scale_by_simplified_ademamix(
    b1: float = 0.99,
    b2: float = 0.95,
    alpha: ScalarOrSchedule = 0.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
) -> GradientTransformationExtraArgs:
    r"""Rescales the updates by Simplified AdEMAMix: one EMA without its ``1 - b1`` factor, mixed
    with the gradient.

    ``m = g + b1 m``, ``n = g^2 + b2 (n - g^2)``, ``u = (m + alpha g) / (sqrt(n / (1 - b2^t) +
    eps_root) + eps)``: the EMA is not bias-corrected, and ``alpha`` may be a schedule of the
    step count (the steps before this one). ``alpha = 0`` is Adam with ``b1``'s EMA scaled by
    ``1 / (1 - b1)``. One fused pass.

    Args:
        b1: decay of the EMA, between 0 and 1.
        b2: decay of the second moment, between 0 and 1.
        alpha: the gradient's weight in the mixture, or a schedule of it.
        eps: added to the square root.
        eps_root: added inside the square root.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleBySimplifiedAdEMAMixState(t, m,
            n)``, as optax.contrib's.

    Raises:
        TypeError: a hyperparameter has the wrong type.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Morwani et al., "Connections between Schedule-Free Optimizers, AdEMAMix, and Accelerated
        SGD Variants", 2025 (arXiv:2502.02431). optax.contrib.scale_by_simplified_ademamix.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_simplified_ademamix(alpha=1.0, b2=0.0)
        >>> g = {"w": np.array([3.0, -4.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # (g + g) / |g|
        [2.0, -2.0]
    """
    return _ScaleBySimplifiedAdemamix(b1, b2, alpha, eps, eps_root).transformation()


def simplified_ademamix(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.99,
    b2: float = 0.95,
    alpha: ScalarOrSchedule = 0.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """Simplified AdEMAMix with decoupled weight decay: ``chain(scale_by_simplified_ademamix(...),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``, one fused
    pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_simplified_ademamix`.
        b2: as in `scale_by_simplified_ademamix`.
        alpha: as in `scale_by_simplified_ademamix`.
        eps: as in `scale_by_simplified_ademamix`.
        eps_root: as in `scale_by_simplified_ademamix`.
        weight_decay: the decay rate.
        mask: which leaves decay (as `add_decayed_weights`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``(ScaleBySimplifiedAdEMAMixState(...), EmptyState(), EmptyState())``
            (``MaskedState`` for a masked decay, ``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter has the wrong type.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Morwani et al., "Connections between Schedule-Free Optimizers, AdEMAMix, and Accelerated
        SGD Variants", 2025 (arXiv:2502.02431). optax.contrib.simplified_ademamix.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.simplified_ademamix(0.1, alpha=1.0, b2=0.0)
        >>> state = nba.step_(tx, {"w": np.array([3.0, -4.0])}, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]
        [-0.2, 0.2]
    """
    return chain(
        scale_by_simplified_ademamix(b1, b2, alpha, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


# --- reduce on plateau -------------------------------------------------------------------------


@state_class
class ReduceLROnPlateauState(NamedTuple):
    """State of `reduce_on_plateau` (optax.contrib's fields).

    Attributes:
        scale: the factor the updates are multiplied by (the params' lowest float dtype).
        best_value: the best average value seen (the params' highest float dtype).
        plateau_count: checks without improvement since the last one (int32).
        cooldown_count: checks left before the plateau count runs again (int32).
        count: values accumulated towards the next check (int32).
        avg_value: their running mean.
    """

    scale: Any
    best_value: Any
    plateau_count: np.int32
    cooldown_count: np.int32
    count: np.int32  # type: ignore[assignment]
    avg_value: Any


class _ReduceOnPlateau(Stage):
    complex_leaves = True
    public_name = "reduce_on_plateau"

    def __init__(
        self,
        factor: Any,
        patience: Any,
        rtol: Any,
        atol: Any,
        cooldown: Any,
        accumulation_size: Any,
        min_scale: Any,
    ) -> None:
        self.factor = real(factor, "factor")
        if not 0.0 < self.factor < 1.0:
            raise ValueError(f"Factor must be in the range (0, 1), got factor = {factor!r}.")
        self.rtol, self.atol = real(rtol, "rtol"), real(atol, "atol")
        if self.rtol < 0.0 or self.atol < 0.0:
            raise ValueError(
                f"Both rtol and atol must be non-negative, got rtol = {rtol!r} and atol = {atol!r}."
            )
        if self.rtol == 0.0 and self.atol == 0.0:
            raise ValueError("At least one of rtol or atol must be positive, got rtol = 0 and atol = 0.")
        if self.rtol > 1.0:
            raise ValueError(f"rtol must be less than or equal to 1.0, got rtol = {rtol!r}.")
        self.patience, self.cooldown = integer(patience, "patience"), integer(cooldown, "cooldown")
        self.accumulation_size = integer(accumulation_size, "accumulation_size")
        if self.accumulation_size < 1:
            raise ValueError(f"accumulation_size must be >= 1, got {accumulation_size!r}")
        self.min_scale = real(min_scale, "min_scale")

    def init(self, params: Any) -> ReduceLROnPlateauState:
        layout = layout_of(params, "params")
        reals = [real_dtype(d) for d in layout.dtypes] or [np.dtype(np.float32)]
        low, high = min(reals, key=lambda d: d.itemsize), max(reals, key=lambda d: d.itemsize)
        return ReduceLROnPlateauState(
            low.type(1.0), high.type(np.inf), np.int32(0), np.int32(0), np.int32(0), high.type(0.0)
        )

    def declare(self, spec: Spec, state: Any) -> Scale:
        if not isinstance(state, ReduceLROnPlateauState):
            raise wrong_state("ReduceLROnPlateauState", state)
        part = Scale(ONE, None, "reduce_on_plateau")

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not isinstance(state, ReduceLROnPlateauState):
                return False
            new = self._next(state, _objective_value(extra, "reduce_on_plateau"))
            part.factor = Factor(1.0, float(new.scale))
            part.new_state = new
            return True

        part.tick = tick
        return part

    def _next(self, state: ReduceLROnPlateauState, value: float) -> ReduceLROnPlateauState:
        """optax's update of the state, in the state's dtypes."""
        avg = np.asarray(state.avg_value)
        t = avg.dtype.type
        count = int(state.count)
        new_count = safe_increment(np.int32(count))
        with np.errstate(all="ignore"):
            avg = t((t(count) * avg + t(value)) / t(int(new_count)))
        state = state._replace(avg_value=avg, count=new_count)
        if int(new_count) != self.accumulation_size:
            return state
        best = np.asarray(state.best_value)
        with np.errstate(all="ignore"):
            improved = bool(avg < (1 - self.rtol) * best - self.atol)
        new_best = best.dtype.type(avg) if improved else best.dtype.type(best)
        plateau = 0 if improved else int(safe_increment(np.int32(int(state.plateau_count))))
        scale = np.asarray(state.scale)
        if int(state.cooldown_count) > 0:
            new_plateau, new_scale, cooldown = 0, scale, int(state.cooldown_count) - 1
        else:
            hit = plateau == self.patience
            new_plateau = 0 if hit else plateau
            new_scale = np.maximum(scale.dtype.type(scale * self.factor) if hit else scale, self.min_scale)
            cooldown = self.cooldown if hit else 0
        return ReduceLROnPlateauState(
            scale.dtype.type(new_scale),
            new_best,
            np.int32(new_plateau),
            np.int32(cooldown),
            np.int32(0),
            t(0.0),
        )


def reduce_on_plateau(
    factor: float = 0.1,
    patience: int = 10,
    rtol: float = 1e-4,
    atol: float = 0.0,
    cooldown: int = 0,
    accumulation_size: int = 1,
    min_scale: float = 0.0,
) -> GradientTransformationExtraArgs:
    """Scales the updates down by ``factor`` when the objective stops improving.

    Each update takes the objective's ``value`` (``update(..., value=loss)``); every
    ``accumulation_size`` values their mean is checked: it improves on the best mean when below
    ``(1 - rtol) * best - atol``; after ``patience`` checks without improvement the scale is
    multiplied by ``factor`` (not below ``min_scale``) and the count waits ``cooldown`` checks
    before running again. The updates are multiplied by the current scale: a pending factor,
    fused with the next kernel. Put it after the optimizer:
    ``chain(adam(lr), reduce_on_plateau())``.

    Args:
        factor: the scale's reduction, in (0, 1).
        patience: checks without improvement before a reduction.
        rtol: the relative improvement that counts (``0 <= rtol <= 1``).
        atol: the absolute improvement that counts (``>= 0``; ``rtol`` or ``atol`` positive).
        cooldown: checks after a reduction before the patience count resumes.
        accumulation_size: values averaged per check (``>= 1``; a mini-batch loss: more).
        min_scale: the smallest scale.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ReduceLROnPlateauState(scale,
            best_value, plateau_count, cooldown_count, count, avg_value)``, as optax.contrib's.

    Raises:
        TypeError: an argument has the wrong type; at an update, ``value`` is missing or not a
            real scalar.
        ValueError: an argument is out of range (optax's messages).

    References:
        PyTorch's ``torch.optim.lr_scheduler.ReduceLROnPlateau``; optax.contrib.reduce_on_plateau.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.chain(nba.sgd(0.1), nba.reduce_on_plateau(factor=0.5, patience=2))
        >>> params = {"w": np.ones(2)}
        >>> state = tx.init(params)
        >>> for loss in [1.0, 0.9, 0.9, 0.9]:  # no progress after the second
        ...     state = nba.step_(tx, {"w": np.ones(2)}, state, params, value=loss)
        >>> float(state[1].scale)  # halved after 2 checks without improvement
        0.5
    """
    return _ReduceOnPlateau(
        factor, patience, rtol, atol, cooldown, accumulation_size, min_scale
    ).transformation()


# --- schedule-free -----------------------------------------------------------------------------


@state_class
class ScheduleFreeState(NamedTuple):
    """State of `schedule_free` (optax.contrib's fields).

    Attributes:
        b1: the interpolation between ``x`` and ``z`` (the params' lowest float dtype).
        weight_sum: the sum of the averaging weights so far.
        step_count: the step of the next update, from 1 (int32; the learning rate schedule's
            argument).
        max_lr: the largest learning rate so far.
        base_optimizer_state: the base optimizer's state.
        z: the base optimizer's iterates, a FlatTree of the params' layout (``state_dtype``).
    """

    b1: Any
    weight_sum: Any
    step_count: np.int32
    max_lr: Any
    base_optimizer_state: Any
    z: FlatTree


@formula(
    states=("z",),
    inputs=("g", "params"),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "ck", "one_minus_ck"),
)
def schedule_free_direction(z, g, params, b1, one_minus_b1, ck, one_minus_ck):
    """Schedule-free: z' = z + g (the base optimizer's update); x = (y - (1 - b1) z) / b1 is the
    average the params y were interpolated from; x' = (1 - ck) x + ck z'; out = b1 x' + (1 -
    b1) z' - y (the params become the new interpolation)."""
    zn = z + g
    x = (params - one_minus_b1 * z) / b1
    xn = one_minus_ck * x + ck * zn
    return zn, (b1 * xn + one_minus_b1 * zn) - params


class _ScheduleFree(Stage):
    """`schedule_free`: the base optimizer's step, then one pass over ``z``, the params and its
    updates (`schedule_free_direction`)."""

    complex_leaves = True  # optax's: z and the interpolation complex, its scalars real
    public_name = "schedule_free"
    formula = schedule_free_direction  # run by its own pass (the driver's map_)

    def __init__(
        self, base: Any, learning_rate: Any, b1: Any, weight_lr_power: Any, state_dtype: Any
    ) -> None:
        self.inner = with_extra_args_support(transformation(base, "base_optimizer"))
        self.stage = as_stage(self.inner)
        if self.stage.reshapes:
            raise TypeError("schedule_free: the base optimizer must not change the updates' shape")
        self.learning_rate = (
            learning_rate if callable(learning_rate) else real(learning_rate, "learning_rate")
        )
        self.b1 = real(b1, "b1")
        if not 0.0 < self.b1 <= 1.0:
            raise ValueError(f"b1 must be in (0, 1] (schedule_free divides by it), got {b1!r}")
        self.power = real(weight_lr_power, "weight_lr_power")
        self.state_dtype = (
            None if state_dtype is None else check_float_dtype(state_dtype, "state_dtype", complex=True)
        )

    def refuses_complex(self) -> Any:
        return self.stage.refuses_complex() or Stage.refuses_complex(self)

    def foreign(self) -> bool:
        return self.stage.foreign()

    def init(self, params: Any) -> ScheduleFreeState:
        layout, device = layout_and_device(params, "params")
        if self.state_dtype is not None:  # complex exactly where the params are
            check_storage([self.state_dtype] * len(layout.groups), layout, "state_dtype")
        reals = [real_dtype(d) for d in layout.dtypes] or [np.dtype(np.float32)]
        low = min(reals, key=lambda d: d.itemsize)
        flat = params if isinstance(params, FlatTree) else None
        z = FlatTree.empty(layout, self.state_dtype, device)
        src = flat if flat is not None else as_flat(params, layout, "params", device=device)[0]
        for o, p in zip(z.groups, src.groups):
            ops_for(o).scale_(o, p, ONE)  # z starts at the params (a copy)
        t = low.type
        return ScheduleFreeState(t(self.b1), t(0.0), np.int32(1), t(0.0), self.inner.init(params), z)

    def owner(self, state: Any) -> FlatTree | None:
        ok = isinstance(state, ScheduleFreeState) and isinstance(state.z, FlatTree)
        return state.z if ok else None

    def declare(self, spec: Spec, state: Any) -> Host:
        """One `numbaccum.fuse.Host` (a control node): the base optimizer's plan, declared here
        too (`numbaccum.runner.sub_plan`) and replayed by the run, then the pass over ``z``."""
        z = expect_state(state, ScheduleFreeState, "z", spec, renew=False)
        buffers, inner = (("z", z.__dict__),), self.stage
        base_state = state.base_optimizer_state
        owner = inner.owner(base_state)
        if owner is not None and (owner.layout is not spec.layout or owner.device != spec.device):
            owner = None
        sub = runner.sub_plan(inner, spec, base_state, owner, "schedule_free.")
        assert sub is not None  # (a base optimizer that reshapes is refused when built)
        learning_rate, power, b1 = self.learning_rate, self.power, self.b1
        launches = Launches()  # the pass over z, kept for the buffers it last ran on
        step: list = [None] * 5  # this step's params, scalars, values of the new state, base state

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not holds(state, ScheduleFreeState, buffers):
                return False
            if params is None:
                raise ValueError("schedule_free needs params: call update(updates, state, params)")
            new_z = current(state.z, "z")
            t = np.asarray(state.max_lr).dtype.type
            if callable(learning_rate):
                lr = t(scheduled(learning_rate, state.step_count, "learning_rate"))
            else:
                lr = t(learning_rate)
            with np.errstate(all="ignore"):  # optax's: NaN stays NaN, a 0 / 0 weight is 0
                max_lr = np.maximum(t(state.max_lr), lr)
                weight = t(max_lr**power)
                total = t(t(state.weight_sum) + weight)
                ck = (
                    t(np.nan)
                    if np.isnan(weight) or np.isnan(total)
                    else t(np.nan_to_num(weight / total, nan=0.0))
                )
            # optax's b1 is the Python float (1.0 - b1 in Python); 1.0 - ck in the state's dtype
            scalars = (b1, 1.0 - b1, ck, t(1.0) - ck)
            base = state.base_optimizer_state
            if not sub.tick(base, params, extra):  # the base state holds other buffers
                return False
            values = (state.b1, total, safe_increment(state.step_count), max_lr)
            step[:] = (params, scalars, values, new_z, base)
            return True

        def run(u: Updates) -> tuple[Updates, ScheduleFreeState]:
            params, scalars, (b1_, weight_sum, step_count, max_lr), z, base = step
            base_u, base_state = runner.replay(sub, base, u, None, True)  # ticked by `tick`
            p = params.flat()
            out = base_u.fresh() if base_u.owned else u.fresh()
            for gi, arrays in enumerate(zip(z.groups, base_u.flat.groups, p.groups, out.groups)):
                launches.run(schedule_free_direction, gi, list(arrays), base_u.factor, scalars)
            new_state = ScheduleFreeState(b1_, weight_sum, step_count, max_lr, base_state, z)
            return Updates(out, True, scratch=u.scratch), new_state

        # the base optimizer's passes, then one over z, its updates and the params (writes z and
        # the updates)
        passes = lambda apply: (runner.Sub(sub, False), ("kernel", "interpolation", 3.0, 2.0))  # noqa: E731
        part = Host(run, passes, self.public_name, tick, settles=False)
        return part


def schedule_free(
    base_optimizer: Any,
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    weight_lr_power: float = 2.0,
    state_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """Makes ``base_optimizer`` schedule-free: its momentum replaced by interpolation and
    averaging, so no decaying learning rate schedule is needed.

    With ``z`` the base optimizer's iterates (``z' = z + base_update``) and ``x`` their average
    (``x' = (1 - c) x + c z'``, ``c = w_t / sum w`` with ``w_t = max_lr^weight_lr_power``), the
    params are the interpolation ``y = b1 x + (1 - b1) z``; gradients are taken at ``y``, and
    `schedule_free_eval_params` gives ``x`` for evaluation. Turn the base optimizer's momentum
    off (``adam(lr, b1=0.0)``). One pass after the base optimizer's.

    Args:
        base_optimizer: the base transformation (its updates added to ``z``).
        learning_rate: the learning rate (a float or a schedule of the step, from 1), the same
            as the base optimizer's: it weighs the averaging.
        b1: the interpolation, in (0, 1].
        weight_lr_power: the power of the learning rate in the averaging weights.
        state_dtype: the dtype of ``z`` (None: each leaf's); complex for complex params (and
            real for real ones).

    Returns:
        A `GradientTransformationExtraArgs` whose ``update`` needs params; its state is
            ``ScheduleFreeState(b1, weight_sum, step_count, max_lr, base_optimizer_state, z)``, as
            optax.contrib's.

    Raises:
        TypeError: an argument has the wrong type; at ``init``, a real ``state_dtype`` for
            complex params or a complex one for real params.
        ValueError: ``b1`` is not in (0, 1]; at an update, no params.

    References:
        Defazio et al., "The Road Less Scheduled", NeurIPS 2024 (arXiv:2405.15682).
        optax.contrib.schedule_free.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.schedule_free(nba.sgd(0.5), learning_rate=0.5)
        >>> params = {"x": np.array([2.0])}
        >>> state = tx.init(params)
        >>> for _ in range(20):
        ...     state = nba.step_(tx, {"x": 2 * params["x"]}, state, params)  # grad of x^2
        >>> bool(abs(nba.schedule_free_eval_params(state, params)["x"][0]) < 0.25)
        True
    """
    return _ScheduleFree(base_optimizer, learning_rate, b1, weight_lr_power, state_dtype).transformation()


def schedule_free_eval_params(state: Any, params: Any) -> Any:
    """The params to evaluate a schedule-free model at: the average ``x = (y - (1 - b1) z) /
    b1`` of the state's ``z`` and the params ``y`` (a new tree; the params are not changed).

    Args:
        state: a `ScheduleFreeState` (or a state holding one, e.g. a chain's).
        params: the params (``y``), a tree of the state's layout.

    Returns:
        A tree like ``params``.

    Raises:
        ValueError: no `ScheduleFreeState` in ``state``.

    References:
        optax.contrib.schedule_free_eval_params.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.schedule_free_sgd(0.1)
        >>> params = {"w": np.ones(2)}
        >>> state = nba.step_(tx, {"w": np.ones(2)}, tx.init(params), params)
        >>> nba.schedule_free_eval_params(state, params)["w"]  # x: where z went (1 - 0.1 * 1)
        array([0.9, 0.9])
    """
    found = find_state(state, ScheduleFreeState)
    if found is None:
        raise ValueError("schedule_free_eval_params requires a ScheduleFreeState as input.")
    b1 = float(found.b1)
    z = found.z.tree_as("numpy") if not found.z.device else found.z.copy().tree
    return tree_map(lambda y, zi: (np.asarray(y) - (1.0 - b1) * np.asarray(zi)) / b1, params, z)


def _warmed_up(learning_rate: Any, warmup_steps: Any) -> Any:
    """optax.contrib's linear warmup from 0 over ``warmup_steps`` (None: the rate as it is)."""
    if warmup_steps is None:
        return learning_rate
    steps = integer(warmup_steps, "warmup_steps")
    return warmup_constant_schedule(init_value=0.0, peak_value=learning_rate, warmup_steps=steps)


def schedule_free_sgd(
    learning_rate: float = 1.0,
    warmup_steps: int | None = None,
    b1: float = 0.9,
    weight_decay: float | None = None,
    weight_lr_power: float = 2.0,
    state_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """Schedule-free SGD: `schedule_free` of ``sgd(learning_rate)`` (after
    ``add_decayed_weights(weight_decay)`` when given), with a linear warmup from 0 over
    ``warmup_steps`` when given, as optax.contrib builds it.

    Args:
        learning_rate: the peak learning rate.
        warmup_steps: the warmup's length (None: no warmup).
        b1: as in `schedule_free`.
        weight_decay: the decay rate (None: none).
        weight_lr_power: as in `schedule_free`.
        state_dtype: as in `schedule_free`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is a ``ScheduleFreeState``.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range.

    References:
        Defazio et al., "The Road Less Scheduled", NeurIPS 2024 (arXiv:2405.15682).
        optax.contrib.schedule_free_sgd.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.schedule_free_sgd(0.1)
        >>> params = {"w": np.ones(2)}
        >>> state = nba.step_(tx, {"w": np.ones(2)}, tx.init(params), params)
        >>> params["w"]  # b1 x + (1 - b1) z with x = z = 0.9 after the first step
        array([0.9, 0.9])
    """
    lr = _warmed_up(learning_rate, warmup_steps)
    optimizer = sgd(lr)
    if weight_decay is not None:
        optimizer = chain(add_decayed_weights(weight_decay), optimizer)
    return schedule_free(optimizer, lr, b1, weight_lr_power, state_dtype)


def schedule_free_adamw(
    learning_rate: float = 0.0025,
    warmup_steps: int | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_lr_power: float = 2.0,
    state_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """Schedule-free AdamW: `schedule_free` of ``chain(scale_by_rms(b2, eps, eps_in_sqrt=False,
    bias_correction=True), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``
    (Adam without momentum), with a linear warmup over ``warmup_steps`` when given, as
    optax.contrib builds it.

    Args:
        learning_rate: the peak learning rate.
        warmup_steps: the warmup's length (None: no warmup).
        b1: as in `schedule_free`.
        b2: the second moment's decay.
        eps: added to its square root.
        weight_decay: the decay rate.
        weight_lr_power: as in `schedule_free`.
        state_dtype: as in `schedule_free`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is a ``ScheduleFreeState``.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range.

    References:
        Defazio et al., "The Road Less Scheduled", NeurIPS 2024 (arXiv:2405.15682).
        optax.contrib.schedule_free_adamw.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.schedule_free_adamw(0.1)
        >>> params = {"w": np.zeros(2)}
        >>> state = nba.step_(tx, {"w": np.array([1.0, -1.0])}, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # the first step: -lr * sign(g)
        [-0.1, 0.1]
    """
    lr = _warmed_up(learning_rate, warmup_steps)
    optimizer = chain(
        scale_by_rms(
            decay=check_decay(b2, "b2"), eps=real(eps, "eps"), eps_in_sqrt=False, bias_correction=True
        ),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )
    return schedule_free(optimizer, lr, b1, weight_lr_power, state_dtype)


# --- learning-rate-free AdamW: D-Adaptation and Prodigy ----------------------------------------


@state_class
class DAdaptAdamWState(NamedTuple):
    """State of `dadapt_adamw` (optax.contrib's fields).

    Attributes:
        exp_avg: the first moment of the scaled gradients, a FlatTree of the params' layout.
        exp_avg_sq: the second moment of the gradients.
        grad_sum: the EMA of the scaled gradients' sum.
        estim_lr: the estimate of the distance to the solution (the params' lowest dtype).
        numerator_weighted: its running numerator.
        count: the number of updates so far (int32, saturating).
    """

    exp_avg: FlatTree
    exp_avg_sq: FlatTree
    grad_sum: FlatTree
    estim_lr: Any
    numerator_weighted: Any
    count: np.int32  # type: ignore[assignment]


@state_class
class ProdigyState(NamedTuple):
    """State of `prodigy` (optax.contrib's fields).

    Attributes:
        exp_avg: the first moment of the scaled gradients, a FlatTree of the params' layout.
        exp_avg_sq: their second moment.
        grad_sum: the EMA of the scaled gradients' sum.
        params0: the params at ``init``.
        estim_lr: the estimate of the distance to the solution (the params' lowest dtype).
        numerator_weighted: its running numerator.
        count: the number of updates so far (int32, saturating).
    """

    exp_avg: FlatTree
    exp_avg_sq: FlatTree
    grad_sum: FlatTree
    params0: FlatTree
    estim_lr: Any
    numerator_weighted: Any
    count: np.int32  # type: ignore[assignment]


@formula(
    states=("exp_avg", "exp_avg_sq", "grad_sum"),
    inputs=("g", "params"),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "b2", "one_minus_b2", "sb2", "one_minus_sb2", "dlr", "neg_wd_dlr", "eps"),
)
def dadapt_direction(
    exp_avg,
    exp_avg_sq,
    grad_sum,
    g,
    params,
    b1,
    one_minus_b1,
    b2,
    one_minus_b2,
    sb2,
    one_minus_sb2,
    dlr,
    neg_wd_dlr,
    eps,
):
    """D-Adaptation AdamW (optax.contrib's order): ea = b1 ea + ((1 - b1) dlr) g; eas = b2 eas +
    ((1 - b2) g) g; s = sb2 s + ((1 - sb2) dlr) g; out = -wd dlr p - ea / (sqrt(eas) + eps)."""
    ea = b1 * exp_avg + one_minus_b1 * dlr * g
    eas = b2 * exp_avg_sq + one_minus_b2 * g * g
    s = sb2 * grad_sum + one_minus_sb2 * dlr * g
    return ea, eas, s, neg_wd_dlr * params - ea / (math.sqrt(eas) + eps)


@formula(
    states=("exp_avg", "exp_avg_sq", "grad_sum"),
    inputs=("g", "params"),
    outputs=("out",),
    scalars=(
        "b1",
        "one_minus_b1",
        "b2",
        "one_minus_b2",
        "b3",
        "estim_lr",
        "gs_rate",
        "estim_lr0",
        "dlr",
        "neg_wd_dlr",
        "eps_d",
    ),
)
def prodigy_direction(
    exp_avg,
    exp_avg_sq,
    grad_sum,
    g,
    params,
    b1,
    one_minus_b1,
    b2,
    one_minus_b2,
    b3,
    estim_lr,
    gs_rate,
    estim_lr0,
    dlr,
    neg_wd_dlr,
    eps_d,
):
    """Prodigy (optax.contrib's order): dg = d g; ea = b1 ea + (1 - b1) dg; eas = b2 eas + ((1 -
    b2) dg) dg; s = b3 s + (rate dg) / d0; out = -wd dlr p - (dlr ea) / (sqrt(eas) + eps_d), as
    `prodigy_update` computes it (``eps_d`` the ``d eps`` of the estimate before this step: the
    new one's wherever the estimate stays)."""
    dg = estim_lr * g
    ea = b1 * exp_avg + one_minus_b1 * dg
    eas = b2 * exp_avg_sq + one_minus_b2 * dg * dg
    s = b3 * grad_sum + gs_rate * dg / estim_lr0
    return ea, eas, s, neg_wd_dlr * params - dlr * ea / (math.sqrt(eas) + eps_d)


@formula(
    inputs=("exp_avg", "exp_avg_sq", "params"), outputs=("out",), scalars=("dlr", "neg_wd_dlr", "eps_d")
)
def prodigy_update(exp_avg, exp_avg_sq, params, dlr, neg_wd_dlr, eps_d):
    """Prodigy's update: out = -wd dlr p - (dlr ea) / (sqrt(eas) + d eps), ``eps_d`` the ``d eps``
    of the new estimate d (optax's and the paper's order: the estimate grows before the update)."""
    return neg_wd_dlr * params - dlr * exp_avg / (math.sqrt(exp_avg_sq) + eps_d)


@formula(states=("diff",), inputs=("g", "params0", "params"), outputs=(), scalars=())
def params_diff(diff, g, params0, params):
    """diff = params0 - params (``g`` unused: the driver's first input)."""
    return params0 - params


@formula(states=("weighted",), inputs=("grad_sum", "exp_avg_sq"), outputs=(), scalars=("eps",))
def dadapt_weighted(weighted, grad_sum, exp_avg_sq, eps):
    """weighted = s / (sqrt(eas) + eps)."""
    return grad_sum / (math.sqrt(exp_avg_sq) + eps)


class _LrFree(Stage):
    """`dadapt_adamw` and `prodigy`: one inner product of the gradient with a per-element
    quantity (its own pass into a workspace, then one float64 reduction), the moments and the
    update in one pass, and the L1 norm of the new ``grad_sum`` (one reduction)."""

    # The formulas its passes run (the driver's map_), declared for the contract's tests.
    formulas = (dadapt_direction, prodigy_direction, prodigy_update, params_diff, dadapt_weighted)

    def __init__(
        self,
        prodigy: bool,
        learning_rate: Any,
        betas: Any,
        eps: Any,
        estim_lr0: Any,
        weight_decay: Any,
        beta3: Any = None,
        estim_lr_coef: Any = 1.0,
        safeguard_warmup: Any = False,
    ) -> None:
        self.prodigy = prodigy
        self.learning_rate = (
            learning_rate if callable(learning_rate) else real(learning_rate, "learning_rate")
        )
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r:.60}")
        self.b1, self.b2 = check_decay(betas[0], "betas[0]"), check_decay(betas[1], "betas[1]")
        self.eps, self.estim_lr0 = real(eps, "eps"), real(estim_lr0, "estim_lr0")
        if not self.estim_lr0 > 0.0:
            raise ValueError(f"estim_lr0 must be > 0, got {estim_lr0!r}")
        self.weight_decay = real(weight_decay, "weight_decay")
        self.b3 = self.b2**0.5 if beta3 is None else check_decay(beta3, "beta3")
        self.coef = real(estim_lr_coef, "estim_lr_coef")
        self.safeguard = flag(safeguard_warmup, "safeguard_warmup")
        self.state_cls = ProdigyState if prodigy else DAdaptAdamWState

    @property
    def public_name(self) -> str:  # type: ignore[override]
        return "prodigy" if self.prodigy else "dadapt_adamw"

    def init(self, params: Any) -> Any:
        layout, device = layout_and_device(params, "params")
        reals = [real_dtype(d) for d in layout.dtypes] or [np.dtype(np.float32)]
        t = min(reals, key=lambda d: d.itemsize).type
        exp_avg, exp_avg_sq, grad_sum = (FlatTree.zeros(layout, None, device) for _ in range(3))
        scalars = (t(self.estim_lr0), t(0.0), np.int32(0))
        if not self.prodigy:
            return DAdaptAdamWState(exp_avg, exp_avg_sq, grad_sum, *scalars)
        p0 = FlatTree.empty(layout, None, device)
        src = params if isinstance(params, FlatTree) else as_flat(params, layout, "params", device=device)[0]
        for o, p in zip(p0.groups, src.groups):
            ops_for(o).scale_(o, p, ONE)
        return ProdigyState(exp_avg, exp_avg_sq, grad_sum, p0, *scalars)

    def owner(self, state: Any) -> FlatTree | None:
        ok = isinstance(state, self.state_cls) and isinstance(state.exp_avg, FlatTree)
        return state.exp_avg if ok else None

    def declare(self, spec: Spec, state: Any) -> Host:
        """One `numbaccum.fuse.Host` over ``state``'s buffers (checked here); each step's
        scalars come from its tick."""
        cls, prodigy = self.state_cls, self.prodigy
        ea = expect_state(state, cls, "exp_avg", spec, renew=False)
        eas = expect_state(state, cls, "exp_avg_sq", spec, renew=False)
        gs = expect_state(state, cls, "grad_sum", spec, renew=False)
        p0 = expect_state(state, cls, "params0", spec, renew=False) if prodigy else None
        fields = ("exp_avg", "exp_avg_sq", "grad_sum", "params0")
        buffers = tuple((f, b.__dict__) for f, b in zip(fields, (ea, eas, gs, p0)) if b is not None)
        b1, b2, eps, wd, name = self.b1, self.b2, self.eps, self.weight_decay, self.public_name
        b3, d0, coef, sb2 = self.b3, self.estim_lr0, self.coef, b2**0.5
        # The passes' launches and the reductions, kept for the buffers they last ran on.
        launches, sums, wholes = Launches(), Reductions(), [whole(a.size) for a in ea.groups]
        # this step's t, count, d, nw, dlr, neg_wd_dlr, scalars, params and the buffers it keeps
        step: list = [None] * 9

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not holds(state, cls, buffers):
                return False
            if params is None:
                raise ValueError(f"{name} needs params: call update(updates, state, params)")
            new_ea = current(state.exp_avg, "exp_avg")
            t = np.asarray(state.estim_lr).dtype.type
            count = int(state.count)
            c = safe_increment(np.int32(count))
            sched = (
                scheduled(self.learning_rate, np.int32(count), "learning_rate")
                if callable(self.learning_rate)
                else self.learning_rate
            )
            d, nw = t(state.estim_lr), t(state.numerator_weighted)
            with np.errstate(all="ignore"):
                bc = t(t(t(1) - t(b2) ** int(c)) ** t(0.5)) / t(t(1) - t(b1) ** int(c))
                dlr = t(t(d * t(sched)) * bc)
                neg_wd_dlr = t(t(-wd) * dlr)
            scalars: tuple  # the formula's: prodigy's eleven, D-Adaptation's nine
            if prodigy:
                rate = d if self.safeguard else dlr
                scalars = (b1, 1.0 - b1, b2, 1.0 - b2, b3, d, rate, d0, dlr, neg_wd_dlr, t(d * t(eps)))
            else:
                scalars = (b1, 1.0 - b1, b2, 1.0 - b2, sb2, 1.0 - sb2, dlr, neg_wd_dlr, eps)
            kept = (new_ea, state.exp_avg_sq, state.grad_sum, state.params0 if prodigy else None)
            step[:] = (t, c, d, nw, dlr, neg_wd_dlr, scalars, params, kept)
            return True

        def run(u: Updates) -> tuple[Updates, Any]:
            t, c, d, nw, dlr, neg_wd_dlr, scalars, params, (ea, eas, gs, p0) = step
            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            g, p = u.flat, params.flat()
            tmp = ea.workspace("weighted")
            for gi, (tg, a, b, x) in enumerate(
                zip(tmp.groups, (p0 or gs).groups, (p.groups if prodigy else eas.groups), g.groups)
            ):
                if prodigy:  # p0 - p, as optax's param_diff
                    launches.run(params_diff, gi, [tg, x, a, b], ONE, ())
                else:  # s / (sqrt(eas) + eps), from the state before this step
                    launches.run(dadapt_weighted, gi, [tg, a, b], ONE, (eps,))
            acum = t(sum(map(sums.dot, range(len(wholes)), g.groups, tmp.groups)))
            out = u.fresh()
            direction = prodigy_direction if prodigy else dadapt_direction
            for gi, arrays in enumerate(zip(ea.groups, eas.groups, gs.groups, g.groups, p.groups, out.groups)):
                launches.run(direction, gi, list(arrays), ONE, scalars)
            l1 = 0.0
            for gi, x in enumerate(gs.groups):
                l1 += float(sums.reduce(gi, "sumabs", x, wholes[gi])[0])
            l1 = t(l1)
            with np.errstate(all="ignore"):
                if prodigy:
                    new_nw = t(t(b3) * nw + t(t(d / t(d0)) * dlr) * acum)
                    estimate = t(t(coef) * new_nw / l1)
                else:
                    new_nw = t(t(sb2) * nw + t(t(1 - sb2) * dlr) * acum)
                    estimate = t(new_nw / t(t(1 - sb2) * l1))
                new_d = t(np.maximum(d, estimate))  # NaN if either is (jnp.maximum)
            if prodigy and not new_d == d:
                # Prodigy's eps term takes the new estimate, known only after the L1 norm: the
                # fused pass assumed d stays (most steps), and where it grew (or is NaN: an inf or
                # NaN gradient makes every element's update NaN, as optax's) the update is made
                # again from the moments just stored, one pass of its own.
                with np.errstate(all="ignore"):
                    eps_d = t(new_d * t(eps))
                for gi, arrays in enumerate(zip(ea.groups, eas.groups, p.groups, out.groups)):
                    launches.run(prodigy_update, gi, list(arrays), ONE, (dlr, neg_wd_dlr, eps_d))
            tail = (new_d, new_nw, c)
            new = ProdigyState(ea, eas, gs, p0, *tail) if prodigy else DAdaptAdamWState(ea, eas, gs, *tail)
            return Updates(out, True, scratch=u.scratch), new

        # the inner product's quantity (a pass into a workspace) and its dot with the updates,
        # the moments and the update in one pass, the L1 norm of the new grad_sum; Prodigy
        # makes the update again (one more pass) on the steps its estimate grows
        passes = (
            ("kernel", "p0 - p" if prodigy else "s / (sqrt(v) + eps)", 2.0, 1.0),
            ("reduction", "inner product", 2.0, 0.0),
            ("kernel", "moments and update", 5.0, 4.0),
            ("reduction", "L1 norm of grad_sum", 1.0, 0.0),
        )
        part = Host(run, passes, name, tick)
        return part


def dadapt_adamw(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    estim_lr0: float = 1e-6,
    weight_decay: float = 0.0,
) -> GradientTransformationExtraArgs:
    """Learning-rate-free AdamW by D-Adaptation: the step size is AdamW's times an estimate
    ``d`` of the distance to the solution, which only grows.

    With ``dlr = d * lr * sqrt(1 - b2^t) / (1 - b1^t)``: ``ea = b1 ea + (1 - b1) dlr g``, ``eas =
    b2 eas + (1 - b2) g^2``, ``s = sqrt(b2) s + (1 - sqrt(b2)) dlr g``; ``u = -wd dlr p - ea /
    (sqrt(eas) + eps)``; then ``d = max(d, N / ((1 - sqrt(b2)) ||s||_1))`` with ``N`` the weighted
    sum of ``dlr <g, s_prev / (sqrt(eas_prev) + eps)>``. The inner product and the L1 norm are
    float64 reductions; the moments and the update one pass. Needs params.

    Args:
        learning_rate: a factor on the estimated rate (1 by default), or a schedule.
        betas: ``(b1, b2)``, Adam's decays.
        eps: added to the square root.
        estim_lr0: the first estimate of ``d`` (``> 0``).
        weight_decay: decoupled weight decay.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``DAdaptAdamWState(exp_avg,
            exp_avg_sq, grad_sum, estim_lr, numerator_weighted, count)``, as optax.contrib's.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a decay is not between 0 and 1, or ``estim_lr0 <= 0``; at an update, no params.

    References:
        Defazio and Mishchenko, "Learning-Rate-Free Learning by D-Adaptation", ICML 2023
        (arXiv:2301.07733). optax.contrib.dadapt_adamw.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.dadapt_adamw()
        >>> params = {"x": np.array([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> for _ in range(50):
        ...     state = nba.step_(tx, {"x": 2 * params["x"]}, state, params)
        >>> bool(state.estim_lr > 1e-6)  # the distance estimate grew from its first guess
        True
    """
    return _LrFree(False, learning_rate, betas, eps, estim_lr0, weight_decay).transformation()


def prodigy(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    beta3: float | None = None,
    eps: float = 1e-8,
    estim_lr0: float = 1e-6,
    estim_lr_coef: float = 1.0,
    weight_decay: float = 0.0,
    safeguard_warmup: bool = False,
) -> GradientTransformationExtraArgs:
    """Learning-rate-free AdamW by Prodigy: D-Adaptation with the distance measured from the
    initial params.

    With ``dg = d g`` and ``dlr = d * lr * sqrt(1 - b2^t) / (1 - b1^t)``: ``ea = b1 ea + (1 - b1)
    dg``, ``eas = b2 eas + (1 - b2) dg^2``, ``s = b3 s + dlr dg / d0`` (``d dg / d0`` with
    ``safeguard_warmup``); ``N = b3 N + (d / d0) dlr <g, p0 - p>``, ``d' = max(d, coef N /
    ||s||_1)``; ``u = -wd dlr p - dlr ea / (sqrt(eas) + d' eps)``, with the new estimate ``d'``
    (optax's and the paper's order), so an inf or NaN gradient makes every update NaN, as in
    optax. The inner product and the L1 norm are float64 reductions; the moments and the update
    one pass, and a second pass for the update on the steps where ``d`` grows. Needs params.

    Args:
        learning_rate: a factor on the estimated rate (1 by default), or a schedule.
        betas: ``(b1, b2)``, Adam's decays.
        beta3: the decay of ``s`` and ``N`` (None: ``sqrt(b2)``).
        eps: added to the square root (times ``d``).
        estim_lr0: the first estimate of ``d`` (``> 0``).
        estim_lr_coef: a factor on the estimate.
        weight_decay: decoupled weight decay.
        safeguard_warmup: leave ``dlr`` out of ``s`` (for warmup schedules).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ProdigyState(exp_avg, exp_avg_sq,
            grad_sum, params0, estim_lr, numerator_weighted, count)``, as optax.contrib's.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a decay is not between 0 and 1, or ``estim_lr0 <= 0``; at an update, no params.

    References:
        Mishchenko and Defazio, "Prodigy: An Expeditiously Adaptive Parameter-Free Learner",
        ICML 2024 (arXiv:2306.06101). optax.contrib.prodigy.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.prodigy()
        >>> params = {"x": np.array([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> for _ in range(50):
        ...     state = nba.step_(tx, {"x": 2 * params["x"]}, state, params)
        >>> bool(state.estim_lr > 1e-6 and np.sum(params["x"] ** 2) < 14.0)
        True
    """
    return _LrFree(
        True, learning_rate, betas, eps, estim_lr0, weight_decay, beta3, estim_lr_coef, safeguard_warmup
    ).transformation()


# --- Sophia ------------------------------------------------------------------------------------


@state_class
class HutchinsonState(NamedTuple):
    """State of `hutchinson_estimator_diag_hessian` (optax.contrib's field).

    Attributes:
        key: ``[seed, step]`` as two read-only uint64: the key of the Philox generator that
            draws the next estimate's Rademacher vector; ``step`` counts the estimates made (the
            key optax splits at each estimate).
    """

    key: np.ndarray


def _philox_key(seed: int, step: int) -> np.ndarray:
    key = np.array([seed, step], np.uint64)
    key.flags.writeable = False
    return key


def _hutchinson_key(state: Any) -> tuple[int, int]:
    if not isinstance(state, HutchinsonState):
        raise wrong_state("HutchinsonState", state)
    k = np.asarray(state.key)
    if k.shape != (2,) or k.dtype != np.uint64:
        raise ValueError(f"state.key: expected 2 uint64 [seed, step], got {k.dtype} {k.shape}")
    seed, step = int(k[0]), int(k[1])
    if step == 2**64 - 1:  # the next key would repeat step 0's draws
        raise ValueError("state.key: the Rademacher stream of this seed is exhausted")
    return seed, step


def _rademacher(out: FlatTree, seed: int, step: int) -> FlatTree:
    """``out`` filled with independent signs +-1 (each with probability 1/2), group by group in
    group order, one per bit of the Philox stream keyed ``[seed, step]`` (the raw 64-bit words,
    bits taken from the least significant up: the same signs on every machine and thread count);
    drawn on the host, then copied to the device for device buffers."""
    bits = np.random.Philox(key=np.array([seed, step], np.uint64))
    for g in out.groups:
        n = int(g.shape[0])
        words = np.asarray(bits.random_raw((n + 63) // 64), dtype="<u8")
        flips = np.unpackbits(words.view(np.uint8), count=n, bitorder="little")
        signs = (np.float32(1.0) - np.float32(2.0) * flips.astype(np.float32)).astype(g.dtype)
        if out.device:  # (a device group: numba's DeviceNDArray, typed as FlatTree's ndarray)
            g.copy_to_device(signs)  # type: ignore[attr-defined]
        else:
            g[...] = signs
    return out


def _array_kind(raw: Any, device: bool) -> str:
    """The array type the user's callbacks get: the params' own ('numpy' on the host; on a GPU
    'numba', 'cupy' or 'torch' as the params are)."""
    if not device:
        return "numpy"
    if isinstance(raw, FlatTree):
        return "numba"
    leaves = tree_flatten(raw)[0]
    return arrays.kind_of(leaves[0]) if leaves else "numba"


def _copied_in(tree: Any, spec: Spec, into: FlatTree, name: str) -> FlatTree:
    """``tree`` (what a callback returned) copied into ``into``, in its dtypes: never a view of
    the callback's arrays, which it may reuse."""
    # A plain tree of NumPy arrays of the layout (a host estimate's every step): checked by the
    # layout's kept check, copied in by `host_flat`; anything else is checked and named by `as_flat`.
    checked = None if spec.device else host_check(spec.layout)(tree)
    if checked is not None:
        flat, copied, _ = host_flat(checked, spec.layout, into)
    else:
        flat, copied, _ = as_flat(tree, spec.layout, name, into, spec.device)
    if not copied:
        for d, s in zip(into.groups, flat.groups):
            if into.device:
                ops_for(s).scale_(d, s, ONE)
            else:
                np.copyto(d, s)
    return into


def _difference_step(p: FlatTree) -> float:
    """The central difference's step ``r`` along a Rademacher vector ``v`` (``||v|| =
    sqrt(n)``): ``r = eps^(1/3) max(1, ||p||) / sqrt(n)``, ``eps`` the machine epsilon of the
    params' least precise dtype. ``eps^(1/3)`` balances the difference's truncation error
    (``O(r^2)``) against its rounding error (``O(eps / r)``); the params' norm makes the step
    relative to their scale."""
    n = int(sum(p.layout.group_sizes))
    eps = max((2.0**-7 if d.kind == "V" else float(np.finfo(d).eps)) for d in p.group_dtypes)
    norm = math.sqrt(sum(float(ops_for(g).sumsq(g)) for g in p.groups))
    return eps ** (1.0 / 3.0) * max(1.0, norm) / math.sqrt(max(n, 1))


@formula(states=(), inputs=("hv", "v"), outputs=("out",), scalars=())
def hutchinson_product(hv, v):
    """Hutchinson's estimate of the Hessian's diagonal: out = (H v) * v, v of random signs."""
    return hv * v


@formula(states=(), inputs=("g_plus", "g_minus", "v"), outputs=("out",), scalars=("inv_two_r",))
def hutchinson_difference(g_plus, g_minus, v, inv_two_r):
    """Hutchinson's estimate with H v a central difference of gradients: out = ((grad(p + r v) -
    grad(p - r v)) * (1 / 2r)) * v."""
    return ((g_plus - g_minus) * inv_two_r) * v


_NO_OBJ_FN = (
    "hutchinson_estimator_diag_hessian: obj_fn cannot be differentiated without a framework. "
    "Pass hvp_fn=lambda params, v: <the Hessian of the objective at params times v> (a tree like "
    "params), or grad_fn=lambda params: <the gradient at params> (then H v is a central difference "
    "of two gradients): update(updates, state, params, hvp_fn=...)"
)


class _Hutchinson(Stage):
    """`hutchinson_estimator_diag_hessian`: random signs on the host, the user's Hessian-vector
    product (or two gradients), then one pass (`hutchinson_product` or
    `hutchinson_difference`)."""

    public_name = "hutchinson_estimator_diag_hessian"
    formulas = (hutchinson_product, hutchinson_difference)  # run by its own passes (map_)

    def __init__(self, random_seed: Any) -> None:
        self.seed = 0 if random_seed is None else integer(random_seed, "random_seed", 0, 2**64 - 1)

    def init(self, params: Any) -> HutchinsonState:
        layout_of(params, "params")  # (checks the params as every init does)
        return HutchinsonState(_philox_key(self.seed, 0))

    def declare(self, spec: Spec, state: Any) -> Host:
        """One `numbaccum.fuse.Host`: its tick makes the estimate (the user's callbacks run
        there, before any pass of the step writes anything), its run hands it on."""
        if not isinstance(state, HutchinsonState):
            raise wrong_state("HutchinsonState", state)
        layout, device = spec.layout, spec.device
        step: list = [None]  # this step's estimate

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not holds(state, HutchinsonState, ()):
                return False
            out = step[0] = self.kept("output", layout, device)
            part.new_state = self.estimate(spec, state, params, extra, out)
            return True

        def run(u: Updates) -> tuple[Updates, HutchinsonState]:
            return Updates(step[0], True, scratch=u.scratch), part.new_state

        # the user's Hessian-vector products (or gradients) and the estimate's pass: user code
        part = Host(run, None, self.public_name, tick, settles=False)
        return part

    def estimate(
        self, spec: Spec, state: Any, params: ParamsRef | None, extra: dict, out: FlatTree
    ) -> HutchinsonState:
        """Writes one estimate of the Hessian's diagonal into ``out`` (of ``spec``'s layout) and
        returns the next state; the user's callbacks come in ``extra``."""
        seed, step = _hutchinson_key(state)
        if params is None:
            raise ValueError(
                "params must be provided to hutchinson_estimator_diag_hessian's update function."
            )
        hvp_fn, grad_fn = extra.get("hvp_fn"), extra.get("grad_fn")
        if hvp_fn is None and grad_fn is None:
            if extra.get("obj_fn") is not None:
                raise ValueError(_NO_OBJ_FN)
            raise ValueError(
                "hutchinson_estimator_diag_hessian needs hvp_fn=lambda params, v: H v, or "
                "grad_fn=lambda params: <the gradient>, as update's keyword arguments"
            )
        name = "hvp_fn" if hvp_fn is not None else "grad_fn"
        fn = hvp_fn if hvp_fn is not None else grad_fn
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        layout, device = spec.layout, spec.device
        v = _rademacher(self.kept("v", layout, device), seed, step)
        raw = params.raw
        kind = _array_kind(raw, device)
        if hvp_fn is not None:
            tree = raw.tree_as(kind) if isinstance(raw, FlatTree) else raw
            # The user's callbacks: interruptible (`user_code`); they run in the tick, before any pass.
            hv = user_code(hvp_fn, tree, v.tree_as(kind))
            hv = _copied_in(hv, spec, self.kept("hv", layout, device), "hvp_fn's value")
            for o, a, s in zip(out.groups, hv.groups, v.groups):
                ops_for(o).driver.map_(hutchinson_product, ONE, (a, s, o), ())
        else:
            p = as_flat(raw, layout, "params", self.kept("params", layout, device), device)[0]
            r = _difference_step(p)
            plus, minus = self.kept("params_plus", layout, device), self.kept("params_minus", layout, device)
            for a, b, x, s in zip(plus.groups, minus.groups, p.groups, v.groups):
                ops_for(x).add_scaled_(a, x, ONE, s, r)
                ops_for(x).add_scaled_(b, x, ONE, s, -r)
            gp = _copied_in(
                user_code(fn, plus.tree_as(kind)),
                spec,
                self.kept("g_plus", layout, device),
                "grad_fn's value",
            )
            gm = _copied_in(
                user_code(fn, minus.tree_as(kind)),
                spec,
                self.kept("g_minus", layout, device),
                "grad_fn's value",
            )
            for o, a, b, s in zip(out.groups, gp.groups, gm.groups, v.groups):
                ops_for(o).driver.map_(hutchinson_difference, ONE, (a, b, s, o), (0.5 / r,))
        return HutchinsonState(_philox_key(seed, step + 1))


def hutchinson_estimator_diag_hessian(random_seed: int | None = None) -> GradientTransformationExtraArgs:
    """Estimates the diagonal of the Hessian by Hutchinson's method: ``d = v * (H v)`` with ``v``
    a vector of random signs (Rademacher), unbiased (``E[v * H v] = diag(H)``) but noisy.

    Without autodiff, ``H v`` comes from the caller: ``update(updates, state, params,
    hvp_fn=hvp)`` with ``hvp(params, v) -> H v`` (a tree like params; exact), or ``grad_fn=grad``
    with ``grad(params) -> gradient``, from which ``H v`` is the central difference ``(grad(p +
    r v) - grad(p - r v)) / 2r``, ``r = eps^(1/3) max(1, ||p||) / sqrt(n)`` (``eps`` the machine
    epsilon of the params' least precise dtype, ``n`` their size: exact for a quadratic up to
    rounding). ``hvp_fn`` wins when both are given; optax's ``obj_fn`` alone raises, saying what
    to pass instead. The callbacks get trees of the params' array type (NumPy on the host, the
    params' CUDA array type on a GPU), views valid during the call. The signs of estimate ``k``
    (from 0) are the bits of the Philox stream keyed ``[random_seed, k]``, drawn on the host:
    the same on any machine, thread count and backend (JAX's differ). The updates are not read.

    Args:
        random_seed: the seed, an int in ``[0, 2**64)``; None: 0 (optax: ``PRNGKey(0)``).

    Returns:
        A `GradientTransformationExtraArgs` whose ``update`` returns the estimate; its state is
            ``HutchinsonState(key)``.

    Raises:
        TypeError: ``random_seed`` is not an int; at an update, ``hvp_fn`` or ``grad_fn`` is not
            callable or returns a tree unlike params.
        ValueError: ``random_seed`` is out of range; at an update, no params, or neither
            ``hvp_fn`` nor ``grad_fn`` (``obj_fn`` alone: the message says what to pass).

    References:
        Hutchinson, "A stochastic estimator of the trace of the influence matrix for Laplacian
        smoothing splines", 1989; Liu et al., "Sophia", 2023 (arXiv:2305.14342).
        optax.contrib.hutchinson_estimator_diag_hessian.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> A = np.array([[2.0, 0.5], [0.5, 3.0]])  # the Hessian of 0.5 x^T A x
        >>> tx = nba.hutchinson_estimator_diag_hessian(random_seed=0)
        >>> params = {"x": np.zeros(2)}
        >>> state = tx.init(params)
        >>> d, state = tx.update(params, state, params, hvp_fn=lambda p, v: {"x": A @ v["x"]})
        >>> sorted(abs(d["x"] - np.diag(A)))  # diag(A) +- the off-diagonal term
        [np.float64(0.5), np.float64(0.5)]
        >>> total = np.zeros(2)
        >>> for _ in range(400):  # grad_fn: H v from two gradients (exact for a quadratic)
        ...     d, state = tx.update(params, state, params, grad_fn=lambda p: {"x": A @ p["x"]})
        ...     total += d["x"]
        >>> np.round(total / 400, 1)  # the mean converges to diag(A)
        array([2., 3.])
    """
    return _Hutchinson(random_seed).transformation()


@state_class
class SophiaState(NamedTuple):
    """State of `scale_by_sophia` (optax.contrib's fields).

    Attributes:
        count: the number of updates so far (int32, saturating).
        mu: the EMA of the gradients, a FlatTree of the params' layout (``mu_dtype``).
        nu: the EMA of the Hessian diagonal's estimates (the params' dtypes).
        hessian_fn_state: the state of ``hessian_diagonal_fn``.
    """

    count: np.int32  # type: ignore[assignment]
    mu: FlatTree
    nu: FlatTree
    hessian_fn_state: Any


@formula(
    states=("mu", "nu"),
    inputs=("g", "h"),
    outputs=("out",),
    scalars=(
        "b1",
        "one_minus_b1",
        "b2",
        "one_minus_b2",
        "bc1",
        "gamma",
        "eps",
        "clip_threshold",
        "clipping",
        "hessian_step",
    ),
)
def sophia_direction(
    mu, nu, g, h, b1, one_minus_b1, b2, one_minus_b2, bc1, gamma, eps, clip_threshold, clipping, hessian_step
):
    """Sophia: mu = (1 - b1) g + b1 mu; out = (mu / bc1) / max(gamma nu, eps) with the *previous*
    nu, clipped to [-c, c]; on a Hessian step nu = (1 - b2) h + b2 nu (h the estimate), else nu
    is kept (h not read)."""
    m = one_minus_b1 * g + b1 * mu
    u = (m / bc1) / maximum(gamma * nu, eps)
    if clipping:
        u = minimum(maximum(u, -clip_threshold), clip_threshold)
    v = one_minus_b2 * h + b2 * nu if hessian_step else nu
    return m, v, u


class _ScaleBySophia(Elementwise):
    state_cls, fields, formula, name = SophiaState, ("mu", "nu"), sophia_direction, "scale_by_sophia"
    counted = True
    dtype_options = {"mu": "mu_dtype"}
    other_starts = {"hessian_fn_state": None}  # made by init

    def __init__(
        self,
        b1: Any,
        b2: Any,
        eps: Any,
        gamma: Any,
        clip_threshold: Any,
        update_interval: Any,
        hessian_diagonal_fn: Any,
        mu_dtype: Any,
        verbose: Any,
        print_win_rate_every_n_steps: Any,
    ) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.gamma = real(eps, "eps"), real(gamma, "gamma")
        self.clip = None if clip_threshold is None else real(clip_threshold, "clip_threshold")
        self.update_interval = integer(update_interval, "update_interval", 1)
        given = transformation(hessian_diagonal_fn, "hessian_diagonal_fn")
        tx = with_extra_args_support(given)
        found = stage_of(tx)
        self.hessian = tx
        self.hutchinson = found if isinstance(found, _Hutchinson) else None  # called directly
        self.user_estimator = found is None  # the user's: interruptible, as a callback
        # A plain GradientTransformation of the user's: its own update, called without the extra
        # args, as the wrapper `with_extra_args_support` made for it calls it.
        self.plain_update = given.update if found is None and tx is not given else None
        self.mu_dtype = _mu_dtype(mu_dtype)
        self.verbose = flag(verbose, "verbose")
        self.every = integer(print_win_rate_every_n_steps, "print_win_rate_every_n_steps")

    def init(self, params: Any) -> SophiaState:
        state = super().init(params)
        return state._replace(hessian_fn_state=self.hessian.init(params))

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        bc1 = bias_correction(self.b1, int(count), ct)
        clipping = self.clip is not None
        clip = self.clip if clipping else 0.0
        # The last one, whether this step updates nu, is set by the tick (from the old count).
        return (
            self.b1,
            1.0 - self.b1,
            self.b2,
            1.0 - self.b2,
            bc1,
            self.gamma,
            self.eps,
            clip,
            clipping,
            False,
        )

    def _estimate(self, spec: Spec, hstate: Any, params: ParamsRef, extra: dict, into: FlatTree) -> Any:
        """One estimate of the Hessian's diagonal into ``into``; the estimator's new state. Called
        by the tick: before any pass, so a raising callback leaves everything as it was, and with
        ``updates=None`` (a step is planned before its passes run: the updates Sophia will read
        do not exist yet)."""
        if self.hutchinson is not None:
            return self.hutchinson.estimate(spec, hstate, params, extra, into)
        raw = params.raw
        update = self.hessian.update
        if self.plain_update is not None:
            out, new = user_code(self.plain_update, None, hstate, raw)
        elif self.user_estimator:
            out, new = user_code(update, None, hstate, raw, **extra)
        else:
            out, new = update(None, hstate, raw, **extra)
        _copied_in(out, spec, into, "hessian_diagonal_fn's value")
        return new

    def declare(self, spec: Spec, state: Any) -> Any:
        if not isinstance(state, SophiaState):
            raise wrong_state("SophiaState", state)
        part = super().declare(spec, state)
        # The estimate's buffer of this plan (the leaves' dtypes, as optax's estimate), written
        # on the Hessian steps only; the pass reads it then.
        h = FlatTree.zeros(spec.layout, None, spec.device)
        mu, nu = part.states
        ticked, interval, estimate = part.tick, self.update_interval, self._estimate
        assert ticked is not None  # (set by `Elementwise.declare`)
        report = self.verbose and self.clip is not None and self.every > 0
        plain = lambda: (h,)  # noqa: E731

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not ticked(state, params, extra):
                return False
            if params is None:
                raise ValueError("params must be provided to sophia's update function.")
            hessian_step = int(state.count) % interval == 0  # optax: the count before this step
            if hessian_step:
                new = estimate(spec, state.hessian_fn_state, params, extra, h)
                part.new_state = part.new_state._replace(hessian_fn_state=new)
            scalars = part.scalars  # (the tick's new list: each group's, its last set here)
            for i in range(len(scalars)):
                scalars[i] = (*scalars[i][:-1], hessian_step)
            part.inputs = plain
            if report and int(part.new_state.count) % self.every == 0:
                self._report(part, mu, nu, h)
            return True

        part.inputs, part.tick = plain, tick
        return part

    def _report(self, part: Any, mu: FlatTree, nu: FlatTree, h: FlatTree) -> None:
        """optax's ``verbose``: prints the share of this step's updates that were not clipped,
        once the pass ran (`Later`), from mu and a copy of nu taken before the pass."""
        before = nu.workspace("win_rate")
        done, scalars, clip = part.new_state, part.scalars, self.clip

        def inputs() -> tuple:
            for d, s in zip(before.groups, nu.groups):
                (ops_for(s).scale_(d, s, ONE) if nu.device else np.copyto(d, s))
            return (h,)

        def make() -> Any:
            kept, total = 0, 0
            for gi, (m, v) in enumerate(zip(mu.groups, before.groups)):
                ct = compute_dtype(m.dtype, v.dtype)
                m, v = (
                    # (device groups: numba's DeviceNDArray, typed as FlatTree's ndarray)
                    np.asarray(x.copy_to_host() if mu.device else x).astype(ct)  # type: ignore[attr-defined]
                    for x in (m, v)
                )
                t = ct.type
                _, _, _, _, bc1, gamma, eps, *_ = scalars[gi]
                with np.errstate(all="ignore"):
                    u = (m / t(bc1)) / np.maximum(t(gamma) * v, t(eps))
                kept += int(np.count_nonzero(np.abs(u) < t(clip)))
                total += u.size
            print(f"Sophia optimizer win rate: {kept / total if total else float('nan')}")
            return done

        part.inputs, part.new_state = inputs, Later(make)


def scale_by_sophia(
    b1: float = 0.965,
    b2: float = 0.99,
    eps: float = 1e-8,
    gamma: float = 0.01,
    clip_threshold: float | None = 1.0,
    update_interval: int = 10,
    # optax's default, written as optax writes it so that the signature shows it: one estimator
    # per function, shared by its calls (a stage never changes; its buffers are per thread)
    hessian_diagonal_fn: Any = hutchinson_estimator_diag_hessian(),  # noqa: B008
    mu_dtype: Any = None,
    verbose: bool = False,
    print_win_rate_every_n_steps: int = 0,
) -> GradientTransformationExtraArgs:
    """Rescales the updates by Sophia: momentum over a clipped, EMA'd Hessian diagonal.

    ``mu = (1 - b1) g + b1 mu``, ``u = clip((mu / (1 - b1^t)) / max(gamma nu, eps), -c, c)``
    (``c = clip_threshold``; None: no clip) with the ``nu`` of the steps before; then, when
    ``count % update_interval == 0`` (the count before this step, so the first step is one),
    ``nu = (1 - b2) h + b2 nu`` with ``h = hessian_diagonal_fn``'s estimate. The estimator runs
    on the host before the pass, only on those steps, and its extra arguments come through
    ``update``: the default (`hutchinson_estimator_diag_hessian`) needs ``hvp_fn=`` or
    ``grad_fn=`` (see it); optax's ``obj_fn`` cannot be differentiated here. The moments and
    the update are one fused pass (with the learning rate and weight decay in `sophia`). Needs
    params. ``explain`` plans a step, so it takes the estimator's arguments too
    (``explain(tx, params, hvp_fn=hvp)``: a fresh state's first step estimates).

    Args:
        b1: decay of the first moment, between 0 and 1.
        b2: decay of the Hessian diagonal's EMA, between 0 and 1 (per Hessian step: the
            effective decay per step is ``1 - (1 - b2) / update_interval``).
        eps: the floor of ``gamma nu``.
        gamma: the Hessian diagonal's scale.
        clip_threshold: the bound of the updates (None: no clipping).
        update_interval: steps between Hessian estimates (``>= 1``).
        hessian_diagonal_fn: the estimator, a transformation called as ``update(None, state,
            params, **extra_args)`` (the updates are not passed: see above) returning a tree like
            params; its state is ``hessian_fn_state``.
        mu_dtype: storage dtype of ``mu`` (None: each leaf's).
        verbose: print the win rate (the share of updates not clipped) every
            ``print_win_rate_every_n_steps`` steps (with a clip threshold).
        print_win_rate_every_n_steps: see ``verbose`` (0: never). The authors advise 0.1-0.5;
            too low, try a larger ``gamma``.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``SophiaState(count, mu, nu,
            hessian_fn_state)``, as optax.contrib's.

    Raises:
        TypeError: a hyperparameter has the wrong type, or ``hessian_diagonal_fn`` is not a
            transformation; at an update, what the estimator raises (before anything is written).
        ValueError: ``b1`` or ``b2`` is not between 0 and 1, ``update_interval < 1``; at an
            update, no params, or the estimator's arguments are missing.

    References:
        Liu et al., "Sophia: A Scalable Stochastic Second-order Optimizer for Language Model
        Pre-training", 2023 (arXiv:2305.14342). optax.contrib.scale_by_sophia.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> a = np.array([1.0, 4.0])  # the Hessian of 0.5 sum(a x^2), diagonal
        >>> hvp = lambda p, v: {"x": a * v["x"]}
        >>> tx = nba.scale_by_sophia(b2=0.0, gamma=1.0, update_interval=1)
        >>> params = {"x": np.array([0.5, 0.25])}
        >>> g = {"x": a * params["x"]}
        >>> state = tx.init(params)
        >>> u, state = tx.update(g, state, params, hvp_fn=hvp)
        >>> u["x"]  # nu is still 0: clip(mu / eps) = sign(g)
        array([1., 1.])
        >>> u, state = tx.update(g, state, params, hvp_fn=hvp)
        >>> [round(float(x), 6) for x in u["x"]]  # mu / nu: Newton's step g / a
        [0.5, 0.25]
    """
    return _ScaleBySophia(
        b1,
        b2,
        eps,
        gamma,
        clip_threshold,
        update_interval,
        hessian_diagonal_fn,
        mu_dtype,
        verbose,
        print_win_rate_every_n_steps,
    ).transformation()


def sophia(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.965,
    b2: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    weight_decay_mask: Any = None,
    gamma: float = 0.01,
    clip_threshold: float | None = 1.0,
    update_interval: int = 10,
    # optax's default, written as optax writes it so that the signature shows it: one estimator
    # per function, shared by its calls (a stage never changes; its buffers are per thread)
    hessian_diagonal_fn: Any = hutchinson_estimator_diag_hessian(),  # noqa: B008
    mu_dtype: Any = None,
    verbose: bool = False,
    print_win_rate_every_n_steps: int = 0,
) -> GradientTransformationExtraArgs:
    """Sophia with decoupled weight decay: ``chain(scale_by_sophia(...),
    add_decayed_weights(weight_decay, weight_decay_mask), scale_by_learning_rate(learning_rate))``,
    one fused pass (after the Hessian estimate, every ``update_interval`` steps).

    ``u = -lr (clip((mu / (1 - b1^t)) / max(gamma nu, eps), -c, c) + wd p)``; see
    `scale_by_sophia`. Pass the estimator's arguments to ``update`` (or `step_`): with the
    default estimator, ``hvp_fn=lambda params, v: H v`` or ``grad_fn=lambda params: grad``.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_sophia`.
        b2: as in `scale_by_sophia`.
        eps: as in `scale_by_sophia`.
        weight_decay: the decay rate.
        weight_decay_mask: which leaves decay (as `add_decayed_weights`' ``mask``).
        gamma: as in `scale_by_sophia`.
        clip_threshold: as in `scale_by_sophia`.
        update_interval: as in `scale_by_sophia`.
        hessian_diagonal_fn: as in `scale_by_sophia`.
        mu_dtype: as in `scale_by_sophia`.
        verbose: as in `scale_by_sophia`.
        print_win_rate_every_n_steps: as in `scale_by_sophia`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(SophiaState(...), EmptyState(),
            EmptyState())`` (``MaskedState`` for a masked decay, ``ScaleByScheduleState`` last
            with a schedule).

    Raises:
        TypeError: a hyperparameter has the wrong type.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1, ``update_interval < 1``; at an
            update, as `scale_by_sophia`.

    References:
        Liu et al., "Sophia: A Scalable Stochastic Second-order Optimizer for Language Model
        Pre-training", 2023 (arXiv:2305.14342). optax.contrib.sophia.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> a = np.array([1.0, 100.0])  # 0.5 sum(a x^2): badly conditioned
        >>> params = {"x": np.array([1.0, 1.0])}
        >>> tx = nba.sophia(0.5, b1=0.5, b2=0.5, gamma=1.0, update_interval=1, weight_decay=0.0)
        >>> state = tx.init(params)
        >>> for _ in range(40):
        ...     g = {"x": a * params["x"]}
        ...     state = nba.step_(tx, g, state, params, hvp_fn=lambda p, v: {"x": a * v["x"]})
        >>> [round(float(x), 4) for x in params["x"]]  # both directions at the same pace
        [0.0, 0.0]
    """
    return chain(
        scale_by_sophia(
            b1,
            b2,
            eps,
            gamma,
            clip_threshold,
            update_interval,
            hessian_diagonal_fn,
            mu_dtype,
            verbose,
            print_win_rate_every_n_steps,
        ),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(learning_rate),
    )
