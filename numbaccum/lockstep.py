"""Ranks in step: what a collective compares across the ranks of a data-parallel run.

MPI pairs the n-th collective call of every rank, whatever step each rank thinks it is at. Ranks
that resume from checkpoints of different steps, or run a `numbaccum.MultiSteps` with another
``k``, or skip a step the others take (`numbaccum.apply_if_finite` deciding on each rank's own
gradients), still pair their collectives: the sums mix gradients of different steps, the
optimizer states drift apart, and the rank with one collective more waits forever. So:

* at ``init``, a collective compares a digest of the configuration that decides when it runs
  (`check_same_schedule`, beside the layout and bucket size checks of `numbaccum.distributed`):
  the combinators' around it, which it cannot see; and
* at every step, its first collective is preceded by a tiny one that compares the counters of its
  state and of the combinators around it (`check_in_step`): one ``Allreduce`` of a few int64.

A combinator that decides whether the transformation inside it runs says what it runs under
while it runs it (`inside`): a `Note` of its configuration during ``init``, of its counters during
a step. A collective inside reads them (`notes`); `numbaccum.sharded.Sharded`, which holds its
transformation rather than being held by it, collects the notes of its ``init`` (`recording`).
Per thread: an update runs on one thread, and so do the stages inside it.

Why ``MAX`` of ``[v, -v]``: one elementwise ``MAX`` gives ``max(v)`` and ``-min(v)`` over the ranks
in one call, and every rank holds the same vector afterwards, so every rank knows at once whether
the ranks agree (``max == min``), and can make the second collective that names the values
without any rank waiting alone. Integers compare exactly; a ``SUM`` cannot tell ``(1, 3)`` from
``(2, 2)``, and floats would round.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "Note",
    "check_in_step",
    "check_same_schedule",
    "gathered_if_different",
    "inside",
    "notes",
    "recording",
    "same_everywhere",
]

_WIDTH = 8  # counters sent as they are (exact); beyond them, a hash of all of them joins in
_MASK = (1 << 62) - 1  # a hash as an int64 whose negation is an int64 too


class Note:
    """What an enclosing combinator runs under.

    Attributes:
        values: its counters at this step (a tuple of ints, compared across ranks); ``()`` at
            ``init``.
        describe: a function of no arguments giving the note's text for an error message (at
            ``init``: its configuration, compared as text); called only when needed.
    """

    __slots__ = ("describe", "values")

    def __init__(self, values: tuple, describe: Callable[[], str]) -> None:
        self.values, self.describe = values, describe


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[Note] = []
        self.recorders: list[list[Note]] = []


_LOCAL = _Local()


class inside:  # noqa: N801 - used as a context manager, like contextlib's
    """``with inside(note):`` runs the block under ``note``: collectives inside it see it."""

    __slots__ = ("note", "stack")

    def __init__(self, note: Note) -> None:
        self.note = note

    def __enter__(self) -> None:
        local = _LOCAL
        self.stack = local.stack
        self.stack.append(self.note)
        for r in local.recorders:
            r.append(self.note)

    def __exit__(self, *exc: Any) -> None:
        self.stack.pop()


def notes() -> tuple[Note, ...]:
    """The notes of the combinators around the caller, outermost first."""
    return tuple(_LOCAL.stack)


class recording:  # noqa: N801 - a context manager
    """``with recording() as found:`` lists in ``found`` every note made inside the block."""

    __slots__ = ("found",)

    def __enter__(self) -> list[Note]:
        self.found: list[Note] = []
        _LOCAL.recorders.append(self.found)
        return self.found

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.recorders.pop()  # this block's (blocks nest): not list.remove, which compares lists


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _spread(texts: list[str]) -> str:
    """``"a on ranks 0, 2 vs b on rank 1"``: each distinct text with the ranks that have it."""
    by: dict[str, list[int]] = {}
    for r, t in enumerate(texts):
        by.setdefault(t, []).append(r)
    return " vs ".join(f"{t} on {_ranks(rs)}" for t, rs in by.items())


def gathered_if_different(comm: Any, records: list[str]) -> list[list[str]] | None:
    """None where every rank of ``comm`` passed the same ``records`` (texts), else every rank's
    records, in rank order (the same list on every rank).

    One ``Allgather`` of a 32-byte digest per rank; only when they differ, a second collective
    (every rank knows by then, so none waits alone) brings the records together.
    """
    mine = np.frombuffer(hashlib.sha256("\0".join(records).encode()).digest(), np.uint8)
    every = np.empty((comm.Get_size(), mine.size), np.uint8)
    comm.Allgather(mine, every)
    if (every == every[0]).all():
        return None
    return comm.allgather(records)


def same_everywhere(comm: Any, records: list[str]) -> list[str]:
    """``[]`` where every rank of ``comm`` passed the same ``records``, else one line per position
    where they differ, ``"<text> on rank 0 vs <text> on ranks 1, 2"`` (the same on every rank);
    `gathered_if_different`'s collectives."""
    every = gathered_if_different(comm, records)
    return [] if every is None else _differences(every)


