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
        (lambda: na.piecewise_interpolate_schedule("cubic", 1.0), ValueError, "interpolate_type"),
        (lambda: na.piecewise_interpolate_schedule("linear", 1.0, {3: -0.5}), ValueError, "non-negative"),
        (lambda: na.piecewise_interpolate_schedule("linear", 1.0, {2.5: 0.5}), TypeError, "key"),
        (lambda: na.linear_onecycle_schedule(0, 1.0), ValueError, "transition_steps > 0"),
        (lambda: na.cosine_onecycle_schedule(-5, 1.0), ValueError, "transition_steps > 0"),
        (lambda: na.cosine_onecycle_schedule(10, "peak"), TypeError, "peak_value"),
        (lambda: na.warmup_constant_schedule(0.0, 1.0, 2.5), TypeError, "transition_steps"),
        (lambda: na.sgdr_schedule([]), ValueError, "at least one cycle"),
        (lambda: na.sgdr_schedule([(0.0, 1.0, 2, 10)]), TypeError, r"cosine_kwargs\[0\] must be a mapping"),
        (lambda: na.sgdr_schedule([{"init_value": 0.0, "peak": 1.0}]), TypeError, r"cosine_kwargs\[0\]"),
        (
            lambda: na.warmup_exponential_decay_schedule(0.0, 1.0, 5, 10, 0.5, staircase="yes"),
            TypeError,
            "staircase",
        ),
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


# --- against optax 0.2.8, count by count (issue 22, item 6) -------------------------------------

