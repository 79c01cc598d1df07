"""Per-call time of `apply_updates_` and `apply_updates` on a small tree, two checkouts alternated.

Usage: python benchmarks/ab_apply_updates.py OLD_ROOT NEW_ROOT [--rounds 8]

The tree: a dict of 4 float32 leaves, shapes (32, 64), (64,), (64, 40), (40,) (4,712 params),
with updates of the same structure and dtypes: as a plain dict, and as FlatTrees (params and
updates of one layout). A plain NumPy loop ``for k in p: p[k] += u[k]`` is timed in every process
as the floor. Each round starts one process per checkout (A, B, A, B, ...: this machine's speed
moves within minutes, so the two are never timed in blocks); a process warms up, then times 2000
calls per case and prints the median of 20 batches, in microseconds per call. The report is the
median over rounds of each case.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_call_overhead import compare  # noqa: E402  (the same alternated harness)

CHILD = r"""
import json, time, numpy as np, numbaccum as nba
rng = np.random.default_rng(0)
shapes = [(32, 64), (64,), (64, 40), (40,)]
p = {f"l{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
u = {k: (rng.standard_normal(v.shape) * 1e-6).astype(np.float32) for k, v in p.items()}
u64 = {k: v.astype(np.float64) for k, v in u.items()}
fp, fu = nba.FlatTree.from_tree(p), nba.FlatTree.from_tree(u)
pt = nba.FlatTree.from_tree(p)


def numpy_loop():
    for k in p:
        p[k] += u[k]


cases = {
    "NumPy loop p[k] += u[k]": numpy_loop,
    "apply_updates_(dict, dict)": lambda: nba.apply_updates_(p, u),
    "apply_updates_(Flat, Flat)": lambda: nba.apply_updates_(fp, fu),
    "apply_updates(dict, dict)": lambda: nba.apply_updates(p, u),
    "apply_updates(Flat, Flat)": lambda: nba.apply_updates(fp, fu),
    "apply_updates_(dict, f64 dict)": lambda: nba.apply_updates_(p, u64),
    "apply_updates_(Flat.tree, dict)": lambda: nba.apply_updates_(pt.tree, u),
}
out = {}
for name, f in cases.items():
    for _ in range(200):
        f()
    batches = []
    for _ in range(20):
        t = time.perf_counter()
        for _ in range(100):
            f()
        batches.append((time.perf_counter() - t) / 100 * 1e6)
    out[name] = sorted(batches)[len(batches) // 2]
print(json.dumps(out))
"""


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 8
    compare(old, new, rounds, CHILD)


if __name__ == "__main__":
    main()
