"""One update at a time, and only of the current state: the update transaction.

A state's buffers are updated in place: the state an update was given and the one it returns
share them. Each planned state buffer is therefore renewed (`current`): the new state holds a new
wrapper of the same storage, one generation on, and the storage's live generation moves to it
when the whole update has succeeded (`guarded`). A state kept from before (``best = state``,
yesterday's state to retry a step) then holds an older generation and is refused, where it would
otherwise compute with advanced buffers and old counters. A failed update commits nothing: the
state it was given stays current.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ._interrupts import forced, hold, release
from .flat import FlatTree

__all__ = ["current", "guarded", "keep_states"]


class _Renewals(list):
    """The buffers renewed (`current`) by the update running on one thread, and ``depth``: how
    many updates run there (an update inside another one's user transformation joins it)."""

    __slots__ = ("depth",)


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.renewals = _Renewals()
        self.renewals.depth = 0


# One thread-local read per update and per renewed buffer; the rest are plain attributes.
_THREAD = _PerThread()
_NEW = object.__new__

_STALE = (
    "{}: this state is stale: an update has already advanced its buffers in place (a state "
    "is consumed by update). Use the state the last update returned; to keep one (best = state, "
    "a step to retry), keep a snapshot: numbaccum.copy_state(state)"
)

_BUSY = (
    "state: another update of this state is running (on another thread?); a state is not "
    "thread-safe: give each thread its own state (transformations may be shared)"
)


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
            raise ValueError(_STALE.format(f"state.{field}"))
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
    at once are caught here (a flag on the owner's storage, tens of nanoseconds; best effort,
    not a lock): RuntimeError. The buffers the update renewed (`current`) become the current
    ones only if it returns; an update inside another one (a transformation that calls
    ``update`` itself) joins the outer one's transaction.

    The outermost update of the main thread holds Ctrl-C from here to its commit
    (`numbaccum._interrupts`): a SIGINT while numbaccum's code runs reaches the caller after the
    update has returned, so that no ``KeyboardInterrupt`` leaves a state half written.
    """
    renewals = _THREAD.renewals
    held = not renewals.depth and hold()
    try:
        if owner is not None:
            if owner._busy:
                raise RuntimeError(_BUSY)
            owner._busy = True
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
                owner._busy = False
    finally:
        if held:
            release()  # the last thing: nothing after it, up to the caller, handles a signal


def _refuse(renewed: list) -> None:
    """Makes the states of an update a second Ctrl-C cut short stale (their buffers may be half
    written): every generation of the buffers it renewed, the one the caller holds included, is
    then behind the storage's live one (`current` refuses them)."""
    for r in renewed:
        r._live = r._gen + 1


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
