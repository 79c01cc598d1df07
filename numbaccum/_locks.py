"""`lock`: the module-level locks of numbaccum, made free again in a forked child.

A child of ``os.fork`` (``multiprocessing``'s default start method on Linux up to Python 3.13)
inherits each lock in the state it had at the fork: one that another thread of the parent held
then (compiling a kernel, interning a layout, filling a cache) stays held forever in the child,
whose next use of it deadlocks. Every lock made here is re-initialised, unheld, in the child, as
CPython's own ``threading`` and ``logging`` do with theirs (``_at_fork_reinit``): in place, so
that every name and attribute bound to it sees the fresh one.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["lock"]

_MADE: list[Any] = []  # held for the life of the process: module-level and per-cache locks only


def lock() -> Any:
    """A new ``threading.Lock`` that is free in a forked child. For locks that live as long as
    the process (a module's, a module-level cache's): each is kept for the at-fork hook."""
    made = threading.Lock()
    _MADE.append(made)
    return made


def _after_fork_in_child() -> None:
    for made in _MADE:
        reinit = getattr(made, "_at_fork_reinit", None)  # CPython 3.9+
        if reinit is not None:
            reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
