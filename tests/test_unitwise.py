"""optax's unit-wise family: unitwise_norm, unitwise_clip, adaptive_grad_clip (optax.md 3.6 and
the _clipping_test.py vectors of section 4), against the NumPy reference on random trees."""

import numpy as np
import pytest
import reference as ref
from _testutil import assert_tree_close, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import tree_sequences

import numbaccum as nba

SETUP_UPDATES = (np.array([500.0, 5.0], np.float32), np.array([300.0, 3.0], np.float32))
SETUP_PARAMS = (np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32))


def agc(updates, params, clipping, **kw):
    tx = nba.adaptive_grad_clip(clipping, **kw)
    u, _ = tx.update(updates, tx.init(params), params)
    return nba.tree_map(np.copy, u)


def test_unitwise_norm_vectors():
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    out = nba.unitwise_norm(x)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_allclose(out, [[3.1622777, 4.472136]] * 2, rtol=1e-7)
    np.testing.assert_array_equal(nba.unitwise_norm(np.array([3.0, 4.0])), [5.0, 5.0])
    np.testing.assert_array_equal(nba.unitwise_norm(np.array(-2.0)), 2.0)
    # (1, 3) squeezes to a vector: one norm for the whole array
    np.testing.assert_allclose(nba.unitwise_norm(np.array([[3.0, 4.0, 12.0]])), [[13.0] * 3])


def test_unitwise_norm_rank_rules_and_axis():
    x = np.arange(96, dtype=np.float64).reshape(2, 2, 2, 3, 4)
    for axis in (0, 1, 4, -1, (0, 1), (0, 1, 2), (0, 1, 2, 3), (1, 3)):
        out = nba.unitwise_norm(x, axis=axis)
        assert out.shape == x.shape
        np.testing.assert_allclose(
            out, np.broadcast_to(np.sqrt(np.sum(x**2, axis=axis, keepdims=True)), x.shape)
        )
    np.testing.assert_array_equal(
        nba.unitwise_norm(x), nba.unitwise_norm(x, axis=(0, 1, 2, 3))
    )  # 5-D default
    r3 = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    np.testing.assert_array_equal(
        nba.unitwise_norm(r3), nba.unitwise_norm(r3, axis=0)
    )  # the code, not the doc
    r4 = r3.reshape(2, 3, 2, 2)
    np.testing.assert_array_equal(nba.unitwise_norm(r4), nba.unitwise_norm(r4, axis=(0, 1, 2)))
    with pytest.raises(ValueError, match="rank"):
        nba.unitwise_norm(np.ones((2, 2, 2, 2, 2, 2)))
    np.testing.assert_array_equal(nba.unitwise_norm(np.ones((2,) * 6), axis=5), np.full((2,) * 6, np.sqrt(2)))
    with pytest.raises(ValueError, match="axis"):
        nba.unitwise_norm(np.ones((2, 3)), axis=2)


def test_unitwise_clip():
    g = np.array([[3.0, 4.0], [0.0, 1.0]], np.float32)
    out = nba.unitwise_clip(np.full((2, 2), 5.0, np.float32), np.full((2, 2), 2.0, np.float32), g)
    np.testing.assert_allclose(out, g * 0.4, rtol=1e-7)
    same = nba.unitwise_clip(np.full((2, 2), 1.0), np.full((2, 2), 2.0), g)
    np.testing.assert_array_equal(same, g)
    tiny = nba.unitwise_clip(np.zeros(2), np.zeros(2), np.array([1.0, 1.0]))  # max(., div_eps)
    np.testing.assert_array_equal(tiny, [0.0, 0.0])
    with pytest.raises(ValueError, match="shape"):
        nba.unitwise_clip(np.ones(2), np.ones(3), np.ones(2))


