"""lookahead (numbaccum.lookahead) against optax: the same params bit for bit, wrapped around
our optimizers; update and step_ alike; what a user gets wrong. Every transformation of the
registry (tests/registry.py) as the fast optimizer, against optax.lookahead's arithmetic around
it run alone; the params the fast optimizer sees, against optax's; CUDA params."""

from __future__ import annotations

import numpy as np
import pytest
from _testutil import assert_tree_equal, require, watch_declarations
from registry import CASES, OWN_TESTS, sweep

import numbaccum as nba

CONFIGS = {
    "adam_sync3": lambda m: m.lookahead(m.adam(0.1), sync_period=3, slow_step_size=0.5),
    "sgd_momentum_reset": lambda m: m.lookahead(m.sgd(0.1, momentum=0.9), 2, 0.3, reset_state=True),
    "clip_every_step": lambda m: m.lookahead(m.chain(m.clip_by_global_norm(1.0), m.sgd(0.05)), 1, 0.8),
}


def _params(rng):
    return {"a": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_optax_and_step_matches_update(name):
    jax, optax = require("jax"), require("optax")
    rng = np.random.default_rng(0)
    p0 = _params(rng)
    ours, stepped, theirs = CONFIGS[name](nba), CONFIGS[name](nba), CONFIGS[name](optax)
    pn = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    ps = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    po = optax.LookaheadParams.init_synced(jax.tree.map(jax.numpy.asarray, p0))
    sn, ss, so = ours.init(pn), stepped.init(ps), theirs.init(po)
    for _ in range(7):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in p0.items()}
        un, sn = ours.update(g, sn, pn)
        pn = nba.apply_updates(pn, un)
        ss = nba.step_(stepped, g, ss, ps)
        uo, so = theirs.update(g, so, po)
        po = optax.apply_updates(po, uo)
        assert_tree_equal(ps, pn)
        assert int(sn.steps_since_sync) == int(so.steps_since_sync)
    for a, b in zip(nba.tree_flatten(pn)[0], jax.tree.leaves(po)):
        if "clip" in name:  # the global norm: float64 here, float32 in optax
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(a, np.asarray(b))


def test_the_slow_params_move_only_at_a_synchronisation():
    tx = nba.lookahead(nba.sgd(0.1), sync_period=3, slow_step_size=0.5)
    params = nba.LookaheadParams.init_synced({"w": np.ones(2)})
    state = tx.init(params)
    slow = []
    for _ in range(6):
        state = nba.step_(tx, {"w": 2 * params.fast["w"]}, state, params)
        slow.append(params.slow["w"][0])
    assert slow[0] == slow[1] == 1.0 and slow[2] < 1.0 and slow[3] == slow[4] == slow[2] and slow[5] < slow[2]
    assert params.slow["w"] is not params.fast["w"]  # init_synced copies: in-place steps keep them apart


def test_errors_are_named_and_change_nothing():
    tx = nba.lookahead(nba.adam(0.1), 2, 0.5)
    params = nba.LookaheadParams.init_synced({"w": np.ones(2)})
    state = tx.init(params)
    before = nba.tree_map(np.copy, params)
    with pytest.raises(TypeError, match="needs a LookaheadParams"):
        tx.update({"w": np.ones(2)}, state, {"w": np.ones(2)})
    bad = nba.LookaheadParams(fast={"w": np.ones(2)}, slow={"w": np.ones(3)})
    with pytest.raises(ValueError, match="slow params must have the fast params"):
        nba.step_(tx, {"w": np.ones(2)}, state, bad)
    with pytest.raises(ValueError, match=r"tree structure mismatch|updates"):
        nba.step_(tx, {"v": np.ones(2)}, state, params)
    assert_tree_equal(params, before)
    with pytest.raises(ValueError, match="sync_period"):
        nba.lookahead(nba.sgd(0.1), 0, 0.5)
    with pytest.raises(TypeError, match="slow_step_size"):
        nba.lookahead(nba.sgd(0.1), 2, "0.5")


def test_checkpoint_round_trip(tmp_path):
    tx = nba.lookahead(nba.adam(0.1), 3, 0.5)
    params = nba.LookaheadParams.init_synced({"w": np.linspace(-1, 1, 4)})
    state = tx.init(params)
    for _ in range(2):
        state = nba.step_(tx, {"w": params.fast["w"].copy()}, state, params)
    nba.save_state(tmp_path / "s.npz", state)
    again = nba.load_state(tmp_path / "s.npz", like=tx.init(params))
    p1, p2 = nba.tree_map(np.copy, params), nba.tree_map(np.copy, params)
    nba.step_(tx, {"w": np.ones(4)}, state, nba.LookaheadParams(*p1))
    nba.step_(tx, {"w": np.ones(4)}, again, nba.LookaheadParams(*p2))
    assert_tree_equal(p1, p2)


