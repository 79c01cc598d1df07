"""GPU benchmark: numbaccum's CUDA kernels next to PyTorch foreach and a device copy, one run.

    python benchmarks/gpu_bench.py [--json FILE]

Workloads (float32): GPT-2 small (124M params, 148 leaves), GPT-2 XL shapes (1.56B params, 580
leaves) and 2000 leaves of 100-5000 elements. Operations: MultiSteps mini-step (mean accumulate,
``acc += (g - acc) / (n + 1)``; torch: ``_foreach_lerp_``), ema with debias (torch:
``_foreach_lerp_`` then ``_foreach_div``) and clip_by_global_norm (numbaccum into its output
buffer: a norm pass and a scale pass, 12 bytes/param; torch ``clip_grad_norm_(foreach=True)`` in
place). With ``--optax``, optax under ``jax.jit`` too (state donated; run with
XLA_PYTHON_CLIENT_PREALLOCATE=false). The roof is a device-to-device copy.
Times are medians of CUDA-event-timed calls after warm-up; GB/s counts minimal bytes per param.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import numbaccum as nba  # noqa: E402
from numbaccum.bench import workloads  # noqa: E402


def gpt2_xl_shapes() -> dict:
    return workloads.gpt2_small_shapes(d=1600, n_layer=48)


def timed(fn, repeats: int) -> list[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def run(name: str, shapes: dict, repeats: int, optax_too: bool) -> list[dict]:
    from numba import cuda

    sizes = [int(np.prod(s)) for s in workloads.leaves(shapes)]
    n = sum(sizes)
    rows = []
    box: dict = {}  # what the timed closures use; cleared between parts to free GPU memory

    def free() -> None:
        box.clear()
        torch.cuda.empty_cache()
        cuda.current_context().deallocations.clear()

    box["a"], box["b"] = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    copy = statistics.median(timed(lambda: box["b"].copy_(box["a"]), repeats))
    roof = 8 * n / copy / 1e9
    rows.append(dict(workload=name, op="d2d copy", impl="torch", ms=copy * 1e3, gbs=roof, roof=1.0))
    free()

    def add(op, impl, fn, bpp):
        med = statistics.median(timed(fn, repeats))
        gbs = bpp * n / med / 1e9
        rows.append(dict(workload=name, op=op, impl=impl, ms=med * 1e3, gbs=gbs, roof=gbs / roof))

    # numbaccum: a FlatTree on the device, moved with one transfer per dtype
    box["g"] = nba.to_device(nba.FlatTree.from_tree(workloads.make_tree(shapes, np.float32, seed=1)))
    box["ms"] = nba.MultiSteps(nba.sgd(1.0), 1_000_000)  # never emits: pure mini-steps
    box["ms_state"] = box["ms"].init(box["g"])

    def nba_mini():
        _, box["ms_state"] = box["ms"].update(box["g"], box["ms_state"])

    add("MultiSteps mini-step", "numbaccum", nba_mini, 12)
    box.pop("ms_state")
    box["ema"] = nba.ema(0.999)
    box["ema_state"] = box["ema"].init(box["g"])

    def nba_ema():
        _, box["ema_state"] = box["ema"].update(box["g"], box["ema_state"])

    add("ema (debias)", "numbaccum", nba_ema, 16)
    box.pop("ema_state")
    box["clip"] = nba.clip_by_global_norm(1e-3)  # always clips: the factor pass runs
    box["clip_state"] = box["clip"].init(box["g"])

    def nba_clip():
        box["clip"].update(box["g"], box["clip_state"])

    add("clip_by_global_norm", "numbaccum", nba_clip, 12)
    free()

    box["tg"] = [torch.randn(s, device="cuda") for s in sizes]
    box["tacc"] = [torch.zeros(s, device="cuda") for s in sizes]
    box["k"] = 0

    def torch_mini():
        box["k"] += 1
        torch._foreach_lerp_(box["tacc"], box["tg"], 1.0 / box["k"])

    add("MultiSteps mini-step", "torch foreach lerp", torch_mini, 12)
    box["k"] = 0

    def torch_ema():
        box["k"] += 1
        torch._foreach_lerp_(box["tacc"], box["tg"], 1 - 0.999)
        torch._foreach_div(box["tacc"], 1 - 0.999 ** box["k"])

    add("ema (debias)", "torch foreach", torch_ema, 16)

    def torch_clip():
        torch.nn.utils.clip_grad_norm_(box["tacc"], 1e-3, foreach=True)

    for t, g in zip(box["tacc"], box["tg"]):
        t.grad = g
    box["tacc"] = [t.requires_grad_() for t in box["tacc"]]
    add("clip_by_global_norm (in place)", "torch clip_grad_norm_ foreach", torch_clip, 12)
    free()
    if optax_too:
        run_optax(shapes, sizes, n, repeats, roof, rows, name)
    return rows


def run_optax(
    shapes: dict, sizes: list[int], n: int, repeats: int, roof: float, rows: list, name: str
) -> None:
    """optax under jax.jit, the state donated so XLA updates it in place."""
    import time

    import jax
    import jax.numpy as jnp
    import optax

    box = {"leaves": [jnp.ones(s, jnp.float32) for s in sizes]}

    def bench(tx, op, bpp):
        leaves = box["leaves"]
        state = tx.init(leaves)
        step = jax.jit(tx.update, donate_argnums=(1,))
        for _ in range(3):
            u, state = step(leaves, state)
        jax.block_until_ready(u)
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            u, state = step(leaves, state)
            jax.block_until_ready(u)
            ts.append(time.perf_counter() - t)
        med = statistics.median(ts)
        gbs = bpp * n / med / 1e9
        rows.append(dict(workload=name, op=op, impl="optax jit", ms=med * 1e3, gbs=gbs, roof=gbs / roof))

    bench(optax.MultiSteps(optax.sgd(1.0), 1_000_000), "MultiSteps mini-step", 12)
    bench(optax.ema(0.999), "ema (debias)", 16)
    bench(optax.clip_by_global_norm(1e-3), "clip_by_global_norm", 12)
    box.clear()
    jax.clear_caches()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--optax", action="store_true", help="also optax under jax.jit (needs JAX with CUDA)")
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    rows += run("2000 small leaves (5.2M)", workloads.many_small_shapes(), args.repeats, args.optax)
    rows += run("GPT-2 small (124M, 148 leaves)", workloads.gpt2_small_shapes(), args.repeats, args.optax)
    rows += run("GPT-2 XL (1.56B, 580 leaves)", gpt2_xl_shapes(), max(5, args.repeats // 2), args.optax)
    print("| workload | operation | implementation | median ms | GB/s | of d2d copy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = [r["workload"], r["op"], r["impl"], f"{r['ms']:.3f}", f"{r['gbs']:.0f}", f"{r['roof']:.2f}"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
