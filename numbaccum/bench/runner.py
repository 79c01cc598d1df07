"""`numbaccum bench`: numbaccum next to a NumPy per-leaf version of the same math, in one run.

Each operation is timed after a warm-up (which also compiles the kernels) as the median of
``repeats`` calls, with min and max. GB/s counts the minimal bytes per parameter of the operation
(DESIGN.md), and the copy floor is a large copy measured in the same run. Minimal bytes per
float32 parameter: a MultiSteps mini-step reads g and reads and writes acc (12), except the first
of a cycle, which only writes acc (8); an emitting step also reads and writes mu and nu and writes
the update (32); ema with debias reads g, reads and writes ema, writes the update (16);
clip_by_global_norm reads g for the norm and again for the output, and writes the output (12).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import workloads
from .baselines import DECAY, LR, NumpyClipByGlobalNorm, NumpyEma, NumpyMultiStepsAdam


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def copy_floor(nbytes: int, repeats: int) -> float:
    """GB/s (read + write bytes) of the faster of ``np.copyto`` (one thread) and a parallel numba
    copy (all threads) between two preallocated float32 buffers: the roof a kernel can reach."""
    from numbaccum import backend

    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    backend.call("scale_", b, a, 1.0, 1.0)  # (x / 1) * 1 == x: a copy through our own kernel
    t_np = min(_times(lambda: np.copyto(b, a), repeats))
    t_par = min(_times(lambda: backend.call("scale_", b, a, 1.0, 1.0), repeats))
    return 2 * a.nbytes / min(t_np, t_par) / 1e9


def run(workload: str, repeats: int, quick: bool) -> dict[str, Any]:
    import numba

    import numbaccum as nba

    shapes = workloads.WORKLOADS[workload]()
    params = workloads.make_tree(shapes, np.float32, seed=0)
    grads = workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2)
    leaves = nba.tree_flatten(grads)[0]
    n_params = sum(x.size for x in leaves)
    pf, gf = nba.FlatTree.from_tree(params), nba.FlatTree.from_tree(grads)
    floor = copy_floor(min(500_000_000, max(64 * n_params, 1 << 22)), 5)
    k = 4
    rows = []

    def add(op: str, impl: str, ts: list[float], bytes_per_param: float) -> None:
        med = statistics.median(ts)
        gbs = bytes_per_param * n_params / med / 1e9
        rows.append(
            dict(
                op=op,
                impl=impl,
                median_s=med,
                min_s=min(ts),
                max_s=max(ts),
                gbs=gbs,
                floor_fraction=gbs / floor,
            )
        )

    # MultiSteps(adam(1e-3), 4): time mini-steps and emitting steps separately.
    opt = nba.MultiSteps(nba.adam(LR), k)
    state = opt.init(pf)
    ref = NumpyMultiStepsAdam(nba.tree_flatten(params)[0], k)
    cycles = max(2, repeats // k)
    mini: dict[str, list[float]] = {"numbaccum": [], "numpy": []}
    emit: dict[str, list[float]] = {"numbaccum": [], "numpy": []}
    for cycle in range(cycles + 1):  # the first cycle warms up
        for step in range(k):
            t = time.perf_counter()
            _, state = opt.update(gf, state, pf)
            t_nba = time.perf_counter() - t
            t = time.perf_counter()
            ref.update(leaves)
            t_np = time.perf_counter() - t
            if cycle:
                bucket = emit if step == k - 1 else mini
                bucket["numbaccum"].append(t_nba)
                bucket["numpy"].append(t_np)
    mini_bytes = (8 + 12 * (k - 2)) / (k - 1)  # the first mini-step of a cycle reads no acc
    for impl in ("numbaccum", "numpy"):
        add("MultiSteps mini-step", impl, mini[impl], mini_bytes)
        add("MultiSteps emitting step", impl, emit[impl], 32)

    tx = nba.ema(DECAY)
    s = tx.init(pf)
    tx.update(gf, s)
    add("ema (debias)", "numbaccum", _times(lambda: tx.update(gf, s), repeats), 16)
    ref_ema = NumpyEma(nba.tree_flatten(params)[0])
    add("ema (debias)", "numpy", _times(lambda: ref_ema.update(leaves), repeats), 16)

    # clip_by_global_norm standalone, always clipping (max_norm far below the norm): a norm pass
    # and a scale pass into the transformation's own output buffer.
    clip = nba.clip_by_global_norm(1e-3)
    cs = clip.init(pf)
    clip.update(gf, cs)
    add("clip_by_global_norm", "numbaccum", _times(lambda: clip.update(gf, cs), repeats), 12)
    ref_clip = NumpyClipByGlobalNorm(nba.tree_flatten(params)[0], 1e-3)
    ref_clip.update(leaves)
    add("clip_by_global_norm", "numpy", _times(lambda: ref_clip.update(leaves), repeats), 12)

    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cpus, {platform.system()} {platform.machine()}",
        "numba_threads": numba.get_num_threads(),
        "threading_layer": _threading_layer(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "workload": workload,
        "n_params": int(n_params),
        "n_leaves": len(leaves),
        "copy_floor_gbs": floor,
        "rows": rows,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def _threading_layer() -> str:
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:
        return "not yet chosen"


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"numbaccum bench -- {result['workload']}: {result['n_params']:,} float32 params in "
        f"{result['n_leaves']} leaves; {result['date']}; {result['machine']}; numba "
        f"{result['numba']} ({result['numba_threads']} threads, {result['threading_layer']}), "
        f"numpy {result['numpy']}",
        f"copy floor (best of np.copyto and a parallel copy, R+W): {result['copy_floor_gbs']:.1f} GB/s",
        "",
        "| operation | implementation | median ms | min-max ms | GB/s | of copy floor | vs numpy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    numpy_time = {r["op"]: r["median_s"] for r in result["rows"] if r["impl"] == "numpy"}
    for r in result["rows"]:
        speed = numpy_time[r["op"]] / r["median_s"]
        ms = f"{r['median_s'] * 1e3:.2f} | {r['min_s'] * 1e3:.2f}-{r['max_s'] * 1e3:.2f}"
        lines.append(
            f"| {r['op']} | {r['impl']} | {ms} | {r['gbs']:.1f} | {r['floor_fraction']:.2f} | {speed:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="numbaccum bench", description=__doc__)
    parser.add_argument("--workload", default=None, choices=sorted(workloads.WORKLOADS))
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per operation")
    parser.add_argument("--quick", action="store_true", help="a small workload and few repeats")
    parser.add_argument("--json", metavar="FILE", help="also write the raw numbers here")
    args = parser.parse_args(argv)
    workload = args.workload or ("many_small" if args.quick else "gpt2_small")
    repeats = args.repeats or (4 if args.quick else 12)
    print(f"numbaccum bench: {workload}, {repeats} repeats (warm-up first) ...", file=sys.stderr)
    result = run(workload, repeats, args.quick)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
