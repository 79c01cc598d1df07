"""Issue 15 item 5: a tree of separate GPU arrays (CuPy arrays or PyTorch tensors, as users hold
them) against the same update on a FlatTree, per call, wall time between device
synchronisations (the host's cost is the point).

Rows, for GPT-2-small shapes (148 leaves, 124M float32) and for 2000 small leaves (5.2M):

- ``step_(chain(clip_by_global_norm(1.0), adamw(1e-3)), grads, state, params)`` with grads and
  params as separate arrays: packed with one launch per dtype group over a table of their
  addresses, params scattered back the same way (`numbaccum.cuda.leaves`);
- the same with the pointer table turned off (each leaf converted through numba's device-array
  wrapper and copied by a launch of its own: the path before);
- the same update on FlatTrees (the floor: nothing to pack);
- the host cost of reading the leaves' addresses alone (`numbaccum.arrays.device_pointers`),
  per leaf.

Calls alternate A, B, C, A, B, C, ...; medians. Needs a CUDA GPU with CuPy or PyTorch; it stops
with a clear message without one (no GPU was lent to the session that wrote it). With
``--kind numba`` it runs on numba device arrays, in numba's CUDA simulator too (``--scale``
small), which checks the script, not the speed.

    PYTHONPATH=. python benchmarks/gpu_leaves.py [--kind cupy|torch|numba] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import numbaccum as nb
from numbaccum import arrays
from numbaccum.bench import workloads
from numbaccum.bench.gpu import Clock


def _converter(kind: str) -> Callable[[np.ndarray], Any]:
    if kind == "cupy":
        import cupy

        return cupy.asarray
    if kind == "torch":
        import torch

        return lambda x: torch.as_tensor(x, device="cuda")
    from numba import cuda

    return cuda.to_device


def _alternate(contenders: list, repeats: int, clock: Clock) -> dict:
    for _, fn in contenders:
        fn()
        fn()
    times: list[list[float]] = [[] for _ in contenders]
    for _ in range(repeats):
        for (_, fn), ts in zip(contenders, times):
            ts.append(clock(fn))
    return {name: statistics.median(ts) for (name, _), ts in zip(contenders, times)}


class _NoTable:
    """Context: the pointer table off (the general path: a conversion and a launch per leaf)."""

    def __enter__(self) -> None:
        self._old = arrays.device_leaves, arrays.device_facts
        arrays.device_leaves = lambda tree, layout: None  # type: ignore[assignment]
        arrays.device_facts = lambda leaves: None  # type: ignore[assignment]

    def __exit__(self, *exc: Any) -> None:
        arrays.device_leaves, arrays.device_facts = self._old


def _rows(title: str, shapes: Any, conv: Callable, repeats: int, clock: Clock) -> None:
    host_p = workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2)
    host_g = workloads.make_tree(shapes, np.float32, seed=2, scale=1e-2)
    n_leaves, n = workloads.count_leaves(shapes), workloads.count_params(shapes)
    sep_p, sep_g = nb.tree_map(conv, host_p), nb.tree_map(conv, host_g)
    flat_p, flat_g = nb.to_device(nb.FlatTree.from_tree(host_p)), nb.to_device(nb.FlatTree.from_tree(host_g))

    def make() -> Any:
        return nb.chain(nb.clip_by_global_norm(1.0), nb.adamw(1e-3))

    txs = {"table": make(), "per leaf": make(), "flat": make()}
    states = {"table": txs["table"].init(sep_p), "per leaf": txs["per leaf"].init(sep_p)}
    states["flat"] = txs["flat"].init(flat_p)

    def step(name: str, g: Any, p: Any) -> Callable[[], None]:
        def call() -> None:
            states[name] = nb.step_(txs[name], g, states[name], p)

        return call

    def per_leaf() -> None:
        with _NoTable():
            step("per leaf", sep_g, sep_p)()

    contenders = [
        ("separate arrays, pointer table", step("table", sep_g, sep_p)),
        ("separate arrays, a conversion and a launch per leaf (before)", per_leaf),
        ("FlatTree (nothing to pack)", step("flat", flat_g, flat_p)),
    ]
    got = _alternate(contenders, repeats, clock)
    layout = nb.FlatTree.from_tree(host_p).layout
    t = time.perf_counter()
    for _ in range(20):
        arrays.device_pointers(sep_g, layout)
    per_leaf_us = (time.perf_counter() - t) / 20 / n_leaves * 1e6
    floor = got["FlatTree (nothing to pack)"]
    print(f"\n{title}: {n_leaves} leaves, {n / 1e6:.1f}M float32; step_(chain(clip, adamw))")
    print("| contender | median ms per call | vs FlatTree |")
    print("| --- | --- | --- |")
    for name, sec in got.items():
        print(f"| {name} | {sec * 1e3:.3f} | {sec / floor:.2f}x |")
    print(f"reading the leaves' addresses: {per_leaf_us:.2f} us a leaf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["cupy", "torch", "numba"], default="cupy")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each leaf's rows")
    args = ap.parse_args()
    from numba import cuda

    if not cuda.is_available():
        sys.exit("gpu_leaves.py needs a CUDA GPU (numba-cuda sees none); nothing was measured")
    conv = _converter(args.kind)
    clock = Clock(wall=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# GPU trees of separate arrays ({args.kind}), {when}")

    def shrink(shape: tuple) -> tuple:
        return shape if not shape or args.scale >= 1 else (max(1, int(shape[0] * args.scale)), *shape[1:])

    gpt2 = workloads.map_shapes(shrink, workloads.gpt2_small_shapes())
    _rows("GPT-2-small shapes", gpt2, conv, args.repeats, clock)
    small = workloads.map_shapes(shrink, workloads.many_small_shapes())
    _rows("2000 small leaves", small, conv, args.repeats, clock)


if __name__ == "__main__":
    main()
