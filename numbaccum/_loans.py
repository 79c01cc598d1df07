"""Buffers lent to the caller: returned updates are never overwritten while anything holds them.

An ``update`` returns its updates as views of a workspace (`numbaccum.flat.FlatTree.workspace`)
that a later call writes again. optax's arrays are immutable, so code ported from it keeps
updates in a list, or runs one optimizer for two models, and expects each to keep its numbers.
Here such a call must not write into what the caller still holds.

What is handed out is made of a fresh **root** per call and buffer: a 1-D array over the whole
buffer whose base is a ``memoryview`` of it, not the buffer itself. NumPy collapses a view's base
to the first array up the chain that owns its memory, or whose base is not an array; the
memoryview stops it at the root, so every view the caller holds, or makes of one (a slice, a
reshape, a transpose), keeps the root alive, and nothing of the library's does. A weak reference
to the last root of each buffer (`lend`) then answers "does anything still hold it?"
(`on_loan`) in tens of nanoseconds, and the writer takes another buffer while it does. On a
CUDA device the root is a device array whose memory's ``owner`` is a small token: numba's views
carry their owner, so the token plays the memoryview's part (in numba's simulator, whose device
arrays wrap NumPy arrays, the NumPy root does).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from . import arrays

__all__ = ["LENT", "lend", "lent_moved", "on_loan"]

# id(buffer) -> a weak reference to what keeps the last root lent of it alive (the root, or on a
# device its owner token). An entry goes with its root; a buffer dies only after its roots (they
# hold it), so an id reused by a new buffer never finds a live entry of the old one. Emptied,
# never rebound: a hot caller tests ``if LENT`` before it calls `on_loan`.
LENT: dict[int, weakref.ref] = {}


class _Owner:
    """The owner of a device root's memory: holds the buffer, as its views hold the owner."""

    __slots__ = ("buffer", "__weakref__")

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer


def lend(buffer: Any) -> Any:
    """A fresh view of the whole 1-D ``buffer`` to make what the caller is handed out of: while
    it, or any view made of it, lives, `on_loan` of ``buffer`` is True."""
    if buffer.size == 0:  # nothing can be overwritten
        return buffer
    watched: object  # what the weak reference below watches: the NumPy root, or an `_Owner`
    if isinstance(buffer, np.ndarray):
        # (bfloat16 has no buffer format: its bytes are shared)
        raw = buffer if buffer.dtype.kind in "fc" else buffer.view(np.uint8)
        # (numpy's stubs give ndarray the buffer protocol's `__buffer__` only from Python 3.12)
        root = watched = np.frombuffer(memoryview(raw), buffer.dtype)  # type: ignore[arg-type]
    elif arrays.simulated():  # a FakeCUDAArray over a NumPy array: the NumPy root, wrapped
        watched = np.frombuffer(memoryview(buffer._ary.view(np.uint8)), buffer.dtype)
        root = type(buffer)(watched)
    else:
        watched = _Owner(buffer)
        ptr = arrays.data_pointer(buffer)
        assert ptr is not None  # a device array: only the simulator's have no address
        root = arrays.view_from_pointer(ptr, buffer.size, buffer.dtype, watched)
    key = id(buffer)

    def forget(r: weakref.ref) -> None:  # every view is gone (a newer loan's entry stays)
        if LENT.get(key) is r:
            LENT.pop(key)

    ref = weakref.ref(watched, forget)
    LENT[key] = ref
    return root


def on_loan(buffers: Iterable[Any]) -> bool:
    """Whether the caller still holds something lent of one of ``buffers`` (`lend`)."""
    if not LENT:  # nothing lent anywhere: the common case of `numbaccum.step_`
        return False
    for b in buffers:
        ref = LENT.get(id(b))
        if ref is not None and ref() is not None:
            return True
    return False


def lent_moved(old: Sequence[Any], new: Sequence[Any]) -> bool:
    """Whether the buffers ``new`` are ``old`` with only lent ones moved: every array of ``old``
    that ``new`` does not have at its place is (a view of) a buffer whose values the caller
    holds (`on_loan`). That is the loop holding its last updates while it asks for the next
    (``u, state = tx.update(g, state)``): the workspace it was handed is written again only once
    it is dropped, and the call writes its spare (`numbaccum.flat.Workspace`), by turns. Only
    the library's buffers are ever lent, so a launch kept for them as well as for the last ones
    (`numbaccum.fuse.Launches`, `numbaccum.backend.Reductions`) keeps nothing of the caller's
    alive (a new FlatTree of gradients each step is another input: not kept)."""
    if len(old) != len(new):
        return False
    moved = False
    for a, b in zip(old, new):
        if a is not b:
            base = getattr(a, "base", None)
            if not on_loan((a if base is None else base,)):
                return False
            moved = True
    return moved
