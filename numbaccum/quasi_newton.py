"""L-BFGS and its line searches, for scientific optimisation loops (optax's ``lbfgs``).

`scale_by_lbfgs` keeps the last ``memory_size`` differences of params and gradients as FlatTrees
of the params' layout, and multiplies the gradient by the inverse-Hessian approximation they
define with the two-loop recursion (Nocedal and Wright, Algorithm 7.4) on the flat buffers: each
inner product is one float64 reduction per dtype group (`numbaccum.contract.Ops.dot`), each
update of the vector one elementwise pass (``add_scaled_``). No Python loop over leaves.

`scale_by_zoom_linesearch` then finds a step along that direction satisfying the strong Wolfe
conditions (Algorithms 3.5 and 3.6, with Hager and Zhang's approximate decrease near the
minimum), calling the objective at trial points. A NumPy user has no automatic differentiation,
so the objective comes as ``value_fn(params) -> (value, grad)`` (SciPy's ``jac=True``), or as
``value_fn(params) -> value`` together with ``grad_fn(params) -> grad``. The value and gradient
of the accepted point stay in the state, and `value_and_grad_from_state` hands them to the next
iteration instead of evaluating the objective again.

The line search and the two-loop recursion run their scalar logic on the host in float64; the
vectors live in the flat buffers (on the GPU too, where the inner products for now go through
host copies).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _config
from ._checks import flag, integer, non_negative, real, real_scalar, wrong_state
from ._interrupts import user_code
from .backend import ops_for
from .base import Stage, chain, states_of
from .contract import ONE, Factor
from .declared import expect_state, safe_increment
from .flat import FlatTree, as_flat, layout_and_device
from .fuse import Host
from .protocol import GradientTransformationExtraArgs, state_class
from .scaling import ScalarOrSchedule, identity, scale, scale_by_learning_rate
from .transaction import current
from .updates import Spec, Updates

__all__ = [
    "BacktrackingLinesearchInfo",
    "ScaleByBacktrackingLinesearchState",
    "ScaleByLBFGSState",
    "ScaleByZoomLinesearchState",
    "ZoomLinesearchInfo",
    "lbfgs",
    "scale_by_backtracking_linesearch",
    "scale_by_lbfgs",
    "scale_by_zoom_linesearch",
    "value_and_grad_from_state",
]


def _dot(x: FlatTree, y: FlatTree, ops: list | None = None) -> float:
    """The real inner product of two FlatTrees of one layout, float64: per group, summed in
    group order. ``ops``: each group's `numbaccum.contract.Ops`, when the caller has them."""
    total = 0.0
    for i, (a, b) in enumerate(zip(x.groups, y.groups)):
        total += (ops[i] if ops is not None else ops_for(a)).dot(a, b)
    return total


def _axpy(out: FlatTree, x: FlatTree, s: float, y: FlatTree, ops: list | None = None) -> None:
    """out = x + s * y, group by group, in each group's dtype."""
    for i, (o, a, b) in enumerate(zip(out.groups, x.groups, y.groups)):
        (ops[i] if ops is not None else ops_for(o)).add_scaled_(o, a, ONE, b, s)


def _copy_into(out: FlatTree, x: FlatTree, ops: list | None = None) -> None:
    for i, (o, a) in enumerate(zip(out.groups, x.groups)):
        (ops[i] if ops is not None else ops_for(o)).scale_(o, a, ONE)


def _two_loop(
    vec: FlatTree, g: FlatTree, p: FlatTree, prev_params: FlatTree, prev_updates: FlatTree,
    dps: tuple, dus: tuple, rhos: np.ndarray, order: Any, gamma: float, ops: list,
) -> None:
    """This step's pair kept and the two-loop recursion over the memory slots ``order`` (oldest
    first), through the contract's calls (`numbaccum.cpu.reduce.lbfgs_two_loop` compiled)."""
    _copy_into(prev_params, p, ops)  # this step's pair, kept for the next one
    _copy_into(prev_updates, g, ops)
    if vec is not g:
        _copy_into(vec, g, ops)
    alphas = []
    for j in reversed(order):
        alpha = rhos[j] * _dot(dps[j], vec, ops)
        _axpy(vec, vec, -alpha, dus[j], ops)
        alphas.append(alpha)
    if gamma != 1.0:
        for o, op in zip(vec.groups, ops):
            op.scale_(o, o, Factor(1.0, gamma))
    for j, alpha in zip(order, reversed(alphas)):
        beta = rhos[j] * _dot(dus[j], vec, ops)
        _axpy(vec, vec, alpha - beta, dps[j], ops)


def _compiled_groups(prev_params: FlatTree, prev_updates: FlatTree, dps: tuple, dus: tuple) -> Any:
    """``groups(p, g, vec)``: per dtype group, the arguments of the CPU engine's compiled step
    (`numbaccum.cpu.reduce.lbfgs_pair`, ``lbfgs_two_loop``), or None where the step's buffers
    do not fit them; None where it never runs: on a device, more than two groups, dtypes other
    than float32 and float64, a group of a size the driver runs in parallel (there the
    contract's calls use every core), or a memory of more than `_COMPILED_MEMORY` slots."""
    kept = prev_params.groups
    if prev_params.device or len(kept) > 2 or len(dps) > _COMPILED_MEMORY:
        return None
    fixed = []
    for gi, (pp, pu) in enumerate(zip(kept, prev_updates.groups)):
        dt = pp.dtype
        mem = tuple(d.groups[gi] for d in dps), tuple(d.groups[gi] for d in dus)
        arrays = (pu, *mem[0], *mem[1])
        if dt not in _REALS or pp.size >= _config.SERIAL_BELOW or not pp.flags.c_contiguous:
            return None
        if any(a.dtype != dt or not a.flags.c_contiguous for a in arrays):
            return None
        fixed.append((pp, pu, *mem, dt.type(0)))
    none = np.zeros(0, np.float64)  # the pad of a tree of one group: adds 0.0 to each product
    pad = (none, none, none, none, none, (none,) * len(dps), (none,) * len(dus), np.float64(0.0))

    def groups(p: FlatTree, g: FlatTree, vec: FlatTree) -> tuple | None:
        out: list = []
        for pp, pu, ds, us, zero in fixed:
            a, b, q = p.groups[len(out)], g.groups[len(out)], vec.groups[len(out)]
            if a.dtype != pp.dtype or b.dtype != pp.dtype or q.dtype != pp.dtype:
                return None
            out.append((a, b, pp, pu, q, ds, us, zero))
        return (*out, pad) if len(out) == 1 else tuple(out)

    return groups


