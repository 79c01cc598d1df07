"""The floor of the small model's step with today's building blocks (issue 23's per-call target).

``step_(chain(clip_by_global_norm(1.0), adamw(1e-3)), grads, state, params)`` on FlatTrees of the
small model (4 float32 leaves, 4,712 parameters), against the same step written by hand as one
flat function over the pieces a kept plan replays: the state renewed and counted, Adam's scalars
computed and cast, the clip's norm (the prepared engine call) and factor, the one fused launch,
the new state built, the renewal committed. What the hand-written step leaves out is what the
runner's layers cost (entry, ticks of nested chains, run and group calls, new-state packing);
its time is what a step generated per plan could approach. It knows this one plan's shape and
reads internals (`runner.plan_of`, a group's prepared launch): a measurement, not an API.

Usage: python benchmarks/small_model_floor.py
"""

from __future__ import annotations

import numpy as np
from small_model import SETUP  # the model, its gradients and the timer of small_model.py

import numbaccum as nba
from numbaccum import runner, transaction
from numbaccum.base import stage_of
from numbaccum.clipping import ClipByGlobalNormState, clip_factor
from numbaccum.contract import Factor, cast_scalars
from numbaccum.declared import safe_increment
from numbaccum.updates import Spec


def main() -> None:
    setup: dict = {}
    exec(SETUP, setup)
    best = setup["best"]
    params, grads = nba.FlatTree.from_tree(setup["P"]), nba.FlatTree.from_tree(setup["G"])
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-3))
    box = [tx.init(params)]
    for _ in range(50):
        box[0] = nba.step_(tx, grads, box[0], params)

    stage = stage_of(tx)
    plan = runner.plan_of(stage, Spec(params.layout, False), box[0], stage.owner(box[0]))
    fused = plan.runs[0][2]
    launch = next(iter(fused.recent.values()))[5]  # the fused pass, prepared for these buffers
    adam = stage.stages[1].stages[0]
    adam_state_cls = type(box[0][1][0])
    decay_and_lr = [np.float32(1e-4), np.float32(1.0), np.float32(-1e-3)]
    renewals = transaction._THREAD.renewals

    def by_hand() -> None:
        clip_state, (adam_state, decay_state, lr_state) = box[0]
        marks = plan.owner.__dict__  # the busy mark, as `transaction.guarded` takes it
        me = object()
        if marks.setdefault("_busy", me) is not me:
            raise RuntimeError("busy")
        renewals.depth += 1
        count = safe_increment(adam_state.count)
        nu = transaction.current(adam_state.nu, "nu")
        scalars = cast_scalars(adam.scalars(count, np.dtype(np.float32)), np.float32)
        new_adam = tuple.__new__(adam_state_cls, (count, adam_state.mu, nu))
        norm = nba.global_norm(grads)
        record = ClipByGlobalNormState(np.float64(norm), np.bool_(not norm < 1.0), np.bool_(False))
        launch(Factor(*clip_factor(norm, 1.0)), [*scalars, *decay_and_lr])
        for r in renewals:
            r._live = r._gen
        renewals.clear()
        renewals.depth -= 1
        marks.pop("_busy", None)
        box[0] = (record, (new_adam, decay_state, lr_state))

    def stepped() -> None:
        box[0] = nba.step_(tx, grads, box[0], params)

    # The same values: three steps each way from one state and params give the same bits.
    start, kept = nba.copy_state(box[0]), params.copy()
    for _ in range(3):
        by_hand()
    after_hand = params.copy()
    params.assign_(kept)
    box[0] = start
    for _ in range(3):
        stepped()
    assert all(np.array_equal(a, b) for a, b in zip(params.groups, after_hand.groups))
    for name, f in (("step_", stepped), ("by hand", by_hand), ("step_", stepped), ("by hand", by_hand)):
        print(f"{name:8s} {best(f):6.2f} us")  # the fastest batch of 200 calls


if __name__ == "__main__":
    main()
