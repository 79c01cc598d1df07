"""numbaccum.distributed on every rank of MPI.COMM_WORLD.

CI runs this file on two ranks (``mpiexec -n 2 python -m pytest -p no:cacheprovider tests/mpi``,
in `.ci/run`, under a timeout) and again in numba's CUDA simulator; the plain ``python -m pytest``
runs it on one rank. Every rank runs the same tests in the same order, with the same seeds (no
hypothesis: its draws could differ between ranks), and checks its results after the collectives
so that a failing assertion cannot leave another rank waiting.
"""

import hashlib
import json
import math
import os

import numpy as np
import pytest

import numbaccum as nba
from numbaccum import _config, lockstep

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
            if np.asarray(recv).dtype != np.int64:  # not the step counters' message
                calls.append(len(recv))
                assert len(recv) <= 7
            return self._comm.Allreduce(send, recv, op=op)

        def Iallreduce(self, send, recv, op=MPI.SUM):  # noqa: N802 - mpi4py's name
            calls.append(len(recv))
            assert len(recv) <= 7
            return self._comm.Iallreduce(send, recv, op=op)

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

    def Iallreduce(self, *args, **kwargs):  # noqa: N802 - mpi4py's name
        self.allreduces += 1
        return COMM.Iallreduce(*args, **kwargs)

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
        # (and before them, one of the step counters)
        assert inside.allreduces == (steps // k) * (groups + 1)
        assert outside.allreduces == steps * (groups + 1)


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


# --- buckets ------------------------------------------------------------------------------


@pytest.fixture
def process_bucket(monkeypatch):
    """The bucket size in use is process state (`calibrate`, a saved file): each test that
    changes it gets it back as it found it."""
    monkeypatch.setattr(dist, "_calibrated", list(dist._calibrated))
    monkeypatch.setattr(dist, "_saved", dict(dist._saved))
    monkeypatch.setattr(_config, "MPI_BUCKET_BYTES", None)


class MessageLog:
    """COMM_WORLD, keeping the count of every Allreduce message and its dtype."""

    def __init__(self):
        self.messages = []

    def Allreduce(self, send, recv, op=MPI.SUM):  # noqa: N802 - mpi4py's name
        self.messages.append((np.asarray(recv).dtype, len(recv)))
        return COMM.Allreduce(send, recv, op=op)

    def Iallreduce(self, send, recv, op=MPI.SUM):  # noqa: N802 - mpi4py's name
        self.messages.append((np.asarray(recv).dtype, len(recv)))
        return COMM.Iallreduce(send, recv, op=op)

    def __getattr__(self, name):
        return getattr(COMM, name)


def expected_messages(flat, bucket_bytes):
    """(dtype on the wire, count) of every message: whole elements of at most bucket_bytes (at
    least one), never across a dtype buffer; float16 and bfloat16 travel as float32."""
    out = []
    for dt, n in zip(flat.group_dtypes, flat.layout.group_sizes):
        wire = np.dtype(np.float32) if dt.itemsize == 2 else np.dtype(dt)
        step = max(1, bucket_bytes // wire.itemsize)
        out += [(wire, min(step, n - lo)) for lo in range(0, n, step)]
    return out


ONE_MESSAGE = 1 << 62  # larger than any buffer: one message per dtype buffer, as before buckets
# An update of allreduce_mean sends the ranks' step counters first: [v, -v] of lockstep's vector.
STEP_COUNTERS = (np.dtype(np.int64), 2 * (2 + lockstep._WIDTH))


@pytest.mark.parametrize("bucket_bytes", [1, 3, 12, 13, 100, 4 << 20])
def test_buckets_give_the_bits_of_one_message(bucket_bytes):
    # float32 and float64 leaves of sizes 2112, 33, 165, 1 and 0: the odd sizes split leaves (and
    # round down: 13 bytes are 3 float32s or 1 float64; 1 and 3 bytes, one element)
    g = nba.FlatTree.from_tree(grads_of(RANK, 0))
    whole = dist.allreduce_sum_(g, g.zeros_like(), COMM, bucket_bytes=ONE_MESSAGE)
    log = MessageLog()
    ours = dist.allreduce_sum_(g, g.zeros_like(), log, bucket_bytes=bucket_bytes)
    mean = dist.allreduce_mean_(g.copy(), None, COMM, bucket_bytes=bucket_bytes)
    assert_same_on_every_rank(ours, mean)
    for a, b in zip(ours.groups, whole.groups):  # elementwise sums: the bits of one message
        np.testing.assert_array_equal(a, b)
    ref = nba.tree_map(lambda *xs: sum(xs[1:], xs[0]), *[grads_of(r, 0) for r in range(SIZE)])
    assert_matches(ours.tree, ref)
    assert_matches(mean.tree, mean_over_ranks(0))
    assert log.messages == expected_messages(g, bucket_bytes)


def test_buckets_respect_the_max_count_too(monkeypatch):
    g = nba.FlatTree.from_tree(grads_of(RANK, 1))
    whole = dist.allreduce_sum_(g, g.zeros_like(), COMM, bucket_bytes=ONE_MESSAGE)
    monkeypatch.setattr(_config, "MPI_MAX_COUNT", 5)
    log = MessageLog()
    ours = dist.allreduce_sum_(g, g.zeros_like(), log, bucket_bytes=64)  # 16 float32s, 8 float64s
    assert [n for _, n in log.messages if n > 5] == []
    assert sum(n for _, n in log.messages) == g.layout.size
    for a, b in zip(ours.groups, whole.groups):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bucket_bytes", [4, 10, 1 << 20])
def test_float16_and_bfloat16_means_in_buckets(bucket_bytes):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    like = {
        "h": np.ones((7, 3), np.float16),
        "bf": np.ones(9, ml_dtypes.bfloat16),
        "s": np.ones(11, np.float32),
        "e": np.zeros((0, 2), np.float64),  # a dtype buffer of size 0: no message
    }
    g = grads_of(RANK, 2, like)
    g["h"][0] = np.float16(60000.0)  # float16's max is 65504: the sum must not overflow
    tx = dist.allreduce_mean(log := MessageLog(), bucket_bytes=bucket_bytes)
    updates, _ = tx.update(g, tx.init(like))
    whole = dist.allreduce_mean_(nba.FlatTree.from_tree(g), None, COMM, bucket_bytes=ONE_MESSAGE)
    assert_same_on_every_rank(updates)
    for key in like:
        np.testing.assert_array_equal(updates[key], whole[key])
    assert np.isfinite(updates["h"]).all()
    ref = mean_over_ranks(2, like)
    ref["h"][0] = np.float16(60000.0)
    ref["bf"] = ref["bf"].astype(np.float32)
    if SIZE <= 2:  # float32 sum, one division, one rounding
        np.testing.assert_array_equal(updates["h"], ref["h"])
        np.testing.assert_array_equal(updates["bf"].astype(np.float32), ref["bf"])
    if SIZE > 1:
        assert log.messages == [STEP_COUNTERS, *expected_messages(nba.FlatTree.from_tree(like), bucket_bytes)]


@pytest.mark.parametrize(
    ("bad", "error", "says"),
    [
        (0, ValueError, ">= 1"),
        (-4, ValueError, ">= 1"),
        (2.5, TypeError, "an int"),
        ("4MB", TypeError, "an int"),
    ],
)
def test_a_bad_bucket_size_raises_before_any_buffer_is_touched(bad, error, says):
    class NoCollective:
        def __getattr__(self, name):
            raise AssertionError(f"{name} called")

    g = nba.FlatTree.from_tree(grads_of(RANK, 3))
    out = g.zeros_like()
    for call in (dist.allreduce_sum_, dist.allreduce_mean_):
        with pytest.raises(error, match=f"bucket_bytes must be {says}"):
            call(g, out, NoCollective(), bucket_bytes=bad)
    with pytest.raises(error, match=f"bucket_bytes must be {says}"):
        dist.allreduce_mean(NoCollective(), bucket_bytes=bad)
    assert all((x == 0).all() for x in out.groups)
    assert all(np.array_equal(a, b) for a, b in zip(g.leaves, nba.tree_flatten(grads_of(RANK, 3))[0]))


@multi_rank
def test_ranks_with_other_bucket_sizes_raise_at_init_on_every_rank():
    mine = 12345 if RANK == SIZE - 1 else None  # the others: the default
    with pytest.raises(ValueError, match="bucket sizes differ between ranks") as e:
        dist.allreduce_mean(bucket_bytes=mine).init(make_params())
    messages = COMM.allgather(str(e.value))
    assert messages == [messages[0]] * SIZE
    assert f"12345 bytes (argument) on rank {SIZE - 1}, " in messages[0]
    assert "bytes (default) on rank 0" in messages[0]
    dist.allreduce_mean(bucket_bytes=12345).init(make_params())  # and the ranks are in step


def test_calibrate_takes_the_same_choice_on_every_rank_and_uses_it(process_bucket):
    # tiny sizes on a tiny buffer: a quick run whose choice splits make_params' buffers
    c = dist.calibrate(sizes=[64, 8, 64], repeats=3, nbytes=4096)
    assert sorted(c.seconds) == [8, 64] and c.bucket_bytes in c.seconds and c.path is None
    assert all(t > 0 for t in c.seconds.values())
    assert_same_on_every_rank(np.int64(c.bucket_bytes), np.array(list(c.seconds.values())))
    ranks = "1 rank" if SIZE == 1 else f"{SIZE} ranks"
    assert dist._bucket_in_use() == (c.bucket_bytes, f"calibrate() in this process, {ranks}")
    assert "calibrate() in this process" in dist.describe()
    log = MessageLog()
    tx = dist.allreduce_mean(log)  # made after the calibration: uses its choice
    g = nba.FlatTree.from_tree(grads_of(RANK, 4))
    tx.update(g, tx.init(g))
    if SIZE > 1:
        assert log.messages == [STEP_COUNTERS, *expected_messages(g, c.bucket_bytes)]
    assert dist._bucket_in_use(12).nbytes == 12  # an argument still wins
    with pytest.raises(ValueError, match="sizes"):
        dist.calibrate(sizes=[])
    with pytest.raises(TypeError, match="save"):
        dist.calibrate(save=2)


def test_calibrate_saves_its_choice_and_a_later_process_reads_it(process_bucket, tmp_path, monkeypatch):
    where = COMM.bcast(str(tmp_path), root=0)  # one directory for every rank (rank 0's)
    monkeypatch.setenv("NUMBACCUM_CACHE_DIR", where)
    c = dist.calibrate(sizes=[256, 1 << 10], repeats=2, nbytes=1 << 16, save=True)
    assert c.path == os.path.join(where, dist.CALIBRATION_FILE)
    with open(c.path) as f:
        record = json.load(f)
    assert record["bucket_bytes"] == c.bucket_bytes and record["ranks"] == SIZE
    assert record["library"] == dist._library()
    # a later process: nothing calibrated yet, the file not read yet
    monkeypatch.setattr(dist, "_calibrated", [])
    monkeypatch.setattr(dist, "_saved", {})
    bucket = dist._bucket_in_use()
    ranks = "1 rank" if SIZE == 1 else f"{SIZE} ranks"
    assert bucket.nbytes == c.bucket_bytes and bucket.source.startswith(f"calibrated: {c.path} ({ranks}, ")
    assert f"({bucket.source})" in dist.describe()
    monkeypatch.setattr(_config, "MPI_BUCKET_BYTES", 12345)  # the environment wins over the file
    assert dist._bucket_in_use() == (12345, "environment: NUMBACCUM_MPI_BUCKET_BYTES")
    COMM.Barrier()  # every rank has read rank 0's file before the next test writes its own


def test_calibrate_saves_to_a_path_given(process_bucket, tmp_path):
    path = COMM.bcast(str(tmp_path / "sub" / "buckets.json"), root=0)
    c = dist.calibrate(COMM, sizes=[512], repeats=1, nbytes=1 << 12, save=path)
    assert c == (512, c.seconds, path)
    with open(path) as f:
        assert json.load(f)["bucket_bytes"] == 512
    COMM.Barrier()


@needs_cuda
@pytest.mark.parametrize("bucket_bytes", [12, ONE_MESSAGE])
def test_cuda_buffers_go_in_buckets_through_the_host(bucket_bytes):
    like = {"w": make_params()["dense"]["w"][:5], "h": np.ones(6, np.float16), "d": np.ones((2, 2))}
    g = grads_of(RANK, 6, like)
    g["h"][0] = np.float16(60000.0)
    flat = nba.FlatTree.from_tree(g)
    host = dist.allreduce_mean_(flat.copy(), None, COMM, bucket_bytes=ONE_MESSAGE)
    log = MessageLog()
    ours = nba.to_host(dist.allreduce_mean_(nba.to_device(flat), None, log, bucket_bytes=bucket_bytes))
    tx = dist.allreduce_mean(bucket_bytes=bucket_bytes)  # float16 inside: divided on the host
    stage, _ = tx.update(nba.to_device(flat), tx.init(nba.to_device(flat)))
    stage = nba.to_host(stage)
    assert_same_on_every_rank(ours, stage)
    for a, b, c in zip(ours.groups, stage.groups, host.groups):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
    assert np.isfinite(ours["h"]).all()
    if SIZE > 1:
        assert log.messages == expected_messages(flat, bucket_bytes)


@needs_cuda
@pytest.mark.parametrize("bucket_bytes", [12, ONE_MESSAGE])
def test_cuda_bfloat16_and_complex_buffers_through_the_host(bucket_bytes):
    """bfloat16 and complex device buffers staged through the host: the host path's bits, for
    the mean alone (`allreduce_mean_`), and a step of ``allreduce_mean`` + clip + Adam on the
    bfloat16 and float32 ones (the transformation refuses complex leaves)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    like = {
        "bf": np.ones((5, 3), ml_dtypes.bfloat16),
        "c": np.ones(7, np.complex64),
        "s": np.ones(4, np.float32),
    }
    g = grads_of(RANK, 7, like)
    g["c"] = g["c"] * np.complex64(1 - 2j)  # a real and an imaginary part of their own
    flat = nba.FlatTree.from_tree(g)
    host = dist.allreduce_mean_(flat.copy(), None, COMM, bucket_bytes=bucket_bytes)
    dev = nba.to_host(dist.allreduce_mean_(nba.to_device(flat), None, COMM, bucket_bytes=bucket_bytes))
    assert_same_on_every_rank(dev)
    for a, b in zip(dev.groups, host.groups):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))

    def step(to):
        tx = nba.chain(
            dist.allreduce_mean(bucket_bytes=bucket_bytes), nba.clip_by_global_norm(1.0), nba.adam(0.1)
        )
        real = {k: v for k, v in like.items() if k != "c"}
        params = to(nba.FlatTree.from_tree(real))
        grads = to(nba.FlatTree.from_tree({k: g[k] for k in real}))
        state = nba.step_(tx, grads, tx.init(params), params)
        return nba.to_host(params) if to is nba.to_device else params, state

    on_device, _ = step(nba.to_device)
    on_host, _ = step(lambda x: x)
    assert_same_on_every_rank(on_device)
    for a, b in zip(on_device.groups, on_host.groups):  # CUDA may contract a * b + c into an FMA
        assert a.dtype == b.dtype
        tol = 1e-2 if a.dtype == np.dtype(ml_dtypes.bfloat16) else 1e-5
        np.testing.assert_allclose(a.astype(np.complex128), b.astype(np.complex128), rtol=tol, atol=tol)


# --- issue 27, item 2: the clip's norm rides on the collective (overlap) ----------------------


def _dp_steps(tx, steps, apply, like=None, grads=None):
    """``steps`` updates of ``tx`` from params ``like`` (``make_params()``): the params, the last
    state and the clip's norms seen (``state[1].norm``)."""
    params = nba.FlatTree.from_tree(make_params() if like is None else like)
    state = tx.init(params)
    norms = []
    for step in range(steps):
        g = grads_of(RANK, step, like) if grads is None else grads(step)
        if apply:
            state = nba.step_(tx, g, state, params)
        else:
            updates, state = tx.update(g, state, params)
            nba.apply_updates_(params, updates)
        norms.append(float(state[1].norm))
    return params, state, norms


def _dp_chain(max_norm, bucket_bytes):
    return nba.chain(
        dist.allreduce_mean(bucket_bytes=bucket_bytes), nba.clip_by_global_norm(max_norm), nba.adamw(1e-2)
    )


@pytest.mark.parametrize("apply", [False, True], ids=["update", "step_"])
@pytest.mark.parametrize("max_norm", [1.0, 1e6], ids=["clipped", "not-clipped"])
@pytest.mark.parametrize("bucket_bytes", [100, 1000, 16 << 20])
@pytest.mark.parametrize("block", [None, 64])
def test_overlap_clip_norm_on_the_collective_gives_the_unfused_bits(
    monkeypatch, apply, max_norm, bucket_bytes, block
):
    # Small buckets: many per dtype buffer (float32 and float64), cutting the engine's items and
    # leaves anywhere; the norm is reduced item by item as the buckets arrive. A block of 64
    # elements: several items per leaf, buckets ending inside them.
    if block is not None:
        monkeypatch.setattr(_config, "REDUCE_BLOCK", block)
    tx = _dp_chain(max_norm, bucket_bytes)
    fused = _dp_steps(tx, 3, apply)
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")  # stage by stage: 1/n settled, then the norm pass
    unfused = _dp_steps(_dp_chain(max_norm, bucket_bytes), 3, apply)
    monkeypatch.delenv("NUMBACCUM_FUSE")
    assert_same_on_every_rank(fused[0], fused[1])
    np.testing.assert_array_equal(fused[2], unfused[2])  # the norms, bit for bit
    for a, b in zip(fused[0].groups, unfused[0].groups):
        np.testing.assert_array_equal(a, b)
    # and the plain reference: the NumPy mean over ranks, then one process's clip and adamw
    ref_tx = nba.chain(nba.clip_by_global_norm(max_norm), nba.adamw(1e-2))
    ref_params = make_params()
    ref_state = ref_tx.init(ref_params)
    for step in range(3):
        mean = mean_over_ranks(step)
        norm = math.sqrt(
            sum(float(np.sum(np.square(x, dtype=np.float64))) for x in nba.tree_flatten(mean)[0])
        )
        np.testing.assert_allclose(fused[2][step], norm, rtol=1e-12)
        u, ref_state = ref_tx.update(mean, ref_state, ref_params)
        ref_params = nba.apply_updates(ref_params, u)
    assert_matches(fused[0].tree, ref_params)


@multi_rank
def test_overlap_explain_shows_the_collective_and_the_norm_on_it():
    like = make_params()
    tx = _dp_chain(1.0, 1000)
    e = nba.explain(tx, like)
    kinds = [p.kind for p in e.passes]
    assert kinds == ["collective", "fused"], e
    assert " Allreduce" in e.passes[0].stages[0] and "clip_by_global_norm" in e.passes[0].stages[1]
    assert e.total == e.minimum
    stage_by_stage = nba.explain(tx, like, fused=False)
    assert [p.kind for p in stage_by_stage.passes][:3] == ["collective", "settle", "reduction"]
    # float16 leaves: summed in float32 and divided on the host; the norm reads the mean
    half = nba.explain(tx, {"h": np.zeros(10, np.float16), "w": np.zeros(3, np.float32)})
    assert [p.kind for p in half.passes] == ["collective", "reduction", "fused"], half


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_overlap_nonfinite_gradients_clip_as_the_unfused_path(monkeypatch, bad):
    def grads(step):
        g = grads_of(RANK, step)
        if RANK == SIZE - 1 and step == 1:
            g["dense"]["w"][3, 4] = bad
        return g

    fused = _dp_steps(_dp_chain(1.0, 1000), 3, True, grads=grads)
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    unfused = _dp_steps(_dp_chain(1.0, 1000), 3, True, grads=grads)
    assert_same_on_every_rank(fused[0], fused[1])
    np.testing.assert_array_equal(fused[2], unfused[2])
    assert not math.isfinite(fused[2][1])
    for a, b in zip(fused[0].groups, unfused[0].groups):
        np.testing.assert_array_equal(a, b)  # NaN where the unfused path has NaN


def test_overlap_zero_norm_with_max_norm_zero_gives_zeros():
    like = make_params()
    zeros = nba.tree_map(np.zeros_like, like)
    tx = nba.chain(dist.allreduce_mean(bucket_bytes=100), nba.clip_by_global_norm(0.0))
    updates, state = tx.update(zeros, tx.init(like))
    assert float(state[1].norm) == 0.0
    for u in nba.tree_flatten(updates)[0]:
        assert not np.any(u) and not np.any(np.isnan(u))
    # and through a kernel: sgd of zeros, no NaN
    tx = nba.chain(dist.allreduce_mean(bucket_bytes=100), nba.clip_by_global_norm(0.0), nba.sgd(0.1))
    params = nba.FlatTree.from_tree(like)
    before = params.copy()
    state = nba.step_(tx, zeros, tx.init(params), params)
    assert float(state[1].norm) == 0.0
    for a, b in zip(params.groups, before.groups):
        np.testing.assert_array_equal(a, b)


def test_overlap_float16_leaves_fall_back_to_the_norm_pass(monkeypatch):
    like = {"h": np.ones((40, 7), np.float16), "w": np.ones(50, np.float32)}
    fused = _dp_steps(_dp_chain(0.5, 64), 2, True, like=like)
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    unfused = _dp_steps(_dp_chain(0.5, 64), 2, True, like=like)
    assert_same_on_every_rank(fused[0], fused[1])
    np.testing.assert_array_equal(fused[2], unfused[2])
    for a, b in zip(fused[0].groups, unfused[0].groups):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bucket_bytes", [12, 4 << 10])
def test_overlap_nonblocking_buckets_give_the_bits_of_blocking_allreduce(bucket_bytes, monkeypatch):
    # Iallreduce per bucket, the next in flight: the bits of one blocking Allreduce per buffer
    # (MPICH adds in one order for both; on 3 ranks too)
    monkeypatch.setattr(_config, "MPI_NONBLOCKING", True)
    g = nba.FlatTree.from_tree(grads_of(RANK, 2))
    ours = dist.allreduce_sum_(g, g.zeros_like(), COMM, bucket_bytes=bucket_bytes)
    for x, y in zip(g.groups, ours.groups):
        plain = np.empty_like(x)
        COMM.Allreduce(x, plain, op=MPI.SUM)
        np.testing.assert_array_equal(y, plain)
    assert_same_on_every_rank(ours)


@multi_rank
@pytest.mark.parametrize("bucket_bytes", [100, 16 << 20])
def test_overlap_nonblocking_buckets_with_the_norm_give_the_blocking_bits(bucket_bytes, monkeypatch):
    # NUMBACCUM_MPI_NONBLOCKING=1: Iallreduce per bucket, the norm testing the next between its
    # batches; the same updates, norms and params as the blocking default, and explain says so
    blocking = _dp_steps(_dp_chain(1.0, bucket_bytes), 3, True)
    monkeypatch.setattr(_config, "MPI_NONBLOCKING", True)
    nonblocking = _dp_steps(_dp_chain(1.0, bucket_bytes), 3, True)
    assert "Iallreduce" in nba.explain(_dp_chain(1.0, bucket_bytes), make_params()).passes[0].stages[0]
    assert_same_on_every_rank(nonblocking[0], nonblocking[1])
    np.testing.assert_array_equal(nonblocking[2], blocking[2])
    for a, b in zip(nonblocking[0].groups, blocking[0].groups):
        np.testing.assert_array_equal(a, b)


def test_overlap_multisteps_rides_too(monkeypatch):
    def run():
        tx = nba.MultiSteps(_dp_chain(1.0, 1000), 2)
        params = nba.FlatTree.from_tree(make_params())
        state = tx.init(params)
        for step in range(4):
            state = nba.step_(tx, grads_of(RANK, step), state, params)
        return params, state

    fused = run()
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    unfused = run()
    assert_same_on_every_rank(*fused)
    for a, b in zip(fused[0].groups, unfused[0].groups):
        np.testing.assert_array_equal(a, b)


# --- issue 42, item 9: ranks out of step raise on every rank ------------------------------------


def _one_message(e):
    """The error's message, after checking that every rank raised the same one."""
    messages = COMM.allgather(str(e.value))
    assert messages == [messages[0]] * SIZE, f"rank {RANK}: another message than rank 0's"
    return messages[0]


@multi_rank
def test_in_step_ranks_restored_from_checkpoints_of_different_steps_raise_on_every_rank(tmp_path):
    # Rank 0 resumes from the checkpoint of step 3, the others from step 2: the first step's
    # collective sees their counters differ, and every rank raises the same error naming them
    # (before: no error, and adam's counts went on apart, 6 and 5 after 3 more steps).
    tx = nba.chain(dist.allreduce_mean(), nba.adam(1e-3))
    params = nba.FlatTree.from_tree(make_params())
    state = tx.init(params)
    for step in range(3):
        state = nba.step_(tx, grads_of(RANK, step), state, params)
        nba.save_state(tmp_path / f"state-{step + 1}.npz", state)  # each rank its own files
    restored = nba.load_state(tmp_path / f"state-{3 if RANK == 0 else 2}.npz")
    before = [b.copy() for b in params.groups]
    with pytest.raises(ValueError, match="out of step") as e:
        nba.step_(tx, grads_of(RANK, 3), restored, params)
    message = _one_message(e)
    assert "3 on rank 0" in message and f"2 on rank{'s' if SIZE > 2 else ''} 1" in message
    assert "allreduce_mean" in message and "checkpoint" in message
    assert all(np.array_equal(a, b) for a, b in zip(params.groups, before))  # nothing written
    # every rank from the same checkpoint: in step again, and the same bits everywhere
    restored = nba.load_state(tmp_path / "state-3.npz")
    for step in range(3, 5):
        restored = nba.step_(tx, grads_of(RANK, step), restored, params)
    assert int(restored[1][0].count) == 5
    assert_same_on_every_rank(params, restored)


def _in_step_multisteps(k, comm=None):
    return nba.MultiSteps(nba.chain(dist.allreduce_mean(comm), nba.sgd(0.1, momentum=0.9)), k)


@multi_rank
def test_in_step_multisteps_with_another_k_on_a_rank_raises_at_init_on_every_rank():
    # Before: init passed, then the ranks paired the collectives of different steps (rank 0's
    # 2nd mini-step with the last rank's 3rd) and the one with more emitting steps hung.
    k = 3 if RANK == SIZE - 1 else 2
    with pytest.raises(ValueError, match="differ between ranks") as e:
        _in_step_multisteps(k).init(make_params())
    message = _one_message(e)
    assert f"MultiSteps(every_k_schedule=3) on rank {SIZE - 1}" in message
    assert f"MultiSteps(every_k_schedule=2) on rank{'s' if SIZE > 2 else ''} 0" in message
    # the same k everywhere: init passes, and the ranks are in step
    tx = _in_step_multisteps(2)
    params = nba.FlatTree.from_tree(make_params())
    state = tx.init(params)
    for step in range(4):
        state = nba.step_(tx, grads_of(RANK, step), state, params)
    assert_same_on_every_rank(params, state.inner_opt_state)


@multi_rank
def test_in_step_multisteps_schedule_that_differs_later_raises_at_the_emitting_step():
    # A schedule: the same k at gradient step 0 (init agrees), then 2 on rank 0 and 3 elsewhere.
    # Rank 0's second cycle emits at mini-step 4, the others' at 5: that collective pairs them,
    # sees their k differ and raises on every rank (before: 5 steps passed silently, the ranks
    # averaging gradients of different mini-steps).
    def schedule(gradient_step):
        return 2 if gradient_step == 0 or RANK == 0 else 3

    tx = _in_step_multisteps(schedule)
    params = nba.FlatTree.from_tree(make_params())
    state = tx.init(params)
    with pytest.raises(ValueError, match="out of step") as e:
        for step in range(5):
            state = nba.step_(tx, grads_of(RANK, step), state, params)
    message = _one_message(e)
    assert "MultiSteps every_k_schedule 2 at gradient_step 1 on rank 0" in message
    assert "every_k_schedule 3 at gradient_step 1 on rank" in message


@multi_rank
def test_in_step_a_rank_that_skipped_a_step_makes_the_next_collective_raise():
    # apply_if_finite decides from each rank's own gradients: a NaN on one rank only skips the
    # step there, so its counter stays behind, and the next collective says so on every rank.
    tx = nba.apply_if_finite(nba.chain(dist.allreduce_mean(), nba.sgd(0.1)), max_consecutive_errors=5)
    params = nba.FlatTree.from_tree(make_params())
    state = tx.init(params)
    state = nba.step_(tx, grads_of(RANK, 0), state, params)
    g = grads_of(RANK, 1)
    if RANK == SIZE - 1:
        g["dense"]["b"][0] = np.nan
    with pytest.raises(ValueError, match="out of step") as e:
        for step in range(2):
            state = nba.step_(tx, g, state, params)
            g = grads_of(RANK, 2)
    _one_message(e)


def test_in_step_a_state_saved_before_the_count_loads_with_count_0(tmp_path):
    # A file written before AllreduceMeanState kept its count: the fields ["mean"] only.
    tx = nba.chain(dist.allreduce_mean(), nba.sgd(0.1))
    params = nba.FlatTree.from_tree(make_params())
    state = tx.init(params)
    state = nba.step_(tx, grads_of(RANK, 0), state, params)
    assert int(state[0].count) == 1
    path = tmp_path / "old.npz"
    nba.save_state(path, state)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(bytes(arrays["numbaccum_checkpoint"]).decode())
    node = header["state"][1][0]  # the chain's tuple: its first stage's state
    assert node[:3] == ["nt", "numbaccum.distributed:AllreduceMeanState", ["mean", "count"]]
    node[2], node[3] = ["mean"], node[3][:1]
    arrays["numbaccum_checkpoint"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(path, **arrays)
    old = nba.load_state(path)
    assert int(old[0].count) == 0 and isinstance(old[0], dist.AllreduceMeanState)
    old = nba.step_(tx, grads_of(RANK, 1), old, params)  # every rank's is 0: in step
    assert int(old[0].count) == 1


@multi_rank
def test_a_held_update_of_a_lone_allreduce_mean_is_not_overwritten_by_the_next():
    """A lone ``allreduce_mean().update`` returns the mean where the collective wrote it: the
    next update writes elsewhere while the caller holds it (it wrote the same buffer again)."""
    params = make_params()
    tx = dist.allreduce_mean()
    state = tx.init(params)
    kept = []
    for step in range(3):
        u, state = tx.update(grads_of(RANK, step), state)
        kept.append(u)
    u_flat, state = tx.update(nba.FlatTree.from_tree(grads_of(RANK, 7)), state)
    for step, u in enumerate(kept):
        assert_matches(u, mean_over_ranks(step))
    assert_matches(u_flat.tree, mean_over_ranks(7))
    del kept, u_flat, u  # dropped: the common loop alternates two buffers, allocating nothing
    a, state = tx.update(grads_of(RANK, 8), state)
    ptr = nba.tree_flatten(a)[0][0].__array_interface__["data"][0]
    del a
    b, state = tx.update(grads_of(RANK, 9), state)
    assert nba.tree_flatten(b)[0][0].__array_interface__["data"][0] == ptr
    assert_matches(b, mean_over_ranks(9))
