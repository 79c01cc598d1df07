"""optax's optimizers: SGD, sign-SGD, Adam and the rest of its library. Each direction is one
formula (`numbaccum.formulas`, or beside its declaration here), each optimizer optax's chain of it
with weight decay (`numbaccum.scaling`) and the learning rate.

A direction is a `_Direction` stage: its state holds its moments as FlatTrees (plus the step
count where the formula needs bias corrections), and its update is one kernel per dtype group
that reads the updates and the moments once and writes the moments and the direction once. In a
chain, the learning rate and weight decay fuse into that kernel (`numbaccum.fuse`), so
``adamw(1e-3)`` is one pass, and `numbaccum.step_` adds it to the params in the same pass.

Names, arguments, defaults, state classes and their fields are optax's, and so is the order of
the floating-point operations (the formulas' docstrings give them).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import formulas as F
from ._checks import flag, non_negative, real
from .accumulation import ema, trace
from .backend import Reductions, leaf_sumsq, leaf_tables, ops_for, prepare_divide
from .base import Stage, chain
from .clipping import leaf_reductions, scale_by_polyak
from .contract import ONE, Ops
from .declared import Elementwise, bias_correction, check_decay, expect_state, holds, safe_increment
from .flat import FlatTree, as_flat, layout_and_device
from .formulas import abs_sq, formula, inv_root, maximum, quot, re, sqrt, tanh
from .formulas import signum as sign_of  # (``signum`` is the public optimizer below)
from .fuse import FusedRun, Host, Launches
from .layout import check_float_dtype, compute_dtype, real_dtype
from .masking import masked
from .norms import scale_by_trust_ratio
from .protocol import GradientTransformationExtraArgs, state_class
from .scaling import ScalarOrSchedule, add_decayed_weights, identity, scale, scale_by_learning_rate
from .traits import LEAF
from .transaction import current
from .tree import tree_flatten, tree_unflatten
from .updates import ParamsRef, Spec, Updates

__all__ = [
    "ScaleByAdaDeltaState",
    "ScaleByAdamState",
    "ScaleByAdanState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByDistanceOverGradientsState",
    "ScaleByLionState",
    "ScaleByNovogradState",
    "ScaleByOptimisticGradientState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByRpropState",
    "ScaleByRssState",
    "adabelief",
    "adagrad",
    "adam",
    "adadelta",
    "adamax",
    "adamaxw",
    "adamw",
    "adan",
    "amsgrad",
    "fromage",
    "lamb",
    "lars",
    "lion",
    "nadam",
    "nadamw",
    "novograd",
    "optimistic_adam",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "polyak_sgd",
    "radam",
    "rmsprop",
    "rprop",
    "scale_by_adadelta",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_adan",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_distance_over_gradients",
    "scale_by_lion",
    "scale_by_nadam",
    "scale_by_novograd",
    "scale_by_optimistic_gradient",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rprop",
    "scale_by_rss",
    "scale_by_sign",
    "scale_by_stddev",
    "scale_by_yogi",
    "sgd",
    "sign_sgd",
    "signum",
    "yogi",
]


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """Stochastic gradient descent, with optional (Nesterov) momentum:
    ``trace = g + momentum * trace``, ``u = -lr * trace`` (``-lr * (g + momentum * trace)``
    with ``nesterov``; ``u = -lr * g`` without momentum).

    It is ``chain(trace(momentum, nesterov, accumulator_dtype), scale_by_learning_rate(
    learning_rate))`` (no trace when ``momentum`` is None), one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        momentum: the trace's decay, in [0, 1]; None: plain SGD (no state buffer).
        nesterov: Nesterov's momentum.
        accumulator_dtype: storage dtype of the trace; None keeps each leaf's dtype.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(TraceState(trace), EmptyState())``
            (``EmptyState()`` first without momentum).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, ``momentum`` is
            not a real number, or (with ``momentum``) ``nesterov`` is not a bool or
            ``accumulator_dtype`` is not a float dtype.
        ValueError: ``momentum`` is not between 0 and 1.

    References:
        Polyak, "Some methods of speeding up the convergence of iteration methods", 1964;
        Sutskever et al., "On the importance of initialization and momentum in deep learning",
        ICML 2013. optax.sgd; torch.optim.SGD (the same trace, without dampening).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.sgd(0.1, momentum=0.9)
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     state = nba.step_(tx, {"w": np.ones(2)}, state, params)
        >>> params["w"]  # -0.1 * 1, then -0.1 * (1 + 0.9)
        array([-0.29, -0.29])
    """
    if momentum is not None:
        check_decay(momentum, "momentum")  # named as the caller knows it (trace calls it decay)
    first = trace(momentum, nesterov, accumulator_dtype) if momentum is not None else identity()
    return chain(first, scale_by_learning_rate(learning_rate))


class _ScaleBySign(Elementwise):
    """``u = sign(g)`` per element (`numbaccum.formulas.sign`); stateless."""

    complex_leaves = True  # optax defines it on complex leaves

    formula, name = F.sign, "scale_by_sign"

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return ()


def scale_by_sign() -> GradientTransformationExtraArgs:
    """Replaces each element of the updates by its sign.

    ``u = sign(g)``: 1 where ``g > 0``, -1 where ``g < 0``, and ``g`` itself where it is +-0 or
    NaN (as ``jnp.sign``). Stateless; the direction of `sign_sgd`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``. Updates keep each
            leaf's dtype.

    References:
        Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018
        (arXiv:1802.04434). optax.scale_by_sign.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_sign()
        >>> g = {"w": np.array([0.5, -2.0, 0.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [float(x) for x in u["w"]]
        [1.0, -1.0, 0.0]
    """
    return _ScaleBySign().transformation()


def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformationExtraArgs:
    """signSGD: gradient descent on the signs of the gradients.

    ``u = -lr sign(g)`` (``sign`` as in `scale_by_sign`: +-0 and NaN stay as they are).

    It is ``chain(scale_by_sign(), scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(EmptyState(), EmptyState())``
            (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable.

    References:
        Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018
        (arXiv:1802.04434); Balles et al., "The Geometry of Sign Gradient Descent", 2020
        (arXiv:2002.08056). optax.sign_sgd; no torch.optim counterpart.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(3, np.float32)}
        >>> tx = nba.sign_sgd(0.1)
        >>> grads = {"w": np.array([0.5, -2.0, 0.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * sign(g)
        [0.9, 1.1, 1.0]
    """
    return chain(scale_by_sign(), scale_by_learning_rate(learning_rate))


@state_class
class ScaleByAdamState(NamedTuple):
    """Adam's step count and first and second moments (also NAdam's, Adamax's and Yogi's state).

    Attributes:
        count: the number of updates so far, an int32 scalar saturating at the int32 maximum
            (the ``t`` of the bias corrections).
        mu: the first moment, the exponential moving average of the gradients: a FlatTree of
            the params' layout, in ``mu_dtype`` or each leaf's dtype.
        nu: the second moment, the exponential moving average of the squared gradients, a
            FlatTree in each leaf's dtype (Adamax: the infinity norm ``max(|g| + eps, b2 nu)``;
            Yogi: its additive estimate).
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: FlatTree
    nu: FlatTree


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "b2", "one_minus_b2", "bc1", "bc2", "eps", "eps_root"),
)
def adam_direction(mu, nu, g, b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root):
    """mu = (1 - b1) g + b1 mu; nu = (1 - b2) g^2 + b2 nu;
    out = (mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps)."""
    m = one_minus_b1 * g + b1 * mu
    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)
    return m, v, quot(quot(m, bc1), math.sqrt(v / bc2 + eps_root) + eps)


class _ScaleByAdam(Elementwise):
    """`scale_by_adam`, declared: Adam's moments and direction in one formula."""

    complex_leaves = True  # optax defines it on complex leaves

    formula, state_cls, fields, counted, name = (
        adam_direction,
        ScaleByAdamState,
        ("mu", "nu"),
        True,
        "scale_by_adam",
    )
    dtype_options = {"mu": "mu_dtype"}

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
    """Rescales the updates by Adam's bias-corrected moments: `adam` without the learning rate.

    ``mu = (1 - b1) g + b1 mu``, ``nu = (1 - b2) g^2 + b2 nu``,
    ``u = (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``, as optax computes it,
    with ``t`` the new step count (1 at the first update) and the bias corrections computed in
    the leaves' compute dtype (float32 for float32 leaves, like optax); one fused pass.

    Args:
        b1: decay rate of the first moment, between 0 and 1.
        b2: decay rate of the second moment, between 0 and 1.
        eps: added outside the square root.
        eps_root: added inside the square root.
        mu_dtype: storage dtype of ``mu`` (float16, bfloat16, float32 or float64); None keeps each leaf's
            dtype.
        nesterov: NAdam's direction instead (`scale_by_nadam`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAdamState(count, mu, nu)``.
            Updates keep each leaf's dtype.

    Raises:
        TypeError: ``b1``, ``b2``, ``eps`` or ``eps_root`` is not a real number, ``mu_dtype`` is
            not a float dtype, or ``nesterov`` is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015
        (arXiv:1412.6980). optax.scale_by_adam; the direction of torch.optim.Adam.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_adam()
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]], int(state.count)  # sign(g) at the first step
        ([1.0, -1.0], 1)
        >>> u, state = tx.update({"w": np.array([0.1, -1.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]
        [0.803, -0.9322]
    """
    if flag(nesterov, "nesterov"):
        return scale_by_nadam(b1, b2, eps, eps_root, mu_dtype)
    return _ScaleByAdam(b1, b2, eps, eps_root, mu_dtype).transformation()


class _Direction(Elementwise):
    """optax's ``scale_by_*`` directions with moments: declarations that count steps (for their
    bias corrections) unless they say otherwise."""

    complex_leaves = True  # optax defines it on complex leaves

    counted = True


def _mu_dtype(mu_dtype: Any) -> np.dtype | None:
    return None if mu_dtype is None else check_float_dtype(mu_dtype, "mu_dtype", complex=True)


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "b2", "one_minus_b2", "bc1", "bc1_next", "bc2", "eps", "eps_root"),
)
def nadam_direction(mu, nu, g, b1, one_minus_b1, b2, one_minus_b2, bc1, bc1_next, bc2, eps, eps_root):
    """Adam with Nesterov momentum (optax's ``scale_by_adam(nesterov=True)``): the moments as
    Adam's; ``mu_hat = b1 (mu / (1 - b1^(t+1))) + (1 - b1) (g / (1 - b1^t))``;
    out = mu_hat / (sqrt(nu / bc2 + eps_root) + eps)."""
    m = one_minus_b1 * g + b1 * mu
    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)
    m_hat = b1 * quot(m, bc1_next) + one_minus_b1 * quot(g, bc1)
    return m, v, quot(m_hat, math.sqrt(v / bc2 + eps_root) + eps)


class _ScaleByNadam(_Direction):
    state_cls, fields, formula, name = (
        ScaleByAdamState,
        ("mu", "nu"),
        nadam_direction,
        "scale_by_adam(nesterov)",
    )
    dtype_options = {"mu": "mu_dtype"}

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
    """Rescales the updates by NAdam's moments: ``scale_by_adam(..., nesterov=True)``.

    Adam's moments ``mu = (1 - b1) g + b1 mu``, ``nu = (1 - b2) g^2 + b2 nu``; the first one
    bias-corrected with Nesterov's look-ahead,
    ``mu_hat = b1 (mu / (1 - b1^(t+1))) + (1 - b1) (g / (1 - b1^t))``;
    ``u = mu_hat / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``, with ``t`` the new step count;
    one fused pass.

    Args:
        b1: decay rate of the first moment, between 0 and 1.
        b2: decay rate of the second moment, between 0 and 1.
        eps: added outside the square root.
        eps_root: added inside the square root.
        mu_dtype: storage dtype of ``mu`` (float16, bfloat16, float32 or float64); None keeps each leaf's
            dtype.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAdamState(count, mu, nu)``,
            as in optax. Updates keep each leaf's dtype.

    Raises:
        TypeError: ``b1``, ``b2``, ``eps`` or ``eps_root`` is not a real number, or ``mu_dtype``
            is not a float dtype.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Dozat, "Incorporating Nesterov Momentum into Adam", ICLR 2016 workshop track.
        optax.scale_by_adam with ``nesterov=True``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_nadam()
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # (0.9 * 0.1 / 0.19 + 1) * sign(g) at t = 1
        [1.4737, -1.4737]
    """
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
    """Adam, as optax computes it:

    ``mu = b1 mu + (1 - b1) g``, ``nu = b2 nu + (1 - b2) g^2``,
    ``u = -lr (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``.

    It is ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
    scale_by_learning_rate(learning_rate))``, declared like any other chain: fused, the ``-lr``
    step is applied inside the Adam pass (``u = direction * -lr`` rounds exactly as a separate
    scaling pass would); with ``NUMBACCUM_FUSE=0`` it is the chain's two passes.

    Args:
        learning_rate: a float, or a schedule of the step count (``fn(count) -> float``).
        b1: decay rate of the first moment, in [0, 1].
        b2: decay rate of the second moment, in [0, 1].
        eps: added to the denominator outside the square root.
        eps_root: added to the denominator inside the square root.
        mu_dtype: storage dtype of the first moment (``mu``); None keeps each leaf's dtype.
        nesterov: NAdam's direction instead (`nadam`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            EmptyState())`` (or ``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, ``b1``, ``b2``,
            ``eps`` or ``eps_root`` is not a real number, ``mu_dtype`` is not a float dtype, or
            ``nesterov`` is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015
        (arXiv:1412.6980). optax.adam; torch.optim.Adam.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(3, np.float32)}
        >>> tx = nba.adam(0.1)
        >>> state = tx.init(params)
        >>> state = nba.step_(tx, {"w": np.array([1.0, -2.0, 0.0], np.float32)}, state, params)
        >>> params["w"].round(4)  # each moved by lr against its gradient's sign (eps aside)
        array([0.9, 1.1, 1. ], dtype=float32)
    """
    direction = scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)
    return chain(direction, scale_by_learning_rate(learning_rate))


