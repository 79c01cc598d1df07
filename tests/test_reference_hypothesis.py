"""numbaccum against the plain NumPy reference (tests/reference.py) on random trees.

Trees are nested dict/list/tuple/NamedTuple/None with float32/float64 leaves of
shapes including 0-d and size 0 (tests/strategies.py). Each test runs several
steps and compares updates and state after every step. float32 agrees within
rtol 1e-6 and float64 within 1e-12 (DESIGN.md "Numerics"); ema's float32 output
is compared bit for bit (API.md "ema").
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import reference as ref
import strategies as strat
from _testutil import (
    as_tree,
    assert_exact_positive_zeros,
    assert_same_structure,
    assert_tree_close,
    assert_tree_equal,
    find_state,
    leaves,
    no_shared_memory,
    scalar_int,
    snapshot,
    thread_counts,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import numbaccum as nba

# NUMBACCUM_HYPOTHESIS_EXAMPLES raises the example count for a longer bug hunt.
SETTINGS = settings(
    deadline=None,
    max_examples=int(os.environ.get("NUMBACCUM_HYPOTHESIS_EXAMPLES", "25")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

F32 = np.dtype(np.float32)


def _maybe_flat(grads, as_flat):
    """Yield each step's gradient as given, or through one reused FlatTree."""
    if not as_flat:
        yield from grads
        return
    ft = nba.FlatTree.from_tree(grads[0])
    for g in grads:
        ft.assign_(g)
        yield ft


def _check_output_kind(u, as_flat):
    if as_flat:
        assert isinstance(u, nba.FlatTree), f"FlatTree in, {type(u).__name__} out"
    else:
        assert not isinstance(u, nba.FlatTree), "plain tree in, FlatTree out"


def _assert_ema_match(actual, expected, msg=""):
    """float32 leaves bit for bit; float64 leaves within 1e-12."""
    assert_same_structure(actual, expected)
    el = leaves(expected)
    for p, a, e in zip(ref.tree_paths(as_tree(expected)), leaves(actual), el):
        scale = float(np.max(np.abs(e))) if np.size(e) else 0.0  # this leaf's, not the tree's
        a = np.asarray(a)
        assert a.shape == e.shape and a.dtype == e.dtype, (
            f"{msg} {p}: {a.dtype}{a.shape} vs {e.dtype}{e.shape}"
        )
        if e.dtype == F32:
            np.testing.assert_array_equal(a, e, err_msg=f"{msg} {p} (float32 must be bit-exact)")
        else:
            np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12 * scale, err_msg=f"{msg} {p}")


# ---------------------------------------------------------------------------
# Trees and FlatTree
# ---------------------------------------------------------------------------


@SETTINGS
@given(tree=strat.trees(min_leaves=0))
def test_tree_flatten_order_and_roundtrip(tree):
    leaves_n, treedef = nba.tree_flatten(tree)
    leaves_r, _ = ref.tree_flatten(tree)
    assert len(leaves_n) == len(leaves_r)
    for a, b in zip(leaves_n, leaves_r):
        assert a is b, "leaf order differs from sorted-dict / sequence order"
    back = nba.tree_unflatten(treedef, leaves_n)
    assert_same_structure(back, tree)
    neg = nba.tree_map(np.negative, tree)
    assert_tree_equal(neg, ref.tree_map(np.negative, tree))
    two = nba.tree_map(np.add, tree, tree)
    assert_tree_equal(two, ref.tree_map(np.add, tree, tree))


