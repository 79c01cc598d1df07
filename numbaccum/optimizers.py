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
from ._checks import flag, real
from .accumulation import trace
from .base import chain
from .declared import Elementwise, bias_correction, check_decay, safe_increment
from .flat import FlatTree
from .formulas import formula, maximum, sqrt
from .layout import check_float_dtype
from .protocol import GradientTransformationExtraArgs
from .scaling import ScalarOrSchedule, add_decayed_weights, identity, scale_by_learning_rate

__all__ = [
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByLionState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByRssState",
    "adabelief",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "amsgrad",
    "lion",
    "nadam",
    "nadamw",
    "rmsprop",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_lion",
    "scale_by_nadam",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_sign",
    "scale_by_stddev",
    "scale_by_yogi",
    "sgd",
    "sign_sgd",
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
    v = one_minus_b2 * (g * g) + b2 * nu
    return m, v, (m / bc1) / (math.sqrt(v / bc2 + eps_root) + eps)


class _ScaleByAdam(Elementwise):
    """`scale_by_adam`, declared: Adam's moments and direction in one formula."""

    formula, state_cls, fields, counted, name = (
        adam_direction,
        ScaleByAdamState,
        ("mu", "nu"),
        True,
        "scale_by_adam",
    )

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
        b1: decay rate of the first moment, in [0, 1].
        b2: decay rate of the second moment, in [0, 1].
        eps: added outside the square root.
        eps_root: added inside the square root.
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
    v = one_minus_b2 * (g * g) + b2 * nu
    m_hat = b1 * (m / bc1_next) + one_minus_b1 * (g / bc1)
    return m, v, m_hat / (math.sqrt(v / bc2 + eps_root) + eps)


class _ScaleByNadam(_Direction):
    state_cls, fields, formula, name = (
        ScaleByAdamState,
        ("mu", "nu"),
        nadam_direction,
        "scale_by_adam(nesterov)",
    )

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


class ScaleByAmsgradState(NamedTuple):
    """AMSGrad's step count, moments and running maximum of the corrected second moment."""

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    mu: FlatTree
    nu: FlatTree
    nu_max: FlatTree


class ScaleByBeliefState(NamedTuple):
    """AdaBelief's step count, first moment and second central moment."""

    count: np.int32  # type: ignore[assignment]
    mu: FlatTree
    nu: FlatTree


class ScaleByLionState(NamedTuple):
    """Lion's step count and momentum."""

    count: np.int32  # type: ignore[assignment]
    mu: FlatTree


class ScaleByRmsState(NamedTuple):
    """RMSProp's second moment."""

    nu: FlatTree


class ScaleByRmsWithCountState(NamedTuple):
    """RMSProp's step count and second moment (with bias correction)."""

    count: np.int32  # type: ignore[assignment]
    nu: FlatTree


class ScaleByRStdDevState(NamedTuple):
    """Centred RMSProp's first and second moments."""

    mu: FlatTree
    nu: FlatTree


class ScaleByRStdDevWithCountState(NamedTuple):
    """Centred RMSProp's step count and moments (with bias correction)."""

    count: np.int32  # type: ignore[assignment]
    mu: FlatTree
    nu: FlatTree


class ScaleByRssState(NamedTuple):
    """Adagrad's sum of squared gradients."""

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
        ValueError: ``update`` without ``params``.

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
) -> GradientTransformationExtraArgs:
    """NAdam: ``adam(..., nesterov=True)`` (see `scale_by_nadam`)."""
    return chain(scale_by_nadam(b1, b2, eps, eps_root, mu_dtype), scale_by_learning_rate(learning_rate))


def nadamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: ScalarOrSchedule = 1e-4,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """NAdamW: ``adamw(..., nesterov=True)``."""
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=True)


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
    v = one_minus_b2 * (g * g) + b2 * nu
    vm = maximum(nu_max, v / bc2)
    return m, v, vm, (m / bc1) / (math.sqrt(vm + eps_root) + eps)


class _ScaleByAmsgrad(_Direction):
    state_cls, fields, formula, name = (
        ScaleByAmsgradState,
        ("mu", "nu", "nu_max"),
        amsgrad_direction,
        "scale_by_amsgrad",
    )

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
    """AMSGrad's direction: Adam's moments, ``nu_max = max(nu_max, nu / (1 - b2^t))``,
    ``u = (mu / (1 - b1^t)) / (sqrt(nu_max + eps_root) + eps)`` (each correction optional)."""
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
    """AMSGrad: ``chain(scale_by_amsgrad(...), scale_by_learning_rate(learning_rate))``."""
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
    v = maximum(abs(g) + eps, b2 * nu)
    return m, v, (m / bc1) / v


