"""`inject_hyperparams`: hyperparameters that live in the state, so a loop can change them.

optax's wrapper, with its state (`InjectStatefulHyperparamsState`): the numeric arguments of the
factory are kept in ``state.hyperparams`` (a dict the caller may change between steps), the
callable ones are schedules of the step, and each update builds the inner transformation from
the current values. Building one is Python work only (the kernels take their scalars as
arguments; nothing is compiled again), and the last one built is kept for the next update while
the values do not change.
"""

from __future__ import annotations

import inspect
import numbers
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from .accumulation import safe_increment
from .base import GradientTransformationExtraArgs, with_extra_args_support
from .flat import FlatTree
from .layout import check_float_dtype
from .tree import tree_flatten

__all__ = [
    "InjectHyperparamsState",
    "InjectStatefulHyperparamsState",
    "WrappedSchedule",
    "WrappedScheduleState",
    "inject_hyperparams",
]


class InjectStatefulHyperparamsState(NamedTuple):
    """The step count, the hyperparameters of the last step (by name), the schedules' states
    (by name) and the inner transformation's state."""

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    hyperparams: dict[str, Any]
    hyperparams_states: dict[str, Any]
    inner_state: Any


# optax's older name (its state had no ``hyperparams_states``); kept for code that names it.
InjectHyperparamsState = InjectStatefulHyperparamsState


class WrappedScheduleState(NamedTuple):
    """The state of a plain schedule: the step count."""

    count: np.int32  # type: ignore[assignment]


class WrappedSchedule:
    """A schedule of the step count (``f(count) -> value``) as a stateful schedule (optax's
    protocol: ``init() -> state``, ``update(state, **extra_args) -> state``,
    ``__call__(state, **extra_args) -> value``)."""

    def __init__(self, schedule_fn: Callable[[Any], Any]) -> None:
        self.schedule_fn = schedule_fn

    def init(self) -> WrappedScheduleState:
        return WrappedScheduleState(np.int32(0))

    def update(self, state: WrappedScheduleState, **extra_args: Any) -> WrappedScheduleState:
        return WrappedScheduleState(safe_increment(state.count))

    def __call__(self, state: WrappedScheduleState, **extra_args: Any) -> Any:
        return self.schedule_fn(state.count)


def _stateful(value: Any) -> bool:
    """optax's ``StatefulSchedule``: an object with ``init``, ``update`` and ``__call__``."""
    return (
        callable(value)
        and callable(getattr(value, "init", None))
        and callable(getattr(value, "update", None))
    )


def _highest_float(tree: Any) -> np.dtype | None:
    """The widest floating dtype among the leaves of ``tree`` (optax's ``tree.dtype(tree,
    'highest')`` for float trees); None for a tree with no float leaf."""
    if isinstance(tree, FlatTree):
        dtypes = list(tree.layout.dtypes)
    else:
        dtypes = [np.dtype(x.dtype) for x in tree_flatten(tree)[0] if hasattr(x, "dtype")]
    floats = [d for d in dtypes if d.kind == "f"]
    return max(floats, key=lambda d: d.itemsize) if floats else None


def _convert_floats(value: Any, dtype: np.dtype | None) -> Any:
    """A float hyperparameter as a NumPy scalar of ``dtype`` (optax casts them to the params'
    dtype); ints, bools and anything else as they are."""
    if isinstance(value, (bool, np.bool_)) or dtype is None:
        return value
    if isinstance(value, (float, np.floating)) or (
        isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind == "f"
    ):
        return dtype.type(value)
    if getattr(value, "shape", None) == () and not isinstance(value, numbers.Number):
        dt = getattr(value, "dtype", None)  # a NumPy dtype for JAX, a torch.dtype for PyTorch
        if getattr(dt, "kind", None) == "f" or getattr(dt, "is_floating_point", False):
            return dtype.type(float(value))
    return value


def _scalar(value: Any, what: str) -> Any:
    """``value``, or ValueError naming ``what`` when it is an array that is not a scalar: a
    hyperparameter is one number (every factory reads it as one), and the key of the kept
    transformation reads it with ``.item()``."""
    shape = getattr(value, "shape", None)
    if shape is None or isinstance(value, type):
        return value
    try:
        shape = tuple(shape)
    except TypeError:
        return value
    if shape != ():
        raise ValueError(
            f"{what}: an array of shape {shape}, expected a scalar (shape ()); name an argument that "
            "takes an array in static_args"
        )
    return value


def _key(hparams: dict) -> tuple | None:
    """A hashable key of the values (None when one is not hashable: then nothing is kept)."""
    try:
        key = tuple(
            sorted((k, type(v), v if not isinstance(v, np.ndarray) else v.item()) for k, v in hparams.items())
        )
        hash(key)
    except TypeError:
        return None
    return key