@SETTINGS
@given(tree=strat.trees())
def test_flattree_views_and_copies(tree):
    before = snapshot(tree)
    ft = nba.FlatTree.from_tree(tree)
    assert_tree_equal(ft.tree, tree)
    assert_tree_equal(tree, before)
    if isinstance(tree, dict):
        for key in tree:
            assert_tree_equal(ft[key], tree[key])
    if isinstance(tree, np.ndarray):
        np.testing.assert_array_equal(np.asarray(ft), tree)
    for dt, buf in ft.buffers.items():
        assert isinstance(dt, np.dtype)
        assert buf.ndim == 1 and buf.dtype == dt
    total = {}
    for x in ref.tree_leaves(tree):
        total[x.dtype] = total.get(x.dtype, 0) + x.size
    for dt, n in total.items():
        if n:
            assert ft.buffers[dt].size >= n
    bufs = list(ft.buffers.values())
    for x in leaves(ft):
        if np.size(x):
            assert any(np.shares_memory(x, b) for b in bufs), "FlatTree.tree leaf is not a view"
            assert all(not np.shares_memory(x, y) for y in ref.tree_leaves(tree) if np.size(y))
    # Writing through a view changes the buffer (the user may compute into it).
    for x in leaves(ft):
        if np.size(x):
            x.reshape(-1)[0] = 123.0
            assert any(np.any(b == 123.0) for b in bufs)
            break
    c = ft.copy()
    assert_tree_equal(c.tree, ft.tree)
    for x in leaves(c):
        if np.size(x):
            assert not any(np.shares_memory(x, b) for b in bufs)
    z = ft.zeros_like()
    assert_tree_equal(z.tree, ref.zeros_like(tree))
    z.assign_(tree)
    assert_tree_equal(z.tree, tree)
    one = nba.FlatTree.from_tree(tree, dtype=np.float64)
    assert_tree_close(one.tree, ref.tree_map(lambda x: x.astype(np.float64), tree), rtol=0, atol_rel=0)


# ---------------------------------------------------------------------------
# trace
# ---------------------------------------------------------------------------


@SETTINGS
@given(
    data=strat.tree_sequences(max_steps=5),
    decay=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]),
    nesterov=st.booleans(),
    as_flat=st.booleans(),
)
def test_trace_matches_reference(data, decay, nesterov, as_flat):
    params, grads = data
    tx = nba.trace(decay, nesterov=nesterov)
    rtx = ref.trace(decay, nesterov=nesterov)
    s = tx.init(nba.FlatTree.from_tree(params) if as_flat else params)
    rs = rtx.init(params)
    for i, (g, gin) in enumerate(zip(grads, _maybe_flat(grads, as_flat))):
        u, s = tx.update(gin, s)
        ru, rs = rtx.update(g, rs)
        _check_output_kind(u, as_flat)
        assert_tree_close(u, ru, msg=f"updates step {i}")
        assert_tree_close(s.trace, rs.trace, msg=f"trace step {i}")
        assert_tree_equal(gin, g)  # update never modifies its input
        assert no_shared_memory(u, s.trace), "updates alias the trace accumulator"
        assert no_shared_memory(u, gin), "updates alias the input"


@SETTINGS
@given(data=strat.tree_sequences(max_steps=4, dtypes=(F32,)), nesterov=st.booleans())
def test_trace_accumulator_dtype_float64(data, nesterov):
    params, grads = data
    tx = nba.trace(0.9, nesterov=nesterov, accumulator_dtype=np.float64)
    rtx = ref.trace(0.9, nesterov=nesterov, accumulator_dtype=np.float64)
    s, rs = tx.init(params), rtx.init(params)
    for i, g in enumerate(grads):
        u, s = tx.update(g, s)
        ru, rs = rtx.update(g, rs)
        for a in leaves(s.trace):
            assert np.asarray(a).dtype == np.float64
        # optax keeps the promoted dtype for the updates; only values are checked.
        assert_tree_close(u, ru, rtol=1e-6, check_dtype=False, msg=f"updates step {i}")
        assert_tree_close(s.trace, rs.trace, rtol=1e-12, msg=f"trace step {i}")


# ---------------------------------------------------------------------------
# ema
# ---------------------------------------------------------------------------


