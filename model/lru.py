"""A least-recently-used map with a size bound, for the per-shape caches of a long-running worker.

A job whose requests ask for many image sizes (or step counts) makes a new shape bucket for each; without a bound
the compiled programs, RoPE tables and schedules of every bucket ever seen would stay in memory for the life of the
worker. The text-embedding cache of repeated prompts is one too.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Generic, Hashable, Iterator, TypeVar

from .contract import optional_count

logger = logging.getLogger(__name__)

V = TypeVar("V")


class LRUCache(Generic[V]):
    """`get(key, make)` returns the cached value or makes, stores and returns it; past `maxsize` entries the least
    recently used one is dropped. `maxsize=None` keeps everything. `log_drops`: log each dropped key (off for caches
    whose keys are user text or that drop all the time). Not thread-safe: callers hold their own lock."""

    def __init__(self, maxsize: int | None, name: str = "cache", *, log_drops: bool = True):
        self.maxsize = optional_count(f"{name} size", maxsize)
        self.name = name
        self.log_drops = log_drops
        self.evictions = 0
        self._items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        if key in self._items:
            return self[key]
        value = make()
        self.put(key, value)
        return value

    def __getitem__(self, key: Hashable) -> V:
        """The value of a cached key (KeyError otherwise), now the most recently used."""
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: Hashable, value: V) -> None:
        """Store `value` as the most recently used, dropping the least recently used past `maxsize`."""
        self._items[key] = value
        self._items.move_to_end(key)
        while self.maxsize is not None and len(self._items) > self.maxsize:
            old, _ = self._items.popitem(last=False)
            self.evictions += 1
            if self.log_drops:
                logger.info("%s: dropped %s, the least recently used of more than %d", self.name, old, self.maxsize)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def keys(self) -> list:
        return list(self._items)
