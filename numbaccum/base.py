"""The optax protocol over flat buffers: GradientTransformation, stages, chain.

Every numbaccum transformation is an optax-style ``(init, update)`` pair whose ``update`` is the
bound method of a `Stage`. A stage updates in two phases, so that a failed call changes nothing:

1. ``plan(spec, state, params, extra) -> Step`` (host only, writes nothing): validates the state
   against the updates' `Spec` (layout and device), checks params and extra arguments, calls
   schedules and computes every per-step scalar (bias corrections, learning rates, counts).
2. ``Step.run(updates) -> (updates, new_state)``: runs the kernels. It may decide on values it
   reads (a clip's norm, a skip predicate) but raises nothing a plan could have caught.

`Stage.update` converts the user's tree into `Updates` once, plans the whole stage (a `chain`
plans every one of its stages before it runs any), then runs it and hands the result back in the
caller's form. `Updates` carry a pending `Factor` ``(flat / div) * mul`` that the next kernel
applies while it reads the buffer, so ``clip_by_global_norm`` costs no pass of its own.

A `chain` runs each maximal run of stages that declare their elementwise work (``Step.fuse``) as
one generated kernel per dtype group (`numbaccum.fuse`; ``NUMBACCUM_FUSE=0``: stage by stage,
the same bits on the CPU).

Workspaces are explicit: a stage names the FlatTree of its state that owns its scratch buffers
(`Stage.owner`); a stateless stage keeps its own, per layout, device and thread (`Stage.kept`).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import numpy as np

from . import _config, arrays, fuse
from ._checks import transformation
from .backend import ops_for
from .contract import ONE, Factor
from .flat import FlatTree, as_flat, check_leaves, host_leaves, layout_of
from .layout import Layout
from .tree import leaves_if_structure, tree_flatten, tree_unflatten

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "chain",
    "copy_state",
    "named_chain",
    "with_extra_args_support",
]


class GradientTransformation(NamedTuple):
    """A pair of pure-looking functions ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``."""

    init: Callable[..., Any]
    update: Callable[..., Any]


class GradientTransformationExtraArgs(GradientTransformation):
    """A GradientTransformation whose ``update`` accepts (and may ignore) ``**extra_args``."""


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def with_extra_args_support(tx: Any) -> GradientTransformationExtraArgs:
    """Wraps ``tx`` so that its ``update`` accepts and drops unknown keyword arguments.

    Returns ``tx`` itself when it already is a GradientTransformationExtraArgs (and a `Stage`'s
    own transformation for a stage, e.g. a `MultiSteps`).
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

    return GradientTransformationExtraArgs(tx.init, update)


# --- the values passed between stages -------------------------------------------------------


class Spec(NamedTuple):
    """What a stage is fed: the updates' layout and whether they live on a CUDA device."""

    layout: Layout
    device: bool


class Updates:
    """Updates between two stages: the value is ``factor(flat)``, group by group.

    Attributes:
        flat: the buffer.
        owned: a workspace this update may overwrite (never the caller's input, never a
            state's accumulator).
        factor: the pending `Factor` ``(x / div) * mul``, applied by the next kernel that reads
            ``flat`` (`ONE`: none).
        returnable: may be handed to the user as is (default: ``owned``).
        scratch: where a stage writes a new value when ``flat`` is not ``owned`` (see `fresh`);
            the runner (`Stage.update`, `chain`) sets it to the running stage's workspace.
    """

    # A plain class with slots, not a dataclass: a few are made per update, and a small tree's
    # whole update costs microseconds.
    __slots__ = ("flat", "owned", "factor", "returnable", "scratch")

    def __init__(
        self,
        flat: FlatTree,
        owned: bool,
        factor: Factor = ONE,
        returnable: bool | None = None,
        scratch: Callable[[], FlatTree] | None = None,
    ) -> None:
        self.flat = flat
        self.owned = owned
        self.factor = factor
        self.returnable = owned if returnable is None else returnable
        self.scratch = scratch

    def __repr__(self) -> str:
        return f"Updates({self.flat!r}, owned={self.owned}, factor={self.factor!r})"

    @property
    def pending(self) -> bool:
        """Whether a factor waits to be applied."""
        return self.factor is not ONE and not self.factor.is_one

    def scaled(self, factor: Factor) -> Updates:
        """``factor(self)``: the same buffer with ``factor`` pending, which rides on the next kernel.

        A factor already pending is never dropped: it is applied first (one pass), so the result
        is ``factor(pending(x))`` rounded exactly as two separate scalings would be.
        """
        if factor is ONE or factor.is_one:
            return self
        u = self.settled() if self.pending else self
        return Updates(u.flat, u.owned, factor, u.returnable, u.scratch)

    def view(self) -> Updates:
        """The same value, read-only: a stage that runs an inner transformation on it and reads
        it again afterwards passes this, so the inner one writes into ``scratch`` instead."""
        return Updates(self.flat, False, self.factor, False, self.scratch)

    def fresh(self) -> FlatTree:
        """A buffer for this update's next value: its own if it may be overwritten, else the
        running stage's scratch (a workspace of its state, or the stateless stage's own)."""
        if self.owned:
            return self.flat
        if self.scratch is not None:
            return self.scratch()
        return FlatTree.empty(self.flat.layout, device=self.flat.device)

    def settled(self, into: FlatTree | None = None) -> Updates:
        """This update with the pending factor applied (in place when owned, else into ``into``
        or `fresh`)."""
        if not self.pending:
            return self
        out = into if into is not None and not self.owned else self.fresh()
        self.into(out)
        return Updates(out, True, scratch=self.scratch)

    def into(self, out: FlatTree) -> FlatTree:
        """Writes the value into ``out`` (same layout; any storage dtypes) and returns it."""
        factor = self.factor
        for dst, src in zip(out.groups, self.flat.groups):
            ops_for(src).scale_(dst, src, factor)
        return out

    def handed_out(self) -> FlatTree:
        """The value in a new buffer of its own, for code that is not numbaccum's: it may keep,
        return or modify it (never the caller's gradients or a state's accumulator)."""
        return self.into(FlatTree.empty(self.flat.layout, device=self.flat.device))


