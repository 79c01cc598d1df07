"""Differential tests against optax itself, when it is installed (``pip install optax``).

CI does not install JAX; run these where it is (``pip install optax``). The float32 recipes of
reference/optax.md are checked bit for bit in test_optax_vectors.py; optax itself is matched within
DESIGN.md's rtol 1e-6: under ``jax.jit`` XLA contracts ``a * g + b * m`` into fused multiply-adds
(1 ulp per step, carried in the state), and eager JAX computes ``decay ** count`` with a pow that
differs from float32 repeated multiplication in the last bit for some counts (jitted JAX agrees
with the recipe's).
"""

import numpy as np
import pytest

import numbaccum as nba

optax = pytest.importorskip("optax")
jax = pytest.importorskip("jax")


def _grads(n_steps, shape, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n_steps)]


def _run_optax(tx, params, grads, jit=True):
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    out = []
    for g in grads:
        u, state = update(g, state, params)
        out.append(np.asarray(u))
    return out, state


def _run_ours(tx, params, grads):
    state = tx.init(params)
    out = []
    for g in grads:
        u, state = tx.update(g, state, params)
        out.append(np.array(u, copy=True))
    return out, state


def _assert_close(a, b):
    assert a.dtype == b.dtype
    # atol: 1e-6 of the update's scale, for elements where two terms nearly cancel
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(b))))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("decay", [0.9, 0.99, 0.999])
def test_ema_debias_float32(decay, jit):
    params = np.zeros(1000, np.float32)
    grads = _grads(40, params.shape, 0)
    theirs, _ = _run_optax(optax.ema(decay), params, grads, jit)
    ours, _ = _run_ours(nba.ema(decay), params, grads)
    for a, b in zip(ours, theirs):
        _assert_close(a, b)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_trace_float32(nesterov, jit):
    params = np.zeros(1000, np.float32)
    grads = _grads(20, params.shape, 1)
    theirs, _ = _run_optax(optax.trace(0.9, nesterov=nesterov), params, grads, jit)
    ours, _ = _run_ours(nba.trace(0.9, nesterov=nesterov), params, grads)
    for a, b in zip(ours, theirs):
        if jit:
            _assert_close(a, b)
        else:  # no division, no pow: eager optax is the recipe exactly
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("k", [1, 3])
def test_multisteps_adam_matches_optax(k):
    params = np.zeros(500, np.float32)
    grads = _grads(4 * k, params.shape, 2)
    theirs, _ = _run_optax(optax.MultiSteps(optax.adam(1e-2), k), params, grads)
    ours, _ = _run_ours(nba.MultiSteps(nba.adam(1e-2), k), params, grads)
    for a, b in zip(ours, theirs):
        # 1e-5 for a chain (reference/optax.md); atol for elements where mu nearly cancels
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))))
