"""masked(inner, mask) and add_decayed_weights(weight_decay, mask) against the plain NumPy
reference: random trees and masks, prefix and callable masks, pending factors, fused chains, and
bad masks refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
import strategies as strat
from _testutil import assert_bits_equal, assert_tree_close, assert_tree_equal, plain, require, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numbaccum as nba

SETTINGS = settings(deadline=None, max_examples=12, suppress_health_check=[HealthCheck.too_slow])

PAIRS = {
    "masked_trace": (
        lambda m: nba.masked(nba.trace(0.9), m),
        lambda m: ref.masked(ref.trace(0.9), m),
    ),
    "masked_decay": (
        lambda m: nba.masked(nba.add_decayed_weights(0.1), m),
        lambda m: ref.masked(ref.add_decayed_weights(0.1), m),
    ),
    "decay_mask_argument": (
        lambda m: nba.add_decayed_weights(0.1, m),
        lambda m: ref.add_decayed_weights_masked(0.1, m),
    ),
    "scaled_then_masked_adam": (  # a factor pending on the input of the masked stage
        lambda m: nba.chain(nba.scale(0.5), nba.masked(nba.adam(0.01), m), nba.scale(2.0)),
        lambda m: ref.chain(ref.scale(0.5), ref.masked(ref.adam(0.01), m), ref.scale(2.0)),
    ),
    "trace_masked_decay_sgd": (
        lambda m: nba.chain(nba.trace(0.5), nba.add_decayed_weights(0.05, m), nba.sgd(0.1, 0.9)),
        lambda m: ref.chain(ref.trace(0.5), ref.add_decayed_weights_masked(0.05, m), ref.sgd(0.1, 0.9)),
    ),
}


@SETTINGS
@given(
    data=strat.tree_sequences(min_steps=1, max_steps=3),
    bits=st.lists(st.booleans(), min_size=64, max_size=64),
)
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_matches_reference(name, data, bits):
    params, grads = data
    leaves, td = nba.tree_flatten(params)
    mask = nba.tree_unflatten(td, bits[: len(leaves)])
    tx, rtx = PAIRS[name][0](mask), PAIRS[name][1](mask)
    s, rs = tx.init(params), rtx.init(params)
    for g in grads:
        before = snapshot(g)
        u, s = tx.update(g, s, params)
        ru, rs = rtx.update(g, rs, params)
        assert_tree_close(u, ru)
        assert_tree_equal(g, before)  # the gradient is read, never written


def _frozen(state):
    """Copies of every array in a state (FlatTrees flatten as their leaves)."""
    return [np.array(x, copy=True) for x in nba.tree_flatten(state)[0]]


def _tree():
    rng = np.random.default_rng(0)
    return {
        "dense": {
            "w": rng.standard_normal((3, 4)).astype(np.float32),
            "b": rng.standard_normal(4).astype(np.float32),
        },
        "norm": {"scale": rng.standard_normal(4), "bias": rng.standard_normal(4)},
        "head": rng.standard_normal((4, 2)).astype(np.float32),
        "t": np.float32(0.5) * np.ones(()),
    }


def _run(tx, params, grads_seq):
    s = tx.init(params)
    out = []
    for g in grads_seq:
        u, s = tx.update(g, s, params)
        out.append(snapshot(u))
    return out, s


def _grads(n=3):
    return [nba.tree_map(lambda x, v=0.25 * (i + 1): np.full_like(x, v), _tree()) for i in range(n)]


def test_prefix_and_callable_masks_equal_the_full_mask():
    p = _tree()
    full = {
        "dense": {"w": True, "b": False},
        "norm": {"scale": False, "bias": False},
        "head": True,
        "t": False,
    }
    prefix = {"dense": {"w": True, "b": False}, "norm": False, "head": True, "t": False}
    calls = []

    def by_ndim(tree):
        calls.append(1)
        return nba.tree_map(lambda x: x.ndim > 1, tree)

    want, _ = _run(nba.masked(nba.trace(0.5), full), p, _grads())
    for mask in (prefix, by_ndim):
        got, _ = _run(nba.masked(nba.trace(0.5), mask), p, _grads())
        for a, b in zip(got, want):
            assert_tree_equal(a, b)
    # A callable mask is resolved once per tree layout (init, then the updates of that layout).
    assert len(calls) == 1
    # The reference agrees (it calls the mask on the real trees).
    rgot, _ = _run(ref.masked(ref.trace(0.5), full), p, _grads())
    for a, b in zip(want, rgot):
        assert_tree_close(a, b)


def test_inner_state_covers_the_kept_leaves_only():
    p = _tree()
    tx = nba.masked(nba.trace(0.5), {"dense": True, "norm": False, "head": False, "t": False})
    s = tx.init(p)
    assert isinstance(s, nba.MaskedState)
    assert s.inner_state.trace.layout.num_leaves == 2
    tree = s.inner_state.trace.tree
    assert isinstance(tree["norm"], nba.MaskedNode) and tree["dense"]["w"].shape == (3, 4)


@pytest.mark.parametrize("callable_mask", [False, True])
def test_masked_out_subtree_is_one_masked_node(callable_mask):
    """issue 22 item 6: as optax's ``mask_pytree``, a False leaf of a prefix mask makes its
    whole subtree one `MaskedNode` (in the inner state, its params and its updates); a full
    mask gives one per leaf."""
    p = _tree()
    seen = []

    def update(u, s, params=None):
        seen.append((u, params))
        return u, s

    def init(params):
        seen.append((params, None))
        return nba.EmptyState()

    prefix = {"dense": True, "norm": False, "head": False, "t": False}
    full = nba.tree_map(lambda x: True, p)
    full["norm"] = nba.tree_map(lambda x: False, p["norm"])
    for mask, one_node in [(prefix, True), (full, False)]:
        seen.clear()
        m = (lambda params, mask=mask: mask) if callable_mask else mask
        user = nba.masked(nba.GradientTransformation(init, update), m)
        traced = nba.masked(nba.trace(0.5), m)
        user.update(_grads(1)[0], user.init(p), p)
        trees = [seen[0][0], seen[1][0], seen[1][1], traced.init(p).inner_state.trace.tree]
        for tree in trees:
            if one_node:
                assert isinstance(tree["norm"], nba.MaskedNode) and isinstance(tree["head"], nba.MaskedNode)
            else:
                assert isinstance(tree["norm"], dict)
                assert all(isinstance(v, nba.MaskedNode) for v in tree["norm"].values())
            assert tree["dense"]["w"].shape == (3, 4)


def test_all_and_none_masked():
    p = _tree()
    g = _grads(1)[0]
    on = nba.tree_map(lambda x: True, p)
    off = nba.tree_map(lambda x: False, p)
    u, _ = nba.add_decayed_weights(0.5, on).update(g, nba.add_decayed_weights(0.5, on).init(p), p)
    want, _ = nba.add_decayed_weights(0.5).update(g, nba.EmptyState(), p)
    assert_tree_equal(u, want)
    u, _ = nba.masked(nba.scale(3.0), off).update(g, nba.masked(nba.scale(3.0), off).init(p), p)
    assert_tree_equal(u, g)


def test_flat_tree_in_flat_tree_out_and_state_matches_optax_shape():
    p = nba.FlatTree.from_tree(_tree())
    g = nba.FlatTree.from_tree(_grads(1)[0])
    tx = nba.chain(
        nba.scale_by_adam(), nba.add_decayed_weights(0.1, lambda t: nba.tree_map(lambda x: x.ndim > 1, t))
    )
    s = tx.init(p)
    assert isinstance(s[1], nba.MaskedState) and isinstance(s[1].inner_state, nba.EmptyState)
    u, s = tx.update(g, s, p)
    assert isinstance(u, nba.FlatTree)
    rtx = ref.chain(
        ref.scale_by_adam(),
        ref.add_decayed_weights_masked(0.1, lambda t: ref.tree_map(lambda x: np.ndim(x) > 1, t)),
    )
    ru, _ = rtx.update(g.tree, rtx.init(p.tree), p.tree)
    assert_tree_close(u.tree, ru)


@pytest.mark.parametrize(
    "mask, error, match",
    [
        ({"dense": True, "norm": True, "head": True}, ValueError, r"mask: dict keys differ"),
        (
            {"dense": {"w": True}, "norm": True, "head": True, "t": True},
            ValueError,
            r"mask\['dense'\]: dict keys",
        ),
        (
            {"dense": True, "norm": True, "head": [True], "t": True},
            ValueError,
            r"mask\['head'\]: not a prefix",
        ),
        (
            {"dense": True, "norm": True, "head": 1, "t": True},
            TypeError,
            r"mask\['head'\]: a mask leaf must be a bool",
        ),
    ],
)
def test_bad_masks_are_refused_before_anything_is_written(mask, error, match):
    p = _tree()
    good = nba.masked(nba.trace(0.5), {"dense": True, "norm": True, "head": True, "t": True})
    s = good.init(p)
    before = _frozen(s)
    with pytest.raises(error, match=match):
        nba.masked(nba.trace(0.5), mask).update(_grads(1)[0], s, p)
    assert_tree_equal(_frozen(s), before)
    with pytest.raises(error, match=match):
        nba.add_decayed_weights(0.1, mask).update(_grads(1)[0], nba.MaskedState(nba.EmptyState()), p)


def test_bad_states_and_missing_params():
    p = _tree()
    g = _grads(1)[0]
    with pytest.raises(TypeError, match="MaskedState"):
        nba.masked(nba.trace(0.5), nba.tree_map(lambda x: True, p)).update(g, nba.EmptyState(), p)
    tx = nba.add_decayed_weights(0.1, nba.tree_map(lambda x: True, p))
    with pytest.raises(ValueError, match="needs params"):
        tx.update(g, tx.init(p))
    with pytest.raises(TypeError, match="MaskedState"):
        tx.update(g, nba.EmptyState(), p)
    # An inner state of another layout is caught by the inner plan, before anything is written.
    inner = nba.masked(nba.trace(0.5), nba.tree_map(lambda x: True, p))
    s = inner.init(p)
    other = nba.masked(nba.trace(0.5), {"dense": False, "norm": True, "head": True, "t": True})
    before = _frozen(s)
    with pytest.raises(ValueError):
        other.update(g, s, p)
    assert_tree_equal(_frozen(s), before)


def test_fused_and_stage_by_stage_agree(monkeypatch):
    p = _tree()
    mask = {"dense": {"w": True, "b": False}, "norm": False, "head": True, "t": True}

    def make():
        return nba.chain(
            nba.clip_by_global_norm(1.0),
            nba.scale_by_adam(),
            nba.add_decayed_weights(0.1, mask),
            nba.scale(-0.01),
        )

    fused, _ = _run(make(), p, _grads())
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    plain, _ = _run(make(), p, _grads())
    for a, b in zip(fused, plain):
        assert_tree_equal(a, b)


def test_none_updates_give_none_as_in_optax():
    p = _tree()
    decay = nba.add_decayed_weights(0.1)  # needs params even for no updates, as in optax
    for tx in (nba.scale(2.0), nba.clip_by_global_norm(1.0), nba.sgd(0.1), decay):
        u, s = tx.update(None, tx.init(p), p)
        assert u is None
        assert tx.update(None, tx.init(None), None if tx is not decay else p)[0] is None
    sched = nba.scale_by_learning_rate(lambda c: 0.1)
    u, s = sched.update(None, sched.init(p), p)
    assert u is None and int(s.count) == 1  # the step still counts, as in optax
    adam = nba.adam(0.1)
    with pytest.raises(ValueError, match="updates: tree structure mismatch"):
        adam.update(None, adam.init(p), p)  # a state of a tree wants that tree
    assert nba.apply_updates(None, _grads(1)[0]) is None
    assert nba.apply_updates_(None, _grads(1)[0]) is None


def test_a_masked_weight_decay_fuses_into_the_optimizers_pass(monkeypatch):
    """adamw with a mask (no decay on biases: the usual setup) is one fused pass per dtype group,
    like adamw without one, and gives optax's ``masked(add_decayed_weights)`` bit for bit: the
    masked-out leaves pass unchanged, whatever their params hold (inf, NaN)."""
    from numbaccum.cpu import driver

    rng = np.random.default_rng(3)
    params = {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "b": np.array([np.inf, np.nan, 1.0], np.float32),  # masked out: never read
        "v": rng.standard_normal(5),  # float64, kept
    }
    mask = {"w": True, "b": False, "v": True}
    grads = [
        nba.tree_map(lambda x: (rng.standard_normal(x.shape) * 0.01).astype(x.dtype), params)
        for _ in range(3)
    ]
    # (a norm below 1: the clip changes nothing, and the reference needs none)
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-2, weight_decay=0.1, mask=mask))
    rtx = ref.adamw(1e-2, weight_decay=0.1, mask=mask)
    shown = nba.explain(tx, params, apply=True)
    assert [p.kind for p in shown.passes] == ["reduction", "fused"], shown
    assert "add_decayed_weights (masked)" in shown.passes[1].stages
    p, rp = snapshot(params), snapshot(params)
    s, rs = tx.init(p), rtx.init(rp)
    launched: list[str] = []
    for i, g in enumerate(grads):
        if i == len(grads) - 1:
            monkeypatch.setattr(driver, "observers", [lambda f: launched.append(f.name)])
        s = nba.step_(tx, g, s, p)
        ru, rs = rtx.update(g, rs, rp)
        rp = ref.apply_updates(rp, ru)
    assert len(launched) == 2 and all(n.startswith("fused_") for n in launched), launched  # f32, f64
    assert_tree_equal(p, rp)
    assert np.isinf(p["b"][0]) and np.isnan(p["b"][1])


# --- flatten: the inner transformation sees one vector ---------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda m: m.flatten(m.adam(0.1)),
        lambda m: m.chain(m.scale(2.0), m.flatten(m.lamb(0.1)), m.scale(0.5)),
        lambda m: m.flatten(m.chain(m.clip_by_global_norm(1.0), m.sgd(0.1, momentum=0.9))),
        lambda m: m.flatten(m.scale_by_trust_ratio()),
    ],
)
def test_flatten_matches_optax_and_step_matches_update(make):
    optax = require("optax")
    rng = np.random.default_rng(0)
    p = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    ours, stepped, theirs = make(nba), make(nba), make(optax)
    s, ss, so = ours.init(p), stepped.init(p), theirs.init(p)
    pu, ps = nba.tree_map(np.copy, p), nba.tree_map(np.copy, p)
    for _ in range(4):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in p.items()}
        u, s = ours.update(g, s, pu)
        uo, so = theirs.update(g, so, pu)
        assert_tree_close(u, {k: np.asarray(v) for k, v in uo.items()}, rtol=2e-6)
        ss = nba.step_(stepped, g, ss, ps)
        pu = nba.apply_updates(pu, u)
        assert_tree_equal(ps, pu)
    assert u["a"].dtype == np.float32


def test_flatten_shares_the_buffers_and_refuses_mixed_dtypes():
    tx = nba.flatten(nba.scale_by_trust_ratio())  # one norm over the whole tree
    params = {"a": np.array([3.0]), "b": np.array([4.0])}
    u, _ = tx.update({"a": np.array([1.0]), "b": np.array([0.0])}, tx.init(params), params)
    np.testing.assert_array_equal(u["a"], [5.0])  # ||p|| / ||g|| over both leaves: 5 / 1
    with pytest.raises(TypeError, match="several dtypes"):
        tx.init({"a": np.ones(2), "b": np.ones(2, np.float32)})


@pytest.mark.parametrize("make", [nba.conditionally_transform, nba.conditionally_mask])
def test_conditionally_refuses_an_inner_that_reshapes_its_updates(make):
    """Its skipped steps would return the per-example gradients (or zeros of their shape) where
    the others return params-shaped updates; optax's ``lax.cond`` refuses such branches too.
    Refused when built, naming the combinator."""
    for inner in (nba.dpsgd(0.1, 1.0, 0.5, seed=0), nba.lookahead(nba.sgd(0.1), 2, 0.5)):
        with pytest.raises(TypeError, match=f"{make.__name__}: inner reshapes its updates"):
            make(inner, lambda step: step % 2 == 0)


def test_masked_scale_applies_its_factor_in_the_copies_out():
    """masked(scale): the factor the inner scale leaves pending is applied by the copies of the
    kept leaves out (no settle pass of its own, none in `explain`), with the bits of a settle.
    Each kept dtype group is one run of a full group (w after b, d alone), so the kept leaves
    are read in place (views, no copies in): one pass in all."""
    p = {"w": np.zeros((4, 4), np.float32), "b": np.zeros(4, np.float32), "d": np.zeros(3)}
    tx = nba.masked(nba.scale(-0.3), {"w": True, "b": False, "d": True})
    state = tx.init(p)
    rng = np.random.default_rng(5)
    for _ in range(3):
        g = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in p.items()}
        u, state = tx.update(g, state)
        for k in ("w", "d"):  # numpy's own product rounds as the settle does
            np.testing.assert_array_equal(u[k].view(np.uint8), (g[k] * g[k].dtype.type(-0.3)).view(np.uint8))
        np.testing.assert_array_equal(u["b"], g["b"])
    kinds = [q.kind for q in nba.explain(tx, p, state).passes]
    assert kinds == ["kernel"], kinds


def test_a_mask_keeping_every_leaf_runs_the_inner_parts_in_place():
    """A mask that keeps every leaf (lars' and lamb's defaults) runs the inner stage's parts on
    the updates themselves: its kernels fuse with the neighbours' (no copies in or out in
    `explain`), the bits and the inner state are the inner stage's alone, and user code inside
    still commits nothing when it raises."""
    from _testutil import check_raising_update_commits_nothing, raising_user_code

    rng = np.random.default_rng(7)
    p = {"w": rng.standard_normal((4, 3)).astype(np.float32), "d": rng.standard_normal(5)}
    every = {"w": True, "d": True}
    tx = nba.chain(nba.scale(0.5), nba.masked(nba.trace(0.9), every), nba.scale(-0.1))
    plain = nba.chain(nba.scale(0.5), nba.trace(0.9), nba.scale(-0.1))
    shown = nba.explain(tx, p, apply=True)
    assert [q.kind for q in shown.passes] == ["fused"], shown
    s, t = tx.init(p), plain.init(p)
    pa, pb = snapshot(p), snapshot(p)
    for k in range(3):
        g = {n: rng.standard_normal(v.shape).astype(v.dtype) for n, v in p.items()}
        u, s = tx.update(g, s, p)
        v, t = plain.update(g, t, p)
        assert_tree_equal(u, v)
        s, t = nba.step_(tx, g, s, pa), nba.step_(plain, g, t, pb)
        assert_tree_equal(pa, pb)
    assert isinstance(s[1], nba.MaskedState)
    assert_tree_equal(s[1].inner_state.trace, t[1].trace)
    user, fail = raising_user_code()
    guarded = nba.chain(nba.trace(0.5), nba.masked(nba.chain(nba.trace(0.9), user), every))
    written = lambda st: (st[0].trace.tree, st[1].inner_state[0].trace.tree)  # noqa: E731
    check_raising_update_commits_nothing(guarded, fail, g, p, written)


def test_partition_reads_and_writes_a_label_in_place_where_its_leaves_are_one_run():
    """Each label's leaves of one dtype lie back to back here (b then w in the float32 group,
    d alone in float64), so `partition` hands each label views of the updates: no copies in,
    and a stateless label writes its updates in place (no copies out either). The numbers are
    the leaves' own formulas, the user's gradients are never written, and updates kept across
    steps keep theirs."""
    p = {"b": np.zeros(4, np.float32), "w": np.zeros((4, 4), np.float32), "d": np.zeros(3)}
    labels = {"b": "x", "w": "y", "d": "x"}
    tx = nba.chain(nba.clip(10.0), nba.partition({"x": nba.clip(0.5), "y": nba.trace(0.9)}, labels))
    state = tx.init(p)
    rng = np.random.default_rng(3)
    kept, mu = [], np.zeros((4, 4), np.float32)
    for _ in range(3):
        g = {k: (3 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in p.items()}
        before = snapshot(g)
        u, state = tx.update(g, state)
        assert_tree_equal(g, before)
        mu = np.clip(g["w"], -10, 10) + np.float32(0.9) * mu
        want = {"b": np.clip(g["b"], -0.5, 0.5), "w": mu.copy(), "d": np.clip(g["d"], -0.5, 0.5)}
        assert_bits_equal(plain(u), plain(want))
        kept.append((u, want))
    for u, want in kept:  # each call wrote elsewhere than what the caller held
        assert_bits_equal(plain(u), plain(want))
    moves = [s for q in nba.explain(tx, p, state).passes for s in q.stages]
    assert not [s for s in moves if "the kept leaves in" in s], moves
    # trace's label only: it writes its own buffer
    assert len([s for s in moves if "the updates out" in s]) == 1, moves
