"""Issue 12, items 4, 5, 7 (dpsgd's output buffer) and 8, each test named after the item it fixes:
a state of another tree, extreme magnitudes, updates overwritten by another state's update,
growth clipping from zero."""

from __future__ import annotations

import numpy as np
import pytest

import numbaccum as nba
from numbaccum.compat import torchzero as tz

F32, F64 = np.float32, np.float64


def a(*v, dtype=F64):
    return np.array(v, dtype)


def state_bits(state):
    """Every array of a state as bytes (FlatTree groups included), to check it is unchanged."""
    out = []
    for x in nba.tree_flatten(state)[0]:
        if isinstance(x, nba.FlatTree):
            out.extend(np.asarray(g).tobytes() for g in x.groups)
        elif isinstance(x, (np.ndarray, np.generic)):
            out.append(np.asarray(x).tobytes())
        else:
            out.append(repr(x))
    return out


# === item 4: a state of another tree ========================================================


@pytest.mark.parametrize("tensorwise", [True, False])
def test_item4_clip_norm_growth_rejects_state_of_another_tree(tensorwise):
    tx = nba.clip_norm_growth(tensorwise=tensorwise)
    s = tx.init({"a": np.ones(3), "b": np.ones(5)})
    _, s = tx.update({"a": np.ones(3), "b": np.ones(5)}, s)
    before = state_bits(s)
    other = {"x": np.full((7, 7), 100.0), "y": [np.full(2, 100.0)]}  # two leaves too
    with pytest.raises(ValueError, match=r"^state: .*another tree"):
        tx.update(other, s)
    assert state_bits(s) == before
    same_keys_other_shapes = {"a": np.ones(4), "b": np.ones(5)}
    with pytest.raises(ValueError, match=r"^state: "):
        tx.update(same_keys_other_shapes, s)
    assert state_bits(s) == before
    u, _ = tx.update({"a": np.ones(3), "b": np.ones(5)}, s)  # its own tree still works
    np.testing.assert_array_equal(u["a"], np.ones(3))


def test_item4_torchzero_clip_norm_growth_rejects_state_of_another_tree():
    m = tz.ClipNormGrowth()
    m.step({"a": np.ones(3), "b": np.ones(5)})
    with pytest.raises(ValueError, match=r"^state: "):
        m.step({"x": np.full((7, 7), 100.0), "y": [np.full(2, 100.0)]})
    # A state_dict of one tree is refused by a module that runs on another, before writing.
    sd = m.state_dict()
    m2 = tz.ClipNormGrowth()
    m2.step({"x": np.ones(4), "y": np.ones(2)})
    before = m2.state_dict()
    with pytest.raises(ValueError, match=r"state\.layout: .*another tree"):
        m2.load_state_dict(sd)
    after = m2.state_dict()
    np.testing.assert_array_equal(after["state"]["prev_norm"], before["state"]["prev_norm"])


def test_item4_clip_norm_growth_state_round_trips_a_checkpoint(tmp_path):
    p = {"a": np.ones(3), "b": np.ones(5)}
    tx = nba.clip_norm_growth()
    _, s = tx.update(p, tx.init(p))
    nba.save_state(tmp_path / "s.npz", s)
    loaded = nba.load_state(tmp_path / "s.npz", like=tx.init(p))
    assert loaded.layout is s.layout and bool(loaded.started)
    g = {"a": np.full(3, 9.0), "b": np.ones(5)}
    u1, _ = tx.update(g, s)
    u1 = {k: np.copy(v) for k, v in u1.items()}
    u2, _ = tx.update(g, loaded)
    for k in g:
        np.testing.assert_array_equal(u1[k], u2[k])
    with pytest.raises(ValueError, match=r"state\.layout: the checkpoint does not match like"):
        nba.load_state(tmp_path / "s.npz", like=tx.init({"a": np.ones(4), "b": np.ones(5)}))


# === item 8: growth clipping from zero ======================================================

VALUE_STEPS = [a(1, -1, 0, 2), a(3, -1.2, 5, 0.5), a(3, -1.2, 5, 0.1), a(3, 0.01, 5, 0.1)]


def run(tx, steps):
    s = tx.init(steps[0])
    outs = []
    for g in steps:
        u, s = tx.update(g, s)
        outs.append(np.copy(u))
    return outs, s


