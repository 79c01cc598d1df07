"""Knobs read at call time. Change them before a call to take effect for that call."""

from __future__ import annotations

import os
import warnings
from typing import Any


def _env_int(name: str, default: Any, power_of_two: bool = False, maximum: int | None = None) -> Any:
    """A positive int (at most ``maximum``) from the environment variable ``name``, else
    ``default`` (None: a knob whose absence defers to something else).

    A bad value must not break ``import numbaccum`` (the CPU path never reads these knobs): it
    falls back to the default with a warning that names the variable.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1 or (power_of_two and value & (value - 1)) or (maximum is not None and value > maximum):
        need = "a positive power of two" if power_of_two else "a positive integer"
        need += f" <= {maximum}" if maximum is not None else ""
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        instead = "ignored" if default is None else f"using {default}"
        warnings.warn(f"{name}={shown!r} is not {need}; {instead}", RuntimeWarning, stacklevel=2)
        return default
    return value


# Elements per block of every reduction. The partition depends on the buffer size only, so a
# norm has the same bits for any thread count. 2**14 float64 partials cover 2**30 elements.
REDUCE_BLOCK = 1 << 16

# Elements per parallel chunk of elementwise kernels: 128 KiB of float32, large enough to amortise
# scheduling, small enough that two cores stay busy on a 1M-element tree.
CHUNK = 1 << 15

# Below this many elements a kernel runs serially: entering a parallel region costs microseconds,
# more than a small tree's whole update.
SERIAL_BELOW = 1 << 16

# Whether kernels may enter numba's parallel regions (the parallel drivers of calls of at least
# SERIAL_BELOW elements). False in a process forked from one whose GNU OpenMP threading layer had
# started (`numbaccum.cpu.driver`): libgomp's threads do not survive a fork, and numba terminates
# such a child at its first parallel region. Every kernel then takes its serial driver: the same
# bits (the partitions depend on the sizes only), on one thread.
PARALLEL = True

# A parallel elementwise call writes a float output of at least this many bytes with streaming
# stores (x86-64, `numbaccum.cpu.streaming`): no read of each line before it is written, no
# eviction of what the caches hold. Meant for outputs larger than the last-level cache, which
# are not read again from it (this VM's L3: 32 MiB).
STREAM_BYTES = _env_int("NUMBACCUM_STREAM_BYTES", 32 << 20)

# CUDA: threads per block of every kernel (a power of two). CI's simulator run sets 4 through
# NUMBACCUM_CUDA_THREADS, so that small inputs span many blocks.
CUDA_THREADS = _env_int("NUMBACCUM_CUDA_THREADS", 256, power_of_two=True, maximum=1024)  # CUDA's limit

# CUDA: at most this many blocks per elementwise launch; grid-stride loops cover the rest
# (132 SMs x 16 resident blocks of 256 threads on an H100). The simulator run lowers it: each
# simulated thread is a Python thread.
CUDA_MAX_BLOCKS = _env_int("NUMBACCUM_CUDA_MAX_BLOCKS", 132 * 16)

# CUDA: elements per block of a reduction. Like REDUCE_BLOCK on the CPU, the partition depends on
# the segment sizes only, so a norm has the same bits on every run and every GPU.
CUDA_REDUCE_BLOCK = 1 << 14

# MPI: at most this many elements per message of a collective. MPI counts are C ints, so a
# larger buffer goes as several messages (mpi4py 4 with an MPI-4 library could send it whole;
# MPI-3 libraries cannot). Tests lower it to exercise the split.
MPI_MAX_COUNT = 2**31 - 1

# MPI: bytes per message ("bucket") of the collective on a dtype buffer, unless an argument, the
# environment or a calibration says otherwise (`numbaccum.distributed.calibrate`). MPI libraries
# pick their algorithm by message size. On the 2-core VM (MPICH 5.0.2 over shared memory, 2 ranks,
# 62.2M float32, sizes alternated, 2026-11-27) one 249 MB message took 114-134 ms and 16 MiB
# pieces 72-86 ms in every run, while 1-4 MiB pieces took 53-62 ms in some runs and 95-112 ms in
# others: the runs where small pieces were fast are those where the compute-bound local step was
# 1.3x slower, as when the host runs both vCPUs on one physical core. Ranks on cores of their own
# (the case of a real job) is the other state, where 16 MiB is the best size; `calibrate` finds
# smaller ones where they win (benchmarks/results/2026-11-27-mpi-buckets-issue27.md). PyTorch
# DDP's buckets are 25 MB.
MPI_BUCKET_BYTES_DEFAULT = 16 << 20

# MPI: NUMBACCUM_MPI_BUCKET_BYTES overrides the default and a saved calibration (None: not set).
MPI_BUCKET_BYTES = _env_int("NUMBACCUM_MPI_BUCKET_BYTES", None)

# MPI: "1" posts each bucket as a non-blocking Iallreduce, the next in flight while a clip's norm
# runs on the last (for MPI libraries that move messages on by themselves: an asynchronous
# progress thread, a network card); "0" (the default) one blocking Allreduce per bucket, the norm
# right after it, while the bucket is in cache. MPICH's shared memory moves a non-blocking
# collective on only inside MPI calls, so there the norm's work delays the transfer instead of
# hiding under it: 2 ranks, 62.2M float32, alternated, DP step with the clip 185.5 ms
# non-blocking, 151.5 ms blocking (benchmarks/results/2026-11-27-mpi-overlap-issue27.md).
MPI_NONBLOCKING = _env_int("NUMBACCUM_MPI_NONBLOCKING", 0) == 1

# MPI: whether CUDA buffers go to MPI directly: "1" yes, "0" no (staged through host memory),
# "auto" asks the MPI library (MPIX_Query_cuda_support).
MPI_CUDA_AWARE = os.environ.get("NUMBACCUM_MPI_CUDA_AWARE", "auto")

# MPI: an uncaught exception on one rank calls MPI_Abort (see numbaccum.distributed), because
# the other ranks would otherwise wait in a collective forever. "0" leaves it to the user.
MPI_ABORT_ON_UNCAUGHT = os.environ.get("NUMBACCUM_MPI_ABORT", "1") != "0"

# Every cache of data derived from a layout (leaf and slice tables, per-example plans, the
# buffers a stateless transformation keeps per tree shape, per thread) holds at most this many
# entries, the oldest evicted first: a training loop sees a handful of tree shapes, a
# program that feeds thousands (Poisson-sampled batch sizes, growing models) stays bounded.
CACHE_ENTRIES = _env_int("NUMBACCUM_CACHE_ENTRIES", 64)

# The buffers a stateless transformation keeps for itself (its input copy and its output, per
# tree shape and thread) are kept for this many tree shapes, the oldest dropped first.
KEPT_LAYOUTS = _env_int("NUMBACCUM_KEPT_LAYOUTS", 8)
