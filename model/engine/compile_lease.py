"""A compile lease: of the workers sharing a persistent compilation cache, only the first to reach a program compiles it.

Workers of a job share one XLA cache (pipeline/compile_cache.py), but nothing tells the others that one is already
compiling, so N workers starting together compile the same programs N times. Before compiling, a worker creates
`{cache}/leases/{key}.lease` (an exclusive create: a local file with O_EXCL, a gs:// object written with
`if_generation_match=0`) holding who it is; the one that creates it compiles (which writes the cache) and removes it,
the others wait until it is gone and then compile, which JAX answers from the cache. A lease older than
`stale_after` (its holder died; on a local folder also a holder on this host whose process is gone) is taken over,
and a wait longer than `max_wait` compiles anyway with a warning: a lease never deadlocks a worker.

The key and the decision are pure functions; only `compile_lowered` reads JAX (its versions, config and devices).
The stores (`LocalLeases`, `GcsLeases`) and the holder are also what a job's lease on its output is made of
(pipeline/output_lease.py): created only if absent, refreshed by its holder (`refresh`, its heartbeat), removed by tag.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from typing import Callable, NamedTuple

logger = logging.getLogger(__name__)

STALE_AFTER_S = 20 * 60.0  # a lease this old is its dead holder's: a program compiles in minutes, not this long
MAX_WAIT_S = 30 * 60.0  # a worker never waits longer than this for another's lease
POLL_S = 1.5  # how often a waiting worker looks whether the lease is gone
LEASES = "leases"  # the folder of the leases, inside the cache folder

TAKE, WAIT, TAKE_OVER, GIVE_UP = "take", "wait", "take_over", "give_up"


def pid_namespace() -> str:
    """This process's PID namespace (Linux), so that a pid is only ever looked up where it means the same process
    (two containers can share a host name, never a PID namespace); "" where it cannot be told."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lease: written into it so a waiting worker can say whom it waits for."""

    host: str
    pid: int
    time: float  # when it took the lease (seconds since the epoch)
    token: str = ""  # unique per take, so a holder only ever removes its own lease
    job: str = ""  # the job holding it (an output's lease: this run, or the Dataflow job id)
    stale_after: float = 0.0  # seconds without a refresh after which the holder is presumed gone (0: the reader's)
    runner: str = ""  # where the job runs: "" on this machine, "dataflow:PROJECT/REGION" for a Dataflow job
    pid_ns: str = ""  # pid_namespace() of the holder

    @classmethod
    def me(cls, **fields) -> "Holder":
        return cls(socket.gethostname(), os.getpid(), time.time(), uuid.uuid4().hex, pid_ns=pid_namespace(), **fields)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Holder | None":
        """The holder a lease names, or None when its content is unreadable (a half-written or foreign file)."""
        try:
            d = json.loads(text)
            return cls(str(d["host"]), int(d["pid"]), float(d["time"]), str(d.get("token", "")),
                       str(d.get("job", "")), float(d.get("stale_after", 0.0)), str(d.get("runner", "")),
                       str(d.get("pid_ns", "")))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.time, datetime.timezone.utc).strftime("%H:%M:%S UTC")
        if self.runner.startswith("dataflow:"):
            return f"Dataflow job {self.job or '(not yet submitted)'} in {self.runner[len('dataflow:'):]} " \
                   f"(launched from {self.host} at {since})"
        job = f"job {self.job}, " if self.job else ""
        return f"{job}pid {self.pid} on {self.host} (since {since})"


def process_alive(holder: Holder | None) -> bool | None:
    """False for a holder process on this host (and in this PID namespace, when the holder says its own) that is
    gone; True when it runs; None when it cannot be told (another host or container)."""
    if holder is None or holder.host != socket.gethostname():
        return None
    if holder.pid_ns and holder.pid_ns != pid_namespace():
        return None
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


class Lease(NamedTuple):
    """A lease as found: its holder (None if unreadable), its age and what identifies this very lease (`tag`)."""

    holder: Holder | None
    age_s: float
    tag: object


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
    """What a worker that could not create the lease does next: TAKE (it is gone: create it), GIVE_UP (waited
    `max_wait`: compile without it), TAKE_OVER (older than `stale_after`, or its holder is known dead) or WAIT."""
    if lease_age_s is None:
        return TAKE
    if waited_s >= max_wait:
        return GIVE_UP
    if holder_alive is False or lease_age_s >= stale_after:
        return TAKE_OVER
    return WAIT


