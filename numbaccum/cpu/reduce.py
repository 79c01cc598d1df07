"""The reduction engine on the CPU: every reduction and per-slice scaling of numbaccum.

One engine runs any `numbaccum.tables` table (whole buffer, per leaf, per slice, per example)
over the table's fixed work items (``_config.REDUCE_BLOCK`` elements each). An item gives one
float64 partial per slice it covers, and `numbaccum.tables.combine` folds each slice's partials
in item order: the same bits for any thread count, and the same bits for the same elements
whichever table holds them (a leaf's sum of squares is the same in a per-leaf and a whole-leaf
slice table, so every API that asks for a global norm gets one answer).

A contiguous run of a slice is summed with 64 independent float64 accumulators when it is long
(measured on the 2-core VM: 64 lanes read at 45 GB/s, 8 at 22-28 GB/s; enough independent add
chains to hide their latency, and they vectorise without fastmath), with 8 when it is short (a
64-lane array costs more than it saves on a few elements); the choice depends on the run's
length only. Strided runs use the same sums over a strided view; slices of several reduced runs
walk their digits run by run. ``error_model="numpy"``: no exception on a division by zero.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .. import _cache, _config, _locks, formulas
from .._bounded import Bounded
from ..tables import (
    DK,
    DR,
    F_BASE,
    F_CBASE,
    F_KIND,
    F_N0,
    F_N1,
    F_RBASE,
    F_S0,
    F_S1,
    F_VBASE,
    FACTORED,
    FIRST,
    HEAD,
    MAX,
    MIN,
    NSLICES,
    SUM,
    AxisMaxima,
    AxisSums,
    AxisTable,
    FactorTable,
    Table,
    combine,
    compiled,
    element_offset,
    fold,
    identity,
    nan_max,
    needs_scaling,
    norm_scale,
    pnorm_factor,
    pnorm_kind,
    rescued_norm,
    slice_start,
    sum_in_order,
    wide,
)
from .driver import entry_point, guard_for, runs_serial

__all__ = [
    "KINDS",
    "apply_",
    "axis_max_",
    "axis_sumsq",
    "divide_",
    "axes_pass_",
    "ema_update_",
    "global_norm_finish_",
    "kept_kernel",
    "prepare",
    "prepare_apply",
    "prepare_axes",
    "prepare_axis_max",
    "prepare_axis_sumsq",
    "prepare_divide",
    "prepare_ema",
    "prepare_rescale",
    "prepare_row_column",
    "reduce",
    "rescale_",
    "row_column_pass_",
]

_slice_start = njit(inline="always", error_model="numpy")(slice_start)
_element_offset = njit(inline="always", error_model="numpy")(element_offset)
_jit = njit(inline="always", error_model="numpy")
# How an element is read: as float64, as complex128 (complex buffers: optax's norms take |z|^2 =
# re^2 + im^2), a bfloat16 buffer's raw bits as float64 (`formulas.widening`, CUDA's too).
_f64, _c128, _bf16_f64 = formulas.widening(_jit)
_ema = formulas.compile_formula(formulas.ema.fn, _jit)
_rescued_norm = njit(error_model="numpy")(rescued_norm)
_pnorm_factor = compiled(pnorm_factor, _jit)
_nan_max = _jit(nan_max)

_LANES = 64  # independent accumulators of a long run
_WIDE = 1024  # runs of at least this many elements use them (the choice depends on n only)


# --- terms: what a reduction adds up ---------------------------------------------------------


@_jit
def _t_sq(v, c, p):  # pragma: no cover - compiled
    return v * v


@_jit
def _t_csq(v, c, p):  # pragma: no cover - compiled
    d = v - c
    return d * d


@_jit
def _t_ssq(v, c, p):  # pragma: no cover - compiled
    w = v * c  # c a power of two: exact
    return w * w


@_jit
def _t_qsq(v, c, p):  # pragma: no cover - compiled
    w = _like(v, _like(v, v / _like(v, c)) * _like(v, p))  # rounded as the settled element is
    w = np.float64(w)
    return w * w


@_jit
def _t_abs(v, c, p):  # pragma: no cover - compiled
    return abs(v)


@_jit
def _t_pow(v, c, p):  # pragma: no cover - compiled
    return abs(v) ** p


@_jit
def _t_signed(v, c, p):  # pragma: no cover - compiled
    return v


@_jit
def _t_nonzero(v, c, p):  # pragma: no cover - compiled
    return 1.0 if v != 0 else 0.0


@_jit
def _t_nan(v, c, p):  # pragma: no cover - compiled
    return 1.0 if v != v else 0.0


@_jit
def _t_nonfinite(v, c, p):  # pragma: no cover - compiled
    return 1.0 if v - v != 0 else 0.0  # NaN for NaN and +-inf, 0 for every finite value


def _like(v, x):  # pragma: no cover - compiled (below)
    """``x`` in the type of ``v`` (a float32 element's factor in float32)."""
    return x


@overload(_like, jit_options={"error_model": "numpy"})
def _like_typed(v, x):
    if isinstance(v, types.Float) and v.bitwidth == 32:
        return lambda v, x: np.float32(x)
    return lambda v, x: np.float64(x)


@_jit
def _keep(v):  # pragma: no cover - compiled
    return v


@_jit
def _t_sq_complex(v, c, p):  # pragma: no cover - compiled
    return v.real * v.real + v.imag * v.imag


@_jit
def _t_ssq_complex(v, c, p):  # pragma: no cover - compiled
    a = v.real * c  # c a power of two: exact
    b = v.imag * c
    return a * a + b * b


def _lane_sum(term, load=_f64):
    """``total(v, c, p) = sum(term(v[i], c, p))`` in float64 over a (possibly strided) view:
    `_LANES` accumulators for a long view, 8 for a short one, combined in a fixed order.
    ``load`` reads an element as float64 (`_bf16_f64`: a bfloat16 buffer's raw bits)."""

    @_jit
    def total(v, c, p):  # pragma: no cover - compiled
        n = v.size
        if n >= _WIDE:
            acc = np.zeros(_LANES, np.float64)
            stop = n // _LANES * _LANES
            for i in range(0, stop, _LANES):
                for j in range(_LANES):
                    acc[j] += term(load(v[i + j]), c, p)
            s = 0.0
            for i in range(stop, n):
                s += term(load(v[i]), c, p)
            for j in range(_LANES):
                s += acc[j]
            return s
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        stop = n // 8 * 8
        for i in range(0, stop, 8):
            s0 += term(load(v[i]), c, p)
            s1 += term(load(v[i + 1]), c, p)
            s2 += term(load(v[i + 2]), c, p)
            s3 += term(load(v[i + 3]), c, p)
            s4 += term(load(v[i + 4]), c, p)
            s5 += term(load(v[i + 5]), c, p)
            s6 += term(load(v[i + 6]), c, p)
            s7 += term(load(v[i + 7]), c, p)
        t = 0.0
        for i in range(stop, n):
            t += term(load(v[i]), c, p)
        return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + t

    return total


def _extreme(take_max, load=_f64):
    """``total(v, c, p)``: the NaN-propagating max (or min) of |v| (``load``: `_lane_sum`)."""

    @_jit
    def total(v, c, p):  # pragma: no cover - compiled
        m = 0.0 if take_max else np.inf
        for i in range(v.size):
            a = abs(load(v[i]))
            if a != a:
                return a
            if (a > m) if take_max else (a < m):
                m = a
        return m

    return total


def _view_run(kind, total):
    """``run(x, out, a, n, st, c, p)``: ``total`` over ``n`` elements of ``x`` from ``a`` with
    stride ``st`` (a contiguous view when ``st == 1``: the loop vectorises)."""

    # Compiled on its own (not inlined): the walker calls it twice, and an inlined copy per call
    # site and view type made the engine's kernels take seconds each to compile. A symbol of its
    # own, so named after its kind and code: the kernels that call it are cached.
    @njit(error_model="numpy")
    @_cache.identified(kind)
    def run(x, out, a, n, st, c, p):  # pragma: no cover - compiled
        if st == 1:
            return total(x[a : a + n], c, p)
        return total(x[a : a + (n - 1) * st + 1 : st], c, p)

    return run


def _walker(run, op):
    """``walk(x, out, rows, r, off, e0, e1, idx, c, f)``: ``run`` over the runs of elements
    ``[e0, e1)`` of the slice at ``off`` (one strided run when the slice has one reduced run;
    else its digits, kept in the scratch ``idx``), the runs' values folded by ``op``."""

    @_jit
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
        acc = identity(op)
        e = e0
        while e < e1:
            n = min(rows[r, ext + last] - idx[last], e1 - e)
            a = off + _element_offset(rows, r, e)
            acc = fold(op, acc, run(x, out, a, n, st, c, f))
            e += n
            idx[last] += n
            j = last
            while j > 0 and idx[j] >= rows[r, ext + j]:
                idx[j] = 0
                idx[j - 1] += 1
                j -= 1
        return acc

    return walk


def _reducer(kind, total, op):
    """Parallel and serial drivers of reduction ``kind``: ``part[pstart[b] + j]`` = the reduction
    of slice ``s0 + j`` of item ``b`` over the item's elements, centred on ``centers[slice]``
    when given."""
    walk = _walker(_view_run(kind, total), op)

    @_jit
    def item(x, rows, items, pstart, centers, p, part, b, idx):  # pragma: no cover - compiled
        r, s0, s1, e0, e1 = items[b, 0], items[b, 1], items[b, 2], items[b, 3], items[b, 4]
        first = rows[r, FIRST]
        for s in range(s0, s1):
            c = centers[first + s] if centers.size else 0.0
            part[pstart[b] + s - s0] = walk(x, x, rows, r, _slice_start(rows, r, s), e0, e1, idx, c, p)

    @_cache.cached
    @njit(parallel=True, error_model="numpy")
    @_cache.identified(kind)
    def parallel(x, rows, items, pstart, centers, p, part):  # pragma: no cover - compiled
        width = max(rows[0, DR], 1) if rows.shape[0] else 1
        for b in prange(items.shape[0]):
            item(x, rows, items, pstart, centers, p, part, b, np.empty(width, np.int64))

    @_cache.cached
    @njit(error_model="numpy")
    @_cache.identified(kind)
    def serial(x, rows, items, pstart, centers, p, part):  # pragma: no cover - compiled
        idx = np.empty(max(rows[0, DR], 1) if rows.shape[0] else 1, np.int64)
        for b in range(items.shape[0]):
            item(x, rows, items, pstart, centers, p, part, b, idx)

    return (parallel, serial), op


def _totals(load):
    """What each reduction kind adds up (or keeps), reading elements with ``load``, and how its
    values fold."""
    return {
        "sumsq": (_lane_sum(_t_sq, load), SUM),
        "csumsq": (_lane_sum(_t_csq, load), SUM),  # centred: sum((x - c) ** 2)
        "ssumsq": (_lane_sum(_t_ssq, load), SUM),  # scaled: sum((x * c) ** 2), c per slice
        "sumabs": (_lane_sum(_t_abs, load), SUM),
        "sumpow": (_lane_sum(_t_pow, load), SUM),
        "sum": (_lane_sum(_t_signed, load), SUM),
        "nnz": (_lane_sum(_t_nonzero, load), SUM),
        "nancount": (_lane_sum(_t_nan, load), SUM),
        "nonfinite": (_lane_sum(_t_nonfinite, load), SUM),
        "maxabs": (_extreme(True, load), MAX),
        "minabs": (_extreme(False, load), MIN),
    }


def _complex_totals():
    """The kinds defined on complex buffers, over |z| (a signed or centred sum has no real
    value: `_kinds_for` refuses those)."""
    return {
        "sumsq": (_lane_sum(_t_sq_complex, _c128), SUM),
        "ssumsq": (_lane_sum(_t_ssq_complex, _c128), SUM),
        "sumabs": (_lane_sum(_t_abs, _c128), SUM),
        "sumpow": (_lane_sum(_t_pow, _c128), SUM),
        "nnz": (_lane_sum(_t_nonzero, _c128), SUM),
        "nancount": (_lane_sum(_t_nan, _c128), SUM),
        "nonfinite": (_lane_sum(_t_nonfinite, _c128), SUM),
        "maxabs": (_extreme(True, _c128), MAX),
        "minabs": (_extreme(False, _c128), MIN),
    }


# The reduction kinds of the engine: name -> (drivers, fold).
KINDS = {kind: _reducer(kind, total, op) for kind, (total, op) in _totals(_f64).items()}
# Through a pending factor: sum(((x / c) * p) ** 2), the element rounded to its own dtype (float32
# or float64) before it is squared in float64: the bits of "sumsq" over the settled updates
# (`numbaccum.updates.Updates.settled`), without writing them (a collective's fused norm).
KINDS["qsumsq"] = _reducer("qsumsq", _lane_sum(_t_qsq, _keep), SUM)


# The same over bfloat16 buffers' raw bits, and over complex buffers, made when first needed.
class _ComplexKinds(dict):
    """The complex kinds: a kind without a complex meaning is a TypeError, not a KeyError."""

    def __missing__(self, kind):
        raise TypeError(f"the reduction {kind!r} is not defined on complex buffers")


_BF16_KINDS: dict = {}
_COMPLEX_KINDS = _ComplexKinds()
_MADE_LOCK = _locks.lock()


def _kinds_for(x):
    """``(kinds, x)``: the engine's kinds for buffer ``x`` and the buffer they read: a
    bfloat16 buffer's kinds read its raw bits (a uint16 view) and widen each element; a
    complex buffer's reduce |z|."""
    kind = x.dtype.kind
    if kind != "V" and kind != "c":
        return KINDS, x
    made = _BF16_KINDS if kind == "V" else _COMPLEX_KINDS
    if not made:
        with _MADE_LOCK:
            if not made:
                if kind == "V":
                    made.update(
                        {k: _reducer(f"{k}_bf16", t, op) for k, (t, op) in _totals(_bf16_f64).items()}
                    )
                else:
                    made.update(
                        {k: _reducer(f"{k}_complex", t, op) for k, (t, op) in _complex_totals().items()}
                    )
    if kind == "V":
        return _BF16_KINDS, x.view(np.uint16)
    return _COMPLEX_KINDS, x


def _pick(pair, n):
    if n < _config.SERIAL_BELOW:  # a small tree's every call: no call of runs_serial
        return pair[1]
    return pair[1] if runs_serial(n) else pair[0]


def _guarded(n, kernel, *args):
    """Runs ``kernel`` under the CPU driver's guard (numba's ``workqueue`` layer aborts when two
    threads enter parallel kernels at once)."""
    with guard_for(n):
        return kernel(*args)


_NONE = np.zeros(0, np.float64)


def _f16(x):
    """numba has neither float16 nor bfloat16 on the CPU: a float32 copy of such a buffer (exact),
    else x."""
    return x.astype(np.float32) if x.dtype.itemsize == 2 else x


def partials(kind, x, table: Table, centers=None, p=0.0):
    """The work of ``table`` (``REDUCE_BLOCK`` items) and its partials of reduction ``kind``."""
    if x.dtype.type is np.float16:
        x = x.astype(np.float32)
    kinds, x = _kinds_for(x)
    (pair, op) = kinds[kind]
    work = table.work(_config.REDUCE_BLOCK, True)
    part = np.empty(work.nparts, np.float64)
    c = _NONE if centers is None else np.ascontiguousarray(centers, np.float64)
    args = (x, table.rows, work.items, work.pstart, c, np.float64(p), part)
    if work.items.shape[0]:
        _guarded(x.size, _pick(pair, x.size), *args)
    return work, part, op


_NON_NEGATIVE = frozenset(("sumsq", "csumsq", "sumabs", "nnz", "nancount", "nonfinite"))


def _dead():
    return None


def prepared(kind, table: Table):
    """``reduce(kind, x, table)`` for one table, its work laid out once: ``run(x)`` -> per slice,
    float64 (the same kernel, the same partition, the same bits). What a kept plan's global norm
    calls every step (`numbaccum.backend.leaf_sumsq`); for kinds without centres."""
    ((parallel, serial), op) = KINDS[kind]
    work = table.work(_config.REDUCE_BLOCK, True)
    rows, items, pstart, pslice, nparts = table.rows, work.items, work.pstart, work.pslice, work.nparts
    busy = items.shape[0] > 0
    zero = np.float64(0.0)
    # One partial per slice of a kind whose partials are never -0.0 (sums of squares, of |x|,
    # counts): the partials are the fold from 0.0, bit for bit.
    folded = kind in _NON_NEGATIVE and nparts == pslice.size - 1 and bool(np.all(np.diff(pslice) == 1))

    found: dict[np.dtype, Any] = {}  # per dtype, the serial driver's compiled function (`driver.entry_point`)
    # The last buffer it called the compiled function for (weakly: the run is kept per layout
    # and must not keep a tree alive), its dtype, the function: a kept plan's step passes the
    # same buffer again, whose contiguity and alignment cannot have changed. One tuple in one
    # slot: threads sharing the layout read and replace it whole.
    last = [(_dead, None, None)]

    def run(x):  # `partials` and `combine`, inline: this is a small tree's every step
        part = np.empty(nparts, np.float64)
        held, dtype, direct = last[0]
        if held() is x and x.dtype is dtype:
            direct(x, rows, items, pstart, _NONE, zero, part)
            return part if folded else combine(part, pslice, op)
        dtype, owner = x.dtype, x
        pair = (parallel, serial)
        if dtype.type is np.float16:
            x = x.astype(np.float32)
        elif dtype.kind == "V" or dtype.kind == "c":  # bfloat16 (its raw bits) or complex
            kinds, x = _kinds_for(x)
            pair = kinds[kind][0]
        if busy:
            n = x.size
            if n < _config.SERIAL_BELOW:  # never enters a parallel region: no guard
                kernel = found.get(dtype)  # by dtype: byte order included
                flags = x.flags
                if kernel is not None and flags.c_contiguous and flags.aligned:
                    kernel(x, rows, items, pstart, _NONE, zero, part)
                    if x is owner:  # not a copy or a view made here, which dies with the call
                        last[0] = (weakref.ref(x), dtype, kernel)
                else:
                    args = (x, rows, items, pstart, _NONE, zero, part)
                    pair[1](*args)
                    found[dtype] = entry_point(pair[1], args)
            elif runs_serial(n):  # parallel regions off (a forked child)
                pair[1](x, rows, items, pstart, _NONE, zero, part)
            else:
                with guard_for(n):
                    pair[0](x, rows, items, pstart, _NONE, zero, part)
        return part if folded else combine(part, pslice, op)

    return run


def prepare(kind, x, table: Table):
    """``reduce(kind, x, table, centers, p)`` for this very buffer, resolved once: ``run(centers,
    p)`` -> per slice, float64. The kernel, the table's work and the compiled entry are found at
    the first call; later calls run them directly (the same kernel, items and combine: the same
    bits). What `numbaccum.backend.Reductions` keeps for a plan's per-slice factors. A float16
    buffer (a float32 copy per call) and a complex ``'sum'`` (two sums) take `reduce` itself."""
    if x.dtype.type is np.float16 or (kind == "sum" and x.dtype.kind == "c"):
        return lambda centers=None, p=0.0: reduce(kind, x, table, centers, p)
    head, nparts, pslice, op, folded, kernel = _resolved(kind, x, table)
    busy = head[2].shape[0] > 0

    def run(centers=None, p=0.0):
        part = np.empty(nparts, np.float64)
        # A fresh contiguous copy: always the type the entry was compiled for (never read-only).
        c = _NONE if centers is None else np.array(centers, np.float64)
        if busy:
            kernel[0](*head, c, np.float64(p), part)
        return part if folded else combine(part, pslice, op)

    return run


def _resolved(kind, x, table: Table):
    """What `prepare`'s run calls for ``x``: ``(head, nparts, pslice, op, folded, kernel)``, the
    kernel's leading arguments ``(x, rows, items, pstart)`` (its items empty: nothing to run),
    the partials' count and combine, whether they are already the per-slice values, and the
    `kept_kernel`."""
    kinds, xr = _kinds_for(x)
    (pair, op) = kinds[kind]
    work = table.work(_config.REDUCE_BLOCK, True)
    pslice, nparts = work.pslice, work.nparts
    folded = kind in _NON_NEGATIVE and nparts == pslice.size - 1 and bool(np.all(np.diff(pslice) == 1))
    return (xr, table.rows, work.items, work.pstart), nparts, pslice, op, folded, kept_kernel(pair, xr.size)


def prepare_pair(kind, x, y, table: Table):
    """``(reduce(kind, x, table), reduce(kind, y, table))`` for these very buffers, resolved once
    (`prepare`'s, for a kind without centres): ``run()`` -> the two per-slice arrays, from one
    call (a trust ratio's norms of params and updates). float16 buffers take `reduce` itself."""
    if np.float16 in (x.dtype.type, y.dtype.type) or (kind == "sum" and "c" in (x.dtype.kind, y.dtype.kind)):
        return lambda: (reduce(kind, x, table), reduce(kind, y, table))
    hx, nparts, pslice, opx, folded_x, kx = _resolved(kind, x, table)
    hy, _, _, opy, folded_y, ky = _resolved(kind, y, table)
    busy, zero = hx[2].shape[0] > 0, np.float64(0.0)

    def run():
        px, py = np.empty(nparts, np.float64), np.empty(nparts, np.float64)
        if busy:
            kx[0](*hx, _NONE, zero, px)
            ky[0](*hy, _NONE, zero, py)
        return (px if folded_x else combine(px, pslice, opx)), (py if folded_y else combine(py, pslice, opy))

    return run


def kept_kernel(pair, n):
    """``[kernel]``, what a prepared call over ``n`` elements calls with arguments of fixed types:
    at a parallel size the pair behind its guard (`_pick` asked at every call: a fork); else the
    serial driver, replaced after its first call by its compiled function (`driver.entry_point`)."""
    if n >= _config.SERIAL_BELOW:
        return [lambda *args: _guarded(n, _pick(pair, n), *args)]
    kernel: list = []

    def first(*args):
        pair[1](*args)
        kernel[0] = entry_point(pair[1], args)

    kernel.append(first)
    return kernel


def by_items(kind, table: Table):
    """The reduction ``kind`` of ``table`` (its work at ``REDUCE_BLOCK``) run item by item, for a
    buffer that arrives in pieces (`numbaccum.backend.PiecewiseSumsq`): ``(work, run)``, where
    ``run(x, b0, b1, part, centers, p)`` writes the partials of items ``[b0, b1)`` into ``part``
    (``work.nparts`` of them). The same kernels over the same items as a whole run: once every
    item has run, ``combine(part, work.pslice, op)`` gives its bits. For float32 and float64
    buffers."""
    ((parallel, serial), _) = KINDS[kind]
    work = table.work(_config.REDUCE_BLOCK, True)
    items, pstart = work.items, work.pstart

    def run(x, b0, b1, part, centers, p):
        its, ps, n = items[b0:b1], pstart[b0:b1], x.size
        if b1 - b0 < 2 or runs_serial(n):
            serial(x, table.rows, its, ps, centers, np.float64(p), part)
        else:
            with guard_for(n):
                parallel(x, table.rows, its, ps, centers, np.float64(p), part)

    return work, run


def reduce(kind, x, table: Table, centers=None, p=0.0):
    """Per slice of ``table``: the reduction ``kind`` (a key of `KINDS`) of ``x``, float64.

    ``centers`` (one per slice) only for ``'csumsq'`` (the centres) and ``'ssumsq'`` (the
    scales); ``p`` only for ``'sumpow'``. Slices of
    inactive rows and empty slices hold the identity: 0, +inf for ``'minabs'``. The ``'sum'`` of
    a complex ``x`` is complex128: its parts summed apart (a complex mean's)."""
    if kind == "sum" and x.dtype.kind == "c":
        return reduce("sum", x.real, table) + 1j * reduce("sum", x.imag, table)
    work, part, op = partials(kind, x, table, centers, p)
    return combine(part, work.pslice, op)


# --- the norm family's per-slice scaling ----------------------------------------------------


@_cache.cached
@njit(error_model="numpy")
def _pnorm_factors(
    totals, x, rows, p, may_rescue, max_norm, min_norm, norm_value, factors
):  # pragma: no cover
    """factors[s] = `numbaccum.tables.pnorm_factor` of every slice; whether any is not 1."""
    changed = False
    for r in range(rows.shape[0]):
        first = rows[r, FIRST]
        for s in range(rows[r, NSLICES]):
            f = _pnorm_factor(totals[first + s], x, rows, r, s, p, may_rescue, max_norm, min_norm, norm_value)
            factors[first + s] = f
            changed = changed or f != 1.0
    return changed


def rescale_(out, x, table: Table, p, may_rescue, max_norm, min_norm, norm_value):
    """out = x * factor[s] over every slice ``s``, the factor `numbaccum.tables.pnorm_factor` of
    the slice's p-norm (p > 0): clip_norm's and normalize's scaling. Returns False, writing
    nothing, when every factor is 1 (the host can tell; the caller then keeps ``x``)."""
    xr = _f16(x)  # numba has no float16: one float32 copy, for the sums and the rare rescue
    totals = reduce(pnorm_kind(p), xr, table, None, p)
    factors = np.empty(table.nslices, np.float64)
    args = (
        np.float64(p),
        bool(may_rescue),
        np.float64(max_norm),
        np.float64(min_norm),
        np.float64(norm_value),
    )
    if not _pnorm_factors(totals, xr, table.rows, *args, factors):
        return False
    apply_(out, x, table, _NONE, factors)
    return True


def prepare_rescale(out, x, table: Table, p, may_rescue):
    """`rescale_` for these very buffers and this ``p``, resolved once (`prepare`,
    `prepare_apply`): ``run(max_norm, min_norm, norm_value)`` -> whether ``out`` was written.
    float16 and bfloat16 buffers take `rescale_` itself."""
    if _has_f16(out, x):
        return lambda *target: rescale_(out, x, table, p, may_rescue, *target)
    totals, apply = prepare(pnorm_kind(p), x, table), prepare_apply(out, x, table)
    rows, n, head = table.rows, table.nslices, (np.float64(p), bool(may_rescue))

    def run(max_norm, min_norm, norm_value):
        factors = np.empty(n, np.float64)
        target = (np.float64(max_norm), np.float64(min_norm), np.float64(norm_value))
        if not _pnorm_factors(totals(None, p), x, rows, *head, *target, factors):
            return False
        apply(_NONE, factors)
        return True

    return run


# --- per-slice scalings ----------------------------------------------------------------------


@_jit
def _apply_run(x, out, a, n, st, c, f):  # pragma: no cover - compiled
    """out = (x - c) * f over a run (float64 arithmetic, complex128 for a complex x; one
    rounding on the store)."""
    if st == 1:
        o, v = out[a : a + n], x[a : a + n]
        for i in range(n):
            o[i] = (wide(v[i]) - c) * f
    else:
        for i in range(n):
            k = a + i * st
            out[k] = (wide(x[k]) - c) * f
    return 0.0


@_jit
def _apply_in_place_run(x, out, a, n, st, c, f):  # pragma: no cover - compiled
    """`_apply_run` with ``out`` its own input (``x`` unused): see `_divide_in_place_run`."""
    if st == 1:
        o = out[a : a + n]
        for i in range(n):
            o[i] = (wide(o[i]) - c) * f
    else:
        for i in range(n):
            k = a + i * st
            out[k] = (wide(out[k]) - c) * f
    return 0.0


@_jit
def _divide_run(x, out, a, n, st, c, f):  # pragma: no cover - compiled
    """out = ((x / div) * mul) / d over a run, in the buffer dtype; ``c = (div, mul, scaled)``
    is the pending factor, ``f`` the slice's divisor."""
    div, mul, scaled = c
    if st == 1:
        o, v = out[a : a + n], x[a : a + n]
        for i in range(n):
            o[i] = ((v[i] / div) * mul if scaled else v[i]) / f
    else:
        for i in range(n):
            k = a + i * st
            out[k] = ((x[k] / div) * mul if scaled else x[k]) / f
    return 0.0


@_jit
def _divide_in_place_run(x, out, a, n, st, c, f):  # pragma: no cover - compiled
    """`_divide_run` with ``out`` its own input (``x`` unused): one array read and written, so
    that the loop vectorises (with two views of one buffer it runs scalar: LLVM cannot prove
    they do not overlap, and a scalar division costs several times a vector one)."""
    div, mul, scaled = c
    if st == 1:
        o = out[a : a + n]
        for i in range(n):
            o[i] = ((o[i] / div) * mul if scaled else o[i]) / f
    else:
        for i in range(n):
            k = a + i * st
            out[k] = ((out[k] / div) * mul if scaled else out[k]) / f
    return 0.0


@_jit
def _ema_run(x, out, a, n, st, c, f):  # pragma: no cover - compiled
    """ema = (1 - decay) * g + decay * ema over a run (`numbaccum.formulas.ema`), ``x`` the
    gradient, ``out`` the ema; ``c = (div, mul, scaled, one_minus_decay, decay, one)``."""
    div, mul, scaled, one_minus_decay, decay, one = c
    for i in range(n):
        k = a + i * st
        v = (x[k] / div) * mul if scaled else x[k]
        out[k] = _ema(out[k], v, one_minus_decay, decay, one)[0]
    return 0.0


def _scaler(name, run, per_slice):
    """Parallel and serial drivers of ``run`` over every slice of the items; ``per_slice(values,
    slice)`` picks the slice's ``f`` (``values`` a per-slice array); a slice whose ``f`` is NaN
    in ``skip`` mode is left alone."""
    walk = _walker(run, SUM)

    @_jit
    def item(out, x, rows, items, c, values, b, idx):  # pragma: no cover - compiled
        r, s0, s1, e0, e1 = items[b, 0], items[b, 1], items[b, 2], items[b, 3], items[b, 4]
        first = rows[r, FIRST]
        for s in range(s0, s1):
            cs, f, go = per_slice(c, values, first + s)
            if go:
                walk(x, out, rows, r, _slice_start(rows, r, s), e0, e1, idx, cs, f)

    @_cache.cached
    @njit(parallel=True, error_model="numpy")
    @_cache.identified(name)
    def parallel(out, x, rows, items, c, values):  # pragma: no cover - compiled
        width = max(rows[0, DR], 1) if rows.shape[0] else 1
        for b in prange(items.shape[0]):
            item(out, x, rows, items, c, values, b, np.empty(width, np.int64))

    @_cache.cached
    @njit(error_model="numpy")
    @_cache.identified(name)
    def serial(out, x, rows, items, c, values):  # pragma: no cover - compiled
        idx = np.empty(max(rows[0, DR], 1) if rows.shape[0] else 1, np.int64)
        for b in range(items.shape[0]):
            item(out, x, rows, items, c, values, b, idx)

    return parallel, serial


@_jit
def _centre_scale(c, values, s):  # pragma: no cover - compiled
    centers, factors = values
    return (centers[s] if centers.size else 0.0), (factors[s] if factors.size else 1.0), True


@_jit
def _divisor(c, values, s):  # pragma: no cover - compiled
    return c, values[s], True


@_jit
def _if_active(c, values, s):  # pragma: no cover - compiled
    return c, 0.0, values[s] != 0


_APPLY = _scaler("apply", _apply_run, _centre_scale)
_APPLY_IN_PLACE = _scaler("apply_in_place", _apply_in_place_run, _centre_scale)
_DIVIDE = _scaler("divide", _divide_run, _divisor)
_DIVIDE_IN_PLACE = _scaler("divide_in_place", _divide_in_place_run, _divisor)
_EMA = _scaler("ema", _ema_run, _if_active)


def _run_scaler(pair, n, table, active_only, out, x, c, values):
    work = table.work(_config.REDUCE_BLOCK, active_only)
    if work.items.shape[0]:
        _guarded(n, _pick(pair, n), out, x, table.rows, work.items, c, values)


def _staged(fn, write, *args):
    """``fn(*args)`` with float16 and bfloat16 buffers computed through float32 copies (the
    per-slice scalings are rarer than the reductions: no variant of their own); the buffers at
    positions ``write`` are copied back (rounded once)."""
    staged = [
        a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype.itemsize == 2 else a for a in args
    ]
    fn(*staged)
    for i in write:
        if staged[i] is not args[i]:
            args[i][...] = staged[i]


def _has_f16(*arrays):
    """Whether any of the buffers is float16 or bfloat16 (the two-byte floats)."""
    return any(a.dtype.itemsize == 2 for a in arrays)


def apply_(out, x, table: Table, centers, factors):
    """out = (x - centers[s]) * factors[s] over every slice ``s`` (empty ``centers``: 0; empty
    ``factors``: 1), computed in float64. Inactive rows are copied (skipped when ``out`` is
    ``x``)."""
    if _has_f16(out, x):
        same = out is x or out.ctypes.data == x.ctypes.data
        if same:

            def run(o):
                apply_(o, o, table, centers, factors)

            return _staged(run, (0,), out)
        return _staged(lambda o, v: apply_(o, v, table, centers, factors), (0,), out, x)
    in_place = out.ctypes.data == x.ctypes.data
    ct = np.complex128 if np.iscomplexobj(centers) else np.float64  # a complex slice's mean
    values = (np.ascontiguousarray(centers, ct), np.ascontiguousarray(factors, np.float64))
    _run_scaler(_APPLY_IN_PLACE if in_place else _APPLY, x.size, table, in_place, out, x, 0.0, values)


def prepare_apply(out, x, table: Table):
    """`apply_` for these very buffers, resolved once: ``run(centers, factors)`` (as `prepare`
    for `reduce`: the same kernel over the same items). float16 and bfloat16 buffers (staged
    through float32 copies per call) take `apply_` itself."""
    if _has_f16(out, x):
        return lambda centers, factors: apply_(out, x, table, centers, factors)
    in_place = out.ctypes.data == x.ctypes.data
    pair = _APPLY_IN_PLACE if in_place else _APPLY
    items, rows, n = table.work(_config.REDUCE_BLOCK, in_place).items, table.rows, x.size
    found: dict = {}  # per centres dtype (a complex slice's mean), the serial driver's entry

    def run(centers, factors):
        if not items.shape[0]:
            return
        ct = np.complex128 if np.iscomplexobj(centers) else np.float64
        args = (out, x, rows, items, 0.0, (np.array(centers, ct), np.array(factors, np.float64)))
        if n >= _config.SERIAL_BELOW:
            _guarded(n, _pick(pair, n), *args)
        elif ct in found:
            found[ct](*args)
        else:
            pair[1](*args)
            found[ct] = entry_point(pair[1], args)

    return run


def divide_(out, x, factor, table: Table, divisors):
    """out = factor(x) / divisors[s] over every slice ``s`` of ``table``, in the compute dtype
    (``divisors`` cast to it; ``factor`` a host `numbaccum.contract.Factor`)."""
    if _has_f16(out, x):
        if out is x or out.ctypes.data == x.ctypes.data:
            return _staged(lambda o: divide_(o, o, factor, table, divisors), (0,), out)
        return _staged(lambda o, v: divide_(o, v, factor, table, divisors), (0,), out, x)
    div, mul = factor.div, factor.mul
    t = np.result_type(out.dtype, x.dtype).type
    scaled = not (div == 1.0 and mul == 1.0)
    d = np.ascontiguousarray(divisors, t)
    kernels = _DIVIDE_IN_PLACE if out.ctypes.data == x.ctypes.data else _DIVIDE
    _run_scaler(kernels, x.size, table, False, out, x, (t(div), t(mul), scaled), d)


def prepare_divide(out, x, table: Table):
    """`divide_` for these very buffers, resolved once: ``run(factor, divisors)`` (as
    `prepare_apply`: the same kernel over the same items). float16 and bfloat16 buffers (staged
    through float32 copies per call) take `divide_` itself."""
    if _has_f16(out, x):
        return lambda factor, divisors: divide_(out, x, factor, table, divisors)
    t = np.result_type(out.dtype, x.dtype).type
    pair = _DIVIDE_IN_PLACE if out.ctypes.data == x.ctypes.data else _DIVIDE
    items, rows, kernel = table.work(_config.REDUCE_BLOCK, False).items, table.rows, kept_kernel(pair, x.size)

    def run(factor, divisors):
        if items.shape[0]:
            div, mul = factor.div, factor.mul
            c = (t(div), t(mul), not (div == 1.0 and mul == 1.0))
            kernel[0](out, x, rows, items, c, np.array(divisors, t))

    return run

def ema_update_(ema, g, factor, table: Table, active, one_minus_decay, decay):
    """ema = (1 - decay) * factor(g) + decay * ema over each slice ``s`` with ``active[s] != 0``
    (`numbaccum.formulas.ema`); the other slices are left as they are (their g is not even
    read)."""
    if _has_f16(ema, g):
        return _staged(
            lambda e, v: ema_update_(e, v, factor, table, active, one_minus_decay, decay), (0,), ema, g
        )
    div, mul = factor.div, factor.mul
    t = np.result_type(ema.dtype, g.dtype).type
    scaled = not (div == 1.0 and mul == 1.0)
    c = (t(div), t(mul), scaled, t(one_minus_decay), t(decay), t(1))
    act = np.ascontiguousarray(active, np.uint8)
    _run_scaler(_EMA, g.size, table, False, ema, g, c, act)


def prepare_ema(ema, g, table: Table):
    """`ema_update_` for these very buffers, resolved once: ``run(factor, active,
    one_minus_decay, decay)``. float16 and bfloat16 buffers take `ema_update_` itself."""
    if _has_f16(ema, g):
        return lambda factor, *rest: ema_update_(ema, g, factor, table, *rest)
    t = np.result_type(ema.dtype, g.dtype).type
    items, rows, n = table.work(_config.REDUCE_BLOCK, False).items, table.rows, g.size

    kernel = kept_kernel(_EMA, n)
    def run(factor, active, one_minus_decay, decay):
        if items.shape[0]:
            div, mul = factor.div, factor.mul
            c = (t(div), t(mul), not (div == 1.0 and mul == 1.0), t(one_minus_decay), t(decay), t(1))
            args = (ema, g, rows, items, c, np.array(active, np.uint8))
            kernel[0](*args)

    return run


# --- sums of squares along one axis (Adafactor's statistics) ------------------------------------


@_jit
def _axis_item(x, jobs, items, out, b):  # pragma: no cover - compiled
    j, a0, a1, b0, b1 = items[b, 0], items[b, 1], items[b, 2], items[b, 3], items[b, 4]
    base, K, B, obase = jobs[j, 0], jobs[j, 2], jobs[j, 3], jobs[j, 4]
    if B == 1:  # each sum a contiguous run: independent lanes hide the adds' latency
        for a in range(a0, a1):
            out[obase + a] = _lane_sumsq(x[base + a * K : base + (a + 1) * K])
        return
    acc = np.empty(b1 - b0, np.float64)
    for a in range(a0, a1):
        acc[:] = 0.0
        for k in range(K):  # a band of a row at a time: contiguous, in k order
            row = x[base + (a * K + k) * B + b0 : base + (a * K + k) * B + b1]
            for i in range(b1 - b0):
                w = np.float64(row[i])
                acc[i] += w * w
        out[obase + a * B + b0 : obase + a * B + b1] = acc


@_jit
def _lane_sumsq(v):  # pragma: no cover - compiled
    """sum(v^2) in float64 over 8 lanes folded in a fixed order."""
    s = np.zeros(8, np.float64)
    n8 = v.size - v.size % 8
    for i in range(0, n8, 8):
        for j in range(8):
            w = np.float64(v[i + j])
            s[j] += w * w
    for i in range(n8, v.size):
        w = np.float64(v[i])
        s[i - n8] += w * w
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))


