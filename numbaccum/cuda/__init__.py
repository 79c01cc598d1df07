"""The CUDA backend: how to walk a buffer with ``numba.cuda`` kernels, never what to compute.

Same modules and primitives as `numbaccum.cpu` (`driver`, `reduce`, `per_example`), plus `device`:
the one clear error when numba-cuda cannot compile kernels here. Imported only when CUDA arrays
are used: ``import numbaccum`` never imports ``numba.cuda``.
"""
