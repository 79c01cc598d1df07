"""Per-example gradient clipping and differentially private aggregation (DP-SGD).

Per-example gradients come as a tree whose leaves carry the batch on axis 0: leaf ``k`` has shape
``(B, *s_k)``. In a flat buffer that leaf is ``B`` contiguous runs of ``D_k = prod(s_k)`` elements,
one per example, so whatever the number of leaves the work is two passes over the batch:

1. one `segment_sumsq` per dtype group over the table of (leaf, example) runs gives every squared
   norm ``n2[k, b]`` (float64, fixed partition: the same bits for any thread count);
2. the host turns those few numbers into multipliers ``m[k, b]``, and one `batch_weighted_sum_`
   per dtype group writes ``sum_b m[k, b] * g[k][b]`` (float64 sums in example order, rounded once
   to the leaf dtype).

No Python loop over examples or leaves, and no copy of the batch when it already lives in one
buffer per dtype (a `FlatTree`, or the ``.tree`` of one: compute the per-example gradients into its
views). A plain tree of separate arrays is packed into such a buffer first (one copy).
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import arrays
from ._bounded import Bounded
from ._checks import flag, non_negative, real, wrong_state
from .accumulation import trace
from .backend import Reductions, ops_for, prepare_reduce, prepare_weighted_sum, slice_sumsq
from .base import Stage, chain
from .contract import ONE
from .declared import Elementwise, check_decay
from .flat import FlatTree, Workspace, as_flat, host_leaves, layout_of
from .formulas import formula, like, normal
from .fuse import Host
from .layout import Layout, finfo
from .protocol import GradientTransformationExtraArgs, state_class
from .scaling import ScalarOrSchedule, identity, scale_by_learning_rate
from .tables import SUMSQ_TINY, segments
from .traits import TREE
from .tree import short_repr, tree_unflatten
from .updates import Spec, Updates

__all__ = [
    "AddNoiseState",
    "DifferentiallyPrivateAggregateState",
    "add_noise",
    "differentially_private_aggregate",
    "dp_epsilon",
    "dpsgd",
    "noisy_sgd",
    "per_example_clip_from_norms",
    "per_example_clip_weights",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
]


# --- the per-example layout -----------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """What a per-example layout implies, worked out once per layout (layouts are interned)."""

    batch: int
    out_layout: Layout  # the same tree without the batch axis, grouped like the input
    runs: tuple[np.ndarray, ...]  # per group: offsets of its (leaf, example) runs, leaf-major
    example_sizes: np.ndarray  # D_k per leaf, int64
    tables: tuple  # per group: the segments table of its runs (one slice per run)


# Per per-example layout, i.e. per batch size: bounded, as Poisson-sampled DP-SGD sees a new
# batch size almost every step.
_PLANS = Bounded()


def _plan(layout: Layout, name: str) -> _Plan:
    plan = _PLANS.get(layout)
    if plan is None:
        plan = _PLANS.put(layout, _make_plan(layout, name))
    return plan


def _make_plan(layout: Layout, name: str) -> _Plan:
    batch = 0
    for i, shape in enumerate(layout.shapes):  # once per layout, not per call
        if not shape:
            raise ValueError(
                f"{layout.path(i, name)}: a 0-d leaf has no batch dimension; per-example "
                "gradients have shape (batch, ...)"
            )
        if i == 0:
            batch = shape[0]
        elif shape[0] != batch:
            raise ValueError(
                f"{layout.path(i, name)}: batch size {shape[0]} differs from {batch} "
                f"({layout.path(0, name)}); every leaf needs the same batch size on axis 0"
            )
    keys = [layout.group_dtypes[g] for g in layout.leaf_group]
    out_layout = Layout.get(layout.treedef, [s[1:] for s in layout.shapes], layout.dtypes, keys)
    sizes = np.array(out_layout.sizes, np.int64)
    runs = []
    for members, offsets in zip(layout.group_index, layout.offsets):
        d = sizes[members]
        starts = offsets[:-1, None] + np.arange(batch, dtype=np.int64)[None, :] * d[:, None]
        table = np.append(starts.ravel(), offsets[-1]).astype(np.int64)
        table.flags.writeable = False
        runs.append(table)
    return _Plan(batch, out_layout, tuple(runs), sizes, tuple(segments(r) for r in runs))


def _per_example(grads: Any, name: str) -> tuple[FlatTree, _Plan, str]:
    """``(flat, plan, kind)``: the per-example tree in flat buffers (zero-copy for a FlatTree or
    its views); ValueError/TypeError naming the leaf before anything is computed."""
    layout = grads.layout if isinstance(grads, FlatTree) else layout_of(grads, name)
    plan = _plan(layout, name)
    flat, _, kind = as_flat(grads, layout, name)
    return flat, plan, kind


def _check_clip(value: Any, name: str) -> float:
    return non_negative(value, name)


# --- the two passes -------------------------------------------------------------------------


def _squared_norms(flat: FlatTree, plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
    """``(s, f)``, float64 ``(leaves, B)``: the squared norm of example ``b`` of leaf ``k`` is
    ``s[k, b] / f[k, b] ** 2`` (`numbaccum.backend.slice_sumsq`: ``f`` is 1 except where float64
    entries past ~1e154 or below ~1e-154 made the plain sum overflow or underflow).

    One segmented reduction per dtype group; on the GPU the values come back to the host."""
    lay = flat.layout
    s = np.empty((lay.num_leaves, plan.batch), np.float64)
    f = np.ones_like(s)
    for members, table, g in zip(lay.group_index, plan.tables, flat.groups):
        gs, gf = slice_sumsq(g, table)
        s[members] = np.asarray(gs).reshape(members.size, plan.batch)
        f[members] = np.asarray(gf).reshape(members.size, plan.batch)
    return s, f


def _multipliers(norms: np.ndarray, clip: Any) -> np.ndarray:
    """``min(clip / norm, 1)``, with optax's ``0 / 0 -> 1`` (a zero example under a zero clip is
    not clipped) and 0 for a non-finite norm: that example is dropped, not passed through."""
    with np.errstate(divide="ignore", invalid="ignore"):
        mult = np.minimum(clip / norms, 1.0)
    mult[np.isnan(mult)] = 1.0
    mult[~np.isfinite(norms)] = 0.0
    return mult


def _global_norms(flat: FlatTree, plan: _Plan) -> np.ndarray:
    """Each example's L2 norm over every leaf, float64 ``(B,)`` (`_norms_over_leaves`)."""
    s, f = _squared_norms(flat, plan)
    if np.all(f == 1.0):  # the common case
        return np.sqrt(s.sum(axis=0))
    return _norms_over_leaves(s, f)


