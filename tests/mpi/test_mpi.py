"""numbaccum.distributed on every rank of MPI.COMM_WORLD.

CI runs this file on two ranks (``mpiexec -n 2 python -m pytest -p no:cacheprovider tests/mpi``,
in `.ci/run`, under a timeout) and again in numba's CUDA simulator; the plain ``python -m pytest``
runs it on one rank. Every rank runs the same tests in the same order, with the same seeds (no
hypothesis: its draws could differ between ranks), and checks its results after the collectives
so that a failing assertion cannot leave another rank waiting.
"""

import hashlib
import math
import os

import numpy as np
import pytest

import numbaccum as nba
from numbaccum import _config

MPI = pytest.importorskip("mpi4py.MPI")
from numbaccum import distributed as dist  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
multi_rank = pytest.mark.skipif(SIZE < 2, reason="needs mpiexec -n 2 or more")


def _bytes(x, out):
    """Appends the bytes of every array, FlatTree buffer and scalar of a tree or state."""
    if isinstance(x, nba.FlatTree):
        x = nba.to_host(x) if x.device else x
        for d in sorted(x.buffers, key=str):
            out.append(str(d).encode() + np.ascontiguousarray(x.buffers[d]).tobytes())
    elif isinstance(x, dict):
        for k in sorted(x):
            _bytes(x[k], out)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _bytes(v, out)
    elif x is not None:
        a = np.asarray(x.copy_to_host() if hasattr(x, "copy_to_host") else x)
        out.append(str(a.dtype).encode() + a.tobytes())


def assert_same_on_every_rank(*objs):
    parts: list = []
    for o in objs:
        _bytes(o, parts)
    mine = hashlib.sha256(b"|".join(parts)).hexdigest()
    every = COMM.allgather(mine)
    assert every == [every[0]] * SIZE, f"rank {RANK}: state differs between ranks"


def make_params():
    rng = np.random.default_rng(0)
    return {
        "dense": {"w": rng.standard_normal((64, 33)).astype(np.float32), "b": np.zeros(33, np.float32)},
        "out": [rng.standard_normal((33, 5)), np.float32(0.5) * np.ones((), np.float32)],
        "empty": np.zeros((0, 3), np.float32),
    }


def grads_of(rank, step, like=None):
    """Rank ``rank``'s gradients at ``step``: every rank can compute every rank's."""
    rng = np.random.default_rng([rank, step])
    like = make_params() if like is None else like
    return nba.tree_map(lambda p: (3 * rng.standard_normal(p.shape)).astype(p.dtype), like)


def mean_over_ranks(step, like=None):
    """The reference mean: summed in rank order in each leaf's dtype, then divided (float16:
    summed in float32 and rounded once), as the collective does on two ranks."""
    per_rank = [grads_of(r, step, like) for r in range(SIZE)]

    def mean(*xs):
        wide = np.dtype(np.float32) if xs[0].dtype == np.float16 else xs[0].dtype
        total = np.asarray(xs[0], wide).copy()
        for x in xs[1:]:
            total = total + np.asarray(x, wide)
        return (total / wide.type(SIZE)).astype(xs[0].dtype)

    return nba.tree_map(mean, *per_rank)


def assert_matches(ours, ref):
    """Bit for bit on up to two ranks (a + b is the only sum); within rounding on more, where the
    collective may add in another order than rank order."""
    for a, b in zip(nba.tree_flatten(ours)[0], nba.tree_flatten(ref)[0]):
        a = np.asarray(a.copy_to_host() if hasattr(a, "copy_to_host") else a)
        if SIZE <= 2:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_data_parallel_step_is_the_one_process_step_on_the_mean():
    params = nba.FlatTree.from_tree(make_params())
    tx = nba.chain(dist.allreduce_mean(), nba.clip_by_global_norm(1.0), nba.adam(1e-2))
    state = tx.init(params)
    ref_params = make_params()
    ref_tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2))
    ref_state = ref_tx.init(ref_params)
    grads = params.zeros_like()  # gradients computed straight into a FlatTree (no packing)
    for step in range(4):
        if step % 2:
            grads.assign_(grads_of(RANK, step))
            updates, state = tx.update(grads, state, params)
        else:
            updates, state = tx.update(grads_of(RANK, step), state, params)
        nba.apply_updates_(params, updates)
        ref_updates, ref_state = ref_tx.update(mean_over_ranks(step), ref_state, ref_params)
        ref_params = nba.apply_updates(ref_params, ref_updates)
        assert_same_on_every_rank(params, state)
        assert_matches(params.tree, ref_params)


def test_mixed_dtypes_float16_summed_in_float32():
    like = {
        "h": np.ones((7, 3), np.float16),
        "s": np.ones(11, np.float32),
        "d": np.ones((), np.float64),
    }
    tx = dist.allreduce_mean()
    state = tx.init(like)
    for step in range(2):
        g = grads_of(RANK, step, like)
        g["h"][0] = np.float16(60000.0)  # float16's max is 65504: the sum must not overflow
        updates, state = tx.update(g, state)
        ref = mean_over_ranks(step, like)
        ref["h"][0] = np.float16(60000.0)
        assert_matches(updates, ref)
        assert np.isfinite(updates["h"]).all()
        assert_same_on_every_rank(updates, state)


