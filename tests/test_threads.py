"""Threads (issue 12, item 2): layout interning and the module caches under concurrent use, a
transformation shared by threads, and a state used by two threads at once (detected).

Every test runs many threads with a tiny switch interval, so that the interpreter changes thread
between almost any two bytecodes.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import reference as ref

import numbaccum as nba
from numbaccum.flat import FlatTree
from numbaccum.layout import Layout
from numbaccum.tree import tree_flatten

THREADS = 12


@pytest.fixture(autouse=True)
def tiny_switch_interval():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_threads(target, n: int = THREADS) -> list:
    """Runs ``target(i)`` on ``n`` threads started together; returns the results in order and
    re-raises the first exception a thread raised."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_item2_threads_init_race_gives_one_layout():
    # The reproduction: chain(trace, ema).init on one new tree from many threads at once;
    # every sub-state must share the one interned layout, and updates must work.
    for trial in range(2):
        tree = {f"k{trial}_{i}": np.ones(1, np.float32) for i in range(5_000)}
        tx = nba.chain(nba.trace(0.9), nba.ema(0.9))
        states = run_threads(lambda i, tx=tx, tree=tree: tx.init(tree))
        layouts = {id(s.layout) for st in states for s in _flat_trees(st)}
        assert len(layouts) == 1
        tx.update(tree, states[0])  # no "layout does not match"


def _flat_trees(state):
    if isinstance(state, FlatTree):
        yield state
    elif isinstance(state, (tuple, list)):
        for s in state:
            yield from _flat_trees(s)


def test_item2_threads_layout_get_interns_one_object():
    td = tree_flatten({"a": 0, "b": 0})[1]
    for n in range(20):
        shapes = [(n + 1,), (n + 2, 3)]
        got = run_threads(lambda i, shapes=shapes: Layout.get(td, shapes, [np.float32, np.float64]))
        assert all(g is got[0] for g in got)


def test_item2_threads_shared_stateless_transformation_keeps_each_threads_shape():
    # One clip_by_global_norm shared by threads feeding two tree shapes: each thread gets its
    # own shape and clip_by_global_norm's values (tests/reference.py), never the other's.
    tx = nba.clip_by_global_norm(1.0)
    rng = np.random.default_rng(0)
    trees = [
        {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)},
        {"x": [rng.normal(size=7).astype(np.float64), rng.normal(size=(2, 2)).astype(np.float32)]},
    ]
    wants = [ref.scale_slices(t, dim="global", max_norm=1.0) for t in trees]
    for t in trees:  # compile outside the threads
        tx.update(t, nba.EmptyState())

    def work(i: int) -> int:
        tree, want = trees[i % 2], wants[i % 2]
        for _ in range(60):
            out, _ = tx.update(tree, nba.EmptyState())
            got, got_def = ref.tree_flatten(out)
            exp, exp_def = ref.tree_flatten(want)
            assert got_def == exp_def, "a tree shaped like the other thread's"
            for g, e in zip(got, exp):
                np.testing.assert_array_equal(g, e)
                assert g.dtype == e.dtype
        return i

    assert run_threads(work) == list(range(THREADS))


@pytest.mark.parametrize(
    "make",
    [lambda: nba.chain(nba.clip_by_global_norm(1.0), nba.trace(0.9)), lambda: nba.adam(1e-2)],
    ids=["chain", "adam"],
)
def test_item2_threads_shared_transformation_with_per_thread_states_is_bitwise(make):
    tx = make()
    rng = np.random.default_rng(1)
    grads = [
        {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}
        for _ in range(THREADS)
    ]

    def run(i: int, t) -> list:
        s = t.init(grads[i])
        outs = []
        for step in range(40):
            g = {k: v * np.float32(1 + step % 3) for k, v in grads[i].items()}
            u, s = t.update(g, s, g)
            outs.append({k: np.array(v) for k, v in u.items()})
        return outs

    alone = [run(i, make()) for i in range(THREADS)]
    together = run_threads(lambda i: run(i, tx))
    for a, b in zip(alone, together):
        for x, y in zip(a, b):
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])


def test_item2_threads_module_caches_are_safe():
    # Many threads filling the per-layout caches at once (leaf tables, slicings, per-example
    # plans) on distinct new layouts: each gets its own correct result.
    def work(i: int) -> None:
        for j in range(20):
            g = {"p": np.full((i + 2, j + 1), 2.0, np.float32)}
            np.testing.assert_allclose(float(nba.global_norm(g)), 2.0 * np.sqrt((i + 2) * (j + 1)), rtol=1e-6)
            out, _ = nba.clip_norm(1.0, dim=0).update(g, nba.EmptyState())
            np.testing.assert_allclose(np.linalg.norm(out["p"], axis=0), 1.0, rtol=1e-5)

    run_threads(work)


def test_item2_threads_state_used_by_two_threads_at_once_raises():
    # A state is not thread-safe: an update of a state whose update is running on another
    # thread raises RuntimeError instead of giving wrong counts silently.
    tx = nba.ema(0.9)
    g = FlatTree.from_tree({"w": np.ones(200_000, np.float32)})
    cur = [tx.init(g)]  # the current state, shared by the threads
    busy: list = []

    def work(i: int) -> None:
        for _ in range(30):
            try:
                cur[0] = tx.update(g, cur[0])[1]
            except RuntimeError as e:
                assert "another thread" in str(e)
                busy.append(e)
            except ValueError as e:  # another thread advanced the state it read: stale
                assert "stale" in str(e)

    run_threads(work, 4)
    assert busy, "no concurrent use of one state was detected"
    u, s2 = tx.update(g, cur[0])  # the state is usable again once nobody runs it


def test_item2_threads_busy_flag_is_cleared_after_an_error():
    tx = nba.ema(0.9)
    g = {"w": np.ones(3, np.float32)}
    s = tx.init(g)
    with pytest.raises(ValueError):
        tx.update({"w": np.ones(4, np.float32)}, s)
    tx.update(g, s)  # not left marked busy


def test_threads_norms_of_one_layout_each_get_their_own_trees_norm():
    """The host sum of squares is prepared once per layout and remembers the buffer it last ran
    on (`cpu.reduce.prepared`): threads taking norms of different trees of one layout, over and
    over, each get their own tree's norm, never another's."""
    trees = [
        FlatTree.from_tree({"a": np.full((3, 4), i + 1, np.float32), "b": np.full(5, -i, np.float32)})
        for i in range(THREADS)
    ]
    want = [nba.global_norm(t) for t in trees]
    assert len(set(want)) == THREADS

    def work(i):
        return [nba.global_norm(trees[i]) for _ in range(200)]

    for i, got in enumerate(run_threads(work)):
        assert got == [want[i]] * 200