@SETTINGS
@given(
    data=strat.tree_sequences(max_steps=6),
    # SAFE_DECAYS: every float32 evaluation of 1 - d**count agrees there; 0.9 and
    # 0.99 are the common values (and agree with the reference's scalar power).
    decay=st.sampled_from(list(ref.SAFE_DECAYS) + [0.9, 0.99]),
    debias=st.booleans(),
    as_flat=st.booleans(),
)
def test_ema_matches_reference(data, decay, debias, as_flat):
    params, grads = data
    tx = nba.ema(decay, debias=debias)
    rtx = ref.ema(decay, debias=debias)
    s = tx.init(nba.FlatTree.from_tree(params) if as_flat else params)
    rs = rtx.init(params)
    saved = None
    outs = []
    mid = len(grads) // 2
    for i, (g, gin) in enumerate(zip(grads, _maybe_flat(grads, as_flat))):
        if i == mid:
            saved = nba.copy_state(s)
        u, s = tx.update(gin, s)
        ru, rs = rtx.update(g, rs)
        _check_output_kind(u, as_flat)
        _assert_ema_match(u, ru, f"updates step {i}")
        _assert_ema_match(s.ema, rs.ema, f"ema step {i}")
        assert scalar_int(s.count) == int(rs.count)
        assert no_shared_memory(u, s.ema)
        outs.append(snapshot(u))
    # copy_state is an independent snapshot: replaying from it reproduces the run.
    for i in range(mid, len(grads)):
        u, saved = tx.update(grads[i], saved)
        assert_tree_equal(u, outs[i])


@SETTINGS
@given(data=strat.tree_sequences(max_steps=4, dtypes=(F32,)), debias=st.booleans())
def test_ema_accumulator_dtype_float64(data, debias):
    params, grads = data
    tx = nba.ema(0.9, debias=debias, accumulator_dtype=np.float64)
    rtx = ref.ema(0.9, debias=debias, accumulator_dtype=np.float64)
    s, rs = tx.init(params), rtx.init(params)
    for i, g in enumerate(grads):
        u, s = tx.update(g, s)
        ru, rs = rtx.update(g, rs)
        for a in leaves(s.ema):
            assert np.asarray(a).dtype == np.float64
        assert_tree_close(s.ema, rs.ema, rtol=1e-12, msg=f"ema step {i}")
        assert_tree_close(u, ru, rtol=1e-6, check_dtype=False, msg=f"updates step {i}")


# ---------------------------------------------------------------------------
# apply_every
# ---------------------------------------------------------------------------


@SETTINGS
@given(data=strat.tree_sequences(min_steps=1, max_steps=8), k=st.integers(1, 5), as_flat=st.booleans())
def test_apply_every_matches_reference(data, k, as_flat):
    params, grads = data
    tx = nba.apply_every(k)
    rtx = ref.apply_every(k)
    s, rs = tx.init(params), rtx.init(params)
    for i, (g, gin) in enumerate(zip(grads, _maybe_flat(grads, as_flat))):
        u, s = tx.update(gin, s)
        ru, rs = rtx.update(g, rs)
        _check_output_kind(u, as_flat)
        assert_tree_close(u, ru, msg=f"updates step {i}")
        assert_tree_close(s.grad_acc, rs.grad_acc, msg=f"grad_acc step {i}")
        assert scalar_int(s.count) == int(rs.count)


# ---------------------------------------------------------------------------
# MultiSteps
# ---------------------------------------------------------------------------

SCHEDULES = {
    "k1": 1,
    "k2": 2,
    "k3": 3,
    "k4": 4,
    "k5": 5,
    "cycle123": lambda s: 1 + s % 3,
    "where": lambda s: 1 if s < 2 else 3,
}

INNER = {
    "sgd": (lambda: nba.sgd(0.1), lambda: ref.sgd(0.1)),
    "momentum": (lambda: nba.sgd(0.1, momentum=0.9), lambda: ref.sgd(0.1, momentum=0.9)),
    "adam": (lambda: nba.adam(0.05), lambda: ref.adam(0.05)),
    "adamw_chain": (
        lambda: nba.chain(nba.scale_by_adam(), nba.add_decayed_weights(1e-2), nba.scale(-1e-3)),
        lambda: ref.chain(ref.scale_by_adam(), ref.add_decayed_weights(1e-2), ref.scale(-1e-3)),
    ),
}