class SkipStep(Exception):
    """Raised inside a run by a stage that decided, from the data, that this step must not
    happen (a clip with ``nonfinite="skip"`` that saw a NaN or inf): the enclosing chain keeps the
    states of the stages after it as they were and passes the exception on, and the outermost
    stage returns zero updates (`Stage.update`, `numbaccum.step_`: params untouched).

    Attributes:
        new_state: the new state of what raised it (a chain: every stage's, the stages after the
            skipping one unchanged).
    """

    def __init__(self, new_state: Any) -> None:
        super().__init__("step skipped")
        self.new_state = new_state


class ParamsRef:
    """The ``params`` argument: checked against the updates' layout before anything runs
    (`Stage.update`), flattened only when a stage asks for it (then once, into a workspace).

    A wrapper that hands an inner transformation part of the params (`numbaccum.masking`) gives
    ``fill`` (makes the flat params) and ``raw_of`` (makes the tree, for a foreign inner
    transformation) instead of ``raw``: both are called only if asked for."""

    __slots__ = ("_raw", "_raw_of", "_layout", "_into", "_device", "_flat", "_fill", "checked")

    def __init__(
        self,
        raw: Any,
        layout: Layout,
        owner: FlatTree | None = None,
        device: bool | None = None,
        into: Callable[[], FlatTree] | None = None,
        *,
        fill: Callable[[], FlatTree] | None = None,
        raw_of: Callable[[], Any] | None = None,
    ) -> None:
        self._raw = raw
        self._raw_of = raw_of
        self._layout = layout
        self._device = device
        self._flat: FlatTree | None = None
        self._fill = fill
        self.checked: list | None = None  # host leaves already checked against the layout
        if into is None and owner is not None:
            into = lambda: owner.workspace("params")  # noqa: E731
        self._into = into

    @property
    def raw(self) -> Any:
        """The params as the caller gave them."""
        if self._raw_of is not None:
            self._raw, self._raw_of = self._raw_of(), None
        return self._raw

    def flat(self) -> FlatTree:
        """The params as a FlatTree of the updates' layout (packed on first use)."""
        if self._flat is None:
            if self._fill is not None:
                self._flat = self._fill()
            else:
                self._flat = as_flat(
                    self.raw,
                    self._layout,
                    "params",
                    self._into,
                    self._device,
                    self.checked if not self._device else None,
                )[0]
        return self._flat


