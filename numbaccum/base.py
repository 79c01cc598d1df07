"""The optax protocol over flat buffers: GradientTransformation, chain, apply_updates.

Every numbaccum transformation is an optax-style ``(init, update)`` pair. Inside, it also has a
*flat* update that takes and returns a `Flow`: the updates as a `FlatTree`, whether the buffer
may be overwritten in place, and a pending ``(g / div) * mul`` factor that the next kernel
applies while it reads ``g`` (so ``clip_by_global_norm`` costs no pass of its own). `chain` and
`MultiSteps` pass flows from stage to stage; the public ``update`` converts a user tree into a
flow once on the way in and back once on the way out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import backend
from ._checks import transformation
from .flat import FlatTree, Layout, as_flat, check_leaves, host_leaves, layout_of, torch_runs
from .tree import format_path, tree_flatten, tree_flatten_with_path

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "apply_updates",
    "apply_updates_",
    "chain",
    "copy_state",
    "named_chain",
    "with_extra_args_support",
]


class GradientTransformation(NamedTuple):
    """A pair of pure-looking functions ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``."""

    init: Callable[..., Any]
    update: Callable[..., Any]


class GradientTransformationExtraArgs(GradientTransformation):
    """A GradientTransformation whose ``update`` accepts (and may ignore) ``**extra_args``."""


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def with_extra_args_support(tx: Any) -> GradientTransformationExtraArgs:
    """Wraps ``tx`` so that its ``update`` accepts and drops unknown keyword arguments.

    Returns ``tx`` itself when it already is a GradientTransformationExtraArgs.
    """
    if isinstance(tx, GradientTransformationExtraArgs):
        return tx
    transformation(tx, "tx")

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del extra_args
        return tx.update(updates, state, params)

    return GradientTransformationExtraArgs(tx.init, update)


# --- flows ----------------------------------------------------------------------------------


class Flow:
    """Updates between two stages: the value is ``(flat / div) * mul``, group by group.

    Attributes:
        flat: the buffer.
        owned: a state's scratch buffer: later stages may overwrite it.
        div, mul: the pending factor: floats, or (GPU) ``div`` a dict dtype -> device array
            ``[div, mul]`` with ``mul`` None.
        returnable: may be handed to the user as is (default: ``owned``).
        scratch: where a stage writes a new value (see `fresh`).
    """

    # A plain class with slots, not a dataclass: a few flows are made per update, and a small
    # tree's whole update costs microseconds.
    __slots__ = ("flat", "owned", "div", "mul", "returnable", "scratch")

    def __init__(
        self,
        flat: FlatTree,
        owned: bool,
        div: Any = 1.0,
        mul: Any = 1.0,
        returnable: bool | None = None,
        scratch: Callable[[], FlatTree] | None = None,
    ) -> None:
        self.flat = flat
        self.owned = owned
        self.div = div
        self.mul = mul
        self.returnable = owned if returnable is None else returnable
        self.scratch = scratch

    def __repr__(self) -> str:
        return f"Flow({self.flat!r}, owned={self.owned}, div={self.div!r}, mul={self.mul!r})"

    @property
    def pending(self) -> bool:
        return isinstance(self.div, dict) or self.div != 1.0 or self.mul != 1.0

    def with_factor(self, div: Any, mul: Any) -> Flow:
        """The same buffer with the pending factor ``(x / div) * mul`` (none pending before)."""
        return Flow(self.flat, self.owned, div, mul, self.returnable, self.scratch)

    def fresh(self) -> FlatTree:
        """A buffer for this flow's next value: the flow's own if it may be overwritten, else
        the update's scratch (a workspace of the state, or the stateless transformation's)."""
        if self.owned:
            return self.flat
        if self.scratch is not None:
            return self.scratch()
        return FlatTree.empty(self.flat.layout, device=self.flat.device)

    def settled(self, into: FlatTree | None = None) -> Flow:
        """This flow with the pending factor applied (in place when owned)."""
        if not self.pending:
            return self
        out = into if into is not None and not self.owned else self.fresh()
        for dst, src in zip(out.groups, self.flat.groups):
            backend.call("scale_", dst, src, self.div, self.mul)
        return Flow(out, True, scratch=self.scratch)

    def into(self, out: FlatTree) -> FlatTree:
        """Writes the value into ``out`` (same layout) and returns it."""
        for dst, src in zip(out.groups, self.flat.groups):
            backend.call("scale_", dst, src, self.div, self.mul)
        return out


class ParamsRef:
    """The ``params`` argument, flattened only when a stage asks for it (then once)."""

    def __init__(self, raw: Any, layout: Layout, owner: FlatTree | None, device: bool | None = None) -> None:
        self.raw = raw
        self._layout = layout
        self._owner = owner
        self._device = device
        self._flat: FlatTree | None = None

    def flat(self) -> FlatTree:
        if self._flat is None:
            owner = self._owner
            into = (lambda: owner.workspace("params")) if owner is not None else None
            self._flat = as_flat(self.raw, self._layout, "params", pack_into=into, device=self._device)[0]
        return self._flat


FlatUpdate = Callable[[Flow, Any, "ParamsRef | None", dict], "tuple[Flow, Any]"]


def state_owner(state: Any) -> FlatTree | None:
    """The first FlatTree held by a state (its layout is the one the state was built for)."""
    if isinstance(state, FlatTree):
        return state
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (tuple, list)):
        for s in state:
            if isinstance(s, FlatTree):  # checked here first: no call per field
                return s
            if isinstance(s, (tuple, list, dict)):
                found = state_owner(s)
                if found is not None:
                    return found
    return None


def _output(flow: Flow, new_state: Any, owner: FlatTree | None, kept: threading.local) -> FlatTree:
    """The flow as a buffer that the caller may keep until the next update: never an input.

    It goes into a workspace of the new state's owner (else of ``owner``). A stateless
    transformation has no state to own that buffer, so it keeps one per layout and device (per
    thread) itself: its updates are valid until its own next update."""
    if flow.owned:
        return flow.settled().flat
    if flow.returnable and not flow.pending:
        return flow.flat
    owner = state_owner(new_state) or owner
    if owner is not None:
        out = owner.workspace("output")
    else:
        out = _kept(kept, "output", flow.flat.layout, flow.flat.device)
    return flow.into(out)


def _kept(kept: threading.local, name: str, layout: Layout, device: bool) -> FlatTree:
    """A buffer a stateless transformation keeps per layout and device (and thread)."""
    cache = kept.__dict__.setdefault(name, {})
    out = cache.get((layout, device))
    if out is None:
        out = cache[(layout, device)] = FlatTree.empty(layout, device=device)
    return out


def _side(tree: Any) -> bool:
    """Whether a tree's first leaf is a CUDA array (the leaves were already checked to agree)."""
    if isinstance(tree, FlatTree):
        return tree.device
    leaves = tree_flatten(tree)[0]
    return bool(leaves) and not isinstance(leaves[0], (np.ndarray, np.generic))


