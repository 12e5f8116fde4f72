"""A least-recently-used map with a size bound, for the per-shape caches of a long-running worker.

A job whose requests ask for many image sizes (or step counts) makes a new shape bucket for each; without a bound
the compiled programs, RoPE tables and schedules of every bucket ever seen would stay in memory for the life of the
worker.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Generic, Hashable, TypeVar

from .noise import is_integer

logger = logging.getLogger(__name__)

V = TypeVar("V")


class LRUCache(Generic[V]):
    """`get(key, make)` returns the cached value or makes, stores and returns it; past `maxsize` entries the least
    recently used one is dropped. `maxsize=None` keeps everything. Not thread-safe: callers hold their own lock."""

    def __init__(self, maxsize: int | None, name: str = "cache"):
        if maxsize is not None and (not is_integer(maxsize) or maxsize < 1):
            raise ValueError(f"{name} size must be None or an integer >= 1, got {maxsize!r}")
        self.maxsize = None if maxsize is None else int(maxsize)
        self.name = name
        self.evictions = 0
        self._items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = make()
        self._items[key] = value
        while self.maxsize is not None and len(self._items) > self.maxsize:
            old, _ = self._items.popitem(last=False)
            self.evictions += 1
            logger.info("%s: dropped %s, the least recently used of more than %d", self.name, old, self.maxsize)
        return value

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list:
        return list(self._items)