def check_params(params: Any, spec: Spec) -> list | None:
    """ValueError/TypeError naming the leaf when ``params`` do not match ``spec``: structure,
    shapes and dtypes (params of another dtype than the state was made for are refused by
    `Stage.update` and `numbaccum.step_` alike). Cheap for a FlatTree of that layout and for a
    tree of CUDA arrays, read off their own attributes.
    Returns the checked leaves of a plain host tree (so that packing it does not check them
    again), else None."""
    if isinstance(params, FlatTree):
        if params.layout is spec.layout and params.device == spec.device:
            return None
    elif spec.device and arrays.device_pointers(params, spec.layout) is not None:
        return None
    elif not spec.device:
        fast = host_leaves(params, spec.layout)  # structure, shapes and dtypes: the common case
        if fast is not None:
            return fast
    leaves = check_leaves(params, spec.layout, "params", spec.device)
    for i, (x, d) in enumerate(zip(leaves, spec.layout.dtypes)):
        # Params of another dtype than the state was made for: `update` would add float32
        # updates to them and `step_` round them to the state's dtype. Neither is asked for.
        if x.dtype != d:
            raise TypeError(
                f"{spec.layout.path(i, 'params')}: dtype {x.dtype} does not match {d}, the dtype "
                "of the params the state was made for (init the state with these params)"
            )
    return leaves if not spec.device and not isinstance(params, FlatTree) else None


# --- the stage protocol ---------------------------------------------------------------------


class Step:
    """A planned update of one stage: ``step.run(updates) -> (updates, new_state)``.

    Made by `Stage.plan` with everything already validated and computed; ``run`` (a function,
    usually a closure over the plan's values) only touches buffers. ``spec``: the `Spec` of the
    updates ``run`` returns, when it differs from the input's (a per-example aggregation returns
    params-shaped updates); None otherwise.
    """

    # ``run`` is the function itself, not a method calling it: one call less per stage and step.
    __slots__ = ("run", "spec", "fuse", "apply", "final")

    def __init__(
        self,
        run: Callable[[Updates], tuple[Updates, Any]],
        spec: Spec | None = None,
        fuse: Any = None,
        apply: Callable[[Updates, FlatTree], Any] | None = None,
        final: Callable[[Updates], tuple[Updates, Any]] | None = None,
    ) -> None:
        self.run = run
        self.spec = spec
        # The stage's elementwise work, declared for the chain compiler (`numbaccum.fuse`): a
        # `Kernel`, `Scale` or `Prepass` part, or a `Chained` run of them; None: not fusable.
        self.fuse = fuse
        # ``apply(updates, params) -> new_state``: runs the step and adds its updates to
        # ``params`` (a FlatTree of the layout) in its last pass, never writing them
        # (`numbaccum.step_`); None where the step cannot.
        self.apply = apply
        # ``final(updates) -> (updates, new_state)``: `run` for a caller that settles the
        # updates right after (`Stage.update`): a factor left pending at the end is applied in
        # the last pass instead of a pass of its own. None: use `run`.
        self.final = final


