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

import contextlib
from typing import Any, NamedTuple

import numpy as np

from . import fuse, runner, transaction
from ._checks import transformation
from .base import Foreign, Stage, as_stage, stage_of, with_extra_args_support
from .flat import FlatTree, layout_of
from .lookahead import LookaheadParams
from .updates import ParamsRef, Spec

__all__ = ["Explanation", "Pass", "explain", "step_"]


# --- step_ ----------------------------------------------------------------------------------


def step_(tx: Any, grads: Any, state: Any, params: Any, **extra_args: Any) -> Any:
    """``params += tx.update(grads, state, params)[0]`` in place, within the update's last fused
    pass (the update is never written to a buffer); returns the new state.

    Same results as ``updates, state = tx.update(grads, state, params)`` then
    ``apply_updates_(params, updates)`` (the same bits on the CPU), with one pass less over
    memory: each parameter becomes ``p + u`` in its own dtype as the last kernel computes ``u``.
    A transformation whose last stages do not fuse (a foreign one,
    ``NUMBACCUM_FUSE=0``) runs exactly those two calls. `explain` with ``apply=True`` shows the
    passes.

    Args:
        tx: a transformation.
        grads: the gradients (a tree, or a FlatTree).
        state: ``tx``'s state (consumed, like ``update``'s).
        params: a FlatTree, or a tree of writable arrays, changed in place.
        **extra_args: passed to ``tx.update`` (as ``update``'s own extra keyword arguments).

    Returns:
        The new state, as ``tx.update`` would have returned it.

    Raises:
        TypeError: ``tx`` has no callable ``init`` or ``update``; a leaf of ``params`` cannot
            change in place (nothing is written then); and whatever ``tx.update`` raises, also
            before anything is written.

    References:
        optax: ``updates, state = tx.update(grads, state, params)`` then
        ``optax.apply_updates(params, updates)``; PyTorch's ``optimizer.step()`` (in place, with
        ``foreach``/``fused`` kernels).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(2, np.float32)}
        >>> tx = nba.sgd(0.5)
        >>> state = tx.init(params)
        >>> state = nba.step_(tx, {"w": np.array([1.0, -2.0], np.float32)}, state, params)
        >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.5 * g
        [0.5, 2.0]
    """
    stage = stage_of(tx)
    if stage is None or not callable(getattr(tx, "init", None)):
        own = getattr(tx, "_numbaccum_step_", None)  # a step of its own (`distributed.shard`)
        if own is not None:
            return own(grads, state, params, **extra_args)
        kept = getattr(getattr(tx, "update", None), "numbaccum_stage", None)  # `stateless`'s
        stage = kept if type(kept) is Foreign else as_stage(with_extra_args_support(transformation(tx, "tx")))
    return runner.run(stage, grads, state, params, extra_args, True)


# --- explain --------------------------------------------------------------------------------


class Pass(NamedTuple):
    """One pass over memory: ``kind`` ("collective", "reduction", "fused", "kernel", "settle",
    "apply", "opaque"), the stages it runs, and the bytes per parameter it reads and writes (None where
    not known: a stage that is not described)."""

    kind: str
    stages: tuple[str, ...]
    read: float | None
    written: float | None

    @property
    def bytes(self) -> float | None:
        return None if self.read is None or self.written is None else self.read + self.written


class Explanation(NamedTuple):
    """The passes over memory of an update, as `explain` gives them; ``print`` shows a table.

    Attributes:
        passes: the passes in the order they run, each a ``Pass(kind, stages, read, written)``:
            its kind ("reduction", "fused", "kernel", "settle", "apply" or "opaque"), the stages
            it runs, and the bytes per parameter it reads and writes (None where not known).
        minimum: the arithmetic minimum, in bytes per parameter: each input read once, each
            state read and written once, the output written once, one more read of the input
            per reduction.
        fused: whether the fused path was explained (else stage by stage).
        applied: whether `step_` was explained (the update added to the params) rather than
            ``update``.
        num_params: the number of parameters (elements of all leaves).
        total: the bytes per parameter of all passes, ``sum(read + written)`` (None where a
            pass is not described); ``total / minimum`` is what the table shows as ``1.00x``.
    """

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

    def __repr__(self) -> str:
        return self.__str__()


