"""Row-wise clipping of every matrix, ``clip_norm(1.0, dim=1)``: numbaccum vs NumPy per leaf.

    python benchmarks/norms.py [--workload gpt2_small] [--dtype float32] [--repeats 7]
                               [--max-norm 1.0] [--json FILE]

``--workload gpt2_mini`` (GPT-2-small's structure with small dimensions) is a quick smoke test.

Each leaf with a dimension 1 is clipped slice by slice: the elements sharing an index along
every other dimension (the rows of an ``(in, out)`` matrix) are scaled to an L2 norm of at most
``max_norm``; vectors have no dimension 1 and pass unchanged. Implementations, side by side in
one run (the repeats interleave them):

  numbaccum-flat  ``nba.clip_norm(max_norm, dim=1).update`` on a FlatTree (no packing copy):
                  one segmented pass for the row norms per dtype group, one pass that scales.
  numbaccum-tree  the same update on a plain tree of separate arrays (one packing copy in).
  numpy           per leaf: row sums of squares with ``einsum`` (float32 accumulation), the
                  factors ``min(1, max_norm / n)`` (1 where ``n <= 1e-12`` or not finite), then
                  ``np.multiply`` into a preallocated output leaf. Single-threaded.

Bytes per parameter (minimal): 12 for float32 (read for the norms, read and write to scale).
``GB/s`` counts those bytes. The copy roof is ``np.copyto`` of the same number of bytes.
Before timing, numbaccum's output is checked against the NumPy one (rtol 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numbaccum.bench import workloads  # noqa: E402  (plain NumPy: imports nothing of numbaccum's)

TINY = 1e-12

# The GPT-2-small structure with small dimensions (148 leaves, ~60k params): a smoke test.
SHAPES = {
    **workloads.WORKLOADS,
    "gpt2_mini": lambda: workloads.gpt2_small_shapes(vocab=500, n_ctx=64, d=32, n_layer=12),
}


class NumpyRowClip:
    """``clip_norm(max_norm, dim=1)`` leaf by leaf in NumPy, into preallocated outputs."""

    def __init__(self, leaves: list[np.ndarray], max_norm: float) -> None:
        self.max_norm = max_norm
        self.out = [np.empty_like(x) for x in leaves]

    def __call__(self, leaves: list[np.ndarray]) -> list[np.ndarray]:
        for x, o in zip(leaves, self.out):
            if x.ndim < 2:  # no dimension 1: unchanged
                np.copyto(o, x)
                continue
            if x.ndim == 2:  # rows: the BLAS-free but contiguous einsum reduction
                v, n = x, np.sqrt(np.einsum("ij,ij->i", x, x))[:, None]
            else:
                v = x.reshape(x.shape[0], x.shape[1], -1)
                n = np.sqrt(np.einsum("ijk,ijk->ik", v, v))[:, None, :]
            with np.errstate(divide="ignore", invalid="ignore"):
                f = np.where(np.isfinite(n) & (n > TINY), np.minimum(1.0, self.max_norm / n), 1.0)
            np.multiply(v, f.astype(x.dtype), out=o.reshape(v.shape))
        return self.out


def timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def copy_roof(nbytes: int, reps: int) -> float:
    """Median seconds of ``np.copyto`` moving ``nbytes`` (read + write counted)."""
    n = max(nbytes // 8, 1)
    src, dst = np.ones(n, np.float32), np.zeros(n, np.float32)
    np.copyto(dst, src)
    return statistics.median(timed(np.copyto, dst, src) for _ in range(reps))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="gpt2_small", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    import numba

    import numbaccum as nba

    shapes = SHAPES[args.workload]()
    dtype = np.dtype(args.dtype)
    grads = workloads.make_tree(shapes, dtype, seed=0)
    n_params = workloads.count_params(shapes)
    leaves = workloads.leaves(grads)
    flat = nba.FlatTree.from_tree(grads)
    tx = nba.clip_norm(args.max_norm, dim=1)
    state = tx.init(flat)
    ref = NumpyRowClip(leaves, args.max_norm)

    def run_flat():
        return tx.update(flat, state)[0]

    def run_tree():
        return tx.update(grads, state)[0]

    # Warm-up (compiles the kernels, builds the slice tables) and the check.
    want = ref(leaves)
    for name, fn in (("numbaccum-flat", run_flat), ("numbaccum-tree", run_tree)):
        got = fn()
        got_leaves = workloads.leaves(got.tree if isinstance(got, nba.FlatTree) else got)
        for a, b in zip(got_leaves, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)

    impls = {"numbaccum-flat": run_flat, "numbaccum-tree": run_tree, "numpy": lambda: ref(leaves)}
    times: dict[str, list[float]] = {k: [] for k in impls}
    for _ in range(args.repeats):
        for name, fn in impls.items():
            times[name].append(timed(fn))
    moved = 12 * n_params if dtype == np.float32 else 24 * n_params
    roof = copy_roof(moved, max(3, args.repeats))

    results = {
        "workload": args.workload,
        "dtype": args.dtype,
        "leaves": workloads.count_leaves(shapes),
        "params": n_params,
        "max_norm": args.max_norm,
        "repeats": args.repeats,
        "numba_threads": numba.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "copy_roof_s": roof,
        "copy_roof_gbs": moved / roof / 1e9,
        "impls": {},
    }
    print(
        f"clip_norm({args.max_norm}, dim=1) on {args.workload}: {results['leaves']} leaves, "
        f"{n_params:,} params, {args.dtype}, {numba.get_num_threads()} numba threads"
    )
    header = ("implementation", "median ms", "min ms", "GB/s", "x roof", "vs numpy")
    print("{:16s} {:>10s} {:>9s} {:>7s} {:>7s} {:>9s}".format(*header))
    base = statistics.median(times["numpy"])
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = moved / med / 1e9
        results["impls"][name] = {
            "median_s": med,
            "min_s": min(ts),
            "gbs": gbs,
            "speedup_vs_numpy": base / med,
        }
        print(
            f"{name:16s} {med * 1e3:10.2f} {min(ts) * 1e3:9.2f} {gbs:7.1f} "
            f"{gbs / results['copy_roof_gbs']:7.2f} {base / med:8.2f}x"
        )
    print(f"{'copy roof':16s} {roof * 1e3:10.2f} {'':9s} {results['copy_roof_gbs']:7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
