"""Differential tests against optax itself, when it is installed (``pip install optax``).

CI installs CPU JAX and optax (the ``parity`` extra, .ci/run); there (``NUMBACCUM_CI=1``) a
missing JAX fails these tests instead of skipping them (`_testutil.require`). The float32 recipes of
reference/optax.md are checked bit for bit in test_optax_vectors.py; optax itself is matched within
DESIGN.md's rtol 1e-6: under ``jax.jit`` XLA contracts ``a * g + b * m`` into fused multiply-adds
(1 ulp per step, carried in the state), and eager JAX computes ``decay ** count`` with a pow that
differs from float32 repeated multiplication in the last bit for some counts (jitted JAX agrees
with the recipe's).
"""

import inspect

import numpy as np
import pytest
from _testutil import require
from registry import CASES

import numbaccum as nba
from numbaccum.base import stage_of

optax = require("optax")
jax = require("jax")


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


def _tree_close(ours, theirs, rtol=1e-6):
    a_leaves, b_leaves = nba.tree_flatten(ours)[0], jax.tree.leaves(theirs)
    assert len(a_leaves) == len(b_leaves)
    for a, b in zip(a_leaves, b_leaves):
        b = np.asarray(b)
        np.testing.assert_allclose(
            np.asarray(a), b, rtol=rtol, atol=rtol * float(np.max(np.abs(b), initial=0.0))
        )


def _mlp(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "w": rng.standard_normal((8, 4)).astype(dtype),
            "b": rng.standard_normal(4).astype(dtype),
        },
        "norm": {"scale": rng.standard_normal(4).astype(dtype)},
    }


def test_masked_weight_decay_matches_optax():
    def mask(t):
        return jax.tree.map(lambda x: x.ndim > 1, t)

    params = _mlp(0)
    for make_ours, make_theirs in [
        (lambda: nba.add_decayed_weights(0.1, mask), lambda: optax.add_decayed_weights(0.1, mask)),
        (lambda: nba.masked(nba.adam(1e-2), mask), lambda: optax.masked(optax.adam(1e-2), mask)),
        (
            lambda: nba.chain(nba.scale_by_adam(), nba.add_decayed_weights(1e-2, mask), nba.scale(-1e-2)),
            lambda: optax.chain(
                optax.scale_by_adam(), optax.add_decayed_weights(1e-2, mask), optax.scale(-1e-2)
            ),
        ),
    ]:
        ours, theirs = make_ours(), make_theirs()
        s, t = ours.init(params), theirs.init(params)
        for i in range(3):
            g = _mlp(10 + i)
            u, s = ours.update(g, s, params)
            v, t = jax.jit(theirs.update)(g, t, params)
            _tree_close(u, v, 1e-5)


def test_inject_hyperparams_matches_optax():
    params = _mlp(0)
    ours = nba.inject_hyperparams(nba.adam)(learning_rate=1e-2, b1=0.8)
    theirs = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.8)
    s, t = ours.init(params), theirs.init(params)
    assert set(s.hyperparams) == set(t.hyperparams)
    for i, lr in enumerate([1e-2, 1e-2, 1e-3, 5e-2]):
        s.hyperparams["learning_rate"] = lr
        t.hyperparams["learning_rate"] = lr
        g = _mlp(20 + i)
        u, s = ours.update(g, s, params)
        v, t = theirs.update(g, t, params)
        _tree_close(u, v, 1e-5)
        for k in s.hyperparams:
            assert np.asarray(s.hyperparams[k]).dtype == np.asarray(t.hyperparams[k]).dtype
    sched = optax.linear_schedule(1.0, 0.1, 5)
    ours = nba.inject_hyperparams(nba.sgd)(learning_rate=nba.linear_schedule(1.0, 0.1, 5), momentum=0.9)
    theirs = optax.inject_hyperparams(optax.sgd)(learning_rate=sched, momentum=0.9)
    s, t = ours.init(params), theirs.init(params)
    for i in range(6):
        g = _mlp(30 + i)
        u, s = ours.update(g, s, params)
        v, t = theirs.update(g, t, params)
        _tree_close(u, v, 1e-6)
        np.testing.assert_allclose(
            float(s.hyperparams["learning_rate"]), float(t.hyperparams["learning_rate"]), rtol=1e-6
        )  # JAX: float32 schedule


def test_none_updates_as_optax():
    params = _mlp(0)
    for name in ("scale", "clip_by_global_norm", "sgd", "add_decayed_weights"):
        arg = {"scale": 2.0, "clip_by_global_norm": 1.0, "sgd": 0.1, "add_decayed_weights": 0.1}[name]
        ours, theirs = getattr(nba, name)(arg), getattr(optax, name)(arg)
        assert ours.update(None, ours.init(params), params)[0] is None
        assert theirs.update(None, theirs.init(params), params)[0] is None
    assert nba.apply_updates(None, params) is None and optax.apply_updates(None, params) is None


# optax's optimizer library and every other registry Case that names optax's construction of it
# (Case.optax).
REGISTERED = sorted(name for name, case in CASES.items() if case.optax is not None)