def test_a_pending_factor_from_the_previous_stage_is_applied_before_the_sum():
    tx = nba.chain(nba.scale(0.5), dist.allreduce_mean(), nba.scale(4.0))
    like = make_params()
    state = tx.init(like)
    updates, state = tx.update(grads_of(RANK, 0), state)
    ref = nba.tree_map(lambda m: m * m.dtype.type(2.0), mean_over_ranks(0))
    for a, b in zip(nba.tree_flatten(updates)[0], nba.tree_flatten(ref)[0]):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert_same_on_every_rank(updates)


def test_large_buffers_are_split_into_messages_of_at_most_max_count(monkeypatch):
    like = make_params()
    tx = dist.allreduce_mean()
    state = tx.init(like)
    whole, state = tx.update(grads_of(RANK, 0), state)
    whole = nba.tree_map(np.copy, whole)
    calls = []

    class Counting:
        def __init__(self, comm):
            self._comm = comm

        def Allreduce(self, send, recv, op=MPI.SUM):  # noqa: N802 - mpi4py's name
            calls.append(len(recv))
            assert len(recv) <= 7
            return self._comm.Allreduce(send, recv, op=op)

        def __getattr__(self, name):
            return getattr(self._comm, name)

    monkeypatch.setattr(_config, "MPI_MAX_COUNT", 7)
    split = dist.allreduce_mean(Counting(COMM))
    state2 = split.init(like)
    updates, state2 = split.update(grads_of(RANK, 0), state2)
    for a, b in zip(nba.tree_flatten(updates)[0], nba.tree_flatten(whole)[0]):
        np.testing.assert_array_equal(a, b)
    sizes = nba.FlatTree.from_tree(like).layout.group_sizes
    if SIZE > 1:
        assert len(calls) == sum(math.ceil(n / 7) for n in sizes) and sum(calls) == sum(sizes)
    flat = nba.FlatTree.from_tree(grads_of(RANK, 1))
    summed = dist.allreduce_sum_(flat.copy(), comm=COMM)
    ref = nba.tree_map(lambda *xs: sum(xs[1:], xs[0]), *[grads_of(r, 1) for r in range(SIZE)])
    assert_matches(summed.tree, ref)