def flat_transformation(
    init: Callable[[Any], Any], flat_update: FlatUpdate
) -> GradientTransformationExtraArgs:
    """A GradientTransformationExtraArgs from ``init`` and a flat update.

    The public ``update`` validates ``updates`` and ``params`` against the state's layout before
    any buffer is touched, runs the flat update, and returns the updates in the caller's form: a
    plain tree for a plain tree, a FlatTree for a FlatTree.
    """

    kept = threading.local()  # a stateless transformation's output buffers (see _output)
    last: list[Layout | None] = [None]  # a stateless transformation's last plain-tree layout

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        owner = state_owner(state)
        side: bool | None = None  # the updates' side, when known here
        checked = None  # the updates' leaves, when checked here
        if owner is not None:
            layout = owner.layout
        elif params is None and isinstance(updates, FlatTree):
            layout = updates.layout
        elif params is None and last[0] is not None and (checked := host_leaves(updates, last[0])):
            layout, side = last[0], False  # the same structure, shapes and dtypes as last time
        elif params is None and last[0] is not None and torch_runs(updates, last[0]) is not None:
            layout, side = last[0], True  # the same torch views as last time
        else:  # a stateless transformation: params (if given) define the layout
            layout = layout_of(
                params if params is not None else updates, "params" if params is not None else "updates"
            )
            if params is None:
                last[0] = layout
        device = owner.device if owner is not None else None
        if owner is not None:
            inbox: Callable[[], FlatTree] = lambda: owner.workspace("input")  # noqa: E731
        else:
            inbox = lambda: _kept(kept, "input", layout, _side(updates) if side is None else side)  # noqa: E731
        flat, copied, kind = as_flat(updates, layout, "updates", inbox, device, checked)
        ref = None
        if params is not None:
            if not (
                isinstance(params, FlatTree) and params.layout is layout and params.device == flat.device
            ) and not (flat.device and torch_runs(params, layout) is not None):  # checked cheaply
                check_leaves(params, layout, "params", flat.device)
            ref = ParamsRef(params, layout, owner, flat.device)
        if owner is not None:
            scratch: Callable[[], FlatTree] = lambda: owner.workspace("output")  # noqa: E731
        else:
            scratch = lambda: _kept(kept, "output", layout, flat.device)  # noqa: E731
        flow = Flow(flat, copied, scratch=scratch)
        if kind in backend.STREAM_KINDS:  # kernels go to the caller's current CUDA stream
            with backend.launch_context(kind):
                out_flow, new_state = flat_update(flow, state, ref, extra_args)
                out = _output(out_flow, new_state, owner, kept)
        else:
            out_flow, new_state = flat_update(flow, state, ref, extra_args)
            out = _output(out_flow, new_state, owner, kept)
        if kind == "flat":
            return out, new_state
        return out.tree_as(kind), new_state

    update._flat = flat_update  # type: ignore[attr-defined]
    return GradientTransformationExtraArgs(init, update)


