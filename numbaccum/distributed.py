"""Data-parallel training over MPI: collectives over buckets of each dtype buffer, never per leaf.

``pip install "numbaccum[mpi]"`` installs mpi4py and MPICH. ``import numbaccum`` never imports
mpi4py, and neither does importing this module: mpi4py (which initialises MPI) is imported when a
function first needs a communicator.

Replicated data parallelism (every rank holds the whole model and a shard of the data)::

    opt = nba.MultiSteps(nba.chain(allreduce_mean(), nba.clip_by_global_norm(1.0), nba.adam(1e-3)), k)

averages the accumulated gradients once per emitted step, and every rank then runs the same
optimizer on the same bits.

Buckets. Each dtype buffer goes to MPI in pieces of a few MiB ("buckets"), not as one message:
MPI libraries pick their algorithm by message size, and on MPICH's shared-memory path one 249 MB
``Allreduce`` took 114-134 ms where the same bytes in 16 MiB pieces took 72-86 ms (2026-11-27).
The size is an argument (``bucket_bytes``), else ``NUMBACCUM_MPI_BUCKET_BYTES``, else what
`calibrate` measured on this machine (in this process, or saved by an earlier one), else
``_config.MPI_BUCKET_BYTES_DEFAULT``; `describe` (``numbaccum info``) says which.

Sharded models (each rank holds different leaves) use `global_norm` and `clip_by_global_norm`
with a communicator: one scalar collective per call.

How ranks stay bitwise identical: an ``MPI_Allreduce`` delivers the same result to every rank
(the standard requires identical results on all members; MPICH's algorithms either reduce each
element on one rank and pass the result on, or combine the same two partial sums on both sides
of a pair, and ``a + b == b + a`` exactly in IEEE arithmetic). Reducing in a fixed order by hand
(``Reduce`` to rank 0, then ``Bcast``) costs 2.6x an ``Allreduce`` here
(benchmarks/results/2026-11-23-cpu-mpi-allreduce.md), so plain ``Allreduce`` it is, and the MPI
tests compare every rank's state bit for bit after every step, on 2 and 3 ranks.

A rank that raises while the others wait in a collective would leave them waiting forever: MPI
has no timeouts. So, as ``python -m mpi4py`` does, creating a transformation here on more than
one rank installs a ``sys.excepthook`` that prints the traceback and calls ``MPI_Abort``: an
uncaught exception on one rank ends every rank (``NUMBACCUM_MPI_ABORT=0`` turns it off).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import _cache, _config, lockstep
from ._checks import flag, integer, non_negative
from ._loans import on_loan
from .backend import PiecewiseSumsq, ops_for
from .base import Stage
from .clipping import global_norm as _local_norm
from .clipping import stateless_prepass
from .contract import ONE, Factor
from .declared import expect_state, field_owner
from .flat import FlatTree, layout_and_device
from .fuse import Collective, Scale
from .layout import Layout
from .protocol import EmptyState, GradientTransformationExtraArgs, state_class
from .tables import sum_in_order
from .traits import ELEMENT, TREE
from .transaction import current
from .updates import Spec, Updates

__all__ = [
    "AllreduceMeanState",
    "Calibration",
    "Sharded",
    "ShardedState",
    "allreduce_mean",
    "allreduce_mean_",
    "allreduce_sum_",
    "calibrate",
    "check_same_layout",
    "clip_by_global_norm",
    "cuda_aware",
    "describe",
    "global_norm",
    "shard",
]

_F32 = np.dtype(np.float32)

INSTALL_HINT = 'numbaccum.distributed needs mpi4py and an MPI library: pip install "numbaccum[mpi]"'


def _mpi() -> Any:
    """``mpi4py.MPI``, imported on first use (the import initialises MPI)."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return MPI


def _comm(comm: Any) -> Any:
    return _mpi().COMM_WORLD if comm is None else comm


# --- buckets: the size of each message ------------------------------------------------------


class _Bucket(NamedTuple):
    """A bucket size in bytes and where it came from (`describe` and the cross-rank check say)."""

    nbytes: int
    source: str


ENV_BUCKET = "NUMBACCUM_MPI_BUCKET_BYTES"
CALIBRATION_FILE = "mpi-bucket.json"  # beside the kernel cache (`numbaccum._cache.directory`)
_calibrated: list[_Bucket] = []  # what `calibrate` chose in this process (the last one counts)
_saved: dict[str, _Bucket | None] = {}  # the saved calibration, read once per path (None: none)


def _bucket_arg(value: Any) -> int:
    """``bucket_bytes`` as a positive int; TypeError or ValueError naming it."""
    return integer(value, "bucket_bytes", minimum=1)


def _bucket_in_use(bucket_bytes: Any = None) -> _Bucket:
    """The bucket size a collective uses: the argument, else ``NUMBACCUM_MPI_BUCKET_BYTES``, else
    the last `calibrate` of this process, else the saved calibration, else the default."""
    if bucket_bytes is not None:
        return _Bucket(_bucket_arg(bucket_bytes), "argument")
    if _config.MPI_BUCKET_BYTES is not None:
        return _Bucket(int(_config.MPI_BUCKET_BYTES), f"environment: {ENV_BUCKET}")
    if _calibrated:
        return _calibrated[-1]
    saved = _saved_bucket()
    return saved if saved is not None else _Bucket(int(_config.MPI_BUCKET_BYTES_DEFAULT), "default")


def _calibration_path() -> Path | None:
    """Where `calibrate` saves its choice: beside the kernel cache, whose directory a user
    already controls (``NUMBACCUM_CACHE_DIR``); None when that is turned off."""
    base = _cache.directory()
    return None if base is None else base / CALIBRATION_FILE


def _saved_bucket() -> _Bucket | None:
    path = _calibration_path()
    if path is None:
        return None
    key = str(path)
    if key not in _saved:
        _saved[key] = _read_calibration(path, _library())
    return _saved[key]


