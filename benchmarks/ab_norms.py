"""A/B: ``clip_norm`` per slice on GPT-2-small shapes (124.4M float32, a FlatTree), an older
numbaccum against this one, alternated call by call (A, B, A, B, ...); medians.

Set up the old version as in ``benchmarks/ab_versions.py`` (a package named ``numbaccum_old``
under ``/tmp/oldpkg``, or ``NUMBACCUM_OLD_PATH``), then:

    REPEATS=21 PYTHONPATH=. python benchmarks/ab_norms.py
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("NUMBACCUM_OLD_PATH", "/tmp/oldpkg"))
import numbaccum_old as old  # noqa: E402
import numpy as np  # noqa: E402

import numbaccum as new  # noqa: E402
from numbaccum.bench import workloads as W  # noqa: E402

CASES = {
    "clip_norm(1e-3, dim=1) [clips]": {"max_norm": 1e-3, "dim": 1},
    "clip_norm(100.0) per leaf [no clip]": {"max_norm": 100.0, "dim": None},
    "clip_norm(1e-3) per leaf [clips]": {"max_norm": 1e-3, "dim": None},
}


def update_of(lib, tree, kw):
    f = lib.FlatTree.from_tree(tree)
    tx = lib.clip_norm(**kw)
    s = tx.init(f)
    return lambda: tx.update(f, s)


def main():
    tree = W.make_tree(W.gpt2_small_shapes(), np.float32, seed=1, scale=1e-2)
    repeats = int(os.environ.get("REPEATS", 9))
    print("| case | old ms (median) | new ms (median) | new/old |\n| --- | --- | --- | --- |")
    for name, kw in CASES.items():
        fns = {"old": update_of(old, tree, kw), "new": update_of(new, tree, kw)}
        for fn in fns.values():  # compile and warm up
            fn()
            fn()
        times = {tag: [] for tag in fns}
        for _ in range(repeats):
            for tag, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[tag].append(time.perf_counter() - t)
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {name} | {o * 1e3:.1f} | {n * 1e3:.1f} | {n / o:.2f} |")


if __name__ == "__main__":
    main()
