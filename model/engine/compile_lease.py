"""A compile lease: of the workers sharing a persistent compilation cache, only the first to reach a program compiles it.

Workers of a job share one XLA cache (pipeline/compile_cache.py), but nothing tells the others that one is already
compiling, so N workers starting together compile the same programs N times. Before compiling, a worker creates
`{cache}/leases/{key}.lease` (an exclusive create: a local file with O_EXCL, a gs:// object written with
`if_generation_match=0`) holding who it is; the one that creates it compiles (which writes the cache) and removes it,
the others wait until it is gone and then compile, which JAX answers from the cache. A lease older than
`stale_after` (its holder died; on a local folder also a holder on this host whose process is gone) is taken over,
and a wait longer than `max_wait` compiles anyway with a warning: a lease never deadlocks a worker.

The key and the decision are pure functions; only `compile_lowered` reads JAX (its versions, config and devices).
The stores (`LocalLeases`, `GcsLeases`), the holder and `decide` are the storage room's (model/storage/leases.py),
shared with the job's lease on its output (pipeline/output_lease.py).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable

from ..storage import leases as stores
from ..storage.leases import GIVE_UP, LEASES, TAKE, TAKE_OVER, WAIT, GcsLeases, Holder, LocalLeases

logger = logging.getLogger(__name__)

STALE_AFTER_S = 20 * 60.0  # a lease this old is its dead holder's: a program compiles in minutes, not this long
MAX_WAIT_S = 30 * 60.0  # a worker never waits longer than this for another's lease
POLL_S = 1.5  # how often a waiting worker looks whether the lease is gone

__all__ = ["GIVE_UP", "LEASES", "TAKE", "TAKE_OVER", "WAIT", "GcsLeases", "Holder", "LocalLeases", "cache_dir",
           "compile_lowered", "compile_with_lease", "decide", "lease_key", "leases_for", "program_key"]


def lease_key(program_text: str, *, jax_version: str, jaxlib_version: str, platform: str, platform_version: str,
              device_kind: str, device_count: int) -> str:
    """The lease's name for one executable: what JAX's own cache key depends on (the program, the versions, the
    backend and the devices), without reproducing that key."""
    h = hashlib.sha256(program_text.encode())
    for part in (jax_version, jaxlib_version, platform, platform_version, device_kind, device_count):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()


def decide(lease_age_s: float | None, waited_s: float, *, holder_alive: bool | None = None,
           stale_after: float = STALE_AFTER_S, max_wait: float = MAX_WAIT_S) -> str:
    """model.storage.leases.decide with the compile lease's limits."""
    return stores.decide(lease_age_s, waited_s, holder_alive=holder_alive, stale_after=stale_after, max_wait=max_wait)


def leases_for(cache_dir: str):
    """The lease store beside the compilation cache `cache_dir` (a folder or a gs:// prefix)."""
    return GcsLeases(cache_dir) if cache_dir.startswith("gs://") else LocalLeases(cache_dir)


# --------------------------------------------------------------------------------------------- compiling under one
def compile_with_lease(compile_fn: Callable, key: str, leases, *, stale_after: float = STALE_AFTER_S,
                       max_wait: float = MAX_WAIT_S, poll_s: float = POLL_S, on_wait: Callable[[], None] | None = None):
    """`compile_fn()` run once this worker holds the lease `key` (or gave up waiting for it); the lease is removed
    afterwards, also when compiling fails."""
    tag = _acquire(key, leases, stale_after=stale_after, max_wait=max_wait, poll_s=poll_s, on_wait=on_wait)
    try:
        return compile_fn()
    finally:
        if tag is not None:
            try:
                leases.remove(key, tag)
            except Exception:  # noqa: BLE001 - a lease left behind goes stale; the compile result still counts
                logger.warning("could not remove compile lease %s", key, exc_info=True)


def _acquire(key: str, leases, *, stale_after: float, max_wait: float, poll_s: float, on_wait):
    """The tag of the lease this worker now holds, or None when it compiles without one."""
    start = time.monotonic()
    waiting_for = None
    while True:
        try:
            tag = leases.create(key, Holder.me())
            if tag is not None:
                if waiting_for is not None:
                    logger.info("compile lease %s is free after %.1f s", key[:12], time.monotonic() - start)
                return tag
            lease = leases.read(key)
        except Exception:  # noqa: BLE001 - the lease is an optimisation: without it, compile as before
            logger.warning("cannot take compile lease %s; compiling without it", key[:12], exc_info=True)
            return None
        waited = time.monotonic() - start
        alive = leases.holder_alive(lease.holder) if lease is not None else None
        action = decide(None if lease is None else lease.age_s, waited, holder_alive=alive,
                        stale_after=stale_after, max_wait=max_wait)
        who = lease.holder.describe() if lease is not None and lease.holder else "an unknown holder"
        if action == TAKE:
            continue
        if action == GIVE_UP:
            logger.warning("waited %.0f s for %s to compile program %s; compiling it here too", waited, who, key[:12])
            return None
        if action == TAKE_OVER:
            logger.warning("compile lease %s of %s is stale (%.0f s old%s); taking it over", key[:12], who,
                           lease.age_s, ", its process is gone" if alive is False else "")
            if leases.remove(key, lease.tag):
                continue
        elif waiting_for is None:
            waiting_for = who
            logger.info("waiting for %s, who is compiling program %s, to find it in the compilation cache",
                        who, key[:12])
            if on_wait is not None:
                on_wait()
        time.sleep(poll_s)


def program_key(lowered, devices) -> str:
    """`lease_key` of a lowered JAX program compiled for `devices`."""
    import jax
    import jaxlib

    devices = list(devices)
    first = devices[0]
    client = getattr(first, "client", None)
    return lease_key(lowered.as_text(), jax_version=jax.__version__, jaxlib_version=jaxlib.__version__,
                     platform=first.platform, platform_version=getattr(client, "platform_version", ""),
                     device_kind=first.device_kind, device_count=len(devices))


def cache_dir() -> str | None:
    """JAX's persistent compilation cache folder (model.engine.programs.enable_compilation_cache, or JAX's environment
    variables), or None when the cache is off."""
    import jax

    path = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    return str(path) if path else None


def compile_lowered(lowered, devices, **kwargs):
    """`lowered.compile()`, under a lease beside the persistent compilation cache when one is on (`devices`: those
    the program runs on)."""
    folder = cache_dir()
    if not folder:
        return lowered.compile()  # no shared cache: a waiting worker would find nothing, so nothing to wait for
    from .compile_events import note_lease_wait

    return compile_with_lease(lowered.compile, program_key(lowered, devices), leases_for(folder),
                              on_wait=note_lease_wait, **kwargs)
