"""Slice tables and work items: the one description of every reduction, shared by both backends.

Every reduction of numbaccum (whole tree, per leaf, per slice of a leaf, per example) is a
reduction over the *slices* of a *table*: a leaf is one slice, a row of a matrix is one slice,
an example's part of a per-example leaf is one slice (the batch dimension kept). The engines
(`numbaccum.cpu.reduce`, `numbaccum.cuda.reduce`) run any table; this module builds the tables
and cuts their work, on the host, and neither backend imports the other.

A table ``rows`` is int64, one row per leaf of a dtype group; the leaf's dimensions are merged
into runs of kept and of reduced ones, so that one kernel serves ``x.reshape(outer, red, inner)``
and every other pattern:

    [base, first, nslices, slen, active, DK, DR, kext[DK], kstr[DK], rext[DR], rstr[DR]]

``base`` is the leaf's start in the group buffer, ``first`` the number of its first slice in the
table's numbering, ``nslices`` and ``slen`` its slice count and elements per slice, ``active``
whether the leaf is reduced and scaled at all (an inactive leaf is one slice that a scaling
copies unchanged), ``kext``/``kstr`` the extents and strides of its kept runs and ``rext``/
``rstr`` those of its reduced runs (outermost first, padded at the front with extent 1). Slice
``s`` starts at ``base + sum(s_i * kstr[i])`` with ``s_i`` the row-major digits of ``s`` in
``kext`` (`slice_start`); its element ``e`` sits at ``sum(e_j * rstr[j])`` from there
(`element_offset`). Both are plain Python here, compiled by each backend.

The work is cut into fixed *items* that depend only on the table and the block size: a run of
whole slices of about ``block`` elements together, or a ``block`` chunk of one long slice. Each
item gives one float64 partial per slice it covers; partials are numbered in slice order, so the
partials of slice ``s`` are ``part[pslice[s]:pslice[s + 1]]``, and `combine` folds them in that
order starting from the identity. No thread count enters: the same table gives the same bits.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import numba
import numpy as np
from numba import njit
from numba import types as nbtypes
from numba.extending import overload

from . import _cache
from ._bounded import Bounded

__all__ = [
    "ACTIVE",
    "AxisMaxima",
    "AxisSums",
    "AxesPass",
    "AxisTable",
    "BASE",
    "DK",
    "DR",
    "FACTORED",
    "FIRST",
    "HEAD",
    "LeafTable",
    "MAX",
    "METRIC_TINY",
    "MIN",
    "NSLICES",
    "SUMSQ_TINY",
    "SLEN",
    "SUM",
    "FactorTable",
    "RowColumnPass",
    "Table",
    "UNFACTORED",
    "Work",
    "as_table",
    "combine",
    "compiled",
    "element_offset",
    "examples",
    "nan_max",
    "needs_scaling",
    "norm_pair",
    "norm_scale",
    "pnorm_factor",
    "pnorm_kind",
    "rescued_norm",
    "segments",
    "slice_start",
    "slice_table",
    "sum_in_order",
    "whole",
    "wide",
    "without_axis",
]

# --- the scaled L2 norm: when the plain float64 sum of squares cannot be trusted --------------
#
# A float32 (or float16) element squares to between 2e-90 and 1.2e77 in float64: the plain sum of
# squares neither overflows nor loses an element to underflow, and it is always the answer. A
# float64 element above ~1.3e154 squares to inf, one below ~1.5e-154 to a subnormal or 0. So
# the plain sum (the fast path, one pass) is kept unless it is inf (overflow; NaN stays NaN) or
# below `SUMSQ_TINY` (where an underflowed square may have been a large part of it, or all of it:
# [1e-170] * 4 sums to 0). Those slices are summed again as sum((x * f) ** 2), ``f`` the power of
# two that brings their max |x| into [0.5, 1) (`norm_scale`): no overflow, and every square that
# is lost is below 2**-1074 next to a max square of at least 0.25. The norm is sqrt(s) / f.
SUMSQ_TINY = 2.0**-800  # ~1.5e-241: lost squares are < 2**-1074 each, 1e-82 of it per 1e12 elements


def needs_scaling(s):  # pragma: no cover - compiled by the backends too
    """Whether a plain float64 sum of squares of float64 elements may be wrong: inf, or small
    enough that underflow may have lost part of it (NaN: no, it stays NaN)."""
    return s == math.inf or s < SUMSQ_TINY


def norm_scale(m):  # pragma: no cover - compiled by the backends too
    """The power of two ``f`` that puts ``m * f`` (a finite max |x| > 0) in [0.5, 1); kept
    within [2**-1000, 2**1000] so that ``f`` itself is finite (a subnormal max then lands in
    [2**-76, 1): still far from underflow)."""
    e = math.frexp(m)[1]
    return math.ldexp(1.0, min(max(-e, -1000), 1000))


def rescued_norm(sums):  # pragma: no cover - compiled by the backends too
    """The global L2 norm from ``sums = [plain | rescued | scale]`` (3 blocks of one value per
    leaf, leaf order): ``sqrt(sum plain)`` unless that total `needs_scaling`, else
    ``sqrt(sum_k rescued_k * (F / scale_k) ** 2) / F`` over the non-zero leaves, with ``F`` the
    least of their scales (the bits of `numbaccum.backend.tree_sumsq_scaled`)."""
    n = sums.size // 3
    total = 0.0
    for k in range(n):
        total += sums[k]
    if not (total == math.inf or total < SUMSQ_TINY):  # `needs_scaling`, inlined for the compilers
        return math.sqrt(total)
    big = math.inf  # the scale of the largest elements: the least over the non-zero leaves
    for k in range(n):
        if sums[n + k] != 0:
            big = min(big, sums[2 * n + k])
    if big == math.inf:
        big = 1.0
    ts = 0.0
    for k in range(n):
        if sums[n + k] != 0:  # a zero leaf may have a scale far from big: 0 * inf is NaN
            r = big / sums[2 * n + k]
            ts += sums[n + k] * r * r
    return math.sqrt(ts) / big


# Columns of a table row.
BASE, FIRST, NSLICES, SLEN, ACTIVE, DK, DR, HEAD = 0, 1, 2, 3, 4, 5, 6, 7
# How the partials of one slice combine: added, or the NaN-propagating max or min.
SUM, MAX, MIN = 0, 1, 2


# --- index math: plain Python, compiled by each backend ------------------------------------


def slice_start(rows, r, s):  # pragma: no cover - compiled by the backends
    """Offset of slice ``s`` of row ``r``: ``base + sum(s_i * kstr[i])`` over the row-major
    digits ``s_i`` of ``s`` in the kept extents."""
    dk = rows[r, DK]
    off = rows[r, BASE]
    for i in range(dk - 1, -1, -1):
        e = rows[r, HEAD + i]
        off += (s % e) * rows[r, HEAD + dk + i]
        s //= e
    return off


def element_offset(rows, r, e):  # pragma: no cover - compiled by the backends
    """Offset of element ``e`` of a slice of row ``r`` from the slice's start:
    ``sum(e_j * rstr[j])`` over the row-major digits ``e_j`` of ``e`` in the reduced extents."""
    dr = rows[r, DR]
    ext = HEAD + 2 * rows[r, DK]
    if dr == 1:
        return e * rows[r, ext + 1]
    a = e - e  # an int64 zero of e's type
    for j in range(dr - 1, -1, -1):
        n = rows[r, ext + j]
        a += (e % n) * rows[r, ext + dr + j]
        e //= n
    return a


# --- the norm family's per-slice factor: plain Python, compiled by each backend --------------
#
# clip_norm / normalize (and their in-place twins) scale each slice by a factor of its p-norm.
# The backends fold each slice's partials into its power sum, then call `pnorm_factor` once per
# slice (a loop on the host, a thread per slice on CUDA): the factor is computed where the data
# lives and never crosses to the host.


# A slice whose metric is at or below this (or not finite) is left as it is (torchzero's 1e-12).
METRIC_TINY = 1e-12


def norm_pair(n, max_norm, min_norm, norm_value):  # pragma: no cover - compiled by the backends too
    """The norm family's ``(div, mul)`` for a slice of metric ``n`` (the slice becomes ``(x /
    div) * mul``): torchzero's clip ``clamp(min_norm / n, min=1) * clamp(max_norm / n, max=1)``
    (``max_norm`` inf and ``min_norm`` 0 when unset), or, for a ``norm_value`` that is not NaN,
    normalize's ``norm_value / n``. ``(1, 1)`` for a metric that is not finite or is at most
    1e-12: such a slice is left as it is."""
    if not (n - n == 0 and n > METRIC_TINY):
        return 1.0, 1.0
    if norm_value == norm_value:
        return n, norm_value
    div = 1.0
    mul = 1.0
    if n > max_norm:
        div = n
        mul = max_norm
    if n < min_norm:
        div = div * n
        mul = mul * min_norm
    return div, mul


def pnorm_factor(total, x, rows, r, s, p, may_rescue, max_norm, min_norm, norm_value):  # pragma: no cover
    """The factor ``mul / div`` (`norm_pair`) of slice ``s`` of row ``r`` from its plain power
    sum ``total = sum(|x| ** p)`` (p > 0; for p = inf, the max |x|); 1 for an inactive row.

    With ``may_rescue`` (a float64 buffer for p = 2, any buffer for other finite p), a total
    that is inf (or, for p = 2, below `SUMSQ_TINY`) is summed again here over the slice's
    elements, scaled by the power of two `norm_scale` of its max |x|: the metric is then
    ``S ** (1 / p) / f``, finite whenever it is representable (the rare rescue, serial, by the
    one thread that owns the slice)."""
    if rows[r, ACTIVE] == 0 or rows[r, SLEN] == 0:
        return 1.0
    f = 1.0
    if may_rescue and (total == math.inf or (p == 2.0 and total < SUMSQ_TINY)):
        off = slice_start(rows, r, s)
        m = 0.0
        for e in range(rows[r, SLEN]):
            v = abs(np.float64(x[off + element_offset(rows, r, e)]))
            if v != v or v > m:
                m = v
                if v != v:
                    break
        if m - m == 0 and m > 0:
            f = norm_scale(m)
            acc = 0.0
            for e in range(rows[r, SLEN]):
                w = abs(np.float64(x[off + element_offset(rows, r, e)]) * f)
                acc += w * w if p == 2.0 else w**p
            total = acc
    if p == 2.0:
        n = math.sqrt(total) / f
    elif p == 1.0:
        n = total / f
    elif p == math.inf:
        n = total
    else:
        n = total ** (1.0 / p) / f
    div, mul = norm_pair(n, max_norm, min_norm, norm_value)
    return mul / div


def pnorm_kind(p: float) -> str:
    """The engines' reduction (a key of their ``KINDS``) whose per-slice value `pnorm_factor`
    takes for a p-norm (p > 0): the sum of squares, of |x|, of |x| ** p, or the max |x|."""
    return {2.0: "sumsq", 1.0: "sumabs", math.inf: "maxabs"}.get(p, "sumpow")


def compiled(fn: Any, jit: Any) -> Any:
    """``fn`` (a plain function of this module) compiled by ``jit``, with the plain helpers it
    calls (`slice_start`, `element_offset`, `norm_scale`, `norm_pair`) compiled by the same
    ``jit``: one source, both backends."""
    glb = dict(globals())
    for name in ("slice_start", "element_offset", "norm_scale", "norm_pair"):
        glb[name] = jit(globals()[name])
    return jit(types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__))


# --- host helpers (compiled once for the host) ----------------------------------------------


@njit(inline="always", error_model="numpy")
def fold(op, acc, v):  # pragma: no cover - compiled
    """acc (+) v: a sum, or the NaN-propagating max or min (NaN, once in, stays)."""
    if op == SUM:
        return acc + v
    if acc != acc:
        return acc
    if v != v:
        return v
    if op == MAX:
        return v if v > acc else acc
    return v if v < acc else acc


@njit(inline="always", error_model="numpy")
def identity(op):  # pragma: no cover - compiled
    """The start of a fold: 0, or +inf for a minimum."""
    return np.inf if op == MIN else 0.0


@_cache.cached
@njit(error_model="numpy")
def combine(part, pslice, op):  # pragma: no cover - compiled
    """One value per slice: ``part[pslice[s]:pslice[s + 1]]`` folded in order from the identity
    (a slice without partials keeps the identity: 0, or +inf for a minimum)."""
    n = pslice.size - 1
    out = np.empty(n, np.float64)
    for s in range(n):
        acc = identity(op)
        for k in range(pslice[s], pslice[s + 1]):
            acc = fold(op, acc, part[k])
        out[s] = acc
    return out


@_cache.cached
@njit(error_model="numpy")
def sum_in_order(values):  # pragma: no cover - compiled
    """Sequential float64 sum from 0.0, in index order: how per-leaf values become a tree total."""
    total = 0.0
    for i in range(values.size):
        total += values[i]
    return total


# Tables up to this many rows and slices are laid out in plain Python (`Table.work`).
_PY_ROWS, _PY_SLICES = 4096, 16384


@_cache.cached
@njit(error_model="numpy")
def _build_work(rows, nslices, block, active_only):  # pragma: no cover - compiled
    """``(items, pstart, pslice)``: ``items[b] = (row, s0, s1, e0, e1)`` (slices ``[s0, s1)`` of
    ``row`` over their elements ``[e0, e1)``), ``pstart[b]`` the index of item b's first
    partial, ``pslice[s]`` the first partial of slice ``s`` (table numbering). Rows without
    elements (and, if ``active_only``, inactive rows) get no item."""
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
    pslice = np.zeros(nslices + 1, np.int64)
    b = 0
    parts = 0
    for r in range(rows.shape[0]):
        nsl, slen, first = rows[r, NSLICES], rows[r, SLEN], rows[r, FIRST]
        if nsl == 0 or slen == 0 or (active_only and rows[r, ACTIVE] == 0):
            for s in range(nsl):
                pslice[first + s + 1] = parts
            continue
        if slen >= block:
            for s in range(nsl):
                for e0 in range(0, slen, block):
                    items[b, 0], items[b, 1], items[b, 2] = r, s, s + 1
                    items[b, 3], items[b, 4] = e0, min(slen, e0 + block)
                    pstart[b] = parts
                    parts += 1
                    b += 1
                pslice[first + s + 1] = parts
        else:
            per = block // slen
            for s0 in range(0, nsl, per):
                s1 = min(nsl, s0 + per)
                items[b, 0], items[b, 1], items[b, 2], items[b, 3], items[b, 4] = r, s0, s1, 0, slen
                pstart[b] = parts
                for s in range(s0, s1):
                    parts += 1
                    pslice[first + s + 1] = parts
                b += 1
    return items, pstart, pslice


# --- tables ---------------------------------------------------------------------------------


class Work:
    """The cut of a table for one block size: ``items``, ``pstart``, ``pslice`` (see
    `_build_work`) and ``nparts``; ``device`` is a backend's cache of its own copies."""

    __slots__ = ("items", "pstart", "pslice", "nparts", "device")

    def __init__(self, items: np.ndarray, pstart: np.ndarray, pslice: np.ndarray) -> None:
        self.items, self.pstart, self.pslice = items, pstart, pslice
        self.nparts = int(pslice[-1])
        self.device: dict = {}


