"""A/B in one process: ``step_`` of optimizers whose last stage fuses nothing (SM3, Adafactor,
NovoGrad), the pending learning rate settled in the apply's pass (new, `fuse.apply_settled`)
against a settle pass then an apply pass (old), alternated call by call; the params' bits compared.

    PYTHONPATH=. python benchmarks/ab_apply_settled.py [scale]
"""

import sys
import time

import numpy as np

sys.path.insert(0, "benchmarks")
from vs_torch import _shrink  # noqa: E402

import numbaccum as nba  # noqa: E402
from numbaccum import fuse  # noqa: E402
from numbaccum.apply import _apply  # noqa: E402
from numbaccum.bench import workloads  # noqa: E402

new_fn = fuse.apply_settled


def old_fn(u, p, memo=None):  # the old path: settle into a buffer, then add
    _apply(p, u.settled().flat, p)


shapes = _shrink(workloads.gpt2_small_shapes(), float(sys.argv[1]) if len(sys.argv) > 1 else 0.5)
p0 = workloads.make_tree(shapes, np.float32, seed=0)
g = nba.FlatTree.from_tree(workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2))
print(f"{workloads.count_params(shapes) / 1e6:.1f}M params")
for name, make in [
    ("sm3", lambda: nba.sm3(1e-3)),
    ("adafactor", lambda: nba.adafactor(1e-3)),
    ("novograd", lambda: nba.novograd(1e-3)),
]:
    runs = {}
    for mode in ("new", "old"):
        tx = make()
        p = nba.FlatTree.from_tree(nba.tree_map(np.copy, p0))
        box = [tx.init(p)]
        runs[mode] = (tx, p, box)
    ts = {m: [] for m in runs}
    for r in range(10):
        for m, (tx, p, box) in runs.items():
            fuse.apply_settled = new_fn if m == "new" else old_fn
            t = time.perf_counter()
            box[0] = nba.step_(tx, g, box[0], p)
            dt = time.perf_counter() - t
            if r >= 2:
                ts[m].append(dt)
    a, b = np.median(ts["new"]), np.median(ts["old"])
    same = all(np.array_equal(x, y) for x, y in zip(runs["new"][1].groups, runs["old"][1].groups))
    print(
        f"{name}: new {a * 1e3:.1f} ms, old {b * 1e3:.1f} ms, new/old {a / b:.3f}, same params bits: {same}"
    )
