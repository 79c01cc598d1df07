"""State and buffer semantics (API.md) and bad input: clear errors, state left untouched."""

import numpy as np
import pytest

import numbaccum as nba

TXS = {
    "trace": lambda: nba.trace(0.9, nesterov=True),
    "ema": lambda: nba.ema(0.9),
    "apply_every": lambda: nba.apply_every(2),
    "multisteps": lambda: nba.MultiSteps(nba.adam(1e-2), 2),
    "multisteps_sum_skip": lambda: nba.MultiSteps(
        nba.sgd(0.1, momentum=0.9), 1, use_grad_mean=False, should_skip_update_fn=nba.skip_not_finite
    ),
    "chain": lambda: nba.chain(nba.trace(0.5), nba.add_decayed_weights(1e-2), nba.scale(-0.1)),
    "adam": lambda: nba.adam(1e-3),
    "sgd_schedule": lambda: nba.sgd(lambda c: 0.1 / (1 + c)),
}


def params():
    rng = np.random.default_rng(0)
    return {
        "dense": {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": np.zeros(4, np.float32)},
        "scale": np.array(1.5, np.float64),
        "empty": np.zeros((0, 2), np.float32),
    }


def grads(seed):
    rng = np.random.default_rng(seed)
    return nba.tree_map(lambda p: rng.standard_normal(p.shape).astype(p.dtype), params())


def snapshot(tree):
    return [x.copy() for x in nba.tree_flatten(tree)[0]]


def state_arrays(state):
    out = []
    for leaf in nba.tree_flatten(state)[0]:
        out.append(np.array(leaf, copy=True))
    return out


def assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("name", sorted(TXS))
def test_inputs_untouched_outputs_never_alias(name):
    tx = TXS[name]()
    p = params()
    state = tx.init(p)
    for step in range(4):
        g = grads(step)
        g_before, p_before = snapshot(g), snapshot(p)
        u, state = tx.update(g, state, p)
        assert_bitwise_equal(snapshot(g), g_before)
        assert_bitwise_equal(snapshot(p), p_before)
        assert nba.tree_flatten(u)[1] == nba.tree_flatten(p)[1]
        for x, y in zip(nba.tree_flatten(u)[0], nba.tree_flatten(p)[0]):
            assert x.dtype == y.dtype and x.shape == y.shape
        state_leaves = nba.tree_flatten(state)[0]
        for x in nba.tree_flatten(u)[0]:
            for other in nba.tree_flatten(g)[0] + nba.tree_flatten(p)[0]:
                assert not np.may_share_memory(x, other)
            for s in state_leaves:
                if isinstance(s, np.ndarray):
                    assert not np.may_share_memory(x, s)


@pytest.mark.parametrize("name", sorted(TXS))
def test_flattree_in_flattree_out_and_same_numbers(name):
    tx = TXS[name]()
    p = params()
    pf = nba.FlatTree.from_tree(p)
    s_plain, s_flat = tx.init(p), tx.init(pf)
    for step in range(3):
        g = grads(step)
        u1, s_plain = tx.update(g, s_plain, p)
        u2, s_flat = tx.update(nba.FlatTree.from_tree(g), s_flat, pf)
        assert isinstance(u2, nba.FlatTree)
        for x, y in zip(nba.tree_flatten(u1)[0], nba.tree_flatten(u2.tree)[0]):
            assert x.tobytes() == y.tobytes()


def test_views_of_a_flattree_are_used_without_copy():
    p = params()
    tx = nba.ema(0.9)
    s = tx.init(p)
    g = nba.FlatTree.from_tree(grads(1))
    u1, s = tx.update(g.tree, s)  # the leaves are views of g's buffers: zero-copy path
    assert s.ema.workspace_of("input").buffer is None  # never packed: no buffer made


def test_copy_state_is_independent():
    tx = nba.MultiSteps(nba.adam(1e-2), 3)
    p = params()
    s = tx.init(p)
    _, s = tx.update(grads(0), s, p)
    snap = nba.copy_state(s)
    before = state_arrays(snap)
    _, s = tx.update(grads(1), s, p)
    assert_bitwise_equal(state_arrays(snap), before)
    # continuing from the snapshot reproduces the same step
    u_a, _ = tx.update(grads(1), nba.copy_state(snap), p)
    u_b, _ = tx.update(grads(1), snap, p)
    assert_bitwise_equal(snapshot(u_a), snapshot(u_b))


def test_apply_updates_keeps_param_dtype_and_in_place():
    p = params()
    u = nba.tree_map(lambda x: np.ones(x.shape, np.float64), p)
    new = nba.apply_updates(p, u)
    assert new["dense"]["w"].dtype == np.float32
    np.testing.assert_allclose(new["dense"]["w"], p["dense"]["w"] + 1)
    before = snapshot(p)
    nba.apply_updates_(p, u)
    for x, y in zip(nba.tree_flatten(p)[0], before):
        np.testing.assert_allclose(x, y + 1)
    pf = nba.FlatTree.from_tree(params())
    out = nba.apply_updates_(pf, u)
    assert out is pf


# --- bad input ------------------------------------------------------------------------------


def bad_inputs():
    g = grads(0)
    yield "missing key", {"dense": g["dense"], "scale": g["scale"]}, ValueError, r"updates"
    wrong_shape = grads(0)
    wrong_shape["dense"]["w"] = np.zeros((4, 3), np.float32)
    yield "shape", wrong_shape, ValueError, r"updates\['dense'\]\['w'\]: shape"
    ints = grads(0)
    ints["dense"]["b"] = np.zeros(4, np.int32)
    yield "int leaf", ints, TypeError, r"updates\['dense'\]\['b'\]: dtype int32"
    lists = grads(0)
    lists["dense"]["b"] = [0.0] * 4
    yield "list leaf", lists, ValueError, r"updates\['dense'\]\['b'\]"
    yield "not a tree", "abc", (TypeError, ValueError), r"updates"


@pytest.mark.parametrize("name", sorted(TXS))
def test_bad_updates_raise_before_touching_state(name):
    tx = TXS[name]()
    p = params()
    state = tx.init(p)
    _, state = tx.update(grads(0), state, p)
    before = state_arrays(state)
    for what, bad, exc, match in bad_inputs():
        with pytest.raises(exc, match=match):
            tx.update(bad, state, p)
        assert_bitwise_equal(state_arrays(state), before), what
    _, state = tx.update(grads(1), state, p)  # the state still works


def test_bad_params_raise_before_touching_state():
    tx = nba.chain(nba.trace(0.9), nba.add_decayed_weights(0.1))
    p = params()
    state = tx.init(p)
    before = state_arrays(state)
    bad = params()
    bad["dense"]["w"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match=r"params\['dense'\]\['w'\]: shape"):
        tx.update(grads(0), state, bad)
    assert_bitwise_equal(state_arrays(state), before)


def test_missing_params_is_a_value_error():
    tx = nba.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads(0), tx.init(params()))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: nba.trace(1.5), "decay"),
        (lambda: nba.ema(-0.1), "decay"),
        (lambda: nba.apply_every(0), "k must be >= 1"),
        (lambda: nba.MultiSteps(nba.sgd(1.0), 0), "every_k_schedule"),
        (lambda: nba.scale_by_adam(b1=2.0), "b1"),
        (lambda: nba.global_norm({"a": np.ones(2)}, ord=3), "ord"),
    ],
)
def test_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_accumulator_dtype():
    with pytest.raises(TypeError, match="accumulator_dtype"):
        nba.trace(0.9, accumulator_dtype=np.int32)


