"""Random chains of numbaccum stages and transformations written by users, against optax
(issue 22, item 2).

Each user transformation exists twice, once written for NumPy (run by numbaccum) and once for
jnp (run by optax), in several styles: it returns its input, returns new arrays, modifies its
input in place, returns Python scalars and lists, or keeps a reference to its input (in its
state) and reads it on the next call. They sit inside `chain`, `MultiSteps`, `apply_if_finite`,
`masked` and `inject_hyperparams`, mixed with numbaccum's own stages. Each step's updates match
optax's within float32's rtol 1e-6 (per leaf, with an atol of 1e-6 of that leaf's largest
value for elements where terms cancel), the caller's gradients are never changed, and `step_`
gives the bits of ``update`` then ``apply_updates_``.
"""

from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numbaccum as nba
from numbaccum.passes import step_

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

STAGES = ("scale", "trace", "nesterov", "ema", "clip", "adam", "decay")
STYLES = ("identity", "new", "inplace", "lists", "keepref")
WRAPPERS = ("multisteps", "finite", "masked", "inject")


def _stage(name: str, lib: Any) -> Any:
    return {
        "scale": lambda: lib.scale(-0.5),
        "trace": lambda: lib.trace(0.9),
        "nesterov": lambda: lib.trace(0.5, nesterov=True),
        "ema": lambda: lib.ema(0.8),
        "clip": lambda: lib.clip_by_global_norm(1.5),
        "adam": lambda: lib.adam(0.1),
        "decay": lambda: lib.add_decayed_weights(0.01),
    }[name]()


class Prev(NamedTuple):
    prev: Any


def _user(style: str, lib: Any) -> Any:
    """The user transformation of ``style``, written for NumPy (``lib`` numbaccum) or jnp
    (``lib`` optax): the same arithmetic, each rounded in float32."""
    numpy = lib is nba
    empty = lambda params: lib.EmptyState()  # noqa: E731
    tmap = jax.tree.map  # a tree utility only: the leaves are NumPy arrays on numbaccum's side

    if style == "identity":
        return lib.GradientTransformation(empty, lambda u, s, params=None: (u, s))
    if style == "new":
        return lib.GradientTransformation(empty, lambda u, s, params=None: (tmap(lambda x: x * 0.5 + 1.0, u), s))
    if style == "inplace":

        def inplace(u, s, params=None):
            if not numpy:
                return tmap(lambda x: x * 2.0 - 0.25, u), s
            for x in jax.tree.leaves(u):
                x *= 2.0
                x -= 0.25
            return u, s

        return lib.GradientTransformation(empty, inplace)
    if style == "lists":
        # A list for the pair; Python floats for 0-d leaves (as ``float(x)`` gives them).
        def lists(u, s, params=None):
            if not numpy:
                return [tmap(lambda x: x * 3.0, u), s]
            return [tmap(lambda x: float(x) * 3.0 if x.ndim == 0 else x * 3.0, u), s]

        return lib.GradientTransformation(empty, lists)

    # keepref: reads the input it kept on the last call (zeros at first)
    zeros = np.zeros_like if numpy else jnp.zeros_like

    def keepref(u, s, params=None):
        return tmap(lambda x, p: x + 0.5 * p, u, s.prev), Prev(u)

    return lib.GradientTransformation(lambda params: Prev(tmap(zeros, params)), keepref)


def _build(items: list, lib: Any) -> Any:
    return lib.chain(*(_item(it, lib) for it in items))


def _item(it: tuple, lib: Any) -> Any:
    kind = it[0]
    if kind == "stage":
        return _stage(it[1], lib)
    if kind == "user":
        return _user(it[1], lib)
    _, inner_items, k, bits = it
    if kind == "inject":
        factory = lambda learning_rate: lib.chain(  # noqa: E731
            *(_item(x, lib) for x in inner_items), lib.scale(learning_rate)
        )
        return lib.inject_hyperparams(factory)(learning_rate=0.75)
    inner = _build(inner_items, lib)
    if kind == "multisteps":
        return lib.MultiSteps(inner, k).gradient_transformation()
    if kind == "finite":
        return lib.apply_if_finite(inner, 2)
    # bit 8: a prefix mask, whose False leaf is one MaskedNode for its whole subtree
    mask = {"b": bool(bits & 1) if bits & 8 else [bool(bits & 1), bool(bits & 2)], "w": bool(bits & 4)}
    return lib.masked(inner, mask)


