"""History-based clipping (numbaccum.adaptive): torchzero's observed tables
(reference/declearn_torchzero.md B.6-B.9) as vectors, the peers' bugs not reproduced (one named
test each), the plain NumPy reference on random trees, state and error semantics."""

import math

import numpy as np
import pytest
import reference as ref
from _testutil import assert_tree_close, quick_and_long, snapshot
from hypothesis import strategies as st
from registry import CASES
from strategies import tree_sequences

import numbaccum as nba
from numbaccum.layout import Layout

F64 = np.float64


def a(*values, dtype=F64):
    return np.array(values, dtype)


def run(tx, steps, state=None):
    """Outputs (copies) of ``tx`` over ``steps`` and the final state."""
    state = tx.init(steps[0]) if state is None else state
    outs = []
    for g in steps:
        u, state = tx.update(g, state)
        outs.append(snapshot(u))
    return outs, state


def check_outputs(outs, expected, rtol=1e-12):
    assert len(outs) == len(expected)
    for got, want in zip(outs, expected):
        # an array against a list of values; a list of arrays against a list of lists
        pairs = [(got, want)] if isinstance(got, np.ndarray) else zip(nba.tree_flatten(got)[0], want)
        for x, y in pairs:
            np.testing.assert_allclose(x, np.asarray(y, np.float64), rtol=rtol, atol=1e-15)


# --- torchzero's observed tables (float64) ---------------------------------------------------

S34, S3040, S0304 = a(3, 4), a(30, 40), a(0.3, 0.4)


@pytest.mark.parametrize(
    "kwargs, steps, expected, prev",
    [
        ({}, [S34, S34, S3040], [[0.03, 0.04], [0.045, 0.06], [0.0675, 0.09]], [0.1125]),
        (
            dict(beta=0.5, max_ema_growth=None),
            [S34, S34, S3040, S0304],
            [[1.5, 2], [2.25, 3], [16.125, 21.5], [0.3, 0.4]],
            None,
        ),
        (
            dict(beta=0.5),
            [S34, S34, S3040, S0304],
            [[1.5, 2], [2.25, 3], [3.375, 4.5], [0.3, 0.4]],
            [3.0625],
        ),
        (dict(beta=0.5, init=1.0), [S34, S34], [[1.92093727, 2.56124969], [2.46018292, 3.28024389]], None),
    ],
    ids=["defaults", "beta.5-no-growth", "beta.5-growth", "beta.5-init1"],
)
def test_clip_norm_by_ema_table(kwargs, steps, expected, prev):
    outs, state = run(nba.clip_norm_by_ema(**kwargs), steps)
    check_outputs(outs, expected, rtol=1e-12 if "init" not in kwargs else 1e-8)
    if prev is not None:
        np.testing.assert_allclose(state.prev_ema_norm, prev, rtol=1e-12)


def test_clip_norm_by_ema_table_exp_avg_and_history():
    tx = nba.clip_norm_by_ema(beta=0.5, max_ema_growth=None)
    _, state = run(tx, [S34, S34, S3040, S0304])
    np.testing.assert_allclose(state.exp_avg.tree, [8.2125, 10.95], rtol=1e-12)
    history = []
    tx = nba.clip_norm_by_ema(beta=0.5)
    state = tx.init(S34)
    for g in (S34, S34, S3040, S0304):
        _, state = tx.update(g, state)
        history.append(float(state.prev_ema_norm[0]))
    np.testing.assert_allclose(history, [2.5, 3.75, 5.625, 3.0625], rtol=1e-12)
    # the first-step EMA of the defaults is capped on step 2: [0.0597, 0.0796] -> [0.045, 0.06]
    _, state = run(nba.clip_norm_by_ema(), [S34, S34])
    np.testing.assert_allclose(state.exp_avg.tree, [0.045, 0.06], rtol=1e-12)


