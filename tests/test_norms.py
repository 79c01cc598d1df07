"""The norm family (numbaccum.norms): torchzero's observed values (declearn_torchzero.md B.2-B.5),
the torchzero bugs that are not reproduced (API.md), optax's centralize / unitwise / AGC vectors
(optax.md 3.6, 3.7), the plain-NumPy reference on random trees, and the kernel cut into items."""

import math

import numpy as np
import pytest
import reference as ref
from _testutil import assert_tree_close, snapshot, thread_counts
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import trees

import numbaccum as nba
from numbaccum import _config, norms

W = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])


def run(tx, tree, params=None):
    u, _ = tx.update(tree, tx.init(tree if params is None else params), params)
    return nba.tree_map(np.copy, u)


# --- ord, leaf_norms, tree_norm -------------------------------------------------------------

ORDS = [2, 1, 0, 3, 4, 0.5, 1.5, -1, -0.5, math.inf, -math.inf, "mad", "std", "var", "sum"]
ORDS += ["l0", "l1", "l2", "l3", "l4", "linf"]


def test_check_ord_names_and_errors():
    assert norms.check_ord("l3") == 3.0 and norms.check_ord("linf") == math.inf
    assert norms.check_ord(np.float32(2)) == 2.0 and norms.check_ord("std") == "std"
    for bad in ("l5", "L2", "fro", None, True, math.nan, [2], 1 + 2j):
        with pytest.raises(ValueError, match="ord"):
            norms.check_ord(bad)
    with pytest.raises(ValueError, match="ord"):
        nba.clip_norm(1.0, ord="nuc")


def test_torchzero_metric_table_per_leaf_and_global():
    g = np.array([3.0, -4.0])
    flat = nba.FlatTree.from_tree([g, W])
    expected = {
        2: ([5.0, math.sqrt(136)], math.sqrt(161)),
        1: ([7.0, 24.0], 31.0),
        0: ([2.0, 6.0], 8.0),  # global 'l0' counts (torchzero: ZeroDivisionError)
        math.inf: ([4.0, 9.0], 9.0),
        -math.inf: ([3.0, 1.0], 1.0),
        "mad": ([3.5, 4.0], 31 / 8),
        "sum": ([-1.0, 24.0], 23.0),
        "var": ([24.5, 8.0], float(np.var(np.r_[g, W.ravel()], ddof=1))),
        "std": ([math.sqrt(24.5), math.sqrt(8.0)], float(np.std(np.r_[g, W.ravel()], ddof=1))),
        -1: ([1 / (1 / 3 + 1 / 4), 1 / (1 + 1 / 2 + 1 / 3 + 1 / 4 + 1 / 5 + 1 / 9)], None),
    }
    for ord, (per_leaf, total) in expected.items():
        np.testing.assert_allclose(norms.leaf_norms(flat, ord), per_leaf, rtol=1e-14, err_msg=str(ord))
        if total is not None:
            np.testing.assert_allclose(norms.tree_norm(flat, ord), total, rtol=1e-14, err_msg=str(ord))


def _l2_rescued(x) -> float:
    """A leaf's L2 norm in float64, rescued like the library's (issue 12 item 5): a plain sum of
    squares that overflowed or may have underflowed is taken again on values scaled by the max."""
    return ref.global_norm([x])


@settings(deadline=None, max_examples=30)
@given(trees(max_leaves=5), st.sampled_from(ORDS))
def test_leaf_and_tree_norms_match_numpy(tree, ord):
    flat = nba.FlatTree.from_tree(tree)
    leaves = ref.tree_leaves(tree)
    got = norms.leaf_norms(flat, ord)
    want = [
        _l2_rescued(x) if ord == 2 else float(ref.slice_metric(x.reshape(-1), ord, (0,))[0]) for x in leaves
    ]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0, equal_nan=True)
    total = ref.global_norm(tree) if ord == 2 else ref.tree_metric(tree, ord)
    np.testing.assert_allclose(norms.tree_norm(flat, ord), total, rtol=1e-12, equal_nan=True)
    # a plain tree gives the same bits as its FlatTree
    np.testing.assert_array_equal(norms.leaf_norms(tree, ord), got)


def test_empty_and_zero_d_leaves():
    tree = [np.zeros(0, np.float32), np.array(-2.0), np.zeros((2, 0))]
    flat = nba.FlatTree.from_tree(tree)
    np.testing.assert_array_equal(norms.leaf_norms(flat, 2), [0.0, 2.0, 0.0])
    np.testing.assert_array_equal(norms.leaf_norms(flat, -math.inf), [math.inf, 2.0, math.inf])
    assert np.isnan(norms.leaf_norms(flat, "mad")[0]) and norms.tree_norm(flat, "mad") == 2.0
    assert norms.tree_norm(nba.FlatTree.from_tree([np.zeros(0)]), 2) == 0.0


