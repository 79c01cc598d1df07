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
    """``value`` at every step."""
    value = real(value, "value")

    def schedule(count: Any) -> float:
        _count(count)
        return value

    return schedule


def polynomial_schedule(
    init_value: Any, end_value: Any, power: Any, transition_steps: Any, transition_begin: Any = 0
) -> Schedule:
    """``(init - end) * (1 - t / transition_steps) ** power + end``, with
    ``t = clip(count - transition_begin, 0, transition_steps)``.

    As in optax, ``transition_steps <= 0`` gives the constant ``init_value`` and a negative
    ``transition_begin`` counts as 0.
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
    """From ``init_value`` to ``end_value`` linearly over ``transition_steps`` steps starting at
    ``transition_begin``: ``polynomial_schedule(..., power=1)``."""
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def cosine_decay_schedule(
    init_value: Any, decay_steps: Any, alpha: Any = 0.0, exponent: Any = 1.0
) -> Schedule:
    """``init_value * ((1 - alpha) * c ** exponent + alpha)``, with
    ``c = (1 + cos(pi * min(count, decay_steps) / decay_steps)) / 2``.

    Raises:
        ValueError: ``decay_steps <= 0`` (as optax).
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
    """``schedules[i](count - boundaries[i-1])`` for ``boundaries[i-1] <= count < boundaries[i]``
    (``schedules[0](count)`` before the first boundary).

    Raises:
        ValueError: ``len(boundaries) != len(schedules) - 1``.
        TypeError: a schedule is not callable, or a boundary not an integer.
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
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then a cosine
    decay to ``end_value`` reached at ``decay_steps`` (which counts the warmup): as optax,
    ``join_schedules([linear, cosine_decay(peak, decay_steps - warmup_steps, end/peak)],
    [warmup_steps])``.
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
    """``init_value * decay_rate ** p``, ``p = (count - transition_begin) / transition_steps``
    (floored when ``staircase``); ``init_value`` until ``transition_begin``; every value, those
    before ``transition_begin`` too, bounded by ``end_value`` (a floor when ``decay_rate < 1``, a
    ceiling otherwise), as optax: a growth that overflows gives ``end_value``.

    As optax, ``transition_steps <= 0`` or ``decay_rate == 0`` give the constant ``init_value``
    and a negative ``transition_begin`` counts as 0.
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


def piecewise_constant_schedule(
    init_value: Any, boundaries_and_scales: Mapping[Any, Any] | None = None
) -> Schedule:
    """``init_value`` times every ``scale`` whose boundary ``count`` has reached.

    Raises:
        ValueError: a negative scale (as optax).
    """
    init_value = real(init_value, "init_value")
    pairs = []
    for b, s in (boundaries_and_scales or {}).items():
        scale = real(s, f"boundaries_and_scales[{b!r}]")
        if scale < 0:
            raise ValueError(f"piecewise_constant_schedule expects non-negative scales, got {scale} at {b!r}")
        pairs.append((_steps(b, "boundaries_and_scales key"), scale))
    pairs.sort()

    def schedule(count: Any) -> float:
        n = _count(count)
        value = init_value
        for boundary, scale in pairs:
            if n >= boundary:
                value *= scale
        return value

    return schedule
