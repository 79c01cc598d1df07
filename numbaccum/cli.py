"""Command line: ``numbaccum info`` and ``numbaccum bench`` (also ``python -m numbaccum``)."""

from __future__ import annotations

import argparse
import os
import sys


def info() -> int:
    """Prints versions, threads, the threading layer, the kernel cache and CUDA status."""
    import numba
    import numpy as np

    import numbaccum
    from numbaccum._cache import describe as describe_cache
    from numbaccum.backend import ops_for

    x = np.ones(1 << 17, np.float32)
    ops_for(x).sumsq(x)  # enter a parallel region: numba picks its threading layer
    print(f"numbaccum {numbaccum.__version__}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, numba {numba.__version__}")
    print(f"threads: {numba.get_num_threads()} of {os.cpu_count()} cpus, layer {numba.threading_layer()}")
    print(f"kernel cache: {describe_cache()}")
    print(f"cuda: {_cuda_status()}")
    from numbaccum.distributed import describe

    print(f"mpi: {describe()}")  # imports mpi4py (and so starts MPI) only here, never on import
    return 0


def _cuda_status() -> str:
    try:
        from numba import cuda
    except Exception as e:  # pragma: no cover - depends on the installation
        return f"numba.cuda cannot be imported ({e})"
    if not cuda.is_available():
        return "no CUDA device or driver (CUDA arrays would raise a clear error; NumPy works)"
    from numbaccum.cuda.device import cuda_module

    try:
        cuda_module()
    except RuntimeError as e:
        return str(e)
    from numba import config

    if getattr(config, "ENABLE_CUDASIM", False) or not hasattr(cuda, "get_current_device"):
        return "available (the numba CUDA simulator)"
    name = cuda.get_current_device().name
    return f"available: {name.decode() if isinstance(name, bytes) else name}"


def _version() -> str:
    import numbaccum

    return numbaccum.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="numbaccum")
    parser.add_argument("--version", action="version", version=f"numbaccum {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, threads and backends")
    sub.add_parser("bench", help="time numbaccum against NumPy and its peers here", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        return info()
    from numbaccum.bench.runner import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
