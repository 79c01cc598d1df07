"""Accumulation with optax's semantics: trace, ema, apply_every, MultiSteps, skip predicates.

States are NamedTuples with optax's field names; fields that mirror params are `FlatTree`s
updated in place (the state passed in is consumed), counters are NumPy int32 scalars that
saturate at the int32 maximum like optax's ``safe_increment``. Each transformation is a `Stage`:
its plan checks the state and computes the step's scalars, its step runs the kernels.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import formulas as F
from . import fuse
from ._checks import INT32_MAX, flag, integer, transformation, wrong_state
from ._interrupts import user_code
from .backend import ops_for, tree_sumsq_scaled
from .base import Chain, Foreign, Stage, as_stage, undoable, with_extra_args_support
from .control import Adds, Inner
from .contract import ONE
from .declared import (
    Elementwise,
    bias_correction,
    check_decay,
    expect_state,
    field_owner,
    safe_increment,
)
from .flat import FlatTree, as_flat, layout_and_device, layout_of
from .formulas import formula
from .layout import Layout, check_float_dtype, check_storage
from .lockstep import Note, inside
from .protocol import GradientTransformationExtraArgs, state_class
from .traits import ELEMENT, LEAF
from .transaction import current, keep_states
from .tree import short_repr
from .updates import ParamsRef, SkipStep, Spec, Updates

__all__ = [
    "ApplyEvery",
    "EmaState",
    "MultiSteps",
    "MultiStepsState",
    "TraceState",
    "apply_every",
    "ema",
    "skip_large_updates",
    "skip_not_finite",
    "trace",
]


def zeros_output(owner: FlatTree, layout: Layout) -> Updates:
    """A read-only zero tree kept by ``owner``: returned on steps that emit nothing."""
    zeros = owner.workspace_of("zeros", list(layout.group_dtypes))
    ws = zeros.buffer  # made once, never written again: not one to alternate (`Workspace`)
    if ws is None:
        ws = zeros().fill_(0.0)
        if not ws.device:  # NumPy can enforce it; on the GPU it is a promise
            for g in ws.groups:
                g.flags.writeable = False
        ws._readonly = True
    return Updates(ws, owned=False, returnable=True)


# --- trace ----------------------------------------------------------------------------------


@state_class
class TraceState(NamedTuple):
    """The state of `trace`: the momentum buffer.

    Attributes:
        trace: the decaying sum of past updates, ``t = g + decay * t`` (a `FlatTree` of the
            params' leaves, in ``accumulator_dtype`` or each leaf's dtype); zeros after ``init``.
    """

    trace: FlatTree


@formula(states=("trace",), inputs=("g",), outputs=("out",), scalars=("decay", "nesterov"))
def trace_update(trace, g, decay, nesterov):
    """t = g + decay * trace; trace = t; out = g + decay * t if nesterov else t."""
    t = g + decay * trace
    return t, (g + decay * t if nesterov else t)


class _Trace(Elementwise):
    """`trace`, declared: ``trace = g + decay * trace`` over its state's ``trace`` buffer."""

    complex_leaves = True  # optax defines it on complex leaves

    formula, state_cls, fields, name = trace_update, TraceState, ("trace",), "trace"
    dtype_options = {"trace": "accumulator_dtype"}

    def __init__(self, decay: float, nesterov: bool, accumulator_dtype: Any) -> None:
        self.decay = check_decay(decay)
        self.nesterov = flag(nesterov, "nesterov")
        self.accumulator_dtype = accumulator_dtype
        if accumulator_dtype is not None:  # stored as a dtype: `Elementwise.field_dtypes` reads it
            self.accumulator_dtype = check_float_dtype(accumulator_dtype, "accumulator_dtype", complex=True)

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.decay, self.nesterov)


def trace(
    decay: float, nesterov: bool = False, accumulator_dtype: Any = None
) -> GradientTransformationExtraArgs:
    """Momentum: accumulates the updates into a decaying trace.

    Each update computes ``t = g + decay * t`` element by element and returns ``u = t``, or with
    ``nesterov`` ``u = g + decay * t`` (with the new ``t``). The trace is stored in
    ``accumulator_dtype``; the updates keep each leaf's dtype. One fused pass.

    Args:
        decay: decay rate of the trace, from 0 to 1 (both included).
        nesterov: return Nesterov's update ``g + decay * t`` instead of ``t``.
        accumulator_dtype: storage dtype of the trace (float16, bfloat16, float32 or float64); None keeps
            each leaf's dtype.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``TraceState(trace)``, the trace
            starting at zeros.

    Raises:
        ValueError: ``decay`` is outside the closed interval from 0 to 1, or NaN.
        TypeError: ``decay`` is not a real number, ``nesterov`` not a bool, or
            ``accumulator_dtype`` not float16, bfloat16, float32 or float64.

    References:
        Polyak, "Some methods of speeding up the convergence of iteration methods", 1964;
        Sutskever et al., "On the importance of initialization and momentum in deep learning",
        ICML 2013 (Nesterov's momentum in this form). optax.trace.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.trace(0.9)
        >>> state = tx.init({"w": np.zeros(2, np.float32)})
        >>> g = {"w": np.array([1.0, 2.0], np.float32)}
        >>> u, state = tx.update(g, state)
        >>> u, state = tx.update(g, state)
        >>> [round(float(x), 4) for x in u["w"]]  # g + 0.9 * g
        [1.9, 3.8]
    """
    return _Trace(decay, nesterov, accumulator_dtype).transformation()


# --- ema ------------------------------------------------------------------------------------


