"""The one dispatch point: picks the kernel module for the arrays and prepares each call.

`call` casts Python scalars to the compute dtype of the call (the promoted dtype of its buffers),
so a float32 buffer never runs a float64 variant by accident; this mirrors optax's weak typing,
where ``decay`` is rounded to the leaf dtype. numba has no float16 on the CPU, so float16 buffers
are staged through float32 copies (compute in float32, round once on the way back).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

from . import cpu

_workqueue_lock = threading.Lock()
_guard: Any = None  # decided after the first parallel call


def _parallel_guard() -> Any:
    """A lock when numba fell back to the ``workqueue`` layer, which aborts the process when two
    threads enter parallel kernels at once (numba#9288); nothing for the thread-safe omp/tbb."""
    global _guard
    if _guard is None:
        import numba

        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet: be safe this once
            return _workqueue_lock
        _guard = _workqueue_lock if layer == "workqueue" else contextlib.nullcontext()
    return _guard


def is_cuda_array(x: Any) -> bool:
    """True for arrays that live on a CUDA device (without importing numba.cuda)."""
    return hasattr(x, "__cuda_array_interface__") or type(x).__module__.startswith("numba.cuda")


def kind_of(x: Any) -> str:
    """Which array type the caller uses: 'numpy', 'numba', 'cupy' or 'torch'."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    if isinstance(x, (np.ndarray, np.generic)):
        return "numpy"
    return "numba"


def launch_context(kind: str) -> Any:
    """Where an update's kernels go: the caller's current stream for CuPy and PyTorch arrays."""
    if kind in ("cupy", "torch"):
        from .cuda.device import on_stream

        return on_stream(kind)
    return contextlib.nullcontext()


def _call_cuda(name: str, args: tuple) -> Any:
    from .cuda.device import cuda_module

    cuda_module()  # one clear error, once, when CUDA cannot run kernels here
    from . import cuda as kernels  # the package: every kernel module's names

    arrays = [
        a for a in args if hasattr(a, "dtype") and hasattr(a, "shape") and not isinstance(a, np.generic)
    ]
    ctype = np.result_type(*(a.dtype for a in arrays)) if arrays else np.dtype(np.float64)
    scalar = (int, float, np.generic)
    run_args = [
        ctype.type(a) if isinstance(a, scalar) and not isinstance(a, (bool, np.bool_)) else a for a in args
    ]
    return getattr(kernels, name)(*run_args)


def call(name: str, *args: Any) -> Any:
    """Runs kernel ``name`` of the contract on ``args`` (buffers and scalars), on the CPU for
    NumPy buffers and on CUDA for device buffers."""
    if args and not isinstance(args[0], np.ndarray) and is_cuda_array(args[0]):
        return _call_cuda(name, args)
    staged: dict[int, np.ndarray] = {}  # id(float16 buffer) -> its float32 copy
    for a in args:
        if isinstance(a, np.ndarray) and a.dtype == np.float16 and id(a) not in staged:
            staged[id(a)] = a.astype(np.float32)
    run_args = [staged.get(id(a), a) if isinstance(a, np.ndarray) else a for a in args]
    arrays = [a for a in run_args if isinstance(a, np.ndarray)]
    ctype = np.result_type(*arrays) if arrays else np.dtype(np.float64)
    run_args = [a if isinstance(a, (np.ndarray, bool, np.bool_)) else ctype.type(a) for a in run_args]
    with _parallel_guard():
        result = getattr(cpu, name)(*run_args)
    for i in cpu.WRITES.get(name, ()) if staged else ():
        if id(args[i]) in staged:
            np.copyto(args[i], run_args[i], casting="same_kind")
    return result