def test_clip_norm_by_ema_global_table():
    steps = [[a(3, 4), a(12)], [a(3, 4), a(12)], [a(30, 40), a(120)]]
    tx = nba.clip_norm_by_ema(beta=0.5, tensorwise=False)
    state = tx.init(steps[0])
    history = []
    outs = []
    for g in steps:
        u, state = tx.update(g, state)
        outs.append(snapshot(u))
        history.append(float(state.prev_ema_norm))
    check_outputs(outs, [[[1.5, 2], [6]], [[2.25, 3], [9]], [[3.375, 4.5], [13.5]]])
    np.testing.assert_allclose(history, [6.5, 9.75, 14.625], rtol=1e-12)
    assert state.prev_ema_norm.shape == ()


def test_normalize_by_ema_table():
    outs, _ = run(nba.normalize_by_ema(beta=0.5), [S34, S34, S3040, a(0, 0)])
    check_outputs(outs, [[1.5, 2], [2.25, 3], [3.375, 4.5], [0, 0]])


def test_normalize_by_ema_scales_up():
    outs, _ = run(nba.normalize_by_ema(beta=0.5, max_ema_growth=None), [S3040, S0304])
    # e = [7.65, 10.2] after step 2, parallel to the update: the update takes its norm 12.75
    check_outputs(outs, [[15, 20], [7.65, 10.2]])


def test_clip_value_by_ema_tables():
    outs, _ = run(nba.clip_value_by_ema(), [a(1, -2, 0)] * 2)
    check_outputs(outs, [[0.01, -0.02, 0], [0.0199, -0.0398, 0]])
    outs, state = run(nba.clip_value_by_ema(beta=0.5, init=1), [a(1, -2, 0), a(4, -1, 3), a(4, -1, 3)])
    check_outputs(outs, [[1, -2, 0], [2.5, -1, 1.5], [3.25, -1, 2.25]])
    np.testing.assert_allclose(state.exp_avg.tree, [3.25, 1.25, 2.25], rtol=1e-12)
    assert int(state.count) == 3


VALUE_STEPS = [a(1, -1, 0, 2), a(3, -1.2, 5, 0.5), a(3, -1.2, 5, 0.1), a(3, 0.01, 5, 0.1)]


def test_clip_value_growth_default_table():
    # torchzero's table, all of it: the third element grows from its first value 0 (item 8).
    outs, state = run(nba.clip_value_growth(), VALUE_STEPS)
    expected = [
        [1, -1, 0, 2],
        [1.5, -1.2, 0.00015, 0.5],
        [2.25, -1.2, 0.000225, 0.1],
        [3, 0.01, 0.0003375, 0.1],
    ]
    check_outputs(outs, expected)
    np.testing.assert_allclose(state.prev.tree, [3, -0.6, 0.0003375, 0.25], rtol=1e-12)
    prevs = []
    tx = nba.clip_value_growth()
    s = tx.init(VALUE_STEPS[0])
    for g in VALUE_STEPS:
        _, s = tx.update(g, s)
        prevs.append(np.copy(s.prev.tree))
    np.testing.assert_allclose(
        np.array(prevs),
        [[1, -1, 0, 2], [1.5, -1.2, 0.00015, 1], [2.25, -1.2, 0.000225, 0.5], [3, -0.6, 0.0003375, 0.25]],
        rtol=1e-12,
    )


def test_clip_value_growth_additive_table():
    outs, state = run(nba.clip_value_growth(add=1, mul=None), VALUE_STEPS)
    check_outputs(outs[1:], [[2, -1.2, 1, 0.5], [3, -1.2, 2, 0.1], [3, 0.01, 3, 0.1]])
    np.testing.assert_allclose(state.prev.tree, [3, -0.6, 3, 0.25], rtol=1e-12)


NORM_STEPS = [S34, S3040, S3040, S0304, S0304, S34]


def test_clip_norm_growth_default_table():
    tx = nba.clip_norm_growth()
    state = tx.init(S34)
    outs, prevs = [], []
    for g in NORM_STEPS:
        u, state = tx.update(g, state)
        outs.append(np.copy(u))
        prevs.append(float(state.prev_norm[0]))
    check_outputs(outs, [[3, 4], [4.5, 6], [6.75, 9], [0.3, 0.4], [0.3, 0.4], [2.53125, 3.375]])
    np.testing.assert_allclose(prevs, [5, 7.5, 11.25, 5.625, 2.8125, 4.21875], rtol=1e-12)


