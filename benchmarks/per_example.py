"""per_example_global_norm_clip on a batch of per-example gradients: numbaccum vs plain NumPy.

    python benchmarks/per_example.py [--batch 64] [--params 1000000] [--repeats 10] [--quick]
                                     [--json FILE]

The workload is an MLP-shaped float32 tree of about ``--params`` parameters per example (two
weight matrices and two biases), with the batch on axis 0 of every leaf: 64 x 1M = 64M floats
(256 MB) by default. Each implementation is timed after a warm-up (which also compiles the
kernels and checks its result against numbaccum's) as the median of ``--repeats`` calls.

Implementations, side by side in one run:
  numbaccum flat   ``nba.per_example_global_norm_clip`` on a ``FlatTree`` (or its ``.tree``):
                   the zero-copy path; one float64 squared-norm pass and one weighted-sum pass
                   per dtype.
  numbaccum tree   the same on a plain tree of separate arrays, which is packed into one buffer
                   first (a copy of the batch).
  numpy            per-example norms with ``np.einsum('bi,bi->b')`` per leaf (float32
                   accumulation, as a NumPy user writes it), multipliers, then
                   ``np.tensordot(mult, g, axes=1)`` per leaf (BLAS, all threads).
  numpy f64        the same with float64 norms (``np.einsum(..., dtype=np.float64)``), which is what
                   numbaccum computes.
  dp_aggregate     ``nba.differentially_private_aggregate(C, 1.0, seed)`` on the FlatTree: the clip
                   plus float64 Gaussian noise drawn on the host (one value per parameter).

GB/s counts the minimal traffic: the batch is read twice (norms, then sums) and the sums are
written once: ``(2 B + 1) * 4`` bytes per parameter. The copy floor is the faster of
``np.copyto`` and numbaccum's parallel copy kernel on a large buffer, measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numbaccum as nba  # noqa: E402
from numbaccum.bench.runner import _times, copy_floor  # noqa: E402


def mlp_shapes(n_params: int) -> dict[str, tuple[int, ...]]:
    """Two dense layers ``d_in -> hidden -> d_out`` with biases, about ``n_params`` in all."""
    d_in, d_out = 784, 10
    hidden = max(1, round((n_params - d_out) / (d_in + d_out + 1)))
    return {"w1": (d_in, hidden), "b1": (hidden,), "w2": (hidden, d_out), "b2": (d_out,)}


def numpy_clip(grads: dict[str, np.ndarray], clip: float, acc_dtype: Any = None) -> tuple[dict, int]:
    """Plain NumPy per-example clipping: einsum norms per leaf, then a tensordot per leaf."""
    batch = next(iter(grads.values())).shape[0]
    sq = np.zeros(batch, acc_dtype or np.float32)
    for x in grads.values():
        x2 = x.reshape(batch, -1)
        sq += np.einsum("bi,bi->b", x2, x2, dtype=acc_dtype)
    norms = np.sqrt(sq)
    with np.errstate(divide="ignore", invalid="ignore"):
        mult = np.nan_to_num(np.minimum(clip / norms, 1.0), nan=1.0)
    m = mult.astype(np.float32)
    return {k: np.tensordot(m, x, axes=1) for k, x in grads.items()}, int(np.sum(mult < 1.0))


def run(batch: int, n_params: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    shapes = mlp_shapes(n_params)
    grads = {k: rng.standard_normal((batch, *s), dtype=np.float32) for k, s in shapes.items()}
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    flat = nba.FlatTree.from_tree(grads)
    # Examples' norms are about sqrt(n_params): a clip at the median norm clips half of them.
    clip = float(np.sqrt(n_params))
    dp = nba.differentially_private_aggregate(clip, 1.0, seed=0)
    dp_state = dp.init(None)

    impls: dict[str, Callable[[], Any]] = {
        "numbaccum flat": lambda: nba.per_example_global_norm_clip(flat, clip),
        "numbaccum tree": lambda: nba.per_example_global_norm_clip(grads, clip),
        "numpy": lambda: numpy_clip(grads, clip),
        "numpy f64": lambda: numpy_clip(grads, clip, np.float64),
        "dp_aggregate": lambda: dp.update(flat, dp_state),
    }
    want, want_n = nba.per_example_global_norm_clip(flat, clip)
    for name in ("numbaccum tree", "numpy", "numpy f64"):  # warm-up and a check of each result
        got, n = impls[name]()
        for k, v in want.tree.items():
            np.testing.assert_allclose(
                got[k], v, rtol=1e-3, atol=1e-3 * float(np.max(np.abs(v))), err_msg=name
            )
    impls["dp_aggregate"]()
    floor = copy_floor(min(500_000_000, max(8 * batch * n_params, 1 << 22)), 5)
    nbytes = (2 * batch + 1) * 4 * n_params
    rows = []
    for name, fn in impls.items():
        ts = _times(fn, repeats)
        med = statistics.median(ts)
        rows.append(dict(impl=name, median_s=med, min_s=min(ts), max_s=max(ts), gbs=nbytes / med / 1e9))
    base = next(r["median_s"] for r in rows if r["impl"] == "numpy")
    for r in rows:
        r["of_floor"] = r["gbs"] / floor
        r["vs_numpy"] = base / r["median_s"]
    import numba

    return dict(
        date=_dt.date.today().isoformat(),
        machine=platform.node(),
        cpu_count=os.cpu_count(),
        numba_threads=numba.get_num_threads(),
        batch=batch,
        params_per_example=n_params,
        shapes=shapes,
        clip=clip,
        num_clipped=int(want_n),
        repeats=repeats,
        copy_floor_gbs=floor,
        rows=rows,
    )


def format_table(res: dict[str, Any]) -> str:
    lines = [
        f"per_example_global_norm_clip: batch {res['batch']} x {res['params_per_example']:,} float32 "
        f"parameters ({res['num_clipped']} of {res['batch']} examples clipped), median of "
        f"{res['repeats']}, {res['numba_threads']} numba threads",
        f"copy floor (best of np.copyto and a parallel copy, R+W): {res['copy_floor_gbs']:.1f} GB/s",
        "",
        "| implementation | median ms | min-max ms | GB/s | of copy floor | vs numpy |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['impl']} | {1e3 * r['median_s']:.2f} | {1e3 * r['min_s']:.2f}-{1e3 * r['max_s']:.2f} | "
            f"{r['gbs']:.1f} | {r['of_floor']:.2f} | {r['vs_numpy']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--params", type=int, default=1_000_000, help="parameters per example")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not a measurement")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.params, args.repeats = 4, 10_000, 3
    res = run(args.batch, args.params, args.repeats)
    print(format_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
