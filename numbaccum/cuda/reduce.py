"""The reduction engine on CUDA: the twin of `numbaccum.cpu.reduce`.

The same `numbaccum.tables` tables and work items, cut at ``CUDA_REDUCE_BLOCK`` elements. One
CUDA block takes one item: for each slice of the item its threads stride over the item's
elements (an element's offset from `numbaccum.tables.element_offset`), add them in float64, and
a shared-memory tree in a fixed pairing gives the item's partial for that slice. No float
atomics: the partials come to the host, where `numbaccum.tables.combine` folds each slice's in
item order, so a norm has the same bits on every run. A scaling is one launch, one block per
item.

A global L2 norm can stay on the device and be finished there (`global_norm_finish_`): the same
partials kernel, and the last block to finish (an integer ticket) folds each leaf's partials in
item order into a per-leaf array in tree order, exactly as the host would; the kernel of the last
dtype group adds that array in order (`numbaccum.tables.rescued_norm`) and hands the norm to the
caller's *finish*: a plain function ``finish(norm, scalars)`` returning a tuple of floats (one of
`numbaccum.formulas`, compiled here as a device function; a kernel per finish), whose values it
writes to the caller's float32 and float64 device arrays. The kernel names no transformation:
clip_by_global_norm brings `numbaccum.formulas.clip_finish` (its factor and its state's record).
One launch per group, no synchronisation, and the same norm bits as `global_norm` of the same
device tree. The scaled norm (`numbaccum.backend.tree_sumsq_scaled`) rides on the same launch: in
a float64 group whose plain total `needs_scaling` (float64 elements past ~1e154 or below
~1e-154, rare), the last block alone runs the group's max and scaled partials over the same items
with the same pairing (slow, but the same bits as the host's rescue).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np
from numba import cuda

from .. import _config, _locks, formulas
from ..arrays import data_pointer, empty, raw_bits, stream, stream_handle
from ..contract import ONE, Factor
from ..layout import real_dtype
from ..tables import (
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
    nan_max,
    needs_scaling,
    norm_scale,
    pnorm_factor,
    pnorm_kind,
    rescued_norm,
    slice_start,
    wide,
    without_axis,
)
from . import driver
from .cache import cached

__all__ = [
    "KINDS",
    "apply_",
    "axes_pass_",
    "axis_max_",
    "axis_sumsq",
    "divide_",
    "ema_update_",
    "global_norm_finish_",
    "reduce",
    "rescale_",
    "row_column_pass_",
]

_dev_inline = cuda.jit(device=True, inline=True)
_slice_start = cuda.jit(device=True)(slice_start)
_element_offset = cuda.jit(device=True)(element_offset)
_needs_scaling = cuda.jit(device=True)(needs_scaling)
_norm_scale = cuda.jit(device=True)(norm_scale)
_rescued_norm = cuda.jit(device=True)(rescued_norm)
_ema = formulas.compile_formula(formulas.ema.fn, _dev_inline)
_pnorm_factor = compiled(pnorm_factor, _dev_inline)
_read = driver.read
_without_axis = cuda.jit(device=True)(without_axis)
_nan_max = _dev_inline(nan_max)

# Reduction kinds (the same names as the CPU engine's) -> (code, fold).
KINDS = {
    "sumsq": (0, SUM),
    "csumsq": (1, SUM),
    "sumabs": (2, SUM),
    "sumpow": (3, SUM),
    "sum": (4, SUM),
    "nnz": (5, SUM),
    "nancount": (6, SUM),
    "nonfinite": (7, SUM),
    "maxabs": (8, MAX),
    "minabs": (9, MIN),
    "ssumsq": (10, SUM),  # scaled: sum((x * c) ** 2), c per slice (a power of two)
}
_MAXABS, _MINABS = 8, 9
_REAL_PART, _IMAG_PART = 11, 12  # a complex buffer's 'sum': its parts summed apart


@_dev_inline
def _class_term(kind, v, p):  # pragma: no cover - compiled
    """The kinds that read |v| or v's class: one text for real and complex v (`_term`, `_cterm`)."""
    if kind == 3:
        return abs(v) ** p
    if kind == 5:
        return 1.0 if v != 0 else 0.0
    if kind == 6:
        return 1.0 if v != v else 0.0
    if kind == 7:
        return 1.0 if v - v != 0 else 0.0
    return abs(v)


@_dev_inline
def _term(kind, v, c, p):  # pragma: no cover - compiled
    if kind == 0:
        return v * v
    if kind == 1:
        d = v - c
        return d * d
    if kind == 4:
        return v
    if kind == 10:
        w = v * c
        return w * w
    return _class_term(kind, v, p)


