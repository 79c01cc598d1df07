"""Bounded caches (issue 12, item 3): layouts are interned weakly, everything derived from them
(leaf and slice tables, per-example plans, a stateless transformation's buffers) is kept for a
bounded number of layouts, and a dropped transformation frees its buffers."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import numpy as np
import pytest

import numbaccum as nba
from numbaccum import _config, backend, privacy, tables
from numbaccum._bounded import Bounded
from numbaccum.base import stage_of
from numbaccum.flat import layout_of
from numbaccum.layout import Layout

MB = 1 << 20


@pytest.fixture
def small_bounds(monkeypatch):
    """Bounds small enough that the tests run fast and a leak shows clearly."""
    monkeypatch.setattr(_config, "CACHE_ENTRIES", 16)
    monkeypatch.setattr(_config, "KEPT_LAYOUTS", 4)
    # Entries made under the default bound would stay until evicted: start from empty caches.
    for cache in (privacy._PLANS, backend._LEAF_TABLES):
        cache.clear()


def _growth(run) -> int:
    """Bytes still allocated (tracemalloc, NumPy buffers included) after ``run()``."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_item3_caches_1000_tree_shapes_through_one_clip_keep_memory_bounded(small_bounds):
    # 1,000 shapes of ~100 KB through one clip_by_global_norm kept ~105 MB (a buffer per shape).
    tx = nba.clip_by_global_norm(1.0)
    tx.update({"w": np.ones(8, np.float32)}, nba.EmptyState())  # compile outside the measure

    def run():
        for i in range(1000):
            g = {"w": np.ones(25_000 + i, np.float32), "b": [np.ones(2, np.float32)]}
            out, _ = tx.update(g, nba.EmptyState())
            assert out["w"].shape == (25_000 + i,)

    grew = _growth(run)
    # At most KEPT_LAYOUTS shapes of input and output buffers (4 x 2 x 100 KB) and small tables.
    assert grew < 3 * MB, f"{grew / MB:.1f} MB kept after 1,000 tree shapes"


def test_item3_caches_200_trees_with_1mb_dict_keys_keep_memory_bounded(small_bounds):
    # Every layout keeps its treedef, and with it the dict keys: 200 distinct 1 MB keys kept
    # 136 MB when layouts were cached forever.
    tx = nba.clip_by_global_norm(1.0)
    tx.update({"w": np.ones(3, np.float32)}, nba.EmptyState())
    n_layouts = len(Layout._cache)

    def run():
        for i in range(200):
            key = str(i) + "k" * MB
            g = {key: np.full(3, 2.0, np.float32)}
            out, _ = tx.update(g, nba.EmptyState())
            assert float(nba.global_norm(out)) <= 1.0 + 1e-6
            nba.ema(0.9).init(g)

    grew = _growth(run)
    # Held: the keys of the layouts still in the bounded caches (16 leaf tables, 4 kept).
    assert grew < 30 * MB, f"{grew / MB:.1f} MB kept after 200 trees with 1 MB keys"
    assert len(Layout._cache) <= n_layouts + _config.CACHE_ENTRIES + _config.KEPT_LAYOUTS + 2


def test_item3_caches_1000_batch_sizes_keep_the_per_example_plan_cache_bounded(small_bounds):
    # Poisson-sampled DP-SGD sees a new batch size almost every step: one plan per batch size.
    params = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    tx = nba.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0)
    agg = nba.differentially_private_aggregate(1.0, 0.0, seed=1)
    s, sa = tx.init(params), agg.init(params)

    def run():
        nonlocal s, sa
        for b in range(1, 1001):
            g = {"w": np.ones((b, 3, 2), np.float32), "b": np.ones((b, 2), np.float32)}
            if b % 8 == 0:
                _, s = tx.update(g, s)
            u, sa = agg.update(g, sa)
            # each example's norm is sqrt(8) > 1: clipped to 1, summed, averaged
            np.testing.assert_allclose(u["b"], np.full(2, 1 / np.sqrt(8), np.float32), rtol=1e-5)
            assert len(privacy._PLANS) <= _config.CACHE_ENTRIES

    run()
    # Unbounded, the plans and slice tables of 1,000 batch sizes took ~90 MB; bounded, 16 of each.
    assert len(privacy._PLANS) <= _config.CACHE_ENTRIES
    assert len(tables._CACHE) <= _config.CACHE_ENTRIES
    held = sum(p.runs[0].nbytes + p.example_sizes.nbytes for p in privacy._PLANS.values())
    held += sum(t.rows.nbytes for t in tables._CACHE.values())
    assert held < 4 * MB, f"{held / MB:.1f} MB held after 1,000 batch sizes"


def test_item3_caches_a_dropped_transformation_frees_its_buffers():
    tx = nba.clip_by_global_norm(1.0)
    g = {"w": np.ones(1000, np.float32) * 5}
    out, _ = tx.update(g, nba.EmptyState())
    stage = stage_of(tx)
    layout = layout_of(g, "g")
    kept = weakref.ref(stage.kept("output", layout, False))
    assert kept() is not None
    del tx, stage, out
    gc.collect()
    assert kept() is None


def test_item3_caches_layouts_are_freed_when_nothing_holds_them():
    before = len(Layout._cache)
    states = [nba.ema(0.9).init({"x": np.ones(i + 1000, np.float32)}) for i in range(50)]
    assert len(Layout._cache) >= before + 50
    same = nba.ema(0.9).init({"x": np.ones(1000, np.float32)})
    assert same.ema.layout is states[0].ema.layout  # interned while held
    del states, same
    gc.collect()
    assert len(Layout._cache) <= before + _config.CACHE_ENTRIES


def test_item3_caches_bounded_evicts_the_oldest():
    c = Bounded(3)
    for k in "abc":
        assert c.put(k, k.upper()) == k.upper()
    assert c.get("a") == "A"
    c.put("d", "D")
    assert "a" not in c and len(c) == 3 and c.get("b") == "B"
    assert c.put("b", "other") == "B"  # the first value stored wins (threads share it)
    assert c.get("zz") is None
