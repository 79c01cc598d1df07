"""The kernel contract: every operation a transformation may run on flat buffers, declared once.

A transformation gets the operations for its buffers from `numbaccum.backend.ops_for` and calls
them by name (``ops.zero_nans_(...)``): a reader and an editor can follow a call to its
declaration here, and from here to its formula in `numbaccum.formulas`. Both backends implement
the contract through three modules with the same primitives (`BACKEND`): a *driver* that
compiles the formulas (`numbaccum.cpu.driver`, `numbaccum.cuda.driver`: how to walk a buffer, not
what to compute), the one reduction engine over the tables of `numbaccum.tables` (``reduce``),
and the per-example weighted sum (``per_example``). A trailing ``_`` means the operation writes
some of its arguments; which ones is part of the formula's declaration (so float16 staging is
derived, not listed).

Every elementwise operation reads its first array through a pending `Factor` ``(x / div) *
mul``: a clip factor that rides on the next pass instead of costing a pass of its own.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import formulas as F
from .layout import real_dtype
from .tables import as_table, segments, whole

__all__ = ["BACKEND", "ONE", "Factor", "Ops", "cast_scalars", "may_rescue"]

# What each backend package provides, module by module (tests/test_contract.py checks that
# numbaccum.cpu and numbaccum.cuda both define every primitive, with the same parameters).
BACKEND: dict[str, tuple[str, ...]] = {
    "driver": ("map_",),
    "reduce": (
        "reduce",
        "apply_",
        "divide_",
        "ema_update_",
        "global_norm_finish_",
        "rescale_",
        "dot",
        "axis_sumsq",
        "axis_max_",
        "row_column_pass_",
        "axes_pass_",
    ),
    "per_example": ("batch_weighted_sum_",),
}


class Factor:
    """A pending scale ``(x / div) * mul`` of updates that are not written yet.

    Attributes:
        div, mul: host floats (``1.0, 1.0`` is no scale at all, and costs no division). With
            ``cast=True`` they are never rebalanced (`balanced`): each kernel casts them to its
            compute dtype as they are, as optax's ``step_size * g`` does.
        device: on CUDA, a factor that never left the GPU: a dict compute dtype -> device array
            ``[div, mul]`` (then ``div`` and ``mul`` are unused).
        is_one: True when the factor changes nothing (reads need no division).
    """

    __slots__ = ("div", "mul", "device", "is_one")

    def __init__(
        self, div: float = 1.0, mul: float = 1.0, device: dict | None = None, *, cast: bool = False
    ) -> None:
        # Computed in float64 and cast to the buffer dtype by the kernels: a pair outside
        # float32's range is first scaled by a power of two (`numbaccum.formulas.balanced`),
        # unless ``cast``: a step size that optax casts to the leaf's dtype before it multiplies
        # (``scale``, a learning rate) is cast as it is, to a subnormal, 0 or inf as optax's.
        if not cast and not (_LO < abs(div) < _HI and _LO < abs(mul) < _HI) and device is None:
            div, mul = F.balanced(float(div), float(mul))
        self.div = div
        self.mul = mul
        self.device = device
        # True when the factor changes nothing (reads need no division); asked every step.
        self.is_one = device is None and div == 1.0 and mul == 1.0

    def __repr__(self) -> str:
        if self.device is not None:
            return "Factor(<on device>)"
        return f"Factor(div={self.div!r}, mul={self.mul!r})"


_LO, _HI = 2.0**-99, 2.0**99  # inside: `balanced` changes nothing (the common case, one test)
ONE = Factor()


def cast_scalars(values: Any, t: type) -> list:
    """``values`` as scalars of the compute type ``t`` (bools and uint32 words kept: a noise
    key's), as a kernel call takes them. A Python float's cast is remembered (a step's constants
    are cast once, not every step: a small tree's step costs microseconds); +-0 are kept apart
    (they compare equal)."""
    memo = _CASTS.get(t)
    if memo is None or len(memo) > 4096:  # bounded: a schedule may give a new value every step
        memo = _CASTS[t] = {}
    out = []
    for v in values:
        tv = type(v)
        if tv is t or tv is bool or tv is np.bool_ or tv is np.uint32:  # a kept plan's tick cast most already
            out.append(v)
        elif tv is float:
            key = v if v else "-0" if math.copysign(1.0, v) < 0 else "+0"
            c = memo.get(key)
            if c is None:
                c = memo[key] = t(v)
            out.append(c)
        else:
            out.append(t(v))
    return out


_CASTS: dict[type, dict[Any, Any]] = {}  # per type, float (or "+0", "-0") -> its cast


class Ops:
    """The operations of one backend over its flat 1-D buffers (all of one size per call).

    Scalars may be Python numbers: the driver casts them to the call's compute dtype (the
    promoted dtype of its arrays), so a float32 buffer never runs a float64 variant by accident.
    """

    def __init__(self, driver: Any, reduce: Any, per_example: Any) -> None:
        self.driver = driver  # compiles and runs the formulas: map_
        # the reduction engine: reduce, apply_, divide_, ema_update_, global_norm_finish_, rescale_
        self.reduce = reduce
        self.per_example = per_example  # batch_weighted_sum_

    def __repr__(self) -> str:
        return f"Ops({self.driver.NAME})"

    # --- elementwise: one formula each (numbaccum.formulas) ----------------------------------

    def fill_(self, x: Any, value: float) -> None:
        """x = value."""
        self.driver.map_(F.fill, ONE, (x,), (value,))

    def scale_(self, out: Any, x: Any, factor: Factor) -> None:
        """out = factor(x) (``out`` may be ``x``; with `ONE` a copy)."""
        self.driver.map_(F.scale, factor, (x, out), ())

    def add_scaled_(self, out: Any, x: Any, factor: Factor, y: Any, s: float) -> None:
        """out = factor(x) + s * y (``out`` may be ``x``)."""
        self.driver.map_(F.add_scaled, factor, (x, y, out), (s,))

    def zero_nans_(self, out: Any, x: Any, factor: Factor) -> None:
        """out = 0 where factor(x) is NaN, else that value (inf is kept)."""
        self.driver.map_(F.zero_nans, factor, (x, out), ())

    def mean_accumulate_(self, acc: Any, g: Any, factor: Factor, count: int, fresh: bool) -> None:
        """acc = acc + (g - acc) / count (Welford), with acc read as 0 if ``fresh``."""
        self.driver.map_(F.mean_accumulate, factor, (acc, g), (count, fresh))

    def sum_accumulate_(self, acc: Any, g: Any, factor: Factor, fresh: bool) -> None:
        """acc = g + acc, with acc read as 0 if ``fresh``."""
        self.driver.map_(F.sum_accumulate, factor, (acc, g), (fresh,))

    def abs_ema_update_(
        self, ema: Any, g: Any, factor: Factor, one_minus_decay: float, decay: float, init: float, fresh: bool
    ) -> None:
        """ema = (1 - decay) * |g| + decay * (|g| * init if fresh else ema); non-finite g skipped."""
        self.driver.map_(F.abs_ema, factor, (ema, g), (one_minus_decay, decay, init, fresh))

    def clip_by_(self, out: Any, x: Any, factor: Factor, bound: Any) -> None:
        """out = clip(factor(x), -bound, bound) with a bound per element; NaN stays NaN."""
        self.driver.map_(F.clip_by, factor, (x, bound, out), ())

    # --- reductions: one engine over slice tables (numbaccum.tables) --------------------------
    # Whole buffer, per leaf, per slice and per example are all reductions over the slices of a
    # table (a `numbaccum.tables.Table`, or a raw table array): float64 partials over the
    # table's fixed work items, folded per slice in item order. Results are float64 host arrays,
    # one value per slice in the table's order (on CUDA: one synchronisation). The same elements
    # give the same bits whichever table holds them and whatever the thread count.

    def slice_sumsq(self, x: Any, table: Any, centers: Any = None) -> np.ndarray:
        """Per slice ``s``: sum((x - centers[s]) ** 2) (``centers`` None or empty: sum(x ** 2))."""
        if centers is not None and np.size(centers):
            return self.reduce.reduce("csumsq", x, as_table(table), centers)
        return self.reduce.reduce("sumsq", x, as_table(table))

    def slice_sumsq_scaled(self, x: Any, table: Any, scales: Any) -> np.ndarray:
        """Per slice ``s``: sum((x * scales[s]) ** 2) (``scales`` powers of two: the rescue of an
        overflowed or underflowed sum of squares, see `numbaccum.backend.slice_sumsq`)."""
        return self.reduce.reduce("ssumsq", x, as_table(table), scales)

    def slice_sumabs(self, x: Any, table: Any) -> np.ndarray:
        """Per slice: sum(|x|)."""
        return self.reduce.reduce("sumabs", x, as_table(table))

    def slice_sumpow(self, x: Any, table: Any, p: float) -> np.ndarray:
        """Per slice: sum(|x| ** p) (|0| ** p is inf for a negative p)."""
        return self.reduce.reduce("sumpow", x, as_table(table), None, p)

    def slice_sum(self, x: Any, table: Any) -> np.ndarray:
        """Per slice: sum(x) (signed; complex128 for a complex x, its parts summed apart)."""
        return self.reduce.reduce("sum", x, as_table(table))

    def slice_nnz(self, x: Any, table: Any) -> np.ndarray:
        """Per slice: the number of non-zero elements (NaN counts)."""
        return self.reduce.reduce("nnz", x, as_table(table))

    def slice_nancount(self, x: Any, table: Any) -> np.ndarray:
        """Per slice: the number of NaN elements."""
        return self.reduce.reduce("nancount", x, as_table(table))

    def slice_nonfinite(self, x: Any, table: Any) -> np.ndarray:
        """Per slice: the number of NaN and +-inf elements."""
        return self.reduce.reduce("nonfinite", x, as_table(table))

    def slice_maxabs(self, x: Any, table: Any) -> np.ndarray:
        """Per slice: max(|x|) (0 if empty, NaN if any element is NaN)."""
        return self.reduce.reduce("maxabs", x, as_table(table))

    def slice_minabs(self, x: Any, table: Any) -> np.ndarray:
        """Per slice: min(|x|) (+inf if empty, NaN if any element is NaN)."""
        return self.reduce.reduce("minabs", x, as_table(table))

    def slice_apply_(self, out: Any, x: Any, table: Any, centers: Any, factors: Any) -> None:
        """out = (x - centers[s]) * factors[s] over every slice ``s`` (empty ``centers``: 0;
        empty ``factors``: 1), in float64. Inactive rows are copied (skipped when out is x)."""
        self.reduce.apply_(out, x, as_table(table), _values(centers), _values(factors))

    def slice_divide_(self, out: Any, x: Any, factor: Factor, table: Any, divisors: Any) -> None:
        """out = factor(x) / divisors[s] over every slice ``s``, in the compute dtype."""
        self.reduce.divide_(out, x, factor, as_table(table), divisors)

    def slice_ema_update_(
        self, ema: Any, g: Any, factor: Factor, table: Any, active: Any, one_minus_decay: float, decay: float
    ) -> None:
        """ema = (1 - decay) * factor(g) + decay * ema over each slice ``s`` with ``active[s]``;
        the other slices are left as they are (`numbaccum.formulas.ema`)."""
        self.reduce.ema_update_(ema, g, factor, as_table(table), active, one_minus_decay, decay)

    def global_norm_finish_(
        self,
        leaf_sums: Any,
        x: Any,
        table: Any,
        members: Any,
        last: bool,
        finish: Any,
        scalars: tuple,
        out32: Any,
        out64: Any,
    ) -> None:
        """``leaf_sums`` holds 3 float64 per leaf, ``[plain | rescued | scale]``: sum(x ** 2) per
        slice of ``table`` (the group's leaves) at ``members``, and the group's rescued sums and
        scale where a float64 group's plain total `numbaccum.tables.needs_scaling` (else the
        plain sums and 1). Called once per dtype group, the last with ``last``: then the global
        L2 norm `numbaccum.tables.rescued_norm` (the bits of `numbaccum.global_norm`) goes
        to ``finish(norm, scalars)`` (``scalars`` the tuple given, as float64), a plain function
        returning a tuple of floats (`numbaccum.formulas`' kind, compiled by the backend; a
        tuple, not ``*scalars``: CUDA inlines no call with ``*args``; clip_by_global_norm's is
        `numbaccum.formulas.clip_finish`), whose values are written to ``out32`` and ``out64``
        (float32 and float64, as many as each holds). On CUDA one launch per group and no
        synchronisation (device arrays): the norm never leaves the device."""
        f64 = tuple(np.float64(v) for v in scalars)
        self.reduce.global_norm_finish_(
            leaf_sums, x, as_table(table), members, last, finish, f64, out32, out64
        )

    def slice_rescale_(
        self,
        out: Any,
        x: Any,
        table: Any,
        p: float,
        max_norm: float = float("inf"),
        min_norm: float = 0.0,
        norm_value: float = float("nan"),
    ) -> bool:
        """out = x * (mul / div) over every slice ``s``, ``(div, mul)`` the norm family's
        `numbaccum.tables.norm_pair` of the slice's p-norm (p > 0; `numbaccum.tables.pnorm_factor`):
        clip_norm's and normalize's scaling, the factors computed where the data lives (on CUDA
        three launches and no synchronisation). A slice whose p-norm overflows (or, for p = 2 in
        float64, may have underflowed) is measured again scaled by a power of two. Returns whether
        ``out`` was written: the host returns False when every factor is 1, and the caller keeps
        ``x``; CUDA always writes it."""
        return bool(
            self.reduce.rescale_(out, x, as_table(table), p, may_rescue(p, x), max_norm, min_norm, norm_value)
        )

    # Shorthands: a whole buffer is one slice, ``offsets`` one contiguous slice per segment.

    def sumsq(self, x: Any) -> float:
        """sum(x ** 2) in float64."""
        return float(self.slice_sumsq(x, whole(x.size))[0])

    def sumabs(self, x: Any) -> float:
        """sum(|x|) in float64."""
        return float(self.slice_sumabs(x, whole(x.size))[0])

    def maxabs(self, x: Any) -> float:
        """max(|x|) (0 for an empty buffer, NaN if any element is NaN)."""
        return float(self.slice_maxabs(x, whole(x.size))[0])

    def count_nonfinite(self, x: Any) -> int:
        """Number of NaN and +-inf elements."""
        return int(self.slice_nonfinite(x, whole(x.size))[0])

    def dot(self, x: Any, y: Any) -> float:
        """``sum(x * y)`` in float64 (complex: the real part of ``vdot(x, y)``), in a fixed
        order."""
        return float(self.reduce.dot(x, y))

    def axis_sumsq(self, x: Any, sums: Any) -> np.ndarray:
        """Sums of squares along one axis of leaves (``sums`` a `numbaccum.tables.AxisSums`):
        float64 on the host, each sum in a fixed order (0 where no job writes)."""
        return self.reduce.axis_sumsq(x, sums)

    def axis_max_(self, out: Any, x: Any, maxima: Any) -> None:
        """Maxima over all axes but one of leaves (``maxima`` a `numbaccum.tables.AxisMaxima`),
        written to the host array ``out`` at ``maxima.where`` (NaN if any element is NaN)."""
        self.reduce.axis_max_(out, x, maxima)

    def row_column_pass_(
        self, decl: Any, out: Any, g: Any, v: Any, table: Any, rf: Any, cf: Any, scalars: tuple
    ) -> None:
        """A pass over a dtype group (``table`` a `numbaccum.tables.FactorTable`) computing the
        formulas of ``decl`` (a `numbaccum.tables.RowColumnPass`): a ``FACTORED`` leaf's element
        ``out = decl.scaled(g, rf[row], cf[col])`` (host float64 statistics at the table's row
        and column indices), any other leaf's ``(v, out) = decl.full(v, g, scalars)`` over the
        group's state ``v``, in the compute dtype (``scalars`` cast to it)."""
        self.reduce.row_column_pass_(decl, out, g, v, table, rf, cf, scalars)

    def axes_pass_(
        self, decl: Any, out: Any, g: Any, nu: Any, acc: Any, table: Any, mu: Any, scalars: tuple
    ) -> None:
        """A pass over a dtype group (``table`` a `numbaccum.tables.AxisTable`, ``mu`` the
        group's axis statistics on the host) computing the formulas of ``decl`` (a
        `numbaccum.tables.AxesPass`): per element, its statistics along its axes folded by
        ``decl.fold`` into ``m``, then ``(acc, nu, out) = decl.element(g, m, nu, scalars)`` in
        the compute dtype (``scalars`` cast to it); a ``direct`` axis's statistic becomes the
        element's ``acc``."""
        self.reduce.axes_pass_(decl, out, g, nu, acc, table, mu, scalars)

    def segment_sumsq(self, x: Any, offsets: Any) -> np.ndarray:
        """Per segment ``[offsets[s], offsets[s + 1])``: sum(x ** 2)."""
        return self.slice_sumsq(x, segments(offsets))

    def segment_sumabs(self, x: Any, offsets: Any) -> np.ndarray:
        """Per segment: sum(|x|)."""
        return self.slice_sumabs(x, segments(offsets))

    def segment_maxabs(self, x: Any, offsets: Any) -> np.ndarray:
        """Per segment: max(|x|)."""
        return self.slice_maxabs(x, segments(offsets))

    def segment_nancount(self, x: Any, offsets: Any) -> np.ndarray:
        """Per segment: the number of NaN elements."""
        return self.slice_nancount(x, segments(offsets))

    def segment_nonfinite(self, x: Any, offsets: Any) -> np.ndarray:
        """Per segment: the number of NaN and +-inf elements."""
        return self.slice_nonfinite(x, segments(offsets))

    def segment_divide_(self, out: Any, x: Any, factor: Factor, offsets: Any, factors: Any) -> None:
        """out = factor(x) / factors[s] over each segment ``s`` (a per-leaf divisor)."""
        self.slice_divide_(out, x, factor, segments(offsets), factors)

    def segment_ema_update_(
        self,
        ema: Any,
        g: Any,
        factor: Factor,
        offsets: Any,
        active: Any,
        one_minus_decay: float,
        decay: float,
    ) -> None:
        """ema = (1 - decay) * factor(g) + decay * ema over each segment with ``active[s]``."""
        self.slice_ema_update_(ema, g, factor, segments(offsets), active, one_minus_decay, decay)

    # --- per example (DP-SGD) ----------------------------------------------------------------

    def batch_weighted_sum_(
        self,
        out: Any,
        g: Any,
        offsets: Any,
        out_offsets: Any,
        mult: Any,
        noise: Any,
        std: float,
        div: float,
        limit: float,
        init: Any = None,
    ) -> None:
        """out[k][j] = clamp((init[k][j] + sum_b mult[k, b] * g[k][b, j] + std * noise[k][j]) / div,
        +-limit), the sum from ``init`` (an earlier sum: DP accumulation) or from 0 when None."""
        # float64 scalars: the sums are float64 (``mult`` is), and so is the division by ``div``.
        f = np.float64
        start = _NO_INIT if init is None else init
        self.per_example.batch_weighted_sum_(
            out, g, offsets, out_offsets, mult, noise, f(std), f(div), f(limit), start, init is not None
        )


def may_rescue(p: float, x: Any) -> bool:
    """Whether `Ops.slice_rescale_` of order ``p`` over buffer ``x`` may measure a slice again
    scaled: squares in float64 leave its range only from float64 parts (a float32 or complex64
    element's square cannot), other finite orders from any buffer."""
    return p != float("inf") and (p != 2.0 or real_dtype(np.dtype(x.dtype)) == np.float64)


def _values(v: Any) -> Any:
    """A per-slice argument that may be absent: None becomes an empty float64 array."""
    return _NO_VALUES if v is None else v


_NO_VALUES = np.zeros(0, np.float64)
_NO_INIT = np.zeros(1, np.float64)  # batch_weighted_sum_'s init when the sum starts from 0
