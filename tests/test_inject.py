"""inject_hyperparams: hyperparameters kept in the state, changed between steps, or scheduled;
the same updates as the plain factory built with the same values, and nothing compiled again."""

from __future__ import annotations

import numpy as np
import pytest
from _testutil import (
    assert_tree_equal,
    check_raising_update_commits_nothing,
    package_calls,
    raising_user_code,
    watch_declarations,
)

import numbaccum as nba


def _params(dtype=np.float32):
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 5)).astype(dtype),
        "b": rng.standard_normal(5).astype(dtype),
        "s": np.ones((), dtype),
    }


def _grads(i, dtype=np.float32):
    rng = np.random.default_rng(10 + i)
    return nba.tree_map(lambda x: rng.standard_normal(x.shape).astype(dtype), _params(dtype))


def _frozen(state):
    return [np.array(x, copy=True) for x in nba.tree_flatten(state)[0]]


def test_state_holds_the_hyperparameters_in_the_params_dtype():
    p = _params()
    opt = nba.inject_hyperparams(nba.adam)(learning_rate=0.1, b1=0.8)
    s = opt.init(p)
    assert isinstance(s, nba.InjectStatefulHyperparamsState) and int(s.count) == 0
    assert set(s.hyperparams) == {"learning_rate", "b1", "b2", "eps", "eps_root"}
    assert all(type(v) is np.float32 for v in s.hyperparams.values())  # optax casts to the params' dtype
    assert s.hyperparams["b1"] == np.float32(0.8)
    s64 = nba.inject_hyperparams(nba.adam)(learning_rate=0.1).init(_params(np.float64))
    assert type(s64.hyperparams["learning_rate"]) is np.float64
    fixed = nba.inject_hyperparams(nba.adam, hyperparam_dtype=np.float64)(learning_rate=0.1).init(p)
    assert type(fixed.hyperparams["learning_rate"]) is np.float64


def test_changing_the_learning_rate_between_steps():
    """Steps with lr 0.1 then 0.01 equal the plain adam built with each value, on one state."""
    p = _params()
    opt = nba.inject_hyperparams(nba.adam)(learning_rate=0.1)
    s = opt.init(p)
    plain_state = nba.adam(0.1).init(p)
    for i, lr in enumerate([0.1, 0.1, 0.01, 0.01, 0.5]):
        s.hyperparams["learning_rate"] = lr
        u, s = opt.update(_grads(i), s, p)
        h = {k: np.float32(v) for k, v in s.hyperparams.items()}
        plain = nba.adam(**h)
        pu, plain_state = plain.update(_grads(i), plain_state, p)
        assert_tree_equal(u, pu)
        assert s.hyperparams["learning_rate"] == np.float32(lr) and int(s.count) == i + 1


@pytest.mark.parametrize("door", ["update", "step_"])
def test_a_learning_rate_of_minus_zero_is_not_taken_for_zero(door):
    """-0.0 == 0.0 (and they hash alike), but sgd's update -lr * g is +0.0 for lr -0.0 and -0.0
    for 0.0 (optax's bits): the kept transformation of one zero must not serve the other. Params
    of -0.0 show the update's sign after step_ too (-0.0 + +0.0 is +0.0, -0.0 + -0.0 is -0.0)."""
    p, g = {"w": np.full(3, -0.0, np.float32)}, {"w": np.ones(3, np.float32)}
    tx = nba.inject_hyperparams(nba.sgd)(learning_rate=0.0)
    s = tx.init(p)
    for lr in [0.0, -0.0, 0.0, -0.0, 0.0]:
        s.hyperparams["learning_rate"] = lr
        want = -np.float32(lr) * g["w"]
        if door == "update":
            u, s = tx.update(g, s, p)
            got = u["w"]
        else:
            p["w"][:] = -0.0
            s = nba.step_(tx, g, s, p)
            got, want = p["w"], np.float32(-0.0) + want
        assert np.array_equal(np.signbit(got), np.signbit(want)), (door, lr, got)