# Complex buffers (optax's norms: |z|^2 = re^2 + im^2), each element read as complex128: the
# CPU engine's complex kinds, and the complex 'sum' (its parts apart). A centred sum of squares
# has no meaning there (`reduce` refuses it).
_COMPLEX_KINDS = frozenset(
    ("sumsq", "ssumsq", "sumabs", "sumpow", "nnz", "nancount", "nonfinite", "maxabs", "minabs", "sum")
)


@_dev_inline
def _cterm(kind, v, c, p):  # pragma: no cover - compiled
    if kind == 0:
        return v.real * v.real + v.imag * v.imag
    if kind == 10:
        a = v.real * c  # c a power of two: exact
        b = v.imag * c
        return a * a + b * b
    if kind == _REAL_PART:
        return v.real
    if kind == _IMAG_PART:
        return v.imag
    return _class_term(kind, v, p)


# How an element is read (float64, complex128, bfloat16 bits): the CPU engine's functions.
_f64, _c128, _bf16_f64 = formulas.widening(_dev_inline)


def _check_kind(kind: str, x: Any) -> None:
    """TypeError for a reduction without a meaning on a complex ``x`` (the CPU engine's)."""
    if np.dtype(x.dtype).kind == "c" and kind not in _COMPLEX_KINDS:
        raise TypeError(f"the reduction {kind!r} is not defined on complex buffers")


@_dev_inline
def _merge(kind, acc, v):  # pragma: no cover - compiled
    """Adds, or keeps the NaN-propagating max (min) for the extreme kinds."""
    if kind != _MAXABS and kind != _MINABS:
        return acc + v
    if acc != acc:
        return acc
    if v != v:
        return v
    if kind == _MAXABS:
        return v if v > acc else acc
    return v if v < acc else acc


_KERNELS: dict[tuple, Any] = {}
_KERNELS_LOCK = _locks.lock()


def _norm_only(norm, scalars):  # pragma: no cover - compiled
    """The finish of a kernel without one: it types the tail, which never runs there."""
    return (norm,)


