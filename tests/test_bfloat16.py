"""bfloat16 leaves (ml_dtypes' dtype): two bytes an element in memory, computed in float32.

The kernels see a bfloat16 buffer's raw 16 bits: each element is widened to float32 when read
(exact) and rounded once, to nearest even, when stored (`numbaccum.formulas.to_bf16`). These
tests check the conversions against ml_dtypes on every bfloat16 value and on float32 and float64
values where rounding is hard (ties, overflow, NaN, subnormals); every transformation of the
registry against tests/reference.py computed in float64 and rounded once (within 1 ulp of
bfloat16); that fused chains, stage by stage and ``step_`` give the same bits; and the places a
dtype must survive (norms, accumulators, ``mu_dtype``, checkpoints, errors).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from _testutil import as_tree, leaves, require, snapshot, state_arrays
from registry import CASES, DRIVERS, cases, sampled, sweep, with_reference

import numbaccum as nba
from numbaccum import _config, formulas
from numbaccum.cpu import driver

ml_dtypes = require("ml_dtypes")
BF = np.dtype(ml_dtypes.bfloat16)


def _bits(x) -> np.ndarray:
    """The raw bits of a bfloat16 array (a 0-d one stays 0-d)."""
    a = np.asarray(x)
    return (a if a.flags.c_contiguous else a.copy()).view(np.uint16)


def ulps(a, b) -> np.ndarray:
    """Distance in bfloat16 steps between same-shaped bfloat16 arrays (+0 and -0 apart by 0)."""

    def key(x):
        raw = _bits(x).astype(np.int64)
        return np.where(raw & 0x8000, -(raw & 0x7FFF), raw & 0x7FFF)

    return np.abs(key(a) - key(b))


def exact_bf16(v: np.ndarray) -> np.ndarray:
    """float64 values rounded once to the nearest bfloat16, ties to even, without trusting any
    conversion: of the three bfloat16 values around ml_dtypes' answer, the nearest (the
    differences are exact by Sterbenz's lemma), the even one on a tie; infinity counts as 2**128
    (the next step after the largest bfloat16), so values halfway there and beyond overflow."""
    with np.errstate(over="ignore", invalid="ignore"):
        guess = _bits(v.astype(BF)).astype(np.int64)

    def value(bits):
        with np.errstate(invalid="ignore"):
            x = (bits & 0xFFFF).astype(np.uint16).view(BF).astype(np.float64)
        return np.where(np.isinf(x), np.copysign(2.0**128, x), x)

    best = guess.copy()
    for step in (-1, 1):
        cand = guess + step
        cand_v, best_v = value(cand), value(best)
        with np.errstate(invalid="ignore"):
            dc, db = np.abs(cand_v - v), np.abs(best_v - v)
            better = (dc < db) | ((dc == db) & (cand % 2 == 0))
        # Only neighbours of one sign and exponent field below NaN's.
        ok = np.isfinite(v) & ~np.isnan(cand_v) & ((cand & 0x7FFF) <= 0x7F80) & ((cand ^ guess) & 0x8000 == 0)
        best = np.where(ok & better, cand, best)
    return (best & 0xFFFF).astype(np.uint16).view(BF)


# --- the conversions -------------------------------------------------------------------------

_JIT = formulas.bf16_conversions(driver._inline, driver._BF16)  # those the CPU kernels call


@pytest.fixture(scope="module")
def conv():
    """The conversions compiled (as the kernels inline them) into loops over arrays."""
    from numba import njit

    from_bf16, to_bf16, to64 = _JIT["from_bf16"], _JIT["to_bf16"], _JIT["to_bf16_from64"]

    @njit
    def widen(h, out):
        for i in range(h.size):
            out[i] = from_bf16(h[i])

    @njit
    def narrow(x, out):
        for i in range(x.size):
            out[i] = to_bf16(x[i])

    @njit
    def narrow64(x, out):
        for i in range(x.size):
            out[i] = to64(x[i])

    return widen, narrow, narrow64


def test_every_bfloat16_widens_exactly(conv):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(h.size, np.float32)
    conv[0](h, out)
    want = h.view(BF).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    # The plain-Python formula (what the CUDA simulator runs) gives the same.
    some = h[::97]
    py = np.array([formulas.from_bf16(v) for v in some], np.float32)
    assert np.array_equal(py.view(np.uint32), some.view(BF).astype(np.float32).view(np.uint32))


def _hard_float32(rng) -> np.ndarray:
    """float32 values where rounding to bfloat16 is hard: ties (the 16 dropped bits 0x8000) to
    even and to odd, one bit either side, the largest finite values, subnormals, infinities,
    NaNs of both signs with payloads, zeros; then random bit patterns."""
    hi = rng.integers(0, 1 << 16, 20000, dtype=np.uint32) << 16
    lows = np.array([0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0001, 0x0000], np.uint32)
    bits = (hi[:, None] | lows[None, :]).ravel()
    special = np.array(
        [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x80000001, 0x007FFFFF,
         0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000000, 0x80000000],
        np.uint32,
    )  # fmt: skip
    rand = rng.integers(0, 1 << 32, 200000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([bits, special, rand]).view(np.float32)


def test_rounding_float32_to_bfloat16_is_ml_dtypes_bit_for_bit(conv):
    x = _hard_float32(np.random.default_rng(0))
    out = np.empty(x.size, np.uint16)
    conv[1](x, out)
    with np.errstate(invalid="ignore"):
        want = _bits(x.astype(BF))
    nan = np.isnan(x)
    assert np.array_equal(out[~nan], want[~nan])
    # NaN stays a NaN of its sign, quiet (ml_dtypes gives the same bits).
    assert np.all(np.isnan(out[nan].view(BF).astype(np.float32)))
    assert np.array_equal(out[nan] >> 15, x[nan].view(np.uint32) >> 31)
    py = np.array([formulas.to_bf16(v) for v in x[:3000]], np.uint16)
    assert np.array_equal(py, out[:3000])


def test_rounding_in_place_is_narrowing_and_widening(conv):
    """`formulas.as_bfloat16` (a fused chain's rounding between parts) works on the 32 bits; it
    must give the bits of widening what `to_bf16` stores, NaN included."""
    from numba import njit

    as_bf16 = formulas.compile_formula(formulas.as_bfloat16, njit(inline="always"))

    @njit
    def rounded(x, out):
        for i in range(x.size):
            out[i] = as_bf16(x[i])

    x = _hard_float32(np.random.default_rng(4))
    out, bits, wide = np.empty_like(x), np.empty(x.size, np.uint16), np.empty_like(x)
    rounded(x, out)
    conv[1](x, bits)
    conv[0](bits, wide)
    assert np.array_equal(out.view(np.uint32), wide.view(np.uint32))


def test_rounding_float64_to_bfloat16_rounds_once(conv):
    rng = np.random.default_rng(1)
    x32 = _hard_float32(rng)
    x32 = x32[np.isfinite(x32)]
    # Just above and below each tie: a float64 that rounds to a float32 tie, then (rounding
    # twice) to the wrong bfloat16. Nudged by far less than a float32 step.
    nudge = np.abs(x32.astype(np.float64)) * 2.0**-40
    x = np.concatenate(
        [x32.astype(np.float64) + nudge, x32.astype(np.float64) - nudge, [np.inf, -np.inf, 1e300]]
    )
    out = np.empty(x.size, np.uint16)
    conv[2](x, out)
    want = _bits(exact_bf16(x))
    assert np.array_equal(out, want)
    with np.errstate(over="ignore"):
        twice = _bits(x.astype(np.float32).astype(BF))
    assert np.any(twice != want), "the data has no case where rounding twice differs"
    nan = np.array([np.nan, -np.nan])
    o = np.empty(2, np.uint16)
    conv[2](nan, o)
    assert np.all(np.isnan(o.view(BF).astype(np.float32)))


# --- every transformation against the reference ----------------------------------------------


def _values(rng, shape) -> np.ndarray:
    x = rng.choice([-1.0, 1.0], size=shape) * 10.0 ** rng.uniform(-6, 2, size=shape)
    x = np.where(rng.random(shape) < 0.05, 0.0, x)
    return np.asarray(x).astype(BF)


def tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": _values(rng, (23, 17)),
        "b": _values(rng, (17,)),
        "s": _values(rng, ()),
        "e": _values(rng, (0,)),
    }


def wide(t):
    return nba.tree_map(lambda x: np.asarray(x).astype(np.float64), t)


# Every Case compiles its kernels for bfloat16 here: the registry's DRIVERS (a stage of each kind)
# in the README's command, every Case in the exhaustive step (registry.sweep).
ONE_STEP = sweep(with_reference(per_example=False), keep=DRIVERS)


def assert_within_one_ulp(actual, expected64, msg: str) -> None:
    """bfloat16 ``actual`` within 1 ulp of float64 ``expected64`` rounded once; NaN where it is."""
    for p, a, e in zip(ref.tree_paths(as_tree(expected64)), leaves(actual), leaves(expected64)):
        a, e = np.asarray(a), np.asarray(e, np.float64)
        assert a.dtype == BF and a.shape == e.shape, f"{msg} {p}: {a.dtype}{a.shape}"
        nan = np.isnan(e)
        assert np.array_equal(np.isnan(a.astype(np.float32)), nan), f"{msg} {p}: NaN elsewhere"
        d = ulps(a[~nan], exact_bf16(e[~nan]))
        assert d.size == 0 or d.max() <= 1, (
            f"{msg} {p}: {int(d.max())} ulps apart at {np.argmax(d)}: "
            f"{a[~nan].ravel()[np.argmax(d)]!r} vs {e[~nan].ravel()[np.argmax(d)]!r}"
        )


# At the first step the bias-corrected variance of a centred RMSProp is g**2 - g**2 = 0 in exact
# arithmetic: what is left is rounding noise in any dtype (the float64 reference's is NaN wherever
# it dips below zero), so no dtype's answer is the reference's.
ILL_CONDITIONED = {"rmsprop_centered_bc_eps_out"}

# Where a rounding the reference does not make meets a cancellation, ulps of the result say
# nothing: these are compared within bfloat16's precision of each leaf's largest value instead.
# fromage adds its decay after the learning rate: the rate is a factor left pending (never
# stored, so one rounding fewer than the per-stage reference) and ``-lr m g' + (m - 1) p``
# cancels. novograd keeps ``nu`` in the leaf's dtype (optax's), so its divisor is rounded to
# bfloat16 before ``g / d + wd p``, which cancels too.
CANCELS = {"fromage", "novograd"}


def _rounded(t):
    """A tree's float leaves rounded once to bfloat16 (kept as float64 values)."""

    def one(x):
        a = np.asarray(x)
        return exact_bf16(a.astype(np.float64)).astype(np.float64) if a.dtype.kind == "f" else x

    return nba.tree_map(one, t)


@pytest.fixture
def stages_store_bfloat16(monkeypatch):
    """The reference's chains round each stage's updates to bfloat16 before the next stage reads
    them: what a bfloat16 tree's stages store (and what optax's bfloat16 arrays hold)."""
    chain = ref.chain

    def rounding_chain(*txs):
        def rounding(t):
            def update(u, s, p=None, **extra):
                u, s = t.update(u, s, p, **extra)
                return _rounded(u), s

            return ref.Transformation(t.init, update)

        return chain(*map(rounding, txs))

    monkeypatch.setattr(ref, "chain", rounding_chain)


@pytest.mark.parametrize("name", ONE_STEP)
def test_first_step_within_one_ulp_of_the_reference_in_float64(name, stages_store_bfloat16):
    """Every transformation's first update (and its state) on a bfloat16 tree, from the same
    inputs as the reference computes them in float64, within 1 ulp of that rounded once (a chain
    of stages: once per stage, as each stage stores its updates)."""
    if name in ILL_CONDITIONED:
        pytest.skip("ill-conditioned at the first step in every dtype (ILL_CONDITIONED)")
    tx, rtx = CASES[name].make(), CASES[name].reference()
    params, g = tree(7), tree(1000)
    u, state = tx.update(g, tx.init(params), params)
    # The reference starts from its initial state as a bfloat16 state holds it (adagrad's 0.1 is
    # 0.10009765625 there).
    ru, rstate = rtx.update(wide(g), _rounded(rtx.init(wide(params))), wide(params))
    if name in CANCELS:
        for a, e in zip(leaves(u), leaves(ru)):
            a, e = np.asarray(a).astype(np.float64), np.asarray(e, np.float64)
            scale = float(np.max(np.abs(e))) if e.size else 0.0
            np.testing.assert_allclose(a, e, rtol=2**-8, atol=2**-8 * scale, err_msg=name)
    else:
        assert_within_one_ulp(u, ru, f"{name} updates")
    if CASES[name].ref_state and name not in CANCELS:
        ours = state_arrays(state)
        for p, e in state_arrays(rstate).items():
            if e.dtype.kind == "f" and p in ours and ours[p].dtype == BF:
                assert_within_one_ulp(ours[p], e, f"{name} {p}")


FUSABLE = [n for n in with_reference(per_example=False) if CASES[n].fusable]


def _run(name: str, via_step: bool, steps: int = 4):
    """Each step's updates (with ``via_step``: ``step_``'s params) of the Case chained with a
    scale; the update path applies its updates with `apply_updates` (so that both see the same
    params at every step)."""
    tx = nba.chain(CASES[name].make(), nba.scale(-0.5))
    params = tree(7)
    state = tx.init(params)
    outs = []
    for k in range(steps):
        g = tree(1000 + k)
        if via_step:
            state = nba.step_(tx, g, state, params)
            outs.append(snapshot(params))
        else:
            u, state = tx.update(g, state, params)
            outs.append(snapshot(u))
            params = nba.apply_updates(params, u)
    return outs


def _same_bits(a_tree, b_tree, msg):
    for p, a, b in zip(ref.tree_paths(as_tree(b_tree)), leaves(a_tree), leaves(b_tree)):
        assert np.asarray(a).dtype == np.asarray(b).dtype == BF, f"{msg} {p}"
        assert np.array_equal(_bits(a), _bits(b)), f"{msg} {p}: bits differ"


# The parallel drivers run the same loop body over chunks: a few stages of each kind (a moment, a
# clip with its pre-pass, a float64 accumulator beside bfloat16, a per-leaf reduction) check them.
# The README's command runs the registry's DRIVERS of these, the exhaustive step the rest.
PARALLEL = ["adamw", "clip_by_global_norm", "trace_nesterov_f64acc", "clip_norm_rows", "lion"]
FUSED_RUNS = sweep([(n, False) for n in sampled(FUSABLE)] + [(n, True) for n in PARALLEL], keep=DRIVERS)


@pytest.mark.parametrize(("name", "parallel"), FUSED_RUNS)
def test_fused_stage_by_stage_and_step_give_the_same_bits(name, parallel, monkeypatch):
    """Four steps of fusable stages of each kind (the registry's SAMPLE; every formula's first
    bfloat16 step is checked above) chained with a scale, on bfloat16: the fused kernel
    rounds between its parts as the separate passes store (`formulas.as_bfloat16`), and
    ``step_``'s params are the updates added and rounded once."""
    if parallel:
        monkeypatch.setattr(_config, "SERIAL_BELOW", 1, raising=True)
        monkeypatch.setattr(_config, "CHUNK", 64, raising=True)
    fused = _run(name, False)
    stepped = _run(name, True)
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    staged = _run(name, False)
    params = tree(7)
    for k, (a, b) in enumerate(zip(fused, staged)):
        _same_bits(a, b, f"{name} step {k + 1}: fused vs stage by stage")
        params = nba.apply_updates(params, b)
        _same_bits(stepped[k], params, f"{name} step {k + 1}: step_ vs update + apply_updates")


# --- where the dtype must survive ------------------------------------------------------------


def test_global_norm_of_bfloat16_is_that_of_its_float32_values():
    """Norms accumulate in float64 over the widened elements: the same bits as the float32 tree
    of the same values (exact), on the serial and the parallel path."""
    t = {"a": np.random.default_rng(3).standard_normal(300_001).astype(BF), "b": tree(5)["w"]}
    t32 = nba.tree_map(lambda x: x.astype(np.float32), t)
    assert nba.global_norm(t) == nba.global_norm(t32)
    u, s = nba.clip_by_global_norm(1.0).update(t, nba.clip_by_global_norm(1.0).init(t))
    u32, s32 = nba.clip_by_global_norm(1.0).update(t32, nba.clip_by_global_norm(1.0).init(t32))
    assert s.norm == s32.norm
    for k in t:
        assert u[k].dtype == BF
        assert np.array_equal(_bits(u[k]), _bits(u32[k].astype(BF)))  # one rounding either way


def test_mu_dtype_bfloat16_halves_the_first_moment():
    params = {"w": np.ones((64, 64), np.float32)}
    opt = nba.adam(1e-3, mu_dtype="bfloat16")
    state = opt.init(params)
    assert state[0].mu.group_dtypes == (BF,) and state[0].nu.group_dtypes == (np.dtype(np.float32),)
    assert state[0].mu.groups[0].nbytes * 2 == state[0].nu.groups[0].nbytes
    ref_opt = nba.adam(1e-3)
    rstate = ref_opt.init(params)
    g = {"w": np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)}
    u, state = opt.update(g, state)
    ru, rstate = ref_opt.update(g, rstate)
    assert np.array_equal(_bits(state[0].mu.tree["w"]), _bits(rstate[0].mu.tree["w"].astype(BF)))
    assert u["w"].dtype == np.float32


