"""numbaccum.distributed.shard (ZeRO stage 1) on every rank of MPI.COMM_WORLD.

CI runs this file on two ranks and on three (``-k shard``, `.ci/run`); the plain ``python -m
pytest`` runs it on one rank. As in test_mpi.py: every rank runs the same tests in the same
order, with the same seeds, and checks its results after the collectives, so that a failing
assertion cannot leave another rank waiting. An error a test expects is raised on every rank
alike, before any collective.
"""

import hashlib
import os

import numpy as np
import pytest

import numbaccum as nba
import numbaccum.layout

MPI = pytest.importorskip("mpi4py.MPI")
from numbaccum import distributed as dist  # noqa: E402
from numbaccum.sharded import partition  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _digest(*objs):
    """A hash of every buffer, array and number of trees and states (FlatTrees by their buffers)."""
    parts = []

    def add(x):
        if isinstance(x, nba.FlatTree):
            parts.extend(np.ascontiguousarray(b).tobytes() for _, b in sorted(x.buffers.items(), key=str))
        elif isinstance(x, (tuple, list)):
            for v in x:
                add(v)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                add(x[k])
        elif x is not None and not isinstance(x, nba.layout.Layout):
            parts.append(np.asarray(x).tobytes())

    for o in objs:
        add(o)
    return hashlib.sha256(b"|".join(parts)).hexdigest()


def assert_same_on_every_rank(*objs):
    every = COMM.allgather(_digest(*objs))
    assert every == [every[0]] * SIZE, f"rank {RANK}: params differ between ranks"


def make_params(half=False):
    rng = np.random.default_rng(0)
    p = {
        "dense": {"w": rng.standard_normal((64, 33)).astype(np.float32), "b": np.zeros(33, np.float32)},
        "out": [rng.standard_normal((33, 5)), np.float32(0.5) * np.ones((), np.float32)],
        "empty": np.zeros((0, 3), np.float32),
        "emb": rng.standard_normal((17, 9)).astype(np.float32),
    }
    if half:
        p["h"] = {
            "a": rng.standard_normal((6, 5)).astype(np.float16),
            "b": rng.standard_normal(7).astype(np.float16),
        }
    return p


def grads_of(rank, step, like):
    rng = np.random.default_rng([rank, step])
    return nba.tree_map(lambda p: (3 * rng.standard_normal(p.shape)).astype(p.dtype), like)


def assert_matches(ours, ref, exact):
    """Bit for bit where the sums are in the same order (up to two ranks: ``a + b``), within
    float32 rounding on more ranks."""
    for a, b in zip(nba.tree_flatten(ours)[0], nba.tree_flatten(ref)[0]):
        a, b = np.asarray(a), np.asarray(b)
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            tol = 2e-3 if a.dtype == np.float16 else 1e-5
            np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


def run_both(tx, ref_tx, like, steps=4, bucket_bytes=None, use_step=True):
    """``steps`` sharded steps and the data-parallel steps of ``ref_tx``, from the same params;
    checks replicas after every step; returns both params, both states."""
    opt = dist.shard(tx, bucket_bytes=bucket_bytes)
    params = nba.FlatTree.from_tree(like)
    ref_params = nba.FlatTree.from_tree(like)
    state = opt.init(params)
    ref_state = ref_tx.init(ref_params)
    for step in range(steps):
        g = grads_of(RANK, step, like)
        if use_step and step % 2:
            state = opt.step_(g, state, params)
        else:
            state = nba.step_(opt, nba.FlatTree.from_tree(g), state, params)
        ref_state = nba.step_(ref_tx, g, ref_state, ref_params)
        assert_same_on_every_rank(params)
    return opt, params, ref_params, state, ref_state


