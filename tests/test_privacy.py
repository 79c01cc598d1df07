"""Per-example clipping and DP-SGD: optax's vectors (reference/optax.md 3.4, 3.5, 3.7 and the
privacy tests), the plain NumPy reference on random trees, the deliberate differences (non-finite
examples dropped, float64 norms), the noise's statistics and reproducibility, and composition."""

import math

import numpy as np
import pytest
import reference as ref
from _testutil import (
    assert_tree_close,
    assert_tree_equal,
    check_raising_update_commits_nothing,
    no_shared_memory,
    raising_user_code,
    require,
    snapshot,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import F32 as DT32
from strategies import F64 as DT64
from strategies import LeafSpec, tree_from_spec, tree_specs

import numbaccum as nba
from numbaccum import _config
from numbaccum.contract import Ops

F32, F64 = np.float32, np.float64


def flat_leaves(tree):
    return nba.tree_flatten(tree.tree if isinstance(tree, nba.FlatTree) else tree)[0]


# --- optax's vectors ------------------------------------------------------------------------


def test_optax_per_example_global_norm_clip_vector():
    g0 = np.array([[0, -0.5], [3, 4], [5, 6], [0, 0]], F32)
    g1 = np.array([[0], [5], [-3], [0]], F32)
    sums, n = nba.per_example_global_norm_clip([g0, g1], 1.0)
    np.testing.assert_allclose(sums[0], [1.02187836, 0.78282261], atol=1e-6)
    np.testing.assert_allclose(sums[1], [0.34853825], atol=1e-6)
    assert n == 2 and isinstance(n, np.int32)
    assert sums[0].dtype == F32 and sums[0].shape == (2,) and sums[1].shape == (1,)


@pytest.mark.parametrize(
    "clip, total, count", [(np.inf, 7.0, 0), (0.0, 0.0, 3), (1.25, 1.75, 3), (5.0, 7.0, 0)]
)
def test_optax_doc_example(clip, total, count):
    g = [np.array([[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]], F32)]
    sums, n = nba.per_example_global_norm_clip(g, clip)
    np.testing.assert_allclose(sums[0], [total] * 3, rtol=1e-7)
    assert n == count  # norm == clip (5.0) is not counted: the test is a strict < 1
    for uniform in (True, False):  # one layer: the same numbers (observed in optax)
        lsums, counts = nba.per_example_layer_norm_clip(g, clip, uniform)
        np.testing.assert_allclose(lsums[0], sums[0], rtol=1e-7)
        assert counts == [count]


def test_optax_layer_norm_clip_vectors():
    g = [np.array([[0.5], [1.5], [-2], [3]], F32), np.ones((4, 3, 3, 2), F32)]
    sums, counts = nba.per_example_layer_norm_clip(g, math.sqrt(2.0))  # both layers clip at 1
    np.testing.assert_allclose(sums[0], [1.5], atol=1e-7)
    np.testing.assert_allclose(sums[1], np.full((3, 3, 2), 4 / math.sqrt(18)), atol=1e-4)
    np.testing.assert_allclose(sums[1], np.full((3, 3, 2), 0.9428090), rtol=1e-6)
    assert counts == [3, 4] and all(isinstance(c, np.int32) for c in counts)
    sums, counts = nba.per_example_layer_norm_clip(g, math.sqrt(19.0), uniform=False)
    np.testing.assert_allclose(sums[0], [1.5], atol=1e-7)
    np.testing.assert_allclose(sums[1], np.full((3, 3, 2), 4.0), atol=1e-6)
    assert counts == [3, 0]  # layer 1's norm equals its clip sqrt(18): not counted
    sums, counts = nba.per_example_layer_norm_clip(g, 1.0, uniform=False)
    np.testing.assert_allclose(sums[0], [0.45883146], rtol=1e-6)
    np.testing.assert_allclose(sums[1], np.full((3, 3, 2), 0.91766298), rtol=1e-6)
    assert counts == [4, 4]


def optax_privacy_batch(batch=8):
    """optax's _privacy_test setUp: 67 elements per example, example i filled with i."""
    fill = np.arange(batch, dtype=F32)
    return {
        "w": np.broadcast_to(fill[:, None, None], (batch, 8, 8)).copy(),
        "b": np.broadcast_to(fill[:, None], (batch, 3)).copy(),
    }


def test_optax_no_privacy():
    tx = nba.differentially_private_aggregate(float(np.finfo(F32).max), 0.0, 0)
    u, _ = tx.update(optax_privacy_batch(), tx.init(None))
    for leaf in flat_leaves(u):
        np.testing.assert_array_equal(leaf, 3.5)


@pytest.mark.parametrize(
    "clip, expected", [(0.5, 0.0534491), (10, 1.0412709), (20, 1.9021181), (40, 3.0825417), (80, 3.5)]
)
def test_optax_clipping_norm(clip, expected):
    i = np.arange(8, dtype=F64)
    with np.errstate(divide="ignore", invalid="ignore"):
        formula = np.mean(np.nan_to_num(i / np.maximum(i * math.sqrt(67) / clip, 1.0)))
    np.testing.assert_allclose(formula, expected, atol=5e-8)  # the reference prints 7 decimals
    tx = nba.differentially_private_aggregate(clip, 0.0, 0)
    u, _ = tx.update(optax_privacy_batch(), tx.init(None))
    for leaf in flat_leaves(u):
        np.testing.assert_allclose(leaf, formula, rtol=2e-7)  # optax's test tolerance


@pytest.mark.parametrize("clip, nm", [(1.0, 1.0), (2.0, 0.5), (3.0, 10.0)])
def test_optax_noise_multiplier(clip, nm):
    tx = nba.differentially_private_aggregate(clip, nm, 1)
    u, _ = tx.update({"x": np.ones((1, 100, 100), F32)}, tx.init(None))
    np.testing.assert_allclose(np.std(u["x"]), clip * nm, rtol=0.1)


def test_optax_aggregated_updates_as_input_fails():
    tx = nba.differentially_private_aggregate(1.0, 1.0, 0)
    with pytest.raises(ValueError, match=r"updates\['b'\]: a 0-d leaf has no batch dimension"):
        tx.update({"w": np.ones(3, F32), "b": np.array(1.0, F32)}, tx.init(None))


# --- against the plain NumPy reference on random trees --------------------------------------


@st.composite
def per_example_trees(draw, dtypes=(DT32, DT64), max_abs=10.0, min_batch=1):
    """A random tree whose leaves all have a batch axis of one size in front of a random shape."""
    spec = draw(tree_specs(dtypes=dtypes, max_leaves=5))
    batch = draw(st.integers(min_batch, 5))

    def with_batch(s):
        if s is None:
            return None
        if isinstance(s, LeafSpec):
            return LeafSpec((batch, *s.shape), s.dtype)
        if isinstance(s, dict):
            return {k: with_batch(v) for k, v in s.items()}
        if isinstance(s, list):
            return [with_batch(c) for c in s]
        return type(s)(*[with_batch(c) for c in s]) if hasattr(s, "_fields") else tuple(map(with_batch, s))

    return draw(tree_from_spec(with_batch(spec), max_abs))


def _spoil(tree, data):
    """Puts a NaN or an inf into some examples (of some leaves)."""
    for x in flat_leaves(tree):
        if x.size and data.draw(st.booleans()):
            rows = x.reshape(x.shape[0], -1)  # a view: the leaves are contiguous
            b = data.draw(st.integers(0, rows.shape[0] - 1))
            j = data.draw(st.integers(0, rows.shape[1] - 1))
            rows[b, j] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return tree


@settings(deadline=None, max_examples=40)
@given(per_example_trees(), st.sampled_from([0.0, 0.3, 2.0, 50.0, np.inf]), st.data())
def test_per_example_clips_match_reference(tree, clip, data):
    if data.draw(st.booleans()):
        tree = _spoil(tree, data)
    before = snapshot(tree)
    sums, n = nba.per_example_global_norm_clip(tree, clip)
    ref_sums, ref_n = ref.per_example_global_norm_clip(tree, clip)
    assert_tree_close(sums, ref_sums)
    assert n == ref_n
    for uniform in (True, False):
        lsums, counts = nba.per_example_layer_norm_clip(tree, clip, uniform)
        ref_lsums, ref_counts = ref.per_example_layer_norm_clip(tree, clip, uniform)
        assert_tree_close(lsums, ref_lsums)
        assert_tree_equal(counts, ref_counts)
    assert_tree_equal(tree, before)  # the input is never modified
    assert no_shared_memory(sums, tree)
    # a FlatTree of the same batch: zero-copy, the same bits, a FlatTree out
    flat = nba.FlatTree.from_tree(tree)
    fsums, fn = nba.per_example_global_norm_clip(flat, clip)
    assert isinstance(fsums, nba.FlatTree) and fn == n
    assert_tree_equal(fsums, sums)


@settings(deadline=None, max_examples=30)
@given(per_example_trees(), st.sampled_from([0.0, 0.7, 5.0]), st.sampled_from([0.0, 0.5, 3.0]), st.data())
def test_dp_aggregate_matches_reference(tree, clip, nm, data):
    if data.draw(st.booleans()):
        tree = _spoil(tree, data)
    seed = data.draw(st.integers(0, 2**64 - 1))
    tx, rtx = (
        nba.differentially_private_aggregate(clip, nm, seed),
        ref.differentially_private_aggregate(clip, nm, seed),
    )
    s, rs = tx.init(None), rtx.init(None)
    for _ in range(2):
        u, s = tx.update(tree, s)
        ru, rs = rtx.update(tree, rs)
        assert_tree_close(u, ru)
        np.testing.assert_array_equal(s.rng_key, rs.rng_key)
        assert all(np.all(np.isfinite(x)) for x in flat_leaves(u))  # NaN/inf examples are dropped


# --- deliberate differences from optax and edge cases ---------------------------------------


def test_non_finite_examples_are_dropped_and_counted():
    g = np.array([[np.nan, 1.0], [3.0, 4.0], [np.inf, 0.0], [0.3, 0.4]], F32)
    sums, n = nba.per_example_global_norm_clip([g], 1.0)
    # optax: [NaN, ...] (the NaN example passes through unclipped) and counts only [3, 4]
    np.testing.assert_allclose(sums[0], [0.6 + 0.3, 0.8 + 0.4], rtol=1e-6)
    assert n == 3  # the two dropped examples and the clipped [3, 4]
    # per layer: a NaN in one leaf of an example drops that example from that leaf only
    other = np.array([[1.0], [1.0], [1.0], [1.0]], F32)
    lsums, counts = nba.per_example_layer_norm_clip([g, other], 2.0)  # clips sqrt(2) each
    np.testing.assert_allclose(lsums[0], [3 / 5 * math.sqrt(2) + 0.3, 4 / 5 * math.sqrt(2) + 0.4], rtol=1e-6)
    np.testing.assert_allclose(lsums[1], [4.0], rtol=1e-7)
    assert counts == [3, 0]


def test_float32_squares_do_not_overflow():
    g = {"a": np.array([[1e20, 1e20], [0.0, 0.5]], F32), "b": np.zeros((2, 1), F32)}
    sums, n = nba.per_example_global_norm_clip(g, 1.0)
    np.testing.assert_allclose(sums["a"], [math.sqrt(0.5), math.sqrt(0.5) + 0.5], rtol=1e-6)
    assert n == 1  # optax: the norm overflows to inf, the example becomes zeros (still counted)


def test_zeros_and_zero_clip():
    g = [np.zeros((3, 2), F32), np.zeros((3,), F64)]
    sums, n = nba.per_example_global_norm_clip(g, 0.0)
    assert n == 0  # 0 / 0: multiplier 1, as optax's nan_to_num
    assert_tree_equal(sums, [np.zeros(2, F32), np.array(0.0, F64)])
    sums, counts = nba.per_example_layer_norm_clip(g, 0.0, uniform=False)
    assert counts == [0, 0]


def test_batch_of_one_size_zero_leaves_and_empty_batch():
    g = {"w": np.array([[3.0, 4.0]], F32), "e": np.zeros((1, 0, 2), F32), "s": np.array([2.0], F64)}
    sums, n = nba.per_example_global_norm_clip(g, 1.0)
    norm = math.sqrt(9 + 16 + 4)
    np.testing.assert_allclose(sums["w"], [3 / norm, 4 / norm], rtol=1e-6)
    np.testing.assert_allclose(sums["s"], 2 / norm, rtol=1e-12)
    assert sums["e"].shape == (0, 2) and sums["s"].shape == () and n == 1
    empty = {"w": np.zeros((0, 2), F32)}
    sums, n = nba.per_example_global_norm_clip(empty, 1.0)
    assert_tree_equal(sums, {"w": np.zeros(2, F32)})
    assert n == 0
    tx = nba.differentially_private_aggregate(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="batch size 0"):
        tx.update(empty, tx.init(None))
    assert nba.per_example_global_norm_clip({}, 1.0) == ({}, 0)


def test_missing_or_unequal_batch_names_the_leaf():
    with pytest.raises(ValueError, match=r"grads\['b'\]: a 0-d leaf has no batch dimension"):
        nba.per_example_global_norm_clip({"a": np.ones((2, 3), F32), "b": np.array(1.0, F32)}, 1.0)
    with pytest.raises(ValueError, match=r"grads\['b'\]\[1\]: batch size 3 differs from 2"):
        nba.per_example_layer_norm_clip({"a": np.ones((2, 3)), "b": [np.ones(2), np.ones((3, 1))]}, 1.0)
    with pytest.raises(TypeError, match=r"grads\[0\]: dtype int64"):
        nba.per_example_global_norm_clip([np.ones((2, 3), np.int64)], 1.0)
    for bad in (-1.0, np.nan):
        with pytest.raises(ValueError, match="l2_norm_clip"):
            nba.per_example_global_norm_clip([np.ones((2, 3))], bad)
        with pytest.raises(ValueError, match="global_l2_norm_clip"):
            nba.per_example_layer_norm_clip([np.ones((2, 3))], bad)


def test_mixed_dtypes_keep_dtypes_and_float16():
    rng = np.random.default_rng(3)
    g = {
        "h": rng.standard_normal((4, 5)).astype(np.float16),
        "s": rng.standard_normal((4, 2)).astype(F32),
        "d": rng.standard_normal((4,)).astype(F64),
    }
    sums, n = nba.per_example_global_norm_clip(g, 1.0)
    ref_sums, ref_n = ref.per_example_global_norm_clip(g, 1.0)
    assert n == ref_n and {k: v.dtype for k, v in sums.items()} == {k: v.dtype for k, v in g.items()}
    assert_tree_close(sums, ref_sums, rtol=1e-3)  # float16: computed in float32, rounded to float16


def test_flat_tree_stored_in_one_dtype():
    rng = np.random.default_rng(5)
    g = {"s": rng.standard_normal((3, 4)).astype(F32), "d": rng.standard_normal((3, 2))}
    flat = nba.FlatTree.from_tree(g, dtype=F64)  # both leaves in one float64 buffer
    sums, n = nba.per_example_global_norm_clip(flat, 1.0)
    assert isinstance(sums, nba.FlatTree) and sums.group_dtypes == (np.dtype(F64),)
    want, want_n = ref.per_example_global_norm_clip(nba.tree_map(lambda x: x.astype(F64), g), 1.0)
    assert_tree_close(sums, want)
    assert n == want_n
    lsums, counts = nba.per_example_layer_norm_clip(flat, 1.0, uniform=False)
    assert_tree_equal(counts, ref.per_example_layer_norm_clip(g, 1.0, uniform=False)[1])


def test_one_kernel_per_pass_and_group_whatever_the_leaf_count(monkeypatch):
    calls = []
    for name in ("slice_sumsq", "batch_weighted_sum_"):
        real = getattr(Ops, name)
        monkeypatch.setattr(
            Ops, name, lambda self, *a, _n=name, _f=real, **kw: calls.append(_n) or _f(self, *a, **kw)
        )
    for n_leaves in (2, 40):
        tree = {f"p{i:02d}": np.ones((3, 4), F32) for i in range(n_leaves)}
        tree["d"] = np.ones((3, 2), F64)
        calls.clear()
        nba.per_example_global_norm_clip(tree, 1.0)
        assert sorted(calls) == ["batch_weighted_sum_"] * 2 + ["slice_sumsq"] * 2  # two groups


def test_flat_input_is_not_copied(monkeypatch):
    g = nba.FlatTree.from_tree({"w": np.ones((4, 3), F32), "b": np.ones((4,), F32)})
    views = g.tree
    monkeypatch.setattr(nba.FlatTree, "_copy_leaves_in", lambda *a: pytest.fail("the batch was copied"))
    nba.per_example_global_norm_clip(g, 1.0)
    nba.per_example_global_norm_clip(views, 1.0)  # the .tree of a FlatTree: zero-copy too


def test_same_bits_serial_and_parallel(monkeypatch):
    rng = np.random.default_rng(7)
    g = {"w": rng.standard_normal((16, 300, 40)).astype(F32), "b": rng.standard_normal((16, 40)).astype(F32)}
    monkeypatch.setattr(_config, "SERIAL_BELOW", 1 << 40)
    serial = snapshot(nba.per_example_global_norm_clip(g, 1.0)[0])
    monkeypatch.setattr(_config, "SERIAL_BELOW", 0)
    assert_tree_equal(nba.per_example_global_norm_clip(g, 1.0)[0], serial)
    assert_tree_close(serial, ref.per_example_global_norm_clip(g, 1.0)[0])


# --- differentially_private_aggregate -------------------------------------------------------


def test_noise_statistics_for_a_fixed_seed():
    clip, nm, batch, n = 2.0, 1.5, 4, 1_000_000
    tx = nba.differentially_private_aggregate(clip, nm, 12345)
    u, _ = tx.update({"x": np.zeros((batch, n), F32)}, tx.init(None))
    z = u["x"].astype(F64) / (clip * nm / batch)  # standard normal if the noise is right
    assert abs(np.mean(z)) < 5 / math.sqrt(n)
    assert abs(np.std(z) - 1) < 5 / math.sqrt(2 * n)
    # Gaussian shape: the fraction within 1 and 2 standard deviations, the tails present
    for k, p in ((1, 0.682689), (2, 0.954500)):
        assert abs(np.mean(np.abs(z) < k) - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert np.max(np.abs(z)) > 4.0


def test_same_seed_same_bits_other_seed_or_step_differs():
    g = {"w": np.random.default_rng(0).standard_normal((3, 50)).astype(F32), "d": np.ones((3, 2), F64)}

    def run(seed, steps=2):
        tx = nba.differentially_private_aggregate(1.0, 1.0, seed)
        s, out = tx.init(None), []
        for _ in range(steps):
            u, s = tx.update(g, s)
            out.append(snapshot(u))
        return out

    a, b, c = run(7), run(7), run(8)
    for x, y in zip(a, b):
        assert_tree_equal(x, y)
    assert not np.array_equal(a[0]["w"], a[1]["w"])  # step 1 draws new noise
    assert not np.array_equal(a[0]["w"], c[0]["w"])
    # the documented generator: Philox keyed by [seed, step], float64 draws group by group (the
    # float64 group of "d" comes first in tree order), added to the float64 sum, cast once
    z = np.random.Generator(np.random.Philox(key=np.array([7, 1], np.uint64))).standard_normal(2 + 50)
    summed = ref.per_example_global_norm_clip(g, 1.0)[0]
    np.testing.assert_allclose(a[1]["d"], (summed["d"] + z[:2]) / 3, rtol=1e-13)
    want_w = ((summed["w"].astype(F64) + z[2:]) / 3).astype(F32)
    np.testing.assert_allclose(a[1]["w"], want_w, rtol=1e-6)


def test_noise_never_overflows_to_inf():
    tx = nba.differentially_private_aggregate(1e3, 1e3, 0)  # std 1e6: beyond float16's 65504
    u, _ = tx.update({"h": np.zeros((1, 1000), np.float16)}, tx.init(None))
    assert np.all(np.isfinite(u["h"])) and np.max(np.abs(u["h"])) == np.finfo(np.float16).max
    tx = nba.differentially_private_aggregate(1e30, 1e10, 0)  # std 1e40: beyond float32
    u, _ = tx.update({"s": np.zeros((2, 100), F32)}, tx.init(None))
    assert np.all(np.isfinite(u["s"])) and np.max(np.abs(u["s"])) == np.finfo(F32).max


def test_dp_bad_hyperparameters():
    for args, match in [
        ((-1.0, 1.0, 0), "l2_norm_clip"),
        ((1.0, -0.5, 0), "noise_multiplier"),
        ((1.0, np.inf, 0), "noise_multiplier"),
        ((np.inf, 1.0, 0), "not finite"),
        ((1.0, 1.0, -1), "seed"),
        ((1.0, 1.0, 2**64), "seed"),
    ]:
        with pytest.raises(ValueError, match=match):
            nba.differentially_private_aggregate(*args)
    with pytest.raises(TypeError, match="seed"):
        nba.differentially_private_aggregate(1.0, 1.0, 1.5)
    nba.differentially_private_aggregate(np.inf, 0.0, np.uint64(2**64 - 1))  # no noise: fine


def test_failed_update_leaves_state_unchanged():
    tx = nba.dpsgd(0.1, 1.0, 1.0, seed=3, momentum=0.9)
    params = {"w": np.zeros(3, F32), "b": np.zeros((), F32)}
    s = tx.init(params)
    good = {"w": np.ones((2, 3), F32), "b": np.ones((2,), F32)}
    _, s = tx.update(good, s, params)
    before = snapshot(s[1].trace), s[0].rng_key.copy()
    bad = [
        (
            {"w": np.ones((2, 3), F32), "b": np.ones((3,), F32)},
            ValueError,
            r"updates\['w'\]: batch size 2 differs from 3",
        ),
        ({"w": np.ones((2, 3), F32), "b": np.ones((), F32)}, ValueError, r"updates\['b'\]: a 0-d leaf"),
        ({"w": np.ones((2, 4), F32), "b": np.ones((2,), F32)}, ValueError, "layout does not match"),
        ({"w": np.ones((2, 3), F32)}, ValueError, "updates"),
    ]
    for g, err, match in bad:
        with pytest.raises(err, match=match):
            tx.update(g, s, params)
    with pytest.raises(ValueError, match=r"params\['w'\]: shape \(4,\) does not match \(3,\)"):
        tx.update(good, s, {"w": np.zeros(4, F32), "b": np.zeros((), F32)})
    with pytest.raises(TypeError, match="DifferentiallyPrivateAggregateState"):
        tx.update(good, (None, *s[1:]), params)
    assert_tree_equal(s[1].trace, before[0])
    np.testing.assert_array_equal(s[0].rng_key, before[1])


def test_dp_state_is_immutable_looking_and_outputs_never_alias():
    tx = nba.differentially_private_aggregate(1.0, 1.0, 5)
    s0 = tx.init(None)
    assert not s0.rng_key.flags.writeable
    g = {"w": np.ones((2, 3), F32)}
    before = snapshot(g)
    u, s1 = tx.update(g, s0)
    assert list(s0.rng_key) == [5, 0] and list(s1.rng_key) == [5, 1]
    again, _ = tx.update(g, s0)  # the old state still gives step 0's noise
    assert_tree_equal(again, u)
    assert_tree_equal(g, before) and no_shared_memory(u, g)


# --- dpsgd and composition ------------------------------------------------------------------


@pytest.mark.parametrize(
    "momentum, nesterov, lr", [(None, False, 0.1), (0.9, False, 0.1), (0.5, True, lambda c: 0.1 / (1 + c))]
)
def test_dpsgd_matches_reference_chain(momentum, nesterov, lr):
    rng = np.random.default_rng(2)
    params = {"w": np.zeros((3, 4), F32), "b": np.zeros(4, F64)}
    tx = nba.dpsgd(lr, 1.0, 0.7, seed=11, momentum=momentum, nesterov=nesterov)
    rtx = ref.dpsgd(lr, 1.0, 0.7, 11, momentum, nesterov)
    s, rs = tx.init(params), rtx.init(params)
    assert len(s) == 3 and isinstance(s[0], nba.DifferentiallyPrivateAggregateState)
    assert isinstance(s[1], nba.TraceState if momentum is not None else nba.EmptyState)
    for _ in range(4):
        g = {"w": rng.standard_normal((6, 3, 4)).astype(F32), "b": rng.standard_normal((6, 4))}
        u, s = tx.update(g, s, params)
        ru, rs = rtx.update(g, rs, params)
        assert_tree_close(u, ru, rtol=1e-5 if momentum else None)
        assert no_shared_memory(u, g)
    flat = nba.FlatTree.from_tree(g)  # a FlatTree in: a FlatTree out
    out, _ = tx.update(flat, s, params)
    assert isinstance(out, nba.FlatTree) and out["w"].shape == (3, 4)


def test_dp_aggregate_then_multisteps_and_multisteps_around_dpsgd():
    """The aggregate must be the first stage (optax #515): its output, params-shaped, feeds any
    chain, MultiSteps included; MultiSteps around dpsgd accumulates per-example input."""
    rng = np.random.default_rng(4)
    params = {"w": np.zeros((2, 3), F32)}
    agg = nba.differentially_private_aggregate(1.0, 0.5, seed=9)
    ms = nba.MultiSteps(nba.chain(nba.clip_by_global_norm(10.0), nba.sgd(0.1, momentum=0.9)), 2)
    ragg = ref.differentially_private_aggregate(1.0, 0.5, 9)
    rms = ref.MultiSteps(ref.sgd(0.1, momentum=0.9), 2)
    s_agg, s_ms, r_agg, r_ms = agg.init(params), ms.init(params), ragg.init(params), rms.init(params)
    for _ in range(4):
        g = {"w": rng.standard_normal((5, 2, 3)).astype(F32)}
        u, s_agg = agg.update(g, s_agg)
        u, s_ms = ms.update(u, s_ms, params)
        ru, r_agg = ragg.update(g, r_agg)
        ru, r_ms = rms.update(ru, r_ms, params)
        assert_tree_close(u, ru, rtol=1e-5)
    # MultiSteps around dpsgd is DP accumulation now (issue 15): per-example input, summed
    # (tests/test_dp_accumulation.py); params-shaped input is refused, naming the leaf.
    wrapped = nba.MultiSteps(nba.dpsgd(0.1, 1.0, 0.5, seed=9, momentum=0.9), 2)
    s = wrapped.init(params)
    _, s = wrapped.update(g, s, params)
    assert int(s.mini_step) == 1 and int(s.inner_opt_state[0].examples) == 5
    with pytest.raises(ValueError, match=r"updates\['w'\]"):
        wrapped.update({"w": np.zeros((2, 3), F32)[0]}, s, params)


def test_dp_aggregate_chains_like_optax():
    """chain(differentially_private_aggregate, adam): the rest of the chain takes the aggregate's
    params-shaped output, as optax.chain does; dpsgd is such a chain (optax's 3-part state)."""
    rng = np.random.default_rng(5)
    p = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.float64)}
    tx = nba.chain(nba.differentially_private_aggregate(1.0, 0.5, seed=2), nba.adam(1e-2))
    rtx = ref.chain(ref.differentially_private_aggregate(1.0, 0.5, 2), ref.adam(1e-2))
    s, rs = tx.init(p), rtx.init(p)
    for _ in range(3):
        g = {"w": rng.standard_normal((6, 3, 4)).astype(np.float32), "b": rng.standard_normal((6, 4))}
        u, s = tx.update(g, s, p)
        ru, rs = rtx.update(g, rs, p)
        assert_tree_close(u, ru)
    assert len(s) == 2 and isinstance(s[0], nba.DifferentiallyPrivateAggregateState)
    with pytest.raises(ValueError, match="updates"):  # params-shaped input: no batch to aggregate
        tx.update(p, s, p)


