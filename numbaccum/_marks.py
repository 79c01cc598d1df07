"""The marks on a FlatTree's storage that make a state current or stale, idle or busy.

Below `numbaccum.flat` (which holds its own buffers with them while it is pickled or copied) and
`numbaccum.transaction` (which renews and commits them around an update): the generation test
(`check_current`), the busy mark an update or a reader puts on a storage (one atomic
``dict.setdefault`` on the storage's shared ``__dict__``), and the messages both raise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["BUSY", "STALE", "check_current", "held", "wait_for_reader"]

STALE = (
    "{}: this state is stale: an update has already advanced its buffers in place (a state "
    "is consumed by update). Use the state the last update returned; to keep one (best = state, "
    "a step to retry), keep a snapshot: numbaccum.copy_state(state)"
)

BUSY = (
    "state: another update of this state is running (on another thread?); a state is not "
    "thread-safe: give each thread its own state (transformations may be shared)"
)


class _Reading:
    """The busy mark a reader (`held`) puts on the buffers it reads; an update that finds it
    waits for ``done`` instead of raising."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


def check_current(flat: Any, where: str) -> None:
    """Raises the update's ValueError when ``flat`` (at ``where``) belongs to a stale state: its
    generation is neither the storage's live one nor the one after it
    (`numbaccum.transaction.current`)."""
    g = flat._gen
    if g != flat._live and g != flat._live + 1:
        raise ValueError(STALE.format(where))


def wait_for_reader(marks: dict, me: object, held: Any) -> None:
    """Takes the busy mark ``me`` of a storage once the reader holding it is done; RuntimeError
    when an update holds it."""
    while held is not me:
        if type(held) is not _Reading:
            raise RuntimeError(BUSY)
        held.done.wait()
        held = marks.setdefault("_busy", me)


@contextlib.contextmanager
def held(found: Sequence[tuple[str, Any]]) -> Iterator[None]:
    """Holds the storages of the FlatTrees ``found`` (``(path, flat)`` pairs) while the caller
    reads them, after checking that each is current (`numbaccum.transaction.reading`).

    Each storage is marked busy with one mark, all or none: an update of the state (whose
    owner is one of them) waits until the reader is done; a reader finding another reader's mark
    waits for it before trying again (it holds nothing meanwhile: two readers never wait on each
    other in a circle).

    Raises:
        ValueError: a FlatTree of a stale state (the update's message, naming its path).
        RuntimeError: an update of the state is running (the update's own message).
    """
    storages = list({id(f.__dict__): f.__dict__ for _, f in found}.values())
    me = _Reading()
    _hold(storages, me)
    try:
        for where, f in found:
            check_current(f, where)
        yield
    finally:
        for marks in storages:
            marks.pop("_busy", None)
        me.done.set()


def _hold(storages: list[dict], me: _Reading) -> None:
    while True:
        taken: list[dict] = []
        held: Any = me
        for marks in storages:
            held = marks.setdefault("_busy", me)
            if held is not me:
                break
            taken.append(marks)
        if held is me:
            return
        for marks in taken:  # all or none: let go of what was taken, then wait or raise
            del marks["_busy"]
        if type(held) is not _Reading:
            raise RuntimeError(BUSY)
        held.done.wait()
