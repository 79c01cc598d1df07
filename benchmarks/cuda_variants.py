"""Kernel-shape experiments for the mean-accumulate mini-step on a GPT-2-XL-sized buffer (GPU).

    python benchmarks/cuda_variants.py [--n 1557000000]

Times ``acc = acc + (g - acc) / count`` in float32 written four ways -- the library's kernel,
four strided loads in flight per thread, two elements per 8-byte load (the buffers viewed as
complex64), and both -- at several grid sizes, next to a device-to-device copy of the same bytes
(the roof: 12 bytes per element against the copy's 8). CUDA-event medians of 15 calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bench  # noqa: E402
import torch  # noqa: E402
from numba import cuda  # noqa: E402

from numbaccum.backend import ops_for  # noqa: E402
from numbaccum.contract import Factor  # noqa: E402


@cuda.jit
def unroll4(n, acc, g, count):  # pragma: no cover - compiled
    i = cuda.grid(1)
    step = cuda.gridsize(1)
    while i + 3 * step < n:
        a0, a1, a2, a3 = acc[i], acc[i + step], acc[i + 2 * step], acc[i + 3 * step]
        g0, g1, g2, g3 = g[i], g[i + step], g[i + 2 * step], g[i + 3 * step]
        acc[i] = a0 + (g0 - a0) / count
        acc[i + step] = a1 + (g1 - a1) / count
        acc[i + 2 * step] = a2 + (g2 - a2) / count
        acc[i + 3 * step] = a3 + (g3 - a3) / count
        i += 4 * step
    while i < n:
        acc[i] = acc[i] + (g[i] - acc[i]) / count
        i += step


@cuda.jit
def pairs(n, acc, g, count):  # pragma: no cover - compiled
    i = cuda.grid(1)
    step = cuda.gridsize(1)
    while i < n:
        a = acc[i]
        b = g[i]
        re = a.real + (b.real - a.real) / count
        im = a.imag + (b.imag - a.imag) / count
        acc[i] = complex(re, im)
        i += step


@cuda.jit
def pairs2(n, acc, g, count):  # pragma: no cover - compiled
    i = cuda.grid(1)
    step = cuda.gridsize(1)
    while i + step < n:
        a0, a1 = acc[i], acc[i + step]
        b0, b1 = g[i], g[i + step]
        acc[i] = complex(a0.real + (b0.real - a0.real) / count, a0.imag + (b0.imag - a0.imag) / count)
        acc[i + step] = complex(a1.real + (b1.real - a1.real) / count, a1.imag + (b1.imag - a1.imag) / count)
        i += 2 * step
    while i < n:
        a = acc[i]
        b = g[i]
        acc[i] = complex(a.real + (b.real - a.real) / count, a.imag + (b.imag - a.imag) / count)
        i += step


def timed(fn, repeats: int = 15) -> float:
    return statistics.median(gpu_bench.timed(fn, repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_557_611_200)
    n = p.parse_args().n // 2 * 2
    ta = torch.zeros(n, device="cuda")
    tg = torch.randn(n, device="cuda")
    tc = torch.empty_like(tg)
    acc, g = cuda.as_cuda_array(ta), cuda.as_cuda_array(tg)
    acc2, g2 = cuda.as_cuda_array(ta.view(torch.complex64)), cuda.as_cuda_array(tg.view(torch.complex64))
    c = np.float32(3.0)
    copy = timed(lambda: tc.copy_(tg))
    print(f"n = {n}; d2d copy {copy * 1e3:.3f} ms; roof for 12 B/elem = {copy * 1.5 * 1e3:.3f} ms")
    ops = ops_for(acc)
    rows = [("library mean_accumulate_", lambda: ops.mean_accumulate_(acc, g, Factor(c, c), c, False))]
    for blocks in (132 * 8, 132 * 16, 132 * 32, -(-n // 256)):
        rows.append((f"unroll4 [{blocks}x256]", lambda b=blocks: unroll4[b, 256](n, acc, g, c)))
        half = n // 2
        b2 = min(blocks, -(-half // 256))
        rows.append((f"complex64 pairs [{b2}x256]", lambda b=b2, h=half: pairs[b, 256](h, acc2, g2, c)))
        rows.append((f"complex64 pairs x2 [{b2}x256]", lambda b=b2, h=half: pairs2[b, 256](h, acc2, g2, c)))
    for name, fn in rows:
        t = timed(fn)
        print(f"{name:40s} {t * 1e3:8.3f} ms  {copy * 1.5 / t:5.3f} of the roof")


if __name__ == "__main__":
    main()
