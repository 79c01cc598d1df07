"""Where numbaccum's numbers and optax's part, and why (docs/migrating.md, "Numerics").

Each difference is pinned from both sides where optax is installed: a NumPy copy of optax's
formula with the one operation that XLA computes differently (its ``rsqrt``, its division by a
scalar, its fused multiply-adds, its flushed subnormals) gives optax's bits, and the same copy
with IEEE's correctly rounded operation gives numbaccum's. RMSProp with ``eps_in_sqrt=False``
(its scale computed in float64 for float32 leaves), the trust ratio of LARS and LAMB (computed in
float64) and Prodigy's update (its ``d eps`` term from the estimate before the step's growth),
which differed from optax's by how their formulas were computed, now give optax's numbers.

optax runs on JAX's CPU backend, float32 with ``jax_enable_x64`` off (with it on, optax computes
its Python-float scalars such as Prodigy's bias correction in float64), float64 with it on.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import reference as ref
from _testutil import require

import numbaccum as nba

F32, F64 = np.float32, np.float64


def same_bits(a, b) -> bool:
    """The same dtype, shape and bits (-0.0 is not +0.0; NaNs of any payload are equal)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(nan | ((a == b) & (np.signbit(a) == np.signbit(b)))))


def jax_x64(on: bool):
    """JAX with float64 on or off for the duration of a ``with`` block."""
    return require("jax").enable_x64(on)


def _optax_run(tx, params, grads) -> list:
    """optax's updates, eagerly (each operation as JAX computes it alone), as NumPy arrays."""
    jax = require("jax")
    state, out = tx.init(params), []
    for g in grads:
        u, state = tx.update(g, state, params)
        out.append(jax.tree.map(np.asarray, u))
    return out


def _ours_run(tx, params, grads) -> list:
    state, out = tx.init(params), []
    for g in grads:
        u, state = tx.update(g, state, params)
        out.append(nba.tree_map(np.copy, u))
    return out


def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# --- rsqrt: RMSProp, Adagrad, SM3 ----------------------------------------------------------------


def _xla_rsqrt(x: np.ndarray) -> np.ndarray:
    """``jax.lax.rsqrt`` of x: on the CPU, the processor's approximate reciprocal square root
    refined by Newton steps (not correctly rounded)."""
    jax = require("jax")
    return np.asarray(jax.lax.rsqrt(x))


def _ieee_rsqrt(x: np.ndarray) -> np.ndarray:
    """numbaccum's ``1 / sqrt(x)``: sqrt in x's dtype, the division in float64 (one rounding
    for float32, with the product it scales: see `_scaled`)."""
    return 1.0 / np.sqrt(x).astype(F64)


