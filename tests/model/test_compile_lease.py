"""The compile lease (model/engine/compile_lease.py): one worker compiles a program, the others sharing the cache wait.

Unit level: the key, the decision, the local and gs:// (emulator) stores, and workers racing as threads. The
processes compiling the tiny model against one cache folder are in tests/model/test_compile_lease_processes.py.
"""

import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from model.engine import compile_lease as cl


def _key(shape):
    lowered = jax.jit(lambda x: jnp.sin(x) * 2).lower(jax.ShapeDtypeStruct(shape, jnp.float32))
    return cl.program_key(lowered, jax.devices()[:1])


def test_key_is_stable_for_a_program_and_differs_for_another_shape():
    assert _key((4, 8)) == _key((4, 8))
    assert _key((4, 8)) != _key((4, 16))
    base = dict(jax_version="1", jaxlib_version="1", platform="tpu", platform_version="x", device_kind="v5e",
                device_count=1)
    assert cl.lease_key("p", **base) != cl.lease_key("p", **{**base, "device_count": 4})
    assert cl.lease_key("p", **base) != cl.lease_key("p", **{**base, "jaxlib_version": "2"})


def test_decision():
    assert cl.decide(None, 0.0) == cl.TAKE
    assert cl.decide(5.0, 1.0, stale_after=60, max_wait=120) == cl.WAIT
    assert cl.decide(61.0, 1.0, stale_after=60, max_wait=120) == cl.TAKE_OVER
    assert cl.decide(5.0, 1.0, holder_alive=False, stale_after=60, max_wait=120) == cl.TAKE_OVER
    assert cl.decide(5.0, 121.0, stale_after=60, max_wait=120) == cl.GIVE_UP


def _race(leases, key="k" * 64, workers=2, hold_s=0.6):
    """Run `workers` threads compiling under the lease at once; returns (intervals, waits)."""
    intervals, waits, barrier = [], [], threading.Barrier(workers)

    def compile_fn():
        start = time.monotonic()
        time.sleep(hold_s)
        intervals.append((start, time.monotonic()))
        return "exe"

    def worker():
        barrier.wait()
        assert cl.compile_with_lease(compile_fn, key, leases, poll_s=0.05, on_wait=lambda: waits.append(1)) == "exe"

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return sorted(intervals), waits


def _assert_one_at_a_time(intervals, waits, workers=2):
    assert len(intervals) == workers
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        assert start >= end, intervals  # the next compiled only after the holder was done
    assert len(waits) == workers - 1


def test_racing_workers_on_a_local_folder_compile_one_at_a_time(tmp_path):
    leases = cl.LocalLeases(str(tmp_path))
    _assert_one_at_a_time(*_race(leases))
    assert os.listdir(tmp_path / cl.LEASES) == []  # every lease was removed


def test_waiting_is_logged_once_with_the_holder(tmp_path, caplog):
    leases = cl.LocalLeases(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="model.engine.compile_lease"):
        _race(leases, hold_s=0.5)
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert len(waiting) == 1 and f"pid {os.getpid()}" in waiting[0], waiting


def _foreign_lease(leases, key, *, host="another-host", pid=1, age_s=0.0):
    holder = cl.Holder(host, pid, time.time() - age_s, "theirs")
    assert leases.create(key, holder) is not None
    path = os.path.join(leases.folder, key + ".lease")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_stale_lease_is_taken_over(tmp_path):
    leases = cl.LocalLeases(str(tmp_path))
    path = _foreign_lease(leases, "k", age_s=120)
    waits = []
    start = time.monotonic()
    assert cl.compile_with_lease(lambda: os.path.exists(path), "k", leases, stale_after=60, poll_s=0.05,
                                 on_wait=lambda: waits.append(1))  # compiled holding the lease (now ours)
    assert time.monotonic() - start < 5 and not waits and not os.path.exists(path)


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leases = cl.LocalLeases(str(tmp_path))
    _foreign_lease(leases, "k", host=socket.gethostname(), pid=int(dead.stdout))
    waits = []
    assert cl.compile_with_lease(lambda: 1, "k", leases, poll_s=0.05, on_wait=lambda: waits.append(1)) == 1
    assert not waits


def test_the_wait_is_bounded(tmp_path, caplog):
    leases = cl.LocalLeases(str(tmp_path))
    path = _foreign_lease(leases, "k")  # a live holder on another host that never finishes
    with caplog.at_level(logging.WARNING, logger="model.engine.compile_lease"):
        assert cl.compile_with_lease(lambda: 2, "k", leases, max_wait=0.3, poll_s=0.05) == 2
    assert os.path.exists(path)  # not ours to remove
    assert any("compiling it here too" in r.getMessage() for r in caplog.records)


def test_the_lease_is_removed_when_compiling_fails(tmp_path):
    leases = cl.LocalLeases(str(tmp_path))

    def fail():
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cl.compile_with_lease(fail, "k", leases)
    assert leases.read("k") is None


def test_a_holder_never_removes_a_lease_taken_over_from_it(tmp_path):
    leases = cl.LocalLeases(str(tmp_path))
    mine = leases.create("k", cl.Holder.me())
    os.unlink(os.path.join(leases.folder, "k.lease"))  # as a takeover does, then the new holder creates it
    time.sleep(0.01)
    assert leases.create("k", cl.Holder("other", 2, time.time())) is not None
    assert not leases.remove("k", mine)
    assert leases.read("k").holder.host == "other"


def test_cache_dir_is_jaxs_setting(tmp_path):
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    try:  # whatever an earlier test of this process set, JAX's current setting is what counts
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
        jax.config.update("jax_enable_compilation_cache", True)
        assert cl.cache_dir() == str(tmp_path / "jax")
        jax.config.update("jax_enable_compilation_cache", False)
        assert cl.cache_dir() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])


def test_compile_lowered_takes_a_lease_only_with_a_cache(tmp_path, monkeypatch):
    lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((3,), jnp.float32))
    taken = []
    real_create = cl.LocalLeases.create
    monkeypatch.setattr(cl.LocalLeases, "create", lambda self, key, holder: taken.append(self.folder)
                        or real_create(self, key, holder))
    monkeypatch.setattr(cl, "cache_dir", lambda: None)
    cl.compile_lowered(lowered, jax.devices()[:1])
    assert taken == []
    monkeypatch.setattr(cl, "cache_dir", lambda: str(tmp_path))
    cl.compile_lowered(lowered, jax.devices()[:1])
    assert taken == [str(tmp_path / cl.LEASES)] and os.listdir(tmp_path / cl.LEASES) == []


def test_gcs_leases_are_created_if_absent_and_removed_by_generation(gcs_emulator, gcs_bucket):
    leases = cl.leases_for(f"gs://{gcs_bucket}/xla")
    assert isinstance(leases, cl.GcsLeases)
    mine = leases.create("k", cl.Holder.me())
    assert mine is not None and leases.create("k", cl.Holder("other", 2, time.time())) is None  # 412: held
    found = leases.read("k")
    assert found.holder.pid == os.getpid() and found.tag == mine and found.age_s < 60
    assert not leases.remove("k", mine + 1)  # another generation: not this lease
    assert leases.remove("k", mine) and leases.read("k") is None
    assert gcs_emulator.list_blobs(f"gs://{gcs_bucket}/xla/{cl.LEASES}/") == {}


def test_racing_workers_on_gcs_compile_one_at_a_time(gcs_emulator, gcs_bucket):
    _assert_one_at_a_time(*_race(cl.leases_for(f"gs://{gcs_bucket}/xla")))