def _partials_kernel(
    kind: int, tpb: int, finish: Any = None, rescue: bool = False, complex_: bool = False, bf16: bool = False
) -> Any:
    """The partials kernel of reduction ``kind`` for ``tpb`` threads (shared memory is sized at
    compile time). With a ``finish`` (a plain function, see the module docstring), the global
    norm's tail, which calls it on the device, and with ``rescue`` (a float64 or complex128
    group) the tail's scaled second pass when the group's plain sum of squares `needs_scaling`.
    ``complex_``: over a complex buffer (each element read as complex128, the `_cterm` kinds);
    ``bf16``: over a bfloat16 buffer's raw bits (uint16, each element widened: `_bf16_f64`).
    One kernel per ``(kind, tpb, finish, rescue, complex_, bf16)``: the compiled finish, the term and
    the load are closure cells of the kernel, so their code is in the kernel's identity
    (`numbaccum._cache.identify`)."""
    key = (kind, tpb, finish, rescue, complex_, bf16)
    hit = _KERNELS.get(key)
    if hit is not None:
        return hit
    finishing = finish is not None
    fin = formulas.compile_formula(finish if finishing else _norm_only, _dev_inline)
    term, load = (_cterm, _c128) if complex_ else (_term, _bf16_f64 if bf16 else _f64)

    @cached
    @cuda.jit
    def kernel(
        x,
        rows,
        items,
        pstart,
        centers,
        centred,
        p,
        part,
        pslice,
        members,
        leaf_sums,
        ticket,
        last_group,
        scalars,
        out32,
        out64,
    ):  # pragma: no cover - compiled
        shared = cuda.shared.array(tpb, np.float64)
        b = cuda.blockIdx.x
        t = cuda.threadIdx.x
        if b < items.shape[0]:
            r = items[b, 0]
            s0 = items[b, 1]
            first = rows[r, FIRST]
            for s in range(s0, items[b, 2]):
                off = _slice_start(rows, r, s)
                c = centers[first + s] if centred else 0.0
                acc = math.inf if kind == _MINABS else 0.0
                e = items[b, 3] + t
                while e < items[b, 4]:
                    v = load(x[off + _element_offset(rows, r, e)])
                    acc = _merge(kind, acc, term(kind, v, c, p))
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
        if finishing:
            last = cuda.shared.array(1, np.int32)
            scale = cuda.shared.array(1, np.float64)
            if t == 0:  # this block's partials are out: take a ticket
                cuda.threadfence()
                last[0] = cuda.atomic.add(ticket, 0, 1) == cuda.gridDim.x - 1
            cuda.syncthreads()
            if last[0]:  # the last block: every partial is visible; fold each leaf's in order
                nl = leaf_sums.size // 3  # [plain | rescued | scale] per leaf
                nsl = pslice.size - 1
                s = t
                while s < nsl:
                    acc = 0.0
                    for k in range(pslice[s], pslice[s + 1]):
                        acc += part[k]
                    leaf_sums[members[s]] = acc
                    s += tpb
                cuda.threadfence()
                cuda.syncthreads()
                if t == 0:
                    scale[0] = 0.0
                    if rescue:  # the group's own plain total, in leaf order (as the host adds it)
                        gt = 0.0
                        for k in range(nsl):
                            gt += leaf_sums[members[k]]
                        if _needs_scaling(gt):
                            scale[0] = 1.0
                cuda.syncthreads()
                if rescue and scale[0] != 0.0:
                    # The rare rescue, by this one block: the group's max |x| over every item,
                    # then the scaled partials of every item with the engine's own cut, thread
                    # stride and pairing (the bits of `reduce('ssumsq')`), folded per leaf.
                    m = 0.0
                    for b2 in range(items.shape[0]):
                        r2 = items[b2, 0]
                        for s2 in range(items[b2, 1], items[b2, 2]):
                            off = _slice_start(rows, r2, s2)
                            e = items[b2, 3] + t
                            while e < items[b2, 4]:
                                m = _merge(_MAXABS, m, abs(load(x[off + _element_offset(rows, r2, e)])))
                                e += tpb
                    shared[t] = m
                    cuda.syncthreads()
                    half = tpb // 2
                    while half > 0:
                        if t < half:
                            shared[t] = _merge(_MAXABS, shared[t], shared[t + half])
                        cuda.syncthreads()
                        half //= 2
                    if t == 0:
                        mm = shared[0]
                        scale[0] = _norm_scale(mm) if (mm - mm == 0 and mm > 0) else 0.0
                    cuda.syncthreads()
                    f = scale[0]
                    if f != 0.0:
                        for b2 in range(items.shape[0]):
                            r2 = items[b2, 0]
                            s0b = items[b2, 1]
                            for s2 in range(s0b, items[b2, 2]):
                                off = _slice_start(rows, r2, s2)
                                acc = 0.0
                                e = items[b2, 3] + t
                                while e < items[b2, 4]:
                                    acc = acc + term(10, load(x[off + _element_offset(rows, r2, e)]), f, p)
                                    e += tpb
                                shared[t] = acc
                                cuda.syncthreads()
                                half = tpb // 2
                                while half > 0:
                                    if t < half:
                                        shared[t] = shared[t] + shared[t + half]
                                    cuda.syncthreads()
                                    half //= 2
                                if t == 0:
                                    part[pstart[b2] + s2 - s0b] = shared[0]
                                cuda.syncthreads()
                        cuda.threadfence_block()
                s = t
                while s < nsl:
                    k = members[s]
                    if rescue and scale[0] != 0.0:
                        acc = 0.0
                        for q in range(pslice[s], pslice[s + 1]):
                            acc += part[q]
                        leaf_sums[nl + k] = acc
                        leaf_sums[2 * nl + k] = scale[0]
                    else:
                        leaf_sums[nl + k] = leaf_sums[k]
                        leaf_sums[2 * nl + k] = 1.0
                    s += tpb
                cuda.threadfence()
                cuda.syncthreads()
                if t == 0:
                    ticket[0] = 0
                    if last_group:  # the caller's finish of the global norm, never on the host
                        values = fin(_rescued_norm(leaf_sums), scalars)
                        for n in range(min(len(values), out64.size)):
                            out64[n] = values[n]
                        for n in range(min(len(values), out32.size)):
                            out32[n] = values[n]

    with _KERNELS_LOCK:
        _KERNELS[key] = kernel
    return kernel


def _is_complex(x: Any) -> bool:
    return np.dtype(x.dtype).kind == "c"


def _is_bf16(x: Any) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and np.dtype(dt).kind == "V"


def through_float32(*write: int) -> Any:
    """The operation with its bfloat16 device buffers computed through float32 copies, those at
    positions ``write`` rounded back once (the CPU engine's staging: the per-slice scalings and
    the axis passes are rarer than the reductions and the elementwise passes,
    which read bfloat16 bits in place)."""

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any) -> Any:
            if not any(_is_bf16(a) and not isinstance(a, np.ndarray) for a in args):
                return fn(*args)
            # Host arrays (an axes pass's statistics) are converted by NumPy where they are used.
            staged = [_widened(a) if _is_bf16(a) and not isinstance(a, np.ndarray) else a for a in args]
            result = fn(*staged)
            for i in write:
                if staged[i] is not args[i]:
                    driver.map_(formulas.scale, ONE, (staged[i], args[i]), ())
            return result

        return run

    return wrap


