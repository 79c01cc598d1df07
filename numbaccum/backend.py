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

from . import _config, cpu
from .arrays import is_cuda_array

_workqueue_lock = threading.Lock()
_NO_GUARD = contextlib.nullcontext()
_guard: Any = None  # decided after the first parallel call
_F16 = np.dtype(np.float16)
_F64 = np.dtype(np.float64)
_AS_IS = (np.ndarray, bool, np.bool_)  # arguments passed through uncast
_UNCAST: dict[type, frozenset] = {}  # per compute type: argument types that need no cast


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
        _guard = _workqueue_lock if layer == "workqueue" else _NO_GUARD
    return _guard


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
    if args and type(args[0]) is not np.ndarray and is_cuda_array(args[0]):
        return _call_cuda(name, args)
    dtypes = [a.dtype for a in args if isinstance(a, np.ndarray)]
    if not dtypes:
        ctype = _F64
    else:  # the compute dtype: one dtype (the common case) needs no promotion
        ctype = dtypes[0]
        if dtypes.count(ctype) != len(dtypes):
            if _F16 in set(dtypes):  # hashing first: == between dtypes is slow
                return _call_staged(name, args)
            ctype = np.result_type(*[a for a in args if isinstance(a, np.ndarray)])
        elif ctype.type is np.float16:
            return _call_staged(name, args)
    cast = ctype.type
    ok = _UNCAST.get(cast)
    if ok is None:
        ok = _UNCAST[cast] = frozenset((np.ndarray, bool, np.bool_, cast))
    # Python floats first: most scalars are, and they always need the cast.
    run_args = [
        cast(a) if type(a) is float else a if type(a) in ok or isinstance(a, _AS_IS) else cast(a)
        for a in args
    ]
    guard = _guard
    if guard is None:
        # Ask numba for its layer only after a call big enough to have entered a parallel region
        # (asking before raises, which costs more than a small tree's kernel); lock until then.
        big = isinstance(args[0], np.ndarray) and args[0].size >= _config.SERIAL_BELOW
        guard = _parallel_guard() if big else _workqueue_lock
    kernel = getattr(cpu, name)
    if guard is _NO_GUARD:
        return kernel(*run_args)
    with guard:
        return kernel(*run_args)


def _call_staged(name: str, args: tuple) -> Any:
    """`call` with float16 buffers: each computed through a float32 copy, written back once."""
    staged: dict[int, np.ndarray] = {}  # id(float16 buffer) -> its float32 copy
    for a in args:
        if isinstance(a, np.ndarray) and a.dtype == np.float16 and id(a) not in staged:
            staged[id(a)] = a.astype(np.float32)
    run_args = [staged.get(id(a), a) if isinstance(a, np.ndarray) else a for a in args]
    arrays = [a for a in run_args if isinstance(a, np.ndarray)]
    ctype = np.result_type(*arrays)
    run_args = [a if isinstance(a, _AS_IS) else ctype.type(a) for a in run_args]
    with _parallel_guard():
        result = getattr(cpu, name)(*run_args)
    for i in cpu.WRITES.get(name, ()):
        if id(args[i]) in staged:
            np.copyto(args[i], run_args[i], casting="same_kind")
    return result


_OPS: dict[str, Any] = {}


def ops_for(x: Any) -> Any:
    """The kernel contract (`numbaccum.contract.Ops`) for the backend that holds buffer ``x``:
    the CPU driver for NumPy arrays, the CUDA driver for device arrays (numba.cuda is imported
    only then, with one clear error if it cannot compile kernels here)."""
    if type(x) is np.ndarray:
        return _OPS.get("cpu") or _make_ops("cpu")
    if is_cuda_array(x):
        return _OPS.get("cuda") or _make_ops("cuda")
    return _OPS.get("cpu") or _make_ops("cpu")


def _make_ops(name: str) -> Any:
    from .contract import Ops

    if name == "cuda":
        from .cuda.device import cuda_module

        cuda_module()  # one clear error, once, when CUDA cannot run kernels here
        from .cuda import driver
    else:
        from .cpu import driver  # type: ignore[no-redef]
    ops = _OPS[name] = Ops(driver)
    return ops
