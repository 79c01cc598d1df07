"""Per-example (DP-SGD) kernels on the CPU: the weighted sum of a batch of gradients.

A per-example leaf of shape ``(B, *s)`` sits in its group as ``B`` contiguous runs of
``D = prod(s)`` elements: example ``b`` of leaf ``k`` starts at ``offsets[k] + b * D``. The squared
norm of every (leaf, example) run is a reduction of the one engine over the per-example table
(`numbaccum.tables.examples`: one slice per example of each leaf; one pass over the batch); this
module holds the second pass, which reads the batch once more and writes one ``D``-element sum
per leaf. It says only how the pass walks the buffers: the arithmetic of an element (which
examples count, where a sum starts, a term, the noise and clamp) is `numbaccum.formulas`'
(`example_counts`, `sum_start`, `add_example`, `noised_output`), compiled here and by CUDA.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _cache, formulas
from ..tables import segments
from .driver import guard_for, runs_serial
from .reduce import kept_kernel

__all__ = ["batch_weighted_sum_", "prepare_weighted_sum"]

# Output elements per work item: each example's row of a chunk is read as one 256 KiB run (the
# prefetchers follow it), against a float64 accumulator of 512 KiB that stays in L2. Measured on
# the 2-core VM (64 x 1M float32): 2048 elements per item 10-15 ms, 65536 with four rows per sweep
# 6.4 ms (the same bits: each element still adds its examples in order).
BATCH_CHUNK = 1 << 16

# The arithmetic of an element (`numbaccum.formulas`, shared with CUDA); this module only walks.
_jit = njit(inline="always", error_model="numpy")
_counts = formulas.compile_formula(formulas.example_counts, _jit)
_start = formulas.compile_formula(formulas.sum_start, _jit)
_add = formulas.compile_formula(formulas.add_example, _jit)
_output = formulas.compile_formula(formulas.noised_output, _jit)


def _weighted_sum(parallel):
    @_cache.cached
    @njit(parallel=parallel, error_model="numpy")
    @_cache.identified("parallel" if parallel else "serial")  # one code, two kernels
    def run(
        out, g, offsets, out_offsets, mult, noise, std, div, limit, init, has_init, items
    ):  # pragma: no cover
        batch = mult.shape[1]
        for c in prange(items.shape[0]):
            k = items[c, 0]
            lo, hi = out_offsets[k] + items[c, 3], out_offsets[k] + items[c, 4]
            size = out_offsets[k + 1] - out_offsets[k]
            first = offsets[k] + (lo - out_offsets[k])
            w = hi - lo
            active = np.empty(batch, np.int64)  # the examples that count, in order
            na = 0
            for b in range(batch):
                if _counts(mult[k, b]):
                    active[na] = b
                    na += 1
            acc = np.empty(w, np.float64)
            for j in range(w):
                acc[j] = _start(init, lo + j, has_init)
            q = 0
            while q + 4 <= na:  # four rows per sweep of the accumulator, added in example order
                b0, b1, b2, b3 = active[q], active[q + 1], active[q + 2], active[q + 3]
                m0, m1, m2, m3 = mult[k, b0], mult[k, b1], mult[k, b2], mult[k, b3]
                r0 = g[first + b0 * size : first + b0 * size + w]
                r1 = g[first + b1 * size : first + b1 * size + w]
                r2 = g[first + b2 * size : first + b2 * size + w]
                r3 = g[first + b3 * size : first + b3 * size + w]
                for j in range(w):
                    a = _add(acc[j], m0, r0[j])
                    a = _add(a, m1, r1[j])
                    a = _add(a, m2, r2[j])
                    acc[j] = _add(a, m3, r3[j])
                q += 4
            while q < na:
                b = active[q]
                m = mult[k, b]
                r = g[first + b * size : first + b * size + w]
                for j in range(w):
                    acc[j] = _add(acc[j], m, r[j])
                q += 1
            o = out[lo:hi]
            for j in range(w):
                o[j] = _output(acc[j], noise, lo + j, std, div, limit)

    return run


_WEIGHTED_SUM = (_weighted_sum(True), _weighted_sum(False))


def batch_weighted_sum_(out, g, offsets, out_offsets, mult, noise, std, div, limit, init, has_init):
    """out[k][j] = clamp((sum_b mult[k, b] * g[k][b, j] + std * noise[k][j]) / div, +-limit), the
    sum starting from ``init[k][j]`` (float64, the output's layout) when ``has_init``.

    ``offsets`` are the per-example group's leaf boundaries, ``out_offsets`` the output's (each
    ``B`` times smaller); ``mult`` is float64 ``(leaves, B)``; ``noise`` is read only when
    ``std != 0``. Sums run in float64 in example order; examples with ``mult == 0`` are skipped.
    """
    if out.dtype.itemsize == 2 or g.dtype.itemsize == 2 or noise.dtype.itemsize == 2:
        # numba has neither float16 nor bfloat16 on the CPU: read through float32 copies
        # (exact), round once.
        out32 = out.astype(np.float32)
        batch_weighted_sum_(
            out32,
            g.astype(np.float32),
            offsets,
            out_offsets,
            mult,
            noise.astype(np.float32),
            std,
            div,
            limit,
            init.astype(np.float32) if init.dtype.itemsize == 2 else init,
            has_init,
        )
        out[...] = out32
        return
    run = _WEIGHTED_SUM[1] if runs_serial(g.size) else _WEIGHTED_SUM[0]
    # The output's leaves cut into fixed items of BATCH_CHUNK elements (a segments table's work).
    items = segments(out_offsets).work(BATCH_CHUNK, False).items
    with guard_for(g.size):  # numba's workqueue layer aborts on concurrent parallel calls
        run(out, g, offsets, out_offsets, mult, noise, std, div, limit, init, has_init, items)


def prepare_weighted_sum(out, g, offsets, out_offsets, init):
    """`batch_weighted_sum_` over these very buffers, as ``run(mult, noise, std, div, limit)``
    (float64 scalars and arrays: numbaccum's noise is float64), the sum from ``init`` or, when
    None, from 0: its items are found once, its kernel kept (`numbaccum.cpu.reduce.kept_kernel`:
    below `_config.SERIAL_BELOW` the serial driver's compiled function, called without numba's
    dispatch; above it the pair behind its guard, asked at each call) -- the same kernel over the
    same items: the same bits. What a declared DP aggregation keeps
    (`numbaccum.backend.prepare_weighted_sum`). float16 and bfloat16 buffers take the call."""
    has_init, start = init is not None, _FROM_ZERO if init is None else init
    if out.dtype.itemsize == 2 or g.dtype.itemsize == 2:
        return lambda mult, noise, std, div, limit: batch_weighted_sum_(
            out, g, offsets, out_offsets, mult, noise, std, div, limit, start, has_init
        )
    items = segments(out_offsets).work(BATCH_CHUNK, False).items
    kernel = kept_kernel(_WEIGHTED_SUM, g.size)

    def run(mult, noise, std, div, limit):
        kernel[0](out, g, offsets, out_offsets, mult, noise, std, div, limit, start, has_init, items)

    return run


_FROM_ZERO = np.zeros(1, np.float64)  # the init a sum from 0 passes (never read)
