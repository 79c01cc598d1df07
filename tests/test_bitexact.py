"""Bit for bit against tests/reference.py, wherever the README promises it.

The README: "float32 results match optax's recipes bit for bit", and "fused and stage by stage
give the same bits on the CPU". Every `registry` Case marked ``exact`` runs several steps on
trees whose values span many magnitudes (so that ``eps`` and every rounding step shows in the
last bits), and its updates, state and ``step_``'s params are compared with the reference's bit
for bit: float32 and float64 leaves alike (the reference does each operation in the leaf's
dtype, in optax's order, as the formulas do). The same runs go through the parallel kernels
(``_config.SERIAL_BELOW`` lowered, so that small trees take that path), through the streaming
stores of large outputs (``_config.STREAM_BYTES`` lowered too) and stage by stage
(``NUMBACCUM_FUSE=0``).

A one-line change of a formula's rounding (``m / (bc1 * d)`` for ``(m / bc1) / d``) moves the
last bit of a good part of the results: these tests see it where a tolerance does not
(``tests/tools/mutate.py`` checks that).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from _testutil import as_tree, assert_same_structure, leaves, snapshot, state_arrays
from registry import CASES, DRIVERS, sampled, sweep, with_reference

import numbaccum as nba
from numbaccum import _config

STEPS = 6


def _values(rng: np.random.Generator, shape: tuple, dtype) -> np.ndarray:
    """Values of random sign over 10 decades (1e-8 .. 1e2: ``eps`` matters for the small ones),
    with exact zeros and -0.0 among them."""
    x = rng.choice([-1.0, 1.0], size=shape) * 10.0 ** rng.uniform(-8, 2, size=shape)
    x = np.where(rng.random(shape) < 0.05, 0.0, x)
    x = np.where(rng.random(shape) < 0.02, -0.0, x)
    return np.asarray(x, dtype=dtype)


SHAPES = {
    "w": ((23, 17), np.float32),
    "b": ((17,), np.float32),
    "s": ((), np.float32),
    "d": ((5, 31), np.float64),
}
SHAPES["e"] = ((0,), np.float32)


def tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {k: _values(rng, shape, dt) for k, (shape, dt) in SHAPES.items()}


def grads_for(step: int) -> dict:
    g = tree(1000 + step)
    if step == 2:  # a gradient that repeats the last one: moments that cancel to exactly zero
        g = tree(1000 + step - 1)
    return g


def assert_bits(actual, expected, msg: str) -> None:
    """Every leaf the same dtype, shape and bits (NaN payloads aside; -0.0 is not +0.0)."""
    assert_same_structure(actual, expected)
    paths = ref.tree_paths(as_tree(expected))
    for p, a, e in zip(paths, leaves(actual), leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape, (
            f"{msg} {p}: {a.dtype}{a.shape} vs {e.dtype}{e.shape}"
        )
        same = (a == e) & (np.signbit(a) == np.signbit(e)) | (np.isnan(a) & np.isnan(e))
        if not np.all(same):
            bad = np.flatnonzero(~same.reshape(-1))
            i = bad[0]
            raise AssertionError(
                f"{msg} {p}: {bad.size} of {a.size} elements differ in their bits; first at {i}: "
                f"{a.reshape(-1)[i]!r} vs the reference's {e.reshape(-1)[i]!r}"
            )


def compare_states(actual: dict, expected: dict, name: str, compare) -> None:
    """Every array of the reference's state against numbaccum's at the same path (counters
    exactly; numbaccum may keep more, such as its workspaces)."""
    for p, e in expected.items():
        assert p in actual, f"{name}: numbaccum's state has no {p} (it has {sorted(actual)})"
        a = actual[p]
        if e.dtype.kind in "iub":
            assert a.shape == e.shape and np.array_equal(a, e), f"{name} {p}: {a} vs {e}"
        else:
            compare(a, e, f"{name} {p}")


def run(name: str, via_step: bool = False):
    """numbaccum's updates per step (or params after each ``step_``) and final state trees."""
    tx = CASES[name].make()
    params = tree(7)
    state = tx.init(params)
    outs = []
    for k in range(STEPS):
        g = grads_for(k)
        if via_step:
            state = nba.step_(tx, g, state, params)
            outs.append(snapshot(params))
        else:
            u, state = tx.update(g, state, params)
            outs.append(snapshot(u))
    return outs, state_arrays(state)


def run_reference(name: str, via_step: bool = False):
    tx = CASES[name].reference()
    params = tree(7)
    state = tx.init(params)
    outs = []
    for k in range(STEPS):
        u, state = tx.update(grads_for(k), state, params)
        if via_step:
            params = ref.apply_updates(params, u)
            outs.append(params)
        else:
            outs.append(u)
    return outs, state_arrays(state)


EXACT = with_reference(exact=True)


