"""The one dispatch point: the kernel contract (`numbaccum.contract.Ops`) for a buffer's backend.

``ops_for(buffer)`` is how a transformation reaches kernels: the CPU backend for NumPy arrays,
the CUDA backend for device arrays. Each backend is three modules with the same primitives --
``driver`` (compiles the formulas: `map_`), ``reduce`` (the one reduction engine) and
``per_example`` -- that `Ops` holds by name, so a reader can follow a call from a transformation
to the contract, and from there to the formula and the driver. ``numba.cuda`` is imported only
when a CUDA array is seen, with one clear error if it cannot compile kernels here.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from . import _config
from ._bounded import Bounded
from ._loans import lent_moved
from .arrays import is_cuda_array
from .contract import Ops, may_rescue
from .layout import real_dtype
from .tables import (
    ACTIVE,
    NSLICES,
    SLEN,
    SUM,
    SUMSQ_TINY,
    as_table,
    combine,
    needs_scaling,
    norm_scale,
    segments,
    sum_in_order,
)

__all__ = [
    "PiecewiseSumsq",
    "Reductions",
    "leaf_sumsq",
    "leaf_tables",
    "ops_for",
    "prepare_block_scaling",
    "prepare_norm_scaling",
    "prepare_reduce",
    "prepare_weighted_sum",
    "slice_sumsq",
    "tree_sumsq",
    "tree_sumsq_scaled",
]

_F64 = np.dtype(np.float64)

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


def device_leaf_copies() -> Any:
    """`numbaccum.cuda.leaves`: packing and scattering a tree of separate CUDA arrays over a
    table of their addresses (the one door to it, like `ops_for`)."""
    from .cuda.device import cuda_module

    cuda_module()
    from .cuda import leaves

    return leaves


# --- the one global norm: every API that needs a tree's sum of squares takes it here -----------
#
# The plain float64 sum of squares is the fast path (one pass); `numbaccum.tables.needs_scaling`
# says when it cannot be trusted (float64 elements past ~1e154 overflow it, below ~1e-154
# underflow in it), and then the few slices concerned are summed again as sum((x * f) ** 2), with
# ``f`` a power of two from their max |x| (`numbaccum.tables.norm_scale`): the norm is
# ``sqrt(s) / f``, finite whenever it is representable. float32 and float16 elements never need
# it (their squares fit float64 with room to spare).


def slice_sumsq(x: Any, table: Any, s: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """``(s, f)`` per slice of ``table``: ``s = sum((x * f) ** 2)`` in float64, ``f`` 1 (the
    plain sum, the common case) or the power of two that rescued an overflowed or underflowed
    slice; the slice's L2 norm is ``sqrt(s) / f``. An inf or NaN element keeps the plain sum (inf
    or NaN), as before. ``s``: the plain sums, when already taken (`Reductions.sumsq`)."""
    if s is None:
        s = ops_for(x).slice_sumsq(x, as_table(table))
    f = np.ones_like(s)
    if np.dtype(x.dtype).itemsize < 8 or not s.size:  # float32/16: the plain sum is exact enough
        return s, f
    bad = (s == np.inf) | (s < SUMSQ_TINY)
    if not bad.any():
        return s, f
    table = as_table(table)  # (a raw table's: cached)
    rows = table.rows
    row_of = np.repeat(np.arange(rows.shape[0]), rows[:, NSLICES])  # slices are numbered row by row
    bad &= ((rows[:, ACTIVE] != 0) & (rows[:, SLEN] > 0))[row_of]  # empty and inactive: 0 is right
    if not bad.any():
        return s, f
    ops = ops_for(x)
    sub = table.only(np.bincount(row_of[bad], minlength=rows.shape[0]) > 0)  # read only those rows
    m = ops.slice_maxabs(x, sub)
    fix = bad & np.isfinite(m) & (m > 0)
    if fix.any():
        f[fix] = [norm_scale(v) for v in m[fix]]
        s = np.where(fix, ops.slice_sumsq_scaled(x, sub, f), s)
    return s, f


class Reductions:
    """Per-slice reductions and scalings kept across steps, as `numbaccum.fuse.Launches` keeps
    elementwise launches: per caller's slot, the engine's call prepared for the very buffers and
    table it was last given (`numbaccum.cpu.reduce.prepare`), prepared again when they change.
    The same kernels, items and combine as the `Ops` calls they replace: the same bits, without
    the Python dispatch of every call (a small tree's per-slice stage is mostly that). A
    stage's declared part keeps one. A CUDA buffer takes the contract's call each time."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: dict = {}  # (slot, kind) -> (buffers, prepared run, the entry before or None)

    def reduce(
        self, slot: Any, kind: str, x: Any, table: Any, centers: Any = None, p: float = 0.0
    ) -> np.ndarray:
        """Per slice of ``table``: the engine's reduction ``kind`` of ``x`` (``'sumsq'``,
        ``'csumsq'`` with ``centers``, ``'sum'``, ...), as `Ops`' ``slice_*`` give it."""
        key, buffers = (slot, kind), (x, table)
        last = self.last.get(key)
        if last is not None and last[0][0] is x and last[0][1] is table:
            return last[1](centers, p)
        return self._miss(key, last, buffers, prepare_reduce, kind, x, table)(centers, p)

    def sumsq(self, slot: Any, x: Any, table: Any) -> tuple[np.ndarray, np.ndarray]:
        """`slice_sumsq`'s ``(s, f)``, its plain pass kept (the rare rescue is not)."""
        return slice_sumsq(x, table, self.reduce(slot, "sumsq", x, table))

    def apply_(self, slot: Any, out: Any, x: Any, table: Any, centers: Any, factors: Any) -> None:
        """`Ops.slice_apply_`: ``out = (x - centers[s]) * factors[s]`` over every slice (None
        or empty: 0 and 1)."""
        key, buffers = (slot, "apply"), (x, table, out)
        last = self.last.get(key)
        if last is not None and all(map(operator.is_, last[0], buffers)):
            run = last[1]
        else:
            run = self._miss(key, last, buffers, _prepare_apply, out, x, table)
        run(_NO_VALUES if centers is None else centers, _NO_VALUES if factors is None else factors)

    def rescale_(self, slot: Any, out: Any, x: Any, table: Any, p: float, *target: float) -> bool:
        """`Ops.slice_rescale_` (``target``: its ``max_norm, min_norm, norm_value``): whether
        ``out`` was written."""
        key, buffers = (slot, "rescale", p), (x, table, out)
        last = self.last.get(key)
        if last is not None and all(map(operator.is_, last[0], buffers)):
            return bool(last[1](*target))
        return bool(self._miss(key, last, buffers, _prepare_rescale, out, x, table, p)(*target))

    def call(self, slot: Any, prepare: Any, buffers: tuple, *args: Any) -> Any:
        """``prepare(*buffers)(*args)``: the run `prepare` gives (`prepare_divide`,
        `prepare_ema`, `prepare_axis_sumsq`, `prepare_axis_max`, `prepare_row_column`,
        `prepare_axes`) kept under the caller's ``slot`` while ``buffers`` are the very objects
        it was prepared for, prepared again when one changes."""
        key = (slot, prepare)
        last = self.last.get(key)
        if last is not None:  # inline tests of the last run and the one before (`_miss`)
            if all(map(operator.is_, last[0], buffers)):
                return last[1](*args)
            before = last[2]
            if before is not None and all(map(operator.is_, before[0], buffers)):
                return before[1](*args)
        return self._miss(key, last, buffers, prepare, *buffers)(*args)

    def _miss(self, key: Any, last: tuple | None, buffers: tuple, prepare: Any, *how: Any) -> Any:
        """The run for ``buffers`` when the last one kept under ``key`` is for others: the one
        before it if that one is for these (the loop holding its last updates writes a
        workspace and its spare by turns: both stay prepared, `numbaccum._loans.lent_moved`),
        else ``prepare(*how)``, kept."""
        if last is not None:
            before = last[2]
            if before is not None and all(map(operator.is_, before[0], buffers)):
                return before[1]
        run = prepare(*how)
        before = (last[0], last[1], None) if last is not None and lent_moved(last[0], buffers) else None
        self.last[key] = (buffers, run, before)
        return run

    def dot(self, slot: Any, x: Any, y: Any) -> float:
        """`Ops.dot`: ``sum(x * y)`` in float64, in its fixed order (the host engine's
        `numbaccum.cpu.reduce.prepare_dot`; on CUDA the contract's call)."""
        key, buffers = (slot, "dot"), (x, y)
        last = self.last.get(key)
        if last is not None and last[0][0] is x and last[0][1] is y:
            return last[1]()
        return self._miss(key, last, buffers, _prepare_dot, x, y)()


def prepare_reduce(kind: str, x: Any, table: Any) -> Any:
    """``run(centers, p)``: the host engine's prepared reduction; on CUDA the engine's call."""
    engine, table = ops_for(x).reduce, as_table(table)
    if isinstance(x, np.ndarray):
        return engine.prepare(kind, x, table)
    return lambda centers=None, p=0.0: engine.reduce(kind, x, table, centers, p)


def _prepare_dot(x: Any, y: Any) -> Any:
    """``run()``: the host engine's prepared `Ops.dot`; on CUDA the contract's call."""
    ops = ops_for(x)
    return ops.reduce.prepare_dot(x, y) if isinstance(x, np.ndarray) else lambda: ops.dot(x, y)


def prepare_weighted_sum(out: Any, g: Any, offsets: Any, out_offsets: Any, init: Any) -> Any:
    """``run(mult, noise, std, div, limit)``: `Ops.batch_weighted_sum_` over these buffers (the
    sum from ``init``, or from 0 when None), for `Reductions.call`: the host engine's prepared
    sum (`numbaccum.cpu.per_example.prepare_weighted_sum`); on CUDA the contract's call."""
    ops = ops_for(g)
    if isinstance(g, np.ndarray):
        return ops.per_example.prepare_weighted_sum(out, g, offsets, out_offsets, init)
    return lambda mult, noise, std, div, limit: ops.batch_weighted_sum_(
        out, g, offsets, out_offsets, mult, noise, std, div, limit, init
    )


def _prepare_rescale(out: Any, x: Any, table: Any, p: float) -> Any:
    """``run(max_norm, min_norm, norm_value)``: the host engine's prepared
    `Ops.slice_rescale_`; on CUDA the contract's call."""
    ops, table = ops_for(x), as_table(table)
    if isinstance(x, np.ndarray):
        return ops.reduce.prepare_rescale(out, x, table, p, may_rescue(p, x))
    return lambda *target: ops.slice_rescale_(out, x, table, p, *target)


def _prepare_apply(out: Any, x: Any, table: Any) -> Any:
    """``run(centers, factors)``: the host engine's prepared `Ops.slice_apply_`; on CUDA the
    contract's call."""
    ops, table = ops_for(x), as_table(table)
    if isinstance(x, np.ndarray):
        return ops.reduce.prepare_apply(out, x, table)
    return lambda centers, factors: ops.slice_apply_(out, x, table, centers, factors)


_NO_VALUES = np.zeros(0, np.float64)  # an absent per-slice argument (centres 0, factors 1)


def prepare_norm_scaling(out: Any, x: Any, y: Any, table: Any, x_norm: bool = True) -> Any:
    """``run(factors_of, *args)``: ``out = x * factors_of(||y||, ||x||, *args)`` over every slice
    of ``table`` (`Ops.slice_apply_`), both L2 norms per slice in float64 as `slice_sumsq` gives
    them (its rescue included): the trust ratio's and adaptive clipping's step of one group, in
    one kept call (`Reductions.call`); without ``x_norm``, ``factors_of(||y||, *args)`` (a param
    block's scale). The host engine's two sums of squares are one prepared call
    (`numbaccum.cpu.reduce.prepare_pair`), the scaling `prepare_apply`'s: the same kernels and
    items as `Reductions.sumsq` and `Reductions.apply_`, the same bits. On CUDA the contract's
    calls."""
    ops, t = ops_for(x), as_table(table)
    engine = ops.reduce
    if not x_norm:
        one = prepare_reduce("sumsq", y, t)

        def sums() -> tuple[np.ndarray, np.ndarray | None]:
            return one(None, 0.0), None

    elif isinstance(x, np.ndarray):
        sums = engine.prepare_pair("sumsq", y, x, t)
    else:

        def sums() -> tuple[np.ndarray, np.ndarray | None]:
            return engine.reduce("sumsq", y, t, None, 0.0), engine.reduce("sumsq", x, t, None, 0.0)

    apply = _prepare_apply(out, x, table)
    # (float64 buffers: `slice_sumsq`'s rescue)
    wide_y, wide_x = np.dtype(y.dtype).itemsize >= 8, np.dtype(x.dtype).itemsize >= 8

    def run(factors_of: Any, *args: Any) -> None:
        sy, sx = sums()
        # (inline: `slice_sumsq`'s test of a float64 buffer's plain sums)
        ny = _l2(y, t, sy) if wide_y and ((sy == np.inf) | (sy < SUMSQ_TINY)).any() else np.sqrt(sy)
        if sx is None:
            apply(_NO_VALUES, factors_of(ny, *args))
            return
        nx = _l2(x, t, sx) if wide_x and ((sx == np.inf) | (sx < SUMSQ_TINY)).any() else np.sqrt(sx)
        apply(_NO_VALUES, factors_of(ny, nx, *args))

    return run


def prepare_block_scaling(out: Any, x: Any, y: Any, table: Any) -> Any:
    """`prepare_norm_scaling` with ``y``'s norm only: ``run(factors_of, *args)`` writes
    ``out = x * factors_of(||y||, *args)`` (`numbaccum.scale_by_param_block_norm`'s step)."""
    return prepare_norm_scaling(out, x, y, table, x_norm=False)


def _l2(x: Any, table: Any, s: np.ndarray) -> np.ndarray:
    """The L2 norm per slice from the plain sums ``s`` of ``x``, rescued where `slice_sumsq`
    rescues them."""
    with np.errstate(all="ignore"):
        s, f = slice_sumsq(x, table, s)
        return np.sqrt(s) / f


# What `Reductions.call` keeps: the host engine's prepared entry (`numbaccum.cpu.reduce`'s
# ``prepare_*``), or on a CUDA buffer the contract's call each time.


def prepare_divide(out: Any, x: Any, table: Any) -> Any:
    """``run(factor, divisors)``: `Ops.slice_divide_` of these buffers."""
    ops = ops_for(x)
    if isinstance(x, np.ndarray):
        return ops.reduce.prepare_divide(out, x, as_table(table))
    return lambda factor, divisors: ops.slice_divide_(out, x, factor, table, divisors)


def prepare_ema(ema: Any, g: Any, table: Any) -> Any:
    """``run(factor, active, one_minus_decay, decay)``: `Ops.slice_ema_update_` of these
    buffers."""
    ops = ops_for(g)
    if isinstance(g, np.ndarray):
        return ops.reduce.prepare_ema(ema, g, as_table(table))
    return lambda factor, *rest: ops.slice_ema_update_(ema, g, factor, table, *rest)


def prepare_axis_sumsq(x: Any, sums: Any) -> Any:
    """``run()``: `Ops.axis_sumsq` of this buffer."""
    ops = ops_for(x)
    if isinstance(x, np.ndarray):
        return ops.reduce.prepare_axis_sumsq(x, sums)
    return lambda: ops.axis_sumsq(x, sums)


def prepare_axis_max(out: Any, x: Any, maxima: Any) -> Any:
    """``run()``: `Ops.axis_max_` of these buffers."""
    ops = ops_for(x)
    if isinstance(x, np.ndarray):
        return ops.reduce.prepare_axis_max(out, x, maxima)
    return lambda: ops.axis_max_(out, x, maxima)


def prepare_row_column(decl: Any, out: Any, g: Any, v: Any, table: Any) -> Any:
    """``run(rf, cf, scalars)``: `Ops.row_column_pass_` of these buffers."""
    ops = ops_for(g)
    if isinstance(g, np.ndarray):
        return ops.reduce.prepare_row_column(decl, out, g, v, table)
    return lambda rf, cf, scalars: ops.row_column_pass_(decl, out, g, v, table, rf, cf, scalars)


def prepare_axes(decl: Any, out: Any, g: Any, nu: Any, acc: Any, table: Any, mu: Any) -> Any:
    """``run(scalars)``: `Ops.axes_pass_` of these buffers."""
    ops = ops_for(g)
    if isinstance(g, np.ndarray):
        return ops.reduce.prepare_axes(decl, out, g, nu, acc, table, mu)
    return lambda scalars: ops.axes_pass_(decl, out, g, nu, acc, table, mu, scalars)


def leaf_sumsq(flat: Any) -> np.ndarray:
    """sum(x ** 2) of every leaf of a `numbaccum.flat.FlatTree`, float64 in leaf order (one
    engine call per dtype group, each leaf one slice): the plain sums, the fast path."""
    lay = flat.layout
    if not flat.device:  # the host engine's calls, laid out once per layout (and block size)
        key = (lay, _config.REDUCE_BLOCK)
        runs = _HOST_SUMSQ.get(key)
        if runs is None:
            tables = leaf_tables(lay)
            runs = _HOST_SUMSQ.put(
                key, [ops_for(g).reduce.prepared("sumsq", t) for g, t in zip(flat.groups, tables)]
            )
        if len(runs) == 1:  # one dtype: its slices are the leaves, in order
            return runs[0](flat.groups[0])
        out = np.empty(lay.num_leaves, np.float64)
        for members, run, g in zip(lay.group_index, runs, flat.groups):
            out[members] = run(g)
        return out
    out = np.empty(lay.num_leaves, np.float64)
    for members, table, g in zip(lay.group_index, leaf_tables(lay), flat.groups):
        out[members] = ops_for(g).slice_sumsq(g, table)
    return out


_HOST_SUMSQ = Bounded()  # (layout, block) -> per group, the engine's sumsq prepared (cpu.reduce)


def leaf_tables(lay: Any) -> list:
    """One segments table per group of layout ``lay`` (each leaf a slice), cached per layout."""
    tables = _LEAF_TABLES.get(lay)
    if tables is None:  # once per layout: a small tree's whole update costs microseconds
        tables = _LEAF_TABLES.put(lay, [segments(offsets) for offsets in lay.offsets])
    return tables


_LEAF_TABLES = Bounded()  # layout -> one segments table per group (each leaf a slice)


def tree_sumsq(flat: Any) -> float:
    """The plain squared global L2 norm of a tree: `leaf_sumsq` added in leaf order from 0.0
    (inf past float64's range: the squared norm is then not representable)."""
    return float(sum_in_order(leaf_sumsq(flat)))


def tree_sumsq_scaled(flat: Any) -> tuple[float, float]:
    """``(s, f)``: the squared global L2 norm of ``flat`` is ``s / f**2``, its norm
    ``sqrt(s) / f`` (`numbaccum.global_norm`).

    The one definition: `numbaccum.global_norm`, ``norms.tree_norm(t, 2)``, ``clip_norm(...,
    dim='global')``, clip_by_global_norm (and its device twin, `Ops.global_norm_finish_`),
    normalize_by_update_norm and skip_large_updates all take it, so they agree bit for bit.
    ``f`` is 1 and ``s`` the plain `tree_sumsq` unless that `needs_scaling`; then each float64
    group whose own plain total needs it is summed again, its leaves scaled by one power of two
    ``f_g`` from the group's max |x|, and ``s = sum_k s_k * (F / f_k) ** 2`` in leaf order over
    the non-zero leaves, ``F`` the least of their ``f_k`` (the other leaves keep their plain sums
    and ``f_k = 1``). `numbaccum.tables.rescued_norm` is the same sum, on the device too."""
    sums = leaf_sumsq(flat)
    total = float(sum_in_order(sums))
    if not needs_scaling(total):
        return total, 1.0
    scaled, scale = _rescued(flat, sums)
    nonzero = scaled != 0  # zero leaves have no magnitude to rescale to (and 0 * inf is NaN)
    big = float(scale[nonzero].min()) if nonzero.any() else 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        r = big / scale
        terms = np.where(nonzero, scaled * r * r, 0.0)
    return float(sum_in_order(terms)), big


def sumsq_of_leaves(lay: Any, sums: np.ndarray) -> float | None:
    """The squared global L2 norm `tree_sumsq_scaled` gives (with ``f`` 1) for a tree of layout
    ``lay`` whose plain per-leaf sums (`leaf_sumsq`) are ``sums``, without reading the tree; None
    when it would rescue a float64 group (which reads the tree again: ask `tree_sumsq_scaled`).
    Without a rescued group its sum over the leaves is the plain one (zero leaves keep 0)."""
    total = float(sum_in_order(sums))
    if not needs_scaling(total):
        return total
    for members, dt in zip(lay.group_index, lay.group_dtypes):
        if real_dtype(dt) == _F64 and needs_scaling(float(sum_in_order(sums[members]))):
            return None
    return total


class PiecewiseSumsq:
    """`leaf_sumsq` of ``factor(x)`` for one host group (float32 or float64) of a layout, while
    its buffer arrives in pieces (a collective's buckets): `feed` reduces the engine's items
    whose elements have all arrived, while they are in cache; `finish` gives the group's
    per-leaf sums, the bits of `leaf_sumsq` over the settled group: the same items and
    partials, combined in the same order (`numbaccum.cpu.reduce.by_items`, reading each
    element through the factor and rounding it as `Updates.settled` would write it)."""

    # Items reduced between two calls of ``between`` (a collective's progress: MPICH moves a
    # non-blocking message on only inside MPI calls): 16 items of `_config.REDUCE_BLOCK`
    # elements, a few MiB, a millisecond or so.
    BATCH = 16

    def __init__(self, lay: Any, gi: int, x: np.ndarray) -> None:
        table = leaf_tables(lay)[gi]
        self.work, self.run = ops_for(x).reduce.by_items("qsumsq", table)
        items = self.work.items
        # A segments table's item covers elements [base + e0, base + e1) of its row's leaf.
        self.ends = table.rows[items[:, 0], 0] + items[:, 4]
        self.centers = np.empty(table.nslices, np.float64)  # the factor's div, per slice
        self.part = np.empty(self.work.nparts, np.float64)
        self.done, self.mul = 0, 1.0

    def start(self, div: float, mul: float) -> None:
        """A new sum, of the values ``(x / div) * mul``."""
        self.centers.fill(div)
        self.done, self.mul = 0, mul

    def feed(self, x: np.ndarray, upto: int, between: Any = None) -> None:
        """Reduces every item not yet reduced whose elements lie below ``upto`` (they have
        arrived), ``between()`` called between batches of items."""
        stop = int(np.searchsorted(self.ends, upto, "right"))
        b = self.done
        while b < stop:
            e = min(stop, b + self.BATCH)
            self.run(x, b, e, self.part, self.centers, self.mul)
            b = e
            if between is not None and b < stop:
                between()
        self.done = stop

    def finish(self) -> np.ndarray:
        """The group's per-leaf sums of squares, float64 (every item fed)."""
        assert self.done == self.ends.size, "PiecewiseSumsq: not every element arrived"
        return combine(self.part, self.work.pslice, SUM)


def _rescued(flat: Any, sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per leaf ``(s_k, f_k)``: the plain sums, except in float64 groups whose total
    `needs_scaling` (the host twin of the device kernel's rescue in `Ops.global_norm_finish_`)."""
    lay = flat.layout
    scaled, scale = sums.copy(), np.ones_like(sums)
    for members, table, g in zip(lay.group_index, leaf_tables(lay), flat.groups):
        # float64 parts only (float64, complex128): a 32-bit part's square never leaves float64's range
        if real_dtype(g.dtype) != _F64 or not needs_scaling(float(sum_in_order(sums[members]))):
            continue
        ops = ops_for(g)
        per_leaf = ops.slice_maxabs(g, table)
        m = float(np.max(per_leaf)) if per_leaf.size else 0.0  # NaN if any is NaN
        if math.isfinite(m) and m > 0:
            f = norm_scale(m)
            scaled[members] = ops.slice_sumsq_scaled(g, table, np.full(members.size, f))
            scale[members] = f
    return scaled, scale
