"""Issue 14's GPU rows: fused chains on the device against stage by stage and the copy roof, and
the host cost of a full emitting step on 2000 small leaves. Needs a CUDA GPU (numba-cuda); it
stops with a clear message without one (no GPU was lent to the session that wrote it: run it
where there is one and record the table in benchmarks/results/).

Rows (float32):

1. GPT-2 XL shapes (1.56B parameters): ``chain(clip_by_global_norm(1.0), ema(0.9), trace(0.9),
   scale(-1e-3))`` fused (the default), stage by stage (``NUMBACCUM_FUSE=0``), and a
   device-to-device copy of the bytes `numbaccum.explain` says the fused update moves. Targets:
   fused <= 0.6x stage by stage, and >= 0.85 of the copy's bandwidth.
2. 2000 leaves of 100-5000 elements: the emitting step of ``MultiSteps(chain(clip_by_global_norm(1.0),
   adamw(1e-3)), 4)`` (its update after three mini-steps), per call. Target: <= 0.2 ms.

Calls alternate A, B, C, A, B, C, ...; each is timed between CUDA events; medians.

    PYTHONPATH=. python benchmarks/gpu_fusion.py [--scale 1.0] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import numbaccum as nb
from numbaccum.bench import workloads
from numbaccum.bench.gpu import Clock


def _alternate(contenders: list, repeats: int, clock: Clock) -> list:
    for _, fn in contenders:
        fn()
        fn()
    times: list[list[float]] = [[] for _ in contenders]
    for _ in range(repeats):
        for (_, fn), ts in zip(contenders, times):
            ts.append(clock(fn))
    return [(name, statistics.median(ts)) for (name, _), ts in zip(contenders, times)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each GPT-2 XL leaf's rows")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    from numba import cuda

    if not cuda.is_available():
        sys.exit("gpu_fusion.py needs a CUDA GPU (numba-cuda sees none); nothing was measured")
    clock = Clock()
    print(f"# GPU fusion benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"device: {cuda.get_current_device().name if hasattr(cuda, 'get_current_device') else 'simulator'}")

    def shrink(shape: tuple) -> tuple:
        return shape if not shape or args.scale >= 1 else (max(1, int(shape[0] * args.scale)), *shape[1:])

    shapes = workloads.map_shapes(shrink, workloads.gpt2_small_shapes(d=1600, n_layer=48))
    n = workloads.count_params(shapes)
    grads = nb.to_device(nb.FlatTree.from_tree(workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2)))
    contenders = []
    nbytes = None
    for fused in ("1", "0"):
        tx = nb.chain(nb.clip_by_global_norm(1.0), nb.ema(0.9), nb.trace(0.9), nb.scale(-1e-3))
        box = [tx.init(grads)]
        if fused == "1":
            nbytes = nb.explain(tx, grads, fused=True).total * n

        def call(tx=tx, box=box, fused=fused) -> None:
            os.environ["NUMBACCUM_FUSE"] = fused
            _, box[0] = tx.update(grads, box[0])

        contenders.append(("fused" if fused == "1" else "stage by stage", call))
    src = cuda.device_array(int(nbytes // 8), np.float32)
    dst = cuda.device_array_like(src)
    contenders.append(("copy of the fused bytes", lambda: dst.copy_to_device(src)))
    rows = _alternate(contenders, args.repeats, clock)
    os.environ["NUMBACCUM_FUSE"] = "1"
    base = dict(rows)
    print(f"\nGPT-2 XL shapes, {n / 1e6:.0f}M float32, fused moves {nbytes / n:.1f} B/param")
    print("| contender | median ms | vs stage by stage | of the copy's bandwidth |")
    print("| --- | --- | --- | --- |")
    for name, t in rows:
        ratio, roof = t / base["stage by stage"], base["copy of the fused bytes"] / t
        print(f"| {name} | {t * 1e3:.3f} | {ratio:.2f}x | {roof:.2f} |")

    small = workloads.make_tree(workloads.many_small_shapes(), np.float32, seed=2, scale=1e-2)
    p = nb.to_device(nb.FlatTree.from_tree(small))
    g = nb.to_device(nb.FlatTree.from_tree(small))
    ms = nb.MultiSteps(nb.chain(nb.clip_by_global_norm(1.0), nb.adamw(1e-3)), 4)
    box = [ms.init(p)]

    def emitting() -> None:
        _, box[0] = ms.update(g, box[0], p)

    times = []
    for _ in range(args.repeats + 2):
        for _ in range(3):
            emitting()
        times.append(clock(emitting))
    ms_per_call = statistics.median(times[2:]) * 1e3
    print(f"\n2000 small leaves: emitting step of MultiSteps(chain(clip, adamw), 4): {ms_per_call:.3f} ms")


if __name__ == "__main__":
    main()