@_cache.cached
@njit(parallel=True, error_model="numpy")
def _axis_parallel(x, jobs, items, out):  # pragma: no cover - compiled
    for b in prange(items.shape[0]):
        _axis_item(x, jobs, items, out, b)


@_cache.cached
@njit(error_model="numpy")
def _axis_serial(x, jobs, items, out):  # pragma: no cover - compiled
    for b in range(items.shape[0]):
        _axis_item(x, jobs, items, out, b)


def axis_sumsq(x, sums: AxisSums):
    """The sums of squares of `numbaccum.tables.AxisSums`, float64 (0 where no job writes)."""
    out = np.zeros(sums.n_out, np.float64)
    items = sums.items(_config.REDUCE_BLOCK)
    if items.shape[0]:
        x = _f16(x)
        _guarded(x.size, _pick((_axis_parallel, _axis_serial), x.size), x, sums.jobs, items, out)
    return out


def prepare_axis_sumsq(x, sums: AxisSums):
    """`axis_sumsq` of this very buffer, resolved once: ``run()`` -> the sums (as `prepare`
    for `reduce`). A float16 or bfloat16 buffer takes `axis_sumsq` itself."""
    if x.dtype.itemsize == 2:
        return lambda: axis_sumsq(x, sums)
    items, jobs, n = sums.items(_config.REDUCE_BLOCK), sums.jobs, x.size
    pair, busy, n_out = (_axis_parallel, _axis_serial), items.shape[0] > 0, sums.n_out

    kernel = kept_kernel(pair, n)
    def run():
        out = np.zeros(n_out, np.float64)
        if busy:
            args = (x, jobs, items, out)
            kernel[0](*args)
        return out

    return run


