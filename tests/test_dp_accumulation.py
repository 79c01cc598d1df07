"""DP-SGD with gradient accumulation: MultiSteps over differentially_private_aggregate sums the
clipped examples of k mini-batches and noises them once, the same bits as one update on the
logical batch (same seed, same noise draw)."""

from __future__ import annotations

import numpy as np
import pytest
from _testutil import assert_tree_equal, find_state, watch_declarations

import numbaccum as nba

MAKERS = {
    "dpsgd_momentum": lambda: nba.dpsgd(0.1, 1.0, 1.1, seed=7, momentum=0.9),
    "aggregate_adam": lambda: nba.chain(nba.differentially_private_aggregate(0.5, 2.0, 3), nba.adam(1e-2)),
    "aggregate_alone": lambda: nba.differentially_private_aggregate(1.0, 0.7, 11),
    "named": lambda: nba.named_chain(
        ("dp", nba.differentially_private_aggregate(1.0, 1.0, 5)), ("opt", nba.adamw(1e-2, weight_decay=0.1))
    ),
}


def _params(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(4),
        "s": np.float32(0.5) * np.ones((), np.float32),  # a 0-d param: per-example leaves (B,)
    }


def _batch(p, n, seed):
    rng = np.random.default_rng(seed)
    out = {k: (rng.standard_normal((n, *np.shape(v))) * 3).astype(np.asarray(v).dtype) for k, v in p.items()}
    out["b"][1] = np.nan  # a non-finite example is dropped, in both
    return out


def _examples(state):
    """The examples of the cycle, as the DP stage's own state counts them."""
    return int(find_state(state.inner_opt_state, nba.DifferentiallyPrivateAggregateState).examples)


def test_multisteps_state_has_optax_fields():
    """issue 22 item 6: optax code reads MultiStepsState by field; it has optax's five (the DP
    example count was a sixth)."""
    fields = ("mini_step", "gradient_step", "inner_opt_state", "acc_grads", "skip_state")
    assert nba.MultiStepsState._fields == fields
    p = _params(4)
    ms = nba.MultiSteps(MAKERS["aggregate_adam"](), 2)
    s = ms.init(p)
    _, s = ms.update(_batch(p, 3, 1), s, p)
    assert type(s)._fields == fields and _examples(s) == 3
    assert nba.DifferentiallyPrivateAggregateState._fields[0] == "rng_key"  # optax's, first


def _split(batch, sizes):
    out, start = [], 0
    for n in sizes:
        out.append({k: v[start : start + n] for k, v in batch.items()})
        start += n
    return out


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("sizes", [(5, 5, 5), (2, 7, 1), (4,)], ids=["even", "uneven", "k1"])
def test_k_mini_steps_equal_one_step_on_the_logical_batch(name, sizes):
    p = _params(0)
    one, ms = MAKERS[name](), nba.MultiSteps(MAKERS[name](), len(sizes))
    s1, s2 = one.init(p), ms.init(p)
    for cycle in range(2):  # the second cycle draws the next noise, as the second big step
        batch = _batch(p, sum(sizes), 10 + cycle)
        u1, s1 = one.update(batch, s1, p)
        for i, mini in enumerate(_split(batch, sizes)):
            u2, s2 = ms.update(mini, s2, p)
            if i < len(sizes) - 1:
                assert all(np.all(np.asarray(x) == 0) for x in nba.tree_flatten(u2)[0])
                assert _examples(s2) == sum(sizes[: i + 1])
        assert_tree_equal(u2, u1)  # the same bits
        assert _examples(s2) == 0 and int(s2.gradient_step) == cycle + 1
    assert_tree_equal(nba.tree_flatten(s2.inner_opt_state)[0], nba.tree_flatten(s1)[0])


