"""Command line: ``numbaccum info`` and ``numbaccum bench`` (also ``python -m numbaccum``)."""

from __future__ import annotations

import argparse
import os
import sys


def info() -> int:
    """Prints versions, threads, the threading layer, CUDA status and the numba cache dir."""
    import numba
    import numpy as np

    import numbaccum
    from numbaccum import backend

    backend.call("sumsq", np.ones(1 << 17, np.float32))  # enter a parallel region: picks the layer
    print(f"numbaccum {numbaccum.__version__}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, numba {numba.__version__}")
    print(f"threads: {numba.get_num_threads()} of {os.cpu_count()} cpus, layer {numba.threading_layer()}")
    cache_dir = getattr(numba.config, "CACHE_DIR", "") or "(next to the sources; NUMBA_CACHE_DIR moves it)"
    print(f"numba cache dir: {cache_dir}; numbaccum kernels compile on first use (not cached)")
    print("cuda: not supported by this build (NumPy arrays only)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="numbaccum")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, threads and backends")
    sub.add_parser("bench", help="time numbaccum against NumPy on this machine", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        return info()
    from numbaccum.bench.runner import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
