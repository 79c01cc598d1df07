"""The inner transformation of a control node, declared once and replayed.

A control node (`numbaccum.MultiSteps`, ``apply_every``, ``masked``, ``partition``,
``conditionally_transform``, ``flatten``, ``lookahead``, ``apply_if_finite``) declares one
`numbaccum.fuse.Host`: its tick checks the node's own state, chooses what this step runs and
ticks the inner transformation's plan (`Inner.tick`); its run replays that plan (`Inner.run`).
The plan is the runner's (`numbaccum.runner.sub_plan`), kept by the part: made on the first step
that runs it, ticked on every step that does, declared again with the whole outer plan when
the inner state holds other buffers (its tick says False). User code (a `Foreign` inner) is one
opaque part of that plan.
"""

from __future__ import annotations

from typing import Any

from . import fuse, runner
from .contract import ONE
from .flat import FlatTree
from .updates import ParamsRef, Spec, Updates

__all__ = ["Adds", "Inner"]


class Adds:
    """``params += u`` (settled first) for a step whose updates no pass added, kept across steps
    by one caller (a control node's declaration): by the kept launches of the plain add
    (`numbaccum.fuse.Launches.add`, `numbaccum.apply_updates_`'s kernel), or, with a factor
    pending, settled and added in one pass that rounds as settling first would
    (`numbaccum.fuse.apply_settled`, its group calls kept): the same bits."""

    __slots__ = ("launches", "memo")

    def __init__(self) -> None:
        self.launches = fuse.Launches()
        self.memo: tuple[dict, dict] = ({}, {})

    def __call__(self, params: FlatTree, u: Updates) -> None:
        factor = u.factor
        if factor is not ONE and not factor.is_one:  # (`Updates.pending`, inline)
            fuse.apply_settled(u, params, self.memo)
        else:
            self.launches.add(params, u.flat)


class Inner:
    """A control node's inner stage for updates of one `Spec`: its kept plan.

    Attributes:
        stage: the inner stage; ``spec``: the updates it is given (masked's kept leaves).
        prefix: the names of its workspaces start with it (`numbaccum.runner.sub_plan`).
        plan: its `numbaccum.runner.Plan` (None until a step runs it).
        state: the inner state ticked.
    """

    __slots__ = ("stage", "spec", "prefix", "plan", "state", "adds")

    def __init__(self, stage: Any, spec: Spec, prefix: str) -> None:
        self.stage, self.spec, self.prefix = stage, spec, prefix
        self.plan: runner.Plan | None = None
        self.state: Any = None
        self.adds = Adds()  # `apply`'s, when the plan's last pass cannot add

    def tick(self, state: Any, params: ParamsRef | None, extra: dict) -> bool:
        """This step's values of the inner plan, before anything is written (its checks raise
        what is wrong); False when ``state`` holds other buffers than the plan was made for (the
        runner then declares the outer plan again)."""
        self.state = state
        plan = self.plan
        if plan is None:
            spec = self.spec
            owner = self.stage.owner(state)
            if owner is not None and (owner.layout is not spec.layout or owner.device != spec.device):
                owner = None
            plan = self.plan = runner.sub_plan(self.stage, spec, state, owner, self.prefix)
        return plan.tick(state, params, extra)

    def run(self, u: Updates, settle: bool = False) -> tuple[Updates, Any]:
        """The ticked inner step on ``u``: ``(updates, new_state)``; ``settle``: a factor left
        pending at the end is applied in the last pass (the caller settles them next)."""
        assert self.plan is not None  # (made by `tick`)
        return runner.replay(self.plan, self.state, u, None, settle)

    def apply(self, u: Updates, params: FlatTree) -> Any:
        """The ticked inner step on ``u``, its updates added to ``params`` (in its last pass
        where its plan can: `numbaccum.runner.Plan.apply`); returns its new state."""
        plan = self.plan
        assert plan is not None  # (made by `tick`)
        if plan.apply:
            return runner.replay(plan, self.state, u, params, False)[1]
        out, new_state = runner.replay(plan, self.state, u, None, False)  # (`run`)
        self.adds(params, out)
        return new_state

    def passes(self, apply: bool, weight: float = 1.0, folded: bool = False) -> list:
        """What the inner step moves, for `numbaccum.explain`: its plan (`numbaccum.runner.Sub`;
        ``folded``: a factor it leaves pending is applied by the caller's next pass); nothing
        before a step has run it."""
        if self.plan is None:
            return []
        return [runner.Sub(self.plan, apply, weight, folded)]
