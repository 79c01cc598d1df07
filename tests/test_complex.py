"""Complex leaves (complex64, complex128) with optax's semantics.

optax 0.2.8 takes complex parameters in most of its transformations: first moments stay complex,
second moments and norms use ``|z|^2`` (its ``numerics.abs_sq``; the moment is stored in the
leaf's complex dtype with a zero imaginary part), ``sign`` is ``z / |z|``, and the scalars
(learning rates, decays, bias corrections) are real. Each test here compares with optax itself
(eager, where complex division is the IEEE one: jitted XLA contracts multiply-adds), or checks
what numbaccum decides on purpose (README "Differences from optax"): a real accumulator or
``mu_dtype`` for complex leaves is refused (optax drops the imaginary parts without a word),
MultiSteps accumulates complex leaves in their own dtype, complex updates are not added to real
params, and the transformations optax does not define on complex leaves (``clip``, and
numbaccum's own clippers) refuse them by name.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _testutil import require, state_arrays
from registry import CASES, DRIVERS, cases, sampled, sweep

import numbaccum as nba

C64, C128 = np.dtype(np.complex64), np.dtype(np.complex128)


def _complex(rng, shape, dtype) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def tree(seed: int, dtype=C64) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": _complex(rng, (7, 5), dtype), "b": _complex(rng, (5,), dtype), "s": _complex(rng, (), dtype)}


# Built from the module given: numbaccum's and optax's constructions read the same.
SAME = {
    "identity": lambda L: L.identity(),
    "scale": lambda L: L.scale(0.5),
    "add_decayed_weights": lambda L: L.add_decayed_weights(0.1),
    "trace": lambda L: L.trace(0.9),
    "trace_nesterov": lambda L: L.trace(0.9, nesterov=True),
    "ema": lambda L: L.ema(0.9),
    "sgd": lambda L: L.sgd(0.1, momentum=0.9),
    "sign_sgd": lambda L: L.sign_sgd(0.1),
    "apply_every": lambda L: L.apply_every(3),
    "zero_nans": lambda L: L.zero_nans(),
    "adam": lambda L: L.adam(0.1),
    "adamw": lambda L: L.adamw(0.1, weight_decay=0.1),
    "nadam": lambda L: L.nadam(0.1),
    "nadamw": lambda L: L.nadamw(0.1),
    "amsgrad": lambda L: L.amsgrad(0.1),
    "adamax": lambda L: L.adamax(0.1),
    "yogi": lambda L: L.yogi(0.1),
    "adabelief": lambda L: L.adabelief(0.1),
    "adabelief_nesterov": lambda L: L.adabelief(0.1, nesterov=True),
    "lion": lambda L: L.lion(0.1),
    "lion_smooth": lambda L: L.chain(L.scale_by_lion(mode="smooth", smooth_beta=2.0), L.scale(-1e-2)),
    "rmsprop": lambda L: L.rmsprop(0.1),
    "rmsprop_centered": lambda L: L.rmsprop(0.1, centered=True, momentum=0.9),
    "scale_by_rms_bc": lambda L: L.scale_by_rms(bias_correction=True, eps_in_sqrt=False),
    "adagrad": lambda L: L.adagrad(0.1),
    "clip_by_global_norm": lambda L: L.clip_by_global_norm(1.0),
    "clip_by_block_rms": lambda L: L.clip_by_block_rms(0.5),
    "normalize_by_update_norm": lambda L: L.normalize_by_update_norm(),
    "centralize": lambda L: L.centralize(),
    "adaptive_grad_clip": lambda L: L.adaptive_grad_clip(0.1),
    "clip_then_adamw": lambda L: L.chain(L.clip_by_global_norm(1.0), L.adamw(0.1, weight_decay=0.1)),
    "multisteps": lambda L: L.MultiSteps(L.adam(0.1), 2, accumulator_dtype=np.complex64),
    "apply_if_finite": lambda L: L.apply_if_finite(L.adam(0.1), 3),
    "inject_hyperparams": lambda L: L.inject_hyperparams(L.adam)(learning_rate=0.1),
    "masked": lambda L: L.masked(L.adam(0.1), {"w": True, "b": False, "s": True}),
    "novograd": lambda L: L.novograd(0.1, weight_decay=0.1),
    "scale_by_novograd": lambda L: L.scale_by_novograd(b2=0.6, eps_root=1e-3),
}
# lion's smooth mode: XLA's complex tanh is less accurate than NumPy's (8e-6 near its poles).
RTOL = {"lion_smooth": 2e-5}


def _close(ours, theirs, rtol, msg):
    for k in ours:
        a, b = np.asarray(ours[k]), np.asarray(theirs[k])
        assert a.dtype == b.dtype, f"{msg} {k}: {a.dtype} vs {b.dtype}"
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale, err_msg=f"{msg} {k}")


def _against_optax(name, dtype, steps=4):
    optax = require("optax")
    ours, theirs = SAME[name](nba), SAME[name](optax)
    params = tree(0, dtype)
    s, t = ours.init(params), theirs.init(params)
    rtol = RTOL.get(name, 2e-6 if dtype == C64 else 1e-12)
    for i in range(steps):
        g = tree(10 + i, dtype)
        u, s = ours.update(g, s, params)
        v, t = theirs.update(g, t, params)
        _close(u, v, rtol, f"{name} {dtype} step {i + 1}")
    return s, t


@pytest.mark.parametrize("name", sorted(SAME))
def test_complex64_matches_optax(name):
    _against_optax(name, C64)


@pytest.mark.parametrize(
    "name", ["adam", "sgd", "clip_then_adamw", "rmsprop_centered", "yogi", "lion", "novograd"]
)
def test_complex128_matches_optax(name):
    jax = require("jax")
    with jax.enable_x64(True):
        _against_optax(name, C128)


def test_second_moments_are_complex_with_zero_imaginary_parts_as_optax_keeps_them():
    state, theirs = _against_optax("adam", C64)
    nu, their_nu = state[0].nu, theirs[0].nu
    assert nu.group_dtypes == (C64,)
    for k, x in nu.tree.items():
        assert x.dtype == np.asarray(their_nu[k]).dtype == C64
        assert not np.any(x.imag) and np.all(x.real > 0)
    assert state[0].mu.group_dtypes == (C64,) and np.any(state[0].mu.groups[0].imag)


# --- fused, stage by stage and step_ ------------------------------------------------------------

CHAINS = {
    "clip_adamw": lambda: nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(0.1, weight_decay=0.1)),
    "sgd_nesterov": lambda: nba.sgd(0.1, 0.9, nesterov=True),
    "zero_nans_lion": lambda: nba.chain(nba.zero_nans(), nba.lion(0.1)),
    "rmsprop_centered": lambda: nba.rmsprop(0.1, centered=True, momentum=0.9),
    "normalize_yogi": lambda: nba.chain(nba.normalize_by_update_norm(), nba.yogi(0.1)),
    "every_moment": lambda: nba.chain(
        nba.adabelief(0.1),
        nba.amsgrad(0.1),
        nba.adamax(0.1),
        nba.adagrad(0.1),
        nba.scale_by_sign(),
        nba.ema(0.9),
    ),
}


def _params_after(name, dtype, mode):
    tx = CHAINS[name]()
    params = tree(1, dtype)
    state = tx.init(params)
    seen = []
    for i in range(4):
        g = tree(20 + i, dtype)
        if mode == "step_":
            state = nba.step_(tx, g, state, params)
        else:
            u, state = tx.update(g, state, params)
            params = nba.apply_updates(params, u)
        seen.append({k: v.copy() for k, v in params.items()})
    return seen


# complex128 in the exhaustive step: the same chains, compiled for the other dtype
@pytest.mark.parametrize("dtype", [C64, pytest.param(C128, marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_fused_stage_by_stage_and_step_give_the_same_bits(name, dtype, monkeypatch):
    fused = _params_after(name, dtype, "update")
    stepped = _params_after(name, dtype, "step_")
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    staged = _params_after(name, dtype, "update")
    for k, (f, s, t) in enumerate(zip(fused, staged, stepped)):
        for leaf in f:
            bits = np.ravel(f[leaf]).view(np.uint8)
            assert np.array_equal(bits, np.ravel(s[leaf]).view(np.uint8)), (
                f"{name} step {k + 1} {leaf}: staged"
            )
            assert np.array_equal(bits, np.ravel(t[leaf]).view(np.uint8)), (
                f"{name} step {k + 1} {leaf}: step_"
            )


@pytest.mark.parametrize("state_dtype", [None, C64])
@pytest.mark.parametrize("base", ["sgd", "adam"])
def test_schedule_free_on_complex_params_matches_optax(base, state_dtype):
    """optax.contrib's test_explicit_dtype builds it with ``state_dtype=jnp.complex64`` on
    complex64 params: ``z`` complex64, the updates as optax's. optax keeps ``b1``, ``max_lr``
    and ``weight_sum`` in the params' dtype (complex64, a complex ``max_lr ** 2``); numbaccum's
    are real (float32), as every scalar of a complex leaf: within float32 rounding."""
    optax = require("optax")

    def make(L, contrib):
        inner = L.sgd(0.1) if base == "sgd" else L.adam(0.05, b1=0.0)
        return contrib.schedule_free(inner, 0.1 if base == "sgd" else 0.05, b1=0.8, state_dtype=state_dtype)

    ours, theirs = make(nba, nba), make(optax, optax.contrib)
    p, po = tree(0), tree(0)
    s, t = ours.init(p), theirs.init(po)
    assert {k: x.dtype for k, x in s.z.tree.items()} == {k: np.asarray(x).dtype for k, x in t.z.items()}
    for i in range(4):
        g = tree(10 + i)
        s = nba.step_(ours, g, s, p)
        v, t = theirs.update(g, t, po)
        po = optax.apply_updates(po, v)
        _close(p, po, 2e-6, f"schedule_free {base} step {i + 1}")
        _close(nba.schedule_free_eval_params(s, p), optax.contrib.schedule_free_eval_params(t, po), 2e-6, "x")
    assert np.asarray(s.b1).dtype == np.asarray(s.max_lr).dtype == np.float32  # real scalars


def test_schedule_free_refuses_a_state_dtype_that_drops_or_adds_imaginary_parts():
    drop = "would drop the imaginary parts of the complex64"
    add = "would make complex the updates of the float32"
    with pytest.raises(TypeError, match=f"state_dtype: float32 {drop}"):
        nba.schedule_free(nba.sgd(0.1), 0.1, state_dtype=np.float32).init(tree(0))
    with pytest.raises(TypeError, match=f"state_dtype: complex64 {add}"):
        nba.schedule_free(nba.sgd(0.1), 0.1, state_dtype=np.complex64).init({"w": np.ones(3, np.float32)})


def test_explain_fuses_a_complex_chain_into_one_pass():
    text = str(nba.explain(CHAINS["clip_adamw"](), tree(0)))
    assert "2 passes" in text and "clip_by_global_norm + scale_by_adam" in text


# --- optax's alias test: every covered optimizer converges on complex targets ----------------
# optax 0.2.8 alias_test.test_optimization runs these (with their learning rates) on complex64
# params for 10,000 steps, on a parabola and on Rosenbrock's function, and checks the minimum
# within 3e-2. The gradients as optax's test takes them (the conjugates of JAX's): for the
# parabola sum(|p - t|^2), 2 (p - t); for Rosenbrock's |a - p0|^2 + b |p1 - p0^2|^2, with
# w = p1 - p0^2: (2 (p0 - a) - 4 b conj(p0) w, 2 b w).


def _parabola(p, g):
    target = np.array([1.0, -1.0, 1.0]) * (1 + 1j)
    np.multiply(p - target, 2, out=g, casting="same_kind")
    return np.array([-1.0, 10.0, 1.0]), target


def _rosenbrock(p, g, a=1 + 1j, b=100.0):
    w = p[1] - p[0] ** 2
    g[0] = 2 * (p[0] - a) - 4 * b * np.conj(p[0]) * w
    g[1] = 2 * b * w
    return np.zeros(2), np.array([a, a**2])


CONVERGING = {
    "adabelief": lambda: nba.adabelief(1e-2),
    "adagrad": lambda: nba.adagrad(1.0),
    "adam": lambda: nba.adam(1e-1),
    "adamax": lambda: nba.adamax(1e-1),
    "adamw": lambda: nba.adamw(1e-1),
    "amsgrad": lambda: nba.amsgrad(1e-1),
    "nadam": lambda: nba.nadam(1e-2),
    "nadamw": lambda: nba.nadamw(1e-2),
    "rmsprop": lambda: nba.rmsprop(5e-3),
    "rmsprop_momentum": lambda: nba.rmsprop(5e-3, momentum=0.9),
    "sgd": lambda: nba.sgd(1e-3, 0.9),
    "yogi": lambda: nba.yogi(1e-1),
}


@pytest.mark.parametrize("target", [_parabola, _rosenbrock])
@pytest.mark.parametrize("name", sorted(CONVERGING))
def test_optimizers_reach_the_minimum_of_complex_targets(name, target):
    start, final = target(np.zeros(3, np.complex64), np.zeros(3, np.complex64))
    # optax's test starts from the real initial params cast to complex64, as here.
    params = nba.FlatTree.from_tree({"p": start.astype(np.complex64)})
    tx = CONVERGING[name]()
    state = tx.init(params)
    grads = params.zeros_like()
    p, g = params.tree["p"], grads.tree["p"]
    for _ in range(10_000):
        target(p, g)
        state = nba.step_(tx, grads, state, params)
    np.testing.assert_allclose(p, final, rtol=3e-2, atol=3e-2)


# --- what every transformation does with complex leaves ------------------------------------
# Those optax defines on complex leaves take them; the others refuse them by name before
# anything runs (numba could not even compile a comparison of complex numbers).

TAKES_COMPLEX = {
    "MultiSteps", "adabelief", "adagrad", "adam", "adamax", "adamw", "adaptive_grad_clip",
    "add_decayed_weights", "amsgrad", "apply_every", "apply_if_finite", "centralize", "chain",
    "clip_by_block_rms", "clip_by_global_norm", "ema", "identity", "inject_hyperparams", "lion",
    "masked", "nadam", "nadamw", "named_chain", "normalize_by_update_norm", "rmsprop", "scale",
    "scale_by_adam", "scale_by_adamax", "scale_by_amsgrad", "scale_by_belief",
    "scale_by_learning_rate", "scale_by_lion", "scale_by_nadam", "scale_by_rms", "scale_by_rss",
    "scale_by_sign", "scale_by_stddev", "scale_by_yogi", "sgd", "sign_sgd", "trace", "yogi",
    "zero_nans", "set_to_zero", "scale_by_schedule", "partition", "multi_transform", "freeze",
    "selective_transform", "stateless", "stateless_with_tree_map", "adamaxw", "radam",
    "scale_by_radam", "lamb", "lars", "scale_by_trust_ratio", "signum", "fromage",
    "scale_by_optimistic_gradient", "optimistic_gradient_descent", "optimistic_adam",
    "optimistic_adam_v2", "conditionally_transform", "conditionally_mask", "add_noise", "noisy_sgd",
    "snapshot", "scale_by_lbfgs", "inject_stateful_hyperparams", "ademamix", "scale_by_ademamix",
    "scale_by_param_block_norm", "scale_by_param_block_rms", "novograd", "scale_by_novograd",
    "schedule_free", "schedule_free_sgd", "schedule_free_adamw", "acprop", "scale_by_acprop",
}  # fmt: skip
# Registry cases whose hyperparameters fix a real state dtype (refused: see below).
REAL_STATE = {"trace_nesterov_f64acc"}


# Every Case on complex64; complex128 (the same formulas, compiled for the other dtype) on the
# SAMPLE of each kind. The README's command runs the SAMPLE on complex64 and its DRIVERS on
# complex128, the exhaustive step the rest (each Case compiles its complex kernels).
EACH = [n for n in cases(per_example=False) if n not in REAL_STATE]
EACH_DTYPE = [(n, C64) for n in EACH] + [(n, C128) for n in sampled(EACH)]
EACH_RUN = sweep(EACH_DTYPE[: len(EACH)]) + sweep(EACH_DTYPE[len(EACH) :], keep=DRIVERS)


@pytest.mark.parametrize(("name", "dtype"), EACH_RUN, ids=[f"{n}-{np.dtype(d).name}" for n, d in EACH_DTYPE])
def test_each_transformation_takes_complex_leaves_or_refuses_them_by_name(name, dtype):
    """Taken: two steps keep the updates' and every state buffer's dtype (optax's
    test_state_shape_dtype_shard_stability); refused: nothing written."""
    case = CASES[name]
    params = tree(2, dtype)
    tx = case.make()
    state = tx.init(params)
    before = {p: a.copy() for p, a in state_arrays(state).items()}
    grads = tree(3, dtype)
    if case.public not in TAKES_COMPLEX:
        with pytest.raises(TypeError, match=rf"does not take complex leaves \(updates\['b'\] is {dtype}\)"):
            tx.update(grads, state, params)
        after = state_arrays(state)
        assert all(np.array_equal(before[p], a, equal_nan=True) for p, a in after.items())
        return
    for i in range(2):  # new gradients each step: the same twice has a centred variance of 0
        state = nba.step_(tx, tree(4 + i, dtype), state, params)
        assert {p: a.dtype for p, a in state_arrays(state).items()} == {p: a.dtype for p, a in before.items()}
    updates, state = tx.update(grads, state, params)
    for k, u in updates.items():
        assert u.dtype == params[k].dtype == dtype and np.all(np.isfinite(u)), f"{name} {k}"


def test_the_transformations_taking_complex_leaves_are_the_registrys():
    assert {CASES[n].public for n in cases(per_example=False)} >= TAKES_COMPLEX


def test_a_user_transformation_in_a_chain_gets_the_complex_leaves():
    seen = []

    def update(updates, state, params=None):
        seen.append({k: v.dtype for k, v in updates.items()})
        return {k: np.conj(v) for k, v in updates.items()}, state

    tx = nba.chain(nba.GradientTransformation(lambda p: nba.EmptyState(), update), nba.scale(2.0))
    g = tree(4)
    u, _ = tx.update(g, tx.init(g))
    assert seen == [{k: C64 for k in g}]
    for k in g:
        np.testing.assert_array_equal(u[k], 2 * np.conj(g[k]))


# --- deliberate differences from optax -------------------------------------------------------


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda dt: nba.adam(0.1, mu_dtype=dt), "mu_dtype"),
        (lambda dt: nba.ademamix(0.1, mu_dtype=dt), "mu_dtype"),  # its three moments (was named accumulator_dtype)
        (lambda dt: nba.sgd(0.1, momentum=0.9, accumulator_dtype=dt), "accumulator_dtype"),
        (lambda dt: nba.MultiSteps(nba.sgd(0.1), 2, accumulator_dtype=dt), "accumulator_dtype"),
    ],
)
def test_a_state_dtype_that_drops_or_adds_imaginary_parts_is_refused(make, field):
    """optax keeps a float32 ``mu`` or accumulator of complex64 params (and so loses their
    imaginary parts), and a complex one of real params (complex updates): both refused here."""
    with pytest.raises(TypeError, match=rf"{field}: float32 would drop the imaginary parts of the complex64"):
        make(np.float32).init(tree(0))
    with pytest.raises(TypeError, match=rf"{field}: complex64 would make complex the updates of the float32"):
        make(np.complex64).init({"w": np.ones(3, np.float32)})
    state = make(np.complex128).init(tree(0))  # another complex dtype: as float64 for float32
    assert C128 in {a.dtype for a in state_arrays(state).values()}


def test_multisteps_accumulates_complex_leaves_in_their_own_dtype():
    """optax's default float32 accumulator keeps only the last gradient's imaginary part
    (``-1 - 0.5j`` here); numbaccum averages the complex gradients."""
    tx = nba.MultiSteps(nba.sgd(1.0), 2)
    params = {"w": np.zeros(3, np.complex64)}
    state = tx.init(params)
    assert state.acc_grads.group_dtypes == (C64,)
    g = {"w": np.full(3, 1 + 1j, np.complex64)}
    u, state = tx.update(g, state, params)
    assert not np.any(u["w"].view(np.uint32))  # exact +0 zeros between emissions
    u, state = tx.update(g, state, params)
    np.testing.assert_array_equal(u["w"], np.full(3, -1 - 1j, np.complex64))


def test_complex_updates_are_not_added_to_real_params():
    params = {"w": np.ones(3, np.float32), "v": np.ones(2, np.complex64)}
    updates = {"w": np.array([1 + 2j, 3, 4], np.complex64), "v": np.ones(2, np.complex64)}
    for apply in (nba.apply_updates, nba.apply_updates_):
        with pytest.raises(
            TypeError, match=r"updates\['w'\]: complex64 values for a float32 leaf would lose"
        ):
            apply(params, updates)
    np.testing.assert_array_equal(params["w"], np.ones(3, np.float32))
    np.testing.assert_array_equal(params["v"], np.ones(2, np.complex64))
    out = nba.apply_updates(params, {"w": np.ones(3, np.float32), "v": np.full(2, 1j, np.complex64)})
    assert out["v"].dtype == C64 and out["v"][0] == 1 + 1j


def test_inject_hyperparams_keeps_real_hyperparameters_for_complex_params():
    """optax stores them in the params' highest dtype (complex64): real numbers made complex.
    numbaccum keeps them in the real dtype of the parts, optax's ``hyperparam_dtype=float32``."""
    tx = nba.inject_hyperparams(nba.adam)(learning_rate=0.1)
    state = tx.init(tree(0))
    assert np.asarray(state.hyperparams["learning_rate"]).dtype == np.float32
    jax = require("jax")
    with jax.enable_x64(True):
        assert np.asarray(tx.init(tree(0, C128)).hyperparams["b1"]).dtype == np.float64