def test_shard_adamw_is_the_data_parallel_step():
    """Per-element stages only: the even partition (each bucket split among the ranks)."""
    tx = nba.adamw(1e-2, weight_decay=0.1)
    ref = nba.chain(dist.allreduce_mean(), nba.adamw(1e-2, weight_decay=0.1))
    opt, params, ref_params, state, _ = run_both(tx, ref, make_params())
    assert opt.partition == "even" and state.partition == "even"
    assert_matches(params.tree, ref_params.tree, exact=SIZE <= 2)


@pytest.mark.parametrize("bucket_bytes", [40, 100, 1 << 20])
def test_shard_buckets_and_float16(bucket_bytes):
    """Small buckets (many per buffer, cutting leaves; 100 bytes: 25 float32 or float16, 12
    float64 elements, not divisible by 2 or 3 ranks) and a float16 group, summed in float32 and
    divided on the host as allreduce_mean does."""
    like = make_params(half=True)
    tx = nba.adam(1e-2)
    ref = nba.chain(dist.allreduce_mean(bucket_bytes=bucket_bytes), nba.adam(1e-2))
    opt, params, ref_params, _, _ = run_both(tx, ref, like, bucket_bytes=bucket_bytes)
    assert opt.partition == "even"
    assert_matches(params.tree, ref_params.tree, exact=SIZE <= 2)


@pytest.mark.parametrize("bucket_bytes", [4, 8])
def test_shard_buckets_smaller_than_the_ranks(bucket_bytes):
    """One or two elements per bucket: some ranks get nothing of a bucket (a count of zero)."""
    rng = np.random.default_rng(5)
    like = {
        "a": rng.standard_normal(13).astype(np.float32),
        "b": rng.standard_normal((3, 2)).astype(np.float16),
        "c": rng.standard_normal(5),
    }
    tx = nba.adamw(1e-2, weight_decay=0.1)
    ref = nba.chain(dist.allreduce_mean(bucket_bytes=bucket_bytes), nba.adamw(1e-2, weight_decay=0.1))
    opt, params, ref_params, state, _ = run_both(tx, ref, like, steps=3, bucket_bytes=bucket_bytes)
    assert opt.partition == "even"
    assert_matches(params.tree, ref_params.tree, exact=SIZE <= 2)
    assert sum(COMM.allgather(_state_bytes(state.inner))) == _state_bytes(tx.init(params))


def test_shard_with_the_sharded_clip():
    """The clip's norm is combined over the ranks: the global norm of the mean gradient. On the
    even partition each rank's sum of squares is over its pieces of the leaves: together, every
    element once."""
    tx = nba.chain(dist.clip_by_global_norm(1.0), nba.adamw(1e-2, weight_decay=0.1))
    ref = nba.chain(dist.allreduce_mean(), nba.clip_by_global_norm(1.0), nba.adamw(1e-2, weight_decay=0.1))
    opt, params, ref_params, _, _ = run_both(tx, ref, make_params(), bucket_bytes=100)
    assert opt.partition == "even"
    # the norm is added in another order (per rank, then over ranks): within rounding
    assert_matches(params.tree, ref_params.tree, exact=False)
    _, unclipped, _, _, _ = run_both(nba.adamw(1e-2, weight_decay=0.1), ref, make_params())
    assert not np.array_equal(unclipped["dense"]["w"], params["dense"]["w"])  # it did clip


def test_shard_per_leaf_transformations_are_exact():
    """Whole leaves per rank: Adafactor's factored moments, LAMB's trust ratio and masks (a tree
    and a function of the params) are those of the unsharded step."""
    like = make_params()
    mask = {"dense": {"w": True, "b": False}, "out": [True, False], "empty": False, "emb": True}
    for tx in (
        lambda: nba.adafactor(1e-2),
        lambda: nba.lamb(1e-2),
        lambda: nba.chain(nba.masked(nba.add_decayed_weights(0.5), mask), nba.adam(1e-2)),
        lambda: nba.adamw(1e-2, weight_decay=0.3, mask=lambda p: nba.tree_map(lambda x: x.ndim > 1, p)),
    ):
        opt, params, ref_params, state, _ = run_both(
            tx(), nba.chain(dist.allreduce_mean(), tx()), like, steps=3
        )
        assert opt.partition == "leaves" and state.partition == "leaves"
        assert_matches(params.tree, ref_params.tree, exact=SIZE <= 2)


