"""Complex leaves on the CPU: a complex64 tree against the float32 tree of the same bytes.

A complex64 element is two float32 numbers, so the fair comparison is a complex64 tree of N
elements against a float32 tree of 2N (GPT-2-small shapes; the complex tree keeps half of each
leaf's rows). Rows:

1. ``clip_by_global_norm(1.0).update`` (the norm of |z|^2, then the scaling, out of place).
2. ``step_(chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=1e-2)))``: Adam's moments,
   ``nu`` of |g|^2 stored complex with a zero imaginary part, as optax keeps it.

With each row, what ``explain`` says each moves per parameter (a complex parameter is 8 bytes).
Calls alternate A, B, A, B, ... after a warm-up (this machine's bandwidth moves 2-3x within
minutes); each row reports the median (and min-max) per call.

    PYTHONPATH=. python benchmarks/complex.py [--scale 1.0] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
from vs_torch import _ours_step, _shrink, _time  # this directory's: shrinking, the timer, our step

import numbaccum as nb
from numbaccum.bench import workloads

LR, WD, MAX_NORM = 1e-3, 1e-2, 1.0


def _clip(grads: nb.FlatTree):
    tx = nb.clip_by_global_norm(MAX_NORM)
    box = [tx.init(grads)]

    def call() -> None:
        _, box[0] = tx.update(grads, box[0])

    return call


def _step(params: nb.FlatTree, grads: nb.FlatTree):
    """`step_` of clip + AdamW on a copy of ``params`` (vs_torch's ``_ours_step``)."""
    tx = nb.chain(nb.clip_by_global_norm(MAX_NORM), nb.adamw(LR, weight_decay=WD))
    return _ours_step(tx, params, grads)


def _complex(tree: dict, other: dict) -> dict:
    """complex64 leaves: ``tree`` the real parts, ``other`` the imaginary ones."""
    return nb.tree_map(lambda a, b: (np.asarray(a) + 1j * np.asarray(b)).astype(np.complex64), tree, other)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each leaf's rows kept (float32)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    import numba

    shapes = _shrink(workloads.gpt2_small_shapes(), args.scale)
    half = _shrink(workloads.gpt2_small_shapes(), args.scale / 2)
    real = [workloads.make_tree(shapes, np.float32, seed=s, scale=k) for s, k in ((0, 1.0), (1, 1e-2))]
    parts = [
        workloads.make_tree(half, np.float32, seed=s, scale=k)
        for s, k in ((2, 1.0), (3, 1e-2), (4, 1.0), (5, 1e-2))
    ]
    trees = {
        "float32": tuple(nb.FlatTree.from_tree(t) for t in real),
        "complex64": (
            nb.FlatTree.from_tree(_complex(parts[0], parts[2])),
            nb.FlatTree.from_tree(_complex(parts[1], parts[3])),
        ),
    }
    sizes = {k: v[0].layout.size for k, v in trees.items()}
    print(
        f"# complex64 against float32 of the same bytes, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {os.cpu_count()} CPUs, numba threads {numba.get_num_threads()}")
    print(
        f"(float32: {sizes['float32'] / 1e6:.1f}M params, complex64: {sizes['complex64'] / 1e6:.1f}M params)"
    )
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
                [("complex64", _clip(trees["complex64"][1])), ("float32", _clip(trees["float32"][1]))],
                args.repeats,
            ),
        ),
        (
            "step_(chain(clip_by_global_norm, adamw))",
            _time(
                [("complex64", _step(*trees["complex64"])), ("float32", _step(*trees["float32"]))],
                args.repeats,
            ),
        ),
    ]
    print()
    print("| workload | contender | median ms | min-max ms | ratio to float32 (same bytes) |")
    print("| --- | --- | --- | --- | --- |")
    for name, results in rows:
        base = results[-1][1]
        for label, med, lo, hi in results:
            print(
                f"| {name} | {label} | {med * 1e3:.1f} | {lo * 1e3:.1f}-{hi * 1e3:.1f} | {med / base:.2f}x |"
            )


if __name__ == "__main__":
    main()