class Table:
    """A slice table (``rows``, read-only int64) and its number of slices, with its work cut
    once per ``(block, active_only)``; ``device`` is a backend's cache of its own copies."""

    __slots__ = ("rows", "nslices", "_work", "device")

    def __init__(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, np.int64)
        if rows.ndim != 2 or (rows.shape[0] and rows.shape[1] < HEAD + 2):
            raise ValueError(f"a slice table has rows of at least {HEAD + 2} columns; got shape {rows.shape}")
        rows.flags.writeable = False
        self.rows = rows
        self.nslices = int(rows[-1, FIRST] + rows[-1, NSLICES]) if rows.shape[0] else 0
        self._work: dict[tuple[int, bool], Work] = {}
        self.device: dict = {}

    def work(self, block: int, active_only: bool = True) -> Work:
        """The items of this table for ``block`` elements per item (cached)."""
        key = (int(block), bool(active_only))
        w = self._work.get(key)
        if w is None:
            # A small table is laid out by the plain-Python function (milliseconds, once per
            # table): compiling it costs about a second of a cold start.
            small = self.rows.shape[0] <= _PY_ROWS and self.nslices <= _PY_SLICES
            build = _build_work.py_func if small else _build_work
            w = self._work[key] = Work(*build(self.rows, self.nslices, np.int64(block), active_only))
        return w

    def only(self, rows: np.ndarray) -> Table:
        """This table with only the rows where ``rows`` is True active (the others get no work
        and keep the identity): a second pass over a few leaves reads only them."""
        out = self.rows.copy()
        out[:, ACTIVE] = np.where(rows, out[:, ACTIVE], 0)
        return Table(out)

    def __repr__(self) -> str:
        return f"Table({self.rows.shape[0]} rows, {self.nslices} slices)"


