"""Slice-wise reductions and scalings on CUDA: the twin of `numbaccum.cpu.slices`.

Same slice tables and work items (cut at ``CUDA_REDUCE_BLOCK`` elements). One CUDA block takes
one item: its threads stride over the item's elements of each slice (the element's offset comes
from its digits over the reduced runs) and add them in float64, then a shared-memory tree in a
fixed order gives the item's partial for that slice. The partials come to the host, where the
CPU's `combine_partials` adds each slice's in item order: the same bits on every run. A scaling
is one launch per call, one block per item.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

from .. import _config
from ..arrays import data_pointer, stream
from ..cpu.slices import DK, DR, FIRST, HEAD, combine_partials, items_of, slice_start
from .kernels import LAUNCHES

__all__ = [
    "slice_apply_",
    "slice_maxabs",
    "slice_minabs",
    "slice_nnz",
    "slice_sum",
    "slice_sumabs",
    "slice_sumpow",
    "slice_sumsq",
]

_SQ, _ABS, _POW, _SUM, _NNZ, _MAX, _MIN = range(7)
_OP = {_MAX: 1, _MIN: 2}  # combine_partials' max and min; every other kind adds

_slice_start = cuda.jit(device=True)(slice_start.py_func)


@cuda.jit(device=True)
def _element(rows, r, e):  # pragma: no cover - compiled
    """Offset of element ``e`` of a slice of row ``r`` from the slice's start."""
    dr = rows[r, DR]
    ext = HEAD + 2 * rows[r, DK]
    if dr == 1:
        return e * rows[r, ext + 1]
    a = 0
    for j in range(dr - 1, -1, -1):
        n = rows[r, ext + j]
        a += (e % n) * rows[r, ext + dr + j]
        e //= n
    return a


@cuda.jit(device=True, inline=True)
def _merge(kind, acc, v):  # pragma: no cover - compiled
    """Adds, or keeps the NaN-propagating max (min) for the extreme kinds."""
    if kind != _MAX and kind != _MIN:
        return acc + v
    if acc != acc:
        return acc
    if v != v:
        return v
    if kind == _MAX:
        return v if v > acc else acc
    return v if v < acc else acc


@cuda.jit(device=True, inline=True)
def _term(kind, v, c, p):  # pragma: no cover - compiled
    if kind == _SQ:
        d = v - c
        return d * d
    if kind == _POW:
        return abs(v) ** p
    if kind == _SUM:
        return v
    if kind == _NNZ:
        return 1.0 if v != 0 else 0.0
    return abs(v)


_REDUCERS: dict[tuple[int, int], Any] = {}


def _reducer(kind: int, tpb: int) -> Any:
    """The partials kernel of one reduction kind for ``tpb`` threads (shared memory needs the
    size at compile time)."""
    key = (kind, tpb)
    if key in _REDUCERS:
        return _REDUCERS[key]

    @cuda.jit
    def partials(x, rows, items, pstart, centers, centred, p, part):  # pragma: no cover - compiled
        shared = cuda.shared.array(tpb, np.float64)
        b = cuda.blockIdx.x
        t = cuda.threadIdx.x
        r = items[b, 0]
        s0 = items[b, 1]
        first = rows[r, FIRST]
        for s in range(s0, items[b, 2]):
            off = _slice_start(rows, r, s)
            c = centers[first + s] if centred else 0.0
            acc = math.inf if kind == _MIN else 0.0
            e = items[b, 3] + t
            while e < items[b, 4]:
                acc = _merge(kind, acc, _term(kind, np.float64(x[off + _element(rows, r, e)]), c, p))
                e += tpb
            shared[t] = acc
            cuda.syncthreads()
            half = tpb // 2
            while half > 0:  # fixed pairing: the same tree every run
                if t < half:
                    shared[t] = _merge(kind, shared[t], shared[t + half])
                cuda.syncthreads()
                half //= 2
            if t == 0:
                part[pstart[b] + s - s0] = shared[0]
            cuda.syncthreads()  # shared[0] is read before the next slice overwrites it

    _REDUCERS[key] = partials
    return partials


@cuda.jit
def _apply(out, x, rows, items, centers, centred, factors, scaled):  # pragma: no cover - compiled
    b = cuda.blockIdx.x
    r = items[b, 0]
    first = rows[r, FIRST]
    for s in range(items[b, 1], items[b, 2]):
        off = _slice_start(rows, r, s)
        c = centers[first + s] if centred else 0.0
        f = factors[first + s] if scaled else 1.0
        e = items[b, 3] + cuda.threadIdx.x
        while e < items[b, 4]:
            k = off + _element(rows, r, e)
            out[k] = (np.float64(x[k]) - c) * f
            e += cuda.blockDim.x


