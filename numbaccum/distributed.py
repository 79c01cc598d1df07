"""Data-parallel training over MPI: one collective per dtype buffer, never one per leaf.

``pip install "numbaccum[mpi]"`` installs mpi4py and MPICH. ``import numbaccum`` never imports
mpi4py, and neither does importing this module: mpi4py (which initialises MPI) is imported when a
function first needs a communicator.

Replicated data parallelism (every rank holds the whole model and a shard of the data)::

    opt = nba.MultiSteps(nba.chain(allreduce_mean(), nba.clip_by_global_norm(1.0), nba.adam(1e-3)), k)

averages the accumulated gradients once per emitted step (one ``Allreduce`` per dtype buffer),
and every rank then runs the same optimizer on the same bits. Sharded models (each rank holds
different leaves) use `global_norm` and `clip_by_global_norm` with a communicator: one scalar
collective per call.

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
import hashlib
import math
import sys
from typing import Any, NamedTuple

import numpy as np

from . import _config
from ._checks import non_negative
from .backend import ops_for
from .base import Stage, Step
from .clipping import global_norm as _local_norm
from .contract import ONE, Factor
from .declared import expect_state, field_owner
from .flat import FlatTree, layout_and_device
from .layout import Layout
from .protocol import EmptyState, GradientTransformationExtraArgs
from .tables import sum_in_order
from .updates import ParamsRef, Spec, Updates

__all__ = [
    "AllreduceMeanState",
    "allreduce_mean",
    "allreduce_mean_",
    "allreduce_sum_",
    "check_same_layout",
    "clip_by_global_norm",
    "cuda_aware",
    "describe",
    "global_norm",
]

_F16 = np.dtype(np.float16)
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


# --- the collective on flat buffers ---------------------------------------------------------


def _chunks(n: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of at most ``_config.MPI_MAX_COUNT`` elements: MPI counts are C ints."""
    step = max(1, int(_config.MPI_MAX_COUNT))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _allreduce_host(comm: Any, src: np.ndarray, dst: np.ndarray) -> None:
    """``dst = sum over ranks of src`` (NumPy, ``src`` may be ``dst``), chunked."""
    MPI = _mpi()
    for lo, hi in _chunks(dst.size):
        if src is dst:
            comm.Allreduce(MPI.IN_PLACE, dst[lo:hi], op=MPI.SUM)
        else:
            comm.Allreduce(src[lo:hi], dst[lo:hi], op=MPI.SUM)


def _staging(out: FlatTree, gi: int, dtype: np.dtype, what: str) -> np.ndarray:
    """A host buffer of group ``gi``'s size kept beside ``out`` (allocated once, pinned for a CUDA
    ``out`` so that copies run at full speed)."""
    # Kept in the storage's attributes, which the renewals of a state's buffer share
    # (`numbaccum.transaction.current`): allocated once per storage, not once per update.
    bufs = out.__dict__.setdefault("_staging", {})
    key = (gi, dtype, what)
    h = bufs.get(key)
    if h is None:
        n = out.layout.group_sizes[gi]
        if out.device:
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


def _reduce(comm: Any, src: FlatTree, out: FlatTree, mean: bool) -> None:
    """``out = sum (or mean) over ranks of src``, one Allreduce per dtype group (chunked).

    float16 and bfloat16 groups are summed in float32 (MPI has no sum of either, and a float16 sum
    overflows where the mean does not) and their mean is rounded once; so a tree with such a
    group takes ``mean=True``. CUDA groups are staged through host memory, one copy each way, unless the MPI
    library is CUDA-aware (`cuda_aware`), which reads and writes device memory itself."""
    n = comm.Get_size()
    direct = out.device and cuda_aware()
    s = _sync_stream() if out.device else 0
    for gi, (x, y) in enumerate(zip(src.groups, out.groups)):
        if y.size == 0:
            continue  # every rank has the same layout (checked at init): all skip it
        dt = np.dtype(y.dtype)
        half = dt.itemsize == 2  # float16 or bfloat16: MPI has no sum of either
        if not half and not out.device:
            _allreduce_host(comm, x, y)
            if mean:
                ops_for(y).scale_(y, y, Factor(float(n), 1.0))
        elif not half and direct:
            for lo, hi in _chunks(y.size):  # device pointers straight to MPI
                comm.Allreduce(x[lo:hi], y[lo:hi], op=_mpi().SUM)
            if mean:
                ops_for(y).scale_(y, y, Factor(float(n), 1.0))
        elif not half:  # CUDA through the host: one copy down, one up
            h = _staging(out, gi, dt, "sum")
            x.copy_to_host(h, stream=s)
            if s != 0:
                s.synchronize()
            _allreduce_host(comm, h, h)
            if mean:
                np.divide(h, n, out=h)
            y.copy_to_device(h, stream=s)
        else:
            h32 = _staging(out, gi, _F32, "sum")
            if out.device:
                h16 = _staging(out, gi, _F16, "half")
                x.copy_to_host(h16, stream=s)
                if s != 0:
                    s.synchronize()
                np.copyto(h32, h16)
            else:
                h32[...] = x  # exact (float16 and bfloat16 are float32 values)
            _allreduce_host(comm, h32, h32)
            # the mean in float32, rounded once; dividing after rounding the sum could overflow
            if mean:
                np.divide(h32, np.float32(n), out=h32)
            (h16 if out.device else y)[...] = h32
            if out.device:
                y.copy_to_device(h16, stream=s)