def _parts(state):
    """A chain's states (a plain tuple), or the one state of a transformation."""
    return list(state) if type(state) is tuple else [state]


# Within float32's, float64's rounding of the update's scale (XLA's fused multiply-adds: an ulp
# or two a step, carried in the state).
CLOSE = {np.float32: 2e-6, np.float64: 1e-12}


def _matches_optax(ours, theirs, of_params=False, dtype=np.float32, steps=6):
    """Six steps on a tree of ``dtype`` (float64: JAX's x64 on), optax under jit: the same
    updates within rounding (`CLOSE`), the same state classes and fields. ``of_params``:
    updates that are new params minus the params (schedule-free's), within rounding of the
    params' scale."""
    params = _mlp(0, dtype)
    with jax.enable_x64(dtype == np.float64):
        s, t = ours.init(params), theirs.init(params)
        for a, b in zip(_parts(s), _parts(t), strict=True):
            assert type(a).__name__ == type(b).__name__
            assert getattr(a, "_fields", ()) == getattr(b, "_fields", ())
        update = jax.jit(theirs.update)
        for i in range(steps):
            g = _mlp(40 + i, dtype)
            u, s = ours.update(g, s, params)
            v, t = update(g, t, params)
            leaves = [*nba.tree_flatten(u)[0], *jax.tree.leaves(v)]
            assert all(np.asarray(x).dtype == dtype for x in leaves)
            if of_params:  # new params - params: the same new params within rounding
                _tree_close(nba.apply_updates(params, u), nba.apply_updates(params, v), CLOSE[dtype])
            else:
                _tree_close(u, v, CLOSE[dtype])


# Updates that are the new params minus the params: their rounding is the params' (a cancellation).
OF_PARAMS = {"schedule_free_adam", "schedule_free_adamw", "schedule_free_sgd"}


@pytest.mark.parametrize("name", REGISTERED)
def test_registered_transformation_matches_optax(name):
    """Every registry Case that names optax's construction of it (tests/registry.py)."""
    _matches_optax(CASES[name].make(), CASES[name].optax(optax), of_params=name in OF_PARAMS)


@pytest.mark.parametrize("jit", [False, True])
def test_scale_by_distance_over_gradients_matches_optax_as_the_params_move(jit):
    """DoG's step size is the distance the params travelled: eight steps on float32 leaves of
    several shapes (a 0-d one among them), the params moved by each step's updates on both sides,
    the same updates, params and state within float32 rounding. optax's update of a 0-d leaf
    has its step size's shape (1,) (numbaccum keeps the leaf's shape): compared by value."""
    rng = np.random.default_rng(11)
    shapes = {"w": (6, 4), "b": (4,), "s": (), "k": (2, 3, 2)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    slope = {k: rng.standard_normal(s) for k, s in shapes.items()}  # one direction, noisy
    grads = [
        {k: (slope[k] + 0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
        for _ in range(8)
    ]
    kw = {"reps_rel": 1e-2, "eps": 1e-8, "global_scale": -2.0}
    ours, theirs = nba.scale_by_distance_over_gradients(**kw), optax.scale_by_distance_over_gradients(**kw)
    p_ours, p_theirs = {k: v.copy() for k, v in params.items()}, dict(params)
    s, t = ours.init(p_ours), theirs.init(p_theirs)
    assert type(s).__name__ == type(t).__name__ and s._fields == t._fields
    update = jax.jit(theirs.update) if jit else theirs.update

    def close(a, b, rtol=2e-6):
        b = np.asarray(b).reshape(np.shape(a))
        assert np.asarray(a).dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b), initial=0.0)))

    for g in grads:
        u, s = ours.update(g, s, p_ours)
        v, t = update(g, t, p_theirs)
        for k in shapes:
            close(u[k], v[k])
        p_ours = nba.apply_updates(p_ours, u)
        p_theirs = optax.apply_updates(p_theirs, v)
        for k in shapes:
            close(p_ours[k], p_theirs[k])
            close(s.max_dist[k], t.max_dist[k])
            assert s.grad_sum_of_squares[k].shape == (1,) == np.shape(t.grad_sum_of_squares[k])
            close(s.grad_sum_of_squares[k], t.grad_sum_of_squares[k])
            close(s.init_params[k], t.init_params[k], 0.0)
    # The distance has grown past its initial value: the comparison saw max_dist move.
    first = ours.init(params).max_dist
    assert all(float(s.max_dist[k]) > float(first[k]) for k in shapes)


def test_the_registry_names_optax_for_the_optimizer_library():
    assert {"adamw", "nadam", "amsgrad", "adamax", "adabelief", "lion", "adagrad"} <= set(REGISTERED)
    # the variants this file once listed on its own: a mask, lion's smooth sign, optax's
    # nesterov=False of nadam and nadamw (issue 47), rmsprop's defaults and every option
    assert {
        "adamw_nesterov_masked", "scale_by_lion_smooth", "nadam_nesterov_false", "nadamw_nesterov_false",
        "rmsprop_eps_in_sqrt", "rmsprop_every_option",
    } <= set(REGISTERED)  # fmt: skip


