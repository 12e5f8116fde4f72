"""A least-recently-used map with a size bound, for the per-shape caches of a long-running worker.

A job whose requests ask for many image sizes (or step counts) makes a new shape bucket for each; without a bound
the compiled programs, RoPE tables and schedules of every bucket ever seen would stay in memory for the life of the
worker. The text-embedding cache of repeated prompts is one too.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Hashable, TypeVar

import cachetools

from ..contract import optional_count

logger = logging.getLogger(__name__)

V = TypeVar("V")


class LRUCache(cachetools.LRUCache):
    """cachetools' LRU map (reading a key makes it the most recently used; past `maxsize` entries the least recently
    used one is dropped) with a name, a count of the entries dropped (`evictions`) and `get_or_make`. `maxsize=None`
    keeps everything. `log_drops`: log each dropped key (off for caches whose keys are user text or that drop all the
    time). Not thread-safe: callers hold their own lock."""

    def __init__(self, maxsize: int | None, name: str = "cache", *, log_drops: bool = True):
        bound = optional_count(f"{name} size", maxsize)
        super().__init__(maxsize=math.inf if bound is None else bound)
        self.name = name
        self.log_drops = log_drops
        self.evictions = 0

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The cached value of `key` (now the most recently used), or `make()`'s, stored."""
        if key in self:
            return self[key]
        value = make()
        self[key] = value
        return value

    def popitem(self):
        """Drop the least recently used entry (cachetools calls this when an insert goes past `maxsize`)."""
        key, value = super().popitem()
        self.evictions += 1
        if self.log_drops:
            logger.info("%s: dropped %s, the least recently used of more than %d", self.name, key, self.maxsize)
        return key, value