def _scaled(s: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``s * g`` rounded once to g's dtype."""
    return (s * g).astype(g.dtype)


def _differs_by_rsqrt_alone(make, copy, params, grads, dtype) -> tuple[list, list]:
    """``make(optax)``'s updates are ``copy`` (a NumPy copy of optax's formula) with XLA's rsqrt,
    ``make(nba)``'s the same copy with 1 / sqrt, bit for bit both at every step, and the two
    differ somewhere unless XLA's rsqrt rounds as 1 / sqrt on these values. Returns
    (numbaccum's, optax's) updates."""
    optax = require("optax")
    with jax_x64(dtype == F64):
        theirs = _optax_run(make(optax), params, grads)
        xla = copy(grads, _xla_rsqrt, dtype)
    ours = _ours_run(make(nba), params, grads)
    ieee = copy(grads, _ieee_rsqrt, dtype)
    for k in range(len(grads)):
        assert same_bits(xla[k], theirs[k]), f"step {k}: optax is not its formula with lax.rsqrt"
        assert same_bits(ieee[k], ours[k]), f"step {k}: numbaccum is not the formula with 1 / sqrt"
    # The difference is real where XLA's rsqrt rounds otherwise on these values. Some versions'
    # float64 rsqrt on the CPU is correctly rounded (jax 0.10.2's here): then the two formulas
    # agree, and so must the updates.
    rounds_alike = all(same_bits(a, b) for a, b in zip(xla, ieee))
    assert all(same_bits(a, b) for a, b in zip(ours, theirs)) == rounds_alike
    return ours, theirs


def _rmsprop_centered_momentum(grads, rsqrt, dt, lr=1e-2, decay=0.9, momentum=0.9, eps=1e-8):
    """optax's ``rmsprop(lr, decay, eps, centered=True, momentum=momentum)`` in NumPy, its
    ``jax.lax.rsqrt`` replaced by ``rsqrt``."""
    mu = nu = trace = np.zeros_like(grads[0])
    out = []
    for g in grads:
        mu = dt(1.0 - decay) * g + dt(decay) * mu
        nu = dt(1.0 - decay) * (g * g) + dt(decay) * nu
        u = dt(-lr) * _scaled(rsqrt(nu - mu * mu + dt(eps)), g)
        trace = u + dt(momentum) * trace
        out.append(trace)
    return out


@pytest.mark.parametrize("dtype", [F32, F64])
def test_rmsprop_centered_momentum_differs_from_optax_by_its_rsqrt_alone(dtype):
    """rmsprop(centered, momentum): optax's updates are its formula with XLA's rsqrt, numbaccum's
    the same formula with 1 / sqrt, bit for bit both, over 30 steps; the two differ by a few
    ulp per step, which the momentum carries on (tens of ulp of an element)."""
    rng = np.random.default_rng(0)
    params = _normal(rng, 300, dtype)
    grads = [_normal(rng, 300, dtype) for _ in range(30)]

    def make(lib):
        return lib.rmsprop(1e-2, centered=True, momentum=0.9)

    ours, theirs = _differs_by_rsqrt_alone(make, _rmsprop_centered_momentum, params, grads, dtype)
    for a, b in zip(ours, theirs):  # and small: within 64 ulp of the updates' scale
        assert np.max(np.abs(a - b)) <= 64 * np.finfo(dtype).eps * np.max(np.abs(b))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_rmsprop_with_eps_outside_the_root_is_optax_bit_for_bit(dtype):
    """Without ``eps_in_sqrt`` optax divides, ``1 / (sqrt(nu) + eps)``, and so does numbaccum, in
    the leaf's dtype: 30 steps of centred RMSProp with momentum give optax's bits. (Computed in
    float64, the scale of a float32 leaf was 1 or 2 ulp from optax's.)"""
    optax = require("optax")
    rng = np.random.default_rng(6)
    params = _normal(rng, 300, dtype)
    grads = [_normal(rng, 300, dtype) for _ in range(30)]
    kw = {"eps_in_sqrt": False, "centered": True, "momentum": 0.9}
    with jax_x64(dtype == F64):
        theirs = _optax_run(optax.rmsprop(1e-2, **kw), params, grads)
    ours = _ours_run(nba.rmsprop(1e-2, **kw), params, grads)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert same_bits(a, b), f"step {k}"


def _sm3(grads, rsqrt, dt, lr=0.1, b1=0.9, eps=1e-8):
    """optax's ``sm3(lr, b1)`` (b2 = 1) in NumPy for one (rows, cols) leaf, its
    ``jax.lax.rsqrt`` replaced by ``rsqrt``."""
    rows, cols = grads[0].shape
    mu_r, mu_c = np.zeros((rows, 1), dt), np.zeros((1, cols), dt)
    nu, out = np.zeros_like(grads[0]), []
    for g in grads:
        acc = dt(1.0) * (g * g) + dt(1.0) * np.minimum(mu_r, mu_c)
        with np.errstate(divide="ignore"):
            up = np.where(acc > 0, _scaled(rsqrt(acc + dt(eps)), g), dt(0.0))
        nu = dt(1.0 - b1) * up + dt(b1) * nu
        mu_r, mu_c = acc.max(axis=1, keepdims=True), acc.max(axis=0, keepdims=True)
        out.append(dt(-lr) * nu)
    return out


def test_sm3_float64_differs_from_optax_by_its_rsqrt_alone():
    """sm3 on a float64 matrix: optax's updates are its formula with XLA's rsqrt, numbaccum's
    the same formula with 1 / sqrt, bit for bit both, over 20 steps."""
    rng = np.random.default_rng(1)
    params = _normal(rng, (12, 9), F64)
    grads = [_normal(rng, (12, 9), F64) for _ in range(20)]
    _differs_by_rsqrt_alone(lambda lib: lib.sm3(0.1), _sm3, params, grads, F64)


def _adagrad(grads, rsqrt, dt, lr=0.1, initial=0.1, eps=1e-7):
    """optax's ``adagrad(lr)`` in NumPy, its ``jax.lax.rsqrt`` replaced by ``rsqrt``."""
    acc, out = np.full_like(grads[0], initial), []
    for g in grads:
        acc = g * g + acc
        with np.errstate(divide="ignore"):
            up = np.where(acc > 0, _scaled(rsqrt(acc + dt(eps)), g), dt(0.0))
        out.append(dt(-lr) * up)
    return out


@pytest.mark.parametrize("dtype", [F32, F64])
def test_adagrad_differs_from_optax_by_its_rsqrt_alone(dtype):
    """adagrad: optax's updates are its formula with XLA's rsqrt, numbaccum's the same formula
    with 1 / sqrt, bit for bit both, over 20 steps."""
    rng = np.random.default_rng(7)
    params = _normal(rng, 300, dtype)
    grads = [_normal(rng, 300, dtype) for _ in range(20)]
    _differs_by_rsqrt_alone(lambda lib: lib.adagrad(0.1), _adagrad, params, grads, dtype)


# --- novograd: XLA's reciprocal and fused multiply-adds ------------------------------------------


def _fma(a, b, c) -> np.ndarray:
    """``a * b + c`` rounded once (float64), element by element, from exact fractions."""
    abc = np.broadcast(a, b, c)
    exact = [Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)) for x, y, z in abc]
    return np.array([float(v) for v in exact]).reshape(abc.shape)