_leaf = st.one_of(
    st.tuples(st.just("stage"), st.sampled_from(STAGES)), st.tuples(st.just("user"), st.sampled_from(STYLES))
)
_wrapped = st.tuples(st.sampled_from(WRAPPERS), st.lists(_leaf, min_size=1, max_size=3), st.integers(1, 3), st.integers(0, 15))


@st.composite
def chains(draw: Any, wrapper: str | None) -> list:
    """A chain of 1-4 items with a user transformation in it: inside a ``wrapper`` (which may
    itself sit in another wrapper) when one is given, else at the top."""
    items = draw(st.lists(st.one_of(_leaf, _wrapped), min_size=0, max_size=2))
    user: tuple = ("user", draw(st.sampled_from(STYLES)))
    if wrapper is not None:
        inner = draw(st.lists(_leaf, min_size=0, max_size=2))
        inner.insert(draw(st.integers(0, len(inner))), user)
        user = (wrapper, inner, draw(st.integers(1, 3)), draw(st.integers(0, 15)))
        if draw(st.integers(0, 3)) == 0:  # one more level
            user = (draw(st.sampled_from(WRAPPERS)), [user], draw(st.integers(1, 3)), draw(st.integers(0, 15)))
    items.insert(draw(st.integers(0, len(items))), user)
    return items


def _params(rng: np.random.Generator) -> dict:
    # a list node and a 0-d leaf: where the "lists" style returns Python floats
    return {
        "b": [rng.standard_normal(4).astype(np.float32), np.float32(rng.standard_normal()).reshape(())],
        "w": rng.standard_normal((3, 5)).astype(np.float32),
    }


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _assert_close(ours: Any, theirs: Any, where: str) -> None:
    a_leaves = jax.tree.leaves(ours)
    b_leaves = jax.tree.leaves(theirs)
    assert len(a_leaves) == len(b_leaves), where
    for i, (a, b) in enumerate(zip(a_leaves, b_leaves)):
        a, b = np.asarray(a), np.asarray(b, dtype=np.float32)
        assert a.dtype == np.float32, f"{where}: leaf {i} is {a.dtype}"
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale, err_msg=f"{where}: leaf {i}")


@settings(
    max_examples=6,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@pytest.mark.parametrize("wrapper", [None, *WRAPPERS])
@given(data=st.data(), seed=st.integers(0, 2**16), n_steps=st.integers(2, 6))
def test_random_chains_with_user_transformations_match_optax(wrapper, data, seed, n_steps):
    items = data.draw(chains(wrapper), label="items")
    rng = np.random.default_rng(seed)
    params = _params(rng)
    grads = [jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params) for _ in range(n_steps)]
    ours, applied, theirs = _build(items, nba), _build(items, nba), _build(items, optax)
    p_ours, p_applied, p_theirs = _copy(params), _copy(params), jax.tree.map(jnp.asarray, params)
    s_ours, s_applied, s_theirs = ours.init(p_ours), applied.init(p_applied), theirs.init(p_theirs)
    for i, g in enumerate(grads):
        where = f"{items} step {i}"
        given_g = _copy(g)
        u, s_ours = ours.update(given_g, s_ours, p_ours)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, err_msg="the gradients changed"), given_g, g)
        v, s_theirs = theirs.update(jax.tree.map(jnp.asarray, g), s_theirs, p_theirs)
        _assert_close(u, v, where)
        nba.apply_updates_(p_ours, u)
        p_theirs = optax.apply_updates(p_theirs, v)
        s_applied = step_(applied, _copy(g), s_applied, p_applied)
        for a, b in zip(jax.tree.leaves(p_applied), jax.tree.leaves(p_ours)):
            np.testing.assert_array_equal(a, b, err_msg=f"{where}: step_ differs from update + apply_updates_")
