"""The whole job under injected faults, on the local GCS emulator, with the end-to-end tests' tiny checkpoint, image shape
and XLA cache (tests/support/pipeline_helpers.py: 32x64, the checkpoint's 4 steps).

(a) + (e) Inference raises in some bundles (transient) and always for one shape bucket (out-of-memory-like).
    Without retries the failed images land in the errors output (one row each, with the exception), every other
    request is complete, the other bucket is unaffected, nothing partial is written; a `--skip_existing` rerun
    (with retries) fills in exactly the transiently failed images, never retries the out-of-memory bucket, leaves
    every existing object untouched, and its manifest-* + existing-* list every image once; every image equals
    the bytes of a standalone `generate` for that image. With the job's in-job retries, random transient faults
    cost nothing: one run, every image, the retries reported in summary.json.
(b) GCS flaky: all GCS traffic (prompt reads, listings, image uploads, manifest finalisation) goes through our
    fault proxy at 10%: the job completes with nothing lost, every injected fault was retried, and summary.json
    reports the client's retries. At a fault rate
    the client cannot overcome, the job fails with a clear error and writes no summary claiming completeness.
    The gs:// checkpoint copy rides over the same fault rate.
(c) SIGKILL half way (`python -m pipeline.run` in a subprocess) and rerun with `--skip_existing`: the union of
    outputs is complete and byte-identical to an uninterrupted run; the killed run left no partial object.
(d) A broken gs:// checkpoint (truncated shard, shard missing, wrong dtype, checksum mismatch, corrupted
    config.json) fails fast, before any image is generated, with an error naming the file; through the job too.

Runs reuse one in-process model (tests/support/fault_jobs.py CachedHandler) except (c)'s subprocess and (d), which load for
real.
All of them run in CI (the 5,000-request soak, tests/pipeline/test_soak.py, is the only slow-marked fault test).
In-process runs use Beam's own GCS retry policy with short back-off (fault_jobs.fast_gcs_retries).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

import fault_jobs
from fault_jobs import FaultyHandler, JobOutputs, expected_png, install_handler, sha256
from fault_proxy import FaultProxy, FaultRule, data_path_faults, in_front_of
from pipeline.run import run
# The end-to-end tests' checkpoint, image shape and persistent XLA cache: the session compiles the job's programs once.
from pipeline_helpers import HEIGHT, WIDTH, ckpt32, xla_cache  # noqa: F401 - ckpt32 and xla_cache are fixtures
from transforms import layout
from transforms.inputs.readers import parse_lines
from transforms.inputs.validation import RequestDefaults
from transforms.requests import GenerationRequest

from paths import REPO  # noqa: E402
SECRET = "SECRET-PROMPT " + "lighthouse " * 20 + "END"
STEPS, SEED = None, 3  # the checkpoint's default steps (4), as in the end-to-end tests

GOOD = [{"id": f"g{i}", "prompt": f"good prompt number {i}"} for i in range(7)] + [
    {"id": "secret", "prompt": SECRET},
    {"id": "multi", "prompt": "two images of a fox", "num_images": 2},
    {"prompt": "a prompt without an id"},
]
DOOMED = [{"id": "tall0", "prompt": "a tall view", "height": 64, "width": 32},
          {"id": "tall1", "prompt": "another", "height": 64, "width": 32}]
DOOMED_SHAPE = "64x32/"
INVALID = ['{"id": "bad-size", "prompt": "x", "height": 7}', "this line is not json",
           '{"id": "evil\\u0000id", "prompt": "x"}']  # an id with NUL: still refused (natural ids allow "../evil")


def _jsonl(records, invalid=()) -> bytes:
    return ("\n".join([json.dumps(r) for r in records] + list(invalid)) + "\n").encode()


def _tasks(records) -> dict:
    """{file_name: ImageTask} of the valid records, parsed exactly as the job parses them."""
    d = RequestDefaults(height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, seed=SEED)
    out = {}
    for r in parse_lines(_jsonl(records), "x.jsonl", "jsonl", d):
        assert isinstance(r, GenerationRequest)
        for t in r.tasks():
            out[t.file_name] = t
    return out


def _argv(model, inp, out, xla, *extra):
    return [f"--model={model}", f"--input={inp}", f"--output={out}", f"--height={HEIGHT}", f"--width={WIDTH}",
            "--dtype=float32", "--max_sequence_length=32", "--batch_size=2",
            f"--seed={SEED}", f"--compilation_cache_dir={xla}", "--runner=FnApiRunner", "--no_progress", *extra]


@pytest.fixture(scope="module")
def loaded(ckpt32, xla_cache):
    """The tiny model, loaded once for this module (the job's runs reuse it through CachedHandler)."""
    return fault_jobs.load_cached(ckpt32, compilation_cache_dir=xla_cache)


@pytest.fixture(scope="module")
def oracle(loaded):
    """{file_name: PNG bytes} every image of GOOD must have, from one standalone generate call per image."""
    return {name: expected_png(loaded, t) for name, t in _tasks(GOOD).items()}


# The job's own files besides the images: manifest, errors, summary, the imagefolder metadata, the preview, the
# near-duplicate groups and the dataset card with its statistics (labels.png only when records have labels).
JOB_FILES = ("manifest/manifest-00000-of-00001.jsonl", "manifest/existing-00000-of-00001.jsonl",
             "errors/errors-00000-of-00001.jsonl", layout.SUMMARY_FILE, layout.METADATA_FILE,
             "preview/index.html", "preview/contact_sheet.jpg", "duplicates/duplicates-00000-of-00001.jsonl",
             "README.md", "card/stats.json", "card/errors.png", "card/labels.png")


def _check_no_partial_objects(outs: JobOutputs, allowed_images: set[str], killed: bool = False):
    """`killed`: a run killed outright leaves its lease on the output (pipeline/output_lease.py), for the next
    launch to take over."""
    names = outs.relnames()
    assert (".flux2-job.lease" in names) == killed
    extra = {n for n in names if not (n in allowed_images or n in JOB_FILES or n == ".flux2-job.lease")}
    assert not extra, f"unexpected objects under the output (partial or temporary): {sorted(extra)}"


def _check_listed_once(outs: JobOutputs, images: dict[str, bytes]):
    """manifest-* (generated by the latest run) and existing-* (found by it) list every image exactly once, each
    row with the sha256 and size of the object."""
    rows = outs.rows("manifest") + outs.rows("existing")
    assert sorted(r["file_name"] for r in rows) == sorted(images)
    for row in rows:
        data = images[row["file_name"]]
        assert (row["sha256"], row["bytes"]) == (sha256(data), len(data)), row["file_name"]


# ================================================================================================ (a) + (e)
def test_inference_faults_go_to_errors_and_a_rerun_completes_the_job(gcs_emulator, gcs_bucket, ckpt32, loaded,
                                                                     oracle, xla_cache, monkeypatch, caplog):
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", _jsonl(GOOD + DOOMED, INVALID))
    outs = JobOutputs(gcs_emulator, f"{b}/out")
    good = set(oracle)
    doomed = set(_tasks(DOOMED))
    fault_jobs.reset_faults()
    # Calls 2 and 5 of this process fail (a bundle lost), and every 64x32 batch fails like an OOM. This run does
    # not retry, so the lost bundles' images become error rows.
    install_handler(monkeypatch, FaultyHandler, fail_calls=(2, 5), doomed_shape=DOOMED_SHAPE)
    caplog.set_level(logging.INFO)
    argv = _argv(ckpt32, f"{b}/in/p.jsonl", outs.output, xla_cache)

    _, summary = run(argv + ["--inference_retries=0"])
    raised = list(fault_jobs.RAISED)
    transient = {n for kind, names in raised if kind == "transient" for n in names}
    assert len([k for k, _ in raised if k == "transient"]) == 2 and transient <= good
    assert {n for kind, names in raised if kind == "oom" for n in names} == doomed

    images = outs.images()
    manifest = outs.rows("manifest")
    errors = outs.rows("errors")
    failed_rows = [e for e in errors if e["kind"] == layout.INFERENCE_FAILED]
    # every image task ends in exactly one place: an image + a manifest row, or an error row
    assert set(images) == good - transient
    assert sorted(r["file_name"] for r in manifest) == sorted(images)
    assert sorted(e["file_name"] for e in failed_rows) == sorted(transient | doomed)
    for row in manifest:
        assert row["sha256"] == sha256(images[row["file_name"]])
        assert images[row["file_name"]] == oracle[row["file_name"]], row["file_name"]
    for e in failed_rows:
        words = "RESOURCE_EXHAUSTED" if e["file_name"] in doomed else "injected transient fault"
        assert words in e["reason"] and e["id"] and e["source"].endswith("p.jsonl"), e
    assert sorted((e["line"], e["kind"]) for e in errors if e["kind"] != layout.INFERENCE_FAILED) == \
        [(len(GOOD) + len(DOOMED) + i + 1, layout.INVALID_RECORD) for i in range(len(INVALID))]
    assert (summary["images_generated"], summary["failed"], summary["invalid"]) == \
        (len(good - transient), len(transient | doomed), len(INVALID))
    assert summary["retries"]["inference"] == 0
    assert outs.rows("existing") == []
    _check_no_partial_objects(outs, set(images))
    leaked = [r.getMessage()[:120] for r in caplog.records if SECRET[:20] in r.getMessage()]  # any level, any cut
    assert not leaked, leaked
    generations = outs.generations()

    # --- rerun with --skip_existing and the default retries: the first call of this run fails once more (and is
    # retried); out-of-memory is never retried as such: a doomed batch runs once, then in halves (each once), and
    # the first single image that still fails ends it.
    fault_jobs.reset_faults()
    install_handler(monkeypatch, FaultyHandler, fail_calls=(1,), doomed_shape=DOOMED_SHAPE)
    _, summary2 = run(argv + ["--skip_existing"])
    raised2 = list(fault_jobs.RAISED)
    assert [k for k, _ in raised2].count("transient") == 1
    oom_attempts = collections.Counter(tuple(names) for kind, names in raised2 if kind == "oom")
    assert set(n for names in oom_attempts for n in names) == doomed
    assert set(oom_attempts.values()) == {1}, oom_attempts  # no batch or part of one was run twice
    images2 = outs.images()
    assert set(images2) == good  # every good image exists exactly once (one object per name)
    assert all(images2[n] == oracle[n] for n in good)  # and has the bytes of an uninterrupted, unbatched run
    after = outs.generations()
    assert {n: after[n] for n in generations} == generations  # nothing written before was rewritten
    manifest2 = outs.rows("manifest")
    assert sorted(r["file_name"] for r in manifest2) == sorted(transient)  # the rerun's manifest: what it generated
    assert (summary2["images_generated"], summary2["skipped"], summary2["failed"]) == \
        (len(transient), len(good - transient), len(doomed))
    assert summary2["retries"]["inference"] == 1
    errors2 = outs.rows("errors")
    assert sorted(e["file_name"] for e in errors2 if e["kind"] == layout.INFERENCE_FAILED) == sorted(doomed)
    _check_no_partial_objects(outs, good)
    # The first run's rows are not lost: existing-* lists what the rerun found, rebuilt from the images, equal to
    # the first run's manifest rows except for the time it took (not measured for an image found).
    existing = {r["file_name"]: r for r in outs.rows("existing")}
    assert set(existing) == good - transient
    for row in manifest:
        assert existing[row["file_name"]] == dict(row, generation_ms=None), row["file_name"]
    _check_listed_once(outs, images2)


def test_in_job_retries_ride_over_random_inference_faults(gcs_emulator, gcs_bucket, ckpt32, loaded, oracle,
                                                          xla_cache, monkeypatch):
    """A third of the calls fail at random (every batch has its own draw on each attempt); three retries: every
    image is generated in one run, with its uninterrupted bytes, listed once; the summary reports the retries."""
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", _jsonl(GOOD))
    outs = JobOutputs(gcs_emulator, f"{b}/out")
    fault_jobs.reset_faults()
    install_handler(monkeypatch, FaultyHandler, fail_calls=(1, 2, 4, 7))
    _, summary = run(_argv(ckpt32, f"{b}/in/p.jsonl", outs.output, xla_cache, "--inference_retries=3"))
    injected = [k for k, _ in fault_jobs.RAISED].count("transient")
    assert injected == 4
    images = outs.images()
    assert images == oracle
    _check_listed_once(outs, images)
    assert outs.rows("errors") == []
    assert (summary["images_generated"], summary["failed"]) == (len(oracle), 0)
    assert summary["retries"]["inference"] == injected
    print(f"\n[fault figures] inference: {injected} transient faults injected, "
          f"{summary['retries']['inference']} batch retries, 0 lost")


# ================================================================================================ (b) flaky GCS
@pytest.fixture
def proxy(gcs_emulator, monkeypatch):
    with in_front_of(gcs_emulator, monkeypatch, seed=11) as p:
        yield p


def _client_retries(caplog) -> int:
    return sum(1 for r in caplog.records if r.name.startswith("google.api_core.retry")
               and r.getMessage().startswith("Retrying due to"))


def test_job_completes_with_nothing_lost_at_10_percent_gcs_faults(gcs_emulator, gcs_bucket, ckpt32, loaded, oracle,
                                                                 xla_cache, proxy, monkeypatch, caplog):
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", _jsonl(GOOD, INVALID))
    outs = JobOutputs(gcs_emulator, f"{b}/out")
    install_handler(monkeypatch)
    fault_jobs.fast_gcs_retries(monkeypatch)
    # 10% of every kind of request; plus one guaranteed fault on each rare kind (manifest finalisation is a
    # handful of requests per run, which a 10% draw could miss).
    proxy.set_rules([FaultRule(fraction=1.0, kinds={"read"}, name=r"/in/p\.jsonl$", limit=1, actions=("429",)),
                     FaultRule(fraction=1.0, kinds={"batch"}, limit=1, actions=("503",)),
                     FaultRule(fraction=1.0, kinds={"list"}, limit=1, actions=("reset",)),
                     FaultRule(fraction=0.10, actions=("503", "429", "reset", "delay"), delay_s=0.2)])
    caplog.set_level(logging.DEBUG, logger="google.api_core.retry")
    result, summary = run(_argv(ckpt32, f"{b}/in/p.jsonl", outs.output, xla_cache))
    stats = proxy.stats()
    proxy.clear_rules()

    images = outs.images()
    assert images == oracle  # nothing lost, nothing different
    manifest = outs.rows("manifest")
    assert sorted(r["file_name"] for r in manifest) == sorted(oracle)
    assert all(r["sha256"] == sha256(images[r["file_name"]]) for r in manifest)
    assert len(outs.rows("errors")) == len(INVALID)
    assert (summary["images_generated"], summary["failed"], summary["invalid"]) == (len(oracle), 0, len(INVALID))
    _check_no_partial_objects(outs, set(oracle))
    failing, retried, unretried = data_path_faults(stats)
    assert failing >= 4 and all(stats["injected_by_kind"].get(k, 0) >= 1 for k in ("read", "list", "batch")), stats
    assert unretried == [] and retried >= failing, stats
    client_retries = _client_retries(caplog)
    assert client_retries >= 1
    # the job reports the retries its GCS client made (at least those inside its bundles)
    assert 1 <= summary["retries"]["gcs"] <= client_retries, (summary["retries"], client_retries)
    assert outs.summary()["retries"] == summary["retries"]
    throttled = sum(c.committed for c in result.metrics().query()["counters"]
                    if c.key.metric.name == "cumulativeThrottlingSeconds")
    print(f"\n[fault figures] 10% GCS faults: {json.dumps(stats)}; client retry log lines {client_retries}; "
          f"beam gcsio cumulativeThrottlingSeconds {throttled}")


def test_job_fails_clearly_when_gcs_faults_cannot_be_overcome(gcs_emulator, gcs_bucket, ckpt32, loaded, xla_cache,
                                                              proxy, monkeypatch):
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", _jsonl([GOOD[7]] + GOOD[:3]))
    outs = JobOutputs(gcs_emulator, f"{b}/out")
    install_handler(monkeypatch)
    fault_jobs.fast_gcs_retries(monkeypatch, timeout=4.0)  # the client's retry budget, shortened for CI
    proxy.set_rules([FaultRule(fraction=1.0, kinds={"upload"}, name=r"/out/images/", actions=("503",))])
    start = time.monotonic()
    with pytest.raises(Exception) as e:
        run(_argv(ckpt32, f"{b}/in/p.jsonl", outs.output, xla_cache))
    elapsed = time.monotonic() - start
    message = f"{type(e.value).__name__}: {e.value}"
    proxy.clear_rules()
    assert any(w in message for w in ("503", "ServiceUnavailable", "RetryError", "Timeout")), message[:2000]
    assert "images/" in message or "WriteImages" in message, message[:2000]
    assert outs.summary() is None  # no summary claiming a complete job
    assert not outs.rows("manifest")
    assert not outs.images()
    assert proxy.stats()["injected_by_kind"]["upload"] >= 2
    print(f"\n[fault figures] unrecoverable image uploads: failed after {elapsed:.1f} s, "
          f"{proxy.stats()['injected_by_kind']['upload']} upload faults; error: {message[:300]!r}")
    assert SECRET not in message  # the failure names the stage and the object, never quotes a prompt


def test_gcs_checkpoint_copy_rides_over_10_percent_faults(gcs_emulator, gcs_bucket, ckpt32, proxy, tmp_path):
    from model.loading import checkpoint

    uri = f"gs://{gcs_bucket}/models/tiny"
    gcs_emulator.upload_dir(ckpt32, uri)
    proxy.set_rules([FaultRule(fraction=0.10, kinds={"read", "list"}, actions=("503", "429", "reset", "delay"),
                               delay_s=0.1),
                     FaultRule(fraction=1.0, kinds={"read"}, name=r"safetensors$", limit=2, actions=("503",))])
    path = checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "cache"))
    stats = proxy.stats()
    for root, _dirs, files in os.walk(ckpt32):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), ckpt32)
            with open(os.path.join(root, name), "rb") as a, open(os.path.join(path, rel), "rb") as c:
                assert a.read() == c.read(), rel
    assert stats["injected_by_kind"].get("read", 0) >= 2 and data_path_faults(stats)[2] == [], stats
    print(f"\n[fault figures] checkpoint copy at 10%: {json.dumps(stats)}")


