"""L-BFGS and the zoom line search (numbaccum.quasi_newton) against optax in float64 (x64), on
the functions of optax's own tests and of scientific loops, plus what a NumPy user gets wrong.

The objective comes as ``value_fn(params) -> (value, grad)``: the zoom line search evaluates it at
its trial points, and `value_and_grad_from_state` reuses the accepted point's evaluation.
"""

from __future__ import annotations

import numpy as np
import pytest
from _testutil import assert_tree_close, require

import numbaccum as nba


def rosenbrock(p):
    x = p["x"]
    value = float(np.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2))
    g = np.zeros_like(x)
    g[:-1] = -400 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2 * (1 - x[:-1])
    g[1:] += 200 * (x[1:] - x[:-1] ** 2)
    return value, {"x": g}


def _jax_rosenbrock(jnp):
    return lambda p: jnp.sum(100 * (p["x"][1:] - p["x"][:-1] ** 2) ** 2 + (1 - p["x"][:-1]) ** 2)


A = np.array([[3.0, 0.5, 0.0], [0.5, 2.0, 0.3], [0.0, 0.3, 1.0]])
B = np.array([1.0, -2.0, 0.5])


def quadratic(p):
    """0.5 x'Ax - b'x over two leaves (x: 2 elements, y: 1)."""
    x = np.concatenate([p["x"], p["y"]])
    g = A @ x - B
    return float(0.5 * x @ A @ x - B @ x), {"x": g[:2], "y": g[2:]}


def _jax_quadratic(jnp):
    def f(p):
        x = jnp.concatenate([p["x"], p["y"]])
        return 0.5 * x @ jnp.asarray(A) @ x - jnp.asarray(B) @ x

    return f


def _run_ours(tx, fn, params, steps):
    state = tx.init(params)
    value_and_grad = nba.value_and_grad_from_state(fn)
    values, rates = [], []
    for _ in range(steps):
        value, grad = value_and_grad(params, state=state)
        values.append(value)
        state = nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=fn)
        rates.append(float(_zoom_state(state).learning_rate))
    return params, values, rates, state


def _run_optax(optax, jax, tx, fn, params, steps):
    jnp = jax.numpy
    params = jax.tree.map(jnp.asarray, params)
    state = tx.init(params)
    value_and_grad = optax.value_and_grad_from_state(fn)
    values, rates = [], []
    for _ in range(steps):
        value, grad = value_and_grad(params, state=state)
        values.append(float(value))
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn)
        params = optax.apply_updates(params, updates)
        rates.append(float(_zoom_state(state).learning_rate))
    return params, values, rates


def _zoom_state(state):
    if hasattr(state, "learning_rate") and hasattr(state, "info"):
        return state
    for s in state if isinstance(state, tuple) else ():
        found = _zoom_state(s)
        if found is not None:
            return found
    return None


@pytest.fixture
def x64():
    jax = require("jax")
    optax = require("optax")
    with jax.enable_x64(True):
        yield jax, optax