def test_a_checkpoint_mid_cycle_continues_with_the_same_bits(tmp_path):
    p = _params(1)
    ms = nba.MultiSteps(MAKERS["aggregate_adam"](), 3)
    s = ms.init(p)
    batch = _batch(p, 9, 3)
    minis = _split(batch, (3, 3, 3))
    _, s = ms.update(minis[0], s, p)
    nba.save_state(tmp_path / "s.npz", s)
    restored = nba.load_state(tmp_path / "s.npz", like=ms.init(p))
    outs = []
    for st in (s, restored):
        for mini in minis[1:]:
            u, st = ms.update(mini, st, p)
        outs.append(u)
    assert_tree_equal(outs[0], outs[1])


def test_bad_input_leaves_the_state_as_it_was():
    p = _params(2)
    ms = nba.MultiSteps(MAKERS["dpsgd_momentum"](), 2)
    s = ms.init(p)
    _, s = ms.update(_batch(p, 3, 1), s, p)
    before = [np.array(x, copy=True) for x in nba.tree_flatten(s)[0]]
    bad = _batch(p, 3, 2)
    bad["w"] = bad["w"][:2]  # another batch size in one leaf
    with pytest.raises(ValueError, match="batch"):
        ms.update(bad, s, p)
    assert_tree_equal([np.asarray(x) for x in nba.tree_flatten(s)[0]], before)
    with pytest.raises(ValueError, match="should_skip_update_fn"):
        nba.MultiSteps(MAKERS["dpsgd_momentum"](), 2, should_skip_update_fn=nba.skip_not_finite)


def test_the_accumulator_is_float64_unless_asked():
    p = _params(3)
    s = nba.MultiSteps(MAKERS["dpsgd_momentum"](), 2).init(p)
    assert set(s.acc_grads.group_dtypes) == {np.dtype(np.float64)}
    s = nba.MultiSteps(MAKERS["dpsgd_momentum"](), 2, accumulator_dtype=np.float32).init(p)
    assert set(s.acc_grads.group_dtypes) == {np.dtype(np.float32)}


def test_a_version_1_checkpoint_mid_cycle_loads_with_its_example_count():
    """A file written by landed main 7d5d46e (MultiStepsState had a sixth field, ``examples``;
    the DP state one field) mid-cycle: 2 of 3 mini-steps, 6 examples. It loads, the count moves
    to the DP state, and the cycle ends with the bits of an uninterrupted run."""
    import os

    path = os.path.join(os.path.dirname(__file__), "data", "checkpoint_v1_multisteps_dp.npz")
    p = _params(0)
    ms = nba.MultiSteps(MAKERS["aggregate_adam"](), 3)
    s = ms.init(p)
    batch = _batch(p, 9, 10)
    minis = _split(batch, (2, 4, 3))
    for mini in minis[:2]:
        _, s = ms.update(mini, s, p)
    loaded = nba.load_state(path)
    assert type(loaded)._fields == nba.MultiStepsState._fields
    assert _examples(loaded) == 6 and int(loaded.mini_step) == 2
    u_loaded, _ = ms.update(minis[2], loaded, p)
    u_loaded = nba.tree_map(np.copy, u_loaded)
    u, _ = ms.update(minis[2], s, p)
    assert_tree_equal(u_loaded, u)


def _kept_plans(state):
    """The runner's plans kept with a MultiSteps state's accumulator (one per batch size)."""
    return list(state.acc_grads.__dict__.get("_plans", {}).values())


