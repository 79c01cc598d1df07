"""Adafactor and SM3 (numbaccum.factored) against optax, on the leaves they factor and the ones
they do not: matrices, tensors of rank 3 and 4 whose largest dimensions are not the last ones,
vectors, 0-d and size-1 leaves; float32 (optax's default) and float64 (JAX x64); and what their
states cost.
"""

from __future__ import annotations

import numpy as np
import pytest
from _testutil import require

import numbaccum as nba
from numbaccum.factored import _factored_dims

SHAPES = {
    "mat": (5, 7),
    "tall": (9, 4),
    "vec": (7,),
    "scalar": (),
    "t3": (3, 6, 4),
    "t3_unit": (4, 1, 9),
    "t4": (6, 5, 2, 3),
    "one": (1,),
}


def _tree(rng: np.random.Generator, dtype: type) -> dict:
    return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def _compare(jax, optax, ours, theirs, dtype, steps, rtol):
    """``steps`` updates of both on the same random gradients: updates and every state field."""
    jnp = jax.numpy
    rng = np.random.default_rng(7)
    params = _tree(rng, dtype)
    jparams = jax.tree.map(jnp.asarray, params)
    state, ostate = ours.init(params), theirs.init(jparams)
    for _ in range(steps):
        grads = _tree(rng, dtype)
        u, state = ours.update(grads, state, params)
        ou, ostate = theirs.update(jax.tree.map(jnp.asarray, grads), ostate, jparams)
        for k in SHAPES:
            assert u[k].shape == ou[k].shape and u[k].dtype == ou[k].dtype, k
            np.testing.assert_allclose(u[k], np.asarray(ou[k]), rtol=rtol, atol=0, err_msg=k)
        for field in ("v_row", "v_col", "v"):
            for k in SHAPES:
                a, b = getattr(state, field)[k], np.asarray(getattr(ostate, field)[k])
                assert a.shape == b.shape and a.dtype == b.dtype, (field, k)
                np.testing.assert_allclose(a, b, rtol=rtol, atol=0, err_msg=f"{field}[{k}]")
        assert int(state.count) == int(ostate.count)


@pytest.mark.parametrize("min_dim", [1, 3, 5, 128])
def test_scale_by_factored_rms_matches_optax_in_float32(min_dim):
    jax, optax = require("jax"), require("optax")
    ours = nba.scale_by_factored_rms(min_dim_size_to_factor=min_dim)
    theirs = optax.scale_by_factored_rms(min_dim_size_to_factor=min_dim)
    # optax computes the means and the factors in float32, numbaccum in float64 (one rounding)
    _compare(jax, optax, ours, theirs, np.float32, 5, 2e-6)


def test_scale_by_factored_rms_matches_optax_in_float64_with_a_decay_schedule():
    jax, optax = require("jax"), require("optax")

    def capped(step, rate):  # Zhai et al.'s cap on the second moment's decay
        return min(0.999, 1.0 - (float(step) + 1.0) ** -rate)

    with jax.enable_x64(True):
        kw = dict(decay_rate=0.5, step_offset=-3, min_dim_size_to_factor=4, decay_rate_fn=capped)
        ours = nba.scale_by_factored_rms(**kw)
        theirs = optax.scale_by_factored_rms(**kw)
        _compare(jax, optax, ours, theirs, np.float64, 4, 1e-13)


