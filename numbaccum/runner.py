"""The one runner: every update goes through here, planned once and replayed.

`Stage.update` (optax's ``update``) and `numbaccum.step_` (the update added to the params in
its last pass) are one function, `run`, in two modes. A call:

1. checks the state is free and current (`transaction.guarded`: one update of a state at a time, a
   stale state refused) and converts the user's updates once (`Stage.take`) and checks the
   params against their layout;
2. finds the `Plan` of the transformation for that layout and device, made once and kept with
   the state (in its owning buffer's storage: a plan lives and dies with the state it was made
   for) or, for a transformation without buffers, with the stage per thread;
3. **ticks** it: each declared part computes this step's values (counts, bias corrections,
   schedules, learning rates) into its slots, after checking that the state holds the buffers
   the plan was made for -- anything else (a state from ``init`` again, a checkpoint loaded,
   a state of another transformation) makes a new plan, whose declaration raises the clear
   error when the state is wrong. Nothing has been written yet;
4. runs the plan's passes: each maximal run of parts is one kernel per dtype group
   (`numbaccum.fuse.FusedRun`, whose calls are shaped once and replayed), a clip's reduction
   before it; with ``step_`` the last pass adds the update to the params.

Most calls repeat the last one: the state the last step returned, updates and params of the same
layout and form. A stage keeps its last step's plan per thread (`_LastStep`: the plan, weakly,
and the identity of the state it returned), and such a call goes from 3 straight to the plan's
tick (`_again`), which checks the state as every step does; anything else takes 1-2.

A control node (MultiSteps, masked, apply_if_finite, ...) declares a `numbaccum.fuse.Host` that
holds the plan of its inner transformation (`sub_plan`: declared once, kept by the part, not
here), ticks it when this step runs it, and replays it from its run. A reshaping stage
(lookahead, the per-example aggregation, a chain holding one: its `numbaccum.fuse.Host` names
the ``spec`` of what it returns, set by its tick) keeps its plan and takes `_again` too: its
params are checked after the tick, against that spec (`_reshaped`). User code is one opaque
part of a plan (`numbaccum.base.Foreign`): every transformation is planned once and replayed.

`numbaccum.explain` describes `plan_of`, the very plan `run` replays.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np

from . import _config, arrays, fuse
from .backend import ops_for
from .apply import apply_updates_, check_writable, scatter_back
from .flat import FlatTree, as_flat, device_flat, host_check, host_flat, layout_of
from .contract import ONE
from .fuse import run_part
from .transaction import guarded, keep_states, state_flats
from .updates import ParamsRef, SkipStep, Spec, Updates, check_params

__all__ = ["Plan", "Sub", "check_complex", "plan_of", "replay", "run", "stage_name", "sub_plan", "ticked"]


class Plan:
    """A declared transformation planned for one layout, device and mode.

    Attributes:
        root: the stage's declared part (a `numbaccum.fuse.Chained` for a chain).
        leaves: its `Kernel`, `Scale` and `Prepass` parts in order.
        runs: ``(start, stop, fused)`` over ``leaves``: a `numbaccum.fuse.FusedRun` of
            ``leaves[start:stop]`` (one pass per dtype group), or None for a lone factor or
            reduction (`fuse.run_part`).
        scratch: per run, where it writes when its input may not be overwritten.
        owner: the state's buffer that owns the workspaces (None for a stage without buffers);
            ``inbox``, ``into``, ``output``: its workspaces for the packed updates, the packed
            params and the returned updates (`Stage._workspace`).
        fused: whether the runs are fused (``NUMBACCUM_FUSE``), and ``apply``: whether the last
            run can add the updates to the params (`numbaccum.step_`): a fused run, or a
            control node's `numbaccum.fuse.Host` with an ``apply`` of its own (it adds them in
            its inner plan's last pass).
        tick: ``root.tick`` with the nested chains unrolled (`numbaccum.fuse.flat_tick`);
            ``new_state()``: the new state from the leaves' after a pass
            (`numbaccum.fuse.new_state_maker`).
        launches: the kernels that run after the last part, kept (`numbaccum.fuse.Launches`):
            a factor it leaves pending (a lone ``scale``) settled into the returned updates,
            or the updates added to the params when no pass of the plan adds them.
        undo: for a plan that runs foreign code among the parts of other stages (a chain, a
            wrapper: their parts spliced into its runs), ``undo(state)``: the states the step
            may have written when that code raises, copied before `replay` runs and restored
            then (`numbaccum.base.Stage.undo_states`); None otherwise.
    """

    __slots__ = (
        "root", "leaves", "runs", "scratch", "spec", "fused", "apply", "tick", "new_state", "owner",
        "inbox", "into", "output", "launches", "undo", "check", "returned", "__weakref__",
    )  # fmt: skip
    # Set by whoever makes the plan (`plan_of`, `sub_plan`), not by __init__.
    owner: FlatTree | None
    inbox: Any
    into: Any
    output: Any

    def __init__(self, root: Any, spec: Spec, fused: bool, scratch: list) -> None:
        self.root, self.spec, self.fused = root, spec, fused
        self.leaves = fuse.leaves(root)
        self.runs = fuse.cut(self.leaves) if fused else _one_by_one(self.leaves)
        # Its last pass can add to the params (an empty chain has no pass: the updates as given).
        self.apply = fused and bool(self.runs) and (self.runs[-1][2] is not None or applies(self.leaves[-1]))
        self.scratch = scratch[: len(self.runs)]
        self.tick = fuse.flat_tick(root)  # root.tick, nested chains unrolled
        self.new_state = fuse.new_state_maker(root)  # the new state from the leaves' after a pass
        self.launches = fuse.Launches()  # the settle or add after the last part (`_replayed`)
        self.undo: Any = None  # set with the stage (`undo_of`)
        self.check = host_check(spec.layout)  # `host_leaves` of a plain tree for this layout
        # A reshaping stage's: for the layout its updates have (the params'), `host_leaves` of
        # the params and where they are packed, ``(spec, check, into)`` (`_reshaped`).
        self.returned: tuple | None = None


def undo_of(stage: Any, root: Any) -> Any:
    """`Plan.undo` of ``stage``'s plan: its `numbaccum.base.Stage.undo_states` when it runs
    foreign code and its declaration splices the parts of other stages (a `numbaccum.fuse.Chained`
    or `numbaccum.fuse.Wrapped` root: no part of it restores what the others wrote)."""
    if stage.foreign() and isinstance(root, (fuse.Chained, fuse.Wrapped)):
        return stage.undo_states
    return None


def applies(part: Any) -> bool:
    """Whether a plan's last part adds the updates to the params itself: a control node's
    `numbaccum.fuse.Host` with an ``apply`` (MultiSteps: in its inner plan's last pass)."""
    return type(part) is fuse.Host and part.apply is not None


def _one_by_one(leaves: list) -> list:
    """Stage by stage (``NUMBACCUM_FUSE=0``): each kernel its own pass."""
    return [(i, i + 1, fuse.FusedRun([p]) if type(p) is fuse.Kernel else None) for i, p in enumerate(leaves)]


def check_complex(stage: Any, layout: Any) -> None:
    """TypeError when ``layout`` has complex leaves and ``stage`` (or a stage it runs) does not
    take them (`numbaccum.base.Stage.complex_leaves`): named, with the first complex leaf."""
    refusing = stage.refuses_complex()
    if refusing is None:
        return
    leaf = next(i for i, d in enumerate(layout.dtypes) if d.kind == "c")
    raise TypeError(
        f"{stage_name(refusing)} does not take complex leaves ({layout.path(leaf, 'updates')} is "
        f"{layout.dtypes[leaf]}); the dtypes guide lists the transformations that do"
    )


def stage_name(stage: Any) -> str:
    """A stage's public name, for errors: its declared ``name``, else its class's
    (``_ClipByGlobalNorm`` -> ``clip_by_global_norm``; a public class as it is)."""
    name = getattr(stage, "public_name", None) or getattr(stage, "name", None)
    if isinstance(name, str):
        return name
    cls = type(stage).__name__
    if not cls.startswith("_"):
        return cls
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(cls[1:]))


