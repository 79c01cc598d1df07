"""`masked`: run a transformation on some leaves of the tree, pass the others through.

The usual use is keeping biases and norm scales out of weight decay::

    decay = masked(add_decayed_weights(1e-4), lambda p: tree_map(lambda x: x.ndim > 1, p))

The inner transformation sees the tree with every masked-out subtree (under each False leaf of
the mask, a prefix of the tree) replaced by one `MaskedNode` (an empty node, as in optax), so its
state holds only the kept leaves. The mask is resolved once per tree layout into the leaves it
keeps; a run of consecutive kept leaves of one dtype is one contiguous range of the flat
buffers, so moving the kept leaves in and out of the inner transformation is one copy per range,
not per leaf.

`partition` (optax's ``multi_transform``) runs one transformation per label on the leaves that
carry it; `conditionally_transform` and `conditionally_mask` mask in time: the inner
transformation runs at the steps a condition allows; `flatten` shows the inner transformation
the whole tree as one vector.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from . import _bounded, fuse
from ._checks import flag, transformation, wrong_state
from .base import Chain, Stage, as_stage, undoable, with_extra_args_support
from .control import Inner
from .contract import ONE
from .declared import safe_increment
from .flat import FlatTree, Workspace, layout_of
from .layout import Layout
from .protocol import GradientTransformationExtraArgs, state_class
from .traits import ELEMENT, LEAF
from .tree import broadcast_prefix, short_repr, tree_flatten, tree_map, tree_unflatten
from .updates import ParamsRef, SkipStep, Spec, Updates

__all__ = [
    "ConditionallyMaskState",
    "ConditionallyTransformState",
    "MaskedNode",
    "MaskedState",
    "MultiTransformState",
    "PartitionState",
    "conditionally_mask",
    "conditionally_transform",
    "flatten",
    "masked",
    "multi_transform",
    "partition",
]


@state_class
class MaskedNode(NamedTuple):
    """A masked-out subtree, as the inner transformation of `masked` sees it: an empty node.

    It has no fields and no leaves, so the inner transformation's state holds nothing for the
    subtree it replaces (optax's ``MaskedNode``).
    """


@state_class
class MaskedState(NamedTuple):
    """The state of `masked`: the inner transformation's state, over the kept leaves only.

    Attributes:
        inner_state: the inner transformation's state, initialised on the params with each
            masked-out subtree replaced by a `MaskedNode`.
    """

    inner_state: Any


class _Plan(NamedTuple):
    """A mask resolved for one layout."""

    keep: tuple[bool, ...]  # per leaf of the full layout
    kept: tuple[int, ...]  # indices of the kept leaves
    sub: Layout  # the layout of the tree the inner transformation sees
    # (group, start, stop, sub_group, sub_start) per maximal run of consecutive kept leaves
    runs: tuple[tuple[int, int, int, int, int], ...]
    # (group, start, stop) per maximal run of consecutive masked-out leaves
    gaps: tuple[tuple[int, int, int], ...]


def _standins(layout: Layout) -> Any:
    """A tree of read-only zero-stride arrays of the layout's shapes and dtypes (no memory): what
    a callable mask is given, so that it is called once per layout (optax calls it on traced
    values under ``jit``: a mask may depend on shapes, dtypes and paths, not on values)."""
    leaves = [np.broadcast_to(np.zeros((), d), s) for s, d in zip(layout.shapes, layout.dtypes)]
    return tree_unflatten(layout.treedef, leaves)


def _mask_leaf(value: Any, where: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype == np.bool_:
        return bool(value)
    raise TypeError(f"{where}: a mask leaf must be a bool, got {type(value).__name__} {value!r:.40}")


def _mask_pytree(mask: Any, tree: Any) -> Any:
    """``tree`` with each subtree under a False leaf of the ``mask`` prefix replaced by one
    `MaskedNode` (optax's ``mask_pytree``: a masked-out dict is one node, not one per leaf).
    ``mask`` has been checked to be a prefix of ``tree`` (`broadcast_prefix`)."""
    if mask is None:  # an empty subtree of the params: nothing to mask
        return tree
    if isinstance(mask, dict):
        return {k: _mask_pytree(mask[k], v) for k, v in tree.items()}
    if isinstance(mask, tuple) and hasattr(type(mask), "_fields"):
        return type(tree)(*(_mask_pytree(m, v) for m, v in zip(mask, tree)))
    if isinstance(mask, (list, tuple)):
        return type(tree)(_mask_pytree(m, v) for m, v in zip(mask, tree))
    return tree if _mask_leaf(mask, "mask") else MaskedNode()


def _masked_tree(plan: _Plan, leaves: list) -> Any:
    """The tree of ``leaves`` (of the full layout) as the inner transformation sees it."""
    return tree_unflatten(plan.sub.treedef, [leaves[i] for i in plan.kept])


def _share(sub: Layout, layout: Layout) -> tuple[float, float]:
    """What the kept leaves of ``layout`` (``sub``'s) are of it, for `numbaccum.explain`: their
    bytes per byte of the whole, and their elements per element of the whole."""
    n = float(sum(layout.group_sizes)) or 1.0
    size = float(sum(s * d.itemsize for s, d in zip(layout.group_sizes, layout.group_dtypes))) or 1.0
    kept = float(sum(s * d.itemsize for s, d in zip(sub.group_sizes, sub.group_dtypes)))
    return kept / size, float(sum(sub.group_sizes)) / n


class _Views:
    """The kept leaves of a full FlatTree as a FlatTree of ``sub`` whose groups are views of the
    full one's, where every group of ``sub`` is one run of a full group (a label's leaves of
    one dtype back to back, as `partition`'s often are): the inner transformation reads and
    writes them in place, no copies in or out. Kept for the last few full FlatTrees (a
    workspace and its spare by turns, the caller's gradients), so that the inner plan's kept
    launches see the same views step after step."""

    __slots__ = ("sub", "spans", "last")

    def __init__(self, sub: Layout, spans: list) -> None:
        self.sub, self.spans = sub, spans  # per group of sub: (full group, start, stop)
        self.last: list = []  # [(full groups, view)], the newest first

    @staticmethod
    def of(m: _Plan, device: bool) -> _Views | None:
        """The views of ``m``'s kept leaves, or None where a group of ``m.sub`` is not one run
        of a full group (the kept leaves are then packed by copies); host buffers only (a
        device buffer's slices are copied as before)."""
        if device:
            return None
        spans: list = [None] * len(m.sub.groups)
        for g, a, b, sg, sa in m.runs:
            if sa != 0 or spans[sg] is not None or b - a != m.sub.group_sizes[sg]:
                return None
            spans[sg] = (g, a, b)
        return _Views(m.sub, spans) if all(x is not None for x in spans) else None

    def view(self, full: FlatTree) -> FlatTree | None:
        """The kept leaves of ``full`` as views (None when its storage dtypes are not the
        layout's: the copies convert)."""
        groups = full.groups
        for held, v in self.last:
            if held is groups:
                return v
        parts = [groups[g][a:b] for g, a, b in self.spans]
        if any(x.dtype != d for x, d in zip(parts, self.sub.group_dtypes)):
            return None
        v = FlatTree(self.sub, parts, {x.dtype: x for x in parts})
        self.last = [(groups, v), *self.last[:2]]
        return v


def _runs(layout: Layout, sub: Layout, keep: tuple[bool, ...]) -> tuple[tuple, tuple]:
    runs: list[list[int]] = []
    gaps: list[list[int]] = []
    j = 0  # the kept leaf's index in ``sub``
    for i, k in enumerate(keep):
        g, start = layout.leaf_group[i], layout.leaf_start[i]
        stop = start + layout.sizes[i]
        if k:
            sg, ss = sub.leaf_group[j], sub.leaf_start[j]
            last = runs[-1] if runs else None
            if (
                last
                and last[0] == g
                and last[2] == start
                and last[3] == sg
                and last[4] + last[2] - last[1] == ss
            ):
                last[2] = stop
            else:
                runs.append([g, start, stop, sg, ss])
            j += 1
        else:
            last = gaps[-1] if gaps else None
            if last and last[0] == g and last[2] == start:
                last[2] = stop
            else:
                gaps.append([g, start, stop])
    return tuple(tuple(r) for r in runs if r[2] > r[1]), tuple(tuple(r) for r in gaps if r[2] > r[1])


def _inner_state(state: MaskedState) -> Any:
    return state.inner_state


class _Masked(Stage):
    """`masked` as a stage: declares the inner stage on the kept leaves' layout, kept (its tick's
    checks run before anything is written), and runs it on a packed copy of the kept leaves."""

    scope = LEAF  # a mask has the params' structure
    children_at = "inner"

    def __init__(self, inner: Any, mask: Any, mask_compatible_extra_args: bool) -> None:
        self.inner = as_stage(with_extra_args_support(transformation(inner, "inner")))
        if self.inner.reshapes:
            raise TypeError("masked: the inner transformation must not change the updates' shape")
        self.mask = mask
        self.mask_extra = flag(mask_compatible_extra_args, "mask_compatible_extra_args")
        self._plans = _bounded.Bounded()

    def refuses_complex(self) -> Any:
        return self.inner.refuses_complex()

    def foreign(self) -> bool:
        return self.inner.foreign()

    def resolve(self, layout: Layout) -> _Plan:
        """The mask for trees of ``layout`` (cached per layout)."""
        found = self._plans.get(layout)
        if found is not None:
            return found
        mask = self.mask(_standins(layout)) if callable(self.mask) else self.mask
        prefix = broadcast_prefix(mask, layout.treedef, "mask")
        paths = None
        keep = []
        for i, value in enumerate(prefix):
            try:
                keep.append(_mask_leaf(value, "mask"))
            except TypeError:
                paths = paths or layout.path(i, "mask")
                raise TypeError(
                    f"{paths}: a mask leaf must be a bool, got {type(value).__name__} {value!r:.40}"
                ) from None
        keep_t = tuple(keep)
        sub = layout_of(_mask_pytree(mask, _standins(layout)), "mask")
        runs, gaps = _runs(layout, sub, keep_t)
        plan = _Plan(keep_t, tuple(i for i, k in enumerate(keep_t) if k), sub, runs, gaps)
        self._plans.put(layout, plan)
        return plan

    def _masked_input(self, tree: Any) -> Any:
        """``tree`` (params at init) with the masked-out leaves replaced by `MaskedNode`."""
        if isinstance(tree, FlatTree):
            layout, leaves = tree.layout, [tree.leaf(i) for i in range(tree.layout.num_leaves)]
        else:
            layout, leaves = layout_of(tree, "params"), tree_flatten(tree)[0]
        return _masked_tree(self.resolve(layout), leaves)

    def init(self, params: Any) -> MaskedState:
        return MaskedState(self.inner.init(self._masked_input(params)))

    def declare(self, spec: Spec, state: Any) -> Any:
        """A `numbaccum.fuse.Host` that runs the inner stage's kept plan (`numbaccum.control.Inner`)
        on a packed copy of the kept leaves of ``spec``'s layout; its tick checks the state and
        ticks the inner plan with the kept leaves' params (and extra arguments, when masked)."""
        if not isinstance(state, MaskedState):
            raise wrong_state("MaskedState (masked)", state)
        m = self.resolve(spec.layout)
        if m.sub is spec.layout:  # every leaf kept (lars' default masks): no copies in or out
            return self._declare_whole(spec, state)
        sub_spec = Spec(m.sub, spec.device)
        inner = Inner(self.inner, sub_spec, "masked.")
        # The kept leaves' workspaces, this part's own (a plan is the state's, or the thread's
        # for a stage without buffers): the packed updates, the inner step's scratch, the params.
        inbox, scratch, packed = (Workspace(m.sub, None, spec.device) for _ in range(3))
        layout, mask_extra = spec.layout, self.mask_extra
        # The copies in and out of the kept leaves (and of their params), over fixed bounds:
        # their launches kept while the buffers are the same (the workspaces, step after step).
        copies = fuse.Launches()
        now: list = [None]  # this step's params (set by the tick)
        # Where each kept group is one run of a full group: views instead of copies (`_Views`).
        views, param_views = _Views.of(m, spec.device), _Views.of(m, spec.device)
        fill = self._packer(now, m, packed, copies, param_views)

        def raw_of() -> Any:
            return self._masked_input(now[0].raw)

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not isinstance(state, MaskedState):
                return False
            sub_params = None
            if params is not None:
                now[0] = params
                sub_params = ParamsRef(None, m.sub, device=spec.device, fill=fill, raw_of=raw_of)
            if mask_extra and extra:
                extra = {k: self._mask_extra(v, layout, m) for k, v in extra.items()}
            return inner.tick(state.inner_state, sub_params, extra)

        def run(u: Updates) -> tuple[Updates, MaskedState]:
            factor, groups = u.factor, u.flat.groups
            sub = viewed = None if views is None else views.view(u.flat)
            if viewed is not None:  # the kept leaves in place: the inner step reads them as they are
                inner_in = Updates(viewed, u.owned, factor, scratch=scratch)
            else:
                sub = inbox()
                for i, (g, a, b, sg, sa) in enumerate(m.runs):  # the kept leaves, the factor applied
                    copies.copy(("in", i), sub.groups[sg], sa, groups[g], a, b - a, factor)
                inner_in = Updates(sub, True, scratch=scratch)
            inner_out, new_inner = inner.run(inner_in, settle=True)
            # A factor the inner step left pending (a lone scale) is applied by the copies out:
            # the same kernel (`Updates.settled`'s scale), into the updates instead of in place.
            pending = inner_out.factor
            out = u.flat if u.owned else u.fresh()
            if out is not u.flat or (factor is not ONE and not factor.is_one):
                for i, (g, a, b) in enumerate(m.gaps):  # the masked-out leaves pass through
                    copies.copy(("gap", i), out.groups[g], a, groups[g], a, b - a, factor)
            in_place = viewed is not None and inner_out.flat is viewed and out is u.flat
            moved[0] = not (in_place and (pending is ONE or pending.is_one))
            if not moved[0]:  # written in place, into the views of the updates: nothing to move
                return Updates(out, True, scratch=u.scratch), MaskedState(new_inner)
            ys = inner_out.flat.groups
            for i, (g, a, b, sg, sa) in enumerate(m.runs):
                copies.copy(("out", i), out.groups[g], a, ys[sg], sa, b - a, pending)
            return Updates(out, True, scratch=u.scratch), MaskedState(new_inner)

        kept = _share(m.sub, layout)
        moved = [True]  # whether the last step copied the inner step's updates out

        def passes(apply: bool) -> list:
            # (views: the kept leaves are read in place; the updates move out unless the inner
            # step wrote them in place too, as the last step showed)
            gather = [("kernel", "the kept leaves in", kept[0], kept[0], 0.0)] if views is None else []
            out = [("kernel", "the updates out", 1.0, 1.0, 0.0)] if moved[0] else []
            return [*gather, *inner.passes(False, kept[1], True), *out]

        return fuse.Host(run, passes, "masked", tick, settles=False)

    def _declare_whole(self, spec: Spec, state: MaskedState) -> Any:
        """`declare` for a mask that keeps every leaf of ``spec``'s layout (in its grouping):
        the inner stage's parts run on the updates themselves, as the inner stage alone would.
        Declared parts join the enclosing plan's runs (`numbaccum.fuse.Wrapped`, fused with the
        neighbours'); user code runs in its own kept plan (`numbaccum.control.Inner`), which
        restores what it wrote when that code raises."""
        layout, mask_extra = spec.layout, self.mask_extra
        m = self.resolve(layout)
        foreign = self.inner.foreign()
        if not foreign:
            part = self.inner.declare(spec, state.inner_state)
            inner_tick = fuse.flat_tick(part)
        else:
            inner = Inner(self.inner, spec, "masked.")
            inner_tick = inner.tick

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not isinstance(state, MaskedState):
                return False
            if mask_extra and extra:
                extra = {k: self._mask_extra(v, layout, m) for k, v in extra.items()}
            return inner_tick(state.inner_state, params, extra)

        if not foreign:
            return fuse.Wrapped(part, MaskedState, "masked", tick, _inner_state)

        def run(u: Updates) -> tuple[Updates, MaskedState]:
            out, new_inner = inner.run(u)
            return out, MaskedState(new_inner)

        return fuse.Host(run, lambda apply: inner.passes(False), "masked", tick, settles=False)

    def _packer(
        self, now: list, m: _Plan, packed: Workspace, copies: fuse.Launches, views: _Views | None
    ) -> Callable[[], FlatTree]:
        """A ``ParamsRef`` fill for the kept leaves of this step's params (``now[0]``): views of
        its flat form (``views``, where they can be), else packed into ``packed``, one copy per
        run of kept leaves (launched through the declaration's ``copies``)."""

        def into() -> FlatTree:
            full = now[0].flat()
            sub = None if views is None else views.view(full)
            if sub is not None:
                return sub
            sub = packed()
            for i, (g, a, b, sg, sa) in enumerate(m.runs):
                copies.copy(("params", i), sub.groups[sg], sa, full.groups[g], a, b - a, ONE)
            return sub

        return into

    def _mask_extra(self, value: Any, layout: Layout, m: _Plan) -> Any:
        """An extra argument of the updates' structure, masked like them (optax's
        ``mask_compatible_extra_args``); anything else as it is."""
        try:
            leaves, td = tree_flatten(value)
        except TypeError:
            return value
        if td != layout.treedef:
            return value
        return _masked_tree(m, leaves)


def masked(
    inner: Any,
    mask: Any | Callable[[Any], Any],
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformationExtraArgs:
    """Applies ``inner`` to the leaves selected by ``mask``; the others pass through unchanged.

    Each update returns ``u_i = inner(g)_i`` for the leaves where ``mask_i`` is True and
    ``u_i = g_i`` where it is False. The inner transformation sees the tree with each masked-out
    subtree (under a False leaf of the mask) replaced by one `MaskedNode`, so its state covers the
    kept leaves only (optax's ``masked``), and its ``params`` are the kept leaves too.

    Args:
        inner: the transformation to apply to the kept leaves.
        mask: a tree of bools with the structure of the params or a prefix of it (a bool at a
            subtree applies to all its leaves), or a callable of the params returning one. A
            callable is called once per tree layout, with read-only stand-in arrays of the
            leaves' shapes and dtypes: as under optax's ``jit``, it may depend on shapes, dtypes
            and paths, not on values.
        mask_compatible_extra_args: also mask the extra keyword arguments of ``update`` that have
            the updates' structure.

    Returns:
        The masked transformation (a `GradientTransformationExtraArgs`); its state is
            ``MaskedState(inner_state)``.

    Raises:
        TypeError: ``inner`` is not a transformation, or one that changes the updates' shape;
            ``mask_compatible_extra_args`` is not a bool; at ``init`` or an update, a mask leaf
            is not a bool.
        ValueError: at ``init`` or an update, the mask is not a prefix of the tree's structure.

    References:
        optax.masked.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"b": np.ones(2, np.float32), "w": np.ones(2, np.float32)}
        >>> tx = nba.masked(nba.trace(0.9), {"b": False, "w": True})
        >>> state = tx.init(params)
        >>> g = {"b": np.array([1.0, 2.0], np.float32), "w": np.array([1.0, 2.0], np.float32)}
        >>> u, state = tx.update(g, state)
        >>> u, state = tx.update(g, state)
        >>> [round(float(x), 4) for x in u["w"]], [round(float(x), 4) for x in u["b"]]
        ([1.9, 3.8], [1.0, 2.0])
    """
    return _Masked(inner, mask, mask_compatible_extra_args).transformation()


# --- partition: a transformation per label ----------------------------------------------------


@state_class
class PartitionState(NamedTuple):
    """The state of `partition`: each label's `masked` state.

    Attributes:
        inner_states: a dict from each label of ``transforms`` to the `MaskedState` of its
            transformation over the leaves of that label.
    """

    inner_states: Any


MultiTransformState = PartitionState  # optax's older name, kept as optax keeps it


def _labels(param_labels: Any, tree: Any) -> Any:
    return param_labels(tree) if callable(param_labels) else param_labels


class _Partition(Stage):
    """`partition` as a stage: the chain of each label's `masked` transformation (disjoint
    masks, so their order does not matter), planned as one chain (all or nothing)."""

    scope = LEAF  # a label tree has the params' structure
    children_at = "chain"

    def __init__(
        self, transforms: Any, param_labels: Any, mask_compatible_extra_args: bool, what: str = "param_labels"
    ) -> None:
        if not isinstance(transforms, Mapping) or not transforms:
            raise TypeError(
                "transforms must be a non-empty mapping of labels to transformations, got "
                + short_repr(transforms)
            )
        self.param_labels, self.what = param_labels, what
        self.labels = list(transforms)

        def mask_of(label: Any) -> Callable[[Any], Any]:
            return lambda tree: tree_map(lambda leaf: leaf == label, _labels(param_labels, tree))

        stages: list[Stage] = [
            _Masked(transformation(tx, f"transforms[{label!r}]"), mask_of(label), mask_compatible_extra_args)
            for label, tx in transforms.items()
        ]
        self.chain = Chain(stages, [str(k) for k in self.labels])
        self.keys = dict(zip(self.chain.names, self.labels))  # type: ignore[arg-type]

    def refuses_complex(self) -> Any:
        return self.chain.refuses_complex()

    def foreign(self) -> bool:
        return self.chain.foreign()

    def init(self, params: Any) -> PartitionState:
        labels = _labels(self.param_labels, params)
        layout = params.layout if isinstance(params, FlatTree) else layout_of(params, "params")
        known = set(self.labels)
        for i, label in enumerate(broadcast_prefix(labels, layout.treedef, self.what)):
            try:
                ok = label in known
            except TypeError:  # unhashable: no transformation has it
                ok = False
            if not ok:
                raise ValueError(
                    f"{self.what}: no transformation for the label {short_repr(label)} of "
                    f"{layout.path(i, 'params')} (transforms has {sorted(map(repr, self.labels))})"
                )
        states = self.chain.init(params)
        return PartitionState({self.keys[k]: v for k, v in states.items()})

    def _inner(self, state: Any) -> dict:
        """The chain's state (a dict by label name) in ``state``; TypeError or ValueError when
        it is not a state of these labels."""
        if not isinstance(state, PartitionState) or not isinstance(state.inner_states, Mapping):
            raise wrong_state("PartitionState (partition)", state)
        if set(state.inner_states) != set(self.labels):
            raise ValueError(
                f"state.inner_states: labels {sorted(map(repr, state.inner_states))}, not the "
                f"transforms' {sorted(map(repr, self.labels))}"
            )
        keys = self.keys  # maps, not a comprehension: every step's tick asks
        return dict(zip(keys, map(state.inner_states.__getitem__, keys.values())))

    def declare(self, spec: Spec, state: Any) -> Any:
        """The chain of each label's `masked`, its parts in the enclosing plan's runs
        (`numbaccum.fuse.Wrapped`); with user code inside, a `numbaccum.fuse.Host` that runs that
        chain's own kept plan (`numbaccum.control.Inner`), which restores what it wrote when that
        code raises. The tick checks the state's labels and ticks the chain."""
        chain_state, keys = self._inner(state), self.keys

        def wrap(states: dict) -> PartitionState:
            return PartitionState(dict(zip(map(keys.__getitem__, states), states.values())))

        if not self.chain.foreign():
            part = self.chain.declare(spec, chain_state)
            inner_tick = fuse.flat_tick(part)

            def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
                return inner_tick(self._inner(state), params, extra)

            return fuse.Wrapped(part, wrap, "partition", tick, self._inner)
        inner = Inner(self.chain, spec, "partition.")

        def ticked(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            return inner.tick(self._inner(state), params, extra)

        def run(u: Updates) -> tuple[Updates, PartitionState]:
            out, states = inner.run(u)
            return out, wrap(states)

        return fuse.Host(run, lambda apply: inner.passes(False), "partition", ticked, settles=False)


def partition(
    transforms: Mapping[Any, Any],
    param_labels: Any | Callable[[Any], Any],
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformationExtraArgs:
    """Applies a different transformation to each labelled subset of the params.

    ``u_i = transforms[label_i](g)_i``: each leaf gets the transformation of its label, run (as
    `masked`) on the leaves of that label only, so each transformation's state covers its
    leaves. ``multi_transform`` is the same function (optax's older name).

    Args:
        transforms: a mapping from each label to a transformation.
        param_labels: a tree of labels with the structure of the params or a prefix of it (a
            label at a subtree applies to all its leaves), or a callable of the params returning
            one (called, as `masked`'s mask, once per tree layout with stand-in arrays: labels may
            depend on shapes, dtypes and paths, not on values).
        mask_compatible_extra_args: also mask the extra keyword arguments of ``update`` that have
            the updates' structure (as `masked`).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``PartitionState(inner_states)``, a
            dict from each label to its `MaskedState`.

    Raises:
        TypeError: ``transforms`` is not a non-empty mapping, or holds something that is not a
            transformation.
        ValueError: at ``init``, a label without a transformation; at an update, a state of
            other labels.

    References:
        optax.partition (``optax.multi_transform``).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones((2, 2)), "b": np.ones(2)}
        >>> tx = nba.partition(
        ...     {"decay": nba.adamw(0.1), "plain": nba.sgd(0.1)},
        ...     lambda p: {"w": "decay", "b": "plain"},
        ... )
        >>> state = tx.init(params)
        >>> sorted(state.inner_states)
        ['decay', 'plain']
        >>> u, state = tx.update({"w": np.ones((2, 2)), "b": np.ones(2)}, state, params)
        >>> u["b"].tolist()  # sgd: -0.1 * g
        [-0.1, -0.1]
    """
    return _Partition(transforms, param_labels, mask_compatible_extra_args).transformation()


multi_transform = partition


# --- masks in time: the inner transformation at some steps only -----------------------------


@state_class
class ConditionallyTransformState(NamedTuple):
    """The state of `conditionally_transform` (optax's fields).

    Attributes:
        inner_state: the inner transformation's state (unchanged at the steps it does not run).
        step: the number of updates so far (int32, saturating), the condition's argument.
    """

    inner_state: Any
    step: np.int32


@state_class
class ConditionallyMaskState(NamedTuple):
    """The state of `conditionally_mask` (optax's fields, in optax's order).

    Attributes:
        step: the number of updates so far (int32, saturating), the condition's argument.
        inner_state: the inner transformation's state (unchanged at the steps it does not run).
    """

    step: np.int32
    inner_state: Any


class _Conditionally(Stage):
    """`conditionally_transform` (``zeros=False``) and `conditionally_mask` (``zeros=True``): the
    condition is asked at the tick, before anything is written; a step that runs the inner
    transformation replays the inner's own kept plan (`numbaccum.step_` adds the updates in its
    last pass) inside this state."""

    scope = ELEMENT
    children_at = "stage"

    def __init__(self, inner: Any, should_transform_fn: Any, forward_extra_args: Any, zeros: bool) -> None:
        self.inner = with_extra_args_support(transformation(inner, "inner"))
        self.stage = as_stage(self.inner)
        if not callable(should_transform_fn):
            raise TypeError(f"should_transform_fn must be callable, got {type(should_transform_fn).__name__}")
        self.condition = should_transform_fn
        self.forward = flag(forward_extra_args, "forward_extra_args")
        self.zeros = zeros
        self.state_cls = ConditionallyMaskState if zeros else ConditionallyTransformState
        if self.stage.reshapes:  # (optax's lax.cond refuses branches of other shapes too)
            raise TypeError(
                f"{self.name}: inner reshapes its updates (a per-example aggregation, lookahead): the "
                "steps that skip it would return updates of another shape"
            )

    @property
    def name(self) -> str:
        return "conditionally_mask" if self.zeros else "conditionally_transform"

    def refuses_complex(self) -> Any:
        return self.stage.refuses_complex()

    def foreign(self) -> bool:
        return self.stage.foreign()

    def _state(self, inner_state: Any, step: Any) -> Any:
        if self.zeros:
            return ConditionallyMaskState(step, inner_state)
        return ConditionallyTransformState(inner_state, step)

    def init(self, params: Any) -> Any:
        return self._state(self.inner.init(params), np.int32(0))

    def owner(self, state: Any) -> FlatTree | None:
        return self.stage.owner(state.inner_state) if isinstance(state, self.state_cls) else None

    def _asked(self, step: Any, extra: dict) -> bool:
        """The condition's answer at ``step``: a NumPy, JAX or Python bool (optax's: an array)."""
        answer = self.condition(step, **extra) if self.forward else self.condition(step)
        try:
            return bool(np.asarray(answer))
        except (TypeError, ValueError):
            raise TypeError(
                f"should_transform_fn must return a bool, got {type(answer).__name__} {answer!r:.40}"
            ) from None

    def declare(self, spec: Spec, state: Any) -> Any:
        """A `numbaccum.fuse.Host`: its tick asks the condition and, at a step that runs the
        inner transformation, ticks its kept plan (`numbaccum.control.Inner`); its ``apply``
        adds the updates in that plan's last pass (`numbaccum.step_`)."""
        if not isinstance(state, self.state_cls):
            raise wrong_state(f"{self.state_cls.__name__} ({self.name})", state)
        inner = Inner(self.stage, spec, "conditionally.")
        cls, zeros, wrap = self.state_cls, self.zeros, self._state
        guard = self.stage.foreign()  # foreign code inside: its state restored if it raises
        step: list = [None, False, None]  # this step's state, whether the inner runs, new step

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not isinstance(state, cls):
                return False
            runs = self._asked(state.step, extra)
            if runs and not inner.tick(state.inner_state, params, extra):
                return False
            step[:] = state, runs, safe_increment(state.step)
            return True

        def run(u: Updates) -> tuple[Updates, Any]:
            state, runs, new_step = step
            if not runs:
                if zeros:  # optax's zeros_like: the updates' shape, whatever the inner would make
                    return Updates(u.fresh().fill_(0.0), True), wrap(state.inner_state, new_step)
                return u, wrap(state.inner_state, new_step)
            try:
                if guard:
                    out, new_inner = undoable(inner.run, state.inner_state)(u)
                else:
                    out, new_inner = inner.run(u)
            except SkipStep as e:
                raise SkipStep(wrap(e.new_state, new_step)) from None
            return out, wrap(new_inner, new_step)

        def apply(u: Updates, p: FlatTree) -> Any:
            state, runs, new_step = step
            if runs and not guard:
                try:
                    return wrap(inner.apply(u, p), new_step)
                except SkipStep as e:
                    raise SkipStep(wrap(e.new_state, new_step)) from None
            out, new_state = run(u)
            inner.adds(p, out)
            return new_state

        def passes(apply: bool) -> list:
            if step[1]:
                return inner.passes(apply)
            if zeros:
                return [("kernel", "zeros", 0.0, 1.0, 0.0)]
            return []

        return fuse.Host(run, passes, self.name, tick, settles=False, apply=apply)


def conditionally_transform(
    inner: Any, should_transform_fn: Callable[..., Any], forward_extra_args: bool = False
) -> GradientTransformationExtraArgs:
    """Runs ``inner`` only at the steps ``should_transform_fn(step)`` allows; the other steps
    pass the updates through and leave the inner state as it was.

    ``step`` counts the updates before this one (0 at the first), whether ``inner`` ran or not.
    The condition is asked on the host before anything runs, and a step that runs ``inner``
    runs ``inner``'s own plan, kept (`numbaccum.step_` adds the updates in its last pass).

    Args:
        inner: the transformation to run at some steps.
        should_transform_fn: ``fn(step) -> bool`` (``step`` an int32 scalar); with
            ``forward_extra_args``, ``fn(step, **extra_args)``.
        forward_extra_args: pass the update's extra arguments to the condition too.

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``ConditionallyTransformState(inner_state, step)``, as in optax.

    Raises:
        TypeError: ``inner`` is not a transformation, or one that reshapes its updates (a
            per-example aggregation, lookahead), or ``should_transform_fn`` is not callable; at
            ``update``, the condition's answer is not a bool.

    References:
        optax.conditionally_transform.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.conditionally_transform(nba.scale(10.0), lambda step: step % 2 == 1)
        >>> state = tx.init({"w": np.zeros(1)})
        >>> for _ in range(3):
        ...     u, state = tx.update({"w": np.ones(1)}, state)
        ...     print(u["w"])
        [1.]
        [10.]
        [1.]
    """
    return _Conditionally(inner, should_transform_fn, forward_extra_args, zeros=False).transformation()


def conditionally_mask(
    inner: Any, should_transform_fn: Callable[..., Any], forward_extra_args: bool = False
) -> GradientTransformationExtraArgs:
    """Runs ``inner`` only at the steps ``should_transform_fn(step)`` allows; the other steps
    give zero updates and leave the inner state as it was.

    As `conditionally_transform`, except the updates of a step ``inner`` does not run are zeros
    (of the updates' shapes and dtypes), as optax's.

    Args:
        inner: the transformation to run at some steps.
        should_transform_fn: ``fn(step) -> bool`` (``step`` an int32 scalar); with
            ``forward_extra_args``, ``fn(step, **extra_args)``.
        forward_extra_args: pass the update's extra arguments to the condition too.

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``ConditionallyMaskState(step, inner_state)``, as in optax.

    Raises:
        TypeError: ``inner`` is not a transformation, or one that reshapes its updates (a
            per-example aggregation, lookahead), or ``should_transform_fn`` is not callable; at
            ``update``, the condition's answer is not a bool.

    References:
        optax.conditionally_mask.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.conditionally_mask(nba.sgd(0.5), lambda step: step >= 1)  # no step at first
        >>> params = {"w": np.ones(1)}
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     state = nba.step_(tx, {"w": np.ones(1)}, state, params)
        ...     print(params["w"])
        [1.]
        [0.5]
    """
    return _Conditionally(inner, should_transform_fn, forward_extra_args, zeros=True).transformation()


# --- the whole tree as one vector ---------------------------------------------------------------


class _Flatten(Stage):
    """`flatten`: the inner transformation sees the tree as one 1-D array. The leaves of one
    dtype are that array already (one group of the flat buffers, in leaf order): the inner
    stage runs on a view of it, the updates come back as views of its output, nothing copied."""

    scope = LEAF
    children_at = "inner"
    joins_leaves = True  # its inner stage sees the leaves as one vector

    def __init__(self, inner: Any) -> None:
        self.inner = as_stage(with_extra_args_support(transformation(inner, "inner")))
        if self.inner.reshapes:
            raise TypeError("flatten: the inner transformation must not change the updates' shape")

    def refuses_complex(self) -> Any:
        return self.inner.refuses_complex()

    def foreign(self) -> bool:
        return self.inner.foreign()

    def init(self, params: Any) -> Any:
        layout = params.layout if isinstance(params, FlatTree) else layout_of(params, "params")
        flat = params if isinstance(params, FlatTree) else FlatTree.from_tree(params)
        return self.inner.init(_vector(flat, _vector_layout(layout)))

    def owner(self, state: Any) -> FlatTree | None:
        # The inner state's buffers are of the vector's layout, not the updates': a stage's owner
        # gives the layout of its updates and workspaces (`Stage.take`), so there is none here.
        return None

    def declare(self, spec: Spec, state: Any) -> Any:
        """A `numbaccum.fuse.Host` that runs the inner stage's kept plan (`numbaccum.control.Inner`)
        on the updates as one vector (a view: nothing copied); its tick ticks that plan with the
        params as one vector."""
        vec = _vector_layout(spec.layout)
        sub_spec = Spec(vec, spec.device)
        inner, layout = Inner(self.inner, sub_spec, "flatten."), spec.layout

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            sub_params = None
            if params is not None:
                sub_params = ParamsRef(
                    None,
                    vec,
                    device=spec.device,
                    fill=lambda: _vector(params.flat(), vec),
                    raw_of=lambda: _vector(params.flat(), vec).tree,
                )
            return inner.tick(state, sub_params, extra)

        def run(u: Updates) -> tuple[Updates, Any]:
            scratch = u.scratch
            vec_scratch = None if scratch is None else (lambda: _vector(scratch(), vec))
            out, new_state = inner.run(
                Updates(_vector(u.flat, vec), u.owned, u.factor, u.returnable, vec_scratch), settle=True
            )
            back = FlatTree(layout, out.flat.groups, out.flat.buffers)
            return Updates(back, out.owned, out.factor, out.returnable, u.scratch), new_state

        return fuse.Host(run, lambda apply: inner.passes(False), "flatten", tick, settles=False)


def _vector_layout(layout: Layout) -> Layout:
    """The layout of one 1-D array holding every leaf of ``layout`` (one dtype only)."""
    if len(layout.group_dtypes) > 1:
        dts = ", ".join(str(d) for d in layout.group_dtypes)
        raise TypeError(
            f"flatten: the leaves have several dtypes ({dts}); optax concatenates them in their "
            "promoted dtype, numbaccum flattens the leaves of one dtype (cast the tree first)"
        )
    dtype = layout.group_dtypes[0] if layout.group_dtypes else np.dtype(np.float32)
    return Layout.get(tree_flatten(np.empty(0))[1], [(layout.size,)], [dtype])


def _vector(flat: FlatTree, vec: Layout) -> FlatTree:
    """``flat``'s one group as a FlatTree of the 1-D layout ``vec`` (a view)."""
    groups = list(flat.groups)
    if not groups:  # a tree without leaves: one empty vector
        groups = [np.empty(0, vec.group_dtypes[0])]
    if len(flat.buffers) == 1 and next(iter(flat.buffers.values())).size == groups[0].size:
        # The group is the whole buffer: the same buffer, so that what is lent of the vector
        # marks the buffer its workspace writes (`FlatTree.lent`).
        return FlatTree(vec, groups, dict(flat.buffers))
    return FlatTree(vec, groups, {np.dtype(g.dtype): g for g in groups})


def flatten(inner: Any) -> GradientTransformationExtraArgs:
    """Runs ``inner`` on the tree as one 1-D array (its leaves concatenated in tree order).

    For transformations that treat their input as one vector (a full-matrix preconditioner, a
    per-leaf rule that should see one leaf): ``inner``'s state is made for a single 1-D array.
    The flat buffers already hold that array, so nothing is copied in or out. The leaves must
    share one dtype (optax concatenates several in their promoted dtype, and returns updates of
    that dtype; numbaccum refuses them rather than change the updates' dtypes).

    Args:
        inner: the transformation to run on the vector.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``inner``'s state for the vector.

    Raises:
        TypeError: ``inner`` is not a transformation or changes the updates' shape; at ``init``
            or an update, the leaves have several dtypes.

    References:
        optax.flatten.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.flatten(nba.scale_by_trust_ratio())  # one trust ratio for the whole tree
        >>> params = {"a": np.array([3.0]), "b": np.array([4.0])}  # ||p|| = 5
        >>> u, _ = tx.update({"a": np.array([1.0]), "b": np.array([0.0])}, tx.init(params), params)
        >>> u["a"], u["b"]  # g * ||p|| / ||g||
        (array([5.]), array([0.]))
    """
    return _Flatten(inner).transformation()