# --- norms, non-finite values, checkpoints -------------------------------------------------------


def test_global_norms_of_complex_leaves():
    t = {"a": np.array([3 + 4j, -1j, 2], np.complex64), "b": np.array(2 - 2j, np.complex128)}
    mags = np.abs(np.concatenate([np.ravel(x).astype(np.complex128) for x in t.values()]))
    assert nba.global_norm(t) == pytest.approx(np.sqrt(np.sum(mags**2)), rel=1e-15)
    assert nba.global_norm(t, ord=1) == pytest.approx(np.sum(mags), rel=1e-15)
    assert nba.global_norm(t, ord=np.inf) == pytest.approx(np.max(mags), rel=1e-15)


def test_a_huge_complex128_norm_is_rescued_as_a_float64_one():
    """|z|^2 past float64's range: the norm of a complex128 tree is measured again scaled, as a
    float64 tree's is, on every path (global_norm, the clip's norm, the finishing twin of the
    device kernel), and they agree bit for bit with the float64 tree of its parts."""
    z = np.array([3e200 + 4e200j, -1e200j, 2e200], np.complex128)
    parts = {"a": z.view(np.float64)}  # the same values as a float64 tree: re, im, re, im...
    norm = nba.global_norm({"a": z})
    assert np.isfinite(norm) and norm == nba.global_norm(parts)
    assert norm == pytest.approx(np.sqrt(25 + 1 + 4) * 1e200, rel=1e-15)
    tx = nba.clip_by_global_norm(1.0)
    u, _ = tx.update({"a": z}, tx.init({"a": z}))
    assert np.all(np.isfinite(u["a"]))
    assert np.sqrt(np.sum(np.abs(u["a"]) ** 2)) == pytest.approx(1.0, rel=1e-14)
    # The host twin of the device kernel that finishes the norm (`Ops.global_norm_finish_`).
    from numbaccum import tables
    from numbaccum.backend import ops_for
    from numbaccum.formulas import clip_finish

    factors = []  # clip_finish's (div, mul): finite, and the same for both trees
    for tree in ({"a": z}, parts):
        flat = nba.FlatTree.from_tree(tree)
        (g,), lay = flat.groups, flat.layout
        sums, out32, out64 = np.zeros(3), np.zeros(2, np.float32), np.zeros(2)
        members = lay.group_index[0]
        with np.errstate(over="ignore"):  # (the float32 copy of the divisor overflows)
            ops_for(g).global_norm_finish_(
                sums, g, tables.segments(lay.offsets[0]), members, True, clip_finish, (1.0,), out32, out64
            )
        factors.append(tuple(out64))
    assert factors[0] == factors[1] and np.all(np.isfinite(factors[0]))
    assert factors[0][1] / factors[0][0] == pytest.approx(1.0 / norm, rel=1e-14)


