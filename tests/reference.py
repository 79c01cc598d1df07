"""Plain NumPy, leaf-by-leaf reference implementation for the numbaccum tests.

Nothing here imports numba or numbaccum: every transformation is written as the
optax formula applied to one leaf at a time, so that the fast flat-buffer kernels
can be checked against it (see reference/optax.md sections 0-2 in shared/).

Conventions:
* Trees are dicts (sorted keys), lists, tuples, NamedTuples and ``None`` (an
  empty subtree); everything else is a leaf (a NumPy array).
* Python float hyperparameters are "weakly typed" the way optax/JAX treat them:
  an expression such as ``1 - decay`` is evaluated in Python float64 and then
  rounded once to the leaf's dtype (``np.float32(1 - decay)``).
* Counters are np.int32 scalars that saturate at int32 max (optax ``safe_increment``).
* Updates keep the dtype of the incoming updates leaf; accumulators keep their
  own dtype (the params' dtype unless an ``accumulator_dtype`` is given).
* The numbaccum deviations from optax listed in API.md are mirrored in
  ``MultiSteps``: non-emitting steps return exact +0.0, the accumulator is
  reset to exact zeros on emission and the inner optimizer runs only on
  emitting steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)

# ---------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def tree_flatten(tree: Any) -> tuple[list, tuple]:
    """Return ``(leaves, treedef)``; the treedef is a hashable nested tuple."""
    leaves: list = []

    def rec(t: Any) -> tuple:
        if t is None:
            return ("none",)
        if isinstance(t, dict):
            keys = sorted(t)
            return ("dict", tuple(keys), tuple(rec(t[k]) for k in keys))
        if is_namedtuple(t):
            return ("namedtuple", type(t), tuple(rec(c) for c in t))
        if isinstance(t, tuple):
            return ("tuple", tuple(rec(c) for c in t))
        if isinstance(t, list):
            return ("list", tuple(rec(c) for c in t))
        leaves.append(t)
        return ("leaf",)

    treedef = rec(tree)
    return leaves, treedef


def tree_structure(tree: Any) -> tuple:
    return tree_flatten(tree)[1]


def tree_leaves(tree: Any) -> list:
    return tree_flatten(tree)[0]


def tree_unflatten(treedef: tuple, leaves) -> Any:
    it = iter(list(leaves))

    def rec(d: tuple) -> Any:
        kind = d[0]
        if kind == "leaf":
            return next(it)
        if kind == "none":
            return None
        if kind == "dict":
            return {k: rec(c) for k, c in zip(d[1], d[2])}
        if kind == "namedtuple":
            return d[1](*[rec(c) for c in d[2]])
        if kind == "tuple":
            return tuple(rec(c) for c in d[1])
        if kind == "list":
            return [rec(c) for c in d[1]]
        raise AssertionError(kind)

    out = rec(treedef)
    rest = list(it)
    if rest:
        raise ValueError(f"{len(rest)} leaves left over")
    return out


def tree_paths(tree: Any, root: str = "tree") -> list[str]:
    """Path strings of the leaves, in flatten order (for messages)."""
    paths: list[str] = []

    def rec(t: Any, p: str) -> None:
        if t is None:
            return
        if isinstance(t, dict):
            for k in sorted(t):
                rec(t[k], f"{p}[{k!r}]")
        elif is_namedtuple(t):
            for name, c in zip(t._fields, t):
                rec(c, f"{p}.{name}")
        elif isinstance(t, (list, tuple)):
            for i, c in enumerate(t):
                rec(c, f"{p}[{i}]")
        else:
            paths.append(p)

    rec(tree, root)
    return paths


def tree_map(f: Callable, tree: Any, *rest: Any) -> Any:
    leaves, treedef = tree_flatten(tree)
    others = []
    for r in rest:
        rl, rd = tree_flatten(r)
        if rd != treedef:
            raise ValueError("tree structures differ")
        others.append(rl)
    return tree_unflatten(treedef, [f(*xs) for xs in zip(leaves, *others)])


def tree_copy(tree: Any) -> Any:
    return tree_map(lambda x: np.array(x, copy=True), tree)


def zeros_like(tree: Any, dtype=None) -> Any:
    return tree_map(lambda x: np.zeros(np.shape(x), dtype if dtype is not None else x.dtype), tree)


def _arr(x, dtype) -> np.ndarray:
    """A fresh array of ``dtype`` (0-d results of NumPy ops are scalars)."""
    return np.array(x, dtype=dtype, copy=True)


def _c(value: float, dtype) -> np.generic:
    """A Python float hyperparameter rounded once to ``dtype`` (weak typing)."""
    return np.dtype(dtype).type(value)


def safe_increment(c) -> np.int32:
    """optax ``safe_increment`` on an int32 counter: saturates, never wraps."""
    c = int(c)
    return np.int32(c + 1 if c < INT32_MAX else INT32_MAX)


def powf(d: float, count, dtype) -> np.generic:
    """``dtype(d) ** count`` with a Python int exponent (NumPy scalar power).

    optax.md §0 says ``np.power(f32, f32)`` and ``f32 ** int`` both matched JAX;
    with NumPy 2.4 they differ in the last bit for some (d, count), e.g.
    d=0.9, count=4, so ``1 - d**count`` is not uniquely defined by the spec
    there. Both agree for every count in 1..59 when d is in SAFE_DECAYS.
    """
    dt = np.dtype(dtype)
    return dt.type(dt.type(d) ** int(count))


# Decays for which every float32 way of computing ``1 - f32(d)**count``
# (powf, scalar power, repeated squaring, float64 pow rounded) agrees bit for
# bit for count in 1..59: safe for bit-exact comparisons of debiased output.
SAFE_DECAYS = (0.0, 0.1, 0.2, 0.25, 0.3, 0.5, 0.75)


def bias_correction_denominator(decay: float, count: int, dtype) -> np.generic:
    """``dtype(1) - dtype(decay) ** count`` (optax's float32 debias recipe)."""
    dt = np.dtype(dtype)
    return dt.type(dt.type(1) - powf(decay, count, dt))


# ---------------------------------------------------------------------------
# Base protocol
# ---------------------------------------------------------------------------


class Transformation(NamedTuple):
    init: Callable
    update: Callable


class EmptyState(NamedTuple):
    pass


def chain(*txs: Transformation) -> Transformation:
    def init(params):
        return tuple(t.init(params) for t in txs)

    def update(updates, state, params=None, **extra):
        if len(state) != len(txs):
            raise ValueError("state/transformation count mismatch")
        new_states = []
        for t, s in zip(txs, state):
            updates, s = t.update(updates, s, params, **extra)
            new_states.append(s)
        return updates, tuple(new_states)

    return Transformation(init, update)


def identity() -> Transformation:
    return Transformation(lambda params: EmptyState(), lambda u, s, p=None, **e: (tree_copy(u), s))


def apply_updates(params, updates):
    """Per leaf ``(p + u).astype(p.dtype)``; ``None`` stays ``None``."""
    return tree_map(lambda p, u: _arr(np.asarray(p) + np.asarray(u), p.dtype), params, updates)


def global_norm(tree, ord=2, squared: bool = False) -> float:
    """optax.tree.norm with float64 accumulation."""
    leaves = [np.asarray(x, dtype=np.float64).ravel() for x in tree_leaves(tree)]
    flat = np.concatenate(leaves) if leaves else np.zeros(0)
    if ord in (None, 2):
        s = float(np.sum(flat * flat))
        m = float(np.max(np.abs(flat))) if flat.size else 0.0
        if (not math.isfinite(s) or s < 2.0**-800) and math.isfinite(m) and m > 0:
            # Overflowed or (maybe) underflowed: rescaled by the max, as the library does.
            r = m * math.sqrt(float(np.sum((flat / m) ** 2)))
            return r * r if squared else r
        return s if squared else math.sqrt(s)
    if ord == 1:
        r = float(np.sum(np.abs(flat)))
    elif ord == np.inf or ord in ("inf", "infinity"):
        r = float(np.max(np.abs(flat))) if flat.size else 0.0
    else:
        raise ValueError(f"unknown ord {ord!r}")
    return r * r if squared else r


# ---------------------------------------------------------------------------
# Accumulation
# ---------------------------------------------------------------------------


class TraceState(NamedTuple):
    trace: Any


def trace(decay: float, nesterov: bool = False, accumulator_dtype=None) -> Transformation:
    def init(params):
        return TraceState(zeros_like(params, accumulator_dtype))

    def update(updates, state, params=None, **extra):
        gl, tdef = tree_flatten(updates)
        tl, tdef2 = tree_flatten(state.trace)
        if tdef != tdef2:
            raise ValueError("tree structures differ")
        us, ts = [], []
        for g, t in zip(gl, tl):
            cdt = np.result_type(g.dtype, t.dtype)
            d = _c(decay, cdt)
            gg = g.astype(cdt)
            new = gg + d * t.astype(cdt)
            u = gg + d * new if nesterov else new
            us.append(_arr(u, g.dtype))
            ts.append(_arr(new, t.dtype))
        return tree_unflatten(tdef, us), TraceState(tree_unflatten(tdef, ts))

    return Transformation(init, update)


class EmaState(NamedTuple):
    count: np.int32
    ema: Any


def ema(decay: float, debias: bool = True, accumulator_dtype=None) -> Transformation:
    """``m = (1-d)*g + d*m`` in the accumulator dtype; ``u = m / (1 - d**count)``."""

    def init(params):
        return EmaState(np.int32(0), zeros_like(params, accumulator_dtype))

    def update(updates, state, params=None, **extra):
        count = safe_increment(state.count)
        gl, tdef = tree_flatten(updates)
        ml, mdef = tree_flatten(state.ema)
        if mdef != tdef:
            raise ValueError("tree structures differ")
        us, ms = [], []
        for g, m in zip(gl, ml):
            cdt = np.result_type(g.dtype, m.dtype)
            new = _c(1 - decay, cdt) * g.astype(cdt) + _c(decay, cdt) * m.astype(cdt)
            u = new / bias_correction_denominator(decay, count, cdt) if debias else new
            us.append(_arr(u, g.dtype))
            ms.append(_arr(new, m.dtype))
        return tree_unflatten(tdef, us), EmaState(count, tree_unflatten(tdef, ms))

    return Transformation(init, update)


class ApplyEveryState(NamedTuple):
    count: int
    grad_acc: Any


def apply_every(k: int = 1) -> Transformation:
    """optax: ``acc = (c != 0) * acc + g``; emit the sum when ``c == k - 1``."""

    def init(params):
        return ApplyEveryState(np.int32(0), zeros_like(params))

    def update(updates, state, params=None, **extra):
        c = state.count % k
        emit = c == k - 1
        gl, tdef = tree_flatten(updates)
        al, _ = tree_flatten(state.grad_acc)
        us, accs = [], []
        for g, a in zip(gl, al):
            dt = a.dtype
            new = _c(float(c != 0), dt) * a + g.astype(dt)
            accs.append(_arr(new, dt))
            us.append(_arr(_c(float(emit), dt) * new, g.dtype))
        count = np.int32(safe_increment(state.count) % k)
        return tree_unflatten(tdef, us), ApplyEveryState(count, tree_unflatten(tdef, accs))

    return Transformation(init, update)


def skip_not_finite(updates, gradient_step, params):
    n = int(sum(int(np.sum(~np.isfinite(np.asarray(x)))) for x in tree_leaves(updates)))
    return n > 0, {"should_skip": n > 0, "num_not_finite": n}


def skip_large_updates(updates, gradient_step, params, max_squared_norm: float):
    norm_sq = global_norm(updates, squared=True)
    skip = not (norm_sq < max_squared_norm)
    return skip, {"should_skip": skip, "norm_squared": norm_sq}


class MultiStepsState(NamedTuple):
    mini_step: int
    gradient_step: int
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()


def default_accumulator_dtype(dtype) -> np.dtype:
    """float32 for float16/float32 leaves, float64 for float64 leaves."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


class MultiSteps:
    """numbaccum's MultiSteps (optax semantics with API.md's deliberate differences)."""

    def __init__(
        self,
        opt: Transformation,
        every_k_schedule,
        use_grad_mean: bool = True,
        should_skip_update_fn=None,
        accumulator_dtype=None,
    ):
        self.inner_opt = opt
        self.every_k_schedule = every_k_schedule
        self.use_grad_mean = use_grad_mean
        self.should_skip_update_fn = should_skip_update_fn
        self.accumulator_dtype = accumulator_dtype

    def _k(self, gradient_step: int) -> int:
        s = self.every_k_schedule
        k = int(s) if isinstance(s, (int, np.integer)) else int(s(np.int32(gradient_step)))
        if k < 1:
            raise ValueError("every_k_schedule < 1")
        return k

    def _acc_dtype(self, dtype) -> np.dtype:
        if self.accumulator_dtype is not None:
            return np.dtype(self.accumulator_dtype)
        return default_accumulator_dtype(dtype)

    def init(self, params):
        acc = tree_map(lambda p: np.zeros(np.shape(p), self._acc_dtype(p.dtype)), params)
        if self.should_skip_update_fn is None:
            skip_state = ()
        else:
            _, skip_state = self.should_skip_update_fn(zeros_like(params), 0, params)
        return MultiStepsState(np.int32(0), np.int32(0), self.inner_opt.init(params), acc, skip_state)

    def has_updated(self, state) -> bool:
        return state.mini_step == 0 and state.gradient_step > 0

    def update(self, updates, state, params=None, **extra):
        k = self._k(state.gradient_step)
        if self.should_skip_update_fn is None:
            skip, skip_state = False, ()
        else:
            skip, skip_state = self.should_skip_update_fn(updates, state.gradient_step, params)
        if bool(skip):
            return zeros_like(updates), state._replace(skip_state=skip_state)

        gl, tdef = tree_flatten(updates)
        al, _ = tree_flatten(state.acc_grads)
        n = state.mini_step
        accs = []
        for g, a in zip(gl, al):
            cdt = np.result_type(g.dtype, a.dtype)
            gg, aa = g.astype(cdt), a.astype(cdt)
            # Welford mean (true division by the count) or a plain sum.
            new = aa + (gg - aa) / cdt.type(n + 1) if self.use_grad_mean else gg + aa
            accs.append(_arr(new, a.dtype))
        emit = n == k - 1
        if emit:
            inner_in = tree_unflatten(tdef, [_arr(a, g.dtype) for a, g in zip(accs, gl)])
            u, inner = self.inner_opt.update(inner_in, state.inner_opt_state, params, **extra)
            new_acc = tree_unflatten(tdef, [np.zeros_like(a) for a in accs])
            gs = safe_increment(state.gradient_step)
        else:
            u = zeros_like(updates)
            inner = state.inner_opt_state
            new_acc = tree_unflatten(tdef, accs)
            gs = state.gradient_step
        mini = np.int32(safe_increment(n) % k)
        return u, MultiStepsState(mini, gs, inner, new_acc, skip_state)

    def gradient_transformation(self) -> Transformation:
        return Transformation(self.init, self.update)


# ---------------------------------------------------------------------------
# Inner optimizers
# ---------------------------------------------------------------------------


def scale(step_size: float) -> Transformation:
    def update(updates, state, params=None, **extra):
        return tree_map(lambda g: _arr(_c(step_size, g.dtype) * g, g.dtype), updates), state

    return Transformation(lambda params: EmptyState(), update)


class ScaleByScheduleState(NamedTuple):
    count: int


def scale_by_learning_rate(learning_rate) -> Transformation:
    """``u = -lr * g``; a callable ``lr`` is evaluated at the pre-increment count."""
    if callable(learning_rate):

        def init(params):
            return ScaleByScheduleState(np.int32(0))

        def update(updates, state, params=None, **extra):
            step = -float(learning_rate(np.int32(state.count)))
            u = tree_map(lambda g: _arr(_c(step, g.dtype) * g, g.dtype), updates)
            return u, ScaleByScheduleState(safe_increment(state.count))

        return Transformation(init, update)
    return scale(-float(learning_rate))


def add_decayed_weights(weight_decay: float = 0.0) -> Transformation:
    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("add_decayed_weights needs params")

        def leaf(g, p):
            cdt = np.result_type(g.dtype, p.dtype)
            return _arr(g.astype(cdt) + _c(weight_decay, cdt) * p.astype(cdt), g.dtype)

        return tree_map(leaf, updates, params), state

    return Transformation(lambda params: EmptyState(), update)


class MaskedNode(NamedTuple):
    """A masked-out leaf, as optax's ``masked`` hands the inner transformation."""