@state_class
class EmaState(NamedTuple):
    """The state of `ema`: the step count and the moving average.

    Attributes:
        count: updates so far (int32, saturating at the int32 maximum); the debiased update
            divides by ``1 - decay ** count``.
        ema: the moving average ``e = (1 - decay) * g + decay * e``, never debiased (a
            `FlatTree` of the params' leaves, in ``accumulator_dtype`` or each leaf's dtype);
            zeros after ``init``.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    ema: FlatTree


class _Ema(Elementwise):
    """`ema`, declared: the count and each group's bias correction are its per-step scalars."""

    complex_leaves = True  # optax defines it on complex leaves

    formula, state_cls, fields, counted, name = F.ema, EmaState, ("ema",), True, "ema"
    dtype_options = {"ema": "accumulator_dtype"}

    def __init__(self, decay: float, debias: bool, accumulator_dtype: Any) -> None:
        self.decay = check_decay(decay)
        self.one_minus = 1.0 - self.decay
        self.debias = flag(debias, "debias")
        self.accumulator_dtype = accumulator_dtype
        if accumulator_dtype is not None:  # stored as a dtype: `Elementwise.field_dtypes` reads it
            self.accumulator_dtype = check_float_dtype(accumulator_dtype, "accumulator_dtype", complex=True)

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        bc = bias_correction(self.decay, int(count), ct) if self.debias else 1.0
        return (self.one_minus, self.decay, bc)


def ema(decay: float, debias: bool = True, accumulator_dtype: Any = None) -> GradientTransformationExtraArgs:
    """Exponential moving average of the updates, optionally debiased.

    Each update computes ``count = count + 1``, ``e = (1 - decay) * g + decay * e`` element by
    element and returns ``u = e / (1 - decay ** count)`` with ``debias``, ``u = e`` without.

    The float32 result equals optax's recipe bit for bit: both products and the sum are rounded
    in the accumulator's dtype and the debias is a true division by ``f32(1) - f32(d) ** count``.
    ``count`` saturates at the int32 maximum; ``decay = 1`` with debias gives NaN, as in optax.

    Args:
        decay: decay rate, from 0 to 1 (both included).
        debias: whether to divide by ``1 - decay ** count``.
        accumulator_dtype: storage dtype of the average (float16, bfloat16, float32 or float64); None
            keeps each leaf's dtype.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmaState(count, ema)``, the average
            starting at zeros. The updates keep each leaf's dtype.

    Raises:
        ValueError: ``decay`` is outside the closed interval from 0 to 1, or NaN.
        TypeError: ``decay`` is not a real number, ``debias`` not a bool, or
            ``accumulator_dtype`` not float16, bfloat16, float32 or float64.

    References:
        Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015 (the bias
        correction). optax.ema.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.ema(0.9)
        >>> state = tx.init({"w": np.zeros(2, np.float32)})
        >>> u, state = tx.update({"w": np.array([1.0, 2.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]  # (0.1 * g) / (1 - 0.9)
        [1.0, 2.0]
        >>> u, state = tx.update({"w": np.array([3.0, 4.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]  # (0.1 * 3 + 0.9 * 0.1) / (1 - 0.81), ...
        [2.0526, 3.0526]
    """
    return _Ema(decay, debias, accumulator_dtype).transformation()


# --- apply_every ----------------------------------------------------------------------------