def test_float64_overflow_is_rescaled_not_inf():
    big = np.array([1e200, -1e200, 3e199])
    want = math.sqrt(2 + 0.09) * 1e200
    np.testing.assert_allclose(norms.leaf_norms([big], 2)[0], want, rtol=1e-14)
    np.testing.assert_allclose(norms.tree_norm([big, big], 2), want * math.sqrt(2), rtol=1e-14)
    np.testing.assert_allclose(
        norms.leaf_norms([big], "std")[0], np.std(big / 1e200, ddof=1) * 1e200, rtol=1e-13
    )
    np.testing.assert_allclose(
        norms.leaf_norms([big], 4)[0], np.sum((big / 1e200) ** 4) ** 0.25 * 1e200, rtol=1e-14
    )
    out = run(nba.clip_norm(1.0), big)
    np.testing.assert_allclose(np.linalg.norm(out), 1.0, rtol=1e-14)
    # float32 squares accumulate in float64: no overflow to begin with
    np.testing.assert_allclose(
        run(nba.clip_norm(1.0), np.array([1e20, 1e20], np.float32)), [0.70710677] * 2, rtol=1e-6
    )


def _slice_factor_want(x, p, max_norm):
    """clip_norm's factor for one slice, from NumPy on the slice divided by its max first."""
    m = float(np.max(np.abs(x)))
    n = m * float(np.sum(np.abs(x / m) ** p) ** (1 / p)) if m > 0 else 0.0
    return max_norm / n if n > max_norm and n > 1e-12 else 1.0  # a metric <= 1e-12: left alone


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, np.inf])
def test_per_slice_clip_rescues_overflow_in_the_engine(p):
    """`Ops.slice_rescale_`: rows whose plain power sum overflows are measured again scaled, on
    the host as on the device (the same source); a tiny row is left alone however measured."""
    from numbaccum.backend import ops_for

    rows = [
        [1e200, -1e200, 3e199, 0.0],  # overflows for every finite p
        [1e-170, 1e-170, -1e-170, 1e-170],  # squares underflow to 0; a metric <= 1e-12 anyway
        [3.0, 4.0, 0.0, 0.0],  # plain
        [0.0, 0.0, 0.0, 0.0],  # zero: left alone
    ]
    x = np.array(rows)
    max_norm = 1e-200
    tx = nba.clip_norm(max_norm, ord=p, dim=1)
    out = run(tx, x)
    for i, r in enumerate(rows):
        r = np.array(r)
        f = _slice_factor_want(r, p, max_norm) if np.any(r) else 1.0
        np.testing.assert_allclose(out[i], r * f, rtol=1e-13, err_msg=f"row {i}, p={p}")
    # and nothing is written when nothing is clipped (the host engine can tell)
    flat = nba.FlatTree.from_tree([np.array([[3.0, 4.0]])])
    table = norms._slicing(flat.layout, ("whole",), norms._whole_leaf).groups[0].rows
    out_buf = np.full(2, 7.0)
    assert ops_for(flat.groups[0]).slice_rescale_(out_buf, flat.groups[0], table, 2.0, 10.0) is False
    assert np.all(out_buf == 7.0)
    assert ops_for(flat.groups[0]).slice_rescale_(out_buf, flat.groups[0], table, 2.0, 1.0) is True
    np.testing.assert_allclose(out_buf, [0.6, 0.8], rtol=1e-15)


# --- torchzero's observed values (B.3-B.5) --------------------------------------------------


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"dim": None}, [[-3, -2, -1], [0, 1, 5]]),
        ({"dim": "global"}, [[-3, -2, -1], [0, 1, 5]]),
        ({"dim": 5, "inverse_dims": True}, [[-3, -2, -1], [0, 1, 5]]),
        ({"dim": 0}, [[-1.5, -1.5, -3], [1.5, 1.5, 3]]),
        ({"dim": 1}, [[-1, 0, 1], [-2, -1, 3]]),
        ({"dim": 0, "inverse_dims": True}, [[-1, 0, 1], [-2, -1, 3]]),
        ({"dim": -1}, [[-1, 0, 1], [-2, -1, 3]]),
        ({"dim": 5}, W),
        # torchzero ignores a negative dim in the complement and centres over everything; here
        # -1 is the last axis in both places, so its complement is axis 0.
        ({"dim": -1, "inverse_dims": True}, [[-1.5, -1.5, -3], [1.5, 1.5, 3]]),
    ],
)
def test_centralize_torchzero_table(kw, expected):
    kw = {"inverse_dims": False, **kw}
    np.testing.assert_array_equal(run(nba.centralize(**kw), W), expected)