def _widened(x: Any) -> Any:
    """A float32 device copy of bfloat16 device buffer ``x`` (exact)."""
    out = empty(x.size, np.float32)
    driver.map_(formulas.scale, ONE, (x, out), ())
    return out


# --- device copies ---------------------------------------------------------------------------

_DUMMY: dict[Any, Any] = {}


def _dummy(dtype: Any = np.float64) -> Any:
    d = _DUMMY.get(np.dtype(dtype))
    if d is None:
        d = _DUMMY[np.dtype(dtype)] = cuda.to_device(np.zeros(1, dtype))
    return d


def _work(table: Table, active_only: bool = True) -> tuple:
    """``(work, rows, items, pstart, pslice)``: the table's work at ``CUDA_REDUCE_BLOCK`` and
    its device copies (cached with the table)."""
    work = table.work(_config.CUDA_REDUCE_BLOCK, active_only)
    dev = work.device.get("cuda")
    if dev is None:
        rows = table.device.get("cuda")
        if rows is None:
            rows = table.device["cuda"] = cuda.to_device(table.rows)
        items = work.items if work.items.shape[0] else np.zeros((1, 5), np.int64)
        dev = work.device["cuda"] = (
            rows,
            cuda.to_device(items),
            cuda.to_device(work.pstart if work.pstart.size else np.zeros(1, np.int64)),
            cuda.to_device(work.pslice),
        )
    return (work, *dev)


def _per_slice(values: Any) -> tuple[Any, bool]:
    """A per-slice float64 array on the device (complex128 for complex values: a complex
    slice's mean) and whether it is given (None or empty: not)."""
    if values is not None and values.size:
        if isinstance(values, np.ndarray):
            dt = np.complex128 if values.dtype.kind == "c" else np.float64
            values = cuda.to_device(np.ascontiguousarray(values, dt), stream=stream())
        return values, True
    return _dummy(), False


def _launch(kernel: Any, blocks: int, args: tuple) -> None:
    driver.LAUNCHES[0] += 1
    kernel[blocks, _config.CUDA_THREADS, stream()](*args)


# --- reductions ------------------------------------------------------------------------------


def reduce(kind: str, x: Any, table: Table, centers: Any = None, p: float = 0.0) -> np.ndarray:
    """Per slice of ``table``: the reduction ``kind`` of ``x``, float64 on the host (one
    synchronisation). As `numbaccum.cpu.reduce.reduce`."""
    _check_kind(kind, x)
    if kind == "sum" and _is_complex(x):  # complex128: its parts summed apart (a complex mean's)
        return _reduce(_REAL_PART, SUM, x, table) + 1j * _reduce(_IMAG_PART, SUM, x, table)
    code, op = KINDS[kind]
    return _reduce(code, op, x, table, centers, p)


def _reduce(code: int, op: int, x: Any, table: Table, centers: Any = None, p: float = 0.0) -> np.ndarray:
    """`reduce` of the kind of ``code``, folded by ``op``: one launch, one copy to the host."""
    work, rows, items, pstart, pslice = _work(table)
    part = np.zeros(work.nparts, np.float64)
    if work.items.shape[0]:
        c, centred = _per_slice(centers)
        part_d = cuda.device_array(work.nparts, np.float64, stream=stream())
        d, i8 = _dummy(), _dummy(np.int64)
        args = (
            x,
            rows,
            items,
            pstart,
            c,
            centred,
            np.float64(p),
            part_d,
            pslice,
            i8,
            d,
            _dummy(np.int32),
            False,
            (),
            _dummy(np.float32),
            d,
        )
        kernel = _partials_kernel(code, _config.CUDA_THREADS, complex_=_is_complex(x), bf16=_is_bf16(x))
        _launch(kernel, work.items.shape[0], (raw_bits(x), *args[1:]))
        part = part_d.copy_to_host(stream=stream())
    return combine(part, work.pslice, op)


_TICKETS: dict[tuple, Any] = {}


def _ticket() -> Any:
    """The zeroed ticket counter, per host thread and stream: two finishing launches in flight on
    different streams never share one (the last block resets it)."""
    key = (threading.get_ident(), stream_handle(stream()))
    hit = _TICKETS.get(key)
    if hit is None:
        hit = _TICKETS[key] = cuda.to_device(np.zeros(1, np.int32), stream=stream())
    return hit


_PARTS: dict[tuple, Any] = {}