def test_adaptive_grad_clip_vectors():
    g = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    out = agc(g, np.ones((2, 2), np.float32), 1.0)
    np.testing.assert_allclose(out, [[0.4472136, 0.6324555], [1.3416407, 1.2649111]], rtol=1e-6)
    out = agc(np.array([0.5, 0.5], np.float32), np.zeros(2, np.float32), 1.0)  # the eps floor
    np.testing.assert_allclose(out, [7.071e-4, 7.071e-4], rtol=1e-4)
    out = agc(SETUP_UPDATES, SETUP_PARAMS, 0.5)  # the reference prints 8 significant digits
    np.testing.assert_allclose(out[0], [1.1179781, 0.0111798], rtol=5e-6)
    np.testing.assert_allclose(out[1], [2.4998751, 0.0249988], rtol=5e-6)


def test_adaptive_grad_clip_loop_like_optax_test():
    updates = SETUP_UPDATES
    for i in range(1, 51):
        clip_r = 1.0 / i
        updates = agc(updates, SETUP_PARAMS, clip_r)
        for u, p in zip(updates, SETUP_PARAMS):
            assert np.all(nba.unitwise_norm(u) - clip_r * nba.unitwise_norm(p) < 1e-6)
        again = agc(updates, SETUP_PARAMS, clip_r)
        for a, b in zip(again, updates):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_adaptive_grad_clip_with_axis_and_5d_default():
    conv = 2 * np.ones((2, 2, 2, 3, 4), np.float32)
    p = np.ones_like(conv)
    out = agc(conv, p, 0.5, axis=(0, 1, 2))
    bound = 0.5 * nba.unitwise_norm(p, axis=(0, 1, 2)) + 1e-6
    assert np.all(nba.unitwise_norm(out, axis=(0, 1, 2)) <= bound)
    np.testing.assert_array_equal(agc(conv, p, 0.5), agc(conv, p, 0.5, axis=(0, 1, 2, 3)))
    lin = 3 * np.ones((5, 6), np.float32)
    out = agc(lin, np.ones_like(lin), 0.5, axis=0)
    assert np.all(nba.unitwise_norm(out, axis=0) <= 0.5 * nba.unitwise_norm(np.ones_like(lin), axis=0) + 1e-6)
    small = 0.1 * np.ones((5, 6), np.float32)
    np.testing.assert_allclose(agc(small, np.ones_like(small), 2.0), small, rtol=1e-6)


def test_adaptive_grad_clip_errors_touch_nothing():
    tx = nba.adaptive_grad_clip(0.1)
    g = {"w": np.ones((2, 3)), "b": np.ones(3)}
    before = snapshot(g)
    with pytest.raises(ValueError, match="params"):
        tx.update(g, tx.init(g))
    deep = {"k": np.ones((2,) * 6)}
    with pytest.raises(ValueError, match=r"updates\['k'\].*rank"):
        tx.update(deep, tx.init(deep), deep)
    with pytest.raises(ValueError, match="axis"):
        nba.adaptive_grad_clip(0.1, axis="rows")
    for a, b in zip(ref.tree_leaves(g), ref.tree_leaves(before)):
        np.testing.assert_array_equal(a, b)


@settings(deadline=None, max_examples=30)
@given(
    tree_sequences(min_steps=1, max_steps=1), st.sampled_from([0.01, 0.5, 2.0]), st.sampled_from([1e-3, 1.0])
)
def test_adaptive_grad_clip_matches_reference(seq, clipping, eps):
    params, (grads,) = seq
    got = agc(grads, params, clipping, eps=eps)
    assert_tree_close(got, ref.adaptive_grad_clip(grads, params, clipping, eps), rtol=2e-6, atol_rel=1e-6)


def test_adaptive_grad_clip_in_a_chain_with_params():
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    g = nba.tree_map(lambda x: 5 * x + 1, p)
    tx = nba.chain(nba.adaptive_grad_clip(0.01), nba.sgd(1.0))
    u, _ = tx.update(g, tx.init(p), p)
    want = nba.tree_map(lambda x: -x, ref.adaptive_grad_clip(g, p, 0.01))
    assert_tree_close(u, want, rtol=2e-6, atol_rel=1e-6)
