"""CUDA kernels in the on-disk kernel cache (`numbaccum._cache`): numba's CUDA cache (one entry per
signature and compute capability), in our directory, with the same locks and content-hashed keys
as the CPU kernels. The CUDA simulator runs Python, not compiled code: nothing is cached there."""

from __future__ import annotations

from typing import Any

from numba import config

from .. import _cache

__all__ = ["cached"]

_CLASS: list[Any] = []  # the cache class, built on first use (it imports numba's CUDA dispatcher)


def _cache_class() -> Any:
    if not _CLASS:
        from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

        class _Impl(CUDACacheImpl):
            _locator_classes: list[Any] = [_cache.Locator]  # numba's: list[type[object]] (see _cache)

        class _Cache(_cache.LockedCache, CUDACache):
            _impl_class = _Impl

        _CLASS.append(_Cache)
    return _CLASS[0]


def cached(kernel: Any) -> Any:
    """``kernel`` (a ``cuda.jit`` kernel, before its first compile) named after what it computes
    (`numbaccum._cache.named`) with its compiled code kept in the cache directory; only named in
    the simulator or when the cache is off."""
    _cache.named(kernel)
    if getattr(config, "ENABLE_CUDASIM", False) or not hasattr(kernel, "enable_caching"):
        return kernel
    if _cache.root() is None:
        return kernel
    try:
        cls = _cache_class()
    except Exception:  # a numba without a CUDA cache: compile in memory
        return kernel
    return _cache.cached(kernel, cls)