_TABLES: dict[tuple, tuple] = {}
_DUMMY: list[Any] = []


def _tables(rows: np.ndarray, active_only: bool) -> tuple:
    """Device copies of a table and its items: ``(rows, items, pstart, host items, host pstart,
    nparts)``, cached per table."""
    key = (rows.tobytes(), rows.shape, _config.CUDA_REDUCE_BLOCK, active_only)
    hit = _TABLES.get(key)
    if hit is None:
        items, pstart, nparts = items_of(rows, _config.CUDA_REDUCE_BLOCK, active_only)
        dev = cuda.to_device
        hit = (dev(rows), dev(items), dev(pstart), items, pstart, int(nparts))
        if len(_TABLES) > 256:
            _TABLES.clear()
        _TABLES[key] = hit
    return hit


def _per_slice(values: Any) -> tuple[Any, bool]:
    """A per-slice float64 array on the device and whether it is given (empty: not)."""
    if values is not None and values.size:
        if isinstance(values, np.ndarray):
            values = cuda.to_device(np.ascontiguousarray(values, np.float64), stream=stream())
        return values, True
    if not _DUMMY:
        _DUMMY.append(cuda.to_device(np.zeros(1, np.float64)))
    return _DUMMY[0], False


def _reduce(kind: int, x: Any, rows: np.ndarray, centers: Any = None, p: float = 0.0) -> np.ndarray:
    rows_d, items_d, pstart_d, items, pstart, nparts = _tables(rows, True)
    part = np.zeros(nparts, np.float64)
    if items.shape[0]:
        c, centred = _per_slice(centers)
        part_d = cuda.device_array(nparts, np.float64, stream=stream())
        tpb = _config.CUDA_THREADS
        LAUNCHES[0] += 1
        _reducer(kind, tpb)[items.shape[0], tpb, stream()](
            x, rows_d, items_d, pstart_d, c, centred, np.float64(p), part_d
        )
        part = part_d.copy_to_host(stream=stream())
    return combine_partials(rows, items, pstart, part, _OP.get(kind, 0))


# --- the contract (same names and signatures as numbaccum.cpu.slices) -----------------------


def slice_sumsq(x, rows, centers):
    """Per slice ``s`` of the table: sum((x - centers[s]) ** 2) in float64 (``centers`` empty:
    no centring). Slices of inactive leaves are 0."""
    return _reduce(_SQ, x, rows, centers)


def slice_sumabs(x, rows):
    """Per slice: sum(|x|) in float64."""
    return _reduce(_ABS, x, rows)


def slice_sumpow(x, rows, p):
    """Per slice: sum(|x| ** p) in float64 (|0| ** p is inf for a negative p)."""
    return _reduce(_POW, x, rows, p=p)


def slice_sum(x, rows):
    """Per slice: sum(x) (signed) in float64."""
    return _reduce(_SUM, x, rows)


def slice_nnz(x, rows):
    """Per slice: the number of non-zero elements (NaN counts), as float64."""
    return _reduce(_NNZ, x, rows)


def slice_maxabs(x, rows):
    """Per slice: max(|x|) (0 if empty, NaN if any element is NaN)."""
    return _reduce(_MAX, x, rows)


def slice_minabs(x, rows):
    """Per slice: min(|x|) (+inf if empty, NaN if any element is NaN)."""
    return _reduce(_MIN, x, rows)


def slice_apply_(out, x, rows, centers, factors):
    """out = (x - centers[s]) * factors[s] over every slice ``s`` (empty ``centers``: 0; empty
    ``factors``: 1), computed in float64. Inactive leaves are copied (skipped when ``out`` is
    ``x``)."""
    ptr = data_pointer(out)
    in_place = out is x or (ptr is not None and ptr == data_pointer(x))
    rows_d, items_d, _, items, _, _ = _tables(rows, in_place)
    if items.shape[0]:
        c, centred = _per_slice(centers)
        f, scaled = _per_slice(factors)
        LAUNCHES[0] += 1
        _apply[items.shape[0], _config.CUDA_THREADS, stream()](out, x, rows_d, items_d, c, centred, f, scaled)


KERNELS = (
    "slice_sumsq",
    "slice_sumabs",
    "slice_sumpow",
    "slice_sum",
    "slice_nnz",
    "slice_maxabs",
    "slice_minabs",
    "slice_apply_",
)
