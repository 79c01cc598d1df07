"""Hypothesis strategies for random parameter/gradient trees.

A tree is drawn in two stages: first a *spec* (the structure, with a
``LeafSpec(shape, dtype)`` at each leaf), then any number of value trees that
follow that spec. That gives sequences of gradient trees that share one
structure, as an optimizer loop produces them.

The trees must reach real work: besides the special shapes (0-d, size 0), leaves have up to
a few thousand elements, and about one draw in `BIG_ONE_IN` has a leaf of `BIG_LEAF` elements,
above ``numbaccum._config.SERIAL_BELOW``, so that the parallel kernels run (``big=False``
leaves them out, for the CUDA simulator). Values are drawn element by element (no fill value:
hypothesis would otherwise make most elements of a leaf one repeated value, often 0), large
leaves from a seeded generator over many magnitudes, with zeros and -0.0 among them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

# Shapes that stress the layout code: 0-d, size 0, and small ordinary ones.
SPECIAL_SHAPES = [(), (0,), (2, 0), (1,), (3,), (2, 3), (1, 1)]

# A leaf that takes the parallel kernels (>= numbaccum._config.SERIAL_BELOW, checked by
# test_strategies), odd so that it is not a multiple of any chunk; one draw in BIG_ONE_IN.
BIG_LEAF = (1 << 16) + 3
BIG_ONE_IN = 12
# Leaves up to this many elements are drawn element by element; larger ones from a generator.
ELEMENTWISE_MAX = 64


class Pair(NamedTuple):
    """A NamedTuple node, to check NamedTuples are kept as tree nodes."""

    a: Any
    b: Any


@dataclass(frozen=True)
class LeafSpec:
    shape: tuple
    dtype: np.dtype


def shapes(big: bool = True) -> st.SearchStrategy[tuple]:
    options = [
        st.sampled_from(SPECIAL_SHAPES),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=3, max_side=16),
        hnp.array_shapes(min_dims=1, max_dims=2, min_side=2, max_side=8),
        st.tuples(st.integers(65, 3000)),
    ]
    if not big:
        return st.one_of(*options)
    usual = st.one_of(*options)
    return st.integers(1, BIG_ONE_IN).flatmap(lambda k: st.just((BIG_LEAF,)) if k == 1 else usual)


def leaf_specs(dtypes=(F32, F64), big: bool = True) -> st.SearchStrategy[LeafSpec]:
    return st.builds(LeafSpec, shapes(big), st.sampled_from([np.dtype(d) for d in dtypes]))


_KEYS = st.text(alphabet="abcdefgxyz_", min_size=1, max_size=4)


def spec_leaves(spec: Any) -> list[LeafSpec]:
    out: list[LeafSpec] = []

    def rec(s: Any) -> None:
        if s is None:
            return
        if isinstance(s, LeafSpec):
            out.append(s)
        elif isinstance(s, dict):
            for k in sorted(s):
                rec(s[k])
        else:
            for c in s:
                rec(c)

    rec(spec)
    return out


def tree_specs(
    dtypes=(F32, F64),
    max_leaves: int = 6,
    allow_none: bool = True,
    allow_namedtuple: bool = True,
    min_leaves: int = 1,
    big: bool = True,
) -> st.SearchStrategy[Any]:
    """Nested dict / list / tuple (/ NamedTuple / None) specs with LeafSpec leaves."""
    base = leaf_specs(dtypes, big)

    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        kids = st.one_of(children, st.none()) if allow_none else children
        options = [
            st.dictionaries(_KEYS, kids, min_size=1, max_size=3),
            st.lists(kids, min_size=1, max_size=3),
            st.lists(kids, min_size=1, max_size=3).map(tuple),
        ]
        if allow_namedtuple:
            options.append(st.builds(Pair, kids, kids))
        return st.one_of(*options)

    node = st.recursive(base, extend, max_leaves=max_leaves)
    # A wide top level as well, so that most trees have several leaves (and
    # mixed dtypes) rather than the one leaf st.recursive favours.
    top = st.one_of(
        node,
        st.dictionaries(_KEYS, node, min_size=2, max_size=4),
        st.lists(node, min_size=2, max_size=4),
    )
    return top.filter(lambda s: len(spec_leaves(s)) >= min_leaves)


def _generated(spec: LeafSpec, max_abs: float, seed: int, zero_share: float) -> np.ndarray:
    """A large leaf: random signs and magnitudes over 8 decades below ``max_abs``, a share of
    exact zeros (some of them -0.0)."""
    rng = np.random.default_rng(seed)
    n = math.prod(spec.shape)
    x = rng.choice([-1.0, 1.0], n) * max_abs * 10.0 ** rng.uniform(-8, 0, n)
    zeros = rng.random(n) < zero_share
    x[zeros] = np.where(rng.random(int(zeros.sum())) < 0.3, -0.0, 0.0)
    return x.astype(spec.dtype).reshape(spec.shape)


def leaf_arrays(spec: LeafSpec, max_abs: float = 10.0) -> st.SearchStrategy[np.ndarray]:
    if math.prod(spec.shape) > ELEMENTWISE_MAX:
        seeds = st.integers(0, 2**32 - 1)
        return st.builds(
            _generated, st.just(spec), st.just(max_abs), seeds, st.sampled_from([0.0, 0.05, 0.5])
        )
    width = 32 if spec.dtype == F32 else 64
    nonzero = st.floats(
        -max_abs, max_abs, width=width, allow_nan=False, allow_infinity=False, allow_subnormal=False
    ).filter(bool)
    # hypothesis favours 0.0: about one element in five is a zero of either sign, not most
    elements = st.one_of(nonzero, nonzero, nonzero, nonzero, st.sampled_from([0.0, -0.0]))
    return hnp.arrays(spec.dtype, spec.shape, elements=elements, fill=st.nothing())


def tree_from_spec(spec: Any, max_abs: float = 10.0) -> st.SearchStrategy[Any]:
    """Strategy for a value tree following ``spec``."""
    if spec is None:
        return st.none()
    if isinstance(spec, LeafSpec):
        return leaf_arrays(spec, max_abs)
    if isinstance(spec, dict):
        return st.fixed_dictionaries({k: tree_from_spec(v, max_abs) for k, v in spec.items()})
    if isinstance(spec, Pair):
        return st.builds(Pair, tree_from_spec(spec.a, max_abs), tree_from_spec(spec.b, max_abs))
    if isinstance(spec, tuple):
        return st.tuples(*[tree_from_spec(c, max_abs) for c in spec])
    if isinstance(spec, list):
        return st.tuples(*[tree_from_spec(c, max_abs) for c in spec]).map(list)
    raise TypeError(spec)


def trees(**spec_kwargs) -> st.SearchStrategy[Any]:
    """A single random tree."""
    max_abs = spec_kwargs.pop("max_abs", 10.0)
    return tree_specs(**spec_kwargs).flatmap(lambda s: tree_from_spec(s, max_abs))


@st.composite
def tree_sequences(
    draw,
    min_steps: int = 1,
    max_steps: int = 6,
    max_abs: float = 10.0,
    **spec_kwargs,
):
    """``(params, [grads_1, ..., grads_n])``: trees that share one structure."""
    spec = draw(tree_specs(**spec_kwargs))
    n = draw(st.integers(min_steps, max_steps))
    params = draw(tree_from_spec(spec, max_abs))
    grads = [draw(tree_from_spec(spec, max_abs)) for _ in range(n)]
    return params, grads