def test_clip_norm_growth_additive_global_and_inf_tables():
    tx = nba.clip_norm_growth(add=1, mul=None)
    state = tx.init(S34)
    outs, prevs = [], []
    for g in (S34, a(6, 8), a(6, 8), a(0.6, 0.8)):
        u, state = tx.update(g, state)
        outs.append(np.copy(u))
        prevs.append(float(state.prev_norm[0]))
    check_outputs(outs, [[3, 4], [3.6, 4.8], [4.2, 5.6], [0.6, 0.8]])
    np.testing.assert_allclose(prevs, [5, 6, 7, 3.5], rtol=1e-12)

    steps = [[a(3, 4), a(12)], [a(30, 40), a(120)], [a(30, 40), a(120)]]
    outs, state = run(nba.clip_norm_growth(tensorwise=False), steps)
    check_outputs(outs, [[[3, 4], [12]], [[4.5, 6], [18]], [[6.75, 9], [27]]])
    np.testing.assert_allclose(float(state.prev_norm), 29.25, rtol=1e-12)

    outs, _ = run(nba.clip_norm_growth(ord=math.inf), [S34, S3040])
    check_outputs(outs, [[3, 4], [4.5, 6]])


def test_inner_output_is_scaled_by_the_input_statistics():
    # torchzero's row "beta=.5, growth=None, inner=Mul(10)": [15, 20], [157.5, 210]
    from numbaccum.adaptive import _ema_norm_transformation

    tx = _ema_norm_transformation(0.5, 2, True, None, 0.0, 1e-6, False, inner=nba.scale(10.0))
    outs, _ = run(tx, [S34, S3040])
    check_outputs(outs, [[15, 20], [157.5, 210]])


# --- torchzero's bugs, not reproduced ------------------------------------------------------


def test_zero_first_step_does_not_collapse_clip_norm_by_ema():
    # torchzero: [0, 0] then [3, 4] x3 gives 6e-7, 9e-7, 1.35e-6 (about 38 steps to recover).
    outs, _ = run(nba.clip_norm_by_ema(), [a(0, 0), S34, S34, S34])
    check_outputs(outs, [[0, 0], [0.03, 0.04], [0.045, 0.06], [0.0675, 0.09]])


def test_zero_first_step_does_not_collapse_clip_norm_growth():
    # torchzero: [0, 0] then [3, 4] x3 gives [0, 0], [0, 0] (allowed 0: divided by inf), then
    # [9e-5, 1.2e-4], [1.35e-4, 1.8e-4]. Here the growth from 0 starts at once from min_value.
    outs, state = run(nba.clip_norm_growth(), [a(0, 0), S34, S34])
    check_outputs(outs, [[0, 0], [9e-5, 1.2e-4], [1.35e-4, 1.8e-4]])
    np.testing.assert_allclose(state.prev_norm, [2.25e-4])


def test_min_value_bounds_the_allowed_norm_not_the_divisor():
    # torchzero divides every step by min_value when it is above 1: [3,4] -> [1.5, 2].
    outs, _ = run(nba.clip_norm_growth(min_value=2.0), [S34, S34, S34])
    check_outputs(outs, [[3, 4]] * 3)
    # ... while it does bound the allowed norm from below: prev 1e-3 allows 1.5 * 2 = 3.
    outs, _ = run(nba.clip_norm_growth(min_value=2.0), [a(0.001, 0), a(4, 0)])
    check_outputs(outs, [[0.001, 0], [3, 0]])


@pytest.mark.parametrize("make", [nba.clip_norm_growth, nba.clip_value_growth])
def test_add_none_mul_none_is_the_identity(make):
    # torchzero crashes from step 2 (a bare tensor unpacked as a 3-tuple), or with a first dim of
    # 3 silently stores elements as prev_norm/prev_denom.
    tx = make(add=None, mul=None)
    steps = [a(3, 4, 5), a(30, 40, 50), a(0, 0, 1e9)]
    outs, state = run(tx, steps)
    check_outputs(outs, steps)
    first = tx.init(steps[0])
    assert all(np.array_equal(x, y) for x, y in zip(nba.tree_flatten(state)[0], nba.tree_flatten(first)[0]))


