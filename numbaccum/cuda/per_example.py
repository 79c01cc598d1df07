"""Per-example (DP-SGD) kernels on CUDA: the twin of `numbaccum.cpu.per_example`.

One CUDA block covers a fixed run of one leaf's output elements; each thread sums its elements
over the batch in example order (float64, no atomics: the same bits on every run), reading
consecutive addresses across the threads of a warp for each example. The arithmetic of an
element is `numbaccum.formulas`' (`example_counts`, `sum_start`, `add_example`,
`noised_output`), the one the CPU compiles too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from .. import _config, formulas
from ..arrays import stream
from ..tables import segments
from . import driver
from .cache import cached
from .reduce import through_float32

__all__ = ["batch_weighted_sum_"]


_dev = cuda.jit(device=True, inline=True)
_counts = formulas.compile_formula(formulas.example_counts, _dev)
_start = formulas.compile_formula(formulas.sum_start, _dev)
_add = formulas.compile_formula(formulas.add_example, _dev)
_output = formulas.compile_formula(formulas.noised_output, _dev)


@cached
@cuda.jit
def _weighted_sum(
    out, g, offsets, out_offsets, items, mult, noise, std, div, limit, init, has_init
):  # pragma: no cover
    blk = cuda.blockIdx.x
    k = items[blk, 0]
    size = out_offsets[k + 1] - out_offsets[k]
    i = out_offsets[k] + items[blk, 3] + cuda.threadIdx.x
    stop = out_offsets[k] + items[blk, 4]
    while i < stop:
        src = offsets[k] + (i - out_offsets[k])
        acc = _start(init, i, has_init)
        for b in range(mult.shape[1]):
            m = mult[k, b]
            if _counts(m):
                acc = _add(acc, m, g[src + b * size])
        out[i] = _output(acc, noise, i, std, div, limit)
        i += cuda.blockDim.x


_OFFSETS: dict[bytes, Any] = {}


def _device_offsets(offsets: np.ndarray) -> Any:
    """A device copy of an offsets table (cached: layouts keep theirs for life)."""
    key = offsets.tobytes()
    hit = _OFFSETS.get(key)
    if hit is None:
        if len(_OFFSETS) > 256:
            _OFFSETS.clear()
        hit = _OFFSETS[key] = cuda.to_device(offsets)
    return hit


def _on_device(x: Any) -> Any:
    return cuda.to_device(np.ascontiguousarray(x), stream=stream()) if isinstance(x, np.ndarray) else x


@through_float32(0)  # bfloat16 buffers (the output, gradients, noise, start) through float32
def batch_weighted_sum_(out, g, offsets, out_offsets, mult, noise, std, div, limit, init, has_init):
    """out[k][j] = clamp((sum_b mult[k, b] * g[k][b, j] + std * noise[k][j]) / div, +-limit), the
    sum starting from ``init[k][j]`` (the output's layout) when ``has_init``.

    ``offsets`` are the per-example group's leaf boundaries, ``out_offsets`` the output's (each
    ``B`` times smaller); ``mult`` is float64 ``(leaves, B)``; ``noise`` is read only when
    ``std != 0``. Sums run in float64 in example order; examples with ``mult == 0`` are skipped.
    Host ``mult`` and ``noise`` are copied to the device first.
    """
    out_offsets = np.asarray(out_offsets, np.int64)
    # A few elements per thread: enough blocks to fill the GPU for a 1M-parameter output (the
    # output's leaves cut into fixed items: a segments table's work).
    work = segments(out_offsets).work(4 * _config.CUDA_THREADS, False)
    nblocks = work.items.shape[0]
    if not nblocks:
        return
    items = work.device.get("cuda items")
    if items is None:
        items = work.device["cuda items"] = cuda.to_device(work.items)
    driver.LAUNCHES[0] += 1
    _weighted_sum[nblocks, _config.CUDA_THREADS, stream()](
        out,
        g,
        _device_offsets(np.asarray(offsets, np.int64)),
        _device_offsets(out_offsets),
        items,
        _on_device(mult),
        _on_device(noise),
        std,
        div,
        limit,
        _on_device(init),
        has_init,
    )