# --- finding the plan -----------------------------------------------------------------------


def plan_of(stage: Any, spec: Spec, state: Any, owner: FlatTree | None) -> Plan:
    """The kept plan of ``stage`` for ``spec`` and ``state``'s buffers (made now if none is
    kept), not yet ticked."""
    fused = fuse.enabled()
    plans = _plans(stage, owner)
    key = (stage, spec.layout, spec.device, fused)
    plan = plans.get(key)
    if plan is None:
        root = stage.declare(spec, state)  # checks the state: raises naming what is wrong
        scratch = [stage._workspace(owner, spec, f"run{i}") for i in range(len(fuse.leaves(root)))]
        plan = Plan(root, spec, fused, scratch)
        plan.owner, plan.undo = owner, undo_of(stage, root)
        plan.inbox = stage._inbox(owner, spec.layout, spec.device)
        plan.into = stage._workspace(owner, spec, "params")
        plan.output = stage._workspace(owner, spec, "output")
        if len(plans) >= max(_config.KEPT_LAYOUTS, 2):
            del plans[next(iter(plans))]  # the oldest: bounded for ever new tree shapes
        plans[key] = plan
    return plan


def sub_plan(stage: Any, spec: Spec, state: Any, owner: FlatTree | None, prefix: str) -> Plan:
    """The plan of ``stage``, the inner transformation of a control node (MultiSteps, masked,
    ...), declared now for ``spec`` and ``state``'s buffers, not yet ticked.

    The control node's part keeps it (it is not kept here: it lives and dies with the part, and
    so with the outer plan), ticks it on the steps that run it and runs it with `replay`. Its
    workspaces are ``owner``'s (None: the stage's own, `Stage.kept`) named with ``prefix``, so
    that they never collide with the outer plan's in the same owner."""
    root = stage.declare(spec, state)  # checks the state: raises naming what is wrong
    scratch = [stage._workspace(owner, spec, f"{prefix}run{i}") for i in range(len(fuse.leaves(root)))]
    plan = Plan(root, spec, fuse.enabled(), scratch)
    plan.owner, plan.inbox, plan.into = owner, None, None  # the outer plan's input and params
    plan.undo = undo_of(stage, root)
    plan.output = stage._workspace(owner, spec, f"{prefix}output")
    return plan