def test_value_growth_zero_history_passes_instead_of_collapsing():
    # torchzero with min_value=None zeroes such an element for good: [0,1,0] every time (the
    # bound mul * 0); that bound is not applied here, so the element grows.
    outs, state = run(nba.clip_value_growth(min_value=None), [a(0, 1, 0), a(2, 1, 0), a(2, 1, 0)])
    check_outputs(outs, [[0, 1, 0], [2, 1, 0], [2, 1, 0]])
    np.testing.assert_allclose(state.prev.tree, [2, 1, 0])
    # With the default it is clipped to 1.5e-4 and grows by 1.5x per step (torchzero's rule).
    outs, _ = run(nba.clip_value_growth(), [a(0.0), a(5.0), a(100.0)])
    check_outputs(outs, [[0], [1.5e-4], [2.25e-4]])


@pytest.mark.parametrize("ord", ["mad", "std", "l1", "linf", "sum", 3])
def test_string_and_any_ord_work_per_leaf(ord):
    # torchzero's per-tensor EMA and growth clippers accept numeric ords only (TypeError).
    steps = [{"w": a(1, -2, 3), "b": a(0.5, 0.25)}, {"w": a(10, -20, 30), "b": a(5, 2.5)}]
    for tx, rtx in (
        (nba.clip_norm_by_ema(beta=0.5, ord=ord), ref.clip_norm_by_ema(beta=0.5, ord=ord)),
        (nba.clip_norm_growth(ord=ord), ref.clip_norm_growth(ord=ord)),
        (nba.clip_norm_by_ema(beta=0.5, ord=ord, tensorwise=False), ref.clip_norm_by_ema(0.5, ord, False)),
    ):
        outs, _ = run(tx, steps)
        rs = rtx.init(steps[0])
        for got, g in zip(outs, steps):
            want, rs = rtx.update(g, rs)
            assert_tree_close(got, want)


def test_global_l0_counts_nonzeros():
    # torchzero: ZeroDivisionError for 'l0' in every global path.
    tx = nba.clip_norm_growth(ord="l0", tensorwise=False)
    outs, state = run(tx, [[a(1, 0), a(2)], [a(1, 1), a(1)], [a(3, 3), a(3)]])
    assert float(state.prev_norm) == 3.0  # 2 non-zeros, then 3 <= 2 * 1.5


# --- numbaccum's own edge semantics ---------------------------------------------------------


def test_non_finite_update_does_not_poison_the_ema():
    tx = nba.clip_norm_by_ema(beta=0.5)
    steps = [{"a": S34, "b": a(1.0)}, {"a": a(np.inf, 4), "b": a(1.0)}, {"a": S34, "b": a(1.0)}]
    outs, state = run(tx, steps)
    assert outs[1]["a"][0] == np.inf  # passed through unchanged
    np.testing.assert_allclose(outs[2]["a"], [2.25, 3])  # as if the inf step had not been there
    np.testing.assert_allclose(state.exp_avg["a"], [2.25, 3])
    np.testing.assert_allclose(outs[2]["b"], [0.875])  # b's EMA kept going
    # global mode: a non-finite update does not enter the EMA at all
    tx = nba.clip_norm_by_ema(beta=0.5, tensorwise=False)
    outs, state = run(tx, [S34, a(np.nan, 1), S34])
    assert np.isnan(outs[1][0]) and outs[1][1] == 1
    np.testing.assert_allclose(outs[2], [2.25, 3])


def test_non_finite_elements_in_value_clippers():
    outs, state = run(nba.clip_value_by_ema(beta=0.5), [a(2, 2, 2), a(np.inf, -np.inf, np.nan)])
    np.testing.assert_array_equal(outs[1][:2], [1, -1])  # inf is clipped to the EMA
    assert np.isnan(outs[1][2])
    np.testing.assert_array_equal(state.exp_avg.tree, [1, 1, 1])  # and never enters it
    outs, state = run(nba.clip_value_growth(), [a(2, 2, 0), a(np.inf, np.nan, np.inf)])
    np.testing.assert_array_equal(outs[1][[0, 2]], [3, 1.5 * 1e-4])  # clipped: a history, even of 0
    assert np.isnan(outs[1][1])
    np.testing.assert_array_equal(state.prev.tree, [2, 2, 0])