def _novograd_tiny(grads, params, xla: bool, fused: bool, lr=1e-2, b1=0.9, eps=1e-6, wd=0.1):
    """optax's ``novograd(lr, weight_decay=wd)`` in NumPy for gradients whose squared norm
    underflows to 0 (so the divisor is ``eps`` exactly): ``xla`` divides by multiplying by the
    reciprocal, ``fused`` rounds ``g r + wd p`` and ``b1 mu + a`` once (fused multiply-adds);
    neither is IEEE's order, which divides and rounds every operation."""
    divisor = np.sqrt(0.0) + eps
    mu, out = None, []
    for g in grads:
        if xla:
            r = 1.0 / divisor
            a = _fma(g, r, wd * params) if fused else g * r + wd * params
        else:
            a = g / divisor + wd * params
        if mu is None:
            mu = a
        else:
            mu = _fma(b1, mu, a) if fused else b1 * mu + a
        out.append(-lr * mu)
    return out


def test_novograd_float64_tiny_gradients_divide_where_xla_multiplies_by_the_reciprocal():
    """novograd on float64 gradients of 1e-170 (their squared norm underflows to 0 on both
    sides: the divisor is ``eps``): numbaccum divides (IEEE, every operation rounded), optax's
    XLA-compiled update (its ``lax.cond`` is compiled even outside ``jit``) multiplies by the
    reciprocal and contracts multiply-adds where the CPU has them."""
    optax = require("optax")
    rng = np.random.default_rng(2)
    params = _normal(rng, 64, F64, 1e-170)
    grads = [_normal(rng, 64, F64, 1e-170) for _ in range(8)]
    with jax_x64(True):
        theirs = _optax_run(optax.novograd(1e-2, weight_decay=0.1), params, grads)
    tx = nba.novograd(1e-2, weight_decay=0.1)
    state, ours = tx.init(params), []
    for g in grads:
        u, state = tx.update(g, state, params)
        ours.append(np.array(u, copy=True))
        assert float(nba.tree_flatten(state[0].nu)[0][0]) == 0.0  # the squared norm underflowed
    ieee = _novograd_tiny(grads, params, xla=False, fused=False)
    assert all(same_bits(a, b) for a, b in zip(ieee, ours)), "numbaccum is not IEEE's order"
    fused = _novograd_tiny(grads, params, xla=True, fused=True)
    plain = _novograd_tiny(grads, params, xla=True, fused=False)
    assert all(same_bits(a, b) for a, b in zip(fused, theirs)) or all(
        same_bits(a, b) for a, b in zip(plain, theirs)
    ), "optax is not its formula with XLA's reciprocal"
    assert not all(same_bits(a, b) for a, b in zip(ours, theirs))