@_jit
def _max_item(x, jobs, items, out, b):  # pragma: no cover - compiled
    j, k0, k1 = items[b, 0], items[b, 1], items[b, 2]
    base, A, K, B, obase = jobs[j, 0], jobs[j, 1], jobs[j, 2], jobs[j, 3], jobs[j, 4]
    acc = np.full(k1 - k0, -np.inf)
    for a in range(A):
        if B == 1:  # the kept axis is the last: a contiguous band per a
            row = x[base + a * K + k0 : base + a * K + k1]
            for i in range(k1 - k0):
                acc[i] = _nan_max(acc[i], np.float64(row[i]))
        else:
            for k in range(k0, k1):
                row = x[base + (a * K + k) * B : base + (a * K + k + 1) * B]
                m = acc[k - k0]
                for i in range(B):
                    m = _nan_max(m, np.float64(row[i]))
                acc[k - k0] = m
    out[obase + k0 : obase + k1] = acc


@_cache.cached
@njit(parallel=True, error_model="numpy")
def _max_parallel(x, jobs, items, out):  # pragma: no cover - compiled
    for b in prange(items.shape[0]):
        _max_item(x, jobs, items, out, b)


@_cache.cached
@njit(error_model="numpy")
def _max_serial(x, jobs, items, out):  # pragma: no cover - compiled
    for b in range(items.shape[0]):
        _max_item(x, jobs, items, out, b)