class MaskedState(NamedTuple):
    inner_state: Any


def masked(inner: Transformation, mask) -> Transformation:
    """optax's ``masked`` for a mask of the params' full structure (or a callable giving one):
    the inner transformation runs on the tree whose masked-out leaves are `MaskedNode`, and those
    leaves pass through as they came."""

    def mask_leaves(tree):
        m = mask(tree) if callable(mask) else mask
        return [bool(b) for b in tree_leaves(m)]

    def hide(tree, keep):
        leaves, td = tree_flatten(tree)
        return tree_unflatten(td, [x if k else MaskedNode() for x, k in zip(leaves, keep)])

    def init(params):
        return MaskedState(inner.init(hide(params, mask_leaves(params))))

    def update(updates, state, params=None, **extra):
        keep = mask_leaves(updates)
        sub = hide(updates, keep)
        new_sub, inner_state = inner.update(
            sub, state.inner_state, None if params is None else hide(params, keep)
        )
        new_leaves = iter(tree_leaves(new_sub))
        leaves, td = tree_flatten(updates)
        out = [next(new_leaves) if k else tree_copy(x) for x, k in zip(leaves, keep)]
        return tree_unflatten(td, out), MaskedState(inner_state)

    return Transformation(init, update)


def add_decayed_weights_masked(weight_decay: float, mask) -> Transformation:
    """optax's ``add_decayed_weights(weight_decay, mask)``."""
    return masked(add_decayed_weights(weight_decay), mask)


def sgd(learning_rate, momentum=None, nesterov: bool = False, accumulator_dtype=None) -> Transformation:
    parts = []
    if momentum is not None:
        parts.append(trace(momentum, nesterov, accumulator_dtype))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)


def scale_by_sign() -> Transformation:
    """``u = sign(g)``, as ``jnp.sign``: +-0 and NaN are kept."""

    def update(updates, state, params=None, **extra):
        return tree_map(lambda g: _arr(np.where(g == 0, g, np.sign(g)), g.dtype), updates), state

    return Transformation(lambda params: EmptyState(), update)


def set_to_zero() -> Transformation:
    """``u = +0`` (optax's ``set_to_zero``: ``zeros_like``)."""

    def update(updates, state, params=None, **extra):
        return tree_map(lambda g: np.zeros_like(g), updates), state

    return Transformation(lambda params: EmptyState(), update)


def keep_params_nonnegative() -> Transformation:
    """optax's ``where(p + u < 0, -p, u)``."""

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("keep_params_nonnegative needs params")
        return tree_map(lambda g, p: _arr(np.where(p + g < 0, -p, g), g.dtype), updates, params), state

    return Transformation(lambda params: EmptyState(), update)


def scale_by_schedule(step_size_fn) -> Transformation:
    """``u = step_size_fn(count) * g`` (the step size cast to g's dtype), then ``count + 1``."""

    def update(updates, state, params=None, **extra):
        step = float(step_size_fn(np.int32(state.count)))
        u = tree_map(lambda g: _arr(_c(step, g.dtype) * g, g.dtype), updates)
        return u, ScaleByScheduleState(safe_increment(state.count))

    return Transformation(lambda params: ScaleByScheduleState(np.int32(0)), update)


class PartitionState(NamedTuple):
    inner_states: Any


def partition(transforms: dict, labels) -> Transformation:
    """optax's ``partition``: each label's transformation `masked` to the leaves of that label
    (``labels`` a full tree of labels, or a callable of the params giving one)."""

    def masked_of(label):
        return masked(
            transforms[label],
            lambda t: tree_map(lambda x: x == label, labels(t) if callable(labels) else labels),
        )

    parts = {label: masked_of(label) for label in transforms}

    def init(params):
        return PartitionState({k: tx.init(params) for k, tx in parts.items()})

    def update(updates, state, params=None, **extra):
        new = {}
        for k, tx in parts.items():
            updates, new[k] = tx.update(updates, state.inner_states[k], params)
        return updates, PartitionState(new)

    return Transformation(init, update)


def sign_sgd(learning_rate) -> Transformation:
    return chain(scale_by_sign(), scale_by_learning_rate(learning_rate))


class ScaleByAdamState(NamedTuple):
    count: int
    mu: Any
    nu: Any


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0
) -> Transformation:
    def init(params):
        return ScaleByAdamState(np.int32(0), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None, **extra):
        count = safe_increment(state.count)
        gl, tdef = tree_flatten(updates)
        mul, _ = tree_flatten(state.mu)
        nul, _ = tree_flatten(state.nu)
        us, mus, nus = [], [], []
        for g, mu, nu in zip(gl, mul, nul):
            dt = g.dtype
            mu_new = _c(1 - b1, dt) * g + _c(b1, dt) * mu.astype(dt)
            nu_new = _c(1 - b2, dt) * (g * g) + _c(b2, dt) * nu.astype(dt)
            mu_hat = mu_new / bias_correction_denominator(b1, count, dt)
            nu_hat = nu_new / bias_correction_denominator(b2, count, dt)
            u = mu_hat / (np.sqrt(nu_hat + _c(eps_root, dt)) + _c(eps, dt))
            us.append(_arr(u, dt))
            mus.append(_arr(mu_new, mu.dtype))
            nus.append(_arr(nu_new, nu.dtype))
        return tree_unflatten(tdef, us), ScaleByAdamState(
            count, tree_unflatten(tdef, mus), tree_unflatten(tdef, nus)
        )

    return Transformation(init, update)


def adam(
    learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0
) -> Transformation:
    return chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(learning_rate))


# ---------------------------------------------------------------------------
# Per-example clipping and differential privacy (optax.md 3.4, 3.5, 3.7)
# ---------------------------------------------------------------------------


