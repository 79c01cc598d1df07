"""Issue 12, items 4, 5, 7 (dpsgd's output buffer) and 8, each test named after the item it fixes:
a state of another tree, extreme magnitudes, updates overwritten by another state's update,
growth clipping from zero."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import numbaccum as nba
from numbaccum.compat import declearn as dl
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
    if momentum is None:  # no state buffer at all: they survive the state's next update too
        tx.update(g1, s1)
        np.testing.assert_array_equal(u1["w"], keep)


# === item 5: extreme magnitudes, one scaled norm ============================================


def ref_norm(*leaves):
    """The exact L2 norm of every element of ``leaves``, from Fractions (rounded once)."""
    vals = [Fraction(float(v)) for x in leaves for v in np.ravel(np.asarray(x, F64))]
    if not vals:
        return 0.0
    m = max(abs(v) for v in vals)
    if m == 0:
        return 0.0
    e = math.frexp(float(m))[1]  # exact rescaling by a power of two: the sqrt stays in range
    s = sum((v / Fraction(2) ** e) ** 2 for v in vals)
    return math.ldexp(math.sqrt(s.numerator / s.denominator), e)


def clipped(x, norm, max_norm):
    """optax's clip, computed in float64 and rounded once to the leaf dtype."""
    x = np.asarray(x)
    return (x.astype(F64) / norm * max_norm).astype(x.dtype) if norm >= max_norm else x


HUGE = [1e154, 3e200, 1e300, -7.5e299]  # per leaf; their norms are representable
TINY = [1e-170, 3e-160, 2.5e-300, -1e-310]


@pytest.mark.parametrize("v", HUGE + TINY)
def test_item5_global_norm_of_extreme_float64(v):
    tree = {"a": np.full(3, v), "b": [np.array([v / 3, -v]), np.array(0.0)], "c": np.ones(2, F32)}
    got = nba.global_norm(tree)
    want = ref_norm(tree["a"], *tree["b"], tree["c"])
    assert math.isfinite(got)
    assert got == pytest.approx(want, rel=1e-14)
    assert nba.norms.tree_norm(tree, 2) == got  # one definition, one set of bits
    assert nba.global_norm(tree, squared=True) == pytest.approx(want * want, rel=1e-13)


def test_item5_global_norm_underflow_vector_of_the_issue():
    assert nba.global_norm([np.array([1e-170] * 4)]) == 2e-170
    assert nba.global_norm([np.full(4, 1e-170)]) == 2e-170
    assert nba.global_norm({"x": np.zeros(5)}) == 0.0


def test_item5_non_finite_input_keeps_todays_behaviour():
    assert nba.global_norm({"a": np.array([1.0, np.inf])}) == math.inf
    assert math.isnan(nba.global_norm({"a": np.array([1e300, np.nan])}))
    assert nba.global_norm({"a": np.full(4, 1.7e308)}) == math.inf  # the norm itself overflows
    u, _ = nba.clip_by_global_norm(1.0).update({"a": np.array([1.0, np.nan])}, None)
    assert np.all(np.isnan(u["a"]))


def test_item5_clip_by_global_norm_float32_near_max():
    with np.errstate(all="raise"):
        x = np.array([2.5e38, 2.5e38], F32)
        u, _ = nba.clip_by_global_norm(1.0).update({"a": x}, None)
        np.testing.assert_allclose(u["a"], clipped(x, ref_norm(x), 1.0), rtol=1e-6)
        assert u["a"][0] == pytest.approx(math.sqrt(0.5), rel=1e-6)
        y = np.array([3e38, 3e38], F32)
        u, _ = nba.clip_by_global_norm(4e38).update({"a": y}, None)
        assert np.all(np.isfinite(u["a"]))
        np.testing.assert_allclose(u["a"], clipped(y, ref_norm(y), 4e38), rtol=1e-6)
        for tree, m in (({"a": x}, 1.0), ({"a": y}, 4e38)):
            tx = nba.clip_norm(m, dim="global")
            u, _ = tx.update(tree, tx.init(tree))
            np.testing.assert_allclose(u["a"], clipped(tree["a"], ref_norm(tree["a"]), m), rtol=1e-6)


