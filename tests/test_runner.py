"""The one runner (`numbaccum.runner`): plans made once, kept with their state, replayed.

A kept plan is a cache, and a cache is where wrong answers hide: each test here feeds the runner
what a user does between two steps (another state of the same transformation, a state made
again by ``init``, a loaded checkpoint, another tree shape, a stale state, a schedule that
raises, ``NUMBACCUM_FUSE`` changed, threads) and compares with a fresh transformation and state,
which cannot have a kept plan.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import reference as ref
from _testutil import watch_declarations

import numbaccum as nba
from numbaccum import runner
from numbaccum.base import stage_of


def _tree(seed: int, shapes=((3, 4), (5,))) -> dict:
    rng = np.random.default_rng(seed)
    return {f"l{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}


def _chain() -> object:
    return nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-2, weight_decay=0.1))


def _run(tx, params, grads_list, state=None):
    """The params after ``step_`` over ``grads_list`` from ``state`` (``tx.init`` if None)."""
    p = {k: v.copy() for k, v in params.items()}
    s = tx.init(p) if state is None else state
    for g in grads_list:
        s = nba.step_(tx, g, s, p)
    return p, s


def _fresh(params, grads_list):
    return _run(_chain(), params, grads_list)[0]


def _same(a: dict, b: dict) -> None:
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_a_replayed_step_declares_nothing(monkeypatch):
    tx, params = _chain(), _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = tx.init(p)
    s = nba.step_(tx, _tree(1), s, p)
    made = []
    real = runner.Plan.__init__

    def counting(self, *a, **k):
        made.append(1)
        real(self, *a, **k)

    monkeypatch.setattr(runner.Plan, "__init__", counting)
    for i in range(3):
        s = nba.step_(tx, _tree(2 + i), s, p)
    assert not made  # replayed: ticked, never declared again
    tx.update(_tree(9), tx.init(p), p)  # another state, and update's own plan: one more
    assert len(made) == 1  # (update and step_ share a state's plan)


def test_two_states_of_one_transformation_alternated_match_separate_runs():
    tx, params = _chain(), _tree(0)
    grads = [_tree(10 + i) for i in range(4)]
    pa = {k: v.copy() for k, v in params.items()}
    pb = {k: (v * 2).copy() for k, v in params.items()}
    sa, sb = tx.init(pa), tx.init(pb)
    for g in grads:  # A, B, A, B: each state's plan is its own
        sa = nba.step_(tx, g, sa, pa)
        sb = nba.step_(tx, g, sb, pb)
    _same(pa, _fresh(params, grads))
    _same(pb, _fresh({k: v * 2 for k, v in params.items()}, grads))


def test_the_same_step_again_skips_the_full_entry(monkeypatch):
    tx, params = _chain(), _tree(0)
    grads = [_tree(40 + i) for i in range(4)]
    p = {k: v.copy() for k, v in params.items()}
    s = nba.step_(tx, grads[0], tx.init(p), p)
    entered = []
    real = runner._step
    monkeypatch.setattr(runner, "_step", lambda *a: entered.append(1) or real(*a))
    for g in grads[1:]:
        s = nba.step_(tx, g, s, p)
    assert not entered  # the plan's tick checked the state; the entry was not run again
    _same(p, _fresh(params, grads))


def _as(form: str, tree: dict) -> object:
    return nba.FlatTree.from_tree(tree) if form == "flat" else {k: v.copy() for k, v in tree.items()}


@pytest.mark.parametrize("order", ["flat-dict", "dict-flat"])
def test_the_fast_entry_gives_the_full_entrys_bits_whatever_the_arguments_form(order):
    """Gradients and params switching between FlatTrees and dicts, ``update`` and ``step_``
    interleaved, on one transformation: the same bits as a new transformation at every call (no
    kept step to reuse)."""
    params, forms = _tree(0), order.split("-")
    grads = [_tree(50 + i) for i in range(8)]
    tx = _chain()
    p_kept, p_new = nba.FlatTree.from_tree(params), nba.FlatTree.from_tree(params)
    s_kept, s_new = tx.init(p_kept), tx.init(p_new)
    for i, g in enumerate(grads):
        gform, pform, how = forms[i % 2], forms[(i // 2) % 2], ("step", "update")[(i // 4) % 2]
        results = []
        for t, p, s in ((tx, p_kept, s_kept), (_chain(), p_new, s_new)):
            pp = p if pform == "flat" else p.tree
            gg = _as(gform, g)
            if how == "step":
                s = nba.step_(t, gg, s, pp)
            else:
                u, s = t.update(gg, s, pp)
                nba.apply_updates_(pp, u)
            results.append(s)
        s_kept, s_new = results
        for a, b in zip(p_kept.groups, p_new.groups):
            np.testing.assert_array_equal(a, b)


def test_wrong_arguments_after_replayed_steps_get_the_full_entrys_errors():
    tx, params = _chain(), _tree(0)
    p = nba.FlatTree.from_tree(params)
    s = tx.init(p)
    for i in range(2):
        s = nba.step_(tx, nba.FlatTree.from_tree(_tree(60 + i)), s, p)
    before = p.copy()
    bad_shape = _tree(7, shapes=((3, 4), (6,)))
    with pytest.raises(ValueError, match="shape"):
        nba.step_(tx, bad_shape, s, p)
    with pytest.raises(TypeError, match="dtype float64 does not match"):
        nba.step_(tx, _tree(8), s, {k: v.astype(np.float64) for k, v in p.tree.items()})
    frozen = p.tree
    frozen["l1"] = frozen["l1"].copy()
    frozen["l1"].flags.writeable = False
    with pytest.raises(TypeError, match="l1"):
        nba.step_(tx, _tree(9), s, frozen)
    for a, b in zip(p.groups, before.groups):
        np.testing.assert_array_equal(a, b)
    s = nba.step_(tx, _tree(10), s, p)  # the state is still current and runs
    fresh = nba.FlatTree.from_tree(params)
    t2 = _chain()
    s2 = t2.init(fresh)
    for g in (_tree(60), _tree(61), _tree(10)):
        s2 = nba.step_(t2, nba.FlatTree.from_tree(g), s2, fresh)
    for a, b in zip(p.groups, fresh.groups):
        np.testing.assert_array_equal(a, b)


def test_a_named_chain_state_edited_between_replayed_steps_is_checked():
    def make():
        return nba.named_chain(("clip", nba.clip_by_global_norm(1.0)), ("adam", nba.adam(1e-2)))

    tx, params = make(), _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = tx.init(p)
    for i in range(2):
        s = nba.step_(tx, _tree(70 + i), s, p)
    other = make().init(p)
    s["adam"] = other["adam"]  # the dict the last step returned, edited: the same object
    q = {k: v.copy() for k, v in p.items()}
    s = nba.step_(tx, _tree(72), s, p)
    fresh = make()
    nba.step_(fresh, _tree(72), {"clip": other["clip"], "adam": fresh.init(q)["adam"]}, q)
    _same(p, q)  # the edited state's own buffers, not the kept plan's


def test_a_state_made_again_by_init_or_loaded_from_a_checkpoint_gets_a_new_plan(tmp_path):
    tx, params = _chain(), _tree(0)
    grads = [_tree(20 + i) for i in range(3)]
    p, s = _run(tx, params, grads[:2])
    nba.save_state(tmp_path / "s.npz", s)
    loaded = nba.load_state(tmp_path / "s.npz")
    p2 = {k: v.copy() for k, v in p.items()}
    nba.step_(tx, grads[2], loaded, p2)
    _same(p2, _fresh(params, grads))
    again = {k: v.copy() for k, v in params.items()}
    s0 = tx.init(again)  # new buffers for the same transformation
    for g in grads:
        s0 = nba.step_(tx, g, s0, again)
    _same(again, _fresh(params, grads))


def test_a_stateless_chain_fed_two_tree_shapes_alternately():
    tx = nba.chain(nba.clip_by_global_norm(0.5), nba.scale(-0.1))
    a, b = _tree(1), _tree(2, shapes=((7,), (2, 2), (3,)))
    for _ in range(2):
        for g in (a, b):
            u, _ = tx.update(g, tx.init(g))
            fresh = nba.chain(nba.clip_by_global_norm(0.5), nba.scale(-0.1))
            v, _ = fresh.update(g, fresh.init(g))
            _same(u, v)


def test_changing_fuse_between_steps_keeps_the_bits(monkeypatch):
    tx, params = _chain(), _tree(0)
    grads = [_tree(30 + i) for i in range(4)]
    p = {k: v.copy() for k, v in params.items()}
    s = tx.init(p)
    for i, g in enumerate(grads):
        monkeypatch.setenv("NUMBACCUM_FUSE", "0" if i % 2 else "1")
        s = nba.step_(tx, g, s, p)
    monkeypatch.delenv("NUMBACCUM_FUSE")
    _same(p, _fresh(params, grads))


def test_a_stale_state_is_refused_on_a_replayed_plan():
    tx, params = _chain(), _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s0 = tx.init(p)
    s1 = nba.step_(tx, _tree(1), s0, p)
    nba.step_(tx, _tree(2), s1, p)
    with pytest.raises(ValueError, match="stale"):
        nba.step_(tx, _tree(3), s1, p)


def test_a_wrong_state_after_a_kept_plan_gets_the_clear_error():
    tx, params = _chain(), _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = nba.step_(tx, _tree(1), tx.init(p), p)
    sgdw = nba.chain(nba.trace(0.9), nba.add_decayed_weights(0.1), nba.scale(-0.01))
    other = nba.chain(nba.clip_by_global_norm(1.0), sgdw).init(p)  # the same shape of states
    before = {k: v.copy() for k, v in p.items()}
    with pytest.raises(TypeError, match="expected ScaleByAdamState, got TraceState"):
        nba.step_(tx, _tree(2), other, p)
    _same(p, before)
    nba.step_(tx, _tree(2), s, p)  # the right state still runs


def test_a_schedule_that_raises_on_a_replayed_step_writes_nothing():
    calls = []

    def lr(count):
        calls.append(int(count))
        if int(count) == 2:
            raise RuntimeError("schedule broke")
        return 0.1

    tx = nba.chain(nba.trace(0.9), nba.scale_by_learning_rate(lr))
    params = _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = tx.init(p)
    for i in range(2):
        s = nba.step_(tx, _tree(i), s, p)
    kept_p = {k: v.copy() for k, v in p.items()}
    kept_trace = s[0].trace.copy()
    with pytest.raises(RuntimeError, match="schedule broke"):
        nba.step_(tx, _tree(5), s, p)
    _same(p, kept_p)
    for a, b in zip(s[0].trace.groups, kept_trace.groups):
        np.testing.assert_array_equal(a, b)


def test_a_skipped_step_keeps_the_later_states_and_the_params():
    tx = nba.chain(nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.adam(1e-2))
    params = _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = nba.step_(tx, _tree(1), tx.init(p), p)
    bad = _tree(2)
    bad["l0"][0, 0] = np.nan
    before = {k: v.copy() for k, v in p.items()}
    s2 = nba.step_(tx, bad, s, p)
    _same(p, before)
    assert bool(s2[0].skipped) and int(s2[1][0].count) == 1
    s3 = nba.step_(tx, _tree(3), s2, p)  # the kept state is current: it goes on
    assert int(s3[1][0].count) == 2


def test_plans_of_a_stateless_chain_are_bounded_and_per_thread():
    tx = nba.chain(nba.clip(0.5), nba.scale(2.0))
    stage = stage_of(tx)
    for n in range(1, 40):
        g = {"a": np.ones(n, np.float32)}
        tx.update(g, tx.init(g))
    assert len(runner._plans(stage, None)) <= max(nba._config.KEPT_LAYOUTS, 2)
    errors = []

    def worker(seed: int) -> None:
        try:
            for i in range(30):
                g = _tree(seed + i, shapes=((seed % 5 + 1,), (3,)))
                u, _ = tx.update(g, tx.init(g))
                expect = {k: np.clip(v, -0.5, 0.5) * np.float32(2.0) for k, v in g.items()}
                _same(u, expect)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_explain_shows_the_plan_the_runner_replays(monkeypatch):
    """One kernel per fused pass: the passes `explain` lists are the kernels a step launches."""
    from numbaccum.cpu import driver

    tx, params = _chain(), _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = nba.step_(tx, _tree(1), tx.init(p), p)
    launched = []
    monkeypatch.setattr(driver, "observers", [lambda f: launched.append(f.name)])
    nba.step_(tx, _tree(2), s, p)
    assert len(launched) == 1 and launched[0].startswith("fused_")  # (the reduction: the engine)
    shown = nba.explain(tx, p, apply=True)
    assert [x.kind for x in shown.passes] == ["reduction", "fused"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: _chain(),
        lambda: nba.MultiSteps(nba.adam(1e-3), 2),
        lambda: nba.lamb(1e-3),
        lambda: nba.chain(nba.stateless(lambda u, p: u), nba.adafactor(1e-2)),
    ],
    ids=["chain", "multisteps", "lamb", "user_code_then_adafactor"],
)
def test_explain_of_a_state_describes_its_kept_plan_and_declares_nothing(make, monkeypatch):
    """issue 43: `explain` given a state is that state's kept plan describing itself (the plan the
    next update replays, ticked): nothing is declared for it, and the update after it still
    replays the same plan."""
    tx, params = make(), _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = tx.init(p)
    for k in range(2):
        s = nba.step_(tx, _tree(1 + k), s, p)
        _, s = tx.update(_tree(3 + k), s, p)
    declared = watch_declarations(monkeypatch, [])
    shown = nba.explain(tx, p, s)
    _, s = tx.update(_tree(5), s, p)
    assert declared == [] and shown.passes
    assert all(x.kind != "opaque" or x.stages == ("Foreign",) for x in shown.passes)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_an_empty_chain_is_the_identity_and_explains_its_copy(fused, monkeypatch):
    """optax's ``chain()`` is the identity: ``update`` returns the updates (in a buffer of its
    own), ``step_`` adds them, and `explain` shows the one copy (it raised IndexError)."""
    monkeypatch.setenv("NUMBACCUM_FUSE", fused)
    tx = nba.chain()
    params = _tree(0)
    grads = _tree(1)
    u, s = tx.update(grads, tx.init(params), params)
    for k in grads:
        np.testing.assert_array_equal(u[k], grads[k])
        assert not np.shares_memory(u[k], grads[k])
    p = {k: v.copy() for k, v in params.items()}
    nba.step_(tx, grads, s, p)
    for k in grads:
        np.testing.assert_array_equal(p[k], params[k] + grads[k])
    assert [x.kind for x in nba.explain(tx, params).passes] == ["settle"]
    assert [x.kind for x in nba.explain(tx, params, apply=True).passes] == ["apply"]


@pytest.mark.parametrize("declared", [True, False])
def test_a_nested_chain_skipped_by_its_clip_keeps_its_state_shape(declared):
    """A clip that skips from inside a nested chain: the nested chain's state keeps its shape
    (the clip's new state, the later stages' as they were), declared or planned each step."""
    inner = nba.chain(nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.adam(1e-2))
    last = nba.scale(1.0) if declared else nba.masked(nba.scale(1.0), {"l0": True, "l1": False})
    tx = nba.chain(inner, last)
    params = _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = nba.step_(tx, _tree(1), tx.init(p), p)
    bad = _tree(2)
    bad["l1"][0] = np.inf
    u, s2 = tx.update(bad, s, p)
    assert all(np.all(v == 0) for v in u.values())
    assert len(s2) == 2 and len(s2[0]) == 2 and bool(s2[0][0].skipped)
    assert int(s2[0][1][0].count) == 1  # adam's count: the skipped step did not advance it
    s3 = nba.step_(tx, _tree(3), s2, p)  # and the next step takes it
    assert int(s3[0][1][0].count) == 2


def test_a_chain_of_one_keeps_its_tuple_state():
    """A chain of one stage returns a state of one (not the stage's state), step after step."""
    p = {"w": np.ones(3, np.float32)}
    tx = nba.chain(nba.ema(0.9))
    s = tx.init(p)
    for _ in range(3):
        _, s = tx.update(p, s, p)
        assert isinstance(s, tuple) and len(s) == 1 and isinstance(s[0], nba.EmaState)


def _stages(obj: object, seen: set | None = None) -> list:
    """Every `Stage` reachable from ``obj`` through attributes, lists, tuples and dicts."""
    from numbaccum.base import Stage

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        return [s for x in obj for s in _stages(x, seen)]
    if isinstance(obj, dict):
        return [s for x in obj.values() for s in _stages(x, seen)]
    if not isinstance(obj, Stage):
        return []
    return [obj] + [s for k, v in vars(obj).items() if k != "_kept" for s in _stages(v, seen)]


@pytest.mark.parametrize(
    "make",
    [
        _chain,
        lambda: nba.scale(2.0),
        lambda: nba.ema(0.9),
        lambda: nba.MultiSteps(nba.adam(1e-2), 2).gradient_transformation(),
        lambda: nba.chain(nba.masked(nba.trace(0.9), {"l0": True, "l1": False}), nba.sgd(0.1)),
        lambda: nba.inject_hyperparams(nba.adamw)(learning_rate=1e-2),
    ],
    ids=["clip-adamw", "scale", "ema", "multisteps", "masked", "inject"],
)
def test_a_transformation_does_not_change_after_construction(make):
    """Transformations may be shared by threads: what a stage remembers between calls (kept
    buffers and plans, the last layout and spec) lives per thread (`Stage.local`); every other
    attribute of every stage stays what construction made it, through update, step_ and explain
    on two tree shapes."""
    tx = make()
    stages = _stages(stage_of(tx))
    before = [{k: v for k, v in vars(s).items() if k != "_kept"} for s in stages]
    for shapes in (((3, 4), (5,)), ((2, 2), (7,))):
        p, g = _tree(0, shapes), _tree(1, shapes)
        s = tx.init(p)
        u, s = tx.update(g, s, p)
        s = nba.step_(tx, g, s, p)
        nba.explain(tx, p)
        nba.step_(tx, nba.FlatTree.from_tree(g), s, nba.FlatTree.from_tree(p))
    after = [{k: v for k, v in vars(s).items() if k != "_kept"} for s in stages]
    assert len(after) == len(before)
    for b, a in zip(before, after):
        assert a.keys() == b.keys() and all(a[k] is b[k] for k in b), (sorted(a), sorted(b))


def _reference(expected, params, grads):
    """The params after ``expected`` (a `tests/reference.py` transformation) over ``grads``."""
    q = {k: v.copy() for k, v in params.items()}
    t = expected.init(q)
    for g in grads:
        u, t = expected.update(g, t, q)
        q = ref.apply_updates(q, u)
    return q


def _nested():
    inner = nba.named_chain(
        ("trace", nba.trace(0.9)), ("adam", nba.chain(nba.scale_by_adam(), nba.scale(-1e-2)))
    )
    return nba.chain(nba.identity(), inner, nba.chain())


def test_a_kept_plan_of_nested_chains_ticks_and_rebuilds_their_states():
    """The kept plan's tick and new state are written out once for the nest (`fuse.flat_tick`,
    `fuse.new_state_maker`): nested tuples, a named chain's dict and an empty chain come back
    as the chains build them, and the params get the leaf-by-leaf reference's bits, step
    after step."""
    params, grads = _tree(0), [_tree(80 + i) for i in range(4)]
    p, s = _run(_nested(), params, grads)
    expected = ref.chain(ref.identity(), ref.trace(0.9), ref.scale_by_adam(), ref.scale(-1e-2))
    _same(p, _reference(expected, params, grads))
    assert type(s) is tuple and len(s) == 3 and s[2] == ()
    assert isinstance(s[1], dict) and list(s[1]) == ["trace", "adam"]
    assert type(s[1]["adam"]) is tuple and len(s[1]["adam"]) == 2
    assert int(s[1]["adam"][0].count) == len(grads)


@pytest.mark.parametrize("edit", ["tuple for dict", "short tuple", "named tuple", "other keys"])
def test_a_nested_state_of_the_wrong_shape_after_kept_steps_gets_the_full_entrys_error(edit):
    tx, params = _nested(), _tree(0)
    p = {k: v.copy() for k, v in params.items()}
    s = tx.init(p)
    for i in range(2):
        s = nba.step_(tx, _tree(90 + i), s, p)
    inner = s[1]
    wrong = {
        "tuple for dict": (inner["trace"], inner["adam"]),
        "short tuple": {"trace": inner["trace"], "adam": inner["adam"][:1]},
        "named tuple": {"trace": inner["trace"], "adam": nba.EmptyState()},
        "other keys": {"trace": inner["trace"], "adamw": inner["adam"]},
    }[edit]
    before = {k: v.copy() for k, v in p.items()}
    with pytest.raises((TypeError, ValueError)):
        nba.step_(tx, _tree(92), (s[0], wrong, s[2]), p)
    _same(p, before)  # nothing written
    s = nba.step_(tx, _tree(92), s, p)  # the state itself still steps


@pytest.mark.parametrize("lr", [1e-2, 0.1 + 1e-9])
def test_scalars_reach_a_replayed_launch_as_the_first_call_cast_them(lr):
    """After its first call a prepared launch passes the scalars as the ticks give them (Python
    floats, float32 bias corrections) and the compiled function converts them: in a group whose
    call computes in float64 (a float64 accumulator) beside float32 Adam, each value must still
    be rounded once to its formula's dtype, as the leaf-by-leaf reference rounds it."""
    tx = nba.chain(nba.trace(0.9, accumulator_dtype=np.float64), nba.scale_by_adam(), nba.scale(-lr))
    expected = ref.chain(ref.trace(0.9, accumulator_dtype=np.float64), ref.scale_by_adam(), ref.scale(-lr))
    params, grads = _tree(3), [_tree(100 + i) for i in range(5)]
    p, _ = _run(tx, params, grads)
    _same(p, _reference(expected, params, grads))


# --- control nodes: the inner transformation's plan is declared once, kept by the node -------


def _control_nodes():
    mask = {"b": False, "w": True}
    return {
        "MultiSteps": lambda: nba.MultiSteps(nba.adam(1e-2), 2),
        "apply_every": lambda: nba.chain(nba.apply_every(2), nba.sgd(0.1)),
        "masked": lambda: nba.masked(nba.adam(1e-2), mask),
        "partition": lambda: nba.partition(
            {"a": nba.adam(1e-2), "b": nba.sgd(0.1, momentum=0.9)}, {"b": "b", "w": "a"}
        ),
        "conditionally_mask": lambda: nba.conditionally_mask(nba.adam(1e-2), lambda step: step % 2 == 0),
        "apply_if_finite": lambda: nba.apply_if_finite(nba.adam(1e-2), 2),
        "flatten": lambda: nba.flatten(nba.sgd(0.1, momentum=0.9)),
    }


@pytest.mark.parametrize("name", sorted(_control_nodes()))
def test_a_control_node_plans_nothing_at_a_steady_step(name, monkeypatch):
    """After the first steps, a control node's step ticks its kept plan and its inner's (no
    declaration of anything: `Stage.declare`), with the same bits as before (a reference run planned each
    step: MultiSteps, masked, ... planned their inner transformation on every call)."""
    make = _control_nodes()[name]
    params = {"b": np.ones(3, np.float32), "w": np.arange(8, dtype=np.float32).reshape(2, 4)}
    grads = [nba.tree_map(lambda x, i=i: (x + i) * 0.25, params) for i in range(6)]
    tx = make()
    p = nba.tree_map(np.copy, params)
    s = tx.init(p)
    for g in grads[:3]:
        s = nba.step_(tx, g, s, p)
    declared = watch_declarations(monkeypatch, [])
    for g in grads[3:]:
        s = nba.step_(tx, g, s, p)
        _, s = tx.update(g, s, p)
    assert declared == []
    assert all(q.kind != "opaque" for q in nba.explain(make(), params).passes)


def test_explain_never_changes_the_numbers_of_an_update_running_on_another_thread():
    """A state's kept plan is shared by the threads: `explain`'s tick writes the step's values
    (here scale_by_polyak's ``value``) where an update of that state on another thread reads
    them. Explain holds the state as a reader: it raises the update's "another thread" error
    while the update runs, and the update keeps its own numbers (it read explain's value)."""
    inside, go = threading.Event(), threading.Event()

    def wait(updates, state, params=None):
        if waiting:
            inside.set()
            assert go.wait(10)
        return updates, state

    waiting = False
    tx = nba.chain(nba.GradientTransformation(lambda p: (), wait), nba.trace(0.5), nba.scale_by_polyak())
    params = {"w": np.ones(3)}
    g = {"w": np.full(3, 2.0)}
    s = tx.init(params)
    _, s = tx.update(g, s, params, value=1.0)
    expect, _ = tx.update(g, nba.copy_state(s), params, value=3.0)
    waiting = True
    got: list = []
    worker = threading.Thread(target=lambda: got.append(tx.update(g, s, params, value=3.0)))
    worker.start()
    try:
        assert inside.wait(10)
        with pytest.raises(RuntimeError, match="another thread"):
            nba.explain(tx, params, s, value=100.0)
    finally:
        go.set()
        worker.join()
    np.testing.assert_array_equal(got[0][0]["w"], expect["w"])
    waiting = False
    assert nba.explain(tx, params, got[0][1], value=3.0).passes  # free again once it returned