_REALS = (np.dtype(np.float32), np.dtype(np.float64))
# The compiled step takes the memory as tuples of arrays, a type (and a compilation) per memory
# size (about 5 s for 10 or 16 slots, once: the kernel cache keeps it); past a few dozen, numba's
# compilation runs for minutes and exhausts memory (1000 slots crashed a test worker). optax's
# default is 10; a larger memory takes the contract's calls (the same bits: test_declared_hosts).
_COMPILED_MEMORY = 16


def _weights_fit(weights: Any, m: int) -> bool:
    """Whether a state's ``weights_memory`` holds ``m`` floats."""
    w = np.asarray(weights)
    return w.shape == (m,) and w.dtype.kind == "f"


# --- L-BFGS's direction ----------------------------------------------------------------------


@state_class
class ScaleByLBFGSState(NamedTuple):
    """L-BFGS's state (optax's fields).

    Attributes:
        count: the number of updates so far (int32, saturating).
        params: the params of the last update, a FlatTree of their layout.
        updates: the updates (gradients) of the last update.
        diff_params_memory: ``memory_size`` FlatTrees: the last differences of params
            (``s_k``), a ring buffer.
        diff_updates_memory: ``memory_size`` FlatTrees: the last differences of gradients
            (``y_k``).
        weights_memory: ``1 / <s_k, y_k>`` of each slot (0 where unset), float64.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    params: FlatTree
    updates: FlatTree
    diff_params_memory: tuple
    diff_updates_memory: tuple
    weights_memory: np.ndarray


class _ScaleByLBFGS(Stage):
    complex_leaves = True  # optax's: real parts of the inner products
    public_name = "scale_by_lbfgs"

    def __init__(self, memory_size: Any, scale_init_precond: Any) -> None:
        self.memory_size = integer(memory_size, "memory_size")
        if self.memory_size < 1:
            raise ValueError(f"memory_size must be >= 1, got {memory_size!r}")
        self.scale_init_precond = flag(scale_init_precond, "scale_init_precond")

    def init(self, params: Any) -> ScaleByLBFGSState:
        layout, device = layout_and_device(params, "params")
        m = self.memory_size

        def zeros() -> FlatTree:
            return FlatTree.zeros(layout, None, device)

        first = zeros()
        _check_memory_fits(m, sum(g.nbytes for g in first.groups))
        return ScaleByLBFGSState(
            np.int32(0),
            first,
            zeros(),
            tuple(zeros() for _ in range(m)),
            tuple(zeros() for _ in range(m)),
            np.zeros(m, np.float64),
        )

    def owner(self, state: Any) -> FlatTree | None:
        return (
            state.params
            if isinstance(state, ScaleByLBFGSState) and isinstance(state.params, FlatTree)
            else None
        )

    def written(self, state: Any) -> Any:
        """A step writes the last params and updates and, from the second step on, the newest
        pair's slot of each memory (`plan`'s ``prev``): a chain copies these before its line
        search, not the whole memory (the weights are a new array each step)."""
        if not isinstance(state, ScaleByLBFGSState) or not isinstance(state.diff_params_memory, tuple):
            return state  # `plan` refuses it before anything runs; copy what is there
        count, m = int(state.count), len(state.diff_params_memory)
        if count == 0 or m == 0 or len(state.diff_updates_memory) != m:
            return (state.params, state.updates)
        prev = (count - 1) % m
        return (state.params, state.updates, state.diff_params_memory[prev], state.diff_updates_memory[prev])

    def declare(self, spec: Spec, state: Any) -> Host:
        """A `numbaccum.fuse.Host` over ``state``'s buffers (checked here: type, layouts,
        devices, the memories' length); its tick takes the step's count, weights and params."""
        prev_params = expect_state(state, ScaleByLBFGSState, "params", spec, renew=False)
        prev_updates = expect_state(state, ScaleByLBFGSState, "updates", spec, renew=False)
        m = self.memory_size
        memories = []
        for field in ("diff_params_memory", "diff_updates_memory"):
            mem = getattr(state, field)
            if not isinstance(mem, tuple) or len(mem) != m:
                raise ValueError(
                    f"state.{field}: expected {m} FlatTrees (memory_size), got {type(mem).__name__}"
                )
            for k, f in enumerate(mem):
                if not isinstance(f, FlatTree) or f.layout is not spec.layout or f.device != spec.device:
                    raise ValueError(f"state.{field}[{k}]: not a FlatTree of the updates' layout and device")
            memories.append(mem)
        if not _weights_fit(state.weights_memory, m):
            weights = np.asarray(state.weights_memory)
            raise ValueError(f"state.weights_memory: expected {m} floats, got {weights.dtype}{weights.shape}")
        dps, dus = memories
        scale_init = self.scale_init_precond
        # The buffers declared for, by storage (renewals share it); the memories by the tuples,
        # which every step passes on as they are (a copied or loaded state has its own).
        p_storage, u_storage = prev_params.__dict__, prev_updates.__dict__
        ops = [ops_for(g) for g in prev_params.groups]  # per group: the same for every buffer
        engine: Any = ops[0].reduce if ops else None
        block = np.int64(_config.REDUCE_BLOCK)
        compiled = _compiled_groups(prev_params, prev_updates, dps, dus)
        now: list = [0, None, None, None]  # this step's count, weights, owner and params

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if params is None:
                raise ValueError("scale_by_lbfgs needs params: call update(updates, state, params)")
            if type(state) is not ScaleByLBFGSState and not isinstance(state, ScaleByLBFGSState):
                return False
            if (
                getattr(state.params, "__dict__", None) is not p_storage
                or getattr(state.updates, "__dict__", None) is not u_storage
                or state.diff_params_memory is not dps
                or state.diff_updates_memory is not dus
                or not _weights_fit(state.weights_memory, m)
            ):
                return False
            now[:] = int(state.count), state.weights_memory, current(state.params, "params"), params
            return True

        def run(u: Updates) -> tuple[Updates, ScaleByLBFGSState]:
            count, weights, prev_params, params = now  # (prev_params: renewed, the owner)
            idx, prev = count % m, (count - 1) % m
            filled = min(count, m)  # slots written so far (after this step's)
            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            g, p = u.flat, params.flat()
            rhos = np.asarray(weights).copy()
            vec = u.fresh()  # (the updates' own buffer when they may be overwritten)
            # the CPU engine's compiled step, where it applies (float64 weights: its arithmetic)
            fast = compiled(p, g, vec) if compiled is not None and rhos.dtype == np.float64 else None
            if count > 0:  # the newest pair (s, y), from the last step's params and gradients
                if fast:
                    sy, yy = engine.lbfgs_pair(*fast, prev, True, block)
                else:
                    s, y = dps[prev], dus[prev]
                    _axpy(s, p, -1.0, prev_params, ops)
                    _axpy(y, g, -1.0, prev_updates, ops)
                    sy = _dot(y, s, ops)
                    yy = _dot(y, y, ops) if scale_init else 0.0
                rhos[prev] = 0.0 if sy == 0.0 else 1.0 / sy
            if not scale_init:
                gamma = 1.0
            elif count > 0:
                gamma = sy / yy if yy > 0.0 else 1.0
            else:  # optax's first step: a capped reciprocal of the gradient's norm
                gg = engine.lbfgs_pair(*fast, prev, False, block)[0] if fast else _dot(g, g, ops)
                with np.errstate(divide="ignore"):
                    gamma = float(np.minimum(1.0, 1.0 / np.sqrt(gg)))
            # The two-loop recursion, newest pair first; slots not yet written hold zeros and
            # weight 0, and change nothing: skipped.
            order = (np.arange(idx, idx + m) % m)[m - filled :]
            if fast:
                f = Factor(1.0, gamma)
                engine.lbfgs_two_loop(*fast, rhos, order, vec is not g, f.div, f.mul, gamma != 1.0, block)
            else:
                _two_loop(vec, g, p, prev_params, prev_updates, dps, dus, rhos, order, gamma, ops)
            new = ScaleByLBFGSState(safe_increment(count), prev_params, prev_updates, dps, dus, rhos)
            return Updates(vec, True, scratch=u.scratch), new

        # Per step with a full memory: the newest pair and its inner products, this step's
        # params and updates kept, then per slot an inner product and an update of the vector
        # each way (the vector's copy and the gamma scaling aside).
        passes = (
            ("kernel", "newest pair s, y", 4.0, 2.0),
            ("reduction", "<s, y>, <y, y>", 3.0, 0.0),
            ("kernel", "keep params and updates", 2.0, 2.0),
            ("reduction", f"{m} inner products <s_k, q>, <y_k, q>", 4.0 * m, 0.0),
            ("kernel", f"{2 * m} updates of the direction q", 4.0 * m, 2.0 * m),
        )
        return Host(run, passes, "scale_by_lbfgs", tick)


# What one FlatTree of the memory costs on the host beyond its buffers (the object, its views).
_TREE_OVERHEAD = 1024


def _check_memory_fits(m: int, tree_bytes: int) -> None:
    """A ``memory_size`` whose 2 m FlatTrees cannot fit in this machine's memory is refused at
    `init`, naming it: building them one by one would run for hours before NumPy ran out."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX machine: NumPy's own MemoryError
        return
    need = 2 * m * (tree_bytes + _TREE_OVERHEAD) + 8 * m
    if need > physical:
        raise ValueError(
            f"memory_size={m}: its {2 * m} FlatTrees need about {need / 2**30:.3g} GiB, more than "
            f"this machine's {physical / 2**30:.3g} GiB"
        )