# name -> [(args, kwargs)]: growth and decay, staircase, transition_begin before and after 0,
# end_value on both sides of init_value, the fallbacks to a constant, powers that overflow.
OPTAX_CASES = {
    "constant_schedule": [((0.5,), {}), ((-1e-3,), {})],
    "polynomial_schedule": [
        ((1.0, 0.01, 2, 100), {}),
        ((1.0, 0.0, 0.5, 7919, 3), {}),
        ((0.1, 1.0, 1, 100, -2), {}),
        ((1.0, 0.5, -1, 50), {}),  # 0 ** -1 at the end: inf, as jnp.power
        ((1.0, 1.0, -1.5, 50), {}),  # 0 * inf: NaN
        ((2.0, 0.1, 3, 0), {}),  # transition_steps <= 0: the constant init_value
        ((1e-3, 1e-5, 1.0, 1), {}),
    ],
    "linear_schedule": [
        ((1.0, 0.0, 100), {}),
        ((0.0, 1.0, 7919, 5), {}),
        ((1.0, 2.0, 1, -3), {}),
        ((3.0, 1.0, 0), {}),
    ],
    "cosine_decay_schedule": [
        ((1.0, 100), {}),
        ((2.0, 7919, 0.1), {}),
        ((1.0, 50, 0.0, 2.0), {}),
        ((1.0, 50, 0.2, 0.5), {}),
        ((1.0, 50, 0.0, -1.0), {}),  # 0 ** -1 at the end
        ((1.0, 1, 0.5), {}),
        ((1.0, 10, -0.5, 3.0), {}),
    ],
    "warmup_cosine_decay_schedule": [
        ((0.0, 1.0, 100, 1000), {}),
        ((1e-4, 1e-2, 7, 9000, 1e-5), {}),
        ((0.0, 0.0, 5, 10, 0.1), {}),
        ((0.5, 1.0, 0, 100, 0.2, 2.0), {}),
    ],
    "exponential_decay": [
        ((1e-4, 3, 2.0), {"end_value": 1e-2}),  # the issue: OverflowError at count 3072
        ((1.0, 1, 1.0), {"transition_begin": 3, "end_value": 0.1}),  # the issue: 0.1 before 3
        ((0.3, 100, 0.99), {"transition_begin": 50, "end_value": 0.5}),  # a floor above init
        ((1.0, 100, 0.99), {"transition_begin": 50, "end_value": 0.5}),
        ((1.0, 7, 0.5), {}),
        ((1.0, 7, 0.5), {"staircase": True}),
        ((1.0, 3, 1.01), {"end_value": 2.0}),
        ((1.0, 3, 1.01), {"end_value": 0.5, "staircase": True}),  # a ceiling below init
        ((1.0, 3, 2.0), {}),  # grows to inf
        ((1.0, 3, -0.5), {}),  # a negative rate to a fractional power: NaN
        ((1.0, 3, -0.5), {"staircase": True}),
        ((0.0, 3, 2.0), {"end_value": 1.0}),  # 0 * inf: NaN, bounded: NaN
        ((1.0, 0, 0.5), {}),  # transition_steps <= 0: constant
        ((1.0, 5, 0.0), {}),  # decay_rate == 0: constant
        ((2.0, 5, 0.9), {"transition_begin": -4, "end_value": 0.1}),
        ((1.0, 1000, 0.1), {"transition_begin": 10}),
    ],
    "piecewise_constant_schedule": [
        ((1.0, {6: 0.1, 3: 0.5, 5000: 2.0}), {}),
        ((2.0,), {}),
        ((1.0, {0: 0.0, 10: 3.0}), {}),
    ],
    "piecewise_interpolate_schedule": [
        (("linear", 1.0, {4: 0.1, 8: 0.01}), {}),  # optax's docstring example
        (("cosine", 2.0, {10: 0.5, 3: 4.0, 5000: 0.0}), {}),  # unsorted; a zero scale
        (("linear", 1.0), {}),
        (("cosine", 1.0, {0: 3.0, 5: 2.0}), {}),  # a boundary at 0: an empty first segment
        (("linear", 0.5, {-4: 2.0, 7: 0.5}), {}),  # a boundary before 0
    ],
    "linear_onecycle_schedule": [
        ((1000, 1.0), {}),
        ((7, 0.5, 0.5, 0.6, 10.0, 100.0), {}),  # int(0.5 * 7) and int(0.6 * 7) coincide
        ((9973, 3e-3, 0.25, 0.9), {}),
    ],
    "cosine_onecycle_schedule": [
        ((1000, 1.0), {}),
        ((1, 3.0, 0.3), {}),
        ((9973, 3e-3, 0.1, 10.0, 1e3), {}),
    ],
    "warmup_constant_schedule": [((0.0, 1.0, 400), {}), ((0.5, 1.0, 0), {}), ((1e-4, 2e-3, 7919), {})],
    "warmup_exponential_decay_schedule": [
        ((0.0, 1.0, 5, 10, 0.5), {}),
        ((1e-3, 1.0, 100, 7, 0.9), {"transition_begin": 3, "staircase": True, "end_value": 0.1}),
        ((0.0, 1e-2, 1000, 100, 0.99), {"end_value": 1e-3}),
    ],
    "sgdr_schedule": [
        (
            (
                [
                    {"init_value": 0.0, "peak_value": 1.0, "warmup_steps": 20, "decay_steps": 1000},
                    {"init_value": 0.1, "peak_value": 0.5, "warmup_steps": 0, "decay_steps": 2000},
                    {
                        "init_value": 0.0,
                        "peak_value": 0.2,
                        "warmup_steps": 5,
                        "decay_steps": 7919,
                        "end_value": 1e-3,
                    },
                ],
            ),
            {},
        ),
    ],
}
OPTAX_IDS = [(name, i) for name, cases in OPTAX_CASES.items() for i in range(len(cases))]
# Cases where optax's own float32 arithmetic is off by more than 1e-6 (XLA divides by a
# reciprocal, and these formulas amplify that rounding): compared in float64 only.
F32_ILL_CONDITIONED = {
    ("polynomial_schedule", 1): "(1 - t / T) ** 0.5 near t = T: 2**-24 becomes 2.4e-4",
    ("polynomial_schedule", 3): "(1 - t / T) ** -1 near t = T",
    ("cosine_decay_schedule", 4): "c ** -1 near c = 0",
    ("exponential_decay", 8): "2 ** p up to 1e38: the rounding of p times p ln 2",
    ("exponential_decay", 9): "(-0.5) ** p is NaN unless p is an integer, which k / 3 in float32 may miss",
    (
        "exponential_decay",
        11,
    ): "0 * 2 ** p is NaN from the overflow on: count 384 in float32, 3072 in float64",
}
F32_IDS = [case for case in OPTAX_IDS if case not in F32_ILL_CONDITIONED]
COUNTS = np.concatenate([np.arange(10_001), [2**14 + 1, 2**20, 2**24 + 1, 10**8, 2**31 - 1]])