@pytest.mark.parametrize("dtype", [F32, F64])
def test_item8_clip_value_growth_from_zero_follows_torchzero(dtype):
    steps = [x.astype(dtype) for x in VALUE_STEPS]
    rtol = 1e-6 if dtype == F32 else 1e-12
    outs, s = run(nba.clip_value_growth(), steps)  # torchzero's "default" rows, all of them
    want = [[1, -1, 0, 2], [1.5, -1.2, 0.00015, 0.5], [2.25, -1.2, 0.000225, 0.1], [3, 0.01, 0.0003375, 0.1]]
    np.testing.assert_allclose(outs, want, rtol=rtol)
    np.testing.assert_allclose(s.prev.tree, [3, -0.6, 0.0003375, 0.25], rtol=rtol)
    outs, s = run(nba.clip_value_growth(add=1, mul=None), steps)  # "add=1, mul=None" rows
    np.testing.assert_allclose(outs[1:], [[2, -1.2, 1, 0.5], [3, -1.2, 2, 0.1], [3, 0.01, 3, 0.1]], rtol=rtol)
    np.testing.assert_allclose(s.prev.tree, [3, -0.6, 3, 0.25], rtol=rtol)
    # 0 -> 5: 1.5e-4 by default, 1 with add=1, mul=None.
    for tx, want in ((nba.clip_value_growth(), 1.5e-4), (nba.clip_value_growth(add=1, mul=None), 1.0)):
        outs, _ = run(tx, [a(0.0, dtype=dtype), a(5.0, dtype=dtype)])
        np.testing.assert_allclose(outs[1], [want], rtol=rtol)


def test_item8_first_step_only_has_no_history_and_the_degenerate_case_still_grows():
    tx = nba.clip_value_growth()
    s = tx.init(a(0.0))
    assert not s.started
    u, s = tx.update(a(100.0), s)  # the first step passes
    assert u[0] == 100.0 and s.started
    # mul only, min_value=None: torchzero holds a 0 at 0 forever; the bound mul * 0 is skipped.
    outs, s = run(nba.clip_value_growth(min_value=None), [a(0, 1, 0), a(2, 1, 0), a(3, 1, 0)])
    np.testing.assert_allclose(outs, [[0, 1, 0], [2, 1, 0], [3, 1, 0]])
    # ... and from then on the history limits it again.
    u, _ = nba.clip_value_growth(min_value=None).update(a(100.0, 1, 0), s)
    np.testing.assert_allclose(u, [4.5, 1, 0])


@pytest.mark.parametrize("make", [nba.clip_norm_growth, tz.ClipNormGrowth])
def test_item8_clip_norm_growth_from_zero(make):
    tx = make()
    outs, s = run(tx, [a(0, 0), a(3, 4), a(3, 4)])
    # No history on the first step only; then torchzero's rule with min_value bounding the norm.
    np.testing.assert_allclose(outs, [[0, 0], [9e-5, 1.2e-4], [1.35e-4, 1.8e-4]], rtol=1e-12)
    outs, _ = run(make(add=1, mul=None), [a(0, 0), a(3, 4)])
    np.testing.assert_allclose(outs[1], [0.6 * 1.0001, 0.8 * 1.0001], rtol=1e-12)  # min_value + add
    # mul only, min_value=None: mul * 0 is not applied (the norm would stay 0 for good).
    outs, _ = run(make(min_value=None), [a(0, 0), a(3, 4), a(30, 40)])
    np.testing.assert_allclose(outs, [[0, 0], [3, 4], [4.5, 6]], rtol=1e-12)


def test_item8_torchzero_clip_value_growth_from_zero():
    m = tz.ClipValueGrowth()
    outs = [np.copy(m.step(g)) for g in VALUE_STEPS]
    np.testing.assert_allclose(outs[1], [1.5, -1.2, 0.00015, 0.5], rtol=1e-12)
    m = tz.ClipValueGrowth(add=1, mul=None)
    outs = [np.copy(m.step(g)) for g in VALUE_STEPS]
    np.testing.assert_allclose(outs[1], [2, -1.2, 1, 0.5], rtol=1e-12)


# === item 7 (last point): dpsgd(momentum=None)'s updates belong to the caller =================


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_item7_dpsgd_updates_are_not_overwritten_by_another_state(momentum):
    tx = nba.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0, momentum=momentum)
    g1 = {"w": np.full((4, 3), 0.1, F32)}
    g2 = {"w": np.full((4, 3), -0.2, F32)}
    params = {"w": np.zeros(3, F32)}
    s1, s2 = tx.init(params), tx.init(params)
    u1, s1 = tx.update(g1, s1)
    keep = np.copy(u1["w"])
    u2, s2 = tx.update(g2, s2)  # another state of the same transformation
    np.testing.assert_array_equal(u1["w"], keep)
    assert not np.array_equal(u2["w"], keep)
    u3, _ = tx.update(g1, s1)  # and the next update of the same state
    np.testing.assert_array_equal(u1["w"], keep)
    del u3
