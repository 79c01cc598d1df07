"""The chain compiler (`numbaccum.fuse`): fused and stage-by-stage give the same bits.

Every test runs one recipe twice, fused (the default) and with ``NUMBACCUM_FUSE=0``, on the
same gradients, and compares updates and states bit for bit; some also against
``tests/reference.py``. Random chains draw their stages, order and length with hypothesis, over
random trees (mixed float32/float64 leaves, 0-d and size-0 ones).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _testutil import assert_bits_equal, assert_tree_close, assert_tree_equal, quick_and_long, ref, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from registry import CASES, cases
from strategies import tree_sequences

import numbaccum as nb
from numbaccum import fuse

# name -> (numbaccum constructor, reference constructor or None)
POOL = {
    "trace": (lambda: nb.trace(0.9), lambda: ref.trace(0.9)),
    "trace_nesterov_f64": (
        lambda: nb.trace(0.5, nesterov=True, accumulator_dtype=np.float64),
        lambda: ref.trace(0.5, nesterov=True, accumulator_dtype=np.float64),
    ),
    "ema": (lambda: nb.ema(0.9), lambda: ref.ema(0.9)),
    "ema_nodebias": (lambda: nb.ema(0.75, debias=False), lambda: ref.ema(0.75, debias=False)),
    "scale": (lambda: nb.scale(-0.3), lambda: ref.scale(-0.3)),
    "scale_by_adam": (lambda: nb.scale_by_adam(), lambda: ref.scale_by_adam()),
    "adam": (lambda: nb.adam(1e-2), lambda: ref.adam(1e-2)),
    "sgd": (lambda: nb.sgd(0.1, momentum=0.9), lambda: ref.sgd(0.1, momentum=0.9)),
    "sgd_plain": (lambda: nb.sgd(0.1), lambda: ref.sgd(0.1)),
    "add_decayed_weights": (lambda: nb.add_decayed_weights(0.1), lambda: ref.add_decayed_weights(0.1)),
    "scale_by_sign": (lambda: nb.scale_by_sign(), lambda: ref.scale_by_sign()),
    "lr_schedule": (
        lambda: nb.scale_by_learning_rate(lambda c: 0.1 / (1 + int(c))),
        lambda: ref.scale_by_learning_rate(lambda c: 0.1 / (1 + int(c))),
    ),
    "clip_by_global_norm": (lambda: nb.clip_by_global_norm(1.0), None),
    "clip": (lambda: nb.clip(0.5), None),
    "normalize": (lambda: nb.normalize_by_update_norm(2.0), None),
    "zero_nans": (lambda: nb.zero_nans(), None),  # not fusable: splits a run
    # optax's optimizer library (numbaccum.optimizers)
    "adamw": (lambda: nb.adamw(1e-2, weight_decay=0.1), lambda: ref.adamw(1e-2, weight_decay=0.1)),
    "nadam": (lambda: nb.nadam(1e-2), lambda: ref.nadam(1e-2)),
    "amsgrad": (lambda: nb.amsgrad(1e-2), lambda: ref.amsgrad(1e-2)),
    "adamax": (lambda: nb.adamax(1e-2), lambda: ref.adamax(1e-2)),
    "adabelief": (lambda: nb.adabelief(1e-2), lambda: ref.adabelief(1e-2)),
    "lion": (lambda: nb.lion(1e-2), lambda: ref.lion(1e-2)),
    "rmsprop_centered": (
        lambda: nb.rmsprop(1e-2, centered=True, momentum=0.9),
        lambda: ref.rmsprop(1e-2, centered=True, momentum=0.9),
    ),
    "adagrad": (lambda: nb.adagrad(1e-1), lambda: ref.adagrad(1e-1)),
    "masked_decay": (
        lambda: nb.add_decayed_weights(0.1, lambda t: nb.tree_map(lambda x: x.ndim > 1, t)),
        None,
    ),
}

# ... and every other stage of the registry (tests/registry.py) that a chain may fuse: the norm
# family, the adaptive clippers, the optimizer library.
POOL |= {n: (CASES[n].make, CASES[n].reference) for n in cases(fusable=True) if n not in POOL}

WITH_REFERENCE = [n for n in sorted(POOL) if POOL[n][1] is not None]


def _run(make, params, grads, fused: bool, via_step: bool = False):
    """(updates per step, final state) with fusion on or off; ``via_step``: `numbaccum.step_`
    on a copy of params (the params after each step are the result)."""
    old = os.environ.get("NUMBACCUM_FUSE")
    os.environ["NUMBACCUM_FUSE"] = "1" if fused else "0"
    try:
        tx = make()
        state = tx.init(params)
        outs = []
        p = snapshot(params)
        for g in grads:
            if via_step:
                state = nb.step_(tx, g, state, p)
                outs.append(snapshot(p))
            else:
                u, state = tx.update(g, state, params)
                outs.append(snapshot(u))
        return outs, snapshot_state(state)
    finally:
        if old is None:
            del os.environ["NUMBACCUM_FUSE"]
        else:
            os.environ["NUMBACCUM_FUSE"] = old


def snapshot_state(state):
    """A state's leaves as independent arrays (FlatTrees as plain trees)."""
    if isinstance(state, nb.FlatTree):
        return snapshot(state)
    if isinstance(state, dict):
        return {k: snapshot_state(v) for k, v in state.items()}
    if isinstance(state, (tuple, list)):
        return tuple(snapshot_state(v) for v in state)
    return np.array(state, copy=True)


