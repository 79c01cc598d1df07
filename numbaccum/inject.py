"""`inject_hyperparams`: hyperparameters that live in the state, so a loop can change them.

optax's wrapper, with its state (`InjectStatefulHyperparamsState`): the numeric arguments of the
factory are kept in ``state.hyperparams`` (a dict the caller may change between steps), the
callable ones are schedules of the step, and each update builds the inner transformation from
the current values. Building one is Python work only (the kernels take their scalars as
arguments; nothing is compiled again), and the ones built last are kept while the values repeat.

It is a declared stage like the others (`numbaccum.fuse.Wrapped`): its parts are those of the
inner transformation, kept in the runner's plan, so inside a `chain` the inner stages fuse with
their neighbours and `numbaccum.explain` shows them. Each step's tick checks the state, calls
the schedules, checks and converts the values, finds the declaration of the inner
transformation built with them (built and declared once per values, the few last kept with the
plan), ticks it and puts its values into the plan's parts (`numbaccum.fuse.adopter`), all
before anything is written. Values that repeat cost a dictionary lookup; a schedule whose value
changes every step builds and declares a transformation every step (Python only).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from . import _bounded, base, fuse
from ._checks import wrong_state
from .base import Stage
from .declared import safe_increment
from .flat import FlatTree
from .layout import Layout, check_float_dtype, is_float, real_dtype
from .protocol import GradientTransformationExtraArgs, state_class
from .traits import ELEMENT
from .tree import tree_flatten
from .updates import Spec, Updates

__all__ = [
    "InjectHyperparamsState",
    "InjectStatefulHyperparamsState",
    "WrappedSchedule",
    "WrappedScheduleState",
    "inject_hyperparams",
    "inject_stateful_hyperparams",
]


@state_class
class InjectStatefulHyperparamsState(NamedTuple):
    """The state of `inject_hyperparams`: the hyperparameters, their schedules' states and the
    inner state (also exported as ``InjectHyperparamsState``, optax's older name).

    Attributes:
        count: updates so far (int32, saturating at the int32 maximum).
        hyperparams: a dict from argument name to the value the last update used (the initial
            values after ``init``), floats as NumPy scalars of the hyperparameters' dtype (a JAX
            array of a strong dtype as given, as optax keeps it); the caller may set an entry
            between updates (a scheduled entry is overwritten).
        hyperparams_states: a dict from the name of each scheduled argument to its schedule's
            state (a `WrappedScheduleState` for a plain function of the step count).
        inner_state: the state of the inner transformation.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    hyperparams: dict[str, Any]
    hyperparams_states: dict[str, Any]
    inner_state: Any


# optax's older name (its state had no ``hyperparams_states``); kept for code that names it.
InjectHyperparamsState = InjectStatefulHyperparamsState


@state_class
class WrappedScheduleState(NamedTuple):
    """The state of a `WrappedSchedule`: the step count.

    Attributes:
        count: updates so far, the argument of the schedule function (int32, saturating at the
            int32 maximum); 0 after ``init``.
    """

    count: np.int32  # type: ignore[assignment]