@state_class
class ScaleByAmsgradState(NamedTuple):
    """AMSGrad's step count, moments and running maximum of the corrected second moment.

    Attributes:
        count: the number of updates so far, an int32 scalar saturating at the int32 maximum
            (the ``t`` of the bias corrections).
        mu: the first moment, the exponential moving average of the gradients: a FlatTree of
            the params' layout, in ``mu_dtype`` or each leaf's dtype.
        nu: the second moment, the exponential moving average of the squared gradients (not
            bias-corrected), a FlatTree in each leaf's dtype.
        nu_max: the running elementwise maximum of the bias-corrected second moment
            ``nu / (1 - b2^t)`` (of ``nu`` itself with ``bias_correction_nu=False``), which the
            updates divide by; a FlatTree in each leaf's dtype.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: FlatTree
    nu: FlatTree
    nu_max: FlatTree


@state_class
class ScaleByBeliefState(NamedTuple):
    """AdaBelief's step count, first moment and second central moment.

    Attributes:
        count: the number of updates so far, an int32 scalar saturating at the int32 maximum
            (the ``t`` of the bias corrections).
        mu: the first moment, the exponential moving average of the gradients: a FlatTree of
            the params' layout, in each leaf's dtype.
        nu: the second central moment, the exponential moving average of the squared prediction
            error ``(g - mu)^2`` plus ``eps_root`` at each step, a FlatTree in each leaf's dtype.
    """

    count: np.int32  # type: ignore[assignment]
    mu: FlatTree
    nu: FlatTree


@state_class
class ScaleByLionState(NamedTuple):
    """Lion's step count and momentum.

    Attributes:
        count: the number of updates so far, an int32 scalar saturating at the int32 maximum
            (Lion's formula does not read it; optax's state has it).
        mu: the momentum, the exponential moving average of the gradients with decay ``b2``: a
            FlatTree of the params' layout, in ``mu_dtype`` or each leaf's dtype.
    """

    count: np.int32  # type: ignore[assignment]
    mu: FlatTree


@state_class
class ScaleByRmsState(NamedTuple):
    """RMSProp's second moment (without bias correction).

    Attributes:
        nu: the exponential moving average of the squared gradients, starting at
            ``initial_scale``: a FlatTree of the params' layout, in each leaf's dtype.
    """

    nu: FlatTree


@state_class
class ScaleByRmsWithCountState(NamedTuple):
    """RMSProp's step count and second moment (with bias correction).

    Attributes:
        count: the number of updates so far, an int32 scalar saturating at the int32 maximum
            (the ``t`` of the bias correction).
        nu: the exponential moving average of the squared gradients (not bias-corrected),
            starting at ``initial_scale``: a FlatTree of the params' layout, in each leaf's
            dtype.
    """

    count: np.int32  # type: ignore[assignment]
    nu: FlatTree


@state_class
class ScaleByRStdDevState(NamedTuple):
    """Centred RMSProp's first and second moments (without bias correction).

    Attributes:
        mu: the exponential moving average of the gradients, starting at 0: a FlatTree of the
            params' layout, in each leaf's dtype.
        nu: the exponential moving average of the squared gradients, starting at
            ``initial_scale``: a FlatTree in each leaf's dtype.
    """

    mu: FlatTree
    nu: FlatTree


@state_class
class ScaleByRStdDevWithCountState(NamedTuple):
    """Centred RMSProp's step count and moments (with bias correction).

    Attributes:
        count: the number of updates so far, an int32 scalar saturating at the int32 maximum
            (the ``t`` of the bias corrections).
        mu: the exponential moving average of the gradients (not bias-corrected), starting at
            0: a FlatTree of the params' layout, in each leaf's dtype.
        nu: the exponential moving average of the squared gradients (not bias-corrected),
            starting at ``initial_scale``: a FlatTree in each leaf's dtype.
    """

    count: np.int32  # type: ignore[assignment]
    mu: FlatTree
    nu: FlatTree


@state_class
class ScaleByRssState(NamedTuple):
    """Adagrad's sum of squared gradients.

    Attributes:
        sum_of_squares: the sum of the squared gradients so far, starting at
            ``initial_accumulator_value``: a FlatTree of the params' layout, in each leaf's dtype.
    """

    sum_of_squares: FlatTree


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """AdamW, Adam with decoupled weight decay:
    ``u = -lr (adam_direction(g) + weight_decay * params)`` (`adam` gives the direction).

    It is ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``, one
    fused pass (the mask too). ``weight_decay`` multiplies the learning rate, as in optax and
    PyTorch. Needs ``params``.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `adam`.
        b2: as in `adam`.
        eps: as in `adam`.
        eps_root: as in `adam`.
        mu_dtype: as in `adam`.
        nesterov: as in `adam`.
        weight_decay: the decay rate (a float or a schedule).
        mask: None (decay every leaf), or a tree of bools of the params' structure (or a prefix
            of it), or a callable of the params giving one: only the leaves where it is True
            are decayed (the usual way to keep biases and norm scales out).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState, EmptyState(),
            EmptyState())`` (``MaskedState(EmptyState())`` in the middle with a mask).

    Raises:
        TypeError: ``learning_rate`` or ``weight_decay`` is neither a real number nor a
            callable, ``b1``, ``b2``, ``eps`` or ``eps_root`` is not a real number, ``mu_dtype``
            is not a float dtype, or ``nesterov`` is not a bool; at ``init``, a mask leaf that
            is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1; at ``init``, a mask whose
            structure is not the params' (or a prefix of it); ``update`` without ``params``.

    References:
        Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019
        (arXiv:1711.05101). optax.adamw; torch.optim.AdamW.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
        >>> tx = nba.adamw(0.1, weight_decay=0.5, mask={"w": True, "b": False})
        >>> grads = {"w": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> params["w"], params["b"]  # only w decays: 1 - 0.1 * 0.5 * 1
        (array([0.95, 0.95], dtype=float32), array([1., 1.], dtype=float32))
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def nadam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
) -> GradientTransformationExtraArgs:
    """NAdam: Adam with Nesterov momentum, optax's ``adam(..., nesterov=True)``.

    ``mu = (1 - b1) g + b1 mu``, ``nu = (1 - b2) g^2 + b2 nu``,
    ``mu_hat = b1 (mu / (1 - b1^(t+1))) + (1 - b1) (g / (1 - b1^t))``,
    ``u = -lr mu_hat / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``.

    It is ``adam(..., nesterov=nesterov)``: ``chain(scale_by_nadam(b1, b2, eps, eps_root,
    mu_dtype), scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `adam`.
        b2: as in `adam`.
        eps: as in `adam`.
        eps_root: as in `adam`.
        mu_dtype: as in `adam`.
        nesterov: as in `adam`; True by default (optax's ``nadam`` is ``adam`` with this
            default, so ``nesterov=False`` gives `adam`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            EmptyState())`` (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, ``b1``, ``b2``,
            ``eps`` or ``eps_root`` is not a real number, ``mu_dtype`` is not a float dtype, or
            ``nesterov`` is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Dozat, "Incorporating Nesterov Momentum into Adam", ICLR 2016 workshop track.
        optax.nadam; torch.optim.NAdam (with its own momentum-decay schedule: other steps).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.nadam(0.1)
        >>> grads = {"w": np.array([0.5, -2.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * 1.4737 * sign(g)
        [0.8526, 1.1474]
    """
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)


def nadamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = True,
) -> GradientTransformationExtraArgs:
    """NAdamW: NAdam with decoupled weight decay, optax's ``adamw(..., nesterov=True)``.

    ``u = -lr (mu_hat / (sqrt(nu / (1 - b2^t) + eps_root) + eps) + weight_decay * params)``,
    with Adam's moments and NAdam's ``mu_hat`` (`nadam` gives them).

    It is ``chain(scale_by_nadam(b1, b2, eps, eps_root, mu_dtype), add_decayed_weights(
    weight_decay, mask), scale_by_learning_rate(learning_rate))``, one fused pass (the mask
    too). ``weight_decay`` multiplies the learning rate, as in optax and PyTorch. Needs
    ``params``.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `adam`.
        b2: as in `adam`.
        eps: as in `adam`.
        eps_root: as in `adam`.
        mu_dtype: as in `adam`.
        weight_decay: the decay rate (a float or a schedule).
        mask: as in `adamw`: None (decay every leaf), or a tree of bools of the params'
            structure (or a prefix of it), or a callable of the params giving one.
        nesterov: as in `adamw`; True by default (optax's ``nadamw`` is ``adamw`` with this
            default, so ``nesterov=False`` gives `adamw`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState, EmptyState(),
            EmptyState())`` (``MaskedState(EmptyState())`` in the middle with a mask).

    Raises:
        TypeError: ``learning_rate`` or ``weight_decay`` is neither a real number nor a
            callable, ``b1``, ``b2``, ``eps`` or ``eps_root`` is not a real number,
            ``mu_dtype`` is not a float dtype, or ``nesterov`` is not a bool; at ``init``, a
            mask leaf that is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1; at ``init``, a mask whose
            structure is not the params' (or a prefix of it); ``update`` without ``params``.

    References:
        Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019
        (arXiv:1711.05101); Dozat, "Incorporating Nesterov Momentum into Adam", ICLR 2016
        workshop track. optax.nadamw; torch.optim.NAdam with ``decoupled_weight_decay=True``
        (with its own momentum-decay schedule: other steps).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.nadamw(0.1, weight_decay=0.5)
        >>> grads = {"w": np.array([0.5, -2.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * (1.4737 * sign(g) + 0.5 * 1)
        [0.8026, 1.0974]
    """
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=nesterov)


@formula(
    states=("mu", "nu", "nu_max"),
    inputs=("g",),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "b2", "one_minus_b2", "bc1", "bc2", "eps", "eps_root"),
)
def amsgrad_direction(mu, nu, nu_max, g, b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root):
    """AMSGrad: the moments as Adam's; ``nu_max = max(nu_max, nu / bc2)``;
    out = (mu / bc1) / (sqrt(nu_max + eps_root) + eps) (a correction of 1 when disabled)."""
    m = one_minus_b1 * g + b1 * mu
    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)
    vm = maximum(re(nu_max), v / bc2)
    return m, v, vm, quot(quot(m, bc1), math.sqrt(vm + eps_root) + eps)


class _ScaleByAmsgrad(_Direction):
    state_cls, fields, formula, name = (
        ScaleByAmsgradState,
        ("mu", "nu", "nu_max"),
        amsgrad_direction,
        "scale_by_amsgrad",
    )
    dtype_options = {"mu": "mu_dtype"}

    def __init__(
        self, b1: float, b2: float, eps: float, eps_root: float, mu_dtype: Any, bc_mu: bool, bc_nu: bool
    ) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.mu_dtype = _mu_dtype(mu_dtype)
        self.bc_mu, self.bc_nu = flag(bc_mu, "bias_correction_mu"), flag(bc_nu, "bias_correction_nu")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2, t = self.b1, self.b2, int(count)
        bc1 = bias_correction(b1, t, ct) if self.bc_mu else 1.0  # x / 1 is x: "no correction"
        bc2 = bias_correction(b2, t, ct) if self.bc_nu else 1.0
        return (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc2, self.eps, self.eps_root)


def scale_by_amsgrad(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformationExtraArgs:
    """Rescales the updates by AMSGrad's moments: Adam's, dividing by the largest second moment.

    ``mu = (1 - b1) g + b1 mu``, ``nu = (1 - b2) g^2 + b2 nu``,
    ``nu_max = max(nu_max, nu / (1 - b2^t))``,
    ``u = (mu / (1 - b1^t)) / (sqrt(nu_max + eps_root) + eps)``, with ``t`` the new step count;
    a correction switched off divides by 1 (``bias_correction_mu``, ``bias_correction_nu``).
    One fused pass.

    Args:
        b1: decay rate of the first moment, between 0 and 1.
        b2: decay rate of the second moment, between 0 and 1.
        eps: added outside the square root.
        eps_root: added inside the square root.
        mu_dtype: storage dtype of ``mu`` (float16, bfloat16, float32 or float64); None keeps each leaf's
            dtype.
        bias_correction_mu: whether to divide ``mu`` by ``1 - b1^t`` (False: the paper's
            AMSGrad).
        bias_correction_nu: whether to divide ``nu`` by ``1 - b2^t`` before the maximum (False:
            the paper's AMSGrad).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAmsgradState(count, mu, nu,
            nu_max)``. Updates keep each leaf's dtype.

    Raises:
        TypeError: ``b1``, ``b2``, ``eps`` or ``eps_root`` is not a real number, ``mu_dtype`` is
            not a float dtype, or ``bias_correction_mu`` or ``bias_correction_nu`` is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Reddi, Kale and Kumar, "On the Convergence of Adam and Beyond", ICLR 2018
        (arXiv:1904.09237). optax.scale_by_amsgrad.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_amsgrad()
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u, state = tx.update({"w": np.array([0.1, -1.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]  # scale_by_adam gives [0.803, -0.9322]
        [0.5789, -0.7368]
        >>> [round(float(x), 3) for x in state.nu_max.tree["w"]]  # about the first g^2
        [0.25, 4.0]
    """
    return _ScaleByAmsgrad(
        b1, b2, eps, eps_root, mu_dtype, bias_correction_mu, bias_correction_nu
    ).transformation()


def amsgrad(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformationExtraArgs:
    """AMSGrad: Adam dividing by the running maximum of its second moment.

    ``mu = (1 - b1) g + b1 mu``, ``nu = (1 - b2) g^2 + b2 nu``,
    ``nu_max = max(nu_max, nu / (1 - b2^t))``,
    ``u = -lr (mu / (1 - b1^t)) / (sqrt(nu_max + eps_root) + eps)`` (each correction optional).

    It is ``chain(scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu,
    bias_correction_nu), scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_amsgrad`.
        b2: as in `scale_by_amsgrad`.
        eps: as in `scale_by_amsgrad`.
        eps_root: as in `scale_by_amsgrad`.
        mu_dtype: as in `scale_by_amsgrad`.
        bias_correction_mu: as in `scale_by_amsgrad`.
        bias_correction_nu: as in `scale_by_amsgrad`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAmsgradState(count, mu, nu,
            nu_max), EmptyState())`` (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, or another
            argument has the wrong type (as in `scale_by_amsgrad`).
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Reddi, Kale and Kumar, "On the Convergence of Adam and Beyond", ICLR 2018
        (arXiv:1904.09237). optax.amsgrad; torch.optim.Adam with ``amsgrad=True`` (which keeps
        the maximum of the uncorrected ``nu``: other steps).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.amsgrad(0.1)
        >>> grads = {"w": np.array([0.5, -2.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * sign(g) at the first step
        [0.9, 1.1]
    """
    return chain(
        scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype, bias_correction_mu, bias_correction_nu),
        scale_by_learning_rate(learning_rate),
    )


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "b2", "bc1", "eps"),
)
def adamax_direction(mu, nu, g, b1, one_minus_b1, b2, bc1, eps):
    """Adamax: mu as Adam's; ``nu = max(|g| + eps, b2 nu)`` (the infinity moment);
    out = (mu / bc1) / nu."""
    m = one_minus_b1 * g + b1 * mu
    v = maximum(abs(g) + eps, b2 * re(nu))
    return m, v, quot(quot(m, bc1), v)


class _ScaleByAdamax(_Direction):
    state_cls, fields, formula, name = ScaleByAdamState, ("mu", "nu"), adamax_direction, "scale_by_adamax"

    def __init__(self, b1: float, b2: float, eps: float) -> None:
        self.b1, self.b2, self.eps = check_decay(b1, "b1"), check_decay(b2, "b2"), real(eps, "eps")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.b1, 1.0 - self.b1, self.b2, bias_correction(self.b1, int(count), ct), self.eps)


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformationExtraArgs:
    """Rescales the updates by Adamax's moments: Adam's, with an infinity norm for the second.

    ``mu = (1 - b1) g + b1 mu``, ``nu = max(|g| + eps, b2 nu)``, ``u = (mu / (1 - b1^t)) / nu``,
    with ``t`` the new step count (``nu`` needs no bias correction); one fused pass.

    Args:
        b1: decay rate of the first moment, between 0 and 1.
        b2: decay rate of the infinity norm, between 0 and 1.
        eps: added to ``|g|`` inside the maximum (so ``nu`` is never 0).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAdamState(count, mu, nu)``,
            as in optax. Updates keep each leaf's dtype.

    Raises:
        TypeError: ``b1``, ``b2`` or ``eps`` is not a real number.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015
        (arXiv:1412.6980), section 7.1. optax.scale_by_adamax; the direction of
        torch.optim.Adamax.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_adamax()
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u, state = tx.update({"w": np.array([0.1, -1.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in state.nu.tree["w"]]  # max(|g| + eps, 0.999 * 0.5)
        [0.4995, 1.998]
        >>> [round(float(x), 4) for x in u["w"]]  # (0.055 / 0.19) / 0.4995 for the first
        [0.5795, -0.7376]
    """
    return _ScaleByAdamax(b1, b2, eps).transformation()