def test_stages_before_the_aggregate_run_on_each_example_as_optax_chain():
    """chain(scale(2), differentially_private_aggregate, sgd): the stages before the reshaping
    one run on the per-example gradients (optax's chain just passes them on), the ones after on
    the params-shaped aggregate; with the params given too (the chain's input is the
    aggregate's, its params the rest's), in ``update`` and ``step_``, kept plans replayed."""
    rng = np.random.default_rng(8)
    p = {"w": np.zeros((3, 4), np.float32)}
    tx = nba.chain(nba.scale(2.0), nba.differentially_private_aggregate(1.0, 0.5, seed=4), nba.sgd(0.1))
    rtx = ref.chain(ref.scale(2.0), ref.differentially_private_aggregate(1.0, 0.5, 4), ref.sgd(0.1))
    s, rs, q = tx.init(p), rtx.init(p), {"w": p["w"].copy()}
    for _ in range(3):
        g = {"w": rng.standard_normal((5, 3, 4)).astype(np.float32)}
        before = q["w"].copy()
        u, s2 = tx.update(g, nba.copy_state(s), p)
        ru, rs = rtx.update(g, rs, p)
        assert_tree_close(u, ru)
        s = nba.step_(tx, g, s, q)
        np.testing.assert_array_equal(q["w"], before + u["w"])  # the same bits as update + apply
    assert len(s) == 3 and isinstance(s[1], nba.DifferentiallyPrivateAggregateState)