def test_multisteps_accumulates_bfloat16_in_float32():
    params = {"w": np.ones(5, BF)}
    tx = nba.MultiSteps(nba.sgd(1.0), every_k_schedule=3)
    state = tx.init(params)
    assert state.acc_grads.group_dtypes == (np.dtype(np.float32),)
    g = {"w": np.full(5, 1.0 + 2.0**-8, np.float32).astype(BF)}  # 1 + 2^-8 is not a bfloat16
    for _ in range(3):
        state = nba.step_(tx, g, state, params)
    assert params["w"].dtype == BF
    want = (1.0 - np.float32(g["w"][0].astype(np.float32))).astype(BF)
    assert np.all(_bits(params["w"]) == _bits(np.asarray(want)))


def test_mixed_tree_keeps_each_dtype():
    params = {"h": np.ones(3, np.float16), "b": np.ones(4, BF), "s": np.ones(2, np.float32), "d": np.ones(2)}
    g = nba.tree_map(lambda x: np.full(x.shape, 0.25, x.dtype), params)
    tx = nba.chain(nba.clip_by_global_norm(0.1), nba.adamw(1e-2, mu_dtype=BF))
    state = tx.init(params)
    state = nba.step_(tx, g, state, params)
    assert {k: v.dtype for k, v in params.items()} == {
        "h": np.float16,
        "b": BF,
        "s": np.float32,
        "d": np.float64,
    }
    assert state[1][0].mu.group_dtypes == (BF,) * 4
    u, _ = tx.update(g, state, params)
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in leaves(u))


