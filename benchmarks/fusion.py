"""Fused chains against the same chains stage by stage, alternated call by call (CPU).

Rows (GPT-2-small shapes, float32; ``--scale`` keeps a fraction of every leaf's rows, e.g. 0.25
for a ~30M-parameter tree on a loaded machine):

1. ``chain(clip_by_global_norm(1.0), ema(0.9), trace(0.9), scale(-1e-3))``: ``update`` fused
   (the default) against ``NUMBACCUM_FUSE=0`` (stage by stage).
2. ``chain(clip_by_global_norm(1.0), adam(1e-3))``: ``step_`` (applied in the last fused pass)
   against ``update`` then ``apply_updates_``.

Each contender has its own transformation and state; the calls alternate A, B, A, B, ... after
a warm-up (which compiles), and each row reports the median, min and max per call, and the bytes
per parameter that ``numbaccum.explain`` gives for each path. The inputs are FlatTrees (the
library's own layout), so the rows time the passes, not the packing of a plain tree.

    PYTHONPATH=. python benchmarks/fusion.py [--scale 0.25] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

import numbaccum as nb
from numbaccum.bench import workloads


def _shrink(shapes: dict, scale: float) -> dict:
    def f(shape: tuple) -> tuple:
        if not shape or scale >= 1.0:
            return shape
        return (max(1, int(shape[0] * scale)), *shape[1:])

    return workloads.map_shapes(f, shapes)


def _fused(on: bool):
    os.environ["NUMBACCUM_FUSE"] = "1" if on else "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each leaf's rows kept")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    shapes = _shrink(workloads.gpt2_small_shapes(), args.scale)
    params = workloads.make_tree(shapes, np.float32, seed=0)
    grads = nb.FlatTree.from_tree(workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2))
    n = workloads.count_params(shapes)
    print(f"# fusion benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {os.cpu_count()} CPUs, {n / 1e6:.1f}M float32 params")

    def first_chain():
        return nb.chain(nb.clip_by_global_norm(1.0), nb.ema(0.9), nb.trace(0.9), nb.scale(-1e-3))

    def clip_adam():
        return nb.chain(nb.clip_by_global_norm(1.0), nb.adam(1e-3))

    rows = []
    # Row 1: update, fused vs stage by stage.
    p1 = nb.FlatTree.from_tree(params)
    contenders = []
    for on in (True, False):
        tx = first_chain()
        box = [tx.init(p1)]

        def call(tx=tx, box=box, on=on):
            _fused(on)
            _, box[0] = tx.update(grads, box[0])

        nbytes = nb.explain(tx, p1, fused=on).total
        contenders.append((f"update, {'fused' if on else 'stage by stage'}", call, nbytes))
    rows.append(("chain(clip_by_global_norm, ema, trace, scale)", _time(contenders, args.repeats)))
    del contenders
    # Row 2: step_ vs update + apply_updates_.
    contenders = []
    for mode in ("step_", "update + apply_updates_"):
        tx = clip_adam()
        p = nb.FlatTree.from_tree(params)
        box = [tx.init(p)]

        def call(tx=tx, box=box, p=p, mode=mode):
            _fused(True)
            if mode == "step_":
                box[0] = nb.step_(tx, grads, box[0], p)
            else:
                u, box[0] = tx.update(grads, box[0], p)
                nb.apply_updates_(p, u)

        # update then apply_updates_: that one reads params and updates and writes params (12)
        applied = nb.explain(tx, p, apply=True, fused=True)
        nbytes = applied.total if mode == "step_" else nb.explain(tx, p, fused=True).total + 12.0
        contenders.append((mode, call, nbytes))
    rows.append(("chain(clip_by_global_norm, adam)", _time(contenders, args.repeats)))
    _fused(True)
    print()
    print("| workload | contender | median ms | min-max ms | B/param (explain) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, results in rows:
        base = results[-1][1]
        for label, med, lo, hi, nbytes in results:
            span = f"{lo * 1e3:.1f}-{hi * 1e3:.1f}"
            print(f"| {name} | {label} | {med * 1e3:.1f} | {span} | {nbytes:.1f} | {med / base:.2f}x |")


def _time(contenders: list, repeats: int) -> list:
    """``(label, median, min, max, bytes)`` per ``(label, call, bytes)``, calls alternated."""
    for _, call, _ in contenders:  # warm-up: compiles, allocates workspaces
        call()
        call()
    times: list[list[float]] = [[] for _ in contenders]
    for _ in range(repeats):
        for (_, call, _), ts in zip(contenders, times):
            t = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t)
    return [(c[0], statistics.median(ts), min(ts), max(ts), c[2]) for c, ts in zip(contenders, times)]


if __name__ == "__main__":
    main()