class WrappedSchedule:
    """A schedule of the step count as a stateful schedule.

    It follows optax's protocol: ``init() -> state``, ``update(state, **extra_args) -> state``,
    ``__call__(state, **extra_args) -> value``. The value is ``schedule_fn(state.count)``;
    ``update`` sets ``count = count + 1`` (saturating at the int32 maximum); the extra arguments
    are ignored. `inject_hyperparams` wraps each plain callable hyperparameter in one.

    Args:
        schedule_fn: the schedule, a function of the step count (``fn(count) -> value``).

    References:
        optax.WrappedSchedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.WrappedSchedule(nba.linear_schedule(0.0, 1.0, 10))
        >>> state = sched.init()
        >>> round(float(sched(state)), 4)
        0.0
        >>> state = sched.update(state)
        >>> round(float(sched(state)), 4)
        0.1
    """

    def __init__(self, schedule_fn: Callable[[Any], Any]) -> None:
        self.schedule_fn = schedule_fn

    def init(self) -> WrappedScheduleState:
        """The initial state, ``WrappedScheduleState(count=0)``."""
        return WrappedScheduleState(np.int32(0))

    def update(self, state: WrappedScheduleState, **extra_args: Any) -> WrappedScheduleState:
        """The next state: ``count + 1``, saturating at the int32 maximum."""
        return WrappedScheduleState(safe_increment(state.count))

    def __call__(self, state: WrappedScheduleState, **extra_args: Any) -> Any:
        """The schedule's value at ``state.count``: ``schedule_fn(state.count)``."""
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
    'highest')`` for float trees; bfloat16 too, of NumPy kind ``'V'``); a complex leaf counts as
    its parts' dtype (optax would make the hyperparameters complex: they are real numbers); None
    for a tree with no such leaf."""
    if isinstance(tree, FlatTree):
        dtypes = list(tree.layout.dtypes)
    else:
        dtypes = [np.dtype(x.dtype) for x in tree_flatten(tree)[0] if hasattr(x, "dtype")]
    floats = [r for r in map(real_dtype, dtypes) if is_float(r)]
    return max(floats, key=lambda d: d.itemsize) if floats else None


def _convert_floats(value: Any, dtype: np.dtype | None) -> Any:
    """A float hyperparameter as a NumPy scalar of ``dtype`` (optax casts them to the params'
    dtype, bfloat16 too); a JAX array of a strong dtype (not a weakly typed Python number), ints,
    bools and anything else as they are (optax keeps those)."""
    if isinstance(value, (bool, np.bool_)) or dtype is None:
        return value
    if isinstance(value, (float, np.floating)) or (
        isinstance(value, (np.ndarray, np.generic)) and value.shape == () and is_float(value.dtype)
    ):
        return dtype.type(value)
    if getattr(value, "shape", None) == () and not isinstance(value, numbers.Number):
        dt = getattr(value, "dtype", None)  # a NumPy dtype for JAX, a torch.dtype for PyTorch
        real_float = isinstance(dt, np.dtype) and is_float(dt)
        if real_float and getattr(value, "weak_type", None) is False:
            return value  # a JAX array of a dtype of its own: kept as it is, as optax keeps it
        if real_float or getattr(dt, "is_floating_point", False):
            return dtype.type(float(value))
    return value


def _scalar(value: Any, what: str, name: str) -> Any:
    """``value``, or ValueError naming ``what.format(name)`` when it is an array that is not a
    scalar: a hyperparameter is one number (every factory reads it as one), and the key of the
    kept transformations reads it with ``.item()``. (The message is formatted only when raised:
    this runs for every hyperparameter of every update.)"""
    shape = getattr(value, "shape", None)
    if shape is None or isinstance(value, type):
        return value
    try:
        shape = tuple(shape)
    except TypeError:
        return value
    if shape != ():
        raise ValueError(
            f"{what.format(name)}: an array of shape {shape}, expected a scalar (shape ()); name an "
            "argument that takes an array in static_args"
        )
    return value


def _key(hparams: dict) -> tuple | None:
    """A hashable key of the values, their types included (1, 1.0 and True are equal but make
    different transformations); None when one is not hashable: then nothing is kept. The names
    in the dict's order: `_InjectHyperparams._values` makes them in the same order every step."""
    values = tuple(hparams.values())
    key = (tuple(hparams), values, tuple(map(type, values)))
    try:
        hash(key)
    except TypeError:  # a 0-d array (an int one, or a JAX one kept as it is): by its value
        values = tuple(v.item() if getattr(v, "shape", None) == () else v for v in values)
        key = (key[0], values, key[2])
        try:
            hash(key)
        except TypeError:
            return None
    # -0.0 == 0.0, and they hash alike, but a learning rate of -0.0 gives +0.0 updates where 0.0
    # gives -0.0 (optax's bits): the sign of each float zero is part of the key.
    signs = []
    for v in values:  # a loop, not a generator: asked every step where a value is zero
        signs.append(math.copysign(1.0, v) if isinstance(v, (float, np.floating)) and v == 0 else 0.0)
    return (*key, tuple(signs))


def _widest(layout: Layout) -> np.dtype | None:
    """The widest floating dtype of a layout's leaves (`_highest_float` of a tree of it)."""
    best = None
    for d in layout.group_dtypes:  # one or two groups: a loop, not max() with a key
        d = real_dtype(d)  # a complex group: its parts' dtype, as `_highest_float` counts it
        if is_float(d) and (best is None or d.itemsize > best.itemsize):
            best = d
    return best


# How many inner transformations one `inject_hyperparams` keeps, by their values: a loop that
# alternates a few settings, or threads with values of their own, reuse theirs. Few, because a
# stateless inner stage keeps workspaces of its own (per thread), and a schedule that changes
# every step makes a new one at every step anyway.
_BUILT_KEPT = 4
_ONE, _INT32_MAX = np.int32(1), np.iinfo(np.int32).max