class Sub(NamedTuple):
    """A control node's inner plan in its ``passes`` (`numbaccum.fuse.Host`), which
    `numbaccum.explain` describes in its place: ``plan`` (ticked for this step), whether it adds
    the updates to the params (``apply``), the share of the parameters it runs on
    (``weight``: masked's kept leaves), and whether a factor it leaves pending is applied by
    the control node's next pass (``folded``: masked's copies out), not settled on its own."""

    plan: Plan
    apply: bool
    weight: float = 1.0
    folded: bool = False


def _plans(stage: Any, owner: FlatTree | None) -> dict:
    """Where the plans of ``stage`` are kept: with the state's owning storage (shared by its
    renewals, gone with it), else, for a stage whose state holds no buffers, per thread beside
    the buffers the stage keeps for itself (`Stage.kept`: gone with the stage)."""
    if owner is not None:
        plans = owner.__dict__.get("_plans")
        if plans is None:
            plans = owner.__dict__["_plans"] = {}
        return plans
    local = stage.local()
    plans = local.__dict__.get("plans")
    if plans is None:
        plans = local.plans = {}
    return plans


def ticked(stage: Any, spec: Spec, state: Any, owner: Any, ref: Any, extra: dict) -> Plan:
    """The plan, ticked for this step: declared anew when the state is not the one it was made
    for (the new declaration checks it, and raises what is wrong)."""
    plan = plan_of(stage, spec, state, owner)
    if not plan.tick(state, ref, extra):
        _plans(stage, owner).pop((stage, spec.layout, spec.device, plan.fused), None)
        plan = plan_of(stage, spec, state, owner)
        if not plan.tick(state, ref, extra):
            raise AssertionError(f"{type(stage).__name__}: a new declaration refused its own state")
    return plan


