"""`numbaccum bench`: numbaccum next to a NumPy per-leaf version of the same math and, when they are
installed, PyTorch's foreach ops and optax under ``jax.jit``, in one run, on the CPU and (when one
works) on a CUDA device.

Workloads (float32): ResNet-50 shapes (25.6M parameters in 161 leaves), 2000 small leaves of
100-5000 elements, and a tiny tree of 10 leaves of 10 elements, where what is measured is the
per-call overhead (reported in microseconds); on request, GPT-2-small shapes (124M parameters in
148 leaves, about 10 GB with every peer). Operations: clip_by_global_norm (``max_norm`` far
below the norm, so it always scales), a MultiSteps mini-step, ema with debias, and the emitting
step of ``MultiSteps(chain(clip_by_global_norm(1.0), adam(1e-3)), 4)`` (the full step: accumulate,
clip the mean, Adam, reset).

Each operation is timed call by call after a warm-up (which also compiles the kernels), the
implementations of a row alternately (A, B, C, A, B, C, ...; MultiSteps: a whole cycle each in
turn), so that a shared machine's changing load falls on all of them alike (timed in blocks, the
ratio against PyTorch moved between 0.64x and 1.37x in back-to-back runs; alternated, by less than
0.2x): median, min and max of each. GB/s counts the minimal bytes per float32 parameter (what
`numbaccum.explain` calls the arithmetic minimum): a mini-step reads g and reads and writes acc
(12), except the first of a cycle, which only writes acc (8); the full step reads g and acc for
the norm, reads them again beside mu and nu, writes mu, nu, the update and the zeroed acc (40);
ema with debias reads g, reads and writes ema, writes the update (16); clip_by_global_norm reads
g for the norm and again for the output, and writes the output (12).
The copy floor is measured in the same run: on the CPU the faster of ``np.copyto`` and a parallel
copy of a large buffer, on the GPU a device-to-device copy of the workload's size. On the GPU,
calls are timed between CUDA events (optax: wall time, its step blocks until ready).

A run first says what it will time, then a line as each phase and row begins. Each peer runs in a
process of its own (`worker`), timed there call by call, in turn with the others: a row whose
build and first call (compile included) run over the peer budget, or whose process grows past its
memory bound, is abandoned (the process killed) and noted under the table. Each row builds only
its own operation's states, so a run holds one operation's memory at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _progress
from . import workloads
from .baselines import B1, B2, DECAY, EPS, LR, NumpyClipByGlobalNorm, NumpyEma, NumpyMultiStepsAdam
from .peers import FULL_MAX_NORM, PEERS, Peer, Steps, torch_available
from .worker import WALL_FACTOR, PeerProcess, PeerSkipped, resident_bytes

K = 4  # mini-steps per MultiSteps cycle
CLIP_MAX_NORM = 1e-3  # far below the gradients' norm: the standalone clip always scales

OPS = ("clip", "multisteps", "ema")
# The order the rows are timed in (the table keeps the order asked for): the heaviest compile
# last, so that a peer abandoned over it (which sits out the rest of the workload) has been timed
# on the others. optax's jit of MultiSteps(chain(clip, adam)) over ResNet-50's 161 leaves takes
# 16 s of CPU time and 2.5 GB; of clip_by_global_norm, 1.6 s.
TIME_ORDER = ("clip", "ema", "multisteps")
MINI = "MultiSteps mini-step"
FULL = "full step: MultiSteps(chain(clip, adam)), emitting"
LABELS = {"clip": ("clip_by_global_norm",), "multisteps": (MINI, FULL), "ema": ("ema (debias)",)}
PLAN_LABELS = {
    "clip": "clip_by_global_norm",
    "multisteps": "MultiSteps(chain(clip, adam), 4): its mini-step and its emitting full step",
    "ema": "ema (debias)",
}
BYTES_PER_PARAM = {
    "clip_by_global_norm": 12.0,
    MINI: (8 + 12 * (K - 2)) / (K - 1),  # the first mini-step of a cycle reads no acc
    FULL: 40.0,
    "ema (debias)": 16.0,
}

DEVICES = ("cpu", "cuda")
DEFAULT_WORKLOADS = ("resnet50", "many_small", "tiny")
QUICK_WORKLOADS = ("many_small", "tiny")
# Timed calls per operation (MultiSteps: calls of all positions of a cycle, after a warm-up cycle).
REPEATS = {"gpt2_small": 12, "resnet50": 20, "many_small": 40, "tiny": 2000}
QUICK_REPEATS = {"gpt2_small": 4, "resnet50": 4, "many_small": 4, "tiny": 200}
# A peer's build and first calls of a row (its compile included) must finish within this many
# seconds of CPU time (and WALL_FACTOR times as many of wall time), or the row is skipped with a
# note: optax's jit of the 2000-leaf tree would otherwise hold a run for many minutes and gigabytes.
PEER_BUDGET_S = 10.0
# The most resident memory a peer's process may hold: its trees and states (at most about 12
# float32 copies of the parameters), plus this much for its library.
PEER_MEMORY_BASE = 3 << 29  # 1.5 GiB
PEER_MEMORY_COPIES = 12
# The run's processes together: a peer's process is also abandoned when it would take the sum of
# this process's and the peers' resident memory past this (--max-memory). numbaccum and NumPy
# alone need 1.5 GB on ResNet-50; GPT-2 small with every peer needs about 10 GB.
MAX_MEMORY_GB = 4.0
MEMORY_SLACK = 0.05  # of it, kept for what a process can grow between two looks (0.1 s apart)
PER_CALL = {"tiny"}  # overhead-bound: reported in microseconds per call, no GB/s
# The copy floor's buffers: 16 float32 copies of the largest workload, at most 2 x 128 MB (far
# past any cache; 2 x 500 MB cost seconds of page faults on a busy 2-core machine).
COPY_FLOOR_BYTES = 1 << 27

Clock = Callable[[Callable[[], Any]], float]


def _wall(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    return [_wall(fn) for _ in range(repeats)]


def copy_floor(nbytes: int, repeats: int) -> float:
    """GB/s (read + write bytes) of the faster of ``np.copyto`` (one thread) and a parallel numba
    copy (all threads) between two preallocated float32 buffers: the roof a kernel can reach."""
    from numbaccum.backend import ops_for
    from numbaccum.contract import ONE

    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    ops = ops_for(a)
    ops.scale_(b, a, ONE)  # a scale by one is a copy through our own kernel
    t_np = min(_times(lambda: np.copyto(b, a), repeats))
    t_par = min(_times(lambda: ops.scale_(b, a, ONE), repeats))
    return 2 * a.nbytes / min(t_np, t_par) / 1e9


# --- what is timed --------------------------------------------------------------------------


def numbaccum_steps(params: Any, grads: Any, k: int = K, ops: Sequence[str] = OPS) -> Steps:
    """numbaccum's steps of ``ops`` on ``params`` and ``grads`` as given: FlatTrees (host or
    device), plain trees of NumPy arrays, or trees of PyTorch CUDA tensors."""
    import numbaccum as nba

    txs = {
        "multisteps": lambda: nba.MultiSteps(
            nba.chain(nba.clip_by_global_norm(FULL_MAX_NORM), nba.adam(LR, B1, B2, EPS)), k
        ),
        "ema": lambda: nba.ema(DECAY),
        "clip": lambda: nba.clip_by_global_norm(CLIP_MAX_NORM),
    }

    def stepper(tx: Any) -> Callable[[], None]:
        box = {"state": tx.init(params)}

        def step() -> None:
            _, box["state"] = tx.update(grads, box["state"], params)

        return step

    return {op: stepper(txs[op]()) for op in ops}


def numpy_steps(
    params: list[np.ndarray], grads: list[np.ndarray], k: int = K, ops: Sequence[str] = OPS
) -> Steps:
    """The NumPy per-leaf baselines (`baselines`) of the same math, for ``ops``."""
    make: dict[str, Callable[[], Any]] = {
        "multisteps": lambda: NumpyMultiStepsAdam(params, k, max_norm=FULL_MAX_NORM),
        "ema": lambda: NumpyEma(params),
        "clip": lambda: NumpyClipByGlobalNorm(params, CLIP_MAX_NORM),
    }
    return {op: functools.partial(make[op]().update, grads) for op in ops}


class Impl:
    """One implementation timed in this process on one device: a name, how to build its steps
    of some operations from the workload's trees, how to time a call."""

    def __init__(
        self, name: str, build: Callable[[dict[str, Any], Sequence[str]], Steps], clock: Callable[[], Clock]
    ) -> None:
        self.name, self.build, self.clock = name, build, clock