def slice_table(cuts: list) -> Table:
    """The table of one group from ``[(base, kept, reduced, active)]``, ``kept`` and ``reduced``
    lists of ``(extent, stride)`` runs, outermost first (an empty leaf has its slices all the
    same: their reductions see no element)."""
    dk = max([len(k) for _, k, _, _ in cuts] + [1])
    dr = max([len(r) for _, _, r, _ in cuts] + [1])
    rows = np.zeros((len(cuts), HEAD + 2 * dk + 2 * dr), np.int64)
    first = 0
    for i, (base, kept, red, active) in enumerate(cuts):
        kept = [(1, 1)] * (dk - len(kept)) + list(kept)  # padding: extent 1 (its stride is never used)
        red = [(1, 1)] * (dr - len(red)) + list(red)
        nslices = int(np.prod([e for e, _ in kept], dtype=np.int64))
        slen = int(np.prod([e for e, _ in red], dtype=np.int64))
        rows[i, :HEAD] = (base, first, nslices, slen, int(active), dk, dr)
        rows[i, HEAD : HEAD + dk] = [e for e, _ in kept]
        rows[i, HEAD + dk : HEAD + 2 * dk] = [s for _, s in kept]
        rows[i, HEAD + 2 * dk : HEAD + 2 * dk + dr] = [e for e, _ in red]
        rows[i, HEAD + 2 * dk + dr :] = [s for _, s in red]
        first += nslices
    return Table(rows)