# --- running it -----------------------------------------------------------------------------


def replay(plan: Plan, state: Any, u: Updates, apply: FlatTree | None, settle: bool) -> tuple[Any, Any]:
    """Runs a ticked plan on ``u``: ``(updates, new_state)``, the updates None when the last
    pass added them to ``apply`` (given only when the plan's last run can: `Plan.apply`; a
    control node's last part then adds them itself, ``Host.apply(u, params) -> new_state``).
    A clip that skips the step raises `SkipStep` with the new state (the parts before it
    advanced, the ones after as they were)."""
    saved = None if plan.undo is None else snapshot(plan.undo(state))
    leaves, runs = plan.leaves, plan.runs
    last = len(runs) - 1
    try:
        for i, (start, _, fr) in enumerate(runs):
            u.scratch = plan.scratch[i]
            try:
                if fr is None:
                    part = leaves[start]
                    if i == last and apply is not None:  # a control node's `Host.apply` (`Plan.apply`)
                        part.new_state = part.apply(u, apply)
                        return None, plan.new_state()
                    # `run_part`'s two common parts inline (every replay of a control node)
                    kind = type(part)
                    if kind is fuse.Host:
                        u, part.new_state = part.run(u)
                    elif kind is fuse.Scale:  # a pending factor (`Updates.scaled`; ONE: nothing)
                        factor = part.factor
                        if factor is not ONE and not factor.is_one:
                            u = u.scaled(factor)
                    else:
                        u = run_part(part, u)[0]
                elif i == last:
                    out, factor = fr.run(u.flat, u.factor, u.fresh, apply, settle, False)
                    if out is None:
                        return None, plan.new_state()
                    u = Updates(out, True, factor, scratch=u.scratch)
                else:
                    out, factor = fr.run(u.flat, u.factor, u.fresh, None, False, False)
                    u = Updates(out, True, factor, scratch=u.scratch)
            except SkipStep as e:
                raise SkipStep(_skipped(plan, state, start, e.new_state)) from None
    except SkipStep:  # an outcome, not a failure: what ran stays
        raise
    except BaseException:
        if saved is not None:  # foreign code raised: what the step wrote, copied back
            restore(saved)
        raise
    return u, plan.new_state()


def snapshot(states: Any) -> list:
    """Copies of the FlatTrees of ``states`` (each into its workspace ``undo``, made once), for
    `restore`."""
    saved = [(f, f.workspace("undo", list(f.group_dtypes))) for f in state_flats(states)]
    for f, b in saved:
        copy_groups(b, f)
    return saved


def restore(saved: list) -> None:
    """Copies a `snapshot` back into the FlatTrees it was taken of."""
    for f, b in saved:
        copy_groups(f, b)


def copy_groups(dst: FlatTree, src: FlatTree) -> None:
    """``dst``'s groups set to ``src``'s, bit for bit (NaN payloads included)."""
    for d, s in zip(dst.groups, src.groups):
        if dst.device:
            ops_for(s).scale_(d, s, ONE)
        else:
            np.copyto(d, s)


def _skipped(plan: Plan, state: Any, at: int, skipped: Any) -> Any:
    """The new state of a step that part ``at`` skipped: the parts before it advanced, its own
    new state, the ones after it as they were (their renewals not committed)."""
    old = fuse.split(plan.root, state)
    new = [p.new_state.make() if type(p.new_state) is fuse.Later else p.new_state for p in plan.leaves[:at]]
    keep_states(old[at + 1 :])
    return fuse.pack(plan.root, [*new, skipped, *old[at + 1 :]])


