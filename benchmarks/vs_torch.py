"""Issue 14's measure table on the CPU: fused chains and in-place optimizer steps against PyTorch's
foreach and fused optimizers, and the emitting step of MultiSteps against the copy floor.

Rows (GPT-2-small shapes, float32; ``--scale`` keeps a fraction of every leaf's rows):

1. ``chain(clip_by_global_norm(1.0), ema(0.9), trace(0.9), scale(-1e-3))``: ``update`` fused,
   against the same math in ``torch._foreach_*`` (``clip_grad_norm_(foreach=True)``,
   ``_foreach_lerp_`` and the debias division, ``_foreach_mul_``/``_foreach_add_``, the scale).
2. ``chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=1e-2))`` applied in place
   (``numbaccum.step_``), against ``clip_grad_norm_(foreach=True)`` then
   ``torch.optim.AdamW(fused=True).step()``.
3. ``adamw(1e-3, weight_decay=1e-2)`` in place, against ``AdamW(fused=True).step()``.
4. The emitting step of ``MultiSteps(chain(clip_by_global_norm(1.0), adamw(1e-3)), 4)`` (its
   ``update``), against a parallel copy of the same number of bytes that ``explain`` says the
   step moves: the ratio of the two times is the fraction of the copy floor's bandwidth reached.

Every contender has its own state and buffers; calls alternate A, B, A, B, ... after a warm-up,
and each row reports the median (and min-max) per call. PyTorch's tensors share the NumPy
buffers (``torch.from_numpy``), so no copy is timed. PyTorch runs with its default threads.

    PYTHONPATH=. python benchmarks/vs_torch.py [--scale 0.25] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

import numbaccum as nb
from numbaccum.backend import ops_for
from numbaccum.bench import workloads
from numbaccum.contract import ONE

LR, WD, MAX_NORM = 1e-3, 1e-2, 1.0


def _shrink(shapes: dict, scale: float) -> dict:
    def f(shape: tuple) -> tuple:
        if not shape or scale >= 1.0:
            return shape
        return (max(1, int(shape[0] * scale)), *shape[1:])

    return workloads.map_shapes(f, shapes)


def _time(contenders: list, repeats: int) -> list:
    """``(label, median, min, max)`` per ``(label, call)``, the calls alternated. A call returns
    None (its whole duration is timed) or the seconds of the part it timed itself."""
    for _, call in contenders:  # warm-up: compiles, allocates workspaces
        call()
        call()
    times: list[list[float]] = [[] for _ in contenders]
    for _ in range(repeats):
        for (_, call), ts in zip(contenders, times):
            t = time.perf_counter()
            own = call()
            ts.append(own if own is not None else time.perf_counter() - t)
    return [(c[0], statistics.median(ts), min(ts), max(ts)) for c, ts in zip(contenders, times)]


def _torch_chain(torch, grads: list[np.ndarray]) -> Callable[[], None]:
    """clip_grad_norm_ + ema (debiased) + trace + scale, the foreach way (the grads clipped in
    place, as a training step consumes them)."""
    g = [torch.from_numpy(x) for x in grads]
    holders = [torch.zeros_like(x).requires_grad_() for x in g]
    for h, x in zip(holders, g):
        h.grad = x
    ema = [torch.zeros_like(x) for x in g]
    tr = [torch.zeros_like(x) for x in g]
    box = {"count": 0}

    def step() -> None:
        box["count"] += 1
        torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, foreach=True)
        torch._foreach_lerp_(ema, g, 1 - 0.9)
        debiased = torch._foreach_div(ema, 1 - 0.9 ** box["count"])
        torch._foreach_mul_(tr, 0.9)
        torch._foreach_add_(tr, debiased)
        torch._foreach_mul(tr, -LR)

    return step


def _torch_adamw(torch, params: list[np.ndarray], grads: list[np.ndarray], clip: bool) -> Callable[[], None]:
    p = [torch.from_numpy(x.copy()).requires_grad_() for x in params]
    for t, x in zip(p, grads):
        t.grad = torch.from_numpy(x)
    opt = torch.optim.AdamW(p, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD, fused=True)

    def step() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_(p, MAX_NORM, foreach=True)
        opt.step()

    return step


def _ours_step(tx, params, grads) -> Callable[[], None]:
    p = nb.FlatTree.from_tree(params)
    box = [tx.init(p)]

    def step() -> None:
        box[0] = nb.step_(tx, grads, box[0], p)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each leaf's rows kept")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    import torch

    shapes = _shrink(workloads.gpt2_small_shapes(), args.scale)
    params = workloads.make_tree(shapes, np.float32, seed=0)
    grad_tree = workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2)
    grads = nb.FlatTree.from_tree(grad_tree)
    n = workloads.count_params(shapes)
    print(f"# numbaccum vs PyTorch, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {os.cpu_count()} CPUs, {n / 1e6:.1f}M float32 params, torch {torch.__version__} ")
    import numba

    print(f"(torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()})")
    leaves = [np.array(x, copy=True) for x in nb.tree_flatten(grad_tree)[0]]
    pleaves = nb.tree_flatten(params)[0]
    rows = []

    # Row 1: the first chain, fused update, against torch foreach.
    tx = nb.chain(nb.clip_by_global_norm(MAX_NORM), nb.ema(0.9), nb.trace(0.9), nb.scale(-LR))
    box = [tx.init(grads)]

    def ours_chain() -> None:
        _, box[0] = tx.update(grads, box[0])

    contenders = [("numbaccum update (fused)", ours_chain), ("torch foreach", _torch_chain(torch, leaves))]
    rows.append(("chain(clip_by_global_norm, ema, trace, scale)", _time(contenders, args.repeats)))

    # Rows 2 and 3: AdamW in place, with and without the clip.
    for clip in (True, False):
        adamw = nb.adamw(LR, weight_decay=WD)
        tx = nb.chain(nb.clip_by_global_norm(MAX_NORM), adamw) if clip else adamw
        torch_leaves = [np.array(x, copy=True) for x in leaves]
        name = "chain(clip_by_global_norm, adamw) in place" if clip else "adamw in place"
        label = "clip_grad_norm_ + AdamW(fused)" if clip else "AdamW(fused)"
        contenders = [
            ("numbaccum step_", _ours_step(tx, params, grads)),
            (f"torch {label}", _torch_adamw(torch, pleaves, torch_leaves, clip)),
        ]
        rows.append((name, _time(contenders, args.repeats)))

    # Row 4: the emitting step of MultiSteps against a copy of the bytes it moves.
    inner = nb.chain(nb.clip_by_global_norm(MAX_NORM), nb.adamw(LR))
    ms = nb.MultiSteps(inner, 4)
    p = nb.FlatTree.from_tree(params)
    ms_box = [ms.init(p)]
    # The bytes of the emitting step (the state as it is before it), as `explain` plans them.
    nbytes = nb.explain(ms, p, ms_box[0]._replace(mini_step=np.int32(3))).total * n

    def emitting() -> float:
        for _ in range(3):
            _, ms_box[0] = ms.update(grads, ms_box[0], p)
        t = time.perf_counter()
        _, ms_box[0] = ms.update(grads, ms_box[0], p)
        return time.perf_counter() - t

    src = np.ones(int(nbytes // 8), np.float32)  # read + write: half the bytes each way
    dst = np.empty_like(src)
    ops = ops_for(src)

    def copy() -> None:
        ops.scale_(dst, src, ONE)

    contenders = [("update", emitting), ("copy of the same bytes", copy)]
    rows.append(("MultiSteps(chain(clip, adamw), 4) emitting step", _time(contenders, args.repeats)))
    print(f"(explain: the emitting step moves {nbytes / n:.1f} B/param)")

    print()
    print("| workload | contender | median ms | min-max ms | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for name, results in rows:
        base = results[-1][1]
        for label, med, lo, hi in results:
            span = f"{lo * 1e3:.1f}-{hi * 1e3:.1f}"
            print(f"| {name} | {label} | {med * 1e3:.1f} | {span} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
