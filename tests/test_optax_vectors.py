"""optax's test vectors (shared/reference/optax.md sections 2 and 4) against numbaccum.

Where numbaccum deliberately differs from optax (API.md "Deliberate differences"):
non-emitting MultiSteps steps return exact +0.0, the accumulator is reset to exact
zeros on emission (a NaN does not stick), and the inner optimizer only runs on
emitting steps. The expected values below already include those differences.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from _testutil import (
    INT32_MAX,
    as_tree,
    assert_exact_positive_zeros,
    find_state,
    scalar_int,
    snapshot,
)

import numbaccum as nba

F32 = np.float32


def f32(x):
    return np.array(x, dtype=np.float32)


def w(x, dtype=np.float32):
    """A one-leaf dict tree, the shape most vectors use."""
    return {"w": np.array(x, dtype=dtype)}


# ---------------------------------------------------------------------------
# §2.1 trace
# ---------------------------------------------------------------------------

TRACE_STORED = [1.0, 2.9000000953674316, 5.610000133514404]


@pytest.mark.parametrize(
    "nesterov, expected",
    [
        (False, [1.0, 2.9000000953674316, 5.610000133514404]),
        (True, [1.899999976158142, 4.610000133514404, 8.048999786376953]),
    ],
)
def test_trace_table(nesterov, expected):
    tx = nba.trace(0.9, nesterov=nesterov)
    state = tx.init(w([0.0]))
    for g, exp, stored in zip([1.0, 2.0, 3.0], expected, TRACE_STORED):
        u, state = tx.update(w([g]), state)
        assert u["w"].dtype == np.float32
        np.testing.assert_allclose(u["w"], f32([exp]), rtol=1e-6, atol=0)
        np.testing.assert_allclose(as_tree(state.trace)["w"], f32([stored]), rtol=1e-6, atol=0)


def test_trace_decay_zero_is_identity():
    tx = nba.trace(0.0)
    g = w([1.5, -2.0, 0.25])
    state = tx.init(g)
    for _ in range(3):
        u, state = tx.update(g, state)
        np.testing.assert_array_equal(u["w"], g["w"])


# ---------------------------------------------------------------------------
# §2.2 ema
# ---------------------------------------------------------------------------


def test_ema_table_float32_bit_exact():
    tx = nba.ema(0.9, debias=True)
    state = tx.init(w(0.0))
    table = [
        (5.0, 4.999999046325684, 0.5, 1),
        (7.0, 6.052629470825195, 1.149999976158142, 2),
        (9.0, 7.140218734741211, 1.934999942779541, 3),
    ]
    for g, upd, stored, count in table:
        u, state = tx.update(w(g), state)
        assert u["w"].dtype == np.float32
        # Bit-exact: assert_array_equal on float32 values.
        np.testing.assert_array_equal(u["w"], F32(upd))
        assert F32(u["w"]) == F32(upd)
        np.testing.assert_array_equal(as_tree(state.ema)["w"], F32(stored))
        assert scalar_int(state.count) == count
    # 4.999999 (not 5.0): the float32 debias denominator is 0.100000024.
    assert F32(4.999999046325684) != F32(5.0)


def test_ema_no_debias_updates_equal_state():
    tx = nba.ema(0.9, debias=False)
    state = tx.init(w(0.0))
    for g, stored in zip([5.0, 7.0, 9.0], [0.5, 1.149999976158142, 1.934999942779541]):
        u, state = tx.update(w(g), state)
        np.testing.assert_array_equal(u["w"], F32(stored))
        np.testing.assert_array_equal(u["w"], as_tree(state.ema)["w"])


def test_ema_optax_test_ema():
    # optax _accumulation_test.test_ema
    d = 0.9
    tx = nba.ema(d, debias=False)
    state = tx.init(w([0.0, 0.0]))
    u, state = tx.update(w([5.0, 7.0]), state)
    np.testing.assert_allclose(u["w"], [(1 - d) * 5.0, (1 - d) * 7.0], atol=1e-4)
    u, state = tx.update(w([7.0, 5.0]), state)
    np.testing.assert_allclose(u["w"], [(1 - d) * (7.0 + d * 5.0), (1 - d) * (5.0 + d * 7.0)], atol=1e-2)


def test_ema_optax_test_ema_debias():
    # optax _accumulation_test.test_ema_debias
    d = 0.9
    tx = nba.ema(d, debias=True)
    state = tx.init(w([0.0, 0.0]))
    u, state = tx.update(w([5.0, 7.0]), state)
    np.testing.assert_allclose(u["w"], [5.0, 7.0], atol=1e-4)
    u, state = tx.update(w([7.0, 5.0]), state)
    expected = [
        ((1 - d) * 7.0 + d * (1 - d) * 5.0) / (1 - d**2),
        ((1 - d) * 5.0 + d * (1 - d) * 7.0) / (1 - d**2),
    ]
    np.testing.assert_allclose(u["w"], expected, atol=1e-2)
    # The stored ema is never debiased.
    np.testing.assert_allclose(
        as_tree(state.ema)["w"],
        [(1 - d) * 7.0 + d * (1 - d) * 5.0, (1 - d) * 5.0 + d * (1 - d) * 7.0],
        atol=1e-2,
    )


def test_ema_decay_zero_is_identity():
    tx = nba.ema(0.0, debias=True)
    g = w([1.5, -2.0, 3.25])
    state = tx.init(g)
    for _ in range(3):
        u, state = tx.update(g, state)
        np.testing.assert_array_equal(u["w"], g["w"])


def test_ema_decay_one_debias_is_nan():
    tx = nba.ema(1.0, debias=True)
    state = tx.init(w([0.0]))
    with np.errstate(all="ignore"):
        u, state = tx.update(w([1.0]), state)
    assert np.isnan(u["w"]).all()


def test_ema_count_saturates_at_int32_max():
    tx = nba.ema(0.9, debias=True)
    state = tx.init(w([0.0]))
    state = state._replace(count=np.int32(INT32_MAX))
    u, state = tx.update(w([1.0]), state)
    assert scalar_int(state.count) == INT32_MAX
    # bc = 1 - 0.9**(2**31 - 1) == 1, so the update is f32(0.1) * 1.
    np.testing.assert_array_equal(u["w"], f32([0.1]))
    u, state = tx.update(w([1.0]), state)
    assert scalar_int(state.count) == INT32_MAX


# ---------------------------------------------------------------------------
# §2.3 apply_every
# ---------------------------------------------------------------------------


def test_apply_every_table():
    tx = nba.apply_every(k=3)
    state = tx.init(w(0.0))
    ups = [0, 0, 6, 0, 0, 15, 0]
    accs = [1, 3, 6, 4, 9, 15, 7]
    counts = [1, 2, 0, 1, 2, 0, 1]
    for i in range(7):
        u, state = tx.update(w(float(i + 1)), state)
        np.testing.assert_array_equal(u["w"], F32(ups[i]))
        np.testing.assert_array_equal(as_tree(state.grad_acc)["w"], F32(accs[i]))
        assert scalar_int(state.count) == counts[i]


def test_apply_every_vs_sgd():
    # optax transform_test.test_apply_every
    k, lr, steps = 4, 1e-2, 50
    init_params = (f32([1.0, 2.0]), f32([3.0, 4.0]))
    per_step = (f32([500.0, 5.0]), f32([300.0, 3.0]))

    sgd = nba.sgd(lr, 0.0)
    p_sgd = init_params
    s_sgd = sgd.init(p_sgd)

    every = nba.chain(nba.apply_every(k=k), nba.trace(decay=0, nesterov=False), nba.scale(-lr))
    p_every = init_params
    s_every = every.init(p_every)

    for i in range(steps):
        u, s_sgd = sgd.update(per_step, s_sgd)
        p_sgd = nba.apply_updates(p_sgd, u)
        u2, s_every = every.update(per_step, s_every)
        if i % k == k - 1:
            p_every = nba.apply_updates(p_every, u2)
            for a, b in zip(p_every, p_sgd):
                np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
        else:
            for leaf in u2:
                np.testing.assert_array_equal(leaf, np.zeros(2, np.float32))
            p_every = nba.apply_updates(p_every, u2)


# ---------------------------------------------------------------------------
# §2.4 MultiSteps
# ---------------------------------------------------------------------------

MEAN_UPDATES = {3: [-0.2, 0.4], 6: [-0.5, 1.0]}
SUM_UPDATES = {3: [-0.6, 1.2], 6: [-1.5, 3.0]}
MEAN_ACC = [[1, -2], [1.5, -3], [0, 0], [4, -8], [4.5, -9], [0, 0], [7, -14]]
SUM_ACC = [[1, -2], [3, -6], [0, 0], [4, -8], [9, -18], [0, 0], [7, -14]]
MINI = [1, 2, 0, 1, 2, 0, 1]
GSTEP = [0, 0, 1, 1, 1, 2, 2]
HAS_UPDATED = [False, False, True, False, False, True, False]


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_multi_steps_table(use_grad_mean):
    ms = nba.MultiSteps(nba.sgd(0.1), 3, use_grad_mean=use_grad_mean)
    params = w([0.0, 0.0])
    state = ms.init(params)
    assert not bool(ms.has_updated(state))
    assert scalar_int(state.mini_step) == 0
    assert scalar_int(state.gradient_step) == 0
    emitted = MEAN_UPDATES if use_grad_mean else SUM_UPDATES
    accs = MEAN_ACC if use_grad_mean else SUM_ACC
    for i in range(1, 8):
        u, state = ms.update(w([i, -2 * i]), state, params)
        assert u["w"].dtype == np.float32
        if i in emitted:
            np.testing.assert_allclose(u["w"], f32(emitted[i]), rtol=1e-6, atol=0)
        else:
            assert_exact_positive_zeros(u, f"step {i}")
        acc = as_tree(state.acc_grads)["w"]
        np.testing.assert_array_equal(acc, f32(accs[i - 1]))
        if i in emitted:
            # numbaccum resets the accumulator to exact (+0.0) zeros on emission.
            assert_exact_positive_zeros(state.acc_grads, f"acc after step {i}")
        assert scalar_int(state.mini_step) == MINI[i - 1]
        assert scalar_int(state.gradient_step) == GSTEP[i - 1]
        assert bool(ms.has_updated(state)) is HAS_UPDATED[i - 1]


def test_multi_steps_accumulator_dtype_defaults():
    ms = nba.MultiSteps(nba.sgd(0.1), 2)
    state = ms.init({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float64)})
    acc = as_tree(state.acc_grads)
    assert acc["a"].dtype == np.float32
    assert acc["b"].dtype == np.float64
    ms64 = nba.MultiSteps(nba.sgd(0.1), 2, accumulator_dtype=np.float64)
    state = ms64.init({"a": np.zeros(3, np.float32)})
    assert as_tree(state.acc_grads)["a"].dtype == np.float64


def test_multi_steps_float64_precision():
    # optax.md §2.4 "x64": g = 1 + 1e-12 twice, MultiSteps(sgd(1), 2).
    g = w([1.0 + 1e-12], np.float64)
    ms = nba.MultiSteps(nba.sgd(1.0), 2)
    state = ms.init(g)
    _, state = ms.update(g, state)
    u, state = ms.update(g, state)
    np.testing.assert_allclose(u["w"], [-1.000000000001], rtol=1e-15)


def test_multi_steps_inner_adam():
    ms = nba.MultiSteps(nba.adam(0.1), 3)
    params = w([0.0, 0.0])
    state = ms.init(params)
    expected = {
        3: ([-0.099999338388443, -0.099999338388443], [0.2, 0.1], 1),
        6: ([-0.09396980702877045, -0.09999899566173553], [0.68, 0.19], 2),
    }
    for i in range(1, 8):
        u, state = ms.update(w([i, 1.0]), state, params)
        adam_state = find_state(state.inner_opt_state, nba.ScaleByAdamState)
        assert adam_state is not None, "no ScaleByAdamState inside inner_opt_state"
        if i in expected:
            upd, mu, count = expected[i]
            np.testing.assert_allclose(u["w"], f32(upd), rtol=1e-6, atol=0)
            np.testing.assert_allclose(as_tree(adam_state.mu)["w"], f32(mu), rtol=1e-6)
            assert scalar_int(adam_state.count) == count
        else:
            assert_exact_positive_zeros(u, f"step {i}")
    # The inner state advances only on emission: 2 emissions in 7 steps.
    assert scalar_int(find_state(state.inner_opt_state, nba.ScaleByAdamState).count) == 2


def _where_schedule(gs):
    # optax: k = where(gs < 2, 1, 3)
    return 1 if gs < 2 else 3


def test_multi_steps_callable_schedule():
    ms = nba.MultiSteps(nba.sgd(1.0), _where_schedule)
    state = ms.init(w([0.0]))
    expected = [-1, -2, 0, 0, -4, 0, 0, -7]
    for i, e in enumerate(expected, start=1):
        u, state = ms.update(w([float(i)]), state)
        np.testing.assert_allclose(u["w"], f32([e]), rtol=1e-6, atol=0)
        if e == 0:
            assert_exact_positive_zeros(u, f"step {i}")


def test_multi_steps_every_k_schedule_has_updated():
    # optax _accumulation_test.test_multi_steps_every_k_schedule
    ms = nba.MultiSteps(nba.sgd(1e-4), _where_schedule)
    params = w(np.zeros(3))
    state = ms.init(params)
    assert not bool(ms.has_updated(state))
    observed = []
    for _ in range(2 + 3 * 5):
        _, state = ms.update(w(np.zeros(3)), state, params)
        observed.append(bool(ms.has_updated(state)))
    assert observed == [True, True] + [False, False, True] * 5


@pytest.mark.parametrize("k", [np.int32(2), np.int64(2)])
def test_multi_steps_numpy_int_schedule(k):
    # API.md: every_k_schedule is an int (numpy ints too).
    ms = nba.MultiSteps(nba.sgd(1.0), k)
    state = ms.init(w([0.0]))
    u, state = ms.update(w([1.0]), state)
    assert_exact_positive_zeros(u)
    u, state = ms.update(w([3.0]), state)
    np.testing.assert_array_equal(u["w"], f32([-2.0]))


def test_multi_steps_skip_not_finite_table():
    ms = nba.MultiSteps(nba.sgd(1.0), 2, should_skip_update_fn=nba.skip_not_finite)
    params = w([0.0])
    state = ms.init(params)
    assert not bool(state.skip_state["should_skip"])
    assert int(state.skip_state["num_not_finite"]) == 0
    rows = [
        # g, update, mini, gstep, acc, skipped
        (1.0, 0.0, 1, 0, 1.0, False),
        (np.nan, 0.0, 1, 0, 1.0, True),
        (3.0, -2.0, 0, 1, 0.0, False),
        (np.inf, 0.0, 0, 1, 0.0, True),
        (5.0, 0.0, 1, 1, 5.0, False),
    ]
    for g, upd, mini, gstep, acc, skipped in rows:
        u, state = ms.update(w([g]), state, params)
        np.testing.assert_array_equal(u["w"], f32([upd]))
        if upd == 0.0:
            assert_exact_positive_zeros(u, f"g={g}")
        assert scalar_int(state.mini_step) == mini
        assert scalar_int(state.gradient_step) == gstep
        np.testing.assert_array_equal(as_tree(state.acc_grads)["w"], f32([acc]))
        assert bool(state.skip_state["should_skip"]) is skipped
        assert int(state.skip_state["num_not_finite"]) == (1 if skipped else 0)


def test_multi_steps_skip_not_finite_optax():
    # optax _accumulation_test.test_multi_steps_skip_not_finite
    ms = nba.MultiSteps(nba.sgd(1.0), 2, should_skip_update_fn=nba.skip_not_finite)
    params = w(np.zeros([]))
    state = ms.init(params)

    def step(g):
        nonlocal params, state
        u, state = ms.update(w(np.array(g, np.float32)), state, params)
        params = nba.apply_updates(params, u)

    step(1.0)
    assert scalar_int(state.mini_step) == 1
    step(1.0)
    assert scalar_int(state.mini_step) == 0
    np.testing.assert_array_equal(params["w"], F32(-1.0))
    step(np.inf)
    assert scalar_int(state.mini_step) == 0
    np.testing.assert_array_equal(params["w"], F32(-1.0))
    step(np.nan)
    assert scalar_int(state.mini_step) == 0
    np.testing.assert_array_equal(params["w"], F32(-1.0))
    step(1.0)
    step(1.0)
    np.testing.assert_array_equal(params["w"], F32(-2.0))


def test_multi_steps_has_updated_after_skip_following_emission():
    # optax: has_updated is a function of the state only; it stays True after
    # a skipped step that directly follows an emission.
    ms = nba.MultiSteps(nba.sgd(1.0), 2, should_skip_update_fn=nba.skip_not_finite)
    state = ms.init(w([0.0]))
    _, state = ms.update(w([1.0]), state)
    _, state = ms.update(w([1.0]), state)
    assert bool(ms.has_updated(state))
    u, state = ms.update(w([np.inf]), state)
    assert_exact_positive_zeros(u)
    assert bool(ms.has_updated(state))


def test_multi_steps_skip_large_updates():
    skip_fn = functools.partial(nba.skip_large_updates, max_squared_norm=100.0)
    ms = nba.MultiSteps(nba.sgd(1.0), 2, should_skip_update_fn=skip_fn)
    state = ms.init(w([0.0]))
    assert not bool(state.skip_state["should_skip"])
    assert float(state.skip_state["norm_squared"]) == 0.0
    u, state = ms.update(w([20.0]), state)  # 400 >= 100: skipped
    assert_exact_positive_zeros(u)
    assert scalar_int(state.mini_step) == 0
    assert bool(state.skip_state["should_skip"])
    assert float(state.skip_state["norm_squared"]) == 400.0
    _, state = ms.update(w([1.0]), state)
    u, state = ms.update(w([3.0]), state)
    np.testing.assert_array_equal(u["w"], f32([-2.0]))
    assert float(state.skip_state["norm_squared"]) == 9.0


def test_multi_steps_no_skip_fn_nan_does_not_stick():
    # optax.md §2.4 "No skip fn", k=3, g2 = [NaN, 1]. optax gives
    # [0,0] [NaN,0] [NaN,-1.6667] [NaN,0] [NaN,0] [NaN,-5] [NaN,0] (NaN sticks);
    # numbaccum returns exact zeros on non-emitting steps and resets the
    # accumulator on emission, so only the emitting step 3 sees the NaN.
    ms = nba.MultiSteps(nba.sgd(1.0), 3)
    state = ms.init(w([0.0, 0.0]))
    grads = [[1, 1], [np.nan, 1], [3, 3], [4, 4], [5, 5], [6, 6], [7, 7]]
    for i, g in enumerate(grads, start=1):
        with np.errstate(invalid="ignore"):
            u, state = ms.update(w(g), state)
        uw = np.asarray(u["w"])
        if i == 3:
            assert np.isnan(uw[0])
            np.testing.assert_allclose(uw[1], F32(-5.0 / 3.0), rtol=1e-6)
            assert_exact_positive_zeros(state.acc_grads, "acc after emission")
        elif i == 6:
            np.testing.assert_allclose(uw, f32([-5.0, -5.0]), rtol=1e-6, atol=0)
        else:
            assert_exact_positive_zeros(u, f"step {i}")
        if i >= 4:
            assert not np.isnan(np.asarray(as_tree(state.acc_grads)["w"])).any()


def test_multi_steps_computes_mean():
    # optax _accumulation_test.test_multi_steps_computes_mean
    ms = nba.MultiSteps(nba.scale(1.0), 4, use_grad_mean=True)
    params = w(0.0)
    state = ms.init(params)
    for i, g in enumerate([1.0, 2.0, 3.0, 4.0]):
        u, state = ms.update(w(g), state, params)
        if i < 3:
            assert not bool(ms.has_updated(state))
            assert_exact_positive_zeros(u)
        else:
            assert bool(ms.has_updated(state))
            assert F32(u["w"]) == F32(2.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: nba.sgd(0.1),
        lambda: nba.sgd(0.1, momentum=0.9),
        lambda: nba.sgd(0.1, momentum=0.9, nesterov=True),
        lambda: nba.adam(0.1),
        lambda: nba.chain(nba.scale_by_adam(), nba.add_decayed_weights(1e-2), nba.scale(-1e-4)),
    ],
    ids=["sgd", "momentum", "nesterov", "adam", "adamw_chain"],
)
def test_gradient_accumulation_first_update_is_zero(make_opt, dtype):
    # optax alias_test.test_gradient_accumulation
    params = {"a": np.array([1.0, -2.0], dtype), "b": np.array(3.0, dtype)}
    ms = nba.MultiSteps(make_opt(), 4)
    state = ms.init(params)
    u, state = ms.update({"a": np.array([2.0, 2.0], dtype), "b": np.array(-1.0, dtype)}, state, params)
    assert_exact_positive_zeros(u)
    assert u["a"].dtype == dtype and np.asarray(u["b"]).dtype == dtype


def test_multi_steps_dense_model():
    # optax _accumulation_test.test_multi_steps with a NumPy Dense(10) layer:
    # loss = sum((x @ w + b)**2) on ones[32, 7]; inner
    # chain(scale_by_adam, add_decayed_weights(1e-2), scale(-1e-4)); k=4.
    rng = np.random.default_rng(0)
    x = np.ones((32, 7), np.float32)
    params = {
        "dense": {
            "kernel": (rng.standard_normal((7, 10)) / np.sqrt(7)).astype(np.float32),
            "bias": np.zeros(10, np.float32),
        }
    }

    def loss_and_grad(p):
        out = x @ p["dense"]["kernel"] + p["dense"]["bias"]
        dout = (2 * out).astype(np.float32)
        grads = {"dense": {"kernel": x.T @ dout, "bias": dout.sum(0)}}
        return float(np.sum(out.astype(np.float64) ** 2)), grads

    k = 4
    ms = nba.MultiSteps(nba.chain(nba.scale_by_adam(), nba.add_decayed_weights(1e-2), nba.scale(-1e-4)), k)
    state = ms.init(params)
    prev_loss, _ = loss_and_grad(params)
    for idx in range(5 * k):
        loss, grads = loss_and_grad(params)
        updates, state = ms.update(grads, state, params)
        new_params = nba.apply_updates(params, updates)
        if idx % k < k - 1:
            assert not bool(ms.has_updated(state))
            for a, b in zip(
                [new_params["dense"]["kernel"], new_params["dense"]["bias"]],
                [params["dense"]["kernel"], params["dense"]["bias"]],
            ):
                np.testing.assert_array_equal(a, b)
            assert loss == prev_loss
        else:
            assert bool(ms.has_updated(state))
            new_loss, _ = loss_and_grad(new_params)
            assert new_loss < loss
            prev_loss = new_loss
        params = new_params


def _scale_by_loss():
    """An inner transformation that needs the ``loss=`` extra argument."""

    def init(params):
        return nba.EmptyState()

    def update(updates, state, params=None, *, loss):
        tree = as_tree(updates)
        return nba.tree_map(lambda g: np.asarray(g) * np.asarray(loss, np.asarray(g).dtype), tree), state

    return nba.GradientTransformationExtraArgs(init, update)


def test_multi_steps_forwards_extra_args():
    ms = nba.MultiSteps(_scale_by_loss(), 2)
    state = ms.init(w([0.0]))
    u, state = ms.update(w([1.0]), state, None, loss=3.0)
    np.testing.assert_array_equal(np.asarray(as_tree(u)["w"]), f32([0.0]))
    u, state = ms.update(w([1.0]), state, None, loss=3.0)
    np.testing.assert_array_equal(np.asarray(as_tree(u)["w"]), f32([3.0]))


def test_multi_steps_gradient_transformation():
    ms = nba.MultiSteps(nba.sgd(1.0), 2)
    tx = ms.gradient_transformation()
    assert isinstance(tx, nba.GradientTransformation)
    init, update = tx
    state = init(w([0.0]))
    assert isinstance(state, nba.MultiStepsState)
    _, state = update(w([1.0]), state)
    u, state = update(w([3.0]), state)
    np.testing.assert_array_equal(u["w"], f32([-2.0]))
    assert ms.inner_opt is not None


# ---------------------------------------------------------------------------
# §2.5 skip predicates
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, skip, num",
    [(np.inf, True, 1), (-np.inf, True, 1), (np.nan, True, 1), (11.0, False, 0)],
)
def test_skip_not_finite(x, skip, num):
    updates = [np.array(x, np.float32), np.zeros([], np.float32)]
    should_skip, info = nba.skip_not_finite(updates, np.int32(0), None)
    assert bool(should_skip) is skip
    assert bool(info["should_skip"]) is skip
    assert int(info["num_not_finite"]) == num


@pytest.mark.parametrize(
    "x, skip, norm_sq",
    [
        (np.inf, True, np.inf),
        (np.nan, True, np.nan),
        (11.0, True, 121.0),
        (10.0, True, 100.0),  # equality is skipped (strict <)
        (9.0, False, 81.0),
        (0.0, False, 0.0),
    ],
)
def test_skip_large_updates(x, skip, norm_sq):
    updates = [np.array(x, np.float32), np.zeros([], np.float32)]
    should_skip, info = nba.skip_large_updates(updates, np.int32(0), None, max_squared_norm=100.0)
    assert bool(should_skip) is skip
    assert bool(info["should_skip"]) is skip
    got = float(info["norm_squared"])
    if math.isnan(norm_sq):
        assert math.isnan(got)
    else:
        assert got == norm_sq


# ---------------------------------------------------------------------------
# §1 / §4 combining
# ---------------------------------------------------------------------------


def test_chain_matches_manual():
    # optax _combining_test.test_chain
    lr, steps = 1e-2, 50
    init_params = (f32([1.0, 2.0]), f32([3.0, 4.0]))
    per_step = (f32([500.0, 5.0]), f32([300.0, 3.0]))

    chained = nba.chain(nba.scale_by_adam(), nba.trace(decay=0, nesterov=False), nba.scale(-lr))
    p_chain = init_params
    s_chain = chained.init(p_chain)

    parts = [nba.scale_by_adam(), nba.trace(decay=0, nesterov=False), nba.scale(-lr)]
    p_manual = init_params
    s_parts = [t.init(p_manual) for t in parts]

    for _ in range(steps):
        u, s_chain = chained.update(per_step, s_chain)
        p_chain = nba.apply_updates(p_chain, u)
        u = per_step
        for j, t in enumerate(parts):
            u, s_parts[j] = t.update(u, s_parts[j])
        p_manual = nba.apply_updates(p_manual, u)
    for a, b in zip(p_chain, p_manual):
        np.testing.assert_allclose(a, b, rtol=1e-4)


def test_chain_protocol():
    plain = nba.GradientTransformation(lambda p: nba.EmptyState(), lambda u, s, p=None: (u, s))
    chained = nba.chain(plain, nba.scale(2.0))
    assert isinstance(chained, nba.GradientTransformationExtraArgs)
    params = w([1.0])
    state = chained.init(params)
    assert isinstance(state, tuple) and len(state) == 2
    u, state = chained.update(w([1.5]), state, params, some_extra=1)
    np.testing.assert_array_equal(u["w"], f32([3.0]))
    with pytest.raises(ValueError):
        chained.update(w([1.5]), state[:1], params)


def test_with_extra_args_support():
    plain = nba.GradientTransformation(lambda p: nba.EmptyState(), lambda u, s, p=None: (u, s))
    wrapped = nba.with_extra_args_support(plain)
    assert isinstance(wrapped, nba.GradientTransformationExtraArgs)
    assert nba.with_extra_args_support(wrapped) is wrapped
    u, _ = wrapped.update(w([1.0]), wrapped.init(w([1.0])), None, loss=3.0)
    np.testing.assert_array_equal(as_tree(u)["w"], f32([1.0]))


def test_named_chain():
    tx = nba.named_chain(("decay", nba.trace(0.5)), ("lr", nba.scale(-1.0)))
    params = w([0.0])
    state = tx.init(params)
    assert isinstance(state, dict) and set(state) == {"decay", "lr"}
    u, state = tx.update(w([2.0]), state, params)
    np.testing.assert_array_equal(u["w"], f32([-2.0]))
    u, state = tx.update(w([2.0]), state, params)
    np.testing.assert_array_equal(u["w"], f32([-3.0]))
    np.testing.assert_array_equal(as_tree(state["decay"].trace)["w"], f32([3.0]))


def test_sgd_momentum_vector():
    # sgd = trace(momentum) then scale_by_learning_rate: -lr * trace.
    tx = nba.sgd(0.1, momentum=0.9)
    state = tx.init(w([0.0]))
    outs = []
    for g in [1.0, 2.0, 3.0]:
        u, state = tx.update(w([g]), state)
        outs.append(snapshot(u)["w"][0])
    np.testing.assert_allclose(outs, [-0.1, -0.29, -0.561], rtol=1e-6)


def test_scale_by_learning_rate_callable():
    tx = nba.scale_by_learning_rate(lambda count: 0.5 * (int(count) + 1))
    state = tx.init(w([0.0]))
    outs = []
    for _ in range(3):
        u, state = tx.update(w([2.0]), state)
        outs.append(float(np.asarray(u["w"])[0]))
    assert outs == [-1.0, -2.0, -3.0]


def test_apply_updates_keeps_param_dtype():
    params = {"a": f32([1.0, 2.0]), "b": np.array([1.0], np.float64)}
    updates = {"a": np.array([0.5, 0.5], np.float64), "b": np.array([0.25], np.float64)}
    new = nba.apply_updates(params, updates)
    assert new["a"].dtype == np.float32 and new["b"].dtype == np.float64
    np.testing.assert_array_equal(new["a"], f32([1.5, 2.5]))
    np.testing.assert_array_equal(new["b"], [1.25])
    # inputs untouched
    np.testing.assert_array_equal(params["a"], f32([1.0, 2.0]))