def test_centralize_per_leaf_is_not_sticky_and_global_mean():
    b = np.array([1.0, 2.0, 6.0])
    for tree in ([b, W], [W, b]):
        out = run(nba.centralize(dim=None, inverse_dims=False), tree)
        i = 0 if tree[0] is b else 1
        np.testing.assert_array_equal(out[i], [-2, -1, 3])
        np.testing.assert_array_equal(out[1 - i], [[-3, -2, -1], [0, 1, 5]])
    out = run(nba.centralize(dim="global"), [np.array([1.0, 2.0]), np.array([6.0])])
    np.testing.assert_array_equal(out[0], [-2, -1])
    np.testing.assert_array_equal(out[1], [3])
    small = [np.array([5.0]), np.array(3.0)]  # min_size 2 and 0-d: unchanged
    for a, b in zip(run(nba.centralize(dim=None, inverse_dims=False), small), small):
        np.testing.assert_array_equal(a, b)


def test_optax_centralize_vectors():
    np.testing.assert_array_equal(run(nba.centralize(), np.array([1.0, 2.0])), [1, 2])
    np.testing.assert_array_equal(
        run(nba.centralize(), np.array([[1.0, 2.0], [3.0, 4.0]])), [[-0.5, 0.5]] * 2
    )
    x = np.array([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]], np.float32)
    np.testing.assert_array_equal(run(nba.centralize(), x), [[[-1.5, -0.5], [0.5, 1.5]]] * 2)
    # an (n, 1) leaf: optax reduces its axis 1, so it becomes zeros
    np.testing.assert_array_equal(run(nba.centralize(), np.array([[1.0], [7.0]])), [[0.0], [0.0]])


def test_clip_and_normalize_torchzero_semantics():
    g3 = np.array([[1.0, -2.0], [2.0, 4.0]])
    g1 = np.array([3.0, -4.0])
    # not sticky: dim=None is each leaf over all of its own dims, whatever comes first
    for tree in ([g1, g3], [g3, g1]):
        out = nba.clip_grad_norm_([x.copy() for x in tree], 1.0, min_size=1)
        j = 1 if tree[0] is g1 else 0
        np.testing.assert_allclose(out[j], [[0.2, -0.4], [0.4, 0.8]], rtol=1e-15)
        np.testing.assert_allclose(out[1 - j], [0.6, -0.8], rtol=1e-15)
    rows = run(nba.clip_norm(1.0, dim=1), g3)
    np.testing.assert_allclose(rows, [[1 / 5**0.5, -2 / 5**0.5], [2 / 20**0.5, 4 / 20**0.5]], rtol=1e-15)
    cols = run(nba.clip_norm(1.0, dim=0), g3)
    np.testing.assert_allclose(cols, [[1 / 5**0.5, -2 / 20**0.5], [2 / 5**0.5, 4 / 20**0.5]], rtol=1e-15)
    np.testing.assert_array_equal(run(nba.clip_norm(10.0), g1), g1)  # below max_norm: untouched
    np.testing.assert_allclose(run(nba.normalize(2.0), g1), [1.2, -1.6], rtol=1e-15)
    np.testing.assert_allclose(run(nba.normalize(1.0, ord=math.inf), g1), [0.75, -1.0], rtol=1e-15)
    np.testing.assert_allclose(
        run(nba.clip_norm(1.0, ord="l1", dim="global"), [g1]), [[3 / 7, -4 / 7]], rtol=1e-15
    )


def test_torchzero_bugs_are_not_reproduced():
    # tiny slices are left unchanged (torchzero divides by 1: [2e-13, 0])
    np.testing.assert_array_equal(run(nba.normalize(2.0), np.array([1e-13, 0.0])), [1e-13, 0.0])
    # a negative global 'sum' does not flip the sign (torchzero: [0.4286, 0.5714])
    g = np.array([-3.0, -4.0])
    np.testing.assert_array_equal(run(nba.clip_norm(1.0, ord="sum", dim="global"), [g])[0], g)
    np.testing.assert_array_equal(run(nba.clip_norm(1.0, ord="sum"), g), g)
    # global 'l0' counts non-zeros: 2 here, so normalize to 1 halves
    np.testing.assert_allclose(run(nba.normalize(1.0, ord="l0", dim="global"), [g])[0], g / 2)
    # 'std' of one element is NaN: the leaf stays as it is (torchzero: NaN output)
    np.testing.assert_array_equal(run(nba.normalize(1.0, ord="std"), np.array([5.0])), [5.0])
    # global normalize of zeros stays zeros (torchzero: NaN); -inf with a zero element too
    zeros = [np.zeros(3), np.zeros(2)]
    for a in run(nba.normalize(1.0, dim="global"), zeros):
        np.testing.assert_array_equal(a, 0.0)
    for a in run(nba.normalize(1.0, ord=-math.inf, dim="global"), [np.array([0.0, 2.0])]):
        np.testing.assert_array_equal(a, [0.0, 2.0])
    # clip_grad_norm_'s default min_size=2 leaves shape-(1,) and 0-d arrays alone
    out = nba.clip_grad_norm_([np.array([5.0]), np.array(-3.0), np.array([3.0, 4.0])], 1.0)
    np.testing.assert_array_equal(out[0], [5.0])
    assert float(out[1]) == -3.0
    np.testing.assert_allclose(out[2], [0.6, 0.8], rtol=1e-15)
    # a non-finite metric leaves its slice unchanged (per slice and global)
    bad = np.array([[np.inf, 1.0], [3.0, 4.0]])
    out = run(nba.clip_norm(1.0, dim=1), bad)
    np.testing.assert_array_equal(out[0], bad[0])
    np.testing.assert_allclose(out[1], [0.6, 0.8], rtol=1e-15)
    nan = [np.array([np.nan, 1.0]), np.array([3.0, 4.0])]
    out = run(nba.clip_norm(1.0, dim="global"), nan)
    np.testing.assert_array_equal(out[1], [3.0, 4.0])