def explain(
    tx: Any,
    params: Any,
    state: Any = None,
    *,
    apply: bool = False,
    fused: bool | None = None,
    **extra_args: Any,
) -> Explanation:
    """The passes ``tx.update(updates, state, params)`` will run (`step_` with ``apply=True``).

    Plans ``tx`` for updates shaped like ``params`` (nothing is run or written): which stages
    each pass fuses, the bytes per parameter each moves (reads and writes of inputs, states and
    outputs, by their dtypes), and the total, ``sum(read + written)`` over the passes, against
    the arithmetic minimum (each input read once, each state read and written once, the output
    written once). For a `MultiSteps`, the passes of its next step, as its state says.

    Args:
        tx: a transformation.
        params: the parameters (their layout and dtypes; add_decayed_weights reads them).
        state: ``tx``'s state; None: ``tx.init(params)`` (allocates a state; with an MPI
            stage such as ``distributed.allreduce_mean`` that init is collective: pass the
            state, or call ``explain`` on every rank).
        apply: explain `step_` (the update added to params) instead of ``update``.
        fused: explain the fused (True) or stage-by-stage (False) path; None: what
            ``NUMBACCUM_FUSE`` selects now.
        **extra_args: the update's extra arguments, for a stage that needs one to plan
            (`scale_by_polyak`'s ``value``).

    Returns:
        An `Explanation`: its ``passes``, ``total`` and ``minimum`` in bytes per parameter;
            ``print`` shows it as a table.

    Raises:
        TypeError: ``tx`` has no callable ``init`` or ``update``; a leaf of ``params`` is not a
            float array; or ``state`` is not of ``tx``'s state class (as ``update`` checks it).
        ValueError: ``state`` is not a state of the chain ``tx`` (not a tuple of one state per
            stage, or for a `named_chain` not a dict of its names).

    References:
        No optax counterpart; in JAX, ``jax.jit(f).lower(*args).compile().cost_analysis()``
        gives the bytes a compiled step accesses.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-3))
        >>> print(nba.explain(tx, {"w": np.zeros(4, np.float32)}, fused=True))
        update (fused), 4 parameters: 2 passes
          1. reduction   4.0 B/param (read 4.0, write 0.0)  clip_by_global_norm (global norm)
          2. fused      24.0 B/param (read 12.0, write 12.0)  clip_by_global_norm + scale_by_adam + scale
          total 28.0 B/param (1.00x); arithmetic minimum 28.0 B/param
    """
    stage = as_stage(with_extra_args_support(transformation(tx, "tx")))
    fused = fuse.enabled() if fused is None else bool(fused)
    # lookahead's gradients (and the plan's bytes per parameter) are those of the fast params
    grads = params.fast if isinstance(params, LookaheadParams) else params
    layout = grads.layout if isinstance(grads, FlatTree) else layout_of(grads, "params")
    device = grads.device if isinstance(grads, FlatTree) else False
    if state is None:
        state = stage.init(params)
    spec = Spec(layout, device)
    # the params as the runner hands them to a reshaping stage's run: of the layout of the
    # updates it returns (lookahead's pair)
    ref = ParamsRef(params, layout if grads is params else layout_of(params, "params"), None, device)
    owner = stage.owner(state)
    if owner is not None and (owner.layout is not spec.layout or owner.device != spec.device):
        owner = None
    # The kept plan of a state with buffers is one for every thread: its tick writes the step's
    # values (extra args, counts) into the plan's slots, which an update of that state running on
    # another thread reads. Held as a reader (`transaction.reading`), as a save holds it, explain
    # waits for no update and lets none start until it is done: a running one makes it raise the
    # update's "another thread" error, where it would have changed that update's numbers.
    with transaction.reading(owner) if owner is not None else contextlib.nullcontext():
        units, segs = _units(stage, spec, state, owner, ref, fused, extra_args)
        return _explained(units, segs, layout, device, apply, fused)


