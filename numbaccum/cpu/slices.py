"""Slice-wise reductions and scalings on the CPU: the kernels of the norm family (`numbaccum.norms`).

A leaf is cut into *slices*: the elements that share an index along the kept dimensions, taken
over the reduced ones (row norms of a matrix reduce dimension 1: one slice per row). A *slice
table* ``rows`` (int64, one row per leaf of a group, built once per layout by `numbaccum.norms`)
describes the cut of every leaf with the dimensions merged into runs of kept and of reduced
ones, so that one kernel serves ``x.reshape(outer, red, inner)`` and every other pattern:

    [base, first, nslices, slen, active, DK, DR, kext[DK], kstr[DK], rext[DR], rstr[DR]]

``base`` is the leaf's start in the group buffer, ``first`` the number of its first slice in the
table's numbering, ``nslices`` and ``slen`` its slice count and elements per slice, ``active``
whether the leaf is reduced and scaled at all (an inactive leaf is one slice that a scaling
copies unchanged), ``kext``/``kstr`` the extents and strides of its kept runs and ``rext``/
``rstr`` those of its reduced runs (outermost first, padded at the front with extent 1). Slice
``s`` starts at ``base + sum(s_i * kstr[i])`` with ``s_i`` the row-major digits of ``s`` in
``kext``; its element ``e`` sits at ``sum(e_j * rstr[j])`` from there.

The work is cut into fixed *items* that depend only on the table: a run of whole slices of about
``REDUCE_BLOCK`` elements together, or a ``REDUCE_BLOCK`` chunk of one long slice. Each item's
partial results are summed in float64 (8 independent accumulators along contiguous runs), and
the partials of a slice are combined in item order: the same bits for any thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _config
from .kernels import _pick

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

# Columns of a slice table row.
BASE, FIRST, NSLICES, SLEN, ACTIVE, DK, DR, HEAD = 0, 1, 2, 3, 4, 5, 6, 7
_SUM, _MAX, _MIN = 0, 1, 2  # how the partials of one slice combine


@njit(inline="always", error_model="numpy")
def slice_start(rows, r, s):  # pragma: no cover - compiled
    """Offset of slice ``s`` of row ``r``: the row-major digits of ``s`` over the kept runs."""
    dk = rows[r, DK]
    off = rows[r, BASE]
    for i in range(dk - 1, -1, -1):
        e = rows[r, HEAD + i]
        off += (s % e) * rows[r, HEAD + dk + i]
        s //= e
    return off


@njit(inline="always", error_model="numpy")
def _combine(op, acc, v):  # pragma: no cover - compiled
    """acc (+) v for a sum, or the NaN-propagating max or min."""
    if op == _SUM:
        return acc + v
    if acc != acc:
        return acc
    if v != v:
        return v
    if op == _MAX:
        return v if v > acc else acc
    return v if v < acc else acc


@njit(inline="always", error_model="numpy")
def _initial(op):  # pragma: no cover - compiled
    return np.inf if op == _MIN else 0.0


def _walker(run, op):
    """``walk(x, out, rows, r, off, e0, e1, idx, c, f)``: ``run`` over the contiguous or strided
    runs of elements ``[e0, e1)`` of the slice at ``off`` (``idx``: scratch digits), combined."""

    @njit(inline="always", error_model="numpy")
    def walk(x, out, rows, r, off, e0, e1, idx, c, f):  # pragma: no cover - compiled
        dk, dr = rows[r, DK], rows[r, DR]
        ext = HEAD + 2 * dk  # first reduced extent column
        last = dr - 1
        st = rows[r, ext + dr + last]
        if dr == 1:  # one reduced run: the common case, no digits to carry
            return run(x, out, off + e0 * st, e1 - e0, st, c, f)
        rem = e0
        for j in range(last, -1, -1):
            idx[j] = rem % rows[r, ext + j]
            rem //= rows[r, ext + j]
        acc = _initial(op)
        e = e0
        while e < e1:
            a = off
            for j in range(dr):
                a += idx[j] * rows[r, ext + dr + j]
            n = min(rows[r, ext + last] - idx[last], e1 - e)
            acc = _combine(op, acc, run(x, out, a, n, st, c, f))
            e += n
            idx[last] += n
            j = last
            while j > 0 and idx[j] >= rows[r, ext + j]:
                idx[j] = 0
                idx[j - 1] += 1
                j -= 1
        return acc

    return walk


def _lane_run(term):
    """``run(x, out, a, n, st, c, p) = sum(term(x[a + i * st], c, p) for i < n)`` in float64:
    8 accumulators (independent add chains), combined in a fixed order."""

    @njit(inline="always", error_model="numpy")
    def total(v, c, p):  # pragma: no cover - compiled
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        stop = v.size // 8 * 8
        for i in range(0, stop, 8):
            s0 += term(np.float64(v[i]), c, p)
            s1 += term(np.float64(v[i + 1]), c, p)
            s2 += term(np.float64(v[i + 2]), c, p)
            s3 += term(np.float64(v[i + 3]), c, p)
            s4 += term(np.float64(v[i + 4]), c, p)
            s5 += term(np.float64(v[i + 5]), c, p)
            s6 += term(np.float64(v[i + 6]), c, p)
            s7 += term(np.float64(v[i + 7]), c, p)
        t = 0.0
        for i in range(stop, v.size):
            t += term(np.float64(v[i]), c, p)
        return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + t

    @njit(inline="always", error_model="numpy")
    def run(x, out, a, n, st, c, p):  # pragma: no cover - compiled
        if st == 1:  # a contiguous view: the loop vectorises
            return total(x[a : a + n], c, p)
        return total(x[a : a + (n - 1) * st + 1 : st], c, p)

    return run


def _extreme_run(take_max):
    """``run``: the NaN-propagating max (or min) of |x| over a run."""

    @njit(inline="always", error_model="numpy")
    def run(x, out, a, n, st, c, p):  # pragma: no cover - compiled
        m = 0.0 if take_max else np.inf
        for i in range(n):
            v = abs(np.float64(x[a + i * st]))
            if v != v:
                return v
            if (v > m) if take_max else (v < m):
                m = v
        return m

    return run


@njit(inline="always", error_model="numpy")
def _sq(v, c, p):  # pragma: no cover - compiled
    d = v - c
    return d * d


@njit(inline="always", error_model="numpy")
def _abs(v, c, p):  # pragma: no cover - compiled
    return abs(v)


@njit(inline="always", error_model="numpy")
def _pow(v, c, p):  # pragma: no cover - compiled
    return abs(v) ** p


@njit(inline="always", error_model="numpy")
def _signed(v, c, p):  # pragma: no cover - compiled
    return v


@njit(inline="always", error_model="numpy")
def _nonzero(v, c, p):  # pragma: no cover - compiled
    return 1.0 if v != 0 else 0.0


def _reducer(run, op):
    """Parallel and serial drivers: ``part[pstart[b] + j]`` = the reduction of slice ``s0 + j``
    of item ``b`` over the item's elements, centred on ``centers[slice]`` (0 if empty)."""
    walk = _walker(run, op)

    @njit(inline="always", error_model="numpy")
    def item(x, rows, items, pstart, centers, p, part, b, idx):  # pragma: no cover - compiled
        r, s0, s1, e0, e1 = items[b, 0], items[b, 1], items[b, 2], items[b, 3], items[b, 4]
        first = rows[r, FIRST]
        for s in range(s0, s1):
            c = centers[first + s] if centers.size else 0.0
            part[pstart[b] + s - s0] = walk(x, x, rows, r, slice_start(rows, r, s), e0, e1, idx, c, p)

    @njit(parallel=True, error_model="numpy")
    def parallel(x, rows, items, pstart, centers, p, part):  # pragma: no cover - compiled
        width = max(rows[0, DR], 1) if rows.shape[0] else 1
        for b in prange(items.shape[0]):
            item(x, rows, items, pstart, centers, p, part, b, np.empty(width, np.int64))

    @njit(error_model="numpy")
    def serial(x, rows, items, pstart, centers, p, part):  # pragma: no cover - compiled
        idx = np.empty(max(rows[0, DR], 1) if rows.shape[0] else 1, np.int64)
        for b in range(items.shape[0]):
            item(x, rows, items, pstart, centers, p, part, b, idx)

    return (parallel, serial), op


