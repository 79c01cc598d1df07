"""Returned updates are the caller's: no later call writes into what the caller still holds.

optax's arrays are immutable, and code ported from it keeps updates in a list, runs one
optimizer for two models (a GAN's generator and discriminator, an actor and a critic), or hands
updates to another thread. numbaccum writes its updates into workspaces it reuses; a workspace
is reused only while nothing holds what it returned last (`numbaccum._loans`). These tests hold
updates in each way a user can (the tree, one leaf, a slice of a leaf, a FlatTree) across
later calls of every registered transformation, and check the common loop stays
allocation-free.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _testutil import assert_tree_equal, snapshot
from registry import CASES, sweep

import numbaccum as nba
from numbaccum.flat import FlatTree


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
        "d": rng.standard_normal(2),
    }


def _grads(model: int, step: int, per_example: bool = False) -> dict:
    g = _tree(100 * model + step + 1)
    if per_example:  # a batch of two examples' gradients
        g = {k: np.stack([v, 0.5 * v]) for k, v in g.items()}
    return g


@pytest.mark.parametrize("name", sweep(sorted(CASES)))  # every Case in the exhaustive step
def test_updates_kept_from_every_transformation_keep_their_values(name):
    """Two models on one transformation, their updates kept in a list, one leaf and one slice
    of a leaf kept alone, then a ``step_`` of a third model: every kept value is as returned."""
    tx = CASES[name].make()
    batch = CASES[name].per_example
    params = [_tree(1), _tree(2), _tree(3)]
    states = [tx.init(p) for p in params]
    kept, copies = [], []
    for step in range(3):
        for m in (0, 1):
            u, states[m] = tx.update(_grads(m, step, batch), states[m], params[m])
            kept.append(u)
            copies.append(snapshot(u))
    leaf = kept[0]["w"]
    part = kept[1]["b"][1:3]
    leaf_copy, part_copy = leaf.copy(), part.copy()
    del kept[:2]
    del copies[:2]
    u, states[0] = tx.update(_grads(0, 9, batch), states[0], params[0])
    states[2] = nba.step_(tx, _grads(2, 0, batch), states[2], params[2])
    for k, (u, c) in enumerate(zip(kept, copies)):
        assert_tree_equal(u, c, msg=f"{name}: kept update {k + 2}")
    np.testing.assert_array_equal(leaf, leaf_copy, err_msg=f"{name}: a kept leaf")
    np.testing.assert_array_equal(part, part_copy, err_msg=f"{name}: a kept slice of a leaf")


def test_the_two_models_example_gives_each_model_its_own_update():
    """The example of the issue: a stateless optimizer shared by two models."""
    g_params, d_params = {"w": np.ones(3, np.float32)}, {"w": np.ones(3, np.float32)}
    opt = nba.chain(nba.clip_by_global_norm(10.0), nba.sgd(0.1))
    sg, sd = opt.init(g_params), opt.init(d_params)
    ug, sg = opt.update({"w": np.ones(3, np.float32)}, sg, g_params)
    ud, sd = opt.update({"w": np.full(3, 5.0, np.float32)}, sd, d_params)
    np.testing.assert_array_equal(ug["w"], np.full(3, -0.1, np.float32))
    np.testing.assert_array_equal(ud["w"], np.full(3, -0.5, np.float32))


@pytest.mark.parametrize("make", [lambda: nba.sgd(0.1), lambda: nba.adamw(1e-2)], ids=["sgd", "adamw"])
def test_flat_tree_updates_are_kept_too(make):
    tx = make()
    params = FlatTree.from_tree(_tree(1))
    state = tx.init(params)
    kept = []
    for step in range(3):
        u, state = tx.update(FlatTree.from_tree(_grads(0, step)), state, params)
        kept.append((u, snapshot(u)))
    groups = kept[0][0].groups  # a group of a FlatTree the caller dropped
    first = [g.copy() for g in groups]
    del kept[0]
    for step in range(3, 5):
        _, state = tx.update(FlatTree.from_tree(_grads(0, step)), state, params)
    for u, c in kept:
        assert_tree_equal(u, c)
    for g, c in zip(groups, first):
        np.testing.assert_array_equal(g, c)


def test_the_common_loop_alternates_two_buffers_and_allocates_nothing(monkeypatch):
    """``updates, state = update(...)`` holds the last updates while the next call runs: that
    call writes the other buffer of the pair, and no step after the first two allocates."""
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-3))
    params = _tree(1)
    state = tx.init(params)
    made = []
    counting = [False]
    empty = FlatTree.empty.__func__

    def counted(cls, *args, **kwargs):
        if counting[0]:
            made.append(args[0] if args else None)
        return empty(cls, *args, **kwargs)

    monkeypatch.setattr(FlatTree, "empty", classmethod(counted))
    addresses = set()
    updates = None
    for step in range(8):
        counting[0] = step >= 3  # inside update only (apply_updates_ packs a plain tree's params)
        updates, state = tx.update(_grads(0, step), state, params)
        counting[0] = False
        nba.apply_updates_(params, updates)
        addresses.add(updates["w"].__array_interface__["data"][0])
    assert made == [], f"{len(made)} buffers allocated in steady steps"
    assert len(addresses) == 2


@pytest.mark.parametrize(
    "name", ["sgd", "trace", "adamw", "clip_by_global_norm", "masked_trace", "multi_transform", "partition"]
)
def test_the_common_loop_prepares_no_launch_in_steady_steps(name, monkeypatch):
    """The loop that holds its last updates while it asks for the next writes a workspace and
    its spare by turns: the kept launches for both stay prepared (they were prepared again every
    step, a few microseconds of a small tree's update), and its numbers are those of a loop that
    drops each update."""
    from numbaccum.cpu import driver

    tx, dropping = CASES[name].make(), CASES[name].make()
    params, params2 = _tree(1), _tree(1)
    state, state2 = tx.init(params), dropping.init(params2)
    prepare, prepared = driver.prepare, []
    monkeypatch.setattr(driver, "prepare", lambda *a: (prepared.append(a[0]), prepare(*a))[1])
    updates = None
    for step in range(8):
        if step == 4:
            prepared.clear()
        updates, state = tx.update(_grads(0, step), state, params)
        nba.apply_updates_(params, updates)
        u2, state2 = dropping.update(_grads(0, step), state2, params2)
        nba.apply_updates_(params2, u2)
        del u2
    assert prepared == [], [f.name for f in prepared]
    assert_tree_equal(params, params2)


@pytest.mark.parametrize("name", ["sgd", "trace", "adamw"])
def test_kept_launches_keep_no_earlier_gradients_of_the_caller_alive(name):
    """New FlatTrees of gradients each step: only the last one's launch is kept (the pair kept
    for the common loop is of the library's own lent buffers), so the caller's earlier gradients
    are freed as soon as the caller drops them."""
    import gc
    import weakref

    tx = CASES[name].make()
    params = _tree(1)
    state = tx.init(params)
    gone = []
    for step in range(6):
        g = FlatTree.from_tree(_grads(0, step))
        gone.append([weakref.ref(b) for b in g.buffers.values()])
        updates, state = tx.update(g, state, params)
        del g
    gc.collect()
    assert [all(r() is None for r in refs) for refs in gone[:-1]] == [True] * 5


@pytest.mark.parametrize("chained", [False, True])
def test_user_code_keeps_the_updates_it_was_given(chained):
    """User code is handed the settled updates in a workspace lent to it: code that keeps them
    (in a list, as optax code may keep JAX's immutable arrays) keeps their values, and code that
    modifies them in place changes nothing numbaccum reads afterwards."""
    given, seen = [], []

    def keep(updates, state, params=None):
        given.append(updates)
        seen.append(snapshot(updates))
        updates["w"] *= 2.0  # its own, for this call
        return {k: v.copy() for k, v in updates.items()}, state

    user = nba.GradientTransformation(lambda p: (), keep)
    tx = nba.chain(nba.trace(0.5), user, nba.scale(-1.0)) if chained else user
    params = _tree(1)
    state = tx.init(params)
    for step in range(4):
        updates, state = tx.update(_grads(0, step), state, params)
        expect = snapshot(given[-1])
        if chained:
            expect = {k: -v for k, v in expect.items()}
        assert_tree_equal(updates, expect)
    for g, s in zip(given, seen):
        s["w"] = s["w"] * 2.0
        assert_tree_equal(g, s)


def test_states_declared_on_one_thread_and_updated_on_two_keep_their_own_numbers():
    """Two states of one chain with user code, their plans made on the main thread, then
    updated at once on two threads, both inside the user code together: each thread's updates
    are those of the same steps run alone (a workspace of the declaration, not of the thread
    that declared it)."""
    barrier = threading.Barrier(2, timeout=10)
    together = [False]

    def meet(updates, state, params=None):
        if together[0]:
            barrier.wait()  # both threads hold what they were given here
            barrier.wait()
        return updates, state

    tx = nba.chain(nba.trace(0.5), nba.GradientTransformation(lambda p: (), meet), nba.scale(-1.0))
    params = [_tree(1), _tree(2)]
    states = [tx.init(p) for p in params]
    for m in (0, 1):
        _, states[m] = tx.update(_grads(m, 0), states[m], params[m])
    expect = []
    for m in (0, 1):
        s = nba.copy_state(states[m])
        u = []
        for step in range(1, 4):
            out, s = tx.update(_grads(m, step), s, params[m])
            u.append(snapshot(out))
        expect.append(u)
    got: list = [[], []]
    errors = []

    def work(m):
        try:
            s = states[m]
            for step in range(1, 4):
                out, s = tx.update(_grads(m, step), s, params[m])
                got[m].append(snapshot(out))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    together[0] = True
    threads = [threading.Thread(target=work, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for m in (0, 1):
        for a, b in zip(got[m], expect[m]):
            assert_tree_equal(a, b)


def test_a_dropped_update_frees_its_buffer_for_the_next_call():
    tx = nba.sgd(0.1)
    params = _tree(1)
    state = tx.init(params)
    addresses = []
    for step in range(4):
        u, state = tx.update(_grads(0, step), state, params)
        addresses.append(u["w"].__array_interface__["data"][0])
        del u
    assert len(set(addresses)) == 1


def test_threads_sharing_one_transformation_keep_their_own_updates():
    """Each thread updates its own state of one shared transformation and keeps every update."""
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.sgd(0.1, momentum=0.9))
    errors = []
    barrier = threading.Barrier(3)

    def work(t: int) -> None:
        try:
            params = _tree(t)
            state = tx.init(params)
            kept = []
            barrier.wait()
            for step in range(20):
                u, state = tx.update(_grads(t, step), state, params)
                kept.append((u, snapshot(u)))
            for u, c in kept:
                assert_tree_equal(u, c, msg=f"thread {t}")
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]


def test_a_kept_update_changed_by_the_caller_is_not_read_back():
    """The returned containers are new each call: changing one does not change the next."""
    tx = nba.sgd(1.0)
    params = _tree(1)
    state = tx.init(params)
    u, state = tx.update(_grads(0, 0), state, params)
    u["w"] = np.zeros(1)
    u["extra"] = 1
    del u
    u, state = tx.update(_grads(0, 1), state, params)
    assert sorted(u) == ["b", "d", "w"]
    np.testing.assert_array_equal(u["w"], -_grads(0, 1)["w"])


@pytest.mark.cuda  # skipped without a GPU or the simulator (tests/conftest.py)
@pytest.mark.parametrize("flat", [False, True], ids=["numba arrays", "FlatTree"])
def test_updates_kept_on_the_device_keep_their_values(flat):
    """The same on a CUDA device: a device view of a kept leaf keeps its buffer from reuse."""
    tx = nba.chain(nba.clip_by_global_norm(10.0), nba.sgd(0.1))
    params = nba.to_device(_tree(1))
    grads = [nba.to_device(_grads(m, 0)) for m in (0, 1, 2)]
    if flat:
        params = FlatTree.from_tree(params)
        grads = [FlatTree.from_tree(g) for g in grads]
    state = tx.init(params)
    kept = []
    for g in grads:
        u, state = tx.update(g, state, params)
        kept.append((u, snapshot(nba.to_host(u))))
    part = kept[0][0]["w"][1:2]
    part_copy = nba.to_host(part).copy()
    del kept[0]
    _, state = tx.update(grads[0], state, params)
    for u, c in kept:
        assert_tree_equal(nba.to_host(u), c)
    np.testing.assert_array_equal(nba.to_host(part), part_copy)
