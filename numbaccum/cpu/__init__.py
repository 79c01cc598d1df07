"""CPU backend: the kernel contract as numba ``@njit`` loops.

Each module of the package contributes ``KERNELS`` (the names it exports) and ``WRITES`` (for each
in-place kernel, the positions of the arguments it writes); `numbaccum.cuda` mirrors the same
modules with the same names and signatures.
"""

from . import adaptive as _adaptive
from . import kernels as _core
from . import per_example as _per_example
from . import slices as _slices
from .adaptive import *  # noqa: F403
from .kernels import *  # noqa: F403
from .per_example import *  # noqa: F403
from .slices import *  # noqa: F403

_MODULES = (_core, _per_example, _adaptive, _slices)

KERNELS: tuple[str, ...] = tuple(name for m in _MODULES for name in m.KERNELS)
WRITES: dict[str, tuple[int, ...]] = {k: v for m in _MODULES for k, v in m.WRITES.items()}

__all__ = list(KERNELS)