@njit(inline="always", error_model="numpy")
def _apply_run(x, out, a, n, st, c, f):  # pragma: no cover - compiled
    """out = (x - c) * f over a run (float64 arithmetic, one rounding on the store)."""
    if st == 1:
        o, v = out[a : a + n], x[a : a + n]
        for i in range(n):
            o[i] = (np.float64(v[i]) - c) * f
    else:
        for i in range(n):
            k = a + i * st
            out[k] = (np.float64(x[k]) - c) * f
    return 0.0


_apply_walk = _walker(_apply_run, _SUM)


@njit(inline="always", error_model="numpy")
def _apply_item(out, x, rows, items, centers, factors, b, idx):  # pragma: no cover - compiled
    r, s0, s1, e0, e1 = items[b, 0], items[b, 1], items[b, 2], items[b, 3], items[b, 4]
    first = rows[r, FIRST]
    for s in range(s0, s1):
        c = centers[first + s] if centers.size else 0.0
        f = factors[first + s] if factors.size else 1.0
        _apply_walk(x, out, rows, r, slice_start(rows, r, s), e0, e1, idx, c, f)


@njit(parallel=True, error_model="numpy")
def _apply_parallel(out, x, rows, items, centers, factors):  # pragma: no cover - compiled
    width = max(rows[0, DR], 1) if rows.shape[0] else 1
    for b in prange(items.shape[0]):
        _apply_item(out, x, rows, items, centers, factors, b, np.empty(width, np.int64))