class _ScaleByAdamax(_Direction):
    state_cls, fields, formula, name = ScaleByAdamState, ("mu", "nu"), adamax_direction, "scale_by_adamax"

    def __init__(self, b1: float, b2: float, eps: float) -> None:
        self.b1, self.b2, self.eps = check_decay(b1, "b1"), check_decay(b2, "b2"), real(eps, "eps")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.b1, 1.0 - self.b1, self.b2, bias_correction(self.b1, int(count), ct), self.eps)


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformationExtraArgs:
    """Adamax's direction: ``mu`` as Adam's, ``nu = max(|g| + eps, b2 nu)``,
    ``u = (mu / (1 - b1^t)) / nu`` (state `ScaleByAdamState`, as in optax)."""
    return _ScaleByAdamax(b1, b2, eps).transformation()


def adamax(
    learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> GradientTransformationExtraArgs:
    """Adamax: ``chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate))``."""
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
    v = (one_minus_b2 * (e * e) + b2 * nu) + eps_root
    m_hat = b1 * (m / bc1_next) + one_minus_b1 * (g / bc1) if nesterov else m / bc1
    return m, v, m_hat / (math.sqrt(v / bc2) + eps)


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
    """AdaBelief's direction: ``mu`` as Adam's, ``nu = (1 - b2) (g - mu)^2 + b2 nu + eps_root``,
    ``u = mu_hat / (sqrt(nu / (1 - b2^t)) + eps)`` (``mu_hat`` as Adam's, or NAdam's)."""
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
    """AdaBelief: ``chain(scale_by_belief(...), scale_by_learning_rate(learning_rate))``."""
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
        out = math.tanh(smooth_beta * c)
    elif refined and abs(c) < 1.0:
        out = c
    else:
        out = 1.0 if c > 0 else (-1.0 if c < 0 else c)  # jnp.sign: +-0 and NaN as they are
    return one_minus_b2 * g + b2 * mu, out


class _ScaleByLion(_Direction):
    state_cls, fields, formula, name = ScaleByLionState, ("mu",), lion_direction, "scale_by_lion"

    def __init__(self, b1: float, b2: float, mu_dtype: Any, mode: str, smooth_beta: float) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.mu_dtype = _mu_dtype(mu_dtype)
        if mode not in _LION_MODES:
            raise ValueError(f"mode must be one of {list(_LION_MODES)}, got {mode!r}")
        self.mode, self.smooth_beta = mode, real(smooth_beta, "smooth_beta")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        b1, b2 = self.b1, self.b2
        return (1.0 - b1, b1, 1.0 - b2, b2, self.smooth_beta, self.mode == "smooth", self.mode == "refined")


def scale_by_lion(
    b1: float = 0.9, b2: float = 0.99, mu_dtype: Any = None, *, mode: str = "hard", smooth_beta: float = 1.0
) -> GradientTransformationExtraArgs:
    """Lion's direction: ``u = sign((1 - b1) g + b1 mu)`` (``mode='smooth'``: ``tanh(smooth_beta
    c)``; ``'refined'``: ``c`` where ``|c| < 1``), then ``mu = (1 - b2) g + b2 mu``."""
    return _ScaleByLion(b1, b2, mu_dtype, mode, smooth_beta).transformation()


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Any = None,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: Any = None,
) -> GradientTransformationExtraArgs:
    """Lion: ``chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, one fused pass. Needs ``params``."""
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
    g2 = g * g
    d = nu - g2
    if d > 0:
        v = nu - one_minus_b2 * g2
    elif d < 0:
        v = nu + one_minus_b2 * g2
    else:
        v = nu - (one_minus_b2 * d) * g2
    return m, v, (m / bc1) / (sqrt(v / bc2 + eps_root) + eps)