def _norms_over_leaves(s: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Each example's L2 norm from its leaves' `_squared_norms` ``(s, f)`` (leaves added in tree
    order; where a leaf was rescaled, the example's leaves are added at its smallest scale)."""
    nonzero = s != 0  # per example: the scale of its largest entries, over its non-zero leaves
    big = np.where(nonzero, f, np.inf).min(axis=0)
    big = np.where(np.isfinite(big), big, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        r = big[None, :] / f
        terms = np.where(nonzero, s * r * r, 0.0)
    return np.sqrt(terms.sum(axis=0)) / big


def _weighted_sums(
    flat: FlatTree,
    plan: _Plan,
    mult: np.ndarray,
    out: FlatTree,
    noise: list[np.ndarray] | None = None,
    std: float = 0.0,
    div: float = 1.0,
) -> FlatTree:
    """``out[k] = (sum_b mult[k, b] * g[k][b] + std * noise[k]) / div``, one kernel per group;
    ``mult`` is ``(leaves, B)``, or ``(B,)`` for one multiplier per example.

    With noise the result saturates at the largest finite value of each output dtype."""
    lay, out_offsets = flat.layout, plan.out_layout.offsets
    mult = np.broadcast_to(mult, (lay.num_leaves, plan.batch))  # one multiplier per example: every leaf
    for gi, (members, g, o) in enumerate(zip(lay.group_index, flat.groups, out.groups)):
        limit = float(finfo(o.dtype).max) if noise is not None else math.inf
        z = noise[gi] if noise is not None else _NO_NOISE
        m = np.ascontiguousarray(mult[members])
        ops_for(g).batch_weighted_sum_(o, g, lay.offsets[gi], out_offsets[gi], m, z, std, div, limit)
    return out


class _Passes:
    """The two passes of a declared DP aggregation (`_Aggregate.declare`, `_Accumulation`) over
    per-example gradients of one layout, kept across steps (`numbaccum.backend.Reductions`,
    prepared again when the buffers change): each group's squared norms a reduction prepared
    for its buffer, and the weighted sums of every group one prepared call, whose limits and
    kernels are found once. The same kernels over the same items, in the same order, as
    `_global_norms` and `_weighted_sums`: the same bits, without the dispatch of each call (a
    small tree's whole step is mostly that)."""

    __slots__ = ("layout", "plan", "clip", "kept", "norms", "prepare_sums")

    def __init__(self, layout: Layout, plan: _Plan, clip: float) -> None:
        self.layout, self.plan, self.clip = layout, plan, clip
        self.kept = Reductions()
        # The groups the squared norms were last prepared for, and per group its run.
        self.norms: tuple[tuple, list] = ((), [])
        self.prepare_sums = self._prepare_sums  # one object: part of `Reductions.call`'s key

    def multipliers(self, flat: FlatTree) -> tuple[np.ndarray, int]:
        """Each example's multiplier for its norm over every leaf, ``(B,)``: `_multipliers` of
        `_global_norms`, whose rescue of a float64 group runs only where its plain sums need it
        (`numbaccum.backend.slice_sumsq`'s test, inline); and how many examples the clip scaled
        down (or dropped: a non-finite norm)."""
        plan, batch, groups = self.plan, self.plan.batch, flat.groups
        lay = self.layout
        held, runs = self.norms
        if len(held) != len(groups) or not all(map(operator.is_, held, groups)):
            # per group: its plain float64 sums of squares per (leaf, example) run, prepared
            runs = [prepare_reduce("sumsq", g, table) for g, table in zip(groups, plan.tables)]
            self.norms = (tuple(groups), runs)
        s = np.empty((lay.num_leaves, batch), np.float64)
        f = None  # the scales, once a group's plain sums overflowed or underflowed
        for members, table, g, sumsq in zip(lay.group_index, plan.tables, groups, runs):
            gs = sumsq()
            if np.dtype(g.dtype).itemsize >= 8 and ((gs == np.inf) | (gs < SUMSQ_TINY)).any():
                gs, gf = slice_sumsq(g, table, gs)
                if f is None:
                    f = np.ones_like(s)
                f[members] = np.asarray(gf).reshape(members.size, batch)
            s[members] = np.asarray(gs).reshape(members.size, batch)
        if f is None or np.all(f == 1.0):  # the common case
            mult = _multipliers(np.sqrt(s.sum(axis=0)), self.clip)
        else:
            mult = _multipliers(_norms_over_leaves(s, f), self.clip)
        return mult, int(np.count_nonzero(mult < 1.0))

    def sums(
        self,
        flat: FlatTree,
        mult: np.ndarray,
        out: FlatTree,
        noise: tuple[int, int] | None,
        std: float,
        div: float,
        init: FlatTree | None = None,
    ) -> None:
        """`_weighted_sums` of ``flat`` into ``out``, the sums from ``init`` (an earlier sum
        of the same layout: DP accumulation) or from 0. ``noise``: the ``(seed, step)`` of the
        noise draw, added with ``std`` (standard normal float64 draws for each group, in group
        order, from Philox keyed by it: every (seed, step) pair is an independent stream; with
        ``std`` 0 nothing drawn, as nothing is read) and the result saturated; None: neither."""
        buffers = (*out.groups, *flat.groups) if init is None else (*out.groups, *flat.groups, *init.groups)
        # A slot per kind of call: a DP accumulation's first mini-step sums from 0 into the
        # sums, the others from them, and the emitting one (with noise) into the updates.
        self.kept.call((init is None, noise is None), self.prepare_sums, buffers, mult, noise, std, div)

    def _prepare_sums(self, *buffers: Any) -> Any:
        """``run(mult, noise, std, div)`` over these buffers: the out groups, the per-example
        groups, and the init groups (none: the sums start from 0). Each group's noise is drawn
        just before its kernel runs: the draws of one generator in group order, as drawn all
        first."""
        lay, plan = self.layout, self.plan
        n = len(plan.tables)
        outs, grads, inits = buffers[:n], buffers[n : 2 * n], buffers[2 * n :] or (None,) * n
        out_offsets, members = plan.out_layout.offsets, lay.group_index
        runs = [
            prepare_weighted_sum(o, g, lay.offsets[gi], out_offsets[gi], init)
            for gi, (o, g, init) in enumerate(zip(outs, grads, inits))
        ]
        limits = [float(finfo(o.dtype).max) for o in outs]  # with noise: saturated
        shape, sizes = (lay.num_leaves, plan.batch), plan.out_layout.group_sizes

        def run(mult: np.ndarray, noise: tuple | None, std: float, div: float) -> None:
            mult = np.broadcast_to(mult, shape)  # one multiplier per example: every leaf
            noised, rng = noise is not None, None
            if noised and std:
                rng = np.random.Generator(np.random.Philox(key=np.array(noise, np.uint64)))
            for gi in range(n):  # a loop, not calls: every step
                m = np.ascontiguousarray(mult[members[gi]])
                z = rng.standard_normal(sizes[gi]) if rng is not None else _NO_NOISE
                runs[gi](m, z, std, div, limits[gi] if noised else math.inf)

        return run


_NO_NOISE = np.zeros(1, np.float64)  # the noise argument when std == 0 (never read then)


def _new_sums(flat: FlatTree, plan: _Plan) -> FlatTree:
    return FlatTree.empty(plan.out_layout, list(flat.group_dtypes), flat.device)


def _as_kind(out: FlatTree, kind: str) -> Any:
    return out if kind == "flat" else out.tree_as(kind)


# --- per-example clipping -------------------------------------------------------------------


def per_example_global_norm_clip(grads: Any, l2_norm_clip: float, *, return_norms: bool = False) -> tuple:
    """Clips each example's gradient to a global L2 norm and sums over the batch (optax's
    ``per_example_global_norm_clip``).

    ``sum_b g[b] * min(1, l2_norm_clip / ||g[b]||)``, with ``||g[b]||`` over every leaf of
    example ``b``; ``num_clipped = #{b : multiplier < 1}``.

    The norms accumulate in float64 (float32 squares cannot overflow: an example of ``1e20``
    entries is scaled, not zeroed as in optax), and the sums too, rounded once to each leaf's
    dtype. Norms are scaled (`numbaccum.global_norm`): float64 entries past 1e154 or below
    1e-154 still give the example's finite norm. An example with a non-finite norm (a NaN or inf
    anywhere in it, or a norm past float64's range) is **dropped**: multiplier 0, counted as
    clipped. optax gives it
    multiplier 1 (NaN) or a NaN sum (inf), which breaks the differential-privacy bound.
    ``norm == l2_norm_clip`` is not counted (the test is a strict ``< 1``); a zero example under
    a zero clip keeps multiplier 1, as in optax.

    Args:
        grads: a tree (or FlatTree) whose leaves have the batch on axis 0, all with the same
            batch size; NumPy or CUDA arrays.
        l2_norm_clip: the largest L2 norm an example may keep, ``>= 0`` (``inf`` clips nothing).
        return_norms: also return each example's pre-clip norm (to log it, or to clip again
            from it with `per_example_clip_from_norms`). It costs nothing: the norms are computed
            anyway.

    Returns:
        ``(sums, num_clipped)``: the tree of sums over the batch (leaf shapes without the batch
            axis, leaf dtypes kept; a FlatTree for a FlatTree, CUDA arrays for CUDA arrays) and the
            number of clipped examples as an ``np.int32``. With ``return_norms``,
            ``(sums, num_clipped, norms)``: ``norms`` is a float64 host array of shape ``(B,)``.

    Raises:
        ValueError: a leaf without a batch dimension (0-d) or with another batch size (the
            message names the leaf), or a negative ``l2_norm_clip``.
        TypeError: a leaf that is not a float array, ``l2_norm_clip`` not a real number, or
            ``return_norms`` not a bool.

    References:
        Abadi et al., "Deep Learning with Differential Privacy", ACM CCS 2016
        (arXiv:1607.00133). optax.per_example_global_norm_clip.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([[3.0, 4.0], [0.3, 0.4]])}  # two examples, norms 5 and 0.5
        >>> sums, num_clipped, norms = nba.per_example_global_norm_clip(grads, 1.0, return_norms=True)
        >>> [round(float(x), 4) for x in sums["w"]], int(num_clipped), norms.tolist()
        ([0.9, 1.2], 1, [5.0, 0.5])
    """
    clip = _check_clip(l2_norm_clip, "l2_norm_clip")
    want_norms = flag(return_norms, "return_norms")
    flat, plan, kind = _per_example(grads, "grads")
    with arrays.launch_context(kind):
        norms = _global_norms(flat, plan)
        mult = _multipliers(norms, clip)
        out = _weighted_sums(flat, plan, mult, _new_sums(flat, plan))
    result = (_as_kind(out, kind), np.int32(np.count_nonzero(mult < 1.0)))
    return (*result, norms) if want_norms else result


def per_example_clip_weights(norms: Any, l2_norm_clip: float) -> np.ndarray:
    """The multiplier of each example for per-example norms the caller already has:
    ``w[b] = min(1, l2_norm_clip / norms[b])``, with ``0 / 0 -> 1`` and ``w[b] = 0`` for a
    non-finite norm (the example is dropped), exactly as `per_example_global_norm_clip` weighs.

    Ghost clipping computes the norms without per-example gradients; a second backward pass on
    the loss weighted by ``w`` then gives the clipped sum directly.

    Args:
        norms: the per-example L2 norms, a 1-d array of ``B`` real numbers ``>= 0`` (NaN and inf
            allowed: dropped examples).
        l2_norm_clip: the largest L2 norm an example may keep, ``>= 0``.

    Returns:
        ``w``, float64 of shape ``(B,)``.

    Raises:
        ValueError: a negative ``l2_norm_clip``; ``norms`` not 1-d, or holding a negative norm.
        TypeError: ``norms`` is not an array of real numbers, or ``l2_norm_clip`` not a real
            number.

    References:
        Abadi et al., "Deep Learning with Differential Privacy", ACM CCS 2016
        (arXiv:1607.00133); Goodfellow, "Efficient Per-Example Gradient Computations", 2015
        (arXiv:1510.01799), for per-example norms without per-example gradients. The multipliers
        of optax.per_example_global_norm_clip.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> nba.per_example_clip_weights(np.array([5.0, 0.5, np.nan]), 1.0).tolist()
        [0.2, 1.0, 0.0]
    """
    clip = _check_clip(l2_norm_clip, "l2_norm_clip")
    return _multipliers(_check_norms(norms, None), clip)


def per_example_clip_from_norms(grads: Any, norms: Any, l2_norm_clip: float) -> tuple[Any, np.int32]:
    """`per_example_global_norm_clip` with the norms given, in one pass over the batch.

    ``sum_b g[b] * w[b]`` with ``w = per_example_clip_weights(norms, l2_norm_clip)`` (the norm
    pass is skipped); ``num_clipped = #{b : w[b] < 1}``. With the norms
    `per_example_global_norm_clip` returned for the same ``grads``, the result is the same, bit
    for bit.

    Args:
        grads: per-example gradients (batch on axis 0 of every leaf), as in
            `per_example_global_norm_clip`.
        norms: the examples' L2 norms, a 1-d array of the batch size (float64 or any real
            dtype; NaN and inf drop an example).
        l2_norm_clip: the largest L2 norm an example may keep, ``>= 0``.

    Returns:
        ``(sums, num_clipped)`` as `per_example_global_norm_clip`.

    Raises:
        ValueError: norms of another length than the batch, negative norms or clip, or leaves
            without a common batch dimension (naming the leaf).
        TypeError: norms that are not a 1-d array of real numbers, a leaf that is not a float
            array, or ``l2_norm_clip`` not a real number.

    References:
        Abadi et al., "Deep Learning with Differential Privacy", ACM CCS 2016
        (arXiv:1607.00133). optax.per_example_global_norm_clip (which computes the norms itself).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"w": np.array([[3.0, 4.0], [0.3, 0.4]])}
        >>> sums, num_clipped = nba.per_example_clip_from_norms(grads, np.array([5.0, 0.5]), 1.0)
        >>> [round(float(x), 4) for x in sums["w"]], int(num_clipped)
        ([0.9, 1.2], 1)
    """
    clip = _check_clip(l2_norm_clip, "l2_norm_clip")
    flat, plan, kind = _per_example(grads, "grads")
    mult = _multipliers(_check_norms(norms, plan.batch), clip)
    with arrays.launch_context(kind):
        out = _weighted_sums(flat, plan, mult, _new_sums(flat, plan))
    return _as_kind(out, kind), np.int32(np.count_nonzero(mult < 1.0))


def _check_norms(norms: Any, batch: int | None) -> np.ndarray:
    """``norms`` as a float64 host array of shape ``(batch,)``; TypeError/ValueError naming
    ``norms`` otherwise (a CUDA array is brought to the host: it is B numbers)."""
    if hasattr(norms, "copy_to_host"):
        norms = norms.copy_to_host()
    elif hasattr(norms, "__cuda_array_interface__") and hasattr(norms, "get"):
        norms = norms.get()  # CuPy
    elif type(norms).__module__.startswith("torch"):
        norms = norms.detach().cpu().numpy()
    try:
        arr = np.asarray(norms)
    except Exception as e:  # ragged lists and the like
        raise TypeError(f"norms must be a 1-d array of real numbers: {e}") from None
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"norms must be a 1-d array of real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"norms must be 1-d (one norm per example), got shape {arr.shape}")
    if batch is not None and arr.shape[0] != batch:
        raise ValueError(f"norms: {arr.shape[0]} norms for a batch of {batch} examples")
    out = arr.astype(np.float64)
    if np.any(out < 0):  # NaN compares False: allowed (the example is dropped)
        raise ValueError(f"norms must be >= 0, got {out[out < 0][0]!r} at index {int(np.argmax(out < 0))}")
    return out


def per_example_layer_norm_clip(
    grads: Any, global_l2_norm_clip: float, uniform: bool = True, *, return_norms: bool = False
) -> tuple:
    """Clips each leaf ("layer") of each example to its own L2 norm and sums over the batch
    (optax's ``per_example_layer_norm_clip``).

    ``sums[k] = sum_b g[k][b] * min(1, C_k / ||g[k][b]||)``, with ``C_k = C / sqrt(K)`` if
    ``uniform``, else ``C_k = C * sqrt(D_k / D)`` (``D_k`` elements per example in leaf ``k`` of
    ``K``, ``D = sum D_k``); ``counts[k] = #{b : multiplier < 1}``.

    Same numerics and differences from optax as `per_example_global_norm_clip`, per layer: an
    example whose leaf has a non-finite norm is dropped from that leaf's sum (multiplier 0,
    counted there) and kept in the others. One squared-norm pass and one sum pass for the whole
    tree, as in the global version.

    Args:
        grads: a tree (or FlatTree) whose leaves have the batch on axis 0.
        global_l2_norm_clip: the overall clip ``C >= 0``, shared out between the leaves.
        uniform: share ``C`` equally (True) or in proportion to the leaves' sizes (False).
        return_norms: also return each leaf's per-example pre-clip norms.

    Returns:
        ``(sums, counts)``: the tree of sums (as in `per_example_global_norm_clip`) and a tree of
            the same structure holding each leaf's number of clipped examples (``np.int32``). With
            ``return_norms``, ``(sums, counts, norms)``: a tree of the same structure whose leaves
            are float64 host arrays of shape ``(B,)``.

    Raises:
        ValueError: missing or unequal batch dimensions (naming the leaf), negative clip.
        TypeError: a leaf that is not a float array, a clip that is not a real number, or
            ``uniform`` or ``return_norms`` not a bool.

    References:
        McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent Language
        Models", ICLR 2018 (arXiv:1710.06963). optax.per_example_layer_norm_clip.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> grads = {"a": np.array([[3.0, 4.0], [0.3, 0.4]]), "b": np.array([[1.0], [2.0]])}
        >>> sums, counts = nba.per_example_layer_norm_clip(grads, 2.0)
        >>> [round(float(x), 4) for x in sums["a"]], [round(float(x), 4) for x in sums["b"]]
        ([1.1485, 1.5314], [2.4142])
        >>> {k: int(v) for k, v in counts.items()}
        {'a': 1, 'b': 1}

        Each leaf's clip is ``C_k = 2 / sqrt(2) = 1.4142``: in ``a`` the first example (norm 5) is
        scaled down to it, in ``b`` the second (norm 2).
    """
    clip = _check_clip(global_l2_norm_clip, "global_l2_norm_clip")
    uniform = flag(uniform, "uniform")
    want_norms = flag(return_norms, "return_norms")
    flat, plan, kind = _per_example(grads, "grads")
    lay = flat.layout
    d = plan.example_sizes.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # K = 0 or D = 0: no multiplier is read
        clips = np.full(lay.num_leaves, clip * math.sqrt(1.0 / max(lay.num_leaves, 1)))
        if not uniform:
            clips = clip * np.sqrt(d / d.sum())
    with arrays.launch_context(kind):
        s, f = _squared_norms(flat, plan)
        norms = np.sqrt(s) / f
        mult = _multipliers(norms, clips[:, None])
        out = _weighted_sums(flat, plan, mult, _new_sums(flat, plan))
    counts = np.count_nonzero(mult < 1.0, axis=1).astype(np.int32)
    result = (_as_kind(out, kind), tree_unflatten(lay.treedef, list(counts)))
    return (*result, tree_unflatten(lay.treedef, list(norms))) if want_norms else result


# --- differential privacy -------------------------------------------------------------------


@state_class
class DifferentiallyPrivateAggregateState(NamedTuple):
    """State of `differentially_private_aggregate`: the key of the next noise draw (optax's field).

    It also counts the examples of the current accumulation cycle, and records what the last
    update did for a privacy log (`numbaccum.stats` reports them): how many examples it averaged,
    how many of them were clipped, and the standard deviation of the noise in the averaged
    update. Account for the privacy spent with `dp_epsilon`.

    Attributes:
        rng_key: ``[seed, step]`` as two uint64 (read-only): the 128-bit key of the Philox
            generator that draws the noise of the next update; ``step`` counts updates.
        examples: under `MultiSteps` (DP accumulation), the examples summed into its
            accumulator so far this cycle (int64); 0 otherwise.
        clipped: the examples whose norm exceeded ``l2_norm_clip`` in the last update (under
            `MultiSteps`: in the cycle so far, then in the whole logical batch), int64.
        batch: the examples the last update averaged (int64).
        noise_std: the standard deviation of the noise in the last update, per element:
            ``l2_norm_clip * noise_multiplier / batch`` (float64).
    """

    rng_key: np.ndarray
    examples: Any = np.int64(0)
    clipped: Any = np.int64(0)
    batch: Any = np.int64(0)
    noise_std: Any = np.float64(0.0)


def _check_seed(seed: Any, name: str = "seed") -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(seed).__name__}")
    s = int(seed)
    if not 0 <= s < 2**64:
        raise ValueError(f"{name} must be in [0, 2**64), got {s}")
    return s


def _key(seed: int, step: int) -> np.ndarray:
    key = np.array([seed, step], np.uint64)
    key.flags.writeable = False
    return key


def _check_dp_state(state: Any, name: str = "state") -> tuple[int, int]:
    if not isinstance(state, DifferentiallyPrivateAggregateState):
        raise TypeError(f"{name}: expected DifferentiallyPrivateAggregateState, got {type(state).__name__}")
    key = np.asarray(state.rng_key)
    if key.shape != (2,) or key.dtype != np.uint64:
        raise ValueError(f"{name}.rng_key: expected 2 uint64 [seed, step], got {key.dtype} {key.shape}")
    seed, step = int(key[0]), int(key[1])
    if step == 2**64 - 1:  # the next key would repeat step 0's noise
        raise ValueError(f"{name}.rng_key: the noise stream of this seed is exhausted")
    examples = state.examples
    if isinstance(examples, (bool, np.bool_)) or not isinstance(examples, numbers.Integral) or examples < 0:
        raise ValueError(f"{name}.examples: expected an int >= 0, got {short_repr(examples, 40)}")
    return seed, step


def _after(seed: int, step: int, clipped: int, batch: int, noise_std: float) -> Any:
    """The state after an update: the next noise key, and what this update did."""
    key = np.array([seed, step + 1], np.uint64)  # `_key`'s, inline: every update
    key.flags.writeable = False
    return DifferentiallyPrivateAggregateState(
        key, np.int64(0), np.int64(clipped), np.int64(batch), np.float64(noise_std)
    )


class _Aggregate(Stage):
    """`differentially_private_aggregate` as a reshaping stage: it takes per-example gradients
    (its own `take`) and its declared `numbaccum.fuse.Host` returns params-shaped updates (its
    ``spec``), so that a `chain` plans the stages after it on the params' layout."""

    scope = TREE
    reshapes = True

    def __init__(self, l2_norm_clip: Any, noise_multiplier: Any, seed: Any) -> None:
        self.clip = _check_clip(l2_norm_clip, "l2_norm_clip")
        nm = real(noise_multiplier, "noise_multiplier")
        if not (nm >= 0 and math.isfinite(nm)):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
        self.std = self.clip * nm if nm > 0 else 0.0
        if not math.isfinite(self.std):
            raise ValueError(
                f"l2_norm_clip * noise_multiplier = {self.clip} * {nm} is not finite: no noise of "
                "that scale can be added"
            )
        self.seed = _check_seed(seed)

    def init(self, params: Any) -> DifferentiallyPrivateAggregateState:
        del params  # the noise key is all the state; B is known only from the first update
        return DifferentiallyPrivateAggregateState(_key(self.seed, 0))

    def take(self, updates: Any, state: Any, params: Any, owner: FlatTree | None) -> tuple[Updates, str]:
        """The per-example gradients as `Updates` of their own layout (zero-copy for a FlatTree or
        its views); ValueError/TypeError naming the leaf. A plain tree of the last layout taken
        (this thread) is checked in one walk (`host_leaves`) instead of laying it out again."""
        local = self.local()
        last = local.__dict__.get("last")  # the last per-example layout taken
        if last is not None and not isinstance(updates, FlatTree):
            checked = host_leaves(updates, last)
            if checked is not None:
                return Updates(as_flat(updates, last, "updates", checked=checked)[0], False), "numpy"
        flat, _, kind = _per_example(updates, "updates")
        if kind == "numpy":
            local.last = flat.layout
        return Updates(flat, False), kind

    def declare(self, spec: Spec, state: Any) -> Host:
        """A `numbaccum.fuse.Host` for per-example gradients of ``spec`` (the batch checked here,
        once per batch size); its tick checks the noise key. Each step writes the sums into
        the declaration's workspace, which is never one whose values the caller still holds
        (`numbaccum.flat.Workspace`: the update of another state of the same transformation
        writes its spare then)."""
        _check_dp_state(state)
        plan = _plan(spec.layout, "updates")
        if plan.batch == 0 and spec.layout.num_leaves:
            raise ValueError("updates: the batch is empty (batch size 0); there is nothing to average")
        out_spec = Spec(plan.out_layout, spec.device)
        clip, std, seed = self.clip, self.std, self.seed
        now = [0]  # this step's noise step
        sums = Workspace(out_spec.layout, None, out_spec.device)  # the plan's: one update at a time
        kept = _Passes(spec.layout, plan, clip)  # the norms' and the sums' calls, kept

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not isinstance(state, DifferentiallyPrivateAggregateState):
                return False
            now[0] = _check_dp_state(state)[1]  # a ValueError naming what is wrong in the key
            return True

        def run(u: Updates) -> tuple[Updates, DifferentiallyPrivateAggregateState]:
            """Clip, sum, add noise, divide by the batch size."""
            step = now[0]
            flat = u.flat if u.factor is ONE else u.settled().flat  # (`settled`'s test, sooner)
            mult, clipped = kept.multipliers(flat)
            out = sums()  # never one whose values the caller holds (`Workspace`)
            batch = max(plan.batch, 1)
            # (with std 0 no noise is drawn; the output still saturates)
            kept.sums(flat, mult, out, (seed, step), float(std), float(batch))
            return Updates(out, True), _after(seed, step, clipped, plan.batch, std / batch)

        # the per-example norms (one reduction), then the weighted sums over the batch; per
        # parameter of the per-example input, whose batch sums to one parameter in 1 / B
        passes = (
            ("reduction", "per-example norms", 1.0, 0.0),
            ("kernel", "clipped sum + noise", 1.0, 1.0 / max(plan.batch, 1)),
        )
        return Host(run, passes, "differentially_private_aggregate", tick, spec=out_spec)

    def declare_accumulation(self, spec: Spec, acc: FlatTree, state: Any) -> _Accumulation:
        """`MultiSteps`' DP accumulation of per-example gradients of ``spec`` into ``acc``
        (`_Accumulation`), after checking ``state`` and that ``acc`` sums these examples."""
        return _Accumulation(self, spec, acc, state)


class _Accumulation:
    """`MultiSteps`' DP accumulation, declared for per-example gradients of one spec (one batch
    size) and one float64 accumulator (`_Aggregate.declare_accumulation`). Each mini-step adds
    its clipped examples to the running sums in example order, continuing the earlier ones' sum
    (`_weighted_sums`' ``init``); the emitting one adds the noise once and divides by every
    example of the cycle, in the same kernel: the bits of one update on the whole logical
    batch, with the same noise draw. ``tick`` checks the step's DP state before anything is
    written; ``run`` writes.

    Attributes:
        spec: the params' `Spec`: that of the sums and of the updates the emitting step returns.
        batch: the examples of one mini-step.
    """

    def __init__(self, agg: _Aggregate, spec: Spec, acc: FlatTree, state: Any) -> None:
        _check_dp_state(state)
        plan = _plan(spec.layout, "updates")
        _check_sums(acc, plan, spec)
        self.plan, self.batch, self.leaves = plan, plan.batch, spec.layout.num_leaves
        self.spec = Spec(plan.out_layout, spec.device)
        self.std, self.seed = agg.std, agg.seed
        self.passes = _Passes(spec.layout, plan, agg.clip)  # the norms' and the sums' calls, kept
        # The emitted updates: never written over ones the caller holds (`Workspace`).
        self.out = Workspace(self.spec.layout, None, self.spec.device)
        # This step's values (`tick`).
        self.state: Any = None
        self.step, self.total, self.fresh, self.emit = 0, 0, True, False

    def tick(self, state: Any, fresh: bool, emit: bool) -> bool:
        """This step's noise step and example count, from the DP ``state`` (``fresh``: the
        cycle's first mini-step; ``emit``: its last); False for a state of another class (the
        declaration says what is wrong), ValueError for a bad key or an empty cycle."""
        if not isinstance(state, DifferentiallyPrivateAggregateState):
            return False
        step = _check_dp_state(state)[1]
        total = (0 if fresh else int(state.examples)) + self.batch
        if emit and total == 0 and self.leaves:
            raise ValueError("updates: no example in the whole cycle; there is nothing to average")
        self.state, self.step, self.total, self.fresh, self.emit = state, step, total, fresh, emit
        return True

    def run(self, u: Updates, acc: FlatTree) -> tuple[Updates | None, DifferentiallyPrivateAggregateState]:
        """Adds the clipped examples of ``u`` to ``acc`` (None: nothing emitted), or on the
        emitting step returns the noised average of the cycle in a new buffer (``acc`` read
        only); and the new DP state, counting the cycle's examples (0 after it)."""
        flat = u.flat if u.factor is ONE else u.settled().flat  # (`settled`'s test, sooner)
        state, fresh, total, passes = self.state, self.fresh, self.total, self.passes
        mult, clipped = passes.multipliers(flat)
        init = None if fresh else acc
        clipped += 0 if fresh else int(state.clipped)
        if not self.emit:  # the running sum, in float64: exact, neither noised nor divided
            passes.sums(flat, mult, acc, None, 0.0, 1.0, init)
            return None, state._replace(examples=np.int64(total), clipped=np.int64(clipped))
        std, seed, step = self.std, self.seed, self.step
        out = self.out()
        passes.sums(flat, mult, out, (seed, step), float(std), float(max(total, 1)), init)
        return Updates(out, True), _after(seed, step, clipped, total, std / max(total, 1))


def _check_sums(acc: FlatTree, plan: _Plan, spec: Spec) -> None:
    """ValueError unless ``acc`` holds the sums of the examples of ``plan`` (the params' layout,
    on the updates' device), naming the first leaf that differs."""
    if acc.layout is plan.out_layout and acc.device == spec.device:
        return
    want, got = acc.layout, plan.out_layout
    for i in range(min(want.num_leaves, got.num_leaves)):
        if want.shapes[i] != got.shapes[i] or want.dtypes[i] != got.dtypes[i]:
            raise ValueError(
                f"{got.path(i, 'updates')}: per-example {got.shapes[i]} {got.dtypes[i]} does not "
                f"match the params the state was built for: {want.shapes[i]} {want.dtypes[i]}"
            )
    raise ValueError("updates: not per-example gradients of the params the state was built for")


def differentially_private_aggregate(
    l2_norm_clip: float, noise_multiplier: float, seed: int
) -> GradientTransformationExtraArgs:
    """Aggregates per-example gradients with Gaussian noise (optax's
    ``differentially_private_aggregate``, the first stage of DP-SGD).

    ``u = (sum_b clip(g[b], l2_norm_clip) + l2_norm_clip * noise_multiplier * z) / B``,
    ``z ~ N(0, I)``, with ``clip`` as in `per_example_global_norm_clip` (non-finite examples
    dropped).

    ``update`` takes the per-example gradients (batch on axis 0 of every leaf) and returns updates
    shaped like the params. Noise: for update number ``step``, NumPy's
    ``Generator(Philox(key=[seed, step]))`` draws float64 standard normals, one array per dtype
    group in group order (on the host, then copied to the device for CUDA arrays); the same seed
    gives the same bits, step after step, and each step is an independent stream. The clipped sum,
    the scaled noise and the division by ``B`` are computed in float64 and rounded once to the leaf
    dtype, which is why this is safe with float32 (or float16) gradients: the noise a float32 leaf
    receives is the float64 Gaussian rounded to float32 (relative error ``2**-24``, no bias), with
    its tail intact, where a float32 sampler fed 24-bit uniforms never draws beyond
    ``|z| = 5.5 .. 5.8`` (Box-Muller's ``sqrt(-2 log u)`` or an inverse CDF at the last uniform
    before 0 or 1) and returns inf if that uniform is 0. The result never becomes +-inf: it
    saturates at the largest finite value of the leaf dtype (a noise scale beyond float16's 65504
    would otherwise round to inf), and a NaN or inf example never reaches the sum. (Rounding the
    noise to float32 keeps the Gaussian's distribution, but like every floating-point DP
    implementation it does not defend against attacks on the low-order bits of the noise.)

    As in optax, the state holds only the noise key: this must be the first stage, fed per-example
    gradients, and ``chain(differentially_private_aggregate(...), adam(1e-3))`` works as in optax
    (the rest of the chain sees params-shaped updates). `dpsgd` is such a chain. Each ``update``
    returns its updates in a new buffer: they stay valid whatever other updates follow.

    Gradient accumulation: ``MultiSteps(differentially_private_aggregate(...) or a chain starting
    with it, k)`` sums each mini-batch's clipped examples into a float64 accumulator and, on the
    k-th mini-step, adds the noise once and divides by all the cycle's examples ``N``:
    ``u = (sum_{b < N} clip(g[b], C) + C * noise_multiplier * z) / N``, then runs the rest of the
    chain on it. That is one update of this stage on the logical batch of ``N`` examples (the same
    bits on the CPU, the same noise draw for the same seed and step), so the privacy accounting is
    that of one step on the logical batch: sampling rate ``N / dataset size``, noise multiplier
    ``noise_multiplier``. (``apply_every`` still cannot wrap it.)

    Args:
        l2_norm_clip: the per-example L2 clip ``C >= 0``.
        noise_multiplier: the noise's standard deviation in units of ``C`` (``>= 0``, finite).
        seed: a non-negative int below ``2**64``; the state starts at ``[seed, 0]``.

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``DifferentiallyPrivateAggregateState(rng_key, examples)``, ``rng_key`` the two uint64
            ``(seed, step)``.

    Raises:
        ValueError: a bad hyperparameter (negative, or a non-finite noise scale), a seed outside
            0 .. 2**64 - 1; at ``update``, a leaf without a batch dimension or with another
            batch size, an empty batch.
        TypeError: ``seed`` not an int, a clip or noise multiplier that is not a real number.

    References:
        Abadi et al., "Deep Learning with Differential Privacy", ACM CCS 2016
        (arXiv:1607.00133). optax.contrib.differentially_private_aggregate.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.differentially_private_aggregate(1.0, noise_multiplier=0.0, seed=0)
        >>> grads = {"w": np.array([[3.0, 4.0], [0.3, 0.4]])}  # two examples, norms 5 and 0.5
        >>> updates, state = tx.update(grads, tx.init(params))
        >>> [round(float(x), 4) for x in updates["w"]], state.rng_key.tolist()  # (0.6 + 0.3) / 2
        ([0.45, 0.6], [0, 1])
    """
    return _Aggregate(l2_norm_clip, noise_multiplier, seed).transformation()


def dpsgd(
    learning_rate: Any,
    l2_norm_clip: float,
    noise_multiplier: float,
    seed: int,
    momentum: float | None = None,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """DP-SGD (optax's ``contrib.dpsgd``): `differentially_private_aggregate` then `sgd`.

    ``u = -learning_rate * trace(dp_aggregate(g))`` (no trace when ``momentum`` is None).

    ``update`` takes per-example gradients (batch on axis 0) and returns params-shaped updates.
    The state is optax's: ``(DifferentiallyPrivateAggregateState, TraceState | EmptyState,
    learning-rate state)``. Seeded and reproducible as `differentially_private_aggregate`.

    Args:
        learning_rate: a float or a schedule (a callable of the step count).
        l2_norm_clip: the per-example L2 clip ``C >= 0``.
        noise_multiplier: the noise's standard deviation in units of ``C``.
        seed: a non-negative int below ``2**64``.
        momentum: the trace decay, or None for plain SGD.
        nesterov: Nesterov momentum.

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``(DifferentiallyPrivateAggregateState(rng_key, examples), TraceState(trace) or
            EmptyState(), EmptyState())`` (``ScaleByScheduleState`` last, with a schedule).

    Raises:
        ValueError: ``momentum`` outside 0 .. 1, or a bad hyperparameter of
            `differentially_private_aggregate`.
        TypeError: a hyperparameter of the wrong type (as in `differentially_private_aggregate`
            and `sgd`).

    References:
        Abadi et al., "Deep Learning with Differential Privacy", ACM CCS 2016
        (arXiv:1607.00133). optax.contrib.dpsgd; Opacus' ``DPOptimizer`` over torch.optim.SGD.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2)}
        >>> tx = nba.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
        >>> grads = {"w": np.array([[3.0, 4.0], [0.3, 0.4]])}
        >>> updates, state = tx.update(grads, tx.init(params))
        >>> [round(float(x), 4) for x in updates["w"]]  # -0.1 * (0.45, 0.6)
        [-0.045, -0.06]
    """
    if momentum is not None:
        check_decay(momentum, "momentum")  # named as the caller knows it (trace calls it decay)
    inner = [trace(momentum, nesterov) if momentum is not None else identity()]
    return chain(
        differentially_private_aggregate(l2_norm_clip, noise_multiplier, seed),
        *inner,
        scale_by_learning_rate(learning_rate),
    )


# --- gradient noise (optax's add_noise) -----------------------------------------------------


@state_class
class AddNoiseState(NamedTuple):
    """State of `add_noise` (optax's fields).

    Attributes:
        count: the number of updates so far (int32, saturating): the noise's step.
        rng_key: the seed, a read-only ``uint64`` array of one element; the noise of step ``t``
            is a function of ``(seed, t)`` and each element's place (see `add_noise`); the key
            itself never changes.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    rng_key: np.ndarray


@formula(inputs=("g",), outputs=("out",), scalars=("std", "k0", "k1", "step", "group"), indexed=True)
def add_noise_direction(g, std, k0, k1, step, group, index):
    """Gradient noise: out = g + std * z, z the standard normal of this element (`normal`,
    rounded to g's compute dtype as a buffer of draws would hold it)."""
    return g + std * like(g, normal(k0, k1, step, group, index))


class _AddNoise(Elementwise):
    scope = TREE  # its noise is drawn by element position in the whole tree
    state_cls, formula, name = AddNoiseState, add_noise_direction, "add_noise"
    counted = True
    complex_leaves = True  # optax draws complex normals for complex leaves

    def __init__(self, eta: Any, gamma: Any, seed: int) -> None:
        self.eta, self.gamma = non_negative(eta, "eta"), real(gamma, "gamma")
        self.seed = seed

    def init(self, params: Any) -> AddNoiseState:
        layout_of(params, "params")  # (checks the params as every init does)
        key = np.array([self.seed], np.uint64)
        key.flags.writeable = False
        return AddNoiseState(np.int32(0), key)

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        with np.errstate(over="ignore", divide="ignore"):  # a huge |gamma|: 0 or inf, as optax's
            return (float(np.sqrt(self.eta / np.float64(count) ** self.gamma)),)  # sqrt(eta / t^gamma)

    def declare(self, spec: Spec, state: Any) -> Any:
        if not isinstance(state, AddNoiseState):
            raise wrong_state("AddNoiseState", state)
        part = super().declare(spec, state)
        ticked = part.tick
        assert ticked is not None  # (set by `Elementwise.declare`)

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not ticked(state, params, extra):
                return False
            # The noise's key and counter words, after the std: the seed's two halves, the step,
            # and the group's number (each element adds its index: `formulas.normal`).
            seed = _add_noise_seed(state.rng_key)
            k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
            step = np.uint32(int(part.new_state.count))
            part.scalars = [(*sc, k0, k1, step, np.uint32(gi)) for gi, sc in enumerate(part.scalars)]
            return True

        part.tick = tick
        return part


def _add_noise_seed(key: Any) -> int:
    k = np.asarray(key)
    if k.shape != (1,) or k.dtype != np.uint64:
        raise ValueError(f"state.rng_key: expected one uint64 (the seed), got {k.dtype} {k.shape}")
    return int(k[0])


def add_noise(
    eta: float, gamma: float, key: int | None = None, *, seed: int | None = None
) -> GradientTransformationExtraArgs:
    """Adds annealed Gaussian noise to the updates.

    ``u = g + sqrt(eta / t^gamma) z`` with ``t`` the step (from 1) and ``z`` standard normal.
    Each element's draw is computed where it is used, inside the pass, from its place alone:
    Box-Muller on the Philox4x32-10 words (Salmon et al. 2011, cuRAND's default generator) of the
    counter ``(index in its dtype group, t, group)`` under the 64-bit ``key`` (53-bit uniforms:
    the tail reaches 8.6 standard deviations). So there is no buffer of draws and no pass to fill
    one, and a seed gives the same noise for any thread count, chunking or fusion (the CPU and the
    GPU agree to rounding; the draws differ from JAX's). Each element's normal is computed in
    float64 and rounded to its compute dtype. Complex leaves get complex normals (both values of
    a Box-Muller pair, each part of variance 1/2). The addition is a declared formula: in a chain
    it fuses with its neighbours.

    Args:
        eta: the variance of the noise at the first step (``>= 0``).
        gamma: the decay exponent of the variance.
        key: the seed, an int in ``[0, 2**64)``; None: 0, with optax's warning.
        seed: deprecated (optax's), the same as ``key``.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``AddNoiseState(count, rng_key)``, as
            in optax.

    Raises:
        TypeError: ``eta`` or ``gamma`` is not a real number, or the key is not an int.
        ValueError: ``eta`` is negative or NaN, the key is out of range, or both ``key`` and
            ``seed`` are given.

    References:
        Neelakantan et al., "Adding Gradient Noise Improves Learning for Very Deep Networks",
        2015 (arXiv:1511.06807). optax.add_noise.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.add_noise(eta=0.01, gamma=0.55, key=0)
        >>> g = {"w": np.zeros(100_000)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> round(float(np.std(u["w"])), 2)  # sqrt(0.01 / 1^0.55)
        0.1
        >>> u, state = tx.update(g, state)
        >>> round(float(np.std(u["w"])) ** 2 / 0.01, 2)  # the variance decays as 2^-0.55
        0.68
    """
    return _AddNoise(eta, gamma, _noise_key(key, seed)).transformation()


def _noise_key(key: Any, seed: Any) -> int:
    """optax's key or deprecated seed, as an int (0 with optax's warning when neither)."""
    if seed is not None:
        warnings.warn('"seed" is deprecated (as in optax), use "key".', DeprecationWarning, stacklevel=3)
        if key is not None:
            raise ValueError("Only one of seed or key can be specified.")
        key = seed
    if key is None:
        warnings.warn("add_noise: no key given, so the noise is seeded with 0 (as optax does)", stacklevel=3)
        key = 0
    return _check_seed(key, "key")


def noisy_sgd(
    learning_rate: ScalarOrSchedule,
    eta: float = 0.01,
    gamma: float = 0.55,
    key: int | None = None,
    *,
    seed: int | None = None,
) -> GradientTransformationExtraArgs:
    """SGD with annealed Gaussian gradient noise: ``chain(add_noise(eta, gamma, key),
    scale_by_learning_rate(learning_rate))``, one fused pass (each draw computed inside it).

    ``u = -lr (g + sqrt(eta / t^gamma) z)``, ``z`` standard normal (see `add_noise`).

    Args:
        learning_rate: a float, or a schedule of the step count.
        eta: the variance of the noise at the first step (``>= 0``).
        gamma: the decay exponent of the variance.
        key: the seed, an int; None: 0, with optax's warning.
        seed: deprecated (optax's), the same as ``key``.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(AddNoiseState(count, rng_key),
            EmptyState())`` (``ScaleByScheduleState`` last with a schedule).

    Raises:
        TypeError: a hyperparameter is not a real number (or a schedule where one may be), or
            the key is not an int.
        ValueError: ``eta`` is negative or NaN, or the key is out of range.

    References:
        Neelakantan et al., "Adding Gradient Noise Improves Learning for Very Deep Networks",
        2015 (arXiv:1511.06807). optax.noisy_sgd.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"x": np.array([1.0, 2.0, 3.0])}
        >>> tx = nba.noisy_sgd(learning_rate=0.003, key=0)
        >>> state = tx.init(params)
        >>> for _ in range(5):
        ...     state = nba.step_(tx, {"x": 2 * params["x"]}, state, params)
        >>> print(f"{float(np.sum(params['x'] ** 2)):.1f}")  # 14 before: each step -1.2% and noise
        13.2
    """
    return chain(add_noise(eta, gamma, _noise_key(key, seed)), scale_by_learning_rate(learning_rate))


# --- privacy accounting ------------------------------------------------------------------------


def dp_epsilon(
    noise_multiplier: float, sampling_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """The epsilon of DP-SGD after ``steps`` updates: the (epsilon, delta) guarantee of a
    Poisson-subsampled Gaussian mechanism composed ``steps`` times, from Google's
    ``dp-accounting`` (the ``dp`` extra: ``pip install numbaccum[dp]``).

    Each update of `dpsgd` (or `differentially_private_aggregate`) adds Gaussian noise of
    standard deviation ``noise_multiplier * l2_norm_clip`` to the sum of clipped per-example
    gradients; with each example in a batch with probability ``sampling_rate`` (batch size /
    dataset size), ``steps`` such updates are (epsilon, delta)-DP.

    Args:
        noise_multiplier: the noise's standard deviation over the clip norm (``>= 0``; 0 gives
            inf).
        sampling_rate: the probability of each example being in a batch, in ``[0, 1]``.
        steps: the number of noised updates (``>= 0``).
        delta: the delta of the guarantee, in ``(0, 1)``.
        accountant: ``'rdp'`` (Renyi DP, Mironov 2017; what Opacus and TensorFlow Privacy
            report by default) or ``'pld'`` (privacy loss distributions, tighter).

    Returns:
        epsilon, a float (inf when no finite guarantee holds).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range, or ``accountant`` unknown.
        ImportError: ``dp-accounting`` is not installed (naming the extra).

    References:
        Abadi et al., "Deep Learning with Differential Privacy", CCS 2016 (the moments
        accountant: q = 0.01, sigma = 4, delta = 1e-5, 10,000 steps gave epsilon = 1.26); Mironov,
        "Renyi Differential Privacy", CSF 2017; Google's dp_accounting library; Opacus'
        ``RDPAccountant`` and ``PRVAccountant``.

    Examples:
        >>> import numbaccum as nba
        >>> eps = nba.dp_epsilon(noise_multiplier=4.0, sampling_rate=0.01, steps=10_000, delta=1e-5)
        >>> round(eps, 3)  # Abadi et al.'s moments accountant: 1.26; RDP is tighter
        1.035
    """
    sigma = real(noise_multiplier, "noise_multiplier")
    if not sigma >= 0.0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    q = real(sampling_rate, "sampling_rate")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling_rate must be in [0, 1], got {sampling_rate!r}")
    if isinstance(steps, (bool, np.bool_)) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    d = real(delta, "delta")
    if not 0.0 < d < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if accountant not in ("rdp", "pld"):
        raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
    try:
        import dp_accounting
    except ImportError as e:
        raise ImportError(
            "dp_epsilon needs Google's dp-accounting library: pip install 'numbaccum[dp]'"
        ) from e
    if steps == 0 or q == 0.0:
        return 0.0
    if sigma == 0.0:
        return math.inf
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), int(steps)
    )
    acc = dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    return float(acc.get_epsilon(d))