def _batch_of(leaves) -> int:
    if any(np.ndim(x) == 0 for x in leaves):
        raise ValueError("a 0-d leaf has no batch dimension")
    sizes = {np.shape(x)[0] for x in leaves}
    if len(sizes) > 1:
        raise ValueError(f"unequal batch sizes {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def _example_sumsq(x, batch) -> np.ndarray:
    """Per example: sum of squares of one leaf, in float64."""
    x64 = np.asarray(x, np.float64).reshape(batch, -1)
    return np.sum(x64 * x64, axis=1)


def _clip_multipliers(norms, clip) -> np.ndarray:
    """optax's ``nan_to_num(minimum(clip / norm, 1), nan=1)``, except that an example with a
    non-finite norm gets 0 (dropped) where optax passes it through (numbaccum's DP fix)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        mult = np.minimum(clip / norms, 1.0)
    mult = np.where(np.isnan(mult), 1.0, mult)
    return np.where(np.isfinite(norms), mult, 0.0)


def _weighted_batch_sum(x, mult) -> np.ndarray:
    """``sum_b mult[b] * x[b]`` in float64, in example order, dropped examples skipped."""
    x64 = np.asarray(x, np.float64)
    acc = np.zeros(x64.shape[1:], np.float64)
    for b in range(x64.shape[0]):
        if mult[b] != 0:
            acc = acc + mult[b] * x64[b]
    return acc


def _example_norms(leaves, batch) -> np.ndarray:
    """Per example: its L2 norm over ``leaves``, in float64; where the plain sum of squares
    overflowed or may have underflowed (below 2**-800), rescaled by the example's max |x|, as the
    library does (issue 12 item 5)."""
    sq = np.zeros(batch, np.float64)
    m = np.zeros(batch, np.float64)
    for x in leaves:
        sq = sq + _example_sumsq(x, batch)
        x64 = np.abs(np.asarray(x, np.float64).reshape(batch, -1))
        m = np.maximum(m, np.max(x64, axis=1, initial=0.0))
    norms = np.sqrt(sq)
    with np.errstate(all="ignore"):
        redo = (~np.isfinite(sq) | (sq < 2.0**-800)) & np.isfinite(m) & (m > 0)
        for b in np.flatnonzero(redo):
            t = sum(
                float(np.sum((np.asarray(x, np.float64).reshape(batch, -1)[b] / m[b]) ** 2)) for x in leaves
            )
            norms[b] = m[b] * np.sqrt(t)
    return norms


def _global_multipliers(leaves, clip) -> np.ndarray:
    """Per example: the multiplier of its global norm (over every leaf)."""
    return _clip_multipliers(_example_norms(leaves, _batch_of(leaves)), clip)


def per_example_global_norm_clip(grads, l2_norm_clip: float):
    """``(sum_b g[b] * min(1, C / ||g[b]||), #clipped)`` leaf by leaf, norms over all leaves."""
    leaves, tdef = tree_flatten(grads)
    mult = _global_multipliers(leaves, l2_norm_clip)
    sums = [_arr(_weighted_batch_sum(x, mult), x.dtype) for x in leaves]
    return tree_unflatten(tdef, sums), np.int32(np.count_nonzero(mult < 1.0))


def per_example_layer_norm_clip(grads, global_l2_norm_clip: float, uniform: bool = True):
    """Each leaf clipped on its own with ``C_k = C sqrt(1/K)`` or ``C sqrt(D_k / D)``."""
    leaves, tdef = tree_flatten(grads)
    batch = _batch_of(leaves)
    sizes = [int(np.prod(np.shape(x)[1:])) for x in leaves]
    total = sum(sizes)
    sums, counts = [], []
    for x, d in zip(leaves, sizes):
        with np.errstate(divide="ignore", invalid="ignore"):  # D = 0: NaN, every multiplier 1
            share = 1.0 / len(leaves) if uniform else np.float64(d) / total
            c = global_l2_norm_clip * np.sqrt(share)
        mult = _clip_multipliers(_example_norms([x], batch), c)
        sums.append(_arr(_weighted_batch_sum(x, mult), x.dtype))
        counts.append(np.int32(np.count_nonzero(mult < 1.0)))
    return tree_unflatten(tdef, sums), tree_unflatten(tdef, counts)


def dp_noise(leaves, seed: int, step: int) -> list:
    """numbaccum's documented noise: ``Generator(Philox(key=[seed, step]))`` draws one float64
    standard-normal array per dtype group (leaves grouped by dtype in order of first appearance,
    groups in that order), split between the group's leaves in tree order."""
    rng = np.random.Generator(np.random.Philox(key=np.array([seed, step], np.uint64)))
    order: list = []
    for x in leaves:
        if x.dtype not in order:
            order.append(x.dtype)
    out: list = [None] * len(leaves)
    for dt in order:
        members = [i for i, x in enumerate(leaves) if x.dtype == dt]
        shapes = [np.shape(leaves[i])[1:] for i in members]
        z = rng.standard_normal(sum(int(np.prod(s)) for s in shapes))
        pos = 0
        for i, s in zip(members, shapes):
            n = int(np.prod(s))
            out[i] = z[pos : pos + n].reshape(s)
            pos += n
    return out


class DifferentiallyPrivateAggregateState(NamedTuple):
    rng_key: np.ndarray


def differentially_private_aggregate(
    l2_norm_clip: float, noise_multiplier: float, seed: int
) -> Transformation:
    """``(sum of clipped examples + C * nm * z) / B`` per leaf, in float64, saturated at the leaf
    dtype's largest finite value, rounded once."""
    std = l2_norm_clip * noise_multiplier if noise_multiplier > 0 else 0.0

    def init(params):
        return DifferentiallyPrivateAggregateState(np.array([seed, 0], np.uint64))

    def update(updates, state, params=None, **extra):
        leaves, tdef = tree_flatten(updates)
        batch = _batch_of(leaves)
        mult = _global_multipliers(leaves, l2_norm_clip)
        step = int(state.rng_key[1])
        noise = dp_noise(leaves, seed, step) if std else [0.0] * len(leaves)
        out = []
        for x, z in zip(leaves, noise):
            v = (_weighted_batch_sum(x, mult) + std * z) / batch
            big = float(np.finfo(x.dtype).max)
            out.append(_arr(np.clip(v, -big, big), x.dtype))
        return tree_unflatten(tdef, out), DifferentiallyPrivateAggregateState(
            np.array([seed, step + 1], np.uint64)
        )

    return Transformation(init, update)


def dpsgd(
    learning_rate, l2_norm_clip, noise_multiplier, seed, momentum=None, nesterov=False
) -> Transformation:
    return chain(
        differentially_private_aggregate(l2_norm_clip, noise_multiplier, seed),
        *([trace(momentum, nesterov)] if momentum is not None else [identity()]),
        scale_by_learning_rate(learning_rate),
    )


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple:
    """Philox4x32-10 (Salmon et al. 2011) on uint64 arrays of 32-bit words: counter
    ``(c0, c1, c2, c3)``, key ``(k0, k1)``; the four output words."""
    m32 = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3, k0, k1 = (np.asarray(w, np.uint64) & m32 for w in (c0, c1, c2, c3, k0, k1))
    for _ in range(10):
        p0, p1 = c0 * np.uint64(0xD2511F53), c2 * np.uint64(0xCD9E8D57)
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & m32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & m32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    return c0, c1, c2, c3


def counter_normals(seed: int, step: int, group: int, n: int) -> np.ndarray:
    """numbaccum's documented gradient noise for the ``n`` elements of dtype group ``group`` at
    step ``step``: Box-Muller (the cosine) on the Philox4x32-10 words of the counter
    ``(index, step, group)`` under the 64-bit key ``seed``, u from 53 bits of the first two words
    plus half an ulp, the angle from the third (float64, NumPy's log and cos)."""
    i = np.arange(n, dtype=np.uint64)
    w0, w1, w2, _ = philox4x32_10(i, i >> np.uint64(32), step, group, seed, seed >> 32)
    u = (((w0 << np.uint64(21)) | (w1 >> np.uint64(11))).astype(np.float64) + 0.5) * 2.0**-53
    return np.sqrt(-2.0 * np.log(u)) * np.cos(2.0 * np.pi * (w2.astype(np.float64) * 2.0**-32))


class AddNoiseState(NamedTuple):
    count: Any
    rng_key: np.ndarray


def add_noise(eta: float, gamma: float, key: int) -> Transformation:
    """``u = g + sqrt(eta / t^gamma) z``: z `counter_normals` by dtype group (leaves grouped by
    dtype in order of first appearance, each group's elements in tree order), rounded to the
    leaf dtype, then ``g + std * z`` in the leaf dtype."""

    def init(params):
        return AddNoiseState(np.int32(0), np.array([key], np.uint64))

    def update(updates, state, params=None, **extra):
        count = safe_increment(state.count)
        std = math.sqrt(eta / float(count) ** gamma)
        leaves, tdef = tree_flatten(updates)
        order = list(dict.fromkeys(x.dtype for x in leaves))
        out = []
        pos = {dt: 0 for dt in order}
        sizes = {dt: sum(x.size for x in leaves if x.dtype == dt) for dt in order}
        draws = {dt: counter_normals(key, int(count), gi, sizes[dt]) for gi, dt in enumerate(order)}
        for x in leaves:
            z = draws[x.dtype][pos[x.dtype] : pos[x.dtype] + x.size].reshape(x.shape).astype(x.dtype)
            pos[x.dtype] += x.size
            out.append(_arr(x + _c(std, x.dtype) * z, x.dtype))
        return tree_unflatten(tdef, out), AddNoiseState(count, state.rng_key)

    return Transformation(init, update)


def noisy_sgd(learning_rate: float, eta: float = 0.01, gamma: float = 0.55, key: int = 0) -> Transformation:
    return chain(add_noise(eta, gamma, key), scale_by_learning_rate(learning_rate))


# ---------------------------------------------------------------------------
# History-based clipping: torchzero's ClipNormByEMA, NormalizeByEMA,
# ClipValueByEMA, ClipNormGrowth, ClipValueGrowth without its bugs
# (declearn_torchzero.md B.6-B.9; API.md "Resolved details")
# ---------------------------------------------------------------------------


def _metrics(leaves, ord, tensorwise: bool) -> np.ndarray:
    """One metric per leaf (over all its elements), or the metric of all leaves concatenated
    (a 0-d array); `slice_metric` and `tree_metric` below."""
    if tensorwise:
        return np.array([float(slice_metric(x, ord, range(np.ndim(x))).reshape(())) for x in leaves])
    return np.array(tree_metric(list(leaves), ord))


def _divided(leaves, denom, tensorwise: bool) -> list:
    """Each leaf divided by its (or the global) factor, rounded to the leaf's dtype first."""
    d = denom if tensorwise else np.full(len(leaves), float(denom))
    return [_arr(x / x.dtype.type(f), x.dtype) if f != 1.0 else _arr(x, x.dtype) for x, f in zip(leaves, d)]


def _ema_in(dtype, g, e, beta):
    """``(1 - beta) g + beta e`` computed in the leaf's dtype (float16: in float32, as the
    library's kernels stage it), not yet rounded to it."""
    t = np.promote_types(dtype, np.float32).type
    return t(1.0 - beta) * np.asarray(g, t) + t(beta) * np.asarray(e, t)


class EmaNormState(NamedTuple):
    exp_avg: list
    prev: np.ndarray


def clip_norm_by_ema(
    beta=0.99, ord=2, tensorwise=True, max_ema_growth=1.5, init=0.0, min_norm=1e-6, normalize=False
) -> Transformation:
    """``e = (1 - beta) g + beta e`` in the leaf dtype (as torchzero's ``lerp_``); the EMA's
    norm grows by at most ``max_ema_growth`` per step once there is a history (``prev > 0``);
    ``u = g / max(1, |g| / |e|)`` (normalize: ``g / (|g| / |e|)``). A leaf with a non-finite
    norm is left out of the EMA; a norm that is non-finite or <= 1e-12 leaves the leaf as is."""

    def init_fn(params):
        leaves = tree_leaves(params)
        exp_avg = [np.full(np.shape(x), init, x.dtype) for x in leaves]
        return EmaNormState(exp_avg, np.zeros(len(leaves) if tensorwise else ()))

    def update(updates, state, params=None):
        leaves, treedef = tree_flatten(updates)
        n = _metrics(leaves, ord, tensorwise)
        active = np.isfinite(n) if tensorwise else np.full(len(leaves), np.isfinite(n))
        exp_avg = [
            _arr(_ema_in(e.dtype, g, e, beta), e.dtype) if a else e.copy()
            for g, e, a in zip(leaves, state.exp_avg, active)
        ]
        ema_norm = _metrics(exp_avg, ord, tensorwise)
        prev = state.prev.copy()
        with np.errstate(all="ignore"):
            if max_ema_growth is not None:
                allowed = np.where(prev > 0, np.maximum(prev * max_ema_growth, min_norm), np.inf)
                over = np.isfinite(ema_norm) & (ema_norm > allowed)
                ratio = np.where(over, ema_norm / np.where(over, allowed, 1.0), 1.0)
                exp_avg = _divided(exp_avg, ratio, tensorwise)
                ema_norm = np.where(over, allowed, ema_norm)
                prev = np.where(np.isfinite(ema_norm), ema_norm, prev)
            denom = n / np.maximum(ema_norm, 0.0)
            if not normalize:
                denom = np.maximum(denom, 1.0)
            denom = np.where(np.isfinite(n) & (n > 1e-12) & np.isfinite(ema_norm), denom, 1.0)
        out = _divided(leaves, denom, tensorwise)
        return tree_unflatten(treedef, out), EmaNormState(exp_avg, prev)

    return Transformation(init_fn, update)


class ValueEmaState(NamedTuple):
    count: np.int32
    exp_avg: list


def clip_value_by_ema(beta=0.99, init=0.0) -> Transformation:
    """``e = (1 - beta) |g| + beta e`` in the leaf dtype (``e = |g| init`` before the first
    step); ``u = clip(g, -e, e)``. A non-finite element keeps its ``e``."""

    def init_fn(params):
        return ValueEmaState(np.int32(0), [np.zeros(np.shape(x), x.dtype) for x in tree_leaves(params)])

    def update(updates, state, params=None):
        leaves, treedef = tree_flatten(updates)
        fresh = int(state.count) == 0
        out, exp_avg = [], []
        for g, e in zip(leaves, state.exp_avg):
            dt = e.dtype
            a = np.abs(g)
            start = a * _c(init, dt) if fresh else e
            with np.errstate(all="ignore"):
                new = _arr(_c(1.0 - beta, dt) * a + _c(beta, dt) * start, dt)
            new = np.where(np.isfinite(g), new, e).astype(dt)
            exp_avg.append(new)
            out.append(_arr(np.where(g > new, new, np.where(g < -new, -new, g)), dt))
        return tree_unflatten(treedef, out), ValueEmaState(safe_increment(state.count), exp_avg)

    return Transformation(init_fn, update)


class NormGrowthState(NamedTuple):
    prev_norm: np.ndarray
    started: bool


def clip_norm_growth(
    add=None, mul=1.5, min_value=1e-4, max_decay=2.0, ord=2, tensorwise=True
) -> Transformation:
    """The first update passes (``prev = |g|`` unfloored). Then, as torchzero:
    ``allowed = min(p + add, p * mul)`` with ``p = max(prev, min_value)`` (``p * mul`` left out
    when ``p == 0``: it would hold the norm at 0 for good); the leaf (or tree) is divided by
    ``|g| / allowed`` when above it. ``prev`` becomes the clipped norm (or ``prev / max_decay``
    when the norm fell below that), floored at ``min_value``. ``add = mul = None``: identity."""

    def init_fn(params):
        return NormGrowthState(np.zeros(len(tree_leaves(params)) if tensorwise else ()), False)

    def update(updates, state, params=None):
        leaves, treedef = tree_flatten(updates)
        if add is None and mul is None:
            return tree_copy(updates), state
        n = _metrics(leaves, ord, tensorwise)
        prev = state.prev_norm
        with np.errstate(all="ignore"):
            history = np.full(np.shape(prev), state.started)
            p = np.maximum(prev, min_value) if min_value is not None else prev
            allowed = np.full(np.shape(prev), np.inf)
            if add is not None:
                allowed = p + add
            if mul is not None:
                allowed = np.minimum(allowed, np.where(p > 0, p * mul, np.inf))
            clipped = np.isfinite(n) & history & (n > 1e-12) & (n > allowed)
            denom = np.where(clipped, n / allowed, 1.0)
            new = np.where(clipped, allowed, n)
            if max_decay is not None:
                new = np.where(history & (n / prev < 1.0 / max_decay), prev / max_decay, new)
            if min_value is not None:
                new = np.where(history, np.maximum(new, min_value), new)
            new = np.where(np.isfinite(n), new, prev)
        return tree_unflatten(treedef, _divided(leaves, denom, tensorwise)), NormGrowthState(new, True)

    return Transformation(init_fn, update)


class ValueGrowthState(NamedTuple):
    prev: list
    started: bool


def clip_value_growth(add=None, mul=1.5, min_value=1e-4, max_decay=2.0) -> Transformation:
    """Element by element, in the leaf dtype (hyperparameters rounded to it): the first update
    passes (a finite value becomes the history). Then ``|u| = min(|g|, |prev| + add)``; with
    ``pm = max(|prev|, min_value) > 0``: ``growth = max(|u| / pm, 1e-8)``, ``|u| = mul * pm`` if
    ``growth > mul``; with ``pm == 0`` no multiplicative limit and no decay; ``prev`` becomes
    ``prev / max_decay`` if ``growth < 1 / max_decay`` (compared in float64), else ``u``. A
    non-finite g leaves ``prev`` as it is."""
    k_add = math.inf if add is None else add
    k_mul = math.inf if mul is None else mul
    k_min = 0.0 if min_value is None else min_value
    k_decay = math.inf if max_decay is None else max_decay

    def init_fn(params):
        return ValueGrowthState([np.zeros(np.shape(x), x.dtype) for x in tree_leaves(params)], False)

    def one(v, p, t, started):
        if not started:
            return v, (v if np.isfinite(v) else p)
        a, pa = abs(v), abs(p)
        if a - pa > t(k_add):
            a = pa + t(k_add)
        pm = max(pa, t(k_min))
        growth = math.inf
        if pm > 0:
            growth = a / pm
            growth = growth if growth >= 1e-8 or growth != growth else 1e-8
            if growth > t(k_mul):
                a = t(k_mul) * pm
        r = np.copysign(a, v)
        if not np.isfinite(v):
            return r, p
        return r, (p / t(k_decay) if float(growth) < 1.0 / float(t(k_decay)) else r)

    def update(updates, state, params=None):
        leaves, treedef = tree_flatten(updates)
        if add is None and mul is None:
            return tree_copy(updates), state
        out, prev = [], []
        with np.errstate(all="ignore"):
            for g, p in zip(leaves, state.prev):
                t = g.dtype.type
                pairs = [one(t(v), t(q), t, state.started) for v, q in zip(np.ravel(g), np.ravel(p))]
                out.append(_arr(np.reshape([r for r, _ in pairs], np.shape(g)), g.dtype))
                prev.append(_arr(np.reshape([q for _, q in pairs], np.shape(g)), g.dtype))
        return tree_unflatten(treedef, out), ValueGrowthState(prev, True)

    return Transformation(init_fn, update)


def l2_clipping(tree, max_norm: float):
    """declearn's L2Clipping: each leaf times ``min(max_norm / |g|, 1)``; a zero (or non-finite)
    norm leaves the leaf as it is."""

    def one(x):
        n = global_norm([x])  # rescaled where the plain sum of squares under- or overflows
        if not (n > 0 and math.isfinite(n)):
            return _arr(x, x.dtype)
        return _arr(x / x.dtype.type(max(n / max_norm, 1.0)) if max_norm > 0 else x * 0.0, x.dtype)

    return tree_map(one, tree)


# ---------------------------------------------------------------------------
# Norm family: torchzero's ClipNorm / Normalize / Centralize with the fixes of
# API.md (declearn_torchzero.md B.2-B.5), optax's centralize and
# adaptive_grad_clip (optax.md 3.6, 3.7)
# ---------------------------------------------------------------------------

_ORD_NAMES = {"l0": 0.0, "l1": 1.0, "l2": 2.0, "l3": 3.0, "l4": 4.0, "linf": math.inf}


def slice_metric(x, ord, axes) -> np.ndarray:
    """The metric ``ord`` of ``x`` over ``axes`` (keepdims), in float64: a p-norm (``inf`` the
    max, ``-inf`` the min of ``|x|``, ``0`` the count of non-zeros), ``'mad'`` (mean ``|x|``),
    ``'std'``/``'var'`` (unbiased) or the signed ``'sum'``."""
    v = np.asarray(x, np.float64)
    axes = tuple(axes)
    ord = _ORD_NAMES.get(ord, ord) if isinstance(ord, str) else float(ord)
    n = math.prod(v.shape[a] for a in axes)
    with np.errstate(all="ignore"):
        if ord == "sum":
            return np.sum(v, axis=axes, keepdims=True)
        if ord == "mad":
            return np.sum(np.abs(v), axis=axes, keepdims=True) / n
        if ord in ("std", "var"):
            if n < 2:  # unbiased: undefined below two elements (NumPy's ddof=1, torch.std)
                return np.full(np.sum(v, axis=axes, keepdims=True).shape, np.nan)
            d = v - np.sum(v, axis=axes, keepdims=True) / n
            var = np.sum(d * d, axis=axes, keepdims=True) / (n - 1)
            return np.sqrt(var) if ord == "std" else var
        if ord == math.inf:
            return np.max(np.abs(v), axis=axes, keepdims=True, initial=0.0)
        if ord == -math.inf:
            return np.min(np.abs(v), axis=axes, keepdims=True, initial=math.inf)
        if ord == 0:
            return np.sum(v != 0, axis=axes, keepdims=True).astype(np.float64)
        a = np.abs(v)
        naive = np.sum(a**ord, axis=axes, keepdims=True) ** (1.0 / ord)
        if ord != 2:
            return naive
        # Overflowed or (maybe) underflowed: rescaled by the max, as the library does for the
        # 2-norm (its one scaled sum of squares; other p-norms are summed as they are).
        m = np.max(a, axis=axes, keepdims=True, initial=0.0)
        rescale = (~np.isfinite(naive) | (naive < 2.0**-400)) & np.isfinite(m) & (m > 0)
        if not np.any(rescale):
            return naive
        safe = np.where(rescale, m, 1.0)
        scaled = safe * np.sum((a / safe) ** ord, axis=axes, keepdims=True) ** (1.0 / ord)
        return np.where(rescale, scaled, naive)


def tree_metric(tree, ord) -> float:
    """The metric of all leaves as one vector (torchzero's ``'global'``, ``'l0'`` counting)."""
    flat = [np.asarray(x, np.float64).ravel() for x in tree_leaves(tree)]
    v = np.concatenate(flat) if flat else np.zeros(0)
    return float(slice_metric(v, ord, (0,)).reshape(()))


def reduced_dims(ndim: int, dim, inverse_dims: bool) -> tuple:
    """The dimensions a leaf of rank ``ndim`` is reduced over: ``dim`` (dims the leaf lacks
    dropped, negative ones from the end; None: all), or the complement with ``inverse_dims``."""
    if dim is None:
        real = set(range(ndim))
    else:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        real = {d % ndim for d in dims if -ndim <= d < ndim}
    if inverse_dims:
        real = set(range(ndim)) - real
    return tuple(sorted(real))


def _usable_metric(n) -> np.ndarray:
    n = np.asarray(n, np.float64)
    return np.isfinite(n) & (n > 1e-12)


def _norm_factor(n, max_norm=None, min_norm=None, norm_value=None) -> np.ndarray:
    """Per-slice factor: torchzero's clip ``clamp(min/n, min=1) * clamp(max/n, max=1)`` or
    normalize ``norm_value / n``; 1 where the metric is <= 1e-12 or not finite."""
    n = np.asarray(n, np.float64)
    with np.errstate(all="ignore"):
        if norm_value is not None:
            f = norm_value / n
        else:
            f = np.ones_like(n)
            if max_norm is not None:
                f = f * np.where(n > max_norm, max_norm / n, 1.0)
            if min_norm is not None:
                f = f * np.where(n < min_norm, min_norm / n, 1.0)
        return np.where(_usable_metric(n), f, 1.0)


def scale_slices(
    tree, ord=2, dim=None, inverse_dims=False, min_size=1, max_norm=None, min_norm=None, norm_value=None
):
    """clip_norm / normalize / clip_grad_norm_ / normalize_grads_, leaf by leaf.

    Per slice: ``x * f`` in float64, rounded once; ``dim='global'``: ``(x / div) * mul`` in the
    leaf dtype (clip_by_global_norm's recipe), unchanged when ``div == mul``."""
    leaves, tdef = tree_flatten(tree)
    if dim == "global":
        n = tree_metric(tree, ord)
        if norm_value is not None:
            div, mul = n, norm_value
        else:
            div = mul = 1.0
            if max_norm is not None and n > max_norm:
                div, mul = n, max_norm
            if min_norm is not None and n < min_norm:
                div, mul = div * n, mul * min_norm
        if not _usable_metric(n) or div == mul:
            return tree_copy(tree)
        return tree_map(lambda x: _arr((x / x.dtype.type(div)) * x.dtype.type(mul), x.dtype), tree)
    out = []
    for x in leaves:
        shape = x.shape if x.ndim else (1,)
        axes = reduced_dims(len(shape), dim, inverse_dims)
        if not axes or math.prod(shape[a] for a in axes) < min_size:
            out.append(_arr(x, x.dtype))
            continue
        v = np.asarray(x, np.float64).reshape(shape)
        f = _norm_factor(slice_metric(v, ord, axes), max_norm, min_norm, norm_value)
        out.append(_arr((v * f).reshape(x.shape), x.dtype))
    return tree_unflatten(tdef, out)


def centralize(tree, dim=0, inverse_dims=True, min_size=2):
    """``x - mean(x over dim)`` per leaf in float64, rounded once; 0-d leaves and leaves of
    fewer than ``min_size`` elements unchanged; ``'global'``: the mean of all elements."""
    leaves, tdef = tree_flatten(tree)
    if dim == "global":
        n = sum(int(np.size(x)) for x in leaves)
        mean = sum(float(np.sum(np.asarray(x, np.float64))) for x in leaves) / n if n else 0.0
        return tree_map(lambda x: _arr(np.asarray(x, np.float64) - mean, x.dtype), tree)
    out = []
    for x in leaves:
        axes = reduced_dims(x.ndim, dim, inverse_dims) if x.ndim else ()
        if not axes or x.size < min_size:
            out.append(_arr(x, x.dtype))
            continue
        v = np.asarray(x, np.float64)
        n = math.prod(v.shape[a] for a in axes)
        with np.errstate(all="ignore"):  # an empty slice's mean is NaN; it has no element
            out.append(_arr(v - np.sum(v, axis=axes, keepdims=True) / n, x.dtype))
    return tree_unflatten(tdef, out)


def unitwise_axes(shape, axis=None) -> tuple:
    """optax's unitwise_norm axes (its code, 5-D included)."""
    nd = len(shape)
    if axis is not None:
        return tuple(sorted({a % nd for a in ((axis,) if isinstance(axis, int) else axis)}))
    if sum(1 for e in shape if e != 1) <= 1:
        return tuple(range(nd))
    if nd in (2, 3):
        return (0,)
    if nd in (4, 5):
        return tuple(range(nd - 1))
    raise ValueError(f"unsupported shape {shape}")


def adaptive_grad_clip(tree, params, clipping, eps=1e-3, axis=None):
    """optax's AGC leaf by leaf in float64: ``g`` where ``|g| < c * max(|p|, eps)``, else
    ``g * max_norm / max(|g|, 1e-6)``, over unit-wise L2 norms."""

    def one(g, p):
        axes = unitwise_axes(np.shape(g), axis)
        gn = slice_metric(g, 2, axes)
        mx = clipping * np.maximum(slice_metric(p, 2, axes), eps)
        with np.errstate(all="ignore"):
            f = np.where(gn < mx, 1.0, mx / np.maximum(gn, 1e-6))
        return _arr(np.asarray(g, np.float64) * f, g.dtype)

    return tree_map(one, tree, params)


# ---------------------------------------------------------------------------
# optax's optimizer library (numbaccum.optimizers), leaf by leaf from optax's
# alias.py / transform.py: moments ``(1 - d) g**k + d m``, corrections
# ``1 - d**count`` in the leaf dtype, then the direction.
# ---------------------------------------------------------------------------


def _direction(state_cls, fields, step, counted=True, initial=None, mu_dtype=None):
    """A transformation whose state holds ``fields`` (trees, ``initial[f]`` at start) and, when
    ``counted``, a count; ``step(count, dt, g, *moments) -> (u, *new_moments)`` per leaf."""

    def init(params):
        trees = []
        for f in fields:
            value = (initial or {}).get(f, 0.0)
            dtype = mu_dtype if (f == "mu" and mu_dtype is not None) else None
            trees.append(tree_map(lambda x, v=value, d=dtype: np.full(np.shape(x), v, d or x.dtype), params))
        return state_cls(np.int32(0), *trees) if counted else state_cls(*trees)

    def update(updates, state, params=None, **extra):
        count = safe_increment(state.count) if counted else None
        moments = [getattr(state, f) for f in fields]
        gl, tdef = tree_flatten(updates)
        ml = [tree_flatten(m)[0] for m in moments]
        us, new = [], [[] for _ in fields]
        for i, g in enumerate(gl):
            dt = g.dtype
            olds = [m[i] for m in ml]
            u, *ms = step(count, dt, g, *[o.astype(np.result_type(o.dtype, dt)) for o in olds])
            us.append(_arr(u, dt))
            for k, (m_new, old) in enumerate(zip(ms, olds)):
                new[k].append(_arr(m_new, old.dtype))
        trees = [tree_unflatten(tdef, n) for n in new]
        return tree_unflatten(tdef, us), (state_cls(count, *trees) if counted else state_cls(*trees))

    return Transformation(init, update)


def _moment(g, m, d, dt, order=1):
    return _c(1 - d, dt) * (g if order == 1 else g * g) + _c(d, dt) * m


def _nesterov_hat(m, g, b1, count, dt):
    return _c(b1, dt) * (m / bias_correction_denominator(b1, safe_increment(count), dt)) + _c(1 - b1, dt) * (
        g / bias_correction_denominator(b1, count, dt)
    )


def scale_by_nadam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None) -> Transformation:
    def step(count, dt, g, mu, nu):
        m, v = _moment(g, mu, b1, dt), _moment(g, nu, b2, dt, 2)
        m_hat = _nesterov_hat(m, g, b1, count, dt)
        v_hat = v / bias_correction_denominator(b2, count, dt)
        return m_hat / (np.sqrt(v_hat + _c(eps_root, dt)) + _c(eps, dt)), m, v

    return _direction(ScaleByAdamState, ("mu", "nu"), step, mu_dtype=mu_dtype)


def adamw(
    learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4, mask=None, *, nesterov=False
):
    direction = scale_by_nadam(b1, b2, eps, eps_root) if nesterov else scale_by_adam(b1, b2, eps, eps_root)
    decay = (
        add_decayed_weights(weight_decay) if mask is None else add_decayed_weights_masked(weight_decay, mask)
    )
    return chain(direction, decay, scale_by_learning_rate(learning_rate))


def nadam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0):
    return chain(scale_by_nadam(b1, b2, eps, eps_root), scale_by_learning_rate(learning_rate))