def use_path(path: str, monkeypatch) -> None:
    """Which CPU kernels run: the serial ones, or the parallel ones on the same small trees
    (``SERIAL_BELOW`` and ``CHUNK`` lowered; ``raising=True``: a renamed knob fails here), or
    the parallel ones writing every output with streaming stores (``STREAM_BYTES`` lowered)."""
    if path != "serial":
        monkeypatch.setattr(_config, "SERIAL_BELOW", 1, raising=True)
        monkeypatch.setattr(_config, "CHUNK", 64, raising=True)
    if path == "streaming":
        monkeypatch.setattr(_config, "STREAM_BYTES", 1, raising=True)


# The parallel and streaming drivers run the serial loop's body (the same formula text) over
# chunks: every Case runs serially, and the registry's SAMPLE of each kind of stage on the other
# two paths (compiling every formula's three drivers took a quarter of the CI's test time), its
# DRIVERS in the README's command and the rest in the exhaustive step (the parallel drivers of
# the SAMPLE took 3 of a cold run's 25 CPU minutes). NUMBACCUM_EXPLORE=1 runs every Case on every
# path.
def with_paths(names: list[str]) -> list:
    other = sweep([(n, p) for p in ("parallel", "streaming") for n in sampled(names)], keep=DRIVERS)
    return [(n, "serial") for n in names] + other


@pytest.mark.parametrize(("name", "path"), with_paths(EXACT))
def test_updates_and_state_bit_for_bit(name, path, monkeypatch):
    use_path(path, monkeypatch)
    outs, state = run(name)
    ref_outs, ref_state = run_reference(name)
    for k, (a, e) in enumerate(zip(outs, ref_outs)):
        assert_bits(a, e, f"{name} ({path}) step {k + 1} updates")
    if CASES[name].ref_state:
        compare_states(state, ref_state, f"{name} ({path})", assert_bits)


# step_ and stage by stage compile kernels of their own per Case: the SAMPLE in the README's
# command, every Case in the exhaustive step (registry.sweep).
@pytest.mark.parametrize("name", sweep(EXACT))
def test_step_bit_for_bit(name):
    """``step_`` (the update added inside the last fused pass) gives the reference's params."""
    outs, _ = run(name, via_step=True)
    ref_outs, _ = run_reference(name, via_step=True)
    for k, (a, e) in enumerate(zip(outs, ref_outs)):
        assert_bits(a, e, f"{name} step_ {k + 1} params")


@pytest.mark.parametrize("name", sweep(EXACT))
def test_fused_and_stage_by_stage_bit_for_bit(name, monkeypatch):
    fused = run(name)
    monkeypatch.setenv("NUMBACCUM_FUSE", "0")
    staged = run(name)
    for k, (a, e) in enumerate(zip(staged[0], fused[0])):
        assert_bits(a, e, f"{name} stage by stage vs fused, step {k + 1}")
    compare_states(staged[1], fused[1], f"{name} stage by stage vs fused", assert_bits)


def test_trees_reach_every_value_class():
    """The data these tests run on: zeros, -0.0, tiny values where eps dominates, large ones."""
    g = np.concatenate([np.ravel(x).astype(np.float64) for x in leaves(tree(1000))])
    assert np.any(g == 0) and np.any(np.signbit(g) & (g == 0))
    assert np.any((np.abs(g) > 0) & (np.abs(g) < 1e-7)) and np.any(np.abs(g) > 10)
    assert np.any(g > 0) and np.any(g < 0)


CLOSE = with_reference(exact=False)


# Per element: a leaf of small values is not excused by a large value elsewhere in the tree.
# float32: a few roundings apart (1 / sqrt rounded once more, then a momentum trace over it).
CLOSE_RTOL = {np.dtype(np.float32): 8e-6, np.dtype(np.float64): 1e-12}


def assert_close_elementwise(actual, expected, msg: str) -> None:
    """Each element within `CLOSE_RTOL` of its own reference value."""
    assert_same_structure(actual, expected)
    for p, a, e in zip(ref.tree_paths(as_tree(expected)), leaves(actual), leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape, f"{msg} {p}"
        np.testing.assert_allclose(a, e, rtol=CLOSE_RTOL[e.dtype], atol=0, err_msg=f"{msg} {p}")


@pytest.mark.parametrize(("name", "path"), with_paths(CLOSE))
def test_updates_and_state_close(name, path, monkeypatch):
    """The Cases whose README promise is not bit for bit (see their ``note``), per element."""
    use_path(path, monkeypatch)
    outs, state = run(name)
    ref_outs, ref_state = run_reference(name)
    for k, (a, e) in enumerate(zip(outs, ref_outs)):
        assert_close_elementwise(a, e, f"{name} ({path}) step {k + 1} updates")
    if CASES[name].ref_state:
        compare_states(state, ref_state, f"{name} ({path})", assert_close_elementwise)


def test_every_mutation_of_the_mutation_tool_still_finds_its_line():
    """``tests/tools/mutate.py`` (run by hand) mutates lines by their text: one that moved would
    stop the tool, so each line must still occur exactly once where it says."""
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).resolve().parent / "tools" / "mutate.py"
    spec = importlib.util.spec_from_file_location("_mutate_tool", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = tool.parent.parent.parent
    moved = [m.name for m in mod.MUTATIONS if (root / m.path).read_text().count(m.old) != 1]
    assert not moved, moved