def scale_by_lbfgs(memory_size: int = 10, scale_init_precond: bool = True) -> GradientTransformationExtraArgs:
    """Multiplies the updates by L-BFGS's approximation of the inverse Hessian.

    With ``s_k = p_{k+1} - p_k`` and ``y_k = g_{k+1} - g_k`` of the last ``memory_size`` steps
    and ``rho_k = 1 / <s_k, y_k>`` (0 where that is 0), the two-loop recursion: ``q = g``; newest
    first, ``a_k = rho_k <s_k, q>``, ``q -= a_k y_k``; ``q *= gamma``; oldest first, ``b_k =
    rho_k <y_k, q>``, ``q += (a_k - b_k) s_k``; ``u = q``. ``gamma = <s, y> / <y, y>`` of the
    newest pair (``scale_init_precond``; 1 otherwise), ``min(1, 1 / ||g||)`` at the first step.
    Inner products are float64 reductions over the flat buffers; each vector update is one pass.

    Args:
        memory_size: the number of pairs kept (``>= 1``).
        scale_init_precond: scale the initial inverse Hessian by ``gamma``.

    Returns:
        A `GradientTransformationExtraArgs` whose ``update`` needs params; its state is
            ``ScaleByLBFGSState(count, params, updates, diff_params_memory, diff_updates_memory,
            weights_memory)``, as in optax (the memories: tuples of FlatTrees).

    Raises:
        TypeError: ``memory_size`` is not an int or ``scale_init_precond`` not a bool.
        ValueError: ``memory_size < 1``; at `init`, a memory that cannot fit in the machine's
            memory; at an update, no params.

    References:
        Nocedal and Wright, "Numerical Optimization", 1999, Algorithms 7.4 and 7.5; Liu and
        Nocedal, "On the limited memory BFGS method for large scale optimization", 1989.
        optax.scale_by_lbfgs.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.scale_by_lbfgs()
        >>> p = {"x": np.array([3.0, 4.0])}
        >>> u, state = tx.update({"x": np.array([3.0, 4.0])}, tx.init(p), p)
        >>> u["x"]  # the first step: g / ||g|| (a capped reciprocal of the norm)
        array([0.6, 0.8])
    """
    return _ScaleByLBFGS(memory_size, scale_init_precond).transformation()


# --- the zoom line search ------------------------------------------------------------------


@state_class
class ZoomLinesearchInfo(NamedTuple):
    """What the last line search did (optax's fields).

    Attributes:
        num_linesearch_steps: the objective's evaluations it made.
        decrease_error: how far the accepted step is from sufficient decrease (0: satisfied).
        curvature_error: how far it is from the small-curvature condition (0: satisfied).
    """

    num_linesearch_steps: np.int32
    decrease_error: np.float64
    curvature_error: np.float64


@state_class
class ScaleByZoomLinesearchState(NamedTuple):
    """State of `scale_by_zoom_linesearch` (optax's fields).

    Attributes:
        learning_rate: the step size the last search accepted (float64).
        value: the objective at the accepted point (inf after ``init``).
        grad: its gradient, a FlatTree of the params' layout.
        info: a `ZoomLinesearchInfo`.
    """

    learning_rate: np.float64
    value: np.float64
    grad: FlatTree
    info: ZoomLinesearchInfo