def run_stage(
    tx: Any, flow: Flow, state: Any, params: ParamsRef | None, extra: dict, scratch: Callable[[], FlatTree]
) -> tuple[Flow, Any]:
    """Runs one stage of a chain: the flat update of a numbaccum transformation, or the plain
    ``update`` of any other (its output is checked and packed into ``scratch()``)."""
    flat_update = getattr(tx.update, "_flat", None)
    if flat_update is not None:
        return flat_update(flow, state, params, extra)
    value = flow.settled(None if flow.owned or not flow.pending else scratch())
    out, new_state = tx.update(value.flat.tree, state, params.raw if params else None, **extra)
    flat, copied, _ = as_flat(out, flow.flat.layout, "updates", pack_into=scratch, device=flow.flat.device)
    return Flow(flat, copied), new_state


# --- combinators ----------------------------------------------------------------------------


def chain(*transforms: Any) -> GradientTransformationExtraArgs:
    """Applies ``transforms`` in order: ``u = t_n(...t_2(t_1(g)))``; state is a tuple.

    ``params`` and extra keyword arguments are passed to every transformation.
    """
    txs = [
        with_extra_args_support(transformation(t, f"chain: transforms[{i}]"))
        for i, t in enumerate(transforms)
    ]
    front = getattr(txs[0].update, "_chain_front", None) if len(txs) > 1 else None
    if front is not None:  # a first stage that changes the layout (per-example DP aggregation)
        return front(txs[1:])

    def init(params: Any) -> tuple:
        return tuple(t.init(params) for t in txs)

    def flat_update(flow: Flow, state: Any, params: ParamsRef | None, extra: dict) -> tuple[Flow, tuple]:
        if not isinstance(state, tuple) or len(state) != len(txs):
            n = len(state) if isinstance(state, (tuple, list)) else type(state).__name__
            raise ValueError(f"state: chain of {len(txs)} transformations got a state of {n}")
        new_states = []
        for i, (t, s) in enumerate(zip(txs, state)):
            scratch = _scratch(state, flow.flat, f"chain{i}")
            flow, s = run_stage(t, flow, s, params, extra, scratch)
            new_states.append(s)
        return flow, tuple(new_states)

    return flat_transformation(init, flat_update)