@pytest.mark.parametrize("v", HUGE + TINY)
def test_item5_every_norm_user_on_extreme_float64(v):
    tree = {"a": np.array([v, -v / 2, v / 4]), "b": np.array([v / 8])}
    norm = ref_norm(tree["a"], tree["b"])
    mx = norm / 4  # clipping applies
    want = {k: clipped(x, norm, mx) for k, x in tree.items()}

    def check(u, expected=want, rtol=1e-13):
        for k in tree:
            # atol: a subnormal result keeps fewer bits (a few units of 2**-1074)
            np.testing.assert_allclose(np.asarray(u[k]), expected[k], rtol=rtol, atol=2e-323, err_msg=k)

    check(nba.clip_by_global_norm(mx).update(tree, None)[0])
    # clip_norm and clip_grad_norm_ leave a norm <= 1e-12 alone (documented, as torchzero)
    passes = norm <= 1e-12
    tx = nba.clip_norm(mx, dim="global")
    check(tx.update(tree, tx.init(tree))[0], tree if passes else want)
    tx = nba.normalize_by_update_norm(scale_factor=mx, eps=0.0)
    check(tx.update(tree, tx.init(tree))[0])
    check(dl_run(dl.L2GlobalClipping(mx), tree))
    # per leaf: clip_by_block_rms, L2Clipping, clip_norm / clip_grad_norm_ per leaf
    leaf = {k: ref_norm(x) for k, x in tree.items()}
    per_leaf = {k: clipped(x, leaf[k], leaf["b"] / 2) for k, x in tree.items()}
    check(dl_run(dl.L2Clipping(leaf["b"] / 2), tree), per_leaf)
    tx = nba.clip_norm(leaf["b"] / 2, dim=None, min_size=1)
    check(tx.update(tree, tx.init(tree))[0], tree if passes else per_leaf)
    g = {k: np.copy(x) for k, x in tree.items()}
    nba.clip_grad_norm_(g, leaf["b"] / 2, min_size=1)
    check(g, tree if passes else per_leaf)
    rms = {k: leaf[k] / math.sqrt(x.size) for k, x in tree.items()}
    thr = rms["b"] / 2
    tx = nba.clip_by_block_rms(thr)
    check(tx.update(tree, tx.init(tree))[0], {k: clipped(x, rms[k], thr) for k, x in tree.items()})
    # skip_large_updates: its squared norm is the same quantity
    sq = float(nba.skip_large_updates(tree, 0, None, 1.0)[1]["norm_squared"])
    assert sq == pytest.approx(norm * norm, rel=1e-13) or (norm * norm == math.inf and sq == math.inf)
    # adaptive norms take the same scaled sums
    assert nba.norms.leaf_norms(nba.FlatTree.from_tree(tree))[0] == pytest.approx(leaf["a"], rel=1e-14)


def dl_run(module, tree):
    return module.run(dict(tree))


@pytest.mark.parametrize("v", [1e200, 1e-170])
def test_item5_per_example_clipping_extreme_float64(v):
    g = {"w": np.array([[v, v], [v / 10, 0.0], [0.0, 0.0]]), "b": np.array([[v], [0.0], [-v]])}
    norms = [ref_norm(g["w"][i], g["b"][i]) for i in range(3)]
    clip = min(n for n in norms if n > 0) / 2
    sums, n_clipped = nba.per_example_global_norm_clip(g, clip)
    mult = [min(1.0, clip / n) if n > 0 else 1.0 for n in norms]
    for k in g:
        want = sum(g[k][i] * mult[i] for i in range(3))
        np.testing.assert_allclose(sums[k], want, rtol=1e-13)
    assert int(n_clipped) == 3 - sum(m == 1.0 for m in mult)
    sums, counts = nba.per_example_layer_norm_clip(g, clip)
    for k in g:
        c = clip / math.sqrt(2)
        mult = [min(1.0, c / ref_norm(g[k][i])) if ref_norm(g[k][i]) > 0 else 1.0 for i in range(3)]
        np.testing.assert_allclose(sums[k], sum(g[k][i] * mult[i] for i in range(3)), rtol=1e-13)


def test_item5_tiny_leaves_are_clipped_by_their_true_rms():
    tree = {"a": np.full(4, 1e-170)}  # rms 1e-170: its squares underflow to 0 in float64
    u, _ = nba.clip_by_block_rms(1e-171).update(tree, None)
    np.testing.assert_allclose(u["a"], np.full(4, 1e-171), rtol=1e-14)


def test_item5_float32_leaves_take_the_plain_fast_path_bit_for_bit():
    from numbaccum.backend import tree_sumsq

    rng = np.random.default_rng(0)
    t = {"a": rng.standard_normal(1000).astype(F32), "b": rng.standard_normal(7)}
    flat = nba.FlatTree.from_tree(t)
    assert nba.norms.tree_norm(flat) == math.sqrt(tree_sumsq(flat)) == nba.global_norm(t)


@pytest.mark.cuda
@pytest.mark.parametrize("v", [3e200, 1e-170, 2.0])
def test_item5_cuda_device_factor_is_the_scaled_norm(v):
    from numba import cuda

    from numbaccum import clipping

    host = {"a": np.array([v, -v / 2, v / 4]), "b": np.full(3, 0.5, F32), "c": np.array([v / 8])}
    if v != 2.0:
        host["b"] = np.zeros(3, F32)  # the rescue: float32 leaves are 0 or negligible
    d = {k: cuda.to_device(x) for k, x in host.items()}
    flat = nba.FlatTree.from_tree(d)
    norm = nba.norms.tree_norm(flat)
    assert math.isfinite(norm) and norm == pytest.approx(ref_norm(*host.values()), rel=1e-14)
    assert nba.global_norm(d) == norm
    facs = clipping._device_factors(flat, norm / 4)
    fac64 = facs[np.dtype(F64)].copy_to_host()
    # [div, mul, norm, clipped]: the host's bits, computed on the device, and the state's record
    assert len(fac64) == 4
    assert tuple(float(x) for x in fac64[:2]) == clip_pair(norm, norm / 4)
    assert fac64[2] == norm and fac64[3] == 1.0
    u, _ = nba.clip_by_global_norm(norm / 4).update(d, None)
    for k, x in host.items():
        want = clipped(x, ref_norm(*host.values()), norm / 4)
        np.testing.assert_allclose(u[k].copy_to_host(), want, rtol=1e-6 if x.dtype == F32 else 1e-13)


def clip_pair(norm, max_norm):
    from numbaccum.formulas import clip_factor

    return tuple(float(v) for v in clip_factor(norm, max_norm))
