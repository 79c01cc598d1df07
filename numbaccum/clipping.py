"""Norms of whole trees and the optax clipping family built on them."""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import numpy as np

from . import formulas as F
from . import fuse
from ._bounded import Bounded
from ._checks import integer, non_negative, real, real_scalar, transformation, wrong_state
from .backend import Reductions, leaf_tables, ops_for, prepare_divide, sumsq_of_leaves, tree_sumsq_scaled
from .base import FLAT_MEASURES, Stage, as_stage, host_step, with_extra_args_support
from .contract import ONE, Factor, Ops
from .control import Inner
from .declared import Elementwise
from .flat import FlatTree, as_flat, layout_of
from .formulas import clip_factor, clip_finish
from .fuse import Later, Prepass
from .layout import Layout, compute_dtype
from .lockstep import Note, inside
from .protocol import EmptyState, GradientTransformationExtraArgs, state_class
from .tables import segments, whole
from .tables import sum_in_order as _sequential_sum
from .traits import LEAF, TREE
from .transaction import keep_states
from .tree import tree_unflatten
from .updates import ParamsRef, SkipStep, Spec, Updates

__all__ = [
    "ApplyIfFiniteState",
    "ClipByGlobalNormState",
    "ClipState",
    "ZeroNansState",
    "apply_if_finite",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "global_norm",
    "keep_params_nonnegative",
    "normalize_by_update_norm",
    "scale_by_polyak",
    "zero_nans",
]

_INT32_MAX = int(np.iinfo(np.int32).max)

_SEGMENT_KERNEL = {1: Ops.segment_sumabs, 2: Ops.segment_sumsq, math.inf: Ops.segment_maxabs}


def leaf_reductions(flat: FlatTree, kernel: Any) -> np.ndarray:
    """One float64 value per leaf (in leaf order), each from a segmented reduction per group.

    ``kernel`` is a per-segment reduction of the contract, e.g. ``Ops.segment_sumsq``."""
    lay: Layout = flat.layout
    out = np.empty(lay.num_leaves, np.float64)
    for members, offsets, g in zip(lay.group_index, lay.offsets, flat.groups):
        out[members] = kernel(ops_for(g), g, offsets)
    return out


def sum_in_order(values: np.ndarray) -> float:
    """Sequential float64 sum in tree order: the same bits whatever the layout or thread count
    (compiled: no Python loop over leaves)."""
    return float(_sequential_sum(values))


def global_norm(tree: Any, ord: Any = 2, squared: bool = False) -> float:
    """The norm of a whole tree, like ``optax.tree.norm``, accumulated in float64.

    ``ord=2``: ``sqrt(sum g^2)``; ``ord=1``: ``sum |g|``; ``ord=inf``: ``max |g|`` (NaN if any
    element is NaN), each over every element of every leaf. With ``squared=True`` the result is
    squared (``sum g^2`` for ``ord=2``). Each leaf is reduced over fixed blocks and the leaves are
    combined in tree order, so a plain tree and its FlatTree give the same bits for any thread
    count. The L2 norm is computed from scaled squares: float64 entries past 1e154 still give a
    finite norm. An empty tree has norm 0.

    Args:
        tree: a tree of float arrays (NumPy or CUDA), or a `FlatTree`.
        ord: ``2`` (or None), ``1``, or ``inf`` (``math.inf``, ``np.inf`` or the string ``"inf"``).
        squared: return the square of the norm.

    Returns:
        The norm (or its square), a Python float. On the GPU it is brought to the host (one
            synchronisation).

    Raises:
        ValueError: ``ord`` is not 1, 2, inf or None.

    References:
        optax.tree.norm (formerly optax.global_norm); torch.nn.utils.get_total_norm.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tree = {"a": np.array([3.0, -4.0]), "b": np.array([12.0])}
        >>> nba.global_norm(tree), nba.global_norm(tree, ord=1), nba.global_norm(tree, ord=np.inf)
        (13.0, 19.0, 12.0)
    """
    # 2 asked first: a clip's every step comes here
    key = 2 if ord is None or ord == 2 else math.inf if ord in (math.inf, "inf") else ord
    if key not in _SEGMENT_KERNEL:
        raise ValueError(f"ord must be 1, 2 or inf, got {ord!r}")
    flat = tree if isinstance(tree, FlatTree) else as_flat(tree, layout_of(tree, "tree"), "tree")[0]
    if key == 2:  # the one global L2 norm of the library (a host float: a sync on GPU)
        s, f = tree_sumsq_scaled(flat)  # sqrt(s) / f: finite whenever representable
        return (s / f / f if f != 1.0 else s) if squared else math.sqrt(s) / f
    # Each group's per-leaf values come back to the host: the norm is a host float (a sync on GPU).
    per_leaf = leaf_reductions(flat, _SEGMENT_KERNEL[key])
    if key == math.inf:
        value = float(np.max(per_leaf)) if per_leaf.size else 0.0
        return value * value if squared else value
    total = sum_in_order(per_leaf)
    return total * total if squared else total


FLAT_MEASURES.add(global_norm)  # snapshot measures the flat buffers with it: the same bits