def test_steady_steps_replay_one_kept_plan_per_batch_size(monkeypatch):
    """issue 43: DP accumulation is declared per per-example layout (per batch size) and kept
    with the accumulator; the rest of the inner chain runs a kept sub plan, ticked on emitting
    steps only. At a steady step nothing is declared, and the bits are the per-call ones
    (`test_k_mini_steps_equal_one_step_on_the_logical_batch`' reference)."""
    p = _params(5)
    ms, one = nba.MultiSteps(MAKERS["dpsgd_momentum"](), 2), MAKERS["dpsgd_momentum"]()
    s, s1 = ms.init(p), one.init(p)
    batches = [_batch(p, 6, 20 + i) for i in range(4)]
    expected = []
    for b in batches:  # the reference, planned each call: before the spy
        u1, s1 = one.update(b, s1, p)
        expected.append(nba.tree_map(np.copy, u1))
    for mini in _split(batches[0], (3, 3)):
        u, s = ms.update(mini, s, p)
    assert_tree_equal(u, expected[0])
    (plan,) = _kept_plans(s)
    rest = plan.root.run.__self__.rest.plan
    assert rest is not None
    declared = watch_declarations(monkeypatch, [])
    for b, u1 in zip(batches[1:], expected[1:]):
        for mini in _split(b, (3, 3)):
            u, s = ms.update(mini, s, p)
        assert_tree_equal(u, u1)
        assert _kept_plans(s) == [plan] and plan.root.run.__self__.rest.plan is rest
    assert declared == []
    # Another batch size: a plan of its own beside the first, which stays kept.
    _, s = ms.update(_batch(p, 2, 30), s, p)
    assert len(_kept_plans(s)) == 2 and plan in _kept_plans(s)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_step_equals_update_then_apply(name):
    """`step_` adds the emitted update in the rest's last pass (or after the aggregation): the
    bits of ``update`` then ``apply_updates_``; a mini-step leaves the params as they are."""
    p1, p2 = (nba.tree_map(np.array, _params(6)) for _ in range(2))  # writable 0-d leaf too
    ms1, ms2 = nba.MultiSteps(MAKERS[name](), 3), nba.MultiSteps(MAKERS[name](), 3)
    s1, s2 = ms1.init(p1), ms2.init(p2)
    for i in range(7):
        mini = _batch(p1, 2 + i % 3, 40 + i)
        u, s1 = ms1.update(mini, s1, p1)
        nba.apply_updates_(p1, u)
        before = nba.tree_map(np.copy, p2)
        s2 = nba.step_(ms2, mini, s2, p2)
        assert_tree_equal(p2, p1)
        if i % 3 != 2:
            assert_tree_equal(p2, before)
    assert_tree_equal(nba.tree_flatten(s2)[0], nba.tree_flatten(s1)[0])


def _inner(state, i, value):
    """``state`` with the state of inner stage ``i`` replaced."""
    inner = list(state.inner_opt_state)
    inner[i] = value
    return state._replace(inner_opt_state=tuple(inner))


def _bad_key(state):
    key = np.array([3, 2**64 - 1], np.uint64)  # an exhausted noise stream
    return _inner(state, 0, state.inner_opt_state[0]._replace(rng_key=key))


@pytest.mark.parametrize(
    "spoil, error, match",
    [
        (_bad_key, ValueError, "exhausted"),
        (lambda s: s._replace(inner_opt_state=s.inner_opt_state[:2]), ValueError, "inner chain"),
        (lambda s: _inner(s, 0, None), TypeError, "DifferentiallyPrivate"),
        (lambda s: _inner(s, 1, None), TypeError, "Trace"),
    ],
    ids=["dp_key", "inner_chain", "dp_state", "rest_state"],
)
@pytest.mark.parametrize("apply", [False, True], ids=["update", "step_"])
def test_a_wrong_state_raises_before_the_accumulator_changes(spoil, error, match, apply):
    """The kept declaration's tick checks the DP state, the inner chain's and (on the emitting
    step) the rest's before anything is written: the sums, the params and the state stay."""
    p = nba.tree_map(np.array, _params(7))  # writable: step_ may change them
    ms = nba.MultiSteps(MAKERS["dpsgd_momentum"](), 2)
    s = ms.init(p)
    _, s = ms.update(_batch(p, 3, 1), s, p)  # the sums hold one mini-batch; the next emits
    bad = spoil(s)
    before = [np.array(x, copy=True) for x in nba.tree_flatten(s)[0]]
    params_before = nba.tree_map(np.copy, p)
    with pytest.raises(error, match=match):
        if apply:
            nba.step_(ms, _batch(p, 3, 2), bad, p)
        else:
            ms.update(_batch(p, 3, 2), bad, p)
    assert_tree_equal([np.asarray(x) for x in nba.tree_flatten(s)[0]], before)
    assert_tree_equal(p, params_before)
    _, s = ms.update(_batch(p, 3, 2), s, p)  # the state itself still steps
    assert int(s.gradient_step) == 1


