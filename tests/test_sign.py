"""scale_by_sign and sign_sgd (the transformation added by following CONTRIBUTING.md) against the
plain NumPy reference, on random trees and on the edge values of a sign: +-0, NaN, +-inf."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
import strategies as strat
from _testutil import assert_tree_close, assert_tree_equal, snapshot
from hypothesis import HealthCheck, given, settings

import numbaccum as nba

SETTINGS = settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=strat.tree_sequences(min_steps=1, max_steps=3))
@pytest.mark.parametrize(
    "make",
    [
        (lambda: nba.scale_by_sign(), lambda: ref.scale_by_sign()),
        (lambda: nba.sign_sgd(0.1), lambda: ref.sign_sgd(0.1)),
        (lambda: nba.sign_sgd(lambda c: 0.1 / (1 + c)), lambda: ref.sign_sgd(lambda c: 0.1 / (1 + c))),
    ],
    ids=["scale_by_sign", "sign_sgd", "sign_sgd_schedule"],
)
def test_matches_reference(make, data):
    params, grads = data
    tx, rtx = make[0](), make[1]()
    s, rs = tx.init(params), rtx.init(params)
    for g in grads:
        before = snapshot(g)
        u, s = tx.update(g, s)
        ru, rs = rtx.update(g, rs)
        assert_tree_close(u, ru)
        assert_tree_equal(g, before)  # the gradient is read, never written


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_edge_values(dtype):
    g = {"x": np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 3.5, -1e-30, 7e-45], dtype)}
    u, _ = nba.scale_by_sign().update(g, nba.EmptyState())
    want = np.array([-0.0, 0.0, np.nan, 1, -1, 1, -1 if dtype != np.float16 else -0.0, 1], dtype)
    if dtype != np.float64:  # 7e-45 is a float32 subnormal and 0 in float16
        want[7] = 1 if dtype == np.float32 else 0.0
    np.testing.assert_array_equal(u["x"], want)
    assert np.array_equal(np.signbit(u["x"]), np.signbit(want))  # -0 stays -0
    assert u["x"].dtype == dtype


def test_a_pending_factor_is_applied_before_the_sign():
    g = {"x": np.array([1.0, -2.0, 3.0], np.float32)}
    tx = nba.chain(nba.clip_by_global_norm(1e-3), nba.scale_by_sign())  # the clip rides on the sign
    u, _ = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(u["x"], [1, -1, 1])