def adamax(
    learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> GradientTransformationExtraArgs:
    """Adamax: Adam with the infinity norm of the gradients for its second moment.

    ``mu = (1 - b1) g + b1 mu``, ``nu = max(|g| + eps, b2 nu)``,
    ``u = -lr (mu / (1 - b1^t)) / nu``.

    It is ``chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate))``, one
    fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_adamax`.
        b2: as in `scale_by_adamax`.
        eps: as in `scale_by_adamax`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            EmptyState())`` (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, or ``b1``, ``b2``
            or ``eps`` is not a real number.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015
        (arXiv:1412.6980), section 7.1. optax.adamax; torch.optim.Adamax.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.adamax(0.1)
        >>> grads = {"w": np.array([0.5, -2.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * g / |g| at the first step
        [0.9, 1.1]
    """
    return chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate))


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=(
        "b1",
        "one_minus_b1",
        "b2",
        "one_minus_b2",
        "bc1",
        "bc1_next",
        "bc2",
        "eps",
        "eps_root",
        "nesterov",
    ),
)
def belief_direction(
    mu, nu, g, b1, one_minus_b1, b2, one_minus_b2, bc1, bc1_next, bc2, eps, eps_root, nesterov
):
    """AdaBelief: ``mu`` as Adam's; ``nu = (1 - b2) (g - mu)^2 + b2 nu + eps_root`` (stored so);
    out = mu_hat / (sqrt(nu / bc2) + eps), ``mu_hat`` as Adam's or NAdam's (``nesterov``)."""
    m = one_minus_b1 * g + b1 * mu
    e = g - m
    v = (one_minus_b2 * abs_sq(e) + b2 * re(nu)) + eps_root
    m_hat = b1 * quot(m, bc1_next) + one_minus_b1 * quot(g, bc1) if nesterov else quot(m, bc1)
    return m, v, quot(m_hat, math.sqrt(v / bc2) + eps)


class _ScaleByBelief(_Direction):
    state_cls, fields, formula, name = ScaleByBeliefState, ("mu", "nu"), belief_direction, "scale_by_belief"

    def __init__(self, b1: float, b2: float, eps: float, eps_root: float, nesterov: bool) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.nesterov = flag(nesterov, "nesterov")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2, t = self.b1, self.b2, int(count)
        bc1, bc1_next = bias_correction(b1, t, ct), bias_correction(b1, int(safe_increment(count)), ct)
        bc2 = bias_correction(b2, t, ct)
        return (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc1_next, bc2, self.eps, self.eps_root, self.nesterov)


def scale_by_belief(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16, eps_root: float = 1e-16, *, nesterov: bool = False
) -> GradientTransformationExtraArgs:
    """Rescales the updates by AdaBelief's moments: Adam's, with the variance of the prediction.

    ``mu = (1 - b1) g + b1 mu``, ``nu = ((1 - b2) (g - mu)^2 + b2 nu) + eps_root`` (with the new
    ``mu``; ``eps_root`` is stored in ``nu``), ``u = mu_hat / (sqrt(nu / (1 - b2^t)) + eps)``,
    with ``t`` the new step count and Adam's ``mu_hat = mu / (1 - b1^t)``, or with ``nesterov``
    NAdam's ``mu_hat = b1 (mu / (1 - b1^(t+1))) + (1 - b1) (g / (1 - b1^t))``; one fused pass.

    Args:
        b1: decay rate of the first moment, between 0 and 1.
        b2: decay rate of the second central moment, between 0 and 1.
        eps: added outside the square root.
        eps_root: added to the second central moment at each step.
        nesterov: NAdam's ``mu_hat`` instead of Adam's.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByBeliefState(count, mu,
            nu)``. Updates keep each leaf's dtype.

    Raises:
        TypeError: ``b1``, ``b2``, ``eps`` or ``eps_root`` is not a real number, or ``nesterov``
            is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Zhuang et al., "AdaBelief Optimizer: Adapting Stepsizes by the Belief in Observed
        Gradients", NeurIPS 2020 (arXiv:2010.07468). optax.scale_by_belief.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_belief()
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # g / sqrt((0.9 g)^2) at the first step
        [1.1111, -1.1111]
    """
    return _ScaleByBelief(b1, b2, eps, eps_root, nesterov).transformation()


def adabelief(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """AdaBelief: Adam dividing by the variance of the gradients around their prediction.

    ``mu = (1 - b1) g + b1 mu``, ``nu = ((1 - b2) (g - mu)^2 + b2 nu) + eps_root``,
    ``u = -lr mu_hat / (sqrt(nu / (1 - b2^t)) + eps)``, ``mu_hat`` Adam's ``mu / (1 - b1^t)``
    (NAdam's with ``nesterov``; see `scale_by_belief`).

    It is ``chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov),
    scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_belief`.
        b2: as in `scale_by_belief`.
        eps: as in `scale_by_belief`.
        eps_root: as in `scale_by_belief`.
        nesterov: as in `scale_by_belief`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByBeliefState(count, mu, nu),
            EmptyState())`` (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, ``b1``, ``b2``,
            ``eps`` or ``eps_root`` is not a real number, or ``nesterov`` is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Zhuang et al., "AdaBelief Optimizer: Adapting Stepsizes by the Belief in Observed
        Gradients", NeurIPS 2020 (arXiv:2010.07468). optax.adabelief; no torch.optim
        counterpart.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.adabelief(0.1)
        >>> grads = {"w": np.array([0.5, -2.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * sign(g) / 0.9
        [0.8889, 1.1111]
    """
    return chain(
        scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), scale_by_learning_rate(learning_rate)
    )


# --- Lion -----------------------------------------------------------------------------------


_LION_MODES = ("hard", "smooth", "refined")


@formula(
    states=("mu",),
    inputs=("g",),
    outputs=("out",),
    scalars=("one_minus_b1", "b1", "one_minus_b2", "b2", "smooth_beta", "smooth", "refined"),
)
def lion_direction(mu, g, one_minus_b1, b1, one_minus_b2, b2, smooth_beta, smooth, refined):
    """Lion: ``c = (1 - b1) g + b1 mu``; out = sign(c) ('hard'), tanh(smooth_beta c)
    ('smooth'), or c where |c| < 1 else sign(c) ('refined'); then ``mu = (1 - b2) g + b2 mu``."""
    c = one_minus_b1 * g + b1 * mu
    if smooth:
        out = tanh(smooth_beta * c)
    elif refined and abs(c) < 1.0:
        out = c
    else:
        out = sign_of(c)  # jnp.sign: +-0 and NaN as they are
    return one_minus_b2 * g + b2 * mu, out


class _ScaleByLion(_Direction):
    state_cls, fields, formula, name = ScaleByLionState, ("mu",), lion_direction, "scale_by_lion"
    dtype_options = {"mu": "mu_dtype"}

    def __init__(self, b1: float, b2: float, mu_dtype: Any, mode: str, smooth_beta: float) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.mu_dtype = _mu_dtype(mu_dtype)
        if not isinstance(mode, str) or mode not in _LION_MODES:  # an array has no truth value
            raise ValueError(f"mode must be one of {list(_LION_MODES)}, got {mode!r}")
        self.mode, self.smooth_beta = mode, real(smooth_beta, "smooth_beta")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2 = self.b1, self.b2
        return (1.0 - b1, b1, 1.0 - b2, b2, self.smooth_beta, self.mode == "smooth", self.mode == "refined")


def scale_by_lion(
    b1: float = 0.9, b2: float = 0.99, mu_dtype: Any = None, *, mode: str = "hard", smooth_beta: float = 1.0
) -> GradientTransformationExtraArgs:
    """Rescales the updates by Lion's direction: the sign of an interpolated momentum.

    ``c = (1 - b1) g + b1 mu`` (with the previous ``mu``), ``u = sign(c)`` (+-0 and NaN as they
    are), then ``mu = (1 - b2) g + b2 mu``. With ``mode='smooth'``, ``u = tanh(smooth_beta c)``;
    with ``mode='refined'``, ``u = c`` where ``|c| < 1``, else ``sign(c)``. One fused pass.

    Args:
        b1: weight of the momentum in ``c``, between 0 and 1.
        b2: decay rate of the momentum, between 0 and 1.
        mu_dtype: storage dtype of ``mu`` (float16, bfloat16, float32 or float64); None keeps each leaf's
            dtype.
        mode: ``'hard'`` (the sign), ``'smooth'`` (tanh) or ``'refined'`` (linear near 0).
        smooth_beta: the slope of the tanh with ``mode='smooth'``.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByLionState(count, mu)``.
            Updates keep each leaf's dtype.

    Raises:
        TypeError: ``b1``, ``b2`` or ``smooth_beta`` is not a real number, or ``mu_dtype`` is
            not a float dtype.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1, or ``mode`` is not one of
            ``'hard'``, ``'smooth'`` and ``'refined'``.

    References:
        Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023
        (arXiv:2302.06675). optax.scale_by_lion.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> tx = nba.scale_by_lion()
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # sign(0.1 g)
        [1.0, -1.0]
        >>> tx = nba.scale_by_lion(mode="refined")
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # 0.1 g, below 1 in magnitude
        [0.05, -0.2]
    """
    return _ScaleByLion(b1, b2, mu_dtype, mode, smooth_beta).transformation()


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Any = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """Lion: the sign of an interpolated momentum, with decoupled weight decay.

    ``c = (1 - b1) g + b1 mu`` (with the previous ``mu``),
    ``u = -lr (sign(c) + weight_decay * params)``, then ``mu = (1 - b2) g + b2 mu``.

    It is ``chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, one fused pass (the mask too). ``weight_decay``
    multiplies the learning rate, as in optax. Needs ``params``.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_lion`.
        b2: as in `scale_by_lion`.
        mu_dtype: as in `scale_by_lion`.
        weight_decay: the decay rate (a float or a schedule).
        mask: as in `adamw`: None (decay every leaf), or a tree of bools of the params'
            structure (or a prefix of it), or a callable of the params giving one.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByLionState(count, mu),
            EmptyState(), EmptyState())`` (``MaskedState(EmptyState())`` in the middle with a
            mask).

    Raises:
        TypeError: ``learning_rate`` or ``weight_decay`` is neither a real number nor a
            callable, ``b1`` or ``b2`` is not a real number, or ``mu_dtype`` is not a float
            dtype; at ``init``, a mask leaf that is not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1; at ``init``, a mask whose
            structure is not the params' (or a prefix of it); ``update`` without ``params``.

    References:
        Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023
        (arXiv:2302.06675). optax.lion; no torch.optim counterpart.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.lion(0.1, weight_decay=0.5)
        >>> grads = {"w": np.array([0.5, -2.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * (sign(g) + 0.5 * 1)
        [0.85, 1.05]
    """
    return chain(
        scale_by_lion(b1, b2, mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


# --- Yogi: its formula declared here, beside its stage ---------------------------------------


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=("b1", "one_minus_b1", "one_minus_b2", "bc1", "bc2", "eps", "eps_root"),
)
def yogi_direction(mu, nu, g, b1, one_minus_b1, one_minus_b2, bc1, bc2, eps, eps_root):
    """Yogi: ``mu`` as Adam's; ``nu = nu - (1 - b2) sign(nu - g^2) g^2``;
    out = (mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps) (NaN for a negative ``nu``).

    optax's ``((1 - b2) * sign(d)) * g^2`` with ``d = nu - g^2``, case by case and in the
    buffer's dtype (a literal 1.0 would make a float32 step float64): ``t = (1 - b2) g^2`` for
    d > 0, ``-t`` for d < 0 (``nu - (-t)`` is ``nu + t`` exactly), and for d = +-0 or NaN, where
    ``sign(d)`` is d, ``((1 - b2) d) g^2``: optax's bits in every case."""
    m = one_minus_b1 * g + b1 * mu
    g2 = abs_sq(g)
    n = re(nu)
    d = n - g2
    if d > 0:
        v = n - one_minus_b2 * g2
    elif d < 0:
        v = n + one_minus_b2 * g2
    else:
        v = n - (one_minus_b2 * d) * g2
    return m, v, quot(quot(m, bc1), sqrt(v / bc2 + eps_root) + eps)


class _ScaleByYogi(_Direction):
    state_cls, fields, formula, name = ScaleByAdamState, ("mu", "nu"), yogi_direction, "scale_by_yogi"
    start_values = {"mu": "initial", "nu": "initial"}  # both moments, as in optax

    def __init__(
        self, b1: float, b2: float, eps: float, eps_root: float, initial_accumulator_value: float
    ) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.initial = real(initial_accumulator_value, "initial_accumulator_value")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2, t = self.b1, self.b2, int(count)
        bc1, bc2 = bias_correction(b1, t, ct), bias_correction(b2, t, ct)
        return (b1, 1.0 - b1, 1.0 - b2, bc1, bc2, self.eps, self.eps_root)


def scale_by_yogi(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-3,
    eps_root: float = 0.0,
    initial_accumulator_value: float = 1e-6,
) -> GradientTransformationExtraArgs:
    """Yogi's direction (state `ScaleByAdamState`, as in optax): ``mu = (1 - b1) g + b1 mu``,
    ``nu = nu - (1 - b2) sign(nu - g^2) g^2``,
    ``u = (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t) + eps_root) + eps)``, one fused pass.

    Args:
        b1: decay rate of the first moment, in [0, 1].
        b2: decay rate of the second moment, in [0, 1].
        eps: added outside the square root.
        eps_root: added inside the square root.
        initial_accumulator_value: where both moments start (optax allows positive values only;
            a negative ``nu`` gives NaN updates).

    Returns:
        A transformation with state `ScaleByAdamState`. Updates keep each leaf's dtype.

    Raises:
        TypeError: ``b1``, ``b2``, ``eps``, ``eps_root`` or ``initial_accumulator_value`` is
            not a real number.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Zaheer et al., "Adaptive Methods for Nonconvex Optimization", NeurIPS 2018.
        optax.scale_by_yogi.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_yogi()
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 3) for x in u["w"]], int(state.count)
        ([0.996, -0.999], 1)
    """
    return _ScaleByYogi(b1, b2, eps, eps_root, initial_accumulator_value).transformation()


def yogi(
    learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3
) -> GradientTransformationExtraArgs:
    """Yogi: ``chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate))``:
    ``u = -lr scale_by_yogi(g)``.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_yogi`.
        b2: as in `scale_by_yogi`.
        eps: as in `scale_by_yogi`.

    Returns:
        A transformation with state ``(ScaleByAdamState, learning-rate state)``.

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, or ``b1``, ``b2``
            or ``eps`` is not a real number.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Zaheer et al., "Adaptive Methods for Nonconvex Optimization", NeurIPS 2018.
        optax.yogi; no torch.optim counterpart.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([1.0, 1.0], np.float32)}
        >>> tx = nba.yogi(0.1)
        >>> state = nba.step_(tx, {"w": np.array([0.5, -2.0], np.float32)}, tx.init(params), params)
        >>> [round(float(x), 3) for x in params["w"]]
        [0.9, 1.1]
    """
    return chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate))


