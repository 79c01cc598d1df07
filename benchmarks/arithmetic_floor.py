"""Whether a step is bound by its bytes or by its arithmetic on this machine: the time per
element of the same ``step_`` on a tree that fits in the last-level cache (its arithmetic, the
memory nearly free) and on GPT-2-small shapes (``--scale``), each contender alternated call by
call (A, B, A, B, ...) at each size.

A pass bound by its bytes runs much faster per element in cache than at full size; a pass bound by
its arithmetic runs at about the same speed at both sizes, and then halving its bytes (bfloat16
against float32) cannot make it faster than its in-cache time. Issue 25 asks bfloat16
``step_(chain(clip_by_global_norm, adamw))`` in <= 0.6x float32's time; issue 26 asks
``noisy_sgd``'s ``step_`` at >= 0.9 of adamw's bandwidth. Contenders:

* ``float32`` / ``bfloat16``: ``step_(chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=1e-2)))``;
* ``adamw`` / ``noisy_sgd``: ``step_`` of ``adamw(1e-3, weight_decay=1e-2)`` and ``noisy_sgd(1e-3, key=0)``
  (float32).

    PYTHONPATH=. python benchmarks/arithmetic_floor.py [--scale 0.5] [--cache-elements 1048576]
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np
from vs_torch import _shrink  # this directory's

import numbaccum as nb
from numbaccum.bench import workloads

BF16 = np.dtype(ml_dtypes.bfloat16)
MAKERS = {
    "float32": (np.float32, lambda: nb.chain(nb.clip_by_global_norm(1.0), nb.adamw(1e-3, weight_decay=1e-2))),
    "bfloat16": (BF16, lambda: nb.chain(nb.clip_by_global_norm(1.0), nb.adamw(1e-3, weight_decay=1e-2))),
    "adamw": (np.float32, lambda: nb.adamw(1e-3, weight_decay=1e-2)),
    "noisy_sgd": (np.float32, lambda: nb.noisy_sgd(1e-3, key=0)),
}


def _step(shapes: dict, dtype: np.dtype, make) -> tuple:
    p = workloads.make_tree(shapes, np.float32, seed=0)
    g = workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2)
    params, grads = (nb.FlatTree.from_tree(nb.tree_map(lambda x: np.asarray(x).astype(dtype), t)) for t in (p, g))
    tx = make()
    box = [tx.init(params)]

    def call() -> None:
        box[0] = nb.step_(tx, grads, box[0], params)

    bytes_ = nb.explain(tx, params, apply=True).total
    return call, bytes_


def _alternated(calls: dict, rounds: int) -> dict:
    for f in calls.values():  # compiled, warm
        f()
        f()
    times: dict = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.5, help="fraction of each GPT-2-small leaf's rows kept")
    ap.add_argument("--cache-elements", type=int, default=1 << 20, help="parameters of the in-cache tree")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    big = _shrink(workloads.gpt2_small_shapes(), args.scale)
    m = args.cache_elements
    small = {"w": (m // 1024, 1024)}  # one leaf: the in-cache time has no per-leaf overhead to hide
    print(f"# arithmetic floor, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| contender | B/param | ns/param in cache | ns/param at full size | full / in cache |")
    print("| --- | --- | --- | --- | --- |")
    for pair in (("float32", "bfloat16"), ("adamw", "noisy_sgd")):
        rows = {}
        for label, shapes in (("cache", small), ("full", big)):
            n = workloads.count_params(shapes)
            calls, per = {}, {}
            for name in pair:
                calls[name], per[name] = _step(shapes, *MAKERS[name])
            rounds = args.rounds if label == "full" else max(args.rounds, int(4e8 // max(n, 1)))
            for name, t in _alternated(calls, rounds).items():
                rows.setdefault(name, {"bytes": per[name]})[label] = 1e9 * t / n
        for name, r in rows.items():
            print(
                f"| {name} | {r['bytes']:.1f} | {r['cache']:.3f} | {r['full']:.3f} | {r['full'] / r['cache']:.2f} |"
            )


if __name__ == "__main__":
    main()
