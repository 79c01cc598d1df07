"""The one dispatch point: the kernel contract (`numbaccum.contract.Ops`) for a buffer's backend.

``ops_for(buffer)`` is how a transformation reaches kernels: the CPU backend for NumPy arrays,
the CUDA backend for device arrays. Each backend is three modules with the same primitives --
``driver`` (compiles the formulas: `map_`), ``reduce`` (the one reduction engine) and
``per_example`` -- that `Ops` holds by name, so a reader can follow a call from a transformation
to the contract, and from there to the formula and the driver. ``numba.cuda`` is imported only
when a CUDA array is seen, with one clear error if it cannot compile kernels here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._bounded import Bounded
from .arrays import is_cuda_array
from .contract import Ops
from .tables import segments, sum_in_order

__all__ = ["leaf_sumsq", "ops_for", "tree_sumsq"]

_OPS: dict[str, Ops] = {}


def ops_for(x: Any) -> Ops:
    """The kernel contract for the backend that holds buffer ``x`` (a NumPy array: the CPU; a
    CUDA array of numba, CuPy or PyTorch: CUDA)."""
    if type(x) is np.ndarray:  # the hot path: one type test
        return _OPS.get("cpu") or _make_ops("cpu")
    if is_cuda_array(x):
        return _OPS.get("cuda") or _make_ops("cuda")
    return _OPS.get("cpu") or _make_ops("cpu")


def _make_ops(name: str) -> Ops:
    if name == "cuda":
        from .cuda.device import cuda_module

        cuda_module()  # one clear error, once, when CUDA cannot run kernels here
        from .cuda import driver, per_example, reduce
    else:
        from .cpu import driver, per_example, reduce  # type: ignore[no-redef]
    ops = _OPS[name] = Ops(driver, reduce, per_example)
    return ops


# --- the one global norm: every API that needs a tree's sum of squares takes it here -----------


def leaf_sumsq(flat: Any) -> np.ndarray:
    """sum(x ** 2) of every leaf of a `numbaccum.flat.FlatTree`, float64 in leaf order (one
    engine call per dtype group, each leaf one slice)."""
    lay = flat.layout
    tables = _LEAF_TABLES.get(lay)
    if tables is None:  # once per layout: a small tree's whole update costs microseconds
        tables = _LEAF_TABLES.put(lay, [segments(offsets) for offsets in lay.offsets])
    out = np.empty(lay.num_leaves, np.float64)
    for members, table, g in zip(lay.group_index, tables, flat.groups):
        out[members] = ops_for(g).slice_sumsq(g, table)
    return out


_LEAF_TABLES = Bounded()  # layout -> one segments table per group (each leaf a slice)


def tree_sumsq(flat: Any) -> float:
    """The squared global L2 norm of a tree: `leaf_sumsq` added in leaf order from 0.0.

    The one definition: `numbaccum.global_norm`, ``norms.tree_norm(t, 2)``, ``clip_norm(...,
    dim='global')``, clip_by_global_norm (`Ops.clip_factors_` on the device) and
    skip_large_updates all take this sum, so they agree bit for bit."""
    return float(sum_in_order(leaf_sumsq(flat)))