def _scratch(n: int, tag: str = "partials") -> Any:
    """A float64 device array of ``n`` (at least 1) per host thread, stream, size and use."""
    key = (threading.get_ident(), stream_handle(stream()), n, tag)
    hit = _PARTS.get(key)
    if hit is None:
        if len(_PARTS) > 64:
            _PARTS.clear()
        hit = _PARTS[key] = cuda.device_array(max(n, 1), np.float64, stream=stream())
    return hit


_MEMBERS: dict[bytes, Any] = {}


def global_norm_finish_(leaf_sums, x, table: Table, members, last, finish, scalars, out32, out64):
    """``leaf_sums = [plain | rescued | scale]`` (3 per leaf): the group's plain per-leaf sums
    of squares (folded as the host folds them), and for a float64 group whose total
    `needs_scaling` its rescued sums and scale (else the plain sums and 1); when ``last``, the
    values of ``finish(norm, scalars)`` (``scalars`` a tuple of float64) for the global norm
    `numbaccum.tables.rescued_norm`, written to ``out32`` and ``out64`` (as many as each holds).
    One launch, nothing comes to the host."""
    work, rows, items, pstart, pslice = _work(table)
    members = np.ascontiguousarray(members, np.int64)
    key = members.tobytes()
    mem = _MEMBERS.get(key)
    if mem is None:
        if len(_MEMBERS) > 256:
            _MEMBERS.clear()
        mem = _MEMBERS[key] = cuda.to_device(members if members.size else np.zeros(1, np.int64))
    args = (
        x,
        rows,
        items,
        pstart,
        _dummy(),
        False,
        np.float64(0),
        _scratch(work.nparts),
        pslice,
        mem,
        leaf_sums,
        _ticket(),
        bool(last),
        tuple(scalars),
        out32,
        out64,
    )
    # At least one block, so that a group without elements still writes its zeros (and finishes).
    # float32/16 squares (and complex64 parts') never leave float64's range
    rescue = np.dtype(x.dtype) in (np.float64, np.complex128)
    kernel = _partials_kernel(0, _config.CUDA_THREADS, finish, rescue, _is_complex(x), _is_bf16(x))
    _launch(kernel, max(1, work.items.shape[0]), (raw_bits(x), *args[1:]))


# --- the norm family's per-slice scaling: factors computed on the device ----------------------


@cached
@cuda.jit
def _pnorm_factors(
    part, pslice, slice_row, x, rows, is_max, p, may_rescue, max_norm, min_norm, norm_value, factors
):  # pragma: no cover - compiled
    """factors[s] = `numbaccum.tables.pnorm_factor` of slice ``s`` from its partials folded in
    item order (as `numbaccum.tables.combine` folds them): one thread per slice."""
    s = cuda.grid(1)
    while s < factors.size:
        acc = 0.0
        for k in range(pslice[s], pslice[s + 1]):
            acc = _merge(_MAXABS, acc, part[k]) if is_max else acc + part[k]
        r = slice_row[s]
        factors[s] = _pnorm_factor(
            acc, x, rows, r, s - rows[r, FIRST], p, may_rescue, max_norm, min_norm, norm_value
        )
        s += cuda.gridsize(1)


def _slice_rows(table: Table) -> Any:
    """The row of every slice of ``table`` (int64, on the device; cached with the table)."""
    dev = table.device.get("cuda slice rows")
    if dev is None:
        rows = np.repeat(np.arange(table.rows.shape[0], dtype=np.int64), table.rows[:, NSLICES])
        dev = table.device["cuda slice rows"] = cuda.to_device(rows if rows.size else np.zeros(1, np.int64))
    return dev


@through_float32(0)
def rescale_(out, x, table: Table, p, may_rescue, max_norm, min_norm, norm_value):
    """out = x * factor[s] over every slice ``s``, the factor `numbaccum.tables.pnorm_factor` of
    the slice's p-norm (p > 0): three launches (partials, factors, scaling) and nothing comes
    to the host, so it always writes ``out`` and returns True (the host twin may return False)."""
    code, op = KINDS[pnorm_kind(p)]
    work, rows, items, pstart, pslice = _work(table)
    part = _scratch(work.nparts)
    if work.items.shape[0]:
        d, i8 = _dummy(), _dummy(np.int64)
        unused = (i8, d, _dummy(np.int32), False, (), _dummy(np.float32), d)  # the finishing tail's
        args = (x, rows, items, pstart, d, False, np.float64(p), part, pslice, *unused)
        kernel = _partials_kernel(code, _config.CUDA_THREADS, complex_=_is_complex(x), bf16=_is_bf16(x))
        _launch(kernel, work.items.shape[0], (raw_bits(x), *args[1:]))
    factors = _scratch(table.nslices, "factors")
    if table.nslices:
        scalars = (
            np.float64(p),
            bool(may_rescue),
            np.float64(max_norm),
            np.float64(min_norm),
            np.float64(norm_value),
        )
        blocks, tpb = driver.grid(table.nslices)
        driver.LAUNCHES[0] += 1
        _pnorm_factors[blocks, tpb, stream()](
            part, pslice, _slice_rows(table), x, rows, op == MAX, *scalars, factors
        )
    apply_(out, x, table, None, factors)
    return True


