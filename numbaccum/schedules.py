"""Learning-rate schedules: plain functions of the step count, with optax's names and formulas.

Each factory validates its arguments when called (TypeError or ValueError naming the argument)
and returns a function ``schedule(count) -> float``. ``count`` is a Python or NumPy integer (the
``count`` of a state is a NumPy int32); the value is computed on the host in float64, so a
schedule is a per-step scalar of the plan, never part of a kernel.

Where optax only logs and falls back to a constant (``transition_steps <= 0`` in
``linear_schedule`` / ``exponential_decay``, ``decay_rate == 0``), we fall back the same way, so
a ported config behaves the same. Powers follow IEEE arithmetic as ``jnp.power`` does (inf on
overflow, NaN for a negative base and a fractional exponent), never a Python OverflowError or a
complex number, so that a value bounded by ``end_value`` is that bound however far it overflowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._checks import integer, real

Schedule = Callable[[Any], float]


_INT64 = 2**63  # counts and steps are int64 at most (a state's count is an int32)


def _count(count: Any) -> int:
    """The step count as an int; TypeError for anything that is not an integer."""
    if type(count) is np.int32:  # a state's count (every scheduled step): always in range
        return int(count)
    return integer(count, "count", minimum=-_INT64, maximum=_INT64 - 1)


def _steps(value: Any, name: str) -> int:
    return integer(value, name, minimum=-_INT64, maximum=_INT64 - 1)


def _pow(base: float, exponent: float) -> float:
    """``base ** exponent`` as ``jnp.power`` gives it: inf where it overflows, inf for 0 to a
    negative power, NaN for a negative base to a fractional power (Python's ``**`` raises
    OverflowError or ZeroDivisionError there, or returns a complex number)."""
    try:
        return math.pow(base, exponent)  # the C library's pow, as NumPy's: the same bits
    except (OverflowError, ValueError):
        with np.errstate(all="ignore"):
            return float(np.power(np.float64(base), np.float64(exponent)))


def _bound(value: float, end: float, lower: bool) -> float:
    """``jnp.maximum(value, end)`` (``lower``) or ``jnp.minimum``: NaN if either is NaN."""
    if math.isnan(value) or math.isnan(end):
        return math.nan
    return max(value, end) if lower else min(value, end)


def constant_schedule(value: Any) -> Schedule:
    """A constant schedule: the same value at every step.

    The schedule returns ``value`` for every ``count`` (as a float).

    Args:
        value: the value (a real number).

    Returns:
        A function ``schedule(count) -> float`` of an integer step count (a Python or NumPy
            integer; TypeError for anything else).

    Raises:
        TypeError: ``value`` is not a real number.

    References:
        optax.constant_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.constant_schedule(0.1)
        >>> [round(float(sched(i)), 4) for i in (0, 5, 10)]
        [0.1, 0.1, 0.1]
    """
    value = real(value, "value")

    def schedule(count: Any) -> float:
        _count(count)
        return value

    return schedule


def polynomial_schedule(
    init_value: Any, end_value: Any, power: Any, transition_steps: Any, transition_begin: Any = 0
) -> Schedule:
    """A polynomial transition from ``init_value`` to ``end_value``.

    The value is ``(init_value - end_value) * (1 - t / transition_steps) ** power + end_value``,
    with ``t = clip(count - transition_begin, 0, transition_steps)``: ``init_value`` until
    ``transition_begin``, ``end_value`` from ``transition_begin + transition_steps`` on. The
    power follows IEEE arithmetic (inf on overflow, NaN for a negative base and a fractional
    exponent), as ``jnp.power``.

    As in optax, ``transition_steps <= 0`` gives the constant ``init_value`` and a negative
    ``transition_begin`` counts as 0.

    Args:
        init_value: the value before the transition.
        end_value: the value after the transition.
        power: the exponent of the polynomial (1 is linear).
        transition_steps: the length of the transition in steps.
        transition_begin: the step at which the transition starts.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        TypeError: ``init_value``, ``end_value`` or ``power`` is not a real number, or
            ``transition_steps`` or ``transition_begin`` not an integer.

    References:
        optax.polynomial_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.polynomial_schedule(1.0, 0.1, power=2, transition_steps=10)
        >>> [round(float(sched(i)), 4) for i in (0, 5, 10)]  # 0.9 * 0.5 ** 2 + 0.1 at 5
        [1.0, 0.325, 0.1]
    """
    init_value = real(init_value, "init_value")
    end_value = real(end_value, "end_value")
    power = real(power, "power")
    transition_steps = _steps(transition_steps, "transition_steps")
    transition_begin = max(_steps(transition_begin, "transition_begin"), 0)
    if transition_steps <= 0:
        return constant_schedule(init_value)

    def schedule(count: Any) -> float:
        t = min(max(_count(count) - transition_begin, 0), transition_steps)
        frac = 1.0 - t / transition_steps
        return (init_value - end_value) * _pow(frac, power) + end_value

    return schedule


def linear_schedule(
    init_value: Any, end_value: Any, transition_steps: Any, transition_begin: Any = 0
) -> Schedule:
    """A linear transition from ``init_value`` to ``end_value`` (the usual learning-rate warmup).

    The value is ``init_value + (end_value - init_value) * t / transition_steps`` (computed as
    ``(init_value - end_value) * (1 - t / transition_steps) + end_value``), with
    ``t = clip(count - transition_begin, 0, transition_steps)``: it is
    ``polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)``. As in
    optax, ``transition_steps <= 0`` gives the constant ``init_value`` and a negative
    ``transition_begin`` counts as 0.

    Args:
        init_value: the value before the transition.
        end_value: the value after the transition.
        transition_steps: the length of the transition in steps.
        transition_begin: the step at which the transition starts.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        TypeError: ``init_value`` or ``end_value`` is not a real number, or ``transition_steps``
            or ``transition_begin`` not an integer.

    References:
        Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017
        (arXiv:1706.02677; linear warmup). optax.linear_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.linear_schedule(0.0, 1.0, transition_steps=10)
        >>> [round(float(sched(i)), 4) for i in (0, 5, 10)]
        [0.0, 0.5, 1.0]
    """
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def cosine_decay_schedule(
    init_value: Any, decay_steps: Any, alpha: Any = 0.0, exponent: Any = 1.0
) -> Schedule:
    """A cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    The value is ``init_value * ((1 - alpha) * c ** exponent + alpha)``, with
    ``c = (1 + cos(pi * min(count, decay_steps) / decay_steps)) / 2``: ``init_value`` at step 0,
    ``alpha * init_value`` from ``decay_steps`` on (a negative ``count`` is not clipped, as in
    optax).

    Args:
        init_value: the value at step 0.
        decay_steps: the number of steps of the decay.
        alpha: the final value as a fraction of ``init_value``.
        exponent: the power of the cosine factor ``c``.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        ValueError: ``decay_steps <= 0`` (as optax).
        TypeError: ``init_value``, ``alpha`` or ``exponent`` is not a real number, or
            ``decay_steps`` not an integer.

    References:
        Loshchilov and Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts",
        ICLR 2017 (arXiv:1608.03983). optax.cosine_decay_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.cosine_decay_schedule(1.0, decay_steps=10, alpha=0.1)
        >>> [round(float(sched(i)), 4) for i in (0, 5, 10)]  # 0.9 * 0.5 + 0.1 at 5
        [1.0, 0.55, 0.1]
    """
    init_value = real(init_value, "init_value")
    decay_steps = _steps(decay_steps, "decay_steps")
    alpha = real(alpha, "alpha")
    exponent = real(exponent, "exponent")
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay_schedule requires decay_steps > 0, got {decay_steps}")

    def schedule(count: Any) -> float:
        t = min(_count(count), decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * t / decay_steps))
        return init_value * ((1.0 - alpha) * _pow(cosine, exponent) + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[Any]) -> Schedule:
    """Joins schedules one after the other, each restarted at its boundary.

    The value is ``schedules[0](count)`` before the first boundary and
    ``schedules[i](count - boundaries[i - 1])`` from ``boundaries[i - 1]`` on; where the
    boundaries are not increasing, the last schedule whose boundary ``count`` has reached wins,
    as in optax. A schedule is called only from its boundary on (optax calls every one).

    Args:
        schedules: the schedules, in order (callables of the step count).
        boundaries: the steps at which each schedule after the first starts, one fewer than
            ``schedules``.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count.

    Raises:
        ValueError: ``schedules`` is empty, or ``len(boundaries) != len(schedules) - 1``.
        TypeError: a schedule is not callable, or a boundary not an integer.

    References:
        optax.join_schedules.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.join_schedules(
        ...     [nba.constant_schedule(1.0), nba.linear_schedule(1.0, 0.0, 10)], boundaries=[5]
        ... )
        >>> [round(float(sched(i)), 4) for i in (0, 5, 10)]  # the linear one at 0, then at 5
        [1.0, 1.0, 0.5]
    """
    schedules = list(schedules)
    bounds = [_steps(b, f"boundaries[{i}]") for i, b in enumerate(boundaries)]
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(f"schedules[{i}] must be callable, got {type(s).__name__}")
    if not schedules or len(bounds) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules needs one boundary fewer than schedules, got {len(schedules)} "
            f"schedules and {len(bounds)} boundaries"
        )

    def schedule(count: Any) -> float:
        n = _count(count)
        # optax evaluates in order and keeps the last schedule whose boundary was passed.
        value = float(schedules[0](n))
        for boundary, s in zip(bounds, schedules[1:], strict=True):
            if n >= boundary:
                value = float(s(n - boundary))
        return value

    return schedule


def warmup_cosine_decay_schedule(
    init_value: Any,
    peak_value: Any,
    warmup_steps: Any,
    decay_steps: Any,
    end_value: Any = 0.0,
    exponent: Any = 1.0,
) -> Schedule:
    """Linear warmup to ``peak_value``, then a cosine decay to ``end_value``.

    The value rises linearly from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    decays as a cosine to ``end_value``, reached at ``decay_steps`` (which counts the warmup):
    as optax, ``join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
    cosine_decay_schedule(peak_value, decay_steps - warmup_steps, end_value / peak_value,
    exponent)], [warmup_steps])`` (``alpha = 0`` when ``peak_value == 0``).

    Args:
        init_value: the value at step 0.
        peak_value: the value at the end of the warmup.
        warmup_steps: the number of warmup steps.
        decay_steps: the step at which ``end_value`` is reached, warmup included.
        end_value: the final value.
        exponent: the power of the cosine factor (see `cosine_decay_schedule`).

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        ValueError: ``decay_steps <= warmup_steps``.
        TypeError: a value is not a real number, or ``warmup_steps`` or ``decay_steps`` not an
            integer.

    References:
        Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017
        (linear warmup); Loshchilov and Hutter, "SGDR: Stochastic Gradient Descent with Warm
        Restarts", ICLR 2017 (cosine decay). optax.warmup_cosine_decay_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.warmup_cosine_decay_schedule(
        ...     0.0, peak_value=1.0, warmup_steps=5, decay_steps=15, end_value=0.1
        ... )
        >>> [round(float(sched(i)), 4) for i in (0, 5, 10, 15)]
        [0.0, 1.0, 0.55, 0.1]
    """
    init_value = real(init_value, "init_value")
    peak_value = real(peak_value, "peak_value")
    warmup_steps = _steps(warmup_steps, "warmup_steps")
    decay_steps = _steps(decay_steps, "decay_steps")
    end_value = real(end_value, "end_value")
    exponent = real(exponent, "exponent")
    if decay_steps - warmup_steps <= 0:
        raise ValueError(
            f"warmup_cosine_decay_schedule needs decay_steps > warmup_steps, got "
            f"decay_steps={decay_steps}, warmup_steps={warmup_steps}"
        )
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent),
        ],
        [warmup_steps],
    )


def exponential_decay(
    init_value: Any,
    transition_steps: Any,
    decay_rate: Any,
    transition_begin: Any = 0,
    staircase: bool = False,
    end_value: Any = None,
) -> Schedule:
    """An exponential decay (or growth) of ``init_value`` by ``decay_rate`` per ``transition_steps``.

    The value is ``init_value * decay_rate ** p``, ``p = (count - transition_begin) /
    transition_steps`` (floored when ``staircase``); ``init_value`` until ``transition_begin``;
    every value, those before ``transition_begin`` too, bounded by ``end_value`` (a floor when
    ``decay_rate < 1``, a ceiling otherwise), as optax: a growth that overflows gives
    ``end_value``.

    As optax, ``transition_steps <= 0`` or ``decay_rate == 0`` give the constant ``init_value``
    and a negative ``transition_begin`` counts as 0.

    Args:
        init_value: the value until ``transition_begin``.
        transition_steps: the number of steps over which the value is multiplied by
            ``decay_rate``.
        decay_rate: the factor per ``transition_steps`` steps.
        transition_begin: the step at which the decay starts.
        staircase: decay in steps (``p`` floored) instead of continuously.
        end_value: a bound on the value (None: unbounded).

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        TypeError: ``init_value``, ``decay_rate`` or ``end_value`` is not a real number,
            ``transition_steps`` or ``transition_begin`` not an integer, or ``staircase`` not a
            bool.

    References:
        optax.exponential_decay.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.exponential_decay(1.0, transition_steps=5, decay_rate=0.5)
        >>> [round(float(sched(i)), 4) for i in (0, 5, 10)]
        [1.0, 0.5, 0.25]
    """
    init_value = real(init_value, "init_value")
    transition_steps = _steps(transition_steps, "transition_steps")
    decay_rate = real(decay_rate, "decay_rate")
    transition_begin = max(_steps(transition_begin, "transition_begin"), 0)
    if not isinstance(staircase, bool):
        raise TypeError(f"staircase must be a bool, got {type(staircase).__name__}")
    end = None if end_value is None else real(end_value, "end_value")
    if transition_steps <= 0 or decay_rate == 0.0:
        return constant_schedule(init_value)

    def schedule(count: Any) -> float:
        t = _count(count) - transition_begin
        if t <= 0:
            value = init_value
        else:
            p = t / transition_steps
            if staircase:
                p = math.floor(p)
            value = init_value * _pow(decay_rate, p)
        return value if end is None else _bound(value, end, lower=decay_rate < 1.0)

    return schedule


def _boundaries_and_scales(mapping: Mapping[Any, Any] | None, name: str) -> list[tuple[int, float]]:
    """``(boundary, scale)`` pairs of a piecewise schedule's mapping, sorted by boundary; a
    negative scale is a ValueError (as optax), a scale that is not a real number or a boundary
    that is not an integer a TypeError."""
    pairs = []
    for b, s in (mapping or {}).items():
        scale = real(s, f"boundaries_and_scales[{b!r}]")
        if scale < 0:
            raise ValueError(f"{name} expects non-negative scales, got {scale} at {b!r}")
        pairs.append((_steps(b, "boundaries_and_scales key"), scale))
    pairs.sort()
    return pairs


def piecewise_constant_schedule(
    init_value: Any, boundaries_and_scales: Mapping[Any, Any] | None = None
) -> Schedule:
    """A piecewise constant schedule: ``init_value`` scaled at each boundary.

    The value is ``init_value`` times the product of every ``scale`` whose boundary ``count``
    has reached (``count >= boundary``).

    Args:
        init_value: the value before the first boundary.
        boundaries_and_scales: a mapping from step (an integer) to the factor applied from that
            step on; None or empty: the constant ``init_value``.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        ValueError: a negative scale (as optax).
        TypeError: ``init_value`` or a scale is not a real number, or a boundary not an integer.

    References:
        optax.piecewise_constant_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.piecewise_constant_schedule(1.0, {5: 0.5, 10: 0.1})
        >>> [round(float(sched(i)), 4) for i in (0, 5, 10)]  # 1.0 * 0.5 * 0.1 at 10
        [1.0, 0.5, 0.05]
    """
    init_value = real(init_value, "init_value")
    pairs = _boundaries_and_scales(boundaries_and_scales, "piecewise_constant_schedule")

    def schedule(count: Any) -> float:
        n = _count(count)
        value = init_value
        for boundary, scale in pairs:
            if n >= boundary:
                value *= scale
        return value

    return schedule


def _interpolate_linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


def _interpolate_cosine(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1.0)


_INTERPOLATE = {"linear": _interpolate_linear, "cosine": _interpolate_cosine}


def piecewise_interpolate_schedule(
    interpolate_type: str, init_value: Any, boundaries_and_scales: Mapping[Any, Any] | None = None
) -> Schedule:
    """A schedule that interpolates, linearly or along a cosine, between values scaled at
    boundaries.

    The values ``v_0 = init_value``, ``v_i = v_{i-1} * scale_i`` (the boundaries ``b_i`` sorted,
    ``b_0 = 0``) are joined: between ``b_{i-1}`` and ``b_i`` the value goes from ``v_{i-1}`` to
    ``v_i`` with ``pct = (count - b_{i-1}) / max(b_i - b_{i-1}, 1)``, as ``v_{i-1} + (v_i -
    v_{i-1}) pct`` (``'linear'``) or ``v_i + (v_{i-1} - v_i) (cos(pi pct) + 1) / 2``
    (``'cosine'``); from the last boundary on it is the last value, and before step 0 it is 0,
    as in optax (which sums the interpolation of every segment times whether ``count`` is in it:
    an inf value anywhere makes every step NaN, here too).

    Args:
        interpolate_type: ``'linear'`` or ``'cosine'``.
        init_value: the value at step 0.
        boundaries_and_scales: a mapping from step (an integer) to the factor that scales the
            value reached at that step; None or empty: ``init_value`` from step 0 on.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        ValueError: ``interpolate_type`` is neither ``'linear'`` nor ``'cosine'``; a negative
            scale (as optax).
        TypeError: ``init_value`` or a scale is not a real number, or a boundary not an integer.

    References:
        optax.piecewise_interpolate_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01})
        >>> [round(float(sched(i)), 6) for i in range(0, 11, 2)]  # optax's docstring example
        [1.0, 0.55, 0.1, 0.0505, 0.001, 0.001]
    """
    interpolate = _INTERPOLATE.get(interpolate_type) if isinstance(interpolate_type, str) else None
    if interpolate is None:
        raise ValueError(f"interpolate_type must be 'linear' or 'cosine', got {interpolate_type!r}")
    init_value = real(init_value, "init_value")
    pairs = _boundaries_and_scales(boundaries_and_scales, "piecewise_interpolate_schedule")
    bounds = [0] + [b for b, _ in pairs]
    values = [init_value]
    for _, scale in pairs:
        values.append(values[-1] * scale)
    segments = [
        (bounds[i], bounds[i + 1], max(bounds[i + 1] - bounds[i], 1), values[i], values[i + 1])
        for i in range(len(pairs))
    ]
    last_bound, last_value = bounds[-1], values[-1]

    def schedule(count: Any) -> float:
        n = _count(count)
        total = 0.0
        for lo, hi, size, start, end in segments:
            inside = 1.0 if lo <= n < hi else 0.0
            total += inside * interpolate(start, end, (n - lo) / size)
        return total + (1.0 if last_bound <= n else 0.0) * last_value

    return schedule


def _check_onecycle(transition_steps: Any) -> int:
    steps = _steps(transition_steps, "transition_steps")
    if steps <= 0:
        raise ValueError(f"a onecycle schedule needs transition_steps > 0, got {steps}")
    return steps


def linear_onecycle_schedule(
    transition_steps: Any,
    peak_value: Any,
    pct_start: Any = 0.3,
    pct_final: Any = 0.85,
    div_factor: Any = 25.0,
    final_div_factor: Any = 1e4,
) -> Schedule:
    """The one-cycle schedule in three linear phases (Smith's super-convergence).

    From ``peak_value / div_factor`` up to ``peak_value`` at step ``int(pct_start *
    transition_steps)``, back down to ``peak_value / div_factor`` at ``int(pct_final *
    transition_steps)``, then to ``peak_value / div_factor / final_div_factor`` at
    ``transition_steps``, where it stays: optax's `piecewise_interpolate_schedule` (``'linear'``)
    of those boundaries and scales (two boundaries that coincide keep the later scale, as
    optax's dictionary does).

    Args:
        transition_steps: the length of the cycle, in steps.
        peak_value: the largest value, reached at ``pct_start`` of the cycle.
        pct_start: the fraction of the cycle spent rising.
        pct_final: the fraction of the cycle after which the last phase starts.
        div_factor: the initial value is ``peak_value / div_factor``.
        final_div_factor: the final value is the initial one divided by this.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        ValueError: ``transition_steps <= 0`` (as optax).
        TypeError: a value is not a real number, or ``transition_steps`` not an integer.

    References:
        Smith and Topin, "Super-Convergence: Very Fast Training of Neural Networks Using Large
        Learning Rates", 2017 (arXiv:1708.07120). optax.linear_onecycle_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.linear_onecycle_schedule(100, peak_value=1.0)
        >>> [round(float(sched(i)), 4) for i in (0, 30, 85, 100)]
        [0.04, 1.0, 0.04, 0.0]
    """
    steps = _check_onecycle(transition_steps)
    peak, div = real(peak_value, "peak_value"), real(div_factor, "div_factor")
    start, final = real(pct_start, "pct_start"), real(pct_final, "pct_final")
    final_div = real(final_div_factor, "final_div_factor")
    scales = {int(start * steps): div, int(final * steps): 1.0 / div, steps: 1.0 / final_div}
    return piecewise_interpolate_schedule("linear", peak / div, scales)


def cosine_onecycle_schedule(
    transition_steps: Any,
    peak_value: Any,
    pct_start: Any = 0.3,
    div_factor: Any = 25.0,
    final_div_factor: Any = 1e4,
) -> Schedule:
    """The one-cycle schedule along cosines: up from ``peak_value / div_factor`` to
    ``peak_value`` at step ``int(pct_start * transition_steps)``, then down to ``peak_value /
    (div_factor * final_div_factor)`` at ``transition_steps``, where it stays (optax's
    `piecewise_interpolate_schedule` with ``'cosine'``).

    Args:
        transition_steps: the length of the cycle, in steps.
        peak_value: the largest value, reached at ``pct_start`` of the cycle.
        pct_start: the fraction of the cycle spent rising.
        div_factor: the initial value is ``peak_value / div_factor``.
        final_div_factor: the final value is the initial one divided by this.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        ValueError: ``transition_steps <= 0`` (as optax).
        TypeError: a value is not a real number, or ``transition_steps`` not an integer.

    References:
        Smith and Topin, "Super-Convergence: Very Fast Training of Neural Networks Using Large
        Learning Rates", 2017 (arXiv:1708.07120). optax.cosine_onecycle_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.cosine_onecycle_schedule(100, peak_value=1.0)
        >>> [round(float(sched(i)), 4) for i in (0, 15, 30, 100)]
        [0.04, 0.52, 1.0, 0.0]
    """
    steps = _check_onecycle(transition_steps)
    peak, div = real(peak_value, "peak_value"), real(div_factor, "div_factor")
    start, final_div = real(pct_start, "pct_start"), real(final_div_factor, "final_div_factor")
    scales = {int(start * steps): div, steps: 1.0 / (div * final_div)}
    return piecewise_interpolate_schedule("cosine", peak / div, scales)


def warmup_constant_schedule(init_value: Any, peak_value: Any, warmup_steps: Any) -> Schedule:
    """A linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    ``peak_value`` for good (optax's: `linear_schedule` to the peak).

    Args:
        init_value: the value at step 0.
        peak_value: the value from the end of the warmup on.
        warmup_steps: the length of the warmup. ``<= 0`` gives ``init_value`` for good, as
            `linear_schedule` (and optax's) falls back to it.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        TypeError: a value is not a real number, or ``warmup_steps`` not an integer.

    References:
        optax.warmup_constant_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.warmup_constant_schedule(0.0, peak_value=1.0, warmup_steps=4)
        >>> [round(float(sched(i)), 4) for i in (0, 2, 4, 100)]
        [0.0, 0.5, 1.0, 1.0]
    """
    return linear_schedule(init_value, peak_value, warmup_steps)


def warmup_exponential_decay_schedule(
    init_value: Any,
    peak_value: Any,
    warmup_steps: Any,
    transition_steps: Any,
    decay_rate: Any,
    transition_begin: Any = 0,
    staircase: bool = False,
    end_value: Any = None,
) -> Schedule:
    """A linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    `exponential_decay` from ``peak_value`` (counted from the end of the warmup).

    Args:
        init_value: the value at step 0.
        peak_value: the value at the end of the warmup, where the decay starts.
        warmup_steps: the length of the warmup.
        transition_steps: as in `exponential_decay`.
        decay_rate: as in `exponential_decay`.
        transition_begin: as in `exponential_decay`, after the warmup.
        staircase: as in `exponential_decay`.
        end_value: as in `exponential_decay`.

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        TypeError: a value is not a real number, or a step count not an integer.
        ValueError: as `exponential_decay`.

    References:
        optax.warmup_exponential_decay_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> sched = nba.warmup_exponential_decay_schedule(0.0, 1.0, 5, transition_steps=10, decay_rate=0.5)
        >>> [round(float(sched(i)), 4) for i in (0, 5, 15, 25)]
        [0.0, 1.0, 0.5, 0.25]
    """
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            exponential_decay(
                peak_value, transition_steps, decay_rate, transition_begin, staircase, end_value
            ),
        ],
        [warmup_steps],
    )


def sgdr_schedule(cosine_kwargs: Any) -> Schedule:
    """SGD with warm restarts: `warmup_cosine_decay_schedule` cycles one after the other, each
    lasting its ``decay_steps``.

    Args:
        cosine_kwargs: the keyword arguments of each cycle's `warmup_cosine_decay_schedule`
            (an iterable of mappings, each with ``decay_steps``).

    Returns:
        A function ``schedule(count) -> float`` of an integer step count, computed in float64.

    Raises:
        TypeError: a cycle is not a mapping, or its arguments are not
            `warmup_cosine_decay_schedule`'s.
        ValueError: no cycle, or a cycle's own error.

    References:
        Loshchilov and Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts",
        ICLR 2017 (arXiv:1608.03983). optax.sgdr_schedule.

    Examples:
        >>> import numbaccum as nba
        >>> cycle = dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=10)
        >>> sched = nba.sgdr_schedule([cycle, cycle])
        >>> [round(float(sched(i)), 4) for i in (0, 2, 10, 12)]  # restarted at 10
        [0.0, 1.0, 0.0, 1.0]
    """
    schedules, boundaries, step = [], [], 0
    for i, kwargs in enumerate(cosine_kwargs):
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"cosine_kwargs[{i}] must be a mapping of arguments, got {type(kwargs).__name__}")
        try:
            schedules.append(warmup_cosine_decay_schedule(**kwargs))
        except TypeError as e:
            raise TypeError(f"cosine_kwargs[{i}]: {e}") from None
        step += _steps(kwargs["decay_steps"], f"cosine_kwargs[{i}]['decay_steps']")
        boundaries.append(step)
    if not schedules:
        raise ValueError("sgdr_schedule needs at least one cycle")
    return join_schedules(schedules, boundaries[:-1])