def run(stage: Any, grads: Any, state: Any, params: Any, extra: dict, apply: bool) -> Any:
    """``stage.update(grads, state, params, **extra)`` (``apply`` False: returns ``(updates,
    new_state)``), or `numbaccum.step_` (``apply`` True: the updates added to ``params`` in
    place, returns the new state). The one entry of every update."""
    local = stage.__dict__.get("_kept")
    last = local.__dict__.get("last_step") if local is not None else None
    if last is not None and last.state == id(state) and last.apply is apply:
        plan = last.plan()
        if plan is not None:
            try:
                return guarded(plan.owner, _again, stage, plan, grads, state, params, extra, last)
            except _Miss:
                pass
    if not apply and grads is None and params is not None:
        # optax maps over the updates: None (an empty tree) gives None whatever the params,
        # which are then not read (a stateful stage still says its state wants a tree).
        params = FlatTree.empty(layout_of(None, "params"))
    owner = stage.owner(state)
    if apply:
        if not fuse.enabled():
            # One transaction (the update joins it): Ctrl-C waits for the params too.
            return guarded(None, _update_then_apply, stage, grads, state, params, extra)
        return guarded(owner, _step, stage, grads, state, params, owner, extra)
    return guarded(owner, _update, stage, grads, state, params, owner, extra)


# --- the same step again ----------------------------------------------------------------------


class _LastStep:
    """The last planned update of a stage on one thread (`run`): its plan (weakly: a plan lives
    with the state's buffers), the mode (``apply``: `numbaccum.step_`) and the identity of the
    state it returned. A call given that state, with updates and params of the plan's layout in
    the same form (FlatTrees, or plain trees of NumPy arrays), goes straight to the plan's tick
    (`_again`): the tick checks the state as on every step (type, buffers, current), and what
    the full entry derives from the arguments (owner, spec, workspaces) is the plan's."""

    __slots__ = ("plan", "apply", "state")

    def __init__(self, plan: Plan, apply: bool, new_state: Any) -> None:
        self.plan, self.apply, self.state = weakref.ref(plan), apply, id(new_state)


def _keep_last(stage: Any, plan: Plan, apply: bool, kind: str, new_state: Any) -> None:
    if kind == "flat" or kind == "numpy":  # CUDA array types take the full entry (their stream)
        stage.local().last_step = _LastStep(plan, apply, new_state)


class _Miss(Exception):
    """The arguments are not in the form of the last step's (`_again`): the full entry runs."""


_MISS = _Miss()


def _again(stage: Any, plan: Plan, grads: Any, state: Any, params: Any, extra: dict, last: _LastStep) -> Any:
    """`_update` or `_step` of the last step's plan, inside `guarded`; raises `_Miss` (nothing
    written, the renewals of the tick undone by `guarded`) when the arguments or the state do
    not fit it. Notes the new state in ``last`` here, inside the transaction: nothing runs
    between `guarded`'s end and the caller (see `numbaccum._interrupts`)."""
    apply = last.apply
    spec = plan.spec
    layout, device = spec.layout, spec.device
    if plan.fused is not fuse.enabled():
        raise _MISS
    if type(grads) is FlatTree:
        if grads.layout is not layout or grads.device != device:
            raise _MISS
        u, kind = Updates(grads, False), "flat"
    else:
        checked = None if device else plan.check(grads)
        if checked is None:
            raise _MISS
        flat, copied, kind = host_flat(checked, layout, plan.inbox)
        u = Updates(flat, copied)
    if stage.reshapes:  # its params have the layout of what it returns: checked after its tick
        if params is None and apply:
            raise _MISS
        ref = None if params is None else ParamsRef(params, layout, None, device)
        if not plan.tick(state, ref, extra):
            raise _MISS
        done = _reshaped(stage, plan, state, u, kind, spec, ref, params, plan.owner, apply)
        last.state = id(done if apply else done[1])
        return done
    ref, copied = _params_again(plan, params, apply)
    if not plan.tick(state, ref, extra):
        raise _MISS
    u.scratch = plan.output
    if not apply:
        out, new_state = _replayed(stage, plan, state, u, spec)
        last.state = id(new_state)
        return out.lent(kind), new_state
    assert ref is not None and ref._flat is not None  # apply: `_params_again` made them writable
    new_state = _run_step(stage, plan, state, u, ref._flat, copied, spec, kind, ref.checked, params, None)
    last.state = id(new_state)
    return new_state