def test_clip_grad_norm_min_norm_scales_up():
    out = nba.clip_grad_norm_([np.array([0.3, 0.4]), np.array([3.0, 4.0])], 2.0, min_norm=1.0)
    np.testing.assert_allclose(out[0], [0.6, 0.8], rtol=1e-15)
    np.testing.assert_allclose(out[1], [1.2, 1.6], rtol=1e-15)
    only_min = nba.clip_grad_norm_([np.array([0.3, 0.4])], None, min_norm=1.0)
    np.testing.assert_allclose(only_min[0], [0.6, 0.8], rtol=1e-15)


def test_clip_grad_value():
    g = [np.array([-3.0, 0.5, 1.0, 7.0]), np.array([np.nan, -2.0], np.float32)]
    out = nba.clip_grad_value_(g, 1.0)
    assert out is g
    np.testing.assert_array_equal(g[0], [-1.0, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(g[1], [np.nan, -1.0])
    with pytest.raises(ValueError, match="value"):  # torchzero maps every element to -1 instead
        nba.clip_grad_value_(g, -1.0)


# --- in place -------------------------------------------------------------------------------


def test_in_place_functions_write_into_the_arrays_and_flat_buffers():
    g = {"a": np.array([3.0, 4.0]), "b": np.array([[6.0, 8.0]], np.float32)}
    out = nba.normalize_grads_(g, 1.0)
    assert out is g
    np.testing.assert_allclose(g["a"], [0.6, 0.8], rtol=1e-15)
    np.testing.assert_allclose(g["b"], [[0.6, 0.8]], rtol=1e-7)
    flat = nba.FlatTree.from_tree({"a": np.array([3.0, 4.0]), "b": np.array([30.0, 40.0])})
    buf = flat.buffers[np.dtype(np.float64)]
    nba.clip_grad_norm_(flat.tree, 1.0, dim="global")  # the views of a FlatTree: no copy
    np.testing.assert_allclose(buf, np.array([3.0, 4.0, 30.0, 40.0]) / math.sqrt(2525), rtol=1e-15)
    nba.clip_grad_value_(flat, 0.05)
    assert np.max(np.abs(buf)) == 0.05


def test_in_place_errors_touch_nothing():
    g = [np.array([3.0, 4.0]), np.array([5.0])]
    before = snapshot(g)
    with pytest.raises(ValueError, match="max_norm"):
        nba.clip_grad_norm_(g, -1.0)
    with pytest.raises(ValueError, match="ord"):
        nba.normalize_grads_(g, 1.0, ord="bad")
    with pytest.raises(ValueError, match="dim"):
        nba.clip_grad_norm_(g, 1.0, dim="rows")
    with pytest.raises(ValueError, match="min_size"):
        nba.clip_grad_norm_(g, 1.0, min_size=-1)
    ro = np.array([3.0, 4.0])
    ro.flags.writeable = False
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        nba.clip_grad_norm_([g[0], ro], 1.0)
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        nba.clip_grad_value_([g[0], np.float64(3.0)], 1.0)
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        nba.clip_grad_value_([[1.0, 2.0]], 1.0)
    for a, b in zip(g, before):
        np.testing.assert_array_equal(a, b)


def test_bad_hyperparameters_raise_at_construction():
    with pytest.raises(ValueError, match="max_norm"):
        nba.clip_norm(-0.5)
    with pytest.raises(ValueError, match="max_norm"):
        nba.clip_norm(math.nan)
    with pytest.raises(ValueError, match="dim"):
        nba.normalize(dim=1.5)
    with pytest.raises(ValueError, match="dim"):
        nba.centralize(dim="all")
    with pytest.raises(ValueError, match="min_size"):
        nba.centralize(min_size=1.0)


# --- against the NumPy reference on random trees --------------------------------------------

DIMS = st.sampled_from([None, "global", 0, 1, -1, 2, (0, 1), (0, 2), (1, 2), (-1, 0), 7])


@settings(deadline=None, max_examples=40)
@given(
    trees(max_leaves=5),
    st.sampled_from(ORDS),
    DIMS,
    st.booleans(),
    st.integers(0, 4),
    st.sampled_from([0.0, 0.5, 1.0, 3.0, 100.0]),
)
def test_clip_norm_and_normalize_match_reference(tree, ord, dim, inverse_dims, min_size, value):
    kw = {"ord": ord, "dim": dim, "inverse_dims": inverse_dims, "min_size": min_size}
    before = snapshot(tree)
    got = run(nba.clip_norm(value, **kw), tree)
    assert_tree_close(got, ref.scale_slices(tree, max_norm=value, **kw), rtol=2e-6, atol_rel=1e-6)
    got = run(nba.normalize(value, **kw), tree)
    assert_tree_close(got, ref.scale_slices(tree, norm_value=value, **kw), rtol=2e-6, atol_rel=1e-6)
    assert_tree_close(tree, before, rtol=0, atol_rel=0)  # the input is never modified


@settings(deadline=None, max_examples=40)
@given(trees(max_leaves=5), DIMS, st.booleans(), st.integers(0, 4))
def test_centralize_matches_reference(tree, dim, inverse_dims, min_size):
    got = run(nba.centralize(dim, inverse_dims, min_size), tree)
    assert_tree_close(got, ref.centralize(tree, dim, inverse_dims, min_size), rtol=2e-6, atol_rel=1e-6)


@settings(deadline=None, max_examples=30)
@given(
    trees(max_leaves=5),
    st.sampled_from([2, 1, math.inf, "mad"]),
    DIMS,
    st.booleans(),
    st.sampled_from([None, 0.5]),
)
def test_in_place_functions_match_reference(tree, ord, dim, inverse_dims, min_norm):
    kw = {"ord": ord, "dim": dim, "inverse_dims": inverse_dims}
    want = ref.scale_slices(tree, max_norm=1.0, min_norm=min_norm, min_size=2, **kw)
    got = nba.clip_grad_norm_(snapshot(tree), 1.0, min_norm=min_norm, **kw)
    assert_tree_close(got, want, rtol=2e-6, atol_rel=1e-6)
    got = nba.normalize_grads_(snapshot(tree), 2.0, **kw)
    assert_tree_close(got, ref.scale_slices(tree, norm_value=2.0, **kw), rtol=2e-6, atol_rel=1e-6)


# --- work items: long slices cut into chunks, many short slices per item, any thread count --


@pytest.mark.parametrize("block", [1, 3, 8, 64])
def test_small_blocks_give_the_same_values(monkeypatch, block):
    rng = np.random.default_rng(block)
    tree = {
        "conv": rng.standard_normal((3, 4, 5, 2)),
        "w": rng.standard_normal((7, 9)).astype(np.float32),
        "v": rng.standard_normal(40),
        "s": np.array(2.0),
    }
    want = {
        "norm": ref.scale_slices(tree, max_norm=0.5, ord=3, dim=(0, 2)),
        "rows": ref.scale_slices(tree, norm_value=1.0, ord="std", dim=1),
        "min": ref.scale_slices(tree, max_norm=0.1, ord=-math.inf, dim=0, inverse_dims=True),
        "centre": ref.centralize(tree, dim=(1, 3), inverse_dims=False),
    }
    monkeypatch.setattr(_config, "REDUCE_BLOCK", block)
    got = {
        "norm": run(nba.clip_norm(0.5, ord=3, dim=(0, 2)), tree),
        "rows": run(nba.normalize(1.0, ord="std", dim=1), tree),
        "min": run(nba.clip_norm(0.1, ord=-math.inf, dim=0, inverse_dims=True), tree),
        "centre": run(nba.centralize(dim=(1, 3), inverse_dims=False), tree),
    }
    for k in want:
        assert_tree_close(got[k], want[k], rtol=2e-6, atol_rel=1e-6, msg=k)


def test_parallel_kernels_give_the_same_bits_for_any_thread_count(monkeypatch):
    import numba

    rng = np.random.default_rng(3)
    tree = {"w": rng.standard_normal((300, 70)).astype(np.float32), "b": rng.standard_normal(5000)}
    monkeypatch.setattr(_config, "SERIAL_BELOW", 0)  # the prange drivers, on a small tree
    monkeypatch.setattr(_config, "REDUCE_BLOCK", 1000)
    flat = nba.FlatTree.from_tree(tree)
    results = []
    for threads in thread_counts():
        numba.set_num_threads(threads)
        try:
            results.append(
                (
                    norms.leaf_norms(flat, 2),
                    norms.tree_norm(flat, "std"),
                    run(nba.clip_norm(1.0, dim=0), tree),
                )
            )
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for r in results[1:]:
        np.testing.assert_array_equal(r[0], results[0][0])
        assert r[1] == results[0][1]
        for a, b in zip(ref.tree_leaves(r[2]), ref.tree_leaves(results[0][2])):
            np.testing.assert_array_equal(a, b)
    assert_tree_close(results[0][2], ref.scale_slices(tree, max_norm=1.0, dim=0), rtol=2e-6, atol_rel=1e-6)


# --- composition ----------------------------------------------------------------------------


def test_chains_and_flat_trees():
    rng = np.random.default_rng(5)
    p = {"w": rng.standard_normal((4, 6)).astype(np.float32), "b": rng.standard_normal(6).astype(np.float32)}
    g = nba.tree_map(lambda x: 10 * x, p)
    tx = nba.chain(nba.clip_by_global_norm(5.0), nba.clip_norm(1.0, dim=1), nba.centralize(), nba.sgd(0.1))
    u, _ = tx.update(g, tx.init(p), p)
    step1 = run(nba.clip_by_global_norm(5.0), g)
    step2 = ref.scale_slices(step1, max_norm=1.0, dim=1)
    want = nba.tree_map(lambda x: -0.1 * x, ref.centralize(step2))
    assert_tree_close(u, want, rtol=2e-6, atol_rel=1e-6)
    flat = nba.FlatTree.from_tree(g)
    out, _ = nba.normalize(1.0, dim="global").update(flat, nba.EmptyState())
    assert isinstance(out, nba.FlatTree)
    np.testing.assert_allclose(nba.global_norm(out), 1.0, rtol=1e-6)


def test_float16_and_mixed_dtype_leaves_keep_their_dtype():
    tree = {
        "h": np.array([[3.0, 4.0], [0.3, 0.4]], np.float16),
        "f": np.array([[6.0, 8.0]], np.float32),
        "d": np.array([[0.0, 12.0]], np.float64),
    }
    out = run(nba.clip_norm(1.0, dim=1), tree)
    for k in tree:
        assert out[k].dtype == tree[k].dtype
    np.testing.assert_allclose(out["h"], [[0.6, 0.8], [0.3, 0.4]], rtol=1e-3)
    np.testing.assert_allclose(out["f"], [[0.6, 0.8]], rtol=1e-7)
    np.testing.assert_array_equal(out["d"], [[0.0, 1.0]])
    np.testing.assert_allclose(
        norms.leaf_norms(tree, 2), [12.0, 10.0, math.sqrt(25.25)], rtol=1e-3
    )  # d, f, h
    cen = run(nba.centralize(), tree)
    np.testing.assert_allclose(cen["h"].astype(np.float64), [[-0.5, 0.5], [-0.05, 0.05]], atol=1e-3)
    g = [np.array([3.0, 4.0], np.float16)]
    nba.normalize_grads_(g, 1.0)
    assert g[0].dtype == np.float16
    np.testing.assert_allclose(g[0], [0.6, 0.8], rtol=1e-3)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_norm_value_that_is_not_finite_is_refused(value):
    """NaN was taken as normalize's "no target" and left the updates unchanged without a word."""
    grads = {"w": np.array([3.0, 4.0])}
    with pytest.raises(ValueError, match="norm_value"):
        nba.normalize(value)
    with pytest.raises(ValueError, match="norm_value"):
        nba.normalize_grads_(grads, value)
    assert grads["w"].tolist() == [3.0, 4.0]


@pytest.mark.parametrize("make", [nba.clip_norm, nba.normalize])
def test_inverse_dims_is_checked_with_a_global_norm_too(make):
    with pytest.raises(TypeError, match="inverse_dims"):
        make(1.0, dim="global", inverse_dims="yes")
    with pytest.raises(TypeError, match="inverse_dims"):
        nba.centralize(dim="global", inverse_dims="yes")


# --- kept reductions (numbaccum.backend.Reductions) -------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.float16])
def test_kept_reductions_give_the_contracts_bits_and_follow_their_buffers(dtype):
    """A stage's kept reductions, scalings and rescales give the bits of the `Ops` calls they
    replace, read the buffer's current values (not a kept result), and are prepared again for a
    new buffer in the same slot (the identity check)."""
    from numbaccum.backend import Reductions, ops_for
    from numbaccum.tables import segments

    rng = np.random.default_rng(3)
    table = segments([0, 3, 3, 40, 2100])  # an empty slice, and one long enough for 64 lanes
    x = rng.standard_normal(2100).astype(dtype)
    if np.iscomplexobj(x):
        x = x + 1j * rng.standard_normal(2100).astype(dtype)
    ops, kept = ops_for(x), Reductions()
    centers, factors = np.array([0.5, 0.0, -1.0, 2.0]), np.array([2.0, 1.0, 0.25, -3.0])
    for step in range(3):
        if step == 1:
            x *= 3  # in place: the same buffer, new values
        if step == 2:
            x = (x * 0.5).astype(dtype)  # a new buffer in the same slots
        assert_bits = np.testing.assert_array_equal
        assert_bits(kept.reduce("g", "sumsq", x, table), ops.slice_sumsq(x, table))
        assert_bits(kept.reduce("g", "maxabs", x, table), ops.slice_maxabs(x, table))
        assert_bits(kept.reduce("g", "sumpow", x, table, None, 3.0), ops.slice_sumpow(x, table, 3.0))
        if not np.iscomplexobj(x):
            assert_bits(kept.reduce("g", "csumsq", x, table, centers), ops.slice_sumsq(x, table, centers))
        assert_bits(kept.sumsq("g", x, table)[0], ops.slice_sumsq(x, table))
        out, want = np.empty_like(x), np.empty_like(x)
        kept.apply_("g", out, x, table, None, factors)
        ops.slice_apply_(want, x, table, None, factors)
        assert_bits(out, want)
        if np.iscomplexobj(x):  # (the norm family's rescale is of real leaves)
            continue
        out, want = np.zeros_like(x), np.zeros_like(x)
        assert kept.rescale_("g", out, x, table, 2.0, 1.0, 0.0, math.nan) == ops.slice_rescale_(
            want, x, table, 2.0, 1.0
        )
        assert_bits(out, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_kept_calls_give_the_contracts_bits_and_follow_their_buffers(dtype):
    """`Reductions.call`'s prepared runs (divisions, EMA updates, axis sums and maxima, the
    Adafactor and SM3 passes) give the bits of the `Ops` calls they replace, read the buffers'
    current values, and are prepared again for a new buffer in the same slot."""
    from numbaccum import backend as B
    from numbaccum.contract import Factor
    from numbaccum.factored import _FACTORED_PASS, _SM3_PASS, _axes_of, _factoring
    from numbaccum.flat import layout_of
    from numbaccum.tables import segments

    rng = np.random.default_rng(5)
    tree = {"m": np.zeros((30, 90), dtype), "v": np.zeros(7, dtype), "t": np.zeros((3, 4, 5), dtype)}
    lay = layout_of(tree, "t")
    (offsets,), (fac,), ax = lay.offsets, _factoring(lay, True, 2).passes, _axes_of(lay)
    table, rows = segments(offsets), _factoring(lay, True, 2).rows[0]
    n = int(offsets[-1])
    kept, assert_bits = B.Reductions(), np.testing.assert_array_equal
    x = rng.standard_normal(n).astype(dtype)
    out, ema = np.empty_like(x), np.zeros_like(x)
    ema_want, v, v_want = ema.copy(), np.ones_like(x), np.ones_like(x)
    nu, nu_want = np.zeros_like(x), np.zeros_like(x)
    mu, mu_want = np.zeros(ax.mu.group_sizes[0], dtype), np.zeros(ax.mu.group_sizes[0], dtype)
    acc, acc_want = np.zeros_like(x), np.zeros_like(x)
    for step in range(3):
        if step == 1:
            x *= 3  # in place: the same buffer, new values
        if step == 2:
            x, out = (x * 0.5).astype(dtype), np.empty_like(x)  # new buffers in the same slots
        ops, want = B.ops_for(x), np.empty_like(x)
        factor, divisors = Factor(2.0, 3.0), np.array([0.5, 3.0, -4.0])
        kept.call("g", B.prepare_divide, (out, x, table), factor, divisors)
        ops.slice_divide_(want, x, factor, table, divisors)
        assert_bits(out, want)
        active = np.array([1, 0, 1], np.uint8)
        kept.call("g", B.prepare_ema, (ema, x, table), factor, active, 0.1, 0.9)
        ops.slice_ema_update_(ema_want, x, factor, table, active, 0.1, 0.9)
        assert_bits(ema, ema_want)
        assert_bits(kept.call("g", B.prepare_axis_sumsq, (x, rows)), ops.axis_sumsq(x, rows))
        rf, cf = rng.random(rows.n_out) + 0.5, rng.random(_factoring(lay, True, 2).cols[0].n_out) + 0.5
        kept.call("g", B.prepare_row_column, (_FACTORED_PASS, out, x, v, fac), rf, cf, (0.9, 0.1, 1e-30))
        ops.row_column_pass_(_FACTORED_PASS, want, x, v_want, fac, rf, cf, (0.9, 0.1, 1e-30))
        assert_bits(out, want)
        assert_bits(v, v_want)
        scalars = (0.1, 0.9, 1e-8, 0.5, 0.5, 0.0, 1.0)
        kept.call("g", B.prepare_axes, (_SM3_PASS, out, x, nu, acc, ax.passes[0], mu), scalars)
        ops.axes_pass_(_SM3_PASS, want, x, nu_want, acc_want, ax.passes[0], mu_want, scalars)
        assert_bits(out, want)
        assert_bits(nu, nu_want)
        kept.call("g", B.prepare_axis_max, (mu, acc, ax.maxima[0]))
        ops.axis_max_(mu_want, acc_want, ax.maxima[0])
        assert_bits(mu, mu_want)


# Stages whose declared parts keep their reductions and launches (`Reductions.call`, `fuse.Launches`).
_KEPT_CASES = [
    "clip_norm_by_ema", "clip_norm_growth", "zero_nans", "apply_if_finite", "clip_by_block_rms",
    "normalize_global_l1", "normalize_std_inverse", "adafactor", "scale_by_factored_rms", "sm3",
]


@pytest.mark.parametrize("name", _KEPT_CASES)
def test_kept_parts_follow_their_states(name, tmp_path):
    """Two states of one transformation stepped in turn, a state restored from a checkpoint
    next to the one it was saved from, and one state per thread on one transformation: each
    gives the bits of a transformation of its own (the kept runs follow their buffers)."""
    import threading

    from registry import CASES

    make = CASES[name].make
    rng = np.random.default_rng(11)

    def tree(scale):
        return {
            "w": (scale * rng.standard_normal((6, 5))).astype(np.float32),
            "b": (scale * rng.standard_normal(5)).astype(np.float32),
            "d": scale * rng.standard_normal(3),
        }

    params = [tree(1.0), tree(2.0)]
    grads = [[tree(0.5 + k % 3) for k in range(8)] for _ in range(2)]

    def steps(tx, i, state, ks):
        outs = []
        for k in ks:
            u, state = tx.update(grads[i][k], state, params[i])
            outs.append({key: np.array(v) for key, v in u.items()})
        return outs, state

    alone = [steps(make(), i, make().init(params[i]), range(8))[0] for i in range(2)]
    tx = make()  # two states in turn on one transformation
    states = [tx.init(p) for p in params]
    together: list = [[], []]
    for k in range(8):
        for i in range(2):
            out, states[i] = steps(tx, i, states[i], [k])
            together[i] += out
    for i in range(2):
        for a, b in zip(together[i], alone[i]):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
    tx = make()  # a restored state beside the one it was saved from
    _, state = steps(tx, 0, tx.init(params[0]), range(4))
    nba.save_state(tmp_path / "s.npz", state)
    restored = nba.load_state(tmp_path / "s.npz", like=tx.init(params[0]))
    for k in range(4, 8):
        (a,), state = steps(tx, 0, state, [k])
        (b,), restored = steps(tx, 0, restored, [k])
        for key in a:
            np.testing.assert_array_equal(a[key], alone[0][k][key])
            np.testing.assert_array_equal(b[key], alone[0][k][key])
    tx, results = make(), [None, None]  # a thread per state

    def work(i):
        results[i] = steps(tx, i, tx.init(params[i]), range(8))[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for a, b in zip(results[i], alone[i]):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize("scale", [2.0**600, 2.0**-600])
def test_trust_ratio_and_agc_rescue_float64_norms(scale):
    """The trust ratio's and adaptive clipping's kept call per group
    (`numbaccum.backend.prepare_norm_scaling`) rescues float64 sums of squares that overflow or
    underflow, as `numbaccum.backend.slice_sumsq` does: params and updates scaled alike by a
    power of two give the ratios of the unscaled ones (the plain sums would be inf or 0), on
    the step that prepares the call and on the ones that reuse it."""
    rng = np.random.default_rng(3)
    x = {"a": rng.standard_normal(40), "b": rng.standard_normal(7)}
    y = {"a": rng.standard_normal(40), "b": rng.standard_normal(7)}
    p = {k: v * scale for k, v in x.items()}
    g = {k: v * scale for k, v in y.items()}
    ratio = {k: np.linalg.norm(x[k]) / np.linalg.norm(y[k]) for k in x}
    tx = nba.scale_by_trust_ratio()
    state = tx.init(p)
    for _ in range(3):
        u, state = tx.update(g, state, p)
        for k in x:
            np.testing.assert_allclose(u[k], g[k] * ratio[k], rtol=1e-13)
    if scale > 1:  # (below 1e-6, AGC's floor on ||g|| is not scale-free)
        agc = nba.adaptive_grad_clip(0.01)
        state = agc.init(p)
        for _ in range(3):
            u, state = agc.update(g, state, p)
            for k in x:
                np.testing.assert_allclose(u[k], g[k] * (0.01 * ratio[k]), rtol=1e-13)