# --- every fast optimizer of the registry ------------------------------------------------------

# The registry's Cases lookahead cannot wrap, with the reason (every other Case is a fast optimizer).
CANNOT_WRAP = {
    name: "per-example updates: a leading batch dimension, not the fast params' shapes"
    for name, case in CASES.items()
    if case.per_example
}
FAST_OPTIMIZERS = sorted(set(CASES) - set(CANNOT_WRAP))
SYNC_PERIOD, SLOW_STEP_SIZE, N_STEPS = 3, 0.25, 7


def _reference_step(tx, g, state, fast, slow, i, reset_state, extra):
    """Step ``i`` of optax.lookahead's arithmetic around ``tx``, a standalone instance of the fast
    optimizer, given the fast params (as optax gives them) and the ``extra`` arguments of the
    update: ``((fast, slow), fast state)`` after it."""
    u, new_state = tx.update(g, state, fast, **extra)
    u = nba.tree_map(np.asarray, u)
    if i % SYNC_PERIOD != SYNC_PERIOD - 1:
        return (nba.apply_updates(fast, u), nba.tree_map(np.copy, slow)), new_state
    d = nba.tree_map(lambda f, v, s: f + v - s, fast, u, slow)
    slow_u = nba.tree_map(lambda x: x.dtype.type(SLOW_STEP_SIZE) * x, d)
    fast_u = nba.tree_map(lambda v, x: v - x.dtype.type(1.0 - SLOW_STEP_SIZE) * x, u, d)
    if reset_state:  # optax: init of the fast params the step was given
        new_state = tx.init(nba.tree_map(np.copy, fast))
    return (nba.apply_updates(fast, fast_u), nba.apply_updates(slow, slow_u)), new_state


def _check_against_the_reference(make, p0, grad_of, extra_of, reset_state):
    """`N_STEPS` of lookahead around ``make()``, by update + apply_updates and by step_, against
    `_reference_step`: the same fast and slow params bit for bit after every step. The
    gradients (``grad_of``) and extra arguments (``extra_of``) of each step are functions of
    the step and the fast params."""
    tx = make()
    fast, slow = nba.tree_map(np.copy, p0), nba.tree_map(np.copy, p0)
    state = tx.init(fast)
    updated, stepped = (
        nba.lookahead(make(), SYNC_PERIOD, SLOW_STEP_SIZE, reset_state=reset_state) for _ in range(2)
    )
    pu = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    ps = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    su, ss = updated.init(pu), stepped.init(ps)
    for i in range(N_STEPS):
        (fast, slow), state = _reference_step(
            tx, grad_of(i, fast), state, fast, slow, i, reset_state, extra_of(fast)
        )
        u, su = updated.update(grad_of(i, pu.fast), su, pu, **extra_of(pu.fast))
        pu = nba.apply_updates(pu, u)
        ss = nba.step_(stepped, grad_of(i, ps.fast), ss, ps, **extra_of(ps.fast))
        for how, p in (("update", pu), ("step_", ps)):
            assert_tree_equal(p.fast, fast, msg=f"step {i} ({how}) fast")
            assert_tree_equal(p.slow, slow, msg=f"step {i} ({how}) slow")
        assert int(su.steps_since_sync) == int(ss.steps_since_sync) == (i + 1) % SYNC_PERIOD
    return ps


def _no_extra(params):
    return {}


@pytest.mark.parametrize("name", sweep(FAST_OPTIMIZERS))  # every Case in the exhaustive step
def test_every_fast_optimizer_of_the_registry(name):
    """lookahead around each registry Case on a tree of two dtype groups (each group of the pair
    holds the fast leaves then the slow ones), reset_state on every other Case."""
    rng = np.random.default_rng(3)
    p0 = {
        "a": rng.normal(size=(3, 2)).astype(np.float32),  # a matrix: the factored, per-row stages
        "b": rng.normal(size=3).astype(np.float64),
        "c": rng.normal(size=4).astype(np.float32),
    }
    grads = [nba.tree_map(lambda x: rng.normal(size=x.shape).astype(x.dtype), p0) for _ in range(N_STEPS)]
    reset = FAST_OPTIMIZERS.index(name) % 2 == 1
    _check_against_the_reference(CASES[name].make, p0, lambda i, fast: grads[i], _no_extra, reset)


