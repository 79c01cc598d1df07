"""Sharded optimizer state over MPI (ZeRO stage 1): `Sharded`, made by `numbaccum.distributed.shard`.

Every rank holds the whole model and computes gradients on its shard of the data, as in
replicated data parallelism, but each rank keeps the optimizer state of only ``1/n`` of the
parameters. A step (`Sharded.step_`, or ``numbaccum.step_(sharded, grads, state, params)``):

1. **Reduce-scatter** the gradients: one ``MPI_Reduce_scatter`` per bucket of each dtype buffer
   (``Reduce_scatter_block`` where every rank's count is the same), after which each rank holds
   the sum over ranks of its own part only;
2. runs the wrapped transformation on that part with ``numbaccum.step_``: the division by the
   number of ranks rides on its first kernel as a pending factor (as `allreduce_mean`'s does), and
   its last pass adds the update to this rank's part of the params;
3. **All-gathers** the parameters: one ``MPI_Allgatherv`` per bucket or round into the params'
   buffers, so every rank ends the step with the same bits.

Two partitions, chosen when the `Sharded` is made (`Sharded.partition`, also recorded in each
`ShardedState`: a state of one is refused by the other, with a ValueError):

**Even** (``"even"``), when every stage of the wrapped transformation is per element (the scope it
declares, `numbaccum.traits`: AdamW, Adam, SGD, Lion, ... and
`numbaccum.distributed.clip_by_global_norm`, with the combinators ``chain``, ``inject_hyperparams``,
``MultiSteps`` without a skip function, ``lookahead`` and ``conditionally_*`` around them;
`per_element`). Leaf boundaries do not matter then, so each bucket
of each dtype buffer is split evenly among the ranks in rank order (``m // n`` elements each, one
more for the first ``m % n``), cutting leaves: the send buffer of a bucket's ``Reduce_scatter`` is
the bucket itself, and every rank adds its share of every bucket (with whole leaves, one rank adds a
whole bucket while the others wait). Rank ``r``'s part is its pieces of all buckets: not contiguous
in the params, so the rank's optimizer state is a tree of one 1-D leaf per dtype group, its pieces
back to back (a tuple, in the params' group order). The received sums go straight into such a
buffer; each step copies the rank's pieces of the params into another (``1/n`` of the params'
bytes: params the caller changed between steps are taken as they are), runs the fused step there,
and each bucket's ``Allgatherv`` writes every rank's pieces, its own included, back into the params
(a bucket's pieces lie in rank order: ``Allgatherv``'s layout). The sharded clip's sum of squares
over the rank's pieces, added over the ranks, is the sum over every element once: exact, in
another order than the unsharded clip's (per rank in float64, then over the ranks in rank order),
so its norm may differ from ``numbaccum.clip_by_global_norm``'s in the last bits of the float64.

**Whole leaves** (``"leaves"``), when a stage is per leaf (masks, Adafactor, LAMB, per-leaf norms,
``partition``, ``flatten``). Within each dtype group (one contiguous buffer), rank ``r`` owns a
contiguous run of whole leaves, in leaf order, and the ranks' runs follow each other in rank order
(what ``Reduce_scatter`` and ``Allgatherv`` need). The cut between rank ``r - 1`` and rank ``r`` is
the leaf boundary nearest to ``r / n`` of the group's elements (ties: the lower one), so the parts
are balanced by element count to within about one leaf; a group with fewer leaves than ranks, or
one large leaf, leaves some ranks owning nothing of it (they still take part in every collective,
with a count of zero). Cutting inside leaves would make every per-leaf transformation (Adafactor's
factored moments, LAMB's trust ratio, per-leaf norms, masks by leaf) compute on pieces of leaves: a
wrong number. With whole leaves they are exact. The step runs on views of the params (the rank's run
is contiguous) and the all-gather is in place, in rounds that each carry a slice of every rank's
part.

On a rank, with whole leaves, the wrapped transformation sees a tree of the params' structure in
which the leaves the rank does not own are empty (shape ``(0,)``): a mask given as a tree still
matches, and a mask function decides the leaves the rank owns (what it says of an empty leaf
changes nothing).

Both give the same bits as ``chain(allreduce_mean(), tx)`` wherever the sums are added in the same
order (two ranks: ``a + b``, whatever the partition), and the same bits on every rank.

Transformations that reduce over the whole tree (`numbaccum.clip_by_global_norm`, ``dim='global'``
norms, `apply_if_finite`, L-BFGS, ...) would see only the rank's part on a shard: `shard` refuses
them, naming the stage, and accepts `numbaccum.distributed.clip_by_global_norm` with the same
communicator instead (its norm is combined over the ranks). Only transformations known to be
exact on a part of whole leaves are accepted (per element, per leaf, and the combinators around
them: what each stage declares, `numbaccum.traits`); user code, whose reductions cannot be seen,
is refused too.

This module holds the machinery; `numbaccum.distributed.shard` (which checks the communicator and
the bucket size) makes a `Sharded`.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np

from . import _config, lockstep, traits
from ._checks import transformation
from .apply import check_writable
from .backend import ops_for
from .base import Foreign, Stage, as_stage, chain, with_extra_args_support
from .contract import ONE, Factor
from .flat import FlatTree, layout_and_device
from .fuse import Scale
from .layout import Layout
from .passes import step_ as _step_
from .protocol import EmptyState, state_class
from .runner import stage_name
from .stats import stats
from .tree import short_repr, tree_flatten
from .updates import Spec

__all__ = ["Sharded", "ShardedState", "partition"]

_F32 = np.dtype(np.float32)


@state_class
class ShardedState(NamedTuple):
    """State of `numbaccum.distributed.shard`: this rank's part of the optimizer state.

    Attributes:
        inner: the wrapped transformation's state for this rank's part of the params, whose
            buffers hold about ``1/n`` of the unsharded state's elements: with whole leaves, of a
            tree of the params' structure whose leaves this rank does not own are empty (shape
            ``(0,)``); with the even partition, of a tuple of one 1-D leaf per dtype group.
        layout: the layout of the full params it was made for (a `numbaccum.layout.Layout`).
        rank: the rank that holds it.
        ranks: the number of ranks of the communicator.
        partition: ``"leaves"`` (each rank a run of whole leaves; ``inner`` is of the params'
            structure) or ``"even"`` (each bucket split evenly among the ranks; ``inner`` is of a
            tuple of one 1-D leaf per dtype group, this rank's pieces back to back): the
            partition of the `Sharded` that made it, which takes no state of the other.
    """

    inner: Any
    layout: Layout
    rank: int
    ranks: int
    partition: str = "leaves"


# --- the partition ----------------------------------------------------------------------------


def partition(layout: Layout, n: int) -> list[np.ndarray]:
    """Per dtype group, the ``n + 1`` element offsets ``bounds`` of the ranks' parts: rank ``r``
    owns ``[bounds[r], bounds[r + 1])`` of the group's buffer, a run of whole leaves.

    Balanced by element count over all groups: the groups are placed largest first, each split so
    that the ranks' totals come out as even as possible (water-filling: a group's share of each
    rank is what brings the ranks it reaches up to one level), each cut at the leaf boundary
    nearest to its ideal place (ties: the lower boundary) and never before the previous cut. One
    group alone is cut at the boundaries nearest to ``r / n`` of its elements.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> from numbaccum.sharded import partition
        >>> lay = nba.FlatTree.from_tree({"a": np.zeros(6, np.float32), "b": np.zeros(2, np.float32),
        ...                               "c": np.zeros(4, np.float32)}).layout
        >>> [b.tolist() for b in partition(lay, 2)]  # a | b, c: 6 and 6 elements
        [[0, 6, 12]]
    """
    out: list[np.ndarray] = [np.zeros(n + 1, np.int64)] * len(layout.offsets)
    load = np.zeros(n, np.float64)  # each rank's elements so far
    for g in sorted(range(len(layout.offsets)), key=lambda g: -int(layout.offsets[g][-1])):
        off = layout.offsets[g]
        total = int(off[-1])
        share = _water_fill(load, total)
        ideal = np.cumsum(share)
        bounds = np.zeros(n + 1, np.int64)
        bounds[n] = total
        prev = 0
        for r in range(1, n):
            target = ideal[r - 1]
            j = int(np.searchsorted(off, target))  # off[j - 1] < target <= off[j]
            if j > 0 and (j == len(off) or target - off[j - 1] <= off[j] - target):
                j -= 1
            j = max(j, prev)
            bounds[r] = off[j]
            prev = j
        load += np.diff(bounds)
        out[g] = bounds
    return out


def _water_fill(load: np.ndarray, total: int) -> np.ndarray:
    """Each rank's share of ``total`` elements that brings the least loaded ranks up to one level
    (ranks above it get none): the shares sum to ``total``."""
    order = np.sort(load)
    level = float(order[-1])
    for k in range(1, len(order) + 1):
        level = (total + float(order[:k].sum())) / k
        if k == len(order) or level <= order[k]:
            break
    share = np.maximum(level - load, 0.0)
    return share * (total / share.sum()) if share.sum() > 0 else share


class _Plan:
    """What a `Sharded` derives once per params layout: the parts, the shard's layout, the
    buckets of each group, and (whole leaves) where each leaf lives."""

    def __init__(self, layout: Layout, rank: int, n: int, bucket_bytes: int, even: bool = False) -> None:
        self.layout = layout
        self.local = threading.local()  # receive buffers and packed trees, per thread
        self.half = any(d.itemsize == 2 for d in layout.group_dtypes)
        self.even = even and n > 1  # one rank: the whole-leaf plan is the whole (the same thing)
        self.rank = rank
        if self.even:
            self._even(layout, rank, n, bucket_bytes)
            return
        self.bounds = partition(layout, n)
        self.lo = [int(b[rank]) for b in self.bounds]
        self.hi = [int(b[rank + 1]) for b in self.bounds]
        owner = [0] * layout.num_leaves
        for g, members in enumerate(layout.groups):
            b = self.bounds[g]
            for leaf in members:
                start = layout.leaf_start[leaf]
                # the last rank whose run starts at or before the leaf (runs hold whole leaves;
                # an empty leaf at a cut goes to one of the ranks there: exactly one owner)
                owner[leaf] = min(int(np.searchsorted(b, start, side="right")) - 1, n - 1)
        self.owner = owner
        shapes = [s if owner[i] == rank else (0,) for i, s in enumerate(layout.shapes)]
        self.shard = Layout.get(layout.treedef, shapes, layout.dtypes, layout.group_keys)
        # Per group, the buckets of the reduce-scatter: (lo, hi) of the buffer, each rank's count,
        # and this rank's received run relative to its part. Contiguous: ``Reduce_scatter``
        # takes the ranks' blocks back to back (a slice of every part per round would need a
        # packed copy: measured slower, 94 ms against 67 for 62M float32 on 2 ranks).
        # (The even plan's tuples have two more items: `_even`.)
        self.buckets: list[list[tuple]] = []
        for g, dt in enumerate(layout.group_dtypes):
            wire = _F32.itemsize if dt.itemsize == 2 else dt.itemsize
            step = max(1, min(bucket_bytes // wire, int(_config.MPI_MAX_COUNT)))
            b = self.bounds[g]
            runs = []
            for a in range(0, layout.group_sizes[g], step):
                z = min(layout.group_sizes[g], a + step)
                starts = np.clip(b[:-1], a, z)
                ends = np.clip(b[1:], a, z)
                counts = (ends - starts).astype(np.int64)
                mine = (
                    (int(starts[rank]) - self.lo[g], int(ends[rank]) - self.lo[g]) if counts[rank] else (0, 0)
                )
                runs.append((a, z, counts, mine))
            self.buckets.append(runs)
        # Per group, the rounds of the all-gather: each carries a slice of every rank's part
        # (``Allgatherv`` places blocks anywhere in the buffer), so that every rank sends and
        # receives in every round: 0.6x the time of contiguous buckets, where one rank at a time
        # sends (2 ranks, 62M float32, 16 MiB).
        self.gathers = []
        for g, dt in enumerate(layout.group_dtypes):
            b = self.bounds[g]
            parts = np.diff(b)
            per_rank = max(1, min(bucket_bytes // dt.itemsize, int(_config.MPI_MAX_COUNT)) // n)
            k = max(1, -(-int(parts.max()) // per_rank)) if parts.max() else 0
            s = -(-parts // max(k, 1))
            rounds = []
            for j in range(k):
                starts = np.minimum(b[:-1] + j * s, b[1:])
                ends = np.minimum(starts + s, b[1:])
                rounds.append(((ends - starts).astype(np.int64), starts.astype(np.int64)))
            self.gathers.append(rounds)

    def _even(self, layout: Layout, rank: int, n: int, bucket_bytes: int) -> None:
        """The even partition: each bucket of each group split among the ranks in rank order,
        ``m // n`` elements each and one more for the first ``m % n`` ranks; this rank's pieces
        back to back make its shard, a tuple of one 1-D leaf per group."""
        self.buckets = []
        sizes = []
        for g, dt in enumerate(layout.group_dtypes):
            wire = _F32.itemsize if dt.itemsize == 2 else dt.itemsize
            step = max(1, min(bucket_bytes // wire, int(_config.MPI_MAX_COUNT)))
            runs, pos = [], 0
            for a in range(0, layout.group_sizes[g], step):
                z = min(layout.group_sizes[g], a + step)
                m = z - a
                counts = np.full(n, m // n, np.int64)
                counts[: m % n] += 1
                displs = np.concatenate([[0], np.cumsum(counts[:-1])]).astype(np.int64)
                c = int(counts[rank])
                # (bucket start, end, counts, this rank's (lo, hi) in the shard, displacements,
                # whether every count is the same)
                runs.append((a, z, counts, (pos, pos + c), displs, m % n == 0))
                pos += c
            self.buckets.append(runs)
            sizes.append(pos)
        dts = layout.group_dtypes
        td = tree_flatten(tuple(np.empty(0, d) for d in dts))[1]
        self.shard = Layout.get(td, [(k,) for k in sizes], dts, dts)

    def take(self, full: FlatTree, part: FlatTree) -> None:
        """``part`` (of the shard's layout) = this rank's part of ``full`` (of the params')."""
        if not self.even:
            for dst, src, lo, hi in zip(part.groups, full.groups, self.lo, self.hi):
                dst[...] = src[lo:hi]
            return
        for gi, (dst, src) in enumerate(zip(part.groups, full.groups)):
            for a, _, _, (lo, hi), displs, _ in self.buckets[gi]:
                at = a + int(displs[self.rank])
                dst[lo:hi] = src[at : at + hi - lo]

    def kept(self, name: str, layout: Layout) -> FlatTree:
        bufs = self.local.__dict__.setdefault("bufs", {})
        buf = bufs.get(name)
        if buf is None:
            buf = bufs[name] = FlatTree.zeros(layout)
        return buf

    def wire(self, name: str, n: int) -> np.ndarray:
        """A float32 buffer of at least ``n`` elements (two names: two buffers, never aliased:
        MPI refuses a send buffer that is the receive buffer)."""
        wires = self.local.__dict__.setdefault("wires", {})
        w = wires.get(name)
        if w is None or w.size < max(n, 1):
            w = wires[name] = np.empty(max(n, 1), _F32)
        return w[:n]

    def view(self, params: FlatTree) -> FlatTree:
        """This rank's part of ``params``, as a FlatTree of the shard's layout whose buffers are
        views of ``params``' (made once per params storage)."""
        views = params.__dict__.setdefault("_shard_views", {})
        key = (self.shard, tuple(self.lo))
        v = views.get(key)
        if v is None:
            groups = [g[lo:hi] for g, lo, hi in zip(params.groups, self.lo, self.hi)]
            v = views[key] = FlatTree(self.shard, groups, {np.dtype(g.dtype): g for g in groups})
        return v


# --- the transformations a shard accepts ---------------------------------------------------------

# From each stage's declared `numbaccum.traits`: per element and per leaf are exact on a part of
# whole leaves; a reduction over the whole tree is refused, with what to use instead (by name).
_GLOBAL_NORM = "dim='global': use numbaccum.distributed.clip_by_global_norm(max_norm, comm) for a global clip"
_INSTEAD = {
    "clip_by_global_norm": "use numbaccum.distributed.clip_by_global_norm(max_norm, comm) with the shard's "
    "communicator: its norm is combined over the ranks",
    "rescale": _GLOBAL_NORM,  # clip_norm and normalize_norm
    "centralize(dim='global')": _GLOBAL_NORM,
    "apply_if_finite": "ranks would decide to skip the step apart",
    "aggregate": "its per-example clipping and noise are of the whole tree",
    "add_noise": "its noise is drawn by element position: every rank's part would get the same noise",
}


def check_shardable(stage: Stage, comm: Any, combined: tuple, refused: tuple, where: str = "tx") -> None:
    """Raises TypeError naming the first stage of ``stage`` that would not be exact on a part of
    whole leaves (see the module docstring): one whose declared scope is the whole tree, or that
    declares none (user code). ``combined``: stage classes whose reduction is combined over a
    communicator (accepted with ``comm``'s group); ``refused``: collectives of their own
    (`allreduce_mean`)."""
    name = stage_name(stage)
    if isinstance(stage, refused):
        raise TypeError(
            f"shard: {where} holds {name}, a collective of its own; shard already averages the "
            f"gradients over the ranks: leave it out"
        )
    if isinstance(stage, combined):
        MPI = _mpi()
        if comm.Compare(stage.comm) not in (MPI.IDENT, MPI.CONGRUENT):
            raise ValueError(
                f"shard: {where} holds {name} over another communicator than the shard's; pass it "
                f"the same communicator"
            )
        return
    kind = traits.scope(stage)
    if kind == traits.TREE:
        hint = _INSTEAD.get(name, "")
        raise TypeError(
            f"shard: {where} holds {name}, a reduction over the whole tree: on a shard it would "
            f"see only this rank's leaves" + (f" ({hint})" if hint else "")
        )
    if kind is None:
        what = "a transformation that is not numbaccum's" if isinstance(stage, Foreign) else name
        raise TypeError(
            f"shard: {where} holds {what}, which is not known to be exact on a part of the leaves "
            f"(sharding accepts per-element and per-leaf transformations; one that reduces over "
            f"the whole tree would see only this rank's leaves)"
        )
    for inner in traits.children(stage):
        if getattr(stage, "joins_leaves", False):  # one vector of the leaves: per element only
            _only_per_element(inner, f"{where}'s {name}", combined + refused)
        else:
            check_shardable(inner, comm, combined, refused, where)


def per_element(stage: Stage, combined: tuple) -> bool:
    """Whether every stage of ``stage`` is per element (a declared scope of `ELEMENT
    <numbaccum.traits.ELEMENT>`, or a norm combined over the ranks): then leaf boundaries do not
    matter, and a shard may cut leaves (the even partition)."""
    if isinstance(stage, combined):
        return True
    kids = traits.children(stage)
    return traits.scope(stage) == traits.ELEMENT and all(per_element(s, combined) for s in kids)


def _only_per_element(stage: Stage, where: str, collectives: tuple) -> None:
    if isinstance(stage, collectives) or traits.scope(stage) != traits.ELEMENT:
        raise TypeError(
            f"shard: {where} runs {stage_name(stage)} on the leaves as one vector: on a shard the "
            f"vector would be only this rank's leaves"
        )
    for inner in traits.children(stage):
        _only_per_element(inner, where, collectives)


def _mpi() -> Any:
    from mpi4py import MPI  # the communicator exists, so mpi4py is installed

    return MPI


# --- the division by the number of ranks, as a pending factor ------------------------------------


class _Mean(Stage):
    """``u = g / n``: a pending factor on the reduce-scattered sums (no pass of its own), the
    factor `allreduce_mean` leaves on its output; ``n == 1``: nothing."""

    complex_leaves = True
    public_name = "shard's mean over ranks"
    scope = traits.ELEMENT

    def __init__(self, n: int) -> None:
        self.factor = Factor(float(n), 1.0) if n > 1 else ONE

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def declare(self, spec: Spec, state: Any) -> Scale:
        part = Scale(self.factor, None, "mean over ranks")

        def tick(state: Any, params: Any, extra: dict) -> bool:
            part.new_state = state
            return True

        part.tick = tick
        return part


_EMPTY = EmptyState()


# --- the sharded step -----------------------------------------------------------------------------


class Sharded:
    """A transformation whose optimizer state is sharded over the ranks of a communicator (ZeRO
    stage 1); made by `numbaccum.distributed.shard`, whose docstring says what it does.

    Methods: `init` (collective), `step_` (collective; also ``numbaccum.step_(sharded, ...)``),
    `gather_state` and `scatter_state` (collective: checkpoints of the whole state). It has no
    ``update``: a step ends with the params all-gathered, so it is not a stage of a chain.

    Attributes:
        tx: the wrapped transformation.
        comm: the communicator.
        rank: this rank.
        ranks: the number of ranks.
        bucket_bytes: bytes per message.
        partition: ``"even"`` (every stage per element: each bucket split evenly among the
            ranks) or ``"leaves"`` (each rank a run of whole leaves); see the module docstring.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import shard
        >>> opt = shard(nba.adam(0.1), MPI.COMM_SELF)
        >>> params = {"w": np.zeros(3, np.float32)}
        >>> state = opt.step_({"w": np.ones(3, np.float32)}, opt.init(params), params)
        >>> [round(float(x), 4) for x in params["w"]]
        [-0.1, -0.1, -0.1]
        >>> whole = opt.gather_state(state)  # what nba.adam(0.1)'s own state would be
        >>> int(whole[0].count), [round(float(x), 4) for x in whole[0].mu["w"]]
        (1, [0.1, 0.1, 0.1])
    """

    def __init__(
        self, tx: Any, comm: Any, bucket_bytes: int, check: Any, combined: tuple, refused: tuple
    ) -> None:
        tx = with_extra_args_support(transformation(tx, "tx"))
        stage = as_stage(tx)
        if stage.reshapes:
            raise TypeError("shard: tx must not change the updates' shape (per-example aggregation)")
        check_shardable(stage, comm, combined, refused)
        self.partition = "even" if per_element(stage, combined) else "leaves"
        self.tx = tx
        self.comm = comm
        self.rank, self.ranks = comm.Get_rank(), comm.Get_size()
        self.bucket_bytes = bucket_bytes
        self._check = check  # collective: the same layout and bucket size on every rank
        # The division by n rides on the first kernel; a tree with float16 or bfloat16 groups
        # is divided on the host as the sums arrive (as `allreduce_mean` does).
        self._chains = {half: chain(_Mean(1 if half else self.ranks), tx) for half in (False, True)}
        self._plans: dict[Layout, _Plan] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Sharded({short_repr(self.tx, 60)}, rank {self.rank} of {self.ranks}, {self.partition})"

    def _plan(self, layout: Layout) -> _Plan:
        plan = self._plans.get(layout)
        if plan is None:
            with self._lock:
                plan = self._plans.get(layout)
                if plan is None:
                    if len(self._plans) >= max(_config.KEPT_LAYOUTS, 2):
                        del self._plans[next(iter(self._plans))]
                    plan = self._plans[layout] = _Plan(
                        layout, self.rank, self.ranks, self.bucket_bytes, self.partition == "even"
                    )
        return plan

    # --- init ---------------------------------------------------------------------------------

    def init(self, params: Any) -> ShardedState:
        """This rank's part of the optimizer state for ``params`` (collective).

        Args:
            params: the full params (a tree of host arrays, or a FlatTree), the same layout on
                every rank.

        Returns:
            A `ShardedState`: the wrapped transformation's state for this rank's leaves.

        Raises:
            TypeError: ``params`` are CUDA arrays (not supported: pass host buffers), or not a
                tree of float arrays.
            ValueError: the ranks' params differ in structure, shapes or dtypes, or their bucket
                sizes or the schedules in ``tx`` (MultiSteps' ``every_k_schedule``) differ (the
                same error on every rank).
        """
        layout, device = layout_and_device(params, "params")
        _host_only(device, "params")
        self._check(layout)
        plan = self._plan(layout)
        full = params if isinstance(params, FlatTree) else FlatTree.from_tree(params)
        part = FlatTree.empty(plan.shard)  # a copy: a state never aliases the caller's params
        plan.take(full, part)
        with lockstep.recording() as notes:  # the schedules inside tx (MultiSteps' k)
            inner = self.tx.init(part)
        lockstep.check_same_schedule(self.comm, [n.describe() for n in notes], "shard")
        return ShardedState(inner, layout, self.rank, self.ranks, self.partition)

    # --- the step -------------------------------------------------------------------------------

    def step_(self, grads: Any, state: ShardedState, params: Any, **extra_args: Any) -> ShardedState:
        """One step: gradients reduce-scattered, the wrapped transformation's step on this rank's
        part (its update added to the params there: with the even partition, to a copy of this
        rank's pieces of them), the params all-gathered into their buffers (collective: every
        rank calls it, the same number of times).

        Args:
            grads: this rank's gradients (a tree, or a FlatTree of the params' layout).
            state: this rank's `ShardedState` (consumed, like ``update``'s).
            params: the full params (a FlatTree, or a tree of writable NumPy arrays), changed in
                place; the same bits on every rank after the step.
            **extra_args: passed to the wrapped transformation.

        Returns:
            The new `ShardedState`.

        Raises:
            TypeError: ``state`` is not a `ShardedState`, ``grads`` or ``params`` are not trees
                of the state's layout or are CUDA arrays, a leaf of ``params`` cannot change in
                place; and what the wrapped transformation raises for its state. All before any
                buffer of the caller or the state is written.
            ValueError: ``state`` was made on another rank, for other params, or by a shard of
                the other partition; or the ranks are out of step: their states' step counters
                differ (resumed from checkpoints of different steps, MultiSteps with another
                ``k``), raised on every rank before any buffer is written.
        """
        if not isinstance(state, ShardedState):
            raise TypeError(
                f"state must be the ShardedState of this shard's init, got {type(state).__name__} "
                f"{short_repr(state, 40)}"
            )
        if state.rank != self.rank or state.ranks != self.ranks:
            raise ValueError(
                f"state: made on rank {state.rank} of {state.ranks}, used on rank {self.rank} of "
                f"{self.ranks}; load each rank's own state (or scatter_state a gathered one)"
            )
        if state.partition != self.partition:
            raise ValueError(
                f"state: a state of the {state.partition!r} partition, used by a shard of the "
                f"{self.partition!r} partition (another transformation's state?)"
            )
        layout = state.layout
        plan = self._plan(layout)
        g = _flat_of(grads, layout, "grads", plan, "grads")
        p, packed = _params_of(params, layout, plan)
        if self.ranks > 1:
            _check_in_step(self.comm, state.inner)
        if self.ranks == 1:  # the part is the whole: the wrapped step on the buffers themselves
            inner = _step_(self._chains[plan.half], g, (_EMPTY, state.inner), p, **extra_args)[1]
        elif plan.even:
            summed = plan.kept("summed", plan.shard)
            self._reduce_scatter(plan, g, summed)
            mine = plan.kept("mine", plan.shard)  # this rank's pieces of the params, back to back
            plan.take(p, mine)
            inner = _step_(self._chains[plan.half], summed, (_EMPTY, state.inner), mine, **extra_args)[1]
            self._allgather_even(plan, mine, p)
        else:
            summed = plan.kept("summed", plan.shard)
            self._reduce_scatter(plan, g, summed)
            inner = _step_(
                self._chains[plan.half], summed, (_EMPTY, state.inner), plan.view(p), **extra_args
            )[1]
            self._allgather(plan, p)
        if packed is not None:
            for dst, src in zip(packed, p.leaf_views()):
                dst[...] = src
        return ShardedState(inner, layout, self.rank, self.ranks, self.partition)

    def _numbaccum_step_(self, grads: Any, state: Any, params: Any, **extra_args: Any) -> Any:
        """`numbaccum.step_`'s entry for a `Sharded` (see `step_`)."""
        return self.step_(grads, state, params, **extra_args)

    def _reduce_scatter(self, plan: _Plan, g: FlatTree, out: FlatTree) -> None:
        """``out`` = the sum over ranks of this rank's part of ``g`` (float16 and bfloat16: in
        float32, divided by n and rounded once; other groups of such a tree divided on the host
        too), one ``Reduce_scatter`` per bucket (``Reduce_scatter_block`` where the counts
        agree)."""
        comm, MPI, n = self.comm, _mpi(), self.ranks
        for gi, (x, y) in enumerate(zip(g.groups, out.groups)):
            half = x.dtype.itemsize == 2
            ops = ops_for(y) if plan.half and not half else None
            for a, z, counts, (lo, hi), *even in plan.buckets[gi]:
                block = bool(even and even[1])  # every rank's count the same
                if half:
                    w = plan.wire("send", z - a)
                    w[...] = x[a:z]
                    r = plan.wire("recv", hi - lo)
                    if block:
                        comm.Reduce_scatter_block(w, r, op=MPI.SUM)
                    else:
                        comm.Reduce_scatter(w, r, counts, op=MPI.SUM)
                    np.divide(r, np.float32(n), out=r)
                    y[lo:hi] = r
                else:
                    if block:
                        comm.Reduce_scatter_block(x[a:z], y[lo:hi], op=MPI.SUM)
                    else:
                        comm.Reduce_scatter(x[a:z], y[lo:hi], counts, op=MPI.SUM)
                    if ops is not None:
                        d = y[lo:hi]
                        ops.scale_(d, d, Factor(float(n), 1.0))

    def _allgather(self, plan: _Plan, p: FlatTree) -> None:
        """Every rank's part of ``p`` to every rank, in place: one ``Allgatherv`` per round, each
        round a slice of every rank's part (`_Plan.gathers`)."""
        comm, MPI = self.comm, _mpi()
        for gi, x in enumerate(p.groups):
            if x.dtype.itemsize == 2:  # float16 and bfloat16 travel as their bits
                x = x.view(np.uint16)
            for counts, displs in plan.gathers[gi]:
                comm.Allgatherv(MPI.IN_PLACE, [x, (counts, displs)])

    def _allgather_even(self, plan: _Plan, mine: FlatTree, p: FlatTree) -> None:
        """Every rank's pieces of each bucket into ``p``'s bucket, in rank order (this rank's
        own piece included): one ``Allgatherv`` per bucket (``Allgather`` when the counts agree)."""
        comm = self.comm
        for gi, (x, y) in enumerate(zip(mine.groups, p.groups)):
            if x.dtype.itemsize == 2:  # float16 and bfloat16 travel as their bits
                x, y = x.view(np.uint16), y.view(np.uint16)
            for a, z, counts, (lo, hi), displs, block in plan.buckets[gi]:
                if block:
                    comm.Allgather(x[lo:hi], y[a:z])
                else:
                    comm.Allgatherv(x[lo:hi], [y[a:z], (counts, displs)])

    # --- checkpoints of the whole state -----------------------------------------------------------

    def gather_state(self, state: ShardedState, root: int = 0) -> Any:
        """The whole (unsharded) state on ``root``, as ``tx.init(params)`` on one process would
        hold it, assembled from every rank's part (collective); None on the other ranks.

        Each buffer of the state laid out per leaf of the params comes leaf by leaf from the
        rank that owns the leaf (the even partition: bucket by bucket, each rank's pieces, one
        ``Gatherv`` each, into the full layout's buffers); the other fields (step counts,
        hyperparameters) are the same on every rank and come from ``root``'s. Save it with
        `numbaccum.save_state`; `scatter_state` gives each rank its part back.

        Raises:
            TypeError: ``state`` is not a `ShardedState` of this rank.
            ValueError: a buffer of the state is not laid out per leaf of the params (a masked
                transformation's inner state, a flattened one): save each rank's part instead.
        """
        self._own(state)
        plan = self._plan(state.layout)
        template = None
        if self.rank == root:
            template = self.tx.init(FlatTree.zeros(plan.layout))
        return _Transfer(self, plan, root, gather=True).walk(template, state.inner, "state")

    def scatter_state(self, full: Any, params: Any, root: int = 0) -> ShardedState:
        """This rank's `ShardedState` from the whole state ``full`` held on ``root`` (what
        `gather_state` gave, or the state of an unsharded run of the same transformation;
        ignored on the other ranks), collective. ``params``: the full params (for the layout).

        Raises:
            ValueError: as `gather_state`, or ``full`` does not have the structure of this
                transformation's state.
        """
        mine = self.init(params)
        plan = self._plan(mine.layout)
        inner = _Transfer(self, plan, root, gather=False).walk(
            full if self.rank == root else None, mine.inner, "state"
        )
        return mine._replace(inner=inner)

    def _own(self, state: Any) -> None:
        if not isinstance(state, ShardedState) or state.rank != self.rank or state.ranks != self.ranks:
            raise TypeError(f"state must be this rank's ShardedState, got {short_repr(state, 60)}")


class _Transfer:
    """Walks the whole state (on ``root``) and this rank's part side by side, moving each
    per-leaf buffer's leaves between their owners and ``root``. Every rank walks the same
    structure (its part's), so the messages pair up in order."""

    def __init__(self, sharded: Sharded, plan: _Plan, root: int, gather: bool) -> None:
        self.comm, self.rank, self.root = sharded.comm, sharded.rank, root
        self.plan, self.gather = plan, gather

    def walk(self, full: Any, part: Any, path: str) -> Any:
        """Gathering: the whole state on ``root`` (None elsewhere); scattering: this rank's part
        with ``full``'s values."""
        at_root = self.rank == self.root
        keep = at_root or not self.gather  # whether this rank builds a result
        if isinstance(part, FlatTree):
            self._leaves(full if at_root else None, part, path)
            return (full if self.gather else part) if keep else None
        if isinstance(part, (tuple, list, dict)) and at_root:
            _same_kind(full, part, path)
        if isinstance(part, tuple) and hasattr(part, "_fields"):
            kids = [
                self.walk(getattr(full, f) if at_root else None, v, f"{path}.{f}")
                for f, v in zip(part._fields, part)
            ]
            return type(part)(*kids) if keep else None
        if isinstance(part, (tuple, list)):
            kids = [self.walk(full[i] if at_root else None, v, f"{path}[{i}]") for i, v in enumerate(part)]
            return type(part)(kids) if keep else None
        if isinstance(part, dict):
            by_key = {
                k: self.walk(full[k] if at_root else None, v, f"{path}[{k!r}]") for k, v in part.items()
            }
            return by_key if keep else None
        # a leaf: a count, a hyperparameter, a NumPy array (the same on every rank): root's
        if self.gather:
            return part if at_root else None
        return self.comm.bcast(full if at_root else None, root=self.root)

    def _leaves(self, full: FlatTree | None, part: FlatTree, path: str) -> None:
        plan = self.plan
        ok = part.layout.treedef == plan.shard.treedef and part.layout.num_leaves == plan.shard.num_leaves
        if self.rank == self.root and ok:
            ok = isinstance(full, FlatTree) and full.layout.treedef == plan.layout.treedef
        if not all(self.comm.allgather(ok)):
            raise ValueError(
                f"{path}: a buffer that is not laid out per leaf of the params (a masked or "
                f"flattened transformation's); save each rank's ShardedState with "
                f"numbaccum.save_state instead"
            )
        if plan.even:
            self._pieces(full, part)
            return
        comm, root, rank = self.comm, self.root, self.rank
        for i, owner in enumerate(plan.owner):
            if rank != root and owner != rank:
                continue
            mine = part.leaf(i)
            if rank == root:
                dst = full.leaf(i)  # type: ignore[union-attr]
                if owner == root:
                    if self.gather:
                        dst[...] = mine
                    else:
                        mine[...] = dst
                elif self.gather:
                    if dst.size:
                        comm.Recv(_wire(dst), source=owner, tag=7)
                elif dst.size:
                    comm.Send(_wire(np.ascontiguousarray(dst)), dest=owner, tag=7)
            elif owner == rank and mine.size:
                if self.gather:
                    comm.Send(_wire(np.ascontiguousarray(mine)), dest=root, tag=7)
                else:
                    comm.Recv(_wire(mine), source=root, tag=7)

    def _pieces(self, full: FlatTree | None, part: FlatTree) -> None:
        """The even partition: per dtype group of the params, each bucket's pieces gathered onto
        ``root`` in rank order (``Gatherv``, the all-gather's layout) or scattered from it, through
        the group's elements as one vector on ``root``."""
        comm, root, plan = self.comm, self.root, self.plan
        lay = plan.layout
        at_root = self.rank == root
        for g, members in enumerate(lay.groups):
            mine = part.leaf(g)
            vec = np.empty(lay.group_sizes[g], mine.dtype) if at_root else None
            if at_root and not self.gather:
                assert vec is not None and full is not None  # (root holds the whole state)
                for i in members:
                    s = lay.leaf_start[i]
                    vec[s : s + lay.sizes[i]] = full.leaf(i).reshape(-1)
            for a, z, counts, (lo, hi), displs, _ in plan.buckets[g]:
                there = [_wire(vec[a:z]), (counts, displs)] if vec is not None else None  # root's
                if self.gather:
                    comm.Gatherv(_wire(mine[lo:hi]), there, root=root)
                else:
                    comm.Scatterv(there, _wire(mine[lo:hi]), root=root)
            if at_root and self.gather:
                assert vec is not None and full is not None  # (root holds the whole state)
                for i in members:
                    s = lay.leaf_start[i]
                    full.leaf(i)[...] = vec[s : s + lay.sizes[i]].reshape(lay.shapes[i])


def _check_in_step(comm: Any, inner: Any) -> None:
    """The same ValueError on every rank unless the step counters of every rank's state agree:
    its integers (step counts, MultiSteps' counters; not its buffers), which are the same on every
    rank of a run in step, in one tiny ``Allreduce`` (`numbaccum.lockstep`); the message names
    them as `numbaccum.stats` does."""

    def describe() -> list[str]:
        return [f"state.inner's {k} {v}" for k, v in stats(inner).items() if type(v) is int]

    lockstep.check_in_step(comm, tuple(_counters(inner, [])), describe, "shard")


def _counters(x: Any, out: list) -> list:
    """The integers of a state (not bools), in walk order: a walk with no names, every step."""
    if isinstance(x, (tuple, list)):
        for v in x:
            _counters(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _counters(v, out)
    elif isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        out.append(int(x))
    elif isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iu":
        out.append(int(x))
    return out


def _wire(a: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes as MPI can send them (float16 and bfloat16 as uint16)."""
    flat = a.reshape(-1)
    return flat.view(np.uint16) if a.dtype.itemsize == 2 else flat


def _same_kind(full: Any, part: Any, path: str) -> None:
    if type(full) is not type(part) or len(full) != len(part):
        raise ValueError(
            f"{path}: the whole state has {short_repr(full, 60)} where this transformation's state "
            f"has a {type(part).__name__} of {len(part)}"
        )


# --- arguments ------------------------------------------------------------------------------------


def _host_only(device: bool, name: str) -> None:
    if device:
        raise TypeError(
            f"{name}: CUDA arrays are not supported by shard yet; pass host (NumPy) buffers, or use "
            f"chain(allreduce_mean(), tx), which stages CUDA buffers through the host"
        )


def _flat_of(tree: Any, layout: Layout, name: str, plan: _Plan, kept: str) -> FlatTree:
    """``tree`` as a host FlatTree of ``layout``: itself, or packed into a buffer kept for it."""
    if isinstance(tree, FlatTree):
        _host_only(tree.device, name)
        if tree.layout is not layout or tree.group_dtypes != layout.group_dtypes:
            raise ValueError(
                f"{name}: a FlatTree of {tree.layout}, {tree.group_dtypes}; the state is of {layout}"
            )
        return tree
    got, device = layout_and_device(tree, name)
    _host_only(device, name)
    if got is not layout:
        raise ValueError(f"{name}: a tree of {got}; the state was made for params of {layout}")
    return plan.kept(kept, layout).assign_(tree)


def _params_of(params: Any, layout: Layout, plan: _Plan) -> tuple[FlatTree, list | None]:
    """The params as a writable host FlatTree of ``layout``, and the caller's leaves to copy
    back into (None: the params are that FlatTree)."""
    p = _flat_of(params, layout, "params", plan, "params")
    check_writable(params, "params")  # names the leaf that cannot change
    return (p, None) if p is params else (p, tree_flatten(params)[0])
