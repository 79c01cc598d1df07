"""Small helpers shared by the numbaccum test files (comparisons, state lookup)."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference as ref  # noqa: E402

import numbaccum as nba  # noqa: E402

INT32_MAX = ref.INT32_MAX

# Default relative tolerances: float32 matches optax within 1e-6 (its own test
# default); float64 within 1e-12 (DESIGN.md "Numerics").
RTOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}


# Hypothesis tests run QUICK draws in the README's command (the profile is derandomized: the same
# first draws every run) and LONG in .ci/run's exhaustive step: a draw of an ord, a dtype, an option
# or a hyperparameter's type compiles kernels of its own, and compiling is most of a cold run.
QUICK, LONG = 8, 30


def quick_and_long(body: Any, *strategies: Any, quick: int = QUICK, long: int = LONG, **options: Any) -> Any:
    """``body`` as two hypothesis tests over ``strategies`` (positional: they fill its last
    arguments, after any that pytest parametrizes): ``quick`` draws, and ``long`` marked
    ``exhaustive``; ``options``: more hypothesis settings (no deadline unless given)."""
    options.setdefault("deadline", None)
    short = settings(max_examples=quick, **options)(given(*strategies)(body))
    full = settings(max_examples=long, **options)(given(*strategies)(body))
    return short, pytest.mark.exhaustive(full)


# The thread counts whose results must have the same bits (conftest makes 2 available).
THREAD_COUNTS = (1, 2)


def thread_counts() -> tuple[int, ...]:
    """`THREAD_COUNTS`, failing (not skipping) where numba cannot run them in this process."""
    import numba

    assert max(THREAD_COUNTS) <= numba.config.NUMBA_NUM_THREADS, (
        f"NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}: tests/conftest.py should have raised it"
    )
    return THREAD_COUNTS


# The extra that brings each optional test dependency (the skip reason tells a user what to install).
EXTRAS = {
    "dp_accounting": "dp",
    "jax": "parity",
    "optax": "parity",
    "optax.contrib": "parity",
    "mpi4py": "mpi",
    "ml_dtypes": "bfloat16",
    "matplotlib": "bench",
    "sklearn": "docs",
    "scipy": "docs",
    "mkdocs": "docs",
    "mkdocstrings": "docs",
    "playwright.sync_api": "docs",
}

# Text that makes a documented example (a docstring's or a code block's) need an optional module.
USES = [
    (re.compile(r"\bdp_epsilon\("), "dp_accounting"),
    (re.compile(r"\bimport optax\b"), "optax"),
    (re.compile(r"\bimport jax\b"), "jax"),
    (re.compile(r"numbaccum\.distributed\b"), "mpi4py"),
]


def package_calls(fn: Any) -> int:
    """How many Python functions of the numbaccum package are entered while ``fn()`` runs (a
    ``sys.setprofile`` count: issue 43's measure of per-step planning, not a timing)."""
    package = os.path.dirname(os.path.abspath(nba.__file__)) + os.sep
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def watch_declarations(monkeypatch: Any, seen: list | None = None) -> list:
    """Makes every stage class's ``declare`` record its class's name into ``seen`` (returned) and
    raise an AssertionError when ``seen`` is None: a steady step replays its kept plan and
    declares nothing (a declaration is made once per state and layout)."""
    from numbaccum.base import Stage

    record: list = [] if seen is None else seen
    classes, todo = [], [Stage]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in classes:
        if "declare" in cls.__dict__ and cls is not Stage:
            real = cls.__dict__["declare"]

            def spy(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
                record.append(type(self).__name__)
                if seen is None:
                    raise AssertionError(f"a steady step declared {type(self).__name__} again")
                return _real(self, *args, **kwargs)

            monkeypatch.setattr(cls, "declare", spy)
    return record


def require(module: str) -> Any:
    """``module`` imported; skips without it, except under ``NUMBACCUM_CI``, where a missing
    module fails the test (CI installs every test dependency: a skip would hide a lost test).

    The skip's reason starts "optional dependency", which tests/conftest.py records for CI's
    second pass (.ci/run reruns those tests with the extras installed)."""
    import importlib

    import pytest

    if os.environ.get("NUMBACCUM_CI"):
        return importlib.import_module(module)
    extra = EXTRAS.get(module)
    hint = f"pip install 'numbaccum[{extra}]'" if extra else f"pip install {module}"
    return pytest.importorskip(module, reason=f"optional dependency {module} is not installed ({hint})")


def require_for(text: str) -> None:
    """`require` every optional module that the example ``text`` uses (see `USES`)."""
    for pattern, module in USES:
        if pattern.search(text):
            require(module)


def as_tree(x: Any) -> Any:
    """The plain tree of a FlatTree (views into its buffers); plain trees as-is."""
    if isinstance(x, nba.FlatTree):
        return x.tree
    return x


def leaves(x: Any) -> list:
    return ref.tree_leaves(as_tree(x))


def snapshot(x: Any) -> Any:
    """An independent copy of a tree or FlatTree, as a plain tree."""
    return ref.tree_map(lambda a: np.array(a, copy=True), as_tree(x))


def scalar_int(x: Any) -> int:
    """A state counter: must be an int32 scalar (np.int32 or 0-d int32)."""
    a = np.asarray(x)
    assert a.ndim == 0, f"counter is not a scalar: {x!r}"
    assert a.dtype == np.int32, f"counter dtype {a.dtype}, expected int32"
    return int(a)


def assert_same_structure(actual: Any, expected: Any) -> None:
    sa = ref.tree_structure(as_tree(actual))
    se = ref.tree_structure(as_tree(expected))
    assert sa == se, f"tree structure differs:\n got      {sa}\n expected {se}"


def _check_leaf_meta(a, e, path, check_dtype):
    a = np.asarray(a)
    e = np.asarray(e)
    assert a.shape == e.shape, f"{path}: shape {a.shape} != {e.shape}"
    if check_dtype:
        assert a.dtype == e.dtype, f"{path}: dtype {a.dtype} != {e.dtype}"
    return a, e


def assert_tree_equal(actual: Any, expected: Any, check_dtype: bool = True, msg: str = "") -> None:
    """Bit-for-bit equality (NaN == NaN; -0.0 == +0.0, as assert_array_equal)."""
    assert_same_structure(actual, expected)
    paths = ref.tree_paths(as_tree(expected))
    for p, a, e in zip(paths, leaves(actual), leaves(expected)):
        a, e = _check_leaf_meta(a, e, p, check_dtype)
        np.testing.assert_array_equal(a, e, err_msg=f"{msg} {p}")


def assert_tree_close(
    actual: Any,
    expected: Any,
    rtol: float | None = None,
    atol_rel: float | None = None,
    check_dtype: bool = True,
    msg: str = "",
) -> None:
    """allclose leaf by leaf, each leaf with its own tolerance.

    ``rtol`` defaults to RTOL of each expected leaf's dtype. ``atol`` is ``rtol * max|leaf|``
    of that leaf (``atol_rel`` overrides the factor): elements that end near zero after
    cancellation would otherwise need bit-exactness that the spec only promises for some
    recipes. Never a scale from the whole tree: a leaf of small values next to a large one
    would then pass with any value.
    """
    assert_same_structure(actual, expected)
    el = leaves(expected)
    paths = ref.tree_paths(as_tree(expected))
    for p, a, e in zip(paths, leaves(actual), el):
        a, e = _check_leaf_meta(a, e, p, check_dtype)
        r = rtol if rtol is not None else RTOL.get(e.dtype, 1e-6)
        finite = np.abs(e[np.isfinite(e)].astype(np.float64))
        scale = float(np.max(finite)) if finite.size else 0.0
        atol = (atol_rel if atol_rel is not None else r) * scale
        np.testing.assert_allclose(a, e, rtol=r, atol=atol, err_msg=f"{msg} {p}")


def assert_exact_positive_zeros(tree: Any, msg: str = "") -> None:
    """Every element is exactly +0.0 (no -0.0, no NaN)."""
    for p, a in zip(ref.tree_paths(as_tree(tree)), leaves(tree)):
        a = np.asarray(a)
        assert np.all(a == 0), f"{msg} {p}: not all zeros: {a!r}"
        assert not np.any(np.signbit(a)), f"{msg} {p}: -0.0 found: {a!r}"


def find_state(state: Any, cls: type) -> Any:
    """The first instance of ``cls`` inside nested tuples/lists/dicts of states."""
    if isinstance(state, cls):
        return state
    if isinstance(state, dict):
        children = list(state.values())
    elif isinstance(state, (tuple, list)):
        children = list(state)
    else:
        return None
    for c in children:
        r = find_state(c, cls)
        if r is not None:
            return r
    return None


def no_shared_memory(a_tree: Any, b_tree: Any) -> bool:
    """True when no leaf of ``a_tree`` shares memory with a leaf of ``b_tree``."""
    al = [np.asarray(x) for x in leaves(a_tree)]
    bl = [np.asarray(x) for x in leaves(b_tree)]
    for x in al:
        if x.size == 0:
            continue
        for y in bl:
            if y.size and np.shares_memory(x, y):
                return False
    return True


def state_arrays(state, path: str = "state") -> dict:
    """The arrays of a (nested) state by path (NamedTuple fields by name), leaf by leaf (how the
    reference's state and numbaccum's are compared: numbaccum may keep more, such as workspaces)."""
    if isinstance(state, nba.FlatTree):
        return state_arrays(state.tree, path)
    if isinstance(state, np.ndarray | np.generic):
        return {path: np.array(state)}
    if hasattr(state, "copy_to_host"):  # a device array (a state on the GPU)
        return {path: state.copy_to_host()}
    out: dict = {}
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        for f in state._fields:
            out.update(state_arrays(getattr(state, f), f"{path}.{f}"))
    elif isinstance(state, tuple | list):
        for i, s in enumerate(state):
            out.update(state_arrays(s, f"{path}[{i}]"))
    elif isinstance(state, dict):
        for k in sorted(state):
            out.update(state_arrays(state[k], f"{path}[{k!r}]"))
    return out


def raising_user_code() -> tuple[Any, list]:
    """``(transformation, fail)``: a user-written stateless transformation (the updates as they
    are) that raises ``RuntimeError("user code failed")`` while ``fail[0]`` is True."""
    fail = [False]

    def update(u: Any, state: Any, params: Any = None) -> Any:
        if fail[0]:
            raise RuntimeError("user code failed")
        return u, state

    return nba.GradientTransformation(lambda params: (), update), fail


def check_raising_update_commits_nothing(tx: Any, fail: list, grads: Any, params: Any, written: Any) -> None:
    """An update of ``tx`` whose user code raises (``fail``, from `raising_user_code`) leaves
    ``written(state)`` (what the stages before it write) as it was, bit for bit, and commits
    nothing: the next update of that state gives the same bits as one of a copy taken before."""
    s = tx.init(params)
    _, s = tx.update(grads, s, params)
    kept = nba.copy_state(s)
    fail[0] = True
    with pytest.raises(RuntimeError, match="user code failed"):
        tx.update(grads, s, params)
    assert_tree_equal(written(s), written(kept))
    fail[0] = False
    u, _ = tx.update(grads, s, params)  # the state is still current
    v, _ = tx.update(grads, kept, params)
    assert_tree_equal(u, v)


def same_stdout_with_one_and_two_threads(script: str) -> None:
    """``script`` (Python source) prints the same with NUMBA_NUM_THREADS 1 and 2: the parallel
    kernels' bits do not depend on the thread count."""
    import subprocess

    results = []
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads)
        r = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        results.append(r.stdout.strip())
    assert results[0] == results[1]


def plain(x: Any) -> Any:
    """A state or updates as nested plain data of host arrays (bits compared with array_equal)."""
    if isinstance(x, nba.FlatTree):
        return ("flat", [g.copy_to_host() if x.device else np.array(g) for g in x.groups])
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, [plain(v) for v in x])
    if isinstance(x, (np.ndarray, np.generic)):
        return np.array(x)
    return x


def assert_bits_equal(a: Any, b: Any, where: str = "") -> None:
    """Bit equality of two states or updates: the same containers (a NamedTuple's class name
    too), dtypes and shapes, the same bytes (NaN payloads, -0.0), equal plain scalars."""
    pa, pb = plain(a), plain(b)

    def rec(x, y, path):
        if isinstance(x, dict):
            assert isinstance(y, dict) and set(x) == set(y), path
            for k in x:
                rec(x[k], y[k], f"{path}[{k!r}]")
        elif isinstance(x, tuple):
            assert isinstance(y, tuple) and x[0] == y[0] and len(x[1]) == len(y[1]), path
            for i, (u, v) in enumerate(zip(x[1], y[1])):
                rec(u, v, f"{path}[{i}]")
        elif isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, path
            assert x.tobytes() == y.tobytes(), f"{where}{path}: {x} != {y}"
        else:
            assert type(x) is type(y) and (x == y or (x != x and y != y)), f"{where}{path}: {x!r} != {y!r}"

    rec(pa, pb, "")
