"""`lookahead`: k steps forward with a fast optimizer, one step back towards slow weights.

The params are a `LookaheadParams(fast, slow)`; the gradients, of the fast ones. Flattened, each
dtype group of the pair holds the fast leaves then the slow leaves of that dtype (the tree order),
so the fast params are the first half of every group: the fast optimizer runs on views of them,
and the updates of the pair are written in one buffer per group, fast half then slow half.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import arrays, formulas as F
from ._checks import flag, integer, real, transformation, wrong_state
from .base import Stage, as_stage, with_extra_args_support
from .contract import ONE, Factor
from .control import Inner
from .flat import FlatTree, Workspace, as_flat, host_check, host_leaves, layout_and_device, layout_of
from .fuse import Host, Launches
from .layout import Layout
from .protocol import GradientTransformationExtraArgs, state_class
from .traits import ELEMENT
from .tree import tree_map, tree_unflatten
from .updates import ParamsRef, Spec, Updates, check_params

__all__ = ["LookaheadParams", "LookaheadState", "lookahead"]


class LookaheadParams(NamedTuple):
    """The params of `lookahead`: the fast ones (take gradients at these) and the slow ones (use
    these for evaluation).

    Attributes:
        fast: the fast params, a tree.
        slow: the slow params, a tree of the same structure, shapes and dtypes.
    """

    fast: Any
    slow: Any

    @classmethod
    def init_synced(cls, params: Any) -> LookaheadParams:
        """``LookaheadParams(fast=params, slow=a copy of params)``: a copy, unlike optax's (JAX
        arrays are immutable), because numbaccum updates params in place (`numbaccum.step_`);
        each leaf copied where it lives, as the same array type."""
        return cls(fast=params, slow=tree_map(_copy_leaf, params))


def _copy_leaf(x: Any) -> Any:
    """A copy of the leaf ``x`` where it lives (``np.copy`` would bring a CUDA array to the host)."""
    if not arrays.is_cuda_array(x):
        return np.copy(x)
    if not arrays.is_device_array(x):  # CuPy's copy, PyTorch's clone: the same array type
        return x.clone() if hasattr(x, "clone") else x.copy()
    out = arrays.empty(x.size, x.dtype).reshape(x.shape)  # numba's arrays have no copy()
    arrays.raw_bits(out).copy_to_device(arrays.raw_bits(x), stream=arrays.stream())
    return out


@state_class
class LookaheadState(NamedTuple):
    """The state of `lookahead` (optax's fields).

    Attributes:
        fast_state: the fast optimizer's state.
        steps_since_sync: fast steps since the last synchronisation (int32, modulo
            ``sync_period``).
    """

    fast_state: Any
    steps_since_sync: np.int32


def _fast_of(params: Any) -> Any:
    return params.fast if isinstance(params, LookaheadParams) else params


class _Lookahead(Stage):
    """`lookahead` as a reshaping stage: gradients of the fast params in, updates of the pair
    out (its declared `numbaccum.fuse.Host`'s ``spec``)."""

    scope = ELEMENT
    children_at = "stage"
    reshapes = True

    def __init__(self, fast_optimizer: Any, sync_period: Any, slow_step_size: Any, reset_state: Any) -> None:
        self.inner = with_extra_args_support(transformation(fast_optimizer, "fast_optimizer"))
        self.stage = as_stage(self.inner)
        if self.stage.reshapes:
            raise TypeError("lookahead: the fast optimizer must not change the updates' shape")
        self.sync_period = integer(sync_period, "sync_period")
        if self.sync_period < 1:
            raise ValueError(f"sync_period must be >= 1, got {sync_period!r}")
        self.slow_step_size = real(slow_step_size, "slow_step_size")
        self.reset_state = flag(reset_state, "reset_state")

    def refuses_complex(self) -> Any:
        return self.stage.refuses_complex()

    def foreign(self) -> bool:
        return self.stage.foreign()

    def init(self, params: Any) -> LookaheadState:
        return LookaheadState(self.inner.init(_fast_of(params)), np.int32(0))

    def owner(self, state: Any) -> FlatTree | None:
        return self.stage.owner(state.fast_state) if isinstance(state, LookaheadState) else None

    def take(self, updates: Any, state: Any, params: Any, owner: FlatTree | None) -> tuple[Updates, str]:
        """The gradients of the fast params, as `Updates` of the fast params' layout."""
        if not isinstance(params, LookaheadParams):
            raise _not_a_pair(params)
        checked = None
        if owner is not None:  # the fast state's layout: the fast params' (the tick checks them)
            layout, device = owner.layout, owner.device
            if not device and not isinstance(updates, FlatTree):
                checked = host_leaves(updates, layout)  # the common case, checked in one walk
        else:
            layout, device = layout_and_device(params.fast, "params.fast")
        inbox = lambda: self.kept("input", layout, device)  # noqa: E731 (on the params' side)
        flat, copied, kind = as_flat(updates, layout, "updates", inbox, device, checked)
        return Updates(flat, copied), kind

    def declare(self, spec: Spec, state: Any) -> Host:
        """A `numbaccum.fuse.Host` for gradients of the fast params' ``spec``: the fast
        optimizer's plan kept inside it (`numbaccum.control.Inner`), then the pass that writes
        the updates of the pair. Its tick checks the state and the params (the pair's layout:
        the ``spec`` of what it returns, set each step) and ticks the fast optimizer on the
        fast half of the params; its run writes the pair's updates into a workspace of the
        pair's layout (`numbaccum.flat.Workspace`: the one the caller holds is never written
        again), by launches kept over the fast and slow halves (`numbaccum.fuse.Launches`)."""
        if not isinstance(state, LookaheadState):
            raise wrong_state("LookaheadState", state)
        inner = Inner(self.stage, spec, "lookahead.")
        period, a, reset, make_state = self.sync_period, self.slow_step_size, self.reset_state, self.inner.init
        # The pair's spec: the fast params' twice, in a LookaheadParams (any other pair of the
        # same shapes and dtypes, a FlatTree or CUDA arrays: its own, checked once and kept).
        usual = Spec(_pair_of(spec.layout), spec.device)
        n = spec.layout.num_leaves
        pairs: dict = {}  # another pair layout -> (its spec, its updates' workspace)
        usual_out = Workspace(usual.layout, None, spec.device)
        usual_into = Workspace(usual.layout, None, spec.device)  # the usual pair, packed
        check_half = host_check(spec.layout)  # `host_leaves` of one half of the usual pair
        launches = Launches()  # the pair's updates written over fixed bounds, kept
        slow = Factor(1.0, a)
        now: list = [False, None, None, None]  # this step's: sync, steps_since_sync after it,
        # params, the workspace of the pair's updates

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if type(state) is not LookaheadState and not isinstance(state, LookaheadState):
                return False  # declared again: the error above
            if params is None:
                raise ValueError(
                    "lookahead needs params: call update(updates, state, LookaheadParams(fast, slow))"
                )
            pair = params.raw
            if not isinstance(pair, LookaheadParams):
                raise _not_a_pair(pair)
            fast = ParamsRef(
                pair.fast, spec.layout, None, spec.device, fill=lambda: _half(params.flat(), spec.layout)
            )
            checked = None
            if not spec.device:  # the usual pair: each half checked as the fast params' layout
                fast_leaves = check_half(pair.fast) if type(pair) is LookaheadParams else None
                slow_leaves = None if fast_leaves is None else check_half(pair.slow)
                if fast_leaves is not None and slow_leaves is not None:
                    checked = fast_leaves + slow_leaves  # the pair's leaves: fast, then slow
                else:  # (a subclass, another structure: the pair's own walk)
                    checked = host_leaves(pair, usual.layout)
            if checked is not None:  # plain NumPy leaves of the usual pair: the fast ones first
                out_spec, ws = usual, usual_out
                fast.checked = checked[:n]
                # The pair checked against its layout, and where it is packed: the runner has
                # nothing left to do for the params of what this stage returns
                # (`numbaccum.runner._reshaped`).
                params.checked, params._layout, params._into = checked, usual.layout, usual_into
            else:
                layout = layout_of(pair, "params")
                known = pairs.get(layout)
                if known is None:
                    known = Spec(_pair_layout(pair, spec.layout, layout), spec.device)
                    known = (known, Workspace(known.layout, None, spec.device))
                    if len(pairs) > 2:
                        pairs.clear()
                    pairs[layout] = known
                out_spec, ws = known
                fast.checked = check_params(pair.fast, spec)
            if not inner.tick(state.fast_state, fast, extra):
                return False  # the fast state holds other buffers: declared again
            since = int(state.steps_since_sync)
            now[0], now[1], now[2], now[3] = since == period - 1, np.int32((since + 1) % period), params, ws
            part.spec = out_spec
            return True

        def run(u: Updates) -> tuple[Updates, LookaheadState]:
            sync, new_since, params, ws = now
            fast_u, fast_state = inner.run(u, True)
            fu = fast_u.flat
            # The pair's updates in a workspace (one given to the caller is never written again
            # while they hold it: `numbaccum.flat.Workspace`), by kept launches over the halves.
            out = ws()
            if not sync:  # the fast step as it is (its factor applied); the slow params stay
                factor = fast_u.factor
                for gi, (o, g) in enumerate(zip(out.groups, fu.groups)):
                    n = g.size
                    launches.copy(("fast", gi), o, 0, g, 0, n, factor)
                    launches.sliced(("slow", gi), F.fill, (o,), (n,), n, ONE, (0.0,))
                return Updates(out, True), LookaheadState(fast_state, new_since)
            if fast_u.factor is not ONE and not fast_u.factor.is_one:
                fu = fast_u.settled().flat
            pf = params.flat()
            for gi, (o, g, p) in enumerate(zip(out.groups, fu.groups, pf.groups)):
                # d = fast + u - slow; slow += a d; fast = slow's new value (u - (1 - a) d)
                n = g.size
                launches.sliced(("d", gi), F.add_scaled, (p, g, o), (0, 0, n), n, ONE, (1.0,))
                launches.sliced(("d-slow", gi), F.add_scaled, (o, p, o), (n, n, n), n, ONE, (-1.0,))
                launches.sliced(("fast'", gi), F.add_scaled, (g, o, o), (0, n, 0), n, ONE, (-(1.0 - a),))
                launches.sliced(("slow'", gi), F.scale, (o, o), (n, n), n, slow, ())
            if reset:
                fast_state = make_state(params.raw.fast)
            return Updates(out, True), LookaheadState(fast_state, new_since)

        def passes(apply: bool) -> list:
            # per parameter of the fast params: the fast updates and the params of the pair
            # read, the pair's updates written (a sync step's four passes are as many again)
            return [*inner.passes(False), ("kernel", "fast and slow updates", 3.0, 2.0)]

        part = Host(run, passes, "lookahead", tick)
        return part


def _not_a_pair(params: Any) -> TypeError:
    return TypeError(
        f"params: lookahead needs a LookaheadParams(fast, slow), got {type(params).__name__} "
        "(LookaheadParams.init_synced(params) makes one)"
    )


def _pair_layout(pair: Any, fast: Layout, layout: Layout | None = None) -> Layout:
    """The layout of the `LookaheadParams` pair (``layout``, when known), checked: both halves
    of the fast params'."""
    layout = layout_of(pair, "params") if layout is None else layout
    half = fast.num_leaves
    if layout.num_leaves != 2 * half or any(
        layout.shapes[i] != layout.shapes[half + i] or layout.dtypes[i] != layout.dtypes[half + i]
        for i in range(half)
    ):
        raise ValueError("params: the slow params must have the fast params' structure, shapes and dtypes")
    return layout


def _pair_of(fast: Layout) -> Layout:
    """The layout of ``LookaheadParams(fast=p, slow=p)`` for params ``p`` of layout ``fast``
    (made from zero-strided views: nothing of their size is allocated)."""
    leaves = [np.broadcast_to(np.zeros((), d), s) for s, d in zip(fast.shapes, fast.dtypes)]
    tree = tree_unflatten(fast.treedef, leaves)
    return layout_of(LookaheadParams(tree, tree), "params")


def _half(pair: FlatTree, layout: Layout) -> FlatTree:
    """The fast params: views of the first half of each group of the pair's buffers."""
    groups = [g[:n] for g, n in zip(pair.groups, layout.group_sizes)]
    buffers = {np.dtype(g.dtype): g for g in groups}
    return FlatTree(layout, groups, buffers)


def lookahead(
    fast_optimizer: Any, sync_period: int, slow_step_size: float, reset_state: bool = False
) -> GradientTransformationExtraArgs:
    """Lookahead: ``sync_period`` steps of ``fast_optimizer`` on the fast params, then the slow
    params move ``slow_step_size`` of the way to the fast ones and the fast ones are set there.

    With ``u`` the fast optimizer's update: between synchronisations the fast params get ``u``
    and the slow ones 0; at a synchronisation (every ``sync_period``-th step), with ``d = fast +
    u - slow``, the slow params get ``slow_step_size * d`` and the fast ones ``u - (1 -
    slow_step_size) d`` (so both end at ``slow + slow_step_size * d``), as optax computes them.
    The params are a `LookaheadParams(fast, slow)` and the gradients those of the fast params;
    the updates are a `LookaheadParams` for `apply_updates` or `numbaccum.step_`.

    Args:
        fast_optimizer: the inner transformation.
        sync_period: fast steps between synchronisations (``>= 1``).
        slow_step_size: how far the slow params move towards the fast ones (0 to 1).
        reset_state: re-initialise the fast optimizer's state at each synchronisation.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``LookaheadState(fast_state,
            steps_since_sync)``, as in optax.

    Raises:
        TypeError: ``fast_optimizer`` is not a transformation, or a hyperparameter has the
            wrong type; at an update, the params are not a `LookaheadParams`.
        ValueError: ``sync_period < 1``; at an update, the slow params do not match the fast
            ones.

    References:
        Zhang et al., "Lookahead Optimizer: k steps forward, 1 step back", NeurIPS 2019
        (arXiv:1907.08610). optax.lookahead.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.lookahead(nba.sgd(0.1), sync_period=2, slow_step_size=0.5)
        >>> params = nba.LookaheadParams.init_synced({"w": np.ones(2)})
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     state = nba.step_(tx, {"w": 2 * params.fast["w"]}, state, params)  # grad of w^2
        >>> params.fast["w"], params.slow["w"]  # fast: 1 -> 0.8 -> 0.64; synced halfway: 0.82
        (array([0.82, 0.82]), array([0.82, 0.82]))
    """
    return _Lookahead(fast_optimizer, sync_period, slow_step_size, reset_state).transformation()