# --- issue 47: what optax accepts and numbaccum refused ---------------------------------------


def _low_precision_values(v):
    """The objective ``v`` as optax's tests pass it: a JAX bfloat16 scalar, ml_dtypes' NumPy
    bfloat16 scalar, a 0-d float16 array (each exact in float64)."""
    jnp = jax.numpy
    bf16 = jnp.bfloat16
    return [jnp.asarray(v, bf16), np.asarray(v).astype(bf16)[()], np.asarray(v, np.float16)]


def test_polyak_sgd_takes_a_bfloat16_value_as_optax():
    params = {"w": np.array([1.0, -2.0, 0.5], np.float32)}
    g = {"w": np.array([0.3, -0.1, 0.2], np.float32)}
    ours, theirs = nba.polyak_sgd(max_learning_rate=10.0), optax.polyak_sgd(max_learning_rate=10.0)
    for value in _low_precision_values(1.375):
        u, _ = ours.update(g, ours.init(params), params, value=value)
        v, _ = theirs.update(g, theirs.init(params), params, value=value)
        _tree_close(u, v, 1e-6)


def test_reduce_on_plateau_takes_a_bfloat16_value_as_optax():
    params = {"w": np.ones(3, np.float32)}
    g = {"w": np.array([0.3, -0.1, 0.2], np.float32)}
    kw = {"factor": 0.5, "patience": 1, "accumulation_size": 2}
    for pick in range(3):
        ours = nba.chain(nba.sgd(0.1), nba.reduce_on_plateau(**kw))
        theirs = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(**kw))
        s, t = ours.init(params), theirs.init(params)
        for loss in (2.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.25, 1.0):  # a plateau, then progress
            value = _low_precision_values(loss)[pick]
            u, s = ours.update(g, s, params, value=value)
            v, t = theirs.update(g, t, params, value=value)
            _tree_close(u, v, 1e-6)
            assert float(s[1].scale) == float(t[1].scale)
            assert float(s[1].best_value) == float(t[1].best_value)
        assert float(s[1].scale) < 1.0  # the plateau was seen


@pytest.mark.parametrize("search", ["zoom", "backtracking"])
def test_line_searches_take_bfloat16_values_as_optax(search):
    """``value=`` and ``value_fn``'s value in bfloat16 (optax's test_dtype_stability, with
    ``increase_factor`` 1e-5 as there): the same step sizes, params and values as optax in
    float64."""
    jnp = jax.numpy
    bf16 = jnp.bfloat16

    def make(m):
        if search == "zoom":
            ls = m.scale_by_zoom_linesearch(max_linesearch_steps=10, increase_factor=1e-5)
        else:
            ls = m.scale_by_backtracking_linesearch(max_backtracking_steps=10)
        return m.chain(m.sgd(1.0), ls)

    def ours_fn(p):  # the value rounded to bfloat16, on both sides
        x = p["x"]
        return np.asarray(np.sum((x - 0.75) ** 2)).astype(bf16)[()], {"x": 2 * (x - 0.75)}

    def theirs_fn(p):
        return jnp.sum((p["x"] - 0.75) ** 2).astype(bf16)

    with jax.enable_x64(True):
        p, po = {"x": np.array([2.0, -1.0])}, {"x": jnp.array([2.0, -1.0])}
        ours, theirs = make(nba), make(optax)
        s, t = ours.init(p), theirs.init(po)
        for _ in range(3):
            value, grad = ours_fn(p)
            s = nba.step_(ours, grad, s, p, value=value, grad=grad, value_fn=ours_fn)
            vo, go = theirs_fn(po), jax.grad(lambda q: jnp.sum((q["x"] - 0.75) ** 2))(po)
            uo, t = theirs.update(go, t, po, value=vo, grad=go, value_fn=theirs_fn)
            po = optax.apply_updates(po, uo)
            np.testing.assert_allclose(p["x"], np.asarray(po["x"]), rtol=1e-12)
            assert float(s[1].learning_rate) == float(t[1].learning_rate)
            assert float(s[1].value) == float(t[1].value)


