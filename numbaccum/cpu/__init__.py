"""CPU backend: the kernel contract as numba ``@njit`` loops."""

from .kernels import *  # noqa: F403
from .kernels import KERNELS

__all__ = list(KERNELS)
