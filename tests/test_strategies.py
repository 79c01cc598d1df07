"""The random trees of tests/strategies.py reach real work (they are what most tests run on).

Issue 22: the median tree had 2 elements, a quarter of the draws were all zeros or empty, and no
leaf reached the parallel kernels. Measured here over a few hundred derandomized draws.
"""

from __future__ import annotations

import numpy as np
import strategies as strat
from _testutil import leaves
from hypothesis import HealthCheck, given, settings

from numbaccum import _config


def _draws(strategy, n: int = 300) -> list:
    out = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out


def test_trees_have_many_distinct_nonzero_values_and_some_reach_the_parallel_kernels():
    trees = _draws(strat.trees())
    sizes = np.array([sum(np.size(x) for x in leaves(t)) for t in trees])
    dull = 0
    for t in trees:
        flat = np.concatenate([np.ravel(x).astype(np.float64) for x in leaves(t)] + [np.zeros(0)])
        dull += not np.any(flat != 0)
    assert np.median(sizes) >= 20, f"median tree size {np.median(sizes)}"
    assert dull / len(trees) < 0.1, f"{dull} of {len(trees)} trees are empty or all zeros"
    big = sum(any(np.size(x) >= _config.SERIAL_BELOW for x in leaves(t)) for t in trees)
    assert big >= len(trees) // 40, f"only {big} of {len(trees)} trees reach the parallel kernels"
    assert strat.BIG_LEAF >= _config.SERIAL_BELOW


def test_leaf_values_are_not_one_repeated_value():
    spec = strat.LeafSpec((7, 5), np.dtype(np.float32))
    arrays = _draws(strat.leaf_arrays(spec), 100)
    distinct = np.median([len(np.unique(a)) for a in arrays])
    assert distinct >= 10, f"a (7, 5) leaf has a median of {distinct} distinct values"


def test_big_false_leaves_out_the_big_leaves():
    trees = _draws(strat.trees(big=False), 150)
    assert max(max((np.size(x) for x in leaves(t)), default=0) for t in trees) < _config.SERIAL_BELOW
