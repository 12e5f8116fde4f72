"""Every sink (transforms/sinks/) behaves the same around the job's one generation stage: the same job, once per
--output_format, with reference images, a transient inference fault and a shape bucket that never fits, gives
- references: the same manifest rows, `reference_images` included (the WebDataset rows and KEY.json too);
- retries: the failed call run again (`inference_retries`), every image still made;
- metrics: the same counters of the job's namespace and RunInference's own, the same summary figures;
- dead letters: the same error row for the batch that never fits (and, WebDataset, its failed sidecar row).
Only where the images are stored differs (file_name, uri, key). In-process on the cached tiny model
(tests/support/fault_jobs.py), local outputs.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import pytest

import fault_jobs
from fault_jobs import FaultyHandler, install_handler
from pipeline.run import run
from pipeline_helpers import HEIGHT, WIDTH, ckpt32, counters, rows, xla_cache  # noqa: F401 - fixtures
from reference_files import png
from transforms import shards
from transforms.sinks.registry import OUTPUT_FORMATS

RECORDS = [
    {"id": "ref-a", "prompt": "the fox, edited", "seed": 1, "reference_images": ["refs/a.png"]},
    {"id": "ref-two", "prompt": "a fox and a hat", "seed": 2, "reference_images": ["refs/a.png", "refs/c.png"],
     "num_images": 2},
    {"id": "plain", "prompt": "no references", "seed": 3, "lang": "en"},
    {"id": "tall", "prompt": "a tall view", "height": 64, "width": 32},  # FaultyHandler's doomed bucket
]
IMAGES = 4  # ref-a, ref-two x2, plain
WHERE = ("file_name", "uri", "key", "generation_ms")  # what differs by sink (and the time each image took)


@pytest.fixture(scope="module")
def loaded(ckpt32, xla_cache):
    return fault_jobs.load_cached(ckpt32, compilation_cache_dir=xla_cache)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sinks-in")
    (folder / "refs").mkdir()
    (folder / "refs" / "a.png").write_bytes(png(64, 64, seed=1))
    (folder / "refs" / "c.png").write_bytes(png(80, 64, seed=2, mode="RGBA"))
    (folder / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return folder


def _job(fmt: str, inputs, out, ckpt, xla, monkeypatch):
    fault_jobs.reset_faults()
    install_handler(monkeypatch, FaultyHandler, fail_calls=(1,), doomed_shape="64x32/")
    return run([f"--model={ckpt}", f"--input={inputs / 'p.jsonl'}", f"--output={out}", f"--height={HEIGHT}",
                f"--width={WIDTH}", "--dtype=float32", "--max_sequence_length=32", "--batch_size=2",
                "--inference_retries=1", f"--compilation_cache_dir={xla}", "--runner=FnApiRunner", "--no_progress",
                f"--output_format={fmt}", "--samples_per_shard=2", "--preview=0"])


def _metrics(result) -> dict:
    """Counters of the job's namespace and of RunInference's, but those of the process rather than the job: per
    process, the model's loads and the processes that loaded it (the cached model's, reported by the first job in
    this process) and XLA's compiles (an earlier job warmed the cache)."""
    got = {f"flux2/{k}": v for k, v in counters(result).items()
           if not k.startswith(("xla_", "model_loads", "processes_with_model"))}
    got.update({f"RunInference/{k}": v for k, v in counters(result, "RunInference_flux2").items()})
    return got


@pytest.fixture(scope="module")
def sink_jobs(ckpt32, loaded, xla_cache, inputs, tmp_path_factory):
    """The same job once per --output_format ({fmt: its manifest and error rows, summary, metrics, output folder}),
    each checked for the faults it met. Run once for this module: the WebDataset rerun test resumes a copy of the
    WebDataset output (the first run it needs is this very job)."""
    found = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for fmt in OUTPUT_FORMATS:
            out = tmp_path_factory.mktemp("sinks-out") / fmt
            result, summary = _job(fmt, inputs, out, ckpt32, xla_cache, monkeypatch)
            raised = [kind for kind, _ in fault_jobs.RAISED]
            # The doomed shape's lone image runs out of memory padded to the batch of 2, then again compiled for 1.
            assert raised.count("transient") == 1 and raised.count("oom") == 2, (fmt, raised)
            found[fmt] = {"manifest": rows(str(out), "manifest"), "errors": rows(str(out), "errors"),
                          "summary": summary, "metrics": _metrics(result), "out": out}
    return found