# --- per-slice scalings ----------------------------------------------------------------------


@cached
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
            k = off + _element_offset(rows, r, e)
            out[k] = (wide(x[k]) - c) * f
            e += cuda.blockDim.x


def _by_mode(make: Any) -> Any:
    """A kernel factory cached per pending-factor mode (a closure constant: branches fold), per
    tuple of such constants, or per declaration of an axis pass (its formulas the closure's)."""
    cache: dict[Any, Any] = {}

    def get(mode: Any) -> Any:
        k = cache.get(mode)
        if k is None:
            k = cache[mode] = make(mode)
        return k

    return get


_quot = _dev_inline(formulas.quot)
_complex_quot = _dev_inline(formulas.complex_quot)


@_by_mode
def _divide(key):  # pragma: no cover - compiled per mode
    mode, complex_ = key  # a complex x: read and divided by the real divisor part by part
    read, quot = (driver.read_complex, _complex_quot) if complex_ else (_read, _quot)

    @cached
    @cuda.jit
    def kernel(out, x, div, mul, fac, rows, items, divisors):
        b = cuda.blockIdx.x
        r = items[b, 0]
        first = rows[r, FIRST]
        for s in range(items[b, 1], items[b, 2]):
            off = _slice_start(rows, r, s)
            f = divisors[first + s]
            e = items[b, 3] + cuda.threadIdx.x
            while e < items[b, 4]:
                k = off + _element_offset(rows, r, e)
                out[k] = quot(read(x[k], div, mul, fac, mode), f)
                e += cuda.blockDim.x

    return kernel


@_by_mode
def _ema_kernel(mode):  # pragma: no cover - compiled per mode
    @cached
    @cuda.jit
    def kernel(ema, g, div, mul, fac, rows, items, active, one_minus_decay, decay, one):
        b = cuda.blockIdx.x
        r = items[b, 0]
        first = rows[r, FIRST]
        for s in range(items[b, 1], items[b, 2]):
            if active[first + s] == 0:
                continue
            off = _slice_start(rows, r, s)
            e = items[b, 3] + cuda.threadIdx.x
            while e < items[b, 4]:
                k = off + _element_offset(rows, r, e)
                ema[k] = _ema(ema[k], _read(g[k], div, mul, fac, mode), one_minus_decay, decay, one)[0]
                e += cuda.blockDim.x

    return kernel


def _on_device(x: Any, dtype: Any) -> Any:
    if isinstance(x, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(x, dtype), stream=stream())
    return x


@through_float32(0)
def apply_(out, x, table: Table, centers, factors):
    """out = (x - centers[s]) * factors[s] over every slice ``s`` (empty ``centers``: 0; empty
    ``factors``: 1), computed in float64. Inactive rows are copied (skipped when ``out`` is
    ``x``)."""
    ptr = data_pointer(out)
    in_place = out is x or (ptr is not None and ptr == data_pointer(x))
    work, rows, items, _, _ = _work(table, in_place)
    if work.items.shape[0]:
        c, centred = _per_slice(centers)
        f, scaled = _per_slice(factors)
        _launch(_apply, work.items.shape[0], (out, x, rows, items, c, centred, f, scaled))


@through_float32(0)
def divide_(out, x, factor: Factor, table: Table, divisors):
    """out = factor(x) / divisors[s] over every slice ``s`` of ``table``, in the compute dtype
    (host ``divisors`` are cast to it, its real dtype for complex buffers, and copied to the
    device)."""
    ctype = np.result_type(out.dtype, x.dtype)
    real = real_dtype(ctype)
    work, rows, items, _, _ = _work(table, False)
    if work.items.shape[0]:
        div, mul, fac, mode = driver.factor_args(factor, real)
        # (a caller in a complex group's dtype passes real divisors with zero imaginary parts)
        d = _on_device(np.real(divisors) if isinstance(divisors, np.ndarray) else divisors, real)
        args = (out, x, div, mul, fac, rows, items, d)
        _launch(_divide((mode, ctype.kind == "c")), work.items.shape[0], args)


