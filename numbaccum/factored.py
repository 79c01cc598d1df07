"""Second moments kept per axis, not per element: Adafactor's row and column means and SM3's
per-axis maxima (optax's ``factorized`` and ``scale_by_sm3``).

For a leaf whose two largest dimensions both have at least ``min_dim_size_to_factor`` elements,
`scale_by_factored_rms` keeps ``v_row`` (the mean of ``g^2 + eps`` over the largest dimension
``d0``) and ``v_col`` (over the second largest, ``d1``), two vectors where Adam keeps a matrix,
and scales ``g`` by ``(v_row / mean(v_row))^-1/2`` along one and ``v_col^-1/2`` along the other.
Every other leaf keeps a full second moment ``v``, as RMSProp does. Per dtype group, one update
is two segmented reductions (the row and the column sums of squares, over slice tables:
`numbaccum.tables`), the statistics and factors on the host (vectors the size of a matrix's rows
and columns: float64, NumPy, no loop over leaves), and one pass that scales the factored leaves
and updates and scales the unfactored ones (`numbaccum.contract.Ops.row_column_pass_`, whose
per-element formulas, `factored_element` and `rms_element`, are declared here).

`scale_by_sm3` keeps one statistic per index of each axis of a leaf. One pass reads each
element's statistics (the smallest of its axes'), writes its accumulator to a workspace and its
momentum and update (`numbaccum.contract.Ops.axes_pass_` of `sm3_element`, declared here); one
segmented max per axis number
then gives the new statistics.

The statistics (``v_row``, ``v_col``, SM3's ``mu``) live on the host, the per-element state
(``v``, ``nu``) where the params live.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ._bounded import Bounded
from ._checks import flag, integer, non_negative, real, real_or_schedule, scheduled, wrong_state
from .accumulation import ema
from .backend import (
    Reductions,
    prepare_axes,
    prepare_axis_max,
    prepare_axis_sumsq,
    prepare_divide,
    prepare_row_column,
)
from .base import NO_PARAMS_MSG, Stage, chain
from .clipping import clip_by_block_rms
from .contract import ONE
from .declared import check_decay, expect_state, holds, safe_increment
from .flat import FlatTree, layout_and_device
from .formulas import like, minimum
from .fuse import Host
from .layout import Layout, check_float_dtype
from .norms import _runs, scale_by_param_block_rms
from .protocol import GradientTransformationExtraArgs, state_class
from .scaling import ScalarOrSchedule, add_decayed_weights, scale, scale_by_learning_rate
from .tables import (
    FACTORED,
    UNFACTORED,
    AxesPass,
    AxisMaxima,
    AxisSums,
    AxisTable,
    FactorTable,
    RowColumnPass,
    Table,
    slice_table,
)
from .traits import LEAF
from .transaction import current
from .tree import tree_flatten, tree_unflatten
from .updates import ParamsRef, Spec, Updates

__all__ = ["FactoredState", "ScaleBySM3State", "adafactor", "scale_by_factored_rms", "scale_by_sm3", "sm3"]


@state_class
class FactoredState(NamedTuple):
    """The state of `scale_by_factored_rms` (optax's fields).

    Attributes:
        count: the number of updates so far (int32, saturating).
        v_row: per leaf, the row statistics of a factored leaf (its shape without its largest
            dimension), ``(1,)`` for the others: a host FlatTree in the leaves' dtypes.
        v_col: the column statistics (the shape without the second largest dimension), ``(1,)``
            for the others: a host FlatTree.
        v: the full second moment of an unfactored leaf, ``(1,)`` for a factored one: a FlatTree
            where the params live.
    """

    count: np.int32  # type: ignore[assignment]  # shadows tuple.count, as in optax
    v_row: FlatTree
    v_col: FlatTree
    v: FlatTree


def adafactor_decay_rate(i: Any, exponent: float = 0.8) -> np.float32:
    """Adafactor's second-moment decay at step ``i``: ``1 - (i + 1)^-exponent`` in float32."""
    t = np.float32(i + 1)
    return np.float32(1.0) - t ** np.float32(-exponent)


def _factored_dims(shape: tuple, factored: bool, min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """``(d1, d0)``: the second largest and the largest dimension of a leaf that is factored
    (both at least ``min_dim_size_to_factor``; optax's rule), None otherwise. An empty leaf is
    never factored here (its statistics would be empty; it keeps an empty ``v``)."""
    if not factored or len(shape) < 2 or math.prod(shape) == 0:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return int(order[-2]), int(order[-1])


class _Factoring(NamedTuple):
    """How one layout is factored: the state's layouts and, per dtype group, the tables."""

    dims: tuple  # per leaf: (d1, d0) or None
    v_row: Layout
    v_col: Layout
    v: Layout
    rows: tuple[AxisSums, ...]  # per group: a sum per v_row element (over d0)
    cols: tuple[AxisSums, ...]  # a sum per v_col element (over d1)
    row_len: tuple[np.ndarray, ...]  # per v_row element: n0 (1 for an unfactored leaf's)
    col_len: tuple[np.ndarray, ...]
    row_active: tuple[np.ndarray, ...]  # per v_row element: it belongs to a factored leaf
    col_active: tuple[np.ndarray, ...]
    row_means: tuple[Table, ...]  # on each v_row group: a slice per mean over d1
    row_means_len: tuple[np.ndarray, ...]
    passes: tuple[FactorTable, ...]
    any_factored: bool


_FACTORINGS = Bounded()


def _strides(shape: tuple) -> list[int]:
    out, s = [1] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = s
        s *= int(shape[d])
    return out


def _factoring(layout: Layout, factored: bool, min_dim: int) -> _Factoring:
    """The factoring of ``layout`` (cached per layout and rule)."""
    key = (layout, factored, min_dim)
    hit = _FACTORINGS.get(key)
    if hit is not None:
        return hit
    dims = tuple(_factored_dims(s, factored, min_dim) for s in layout.shapes)

    def shapes(which: int) -> list[tuple]:  # 0: v_row (without d0), 1: v_col (without d1), 2: v
        out = []
        for s, d in zip(layout.shapes, dims):
            if d is None:
                out.append(tuple(s) if which == 2 else (1,))
            else:
                out.append((1,) if which == 2 else tuple(np.delete(s, d[1] if which == 0 else d[0])))
        return out

    keys = layout.group_keys
    v_row, v_col, v = (Layout.get(layout.treedef, shapes(w), layout.dtypes, keys) for w in range(3))
    # Per group: v_row's and v_col's axis sums, their statistics' lengths K and whether a
    # factored leaf owns each (filled in pairs below); the means' slicing, lengths; the pass.
    rows: list[AxisSums] = []
    cols: list[AxisSums] = []
    row_len: list[np.ndarray] = []
    col_len: list[np.ndarray] = []
    row_act: list[np.ndarray] = []
    col_act: list[np.ndarray] = []
    means, means_len, passes = ([] for _ in range(3))
    for gi, members in enumerate(layout.groups):
        cut_m: list[tuple] = []
        meta, job_r, job_c = [], [], []
        for j, leaf in enumerate(members):
            shape, size, d = layout.shapes[leaf], layout.sizes[leaf], dims[leaf]
            base = int(layout.offsets[gi][j])
            rbase, cbase = int(v_row.offsets[gi][j]), int(v_col.offsets[gi][j])
            vbase = int(v.offsets[gi][j])
            if d is None:  # v_row's and v_col's (1,) are never read
                cut_m.append((rbase, [], [], False))
                meta.append((base, size, UNFACTORED, 1, 1, 1, 1, rbase, cbase, vbase))
                continue
            d1, d0 = d
            rshape = v_row.shapes[leaf]
            cut_m.append((rbase, *_runs(rshape, frozenset((d1 - 1 if d1 > d0 else d1,))), True))
            st = _strides(shape)
            meta.append((base, size, FACTORED, st[d0], shape[d0], st[d1], shape[d1], rbase, cbase, vbase))
            # the leaf as (A, K, B) around each summed axis: v_row's elements are its (a, b)
            job_r.append((base, size // (shape[d0] * st[d0]), shape[d0], st[d0], rbase))
            job_c.append((base, size // (shape[d1] * st[d1]), shape[d1], st[d1], cbase))
        for jobs, stats, sums, lens, act in (
            (job_r, v_row, rows, row_len, row_act),
            (job_c, v_col, cols, col_len, col_act),
        ):
            n = stats.group_sizes[gi]
            sums.append(AxisSums(np.array(jobs, np.int64), n))
            lens.append(np.ones(n))  # per statistic: the elements its sum has, K
            act.append(np.zeros(n, bool))  # whether a factored leaf owns it
            for _, A, K, B, o in jobs:
                lens[-1][o : o + A * B] = K
                act[-1][o : o + A * B] = True
        m = slice_table(cut_m)
        means.append(m)
        means_len.append(np.repeat(m.rows[:, 3], m.rows[:, 2]).astype(np.float64))  # SLEN per slice
        passes.append(FactorTable(np.array(meta, np.int64)))
    out = _Factoring(
        dims,
        v_row,
        v_col,
        v,
        tuple(rows),
        tuple(cols),
        tuple(row_len),
        tuple(col_len),
        tuple(row_act),
        tuple(col_act),
        tuple(means),
        tuple(means_len),
        tuple(passes),
        any(d is not None for d in dims),
    )
    return _FACTORINGS.put(key, out)


def _unfactored_share(layout: Layout, dims: tuple) -> float:
    """The share of a layout's elements in unfactored leaves (whose full ``v`` each step reads
    and writes), for `numbaccum.explain`."""
    total = sum(layout.sizes)
    return sum(n for n, d in zip(layout.sizes, dims) if d is None) / total if total else 0.0


# --- the per-element formulas of the passes (plain Python; both backends compile them) -----------


def factored_element(x, r, c):  # pragma: no cover - compiled by the backends
    """A factored leaf's update: ``g * r * c`` in float64 (``r``, ``c`` its row's and its
    column's factors), rounded once when stored."""
    return np.float64(x) * r * c


def rms_element(v, x, scalars):  # pragma: no cover - compiled by the backends
    """An unfactored leaf's element (optax's order): ``v = decay v + one_minus (x^2 + eps)``,
    and ``x`` scaled by that ``v``'s ``-1/2`` power as the buffer stores it (optax rounds it to
    the leaf dtype first; XLA's rsqrt, here a division by the square root, not a pow)."""
    decay, one_minus, eps = scalars
    w = decay * v + one_minus * (x * x + eps)
    return w, x / math.sqrt(like(v, w))


def sm3_element(x, m, nu, scalars):  # pragma: no cover - compiled by the backends
    """SM3's element (optax's order): ``a = c0 x^2 + c1 m`` (``m`` the smallest of the element's
    axis statistics), ``nu' = (1 - b1) x r + b1 nu`` with ``r = 1 / sqrt(a + eps)``, 0 where
    ``a <= 0`` (or NaN); returns ``(a, nu', nu')`` (the update is the momentum)."""
    c0, c1, eps, one_minus_b1, b1, zero, one = scalars
    a = c0 * (x * x) + c1 * m
    up = x * (one / math.sqrt(a + eps) if a > zero else zero)  # a NaN x stays NaN, as optax's
    n = one_minus_b1 * up + b1 * nu
    return a, n, n


_FACTORED_PASS = RowColumnPass(factored_element, rms_element)
_SM3_PASS = AxesPass(minimum, sm3_element)  # the smallest statistic, NaN if any is (jnp.minimum)


class _Stats:
    """One dtype group's row or column statistics (``stats``, a host buffer in the leaves'
    dtype), with what a step updates them from: their axis sums of squares, each statistic's
    length and whether a factored leaf owns it, and ``wide``, their float64 copy (exact:
    float64 holds every float32, float16 and bfloat16), a buffer of the declared part that
    the kept reductions read; ``slot``: the axis sums' in them."""

    __slots__ = ("active", "lens", "slot", "stats", "sums", "wide")

    def __init__(
        self, stats: np.ndarray, sums: AxisSums, lens: np.ndarray, active: np.ndarray, slot: Any
    ) -> None:
        self.stats, self.sums, self.lens, self.active, self.slot = stats, sums, lens, active, slot
        self.wide = np.empty(stats.size)


class _ScaleByFactoredRms(Stage):
    """`scale_by_factored_rms` (see the module docstring for its passes)."""

    scope = LEAF
    public_name = "scale_by_factored_rms"

    def __init__(
        self,
        factored: Any,
        decay_rate: Any,
        step_offset: Any,
        min_dim_size_to_factor: Any,
        epsilon: Any,
        decay_rate_fn: Any,
    ) -> None:
        self.factored = flag(factored, "factored")
        self.decay_rate = real(decay_rate, "decay_rate")
        self.step_offset = integer(step_offset, "step_offset", minimum=-(2**31), maximum=2**31 - 1)
        self.min_dim = integer(min_dim_size_to_factor, "min_dim_size_to_factor")
        self.epsilon = real(epsilon, "epsilon")
        if not callable(decay_rate_fn):
            raise TypeError(
                f"decay_rate_fn must be callable (step, decay_rate) -> float; got {decay_rate_fn!r}"
            )
        self.decay_rate_fn = decay_rate_fn

    def init(self, params: Any) -> FactoredState:
        layout, device = layout_and_device(params, "params")
        f = _factoring(layout, self.factored, self.min_dim)
        return FactoredState(
            np.int32(0), FlatTree.zeros(f.v_row), FlatTree.zeros(f.v_col), FlatTree.zeros(f.v, device=device)
        )

    def _decay(self, count: int) -> tuple[np.float64, np.float64]:
        """The step's decay and one minus it, checked (a user's ``decay_rate_fn`` may return
        anything). One minus a float32 decay (the default schedule's) is rounded to float32, as
        in optax."""
        value = self.decay_rate_fn(np.int64(count - self.step_offset), self.decay_rate)
        try:
            d = np.asarray(value)
            ok = d.shape == () and d.dtype.kind in "fiu"
        except Exception:  # noqa: BLE001 - anything that is not an array is the error below
            ok = False
        if not ok:
            raise TypeError(f"decay_rate_fn must return a real number; got {value!r}")
        t = np.float32 if d.dtype == np.float32 else np.float64
        return np.float64(d), np.float64(t(1) - t(d))

    def declare(self, spec: Spec, state: Any) -> Host:
        """The stage's `numbaccum.fuse.Host` over ``state``'s buffers (checked here: type,
        layouts, devices); the factoring and the per-group tables are the layout's, found once."""
        if not isinstance(state, FactoredState):
            raise wrong_state("FactoredState", state)
        f = _factoring(spec.layout, self.factored, self.min_dim)
        v = expect_state(state, FactoredState, "v", f.v, spec.device, renew=False)
        v_row = expect_state(state, FactoredState, "v_row", f.v_row, False, renew=False)
        v_col = expect_state(state, FactoredState, "v_col", f.v_col, False, renew=False)
        buffers = (("v", v.__dict__), ("v_row", v_row.__dict__), ("v_col", v_col.__dict__))
        eps, decay_of = self.epsilon, self._decay
        step = [np.float64(0.0), np.float64(0.0)]  # this step's decay and one minus it (tick's)
        # Per group: its buffers and tables in one tuple (one zip a step).
        groups = [
            (
                gi,
                v.groups[gi],
                _Stats(v_row.groups[gi], f.rows[gi], f.row_len[gi], f.row_active[gi], (gi, "rows")),
                _Stats(v_col.groups[gi], f.cols[gi], f.col_len[gi], f.col_active[gi], (gi, "cols")),
                f.row_means[gi],
                f.row_means_len[gi],
                f.passes[gi],
                np.empty(v_row.groups[gi].size),  # the row ratios
                bool(f.row_active[gi].any()),  # whether a leaf of the group is factored
            )
            for gi in range(len(spec.layout.groups))
        ]
        sums = Reductions()  # the axis sums, the ratios and the pass, kept for their buffers
        no_factors = np.zeros(0)

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not holds(state, FactoredState, buffers):
                return False
            if params is None:
                raise ValueError(NO_PARAMS_MSG)
            new_v = current(state.v, "v")
            new_row, new_col = current(state.v_row, "v_row"), current(state.v_col, "v_col")
            count = int(np.asarray(state.count))
            step[0], step[1] = decay_of(count)
            part.new_state = FactoredState(safe_increment(np.int32(count)), new_row, new_col, new_v)
            return True

        def run(u: Updates) -> tuple[Updates, FactoredState]:
            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            out = u.fresh()
            decay, one_minus = step
            for (gi, vg, rows, cols, means, means_len, table, ratio, factored), o, g in zip(
                groups, out.groups, u.flat.groups
            ):
                if factored:  # (a group without a factored leaf has no statistics to update)
                    for st in (rows, cols):  # in place, in their dtype, from g's sums of squares
                        st.wide[...] = st.stats
                        with np.errstate(all="ignore"):
                            sq = sums.call(st.slot, prepare_axis_sumsq, (g, st.sums))
                            new = step[0] * st.wide + step[1] * (sq / st.lens + eps)
                        st.stats[st.active] = new[st.active]
                        st.wide[...] = st.stats
                    # v_row over its mean along d1, slice by slice of the means' table
                    mean = sums.reduce(gi, "sum", rows.wide, means) / means_len
                    sums.call(gi, prepare_divide, (ratio, rows.wide, means), ONE, mean)
                    with np.errstate(all="ignore"):
                        rf, cf = ratio**-0.5, cols.wide**-0.5
                else:
                    rf = cf = no_factors
                scalars = (decay, one_minus, eps)
                sums.call(gi, prepare_row_column, (_FACTORED_PASS, o, g, vg, table), rf, cf, scalars)
            return Updates(out, True, scratch=u.scratch), part.new_state

        # Two segmented reductions (row and column sums of squares) where a leaf is factored,
        # then one pass that reads the updates and the unfactored leaves' v, writes both.
        full = _unfactored_share(spec.layout, f.dims)
        passes: tuple = (("kernel", "factored scale", 1.0 + full, 1.0 + full),)
        if f.any_factored:
            passes = (("reduction", "row sums of squares", 1.0, 0.0), ("reduction", "column sums of squares", 1.0, 0.0), *passes)
        part = Host(run, passes, self.public_name, tick)
        return part


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
    decay_rate_fn: Callable[[Any, float], Any] = adafactor_decay_rate,
) -> GradientTransformationExtraArgs:
    """Scales updates by a factored estimate of the gradient's root mean square (Adafactor).

    With ``b = decay_rate_fn(count - step_offset, decay_rate)`` (by default ``1 - (count +
    1)^-decay_rate``, so the first step keeps none of the zero initial state): for a leaf whose
    two largest dimensions ``d0 >= d1`` are both at least ``min_dim_size_to_factor``,

        v_row = b v_row + (1 - b) mean_d0(g^2 + eps)     (the shape without d0)
        v_col = b v_col + (1 - b) mean_d1(g^2 + eps)     (the shape without d1)
        u = g (v_row / mean_d1(v_row))^-1/2 v_col^-1/2   (each broadcast back)

    and for every other leaf ``v = b v + (1 - b) (g^2 + eps)``, ``u = g v^-1/2``. A matrix's
    state is two vectors. The statistics are stored in the leaf dtype, as optax's; the sums of
    squares accumulate in float64 (two segmented reductions per dtype group), the factors are
    computed in float64 on the host, and one pass scales every leaf. Needs ``params`` (optax's
    signature; only their shapes are read).

    Args:
        factored: whether to factor the second moments of the leaves that qualify.
        decay_rate: the second moments' decay parameter (the exponent of the default schedule).
        step_offset: subtracted from the step count before ``decay_rate_fn`` (fine-tuning from a
            step).
        min_dim_size_to_factor: a leaf is factored only if its two largest dimensions have at
            least this many elements.
        epsilon: added to the squared gradient.
        decay_rate_fn: ``(step, decay_rate) -> decay``, the schedule of the decay (the default
            is Adafactor's ``1 - (step + 1)^-decay_rate``, in float32).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``FactoredState(count, v_row, v_col,
        v)``.

    Raises:
        TypeError: a hyperparameter of the wrong type, ``decay_rate_fn`` not callable or
            returning something else than a real number; complex leaves (not supported yet).
        ValueError: a state of another layout; at an update, no ``params``.

    References:
        Shazeer and Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", ICML
        2018 (arXiv:1804.04235). optax.scale_by_factored_rms.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros((2, 3)), "b": np.zeros(3)}
        >>> tx = nba.scale_by_factored_rms(min_dim_size_to_factor=2)
        >>> state = tx.init(params)
        >>> state.v_row["w"].shape, state.v_col["w"].shape, state.v["w"].shape, state.v["b"].shape
        ((2,), (3,), (1,), (3,))
        >>> grads = {"w": np.array([[1.0, 2.0, 2.0], [2.0, 4.0, 4.0]]), "b": np.array([3.0, -3.0, 0.5])}
        >>> u, state = tx.update(grads, state, params)
        >>> u["w"].tolist()  # g^2 has rank one: its factored estimate is exact, u = g / |g|
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
        >>> np.round(u["b"], 6).tolist()  # an unfactored leaf: g / |g|
        [1.0, -1.0, 1.0]
    """
    return _ScaleByFactoredRms(
        factored, decay_rate, step_offset, min_dim_size_to_factor, epsilon, decay_rate_fn
    ).transformation()


def _named_schedule(schedule: Callable[[Any], Any], name: str) -> Callable[[Any], float]:
    def checked(count: Any) -> float:
        return scheduled(schedule, count, name)

    return checked


def adafactor(
    learning_rate: ScalarOrSchedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    dtype_momentum: Any = np.float32,
    weight_decay_rate: ScalarOrSchedule | None = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Any = None,
) -> GradientTransformationExtraArgs:
    """The Adafactor optimizer: Adam's scaling with a matrix's second moments kept as their row
    and column means, as optax chains it.

    ``chain(scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor,
    eps), clip_by_block_rms(clipping_threshold), scale_by_learning_rate(learning_rate,
    flip_sign=False), scale_by_param_block_rms(), ema(momentum, debias=False,
    accumulator_dtype=dtype_momentum), add_decayed_weights(weight_decay_rate,
    weight_decay_mask), scale(-1))``, each part only when its argument is given (the block RMS
    scaling when ``multiply_by_parameter_scale``): with the parameter scale, the learning rate is
    relative to each leaf's RMS.

    Args:
        learning_rate: a step size or a schedule; None leaves it out (the relative step of the
            parameter scale alone).
        min_dim_size_to_factor: as in `scale_by_factored_rms`.
        decay_rate: as in `scale_by_factored_rms`.
        decay_offset: its ``step_offset``.
        multiply_by_parameter_scale: scale each leaf's update by its param's RMS (at least 1e-3).
        clipping_threshold: clip each leaf's update to this RMS (None: no clipping).
        momentum: an EMA of the updates with this decay (None: none; it costs a full moment).
        dtype_momentum: the storage dtype of that EMA (None: the leaves' own).
        weight_decay_rate: decoupled weight decay (None: none), or a schedule.
        eps: `scale_by_factored_rms`'s ``epsilon``.
        factored: as in `scale_by_factored_rms`.
        weight_decay_mask: which leaves the weight decay applies to (a tree or a function of the
            params).

    Returns:
        A `GradientTransformationExtraArgs` (a `chain`); its state is the tuple of its parts'
        states.

    Raises:
        TypeError: a hyperparameter of the wrong type; complex leaves.
        ValueError: at an update, no ``params``.

    References:
        Shazeer and Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", ICML
        2018 (arXiv:1804.04235). optax.adafactor.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"x": np.array([1.0, 2.0, 3.0], np.float32)}
        >>> tx = nba.adafactor(learning_rate=0.003)
        >>> state = tx.init(params)
        >>> for _ in range(5):
        ...     grads = {"x": 2 * params["x"]}  # of f(x) = sum(x^2)
        ...     state = nba.step_(tx, grads, state, params)
        ...     print(f"{float(np.sum(params['x'] ** 2)):.2E}")
        1.39E+01
        1.38E+01
        1.38E+01
        1.37E+01
        1.36E+01
    """
    # Checked here, by the names the caller used (the parts name them otherwise).
    decay_offset = integer(decay_offset, "decay_offset", minimum=-(2**31), maximum=2**31 - 1)
    if clipping_threshold is not None:
        clipping_threshold = non_negative(clipping_threshold, "clipping_threshold")
    if momentum is not None:
        momentum = check_decay(momentum, "momentum")
        if dtype_momentum is not None:
            dtype_momentum = check_float_dtype(dtype_momentum, "dtype_momentum", complex=True)
    if weight_decay_rate is not None:
        weight_decay_rate = real_or_schedule(weight_decay_rate, "weight_decay_rate")
        if callable(weight_decay_rate):  # its values checked by the name the caller used
            weight_decay_rate = _named_schedule(weight_decay_rate, "weight_decay_rate")
    txs = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        txs.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        txs.append(scale_by_learning_rate(learning_rate, flip_sign=False))
    if flag(multiply_by_parameter_scale, "multiply_by_parameter_scale"):
        txs.append(scale_by_param_block_rms())
    if momentum is not None:
        txs.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        txs.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    txs.append(scale(-1.0))
    return chain(*txs)


# --- SM3: one statistic per index of each axis ---------------------------------------------------


@state_class
class ScaleBySM3State(NamedTuple):
    """The state of `scale_by_sm3` (optax's fields).

    Attributes:
        mu: per leaf, a list of one vector per axis (the axis's extent, the leaf's dtype): the
            largest accumulator seen along it; a host FlatTree (a 0-d leaf has one vector of
            one element).
        nu: the momentum of the updates, a FlatTree of the params' layout.
    """

    mu: FlatTree
    nu: FlatTree


class _Axes(NamedTuple):
    """SM3's view of one layout: ``mu``'s layout and, per dtype group, its pass and its maxima."""

    mu: Layout
    mu_group: tuple[int, ...]  # per params group: its group in mu's layout
    passes: tuple[AxisTable, ...]
    maxima: tuple[AxisMaxima, ...]  # per group: the accumulators' maxima into its mu buffer


_AXES = Bounded()


def _axes_of(layout: Layout) -> _Axes:
    """SM3's tables for ``layout`` (cached)."""
    hit = _AXES.get(layout)
    if hit is not None:
        return hit
    shapes = [tuple(s) or (1,) for s in layout.shapes]  # a 0-d leaf counts as shape (1,)
    per_leaf = [[np.zeros(0)] * len(s) for s in shapes]
    _, td = tree_flatten(tree_unflatten(layout.treedef, per_leaf))
    mu_shapes = [(e,) for s in shapes for e in s]
    mu_dtypes = [layout.dtypes[k] for k, s in enumerate(shapes) for _ in s]
    mu = Layout.get(td, mu_shapes, mu_dtypes)
    first_mu = np.cumsum([0] + [len(s) for s in shapes])  # each leaf's first mu leaf
    mu_group = tuple(mu.group_dtypes.index(d) for d in layout.group_dtypes)
    passes, maxima = [], []
    for gi, members in enumerate(layout.groups):
        meta: list[tuple] = []
        axes: list[tuple] = []
        jobs = []
        for j, leaf in enumerate(members):
            shape, size, base = shapes[leaf], layout.sizes[leaf], int(layout.offsets[gi][j])
            meta.append((base, size, len(shape), len(axes)))
            st = _strides(shape)
            for i, extent in enumerate(shape):
                direct = extent == size  # the other axes have extent 1: each element its own max
                mbase = mu.leaf_start[first_mu[leaf] + i]
                axes.append((extent, st[i], mbase, int(direct and size > 0)))
                if size and not direct:  # the leaf as (A, K, B) around axis i, K kept
                    jobs.append((base, size // (extent * st[i]), extent, st[i], mbase))
        passes.append(AxisTable(np.array(meta, np.int64), np.array(axes, np.int64)))
        maxima.append(AxisMaxima(np.array(jobs, np.int64)))
    out = _Axes(mu, mu_group, tuple(passes), tuple(maxima))
    return _AXES.put(layout, out)


class _ScaleBySM3(Stage):
    """`scale_by_sm3`: one pass (the accumulators into a workspace, the momentum, the updates,
    and the statistics along an axis that is a leaf's only one, such as a vector's), then per
    axis number one segmented max over the accumulators, into ``mu`` on the host."""

    scope = LEAF
    public_name = "scale_by_sm3"

    def __init__(self, b1: Any, b2: Any, eps: Any) -> None:
        self.b1, self.b2, self.eps = check_decay(b1, "b1"), check_decay(b2, "b2"), non_negative(eps, "eps")

    def init(self, params: Any) -> ScaleBySM3State:
        layout, device = layout_and_device(params, "params")
        return ScaleBySM3State(FlatTree.zeros(_axes_of(layout).mu), FlatTree.zeros(layout, device=device))

    def owner(self, state: Any) -> FlatTree | None:
        ok = isinstance(state, ScaleBySM3State) and isinstance(state.nu, FlatTree)
        return state.nu if ok else None

    def declare(self, spec: Spec, state: Any) -> Host:
        """The stage's `numbaccum.fuse.Host` over ``state``'s buffers (checked here); the axes'
        tables are the layout's, found once."""
        ax = _axes_of(spec.layout)
        nu = expect_state(state, ScaleBySM3State, "nu", spec, renew=False)
        mu = expect_state(state, ScaleBySM3State, "mu", ax.mu, False, renew=False)
        buffers = (("nu", nu.__dict__), ("mu", mu.__dict__))
        b1 = self.b1
        c0, c1 = (1.0 - self.b2 if self.b2 != 1.0 else 1.0), self.b2  # optax's coefficients
        scalars = (c0, c1, self.eps, 1.0 - b1, b1, 0.0, 1.0)  # `sm3_element`'s
        # Per group: its momentum, statistics and tables in one tuple (one zip a step).
        mus, maxima = [mu.groups[g] for g in ax.mu_group], ax.maxima
        # (a group whose leaves all have one axis has no maxima to take: the pass writes mu)
        groups = [
            (gi, n, mus[gi], ax.passes[gi], maxima[gi], maxima[gi].jobs.size > 0)
            for gi, n in enumerate(nu.groups)
        ]
        sums = Reductions()  # the pass and the maxima, kept for their buffers

        def tick(state: Any, params: ParamsRef | None, extra: dict) -> bool:
            if not holds(state, ScaleBySM3State, buffers):
                return False
            new_nu = current(state.nu, "nu")
            part.new_state = ScaleBySM3State(current(state.mu, "mu"), new_nu)
            return True

        def run(u: Updates) -> tuple[Updates, ScaleBySM3State]:
            u = u if u.factor is ONE else u.settled()  # (inline: nothing pending, the common case)
            out, acc = u.fresh(), nu.workspace("accumulators")
            for (gi, n, m, table, axes, some), o, g, a in zip(groups, out.groups, u.flat.groups, acc.groups):
                sums.call(gi, prepare_axes, (_SM3_PASS, o, g, n, a, table, m), scalars)
                if some:
                    sums.call(gi, prepare_axis_max, (m, a, axes))
            return Updates(out, True, scratch=u.scratch), part.new_state

        # One pass (reads the updates and nu; writes the updates, nu and the accumulators), then
        # the segmented maxima of the accumulators (per axis number) into mu on the host.
        passes = (("kernel", "accumulators, momentum", 2.0, 3.0), ("reduction", "axis maxima", 1.0, 0.0))
        part = Host(run, passes, self.public_name, tick)
        return part


def scale_by_sm3(b1: float = 0.9, b2: float = 1.0, eps: float = 1e-8) -> GradientTransformationExtraArgs:
    """Scales updates by SM3's memory-efficient second moments: one statistic per index of each
    axis of a leaf, where Adagrad keeps one per element.

    Per element, with ``mu_i`` the statistics along axis ``i`` at the element's index (a 1-d
    leaf's single axis holds one per element, so it is Adagrad):

        a = c0 g^2 + b2 min_i mu_i          (c0 = 1 - b2, or 1 when b2 = 1)
        nu = (1 - b1) g r + b1 nu           (r = 1 / sqrt(a + eps), 0 where a <= 0 or a is NaN)
        u = nu
        mu_i = the max of a over the other axes

    One pass computes ``a`` (into a workspace), ``nu`` and ``u``; one segmented max per axis
    number brings the new ``mu`` to the host (vectors the size of the axes). Stateful, real
    leaves only (as optax's).

    Args:
        b1: the momentum's decay.
        b2: the second moments' decay (1: they only accumulate, as Adagrad's).
        eps: added under the square root (``>= 0``).

    Returns:
        A `GradientTransformationExtraArgs`; its state is ``ScaleBySM3State(mu, nu)``.

    Raises:
        TypeError: a hyperparameter that is not a real number; complex leaves.
        ValueError: ``b1`` or ``b2`` outside [0, 1], a negative ``eps``; a state of another
            layout.

    References:
        Anil et al., "Memory-Efficient Adaptive Optimization", NeurIPS 2019 (arXiv:1901.11150).
        optax.scale_by_sm3.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros((2, 3)), "b": np.zeros(3)}
        >>> tx = nba.scale_by_sm3(b1=0.0)
        >>> state = tx.init(params)
        >>> [v.shape for v in state.mu["w"]], [v.shape for v in state.mu["b"]]
        ([(2,), (3,)], [(3,)])
        >>> grads = {"w": np.array([[1.0, 2.0, -2.0], [2.0, 4.0, 1.0]]), "b": np.array([3.0, -4.0, 0.0])}
        >>> u, state = tx.update(grads, state, params)
        >>> np.round(u["b"], 6).tolist()  # the first step: g / |g| (0 where g = 0)
        [1.0, -1.0, 0.0]
        >>> state.mu["w"][0].tolist(), state.mu["w"][1].tolist()  # max of g^2 along each axis
        ([4.0, 16.0], [4.0, 16.0, 4.0])
    """
    return _ScaleBySM3(b1, b2, eps).transformation()


def sm3(learning_rate: float, momentum: float = 0.9) -> GradientTransformationExtraArgs:
    """The SM3 optimizer: ``chain(scale_by_sm3(momentum), scale(-learning_rate))``, Adagrad's
    adaptivity with one statistic per index of each axis (a matrix's state is a row and a column
    vector, plus the momentum).

    Args:
        learning_rate: the step size (a number, as optax's).
        momentum: `scale_by_sm3`'s ``b1``.

    Returns:
        A `GradientTransformationExtraArgs` (a `chain`).

    Raises:
        TypeError: a hyperparameter that is not a real number; complex leaves.
        ValueError: ``momentum`` outside [0, 1].

    References:
        Anil et al., "Memory-Efficient Adaptive Optimization", NeurIPS 2019 (arXiv:1901.11150).
        optax.sm3.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"x": np.array([1.0, 2.0, 3.0], np.float32)}
        >>> tx = nba.sm3(learning_rate=0.003)
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     grads = {"x": 2 * params["x"]}  # of f(x) = sum(x^2)
        ...     state = nba.step_(tx, grads, state, params)
        ...     print(f"{float(np.sum(params['x'] ** 2)):.4f}")
        13.9964
        13.9906
        13.9833
    """
    momentum = check_decay(momentum, "momentum")  # named as the caller named it
    return chain(scale_by_sm3(momentum), scale(-real(learning_rate, "learning_rate")))