@state_class
class ClipByGlobalNormState(NamedTuple):
    """What `clip_by_global_norm` saw at its last update, for a logger (`numbaccum.stats`).

    Attributes:
        norm: the global L2 norm before clipping: a float64 on the host; for CUDA updates a
            `numbaccum.arrays.DeviceScalar` (never synchronised: ``float(norm)`` is the caller's).
        clipped: whether the updates were scaled down (``norm >= max_norm``, or a NaN norm); a
            bool, or a DeviceScalar for CUDA updates.
        skipped: whether the step was skipped or refused for a non-finite norm (``nonfinite``).
    """

    norm: Any
    clipped: Any
    skipped: Any = np.bool_(False)


_NONFINITE = ("pass", "skip", "raise")


def _nonfinite_policy(value: Any) -> str:
    if not isinstance(value, str) or value not in _NONFINITE:  # an array has no truth value
        raise ValueError(f"nonfinite must be one of {list(_NONFINITE)}, got {value!r}")
    return value


def first_nonfinite_leaf(flat: FlatTree) -> str | None:
    """The path of the first leaf holding a NaN or inf, or None (a host sync on the GPU)."""
    counts = leaf_reductions(flat, Ops.segment_nonfinite)
    bad = np.flatnonzero(counts > 0)
    return flat.layout.path(int(bad[0]), "updates") if bad.size else None


_SCRATCH = threading.local()  # per layout: the per-group squared norms and the factors (GPU)
_FACTOR_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _device_factors(flat: FlatTree, max_norm: float) -> dict[np.dtype, Any] | None:
    """clip_by_global_norm's ``[div, mul]`` on the device, for float32 and float64 kernels: one
    launch per dtype group (its sum of squares; the last also finishes the norm with
    `numbaccum.formulas.clip_finish`: the factor, and in float64 the state's norm and clipped
    flag after it). Nothing comes to the host. None for a tree with other dtypes (float16),
    which takes the host path."""
    if any(d not in _FACTOR_DTYPES for d in flat.group_dtypes):
        return None
    from .arrays import empty

    cache = _SCRATCH.__dict__.get("by_layout")
    if cache is None:
        cache = _SCRATCH.by_layout = Bounded()
    scratch = cache.get(flat.layout)
    if scratch is None:
        # per leaf, tree order: [plain | rescued | scale] (see `Ops.global_norm_finish_`)
        sums = empty(3 * flat.layout.num_leaves, np.dtype(np.float64))
        # clip_finish's values, as many as each holds: [div, mul] in float32; [div, mul, norm,
        # clipped] in float64 (the state's record)
        f32, f64 = _FACTOR_DTYPES
        scratch = cache.put(flat.layout, (sums, {f32: empty(2, f32), f64: empty(4, f64)}))
    sums, facs = scratch
    fac32, fac64 = (facs[d] for d in _FACTOR_DTYPES)
    lay, last = flat.layout, len(flat.groups) - 1
    for i, g in enumerate(flat.groups):
        table = segments(lay.offsets[i])
        members, finishes = lay.group_index[i], i == last
        ops_for(g).global_norm_finish_(
            sums, g, table, members, finishes, clip_finish, (max_norm,), fac32, fac64
        )
    return facs


def clip_by_global_norm(max_norm: float, *, nonfinite: str = "pass") -> GradientTransformationExtraArgs:
    """Clips the whole tree to a global L2 norm of at most ``max_norm`` (optax's formula):

    ``u = g`` if ``norm < max_norm`` (strict), else ``u = (g / norm) * max_norm``, with
    ``norm = sqrt(sum g^2)`` over every leaf.

    The norm accumulates in float64 (float32 squares cannot overflow: ``[1e20, 1e20]`` clips to
    ``[0.7071, 0.7071]`` where optax gives zeros), and ``norm == max_norm == 0`` gives zeros where
    optax gives NaN (0 / 0). A NaN norm clips every element to NaN, as in optax. The factor is not
    a pass of its own: it rides on the next kernel that reads the updates. On the GPU the norm
    and the factor stay on the device (no synchronisation; float16 trees bring the norm back).

    The state (`ClipByGlobalNormState`) records the norm it saw and whether it clipped, for a
    logger (`numbaccum.stats`); optax's state is empty.

    Args:
        max_norm: the largest global norm let through.
        nonfinite: what a NaN or inf norm does: ``"pass"`` (the default, optax's: NaN updates),
            ``"skip"`` (zero updates, and in a chain the stages after this one keep their states;
            the stages before it have run), or ``"raise"`` (FloatingPointError naming the first
            leaf holding a NaN or inf; nothing after the stages before it has run). Both check
            on the host: on the GPU that is a synchronisation, which ``"pass"`` never makes.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ClipByGlobalNormState(norm, clipped,
            skipped)`` (all zero and False after ``init``).

    Raises:
        ValueError: ``max_norm`` is negative or NaN, or ``nonfinite`` is not one of the three.
        TypeError: ``max_norm`` is not a real number.
        FloatingPointError: at ``update``, with ``nonfinite="raise"``, when the norm is NaN or inf.

    References:
        Pascanu, Mikolov and Bengio, "On the difficulty of training recurrent neural networks",
        ICML 2013 (arXiv:1211.5063). optax.clip_by_global_norm; torch.nn.utils.clip_grad_norm_
        (which multiplies by ``max_norm / (norm + 1e-6)`` whenever that is below 1).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([3.0, 4.0])}
        >>> tx = nba.clip_by_global_norm(1.0)
        >>> updates, state = tx.update(grads, tx.init(grads))
        >>> [round(float(x), 4) for x in updates["w"]], float(state.norm), bool(state.clipped)
        ([0.6, 0.8], 5.0, True)
    """
    return _ClipByGlobalNorm(max_norm, nonfinite).transformation()


