"""The norm family over flat buffers: ``ord``, ``dim``, ``inverse_dims``, ``min_size``.

torchzero's ``ClipNorm``/``Normalize``/``Centralize`` and optax's ``centralize`` and
``adaptive_grad_clip`` all measure *slices* of each leaf (the whole leaf, its rows, its output
units, ...) and rescale or centre each slice. Here a *slicing* of a layout says, for every leaf,
which dimensions are reduced; it is built once per layout and kept, as a slice table per dtype
group (`numbaccum.cpu.slices`). A metric is then one or two segmented kernel passes over each
group's buffer, the factors are computed from the per-slice values (float64), and one more
pass scales every slice of the group. No Python loop over leaves runs on the hot path. For the
p-norms (p > 0, the common case) the factors are computed where the data lives
(`Ops.slice_rescale_`, one source for both backends: `numbaccum.tables.pnorm_factor`), so on the
GPU clip_norm and normalize never synchronise; the statistics (``'mad'``, ``'std'``, ``'var'``,
``'sum'``), p <= 0 and ``dim='global'`` bring their values to the host once per update.

The internal API that other modules use: `check_ord`, `leaf_norms` (one value per leaf) and
`tree_norm` (the global value).

Deliberate differences from torchzero (see the README's "Differences from torchzero"):
``dim=None`` reduces each leaf over all of its own dimensions; a slice whose metric is
``<= 1e-12`` or not finite is left unchanged, in the per-slice and the global modes alike; the
global ``'l0'`` counts the non-zero elements; negative dimensions count from the end in
``inverse_dims`` as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numba import njit

from . import _cache, runner
from ._bounded import Bounded
from ._checks import flag, non_negative, real
from .apply import scatter_back, writable_flat
from .backend import (
    Reductions,
    leaf_sumsq,
    ops_for,
    prepare_block_scaling,
    prepare_norm_scaling,
    slice_sumsq,
    tree_sumsq_scaled,
)
from .base import Stage, host_step
from .clipping import _Clip
from .contract import ONE, Factor, Ops
from .flat import FlatTree, as_flat, layout_of
from .layout import Layout, compute_dtype, real_dtype
from .protocol import EmptyState, GradientTransformationExtraArgs
from .tables import ACTIVE, METRIC_TINY, NSLICES, SLEN, SUMSQ_TINY, norm_pair, sum_in_order
from .traits import LEAF, TREE
from .updates import Spec, Updates

__all__ = [
    "adaptive_grad_clip",
    "centralize",
    "check_ord",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_norm",
    "leaf_norms",
    "normalize",
    "normalize_grads_",
    "scale_by_param_block_norm",
    "scale_by_param_block_rms",
    "scale_by_trust_ratio",
    "tree_norm",
    "unitwise_clip",
    "unitwise_norm",
]

# A metric at or below this (or not finite) leaves its slice unchanged: torchzero's threshold,
# where torchzero instead divides by 1 (so a tiny slice was still scaled by the target).
TINY = METRIC_TINY

_norm_pair = njit(inline="always", error_model="numpy")(norm_pair)

_NAMED_ORDS = {"l0": 0.0, "l1": 1.0, "l2": 2.0, "l3": 3.0, "l4": 4.0, "linf": math.inf}
_STATISTICS = ("mad", "std", "var", "sum")
_EMPTY = np.zeros(0, np.float64)


# --- ord ------------------------------------------------------------------------------------


def check_ord(ord: Any) -> float | str:
    """The canonical form of a norm order: a float ``p`` (``inf``, ``-inf``, ``0`` and
    fractional or negative ``p`` included; ``'l0'``..``'l4'`` and ``'linf'`` become numbers) or
    one of ``'mad'`` (mean absolute value), ``'std'``, ``'var'`` (unbiased) and ``'sum'``.

    Raises:
        ValueError: an unknown name, NaN, or anything that is not a real number.
    """
    if isinstance(ord, str):
        if ord in _NAMED_ORDS:
            return _NAMED_ORDS[ord]
        if ord in _STATISTICS:
            return ord
    elif not isinstance(ord, (bool, np.bool_)) and np.ndim(ord) == 0:
        try:
            p = float(ord)
        except (TypeError, ValueError):
            p = math.nan
        if p == p:
            return p
    names = ", ".join(repr(n) for n in (*_STATISTICS, *_NAMED_ORDS))
    raise ValueError(f"ord must be a number or one of {names}; got {ord!r}")


# --- slicings -------------------------------------------------------------------------------


class _GroupSlices(NamedTuple):
    """One dtype group cut into slices: the kernel table and per-slice host arrays."""

    rows: np.ndarray  # the slice table (see numbaccum.cpu.slices)
    slen: np.ndarray  # float64: elements per slice
    active: np.ndarray  # bool: the slice belongs to a leaf that is reduced and scaled
    any_active: bool


class _Slicing(NamedTuple):
    groups: tuple[_GroupSlices, ...]
    any_active: bool


# A chooser maps a leaf's shape to ``(shape, reduced dims)`` (the shape a 0-d leaf is measured
# as may be (1,)), or None for a leaf that is left alone.
Chooser = Callable[[tuple], "tuple[tuple, frozenset] | None"]

_SLICINGS = Bounded()  # (layout, chooser key) -> slicing


def _runs(shape: tuple, reduced: frozenset) -> tuple[list, list]:
    """The leaf's dimensions merged into runs: ``(kept, reduced)`` lists of ``(extent,
    stride)``, outermost first. Extent-1 dimensions are dropped and neighbours of one kind merge
    (C order: they are adjacent in memory)."""
    runs: list[list] = []  # [is_reduced, extent, stride], innermost first
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        e = int(shape[d])
        if e != 1:
            red = d in reduced
            if runs and runs[-1][0] == red:
                runs[-1][1] *= e
            else:
                runs.append([red, e, stride])
        stride *= e
    runs.reverse()
    return [(e, s) for r, e, s in runs if not r], [(e, s) for r, e, s in runs if r]


def _table(cuts: list) -> tuple[np.ndarray, int]:
    """The slice table of one group from ``[(base, kept, reduced, active)]`` (an empty leaf
    has its slices all the same: their reductions see no element)."""
    dk = max([len(k) for _, k, _, _ in cuts] + [1])
    dr = max([len(r) for _, _, r, _ in cuts] + [1])
    rows = np.zeros((len(cuts), 7 + 2 * dk + 2 * dr), np.int64)
    first = 0
    for i, (base, kept, red, active) in enumerate(cuts):
        kept = [(1, 1)] * (dk - len(kept)) + kept  # padding: extent 1 (its stride is never used)
        red = [(1, 1)] * (dr - len(red)) + red
        nslices = int(np.prod([e for e, _ in kept], dtype=np.int64))
        slen = int(np.prod([e for e, _ in red], dtype=np.int64))
        rows[i, :7] = (base, first, nslices, slen, int(active), dk, dr)
        rows[i, 7 : 7 + dk] = [e for e, _ in kept]
        rows[i, 7 + dk : 7 + 2 * dk] = [s for _, s in kept]
        rows[i, 7 + 2 * dk : 7 + 2 * dk + dr] = [e for e, _ in red]
        rows[i, 7 + 2 * dk + dr :] = [s for _, s in red]
        first += nslices
    rows.flags.writeable = False
    return rows, first


def _slicing(layout: Layout, key: tuple, choose: Chooser, name: str = "updates") -> _Slicing:
    """The slicing of ``layout`` by ``choose`` (cached under ``key``); ValueError naming the leaf
    when ``choose`` rejects one."""
    cache_key = (layout, key)
    hit = _SLICINGS.get(cache_key)
    if hit is not None:
        return hit
    groups = []
    for members, offsets in zip(layout.groups, layout.offsets):
        cuts: list[tuple] = []
        for j, leaf in enumerate(members):
            shape, size = layout.shapes[leaf], layout.sizes[leaf]
            try:
                chosen = choose(shape)
            except ValueError as e:
                raise ValueError(f"{layout.path(leaf, name)}: {e}") from None
            if size == 0:
                # Nothing to measure or scale; cut by ``dim`` it could still have billions of
                # (empty) slices: shape (0, 2**31) with dim=0 would make 16 GiB of slice tables.
                chosen = None
            if chosen is None:  # left alone: one contiguous slice, copied as it is
                cuts.append((int(offsets[j]), [], [(size, 1)] if size != 1 else [], False))
            else:
                kept, red = _runs(*chosen)
                cuts.append((int(offsets[j]), kept, red, True))
        rows, _ = _table(cuts)
        slen = np.repeat(rows[:, SLEN], rows[:, NSLICES]).astype(np.float64)
        active = np.repeat(rows[:, ACTIVE], rows[:, NSLICES]).astype(bool)
        groups.append(_GroupSlices(rows, slen, active, bool(active.any())))
    out = _Slicing(tuple(groups), any(g.any_active for g in groups))
    return _SLICINGS.put(cache_key, out)


def _whole_leaf(shape: tuple) -> tuple[tuple, frozenset]:
    return shape, frozenset(range(len(shape)))


_WHOLE = ("whole",)  # `_whole`'s key in `_SLICINGS`


def _whole(layout: Layout) -> _Slicing:
    """Every leaf one slice (the per-leaf and global metrics)."""
    return _slicing(layout, _WHOLE, _whole_leaf)


def _check_dim(dim: Any, name: str = "dim") -> tuple[int, ...] | str | None:
    """``dim`` as None, 'global' or a tuple of ints (``axis``: no 'global'); ValueError else."""
    if dim is None or (name == "dim" and isinstance(dim, str) and dim == "global"):
        return dim
    dims = (dim,) if not isinstance(dim, (tuple, list)) else tuple(dim)
    for d in dims:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            allowed = (
                "an int, a tuple of ints, None or 'global'" if name == "dim" else "an int or a tuple of ints"
            )
            raise ValueError(f"{name} must be {allowed}; got {dim!r}")
    return tuple(int(d) for d in dims)


def _check_min_size(min_size: Any) -> int:
    if isinstance(min_size, (bool, np.bool_)) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ValueError(f"min_size must be an int >= 0; got {min_size!r}")
    return int(min_size)


def _real_dims(nd: int, dims: tuple | None, inverse_dims: bool) -> frozenset:
    """torchzero's dimension rule with its two fixes: dimensions a leaf lacks are dropped (a
    negative one counts from the end), and ``None`` means all of the leaf's own dimensions."""
    real = frozenset(range(nd)) if dims is None else frozenset(d % nd for d in dims if -nd <= d < nd)
    return frozenset(range(nd)) - real if inverse_dims else real


