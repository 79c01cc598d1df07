"""Two versions of numbaccum in one process, alternated call by call (A, B, A, B, ...), so that the
machine's load and bandwidth drift hit both alike: the bench's operations on its workloads.

Set up the old version as a package of another name, then run (medians and minima per call):

    git worktree add /tmp/old <commit> && mkdir -p /tmp/oldpkg
    cp -r /tmp/old/numbaccum /tmp/oldpkg/numbaccum_old   # the package imports itself relatively
    python benchmarks/ab_versions.py [gpt2_small] [many_small] [tiny]
"""

import json
import os
import sys
import time

sys.path.insert(0, os.environ.get("NUMBACCUM_OLD_PATH", "/tmp/oldpkg"))
import numbaccum_old as old  # noqa: E402
import numpy as np  # noqa: E402

import numbaccum as new  # noqa: E402
from numbaccum.bench import workloads as W  # noqa: E402


def cases(lib, tree, plain):
    f = tree if plain else lib.FlatTree.from_tree(tree)
    out = {}
    tx = lib.clip_by_global_norm(1.0)
    s = tx.init(f)
    out["clip_by_global_norm"] = lambda: tx.update(f, s)
    ms = lib.MultiSteps(lib.chain(lib.clip_by_global_norm(1.0), lib.adam(1e-3)), 4)
    ms_s = [ms.init(f)]

    def mini():
        _, st = ms.update(f, ms_s[0], f)
        if int(st.mini_step) == 3:  # keep it a mini-step: reset the count before the emitting one
            st = st._replace(mini_step=np.int32(1))
        ms_s[0] = st

    out["MultiSteps mini-step"] = mini
    full = lib.MultiSteps(lib.chain(lib.clip_by_global_norm(1.0), lib.adam(1e-3)), 1)
    fs = [full.init(f)]

    def emit():
        _, fs[0] = full.update(f, fs[0], f)

    out["full emitting step"] = emit
    e = lib.ema(0.9)
    es = [e.init(f)]

    def ema():
        _, es[0] = e.update(f, es[0])

    out["ema (debias)"] = ema
    return out


res = {}
spec = [
    ("gpt2_small", W.gpt2_small_shapes(), 7, False),
    ("many_small", W.many_small_shapes(), 25, False),
    ("tiny (plain tree)", W.tiny_shapes(), 2000, True),
    ("tiny (FlatTree)", W.tiny_shapes(), 2000, False),
]
only = sys.argv[1:]
for wname, shapes, n, plain in spec:
    if only and wname.split()[0] not in only:
        continue
    tree = W.make_tree(shapes)
    co, cn = cases(old, tree, plain), cases(new, tree, plain)
    for op in co:
        fa, fb = co[op], cn[op]
        for _ in range(2):
            fa()
            fb()
        ta, tb = [], []
        for _ in range(n):
            t = time.perf_counter()
            fa()
            ta.append(time.perf_counter() - t)
            t = time.perf_counter()
            fb()
            tb.append(time.perf_counter() - t)
        ta.sort()
        tb.sort()
        unit = 1e6 if wname.startswith("tiny") else 1e3
        u = "us" if unit == 1e6 else "ms"
        row = dict(
            workload=wname,
            op=op,
            before_median=ta[n // 2] * unit,
            after_median=tb[n // 2] * unit,
            before_min=ta[0] * unit,
            after_min=tb[0] * unit,
            unit=u,
            calls=n,
        )
        res.setdefault("rows", []).append(row)
        ratio = row["after_median"] / row["before_median"]
        cells = [wname, op, f"{row['before_median']:.1f}", f"{row['after_median']:.1f}", f"{ratio:.2f}"]
        cells += [f"{row['before_min']:.1f}", f"{row['after_min']:.1f}", u]
        print("| " + " | ".join(cells) + " |", flush=True)
    del co, cn, tree
with open(f"ab_versions_{'_'.join(only) or 'all'}.json", "w") as fh:
    json.dump(res, fh, indent=1)
