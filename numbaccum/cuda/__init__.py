"""CUDA backend: the kernel contract as ``numba.cuda`` kernels (imported only when CUDA arrays are
used; ``import numbaccum`` never imports ``numba.cuda``). Same modules, names and signatures as
`numbaccum.cpu`."""

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

__all__ = list(KERNELS)