def allreduce_sum_(src: FlatTree, out: FlatTree | None = None, comm: Any = None) -> FlatTree:
    """``out = sum over ranks r of src_r``, one ``Allreduce`` per dtype buffer; returns ``out``.

    ``out`` defaults to ``src`` (in place); it must have ``src``'s layout and dtypes. Buffers of
    more than ``2**31 - 1`` elements go as several messages (``_config.MPI_MAX_COUNT``). CUDA
    buffers are staged through the host unless the MPI library is CUDA-aware. float16 buffers are
    summed in float32 and rounded once (an overflow gives inf: prefer `allreduce_mean_`).
    """
    comm = _comm(comm)
    out = src if out is None else out
    _check_pair(src, out)
    _reduce(comm, src, out, mean=False)
    return out


def allreduce_mean_(src: FlatTree, out: FlatTree | None = None, comm: Any = None) -> FlatTree:
    """``out = (sum over ranks r of src_r) / n_ranks``, one ``Allreduce`` per dtype buffer.

    Like `allreduce_sum_`, then a division by the number of ranks (float16: in float32, rounded
    once). Every rank gets the same bits.
    """
    comm = _comm(comm)
    out = src if out is None else out
    _check_pair(src, out)
    _reduce(comm, src, out, mean=True)
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
    """
    comm = _comm(comm)
    text = repr(layout.treedef) + "\n" + "\n".join(_leaf_records(layout, name))
    mine = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    every = np.empty((comm.Get_size(), mine.size), np.uint8)
    comm.Allgather(mine, every)
    if (every == every[0]).all():
        return
    records = comm.allgather((repr(layout.treedef), _leaf_records(layout, name)))
    r = next(i for i in range(len(every)) if (every[i] != every[0]).any())
    (td0, leaves0), (tdr, leavesr) = records[0], records[r]
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
    """
    key = _ord_key(ord)
    comm = _comm(comm)
    local = _local_norm(tree, ord=key, squared=key == 2)
    total = _combine(local, key, comm)
    if key == 2:
        return total if squared else math.sqrt(total)
    return total * total if squared else total


# --- the transformations --------------------------------------------------------------------


class AllreduceMeanState(NamedTuple):
    """State of `allreduce_mean`.

    Attributes:
        mean: the buffer the collective writes into (shaped like params, in the updates' dtypes);
            it holds the last sum over ranks (or mean, for trees with float16 leaves).
    """

    mean: FlatTree


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


def allreduce_mean(comm: Any = None) -> GradientTransformationExtraArgs:
    """Averages the updates across the ranks of ``comm`` (default ``MPI.COMM_WORLD``):
    ``u = (sum over ranks r of g_r) / n_ranks``.

    One ``Allreduce`` per dtype buffer, into a buffer the state owns; the division by
    ``n_ranks`` is not a pass of its own but rides on the next kernel that reads the updates
    (trees with float16 leaves: summed in float32 and divided on the host). Every rank gets the
    same bits, so replicated params and optimizer states stay identical. On one rank it is the
    identity. Put it first: ``chain(allreduce_mean(), clip_by_global_norm(1.0), adam(1e-3))``;
    inside ``MultiSteps(..., k)`` it averages once per emitted step instead of every mini-step.

    ``init`` checks with one small collective that every rank has the same tree structure,
    shapes and dtypes (ValueError on every rank otherwise). ``update`` is collective: every rank
    must call it, the same number of times.
    """
    comm = _comm(comm)
    _abort_on_uncaught(comm)
    return _AllreduceMean(comm).transformation()


