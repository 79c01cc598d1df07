"""lookahead (numbaccum.lookahead) against optax: the same params bit for bit, wrapped around
our optimizers; update and step_ alike; what a user gets wrong."""

from __future__ import annotations

import numpy as np
import pytest
from _testutil import assert_tree_equal, require

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