class _Stateless(Stage):
    """A stateless stage: ``init`` gives `EmptyState` and the state passes through."""

    def init(self, params: Any) -> EmptyState:
        return EmptyState()


class _ClipByGlobalNorm(Stage):
    """`clip_by_global_norm`: the factor ``(g / norm) * max_norm`` is left pending on the
    updates; the norm it saw goes into the new state (`fuse.Later`: known once the pre-pass ran)."""

    scope = TREE
    complex_leaves = True  # optax defines it on complex leaves

    def __init__(self, max_norm: Any, nonfinite: str = "pass") -> None:
        self.max_norm = non_negative(max_norm, "max_norm")
        self.nonfinite = _nonfinite_policy(nonfinite)

    def init(self, params: Any) -> ClipByGlobalNormState:
        return ClipByGlobalNormState(np.float64(0.0), np.bool_(False), np.bool_(False))

    def declare(self, spec: Spec, state: Any) -> Prepass:
        # optax's EmptyState, or None (a stateless transformation's state is often passed so)
        if not _clip_state(state):
            raise wrong_state("ClipByGlobalNormState", state)
        max_norm, policy = self.max_norm, self.nonfinite
        seen: list = []  # the state this step records, once its pre-pass has run
        memo: list = [None, None]  # flat, factor: asked twice for one buffer (apply_if_finite)

        def factor_of(flat: FlatTree) -> Factor:
            if memo[0] is flat:
                return memo[1]
            factor = None
            if flat.device and policy == "pass":  # norm and factor stay on the GPU: no sync
                facs = _device_factors(flat, max_norm)
                if facs is not None:
                    seen.append(_device_record(facs))
                    factor = Factor(device=facs)
            if factor is None:
                factor = of_norm(flat, global_norm(flat))
            memo[0], memo[1] = flat, factor
            return factor

        def finite_of(flat: FlatTree) -> bool | None:
            """True when the norm is finite: then every element is (a NaN or inf element makes
            the rescued sum of squares NaN or inf); None otherwise (finite elements can still
            have an infinite float64 norm), and on the GPU, whose norm stays there."""
            if flat.device or policy != "pass":
                return None
            factor_of(flat)
            return True if math.isfinite(seen[-1].norm) else None

        def from_sumsq(flat: FlatTree, sums: np.ndarray) -> Factor | None:
            """The factor from a collective's per-leaf sums of squares (`fuse.Collective`)."""
            s = sumsq_of_leaves(flat.layout, sums)
            if s is None:  # a float64 norm to rescue: the pre-pass reads the values itself
                return None
            memo[0] = memo[1] = None  # not of a buffer this step holds: never memoised
            return of_norm(flat, math.sqrt(s))  # `global_norm`: sqrt(s) / f, f 1

        def of_norm(flat: FlatTree, norm: float) -> Factor:
            clipped = not norm < max_norm
            if not math.isfinite(norm) and policy != "pass":
                seen.append(ClipByGlobalNormState(np.float64(norm), np.bool_(clipped), np.bool_(True)))
                if policy == "raise":
                    where = first_nonfinite_leaf(flat)
                    raise FloatingPointError(
                        f"clip_by_global_norm: the global norm is {norm}: {where} is not finite"
                    )
                raise SkipStep(seen[-1])
            seen.append(_new_record(_CLIP_STATE, (np.float64(norm), _BOOLS[clipped], _BOOLS[False])))
            return Factor(*clip_factor(norm, max_norm)) if clipped else ONE  # fits float32 (`Factor`)

        def tick(state: Any, params: Any, extra: dict) -> bool:
            seen.clear()  # a new step: nothing reduced yet
            memo[0] = memo[1] = None
            return state is None or isinstance(state, _CLIP_STATES)  # `_clip_state`, inline

        part = Prepass(
            factor_of,
            Later(lambda: seen[-1]),
            "clip_by_global_norm",
            finite_of=finite_of,
            # Rides on a collective's sum (host, "pass": a step skipped or refused there would
            # be the collective's too; those policies take their own reduction pass).
            from_sumsq=from_sumsq if not spec.device and policy == "pass" else None,
        )
        part.tick = tick
        return part


_new_record, _CLIP_STATE = tuple.__new__, ClipByGlobalNormState  # made every step: no keywords
_BOOLS = {False: np.False_, True: np.True_}


_CLIP_STATES = (ClipByGlobalNormState, EmptyState)


def _clip_state(state: Any) -> bool:
    return state is None or isinstance(state, _CLIP_STATES)


def _device_record(facs: dict) -> ClipByGlobalNormState:
    """The norm and the clipped flag of a device-side clip (`_device_factors` leaves them after
    the float64 factor), copied on the device into a state of their own (`DeviceScalar`s)."""
    from .arrays import DeviceScalar, empty

    rec = empty(2, np.dtype(np.float64))
    rec.copy_to_device(facs[np.dtype(np.float64)][2:4])
    return ClipByGlobalNormState(
        DeviceScalar(rec[0:1], np.float64), DeviceScalar(rec[1:2], np.bool_), np.bool_(False)
    )