def test_checkpoint_keeps_bfloat16_bits(tmp_path):
    params = {"w": tree(2)["w"], "f": np.ones(3, np.float32)}
    tx = nba.inject_hyperparams(nba.adam, hyperparam_dtype=BF)(learning_rate=1e-2)
    state = nba.step_(tx, {"w": tree(3)["w"], "f": np.ones(3, np.float32)}, tx.init(params), params)
    path = tmp_path / "s.npz"
    nba.save_state(path, state)
    back = nba.load_state(path, like=tx.init(params))
    mu, mu_back = state.inner_state[0].mu, back.inner_state[0].mu
    assert mu_back.group_dtypes == mu.group_dtypes
    for a, b in zip(mu.groups, mu_back.groups):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    lr = back.hyperparams["learning_rate"]
    assert np.asarray(lr).dtype == BF and _bits(lr) == _bits(state.hyperparams["learning_rate"])


def test_integer_leaves_still_get_a_clear_error():
    """(Complex leaves are taken since issue 25: tests/test_complex.py.)"""
    for bad in (np.ones(3, np.int32), np.ones(3, np.uint8)):
        with pytest.raises(TypeError, match=r"\['x'\]: dtype .* is not float16, bfloat16, .* or complex128"):
            nba.FlatTree.from_tree({"x": bad})


