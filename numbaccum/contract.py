"""The kernel contract: every operation a transformation may run on flat buffers, declared once.

A transformation gets the operations for its buffers from `numbaccum.backend.ops_for` and calls
them by name (``ops.ema_update_(...)``): a reader and an editor can follow a call to its
declaration here, and from here to its formula in `numbaccum.formulas`. Both backends implement
the contract through a *driver* (`numbaccum.cpu.driver`, `numbaccum.cuda.driver`): how to walk a
buffer, not what to compute. A trailing ``_`` means the operation writes some of its arguments;
which ones is part of the formula's declaration (so float16 staging is derived, not listed).

Every elementwise operation reads its first array through a pending `Factor` ``(x / div) *
mul``: a clip factor that rides on the next pass instead of costing a pass of its own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ONE", "Factor", "Ops"]


class Factor:
    """A pending scale ``(x / div) * mul`` of updates that are not written yet.

    Attributes:
        div, mul: host floats (``1.0, 1.0`` is no scale at all, and costs no division).
        device: on CUDA, a factor that never left the GPU: a dict compute dtype -> device array
            ``[div, mul]`` (then ``div`` and ``mul`` are unused).
    """

    __slots__ = ("div", "mul", "device")

    def __init__(self, div: float = 1.0, mul: float = 1.0, device: dict | None = None) -> None:
        self.div = div
        self.mul = mul
        self.device = device

    @property
    def is_one(self) -> bool:
        """True when the factor changes nothing (reads need no division)."""
        return self.device is None and self.div == 1.0 and self.mul == 1.0

    def __repr__(self) -> str:
        if self.device is not None:
            return "Factor(<on device>)"
        return f"Factor(div={self.div!r}, mul={self.mul!r})"


ONE = Factor()


class Ops:
    """The operations of one backend over its flat 1-D buffers (all of one size per call).

    Scalars may be Python numbers: the driver casts them to the call's compute dtype (the
    promoted dtype of its arrays), so a float32 buffer never runs a float64 variant by accident.
    """

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def __repr__(self) -> str:
        return f"Ops({self.driver.name})"

    # --- elementwise: one formula each (numbaccum.formulas) ----------------------------------

    def fill_(self, x: Any, value: float) -> None:
        """x = value."""
        _legacy("fill_", x, value)

    def scale_(self, out: Any, x: Any, factor: Factor) -> None:
        """out = factor(x) (``out`` may be ``x``; with `ONE` a copy)."""
        _legacy("scale_", out, x, *_df(factor))

    def add_scaled_(self, out: Any, x: Any, factor: Factor, y: Any, s: float) -> None:
        """out = factor(x) + s * y (``out`` may be ``x``)."""
        _legacy("add_scaled_", out, x, *_df(factor), y, s)

    def clip_(self, out: Any, x: Any, factor: Factor, max_delta: float) -> None:
        """out = clip(factor(x), -max_delta, max_delta); NaN stays NaN."""
        _legacy("clip_", out, x, *_df(factor), max_delta)

    def zero_nans_(self, out: Any, x: Any, factor: Factor) -> None:
        """out = 0 where factor(x) is NaN, else that value (inf is kept)."""
        _legacy("zero_nans_", out, x, *_df(factor))

    def trace_update_(self, trace: Any, g: Any, factor: Factor, decay: float, nesterov: bool, out: Any) -> None:
        """trace = g + decay * trace; out = trace, or g + decay * trace if nesterov."""
        _legacy("trace_update_", trace, g, *_df(factor), decay, nesterov, out)

    def ema_update_(
        self, ema: Any, g: Any, factor: Factor, one_minus_decay: float, decay: float, bias_correction: Any, out: Any
    ) -> None:
        """ema = (1 - decay) * g + decay * ema; out = ema / bias_correction."""
        _legacy("ema_update_", ema, g, *_df(factor), one_minus_decay, decay, bias_correction, out)

    def mean_accumulate_(self, acc: Any, g: Any, factor: Factor, count: int, fresh: bool) -> None:
        """acc = acc + (g - acc) / count (Welford), with acc read as 0 if ``fresh``."""
        _legacy("mean_accumulate_", acc, g, *_df(factor), count, fresh)

    def sum_accumulate_(self, acc: Any, g: Any, factor: Factor, fresh: bool) -> None:
        """acc = g + acc, with acc read as 0 if ``fresh``."""
        _legacy("sum_accumulate_", acc, g, *_df(factor), fresh)

    def adam_update_(
        self,
        mu: Any,
        nu: Any,
        g: Any,
        factor: Factor,
        b1: float,
        one_minus_b1: float,
        b2: float,
        one_minus_b2: float,
        bc1: Any,
        bc2: Any,
        eps: float,
        eps_root: float,
        out_mul: float,
        out: Any,
    ) -> None:
        """Adam's moments in place; out = ((mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps)) * out_mul."""
        args = (b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, eps, eps_root, out_mul)
        _legacy("adam_update_", mu, nu, g, *_df(factor), *args, out)

    def abs_ema_clip_(
        self, ema: Any, g: Any, factor: Factor, one_minus_decay: float, decay: float, init: float, fresh: bool, out: Any
    ) -> None:
        """ema = (1 - decay) * |g| + decay * (|g| * init if fresh else ema); out = clip(g, -ema, ema).
        A non-finite g leaves its ema element as it is."""
        _legacy("abs_ema_clip_", ema, g, *_df(factor), one_minus_decay, decay, init, fresh, out)

    def abs_ema_update_(
        self, ema: Any, g: Any, factor: Factor, one_minus_decay: float, decay: float, init: float, fresh: bool
    ) -> None:
        """ema = (1 - decay) * |g| + decay * (|g| * init if fresh else ema); non-finite g skipped."""
        _legacy("abs_ema_update_", ema, g, *_df(factor), one_minus_decay, decay, init, fresh)

    def clip_by_(self, out: Any, x: Any, factor: Factor, bound: Any) -> None:
        """out = clip(factor(x), -bound, bound) with a bound per element; NaN stays NaN."""
        _legacy("clip_by_", out, x, *_df(factor), bound)

    def growth_clip_(
        self,
        prev: Any,
        g: Any,
        factor: Factor,
        add: float,
        max_growth: float,
        min_value: float,
        max_decay: float,
        out: Any,
    ) -> None:
        """|out| <= min(|prev| + add, max_growth * max(|prev|, min_value)) with g's sign; prev
        tracks out (torchzero's ClipValueGrowth; see `numbaccum.formulas.growth_clip`)."""
        _legacy("growth_clip_", prev, g, *_df(factor), add, max_growth, min_value, max_decay, out)

    # --- per segment / per slice (one reduction engine) --------------------------------------
    # TRANSITIONAL: the reduction section is being rebuilt on one engine.

    def sumsq(self, x: Any) -> float:
        return _legacy("sumsq", x)

    def sumabs(self, x: Any) -> float:
        return _legacy("sumabs", x)

    def maxabs(self, x: Any) -> float:
        return _legacy("maxabs", x)

    def count_nonfinite(self, x: Any) -> int:
        return _legacy("count_nonfinite", x)

    def segment_sumsq(self, x: Any, offsets: Any) -> Any:
        return _legacy("segment_sumsq", x, offsets)

    def segment_sumabs(self, x: Any, offsets: Any) -> Any:
        return _legacy("segment_sumabs", x, offsets)

    def segment_maxabs(self, x: Any, offsets: Any) -> Any:
        return _legacy("segment_maxabs", x, offsets)

    def segment_nancount(self, x: Any, offsets: Any) -> Any:
        return _legacy("segment_nancount", x, offsets)

    def segment_divide_(self, out: Any, x: Any, factor: Factor, offsets: Any, factors: Any) -> None:
        _legacy("segment_divide_", out, x, *_df(factor), offsets, factors)

    def segment_ema_update_(
        self, ema: Any, g: Any, factor: Factor, offsets: Any, active: Any, one_minus_decay: float, decay: float
    ) -> None:
        _legacy("segment_ema_update_", ema, g, *_df(factor), offsets, active, one_minus_decay, decay)

    def sumsq_clip_factors_(self, sums: Any, x: Any, group: int, max_norm: float, fac32: Any, fac64: Any) -> None:
        _legacy("sumsq_clip_factors_", sums, x, group, max_norm, fac32, fac64)

    def slice_sumsq(self, x: Any, rows: Any, centers: Any) -> Any:
        return _legacy("slice_sumsq", x, rows, centers)

    def slice_sumabs(self, x: Any, rows: Any) -> Any:
        return _legacy("slice_sumabs", x, rows)

    def slice_sumpow(self, x: Any, rows: Any, p: float) -> Any:
        return _legacy("slice_sumpow", x, rows, p)

    def slice_sum(self, x: Any, rows: Any) -> Any:
        return _legacy("slice_sum", x, rows)

    def slice_nnz(self, x: Any, rows: Any) -> Any:
        return _legacy("slice_nnz", x, rows)

    def slice_maxabs(self, x: Any, rows: Any) -> Any:
        return _legacy("slice_maxabs", x, rows)

    def slice_minabs(self, x: Any, rows: Any) -> Any:
        return _legacy("slice_minabs", x, rows)

    def slice_apply_(self, out: Any, x: Any, rows: Any, centers: Any, factors: Any) -> None:
        _legacy("slice_apply_", out, x, rows, centers, factors)

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
    ) -> None:
        """out[k][j] = clamp((sum_b mult[k, b] * g[k][b, j] + std * noise[k][j]) / div, +-limit)."""
        _legacy("batch_weighted_sum_", out, g, offsets, out_offsets, mult, noise, std, div, limit)


def _df(factor: Factor) -> tuple[Any, Any]:
    """TRANSITIONAL: a Factor as the old kernels' ``div, mul`` arguments."""
    if factor.device is not None:
        return factor.device, None
    return factor.div, factor.mul


def _legacy(name: str, *args: Any) -> Any:
    """TRANSITIONAL: the old string dispatch, until the drivers implement the contract."""
    from . import backend

    return backend.call(name, *args)
