"""Transformations written by users (issue 22, item 2), without JAX.

A user's ``GradientTransformation`` gets buffers of its own, which it may keep, return or
modify (never the caller's gradients, never a state's accumulator), and what it returns is read
before anything it might alias is reset; an update around it is all or nothing. The random
chains against optax itself are in test_user_transformations_optax.py.
"""

from typing import Any, NamedTuple

import numpy as np
import pytest

import numbaccum as nba
from numbaccum.passes import step_


def identity_tx() -> nba.GradientTransformation:
    return nba.GradientTransformation(lambda params: nba.EmptyState(), lambda u, s, params=None: (u, s))


class Flaky:
    """A user transformation that returns its input (or what the numbaccum transformation
    ``inner`` it calls returns, after that one wrote its state), and raises on the calls listed
    in ``fail_on`` (counted from 1): a transient failure."""

    def __init__(self, fail_on: set[int], inner: Any = None) -> None:
        self.calls = 0
        self.fail_on = fail_on
        self.inner = inner

    def init(self, params: Any) -> Any:
        return nba.EmptyState() if self.inner is None else self.inner.init(params)

    def update(self, u: Any, s: Any, params: Any = None) -> tuple[Any, Any]:
        self.calls += 1
        if self.inner is not None:
            u, s = self.inner.update(u, s, params)
        if self.calls in self.fail_on:
            raise RuntimeError("transient failure")
        return u, s

    def tx(self) -> nba.GradientTransformation:
        return nba.GradientTransformation(self.init, self.update)


def _params() -> dict:
    return {"b": np.zeros(3, np.float32), "w": np.zeros((2, 3), np.float32)}


def _grads(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"b": rng.standard_normal(3).astype(np.float32), "w": rng.standard_normal((2, 3)).astype(np.float32)}
        for _ in range(n)
    ]


def _copy(tree: dict) -> dict:
    return {k: v.copy() for k, v in tree.items()}