def test_bfloat16_by_name_and_from_jax():
    assert nba.adam(1e-3, mu_dtype="bfloat16").init({"w": np.ones(2, np.float32)})[0].mu.group_dtypes == (BF,)
    with pytest.raises(TypeError, match="mu_dtype"):
        nba.adam(1e-3, mu_dtype="bfloat17")


def test_a_cuda_array_whose_interface_fails_gets_a_clear_error():
    """PyTorch's CUDA interface has no bfloat16 (reading it raises): the leaf's path and why."""

    class Tensor:
        shape, dtype = (3,), "torch.bfloat16"

        @property
        def __cuda_array_interface__(self):
            raise KeyError(self.dtype)

    with pytest.raises(TypeError, match=r"\['x'\]: cannot read this CUDA Tensor \(KeyError"):
        nba.FlatTree.from_tree({"x": Tensor()})


def test_cpu_torch_bfloat16_tensors_are_read_as_bfloat16():
    torch = pytest.importorskip("torch")  # not a test dependency (CI has none): where it is
    t = {"w": torch.linspace(-2, 2, 7, dtype=torch.bfloat16)}
    u, _ = nba.clip_by_global_norm(1.0).update(t, nba.clip_by_global_norm(1.0).init(t))
    want = (t["w"].float() / torch.linalg.norm(t["w"].float())).to(torch.bfloat16)
    assert u["w"].dtype == BF
    assert np.array_equal(_bits(u["w"]), want.view(torch.int16).numpy().view(np.uint16))