def _ours(name, i):
    args, kwargs = OPTAX_CASES[name][i]
    schedule = getattr(na, name)(*args, **kwargs)
    return np.array([schedule(int(c)) for c in COUNTS], np.float64)


# optax's interpolated schedules take one count at a time (their segments broadcast against it).
ONE_COUNT = {"piecewise_interpolate_schedule", "linear_onecycle_schedule", "cosine_onecycle_schedule"}


def _theirs(optax, name, i, count_dtype):
    import jax

    args, kwargs = OPTAX_CASES[name][i]
    schedule = getattr(optax, name)(*args, **kwargs)
    got = (jax.vmap(schedule) if name in ONE_COUNT else schedule)(np.asarray(COUNTS, count_dtype))
    return np.broadcast_to(np.asarray(got, np.float64), COUNTS.shape)


def test_the_optax_cases_cover_every_schedule():
    assert set(OPTAX_CASES) | {"join_schedules"} == {
        n
        for n in na.__all__
        if n.endswith(("_schedule", "_schedules", "_decay")) and not n.startswith("scale_by")
    }


@pytest.mark.parametrize("name,i", OPTAX_IDS, ids=[f"{n}-{i}" for n, i in OPTAX_IDS])
def test_schedules_match_optax_at_every_count_in_float64(name, i):
    """optax's formulas evaluated in float64 (x64 on): ours compute in float64 too, so every
    value agrees to the last bits or so (libm vs XLA's pow and cos), inf and NaN where optax's
    (XLA flushes subnormal results to zero, hence the atol of the smallest normal number)."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    with jax.enable_x64(True):
        want = _theirs(optax, name, i, np.int64)
    np.testing.assert_allclose(_ours(name, i), want, rtol=1e-12, atol=np.finfo(np.float64).tiny)


@pytest.mark.parametrize("name,i", F32_IDS, ids=[f"{n}-{i}" for n, i in F32_IDS])
def test_schedules_match_optax_at_every_count_in_float32(name, i):
    """optax as it usually runs, in float32 (int32 counts): our value rounded to float32 within
    rtol 1e-6, or within 1e-6 of the schedule's scale where optax's own float32 arithmetic drifts
    that much (``1 - t / T`` cancels near the end, ``p`` is rounded before the power); overflow to
    inf and NaN where optax's."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    with jax.enable_x64(False):
        want = _theirs(optax, name, i, np.int32)
    ours = _ours(name, i)
    finite = np.abs(ours[np.isfinite(ours)])
    scale = finite.max() if finite.size else 0.0  # the schedule's largest finite value
    with np.errstate(over="ignore"):
        ours32 = ours.astype(np.float32)
    np.testing.assert_allclose(ours32, want.astype(np.float32), rtol=1e-6, atol=1e-6 * scale)


def test_join_schedules_matches_optax():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")

    def build(lib):
        parts = [
            lib.linear_schedule(0.0, 1.0, 10),
            lib.exponential_decay(1.0, 7, 0.5, end_value=1e-3),
            lib.cosine_decay_schedule(1e-3, 50, 0.1),
        ]
        return lib.join_schedules(parts, [10, 5000])

    ours = build(na)
    with jax.enable_x64(True):
        want = np.asarray(build(optax)(np.asarray(COUNTS, np.int64)), np.float64)
    np.testing.assert_allclose([ours(int(c)) for c in COUNTS], want, rtol=1e-12, atol=0)


def test_exponential_decay_the_issue_examples():
    """Before: OverflowError at count 3072, and 1.0 (not end_value) before transition_begin."""
    s = na.exponential_decay(1e-4, 3, 2.0, end_value=1e-2)
    assert [s(3072), s(2**31 - 1)] == [1e-2, 1e-2]
    assert [na.exponential_decay(1.0, 1, 1.0, transition_begin=3, end_value=0.1)(c) for c in range(5)] == [
        0.1
    ] * 5
    assert na.exponential_decay(1.0, 3, 2.0)(3072) == math.inf
    assert math.isnan(na.exponential_decay(1.0, 3, -0.5)(1))
    assert na.cosine_decay_schedule(1.0, 50, exponent=-1.0)(50) == math.inf
    with pytest.raises(ValueError, match="count must be <="):
        s(2**63)