class _Point(NamedTuple):
    """A trial point of the search: its step size, value, gradient and slope along the
    direction."""

    step: float
    value: float
    grad: FlatTree | None
    slope: float


def _cubicmin(a: float, fa: float, fpa: float, b: float, fb: float, c: float, fc: float) -> float:
    """The minimiser of the cubic through (a, fa), (b, fb), (c, fc) with slope fpa at a (NaN
    when it has none), as SciPy's and optax's."""
    a, fa, fpa, b, fb, c, fc = (np.float64(v) for v in (a, fa, fpa, b, fb, c, fc))
    with np.errstate(all="ignore"):
        db, dc = b - a, c - a
        denom = (db * dc) ** 2 * (db - dc)
        rb, rc = fb - fa - fpa * db, fc - fa - fpa * dc
        aa = (dc**2 * rb - db**2 * rc) / denom
        bb = (-(dc**3) * rb + db**3 * rc) / denom
        radical = bb * bb - 3.0 * aa * fpa
        return float(a + (-bb + np.sqrt(np.float64(radical))) / (3.0 * aa))


def _quadmin(a: float, fa: float, fpa: float, b: float, fb: float) -> float:
    """The minimiser of the quadratic through (a, fa), (b, fb) with slope fpa at a."""
    a, fa, fpa, b, fb = (np.float64(v) for v in (a, fa, fpa, b, fb))
    with np.errstate(all="ignore"):
        db = b - a
        bb = (fb - fa - fpa * db) / (db * db)
        return float(a - fpa / (2.0 * bb))


class _Zoom:
    """One line search: Algorithm 3.5 (bracketing) then 3.6 (zoom) of Nocedal and Wright, as
    optax's ``zoom_linesearch`` runs them, on the host."""

    def __init__(
        self, ls: _ZoomLinesearch, evaluate: Callable[[float], _Point], start: _Point, guess: float
    ) -> None:
        self.ls, self.evaluate, self.start, self.guess = ls, evaluate, start, guess

    def errors(self, pt: _Point) -> tuple[float, float]:
        ls, v0, s0 = self.ls, self.start.value, self.start.slope
        with np.errstate(all="ignore"):
            dec = pt.value - v0 - ls.slope_rtol * pt.step * s0
            if ls.approx_dec_rtol is not None:  # Hager and Zhang's approximate decrease
                approx = max(
                    pt.slope - (2 * ls.slope_rtol - 1.0) * s0, pt.value - v0 - ls.approx_dec_rtol * abs(v0)
                )
                dec = min(approx, dec)
            curv = abs(pt.slope) - ls.curv_rtol * abs(s0)
        dec = math.inf if math.isnan(dec) else max(dec, 0.0)
        curv = math.inf if math.isnan(curv) else max(curv, 0.0)
        return dec, curv

    def run(self) -> tuple[_Point, int, float, float]:
        """The accepted point, the evaluations made, its decrease and curvature errors."""
        ls = self.ls
        tol, max_steps = ls.tol, ls.max_linesearch_steps
        prev = self.start
        safe = _Point(0.0, self.start.value, self.start.grad, self.start.slope)
        low = high = cubic = prev
        found, n = False, 0
        cur, dec, curv = prev, math.inf, math.inf
        while n < max_steps:
            if not found:  # bracketing: grow the step until an interval holds a good one
                step = self.guess if n == 0 else ls.increase_factor * prev.step
                capped = ls.max_learning_rate is not None and step >= ls.max_learning_rate
                if ls.max_learning_rate is not None:
                    step = min(step, ls.max_learning_rate)
                cur = self.evaluate(step)
                n += 1
                dec, curv = self.errors(cur)
                if dec <= tol:
                    safe = cur
                to_high = dec > 0.0 or (cur.value >= prev.value and n > 1)
                to_low = cur.slope >= 0.0 and not to_high
                if to_low:
                    low, high = cur, prev
                else:
                    low, high = prev, cur
                cubic = low
                found = to_high or to_low or max(dec, curv) <= tol
                if max(dec, curv) <= tol:
                    return cur, n, dec, curv
                if capped and not found:
                    return cur, n, dec, curv
                prev = cur
                failed = n >= max_steps
            else:  # zoom: interpolate inside [low, high]
                delta = abs(high.step - low.step)
                left, right = min(high.step, low.step), max(high.step, low.step)
                mid = _cubicmin(
                    low.step, low.value, low.slope, high.step, high.value, cubic.step, cubic.value
                )
                if not (left + 0.2 * delta < mid < right - 0.2 * delta):
                    mid = _quadmin(low.step, low.value, low.slope, high.step, high.value)
                    if not (left + 0.1 * delta < mid < right - 0.1 * delta):
                        mid = (low.step + high.step) / 2.0
                cur = self.evaluate(mid)
                n += 1
                dec, curv = self.errors(cur)
                if dec <= tol and cur.value < safe.value:
                    safe = cur
                if max(dec, curv) <= tol:
                    return cur, n, dec, curv
                to_high = dec > 0.0 or cur.value >= low.value
                high_to_low = cur.slope * (high.step - low.step) >= 0.0 and not to_high
                old_low, old_high = low, high
                if to_high:
                    high = cur
                elif high_to_low:
                    high = old_low
                if not to_high:
                    low = cur
                cubic = old_high if (to_high or high_to_low) else old_low
                failed = n >= max_steps or (delta <= ls.stepsize_precision and safe.step > 0.0)
            if failed:
                break
        # Failed: the best point of sufficient decrease if any (or where the objective is not
        # finite, no step), else the last one tried.
        return (safe if safe.step > 0.0 or math.isinf(dec) else cur), n, dec, curv