def test_apply_updates_of_float16_to_bfloat16_and_back():
    """NumPy cannot promote float16 with bfloat16: the sum is computed in float32, rounded once
    to each param's dtype."""
    params = {"a": np.ones(3, BF), "b": np.ones(2, np.float16)}
    updates = {"a": np.full(3, 2.0**-9 * 3, np.float16), "b": np.full(2, 0.25, BF)}
    out = nba.apply_updates(params, updates)
    assert out["a"].dtype == BF and out["b"].dtype == np.float16
    want_a = np.asarray(np.float32(1) + np.float32(updates["a"][0])).astype(BF)  # 1 + 3 * 2**-9
    assert np.all(_bits(out["a"]) == _bits(want_a)) and np.all(out["b"] == np.float16(1.25))
    nba.apply_updates_(params, updates)
    assert np.array_equal(_bits(params["a"]), _bits(out["a"])) and np.array_equal(params["b"], out["b"])


# --- optax's own bfloat16 cases, for every transformation ------------------------------------
# optax 0.2.8's alias_test runs these per optimizer in bfloat16 (and float32): the updates keep
# the gradients' dtype (test_preserve_dtype), MultiSteps' first update is exactly zero
# (test_gradient_accumulation), two steps keep every dtype of the params and the state
# (test_state_shape_dtype_shard_stability), and an explicit state dtype is the state's
# (test_explicit_dtype). Here for every transformation of the registry.