def _same(a, b, msg=""):
    (ua, sa), (ub, sb) = a, b
    assert len(ua) == len(ub), msg
    for i, (x, y) in enumerate(zip(ua, ub)):
        assert_bits_equal(x, y, where=f"{msg} step {i}")
    assert_bits_equal(sa, sb, where=f"{msg} state")


def _state_leaves(s):
    return ref.tree_leaves(s)


def _chain(names):
    return lambda: nb.chain(*(POOL[n][0]() for n in names))


def _random_chain_fused_equals_stage_by_stage(names, data):
    params, grads = data
    make = _chain(names)
    _same(_run(make, params, grads, True), _run(make, params, grads, False), msg=str(names))


# Each chain drawn compiles its own fused kernels: 5 in the README's command, 14 in the exhaustive
# step (the recipes' and the opaque stages' tests below fuse every kind of part every run).
test_random_chains_fused_equal_stage_by_stage, test_random_chains_fused_equal_stage_by_stage_long = quick_and_long(
    _random_chain_fused_equals_stage_by_stage,
    st.lists(st.sampled_from(sorted(POOL)), min_size=1, max_size=5),
    tree_sequences(max_steps=3, max_leaves=4, allow_none=False),
    quick=5,
    long=14,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    names=st.lists(st.sampled_from(WITH_REFERENCE), min_size=1, max_size=4),
    data=tree_sequences(max_steps=3, max_leaves=4, allow_none=False),
)
def test_random_chains_against_reference(names, data):
    params, grads = data
    outs, _ = _run(_chain(names), params, grads, True)
    rtx = ref.chain(*(POOL[n][1]() for n in names))
    rstate = rtx.init(params)
    for i, g in enumerate(grads):
        expected, rstate = rtx.update(g, rstate, params)
        assert_tree_close(outs[i], expected, rtol=2e-5, atol_rel=2e-5, msg=f"{names} step {i}")


PARAMS = {
    "w": np.linspace(-2, 2, 70000, dtype=np.float32).reshape(350, 200),  # a parallel-sized group
    "b": np.linspace(-1, 1, 7).astype(np.float64),
    "s": np.float32(0.5),
    "e": np.zeros((0, 3), np.float32),
}


def _grads(n=3, seed=0, params=PARAMS):
    rng = np.random.default_rng(seed)
    return [
        {k: (rng.standard_normal(np.shape(v)) * 2).astype(np.asarray(v).dtype) for k, v in params.items()}
        for _ in range(n)
    ]


