"""Knobs read at call time. Change them before a call to take effect for that call."""

from __future__ import annotations

# Elements per block of every reduction. The partition depends on the buffer size only, so a
# norm has the same bits for any thread count. 2**14 float64 partials cover 2**30 elements.
REDUCE_BLOCK = 1 << 16

# Elements per parallel chunk of elementwise kernels: 128 KiB of float32, large enough to amortise
# scheduling, small enough that two cores stay busy on a 1M-element tree.
CHUNK = 1 << 15

# Below this many elements a kernel runs serially: entering a parallel region costs microseconds,
# more than a small tree's whole update.
SERIAL_BELOW = 1 << 16