def _flat_pair(trees: dict[str, Any], device: bool) -> tuple[Any, Any]:
    """numbaccum's own copies of the workload's trees (made once per workload and device)."""
    import numbaccum as nba

    key = "device flat" if device else "flat"
    if key not in trees:
        p, g = nba.FlatTree.from_tree(trees["params"]), nba.FlatTree.from_tree(trees["grads"])
        trees[key] = (nba.to_device(p), nba.to_device(g)) if device else (p, g)
    return trees[key]


def _torch_views(trees: dict[str, Any], ops: Sequence[str]) -> Steps:
    p, g = _flat_pair(trees, True)
    return numbaccum_steps(p.tree_as("torch"), g.tree_as("torch"), ops=ops)


def implementations(device: str, workload: str) -> list[Impl]:
    """What runs in this process on ``device`` for ``workload``: numbaccum and the NumPy
    baseline (the peers run in processes of their own: `peers_to_run`)."""
    wall = lambda: _wall  # noqa: E731
    if device == "cpu":
        flat = lambda t, ops: numbaccum_steps(*_flat_pair(t, False), ops=ops)  # noqa: E731
        out = [Impl("numbaccum", flat, wall)]
        if workload in PER_CALL:  # the overhead of a plain tree (checked and packed every call)
            plain = lambda t, ops: numbaccum_steps(t["params"], t["grads"], ops=ops)  # noqa: E731
            out.append(Impl("numbaccum (plain tree)", plain, wall))
        out.append(Impl("numpy", lambda t, ops: numpy_steps(t["p_leaves"], t["g_leaves"], ops=ops), wall))
        return out
    from . import gpu

    device_flat = lambda t, ops: numbaccum_steps(*_flat_pair(t, True), ops=ops)  # noqa: E731
    out = [Impl("numbaccum", device_flat, gpu.Clock)]
    if not gpu.status()[1] and torch_available("cuda"):  # the same device buffers as PyTorch tensors
        out.append(Impl("numbaccum (torch tensors)", _torch_views, gpu.Clock))
    return out