def test_tiny_norm_passes_unchanged():
    outs, state = run(nba.normalize_by_ema(beta=0.5), [S34, a(1e-13, 0)])
    np.testing.assert_array_equal(outs[1], [1e-13, 0])


def test_float32_norms_do_not_overflow():
    big = np.array([1e20, 1e20], np.float32)
    outs, state = run(nba.clip_norm_by_ema(beta=0.5), [big, big])
    assert outs[1].dtype == np.float32 and np.all(np.isfinite(outs[1]))
    np.testing.assert_allclose(outs[1], big * np.float32(0.75), rtol=1e-6)
    outs, _ = run(nba.clip_norm_growth(), [big, big * np.float32(4)])
    np.testing.assert_allclose(outs[1], big * np.float32(1.5), rtol=1e-6)


def test_zero_and_size_zero_leaves_and_mixed_dtypes():
    tree = {
        "s": np.float32(3.0) * np.ones((), np.float32),
        "e": np.zeros((2, 0), np.float64),
        "h": np.array([1.0, -2.0], np.float16),
        "w": np.array([[3.0, 4.0]], np.float64),
    }
    for tx in (
        nba.clip_norm_by_ema(),
        nba.normalize_by_ema(tensorwise=False),
        nba.clip_value_by_ema(),
        nba.clip_norm_growth(),
        nba.clip_value_growth(),
    ):
        outs, _ = run(tx, [tree, nba.tree_map(lambda x: x * 2, tree)])
        for got in outs:
            for k in tree:
                assert got[k].dtype == tree[k].dtype and got[k].shape == tree[k].shape


# --- the plain NumPy reference on random trees ----------------------------------------------

ORDS = st.sampled_from([2, 1, math.inf, 3, "mad", "std", "l0", -math.inf])
# add, mul, min_value, max_decay of the growth clippers
GROWTH = (
    st.sampled_from([None, 0.5, 2.0]),
    st.sampled_from([None, 1.5, 1.01]),
    st.sampled_from([None, 1e-4, 0.3]),
    st.sampled_from([None, 2.0, 3.0]),
)


def against_reference(tx, rtx, params, steps, states):
    """Runs ``tx`` and its reference ``rtx`` side by side; ``states`` lists pairs of (state,
    reference state) accessors to compare after each step."""
    state, rstate = tx.init(params), rtx.init(params)
    for g in steps:
        u, state = tx.update(g, state)
        want, rstate = rtx.update(g, rstate)
        assert_tree_close(u, want)
        for ours, theirs in states:
            assert_tree_close(ours(state), theirs(rstate, g), rtol=1e-6, check_dtype=False)


def as_tree(leaves_of):
    """A reference state's list of leaves as a tree shaped like the updates ``g``."""
    return lambda rstate, g: ref.tree_unflatten(ref.tree_structure(g), leaves_of(rstate))


def _ema_norm_clippers(seq, beta, ord, tensorwise, growth, init, normalize):
    make = nba.normalize_by_ema if normalize else nba.clip_norm_by_ema
    tx = make(beta=beta, ord=ord, tensorwise=tensorwise, max_ema_growth=growth, init=init)
    rtx = ref.clip_norm_by_ema(beta, ord, tensorwise, growth, init, 1e-6, normalize)
    checks = [
        (lambda s: s.exp_avg.tree, as_tree(lambda r: r.exp_avg)),
        (lambda s: s.prev_ema_norm, lambda r, g: r.prev),
    ]
    against_reference(tx, rtx, *seq, checks)


test_ema_norm_clippers_against_reference, test_ema_norm_clippers_against_reference_long = quick_and_long(
    _ema_norm_clippers,
    tree_sequences(min_steps=2, max_steps=5),
    st.sampled_from([0.0, 0.5, 0.9]),
    ORDS,
    st.booleans(),
    st.sampled_from([None, 1.5, 1.1]),
    st.sampled_from([0.0, 0.5]),
    st.booleans(),
)