CASES = {
    "lbfgs_rosenbrock": (lambda m: m.lbfgs(), rosenbrock, _jax_rosenbrock, {"x": np.zeros(5)}, 30),
    "lbfgs_quadratic_two_leaves": (
        lambda m: m.lbfgs(memory_size=2),
        quadratic,
        _jax_quadratic,
        {"x": np.array([1.0, -1.0]), "y": np.array([2.0])},
        8,
    ),
    "lbfgs_no_scaling": (
        lambda m: m.lbfgs(scale_init_precond=False, memory_size=4),
        rosenbrock,
        _jax_rosenbrock,
        {"x": np.full(4, -0.5)},
        20,
    ),
    "sgd_zoom_keep": (
        lambda m: m.chain(m.sgd(1.0), m.scale_by_zoom_linesearch(max_linesearch_steps=15)),
        rosenbrock,
        _jax_rosenbrock,
        {"x": np.array([-1.2, 1.0])},
        15,
    ),
    "sgd_zoom_capped": (
        lambda m: m.chain(
            m.sgd(1.0),
            m.scale_by_zoom_linesearch(max_linesearch_steps=10, max_learning_rate=0.05, curv_rtol=0.5),
        ),
        quadratic,
        _jax_quadratic,
        {"x": np.array([1.0, -1.0]), "y": np.array([2.0])},
        6,
    ),
    # A factor <= 1 (optax's own tests build 1e-5): the bracketing step does not grow.
    "sgd_zoom_increase_one": (
        lambda m: m.chain(
            m.sgd(1e-3), m.scale_by_zoom_linesearch(max_linesearch_steps=8, increase_factor=1.0)
        ),
        rosenbrock,
        _jax_rosenbrock,
        {"x": np.array([-1.2, 1.0])},
        6,
    ),
    "sgd_zoom_shrinking": (
        lambda m: m.chain(
            m.sgd(1e-3), m.scale_by_zoom_linesearch(max_linesearch_steps=5, increase_factor=1e-5)
        ),
        quadratic,
        _jax_quadratic,
        {"x": np.array([1.0, -1.0]), "y": np.array([2.0])},
        6,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_optax_in_float64(name, x64):
    """The same iterates, values and accepted step sizes as optax's (float64 on both sides)."""
    jax, optax = x64
    make, fn, jax_fn, params, steps = CASES[name]
    ours_p, ours_v, ours_r, _ = _run_ours(make(nba), fn, {k: v.copy() for k, v in params.items()}, steps)
    theirs_p, theirs_v, theirs_r = _run_optax(optax, jax, make(optax), jax_fn(jax.numpy), params, steps)
    np.testing.assert_allclose(ours_r, theirs_r, rtol=1e-6, err_msg=f"{name}: step sizes")
    np.testing.assert_allclose(ours_v, theirs_v, rtol=1e-6, atol=1e-12, err_msg=f"{name}: values")
    assert_tree_close(ours_p, {k: np.asarray(v) for k, v in theirs_p.items()}, rtol=1e-6, atol_rel=1e-9)


def test_lbfgs_reaches_the_rosenbrock_minimum_like_scipy():
    """Rosenbrock in 10 dimensions from 0: within 1e-8 of (1, ..., 1), in as many iterations as
    optax's (63 with x64) and SciPy's L-BFGS-B (58)."""
    params = {"x": np.zeros(10)}
    tx = nba.lbfgs()
    state = tx.init(params)
    value_and_grad = nba.value_and_grad_from_state(rosenbrock)
    it = 0
    while it < 200:
        value, grad = value_and_grad(params, state=state)
        if np.linalg.norm(grad["x"]) < 1e-6:
            break
        it += 1
        state = nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=rosenbrock)
    assert it <= 70, it
    np.testing.assert_allclose(params["x"], np.ones(10), atol=1e-7)


def test_update_and_step_agree_and_float32_works():
    params = {"x": np.array([-1.2, 1.0, 0.5], np.float32)}

    def f32(p):
        value, grad = rosenbrock(p)
        return np.float32(value), {"x": grad["x"].astype(np.float32)}

    a, b = nba.lbfgs(), nba.lbfgs()
    sa, sb = a.init(params), b.init(params)
    pa, pb = {"x": params["x"].copy()}, {"x": params["x"].copy()}
    for _ in range(5):
        va, ga = f32(pa)
        u, sa = a.update(ga, sa, pa, value=va, grad=ga, value_fn=f32)
        pa = nba.apply_updates(pa, u)
        vb, gb = f32(pb)
        sb = nba.step_(b, gb, sb, pb, value=vb, grad=gb, value_fn=f32)
        np.testing.assert_array_equal(pa["x"], pb["x"])
    assert pa["x"].dtype == np.float32 and f32(pa)[0] < f32(params)[0]


def test_a_value_fn_with_a_separate_grad_fn_and_extra_arguments():
    """optax's rule: keyword arguments of the update that value_fn names are passed to it."""
    data = np.array([1.0, 2.0, 3.0])

    def value_fn(p, data):
        return float(np.sum((p["w"] - data) ** 2))

    def grad_fn(p, data):
        return {"w": 2 * (p["w"] - data)}

    params = {"w": np.zeros(3)}
    tx = nba.lbfgs()
    state = tx.init(params)
    for _ in range(3):
        v, g = value_fn(params, data), grad_fn(params, data)
        state = nba.step_(
            tx, g, state, params, value=v, grad=g, value_fn=value_fn, grad_fn=grad_fn, data=data
        )
    np.testing.assert_allclose(params["w"], data, atol=1e-10)


def test_missing_and_wrong_arguments_are_named_and_change_nothing():
    params = {"x": np.array([-1.2, 1.0])}
    tx = nba.lbfgs()
    state = tx.init(params)
    value, grad = rosenbrock(params)
    before = params["x"].copy()
    with pytest.raises(TypeError, match="value, grad and value_fn .*missing value_fn"):
        nba.step_(tx, grad, state, params, value=value, grad=grad)
    with pytest.raises(TypeError, match="value must be a real scalar"):
        nba.step_(tx, grad, state, params, value="1", grad=grad, value_fn=rosenbrock)
    with pytest.raises(ValueError, match="grad: tree structure mismatch"):
        nba.step_(tx, grad, state, params, value=value, grad={"y": grad["x"]}, value_fn=rosenbrock)
    with pytest.raises(TypeError, match=r"\['data'\] are not arguments of value_fn"):
        nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=rosenbrock, data=1)
    with pytest.raises(TypeError, match="needs gradients at its trial points"):
        nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=lambda p: rosenbrock(p)[0])
    np.testing.assert_array_equal(params["x"], before)
    with pytest.raises(ValueError, match="memory_size must be >= 1"):
        nba.lbfgs(memory_size=0)
    with pytest.raises(ValueError, match="initial_guess_strategy"):
        nba.scale_by_zoom_linesearch(10, initial_guess_strategy="two")
    with pytest.raises(ValueError, match="needs params"):
        nba.scale_by_lbfgs().update(grad, nba.scale_by_lbfgs().init(params))


