"""Sharded optimizer state (ZeRO stage 1) against the replicated data-parallel step, over MPI.

    NUMBA_NUM_THREADS=1 mpiexec -n 2 python benchmarks/mpi_shard.py [--scale 0.5] [--rounds 6]
        [--repeats 2] [--bucket-bytes N] [--memory-only] [--breakdown] [--json FILE]

Contenders (every rank runs both; they alternate within each round, A B A B ..., never in
blocks, so that drift in the machine's state hits both alike), each timed between two barriers
(a time is the slowest rank's), on GPT-2-small shapes (148 float32 leaves, 124M params at
``--scale 1``), the same gradients each step:

  DP step     ``numbaccum.step_(chain(allreduce_mean(), adamw(1e-3)), grads, state, params)``:
              one ``Allreduce`` per bucket, Adam's fused step on the whole model on every rank.
  ZeRO-1 step ``numbaccum.step_(shard(adamw(1e-3)), grads, state, params)``: AdamW is per
              element, so the even partition: one ``Reduce_scatter`` per bucket (each rank
              receives the sum of its ~1/n of the bucket), this rank's pieces of the params
              copied into a contiguous buffer, Adam's fused step there, one ``Allgatherv`` per
              bucket into the params.

``--breakdown`` then times the pieces of both steps the same way (alternated, between
barriers): the DP step's ``allreduce_sum_`` and its AdamW step on the whole model; the sharded
step's reduce-scatter, params copy, AdamW step on the shard and all-gather (the shard's internal
methods, as its step calls them).

Memory, per rank, of each contender's state (MB = 10**6 bytes): the optimizer state (AdamW's two
moments) and the buffers the collectives use (``allreduce_mean``'s model-sized buffer; the
shard's receive buffer of its part, and with the even partition its copy of its params pieces).
``--memory-only`` builds the states and reports memory without timing (for the full model on a
machine short of time). Markdown on rank 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import statistics
import time

import numpy as np
from mpi4py import MPI

import numbaccum as nba
from numbaccum import distributed as dist
from numbaccum.bench.workloads import WORKLOADS, make_tree, map_shapes


def _scaled(shapes, scale):
    if scale == 1.0:
        return shapes
    return map_shapes(lambda s: (max(1, int(s[0] * scale)), *s[1:]) if s else s, shapes)


def _flat_bytes(x) -> int:
    """Bytes of every FlatTree buffer a state holds."""
    if isinstance(x, nba.FlatTree):
        return sum(b.nbytes for b in x.buffers.values())
    if isinstance(x, (tuple, list)):
        return sum(_flat_bytes(v) for v in x)
    if isinstance(x, dict):
        return sum(_flat_bytes(v) for v in x.values())
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls of a contender per round")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--workload", default="gpt2_small", choices=sorted(WORKLOADS))
    ap.add_argument("--bucket-bytes", type=int, default=None)
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="also time the pieces of both steps")
    ap.add_argument(
        "--with-leaves", action="store_true", help="a third contender: the shard forced to whole leaves"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    shapes = _scaled(WORKLOADS[args.workload](), args.scale)
    like = make_tree(shapes, np.float32, seed=0, scale=0.02)
    grads = nba.FlatTree.from_tree(make_tree(shapes, np.float32, seed=1 + rank, scale=1e-3))
    size = grads.layout.size

    dp_tx = nba.chain(dist.allreduce_mean(bucket_bytes=args.bucket_bytes), nba.adamw(1e-3))
    zero = dist.shard(nba.adamw(1e-3), bucket_bytes=args.bucket_bytes)
    dp_params, z_params = nba.FlatTree.from_tree(like), nba.FlatTree.from_tree(like)
    states = {"DP step": dp_tx.init(dp_params), "ZeRO-1 step": zero.init(z_params)}
    if args.with_leaves:  # the whole-leaf partition, which adamw would not get: forced
        leaves = dist.shard(nba.adamw(1e-3), bucket_bytes=args.bucket_bytes)
        leaves.partition = "leaves"
        l_params = nba.FlatTree.from_tree(like)
        states["ZeRO-1 step, whole leaves"] = leaves.init(l_params)
    del like
    memory = {
        "DP step": (_flat_bytes(states["DP step"][1]), _flat_bytes(states["DP step"][0])),
        # receive buffer (and the even partition's params pieces): about, until a step made them
        "ZeRO-1 step": (
            _flat_bytes(states["ZeRO-1 step"].inner),
            size // n * 4 * (2 if zero.partition == "even" else 1),
        ),
    }
    steps = {
        "DP step": lambda s: nba.step_(dp_tx, grads, s, dp_params),
        "ZeRO-1 step": lambda s: nba.step_(zero, grads, s, z_params),
    }
    if args.with_leaves:
        steps["ZeRO-1 step, whole leaves"] = lambda s: nba.step_(leaves, grads, s, l_params)
        memory["ZeRO-1 step, whole leaves"] = (_flat_bytes(states["ZeRO-1 step, whole leaves"].inner), 0)
    names = list(steps)
    samples: dict[str, list[float]] = {k: [] for k in names}
    if not args.memory_only:
        for k in names:  # warm-up: kernels compiled or loaded, pages touched, MPI set up
            states[k] = steps[k](states[k])
        # the receive buffer exists now: its true size
        kept = zero._plan(dp_params.layout).local.__dict__.get("bufs", {})
        if "summed" in kept:
            made = _flat_bytes(kept["summed"]) + _flat_bytes(kept.get("mine"))
            memory["ZeRO-1 step"] = (memory["ZeRO-1 step"][0], made)
        if args.with_leaves:
            kept = leaves._plan(dp_params.layout).local.__dict__.get("bufs", {})
            k = "ZeRO-1 step, whole leaves"
            memory[k] = (memory[k][0], _flat_bytes(kept.get("summed")))
        for _ in range(args.rounds):
            for _ in range(args.repeats):
                for k in names:  # A B A B: alternated, never in blocks
                    comm.Barrier()
                    t0 = time.perf_counter()
                    states[k] = steps[k](states[k])
                    comm.Barrier()
                    samples[k].append(time.perf_counter() - t0)
        same = comm.allgather(hashlib.sha256(z_params.buffers[np.dtype(np.float32)].tobytes()).hexdigest())
        assert same == [same[0]] * n, "ZeRO-1 replicas differ"
    pieces = _breakdown(comm, zero, grads, dp_params, z_params, states, args) if args.breakdown else None
    mem_all = comm.gather(memory, root=0)
    if rank != 0:
        return 0
    print(
        f"{_dt.date.today()} {platform.node()} ({os.cpu_count()} cores), {n} ranks, {args.workload} "
        f"x{args.scale} ({size / 1e6:.1f}M float32), NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS')}"
    )
    print(f"mpi: {dist.describe()}")
    print(f"shard partition: {zero.partition}")
    if not args.memory_only:
        dp = samples["DP step"]
        print("\n| per step | median ms | min ms | max ms | vs DP step (median of per-pair ratios) |")
        print("| --- | --- | --- | --- | --- |")
        for k in names:
            xs = samples[k]
            ratios = [a / b for a, b in zip(xs, dp)]
            print(
                f"| {k} | {1e3 * statistics.median(xs):.0f} | {1e3 * min(xs):.0f} | {1e3 * max(xs):.0f} "
                f"| {statistics.median(ratios):.2f} |"
            )
    if pieces:
        print("\n| piece | median ms | min ms | max ms |")
        print("| --- | --- | --- | --- |")
        for k, xs in pieces.items():
            print(f"| {k} | {1e3 * statistics.median(xs):.1f} | {1e3 * min(xs):.1f} | {1e3 * max(xs):.1f} |")
    print("\n| per rank | optimizer state MB | collective buffers MB |")
    print("| --- | --- | --- |")
    for k in names:
        for r, m in enumerate(mem_all):
            print(f"| {k}, rank {r} | {m[k][0] / 1e6:.1f} | {m[k][1] / 1e6:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            out = {"ranks": n, "scale": args.scale, "samples": samples, "memory": mem_all, "pieces": pieces}
            json.dump(out, f, indent=1)
    return 0


def _breakdown(comm, zero, grads, dp_params, z_params, states, args) -> dict[str, list[float]]:
    """The pieces of both steps, each timed between barriers, alternated within each round (the
    params and states advance: these are timings, not a run)."""
    from numbaccum.passes import step_ as inner_step_
    from numbaccum.sharded import _EMPTY as empty

    plan = zero._plan(z_params.layout)
    summed = plan.kept("summed", plan.shard)
    mine = plan.kept("mine", plan.shard)
    total = grads.zeros_like()
    adamw = nba.adamw(1e-3)
    whole = [adamw.init(dp_params)]
    zstate = states["ZeRO-1 step"]
    inner = [zstate.inner]
    chain = zero._chains[plan.half]

    def zero_step() -> None:
        inner[0] = inner_step_(chain, summed, (empty, inner[0]), mine)[1]

    def dp_step() -> None:
        whole[0] = nba.step_(adamw, grads, whole[0], dp_params)

    pieces = {
        "DP: allreduce_sum_ of the gradients": lambda: dist.allreduce_sum_(
            grads, total, comm, bucket_bytes=args.bucket_bytes
        ),
        "DP: AdamW step, whole model": dp_step,
        "ZeRO-1: reduce-scatter": lambda: zero._reduce_scatter(plan, grads, summed),
        "ZeRO-1: copy of this rank's params pieces": lambda: plan.take(z_params, mine),
        "ZeRO-1: AdamW step on the shard": zero_step,
        "ZeRO-1: all-gather into the params": lambda: (
            zero._allgather_even(plan, mine, z_params) if plan.even else zero._allgather(plan, z_params)
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in pieces}
    for f in pieces.values():  # warm-up
        f()
    for _ in range(args.rounds):
        for _ in range(args.repeats):
            for k, f in pieces.items():
                comm.Barrier()
                t0 = time.perf_counter()
                f()
                comm.Barrier()
                times[k].append(time.perf_counter() - t0)
    return times


if __name__ == "__main__":
    raise SystemExit(main())