# --------------------------------------------------------------------------------------------- where leases live
class LocalLeases:
    """Leases as files in `{cache}/leases/` (`{folder}/{subfolder}/`), created with a hard link that fails when the
    name exists (atomic on a local file system)."""

    def __init__(self, cache_dir: str, subfolder: str = LEASES):
        self.folder = os.path.join(cache_dir, subfolder) if subfolder else cache_dir

    def path(self, key: str) -> str:
        return os.path.join(self.folder, key + ".lease")

    def create(self, key: str, holder: Holder):
        """The new lease's tag, or None when the lease exists. The holder is written to a private file first, which
        is then hard-linked to the lease's name (fails if it exists): a reader never sees a lease without its holder."""
        os.makedirs(self.folder, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=self.folder, prefix=".new-", suffix=".lease")
        try:
            try:
                os.write(fd, holder.to_json().encode())
                st = os.fstat(fd)
            finally:
                os.close(fd)
            os.chmod(temp, 0o644)
            try:
                os.link(temp, self.path(key))
            except FileExistsError:
                return None
        finally:
            os.unlink(temp)
        return st.st_ino, st.st_mtime_ns

    def read(self, key: str) -> Lease | None:
        try:
            with open(self.path(key), "rb") as f:
                st = os.fstat(f.fileno())
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return None
        return Lease(Holder.from_json(text), max(0.0, time.time() - st.st_mtime), (st.st_ino, st.st_mtime_ns))

    def remove(self, key: str, tag) -> bool:
        """Remove the lease if it is still the one `tag` names (a taken-over lease belongs to its new holder)."""
        path = self.path(key)
        try:
            st = os.stat(path)
            if (st.st_ino, st.st_mtime_ns) != tag:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def refresh(self, key: str, tag, holder: Holder | None = None):
        """The lease's new tag after its holder refreshed it (its age starts again; with `holder`, its content is
        replaced), or None when it is no longer the one `tag` names (taken over, or removed)."""
        path = self.path(key)
        try:
            st = os.stat(path)
            if (st.st_ino, st.st_mtime_ns) != tag:
                return None
            if holder is None:
                os.utime(path)
            else:
                fd, temp = tempfile.mkstemp(dir=self.folder, prefix=".new-", suffix=".lease")
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(holder.to_json())
                    os.chmod(temp, 0o644)
                    os.replace(temp, path)
                except BaseException:
                    os.unlink(temp)
                    raise
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    @staticmethod
    def holder_alive(holder: Holder | None) -> bool | None:
        """False for a holder on this host whose process is gone; None when it cannot be told."""
        return process_alive(holder)


class GcsLeases:
    """Leases as objects under `{cache}/leases/`, created with `if_generation_match=0` (GCS answers 412 if the
    object exists) and removed by generation."""

    def __init__(self, cache_dir: str, client=None, subfolder: str = LEASES):
        from ..loading.checkpoint import _client, split_gs_uri

        self._bucket_name, prefix = split_gs_uri(cache_dir.rstrip("/") + ("/" + subfolder if subfolder else ""))
        self._prefix = prefix
        self._client = client or _client()
        self._bucket = self._client.bucket(self._bucket_name)

    def _blob(self, key: str):
        return self._bucket.blob(f"{self._prefix}/{key}.lease" if self._prefix else f"{key}.lease")

    def path(self, key: str) -> str:
        return f"gs://{self._bucket_name}/{self._blob(key).name}"

    def create(self, key: str, holder: Holder):
        from google.api_core import exceptions

        blob = self._blob(key)
        try:
            blob.upload_from_string(holder.to_json(), content_type="application/json", if_generation_match=0)
        except exceptions.PreconditionFailed:
            return None
        return blob.generation

    def read(self, key: str) -> Lease | None:
        from google.api_core import exceptions

        blob = self._bucket.get_blob(self._blob(key).name)
        if blob is None:
            return None
        generation, created = blob.generation, blob.time_created  # (a download may reset the blob's properties)
        try:
            text = blob.download_as_text(if_generation_match=generation)
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return None  # removed or replaced meanwhile: look again
        age = time.time() - created.timestamp() if created else 0.0
        return Lease(Holder.from_json(text), max(0.0, age), generation)

    def remove(self, key: str, tag) -> bool:
        from google.api_core import exceptions

        try:
            self._blob(key).delete(if_generation_match=tag)
            return True
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return False

    def refresh(self, key: str, tag, holder: Holder | None = None):
        """The lease's new generation after its holder rewrote it (same content unless `holder`: a new generation
        is created now, so its age starts again), or None when it is no longer generation `tag`."""
        from google.api_core import exceptions

        blob = self._blob(key)
        try:
            if holder is None:
                text = blob.download_as_text(if_generation_match=tag)
            else:
                text = holder.to_json()
            blob.upload_from_string(text, content_type="application/json", if_generation_match=tag)
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return None
        return blob.generation

    @staticmethod
    def holder_alive(holder: Holder | None) -> bool | None:
        return None  # workers on other machines (or in other containers): only the lease's age tells


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