class ScaleByAmsgradState(NamedTuple):
    count: int
    mu: Any
    nu: Any
    nu_max: Any


def amsgrad(
    learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, bias_correction_mu=True, bias_correction_nu=True
):
    def step(count, dt, g, mu, nu, nu_max):
        m, v = _moment(g, mu, b1, dt), _moment(g, nu, b2, dt, 2)
        m_hat = m / bias_correction_denominator(b1, count, dt) if bias_correction_mu else m
        v_eff = v / bias_correction_denominator(b2, count, dt) if bias_correction_nu else v
        vm = np.maximum(nu_max, v_eff)
        return m_hat / (np.sqrt(vm + _c(eps_root, dt)) + _c(eps, dt)), m, v, vm

    direction = _direction(ScaleByAmsgradState, ("mu", "nu", "nu_max"), step)
    return chain(direction, scale_by_learning_rate(learning_rate))


def adamax(learning_rate, b1=0.9, b2=0.999, eps=1e-8):
    def step(count, dt, g, mu, nu):
        m = _moment(g, mu, b1, dt)
        v = np.maximum(np.abs(g) + _c(eps, dt), _c(b2, dt) * nu)
        return (m / bias_correction_denominator(b1, count, dt)) / v, m, v

    return chain(_direction(ScaleByAdamState, ("mu", "nu"), step), scale_by_learning_rate(learning_rate))


