"""Issue 25's bfloat16 table on the CPU: the same work on bfloat16 and float32 trees, and the clip
against PyTorch's ``clip_grad_norm_(foreach=True)``.

Rows (GPT-2-small shapes; ``--scale`` keeps a fraction of every leaf's rows):

1. ``clip_by_global_norm(1.0).update`` on float32 and on bfloat16 gradients (out of place, as
   optax's), against ``torch.nn.utils.clip_grad_norm_(foreach=True)`` on the float32 ones (in
   place). The gradients have a norm above 1, so every contender scales every element.
2. ``step_(chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=1e-2)))`` on float32 and on
   bfloat16 params, gradients and moments.

With each row, what ``explain`` says each moves per parameter. Every contender has its own state
and buffers; calls alternate A, B, C, A, B, C, ... after a warm-up (this machine's bandwidth moves
2-3x within minutes: block timing would turn that into ratios), and each row reports the median
(and min-max) per call.

    PYTHONPATH=. python benchmarks/bfloat16.py [--scale 0.25] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import ml_dtypes
import numpy as np
from vs_torch import _shrink, _time  # this directory's: the same shrinking and alternated timer

import numbaccum as nb
from numbaccum.bench import workloads

BF16 = np.dtype(ml_dtypes.bfloat16)
LR, WD, MAX_NORM = 1e-3, 1e-2, 1.0


def _clip(grads: nb.FlatTree):
    tx = nb.clip_by_global_norm(MAX_NORM)
    box = [tx.init(grads)]

    def call() -> None:
        _, box[0] = tx.update(grads, box[0])

    return call


def _step(params: nb.FlatTree, grads: nb.FlatTree):
    tx = nb.chain(nb.clip_by_global_norm(MAX_NORM), nb.adamw(LR, weight_decay=WD))
    box = [tx.init(params)]

    def call() -> None:
        box[0] = nb.step_(tx, grads, box[0], params)

    return call


def _torch_clip(torch, grads: list[np.ndarray]):
    holders = [torch.zeros(x.shape).requires_grad_() for x in grads]
    for h, x in zip(holders, grads):
        h.grad = torch.from_numpy(x)

    def call() -> None:
        torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, foreach=True)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each leaf's rows kept")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    import numba
    import torch

    shapes = _shrink(workloads.gpt2_small_shapes(), args.scale)
    n = workloads.count_params(shapes)
    trees = {}
    for dt in (np.float32, BF16):
        p = workloads.make_tree(shapes, np.float32, seed=0)
        g = workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2)
        trees[np.dtype(dt).name] = tuple(
            nb.FlatTree.from_tree(nb.tree_map(lambda x, dt=dt: np.asarray(x).astype(dt), t)) for t in (p, g)
        )
    torch_grads = [np.array(x, copy=True) for x in nb.tree_flatten(trees["float32"][1].tree)[0]]
    print(f"# bfloat16 against float32, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {os.cpu_count()} CPUs, {n / 1e6:.1f}M params, torch {torch.__version__}")
    print(f"(torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()})")

    clip_tx = nb.clip_by_global_norm(MAX_NORM)
    step_tx = nb.chain(nb.clip_by_global_norm(MAX_NORM), nb.adamw(LR, weight_decay=WD))
    for name, (p, g) in trees.items():
        c = nb.explain(clip_tx, g).total
        s = nb.explain(step_tx, p, apply=True).total
        print(f"(explain, {name}: clip_by_global_norm {c:.1f} B/param, step_ {s:.1f} B/param)")

    rows = [
        (
            "clip_by_global_norm(1.0)",
            _time(
                [
                    ("bfloat16 update", _clip(trees["bfloat16"][1])),
                    (
                        "torch clip_grad_norm_(foreach=True), float32, in place",
                        _torch_clip(torch, torch_grads),
                    ),
                    ("float32 update", _clip(trees["float32"][1])),
                ],
                args.repeats,
            ),
        ),
        (
            "step_(chain(clip_by_global_norm, adamw))",
            _time(
                [("bfloat16", _step(*trees["bfloat16"])), ("float32", _step(*trees["float32"]))],
                args.repeats,
            ),
        ),
    ]
    print()
    print("| workload | contender | median ms | min-max ms | ratio to the last |")
    print("| --- | --- | --- | --- | --- |")
    for name, results in rows:
        base = results[-1][1]
        for label, med, lo, hi in results:
            span = f"{lo * 1e3:.1f}-{hi * 1e3:.1f}"
            print(f"| {name} | {label} | {med * 1e3:.1f} | {span} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
