"""The scaled norm's fast path against the plain norm before it (issue 12, item 5), alternated
call by call (A, B, A, B, ...) in one process: global_norm, clip_by_global_norm and
clip_by_block_rms on float32 and float64 trees of common magnitudes, large and small.

Set up the old version as a package of another name, then run:

    git worktree add /tmp/h2old/src f309338 && mkdir -p /tmp/h2old/pkg
    cp -r /tmp/h2old/src/numbaccum /tmp/h2old/pkg/numbaccum_old
    NUMBACCUM_OLD_PATH=/tmp/h2old/pkg python benchmarks/norm_fastpath.py
"""

import json
import os
import sys
import time

sys.path.insert(0, os.environ.get("NUMBACCUM_OLD_PATH", "/tmp/h2old/pkg"))
import numbaccum_old as old  # noqa: E402
import numpy as np  # noqa: E402

import numbaccum as new  # noqa: E402


def trees():
    rng = np.random.default_rng(0)
    big32 = {
        f"l{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate([2_000_000, 768 * 768, 3072])
    }
    big64 = {k: v.astype(np.float64) for k, v in big32.items()}
    small = {f"l{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate([3, 17, 64, 1])}
    small64 = {k: v.astype(np.float64) for k, v in small.items()}
    return {"f32 2.6M": big32, "f64 2.6M": big64, "f32 small": small, "f64 small": small64}


def cases(lib, tree):
    f = lib.FlatTree.from_tree(tree)
    cbgn = lib.clip_by_global_norm(1.0)
    rms = lib.clip_by_block_rms(0.1)
    return {
        "global_norm": lambda: lib.global_norm(f),
        "clip_by_global_norm": lambda: cbgn.update(f, None),
        "clip_by_block_rms": lambda: rms.update(f, None),
    }


def main():
    reps = int(os.environ.get("REPS", "41"))
    out = {}
    for tname, tree in trees().items():
        a, b = cases(old, tree), cases(new, tree)
        for name in a:
            fa, fb = a[name], b[name]
            for _ in range(3):  # compile and warm
                fa(), fb()
            ta, tb = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                fa()
                t1 = time.perf_counter()
                fb()
                t2 = time.perf_counter()
                ta.append(t1 - t0)
                tb.append(t2 - t1)
            ma, mb = float(np.median(ta)), float(np.median(tb))
            out[f"{tname} / {name}"] = {"old_median_s": ma, "new_median_s": mb, "new/old": mb / ma}
            line = f"{tname:10s} {name:20s} old {ma * 1e6:10.1f} us  new {mb * 1e6:10.1f} us"
            print(f"{line}  new/old {mb / ma:5.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