ClipState = EmptyState


def clip(max_delta: float) -> GradientTransformationExtraArgs:
    """Clips every element to at most ``max_delta`` in magnitude (optax's ``clip``).

    ``u = clip(g, -max_delta, max_delta)``, element by element. NaN stays NaN, as with
    ``jnp.clip``. Stateless.

    Args:
        max_delta: the largest magnitude an element keeps (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()`` (``ClipState``).

    Raises:
        ValueError: ``max_delta`` is negative or NaN.
        TypeError: ``max_delta`` is not a real number.

    References:
        Mikolov, "Statistical Language Models Based on Neural Networks", PhD thesis, 2012
        (element-wise clipping, as discussed by Pascanu et al. 2013). optax.clip;
        torch.nn.utils.clip_grad_value_ (in place: `clip_grad_value_`).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([-2.0, 0.5, 3.0])}
        >>> tx = nba.clip(1.0)
        >>> updates, _ = tx.update(grads, tx.init(grads))
        >>> [round(float(x), 4) for x in updates["w"]]
        [-1.0, 0.5, 1.0]
    """
    return _Clip(max_delta).transformation()


class _Clip(Elementwise):
    """``u = clip(g, -max_delta, max_delta)``, declared (stateless)."""

    formula, name = F.clip, "clip"

    def __init__(self, max_delta: Any) -> None:
        self.max_delta = non_negative(max_delta, "max_delta")

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.max_delta,)


@F.formula(inputs=("g", "p"), outputs=("out",))
def nonnegative_step(g, p):
    """out = -p where p + g < 0 (the step that lands on 0), else g (NaN passes: optax's
    ``where(p + u < 0, -p, u)``)."""
    return -p if p + g < 0 else g


class _KeepParamsNonnegative(Elementwise):
    """``u = -p`` where ``p + g < 0``, else ``g``, declared (stateless, reads the params)."""

    formula, name, inputs = nonnegative_step, "keep_params_nonnegative", ("params",)

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return ()


def keep_params_nonnegative() -> GradientTransformationExtraArgs:
    """Keeps the params non-negative: an update that would take a param below zero takes it to
    zero instead.

    ``u = -p`` where ``p + g < 0``, else ``u = g`` (a NaN passes as it is). Put it last in a
    chain, on the final updates: the params stay ``>= 0`` if they start so. Needs ``params``
    at each update. Stateless.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        ValueError: at an update, no ``params``.

    References:
        optax.keep_params_nonnegative.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([1.0, 0.5, 2.0])}
        >>> tx = nba.keep_params_nonnegative()
        >>> u, _ = tx.update({"w": np.array([-2.0, 0.25, -1.0])}, tx.init(params), params)
        >>> u["w"].tolist()  # -1 stops at 0; the others pass
        [-1.0, 0.25, -1.0]
    """
    return _KeepParamsNonnegative().transformation()


def normalize_by_update_norm(scale_factor: float = 1.0, eps: float = 1e-6) -> GradientTransformationExtraArgs:
    """Scales the updates to a global L2 norm of ``scale_factor`` (optax's ``normalize_by_update_norm``).

    ``u = g / ((norm + eps) / scale_factor)``, with ``norm = sqrt(sum g^2)`` over every leaf.

    The norm accumulates in float64; the division rides on the next kernel. On the GPU the norm
    comes back to the host (one synchronisation per call). A negative ``scale_factor`` flips the
    direction (``-1``: a normalized descent step); ``scale_factor = 0`` gives zeros (a division
    by inf). Stateless.

    Args:
        scale_factor: the norm of the output (up to ``eps``); any real number.
        eps: added to the norm before the division (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        ValueError: ``eps`` is negative or NaN.
        TypeError: ``scale_factor`` or ``eps`` is not a real number.

    References:
        Hazan, Levy and Shalev-Shwartz, "Beyond Convexity: Stochastic Quasi-Convex
        Optimization", NeurIPS 2015 (normalized gradient descent). optax.normalize_by_update_norm.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([3.0, 4.0])}
        >>> tx = nba.normalize_by_update_norm()
        >>> updates, _ = tx.update(grads, tx.init(grads))
        >>> [round(float(x), 4) for x in updates["w"]]  # (3, 4) / (5 + 1e-6)
        [0.6, 0.8]
    """
    return _NormalizeByUpdateNorm(scale_factor, eps).transformation()


class _NormalizeByUpdateNorm(_Stateless):
    scope = TREE
    complex_leaves = True  # optax defines it on complex leaves

    def __init__(self, scale_factor: Any, eps: Any) -> None:
        self.scale_factor, self.eps = real(scale_factor, "scale_factor"), non_negative(eps, "eps")

    def declare(self, spec: Spec, state: Any) -> Prepass:
        scale_factor, eps = self.scale_factor, self.eps

        def factor_of(flat: FlatTree) -> Factor:
            norm = global_norm(flat)  # float64; the factor is scaled to fit float32 (`Factor`)
            with np.errstate(divide="ignore", invalid="ignore"):  # scale_factor 0: inf, as in optax
                return Factor(np.float64(norm + eps) / np.float64(scale_factor), 1.0)

        return stateless_prepass(factor_of, "normalize_by_update_norm", "update norm")