class _InjectHyperparams(Stage):
    """`inject_hyperparams` as a stage: declares the parts of the inner transformation (`declare`),
    whose tick takes this step's values from the declaration of the transformation built with
    them; the new state is an `InjectStatefulHyperparamsState` around the inner one.

    Whether the factory's transformations run foreign code or reshape their updates is what a
    chain must know before it plans (`Stage.foreign`, ``reshapes``): it is read, once, from the
    transformation built with the initial values (the factory and the schedules are called at
    construction for it); unknown when that raises (then foreign, which costs an enclosing
    chain snapshot copies, never correctness). A factory whose kind of transformation changes
    with the values is refused at the plan that builds the other kind.
    """

    scope = ELEMENT
    children_at = "probe"  # the inner stage at the initial values

    def __init__(
        self,
        factory: Callable[..., Any],
        other: dict,
        numeric: dict,
        schedules: dict,
        fixed_dtype: np.dtype | None,
    ) -> None:
        self.factory, self.other, self.numeric, self.schedules = factory, other, numeric, schedules
        self.fixed_dtype = fixed_dtype
        self.names = frozenset(numeric)
        self.built = _bounded.Bounded(_BUILT_KEPT)  # key of the values -> the inner stage
        try:
            states = {k: f.init() for k, f in schedules.items()}
            probe: Stage | None = self._make({**numeric, **self._values({}, states, fixed_dtype, {})})
        except Exception:  # noqa: BLE001 - raised again, named, by init or the plan
            probe = None
        self.probe = probe  # what `owner` and `take` ask about the inner states
        self._foreign = True if probe is None else probe.foreign()
        self.reshapes = False if probe is None else probe.reshapes  # type: ignore[misc]

    def _make(self, hparams: dict) -> Stage:
        return base.as_stage(base.with_extra_args_support(self.factory(**self.other, **hparams)))

    def _build(self, hparams: dict) -> Stage:
        """The inner stage of these values: kept while they repeat (`_BUILT_KEPT`)."""
        key = _key(hparams)
        got = self.built.get(key) if key is not None else None
        if got is not None:
            return got
        stage = self._make(hparams)
        if stage.reshapes != self.reshapes or (stage.foreign() and not self._foreign):
            raise TypeError(
                "inject_hyperparams: inner_factory returned another kind of transformation for "
                f"{hparams} than for the initial values (one that "
                f"{'reshapes its updates' if stage.reshapes != self.reshapes else 'runs foreign code'})"
            )
        return stage if key is None else self.built.put(key, stage)

    def _values(self, state_hparams: dict, states: dict, dtype: np.dtype | None, extra: dict) -> dict:
        """This step's values: the state's, then each schedule's (checked, floats converted)."""
        schedules = self.schedules
        done = None if dtype is None else dtype.type  # a value of it is checked and converted
        hparams = {}
        for k, v in state_hparams.items():
            if k not in schedules:
                same = type(v) is done
                hparams[k] = v if same else _convert_floats(_scalar(v, "state.hyperparams[{!r}]", k), dtype)
        for k, f in schedules.items():
            value = _scalar(f(states[k], **extra), "{} (the schedule's value)", k)
            hparams[k] = _convert_floats(value, dtype)
        return hparams

    def foreign(self) -> bool:
        return self._foreign

    def undo_states(self, state: Any) -> tuple:
        if self.probe is None or not isinstance(state, InjectStatefulHyperparamsState):
            return ()
        return self.probe.undo_states(state.inner_state)  # its parts run in the plan's runs

    def refuses_complex(self) -> Stage | None:
        return None if self.probe is None else self.probe.refuses_complex()

    def owner(self, state: Any) -> FlatTree | None:
        if self.probe is None or not isinstance(state, InjectStatefulHyperparamsState):
            return None
        return self.probe.owner(state.inner_state)

    def take(self, updates: Any, state: Any, params: Any, owner: FlatTree | None) -> tuple[Updates, str]:
        if self.reshapes:  # per-example updates, converted as the inner stage converts them
            inner = state.inner_state if isinstance(state, InjectStatefulHyperparamsState) else None
            return self.probe.take(updates, inner, params, self.probe.owner(inner))  # type: ignore[union-attr]
        return super().take(updates, state, params, owner)

    def init(self, params: Any) -> InjectStatefulHyperparamsState:
        dtype = self.fixed_dtype or _highest_float(params)
        states = {k: f.init() for k, f in self.schedules.items()}
        hparams = {k: _convert_floats(v, dtype) for k, v in self.numeric.items()}
        hparams.update(self._values({}, states, dtype, {}))
        inner_state = self._build(hparams).init(params)
        return InjectStatefulHyperparamsState(np.int32(0), hparams, states, inner_state)

    def declare(self, spec: Spec, state: Any) -> fuse.Wrapped:
        """The inner transformation's declaration, wrapped (`numbaccum.fuse.Wrapped`): its parts
        run in the plan's runs (fused with the neighbours'), copies (`numbaccum.fuse.shells`)
        of the declaration of the transformation built with the initial values.

        Its tick checks the state, computes this step's values (the state's, the schedules'),
        finds the declaration of the transformation built with them for the inner state's
        buffers (made once per values: the `_BUILT_KEPT` last are kept with the plan), ticks
        it and puts what it computed into the plan's parts (`numbaccum.fuse.adopter`), all
        before anything is written: a bad value raises there, from the factory. A factory
        whose transformation for the new values is built of other parts (a structure the
        plan's runs were not cut for) makes the runner declare the plan again, from it."""
        if not isinstance(state, InjectStatefulHyperparamsState):
            raise wrong_state("InjectStatefulHyperparamsState", state)
        dtype = self.fixed_dtype or _widest(spec.layout)  # the params', as optax
        # The transformation a tick found built of other parts (else the initial values').
        template = self.local().__dict__.pop("template", None) or self.probe
        if template is None:  # the factory raised for the initial values: this state's (raises)
            if not self.names <= state.hyperparams.keys():
                raise ValueError(f"state.hyperparams: missing {sorted(self.names - set(state.hyperparams))}")
            template = self._build(self._values(state.hyperparams, state.hyperparams_states, dtype, {}))
        first = template.declare(spec, state.inner_state)  # raises what is wrong with it
        shell = fuse.shells(first)
        nodes: list = []  # the plan's parts that take each declaration's values (`adopter`)
        shape = fuse.structure(shell, nodes)
        # values key -> (tick, adopt) of the inner declaration built with those values; the
        # initial one is the template's own (its key is never asked: its values may differ)
        decls: dict = {}
        step: list = [None, None, None]  # this step's count, hyperparameters, schedules' states
        names, schedules, values, make = self.names, self.schedules, self._values, self._declared
        cls = InjectStatefulHyperparamsState

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if type(state) is not cls and not isinstance(state, cls):
                return False  # declared again: the error above
            hparams = state.hyperparams
            if not names <= hparams.keys():
                raise ValueError(f"state.hyperparams: missing {sorted(names - set(hparams))}")
            hparams = values(hparams, state.hyperparams_states, dtype, extra)
            vs = tuple(hparams.values())
            key: tuple | None = (tuple(hparams), vs, tuple(map(type, vs)))  # `_key`'s, inline
            try:
                got = decls.get(key)
            except TypeError:  # a value that is not hashable as it is
                key = _key(hparams)
                got = decls.get(key) if key is not None else None
            else:
                if 0.0 in vs:  # a zero, perhaps -0.0 (== 0.0): `_key` tells their signs apart
                    key = _key(hparams)
                    got = decls.get(key)
            if got is None:
                got = make(hparams, key, spec, state.inner_state, nodes, shape, decls)
                if got is None:
                    return False  # built of other parts: declared again, from it
            inner_tick, adopt = got
            old = state.hyperparams_states
            new_states = {k: f.update(old[k], **extra) for k, f in schedules.items()} if schedules else {}
            if not inner_tick(state.inner_state, params, extra):
                return False  # the inner state holds other buffers: declared again
            adopt()
            count = state.count
            # safe_increment's common case inline (every step)
            count = count + _ONE if type(count) is np.int32 and count != _INT32_MAX else safe_increment(count)
            step[0], step[1], step[2] = count, hparams, new_states
            return True

        def wrap(inner_state: Any) -> InjectStatefulHyperparamsState:
            return cls(step[0], step[1], step[2], inner_state)

        return fuse.Wrapped(shell, wrap, "inject_hyperparams", tick, _inner_state)

    def _declared(
        self, hparams: dict, key: Any, spec: Spec, inner_state: Any, shell: list, shape: tuple, decls: dict
    ) -> tuple | None:
        """``(tick, adopt)`` of the declaration of the transformation built with ``hparams``, for
        the buffers of ``inner_state``, its values put into the plan's parts ``shell``
        (`numbaccum.fuse.adopter`), kept in ``decls`` under ``key`` (unless None: values that
        are not hashable); None when it is built of other parts than ``shape`` (then it is the
        template of the next declaration, on this thread)."""
        stage = self._build(hparams)  # a bad value raises here, before anything is written
        root = stage.declare(spec, inner_state)
        adopt = fuse.adopter(shell, shape, root)
        if adopt is None:
            self.local().template = stage
            return None
        got = (fuse.flat_tick(root), adopt)
        if key is not None:
            if len(decls) >= _BUILT_KEPT:
                del decls[next(iter(decls))]  # the oldest: a schedule makes new values every step
            decls[key] = got
        return got