def test_schedules_are_called_with_the_step_and_stored():
    p = _params(np.float64)
    sched = nba.linear_schedule(1.0, 0.0, 4)
    opt = nba.inject_hyperparams(nba.sgd)(learning_rate=sched, momentum=0.9)
    ref = nba.sgd(sched, momentum=0.9)
    s, rs = opt.init(p), ref.init(p)
    assert s.hyperparams["learning_rate"] == 1.0
    for i in range(5):
        s.hyperparams["learning_rate"] = 123.0  # a scheduled entry cannot be set: no effect
        u, s = opt.update(_grads(i, np.float64), s, p)
        ru, rs = ref.update(_grads(i, np.float64), rs, p)
        assert_tree_equal(u, ru)
        assert s.hyperparams["learning_rate"] == sched(i)
        assert int(s.hyperparams_states["learning_rate"].count) == i + 1


def test_a_new_learning_rate_compiles_nothing():
    from numba.core import event

    p = _params()
    opt = nba.inject_hyperparams(nba.adam)(learning_rate=0.1)
    s = opt.init(p)
    _, s = opt.update(_grads(0), s, p)  # warm: every kernel of this tree is compiled
    with event.install_recorder("numba:compile") as rec:
        for lr in (0.2, 0.05, 1e-4):
            s.hyperparams["learning_rate"] = lr
            _, s = opt.update(_grads(1), s, p)
    assert rec.buffer == []


def test_bad_values_raise_before_anything_is_written():
    p = _params()
    opt = nba.inject_hyperparams(nba.adam)(learning_rate=0.1)
    s = opt.init(p)
    _, s = opt.update(_grads(0), s, p)
    before = _frozen(s)
    s.hyperparams["b1"] = 1.5  # adam refuses a decay outside [0, 1]
    with pytest.raises(ValueError, match="b1"):
        opt.update(_grads(1), s, p)
    s.hyperparams["b1"] = np.float32(0.9)
    assert_tree_equal(_frozen(s), before)
    del s.hyperparams["b2"]
    with pytest.raises(ValueError, match="missing"):
        opt.update(_grads(1), s, p)
    with pytest.raises(TypeError, match="InjectStatefulHyperparamsState"):
        opt.update(_grads(1), nba.EmptyState(), p)


def test_static_args_and_bools():
    with pytest.raises(ValueError, match="static_args"):
        nba.inject_hyperparams(nba.sgd, static_args="nope")
    opt = nba.inject_hyperparams(nba.sgd)(learning_rate=0.1, momentum=0.9, nesterov=True)
    s = opt.init(_params())
    assert "nesterov" not in s.hyperparams  # a bool is not a hyperparameter to change

    def factory(learning_rate, fn):
        return nba.chain(nba.scale(fn(learning_rate)))

    opt = nba.inject_hyperparams(factory, static_args="fn")(learning_rate=0.5, fn=lambda x: 2 * x)
    s = opt.init(_params())
    assert set(s.hyperparams) == {"learning_rate"}
    u, _ = opt.update(_grads(0), s, _params())
    np.testing.assert_array_equal(u["b"], _grads(0)["b"] * np.float32(1.0))


def test_stateful_schedule_protocol():
    class Halving:
        def init(self):
            return np.int32(0)

        def update(self, state, **extra):
            return state + 1

        def __call__(self, state, **extra):
            return 1.0 / 2 ** int(state)

    p = _params(np.float64)
    opt = nba.inject_hyperparams(nba.scale)(step_size=Halving())
    s = opt.init(p)
    for i in range(3):
        u, s = opt.update(_grads(i, np.float64), s, p)
        np.testing.assert_array_equal(u["w"], _grads(i, np.float64)["w"] / 2**i)


