"""Where the time of a small CUDA update goes: numba's launch paths, then whole updates profiled.

    python benchmarks/cuda_launch.py [--profile]

Prints the host cost of one launch of a trivial kernel through ``kernel[grid, block, stream](...)``
and through the compiled kernel's own ``launch`` (no typing, no overload lookup), with 2 and 9
arguments; then the wall time per ``update`` of ema, MultiSteps and clip_by_global_norm on the
tiny and the 2000-small-leaf trees, and with ``--profile`` the top of a cProfile of the clip.

Finding (H100, 2026-11-23): a launch costs 27-31 us with 2 arguments and 58-68 us with 9, and a
launcher that packed the parameters itself and called ``cuLaunchKernel`` cut that to 14 / 23 us --
but whole updates did not move (tiny tree: ema 58 vs 66 us, clip 81 vs 83 us; 2000 leaves: equal
within noise), so numbaccum keeps numba's launch path.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numba import cuda  # noqa: E402

import numbaccum as nba  # noqa: E402
from numbaccum.bench import workloads  # noqa: E402


@cuda.jit
def _two(n, x):  # pragma: no cover - compiled
    i = cuda.grid(1)
    if i < n:
        x[i] = 1.0


@cuda.jit
def _nine(n, out, x, div, mul, fac, a, b, c):  # pragma: no cover - compiled
    i = cuda.grid(1)
    if i < n:
        out[i] = (x[i] / div) * mul + a * b * c + fac[0]


def per_call(fn, calls: int = 2000) -> float:
    fn()
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def launch_paths() -> None:
    x = cuda.device_array(1024, np.float32)
    y = cuda.device_array(1024, np.float32)
    fac = cuda.device_array(2, np.float32)
    f = np.float32(1.5)
    n = np.int64(1024)
    two = (n, x)
    nine = (n, y, x, f, f, fac, f, f, f)
    s = cuda.default_stream()
    rows = [
        ("2 args, kernel[4, 256]", lambda: _two[4, 256](*two)),
        ("2 args, kernel[4, 256, stream]", lambda: _two[4, 256, s](*two)),
        ("9 args, kernel[4, 256, stream]", lambda: _nine[4, 256, s](*nine)),
    ]
    _two[4, 256](*two)
    _nine[4, 256](*nine)
    k2 = next(iter(_two.overloads.values()))
    k9 = next(iter(_nine.overloads.values()))
    rows += [
        ("2 args, compiled.launch", lambda: k2.launch(two, (4, 1, 1), (256, 1, 1), s)),
        ("9 args, compiled.launch", lambda: k9.launch(nine, (4, 1, 1), (256, 1, 1), s)),
    ]
    rows += [
        ("__cuda_array_interface__ data pointer", lambda: x.__cuda_array_interface__["data"][0]),
        ("device_ctypes_pointer.value", lambda: x.device_ctypes_pointer.value),
    ]
    for name, fn in rows:
        print(f"{name:40s} {per_call(fn):8.1f} us/launch")


def updates(profile: bool) -> None:
    for label, shapes in (("tiny", workloads.tiny_shapes()), ("2000 leaves", workloads.many_small_shapes())):
        g = nba.to_device(nba.FlatTree.from_tree(workloads.make_tree(shapes)))
        txs = {
            "ema(0.9)": nba.ema(0.9),
            "MultiSteps(adam, 4) mini-step": nba.MultiSteps(nba.adam(1e-3), 4),
            "clip_by_global_norm(1.0)": nba.clip_by_global_norm(1.0),
        }
        for name, tx in txs.items():
            state = tx.init(g)

            def step(tx=tx, state=state, g=g):
                return tx.update(g, state)

            best = min(per_call(step, 300) for _ in range(3))
            print(f"{label:12s} {name:32s} {best:7.1f} us/update")
            if profile and name.startswith("clip") and label == "tiny":
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(300):
                    step()
                pr.disable()
                cuda.synchronize()
                pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    launch_paths()
    updates(a.profile)
