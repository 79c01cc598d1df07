"""CUDA arrays in and out: zero-copy views, the caller's stream, and a clear error without CUDA.

Any array exposing ``__cuda_array_interface__`` (CuPy, PyTorch, numba) is viewed as a numba
device array with ``sync=False``: numba would otherwise synchronise on the producer's stream at
every conversion. Kernels are launched on the stream of the caller's framework (its current
stream), so the order with the caller's own work is kept without a host synchronisation. Results
go back as the caller's array type, again without a copy.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_state = threading.local()
_checked: list[bool] = []

INSTALL_HINT = (
    "numbaccum's CUDA backend needs a working CUDA driver and numba-cuda that can compile "
    "kernels with your NumPy: pip install 'numbaccum[cuda]' (numba-cuda 0.30 needs numpy<2.5)"
)


def cuda_module() -> Any:
    """``numba.cuda``, after a one-time check that kernels compile and run here."""
    try:
        from numba import cuda
    except Exception as e:  # pragma: no cover - depends on the installation
        raise RuntimeError(f"{INSTALL_HINT} (importing numba.cuda failed: {e})") from e
    if not _checked:
        try:
            from . import kernels

            probe = cuda.device_array(1, np.float32)
            kernels.fill_(probe, np.float32(1.0))
            ok = float(probe.copy_to_host()[0]) == 1.0
        except Exception as e:
            raise RuntimeError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
        if not ok:  # pragma: no cover
            raise RuntimeError(f"{INSTALL_HINT} (a test kernel gave a wrong result)")
        _checked.append(True)
    return cuda


def stream() -> Any:
    """The stream kernels are launched on: the caller's, or the default stream (0)."""
    return getattr(_state, "stream", 0)


class on_stream:
    """Context: launch on the current stream of the framework ``kind`` ('cupy' or 'torch')."""

    def __init__(self, kind: str) -> None:
        self._ptr = _framework_stream(kind)

    def __enter__(self) -> None:
        self._old = getattr(_state, "stream", 0)
        if self._ptr:
            from numba import cuda

            _state.stream = cuda.external_stream(self._ptr)

    def __exit__(self, *exc: Any) -> None:
        _state.stream = self._old


def _framework_stream(kind: str) -> int:
    if kind == "torch":
        import torch

        return int(torch.cuda.current_stream().cuda_stream)
    if kind == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def is_device_array(x: Any) -> bool:
    """A numba device array (real or simulated)."""
    return type(x).__name__ in ("DeviceNDArray", "FakeCUDAArray", "MappedNDArray", "ManagedNDArray")


def as_device_array(x: Any) -> Any:
    """A zero-copy numba view of a CUDA array (no synchronisation on its stream)."""
    if is_device_array(x):
        return x
    cuda = cuda_module()
    return cuda.as_cuda_array(x, sync=False)


def as_kind(x: Any, kind: str) -> Any:
    """A zero-copy view of the device array ``x`` as the caller's array type."""
    if kind == "cupy":
        import cupy

        return cupy.asarray(x)
    if kind == "torch":
        import torch

        return torch.as_tensor(x, device="cuda")
    return x


def data_pointer(x: Any) -> int | None:
    """Device address of ``x``'s first element (None in the simulator, which has none)."""
    try:
        return int(x.device_ctypes_pointer.value or 0)  # 0.2 us; the interface dict costs 2.3 us
    except AttributeError:
        cai = getattr(x, "__cuda_array_interface__", None)
        return None if cai is None else int(cai["data"][0])


def stream_handle(s: Any) -> int:
    """The CUDA handle of a numba stream (0 for the default stream)."""
    if isinstance(s, int):
        return s
    h = s.handle
    return int(h.value or 0) if hasattr(h, "value") else int(h)


def view_from_pointer(ptr: int, n: int, dtype: np.dtype, owner: Any) -> Any:
    """A 1-D device array of ``n`` elements at ``ptr``, kept alive by ``owner``."""
    cuda = cuda_module()
    desc = {
        "shape": (n,),
        "typestr": np.dtype(dtype).str,
        "data": (ptr, False),
        "version": 3,
        "strides": None,
    }
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


def empty(n: int, dtype: np.dtype) -> Any:
    return cuda_module().device_array(n, dtype, stream=stream())


def to_device(x: np.ndarray) -> Any:
    return cuda_module().to_device(np.ascontiguousarray(x), stream=stream())


def to_host(x: Any) -> np.ndarray:
    return x.copy_to_host(stream=stream())
