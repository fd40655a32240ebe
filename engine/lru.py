"""One LRU for retained KV caches: entries by key, within a byte budget.

Every core keeps the KV cache of a session's paused or finished turn for the
session's next request: ``kvpool.KVHandles`` (blocks of the paged pool),
``eager_kv.EagerCaches`` (the eager core's tensors) and the fake core's nominal
store (token ids). Each says what an entry is, how many bytes it counts for,
and what letting it go frees; this class keeps the order and the budget, so
the three evict alike: the least recently put first, once over budget.

A ``take`` (a request resumes from the entry) removes the entry without
releasing it: the running request owns that cache now. Looking an entry up
does not make it more recent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

V = TypeVar("V")


def _keep(_: object) -> None:
    """Letting go of an entry that holds nothing the store must free."""


class RetainedLRU(Generic[V]):
    def __init__(
        self,
        budget_bytes: int,
        nbytes: Callable[[V], int],
        release: Callable[[V], None] = _keep,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._nbytes = nbytes
        self._release = release  # an entry dropped or evicted, not taken
        # Each entry with the bytes it was counted for, least recently put first.
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()

    def put(self, key: str, value: V) -> bool:
        """Keep ``value`` under ``key`` (replacing, and releasing, what was there) as
        the most recent entry, evicting the least recently put ones while over budget.
        False if ``value`` alone exceeds the budget: then nothing is kept and the
        caller still owns it."""
        self.drop(key)
        size = self._nbytes(value)
        if size > self.budget_bytes:
            return False
        self._entries[key] = (value, size)
        self.used_bytes += size
        while self.used_bytes > self.budget_bytes:
            self.evict_oldest()
        return key in self._entries

    def take(self, key: str) -> V | None:
        """Remove and return ``key``'s entry, unreleased: its new owner frees it."""
        held = self._entries.pop(key, None)
        if held is None:
            return None
        self.used_bytes -= held[1]
        return held[0]

    def drop(self, key: str) -> None:
        """Remove ``key``'s entry, if any, and release it."""
        value = self.take(key)
        if value is not None:
            self._release(value)

    def evict_oldest(self) -> bool:
        """Remove and release the least recently put entry; False if there is none."""
        if not self._entries:
            return False
        _, (value, size) = self._entries.popitem(last=False)
        self.used_bytes -= size
        self._release(value)
        return True

    def get(self, key: str) -> V | None:
        """``key``'s entry, left in place and in its place in the order."""
        held = self._entries.get(key)
        return held[0] if held is not None else None

    def values(self) -> Iterator[V]:
        """The entries, least recently put first."""
        return (value for value, _ in self._entries.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class LRUBacked:
    """A store whose entries live in ``self.lru``: its budget and use, as the
    engine's metrics read them, are the LRU's, and so are dropping an entry
    (released as the store's LRU releases it) and asking what it holds."""

    lru: RetainedLRU[Any]

    def drop(self, key: str) -> None:
        self.lru.drop(key)

    def __contains__(self, key: str) -> bool:
        return key in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    @property
    def budget_bytes(self) -> int:
        return self.lru.budget_bytes

    @property
    def used_bytes(self) -> int:
        return self.lru.used_bytes