def named_chain(*transforms: tuple[str, Any]) -> GradientTransformationExtraArgs:
    """Like `chain`, with a state dict keyed by the given names."""
    for i, entry in enumerate(transforms):
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise TypeError(
                f"named_chain: transforms[{i}] must be a (name, transformation) pair, got {entry!r:.60}"
            )
        transformation(entry[1], f"named_chain: transforms[{i}] ({entry[0]!r})")
    names = [n for n, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    inner = chain(*(t for _, t in transforms))
    inner_flat = inner.update._flat  # type: ignore[attr-defined]

    def init(params: Any) -> dict:
        return dict(zip(names, inner.init(params)))

    def flat_update(flow: Flow, state: Any, params: ParamsRef | None, extra: dict) -> tuple[Flow, dict]:
        if not isinstance(state, dict) or sorted(state) != sorted(names):
            raise ValueError(f"state: named_chain expects a dict with keys {names}")
        flow, states = inner_flat(flow, tuple(state[n] for n in names), params, extra)
        return flow, dict(zip(names, states))

    return flat_transformation(init, flat_update)


def _scratch(state: Any, flat: FlatTree, name: str) -> Callable[[], FlatTree]:
    """A scratch buffer for a chain stage, made only if the stage asks for one."""
    owner = state_owner(state)
    if owner is not None:
        return lambda: owner.workspace(name)
    return lambda: FlatTree.empty(flat.layout, device=flat.device)


# --- applying updates and copying states ----------------------------------------------------


def _apply(p: FlatTree, updates: Any, out: FlatTree) -> FlatTree:
    u = as_flat(updates, p.layout, "updates", device=p.device)[0]
    for dst, pg, ug in zip(out.groups, p.groups, u.groups):
        backend.call("add_scaled_", dst, pg, 1.0, 1.0, ug, 1.0)
    return out


def apply_updates(params: Any, updates: Any) -> Any:
    """Returns ``params + updates`` as a new tree; each leaf keeps its params dtype.

    A FlatTree in gives a FlatTree out; CUDA arrays in give the same array type out.
    """
    layout = params.layout if isinstance(params, FlatTree) else layout_of(params, "params")
    p, _, kind = as_flat(params, layout, "params")
    out = _apply(p, updates, FlatTree.empty(layout, list(p.group_dtypes), p.device))
    return out if kind == "flat" else out.tree_as(kind)


def apply_updates_(params: Any, updates: Any) -> Any:
    """``params += updates`` in place (a FlatTree, or a tree of writable arrays); returns params.

    Raises:
        TypeError: a leaf is a NumPy scalar or a read-only array (it cannot change in place).
    """
    p, copied = writable_flat(params, "params")
    _apply(p, updates, p)
    if copied:
        scatter_back(p, params, "params")
    return params


def writable_flat(tree: Any, name: str) -> tuple[FlatTree, bool]:
    """``(flat, copied)``: ``tree`` as a FlatTree whose changes reach the caller's arrays -- the
    FlatTree itself, the buffers behind a FlatTree's ``.tree``, or (``copied``) a packed copy that
    `scatter_back` writes back. TypeError names a leaf that cannot change in place, before
    anything is written."""
    if isinstance(tree, FlatTree):
        return tree, False
    layout = layout_of(tree, name)
    raw, paths, _ = tree_flatten_with_path(tree)
    for x, path in zip(raw, paths):
        if isinstance(x, np.generic) or (isinstance(x, np.ndarray) and not x.flags.writeable):
            raise TypeError(f"{format_path(path, name)}: cannot be changed in place (not a writable array)")
    flat, copied, _ = as_flat(tree, layout, name)
    return flat, copied


def scatter_back(flat: FlatTree, tree: Any, name: str) -> None:
    """Copies each leaf of ``flat`` into the matching array of ``tree`` (separate arrays: one copy
    per leaf is all there is to do)."""
    for i, leaf in enumerate(check_leaves(tree, flat.layout, name)):
        if flat.device:
            backend.call("scale_", leaf.reshape(leaf.size), flat.leaf(i).reshape(leaf.size), 1.0, 1.0)
        else:
            np.copyto(leaf, flat.leaf(i))


def copy_state(state: Any) -> Any:
    """An independent deep copy of a state (FlatTrees and arrays copied, structure kept)."""
    if isinstance(state, FlatTree):
        return state.copy()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        return {k: copy_state(v) for k, v in state.items()}
    if isinstance(state, tuple) and hasattr(type(state), "_fields"):
        return type(state)(*(copy_state(v) for v in state))
    if isinstance(state, (tuple, list)):
        return type(state)(copy_state(v) for v in state)
    return state