def test_a_hyperparameter_of_the_wrong_shape_is_named_and_the_state_kept():
    """Issue 22: an array hyperparameter of shape (3,) raised NumPy's "can only convert an array
    of size 1 to a Python scalar", naming nothing."""
    p = _params()
    opt = nba.inject_hyperparams(nba.adam)(learning_rate=0.1)
    s = opt.init(p)
    _, s = opt.update(_grads(0), s, p)
    before = _frozen(s)
    for bad in (np.ones(3), np.ones((2, 2), np.float32), np.ones(0)):
        s.hyperparams["learning_rate"] = bad
        shape = str(bad.shape).replace("(", r"\(").replace(")", r"\)")
        with pytest.raises(
            ValueError,
            match=rf"state.hyperparams\['learning_rate'\]: an array of shape {shape}, "
            r"expected a scalar \(shape \(\)\)",
        ):
            opt.update(_grads(1), s, p)
        assert s.hyperparams["learning_rate"] is bad
    s.hyperparams["learning_rate"] = np.float32(0.1)
    assert_tree_equal(_frozen(s), before)
    opt.update(_grads(1), s, p)  # and it goes on
    with pytest.raises(ValueError, match=r"^b1: an array of shape \(3,\)"):
        nba.inject_hyperparams(nba.adam)(learning_rate=0.1, b1=np.full(3, 0.9))
    scheduled = nba.inject_hyperparams(nba.adam)(learning_rate=lambda count: np.full(2, 0.1))
    with pytest.raises(ValueError, match=r"learning_rate \(the schedule's value\): an array of shape \(2,\)"):
        scheduled.init(p)
    late = nba.inject_hyperparams(nba.adam)(
        learning_rate=lambda count: 0.1 if count == 0 else np.full(2, 0.1)
    )
    s = late.init(p)
    _, s = late.update(_grads(0), s, p)
    before = _frozen(s)
    with pytest.raises(ValueError, match=r"learning_rate \(the schedule's value\): an array of shape \(2,\)"):
        late.update(_grads(1), s, p)
    assert_tree_equal(_frozen(s), before)


# --- issue 23: inject_hyperparams is a stage: it fuses, and plans before anything is written ---


def _bits(tree):
    """Every array of a tree (a state: its FlatTrees' buffers too) as raw bytes."""
    return [np.asarray(x).tobytes() for x in nba.tree_flatten(tree)[0]]


def test_in_a_chain_the_inner_stages_fuse_with_the_clip_and_give_adamws_bits():
    """One fused run: the clip's reduction, then one pass with adamw's stages in it, the plan
    `explain` shows being exactly that of the chain with a plain adamw; and the same bits, with
    update and with step_, as that chain (adamw built from the state's float32 values)."""
    p = _params()
    tx = nba.chain(nba.clip_by_global_norm(5.0), nba.inject_hyperparams(nba.adamw)(learning_rate=1e-3))
    s = tx.init(p)
    plain = nba.chain(nba.clip_by_global_norm(5.0), nba.adamw(**s[1].hyperparams))
    plan = nba.explain(tx, p)
    assert str(plan) == str(nba.explain(plain, p))
    assert [q.kind for q in plan.passes] == ["reduction", "fused"]
    assert plan.passes[1].stages[:2] == ("clip_by_global_norm", "scale_by_adam")
    applied = nba.explain(tx, p, apply=True)
    assert [q.kind for q in applied.passes] == ["reduction", "fused"]
    assert applied.passes[1].stages[-1] == "apply to params"
    ps = plain.init(p)
    for i in range(4):
        g = nba.tree_map(lambda x: 3.0 * x, _grads(i)) if i == 2 else _grads(i)  # step 2 clips
        u, s = tx.update(g, s, p)
        v, ps = plain.update(g, ps, p)
        assert _bits(u) == _bits(v) and _bits(s[1].inner_state) == _bits(ps[1])
        assert int(s[1].count) == i + 1
    q, pq = _params(), _params()
    s, ps = tx.init(q), plain.init(pq)
    for i in range(4):
        s = nba.step_(tx, _grads(i), s, q)
        ps = nba.step_(plain, _grads(i), ps, pq)
        assert _bits(q) == _bits(pq) and _bits(s[1].inner_state) == _bits(ps[1])