def test_user_code_after_the_aggregate_that_raises_leaves_the_states_as_they_were():
    """A chain whose foreign stage after the reshaping one raises: the momentum written before it
    (a chain of the aggregate, sgd with momentum, then user code) is restored, bit for bit."""
    p = {"w": np.zeros(4, np.float32)}
    user, fail = raising_user_code()
    tx = nba.chain(nba.differentially_private_aggregate(1.0, 0.0, seed=1), nba.sgd(0.1, momentum=0.9), user)
    g = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    check_raising_update_commits_nothing(tx, fail, g, p, lambda s: s[1][0].trace.tree)


# --- privacy accounting ------------------------------------------------------------------------

# Opacus 1.6.0's accountants on the same inputs (sigma, q, steps, delta): its RDPAccountant and
# PRVAccountant (``acc.history = [(sigma, q, steps)]; acc.get_epsilon(delta)``), recorded by
# benchmarks/dp_accountant.py (Opacus needs PyTorch, which CI does not install).
OPACUS = [
    ((4.0, 0.01, 10000, 1e-5), 1.0354900660362476, 0.9569361942671307),
    ((1.1, 256 / 60000, 14100, 1e-5), 2.6003429386103023, 2.395268532385706),
    ((0.8, 0.004, 5000, 1e-6), 3.392487653680443, 2.917456768989771),
    ((2.0, 0.1, 100, 1e-5), 2.5805688086608938, 2.347555316412645),
]