@state_class
class ApplyEvery(NamedTuple):
    """The state of `apply_every`: the step within the cycle and the cycle's sum.

    Attributes:
        count: steps taken in the current cycle, from 0 to ``k - 1`` (int32).
        grad_acc: the sum of this cycle's updates (a `FlatTree` of the params' leaves, in their
            dtypes); zeros after ``init``. After an emitting step it still holds the emitted sum,
            which the next step overwrites.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    grad_acc: FlatTree


class _ApplyEvery(Stage):
    """`apply_every` as a stage: the plan decides whether this step emits."""

    scope = ELEMENT
    complex_leaves = True  # optax defines it on complex leaves

    def __init__(self, k: int) -> None:
        self.k = _check_k(k, "k")

    def init(self, params: Any) -> ApplyEvery:
        layout, device = layout_and_device(params, "params")
        return ApplyEvery(np.int32(0), FlatTree.zeros(layout, None, device))

    def owner(self, state: Any) -> FlatTree | None:
        return field_owner(state, ApplyEvery, "grad_acc")

    def declare(self, spec: Spec, state: Any) -> fuse.Host:
        """A `numbaccum.fuse.Host` over ``state``'s sum: its tick checks the state and finds
        where this step is in the cycle; its run adds the updates and emits on the last step."""
        storage = expect_state(state, ApplyEvery, "grad_acc", spec, renew=False).__dict__
        k, layout, dtypes = self.k, spec.layout, list(spec.layout.group_dtypes)
        step: list = [None, 0, None]  # this step's sum (renewed), place in the cycle, new count

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not isinstance(state, ApplyEvery) or getattr(state.grad_acc, "__dict__", None) is not storage:
                return False
            step[0] = current(state.grad_acc, "grad_acc")
            step[1] = int(state.count) % k
            step[2] = np.int32(int(safe_increment(state.count)) % k)
            return True

        # The sums, the emitted copy and (`numbaccum.step_`) the add to the params, launched
        # over the state's buffers by kept launches: the add of the zeros and of the sum each
        # its own, so that the steps between emits do not prepare them again by turns.
        sums, add_zeros, add_sum = fuse.Launches(), fuse.Launches(), fuse.Launches()

        def accumulated(u: Updates) -> tuple[FlatTree, bool, ApplyEvery]:
            acc, c, count = step
            factor, fresh = u.factor, (c == 0,)
            for gi, (a, g) in enumerate(zip(acc.groups, u.flat.groups)):
                sums.run(F.sum_accumulate, gi, [a, g], factor, fresh)
            return acc, c == k - 1, ApplyEvery(count, acc)

        def run(u: Updates) -> tuple[Updates, ApplyEvery]:
            acc, emits, new_state = accumulated(u)
            if not emits:
                return zeros_output(acc, layout), new_state
            out = sums.settle(Updates(acc, owned=False), acc.workspace("out", dtypes))
            return Updates(out, owned=True), new_state

        def apply(u: Updates, p: FlatTree) -> ApplyEvery:
            acc, emits, new_state = accumulated(u)
            if emits:  # the sum added as it is (the emitted copy's values)
                add_sum.add(p, acc)
            else:  # zeros added, as the updates of the step are (the params' -0.0 become 0.0)
                add_zeros.add(p, zeros_output(acc, layout).flat)
            return new_state

        def passes(apply: bool) -> list:
            c = step[1]
            out = [("kernel", "accumulate", 1.0 if c == 0 else 2.0, 1.0, 1.0 if c == 0 else 2.0)]
            if apply:  # the sum, or zeros, added to the params
                return out + [("apply", "apply_updates_", 2.0, 1.0)]
            return out + [("kernel", "emit the sum", 1.0, 1.0, 0.0)] if c == k - 1 else out

        return fuse.Host(run, passes, "apply_every", tick, settles=False, apply=apply)


def apply_every(k: int = 1) -> GradientTransformationExtraArgs:
    """Sums ``k`` steps of updates and emits the sum every ``k``-th step, zeros otherwise.

    With ``c = count % k``, each update computes ``grad_acc = g + grad_acc`` (``grad_acc = g + 0``
    when ``c == 0``), returns ``u = grad_acc`` when ``c == k - 1`` and ``u = 0`` otherwise, and
    sets ``count = (count + 1) % k``. Unlike optax, a step that emits nothing returns exact zeros
    and a new cycle starts from exact zeros, so a NaN does not survive into the next cycle.

    Args:
        k: the number of steps summed per emitted update, from 1 to the int32 maximum.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ApplyEvery(count, grad_acc)``.

    Raises:
        TypeError: ``k`` is not an int (a bool, a float or a string).
        ValueError: ``k`` is below 1 or above the int32 maximum.

    References:
        optax.apply_every.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.apply_every(2)
        >>> state = tx.init({"w": np.zeros(2, np.float32)})
        >>> u, state = tx.update({"w": np.array([1.0, 2.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]  # the first of two steps: zeros
        [0.0, 0.0]
        >>> u, state = tx.update({"w": np.array([3.0, 4.0], np.float32)}, state)
        >>> [round(float(x), 4) for x in u["w"]]  # the sum of the two steps
        [4.0, 6.0]
    """
    return _ApplyEvery(k).transformation()


def _check_k(k: Any, name: str) -> int:
    # At most the int32 maximum: the step counters are int32 (as in optax), so a larger k would
    # overflow MultiSteps' mini_step, and apply_every's saturating count would never reach it.
    return integer(k, name, minimum=1, maximum=INT32_MAX)


# --- skip predicates ------------------------------------------------------------------------


def _updates_of(updates: Any) -> Updates:
    if isinstance(updates, FlatTree):
        return Updates(updates, owned=False)
    return Updates(as_flat(updates, layout_of(updates, "updates"), "updates")[0], owned=False)


def _skip_not_finite_flat(u: Updates, gradient_step: Any, params: Any) -> tuple[np.bool_, dict]:
    u = u.settled()
    n = sum(ops_for(g).count_nonfinite(g) for g in u.flat.groups)
    skip = np.bool_(n > 0)
    return skip, {"should_skip": skip, "num_not_finite": np.int32(min(n, INT32_MAX))}


def skip_not_finite(updates: Any, gradient_step: Any, params: Any) -> tuple[np.bool_, dict]:
    """Skip predicate for `MultiSteps`: skip when any element of the updates is NaN or +-inf.

    It computes ``num_not_finite = sum(not isfinite(g))`` over every element of every leaf and
    ``should_skip = num_not_finite > 0``. Pass it as ``MultiSteps(...,
    should_skip_update_fn=skip_not_finite)``; `MultiSteps` evaluates it on its flat buffers.

    Args:
        updates: the updates (a tree of arrays, or a `FlatTree`).
        gradient_step: the `MultiSteps` gradient step (unused, part of the protocol).
        params: the params (unused, part of the protocol).

    Returns:
        The pair ``(should_skip, info)``, ``should_skip`` a NumPy bool and ``info`` the dict
            ``{"should_skip": should_skip, "num_not_finite": n}``, ``n`` an int32 (saturating
            at the int32 maximum); `MultiSteps` keeps ``info`` in ``MultiStepsState.skip_state``.

    References:
        optax.skip_not_finite.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> should_skip, info = nba.skip_not_finite({"w": np.array([1.0, np.nan, np.inf])}, 0, None)
        >>> bool(should_skip), int(info["num_not_finite"])
        (True, 2)
    """
    return _skip_not_finite_flat(_updates_of(updates), gradient_step, params)


def _skip_large_flat(
    u: Updates, gradient_step: Any, params: Any, max_squared_norm: float
) -> tuple[np.bool_, dict]:
    u = u.settled()
    s, f = tree_sumsq_scaled(u.flat)  # the one global norm: global_norm's bits
    norm_sq = s / f / f if f != 1.0 else s  # inf only where the squared norm is past float64
    skip = np.bool_(not norm_sq < float(max_squared_norm))
    return skip, {"should_skip": skip, "norm_squared": np.float64(norm_sq)}


def skip_large_updates(
    updates: Any, gradient_step: Any, params: Any, max_squared_norm: float
) -> tuple[np.bool_, dict]:
    """Skip predicate for `MultiSteps`: skip when the updates' squared global norm is too large.

    It computes ``norm_squared = sum(g ** 2)`` over every element of every leaf and
    ``should_skip = not norm_squared < max_squared_norm``, so a NaN norm and equality skip too.
    Bind ``max_squared_norm`` with ``functools.partial`` (by keyword: `MultiSteps` then evaluates
    it on its flat buffers).

    Args:
        updates: the updates (a tree of arrays, or a `FlatTree`).
        gradient_step: the `MultiSteps` gradient step (unused, part of the protocol).
        params: the params (unused, part of the protocol).
        max_squared_norm: the bound on the squared global norm.

    Returns:
        The pair ``(should_skip, info)``, ``should_skip`` a NumPy bool and ``info`` the dict
            ``{"should_skip": should_skip, "norm_squared": norm_squared}``, the squared norm a
            float64; `MultiSteps` keeps ``info`` in ``MultiStepsState.skip_state``.

    References:
        optax.skip_large_updates.

    Examples:
        >>> import functools
        >>> import numpy as np, numbaccum as nba
        >>> skip = functools.partial(nba.skip_large_updates, max_squared_norm=25.0)
        >>> should_skip, info = skip({"w": np.array([3.0, 4.0])}, 0, None)
        >>> bool(should_skip), float(info["norm_squared"])  # 9 + 16 is not below 25
        (True, 25.0)
    """
    return _skip_large_flat(_updates_of(updates), gradient_step, params, max_squared_norm)


# Our predicates, evaluated on the flat buffers (pending factor included) instead of a tree.
FLAT_SKIP_PREDICATES: dict[Callable[..., Any], Callable[..., Any]] = {
    skip_not_finite: _skip_not_finite_flat,
    skip_large_updates: _skip_large_flat,
}


def _skip_target(fn: Callable) -> tuple[Callable, dict]:
    """A skip predicate and its keywords (those of a ``functools.partial`` without arguments)."""
    if isinstance(fn, functools.partial) and not fn.args:
        return fn.func, dict(fn.keywords)
    return fn, {}


def _call_skip(fn: Callable, u: Updates, gradient_step: Any, params: ParamsRef | None) -> tuple[Any, Any]:
    """Evaluates a skip predicate, on the flat buffers when it is one of ours (also bound with
    ``functools.partial`` keywords)."""
    target, kwargs = _skip_target(fn)
    flat = FLAT_SKIP_PREDICATES.get(target)
    if flat is not None:
        return flat(u, gradient_step, params, **kwargs)
    # Not the caller's gradients, which are added to the accumulator after it returns.
    tree = u.handed_out().tree
    out = user_code(fn, tree, gradient_step, params.raw if params is not None else None)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"should_skip_update_fn must return a (should_skip, info) pair, got {short_repr(out, 40)}"
        )
    return out


# --- MultiSteps -----------------------------------------------------------------------------


@state_class
class MultiStepsState(NamedTuple):
    """State of `MultiSteps`.

    Attributes:
        mini_step: mini-steps accumulated in the current cycle (int32).
        gradient_step: emitted (inner) steps so far (int32, saturating).
        inner_opt_state: the inner optimizer's state; it advances only on emitting steps.
        acc_grads: the running mean (or sum) of this cycle's gradients; zeros after emission.
        skip_state: the last info dict of ``should_skip_update_fn`` (``()`` without one).

    optax's five fields, read by field as optax code does. With DP accumulation (an inner
    `differentially_private_aggregate`), the examples summed in ``acc_grads`` this cycle are
    counted in that stage's own state (``DifferentiallyPrivateAggregateState.examples``).
    """

    mini_step: np.int32
    gradient_step: np.int32
    inner_opt_state: Any
    acc_grads: FlatTree
    skip_state: Any = ()


def _default_acc_dtype(dt: np.dtype) -> np.dtype:
    """float64 and complex leaves accumulate in their own dtype (optax's float32 default drops
    the imaginary parts), the others in float32."""
    return dt if dt == np.float64 or dt.kind == "c" else np.dtype(np.float32)


class MultiSteps(Stage):
    """Gradient accumulation: runs ``opt`` on the mean (or sum) of every ``k`` mini-batches.

    Each mini-step updates ``acc = acc + (g - acc) / (mini_step + 1)`` (mean, Welford) or
    ``acc = g + acc`` (sum). On the ``k``-th mini-step the inner optimizer runs on ``acc`` and its
    update is returned; on the others the update is exact zeros. ``k = every_k_schedule`` if an
    int, else ``every_k_schedule(gradient_step)``, read at the start of each cycle.

    Differences from optax (deliberate): steps that emit nothing return exact ``+0.0`` zeros
    (optax returns ``0 * inner_update``, which can be ``-0.0`` or NaN); the accumulator is reset
    to exact zeros on emission, so a NaN in one cycle does not stick forever; and the inner
    optimizer runs only on emitting steps (optax runs it every mini-step and discards the result).

    An update is all or nothing: the schedule is called and, on an emitting step, the inner
    optimizer planned (its state, params and schedules checked) before the gradient is added.
    A ``should_skip_update_fn`` of your own runs on the updates just before they are added; if
    it raises, nothing of this state has changed.

    Its ``init`` returns ``MultiStepsState(mini_step, gradient_step, inner_opt_state, acc_grads,
    skip_state)``; ``has_updated(state)`` says whether the last step emitted an update.

    Args:
        opt: the inner transformation.
        every_k_schedule: ``k`` (an int, NumPy ints too) or a callable of ``gradient_step``.
        use_grad_mean: accumulate the mean (True) or the sum (False).
        should_skip_update_fn: ``fn(updates, gradient_step, params) -> (bool, info)``; a skipped
            mini-step leaves the state unchanged except ``skip_state`` and returns zeros.
        accumulator_dtype: dtype of ``acc_grads``; default float32 for float16 and float32
            leaves, float64 for float64 leaves.

    Raises:
        TypeError: ``opt`` is not a transformation, or one that reshapes its updates (other than
            a leading `differentially_private_aggregate`); ``every_k_schedule`` is neither an int
            nor a callable; ``use_grad_mean`` is not a bool; ``should_skip_update_fn`` is neither
            callable nor None; ``accumulator_dtype`` is not float16, bfloat16, float32 or float64.
        ValueError: ``every_k_schedule`` is below 1 or above the int32 maximum (a schedule's value
            is checked the same way at the update); ``should_skip_update_fn`` is given with DP
            accumulation.

    References:
        optax.MultiSteps.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2, np.float32)}
        >>> opt = nba.MultiSteps(nba.sgd(1.0), every_k_schedule=2)
        >>> state = opt.init(params)
        >>> state = nba.step_(opt, {"w": np.array([1.0, 2.0], np.float32)}, state, params)
        >>> [round(float(x), 4) for x in params["w"]], opt.has_updated(state)
        ([0.0, 0.0], False)
        >>> state = nba.step_(opt, {"w": np.array([3.0, 6.0], np.float32)}, state, params)
        >>> [round(float(x), 4) for x in params["w"]], opt.has_updated(state)  # -1.0 * the mean
        ([-2.0, -4.0], True)
    """

    children_at = "_inner"

    def __init__(
        self,
        opt: Any,
        every_k_schedule: int | Callable[[Any], Any],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable[..., Any] | None = None,
        accumulator_dtype: Any = None,
    ) -> None:
        if callable(every_k_schedule):
            self._k: Any = every_k_schedule
        else:
            self._k = _check_k(every_k_schedule, "every_k_schedule")
        self._opt = with_extra_args_support(transformation(opt, "opt"))
        self._inner = as_stage(self._opt)
        self._foreign = self._inner.foreign()
        # DP accumulation: an inner optimizer that starts by aggregating per-example gradients
        # (`differentially_private_aggregate`) sums them here, and noises them once per cycle.
        inner = self._inner
        first = inner.stages[0] if isinstance(inner, Chain) and inner.stages else inner
        self._dp = first if inner.reshapes and hasattr(first, "declare_accumulation") else None
        if inner.reshapes and self._dp is None:
            raise TypeError("opt: MultiSteps cannot accumulate a transformation that reshapes its updates")
        if self._dp is not None and should_skip_update_fn is not None:
            raise ValueError("should_skip_update_fn: not with DP accumulation (the updates are per example)")
        # The stages after it, run on the noised average of each cycle (None: none).
        rest = inner.stages[1:] if self._dp is not None and isinstance(inner, Chain) else []
        self._rest = Chain(rest) if rest else None
        self.reshapes = self._dp is not None
        if should_skip_update_fn is not None and not callable(should_skip_update_fn):
            raise TypeError(
                f"should_skip_update_fn must be callable or None, got {type(should_skip_update_fn).__name__}"
            )
        self._mean = flag(use_grad_mean, "use_grad_mean")
        self._skip = should_skip_update_fn
        # A skip function of the user's sees a tree of the params' structure: whole leaves of it.
        self.scope = LEAF if should_skip_update_fn is not None else ELEMENT
        self._user_skip = should_skip_update_fn is not None and (
            _skip_target(should_skip_update_fn)[0] not in FLAT_SKIP_PREDICATES
        )
        self._acc_dtype = (
            None
            if accumulator_dtype is None
            else check_float_dtype(accumulator_dtype, "accumulator_dtype", complex=True)
        )

    @property
    def inner_opt(self) -> GradientTransformationExtraArgs:
        """The inner transformation (with extra-args support)."""
        return self._opt

    def init(self, params: Any) -> MultiStepsState:
        """Zero accumulator, the inner state, and the skip function's info for zero updates."""
        layout, device = layout_and_device(params, "params")
        dts = [self._acc_dtype or _default_acc_dtype(d) for d in layout.group_dtypes]
        check_storage(dts, layout, "accumulator_dtype")
        if self._dp is not None:  # the sums of clipped examples: float64 unless asked otherwise
            dts = [self._acc_dtype or np.dtype(np.float64)] * len(layout.group_dtypes)
        acc = FlatTree.zeros(layout, dts, device)
        skip_state: Any = ()
        if self._skip is not None:
            zeros = FlatTree.zeros(layout, None, device)
            ref = ParamsRef(params, layout, None, device)
            _, skip_state = _call_skip(self._skip, Updates(zeros, owned=False), np.int32(0), ref)
        # A collective inside (`numbaccum.distributed.allreduce_mean`) compares this schedule
        # across the ranks: another k on one rank would pair the collectives of different steps.
        with inside(Note((), self._describe_schedule)):
            inner_state = self._opt.init(params)
        return MultiStepsState(np.int32(0), np.int32(0), inner_state, acc, skip_state)

    def _describe_schedule(self) -> str:
        """``every_k_schedule`` as text (a schedule: its name and its first value)."""
        if not callable(self._k):
            return f"MultiSteps(every_k_schedule={self._k})"
        name = getattr(self._k, "__qualname__", type(self._k).__name__)
        return f"MultiSteps(every_k_schedule={name}: {self._schedule(np.int32(0))} at gradient_step 0)"

    @staticmethod
    def _emitting(k: int, gradient_step: Any) -> Note:
        """What an emitting step runs its inner optimizer under: a collective inside compares
        ``k`` and the gradient step across the ranks (`numbaccum.lockstep`)."""
        g = int(gradient_step)
        return Note((k, g), lambda: f"MultiSteps every_k_schedule {k} at gradient_step {g}")

    def has_updated(self, state: MultiStepsState) -> bool:
        """True right after an emitting step (optax: ``mini_step == 0 and gradient_step > 0``)."""
        return bool(int(state.mini_step) == 0 and int(state.gradient_step) > 0)

    def gradient_transformation(self) -> GradientTransformationExtraArgs:
        """This MultiSteps as a GradientTransformation ``(init, update)``."""
        return self.transformation()

    def refuses_complex(self) -> Stage | None:
        return self._inner.refuses_complex()

    def owner(self, state: Any) -> FlatTree | None:
        return field_owner(state, MultiStepsState, "acc_grads")

    def foreign(self) -> bool:
        # A skip function of the user's runs while the step runs, before the accumulator is
        # written: nothing of ours to restore, but an enclosing chain's earlier stages wrote.
        return self._foreign or self._user_skip

    def _schedule(self, gradient_step: np.int32) -> int:
        if not callable(self._k):
            return self._k
        k = self._k(gradient_step)
        # The same rule as a constant k: an int in [1, int32 max]; 2.7, True or "3" are refused,
        # not truncated or parsed.
        try:
            return _check_k(k, "every_k_schedule's value")
        except (TypeError, ValueError) as e:
            shown = short_repr(k.item() if isinstance(k, np.generic) else k, 40)  # 0, not np.int64(0)
            raise type(e)(
                f"every_k_schedule returned {shown} at gradient_step {gradient_step}: {e}"
            ) from None

    def take(self, updates: Any, state: Any, params: Any, owner: FlatTree | None) -> tuple[Updates, str]:
        if self._dp is not None:  # per-example gradients, of their own layout
            return self._dp.take(updates, None, params, None)
        return super().take(updates, state, params, owner)

    def _inbox(self, owner: FlatTree | None, layout: Layout, side: Any) -> Callable[[], FlatTree]:
        # Per-example gradients have a layout of their own (the batch's), not the accumulator's.
        return super()._inbox(None if self._dp is not None else owner, layout, side)

    def _inner_states(self, state: MultiStepsState) -> tuple | None:
        """The inner stages' states in order (DP accumulation: the aggregation's first), None
        when ``state.inner_opt_state`` is not the inner chain's."""
        inner = self._inner
        return inner._states(state.inner_opt_state) if isinstance(inner, Chain) else (state.inner_opt_state,)

    def declare(self, spec: Spec, state: Any) -> fuse.Host:
        """The control node over ``state``'s accumulator, after checking it: `_Cycle`, or with
        DP accumulation `_DpCycle` (for per-example gradients of ``spec``: one per batch size);
        the inner optimizer's plan is declared on the first emitting step
        (`numbaccum.control.Inner`)."""
        if self._dp is not None:
            return _DpCycle(self, state, spec).part
        acc = expect_state(state, MultiStepsState, "acc_grads", spec, renew=False)
        return _Cycle(self, acc, spec).part