def _explained(
    units: list, segs: list, layout: Any, device: bool, apply: bool, fused: bool
) -> Explanation:
    """The `Explanation` of a plan's ``units`` run as ``segs`` (`_units`)."""
    b = _Bytes(layout)
    x = b.x
    passes: list[Pass] = []
    # The gradient read once, and the output written once (params read and written with apply);
    # each state and extra input below.
    minimum = x + (2 * x if apply else x)
    pending = False
    for start, stop, fr in segs:
        parts = fr.parts if fr is not None else units[start]
        if type(parts[0]) is fuse.Host and parts[0].passes is None:  # user code
            passes.append(Pass("opaque", (parts[0].name,), None, None))
            pending = False
            continue
        if fr is None and type(parts[0]) is fuse.Host and callable(parts[0].passes):
            # A control node: this step's passes, its inner plans' in their place.
            host = parts[0]
            applies = apply and fused and stop == len(units) and host.apply is not None
            more, pending = _control_passes(b, host, pending, applies, fused, device, passes)
            minimum += more
            continue
        rides = fr is not None and _rides(parts, layout, device)
        # A pre-pass riding on the collective reads each bucket as it arrives: nothing more.
        minimum += sum(_least(b, p) for k, p in enumerate(parts) if _moves(p) and not (rides and k == 1))
        if fr is not None:
            shown, shared = _fused_passes(b, parts, apply and stop == len(units), rides)
            passes += shown
            minimum -= shared
            pending = False
        else:
            pending = _one_by_one_passes(b, parts, pending, passes)
    n = int(sum(layout.group_sizes))
    if apply and fused and pending:  # settled in the apply's pass (`fuse.apply_settled`)
        passes.append(Pass("apply", ("pending factor", "apply_updates_"), 2 * x, x))
        return Explanation(tuple(passes), minimum, fused, apply, n)
    if pending:  # a factor left on the output: `Stage.update` settles it
        passes.append(Pass("settle", ("pending factor",), x, x))
    elif not apply and not segs:  # nothing runs (an empty chain): the updates copied to the output
        passes.append(Pass("settle", ("copy to the returned updates",), x, x))
    last = units[segs[-1][0]] if segs else None
    applied = fused and segs and (segs[-1][2] is not None or (last is not None and runner.applies(last[0])))
    if apply and not applied:
        passes.append(Pass("apply", ("apply_updates_",), 2 * x, x))
    return Explanation(tuple(passes), minimum, fused, apply, n)


def _control_passes(
    b: "_Bytes", host: fuse.Host, pending: bool, apply: bool, fused: bool, device: bool, passes: list
) -> tuple[float, bool]:
    """Appends a control node's passes for this step (`numbaccum.fuse.Host`'s ``passes(apply)``):
    its own rows, and each inner plan (`numbaccum.runner.Sub`) described as `explain` describes a
    plan, its bytes counted per parameter of the outer tree. Returns what they add to the
    minimum and whether a factor is pending after them."""
    x = b.x
    if pending and host.settles:
        passes.append(Pass("settle", ("pending factor",), x, x))
    more = 0.0
    passes_of = host.passes
    assert callable(passes_of)  # (a control node's: `_explain_plan` calls this for no other)
    for item in passes_of(apply):
        if isinstance(item, runner.Sub):
            sub = _explain_plan(item.plan, item.apply, fused, device)
            w = item.weight
            shown = sub.passes
            if item.folded and shown and shown[-1].kind == "settle":  # the node's next pass applies it
                shown = shown[:-1]
            passes += [Pass(p.kind, p.stages, _times(p.read, w), _times(p.written, w)) for p in shown]
            own = _Bytes(item.plan.spec.layout).x * (3 if item.apply else 2)  # its input, output (params)
            more += (sub.minimum - own) * w
            continue
        kind, what, read, written = item[:4]
        label = (f"{host.name} ({what})" if what else host.name,)
        if read is None:
            passes.append(Pass("opaque", label, None, None))
            continue
        passes.append(Pass(kind, label, read * x, written * x))
        more += (item[4] if len(item) > 4 else 0.0) * x
    return more, host.pending