def _params_again(plan: Plan, params: Any, apply: bool) -> tuple[ParamsRef | None, bool]:
    """The params of `_again` and whether they were packed: checked and made writable as the
    full entry does (`check_params`, `_writable`: the same errors); separate CUDA arrays, whose
    addresses the full entry reads once for the whole step, raise `_Miss`."""
    spec = plan.spec
    if params is None:
        if apply:
            raise _MISS
        return None, False
    ref = ParamsRef(params, spec.layout, None, spec.device, plan.into)
    if type(params) is FlatTree and params.layout is spec.layout and params.device == spec.device:
        # The plan's own layout: `check_params` has nothing to check and `_writable` returns
        # them once `check_writable` has passed.
        if apply:
            check_writable(params, "params")
            ref._flat = params
        return ref, False
    if spec.device:
        raise _MISS
    ref.checked = plan.check(params) or check_params(params, spec)  # the common case first
    if not apply:
        return ref, False
    ref._flat, copied = _writable(params, spec, plan.into, None, ref.checked)
    return ref, copied


def _spec(stage: Any, flat: FlatTree) -> Spec:
    local = stage.local()  # the last one, kept (per thread): a small tree's update is microseconds
    spec = local.__dict__.get("spec")
    if spec is None or spec.layout is not flat.layout or spec.device != flat.device:
        if flat.layout.complex:  # once per layout: a stage that does not take them says so now
            check_complex(stage, flat.layout)
        spec = local.spec = Spec(flat.layout, flat.device)
    return spec


def _update(stage: Any, updates: Any, state: Any, params: Any, owner: Any, extra: dict) -> tuple[Any, Any]:
    u, kind = stage.take(updates, state, params, owner)
    spec = _spec(stage, u.flat)
    ref = None
    if params is not None:
        ref = ParamsRef(params, spec.layout, None, spec.device, stage._workspace(owner, spec, "params"))
        if not stage.reshapes:
            ref.checked = check_params(params, spec)
    plan = ticked(stage, spec, state, owner, ref, extra)
    if stage.reshapes:
        out, new_state = _reshaped(stage, plan, state, u, kind, spec, ref, params, owner, False)
        _keep_last(stage, plan, False, kind, new_state)
        return out, new_state
    u.scratch = stage._workspace(owner, spec, "output")
    if kind in arrays.STREAM_KINDS:  # kernels go to the caller's current CUDA stream
        with arrays.launch_context(kind):
            out, new_state = _replayed(stage, plan, state, u, spec)
    else:
        out, new_state = _replayed(stage, plan, state, u, spec)
    _keep_last(stage, plan, False, kind, new_state)
    return out.lent(kind), new_state


def _replayed(stage: Any, plan: Plan, state: Any, u: Updates, spec: Spec) -> tuple[FlatTree, Any]:
    """`_run_or_zeros` of a kept plan: its output settled (the last pass settles a trailing
    factor), zeros for a skipped step."""
    try:
        u, new_state = replay(plan, state, u, None, True)
    except SkipStep as e:
        return stage.workspace(e.new_state, spec, "output")().fill_(0.0), e.new_state
    # `Stage._output`, read off here (every update of a kept plan): a trailing lone factor
    # settled by the plan's kept launches, owned or returnable updates as they are.
    factor = u.factor
    if factor is not ONE and not factor.is_one:
        out = u.flat if u.owned else stage.workspace(new_state, spec, "output")()
        return plan.launches.settle(u, out), new_state
    if u.owned or u.returnable:
        return u.flat, new_state
    return stage._output(u, new_state, spec), new_state