_CACHE = Bounded()


def _cached(key: tuple, make: Any) -> Table:
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE.put(key, make())
    return hit


def segments(offsets: Any) -> Table:
    """Each ``[offsets[k], offsets[k + 1])`` one contiguous slice (a group's leaves: one slice
    per leaf). Cached per offsets (layouts keep theirs for life)."""
    offsets = np.asarray(offsets, np.int64)
    key = ("segments", offsets.tobytes())
    return _cached(key, lambda: _segments_table(offsets))


def _segments_table(offsets: np.ndarray) -> Table:
    """`slice_table` of ``[(a, [], [(b - a, 1)], True)]`` for each segment, built in whole-array
    operations: a per-example layout has a segment per (leaf, example), and Poisson-sampled
    DP-SGD builds a new one for almost every batch size (a Python loop took ~0.1 s at 1,000)."""
    n = max(len(offsets) - 1, 0)
    rows = np.zeros((n, HEAD + 4), np.int64)  # dk = dr = 1
    rows[:, 0] = offsets[:-1]  # base
    rows[:, 1] = np.arange(n)  # first slice: one slice per segment
    rows[:, 2] = 1  # nslices
    rows[:, 3] = np.diff(offsets)  # slen
    rows[:, 4] = 1  # active
    rows[:, 5] = rows[:, 6] = 1  # dk, dr
    rows[:, HEAD : HEAD + 2] = 1  # kept: padding, extent 1, stride 1
    rows[:, HEAD + 2] = rows[:, 3]  # reduced: extent slen ...
    rows[:, HEAD + 3] = 1  # ... stride 1
    return Table(rows)