def test_every_sink_gives_the_same_rows_errors_retries_and_metrics(sink_jobs):
    found = sink_jobs
    for fmt, f in found.items():
        s = f["summary"]
        assert (s["images_generated"], s["failed"], s["errors_by_reason"]) == (IMAGES, 1, {"inference_failed": 1})
        assert s["retries"]["inference"] == 1, fmt  # the transient fault, ridden over
        m = f["metrics"]
        assert m["flux2/inference_retries"] == 1 and m["flux2/images_generated"] == IMAGES, (fmt, m)
        assert m["RunInference/num_inferences"] >= IMAGES, (fmt, m)  # RunInference's own metrics, in every sink
        refs = {r["id"]: r.get("reference_images") for r in f["manifest"]}
        assert [e["uri"].rsplit("/", 1)[-1] for e in refs["ref-two"]] == ["a.png", "c.png"], fmt
        assert refs["plain"] is None

    def same(row):
        return json.dumps({k: v for k, v in row.items() if k not in WHERE})

    files, wds = found["files"], found["webdataset"]
    assert sorted(map(same, files["manifest"])) == sorted(map(same, wds["manifest"]))  # sha256 included
    assert sorted(map(json.dumps, files["errors"])) == sorted(map(json.dumps, wds["errors"]))
    assert files["metrics"] == {k: v for k, v in wds["metrics"].items() if k not in ("flux2/shards_written",)}
    assert wds["metrics"]["flux2/shards_written"] == 3

    # WebDataset: KEY.json is the manifest row (references included); the failed image is a failed sidecar row.
    by_key = {r["key"]: r for r in wds["manifest"]}
    samples = 0
    for shard in range(3):
        with tarfile.open(shards.shard_path(str(wds["out"]), shard)) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(member).read())
                    want = dict(by_key[meta["key"]], uri=shards.shard_relpath(shard), generation_ms=None)
                    assert meta == want
                    samples += 1
    assert samples == IMAGES
    with open(shards.sidecar_path(str(wds["out"]), 2), "rb") as f:
        sidecar = shards.read_sidecar(f.read())
    assert [(r["id"], r["status"]) for r in sidecar if r["status"] == "failed"] == [("tall", "failed")]
    assert not (wds["out"] / "shards" / ".staging").exists()


def test_a_webdataset_rerun_keeps_the_shards_with_their_references(ckpt32, loaded, xla_cache, inputs, sink_jobs,
                                                                   tmp_path, monkeypatch):
    """--skip_existing over a complete WebDataset output: the kept shards' rows (existing-*) are the manifest rows
    the first run wrote, references included."""
    out, first_out = tmp_path / "wds", sink_jobs["webdataset"]["out"]
    shutil.copytree(first_out, out)  # the first run's output, as it left it
    # the first run's rows, their uri moved with the copy (a row names its shard by absolute path)
    first = {r["key"]: dict(r, uri=r["uri"].replace(str(first_out), str(out), 1)) for r in rows(str(out), "manifest")}
    assert all(r["uri"].startswith(str(out)) for r in first.values())
    install_handler(monkeypatch, FaultyHandler, fail_calls=(1,), doomed_shape="64x32/")
    fault_jobs.reset_faults()
    _, summary = run([f"--model={ckpt32}", f"--input={inputs / 'p.jsonl'}", f"--output={out}", f"--height={HEIGHT}",
                      f"--width={WIDTH}", "--dtype=float32", "--max_sequence_length=32", "--batch_size=2",
                      "--inference_retries=1", f"--compilation_cache_dir={xla_cache}", "--runner=FnApiRunner",
                      "--no_progress", "--output_format=webdataset", "--samples_per_shard=2", "--preview=0",
                      "--skip_existing"])
    kept = {r["key"]: r for r in rows(str(out), "existing")}
    # Shards 0 and 1 are complete; shard 2 holds the failed image, so it is made again.
    assert sorted(kept) == sorted(k for k, r in first.items() if int(k) // 10 < 2)
    assert (summary["skipped"], summary["images_generated"]) == (len(kept), IMAGES - len(kept))
    for key, row in kept.items():
        assert dict(row, generation_ms=None) == dict(first[key], generation_ms=None)
    assert any(r.get("reference_images") for r in kept.values())
    with io.open(shards.stats_path(str(out), 2)) as f:
        assert json.load(f)["failures"] == 1
