"""One update at a time, and only of the current state: the update transaction.

A state's buffers are updated in place: the state an update was given and the one it returns
share them. Each planned state buffer is therefore renewed (`current`): the new state holds a new
wrapper of the same storage, one generation on, and the storage's live generation moves to it
when the whole update has succeeded (`guarded`). A state kept from before (``best = state``,
yesterday's state to retry a step) then holds an older generation and is refused, where it would
otherwise compute with advanced buffers and old counters. A failed update commits nothing: the
state it was given stays current.

Whatever else reads a state's buffers to make another state of them (`numbaccum.save_state`,
`numbaccum.copy_state`, pickling and ``copy.deepcopy`` of a FlatTree) holds them while it reads
(`reading`): it refuses a stale state as an update does, and a busy one (an update of it is
running) with the update's own error; an update that starts meanwhile waits until the reader is
done. `save_state` and `copy_state` hold the whole state, whose update's owner is one of its
buffers: what they read is one state, never half of two. Pickling and deepcopy are given one
FlatTree at a time, and hold that one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ._interrupts import forced, hold, release
from ._marks import STALE, held, wait_for_reader
from .flat import FlatTree
from .tree import short_repr

__all__ = ["current", "guarded", "keep_states", "reading"]


class _Renewals(list):
    """The buffers renewed (`current`) by the update running on one thread, and ``depth``: how
    many updates run there (an update inside another one's user transformation joins it)."""

    __slots__ = ("depth",)
    depth: int


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.renewals = _Renewals()
        self.renewals.depth = 0


# One thread-local read per update and per renewed buffer; the rest are plain attributes.
_THREAD = _PerThread()
_NEW = object.__new__

def current(flat: FlatTree, field: str) -> FlatTree:
    """``flat``, the buffer ``state.<field>`` of the state being planned, renewed for the
    state the update returns, after checking that it is current: a new FlatTree over the same
    storage (it shares ``flat``'s ``__dict__``) one generation on, which becomes the current
    one when the update returns (`guarded`).

    Raises:
        ValueError: ``flat`` belongs to a stale state (an update has advanced it since).
    """
    g = flat._gen
    if g != flat._live:
        if g != flat._live + 1:
            raise ValueError(STALE.format(f"state.{field}"))
        # One generation ahead: returned by an update whose commit was not made (planned
        # outside `guarded`): nothing newer exists, so it is the current one.
        flat._live = g
    new = _NEW(FlatTree)  # inline, not a method: this runs for each state buffer of each update
    new.__dict__ = flat.__dict__
    new._gen = g + 1
    renewals = _THREAD.renewals
    if renewals.depth:  # planned by an update (not by `explain`): committed when it returns
        renewals.append(new)
    return new


def keep_states(old: Any) -> None:
    """Says that the running update returns ``old`` (a state it was given, or part of one)
    unchanged although it was planned (a skipped step): its buffers' renewals are not
    committed, so that ``old`` stays current."""
    renewals = _THREAD.renewals
    if renewals:
        kept = {id(f.__dict__) for f in state_flats(old, writable_only=False)}
        renewals[:] = [r for r in renewals if id(r.__dict__) not in kept]


def guarded(owner: FlatTree | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: an update (`Stage.update`, `numbaccum.step_`) of the state whose buffers
    ``owner`` owns (None: a stateless stage), run as one transaction.

    A state is not thread-safe: its update writes its buffers in place. Two updates of one state
    at once are caught here: the owner's storage is marked busy for the update (one atomic
    ``dict.setdefault`` of a fresh token, tens of nanoseconds) and a second update finding the
    mark raises RuntimeError; one finding a reader's mark (`reading`: a save or a copy of the
    state) waits for it. The buffers the update renewed (`current`) become the current ones only
    if it returns; an update inside another one (a transformation that calls ``update`` itself)
    joins the outer one's transaction.

    The outermost update of the main thread holds Ctrl-C from here to its commit
    (`numbaccum._interrupts`): a SIGINT while numbaccum's code runs reaches the caller after the
    update has returned, so that no ``KeyboardInterrupt`` leaves a state half written.
    """
    renewals = _THREAD.renewals
    holding = not renewals.depth and hold()
    try:
        if owner is not None:
            marks = owner.__dict__
            me = object()
            holder = marks.setdefault("_busy", me)
            if holder is not me:
                wait_for_reader(marks, me, holder)
        start = len(renewals)
        renewals.depth += 1
        try:
            out = fn(*args)
            if renewals.depth == 1 and renewals:  # the outermost update returns: commit
                for r in renewals:
                    r._live = r._gen
                renewals.clear()
            return out
        except BaseException:
            if forced():  # a second Ctrl-C interrupted it at once: what it wrote may be torn
                _refuse(renewals[start:])
            del renewals[start:]
            raise
        finally:
            renewals.depth -= 1
            if owner is not None:
                marks.pop("_busy", None)
    finally:
        if holding:
            release()  # the last thing: nothing after it, up to the caller, handles a signal


def _refuse(renewed: list) -> None:
    """Makes the states of an update a second Ctrl-C cut short stale (their buffers may be half
    written): every generation of the buffers it renewed, the one the caller holds included, is
    then behind the storage's live one (`current` refuses them)."""
    for r in renewed:
        r._live = r._gen + 1


@contextlib.contextmanager
def reading(state: Any, name: str = "state") -> Iterator[None]:
    """Holds the buffers of ``state`` (a FlatTree, or a nest of tuples, NamedTuples, lists and
    dicts holding them) while the caller reads them, after checking that each is current.

    Each storage is marked busy with one mark, all or none: an update of the state (whose
    owner is one of them) waits until the reader is done; a reader finding another reader's mark
    waits for it before trying again (it holds nothing meanwhile: two readers never wait on each
    other in a circle).

    Raises:
        ValueError: a FlatTree of a stale state (the update's message, naming its path from
            ``name``).
        RuntimeError: an update of the state is running (the update's own message).
    """
    with held(_flats_with_paths(state, name)):
        yield


def _flats_with_paths(state: Any, name: str) -> list[tuple[str, FlatTree]]:
    """``(path, flat)`` for each FlatTree of ``state`` (each object once, by its first path)."""
    found: dict[int, tuple[str, FlatTree]] = {}

    def walk(x: Any, path: str) -> None:
        if isinstance(x, FlatTree):
            found.setdefault(id(x), (path, x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}[{short_repr(k)}]")
        elif isinstance(x, tuple) and hasattr(cls := type(x), "_fields"):
            for f, v in zip(cls._fields, x):
                walk(v, f"{path}.{f}")
        elif isinstance(x, (tuple, list)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk(state, name)
    return list(found.values())


def state_flats(state: Any, writable_only: bool = True) -> list[FlatTree]:
    """The FlatTrees in a state (a nest of tuples, NamedTuples, lists and dicts), each once: the
    writable ones only unless ``writable_only`` is False."""
    found: dict[int, FlatTree] = {}

    def walk(x: Any) -> None:
        if isinstance(x, FlatTree):
            if not (writable_only and x._readonly):
                found.setdefault(id(x), x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)

    walk(state)
    return list(found.values())