# --- RMSProp and Adagrad --------------------------------------------------------------------


@formula(
    states=("nu",),
    inputs=("g",),
    outputs=("out",),
    scalars=("one_minus_decay", "decay", "bc", "eps", "eps_in_sqrt"),
)
def rms_direction(nu, g, one_minus_decay, decay, bc, eps, eps_in_sqrt):
    """RMSProp's scaling: ``nu = (1 - decay) g^2 + decay nu``; out = g / sqrt(nu / bc + eps)
    (``eps_in_sqrt``) or g / (sqrt(nu / bc) + eps); ``bc`` 1 without bias correction. The scale
    is `inv_root`'s."""
    v = one_minus_decay * abs_sq(g) + decay * re(nu)
    return v, inv_root(v / bc, eps, eps_in_sqrt) * g


class _ScaleByRms(_Direction):
    formula, name = rms_direction, "scale_by_rms"
    fields: tuple[str, ...] = ("nu",)
    start_values = {"nu": "initial"}

    def __init__(self, decay: float, eps: float, initial_scale: float, eps_in_sqrt: bool, bc: bool) -> None:
        self.decay, self.eps = check_decay(decay, "decay"), real(eps, "eps")
        self.initial = real(initial_scale, "initial_scale")
        self.eps_in_sqrt, self.bc = flag(eps_in_sqrt, "eps_in_sqrt"), flag(bc, "bias_correction")
        self.counted = self.bc  # optax's state has a count only then
        self.state_cls = ScaleByRmsWithCountState if self.bc else ScaleByRmsState

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        bc = bias_correction(self.decay, int(count), ct) if self.bc else 1.0
        return (1.0 - self.decay, self.decay, bc, self.eps, self.eps_in_sqrt)


def scale_by_rms(
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformationExtraArgs:
    """Rescales the updates by the root of the moving average of their squares (RMSProp's).

    ``nu = (1 - decay) g^2 + decay nu`` (starting at ``initial_scale``),
    ``u = (1 / sqrt(nu_hat + eps)) g`` with ``eps_in_sqrt``, else ``u = (1 / (sqrt(nu_hat) +
    eps)) g``, where ``nu_hat = nu / (1 - decay^t)`` (``t`` the new step count) with
    ``bias_correction``, else ``nu``; one fused pass.

    Args:
        decay: decay rate of the moving average, between 0 and 1.
        eps: added inside or outside the square root (see ``eps_in_sqrt``).
        initial_scale: the value ``nu`` starts at (PyTorch: 0; TF1: 1).
        eps_in_sqrt: whether ``eps`` is added inside the square root (optax's default) or
            outside it (PyTorch's).
        bias_correction: whether to divide ``nu`` by ``1 - decay^t`` (the state then counts
            steps).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByRmsState(nu)``, or
            ``ScaleByRmsWithCountState(count, nu)`` with ``bias_correction``. Updates keep each
            leaf's dtype.

    Raises:
        TypeError: ``decay``, ``eps`` or ``initial_scale`` is not a real number, or
            ``eps_in_sqrt`` or ``bias_correction`` is not a bool.
        ValueError: ``decay`` is not between 0 and 1.

    References:
        Tieleman and Hinton, "Lecture 6.5, RMSProp: Divide the gradient by a running average
        of its recent magnitude", COURSERA: Neural Networks for Machine Learning, 2012.
        optax.scale_by_rms; the scaling of torch.optim.RMSprop (with ``eps_in_sqrt=False``).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> tx = nba.scale_by_rms()
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # g / sqrt(0.1 g^2)
        [3.1623, -3.1623]
        >>> tx = nba.scale_by_rms(bias_correction=True)
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]], int(state.count)  # g / sqrt(g^2)
        ([1.0, -1.0], 1)
    """
    return _ScaleByRms(decay, eps, initial_scale, eps_in_sqrt, bias_correction).transformation()


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=("one_minus_decay", "decay", "bc", "eps", "eps_in_sqrt"),
)
def stddev_direction(mu, nu, g, one_minus_decay, decay, bc, eps, eps_in_sqrt):
    """Centred RMSProp's scaling: mu, nu the EMAs of g and g^2; ``var = nu / bc - (mu / bc)^2``;
    out = g / sqrt(var + eps) (``eps_in_sqrt``) or g / (sqrt(var) + eps)."""
    m = one_minus_decay * g + decay * mu
    v = one_minus_decay * abs_sq(g) + decay * re(nu)
    mh = quot(m, bc)
    var = v / bc - abs_sq(mh)  # may round below zero: NaN then, as in optax
    return m, v, inv_root(var, eps, eps_in_sqrt) * g


class _ScaleByStddev(_ScaleByRms):
    formula, name = stddev_direction, "scale_by_stddev"
    fields = ("mu", "nu")

    def __init__(self, decay: float, eps: float, initial_scale: float, eps_in_sqrt: bool, bc: bool) -> None:
        super().__init__(decay, eps, initial_scale, eps_in_sqrt, bc)
        self.state_cls = ScaleByRStdDevWithCountState if self.bc else ScaleByRStdDevState