@SETTINGS
@given(
    data=strat.tree_sequences(min_steps=1, max_steps=9),
    schedule=st.sampled_from(sorted(SCHEDULES)),
    use_grad_mean=st.booleans(),
    as_flat=st.booleans(),
)
@pytest.mark.parametrize("inner", sorted(INNER))
def test_multi_steps_matches_reference(inner, data, schedule, use_grad_mean, as_flat):
    params, grads = data
    make_n, make_r = INNER[inner]
    ms = nba.MultiSteps(make_n(), SCHEDULES[schedule], use_grad_mean=use_grad_mean)
    rms = ref.MultiSteps(make_r(), SCHEDULES[schedule], use_grad_mean=use_grad_mean)
    s, rs = ms.init(params), rms.init(params)
    assert bool(ms.has_updated(s)) is False
    for i, (g, gin) in enumerate(zip(grads, _maybe_flat(grads, as_flat))):
        u, s = ms.update(gin, s, params)
        ru, rs = rms.update(g, rs, params)
        _check_output_kind(u, as_flat)
        emitted = rms.has_updated(rs)
        if emitted:
            assert_tree_close(u, ru, msg=f"emitted updates step {i}")
            assert_exact_positive_zeros(s.acc_grads, f"acc reset step {i}")
        else:
            assert_same_structure(u, ru)
            assert_exact_positive_zeros(u, f"non-emitting step {i}")
            for a, e in zip(leaves(u), leaves(ru)):
                assert np.asarray(a).dtype == e.dtype and np.shape(a) == e.shape
        assert_tree_close(s.acc_grads, rs.acc_grads, msg=f"acc_grads step {i}")
        assert scalar_int(s.mini_step) == int(rs.mini_step)
        assert scalar_int(s.gradient_step) == int(rs.gradient_step)
        assert bool(ms.has_updated(s)) is bool(emitted)
        assert_tree_equal(gin, g)
        assert no_shared_memory(u, s.acc_grads)
    if inner in ("adam", "adamw_chain"):
        a = _find(s.inner_opt_state, nba.ScaleByAdamState)
        ref_adam = _find(rs.inner_opt_state, ref.ScaleByAdamState)
        assert scalar_int(a.count) == int(ref_adam.count)
        assert_tree_close(a.mu, ref_adam.mu, msg="adam mu")
        assert_tree_close(a.nu, ref_adam.nu, msg="adam nu")


@SETTINGS
@given(data=strat.tree_sequences(min_steps=2, max_steps=8), k=st.integers(1, 4))
def test_multi_steps_skip_not_finite_matches_reference(data, k):
    params, grads = data
    # Poison every third gradient with a NaN or an inf in its first non-empty leaf.
    poisoned = []
    for i, g in enumerate(grads):
        g = ref.tree_copy(g)
        if i % 3 == 1:
            for x in ref.tree_leaves(g):
                if x.size:
                    x.reshape(-1)[0] = np.nan if i % 2 else np.inf
                    break
        poisoned.append(g)
    ms = nba.MultiSteps(nba.sgd(0.5), k, should_skip_update_fn=nba.skip_not_finite)
    rms = ref.MultiSteps(ref.sgd(0.5), k, should_skip_update_fn=ref.skip_not_finite)
    s, rs = ms.init(params), rms.init(params)
    for i, g in enumerate(poisoned):
        u, s = ms.update(g, s, params)
        ru, rs = rms.update(g, rs, params)
        assert_tree_close(u, ru, msg=f"updates step {i}")
        assert_tree_close(s.acc_grads, rs.acc_grads, msg=f"acc step {i}")
        assert scalar_int(s.mini_step) == int(rs.mini_step)
        assert scalar_int(s.gradient_step) == int(rs.gradient_step)
        assert bool(s.skip_state["should_skip"]) is bool(rs.skip_state["should_skip"])
        assert int(s.skip_state["num_not_finite"]) == rs.skip_state["num_not_finite"]


@SETTINGS
@given(
    data=strat.tree_sequences(min_steps=2, max_steps=8),
    k=st.integers(1, 3),
    max_sq=st.sampled_from([1.0, 50.0, 400.0]),
)
def test_multi_steps_skip_large_updates_matches_reference(data, k, max_sq):
    params, grads = data
    fn = lambda u, gs, p: nba.skip_large_updates(u, gs, p, max_squared_norm=max_sq)  # noqa: E731
    rfn = lambda u, gs, p: ref.skip_large_updates(u, gs, p, max_squared_norm=max_sq)  # noqa: E731
    ms = nba.MultiSteps(nba.sgd(0.5), k, should_skip_update_fn=fn)
    rms = ref.MultiSteps(ref.sgd(0.5), k, should_skip_update_fn=rfn)
    s, rs = ms.init(params), rms.init(params)
    for i, g in enumerate(grads):
        u, s = ms.update(g, s, params)
        ru, rs = rms.update(g, rs, params)
        assert_tree_close(u, ru, msg=f"updates step {i}")
        assert_tree_close(s.acc_grads, rs.acc_grads, msg=f"acc step {i}")
        assert scalar_int(s.mini_step) == int(rs.mini_step)
        assert bool(s.skip_state["should_skip"]) is bool(rs.skip_state["should_skip"])
        np.testing.assert_allclose(
            float(s.skip_state["norm_squared"]), rs.skip_state["norm_squared"], rtol=1e-12
        )