def test_shard_more_ranks_than_leaves():
    """Whole leaves, one leaf per dtype group: a rank owns a whole group or nothing of it, and
    every rank still steps; a single leaf leaves all ranks but one owning nothing at all. The
    even partition splits the same leaves to the element."""
    rng = np.random.default_rng(3)
    for like, sizes in (
        ({"a": rng.standard_normal(50).astype(np.float32), "b": rng.standard_normal((4, 3))}, (50, 12)),
        ({"a": rng.standard_normal(50).astype(np.float32)}, (50,)),
    ):
        tx = nba.chain(nba.trace(0.9), nba.scale_by_trust_ratio(), nba.scale(-0.1))  # per leaf
        opt, params, ref_params, state, _ = run_both(tx, nba.chain(dist.allreduce_mean(), tx), like)
        assert opt.partition == "leaves"
        assert_matches(params.tree, ref_params.tree, exact=SIZE <= 2)
        held = COMM.allgather(sum(b.size for b in _buffers(state.inner)))  # the momentum
        assert sum(held) == sum(sizes) and held.count(0) >= SIZE - len(sizes), held
        assert all(h in (0, *sizes, sum(sizes)) for h in held), held

        tx = nba.sgd(0.1, momentum=0.9)  # per element: the even partition
        opt, params, ref_params, state, _ = run_both(tx, nba.chain(dist.allreduce_mean(), tx), like)
        assert opt.partition == "even"
        assert_matches(params.tree, ref_params.tree, exact=SIZE <= 2)
        held = COMM.allgather(sum(b.size for b in _buffers(state.inner)))
        assert sum(held) == sum(sizes) and max(held) - min(held) <= len(sizes), held


def _buffers(state):
    """The buffers of every FlatTree a state holds."""
    if isinstance(state, nba.FlatTree):
        return list(state.buffers.values())
    if isinstance(state, (tuple, list)):
        return [b for x in state for b in _buffers(x)]
    if isinstance(state, dict):
        return [b for x in state.values() for b in _buffers(x)]
    return []


def _state_bytes(state):
    return sum(b.nbytes for b in _buffers(state))


