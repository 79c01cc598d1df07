"""Streaming stores of large outputs (`numbaccum.cpu.streaming`): the same bits as plain stores.

The CPU driver writes a float output of at least ``_config.STREAM_BYTES`` with streaming stores:
each block of the output is computed into scratch, then copied out one element at a time up to
a 32-byte boundary, in 32-byte vectors, then the tail. These tests lower the threshold so small
buffers take that path, and compare with the plain drivers on every alignment and length around
the block and vector sizes, with states and outputs together, bfloat16 inputs, threads, and the
choice itself (which outputs stream, and not where an input is the output, nor off x86-64).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _testutil import require

from numbaccum import _config
from numbaccum import formulas as F
from numbaccum.contract import ONE, Factor
from numbaccum.cpu import driver, streaming

pytestmark = pytest.mark.skipif(not streaming.available(), reason="streaming stores are x86-64's")


@pytest.fixture
def stream_all(monkeypatch):
    """Every parallel call with a float output streams it (the threshold at one byte)."""
    monkeypatch.setattr(_config, "SERIAL_BELOW", 1, raising=True)
    monkeypatch.setattr(_config, "CHUNK", 3000, raising=True)  # not a multiple of BLOCK
    monkeypatch.setattr(_config, "STREAM_BYTES", 1, raising=True)


def _variant_of(f, arrays):
    return driver._variant(
        f, arrays, np.result_type(*arrays), False, driver._passed_twice(arrays)
    )[1]


SIZES = [1, 7, 8, 9, 1023, 1024, 1025, 2999, 3000, 3001, 10_007]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1, 3, 5])
def test_scale_out_of_place_has_the_plain_bits_at_every_alignment(stream_all, dtype, offset):
    rng = np.random.default_rng(offset)
    for n in SIZES:
        x = rng.standard_normal(n + 8).astype(dtype)[offset : offset + n]
        out = np.full(n + 16, -7.0, dtype)  # guards on both sides
        dst = out[offset + 1 : offset + 1 + n]
        assert _variant_of(F.scale, (x, dst))[2]
        driver.map_(F.scale, Factor(3.0, 0.5), (x, dst), ())
        assert np.array_equal(dst, (x / dtype(3.0)) * dtype(0.5)), n
        assert np.all(out[: offset + 1] == -7.0) and np.all(out[offset + 1 + n :] == -7.0), n


def test_states_and_outputs_together(stream_all):
    """ema: its state written in place (plain stores), its output streamed."""
    rng = np.random.default_rng(1)
    for n in SIZES:
        g = rng.standard_normal(n)
        ema, out = rng.standard_normal(n), np.empty(n)
        want_ema = 0.1 * g + 0.9 * ema
        variant = _variant_of(F.ema, (ema, g, out))
        assert variant[2]
        driver.map_(F.ema, ONE, (ema, g, out), (0.1, 0.9, 0.5))
        assert np.array_equal(ema, want_ema) and np.array_equal(out, want_ema / 0.5), n


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_bfloat16_outputs_stream_their_bits(stream_all, offset):
    """bfloat16 in, float32 out; bfloat16 out (its raw bits streamed), at every alignment."""
    bf16 = require("ml_dtypes").bfloat16
    for n in SIZES:
        x = np.random.default_rng(n).standard_normal(n + 3).astype(bf16)[offset : offset + n]
        out = np.empty(n, np.float32)
        driver.map_(F.scale, Factor(2.0, 1.0), (x, out), ())
        assert np.array_equal(out, x.astype(np.float32) / np.float32(2.0)), n
        back = np.zeros(n + 4, bf16)
        dst = back[offset : offset + n]
        driver.map_(F.scale, Factor(3.0, 1.0), (x, dst), ())
        want = (x.astype(np.float32) / np.float32(3.0)).astype(bf16)
        assert np.array_equal(dst.view(np.uint16), want.view(np.uint16)), n
        assert not np.any(back[:offset].view(np.uint16)) and not np.any(back[offset + n :].view(np.uint16))


def test_threads_share_the_streaming_kernels(stream_all):
    """Eight threads, each its own buffers through the same compiled variant."""
    xs = [np.random.default_rng(i).standard_normal(20_000).astype(np.float32) for i in range(8)]
    outs = [np.empty_like(x) for x in xs]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                driver.map_(F.scale, Factor(1.0, float(i + 1)), (xs[i], outs[i]), ())
                assert np.array_equal(outs[i], xs[i] * np.float32(i + 1))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_which_calls_stream(monkeypatch):
    monkeypatch.setattr(_config, "SERIAL_BELOW", 1, raising=True)
    x, out = np.ones(1000, np.float32), np.empty(1000, np.float32)
    monkeypatch.setattr(_config, "STREAM_BYTES", 4000, raising=True)
    assert _variant_of(F.scale, (x, out))[2]  # 4000 bytes: at the threshold
    monkeypatch.setattr(_config, "STREAM_BYTES", 4001, raising=True)
    assert _variant_of(F.scale, (x, out)) is None  # below it: the plain drivers
    monkeypatch.setattr(_config, "STREAM_BYTES", 1, raising=True)
    # in place (the output is the input): not streamed, and sliced once (`driver._source`'s alias)
    assert _variant_of(F.scale, (x, x)) == ((False, False), "float32", False, (0, 0))
    ema = np.zeros(1000, np.float32)
    assert _variant_of(F.ema, (ema, x, out))[2]  # an output beside a state
    assert _variant_of(F.mean_accumulate, (ema, x)) is None  # states only: nothing to stream
    monkeypatch.setattr(_config, "SERIAL_BELOW", 1 << 20, raising=True)
    assert _variant_of(F.scale, (x, out)) is None  # a serial call: small, in cache
    monkeypatch.setattr(_config, "SERIAL_BELOW", 1, raising=True)
    monkeypatch.setattr(streaming, "available", lambda: False)
    assert _variant_of(F.scale, (x, out)) is None  # not x86-64


def test_the_default_threshold_is_larger_than_a_cache():
    assert _config.STREAM_BYTES >= 8 << 20