def scale_by_yogi(b1=0.9, b2=0.999, eps=1e-3, eps_root=0.0, initial_accumulator_value=1e-6):
    """optax's ``scale_by_yogi``: both moments start at ``initial_accumulator_value``;
    ``nu = nu - ((1 - b2) * sign(nu - g^2)) * g^2`` with ``jnp.sign`` (+-0 and NaN kept)."""

    def step(count, dt, g, mu, nu):
        m = _moment(g, mu, b1, dt)
        g2 = g * g
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, as in optax
            d = nu - g2
            sign = np.where(d == 0, d, np.sign(d)).astype(dt)
            v = nu - (_c(1 - b2, dt) * sign) * g2
            m_hat = m / bias_correction_denominator(b1, count, dt)
            v_hat = v / bias_correction_denominator(b2, count, dt)
            return m_hat / (np.sqrt(v_hat + _c(eps_root, dt)) + _c(eps, dt)), m, v

    initial = {"mu": initial_accumulator_value, "nu": initial_accumulator_value}
    return _direction(ScaleByAdamState, ("mu", "nu"), step, initial=initial)


def yogi(learning_rate, b1=0.9, b2=0.999, eps=1e-3):
    return chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate))


class ScaleByBeliefState(NamedTuple):
    count: int
    mu: Any
    nu: Any


def adabelief(learning_rate, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *, nesterov=False):
    def step(count, dt, g, mu, nu):
        m = _moment(g, mu, b1, dt)
        v = _moment(g - m, nu, b2, dt, 2) + _c(eps_root, dt)
        m_hat = (
            _nesterov_hat(m, g, b1, count, dt) if nesterov else m / bias_correction_denominator(b1, count, dt)
        )
        v_hat = v / bias_correction_denominator(b2, count, dt)
        return m_hat / (np.sqrt(v_hat) + _c(eps, dt)), m, v

    return chain(_direction(ScaleByBeliefState, ("mu", "nu"), step), scale_by_learning_rate(learning_rate))


class ScaleByLionState(NamedTuple):
    count: int
    mu: Any