@pytest.mark.parametrize(("args", "rdp", "prv"), OPACUS)
def test_epsilon_matches_opacus(args, rdp, prv):
    require("dp_accounting")
    ours_rdp, ours_pld = nba.dp_epsilon(*args), nba.dp_epsilon(*args, accountant="pld")
    np.testing.assert_allclose(ours_rdp, rdp, rtol=1e-5)  # the same bound, nearly the same orders
    assert ours_pld <= ours_rdp  # PLD accounting is tighter than RDP's
    np.testing.assert_allclose(ours_pld, prv, rtol=0.02)  # PLD and Opacus' PRV: two numerical methods


def test_epsilon_against_the_dp_sgd_paper():
    """Abadi et al. 2016, section 3.1: q = 0.01, sigma = 4, delta = 1e-5 and 10,000 steps give
    epsilon = 1.26 with their moments accountant (9.34 with the strong composition theorem); RDP
    accounting is at least as tight."""
    require("dp_accounting")
    eps = nba.dp_epsilon(4.0, 0.01, 10_000, 1e-5)
    assert 0.9 < eps <= 1.26
    assert nba.dp_epsilon(4.0, 0.01, 20_000, 1e-5) > eps  # more steps spend more privacy
    assert nba.dp_epsilon(8.0, 0.01, 10_000, 1e-5) < eps  # more noise spends less
    assert nba.dp_epsilon(4.0, 0.01, 0, 1e-5) == 0.0
    assert nba.dp_epsilon(0.0, 0.01, 10, 1e-5) == float("inf")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"noise_multiplier": -1.0}, ValueError, "noise_multiplier"),
        ({"sampling_rate": 1.5}, ValueError, "sampling_rate"),
        ({"steps": 2.5}, TypeError, "steps"),
        ({"steps": -1}, ValueError, "steps"),
        ({"delta": 0.0}, ValueError, "delta"),
        ({"accountant": "prv"}, ValueError, "accountant"),
        ({"noise_multiplier": "1"}, TypeError, "noise_multiplier"),
    ],
)
def test_epsilon_arguments_are_checked(kwargs, error, match):
    args = {"noise_multiplier": 1.0, "sampling_rate": 0.01, "steps": 100, "delta": 1e-5} | kwargs
    with pytest.raises(error, match=match):
        nba.dp_epsilon(**args)