class CountingComm:
    """COMM_WORLD, counting its Allreduce calls."""

    def __init__(self):
        self.allreduces = 0

    def Allreduce(self, *args, **kwargs):  # noqa: N802 - mpi4py's name
        self.allreduces += 1
        return COMM.Allreduce(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(COMM, name)


def test_multisteps_both_orders_give_the_same_params():
    k, steps = 3, 7
    inside, outside = CountingComm(), CountingComm()
    tx_in = nba.MultiSteps(nba.chain(dist.allreduce_mean(inside), nba.sgd(0.1, momentum=0.9)), k)
    tx_out = nba.chain(dist.allreduce_mean(outside), nba.MultiSteps(nba.sgd(0.1, momentum=0.9), k))
    p_in = nba.FlatTree.from_tree(make_params())
    p_out = nba.FlatTree.from_tree(make_params())
    s_in, s_out = tx_in.init(p_in), tx_out.init(p_out)
    for step in range(steps):
        g = grads_of(RANK, step)
        u, s_in = tx_in.update(g, s_in, p_in)
        nba.apply_updates_(p_in, u)
        u, s_out = tx_out.update(g, s_out, p_out)
        nba.apply_updates_(p_out, u)
    for a, b in zip(p_in.leaves, p_out.leaves):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Inside, acc_grads holds this rank's own gradients until the emitted step averages them:
    # everything else is replicated. Outside, the accumulator sums averaged gradients.
    replicated = (s_in.mini_step, s_in.gradient_step, s_in.inner_opt_state)
    assert_same_on_every_rank(p_in, replicated, p_out, s_out)
    groups = len(p_in.layout.group_dtypes)
    if SIZE > 1:  # one Allreduce per dtype buffer: per emitted step inside, per mini-step outside
        assert inside.allreduces == (steps // k) * groups
        assert outside.allreduces == steps * groups


@multi_rank
def test_a_rank_with_another_tree_raises_on_every_rank():
    params = make_params()
    if RANK == SIZE - 1:
        params["dense"]["b"] = np.zeros(34, np.float32)
    with pytest.raises(ValueError, match="differ between ranks") as e:
        nba.MultiSteps(nba.chain(dist.allreduce_mean(), nba.adam(1e-3)), 2).init(params)
    messages = COMM.allgather(str(e.value))
    assert messages == [messages[0]] * SIZE
    assert f"params['dense']['b']: (34,) float32 on rank {SIZE - 1}, (33,) float32 on rank 0" in messages[0]

    params = make_params()
    if RANK == SIZE - 1:
        params["extra"] = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="tree structure"):
        dist.allreduce_mean().init(params)
    params = make_params()
    if RANK == SIZE - 1:
        params["dense"]["w"] = params["dense"]["w"].astype(np.float64)
    with pytest.raises(ValueError, match="float64 on rank"):
        dist.allreduce_mean().init(params)
    dist.allreduce_mean().init(make_params())  # and the ranks are still in step


def shard_of(rank, leaves):
    return {f"leaf{i:02d}": x for i, x in enumerate(leaves) if i % SIZE == rank}


def model_leaves():
    rng = np.random.default_rng(7)
    shapes = [(5, 4), (), (13,), (0,), (3, 3, 3), (8,), (2, 9)]
    return [(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for s in shapes]


def test_sharded_global_norm_is_the_norm_of_the_whole_model():
    leaves = model_leaves()
    mine = shard_of(RANK, leaves)
    whole = {f"leaf{i:02d}": x for i, x in enumerate(leaves)}
    for ord in (2, 1, math.inf):
        for squared in (False, True):
            ours = dist.global_norm(mine, COMM, ord=ord, squared=squared)
            ref = nba.global_norm(whole, ord=ord, squared=squared)
            assert math.isclose(ours, ref, rel_tol=1e-12), (ord, squared, ours, ref)
            assert_same_on_every_rank(np.float64(ours))
    if SIZE == 1:  # a single rank is the plain norm, bit for bit
        assert dist.global_norm(whole, COMM) == nba.global_norm(whole)
    with pytest.raises(ValueError, match="ord"):
        dist.global_norm(mine, COMM, ord=3)


@pytest.mark.parametrize("max_norm", [1.0, 1e9, 0.0])
def test_sharded_clip_by_global_norm_clips_the_whole_model(max_norm):
    leaves = model_leaves()
    mine = shard_of(RANK, leaves)
    whole = {f"leaf{i:02d}": x for i, x in enumerate(leaves)}
    tx = nba.chain(dist.clip_by_global_norm(max_norm, COMM), nba.scale(1.0))
    updates, _ = tx.update(mine, tx.init(mine))
    ref, _ = nba.clip_by_global_norm(max_norm).update(whole, nba.EmptyState())
    for key, u in updates.items():
        np.testing.assert_allclose(u, ref[key], rtol=1e-6, atol=0)
    assert nba.global_norm(updates) <= max(max_norm, 0.0) * (1 + 1e-6) or max_norm == 1e9
    with pytest.raises(ValueError, match="max_norm"):
        dist.clip_by_global_norm(-1.0, COMM)


def test_one_rank_communicator_is_the_identity():
    tx = nba.chain(dist.allreduce_mean(MPI.COMM_SELF), nba.clip_by_global_norm(1.0))
    g = grads_of(RANK, 3)
    ours, _ = tx.update(g, tx.init(g))
    ref, _ = nba.clip_by_global_norm(1.0).update(g, nba.EmptyState())
    for a, b in zip(nba.tree_flatten(ours)[0], nba.tree_flatten(ref)[0]):
        np.testing.assert_array_equal(a, b)


def _cuda_usable():
    try:
        from numba import cuda

        return SIM or cuda.is_available()
    except Exception:
        return False


needs_cuda = pytest.mark.skipif(not _cuda_usable(), reason="no CUDA device and not in the simulator")


@needs_cuda
def test_cuda_buffers_are_staged_through_the_host():
    like = {"w": make_params()["dense"]["w"][:5], "h": np.ones(6, np.float16), "d": np.ones((2, 2))}
    params = nba.to_device(nba.FlatTree.from_tree(like))
    tx = nba.chain(dist.allreduce_mean(), nba.clip_by_global_norm(1.0), nba.sgd(0.1, momentum=0.5))
    state = tx.init(params)
    host_params = nba.FlatTree.from_tree(like)
    host_tx = nba.chain(dist.allreduce_mean(), nba.clip_by_global_norm(1.0), nba.sgd(0.1, momentum=0.5))
    host_state = host_tx.init(host_params)
    for step in range(2):
        g = grads_of(RANK, step, like)
        updates, state = tx.update(nba.to_device(nba.FlatTree.from_tree(g)), state, params)
        nba.apply_updates_(params, updates)
        host_updates, host_state = host_tx.update(g, host_state, host_params)
        nba.apply_updates_(host_params, host_updates)
        assert_same_on_every_rank(params, state)
    back = nba.to_host(params)
    for a, b in zip(back.leaves, host_params.leaves):  # CUDA contracts a * b + c into an FMA
        np.testing.assert_allclose(a, b, rtol=1e-3 if a.dtype == np.float16 else 1e-6)
    mean = dist.allreduce_mean_(nba.to_device(nba.FlatTree.from_tree(grads_of(RANK, 5, like))))
    assert_matches(nba.to_host(mean).tree, mean_over_ranks(5, like))
