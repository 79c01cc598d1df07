"""`Bounded`: the thread-safe LRU cache every module-level cache of derived data uses.

Layouts themselves are interned in a weak-value dict (`numbaccum.layout`): a layout lives as
long as something holds it, so ``is`` comparisons stay valid. What is *derived* from a layout
(tables, plans, buffers) lives here, at most ``_config.CACHE_ENTRIES`` entries, least recently
used evicted first; an evicted entry is recomputed on its next use, never wrong.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from . import _config

__all__ = ["Bounded"]


class Bounded:
    """A dict-like cache of at most ``bound`` entries (default: ``_config.CACHE_ENTRIES``, read
    at each insertion), least recently used evicted first.

    Safe under threads: a hit is one C-level ``get`` and ``move_to_end`` (atomic under the GIL,
    no lock); an insertion takes a lock, and `put` returns the value already there when another
    thread won the race, so every thread gets the same object for a key.
    """

    __slots__ = ("_data", "_lock", "bound")

    def __init__(self, bound: int | None = None) -> None:
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.bound = bound

    def get(self, key: Any) -> Any:
        """The value for ``key`` (marked most recently used), or None."""
        data = self._data
        value = data.get(key)
        if value is not None:
            try:  # noqa: SIM105 - contextlib.suppress costs more than the lookup
                data.move_to_end(key)
            except KeyError:  # evicted by another thread in between: the value is still good
                pass
        return value

    def put(self, key: Any, value: Any) -> Any:
        """Stores ``value`` under ``key`` unless a value is already there; returns the stored one.
        Evicts the least recently used entries beyond the bound."""
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
