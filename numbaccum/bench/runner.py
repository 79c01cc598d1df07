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


OPS = ("multisteps", "ema", "clip")


def run(workload: str, repeats: int, ops: tuple[str, ...] = OPS, peers: bool = True) -> dict[str, Any]:
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

    max_norm = 1e-3  # far below the norm: clip_by_global_norm always clips
    p_leaves = nba.tree_flatten(params)[0]
    opt, clip, ema = nba.MultiSteps(nba.adam(LR), k), nba.clip_by_global_norm(max_norm), nba.ema(DECAY)
    box = {"ms": opt.init(pf), "clip": clip.init(pf), "ema": ema.init(pf)}

    def nba_ms() -> None:
        _, box["ms"] = opt.update(gf, box["ms"], pf)

    def nba_ema() -> None:
        _, box["ema"] = ema.update(gf, box["ema"])

    def nba_clip() -> None:
        clip.update(gf, box["clip"])

    ref_ms, ref_ema = NumpyMultiStepsAdam(p_leaves, k), NumpyEma(p_leaves)
    ref_clip = NumpyClipByGlobalNorm(p_leaves, max_norm)
    impls: dict[str, dict[str, Callable[[], Any]]] = {
        "numbaccum": {"multisteps": nba_ms, "ema": nba_ema, "clip": nba_clip},
        "numpy": {
            "multisteps": lambda: ref_ms.update(leaves),
            "ema": lambda: ref_ema.update(leaves),
            "clip": lambda: ref_clip.update(leaves),
        },
    }
    if peers:
        from . import peers as peer_libs

        for name, build in (("torch foreach", peer_libs.torch_steps), ("optax jit", peer_libs.optax_steps)):
            steps = build(p_leaves, leaves, k, max_norm)
            if steps:
                impls[name] = steps
    mini_bytes = (8 + 12 * (k - 2)) / (k - 1)  # the first mini-step of a cycle reads no acc
    cycles = max(2, repeats // k)
    todo = [(impl, op) for impl in impls for op in ops]
    for i, (impl, op) in enumerate(todo):
        print(f"  [{i + 1}/{len(todo)}] {op}: {impl}", file=sys.stderr, flush=True)
        step = impls[impl][op]
        if op == "multisteps":  # mini-steps and emitting steps timed apart, after a warm-up cycle
            mini: list[float] = []
            emit: list[float] = []
            for cycle in range(cycles + 1):
                for position in range(k):
                    t = time.perf_counter()
                    step()
                    if cycle:
                        (emit if position == k - 1 else mini).append(time.perf_counter() - t)
            add("MultiSteps mini-step", impl, mini, mini_bytes)
            add("MultiSteps emitting step", impl, emit, 32)
        else:
            step()
            label, nbytes = {"ema": ("ema (debias)", 16), "clip": ("clip_by_global_norm", 12)}[op]
            add(label, impl, _times(step, repeats), nbytes)

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
    result["rows"].sort(key=lambda r: list(numpy_time).index(r["op"]))
    for r in result["rows"]:
        speed = numpy_time[r["op"]] / r["median_s"]
        ms = f"{r['median_s'] * 1e3:.4g} | {r['min_s'] * 1e3:.4g}-{r['max_s'] * 1e3:.4g}"
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
    parser.add_argument("--op", action="append", choices=OPS, help="operations to time (default all)")
    parser.add_argument("--no-peers", action="store_true", help="skip PyTorch and optax even if installed")
    args = parser.parse_args(argv)
    workload = args.workload or ("many_small" if args.quick else "gpt2_small")
    repeats = args.repeats or (4 if args.quick else 12)
    print(f"numbaccum bench: {workload}, {repeats} repeats (warm-up first) ...", file=sys.stderr)
    result = run(workload, repeats, tuple(args.op or OPS), not args.no_peers)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