def test_value_and_grad_from_state_over_two_line_searches_is_ambiguous_as_optax():
    """Two line searches in one chain: optax's KeyError (which value?), whether they store their
    gradients or not; never the first one's silently."""
    params = {"x": np.array([1.0, 2.0, 3.0], np.float32)}

    def fn(p):
        return float(np.sum(p["x"] ** 2)), {"x": 2 * p["x"]}

    def theirs_fn(p):
        return jax.numpy.sum(p["x"] ** 2)

    chains = [
        lambda m: m.chain(
            m.scale_by_backtracking_linesearch(max_backtracking_steps=15),
            m.scale_by_backtracking_linesearch(max_backtracking_steps=15),
        ),
        lambda m: m.chain(
            m.scale_by_backtracking_linesearch(max_backtracking_steps=15, store_grad=True),
            m.scale_by_backtracking_linesearch(max_backtracking_steps=15, store_grad=True),
        ),
        lambda m: m.chain(
            m.sgd(1.0),
            m.scale_by_zoom_linesearch(max_linesearch_steps=5),
            m.scale_by_backtracking_linesearch(max_backtracking_steps=5, store_grad=True),
        ),
    ]
    for make in chains:
        with pytest.raises(KeyError):
            optax.value_and_grad_from_state(theirs_fn)(params, state=make(optax).init(params))
        with pytest.raises(KeyError, match="2 line search states .* ambiguous"):
            nba.value_and_grad_from_state(fn)(params, state=make(nba).init(params))
    one = nba.chain(nba.sgd(1.0), nba.scale_by_backtracking_linesearch(15, store_grad=True))
    assert nba.value_and_grad_from_state(fn)(params, state=one.init(params))[0] == 14.0


def test_inject_hyperparams_on_bfloat16_params_casts_them_as_optax():
    """optax casts float hyperparameters to the params' highest dtype, bfloat16 too (a JAX
    array of a strong dtype keeps its own): the same dtypes, and sgd's updates bit for bit."""
    jnp = jax.numpy
    bf16 = np.dtype(jnp.bfloat16)
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((4, 3)).astype(bf16), "b": rng.standard_normal(3).astype(bf16)}
    for b1 in (0.9, jnp.asarray(0.9), jnp.array(0.9, jnp.float32), jnp.asarray(0.95, jnp.bfloat16)):
        ours = nba.inject_hyperparams(nba.scale_by_adam)(b1=b1, b2=0.95)
        theirs = optax.inject_hyperparams(optax.scale_by_adam)(b1=b1, b2=0.95)
        s, t = ours.init(params), theirs.init(params)
        g = {k: np.ones_like(v) for k, v in params.items()}
        for _ in range(2):  # init, then an update
            assert {k: np.asarray(v).dtype for k, v in s.hyperparams.items()} == {
                k: np.asarray(v).dtype for k, v in t.hyperparams.items()
            }
            s, t = ours.update(g, s, params)[1], theirs.update(g, t, params)[1]
    ours = nba.inject_hyperparams(nba.sgd)(learning_rate=0.1)
    theirs = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    s, t = ours.init(params), theirs.init(params)
    for _ in range(3):  # -bfloat16(0.1) g: one rounding on both sides
        g = {k: rng.standard_normal(v.shape).astype(bf16) for k, v in params.items()}
        u, s = ours.update(g, s, params)
        v, t = theirs.update(g, t, params)
        for k in u:
            assert u[k].dtype == bf16
            np.testing.assert_array_equal(u[k].view(np.uint16), np.asarray(v[k]).view(np.uint16))


def test_inject_hyperparams_adam_on_bfloat16_params_rounds_b2_to_one_as_optax():
    """The price of optax's cast (docs/guides/masks-and-hyperparameters.md): adam's b2 = 0.999
    is 1.0 in bfloat16, its bias correction 0 / 0 on both sides; ``hyperparam_dtype=float32``
    gives adam's own updates."""
    jnp = jax.numpy
    bf16 = np.dtype(jnp.bfloat16)
    params, g = {"w": np.ones(3, bf16)}, {"w": np.full(3, 0.5, bf16)}
    ours, theirs = nba.inject_hyperparams(nba.adam)(1e-2), optax.inject_hyperparams(optax.adam)(1e-2)
    u, s = ours.update(g, ours.init(params), params)
    v, t = theirs.update(g, theirs.init(params), params)
    assert float(s.hyperparams["b2"]) == float(t.hyperparams["b2"]) == 1.0
    assert np.all(np.isnan(u["w"].astype(np.float32))) and np.all(np.isnan(np.asarray(v["w"], np.float32)))
    fixed = nba.inject_hyperparams(nba.adam, hyperparam_dtype=np.float32)(1e-2)
    u, _ = fixed.update(g, fixed.init(params), params)
    plain = nba.adam(1e-2)
    want, _ = plain.update(g, plain.init(params), params)
    np.testing.assert_array_equal(u["w"].view(np.uint16), want["w"].view(np.uint16))


# --- optax's signatures: every name we claim takes optax's keywords with optax's defaults ------


