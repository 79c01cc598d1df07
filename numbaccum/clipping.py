"""Norms of whole trees and the optax clipping family built on them."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from . import backend
from .base import EmptyState, Flow, GradientTransformationExtraArgs, flat_transformation
from .flat import FlatTree, Layout, as_flat, layout_of

__all__ = ["ClipByGlobalNormState", "clip_by_global_norm", "global_norm"]

_SEGMENT_KERNEL = {1: "segment_sumabs", 2: "segment_sumsq", math.inf: "segment_maxabs"}


def leaf_reductions(flat: FlatTree, kernel: str) -> np.ndarray:
    """One float64 value per leaf (in leaf order), each from a segmented kernel per group."""
    lay: Layout = flat.layout
    out = np.empty(lay.num_leaves, np.float64)
    for members, offsets, g in zip(lay.groups, lay.offsets, flat.groups):
        out[list(members)] = backend.call(kernel, g, offsets)
    return out


def sum_in_order(values: np.ndarray) -> float:
    """Sequential float64 sum in tree order: the same bits whatever the layout or thread count."""
    total = 0.0
    for v in values:
        total += float(v)
    return total


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
    total = sum_in_order(per_leaf)
    if key == 2:
        return total if squared else math.sqrt(total)
    return total * total if squared else total


ClipByGlobalNormState = EmptyState

_SCRATCH = threading.local()  # per layout: the per-leaf squared norms and the factors (GPU)


def _device_factors(flat: FlatTree, max_norm: float) -> dict[np.dtype, Any]:
    """clip_by_global_norm's ``[div, mul]`` on the device, one array per compute dtype the next
    kernels may use: per-segment squares into one float64 array (group by group), then a
    one-thread kernel sums them in order and picks the branch. Nothing comes to the host."""
    from .cuda.device import empty

    lay = flat.layout
    cache = _SCRATCH.__dict__.setdefault("by_layout", {})
    scratch = cache.get(lay)
    if scratch is None:
        dtypes: set[Any] = {np.dtype(np.float32), np.dtype(np.float64), *flat.group_dtypes}
        scratch = cache[lay] = (
            empty(max(lay.num_leaves, 1), np.dtype(np.float64)),
            {d: empty(2, d) for d in dtypes},
        )
    parts, facs = scratch
    pos = 0
    for g, offsets in zip(flat.groups, lay.offsets):
        backend.call("segment_sumsq_into_", parts[pos : pos + offsets.size - 1], g, offsets)
        pos += offsets.size - 1
    for fac in facs.values():
        backend.call("clip_factors_", fac, parts[:pos], max_norm)
    return facs


def clip_by_global_norm(max_norm: float) -> GradientTransformationExtraArgs:
    """Clips the whole tree to a global L2 norm of at most ``max_norm`` (optax's formula):

    ``u = g`` if ``norm < max_norm`` (strict), else ``u = (g / norm) * max_norm``, with
    ``norm = sqrt(sum g^2)`` over every leaf.

    The norm accumulates in float64 (float32 squares cannot overflow: ``[1e20, 1e20]`` clips to
    ``[0.7071, 0.7071]`` where optax gives zeros), and ``norm == max_norm == 0`` gives zeros where
    optax gives NaN (0 / 0). A NaN norm clips every element to NaN, as in optax. The factor is not
    a pass of its own: it rides on the next kernel that reads the updates. On the GPU the norm
    comes back to the host (one synchronisation per call).

    Raises:
        ValueError: ``max_norm`` is negative.
    """
    max_norm = float(max_norm)
    if not max_norm >= 0:  # NaN too
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")

    def flat_update(flow: Flow, state: Any, params: Any, extra: dict) -> tuple[Flow, Any]:
        flow = flow.settled()
        if flow.flat.device:  # the norm and the factor stay on the GPU: no synchronisation
            return Flow(
                flow.flat, flow.owned, _device_factors(flow.flat, max_norm), None, flow.returnable
            ), state
        norm = math.sqrt(sum_in_order(leaf_reductions(flow.flat, "segment_sumsq")))
        if norm < max_norm:
            return flow, state
        if norm == 0.0:  # and so max_norm == 0: zeros, not 0 / 0
            return flow.with_factor(1.0, 0.0), state
        return flow.with_factor(norm, max_norm), state

    return flat_transformation(lambda params: EmptyState(), flat_update)
