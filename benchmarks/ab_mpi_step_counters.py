"""What the step counters' collective costs a data-parallel step: two versions of numbaccum in one
MPI run, alternated step by step (old, new, new, old, ...), so that the machine's drift hits both.

Issue 42, item 9: each update of ``allreduce_mean`` (and each `shard` step) first sends the ranks'
step counters, one ``Allreduce`` of 20 int64 (`numbaccum.lockstep`). Set up the version before it
as a package of another name (as for benchmarks/ab_versions.py), then run on two ranks:

    mkdir -p /tmp/oldpkg && git archive <commit> numbaccum | tar -x -C /tmp/oldpkg
    mv /tmp/oldpkg/numbaccum /tmp/oldpkg/numbaccum_old
    NUMBA_NUM_THREADS=1 mpiexec -n 2 python benchmarks/ab_mpi_step_counters.py [--rounds 40]

Each contender is timed between two barriers (a time is the slowest rank's): ``dp``, one
``chain(allreduce_mean(), clip_by_global_norm(1.0), adam(1e-3))`` step_; ``shard``, one
``shard(adamw(1e-3))`` step_; ``counters``, the new version's counters collective alone. Printed
on rank 0: the medians, and the median over rounds of each round's new / old ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.environ.get("NUMBACCUM_OLD_PATH", "/tmp/oldpkg"))
import numbaccum_old as old  # noqa: E402
import numbaccum_old.distributed as old_dist  # noqa: E402

import numbaccum as new  # noqa: E402
import numbaccum.distributed as new_dist  # noqa: E402
from numbaccum import lockstep  # noqa: E402
from numbaccum.bench import workloads as W  # noqa: E402

WORKLOADS = {  # name -> (shapes, what it is)
    "tiny": (W.tiny_shapes, "100 params in 10 leaves"),
    "many_small": (W.many_small_shapes, "5.1M params in 2000 leaves"),
    "gpt2_small/8": (
        lambda: W.map_shapes(lambda s: (max(1, s[0] // 8), *s[1:]) if s else s, W.gpt2_small_shapes()),
        "GPT-2-small's leaves, first dimension / 8: 16M params in 148 leaves",
    ),
}


def steppers(lib, dist, comm, shapes, rank):
    params = lib.FlatTree.from_tree(W.make_tree(shapes, np.float32, seed=0, scale=0.02))
    grads = lib.FlatTree.from_tree(W.make_tree(shapes, np.float32, seed=1 + rank, scale=1e-3))
    dp = lib.chain(dist.allreduce_mean(comm), lib.clip_by_global_norm(1.0), lib.adam(1e-3))
    dp_state = [dp.init(params)]
    sharded = dist.shard(lib.adamw(1e-3), comm)
    sharded_params = params.copy()
    sh_state = [sharded.init(sharded_params)]

    def dp_step():
        dp_state[0] = lib.step_(dp, grads, dp_state[0], params)

    def shard_step():
        sh_state[0] = sharded.step_(grads, sh_state[0], sharded_params)

    return {"dp": dp_step, "shard": shard_step}


def timed(comm, fn):
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    counters = (3, 2, 1)  # a state's count and a MultiSteps' k and gradient step
    describe = lambda: ["count 3", "k 2 at 1"]  # noqa: E731
    lines = []
    for name in args.workloads.split(","):
        shapes = WORKLOADS[name][0]()
        a = steppers(old, old_dist, comm, shapes, rank)
        b = steppers(new, new_dist, comm, shapes, rank)
        for fn in (*a.values(), *b.values()):  # warm-up: compiles, touches every buffer
            fn()
            fn()
        samples = {f"{k} {v}": [] for k in a for v in ("old", "new")}
        samples["counters alone"] = []
        for r in range(args.rounds):
            for k in a:
                order = (("old", a[k]), ("new", b[k])) if r % 2 == 0 else (("new", b[k]), ("old", a[k]))
                for v, fn in order:
                    samples[f"{k} {v}"].append(timed(comm, fn))
            samples["counters alone"].append(
                timed(comm, lambda: lockstep.check_in_step(comm, counters, describe, "bench"))
            )
        if rank == 0:
            lines.append(f"\n{name} ({WORKLOADS[name][1]}), {comm.Get_size()} ranks, {args.rounds} rounds")
            lines.append("| contender | median ms | min ms |")
            lines.append("| --- | --- | --- |")
            for k, v in samples.items():
                lines.append(f"| {k} | {statistics.median(v) * 1e3:.3f} | {min(v) * 1e3:.3f} |")
            for k in a:
                ratios = [n / o for n, o in zip(samples[f"{k} new"], samples[f"{k} old"])]
                q = statistics.quantiles(ratios, n=4)
                lines.append(
                    f"{k}: new / old per round, median {statistics.median(ratios):.3f} "
                    f"(quartiles {q[0]:.3f}-{q[2]:.3f})"
                )
    if rank == 0:
        threads = os.environ.get("NUMBA_NUM_THREADS")
        print(f"load average {os.getloadavg()[0]:.1f}; NUMBA_NUM_THREADS={threads}")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
