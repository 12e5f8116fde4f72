"""Process-wide counts of XLA compilations and persistent-cache lookups, from JAX's monitoring events.

Listeners are registered once per process (`counts()` starts them); a job reports the deltas as Beam counters so
"a second run compiles nothing" can be read off its metrics. `lease_waits` counts the programs this process waited
for another worker to compile (model/engine/compile_lease.py).
"""

from __future__ import annotations

import threading

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"

_counts = {"compiles": 0, "cache_hits": 0, "cache_misses": 0, "lease_waits": 0}  # compiles: backend-compile events
_lock = threading.Lock()
_registered = False


def _on_duration(event, duration, **_):
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _counts["compiles"] += 1


def _on_event(event, **_):
    key = {CACHE_HIT_EVENT: "cache_hits", CACHE_MISS_EVENT: "cache_misses"}.get(event)
    if key:
        with _lock:
            _counts[key] += 1


def note_lease_wait() -> None:
    """One program this process waited for another worker to compile (a compile lease it found held)."""
    with _lock:
        _counts["lease_waits"] += 1


def counts() -> dict:
    """{'compiles', 'cache_hits', 'cache_misses', 'lease_waits'} since the listeners started (the first call). JAX times a program
    loaded from the persistent cache under the same event as a compilation, so `compiles` is those events less the
    cache hits: the programs XLA really compiled."""
    global _registered
    with _lock:
        if not _registered:
            import jax.monitoring as monitoring

            monitoring.register_event_duration_secs_listener(_on_duration)
            monitoring.register_event_listener(_on_event)
            _registered = True
        return {"compiles": max(0, _counts["compiles"] - _counts["cache_hits"]), "cache_hits": _counts["cache_hits"],
                "cache_misses": _counts["cache_misses"], "lease_waits": _counts["lease_waits"]}