RECIPES = {
    "issue_chain": lambda: nb.chain(nb.clip_by_global_norm(1.0), nb.ema(0.9), nb.trace(0.9), nb.scale(-1e-3)),
    "clip_adam": lambda: nb.chain(nb.clip_by_global_norm(1.0), nb.adam(1e-3)),
    "nested": lambda: nb.chain(
        nb.clip_by_global_norm(0.5),
        nb.chain(nb.scale_by_adam(), nb.add_decayed_weights(1e-2)),
        nb.scale(-0.1),
    ),
    "named": lambda: nb.named_chain(("clip", nb.clip_by_global_norm(1.0)), ("opt", nb.sgd(0.1, 0.9))),
    "multisteps": lambda: nb.MultiSteps(nb.chain(nb.clip_by_global_norm(1.0), nb.adam(1e-3)), 2),
    "apply_if_finite": lambda: nb.apply_if_finite(nb.chain(nb.trace(0.9), nb.scale(-0.1)), 2),
    "split_by_zero_nans": lambda: nb.chain(nb.ema(0.5), nb.zero_nans(), nb.trace(0.9), nb.scale(0.1)),
    "clip_mid_chain": lambda: nb.chain(nb.ema(0.5), nb.clip_by_global_norm(0.1), nb.trace(0.9)),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_fused_equal_stage_by_stage(name):
    grads = _grads(4)
    grads[2]["b"][1] = np.nan  # apply_if_finite skips it; the others carry a NaN through
    _same(_run(RECIPES[name], PARAMS, grads, True), _run(RECIPES[name], PARAMS, grads, False), msg=name)


def test_float16_groups_run_one_formula_at_a_time_with_the_same_bits():
    params = {"h": np.linspace(-1, 1, 9).astype(np.float16), "f": np.ones(3, np.float32)}
    grads = _grads(3, 1, params)
    make = RECIPES["issue_chain"]
    _same(_run(make, params, grads, True), _run(make, params, grads, False))
    acc = lambda: nb.chain(nb.trace(0.9, accumulator_dtype=np.float16), nb.scale(2.0))  # noqa: E731
    _same(_run(acc, PARAMS, _grads(2), True), _run(acc, PARAMS, _grads(2), False))


def _count_kernels(monkeypatch):
    """Counts the elementwise kernels the CPU driver runs (formula names)."""
    from numbaccum.cpu import driver

    seen: list[str] = []
    monkeypatch.setattr(driver, "observers", [lambda f: seen.append(f.name)])
    return seen


def test_a_fused_run_is_one_kernel_per_dtype_group(monkeypatch):
    tx = RECIPES["issue_chain"]()
    state = tx.update(_grads(1)[0], tx.init(PARAMS))[1]
    seen = _count_kernels(monkeypatch)
    state = tx.update(_grads(1)[0], state)[1]
    assert len(seen) == 2 and all(n.startswith("fused_") for n in seen), seen  # float32, float64
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    seen.clear()
    tx.update(_grads(1)[0], state)
    assert sorted(set(seen)) == ["ema", "scale", "trace_update"] and len(seen) == 3 * 2, (
        seen
    )  # + settling the scale


def test_a_long_run_is_cut_below_numbas_argument_limit():
    make = lambda: nb.chain(*(nb.adam(1e-2) for _ in range(4)), nb.trace(0.5))  # noqa: E731
    from numbaccum.flat import layout_of
    from numbaccum.updates import Spec

    from numbaccum.runner import Plan

    stage = make().update.__self__
    spec = Spec(layout_of(PARAMS, "params"), False)
    plan = Plan(stage.declare(spec, stage.init(PARAMS)), spec, True, [])
    assert len(plan.runs) >= 2 and all(r is not None for _, _, r in plan.runs)
    assert all(sum(fuse._cost(p) for p in plan.leaves[a:b]) <= fuse.MAX_ARGS for a, b, _ in plan.runs)
    _same(_run(make, PARAMS, _grads(2), True), _run(make, PARAMS, _grads(2), False))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_learning_rate_is_read_without_a_division(dtype):
    """A factor whose div is 1 (a learning rate) is read by the fused pass as ``x * mul``: the
    bits of ``(x / 1) * mul``, which the stage-by-stage passes compute (zeros of both signs,
    subnormals, infinities, NaN, the largest values), one division less per element."""
    info = np.finfo(dtype)
    edge = np.array(
        [0.0, -0.0, info.smallest_subnormal, -info.tiny, np.inf, -np.inf, np.nan, 1.5, -info.max], dtype
    )
    with np.errstate(over="ignore", invalid="ignore"):  # -max * 2 is -inf, as meant
        grads = [{"w": np.tile(edge, 8000) * dtype(k + 1)} for k in range(2)]  # a parallel-sized leaf
    params = {"w": np.linspace(-1, 1, grads[0]["w"].size).astype(dtype)}

    def make():
        return nb.chain(nb.trace(0.5), nb.scale(-0.3), nb.ema(0.9), nb.scale(0.7))

    fused = _run(make, params, grads, True)[0]
    sources = [fuse.composite_source(key)[1] for key, _ in fuse._COMPOSITES if key[0] == np.dtype(dtype).name]
    assert any(f"as_{np.dtype(dtype).name}(v) * " in src for src in sources)  # read as x * mul
    for a, b in zip(fused, _run(make, params, grads, False)[0]):
        assert np.array_equal(a["w"].view(np.uint8), b["w"].view(np.uint8))  # every bit, NaN's too


@pytest.mark.parametrize("then_ema", [False, True])  # the rate settled at the end, or read by a kernel
def test_tiny_learning_rates_between_ordinary_ones_keep_the_stage_by_stage_bits(then_ema):
    """Learning rates far below 2**-99 (a float32 subnormal among them: cast to float32 as optax
    casts it, never balanced, issue 47) between ordinary ones: every step has the stage-by-stage
    bits whichever rate the previous step used."""
    lrs = [0.5, 1e-35, 0.25, 3e-33, 1e-40, 0.5]
    grads = [{"w": np.linspace(-3, 3, 70000).astype(np.float32) * (k + 1)} for k in range(len(lrs))]
    params = {"w": np.zeros(70000, np.float32)}

    def make():
        parts = [nb.trace(0.5), nb.scale_by_schedule(lambda t: lrs[int(t)])]
        return nb.chain(*parts, *([nb.ema(0.9)] if then_ema else []))

    fused = [u["w"] for u in _run(make, params, grads, True)[0]]
    staged = [u["w"] for u in _run(make, params, grads, False)[0]]
    for k, (a, b) in enumerate(zip(fused, staged)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"step {k}"
    if not then_ema:  # the tiny rate was applied, not dropped or taken for 1
        assert np.any(fused[1] != 0) and np.all(np.abs(fused[1]) < 1e-30)


def test_composites_are_cached_by_formulas_not_objects():
    a, b = RECIPES["issue_chain"](), RECIPES["issue_chain"]()
    g = _grads(1)[0]
    a.update(g, a.init(PARAMS))
    n = fuse.cached_composites()
    b.update(g, b.init(PARAMS))
    assert fuse.cached_composites() == n
    memos = [m for m in fuse._COMPOSITES if m[0][2] and m[0][2][0][0] == "kernel" and m[0][2][0][1] == "ema"]
    names = {fuse._COMPOSITES[m].name for m in memos}
    assert len(names) == len(memos) and all(n.startswith("fused_") for n in names)
    # the name is derived from the key only: the same in any process
    key, callees = memos[0]
    assert fuse.composite_source(key)[0] == fuse._COMPOSITES[key, callees].name
    assert [f.name for f in callees] == [op[1] for op in key[2] if op[0] == "kernel"]


def test_a_failing_plan_leaves_a_fused_chain_unchanged():
    tx = nb.chain(nb.trace(0.9), nb.ema(0.9), nb.add_decayed_weights(0.1))
    state = tx.init(PARAMS)
    before = snapshot_state(state)
    with pytest.raises(ValueError, match="params"):
        tx.update(_grads(1)[0], state)  # add_decayed_weights needs params: planned before running
    assert_tree_equal(_state_leaves(snapshot_state(state)), _state_leaves(before))


# --- step_ ----------------------------------------------------------------------------------

STEP_RECIPES = {
    **{k: RECIPES[k] for k in ("issue_chain", "clip_adam", "nested", "named", "multisteps")},
    "split_by_zero_nans": RECIPES["split_by_zero_nans"],
    "adam_alone": lambda: nb.adam(1e-2),
    "trace_alone": lambda: nb.trace(0.9),
    "not_fusable_last": lambda: nb.chain(nb.adam(1e-2), nb.zero_nans()),
    "decayed_weights_last": lambda: nb.chain(nb.scale_by_adam(), nb.add_decayed_weights(0.1), nb.scale(-0.1)),
    "multisteps_decay_sum": lambda: nb.MultiSteps(
        nb.chain(nb.scale_by_adam(), nb.add_decayed_weights(0.1), nb.scale(-0.1)), 2, use_grad_mean=False
    ),
    "multisteps_skip": lambda: nb.MultiSteps(nb.sgd(0.1, 0.9), 1, should_skip_update_fn=nb.skip_not_finite),
    "multisteps_not_fusable": lambda: nb.MultiSteps(nb.chain(nb.adam(1e-2), nb.zero_nans()), 2),
    # a last stage that fuses nothing: the learning rate settled in the apply's pass
    "sm3_last": lambda: nb.sm3(0.1),
    "multisteps_sm3": lambda: nb.MultiSteps(nb.sm3(0.1), 2),
    "clip_sm3_clip": lambda: nb.chain(nb.clip_by_global_norm(1.0), nb.sm3(0.1), nb.clip_by_global_norm(0.01)),
}


def _update_and_apply(make, params, grads):
    tx = make()
    state = tx.init(params)
    p = snapshot(params)
    outs = []
    for g in grads:
        u, state = tx.update(g, state, p)
        nb.apply_updates_(p, u)
        outs.append(snapshot(p))
    return outs, snapshot_state(state)


@pytest.mark.parametrize("name", sorted(STEP_RECIPES))
def test_step_equals_update_then_apply_updates(name):
    params = {k: np.array(v) for k, v in PARAMS.items() if np.ndim(v)}  # writable leaves
    grads = [{k: g[k] for k in params} for g in _grads(3)]
    make = STEP_RECIPES[name]
    # step_ updates params in place from the params it is given (weight decay reads them)
    got = _run_step(make, params, grads)
    _same(got, _update_and_apply(make, params, grads), msg=name)


def _run_step(make, params, grads, flat=False):
    tx = make()
    state = tx.init(params)
    p = nb.FlatTree.from_tree(params) if flat else snapshot(params)
    outs = []
    for g in grads:
        state = nb.step_(tx, g, state, p)
        outs.append(snapshot(p.tree if flat else p))
    return outs, snapshot_state(state)


# A last stage that fuses nothing (a per-leaf reduction, user code) leaves the learning rate
# pending: step_ settles it in the apply's pass (`fuse.apply_settled`), one pass instead of two,
# with the bits of update + apply_updates_ in every dtype the apply promotes.
def _user_halving():
    """A user-written transformation: NumPy code the runner cannot see into (opaque)."""
    return nb.GradientTransformation(
        lambda params: nb.EmptyState(), lambda u, s, params=None: (nb.tree_map(lambda g: g * 0.5, u), s)
    )


OPAQUE_LAST = {
    "user_then_lr": lambda: nb.chain(_user_halving(), nb.scale(-0.3)),
    "sm3": lambda: nb.sm3(0.3),
    "adafactor": lambda: nb.adafactor(0.3),
    "novograd": lambda: nb.novograd(0.3),
    "clip_user_lr": lambda: nb.chain(nb.clip_by_global_norm(0.5), _user_halving(), nb.scale(-0.3)),
    "sm3_then_clip": lambda: nb.chain(nb.sm3(0.3), nb.clip_by_global_norm(0.01)),  # the norm's factor
}
# float32, and params wider than the updates, in the README's command; the other dtypes (each
# compiles every recipe again) in the exhaustive step.
EXHAUSTIVE = pytest.mark.exhaustive
OPAQUE_DTYPES = [
    ("float32", "float32"),
    pytest.param("float64", "float64", marks=EXHAUSTIVE),
    pytest.param("float16", "float16", marks=EXHAUSTIVE),
    pytest.param("bfloat16", "bfloat16", marks=EXHAUSTIVE),
    ("float64", "float32"),  # params wider than the updates: added in float64, rounded once
    pytest.param("float32", "bfloat16", marks=EXHAUSTIVE),
]


@pytest.mark.parametrize("name", sorted(OPAQUE_LAST))
@pytest.mark.parametrize(("pdt", "gdt"), OPAQUE_DTYPES)
def test_step_after_an_opaque_stage_settles_the_factor_in_the_apply(name, pdt, gdt):
    if "bfloat16" in (pdt, gdt):
        ml_dtypes = pytest.importorskip("ml_dtypes")
        pdt, gdt = (ml_dtypes.bfloat16 if d == "bfloat16" else d for d in (pdt, gdt))
    rng = np.random.default_rng(3)
    shapes = {"w": (350, 200), "b": (7,), "m": (5, 3)}
    params = {k: rng.standard_normal(s).astype(pdt) for k, s in shapes.items()}
    grads = [{k: (2 * rng.standard_normal(s)).astype(gdt) for k, s in shapes.items()} for _ in range(3)]
    make = OPAQUE_LAST[name]
    ex = nb.explain(make(), params, apply=True)
    assert ex.passes[-1].kind == "apply" and ex.passes[-1].stages == ("pending factor", "apply_updates_")
    assert ex.passes[-2].kind != "settle", ex  # the trailing factor: settled in the apply's pass
    got = _run_step(make, params, grads)
    _same(got, _update_and_apply(make, params, grads), msg=f"{name} {pdt}/{gdt}")
    got_flat = _run_step(make, params, grads, flat=True)
    _same(got_flat, got, msg=f"{name} {pdt}/{gdt} on a FlatTree")


def test_step_after_an_opaque_stage_writes_no_settled_copy(monkeypatch):
    """The pending factor is read by the apply's kernel: no scale pass settles the updates (a
    copy handed to the user's code, factor one, would be its own; it is handed a lent
    workspace, with no copy at all)."""
    params = {k: np.array(v) for k, v in PARAMS.items() if np.ndim(v)}
    grads = _grads(2)
    tx = nb.chain(_user_halving(), nb.scale(-0.3))
    state = tx.init(params)
    state = nb.step_(tx, {k: grads[0][k] for k in params}, state, params)  # planned, compiled
    calls = []
    for ops in {nb.backend.ops_for(np.zeros(1, d)) for d in (np.float32, np.float64)}:
        orig = ops.scale_
        monkeypatch.setattr(ops, "scale_", lambda *a, _o=orig, **k: calls.append(a) or _o(*a, **k))
    before = {k: v.copy() for k, v in params.items()}
    nb.step_(tx, {k: grads[1][k] for k in params}, state, params)
    assert all(f.is_one for *_, f in calls)
    for k in params:  # and the step is the one asked for
        np.testing.assert_allclose(params[k], before[k] - 0.3 * (0.5 * np.asarray(grads[1][k])), rtol=1e-6)


def test_step_on_a_flat_tree_never_writes_the_update_buffer(monkeypatch):
    params = {k: np.array(v) for k, v in PARAMS.items() if np.ndim(v)}
    grads = [{k: g[k] for k in params} for g in _grads(2)]
    make = RECIPES["clip_adam"]
    _same(_run_step(make, params, grads, flat=True), _update_and_apply(make, params, grads))
    tx = make()
    state = tx.init(params)
    p = nb.FlatTree.from_tree(params)
    seen = _count_kernels(monkeypatch)
    nb.step_(tx, grads[0], state, p)
    assert len(seen) == 2 and all(n.startswith("fused_") for n in seen), seen  # one per group


def test_step_refuses_read_only_params_before_writing():
    params = {"w": np.ones(3, np.float32)}
    params["w"].flags.writeable = False
    tx = nb.trace(0.9)
    state = tx.init(params)
    with pytest.raises(TypeError, match="params"):
        nb.step_(tx, {"w": np.ones(3, np.float32)}, state, params)
    assert np.all(state.trace.groups[0] == 0)


# --- explain --------------------------------------------------------------------------------


def test_explain_lists_the_passes_and_bytes():
    params = {"w": np.ones((100, 10), np.float32)}
    tx = RECIPES["issue_chain"]()
    fused = nb.explain(tx, params)
    assert [p.kind for p in fused.passes] == ["reduction", "fused"]
    assert fused.passes[1].stages == ("clip_by_global_norm", "ema", "trace", "scale")
    assert fused.total == fused.minimum == 28.0  # norm read 4; g 4, ema 8, trace 8, out 4
    staged = nb.explain(tx, params, fused=False)
    assert [p.kind for p in staged.passes] == ["reduction", "kernel", "kernel", "settle"]
    assert staged.total == 44.0
    text = str(fused)
    assert "2 passes" in text and "ema + trace" in text and "minimum 28.0" in text
    applied = nb.explain(RECIPES["clip_adam"](), params, apply=True)
    assert applied.passes[-1].stages[-1] == "apply to params" and applied.total == 32.0
    # Stage by stage, adam is its chain: the direction's pass, then the learning rate settled
    # (12 B/param), then apply_updates_.
    assert nb.explain(RECIPES["clip_adam"](), params, apply=True, fused=False).total == 48.0
    ms = RECIPES["multisteps"]()  # k = 2
    state = ms.init(params)
    first = nb.explain(ms, params, state)
    assert [p.stages for p in first.passes] == [("multisteps (accumulate)",)] and first.total == 8.0
    emitting = nb.explain(ms, params, state._replace(mini_step=np.int32(1)))
    kinds = [p.kind for p in emitting.passes]
    assert kinds == ["kernel", "reduction", "fused", "kernel"]  # accumulate, norm, adam, reset
    assert emitting.total == 44.0 and emitting.minimum == 36.0
    assert nb.explain(ms, params, state._replace(mini_step=np.int32(1)), apply=True).total == 48.0
    opaque = nb.explain(
        nb.MultiSteps(nb.sgd(0.1), 2, should_skip_update_fn=lambda u, s, p: (False, ())), params
    )
    assert opaque.total is None and "?" in str(opaque)


@pytest.mark.parametrize(
    "make",
    [
        nb.zero_nans,
        lambda: nb.clip_by_block_rms(0.3),
        lambda: nb.clip_norm_by_ema(0.9),
        lambda: nb.normalize_by_ema(0.9, tensorwise=False),
        lambda: nb.clip_norm_growth(),
        lambda: nb.scale_by_lbfgs(memory_size=3),
    ],
    ids=["zero_nans", "block_rms", "clip_norm_by_ema", "normalize_by_ema", "clip_norm_growth", "lbfgs"],
)
def test_declared_host_stages_explain_their_passes(make):
    """A stage that declares a `fuse.Host` is its passes in `explain` (no opaque row), under
    its own name, and keeps its declaration: the plan's part is the same object step after
    step."""
    params = {"w": np.ones((4, 4), np.float32), "d": np.ones(3)}
    tx = make()
    e = nb.explain(tx, params)
    assert e.total is not None and all(p.kind != "opaque" for p in e.passes)
    assert {p.kind for p in e.passes} >= {"reduction", "kernel"}
    from numbaccum.base import stage_of
    from numbaccum.flat import layout_of
    from numbaccum.runner import plan_of
    from numbaccum.updates import Spec

    stage, spec = stage_of(tx), Spec(layout_of(params, "params"), False)
    state = tx.init(params)
    roots = []
    for k in range(2):
        g = {"w": np.full((4, 4), 1.0 + k, np.float32), "d": np.full(3, 2.0 - k)}
        _, state = tx.update(g, state, params)
        roots.append(plan_of(stage, spec, state, stage.owner(state)).root)
    assert type(roots[0]) is fuse.Host and roots[0] is roots[1]


def test_elementwise_history_clippers_fuse_with_the_next_stage():
    """clip_value_growth and clip_value_by_ema declare their formula as a `fuse.Kernel`: with
    adam after them, one fused pass."""
    params = {"w": np.ones((4, 4), np.float32)}
    for tx in (nb.clip_value_growth(add=0.5), nb.clip_value_by_ema(0.9)):
        e = nb.explain(nb.chain(tx, nb.adam(0.1)), params)
        assert [p.kind for p in e.passes] == ["fused"]


def test_step_with_weight_decay_reads_the_params_once(monkeypatch):
    """In `step_`, weight decay's params are the buffer the pass writes: the composite takes it
    once (an aliased second argument leaves LLVM's loop scalar), with the same bits."""
    params = {k: np.array(v) for k, v in PARAMS.items() if np.ndim(v)}
    grads = [{k: g[k] for k in params} for g in _grads(3)]

    def make():
        return nb.chain(
            nb.clip_by_global_norm(1.0), nb.scale_by_adam(), nb.add_decayed_weights(1e-2), nb.scale(-0.1)
        )

    want = _update_and_apply(make, params, grads)
    _same(_run_step(make, params, grads, flat=True), want)
    _same(_run_step(make, params, grads), want)  # a plain tree: packed once, read once too
    applied = nb.explain(make(), {"w": np.ones((100, 10), np.float32)}, apply=True)
    assert applied.total == applied.minimum == 32.0  # norm 4; g 4, mu 8, nu 8, params 8
    tx = make()
    state = tx.init(params)
    seen = []
    real = fuse._composite

    def spy(key):
        seen.append(key)
        return real(key)

    monkeypatch.setattr(fuse, "_composite", spy)
    nb.step_(tx, grads[0], state, nb.FlatTree.from_tree(params))
    assert seen and all(k[2][-1][0] == "apply" and k[2][-1][2] == (1,) for k in seen), seen


def test_step_through_multisteps_adds_in_the_inner_pass(monkeypatch):
    """The emitting step of MultiSteps under step_: the inner chain's last fused pass adds the
    update to the params (no update buffer); the other steps leave the params untouched."""
    params = {k: np.array(v) for k, v in PARAMS.items() if np.ndim(v)}
    grads = [{k: g[k] for k in params} for g in _grads(4)]
    make = RECIPES["multisteps"]
    _same(_run_step(make, params, grads, flat=True), _update_and_apply(make, params, grads))
    tx = make()
    state = tx.init(params)
    p = nb.FlatTree.from_tree(params)
    before = snapshot(p.tree)
    state = nb.step_(tx, grads[0], state, p)  # accumulates only
    assert_tree_equal(p.tree, before)
    seen = []
    real = fuse._composite
    monkeypatch.setattr(fuse, "_composite", lambda key: seen.append(key) or real(key))
    nb.step_(tx, grads[1], state, p)  # emits
    assert seen and all(k[2][-1][0] == "apply" for k in seen)


def test_a_run_written_in_place_takes_its_buffer_once(monkeypatch):
    """When the updates may be overwritten (an owned workspace), the fused pass writes them in
    place through one argument (the composite's last state): same bits as into another buffer."""
    params = {k: np.array(v) for k, v in PARAMS.items() if np.ndim(v)}
    grads = [{k: g[k] for k in params} for g in _grads(3)]

    def make():  # zero_nans ends a run: the next run reads its owned output
        return nb.chain(nb.zero_nans(), nb.scale_by_adam(), nb.add_decayed_weights(0.1), nb.scale(-0.1))

    seen = []
    real = fuse._composite
    monkeypatch.setattr(fuse, "_composite", lambda key: seen.append(key) or real(key))
    fused = _run(make, params, grads, fused=True)
    assert any(k[4] for k in seen)  # in place
    _same(fused, _run(make, params, grads, fused=False))
    name, src, states, inputs, outputs, _, _ = fuse.composite_source(next(k for k in seen if k[4]))
    assert states[-1] == "x" and "x" not in inputs and outputs == ()


def test_apply_if_finite_reads_finiteness_from_the_clips_norm(monkeypatch):
    """apply_if_finite(chain(clip_by_global_norm, ...)): the clip's norm pre-pass also tells
    finiteness, so a finite step runs one reduction, not two; a NaN step counts as before."""
    params = {k: np.array(v) for k, v in PARAMS.items() if np.ndim(v)}
    grads = [{k: g[k] for k in params} for g in _grads(3)]
    bad = {k: np.full_like(v, np.nan) for k, v in grads[0].items()}
    seq = [grads[0], bad, grads[1], bad, bad, grads[2]]

    def make():
        return nb.apply_if_finite(nb.chain(nb.clip_by_global_norm(1.0), nb.adam(1e-2)), 1)

    counted = []  # the finiteness reductions apply_if_finite runs itself (kept: Reductions)
    real = nb.backend.Reductions.reduce

    def reduce(self, slot, kind, *args, **kwargs):
        if kind == "nonfinite":
            counted.append(1)
        return real(self, slot, kind, *args, **kwargs)

    monkeypatch.setattr(nb.backend.Reductions, "reduce", reduce)
    tx = make()
    s = tx.init(params)
    outs = []
    for i, g in enumerate(seq):
        counted.clear()
        u, s = tx.update(g, s, params)
        outs.append(snapshot(u))
        assert bool(counted) == (g is bad), i  # finite: no reduction of its own
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    tx = make()
    s2 = tx.init(params)
    for i, (g, want) in enumerate(zip(seq, outs)):
        u, s2 = tx.update(g, s2, params)
        assert_tree_equal(snapshot(u), want, msg=f"step {i}")
    assert int(s.total_notfinite) == int(s2.total_notfinite) == 3


@pytest.mark.parametrize("size", [200, 65539])
def test_a_float64_accumulator_before_a_float32_stage_fuses_to_the_same_bits(size):
    """The driver reads a fused call's arrays in its widest compute dtype (float64 here, for
    the trace's accumulator): each part casts its states and inputs to its own, so the weight
    decay after the trace computes in float32 as its separate pass does (it computed in float64
    before, from the params widened)."""
    rng = np.random.default_rng(0)
    params = {"w": (rng.normal(size=size) * 10).astype(np.float32)}
    grads = [{"w": (rng.normal(size=size) * 10).astype(np.float32)} for _ in range(3)]
    for names in (["trace_nesterov_f64", "add_decayed_weights"], ["trace_nesterov_f64", "adamw"]):
        make = _chain(names)
        _same(_run(make, params, grads, True), _run(make, params, grads, False), msg=str(names))
