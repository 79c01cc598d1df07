"""`Bounded`: the thread-safe bounded cache every module-level cache of derived data uses.

Layouts themselves are interned in a weak-value dict (`numbaccum.layout`): a layout lives as
long as something holds it, so ``is`` comparisons stay valid. What is *derived* from a layout
(tables, plans, buffers) lives here, at most ``_config.CACHE_ENTRIES`` entries, the oldest
evicted first; an evicted entry is recomputed on its next use, never wrong.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from . import _config, _locks

__all__ = ["Bounded"]


class Bounded:
    """A dict-like cache of at most ``bound`` entries (default: ``_config.CACHE_ENTRIES``, read
    at each insertion), the first inserted evicted first.

    First-in first-out rather than least-recently-used: a hit is then the dict's own ``get``
    (tens of nanoseconds, on every step of a small tree) with no bookkeeping; an entry still in
    use that was evicted is rebuilt once on its next use. Safe under threads: a hit is one
    C-level call (atomic under the GIL); an insertion takes a lock, and `put` returns the value
    already there when another thread won the race, so every thread gets the same object.
    """

    __slots__ = ("_data", "_lock", "bound", "get")

    def __init__(self, bound: int | None = None) -> None:
        self._data: OrderedDict = OrderedDict()
        self._lock = _locks.lock()
        self.bound = bound
        self.get = self._data.get  # the value for a key, or None

    def put(self, key: Any, value: Any) -> Any:
        """Stores ``value`` under ``key`` unless a value is already there; returns the stored one.
        Evicts the oldest entries beyond the bound."""
        bound = self.bound or _config.CACHE_ENTRIES
        with self._lock:
            data = self._data
            old = data.get(key)
            if old is not None:
                return old
            data[key] = value
            while len(data) > bound:
                data.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Any) -> bool:
        return key in self._data

    def values(self) -> list:
        return list(self._data.values())