def test_a_stale_state_is_refused():
    """The accumulator is renewed by every step (`transaction.current`): a state an update has
    already advanced is refused (it was accepted, and its sums added to twice)."""
    p = _params(8)
    ms = nba.MultiSteps(MAKERS["aggregate_adam"](), 3)
    s0 = ms.init(p)
    _, s1 = ms.update(_batch(p, 2, 1), s0, p)
    with pytest.raises(ValueError, match="stale"):
        ms.update(_batch(p, 2, 2), s0, p)
    _, s2 = ms.update(_batch(p, 2, 2), s1, p)
    assert _examples(s2) == 4


def test_an_empty_cycle_raises_before_anything_is_written():
    p = _params(9)
    ms = nba.MultiSteps(MAKERS["aggregate_adam"](), 2)
    s = ms.init(p)
    empty = {k: np.zeros((0, *np.shape(v)), np.asarray(v).dtype) for k, v in p.items()}
    _, s = ms.update(empty, s, p)
    before = [np.array(x, copy=True) for x in nba.tree_flatten(s)[0]]
    with pytest.raises(ValueError, match="no example in the whole cycle"):
        ms.update(empty, s, p)
    assert_tree_equal([np.asarray(x) for x in nba.tree_flatten(s)[0]], before)


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("apply", [False, True], ids=["update", "step_"])
def test_explain_describes_both_steps_of_the_cycle(name, apply):
    """`explain` describes DP accumulation from its declaration: the norms and the sums on a
    mini-step; on the emitting step the noised average, the rest's fused passes and the reset
    (no opaque row)."""
    p = _params(10)
    g = _batch(p, 4, 1)
    ms = nba.MultiSteps(MAKERS[name](), 2)
    s = ms.init(p)
    e = nba.explain(ms, g, s, apply=apply)
    assert [q.stages[0] for q in e.passes] == [
        "multisteps (per-example norms)",
        "multisteps (clipped sums, accumulated)",
    ]
    _, s = ms.update(g, s, p)
    e = nba.explain(ms, g, s, apply=apply)
    stages = [q.stages[0] for q in e.passes]
    assert stages[:2] == ["multisteps (per-example norms)", "multisteps (clipped sums + noise, averaged)"]
    assert stages[-1] == "multisteps (reset)"
    assert len(stages) == (3 + apply if name == "aggregate_alone" else 4)  # the apply row, or the rest's pass
    assert all(q.kind != "opaque" for q in e.passes) and e.total is not None


class _Halving:
    """User code after the aggregation (``u = -u / 2``), raising while ``fail`` is set."""

    fail = False

    def init(self, params):
        return ()

    def update(self, updates, state, params=None):
        if self.fail:
            raise RuntimeError("user code failed")
        return nba.tree_map(lambda x: -0.5 * x, updates), state


@pytest.mark.parametrize("k", [1, 3])
def test_user_code_in_the_rest_that_raises_leaves_the_state_as_it_was(k):
    """The rest of the inner chain may hold user code (planned each emitting step, its
    `numbaccum.control.Inner` has no kept plan): when it raises on the emitting step, the sums,
    the DP state and the trace before it are as they were, and the retried cycle gives the bits
    of a run that never failed."""
    p = _params(11)
    user = _Halving()
    def make():
        inner = nba.chain(nba.differentially_private_aggregate(1.0, 0.5, 0), nba.trace(0.9), user)
        return nba.MultiSteps(inner, k)

    ms, clean = make(), make()
    s, sc = ms.init(p), clean.init(p)
    for i in range(2 * k):
        mini = _batch(p, 2, 50 + i)
        if i == k - 1:
            user.fail = True
            with pytest.raises(RuntimeError, match="user code"):
                ms.update(mini, s, p)
            user.fail = False
        u, s = ms.update(mini, s, p)
        uc, sc = clean.update(mini, sc, p)
        assert_tree_equal(u, uc)
    assert_tree_equal(nba.tree_flatten(s)[0], nba.tree_flatten(sc)[0])
