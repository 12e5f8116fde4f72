"""One job per output at a time (pipeline/output_lease.py), on a local folder and on the GCS emulator: a second launch
stops naming the job that holds the output unless its lease is stale (process gone, heartbeat stopped, Dataflow job
ended); leftovers of earlier runs are removed only when their maker is gone or they are old; a job's own temporary
folders are removed by itself, and its lease at its end, also when it fails. The job-level checks (two real jobs on one
output, Ctrl-C) are at the end."""

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from model.engine.compile_lease import Holder
from pipeline import output_lease as ol
from pipeline.errors import UsageError
from pipeline_helpers import MODEL_ARGS, ckpt32, image_names, output, rows, wait_for_images  # noqa: F401 - fixtures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def _exists(path: str) -> bool:
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.exists(path)


def _plant(output: str, holder: Holder) -> None:
    """A lease left there by `holder` (another launch, maybe long gone)."""
    assert ol.lease_store(output).create(ol.LEASE_KEY, holder) is not None


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_second_launch_is_refused_naming_the_job_until_the_first_releases(output):
    first = ol.take_output_lease(output, job="job-one")
    assert first.tag is not None and _exists(first.path)
    with pytest.raises(UsageError, match=r"being written by another job: job job-one, pid \d+ on .*delete .*"
                                         r"\.flux2-job\.lease"):
        ol.take_output_lease(output, job="job-two")
    assert first.release() and not _exists(first.path)
    second = ol.take_output_lease(output, job="job-two")
    assert second.previous_gone and second.release()


def test_a_lease_whose_process_is_gone_is_taken_over_at_once(output):
    _plant(output, dataclasses.replace(Holder.me(job="killed"), pid=_dead_pid()))
    lease = ol.take_output_lease(output, job="resume")
    assert lease.previous_gone and lease.release()


def test_a_lease_of_another_machine_is_held_until_its_heartbeat_stops(output):
    elsewhere = dataclasses.replace(Holder.me(job="remote", stale_after=1.5), host="another-machine")
    _plant(output, elsewhere)
    with pytest.raises(UsageError, match="job remote, pid .* on another-machine"):
        ol.take_output_lease(output, job="mine")
    time.sleep(2.0)  # no refresh for longer than the holder's stale limit
    lease = ol.take_output_lease(output, job="mine")
    assert not lease.previous_gone  # it may still live: only old leftovers are its
    assert lease.release()


def test_the_heartbeat_keeps_a_running_jobs_lease_fresh(output):
    lease = ol.take_output_lease(output, job="long", stale_after=1.0)
    lease.start_heartbeat(period_s=0.2)
    try:
        time.sleep(2.0)  # twice the stale limit: only the heartbeat keeps it
        with pytest.raises(UsageError, match="job long"):
            ol.take_output_lease(output, job="second", job_state=lambda *a: None)
        found = ol.lease_store(output).read(ol.LEASE_KEY)
        assert found.age_s < 1.0
    finally:
        assert lease.release()
    assert not _exists(lease.path)


def test_a_dataflow_jobs_lease_lasts_while_dataflow_says_it_runs(output):
    lease = ol.take_output_lease(output, job="launch")
    lease.start_heartbeat(period_s=0.2)
    lease.hand_to_job("2026-01-01_00_00_00-123", "dataflow:proj/europe-west4")
    time.sleep(0.5)  # the launcher's heartbeat stopped with the hand-over
    holder = ol.lease_store(output).read(ol.LEASE_KEY).holder
    assert (holder.job, holder.runner, holder.stale_after) == ("2026-01-01_00_00_00-123", "dataflow:proj/europe-west4",
                                                               ol.DATAFLOW_STALE_AFTER_S)
    asked = []
    with pytest.raises(UsageError, match="Dataflow job 2026-01-01_00_00_00-123 in proj/europe-west4"):
        ol.take_output_lease(output, job="x", job_state=lambda runner, job: asked.append((runner, job)) or True)
    with pytest.raises(UsageError, match="Dataflow job"):  # Dataflow cannot be asked: held for the long limit
        ol.take_output_lease(output, job="x", job_state=lambda runner, job: None)
    assert asked == [("dataflow:proj/europe-west4", "2026-01-01_00_00_00-123")]
    # The job's last step removes it, and only its own lease.
    ol.release_from_job({}, output, "someone else's token")
    assert _exists(lease.path)
    ol.release_from_job({}, output, lease.holder.token)
    assert not _exists(lease.path)
    # An ended job's lease is taken over at once.
    lease.tag = ol.lease_store(output).create(ol.LEASE_KEY, lease.holder)
    taken = ol.take_output_lease(output, job="next", job_state=lambda runner, job: False)
    assert taken.previous_gone and taken.release()