def test_adafactor_trains_as_optax_does():
    """The whole chain (clipping, learning rate, parameter scale, momentum, weight decay) on a
    least-squares fit of a 130x140 matrix: the same params after 20 steps."""
    jax, optax = require("jax"), require("optax")
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    target = rng.standard_normal((130, 140)).astype(np.float32)
    params = {"w": np.zeros((130, 140), np.float32), "b": np.ones(140, np.float32)}
    jparams = jax.tree.map(jnp.asarray, params)
    kw = dict(learning_rate=0.01, momentum=0.9, weight_decay_rate=1e-3)
    ours, theirs = nba.adafactor(**kw), optax.adafactor(**kw)
    state, ostate = ours.init(params), theirs.init(jparams)
    for _ in range(20):
        grads = {"w": params["w"] - target, "b": params["b"]}
        state = nba.step_(ours, grads, state, params)
        og = {"w": jparams["w"] - target, "b": jparams["b"]}
        ou, ostate = theirs.update(og, ostate, jparams)
        jparams = optax.apply_updates(jparams, ou)
    for k in params:
        np.testing.assert_allclose(params[k], np.asarray(jparams[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    assert np.mean((params["w"] - target) ** 2) < np.mean(target**2)  # it trains


def test_the_factored_dimensions_are_optaxs():
    assert _factored_dims((5, 7), True, 5) == (0, 1)
    assert _factored_dims((9, 4), True, 4) == (1, 0)
    assert _factored_dims((6, 5, 2, 3), True, 3) == (1, 0)
    assert _factored_dims((9, 4), True, 5) is None  # the second largest is below the minimum
    assert _factored_dims((9, 4), False, 1) is None
    assert _factored_dims((7,), True, 1) is None
    assert _factored_dims((0, 200, 300), True, 128) is None  # empty: never factored here


def test_a_matrix_keeps_two_vectors_of_state():
    """What Adafactor is for: GPT-2's token embedding (50257 x 768) keeps 51,025 numbers of
    second moments where Adam keeps 38.6 million."""
    params = {"wte": np.zeros((50257, 768), np.float32), "ln": np.zeros(768, np.float32)}
    state = nba.scale_by_factored_rms().init(params)
    assert state.v_row["wte"].shape == (768,) and state.v_col["wte"].shape == (50257,)
    assert state.v["wte"].shape == (1,) and state.v["ln"].shape == (768,)
    held = sum(f.layout.size for f in (state.v_row, state.v_col, state.v))
    assert held == (768 + 1) + (50257 + 1) + (1 + 768)  # v_row, v_col, v: a (1,) where unused


def test_an_empty_leaf_keeps_an_empty_second_moment():
    params = {"e": np.zeros((0, 200, 300), np.float32), "w": np.ones((200, 300), np.float32)}
    tx = nba.scale_by_factored_rms()
    state = tx.init(params)
    assert state.v["e"].shape == (0, 200, 300) and state.v_row["e"].shape == (1,)
    u, state = tx.update({k: np.ones_like(v) for k, v in params.items()}, state, params)
    assert u["e"].shape == (0, 200, 300)
    np.testing.assert_allclose(u["w"], 1.0, rtol=1e-6)


def test_a_bad_decay_schedule_is_refused_before_anything_is_written():
    params = {"w": np.ones((4, 4), np.float32)}
    tx = nba.scale_by_factored_rms(min_dim_size_to_factor=2, decay_rate_fn=lambda step, rate: "0.5")
    state = tx.init(params)
    with pytest.raises(TypeError, match="decay_rate_fn must return a real number"):
        tx.update({"w": np.ones((4, 4), np.float32)}, state, params)
    assert int(state.count) == 0 and not state.v_row["w"].any() and not state.v_col["w"].any()
    with pytest.raises(TypeError, match="decay_rate_fn must be callable"):
        nba.scale_by_factored_rms(decay_rate_fn=0.8)


def test_it_needs_params():
    tx = nba.scale_by_factored_rms()
    g = {"w": np.ones(3)}
    with pytest.raises(ValueError, match="requires the current value of parameters"):
        tx.update(g, tx.init(g))


# --- SM3 -------------------------------------------------------------------------------------

SM3_SHAPES = {k: v for k, v in SHAPES.items() if v != ()}  # optax's SM3 fails on 0-d leaves


def _compare_sm3(jax, ours, theirs, dtype, steps, tol):
    jnp = jax.numpy
    rng = np.random.default_rng(3)
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in SM3_SHAPES.items()}
    state, ostate = ours.init(params), theirs.init(jax.tree.map(jnp.asarray, params))
    for step in range(steps):
        grads = {k: rng.standard_normal(s).astype(dtype) for k, s in SM3_SHAPES.items()}
        grads["mat"][0, :] = 0.0  # accumulators at 0 at the first step: a step of 0 there
        u, state = ours.update(grads, state, params)
        ou, ostate = theirs.update(jax.tree.map(jnp.asarray, grads), ostate)
        for k in SM3_SHAPES:
            b = np.asarray(ou[k])
            # the momentum may cancel: the error is relative to the leaf's scale
            np.testing.assert_allclose(u[k], b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=f"{step} {k}")
            np.testing.assert_allclose(
                state.nu[k], np.asarray(ostate.nu[k]), rtol=tol, atol=tol * np.abs(b).max()
            )
            assert len(state.mu[k]) == len(ostate.mu[k])
            for i, (m, om) in enumerate(zip(state.mu[k], ostate.mu[k])):
                assert m.shape == om.shape and m.dtype == om.dtype
                np.testing.assert_allclose(m, np.asarray(om), rtol=tol, err_msg=f"mu[{k}][{i}]")


@pytest.mark.parametrize("b1,b2", [(0.9, 1.0), (0.5, 0.9), (0.0, 0.99)])
def test_scale_by_sm3_matches_optax_in_float32(b1, b2):
    jax, optax = require("jax"), require("optax")
    # 1 / sqrt against optax's rsqrt, then the momentum: a few float32 roundings
    _compare_sm3(jax, nba.scale_by_sm3(b1, b2), optax.scale_by_sm3(b1, b2), np.float32, 5, 1e-5)


def test_scale_by_sm3_matches_optax_in_float64():
    jax, optax = require("jax"), require("optax")
    with jax.enable_x64(True):
        _compare_sm3(jax, nba.scale_by_sm3(0.8, 0.95), optax.scale_by_sm3(0.8, 0.95), np.float64, 4, 1e-13)


def test_sm3_keeps_one_statistic_per_index_of_each_axis():
    params = {"wte": np.zeros((50257, 768), np.float32), "x": np.zeros((), np.float32)}
    state = nba.scale_by_sm3().init(params)
    assert [m.shape for m in state.mu["wte"]] == [(50257,), (768,)]
    assert [m.shape for m in state.mu["x"]] == [(1,)]  # a 0-d leaf counts as shape (1,)
    assert state.mu.layout.size == 50257 + 768 + 1


def test_sm3_on_a_0d_leaf_is_adagrad_with_momentum():
    tx = nba.scale_by_sm3(b1=0.0)
    params = {"x": np.float32(1.0) * np.ones((), np.float32)}
    state = tx.init(params)
    total = 0.0
    for g in (3.0, -4.0, 12.0):
        total += g * g
        u, state = tx.update({"x": np.array(g, np.float32)}, state, params)
        assert u["x"].shape == ()
        np.testing.assert_allclose(u["x"], g / np.sqrt(total + 1e-8), rtol=1e-6)
        np.testing.assert_allclose(state.mu["x"][0], [total], rtol=1e-6)


def test_sm3_after_a_nan_gradient_matches_optax():
    """A NaN gradient poisons the statistics of its row and column (optax's max and min keep
    NaN), and from there every accumulator that reads them: the same NaNs and steps as optax."""
    jax, optax = require("jax"), require("optax")
    jnp = jax.numpy
    tx, otx = nba.scale_by_sm3(), optax.scale_by_sm3()
    params = {"w": np.zeros((3, 4), np.float32)}
    state, ostate = tx.init(params), otx.init(jax.tree.map(jnp.asarray, params))
    g = np.ones((3, 4), np.float32)
    g[1, 2] = np.nan
    for grads in (g, 2 * np.ones((3, 4), np.float32)):
        u, state = tx.update({"w": grads}, state, params)
        ou, ostate = otx.update({"w": jnp.asarray(grads)}, ostate)
        np.testing.assert_allclose(u["w"], np.asarray(ou["w"]), rtol=1e-6)
        for m, om in zip(state.mu["w"], ostate.mu["w"]):
            np.testing.assert_array_equal(m, np.asarray(om))
    assert np.isnan(state.mu["w"][0]).all()  # by the second step every row meets column 2


@pytest.mark.parametrize("block", [5, 64, 4096])
def test_sm3_runs_along_the_last_axis_give_the_element_by_element_bits(block):
    """The host pass cuts each leaf into runs along its last axis (the other axes' minimum taken
    once per run, the axes pass's ``item``); element by element (its ``digits``) must give the same bits, for
    items cut mid-row, leaves with axes of extent 1 anywhere, NaN and zero statistics."""
    from numbaccum import factored
    from numbaccum.cpu import reduce as cpu_reduce

    shapes = [(7, 9), (3, 1, 5), (6, 1), (1, 8), (1,), (2, 3, 4, 5), (13,), (4, 0)]
    layout = nba.FlatTree.from_tree([np.zeros(s, np.float32) for s in shapes]).layout
    ax = factored._axes_of(layout)
    table = ax.passes[0]
    items = table.items(block)
    rng = np.random.default_rng(0)
    n, nmu = layout.group_sizes[0], ax.mu.size
    g = rng.standard_normal(n).astype(np.float32)
    g[::17] = 0.0
    mu = np.abs(rng.standard_normal(nmu)).astype(np.float32)
    mu[::11] = 0.0
    mu[5] = np.nan
    c = tuple(np.float32(v) for v in (0.1, 0.9, 1e-8, 0.1, 0.9, 0.0, 1.0))
    nu0 = rng.standard_normal(n).astype(np.float32)
    results = []
    walkers = cpu_reduce._pass_kernels(cpu_reduce._axes_kernels, factored._SM3_PASS)[2:]
    for fn in walkers:
        nu = nu0.copy()
        out, acc, new = np.empty(n, np.float32), np.empty(n, np.float32), mu.copy()
        for b in range(items.shape[0]):
            fn(out, g, nu, acc, table.meta, table.axes, items, mu, new, c, b)
        results.append((out, nu, acc, new))
    for a, b, what in zip(*results, ("out", "nu", "acc", "mu")):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=what)


# --- the statistics' sums: bands of columns, each column in k order -----------------------------


@pytest.mark.parametrize("shape", [(3000, 700), (64, 5000), (700, 3000), (40, 3, 2500), (5, 4100)])
def test_axis_sums_are_each_columns_sum_in_order_for_any_thread_count(shape):
    """`AxisSums` (Adafactor's row and column statistics) cuts a plane into bands of columns,
    whole rows where they fit and narrower ones to give every thread work: each column is
    summed from 0.0 in ``k`` order whatever the bands, so the bits are NumPy's sequential sum's
    for 1 and 2 threads."""
    import numba

    from numbaccum.cpu import reduce as cr
    from numbaccum.tables import AxisSums

    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    A, K, B = (1, *shape) if len(shape) == 2 else shape
    x3 = x.reshape(A, K, B).astype(np.float64)
    ref = np.zeros((A, B))
    for k in range(K):  # sequential in k for every column (np.sum would add pairwise)
        ref += x3[:, k, :] ** 2
    sums = AxisSums(np.array([[0, A, K, B, 0]]), A * B)
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            np.testing.assert_array_equal(cr.axis_sumsq(x.ravel(), sums), ref.ravel())
    finally:
        numba.set_num_threads(before)