# ================================================================================================ (c) SIGKILL
# ~55 s (the subprocess imports Beam and JAX and loads the model for real before it can be killed): kept in CI, the
# only test of a hard kill and its resume.
def test_sigkill_half_way_then_skip_existing_rerun_is_complete_and_identical(gcs_emulator, gcs_bucket, ckpt32,
                                                                            loaded, oracle, xla_cache, monkeypatch):
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", _jsonl(GOOD, INVALID))
    outs = JobOutputs(gcs_emulator, f"{b}/out")
    total = len(oracle)
    argv = _argv(ckpt32, f"{b}/in/p.jsonl", outs.output, xla_cache)
    # Image uploads are slowed (0.6 s each) by the proxy so that "half way" lasts long enough to be hit.
    with FaultProxy(gcs_emulator.host, seed=5,
                    rules=[FaultRule(fraction=1.0, kinds={"upload"}, name=r"/out/images/", actions=("delay",),
                                     delay_s=0.6)]) as slow:
        env = dict(os.environ, STORAGE_EMULATOR_HOST=slow.url, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.run", *argv], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        seen, deadline = 0, time.monotonic() + 300
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                seen = len([n for n in outs.relnames() if n.startswith("images/")])
                if seen >= total // 3:
                    break
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the job's whole process group, started above
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, err[-3000:])
        killed = outs.images()
        assert total // 3 <= len(killed) < total, (len(killed), total)
        for name, data in killed.items():  # whatever the killed run left is complete and final
            assert data == oracle[name], name
        _check_no_partial_objects(outs, set(killed), killed=True)
        assert outs.summary() is None and not outs.rows("manifest")
        before = outs.generations()

        # The rerun reads the killed run's images back; the emulator serves them through the proxy that wrote them
        # (their media links name it), so it stays up, without its delays.
        slow.clear_rules()
        install_handler(monkeypatch)
        _, summary = run(argv + ["--skip_existing"])
        images = outs.images()
        assert images == oracle  # the union is complete and byte-identical to an uninterrupted run
        after = outs.generations()
        assert {n: after[n] for n in before} == before
        assert (summary["skipped"], summary["images_generated"]) == (len(killed), total - len(killed))
        _check_no_partial_objects(outs, set(oracle))
        manifest, existing = outs.rows("manifest"), outs.rows("existing")
        assert sorted(r["file_name"] for r in existing) == sorted(killed)  # the killed run's images are listed too
        _check_listed_once(outs, images)
        print(f"\n[fault figures] SIGKILL after {len(killed)}/{total} images; rerun generated "
              f"{summary['images_generated']}, skipped {summary['skipped']}; rows after rerun: "
              f"manifest {len(manifest)}, existing {len(existing)}")