# The registry's transformations that its Case-driven tests cannot drive (`registry.OWN_TESTS`: an
# update needs extra arguments, or leaves of one dtype), driven here on the quadratic objective
# 0.5 sum(w p^2) at the fast params, with the extra arguments each update takes from it.
_W = {"a": np.linspace(0.5, 2.0, 6).reshape(3, 2), "c": np.linspace(1.0, 3.0, 4)}


def _value_and_grad(p):
    return float(sum(0.5 * np.sum(_W[k] * p[k] ** 2) for k in _W)), {k: _W[k] * p[k] for k in _W}


def _objective(p):
    return {"value": _value_and_grad(p)[0]}


def _line_search(p):
    value, grad = _value_and_grad(p)
    return {"value": value, "grad": grad, "value_fn": _value_and_grad}


def _hvp(p):
    return {"hvp_fn": lambda params, v: {k: _W[k] * v[k] for k in _W}}


DRIVEN = {
    "scale_by_polyak": (lambda: nba.scale_by_polyak(max_learning_rate=0.5), _objective),
    "polyak_sgd": (lambda: nba.polyak_sgd(0.5), _objective),
    "lbfgs": (lambda: nba.lbfgs(memory_size=3), _line_search),
    "scale_by_zoom_linesearch": (lambda: nba.scale_by_zoom_linesearch(5), _line_search),
    "scale_by_backtracking_linesearch": (lambda: nba.scale_by_backtracking_linesearch(5), _line_search),
    "reduce_on_plateau": (
        lambda: nba.chain(nba.sgd(0.1), nba.reduce_on_plateau(patience=1, cooldown=0)),
        _objective,
    ),
    "hutchinson_estimator_diag_hessian": (lambda: nba.hutchinson_estimator_diag_hessian(5), _hvp),
    "flatten": (lambda: nba.flatten(nba.adamw(1e-2, weight_decay=0.1)), _no_extra),
}
# Of registry.OWN_TESTS, what lookahead cannot wrap, with the reason.
OWN_CANNOT_WRAP = {"lookahead": "its updates are a (fast, slow) pair: twice the fast params' leaves"}


def test_every_transformation_of_the_registry_is_driven_or_excluded():
    assert set(DRIVEN) | set(OWN_CANNOT_WRAP) == set(OWN_TESTS)
    assert set(FAST_OPTIMIZERS) | set(CANNOT_WRAP) == set(CASES)


@pytest.mark.parametrize("name", sorted(DRIVEN))
def test_fast_optimizers_with_extra_arguments(name):
    """lookahead passes each update's extra arguments to the fast optimizer, which evaluates the
    objective at the fast params (float64, one dtype group: `flatten` takes no other)."""
    make, extra_of = DRIVEN[name]
    p0 = {"a": np.linspace(-1.0, 1.5, 6).reshape(3, 2), "c": np.linspace(2.0, -1.0, 4)}
    reset = sorted(DRIVEN).index(name) % 2 == 1
    moved = _check_against_the_reference(make, p0, lambda i, fast: _value_and_grad(fast)[1], extra_of, reset)
    assert not np.array_equal(moved.fast["a"], p0["a"])


def test_what_lookahead_cannot_wrap_is_refused_by_name():
    inner = nba.lookahead(nba.sgd(0.1), SYNC_PERIOD, SLOW_STEP_SIZE)
    for fast in [CASES[name].make() for name in CANNOT_WRAP] + [inner]:
        with pytest.raises(TypeError, match="must not change the updates' shape"):
            nba.lookahead(fast, SYNC_PERIOD, SLOW_STEP_SIZE)


# --- the params the fast optimizer sees, against optax -------------------------------------------


def _recording(lib, seen, step):
    """A transformation of ``lib`` (numbaccum or optax) that notes the params its init and update
    are given, by the step (``step[0]``), then returns the updates as they are."""

    def note(kind, params):
        seen[step[0], kind] = {k: np.array(v) for k, v in params.items()}

    def init(params):
        note("init", params)
        return lib.EmptyState()

    def update(updates, state, params=None):
        note("update", params)
        return updates, state

    return lib.GradientTransformation(init, update)