@pytest.mark.parametrize("make", [lambda: nba.adamw(1e-3), lambda: nba.lamb(1e-3)], ids=["even", "leaves"])
def test_shard_state_memory_per_rank_is_about_one_nth(make):
    rng = np.random.default_rng(4)
    like = {f"w{i:02d}": rng.standard_normal((100 + 7 * i, 16)).astype(np.float32) for i in range(24)}
    params = nba.FlatTree.from_tree(like)
    opt = dist.shard(make())
    state = opt.init(params)
    whole = _state_bytes(make().init(params))
    per_rank = COMM.allgather(_state_bytes(state))
    assert sum(per_rank) == whole
    assert max(per_rank) <= whole / SIZE * 1.1 + 1, (per_rank, whole)
    if opt.partition == "even":  # to the element: about one bucket's split apart at most
        assert max(per_rank) - min(per_rank) <= 2 * 4 * (params.layout.size // (4 << 20) + 1), per_rank


def test_partition_is_whole_leaves_balanced_and_in_rank_order():
    lay = nba.FlatTree.from_tree(make_params(half=True)).layout
    for n in (1, 2, 3, 5, 40):
        for bounds, off in zip(partition(lay, n), lay.offsets):
            assert bounds[0] == 0 and bounds[-1] == off[-1] and (np.diff(bounds) >= 0).all()
            assert set(bounds.tolist()) <= set(off.tolist())  # cuts at leaf boundaries only


def test_shard_refuses_whole_tree_reductions_by_name():
    cases = [
        (nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-3)), "clip_by_global_norm"),
        (nba.apply_if_finite(nba.adam(1e-3), 3), "apply_if_finite"),
        (nba.chain(nba.clip_norm(1.0, dim="global"), nba.sgd(0.1)), "dim='global'"),
        (nba.chain(dist.allreduce_mean(), nba.adam(1e-3)), "collective of its own"),
        (
            nba.MultiSteps(nba.chain(nba.normalize_by_update_norm(), nba.sgd(0.1)), 2),
            "normalize_by_update_norm",
        ),
        (nba.flatten(nba.adafactor(1e-3)), "flatten"),
        # noise drawn by position in the one vector: every rank's vector would get the same noise
        (nba.flatten(nba.chain(nba.add_noise(0.1, 0.55, 0), nba.sgd(0.1))), "flatten runs add_noise"),
    ]
    for tx, words in cases:
        with pytest.raises(TypeError, match=words):
            dist.shard(tx)

    class User:
        def init(self, params):
            return ()

        def update(self, updates, state, params=None):
            return updates, state

    with pytest.raises(TypeError, match="not numbaccum's"):
        dist.shard(nba.chain(User(), nba.sgd(0.1)))
    if SIZE > 1:  # a sharded clip over another communicator would combine the wrong norms
        with pytest.raises(ValueError, match="another communicator"):
            dist.shard(nba.chain(dist.clip_by_global_norm(1.0, MPI.COMM_SELF), nba.sgd(0.1)))
    # accepted: per element, per leaf, combinators around them
    dist.shard(nba.MultiSteps(nba.chain(dist.clip_by_global_norm(1.0), nba.lion(1e-4)), 2))
    dist.shard(nba.inject_hyperparams(nba.adamw)(learning_rate=1e-3))
    dist.shard(nba.flatten(nba.adam(1e-3)))
    dist.shard(nba.flatten(nba.inject_hyperparams(nba.adamw)(learning_rate=1e-3)))  # per element inside


def test_shard_takes_inject_hyperparams_with_a_schedule():
    """A schedule's ``init`` and ``update`` are not a transformation's: the stage that runs is
    the per-element one it builds (the even partition), with the data-parallel run's bits."""
    def make():
        return nba.inject_hyperparams(nba.sgd)(learning_rate=nba.linear_schedule(0.1, 0.01, 3), momentum=0.9)

    opt, params, ref_params, state, _ = run_both(make(), nba.chain(dist.allreduce_mean(), make()), make_params())
    assert opt.partition == state.partition == "even"
    assert_matches(params.tree, ref_params.tree, exact=SIZE <= 2)


def test_shard_errors_leave_everything_as_it_was():
    like = make_params()
    opt = dist.shard(nba.adam(1e-2))
    params = nba.FlatTree.from_tree(like)
    state = opt.init(params)
    before = _digest(params, state.inner)
    g = grads_of(RANK, 0, like)
    other = {"w": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="grads"):
        opt.step_(other, state, params)
    with pytest.raises(ValueError, match="params"):
        opt.step_(g, state, nba.FlatTree.from_tree(other))
    with pytest.raises(TypeError, match="ShardedState"):
        opt.step_(g, nba.adam(1e-2).init(params), params)
    with pytest.raises(ValueError, match="rank"):
        opt.step_(g, state._replace(rank=RANK + 1), params)
    frozen = nba.tree_map(np.copy, like)
    frozen["emb"].flags.writeable = False
    with pytest.raises(TypeError, match="emb"):
        opt.step_(g, state, frozen)
    wrong = dist.shard(nba.sgd(0.1, momentum=0.9)).init(params)  # another transformation's state
    with pytest.raises((TypeError, ValueError)):
        opt.step_(g, wrong, params)
    leaves = dist.shard(nba.lamb(1e-2)).init(params)  # the other partition's state
    with pytest.raises(ValueError, match="partition"):
        opt.step_(g, leaves, params)
    with pytest.raises(ValueError, match="partition"):
        dist.shard(nba.lamb(1e-2)).step_(g, state, params)
    assert _digest(params, state.inner) == before
    state = opt.step_(g, state, params)  # and the state still steps
    assert_same_on_every_rank(params)


