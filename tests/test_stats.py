"""numbaccum.stats and the clip's recorded norm; clip_by_global_norm's non-finite policy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _testutil import assert_tree_equal

import numbaccum as nba


def _tree(bad=False):
    rng = np.random.default_rng(0)
    t = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3)}
    if bad:
        t["b"][1] = np.nan
    return t


def _frozen(state):
    return [np.array(x, copy=True) for x in nba.tree_flatten(state)[0]]


def test_the_clip_records_the_norm_it_saw():
    g = _tree()
    want = nba.global_norm(g)
    for max_norm, clipped in ((1.0, True), (want * 2, False)):
        tx = nba.clip_by_global_norm(max_norm)
        s = tx.init(g)
        assert s == nba.ClipByGlobalNormState(0.0, False, False)
        _, s = tx.update(g, s)
        assert s.norm == want and bool(s.clipped) is clipped and not s.skipped
        assert isinstance(s.norm, np.float64)


@pytest.mark.parametrize("fused", [True, False])
def test_stats_of_a_training_state(fused, monkeypatch):
    monkeypatch.setenv("NUMBACCUM_FUSE", "1" if fused else "0")
    p, g = _tree(), _tree()
    opt = nba.MultiSteps(
        nba.chain(nba.clip_by_global_norm(1.0), nba.inject_hyperparams(nba.adamw)(learning_rate=1e-3)),
        2,
        should_skip_update_fn=nba.skip_not_finite,
    )
    s = opt.init(p)
    for _ in range(2):
        _, s = opt.update(g, s, p)
    st = nba.stats(s)
    assert st["multisteps/mini_step"] == 0 and st["multisteps/gradient_step"] == 1
    assert st["multisteps/clip_by_global_norm/norm"] == nba.global_norm(g)
    assert st["multisteps/clip_by_global_norm/clipped"] is True
    assert st["multisteps/inject_hyperparams/hyperparams/learning_rate"] == pytest.approx(1e-3)
    assert st["multisteps/inject_hyperparams/scale_by_adam/count"] == 1
    assert st["multisteps/skip_state/should_skip"] is False
    assert all(isinstance(v, (bool, int, float)) for v in st.values())


def test_names_of_named_chains_and_indices_where_two_clash():
    g = _tree()
    tx = nba.named_chain(
        ("pre", nba.clip_by_global_norm(1.0)), ("opt", nba.chain(nba.clip_by_global_norm(2.0), nba.sgd(0.1)))
    )
    _, s = tx.update(g, tx.init(g))
    st = nba.stats(s)
    assert st["pre/clip_by_global_norm/norm"] == nba.global_norm(g)
    assert st["opt/clip_by_global_norm/norm"] == pytest.approx(1.0)
    tx = nba.chain(
        nba.clip_by_global_norm(1.0), nba.clip_by_global_norm(2.0), nba.apply_if_finite(nba.sgd(0.1), 2)
    )
    _, s = tx.update(g, tx.init(g))
    st = nba.stats(s)
    assert {
        "0/clip_by_global_norm/norm",
        "1/clip_by_global_norm/norm",
        "apply_if_finite/total_notfinite",
    } <= set(st)


def test_fused_and_stage_by_stage_record_the_same_state(monkeypatch):
    p = _tree()
    grads = [_tree(), nba.tree_map(lambda x: 10 * x, _tree())]
    states = []
    for flag in ("1", "0"):
        monkeypatch.setenv("NUMBACCUM_FUSE", flag)
        tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(0.1))
        s = tx.init(p)
        for g in grads:
            _, s = tx.update(g, s, p)
        states.append(s[0])
    assert states[0] == states[1]


@pytest.mark.parametrize("fused", ["1", "0"])
def test_skip_returns_zeros_and_keeps_the_stages_after_it(fused, monkeypatch):
    monkeypatch.setenv("NUMBACCUM_FUSE", fused)
    p = _tree()
    tx = nba.chain(nba.trace(0.5), nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.adam(0.1))
    s = tx.init(p)
    _, s = tx.update(_tree(), s, p)
    adam_before = _frozen(s[2])
    u, s2 = tx.update(_tree(bad=True), s, p)
    assert all(np.all(x == 0) for x in nba.tree_flatten(u)[0])
    assert bool(s2[1].skipped) and math.isnan(s2[1].norm)
    assert_tree_equal(_frozen(s2[2]), adam_before)  # downstream untouched
    assert int(s2[2][0].count) == 1
    # the trace before the clip ran (documented): its state took the bad gradient
    assert np.isnan(s2[0].trace.tree["b"][1])
    # a finite step afterwards goes on normally
    u, s3 = tx.update(_tree(), nba.chain(nba.trace(0.5)).init(p) + s2[1:], p)
    assert int(s3[2][0].count) == 2 and not bool(s3[1].skipped)


def test_skip_through_step_multisteps_and_apply_if_finite():
    p = _tree()
    tx = nba.chain(nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.adamw(0.1))
    s = tx.init(p)
    before = _frozen(p)
    s = nba.step_(tx, _tree(bad=True), s, p)
    assert_tree_equal(_frozen(p), before) and bool(s[0].skipped) and int(s[1][0].count) == 0
    ms = nba.MultiSteps(tx, 1)
    s = ms.init(p)
    u, s = ms.update(_tree(bad=True), s, p)
    assert all(np.all(x == 0) for x in nba.tree_flatten(u)[0])
    assert int(s.gradient_step) == 1 and bool(s.inner_opt_state[0].skipped)
    assert np.all(s.acc_grads.groups[0] == 0)  # the cycle is over
    af = nba.apply_if_finite(nba.chain(nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.sgd(0.1)), 0)
    u, s = af.update(_tree(bad=True), af.init(p), p)  # max errors 0: the inner runs, and skips
    assert all(np.all(x == 0) for x in nba.tree_flatten(u)[0]) and bool(s.inner_state[0].skipped)


def test_raise_names_the_leaf_and_pass_is_optaxs():
    p = _tree()
    tx = nba.chain(nba.clip_by_global_norm(1.0, nonfinite="raise"), nba.adam(0.1))
    s = tx.init(p)
    before = _frozen(s)
    with pytest.raises(FloatingPointError, match=r"updates\['b'\] is not finite"):
        tx.update(_tree(bad=True), s, p)
    assert_tree_equal(_frozen(s), before)
    u, s = nba.clip_by_global_norm(1.0).update(_tree(bad=True), nba.ClipByGlobalNormState(0.0, False))
    assert all(np.all(np.isnan(x)) for x in nba.tree_flatten(u)[0])  # "pass": NaN updates
    with pytest.raises(ValueError, match="nonfinite"):
        nba.clip_by_global_norm(1.0, nonfinite="ignore")


def test_an_optax_empty_state_is_accepted_and_states_checkpoint(tmp_path):
    g = _tree()
    tx = nba.clip_by_global_norm(1.0)
    _, s = tx.update(g, nba.EmptyState())
    assert isinstance(s, nba.ClipByGlobalNormState)
    path = tmp_path / "s.npz"
    nba.save_state(path, (s, nba.adam(0.1).init(g)))
    back = nba.load_state(path)
    assert back[0] == s
    with pytest.raises(TypeError, match="ClipByGlobalNormState"):
        tx.update(g, nba.TraceState(None))
