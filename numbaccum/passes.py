"""What an update runs, and an update applied in place: `explain` and `step_`.

`explain(tx, params)` plans ``tx`` as ``tx.update`` would (nothing is written) and lists the
passes over memory it will run: each pass, the stages it fuses (`numbaccum.fuse`) and the bytes
per parameter it moves, against the arithmetic minimum (each input read once, each state read
and written once, the output written once, plus one read of the input per reduction a clip or a
normalize needs before its factor is known).

`step_(tx, grads, state, params)` runs the update and adds it to ``params`` in place within the
last fused pass: the update buffer is never written and read back (about 8 bytes per float32
parameter less than ``update`` then `apply_updates_`). Same bits as those two calls.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import arrays, fuse
from ._checks import transformation
from .accumulation import MultiSteps, MultiStepsState, skip_large_updates, skip_not_finite
from .apply import apply_updates_, scatter_back
from .base import (
    Chain,
    ParamsRef,
    SkipStep,
    Spec,
    Stage,
    Updates,
    as_stage,
    check_params,
    guarded,
    step_applier,
    with_extra_args_support,
)
from .flat import FlatTree, as_flat, device_flat, layout_of
from .tree import format_path, tree_flatten_with_path

__all__ = ["Explanation", "Pass", "explain", "step_"]


# --- step_ ----------------------------------------------------------------------------------


def step_(tx: Any, grads: Any, state: Any, params: Any, **extra_args: Any) -> Any:
    """``params += tx.update(grads, state, params)[0]`` in place, within the update's last fused
    pass (the update is never written to a buffer); returns the new state.

    Same results as ``updates, state = tx.update(grads, state, params)`` then
    ``apply_updates_(params, updates)`` (the same bits on the CPU). A transformation whose last
    stages do not fuse (a foreign one, `MultiSteps`, ``NUMBACCUM_FUSE=0``) runs exactly those two
    calls.

    Args:
        tx: a transformation.
        grads: the gradients (a tree, or a FlatTree).
        state: ``tx``'s state (consumed, like ``update``'s).
        params: a FlatTree, or a tree of writable arrays, changed in place.

    Raises:
        TypeError: a leaf of ``params`` cannot change in place; or what ``tx.update`` raises.
        Nothing is written then.
    """
    stage = as_stage(with_extra_args_support(transformation(tx, "tx")))
    if not fuse.enabled() or stage.reshapes:
        return _update_then_apply(stage, grads, state, params, extra_args)
    owner = stage.owner(state)
    # The same guard as `update`: one update of a state at a time, only of the current state.
    return guarded(owner, _step, stage, grads, state, params, owner, extra_args)


def _step(stage: Stage, grads: Any, state: Any, params: Any, owner: Any, extra_args: dict) -> Any:
    """`step_` of a stage whose last pass may add the updates to the params, inside `guarded`."""
    u, kind = stage.take(grads, state, params, owner)
    spec = Spec(u.flat.layout, u.flat.device)
    into = stage._workspace(owner, spec, "params")
    ref = ParamsRef(params, spec.layout, None, spec.device, into)
    # Separate CUDA arrays: their addresses are read once here, for the check, the packing and
    # the write-back (a microsecond a leaf each time otherwise).
    found = (
        None if isinstance(params, FlatTree) or not spec.device else arrays.device_leaves(params, spec.layout)
    )
    ref.checked = None if found is not None else check_params(params, spec)
    step = stage.plan(spec, state, ref, extra_args)
    apply = step_applier(step)
    if apply is None:  # nothing fused at the end: the planned step, then apply_updates_
        return _run_then_apply(stage, step, u, kind, params, spec, owner, found)
    p, copied = _writable(params, spec, into, found)
    if ref._flat is None:  # a stage that reads the params (weight decay) reads these: the
        ref._flat = p  # fused pass then reads and writes one buffer (`fuse._run_group`)
    u.scratch = stage._workspace(owner, spec, "output")
    try:
        if kind in arrays.STREAM_KINDS:
            with arrays.launch_context(kind):
                new_state = apply(u, p)
        else:
            new_state = apply(u, p)
    except SkipStep as e:  # a clip skipped the step: the params are not touched
        return e.new_state
    if copied:
        scatter_back(p, params, "params", found)
    return new_state


def _update_then_apply(stage: Stage, grads: Any, state: Any, params: Any, extra: dict) -> Any:
    _writable_check(params)
    updates, new_state = stage.update(grads, state, params, **extra)
    apply_updates_(params, updates)
    return new_state


def _run_then_apply(
    stage: Stage, step: Any, u: Updates, kind: str, params: Any, spec: Spec, owner: Any, found: Any
) -> Any:
    p, copied = _writable(params, spec, stage._workspace(owner, spec, "params"), found)
    u.scratch = stage._workspace(owner, spec, "output")
    try:
        if kind in arrays.STREAM_KINDS:
            with arrays.launch_context(kind):
                u, new_state = step.run(u)
                apply_updates_(p, stage._output(u, new_state, spec))
        else:
            u, new_state = step.run(u)
            apply_updates_(p, stage._output(u, new_state, spec))
    except SkipStep as e:  # a clip skipped the step: the params are not touched
        return e.new_state
    if copied:
        scatter_back(p, params, "params", found)
    return new_state


def _writable_check(tree: Any) -> None:
    if isinstance(tree, FlatTree):
        return
    raw, paths, _ = tree_flatten_with_path(tree)
    for x, path in zip(raw, paths):
        if isinstance(x, np.generic) or (isinstance(x, np.ndarray) and not x.flags.writeable):
            where = format_path(path, "params")
            raise TypeError(f"{where}: cannot be changed in place (not a writable array)")


def _writable(params: Any, spec: Spec, into: Any, found: Any = None) -> tuple[FlatTree, bool]:
    """params as a FlatTree of ``spec``'s layout whose changes reach the caller (``copied``: a
    packed copy, in the workspace ``into`` gives, to scatter back); ``found``: the addresses of
    separate CUDA arrays, already read (`arrays.device_leaves`)."""
    if found is not None:
        flat, copied, _ = device_flat(found, spec.layout, into)
        return flat, copied
    _writable_check(params)
    if isinstance(params, FlatTree) and params.layout is spec.layout and params.device == spec.device:
        return params, False
    flat, copied, _ = as_flat(params, spec.layout, "params", pack_into=into, device=spec.device)
    return flat, copied


# --- explain --------------------------------------------------------------------------------


class Pass(NamedTuple):
    """One pass over memory: ``kind`` ("reduction", "fused", "kernel", "settle", "apply",
    "opaque"), the stages it runs, and the bytes per parameter it reads and writes (None where
    not known: a stage that is not described)."""

    kind: str
    stages: tuple[str, ...]
    read: float | None
    written: float | None

    @property
    def bytes(self) -> float | None:
        return None if self.read is None or self.written is None else self.read + self.written


class Explanation(NamedTuple):
    """The passes of an update (`explain`); ``print`` shows them as a table."""

    passes: tuple[Pass, ...]
    minimum: float
    fused: bool
    applied: bool
    num_params: int

    @property
    def total(self) -> float | None:
        """Bytes per parameter over every pass (None if a pass is not described)."""
        sizes = [p.bytes for p in self.passes]
        return None if any(b is None for b in sizes) else float(sum(sizes))  # type: ignore[arg-type]

    def __str__(self) -> str:
        head = "step_" if self.applied else "update"
        mode = "fused" if self.fused else "stage by stage"
        lines = [f"{head} ({mode}), {self.num_params} parameters: {len(self.passes)} passes"]
        for i, p in enumerate(self.passes):
            b = "?" if p.bytes is None else f"{p.bytes:.1f}"
            r = "?" if p.read is None else f"{p.read:.1f}"
            w = "?" if p.written is None else f"{p.written:.1f}"
            stages = " + ".join(p.stages)
            lines.append(f"  {i + 1}. {p.kind:<9} {b:>5} B/param (read {r}, write {w})  {stages}")
        total = self.total
        shown = "?" if total is None else f"{total:.1f}"
        ratio = "" if total is None or not self.minimum else f" ({total / self.minimum:.2f}x)"
        lines.append(f"  total {shown} B/param{ratio}; arithmetic minimum {self.minimum:.1f} B/param")
        return "\n".join(lines)

    __repr__ = __str__


def explain(
    tx: Any, params: Any, state: Any = None, *, apply: bool = False, fused: bool | None = None
) -> Explanation:
    """The passes ``tx.update(updates, state, params)`` will run (`step_` with ``apply=True``).

    Plans ``tx`` for updates shaped like ``params`` (nothing is run or written): which stages
    each pass fuses, the bytes per parameter each moves (reads and writes of inputs, states and
    outputs, by their dtypes), and the total against the arithmetic minimum.

    Args:
        tx: a transformation.
        params: the parameters (their layout and dtypes; add_decayed_weights reads them).
        state: ``tx``'s state; None: ``tx.init(params)`` (allocates a state).
        apply: explain `step_` (the update added to params) instead of ``update``.
        fused: explain the fused (True) or stage-by-stage (False) path; None: what
            ``NUMBACCUM_FUSE`` selects now.
    """
    stage = as_stage(with_extra_args_support(transformation(tx, "tx")))
    fused = fuse.enabled() if fused is None else bool(fused)
    layout = params.layout if isinstance(params, FlatTree) else layout_of(params, "params")
    device = params.device if isinstance(params, FlatTree) else False
    if state is None:
        state = stage.init(params)
    spec = Spec(layout, device)
    ref = ParamsRef(params, layout, None, device)
    if isinstance(stage, MultiSteps) and not stage.reshapes:  # (DP accumulation: opaque below)
        return _explain_multisteps(stage, params, state, apply, fused, layout)
    if isinstance(stage, Chain) and type(stage).plan is Chain.plan:
        states = stage._states(state)
        if states is None:
            raise ValueError("state: not this chain's state")
        steps = [s.plan(spec, st, ref, {}) for s, st in zip(stage.stages, states)]
        names = [type(s).__name__.lstrip("_") for s in stage.stages]
    else:
        steps = [stage.plan(spec, state, ref, {})]
        names = [type(stage).__name__.lstrip("_")]
    sizes = np.array(layout.group_sizes, np.float64)
    n = float(sizes.sum()) or 1.0
    d = np.array([np.dtype(t).itemsize for t in layout.group_dtypes], np.float64)

    def per_param(itemsizes: Any) -> float:
        return float(np.dot(sizes, itemsizes) / n)

    x = per_param(d)

    def buffers(part: fuse.Kernel) -> tuple[float, float]:
        st = sum(per_param([g.dtype.itemsize for g in s.groups]) for s in part.states)
        extra = x * (len(part.formula.inputs) - 1)  # params: the updates' dtypes
        return st + extra, st

    segs = fuse.segments(steps) if fused else [(i, i + 1, None) for i in range(len(steps))]
    passes: list[Pass] = []
    # The gradient read once, and the output written once (params read and written with apply);
    # each state and extra input below.
    minimum = x + (2 * x if apply else x)
    pending = False
    for start, stop, fr in segs:
        parts = fr.parts if fr is not None else fuse.leaves(steps[start].fuse) if steps[start].fuse else None
        if parts is None:
            passes.append(Pass("opaque", (names[start],), None, None))
            pending = False
            continue
        for p in parts:
            if isinstance(p, fuse.Kernel):
                r, w = buffers(p)
                minimum += r + w
            elif isinstance(p, fuse.Prepass):
                minimum += x
        if fr is not None:
            label = tuple(_part_name(p) for p in parts if not (isinstance(p, fuse.Scale) and p.factor.is_one))
            if isinstance(parts[0], fuse.Prepass):
                passes.append(Pass("reduction", (f"{parts[0].name} ({parts[0].reads})",), x, 0.0))
            r = x + sum(buffers(p)[0] for p in parts if isinstance(p, fuse.Kernel))
            w = sum(buffers(p)[1] for p in parts if isinstance(p, fuse.Kernel))
            last = stop == len(steps)
            if apply and last:
                # The params a part reads (weight decay) are the ones the pass writes: read once.
                shared = x * sum(len(p.formula.inputs) - 1 for p in parts if isinstance(p, fuse.Kernel))
                minimum -= shared
                passes.append(Pass("fused", (*label, "apply to params"), r + x - shared, w + x))
            else:
                passes.append(Pass("fused", label, r, w + x))
            pending = False
            continue
        for p in parts:  # stage by stage
            if isinstance(p, fuse.Prepass):
                if pending:
                    passes.append(Pass("settle", ("pending factor",), x, x))
                passes.append(Pass("reduction", (f"{p.name} ({p.reads})",), x, 0.0))
                pending = True
            elif isinstance(p, fuse.Scale):
                if p.factor.is_one:
                    continue
                if pending:
                    passes.append(Pass("settle", ("pending factor",), x, x))
                pending = True
            else:
                r, w = buffers(p)
                passes.append(Pass("kernel", (_part_name(p),), x + r, w + x))
                pending = False
    if pending:  # a factor left on the output: `Stage.update` settles it
        passes.append(Pass("settle", ("pending factor",), x, x))
    if apply and not (fused and segs and segs[-1][2] is not None):
        passes.append(Pass("apply", ("apply_updates_",), 2 * x, x))
    return Explanation(tuple(passes), minimum, fused, apply, int(sum(layout.group_sizes)))


def _explain_multisteps(
    stage: MultiSteps, params: Any, state: Any, apply: bool, fused: bool, layout: Any
) -> Explanation:
    """The passes of `MultiSteps`' next step (as its state says): the accumulation, the skip
    function's check, and on an emitting step the inner optimizer's passes and the reset."""
    if not isinstance(state, MultiStepsState):
        raise TypeError(f"state: expected MultiStepsState, got {type(state).__name__}")
    sizes = np.array(layout.group_sizes, np.float64)
    n = float(sizes.sum()) or 1.0
    x = float(np.dot(sizes, [np.dtype(t).itemsize for t in layout.group_dtypes]) / n)
    a = float(np.dot(sizes, [g.dtype.itemsize for g in state.acc_grads.groups]) / n)
    mini, k = int(state.mini_step), stage._schedule(state.gradient_step)
    passes: list[Pass] = []
    skip = stage._skip
    if skip is not None:  # the library's predicates read the updates once; a user's: unknown
        known = skip in (skip_not_finite, skip_large_updates)
        passes.append(
            Pass(
                "reduction" if known else "opaque",
                ("should_skip_update_fn",),
                *((x, 0.0) if known else (None, None)),
            )
        )
    fresh = mini == 0
    passes.append(Pass("kernel", ("multisteps (accumulate)",), x + (0.0 if fresh else a), a))
    minimum = x + (0.0 if fresh else a) + a
    if mini >= k - 1:
        if a != x:
            passes.append(Pass("kernel", ("multisteps (cast to the updates' dtypes)",), a, x))
        inner = explain(stage.inner_opt, params, state.inner_opt_state, apply=apply, fused=fused)
        passes += inner.passes
        passes.append(Pass("kernel", ("multisteps (reset)",), 0.0, a))
        minimum += inner.minimum - x  # the inner reads the accumulator, counted above
    return Explanation(tuple(passes), minimum, fused, apply, int(sum(layout.group_sizes)))


def _part_name(p: Any) -> str:
    return p.name or type(p).__name__.lower()