def peers_to_run(device: str, peers: bool | Sequence[str]) -> tuple[dict[str, Peer], dict[str, Peer]]:
    """``(to run, missing)``: the peers of `PEERS` named in ``peers`` (all for True) that are
    installed, and those that are not. None runs on the CUDA simulator (PyTorch and JAX need a
    real GPU)."""
    names = list(PEERS) if peers is True else [] if peers is False else list(dict.fromkeys(peers))
    if device == "cuda":
        from . import gpu

        if gpu.status()[1]:
            return {}, {}
    chosen = {name: PEERS[name] for name in names}
    return (
        {n: p for n, p in chosen.items() if p.installed()},
        {n: p for n, p in chosen.items() if not p.installed()},
    )


# A row stops repeating once it has spent this long per contender (with at least 3 samples): a
# slow peer (a 2000-leaf tree converted leaf by leaf, say) would otherwise hold the run for minutes.
ROW_SECONDS = 2.0


class _Local:
    """A contender in this process: its step and clock."""

    skipped: str | None = None

    def __init__(self, step: Callable[[], Any], clock: Clock) -> None:
        self.step, self.clock = step, clock

    def calls(self, n: int) -> list[float]:
        return [self.clock(self.step) for _ in range(n)]


class _Remote:
    """A contender in a peer's process (`worker.PeerProcess`), timed there call by call."""

    skipped: str | None = None

    def __init__(self, process: PeerProcess, op: str, first_s: float) -> None:
        self.process, self.op, self.first_s = process, op, first_s

    def calls(self, n: int) -> list[float]:
        return self.process.calls(self.op, n)


def measure(step: Callable[[], Any], op: str, clock: Clock, repeats: int, warmup: int) -> dict:
    """``{row label: per-call seconds}`` of one implementation (`measure_alternating`)."""
    (out,) = measure_alternating([(step, clock)], op, repeats, warmup)
    assert out is not None  # only a peer's process drops out of a row
    return out