def test_schedule_returning_zero_raises_before_touching_state():
    tx = nba.MultiSteps(nba.sgd(1.0), lambda step: 2 - step)
    p = params()
    s = tx.init(p)
    for i in range(3):  # k = 2, then k = 1
        _, s = tx.update(grads(i), s, p)
    assert int(s.gradient_step) == 2
    before = state_arrays(s)
    with pytest.raises(ValueError, match="every_k_schedule returned 0"):
        tx.update(grads(5), s, p)
    assert_bitwise_equal(state_arrays(s), before)


def test_skip_fn_must_return_bool_scalar():
    tx = nba.MultiSteps(nba.sgd(1.0), 2, should_skip_update_fn=lambda u, s, p: (np.array([True, False]), ()))
    p = params()
    s = tx.init(p)
    with pytest.raises(ValueError, match="bool scalar"):
        tx.update(grads(0), s, p)


def test_state_of_other_layout_is_rejected():
    tx = nba.trace(0.9)
    s = tx.init({"a": np.zeros(3)})
    with pytest.raises(ValueError, match="updates"):
        tx.update({"a": np.zeros(4)}, s)


def test_non_emitting_zeros_are_read_only_and_positive():
    tx = nba.MultiSteps(nba.sgd(1.0), 3)
    p = params()
    s = tx.init(p)
    u, s = tx.update(grads(0), s, p)
    w = u["dense"]["w"]
    assert not w.flags.writeable
    assert not np.signbit(w).any() and not w.any()
    flat, s = tx.update(nba.FlatTree.from_tree(grads(1)), s, nba.FlatTree.from_tree(p))
    assert not any(g.flags.writeable for g in flat.groups) and not flat["dense"]["w"].flags.writeable


