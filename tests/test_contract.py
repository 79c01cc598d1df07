"""The kernel contract: every formula compiled by both drivers, every Ops method declared once.

The reference for a formula is the formula itself, run as plain Python on NumPy scalars of the
buffer dtype, element by element: the drivers must compile exactly that. (Plain Python evaluates
``math.sqrt`` and ``math.copysign`` in float64, so float32 results may differ in the last place.)

Every registered formula is checked, wherever it is declared: those of `numbaccum.formulas`, those
declared beside their stages (`numbaccum.optimizers`), and this module's own (`decayed_peak`, a
stage declared outside the package, as a user would).
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
from typing import Any, NamedTuple

import numpy as np
import pytest

import numbaccum as nba
from numbaccum import contract, formulas, optimizers
from numbaccum.backend import ops_for
from numbaccum.base import Stage
from numbaccum.contract import ONE, Factor, Ops
from numbaccum.cpu import driver as cpu_driver
from numbaccum.declared import Elementwise
from numbaccum.flat import FlatTree
from numbaccum.formulas import formula
from numbaccum.formulas import maximum as larger  # a helper under a name formulas.py lacks


@formula(states=("peak",), inputs=("g",), outputs=("out",), scalars=("decay",))
def contract_decayed_peak(peak, g, decay):
    """peak = max(decay * peak, g) (NaN if either is: `formulas.maximum`, imported under a name
    of this module's); out = g - peak."""
    p = larger(decay * peak, g)
    return p, g - p


class DecayedPeakState(NamedTuple):
    peak: FlatTree


class _DecayedPeak(Elementwise):
    """A stage declared outside numbaccum, with its formula beside it."""

    formula, state_cls, fields, name = contract_decayed_peak, DecayedPeakState, ("peak",), "decayed_peak"

    def __init__(self, decay: float) -> None:
        self.decay = decay

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        return (self.decay,)


FORMULAS = list(formulas.registered().values())  # after `import numbaccum`: all of them
BOOLS = {"nesterov", "fresh"}
WORDS = {"k0", "k1", "step", "group"}  # a noise key's and counter's uint32 words (add_noise)
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _inputs(f, n, dtype, seed):
    rng = np.random.default_rng(seed)
    arrays = []
    for name in f.arrays:
        a = rng.standard_normal(n).astype(dtype)
        if name in ("nu", "e_g", "e_x", "n", "exp_avg_sq"):
            a = np.abs(a)  # a second moment is never negative
        if name in f.states:
            a[::5] = 0  # growth_clip's "no history" and exact zeros
        arrays.append(a)
    if n >= 8 and f.inputs:
        first = arrays[len(f.states)]
        first[1], first[3], first[6] = np.nan, np.inf, -np.inf
    scalars = []
    for k, name in enumerate(f.scalars):
        if name in WORDS:
            scalars.append(np.uint32(rng.integers(0, 2**32)))
        else:
            scalars.append(bool((seed + k) % 2) if name in BOOLS else float(rng.uniform(0.1, 1.0)))
    return arrays, scalars


def _kept(s) -> bool:
    """A scalar a driver passes uncast: a bool, or a uint32 word."""
    return isinstance(s, (bool, np.uint32))


def _reference(f, factor, arrays, scalars):
    """The plain-Python formula over every element, in the arrays' dtype."""
    out = [a.copy() for a in arrays]
    ns = len(f.states)
    ctype = np.result_type(*arrays)
    cast = ctype.type
    sc = [s if _kept(s) else cast(s) for s in scalars]
    with np.errstate(all="ignore"):
        for i in range(arrays[0].size if arrays else 0):
            vals = [cast(a[i]) for a in arrays[: ns + len(f.inputs)]]
            if f.inputs and not factor.is_one:
                vals[ns] = (vals[ns] / cast(factor.div)) * cast(factor.mul)
            r = f.fn(*vals, *sc, *([i] if f.indexed else []))
            r = r if isinstance(r, tuple) else (r,)
            for k, w in enumerate(f.writes):
                out[w][i] = r[k]
    return out


def _assert_same(got, ref, dtype, maxulp=1):
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_array_max_ulp(got[ok], ref[ok].astype(got.dtype), maxulp=maxulp)


# Formulas that square an intermediate result into a state: plain Python (the reference here, and
# the CUDA simulator) runs ``math.sqrt`` in float64, where compiled code computes float32 in
# float32, so the state is a few roundings apart (float32 bit for bit against optax's recipe:
# test_bitexact.py).
PYTHON_SQRT = {"adadelta_direction": "u = (sqrt(e_x + eps) / sqrt(e_g + eps)) g, then e_x of u^2"}


# Formulas of every kind (no state, a trace, moments with bias corrections, a sign, the element's
# index), run on every path in the README's command; the others' second dtype and parallel driver
# in the exhaustive step.
PARALLEL_SAMPLE = {"add_scaled", "trace_update", "adam_direction", "lion_direction", "add_noise_direction"}


# Every formula in float32 in the README's command; in float64 (a kernel each) the parallel sample
# below there, every formula in the exhaustive step (test_bitexact.py runs each in both dtypes).
SERIAL_RUNS = [
    pytest.param(
        f,
        dtype,
        id=f"{f.name}-{np.dtype(dtype).name}",
        marks=() if dtype is np.float32 or f.name in PARALLEL_SAMPLE else pytest.mark.exhaustive,
    )
    for f in FORMULAS
    for dtype in (np.float32, np.float64)
]


@pytest.mark.parametrize("f,dtype", SERIAL_RUNS)
@pytest.mark.parametrize("factor", [ONE, Factor(3.0, 0.5)], ids=["one", "factor"])
def test_cpu_driver_compiles_the_formula(f, dtype, factor):
    n = 37
    arrays, scalars = _inputs(f, n, dtype, seed=3)
    if not f.inputs and not factor.is_one:
        pytest.skip("a formula without inputs reads no factor")
    ref = _reference(f, factor, arrays, scalars)
    cpu_driver.map_(f, factor, tuple(arrays), tuple(scalars))
    maxulp = 4 if dtype == np.float32 and f.name in PYTHON_SQRT else 1
    for w in f.writes:
        _assert_same(arrays[w], ref[w], dtype, maxulp)


# The parallel driver runs the serial loop's body over chunks: a few formulas (no state, a trace,
# moments with bias corrections, a sign, the element's index) in the README's command, every
# formula in the exhaustive step (each compiles its parallel driver: 50 s of a cold run's CPU).
PARALLEL_RUNS = [
    f if f.name in PARALLEL_SAMPLE else pytest.param(f, marks=pytest.mark.exhaustive) for f in FORMULAS
]


@pytest.mark.parametrize("f", PARALLEL_RUNS, ids=lambda f: f.name)
def test_cpu_parallel_and_serial_give_the_same_bits(f):
    n = (1 << 16) + 5  # past SERIAL_BELOW: the parallel driver
    a1, s = _inputs(f, n, np.float32, seed=5)
    a2 = [a.copy() for a in a1]
    cpu_driver.map_(f, ONE, tuple(a1), tuple(s))
    serial = cpu_driver.compiled(f)[1]
    div, mul = np.float32(1), np.float32(1)
    cast = [x if _kept(x) else np.float32(x) for x in s] or [False]
    serial(n, 1 << 15, *a2, div, mul, False, *cast)
    for w in f.writes:
        assert a1[w].tobytes() == a2[w].tobytes()


@pytest.mark.parametrize("f", FORMULAS, ids=lambda f: f.name)
def test_float16_buffers_are_staged_and_written_back(f):
    a16, s = _inputs(f, 9, np.float16, seed=7)
    a32 = [a.astype(np.float32) for a in a16]
    cpu_driver.map_(f, ONE, tuple(a16), tuple(s))
    cpu_driver.map_(f, ONE, tuple(a32), tuple(s))
    for w in f.writes:  # written buffers: computed in float32, rounded once
        np.testing.assert_array_equal(a16[w], a32[w].astype(np.float16))
    for i in set(range(len(f.arrays))) - set(f.writes):  # read-only buffers untouched
        np.testing.assert_array_equal(a16[i].astype(np.float32), a32[i])


HOME = [f for f in FORMULAS if f.fn.__module__ == formulas.__name__]
BESIDE = [f for f in FORMULAS if f.fn.__module__ != formulas.__name__]


def test_every_formula_of_the_formulas_module_is_reached_by_one_ops_method_or_a_declaration():
    """A general formula is reached by exactly one Ops method, or run by declared stages (the
    runner runs declarations: ``clip``, ``ema``, ``sign``), or both; none is left unreachable."""
    used = {}
    for name, method in inspect.getmembers(Ops, inspect.isfunction):
        src = inspect.getsource(method)
        for f in FORMULAS:
            if f"F.{f.name}," in src:
                used.setdefault(f.name, []).append(name)
    declared = {f.name for f in _declarations(Stage)}
    assert sorted(f.name for f in HOME if f.name not in used and f.name not in declared) == []
    assert {"clip", "ema", "sign"} <= declared - set(used)
    assert all(len(v) == 1 for v in used.values()), used


def _declarations(cls: type) -> set:
    """The formulas that ``cls`` and its subclasses declare (class attributes: ``formula``, or
    ``formulas`` for a stage whose passes run several)."""
    out = {vars(cls)["formula"]} if "formula" in vars(cls) else set()
    out |= set(vars(cls).get("formulas", ()))
    for sub in cls.__subclasses__():
        out |= _declarations(sub)
    return out


def test_a_formula_declared_beside_its_stage_is_run_by_a_declaration():
    """Outside `numbaccum.formulas` a formula needs no Ops method: the runner runs declarations,
    so each one is some declared stage's formula (an `Elementwise` one, or a stage whose
    ``declare`` makes its kernel, like a masked weight decay), none left behind, unreachable."""
    assert {f.name for f in BESIDE} >= {"contract_decayed_peak", "adam_direction", "masked_add_scaled"}
    declared = _declarations(Stage)
    assert [f.name for f in BESIDE if f not in declared] == []


def test_formula_names_are_unique():
    assert len({f.name for f in FORMULAS}) == len(FORMULAS)
    with pytest.raises(ValueError, match="'ema' is already declared .numbaccum.formulas.ema"):

        @formula(inputs=("x",), outputs=("out",))
        def ema(x):
            return x

    assert formulas.registered()["ema"] is formulas.ema
    with pytest.raises(
        ValueError, match="'adam_direction' is already declared .numbaccum.optimizers.adam_direction"
    ):

        @formula(inputs=("x",), outputs=("out",))
        def adam_direction(x):
            return x

    assert formulas.registered()["adam_direction"] is optimizers.adam_direction
    # The same function declared again (a reloaded module) replaces its formula.
    again = formula(states=("peak",), inputs=("g",), outputs=("out",), scalars=("decay",))
    redeclared = again(contract_decayed_peak.fn)
    try:
        assert formulas.registered()["contract_decayed_peak"] is redeclared
    finally:
        formulas._REGISTRY["contract_decayed_peak"] = contract_decayed_peak


def test_a_formula_declared_beside_its_stage_runs_fused_and_stage_by_stage(monkeypatch):
    """The composite of a fused chain calls the formula by its name; stage by stage, the driver
    runs it alone: the same bits, those of the plain-Python formula."""
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal(11).astype(np.float32), "b": rng.standard_normal(5)}
    grads = [nba.tree_map(lambda x, k=k: x * (k + 1.5) - k, params) for k in range(3)]
    seen: list[str] = []
    monkeypatch.setattr(cpu_driver, "observers", [lambda f: seen.append(f.name)])
    results = []
    for fused in ("1", "0"):
        monkeypatch.setenv("NUMBACCUM_FUSE", fused)
        tx = nba.chain(_DecayedPeak(0.5).transformation(), nba.scale(-2.0))
        state, outs = tx.init(params), []
        for g in grads:
            u, state = tx.update(g, state, params)
            outs.append(nba.tree_map(np.copy, u))
        results.append(outs)
    assert "contract_decayed_peak" in seen and any(n.startswith("fused_") for n in seen), seen
    peak = {k: np.zeros_like(v) for k, v in params.items()}
    for step, g in enumerate(grads):
        for k, x in g.items():
            d = x.dtype.type
            new = np.array([contract_decayed_peak.fn(d(p), d(v), d(0.5)) for p, v in zip(peak[k], x)])
            peak[k] = new[:, 0].astype(x.dtype)
            want = (new[:, 1].astype(x.dtype) * d(-2.0)).astype(x.dtype)
            for got in results:
                np.testing.assert_array_equal(got[step][k], want)


