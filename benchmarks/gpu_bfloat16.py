"""Issue 25's bfloat16 table on a GPU: the same work on bfloat16 and float32 PyTorch CUDA tensors.

    python benchmarks/gpu_bfloat16.py [--repeats 20] [--json FILE]

Rows (GPT-2-small shapes, 124M params, 148 leaves, each a separate ``torch`` tensor as a model
holds them; numbaccum packs them with one launch per dtype group and writes ``step_``'s params back
the same way):

1. ``clip_by_global_norm(1.0).update`` on float32 and on bfloat16 gradients (out of place, as
   optax's), against ``torch.nn.utils.clip_grad_norm_(foreach=True)`` on each (in place).
2. ``step_(chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=1e-2)))`` on float32 and
   bfloat16 params, gradients and moments, against ``clip_grad_norm_(foreach=True)`` +
   ``torch.optim.AdamW(fused=True)`` on each.

Also the same two numbaccum rows on FlatTrees on the device (views of one buffer per dtype: no
packing), and what ``explain`` says each moves per parameter. Calls alternate A, B, C, ... after a
warm-up and each is timed with CUDA events; rows report the median (and min-max) per call and the
ratio to float32's numbaccum contender. The bar: bfloat16 <= 0.6x float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import numbaccum as nba  # noqa: E402
from numbaccum.bench import workloads  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
LR, WD, MAX_NORM = 1e-3, 1e-2, 1.0
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def alternated(contenders: list[tuple[str, object]], repeats: int) -> list[tuple[str, float, float, float]]:
    """``(label, median, min, max)`` seconds per call of each contender, called in turn."""
    for _, fn in contenders:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {label: [] for label, _ in contenders}
    for _ in range(repeats):
        for label, fn in contenders:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[label].append(a.elapsed_time(b) / 1e3)
    return [(label, statistics.median(t), min(t), max(t)) for label, t in times.items()]


def trees(shapes: dict, dtype: str, seed: int, scale: float = 1.0) -> tuple[dict, nba.FlatTree]:
    """A tree of separate CUDA tensors of ``dtype`` and a FlatTree on the device of the same
    values (drawn in float32 on the host, rounded to nearest even by each library)."""
    host = workloads.make_tree(shapes, np.float32, seed=seed, scale=scale)
    tensors = nba.tree_map(lambda x: torch.from_numpy(np.asarray(x)).to("cuda").to(TORCH[dtype]), host)
    flat = nba.FlatTree.from_tree(
        nba.tree_map(lambda x: np.asarray(x).astype(np.dtype(dtype) if dtype != "bfloat16" else BF16), host)
    )
    return tensors, nba.to_device(flat)


def nba_clip(grads):
    tx = nba.clip_by_global_norm(MAX_NORM)
    box = [tx.init(grads)]

    def call() -> None:
        _, box[0] = tx.update(grads, box[0])

    return call


def nba_step(params, grads):
    tx = nba.chain(nba.clip_by_global_norm(MAX_NORM), nba.adamw(LR, weight_decay=WD))
    box = [tx.init(params)]

    def call() -> None:
        box[0] = nba.step_(tx, grads, box[0], params)

    return call


def torch_clip(params: dict, grads: dict):
    holders = [p.detach().clone().requires_grad_() for p in nba.tree_flatten(params)[0]]
    for h, g in zip(holders, nba.tree_flatten(grads)[0]):
        h.grad = g

    def call() -> None:
        torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, foreach=True)

    return call


def torch_step(params: dict, grads: dict):
    holders = [p.detach().clone().requires_grad_() for p in nba.tree_flatten(params)[0]]
    for h, g in zip(holders, nba.tree_flatten(grads)[0]):
        h.grad = g
    opt = torch.optim.AdamW(holders, lr=LR, weight_decay=WD, fused=True)

    def call() -> None:
        torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, foreach=True)
        opt.step()

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = workloads.gpt2_small_shapes()
    n = workloads.count_params(shapes)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {n / 1e6:.1f}M params")
    made = {dt: (trees(shapes, dt, 0), trees(shapes, dt, 1, 1e-2)) for dt in ("bfloat16", "float32")}
    tensors = {dt: (p[0], g[0]) for dt, (p, g) in made.items()}
    flats = {dt: (p[1], g[1]) for dt, (p, g) in made.items()}
    for dt, (p, g) in flats.items():
        c = nba.explain(nba.clip_by_global_norm(MAX_NORM), g).total
        s = nba.explain(
            nba.chain(nba.clip_by_global_norm(MAX_NORM), nba.adamw(LR, weight_decay=WD)), p, apply=True
        )
        print(f"(explain, {dt}: clip_by_global_norm {c:.1f} B/param, step_ {s.total:.1f} B/param)")
    rows = []
    for op, ours, theirs in (
        ("clip_by_global_norm(1.0)", lambda p, g: nba_clip(g), torch_clip),
        ("step_(chain(clip_by_global_norm, adamw))", nba_step, torch_step),
    ):
        contenders = []
        for dt in ("bfloat16", "float32"):
            p, g = tensors[dt]
            contenders.append((f"{dt} torch tensors", ours(p, g)))
            contenders.append((f"{dt} FlatTree on the device", ours(*flats[dt])))
            contenders.append((f"{dt} torch (foreach / fused)", theirs(p, g)))
        res = alternated(contenders, args.repeats)
        base = next(med for label, med, _, _ in res if label == "float32 torch tensors")
        rows += [
            dict(op=op, impl=label, ms=med * 1e3, lo=lo * 1e3, hi=hi * 1e3, ratio=med / base)
            for label, med, lo, hi in res
        ]
        torch.cuda.empty_cache()
    print("| operation | contender | median ms | min-max ms | ratio to float32 torch tensors |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['op']} | {r['impl']} | {r['ms']:.3f} | {r['lo']:.3f}-{r['hi']:.3f} | {r['ratio']:.2f}x |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