def inject_hyperparams(
    inner_factory: Callable[..., Any],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: Any = None,
) -> Callable[..., GradientTransformationExtraArgs]:
    """Wraps a factory of transformations so that its numeric arguments are state, and any of
    them may be a schedule of the step.

    ``inject_hyperparams(adam)(learning_rate=0.1)`` behaves as ``adam(0.1)``, with the state
    ``InjectStatefulHyperparamsState(count, hyperparams, hyperparams_states, inner_state)``;
    between steps a loop may set ``state.hyperparams["learning_rate"] = 0.01``, and the next
    update uses it. A callable argument is a schedule: ``f(count)`` (or an optax stateful
    schedule), called before each update, its value stored in ``hyperparams`` (setting a
    scheduled entry has no effect). Each update builds ``inner_factory(**hyperparams)`` (Python
    only: kernels are not compiled again), so a bad value raises before anything is written.

    Args:
        inner_factory: a function returning a transformation (``numbaccum.adam``, ...).
        static_args: names of callable arguments that are not schedules.
        hyperparam_dtype: the dtype of float hyperparameters; None: the widest float dtype of
            the params (of the updates when no params are given), as optax does.

    Returns:
        A function with ``inner_factory``'s signature returning the wrapped transformation.

    Raises:
        ValueError: ``static_args`` names an argument ``inner_factory`` does not have; (from
            the returned function) a numeric argument is an array that is not a scalar (the same
            for a value set in ``state.hyperparams`` or returned by a schedule, at the update,
            the state unchanged).
        TypeError: ``hyperparam_dtype`` is not float16, float32 or float64.
    """
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    if not static.issubset(signature.parameters):
        raise ValueError(
            f"static_args must name parameters of inner_factory: got {sorted(static)}, "
            f"parameters are {list(signature.parameters)}"
        )
    fixed_dtype = (
        None if hyperparam_dtype is None else check_float_dtype(hyperparam_dtype, "hyperparam_dtype")
    )

    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformationExtraArgs:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        schedules: dict[str, Any] = {}
        numeric: dict[str, Any] = {}
        other: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if name in static or isinstance(value, (bool, np.bool_)):
                other[name] = value
            elif _stateful(value):
                schedules[name] = value
            elif callable(value):
                schedules[name] = WrappedSchedule(value)
            elif isinstance(value, (numbers.Number, np.ndarray)) or hasattr(value, "__float__"):
                numeric[name] = _scalar(value, name)
            else:
                other[name] = value
        # The inner transformation of the last values, kept while they do not change (its
        # kept buffers and layout memos with it); per thread, like a transformation's buffers.
        last = threading.local()

        def build(hparams: dict) -> GradientTransformationExtraArgs:
            key = _key(hparams)
            got = getattr(last, "entry", None)
            if key is not None and got is not None and got[0] == key:
                return got[1]
            tx = with_extra_args_support(inner_factory(**other, **hparams))
            if key is not None:
                last.entry = (key, tx)
            return tx

        def values(state_hparams: dict, states: dict, dtype: np.dtype | None, extra: dict) -> dict:
            hparams = {
                k: _convert_floats(_scalar(v, f"state.hyperparams[{k!r}]"), dtype)
                for k, v in state_hparams.items()
                if k not in schedules
            }
            for k, f in schedules.items():
                hparams[k] = _convert_floats(
                    _scalar(f(states[k], **extra), f"{k} (the schedule's value)"), dtype
                )
            return hparams

        def init(params: Any) -> InjectStatefulHyperparamsState:
            dtype = fixed_dtype or _highest_float(params)
            states = {k: f.init() for k, f in schedules.items()}
            hparams = {k: _convert_floats(v, dtype) for k, v in numeric.items()}
            hparams.update(values({}, states, dtype, {}))
            inner_state = build(hparams).init(params)
            return InjectStatefulHyperparamsState(np.int32(0), hparams, states, inner_state)

        def update(
            updates: Any, state: Any, params: Any = None, **extra_args: Any
        ) -> tuple[Any, InjectStatefulHyperparamsState]:
            if not isinstance(state, InjectStatefulHyperparamsState):
                raise TypeError(f"state: expected InjectStatefulHyperparamsState, got {type(state).__name__}")
            missing = set(numeric) - set(state.hyperparams)
            if missing:
                raise ValueError(f"state.hyperparams: missing {sorted(missing)}")
            dtype = fixed_dtype or _highest_float(params if params is not None else updates)
            hparams = values(state.hyperparams, state.hyperparams_states, dtype, extra_args)
            tx = build(hparams)  # a bad value raises here, before anything is written
            new_states = {
                k: f.update(state.hyperparams_states[k], **extra_args) for k, f in schedules.items()
            }
            updates, inner_state = tx.update(updates, state.inner_state, params, **extra_args)
            return updates, InjectStatefulHyperparamsState(
                safe_increment(state.count), hparams, new_states, inner_state
            )

        return GradientTransformationExtraArgs(init, update)

    return wrapped