def test_a_non_finite_part_counts_and_a_nan_part_zeroes_the_element():
    g = {"w": np.array([complex(1, np.nan), complex(np.nan, 1), complex(np.inf, 2), 3 - 1j], np.complex64)}
    tx = nba.zero_nans()
    u, state = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(u["w"], np.array([0, 0, complex(np.inf, 2), 3 - 1j], np.complex64))
    assert bool(state.found_nan["w"])
    tx = nba.MultiSteps(nba.sgd(1.0), 1, should_skip_update_fn=nba.skip_not_finite)
    params = {"w": np.zeros(4, np.complex64)}
    _, state = tx.update(g, tx.init(params), params)
    assert state.skip_state["num_not_finite"] == 3 and state.skip_state["should_skip"]
    tx = nba.apply_if_finite(nba.adam(0.1), 2)
    _, state = tx.update(
        {"w": np.array([1, complex(0, np.inf), 2, 0], np.complex64)}, tx.init(params), params
    )
    assert state.notfinite_count == 1 and not state.last_finite


def test_skip_large_updates_takes_the_squared_magnitudes():
    """optax sums ``p ** 2`` (a complex square: ``(10j) ** 2 = -100`` never skips); numbaccum
    the squared magnitudes, as every other norm."""
    skip = lambda u, s, p: nba.skip_large_updates(u, s, p, max_squared_norm=50.0)  # noqa: E731
    tx = nba.MultiSteps(nba.sgd(1.0), 1, should_skip_update_fn=skip)
    params = {"w": np.zeros(2, np.complex64)}
    _, state = tx.update({"w": np.array([10j, 0], np.complex64)}, tx.init(params), params)
    assert state.skip_state["norm_squared"] == 100.0 and state.skip_state["should_skip"]