class _Spy:
    """A user transformation that counts its updates (it is planned without being called)."""

    def __init__(self) -> None:
        self.calls = 0

    def tx(self):
        def update(u, s, params=None):
            self.calls += 1
            return u, s

        return nba.GradientTransformation(lambda p: nba.EmptyState(), update)


def _raising_after(n):
    def schedule(count):
        if int(count) >= n:
            raise ArithmeticError("the schedule's own error")
        return 0.1

    return schedule


@pytest.mark.parametrize(
    "bad",
    ["a string", "wrong shape", "schedule raises"],
)
def test_a_bad_hyperparameter_raises_before_an_earlier_stage_writes(bad):
    """chain(trace, inject(sgd)): the bad value raises while the chain plans, before the trace
    runs (a user transformation ahead of it is not even called), the trace's buffers as they
    were bit for bit, and the state goes on once the value is fixed (not stale)."""
    p = _params()
    lr = _raising_after(2) if bad == "schedule raises" else 0.1
    spy = _Spy()
    tx = nba.chain(spy.tx(), nba.trace(0.9), nba.inject_hyperparams(nba.sgd)(learning_rate=lr))
    twin = nba.chain(nba.trace(0.9), nba.sgd(0.1))
    s, ts = tx.init(p), twin.init(p)
    for i in range(2):
        _, s = tx.update(_grads(i), s, p)
        _, ts = twin.update(_grads(i), ts, p)
    if bad == "a string":
        s[2].hyperparams["learning_rate"] = "0.1"
        error = TypeError
    elif bad == "wrong shape":
        s[2].hyperparams["learning_rate"] = np.full(2, 0.1, np.float32)
        error = ValueError
    else:
        error = ArithmeticError
    before, calls = _bits(s), spy.calls
    with pytest.raises(error):
        tx.update(_grads(2), s, p)
    with pytest.raises(error):
        nba.step_(tx, _grads(2), s, _params())
    assert spy.calls == calls  # planned, never run
    assert _bits(s) == before
    if bad == "schedule raises":
        return  # it raises at every later step: nothing to go on with
    s[2].hyperparams["learning_rate"] = 0.1
    u, s = tx.update(_grads(2), s, p)  # the same state: still current
    v, ts = twin.update(_grads(2), ts, p)
    assert _bits(u) == _bits(v) and _bits(s[1]) == _bits(ts[0])


def test_a_skipping_clip_inside_keeps_the_states_whole():
    """A clip that skips the step inside the inner transformation: zeros, the inner state it
    says (the clip's record, the rest as it was), wrapped in the inject state; in a chain the
    stages after it keep theirs; and the next step goes on."""
    p = _params()

    def factory(learning_rate):
        return nba.chain(nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.sgd(learning_rate, momentum=0.9))

    nan = nba.tree_map(lambda x: np.full_like(x, np.nan), p)
    for tx in (
        nba.inject_hyperparams(factory)(learning_rate=0.1),
        nba.chain(nba.trace(0.5), nba.inject_hyperparams(factory)(learning_rate=0.1), nba.trace(0.5)),
    ):
        for step in (False, True):
            s = tx.init(p)
            _, s = tx.update(_grads(0), s, p)
            before = _bits(s)
            if step:
                s2 = nba.step_(tx, nan, s, _params())
            else:
                u, s2 = tx.update(nan, s, p)
                assert all(not np.any(x) for x in nba.tree_flatten(u)[0])
            inj = s2 if isinstance(s2, nba.InjectStatefulHyperparamsState) else s2[1]
            assert isinstance(inj, nba.InjectStatefulHyperparamsState) and int(inj.count) == 2
            assert bool(inj.inner_state[0].skipped)
            if not isinstance(s2, nba.InjectStatefulHyperparamsState):
                assert _bits(s2[2]) == _bits(s[2])  # the stage after it kept its state
            assert len(_bits(s2)) == len(before)
            tx.update(_grads(1), s2, p)  # goes on