def _times(v: float | None, w: float) -> float | None:
    return None if v is None else v * w


def _explain_plan(plan: Any, apply: bool, fused: bool, device: bool) -> Explanation:
    """The `Explanation` of a control node's inner plan, ticked for this step (its runs cut as
    ``fused`` says)."""
    again = runner.Plan(plan.root, plan.spec, fused, [])
    units = [[p] for p in again.leaves]
    runs = again.runs if fused else [(i, i + 1, None) for i in range(len(units))]
    return _explained(units, runs, plan.spec.layout, device, apply, fused)


class _Bytes:
    """Bytes per parameter of a layout's buffers: ``x`` for one buffer of the updates' dtypes."""

    def __init__(self, layout: Any) -> None:
        self.sizes = np.array(layout.group_sizes, np.float64)
        self.dtypes = layout.group_dtypes
        self.n = float(self.sizes.sum()) or 1.0
        self.x = self.per_param([np.dtype(t).itemsize for t in layout.group_dtypes])

    def per_param(self, itemsizes: Any) -> float:
        return float(np.dot(self.sizes, np.asarray(itemsizes, np.float64)) / self.n)

    def buffers(self, part: fuse.Kernel) -> tuple[float, float]:
        """What a kernel reads and writes besides the updates: its states (read and written)
        and its extra inputs (read: the params, a masked decay's mask)."""
        st = sum(self.per_param([g.dtype.itemsize for g in s.groups]) for s in part.states)
        ins = part.inputs() if part.inputs is not None else ()
        return st + sum(self.per_param([g.dtype.itemsize for g in f.groups]) for f in ins), st

    def both(self, part: fuse.Kernel) -> float:
        r, w = self.buffers(part)
        return r + w


def _moves(part: Any) -> bool:
    """Whether a part moves memory of its own (a kernel's buffers, a reduction's read, a
    collective's sum)."""
    return isinstance(part, (fuse.Kernel, fuse.Prepass, fuse.Collective, fuse.Host))


def _least(b: _Bytes, part: Any) -> float:
    """The least bytes per parameter a part adds: a kernel's buffers, a reduction's read of the
    updates, a collective's sum written and read once more, a host step's reductions' reads
    (its other passes write the output, counted once already)."""
    if isinstance(part, fuse.Kernel):
        return b.both(part)
    if isinstance(part, fuse.Host):
        rows = part.passes or ()
        assert not callable(rows)  # a control node's are this step's (`_control_passes`)
        return sum(read for kind, _, read, _ in rows if kind == "reduction") * b.x
    return 2 * b.x if isinstance(part, fuse.Collective) else b.x


_RIDING_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _rides(parts: list, layout: Any, device: bool) -> bool:
    """Whether a run's pre-pass rides on its collective (`numbaccum.fuse.FusedRun`): a clip's
    norm after ``allreduce_mean``, host float32 and float64 groups (`distributed._reduce`)."""
    return (
        len(parts) > 1
        and isinstance(parts[0], fuse.Collective)
        and isinstance(parts[1], fuse.Prepass)
        and parts[1].from_sumsq is not None
        and not device
        and all(np.dtype(d) in _RIDING_DTYPES for d in layout.group_dtypes)
    )


def _collective_pass(b: _Bytes, part: Any, riding: Any = None) -> Pass:
    """A collective: the updates read, their sum written (the messages named); with ``riding``,
    the pre-pass whose reduction runs on each bucket as it arrives."""
    stages = [f"{part.name} ({part.messages})"]
    if riding is not None:
        stages.append(f"{riding.name} ({riding.reads}, per bucket as it arrives)")
    return Pass("collective", tuple(stages), b.x, b.x)