class _ZoomLinesearch(Stage):
    complex_leaves = True
    public_name = "scale_by_zoom_linesearch"

    def foreign(self) -> bool:
        return True  # the objective (value_fn, grad_fn) runs while the step runs

    def __init__(
        self,
        max_linesearch_steps: Any,
        max_learning_rate: Any,
        tol: Any,
        increase_factor: Any,
        slope_rtol: Any,
        curv_rtol: Any,
        approx_dec_rtol: Any,
        stepsize_precision: Any,
        initial_guess_strategy: Any,
    ) -> None:
        self.max_linesearch_steps = integer(max_linesearch_steps, "max_linesearch_steps")
        if self.max_linesearch_steps < 1:
            raise ValueError(f"max_linesearch_steps must be >= 1, got {max_linesearch_steps!r}")
        self.max_learning_rate = (
            None if max_learning_rate is None else real(max_learning_rate, "max_learning_rate")
        )
        self.tol = non_negative(tol, "tol")
        # Any real, as optax: a factor <= 1 keeps (or shrinks) the step while bracketing, and the
        # search still ends after max_linesearch_steps evaluations.
        self.increase_factor = real(increase_factor, "increase_factor")
        self.slope_rtol, self.curv_rtol = real(slope_rtol, "slope_rtol"), real(curv_rtol, "curv_rtol")
        self.approx_dec_rtol = None if approx_dec_rtol is None else real(approx_dec_rtol, "approx_dec_rtol")
        self.stepsize_precision = non_negative(stepsize_precision, "stepsize_precision")
        if initial_guess_strategy not in ("one", "keep"):
            raise ValueError(
                f"initial_guess_strategy must be 'one' or 'keep', got {initial_guess_strategy!r}"
            )
        self.keep = initial_guess_strategy == "keep"

    def init(self, params: Any) -> ScaleByZoomLinesearchState:
        layout, device = layout_and_device(params, "params")
        info = ZoomLinesearchInfo(np.int32(0), np.float64(math.inf), np.float64(math.inf))
        return ScaleByZoomLinesearchState(
            np.float64(1.0), np.float64(math.inf), FlatTree.zeros(layout, None, device), info
        )

    def owner(self, state: Any) -> FlatTree | None:
        ok = isinstance(state, ScaleByZoomLinesearchState) and isinstance(state.grad, FlatTree)
        return state.grad if ok else None

    def declare(self, spec: Spec, state: Any) -> Host:
        """A `numbaccum.fuse.Host` over ``state``'s gradient buffer (checked here); its tick
        checks the step's params and objective (the extra arguments) and takes the guess."""
        kept = expect_state(state, ScaleByZoomLinesearchState, "grad", spec, renew=False)
        storage, keep = kept.__dict__, self.keep
        cls, name = ScaleByZoomLinesearchState, self.public_name
        trial_of = self.workspace(state, spec, "trial")
        now: list = [None] * 6  # this step's params, kept grad, value0, grad0, objective, guess

        def tick(state: Any, params: Any, extra: dict) -> bool:
            got = _search_tick(state, cls, storage, params, extra, spec, name)
            if got is None:
                return False
            now[:] = *got, float(state.learning_rate) if keep else 1.0
            return True

        def run(u: Updates) -> tuple[Updates, ScaleByZoomLinesearchState]:
            params, kept_grad, value0, grad0, objective, guess = now
            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            direction, p = u.flat, params.flat()
            trial = trial_of()  # kept: not a new params-sized buffer per update

            def evaluate(step: float) -> _Point:
                _axpy(trial, p, step, direction)
                value, grad = objective(trial)
                return _Point(step, value, grad, _dot(grad, direction))

            start = _Point(0.0, value0, grad0, _dot(grad0, direction))
            best, n, dec, curv = _Zoom(self, evaluate, start, guess).run()
            assert best.grad is not None  # (`evaluate` computes every point's gradient)
            _copy_into(kept_grad, best.grad)
            info = ZoomLinesearchInfo(np.int32(n), np.float64(dec), np.float64(curv))
            new = ScaleByZoomLinesearchState(np.float64(best.step), np.float64(best.value), kept_grad, info)
            return u.scaled(Factor(1.0, best.step)), new

        # The objective is the user's: an opaque row (its trial points are passes of its own).
        return Host(run, None, "scale_by_zoom_linesearch", tick, pending=True)


def _search_tick(
    state: Any, cls: type[Any], storage: dict | None, params: Any, extra: dict, spec: Spec, name: str
) -> tuple | None:
    """What a line search's tick checks and takes: ``(params, kept grad, value, grad,
    objective)`` (the kept gradient renewed, None without one: ``storage`` None), or None when
    ``state`` is not one holding the buffer declared for (``storage``). A ValueError without
    params, the objective's errors (`_objective`), before anything runs."""
    if params is None:
        raise ValueError(f"{name} needs params: call update(updates, state, params)")
    if not isinstance(state, cls):
        return None
    kept = None
    if storage is not None:
        if getattr(state.grad, "__dict__", None) is not storage:
            return None
        kept = current(state.grad, "grad")
    return (params, kept, *_objective(extra, spec, name))


_OWN = ("value", "grad", "value_fn", "grad_fn")


def _objective(
    extra: dict, spec: Spec, name: str = "scale_by_zoom_linesearch"
) -> tuple[float, FlatTree, Callable[..., tuple[float, FlatTree | None]]]:
    """The value and gradient at the params, and ``objective(point, grad=True) -> (value,
    grad)`` (``grad=False``: the gradient None, unless ``value_fn`` gives it anyway), from an
    update's extra arguments (checked before anything runs)."""
    missing = [k for k in ("value", "grad", "value_fn") if k not in extra]
    if missing:
        raise TypeError(
            f"{name} needs the keyword arguments value, grad and value_fn (missing "
            f"{', '.join(missing)}): update(updates, state, params, value=f, grad=g, value_fn=fn)"
        )
    value_fn, grad_fn = extra["value_fn"], extra.get("grad_fn")
    if not callable(value_fn):
        raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}")
    if grad_fn is not None and not callable(grad_fn):
        raise TypeError(f"grad_fn must be callable, got {type(grad_fn).__name__}")
    value0 = _real_value(extra["value"], "value")
    grad0 = as_flat(extra["grad"], spec.layout, "grad", device=spec.device)[0]
    # optax's rule: the other keyword arguments go to value_fn (and grad_fn) when it names them
    kwargs = {k: v for k, v in extra.items() if k not in _OWN}
    fn_kwargs = _accepted(value_fn, kwargs)
    unused = sorted(set(kwargs) - set(fn_kwargs))
    if unused and not _takes_all(value_fn):
        raise TypeError(
            f"{name}: keyword arguments {unused} are not arguments of value_fn "
            "(the line search passes value_fn the ones it names)"
        )
    grad_kwargs = {} if grad_fn is None else _accepted(grad_fn, kwargs)

    def objective(point: FlatTree, need_grad: bool = True) -> tuple[float, FlatTree | None]:
        # The user's code, after earlier stages wrote (L-BFGS's memories): interruptible, and
        # the chain restores them if it raises (the line search is `foreign`).
        out = user_code(value_fn, point.tree, **fn_kwargs)
        grad = None
        if isinstance(out, tuple) and len(out) == 2:
            out, grad = out
        elif need_grad and grad_fn is not None:
            grad = user_code(grad_fn, point.tree, **grad_kwargs)
        elif need_grad:
            raise TypeError(
                f"{name} needs gradients at its trial points: value_fn(params) "
                "must return (value, grad), or pass grad_fn=... as well"
            )
        value = _real_value(out, "value_fn's value")
        if grad is None:
            return value, None
        flat = FlatTree.empty(spec.layout, None, spec.device)
        return value, as_flat(grad, spec.layout, "value_fn's grad", flat, spec.device)[0]

    return value0, grad0, objective