def _inner_state(state: InjectStatefulHyperparamsState) -> Any:
    return state.inner_state


def inject_hyperparams(
    inner_factory: Callable[..., Any],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: Any = None,
) -> Callable[..., GradientTransformationExtraArgs]:
    """Wraps a factory of transformations so that its numeric arguments are state or schedules.

    At each update, for each scheduled argument ``name`` (schedule ``f``, state ``s``) it sets
    ``hyperparams[name] = f(s)`` and ``s = f.update(s)``, then computes ``u, inner_state =
    inner_factory(**fixed, **hyperparams).update(g, inner_state, params)`` and
    ``count = count + 1``; float hyperparameters are cast to the hyperparameters' dtype (a JAX
    array of a strong dtype keeps its own, as optax's). Numeric
    arguments are numbers (bools excepted), 0-d arrays and objects with ``__float__``; bools,
    ``static_args`` and anything else are the ``fixed`` arguments, passed as they are.

    ``inject_hyperparams(adam)(learning_rate=0.1)`` behaves as ``adam(0.1)``, with the state
    ``InjectStatefulHyperparamsState(count, hyperparams, hyperparams_states, inner_state)``;
    between steps a loop may set ``state.hyperparams["learning_rate"] = 0.01``, and the next
    update uses it. A callable argument is a schedule: ``f(count)`` (or an optax stateful
    schedule), called before each update, its value stored in ``hyperparams`` (setting a
    scheduled entry has no effect). Each update takes the transformation
    ``inner_factory(**hyperparams)`` of its values (built, checked and declared once per values:
    Python only, kernels are not compiled again; the few last are kept), before anything is
    written: a bad value raises then, in a `chain` before any of its stages runs. The inner
    stages fuse with the chain's others. The returned function calls ``inner_factory`` (and
    the schedules) once, to know the kind of transformation it makes.

    Args:
        inner_factory: a function returning a transformation (``numbaccum.adam``, ...).
        static_args: names of callable arguments that are not schedules.
        hyperparam_dtype: the dtype of float hyperparameters; None: the widest float dtype of
            the params (of the updates when no params are given), as optax does: bfloat16 for
            bfloat16 params, where adam's ``b2 = 0.999`` becomes 1.0 (pass ``float32`` then).

    Returns:
        A function with ``inner_factory``'s signature returning the wrapped transformation (a
            `GradientTransformationExtraArgs`); its state is ``InjectStatefulHyperparamsState(count,
            hyperparams, hyperparams_states, inner_state)``.

    Raises:
        ValueError: ``static_args`` names an argument ``inner_factory`` does not have; (from
            the returned function) a numeric argument is an array that is not a scalar (the same
            for a value set in ``state.hyperparams`` or returned by a schedule, at the update,
            the state unchanged).
        TypeError: ``hyperparam_dtype`` is not float16, bfloat16, float32 or float64.

    References:
        optax.inject_hyperparams and optax.inject_stateful_hyperparams (``numbaccum``'s one
        wrapper is both: ``inject_stateful_hyperparams`` is this function).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2, np.float32)}
        >>> tx = nba.inject_hyperparams(nba.sgd)(learning_rate=0.1)
        >>> state = tx.init(params)
        >>> state = nba.step_(tx, {"w": np.ones(2, np.float32)}, state, params)
        >>> state.hyperparams["learning_rate"] = 0.5  # used by the next update
        >>> state = nba.step_(tx, {"w": np.ones(2, np.float32)}, state, params)
        >>> [round(float(x), 4) for x in params["w"]]  # -0.1 * 1, then -0.5 * 1
        [-0.6, -0.6]
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
                numeric[name] = _scalar(value, "{}", name)
            else:
                other[name] = value
        return _InjectHyperparams(inner_factory, other, numeric, schedules, fixed_dtype).transformation()

    return wrapped


# optax 0.2.8 has two wrappers: ``inject_hyperparams`` (schedules of the count, state without the
# schedules' states) and ``inject_stateful_hyperparams`` (also `WrappedSchedule`s, and their
# states). numbaccum's one wrapper does both, with the second's state: the same function.
inject_stateful_hyperparams = inject_hyperparams
