"""clip_by_global_norm: optax's vectors (reference/optax.md 3.3), the documented fixes, and
composition with the accumulation transformations."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from strategies import trees

import numbaccum as nba


def clip(tree, max_norm):
    tx = nba.clip_by_global_norm(max_norm)
    u, _ = tx.update(tree, tx.init(tree))
    return nba.tree_map(np.copy, u)


@pytest.mark.parametrize(
    "g, max_norm, expected",
    [
        ([3.0, 4.0], 5.0, [3.0, 4.0]),  # norm == max_norm: the clip branch, exact here
        ([3.0, 4.0], 1.0, [0.6000000238, 0.8000000119]),
        ([0.0, 0.0, 0.0], 1.0, [0.0, 0.0, 0.0]),
        ([3.0, 4.0], 0.0, [0.0, 0.0]),
        ([np.nan, 1.0], 1.0, [np.nan, np.nan]),
        ([np.inf, 1.0], 1.0, [np.nan, 0.0]),
    ],
)
def test_optax_edge_cases(g, max_norm, expected):
    out = clip(np.array(g, np.float32), max_norm)
    np.testing.assert_allclose(out, np.array(expected, np.float32), rtol=1e-7)


def test_tree_and_setup_vectors():
    out = clip((np.array([3.0], np.float32), np.array([4.0], np.float32)), 2.5)
    np.testing.assert_array_equal(out[0], [1.5])
    np.testing.assert_array_equal(out[1], [2.0])
    setup = (np.array([500.0, 5.0], np.float32), np.array([300.0, 3.0], np.float32))
    np.testing.assert_allclose(nba.global_norm(setup), 583.12433, rtol=1e-7)
    out = clip(setup, 1.0)
    np.testing.assert_allclose(out[0], [0.85745007, 0.0085745], rtol=1e-6)
    np.testing.assert_allclose(out[1], [0.51447004, 0.0051447], rtol=1e-6)


def test_max_norm_zero_with_a_tiny_norm_gives_zeros_in_every_dtype():
    """A float64 leaf makes the norm 2e-276; the float32 leaf's pending factor must not round
    its divisor to 0 (0 / 0 = NaN): max_norm=0 gives zeros."""
    g = {"a": np.array(2.04301765e-276), "b": np.zeros(3, np.float32)}
    tx = nba.clip_by_global_norm(0.0)
    u, _ = tx.update(g, tx.init(g))
    assert np.array_equal(u["a"], 0.0) and np.array_equal(u["b"], np.zeros(3, np.float32))


def test_float32_recipe_is_divide_then_multiply():
    g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    norm = np.float32(np.sqrt(np.sum(g.astype(np.float64) ** 2)))
    np.testing.assert_array_equal(clip(g, 1.0), (g / norm) * np.float32(1.0))


def test_deliberate_differences_from_optax():
    # zeros with max_norm 0: zeros, not NaN (optax PR #1752)
    np.testing.assert_array_equal(clip(np.zeros(3, np.float32), 0.0), np.zeros(3))
    # float32 squares do not overflow
    np.testing.assert_allclose(clip(np.array([1e20, 1e20], np.float32), 1.0), [0.70710677] * 2, rtol=1e-6)


def test_idempotent_loop_like_optax_test():
    g = (np.array([500.0, 5.0], np.float32), np.array([300.0, 3.0], np.float32))
    for i in range(1, 51):
        out = clip(g, 1.0 / i)
        np.testing.assert_allclose(nba.global_norm(out), 1.0 / i, rtol=1e-6)
        np.testing.assert_allclose(nba.tree_flatten(clip(out, 1.0 / i))[0][0], out[0], rtol=1e-6)
        g = out


def test_negative_max_norm_is_rejected():
    with pytest.raises(ValueError, match="max_norm"):
        nba.clip_by_global_norm(-1.0)


@settings(deadline=None, max_examples=25)
@given(trees())
def test_against_plain_numpy(tree):
    leaves = nba.tree_flatten(tree)[0]
    norm = nba.global_norm(tree)  # float64, fixed order; checked against NumPy here
    flat64 = np.concatenate([np.ravel(x).astype(np.float64) for x in leaves] + [np.zeros(1)])
    m = float(np.max(np.abs(flat64)))  # on values rescaled by their max: no over/underflow
    want = m * math.sqrt(float(np.sum((flat64 / m) ** 2))) if m > 0 else 0.0
    np.testing.assert_allclose(norm, want, rtol=1e-13)
    out = nba.tree_flatten(clip(tree, 1.0))[0]
    for x, y in zip(out, leaves):
        if norm < 1.0:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_array_equal(x, (y / y.dtype.type(norm)) * y.dtype.type(1.0))


def test_chained_clip_rides_on_the_next_kernel_and_matches_two_passes():
    rng = np.random.default_rng(1)
    p = {
        "w": rng.standard_normal((20, 30)).astype(np.float32),
        "b": rng.standard_normal(30).astype(np.float32),
    }
    fused = nba.MultiSteps(nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2)), 2)
    s = fused.init(p)
    ref_tx = nba.adam(1e-2)
    rs = ref_tx.init(p)
    acc = None
    for step in range(6):
        g = nba.tree_map(lambda x: rng.standard_normal(x.shape).astype(np.float32) * 3, p)
        u, s = fused.update(g, s, p)
        acc = g if acc is None else nba.tree_map(lambda a, b: a + (b - a) / np.float32(2), acc, g)
        if step % 2 == 1:
            ru, rs = ref_tx.update(clip(acc, 1.0), rs, p)
            for x, y in zip(nba.tree_flatten(u)[0], nba.tree_flatten(ru)[0]):
                np.testing.assert_array_equal(x, y)
            acc = None


def test_stateless_output_is_reused_once_dropped_and_never_aliases_the_input():
    tx = nba.clip_by_global_norm(0.5)
    g1, g2 = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    u1, s = tx.update(g1, tx.init(g1))
    u2, s = tx.update(g2, s)
    assert not np.shares_memory(u1, u2)  # u1 is held: u2 is written elsewhere
    assert not np.shares_memory(u2, g2)
    np.testing.assert_allclose(u1, [0.25] * 4)
    np.testing.assert_allclose(u2, [0.25] * 4)
    address = u2.__array_interface__["data"][0]
    del u2
    u3, s = tx.update(g1, s)  # no allocation per step: the buffer nothing holds any more
    assert u3.__array_interface__["data"][0] == address


# --- clip, normalize_by_update_norm, zero_nans, apply_if_finite (reference/optax.md 3.1, 3.7, 4)


def run(tx, tree):
    u, s = tx.update(tree, tx.init(tree))
    return nba.tree_map(np.copy, u), s


def test_clip_vectors():
    out, _ = run(nba.clip(1.0), np.array([500.0, -5.0, 0.5, np.nan], np.float32))
    np.testing.assert_array_equal(out, np.array([1.0, -1.0, 0.5, np.nan], np.float32))
    setup = (np.array([500.0, 5.0], np.float32), np.array([300.0, 3.0], np.float32))
    same, _ = run(nba.clip(1e6), setup)
    for a, b in zip(same, setup):
        np.testing.assert_array_equal(a, b)
    ones, _ = run(nba.clip(1.0), setup)
    for a in ones:
        np.testing.assert_array_equal(a, [1.0, 1.0])
    with pytest.raises(ValueError, match="max_delta"):
        nba.clip(-1.0)


def test_normalize_by_update_norm_vectors():
    out, _ = run(nba.normalize_by_update_norm(), np.array([3.0, 4.0], np.float32))
    np.testing.assert_allclose(out, [0.5999999, 0.7999998], rtol=1e-6)
    zeros, _ = run(nba.normalize_by_update_norm(scale_factor=-1.0), np.zeros(2, np.float32))
    assert np.all(zeros == 0) and np.all(np.signbit(zeros))  # -0.0, as optax


def test_zero_nans_vectors():
    tree = (
        np.array([1.0, 1.0, 1.0], np.float32),
        np.array([1.0, np.nan, np.nan], np.float32),
        np.array([np.nan, 1.0, 1.0], np.float32),
    )
    out, state = run(nba.zero_nans(), tree)
    for a, b in zip(out, ([1, 1, 1], [1, 0, 0], [0, 1, 1])):
        np.testing.assert_array_equal(a, b)
    assert [bool(f) for f in state.found_nan] == [False, True, True]
    with_inf = (tree[0], tree[1], np.array([np.inf, 1.0, 1.0], np.float32))
    out, state = run(nba.zero_nans(), with_inf)
    assert out[2][0] == np.inf and not bool(state.found_nan[2])


def test_apply_if_finite_vector():
    tx = nba.apply_if_finite(nba.sgd(1.0), 2)
    p = np.zeros(1, np.float32)
    s = tx.init(p)
    params, counts = [], []
    for x in (1.0, np.nan, np.nan, 1.0, np.nan, np.nan, np.nan):
        u, s = tx.update(np.array([x], np.float32), s, p)
        p = p + u
        params.append(float(p[0]))
        counts.append(int(s.notfinite_count))
    np.testing.assert_array_equal(params, [-1, -1, -1, -2, -2, -2, np.nan])
    assert counts == [0, 1, 2, 0, 1, 2, 3]
    assert int(s.total_notfinite) == 5 and not bool(s.last_finite)


def test_zero_nans_inside_multisteps_runs():  # optax #828
    tx = nba.MultiSteps(nba.chain(nba.zero_nans(), nba.sgd(1e-4)), 2)
    p = {"w": np.ones(3, np.float32)}
    s = tx.init(p)
    for _ in range(4):
        u, s = tx.update({"w": np.array([1.0, np.nan, 2.0], np.float32)}, s, p)
    np.testing.assert_allclose(u["w"], [-1e-4, 0.0, -2e-4], rtol=1e-6)


def test_clip_by_block_rms_vectors():
    out, _ = run(nba.clip_by_block_rms(1.0), np.array([3.0, 4.0], np.float32))
    np.testing.assert_allclose(out, [0.84852815, 1.1313709], rtol=1e-7)
    zeros, _ = run(nba.clip_by_block_rms(1.0), np.zeros(3, np.float32))
    np.testing.assert_array_equal(zeros, np.zeros(3))
    nan, _ = run(nba.clip_by_block_rms(0.0), np.zeros(2, np.float32))
    assert np.all(np.isnan(nan))  # optax: max(1, 0 / 0) is NaN


def test_clip_by_block_rms_loop_like_optax_test():
    g = (np.array([500.0, 5.0], np.float32), np.array([300.0, 3.0], np.float32))
    for i in range(1, 51):
        out, _ = run(nba.clip_by_block_rms(1.0 / i), g)
        for leaf in out:
            np.testing.assert_allclose(np.sqrt(np.mean(leaf.astype(np.float64) ** 2)), 1.0 / i, rtol=1e-6)
        again, _ = run(nba.clip_by_block_rms(1.0 / i), out)
        for a, b in zip(again, out):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        g = out


@settings(deadline=None, max_examples=25)
@given(trees())
def test_clip_by_block_rms_against_numpy(tree):
    out = nba.tree_flatten(run(nba.clip_by_block_rms(0.5), tree)[0])[0]
    for x, y in zip(out, nba.tree_flatten(tree)[0]):
        if y.size == 0:
            continue
        rms = np.sqrt(np.mean(y.astype(np.float64) ** 2))
        np.testing.assert_allclose(
            x, y / y.dtype.type(max(1.0, rms / 0.5)), rtol=1e-6 if y.dtype == np.float32 else 1e-13
        )


def test_normalize_by_update_norm_with_a_zero_scale_factor_gives_zeros_as_optax():
    """optax divides by (norm + eps) / 0 = inf: zeros (a ZeroDivisionError here before)."""
    g = {"a": np.array([1.0, 2.0, 3.0]), "b": np.ones(3, np.float32)}
    for tx in (nba.normalize_by_update_norm(0.0), nba.chain(nba.normalize_by_update_norm(0.0), nba.scale(2.0))):
        u, _ = tx.update(g, tx.init(None))
        for k in g:
            assert u[k].dtype == g[k].dtype and np.all(u[k] == 0)


def test_clip_by_global_norm_names_a_nonfinite_policy_that_is_not_a_string():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        nba.clip_by_global_norm(1.0, nonfinite=np.zeros(3))


def test_snapshot_of_global_norm_measures_the_flat_buffers_as_their_tree():
    """snapshot(global_norm) measures the updates' flat buffers themselves (no tree of views, no
    layout found again each step): the same float, bit for bit, as the tree of the updates that
    any other measure sees, at every step and with the pending factor of a scale before it."""
    rng = np.random.default_rng(3)
    params = {
        "w": rng.standard_normal((8, 16)).astype(np.float32),
        "b": rng.standard_normal(16).astype(np.float32),
        "d": rng.standard_normal(4),
    }
    seen = []

    def as_a_tree(tree):
        assert type(tree) is dict  # what a measure is documented to get
        seen.append(nba.global_norm(tree))
        return seen[-1]

    flat_tx = nba.chain(nba.sgd(0.1, momentum=0.9), nba.scale(0.5), nba.snapshot("n", nba.global_norm))
    tree_tx = nba.chain(nba.sgd(0.1, momentum=0.9), nba.scale(0.5), nba.snapshot("n", as_a_tree))
    s1, s2 = flat_tx.init(params), tree_tx.init(params)
    for k in range(4):
        g = {key: rng.standard_normal(v.shape).astype(v.dtype) for key, v in params.items()}
        u1, s1 = flat_tx.update(g, s1)
        u2, s2 = tree_tx.update(g, s2)
        measured = s1[2].measurement["n"]
        assert type(measured) is float
        assert math.copysign(1.0, measured) == 1.0 and measured.hex() == seen[-1].hex(), k
        assert measured.hex() == nba.global_norm(u1).hex() == s2[2].measurement["n"].hex(), k