# --- the trust ratio (LARS, LAMB): optax's rounding ----------------------------------------------


def _norms_round_alike(x: np.ndarray) -> bool:
    """Whether optax's float32 norm of ``x`` (XLA's sum) is the float64 norm rounded to float32,
    numbaccum's."""
    jnp = require("jax").numpy
    return F32(np.linalg.norm(x.astype(F64))) == F32(np.asarray(jnp.linalg.norm(x)))


def _draw_round_alike(rng, shapes: dict, params: dict | None = None, wd: float = 0.0) -> dict:
    """A float32 tree of ``shapes`` whose leaves have norms that optax's float32 sum and
    numbaccum's float64 one round alike; with ``params``, the norms of LARS's update ``x + wd p``
    (most draws do; the rest are drawn again)."""
    for _ in range(100):
        x = {k: _normal(rng, n, F32) for k, n in shapes.items()}
        u = x if params is None else {k: x[k] + F32(wd) * params[k] for k in shapes}
        if all(_norms_round_alike(v) for v in u.values()):
            return x
    raise AssertionError("no tree with norms that round alike in 100 draws")


def test_lars_float32_is_optax_bit_for_bit_where_the_norms_round_alike():
    """LARS's trust ratio ``trust ||p|| / ||u||`` is computed as optax rounds it, in float32 from
    the norms rounded to float32: wherever optax's float32 norms are the float64 ones rounded,
    twelve steps of LARS (momentum included) give optax's bits. (A float64 ratio differed from
    optax's by an ulp in a third of the leaves, and the momentum carried it on: 8 ulp.)"""
    optax = require("optax")
    rng = np.random.default_rng(3)
    shapes = {"w": 40, "b": 12, "s": 5}
    params = _draw_round_alike(rng, shapes)
    grads = [_draw_round_alike(rng, shapes, params, 0.01) for _ in range(12)]
    kw = {"weight_decay": 0.01, "trust_coefficient": 0.01}
    with jax_x64(False):
        theirs = _optax_run(optax.lars(0.5, **kw), params, grads)
    tx = nba.lars(0.5, **kw)
    state = tx.init(params)
    for k, g in enumerate(grads):
        u, state = tx.update(g, state, params)
        for name in params:
            assert same_bits(u[name], theirs[k][name]), f"step {k}, leaf {name}"


def test_trust_ratio_keeps_a_finite_ratio_where_float32_norms_overflow():
    """A float32 leaf whose norms pass float32's largest value: the ratio computed in float32
    would be inf / inf; numbaccum keeps the float64 ratio (rounded), a finite update."""
    p = {"w": np.full(4, 3e38, F32)}
    g = {"w": np.array([3e38, -3e38, 3e38, 1e38], F32)}
    tx = nba.scale_by_trust_ratio(trust_coefficient=0.5)
    u, _ = tx.update(g, tx.init(p), p)
    ratio = 0.5 * np.linalg.norm(p["w"].astype(F64)) / np.linalg.norm(g["w"].astype(F64))
    assert same_bits(u["w"], (g["w"] * F64(F32(ratio))).astype(F32))
    assert np.all(np.isfinite(u["w"]))


# --- Prodigy: the eps term takes the new estimate ------------------------------------------------


def _inf_at_step_0(dtype):
    """Params and a first gradient with an inf in one element of one leaf."""
    p = {"w": np.array([1.0, -2.0, 3.0, 0.5], dtype), "b": np.array([0.25], dtype)}
    g = {"w": np.array([0.1, np.inf, -0.3, 0.2], dtype), "b": np.array([0.5], dtype)}
    return p, g


