"""Ctrl-C during an update: it waits for numbaccum's own code, never for yours.

An update writes its state's buffers in place, pass after pass, and makes the new state current
when it has succeeded (`numbaccum.transaction.guarded`). A ``KeyboardInterrupt`` raised between
two of those writes would leave the state it was given current with some buffers advanced: a torn
state that the next update accepts. Python runs signal handlers in the main thread only, between
two bytecodes; so there the outermost update *holds* SIGINT (`hold`): from its start to its
commit, SIGINT's handler is `_record`, and

* while numbaccum's own code runs, a SIGINT is recorded, not handled;
* the user code an update runs (`user_code`: a user transformation, a line search's objective,
  `snapshot`'s measure, MultiSteps' skip function, Sophia's Hessian callbacks) stays
  interruptible: a SIGINT there is handled at once, as without numbaccum, and the update restores
  what it wrote before that code ran (`numbaccum.base.undoable`) and commits nothing. One
  recorded before such code starts is handled as it starts, with the same effect;
* one recorded and not handled by the end goes to the update's caller (`release`, `_Delivery`):
  the update completes and commits, and the handler runs once the caller holds the result.

So a ``KeyboardInterrupt`` never comes out of an update that has written what it cannot restore.
A second SIGINT while one waits is handled at once (the way out of a long first compile); the
update it cuts short may be torn, and its state is refused from then on (`forced`).

Threads other than the main one never see a SIGINT, and hold nothing. A handler that is not a
Python callable (SIG_IGN, SIG_DFL: no ``KeyboardInterrupt`` to hold) is left alone.

Cost: two ``signal.signal`` calls an update in the main thread (two system calls; 0.8 us on the
machine of benchmarks/results), nothing per kernel or per buffer. `release` is the last thing
`guarded` runs, and nothing after it up to the caller calls a function or jumps back: no point
where Python handles a signal (from Python 3.11: a Python function's return is not one).
"""

from __future__ import annotations

import _signal
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from _thread import get_ident

__all__ = ["forced", "hold", "release", "user_code"]

_SIGINT = _signal.SIGINT
_setsignal = _signal.signal  # the C functions: `signal.signal` converts to enums (2 us a call)
_getsignal = _signal.getsignal


class _Held:
    """The one hold of the process (the main thread's outermost update).

    Attributes:
        handler: the SIGINT handler `hold` replaced (None: nothing held).
        pending: a SIGINT was recorded and waits.
        user: how deep in user code the main thread is (`user_code`): a SIGINT is handled there.
        forced: a second SIGINT was handled at once, mid-update.
        delivery: the `_Delivery` on its way to the last update's caller, or None.
    """

    __slots__ = ("handler", "pending", "user", "forced", "delivery")

    def __init__(self) -> None:
        self.handler: Any = None
        self.pending = self.forced = False
        self.user = 0
        self.delivery: _Delivery | None = None


_HELD = _Held()
_MAIN = threading.main_thread().ident


def _after_fork() -> None:
    global _MAIN
    _MAIN = threading.main_thread().ident
    _HELD.__init__()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def hold() -> bool:
    """Holds SIGINT for the update starting now, in the main thread: True if held (then
    `release` must follow). A SIGINT the last update recorded, still on its way to that update's
    caller, is handled now, before this update writes anything."""
    if get_ident() != _MAIN:
        return False
    held = _HELD
    if held.delivery is not None:
        held.delivery.arrive(sys._getframe())
    old = _getsignal(_SIGINT)
    if old is _record:  # left by a hold cut short (only the outermost update holds)
        old = held.handler if callable(held.handler) else _signal.default_int_handler
    elif not callable(old):  # SIG_IGN, SIG_DFL or a C handler: nothing to hold
        return False
    held.handler, held.pending, held.user, held.forced = old, False, 0, False
    try:
        _setsignal(_SIGINT, _record)  # first runs a SIGINT that arrived before, with ``old``
    except BaseException:
        held.handler = None  # (its KeyboardInterrupt: nothing is written yet)
        raise
    return True


def release() -> None:
    """Ends the hold: the handler `hold` replaced is back. A SIGINT recorded meanwhile goes to
    the update's caller (`_Delivery`)."""
    held = _HELD
    handler, held.forced = held.handler, False
    if handler is None:  # given up (the user's code set SIG_IGN or SIG_DFL meanwhile)
        return
    try:
        _setsignal(_SIGINT, handler)  # (the check it runs first may still record one)
    except KeyboardInterrupt:
        # One arrived during the system call, after the update had committed: for the caller.
        held.pending = True
    held.handler = None
    if held.pending:
        held.pending = False
        _Delivery(handler).start()


def forced() -> bool:
    """Whether a second SIGINT cut short the update this thread holds SIGINT for (it may be
    torn)."""
    return _HELD.forced and get_ident() == _MAIN


def user_code(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, user code an update runs, interruptible while the update holds
    SIGINT: a SIGINT recorded before it is handled now, one that arrives while it runs is handled
    there. The caller restores what the update wrote before (`numbaccum.base.undoable`)."""
    held = _HELD
    if held.handler is None or get_ident() != _MAIN:
        return fn(*args, **kwargs)
    if held.pending:
        held.pending = False
        held.handler(_SIGINT, sys._getframe())  # raises, unless the handler is one of yours
    held.user += 1
    try:
        return fn(*args, **kwargs)
    finally:
        held.user -= 1
        if _getsignal(_SIGINT) is not _record:
            _adopt()


def _adopt() -> None:
    """The user's code set a SIGINT handler of its own while an update held SIGINT: the hold
    goes on with it (it runs where the old one would have), or ends for SIG_IGN and SIG_DFL."""
    held = _HELD
    new = _getsignal(_SIGINT)
    if callable(new):
        held.handler = new
        _setsignal(_SIGINT, _record)
    else:
        held.handler = None


def _record(signum: int, frame: Any) -> Any:
    """SIGINT's handler while held (see the module's docstring)."""
    held = _HELD
    handler = held.handler
    if handler is None:  # not held (a hold cut short): as Python would
        return _signal.default_int_handler(signum, frame)
    if held.user:
        return handler(signum, frame)
    if held.pending:  # a second one: at once (for both), whatever it interrupts
        held.pending, held.forced = False, True
        return handler(signum, frame)
    held.pending = True
    return None


class _Delivery:
    """A recorded SIGINT on its way to the caller of the update that recorded it: a profile
    function (`sys.setprofile`, the main thread's) that runs ``handler`` once a call into C made
    with no numbaccum frame on the stack has returned (the caller's code, which by then holds the
    update's result, also when it passed it straight to that call), or when the next update
    starts (`hold`). Under a profiler of the user's, it runs at once: the update has committed,
    and its result is lost to the caller."""

    def __init__(self, handler: Callable[..., Any]) -> None:
        self.handler = handler

    def start(self) -> None:
        if sys.getprofile() is not None:
            self.handler(_SIGINT, sys._getframe())
            return
        _HELD.delivery = self
        sys.setprofile(self)

    def arrive(self, frame: Any) -> Any:
        _HELD.delivery = None
        sys.setprofile(None)
        return self.handler(_SIGINT, frame)

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if (event == "c_return" or event == "c_exception") and not _in_numbaccum(frame):
            self.arrive(frame)  # raises there, once that call has returned
        return None


def _in_numbaccum(frame: Any) -> bool:
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "numbaccum" or name.startswith("numbaccum."):
            return True
        frame = frame.f_back
    return False