@njit(error_model="numpy")
def _apply_serial(out, x, rows, items, centers, factors):  # pragma: no cover - compiled
    idx = np.empty(max(rows[0, DR], 1) if rows.shape[0] else 1, np.int64)
    for b in range(items.shape[0]):
        _apply_item(out, x, rows, items, centers, factors, b, idx)


_APPLY = (_apply_parallel, _apply_serial)


# --- host helpers shared with the CUDA twin (not part of the kernel contract) ---------------


@njit(error_model="numpy")
def build_items(rows, block, active_only):  # pragma: no cover - compiled
    """The work items of a table: ``(items, pstart, nparts)``, ``items[b] = (row, s0, s1, e0,
    e1)`` (slices ``[s0, s1)`` of ``row`` over their elements ``[e0, e1)``), ``pstart[b]`` the
    index of item b's first partial. Rows without elements (and, if ``active_only``, inactive
    rows) get no item."""
    count = 0
    for r in range(rows.shape[0]):
        nsl, slen = rows[r, NSLICES], rows[r, SLEN]
        if nsl == 0 or slen == 0 or (active_only and rows[r, ACTIVE] == 0):
            continue
        if slen >= block:
            count += nsl * ((slen + block - 1) // block)
        else:
            per = block // slen
            count += (nsl + per - 1) // per
    items = np.empty((count, 5), np.int64)
    pstart = np.empty(count, np.int64)
    b = 0
    parts = 0
    for r in range(rows.shape[0]):
        nsl, slen = rows[r, NSLICES], rows[r, SLEN]
        if nsl == 0 or slen == 0 or (active_only and rows[r, ACTIVE] == 0):
            continue
        if slen >= block:
            for s in range(nsl):
                for e0 in range(0, slen, block):
                    items[b, 0], items[b, 1], items[b, 2] = r, s, s + 1
                    items[b, 3], items[b, 4] = e0, min(slen, e0 + block)
                    pstart[b] = parts
                    parts += 1
                    b += 1
        else:
            per = block // slen
            for s0 in range(0, nsl, per):
                s1 = min(nsl, s0 + per)
                items[b, 0], items[b, 1], items[b, 2], items[b, 3], items[b, 4] = r, s0, s1, 0, slen
                pstart[b] = parts
                parts += s1 - s0
                b += 1
    return items, pstart, parts


@njit(error_model="numpy")
def combine_partials(rows, items, pstart, part, op):  # pragma: no cover - compiled
    """One value per slice of the table: each slice's partials combined in item order (slices
    without an item keep the identity: 0, or +inf for a minimum)."""
    n = rows[-1, FIRST] + rows[-1, NSLICES] if rows.shape[0] else 0
    out = np.full(n, _initial(op))
    for b in range(items.shape[0]):
        first = rows[items[b, 0], FIRST]
        for j in range(items[b, 2] - items[b, 1]):
            s = first + items[b, 1] + j
            out[s] = _combine(op, out[s], part[pstart[b] + j])
    return out


_ITEMS: dict[tuple, tuple] = {}


def items_of(rows: np.ndarray, block: int, active_only: bool) -> tuple:
    """`build_items`, cached per table (tables live as long as their layout)."""
    key = (rows.tobytes(), rows.shape, block, active_only)
    hit = _ITEMS.get(key)
    if hit is None:
        if len(_ITEMS) > 256:
            _ITEMS.clear()
        hit = _ITEMS[key] = build_items(rows, np.int64(block), active_only)
    return hit


_NO_CENTERS = np.zeros(0, np.float64)


def _reduce(reducer, x, rows, centers=_NO_CENTERS, p=0.0):
    (pair, op) = reducer
    items, pstart, nparts = items_of(rows, _config.REDUCE_BLOCK, True)
    part = np.empty(nparts, np.float64)
    _pick(pair, x.size)(x, rows, items, pstart, np.asarray(centers, np.float64), np.float64(p), part)
    return combine_partials(rows, items, pstart, part, op)


_SUMSQ = _reducer(_lane_run(_sq), _SUM)
_SUMABS = _reducer(_lane_run(_abs), _SUM)
_SUMPOW = _reducer(_lane_run(_pow), _SUM)
_SUMS = _reducer(_lane_run(_signed), _SUM)
_NNZ = _reducer(_lane_run(_nonzero), _SUM)
_MAXABS = _reducer(_extreme_run(True), _MAX)
_MINABS = _reducer(_extreme_run(False), _MIN)


# --- the contract (same names and signatures in numbaccum.cuda.slices) ----------------------


def slice_sumsq(x, rows, centers):
    """Per slice ``s`` of the table: sum((x - centers[s]) ** 2) in float64 (``centers`` empty:
    no centring). Slices of inactive leaves are 0."""
    return _reduce(_SUMSQ, x, rows, centers)


def slice_sumabs(x, rows):
    """Per slice: sum(|x|) in float64."""
    return _reduce(_SUMABS, x, rows)


def slice_sumpow(x, rows, p):
    """Per slice: sum(|x| ** p) in float64 (|0| ** p is inf for a negative p)."""
    return _reduce(_SUMPOW, x, rows, p=p)


def slice_sum(x, rows):
    """Per slice: sum(x) (signed) in float64."""
    return _reduce(_SUMS, x, rows)


def slice_nnz(x, rows):
    """Per slice: the number of non-zero elements (NaN counts), as float64."""
    return _reduce(_NNZ, x, rows)


def slice_maxabs(x, rows):
    """Per slice: max(|x|) (0 if empty, NaN if any element is NaN)."""
    return _reduce(_MAXABS, x, rows)


def slice_minabs(x, rows):
    """Per slice: min(|x|) (+inf if empty, NaN if any element is NaN)."""
    return _reduce(_MINABS, x, rows)


def slice_apply_(out, x, rows, centers, factors):
    """out = (x - centers[s]) * factors[s] over every slice ``s`` (empty ``centers``: 0; empty
    ``factors``: 1), computed in float64. Inactive leaves are copied (skipped when ``out`` is
    ``x``)."""
    in_place = out.ctypes.data == x.ctypes.data
    items = items_of(rows, _config.REDUCE_BLOCK, in_place)[0]
    c = np.asarray(centers, np.float64)
    f = np.asarray(factors, np.float64)
    _pick(_APPLY, x.size)(out, x, rows, items, c, f)


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

WRITES: dict[str, tuple[int, ...]] = {"slice_apply_": (0,)}