def _norm_chooser(dims: tuple | None, inverse_dims: bool, min_size: int) -> Chooser:
    """The norm family's rule: a 0-d leaf counts as shape (1,); a leaf is left alone when no
    dimension is reduced or a slice has fewer than ``min_size`` elements."""

    def choose(shape: tuple) -> tuple[tuple, frozenset] | None:
        shape = shape or (1,)
        real = _real_dims(len(shape), dims, inverse_dims)
        if not real or math.prod(shape[d] for d in real) < min_size:
            return None
        return shape, real

    return choose


def _center_chooser(dims: tuple | None, inverse_dims: bool, min_size: int) -> Chooser:
    """centralize's rule: 0-d leaves and leaves of fewer than ``min_size`` elements are left
    alone (counted per leaf, so that an (n, 1) leaf is centred over its last axis as in optax)."""

    def choose(shape: tuple) -> tuple[tuple, frozenset] | None:
        real = _real_dims(len(shape), dims, inverse_dims) if shape else frozenset()
        if not real or math.prod(shape) < min_size:
            return None
        return shape, real

    return choose


def unitwise_axes(shape: tuple, axis: tuple[int, ...] | None) -> frozenset:
    """The axes `unitwise_norm` reduces (optax's rule): ``axis`` if given; else all for a leaf
    whose squeezed rank is at most 1, axis 0 for rank 2 and 3, (0, 1, 2) for rank 4 and
    (0, 1, 2, 3) for rank 5.

    Raises:
        ValueError: rank 6 or more without ``axis``, or an axis the leaf lacks.
    """
    nd = len(shape)
    if axis is not None:
        for a in axis:
            if not -nd <= a < nd:
                raise ValueError(f"axis {a} is out of bounds for shape {shape}")
        return frozenset(a % nd for a in axis)
    if sum(1 for e in shape if e != 1) <= 1:
        return frozenset(range(nd))
    if nd in (2, 3):
        return frozenset((0,))
    if nd in (4, 5):
        return frozenset(range(nd - 1))
    raise ValueError(f"expected a parameter of rank 1 to 5 (or an explicit axis), got shape {shape}")


# --- metrics --------------------------------------------------------------------------------


def _like(g: Any) -> Any:
    if isinstance(g, np.ndarray):
        return np.empty_like(g)
    from .arrays import empty

    return empty(g.size, np.dtype(g.dtype))


# A stage's kept reductions and its slot in them (`numbaccum.backend.Reductions`): a kept
# plan's per-slice reductions, prepared once for their buffers; None: the contract's calls.
Kept = tuple[Reductions, Any] | None

# The engine's kind of each per-slice reduction of the contract (`Reductions.reduce` takes kinds).
_KIND_OF = {
    Ops.slice_sum: "sum",
    Ops.slice_sumabs: "sumabs",
    Ops.slice_sumpow: "sumpow",
    Ops.slice_maxabs: "maxabs",
    Ops.slice_minabs: "minabs",
    Ops.slice_nnz: "nnz",
}


def _raw(
    g: Any,
    rows: np.ndarray,
    kernel: Any,
    centers: Any = None,
    p: float = 0.0,
    scales: Any = None,
    kept: Kept = None,
) -> np.ndarray:
    """Per slice of ``rows``: the reduction ``kernel`` (a per-slice reduction of the contract,
    e.g. ``Ops.slice_sum``) of ``(g - centers) * scales``, through ``kept`` when given (the
    plain reductions: a rescue's scaled copy is rare)."""
    if kept is not None and scales is None:
        sums, slot = kept
        if kernel is Ops.slice_sumsq:
            centred = centers is not None and np.size(centers)
            return sums.reduce(slot, "csumsq" if centred else "sumsq", g, rows, centers if centred else None)
        return sums.reduce(slot, _KIND_OF[kernel], g, rows, None, p)
    ops = ops_for(g)
    if scales is not None:  # a scaled copy first: the rare overflow rescue
        tmp = _like(g)
        ops.slice_apply_(tmp, g, rows, _EMPTY if centers is None else centers, scales)
        g, centers = tmp, None
    if kernel is Ops.slice_sumsq:
        return ops.slice_sumsq(g, rows, _EMPTY if centers is None else centers)
    if kernel is Ops.slice_sumpow:
        return ops.slice_sumpow(g, rows, p)
    return kernel(ops, g, rows)


# The reduction of the power sums of a p-norm: ``_POWER_KERNEL.get(p, Ops.slice_sumpow)``.
_POWER_KERNEL = {2.0: Ops.slice_sumsq, 1.0: Ops.slice_sumabs}