@pytest.mark.parametrize("dtype", [F32, F64])
def test_prodigy_inf_gradient_at_step_0_makes_every_update_nan(dtype):
    """An inf in the first gradient: ``<g, p0 - p> = inf * 0`` is NaN, so is the new estimate
    ``d``, and every element's update through its ``d eps`` term: no finite update is made from
    a gradient with an inf (the other elements' updates were finite)."""
    p, g = _inf_at_step_0(dtype)
    tx = nba.prodigy()
    u, state = tx.update(g, tx.init(p), p)
    assert all(np.all(np.isnan(x)) for x in u.values()), u
    assert np.isnan(state.estim_lr)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_optax_prodigy_inf_gradient_at_step_0_is_nan_everywhere_too(dtype):
    optax = require("optax")
    p, g = _inf_at_step_0(dtype)
    with jax_x64(dtype == F64):
        tx = optax.contrib.prodigy()
        v, _ = tx.update(g, tx.init(p), p)
    assert all(np.all(np.isnan(np.asarray(x))) for x in v.values())


def test_prodigy_update_uses_the_grown_estimate_as_optax():
    """Prodigy's update divides by ``sqrt(eas) + d' eps`` with ``d'`` the estimate after this
    step's growth (optax's and the paper's order). With eps = 1e-2 that term shows: twelve
    float64 steps, the estimate growing, within 1e-12 of optax (the estimate before the growth
    gave updates 11% away)."""
    optax = require("optax")
    rng = np.random.default_rng(4)
    p0 = _normal(rng, 200, F64)
    ours_tx, theirs_tx = nba.prodigy(eps=1e-2), optax.contrib.prodigy(eps=1e-2)
    s = ours_tx.init(p0)
    with jax_x64(True):
        t = theirs_tx.init(p0)
        for k in range(12):
            p = p0 - 0.05 * (k + 1) * np.sign(p0)  # params that moved towards zero
            g = p + _normal(rng, 200, F64, 0.3)
            u, s = ours_tx.update(g, s, p)
            v, t = theirs_tx.update(g, t, p)
            v = np.asarray(v)
            np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12 * float(np.max(np.abs(v))))
            np.testing.assert_allclose(float(s.estim_lr), float(t.estim_lr), rtol=1e-12)
    assert float(s.estim_lr) > 10 * 1e-6  # the estimate grew: the steps took the new path


def test_prodigy_update_is_one_formula_whether_the_estimate_grows_or_stays():
    """The same update whichever path made it: a step whose estimate stays (the fused pass) and
    a step whose estimate grows (the update made again) both equal the formula from the new
    state's moments and estimate."""
    rng = np.random.default_rng(5)
    p0 = _normal(rng, 50, F64)
    tx = nba.prodigy(eps=1e-2, weight_decay=0.1)
    s = tx.init(p0)
    grew = stayed = 0
    for k in range(10):
        p = p0 - 0.05 * (k + 1) * np.sign(p0)
        g = p + _normal(rng, 50, F64, 0.3) if k < 5 else -(p0 - p)  # then away: d stays
        d, c = float(s.estim_lr), int(s.count) + 1
        u, s = tx.update(g, s, p)
        bc = (1 - 0.999**c) ** 0.5 / (1 - 0.9**c)
        dlr = d * 1.0 * bc
        ea, eas = s.exp_avg.leaves[0], s.exp_avg_sq.leaves[0]
        want = (-0.1 * dlr) * p - dlr * ea / (np.sqrt(eas) + float(s.estim_lr) * 1e-2)
        np.testing.assert_array_equal(u, want)
        grew += float(s.estim_lr) > d
        stayed += float(s.estim_lr) == d
    assert grew and stayed


# --- subnormals: IEEE's gradual underflow, where XLA flushes to zero -----------------------------


SUBNORMAL = [(F64, 1e-310), (F32, 1e-40)]


@pytest.mark.parametrize("dtype, tiny", SUBNORMAL)
def test_adam_keeps_ieee_gradual_underflow(dtype, tiny):
    """adam at a subnormal gradient: numbaccum computes it as IEEE arithmetic does (the
    reference's NumPy bits), a move of about ``lr * g / eps``, not a flushed zero."""
    p = {"w": np.zeros(3, dtype)}
    g = {"w": np.array([tiny, -tiny, 1.0], dtype)}
    tx, want = nba.adam(1e-3), ref.adam(1e-3)
    u, _ = tx.update(g, tx.init(p), p)
    w, _ = want.update(g, want.init(p), p)
    assert same_bits(u["w"], w["w"])
    assert u["w"][0] < 0 < u["w"][1] and abs(float(u["w"][0])) > 1e3 * tiny  # not flushed