def test_threads_share_one_transformation_and_its_kept_inner_ones():
    """Threads with a state each and learning rates of their own, on one transformation: each
    gets the bits of adam built with its values; the inner transformations kept stay few."""
    import threading

    from numbaccum.base import stage_of

    tx = nba.inject_hyperparams(nba.adam)(learning_rate=0.1)
    rates = [0.1, 0.01, 0.2, 0.05, 0.3, 0.001]
    errors: list = []

    def work(lr):
        try:
            p = _params()
            s = tx.init(p)
            s.hyperparams["learning_rate"] = lr
            plain = nba.adam(**{k: np.float32(v) for k, v in s.hyperparams.items()})
            ps = plain.init(p)
            for i in range(15):
                u, s = tx.update(_grads(i), s, p)
                v, ps = plain.update(_grads(i), ps, p)
                assert _bits(u) == _bits(v), f"lr {lr} step {i}"
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(lr,)) for lr in rates]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert 1 <= len(stage_of(tx).built) <= 4  # bounded, however many values were seen


# --- issue 43: inject_hyperparams declares its parts; a steady step plans nothing ---


def test_a_steady_step_plans_nothing_and_costs_what_the_plain_step_does(monkeypatch):
    """Values that come back (set between steps) reuse the declarations made for them: no stage
    plans, the bits are those of adam built with each value, and a steady step_ makes at most
    a few calls more than the plain adam's (its tick and the values' key)."""
    p, q = _params(), _params()
    tx = nba.inject_hyperparams(nba.adam)(learning_rate=0.1)
    s = tx.init(p)
    plains = {lr: nba.adam(**{**s.hyperparams, "learning_rate": np.float32(lr)}) for lr in (0.1, 0.01)}
    ps = plains[0.1].init(q)
    for i in range(4):  # both values declared, every kernel compiled
        lr = (0.1, 0.01)[i % 2]
        s.hyperparams["learning_rate"] = lr
        s = nba.step_(tx, _grads(i), s, p)
        ps = nba.step_(plains[lr], _grads(i), ps, q)
    assert _bits(p) == _bits(q)

    watch_declarations(monkeypatch)  # both values' declarations are kept
    box = [s, ps]
    for i in range(4, 8):
        lr = (0.1, 0.01)[i % 2]
        box[0].hyperparams["learning_rate"] = lr
        g = _grads(i)
        calls = package_calls(lambda: box.__setitem__(0, nba.step_(tx, g, box[0], p)))
        plain = package_calls(lambda: box.__setitem__(1, nba.step_(plains[lr], g, box[1], q)))
        assert _bits(p) == _bits(q) and _bits(box[0].inner_state) == _bits(box[1]), f"step {i}"
        assert calls <= plain + 8, (calls, plain)


def test_a_factory_whose_parts_change_with_the_values_is_declared_again():
    """The same state, transformations of other parts (a clip's kernel, or no pass at all) as
    the value crosses a threshold: the plan is declared again from the new one, and each step
    gives the bits of the factory built with its value, with update and with step_."""

    def factory(max_delta):
        return nba.chain(nba.trace(0.9), nba.clip(max_delta) if max_delta < 100 else nba.identity())

    values = [0.5, 0.5, 1e3, 0.25, 1e3, 1e3, 0.5]
    for step in (False, True):
        p, q = _params(), _params()
        tx = nba.inject_hyperparams(factory)(max_delta=0.5)
        s, ps = tx.init(p), factory(0.5).init(q)
        for i, v in enumerate(values):
            s.hyperparams["max_delta"] = v
            plain = factory(np.float32(v))
            g = nba.tree_map(lambda x: 3.0 * x, _grads(i))
            if step:
                s = nba.step_(tx, g, s, p)
                ps = nba.step_(plain, g, ps, q)
                assert _bits(p) == _bits(q), f"step {i}"
            else:
                u, s = tx.update(g, s, p)
                v_, ps = plain.update(g, ps, q)
                assert _bits(u) == _bits(v_), f"step {i}"
            assert _bits(s.inner_state) == _bits(ps) and int(s.count) == i + 1
    for v in (1e3, 0.5):  # explain: the plan of the state's values, whichever parts they make
        s.hyperparams["max_delta"] = v
        assert str(nba.explain(tx, p, s)) == str(nba.explain(factory(np.float32(v)), p))


