"""Differential tests against optax itself, when it is installed (``pip install optax``).

CI installs CPU JAX and optax (the ``parity`` extra, .ci/run); there (``NUMBACCUM_CI=1``) a
missing JAX fails these tests instead of skipping them (`_testutil.require`). The float32 recipes of
reference/optax.md are checked bit for bit in test_optax_vectors.py; optax itself is matched within
DESIGN.md's rtol 1e-6: under ``jax.jit`` XLA contracts ``a * g + b * m`` into fused multiply-adds
(1 ulp per step, carried in the state), and eager JAX computes ``decay ** count`` with a pow that
differs from float32 repeated multiplication in the last bit for some counts (jitted JAX agrees
with the recipe's).
"""

import numpy as np
import pytest
from _testutil import require
from registry import CASES

import numbaccum as nba

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


def _mlp(seed):
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "w": rng.standard_normal((8, 4)).astype(np.float32),
            "b": rng.standard_normal(4).astype(np.float32),
        },
        "norm": {"scale": rng.standard_normal(4).astype(np.float32)},
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


# optax's optimizer library: the registry's Cases that name optax's construction (Case.optax),
# and these variants of them.
OPTIMIZERS = {
    "adamw_nesterov_mask": lambda L: L.adamw(1e-2, nesterov=True, mask={"dense": True, "norm": False}),
    "lion_smooth": lambda L: L.chain(L.scale_by_lion(mode="smooth", smooth_beta=2.0), L.scale(-1e-2)),
    "rmsprop": lambda L: L.rmsprop(1e-2),
    "rmsprop_every_option": lambda L: L.rmsprop(
        1e-2,
        0.8,
        1e-6,
        0.5,
        eps_in_sqrt=False,
        centered=True,
        momentum=0.9,
        nesterov=True,
        bias_correction=True,
    ),
}
REGISTERED = sorted(name for name, case in CASES.items() if case.optax is not None)


def _parts(state):
    """A chain's states (a plain tuple), or the one state of a transformation."""
    return list(state) if type(state) is tuple else [state]


def _matches_optax(ours, theirs, of_params=False):
    """Six steps on a float32 tree, optax under jit: the same updates within float32 rounding
    (XLA fuses multiply-adds), the same state classes and fields. ``of_params``: updates that
    are new params minus the params (schedule-free's), within rounding of the params' scale."""
    params = _mlp(0)
    s, t = ours.init(params), theirs.init(params)
    assert [type(x).__name__ for x in _parts(s)] == [type(x).__name__ for x in _parts(t)]
    assert [getattr(x, "_fields", ()) for x in _parts(s)] == [getattr(x, "_fields", ()) for x in _parts(t)]
    update = jax.jit(theirs.update)
    for i in range(6):
        g = _mlp(40 + i)
        u, s = ours.update(g, s, params)
        v, t = update(g, t, params)
        if of_params:  # new params - params: the same new params within float32 rounding
            _tree_close(nba.apply_updates(params, u), nba.apply_updates(params, v), 2e-6)
        else:
            _tree_close(u, v, 2e-6)


# Updates that are the new params minus the params: their rounding is the params' (a cancellation).
OF_PARAMS = {"schedule_free_adam", "schedule_free_adamw", "schedule_free_sgd"}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_library_matches_optax(name):
    _matches_optax(OPTIMIZERS[name](nba), OPTIMIZERS[name](optax))


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