def scale_by_lion(b1=0.9, b2=0.99, mode="hard", smooth_beta=1.0):
    def step(count, dt, g, mu):
        c = _c(1 - b1, dt) * g + _c(b1, dt) * mu
        if mode == "smooth":
            u = np.tanh(_c(smooth_beta, dt) * c)
        elif mode == "refined":
            u = np.where(np.abs(c) < 1.0, c, np.where(c == 0, c, np.sign(c)))
        else:
            u = np.where(c == 0, c, np.sign(c))  # jnp.sign keeps +-0 (and NaN)
        return u, _moment(g, mu, b2, dt)

    return _direction(ScaleByLionState, ("mu",), step)


def lion(learning_rate, b1=0.9, b2=0.99, weight_decay=1e-3):
    return chain(
        scale_by_lion(b1, b2), add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate)
    )


class ScaleByRmsState(NamedTuple):
    nu: Any


class ScaleByRmsWithCountState(NamedTuple):
    count: int
    nu: Any


class ScaleByRStdDevState(NamedTuple):
    mu: Any
    nu: Any


class ScaleByRStdDevWithCountState(NamedTuple):
    count: int
    mu: Any
    nu: Any


def _inv_sqrt(n, eps, dt, eps_in_sqrt):
    one = _c(1.0, dt)
    return one / np.sqrt(n + _c(eps, dt)) if eps_in_sqrt else one / (np.sqrt(n) + _c(eps, dt))


def rmsprop(
    learning_rate,
    decay=0.9,
    eps=1e-8,
    initial_scale=0.0,
    eps_in_sqrt=True,
    centered=False,
    momentum=None,
    nesterov=False,
    bias_correction=False,
):
    def correct(x, count, dt):
        return x / bias_correction_denominator(decay, count, dt) if bias_correction else x

    if centered:

        def step(count, dt, g, mu, nu):
            m, v = _moment(g, mu, decay, dt), _moment(g, nu, decay, dt, 2)
            mh, vh = correct(m, count, dt), correct(v, count, dt)
            return _inv_sqrt(vh - mh * mh, eps, dt, eps_in_sqrt) * g, m, v

        cls = ScaleByRStdDevWithCountState if bias_correction else ScaleByRStdDevState
        direction = _direction(cls, ("mu", "nu"), step, bias_correction, {"nu": initial_scale})
    else:

        def step(count, dt, g, nu):
            v = _moment(g, nu, decay, dt, 2)
            return _inv_sqrt(correct(v, count, dt), eps, dt, eps_in_sqrt) * g, v

        cls = ScaleByRmsWithCountState if bias_correction else ScaleByRmsState
        direction = _direction(cls, ("nu",), step, bias_correction, {"nu": initial_scale})
    tail = trace(momentum, nesterov) if momentum is not None else identity()
    return chain(direction, scale_by_learning_rate(learning_rate), tail)


class ScaleByRssState(NamedTuple):
    sum_of_squares: Any


def adagrad(learning_rate, initial_accumulator_value=0.1, eps=1e-7):
    def step(count, dt, g, s):
        s_new = g * g + s
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(s_new > 0, _c(1.0, dt) / np.sqrt(s_new + _c(eps, dt)), _c(0.0, dt))
        return scale * g, s_new

    direction = _direction(
        ScaleByRssState, ("sum_of_squares",), step, False, {"sum_of_squares": initial_accumulator_value}
    )
    return chain(direction, scale_by_learning_rate(learning_rate))


# --- issue 26: AdamaxW, RAdam, Adadelta -----------------------------------------------------------


def adamaxw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4):
    def step(count, dt, g, mu, nu):
        m = _moment(g, mu, b1, dt)
        v = np.maximum(np.abs(g) + _c(eps, dt), _c(b2, dt) * nu)
        return (m / bias_correction_denominator(b1, count, dt)) / v, m, v

    direction = _direction(ScaleByAdamState, ("mu", "nu"), step)
    return chain(direction, add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))


def scale_by_radam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, nesterov=False):
    """optax's ``scale_by_radam``: ``rho_t`` and ``r_t`` in the leaves' dtype (``b2 ** t`` as a
    power of that dtype), the rectified Adam step once ``rho_t >= threshold``, ``mu_hat`` before."""
    rho_inf = 2.0 / (1.0 - b2) - 1.0

    def step(count, dt, g, mu, nu):
        m, v = _moment(g, mu, b1, dt), _moment(g, nu, b2, dt, 2)
        m_hat = (
            _nesterov_hat(m, g, b1, count, dt) if nesterov else m / bias_correction_denominator(b1, count, dt)
        )
        t = np.dtype(dt).type
        b2t = t(b2) ** int(count)
        ri = t(rho_inf)
        rho = ri - t(2) * t(int(count)) * b2t / (t(1) - b2t)
        if not rho >= threshold:
            return m_hat, m, v
        r = np.sqrt((rho - t(4)) * (rho - t(2)) * ri / ((ri - t(4)) * (ri - t(2)) * rho))
        v_hat = v / bias_correction_denominator(b2, count, dt)
        return (r * m_hat) / (np.sqrt(v_hat + _c(eps_root, dt)) + _c(eps, dt)), m, v

    return _direction(ScaleByAdamState, ("mu", "nu"), step)


def radam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, nesterov=False):
    return chain(
        scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov), scale_by_learning_rate(learning_rate)
    )


class ScaleByAdaDeltaState(NamedTuple):
    e_g: Any
    e_x: Any


def scale_by_adadelta(rho=0.9, eps=1e-6):
    def step(count, dt, g, e_g, e_x):
        eg = _moment(g, e_g, rho, dt, 2)
        u = (np.sqrt(e_x + _c(eps, dt)) / np.sqrt(eg + _c(eps, dt))) * g
        return u, eg, _moment(u, e_x, rho, dt, 2)

    return _direction(ScaleByAdaDeltaState, ("e_g", "e_x"), step, counted=False)


def adadelta(learning_rate=None, rho=0.9, eps=1e-6, weight_decay=0.0):
    last = identity() if learning_rate is None else scale_by_learning_rate(learning_rate)
    return chain(add_decayed_weights(weight_decay), scale_by_adadelta(rho, eps), last)


def scale_by_trust_ratio(min_norm=0.0, trust_coefficient=1.0, eps=0.0):
    """optax's ``scale_by_trust_ratio``, the norms in float64: ``u * trust ||p|| / (||u|| +
    eps)`` per leaf, the ratio in the leaf's real dtype (float32 for float16, bfloat16 and
    complex64) from the norms rounded to it, as optax rounds it (each norm at least ``min_norm``;
    ratio 1 where either norm is 0)."""

    def leaf(g, p):
        t = _wide(np.real(np.zeros(0, g.dtype)).dtype).type

        def norm(x):
            n = t(np.sqrt(np.sum(np.abs(x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)) ** 2)))
            return t(min_norm) if n <= t(min_norm) else n

        with np.errstate(over="ignore"):
            pn, un = norm(p), norm(g)
            ratio = 1.0 if pn == 0.0 or un == 0.0 else t(trust_coefficient) * pn / (un + t(eps))
        return _arr(g.astype(np.result_type(g.dtype, np.float64)) * float(ratio), g.dtype)

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("scale_by_trust_ratio needs params")
        return tree_map(leaf, updates, params), state

    return Transformation(lambda params: EmptyState(), update)


def lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0):
    return chain(
        scale_by_adam(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )


def lars(learning_rate, weight_decay=0.0, trust_coefficient=0.001, eps=0.0, momentum=0.9, nesterov=False):
    return chain(
        add_decayed_weights(weight_decay),
        scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps),
        scale_by_learning_rate(learning_rate),
        trace(momentum, nesterov),
    )


def signum(learning_rate, beta=0.9):
    return chain(ema(beta, debias=False), scale_by_sign(), scale_by_learning_rate(learning_rate))


class ScaleByRpropState(NamedTuple):
    step_sizes: Any
    prev_updates: Any


def scale_by_rprop(learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6, max_step_size=50.0):
    """Rprop as torch.optim.Rprop and the paper (optax 0.2.8 emits the previous step's update:
    its PR #1725): the step grows or shrinks with the sign of ``g * prev``; 0 after a flip."""

    def step(count, dt, g, step_sizes, prev):
        with np.errstate(invalid="ignore"):
            s = g * prev
            factor = np.where(s > 0, _c(eta_plus, dt), _c(eta_minus, dt))
            grown = np.minimum(np.maximum(step_sizes * factor, _c(min_step_size, dt)), _c(max_step_size, dt))
            new_step = np.where(s == 0, step_sizes, grown)
            sign = np.where(g == 0, g, np.sign(g))
            u = np.where(s < 0, np.zeros_like(g), new_step * sign)
        return u, new_step, u

    initial = {"step_sizes": learning_rate}
    return _direction(ScaleByRpropState, ("step_sizes", "prev_updates"), step, counted=False, initial=initial)


def rprop(learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6, max_step_size=50.0):
    return chain(
        scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size), scale(-1.0)
    )


class ScaleByAdanState(NamedTuple):
    m: Any
    v: Any
    n: Any
    g: Any
    t: Any


def scale_by_adan(b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=0.0):
    """optax's ``scale_by_adan`` leaf by leaf (its count is ``t``)."""

    def init(params):
        z = [zeros_like(params) for _ in range(4)]
        return ScaleByAdanState(*z, np.int32(0))

    def update(updates, state, params=None, **extra):
        t = safe_increment(state.t)
        gl, tdef = tree_flatten(updates)
        old = [tree_flatten(getattr(state, f))[0] for f in ("m", "v", "n", "g")]
        out, new = [], [[], [], [], []]
        for i, g in enumerate(gl):
            dt = g.dtype
            m, v, n, gp = (o[i] for o in old)
            d = np.zeros_like(g) if state.t == 0 else g - gp
            m = _moment(g, m, b1, dt)
            v = _moment(d, v, b2, dt)
            n = _moment(g + _c(1 - b2, dt) * d, n, b3, dt, 2)
            m_hat = m / bias_correction_denominator(b1, t, dt)
            v_hat = v / bias_correction_denominator(b2, t, dt)
            n_hat = n / bias_correction_denominator(b3, t, dt)
            u = (m_hat + _c(1 - b2, dt) * v_hat) / (np.sqrt(n_hat + _c(eps_root, dt)) + _c(eps, dt))
            out.append(_arr(u, dt))
            for k, x in enumerate((m, v, n, g)):
                new[k].append(_arr(x, dt))
        trees = [tree_unflatten(tdef, x) for x in new]
        return tree_unflatten(tdef, out), ScaleByAdanState(*trees, t)

    return Transformation(init, update)


def adan(learning_rate, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=1e-8, weight_decay=0.0):
    return chain(
        scale_by_adan(b1, b2, b3, eps, eps_root),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )


def fromage(learning_rate, min_norm=1e-6):
    mult = 1.0 / (1.0 + learning_rate**2) ** 0.5
    return chain(
        scale_by_trust_ratio(min_norm),
        scale_by_learning_rate(learning_rate * mult),
        add_decayed_weights(mult - 1.0),
    )


class ScaleByOptimisticGradientState(NamedTuple):
    is_initial_step: Any
    previous_gradient: Any


def scale_by_optimistic_gradient(alpha=1.0, beta=1.0):
    """optax's ``scale_by_optimistic_gradient`` leaf by leaf (the previous gradient is the
    current one at the first step)."""

    def init(params):
        return ScaleByOptimisticGradientState(np.bool_(True), zeros_like(params))

    def update(updates, state, params=None, **extra):
        def leaf(g, prev):
            prev = g if state.is_initial_step else prev
            return _arr(_c(alpha + beta, g.dtype) * g - _c(beta, g.dtype) * prev, g.dtype)

        out = tree_map(leaf, updates, state.previous_gradient)
        return out, ScaleByOptimisticGradientState(np.bool_(False), tree_map(np.copy, updates))

    return Transformation(init, update)