class _ScaleByYogi(_Direction):
    state_cls, fields, formula, name = ScaleByAdamState, ("mu", "nu"), yogi_direction, "scale_by_yogi"

    def __init__(
        self, b1: float, b2: float, eps: float, eps_root: float, initial_accumulator_value: float
    ) -> None:
        self.b1, self.b2 = check_decay(b1, "b1"), check_decay(b2, "b2")
        self.eps, self.eps_root = real(eps, "eps"), real(eps_root, "eps_root")
        self.initial = real(initial_accumulator_value, "initial_accumulator_value")

    def initial_of(self, field: str) -> float:
        return self.initial  # both moments, as in optax

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

    References:
        Zaheer et al., "Adaptive Methods for Nonconvex Optimization", NeurIPS 2018.

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

    References:
        Zaheer et al., "Adaptive Methods for Nonconvex Optimization", NeurIPS 2018.

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
    (``eps_in_sqrt``) or g / (sqrt(nu / bc) + eps); ``bc`` 1 without bias correction."""
    v = one_minus_decay * (g * g) + decay * nu
    n = v / bc
    s = 1.0 / math.sqrt(n + eps) if eps_in_sqrt else 1.0 / (math.sqrt(n) + eps)
    return v, s * g


class _ScaleByRms(_Direction):
    formula, name = rms_direction, "scale_by_rms"
    fields = ("nu",)

    def __init__(self, decay: float, eps: float, initial_scale: float, eps_in_sqrt: bool, bc: bool) -> None:
        self.decay, self.eps = check_decay(decay, "decay"), real(eps, "eps")
        self.initial = real(initial_scale, "initial_scale")
        self.eps_in_sqrt, self.bc = flag(eps_in_sqrt, "eps_in_sqrt"), flag(bc, "bias_correction")
        self.counted = self.bc  # type: ignore[misc]  # optax's state has a count only then
        self.state_cls = ScaleByRmsWithCountState if self.bc else ScaleByRmsState  # type: ignore[misc]

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
    """RMSProp's scaling: ``nu = (1 - decay) g^2 + decay nu`` (from ``initial_scale``),
    ``u = g / sqrt(nu_hat + eps)`` (``eps_in_sqrt``) or ``g / (sqrt(nu_hat) + eps)``,
    ``nu_hat = nu / (1 - decay^t)`` with ``bias_correction`` (state `ScaleByRmsWithCountState`),
    else ``nu`` (state `ScaleByRmsState`)."""
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
    v = one_minus_decay * (g * g) + decay * nu
    mh = m / bc
    var = v / bc - mh * mh  # may round below zero: NaN then, as in optax
    s = 1.0 / sqrt(var + eps) if eps_in_sqrt else 1.0 / (sqrt(var) + eps)
    return m, v, s * g


class _ScaleByStddev(_ScaleByRms):
    formula, name = stddev_direction, "scale_by_stddev"
    fields = ("mu", "nu")

    def __init__(self, decay: float, eps: float, initial_scale: float, eps_in_sqrt: bool, bc: bool) -> None:
        super().__init__(decay, eps, initial_scale, eps_in_sqrt, bc)
        self.state_cls = ScaleByRStdDevWithCountState if self.bc else ScaleByRStdDevState  # type: ignore[misc]


def scale_by_stddev(
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformationExtraArgs:
    """Centred RMSProp's scaling: ``mu``, ``nu`` the EMAs of ``g`` and ``g^2`` (``nu`` from
    ``initial_scale``), ``u = g / sqrt(nu_hat - mu_hat^2 + eps)`` (or ``g / (sqrt(nu_hat -
    mu_hat^2) + eps)``), hats bias-corrected with ``bias_correction``."""
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
    """RMSProp: ``chain(scale_by_rms(...)`` (``scale_by_stddev`` when ``centered``)``,
    scale_by_learning_rate(learning_rate), trace(momentum, nesterov))`` (``identity()`` for no
    momentum), as optax: the learning rate is applied before the momentum."""
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
    s = g * g + sum_of_squares
    return s, (1.0 / math.sqrt(s + eps) if s > 0 else 0.0) * g


class _ScaleByRss(_Direction):
    state_cls, fields, formula, name = ScaleByRssState, ("sum_of_squares",), rss_direction, "scale_by_rss"
    counted = False

    def __init__(self, initial_accumulator_value: float, eps: float) -> None:
        self.initial = real(initial_accumulator_value, "initial_accumulator_value")
        self.eps = real(eps, "eps")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.eps,)


def scale_by_rss(
    initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> GradientTransformationExtraArgs:
    """Adagrad's scaling: ``s = g^2 + s`` (from ``initial_accumulator_value``),
    ``u = g / sqrt(s + eps)`` where ``s > 0``, else 0."""
    return _ScaleByRss(initial_accumulator_value, eps).transformation()


def adagrad(
    learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> GradientTransformationExtraArgs:
    """Adagrad: ``chain(scale_by_rss(initial_accumulator_value, eps),
    scale_by_learning_rate(learning_rate))``."""
    return chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))