def measure_alternating(contenders: list[Any], op: str, repeats: int, warmup: int) -> list[dict | None]:
    """``[{row label: per-call seconds}]``, one per contender (a ``(step, clock)`` pair, or any
    object whose ``calls(n)`` makes and times ``n`` calls), timed in turn: call by call (A, B, C,
    A, B, C, ...); MultiSteps cycle by cycle (a warm-up cycle each, then the mini-steps and the
    emitting (full) steps of ``max(2, repeats // K)`` cycles timed apart). Each row takes
    ``repeats`` samples, or fewer (at least 3; 2 cycles) once ``ROW_SECONDS`` per contender have
    passed. A contender whose call raises `PeerSkipped` drops out of the row: its entry is None
    and its ``skipped`` holds why."""
    cs = [c if hasattr(c, "calls") else _Local(*c) for c in contenders]
    live = list(range(len(cs)))
    n = max(1, len(cs))

    def call(i: int, k: int) -> list[float]:
        try:
            return cs[i].calls(k)
        except PeerSkipped as e:
            cs[i].skipped = str(e)
            live.remove(i)
            return []

    def more(samples: int, least: int) -> bool:
        return samples < least or time.perf_counter() - start < ROW_SECONDS * n

    start = time.perf_counter()
    if op == "multisteps":
        minis: list[list[float]] = [[] for _ in cs]
        emits: list[list[float]] = [[] for _ in cs]
        for cycle in range(max(2, repeats // K) + 1):
            if not more(cycle, 3):
                break
            for i in list(live):
                ts = call(i, K)
                if cycle and ts:
                    minis[i] += ts[:-1]
                    emits[i].append(ts[-1])
        return [{MINI: minis[i], FULL: emits[i]} if i in live else None for i in range(len(cs))]
    for i in list(live):
        call(i, warmup)
    start = time.perf_counter()
    times: list[list[float]] = [[] for _ in cs]
    rounds = 0
    while rounds < repeats and more(rounds, 3):
        for i in list(live):
            times[i] += call(i, 1)
        rounds += 1
    return [{LABELS[op][0]: times[i]} if i in live else None for i in range(len(cs))]


class Progress:
    """Progress on stderr, each line with the seconds since the run began: a bar on a terminal,
    one line per step otherwise; `note` adds a line (a phase begins, a row is skipped)."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total, self.done = max(total, 1), 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def _elapsed(self) -> str:
        return f"{time.perf_counter() - self.start:.1f} s"

    def step(self, label: str) -> None:
        self.done += 1
        if self.tty:
            filled = 24 * self.done // self.total
            bar = "#" * filled + "-" * (24 - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {self._elapsed()} {label[:70]:<70}")
        else:
            self.stream.write(f"  [{self.done}/{self.total}, {self._elapsed()}] {label}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        lead = "\r" + " " * 110 + "\r" if self.tty else ""  # a line of its own above the bar
        self.stream.write(f"{lead}  [{self._elapsed()}] {text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --- a run ----------------------------------------------------------------------------------


def _trees(workload: str) -> dict[str, Any]:
    params, grads = workloads.bench_trees(workload)
    return {
        "params": params,
        "grads": grads,
        "p_leaves": workloads.leaves(params),
        "g_leaves": workloads.leaves(grads),
    }


def _peer_memory(n_params: int) -> int:
    return PEER_MEMORY_BASE + PEER_MEMORY_COPIES * 4 * n_params


class _Peers:
    """The peers' processes on one device: each started once (it imports its library while this
    process works), given each workload in turn, dropped for the rest of a workload once it
    fails or runs over its budget, and started again for the next workload if it was killed."""

    def __init__(
        self, peers: dict[str, Peer], device: str, budget_s: float, max_memory_gb: float = MAX_MEMORY_GB
    ) -> None:
        self.peers, self.device, self.budget_s = peers, device, budget_s
        self.max_memory = int(max_memory_gb * 1e9)
        self.procs: dict[str, PeerProcess] = {}
        self.gone: dict[str, str] = {}
        self.n_params = 0

    def _allowance(self, label: str) -> int:
        """What peer ``label`` may hold: its own bound, and no more than the run's memory less what
        this process and the other peers hold now."""
        others = sum(p.rss() for lb, p in self.procs.items() if lb != label)
        here = resident_bytes(os.getpid()) or 0
        room = int(self.max_memory * (1 - MEMORY_SLACK)) - here - others
        return min(_peer_memory(self.n_params), room)

    def begin(self, workload: str, n_params: int) -> None:
        """Has every peer build ``workload``'s trees (in its own process, while this one builds
        its own)."""
        self.gone, self.n_params = {}, n_params
        for p in self.peers.values():
            proc = self.procs.get(p.label)
            if proc is None or not proc.alive:
                if proc is not None:
                    proc.close()
                proc = self.procs[p.label] = PeerProcess(p, self.device, K, CLIP_MAX_NORM, self.budget_s)
            proc.load(workload, _peer_memory(n_params))

    def prepare(self, op: str, skipped: list[dict], progress: Progress | None) -> list[tuple[str, _Remote]]:
        """The peers ready to be timed on ``op``: each built its step and made its first calls
        (a MultiSteps cycle) within the budget; the others go to ``skipped`` with the reason."""
        out = []
        for label, proc in self.procs.items():
            why = self.gone.get(label)
            if why is None:
                try:
                    first = proc.prepare(op, K if op == "multisteps" else 1, self._allowance(label))
                    out.append((label, _Remote(proc, op, first)))
                    continue
                except PeerSkipped as e:
                    why = str(e)
                    if e.dead:
                        self.gone[label] = why
            else:
                why = f"not run: {why}"
            skipped.append(dict(op=op, impl=label, why=why))
            if progress is not None:
                progress.note(f"{label} skipped on {op}: {why}")
        return out

    def dropped(self, label: str, why: str, op: str, skipped: list[dict]) -> None:
        self.gone[label] = why
        skipped.append(dict(op=op, impl=label, why=why))

    def close(self) -> None:
        for proc in self.procs.values():
            proc.close()
        self.procs = {}


def _row(label: str, ts: list[float], impl: str, n_params: int, per_call: bool, floor: float | None) -> dict:
    med = statistics.median(ts)
    gbs = None if per_call else BYTES_PER_PARAM[label] * n_params / med / 1e9
    return dict(
        op=label,
        impl=impl,
        median_s=med,
        min_s=min(ts),
        max_s=max(ts),
        calls=len(ts),
        gbs=gbs,
        floor_fraction=None if gbs is None or not floor else gbs / floor,
    )


def run_workload(
    device: str,
    workload: str,
    ops: tuple[str, ...],
    repeats: int,
    impls: list[Impl],
    floor: float | None,
    progress: Progress | None = None,
    remote: _Peers | None = None,
) -> dict[str, Any]:
    """Times every implementation and operation on one device and workload: ``impls`` in this
    process, the peers of ``remote`` each in a process of its own (`worker`), alternately.
    ``floor``: the CPU copy floor in GB/s (the GPU measures its own, of the workload's size).
    Each row builds only its operation's steps, so a row holds one operation's memory at a time."""
    note = progress.note if progress is not None else lambda text: None
    remote = remote if remote is not None else _Peers({}, device, PEER_BUDGET_S)
    note(
        f"{device} {workload}: making the trees"
        + (
            f", and the peers' own ({', '.join(p.label for p in remote.peers.values())})"
            if remote.peers
            else ""
        )
    )
    shapes = workloads.WORKLOADS[workload]()
    n_params = workloads.count_params(shapes)
    remote.begin(workload, n_params)
    trees = _trees(workload)
    if device == "cuda":
        from . import gpu

        floor = gpu.copy_roof(n_params, 10)
    per_call = workload in PER_CALL
    rows: list[dict] = []
    skipped: list[dict] = []
    for op in sorted(ops, key=TIME_ORDER.index):
        names = [impl.name for impl in impls] + [lb for lb in remote.procs if lb not in remote.gone]
        if progress is not None:
            progress.step(f"{device} {workload}: {op}: {', '.join(names)}")
        here: list[tuple[str, _Local | _Remote]] = [
            (impl.name, _Local(impl.build(trees, (op,))[op], impl.clock())) for impl in impls
        ]
        here += remote.prepare(op, skipped, progress)
        results = measure_alternating([c for _, c in here], op, repeats, 20 if per_call else 1)
        for (name, c), result in zip(here, results):
            if result is None:
                remote.dropped(name, c.skipped or "dropped", op, skipped)
                note(f"{name} dropped on {op}: {c.skipped}")
                continue
            for label, ts in result.items():
                rows.append(_row(label, ts, name, n_params, per_call, floor))
                if isinstance(c, _Remote):  # how long its build and first calls took (its budget's use)
                    rows[-1]["first_call_s"] = c.first_s
        del here, results
        gc.collect()
    del trees
    gc.collect()
    if device == "cuda":
        from . import gpu

        gpu.free()
    labels = [label for op in ops for label in LABELS[op]]
    rows.sort(key=lambda r: labels.index(r["op"]))  # stable: contenders keep their order
    skipped.sort(key=lambda x: ops.index(x["op"]))
    return {
        "device": device,
        "workload": workload,
        "n_params": int(n_params),
        "n_leaves": workloads.count_leaves(shapes),
        "per_call": per_call,
        "copy_floor_gbs": floor,
        "rows": rows,
        "skipped": skipped,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def _threading_layer() -> str:
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:
        return "not yet chosen"


def _versions(peers: Sequence[Peer]) -> dict[str, str]:
    """Versions of the peers' libraries (read from their metadata: this process never imports
    them) and of matplotlib when this run imported it."""
    out = {}
    for peer in peers:
        for module in peer.modules:
            try:
                out[module] = importlib.metadata.version(module)
            except importlib.metadata.PackageNotFoundError:
                out[module] = "?"
    if "matplotlib" in sys.modules:
        out["matplotlib"] = str(getattr(sys.modules["matplotlib"], "__version__", "?"))
    return out


def describe_plan(
    devices: Sequence[str],
    workload_names: Sequence[str],
    ops: Sequence[str],
    plan: list[tuple[str, str, list[Impl], dict[str, Peer]]],
    missing: dict[str, Peer],
    budget_s: float,
    max_memory_gb: float = MAX_MEMORY_GB,
) -> str:
    """What a run will do, said before it does anything slow: the workloads, the operations, the
    contenders, the peers' budget, and how to install the peers that are missing."""
    sizes = []
    for w in workload_names:
        shapes = workloads.WORKLOADS[w]()
        sizes.append(
            f"{w} ({workloads.count_params(shapes):,} params in {workloads.count_leaves(shapes)} leaves)"
        )
    lines = [
        f"numbaccum bench: {', '.join(devices)} x {len(workload_names)} workloads x {len(ops)} operations",
        f"  workloads: {'; '.join(sizes)}",
        f"  operations: {'; '.join(PLAN_LABELS[op] for op in ops)}",
    ]
    for device in devices:
        here = [(w, impls, peers) for d, w, impls, peers in plan if d == device]
        names = {w: [i.name for i in impls] + [p.label for p in peers.values()] for w, impls, peers in here}
        common = [n for n in names[here[0][0]] if all(n in v for v in names.values())]
        extra = "; ".join(
            f"{w} also {', '.join(n for n in v if n not in common)}"
            for w, v in names.items()
            if set(v) - set(common)
        )
        lines.append(f"  {device}: {', '.join(common)}" + (f" ({extra})" if extra else ""))
    peers = {p.label: p for _, _, _, ps in plan for p in ps.values()}
    if peers:
        versions = "; ".join(v for v in (p.version() for p in peers.values()) if v)
        lines.append(
            f"  peers ({versions or ', '.join(peers)}) run in processes of their own: "
            f"a row whose build and first call (compile included) take over {budget_s:g} s of CPU time "
            f"or {WALL_FACTOR * budget_s:g} s (--peer-budget), or that would take the run past "
            f"{max_memory_gb:g} GB (--max-memory), is skipped with a note"
        )
    for name, peer in missing.items():
        lines.append(f"  not installed: {peer.label} ({name}): {peer.install}")
    return "\n".join(lines)


