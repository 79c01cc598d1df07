"""Sophia (optax.contrib's ``sophia``, ``scale_by_sophia``, ``hutchinson_estimator_diag_hessian``).

The registry (tests/registry.py) drives Sophia with a deterministic Hessian estimate through the
reference, fusion, CUDA, hostile, checkpoint, complex, bfloat16 and optax tests. Here: the
interface that replaces optax's ``obj_fn`` (``hvp_fn`` or ``grad_fn`` as update's keyword
arguments), optax itself given the *same* Rademacher vectors through a custom
``hessian_diagonal_fn`` on both sides (JAX's random bits differ from our Philox draws), and the
law of our Hutchinson estimator.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import numpy as np
import pytest
from _testutil import require
from test_all_or_nothing import assert_bitwise, snapshot

import numbaccum as nba
from numbaccum.contrib import _difference_step, _rademacher

N = 6


def _spd(n: int = N, seed: int = 0) -> np.ndarray:
    """A symmetric, diagonally dominant matrix: every Hutchinson estimate of its diagonal is
    positive (|off-diagonal row sum| < diagonal), so nu stays away from the eps floor."""
    rng = np.random.default_rng(seed)
    b = rng.uniform(-0.3, 0.3, (n, n))
    a = (b + b.T) / 2
    np.fill_diagonal(a, 0.0)
    np.fill_diagonal(a, np.abs(a).sum(axis=1) + rng.uniform(0.5, 2.0, n))
    return a


A = _spd()
B = np.linspace(-1.0, 1.0, N)


# f(x) = 0.5 x^T A x + b^T x (quadratic) and f(x) + sum(log cosh x) (not): their gradients and
# Hessian-vector products in NumPy, in the params' dtype.
def _grad(x: np.ndarray, quadratic: bool) -> np.ndarray:
    a, b = A.astype(x.dtype), B.astype(x.dtype)
    g = a @ x + b
    return g if quadratic else g + np.tanh(x)


def _hvp(x: np.ndarray, v: np.ndarray, quadratic: bool) -> np.ndarray:
    hv = A.astype(x.dtype) @ v
    return hv if quadratic else hv + (x.dtype.type(1) - np.tanh(x) ** 2) * v


class _Index(NamedTuple):
    k: Any


def _fixed_signs_ours(signs: np.ndarray) -> Any:
    """Hutchinson's estimate with the k-th row of ``signs`` at the k-th estimate, from the
    caller's ``hvp_fn`` (numbaccum's interface)."""

    def init(params: Any) -> _Index:
        return _Index(np.int32(0))

    def update(updates: Any, state: _Index, params: Any = None, hvp_fn: Any = None, **extra: Any) -> Any:
        v = {"x": signs[int(state.k) % len(signs)].astype(params["x"].dtype)}
        hv = hvp_fn(params, v)
        return {"x": hv["x"] * v["x"]}, _Index(np.int32(int(state.k) + 1))

    return nba.GradientTransformationExtraArgs(init, update)


def _fixed_signs_optax(optax: Any, jax: Any, signs: np.ndarray) -> Any:
    """The same estimates for optax's Sophia, from its ``obj_fn`` by JAX's autodiff."""
    jnp = jax.numpy
    table = jnp.asarray(signs)

    def init(params: Any) -> _Index:
        return _Index(jnp.zeros([], jnp.int32))

    def update(updates: Any, state: _Index, params: Any = None, obj_fn: Any = None, **extra: Any) -> Any:
        v = {"x": table[state.k % len(signs)].astype(params["x"].dtype)}
        hv = jax.jvp(jax.grad(obj_fn), (params,), (v,))[1]
        return jax.tree.map(lambda h, r: h * r, hv, v), _Index(state.k + 1)

    return optax.GradientTransformationExtraArgs(init, update)


def _objective(jax: Any, quadratic: bool) -> Any:
    jnp = jax.numpy

    def f(params: Any) -> Any:
        x = params["x"]
        a, b = jnp.asarray(A, x.dtype), jnp.asarray(B, x.dtype)
        value = 0.5 * x @ (a @ x) + b @ x
        return value if quadratic else value + jnp.sum(jnp.log(jnp.cosh(x)))

    return f


CONFIGS = {
    "defaults": {},
    # (eps 0.5: without a clip, the first step's mu / eps would throw log cosh out of range)
    "every_step_no_clip": {"update_interval": 1, "clip_threshold": None, "gamma": 2.0, "b2": 0.9, "eps": 0.5},
    "every_third": {"update_interval": 3, "gamma": 2.0, "b1": 0.8, "b2": 0.5, "weight_decay": 0.01},
}


@pytest.fixture
def x64():
    jax = require("jax")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def _against_optax(config: str, quadratic: bool, dtype: Any, jit: bool, steps: int = 14) -> None:
    optax, jax = require("optax"), require("jax")
    kw = dict(CONFIGS[config])
    signs = np.where(np.random.default_rng(3).random((5, N)) < 0.5, -1.0, 1.0)
    ours = nba.sophia(0.05, hessian_diagonal_fn=_fixed_signs_ours(signs), **kw)
    theirs = optax.contrib.sophia(0.05, hessian_diagonal_fn=_fixed_signs_optax(optax, jax, signs), **kw)
    x0 = np.random.default_rng(1).standard_normal(N).astype(dtype)
    p, q = {"x": x0.copy()}, {"x": jax.numpy.asarray(x0)}
    s, t = ours.init(p), theirs.init(q)
    obj = _objective(jax, quadratic)
    grad = jax.grad(obj)
    update = jax.jit(theirs.update, static_argnames=("obj_fn",)) if jit else theirs.update
    rtol = 2e-5 if dtype == np.float32 else 1e-11
    for step in range(steps):
        hvp = lambda params, v: {"x": _hvp(params["x"], v["x"], quadratic)}  # noqa: E731
        u, s = ours.update({"x": _grad(p["x"], quadratic)}, s, p, hvp_fn=hvp)
        v, t = update(grad(q), t, q, obj_fn=obj)
        assert u["x"].dtype == np.dtype(dtype) and np.asarray(v["x"]).dtype == np.dtype(dtype)
        scale = float(np.max(np.abs(v["x"])))
        np.testing.assert_allclose(
            u["x"], np.asarray(v["x"]), rtol=rtol, atol=rtol * scale, err_msg=f"step {step}"
        )
        for field in ("mu", "nu"):
            got, want = getattr(s[0], field).tree["x"], np.asarray(getattr(t[0], field)["x"])
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.max(np.abs(want))))
        assert int(s[0].count) == int(t[0].count) == step + 1
        assert int(s[0].hessian_fn_state.k) == int(t[0].hessian_fn_state.k)
        p = nba.apply_updates(p, u)
        q = optax.apply_updates(q, v)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("quadratic", [True, False], ids=["quadratic", "log_cosh"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sophia_matches_optax_given_the_same_signs_float32(config, quadratic, jit):
    """optax's obj_fn (JAX autodiff) and our hvp_fn, the same Rademacher vectors: the same
    updates and moments within float32 rounding (the Hessian-vector products round apart)."""
    _against_optax(config, quadratic, np.float32, jit)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("quadratic", [True, False], ids=["quadratic", "log_cosh"])
def test_sophia_matches_optax_given_the_same_signs_float64(config, quadratic, x64):
    _against_optax(config, quadratic, np.float64, jit=True)


def _known_estimate_pair(optax: Any, jax: Any) -> tuple[Any, Any]:
    """A Hessian estimate both sides know exactly (no Hessian-vector product): the Sophia core
    alone, in the same float32 operations."""
    h = np.array([0.5, -0.25, 2.0, 1e-9, 3.0, 0.0], np.float32)
    ours = nba.GradientTransformation(lambda p: nba.EmptyState(), lambda u, s, p=None: ({"x": h.copy()}, s))
    theirs = optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: ({"x": jax.numpy.asarray(h)}, s)
    )
    return ours, theirs


@pytest.mark.parametrize("clip_threshold", [1.0, 0.3, None])
@pytest.mark.parametrize("update_interval", [1, 2, 5])
def test_the_sophia_core_matches_optax_on_a_known_estimate(clip_threshold, update_interval):
    """Eager optax, float32: each step's update and moments bit for bit but for optax's pow in
    the bias correction (1 ulp), with eps flooring gamma nu where nu is negative or tiny."""
    optax, jax = require("optax"), require("jax")
    ours_h, theirs_h = _known_estimate_pair(optax, jax)
    kw = {"gamma": 0.5, "b2": 0.75, "clip_threshold": clip_threshold, "update_interval": update_interval}
    ours = nba.scale_by_sophia(hessian_diagonal_fn=ours_h, **kw)
    theirs = optax.contrib._sophia.scale_by_sophia(hessian_diagonal_fn=theirs_h, **kw)
    p = {"x": np.zeros(N, np.float32)}
    s, t = ours.init(p), theirs.init(p)
    rng = np.random.default_rng(7)
    for _ in range(9):
        g = {"x": rng.standard_normal(N).astype(np.float32)}
        u, s = ours.update(g, s, p)
        v, t = theirs.update(g, t, p)
        np.testing.assert_array_max_ulp(u["x"], np.asarray(v["x"]), maxulp=2)
        np.testing.assert_array_max_ulp(s.mu.tree["x"], np.asarray(t.mu["x"]), maxulp=0)
        np.testing.assert_array_max_ulp(s.nu.tree["x"], np.asarray(t.nu["x"]), maxulp=0)
        if clip_threshold is not None:
            assert np.all(np.abs(u["x"]) <= np.float32(clip_threshold))
    assert type(s).__name__ == type(t).__name__ and s._fields == t._fields


# --- the estimator's interface --------------------------------------------------------------------


def _counting(fn: Any, calls: list) -> Any:
    def wrapped(*args: Any) -> Any:
        calls.append(args)
        return fn(*args)

    return wrapped


def test_the_estimator_runs_only_on_hessian_steps():
    calls: list = []
    hvp = _counting(lambda p, v: {"x": A @ v["x"]}, calls)
    tx = nba.sophia(0.1, update_interval=3)
    p = {"x": np.ones(N)}
    s = tx.init(p)
    for step in range(8):
        s = nba.step_(tx, {"x": _grad(p["x"], True)}, s, p, hvp_fn=hvp)
        assert len(calls) == step // 3 + 1  # the counts before steps 0, 3, 6
    assert [int(k) for k in s[0].hessian_fn_state.key] == [0, 3]
    # On the other steps the callback may be absent altogether.
    s = nba.step_(tx, {"x": _grad(p["x"], True)}, s, p)  # count 8: no estimate
    with pytest.raises(ValueError, match="hvp_fn"):
        nba.step_(tx, {"x": _grad(p["x"], True)}, s, p)  # count 9: an estimate


def test_obj_fn_alone_says_what_to_pass_and_changes_nothing():
    tx = nba.sophia(0.1)
    p = {"x": np.ones(N, np.float32)}
    s = tx.init(p)
    before = snapshot(s)
    with pytest.raises(ValueError, match="obj_fn cannot be differentiated.*hvp_fn.*grad_fn"):
        tx.update({"x": np.ones(N, np.float32)}, s, p, obj_fn=lambda params: 0.0)
    with pytest.raises(ValueError, match="needs hvp_fn"):
        tx.update({"x": np.ones(N, np.float32)}, s, p)
    with pytest.raises(TypeError, match="hvp_fn must be callable"):
        tx.update({"x": np.ones(N, np.float32)}, s, p, hvp_fn=3.0)
    with pytest.raises(ValueError, match="params must be provided"):
        tx.update({"x": np.ones(N, np.float32)}, s)

    def broken(params: Any, v: Any) -> Any:
        raise ZeroDivisionError("the user's own error")

    with pytest.raises(ZeroDivisionError):
        tx.update({"x": np.ones(N, np.float32)}, s, p, hvp_fn=broken)
    with pytest.raises(ValueError, match="hvp_fn's value"):
        tx.update({"x": np.ones(N, np.float32)}, s, p, hvp_fn=lambda q, v: {"x": np.ones(N + 1)})
    assert_bitwise(snapshot(s), before)
    u, s = tx.update({"x": np.ones(N, np.float32)}, s, p, hvp_fn=lambda q, v: {"x": A @ v["x"]})
    assert int(s[0].count) == 1  # the state refused above was still current


def test_callbacks_get_trees_of_the_params_dtype_and_signs():
    seen: list = []

    def hvp(params: Any, v: Any) -> Any:
        seen.append({k: np.array(x) for k, x in v.items()})
        assert params["w"].dtype == np.float32 and params["b"].dtype == np.float64
        return {k: 2.0 * x for k, x in v.items()}

    p = {"w": np.ones((3, 4), np.float32), "b": np.zeros(5)}
    tx = nba.hutchinson_estimator_diag_hessian(7)
    d, s = tx.update(p, tx.init(p), p, hvp_fn=hvp)
    v = seen[0]
    assert v["w"].dtype == np.float32 and v["b"].dtype == np.float64
    assert set(np.unique(np.concatenate([v["w"].ravel(), v["b"]]))) <= {-1.0, 1.0}
    for k in p:  # v * (2 v) = 2 exactly
        np.testing.assert_array_equal(d[k], np.full(p[k].shape, 2.0, p[k].dtype))


def test_grad_fn_gives_the_hessian_vector_product_by_central_differences():
    p = {"x": np.random.default_rng(2).standard_normal(N)}
    for quadratic, rtol in [(True, 1e-9), (False, 1e-6)]:
        a = nba.hutchinson_estimator_diag_hessian(11)
        b = nba.hutchinson_estimator_diag_hessian(11)
        sa, sb = a.init(p), b.init(p)
        for _ in range(3):
            exact, sa = a.update(p, sa, p, hvp_fn=lambda q, v, f=quadratic: {"x": _hvp(q["x"], v["x"], f)})
            diff, sb = b.update(p, sb, p, grad_fn=lambda q, f=quadratic: {"x": _grad(q["x"], f)})
            np.testing.assert_allclose(diff["x"], exact["x"], rtol=rtol, atol=rtol)


def test_the_central_difference_step_rule():
    p = nba.FlatTree.from_tree({"x": np.full(100, 3.0, np.float32)})  # ||p|| = 30
    assert _difference_step(p) == pytest.approx(np.finfo(np.float32).eps ** (1 / 3) * 30 / 10)
    q = nba.FlatTree.from_tree({"x": np.zeros(4), "y": np.zeros(5, np.float32)})
    assert _difference_step(q) == pytest.approx(np.finfo(np.float32).eps ** (1 / 3) / 3)


# --- the law of the Hutchinson estimator ---------------------------------------------------------


def test_hutchinson_is_unbiased():
    """E[v * A v] = diag(A): the mean of n estimates is within 5 standard deviations
    (sqrt(sum_{j != i} A_ij^2 / n)) of the diagonal, and a diagonal A is estimated exactly."""
    p = {"x": np.zeros(N)}
    tx = nba.hutchinson_estimator_diag_hessian(123)
    s = tx.init(p)
    n, total = 3000, np.zeros(N)
    for _ in range(n):
        d, s = tx.update(p, s, p, hvp_fn=lambda q, v: {"x": A @ v["x"]})
        total += d["x"]
    off = A - np.diag(np.diag(A))
    sd = np.sqrt((off**2).sum(axis=1) / n)
    assert np.all(np.abs(total / n - np.diag(A)) < 5 * sd)
    diag = np.diag(np.arange(1.0, N + 1))
    d, s = tx.update(p, s, p, hvp_fn=lambda q, v: {"x": diag @ v["x"]})
    np.testing.assert_array_equal(d["x"], np.arange(1.0, N + 1))


def test_hutchinson_signs_are_balanced_reproducible_and_independent_of_the_layout():
    big = {"a": np.zeros(40_000, np.float32), "b": np.zeros((7, 3))}
    flat = nba.FlatTree.from_tree(big)
    v = _rademacher(flat.workspace("v"), seed=5, step=0)
    for g in v.groups:
        assert set(np.unique(g)) == {-1.0, 1.0}
    assert abs(float(np.mean(v.groups[0]))) < 5 / np.sqrt(40_000)
    # The recipe, written out: the bits of the Philox stream [seed, step], low bit first.
    words = np.random.Philox(key=np.array([5, 0], np.uint64)).random_raw(625)
    bits = np.unpackbits(np.asarray(words, "<u8").view(np.uint8), bitorder="little")[:40_000]
    np.testing.assert_array_equal(v.tree["a"], 1.0 - 2.0 * bits)
    again = _rademacher(flat.workspace("again"), seed=5, step=0)
    other_step = _rademacher(flat.workspace("other"), seed=5, step=1)
    other_seed = _rademacher(flat.workspace("seed"), seed=6, step=0)
    assert v.groups[0].tobytes() == again.groups[0].tobytes()
    assert v.groups[0].tobytes() != other_step.groups[0].tobytes()
    assert v.groups[0].tobytes() != other_seed.groups[0].tobytes()


def test_hutchinson_state_is_its_seed_and_step():
    p = {"x": np.zeros(3)}
    tx = nba.hutchinson_estimator_diag_hessian(2**64 - 1)
    s = tx.init(p)
    assert isinstance(s, nba.HutchinsonState) and s.key.dtype == np.uint64 and not s.key.flags.writeable
    assert [int(k) for k in s.key] == [2**64 - 1, 0]
    d1, s1 = tx.update(p, s, p, hvp_fn=lambda q, v: {"x": v["x"] * np.array([1.0, 2.0, 3.0])})
    d2, _ = tx.update(p, s, p, hvp_fn=lambda q, v: {"x": v["x"] * np.array([1.0, 2.0, 3.0])})
    np.testing.assert_array_equal(d1["x"], d2["x"])  # the same state: the same draws
    assert [int(k) for k in s1.key] == [2**64 - 1, 1]
    assert nba.hutchinson_estimator_diag_hessian().init(p).key.tolist() == [0, 0]
    for bad, err in [(-1, ValueError), (2**64, ValueError), (1.5, TypeError), ("0", TypeError)]:
        with pytest.raises(err, match="random_seed"):
            nba.hutchinson_estimator_diag_hessian(bad)


def test_sophia_with_hutchinson_is_reproducible_and_survives_a_checkpoint(tmp_path):
    p0 = {"x": np.random.default_rng(4).standard_normal(N).astype(np.float32)}

    def run(steps: int, tx: Any, p: Any, s: Any) -> Any:
        for _ in range(steps):
            hvp = lambda q, v: {"x": _hvp(q["x"], v["x"], False)}  # noqa: E731
            s = nba.step_(tx, {"x": _grad(p["x"], False)}, s, p, hvp_fn=hvp)
        return s

    tx = nba.sophia(0.05, update_interval=2, hessian_diagonal_fn=nba.hutchinson_estimator_diag_hessian(9))
    p = {"x": p0["x"].copy()}
    s = run(5, tx, p, tx.init(p))
    nba.save_state(tmp_path / "s.npz", s)
    loaded = nba.load_state(tmp_path / "s.npz")
    q = {"x": p["x"].copy()}
    s_after = run(5, tx, p, s)
    loaded_after = run(5, tx, q, loaded)
    np.testing.assert_array_equal(p["x"], q["x"])
    assert [int(k) for k in loaded_after[0].hessian_fn_state.key] == [9, 5]
    assert_bitwise(snapshot(s_after), snapshot(loaded_after))
    assert pickle.loads(pickle.dumps(loaded_after[0].hessian_fn_state)).key.tolist() == [9, 5]
    fresh = {"x": p0["x"].copy()}
    run(10, tx, fresh, tx.init(fresh))
    np.testing.assert_array_equal(fresh["x"], p["x"])  # a seed reproduces the run


# --- fusion, explain, verbose ----------------------------------------------------------------


def test_sophia_is_one_fused_pass_and_step_matches_update():
    p = {"x": np.random.default_rng(5).standard_normal(N).astype(np.float32)}
    tx = nba.sophia(0.1, update_interval=1)
    hvp = lambda q, v: {"x": A.astype(np.float32) @ v["x"]}  # noqa: E731
    ex = nba.explain(tx, p, fused=True, hvp_fn=hvp)
    assert [x.kind for x in ex.passes] == ["fused"]
    assert "scale_by_sophia" in ex.passes[0].stages[0]
    q = {"x": p["x"].copy()}
    s, t = tx.init(p), tx.init(q)
    for _ in range(4):
        g = {"x": _grad(p["x"], True).astype(np.float32)}
        u, s = tx.update(g, s, p, hvp_fn=hvp)
        p = nba.apply_updates(p, u)
        t = nba.step_(tx, g, t, q, hvp_fn=hvp)
        np.testing.assert_array_equal(p["x"], q["x"])


def test_verbose_prints_the_win_rate(capsys):
    h = np.array([1.0, 1.0, 100.0, 100.0, 0.5, 0.0])
    est = nba.GradientTransformation(lambda p: nba.EmptyState(), lambda u, s, p=None: ({"x": h}, s))
    tx = nba.scale_by_sophia(
        b2=0.0,
        gamma=1.0,
        update_interval=1,
        hessian_diagonal_fn=est,
        verbose=True,
        print_win_rate_every_n_steps=2,
    )
    p = {"x": np.zeros(N)}
    s = tx.init(p)
    g = {"x": np.array([0.5, 2.0, 0.5, 2.0, 0.25, 1.0])}
    u, s = tx.update(g, s, p)  # step 1: not printed
    assert capsys.readouterr().out == ""
    u, s = tx.update(g, s, p)  # step 2: u = clip(g / max(h, eps)), |u| < 1 for 4 of 6
    assert int(np.sum(np.abs(u["x"]) < 1.0)) == 4
    assert capsys.readouterr().out == f"Sophia optimizer win rate: {4 / 6}\n"
    quiet = nba.scale_by_sophia(
        clip_threshold=None, hessian_diagonal_fn=est, verbose=True, print_win_rate_every_n_steps=1
    )
    quiet.update(g, quiet.init(p), p)
    assert capsys.readouterr().out == ""  # no clip: no win rate (optax's)


def test_hyperparameters_are_checked():
    with pytest.raises(ValueError, match="update_interval"):
        nba.sophia(0.1, update_interval=0)
    with pytest.raises(TypeError, match="hessian_diagonal_fn"):
        nba.scale_by_sophia(hessian_diagonal_fn=lambda p: p)
    with pytest.raises(ValueError, match="b1"):
        nba.scale_by_sophia(b1=1.5)
    with pytest.raises(TypeError, match="verbose"):
        nba.scale_by_sophia(verbose="yes")


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["hvp_fn", "grad_fn"])
def test_sophia_with_hutchinson_on_the_device_matches_the_host(how):
    """The signs are drawn on the host (the same on either side); the callbacks get the params'
    CUDA arrays and return CUDA arrays; the estimate and the pass run on the device."""
    from numba import cuda

    def on_device(tree: Any) -> Any:
        return nba.tree_map(lambda x: cuda.to_device(np.asarray(x)), tree)

    def host(tree: Any) -> Any:
        return nba.tree_map(lambda x: x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x), tree)

    def callbacks(device: bool) -> dict:
        back = on_device if device else (lambda t: t)
        if how == "hvp_fn":
            return {"hvp_fn": lambda p, v: back({"x": _hvp(host(p)["x"], host(v)["x"], False)})}
        return {"grad_fn": lambda p: back({"x": _grad(host(p)["x"], False)})}

    x0 = np.random.default_rng(8).standard_normal(N)
    tx_cpu, tx_gpu = (nba.sophia(0.05, update_interval=2) for _ in range(2))
    p = {"x": x0.copy()}
    s_cpu, s_gpu = tx_cpu.init(p), tx_gpu.init(on_device(p))
    for _ in range(5):
        g = {"x": _grad(p["x"], False)}
        u_cpu, s_cpu = tx_cpu.update(g, s_cpu, p, **callbacks(False))
        u_gpu, s_gpu = tx_gpu.update(on_device(g), s_gpu, on_device(p), **callbacks(True))
        assert hasattr(u_gpu["x"], "copy_to_host")
        np.testing.assert_allclose(host(u_gpu)["x"], u_cpu["x"], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(nba.to_host(s_gpu[0].nu).tree["x"], s_cpu[0].nu.tree["x"], rtol=1e-12)
        p = nba.apply_updates(p, u_cpu)