def _read_calibration(path: Path, library: str) -> _Bucket | None:
    """The bucket size `calibrate` saved in ``path``; None when there is no such file, and None
    with a warning when it cannot be read, is not a calibration, or was measured with another MPI
    library: a stale or broken file must never stop a training run."""
    try:
        record = json.loads(path.read_bytes().decode())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        _ignored(path, f"cannot be read ({e})")
        return None
    nbytes = record.get("bucket_bytes") if isinstance(record, dict) else None
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        _ignored(path, "has no positive integer bucket_bytes")
        return None
    if record.get("library") != library:
        _ignored(path, f"was measured with {record.get('library')!r}, not {library!r}")
        return None
    when = f"{_ranks(record.get('ranks', '?'))}, {record.get('date', '?')}"
    return _Bucket(nbytes, f"calibrated: {path} ({when})")


def _ignored(path: Path, why: str) -> None:
    warnings.warn(
        f"numbaccum.distributed: ignoring {path}, which {why}; using the default bucket size "
        f"(run numbaccum.distributed.calibrate(save=True) again, or delete the file)",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _runs(n: int, itemsize: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs covering ``n`` elements of ``itemsize`` bytes, one message each:
    ``bucket_bytes`` rounded down to whole elements (at least one) and at most
    ``_config.MPI_MAX_COUNT`` elements (MPI counts are C ints)."""
    step = max(1, min(bucket_bytes // itemsize, int(_config.MPI_MAX_COUNT)))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


# --- the collective on flat buffers ---------------------------------------------------------


def _sum_host(
    comm: Any, src: np.ndarray, dst: np.ndarray, runs: list, n_mean: int, norm: PiecewiseSumsq | None = None
) -> None:
    """``dst = sum over ranks of src`` (host memory; ``src`` may be ``dst``), one ``Allreduce``
    per run, each run divided by ``n_mean`` (0: not) right after its sum, while it is in cache,
    and fed to ``norm`` (the sum of squares of a clip that rides on the sum).

    With ``NUMBACCUM_MPI_NONBLOCKING=1`` (`_config.MPI_NONBLOCKING`) each run is a non-blocking
    ``Iallreduce``, the next one in flight while one is consumed, ``norm`` testing it between
    its batches of work: for an MPI library that moves messages on by itself. MPICH's shared
    memory does so only inside MPI calls, where the norm's work then delays the transfer (the
    blocking default measured 0.82x the non-blocking step with a clip on 2 ranks). The runs, the
    op and so the bits are the same either way (the MPI tests compare them on 2 and 3 ranks)."""
    MPI = _mpi()
    ops = ops_for(dst) if n_mean else None
    inplace = src is dst

    def args(lo: int, hi: int) -> tuple:
        return (MPI.IN_PLACE if inplace else src[lo:hi], dst[lo:hi])

    nonblocking = _config.MPI_NONBLOCKING
    nxt = comm.Iallreduce(*args(*runs[0]), op=MPI.SUM) if nonblocking else None
    for i, (lo, hi) in enumerate(runs):
        if nonblocking:
            req = nxt
            assert req is not None  # (issued before this run: the first above, each next here)
            nxt = comm.Iallreduce(*args(*runs[i + 1]), op=MPI.SUM) if i + 1 < len(runs) else None
            req.Wait()
        else:
            comm.Allreduce(*args(lo, hi), op=MPI.SUM)
        if ops is not None:
            d = dst[lo:hi]
            ops.scale_(d, d, Factor(float(n_mean), 1.0))
        if norm is not None:
            norm.feed(dst, hi, None if nxt is None else nxt.Test)


def _sum_half(comm: Any, src: np.ndarray, dst: np.ndarray, wire: np.ndarray, runs: list, n_mean: int) -> None:
    """`_sum_host` for float16 and bfloat16, which MPI cannot sum: each run is widened into the
    float32 ``wire`` (exactly: both are float32 values), summed there, and rounded back once
    (with ``n_mean``, after the division: the sum of float16s can overflow where the mean does
    not). A run is read before it is written, so ``src`` may be ``dst``."""
    MPI = _mpi()
    for lo, hi in runs:
        w = wire[: hi - lo]
        w[...] = src[lo:hi]
        comm.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
        if n_mean:
            np.divide(w, np.float32(n_mean), out=w)
        dst[lo:hi] = w


def _staging(out: FlatTree, key: Any, n: int, dtype: np.dtype, pinned: bool) -> np.ndarray:
    """A host buffer of ``n`` elements kept beside ``out`` (allocated once; pinned where it is a
    CUDA copy's end, so that copies run at full speed)."""
    # Kept in the storage's attributes, which the renewals of a state's buffer share
    # (`numbaccum.transaction.current`): allocated once per storage, not once per update.
    bufs = out.__dict__.setdefault("_staging", {})
    key = (key, n, dtype)
    h = bufs.get(key)
    if h is None:
        if pinned:
            from .arrays import cuda_api

            h = cuda_api().pinned_array(n, dtype)
        else:
            h = np.empty(n, dtype)
        bufs[key] = h
    return h


def _sync_stream() -> Any:
    """The stream our kernels run on, after waiting for it: MPI reads memory from the host side."""
    from .arrays import stream

    s = stream()
    if s != 0:
        s.synchronize()
    return s


def _reduce(
    comm: Any, src: FlatTree, out: FlatTree, mean: bool, bucket_bytes: int, sums: np.ndarray | None = None
) -> np.ndarray | None:
    """``out = sum (or mean) over ranks of src``, one Allreduce per bucket of each dtype group.

    Buckets never cross groups; within one they split leaves wherever they fall (the sum is
    elementwise). float16 and bfloat16 groups are summed in float32 buckets, so a tree with such
    a group takes ``mean=True``. CUDA groups are staged through pinned host memory, one copy each
    way, unless the MPI library is CUDA-aware (`cuda_aware`): then MPI reads the device buckets.

    With ``sums`` (one float64 per leaf), also the plain sum of squares of each leaf of the mean
    (``out`` divided by the number of ranks, unless ``mean`` did it), bucket by bucket as the sum
    arrives, with the bits `numbaccum.backend.leaf_sumsq` gives over the settled mean; returns
    ``sums``, or None where that is not done (CUDA, float16 and bfloat16, complex groups)."""
    n = comm.Get_size()
    n_mean = n if mean else 0
    direct = out.device and cuda_aware()
    s = _sync_stream() if out.device else 0
    if sums is not None:
        if out.device or any(d not in _NORM_DTYPES for d in out.group_dtypes):
            sums = None
        else:
            sums.fill(0.0)  # an empty group's leaves: 0, as `leaf_sumsq` gives
    for gi, (x, y) in enumerate(zip(src.groups, out.groups)):
        if y.size == 0:
            continue  # every rank has the same layout (checked at init): all skip it
        dt = np.dtype(y.dtype)
        if dt.itemsize == 2:  # float16 or bfloat16: summed in float32
            runs = _runs(y.size, _F32.itemsize, bucket_bytes)
            wire = _staging(out, "wire", runs[0][1], _F32, pinned=False)
            if not out.device:
                _sum_half(comm, x, y, wire, runs, n_mean)
                continue
            h = _staging(out, (gi, "half"), y.size, dt, pinned=True)
            _down(x, h, s)
            _sum_half(comm, h, h, wire, runs, n_mean)
            y.copy_to_device(h, stream=s)  # type: ignore[attr-defined]  # numba's DeviceNDArray
            continue
        runs = _runs(y.size, dt.itemsize, bucket_bytes)
        if not out.device:
            norm = None
            if sums is not None:
                norm = _piecewise(out, gi)
                norm.start(1.0 if mean else float(n), 1.0)
            _sum_host(comm, x, y, runs, n_mean, norm)
            if norm is not None:
                sums[out.layout.group_index[gi]] = norm.finish()  # type: ignore[index]
        elif direct:
            for lo, hi in runs:  # device pointers straight to MPI
                comm.Allreduce(x[lo:hi], y[lo:hi], op=_mpi().SUM)
            if mean:  # one kernel on the device: a launch per bucket would cost more
                ops_for(y).scale_(y, y, Factor(float(n), 1.0))
        else:  # CUDA through the host: one copy down, the buckets, one copy up
            h = _staging(out, (gi, "sum"), y.size, dt, pinned=True)
            _down(x, h, s)
            _sum_host(comm, h, h, runs, n_mean)
            y.copy_to_device(h, stream=s)  # type: ignore[attr-defined]  # numba's DeviceNDArray
    return sums


_NORM_DTYPES = (_F32, np.dtype(np.float64))  # the groups whose norm rides on the sum


def _piecewise(out: FlatTree, gi: int) -> PiecewiseSumsq:
    """The sum of squares of group ``gi`` fed bucket by bucket, kept beside ``out`` (its tables
    laid out once, like `_staging`'s buffers)."""
    kept = out.__dict__.setdefault("_piecewise", {})
    key = (gi, _config.REDUCE_BLOCK)  # the engine's items, which the block size cuts
    p = kept.get(key)
    if p is None:
        p = kept[key] = PiecewiseSumsq(out.layout, gi, out.groups[gi])
    return p


def _down(x: Any, h: np.ndarray, s: Any) -> None:
    """Device buffer ``x`` into host buffer ``h``, waited for: MPI reads ``h`` next."""
    x.copy_to_host(h, stream=s)
    if s != 0:
        s.synchronize()


def allreduce_sum_(
    src: FlatTree, out: FlatTree | None = None, comm: Any = None, bucket_bytes: int | None = None
) -> FlatTree:
    """``out = sum over ranks r of src_r``, one ``Allreduce`` per bucket of each dtype buffer.

    Collective: every rank calls it with the same layout and the same bucket size. float16 and
    bfloat16 buffers are summed in float32 and rounded once (an overflow gives inf: prefer
    `allreduce_mean_`). CUDA buffers are staged through the host unless the MPI library is
    CUDA-aware. Every rank gets the same bits, and the bits do not depend on the bucket size on
    two ranks (each element is ``a + b``).

    Args:
        src: this rank's buffers.
        out: where the sum goes, with ``src``'s layout, dtypes and device; None: ``src`` (in
            place).
        comm: the communicator; None: ``MPI.COMM_WORLD``.
        bucket_bytes: bytes per message, rounded down to whole elements (at least one; float16
            and bfloat16 travel as float32) and capped at ``2**31 - 1`` elements
            (``_config.MPI_MAX_COUNT``); buckets never span two dtype buffers. None: the size in
            use (`describe` says which: ``NUMBACCUM_MPI_BUCKET_BYTES``, `calibrate`, or the
            default, ``_config.MPI_BUCKET_BYTES_DEFAULT``: 16 MiB).

    Returns:
        ``out``.

    Raises:
        TypeError: ``src`` or ``out`` is not a FlatTree, or ``bucket_bytes`` is not an int.
        ValueError: ``out`` has another layout, dtypes or device than ``src``, or
            ``bucket_bytes < 1``. Both are raised before any buffer is read or written.

    References:
        The MPI standard's ``MPI_Allreduce``; PyTorch's DistributedDataParallel and Horovod, which
        average gradients in buckets the same way (Li et al., PyTorch Distributed, VLDB 2020).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import allreduce_sum_
        >>> g = nba.FlatTree.from_tree({"w": np.arange(3.0, dtype=np.float32)})
        >>> allreduce_sum_(g, g.zeros_like(), MPI.COMM_SELF, bucket_bytes=8)["w"]  # 2 buckets
        array([0., 1., 2.], dtype=float32)
    """
    return _collective(src, out, comm, bucket_bytes, mean=False)


def allreduce_mean_(
    src: FlatTree, out: FlatTree | None = None, comm: Any = None, bucket_bytes: int | None = None
) -> FlatTree:
    """``out = (sum over ranks r of src_r) / n_ranks``, one ``Allreduce`` per bucket.

    Like `allreduce_sum_`, then a division by the number of ranks, bucket by bucket while each
    is in cache (float16 and bfloat16: in float32, rounded once). Every rank gets the same bits.

    Args:
        src: this rank's buffers.
        out: where the mean goes, with ``src``'s layout, dtypes and device; None: ``src``.
        comm: the communicator; None: ``MPI.COMM_WORLD``.
        bucket_bytes: bytes per message, as for `allreduce_sum_`; None: the size in use.

    Returns:
        ``out``.

    Raises:
        TypeError: as `allreduce_sum_`.
        ValueError: as `allreduce_sum_`.

    References:
        The MPI standard's ``MPI_Allreduce``; PyTorch's DistributedDataParallel and Horovod, which
        average gradients in buckets the same way (Li et al., PyTorch Distributed, VLDB 2020).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import allreduce_mean_
        >>> g = nba.FlatTree.from_tree({"h": np.ones(3, np.float16)})
        >>> allreduce_mean_(g, comm=MPI.COMM_SELF, bucket_bytes=1 << 20)["h"]
        array([1., 1., 1.], dtype=float16)
    """
    return _collective(src, out, comm, bucket_bytes, mean=True)


def _collective(src: FlatTree, out: FlatTree | None, comm: Any, bucket_bytes: Any, mean: bool) -> FlatTree:
    nbytes = _bucket_in_use(bucket_bytes).nbytes  # every check before any buffer is touched
    out = src if out is None else out
    _check_pair(src, out)
    _reduce(_comm(comm), src, out, mean, nbytes)
    return out


def _check_pair(src: FlatTree, out: FlatTree) -> None:
    if not isinstance(src, FlatTree) or not isinstance(out, FlatTree):
        raise TypeError("allreduce: src and out must be FlatTrees")
    if src.layout is not out.layout or src.group_dtypes != out.group_dtypes or src.device != out.device:
        raise ValueError("allreduce: out must have the layout, dtypes and device of src")


# --- layouts agree across ranks -------------------------------------------------------------


def _leaf_records(layout: Layout, name: str) -> list[str]:
    """``"params['w']: (3, 4) float32"`` for each leaf, in leaf order."""
    return [f"{layout.path(i, name)}: {s} {d}" for i, (s, d) in enumerate(zip(layout.shapes, layout.dtypes))]


def check_same_layout(layout: Layout, comm: Any = None, name: str = "params") -> None:
    """Raises the same ValueError on every rank unless all ranks have the same tree structure,
    leaf shapes and dtypes.

    One ``Allgather`` of a 32-byte digest per rank; only when the digests differ, a second
    collective (every rank knows it by then, so none waits alone) brings the leaf lists together,
    so that the message can name the first differing leaf.

    Args:
        layout: the tree's layout (a FlatTree's ``.layout``).
        comm: the communicator; None: ``MPI.COMM_WORLD``.
        name: what the tree is called in the message (``"params"``).

    Returns:
        None, on every rank, when the layouts agree.

    Raises:
        ValueError: the ranks' layouts differ; the message names the first differing leaf (its
            path, shape and dtype on both ranks) or the tree structures.

    References:
        PyTorch DDP's check that every rank's parameters have the same shapes
        (``_verify_param_shape_across_processes``), here with a digest first.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import check_same_layout
        >>> params = nba.FlatTree.from_tree({"w": np.ones(3, np.float32)})
        >>> check_same_layout(params.layout, MPI.COMM_SELF) is None
        True
    """
    comm = _comm(comm)
    every = lockstep.gathered_if_different(comm, [repr(layout.treedef), *_leaf_records(layout, name)])
    if every is None:
        return
    r = next(i for i in range(len(every)) if every[i] != every[0])
    (td0, *leaves0), (tdr, *leavesr) = every[0], every[r]
    if td0 != tdr:
        detail = f"tree structure {tdr} on rank {r}, {td0} on rank 0"
    else:
        a, b = next((a, b) for a, b in zip(leaves0, leavesr) if a != b)
        detail = f"{b} on rank {r}, {a.split(': ', 1)[1]} on rank 0"
    raise ValueError(f"{name} differ between ranks: {detail}")


# --- sharded norms --------------------------------------------------------------------------


def _combine(local: float, ord_key: Any, comm: Any) -> float:
    """One ``Allgather`` of a float64 per rank, combined in rank order: the same bits everywhere."""
    every = np.empty(comm.Get_size(), np.float64)
    comm.Allgather(np.array([local], np.float64), every)
    if ord_key == math.inf:
        return float(np.max(every))  # NaN if any rank's is NaN
    return sum_in_order(every)


def _ord_key(ord: Any) -> Any:
    key = 2 if ord is None else math.inf if ord in (math.inf, "inf") else ord
    if key not in (1, 2, math.inf):
        raise ValueError(f"ord must be 1, 2 or inf, got {ord!r}")
    return key


def global_norm(tree: Any, comm: Any = None, ord: Any = 2, squared: bool = False) -> float:
    """The norm of a model whose leaves are sharded across ranks (each rank passes its own leaves).

    ``ord=2``: ``sqrt(sum_r sum_r_leaves g^2)``; ``ord=1``: ``sum |g|``; ``ord=inf``: ``max |g|``.
    Each rank reduces its leaves as `numbaccum.global_norm` does (float64, fixed order), then one
    scalar collective gathers the per-rank values, which every rank adds in rank order: every rank
    gets the same bits. On one rank it equals `numbaccum.global_norm`.

    Args:
        tree: this rank's leaves (a tree of arrays or a FlatTree; host or CUDA).
        comm: the communicator; None: ``MPI.COMM_WORLD``.
        ord: 2, 1 or inf (``"inf"`` too); None is 2.
        squared: return the square of the norm.

    Returns:
        The norm over every rank's leaves, a Python float, the same bits on every rank.

    Raises:
        ValueError: ``ord`` is not 1, 2 or inf.

    References:
        ``optax.tree.norm`` (of one process's tree); Megatron-LM's gradient norm of a model
        split over ranks (Shoeybi et al., 2019), a sum of the ranks' squares.

    Examples:
        >>> import numpy as np
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import global_norm
        >>> global_norm({"w": np.array([3.0, 4.0], np.float32)}, MPI.COMM_SELF)
        5.0
    """
    key = _ord_key(ord)
    comm = _comm(comm)
    local = _local_norm(tree, ord=key, squared=key == 2)
    total = _combine(local, key, comm)
    if key == 2:
        return total if squared else math.sqrt(total)
    return total * total if squared else total


# --- the transformations --------------------------------------------------------------------


@state_class
class AllreduceMeanState(NamedTuple):
    """State of `allreduce_mean`.

    Attributes:
        mean: the buffer the collective writes into (shaped like params, in the updates' dtypes);
            it holds the last sum over ranks (or mean, for trees with float16 leaves).
        count: the steps this state has averaged (int64): every rank's must be the same at each
            step, and each step's first collective checks that they are (ranks resumed from
            checkpoints of different steps raise instead of pairing collectives of different
            steps). A state saved before it was kept loads with 0.
    """

    mean: FlatTree
    count: np.int64 = np.int64(0)  # type: ignore[assignment]  # shadows tuple.count, as in optax


def _abort_on_uncaught(comm: Any) -> None:
    """Makes an uncaught exception on this rank call ``MPI_Abort`` (once per process), as
    ``python -m mpi4py`` does: the other ranks would otherwise wait in a collective forever."""
    if comm.Get_size() < 2 or getattr(sys.excepthook, "_numbaccum_abort", False):
        return
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        previous(kind, value, tb)
        if _config.MPI_ABORT_ON_UNCAUGHT:
            sys.stderr.flush()
            comm.Abort(1)

    hook._numbaccum_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def allreduce_mean(comm: Any = None, bucket_bytes: int | None = None) -> GradientTransformationExtraArgs:
    """Averages the updates across the ranks of ``comm`` (default ``MPI.COMM_WORLD``):
    ``u = (sum over ranks r of g_r) / n_ranks``.

    One ``Allreduce`` per bucket of each dtype buffer, into a buffer the state owns; the division
    by ``n_ranks`` is not a pass of its own but rides on the next kernel that reads the updates
    (trees with float16 or bfloat16 leaves: summed in float32 and divided on the host, bucket by
    bucket). Every rank gets the same bits, so replicated params and optimizer states stay
    identical. On one rank it is the identity. Put it first:
    ``chain(allreduce_mean(), clip_by_global_norm(1.0), adam(1e-3))``; inside
    ``MultiSteps(..., k)`` it averages once per emitted step instead of every mini-step.

    ``init`` checks with small collectives that every rank has the same tree structure, shapes
    and dtypes, the same bucket size and the same schedule around it (a `numbaccum.MultiSteps`'
    ``every_k_schedule``): ValueError on every rank otherwise. ``update`` is collective: every
    rank must call it, the same number of times, from the same step. Each update's first message
    is a tiny ``Allreduce`` of the ranks' step counters (the state's ``count``, and those of the
    combinators around it: MultiSteps' ``k`` and gradient step, `numbaccum.apply_if_finite`'s
    skipped steps), so that ranks out of step (resumed from checkpoints of different steps, with
    another ``k``, skipping a step the others take) raise the same ValueError on every rank,
    naming the counters, before any buffer is written, instead of pairing the collectives of
    different steps (`numbaccum.lockstep`).

    Args:
        comm: the communicator; None: ``MPI.COMM_WORLD``.
        bucket_bytes: bytes per message, as for `allreduce_sum_`; None: the size in use when the
            transformation is made (``NUMBACCUM_MPI_BUCKET_BYTES``, else the last `calibrate`,
            else a saved calibration, else 16 MiB; `describe` says which).

    Returns:
        The transformation; its state is an `AllreduceMeanState`.

    Raises:
        TypeError: ``bucket_bytes`` is not an int.
        ValueError: ``bucket_bytes < 1``; from ``init``, the ranks' layouts, bucket sizes or
            schedules differ; from ``update``, the ranks are out of step (on every rank alike).

    References:
        PyTorch's DistributedDataParallel (Li et al., PyTorch Distributed: Experiences on
        Accelerating Data Parallel Training, VLDB 2020) and Horovod (Sergeev and Del Balso, 2018),
        which average gradients over the ranks in buckets.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import allreduce_mean
        >>> tx = nba.chain(allreduce_mean(MPI.COMM_SELF, bucket_bytes=16 << 20), nba.sgd(0.1))
        >>> g = {"w": np.ones(2, np.float32)}
        >>> tx.update(g, tx.init(g))[0]["w"]
        array([-0.1, -0.1], dtype=float32)
    """
    bucket = _bucket_in_use(bucket_bytes)
    comm = _comm(comm)
    _abort_on_uncaught(comm)
    return _AllreduceMean(comm, bucket).transformation()


class _AllreduceMean(Stage):
    """`allreduce_mean` as a stage: the plan checks the state, the run is the collective."""

    scope = ELEMENT

    def __init__(self, comm: Any, bucket: _Bucket) -> None:
        self.comm = comm
        self.n = comm.Get_size()
        self.bucket = bucket

    def init(self, params: Any) -> AllreduceMeanState:
        layout, device = layout_and_device(params, "params")
        check_same_layout(layout, self.comm)
        _check_same_bucket(self.bucket, self.comm)
        lockstep.check_same_schedule(self.comm, [n.describe() for n in lockstep.notes()], "allreduce_mean")
        return AllreduceMeanState(FlatTree.zeros(layout, None, device), np.int64(0))

    def owner(self, state: Any) -> FlatTree | None:
        """The state's buffer: it defines the layout the updates must have."""
        return field_owner(state, AllreduceMeanState, "mean")

    def declare(self, spec: Spec, state: Any) -> Collective | Scale:
        """A `numbaccum.fuse.Collective` into the state's buffer (one rank: nothing, a `Scale`
        of one); its ``tick`` renews the buffer. A clip's norm that follows rides on it."""
        storage = expect_state(state, AllreduceMeanState, "mean", spec, renew=False).__dict__
        seen = [0]  # the count of the state this step started from (set by the tick)
        part: Any
        if self.n == 1:
            part = Scale(ONE, name="allreduce_mean")
        else:
            comm, n, nbytes = self.comm, self.n, self.bucket.nbytes
            half = any(d.itemsize == 2 for d in spec.layout.group_dtypes)
            # The division by n rides on the next kernel (float16 and bfloat16 trees: divided on
            # the host, bucket by bucket).
            pending = ONE if half else Factor(float(n), 1.0)

            def reduce(flat: FlatTree, factor: Factor, sums: np.ndarray | None) -> tuple:
                _check_in_step(comm, seen[0])  # before any buffer is written
                out = part.new_state.mean
                if on_loan(out.buffers.values()):  # a lone update returned it, and it is held
                    out = out.workspace("sum")  # (a spare while that one is held too)
                # A pending factor is applied on the way into our buffer: no pass of its own.
                src = flat if factor.is_one else Updates(flat, False, factor).into(out)
                return out, pending, _reduce(comm, src, out, half, nbytes, sums)

            part = Collective(reduce, name="allreduce_mean", messages=_messages(spec.layout, nbytes, n))

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if not isinstance(state, AllreduceMeanState):
                return False
            if getattr(state.mean, "__dict__", None) is not storage:  # another state's buffer
                return False
            seen[0] = count = int(state.count)
            part.new_state = AllreduceMeanState(current(state.mean, "mean"), np.int64(count + 1))
            return True

        part.tick = tick
        return part


def _messages(layout: Layout, bucket_bytes: int, n: int) -> str:
    """What the collective sends, for `numbaccum.explain`: its ``Allreduce`` (or ``Iallreduce``)
    calls per update and their size, after the tiny one of the step counters (`_check_in_step`)."""
    count = sum(
        len(_runs(size, 4 if np.dtype(d).itemsize == 2 else np.dtype(d).itemsize, bucket_bytes))
        for size, d in zip(layout.group_sizes, layout.group_dtypes)
        if size
    )
    call = "Iallreduce" if _config.MPI_NONBLOCKING else "Allreduce"
    return f"{count} {call} of up to {_human(bucket_bytes)} over {_ranks(n)}, after the step counters'"


def _check_in_step(comm: Any, count: int) -> None:
    """The same ValueError on every rank unless every rank's state has averaged ``count`` steps
    and the combinators around it are at the same counters (`numbaccum.lockstep`): one
    ``Allreduce`` of a few int64, before the step's first bucket."""
    around = [n for n in lockstep.notes() if n.values]
    values = (count, *(v for n in around for v in n.values))

    def describe() -> list[str]:
        return [f"allreduce_mean's state.count {count}", *(n.describe() for n in around)]

    lockstep.check_in_step(comm, values, describe, "allreduce_mean")


def _check_same_bucket(bucket: _Bucket, comm: Any) -> None:
    """Raises the same ValueError on every rank unless all ranks use the same bucket size.

    Ranks that cut a buffer into different buckets would pass MPI collectives of different
    counts, which MPI does not check: a hang, or sums of the wrong elements. Where the sizes came
    from (a file saved on one node only, an environment variable set on some ranks) is what the
    message names.
    """
    every = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([bucket.nbytes], np.int64), every)
    if (every == every[0]).all():
        return
    sources = comm.allgather(bucket.source)  # every rank knows by now: none waits alone
    r = int(np.flatnonzero(every != every[0])[0])
    raise ValueError(
        f"bucket sizes differ between ranks: {every[r]} bytes ({sources[r]}) on rank {r}, "
        f"{every[0]} bytes ({sources[0]}) on rank 0; pass the same bucket_bytes everywhere or "
        f"run calibrate() on this communicator"
    )


def clip_by_global_norm(max_norm: float, comm: Any = None) -> GradientTransformationExtraArgs:
    """`numbaccum.clip_by_global_norm` for a model whose leaves are sharded across ranks:

    ``u = g`` if ``norm < max_norm``, else ``(g / norm) * max_norm``, with ``norm`` the L2 norm
    over every rank's leaves (`global_norm` with ``comm``: one scalar collective per update, the
    same bits on every rank). Each rank passes its own shard; the layouts may differ between
    ranks. On the GPU the local sum of squares comes back to the host (one synchronisation).

    Args:
        max_norm: the largest global norm let through, at least 0.
        comm: the communicator; None: ``MPI.COMM_WORLD``.

    Returns:
        A `GradientTransformationExtraArgs`; its state is a `numbaccum.ClipByGlobalNormState`, as
            `numbaccum.clip_by_global_norm`'s.

    Raises:
        ValueError: ``max_norm`` is negative.

    References:
        ``optax.clip_by_global_norm``; Megatron-LM's clip of a model split over ranks (Shoeybi
        et al., 2019).

    Examples:
        >>> import numpy as np
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import clip_by_global_norm
        >>> tx = clip_by_global_norm(1.0, MPI.COMM_SELF)
        >>> g = {"w": np.array([3.0, 4.0], np.float32)}
        >>> tx.update(g, tx.init(g))[0]["w"]
        array([0.6, 0.8], dtype=float32)
    """
    max_norm = non_negative(max_norm, "max_norm")
    comm = _comm(comm)
    _abort_on_uncaught(comm)

    return _ShardedClip(max_norm, comm).transformation()


class _ShardedClip(Stage):
    """The sharded clip as a stage: the run takes the norm over every rank (one collective)."""

    scope = TREE

    def __init__(self, max_norm: float, comm: Any) -> None:
        self.max_norm = max_norm
        self.comm = comm

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def declare(self, spec: Spec, state: Any) -> Any:
        """A `numbaccum.fuse.Prepass`: the settled updates' norm over every rank (one scalar
        collective, once a step on every rank) gives the factor left pending on them; the state
        passes through."""
        max_norm, comm = self.max_norm, self.comm

        def factor_of(flat: FlatTree) -> Factor:
            norm = math.sqrt(_combine(_local_norm(flat, squared=True), 2, comm))
            if norm < max_norm:
                return ONE
            if norm == 0.0:  # and so max_norm == 0: zeros, not 0 / 0
                return Factor(1.0, 0.0)
            return Factor(norm, max_norm)

        return stateless_prepass(factor_of, "clip_by_global_norm", "global norm over the ranks")


# --- calibration: the fastest bucket size here ----------------------------------------------

CALIBRATION_SIZES = tuple(m << 20 for m in (1, 2, 4, 8, 16, 32))


class Calibration(NamedTuple):
    """What `calibrate` measured and chose.

    Attributes:
        bucket_bytes: the fastest candidate: from now on the bucket size in use in this process.
        seconds: candidate bytes -> the median time of one sum of the buffer in buckets of that
            size (each round's time is the slowest rank's), smallest candidate first.
        path: the file the choice was saved to; None: not saved.

    Examples:
        >>> from numbaccum.distributed import Calibration
        >>> c = Calibration(4 << 20, {1 << 20: 0.061, 4 << 20: 0.054}, None)
        >>> c.bucket_bytes == min(c.seconds, key=c.seconds.get)
        True
    """

    bucket_bytes: int
    seconds: dict[int, float]
    path: str | None


def calibrate(
    comm: Any = None,
    sizes: Any = CALIBRATION_SIZES,
    repeats: int = 5,
    save: Any = False,
    nbytes: int = 64 << 20,
) -> Calibration:
    """Measures which bucket size sums fastest on ``comm``, and uses it from now on.

    MPI libraries pick their algorithm by message size, so the fastest bucket size depends on the
    library, the network and the number of ranks. This sums a float32 buffer of ``nbytes`` over
    ``comm`` in buckets of each candidate size: one warm-up round, then ``repeats`` timed rounds,
    the candidates alternating within each round so that a drift of the machine hits them all
    alike. A round's time is the slowest rank's (the times are reduced with ``MAX``), the smallest
    median wins, and rank 0's choice is broadcast: every rank takes the same decision. With the
    defaults, 6 candidates x 6 rounds of a 64 MiB sum: a few seconds on one machine.

    The choice becomes the bucket size of every collective given no ``bucket_bytes`` (an
    `allreduce_mean` made from now on), unless ``NUMBACCUM_MPI_BUCKET_BYTES`` is set (it wins).
    Saved, it is read back by the first collective of later processes (measured with the same
    MPI library; a file that cannot be read is ignored with a warning). Collective: every rank of
    ``comm`` calls it, with the same arguments.

    Args:
        comm: the communicator to measure; None: ``MPI.COMM_WORLD``.
        sizes: the candidate bucket sizes in bytes (positive ints).
        repeats: timed rounds (a positive int).
        save: False: keep the choice for this process; True: also save it as ``mpi-bucket.json``
            in numbaccum's cache directory (``NUMBACCUM_CACHE_DIR``, else ``~/.cache/numbaccum``
            on Linux), where later processes read it; a path: save it there (read back only
            from the default place). One rank per node writes (``MPI.COMM_TYPE_SHARED``).
        nbytes: the size of the buffer summed, in bytes (about a model's gradients; larger than
            the caches: 64 MiB, two buffers of it per rank).

    Returns:
        A `Calibration`: the chosen ``bucket_bytes``, each candidate's median ``seconds``, and
            the ``path`` it was saved to.

    Raises:
        TypeError: ``sizes``, ``repeats`` or ``nbytes`` is not made of ints, or ``save`` is not a
            bool or a path.
        ValueError: a size, ``repeats`` or ``nbytes`` is not positive, ``sizes`` is empty, or
            ``save=True`` while ``NUMBACCUM_CACHE_DIR`` turns the cache directory off. All
            before any collective.
        OSError: the file could not be written (raised on every rank).

    References:
        PyTorch DDP's ``bucket_cap_mb`` and Horovod's autotuning of its fusion buffer, which
        choose the same trade-off (fewer messages against overlap) by measurement.

    Examples:
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import calibrate, describe
        >>> c = calibrate(MPI.COMM_SELF, sizes=(1 << 16, 1 << 20), repeats=1, nbytes=1 << 20)
        >>> sorted(c.seconds) == [1 << 16, 1 << 20] and "calibrate()" in describe()
        True
    """
    candidates = _candidates(sizes)
    repeats = integer(repeats, "repeats", minimum=1)
    nbytes = integer(nbytes, "nbytes", minimum=_F32.itemsize)
    path = _save_path(save)
    comm = _comm(comm)
    seconds = _time_buckets(comm, candidates, repeats, nbytes)
    best = int(comm.bcast(min(seconds, key=seconds.__getitem__), root=0))
    _calibrated[:] = [_Bucket(best, f"calibrate() in this process, {_ranks(comm.Get_size())}")]
    if path is not None:
        _save(comm, path, best, seconds, nbytes)
    return Calibration(best, seconds, None if path is None else str(path))


def _candidates(sizes: Any) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a sequence of ints (bytes), got {type(sizes).__name__}")
    out = sorted({integer(b, f"sizes[{i}]", minimum=1) for i, b in enumerate(sizes)})
    if not out:
        raise ValueError("sizes must name at least one bucket size")
    return out


def _save_path(save: Any) -> Path | None:
    if isinstance(save, (str, os.PathLike)):
        return Path(save).expanduser()
    if not flag(save, "save"):
        return None
    path = _calibration_path()
    if path is None:
        raise ValueError(
            f"save=True: numbaccum's cache directory is turned off ({_cache.ENV} is set to turn it "
            f"off); pass save=<a path>"
        )
    return path


def _time_buckets(comm: Any, candidates: list[int], repeats: int, nbytes: int) -> dict[int, float]:
    """Each candidate's median time (the slowest rank's) to sum ``nbytes`` of float32 over
    ``comm``, the candidates alternating within each round."""
    src = np.ones(nbytes // _F32.itemsize, _F32)  # ones: exact sums on any number of ranks
    dst = np.empty_like(src)
    times = np.empty((repeats + 1, len(candidates)))
    for r in range(repeats + 1):  # round 0 warms up: pages touched, MPI's buffers set up
        for i, b in enumerate(candidates):
            runs = _runs(src.size, _F32.itemsize, b)
            comm.Barrier()
            t0 = time.perf_counter()
            _sum_host(comm, src, dst, runs, 0)
            times[r, i] = time.perf_counter() - t0
    comm.Allreduce(_mpi().IN_PLACE, times, op=_mpi().MAX)  # the same table on every rank
    return {b: float(statistics.median(times[1:, i])) for i, b in enumerate(candidates)}


def _save(comm: Any, path: Path, best: int, seconds: dict[int, float], nbytes: int) -> None:
    """Writes the choice to ``path`` from one rank per node (the ranks of a node share its
    filesystem; nodes may not), and raises the same OSError on every rank if a writer failed."""
    record = {
        "bucket_bytes": best,
        "library": _library(),
        "ranks": comm.Get_size(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "nbytes": nbytes,
        "seconds": {str(b): t for b, t in seconds.items()},
    }
    local = comm.Split_type(_mpi().COMM_TYPE_SHARED)
    writer = local.Get_rank() == 0
    local.Free()
    error = ""
    if writer:
        try:
            _write_json(path, record)
        except OSError as e:
            error = f"rank {comm.Get_rank()}: {e}"
    errors = [e for e in comm.allgather(error) if e]
    _saved.pop(str(path), None)  # a later process-default lookup reads the new file
    if errors:
        raise OSError(f"calibrate could not save {path} ({errors[0]})")


def _write_json(path: Path, record: dict) -> None:
    """Writes ``record`` to ``path`` whole or not at all: a temporary file renamed into place, so
    that a reader (or a second writer on a shared filesystem) never sees half a file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- MPI facts for `numbaccum info` ---------------------------------------------------------


def cuda_aware() -> bool:
    """Whether CUDA buffers go to MPI directly: ``NUMBACCUM_MPI_CUDA_AWARE=1``/``0`` decides,
    else the MPI library's ``MPIX_Query_cuda_support()`` (MPICH and Open MPI have it; mpi4py does
    not wrap it, so it is looked up through ctypes), else False: staged through the host.

    Returns:
        True where the MPI library takes device buffers, else False.

    References:
        MPICH's and Open MPI's ``MPIX_Query_cuda_support`` (the MPI extension both define).

    Examples:
        >>> from numbaccum.distributed import cuda_aware
        >>> cuda_aware() in (True, False)
        True
    """
    setting = str(_config.MPI_CUDA_AWARE).lower()
    if setting in ("0", "1"):
        return setting == "1"
    MPI = _mpi()
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


def _library() -> str:
    """The MPI library's name and version, on one line ("MPICH Version: 5.0.2")."""
    return " ".join(_mpi().Get_library_version().strip().splitlines()[0].split())


def _ranks(n: Any) -> str:
    return "1 rank" if n == 1 else f"{n} ranks"


def _human(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} bytes"


def describe() -> str:
    """One line for ``numbaccum info``: mpi4py, the MPI library, how CUDA buffers travel, and the
    bucket size in use and where it came from.

    Returns:
        The line, e.g. ``"mpi4py 4.1.2, MPICH Version: 5.0.2; CUDA buffers staged through host
            memory; buckets of 16 MiB (default)"``.

    References:
        ``mpi4py.MPI.Get_library_version`` (the MPI library's own words).

    Examples:
        >>> from numbaccum.distributed import describe
        >>> describe().startswith("mpi4py ")
        True
    """
    try:
        import mpi4py
    except ImportError:
        return f"mpi4py not installed ({INSTALL_HINT})"
    how = "passed to MPI directly (CUDA-aware MPI)" if cuda_aware() else "staged through host memory"
    bucket = _bucket_in_use()
    return (
        f"mpi4py {mpi4py.__version__}, {_library()}; CUDA buffers {how}; "
        f"buckets of {_human(bucket.nbytes)} ({bucket.source})"
    )


# --- sharded optimizer state (ZeRO stage 1): the machinery is numbaccum/sharded.py ----------

from .sharded import Sharded, ShardedState  # noqa: E402  (sharded imports nothing of this module)


def shard(tx: Any, comm: Any = None, bucket_bytes: int | None = None) -> Sharded:
    """``tx`` with its optimizer state sharded over the ranks of ``comm`` (ZeRO stage 1).

    Every rank holds the whole model and its own gradients, as with ``chain(allreduce_mean(),
    tx)``, but keeps the state of about ``1/n`` of the params: each step reduce-scatters the
    gradients (one ``Reduce_scatter`` per bucket), runs ``tx``'s fused step on this rank's part
    (the division by ``n`` riding on its first kernel, the update added to the params in its last
    pass), and all-gathers the params in place (one ``Allgatherv`` per bucket). Every rank ends
    each step with the same bits, and on two ranks the same bits as ``chain(allreduce_mean(),
    tx)`` (each element's sum is ``a + b``); on more, within the rounding of the sum's order.

    Per-element tx: each bucket split evenly (`numbaccum.sharded`); else whole leaves: in each buffer rank
    ``r`` owns a contiguous run of leaves, the cuts at the leaf boundaries nearest to ``r/n`` of
    the elements, so per-leaf transformations (Adafactor, LAMB, per-leaf norms, masks) are exact;
    a rank may own nothing of a small buffer. ``tx`` may hold only transformations known to be
    exact on such a part: per element, per leaf, and the combinators around them. A reduction
    over the whole tree is refused with a TypeError naming it (`numbaccum.clip_by_global_norm`:
    use this module's `clip_by_global_norm` with the same ``comm``, whose norm is combined over the
    ranks), as is user code. Host buffers only (CUDA arrays raise TypeError).

    Checkpoints: save each rank's `ShardedState` with `numbaccum.save_state` (``state.<rank>.npz``)
    and load it on the same rank; or `Sharded.gather_state` the whole state onto rank 0 (as an
    unsharded run of ``tx`` holds it) and `Sharded.scatter_state` it back, on any number of ranks.

    Args:
        tx: the transformation (e.g. ``numbaccum.adamw(1e-3)``).
        comm: the communicator; None: ``MPI.COMM_WORLD``.
        bucket_bytes: bytes per message, as for `allreduce_sum_`; None: the size in use.

    Returns:
        A `numbaccum.sharded.Sharded`: ``init(params)`` (collective: checks that every rank has
        the same layout and bucket size) gives this rank's `ShardedState`;
        ``step_(grads, state, params)``, or ``numbaccum.step_(sharded, grads, state, params)``,
        steps the params in place and returns the new state (collective).

    Raises:
        TypeError: ``tx`` is not a transformation, or holds one that is not exact on a part of
            the leaves (named), or ``bucket_bytes`` is not an int.
        ValueError: ``bucket_bytes < 1``, or ``tx``'s sharded clip is over another communicator.

    References:
        PyTorch's ``torch.distributed.optim.ZeroRedundancyOptimizer``; Rajbhandari et al., ZeRO:
        Memory Optimizations Toward Training Trillion Parameter Models (2020), stage 1.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> from mpi4py import MPI
        >>> from numbaccum.distributed import shard
        >>> opt = shard(nba.adamw(0.1), MPI.COMM_SELF)
        >>> params = nba.FlatTree.from_tree({"w": np.ones(2, np.float32)})
        >>> state = opt.init(params)
        >>> state = nba.step_(opt, {"w": np.array([1.0, -1.0], np.float32)}, state, params)
        >>> [round(float(x), 4) for x in params["w"]]  # adamw's first step: -0.1 * sign(g), decay
        [0.9, 1.1]
    """
    bucket = _bucket_in_use(bucket_bytes)
    comm = _comm(comm)
    _abort_on_uncaught(comm)

    def check(layout: Layout) -> None:
        check_same_layout(layout, comm)
        _check_same_bucket(bucket, comm)

    return Sharded(tx, comm, bucket.nbytes, check, (_ShardedClip,), (_AllreduceMean,))
