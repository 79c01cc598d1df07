"""The optax protocol over flat buffers: GradientTransformation, stages, chain.

Every numbaccum transformation is an optax-style ``(init, update)`` pair whose ``update`` is the
bound method of a `Stage`. A stage *declares* its work once for a layout and a state
(``declare(spec, state) -> part``: elementwise kernels and factors, reductions, host steps,
control nodes over inner plans, user code as one opaque part; `numbaccum.fuse`); the runner
(`numbaccum.runner`) keeps that declaration as a plan with the state and replays it each step, in
two phases, so that a failed call changes nothing:

1. the plan's **tick** (host only, writes nothing): validates the state against the updates'
   `Spec` (layout and device), checks params and extra arguments, calls schedules and computes
   every per-step scalar (bias corrections, learning rates, counts);
2. its **passes**: the kernels. They may decide on values they read (a clip's norm, a skip
   predicate) but raise nothing a tick could have caught.

`Updates` carry a pending `Factor` ``(flat / div) * mul`` that the next kernel applies while it
reads the buffer, so ``clip_by_global_norm`` costs no pass of its own. A `chain` declares its
stages' parts as one `numbaccum.fuse.Chained`; each maximal run of elementwise parts is one
generated kernel per dtype group (``NUMBACCUM_FUSE=0``: part by part, the same bits on the CPU).

Workspaces are explicit: a stage names the FlatTree of its state that owns its scratch buffers
(`Stage.owner`); a stateless stage keeps its own, per layout, device and thread (`Stage.kept`).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NamedTuple

import numpy as np

from . import _config, arrays, fuse
from . import runner as _runner
from ._checks import transformation, wrong_state
from ._interrupts import user_code
from ._loans import on_loan
from .contract import ONE
from .flat import FlatTree, Workspace, as_flat, host_check, host_flat, host_leaves, layout_of
from .layout import Layout
from .control import Inner
from .protocol import EmptyState, GradientTransformation, GradientTransformationExtraArgs, state_class
from .traits import ELEMENT
from .transaction import keep_states, reading, state_flats
from .tree import leaves_if_structure, tree_flatten, tree_map, tree_unflatten
from .updates import ParamsRef, SkipStep, Spec, Updates

__all__ = [
    "SnapshotState",
    "chain",
    "copy_state",
    "named_chain",
    "snapshot",
    "stateless",
    "stateless_with_tree_map",
    "with_extra_args_support",
]


def with_extra_args_support(tx: Any) -> GradientTransformationExtraArgs:
    """Wraps ``tx`` so that its ``update`` accepts and drops unknown keyword arguments.

    The wrapped ``update(updates, state, params=None, **extra_args)`` calls ``tx.update(updates,
    state, params)``, the extra keyword arguments dropped; ``init`` and the state are ``tx``'s.
    ``tx`` itself comes back when it already is a `GradientTransformationExtraArgs`, and a
    numbaccum stage (e.g. a `MultiSteps`, or a ``GradientTransformation`` of a stage's ``init``
    and ``update``) comes back as its own transformation, which takes extra arguments already.

    Args:
        tx: a transformation: an object with callable ``init`` and ``update`` (optax's, one of
            your own, or numbaccum's).

    Returns:
        A `GradientTransformationExtraArgs` with ``tx``'s ``init``, state and results.

    Raises:
        TypeError: ``tx`` has no callable ``init`` or ``update``.

    References:
        optax.with_extra_args_support.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> def init(params):
        ...     return nba.EmptyState()
        >>> def update(updates, state, params=None):
        ...     return {k: 2.0 * v for k, v in updates.items()}, state
        >>> tx = nba.with_extra_args_support(nba.GradientTransformation(init, update))
        >>> u, _ = tx.update({"w": np.ones(2)}, tx.init(None), loss=0.5)  # loss is dropped
        >>> [round(float(x), 4) for x in u["w"]]
        [2.0, 2.0]
    """
    if isinstance(tx, GradientTransformationExtraArgs):
        return tx
    if isinstance(tx, Stage):
        return tx.transformation()
    stage = stage_of(tx)
    if stage is not None:  # a GradientTransformation(stage.init, stage.update)
        return stage.transformation()
    transformation(tx, "tx")

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del extra_args
        return tx.update(updates, state, params)

    kept = getattr(tx.update, "numbaccum_stage", None)  # `stateless`'s (`as_stage` finds it)
    if kept is not None:
        update.numbaccum_stage = kept  # type: ignore[attr-defined]
    return GradientTransformationExtraArgs(tx.init, update)


def stateless(f: Callable[[Any, Any], Any]) -> GradientTransformation:
    """A transformation of your own without state: ``u = f(updates, params)``.

    ``f`` gets the updates and the params (None when ``update`` is given none) as the caller
    passed them (in a chain, a plain tree of NumPy arrays: numbaccum copies what it returns),
    and returns the new updates of the same structure.

    Args:
        f: ``f(updates, params) -> updates``.

    Returns:
        A `GradientTransformation`; its state is ``EmptyState()``.

    Raises:
        TypeError: ``f`` is not callable.

    References:
        optax.stateless.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> def halve_where_positive(updates, params):
        ...     return {k: np.where(v > 0, v / 2, v) for k, v in updates.items()}
        >>> tx = nba.chain(nba.stateless(halve_where_positive), nba.scale(-1.0))
        >>> g = {"w": np.array([2.0, -2.0])}
        >>> u, _ = tx.update(g, tx.init(g))
        >>> u["w"].tolist()
        [-1.0, 2.0]
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, EmptyState]:
        del state
        return f(updates, params), EmptyState()

    tx = GradientTransformation(lambda params: EmptyState(), update)
    # `numbaccum.step_` of it replays one kept plan instead of wrapping it anew each call (a
    # cycle, update -> stage -> tx -> update, which the collector frees with the function)
    update.numbaccum_stage = Foreign(tx)  # type: ignore[attr-defined]
    return tx