def stateless_prepass(factor_of: Any, name: str, reads: str) -> Prepass:
    """A stateless stage's declared `numbaccum.fuse.Prepass` (``factor_of``, ``reads``: see
    there): its tick passes the state through."""
    part = Prepass(factor_of, None, name, reads)

    def tick(state: Any, params: Any, extra: dict) -> bool:
        part.new_state = state
        return True

    part.tick = tick
    return part


def scale_by_polyak(
    f_min: float = 0.0, max_learning_rate: float = 1.0, eps: float = 0.0, variant: str = "sps"
) -> GradientTransformationExtraArgs:
    """Scales the updates by Polyak's step size, from the objective's value (``update(...,
    value=f(params))``).

    ``u = g * min((f - f_min) / (||g||^2 + eps), max_learning_rate)``, and ``u = 0`` where
    ``||g||^2 + eps`` is at most float64's machine epsilon (optax's guard against 0 / 0). With
    ``variant='sps+'`` the gap ``f - f_min`` is clipped at 0 first (a value below the bound does not
    step back). The squared norm accumulates in float64 (one reduction pass), the step is computed
    on the host and rides on the next kernel. Stateless.

    Args:
        f_min: a lower bound on the objective (0 for models that interpolate the data).
        max_learning_rate: the largest step size.
        eps: added to the squared norm (``>= 0``).
        variant: ``'sps'`` or ``'sps+'``.

    Returns:
        A `GradientTransformationExtraArgs` whose ``update`` needs the keyword ``value`` (the
            objective at the params the updates were taken at); its state is ``EmptyState()``.

    Raises:
        TypeError: a hyperparameter is not a real number; at ``update``, ``value`` is missing
            (before the updates are read, as optax's required keyword) or not a real scalar.
        ValueError: ``eps`` is negative or NaN, or ``variant`` is neither ``'sps'`` nor
            ``'sps+'`` (optax raises at the first update; here at construction).

    References:
        Loizou et al., "Stochastic Polyak Step-size for SGD: An Adaptive Learning Rate for Fast
        Convergence", AISTATS 2021 (arXiv:2002.10542); Berrada et al., "Training Neural Networks
        for and by Interpolation", ICML 2020. optax.scale_by_polyak.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_polyak()
        >>> x = np.array([1.0, 2.0, 3.0])  # f(x) = sum x^2 = 14, g = 2x, |g|^2 = 56
        >>> u, _ = tx.update({"x": 2 * x}, tx.init({"x": x}), value=float(np.sum(x**2)))
        >>> u["x"]  # g * 14 / 56: half of x, the exact step to the minimum of f along g
        array([0.5, 1. , 1.5])
    """
    return _ScaleByPolyak(f_min, max_learning_rate, eps, variant).transformation()


class _ScaleByPolyak(_Stateless):
    scope = TREE
    complex_leaves = True  # optax's norm of complex leaves is |z|^2: the step is real

    def __init__(self, f_min: Any, max_learning_rate: Any, eps: Any, variant: Any) -> None:
        self.f_min, self.max_lr = real(f_min, "f_min"), real(max_learning_rate, "max_learning_rate")
        self.eps = non_negative(eps, "eps")
        if variant not in ("sps", "sps+"):
            raise ValueError(f"variant must be 'sps' or 'sps+', got {variant!r}")
        self.plus = variant == "sps+"

    def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        # optax's update takes ``value`` as a required keyword: a call without it is a TypeError
        # before anything reads the updates (the runner checks their structure first).
        if "value" not in extra_args:
            raise _no_value("scale_by_polyak")
        return super().update(updates, state, params, **extra_args)

    def declare(self, spec: Spec, state: Any) -> Prepass:
        f_min, max_lr, eps, plus = self.f_min, self.max_lr, self.eps, self.plus
        gap = [0.0]  # this step's f - f_min (set by ``tick``, before the pass)

        def factor_of(flat: FlatTree) -> Factor:
            s, f = tree_sumsq_scaled(flat)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                sq = np.float64(s) / np.float64(f) ** 2 + eps
                if sq <= _FLOAT64_EPS:  # (a NaN norm goes on: NaN updates, as optax's)
                    return Factor(1.0, 0.0)
                return Factor(1.0, float(np.minimum(np.float64(gap[0]) / sq, max_lr)))

        part = Prepass(factor_of, None, "scale_by_polyak", "squared global norm")

        def tick(state: Any, params: Any, extra: dict) -> bool:
            value = _objective_value(extra)
            g = value - f_min
            gap[0] = max(g, 0.0) if plus and not math.isnan(g) else g
            part.new_state = state
            return True

        part.tick = tick
        return part


_FLOAT64_EPS = float(np.finfo(np.float64).eps)


def _no_value(name: str) -> TypeError:
    return TypeError(f"{name} needs the objective: call update(updates, state, params, value=f(params))")


def _objective_value(extra: dict, name: str = "scale_by_polyak") -> float:
    """The ``value`` extra argument of an update, as a float (checked before anything runs)."""
    if "value" not in extra:
        raise _no_value(name)
    return real_scalar(extra["value"], "value", "the objective at the params")


