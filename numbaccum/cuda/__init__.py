"""CUDA backend: the kernel contract as ``numba.cuda`` kernels (imported only when CUDA arrays are
used; ``import numbaccum`` never imports ``numba.cuda``)."""

from .kernels import *  # noqa: F403
from .kernels import KERNELS

__all__ = list(KERNELS)