def test_value_and_grad_from_state_reuses_the_line_search_evaluation():
    calls = []

    def fn(p):
        calls.append(1)
        return rosenbrock(p)

    params = {"x": np.array([-1.2, 1.0])}
    tx = nba.lbfgs()
    state = tx.init(params)
    value_and_grad = nba.value_and_grad_from_state(fn)
    evaluations = 0
    for _ in range(10):
        value, grad = value_and_grad(params, state=state)
        np.testing.assert_allclose(value, rosenbrock(params)[0], rtol=1e-12)  # the accepted point's
        state = nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=fn)
        evaluations += int(state[2].info.num_linesearch_steps)
    assert len(calls) == evaluations + 1  # only the first value came from outside the searches
    with pytest.raises(ValueError, match="no line search state"):
        value_and_grad(params, state=nba.adam(0.1).init(params))


def test_lbfgs_checkpoint_round_trip(tmp_path):
    params = {"x": np.array([-1.2, 1.0])}
    tx = nba.lbfgs(memory_size=3)
    state = tx.init(params)
    for _ in range(4):
        value, grad = rosenbrock(params)
        state = nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=rosenbrock)
    nba.save_state(tmp_path / "s.npz", state)
    again = nba.load_state(tmp_path / "s.npz", like=tx.init(params))
    p1, p2 = {"x": params["x"].copy()}, {"x": params["x"].copy()}
    for s, p in ((state, p1), (again, p2)):
        value, grad = rosenbrock(p)
        nba.step_(tx, grad, s, p, value=value, grad=grad, value_fn=rosenbrock)
    np.testing.assert_array_equal(p1["x"], p2["x"])


