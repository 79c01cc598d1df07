"""Data-parallel cost over MPI on GPT-2-small shapes: numbaccum's collective against mpi4py's own.

    mpiexec -n 2 python benchmarks/mpi_allreduce.py [--rounds 4] [--repeats 2] [--scale 1.0] [--json FILE]
        [--pieces 1,2,4,8,16] [--calibrate] [--contenders NAME,...]

Side by side in one run (every rank runs every contender; contenders alternate within each
round, A B C ... A B C ..., so that drift in the machine's state hits them all alike), each
timed between two barriers (so a time is the slowest rank's):

  floor         ``comm.Allreduce(buf, out)`` of one float32 buffer of the whole model's size:
                what MPI itself takes to sum 124M floats in one message (mpi4py, no numbaccum).
  mpi4py N MiB  the same buffer in pieces of N MiB, one ``comm.Allreduce`` each, as a user would
                write it (``--pieces`` lists the sizes): MPI libraries pick their algorithm by
                message size, so the pieces can beat the one message. The best of them is the
                floor numbaccum's collective is held to.
  ours          ``allreduce_sum_(grads, out)``: the collective ``allreduce_mean`` runs on the
                FlatTree's dtype buffers (here one, float32), in buckets of the size in use
                (``numbaccum.distributed.describe()`` says which, printed above the table;
                ``--calibrate`` runs ``calibrate()`` first, so that its choice is in use).
  ours N MiB    the same with ``bucket_bytes=N MiB``: against ``mpi4py N MiB``, what numbaccum's
                layer costs at one bucket size.
  ours+divide   ``allreduce_mean().update(grads, state)`` then ``apply_updates_``: the collective
                plus the division by the number of ranks, which a lone update must apply (in a
                chain it rides on the next stage's kernel instead), and the apply.
  ours mean     ``allreduce_mean().update(grads, state)`` alone (the mean returned, then dropped).
  divided N MiB ``mpi4py N MiB`` then ``np.divide(out, n, out=out)``: the mean as a user writes it;
                the best of them is what ``ours mean`` is held to (issue 43: at most 1.05x).
  per-leaf      ``comm.Allreduce`` leaf by leaf (148 messages): what a naive loop does.
  reduce+bcast  ``Reduce`` to rank 0 then ``Bcast``: one way to fix the reduction order by hand.
  allgather+sum ``Allgather`` every rank's buffer and add them in rank order: the other way.
  step local    ``chain(clip_by_global_norm(1.0), adam(1e-3))`` update + ``apply_updates_``,
                each rank on its own (the step without the collective, every rank at once).
  step DP       ``chain(allreduce_mean(), clip_by_global_norm(1.0), adam(1e-3))`` update +
                ``apply_updates_``: one data-parallel step.
  step DP unfused   ``step DP`` stage by stage (``NUMBACCUM_FUSE=0``): the 1/n settled in a
                pass of its own, then the clip's norm pass (the path before issue 27, item 2;
                its own params, which it steps with the same gradients).
  norm pass     ``global_norm(grads)``: the clip's reduction pass over the gradients, alone (what
                the fused step saves by reducing each bucket as it arrives).
  adam local, adam DP   the same two without the clip: there the division by the number of
                ranks rides on Adam's kernel (and with the clip, since issue 27's item 2, too).

Run it with ``mpiexec -n 1`` too for the step of a lone process. Numbers print as a Markdown
table on rank 0; ``--json`` keeps every sample. ``--scale`` shrinks the model (every leaf's first
dimension) for machines short of memory: each rank holds about 12 model-sized float32 buffers
(params, grads, two Adam moments per optimizer, workspaces, the floor's buffers).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import statistics
import sys
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


def _per_round(samples: list[float], repeats: int) -> list[float]:
    """The median of each round's ``repeats`` samples."""
    return [statistics.median(samples[i : i + repeats]) for i in range(0, len(samples), repeats)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls of a contender per round")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--workload", default="gpt2_small", choices=sorted(WORKLOADS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--contenders", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--pieces", default="1,2,4,8,16", help="MiB per message of the 'mpi4py N MiB' contenders")
    ap.add_argument("--calibrate", action="store_true", help="run calibrate() first: its choice")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    calibration = dist.calibrate(comm) if args.calibrate else None
    shapes = _scaled(WORKLOADS[args.workload](), args.scale)
    params = nba.FlatTree.from_tree(make_tree(shapes, np.float32, seed=0, scale=0.02))
    grads = nba.FlatTree.from_tree(make_tree(shapes, np.float32, seed=1 + rank, scale=1e-3))
    n = params.layout.size
    big = grads.buffers[np.dtype(np.float32)]
    flat_out = grads.zeros_like()  # the sums land here (every contender's sum has the same bits)
    floor_out = np.empty_like(big)
    local_params = params.copy()  # stepped with this rank's own gradients: differs between ranks

    def floor():
        comm.Allreduce(big, floor_out, op=MPI.SUM)

    def pieces(mib):
        step = (mib << 20) // big.itemsize

        def run():
            for lo in range(0, n, step):
                comm.Allreduce(big[lo : lo + step], floor_out[lo : lo + step], op=MPI.SUM)

        return run

    def pieces_divided(mib):
        run_pieces = pieces(mib)

        def run():  # what a user writes for a mean: the sum in pieces, then one division
            run_pieces()
            np.divide(floor_out, np.float32(size), out=floor_out)

        return run

    def mean_update():
        tx = dist.allreduce_mean(comm)
        state = [tx.init(grads)]

        def run():  # a lone update: the mean returned (dropped before the next one)
            _, state[0] = tx.update(grads, state[0])

        return run

    def ours():
        dist.allreduce_sum_(grads, flat_out, comm)

    def ours_at(bucket_bytes):
        return lambda: dist.allreduce_sum_(grads, flat_out, comm, bucket_bytes)

    def stepper(tx, p):
        state = [tx.init(p)]

        def step():
            updates, state[0] = tx.update(grads, state[0], p)
            nba.apply_updates_(p, updates)

        return step

    def unfused(step):
        """``step`` stage by stage (``NUMBACCUM_FUSE=0``): the 1/n settled in a pass, then the
        clip's own norm pass, as before the norm rode on the collective (issue 27, item 2)."""

        def run():
            os.environ["NUMBACCUM_FUSE"] = "0"
            try:
                step()
            finally:
                del os.environ["NUMBACCUM_FUSE"]

        return run

    def per_leaf():
        leaves, out_leaves = grads.leaves, flat_out.leaves

        def run():
            for x, y in zip(leaves, out_leaves):
                comm.Allreduce(x, y, op=MPI.SUM)

        return run

    def reduce_bcast():
        comm.Reduce(big, floor_out, op=MPI.SUM, root=0)
        comm.Bcast(floor_out, root=0)

    def allgather_sum():
        gathered = np.empty((size, n), np.float32)
        summed = flat_out.buffers[np.dtype(np.float32)]

        def run():
            comm.Allgather(big, gathered)
            np.copyto(summed, gathered[0])
            for r in range(1, size):
                np.add(summed, gathered[r], out=summed)

        return run

    def clip_adam(*first):
        return nba.chain(*first, nba.clip_by_global_norm(1.0), nba.adam(1e-3))

    # name -> a function that allocates what the contender needs and returns it, so that a
    # run of a few contenders holds only their buffers
    factories = {
        "floor": lambda: floor,
        "ours": lambda: ours,
        "ours+divide": lambda: stepper(dist.allreduce_mean(comm), grads.zeros_like()),
        "ours mean": mean_update,
        "per-leaf": per_leaf,
        "reduce+bcast": lambda: reduce_bcast,
        "allgather+sum": allgather_sum,
        "step local": lambda: stepper(clip_adam(), local_params),
        "step DP": lambda: stepper(clip_adam(dist.allreduce_mean(comm)), params),
        "step DP unfused": lambda: unfused(stepper(clip_adam(dist.allreduce_mean(comm)), params.copy())),
        "norm pass": lambda: lambda: nba.global_norm(grads),
        "adam local": lambda: stepper(nba.adam(1e-3), local_params),
        "adam DP": lambda: stepper(nba.chain(dist.allreduce_mean(comm), nba.adam(1e-3)), params),
    }
    piece_sizes = [int(m) for m in args.pieces.split(",") if m]
    for mib in piece_sizes:
        factories[f"mpi4py {mib} MiB"] = lambda mib=mib: pieces(mib)
        factories[f"ours {mib} MiB"] = lambda mib=mib: ours_at(mib << 20)
        factories[f"divided {mib} MiB"] = lambda mib=mib: pieces_divided(mib)
    names = args.contenders.split(",") if args.contenders else list(factories)
    if size == 1:
        names = [k for k in names if "local" in k]
    contenders = {k: factories[k]() for k in names}
    for fn in contenders.values():  # warm-up: compiles the kernels, touches every buffer
        fn()
    comm.Barrier()
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            for _ in range(args.repeats):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                comm.Barrier()
                samples[name].append(time.perf_counter() - t0)

    if size > 1:  # the collectives agree with the floor, and the DP steps left identical params
        plain = any(k == "floor" or k.startswith("mpi4py ") for k in contenders)
        if plain and ("ours" in contenders or "per-leaf" in contenders):
            np.testing.assert_array_equal(flat_out.buffers[np.dtype(np.float32)], floor_out)
        digest = hashlib.sha256(params.buffers[np.dtype(np.float32)]).hexdigest()
        assert len(set(comm.allgather(digest))) == 1, "params differ between ranks"
    if rank != 0:
        return 0

    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    now = _dt.date.today().isoformat()
    threads = os.environ.get("NUMBA_NUM_THREADS", "default")
    print(
        f"mpi_allreduce -- {args.workload}, {size} rank(s), {n:,} float32 params in "
        f"{params.layout.num_leaves} leaves "
        f"({n * 4 / 1e6:.0f} MB); {now}; {platform.machine()} {os.cpu_count()} cpus; "
        f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}; NUMBA_NUM_THREADS={threads}; "
        f"{args.rounds} rounds x {args.repeats}; load average {os.getloadavg()[0]:.1f}\n"
    )
    print(f"numbaccum: {dist.describe()}")
    if calibration is not None:
        timed = ", ".join(f"{b >> 20} MiB {t * 1e3:.1f} ms" for b, t in calibration.seconds.items())
        print(f"calibrate() chose {calibration.bucket_bytes >> 20} MiB ({timed})")
    best = min((k for k in med if k.startswith("mpi4py ")), key=med.__getitem__, default=None)
    print(f"best plain bucket size: {best}\n" if best else "")
    print("| contender | median ms | min-max ms | vs floor | vs best mpi4py pieces |")
    print("| --- | --- | --- | --- | --- |")
    for k, v in samples.items():
        rel = f"{med[k] / med['floor']:.3f}" if "floor" in med else "-"
        rel_best = f"{med[k] / med[best]:.3f}" if best else "-"
        print(f"| {k} | {med[k]:.1f} | {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} | {rel} | {rel_best} |")
    divided = min((k for k in med if k.startswith("divided ")), key=med.__getitem__, default=None)
    if divided is not None and "ours mean" in med:  # a lone allreduce_mean().update: the mean
        print(f"ours mean / {divided} = {med['ours mean'] / med[divided]:.3f} (target <= 1.05)")
    base = best or "floor"  # the collective to beat: the best plain bucket size if measured
    ratios = [("ours", (base,), 1.05), ("ours", ("floor",), 1.05), ("step DP", ("step local", base), 1.10)]
    ratios.append(("adam DP", ("adam local", base), 1.10))
    ratios.append(("step DP unfused", ("step local", base), 1.10))
    for top, bottom, target in ratios:
        if top in med and all(b in med for b in bottom):
            value = med[top] / sum(med[b] for b in bottom)
            # the same ratio round by round (the contenders alternate: each round is a pair)
            rounds = [_per_round(samples[k], args.repeats) for k in (top, *bottom)]
            each = [t / sum(bs) for t, *bs in zip(*rounds)]
            spread = f"rounds {min(each):.3f}-{max(each):.3f}"
            print(f"{top} / ({' + '.join(bottom)}) = {value:.3f} ({spread}; target <= {target})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"ranks": size, "params": n, "date": now, "argv": sys.argv, "samples_s": samples}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
