"""The CUDA driver check: one clear error, once, when numba-cuda cannot compile and run kernels.

Everything else about CUDA arrays (views, device memory, pointers, the caller's stream) is
`numbaccum.arrays`. This module compiles its own one-line probe kernel, so it imports no kernel
module of the backend and any of them may import it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import INSTALL_HINT, cuda_api

__all__ = ["cuda_module"]

_checked: list[bool] = []
_probe: list[Any] = []  # the compiled probe kernel, kept so a retry does not compile it again


def _set_one(a: Any) -> None:
    a[0] = 1.0


def cuda_module() -> Any:
    """``numba.cuda``, after a one-time check that kernels compile and run here.

    Raises:
        RuntimeError: with the install hint, when numba.cuda cannot be imported, no driver is
            found, or a kernel fails to compile or gives a wrong result (numba-cuda 0.30 with
            NumPy 2.5 fails while compiling).
    """
    cuda = cuda_api()
    if not _checked:
        try:
            if not _probe:
                _probe.append(cuda.jit(_set_one))
            probe = cuda.device_array(1, np.float32)
            _probe[0][1, 1](probe)
            ok = float(probe.copy_to_host()[0]) == 1.0
        except Exception as e:
            raise RuntimeError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
        if not ok:  # pragma: no cover
            raise RuntimeError(f"{INSTALL_HINT} (a test kernel gave a wrong result)")
        _checked.append(True)
    return cuda
