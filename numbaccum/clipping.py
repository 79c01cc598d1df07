"""Norms of whole trees (the optax clipping family builds on them)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import backend
from .flat import FlatTree, Layout, as_flat, layout_of

__all__ = ["global_norm"]

_SEGMENT_KERNEL = {1: "segment_sumabs", 2: "segment_sumsq", math.inf: "segment_maxabs"}


def leaf_reductions(flat: FlatTree, kernel: str) -> np.ndarray:
    """One float64 value per leaf (in leaf order), each from a segmented kernel per group."""
    lay: Layout = flat.layout
    out = np.empty(lay.num_leaves, np.float64)
    for members, offsets, g in zip(lay.groups, lay.offsets, flat.groups):
        out[list(members)] = backend.call(kernel, g, offsets)
    return out


def global_norm(tree: Any, ord: Any = 2, squared: bool = False) -> float:
    """The norm of a whole tree, like ``optax.tree.norm``, accumulated in float64.

    ``ord=2``: ``sqrt(sum g^2)``; ``ord=1``: ``sum |g|``; ``ord=inf``: ``max |g|`` (NaN if any
    element is NaN). With ``squared=True`` the result is squared (``sum g^2`` for ``ord=2``).
    Each leaf is reduced over fixed blocks and the leaves are combined in tree order, so a plain
    tree and its FlatTree give the same bits for any thread count.
    """
    key = math.inf if ord in (math.inf, "inf") else ord
    if ord is None:
        key = 2
    if key not in _SEGMENT_KERNEL:
        raise ValueError(f"ord must be 1, 2 or inf, got {ord!r}")
    flat = tree if isinstance(tree, FlatTree) else as_flat(tree, layout_of(tree, "tree"), "tree")[0]
    # Each group's per-leaf values come back to the host: the norm is a host float (a sync on GPU).
    per_leaf = leaf_reductions(flat, _SEGMENT_KERNEL[key])
    if key == math.inf:
        value = float(np.max(per_leaf)) if per_leaf.size else 0.0
        return value * value if squared else value
    total = 0.0
    for v in per_leaf:  # tree order, sequential: the same bits whatever the layout
        total += float(v)
    if key == 2:
        return total if squared else math.sqrt(total)
    return total * total if squared else total