def test_checkpoint_keeps_complex_states_bit_for_bit(tmp_path):
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(0.1))
    params = {"w": tree(0)["w"], "d": tree(1, C128)["b"]}
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    path = os.fspath(tmp_path / "complex.npz")
    nba.save_state(path, state)
    back = nba.load_state(path)
    for (p, a), (q, b) in zip(state_arrays(state).items(), state_arrays(back).items()):
        assert (
            p == q
            and a.dtype == b.dtype
            and np.array_equal(np.ravel(a).view(np.uint8), np.ravel(b).view(np.uint8))
        )
    u, _ = tx.update(params, state, params)
    v, _ = tx.update(params, back, params)
    assert all(np.array_equal(u[k], v[k]) for k in u)


def test_integer_leaves_are_still_refused():
    for bad in (np.ones(3, np.int32), np.ones(3, np.bool_)):
        with pytest.raises(
            TypeError, match=r"\['x'\]: dtype .* is not float16, bfloat16, float32, float64, complex64"
        ):
            nba.FlatTree.from_tree({"x": bad})


# On the device: the registry's SAMPLE of the Cases taking complex leaves (every kind of stage:
# declared formulas, fused chains, the reduction engine's norms and per-slice scalings), and the
# chains above; complex128 on a few (the same kernels compiled for the other dtype).
ON_DEVICE = [
    n
    for n in sampled(cases(per_example=False, cuda=True))
    if CASES[n].public in TAKES_COMPLEX and n not in REAL_STATE
] + [
    "clip_then_adamw",
    "normalize_by_update_norm",
    "clip_by_block_rms",
    "adam",
    "novograd",
    "schedule_free_adam",
]
ON_DEVICE_DTYPE = [(n, C64) for n in ON_DEVICE] + [
    (n, C128) for n in ("clip_then_adamw", "centralize", "lamb", "novograd")
]