@pytest.mark.parametrize("reset_state", [False, True])
def test_the_fast_optimizer_sees_the_fast_params_as_in_optax(reset_state):
    """Its init and update get the fast params before the step, the same values as optax's: at
    init, every update and each synchronisation's reset (optax inits at every step and keeps
    the new state only at a synchronisation; numbaccum inits only there)."""
    jax, optax = require("jax"), require("optax")
    rng = np.random.default_rng(5)
    p0 = _params(rng)
    step, seen_ours, seen_theirs = [0], {}, {}
    ours = nba.lookahead(nba.chain(_recording(nba, seen_ours, step), nba.sgd(0.1)), 2, 0.5, reset_state)
    theirs = optax.lookahead(
        optax.chain(_recording(optax, seen_theirs, step), optax.sgd(0.1)), 2, 0.5, reset_state
    )
    pn = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    po = optax.LookaheadParams.init_synced(jax.tree.map(jax.numpy.asarray, p0))
    sn, so = ours.init(pn), theirs.init(po)
    for step[0] in range(1, 6):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in p0.items()}
        sn = nba.step_(ours, g, sn, pn)
        uo, so = theirs.update(g, so, po)
        po = optax.apply_updates(po, uo)
    resets = [(i, "init") for i in (2, 4)] if reset_state else []
    assert sorted(seen_ours) == sorted([(0, "init")] + [(i, "update") for i in range(1, 6)] + resets)
    for key, params in seen_ours.items():
        assert_tree_equal(params, seen_theirs[key], msg=str(key))
    assert not np.array_equal(seen_ours[5, "update"]["a"], seen_ours[4, "update"]["a"])  # they moved


# Cases that read the params each step (weight decay, trust ratios, schedule-free's interpolation)
# or at init (DoG's distance, with reset_state): against optax's lookahead around optax's own.
READS_PARAMS = ["adamw", "lamb", "schedule_free_adamw", "scale_by_distance_over_gradients"]


@pytest.mark.parametrize("name", READS_PARAMS)
def test_params_reading_fast_optimizers_match_optax(name):
    jax, optax = require("jax"), require("optax")
    reset = name == "scale_by_distance_over_gradients"
    ours = nba.lookahead(CASES[name].make(), SYNC_PERIOD, SLOW_STEP_SIZE, reset)
    theirs = optax.lookahead(CASES[name].optax(optax), SYNC_PERIOD, SLOW_STEP_SIZE, reset)
    rng = np.random.default_rng(6)
    p0 = _params(rng)
    pn = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    po = optax.LookaheadParams.init_synced(jax.tree.map(jax.numpy.asarray, p0))
    sn, so = ours.init(pn), theirs.init(po)
    for i in range(N_STEPS):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in p0.items()}
        sn = nba.step_(ours, g, sn, pn)
        uo, so = theirs.update(g, so, po)
        po = optax.apply_updates(po, uo)
        for a, b in zip(nba.tree_flatten(pn)[0], jax.tree.leaves(po)):
            b = np.asarray(b)
            atol = 2e-6 * float(np.max(np.abs(b)))  # float32 rounding at the params' scale
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=atol, err_msg=f"step {i}")


# --- on the device ---------------------------------------------------------------------------------


@pytest.mark.cuda
def test_on_device_matches_the_host():
    """CUDA params (`init_synced` copies them on the device) around a fast optimizer that reads
    them: the host's fast and slow params within float32 rounding (a GPU contracts multiply-adds),
    by update + apply_updates and by step_, the slow params still CUDA arrays. (Updates were
    packed into a host buffer, and init_synced's np.copy brought the slow params to the host.)"""
    from numba import cuda

    make = CASES["adamw"].make
    rng = np.random.default_rng(8)
    p0 = _params(rng)
    on_host = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    stepped = nba.LookaheadParams.init_synced(nba.tree_map(cuda.to_device, p0))
    updated = nba.LookaheadParams.init_synced(nba.tree_map(cuda.to_device, p0))
    assert all(type(x) is type(stepped.fast["a"]) for x in nba.tree_flatten(stepped)[0])
    txs = [nba.lookahead(make(), 2, SLOW_STEP_SIZE) for _ in range(3)]
    states = [txs[0].init(on_host), txs[1].init(stepped), txs[2].init(updated)]
    for _ in range(3):  # a synchronisation at the second
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in p0.items()}
        states[0] = nba.step_(txs[0], g, states[0], on_host)
        states[1] = nba.step_(txs[1], nba.tree_map(cuda.to_device, g), states[1], stepped)
        u, states[2] = txs[2].update(nba.tree_map(cuda.to_device, g), states[2], updated)
        updated = nba.apply_updates(updated, u)
        for p in (stepped, updated):
            assert type(p.slow["a"]) is type(stepped.fast["a"])
            for a, b in zip(nba.tree_flatten(nba.to_host(p))[0], nba.tree_flatten(on_host)[0]):
                np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * float(np.max(np.abs(b))))