# ================================================================================================ (d) broken checkpoint
def _shards(folder_uri_rel: dict, component: str) -> list[str]:
    return sorted(n for n in folder_uri_rel if n.startswith(component + "/") and n.endswith(".safetensors"))


def _edit_header_dtype(data: bytes, tensor_index: int = 0) -> bytes:
    """The same safetensors bytes with one tensor's dtype F32 -> I32 (same size, so only the dtype is wrong)."""
    import struct

    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = sorted(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")[tensor_index]
    header[name]["dtype"] = "I32"
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    return data[:8] + raw + b" " * (n - len(raw)) + data[8 + n:]


BROKEN = ["truncated_shard", "missing_shard", "wrong_dtype", "checksum_mismatch", "corrupted_config"]


@pytest.fixture(scope="module")
def uploaded_ckpt(gcs_emulator, ckpt32):
    """The tiny checkpoint's files, {relative name: bytes}."""
    files = {}
    for root, _dirs, names in os.walk(ckpt32):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, ckpt32).replace(os.sep, "/")] = f.read()
    return files


def _broken_checkpoint(gcs_emulator, bucket: str, files: dict, kind: str) -> tuple[str, str]:
    """Upload a copy of the checkpoint broken in one way; returns (uri, the object name the error must name)."""
    uri = f"gs://{bucket}/models/{kind}"
    files = dict(files)
    vae = _shards(files, "vae")[-1]            # the last component the loader reads
    transformer = _shards(files, "transformer")[-1]
    if kind == "truncated_shard":
        files[vae] = files[vae][: len(files[vae]) // 2]
        named = vae
    elif kind == "missing_shard":
        del files[transformer]
        named = transformer
    elif kind == "wrong_dtype":
        files[transformer] = _edit_header_dtype(files[transformer])
        named = transformer
    elif kind == "corrupted_config":
        files["transformer/config.json"] = b'{"num_layers": 1, '
        named = "transformer/config.json"
    else:
        named = vae
    for rel, data in files.items():
        gcs_emulator.upload_bytes(f"{uri}/{rel}", data)
    if kind == "checksum_mismatch":  # bytes change behind GCS's back: its crc32c/md5 describe the old bytes
        data = bytearray(files[vae])
        data[len(data) // 2] ^= 0xFF
        gcs_emulator.corrupt_object(f"{uri}/{vae}", bytes(data))
    return uri, named


# The loader reads components one after the other, so a broken transformer or VAE shard is only found after the
# earlier components are built (~7-11 s here); every variant still runs in CI.
@pytest.mark.parametrize("kind", BROKEN)
def test_broken_gcs_checkpoint_fails_fast_naming_the_file(gcs_emulator, gcs_bucket, uploaded_ckpt, kind, tmp_path):
    """What every worker runs first: the job's handler loading a gs:// checkpoint."""
    import model
    from transforms.inference import Flux2KleinModelHandler

    uri, named = _broken_checkpoint(gcs_emulator, gcs_bucket, uploaded_ckpt, kind)
    handler = Flux2KleinModelHandler(uri, dtype="float32", max_sequence_length=32, batch_size=2,
                                     load_kwargs={"cache_dir": str(tmp_path / "cache")})
    start = time.monotonic()
    with pytest.raises(model.ModelError) as e:
        handler.load_model()
    elapsed = time.monotonic() - start
    message = str(e.value)
    assert named.rsplit("/", 1)[-1] in message, message
    words = {"truncated_shard": "truncated", "missing_shard": "missing", "wrong_dtype": "dtype",
             "checksum_mismatch": "checksum mismatch", "corrupted_config": "JSON"}[kind]
    assert words in message, message
    if kind == "checksum_mismatch":
        assert f"{uri}/{named}" in message  # the gs:// object, before anything is loaded
    assert elapsed < 60, elapsed
    print(f"\n[fault figures] broken checkpoint {kind}: {type(e.value).__name__} after {elapsed:.1f} s: "
          f"{message[:200]}")


def test_broken_checkpoint_fails_the_job_before_any_image(gcs_emulator, gcs_bucket, uploaded_ckpt, xla_cache,
                                                          tmp_path):
    b = f"gs://{gcs_bucket}"
    # The checksum variant: the job-level facts (fails, names the object, writes nothing) are the same for every
    # variant, and this one fails within seconds (the variants above show the others' timings).
    uri, named = _broken_checkpoint(gcs_emulator, gcs_bucket, uploaded_ckpt, "checksum_mismatch")
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", _jsonl(GOOD[:3]))
    outs = JobOutputs(gcs_emulator, f"{b}/out")
    start = time.monotonic()
    with pytest.raises(Exception) as e:
        run(_argv(uri, f"{b}/in/p.jsonl", outs.output, xla_cache, f"--checkpoint_cache_dir={tmp_path}"))
    elapsed = time.monotonic() - start
    message = f"{type(e.value).__name__}: {e.value}"
    assert "CheckpointError" in message and "checksum mismatch" in message and f"{uri}/{named}" in message, \
        message[:2000]
    assert not outs.relnames(), sorted(outs.relnames())  # no image, manifest, errors or summary
    print(f"\n[fault figures] job with a corrupted gs:// shard failed after {elapsed:.1f} s, nothing written")