def _norm_growth(seq, add, mul, min_value, max_decay, ord, tensorwise):
    tx = nba.clip_norm_growth(add, mul, min_value, max_decay, ord, tensorwise)
    rtx = ref.clip_norm_growth(add, mul, min_value, max_decay, ord, tensorwise)
    against_reference(tx, rtx, *seq, [(lambda s: s.prev_norm, lambda r, g: r.prev_norm)])


test_norm_growth_against_reference, test_norm_growth_against_reference_long = quick_and_long(
    _norm_growth, tree_sequences(min_steps=2, max_steps=5), *GROWTH, ORDS, st.booleans()
)


def _value_growth(seq, add, mul, min_value, max_decay):
    tx = nba.clip_value_growth(add, mul, min_value, max_decay)
    rtx = ref.clip_value_growth(add, mul, min_value, max_decay)
    against_reference(tx, rtx, *seq, [(lambda s: s.prev.tree, as_tree(lambda r: r.prev))])


test_value_growth_against_reference, test_value_growth_against_reference_long = quick_and_long(
    _value_growth, tree_sequences(min_steps=2, max_steps=5), *GROWTH
)


def _value_ema(seq, beta, init):
    tx, rtx = nba.clip_value_by_ema(beta, init), ref.clip_value_by_ema(beta, init)
    against_reference(tx, rtx, *seq, [(lambda s: s.exp_avg.tree, as_tree(lambda r: r.exp_avg))])


test_value_ema_against_reference, test_value_ema_against_reference_long = quick_and_long(
    _value_ema,
    tree_sequences(min_steps=2, max_steps=5),
    st.sampled_from([0.0, 0.5, 0.99]),
    st.sampled_from([0.0, 1.0, 2.0]),
)


# --- protocol: trees, FlatTrees, chains, states, errors -------------------------------------


def tree_pair():
    rng = np.random.default_rng(3)
    p = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3), "s": np.ones(())}
    steps = [nba.tree_map(lambda x, k=k: (x * (k + 1) * 3).astype(x.dtype), p) for k in range(4)]
    return p, steps


# The registry's Cases of numbaccum.adaptive (tests/registry.py).
ADAPTIVE = {
    "clip_norm_by_ema",
    "normalize_by_ema",
    "clip_value_by_ema",
    "clip_norm_growth",
    "clip_value_growth",
}
ALL = sorted(n for n, c in CASES.items() if c.public in ADAPTIVE)


@pytest.mark.parametrize("name", ALL)
def test_flattree_in_flattree_out_same_values_and_input_untouched(name):
    p, steps = tree_pair()
    tx1, tx2 = CASES[name].make(), CASES[name].make()
    s1, s2 = tx1.init(p), tx2.init(nba.FlatTree.from_tree(p))
    for g in steps:
        before = snapshot(g)
        u1, s1 = tx1.update(g, s1)
        flat = nba.FlatTree.from_tree(g)
        u2, s2 = tx2.update(flat, s2)
        assert isinstance(u2, nba.FlatTree)
        assert_tree_close(u1, u2.tree, rtol=0.0, atol_rel=0.0)
        assert_tree_close(g, before, rtol=0.0, atol_rel=0.0)


@pytest.mark.parametrize("name", ALL)
def test_chained_after_a_pending_factor_matches_two_steps(name):
    p, steps = tree_pair()
    chained = nba.chain(nba.scale(0.5), CASES[name].make(), nba.scale(-2.0))
    alone = CASES[name].make()
    sc, sa = chained.init(p), alone.init(p)
    for g in steps:
        uc, sc = chained.update(g, sc, p)
        half = nba.tree_map(lambda x: (x * x.dtype.type(0.5)).astype(x.dtype), g)
        ua, sa = alone.update(half, sa)
        assert_tree_close(uc, nba.tree_map(lambda x: x * x.dtype.type(-2.0), snapshot(ua)))