class Stage(abc.ABC):
    """A numbaccum transformation: ``init``, ``plan`` (validate, compute scalars, write nothing)
    and the public optax ``update`` (plan, then run). ``transformation()`` is its
    GradientTransformationExtraArgs; `stage_of` finds the stage back from one.

    Subclasses implement `init` and `plan`, and `owner` when they have a state whose FlatTree
    owns their workspaces. ``reshapes = True`` marks a stage whose output layout differs from its
    input's (per-example aggregation); such a stage converts the user's input itself (`take`).
    """

    reshapes: ClassVar[bool] = False

    @abc.abstractmethod
    def init(self, params: Any) -> Any:
        """The initial state for ``params``."""

    @abc.abstractmethod
    def plan(self, spec: Spec, state: Any, params: ParamsRef | None, extra: dict) -> Step:
        """Validates ``state`` (and ``params``, ``extra``) for updates of ``spec`` and computes
        every per-step scalar; writes nothing. Raises TypeError/ValueError naming what is wrong."""

    def owner(self, state: Any) -> FlatTree | None:
        """The FlatTree of ``state`` that owns this stage's workspaces, whose layout and device
        are those of the updates the state was built for; None for a stateless stage (or a
        state that is not this stage's: `plan` then says what is wrong)."""
        return None

    def foreign(self) -> bool:
        """Whether this stage runs code that is not numbaccum's (a `Foreign` stage, or a
        combinator around one): such code runs its own checks, and may raise, while the step
        runs, after earlier stages have written their states (see `undoable`)."""
        return False

    # --- workspaces -------------------------------------------------------------------------

    def kept(self, name: str, layout: Layout, device: bool) -> FlatTree:
        """A buffer this stage keeps for itself, per name, layout and device (and thread): the
        workspaces of a stateless stage, whose updates are valid until its own next update."""
        local = self.__dict__.get("_kept")
        if local is None:  # made on first use: subclasses need not call an __init__ of ours
            local = self.__dict__.setdefault("_kept", threading.local())
        cache = local.__dict__.get("buffers")
        if cache is None:
            cache = local.buffers = {}
        key = (name, layout, device)
        out = cache.get(key)
        if out is None:
            out = cache[key] = self._keep(local, cache, key)
        return out

    @staticmethod
    def _keep(local: threading.local, cache: dict, key: tuple) -> FlatTree:
        """A new kept buffer for ``key``. Per thread, buffers are kept for the
        `_config.KEPT_LAYOUTS` (layout, device) pairs first used last, the oldest pair's dropped
        first (a hit costs one dict lookup): a stateless transformation fed ever new tree shapes
        keeps bounded memory. A dropped buffer lives on in the updates a caller still holds."""
        shapes = local.__dict__.setdefault("shapes", [])  # (layout, device), in first-use order
        pair = key[1:]
        if pair not in shapes:
            shapes.append(pair)
            while len(shapes) > max(_config.KEPT_LAYOUTS, 2):  # 2: a reshaping stage's in and out
                gone = shapes.pop(0)
                for k in [k for k in cache if k[1:] == gone]:
                    del cache[k]
        return FlatTree.empty(key[1], device=key[2])

    def workspace(self, state: Any, spec: Spec, name: str) -> Callable[[], FlatTree]:
        """A buffer of ``spec``'s layout for this stage and state, made on first use: in the
        state's owner (`owner`) if it has one of that layout and device, else `kept`."""
        return self._workspace(self.owner(state), spec, name)

    def _workspace(self, owner: FlatTree | None, spec: Spec, name: str) -> Callable[[], FlatTree]:
        if owner is not None and owner.layout is spec.layout and owner.device == spec.device:
            return lambda: owner.workspace(name)
        return lambda: self.kept(name, spec.layout, spec.device)

    # --- the public update --------------------------------------------------------------------

    def transformation(self) -> GradientTransformationExtraArgs:
        """This stage as ``GradientTransformationExtraArgs(self.init, self.update)``."""
        tx = self.__dict__.get("_transformation")
        if tx is None:
            tx = self.__dict__["_transformation"] = GradientTransformationExtraArgs(self.init, self.update)
        return tx

    def take(self, updates: Any, state: Any, params: Any, owner: FlatTree | None) -> tuple[Updates, str]:
        """The user's updates as `Updates` (validated; packed into the ``input`` workspace when
        they are not one flat buffer per dtype already) and their array kind.

        The layout is that of the state's ``owner``; a stateless stage follows ``params`` if
        given, else the updates themselves (remembering the last layout, so that the same plain
        tree is checked cheaply next time). A reshaping stage overrides this."""
        side: bool | None = None  # the updates' side, when known here
        checked = None  # the updates' leaves, when checked here
        last = self.__dict__.get("_last")
        if owner is not None:
            layout = owner.layout
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
                self.__dict__["_last"] = layout
        if owner is not None:
            device: bool | None = owner.device
            inbox: Callable[[], FlatTree] = lambda: owner.workspace("input")  # noqa: E731
        else:
            device = None
            inbox = lambda: self.kept("input", layout, _side(updates) if side is None else side)  # noqa: E731
        flat, copied, kind = as_flat(updates, layout, "updates", inbox, device, checked)
        return Updates(flat, copied), kind

    def update(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        """optax's ``update``: plans the whole stage (every check, every schedule) before any
        buffer is written, then runs it. Returns the updates in the caller's form (a plain tree
        for a plain tree, a FlatTree for a FlatTree, the same CUDA array type) and the new state.
        """
        if updates is None and params is not None:
            # optax maps over the updates: None (an empty tree) gives None whatever the params,
            # which are then not read (a stateful stage still says its state wants a tree).
            params = FlatTree.empty(layout_of(None, "params"))
        owner = self.owner(state)
        return guarded(owner, self._update, updates, state, params, owner, extra_args)

    def _update(
        self, updates: Any, state: Any, params: Any, owner: FlatTree | None, extra_args: dict
    ) -> tuple[Any, Any]:
        u, kind = self.take(updates, state, params, owner)
        flat = u.flat
        spec = self.__dict__.get("_spec")  # the last one, kept: a small tree's update is microseconds
        if spec is None or spec.layout is not flat.layout or spec.device != flat.device:
            spec = self.__dict__["_spec"] = Spec(flat.layout, flat.device)
        ref = None
        if params is not None:
            ref = ParamsRef(params, spec.layout, None, flat.device, self._workspace(owner, spec, "params"))
            if not self.reshapes:
                ref.checked = check_params(params, spec)
        step = self.plan(spec, state, ref, extra_args)
        out_spec = step.spec or spec
        if ref is not None and self.reshapes:
            ref.checked = check_params(params, out_spec)
            ref._layout = out_spec.layout
            ref._into = self._workspace(owner, out_spec, "params")
        u.scratch = self._workspace(owner, spec, "output")
        run = step.final or step.run
        if kind in arrays.STREAM_KINDS:  # kernels go to the caller's current CUDA stream
            with arrays.launch_context(kind):
                out, new_state = self._run_or_zeros(run, u, out_spec)
        else:
            out, new_state = self._run_or_zeros(run, u, out_spec)
        if kind == "flat":
            return out, new_state
        return out.tree_as(kind), new_state

    def _run_or_zeros(self, run: Callable, u: Updates, spec: Spec) -> tuple[FlatTree, Any]:
        """``run(u)`` and its output; zeros (and the skipping stage's state) for a skipped step."""
        try:
            u, new_state = run(u)
        except SkipStep as e:
            zeros = self.workspace(e.new_state, spec, "output")().fill_(0.0)
            return zeros, e.new_state
        return self._output(u, new_state, spec), new_state

    def _output(self, u: Updates, new_state: Any, spec: Spec) -> FlatTree:
        """The updates as a buffer the caller may keep until the next update: never an input,
        never an accumulator; the ``output`` workspace of the new state (else of this stage)."""
        if u.owned:
            return u.settled().flat
        if u.returnable and not u.pending:
            return u.flat
        return u.into(self.workspace(new_state, spec, "output")())


# --- one update at a time, and only of the current state -----------------------------------
#
# A state's buffers are updated in place: the state an update was given and the one it returns
# share them. Each planned state buffer is therefore renewed (`current`): the new state holds
# a new wrapper of the same storage, one generation on, and the storage's live generation moves
# to it when the whole update has succeeded (`guarded`). A state kept from before (``best =
# state``, yesterday's state to retry a step) then holds an older generation and is refused,
# where it would otherwise compute with advanced buffers and old counters. A failed update
# commits nothing: the state it was given stays current.


class _Renewals(list):
    """The buffers renewed (`current`) by the update running on one thread, and ``depth``: how
    many updates run there (an update inside another one's user transformation joins it)."""

    __slots__ = ("depth",)


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.renewals = _Renewals()
        self.renewals.depth = 0


# One thread-local read per update and per renewed buffer; the rest are plain attributes.
_THREAD = _PerThread()
_NEW = object.__new__

_STALE = (
    "{}: this state is stale: an update has already advanced its buffers in place (a state "
    "is consumed by update). Use the state the last update returned; to keep one (best = state, "
    "a step to retry), keep a snapshot: numbaccum.copy_state(state)"
)

_BUSY = (
    "state: another update of this state is running (on another thread?); a state is not "
    "thread-safe: give each thread its own state (transformations may be shared)"
)


def current(flat: FlatTree, field: str) -> FlatTree:
    """``flat``, the buffer ``state.<field>`` of the state being planned, renewed for the
    state the update returns, after checking that it is current: a new FlatTree over the same
    storage (it shares ``flat``'s ``__dict__``) one generation on, which becomes the current
    one when the update returns (`guarded`).

    Raises:
        ValueError: ``flat`` belongs to a stale state (an update has advanced it since).
    """
    g = flat._gen
    if g != flat._live:
        if g != flat._live + 1:
            raise ValueError(_STALE.format(f"state.{field}"))
        # One generation ahead: returned by an update whose commit was not made (planned
        # outside `guarded`): nothing newer exists, so it is the current one.
        flat._live = g
    new = _NEW(FlatTree)  # inline, not a method: this runs for each state buffer of each update
    new.__dict__ = flat.__dict__
    new._gen = g + 1
    renewals = _THREAD.renewals
    if renewals.depth:  # planned by an update (not by `explain`): committed when it returns
        renewals.append(new)
    return new


def keep_states(old: Any) -> None:
    """Says that the running update returns ``old`` (a state it was given, or part of one)
    unchanged although it was planned (a skipped step): its buffers' renewals are not
    committed, so that ``old`` stays current."""
    renewals = _THREAD.renewals
    if renewals:
        kept = {id(f.__dict__) for f in _state_flats(old, writable_only=False)}
        renewals[:] = [r for r in renewals if id(r.__dict__) not in kept]


def guarded(owner: FlatTree | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: an update (`Stage.update`, `numbaccum.step_`) of the state whose buffers
    ``owner`` owns (None: a stateless stage), run as one transaction.

    A state is not thread-safe: its update writes its buffers in place. Two updates of one state
    at once are caught here (a flag on the owner's storage, tens of nanoseconds; best effort,
    not a lock): RuntimeError. The buffers the update renewed (`current`) become the current
    ones only if it returns; an update inside another one (a transformation that calls
    ``update`` itself) joins the outer one's transaction.
    """
    if owner is not None:
        if owner._busy:
            raise RuntimeError(_BUSY)
        owner._busy = True
    renewals = _THREAD.renewals
    start = len(renewals)
    renewals.depth += 1
    try:
        out = fn(*args)
        if renewals.depth == 1 and renewals:  # the outermost update returns: commit
            for r in renewals:
                r._live = r._gen
            renewals.clear()
        return out
    except BaseException:
        del renewals[start:]
        raise
    finally:
        renewals.depth -= 1
        if owner is not None:
            owner._busy = False


def stage_of(tx: Any) -> Stage | None:
    """The `Stage` behind a transformation (its ``update`` is a stage's bound method), or None
    for a foreign transformation (any other ``(init, update)`` pair)."""
    if isinstance(tx, Stage):
        return tx
    owner = getattr(getattr(tx, "update", None), "__self__", None)
    return owner if isinstance(owner, Stage) else None


def _side(tree: Any) -> bool:
    """Whether a tree's first leaf is a CUDA array (the leaves were already checked to agree)."""
    if isinstance(tree, FlatTree):
        return tree.device
    leaves = tree_flatten(tree)[0]
    return bool(leaves) and not isinstance(leaves[0], (np.ndarray, np.generic))


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

    def foreign(self) -> bool:
        return True

    def plan(self, spec: Spec, state: Any, params: ParamsRef | None, extra: dict) -> Step:
        update = self.tx.update
        raw = params.raw if params is not None else None

        def run(u: Updates) -> tuple[Updates, Any]:
            out, new_state = update(u.handed_out().tree, state, raw, **extra)
            into = u.scratch or (lambda: self.kept("output", spec.layout, spec.device))
            return Updates(_read_foreign(out, spec, into), True), new_state

        return Step(run)


def _read_foreign(out: Any, spec: Spec, into: Callable[[], FlatTree]) -> FlatTree:
    """Copies the updates foreign code returned into ``into()``: always a copy, never a view of
    them (they may be its input, its own arrays or the params, which may change before they
    are read again). A Python or NumPy scalar stands for a 0-d leaf, as JAX accepts one."""
    layout = spec.layout
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
    _copy_groups(dst, flat)
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
    flats = _state_flats(states)
    if not flats:
        return run

    def all_or_nothing(*args: Any) -> Any:
        saved = [(f, f.workspace("undo", list(f.group_dtypes))) for f in flats]
        for f, b in saved:
            _copy_groups(b, f)
        try:
            return run(*args)
        except SkipStep:
            raise
        except BaseException:
            for f, b in saved:
                _copy_groups(f, b)
            raise

    return all_or_nothing


def _copy_groups(dst: FlatTree, src: FlatTree) -> None:
    for d, s in zip(dst.groups, src.groups):
        if dst.device:
            ops_for(s).scale_(d, s, ONE)
        else:
            np.copyto(d, s)  # bit for bit, NaN payloads included


def _state_flats(state: Any, writable_only: bool = True) -> list[FlatTree]:
    """The FlatTrees in a state (a nest of tuples, NamedTuples, lists and dicts), each once: the
    writable ones only unless ``writable_only`` is False."""
    found: dict[int, FlatTree] = {}

    def walk(x: Any) -> None:
        if isinstance(x, FlatTree):
            if not (writable_only and x._readonly):
                found.setdefault(id(x), x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)

    walk(state)
    return list(found.values())


def as_stage(tx: Any) -> Stage:
    """``tx``'s `Stage`, or a `Foreign` stage around it."""
    stage = stage_of(tx)
    return stage if stage is not None else Foreign(tx)


# --- combinators ----------------------------------------------------------------------------


class Chain(Stage):
    """`chain` and `named_chain`: plans every stage (threading the `Spec`, which a first
    reshaping stage changes) before it runs any. State: a tuple, or a dict keyed by ``names``."""

    def __init__(self, stages: list[Stage], names: list[str] | None = None) -> None:
        self.stages = stages
        self.names = names
        # A reshaping first stage (per-example aggregation) converts the chain's input.
        self.reshapes = bool(stages) and stages[0].reshapes  # type: ignore[misc]

    def init(self, params: Any) -> Any:
        states = tuple(s.init(params) for s in self.stages)
        return states if self.names is None else dict(zip(self.names, states))

    def _states(self, state: Any) -> tuple | None:
        """The stages' states in order, or None if ``state`` is not this chain's."""
        if self.names is None:
            return state if isinstance(state, tuple) and len(state) == len(self.stages) else None
        if isinstance(state, dict) and len(state) == len(self.names) and all(n in state for n in self.names):
            return tuple(state[n] for n in self.names)
        return None

    def foreign(self) -> bool:
        return self._last_foreign >= 0

    @property
    def _last_foreign(self) -> int:
        """The index of the last stage that runs foreign code, -1 if none (found once)."""
        found = self.__dict__.get("_last_foreign_")
        if found is None:
            found = max((i for i, s in enumerate(self.stages) if s.foreign()), default=-1)
            self.__dict__["_last_foreign_"] = found
        return found

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

    @property
    def _may_own(self) -> tuple[int, ...]:
        """The stages that may own workspaces (their class declares `owner`), before the
        first reshaping one: the only ones `owner` asks."""
        found = self.__dict__.get("_may_own_")
        if found is None:
            found = []
            for i, stage in enumerate(self.stages):
                if stage.reshapes:
                    break
                if type(stage).owner is not Stage.owner:
                    found.append(i)
            found = self.__dict__["_may_own_"] = tuple(found)
        return found

    def take(self, updates: Any, state: Any, params: Any, owner: FlatTree | None) -> tuple[Updates, str]:
        if self.reshapes:
            states = self._states(state)
            first = states[0] if states is not None else None
            return self.stages[0].take(updates, first, params, self.stages[0].owner(first))
        return super().take(updates, state, params, owner)

    def plan(self, spec: Spec, state: Any, params: ParamsRef | None, extra: dict) -> Step:
        states = self._states(state)
        if states is None:
            if self.names is not None:
                raise ValueError(f"state: named_chain expects a dict with keys {self.names}")
            n = len(state) if isinstance(state, (tuple, list)) else type(state).__name__
            raise ValueError(f"state: chain of {len(self.stages)} transformations got a state of {n}")
        owner = self._owner_of(states)
        if owner is not None and (owner.layout is not spec.layout or owner.device != spec.device):
            owner = None
        in_spec = spec
        steps = []
        specs = []  # the spec each stage is fed (a reshaping stage changes it for the next ones)
        for stage, s in zip(self.stages, states):
            specs.append(spec)
            step = stage.plan(spec, s, params, extra)
            steps.append(step)
            if step.spec is not None:
                spec = step.spec
        runs = [step.run for step in steps]
        if spec is in_spec:
            scratches = self._scratches(owner, in_spec, states)
        else:
            scratches = [
                stage.workspace(s, sp, "scratch") for stage, s, sp in zip(self.stages, states, specs)
            ]
        names = self.names
        out_spec = None if spec is in_spec else spec

        def pack(new_states: list) -> Any:
            return tuple(new_states) if names is None else dict(zip(names, new_states))

        # Foreign code runs its own checks while it runs: the states of the stages before the
        # last foreign one (and its own, which may hold our buffers: a user's function around
        # a numbaccum transformation) are snapshot before the run and restored if it raises
        # (`undoable`). A combinator around foreign code guards its own state itself.
        last = self._last_foreign
        earlier = states[:last] if last >= 0 else ()
        if last >= 0 and isinstance(self.stages[last], Foreign):
            earlier = (*earlier, states[last])
        segs = fuse.segments(steps) if fuse.enabled() else None
        if segs is not None and all(r is None for _, _, r in segs):
            segs = None  # nothing to fuse
        if segs is None:

            def run(u: Updates) -> tuple[Updates, Any]:
                new_states = list(states)
                for i, (step_run, scratch) in enumerate(zip(runs, scratches)):
                    u.scratch = scratch
                    try:
                        u, new_states[i] = step_run(u)
                    except SkipStep as e:  # the stages after it keep their states
                        new_states[i] = e.new_state
                        keep_states(states[i + 1 :])
                        raise SkipStep(pack(new_states)) from None
                return u, pack(new_states)

            return Step(undoable(run, earlier), out_spec, _chained(steps, names))

        n = len(steps)

        def run_fused(u: Updates, apply: FlatTree | None = None, settle: bool = False) -> tuple[Any, Any]:
            new_states: list = list(states)
            for start, stop, fr in segs:
                u.scratch = scratches[stop - 1]
                try:
                    if fr is None:
                        u, new_states[start] = runs[start](u)
                    elif stop == n:
                        u, new_states[start:stop] = run_parts(fr, u, apply, settle)
                    else:
                        u, new_states[start:stop] = run_parts(fr, u)
                except SkipStep as e:  # a run's pre-pass (a clip) skipped: nothing of it ran
                    new_states[start] = e.new_state
                    keep_states(states[start + 1 :])
                    raise SkipStep(pack(new_states)) from None
            return u, pack(new_states)

        run_fused = undoable(run_fused, earlier)
        last_fused = segs[-1][2] is not None
        return Step(
            run_fused,
            out_spec,
            _chained(steps, names),
            (lambda u, p: run_fused(u, p)[1]) if last_fused else None,
            (lambda u: run_fused(u, None, True)) if last_fused else None,
        )

    def _scratches(self, owner: FlatTree | None, spec: Spec, states: tuple) -> list:
        """Each stage's scratch buffer: a workspace ``chain<i>`` of the chain's owner, else the
        stage's own (`Stage.workspace`). A stage writes its new values into a scratch buffer of
        its own: it may still read its input after an inner transformation wrote into the
        scratch. The last list is kept, for the same owner (or layout) the next time."""
        memo = self.__dict__.get("_scratch_memo")
        # Keyed by the owner's workspaces, which its renewals share (`current`).
        key = None if owner is None else owner._workspaces
        if memo is not None and memo[0] is key and memo[1] is spec.layout and memo[2] == spec.device:
            return memo[3]
        if owner is not None:
            scratches = [_named_workspace(owner, f"chain{i}") for i in range(len(self.stages))]
        else:
            scratches = [stage.workspace(s, spec, "scratch") for stage, s in zip(self.stages, states)]
            if any(stage.owner(s) is not None for stage, s in zip(self.stages, states)):
                return scratches  # bound to this state: not kept
        self.__dict__["_scratch_memo"] = (key, spec.layout, spec.device, scratches)
        return scratches


def run_parts(
    fr: fuse.FusedRun, u: Updates, apply: FlatTree | None = None, settle: bool = False
) -> tuple[Any, list]:
    """Runs a fused run on ``u`` (`numbaccum.fuse.FusedRun.run`): ``(updates, new_states)``, the
    updates None when they were added to ``apply`` instead of written."""
    out, factor, new_states = fr.run(u.flat, u.factor, u.fresh, apply, settle)
    if out is None:
        return None, new_states
    return Updates(out, True, factor, scratch=u.scratch), new_states


def step_applier(step: Step) -> Callable[[Updates, FlatTree], Any] | None:
    """``apply(updates, params) -> new_state`` for a planned step: its own `Step.apply`, or, for
    a step that is one fusable run, that run with the params added in its pass; None when the
    step cannot apply its updates in its last pass (then: run it, then add the updates)."""
    if step.apply is not None:
        return step.apply
    if step.spec is None and fuse._fusable(step.fuse):
        (_, _, fr), *rest = fuse.segments([step])
        if fr is not None and not rest:
            return lambda u, p: run_parts(fr, u, p)[1][0]
    return None


def _chained(steps: list, names: list[str] | None) -> Any:
    """A chain's own part for an enclosing chain: its steps' parts when every one is fusable
    (`numbaccum.fuse.Chained`), else None."""
    if not steps or any(s.fuse is None or s.spec is not None for s in steps):
        return None
    return fuse.Chained([s.fuse for s in steps], names)


def _named_workspace(owner: FlatTree, name: str) -> Callable[[], FlatTree]:
    return lambda: owner.workspace(name)


def chain(*transforms: Any) -> GradientTransformationExtraArgs:
    """Applies ``transforms`` in order: ``u = t_n(...t_2(t_1(g)))``; state is a tuple.

    ``params`` and extra keyword arguments are passed to every transformation. Every stage is
    planned (its state, params and schedules checked) before any runs, so an error leaves every
    state as it was; a foreign (non-numbaccum) transformation runs its own checks when it runs
    (see `Foreign`).
    """
    txs = [
        with_extra_args_support(transformation(t, f"chain: transforms[{i}]"))
        for i, t in enumerate(transforms)
    ]
    return Chain([as_stage(t) for t in txs]).transformation()


def named_chain(*transforms: tuple[str, Any]) -> GradientTransformationExtraArgs:
    """Like `chain`, with a state dict keyed by the given names."""
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
    """An independent deep copy of a state (FlatTrees and arrays copied, structure kept)."""
    if isinstance(state, FlatTree):
        return state.copy()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        return {k: copy_state(v) for k, v in state.items()}
    if isinstance(state, tuple) and hasattr(type(state), "_fields"):
        return type(state)(*(copy_state(v) for v in state))
    if isinstance(state, (tuple, list)):
        return type(state)(copy_state(v) for v in state)
    return state