def examples(offsets: Any, batch: int) -> Table:
    """Per-example leaves ``(batch, *s)`` at ``offsets``: ``batch`` slices of ``prod(s)``
    contiguous elements each (dimension 0 kept), numbered leaf by leaf, example by example."""
    offsets = np.asarray(offsets, np.int64)
    batch = int(batch)

    def make() -> Table:
        cuts = []
        for a, b in zip(offsets[:-1], offsets[1:]):
            d = int(b - a) // batch if batch else 0
            cuts.append((int(a), [(batch, d)], [(d, 1)], True))
        return slice_table(cuts)

    return _cached(("examples", offsets.tobytes(), batch), make)


def whole(n: int) -> Table:
    """One slice over all ``n`` elements of a buffer."""
    return segments(np.array([0, int(n)], np.int64))


def as_table(table: Any) -> Table:
    """``table`` as a `Table`: a Table itself, or a raw table array (cached by content)."""
    if isinstance(table, Table):
        return table
    rows = np.asarray(table, np.int64)
    return _cached(("rows", rows.shape, rows.tobytes()), lambda: Table(rows))


# --- axis passes: statistics along the axes of leaves (Adafactor, SM3) ----------------------------

# The columns of a `FactorTable` row, one row per leaf of a dtype group:
# [base, size, kind, s0, n0, s1, n1, rbase, cbase, vbase]
F_BASE, F_SIZE, F_KIND, F_S0, F_N0, F_S1, F_N1, F_RBASE, F_CBASE, F_VBASE = range(10)
FACTORED, UNFACTORED = 1, 2