def scale_by_stddev(
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformationExtraArgs:
    """Rescales the updates by the root of the moving variance of the gradients (centred RMSProp).

    ``mu = (1 - decay) g + decay mu``, ``nu = (1 - decay) g^2 + decay nu`` (``mu`` starting at 0,
    ``nu`` at ``initial_scale``), ``var = nu_hat - mu_hat^2``,
    ``u = (1 / sqrt(var + eps)) g`` with ``eps_in_sqrt``, else ``u = (1 / (sqrt(var) + eps)) g``,
    where ``mu_hat = mu / (1 - decay^t)`` and ``nu_hat = nu / (1 - decay^t)`` (``t`` the new
    step count) with ``bias_correction``, else ``mu`` and ``nu``. A ``var`` that rounds below
    zero (below ``-eps`` with ``eps_in_sqrt``) gives NaN, as in optax. One fused pass.

    Args:
        decay: decay rate of both moving averages, between 0 and 1.
        eps: added inside or outside the square root (see ``eps_in_sqrt``).
        initial_scale: the value ``nu`` starts at.
        eps_in_sqrt: whether ``eps`` is added inside the square root (optax's default) or
            outside it (PyTorch's).
        bias_correction: whether to divide ``mu`` and ``nu`` by ``1 - decay^t`` (the state then
            counts steps).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByRStdDevState(mu, nu)``, or
            ``ScaleByRStdDevWithCountState(count, mu, nu)`` with ``bias_correction``. Updates keep
            each leaf's dtype.

    Raises:
        TypeError: ``decay``, ``eps`` or ``initial_scale`` is not a real number, or
            ``eps_in_sqrt`` or ``bias_correction`` is not a bool.
        ValueError: ``decay`` is not between 0 and 1.

    References:
        Graves, "Generating Sequences With Recurrent Neural Networks", 2013 (arXiv:1308.0850).
        optax.scale_by_stddev; the scaling of torch.optim.RMSprop with ``centered=True``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> tx = nba.scale_by_stddev()
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # g / sqrt(0.1 g^2 - (0.1 g)^2)
        [3.3333, -3.3333]
    """
    return _ScaleByStddev(decay, eps, initial_scale, eps_in_sqrt, bias_correction).transformation()


def rmsprop(
    learning_rate: ScalarOrSchedule,
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: float | None = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformationExtraArgs:
    """RMSProp, optax's flexible one: plain or centred, with optional (Nesterov) momentum.

    ``nu = (1 - decay) g^2 + decay nu``, ``u = -lr (1 / sqrt(nu_hat + eps)) g`` (``eps`` outside
    the root without ``eps_in_sqrt``; ``nu_hat`` as in `scale_by_rms`, or the variance
    ``nu_hat - mu_hat^2`` of `scale_by_stddev` when ``centered``); then with ``momentum``,
    ``trace = u + momentum trace`` and ``u = trace`` (``u + momentum trace`` with ``nesterov``).

    It is ``chain(direction, scale_by_learning_rate(learning_rate), trace(momentum, nesterov))``
    with ``direction = scale_by_rms(decay, eps, initial_scale, eps_in_sqrt, bias_correction)``
    (`scale_by_stddev` when ``centered``) and ``identity()`` for the trace without momentum,
    one fused pass. As in optax, the learning rate is applied before the momentum.

    Args:
        learning_rate: a float, or a schedule of the step count.
        decay: as in `scale_by_rms`.
        eps: as in `scale_by_rms`.
        initial_scale: as in `scale_by_rms`.
        eps_in_sqrt: as in `scale_by_rms`.
        centered: whether to divide by the root of the variance (`scale_by_stddev`) instead of
            the second moment.
        momentum: decay rate of the momentum's trace, between 0 and 1; None: no momentum.
        nesterov: Nesterov's momentum (used only with ``momentum``).
        bias_correction: as in `scale_by_rms` (both moments when ``centered``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByRmsState(nu), EmptyState(),
            EmptyState())``: first the direction's (``ScaleByRmsWithCountState`` with
            ``bias_correction``; ``ScaleByRStdDevState`` or ``ScaleByRStdDevWithCountState`` when
            ``centered``), then the learning rate's (``ScaleByScheduleState`` with a schedule), then
            ``TraceState(trace)`` with ``momentum``.

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, ``decay``,
            ``eps``, ``initial_scale`` or ``momentum`` is not a real number, or
            ``eps_in_sqrt``, ``centered``, ``bias_correction`` or (with ``momentum``)
            ``nesterov`` is not a bool.
        ValueError: ``decay`` or ``momentum`` is not between 0 and 1.

    References:
        Tieleman and Hinton, "Lecture 6.5, RMSProp: Divide the gradient by a running average
        of its recent magnitude", COURSERA: Neural Networks for Machine Learning, 2012; Graves,
        "Generating Sequences With Recurrent Neural Networks", 2013 (arXiv:1308.0850).
        optax.rmsprop; torch.optim.RMSprop (``alpha`` is ``decay``; it adds ``eps`` outside the
        root, as ``eps_in_sqrt=False``, and applies the learning rate after the momentum).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.rmsprop(0.1)
        >>> grads = {"w": np.array([0.5, -2.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * g / sqrt(0.1 g^2)
        [0.6838, 1.3162]
    """
    direction = scale_by_stddev if flag(centered, "centered") else scale_by_rms
    if momentum is not None:
        check_decay(momentum, "momentum")  # named as the caller knows it (trace calls it decay)
    return chain(
        direction(decay, eps, initial_scale, eps_in_sqrt, bias_correction),
        scale_by_learning_rate(learning_rate),
        trace(momentum, nesterov) if momentum is not None else identity(),
    )


@formula(states=("sum_of_squares",), inputs=("g",), outputs=("out",), scalars=("eps",))
def rss_direction(sum_of_squares, g, eps):
    """Adagrad's scaling: ``s = g^2 + s``; out = g / sqrt(s + eps) where s > 0, else 0."""
    s = abs_sq(g) + re(sum_of_squares)
    return s, (1.0 / math.sqrt(s + eps) if s > 0 else 0.0) * g


class _ScaleByRss(_Direction):
    state_cls, fields, formula, name = ScaleByRssState, ("sum_of_squares",), rss_direction, "scale_by_rss"
    counted = False
    start_values = {"sum_of_squares": "initial"}

    def __init__(self, initial_accumulator_value: float, eps: float) -> None:
        self.initial = real(initial_accumulator_value, "initial_accumulator_value")
        self.eps = real(eps, "eps")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.eps,)


def scale_by_rss(
    initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> GradientTransformationExtraArgs:
    """Rescales the updates by the root of the sum of all squared gradients so far (Adagrad's).

    ``s = g^2 + s`` (starting at ``initial_accumulator_value``),
    ``u = r g`` with ``r = 1 / sqrt(s + eps)`` where ``s > 0``, else ``r = 0``; one fused pass.

    Args:
        initial_accumulator_value: the value ``s`` starts at (optax asks for a value of 0 or
            more).
        eps: added inside the square root.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByRssState(sum_of_squares)``.
            Updates keep each leaf's dtype.

    Raises:
        TypeError: ``initial_accumulator_value`` or ``eps`` is not a real number.

    References:
        Duchi, Hazan and Singer, "Adaptive Subgradient Methods for Online Learning and
        Stochastic Optimization", JMLR 12, 2011. optax.scale_by_rss.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> tx = nba.scale_by_rss()
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in state.sum_of_squares.tree["w"]]  # 0.1 + g^2
        [0.35, 4.1]
        >>> [round(float(x), 4) for x in u["w"]]  # g / sqrt(0.1 + g^2)
        [0.8452, -0.9877]
    """
    return _ScaleByRss(initial_accumulator_value, eps).transformation()


def adagrad(
    learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> GradientTransformationExtraArgs:
    """Adagrad: each element's step divided by the root of the sum of its squared gradients.

    ``s = g^2 + s`` (starting at ``initial_accumulator_value``),
    ``u = -lr (r g)`` with ``r = 1 / sqrt(s + eps)`` where ``s > 0``, else ``r = 0``.

    It is ``chain(scale_by_rss(initial_accumulator_value, eps),
    scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        initial_accumulator_value: as in `scale_by_rss`.
        eps: as in `scale_by_rss`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByRssState(sum_of_squares),
            EmptyState())`` (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, or
            ``initial_accumulator_value`` or ``eps`` is not a real number.

    References:
        Duchi, Hazan and Singer, "Adaptive Subgradient Methods for Online Learning and
        Stochastic Optimization", JMLR 12, 2011. optax.adagrad; torch.optim.Adagrad (which
        adds ``eps`` outside the root, and starts at 0 by default).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.adagrad(0.1)
        >>> grads = {"w": np.array([0.5, -2.0], np.float32)}
        >>> state = nba.step_(tx, grads, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * g / sqrt(0.1 + g^2)
        [0.9155, 1.0988]
    """
    return chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))


# --- AdamaxW, RAdam, Adadelta (issue 26) -------------------------------------------------------


def adamaxw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """Adamax with decoupled weight decay.

    ``u = -lr ((mu / (1 - b1^t)) / nu + wd p)`` with Adamax's moments (`scale_by_adamax`): it is
    ``chain(scale_by_adamax(b1, b2, eps), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_adamax`.
        b2: as in `scale_by_adamax`.
        eps: as in `scale_by_adamax`.
        weight_decay: the decay rate (multiplied by the learning rate), or a schedule of it.
        mask: None (decay every leaf), a tree of bools of the params' structure (or a prefix
            of it), or a callable of the params returning one (as `add_decayed_weights`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            EmptyState(), EmptyState())`` (``MaskedState(EmptyState())`` in the middle with a
            mask, ``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019
        (arXiv:1711.05101); Kingma and Ba, "Adam", ICLR 2015, section 7.1. optax.adamaxw.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.adamaxw(0.1, weight_decay=0.1)
        >>> state = nba.step_(tx, {"w": np.array([0.25, -4.0], np.float32)}, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 (g / |g| + 0.1 p) at step 1
        [0.89, 1.09]
    """
    return chain(
        scale_by_adamax(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


@formula(
    states=("mu", "nu"),
    inputs=("g",),
    outputs=("out",),
    scalars=(
        "b1",
        "one_minus_b1",
        "b2",
        "one_minus_b2",
        "bc1",
        "bc1_next",
        "bc2",
        "eps",
        "eps_root",
        "r",
        "rectified",
        "nesterov",
    ),
)
def radam_direction(
    mu, nu, g, b1, one_minus_b1, b2, one_minus_b2, bc1, bc1_next, bc2, eps, eps_root, r, rectified, nesterov
):
    """Rectified Adam: the moments as Adam's; ``mu_hat`` as Adam's (or NAdam's, ``nesterov``);
    out = (r mu_hat) / (sqrt(nu / bc2 + eps_root) + eps) while the variance is tractable
    (``rectified``: rho_t >= threshold), else mu_hat (momentum alone)."""
    m = one_minus_b1 * g + b1 * mu
    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)
    m_hat = b1 * quot(m, bc1_next) + one_minus_b1 * quot(g, bc1) if nesterov else quot(m, bc1)
    if rectified:
        return m, v, quot(r * m_hat, math.sqrt(v / bc2 + eps_root) + eps)
    return m, v, m_hat


class _ScaleByRadam(_Direction):
    state_cls, fields, formula, name = ScaleByAdamState, ("mu", "nu"), radam_direction, "scale_by_radam"

    def __init__(self, b1: Any, b2: Any, eps: Any, eps_root: Any, threshold: Any, nesterov: Any) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.threshold, self.nesterov = real(threshold, "threshold"), flag(nesterov, "nesterov")
        if self.b2 == 1.0:
            raise ValueError("b2 must be below 1 (rho_inf = 2 / (1 - b2) - 1)")
        self.rho_inf = 2.0 / (1.0 - self.b2) - 1.0

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2, t = self.b1, self.b2, int(count)
        bc2 = bias_correction(b2, t, ct)
        one, two, four = ct.type(1.0), ct.type(2.0), ct.type(4.0)
        # b2 ** t in the compute dtype, as optax's weak float: rho_t cancels 1999 - 1994 near the
        # threshold, so 1 - bc2 (rounded twice) would move it by a percent.
        b2t = ct.type(b2) ** t
        rho_inf = ct.type(self.rho_inf)
        with np.errstate(all="ignore"):  # rho_t < 4 gives NaN for r, unused then
            rho = rho_inf - two * ct.type(t) * b2t / (one - b2t)
            r = np.sqrt((rho - four) * (rho - two) * rho_inf / ((rho_inf - four) * (rho_inf - two) * rho))
        return (
            b1,
            1.0 - b1,
            b2,
            1.0 - b2,
            bias_correction(b1, t, ct),
            bias_correction(b1, int(safe_increment(count)), ct),
            bc2,
            self.eps,
            self.eps_root,
            r,
            float(rho) >= self.threshold,  # (compared in float64: a huge threshold stays huge)
            self.nesterov,
        )


def scale_by_radam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    threshold: float = 5.0,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """Rescales the updates by Rectified Adam's moments.

    Adam's moments ``mu``, ``nu`` and bias corrections; with ``rho_inf = 2 / (1 - b2) - 1`` and
    ``rho_t = rho_inf - 2 t b2^t / (1 - b2^t)``, ``u = r_t mu_hat / (sqrt(nu_hat + eps_root) +
    eps)`` where ``rho_t >= threshold``, ``r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf -
    4)(rho_inf - 2) rho_t))``, else ``u = mu_hat`` (the variance of the adaptive step is not yet
    tractable: momentum alone). ``rho_t`` and ``r_t`` are computed per step on the host, in the
    leaves' dtype as optax does; one fused pass.

    Args:
        b1: decay rate of the first moment, between 0 and 1.
        b2: decay rate of the second moment, between 0 and 1 (1 excluded).
        eps: added to the square root of the second moment.
        eps_root: added inside the square root.
        threshold: the ``rho_t`` from which the rectified step is taken.
        nesterov: Nesterov's momentum for ``mu_hat`` (as `scale_by_nadam`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAdamState(count, mu, nu)``,
            as in optax.

    Raises:
        TypeError: a hyperparameter is not a real number, or ``nesterov`` not a bool.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1, or ``b2`` is 1.

    References:
        Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond", ICLR 2020
        (arXiv:1908.03265). optax.scale_by_radam.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_radam()
        >>> g = {"w": np.array([0.5, -2.0], np.float32)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # rho_1 = 1 < 5: mu_hat = g
        [0.5, -2.0]
    """
    return _ScaleByRadam(b1, b2, eps, eps_root, threshold, nesterov).transformation()


def radam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    threshold: float = 5.0,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """Rectified Adam (RAdam): Adam whose adaptive step is taken only once its variance is
    tractable, scaled by the rectification ``r_t`` (`scale_by_radam`); momentum alone before.

    It is ``chain(scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
    scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_radam`.
        b2: as in `scale_by_radam`.
        eps: as in `scale_by_radam`.
        eps_root: as in `scale_by_radam`.
        threshold: as in `scale_by_radam`.
        nesterov: as in `scale_by_radam`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            EmptyState())`` (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).
        ValueError: ``b1`` or ``b2`` is not between 0 and 1, or ``b2`` is 1.

    References:
        Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond", ICLR 2020
        (arXiv:1908.03265). optax.radam.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2, np.float32)}
        >>> tx = nba.radam(0.1)
        >>> state = tx.init(params)
        >>> for _ in range(6):  # rho_t passes 5 at the sixth step
        ...     state = nba.step_(tx, {"w": np.array([1.0, -1.0], np.float32)}, state, params)
        >>> [round(float(x), 4) for x in params["w"]]
        [-0.5026, 0.5026]
    """
    return chain(
        scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
        scale_by_learning_rate(learning_rate),
    )


@state_class
class ScaleByAdaDeltaState(NamedTuple):
    """Adadelta's running averages.

    Attributes:
        e_g: the exponential moving average of the squared gradients, a FlatTree of the params'
            layout (each leaf's dtype).
        e_x: the exponential moving average of the squared updates.
    """

    e_g: FlatTree
    e_x: FlatTree


@formula(states=("e_g", "e_x"), inputs=("g",), outputs=("out",), scalars=("rho", "one_minus_rho", "eps"))
def adadelta_direction(e_g, e_x, g, rho, one_minus_rho, eps):
    """Adadelta: ``e_g = (1 - rho) g^2 + rho e_g``; ``u = (sqrt(e_x + eps) / sqrt(e_g + eps)) g``
    (the previous ``e_x``); ``e_x = (1 - rho) u^2 + rho e_x``."""
    eg = one_minus_rho * abs_sq(g) + rho * re(e_g)
    u = (math.sqrt(re(e_x) + eps) / math.sqrt(eg + eps)) * g
    return eg, one_minus_rho * abs_sq(u) + rho * re(e_x), u


class _ScaleByAdaDelta(_Direction):
    state_cls, fields, formula, name = (
        ScaleByAdaDeltaState,
        ("e_g", "e_x"),
        adadelta_direction,
        "scale_by_adadelta",
    )
    counted = False
    # optax's Adadelta squares complex gradients (``g ** 2``, not ``|g|^2``) and its tests skip
    # complex params: refused here.
    complex_leaves = False

    def __init__(self, rho: Any, eps: Any) -> None:
        self.rho, self.eps = check_decay(rho, "rho"), real(eps, "eps")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.rho, 1.0 - self.rho, self.eps)


def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformationExtraArgs:
    """Rescales the updates by Adadelta's ratio of running averages.

    ``e_g = (1 - rho) g^2 + rho e_g``; ``u = (sqrt(e_x + eps) / sqrt(e_g + eps)) g`` with the
    previous ``e_x``; then ``e_x = (1 - rho) u^2 + rho e_x``. One fused pass.

    Args:
        rho: the decay of both running averages, between 0 and 1.
        eps: added inside both square roots.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAdaDeltaState(e_g, e_x)``, as
            in optax.

    Raises:
        TypeError: ``rho`` or ``eps`` is not a real number.
        ValueError: ``rho`` is not between 0 and 1.

    References:
        Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012 (arXiv:1212.5701).
        optax.scale_by_adadelta.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_adadelta()
        >>> g = {"w": np.array([1.0, -2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 6) for x in u["w"]]  # sqrt(1e-6) / sqrt(0.1 g^2 + 1e-6) g
        [0.003162, -0.003162]
    """
    return _ScaleByAdaDelta(rho, eps).transformation()


def adadelta(
    learning_rate: ScalarOrSchedule | None = None,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: Any = None,
) -> GradientTransformationExtraArgs:
    """Adadelta: steps scaled by the ratio of the running RMS of the updates to that of the
    gradients (`scale_by_adadelta`), after an L2 weight decay added to the gradients.

    It is ``chain(add_decayed_weights(weight_decay, weight_decay_mask), scale_by_adadelta(rho,
    eps), scale_by_learning_rate(learning_rate))``, one fused pass. ``learning_rate=None``, optax's
    default, scales by nothing (`identity` in its place, as optax's): the updates are then the
    scaled gradients themselves, not their negation.

    Args:
        learning_rate: a float, or a schedule of the step count; None: no scaling.
        rho: as in `scale_by_adadelta`.
        eps: as in `scale_by_adadelta`.
        weight_decay: the L2 coefficient added to the gradients (``g + wd p``), or a schedule.
        weight_decay_mask: which leaves decay (as `add_decayed_weights`' mask).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(EmptyState(),
            ScaleByAdaDeltaState(e_g, e_x), EmptyState())`` (``ScaleByScheduleState`` last, with
            a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).
        ValueError: ``rho`` is not between 0 and 1.

    References:
        Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012 (arXiv:1212.5701).
        optax.adadelta; torch.optim.Adadelta.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.adadelta(1.0)
        >>> state = nba.step_(tx, {"w": np.array([1.0, -2.0])}, tx.init(params), params)
        >>> [round(float(x), 6) for x in params["w"]]
        [-0.003162, 0.003162]
    """
    return chain(
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_adadelta(rho, eps),
        identity() if learning_rate is None else scale_by_learning_rate(learning_rate),
    )


# --- LAMB and LARS (issue 26) -------------------------------------------------------------------


def lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """LAMB: Adam's direction with decoupled weight decay, each leaf's step scaled by its trust
    ratio ``||p|| / ||u||``.

    It is ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
    scale_by_trust_ratio(), scale_by_learning_rate(learning_rate))``: one fused pass for the
    direction and the decay, the per-leaf norms (float64), then one scaling pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_adam`.
        b2: as in `scale_by_adam`.
        eps: as in `scale_by_adam` (LAMB's default is 1e-6).
        eps_root: as in `scale_by_adam`.
        weight_decay: the decay rate, or a schedule of it.
        mask: which leaves decay (as `add_decayed_weights`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            EmptyState(), EmptyState(), EmptyState())`` (``MaskedState`` for a masked decay,
            ``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).
        ValueError: ``b1`` or ``b2`` is not between 0 and 1; at an update, no ``params``.

    References:
        You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
        ICLR 2020 (arXiv:1904.00962). optax.lamb.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([3.0, 4.0])}
        >>> tx = nba.lamb(0.1)
        >>> state = nba.step_(tx, {"w": np.array([1.0, 1.0])}, tx.init(params), params)
        >>> params["w"].round(4).tolist()  # Adam's first step (1, 1), times ||p|| / sqrt(2)
        [2.6464, 3.6464]
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )


def lars(
    learning_rate: ScalarOrSchedule,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: Any = True,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    trust_ratio_mask: Any = True,
    momentum: float = 0.9,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """LARS: SGD with momentum on each leaf's gradient (plus weight decay) scaled by its trust
    ratio ``trust_coefficient ||p|| / (||g|| + eps)``.

    It is ``chain(add_decayed_weights(weight_decay, weight_decay_mask),
    masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps),
    trust_ratio_mask), scale_by_learning_rate(learning_rate), trace(momentum, nesterov))``, as
    optax's (the momentum after the learning rate).

    Args:
        learning_rate: a float, or a schedule of the step count.
        weight_decay: the L2 coefficient added to the gradients, or a schedule of it.
        weight_decay_mask: which leaves decay: True (all), or a mask as `add_decayed_weights`'.
        trust_coefficient: multiplies the trust ratio.
        eps: added to the update's norm.
        trust_ratio_mask: which leaves are scaled by their trust ratio (True: all; a mask as
            `masked`'s).
        momentum: the momentum's decay, between 0 and 1.
        nesterov: Nesterov's momentum.

    Returns:
        A `GradientTransformationExtraArgs`; its state is the chain's tuple, ending with
            ``TraceState(trace)``.

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).
        ValueError: ``momentum`` is not between 0 and 1; at an update, no ``params``.

    References:
        You, Gitman and Ginsburg, "Large Batch Training of Convolutional Networks", 2017
        (arXiv:1708.03888). optax.lars.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([3.0, 4.0])}
        >>> tx = nba.lars(1.0, trust_coefficient=0.1)
        >>> state = nba.step_(tx, {"w": np.array([0.6, 0.8])}, tx.init(params), params)
        >>> params["w"].round(4).tolist()  # g * 0.1 * 5 / 1
        [2.7, 3.6]
    """
    check_decay(momentum, "momentum")  # named as the caller knows it (trace calls it decay)
    return chain(
        add_decayed_weights(weight_decay, weight_decay_mask),
        masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps), trust_ratio_mask),
        scale_by_learning_rate(learning_rate),
        trace(momentum, nesterov),
    )


# --- signum and Rprop (issue 26) -----------------------------------------------------------------


def signum(
    learning_rate: ScalarOrSchedule, beta: float = 0.9, accumulator_dtype: Any = None
) -> GradientTransformationExtraArgs:
    """Signum: SGD on the signs of an EMA of the gradients (signSGD with momentum).

    ``m = (1 - beta) g + beta m``; ``u = -lr sign(m)`` (no debiasing: a sign does not need it).
    It is ``chain(ema(beta, debias=False, accumulator_dtype=accumulator_dtype),
    scale_by_sign(), scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        beta: the EMA's decay, between 0 and 1.
        accumulator_dtype: the EMA's storage dtype (None: each leaf's).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(EmaState(count, ema), EmptyState(),
            EmptyState())`` (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be), or
            ``accumulator_dtype`` is not a dtype we store.
        ValueError: ``beta`` is not between 0 and 1.

    References:
        Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018
        (arXiv:1802.04434). optax.signum.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2, np.float32)}
        >>> tx = nba.signum(0.1)
        >>> state = nba.step_(tx, {"w": np.array([0.5, -2.0], np.float32)}, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]
        [-0.1, 0.1]
    """
    check_decay(beta, "beta")  # named as the caller knows it (ema calls it decay)
    return chain(
        ema(beta, debias=False, accumulator_dtype=accumulator_dtype),
        scale_by_sign(),
        scale_by_learning_rate(learning_rate),
    )


@state_class
class ScaleByRpropState(NamedTuple):
    """Rprop's state.

    Attributes:
        step_sizes: each element's step size, a FlatTree of the params' layout (starting at the
            learning rate).
        prev_updates: the previous update of each element (``step_size * sign(g)``, or 0 after a
            sign change).
    """

    step_sizes: FlatTree
    prev_updates: FlatTree


@formula(
    states=("step_sizes", "prev_updates"),
    inputs=("g",),
    outputs=("out",),
    scalars=("eta_plus", "eta_minus", "min_step_size", "max_step_size"),
)
def rprop_direction(step_sizes, prev_updates, g, eta_plus, eta_minus, min_step_size, max_step_size):
    """Rprop: ``s = g * prev``; the step grows by ``eta_plus`` where ``s > 0``, shrinks by
    ``eta_minus`` where ``s < 0`` (then clipped to ``[min_step_size, max_step_size]``), stays where
    ``s == 0``; out = prev = 0 where ``s < 0``, else ``step * sign(g)`` (optax's ``jnp.where``s: a
    NaN ``s`` shrinks the step, NaN stays NaN)."""
    s = g * prev_updates
    step = step_sizes
    if s != 0:  # (NaN too: optax clips a NaN s's step)
        step = maximum(step_sizes * (eta_plus if s > 0 else eta_minus), min_step_size)
        if step > max_step_size:
            step = max_step_size
    u = 0.0 if s < 0 else step * sign_of(g)  # +0 after a sign change (optax's zeros_like)
    return step, u, u


class _ScaleByRprop(Elementwise):
    state_cls, fields, formula, name = (
        ScaleByRpropState,
        ("step_sizes", "prev_updates"),
        rprop_direction,
        "scale_by_rprop",
    )
    start_values = {"step_sizes": "learning_rate"}

    def __init__(self, learning_rate: Any, eta_minus: Any, eta_plus: Any, lo: Any, hi: Any) -> None:
        self.learning_rate = real(learning_rate, "learning_rate")
        self.eta_minus, self.eta_plus = real(eta_minus, "eta_minus"), real(eta_plus, "eta_plus")
        self.lo, self.hi = real(lo, "min_step_size"), real(hi, "max_step_size")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.eta_plus, self.eta_minus, self.lo, self.hi)


def scale_by_rprop(
    learning_rate: float,
    eta_minus: float = 0.5,
    eta_plus: float = 1.2,
    min_step_size: float = 1e-6,
    max_step_size: float = 50.0,
) -> GradientTransformationExtraArgs:
    """Rprop's direction: a step size per element that grows while the gradient keeps its sign
    and shrinks when it flips.

    With ``s = g * prev`` (``prev`` the last update): ``step = clip(step * eta_plus, min, max)``
    where ``s > 0``, ``clip(step * eta_minus, min, max)`` where ``s < 0`` (and the update is 0
    there), ``step`` where ``s == 0``; ``u = step * sign(g)``. One fused pass. Real leaves only
    (optax's tests skip complex ones).

    Args:
        learning_rate: the initial step size of every element.
        eta_minus: the factor of a step after a sign change (usually below 1).
        eta_plus: the factor of a step while the sign holds (usually above 1).
        min_step_size: the smallest step.
        max_step_size: the largest step.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByRpropState(step_sizes,
            prev_updates)``, as in optax.

    Raises:
        TypeError: a hyperparameter is not a real number.

    References:
        Riedmiller and Braun, "A Direct Adaptive Method for Faster Backpropagation Learning:
        The RPROP Algorithm", ICNN 1993. optax.scale_by_rprop.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_rprop(0.1)
        >>> g = {"w": np.array([1.0, -1.0])}
        >>> state = tx.init(g)
        >>> for grads in ([1.0, -1.0], [2.0, 1.0]):  # the second element flips its sign
        ...     u, state = tx.update({"w": np.array(grads)}, state)
        >>> u["w"].tolist(), state.step_sizes.tree["w"].tolist()
        ([0.12, 0.0], [0.12, 0.05])
    """
    return _ScaleByRprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size).transformation()


def rprop(
    learning_rate: float,
    eta_minus: float = 0.5,
    eta_plus: float = 1.2,
    min_step_size: float = 1e-6,
    max_step_size: float = 50.0,
) -> GradientTransformationExtraArgs:
    """Rprop (resilient backpropagation): descent by per-element step sizes that adapt to the
    gradient's sign (`scale_by_rprop`), not its size.

    It is ``chain(scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size,
    max_step_size), scale(-1.0))``, one fused pass.

    Args:
        learning_rate: the initial step size of every element.
        eta_minus: as in `scale_by_rprop`.
        eta_plus: as in `scale_by_rprop`.
        min_step_size: as in `scale_by_rprop`.
        max_step_size: as in `scale_by_rprop`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByRpropState(step_sizes,
            prev_updates), EmptyState())``.

    Raises:
        TypeError: a hyperparameter is not a real number.

    References:
        Riedmiller and Braun, "A Direct Adaptive Method for Faster Backpropagation Learning:
        The RPROP Algorithm", ICNN 1993. optax.rprop; torch.optim.Rprop.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.rprop(0.1)
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     state = nba.step_(tx, {"w": np.array([1.0, -1.0])}, state, params)
        >>> params["w"].round(4).tolist()  # -0.1, then -0.12 (the sign held)
        [-0.22, 0.22]
    """
    return chain(
        scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size),
        scale(-1.0),
    )


# --- Adan (issue 26) ----------------------------------------------------------------------------


@state_class
class ScaleByAdanState(NamedTuple):
    """Adan's state (optax's field names).

    Attributes:
        m: the EMA of the gradients, a FlatTree of the params' layout.
        v: the EMA of the gradients' differences ``g - g_prev``.
        n: the EMA of ``|g + (1 - b2) (g - g_prev)|^2``.
        g: the last gradients.
        t: the number of updates so far (int32, saturating), the bias corrections' step.
    """

    m: FlatTree
    v: FlatTree
    n: FlatTree
    g: FlatTree
    t: np.int32


@formula(
    states=("m", "v", "n", "g_prev"),
    inputs=("g",),
    outputs=("out",),
    scalars=(
        "b1",
        "one_minus_b1",
        "b2",
        "one_minus_b2",
        "b3",
        "one_minus_b3",
        "bc1",
        "bc2",
        "bc3",
        "eps",
        "eps_root",
        "zero",
        "first",
    ),
)
def adan_direction(
    m,
    v,
    n,
    g_prev,
    g,
    b1,
    one_minus_b1,
    b2,
    one_minus_b2,
    b3,
    one_minus_b3,
    bc1,
    bc2,
    bc3,
    eps,
    eps_root,
    zero,
    first,
):
    """Adan: ``d = g - g_prev`` (0 at the first step); ``m = (1 - b1) g + b1 m``, ``v = (1 - b2) d
    + b2 v``, ``n = (1 - b3) |g + (1 - b2) d|^2 + b3 n``; out = (m_hat + (1 - b2) v_hat) /
    (sqrt(n_hat + eps_root) + eps), each hat bias-corrected; g_prev = g."""
    d = zero if first else g - g_prev  # ``zero``: a 0 of the compute dtype (a literal is float64)
    mm = one_minus_b1 * g + b1 * m
    vv = one_minus_b2 * d + b2 * v
    nn = one_minus_b3 * abs_sq(g + one_minus_b2 * d) + b3 * re(n)
    out = ((mm / bc1) + one_minus_b2 * (vv / bc2)) / (math.sqrt(nn / bc3 + eps_root) + eps)
    return mm, vv, nn, g, out


class _ScaleByAdan(Elementwise):
    state_cls, fields, formula, name = ScaleByAdanState, ("m", "v", "n", "g"), adan_direction, "scale_by_adan"
    counted, count_field = True, "t"

    def __init__(self, b1: Any, b2: Any, b3: Any, eps: Any, eps_root: Any) -> None:
        self.b1, self.b2, self.b3 = check_decay(b1, "b1"), check_decay(b2, "b2"), check_decay(b3, "b3")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2, b3, t = self.b1, self.b2, self.b3, int(count)
        bcs = (bias_correction(b1, t, ct), bias_correction(b2, t, ct), bias_correction(b3, t, ct))
        return (b1, 1.0 - b1, b2, 1.0 - b2, b3, 1.0 - b3, *bcs, self.eps, self.eps_root, 0.0, t == 1)


def scale_by_adan(
    b1: float = 0.98, b2: float = 0.92, b3: float = 0.99, eps: float = 1e-8, eps_root: float = 0.0
) -> GradientTransformationExtraArgs:
    """Rescales the updates by Adan's three moments (adaptive Nesterov momentum).

    With ``d = g - g_prev`` (0 at the first step): ``m = (1 - b1) g + b1 m``, ``v = (1 - b2) d + b2
    v``, ``n = (1 - b3) (g + (1 - b2) d)^2 + b3 n``, and ``u = (m_hat + (1 - b2) v_hat) /
    (sqrt(n_hat + eps_root) + eps)``, each hat divided by its ``1 - b^t``. One fused pass. Real
    leaves only (optax's tests skip complex ones).

    Args:
        b1: decay of the gradients' EMA, between 0 and 1.
        b2: decay of the differences' EMA, between 0 and 1.
        b3: decay of the second moment, between 0 and 1.
        eps: added to the square root.
        eps_root: added inside the square root.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByAdanState(m, v, n, g, t)``, as
            in optax.

    Raises:
        TypeError: a hyperparameter is not a real number.
        ValueError: ``b1``, ``b2`` or ``b3`` is not between 0 and 1.

    References:
        Xie et al., "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep
        Models", 2022 (arXiv:2208.06677). optax.scale_by_adan.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_adan()
        >>> g = {"w": np.array([0.5, -2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(float(x), 4) for x in u["w"]]  # g / |g| at the first step
        [1.0, -1.0]
    """
    return _ScaleByAdan(b1, b2, b3, eps, eps_root).transformation()


def adan(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.98,
    b2: float = 0.92,
    b3: float = 0.99,
    eps: float = 1e-8,
    eps_root: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """Adan: the adaptive Nesterov momentum optimizer (`scale_by_adan`), with decoupled weight
    decay.

    It is ``chain(scale_by_adan(b1, b2, b3, eps, eps_root), add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_adan`.
        b2: as in `scale_by_adan`.
        b3: as in `scale_by_adan`.
        eps: as in `scale_by_adan`.
        eps_root: as in `scale_by_adan` (Adan's default here is 1e-8, as optax's).
        weight_decay: the decay rate, or a schedule of it.
        mask: which leaves decay (as `add_decayed_weights`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdanState(m, v, n, g, t),
            EmptyState(), EmptyState())`` (``MaskedState`` for a masked decay,
            ``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).
        ValueError: ``b1``, ``b2`` or ``b3`` is not between 0 and 1.

    References:
        Xie et al., "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep
        Models", 2022 (arXiv:2208.06677). optax.adan.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.adan(0.1)
        >>> state = nba.step_(tx, {"w": np.array([0.5, -2.0])}, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]
        [-0.1, 0.1]
    """
    return chain(
        scale_by_adan(b1, b2, b3, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def fromage(learning_rate: ScalarOrSchedule, min_norm: float = 1e-6) -> GradientTransformationExtraArgs:
    """Fromage: Frobenius matched gradient descent, each leaf's step scaled to its params' norm.

    ``u = -lr / sqrt(1 + lr^2) * g * max(||p||, min_norm) / max(||g||, min_norm) - (1 - 1 /
    sqrt(1 + lr^2)) p`` per leaf: ``chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(lr
    * m), add_decayed_weights(m - 1))`` with ``m = 1 / sqrt(1 + lr^2)``, as optax builds it (a
    schedule gives ``m`` of the scheduled rate). The per-leaf norms come from one segmented pass
    of the reduction engine (`scale_by_trust_ratio`).

    Args:
        learning_rate: a float, or a schedule of the step count.
        min_norm: the smallest norm either ratio term takes (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(EmptyState(), EmptyState(),
            EmptyState())`` (``ScaleByScheduleState`` in the middle with a schedule).

    Raises:
        TypeError: ``learning_rate`` is neither a real number nor a callable, or ``min_norm`` is
            not a real number.

    References:
        Bernstein et al., "On the distance between two neural networks and the stability of
        learning", NeurIPS 2020 (arXiv:2002.03432). optax.fromage.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([3.0, 4.0])}  # norm 5
        >>> tx = nba.fromage(0.75)  # m = 0.8
        >>> state = nba.step_(tx, {"w": np.array([0.0, 2.0])}, tx.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]  # 0.8 * (p - 0.75 * g * 5 / 2)
        [2.4, 0.2]
    """
    if not callable(learning_rate):
        lr = real(learning_rate, "learning_rate")
        mult = 1.0 / math.hypot(1.0, lr)  # optax's 1 / (1 + lr^2)^0.5, finite for any finite lr
        return chain(
            scale_by_trust_ratio(min_norm),
            scale_by_learning_rate(lr * mult),
            add_decayed_weights(mult - 1.0),
        )
    schedule = learning_rate

    def mult_of(count: Any) -> Any:
        return 1.0 / np.hypot(1.0, real(schedule(count), "learning_rate"))

    return chain(
        scale_by_trust_ratio(min_norm),
        scale_by_learning_rate(lambda count: mult_of(count) * schedule(count)),
        add_decayed_weights(lambda count: mult_of(count) - 1.0),
    )


@state_class
class ScaleByOptimisticGradientState(NamedTuple):
    """The optimistic gradient's state (optax's fields).

    Attributes:
        is_initial_step: True until the first update (a NumPy bool).
        previous_gradient: the last update this stage received, a FlatTree of the params'
            layout.
    """

    is_initial_step: np.bool_
    previous_gradient: FlatTree


@formula(
    states=("previous_gradient",),
    inputs=("g",),
    outputs=("out",),
    scalars=("alpha_plus_beta", "beta", "first"),
)
def optimistic_direction(previous_gradient, g, alpha_plus_beta, beta, first):
    """Optimistic gradient: out = (alpha + beta) g - beta g_prev, with g_prev = g at the first
    step (optax's issue #1082); g_prev = g."""
    prev = g if first else previous_gradient
    return g, alpha_plus_beta * g - beta * prev


class _ScaleByOptimisticGradient(Elementwise):
    state_cls, fields, formula, name = (
        ScaleByOptimisticGradientState,
        ("previous_gradient",),
        optimistic_direction,
        "scale_by_optimistic_gradient",
    )
    complex_leaves = True  # optax defines it on complex leaves
    counted, count_field = True, "is_initial_step"  # a flag, not a count: see `advance`
    count_start = np.bool_(True)

    def __init__(self, alpha: Any, beta: Any) -> None:
        self.alpha, self.beta = real(alpha, "alpha"), real(beta, "beta")

    def advance(self, count: Any) -> tuple[np.bool_, bool]:
        return np.bool_(False), bool(count)  # the scalars read whether this is the first step

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.alpha + self.beta, self.beta, count)


def scale_by_optimistic_gradient(alpha: float = 1.0, beta: float = 1.0) -> GradientTransformationExtraArgs:
    """Generalized optimistic gradients: the update minus ``beta`` times its change.

    ``u = (alpha + beta) g_t - beta g_{t-1}``, with ``g_{t-1} = g_t`` at the first step (so ``u =
    alpha g``, as optax since its issue #1082); ``alpha + beta`` is summed in float64 and cast once.
    One fused pass; the state keeps the last update.

    Args:
        alpha: the coefficient of the generalized optimistic gradient.
        beta: the coefficient of the negative momentum.

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``ScaleByOptimisticGradientState(is_initial_step, previous_gradient)``, as in optax.

    Raises:
        TypeError: ``alpha`` or ``beta`` is not a real number (optax's adds a schedule to a
            number and fails too).

    References:
        Daskalakis et al., "Training GANs with Optimism", ICLR 2018 (arXiv:1711.00141); Mokhtari
        et al., "A Unified Analysis of Extra-gradient and Optimistic Gradient Methods for Saddle
        Point Problems", 2019 (arXiv:1901.08511). optax.scale_by_optimistic_gradient.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_optimistic_gradient(alpha=1.0, beta=0.5)
        >>> state = tx.init({"w": np.zeros(2)})
        >>> u, state = tx.update({"w": np.array([1.0, 2.0])}, state)
        >>> u["w"]  # the first step: alpha * g
        array([1., 2.])
        >>> u, state = tx.update({"w": np.array([3.0, 2.0])}, state)
        >>> u["w"]  # 1.5 * g - 0.5 * g_prev
        array([4., 2.])
    """
    return _ScaleByOptimisticGradient(alpha, beta).transformation()


def optimistic_gradient_descent(
    learning_rate: ScalarOrSchedule, alpha: float = 1.0, beta: float = 1.0
) -> GradientTransformationExtraArgs:
    """Optimistic gradient descent, for min-max games where plain descent cycles.

    ``w_{t+1} = w_t - lr ((alpha + beta) g_t - beta g_{t-1})``: ``chain(scale_by_optimistic_gradient(alpha,
    beta), scale_by_learning_rate(learning_rate))``, one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        alpha: as in `scale_by_optimistic_gradient`.
        beta: as in `scale_by_optimistic_gradient`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``(ScaleByOptimisticGradientState(is_initial_step, previous_gradient), EmptyState())``
            (``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).

    References:
        Mokhtari et al., "A Unified Analysis of Extra-gradient and Optimistic Gradient Methods
        for Saddle Point Problems: Proximal Point Approach", AISTATS 2020 (arXiv:1901.08511).
        optax.optimistic_gradient_descent.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"x": np.array(1.0), "y": np.array(1.0)}  # min_x max_y x * y
        >>> tx = nba.optimistic_gradient_descent(0.1)
        >>> state = tx.init(params)
        >>> for _ in range(2000):
        ...     grads = {"x": params["y"].copy(), "y": -params["x"]}  # descend x, ascend y
        ...     state = nba.step_(tx, grads, state, params)
        >>> bool(abs(params["x"]) < 1e-3 and abs(params["y"]) < 1e-3)  # the saddle point
        True
    """
    return chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate))


def optimistic_adam(
    learning_rate: float,
    optimism: float | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
) -> GradientTransformationExtraArgs:
    """Optimistic Adam (deprecated in optax for `optimistic_adam_v2`, whose arguments are named).

    ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
    scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism), scale_by_learning_rate(1.0))``:
    the rate enters as the optimistic ``alpha`` (``optimism`` defaults to it), one fused pass.

    Args:
        learning_rate: a float (a schedule is refused, as optax does: use `optimistic_adam_v2`).
        optimism: the optimistic ``beta``; None: ``learning_rate``.
        b1: as in `scale_by_adam`.
        b2: as in `scale_by_adam`.
        eps: as in `scale_by_adam`.
        eps_root: as in `scale_by_adam`.
        mu_dtype: as in `scale_by_adam`.
        nesterov: as in `scale_by_adam` (True here, as optax's).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            ScaleByOptimisticGradientState(is_initial_step, previous_gradient), EmptyState())``.

    Raises:
        ValueError: ``learning_rate`` is a schedule.
        TypeError: a hyperparameter is not a real number.

    Warns:
        DeprecationWarning: as optax's.

    References:
        Daskalakis et al., "Training GANs with Optimism", ICLR 2018 (arXiv:1711.00141).
        optax.optimistic_adam.

    Examples:
        >>> import warnings, numpy as np, numbaccum as nba
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     tx = nba.optimistic_adam(0.1)
        >>> u, _ = tx.update({"w": np.array([2.0])}, tx.init({"w": np.zeros(1)}))
        >>> u["w"]  # alpha = 0.1 times NAdam's first direction (1.4737), the sign flipped
        array([-0.14736842])
    """
    import warnings

    warnings.warn(
        "`optimistic_adam` is deprecated, please use `optimistic_adam_v2` instead.",
        DeprecationWarning,
        stacklevel=2,
    )
    if callable(learning_rate):
        raise ValueError(
            "optimistic_adam: learning_rate must be a number, not a schedule (as optax's): "
            "optimistic_adam_v2 takes one"
        )
    learning_rate = real(learning_rate, "learning_rate")
    optimism = learning_rate if optimism is None else real(optimism, "optimism")
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism),
        scale_by_learning_rate(1.0),  # flips the sign
    )


def optimistic_adam_v2(
    learning_rate: ScalarOrSchedule,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    nesterov: bool = True,
) -> GradientTransformationExtraArgs:
    """Optimistic Adam: Adam's (Nesterov) direction through an optimistic gradient.

    ``chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
    scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate))``: ``d_t`` =
    Adam's direction, ``u = -lr ((alpha + beta) d_t - beta d_{t-1})``; one fused pass.

    Args:
        learning_rate: a float, or a schedule of the step count.
        alpha: as in `scale_by_optimistic_gradient`.
        beta: as in `scale_by_optimistic_gradient`.
        b1: as in `scale_by_adam`.
        b2: as in `scale_by_adam`.
        eps: as in `scale_by_adam`.
        eps_root: as in `scale_by_adam`.
        mu_dtype: as in `scale_by_adam`.
        nesterov: as in `scale_by_adam` (True here, as optax's).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByAdamState(count, mu, nu),
            ScaleByOptimisticGradientState(is_initial_step, previous_gradient), EmptyState())``
            (``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).
        ValueError: ``b1`` or ``b2`` is not between 0 and 1.

    References:
        Daskalakis et al., "Training GANs with Optimism", ICLR 2018 (arXiv:1711.00141).
        optax.optimistic_adam_v2.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"x": np.array(1.0), "y": np.array(2.0)}  # min_x max_y x * y (optax's example)
        >>> tx = nba.optimistic_adam_v2(1.0, alpha=1e-2, beta=1.0)
        >>> state = tx.init(params)
        >>> distances = []
        >>> for _ in range(1025):
        ...     distances.append(float(np.hypot(params["x"], params["y"])))  # to the saddle point
        ...     grads = {"x": params["y"].copy(), "y": -params["x"]}  # descend x, ascend y
        ...     state = nba.step_(tx, grads, state, params)
        >>> [round(distances[4**i], 3) for i in range(6)]  # optax's float32: 0.796 for 0.795
        [2.243, 2.195, 2.161, 2.055, 0.795, 0.001]
    """
    return chain(
        scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
        scale_by_optimistic_gradient(alpha, beta),
        scale_by_learning_rate(learning_rate),
    )


def polyak_sgd(
    max_learning_rate: float = 1.0,
    scaling: ScalarOrSchedule = 1.0,
    f_min: float = 0.0,
    eps: float = 0.0,
    variant: str = "sps",
) -> GradientTransformationExtraArgs:
    """SGD with Polyak's step size: each step as long as the objective's gap over its gradient.

    ``chain(sgd(scaling), scale_by_polyak(f_min, max_learning_rate, eps, variant))``, as optax
    builds it: with ``d = -scaling * g``, ``u = d * min((f - f_min) / (||d||^2 + eps),
    max_learning_rate)`` (``scaling = 1``: Polyak's ``-g (f - f*) / ||g||^2``). ``update`` needs
    the keyword ``value``, the objective at the params.

    Args:
        max_learning_rate: the largest step size.
        scaling: a float, or a schedule of the step count, scaling the gradient first.
        f_min: a lower bound on the objective (0 for models that interpolate the data).
        eps: added to the squared norm (``>= 0``).
        variant: ``'sps'`` or ``'sps+'`` (the gap clipped at 0).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``((EmptyState(), EmptyState()),
            EmptyState())`` (``ScaleByScheduleState`` with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be); at
            ``update``, ``value`` is missing or not a real scalar.
        ValueError: ``eps`` is negative or ``variant`` unknown.

    References:
        Loizou et al., "Stochastic Polyak Step-size for SGD: An Adaptive Learning Rate for Fast
        Convergence", AISTATS 2021 (arXiv:2002.10542). optax.polyak_sgd.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"x": np.array([1.0, 2.0, 3.0])}  # f = sum x^2, min 0
        >>> tx = nba.polyak_sgd()
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     value, grads = float(np.sum(params["x"] ** 2)), {"x": 2 * params["x"]}
        ...     state = nba.step_(tx, grads, state, params, value=value)
        ...     print(float(np.sum(params["x"] ** 2)))
        3.5
        0.875
        0.21875
    """
    return chain(sgd(learning_rate=scaling), scale_by_polyak(f_min, max_learning_rate, eps, variant))


@state_class
class ScaleByNovogradState(NamedTuple):
    """NovoGrad's state (optax's fields).

    Attributes:
        count: the number of updates so far (int32, saturating).
        mu: the first moment of the normalised gradients, a FlatTree of the params' layout
            (in ``mu_dtype``).
        nu: a tree of the params' structure with one 0-d array per leaf, in the leaf's dtype:
            the EMA of the leaf's squared gradient norm.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: FlatTree
    nu: Any = None  # (None only inside `scale_by_novograd.init`)


@formula(states=("mu",), inputs=("g", "params"), outputs=("out",), scalars=("b1", "weight_decay", "first"))
def novograd_moment(mu, g, params, b1, weight_decay, first):
    """NovoGrad's moment of the normalised gradient ``g`` (already divided by its leaf's
    ``sqrt(nu + eps_root) + eps``): a = g + wd p; mu = a at the first step, else b1 mu + a;
    out = mu."""
    a = g + weight_decay * params
    m = a if first else b1 * mu + a
    return m, m


class _NovogradMoment(Elementwise):
    """The elementwise half of `scale_by_novograd` (the per-leaf norms are the other)."""

    state_cls, fields, formula, name = ScaleByNovogradState, ("mu",), novograd_moment, "scale_by_novograd"
    dtype_options = {"mu": "mu_dtype"}
    counted, inputs = True, ("params",)

    def __init__(self, b1: float, weight_decay: float, mu_dtype: Any) -> None:
        self.b1, self.weight_decay, self.mu_dtype = b1, weight_decay, mu_dtype

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.b1, self.weight_decay, int(count) == 1)


class _ScaleByNovograd(Stage):
    """`scale_by_novograd`: each leaf's squared norm (one segmented reduction per dtype group),
    its ``nu`` and divisor on the host (one number per leaf), one segmented division pass, then
    the moment's fused pass."""

    scope = LEAF
    complex_leaves = True  # optax's: norms of |g|, a complex moment
    public_name = "scale_by_novograd"

    def __init__(self, b1: Any, b2: Any, eps: Any, eps_root: Any, weight_decay: Any, mu_dtype: Any) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.moment = _NovogradMoment(self.b1, real(weight_decay, "weight_decay"), _mu_dtype(mu_dtype))

    def init(self, params: Any) -> ScaleByNovogradState:
        moment = self.moment.init(params)
        layout = moment.mu.layout
        nu = [np.zeros((), layout.dtypes[i]) for i in range(layout.num_leaves)]
        return ScaleByNovogradState(moment.count, moment.mu, tree_unflatten(layout.treedef, nu))

    def owner(self, state: Any) -> FlatTree | None:
        return self.moment.owner(state)

    def declare(self, spec: Spec, state: Any) -> Host:
        """One `numbaccum.fuse.Host`: the per-leaf norms and divisions, then the moment's kernel
        (declared once, run as its own pass: `numbaccum.fuse.FusedRun`)."""
        moment = self.moment.declare(spec, state)  # checks the state's type and mu
        moment_tick = moment.tick
        assert moment_tick is not None  # (set by the declare)
        kernel = FusedRun([moment])
        b2, eps, eps_root, lay = self.b2, self.eps, self.eps_root, spec.layout
        mu = moment.states[0]
        buffers = (("mu", mu.__dict__),)
        dtypes = [compute_dtype(d) for d in lay.group_dtypes]
        reals = [real_dtype(d).type for d in lay.dtypes]  # each leaf's nu is of its real dtype
        # Per group: its leaves' table and members, and the real dtype of its quotients; the
        # divisions kept for the buffers they last ran on.
        groups = list(zip(leaf_tables(lay), lay.group_index, map(real_dtype, dtypes)))
        divisions = Reductions()
        normalized_of = mu.workspace_of("normalized", dtypes)  # (mu's storage: the tick holds it)
        treedef, name = lay.treedef, self.public_name
        step: list = [None, False]  # this step's old nu (checked) and whether it is the first

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not holds(state, ScaleByNovogradState, buffers):
                return False
            if params is None:
                raise ValueError(f"{name} needs params: call update(updates, state, params)")
            step[0] = _leaf_scalars(state.nu, lay, "state.nu")
            if not moment_tick(state, params, extra):  # the count and mu renewed, the params read
                return False
            step[1] = int(moment.new_state.count) == 1
            return True

        def run(u: Updates) -> tuple[Updates, ScaleByNovogradState]:
            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            nu, first = step
            sq = leaf_sumsq(u.flat)  # float64, one pass per group
            new_nu, divisors = [], np.empty(len(nu), np.float64)
            with np.errstate(over="ignore", invalid="ignore"):
                # Host numbers, one per leaf, in the leaf's dtype as optax's; a complex leaf's in
                # its real dtype (its sum is of |g|^2), kept with an imaginary part of +0 as
                # optax keeps it: its division of g by a complex of +0 imaginary part is a real one.
                for i, old in enumerate(nu):
                    t = reals[i]
                    n = t(sq[i]) if first else t(1.0 - b2) * t(sq[i]) + t(b2) * old.real
                    new_nu.append(np.asarray(n, old.dtype))
                    divisors[i] = np.sqrt(n + t(eps_root)) + t(eps)
            # g / divisor in the compute dtype: float16 and bfloat16 leaves keep float32 quotients
            # for the moment's pass (its ``+ wd p`` may cancel them).
            normalized = normalized_of()
            for gi, ((table, members, rt), o, g) in enumerate(zip(groups, normalized.groups, u.flat.groups)):
                divisions.call(gi, prepare_divide, (o, g, table), ONE, divisors[members].astype(rt))
            spare = lambda: Updates(normalized, False).fresh()  # noqa: E731  (the moment has its output)
            out, factor, (new_state,) = kernel.run(normalized, ONE, spare)
            return Updates(out, True, factor), new_state._replace(nu=tree_unflatten(treedef, new_nu))

        # a reduction of each leaf's squares, the division pass, then the moment's pass (reads
        # the quotients, mu and the params; writes mu and the updates)
        passes = (
            ("reduction", "leaf norms", 1.0, 0.0),
            ("kernel", "divide", 1.0, 1.0),
            ("kernel", "moment", 3.0, 2.0),
        )
        part = Host(run, passes, name, tick)
        return part


def _leaf_scalars(
    tree: Any, layout: Any, name: str, dtypes: Any = None, shape: tuple = ()
) -> list[np.ndarray]:
    """The arrays of ``tree``, one of ``shape`` (0-d by default) per leaf of ``layout``, each in
    its ``dtypes[i]`` (None: the leaf's own dtype), checked."""
    what = "0-d" if shape == () else f"shape-{shape}"
    try:
        leaves, td = tree_flatten(tree)
    except TypeError:
        leaves, td = [], None
    if td != layout.treedef:
        raise ValueError(f"{name}: not a tree of the params' structure (one {what} array per leaf)")
    out = []
    for i, x in enumerate(leaves):
        a = np.asarray(x)
        want = layout.dtypes[i] if dtypes is None else dtypes[i]
        if a.shape != shape or a.dtype != want:
            raise ValueError(f"{name}{layout.path(i, '')}: expected a {what} {want}, got {a.dtype}{a.shape}")
        out.append(a)
    return out


def scale_by_novograd(
    b1: float = 0.9,
    b2: float = 0.25,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    mu_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """Rescales the updates by NovoGrad's layer-wise second moment.

    Per leaf: ``nu = ||g||^2`` at the first step, then ``nu = (1 - b2) ||g||^2 + b2 nu``; per
    element: ``a = g / (sqrt(nu + eps_root) + eps) + weight_decay p``, ``mu = a`` at the first step,
    then ``mu = b1 mu + a``; ``u = mu``. The squared norms come from one segmented reduction of
    the reduction engine (float64, then the leaf's dtype), the division from one segmented pass,
    the moment from one fused pass. Complex leaves as optax: ``||g||^2`` is the sum of ``|g|^2``,
    ``nu`` is kept in the leaf's complex dtype with an imaginary part of 0, ``mu`` is complex.

    Args:
        b1: decay of the first moment, between 0 and 1.
        b2: decay of the squared norms' EMA, between 0 and 1.
        eps: added to the square root.
        eps_root: added inside the square root.
        weight_decay: added ``weight_decay * p`` (needs params).
        mu_dtype: storage dtype of ``mu`` (None: each leaf's).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByNovogradState(count, mu,
            nu)``, as in optax (``nu``: one 0-d array per leaf).

    Raises:
        TypeError: a hyperparameter is not a real number, or ``mu_dtype`` not a float dtype.
        ValueError: ``b1`` or ``b2`` is not between 0 and 1; at an update, no params.

    References:
        Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments for
        Training of Deep Networks", 2019 (arXiv:1905.11286). optax.scale_by_novograd.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_novograd()
        >>> g = {"w": np.array([3.0, 4.0])}
        >>> u, state = tx.update(g, tx.init(g), g)
        >>> [round(float(x), 4) for x in u["w"]]  # g / ||g|| at the first step
        [0.6, 0.8]
        >>> float(state.nu["w"])
        25.0
    """
    return _ScaleByNovograd(b1, b2, eps, eps_root, weight_decay, mu_dtype).transformation()


def novograd(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.25,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
) -> GradientTransformationExtraArgs:
    """NovoGrad: layer-wise normalised gradients with momentum.

    ``chain(scale_by_novograd(b1, b2, eps, eps_root, weight_decay), scale_by_learning_rate(lr))``
    (the rate rides on the moment's pass).

    Args:
        learning_rate: a float, or a schedule of the step count.
        b1: as in `scale_by_novograd`.
        b2: as in `scale_by_novograd`.
        eps: as in `scale_by_novograd` (1e-6 here, as optax's).
        eps_root: as in `scale_by_novograd`.
        weight_decay: as in `scale_by_novograd`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByNovogradState(count, mu,
            nu), EmptyState())`` (``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be).
        ValueError: ``b1`` or ``b2`` is not between 0 and 1; at an update, no params.

    References:
        Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments for
        Training of Deep Networks", 2019 (arXiv:1905.11286). optax.novograd.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"x": np.array([1.0, 2.0, 3.0])}
        >>> tx = nba.novograd(learning_rate=0.003)
        >>> state = tx.init(params)
        >>> for _ in range(5):
        ...     state = nba.step_(tx, {"x": 2 * params["x"]}, state, params)
        >>> print(f"{float(np.sum(params['x'] ** 2)):.2f}")  # 14 before
        13.71
    """
    return chain(
        scale_by_novograd(b1, b2, eps, eps_root, weight_decay),
        scale_by_learning_rate(learning_rate),
    )


@state_class
class ScaleByDistanceOverGradientsState(NamedTuple):
    """DoG's state (optax's fields).

    Attributes:
        max_dist: a tree of the params' structure with one 0-d array per leaf: the largest
            distance ``||p - p0||`` seen so far (``reps_rel * (1 + ||p0||)`` at first), in the
            dtype that distance is computed in (the leaf's and ``param_dtype`` promoted, float16
            and bfloat16 computed in float32).
        grad_sum_of_squares: a tree of the params' structure with one shape-(1,) array per leaf:
            the sum over the steps of the leaf's squared gradient norm (float32; float64 for
            float64 leaves).
        init_params: the params ``init`` was given, a FlatTree of their layout stored in
            ``param_dtype`` (each leaf's own dtype when it is None).
    """

    max_dist: Any
    grad_sum_of_squares: Any
    init_params: FlatTree


class _ScaleByDistanceOverGradients(Stage):
    """`scale_by_distance_over_gradients`: ``p - p0`` written into a workspace kept by
    ``init_params`` (one `Ops.add_scaled_` pass per dtype group: the contract has no segmented
    reduction of a difference of two buffers), then two segmented reductions per group (that
    difference's squared norms and the updates'), each leaf's step size on the host (NumPy over
    the group's leaves), and one per-leaf scaling pass."""

    public_name = "scale_by_distance_over_gradients"

    def __init__(self, reps_rel: Any, eps: Any, param_dtype: Any, global_scale: Any) -> None:
        self.reps_rel = non_negative(reps_rel, "reps_rel")
        self.eps = non_negative(eps, "eps")
        self.param_dtype = None if param_dtype is None else check_float_dtype(param_dtype, "param_dtype")
        self.global_scale = real(global_scale, "global_scale")

    def _store_dtypes(self, layout: Any) -> list[np.dtype]:
        """Per group: the storage dtype of ``init_params`` (complex groups keep their own: the
        update refuses them, but ``init`` takes every tree)."""
        pd = self.param_dtype
        return [d if pd is None or d.kind == "c" else pd for d in layout.group_dtypes]

    @staticmethod
    def _dtypes(layout: Any, stored: Any) -> tuple[list[np.dtype], list[np.dtype]]:
        """Per group: the dtype of the distances (and of ``p - p0``) and of the gradients' sum of
        squares, for ``init_params`` stored in ``stored``."""
        dist = [compute_dtype(real_dtype(d), real_dtype(s)) for d, s in zip(layout.group_dtypes, stored)]
        sos = [compute_dtype(real_dtype(d)) for d in layout.group_dtypes]
        return dist, sos

    def init(self, params: Any) -> ScaleByDistanceOverGradientsState:
        layout, device = layout_and_device(params, "params")
        src = params if isinstance(params, FlatTree) else as_flat(params, layout, "params", device=device)[0]
        stored = self._store_dtypes(layout)
        init_params = FlatTree.empty(layout, stored, device)
        for o, p in zip(init_params.groups, src.groups):
            ops_for(o).scale_(o, p, ONE)  # a copy, cast to param_dtype
        sq = leaf_reductions(src, Ops.segment_sumsq)  # ||p0||^2 of the params as given, float64
        dist, sos = self._dtypes(layout, stored)
        max_dist: list[Any] = [None] * layout.num_leaves
        sums: list[Any] = [None] * layout.num_leaves
        with np.errstate(over="ignore", invalid="ignore"):
            for members, dt, st in zip(layout.group_index, dist, sos):
                t = dt.type
                first = t(self.reps_rel) * (t(1.0) + np.sqrt(sq[members].astype(dt)))
                for j, i in enumerate(members):
                    max_dist[i] = np.array(first[j])
                    sums[i] = np.zeros(1, st)
        treedef = layout.treedef
        return ScaleByDistanceOverGradientsState(
            tree_unflatten(treedef, max_dist), tree_unflatten(treedef, sums), init_params
        )

    def owner(self, state: Any) -> FlatTree | None:
        ok = isinstance(state, ScaleByDistanceOverGradientsState) and isinstance(state.init_params, FlatTree)
        return state.init_params if ok else None

    def declare(self, spec: Spec, state: Any) -> Host:
        """One `numbaccum.fuse.Host` over ``state``'s ``init_params`` (checked here); the
        dtypes and tables are the layout's, found once."""
        init = expect_state(state, ScaleByDistanceOverGradientsState, "init_params", spec, renew=False)
        buffers = (("init_params", init.__dict__),)
        lay = spec.layout
        dist, sos = self._dtypes(lay, init.group_dtypes)
        leaf_dist = [dist[g] for g in lay.leaf_group]
        leaf_sos = [sos[g] for g in lay.leaf_group]
        scale, eps, treedef, name = self.global_scale, self.eps, lay.treedef, self.public_name
        # Per group: its backend, leaves and table, the dtypes of its distances, sums and step
        # sizes, and one float64 step size per leaf (filled each step).
        groups = [
            (members, table, dt, st, np.promote_types(dt, st))
            for members, table, dt, st in zip(lay.group_index, leaf_tables(lay), dist, sos)
        ]
        launches, scalings = Launches(), Reductions()  # kept for the buffers they last ran on
        step: list = [None] * 4  # this step's params, old distances and sums, init_params renewed

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not holds(state, ScaleByDistanceOverGradientsState, buffers):
                return False
            if params is None:
                raise ValueError(f"{name} needs params: call update(updates, state, params)")
            new_init = current(state.init_params, "init_params")
            old_dist = _leaf_scalars(state.max_dist, lay, "state.max_dist", leaf_dist)
            old_sos = _leaf_scalars(state.grad_sum_of_squares, lay, "state.grad_sum_of_squares", leaf_sos, (1,))
            # (float64 holds every float32 and float64 value exactly: one array for all the groups)
            step[0], step[3] = params, new_init
            step[1] = np.array(old_dist, np.float64)
            step[2] = np.array(old_sos, np.float64).reshape(-1)
            return True

        def run(u: Updates) -> tuple[Updates, ScaleByDistanceOverGradientsState]:
            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            params, old_d, old_s, new_init = step
            pf = params.flat()
            diff = init.workspace("distance", dist)
            for gi, (o, p, p0) in enumerate(zip(diff.groups, pf.groups, init.groups)):
                launches.run(F.add_scaled, gi, [p, p0, o], ONE, (-1.0,))  # p - p0, in the distance's dtype
            dist_sq = leaf_sumsq(diff)  # float64, one pass per group
            grad_sq = leaf_sumsq(u.flat)
            out = u.fresh()
            new_dist: list[Any] = [None] * lay.num_leaves
            new_sos: list[Any] = [None] * lay.num_leaves
            for gi, ((members, table, dt, st, et), o, g) in enumerate(zip(groups, out.groups, u.flat.groups)):
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    # optax's per leaf: d = max(d, ||p - p0||); s += sum(g^2); eta = c (d / sqrt(s + eps))
                    d = np.maximum(old_d[members].astype(dt), np.sqrt(dist_sq[members].astype(dt)))
                    s = old_s[members].astype(st) + grad_sq[members].astype(st)
                    eta = et.type(scale) * (d.astype(et) / np.sqrt(s.astype(et) + et.type(eps)))
                # eta * g in float64, rounded once to the leaf's dtype (float32 * float32 exactly
                # as a float32 product)
                scalings.apply_(gi, o, g, table, None, eta.astype(np.float64))
                for j, i in enumerate(members):
                    new_dist[i] = np.array(d[j])
                    new_sos[i] = s[j : j + 1].copy()
            new_state = ScaleByDistanceOverGradientsState(
                tree_unflatten(treedef, new_dist), tree_unflatten(treedef, new_sos), new_init
            )
            return Updates(out, True), new_state

        # p - p0 (reads both, writes the distance), its leaf norms and the updates' (two
        # reductions), then the scaling pass
        passes = (
            ("kernel", "distance", 2.0, 1.0),
            ("reduction", "leaf norms of the distance and the updates", 2.0, 0.0),
            ("kernel", "scale", 1.0, 1.0),
        )
        part = Host(run, passes, name, tick)
        return part


def scale_by_distance_over_gradients(
    reps_rel: float = 1e-6, eps: float = 1e-8, param_dtype: Any = np.float32, global_scale: float = 1.0
) -> GradientTransformationExtraArgs:
    """Distance over gradients (DoG), the learning-rate-free step size, per leaf ("layer-wise
    DoG", LDoG).

    Per leaf, with ``p0`` the params ``init`` was given (kept in ``param_dtype``):
    ``max_dist = max(max_dist, ||p - p0||)`` (``reps_rel * (1 + ||p0||)`` at first, so that the
    first steps are not zero), ``grad_sum_of_squares += ||g||^2`` and
    ``u = global_scale * (max_dist / sqrt(grad_sum_of_squares + eps)) * g``. ``p - p0`` is
    written into a workspace of the state (one pass per dtype group), both squared norms come
    from segmented reductions of the reduction engine (float64, then rounded to the state's
    dtype), each leaf's step size from NumPy on the host, and the scaling from one pass. Real
    leaves only (optax squares complex gradients without their conjugate). Needs ``params``.

    Differences from optax: a 0-d leaf's update keeps its shape (optax's is of shape (1,), its
    step size's), and float16 and bfloat16 leaves keep their dtype (optax's updates are
    float32); ``max_dist`` is kept from the first step in the dtype optax's takes after the
    first update (float32 for float16 and bfloat16 leaves, where optax's init gives the leaf's
    dtype). ``param_dtype=None`` keeps each leaf's dtype (optax's ``tree.cast`` to None).

    Args:
        reps_rel: the initial distance relative to ``1 + ||p0||`` (the paper recommends 1e-4
            for models with batch norm, 1e-6 otherwise); ``>= 0``.
        eps: added to the gradients' sum of squares inside the square root; ``>= 0``.
        param_dtype: the dtype ``init_params`` is stored in (a float dtype; None: each leaf's).
        global_scale: multiplies every step size (1.0; -1.0 for a descent direction).

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``ScaleByDistanceOverGradientsState(max_dist, grad_sum_of_squares, init_params)``,
            as in optax (one 0-d ``max_dist`` and one shape-(1,) ``grad_sum_of_squares`` per
            leaf; ``init_params`` a FlatTree).

    Raises:
        TypeError: a hyperparameter is not a real number, ``param_dtype`` not a float dtype; at
            an update, complex leaves, or a state that is not this transformation's.
        ValueError: ``reps_rel`` or ``eps`` is negative or NaN; at an update, no params, or a
            state of other leaves (its layout, ``max_dist`` or ``grad_sum_of_squares``).

    References:
        Ivgi et al., "DoG is SGD's Best Friend: A Parameter-Free Dynamic Step Size Schedule",
        ICML 2023 (arXiv:2302.12022). optax.scale_by_distance_over_gradients.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([3.0, 4.0])}
        >>> tx = nba.scale_by_distance_over_gradients(global_scale=-1.0)  # a descent direction
        >>> state = tx.init(params)
        >>> float(state.max_dist["w"])  # reps_rel * (1 + ||p0||)
        6e-06
        >>> for _ in range(100):
        ...     state = nba.step_(tx, {"w": 2 * params["w"]}, state, params)  # grad of ||w||^2
        >>> print(f"{float(np.sum(params['w'] ** 2)):.4f}")  # 25 before, no learning rate
        0.0620
        >>> print(f"{float(state.max_dist['w']):.2f}")  # the distance travelled, the step size
        4.72
    """
    return _ScaleByDistanceOverGradients(reps_rel, eps, param_dtype, global_scale).transformation()