def stateless_with_tree_map(f: Callable[[Any, Any], Any]) -> GradientTransformation:
    """A transformation of your own without state, leaf by leaf: ``u_i = f(g_i, p_i)``.

    ``f`` gets each leaf of the updates with the params' leaf at the same place (None for each
    when ``update`` is given no params), as `stateless` with `tree_map`.

    Args:
        f: ``f(update_leaf, param_leaf) -> new update leaf``.

    Returns:
        A `GradientTransformation`; its state is ``EmptyState()``.

    Raises:
        TypeError: ``f`` is not callable.

    References:
        optax.stateless_with_tree_map.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.stateless_with_tree_map(lambda g, p: g - 0.1 * p)
        >>> params = {"w": np.array([10.0, 20.0])}
        >>> u, _ = tx.update({"w": np.array([1.0, 1.0])}, tx.init(params), params)
        >>> u["w"].tolist()
        [0.0, -1.0]
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")

    def per_leaf(updates: Any, params: Any) -> Any:
        if params is None:
            return tree_map(lambda g: f(g, None), updates)
        return tree_map(f, updates, params)

    return stateless(per_leaf)


# --- the stage protocol ---------------------------------------------------------------------


NO_PARAMS_MSG = (
    "You are using a transformation that requires the current value of parameters, but you are "
    "not passing `params` when calling `update`."
)  # optax's words


def host_step(
    run: Callable[[Updates, ParamsRef | None], Updates],
    passes: tuple | None,
    name: str,
    params: bool = False,
    settle: bool = False,
) -> fuse.Host:
    """A stateless stage's declared `numbaccum.fuse.Host` part: ``run(updates, params) ->
    updates`` each step, the state passed through as it is. Its tick keeps the step's params
    (a ValueError with optax's message when the stage reads them, ``params``, and none were
    given: before anything runs). ``settle``: ``run`` is given the updates settled, a pending
    factor applied first by kept launches (`numbaccum.fuse.Launches.settle`: the kernel of
    `Updates.settled`, the same bits)."""

    def tick(state: Any, p: ParamsRef | None, extra: dict) -> bool:
        if params and p is None:
            raise ValueError(NO_PARAMS_MSG)
        part.params, part.new_state = p, state
        return True

    if settle:
        launches = fuse.Launches()

        def step(u: Updates) -> tuple[Updates, Any]:
            if u.factor is not ONE and not u.factor.is_one:  # (`Updates.pending`, inline)
                u = u.settled(kept=launches)
            return run(u, part.params), part.new_state

    else:

        def step(u: Updates) -> tuple[Updates, Any]:
            return run(u, part.params), part.new_state

    part = fuse.Host(step, passes, name, tick)
    return part


# The runner's protocol of a stage (`numbaccum.runner`): methods a public stage class
# (`numbaccum.MultiSteps`) has but its users never call, kept out of its ``dir()`` and so out of
# ``help()`` (mkdocs.yml's API filter hides the same names).
PROTOCOL = frozenset(
    ("complex_leaves", "declare", "foreign", "kept", "local", "owner", "refuses_complex", "reshapes",
     "take", "transformation", "undo_states", "workspace", "written")
)  # fmt: skip


class _StageType(abc.ABCMeta):
    def __dir__(cls) -> list[str]:
        return [name for name in super().__dir__() if name not in PROTOCOL]


class Stage(metaclass=_StageType):
    """A numbaccum transformation: ``init``, ``declare`` (its parts, kept and replayed by the
    runner) and the public optax ``update`` (tick, then run). ``transformation()`` is its
    GradientTransformationExtraArgs; `stage_of` finds the stage back from one.

    Subclasses implement `init` and `declare`, and `owner` when they have a state whose FlatTree
    owns their workspaces. ``reshapes = True`` marks a stage whose output layout differs from its
    input's (per-example aggregation); such a stage converts the user's input itself (`take`).
    """

    reshapes: bool = False  # a class's default; a wrapper sets its own from its inner stage's
    # Whether the stage takes complex leaves, with optax's semantics (a transformation optax
    # defines on them); the others refuse them with a TypeError before anything runs.
    complex_leaves: ClassVar[bool] = False

    @abc.abstractmethod
    def init(self, params: Any) -> Any:
        """The initial state for ``params``."""

    def refuses_complex(self) -> Stage | None:
        """The first stage (this one, or one it runs) that does not take complex leaves; None
        when all do. A combinator asks the stages it runs."""
        return None if self.complex_leaves else self

    @abc.abstractmethod
    def declare(self, spec: Spec, state: Any) -> Any:
        """This stage's declaration for updates of ``spec`` and states holding ``state``'s
        buffers: a part (`numbaccum.fuse.Kernel`, `Scale`, `Prepass`, `Host`, `Chained`,
        `Wrapped`) whose ``tick`` computes each step's values, after checking ``state``
        (TypeError/ValueError naming what is wrong). The runner keeps it and replays it
        (`numbaccum.runner`)."""

    def owner(self, state: Any) -> FlatTree | None:
        """The FlatTree of ``state`` that owns this stage's workspaces, whose layout and device
        are those of the updates the state was built for; None for a stateless stage (or a
        state that is not this stage's: `plan` then says what is wrong)."""
        return None

    def foreign(self) -> bool:
        """Whether this stage runs code that is not numbaccum's while the step runs (a `Foreign`
        stage; a callback: a line search's objective, `snapshot`'s measure, MultiSteps' skip
        function; or a combinator around one): such code runs its own checks, and may raise (a
        ``KeyboardInterrupt`` too), after earlier stages have written their states: a chain
        restores them then (`undoable`). It runs through `numbaccum._interrupts.user_code`."""
        return False

    def undo_states(self, state: Any) -> tuple:
        """The parts of ``state`` whose buffers a step of this stage may have written when its
        foreign code raises: what a plan that runs this stage's parts among its own copies before
        the step and restores then (`numbaccum.runner.Plan.undo`), so that the update is all or
        nothing around that code too. Empty for a stage without foreign code, or one that
        restores its own (a control node runs its inner plan inside its own run: MultiSteps,
        masked)."""
        return ()

    def written(self, state: Any) -> Any:
        """The part of ``state`` (this stage's) whose buffers its next step writes: what a chain
        copies before foreign code that runs after this stage (`undoable`). All of it, unless a
        stage knows better (L-BFGS writes 4 of its 2 * memory_size + 2 buffers a step)."""
        return state

    # --- workspaces -------------------------------------------------------------------------

    def local(self) -> threading.local:
        """What this stage remembers, per thread: the buffers it keeps (`kept`), its kept plans
        (`numbaccum.runner`), the last layout and spec it saw. Made once, on first use
        (subclasses need not call an ``__init__`` of ours); nothing else of a stage changes after
        construction, and threads sharing a transformation share none of this."""
        local = self.__dict__.get("_kept")
        if local is None:
            local = self.__dict__.setdefault("_kept", threading.local())
        return local

    def kept(self, name: str, layout: Layout, device: bool) -> FlatTree:
        """The buffer to write of this stage's own workspace ``name`` (`kept_workspace`)."""
        return self.kept_workspace(name, layout, device)()

    def kept_workspace(self, name: str, layout: Layout, device: bool) -> Workspace:
        """A `numbaccum.flat.Workspace` this stage keeps for itself, per name, layout and device
        (and thread): the workspaces of a stateless stage.

        Per thread, workspaces are kept for the `_config.KEPT_LAYOUTS` (layout, device) pairs
        first used last, the oldest pair's dropped first (a hit costs one dict lookup): a
        stateless transformation fed ever new tree shapes keeps bounded memory. A dropped one
        lives on in the updates a caller still holds."""
        local = self.local()
        cache = local.__dict__.get("buffers")
        if cache is None:
            cache = local.buffers = {}
        key = (name, layout, device)
        ws = cache.get(key)
        if ws is None:
            shapes = local.__dict__.setdefault("shapes", [])  # (layout, device), in first-use order
            pair = key[1:]
            if pair not in shapes:
                shapes.append(pair)
                while len(shapes) > max(_config.KEPT_LAYOUTS, 2):  # 2: a reshaping stage's in and out
                    gone = shapes.pop(0)
                    for k in [k for k in cache if k[1:] == gone]:
                        del cache[k]
            ws = cache[key] = Workspace(layout, None, device)
        return ws

    def workspace(self, state: Any, spec: Spec, name: str) -> Callable[[], FlatTree]:
        """A buffer of ``spec``'s layout for this stage and state, made on first use: in the
        state's owner (`owner`) if it has one of that layout and device, else `kept`."""
        return self._workspace(self.owner(state), spec, name)

    def _workspace(self, owner: FlatTree | None, spec: Spec, name: str) -> Workspace:
        if owner is not None and owner.layout is spec.layout and owner.device == spec.device:
            return owner.workspace_of(name)
        return self.kept_workspace(name, spec.layout, spec.device)

    # --- the public update --------------------------------------------------------------------

    def transformation(self) -> GradientTransformationExtraArgs:
        """This stage as ``GradientTransformationExtraArgs(self.init, self.update)``."""
        return GradientTransformationExtraArgs(self.init, self.update)

    def take(self, updates: Any, state: Any, params: Any, owner: FlatTree | None) -> tuple[Updates, str]:
        """The user's updates as `Updates` (validated; packed into the ``input`` workspace when
        they are not one flat buffer per dtype already) and their array kind.

        The layout is that of the state's ``owner``; a stateless stage follows ``params`` if
        given, else the updates themselves (remembering the last layout, so that the same plain
        tree is checked cheaply next time). A reshaping stage overrides this."""
        side: bool | None = None  # the updates' side, when known here
        checked = None  # the updates' leaves, when checked here
        local = self.local()
        last = local.__dict__.get("last")  # the layout of the last plain tree taken (this thread)
        if owner is not None:
            layout = owner.layout
            if not owner.device and not isinstance(updates, FlatTree):
                checked = host_leaves(updates, layout)  # the common case, checked in one walk
        elif params is None and isinstance(updates, FlatTree):
            layout = updates.layout
        elif params is None and last is not None and (checked := host_leaves(updates, last)):
            layout, side = last, False  # the same structure, shapes and dtypes as last time
        elif params is None and last is not None and arrays.device_pointers(updates, last) is not None:
            layout, side = last, True  # CUDA arrays of the same structure and shapes as last time
        else:
            layout = layout_of(
                params if params is not None else updates, "params" if params is not None else "updates"
            )
            if params is None:
                local.last = layout
        device = owner.device if owner is not None else None
        inbox = self._inbox(owner, layout, (lambda: _side(updates)) if side is None else side)
        flat, copied, kind = as_flat(updates, layout, "updates", inbox, device, checked)
        return Updates(flat, copied), kind

    def _inbox(
        self, owner: FlatTree | None, layout: Layout, side: bool | Callable[[], bool]
    ) -> Callable[[], FlatTree]:
        """Where updates that are not one flat buffer per dtype are packed: the ``input``
        workspace of the state's ``owner``, else this stage's kept one on ``side`` (a callable:
        asked only when packing)."""
        if owner is not None:
            return owner.workspace_of("input")
        if callable(side):  # asked only when packing
            return lambda: self.kept("input", layout, side())
        return self.kept_workspace("input", layout, side)

    def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        """optax's ``update``: checks everything (state, params, schedules) before any buffer
        is written, then runs (`numbaccum.runner`). Returns the updates in the caller's form (a
        plain tree for a plain tree, a FlatTree for a FlatTree, the same CUDA array type) and
        the new state.
        """
        return _runner.run(self, updates, state, params, extra_args, False)

    def _output(self, u: Updates, new_state: Any, spec: Spec) -> FlatTree:
        """The updates as a buffer to hand to the caller (`FlatTree.lent`): never an input,
        never an accumulator; the ``output`` workspace of the new state (else of this stage)."""
        if u.owned:
            return u.settled().flat
        if u.returnable and not u.pending:
            return u.flat
        return u.into(self.workspace(new_state, spec, "output")())


def stage_of(tx: Any) -> Stage | None:
    """The `Stage` behind a transformation (its ``update`` is a stage's bound method), or None
    for a foreign transformation (any other ``(init, update)`` pair)."""
    if Stage in type(tx).__mro__:  # isinstance without the ABC machinery: every update asks
        return tx
    owner = getattr(getattr(tx, "update", None), "__self__", None)
    return owner if Stage in type(owner).__mro__ else None


def _side(tree: Any) -> bool:
    """Whether a tree's first leaf is a CUDA array (the leaves were already checked to agree)."""
    if isinstance(tree, FlatTree):
        return tree.device
    leaves = tree_flatten(tree)[0]
    return bool(leaves) and arrays.is_cuda_array(leaves[0])


class Foreign(Stage):
    """A transformation that is not a numbaccum stage, run through its plain ``update``.

    Its code may keep, return or modify the arrays it is given, as optax code may keep the
    immutable arrays JAX gives it: each call gets a new buffer holding the settled updates
    (never the caller's gradients, a state's accumulator or a workspace numbaccum writes again),
    and what it returns is copied into this stage's scratch as soon as it returns, before
    anything it might alias changes. Its own checks run inside ``run``: an enclosing `Chain`
    or `MultiSteps` snapshots what it wrote before and restores it if the code raises
    (`undoable`), so an update is all or nothing around it too.
    """

    def __init__(self, tx: Any) -> None:
        self.tx = with_extra_args_support(tx)

    def init(self, params: Any) -> Any:
        return self.tx.init(params)

    complex_leaves = True  # user code: what it does with them is its own

    def foreign(self) -> bool:
        return True

    def undo_states(self, state: Any) -> tuple:
        return (state,)  # a user's function around a numbaccum transformation holds our buffers

    def declare(self, spec: Spec, state: Any) -> fuse.Host:
        """User code as one `numbaccum.fuse.Host` (an opaque row in `numbaccum.explain`): its
        tick keeps the step's state, params and extra arguments (the state is the user's: any
        value fits), its run calls ``update`` on the settled updates and copies what it returns
        into the plan's scratch."""
        update = self.tx.update
        # The declaration's own workspaces: a plan runs one update at a time (a stage's kept
        # ones are its thread's, and a plan of a state may run on any thread). What the code is
        # given is lent (`FlatTree.lent`): a step writes it again only when the code kept
        # nothing of it (it may keep it: it gets another buffer then).
        kept = Workspace(spec.layout, None, spec.device)
        handed = Workspace(spec.layout, None, spec.device)
        launches, kind = fuse.Launches(), "numba" if spec.device else "numpy"
        step: list = [None, None, None]  # this step's state, raw params and extra arguments

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            step[0], step[1], step[2] = state, None if params is None else params.raw, extra
            return True

        def run(u: Updates) -> tuple[Updates, Any]:
            state, raw, extra = step
            given = launches.settle(u, handed()).lent(kind)
            out, new_state = user_code(update, given, state, raw, **extra)
            return Updates(_read_foreign(out, spec, u.scratch or kept), True), new_state

        return fuse.Host(run, None, "Foreign", tick)


def _read_foreign(out: Any, spec: Spec, into: Callable[[], FlatTree]) -> FlatTree:
    """Copies the updates foreign code returned into ``into()``: always a copy, never a view of
    them (they may be its input, its own arrays or the params, which may change before they
    are read again). A Python or NumPy scalar stands for a 0-d leaf, as JAX accepts one."""
    layout = spec.layout
    checked = None if spec.device else host_check(layout)(out)  # the common case: arrays as given
    if checked is not None:
        flat, copied, _ = host_flat(checked, layout, into)
    else:
        raw = leaves_if_structure(out, layout.treedef)
        if raw is not None and any(type(x) is not np.ndarray for x in raw):
            fixed = [
                np.asarray(x, dtype=dt) if _is_real_scalar(x) and shape == () else x
                for x, shape, dt in zip(raw, layout.shapes, layout.dtypes)
            ]
            out = tree_unflatten(layout.treedef, fixed)
        flat, copied, _ = as_flat(out, layout, "updates", pack_into=into, device=spec.device)
    if copied:
        return flat
    dst = into()
    _runner.copy_groups(dst, flat)
    return dst


def _is_real_scalar(x: Any) -> bool:
    return isinstance(x, (float, int, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_))


def undoable(run: Callable[..., Any], states: Any) -> Callable[..., Any]:
    """``run`` made all or nothing for the FlatTrees of ``states``: they are copied before it
    runs and copied back, bit for bit, if it raises (a `SkipStep` is an outcome, not a failure:
    it passes through). For the states a step writes before foreign code runs (`Foreign`): a
    numbaccum stage cannot know in its plan what that code will do, so this restores what was
    written instead of committing nothing. The copies are workspaces of each FlatTree
    (``undo``), made once."""
    if not state_flats(states):
        return run

    def all_or_nothing(*args: Any) -> Any:
        saved = _runner.snapshot(states)
        try:
            return run(*args)
        except SkipStep:
            raise
        except BaseException:
            _runner.restore(saved)
            raise

    return all_or_nothing


def as_stage(tx: Any) -> Stage:
    """``tx``'s `Stage`, or a `Foreign` stage around it (the one `stateless` made, if it is
    one of those)."""
    stage = stage_of(tx)
    if stage is not None:
        return stage
    kept = getattr(getattr(tx, "update", None), "numbaccum_stage", None)
    return kept if type(kept) is Foreign else Foreign(tx)


# --- combinators ----------------------------------------------------------------------------


class Chain(Stage):
    """`chain` and `named_chain`: declares every stage's parts as one plan, whose tick checks
    every stage before any runs (a reshaping stage makes it a control node, `_Reshaping`).
    State: a tuple, or a dict keyed by ``names``."""

    scope = ELEMENT
    children_at = "stages"

    def __init__(self, stages: list[Stage], names: list[str] | None = None) -> None:
        self.stages = stages
        self.names = names
        # A reshaping first stage (per-example aggregation) converts the chain's input.
        # The first stage that reshapes the updates (per-example aggregation, lookahead), if
        # any: the chain's input is its, converted by its `take`, and the chain is declared as a
        # control node (`_Reshaping`) that runs the stages before it, it, then the ones after it.
        self._reshaping = next((i for i, s in enumerate(stages) if s.reshapes), None)
        self.reshapes = self._reshaping is not None
        # The index of the last stage that runs foreign code, -1 if none.
        self._last_foreign = max((i for i, s in enumerate(stages) if s.foreign()), default=-1)
        # The stages that may own workspaces (their class declares `owner`): the only ones
        # `owner` asks. None for a reshaping chain, whose input layout is not the states'.
        self._may_own = (
            ()
            if self.reshapes
            else tuple(i for i, stage in enumerate(stages) if type(stage).owner is not Stage.owner)
        )

    def init(self, params: Any) -> Any:
        states = tuple(s.init(params) for s in self.stages)
        return states if self.names is None else dict(zip(self.names, states))

    def _states(self, state: Any) -> tuple | None:
        """The stages' states in order, or None if ``state`` is not this chain's."""
        if self.names is None:  # a plain tuple (a NamedTuple is one stage's state)
            if type(state) is tuple:  # the common case, without the subclass checks
                return state if len(state) == len(self.stages) else None
            if isinstance(state, tuple) and len(state) == len(self.stages) and not hasattr(state, "_fields"):
                return state
            return None
        names = self.names  # maps, not generators: a named chain asks on every step
        if isinstance(state, dict) and len(state) == len(names) and all(map(state.__contains__, names)):
            return tuple(map(state.__getitem__, names))
        return None

    def foreign(self) -> bool:
        return self._last_foreign >= 0

    def refuses_complex(self) -> Stage | None:
        return next((r for r in (s.refuses_complex() for s in self.stages) if r is not None), None)

    def owner(self, state: Any) -> FlatTree | None:
        """The first owner among the stages before any reshaping one (their layout is the
        chain's input layout)."""
        states = self._states(state)
        return None if states is None else self._owner_of(states)

    def _owner_of(self, states: tuple) -> FlatTree | None:
        stages = self.stages
        for i in self._may_own:
            o = stages[i].owner(states[i])
            if o is not None:
                return o
        return None

    def take(self, updates: Any, state: Any, params: Any, owner: FlatTree | None) -> tuple[Updates, str]:
        r = self._reshaping
        if r is not None:
            states = self._states(state)
            mine = states[r] if states is not None else None
            return self.stages[r].take(updates, mine, params, None)
        return super().take(updates, state, params, owner)

    def _expect_states(self, state: Any) -> tuple:
        """The stages' states in order; ValueError when ``state`` is not this chain's."""
        states = self._states(state)
        if states is None:
            if self.names is not None:
                raise wrong_state(f"a dict with keys {self.names} (named_chain)", state, ValueError)
            n = len(self.stages)
            if isinstance(state, tuple) and not hasattr(state, "_fields"):
                raise wrong_state(
                    f"a tuple of {n} states (a chain of {n}; this one has {len(state)})", state, ValueError
                )
            raise wrong_state(f"a tuple of {n} states (a chain of {n})", state, ValueError)
        return states

    def undo_states(self, state: Any) -> tuple:
        """The stages' states before the last one that runs foreign code (what they write),
        and what that one says of its own (`Stage.undo_states`)."""
        last = self._last_foreign
        states = self._states(state)
        if last < 0 or states is None:
            return ()
        earlier = tuple(st.written(s) for st, s in zip(self.stages[:last], states[:last]))
        return (*earlier, *self.stages[last].undo_states(states[last]))

    def declare(self, spec: Spec, state: Any) -> Any:
        """The stages' parts as one `numbaccum.fuse.Chained`, whose ``tick`` ticks each stage's
        part with its own state; a chain with a reshaping stage: a control node (`_Reshaping`)."""
        states = self._expect_states(state)
        if self.reshapes:
            return _Reshaping(self, spec).part
        parts = [stage.declare(spec, s) for stage, s in zip(self.stages, states)]
        chained = fuse.Chained(parts, self.names)
        split = self._states

        def tick(state: Any, params: Any, extra: dict) -> bool:
            states = split(state)
            if states is None:
                return False
            for part, s in zip(parts, states):  # noqa: SIM110 (a plain loop: no generator per step)
                if not part.tick(s, params, extra):
                    return False
            return True

        chained.tick, chained.split = tick, split
        return chained


class _Reshaping:
    """A chain with a reshaping stage (a per-example aggregation, lookahead), declared for
    updates of one `Spec`: a control node (``part``, a `numbaccum.fuse.Host`) that runs the
    kept plans of the stages before it (on the input's layout), of it, and of the stages after
    it on the layout it returns (its part's ``spec``, known after its tick: one plan per such
    layout, the last `_config.KEPT_LAYOUTS` kept). Its ``spec`` is that layout's, set by its
    tick, as the runner reads a reshaping stage's; foreign code after the reshaping stage
    raising restores what the stages before it wrote."""

    def __init__(self, chain: Chain, spec: Spec) -> None:
        r = chain._reshaping
        assert r is not None
        stages, names = chain.stages, chain.names
        self.split, self.spec, self.r = chain._states, spec, r
        self.pre = Inner(Chain(stages[:r]), spec, f"chain{r}.pre.") if r else None
        self.inner = Inner(stages[r], spec, f"chain{r}.")
        self.post = Chain(stages[r + 1 :]) if r + 1 < len(stages) else None
        self.posts: dict = {}  # the layout the reshaping stage returns -> the plan of the rest
        self.pack = tuple if names is None else (lambda new: dict(zip(names, new)))
        # foreign code after the stages that write: what they wrote, restored if it raises
        self.guarded = tuple(range(r + 1)) if chain._last_foreign > r else ()
        self.written = [stages[i].written for i in self.guarded]
        self.step: list = [None, None]  # this step's states and the plan of the stages after
        self.part = fuse.Host(self.run, self.passes, "chain", self.tick, settles=False, apply=self.apply)

    def tick(self, state: Any, params: ParamsRef | None, extra: dict) -> bool:
        states = self.split(state)
        if states is None:
            return False
        r, pre = self.r, self.pre
        if pre is not None and not pre.tick(tuple(states[:r]), params, extra):
            return False
        if not self.inner.tick(states[r], params, extra):
            return False
        inner_plan = self.inner.plan
        assert inner_plan is not None
        root = inner_plan.root  # (`fuse.returned_spec`'s common case inline: a reshaping Host)
        out_spec = (root.spec if type(root) is fuse.Host else fuse.returned_spec(root)) or self.spec
        post = None
        if self.post is not None:
            post = self.posts.get(out_spec)
            if post is None:
                if len(self.posts) >= max(_config.KEPT_LAYOUTS, 2):
                    del self.posts[next(iter(self.posts))]  # the oldest
                post = self.posts[out_spec] = Inner(self.post, out_spec, f"chain{r}.post.")
            if not post.tick(tuple(states[r + 1 :]), params, extra):
                return False
        self.part.spec = out_spec
        self.step[0], self.step[1] = states, post
        return True

    def run(self, u: Updates) -> tuple[Updates, Any]:
        return self._run(u, None)

    def apply(self, u: Updates, params: FlatTree) -> Any:
        return self._run(u, params)[1]

    def _run(self, u: Updates, params: FlatTree | None) -> tuple[Any, Any]:
        """The step: ``(updates, new_state)``; with ``params`` (`numbaccum.step_`) the updates
        added to them in the last plan's last pass instead (None for the updates)."""
        states, post = self.step
        r, pre = self.r, self.pre
        saved = _runner.snapshot([w(s) for w, s in zip(self.written, states)]) if self.guarded else None
        new = list(states)
        at = 0  # where a skipped step was skipped: the stages before r, r, the ones after
        out: Any = None
        try:
            if pre is not None:
                u, new[:r] = pre.run(u)
            at = r
            if post is None and params is not None:
                new[r] = self.inner.apply(u, params)
                return None, self.pack(new)
            u, new[r] = self.inner.run(u)
            if post is None:
                return u, self.pack(new)
            at = r + 1
            if params is not None:
                new[r + 1 :] = post.apply(u, params)
            else:
                out, new[r + 1 :] = post.run(u)
        except SkipStep as e:  # the stages after the skipping one keep their states
            if at == 0:
                new[:r] = e.new_state
                keep_states(states[r:])
            elif at == r:
                new[r] = e.new_state
                keep_states(states[r + 1 :])
            else:  # (the plan after keeps its own later stages' states)
                new[r + 1 :] = e.new_state
            raise SkipStep(self.pack(new)) from None
        except BaseException:
            if saved is not None:  # foreign code raised: what the stages before it wrote
                _runner.restore(saved)
            raise
        return out, self.pack(new)

    def passes(self, apply: bool) -> list:
        pre, post = self.pre, self.step[1]
        rows = [] if pre is None else pre.passes(False)
        rows += self.inner.passes(apply and post is None)
        return rows if post is None else rows + post.passes(apply)


def chain(*transforms: Any) -> GradientTransformationExtraArgs:
    """Applies ``transforms`` in order: ``u = t_n(...t_2(t_1(g)))``; the state is the tuple of
    their states.

    ``params`` and extra keyword arguments are passed to every transformation. Every stage is
    planned (its state, params and schedules checked) before any runs, so an error leaves every
    state as it was; a foreign (non-numbaccum) transformation runs its own checks when it runs
    (see `Foreign`). Consecutive elementwise stages fuse into one pass per dtype group
    (`numbaccum.explain` shows the passes).

    Args:
        *transforms: transformations (numbaccum's, optax-style ``(init, update)`` pairs of your
            own, or optax's own).

    Returns:
        A `GradientTransformationExtraArgs` whose state is ``tuple(t.init(params) for t in
        transforms)``.

    Raises:
        TypeError: a transformation has no callable ``init`` or ``update`` (names its index).

    References:
        optax.chain; torchzero's and declearn's module chains.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.chain(nba.clip_by_global_norm(1.0), nba.scale(-0.5))
        >>> u, state = tx.update({"g": np.array([3.0, 4.0])}, tx.init({"g": np.zeros(2)}))
        >>> u["g"]  # clipped to norm 1, then scaled
        array([-0.3, -0.4])
    """
    txs = [
        with_extra_args_support(transformation(t, f"chain: transforms[{i}]"))
        for i, t in enumerate(transforms)
    ]
    return Chain([as_stage(t) for t in txs]).transformation()


def named_chain(*transforms: tuple[str, Any]) -> GradientTransformationExtraArgs:
    """Like `chain`, with a state dict keyed by the given names.

    Applies the transformations in the order given, ``u = t_n(...t_2(t_1(g)))`` for the pairs
    ``(name_1, t_1), ..., (name_n, t_n)``; the state is ``{name_i: t_i.init(params)}``, so that a
    stage's state is found by its name (``state["clip"]``) rather than its position. Planning,
    fusion and errors are `chain`'s: an update checks every stage before any runs.

    Args:
        *transforms: ``(name, transformation)`` pairs, the names unique strings.

    Returns:
        A `GradientTransformationExtraArgs` whose state is the dict ``{name: t.init(params)}``,
            in the order of ``transforms``.

    Raises:
        TypeError: an entry is not a ``(str, transformation)`` pair, or its transformation has
            no callable ``init`` or ``update``.
        ValueError: two entries have the same name.

    References:
        optax.named_chain.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.named_chain(("clip", nba.clip_by_global_norm(1.0)), ("sgd", nba.sgd(0.5)))
        >>> state = tx.init({"w": np.zeros(2)})
        >>> u, state = tx.update({"w": np.array([3.0, 4.0])}, state)
        >>> [round(float(x), 4) for x in u["w"]]  # clipped to norm 1, then -0.5 times that
        [-0.3, -0.4]
        >>> list(state), float(state["clip"].norm)
        (['clip', 'sgd'], 5.0)
    """
    for i, entry in enumerate(transforms):
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise TypeError(
                f"named_chain: transforms[{i}] must be a (name, transformation) pair, got {entry!r:.60}"
            )
        transformation(entry[1], f"named_chain: transforms[{i}] ({entry[0]!r})")
    names = [n for n, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    stages = [as_stage(with_extra_args_support(t)) for _, t in transforms]
    return Chain(stages, names).transformation()


# --- copying states ------------------------------------------------------------------------


def copy_state(state: Any) -> Any:
    """An independent deep copy of a state (FlatTrees and arrays copied, structure kept).

    ``update`` writes a state's buffers in place and consumes the state it is given (passing
    that state again raises ValueError: it is stale), so a state to keep (the best so far, a
    step to retry) is kept as a copy: the same nest (tuples, NamedTuples of the same class,
    lists, dicts) with every `FlatTree` and NumPy array replaced by a copy with storage of its
    own (same layout, dtypes and device); scalars, None and other leaves are returned as they
    are. The copy is a state of its own, which any later ``update`` accepts.

    Args:
        state: a state from ``init``/``update``, or any nest of tuples, lists, dicts and
            NamedTuples.

    Returns:
        The copy; no later ``update`` of ``state`` changes it, nor it ``state``. Two places
        holding one buffer (or one array) hold one copy.

    Raises:
        ValueError: ``state`` is stale (an update has consumed it), as ``update`` says: a copy
            keeps a state from *before* the update that consumes it.
        RuntimeError: an update of ``state`` is running on another thread (``update``'s error).
            One that starts while the copy is taken waits for it.

    References:
        copy.deepcopy (which also keeps a read-only FlatTree read-only); an optax state needs no
        copy (JAX arrays are immutable); PyTorch: ``copy.deepcopy(optimizer.state_dict())``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.sgd(0.1, momentum=0.9)
        >>> state = tx.init({"w": np.zeros(2)})
        >>> _, state = tx.update({"w": np.ones(2)}, state)
        >>> saved = nba.copy_state(state)
        >>> _, state = tx.update({"w": np.ones(2)}, state)
        >>> [round(float(x), 4) for x in state[0].trace["w"]]  # 1 + 0.9 * 1
        [1.9, 1.9]
        >>> [round(float(x), 4) for x in saved[0].trace["w"]]  # as it was after the first step
        [1.0, 1.0]
    """
    with reading(state):
        return _copied(state, {})


def _copied(x: Any, memo: dict[int, Any]) -> Any:
    """`copy_state` of ``x``, its buffers held; ``memo``: the copy of each storage (a FlatTree's,
    its renewals share it) and array copied so far."""
    if isinstance(x, (FlatTree, np.ndarray)):
        key = id(x.__dict__) if isinstance(x, FlatTree) else id(x)
        out = memo.get(key)
        if out is None:
            out = memo[key] = x.copy()
        return out
    if isinstance(x, dict):
        return {k: _copied(v, memo) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return type(x)(*(_copied(v, memo) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_copied(v, memo) for v in x)
    return x


# --- monitoring: a measure of the updates kept in the state --------------------------------


# Measures that `snapshot` passes the flat buffers themselves: the library's global norm
# (`numbaccum.clipping` adds it, as it imports this module) gives the same bits on them as on the
# tree of their views (it reduces each leaf, then the leaves in tree order), without finding the
# layout of that tree again every step.
FLAT_MEASURES: set = set()


@state_class
class SnapshotState(NamedTuple):
    """The state of `snapshot` (optax's field).

    Attributes:
        measurement: ``{measure_name: measure(updates)}`` of the last update (of the params
            after ``init``).
    """

    measurement: dict


class _Snapshot(Stage):
    """`snapshot`: the updates pass unchanged (no pass over them); the measure sees them as a
    tree of views into the settled buffers, and the arrays it returns are copied into the state
    when they share those buffers (the next update overwrites them)."""

    complex_leaves = True  # the measure is the user's

    def foreign(self) -> bool:
        return True  # the measure runs while the step runs, after earlier stages wrote

    def __init__(self, name: Any, measure: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"measure_name must be a str, got {type(name).__name__}")
        if not callable(measure):
            raise TypeError(f"measure must be callable, got {type(measure).__name__}")
        self.measure_name, self.measure = name, measure

    def init(self, params: Any) -> SnapshotState:
        tree = params.tree if isinstance(params, FlatTree) else params
        return SnapshotState({self.measure_name: self.measure(tree)})

    def declare(self, spec: Spec, state: Any) -> fuse.Host:
        """A `numbaccum.fuse.Host` that runs the measure (user code: an opaque row in `explain`);
        its tick checks the state's class, which holds no buffers."""
        if not isinstance(state, SnapshotState):
            raise wrong_state("SnapshotState", state)
        name, measure = self.measure_name, self.measure
        flat_measure = any(measure is m for m in FLAT_MEASURES)  # (a measure need not hash)

        def tick(state: Any, params: Any, extra: dict) -> bool:
            return isinstance(state, SnapshotState)  # else declared again: the error above

        def run(u: Updates) -> tuple[Updates, SnapshotState]:
            if u.factor is not ONE and not u.factor.is_one:  # (`Updates.pending`, inline)
                u = u.settled()
            value = user_code(measure, u.flat if flat_measure else u.flat.tree)
            if type(value) is float:  # a number shares no buffer
                return u, SnapshotState({name: value})
            owned = tree_map(lambda x: x.copy() if _shares(x, u.flat) else x, value)
            return u, SnapshotState({name: owned})

        return fuse.Host(run, None, "snapshot", tick)


def _shares(x: Any, flat: FlatTree) -> bool:
    """Whether ``x`` is an array that shares memory with one of ``flat``'s buffers."""
    if not isinstance(x, np.ndarray):
        return hasattr(x, "copy_to_host")  # a device array: maybe a view of ours, copy it
    return any(isinstance(b, np.ndarray) and np.shares_memory(x, b) for b in flat.buffers.values())


def snapshot(measure_name: str, measure: Callable[[Any], Any]) -> GradientTransformationExtraArgs:
    """Keeps a measure of the updates in the state; the updates pass unchanged.

    In a chain, the updates ``measure`` sees are the ones transformed up to this point: e.g. the
    norm before a clip. ``measure`` gets them as a tree of arrays (NumPy arrays, or numba device
    arrays for updates on the GPU) that are views into numbaccum's buffers: arrays it returns
    that are such views are copied into the state, since the next update overwrites them.

    Args:
        measure_name: the key of the measurement in the state.
        measure: ``measure(updates) -> anything`` (a tree of arrays, a float, ...); at ``init``
            it measures the params.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``SnapshotState(measurement)``, as in
            optax (``state.measurement[measure_name]``).

    Raises:
        TypeError: ``measure_name`` is not a str or ``measure`` not callable.

    References:
        optax.snapshot.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.chain(
        ...     nba.sgd(learning_rate=0.1, momentum=0.9),
        ...     nba.snapshot("norm_before_clip", nba.global_norm),
        ...     nba.clip_by_global_norm(0.05),
        ... )
        >>> params = {"x": np.array([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> for step in range(2):
        ...     state = nba.step_(tx, {"x": 2 * params["x"]}, state, params)
        ...     print(f"{step=}, norm={state[1].measurement['norm_before_clip']:.2e}")
        step=0, norm=7.48e-01
        step=1, norm=1.41e+00
    """
    return _Snapshot(measure_name, measure).transformation()


def find_state(state: Any, cls: type | tuple[type, ...]) -> Any:
    """The first state of class ``cls`` (or one of several) inside ``state`` (itself, or nested
    in chains, named chains and wrappers' states), or None."""
    return next(states_of(state, cls), None)


def states_of(state: Any, cls: type | tuple[type, ...]) -> Iterator[Any]:
    """Every state of class ``cls`` (or one of several) inside ``state``, in order (the walk of
    `find_state`)."""
    if isinstance(state, cls):
        yield state
        return
    if isinstance(state, dict):
        state = tuple(state.values())
    if isinstance(state, tuple):
        for s in state:
            yield from states_of(s, cls)
