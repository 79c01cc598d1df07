"""Per-example (DP-SGD) kernels on the CPU: the weighted sum of a batch of gradients.

A per-example leaf of shape ``(B, *s)`` sits in its group as ``B`` contiguous runs of
``D = prod(s)`` elements: example ``b`` of leaf ``k`` starts at ``offsets[k] + b * D``. The squared
norm of every (leaf, example) run is `segment_sumsq` over a finer offsets table (one pass over the
batch); this module holds the second pass, which reads the batch once more and writes one
``D``-element sum per leaf.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .. import _config
from .kernels import _segment_blocks

__all__ = ["batch_weighted_sum_"]

# Output elements per work item: a float64 accumulator of 2048 elements (16 KiB) stays in L1 while
# the B example rows of that chunk stream past it, so each row is read once, contiguously.
BATCH_CHUNK = 2048


def _weighted_sum(parallel):
    @njit(parallel=parallel, error_model="numpy")
    def run(out, g, offsets, out_offsets, mult, noise, std, div, limit, chunk):  # pragma: no cover
        starts, stops, seg = _segment_blocks(out_offsets, chunk)
        batch = mult.shape[1]
        for c in prange(starts.size):
            k = seg[c]
            lo, hi = starts[c], stops[c]
            size = out_offsets[k + 1] - out_offsets[k]
            first = offsets[k] + (lo - out_offsets[k])
            acc = np.zeros(hi - lo, np.float64)
            for b in range(batch):  # in example order: the same bits for any thread count
                m = mult[k, b]
                if m != 0.0:  # a dropped example is skipped, not multiplied: 0 * NaN is NaN
                    row = g[first + b * size : first + b * size + (hi - lo)]
                    for j in range(row.size):
                        acc[j] += m * np.float64(row[j])
            o = out[lo:hi]
            for j in range(o.size):
                v = acc[j]
                if std != 0.0:
                    v += std * noise[lo + j]
                v = v / div
                if v > limit:
                    v = limit
                elif v < -limit:
                    v = -limit
                o[j] = v

    return run


_WEIGHTED_SUM = (_weighted_sum(True), _weighted_sum(False))


def batch_weighted_sum_(out, g, offsets, out_offsets, mult, noise, std, div, limit):
    """out[k][j] = clamp((sum_b mult[k, b] * g[k][b, j] + std * noise[k][j]) / div, +-limit).

    ``offsets`` are the per-example group's leaf boundaries, ``out_offsets`` the output's (each
    ``B`` times smaller); ``mult`` is float64 ``(leaves, B)``; ``noise`` is read only when
    ``std != 0``. Sums run in float64 in example order; examples with ``mult == 0`` are skipped.
    """
    run = _WEIGHTED_SUM[1] if g.size < _config.SERIAL_BELOW else _WEIGHTED_SUM[0]
    run(out, g, offsets, out_offsets, mult, noise, std, div, limit, BATCH_CHUNK)


KERNELS = ("batch_weighted_sum_",)

# Arguments each in-place kernel writes (index into its argument list).
WRITES: dict[str, tuple[int, ...]] = {"batch_weighted_sum_": (0,)}
