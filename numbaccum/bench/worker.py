"""A peer timed in a process of its own, so that a first call that runs over its budget can be
abandoned: optax's jit of a tree of 2000 small leaves compiles for minutes and takes gigabytes,
and a Python thread cannot be stopped, but a process can be killed.

The parent (`PeerProcess`) and the worker (`serve`) exchange pickled messages over the worker's
stdin and stdout. The worker sends whatever its libraries print to stderr, which goes to a file
the parent reads only to explain a failure. The worker never imports numbaccum's package (numba's
start-up costs 1.7 s and 165 MB): it runs `numbaccum.bench` under a stand-in parent package.
Every call is timed inside the worker, so the messages' own cost is never in a sample.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, BinaryIO

# Runs `serve` with a stand-in ``numbaccum`` package whose only path is the real one: importing
# ``numbaccum.bench.worker`` then skips ``numbaccum/__init__.py`` (and numba).
_BOOT = (
    "import sys, types; pkg = types.ModuleType('numbaccum'); pkg.__path__ = [sys.argv[1]]; "
    "sys.modules['numbaccum'] = pkg; from numbaccum.bench.worker import serve; serve()"
)
_POLL_S = 0.1  # how often a wait looks at the worker's memory, CPU time and liveness
WALL_FACTOR = 6.0  # a budget of CPU seconds allows this many times as many seconds of wall time


class PeerSkipped(Exception):
    """A peer cannot be timed (further) on this workload; the message says why, for the notes.

    Attributes:
        dead: whether its process is gone (every later row of the workload is skipped too).
    """

    def __init__(self, why: str, dead: bool) -> None:
        super().__init__(why)
        self.dead = dead


def resident_bytes(pid: int) -> int | None:
    """Resident bytes of process ``pid`` (None where /proc cannot tell: no memory bound there)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system, all threads) process ``pid`` has used; None where /proc
    cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class PeerProcess:
    """One peer on one device, in a process of its own, for as many workloads as it survives.

    Args:
        peer: its `peers.Peer` entry.
        device: ``"cpu"`` or ``"cuda"``.
        k: the MultiSteps period.
        max_norm: the standalone clip's max_norm.
        budget_s: the most CPU seconds a step's build and first calls (compile included), or any
            later request, may take before the process is killed (`_wait`).
        startup_s: the most seconds its start (imports, the library's warm-up) or a workload's
            trees may take.
    """

    def __init__(
        self, peer: Any, device: str, k: int, max_norm: float, budget_s: float, startup_s: float = 120.0
    ) -> None:
        self.peer, self.budget_s, self.startup_s = peer, budget_s, startup_s
        self.memory_bytes = 1 << 62  # set with each workload
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the process; close() frees it)
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, package],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to, self._from = self._proc.stdin, self._proc.stdout
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self._from,), daemon=True).start()
        self._dead: str | None = None
        self._setup: list[str] = []  # requests sent whose replies `ready` has yet to read
        self._request(("start", peer, device, k, max_norm), "its start")

    @property
    def alive(self) -> bool:
        return self._dead is None

    def rss(self) -> int:
        """Its resident bytes now (0 once it is gone or where /proc cannot tell)."""
        return (resident_bytes(self._proc.pid) or 0) if self.alive else 0

    def load(self, workload: str, memory_bytes: int) -> None:
        """Has the worker build ``workload``'s trees (dropping the last one's), in the background:
        the next `prepare` waits for it. ``memory_bytes``: its resident memory's bound from now."""
        self.memory_bytes = memory_bytes
        self._request(("workload", workload), f"its trees of {workload}")

    def _request(self, msg: tuple, what: str) -> None:
        self._send(msg)
        self._setup.append(what)

    def _read(self, stream: BinaryIO) -> None:
        # A reader thread turns the blocking pipe into a queue the parent can wait on with a timeout.
        while True:
            try:
                self._replies.put(pickle.load(stream))
            except Exception:  # EOF (the worker exited or was killed) or a torn message
                self._replies.put(("eof", None))
                return

    def _send(self, msg: tuple) -> None:
        try:
            pickle.dump(msg, self._to)
            self._to.flush()
        except (OSError, ValueError):
            pass  # the process is gone: the wait for its reply says so

    def _last_error_line(self) -> str:
        self._log.seek(0)
        lines = [x for x in self._log.read().decode("utf-8", "replace").splitlines() if x.strip()]
        return lines[-1].strip()[:200] if lines else "no message"

    def _abandon(self, why: str) -> PeerSkipped:
        self.kill()
        self._dead = why
        return PeerSkipped(why, dead=True)

    def _wait(self, what: str, timeout: float, cpu: bool = True) -> Any:
        """The worker's reply to ``what``; PeerSkipped (and the process killed) when it holds
        more than the memory bound, dies, reports an error, or takes longer than ``timeout``
        seconds: of its CPU time where /proc tells it (``cpu``; a busy machine then decides
        as a quiet one would), and never more than `WALL_FACTOR` times that of wall time."""
        if self._dead is not None:
            raise PeerSkipped(f"not run ({self._dead})", dead=True)
        cpu0 = _cpu_seconds(self._proc.pid) if cpu else None
        wall = timeout if cpu0 is None else WALL_FACTOR * timeout
        deadline = time.perf_counter() + wall
        while True:
            try:
                kind, value = self._replies.get(timeout=_POLL_S)
            except queue.Empty:
                rss = resident_bytes(self._proc.pid)
                if rss is not None and rss > self.memory_bytes:
                    raise self._abandon(f"{what} went over {self.memory_bytes / 2**30:.1f} GB") from None
                used = _cpu_seconds(self._proc.pid) if cpu0 is not None else None
                if used is not None and cpu0 is not None and used - cpu0 > timeout:
                    raise self._abandon(f"{what} ran over {timeout:g} s (of CPU time)") from None
                if time.perf_counter() > deadline:
                    raise self._abandon(f"{what} ran over {wall:g} s") from None
                continue
            if kind == "ok":
                return value
            if kind == "error":
                raise PeerSkipped(f"{what} failed: {value}", dead=False)
            code = self._proc.wait()
            raise self._abandon(f"{what}: its process exited ({code}): {self._last_error_line()}")

    def ready(self) -> None:
        """Waits for the worker's start (imports, warm-up) and trees (a failure there is fatal:
        the process is killed and every later row skipped)."""
        while self._setup:
            try:
                self._wait(self._setup[0], self.startup_s, cpu=False)
            except PeerSkipped as e:
                raise e if e.dead else self._abandon(str(e)) from None
            self._setup.pop(0)

    def prepare(self, op: str, calls: int, memory_bytes: int | None = None) -> float:
        """Builds ``op``'s step (dropping the previous one) and makes its first ``calls`` calls,
        within the budget; the seconds they took. ``memory_bytes``: its memory's bound from now
        (else the workload's)."""
        self.ready()
        if memory_bytes is not None:
            self.memory_bytes = memory_bytes
        self._send(("prepare", op, calls))
        return self._wait(f"its build and first call (compile included) of {op}", self.budget_s)

    def calls(self, op: str, n: int) -> list[float]:
        """Seconds of each of ``n`` timed calls of ``op``'s step."""
        self._send(("time", op, n))
        return self._wait(f"a timed call of {op}", self.budget_s)

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        """Asks the worker to exit (kills it if it does not within 5 s) and frees its log."""
        if self._proc.poll() is None:
            self._send(("quit",))
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self._to, self._from):
            with contextlib.suppress(OSError):
                stream.close()
        self._log.close()