EVERY = cases(per_example=False)


@pytest.mark.parametrize("name", sweep(EVERY, keep=DRIVERS))  # bfloat16 kernels of each Case (ONE_STEP)
def test_updates_keep_the_gradients_dtype(name):
    tx = CASES[name].make()
    params = np.array([1.0, 2.0], BF)
    grads = (2 * params.astype(np.float32)).astype(BF)  # the gradient of sum(x ** 2)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert np.asarray(updates).dtype == BF


@pytest.mark.parametrize("name", EVERY)
def test_multisteps_first_update_is_exactly_zero(name):
    tx = nba.MultiSteps(CASES[name].make(), every_k_schedule=4)
    params = np.array([1.0, 2.0], BF)
    grads = (2 * params.astype(np.float32)).astype(BF)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert np.asarray(updates).dtype == BF and not np.any(_bits(updates))  # +0.0 bits


@pytest.mark.parametrize("name", sweep(EVERY, keep=DRIVERS))  # step_'s bfloat16 kernels of each Case
def test_two_steps_keep_every_dtype(name):
    tx = CASES[name].make()
    params = {"w": np.array([0.5, -1.5, 2.0], BF)}
    state = tx.init(params)
    dtypes = {p: a.dtype for p, a in state_arrays(state).items()}
    for _ in range(2):
        grads = {"w": (2 * params["w"].astype(np.float32)).astype(BF)}
        state = nba.step_(tx, grads, state, params)
        assert params["w"].dtype == BF
        assert {p: a.dtype for p, a in state_arrays(state).items()} == dtypes


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32", None])
@pytest.mark.parametrize("params_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("opt", ["sgd_mom", "adam", "adamw"])
def test_explicit_state_dtype(opt, params_dtype, state_dtype):
    if opt == "sgd_mom":
        tx, field = nba.sgd(0.1, momentum=0.9, accumulator_dtype=state_dtype), "trace"
    else:
        tx, field = getattr(nba, opt)(0.1, mu_dtype=state_dtype), "mu"
    params = np.zeros(2, BF if params_dtype == "bfloat16" else params_dtype)
    state = tx.init(params)
    found = [a for p, a in state_arrays(state).items() if p.endswith(f".{field}")]
    named = BF if state_dtype == "bfloat16" else np.dtype(state_dtype or params.dtype)
    want = params.dtype if state_dtype is None else named
    assert found and all(a.dtype == want for a in found)


# --- on the device ---------------------------------------------------------------------------
# The kernels see the raw bits there too: the elementwise and fused passes and the reductions
# read them in place, the rarer single-stage passes (per-slice scalings, Adafactor, SM3, the
# per-example sum) go through float32 copies, as on the host. The registry's SAMPLE of the Cases
# that run on CUDA, and every kind of single-stage pass.

ON_DEVICE = sampled(cases(per_example=False, cuda=True)) + [
    n for n in ("adafactor", "sm3", "clip_by_block_rms", "normalize_by_update_norm", "noisy_sgd", "ema")
]


def _device_tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=shape).astype(BF) for k, shape in (("w", (7, 5)), ("b", (5,)), ("s", ()))}