def optimistic_gradient_descent(learning_rate, alpha=1.0, beta=1.0):
    return chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate))


def optimistic_adam_v2(learning_rate, *, alpha=1.0, beta=1.0, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0):
    return chain(
        scale_by_nadam(b1, b2, eps, eps_root),  # nesterov=True, optax's default here
        scale_by_optimistic_gradient(alpha, beta),
        scale_by_learning_rate(learning_rate),
    )


def scale_by_polyak(f_min=0.0, max_learning_rate=1.0, eps=0.0, variant="sps"):
    """optax's ``scale_by_polyak``, the squared norm in float64."""

    def update(updates, state, params=None, *, value, **extra):
        leaves, _ = tree_flatten(updates)
        sq = sum(
            float(np.sum(np.abs(x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)) ** 2))
            for x in leaves
        )
        gap = float(value) - f_min
        if variant == "sps+":
            gap = max(gap, 0.0)
        step = 0.0 if sq + eps <= np.finfo(np.float64).eps else min(gap / (sq + eps), max_learning_rate)
        return tree_map(lambda x: _arr(x * step, x.dtype), updates), state

    return Transformation(lambda params: EmptyState(), update)


def polyak_sgd(max_learning_rate=1.0, scaling=1.0, f_min=0.0, eps=0.0, variant="sps"):
    return chain(sgd(scaling), scale_by_polyak(f_min, max_learning_rate, eps, variant))


class ConditionallyTransformState(NamedTuple):
    inner_state: Any
    step: Any


class ConditionallyMaskState(NamedTuple):
    step: Any
    inner_state: Any


def conditionally_transform(inner, should_transform_fn):
    def init(params):
        return ConditionallyTransformState(inner.init(params), np.int32(0))

    def update(updates, state, params=None, **extra):
        if should_transform_fn(state.step):
            updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
        else:
            inner_state = state.inner_state
        return updates, ConditionallyTransformState(inner_state, safe_increment(state.step))

    return Transformation(init, update)


def conditionally_mask(inner, should_transform_fn):
    def init(params):
        return ConditionallyMaskState(np.int32(0), inner.init(params))

    def update(updates, state, params=None, **extra):
        if should_transform_fn(state.step):
            updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
        else:
            updates, inner_state = tree_map(np.zeros_like, updates), state.inner_state
        return updates, ConditionallyMaskState(safe_increment(state.step), inner_state)

    return Transformation(init, update)


class ScaleByNovogradState(NamedTuple):
    count: Any
    mu: Any
    nu: Any


def scale_by_novograd(b1=0.9, b2=0.25, eps=1e-8, eps_root=0.0, weight_decay=0.0):
    """optax's ``scale_by_novograd`` leaf by leaf, each squared norm in float64 (then the leaf's
    dtype)."""

    def init(params):
        return ScaleByNovogradState(
            np.int32(0), zeros_like(params), tree_map(lambda p: np.zeros((), p.dtype), params)
        )

    def update(updates, state, params=None, **extra):
        count = safe_increment(state.count)

        def nu_of(g, nu):
            dt = g.dtype
            sq = dt.type(np.sum(g.astype(np.float64) ** 2))
            return np.asarray(sq if count == 1 else _c(1 - b2, dt) * sq + _c(b2, dt) * nu, dt)

        nu = tree_map(nu_of, updates, state.nu)

        def mu_of(g, p, n, m):
            dt = g.dtype
            a = _arr(g / (np.sqrt(n + _c(eps_root, dt)) + _c(eps, dt)), dt) + _c(weight_decay, dt) * p
            return _arr(a if count == 1 else _c(b1, dt) * m + a, dt)

        mu = tree_map(mu_of, updates, params, nu, state.mu)
        return tree_map(np.copy, mu), ScaleByNovogradState(count, mu, nu)

    return Transformation(init, update)


class FactoredState(NamedTuple):
    count: Any
    v_row: Any
    v_col: Any
    v: Any


def scale_by_factored_rms(
    factored=True, decay_rate=0.8, step_offset=0, min_dim_size_to_factor=128, epsilon=1e-30
):
    """optax's ``scale_by_factored_rms`` leaf by leaf: the means of ``g^2 + eps`` in float64
    (then the leaf's dtype, as optax stores them), the factors and the update in float64 then
    rounded once. Empty leaves are never factored (numbaccum's rule)."""

    def dims(shape):
        if not factored or len(shape) < 2 or int(np.prod(shape)) == 0:
            return None
        order = np.argsort(shape)
        return None if shape[order[-2]] < min_dim_size_to_factor else (int(order[-2]), int(order[-1]))

    def init(params):
        def part(p, which):
            d = dims(p.shape)
            if d is None:
                return np.zeros(p.shape if which == 2 else (1,), p.dtype)
            if which == 2:
                return np.zeros((1,), p.dtype)
            return np.zeros(np.delete(p.shape, d[1] if which == 0 else d[0]), p.dtype)

        return FactoredState(*[np.int32(0)] + [tree_map(lambda p, w=w: part(p, w), params) for w in range(3)])

    def update(updates, state, params=None, **extra):
        t = np.float32(int(state.count) - step_offset + 1)
        b = np.float32(1.0) - t ** np.float32(-decay_rate)
        b64, one_minus = np.float64(b), np.float64(np.float32(1) - b)
        out, rows, cols, vs = {}, [], [], []
        leaves, td = tree_flatten(updates)
        for i, (g, vr, vc, v) in enumerate(
            zip(leaves, tree_flatten(state.v_row)[0], tree_flatten(state.v_col)[0], tree_flatten(state.v)[0])
        ):
            dt, d = g.dtype, dims(g.shape)
            sq = g.astype(np.float64) ** 2 + epsilon
            if d is None:
                w = dt.type(1) if dt.itemsize > 2 else np.float32(1)
                nv = _arr(
                    _c(b, w.dtype) * v.astype(w.dtype)
                    + _c(one_minus, w.dtype) * (g.astype(w.dtype) ** 2 + _c(epsilon, w.dtype)),
                    dt,
                )
                out[i] = _arr(g.astype(w.dtype) * nv.astype(w.dtype) ** _c(-0.5, w.dtype), dt)
                rows.append(vr.copy()), cols.append(vc.copy()), vs.append(nv)
                continue
            d1, d0 = d
            nr = _arr(b64 * vr.astype(np.float64) + one_minus * sq.mean(axis=d0), dt)
            nc = _arr(b64 * vc.astype(np.float64) + one_minus * sq.mean(axis=d1), dt)
            r64, c64 = nr.astype(np.float64), nc.astype(np.float64)
            rf = (r64 / r64.mean(axis=d1 - 1 if d1 > d0 else d1, keepdims=True)) ** -0.5
            out[i] = _arr(g.astype(np.float64) * np.expand_dims(rf, d0) * np.expand_dims(c64**-0.5, d1), dt)
            rows.append(nr), cols.append(nc), vs.append(v.copy())
        new = [tree_unflatten(td, x) for x in (rows, cols, vs)]
        return tree_unflatten(td, [out[i] for i in range(len(leaves))]), FactoredState(
            safe_increment(state.count), *new
        )

    return Transformation(init, update)


class ScaleBySM3State(NamedTuple):
    mu: Any
    nu: Any


def scale_by_sm3(b1=0.9, b2=1.0, eps=1e-8):
    """optax's ``scale_by_sm3`` leaf by leaf in the leaf's dtype (float32 for float16 and
    bfloat16); a 0-d leaf counts as shape (1,) (numbaccum's rule: optax fails on it)."""
    c0 = 1.0 - b2 if b2 != 1.0 else 1.0

    def init(params):
        mu = tree_map(lambda p: [np.zeros(e, p.dtype) for e in (p.shape or (1,))], params)
        return ScaleBySM3State(mu, zeros_like(params))

    def update(updates, state, params=None, **extra):
        leaves, td = tree_flatten(updates)
        mus, nus = tree_flatten(state.mu)[0], tree_flatten(state.nu)[0]
        nd = [len(g.shape or (1,)) for g in leaves]
        starts = np.cumsum([0] + nd)
        out, new_mu, new_nu = [], [], []
        for k, (g, n) in enumerate(zip(leaves, nus)):
            dt = g.dtype
            w = _wide(dt)
            x = g.astype(w).reshape(g.shape or (1,))
            vs = [m.astype(w) for m in mus[starts[k] : starts[k + 1]]]
            shape = x.shape
            m = vs[0].reshape([-1] + [1] * (len(shape) - 1))
            for i in range(1, len(shape)):
                m = np.minimum(m, vs[i].reshape([1] * i + [-1] + [1] * (len(shape) - i - 1)))
            a = _c(c0, w) * (x * x) + _c(b2, w) * m
            with np.errstate(divide="ignore", invalid="ignore"):
                up = x * np.where(a > 0, w.type(1) / np.sqrt(a + _c(eps, w)), w.type(0))
            nu = _arr((_c(1 - b1, w) * up + _c(b1, w) * n.astype(w).reshape(shape)).reshape(g.shape), dt)
            out.append(nu.copy())
            new_nu.append(nu)
            axes = range(len(shape))
            new_mu += [_arr(np.max(a, axis=tuple(j for j in axes if j != i)), dt) for i in axes]
        lists, pos = [], 0
        for d in nd:
            lists.append(new_mu[pos : pos + d])
            pos += d
        return tree_unflatten(td, out), ScaleBySM3State(tree_unflatten(td, lists), tree_unflatten(td, new_nu))

    return Transformation(init, update)


def sm3(learning_rate, momentum=0.9):
    return chain(scale_by_sm3(momentum), scale(-learning_rate))


def novograd(learning_rate, b1=0.9, b2=0.25, eps=1e-6, eps_root=0.0, weight_decay=0.0):
    return chain(
        scale_by_novograd(b1, b2, eps, eps_root, weight_decay), scale_by_learning_rate(learning_rate)
    )


class ScaleByDistanceOverGradientsState(NamedTuple):
    max_dist: Any
    grad_sum_of_squares: Any
    init_params: Any


def _wide(dt) -> np.dtype:
    """float16 and bfloat16 computed in float32."""
    dt = np.dtype(dt)
    return np.dtype(np.float32) if dt.itemsize == 2 else dt