def _optax_object(name):
    """optax's object of that name: optax.contrib's first (optax's top level keeps only deprecated
    aliases of dpsgd and differentially_private_aggregate), then optax's own; None if neither."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        found = getattr(optax.contrib, name, None)
        return found if found is not None else getattr(optax, name, None)


# Every public name of ours that optax (or optax.contrib) has, functions and classes alike.
CLAIMED = sorted(n for n in nba.__all__ if _optax_object(n) is not None)
# The names docs/migrating.md maps to one of ours besides its own: (ours, optax's).
ALSO_CLAIMED = {("global_norm", "optax.tree.norm"): lambda: optax.tree.norm}

_NONE = inspect.Parameter.empty
# Deliberate differences, each with its reason: (name, parameter) -> reason. An extra parameter
# of ours is allowed only here (with a default, so optax's calls still work), and so is a
# parameter of optax's that we lack or spell, order or default otherwise.
SIGNATURE_DIFFERENCES = {
    # numbaccum's own options, defaulting to optax's behaviour
    ("clip_by_global_norm", "nonfinite"): "what a NaN or inf norm does (keyword-only; 'pass' is optax's)",
    ("per_example_global_norm_clip", "return_norms"): "the per-example norms too (keyword-only)",
    ("per_example_layer_norm_clip", "return_norms"): "the per-example norms too (keyword-only)",
    ("centralize", "dim"): "which axes to centre (optax's takes no argument: every axis but the first)",
    ("centralize", "inverse_dims"): "see dim",
    ("centralize", "min_size"): "leaves below it pass (optax's: 0-d and 1-d leaves pass)",
    ("normalize", "norm_value"): "the target norm (optax.contrib's takes no argument: 1)",
    ("normalize", "ord"): "see norm_value",
    ("normalize", "dim"): "see norm_value",
    ("normalize", "inverse_dims"): "see norm_value",
    ("normalize", "min_size"): "see norm_value",
    # a NumPy library has no JAX keys (docs/migrating.md's table)
    ("differentially_private_aggregate", "key"): "an int seed, not a JAX key: the seed is required",
    ("differentially_private_aggregate", "seed"): "required and positional (optax's: a deprecated keyword)",
    # None is refused where it is more often a missing value than a wish (the docstring says so)
    ("scale_by_learning_rate", "learning_rate"): "required: optax's None (no scaling) is refused",
    # global_norm is optax.tree.norm's signature (the table maps both names to it)
    ("global_norm", "updates"): "optax.global_norm's one argument: ours is optax.tree.norm's `tree`",
    ("global_norm", "tree"): "optax.tree.norm's first argument (optax.global_norm's is `updates`)",
    ("global_norm", "ord"): "2 (the same norm as optax.tree.norm's None, which ours takes too)",
    ("global_norm", "squared"): "optax.tree.norm's",
    # MultiSteps accumulates in each leaf's dtype (docs/migrating.md: complex leaves)
    ("MultiSteps", "accumulator_dtype"): "None, each leaf's dtype (optax's float32 drops complex parts)",
    # states with more than optax's fields (each extra one with a default)
    ("ClipByGlobalNormState", "norm"): "the norm it saw (optax's state is an EmptyState)",
    ("ClipByGlobalNormState", "clipped"): "see norm",
    ("ClipByGlobalNormState", "skipped"): "see norm",
    ("DifferentiallyPrivateAggregateState", "examples"): "the accountant's counts (defaults 0)",
    ("DifferentiallyPrivateAggregateState", "clipped"): "see examples",
    ("DifferentiallyPrivateAggregateState", "batch"): "see examples",
    ("DifferentiallyPrivateAggregateState", "noise_std"): "see examples",
    # optax 0.2.8's inject_hyperparams returns InjectStatefulHyperparamsState: ours is that class
    # (its legacy three-field InjectHyperparamsState is returned by nothing)
    ("InjectHyperparamsState", "hyperparams_states"): "an alias of InjectStatefulHyperparamsState",
    ("ScaleByNovogradState", "nu"): "None only inside init (the per-leaf norms come second)",
}
# Defaults that are transformations: optax's is built by a call in its source, ours must be the
# same call of our factory (compared by the stage's hyperparameters).
DEFAULT_TRANSFORMATIONS = {
    ("lbfgs", "linesearch"): (
        "scale_by_zoom_linesearch",
        lambda: nba.scale_by_zoom_linesearch(max_linesearch_steps=20, initial_guess_strategy="one"),
    ),
    ("sophia", "hessian_diagonal_fn"): (
        "hutchinson_estimator_diag_hessian",
        lambda: nba.hutchinson_estimator_diag_hessian(None),
    ),
}


def _hyperparameters(tx):
    """A stage's hyperparameters: its attributes, callables and the per-thread workspaces aside."""
    stage = stage_of(tx)
    return {k: v for k, v in vars(stage).items() if not k.startswith("_") and not callable(v)}


def _is_dtype(x):
    return isinstance(x, np.dtype) or (isinstance(x, type) and hasattr(x, "dtype"))


def _same_default(where, ours, theirs):
    """Whether two defaults are the same: equal values, or functions of the step count equal at
    several counts (adopt's clip_value_fn, Adafactor's decay_rate_fn), or transformations built
    by the same call (`DEFAULT_TRANSFORMATIONS`)."""
    if where in DEFAULT_TRANSFORMATIONS:
        factory, same = DEFAULT_TRANSFORMATIONS[where]
        built_by = theirs.update.__qualname__.split(".")[0]
        return built_by == factory and _hyperparameters(ours) == _hyperparameters(same())
    if _is_dtype(ours) and _is_dtype(theirs):  # jnp.float32 is np.float32's dtype
        return np.dtype(ours) == np.dtype(theirs)
    if inspect.isfunction(ours) and inspect.isfunction(theirs):
        counts = [0, 1, 2, 10, 1000]
        return np.allclose([float(ours(c)) for c in counts], [float(theirs(c)) for c in counts], rtol=1e-6)
    return type(ours) is type(theirs) and ours == theirs