def _power_sums(
    g: Any, gs: _GroupSlices, p: float, centers: Any = None, kept: Kept = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(S, f)`` per slice: ``S = sum(|(x - c) * f| ** p)``, where ``f`` is 1 except for slices
    whose plain sum overflowed (float64 leaves above ~1e154 for p = 2): those are summed again
    scaled by a power of two below their max, so the metric is ``S ** (1 / p) / f``."""
    if p == 2 and centers is None:  # the library's one scaled sum of squares (overflow and underflow)
        return slice_sumsq(g, gs.rows) if kept is None else kept[0].sumsq(kept[1], g, gs.rows)
    kernel = _POWER_KERNEL.get(p, Ops.slice_sumpow)
    s = _raw(g, gs.rows, kernel, centers, p, None, kept)
    f = np.ones_like(s)
    if p > 0:
        over = np.isinf(s) & gs.active
        if over.any():
            m = _raw(g, gs.rows, Ops.slice_maxabs)
            fix = over & np.isfinite(m) & (m > 0)
            if fix.any():
                f[fix] = np.ldexp(1.0, -np.frexp(m[fix])[1])
                s = np.where(fix, _raw(g, gs.rows, kernel, centers, p, f), s)
    return s, f


def _root(s: Any, f: Any, p: float) -> Any:
    """The p-norm from power sums of values scaled by ``f``."""
    if p == 2:
        return np.sqrt(s) / f
    if p == 1:
        return s / f
    with np.errstate(divide="ignore"):  # a zero sum under a negative p: inf, as in NumPy
        return np.asarray(s, np.float64) ** (1.0 / p) / f


def _slice_metric(g: Any, gs: _GroupSlices, key: float | str, kept: Kept = None) -> np.ndarray:
    """The metric ``key`` (see `check_ord`) of every slice of one group, in float64 (its
    reductions through ``kept`` when given)."""
    rows, n = gs.rows, gs.slen
    with np.errstate(all="ignore"):  # empty slices and 'std' of one element give NaN: no warning
        if key == "sum":
            return _raw(g, rows, Ops.slice_sum, kept=kept)
        if key == "mad":
            return _raw(g, rows, Ops.slice_sumabs, kept=kept) / n
        if key in ("var", "std"):
            mean = _raw(g, rows, Ops.slice_sum, kept=kept) / n
            s, f = _power_sums(g, gs, 2.0, np.where(gs.active, mean, 0.0), kept)
            q = np.where(n > 1, s / (n - 1), np.nan)  # unbiased: NaN below two elements
            return np.sqrt(q) / f if key == "std" else q / f / f
        if key == math.inf:
            return _raw(g, rows, Ops.slice_maxabs, kept=kept)
        if key == -math.inf:
            return _raw(g, rows, Ops.slice_minabs, kept=kept)
        if key == 0:
            return _raw(g, rows, Ops.slice_nnz, kept=kept)
        return _root(*_power_sums(g, gs, float(key), None, kept), float(key))


def _flat_of(tree: Any, name: str = "tree") -> FlatTree:
    if isinstance(tree, FlatTree):
        return tree
    return as_flat(tree, layout_of(tree, name), name)[0]


def leaf_norms(flat: FlatTree, ord: Any = 2) -> np.ndarray:
    """The metric ``ord`` of every leaf over all of its elements: float64, one per leaf, in leaf
    order (a 0-d leaf is one element; an empty leaf gives 0, +inf for ``-inf``, NaN for
    ``'mad'``, ``'std'`` and ``'var'``). One pass (two for ``'std'``/``'var'``) per dtype group.

    Raises:
        ValueError: unknown ``ord``.
    """
    key = ord if type(ord) is float and ord == ord else check_ord(ord)  # (a stage's: checked already)
    flat = flat if isinstance(flat, FlatTree) else _flat_of(flat)
    lay = flat.layout
    if key == 2:  # the global norm's kept per-leaf sums (the same bits), unless one needs a rescue
        sums = leaf_sumsq(flat)
        for members, dt in zip(lay.group_index, lay.group_dtypes):
            s = sums[members]
            if dt.itemsize >= 8 and np.any((s == np.inf) | (s < SUMSQ_TINY)):  # `slice_sumsq`'s test
                break
        else:
            return np.sqrt(sums)
    whole = _whole(lay)
    out = np.empty(lay.num_leaves, np.float64)
    for members, g, gs in zip(flat.layout.group_index, flat.groups, whole.groups):
        out[members] = _slice_metric(g, gs, key)
    return out


def _leafwise(
    flat: FlatTree,
    kernel: Any,
    centers: float | None = None,
    p: float = 0.0,
    scale: float | None = None,
    kept: Reductions | None = None,
) -> np.ndarray:
    """Per leaf (leaf order): the reduction ``kernel`` of ``(x - centers) * scale`` over all its
    elements (``centers`` and ``scale`` one value for the whole tree; through ``kept``, a
    stage's kept reductions, when given)."""
    whole = _SLICINGS.get((flat.layout, _WHOLE)) or _whole(flat.layout)
    out = np.empty(flat.layout.num_leaves, np.float64)
    for gi, (members, g, gs) in enumerate(zip(flat.layout.group_index, flat.groups, whole.groups)):
        c = None if centers is None else np.full(members.size, centers)
        s = None if scale is None else np.full(members.size, scale)
        out[members] = _raw(g, gs.rows, kernel, c, p, s, None if kept is None else (kept, gi))
    return out


def _tree_power_sum(
    flat: FlatTree, p: float, center: float | None = None, kept: Reductions | None = None
) -> tuple[float, float]:
    """``(S, f)`` over the whole tree, leaves added in leaf order (see `_power_sums`)."""
    kernel = _POWER_KERNEL.get(p, Ops.slice_sumpow)
    if p == 2 and center is None:  # the one global L2 norm: global_norm's bits
        return tree_sumsq_scaled(flat)
    s = float(sum_in_order(_leafwise(flat, kernel, center, p, kept=kept)))
    if p > 0 and math.isinf(s):
        m = float(np.max(_leafwise(flat, Ops.slice_maxabs)))
        if math.isfinite(m) and m > 0:
            f = math.ldexp(1.0, -math.frexp(m)[1])
            return float(sum_in_order(_leafwise(flat, kernel, center, p, f))), f
    return s, 1.0


def tree_norm(flat: FlatTree, ord: Any = 2, kept: Reductions | None = None) -> float:
    """The metric ``ord`` of the whole tree (all leaves as one vector; torchzero's ``'global'``):
    p-norms from the per-leaf power sums added in leaf order, ``inf``/``-inf`` the max/min of
    ``|x|``, ``0`` (``'l0'``) the number of non-zero elements (torchzero raises
    ZeroDivisionError), ``'mad'`` ``sum|x| / n``, ``'sum'`` the signed sum, ``'std'``/``'var'``
    over all elements (unbiased, two passes). Accumulated in float64.

    ``kept``: a stage's kept reductions (`numbaccum.backend.Reductions`), or None.

    Raises:
        ValueError: unknown ``ord``.
    """
    key = ord if type(ord) is float and ord == ord else check_ord(ord)  # (a stage's: checked already)
    flat = flat if isinstance(flat, FlatTree) else _flat_of(flat)
    with np.errstate(all="ignore"):
        if key == "sum":
            return float(sum_in_order(_leafwise(flat, Ops.slice_sum, kept=kept)))
        n = flat.layout.size if isinstance(key, str) else 0  # (the statistics')
        if key == "mad":
            return float(sum_in_order(_leafwise(flat, Ops.slice_sumabs, kept=kept))) / n if n else math.nan
        if key in ("var", "std"):
            if n < 2:
                return math.nan
            mean = float(sum_in_order(_leafwise(flat, Ops.slice_sum, kept=kept))) / n
            s, f = _tree_power_sum(flat, 2.0, mean, kept)
            return math.sqrt(s / (n - 1)) / f if key == "std" else s / (n - 1) / f / f
        if key in (math.inf, -math.inf):
            per_leaf = _leafwise(flat, Ops.slice_maxabs if key > 0 else Ops.slice_minabs, kept=kept)
            if not per_leaf.size:
                return 0.0 if key > 0 else math.inf
            return float(np.max(per_leaf) if key > 0 else np.min(per_leaf))
        if key == 0:
            return float(sum_in_order(_leafwise(flat, Ops.slice_nnz, kept=kept)))
        p = float(key)
        s, f = _tree_power_sum(flat, p, None, kept)
        return s / f if p == 1 else float(_root(s, f, p))  # (`_root`'s l1, without its call)


# --- scaling the updates --------------------------------------------------------------------


class _Target(NamedTuple):
    """What a slice's metric is scaled to (`numbaccum.tables.norm_pair`): clip's bounds
    (``max_norm`` inf and ``min_norm`` 0 when unset), or normalize's ``norm_value`` (NaN for a
    clip)."""

    max_norm: float = math.inf
    min_norm: float = 0.0
    norm_value: float = math.nan


def _clip_target(max_norm: float | None, min_norm: float | None = None) -> _Target:
    """torchzero's clip: ``clamp(min_norm / n, min=1) * clamp(max_norm / n, max=1)``."""
    return _Target(math.inf if max_norm is None else max_norm, 0.0 if min_norm is None else min_norm)


def _normalize_target(norm_value: float) -> _Target:
    return _Target(norm_value=norm_value)


@_cache.cached
@njit(error_model="numpy")
def _slice_factors(metric, active, max_norm, min_norm, norm_value):  # pragma: no cover - compiled
    """``mul / div`` of `numbaccum.tables.norm_pair` per slice (1 for an inactive one)."""
    out = np.ones(metric.size, np.float64)
    for s in range(metric.size):
        if active[s]:
            div, mul = _norm_pair(metric[s], max_norm, min_norm, norm_value)
            out[s] = mul / div
    return out


def _copy_group(out: Any, g: Any) -> None:
    if out is not g:
        ops_for(g).scale_(out, g, ONE)


class _Sliced(Stage):
    """A stateless stage of the norm family. Its plan picks the slicing of the updates' layout
    (``choose``: see `_dims_spec`; a ValueError names a leaf that the choice of dimensions
    rejects) and its run measures and scales. The in-place functions (`clip_grad_norm_`, ...)
    plan and run the same stages."""

    choose: tuple | None = None  # (cache key, chooser); None: the whole tree ('global')

    @property
    def scope(self) -> str:
        """`numbaccum.traits`' scope: each slice is within a leaf; ``dim='global'``: the tree."""
        return TREE if self.choose is None else LEAF

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def slicing(self, spec: Spec) -> _Slicing | None:
        """The slicing of ``spec``'s layout (None for ``dim='global'``)."""
        choose = self.choose
        return None if choose is None else _slicing(spec.layout, choose[0], choose[1])


class _Rescale(_Sliced):
    """Each slice (or the whole tree for ``dim='global'``) becomes ``(x / div) * mul`` with
    ``(div, mul)`` the `numbaccum.tables.norm_pair` of its metric toward ``target``; a slice
    whose metric is not finite or is at most `TINY` stays as it is."""

    def __init__(self, key: float | str, choose: tuple | None, target: _Target) -> None:
        self.key, self.choose, self.target = key, choose, target

    def declare(self, spec: Spec, state: Any) -> Any:
        slicing, key, target = self.slicing(spec), self.key, self.target
        # a reduction of each slice's metric, then the scaling pass
        passes = (("reduction", "metric", 1.0, 0.0), ("kernel", "rescale", 1.0, 1.0))
        sums = Reductions()
        return host_step(
            lambda u, _: _rescale(u, key, slicing, target, sums), passes, runner.stage_name(self), settle=True
        )


def _rescale(
    u: Updates, key: float | str, slicing: _Slicing | None, target: _Target, sums: Reductions
) -> Updates:
    """`_Rescale` on settled updates; ``slicing`` None: the whole tree; ``sums`` the stage's
    kept reductions.

    A p-norm (p > 0, the common case) is one engine call per group (`Ops.slice_rescale_`): the
    factors are computed where the data lives, so on CUDA nothing comes to the host. The
    statistics (``'mad'``, ``'std'``, ``'var'``, ``'sum'``) and p <= 0 bring their per-slice
    metrics to the host for the factors."""
    flat = u.flat
    if slicing is None:
        n = tree_norm(flat, key, sums)
        d, m = norm_pair(n, *target)
        # The pending factor rides on the next kernel, as in clip_by_global_norm: (x / n) * t.
        return u if d == m else u.scaled(Factor(d, m))
    if not slicing.any_active:
        return u
    out = u.fresh()
    written = []
    for gi, (o, g, gs) in enumerate(zip(out.groups, flat.groups, slicing.groups)):
        if not gs.any_active:
            written.append(False)
        elif isinstance(key, float) and key > 0:
            written.append(sums.rescale_(gi, o, g, gs.rows, key, *target))
        else:
            metric = _slice_metric(g, gs, key, (sums, gi))
            f = _slice_factors(metric, gs.active, *target)
            scale = not np.all(f == 1.0)
            if scale:
                sums.apply_(gi, o, g, gs.rows, _EMPTY, f)
            written.append(scale)
    if not any(written):
        return u
    for o, g, w in zip(out.groups, flat.groups, written):
        if not w:
            _copy_group(o, g)
    return Updates(out, True)


def _check_max(value: Any, name: str) -> float:
    return non_negative(value, name)


def _dims_spec(kind: str, dim: Any, inverse_dims: bool, min_size: Any) -> tuple:
    """Validated ``(dims, choose)``: ``choose`` is ``(cache key, chooser)`` of the norm family
    (``kind='norm'``) or of centralize (``'center'``), None for ``dim='global'``."""
    dims = _check_dim(dim)
    size = _check_min_size(min_size)
    inverse = flag(inverse_dims, "inverse_dims")  # checked for 'global' too, which ignores it
    if dims is None or isinstance(dims, tuple):
        make = _norm_chooser if kind == "norm" else _center_chooser
        return dims, ((kind, dims, inverse, size), make(dims, inverse, size))
    return dims, None


def _norm_spec(ord: Any, dim: Any, inverse_dims: bool, min_size: Any) -> tuple:
    """Validated ``(key, dims, choose)`` of the norm family's arguments."""
    key = check_ord(ord)
    return (key, *_dims_spec("norm", dim, inverse_dims, min_size))


def clip_norm(
    max_norm: float, ord: Any = 2, dim: Any = None, inverse_dims: bool = False, min_size: int = 1
) -> GradientTransformationExtraArgs:
    """Clips the norm of each leaf (or of each slice of it, or of the whole tree) to at most
    ``max_norm`` (torchzero's ``ClipNorm``).

    ``u = g * min(1, max_norm / ||g||_ord)`` per slice, computed as ``(g / ||g||_ord) * max_norm``
    where ``||g||_ord > max_norm`` (``u = g`` otherwise).

    A slice whose metric is ``<= 1e-12`` or not finite is left unchanged (also for
    ``'global'``). The norms are reduced in float64 by segmented kernels, one pass per dtype
    group (two for ``'std'``/``'var'``), and a second pass scales every slice. On the GPU a
    p-norm's factors (p > 0, per slice) stay on the device: no synchronisation; the statistics,
    p <= 0 and ``'global'`` bring their metrics to the host (one synchronisation per update).
    Stateless.

    Args:
        max_norm: the largest norm a slice keeps (>= 0).
        ord: a number (``inf``, ``-inf``, ``0`` and fractional or negative p included) or one
            of ``'mad', 'std', 'var', 'sum', 'l0', 'l1', 'l2', 'l3', 'l4', 'linf'``.
        dim: the dimensions the norm is taken over: an int or a tuple (``1`` on a matrix: row
            norms; dimensions a leaf lacks are ignored), ``None`` (each leaf over all of its
            own dimensions) or ``'global'`` (all leaves as one vector, like
            ``clip_by_global_norm``).
        inverse_dims: take the norm over every dimension *not* in ``dim``.
        min_size: leaves whose slices have fewer elements are left unchanged (ignored for
            ``'global'``). A 0-d leaf counts as one element.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        ValueError: negative ``max_norm``, unknown ``ord``, a bad ``dim`` or ``min_size``.
        TypeError: ``max_norm`` is not a real number, or ``inverse_dims`` is not a bool.

    References:
        Pascanu, Mikolov and Bengio, "On the difficulty of training recurrent neural networks",
        ICML 2013 (arXiv:1211.5063). torchzero's ``ClipNorm``; with ``dim='global'``,
        optax.clip_by_global_norm and torch.nn.utils.clip_grad_norm_.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([[3.0, 4.0], [0.3, 0.4]])}
        >>> tx = nba.clip_norm(1.0, dim=1)  # each row's L2 norm to at most 1
        >>> updates, _ = tx.update(grads, tx.init(grads))
        >>> updates["w"].round(4).tolist()
        [[0.6, 0.8], [0.3, 0.4]]
    """
    max_norm = _check_max(max_norm, "max_norm")
    key, _, choose = _norm_spec(ord, dim, inverse_dims, min_size)
    return _Rescale(key, choose, _clip_target(max_norm)).transformation()


def normalize(
    norm_value: float = 1.0, ord: Any = 2, dim: Any = None, inverse_dims: bool = False, min_size: int = 1
) -> GradientTransformationExtraArgs:
    """Scales each leaf (or slice, or the whole tree) to the norm ``norm_value`` (torchzero's
    ``Normalize``).

    ``u = (g / ||g||_ord) * norm_value`` per slice.

    Arguments as in `clip_norm`. A slice whose metric is ``<= 1e-12`` or not finite is left
    unchanged, so zeros stay zeros (torchzero's global mode gives NaN there). Stateless.

    Args:
        norm_value: the norm every slice is scaled to (any real number; a negative one flips
            the sign).
        ord: the norm or statistic, as in `clip_norm`.
        dim: the dimensions the norm is taken over, or ``'global'``, as in `clip_norm`.
        inverse_dims: take the norm over every dimension *not* in ``dim``.
        min_size: leaves whose slices have fewer elements are left unchanged, as in `clip_norm`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        ValueError: unknown ``ord``, a bad ``dim`` or ``min_size``, or ``norm_value`` is NaN
            or infinite.
        TypeError: ``norm_value`` is not a real number, or ``inverse_dims`` is not a bool.

    References:
        Hazan, Levy and Shalev-Shwartz, "Beyond Convexity: Stochastic Quasi-Convex
        Optimization", NeurIPS 2015 (normalized gradient descent). torchzero's ``Normalize``;
        with ``dim='global'``, optax.normalize_by_update_norm (which adds ``eps`` to the norm).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([[3.0, 4.0], [0.3, 0.4]])}
        >>> tx = nba.normalize(1.0, dim=1)  # each row to L2 norm 1
        >>> updates, _ = tx.update(grads, tx.init(grads))
        >>> updates["w"].round(4).tolist()
        [[0.6, 0.8], [0.6, 0.8]]
    """
    norm_value = _check_norm_value(norm_value)
    key, _, choose = _norm_spec(ord, dim, inverse_dims, min_size)
    return _Rescale(key, choose, _normalize_target(norm_value)).transformation()


def _check_norm_value(value: Any) -> float:
    """A finite real ``norm_value``: NaN is the normalize target's "unset" (a clip without
    bounds, which would leave the updates unchanged without a word), and inf has no norm to
    scale to."""
    v = real(value, "norm_value")
    if not math.isfinite(v):
        raise ValueError(f"norm_value must be a finite real number, got {value!r}")
    return v


class _Centre(_Sliced):
    """Subtracts each slice's mean (the tree's mean for ``'global'``)."""

    def __init__(self, choose: tuple | None) -> None:
        self.choose = choose
        self.public_name = "centralize" if choose is not None else "centralize(dim='global')"

    def refuses_complex(self) -> Any:
        # optax's centralize takes complex leaves (a complex mean per slice); the whole tree's
        # mean (``dim='global'``, numbaccum's) is a float64 total: not of complex leaves.
        return self if self.choose is None else None

    def declare(self, spec: Spec, state: Any) -> Any:
        slicing = self.slicing(spec)
        passes = (("reduction", "mean", 1.0, 0.0), ("kernel", "subtract", 1.0, 1.0))
        sums = Reductions()
        return host_step(lambda u, _: _centre(u, slicing, sums), passes, runner.stage_name(self), settle=True)


def _centre(u: Updates, slicing: _Slicing | None, sums: Reductions) -> Updates:
    """`_Centre` on settled updates; ``slicing`` None: the whole tree; ``sums`` the stage's kept
    reductions."""
    flat = u.flat
    if slicing is None:
        n = flat.layout.size
        mean = float(sum_in_order(_leafwise(flat, Ops.slice_sum))) / n if n else 0.0
        if mean == 0.0:
            return u
        slicing = _whole(flat.layout)
        centers: list[np.ndarray | None] = [np.full(gs.active.size, mean) for gs in slicing.groups]
    else:
        if not slicing.any_active:
            return u
        centers = []
        for gi, (g, gs) in enumerate(zip(flat.groups, slicing.groups)):
            if not gs.any_active:
                centers.append(None)
                continue
            with np.errstate(all="ignore"):
                mean = _raw(g, gs.rows, Ops.slice_sum, kept=(sums, gi)) / gs.slen
            centers.append(np.where(gs.active, mean, 0.0))
    out = u.fresh()
    for gi, (o, g, gs, c) in enumerate(zip(out.groups, flat.groups, slicing.groups, centers)):
        if c is None:
            _copy_group(o, g)
        else:
            sums.apply_(gi, o, g, gs.rows, c, _EMPTY)
    return Updates(out, True)


def centralize(dim: Any = 0, inverse_dims: bool = True, min_size: int = 2) -> GradientTransformationExtraArgs:
    """Subtracts the mean of each slice (gradient centralization; optax's and torchzero's
    ``centralize``).

    ``u = g - mean(g, over dim)`` per slice, the mean computed in float64.

    The defaults are optax's ``centralize()`` (gradient centralization: a leaf of rank >= 2
    loses its mean over every axis but the first; vectors and scalars are unchanged);
    ``dim``/``inverse_dims`` select the reduced dimensions as in `clip_norm`, ``dim='global'``
    subtracts the mean of the whole tree. Leaves with fewer than ``min_size`` elements and 0-d
    leaves are left unchanged (``min_size`` counts a leaf's elements, so an (n, 1) leaf is
    centred over its last axis, to zeros, as optax does). The means are float64 sums of one
    segmented pass; a second pass subtracts them. Stateless.

    Args:
        dim: the dimensions kept (with ``inverse_dims``) or reduced (without): an int, a tuple,
            None (every dimension of the leaf) or ``'global'`` (the whole tree's mean).
        inverse_dims: reduce every dimension *not* in ``dim`` (the default: the mean over every
            axis but the first).
        min_size: leaves with fewer elements are left unchanged (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        ValueError: a bad ``dim`` or ``min_size``.
        TypeError: ``inverse_dims`` is not a bool.

    References:
        Yong, Huang, Hua and Zhang, "Gradient Centralization: A New Optimization Technique for
        Deep Neural Networks", ECCV 2020 (arXiv:2004.01461). optax.centralize; torchzero's
        ``Centralize``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([[1.0, 3.0], [2.0, 6.0]]), "b": np.array([1.0, 2.0])}
        >>> tx = nba.centralize()  # each row of w loses its mean; the vector b is unchanged
        >>> updates, _ = tx.update(grads, tx.init(grads))
        >>> updates["w"].tolist(), updates["b"].tolist()
        ([[-1.0, 1.0], [-2.0, 2.0]], [1.0, 2.0])
    """
    _, choose = _dims_spec("center", dim, inverse_dims, min_size)
    return _Centre(choose).transformation()


# --- optax's unit-wise clipping -------------------------------------------------------------


def _check_axis(axis: Any) -> tuple[int, ...] | None:
    if axis is None:
        return None
    checked = _check_dim(axis, "axis")
    return checked  # type: ignore[return-value]


def unitwise_norm(x: Any, axis: Any = None) -> np.ndarray:
    """The L2 norm of each output unit of ``x``, broadcast back to ``x.shape`` (optax).

    ``sqrt(sum(x ** 2, axes, keepdims=True))``, broadcast to ``x.shape``.

    The axes are ``axis`` if given, else by rank (optax's code, not its docstring): all of them
    for a leaf whose squeezed rank is at most 1, axis 0 for rank 2 and 3, (0, 1, 2) for rank 4,
    (0, 1, 2, 3) for rank 5. Accumulated in float64; the result has ``x``'s dtype.

    Args:
        x: an array (or anything ``np.asarray`` takes).
        axis: an int or a tuple of ints, the axes reduced (negative ones count from the end);
            None: the rank rule above.

    Returns:
        A new NumPy array of ``x``'s shape and dtype (float64 for a non-float ``x``), each
            element the norm of its unit.

    Raises:
        ValueError: rank 6 or more without ``axis``, an axis ``x`` lacks, or an ``axis`` that is
            not an int or a tuple of ints.

    References:
        Brock, De, Smith and Simonyan, "High-Performance Large-Scale Image Recognition Without
        Normalization", ICML 2021 (arXiv:2102.06171). optax.unitwise_norm.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> nba.unitwise_norm(np.array([[3.0, 1.0], [4.0, 0.0]])).tolist()  # column norms
        [[5.0, 1.0], [5.0, 1.0]]
    """
    axes = _check_axis(axis)
    a = np.asarray(x)
    red = tuple(sorted(unitwise_axes(a.shape, axes)))
    sq = np.sum(np.square(a, dtype=np.float64), axis=red, keepdims=True)
    return np.broadcast_to(np.sqrt(sq), a.shape).astype(a.dtype if a.dtype.kind == "f" else np.float64)


def unitwise_clip(g_norm: Any, max_norm: Any, grad: Any, div_eps: float = 1e-6) -> np.ndarray:
    """optax's unit-wise clip of arrays of one shape.

    ``where(g_norm < max_norm, grad, grad * (max_norm / max(g_norm, div_eps)))``, element by
    element.

    Args:
        g_norm: the norm of each element's unit (`unitwise_norm` of ``grad``).
        max_norm: the largest norm each element's unit may keep.
        grad: the gradient to clip.
        div_eps: the smallest divisor (it only guards against a division by zero).

    Returns:
        A NumPy array of ``grad``'s shape and dtype.

    Raises:
        ValueError: the three arrays differ in shape.

    References:
        Brock, De, Smith and Simonyan, "High-Performance Large-Scale Image Recognition Without
        Normalization", ICML 2021 (arXiv:2102.06171). optax.unitwise_clip.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> g_norm, max_norm = np.array([5.0, 1.0]), np.array([1.0, 2.0])
        >>> nba.unitwise_clip(g_norm, max_norm, np.array([3.0, 1.0])).round(4).tolist()  # 3 * 1 / 5; kept
        [0.6, 1.0]
    """
    g_norm, max_norm, grad = np.asarray(g_norm), np.asarray(max_norm), np.asarray(grad)
    if not g_norm.shape == max_norm.shape == grad.shape:
        raise ValueError(
            "g_norm, max_norm and grad must have one shape; "
            f"got {g_norm.shape}, {max_norm.shape}, {grad.shape}"
        )
    with np.errstate(all="ignore"):
        clipped = grad * (max_norm / np.maximum(g_norm, div_eps))
    return np.where(g_norm < max_norm, grad, clipped).astype(grad.dtype)


AdaptiveGradClipState = EmptyState


def adaptive_grad_clip(
    clipping: float, eps: float = 1e-3, axis: Any = None
) -> GradientTransformationExtraArgs:
    """Clips each output unit of the updates relative to the same unit of the params (optax's
    ``adaptive_grad_clip``; Brock et al. 2021).

    ``u = unitwise_clip(||g||_unit, clipping * max(||p||_unit, eps), g)``, that is ``g`` where
    ``||g|| < max_norm``, else ``g * max_norm / max(||g||, 1e-6)``, with
    ``max_norm = clipping * max(||p||_unit, eps)``.

    Units are `unitwise_norm`'s slices (``axis`` or the rank rule). The norms of updates and
    params come from segmented kernels (one pass each per dtype group), the factors are float64
    on the host, and one more pass scales the units. Stateless; ``update`` needs ``params``.

    Args:
        clipping: the largest ratio of a unit's update norm to its parameter norm (``>= 0``).
        eps: the smallest parameter norm used (so zero-initialised units can still move).
        axis: the axes of a unit's norm, for every leaf (an int or a tuple of ints); None: the
            rank rule of `unitwise_norm`.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        ValueError: ``params`` not given; a leaf of rank 6 or more without ``axis`` (naming it);
            a negative ``clipping`` or ``eps``, or an ``axis`` that is not an int or a tuple of
            ints.
        TypeError: ``clipping`` or ``eps`` is not a real number.

    References:
        Brock, De, Smith and Simonyan, "High-Performance Large-Scale Image Recognition Without
        Normalization", ICML 2021 (arXiv:2102.06171). optax.adaptive_grad_clip.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([[1.0, 0.1], [0.0, 0.0]])}
        >>> grads = {"w": np.array([[0.3, 1.0], [0.4, 0.0]])}
        >>> tx = nba.adaptive_grad_clip(0.5)  # column norms: g (0.5, 1), p (1, 0.1)
        >>> updates, _ = tx.update(grads, tx.init(params), params)
        >>> updates["w"].round(4).tolist()  # the second column clipped to 0.5 * 0.1
        [[0.3, 0.05], [0.4, 0.0]]
    """
    return _AdaptiveGradClip(clipping, eps, _check_axis(axis)).transformation()


class _AdaptiveGradClip(_Sliced):
    complex_leaves = True  # optax defines it on complex leaves: unitwise norms of |z|

    def __init__(self, clipping: Any, eps: Any, axes: tuple[int, ...] | None) -> None:
        # A negative clipping flipped the sign of every clipped unit; NaN gave NaN.
        self.clipping, self.eps = non_negative(clipping, "clipping"), non_negative(eps, "eps")

        def choose(shape: tuple) -> tuple[tuple, frozenset]:
            return shape, unitwise_axes(shape, axes)

        self.choose = (("unit", axes), choose)

    def declare(self, spec: Spec, state: Any) -> Any:
        slicing = self.slicing(spec)
        assert slicing is not None  # (``choose`` is set above: per unit, never global)
        clipping, eps = self.clipping, self.eps
        sums = Reductions()

        def run(u: Updates, params: Any) -> Updates:
            pf = params.flat()
            out = u.fresh()
            for gi, (o, g, p, gs) in enumerate(zip(out.groups, u.flat.groups, pf.groups, slicing.groups)):
                # ``o = g * _agc_factors(||p||, ||g||, ...)`` per unit, one kept call
                sums.call(gi, prepare_norm_scaling, (o, g, p, gs.rows), _agc_factors, clipping, eps)
            return Updates(out, True)

        passes = (("reduction", "unit norms of updates and params", 2.0, 0.0), ("kernel", "clip", 1.0, 1.0))
        return host_step(run, passes, "adaptive_grad_clip", params=True, settle=True)


def _agc_factors(p_norm: np.ndarray, g_norm: np.ndarray, clipping: float, eps: float) -> np.ndarray:
    """Adaptive clipping's factor per unit: 1 while ``||g|| < clipping * max(||p||, eps)``,
    else that bound over ``max(||g||, 1e-6)``."""
    max_norm = clipping * np.maximum(p_norm, eps)
    with np.errstate(all="ignore"):
        return np.where(g_norm < max_norm, 1.0, max_norm / np.maximum(g_norm, 1e-6))


# --- in place on lists or trees of arrays ---------------------------------------------------


def _in_place(grads: Any, stage: Stage) -> Any:
    """Runs the stateless ``stage`` on ``grads`` and writes the result back into its arrays (a
    FlatTree, or the ``.tree`` of one, is changed in its buffers with no copy). The stage is
    planned first: an error leaves every array as it was."""
    flat, copied = writable_flat(grads, "grads")
    state = EmptyState()
    plan = runner.ticked(stage, Spec(flat.layout, flat.device), state, None, None, {})
    assert plan is not None  # (a clip declares itself)
    result = runner.replay(plan, state, Updates(flat, True), None, True)[0].settled()
    if copied:  # scatter back into the caller's arrays
        scatter_back(result.flat, grads, "grads")
    elif result.flat is not flat:  # (owned updates are written in place: a safeguard)
        runner.copy_groups(flat, result.flat)
    return grads


def clip_grad_norm_(
    grads: Any,
    max_norm: float | None,
    ord: Any = 2,
    dim: Any = None,
    inverse_dims: bool = False,
    min_size: int = 2,
    min_norm: float | None = None,
) -> Any:
    """Clips, in place, the norm of each array of ``grads`` (a list or tree of arrays; slices
    and ``'global'`` as in `clip_norm`) into ``[min_norm, max_norm]``:

    ``g *= max(1, min_norm / n) * min(1, max_norm / n)`` with ``n = ||g||_ord`` per slice (a
    bound that is None is not applied; a slice whose ``n`` is ``<= 1e-12`` or not finite is left
    as it is).

    ``min_size=2`` (torchzero's default) leaves shape-(1,) and 0-d arrays alone. Returns
    ``grads``.

    Args:
        grads: a list or tree of writable float arrays (or a `FlatTree`), changed in place.
        max_norm: the largest norm a slice keeps (``>= 0``); None: no upper bound.
        ord: the norm or statistic, as in `clip_norm`.
        dim: the dimensions the norm is taken over, or ``'global'``, as in `clip_norm`.
        inverse_dims: take the norm over every dimension *not* in ``dim``.
        min_size: arrays whose slices have fewer elements are left unchanged.
        min_norm: the smallest norm a slice is scaled up to (``>= 0``); None: no lower bound.

    Returns:
        ``grads`` itself, its arrays changed in place.

    Raises:
        ValueError: a negative bound, unknown ``ord``, a bad ``dim`` or ``min_size`` (before any
            array is changed).
        TypeError: a leaf that cannot change in place (NumPy scalar, read-only array).

    References:
        Pascanu, Mikolov and Bengio, "On the difficulty of training recurrent neural networks",
        ICML 2013 (arXiv:1211.5063). torchzero's ``clip_grad_norm_``; with ``dim='global'``,
        torch.nn.utils.clip_grad_norm_ (which adds 1e-6 to the norm and returns it).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = [np.array([3.0, 4.0]), np.array([0.3, 0.4])]
        >>> _ = nba.clip_grad_norm_(grads, 2.0, min_norm=1.0)  # norms 5 and 0.5 into 1 .. 2
        >>> [g.round(4).tolist() for g in grads]
        [[1.2, 1.6], [0.6, 0.8]]
    """
    hi = None if max_norm is None else _check_max(max_norm, "max_norm")
    lo = None if min_norm is None else _check_max(min_norm, "min_norm")
    key, _, choose = _norm_spec(ord, dim, inverse_dims, min_size)
    return _in_place(grads, _Rescale(key, choose, _clip_target(hi, lo)))


def normalize_grads_(
    grads: Any,
    norm_value: float,
    ord: Any = 2,
    dim: Any = None,
    inverse_dims: bool = False,
    min_size: int = 1,
) -> Any:
    """Scales, in place, each array of ``grads`` (or slice, or the whole tree) to the norm
    ``norm_value``, as `normalize` does. Returns ``grads``.

    ``g *= norm_value / ||g||_ord`` per slice (a slice whose norm is ``<= 1e-12`` or not finite
    is left as it is).

    Args:
        grads: a list or tree of writable float arrays (or a `FlatTree`), changed in place.
        norm_value: the norm every slice is scaled to.
        ord: the norm or statistic, as in `clip_norm`.
        dim: the dimensions the norm is taken over, or ``'global'``, as in `clip_norm`.
        inverse_dims: take the norm over every dimension *not* in ``dim``.
        min_size: arrays whose slices have fewer elements are left unchanged.

    Returns:
        ``grads`` itself, its arrays changed in place.

    Raises:
        ValueError: unknown ``ord``, a bad ``dim`` or ``min_size``, or ``norm_value`` is NaN or
            infinite (before any array is changed).
        TypeError: a leaf that cannot change in place, or ``norm_value`` is not a real number.

    References:
        Hazan, Levy and Shalev-Shwartz, "Beyond Convexity: Stochastic Quasi-Convex
        Optimization", NeurIPS 2015 (normalized gradient descent). torchzero's
        ``normalize_grads_``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = [np.array([3.0, 4.0]), np.array([0.3, 0.4])]
        >>> _ = nba.normalize_grads_(grads, 1.0)
        >>> [g.round(4).tolist() for g in grads]
        [[0.6, 0.8], [0.6, 0.8]]
    """
    norm_value = _check_norm_value(norm_value)
    key, _, choose = _norm_spec(ord, dim, inverse_dims, min_size)
    return _in_place(grads, _Rescale(key, choose, _normalize_target(norm_value)))


def clip_grad_value_(grads: Any, value: float) -> Any:
    """Clips every element of ``grads`` (a list or tree of arrays) in place into
    ``[-value, value]``; NaN stays NaN. Returns ``grads``.

    ``g = clip(g, -value, value)``, element by element (`clip`'s stage, run in place).

    Args:
        grads: a list or tree of writable float arrays (or a `FlatTree`), changed in place.
        value: the largest magnitude an element keeps (``>= 0``).

    Returns:
        ``grads`` itself, its arrays changed in place.

    Raises:
        ValueError: a negative ``value`` (torchzero maps every element to it instead).
        TypeError: a leaf that cannot change in place, or ``value`` is not a real number.

    References:
        torch.nn.utils.clip_grad_value_; torchzero's ``clip_grad_value_``; optax.clip (not in
        place).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([3.0, -4.0, 0.5])}
        >>> _ = nba.clip_grad_value_(grads, 1.0)
        >>> grads["w"].tolist()
        [1.0, -1.0, 0.5]
    """
    return _in_place(grads, _Clip(_check_max(value, "value")))  # optax.clip's stage


# --- the trust ratio of LARS and LAMB -----------------------------------------------------------


class _ScaleByTrustRatio(Stage):
    """Each leaf's update scaled by ``trust_coefficient * ||p|| / (||u|| + eps)``: two per-leaf
    norms (one segmented reduction each per dtype group), then one per-leaf scaling pass."""

    scope = LEAF
    complex_leaves = True  # optax defines it on complex leaves (norms of |z|)
    public_name = "scale_by_trust_ratio"

    def __init__(self, min_norm: Any, trust_coefficient: Any, eps: Any) -> None:
        self.min_norm = non_negative(min_norm, "min_norm")
        self.trust = real(trust_coefficient, "trust_coefficient")
        self.eps = non_negative(eps, "eps")

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def declare(self, spec: Spec, state: Any) -> Any:
        leaves = _whole(spec.layout)
        # per group: the real dtype its ratios are rounded to
        reals = [real_dtype(compute_dtype(d)).type for d in spec.layout.group_dtypes]
        sums, ratio_args = Reductions(), (self.min_norm, self.trust, self.eps)

        def run(u: Updates, params: Any) -> Updates:
            pf = params.flat()
            out = u.fresh()
            for gi, (o, g, p, gs, t) in enumerate(
                zip(out.groups, u.flat.groups, pf.groups, leaves.groups, reals)
            ):
                # ``o = g * _trust_ratios(||p||, ||g||, ...)`` per leaf, one kept call
                sums.call(gi, prepare_norm_scaling, (o, g, p, gs.rows), _trust_ratios, *ratio_args, t)
            return Updates(out, True)

        passes = (("reduction", "leaf norms of updates and params", 2.0, 0.0), ("kernel", "scale", 1.0, 1.0))
        return host_step(run, passes, "scale_by_trust_ratio", params=True, settle=True)


def _trust_ratios(
    p_norm: np.ndarray, u_norm: np.ndarray, min_norm: float, trust: float, eps: float, t: type
) -> np.ndarray:
    """optax's ``trust * ||p|| / (||u|| + eps)`` per leaf, rounded as optax rounds it: in ``t``
    (the leaves' real compute dtype), from the float64 norms rounded to ``t`` and raised to
    ``min_norm`` (`safe_norm`), so that a float32 leaf gets optax's bits wherever the two norms
    round alike (a ratio computed in float64 differs from optax's in the last bit for about a
    third of the leaves, and LARS's momentum carries that on). Where either norm is 0, the ratio
    is 1 (the leaf would never move, or move by inf). A ratio that leaves ``t``'s range while the
    float64 one does not (norms above float32's largest value, which optax's float32 sums reach
    even sooner) is the float64 ratio rounded to ``t``: a finite number is not given up for an
    inf. Returned as float64 holding ``t``'s values (the scaling pass multiplies in float64: one
    rounding of an exact product, ``t``'s own product)."""
    with np.errstate(all="ignore"):
        lo = t(min_norm)
        pt: np.ndarray = p_norm.astype(t)
        ut: np.ndarray = u_norm.astype(t)
        pn, un = np.where(pt <= lo, lo, pt), np.where(ut <= lo, lo, ut)  # optax's safe_norm
        ratio = t(trust) * pn / (un + t(eps))
        p64, u64 = np.maximum(p_norm, min_norm), np.maximum(u_norm, min_norm)
        wide = (trust * p64 / (u64 + eps)).astype(t)
    ratio = np.where(np.isfinite(ratio) | ~np.isfinite(wide), ratio, wide)
    return np.where((pn == 0.0) | (un == 0.0), 1.0, ratio.astype(np.float64))


def scale_by_trust_ratio(
    min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0
) -> GradientTransformationExtraArgs:
    """Scales each leaf's update by its trust ratio, the ratio of the param's norm to the
    update's (LARS, LAMB).

    ``u = g * trust_coefficient * ||p|| / (||g|| + eps)`` per leaf, with each L2 norm raised to
    ``min_norm`` where it is at or below it (optax's ``safe_norm``) and a ratio of 1 where either
    norm is 0 (the leaf would never move, or move by inf). The norms accumulate in float64 (one
    segmented reduction per dtype group for each); the scaling is one pass. Needs ``params``.
    Stateless.

    Args:
        min_norm: the smallest norm either is taken to have (``>= 0``).
        trust_coefficient: multiplies the ratio.
        eps: added to the update's norm (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        TypeError: a hyperparameter is not a real number.
        ValueError: ``min_norm`` or ``eps`` is negative or NaN; at an update, no ``params``.

    References:
        You et al., "Large Batch Training of Convolutional Networks", 2017 (arXiv:1708.03888);
        You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
        ICLR 2020 (arXiv:1904.00962). optax.scale_by_trust_ratio.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([3.0, 4.0]), "b": np.zeros(2)}
        >>> tx = nba.scale_by_trust_ratio()
        >>> u, _ = tx.update({"w": np.array([0.6, 0.8]), "b": np.ones(2)}, tx.init(params), params)
        >>> u["w"].round(6).tolist(), u["b"].tolist()  # ||p|| / ||g|| = 5; b: ||p|| = 0, ratio 1
        ([3.0, 4.0], [1.0, 1.0])
    """
    return _ScaleByTrustRatio(min_norm, trust_coefficient, eps).transformation()


class _ScaleByParamBlock(Stage):
    """`scale_by_param_block_norm` (``rms=False``) and `scale_by_param_block_rms`: each leaf's
    update times its param's L2 norm (or root mean square), at least ``min_scale``: one
    segmented reduction per dtype group, one per-leaf scaling pass."""

    scope = LEAF
    complex_leaves = True  # optax's norms of |p|

    def __init__(self, min_scale: Any, rms: bool) -> None:
        self.min_scale = non_negative(min_scale, "min_scale")
        self.rms = rms

    @property
    def public_name(self) -> str:  # type: ignore[override]
        return "scale_by_param_block_rms" if self.rms else "scale_by_param_block_norm"

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def declare(self, spec: Spec, state: Any) -> Any:
        leaves = _whole(spec.layout)
        min_scale, sums = self.min_scale, Reductions()
        # per group: each leaf's sqrt(size), the RMS's divisor (None: the L2 norm itself)
        roots = [np.sqrt(np.diff(o).astype(np.float64)) if self.rms else None for o in spec.layout.offsets]

        def run(u: Updates, params: Any) -> Updates:
            pf = params.flat()
            out = u.fresh()
            for gi, (o, g, p, gs, r) in enumerate(
                zip(out.groups, u.flat.groups, pf.groups, leaves.groups, roots)
            ):
                # ``o = g * max(||p||, min_scale)`` per leaf (its RMS with ``rms``), one kept call
                sums.call(gi, prepare_block_scaling, (o, g, p, gs.rows), _block_scales, r, min_scale)
            return Updates(out, True)

        passes = (("reduction", "leaf norms of params", 1.0, 0.0), ("kernel", "scale", 1.0, 1.0))
        return host_step(run, passes, self.public_name, params=True, settle=True)


def _block_scales(norm: np.ndarray, roots: np.ndarray | None, min_scale: float) -> np.ndarray:
    """optax's ``safe_norm`` (``roots`` None) or ``safe_root_mean_squares`` per leaf: the L2 norm
    (divided by ``roots``, each leaf's sqrt(size)), ``min_scale`` at or below it."""
    if roots is not None:
        with np.errstate(divide="ignore", invalid="ignore"):  # an empty leaf: NaN, as jnp.mean
            norm = norm / roots
    return np.where(norm <= min_scale, min_scale, norm)


def scale_by_param_block_norm(min_scale: float = 1e-3) -> GradientTransformationExtraArgs:
    """Scales each leaf's update by the L2 norm of its param (a block: a weight vector or
    matrix): ``u = g * max(||p||, min_scale)`` (optax's ``safe_norm``: ``min_scale`` at or below
    it). The norms accumulate in float64 (one segmented reduction per dtype group); the scaling
    is one pass. Needs ``params``. Stateless.

    Args:
        min_scale: the smallest norm a block is taken to have (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        TypeError: ``min_scale`` is not a real number.
        ValueError: ``min_scale`` is negative or NaN; at an update, no ``params``.

    References:
        optax.scale_by_param_block_norm (the block scaling of Fromage and LAMB-style methods).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([3.0, 4.0]), "b": np.zeros(2)}
        >>> tx = nba.scale_by_param_block_norm()
        >>> u, _ = tx.update({"w": np.ones(2), "b": np.ones(2)}, tx.init(params), params)
        >>> u["w"].tolist(), u["b"].tolist()  # ||w|| = 5; ||b|| = 0: min_scale
        ([5.0, 5.0], [0.001, 0.001])
    """
    return _ScaleByParamBlock(min_scale, rms=False).transformation()


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformationExtraArgs:
    """Scales each leaf's update by the root mean square of its param: ``u = g *
    max(sqrt(mean(p^2)), min_scale)`` (optax's ``safe_root_mean_squares``). One segmented
    reduction per dtype group (float64), one scaling pass. Needs ``params``. Stateless.

    Args:
        min_scale: the smallest RMS a block is taken to have (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``EmptyState()``.

    Raises:
        TypeError: ``min_scale`` is not a real number.
        ValueError: ``min_scale`` is negative or NaN; at an update, no ``params``.

    References:
        optax.scale_by_param_block_rms.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([3.0, 4.0])}  # rms = sqrt(12.5)
        >>> tx = nba.scale_by_param_block_rms()
        >>> u, _ = tx.update({"w": np.ones(2)}, tx.init(params), params)
        >>> [round(float(x), 4) for x in u["w"]]
        [3.5355, 3.5355]
    """
    return _ScaleByParamBlock(min_scale, rms=True).transformation()