def _on_device(tree):
    from numba import cuda

    return nba.tree_map(lambda x: cuda.to_device(np.asarray(x)), tree)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ON_DEVICE)
def test_bfloat16_leaves_on_the_device_match_the_host(name):
    """Three steps of ``step_`` on device arrays against the host's: the same bits in the
    simulator (the kernels' own arithmetic), within 2 ulps of bfloat16 on a GPU (CUDA contracts
    multiply-adds in float32); params, updates and states keep their dtypes."""
    from numba import config

    tol = 0 if config.ENABLE_CUDASIM else 2
    tx_cpu, tx_gpu = CASES[name].make(), CASES[name].make()
    p_cpu = _device_tree(1)
    p_gpu = _on_device(p_cpu)
    p_cpu = {k: v.copy() for k, v in p_cpu.items()}
    s_cpu, s_gpu = tx_cpu.init(p_cpu), tx_gpu.init(p_gpu)
    for step in range(3):
        g = _device_tree(10 + step)
        u_cpu, _ = tx_cpu.update(g, nba.copy_state(s_cpu), p_cpu)  # update consumes a state
        u_gpu, _ = tx_gpu.update(_on_device(g), nba.copy_state(s_gpu), p_gpu)
        s_cpu = nba.step_(tx_cpu, g, s_cpu, p_cpu)
        s_gpu = nba.step_(tx_gpu, _on_device(g), s_gpu, p_gpu)
        for k, want in u_cpu.items():
            got = u_gpu[k].copy_to_host()
            assert got.dtype == BF and got.shape == np.shape(want)
            assert int(ulps(got, want).max(initial=0)) <= tol, f"{name} step {step} update {k}"
            got_p = p_gpu[k].copy_to_host()
            assert got_p.dtype == BF and int(ulps(got_p, p_cpu[k]).max(initial=0)) <= tol, f"{name} {k}"
    want_s, got_s = state_arrays(s_cpu), state_arrays(s_gpu)
    assert {p: a.dtype for p, a in got_s.items()} == {p: a.dtype for p, a in want_s.items()}
    for p, a in want_s.items():
        if a.dtype == BF:
            assert int(ulps(got_s[p], a).max(initial=0)) <= tol, f"{name} {p}"