@state_class
class ZeroNansState(NamedTuple):
    """State of `zero_nans`: whether each leaf held a NaN at the last update (optax's field).

    Attributes:
        found_nan: a tree of the params' structure with one ``np.bool_`` per leaf: True where
            the last update's leaf held at least one NaN (all False after ``init``).
    """

    found_nan: Any


def zero_nans() -> GradientTransformationExtraArgs:
    """Replaces every NaN by 0 (optax's ``zero_nans``).

    ``u = where(isnan(g), 0, g)``, element by element; inf and -inf are kept. The state records,
    per leaf, whether the last update held a NaN (on the GPU that flag comes back to the host).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ZeroNansState(found_nan)``, a tree of
            one bool per leaf.

    References:
        optax.zero_nans; torch.nan_to_num (with ``nan=0.0``, which also maps infs to finite values).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"a": np.array([np.nan, 1.0]), "b": np.array([np.inf])}
        >>> tx = nba.zero_nans()
        >>> updates, state = tx.update(grads, tx.init(grads))
        >>> updates["a"].tolist(), updates["b"].tolist()
        ([0.0, 1.0], [inf])
        >>> {k: bool(v) for k, v in state.found_nan.items()}
        {'a': True, 'b': False}
    """

    return _ZeroNans().transformation()


class _ZeroNans(Stage):
    scope = LEAF
    complex_leaves = True  # optax defines it on complex leaves

    def init(self, params: Any) -> ZeroNansState:
        layout = layout_of(params, "params")
        return ZeroNansState(tree_unflatten(layout.treedef, [np.bool_(False)] * layout.num_leaves))

    def declare(self, spec: Spec, state: Any) -> fuse.Host:
        """A `numbaccum.fuse.Host`: the NaN count of each leaf (a reduction), then the pass that
        zeroes them; the state is rebuilt from the counts each step."""
        if not isinstance(state, ZeroNansState):
            raise wrong_state("ZeroNansState", state)
        lay = spec.layout
        # The counts and the zeroing pass kept for their buffers (the contract's kernels).
        sums, launches, groups = Reductions(), fuse.Launches(), tuple(zip(lay.group_index, leaf_tables(lay)))

        def run(u: Updates) -> tuple[Updates, ZeroNansState]:
            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            counts = np.empty(lay.num_leaves, np.float64)
            out = u.fresh()
            for gi, ((members, table), o, g) in enumerate(zip(groups, out.groups, u.flat.groups)):
                counts[members] = sums.reduce(gi, "nancount", g, table)
                launches.run(F.zero_nans, gi, [g, o], ONE, ())
            found = tree_unflatten(lay.treedef, list(counts > 0))  # np.bool_s
            return Updates(out, True), ZeroNansState(found)

        def tick(state: Any, params: Any, extra: dict) -> bool:
            return isinstance(state, ZeroNansState)  # (its flags are no buffers: any such state)

        passes = (("reduction", "NaN count per leaf", 1.0, 0.0), ("kernel", "zero NaNs", 1.0, 1.0))
        return fuse.Host(run, passes, "zero_nans", tick)


@state_class
class ApplyIfFiniteState(NamedTuple):
    """State of `apply_if_finite`.

    Attributes:
        notfinite_count: consecutive non-finite updates so far (int32; not reset when the
            transformation gives up, as in optax).
        last_finite: whether the last update was finite.
        total_notfinite: non-finite updates since init (int32, saturating).
        inner_state: the inner transformation's state.
    """

    notfinite_count: np.int32
    last_finite: np.bool_
    total_notfinite: np.int32
    inner_state: Any


def apply_if_finite(inner: Any, max_consecutive_errors: int) -> GradientTransformationExtraArgs:
    """Runs ``inner`` only on finite updates (optax's ``apply_if_finite``).

    ``u = inner(g)`` when every element of ``g`` is finite, or when ``notfinite_count >
    max_consecutive_errors`` (``notfinite_count`` counting this update); else ``u = 0`` and the
    inner state is kept. So a NaN or inf anywhere returns zeros until more than
    ``max_consecutive_errors`` such updates in a row, after which the inner update is applied
    anyway (optax's semantics; the streak counter is not reset then).

    The finiteness check is a reduction whose result the host needs (one synchronisation on the
    GPU). All or nothing: the inner transformation is planned (its state, params and schedules
    checked) on every call, finite or not, before anything is written.

    Args:
        inner: the transformation to run on finite updates.
        max_consecutive_errors: how many non-finite updates in a row are zeroed (``>= 0``) before
            ``inner`` runs on them anyway.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ApplyIfFiniteState(notfinite_count,
            last_finite, total_notfinite, inner_state)``.

    Raises:
        TypeError: ``inner`` is not a transformation, or ``max_consecutive_errors`` is not an int.
        ValueError: ``max_consecutive_errors`` is negative.

    References:
        optax.apply_if_finite.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2)}
        >>> tx = nba.apply_if_finite(nba.sgd(0.1), max_consecutive_errors=2)
        >>> updates, state = tx.update({"w": np.array([np.nan, 1.0])}, tx.init(params), params)
        >>> updates["w"].tolist(), int(state.notfinite_count), bool(state.last_finite)
        ([0.0, 0.0], 1, False)
    """
    return _ApplyIfFinite(inner, max_consecutive_errors).transformation()