def test_a_remote_jobs_last_step_releases_its_lease(tiny_ckpt, tmp_path):
    """The step a submitted job runs after its summary (the launcher does not wait for the end): wired after the
    summary and picklable for the workers."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.graph import build_pipeline
    from pipeline.launch import resolve_job

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    job = resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}", f"--output={tmp_path / 'out'}"]))
    labels = {}
    for token in (None, "the-token"):
        p = beam.Pipeline(options=PipelineOptions([]))
        build_pipeline(p, job, started_at=0.0, release_lease=token)
        labels[token] = {t.unique_name for t in p.to_runner_api().components.transforms.values()}
    assert "ReleaseOutputLease" in labels["the-token"] and "ReleaseOutputLease" not in labels[None]


def _make(path: str, data: bytes = b"x") -> None:
    from apache_beam.io.filesystems import FileSystems

    if "://" not in path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with FileSystems.create(path) as f:
        f.write(data)


def _temp_folders(output):
    return sorted(ol._temp_folders(output))


def test_leftovers_are_removed_only_when_their_maker_is_gone(output):
    join = (lambda *p: "/".join((output,) + p)) if "://" in output else (lambda *p: os.path.join(output, *p))
    local = "://" not in output
    # A holder on another machine that stopped refreshing its lease: it may still live (suspended, say), so only
    # what has not changed for its stale limit is surely not its work in progress.
    _plant(output, dataclasses.replace(Holder.me(job="hung", stale_after=2.0), host="elsewhere"))
    _make(join("manifest", "beam-temp-manifest-aaa", "part-0"))
    if local:  # an atomic write's leftover, and an image
        _make(join("images", ".a.png.k2j4h_9x.tmp"))
        _make(join("images", "a.png"))
    time.sleep(2.5)
    _make(join("beam-temp-summary-bbb", "part-0"))  # written just now
    lease = ol.take_output_lease(output, job="next")
    assert not lease.previous_gone
    lease.clear_leftovers()
    after = _temp_folders(output)
    assert len(after) == 1 and "beam-temp-summary-bbb" in after[0], after  # the old one removed, the young kept
    if local:
        assert sorted(os.listdir(join("images"))) == ["a.png"]  # the old .tmp removed, the image kept
    # This run's own temporary folder is removed by itself; the one it found is not its to remove.
    _make(join("errors", "beam-temp-errors-ccc", "part-0"))
    assert lease.remove_own_temp() == 1
    assert _temp_folders(output) == after
    lease.release()
    # The next launch finds no lease: the previous holder released it, so whatever is left is no one's.
    again = ol.take_output_lease(output, job="later")
    assert again.previous_gone and again.clear_leftovers() == 1 and _temp_folders(output) == []
    again.release()


def test_the_launch_holds_the_output_while_it_runs_and_leaves_it_as_it_ends(tmp_path):
    """pipeline/launch.py holding_output: the lease is taken before the output is checked and released at the end;
    a failure (any exception, Ctrl-C included) removes this run's temporary folders and says how many; a submitted
    job keeps the lease, named by its id, for its last step to remove."""
    import types

    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline import launch

    out = tmp_path / "out"
    job = types.SimpleNamespace(spec=types.SimpleNamespace(output=types.SimpleNamespace(output=str(out),
                                                                                        skip_existing=False)),
                                run_token="0123456789abcdef")
    hold = dict(overwrite=False, demo_default_output=False)
    with launch.holding_output(job, **hold) as held:
        assert _exists(held.lease.path) and held.replacing is None and held.lease.holder.job == "0123456789ab"
    assert not _exists(held.lease.path)

    (out / "beam-temp-found-aaa").mkdir()  # an earlier run's leftover, removed at launch: not counted as its own
    with pytest.raises(KeyboardInterrupt):
        with launch.holding_output(job, **hold) as held:
            (out / "manifest" / "beam-temp-manifest-bbb").mkdir(parents=True)
            raise KeyboardInterrupt
    assert launch.CLEANUP == {"temp_removed": 1, "output": str(out)} and not _exists(held.lease.path)
    assert _temp_folders(str(out)) == []

    options = PipelineOptions(["--project=proj", "--region=europe-west4", "--job_name=named"])
    with launch.holding_output(job, **hold) as held:
        held.hand_to_job("2026-01-01_00_00_00-123", options)
    holder = ol.lease_store(str(out)).read(ol.LEASE_KEY).holder
    assert (holder.job, holder.runner) == ("2026-01-01_00_00_00-123", "dataflow:proj/europe-west4")
    ol.release_from_job(None, str(out), holder.token)
    with launch.holding_output(job, **hold) as held:
        held.hand_to_job(None, options)  # no job id from the runner: the job's name
    assert ol.lease_store(str(out)).read(ol.LEASE_KEY).holder.job == "named"


# --------------------------------------------------------------------------------------------- real jobs
def _argv(ckpt, source, out, *extra):
    return [sys.executable, "-m", "pipeline.run", f"--model={ckpt}", f"--input={source}", f"--output={out}",
            *MODEL_ARGS, "--runner=FnApiRunner", "--no_progress", *extra]


def test_two_jobs_on_one_output(ckpt32, tmp_path):
    """The second launch stops at once naming the running job, and touches nothing of it: the first finishes with
    every image generated once; after it, the second resumes (nothing to do) and removes an old .tmp leftover."""
    from pipeline.run import run

    n = 600  # enough that the first job is still generating (not yet finalizing its writes) under load
    source = tmp_path / "prompts.txt"
    source.write_text("".join(f"prompt number {i}\n" for i in range(n)))
    out = tmp_path / "out"
    first = subprocess.Popen(_argv(ckpt32, source, out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_for_images(first, out, 2)
        assert first.poll() is None, "the first job ended before the second was launched"
        temp = sorted(ol._temp_folders(str(out)))
        with pytest.raises(UsageError, match=rf"^--output={str(out)!r} is being written by another job: job \w+, "
                                             rf"pid {first.pid} on "):
            run(_argv(ckpt32, source, out, "--skip_existing")[3:])
        assert first.poll() is None, "the first job ended while the second was launched: the check proved nothing"
        assert set(temp) <= set(ol._temp_folders(str(out)))  # the running job's temporary folders are untouched
        _, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr[-3000:]
    assert len(rows(str(out), "manifest")) == n and len(image_names(str(out))) == n  # each image generated once
    assert not os.path.exists(out / ".flux2-job.lease")
    # After it: a killed run's atomic-write leftover is removed by the next run on the output.
    leftover = out / "images" / ".prompt.png.abcd_123.tmp"
    leftover.write_bytes(b"half an image")
    _, summary = run(_argv(ckpt32, source, out, "--skip_existing")[3:])
    assert summary["skipped"] == n and summary["images_generated"] == 0
    assert not leftover.exists() and not os.path.exists(out / ".flux2-job.lease")


def test_a_run_killed_before_its_first_image_leaves_nothing_that_blocks_the_next(ckpt32, tmp_path):
    """All such a run left is an atomic write's `.tmp` file: the next run removes it, and needs no --skip_existing
    (the output holds no result)."""
    from pipeline.run import run

    source = tmp_path / "p.txt"
    source.write_text("a prompt\n")
    out = tmp_path / "out"
    (out / "images").mkdir(parents=True)
    leftover = out / "images" / ".x.png.abcd_123.tmp"
    leftover.write_bytes(b"half an image")
    _, summary = run(_argv(ckpt32, source, out)[3:])
    assert summary["images_generated"] == 1 and not leftover.exists()


def test_a_failed_run_releases_its_lease_and_removes_its_temporary_folders(ckpt32, tmp_path, monkeypatch):
    """A model that cannot be loaded on the worker (its weights cut after the launch checked them): exit 2, no lease,
    no temporary folder left."""
    import shutil

    from pipeline import run as run_module

    ckpt = shutil.copytree(ckpt32, tmp_path / "ckpt")
    source = tmp_path / "p.txt"
    source.write_text("a prompt\n")
    out = tmp_path / "out"
    argv = [f"--model={ckpt}", f"--input={source}", f"--output={out}", *MODEL_ARGS, "--runner=FnApiRunner",
            "--no_progress"]
    original = run_module._run_holding

    def cut_weights_then_run(*args, **kwargs):  # the launch checked the weights; they change before the load
        for top, _dirs, names in os.walk(ckpt):
            for name in names:
                if name.endswith(".safetensors"):
                    with open(os.path.join(top, name), "r+b") as f:
                        f.truncate(100)
        return original(*args, **kwargs)

    monkeypatch.setattr(run_module, "_run_holding", cut_weights_then_run)
    with pytest.raises(UsageError, match="could not be loaded"):
        run_module.run(argv)
    assert not os.path.exists(out / ".flux2-job.lease")
    assert not [d for d, dirs, _ in os.walk(out) for n in dirs if n.startswith("beam-temp-")]


def test_answers_lost_on_the_way_back_never_make_a_launch_refuse_itself(gcs_emulator, monkeypatch):
    """GCS applied the write but its answer was lost: the client's retry meets its own lease (a 412, a 404), which is
    this launch's, not another job's: taken, refreshed and released all the same."""
    from fault_proxy import FaultProxy, FaultRule

    output = f"gs://{gcs_emulator.new_bucket()}/out"

    def lose_one(kind):
        return FaultRule(fraction=1.0, kinds={kind}, name=r"\.flux2-job\.lease", actions=("reset_after",), limit=1)

    create, refresh, delete = lose_one("upload"), lose_one("upload"), lose_one("delete")
    with FaultProxy(gcs_emulator.host, seed=3, rules=[create]) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        lease = ol.take_output_lease(output, job="one")
        assert lease.tag is not None and create.injected == 1
        proxy.add_rule(refresh)
        lease.start_heartbeat(period_s=0.2)
        deadline = time.time() + 30
        while refresh.injected == 0 and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # the refresh retried, and later ones passed
        found = ol.lease_store(output).read(ol.LEASE_KEY)
        assert refresh.injected == 1 and lease.tag is not None
        assert found.holder.token == lease.holder.token and found.age_s < 1.0
        proxy.add_rule(delete)
        assert lease.release() and delete.injected == 1
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.host)
    assert not _exists(lease.path)