@pytest.mark.parametrize("name", ALL)
def test_state_is_unchanged_after_a_failed_update(name):
    p, steps = tree_pair()
    tx = CASES[name].make()
    _, state = tx.update(steps[0], tx.init(p))
    saved = nba.copy_state(state)
    if CASES[name].public != "clip_norm_growth":  # its state holds one norm per leaf, no shapes
        bad = dict(steps[1])
        bad["w"] = bad["w"][:, :2]
        with pytest.raises(ValueError, match=r"updates\['w'\]"):
            tx.update(bad, state)
    with pytest.raises(ValueError):
        tx.update({"w": steps[1]["w"], "b": steps[1]["b"]}, state)
    with pytest.raises(TypeError, match=r"updates\['s'\]"):
        tx.update({**steps[1], "s": np.ones((), np.int32)}, state)
    for x, y in zip(nba.tree_flatten(state)[0], nba.tree_flatten(saved)[0]):
        if isinstance(x, Layout):  # clip_norm_growth's state names its tree (issue 12 item 4)
            assert x is y
            continue
        x = x.tree if isinstance(x, nba.FlatTree) else x
        y = y.tree if isinstance(y, nba.FlatTree) else y
        assert_tree_close(x, y, rtol=0.0, atol_rel=0.0)
    u1, _ = tx.update(steps[1], state)
    u2, _ = tx.update(steps[1], saved)
    assert_tree_close(u1, u2, rtol=0.0, atol_rel=0.0)


def test_copy_state_is_independent_and_states_are_flat():
    p, steps = tree_pair()
    tx = nba.clip_norm_by_ema()
    state = tx.init(p)
    assert isinstance(state.exp_avg, nba.FlatTree) and state.exp_avg["w"].shape == (4, 3)
    assert state.prev_ema_norm.dtype == np.float64 and state.prev_ema_norm.shape == (3,)
    copy = nba.copy_state(state)
    _, state = tx.update(steps[0], state)
    assert np.all(copy.prev_ema_norm == 0) and np.all(copy.exp_avg["w"] == 0)


def test_wrong_state_type_and_shape():
    p, steps = tree_pair()
    with pytest.raises(TypeError, match="ClipNormByEmaState"):
        nba.clip_norm_by_ema().update(steps[0], nba.clip_norm_growth().init(p))
    state = nba.clip_norm_growth(tensorwise=False).init(p)
    with pytest.raises(ValueError, match="prev_norm"):
        nba.clip_norm_growth().update(steps[0], state)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: nba.clip_norm_by_ema(beta=1.5), "beta"),
        (lambda: nba.clip_norm_by_ema(ord="nope"), "ord"),
        (lambda: nba.clip_norm_by_ema(max_ema_growth=0.0), "max_ema_growth"),
        (lambda: nba.clip_norm_by_ema(min_norm=-1.0), "min_norm"),
        (lambda: nba.normalize_by_ema(init=math.nan), "init"),
        (lambda: nba.clip_value_by_ema(beta=-0.1), "beta"),
        (lambda: nba.clip_norm_growth(mul=0.0), "mul"),
        (lambda: nba.clip_norm_growth(add=-1.0), "add"),
        (lambda: nba.clip_value_growth(max_decay=0.5), "max_decay"),
        (lambda: nba.clip_value_growth(min_value=math.nan), "min_value"),
        (lambda: nba.clip_norm_growth(ord=math.nan), "ord"),
    ],
)
def test_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_one_launch_family_per_group_no_python_loop_over_leaves(monkeypatch):
    # Per-leaf values come from one segmented call per dtype group, whatever the leaf count.
    import inspect

    from numbaccum.contract import Ops

    calls = []
    for name, real in inspect.getmembers(Ops, inspect.isfunction):
        if not name.startswith("_"):  # every kernel of the contract, counted
            counted = lambda self, *a, _n=name, _f=real: calls.append(_n) or _f(self, *a)  # noqa: E731
            monkeypatch.setattr(Ops, name, counted)
    counts = []
    for n in (3, 40):
        tree = {f"p{i:02d}": np.full(5, float(i + 1)) for i in range(n)}
        for tx in (nba.clip_norm_by_ema(), nba.clip_norm_growth()):
            s = tx.init(tree)
            for k in range(3):
                _, s = tx.update(nba.tree_map(lambda x, k=k: x * (1 + 10 * k), tree), s)
        counts.append(len(calls))
        calls.clear()
    assert counts[0] == counts[1]
