"""Progress on stderr while numba compiles numbaccum's kernels.

A process with an empty kernel cache compiles every kernel it runs, a second or more each on a
small machine: the README's first loop spends 8-18 s in `warmup` before its first step, which
looks like a hang when nothing is said. So once the compiles of numbaccum's kernels in this
process have taken `THRESHOLD` seconds together, every compile that ends says on stderr what it
compiled (the kernel's name and dtypes), in how long, and how far along the process is (kernels
compiled and seconds spent so far; inside `warmup`, its step out of the steps it runs). Nothing is
said when the kernels load from the kernel cache (numba then compiles nothing) or when they
compile in under `THRESHOLD` seconds together.

``NUMBACCUM_PROGRESS=0`` (or ``off``, ``false``, ``no``) silences it for the process, read at
each compile; ``warmup(..., progress=False)`` for one call (``True``: said even so).

numba announces each compile as a ``numba:compile`` event (its event API) carrying the dispatcher
and the argument types; a kernel's callees compile inside it, as nested events. Only the outermost
compile of a function of numbaccum's (its sources, the modules it generates) counts: the callees'
time is the kernel's, and a user's own numba functions are none of numbaccum's business. The
listener is installed when this module is imported (`numbaccum.warmup` imports it, so ``import
numbaccum`` does).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from numba.core import event

from . import _cache, _locks

__all__ = ["ENV", "THRESHOLD", "quiet", "task"]

ENV = "NUMBACCUM_PROGRESS"
_OFF = frozenset({"0", "off", "false", "no", "none"})
THRESHOLD = 1.0  # seconds of compiling in this process before anything is said
clock: Callable[[], float] = time.perf_counter  # how compiles are timed (tests give their own)

_lock = _locks.lock()
_tally = {"kernels": 0, "seconds": 0.0, "said": False}  # this process's compiles of numbaccum's
_local = threading.local()  # .starts: the open compiles' start times; .task: the running `task`


class _Task:
    """A `task`'s progress: what it is, its steps done out of ``total``, and what it compiled."""

    def __init__(self, name: str, what: str, total: int, enabled: bool | None) -> None:
        self.name, self.what, self.total, self.enabled = name, what, total, enabled
        self.done = 0
        self.kernels, self.seconds, self.said = 0, 0.0, False


@contextlib.contextmanager
def task(name: str, what: str, total: int, enabled: bool | None = None) -> Iterator[Callable[[], None]]:
    """A long job ``name`` (``"warmup"``) of ``total`` steps, doing ``what``: the first line said
    inside it names the job and ``what``, the compiles inside it the step they are in (``[warmup
    3/8]``), and its end how many kernels it compiled in how long, if anything was said. Yields
    ``advance()``, called as each step ends. ``enabled``: None, as the environment says (`ENV`);
    False, silent; True, said even where the environment silences it. Per thread."""
    job = _Task(name, what, total, enabled)
    outer = getattr(_local, "task", None)
    _local.task = job

    def advance() -> None:
        job.done += 1

    try:
        yield advance
    finally:
        _local.task = outer
        if job.said:
            _say(f"{name} done: {job.kernels} kernels compiled in {job.seconds:.1f} s")


def quiet() -> contextlib.AbstractContextManager[Any]:
    """Nothing said of the compiles inside (this thread's): where the caller shows progress of
    its own that a line would break (`numbaccum bench`'s bar on a terminal)."""
    return task("", "", 0, enabled=False)


def _enabled(job: _Task | None) -> bool:
    if job is not None and job.enabled is not None:
        return job.enabled
    return os.environ.get(ENV, "").strip().lower() not in _OFF


def _ours(dispatcher: Any) -> bool:
    """Whether ``dispatcher`` compiles a function of numbaccum's: its sources, or a module it
    generated (named ``_numbaccum_...`` in the cache, ``<numbaccum ...>`` without one)."""
    fn = getattr(dispatcher, "py_func", None)
    module = getattr(fn, "__module__", None) or ""
    if module == "numbaccum" or module.startswith(("numbaccum.", "_numbaccum_")):
        return True
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith("<numbaccum")


# `_cache.identify`'s suffix of a name: the tags, then 16 hex digits (or "u" and 16, random)
_IDENTITY = re.compile(r"__(?:(\w*?)_)?u?[0-9a-f]{16}$")
_GENERATED = re.compile(r"^_numbaccum_(\w+?)_[0-9a-f]{24}$")  # `_cache.source_file`'s module names


def describe(dispatcher: Any, args: Any) -> str:
    """What a compile compiles, for a person: the function's module and name without the
    digest numbaccum names kernels by (its tags kept), and the dtypes of its array arguments."""
    fn = dispatcher.py_func
    name = fn.__qualname__.replace(".<locals>", "")
    m = _IDENTITY.search(name)
    if m:
        name = name[: m.start()] + (f" ({m[1].replace('_', ' ')})" if m[1] else "")
    module = fn.__module__ or ""
    generated = _GENERATED.match(module)
    if generated:
        module = generated[1]
    elif not module:  # a generated module without a cache file: its placeholder names it
        module = fn.__code__.co_filename.strip("<>").replace(" ", ":")
    dtypes = list(dict.fromkeys(str(a.dtype) for a in args or () if hasattr(a, "dtype")))
    return f"{module}.{name}" + (f" [{', '.join(dtypes)}]" if dtypes else "")


def _say(line: str) -> None:
    stream = sys.stderr
    if stream is not None:  # pythonw has none
        print(f"numbaccum: {line}", file=stream, flush=True)


def _header() -> str:
    where = _cache.root()
    later = (
        f"later processes load them from the kernel cache in {where.parent}"
        if where is not None
        else "the kernel cache is off: every process compiles them again"
    )
    return f"compiling kernels with numba (once: {later}; {ENV}=0 silences this)"


def _ended(dispatcher: Any, args: Any, seconds: float) -> None:
    """A compile of numbaccum's ended after ``seconds``: counted, and said once the process has
    spent `THRESHOLD` seconds compiling (unless silenced)."""
    job = getattr(_local, "task", None)
    with _lock:
        _tally["kernels"] += 1
        _tally["seconds"] += seconds
        kernels, spent = _tally["kernels"], _tally["seconds"]
        if job is not None:
            job.kernels += 1
            job.seconds += seconds
        if spent < THRESHOLD or not _enabled(job):
            return
        lines = [] if _tally["said"] else [_header()]
        _tally["said"] = True
    where = f"[{job.name} {min(job.done + 1, job.total)}/{job.total}] " if job is not None else ""
    if job is not None and not job.said:
        lines.append(f"{job.name} of {job.what}: {job.total} steps")
        job.said = True
    lines.append(
        f"{where}compiled {describe(dispatcher, args)} in {seconds:.1f} s; "
        f"{kernels} kernels, {spent:.1f} s so far"
    )
    for line in lines:
        _say(line)


class _Listener(event.Listener):
    """Times the outermost compile of each of numbaccum's functions (a thread's nested compiles
    are its callees)."""

    def on_start(self, ev: Any) -> None:
        starts = _local.__dict__.setdefault("starts", [])
        # timed: a compile of numbaccum's that is not inside another (a callee's is the kernel's)
        timed = _ours(ev.data["dispatcher"]) and all(s is None for s in starts)
        starts.append(clock() if timed else None)

    def on_end(self, ev: Any) -> None:
        starts = _local.__dict__.get("starts")
        if not starts:  # started before the listener was installed
            return
        began = starts.pop()
        if began is not None:
            _ended(ev.data["dispatcher"], ev.data.get("args"), clock() - began)


event.register("numba:compile", _Listener())