def test_mixed_float16_tree_multisteps_accumulates_in_float32():
    p = {"h": np.ones(3, np.float16), "s": np.ones(2, np.float32), "d": np.ones(2, np.float64)}
    tx = nba.MultiSteps(nba.sgd(1.0), 2)
    s = tx.init(p)
    assert s.acc_grads["h"].dtype == np.float32 and s.acc_grads["d"].dtype == np.float64
    g1 = {"h": np.full(3, 1.0, np.float16), "s": np.full(2, 2.0, np.float32), "d": np.full(2, 3.0)}
    g2 = {"h": np.full(3, 2.0, np.float16), "s": np.full(2, 4.0, np.float32), "d": np.full(2, 6.0)}
    _, s = tx.update(g1, s, p)
    u, s = tx.update(g2, s, p)
    assert u["h"].dtype == np.float16 and u["s"].dtype == np.float32 and u["d"].dtype == np.float64
    np.testing.assert_array_equal(u["h"], [-1.5] * 3)
    np.testing.assert_array_equal(u["s"], [-3.0] * 2)
    np.testing.assert_array_equal(u["d"], [-4.5] * 2)


def test_extra_args_reach_the_inner_optimizer_of_multisteps():
    seen = []

    def init(params):
        return nba.EmptyState()

    def update(updates, state, params=None, *, loss):
        seen.append(loss)
        return nba.tree_map(lambda g: g * loss, updates), state

    tx = nba.MultiSteps(nba.GradientTransformationExtraArgs(init, update), 2)
    p = {"w": np.ones(2, np.float32)}
    s = tx.init(p)
    u, s = tx.update({"w": np.ones(2, np.float32)}, s, p, loss=3.0)
    u, s = tx.update({"w": np.ones(2, np.float32)}, s, p, loss=3.0)
    assert seen == [3.0]  # the inner optimizer runs only on the emitting step
    np.testing.assert_array_equal(u["w"], [3.0, 3.0])


def test_apply_every_starts_each_cycle_from_zero_so_nan_does_not_stick():
    tx = nba.apply_every(2)
    s = tx.init(np.zeros(1))
    out = []
    for g in (np.nan, 1.0, 2.0, 3.0, 4.0):
        u, s = tx.update(np.array([g]), s)
        out.append(float(u[0]))
    np.testing.assert_array_equal(out, [0.0, np.nan, 0.0, 5.0, 0.0])  # optax: NaN from step 2 on


@pytest.mark.parametrize("lr", [1e-2, lambda count: 1e-2 / (1.0 + count)])
def test_fused_adam_is_bitwise_the_chain(lr):
    p = params()
    fused, chained = nba.adam(lr), nba.chain(nba.scale_by_adam(), nba.scale_by_learning_rate(lr))
    s1, s2 = fused.init(p), chained.init(p)
    for step in range(4):
        u1, s1 = fused.update(grads(step), s1, p)
        u2, s2 = chained.update(grads(step), s2, p)
        assert_bitwise_equal(snapshot(u1), snapshot(u2))
    assert_bitwise_equal(state_arrays(s1), state_arrays(s2))


def test_warmup_compiles_ahead_and_checks_its_arguments():
    assert nba.warmup(dtypes=("float64",), backend="cpu") == ["cpu"]
    with pytest.raises(ValueError, match="backend"):
        nba.warmup(backend="tpu")
    with pytest.raises(TypeError, match="dtypes"):
        nba.warmup(dtypes=("int32",), backend="cpu")


def test_warmup_of_a_transformation_leaves_nothing_to_compile_in_the_loop():
    """``warmup(tx, params)`` compiles what the loop will run (issue 24, item 5): in a fresh
    process without a kernel cache, a MultiSteps loop of masked AdamW with a clip, through
    ``update`` + ``apply_updates_`` and ``step_``, emitting steps and clipped and unclipped
    gradients included, compiles nothing after it (without warmup, its first steps compile a
    dozen kernels: 2 s each on a small machine)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    child = Path(__file__).resolve().parent / "_warmup_child.py"
    root = Path(nba.__file__).resolve().parent.parent
    env = dict(os.environ, NUMBACCUM_CACHE_DIR="off", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, str(child)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["compiled_after_warmup"] == []


def test_warmup_takes_a_transformation_or_the_dtypes():
    params = {"w": np.zeros(3, np.float32)}
    assert nba.warmup(nba.ema(0.9), params) == ["cpu"]
    assert nba.warmup(["float32"], backend="cpu") == ["cpu"]  # the first argument was the dtypes
    with pytest.raises(TypeError, match="params"):
        nba.warmup(nba.ema(0.9))
    with pytest.raises(TypeError, match="tx must be a transformation"):  # not silently the dtypes
        nba.warmup(nba.ema, params)
    assert params["w"].tolist() == [0.0, 0.0, 0.0]  # nothing of the caller's changed