def without_axis(e, stride, extent):  # pragma: no cover - compiled by the backends
    """The index of element ``e`` (row-major) of an array once the axis of ``stride`` and
    ``extent`` is removed: ``(e // (stride * extent)) * stride + e % stride``."""
    return (e // (stride * extent)) * stride + e % stride


class RowColumnPass(NamedTuple):
    """The formulas of a pass over a `FactorTable` (`numbaccum.contract.Ops.row_column_pass_`):
    plain functions of scalars, compiled by both backends (`numbaccum.formulas.compile_formula`,
    so they may call its helpers), as an elementwise formula is.

    Attributes:
        scaled: ``scaled(x, r, c) -> out``: an element ``x`` of a ``FACTORED`` leaf and its
            row's and its column's statistics (host float64 values).
        full: ``full(v, x, scalars) -> (v, out)``: an element of any other leaf with its own
            state ``v``, ``scalars`` the pass's tuple in the compute dtype (one argument: CUDA
            inlines no call with ``*args``).
    """

    scaled: Callable
    full: Callable


class AxesPass(NamedTuple):
    """The formulas of a pass over an `AxisTable` (`numbaccum.contract.Ops.axes_pass_`), plain
    functions compiled by both backends.

    Attributes:
        fold: ``fold(m, s) -> m``: how an element's statistics along its axes combine, taken in
            axis order from the first axis's.
        element: ``element(x, m, nu, scalars) -> (a, nu, out)``: an element ``x``, the fold
            ``m`` and its state ``nu``; ``a`` goes to the pass's accumulators (and is the new
            statistic of a ``direct`` axis), ``scalars`` a tuple in the compute dtype.
    """

    fold: Callable
    element: Callable


class LeafTable:
    """Per-leaf work of one dtype group: ``meta``, one int64 row per leaf with its start in the
    group buffer and its size in the first two columns; the work is cut into items ``[row, e0,
    e1]`` of at most ``block`` elements of one leaf, once per block size; ``device`` is a
    backend's cache of its own copies."""

    __slots__ = ("meta", "_items", "device")

    def __init__(self, meta: np.ndarray, width: int) -> None:
        meta = np.ascontiguousarray(meta, np.int64).reshape(-1, width)
        meta.flags.writeable = False
        self.meta = meta
        self._items: dict[int, np.ndarray] = {}
        self.device: dict = {}

    def items(self, block: int) -> np.ndarray:
        """``[row, e0, e1]`` per item, int64 (cached per ``block``)."""
        out = self._items.get(block)
        if out is None:
            cuts = [
                (r, e, min(e + block, int(size)))
                for r, size in enumerate(self.meta[:, F_SIZE])
                for e in range(0, int(size), block)
            ]
            out = np.array(cuts, np.int64).reshape(-1, 3)
            out.flags.writeable = False
            self._items[block] = out
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.meta.shape[0]} leaves)"


