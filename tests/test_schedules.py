"""Schedules against closed-form values (optax's formulas) and their argument checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numbaccum as na


def test_constant_schedule():
    s = na.constant_schedule(0.5)
    assert [s(0), s(np.int32(7))] == [0.5, 0.5]


def test_linear_schedule_values():
    s = na.linear_schedule(1.0, 0.0, transition_steps=4, transition_begin=2)
    got = [s(np.int32(n)) for n in range(9)]
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0], abs=1e-15)
    # optax: transition_steps <= 0 gives the constant init_value.
    assert na.linear_schedule(2.0, 0.0, 0)(5) == 2.0
    # optax: a negative transition_begin counts as 0.
    assert na.linear_schedule(1.0, 0.0, 4, transition_begin=-3)(2) == 0.5


def test_polynomial_schedule_power():
    s = na.polynomial_schedule(1.0, 0.0, power=2, transition_steps=10)
    assert s(5) == pytest.approx(0.25, abs=1e-15)


def test_cosine_decay_values():
    s = na.cosine_decay_schedule(2.0, decay_steps=10, alpha=0.1)
    for n in [0, 3, 10, 15]:
        t = min(n, 10)
        want = 2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * t / 10)) + 0.1)
        assert s(np.int32(n)) == pytest.approx(want, rel=1e-15)
    assert s(10) == pytest.approx(0.2)
    e = na.cosine_decay_schedule(1.0, 4, exponent=2.0)
    assert e(2) == pytest.approx(0.25)


def test_warmup_cosine_decay_values():
    s = na.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14, end_value=0.1)
    assert [s(n) for n in range(5)] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    # halfway through the 10 decay steps: end + (peak - end) / 2
    assert s(9) == pytest.approx(0.55)
    assert s(14) == pytest.approx(0.1)
    assert s(100) == pytest.approx(0.1)


def test_exponential_decay_values():
    s = na.exponential_decay(1.0, transition_steps=2, decay_rate=0.5, transition_begin=1)
    assert [s(n) for n in [0, 1, 2, 3, 5]] == pytest.approx([1.0, 1.0, 0.5**0.5, 0.5, 0.25], rel=1e-15)
    st = na.exponential_decay(1.0, 2, 0.5, staircase=True)
    assert [st(n) for n in [1, 2, 3, 4]] == [1.0, 0.5, 0.5, 0.25]
    floor = na.exponential_decay(1.0, 1, 0.5, end_value=0.3)
    assert floor(10) == 0.3
    ceil = na.exponential_decay(1.0, 1, 2.0, end_value=3.0)
    assert ceil(10) == 3.0
    assert na.exponential_decay(1.0, 1, 0.0)(5) == 1.0  # optax: decay_rate 0 is a constant


def test_piecewise_constant_values():
    s = na.piecewise_constant_schedule(1.0, {6: 0.1, 3: 0.5})
    assert [s(n) for n in [0, 2, 3, 5, 6, 9]] == pytest.approx([1, 1, 0.5, 0.5, 0.05, 0.05])
    assert na.piecewise_constant_schedule(2.0)(100) == 2.0


def test_join_schedules_values():
    s = na.join_schedules(
        [na.constant_schedule(1.0), na.linear_schedule(2.0, 0.0, 4), na.constant_schedule(7.0)],
        [3, 5],
    )
    assert [s(n) for n in [0, 2, 3, 4, 5, 6]] == pytest.approx([1, 1, 2, 1.5, 7, 7])


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda: na.cosine_decay_schedule(1.0, 0), ValueError, "decay_steps"),
        (lambda: na.warmup_cosine_decay_schedule(0, 1, 5, 5), ValueError, "decay_steps"),
        (lambda: na.piecewise_constant_schedule(1.0, {2: -1.0}), ValueError, "non-negative"),
        (lambda: na.join_schedules([na.constant_schedule(1)], [3]), ValueError, "boundar"),
        (lambda: na.join_schedules([1, 2], [3]), TypeError, r"schedules\[0\]"),
        (lambda: na.linear_schedule("a", 0, 3), TypeError, "init_value"),
        (lambda: na.linear_schedule(1, 0, 2.5), TypeError, "transition_steps"),
        (lambda: na.linear_schedule(1, 0, 2, transition_begin=1.5), TypeError, "transition_begin"),
        (lambda: na.exponential_decay(1, 2, 0.5, staircase=1), TypeError, "staircase"),
    ],
)
def test_bad_arguments(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_bad_count():
    with pytest.raises(TypeError, match="count"):
        na.linear_schedule(1, 0, 3)(1.5)


def test_schedule_as_learning_rate():
    params = {"w": np.ones(3, np.float32)}
    tx = na.sgd(na.linear_schedule(1.0, 0.0, 2))
    state = tx.init(params)
    u, state = tx.update({"w": np.ones(3, np.float32)}, state)
    np.testing.assert_array_equal(u["w"], -1.0)
    u, state = tx.update({"w": np.ones(3, np.float32)}, state)
    np.testing.assert_array_equal(u["w"], -0.5)