@through_float32(0)
def ema_update_(ema, g, factor: Factor, table: Table, active, one_minus_decay, decay):
    """ema = (1 - decay) * factor(g) + decay * ema over each slice ``s`` with ``active[s] != 0``
    (`numbaccum.formulas.ema`); the other slices are left as they are."""
    ctype = np.result_type(ema.dtype, g.dtype)
    work, rows, items, _, _ = _work(table, False)
    if work.items.shape[0]:
        div, mul, fac, mode = driver.factor_args(factor, ctype)
        act = _on_device(active, np.uint8)
        t = ctype.type
        args = (ema, g, div, mul, fac, rows, items, act, t(one_minus_decay), t(decay), t(1))
        _launch(_ema_kernel(mode), work.items.shape[0], args)


@cached
@cuda.jit
def _axis_sums(x, jobs, job_of, out):  # pragma: no cover - compiled
    o = cuda.grid(1)
    while o < job_of.size:  # grid-stride: one sum per thread at a time
        j = job_of[o]
        acc = 0.0
        if j >= 0:
            base, K, B = jobs[j, 0], jobs[j, 2], jobs[j, 3]
            local = o - jobs[j, 4]
            a, b = local // B, local % B
            for k in range(K):  # in k order; neighbouring threads read neighbouring elements
                w = np.float64(x[base + (a * K + k) * B + b])
                acc += w * w
        out[o] = acc
        o += cuda.gridsize(1)


@through_float32()
def axis_sumsq(x, sums: AxisSums) -> np.ndarray:
    """The sums of squares of `numbaccum.tables.AxisSums` (one thread each), float64 on the
    host (0 where no job writes)."""
    if not sums.n_out:
        return np.zeros(0, np.float64)
    job_of = sums.device.get("cuda")
    if job_of is None:
        owner = np.full(sums.n_out, -1, np.int64)
        for j, (_, A, _, B, obase) in enumerate(sums.jobs.tolist()):
            owner[obase : obase + A * B] = j
        jobs = sums.jobs if sums.jobs.size else np.zeros((1, 5), np.int64)
        job_of = sums.device["cuda"] = (cuda.to_device(jobs), cuda.to_device(owner))
    out = cuda.device_array(sums.n_out, np.float64, stream=stream())
    blocks, tpb = driver.grid(sums.n_out)
    driver.LAUNCHES[0] += 1
    _axis_sums[blocks, tpb, stream()](x, job_of[0], job_of[1], out)
    return out.copy_to_host(stream=stream())


@cached
@cuda.jit
def _axis_max(x, jobs, job_of, out):  # pragma: no cover - compiled
    t = cuda.grid(1)
    while t < job_of.shape[0]:  # grid-stride: one maximum per thread at a time
        j = job_of[t, 0]
        k = job_of[t, 1]
        base, A, K, B = jobs[j, 0], jobs[j, 1], jobs[j, 2], jobs[j, 3]
        m = -math.inf
        for a in range(A):
            for b in range(B):
                m = _nan_max(m, np.float64(x[base + (a * K + k) * B + b]))
        out[t] = m
        t += cuda.gridsize(1)


@through_float32(0)
def axis_max_(out, x, maxima: AxisMaxima):
    """``out[maxima.where]`` = the maxima of `numbaccum.tables.AxisMaxima` (one thread each;
    ``out`` a host array)."""
    if not maxima.where.size:
        return
    dev = maxima.device.get("cuda")
    if dev is None:
        pairs = np.array([(j, k) for j, (_, _, K, _, _) in enumerate(maxima.jobs.tolist()) for k in range(K)])
        dev = maxima.device["cuda"] = (cuda.to_device(maxima.jobs), cuda.to_device(pairs.astype(np.int64)))
    res = cuda.device_array(maxima.where.size, np.float64, stream=stream())
    blocks, tpb = driver.grid(maxima.where.size)
    driver.LAUNCHES[0] += 1
    _axis_max[blocks, tpb, stream()](x, dev[0], dev[1], res)
    out[maxima.where] = res.copy_to_host(stream=stream())


@_by_mode
def _row_column(decl):  # pragma: no cover - compiled per declaration
    """The kernel of a `numbaccum.tables.RowColumnPass`: one block per item, a thread per
    element."""
    scaled = formulas.compile_formula(decl.scaled, _dev_inline)
    full = formulas.compile_formula(decl.full, _dev_inline)

    @cached
    @cuda.jit
    def kernel(out, g, v, meta, items, rf, cf, one, c):
        b = cuda.blockIdx.x
        r, e0, e1 = items[b, 0], items[b, 1], items[b, 2]
        base = meta[r, F_BASE]
        e = e0 + cuda.threadIdx.x
        if meta[r, F_KIND] == FACTORED:
            s0, n0, s1, n1 = meta[r, F_S0], meta[r, F_N0], meta[r, F_S1], meta[r, F_N1]
            rb, cb = meta[r, F_RBASE], meta[r, F_CBASE]
            while e < e1:
                i0, i1 = rb + _without_axis(e, s0, n0), cb + _without_axis(e, s1, n1)
                out[base + e] = scaled(g[base + e], rf[i0], cf[i1])
                e += cuda.blockDim.x
        else:
            vb = meta[r, F_VBASE]
            while e < e1:  # g in the compute dtype (float32 for float16)
                v[vb + e], out[base + e] = full(v[vb + e], g[base + e] * one, c)
                e += cuda.blockDim.x

    return kernel