# --- issue 43: lookahead declares a kept host step; a steady step plans nothing -------------------


def test_a_steady_step_plans_nothing_and_explain_shows_its_passes(monkeypatch):
    """lookahead(chain(clip, adamw)) declares one host step with the fast optimizer's plan kept
    inside: after warm-up no stage plans, step_ and update give the bits they gave while being
    declared (against a twin run side by side), and explain shows the fast plan's passes and
    the pair's (no opaque row)."""
    def make():
        return nba.lookahead(nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(0.05, weight_decay=0.1)), 2, 0.5)

    rng = np.random.default_rng(11)
    p0 = _params(rng)
    tx, twin = make(), make()
    a = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    b = nba.LookaheadParams.init_synced(nba.tree_map(np.copy, p0))
    sa, sb = tx.init(a), twin.init(b)
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in p0.items()} for _ in range(6)]
    for g in grads[:2]:  # both modes declared
        sa = nba.step_(tx, g, sa, a)
        u, sa = tx.update(g, sa, a)
        a = nba.apply_updates(a, u)
        sb = nba.step_(twin, g, sb, b)
        v, sb = twin.update(g, sb, b)
        b = nba.apply_updates(b, v)

    watch_declarations(monkeypatch)
    for g in grads[2:]:
        sa = nba.step_(tx, g, sa, a)
        u, sa = tx.update(g, sa, a)
        a = nba.apply_updates(a, u)
    monkeypatch.undo()
    for g in grads[2:]:
        sb = nba.step_(twin, g, sb, b)
        v, sb = twin.update(g, sb, b)
        b = nba.apply_updates(b, v)
    assert_tree_equal(a, b)
    plan = nba.explain(tx, a)
    assert "opaque" not in [q.kind for q in plan.passes]
    assert [q.stages[-1] for q in plan.passes][-1] == "lookahead (fast and slow updates)"
    assert plan.passes[0].stages == ("clip_by_global_norm (global norm)",)


def test_updates_kept_from_two_states_keep_their_values():
    """One lookahead, two models: the updates of each (a new buffer per update) stay what they
    were when the other model's update ran."""
    tx = nba.lookahead(nba.sgd(0.1, momentum=0.9), 2, 0.5)
    g_ones = {"w": np.ones(3, np.float32)}
    pa = nba.LookaheadParams.init_synced({"w": np.zeros(3, np.float32)})
    pb = nba.LookaheadParams.init_synced({"w": np.ones(3, np.float32)})
    sa, sb = tx.init(pa), tx.init(pb)
    ua, sa = tx.update(g_ones, sa, pa)
    kept = nba.tree_map(np.copy, ua)
    ub, sb = tx.update({"w": np.full(3, 5.0, np.float32)}, sb, pb)
    assert_tree_equal(ua, kept)
    assert not np.array_equal(ub.fast["w"], ua.fast["w"])


def test_a_raising_schedule_of_the_fast_optimizer_changes_nothing():
    """The fast optimizer's schedule raises in the tick: the fast state, the count since the
    sync and the params as they were, with update and with step_; then it goes on."""
    fail = [False]

    def lr(count):
        if fail[0]:
            raise ArithmeticError("the schedule's own error")
        return 0.1

    tx = nba.lookahead(nba.sgd(lr, momentum=0.9), 3, 0.5)
    params = nba.LookaheadParams.init_synced({"w": np.linspace(-1.0, 1.0, 5)})
    state = tx.init(params)
    for _ in range(2):
        state = nba.step_(tx, {"w": np.ones(5)}, state, params)
    before = [np.array(x, copy=True) for x in nba.tree_flatten((state, params))[0]]
    fail[0] = True
    with pytest.raises(ArithmeticError):
        nba.step_(tx, {"w": np.ones(5)}, state, params)
    with pytest.raises(ArithmeticError):
        tx.update({"w": np.ones(5)}, state, params)
    fail[0] = False
    after = [np.array(x, copy=True) for x in nba.tree_flatten((state, params))[0]]
    assert all(x.tobytes() == y.tobytes() for x, y in zip(before, after))
    state = nba.step_(tx, {"w": np.ones(5)}, state, params)  # the same state: still current
    assert int(state.steps_since_sync) == 0
