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

Cost: installing a handler and giving the old one back are two system calls (``signal.signal``:
1.2 us, a tenth of a small tree's update). Over Python's default handler, the one almost every
program has, the first update installs `_PROXY` instead and leaves it there: a C callable that calls
that default handler (a ``KeyboardInterrupt``, with the same traceback), which each update points
at `_record` and back (0.1 us each, no system call; the hold, all told, adds about 0.6 us to a
small tree's update of 10 us). So after the first update in the main thread,
``signal.getsignal(signal.SIGINT)`` is `_PROXY`, not ``signal.default_int_handler`` (``asyncio.run``
then keeps Python's handling of Ctrl-C rather than installing its own); any other handler is
replaced for the update and given back after it. Nothing per kernel or per buffer.

`release` is the last thing `guarded` runs, and nothing after it up to the caller calls a function
or jumps back: no point where Python handles a signal (from Python 3.11, a function's return is
not one).
"""

from __future__ import annotations

import _signal
import functools
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
_DEFAULT = _signal.default_int_handler

# SIGINT's handler in place of Python's default one from the first update on (see above).
_PROXY = functools.partial(_DEFAULT)
# (func, args, keywords, dict); an exact dict is kept, not copied (typeshed's partial omits it)
_retarget = _PROXY.__setstate__  # type: ignore[attr-defined]
_NO_KEYWORDS: dict = {}
_IDLE = (_DEFAULT, (), _NO_KEYWORDS, None)  # its state between updates


class _Held:
    """The one hold of the process (the main thread's outermost update).

    Attributes:
        handler: the SIGINT handler `hold` replaced (None: nothing held); Python's default one
            when `_PROXY` stands in for it (then the hold points `_PROXY` at `_record`, else
            `_record` is SIGINT's handler).
        pending: a SIGINT was recorded and waits.
        forced: a second SIGINT was handled at once, mid-update.
        delivery: the `_Delivery` on its way to the last update's caller, or None.
    """

    __slots__ = ("handler", "pending", "forced", "delivery")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Nothing held (as made, and in a forked child, which holds nothing)."""
        self.handler: Any = None
        self.pending = self.forced = False
        self.delivery: _Delivery | None = None


_HELD = _Held()
_MAIN = threading.main_thread().ident


def _after_fork() -> None:
    global _MAIN
    _MAIN = threading.main_thread().ident
    _HELD.clear()


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
    if old is _PROXY and held.handler is None:  # the steady state: no system call
        held.handler = _DEFAULT  # (`release` left the rest as `_Held` makes it)
        _retarget(_HOLDING)
        return True
    if old is _PROXY:  # a hold cut short (only the outermost update holds): start afresh
        old = _DEFAULT
    elif old is _record:
        old = held.handler if callable(held.handler) else _DEFAULT
    elif not callable(old):  # SIG_IGN, SIG_DFL or a C handler: nothing to hold
        return False
    proxied = old is _DEFAULT
    held.handler, held.pending, held.forced = old, False, False
    try:
        if proxied:
            _retarget(_HOLDING)
        _setsignal(_SIGINT, _PROXY if proxied else _record)  # first runs a SIGINT come before
    except BaseException:
        held.handler = None
        _retarget(_IDLE)
        if isinstance(sys.exc_info()[1], ValueError):  # not the main interpreter: no signals here
            return False
        raise  # its KeyboardInterrupt: nothing is written yet
    return True


def release() -> None:
    """Ends the hold: the handler `hold` replaced is back. A SIGINT recorded meanwhile goes to
    the update's caller (`_Delivery`)."""
    held = _HELD
    handler, held.forced = held.handler, False
    if handler is None:  # given up (the user's code set SIG_IGN or SIG_DFL meanwhile)
        return
    try:
        if handler is _DEFAULT:  # (`_PROXY` stands in for it)
            _retarget(_IDLE)
        else:
            _setsignal(_SIGINT, handler)  # (the check it runs first may still record one)
    except KeyboardInterrupt:
        # One arrived as the handler came back, after the update had committed: for the caller.
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
    try:  # (`_record` tells the user's frames, above this one, from numbaccum's: `_in_user_code`)
        return fn(*args, **kwargs)
    finally:
        if _getsignal(_SIGINT) is not (_PROXY if held.handler is _DEFAULT else _record):
            _adopt()


def _adopt() -> None:
    """The user's code set a SIGINT handler of its own while an update held SIGINT: the hold
    goes on with it (it runs where the old one would have), or ends for SIG_IGN and SIG_DFL."""
    held = _HELD
    new = _getsignal(_SIGINT)
    if new is _DEFAULT or new is _PROXY:  # Python's default again: `_PROXY` stands in for it
        held.handler = _DEFAULT
        _retarget(_HOLDING)
        if new is _DEFAULT:
            _setsignal(_SIGINT, _PROXY)
        return
    _retarget(_IDLE)
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
    if _in_user_code(frame):
        return handler(signum, frame)
    if held.pending:  # a second one: at once (for both), whatever it interrupts
        held.pending, held.forced = False, True
        return handler(signum, frame)
    held.pending = True
    return None


_USER_CODE = user_code.__code__
_HOLDING = (_record, (), _NO_KEYWORDS, None)  # `_PROXY`'s state while an update holds SIGINT


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


def _in_user_code(frame: Any) -> bool:
    """Whether ``frame`` (where a SIGINT is handled) is code that `user_code` runs (the user's,
    or numbaccum's called by it), not this module's own frames around it."""
    ours = globals()
    while frame is not None and frame.f_globals is ours:  # `user_code` itself, `_adopt`
        frame = frame.f_back
    while frame is not None:
        if frame.f_code is _USER_CODE:
            return True
        frame = frame.f_back
    return False


def _in_numbaccum(frame: Any) -> bool:
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "numbaccum" or name.startswith("numbaccum."):
            return True
        frame = frame.f_back
    return False