@SETTINGS
@given(data=strat.tree_sequences(min_steps=1, max_steps=6, dtypes=(F32,)), k=st.integers(1, 3))
def test_multi_steps_float64_accumulator(data, k):
    params, grads = data
    ms = nba.MultiSteps(nba.sgd(1.0), k, accumulator_dtype=np.float64)
    rms = ref.MultiSteps(ref.sgd(1.0), k, accumulator_dtype=np.float64)
    s, rs = ms.init(params), rms.init(params)
    for i, g in enumerate(grads):
        u, s = ms.update(g, s, params)
        ru, rs = rms.update(g, rs, params)
        assert_tree_close(u, ru, rtol=1e-6, msg=f"updates step {i}")
        for a in leaves(s.acc_grads):
            assert np.asarray(a).dtype == np.float64
        assert_tree_close(s.acc_grads, rs.acc_grads, rtol=1e-12, msg=f"acc step {i}")


# ---------------------------------------------------------------------------
# sgd / adam / apply_updates
# ---------------------------------------------------------------------------


@SETTINGS
@given(
    data=strat.tree_sequences(min_steps=1, max_steps=5),
    lr=st.sampled_from([0.1, 1e-2, 0.3]),
    momentum=st.sampled_from([None, 0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    as_flat=st.booleans(),
)
def test_sgd_matches_reference(data, lr, momentum, nesterov, as_flat):
    params, grads = data
    tx = nba.sgd(lr, momentum=momentum, nesterov=nesterov)
    rtx = ref.sgd(lr, momentum=momentum, nesterov=nesterov)
    p, rp = params, params
    s, rs = tx.init(p), rtx.init(rp)
    for i, (g, gin) in enumerate(zip(grads, _maybe_flat(grads, as_flat))):
        u, s = tx.update(gin, s, p)
        ru, rs = rtx.update(g, rs, rp)
        _check_output_kind(u, as_flat)
        assert_tree_close(u, ru, msg=f"updates step {i}")
        p_old, p_before = p, snapshot(p)
        p = nba.apply_updates(p_old, as_tree(u))
        rp = ref.apply_updates(rp, ru)
        assert_tree_equal(p_old, p_before)  # apply_updates returns a new tree
        assert_tree_close(p, rp, msg=f"params step {i}")


@SETTINGS
@given(
    data=strat.tree_sequences(min_steps=1, max_steps=6),
    lr=st.sampled_from([1e-3, 0.1]),
    eps_root=st.sampled_from([0.0, 1e-8]),
    schedule=st.booleans(),
)
def test_adam_matches_reference(data, lr, eps_root, schedule):
    params, grads = data
    learning_rate = (lambda c: lr / (1.0 + int(c))) if schedule else lr
    tx = nba.adam(learning_rate, eps_root=eps_root)
    rtx = ref.adam(learning_rate, eps_root=eps_root)
    s, rs = tx.init(params), rtx.init(params)
    for i, g in enumerate(grads):
        u, s = tx.update(g, s, params)
        ru, rs = rtx.update(g, rs, params)
        assert_tree_close(u, ru, msg=f"updates step {i}")
    a = _find(s, nba.ScaleByAdamState)
    ra = _find(rs, ref.ScaleByAdamState)
    assert scalar_int(a.count) == int(ra.count)
    assert_tree_close(a.mu, ra.mu, msg="mu")
    assert_tree_close(a.nu, ra.nu, msg="nu")


@SETTINGS
@given(data=strat.tree_sequences(min_steps=1, max_steps=6), as_flat=st.booleans())
def test_chain_of_stateful_transforms_matches_reference(data, as_flat):
    # Each transform reads the previous one's workspace: checks that chaining
    # never lets one stage overwrite another's output or accumulator.
    params, grads = data
    tx = nba.chain(
        nba.add_decayed_weights(1e-2),
        nba.trace(0.5),
        nba.ema(0.5),
        nba.apply_every(2),
        nba.scale(-0.1),
    )
    rtx = ref.chain(
        ref.add_decayed_weights(1e-2),
        ref.trace(0.5),
        ref.ema(0.5),
        ref.apply_every(2),
        ref.scale(-0.1),
    )
    s, rs = tx.init(params), rtx.init(params)
    for i, (g, gin) in enumerate(zip(grads, _maybe_flat(grads, as_flat))):
        u, s = tx.update(gin, s, params)
        ru, rs = rtx.update(g, rs, params)
        _check_output_kind(u, as_flat)
        assert_tree_close(u, ru, msg=f"updates step {i}")
        assert_tree_close(s[1].trace, rs[1].trace, msg=f"trace step {i}")
        assert_tree_close(s[2].ema, rs[2].ema, msg=f"ema step {i}")
        assert_tree_close(s[3].grad_acc, rs[3].grad_acc, msg=f"grad_acc step {i}")


def _find(state, cls):
    found = find_state(state, cls)
    assert found is not None, f"no {cls.__name__} in {state!r}"
    return found


@SETTINGS
@given(data=strat.tree_sequences(min_steps=1, max_steps=3))
def test_apply_updates_and_in_place(data):
    params, grads = data
    before = snapshot(params)
    new = nba.apply_updates(params, grads[0])
    assert_tree_equal(params, before)
    assert_tree_equal(new, ref.apply_updates(params, grads[0]))
    p = ref.tree_copy(params)
    nba.apply_updates_(p, grads[0])
    assert_tree_equal(p, ref.apply_updates(params, grads[0]))


# ---------------------------------------------------------------------------
# global_norm
# ---------------------------------------------------------------------------


@SETTINGS
@given(
    tree=strat.trees(max_abs=1e3),
    ord=st.sampled_from([1, 2, np.inf]),
    squared=st.booleans(),
    as_flat=st.booleans(),
)
def test_global_norm_matches_reference(tree, ord, squared, as_flat):
    assume(ord != np.inf or sum(np.size(x) for x in ref.tree_leaves(tree)) > 0)
    arg = nba.FlatTree.from_tree(tree) if as_flat else tree
    got = nba.global_norm(arg, ord=ord, squared=squared)
    expected = ref.global_norm(tree, ord=ord, squared=squared)
    assert isinstance(float(got), float)
    np.testing.assert_allclose(float(got), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_global_norm_float64_accumulation(dtype):
    # 1e20 squared overflows float32; the reduction accumulates in float64.
    tree = {"a": np.array([1e20, 1e20], dtype), "b": np.array(3e19, dtype)}
    got = nba.global_norm(tree)
    np.testing.assert_allclose(got, ref.global_norm(tree), rtol=1e-12)
    assert np.isfinite(got)


# ---------------------------------------------------------------------------
# Parallel kernel paths
# ---------------------------------------------------------------------------
# Small trees run the serial kernels. These tests reach the parallel (chunked)
# kernels two ways: by shrinking numbaccum's call-time knobs (_config) so that
# tiny trees are split into many chunks/blocks, and with one tree large enough
# for the default thresholds.


@contextlib.contextmanager
def _small_partitions():
    import numbaccum._config as cfg

    knobs = {"SERIAL_BELOW": 1, "CHUNK": 3, "REDUCE_BLOCK": 4}
    missing = [k for k in knobs if not hasattr(cfg, k)]
    assert not missing, f"numbaccum._config has no {missing}: a renamed knob, update this test"
    old = {k: getattr(cfg, k) for k in knobs}
    try:
        for k, v in knobs.items():
            setattr(cfg, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(cfg, k, v)


PARALLEL_CASES = {
    "trace_nesterov": (lambda: nba.trace(0.9, nesterov=True), lambda: ref.trace(0.9, nesterov=True)),
    "ema": (lambda: nba.ema(0.5), lambda: ref.ema(0.5)),
    "apply_every3": (lambda: nba.apply_every(3), lambda: ref.apply_every(3)),
    "adam": (lambda: nba.adam(0.01), lambda: ref.adam(0.01)),
    "multisteps_mean": (
        lambda: nba.MultiSteps(nba.sgd(0.1, momentum=0.9), 2),
        lambda: ref.MultiSteps(ref.sgd(0.1, momentum=0.9), 2),
    ),
    "multisteps_sum": (
        lambda: nba.MultiSteps(nba.sgd(0.1), 2, use_grad_mean=False),
        lambda: ref.MultiSteps(ref.sgd(0.1), 2, use_grad_mean=False),
    ),
}


@settings(SETTINGS, max_examples=min(SETTINGS.max_examples, 15))
@given(data=strat.tree_sequences(min_steps=1, max_steps=4, max_leaves=4))
@pytest.mark.parametrize("case", sorted(PARALLEL_CASES))
def test_parallel_chunks_match_reference(case, data):
    params, grads = data
    make_n, make_r = PARALLEL_CASES[case]
    with _small_partitions():
        tx, rtx = make_n(), make_r()
        s, rs = tx.init(params), rtx.init(params)
        for i, g in enumerate(grads):
            u, s = tx.update(g, s, params)
            ru, rs = rtx.update(g, rs, params)
            if case == "ema":
                _assert_ema_match(u, ru, f"updates step {i}")
            else:
                assert_tree_close(u, ru, msg=f"updates step {i}")
        for o in (1, 2, np.inf):
            if o == np.inf and not sum(np.size(x) for x in ref.tree_leaves(params)):
                continue
            np.testing.assert_allclose(
                nba.global_norm(params, ord=o), ref.global_norm(params, ord=o), rtol=1e-12
            )


def test_large_tree_default_thresholds():
    rng = np.random.default_rng(1)
    n_big = 200_003  # above the default serial threshold, not a multiple of any chunk
    params = {
        "a": rng.standard_normal(n_big).astype(np.float32),
        "b": {"c": rng.standard_normal((300, 250)), "d": np.float32(0.5) * np.ones((), np.float32)},
        "e": [np.zeros(0, np.float32), rng.standard_normal(7).astype(np.float32)],
    }
    grads = [
        ref.tree_map(lambda x, k=k: (x * np.asarray(k + 1.5, x.dtype)).astype(x.dtype), params)
        for k in range(4)
    ]
    cases = [
        (nba.trace(0.9, nesterov=True), ref.trace(0.9, nesterov=True), False),
        (nba.ema(0.9), ref.ema(0.9), True),
        (nba.MultiSteps(nba.adam(0.01), 2), ref.MultiSteps(ref.adam(0.01), 2), False),
    ]
    for tx, rtx, exact in cases:
        s, rs = tx.init(params), rtx.init(params)
        for i, g in enumerate(grads):
            u, s = tx.update(g, s, params)
            ru, rs = rtx.update(g, rs, params)
            if exact:
                _assert_ema_match(u, ru, f"step {i}")
            else:
                assert_tree_close(u, ru, msg=f"step {i}")
    for o in (1, 2, np.inf):
        for sq in (False, True):
            np.testing.assert_allclose(
                nba.global_norm(params, ord=o, squared=sq),
                ref.global_norm(params, ord=o, squared=sq),
                rtol=1e-12,
            )


def test_global_norm_same_bits_for_any_thread_count():
    # DESIGN.md: reductions use a fixed partition, so the thread count never
    # changes the result's bits.
    import numba

    rng = np.random.default_rng(2)
    tree = {"a": rng.standard_normal(300_001).astype(np.float32), "b": rng.standard_normal(150_000)}
    old = numba.get_num_threads()
    try:
        results = {}
        for nt in thread_counts():
            numba.set_num_threads(nt)
            results[nt] = [nba.global_norm(tree, ord=o) for o in (1, 2, np.inf)]
    finally:
        numba.set_num_threads(old)
    vals = list(results.values())
    for v in vals[1:]:
        assert v == vals[0], results