def _functions(path):
    """Module-level functions of a source file and their parameter names (read, not imported:
    the CUDA modules need no GPU to be checked)."""
    tree = ast.parse(path.read_text())
    return {n.name: [a.arg for a in n.args.args] for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_both_backends_implement_the_whole_contract():
    root = pathlib.Path(contract.__file__).parent
    for module, names in contract.BACKEND.items():
        cpu_fns = _functions(root / "cpu" / f"{module}.py")
        cuda_fns = _functions(root / "cuda" / f"{module}.py")
        for name in names:
            assert name in cpu_fns, f"numbaccum.cpu.{module} lacks {name}"
            assert name in cuda_fns, f"numbaccum.cuda.{module} lacks {name}"
            assert cpu_fns[name] == cuda_fns[name], f"{module}.{name}: {cpu_fns[name]} != {cuda_fns[name]}"


def test_every_ops_method_reaches_a_backend_primitive():
    """Each public Ops method runs a formula through the driver, a primitive of the engine or of
    per_example, or another Ops method (the shorthands) -- never a kernel by name."""
    primitives = {f"self.{m}.{n}(" for m, names in contract.BACKEND.items() for n in names}
    methods = {name for name, _ in inspect.getmembers(Ops, inspect.isfunction) if not name.startswith("_")}
    for name in methods:
        src = inspect.getsource(getattr(Ops, name))
        body = src.split('"""')[-1] if src.count('"""') >= 2 else src
        reached = any(p in body for p in primitives) or any(f"self.{m}(" in body for m in methods)
        assert reached, f"Ops.{name} reaches no primitive of the contract"


def test_writes_are_derived_from_the_declaration():
    assert optimizers.adam_direction.writes == (0, 1, 3)  # mu, nu, out (g is read only)
    assert formulas.clip_by.writes == (2,)
    assert formulas.fill.writes == (0,)
    assert formulas.mean_accumulate.writes == (0,)


def test_ops_for_picks_the_cpu_for_numpy_buffers():
    ops = ops_for(np.zeros(3, np.float32))
    assert isinstance(ops, contract.Ops)
    assert ops.driver is cpu_driver


@pytest.mark.cuda
@pytest.mark.parametrize("f", FORMULAS, ids=lambda f: f.name)
def test_cuda_driver_compiles_the_same_formula(f):
    from numba import cuda

    from numbaccum.cuda import driver as cuda_driver

    for n in (0, 1, 6, 9):  # even and odd: float32 pairs and the odd tail
        arrays, scalars = _inputs(f, n, np.float32, seed=n)
        host = [a.copy() for a in arrays]
        dev = [cuda.to_device(a) for a in arrays]
        factor = Factor(2.0, 0.5) if f.inputs else ONE
        cpu_driver.map_(f, factor, tuple(host), tuple(scalars))
        cuda_driver.map_(f, factor, tuple(dev), tuple(scalars))
        maxulp = 4 if SIM and f.name in PYTHON_SQRT else 1
        for w in f.writes:
            _assert_same(dev[w].copy_to_host(), host[w], np.float32, maxulp)