@through_float32(1, 3)
def row_column_pass_(decl, out, g, v, table: FactorTable, rf, cf, scalars):
    """A `numbaccum.tables.RowColumnPass` over one dtype group (`numbaccum.tables.FactorTable`):
    one launch; the row and column statistics (host float64) are copied to the device."""
    items = table.items(_config.CUDA_REDUCE_BLOCK)
    if not items.shape[0]:
        return
    dev = table.device.get("cuda")
    if dev is None:
        dev = table.device["cuda"] = (cuda.to_device(table.meta), cuda.to_device(items))
    t = np.result_type(v.dtype, g.dtype, np.float32).type
    rf_d = cuda.to_device(
        np.ascontiguousarray(rf if np.size(rf) else np.zeros(1), np.float64), stream=stream()
    )
    cf_d = cuda.to_device(
        np.ascontiguousarray(cf if np.size(cf) else np.zeros(1), np.float64), stream=stream()
    )
    args = (out, g, v, *dev, rf_d, cf_d, t(1), tuple([t(s) for s in scalars]))
    _launch(_row_column(decl), items.shape[0], args)


@_by_mode
def _axes(decl):  # pragma: no cover - compiled per declaration
    """The kernel of a `numbaccum.tables.AxesPass`: one block per item, a thread per element,
    its axis statistics folded in axis order (the CPU's order)."""
    fold = formulas.compile_formula(decl.fold, _dev_inline)
    element = formulas.compile_formula(decl.element, _dev_inline)

    @cached
    @cuda.jit
    def kernel(out, g, nu, acc, meta, axes, items, mu, mu_new, one, c):
        b = cuda.blockIdx.x
        r, e0, e1 = items[b, 0], items[b, 1], items[b, 2]
        base, nd, first = meta[r, 0], meta[r, 2], meta[r, 3]
        e = e0 + cuda.threadIdx.x
        while e < e1:
            m = mu[axes[first, 2] + (e // axes[first, 1]) % axes[first, 0]]
            for i in range(1, nd):
                m = fold(m, mu[axes[first + i, 2] + (e // axes[first + i, 1]) % axes[first + i, 0]])
            k = base + e
            a, n, o = element(g[k] * one, m, nu[k], c)  # g in the compute dtype
            acc[k] = a
            nu[k] = n
            out[k] = o
            for i in range(nd):
                if axes[first + i, 3]:
                    mu_new[axes[first + i, 2] + (e // axes[first + i, 1]) % axes[first + i, 0]] = a
            e += cuda.blockDim.x

    return kernel


@through_float32(1, 3, 4)
def axes_pass_(decl, out, g, nu, acc, table: AxisTable, mu, scalars):
    """A `numbaccum.tables.AxesPass` over one dtype group (`numbaccum.tables.AxisTable`): one
    launch; the axis statistics (host) go to the device and come back with their ``direct``
    entries replaced."""
    items = table.items(_config.CUDA_REDUCE_BLOCK)
    if not items.shape[0]:
        return
    dev = table.device.get("cuda")
    if dev is None:
        dev = table.device["cuda"] = tuple(cuda.to_device(a) for a in (table.meta, table.axes, items))
    t = np.result_type(nu.dtype, g.dtype, np.float32).type
    host = np.array(mu if np.size(mu) else np.zeros(1), t)
    old, new = cuda.to_device(host, stream=stream()), cuda.to_device(host, stream=stream())
    args = (out, g, nu, acc, *dev, old, new, t(1), tuple([t(s) for s in scalars]))
    _launch(_axes(decl), items.shape[0], args)
    if np.size(mu):
        mu[...] = new.copy_to_host(stream=stream())


@through_float32()
def dot(x: Any, y: Any) -> float:
    """``sum(x * y)`` in float64 (complex: the real part of ``vdot``), through host copies of the
    two buffers: L-BFGS's inner products on device buffers are correct, not fast (a device
    kernel of its own is future work)."""
    a, b = x.copy_to_host(), y.copy_to_host()
    if a.dtype.kind == "c":
        a, b = a.view(a.real.dtype), b.view(b.real.dtype)
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)))