def _step(stage: Any, grads: Any, state: Any, params: Any, owner: Any, extra: dict) -> Any:
    """`numbaccum.step_`, inside `guarded`: the update added to the params in its last pass."""
    if stage.reshapes:
        return _step_reshaped(stage, grads, state, params, owner, extra)
    u, kind = stage.take(grads, state, params, owner)
    spec = _spec(stage, u.flat)
    into = stage._workspace(owner, spec, "params")
    ref = ParamsRef(params, spec.layout, None, spec.device, into)
    # Separate CUDA arrays: their addresses are read once here, for the check, the packing and
    # the write-back (a microsecond a leaf each time otherwise).
    found = (
        None if isinstance(params, FlatTree) or not spec.device else arrays.device_leaves(params, spec.layout)
    )
    ref.checked = None if found is not None else check_params(params, spec)
    plan = ticked(stage, spec, state, owner, ref, extra)
    p, copied = _writable(params, spec, into, found, ref.checked)
    if ref._flat is None:  # a stage that reads the params (weight decay) reads these: the
        ref._flat = p  # fused pass then reads and writes one buffer (`fuse._run_group`)
    u.scratch = stage._workspace(owner, spec, "output")
    new_state = _run_step(stage, plan, state, u, p, copied, spec, kind, ref.checked, params, found)
    _keep_last(stage, plan, True, kind, new_state)
    return new_state


def _step_reshaped(stage: Any, grads: Any, state: Any, params: Any, owner: Any, extra: dict) -> Any:
    """`numbaccum.step_` of a declared reshaping stage (lookahead, the per-example
    aggregation), inside `guarded`: its plan ticked, then `_reshaped`."""
    u, kind = stage.take(grads, state, params, owner)
    spec = _spec(stage, u.flat)
    ref = ParamsRef(params, spec.layout, None, spec.device)
    plan = ticked(stage, spec, state, owner, ref, extra)
    new_state = _reshaped(stage, plan, state, u, kind, spec, ref, params, owner, True)
    _keep_last(stage, plan, True, kind, new_state)
    return new_state


def _reshaped(
    stage: Any,
    plan: Plan,
    state: Any,
    u: Updates,
    kind: str,
    spec: Spec,
    ref: Any,
    params: Any,
    owner: Any,
    apply: bool,
) -> Any:
    """The ticked plan of a declared reshaping stage run: the params checked against the layout
    of the updates it returns (its `numbaccum.fuse.Host`'s ``spec``, known after the tick);
    ``(updates, new_state)``, or with ``apply`` (`numbaccum.step_`) the params made writable,
    the updates added to them (nothing adds them in a pass: the stage writes a buffer of its
    own) and the new state."""
    root = plan.root  # (`fuse.returned_spec`'s common case inline: a reshaping stage's Host)
    out_spec = (root.spec if type(root) is fuse.Host else fuse.returned_spec(root)) or spec
    if ref is not None and (ref.checked is None or ref._layout is not out_spec.layout):
        # The params, checked against the layout of the updates (``out_spec``: the params', not
        # the per-example gradients') as `check_params` checks them, a plain host tree by the
        # plan's kept `host_leaves` first (the common case); nothing to do when the tick checked
        # their host leaves against that layout and named where they are packed already
        # (lookahead's pair: `ParamsRef` ``checked``, ``_layout`` and ``_into`` set together).
        kept = plan.returned
        if kept is None or kept[0] is not out_spec:  # (the spec its part returns: one per layout)
            check = None if out_spec.device else host_check(out_spec.layout)
            kept = plan.returned = (out_spec, check, stage._workspace(owner, out_spec, "params"))
        check = kept[1]
        ref.checked = (check is not None and check(params)) or check_params(params, out_spec)
        ref._layout = out_spec.layout
        ref._into = kept[2]
    u.scratch = plan.output  # (`plan_of`'s: the stage's workspace of the input's spec)
    if not apply:
        if kind in arrays.STREAM_KINDS:  # kernels go to the caller's current CUDA stream
            with arrays.launch_context(kind):
                out, new_state = _replayed(stage, plan, state, u, out_spec)
        else:
            out, new_state = _replayed(stage, plan, state, u, out_spec)
        return out.lent(kind), new_state
    p, copied = _writable(params, out_spec, ref._into, None, ref.checked)
    if ref._flat is None:  # a stage that reads the params reads these (written after it ran)
        ref._flat = p
    return _run_step(stage, plan, state, u, p, copied, out_spec, kind, ref.checked, params, None)


