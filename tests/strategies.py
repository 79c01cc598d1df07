"""Hypothesis strategies for random parameter/gradient trees.

A tree is drawn in two stages: first a *spec* (the structure, with a
``LeafSpec(shape, dtype)`` at each leaf), then any number of value trees that
follow that spec. That gives sequences of gradient trees that share one
structure, as an optimizer loop produces them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

# Shapes that stress the layout code: 0-d, size 0, and small ordinary ones.
SPECIAL_SHAPES = [(), (0,), (2, 0), (1,), (3,), (2, 3), (1, 1)]


class Pair(NamedTuple):
    """A NamedTuple node, to check NamedTuples are kept as tree nodes."""

    a: Any
    b: Any


@dataclass(frozen=True)
class LeafSpec:
    shape: tuple
    dtype: np.dtype


def shapes() -> st.SearchStrategy[tuple]:
    return st.one_of(
        st.sampled_from(SPECIAL_SHAPES),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    )


def leaf_specs(dtypes=(F32, F64)) -> st.SearchStrategy[LeafSpec]:
    return st.builds(LeafSpec, shapes(), st.sampled_from([np.dtype(d) for d in dtypes]))


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
) -> st.SearchStrategy[Any]:
    """Nested dict / list / tuple (/ NamedTuple / None) specs with LeafSpec leaves."""
    base = leaf_specs(dtypes)

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


def leaf_arrays(spec: LeafSpec, max_abs: float = 10.0) -> st.SearchStrategy[np.ndarray]:
    width = 32 if spec.dtype == F32 else 64
    elements = st.floats(
        -max_abs, max_abs, width=width, allow_nan=False, allow_infinity=False, allow_subnormal=False
    )
    return hnp.arrays(spec.dtype, spec.shape, elements=elements)


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