def _real_value(value: Any, name: str) -> float:
    return real_scalar(value, name, "the objective", size_one=True)


def _accepted(fn: Callable[..., Any], kwargs: dict) -> dict:
    if _takes_all(fn):
        return dict(kwargs)
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in kwargs.items() if k in names}


def _takes_all(fn: Callable[..., Any]) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def scale_by_zoom_linesearch(
    max_linesearch_steps: int,
    max_learning_rate: float | None = None,
    tol: float = 0.0,
    increase_factor: float = 2.0,
    slope_rtol: float = 1e-4,
    curv_rtol: float = 0.9,
    approx_dec_rtol: float | None = 1e-6,
    stepsize_precision: float = 1e-5,
    initial_guess_strategy: str = "keep",
    verbose: bool = False,
) -> GradientTransformationExtraArgs:
    """Scales the updates by a step size satisfying the strong Wolfe conditions.

    The step ``eta`` along the updates ``u`` (a descent direction) is searched for with
    ``f(w + eta u) <= f(w) + slope_rtol eta <grad f(w), u>`` (sufficient decrease; near the
    minimum, Hager and Zhang's approximate form) and ``|<grad f(w + eta u), u>| <= curv_rtol
    |<grad f(w), u>|`` (small curvature): an interval is bracketed by growing the step by
    ``increase_factor``, then zoomed into by cubic, quadratic or bisection steps. When no step
    satisfies both within ``max_linesearch_steps`` evaluations, the best one of sufficient
    decrease is taken. ``update`` needs ``value`` and ``grad`` (the objective and its gradient at
    the params) and ``value_fn``: ``value_fn(params, **kw) -> (value, grad)``, or ``-> value``
    with ``grad_fn(params, **kw) -> grad``; other keyword arguments of the update that
    ``value_fn`` names are passed to it (optax's rule).

    Args:
        max_linesearch_steps: the most evaluations of the objective per update (``>= 1``).
        max_learning_rate: the largest step size tried (None: no bound).
        tol: tolerance on both conditions (``>= 0``).
        increase_factor: the step's growth while bracketing (``> 1`` to grow it; any real, as
            optax's).
        slope_rtol: the sufficient decrease's constant (``c1``).
        curv_rtol: the curvature condition's constant (``c2``).
        approx_dec_rtol: the relative decrease under which the approximate decrease applies
            (None: never).
        stepsize_precision: the interval length under which a step of sufficient decrease is
            accepted.
        initial_guess_strategy: ``'one'`` (each search starts at 1, for quasi-Newton methods) or
            ``'keep'`` (at the last accepted step).
        verbose: accepted for optax's signature (failures are reported in ``state.info``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleByZoomLinesearchState(
            learning_rate, value, grad, info)``, as in optax.

    Raises:
        TypeError: a hyperparameter has the wrong type; at an update, ``value``, ``grad`` or
            ``value_fn`` is missing or wrong, or ``value_fn`` gives no gradient.
        ValueError: a hyperparameter is out of range; at an update, no params.

    References:
        Nocedal and Wright, "Numerical Optimization", 1999, Algorithms 3.5 and 3.6; Hager and
        Zhang, "A new conjugate gradient method with guaranteed descent and an efficient line
        search", SIAM J. Optim. 2005. optax.scale_by_zoom_linesearch.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> def f(p):  # value and gradient of sum((x - 1)^2)
        ...     return float(np.sum((p["x"] - 1) ** 2)), {"x": 2 * (p["x"] - 1)}
        >>> tx = nba.chain(nba.sgd(1.0), nba.scale_by_zoom_linesearch(max_linesearch_steps=15))
        >>> params = {"x": np.array([3.0, -1.0])}
        >>> state = tx.init(params)
        >>> value, grad = f(params)
        >>> state = nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=f)
        >>> params["x"]  # the exact minimiser along -grad: step 0.5
        array([1., 1.])
    """
    flag(verbose, "verbose")
    return _ZoomLinesearch(
        max_linesearch_steps,
        max_learning_rate,
        tol,
        increase_factor,
        slope_rtol,
        curv_rtol,
        approx_dec_rtol,
        stepsize_precision,
        initial_guess_strategy,
    ).transformation()


# --- the backtracking line search -------------------------------------------------------------


@state_class
class BacktrackingLinesearchInfo(NamedTuple):
    """What the last backtracking search did (optax's fields).

    Attributes:
        num_linesearch_steps: the objective's evaluations it made.
        decrease_error: how far the accepted step is from sufficient decrease (0: satisfied).
    """

    num_linesearch_steps: np.int32
    decrease_error: np.float64


@state_class
class ScaleByBacktrackingLinesearchState(NamedTuple):
    """State of `scale_by_backtracking_linesearch` (optax's fields).

    Attributes:
        learning_rate: the step size the last search accepted (float64).
        value: the objective at the accepted point (inf after ``init``).
        grad: its gradient, a FlatTree (``store_grad``), else None.
        info: a `BacktrackingLinesearchInfo`.
    """

    learning_rate: np.float64
    value: np.float64
    grad: FlatTree | None
    info: BacktrackingLinesearchInfo