def _device_tx(name):
    return SAME[name](nba) if name in SAME else CASES[name].make()


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("name", "dtype"), ON_DEVICE_DTYPE, ids=[f"{n}-{np.dtype(d).name}" for n, d in ON_DEVICE_DTYPE]
)
def test_complex_leaves_on_the_device_match_the_host(name, dtype):
    """Three steps of each on device arrays against the host's, within float rounding (CUDA
    contracts multiply-adds); the updates stay on the device and keep their complex dtype."""
    from numba import cuda

    def dev(tree):
        return nba.tree_map(lambda x: cuda.to_device(np.asarray(x)), tree)

    tx_cpu, tx_gpu = _device_tx(name), _device_tx(name)
    params = tree(2, dtype)
    s_cpu, s_gpu = tx_cpu.init(params), tx_gpu.init(dev(params))
    rtol = 2e-5 if dtype == C64 else 1e-12
    for step in range(3):
        g = tree(10 + step, dtype)
        u_cpu, s_cpu = tx_cpu.update(g, s_cpu, params)
        u_gpu, s_gpu = tx_gpu.update(dev(g), s_gpu, dev(params))
        for k, want in u_cpu.items():
            assert hasattr(u_gpu[k], "copy_to_host"), f"{name} {k}: not a device array"
            got = u_gpu[k].copy_to_host()
            assert got.dtype == dtype and got.shape == want.shape
            scale = float(np.max(np.abs(want))) if want.size else 0.0
            np.testing.assert_allclose(
                got, want, rtol=rtol, atol=rtol * scale, err_msg=f"{name} step {step} {k}"
            )


@pytest.mark.cuda
def test_a_huge_complex128_norm_is_rescued_on_the_device_too():
    """The device clip finishes the norm in its kernel, with the host's rescue for complex128."""
    from numba import cuda

    z = np.array([3e200 + 4e200j, -1e200j, 2e200], np.complex128)
    tx = nba.clip_by_global_norm(1.0)
    want, _ = tx.update({"a": z}, tx.init({"a": z}))
    d = {"a": cuda.to_device(z)}
    got, _ = tx.update(d, tx.init(d))
    np.testing.assert_allclose(got["a"].copy_to_host(), want["a"], rtol=1e-14)