@pytest.mark.cuda
def test_bfloat16_device_tree_packs_and_scatters_its_leaves():
    """Separate device arrays (not views of one buffer) are packed into the bfloat16 buffer with
    one launch and written back by ``step_``: their bits, not two opaque bytes an element."""
    p = _device_tree(3)
    g = _device_tree(4)
    want = {k: v.copy() for k, v in p.items()}
    tx = nba.sgd(0.5)
    nba.step_(tx, g, tx.init(want), want)
    dev = _on_device(p)
    nba.step_(tx, _on_device(g), tx.init(dev), dev)
    for k in p:
        assert np.array_equal(_bits(dev[k].copy_to_host()), _bits(want[k])), k
    flat = nba.to_device(nba.FlatTree.from_tree({"w": p["w"], "f": np.ones(2, np.float32)}))
    assert flat.device and nba.to_host(flat)["w"].dtype == BF
    assert np.array_equal(_bits(nba.to_host(flat)["w"]), _bits(p["w"]))


@pytest.mark.cuda
def test_dp_aggregate_of_bfloat16_examples_on_the_device():
    """Per-example bfloat16 gradients on the device (the weighted sum through float32 copies, the
    noise drawn on the host): the host's bits in the simulator, within 1 ulp on a GPU."""
    from numba import config

    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(4, 3, 5)).astype(BF), "b": rng.normal(size=(4, 5)).astype(BF)}
    tx = nba.differentially_private_aggregate(1.0, 0.5, seed=3)
    want, _ = tx.update(g, tx.init(None))
    got, _ = tx.update(_on_device(g), tx.init(None))
    for k in g:
        d = got[k].copy_to_host()
        assert d.dtype == BF and d.shape == g[k].shape[1:]
        assert int(ulps(d, want[k]).max(initial=0)) <= (0 if config.ENABLE_CUDASIM else 1), k


@pytest.mark.cuda
def test_bfloat16_norm_on_the_device_is_the_hosts():
    """The device reduction reads the raw bits and adds them in float64: the host's norm."""
    t = _device_tree(5)
    assert nba.global_norm(_on_device(t)) == pytest.approx(nba.global_norm(t), rel=1e-12)


@pytest.mark.cuda
def test_torch_bfloat16_cuda_tensors():
    """PyTorch's CUDA interface has no bfloat16: its bits are read through an int16 view, and
    the updates come back as torch.bfloat16 tensors (on a GPU with PyTorch only)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with a CUDA device")
    w = torch.linspace(-2, 2, 7, dtype=torch.bfloat16, device="cuda")
    tx = nba.clip_by_global_norm(1.0)
    u, _ = tx.update({"w": w}, tx.init({"w": w}))
    want = (w.float() / torch.linalg.norm(w.float())).to(torch.bfloat16)
    assert u["w"].dtype == torch.bfloat16 and u["w"].is_cuda
    assert torch.equal(u["w"].view(torch.int16), want.view(torch.int16))