# --- the worker's side ------------------------------------------------------------------------


def _function(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _wall(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _clock(device: str, wall: bool) -> Any:
    if device == "cpu":
        return _wall
    from .gpu import Clock

    return Clock(wall=wall)


class _Worker:
    """What a peer's process holds: its trees, the step of the current operation, its clock."""

    def __init__(self, peer: Any, device: str, k: int, max_norm: float) -> None:
        if not _function(peer.available)(device):
            raise RuntimeError(f"{', '.join(peer.modules)} cannot run on {device} here")
        if peer.warm is not None:
            _function(peer.warm)(device)
        self.build = _function(peer.steps)
        self.args = (k, max_norm, device)
        self.clock = _clock(device, peer.cuda_wall)
        self.op: str | None = None
        self.step: Any = None
        self.p: list[Any] = []
        self.g: list[Any] = []

    def workload(self, name: str) -> None:
        from . import workloads

        # The last workload's trees and state go before the next ones are made.
        self.op, self.step, self.p, self.g = None, None, [], []
        gc.collect()
        params, grads = workloads.bench_trees(name)
        self.p, self.g = workloads.leaves(params), workloads.leaves(grads)

    def prepare(self, op: str, calls: int) -> float:
        self.op, self.step = None, None  # the last operation's state goes before the next one's
        gc.collect()
        t = time.perf_counter()
        self.step = self.build(self.p, self.g, *self.args, (op,))[op]
        self.op = op
        for _ in range(calls):
            self.step()
        return time.perf_counter() - t

    def time(self, op: str, n: int) -> list[float]:
        if op != self.op:
            raise RuntimeError(f"{op} was not prepared")
        return [self.clock(self.step) for _ in range(n)]


def serve(inp: BinaryIO | None = None, out: BinaryIO | None = None) -> None:
    """The worker's loop: answers the parent's messages until ``quit`` or the end of its input."""
    if out is None:  # the protocol keeps the real stdout; anything a library prints goes to stderr
        out = os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
    inp = inp if inp is not None else sys.stdin.buffer
    worker: _Worker | None = None
    while True:
        try:
            msg = pickle.load(inp)
        except EOFError:
            return
        if msg[0] == "quit":
            return
        try:
            if msg[0] == "start":
                worker = _Worker(*msg[1:])
                reply: tuple = ("ok", None)
            elif worker is None:
                reply = ("error", "not started")
            elif msg[0] == "workload":
                worker.workload(*msg[1:])
                reply = ("ok", None)
            elif msg[0] == "prepare":
                reply = ("ok", worker.prepare(*msg[1:]))
            else:
                reply = ("ok", worker.time(*msg[1:]))
        except Exception as e:  # reported to the parent, which skips the row with the reason
            reply = ("error", f"{type(e).__name__}: {str(e)[:300]}")
        pickle.dump(reply, out)
        out.flush()