def test_shard_plain_tree_params_are_changed_in_place():
    like = make_params()
    opt = dist.shard(nba.adam(1e-2))
    params = nba.tree_map(np.copy, like)
    flat = nba.FlatTree.from_tree(like)
    state, state2 = opt.init(params), opt.init(flat)
    for step in range(2):
        state = opt.step_(grads_of(RANK, step, like), state, params)
        state2 = opt.step_(grads_of(RANK, step, like), state2, flat)
    assert_matches(params, flat.tree, exact=True)
    assert_same_on_every_rank(params)


@pytest.mark.parametrize(
    "make, bucket_bytes, kind",
    [(lambda: nba.adamw(1e-2, weight_decay=0.1), 100, "even"),
     (lambda: nba.adamw(1e-2, weight_decay=0.1), None, "even"), (lambda: nba.lamb(1e-2), None, "leaves")],
    ids=["even-small-buckets", "even", "leaves"],
)  # fmt: skip
def test_shard_checkpoint_round_trips(tmp_path_factory, make, bucket_bytes, kind):
    """Each rank saves its part and loads it; the whole state gathered on rank 0 is the data-
    parallel run's state; scattered back, every rank goes on as if nothing had happened."""
    like = make_params(half=True)
    tx = make()
    ref = nba.chain(dist.allreduce_mean(bucket_bytes=bucket_bytes), make())
    opt, params, ref_params, state, ref_state = run_both(tx, ref, like, steps=2, bucket_bytes=bucket_bytes)
    assert opt.partition == state.partition == kind
    d = COMM.bcast(str(tmp_path_factory.mktemp("shard")) if RANK == 0 else None)
    path = os.path.join(d, f"state.{RANK}.npz")
    nba.save_state(path, state)
    loaded = nba.load_state(path)
    assert _digest(loaded.inner) == _digest(state.inner) and loaded.layout is state.layout
    whole = opt.gather_state(state)
    if RANK == 0:
        assert_matches(whole, ref_state[1], exact=SIZE <= 2)
        nba.save_state(os.path.join(d, "whole.npz"), whole)
    else:
        assert whole is None
    COMM.Barrier()
    full = nba.load_state(os.path.join(d, "whole.npz")) if RANK == 0 else None
    scattered = opt.scatter_state(full, params)
    assert _digest(scattered.inner) == _digest(state.inner)
    p2 = params.copy()
    for step in range(2, 4):
        g = grads_of(RANK, step, like)
        state = opt.step_(g, state, params)
        loaded = opt.step_(g, loaded, p2)
        ref_state = nba.step_(ref, g, ref_state, ref_params)
    assert _digest(params) == _digest(p2)
    assert_matches(params.tree, ref_params.tree, exact=SIZE <= 2)
    # a masked state is not laid out per leaf of the params: gather says so, on every rank
    mopt = dist.shard(
        nba.masked(
            nba.adam(1e-2),
            {"dense": {"w": True, "b": False}, "out": [True, False], "empty": False, "emb": True, "h": True},
        )
    )
    with pytest.raises(ValueError, match="per leaf"):
        mopt.gather_state(mopt.init(params))