def _fused_passes(b: _Bytes, parts: list, apply: bool, rides: bool = False) -> tuple[list[Pass], float]:
    """The passes of one fused run: its collective and its reduction (or the reduction riding on
    the collective), if it starts with them, then one pass (adding the updates to the params
    with ``apply``); and the bytes the params a part reads save (they are the ones the pass
    writes: read once)."""
    x = b.x
    kernels = [p for p in parts if isinstance(p, fuse.Kernel)]
    out = []
    if isinstance(parts[0], fuse.Collective):
        out.append(_collective_pass(b, parts[0], parts[1] if rides else None))
        half = any(np.dtype(d).itemsize == 2 for d in b.dtypes)  # else the 1/n is pending
        if not rides and not half and isinstance(parts[1], fuse.Prepass):
            out.append(Pass("settle", ("pending factor",), x, x))
        parts = parts[1:]
    label = tuple(_part_name(p) for p in parts if not (isinstance(p, fuse.Scale) and p.factor.is_one))
    if isinstance(parts[0], fuse.Prepass) and not rides:
        out.append(Pass("reduction", (f"{parts[0].name} ({parts[0].reads})",), x, 0.0))
    r = x + sum(b.buffers(p)[0] for p in kernels)
    w = sum(b.buffers(p)[1] for p in kernels)
    if not apply:
        return [*out, Pass("fused", label, r, w + x)], 0.0
    shared = x * sum(1 for p in kernels if len(p.formula.inputs) > 1)  # inputs[1]: the params
    return [*out, Pass("fused", (*label, "apply to params"), r + x - shared, w + x)], shared


def _one_by_one_passes(b: _Bytes, parts: list, pending: bool, passes: list) -> bool:
    """Appends the passes of ``parts`` run stage by stage: a factor stays pending until a kernel
    reads it, and is settled in a pass of its own before a reduction or another factor.
    Returns whether a factor is pending after them."""
    x = b.x
    for p in parts:
        if isinstance(p, fuse.Host):
            if pending and p.settles:
                passes.append(Pass("settle", ("pending factor",), x, x))
            rows = p.passes
            assert rows is not None and not callable(rows)  # user code, control nodes: described apart
            for kind, what, read, written in rows:
                passes.append(Pass(kind, (f"{p.name} ({what})" if what else p.name,), read * x, written * x))
            pending = p.pending or (pending and not p.settles)
        elif isinstance(p, fuse.Collective):
            passes.append(_collective_pass(b, p))
            pending = not any(np.dtype(d).itemsize == 2 for d in b.dtypes)  # the 1/n
        elif isinstance(p, fuse.Prepass):
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
            r, w = b.buffers(p)
            passes.append(Pass("kernel", (_part_name(p),), x + r, w + x))
            pending = False
    return pending


def _units(
    stage: Stage, spec: Spec, state: Any, owner: Any, ref: ParamsRef, fused: bool, extra: dict
) -> tuple:
    """What `explain` describes: ``(units, runs)``, ``units[i]`` the parts of unit ``i``,
    ``runs`` the ``(start, stop, fused run or None)`` over them: the parts of the runner's own
    kept `runner.Plan` for ``state`` (the plan `step_` and ``update`` replay; made now if none
    is kept), ticked for this step, and its runs (cut again when ``fused`` is not what the
    runner does now)."""
    plan = runner.ticked(stage, spec, state, owner, ref, extra)
    if plan.fused is not fused:
        plan = runner.Plan(plan.root, spec, fused, [])
    units = [[p] for p in plan.leaves]
    runs = plan.runs if fused else [(i, i + 1, None) for i in range(len(units))]
    return units, runs


def _part_name(p: Any) -> str:
    return p.name or type(p).__name__.lower()