def _band_width(K: int, B: int, share: int) -> int:
    """The columns of one band of `AxisSums` (bands of equal widths): whole rows where they fit
    (a plane read front to back, which the prefetcher streams; bands of 128 columns, a jump of a
    row's length every 512 bytes, run 1.5x slower on a tall matrix), at most 2048 columns (their
    float64 sums within the L1 cache), and narrower bands when a plane holds more than ``share``
    elements (a thread's share of the work: every thread gets some). The partition does not change
    the bits: each column is summed in ``k`` order by one thread."""
    bands = max(-(-B // 2048), -(-(K * B) // share))
    return max(-(-B // bands), 128)


class AxisSums:
    """Sums of squares along one axis of leaves (Adafactor's row and column statistics): one
    int64 row per job, ``[base, A, K, B, obase]``, asking ``out[obase + a B + b] = sum_k x[base +
    (a K + k) B + b]^2`` for every ``a < A``, ``b < B`` (the leaf seen as ``(A, K, B)``, ``K``
    the axis summed). ``n_out`` is the size of ``out``. The work is cut into items ``[job, a0,
    a1, b0, b1]`` of about ``block`` elements, never across ``K``: each output is one thread's
    sum in ``k`` order (the same bits for any thread count); ``device`` is a backend's cache."""

    __slots__ = ("jobs", "n_out", "_items", "device")

    def __init__(self, jobs: np.ndarray, n_out: int) -> None:
        jobs = np.ascontiguousarray(jobs, np.int64).reshape(-1, 5)
        jobs.flags.writeable = False
        self.jobs, self.n_out = jobs, int(n_out)
        self._items: dict[tuple[int, int], np.ndarray] = {}
        self.device: dict = {}

    def items(self, block: int) -> np.ndarray:
        """``[job, a0, a1, b0, b1]`` per item (cached per ``block`` and thread count)."""
        threads = numba.get_num_threads()
        out = self._items.get((block, threads))
        if out is None:
            share = max(int(sum(A * K * B for _, A, K, B, _ in self.jobs.tolist())) // threads, 1)
            cuts = []
            for j, (_, A, K, B, _) in enumerate(self.jobs.tolist()):
                if block >= K * B:  # whole (K, B) planes, several per item
                    step = max(1, block // max(K * B, 1))
                    cuts += [(j, a, min(a + step, A), 0, B) for a in range(0, A, step)]
                else:  # one plane cut into bands of columns, each row's band pages long
                    width = _band_width(K, B, share)
                    cuts += [
                        (j, a, a + 1, b, min(b + width, B)) for a in range(A) for b in range(0, B, width)
                    ]
            out = np.array(cuts, np.int64).reshape(-1, 5)
            out.flags.writeable = False
            self._items[block, threads] = out
        return out

    def __repr__(self) -> str:
        return f"AxisSums({self.jobs.shape[0]} jobs, {self.n_out} sums)"


class AxisMaxima:
    """Maxima over all axes but one of leaves (SM3's statistics): one int64 row per job, ``[base,
    A, K, B, obase]``, asking ``out[obase + k] = max_{a, b} x[base + (a K + k) B + b]`` (NaN if
    any is NaN) for every ``k < K`` (the leaf seen as ``(A, K, B)``, ``K`` the axis kept).
    ``where`` lists the outputs the jobs write. The work is cut into items ``[job, k0, k1]``, bands
    of the kept axis of about ``block`` elements (at least 128 indices wide, so that the rows a
    band reads are cache lines long); ``device`` is a backend's cache."""

    __slots__ = ("jobs", "where", "_items", "device")

    def __init__(self, jobs: np.ndarray) -> None:
        jobs = np.ascontiguousarray(jobs, np.int64).reshape(-1, 5)
        jobs.flags.writeable = False
        self.jobs = jobs
        self.where = np.concatenate(
            [np.arange(o, o + K, dtype=np.int64) for _, _, K, _, o in jobs.tolist()]
            or [np.zeros(0, np.int64)]
        )
        self._items: dict[int, np.ndarray] = {}
        self.device: dict = {}

    def items(self, block: int) -> np.ndarray:
        """``[job, k0, k1]`` per item (cached per ``block``)."""
        out = self._items.get(block)
        if out is None:
            cuts = []
            for j, (_, A, K, B, _) in enumerate(self.jobs.tolist()):
                width = min(K, max(128, block // max(A * B, 1)))
                cuts += [(j, k, min(k + width, K)) for k in range(0, K, width)]
            out = np.array(cuts, np.int64).reshape(-1, 3)
            out.flags.writeable = False
            self._items[block] = out
        return out

    def __repr__(self) -> str:
        return f"AxisMaxima({self.jobs.shape[0]} jobs)"


def nan_max(a, b):  # pragma: no cover - compiled by the backends
    """``max(a, b)``, NaN if either is (``jnp.maximum``'s rule)."""
    if a != a:
        return a
    if b != b:
        return b
    return a if a > b else b


class FactorTable(LeafTable):
    """The leaves of one dtype group as a `RowColumnPass` sees them (Adafactor's,
    `numbaccum.factored`): one row per leaf, ``[base, size, kind, s0, n0, s1, n1, rbase, cbase,
    vbase]``.

    Element ``e`` of a ``FACTORED`` leaf reads its row statistic ``rf[rbase + without_axis(e,
    s0, n0)]`` and its column statistic ``cf[cbase + without_axis(e, s1, n1)]`` (``s0``, ``n0``:
    stride and extent of the axis the row statistics reduce; ``s1``, ``n1``: those of the column
    statistics'); an ``UNFACTORED`` leaf keeps a state of its own at ``v[vbase + e]``."""

    __slots__ = ()

    def __init__(self, meta: np.ndarray) -> None:
        super().__init__(meta, 10)


class AxisTable(LeafTable):
    """The leaves of one dtype group as an `AxesPass` sees them (SM3's, `numbaccum.factored`):
    one row per leaf, ``[base, size, ndim, first]``, and ``axes``, one int64 row per axis of each leaf
    (``first`` is the leaf's first), ``[extent, stride, mbase, direct]``: element ``e`` of the
    leaf reads its axis ``i`` statistic at ``mu[mbase + (e // stride) % extent]``; along a
    ``direct`` axis (the leaf's only one of extent > 1) each element is its own index's maximum,
    and the pass writes it there (no reduction of slices of one element)."""

    __slots__ = ("axes",)

    def __init__(self, meta: np.ndarray, axes: np.ndarray) -> None:
        super().__init__(meta, 4)
        axes = np.ascontiguousarray(axes, np.int64).reshape(-1, 4)
        axes.flags.writeable = False
        self.axes = axes


def wide(v):
    """``v`` in float64, or complex128 for a complex ``v``: what a per-slice scaling computes in
    (compiled per type by the overload below, on both backends; in the CUDA simulator, this
    Python)."""
    return np.complex128(v) if np.iscomplexobj(v) else np.float64(v)


@overload(wide)
def _wide_typed(v):
    if isinstance(v, nbtypes.Complex):
        return lambda v: np.complex128(v)
    return lambda v: np.float64(v)
