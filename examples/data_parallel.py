"""Data-parallel training over MPI: the MLP of mlp.py, its data set sharded across ranks.

    pip install ".[mpi]"
    mpiexec -n 2 python examples/data_parallel.py

Every rank builds the same model and data set from the same seed, keeps every n-th example, and
computes gradients on mini-batches of its own shard. `MultiSteps` accumulates 4 of them locally;
on the 4th, `allreduce_mean` averages the accumulated gradients across ranks (one `Allreduce` per
bucket of a dtype buffer: here one, the model is small), and every rank clips and applies Adam to
the same bits. Rank 0 prints the loss over the whole data set; at the end every rank checks that
its parameters are bitwise the same as everyone else's. On one rank (`python
examples/data_parallel.py`) it is plain gradient accumulation.
"""

import argparse
import hashlib

import numpy as np

import numbaccum as nba
from numbaccum.distributed import allreduce_mean


def main(
    steps: int = 400,
    batch: int = 32,
    seed: int = 0,
    comm=None,
    log_every: int = 100,
) -> float:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    # the same on every rank: the same model and data set
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2048, 8)).astype(np.float32)
    y = np.sin(x @ rng.standard_normal((8, 1))).astype(np.float32)
    params = nba.FlatTree.from_tree(
        {
            "w1": (rng.standard_normal((8, 64)) / np.sqrt(8)).astype(np.float32),
            "b1": np.zeros(64, np.float32),
            "w2": (rng.standard_normal((64, 1)) / 8).astype(np.float32),
            "b2": np.zeros(1, np.float32),
        }
    )
    x_mine, y_mine = x[rank::size], y[rank::size]  # this rank's shard of the data
    batches = np.random.default_rng([seed, rank])  # each rank its own mini-batches

    grads = params.zeros_like()
    # The average runs once per emitted step (every 4th), on the accumulated mean.
    opt = nba.MultiSteps(
        nba.chain(
            allreduce_mean(comm), nba.clip_by_global_norm(1.0), nba.adam(1e-3)
        ),
        4,
    )
    # checks that every rank has the same tree and k (small collectives)
    state = opt.init(params)
    p, g = params.tree, grads.tree

    def loss_and_grads(xb, yb):
        h = np.maximum(xb @ p["w1"] + p["b1"], 0)
        err = h @ p["w2"] + p["b2"] - yb
        d_out = 2 * err / len(xb)
        g["w2"][...] = h.T @ d_out
        g["b2"][...] = d_out.sum(0)
        d_h = (d_out @ p["w2"].T) * (h > 0)
        g["w1"][...] = xb.T @ d_h
        g["b1"][...] = d_h.sum(0)
        return float(np.mean(err**2))

    def loss():  # over the whole data set: each rank's shard, summed across ranks
        total = comm.allreduce(loss_and_grads(x_mine, y_mine) * len(x_mine))
        return total / len(x)

    for step in range(steps):
        idx = batches.integers(0, len(x_mine), batch)
        loss_and_grads(x_mine[idx], y_mine[idx])
        updates, state = opt.update(grads, state, params)
        nba.apply_updates_(params, updates)
        if log_every and (step + 1) % log_every == 0:
            current = loss()
            if rank == 0:
                print(f"step {step + 1}: loss {current:.4f}", flush=True)

    final = loss()
    buffers = b"".join(b.tobytes() for b in params.buffers.values())
    digest = hashlib.sha256(buffers).hexdigest()
    same = len(set(comm.allgather(digest))) == 1
    if rank == 0:
        print(f"final training loss: {final:.4f} on {size} rank(s)")
        print(f"same parameters on every rank: {same}")
    if not same:
        raise SystemExit("the ranks' parameters differ")
    return final


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    main(steps=parser.parse_args().steps)