@pytest.mark.cuda
def test_lbfgs_on_device_matches_the_host():
    from numba import cuda

    params = {"x": np.array([-1.2, 1.0, 0.3])}

    def on_device(p):
        value, grad = rosenbrock({"x": p["x"].copy_to_host()})
        return value, {"x": cuda.to_device(grad["x"])}

    host = {"x": params["x"].copy()}
    dev = nba.to_device({"x": params["x"].copy()})
    ta, tb = nba.lbfgs(), nba.lbfgs()
    sa, sb = ta.init(host), tb.init(dev)
    for _ in range(4):
        va, ga = rosenbrock(host)
        u, sa = ta.update(ga, sa, host, value=va, grad=ga, value_fn=rosenbrock)
        host = nba.apply_updates(host, u)
        vb, gb = on_device(dev)
        u, sb = tb.update(gb, sb, dev, value=vb, grad=gb, value_fn=on_device)
        dev = nba.apply_updates(dev, u)
        np.testing.assert_allclose(nba.to_host(dev)["x"], host["x"], rtol=1e-12)


BACKTRACKING = {
    "sgd_backtracking": (
        lambda m: m.chain(m.sgd(1.0), m.scale_by_backtracking_linesearch(max_backtracking_steps=15)),
        False,
    ),
    "sgd_backtracking_store_grad": (
        lambda m: m.chain(
            m.sgd(1.0),
            m.scale_by_backtracking_linesearch(
                max_backtracking_steps=10, decrease_factor=0.5, increase_factor=2.0, store_grad=True
            ),
        ),
        True,
    ),
    "lbfgs_backtracking": (
        lambda m: m.lbfgs(linesearch=m.scale_by_backtracking_linesearch(max_backtracking_steps=20)),
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(BACKTRACKING))
def test_backtracking_against_optax_in_float64(name, x64):
    jax, optax = x64
    make, store = BACKTRACKING[name]
    params = {"x": np.array([-1.2, 1.0, 0.3])}
    steps = 12

    def value_only(p):
        return rosenbrock(p)[0]

    ours, theirs = make(nba), make(optax)
    s, so = ours.init({"x": params["x"].copy()}), theirs.init({"x": jax.numpy.asarray(params["x"])})
    p, po = {"x": params["x"].copy()}, {"x": jax.numpy.asarray(params["x"])}
    f = _jax_rosenbrock(jax.numpy)
    for _ in range(steps):
        value, grad = rosenbrock(p)
        s = nba.step_(ours, grad, s, p, value=value, grad=grad, value_fn=rosenbrock if store else value_only)
        vo, go = jax.value_and_grad(f)(po)
        uo, so = theirs.update(go, so, po, value=vo, grad=go, value_fn=f)
        po = optax.apply_updates(po, uo)
        np.testing.assert_allclose(p["x"], np.asarray(po["x"]), rtol=1e-9, atol=1e-12)
        ours_ls, theirs_ls = _zoom_state_or_backtracking(s), _zoom_state_or_backtracking(so)
        assert float(ours_ls.learning_rate) == pytest.approx(float(theirs_ls.learning_rate), rel=1e-12)
        assert int(ours_ls.info.num_linesearch_steps) == int(theirs_ls.info.num_linesearch_steps)
    if store:
        value, grad = nba.value_and_grad_from_state(rosenbrock)(p, state=s)
        np.testing.assert_allclose(grad["x"], rosenbrock(p)[1]["x"], rtol=1e-12)


def _zoom_state_or_backtracking(state):
    if hasattr(state, "learning_rate") and hasattr(state, "info"):
        return state
    for s in state if isinstance(state, tuple) else ():
        found = _zoom_state_or_backtracking(s)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("m", [10**9, 2**40])
def test_a_memory_that_cannot_fit_is_refused_at_init_naming_memory_size(m):
    """2**40 pairs were built one FlatTree at a time (hours before NumPy ran out of memory)."""
    tx = nba.scale_by_lbfgs(memory_size=m)
    with pytest.raises(ValueError, match="memory_size"):
        tx.init({"w": np.ones((3, 4), np.float32)})
