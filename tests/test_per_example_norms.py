"""Issue 15, item 4: per-example clipping without DP, with its norms: ``return_norms=True`` on
both per-example clips, `per_example_clip_weights` (the multipliers for norms the caller has,
e.g. from ghost clipping) and `per_example_clip_from_norms` (the clipped sum from given norms)."""

import math

import numpy as np
import pytest
import reference
from _testutil import assert_tree_equal
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import LeafSpec, tree_from_spec

import numbaccum as nba

F32, F64 = np.float32, np.float64


def batched_trees(batch: int):
    """Per-example trees: 1 to 3 leaves of float32/float64 with ``batch`` on axis 0."""
    shapes = st.lists(
        st.tuples(st.sampled_from([(), (0,), (3,), (2, 3)]), st.sampled_from([F32, F64])),
        min_size=1,
        max_size=3,
    )
    return shapes.flatmap(
        lambda leaves: tree_from_spec([LeafSpec((batch, *s), np.dtype(d)) for s, d in leaves], max_abs=5.0)
    )


def reference_norms(leaves, batch):
    """Each example's L2 norm over every leaf, in float64, leaf by leaf; an overflowed or
    underflowed sum of squares rescued by the example's max |x| as the library does (the plain
    sum gave 0 for a norm of 9.65e-258)."""
    return reference._example_norms(leaves, batch)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), batch=st.integers(1, 5), clip=st.sampled_from([0.0, 0.5, 2.0, math.inf]))
def test_return_norms_are_the_norms_the_clip_used(data, batch, clip):
    g = data.draw(batched_trees(batch))
    sums, n = nba.per_example_global_norm_clip(g, clip)
    sums2, n2, norms = nba.per_example_global_norm_clip(g, clip, return_norms=True)
    assert_tree_equal(sums2, sums)  # asking for the norms changes nothing else
    assert n2 == n and isinstance(n2, np.int32)
    assert norms.dtype == F64 and norms.shape == (batch,)
    np.testing.assert_allclose(norms, reference_norms(nba.tree_flatten(g)[0], batch), rtol=1e-12)
    # The norms clip again to the same bits, without the norm pass.
    sums3, n3 = nba.per_example_clip_from_norms(g, norms, clip)
    assert_tree_equal(sums3, sums)
    assert n3 == n


def test_layer_norms_are_returned_per_leaf():
    rng = np.random.default_rng(3)
    g = {"a": rng.standard_normal((4, 3)).astype(F32), "b": [rng.standard_normal((4, 2, 2))]}
    sums, counts = nba.per_example_layer_norm_clip(g, 1.0)
    sums2, counts2, norms = nba.per_example_layer_norm_clip(g, 1.0, return_norms=True)
    assert_tree_equal(sums2, sums)
    assert_tree_equal(counts2, counts)
    np.testing.assert_allclose(norms["a"], np.linalg.norm(g["a"].astype(F64), axis=1), rtol=1e-12)
    np.testing.assert_allclose(norms["b"][0], np.linalg.norm(g["b"][0].reshape(4, -1), axis=1), rtol=1e-12)
    assert norms["a"].dtype == F64 and norms["b"][0].shape == (4,)


def test_clip_weights_formula():
    norms = np.array([0.0, 0.5, 2.0, 4.0, np.nan, np.inf])
    w = nba.per_example_clip_weights(norms, 1.0)
    np.testing.assert_array_equal(w, [1.0, 1.0, 0.5, 0.25, 0.0, 0.0])  # non-finite: dropped
    assert w.dtype == F64
    # A zero example under a zero clip keeps weight 1 (optax's 0 / 0 -> 1).
    np.testing.assert_array_equal(nba.per_example_clip_weights([0.0, 3.0], 0.0), [1.0, 0.0])


def test_clip_from_norms_applies_the_weights():
    g = {"w": np.array([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0]], F32)}
    sums, n = nba.per_example_clip_from_norms(g, [5.0, 0.5, 10.0], 1.0)
    np.testing.assert_allclose(sums["w"], [0.6 + 0.3 + 0.6, 0.8 + 0.4 + 0.8], rtol=1e-6)
    assert n == 2
    # Norms the caller computed otherwise (ghost clipping) are taken as given.
    sums, n = nba.per_example_clip_from_norms(g, np.array([1.0, 1.0, 1.0], F32), 1.0)
    np.testing.assert_allclose(sums["w"], g["w"].sum(axis=0), rtol=1e-6)
    assert n == 0


@pytest.mark.parametrize(
    "norms,error,match",
    [
        ([1.0, 2.0], ValueError, "norms: 2 norms for a batch of 3"),
        ([[1.0, 2.0, 3.0]], ValueError, "norms must be 1-d"),
        ([1.0, -2.0, 3.0], ValueError, "norms must be >= 0"),
        (["a", "b", "c"], TypeError, "norms must be a 1-d array of real numbers"),
        ([1j, 1j, 1j], TypeError, "norms must be a 1-d array of real numbers"),
        ([[1.0], [2.0, 3.0]], TypeError, "norms must be a 1-d array"),
    ],
)
def test_clip_from_norms_refuses_bad_norms(norms, error, match):
    g = {"w": np.ones((3, 2), F32)}
    with pytest.raises(error, match=match):
        nba.per_example_clip_from_norms(g, norms, 1.0)


@pytest.mark.parametrize("bad", ["yes", np.zeros(2), None])
def test_return_norms_must_be_a_bool(bad):
    g = {"w": np.ones((3, 2), F32)}
    with pytest.raises(TypeError, match="return_norms"):
        nba.per_example_global_norm_clip(g, 1.0, return_norms=bad)
    with pytest.raises(TypeError, match="return_norms"):
        nba.per_example_layer_norm_clip(g, 1.0, return_norms=bad)


def test_clip_from_norms_on_a_flat_tree_returns_a_flat_tree():
    g = nba.FlatTree.from_tree({"w": np.arange(6, dtype=F32).reshape(3, 2), "b": np.ones((3, 1))})
    sums, n, norms = nba.per_example_global_norm_clip(g, 1.0, return_norms=True)
    sums2, n2 = nba.per_example_clip_from_norms(g, norms, 1.0)
    assert isinstance(sums2, nba.FlatTree)
    assert_tree_equal(sums2.tree, sums.tree)
    assert n2 == n
