"""Leases: a file or object created only if absent, naming its holder, refreshed by it and removed by tag.

Two stores with one interface (`create`, `read`, `remove`, `refresh`, `holder_alive`): `LocalLeases`, files created
with a hard link that fails when the name exists, and `GcsLeases`, objects written with `if_generation_match=0`.
`decide` is what a process that found a lease held does next. The compile lease (model/engine/compile_lease.py) and
the job's lease on its output (pipeline/output_lease.py) are made of them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import tempfile
import time
import uuid
from typing import NamedTuple

LEASES = "leases"  # the leases' folder inside the folder they guard, unless a store is given another

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


def decide(lease_age_s: float | None, waited_s: float, *, holder_alive: bool | None = None, stale_after: float,
           max_wait: float) -> str:
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
    """Leases as files in `{folder}/leases/` (`{folder}/{subfolder}/`), created with a hard link that fails when the
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
    """Leases as objects under `{prefix}/leases/` (`{prefix}/{subfolder}/`), created with `if_generation_match=0`
    (GCS answers 412 if the object exists) and removed by generation."""

    def __init__(self, cache_dir: str, client=None, subfolder: str = LEASES):
        from . import gcs

        self._bucket_name, prefix = gcs.split(gcs.join(cache_dir, subfolder))
        self._prefix = prefix
        self._client = client or gcs.client()
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