def scale_by_distance_over_gradients(reps_rel=1e-6, eps=1e-8, param_dtype=np.float32, global_scale=1.0):
    """optax's ``scale_by_distance_over_gradients`` leaf by leaf, each squared norm in float64
    (then rounded to the state's dtype). The distances (``max_dist``, ``p - p0``) are in the
    leaf's and ``param_dtype``'s promoted dtype, the gradients' sum of squares (shape (1,)) in
    the leaf's (float32 for float16 and bfloat16); the update keeps the leaf's shape and dtype."""

    def stored(p):
        return p.dtype if param_dtype is None else np.dtype(param_dtype)

    def sumsq(x):
        return np.sum(np.asarray(x, np.float64) ** 2)

    def init(params):
        def first(p):
            dt = np.promote_types(_wide(p.dtype), _wide(stored(p)))
            return np.asarray(_c(reps_rel, dt) * (dt.type(1.0) + np.sqrt(dt.type(sumsq(p)))), dt)

        return ScaleByDistanceOverGradientsState(
            tree_map(first, params),
            tree_map(lambda p: np.zeros(1, _wide(p.dtype)), params),
            tree_map(lambda p: np.array(p, dtype=stored(p)), params),
        )

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("scale_by_distance_over_gradients needs params")

        def dist_of(d, p, p0):
            dt = d.dtype
            diff = np.asarray(p.astype(dt) - p0.astype(dt), dt)
            return np.asarray(np.maximum(d, np.sqrt(dt.type(sumsq(diff)))), dt)

        def sos_of(s, g):
            return np.asarray(s + s.dtype.type(sumsq(g)), s.dtype)

        max_dist = tree_map(dist_of, state.max_dist, params, state.init_params)
        g_sos = tree_map(sos_of, state.grad_sum_of_squares, updates)

        def scaled(g, d, s):
            et = np.promote_types(d.dtype, s.dtype)
            eta = _c(global_scale, et) * (d.astype(et) / np.sqrt(s.astype(et) + _c(eps, et)))
            return _arr(eta[0] * np.asarray(g, et), g.dtype)

        out = tree_map(scaled, updates, max_dist, g_sos)
        return out, ScaleByDistanceOverGradientsState(max_dist, g_sos, state.init_params)

    return Transformation(init, update)


class ScaleByLBFGSState(NamedTuple):
    count: Any
    params: Any
    updates: Any
    diff_params_memory: Any
    diff_updates_memory: Any
    weights_memory: Any


def _vdot64(a, b) -> float:
    """The real part of ``vdot(a, b)`` over two trees, float64."""
    total = 0.0
    for x, y in zip(tree_flatten(a)[0], tree_flatten(b)[0]):
        wide = np.complex128 if np.iscomplexobj(x) else np.float64
        total += float(np.real(np.vdot(x.astype(wide).ravel(), y.astype(wide).ravel())))
    return total


def scale_by_lbfgs(memory_size=10, scale_init_precond=True):
    """optax's ``scale_by_lbfgs`` (Nocedal and Wright's two-loop recursion) leaf by leaf, its inner
    products in float64; the memories are lists of trees."""

    def init(params):
        z = lambda: [zeros_like(params) for _ in range(memory_size)]  # noqa: E731
        return ScaleByLBFGSState(
            np.int32(0), zeros_like(params), zeros_like(params), z(), z(), np.zeros(memory_size)
        )

    def update(updates, state, params=None, **extra):
        count, m = int(state.count), memory_size
        idx, prev = count % m, (count - 1) % m
        dps, dus, rhos = (
            list(state.diff_params_memory),
            list(state.diff_updates_memory),
            state.weights_memory.copy(),
        )

        def sub(a, b):
            return tree_map(lambda x, y: _arr(x - y, x.dtype), a, b)

        if count > 0:
            dps[prev], dus[prev] = sub(params, state.params), sub(updates, state.updates)
            sy = _vdot64(dus[prev], dps[prev])
            rhos[prev] = 0.0 if sy == 0.0 else 1.0 / sy
        if not scale_init_precond:
            gamma = 1.0
        elif count > 0:
            yy = _vdot64(dus[prev], dus[prev])
            gamma = sy / yy if yy > 0 else 1.0
        else:
            n = np.sqrt(_vdot64(updates, updates))
            gamma = min(1.0, 1.0 / n) if n > 0 else 1.0
        order = [(idx + j) % m for j in range(m)][m - min(count, m) :]
        vec, alphas = tree_map(np.copy, updates), []
        for j in reversed(order):
            a = rhos[j] * _vdot64(dps[j], vec)
            vec = tree_map(lambda v, y, a=a: _arr(v + _c(-a, v.dtype) * y, v.dtype), vec, dus[j])
            alphas.append(a)
        vec = tree_map(lambda v: _arr(v * _c(gamma, v.dtype), v.dtype), vec)
        for j, a in zip(order, reversed(alphas)):
            b = rhos[j] * _vdot64(dus[j], vec)
            vec = tree_map(lambda v, s, a=a, b=b: _arr(v + _c(a - b, v.dtype) * s, v.dtype), vec, dps[j])
        new = ScaleByLBFGSState(
            safe_increment(state.count), tree_map(np.copy, params), tree_map(np.copy, updates), dps, dus, rhos
        )
        return vec, new

    return Transformation(init, update)


def scale_by_adopt(
    b1=0.9, b2=0.9999, eps=1e-6, *, nesterov=False, use_clipping=True, clip_value_fn=lambda x: x**0.25
):
    """optax.contrib's ``scale_by_adopt`` leaf by leaf (its first step only sets nu = g^2)."""

    def init(params):
        return ScaleByAdamState(np.int32(0), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None, **extra):
        c = int(state.count)

        def leaf(g, m, v):
            dt = g.dtype
            t = dt.type
            d1, d2 = (t(b1), t(b2)) if c > 0 else (t(1.0), t(0.0))
            u = g / np.maximum(np.sqrt(v), _c(eps, dt))
            if use_clipping:
                cv = _c(float(clip_value_fn(np.int32(c))), dt)
                u = np.clip(u, -cv, cv)
            nu = _arr((t(1) - d2) * (g * g) + d2 * v, dt)
            mu = _arr((t(1) - d1) * u + d1 * m, dt)
            out = _arr((t(1) - d1) * u + d1 * mu, dt) if nesterov else mu
            return mu, nu, out

        gl, tdef = tree_flatten(updates)
        res = [leaf(g, m, v) for g, m, v in zip(gl, tree_flatten(state.mu)[0], tree_flatten(state.nu)[0])]
        mu, nu, out = (tree_unflatten(tdef, [r[i] for r in res]) for i in range(3))
        return tree_map(np.copy, out), ScaleByAdamState(safe_increment(state.count), mu, nu)

    return Transformation(init, update)


def adopt(learning_rate, b1=0.9, b2=0.9999, eps=1e-6, **kw):
    return chain(scale_by_adopt(b1, b2, eps, **kw), scale_by_learning_rate(learning_rate))


class ScaleByAdemamixState(NamedTuple):
    count: Any
    count_m2: Any
    m1: Any
    m2: Any
    nu: Any


def scale_by_ademamix(b1=0.9, b2=0.999, b3=0.9999, alpha=6.0, eps=1e-8, eps_root=0.0):
    """optax.contrib's ``scale_by_ademamix`` leaf by leaf (the slow EMA not bias-corrected)."""

    def init(params):
        return ScaleByAdemamixState(
            np.int32(0), np.int32(0), zeros_like(params), zeros_like(params), zeros_like(params)
        )

    def update(updates, state, params=None, **extra):
        c3 = b3(int(state.count_m2)) if callable(b3) else b3
        a = alpha(int(state.count_m2)) if callable(alpha) else alpha
        count = safe_increment(state.count)

        def leaf(g, m1, m2, v):
            dt = g.dtype
            m1 = _arr(_moment(g, m1, b1, dt), dt)
            m2 = _arr(_moment(g, m2, c3, dt), dt)
            v = _arr(_moment(g, v, b2, dt, 2), dt)
            m1_hat = m1 / bias_correction_denominator(b1, count, dt)
            v_hat = v / bias_correction_denominator(b2, count, dt)
            out = _arr((m1_hat + _c(a, dt) * m2) / (np.sqrt(v_hat + _c(eps_root, dt)) + _c(eps, dt)), dt)
            return m1, m2, v, out

        gl, tdef = tree_flatten(updates)
        olds = [tree_flatten(getattr(state, f))[0] for f in ("m1", "m2", "nu")]
        res = [leaf(g, *(o[i] for o in olds)) for i, g in enumerate(gl)]
        m1, m2, nu, out = (tree_unflatten(tdef, [r[i] for r in res]) for i in range(4))
        return out, ScaleByAdemamixState(count, safe_increment(state.count_m2), m1, m2, nu)

    return Transformation(init, update)


def ademamix(learning_rate, b1=0.9, b2=0.999, b3=0.9999, alpha=5.0, eps=1e-8, eps_root=0.0, weight_decay=0.0):
    return chain(
        scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )


class SophiaState(NamedTuple):
    count: Any
    mu: Any
    nu: Any
    hessian_fn_state: Any


def scale_by_sophia(
    b1=0.965,
    b2=0.99,
    eps=1e-8,
    gamma=0.01,
    clip_threshold=1.0,
    update_interval=10,
    hessian_diagonal_fn=None,
    mu_dtype=None,
):
    """optax.contrib's ``scale_by_sophia`` leaf by leaf: the update divides by the nu of the steps
    before; nu takes the estimator's output when the count *before* the step is a multiple of
    ``update_interval`` (the estimator is not called otherwise)."""

    def init(params):
        return SophiaState(
            np.int32(0), zeros_like(params, mu_dtype), zeros_like(params), hessian_diagonal_fn.init(params)
        )

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("params must be provided to sophia's update function.")
        count = safe_increment(state.count)
        hessian_step = int(state.count) % update_interval == 0
        hess_state = state.hessian_fn_state
        gl, tdef = tree_flatten(updates)
        hl = [None] * len(gl)
        if hessian_step:
            h, hess_state = hessian_diagonal_fn.update(updates, hess_state, params, **extra)
            hl = tree_flatten(h)[0]

        def leaf(g, m, v, hd):
            dt = np.result_type(g.dtype, m.dtype, v.dtype)
            mu = _c(1 - b1, dt) * g.astype(dt) + _c(b1, dt) * m.astype(dt)
            u = (mu / bias_correction_denominator(b1, count, dt)) / np.maximum(
                _c(gamma, dt) * v.astype(dt), _c(eps, dt)
            )
            if clip_threshold is not None:
                u = np.clip(u, -_c(clip_threshold, dt), _c(clip_threshold, dt))
            nu = v
            if hd is not None:  # the estimate in the leaf's dtype, as optax's
                nu = _c(1 - b2, dt) * np.asarray(hd, v.dtype).astype(dt) + _c(b2, dt) * v.astype(dt)
            return _arr(u, g.dtype), _arr(mu, m.dtype), _arr(nu, v.dtype)

        ml, vl = tree_flatten(state.mu)[0], tree_flatten(state.nu)[0]
        res = [leaf(g, m, v, hd) for g, m, v, hd in zip(gl, ml, vl, hl)]
        out, mu, nu = (tree_unflatten(tdef, [r[i] for r in res]) for i in range(3))
        return out, SophiaState(count, mu, nu, hess_state)

    return Transformation(init, update)


def sophia(
    learning_rate,
    b1=0.965,
    b2=0.99,
    eps=1e-8,
    weight_decay=1e-4,
    gamma=0.01,
    clip_threshold=1.0,
    update_interval=10,
    hessian_diagonal_fn=None,
):
    return chain(
        scale_by_sophia(b1, b2, eps, gamma, clip_threshold, update_interval, hessian_diagonal_fn),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )


def _scale_by_param_block(min_scale, rms):
    def leaf(g, p):
        wide = np.complex128 if np.iscomplexobj(p) else np.float64
        n = np.sqrt(np.sum(np.abs(p.astype(wide)) ** 2))
        if rms:
            with np.errstate(divide="ignore", invalid="ignore"):
                n = n / np.sqrt(p.size)
        n = min_scale if n <= min_scale else n
        return _arr(g.astype(np.result_type(g.dtype, np.float64)) * n, g.dtype)

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("needs params")
        return tree_map(leaf, updates, params), state

    return Transformation(lambda params: EmptyState(), update)


def scale_by_param_block_norm(min_scale=1e-3):
    return _scale_by_param_block(min_scale, rms=False)


def scale_by_param_block_rms(min_scale=1e-3):
    return _scale_by_param_block(min_scale, rms=True)