def _signature_differences(name, ours, theirs):
    """The differences between our signature and optax's that `SIGNATURE_DIFFERENCES` does not
    list: parameters missing on either side, in another place, of another kind (positional or
    keyword-only), or with another default. The names of ``*args`` and ``**kwargs`` are not
    keywords: only their kinds count."""
    allowed = {p for (n, p) in SIGNATURE_DIFFERENCES if n == name}

    def key(p):  # a variadic parameter is matched by its kind alone
        return f"<{p.kind.name}>" if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) else p.name

    def by_key(fn):  # the parameters not listed, and their places among those
        params = [p for p in inspect.signature(fn).parameters.values() if key(p) not in allowed]
        return {key(p): (i, p) for i, p in enumerate(params)}

    ours_by, theirs_by = by_key(ours), by_key(theirs)
    found = []
    for k in sorted(set(ours_by) | set(theirs_by)):
        if k not in theirs_by:
            found.append(f"{k}: ours only")
        elif k not in ours_by:
            found.append(f"{k}: optax's only")
        else:
            (i, p), (j, q) = ours_by[k], theirs_by[k]
            if p.kind != q.kind or (i != j and p.kind != p.KEYWORD_ONLY):
                found.append(f"{k}: {p.kind.name} at {i}, optax's {q.kind.name} at {j}")
            elif (p.default is _NONE) != (q.default is _NONE) or (
                p.default is not _NONE and not _same_default((name, k), p.default, q.default)
            ):
                found.append(f"{k}: default {p.default!r}, optax's {q.default!r}")
    return found


@pytest.mark.parametrize("name", CLAIMED)
def test_the_signature_is_optax_s(name):
    """Issue 47: each optax name we claim takes optax's parameters, in optax's order and kinds,
    with optax's defaults (scale_by_ademamix's alpha was 5.0 where optax's is 6.0; nadam refused
    optax's nesterov), but for the deliberate differences `SIGNATURE_DIFFERENCES` lists."""
    assert _signature_differences(name, getattr(nba, name), _optax_object(name)) == []


@pytest.mark.parametrize("ours,theirs", sorted(ALSO_CLAIMED))
def test_the_signature_of_a_name_the_table_maps_is_optax_s(ours, theirs):
    assert _signature_differences(ours, getattr(nba, ours), ALSO_CLAIMED[ours, theirs]()) == []


def test_every_listed_difference_is_still_one():
    """An entry of `SIGNATURE_DIFFERENCES` that no longer differs is removed (it would hide a
    future drift of that parameter)."""
    for name, param in list(SIGNATURE_DIFFERENCES):
        theirs = [_optax_object(name)] + [f() for (n, _), f in ALSO_CLAIMED.items() if n == name]
        assert name in CLAIMED, name
        saved = SIGNATURE_DIFFERENCES.pop((name, param))
        try:
            assert any(_signature_differences(name, getattr(nba, name), t) for t in theirs), (name, param)
        finally:
            SIGNATURE_DIFFERENCES[name, param] = saved


def test_the_signatures_compared_are_all_the_claimed_names():
    """The lookup finds optax's library, optax.contrib's and the deprecated top-level aliases'
    replacements: 130 functions when this was written (optax 0.2.8), besides the classes."""
    functions = [n for n in CLAIMED if not inspect.isclass(getattr(nba, n))]
    assert len(functions) >= 130
    assert {"adam", "scale_by_ademamix", "nadamw", "dpsgd", "sophia"} <= set(functions)
    assert _optax_object("dpsgd") is optax.contrib.dpsgd


# --- what optax refuses, and how (issue 47) ------------------------------------------------------


def test_scale_by_polyak_without_a_value_is_a_type_error_before_the_updates_are_read():
    """optax's update takes ``value`` as a required keyword: a call without it is Python's
    TypeError whatever the updates are (optax's own test passes updates of another tree). Ours
    said ValueError about the tree's structure first."""
    params = (np.array([1.0, -1.0]),)
    wrong = (np.array([500.0, 5.0]), np.array([300.0, 3.0]))  # two leaves, the params one
    for lib in (nba, optax):
        tx = lib.scale_by_polyak()
        state = tx.init(params)
        with pytest.raises(TypeError, match="value"):
            tx.update(wrong, state, params)
    tx = nba.scale_by_polyak()
    with pytest.raises(ValueError, match="structure"):  # given a value, the tree is checked
        tx.update(wrong, tx.init(params), params, value=1.0)