def _bits(state: Any) -> list:
    """Every array, FlatTree group and scalar of a state, as bytes (with its path)."""
    out: list = []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, nba.FlatTree):
            out.extend((f"{path}.group{i}", g.tobytes()) for i, g in enumerate(x.groups))
        elif isinstance(x, (np.ndarray, np.generic)):
            out.append((path, x.dtype.str, np.asarray(x).tobytes()))
        elif isinstance(x, dict):
            for k in sorted(x):
                walk(x[k], f"{path}[{k!r}]")
        elif isinstance(x, tuple) and hasattr(type(x), "_fields"):
            out.append((path, type(x).__name__))
            for k, v in zip(type(x)._fields, x):
                walk(v, f"{path}.{k}")
        elif isinstance(x, (tuple, list)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        else:
            out.append((path, repr(x)))

    walk(state, "state")
    return out


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_multisteps_of_a_user_transformation_emits_the_mean(factor):
    """issue 22 item 2: every emitting step returned zeros (the user's output was the
    accumulator, reset before it was read)."""
    inner = identity_tx() if factor == 1.0 else nba.chain(identity_tx(), nba.scale(factor))
    ms = nba.MultiSteps(inner, 2)
    params = _params()
    state = ms.init(params)
    grads = _grads(6)
    for i, g in enumerate(grads):
        u, state = ms.update(_copy(g), state, params)
        if i % 2 == 1:
            for k in g:
                mean = grads[i - 1][k] + (g[k] - grads[i - 1][k]) / np.float32(2)  # Welford, as ours
                np.testing.assert_array_equal(u[k], mean * np.float32(factor), err_msg=f"step {i} {k}")
        else:
            assert all(not np.any(u[k]) for k in u)


def _flaky_setups() -> dict:
    """name -> (make(flaky) -> transformation, the call of the flaky code that raises): the
    failure always lands on a step where earlier stages have written their states."""
    return {
        "multisteps": (lambda f: nba.MultiSteps(f.tx(), 2), 2),
        "multisteps_chain": (
            lambda f: nba.MultiSteps(nba.chain(nba.adam(0.1), f.tx(), nba.scale(2.0)), 2),
            2,
        ),
        "chain": (lambda f: nba.chain(nba.trace(0.9), nba.adam(0.1), f.tx(), nba.scale(0.5)), 3),
        "nested": (
            lambda f: nba.chain(
                nba.ema(0.9),
                nba.MultiSteps(nba.chain(nba.trace(0.5), f.tx()), 2),
                nba.clip_by_global_norm(1.0),
            ),
            2,
        ),
        "wraps_adam_chain": (lambda f: nba.chain(nba.trace(0.9), f.tx()), 2),
        "wraps_adam_multisteps": (lambda f: nba.MultiSteps(f.tx(), 2), 2),
        "masked": (lambda f: nba.chain(nba.trace(0.9), nba.masked(f.tx(), {"b": True, "w": False})), 2),
        "apply_if_finite": (lambda f: nba.chain(nba.adam(0.1), nba.apply_if_finite(f.tx(), 2)), 2),
        "inject": (
            lambda f: nba.chain(
                nba.trace(0.9), nba.inject_hyperparams(lambda lr: nba.chain(f.tx(), nba.scale(lr)))(lr=0.1)
            ),
            2,
        ),
    }


@pytest.mark.parametrize("applied", [False, True], ids=["update", "step_"])
@pytest.mark.parametrize("name", sorted(_flaky_setups()))
def test_user_transformation_failing_is_all_or_nothing(name, applied):
    """issue 22 item 2: a user transformation that raises on an emitting step left the
    accumulator (and earlier stages' states) changed: the retry returned zeros. Now the state
    is bitwise what it was, and the retry gives what a run without the failure gives."""
    make, fail_on = _flaky_setups()[name]
    adam = name.startswith("wraps_adam")
    flaky = Flaky({fail_on}, nba.adam(0.1) if adam else None)
    tx, twin = make(flaky), make(Flaky(set(), nba.adam(0.1) if adam else None))
    params, twin_params = _params(), _params()
    state, twin_state = tx.init(params), twin.init(twin_params)
    failed = []

    def step(g: dict) -> Any:
        if applied:
            return None, step_(tx, _copy(g), state, params)
        return tx.update(_copy(g), state, params)

    for i, g in enumerate(_grads(6)):
        before, params_before = _bits(state), _copy(params)
        try:
            u, new_state = step(g)
        except RuntimeError as e:
            assert "transient" in str(e)
            failed.append(i)
            assert _bits(state) == before, f"step {i}: the state changed"
            for k in params:
                np.testing.assert_array_equal(params[k], params_before[k], err_msg="params changed")
            u, new_state = step(g)  # the retry
        state = new_state
        if applied:
            twin_state = step_(twin, _copy(g), twin_state, twin_params)
            for k in params:
                np.testing.assert_array_equal(params[k], twin_params[k], err_msg=f"step {i} {k}")
        else:
            v, twin_state = twin.update(_copy(g), twin_state, twin_params)
            for k in u:
                np.testing.assert_array_equal(u[k], v[k], err_msg=f"step {i} {k}")
        assert _bits(state) == _bits(twin_state)
    assert len(failed) == 1 and failed[0] > 0  # it failed once, after earlier steps


class Prev(NamedTuple):
    prev: Any


def keeps_its_input() -> nba.GradientTransformation:
    """Keeps a reference to its input (in its state) and reads it on the next call, then
    modifies the input in place and returns it."""

    def update(u: dict, s: Prev, params: Any = None) -> tuple[dict, Prev]:
        out = {k: u[k] + np.float32(0.5) * s.prev[k] for k in u}
        for k in u:
            u[k] *= np.float32(3.0)  # its own buffer: nobody else reads it
        return out, Prev(u)

    return nba.GradientTransformation(lambda p: Prev({k: np.zeros_like(v) for k, v in p.items()}), update)


@pytest.mark.parametrize("where", ["first", "after_trace", "multisteps"])
def test_user_code_may_keep_and_modify_its_input(where):
    """The buffers a user transformation gets are its own: modifying them changes neither the
    caller's gradients nor anything of the state, and what it kept is what it was given."""
    user = keeps_its_input()
    tx = {
        "first": nba.chain(user, nba.scale(2.0)),
        "after_trace": nba.chain(nba.trace(0.5), user),
        "multisteps": nba.MultiSteps(nba.chain(nba.scale(1.0), user), 1),
    }[where]
    params = _params()
    state = tx.init(params)
    prev = {k: np.zeros_like(v) for k, v in params.items()}
    trace = {k: np.zeros_like(v) for k, v in params.items()}
    for i, g in enumerate(_grads(4)):
        given = _copy(g)
        u, state = tx.update(given, state, params)
        for k in g:
            np.testing.assert_array_equal(given[k], g[k], err_msg="the caller's gradients changed")
        if where == "after_trace":
            trace = {k: g[k] + np.float32(0.5) * trace[k] for k in g}
            x = trace
        else:
            x = g
        want = {k: x[k] + np.float32(0.5) * prev[k] for k in g}
        prev = {k: x[k] * np.float32(3.0) for k in g}
        for k in g:
            expected = want[k] * np.float32(2.0) if where == "first" else want[k]
            np.testing.assert_array_equal(u[k], expected, err_msg=f"step {i} {k}")


def test_user_transformation_may_return_python_scalars_and_a_list():
    """A 0-d leaf returned as a Python float (JAX accepts one), and the (updates, state) pair as
    a list."""

    def update(u, s, params=None):
        return [{"a": float(u["a"]) * 3.0, "v": u["v"]}, s]

    user = nba.GradientTransformation(lambda p: nba.EmptyState(), update)
    tx = nba.chain(user, nba.scale(2.0))
    params = {"a": np.zeros((), np.float32), "v": np.zeros(2, np.float32)}
    u, _ = tx.update({"a": np.float32(1.5), "v": np.ones(2, np.float32)}, tx.init(params), params)
    assert u["a"].dtype == np.float32 and float(u["a"]) == 9.0
    np.testing.assert_array_equal(u["v"], [2.0, 2.0])


# --- optax's stateless and stateless_with_tree_map --------------------------------------------


def test_stateless_hands_f_the_updates_and_params_as_given():
    seen = []

    def f(updates, params):
        seen.append((updates, params))
        return {k: v * 3 for k, v in updates.items()}

    tx = nba.stateless(f)
    g, p = {"w": np.ones(2, np.float32)}, {"w": np.zeros(2, np.float32)}
    u, state = tx.update(g, tx.init(p), p)
    assert state == nba.EmptyState() and seen[0][0] is g and seen[0][1] is p
    np.testing.assert_array_equal(u["w"], np.full(2, 3, np.float32))
    tx.update(g, state)
    assert seen[1][1] is None


def test_stateless_with_tree_map_passes_none_for_each_leaf_without_params():
    got = []
    tx = nba.stateless_with_tree_map(lambda g, p: got.append(p) or g - (0 if p is None else p))
    g = {"a": np.ones(2), "b": np.ones(3)}
    u, _ = tx.update(g, tx.init(g))
    assert got == [None, None]
    u, _ = tx.update(g, tx.init(g), {"a": np.ones(2), "b": np.zeros(3)})
    assert u["a"].tolist() == [0.0, 0.0] and u["b"].tolist() == [1.0, 1.0, 1.0]


def test_stateless_in_a_chain_is_user_code_whose_output_is_copied():
    kept = []

    def f(updates, params):
        kept.append(updates)  # keeps the buffer it was handed
        return updates

    tx = nba.chain(nba.stateless(f), nba.adam(0.1))
    params = {"w": np.ones(3, np.float32)}
    state = tx.init(params)
    for i in range(2):
        state = step_(tx, {"w": np.full(3, i + 1.0, np.float32)}, state, params)
    assert [k["w"].tolist() for k in kept] == [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    with pytest.raises(TypeError, match="f must be callable"):
        nba.stateless(3)