class _DpCycle:
    """`MultiSteps` with DP accumulation, declared for per-example gradients of one spec and one
    accumulator: each mini-step adds its clipped examples to the float64 sums; the emitting one
    noises and averages them (`numbaccum.privacy._Accumulation`), runs the kept plan of the rest
    of the inner chain on the result and resets the sums. ``part`` is the `numbaccum.fuse.Host`
    the runner keeps: a reshaping one, its ``spec`` the params' (`numbaccum.runner`). Its tick
    checks the state, calls the schedule and checks the DP state (and, on an emitting step,
    ticks the rest's plan) before anything is written."""

    def __init__(self, ms: MultiSteps, state: Any, spec: Spec) -> None:
        if not isinstance(state, MultiStepsState) or not isinstance(state.acc_grads, FlatTree):
            raise wrong_state("MultiStepsState", state)
        states = ms._inner_states(state)
        if states is None:
            raise ValueError("state.inner_opt_state: not the inner chain's state")
        acc = state.acc_grads
        self.sums = ms._dp.declare_accumulation(spec, acc, states[0])  # type: ignore[union-attr]
        out_spec = self.sums.spec
        self.ms, self.storage, self.layout = ms, acc.__dict__, out_spec.layout
        self.rest = Inner(ms._rest, out_spec, "multisteps.") if ms._rest is not None else None
        inner = ms._inner
        self.names = inner.names if isinstance(inner, Chain) else None
        self.chained = isinstance(inner, Chain)
        # Resolved once, not on every step: the inner stages' states (`MultiSteps._inner_states`)
        # and, for a constant every_k_schedule, k (`MultiSteps._schedule`: the int itself).
        self.split = inner._states if isinstance(inner, Chain) else None
        self.k = None if callable(ms._k) else ms._k
        # The inner state from the stages' states: a chain's tuple (or named chain's dict), else
        # the one stage's state.
        names = self.names
        if not self.chained:
            self.pack: Callable[[list], Any] = operator.itemgetter(0)
        elif names is None:
            self.pack = tuple
        else:
            self.pack = lambda new: dict(zip(names, new))
        # explain's ratios, per byte of the per-example input: the float64 sums, the updates
        x = float(np.dot(spec.layout.group_sizes, [d.itemsize for d in spec.layout.group_dtypes]))
        a = float(np.dot(out_spec.layout.group_sizes, [g.dtype.itemsize for g in acc.groups]))
        self.acc_ratio = a / x if x else 1.0
        self.out_ratio = 1.0 / max(self.sums.batch, 1)  # the average: one example's size
        # This step's values (`tick`).
        self.state: Any = None
        self.states: tuple = ()
        self.acc: Any = None
        self.emits = False
        self.note: Note | None = None
        self.launches, self.adds = fuse.Launches(), Adds()  # the zeroing's and the add's, kept
        # (its run is `_step` without params: the updates come back)
        self.part = fuse.Host(
            self._step, self.passes, "multisteps", self.tick, settles=False, apply=self.apply, spec=out_spec
        )

    def tick(self, state: Any, params: ParamsRef | None, extra: dict) -> bool:
        if not isinstance(state, MultiStepsState):
            return False
        if getattr(state.acc_grads, "__dict__", None) is not self.storage:  # other buffers: declared again
            return False
        split = self.split
        states = split(state.inner_opt_state) if split is not None else (state.inner_opt_state,)
        if states is None:
            return False  # declared again: the error above
        acc = current(state.acc_grads, "acc_grads")
        k = self.k if self.k is not None else self.ms._schedule(state.gradient_step)
        mini = int(state.mini_step)
        emits = mini >= k - 1
        if not self.sums.tick(states[0], mini == 0, emits):
            return False
        if emits and self.rest is not None and not self.rest.tick(tuple(states[1:]), params, extra):
            return False
        self.state, self.states, self.acc, self.emits = state, states, acc, emits
        self.note = self.ms._emitting(k, state.gradient_step) if emits else None
        return True

    def apply(self, u: Updates, p: FlatTree) -> MultiStepsState:
        """`run`, the emitted update added to ``p`` (in the rest's last pass where its plan can);
        a step that emits nothing leaves ``p`` as it is."""
        return self._step(u, p)[1]

    def _step(self, u: Updates, p: FlatTree | None = None) -> tuple[Any, MultiStepsState]:
        """The step on ``u``: ``(updates, new state)``, or with params ``p`` ``(None, new
        state)``, the emitted update added to them (the part's ``run``, without them)."""
        state, states, acc = self.state, self.states, self.acc
        emitted, dp_state = self.sums.run(u, acc)
        if emitted is None:  # a mini-step: the DP stage's state counts the examples; the others wait
            mini = np.int32(int(state.mini_step) + 1)
            inner_state = self.pack([dp_state, *states[1:]])
            new = MultiStepsState(mini, state.gradient_step, inner_state, acc, state.skip_state)
            return (zeros_output(acc, self.layout) if p is None else None), new
        out: Updates | None = emitted
        rest_states: Any = states[1:]
        try:
            with inside(self.note):  # type: ignore[arg-type]  # set where emits is
                if self.rest is None:
                    if p is not None:
                        self.adds(p, emitted)
                elif p is None:
                    out, rest_states = self.rest.run(emitted, settle=True)
                else:
                    rest_states = self.rest.apply(emitted, p)
        except SkipStep as e:  # the rest skipped (a clip saw NaN): zeros, cycle over
            out, rest_states = zeros_output(acc, self.layout), e.new_state
        for gi, a in enumerate(acc.groups):  # `Ops.fill_`'s kernel, its launch kept
            self.launches.run(F.fill, gi, [a], ONE, (0.0,))
        inner_state = self.pack([dp_state, *rest_states])
        step = safe_increment(state.gradient_step)
        new = MultiStepsState(np.int32(0), step, inner_state, acc, state.skip_state)
        return (out if p is None else None), new

    def passes(self, apply: bool) -> list:
        """This step's passes (`numbaccum.explain`), per parameter of the per-example input: the
        examples' norms, their clipped sums added to the accumulator, and on an emitting step
        the noised average written (the updates of the rest's passes), the rest's passes and
        the reset."""
        a, b = self.acc_ratio, self.out_ratio
        old = 0.0 if self.sums.fresh else a  # the sums so far, read
        out: list = [("reduction", "per-example norms", 1.0, 0.0, 1.0)]
        if not self.emits:
            return [*out, ("kernel", "clipped sums, accumulated", 1.0 + old, a, old + a)]
        out.append(("kernel", "clipped sums + noise, averaged", 1.0 + old, b, old))
        if self.rest is not None:
            out += self.rest.passes(apply, b)
        elif apply:
            out.append(("apply", "apply_updates_", 2.0 * b, b))
        return [*out, ("kernel", "reset", 0.0, a, 0.0)]