def test_a_constant_add_decayed_weights_takes_any_state_as_optax_s():
    """A constant decay is stateless: optax's update passes whatever state it is given through
    (its own test passes ``0``), as our other stateless transformations do. Ours refused any
    state but EmptyState. A scheduled decay still needs its WeightDecaySchedule (optax's reads
    its count)."""
    params = (np.ones(2, np.float32), {"a": np.ones(2, np.float32), "b": np.full(2, 2.0, np.float32)})
    grads = nba.tree_map(lambda p: np.full_like(p, 0.5), params)
    for state in (0, None, ()):
        assert nba.add_decayed_weights(0.1).update(None, state, params) == (None, state)
        assert optax.add_decayed_weights(0.1).update(None, state, params) == (None, state)
        u, s = nba.add_decayed_weights(0.1).update(grads, state, params)
        v, t = optax.add_decayed_weights(0.1).update(grads, state, params)
        assert s is state and t is state
        _tree_close(u, v, 0.0)
    with pytest.raises(TypeError, match="WeightDecaySchedule"):
        nba.add_decayed_weights(lambda c: 0.1).update(grads, 0, params)


def test_an_unknown_lion_mode_is_refused_when_built_where_optax_waits_for_the_update():
    """Deliberate (docs/migrating.md): optax builds ``scale_by_lion(mode='invalid')`` and its
    ``init`` allocates the state before the first update raises; ours raises where the typo is
    written, naming ``mode`` and the modes there are, as scale_by_polyak's ``variant``."""
    g = np.array([0.1, -0.2], np.float32)
    tx = optax.scale_by_lion(mode="invalid")
    state = tx.init(g)
    with pytest.raises(ValueError, match="invalid"):
        tx.update(g, state)
    with pytest.raises(ValueError, match=r"mode must be one of \['hard', 'smooth', 'refined'\]"):
        nba.scale_by_lion(mode="invalid")


# --- the names optax's own tests never reach, in float32 and float64 (issue 47) -----------------

_YOGI = {"b1": 0.5, "b2": 0.75, "eps": 1e-4, "eps_root": 1e-5, "initial_accumulator_value": 0.5}


def _rank_labels():
    return nba.tree_map(lambda x: "matrix" if np.ndim(x) > 1 else "vector", _mlp(0))


def _decaying(count):
    return 0.1 / (1 + count)


# name -> its construction, from numbaccum or from optax (``L``); ``C``: where optax keeps it
# (optax.contrib for optax, numbaccum's top level for us).
UNREACHED = {
    "scale_by_amsgrad": lambda L, C: L.scale_by_amsgrad(b1=0.8, b2=0.9),
    "scale_by_belief": lambda L, C: L.scale_by_belief(b1=0.8, b2=0.9, eps_root=1e-8),
    "scale_by_sign": lambda L, C: L.chain(L.trace(0.5), L.scale_by_sign()),  # (sign of a sum: ties)
    "scale_by_yogi": lambda L, C: L.scale_by_yogi(**_YOGI),
    "scale_by_radam": lambda L, C: L.scale_by_radam(threshold=3.0, nesterov=True),  # both branches
    "scale_by_novograd": lambda L, C: L.scale_by_novograd(0.8, 0.5, 1e-3, 1e-4),
    "scale_by_adopt": lambda L, C: C.scale_by_adopt(b2=0.99, nesterov=True),
    "scale_by_ademamix": lambda L, C: C.scale_by_ademamix(),  # its defaults (alpha 6.0)
    "scale_by_ademamix_schedules": lambda L, C: C.scale_by_ademamix(
        b3=lambda c: 0.9 + 0.01 * c, alpha=lambda c: 1.0 + c
    ),
    "scale_by_lbfgs": lambda L, C: L.scale_by_lbfgs(memory_size=3),
    "multi_transform": lambda L, C: L.multi_transform(
        {"matrix": L.adam(1e-2), "vector": L.chain(L.trace(0.9), L.scale(-0.1))}, _rank_labels()
    ),
    "inject_stateful_hyperparams": lambda L, C: L.inject_stateful_hyperparams(L.sgd)(
        learning_rate=L.WrappedSchedule(_decaying), momentum=0.9
    ),
}
# The others are compared in other files, in float32 and float64: the two schedules at 10,000
# counts (test_schedules.py's OPTAX_CASES), and the three below.
COMPARED_BELOW = {"scale_by_rprop", "dpsgd", "hutchinson_estimator_diag_hessian"}
SCHEDULES = {"warmup_constant_schedule", "warmup_exponential_decay_schedule"}
NOT_REACHED_BY_OPTAX_TESTS = {
    "scale_by_amsgrad", "scale_by_belief", "scale_by_sign", "scale_by_yogi", "scale_by_radam",
    "scale_by_rprop", "scale_by_sm3", "scale_by_novograd", "scale_by_adopt", "scale_by_ademamix",
    "scale_by_lbfgs", "multi_transform", "inject_stateful_hyperparams", "warmup_constant_schedule",
    "warmup_exponential_decay_schedule", "dpsgd", "hutchinson_estimator_diag_hessian",
}  # fmt: skip
DTYPES = [np.float32, np.float64]