def test_nested_inject_hyperparams_gives_each_steps_values():
    """An inject_hyperparams inside another's factory: the outer tick picks the inner
    transformation of its values, whose own tick picks the adam of the inner state's values (as
    in optax, the inner state's hyperparameters are the ones the inner update uses: the outer
    value only builds it); the bits are those of adam built with the inner state's values, as
    both change between steps."""

    def factory(learning_rate):
        return nba.inject_hyperparams(nba.adam)(learning_rate=learning_rate, b1=0.8)

    p = _params()
    tx = nba.inject_hyperparams(factory)(learning_rate=0.1)
    s = tx.init(p)
    plain_state = nba.adam(0.1, b1=0.8).init(p)
    for i, (lr, b1) in enumerate([(0.1, 0.8), (0.01, 0.8), (0.01, 0.5), (0.1, 0.5), (0.5, 0.8)]):
        s.hyperparams["learning_rate"] = lr
        s.inner_state.hyperparams["b1"] = b1
        u, s = tx.update(_grads(i), s, p)
        h = {k: np.float32(v) for k, v in s.inner_state.hyperparams.items()}
        pu, plain_state = nba.adam(**h).update(_grads(i), plain_state, p)
        assert _bits(u) == _bits(pu), f"step {i}"
        assert _bits(s.inner_state.inner_state) == _bits(plain_state)
        assert int(s.count) == i + 1 and int(s.inner_state.count) == i + 1
        assert s.hyperparams["learning_rate"] == np.float32(lr) and h["b1"] == np.float32(b1)


def test_two_models_on_one_transformation_keep_their_own_updates():
    """One inject_hyperparams transformation, two states with learning rates of their own (a
    GAN's two models): each model's updates are its own, kept ones too."""
    tx = nba.chain(nba.clip_by_global_norm(10.0), nba.inject_hyperparams(nba.sgd)(learning_rate=0.1))
    G = {"w": np.ones(3, np.float32)}
    D = {"w": np.ones(3, np.float32)}
    sg, sd = tx.init(G), tx.init(D)
    sd[1].hyperparams["learning_rate"] = 0.5
    kept = []
    for _ in range(2):
        ug, sg = tx.update({"w": np.ones(3, np.float32)}, sg, G)
        ud, sd = tx.update({"w": np.ones(3, np.float32)}, sd, D)
        kept += [ug, ud]
    for i, u in enumerate(kept):
        expected = np.float32(-0.1) if i % 2 == 0 else np.float32(-0.5)
        np.testing.assert_array_equal(u["w"], np.full(3, expected, np.float32))


def test_explain_shows_the_inner_passes_of_a_declared_inner_host():
    """Adafactor's axis passes (a declared host step) inside inject_hyperparams: explain
    describes them as it does the plain adafactor's, no opaque row."""
    p = {"w": np.zeros((6, 4), np.float32), "b": np.zeros(4, np.float32)}
    tx = nba.inject_hyperparams(nba.adafactor)(learning_rate=1e-2)
    plan = nba.explain(tx, p)
    assert "opaque" not in [q.kind for q in plan.passes]
    s = tx.init(p)
    assert str(plan) == str(nba.explain(nba.adafactor(**s.hyperparams), p))


def test_user_code_raising_inside_an_injected_chain_leaves_the_state_as_it_was():
    """inject_hyperparams around chain(sgd with momentum, user code): the chain's parts run in
    the injected plan's runs, so the plan itself copies the momentum before the step and
    restores it, bit for bit, when the user's code raises after sgd wrote it."""
    user, fail = raising_user_code()
    tx = nba.inject_hyperparams(lambda learning_rate: nba.chain(nba.sgd(learning_rate, momentum=0.9), user))(
        learning_rate=0.1
    )
    p = {"w": np.ones(5, np.float32)}
    g = {"w": np.arange(5, dtype=np.float32)}
    check_raising_update_commits_nothing(tx, fail, g, p, lambda s: s.inner_state[0][0].trace.tree)