def _run_step(
    stage: Any,
    plan: Plan,
    state: Any,
    u: Updates,
    p: FlatTree,
    copied: bool,
    spec: Spec,
    kind: str,
    checked: list | None,
    params: Any,
    found: Any,
) -> Any:
    """The step on the writable params ``p``, on the caller's CUDA stream; when ``p`` is a
    packed copy of ``params`` (``copied``), copied back (into ``checked``, its NumPy leaves, or
    by `scatter_back`). ``plan``: ticked. Returns the new state."""
    try:
        if kind in arrays.STREAM_KINDS:
            with arrays.launch_context(kind):
                new_state = _apply_step(stage, plan, state, u, p, spec)
        elif plan.apply:  # (`_apply_step`'s common case inline: every step of a kept plan)
            new_state = replay(plan, state, u, p, False)[1]
        else:
            new_state = _apply_step(stage, plan, state, u, p, spec)
    except SkipStep as e:  # a clip skipped the step: the params are not touched
        return e.new_state
    if copied:
        if checked is not None:  # the caller's NumPy arrays, checked before: copy back
            for dst, src in zip(checked, p.leaf_views()):
                dst[...] = src  # the same shapes and dtypes (checked): np.copyto's work, sooner
        else:
            scatter_back(p, params, "params", found)
    return new_state


def _apply_step(stage: Any, plan: Plan, state: Any, u: Updates, p: FlatTree, spec: Spec) -> Any:
    """Runs the ticked plan: its last pass adds the updates to ``p`` (a plan whose last run is
    fused, or a control node's ``apply``), or (nothing fused at the end) it runs, then the
    updates are added."""
    if plan.apply:
        return replay(plan, state, u, p, False)[1]
    u, new_state = replay(plan, state, u, None, False)
    factor = u.factor
    if factor is not ONE and not factor.is_one:  # a trailing factor (-lr after a host step):
        # settled in the apply's pass
        local = stage.local().__dict__  # its group calls, kept (SM3, user code)
        fuse.apply_settled(u, p, local.get("tail") or local.setdefault("tail", ({}, {})))
    else:  # `_apply`, with the plan's kept launches (`_output` read off)
        plan.launches.add(p, u.flat if u.owned or u.returnable else stage._output(u, new_state, spec))
    return new_state


def _update_then_apply(stage: Any, grads: Any, state: Any, params: Any, extra: dict) -> Any:
    """`numbaccum.step_` as ``update`` then ``apply_updates_`` (stage by stage, or a reshaping
    stage whose updates have the params' layout, not the gradients')."""
    check_writable(params, "params")
    updates, new_state = stage.update(grads, state, params, **extra)
    apply_updates_(params, updates)
    return new_state


def _writable(
    params: Any, spec: Spec, into: Any, found: Any = None, checked: list | None = None
) -> tuple[FlatTree, bool]:
    """params as a FlatTree of ``spec``'s layout whose changes reach the caller (``copied``: a
    packed copy, in the workspace ``into`` gives, to scatter back); ``found``: the addresses of
    separate CUDA arrays, already read (`arrays.device_leaves`); ``checked``: the leaves of a
    plain host tree, already checked against the layout (`base.check_params`)."""
    if found is not None:
        flat, copied, _ = device_flat(found, spec.layout, into)
        return flat, copied
    if checked is None:
        check_writable(params, "params")  # names the leaf that cannot change
    else:
        for x in checked:  # a loop, not a comprehension: a small tree's every step
            if not x.flags.writeable:
                check_writable(params, "params")
    if checked is not None:  # a plain host tree: packed, or viewed (`as_flat`'s own path)
        flat, copied, _ = host_flat(checked, spec.layout, into)
        return flat, copied
    if isinstance(params, FlatTree) and params.layout is spec.layout and params.device == spec.device:
        return params, False
    flat, copied, _ = as_flat(
        params, spec.layout, "params", pack_into=into, device=spec.device, checked=checked
    )
    return flat, copied