class _BacktrackingLinesearch(Stage):
    complex_leaves = True
    public_name = "scale_by_backtracking_linesearch"

    def foreign(self) -> bool:
        return True  # the objective (value_fn, grad_fn) runs while the step runs

    def __init__(
        self,
        max_steps: Any,
        slope_rtol: Any,
        decrease_factor: Any,
        increase_factor: Any,
        max_learning_rate: Any,
        atol: Any,
        rtol: Any,
        store_grad: Any,
    ) -> None:
        self.max_steps = integer(max_steps, "max_backtracking_steps")
        if self.max_steps < 0:
            raise ValueError(f"max_backtracking_steps must be >= 0, got {max_steps!r}")
        self.slope_rtol = real(slope_rtol, "slope_rtol")
        self.decrease_factor = real(decrease_factor, "decrease_factor")
        if not 0.0 < self.decrease_factor < 1.0:
            raise ValueError(f"decrease_factor must be in (0, 1), got {decrease_factor!r}")
        self.increase_factor = real(increase_factor, "increase_factor")
        self.max_learning_rate = real(max_learning_rate, "max_learning_rate")
        self.atol, self.rtol = non_negative(atol, "atol"), non_negative(rtol, "rtol")
        self.store_grad = flag(store_grad, "store_grad")

    def init(self, params: Any) -> ScaleByBacktrackingLinesearchState:
        layout, device = layout_and_device(params, "params")
        grad = FlatTree.zeros(layout, None, device) if self.store_grad else None
        info = BacktrackingLinesearchInfo(np.int32(0), np.float64(math.inf))
        return ScaleByBacktrackingLinesearchState(np.float64(1.0), np.float64(math.inf), grad, info)

    def owner(self, state: Any) -> FlatTree | None:
        ok = isinstance(state, ScaleByBacktrackingLinesearchState) and isinstance(state.grad, FlatTree)
        return state.grad if ok else None

    def declare(self, spec: Spec, state: Any) -> Host:
        """A `numbaccum.fuse.Host` over ``state``'s gradient buffer (``store_grad``; checked
        here); its tick checks the step's params and objective and takes the first step."""
        if not isinstance(state, ScaleByBacktrackingLinesearchState):
            raise wrong_state("ScaleByBacktrackingLinesearchState", state)
        storage = None
        if self.store_grad:
            kept = expect_state(state, ScaleByBacktrackingLinesearchState, "grad", spec, renew=False)
            storage = kept.__dict__
        trial_of = self.workspace(state, spec, "trial")
        ls, cls, name = self, ScaleByBacktrackingLinesearchState, self.public_name
        now: list = [None] * 6  # this step's params, kept grad, value0, grad0, objective, start

        def tick(state: Any, params: Any, extra: dict) -> bool:
            got = _search_tick(state, cls, storage, params, extra, spec, name)
            if got is None:
                return False
            with np.errstate(over="ignore", invalid="ignore"):
                start = float(
                    np.minimum(ls.increase_factor * float(state.learning_rate), ls.max_learning_rate)
                )
            now[:] = *got, start
            return True

        def run(u: Updates) -> tuple[Updates, ScaleByBacktrackingLinesearchState]:
            params, kept, value0, grad0, objective, start = now

            def errors(step: float, slope: float, value: float) -> float:
                with np.errstate(all="ignore"):
                    err = value - (1.0 + ls.rtol) * value0 - step * ls.slope_rtol * slope
                return math.inf if math.isnan(err) else max(err, 0.0)

            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            direction, p = u.flat, params.flat()
            slope = _dot(direction, grad0)
            trial = trial_of()  # kept: not a new params-sized buffer per update
            step, value, grad, err, n = start, value0, None, math.inf, 0
            while not err <= ls.atol and n <= ls.max_steps:  # optax's loop: up to max + 1 values
                if n > 0:
                    step *= ls.decrease_factor
                _axpy(trial, p, step, direction)
                last = n == ls.max_steps
                value, grad = objective(trial, need_grad=False)
                err = errors(step, slope, value)
                if ls.store_grad and grad is None and (err <= ls.atol or last):
                    grad = objective(trial)[1]
                n += 1
            accepted = 0.0 if math.isinf(err) else step
            if kept is not None and grad is not None:
                _copy_into(kept, grad)
            info = BacktrackingLinesearchInfo(np.int32(n), np.float64(err))
            new = ScaleByBacktrackingLinesearchState(np.float64(accepted), np.float64(value), kept, info)
            return u.scaled(Factor(1.0, accepted)), new

        # The objective is the user's: an opaque row.
        return Host(run, None, "scale_by_backtracking_linesearch", tick, pending=True)


def scale_by_backtracking_linesearch(
    max_backtracking_steps: int,
    slope_rtol: float = 1e-4,
    decrease_factor: float = 0.8,
    increase_factor: float = 1.5,
    max_learning_rate: float = 1.0,
    atol: float = 0.0,
    rtol: float = 0.0,
    store_grad: bool = False,
    verbose: bool = False,
) -> GradientTransformationExtraArgs:
    """Scales the updates by a step size of sufficient decrease (Armijo), found by backtracking.

    Starting from ``min(increase_factor * last step, max_learning_rate)``, the step ``eta`` is
    multiplied by ``decrease_factor`` until ``f(w + eta u) <= (1 + rtol) f(w) + eta slope_rtol
    <u, grad f(w)> + atol`` (at most ``max_backtracking_steps`` times; a non-finite objective
    gives the step 0). ``update`` needs ``value``, ``grad`` and ``value_fn`` (``params -> value``,
    or ``(value, grad)``); with ``store_grad`` the gradient at the accepted point is kept for
    `value_and_grad_from_state` (from ``value_fn``'s pair, or ``grad_fn=``).

    Args:
        max_backtracking_steps: the most reductions of the step.
        slope_rtol: the sufficient decrease's constant.
        decrease_factor: the step's reduction, in (0, 1).
        increase_factor: the first guess's growth over the last accepted step.
        max_learning_rate: the largest step tried.
        atol: absolute tolerance of the criterion (``>= 0``).
        rtol: relative tolerance on the value (``>= 0``).
        store_grad: keep the gradient at the accepted point in the state.
        verbose: accepted for optax's signature (``state.info`` reports failures).

    Returns:
        A `GradientTransformationExtraArgs`; its state is
            ``ScaleByBacktrackingLinesearchState(learning_rate, value, grad, info)``, as optax's.

    Raises:
        TypeError: an argument has the wrong type; at an update, ``value``, ``grad`` or
            ``value_fn`` is missing or wrong.
        ValueError: an argument is out of range; at an update, no params.

    References:
        Armijo, "Minimization of functions having Lipschitz continuous first partial
        derivatives", 1966; Nocedal and Wright, "Numerical Optimization", 1999, Algorithm 3.1.
        optax.scale_by_backtracking_linesearch.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> def f(p):
        ...     return float(np.sum(p["x"] ** 2))
        >>> tx = nba.chain(nba.sgd(1.0), nba.scale_by_backtracking_linesearch(max_backtracking_steps=15))
        >>> params = {"x": np.array([1.0, -2.0])}
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     grad = {"x": 2 * params["x"]}
        ...     state = nba.step_(tx, grad, state, params, value=f(params), grad=grad, value_fn=f)
        >>> float(state[1].learning_rate)  # 1.0 gave no decrease on this quadratic; 0.8 did
        0.8
        >>> round(f(params), 5)  # each step keeps 0.36 of the value: 5 * 0.36^3
        0.23328
    """
    flag(verbose, "verbose")
    return _BacktrackingLinesearch(
        max_backtracking_steps,
        slope_rtol,
        decrease_factor,
        increase_factor,
        max_learning_rate,
        atol,
        rtol,
        store_grad,
    ).transformation()