def run(
    workload_names: tuple[str, ...],
    devices: tuple[str, ...],
    ops: tuple[str, ...] = OPS,
    peers: bool | Sequence[str] = True,
    repeats: dict[str, int] | None = None,
    progress: bool = True,
    budget_s: float = PEER_BUDGET_S,
    max_memory_gb: float = MAX_MEMORY_GB,
) -> dict[str, Any]:
    """Every device x workload, with the machine's description; the JSON that ``--json`` writes.
    What will run goes to stderr first, then (``progress``) a line as each phase and row begins.
    ``budget_s``: a peer's CPU seconds per row (`PEER_BUDGET_S`); ``max_memory_gb``: what the
    run's processes may hold together before a peer is abandoned (`MAX_MEMORY_GB`)."""
    import numba

    repeats = repeats or REPEATS
    gpu_name = None
    if "cuda" in devices:
        from . import gpu

        works, _, gpu_name = gpu.status()
        if not works:
            raise SystemExit(f"numbaccum bench --device cuda: {gpu_name}")
    # What runs is decided (without importing any peer) and said before anything is timed.
    plan, missing = [], {}
    for d in devices:
        to_run, lacking = peers_to_run(d, peers)
        missing.update(lacking)
        plan += [(d, w, implementations(d, w), to_run) for w in workload_names]
    text = describe_plan(devices, workload_names, ops, plan, missing, budget_s, max_memory_gb)
    print(text, file=sys.stderr, flush=True)
    bar = Progress(len(plan) * len(ops)) if progress else None
    # On a terminal the bar is the run's progress: the lines of numbaccum's compiles
    # (numbaccum._progress) would break its line, so they are said only where the bar is lines too.
    with _progress.quiet() if bar is not None and bar.tty else contextlib.nullcontext():
        runs = _measure(plan, devices, workload_names, ops, repeats, bar, budget_s, max_memory_gb)
    if bar is not None:
        bar.close()
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cpus, {platform.system()} {platform.machine()}",
        "gpu": gpu_name,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(),
        "threading_layer": _threading_layer(),
        "peers": _versions([p for _, _, _, ps in plan for p in ps.values()]),
        "k": K,
        "runs": runs,
    }