def test_every_name_optax_s_tests_never_reach_is_compared_with_optax():
    import test_factored
    from test_schedules import OPTAX_CASES

    for dtype in ("float32", "float64"):  # scale_by_sm3's comparisons
        assert callable(getattr(test_factored, f"test_scale_by_sm3_matches_optax_in_{dtype}"))
    assert SCHEDULES <= set(OPTAX_CASES)
    here = {n for n in UNREACHED if n in NOT_REACHED_BY_OPTAX_TESTS} | COMPARED_BELOW
    assert NOT_REACHED_BY_OPTAX_TESTS == here | SCHEDULES | {"scale_by_sm3"}


@pytest.mark.filterwarnings("ignore:inject_stateful_hyperparams is deprecated:DeprecationWarning")  # optax's
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", sorted(UNREACHED))
def test_a_name_optax_s_tests_never_reach_matches_optax(name, dtype):
    ours = UNREACHED[name](nba, nba)
    theirs = UNREACHED[name](optax, optax.contrib)
    _matches_optax(ours, theirs, dtype=dtype, steps=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_scale_by_rprop_s_step_is_optax_s_state_one_step_early(dtype):
    """Rprop (docs/migrating.md): our update is the current step, optax 0.2.8's the previous one
    (its PR #1725); the step optax stores in its state (``prev_updates``) is ours, and so are its
    step sizes, step after step."""
    params = _mlp(0, dtype)
    args = (0.05, 0.3, 1.5, 1e-3, 0.07)
    ours, theirs = nba.scale_by_rprop(*args), optax.scale_by_rprop(*args)
    with jax.enable_x64(dtype == np.float64):
        s, t = ours.init(params), theirs.init(params)
        assert type(s).__name__ == type(t).__name__ and s._fields == t._fields
        update = jax.jit(theirs.update)
        previous = None
        for i in range(6):
            g = _mlp(40 + i % 3, dtype)  # signs that repeat and flip
            u, s = ours.update(g, s, params)
            v, t = update(g, t, params)
            _tree_close(u, t.prev_updates, 0.0)
            _tree_close(s.step_sizes.tree, t.step_sizes, 0.0)
            if previous is not None:  # optax emits the step before, zeroed where the sign flipped
                flipped = jax.tree.map(lambda a, b: np.asarray(a) * np.asarray(b) < 0, g, previous)
                emitted = jax.tree.map(lambda p, f: np.where(f, 0, p), previous_step, flipped)
                _tree_close(emitted, v, 0.0)
            previous, previous_step = g, nba.tree_map(np.copy, u)


@pytest.mark.filterwarnings("ignore:.*seed.* is deprecated:DeprecationWarning")  # optax's dpsgd's own call
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_dpsgd_without_noise_matches_optax(dtype):
    """dpsgd's noise is drawn from Philox, optax's from JAX's keys: with noise_multiplier 0 the
    rest (each example clipped to l2_norm_clip, the sum, the mean, momentum) is compared."""
    rng = np.random.default_rng(5)
    batch = 6
    params = _mlp(0, dtype)
    kw = {"l2_norm_clip": 1.5, "noise_multiplier": 0.0, "seed": 0, "momentum": 0.9, "nesterov": True}
    ours, theirs = nba.dpsgd(0.1, **kw), optax.contrib.dpsgd(0.1, **kw)
    with jax.enable_x64(dtype == np.float64):
        s, t = ours.init(params), theirs.init(params)
        update = jax.jit(theirs.update)
        for _ in range(4):
            g = nba.tree_map(lambda p: (rng.standard_normal((batch, *p.shape)) * 0.7).astype(dtype), params)
            u, s = ours.update(g, s, params)
            v, t = update(g, t, params)
            _tree_close(u, v, CLOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_hutchinson_estimator_matches_optax_on_a_diagonal_hessian(dtype):
    """Our random signs are Philox's, optax's JAX's; for a separable objective (a diagonal
    Hessian, ``3 c x^2``) every sign gives the exact diagonal: ours from ``hvp_fn``, optax's from
    JAX's derivatives of ``obj_fn``, step after step as the params move."""
    jnp = jax.numpy
    c = _mlp(7, dtype)
    ours, theirs = nba.hutchinson_estimator_diag_hessian(3), optax.contrib.hutchinson_estimator_diag_hessian()

    def obj_fn(p):
        return sum(jnp.sum(ci * x**4) / 4 for ci, x in zip(jax.tree.leaves(c), jax.tree.leaves(p)))

    def hvp_fn(p, v):
        return nba.tree_map(lambda ci, x, vi: 3 * ci * x * x * vi, c, p, v)

    with jax.enable_x64(dtype == np.float64):
        params = _mlp(0, dtype)
        s, t = ours.init(params), theirs.init(params)
        assert type(s).__name__ == type(t).__name__ and s._fields == t._fields
        for i in range(3):
            d, s = ours.update(params, s, params, hvp_fn=hvp_fn)
            e, t = theirs.update(params, t, params, obj_fn=obj_fn)
            _tree_close(d, e, CLOSE[dtype])
            params = nba.tree_map(lambda x, k=i: x * dtype(0.5 + k), params)