def value_and_grad_from_state(value_fn: Callable[..., Any]) -> Callable[..., tuple[float, Any]]:
    """``value_and_grad(params, *args, state, **kwargs)``: the objective's value and gradient at
    ``params``, taken from ``state`` where a line search left them (the accepted point of the
    last update is the next update's params), else ``value_fn(params, *args, **kwargs)``.

    Args:
        value_fn: ``value_fn(params, ...) -> (value, grad)``, the gradient a tree like the
            params.

    Returns:
        A function of ``(params, *args, state, **kwargs)`` returning ``(value, grad)`` (the
            gradient a new tree, not a view of the state).

    Raises:
        TypeError: ``value_fn`` is not callable.
        KeyError: (by the function returned) ``state`` holds more than one line search state:
            which value is meant is ambiguous (optax's error).
        ValueError: (by the function returned) no line search state with a gradient in it.

    References:
        optax.value_and_grad_from_state.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> calls = []
        >>> def f(p):
        ...     calls.append(1)
        ...     return float(np.sum(p["x"] ** 2)), {"x": 2 * p["x"]}
        >>> tx = nba.lbfgs()
        >>> params = {"x": np.array([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> value_and_grad = nba.value_and_grad_from_state(f)
        >>> for _ in range(3):
        ...     value, grad = value_and_grad(params, state=state)
        ...     state = nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=f)
        >>> len(calls)  # 3 by the line searches (one each), 1 outside them: the first
        4
        >>> bool(np.all(np.abs(params["x"]) < 1e-15))  # the minimum of sum x^2
        True
    """
    if not callable(value_fn):
        raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}")

    def value_and_grad(params: Any, *args: Any, state: Any, **kwargs: Any) -> tuple[float, Any]:
        searches = list(states_of(state, (ScaleByZoomLinesearchState, ScaleByBacktrackingLinesearchState)))
        if len(searches) > 1:  # optax's KeyError: several values and grads in the state
            raise KeyError(
                f"value_and_grad_from_state: {len(searches)} line search states in the state "
                f"({', '.join(type(s).__name__ for s in searches)}): which value and gradient to "
                "take is ambiguous; keep one line search per chain"
            )
        found = searches[0] if searches else None
        if found is None or found.grad is None:
            raise ValueError(
                "value_and_grad_from_state: no line search state with a value and a gradient in the "
                "state (a backtracking search keeps its gradient with store_grad=True)"
            )
        value, grad = found.value, found.grad
        if math.isfinite(float(value)):
            return float(value), grad.copy().tree
        return value_fn(params, *args, **kwargs)

    return value_and_grad


# --- L-BFGS ------------------------------------------------------------------------------------

def lbfgs(
    learning_rate: ScalarOrSchedule | None = None,
    memory_size: int = 10,
    scale_init_precond: bool = True,
    # optax's default, one object as optax's is (it keeps no state of its own: each lbfgs's state
    # holds the search's), written out so that the signature shows it
    linesearch: Any = scale_by_zoom_linesearch(  # noqa: B008
        max_linesearch_steps=20, initial_guess_strategy="one"
    ),
) -> GradientTransformationExtraArgs:
    """L-BFGS: a quasi-Newton direction and a line search along it.

    ``chain(scale_by_lbfgs(memory_size, scale_init_precond), scale(-1.0) (or
    scale_by_learning_rate(learning_rate)), linesearch)``, as optax builds it. With the default
    zoom line search, ``update`` (and `step_`) need ``value``, ``grad`` and ``value_fn`` (see
    `scale_by_zoom_linesearch`); `value_and_grad_from_state` reuses the line search's last
    evaluation.

    Args:
        learning_rate: None (the line search picks the step), or a float or schedule scaling the
            direction first.
        memory_size: as in `scale_by_lbfgs`.
        scale_init_precond: as in `scale_by_lbfgs`.
        linesearch: a line search transformation, or None for none.

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``(ScaleByLBFGSState(...),
            EmptyState(), ScaleByZoomLinesearchState(...))``.

    Raises:
        TypeError: a hyperparameter has the wrong type; at an update, a line search argument is
            missing.
        ValueError: ``memory_size < 1``.

    References:
        Nocedal and Wright, "Numerical Optimization", 1999, Algorithms 7.4, 7.5, 3.5 and 3.6;
        Liu and Nocedal, "On the limited memory BFGS method for large scale optimization", 1989.
        optax.lbfgs; scipy.optimize.minimize(method="L-BFGS-B").

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> def rosenbrock(p):  # value and gradient
        ...     x = p["x"]
        ...     value = float(np.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2))
        ...     g = np.zeros_like(x)
        ...     g[:-1] = -400 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2 * (1 - x[:-1])
        ...     g[1:] += 200 * (x[1:] - x[:-1] ** 2)
        ...     return value, {"x": g}
        >>> params = {"x": np.zeros(10)}
        >>> tx = nba.lbfgs()
        >>> state = tx.init(params)
        >>> value_and_grad = nba.value_and_grad_from_state(rosenbrock)
        >>> for _ in range(100):
        ...     value, grad = value_and_grad(params, state=state)
        ...     state = nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=rosenbrock)
        >>> bool(np.allclose(params["x"], 1.0, atol=1e-6))
        True
    """
    base_scaling = scale(-1.0) if learning_rate is None else scale_by_learning_rate(learning_rate)
    return chain(
        scale_by_lbfgs(memory_size, scale_init_precond),
        base_scaling,
        identity() if linesearch is None else linesearch,
    )