def axis_max_(out, x, maxima: AxisMaxima):
    """``out[maxima.where]`` = the maxima of `numbaccum.tables.AxisMaxima` (``out`` a host
    array of any float dtype: each maximum is one of ``x``'s values, stored exactly)."""
    items = maxima.items(_config.REDUCE_BLOCK)
    if not items.shape[0]:
        return
    x = _f16(x)
    tmp = np.empty(out.size, np.float64)
    _guarded(x.size, _pick((_max_parallel, _max_serial), x.size), x, maxima.jobs, items, tmp)
    out[maxima.where] = tmp[maxima.where]


def prepare_axis_max(out, x, maxima: AxisMaxima):
    """`axis_max_` for these very buffers, resolved once: ``run()``. A float16 or bfloat16
    buffer takes `axis_max_` itself."""
    items = maxima.items(_config.REDUCE_BLOCK)
    if x.dtype.itemsize == 2 or not items.shape[0]:
        return lambda: axis_max_(out, x, maxima)
    pair, jobs, where, n = (_max_parallel, _max_serial), maxima.jobs, maxima.where, x.size

    kernel = kept_kernel(pair, n)
    def run():
        tmp = np.empty(out.size, np.float64)
        args = (x, jobs, items, tmp)
        kernel[0](*args)
        out[where] = tmp[where]

    return run