@pytest.mark.parametrize("dtype, tiny", SUBNORMAL)
def test_optax_adam_flushes_a_subnormal_gradient_to_zero(dtype, tiny):
    """XLA on the CPU flushes the subnormal to zero: optax's update of those elements is -0.0."""
    optax = require("optax")
    p = {"w": np.zeros(3, dtype)}
    g = {"w": np.array([tiny, -tiny, 1.0], dtype)}
    with jax_x64(dtype == F64):
        v, _ = optax.adam(1e-3).update(g, optax.adam(1e-3).init(p), p)
    assert same_bits(np.asarray(v["w"])[:2], np.array([-0.0, -0.0], dtype))


# A step size optax casts to the leaf's dtype (``scale``, a learning rate): a subnormal of that
# dtype (which XLA then flushes), one below it (0), one above its largest value (inf), and normal
# ones (the last two were kept in float64 as a pair balanced by a power of two, not cast).
STEP_SIZES = {F32: [1e-38, -3e-42, 1e-46, 1e39, 2e-37, 1e-35], F64: [1e-310, -3e-320, 1e-330, 1e-305, 0.3]}
EDGES = [0.0, -0.0, 1.0, -1e6, 1e30, 3e38, 1e-3, np.inf, np.nan]


def _flushed(x):
    """XLA's flush to zero (FTZ/DAZ) of an array's subnormals."""
    x = np.asarray(x)
    return np.where(np.abs(x) < np.finfo(x.dtype).tiny, x.dtype.type(0), x)


def _step_size_transformations(lib, s):
    return {
        "scale": lib.scale(s),
        "scale_by_schedule": lib.scale_by_schedule(lambda count: s),
        "sgd": lib.sgd(-s),
        "trace_then_scale": lib.chain(lib.trace(0.5), lib.scale(s)),  # the factor read by a pass
    }


@pytest.mark.parametrize("dtype", [F32, F64])
def test_a_step_size_is_cast_to_the_leaf_dtype_as_optax_s_recipe(dtype):
    """Issue 47: ``u = dtype(step_size) * g``, as optax computes it, with IEEE's gradual underflow:
    a step size that is a subnormal of the leaf's dtype is kept (XLA flushes it: optax's updates
    are zeros, pinned below), one beyond the dtype's range is 0 or inf, as optax's."""
    with np.errstate(over="ignore", invalid="ignore"):
        g = {"w": np.array(EDGES, dtype)}
        for s in STEP_SIZES[dtype]:
            for name, tx in _step_size_transformations(nba, s).items():
                u, _ = tx.update(g, tx.init(g))
                x = g["w"] + dtype(0.5) * np.zeros_like(g["w"]) if name == "trace_then_scale" else g["w"]
                want = dtype(s) * x  # (the trace's first step: g + 0.5 * 0, where -0 becomes +0)
                assert same_bits(u["w"], want), (name, s, u["w"], want)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_optax_flushes_a_subnormal_step_size(dtype):
    """optax's updates are the recipe with XLA's flush of the cast step size and of the products:
    zeros where the step size is a subnormal of the leaf's dtype (docs/migrating.md)."""
    optax, jnp = require("optax"), require("jax.numpy")
    g = {"w": np.array(EDGES, dtype)}
    with np.errstate(over="ignore", invalid="ignore"), jax_x64(dtype == F64):
        j = {"w": jnp.asarray(g["w"])}  # (on NumPy leaves optax's scale would multiply in NumPy)
        for s in STEP_SIZES[dtype]:
            v, _ = optax.scale(s).update(j, optax.scale(s).init(j))
            want = _flushed(_flushed(np.asarray(s, dtype)) * g["w"])
            np.testing.assert_array_equal(np.asarray(v["w"]), want, err_msg=f"{s}")