class _ApplyIfFinite(Stage):
    scope = TREE
    children_at = "stage"

    def __init__(self, inner: Any, max_errors: Any) -> None:
        self.inner = with_extra_args_support(transformation(inner, "inner"))
        self.stage = as_stage(self.inner)
        self.max_errors = integer(max_errors, "max_consecutive_errors")

    def refuses_complex(self) -> Stage | None:
        return self.stage.refuses_complex()

    def init(self, params: Any) -> ApplyIfFiniteState:
        # A collective inside compares this across the ranks (`numbaccum.lockstep`).
        with inside(Note((), lambda: f"apply_if_finite(max_consecutive_errors={self.max_errors})")):
            inner_state = self.inner.init(params)
        return ApplyIfFiniteState(np.int32(0), np.bool_(True), np.int32(0), inner_state)

    def owner(self, state: Any) -> FlatTree | None:
        return self.stage.owner(state.inner_state) if isinstance(state, ApplyIfFiniteState) else None

    def foreign(self) -> bool:
        return self.stage.foreign()

    def declare(self, spec: Spec, state: Any) -> Any:
        """A `numbaccum.fuse.Host`: its tick checks the state and ticks the inner plan
        (`numbaccum.control.Inner`); its run counts the non-finite elements (or reads
        finiteness from the inner plan's first reduction, a clip's norm) and runs that plan on a
        finite step, or after too many non-finite ones in a row."""
        if not isinstance(state, ApplyIfFiniteState):
            raise wrong_state("ApplyIfFiniteState", state)
        inner, max_errors = Inner(self.stage, spec, "apply_if_finite."), self.max_errors
        step: list = [None]  # this step's state
        sums, wholes = Reductions(), [whole(n) for n in spec.layout.group_sizes]  # the counts, kept

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not isinstance(state, ApplyIfFiniteState) or not inner.tick(state.inner_state, params, extra):
                return False
            step[0] = state
            return True

        def finite_of() -> Any:
            """An inner plan that starts with a clip: its norm tells finiteness (one reduction)."""
            plan = inner.plan
            first = plan.leaves[0] if plan is not None and plan.leaves else None
            return first.finite_of if type(first) is Prepass else None

        # The context a collective inside reads (`numbaccum.lockstep`), its note set each step.
        around = inside(Note((), str))

        def stepped(u: Updates, p: FlatTree | None = None) -> tuple[Any, ApplyIfFiniteState]:
            """The step on ``u``: ``(updates, new_state)``. With ``p`` (`numbaccum.step_` ending
            with this part): the inner plan adds its updates to ``p`` in its last pass
            (`Inner.apply`), a skipped step adds zeros, as its updates are; ``(None, new_state)``."""
            state = step[0]
            streak, total = int(state.notfinite_count), int(state.total_notfinite)
            if u.factor is not ONE and not u.factor.is_one:  # (`Updates.pending`, inline)
                u = u.settled()
            plan = inner.plan  # (`finite_of`, inline)
            first = plan.leaves[0] if plan is not None and plan.leaves else None
            read = first.finite_of if type(first) is Prepass else None
            finite = read(u.flat) if read is not None else None
            if finite is None:
                nonfinite = 0.0
                for gi, (g, table) in enumerate(zip(u.flat.groups, wholes)):
                    nonfinite += sums.reduce(gi, "nonfinite", g, table)[0]
                finite = nonfinite == 0
            count = 0 if finite else streak + 1
            new_total = total + (0 if finite else 1)
            flags = (np.int32(min(count, _INT32_MAX)), np.bool_(finite), np.int32(min(new_total, _INT32_MAX)))
            if finite or count > max_errors:
                # It decides from this rank's own updates: a collective inside compares the
                # skipped steps across the ranks, which a NaN on one rank only sets apart.
                around.note = Note((count, new_total), lambda: _skipped_text(new_total, count))
                try:
                    with around:
                        if p is None:
                            out, inner_state = inner.run(u)
                            return out, ApplyIfFiniteState(*flags, inner_state)
                        return None, ApplyIfFiniteState(*flags, inner.apply(u, p))
                except SkipStep as e:  # an inner clip skipped: zeros, its state as it says
                    new_state = ApplyIfFiniteState(*flags, e.new_state)
            else:
                keep_states(state.inner_state)  # ticked, not run: it stays the current one
                new_state = ApplyIfFiniteState(*flags, state.inner_state)
            zeros = Updates(u.fresh().fill_(0.0), True)
            if p is None:
                return zeros, new_state
            inner.adds(p, zeros)
            return None, new_state

        def passes(apply: bool) -> list:
            rows = [] if finite_of() is not None else [("reduction", "finiteness", 1.0, 0.0, 1.0)]
            return rows + inner.passes(apply)

        return fuse.Host(stepped, passes, "apply_if_finite", tick, apply=lambda u, p: stepped(u, p)[1])


def _skipped_text(total: int, streak: int) -> str:
    return f"apply_if_finite at {total} non-finite updates, {streak} in a row"