# --- axis passes: per-element formulas over statistics gathered along axes -----------------------
# The walks of `numbaccum.tables.FactorTable` and `numbaccum.tables.AxisTable`; what an element
# computes is the declaration's (`tables.RowColumnPass`, `tables.AxesPass`), compiled here per
# declaration as CUDA compiles it.

_PASS_KERNELS = Bounded()  # (walker, declaration) -> its drivers


def _pass_kernels(make, decl):
    """``make(decl)``'s drivers, made once per walker and declaration (making them compiles
    nothing yet: numba compiles on the first call)."""
    kernels = _PASS_KERNELS.get((make, decl))
    return kernels if kernels is not None else _PASS_KERNELS.put((make, decl), make(decl))


@_jit
def _digits(e, s, n):  # pragma: no cover - compiled
    """Element ``e``'s digits around the axis of stride ``s`` and extent ``n``: ``(low, mid,
    high)``, so that the index without that axis is ``high * s + low`` (`tables.without_axis`)."""
    return e % s, (e // s) % n, e // (s * n)


@_jit
def _run_of(s, n, low, mid):  # pragma: no cover - compiled
    """How many elements from here keep the index without the axis moving by one each (``s >
    1``: the low digit runs) or not at all (``s == 1``: the axis itself runs): ``(length,
    step)``."""
    if s > 1:
        return s - low, 1
    return n - mid, 0


@_jit
def _advance(s, n, low, mid, high, k):  # pragma: no cover - compiled
    """The digits ``k`` elements on (``k`` at most the run `_run_of` gave)."""
    if s > 1:
        low += k
        if low == s:
            low = 0
            mid += 1
    else:
        mid += k
    if mid == n:
        mid = 0
        high += 1
    return low, mid, high


def _row_column_kernels(decl):
    """The drivers of a `numbaccum.tables.RowColumnPass`: one item is a run of one leaf's
    elements."""
    scaled = formulas.compile_formula(decl.scaled, _jit)
    full = formulas.compile_formula(decl.full, _jit)

    @_jit
    def item(out, g, v, meta, items, rf, cf, c, b):  # pragma: no cover - compiled
        r, e0, e1 = items[b, 0], items[b, 1], items[b, 2]
        base = meta[r, F_BASE]
        if meta[r, F_KIND] == FACTORED:
            s0, n0, s1, n1 = meta[r, F_S0], meta[r, F_N0], meta[r, F_S1], meta[r, F_N1]
            rb, cb = meta[r, F_RBASE], meta[r, F_CBASE]
            # Runs along which the row and the column index each move by one or stay: plain
            # loops that vectorise, where a division per element would cost more than its bytes.
            l0, m0, h0 = _digits(e0, s0, n0)
            l1, m1, h1 = _digits(e0, s1, n1)
            e = e0
            while e < e1:
                n_a, step0 = _run_of(s0, n0, l0, m0)
                n_b, step1 = _run_of(s1, n1, l1, m1)
                k = min(n_a, n_b, e1 - e)
                ri, ci = rb + h0 * s0 + l0, cb + h1 * s1 + l1
                o, x = out[base + e : base + e + k], g[base + e : base + e + k]
                # One statistic fixed along the run, the other contiguous: loops with constant
                # strides, which LLVM vectorises (a stride known only at run time leaves the
                # loop scalar).
                if step0 == 0 and step1 == 1:
                    a, c1 = rf[ri], cf[ci : ci + k]
                    for t in range(k):
                        o[t] = scaled(x[t], a, c1[t])
                elif step0 == 1 and step1 == 0:
                    r0, b1 = rf[ri : ri + k], cf[ci]
                    for t in range(k):
                        o[t] = scaled(x[t], r0[t], b1)
                else:
                    for t in range(k):
                        o[t] = scaled(x[t], rf[ri + step0 * t], cf[ci + step1 * t])
                l0, m0, h0 = _advance(s0, n0, l0, m0, h0, k)
                l1, m1, h1 = _advance(s1, n1, l1, m1, h1, k)
                e += k
        else:  # the leaf's own state, element by element
            vb = meta[r, F_VBASE]
            n = e1 - e0
            o, x, w = out[base + e0 : base + e1], g[base + e0 : base + e1], v[vb + e0 : vb + e0 + n]
            for t in range(n):
                w[t], o[t] = full(w[t], x[t], c)

    @_cache.cached
    @njit(parallel=True, error_model="numpy")
    @_cache.identified("row_column")
    def parallel(out, g, v, meta, items, rf, cf, c):  # pragma: no cover - compiled
        for b in prange(items.shape[0]):
            item(out, g, v, meta, items, rf, cf, c, b)

    @_cache.cached
    @njit(error_model="numpy")
    @_cache.identified("row_column")
    def serial(out, g, v, meta, items, rf, cf, c):  # pragma: no cover - compiled
        for b in range(items.shape[0]):
            item(out, g, v, meta, items, rf, cf, c, b)

    return parallel, serial


def row_column_pass_(decl, out, g, v, table: FactorTable, rf, cf, scalars):
    """A `numbaccum.tables.RowColumnPass` over one dtype group (see `numbaccum.tables.FactorTable`):
    a ``FACTORED`` leaf's ``out = decl.scaled(g, rf[row], cf[col])`` (host float64 statistics),
    any other leaf's ``(v, out) = decl.full(v, g, scalars)`` in the compute dtype (float16 and
    bfloat16 through float32 copies)."""
    if _has_f16(out, g, v):
        return _staged(
            lambda o, x, w: row_column_pass_(decl, o, x, w, table, rf, cf, scalars), (0, 2), out, g, v
        )
    items = table.items(_config.REDUCE_BLOCK)
    if not items.shape[0]:
        return None
    t = np.result_type(v.dtype, g.dtype).type
    c = tuple([t(s) for s in scalars])
    rf, cf = np.ascontiguousarray(rf, np.float64), np.ascontiguousarray(cf, np.float64)
    pair = _pass_kernels(_row_column_kernels, decl)
    return _guarded(g.size, _pick(pair, g.size), out, g, v, table.meta, items, rf, cf, c)


def prepare_row_column(decl, out, g, v, table: FactorTable):
    """`row_column_pass_` for these very buffers, resolved once: ``run(rf, cf, scalars)``.
    float16 and bfloat16 buffers take `row_column_pass_` itself."""
    items = table.items(_config.REDUCE_BLOCK)
    if _has_f16(out, g, v) or not items.shape[0]:
        return lambda rf, cf, scalars: row_column_pass_(decl, out, g, v, table, rf, cf, scalars)
    t, meta, n = np.result_type(v.dtype, g.dtype).type, table.meta, g.size
    pair = _pass_kernels(_row_column_kernels, decl)

    kernel = kept_kernel(pair, n)
    def run(rf, cf, scalars):
        c = tuple(map(t, scalars))
        args = (out, g, v, meta, items, np.array(rf, np.float64), np.array(cf, np.float64), c)
        kernel[0](*args)

    return run


def _axes_kernels(decl):
    """The drivers of a `numbaccum.tables.AxesPass` (parallel, serial, and their two ways of
    walking an item, ``item`` and ``digits``): one item is a run of one leaf's elements,
    cut into runs along the leaf's last axis, within which every other axis index stays put:
    the fold of their statistics is taken once per run, and the run is a plain loop over
    contiguous statistics that vectorises (a digit update and a gather per element kept the
    loop scalar: 4.6x optax's time on SM3). The same folds in the same order as element by
    element (``digits``, which takes a leaf whose last axis has extent 1)."""
    fold = formulas.compile_formula(decl.fold, _jit)
    element = formulas.compile_formula(decl.element, _jit)

    @_jit
    def digits(out, g, nu, acc, meta, axes, items, mu, mu_new, c, b):  # pragma: no cover - compiled
        """``item`` element by element: its axis indices advanced digit by digit (row-major),
        not divided out per element."""
        r, e0, e1 = items[b, 0], items[b, 1], items[b, 2]
        base, nd, first = meta[r, 0], meta[r, 2], meta[r, 3]
        idx = np.empty(nd, np.int64)
        for i in range(nd):
            idx[i] = (e0 // axes[first + i, 1]) % axes[first + i, 0]
        for e in range(e0, e1):
            m = mu[axes[first, 2] + idx[0]]
            for i in range(1, nd):
                m = fold(m, mu[axes[first + i, 2] + idx[i]])
            k = base + e
            a, n, o = element(g[k], m, nu[k], c)
            acc[k] = a
            nu[k] = n
            out[k] = o
            for i in range(nd):
                if axes[first + i, 3]:
                    mu_new[axes[first + i, 2] + idx[i]] = a
            i = nd - 1
            while i >= 0:
                idx[i] += 1
                if idx[i] < axes[first + i, 0]:
                    break
                idx[i] = 0
                i -= 1

    @_jit
    def item(out, g, nu, acc, meta, axes, items, mu, mu_new, c, b):  # pragma: no cover - compiled
        r, e0, e1 = items[b, 0], items[b, 1], items[b, 2]
        base, nd, first = meta[r, 0], meta[r, 2], meta[r, 3]
        last = first + nd - 1
        if axes[last, 0] == 1 or axes[last, 1] != 1:
            return digits(out, g, nu, acc, meta, axes, items, mu, mu_new, c, b)
        idx = np.empty(nd, np.int64)
        for i in range(nd):
            idx[i] = (e0 // axes[first + i, 1]) % axes[first + i, 0]
        n_last, direct = axes[last, 0], axes[last, 3]
        e = e0
        while e < e1:
            k = min(n_last - idx[nd - 1], e1 - e)
            m = mu[axes[first, 2] + idx[0]]  # the other axes' fold, in axis order
            for i in range(1, nd - 1):
                m = fold(m, mu[axes[first + i, 2] + idx[i]])
            lb = axes[last, 2] + idx[nd - 1]
            st = mu[lb : lb + k]
            lo, hi = base + e, base + e + k
            o, x, v, w = out[lo:hi], g[lo:hi], nu[lo:hi], acc[lo:hi]
            if nd == 1:
                for t in range(k):
                    w[t], v[t], o[t] = element(x[t], st[t], v[t], c)
            else:
                for t in range(k):
                    w[t], v[t], o[t] = element(x[t], fold(m, st[t]), v[t], c)
            if direct:  # the leaf's only axis of extent > 1: each element is its own index's statistic
                mu_new[lb : lb + k] = w
            e += k
            idx[nd - 1] += k
            i = nd - 1
            while i > 0 and idx[i] == axes[first + i, 0]:
                idx[i] = 0
                i -= 1
                idx[i] += 1

    @_cache.cached
    @njit(parallel=True, error_model="numpy")
    @_cache.identified("axes")
    def parallel(out, g, nu, acc, meta, axes, items, mu, mu_new, c):  # pragma: no cover - compiled
        for b in prange(items.shape[0]):
            item(out, g, nu, acc, meta, axes, items, mu, mu_new, c, b)

    @_cache.cached
    @njit(error_model="numpy")
    @_cache.identified("axes")
    def serial(out, g, nu, acc, meta, axes, items, mu, mu_new, c):  # pragma: no cover - compiled
        for b in range(items.shape[0]):
            item(out, g, nu, acc, meta, axes, items, mu, mu_new, c, b)

    return parallel, serial, item, digits  # the item walkers too: tests compare their bits


def axes_pass_(decl, out, g, nu, acc, table: AxisTable, mu, scalars):
    """A `numbaccum.tables.AxesPass` over one dtype group (`numbaccum.tables.AxisTable`): per
    element, its axis statistics folded by ``decl.fold`` into ``m``, then ``(acc, nu, out) =
    decl.element(g, m, nu, scalars)`` in the buffers' dtype (float16 and bfloat16 through
    float32 copies); ``mu`` is the group's axis statistics (host), whose entries along
    ``direct`` axes are replaced by the new ``acc``."""
    if _has_f16(out, g, nu, acc):
        return _staged(
            lambda o, x, n, a: axes_pass_(decl, o, x, n, a, table, mu, scalars), (0, 2, 3), out, g, nu, acc
        )
    items = table.items(_config.REDUCE_BLOCK)
    if not items.shape[0]:
        return None
    t = np.result_type(nu.dtype, g.dtype).type
    c = tuple([t(s) for s in scalars])
    pair = _pass_kernels(_axes_kernels, decl)
    old = np.array(mu, t)  # read while the direct entries are written
    args = (out, g, nu, acc, table.meta, table.axes, items, old, mu, c)
    if mu.dtype != old.dtype:  # float16/bfloat16 statistics: written through a copy
        new = old.copy()
        args = (*args[:8], new, c)
        _guarded(g.size, _pick(pair, g.size), *args)
        mu[...] = new
        return None
    return _guarded(g.size, _pick(pair, g.size), *args)


def prepare_axes(decl, out, g, nu, acc, table: AxisTable, mu):
    """`axes_pass_` for these very buffers, resolved once: ``run(scalars)``. float16 and
    bfloat16 buffers or statistics take `axes_pass_` itself."""
    items = table.items(_config.REDUCE_BLOCK)
    t = np.result_type(nu.dtype, g.dtype).type
    if _has_f16(out, g, nu, acc) or not items.shape[0] or mu.dtype != t:
        return lambda scalars: axes_pass_(decl, out, g, nu, acc, table, mu, scalars)
    head, n = (out, g, nu, acc, table.meta, table.axes, items), g.size
    pair = _pass_kernels(_axes_kernels, decl)

    kernel = kept_kernel(pair, n)
    def run(scalars):
        c = tuple(map(t, scalars))
        args = (*head, np.array(mu, t), mu, c)  # the old statistics read while the direct ones are written
        kernel[0](*args)

    return run


# --- a global norm, finished by the caller's formula --------------------------------------------

_FINISHES: dict = {}  # finish -> compiled


def global_norm_finish_(leaf_sums, x, table: Table, members, last, finish, scalars, out32, out64):
    """``leaf_sums = [plain | rescued | scale]`` (3 per leaf): the per-slice sums of squares of
    ``x`` (its leaves) at ``members``, and for a float64 (or complex128) group whose total `needs_scaling` its
    rescued sums and scale (else the plain sums and 1); when ``last``, the values of
    ``finish(norm, scalars)`` (compiled here) for the global norm `numbaccum.tables.rescued_norm`,
    written to ``out32`` and ``out64`` (as many as each holds). The host twin of the CUDA kernel
    that keeps the norm on the device."""
    members = np.asarray(members)
    nl = leaf_sums.size // 3
    plain = reduce("sumsq", x, table)
    leaf_sums[members] = plain
    scaled, scale = plain, np.ones_like(plain)
    if x.dtype in (np.float64, np.complex128) and needs_scaling(float(sum_in_order(plain))):
        per_leaf = reduce("maxabs", x, table)
        m = float(np.max(per_leaf)) if per_leaf.size else 0.0
        if math.isfinite(m) and m > 0:
            f = norm_scale(m)
            scaled, scale = reduce("ssumsq", x, table, np.full(plain.size, f)), np.full(plain.size, f)
    leaf_sums[nl + members] = scaled
    leaf_sums[2 * nl + members] = scale
    if last:
        fin = _FINISHES.get(finish)
        if fin is None:
            fin = _FINISHES[finish] = formulas.compile_formula(finish, _jit)
        values = fin(_rescued_norm(leaf_sums), scalars)
        for out in (out32, out64):
            n = min(len(values), out.size)
            out[:n] = values[:n]


# --- inner products (L-BFGS's two-loop recursion, its line searches) --------------------------


@njit(error_model="numpy")
def _dot_block(x, y, lo, hi):  # pragma: no cover - compiled
    """sum(x[lo:hi] * y[lo:hi]) in float64, four lanes folded in order."""
    s0 = s1 = s2 = s3 = 0.0
    i = lo
    while i + 4 <= hi:
        s0 += np.float64(x[i]) * np.float64(y[i])
        s1 += np.float64(x[i + 1]) * np.float64(y[i + 1])
        s2 += np.float64(x[i + 2]) * np.float64(y[i + 2])
        s3 += np.float64(x[i + 3]) * np.float64(y[i + 3])
        i += 4
    while i < hi:
        s0 += np.float64(x[i]) * np.float64(y[i])
        i += 1
    return (s0 + s1) + (s2 + s3)


@_cache.cached
@njit(parallel=True, error_model="numpy")
def _dot_parallel(x, y, block, part):  # pragma: no cover - compiled
    """part[b] = the inner product over block ``b``: the same bits for any thread count."""
    for b in prange(part.size):
        part[b] = _dot_block(x, y, b * block, min((b + 1) * block, x.size))


@_cache.cached
@njit(error_model="numpy")
def _dot_serial(x, y, block, part):  # pragma: no cover - compiled
    """`_dot_parallel` without a parallel region (small buffers: no thread pool's start-up)."""
    for b in range(part.size):
        part[b] = _dot_block(x, y, b * block, min((b + 1) * block, x.size))


def dot(x, y) -> float:
    """``sum(x * y)`` accumulated in float64, in a fixed order (blocks of `_config.REDUCE_BLOCK`
    summed in order): the real part of ``vdot(x, y)`` for complex buffers (their parts as
    floats). float16 and bfloat16 buffers are widened first (one copy each)."""
    if x.dtype.kind == "c":
        x, y = x.view(x.real.dtype), y.view(y.real.dtype)
    x, y = _f16(x), _f16(y)
    block = _config.REDUCE_BLOCK
    part = np.zeros(max(-(-x.size // block), 1), np.float64)
    if runs_serial(x.size):
        _dot_serial(x, y, np.int64(block), part)
    else:
        _guarded(x.size, _dot_parallel, x, y, np.int64(block), part)
    return float(sum_in_order(part))


# --- L-BFGS's step compiled whole (a small tree's: no Python between its dots and updates) ------
#
# Per dtype group (two at most, float32 or float64; a tree of one group pads with an empty
# float64 one), ``(p, g, prev_p, prev_g, q, s_mem, y_mem, zero)``: the params, the gradient,
# the last step's pair, the direction, the memories (tuples of buffers) and a zero of the
# group's dtype (scalars are rounded to it as the driver's cast does). Each element is computed
# by the formulas of the contract's calls they replace (``add_scaled``: x + s * y; ``scale``:
# (x / div) * mul) and each inner product is `dot`'s (its blocks summed in order, the groups
# added from 0.0 in order): the same bits as `numbaccum.quasi_newton`'s calls.


@_jit
def _axpy_run(out, x, s, y):  # pragma: no cover - compiled
    for i in range(out.size):
        out[i] = x[i] + s * y[i]


@_jit
def _dot_of(x, y, block):  # pragma: no cover - compiled
    """`dot`'s value: `_dot_serial`'s blocks summed in order from 0.0 (`sum_in_order`)."""
    total = 0.0
    for b in range(max(-(-x.size // block), 1)):
        total += _dot_block(x, y, b * block, min((b + 1) * block, x.size))
    return total


@_cache.cached
@njit(error_model="numpy")
def lbfgs_pair(ga, gb, k, newest, block):  # pragma: no cover - compiled
    """With ``newest``: memory slot ``k`` set to the newest pair, s = p + (-1) prev_p and y = g +
    (-1) prev_g, and ``(<y, s>, <y, y>)``; else ``(<g, g>, 0.0)``."""
    if not newest:
        return (0.0 + _dot_of(ga[1], ga[1], block)) + _dot_of(gb[1], gb[1], block), 0.0
    _axpy_run(ga[5][k], ga[0], _like(ga[7], -1.0), ga[2])
    _axpy_run(ga[6][k], ga[1], _like(ga[7], -1.0), ga[3])
    _axpy_run(gb[5][k], gb[0], _like(gb[7], -1.0), gb[2])
    _axpy_run(gb[6][k], gb[1], _like(gb[7], -1.0), gb[3])
    sy = (0.0 + _dot_of(ga[6][k], ga[5][k], block)) + _dot_of(gb[6][k], gb[5][k], block)
    yy = (0.0 + _dot_of(ga[6][k], ga[6][k], block)) + _dot_of(gb[6][k], gb[6][k], block)
    return sy, yy


@_jit
def _keep_pair(grp, copy):  # pragma: no cover - compiled
    """prev_p = p, prev_g = g and, with ``copy``, q = g (`Ops.scale_` with no factor: copies)."""
    grp[2][:] = grp[0]
    grp[3][:] = grp[1]
    if copy:
        grp[4][:] = grp[1]


@_jit
def _scale_run(q, div, mul):  # pragma: no cover - compiled
    for i in range(q.size):
        q[i] = (q[i] / div) * mul


@_cache.cached
@njit(error_model="numpy")
def lbfgs_two_loop(ga, gb, rho, order, copy, div, mul, scaled, block):  # pragma: no cover - compiled
    """This step's pair kept (`_keep_pair`), then the two-loop recursion over the memory slots
    ``order`` (oldest first) with weights ``rho``: the direction q, scaled by ``(div, mul)``
    between the loops when ``scaled``."""
    _keep_pair(ga, copy)
    _keep_pair(gb, copy)
    alphas = np.empty(order.size, np.float64)
    for t in range(order.size - 1, -1, -1):  # newest first
        j = order[t]
        alpha = rho[j] * ((0.0 + _dot_of(ga[5][j], ga[4], block)) + _dot_of(gb[5][j], gb[4], block))
        _axpy_run(ga[4], ga[4], _like(ga[7], -alpha), ga[6][j])
        _axpy_run(gb[4], gb[4], _like(gb[7], -alpha), gb[6][j])
        alphas[t] = alpha
    if scaled:
        _scale_run(ga[4], _like(ga[7], div), _like(ga[7], mul))
        _scale_run(gb[4], _like(gb[7], div), _like(gb[7], mul))
    for t in range(order.size):
        j = order[t]
        beta = rho[j] * ((0.0 + _dot_of(ga[6][j], ga[4], block)) + _dot_of(gb[6][j], gb[4], block))
        _axpy_run(ga[4], ga[4], _like(ga[7], alphas[t] - beta), ga[5][j])
        _axpy_run(gb[4], gb[4], _like(gb[7], alphas[t] - beta), gb[5][j])


def prepare_dot(x, y):
    """`dot` for these very buffers, resolved once: ``run()`` -> float (the same blocks summed
    in the same order: the same bits). After the first call the serial kernel and the sum are
    called without numba's dispatch (`driver.entry_point`); buffers of a parallel size, float16
    and bfloat16 ones (widened per call) take `dot` itself."""
    if x.dtype.itemsize == 2 or y.dtype.itemsize == 2 or x.size >= _config.SERIAL_BELOW:
        return lambda: dot(x, y)
    if x.dtype.kind == "c":
        x, y = x.view(x.real.dtype), y.view(y.real.dtype)
    block, nparts = np.int64(_config.REDUCE_BLOCK), max(-(-x.size // _config.REDUCE_BLOCK), 1)
    found: list = []  # the kernel's and the sum's compiled functions, after the first call

    def run():
        part = np.zeros(nparts, np.float64)  # per call: threads may share a kept run
        if found:
            found[0](x, y, block, part)
            return float(found[1](part))
        _dot_serial(x, y, block, part)
        total = float(sum_in_order(part))
        found[:] = entry_point(_dot_serial, (x, y, block, part)), entry_point(sum_in_order, (part,))
        return total

    return run