def test_stats_report_the_clipped_examples_and_the_noise_of_the_last_step():
    rng = np.random.default_rng(0)
    params = {"w": np.zeros(3)}
    grads = {"w": rng.normal(size=(8, 3)) * np.array([[0.1], [0.1], [5], [5], [5], [0.1], [0.1], [5]])}
    clipped = int(np.sum(np.linalg.norm(grads["w"], axis=1) > 1.0))
    tx = nba.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0)
    state = nba.step_(tx, grads, tx.init(params), params)
    s = nba.stats(state)
    assert s["differentially_private_aggregate/clipped"] == clipped == 4
    assert s["differentially_private_aggregate/batch"] == 8
    assert s["differentially_private_aggregate/noise_std"] == 1.0 * 0.5 / 8
    # Under MultiSteps: the whole logical batch of the cycle (two mini-batches of 8).
    acc = nba.MultiSteps(nba.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0), 2)
    st = acc.init(params)
    for _ in range(2):
        st = nba.step_(acc, grads, st, params)
    s = nba.stats(st)
    assert s["multisteps/differentially_private_aggregate/clipped"] == 8
    assert s["multisteps/differentially_private_aggregate/batch"] == 16
    assert s["multisteps/differentially_private_aggregate/noise_std"] == 0.5 / 16


def test_aggregate_is_declared_and_explains_its_passes():
    """The aggregation declares a `fuse.Host` that names the layout it returns: `explain` shows
    its reduction and its sum (no opaque row); the kept plan still checks each update's params
    against the params' layout, not the per-example one."""
    params = {"w": np.zeros(3), "b": np.zeros(2, np.float32)}
    grads = {"w": np.ones((4, 3)), "b": np.ones((4, 2), np.float32)}
    tx = nba.differentially_private_aggregate(1.0, 0.5, seed=0)
    e = nba.explain(tx, grads)
    assert [p.kind for p in e.passes] == ["reduction", "kernel"] and e.total is not None
    state = tx.init(params)
    for _ in range(2):
        u, state = tx.update(grads, state, params)
    assert u["w"].shape == (3,)
    with pytest.raises(ValueError, match="params"):
        tx.update(grads, state, {"w": np.zeros(3)})