class _Cycle:
    """`MultiSteps` declared for one accumulator: each mini-step adds the gradient to it (unless
    the skip function says not to); the one that ends the cycle runs the inner optimizer's kept
    plan on it, then resets it. ``part`` is the `numbaccum.fuse.Host` the runner keeps: its tick
    checks the state, calls the schedule and, on an emitting step, ticks the inner plan; its
    ``apply`` adds the emitted update to the params in the inner plan's last pass."""

    def __init__(self, ms: MultiSteps, acc: FlatTree, spec: Spec) -> None:
        self.ms, self.storage, self.layout = ms, acc.__dict__, spec.layout
        self.inner = Inner(ms._inner, spec, "multisteps.")
        self.skip_fn, self.mean = ms._skip, ms._mean
        self.guard = ms._foreign  # foreign code inside: acc restored if it raises
        sizes = np.array(spec.layout.group_sizes, np.float64)
        x = float(np.dot(sizes, [d.itemsize for d in spec.layout.group_dtypes]))
        self.acc_ratio = float(np.dot(sizes, [g.dtype.itemsize for g in acc.groups])) / x if x else 1.0
        self.cast = acc.group_dtypes != spec.layout.group_dtypes
        # This step's values (`tick`).
        self.state: Any = None
        self.acc: Any = None
        self.params: ParamsRef | None = None
        self.emits = False
        self.note: Note | None = None
        self.part = fuse.Host(self.run, self.passes, "multisteps", self.tick, settles=False, apply=self.apply)

    def tick(self, state: Any, params: ParamsRef | None, extra: dict) -> bool:
        if not isinstance(state, MultiStepsState):
            return False
        if getattr(state.acc_grads, "__dict__", None) is not self.storage:  # other buffers: declared again
            return False
        acc = current(state.acc_grads, "acc_grads")
        k = self.ms._schedule(state.gradient_step)
        emits = int(state.mini_step) >= k - 1
        if emits and not self.inner.tick(state.inner_opt_state, params, extra):
            return False
        self.state, self.acc, self.params, self.emits = state, acc, params, emits
        self.note = self.ms._emitting(k, state.gradient_step) if emits else None
        return True

    def accumulate(self, u: Updates) -> tuple[bool, Any]:
        """Adds ``u`` to the accumulator unless the skip function says not to: ``(skipped,
        skip_state)``."""
        state = self.state
        skip_state = state.skip_state
        if self.skip_fn is not None:
            skip, skip_state = _call_skip(self.skip_fn, u, state.gradient_step, self.params)
            if np.ndim(skip) != 0 or np.asarray(skip).dtype != np.bool_:
                raise ValueError(f"should_skip_update_fn must return a bool scalar, got {skip!r}")
            if bool(skip):
                return True, skip_state
        mini = int(state.mini_step)
        fresh = mini == 0
        for a, g in zip(self.acc.groups, u.flat.groups):
            if self.mean:
                ops_for(g).mean_accumulate_(a, g, u.factor, mini + 1, fresh)
            else:
                ops_for(g).sum_accumulate_(a, g, u.factor, fresh)
        return False, skip_state

    def inner_updates(self) -> Updates:
        """The accumulator as the inner optimizer's input, in the updates' dtypes; it writes its
        result to a buffer of its own: not into acc, which would then be copied out before the
        reset."""
        acc, dtypes = self.acc, list(self.layout.group_dtypes)
        return Updates(
            _as_update_dtypes(acc, self.layout), owned=False, scratch=lambda: acc.workspace("emit", dtypes)
        )

    def emitted(self, inner_state: Any, skip_state: Any) -> MultiStepsState:
        for a in self.acc.groups:
            ops_for(a).fill_(a, 0.0)
        step = safe_increment(self.state.gradient_step)
        return MultiStepsState(np.int32(0), step, inner_state, self.acc, skip_state)

    def waiting(self, skip_state: Any) -> MultiStepsState:
        state = self.state
        mini = np.int32(int(state.mini_step) + 1)
        return MultiStepsState(mini, state.gradient_step, state.inner_opt_state, self.acc, skip_state)

    def run(self, u: Updates) -> tuple[Updates, MultiStepsState]:
        if self.emits and self.guard:
            return undoable(self._run, self._guarded())(u)
        return self._run(u)

    def apply(self, u: Updates, p: FlatTree) -> MultiStepsState:
        """`run`, the emitted update added to ``p`` in the inner optimizer's last pass
        (`numbaccum.step_`); a step that emits nothing leaves ``p`` as it is."""
        if self.emits and self.guard:
            return undoable(self._apply, self._guarded())(u, p)
        return self._apply(u, p)

    def _guarded(self) -> Any:
        """What foreign code may hold while it runs: acc (added to before it runs), and a
        `Foreign` inner's own state."""
        state = self.state
        return (self.acc, state.inner_opt_state) if isinstance(self.ms._inner, Foreign) else self.acc

    def _run(self, u: Updates) -> tuple[Updates, MultiStepsState]:
        acc, layout, state = self.acc, self.layout, self.state
        skipped, skip_state = self.accumulate(u)
        if skipped:
            keep_states(state)
            return zeros_output(acc, layout), state._replace(skip_state=skip_state)
        if not self.emits:
            return zeros_output(acc, layout), self.waiting(skip_state)
        inner_in = self.inner_updates()
        # settle: a factor left pending at the end (the learning rate) is applied in the last
        # pass, not in a pass of its own when the caller settles the updates.
        try:
            with inside(self.note):  # type: ignore[arg-type]  # set where emits is
                out, inner_state = self.inner.run(inner_in, settle=True)
        except SkipStep as e:  # the inner optimizer skipped (a clip saw NaN): zeros, cycle over
            return zeros_output(acc, layout), self.emitted(e.new_state, skip_state)
        # The result is moved out of acc first if it still lives there.
        if out.flat is acc or out.flat is inner_in.flat:
            out = Updates(out.into(acc.workspace("emit", list(layout.group_dtypes))), owned=True)
        return out, self.emitted(inner_state, skip_state)

    def _apply(self, u: Updates, p: FlatTree) -> MultiStepsState:
        skipped, skip_state = self.accumulate(u)
        if skipped:
            keep_states(self.state)
            return self.state._replace(skip_state=skip_state)
        if not self.emits:
            return self.waiting(skip_state)
        try:
            with inside(self.note):  # type: ignore[arg-type]  # set where emits is
                inner_state = self.inner.apply(self.inner_updates(), p)
        except SkipStep as e:  # the inner optimizer skipped: params untouched, cycle over
            inner_state = e.new_state
        return self.emitted(inner_state, skip_state)

    def passes(self, apply: bool) -> list:
        """This step's passes (`numbaccum.explain`): the skip function's check, the
        accumulation, and on an emitting step the cast to the updates' dtypes, the inner
        optimizer's passes and the reset."""
        a, out = self.acc_ratio, []
        if self.skip_fn is not None:  # the library's predicates read the updates once; a user's: unknown
            known = _skip_target(self.skip_fn)[0] in FLAT_SKIP_PREDICATES
            check = ("reduction", 1.0, 0.0, 1.0) if known else ("opaque", None, None)
            out.append((check[0], "should_skip_update_fn", *check[1:]))
        fresh = int(self.state.mini_step) == 0
        out.append(("kernel", "accumulate", 1.0 + (0.0 if fresh else a), a, (0.0 if fresh else a) + a))
        if self.emits:
            if self.cast:
                out.append(("kernel", "cast to the updates' dtypes", a, 1.0, 0.0))
            out += self.inner.passes(apply)
            out.append(("kernel", "reset", 0.0, a, 0.0))
        return out


def _as_update_dtypes(acc: FlatTree, layout: Layout) -> FlatTree:
    if acc.group_dtypes == layout.group_dtypes:
        return acc
    cast = acc.workspace("cast", list(layout.group_dtypes))
    for dst, src in zip(cast.groups, acc.groups):
        ops_for(src).scale_(dst, src, ONE)
    return cast