def _measure(
    plan: list[tuple[str, str, list[Impl], dict[str, Peer]]],
    devices: tuple[str, ...],
    workload_names: tuple[str, ...],
    ops: tuple[str, ...],
    repeats: dict[str, int],
    bar: Progress | None,
    budget_s: float,
    max_memory_gb: float,
) -> list[dict[str, Any]]:
    """`run`'s measurements: the copy floor (CPU), then every device and workload of ``plan``."""
    floor = None
    if "cpu" in devices:
        if bar is not None:
            bar.note("measuring the copy floor")
        biggest = max(workloads.count_params(workloads.WORKLOADS[w]()) for w in workload_names)
        floor = copy_floor(min(COPY_FLOOR_BYTES, max(64 * biggest, 1 << 22)), 5)
    runs = []
    for device in devices:
        remote = _Peers(next(ps for d, _, _, ps in plan if d == device), device, budget_s, max_memory_gb)
        try:
            for d, w, impls, _ in plan:
                if d == device:
                    cpu_floor = floor if d == "cpu" else None
                    runs.append(run_workload(d, w, ops, repeats[w], impls, cpu_floor, bar, remote))
        finally:
            remote.close()
    return runs


# --- output ---------------------------------------------------------------------------------


def _num(v: float) -> str:
    return f"{v:.4g}" if v < 10_000 else f"{v:,.0f}"


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def format_table(result: dict[str, Any]) -> str:
    """The run as Markdown: a header, then one table per device and workload."""
    peers = ", ".join(f"{k} {v}" for k, v in result.get("peers", {}).items())
    lines = [
        f"numbaccum bench -- {result['date']}; {result['machine']}"
        + (f"; GPU: {result['gpu']}" if result.get("gpu") else ""),
        f"python {result['python']}, numpy {result['numpy']}, numba {result['numba']} "
        f"({result['numba_threads']} threads, {result['threading_layer']})" + (f", {peers}" if peers else ""),
    ]
    for run in result["runs"]:
        per_call = run["per_call"]
        unit, scale = ("us", 1e6) if per_call else ("ms", 1e3)
        floor = run["copy_floor_gbs"]
        lines += [
            "",
            f"{run['device']} -- {run['workload']}: {run['n_params']:,} float32 params in "
            f"{run['n_leaves']} leaves" + (" (per-call overhead)" if per_call else ""),
        ]
        if floor and not per_call:
            what = (
                "a device-to-device copy of the same size"
                if run["device"] == "cuda"
                else "best of np.copyto and a parallel copy"
            )
            lines.append(f"copy floor ({what}, R+W): {floor:.1f} GB/s")
        lines += [
            "",
            f"| operation | implementation | median {unit} | min-max {unit} | GB/s | of copy floor "
            "| vs numpy | numbaccum speed-up |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        by = {(r["op"], r["impl"]): r["median_s"] for r in run["rows"]}
        order = list(dict.fromkeys(r["op"] for r in run["rows"]))
        for r in sorted(run["rows"], key=lambda r: order.index(r["op"])):
            t = r["median_s"]
            cells = [
                r["op"],
                r["impl"],
                _num(t * scale),
                f"{_num(r['min_s'] * scale)}-{_num(r['max_s'] * scale)}",
                "-" if r["gbs"] is None else f"{r['gbs']:.1f}",
                "-" if r["floor_fraction"] is None else f"{r['floor_fraction']:.2f}",
                "-" if r["impl"] == "numpy" else _ratio(by.get((r["op"], "numpy")), t),
                "-" if r["impl"] == "numbaccum" else _ratio(t, by.get((r["op"], "numbaccum"))),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", _LEGEND_PER_CALL if per_call else _LEGEND]
        if run.get("skipped"):
            lines.append("")
            lines += [f"- {x['impl']} on {x['op']}: skipped: {x['why']}" for x in run["skipped"]]
    return "\n".join(lines)


_RATIOS = (
    "vs numpy: the NumPy per-leaf version's median over this row's (above 1.00x: faster than "
    "NumPy); numbaccum speed-up: this row's median over numbaccum's on a FlatTree (above 1.00x: "
    "numbaccum is that much faster)."
)
_LEGEND = (
    "GB/s: the operation's minimal bytes (see --help) per second of the median; of copy floor: "
    "those GB/s over the copy floor above (above 1.00: faster than a copy through memory, as a "
    "workload that fits in the CPU's caches can be). " + _RATIOS
)
_LEGEND_PER_CALL = "The tree is tiny: the times are per-call overheads (no GB/s). " + _RATIOS


def _default_devices() -> tuple[str, ...]:
    """The CPU, and CUDA when a real GPU works here (not the simulator: too slow for the default)."""
    from . import gpu

    works, simulated, why = gpu.status()
    if not works and why != gpu.NO_DEVICE:  # a GPU is there but cannot run kernels: say why
        print(f"numbaccum bench: CUDA skipped: {why}", file=sys.stderr)
    return ("cpu", "cuda") if works and not simulated else ("cpu",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="numbaccum bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload", action="append", choices=sorted(workloads.WORKLOADS), help="(repeatable) default: all"
    )
    parser.add_argument(
        "--op",
        action="append",
        choices=OPS,
        help="(repeatable) default: all; multisteps times the mini-step and the full step",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda", "all"), help="default: the CPU, and CUDA when a GPU works"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per operation")
    parser.add_argument("--quick", action="store_true", help="the two small workloads, few repeats (< 1 min)")
    parser.add_argument("--json", metavar="FILE", help="also write the raw numbers here")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the comparison (needs matplotlib)")
    parser.add_argument("--no-peers", action="store_true", help="skip PyTorch and optax even if installed")
    parser.add_argument(
        "--peer",
        action="append",
        choices=sorted(PEERS),
        help="time only this peer (repeatable; default: every installed one)",
    )
    parser.add_argument(
        "--peer-budget",
        type=float,
        metavar="SECONDS",
        help=f"the most CPU seconds (and {WALL_FACTOR:g} times as many seconds) a peer's build and first "
        "call of a row (its compile included) may take before the row is skipped with a note "
        f"(default {PEER_BUDGET_S:g})",
    )
    parser.add_argument(
        "--max-memory",
        type=float,
        metavar="GB",
        default=MAX_MEMORY_GB,
        help="abandon a peer's row when the run's processes would hold more than this together "
        f"(default {MAX_MEMORY_GB:g}; GPT-2 small with every peer needs about 10)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--from-json", metavar="FILE", help="time nothing: the table (and --plot) of an earlier --json run"
    )
    args = parser.parse_args(argv)
    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()  # before minutes of timing, not after
    if args.from_json:
        try:
            saved = load_result(args.from_json)
        except ValueError as e:
            print(f"numbaccum bench --from-json: {e}", file=sys.stderr)
            return 2
        return _report(saved, None, args.plot)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.peer_budget is not None and not args.peer_budget > 0:
        parser.error("--peer-budget must be > 0")
    if not args.max_memory > 0:
        parser.error("--max-memory must be > 0")
    budget = args.peer_budget or PEER_BUDGET_S
    names = tuple(args.workload or (QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS))
    base = QUICK_REPEATS if args.quick else REPEATS
    repeats = {w: args.repeats or base[w] for w in names}
    if args.device == "all":
        devices: tuple[str, ...] = DEVICES
    elif args.device:
        devices = (args.device,)
    else:
        devices = _default_devices()
    ops = tuple(dict.fromkeys(args.op or OPS))
    peers: bool | Sequence[str] = False if args.no_peers else (args.peer or True)
    result = run(names, devices, ops, peers, repeats, not args.no_progress, budget, args.max_memory)
    return _report(result, args.json, args.plot)


# What a --json run holds and `format_table` reads: key -> the types its value may have.
_RESULT_KEYS: dict[str, tuple[type, ...]] = {
    "date": (str,),
    "machine": (str,),
    "python": (str,),
    "numpy": (str,),
    "numba": (str,),
    "numba_threads": (int,),
    "threading_layer": (str,),
    "runs": (list,),
}
_RUN_KEYS: dict[str, tuple[type, ...]] = {
    "device": (str,),
    "workload": (str,),
    "n_params": (int,),
    "n_leaves": (int,),
    "per_call": (bool,),
    "copy_floor_gbs": (int, float, type(None)),
    "rows": (list,),
}
_SKIP_KEYS: dict[str, tuple[type, ...]] = {"op": (str,), "impl": (str,), "why": (str,)}
_ROW_KEYS: dict[str, tuple[type, ...]] = {
    "op": (str,),
    "impl": (str,),
    "median_s": (int, float),
    "min_s": (int, float),
    "max_s": (int, float),
    "gbs": (int, float, type(None)),
    "floor_fraction": (int, float, type(None)),
}


def load_result(path: str) -> dict[str, Any]:
    """A result that ``--json`` wrote, checked and with control characters removed from its strings
    (a file's text must not drive the terminal); ValueError with the reason for anything else."""
    shown = _printable(repr(path))
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 20)
    except OSError as e:
        raise ValueError(f"{shown}: cannot read it ({_printable(e.strerror or str(e))})") from None
    try:
        result = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = type(e).__name__ if isinstance(e, RecursionError) else _printable(str(e))[:200]
        raise ValueError(f"{shown}: not the JSON of a numbaccum bench --json run ({why})") from None
    _check_keys(result, _RESULT_KEYS, "the file", shown)
    peers, gpu = result.get("peers", {}), result.get("gpu")
    if not isinstance(peers, dict) or not all(isinstance(v, str) for v in peers.values()):
        raise ValueError(f"{shown}: 'peers' is not a dict of versions: not a numbaccum bench --json run")
    if gpu is not None and not isinstance(gpu, str):
        raise ValueError(f"{shown}: 'gpu' is a {type(gpu).__name__}: not a numbaccum bench --json run")
    for i, run in enumerate(result["runs"]):
        _check_keys(run, _RUN_KEYS, f"runs[{i}]", shown)
        for j, note in enumerate(run.get("skipped", [])):
            _check_keys(note, _SKIP_KEYS, f"runs[{i}].skipped[{j}]", shown)
        for j, row in enumerate(run["rows"]):
            _check_keys(row, _ROW_KEYS, f"runs[{i}].rows[{j}]", shown)
            if not row["median_s"] > 0 or not row["min_s"] > 0 or not row["max_s"] > 0:
                raise ValueError(f"{shown}: runs[{i}].rows[{j}]: times must be positive")
    return _clean(result)


def _check_keys(obj: Any, keys: dict[str, tuple[type, ...]], where: str, shown: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{shown}: {where} is not a JSON object: not a numbaccum bench --json run")
    for key, types in keys.items():
        if key not in obj:
            raise ValueError(f"{shown}: {where} has no {key!r}: not a numbaccum bench --json run")
        value = obj[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"{shown}: {where}: {key!r} is a {type(value).__name__}, not a bench result's")


def _printable(text: str) -> str:
    """``text`` without control characters (ANSI escapes among them), each shown as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _clean(x: Any) -> Any:
    if isinstance(x, str):
        return _printable(x)
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, dict):
        return {_clean(k): _clean(v) for k, v in x.items()}
    return x


def _report(result: dict[str, Any], json_path: str | None, plot_path: str | None) -> int:
    print(format_table(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"raw numbers: {os.path.abspath(json_path)}", file=sys.stderr)
    if plot_path:
        from .plot import plot

        plot(result, plot_path, LABELS)
        print(f"plot: {plot_path}", file=sys.stderr)
    return 0