def check_same_schedule(comm: Any, records: list[str], where: str) -> None:
    """Raises the same ValueError on every rank unless every rank runs ``where`` (a collective)
    under the same schedule: ``records``, the configuration notes of the combinators that decide
    when it runs (MultiSteps' ``every_k_schedule``). Ranks with another ``k`` would pair the
    collectives of different mini-steps, and the one with more emitting steps would hang."""
    lines = same_everywhere(comm, records)
    if lines:
        raise ValueError(
            f"{where}: the schedules around it differ between ranks: {'; '.join(lines)}; every "
            f"rank must run the same transformation"
        )


def _differences(per_rank: list[list[str]]) -> list[str]:
    width = max(len(r) for r in per_rank)
    padded = [r + ["nothing"] * (width - len(r)) for r in per_rank]
    return [_spread([r[i] for r in padded]) for i in range(width) if len({r[i] for r in padded}) > 1]


def _vector(values: tuple) -> np.ndarray:
    """``[v, -v]`` (int64), ``v`` a fixed-width vector of ``values``: their number, a hash of all
    of them (Python's hash of a tuple of ints is the same in every process) and the first
    `_WIDTH` of them, exactly."""
    head = [*values[:_WIDTH], *[0] * (_WIDTH - min(len(values), _WIDTH))]
    v = [len(values), hash(values) & _MASK, *head]
    return np.array(v + [-x for x in v], np.int64)


def check_in_step(comm: Any, values: tuple, describe: Callable[[], list[str]], where: str) -> None:
    """Raises the same ValueError on every rank of ``comm`` unless every rank passed the same
    ``values`` (non-negative ints below 2**62: step counters).

    One ``Allreduce`` (``MAX``) of ``[v, -v]``, ``v`` a fixed-width int64 vector of ``values``
    (`_vector`): every rank then holds ``max(v)`` and ``-min(v)``, equal and opposite where the
    ranks agree. When they do not, a second collective gathers every rank's ``describe()`` (the
    counters as text) for the message.

    Args:
        comm: the communicator.
        values: this rank's counters.
        describe: their texts, for the message.
        where: the collective, for the message (``"allreduce_mean"``).
    """
    both = _vector(values)
    in_place, op_max = _OPS or _ops()
    comm.Allreduce(in_place, both, op=op_max)
    got = both.tolist()
    half = len(got) // 2
    if got[:half] == [-x for x in got[half:]]:  # max == min: every rank has v
        return
    lines = _differences(comm.allgather(describe())) or ["counters that differ only past the ones named"]
    raise ValueError(
        f"{where}: the ranks are out of step (a collective pairs the n-th call of every rank, "
        f"whatever step each is at): {'; '.join(lines)}. Every rank must resume from the "
        f"checkpoint of the same step and take the same steps (the same MultiSteps k, no step "
        f"skipped on some ranks only)"
    )


_OPS: tuple = ()  # mpi4py's IN_PLACE and MAX, once imported (an import per step costs a microsecond)


def _ops() -> tuple:
    global _OPS
    from mpi4py import MPI  # a communicator exists, so mpi4py is installed

    _OPS = (MPI.IN_PLACE, MPI.MAX)
    return _OPS