def clip_by_block_rms(threshold: float) -> GradientTransformationExtraArgs:
    """Clips each leaf to a root-mean-square of at most ``threshold`` (optax's ``clip_by_block_rms``).

    ``u = g / max(1, rms(g) / threshold)``, ``rms(g) = sqrt(mean(g^2))`` per leaf (float64).

    All leaves' squares come from one segmented pass and the division from a second (per-leaf
    divisors), not a Python loop over leaves. As in optax, ``threshold = 0`` on a zero leaf gives
    NaN (0 / 0). On the GPU the per-leaf divisors are computed on the host (one synchronisation).
    Stateless.

    Args:
        threshold: the largest RMS a leaf keeps (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        ValueError: ``threshold`` is negative or NaN.
        TypeError: ``threshold`` is not a real number.

    References:
        Shazeer and Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", ICML
        2018 (update clipping by RMS). optax.clip_by_block_rms.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"a": np.array([3.0, 4.0]), "b": np.array([0.1, 0.2])}
        >>> tx = nba.clip_by_block_rms(1.0)
        >>> updates, _ = tx.update(grads, tx.init(grads))
        >>> [round(float(x), 4) for x in updates["a"]]  # rms 3.5355: divided by it
        [0.8485, 1.1314]
        >>> [round(float(x), 4) for x in updates["b"]]  # rms below 1: unchanged
        [0.1, 0.2]
    """
    return _ClipByBlockRms(threshold).transformation()


class _ClipByBlockRms(_Stateless):
    scope = LEAF
    complex_leaves = True  # optax defines it on complex leaves

    def __init__(self, threshold: Any) -> None:
        # A negative threshold never clipped and NaN gave NaN updates: both refused. 0 is allowed
        # (optax's 0 / 0 = NaN on a zero leaf, documented above).
        self.threshold = non_negative(threshold, "threshold")

    def declare(self, spec: Spec, state: Any) -> fuse.Host:
        """A `numbaccum.fuse.Host`: each leaf's RMS (one segmented reduction per group), then
        the division by the per-leaf divisors; the tables once per layout."""
        lay, threshold = spec.layout, self.threshold
        # per group: its leaves, their sizes (at least 1, as divisors) and its table of slices
        groups = [
            (members, np.maximum(np.diff(offsets), 1), table)
            for members, offsets, table in zip(lay.group_index, lay.offsets, leaf_tables(lay))
        ]

        sums, n = Reductions(), lay.num_leaves  # the reductions and divisions kept for their buffers

        def run(u: Updates, params: Any) -> Updates:
            factors = np.empty(n, np.float64)
            for gi, ((members, sizes, table), g) in enumerate(zip(groups, u.flat.groups)):
                s, f = sums.sumsq(gi, g, table)  # scaled: finite for float64 leaves past 1e154
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # 0 / 0: NaN, as optax
                    rms = np.sqrt(s / sizes) / f
                    factors[members] = np.maximum(1.0, rms / threshold)
            return divide_leaves(u, factors, sums, always=True)

        passes = (("reduction", "RMS per leaf", 1.0, 0.0), ("kernel", "divide", 1.0, 1.0))
        return host_step(run, passes, "clip_by_block_rms", settle=True)


_RANGE: dict[np.dtype, tuple[float, float]] = {}


def _range(ctype: np.dtype) -> tuple[float, float]:
    """The normal range of a compute dtype."""
    info = np.finfo(ctype)
    out = _RANGE[ctype] = (float(info.tiny), float(info.max))
    return out


_CTYPE: dict[tuple, np.dtype] = {}


def _ctype(*dtypes: np.dtype) -> np.dtype:
    """`compute_dtype` of a pair of buffer dtypes, kept (a step of a small tree asks it)."""
    out = _CTYPE[dtypes] = compute_dtype(*dtypes)
    return out


def divide_leaves(u: Updates, factors: np.ndarray, kept: Reductions, always: bool = False) -> Updates:
    """``u`` with each leaf divided by its float64 factor: one segmented pass per group in the
    compute dtype (the factors cast to it; prepared in the caller's ``kept``), or, for a group
    where a factor does not fit that dtype (a float32 leaf divided by 1e39 would be divided by
    inf), ``x * (1 / factor)`` in float64, rounded once. ``u`` itself when every factor is 1
    (unless ``always``)."""
    if not always and not np.any(factors != 1.0):
        return u
    factor = u.factor
    if factor.device is not None:  # a device-resident pending factor: apply it first
        u, factor = u.settled(), ONE
    out = u.fresh()
    lay = u.flat.layout
    tables = leaf_tables(lay)
    for gi, (o, g) in enumerate(zip(out.groups, u.flat.groups)):
        f = factors[lay.group_index[gi]]
        ctype = _CTYPE.get((g.dtype, o.dtype)) or _ctype(g.dtype, o.dtype)
        tiny, big = _RANGE.get(ctype) or _range(ctype)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            a = np.abs(f)  # NaN fits (optax's NaN), 0 and inf too (the division by them is exact)
            if not np.any(((a > big) & (a < np.inf)) | ((a < tiny) & (a > 0))):  # the common case
                kept.call(gi, prepare_divide, (o, g, tables[gi]), factor, f.astype(ctype))
                continue
            if not factor.is_one:  # the float64 path reads settled values
                ops_for(g).scale_(o, g, factor)
                g = o
            ops_for(g).slice_apply_(o, g, segments(lay.offsets[gi]), None, 1.0 / f)
    return Updates(out, True)