class _AllreduceMean(Stage):
    """`allreduce_mean` as a stage: the plan checks the state, the run is the collective."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.n = comm.Get_size()

    def init(self, params: Any) -> AllreduceMeanState:
        layout, device = layout_and_device(params, "params")
        check_same_layout(layout, self.comm)
        return AllreduceMeanState(FlatTree.zeros(layout, None, device))

    def owner(self, state: Any) -> FlatTree | None:
        """The state's buffer: it defines the layout the updates must have."""
        return field_owner(state, AllreduceMeanState, "mean")

    def plan(self, spec: Spec, state: Any, params: ParamsRef | None, extra: dict) -> Step:
        out = expect_state(state, AllreduceMeanState, "mean", spec)
        new_state = AllreduceMeanState(out)
        if self.n == 1:
            return Step(lambda u: (u, new_state))
        comm, n = self.comm, self.n
        half = any(d.itemsize == 2 for d in spec.layout.group_dtypes)

        def run(u: Updates) -> tuple[Updates, AllreduceMeanState]:
            # A pending factor is applied on the way into our buffer: no pass of its own.
            src = u.flat if u.factor.is_one else u.into(out)
            _reduce(comm, src, out, mean=half)
            # The division by n rides on the next kernel (float16 and bfloat16 trees: divided on
            # the host).
            return Updates(out, owned=True, factor=ONE if half else Factor(float(n), 1.0)), new_state

        return Step(run)


def clip_by_global_norm(max_norm: float, comm: Any = None) -> GradientTransformationExtraArgs:
    """`numbaccum.clip_by_global_norm` for a model whose leaves are sharded across ranks:

    ``u = g`` if ``norm < max_norm``, else ``(g / norm) * max_norm``, with ``norm`` the L2 norm
    over every rank's leaves (`global_norm` with ``comm``: one scalar collective per update, the
    same bits on every rank). Each rank passes its own shard; the layouts may differ between
    ranks. On the GPU the local sum of squares comes back to the host (one synchronisation).

    Raises:
        ValueError: ``max_norm`` is negative.
    """
    max_norm = non_negative(max_norm, "max_norm")
    comm = _comm(comm)
    _abort_on_uncaught(comm)

    return _ShardedClip(max_norm, comm).transformation()


class _ShardedClip(Stage):
    """The sharded clip as a stage: the run takes the norm over every rank (one collective)."""

    def __init__(self, max_norm: float, comm: Any) -> None:
        self.max_norm = max_norm
        self.comm = comm

    def init(self, params: Any) -> EmptyState:
        return EmptyState()

    def plan(self, spec: Spec, state: Any, params: ParamsRef | None, extra: dict) -> Step:
        max_norm, comm = self.max_norm, self.comm

        def run(u: Updates) -> tuple[Updates, Any]:
            value = u.settled()
            norm = math.sqrt(_combine(_local_norm(value.flat, squared=True), 2, comm))
            if norm < max_norm:
                return value, state
            if norm == 0.0:  # and so max_norm == 0: zeros, not 0 / 0
                return value.scaled(Factor(1.0, 0.0)), state
            return value.scaled(Factor(norm, max_norm)), state

        return Step(run)


# --- MPI facts for `numbaccum info` ---------------------------------------------------------


def cuda_aware() -> bool:
    """Whether CUDA buffers go to MPI directly: ``NUMBACCUM_MPI_CUDA_AWARE=1``/``0`` decides,
    else the MPI library's ``MPIX_Query_cuda_support()`` (MPICH and Open MPI have it; mpi4py does
    not wrap it, so it is looked up through ctypes), else False: staged through the host."""
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


def describe() -> str:
    """One line for ``numbaccum info``: mpi4py, the MPI library, and how CUDA buffers travel."""
    try:
        import mpi4py
    except ImportError:
        return f"mpi4py not installed ({INSTALL_HINT})"
    MPI = _mpi()
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    how = "passed to MPI directly (CUDA-aware MPI)" if cuda_aware() else "staged through host memory"
    return f"mpi4py {mpi4py.__version__}, {library}; CUDA buffers {how}"
