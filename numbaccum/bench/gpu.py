"""The CUDA side of `numbaccum bench`: whether a GPU works, how calls are timed on it, and the
device-to-device copy that is its roof (the approach of ``benchmarks/gpu_bench.py``).

``numba.cuda`` is imported only by these functions, when the CUDA device is benchmarked.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import Any

NO_DEVICE = "no CUDA device or driver"


def status() -> tuple[bool, bool, str]:
    """``(works, simulated, description)`` of the CUDA device numbaccum would use."""
    try:
        from numba import config, cuda
    except Exception as e:  # pragma: no cover - depends on the installation
        return False, False, f"numba.cuda cannot be imported ({e})"
    simulated = bool(getattr(config, "ENABLE_CUDASIM", False))
    if not cuda.is_available():
        return False, False, NO_DEVICE
    from numbaccum.cuda.device import cuda_module

    try:
        cuda_module()
    except RuntimeError as e:
        return False, simulated, str(e)
    if simulated or not hasattr(cuda, "get_current_device"):
        return True, True, "the numba CUDA simulator"
    name = cuda.get_current_device().name
    return True, False, name.decode() if isinstance(name, bytes) else str(name)


class Clock:
    """Times one call on the GPU: between two CUDA events on the default stream, where numba's
    launches (and PyTorch's, on its default stream) go. The simulator has no timing events: there,
    and with ``wall=True`` (optax, whose step blocks until its result is ready), wall time between
    two device synchronisations."""

    def __init__(self, wall: bool = False) -> None:
        from numba import cuda

        self._cuda = cuda
        self._events: tuple[Any, Any] | None = None
        if not wall:
            try:
                # (mypy may see the simulator's event(), which takes no arguments)
                self._events = (cuda.event(timing=True), cuda.event(timing=True))  # type: ignore[call-arg]
            except TypeError:  # the simulator's events take no arguments and do not time
                self._events = None

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self._events is None:
            self._cuda.synchronize()
            t = time.perf_counter()
            fn()
            self._cuda.synchronize()
            return time.perf_counter() - t
        start, stop = self._events
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return self._cuda.event_elapsed_time(start, stop) / 1e3


def copy_roof(n_floats: int, repeats: int) -> float:
    """GB/s (read + write bytes) of a device-to-device copy of ``n_floats`` float32 values: the
    roof an elementwise kernel on the device can reach."""
    import numpy as np
    from numba import cuda

    a = cuda.to_device(np.ones(max(n_floats, 1), np.float32))
    b = cuda.device_array_like(a)
    clock = Clock()
    b.copy_to_device(a)
    best = min(clock(lambda: b.copy_to_device(a)) for _ in range(max(repeats, 3)))
    return 2 * a.nbytes / best / 1e9


def free() -> None:
    """Returns the device memory of the implementation just timed (numba's pending frees,
    PyTorch's cache) before the next one allocates."""
    gc.collect()
    from numba import cuda

    ctx = cuda.current_context()
    if hasattr(ctx, "deallocations"):
        ctx.deallocations.clear()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
