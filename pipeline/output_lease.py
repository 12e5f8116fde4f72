"""One job per output at a time: a launch takes a lease on `--output` before it writes anything there.

The lease is `{output}/.flux2-job.lease`, made with the storage room's lease stores (model/storage/leases.py): a local
file created only if absent (a hard link that fails when the name exists), a gs:// object created with
`if_generation_match=0`. It names the job (this run, or its Dataflow job id), its host and process. A second launch
on the same output stops (exit 2) naming that job, unless the lease is stale:
- its holder runs on this machine and its process is gone (Ctrl-C'd, killed): taken over at once;
- the launching process refreshes the lease every HEARTBEAT_S (a thread) while it launches, and runs, the job; one
  not refreshed for STALE_AFTER_S (a job killed on another machine writing the same gs:// output) is taken over;
- a remote (Dataflow) job's lease is handed to the job once it is submitted: it then names the Dataflow job id and
  the job's last step (after summary.json) removes it. The launcher is gone by then, so nothing refreshes it: another
  launch asks Dataflow for the job's state (an ended job's lease is taken over) and, when Dataflow cannot be asked,
  holds it for DATAFLOW_STALE_AFTER_S after the submission.
The lease is removed at the end of a local run, whatever its end (finished, failed, Ctrl-C); a run killed outright
(SIGKILL, power loss) leaves it, for the next launch to take over as above.

Leftovers of earlier runs are cleared by the launch that holds the lease, and only what their makers left:
Beam's `beam-temp-*` folders and the hidden `.NAME.*.tmp` files of model/storage/atomic.py, all of them when the
previous holder is known gone (no lease was there, or its process or Dataflow job ended), else those untouched for
the stale limit. A run's own temporary folders are the ones that appeared while it held the lease: it removes them
when it ends; no run removes another's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
import shutil
import threading
import time
from typing import Callable

from model import TAKE_OVER, WAIT, GcsLeases, Holder, LocalLeases, decide, process_alive
from transforms import layout

from .errors import UsageError

logger = logging.getLogger("pipeline.output_lease")

LEASE_KEY = ".flux2-job"  # {output}/.flux2-job.lease
HEARTBEAT_S = 30.0  # how often a running job refreshes its lease
STALE_AFTER_S = 300.0  # a local run's lease not refreshed this long (ten heartbeats) is its dead holder's
DATAFLOW_STALE_AFTER_S = 24 * 3600.0  # a Dataflow job's lease, when Dataflow cannot be asked whether it still runs
DATAFLOW_STATE_TIMEOUT_S = 20.0  # how long a launch waits for Dataflow to say a job's state
# Dataflow job states after which the job writes nothing more.
DATAFLOW_ENDED = ("JOB_STATE_DONE", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_UPDATED",
                  "JOB_STATE_DRAINED", "JOB_STATE_STOPPED")
TEMP_FOLDERS = ("", layout.MANIFEST_DIR, layout.ERRORS_DIR)  # where Beam's file sinks put `beam-temp-*`
# model/storage/atomic.py: tempfile.mkstemp(prefix="." + name + ".", suffix=".tmp"), 8 random characters
ATOMIC_TEMP = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


def lease_store(output: str):
    """The lease store of `output`: the lease lives directly in it."""
    return GcsLeases(output, subfolder="") if output.startswith("gs://") else LocalLeases(output, subfolder="")


def dataflow_runner(project: str | None, region: str | None) -> str:
    return f"dataflow:{project or ''}/{region or ''}"


def dataflow_job_running(runner: str, job_id: str, timeout_s: float = DATAFLOW_STATE_TIMEOUT_S) -> bool | None:
    """Whether the Dataflow job `job_id` (of `runner`, "dataflow:PROJECT/REGION") still runs: False once it ended,
    None when Dataflow cannot be asked within `timeout_s` (no credentials, offline)."""
    project, _, region = runner[len("dataflow:"):].partition("/")
    if not (project and region and job_id):
        return None

    from transforms.beam_adapter import dataflow_job_state

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        state = pool.submit(dataflow_job_state, project, region, job_id).result(timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - any failure means: cannot be told
        logger.info("cannot ask Dataflow for the state of job %s: %s", job_id, e)
        return None
    finally:
        pool.shutdown(wait=False)
    return str(state).rsplit(".", 1)[-1] not in DATAFLOW_ENDED


def holder_alive(holder: Holder | None, job_state: Callable = dataflow_job_running) -> bool | None:
    """Whether the lease's holder still writes: its Dataflow job's state, or its process on this machine; None when
    neither can be told (only the lease's age then)."""
    if holder is None:
        return None
    if holder.runner.startswith("dataflow:"):  # a submitted job: its launcher is gone, the job's state tells
        return job_state(holder.runner, holder.job) if holder.job else None
    return process_alive(holder)  # a local job, or a launch still under way


def _held_by(found, token: str) -> bool:
    """Whether the lease `found` (a store's read; None: no lease) is the one of the holder with `token`."""
    return found is not None and found.holder is not None and found.holder.token == token


def _stale_limit(holder: Holder | None) -> float:
    return holder.stale_after if holder is not None and holder.stale_after > 0 else STALE_AFTER_S


# --------------------------------------------------------------------------------------------- leftovers
def _temp_folders(output: str) -> dict[str, float]:
    """{beam-temp-* folder (a path, or a gs:// prefix ending in '/'): when anything in it last changed}."""
    found: dict[str, float] = {}
    if layout.is_local_path(output):
        for sub in TEMP_FOLDERS:
            parent = os.path.join(output, sub)
            try:
                names = [n for n in os.listdir(parent) if n.startswith("beam-temp-")]
            except OSError:
                continue
            for name in names:
                top = os.path.join(parent, name)
                times = []
                for root, _dirs, files in os.walk(top):
                    for entry in [root] + [os.path.join(root, f) for f in files]:
                        try:
                            times.append(os.stat(entry).st_mtime)
                        except OSError:
                            pass
                found[top] = max(times, default=0.0)
        return found
    from apache_beam.io.filesystems import FileSystems

    for sub in TEMP_FOLDERS:
        pattern = layout.join(output, (sub + "/" if sub else "") + "beam-temp-*/**")
        try:
            objects = FileSystems.match([pattern])[0].metadata_list
        except Exception:  # noqa: BLE001 - nothing there
            continue
        for m in objects:
            head, rest = m.path.split("beam-temp-", 1)
            top = head + "beam-temp-" + rest.split("/", 1)[0] + "/"
            found[top] = max(found.get(top, 0.0), float(m.last_updated_in_seconds or 0.0))
    return found


def _remove_temp_folders(folders: list[str]) -> int:
    local = [f for f in folders if layout.is_local_path(f)]
    for top in local:
        shutil.rmtree(top, ignore_errors=True)
    remote = [f for f in folders if not layout.is_local_path(f)]
    if remote:
        from apache_beam.io.filesystems import FileSystems

        objects = []
        for top in remote:
            try:
                objects += [m.path for m in FileSystems.match([top + "**"])[0].metadata_list]
            except Exception:  # noqa: BLE001 - gone meanwhile
                continue
        if objects:
            FileSystems.delete(objects)
    return len(folders)


def _atomic_temp_files(output: str) -> dict[str, float]:
    """{hidden `.NAME.*.tmp` file of an atomic write under a local `output` (its top and first level): mtime}."""
    if not layout.is_local_path(output):
        return {}  # object stores: an unfinished upload is never an object
    found = {}
    folders = [output]
    try:
        folders += [e.path for e in os.scandir(output) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return {}
    for folder in folders:
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if ATOMIC_TEMP.match(e.name) and e.is_file(follow_symlinks=False):
                        found[e.path] = e.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
    return found


# --------------------------------------------------------------------------------------------- the lease
@dataclasses.dataclass
class OutputLease:
    """A lease this launch holds on its output (`tag` None: it could not be taken, and the run goes on without)."""

    output: str
    store: object
    tag: object
    holder: Holder
    previous_gone: bool  # the previous holder (if any) is known to write nothing more
    previous_stale_after: float = STALE_AFTER_S  # the stale limit of the lease taken over (its leftovers' age)
    temp_before: frozenset = frozenset()  # beam-temp-* folders there when the lease was taken (none of this run's)
    removed: int = 0  # leftovers removed at launch
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def path(self) -> str:
        return self.store.path(LEASE_KEY)

    def clear_leftovers(self, now: float | None = None) -> int:
        """Remove what earlier runs left (`beam-temp-*` folders, atomic writes' `.tmp` files): all of it when the
        previous holder is known gone, else what has not changed for the stale limit. Returns how many."""
        now = time.time() if now is None else now
        limit = self.previous_stale_after
        temp = _temp_folders(self.output)
        old = [f for f, changed in temp.items() if self.previous_gone or now - changed >= limit]
        self.temp_before = frozenset(temp) - frozenset(old)  # first: a failed removal must not make them this run's
        removed = _remove_temp_folders(old)
        for path, changed in _atomic_temp_files(self.output).items():
            if self.previous_gone or now - changed >= limit:
                try:
                    os.unlink(path)
                    removed += 1
                except OSError:
                    pass
        self.removed = removed
        if removed:
            logger.info("removed %d leftover(s) of earlier runs under %s", removed, self.output)
        return removed

    def remove_own_temp(self) -> int:
        """Remove the `beam-temp-*` folders that appeared while this run held the lease (Beam's, of this run)."""
        try:
            mine = [f for f in _temp_folders(self.output) if f not in self.temp_before]
            return _remove_temp_folders(mine)
        except Exception as e:  # noqa: BLE001 - a leftover is removed by the next run; the run's own error matters
            logger.warning("could not remove the temporary folders of this run under %s: %s", self.output, e)
            return 0

    def start_heartbeat(self, period_s: float = HEARTBEAT_S) -> None:
        """Refresh the lease every `period_s` on a daemon thread, until `release`."""
        if self.tag is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, args=(period_s,), name="output-lease-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    tag = self._refreshed(self.store.refresh(LEASE_KEY, self.tag))
                    if tag is None:
                        self.tag = None
                        logger.error("the lease on %s was taken over by another launch (this job's heartbeat was "
                                     "late by over %.0f s): two jobs may now write there", self.output,
                                     _stale_limit(self.holder))
                        return
                    self.tag = tag
            except Exception as e:  # noqa: BLE001 - a missed beat; the next may pass
                logger.warning("could not refresh the lease on %s: %s", self.output, e)

    def _refreshed(self, tag):
        """`tag`, or when a refresh found the lease changed, its tag if it is still this launch's own (a retried
        write whose first answer was lost: GCS applied it, then refused the retry's precondition)."""
        if tag is not None:
            return tag
        found = self.store.read(LEASE_KEY)
        if _held_by(found, self.holder.token):
            return found.tag
        return None

    def hand_to_job(self, job_id: str, runner: str, stale_after: float = DATAFLOW_STALE_AFTER_S) -> None:
        """Leave the lease to the submitted remote job `job_id` (what another launch asks Dataflow about; its last
        step removes the lease): this launcher's heartbeat stops, and the lease now says whose it is."""
        self._stop.set()
        with self._lock:
            if self.tag is None:
                return
            holder = dataclasses.replace(self.holder, job=job_id, runner=runner, stale_after=stale_after)
            try:
                tag = self._refreshed(self.store.refresh(LEASE_KEY, self.tag, holder))
            except Exception as e:  # noqa: BLE001 - the lease still holds, as this launcher's, until it is stale
                logger.warning("could not hand the lease %s to job %s: %s", self.path, job_id, e)
                return
            if tag is not None:
                self.tag, self.holder = tag, holder

    def release(self) -> bool:
        """Stop the heartbeat and remove the lease (only if it is still this launch's)."""
        self._stop.set()
        with self._lock:
            tag, self.tag = self.tag, None
        if tag is None:
            return False
        try:
            if self.store.remove(LEASE_KEY, tag):
                return True
            found = self.store.read(LEASE_KEY)  # a retried delete whose first answer was lost finds it gone
            if _held_by(found, self.holder.token):
                return bool(self.store.remove(LEASE_KEY, found.tag))
            return found is None
        except Exception as e:  # noqa: BLE001 - it goes stale; said so the user knows why a launch may wait
            logger.warning("could not remove the lease %s (%s); another launch takes it over once it is stale",
                           self.path, e)
            return False


def take_output_lease(output: str, *, job: str, stale_after: float = STALE_AFTER_S, store=None,
                      job_state: Callable = dataflow_job_running) -> OutputLease:
    """Take the lease on `output` for `job` (run by this process until `hand_to_job`); UsageError naming the job
    that holds it while that job runs. A lease store that cannot be used (a read-only output is said later, by the
    writes) gives a lease holding nothing."""
    store = store if store is not None else lease_store(output)
    holder = Holder.me(job=job, stale_after=stale_after)
    previous_gone, previous_limit = True, STALE_AFTER_S
    for _ in range(5):
        try:
            tag = store.create(LEASE_KEY, holder)
            if tag is not None:
                return OutputLease(output, store, tag, holder, previous_gone, previous_limit)
            found = store.read(LEASE_KEY)
        except Exception as e:  # noqa: BLE001 - e.g. a file system without hard links
            logger.warning("cannot take the lease on --output=%s (%s: %s); running without it: nothing keeps "
                           "another job from writing there at the same time", output, type(e).__name__, e)
            return OutputLease(output, store, None, holder, previous_gone=False)
        if found is None:
            continue  # removed meanwhile: create it again
        if _held_by(found, holder.token):
            return OutputLease(output, store, found.tag, holder, previous_gone, previous_limit)  # ours: an answer lost
        alive = holder_alive(found.holder, job_state)
        limit = _stale_limit(found.holder)
        action = decide(found.age_s, 0.0, holder_alive=alive, stale_after=limit, max_wait=float("inf"))
        who = found.holder.describe() if found.holder else "a job that left an unreadable lease"
        if action == WAIT:
            raise UsageError(
                f"--output={output!r} is being written by another job: {who}, lease refreshed {found.age_s:.0f} s "
                f"ago; wait for it to end or choose another --output (a lease not refreshed for {limit:.0f} s is "
                f"taken over; if that job is surely gone, delete {store.path(LEASE_KEY)})")
        assert action == TAKE_OVER
        if alive is False:
            why = "its Dataflow job ended" if found.holder.runner else "its process is gone"
        else:
            why = f"not refreshed for {found.age_s:.0f} s"
        logger.warning("taking over the lease on %s of %s (%s)", output, who, why)
        store.remove(LEASE_KEY, found.tag)
        previous_gone, previous_limit = alive is False, limit
    raise UsageError(f"--output={output!r}: its lease {store.path(LEASE_KEY)} keeps changing (other launches are "
                     f"taking it); try again")


def release_from_job(_summary, output: str, token: str) -> None:
    """The last step of a Dataflow job: remove its lease on `output` (the one whose holder has `token`)."""
    store = lease_store(output)
    found = store.read(LEASE_KEY)
    if _held_by(found, token):
        store.remove(LEASE_KEY, found.tag)
