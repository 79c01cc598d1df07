"""The CPU kernels through the contract (`ops_for`) against plain NumPy: edge cases and thread-count
determinism."""

import textwrap

import numpy as np
import pytest
from _testutil import same_stdout_with_one_and_two_threads

from numbaccum import _config, accumulation, formulas, optimizers
from numbaccum.backend import ops_for
from numbaccum.contract import Factor

OPS = ops_for(np.zeros(1))
F = Factor(1.7, 0.3)

DTYPES = [np.float32, np.float64]
SIZES = [0, 1, 17, 1000, (1 << 16) + 3, 300_001]


def rand(n, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_match_float64_numpy(n, dtype):
    x = rand(n, dtype)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(OPS.sumsq(x), np.sum(x64 * x64), rtol=1e-12)
    np.testing.assert_allclose(OPS.sumabs(x), np.sum(np.abs(x64)), rtol=1e-12)
    assert OPS.maxabs(x) == (np.max(np.abs(x64)) if n else 0.0)
    assert OPS.count_nonfinite(x) == 0


def test_segment_reductions_match_per_leaf():
    sizes = [0, 5, 1 << 17, 3, 0, 70_000]
    x = rand(sum(sizes), np.float32)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    got = OPS.segment_sumsq(x, offsets)
    for s, v in enumerate(got):
        seg = x[offsets[s] : offsets[s + 1]]
        assert v == OPS.sumsq(seg)  # same fixed blocks per segment: same bits
        np.testing.assert_allclose(v, np.sum(seg.astype(np.float64) ** 2), rtol=1e-12)
    mx = OPS.segment_maxabs(x, offsets)
    for s, v in enumerate(mx):
        seg = x[offsets[s] : offsets[s + 1]]
        assert v == (np.abs(seg).max() if seg.size else 0.0)


def test_nonfinite_and_nan_propagation():
    x = np.array([1.0, np.nan, np.inf, -np.inf, 3.0], np.float32)
    assert OPS.count_nonfinite(x) == 3
    assert np.isnan(OPS.maxabs(x))
    assert np.isnan(OPS.sumsq(x))
    big = np.full(4, 1e20, np.float32)  # squares overflow float32, not float64
    np.testing.assert_allclose(OPS.sumsq(big), 4e40, rtol=1e-7)


def test_float32_norm_of_1e8_values_is_accurate():
    x = np.full(100_000_000, 0.1, np.float32)
    exact = 1e8 * float(np.float32(0.1)) ** 2
    assert abs(OPS.sumsq(x) - exact) / exact < 1e-7


@pytest.mark.parametrize("n", [7, 200_003])
@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_kernels_match_numpy(n, dtype):
    t = dtype
    g, a, b = rand(n, t, 1), rand(n, t, 2), rand(n, t, 3)
    div, mul = t(1.7), t(0.3)
    ge = (g / div) * mul

    out = np.empty_like(g)
    OPS.scale_(out, g, F)
    np.testing.assert_array_equal(out, ge)
    OPS.add_scaled_(out, g, F, a, 0.25)
    np.testing.assert_array_equal(out, ge + t(0.25) * a)

    tr = a.copy()
    OPS.driver.map_(accumulation.trace_update, F, (tr, g, out), (0.9, True))
    expect_t = ge + t(0.9) * a
    np.testing.assert_array_equal(tr, expect_t)
    np.testing.assert_array_equal(out, ge + t(0.9) * expect_t)

    e = a.copy()
    bc = t(1) - t(0.9) ** 3
    OPS.driver.map_(formulas.ema, F, (e, g, out), (1 - 0.9, 0.9, bc))
    expect_e = t(1 - 0.9) * ge + t(0.9) * a
    np.testing.assert_array_equal(e, expect_e)
    np.testing.assert_array_equal(out, expect_e / bc)

    acc = a.copy()
    OPS.mean_accumulate_(acc, g, F, 3, False)
    np.testing.assert_array_equal(acc, a + (ge - a) / t(3))
    OPS.mean_accumulate_(acc, g, F, 1, True)
    np.testing.assert_array_equal(acc, ge)
    acc = a.copy()
    OPS.sum_accumulate_(acc, g, F, False)
    np.testing.assert_array_equal(acc, ge + a)

    mu, nu = a.copy(), np.abs(b)
    bc1, bc2 = t(1) - t(0.9) ** 2, t(1) - t(0.999) ** 2
    m = t(0.1) * ge + t(0.9) * a
    v = t(1 - 0.999) * (ge * ge) + t(0.999) * np.abs(b)
    OPS.driver.map_(
        optimizers.adam_direction, F, (mu, nu, g, out), (0.9, 0.1, 0.999, 1 - 0.999, bc1, bc2, 1e-8, 0.0)
    )
    np.testing.assert_array_equal(mu, m)
    np.testing.assert_array_equal(nu, v)
    direction = (m / bc1) / (np.sqrt(v / bc2 + t(0)) + t(1e-8))
    np.testing.assert_allclose(out, direction, rtol=2e-7 if t is np.float32 else 1e-15)

    OPS.fill_(out, 0.0)
    assert not out.any()


def test_mixed_dtypes_compute_in_promoted_dtype():
    acc = np.zeros(3, np.float64)
    g = np.array([1.0, 2.0, 3.0], np.float32)
    OPS.sum_accumulate_(acc, g, Factor(), False)
    OPS.sum_accumulate_(acc, np.array([1e-12] * 3, np.float32), Factor(), False)
    assert acc[0] == 1.0 + float(np.float32(1e-12))


def test_serial_and_parallel_paths_agree():
    x = rand(200_000, np.float32)
    par = OPS.sumsq(x)
    old = _config.SERIAL_BELOW
    try:
        _config.SERIAL_BELOW = 1 << 40
        assert OPS.sumsq(x) == par
    finally:
        _config.SERIAL_BELOW = old


SCRIPT = textwrap.dedent(
    """
    import numpy as np, numbaccum as nba
    from numbaccum.backend import ops_for
    OPS = ops_for(np.zeros(1))
    x = np.random.default_rng(5).standard_normal(3_000_001).astype(np.float32)
    tree = {"a": x[:1_000_000].reshape(1000, 1000), "b": x[1_000_000:]}
    out = [OPS.sumsq(x), OPS.sumabs(x), nba.global_norm(tree)]
    out += list(OPS.segment_sumsq(x, np.array([0, 5, 2_000_000, 3_000_001], np.int64)))
    print(repr([float(v).hex() for v in out]))
    """
)


def test_same_bits_with_one_and_two_threads():
    same_stdout_with_one_and_two_threads(SCRIPT)


def test_concurrent_calls_from_threads_do_not_abort():
    import threading

    import numbaccum as nba

    errors = []

    def work(seed):
        try:
            p = {"w": rand(300_000, np.float32, seed)}
            tx = nba.MultiSteps(nba.adam(1e-3), 2)
            s = tx.init(p)
            for _ in range(6):
                _, s = tx.update(p, s, p)
            assert int(s.gradient_step) == 3
        except Exception as e:  # surfaced below; a crash would kill the process instead
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_an_array_passed_twice_is_sliced_once_and_gives_the_same_bits():
    """In place (the output is the input) the driver slices the buffer once, so LLVM vectorises
    the loop (`numbaccum.cpu.driver._source`'s alias): the same values as into another buffer."""
    from numbaccum.cpu import driver

    body, _ = driver._source(formulas.scale, ((False, False), "float32", False, (0, 0)))
    assert "v1 = v0" in body and "a1[lo:hi]" not in body
    x = rand(10_001, np.float32, 5)
    out = np.empty_like(x)
    OPS.scale_(out, x, F)
    OPS.scale_(x, x, F)
    np.testing.assert_array_equal(x, out)