def test_shard_plain_tree_params_even_partition_resteps_changed_params():
    """The even partition copies this rank's pieces of the params at every step: params changed
    by the caller between steps are what the next step starts from."""
    like = make_params()
    tx = nba.sgd(0.1, momentum=0.9)
    ref = nba.chain(dist.allreduce_mean(bucket_bytes=100), nba.sgd(0.1, momentum=0.9))
    opt = dist.shard(tx, bucket_bytes=100)
    params, ref_params = nba.tree_map(np.copy, like), nba.tree_map(np.copy, like)
    state, ref_state = opt.init(params), ref.init(ref_params)
    for step in range(3):
        g = grads_of(RANK, step, like)
        state = opt.step_(g, state, params)
        ref_state = nba.step_(ref, g, ref_state, ref_params)
        params["emb"] *= np.float32(0.5)  # the caller changes the params between steps
        ref_params["emb"] *= np.float32(0.5)
    assert opt.partition == "even"
    assert_matches(params, ref_params, exact=SIZE <= 2)
    assert_same_on_every_rank(params)


@pytest.mark.skipif(not SIM, reason="CUDA: run with NUMBA_ENABLE_CUDASIM=1 (-k cuda)")
def test_shard_refuses_cuda_buffers():
    opt = dist.shard(nba.adam(1e-2))
    with pytest.raises(TypeError, match="CUDA"):
        opt.init(nba.to_device(nba.FlatTree.from_tree(make_params())))


# --- issue 42, item 9: ranks out of step raise on every rank ------------------------------------

multi_rank = pytest.mark.skipif(SIZE < 2, reason="needs mpiexec -n 2 or more")


def _one_message(e):
    messages = COMM.allgather(str(e.value))
    assert messages == [messages[0]] * SIZE, f"rank {RANK}: another message than rank 0's"
    return messages[0]


@multi_rank
@pytest.mark.parametrize("make", [lambda: nba.adamw(1e-2), lambda: nba.lamb(1e-2)], ids=["even", "leaves"])
def test_shard_in_step_ranks_restored_from_different_steps_raise_on_every_rank(tmp_path, make):
    # Rank 0 resumes its part from step 3, the others from step 2 (each rank saves its own): the
    # step's first collective sees the states' counts differ (before: no error; each rank's part
    # went on with its own count, bias corrections of different steps in one model).
    like = make_params()
    opt = dist.shard(make())
    params = nba.FlatTree.from_tree(like)
    state = opt.init(params)
    for step in range(3):
        state = opt.step_(grads_of(RANK, step, like), state, params)
        nba.save_state(tmp_path / f"state-{step + 1}.npz", state)
    restored = nba.load_state(tmp_path / f"state-{3 if RANK == 0 else 2}.npz")
    before = params.copy()
    with pytest.raises(ValueError, match="out of step") as e:
        opt.step_(grads_of(RANK, 3, like), restored, params)
    message = _one_message(e)
    assert "count 3 on rank 0" in message and f"count 2 on rank{'s' if SIZE > 2 else ''} 1" in message
    assert _digest(params) == _digest(before)  # nothing written
    restored = nba.load_state(tmp_path / "state-3.npz")  # the same step everywhere: in step
    restored = opt.step_(grads_of(RANK, 3, like), restored, params)
    assert_same_on_every_rank(params)


@multi_rank
def test_shard_in_step_multisteps_with_another_k_on_a_rank_raises_at_init_on_every_rank():
    # Before: init passed and each rank's part stepped every k of its own mini-steps.
    k = 3 if RANK == SIZE - 1 else 2
    opt = dist.shard(nba.MultiSteps(nba.adamw(1e-2), k))
    with pytest.raises(ValueError, match="differ between ranks") as e:
        opt.init(make_params())
    message = _one_message(e)
    assert f"MultiSteps(every_k_schedule=3) on rank {SIZE - 1}" in message
    opt = dist.shard(nba.MultiSteps(nba.adamw(1e-2), 2))
    params = nba.FlatTree.from_tree(make_params())
    state = opt.init(params)
    for step in range(3):
        state = opt.step_(grads_of(RANK, step, make_params()), state, params)
    assert_same_on_every_rank(params)
