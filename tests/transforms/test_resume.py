"""--skip_existing decides from the listing and the earlier manifest rows' fingerprints: kept images are never read,
stale ones (another prompt, another model) are generated again and counted, unrecorded ones are read and checked."""

import json
import os

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.ml.inference.base import PredictionResult
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

from transforms import layout, shards
from transforms.fingerprints import model_fingerprint, request_fingerprint
from transforms.inference import GeneratedImage
from transforms.requests import GenerationRequest, ImageTask
from transforms.shard_writer import EXISTING_TAG, STALE_TAG, PackShardFn
from transforms.sinks import writes
from transforms.sinks.encoding import ImageEncoding, encode_png, png_text
from transforms.sinks.existing import SkipExisting, existing_manifest_row
from transforms.sinks.writes import write_bytes_atomic

MODEL = model_fingerprint("ckpt", dtype="float32", max_sequence_length=64)
OTHER_DTYPE = model_fingerprint("ckpt", dtype="bfloat16", max_sequence_length=64)
OTHER_LENGTH = model_fingerprint("ckpt", dtype="float32", max_sequence_length=32)


def task(id, prompt="a fox", **kw) -> ImageTask:
    base = dict(id=id, prompt=prompt, seed=3, height=32, width=32, num_inference_steps=None, guidance_scale=None,
                num_images=1, source="p.jsonl", line=1)
    base.update(kw)
    return ImageTask(GenerationRequest(**base), 0)


def _png(t: ImageTask, model_fp=MODEL) -> bytes:
    pixels = np.random.default_rng(t.seed).integers(0, 256, (t.request.height, t.request.width, 3), dtype=np.uint8)
    return encode_png(pixels, png_text(t, num_inference_steps=4, guidance_scale=1.0, model="m",
                                       model_fingerprint=model_fp))


def _write_run(out: str, tasks, model_fp=MODEL, manifest=True, name="manifest-00000-of-00001.jsonl"):
    """What an earlier run left: each task's image, and (unless killed first) its manifest rows."""
    rows = []
    for t in tasks:
        data = _png(t, model_fp)
        uri = layout.join(out, t.file_name)
        write_bytes_atomic(uri, data)
        rows.append(existing_manifest_row(t, data, uri, model_fingerprint=model_fp))
    if manifest:
        write_bytes_atomic(layout.join(out, f"manifest/{name}"),
                           "".join(layout.to_json_line(r) + "\n" for r in rows).encode())
    return rows


@pytest.fixture
def image_reads(monkeypatch):
    """The images SkipExisting reads (FnApiRunner runs in this process, so the module's read_bytes is the one)."""
    reads = []
    real = writes.read_bytes

    def counting(path):
        if f"/{layout.IMAGES_DIR}/" in path.replace(os.sep, "/"):
            reads.append(path)
        return real(path)

    monkeypatch.setattr(writes, "read_bytes", counting)
    return reads


def _skip(out: str, tasks, model_fp=MODEL):
    """Run SkipExisting; ({'tasks': file names, 'skipped': rows, 'stale': file names})."""
    import pickle
    import tempfile

    folder = tempfile.mkdtemp(prefix="skip-")
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        split = p | beam.Create(tasks) | SkipExisting(out, ImageEncoding(), model_fp)
        for name in ("tasks", "skipped", "stale"):
            path = os.path.join(folder, name)
            _ = (split[name] | f"Collect{name}" >> beam.combiners.ToList()
                 | f"Keep{name}" >> beam.Map(lambda items, path=path: open(path, "wb").write(pickle.dumps(items))))
    got = {}
    for name in ("tasks", "skipped", "stale"):
        with open(os.path.join(folder, name), "rb") as f:
            got[name] = pickle.load(f)
    got["tasks"] = sorted(t.file_name for t in got["tasks"])
    return got


def test_same_fingerprints_skip_without_reading_any_image(tmp_path, image_reads):
    out = str(tmp_path / "out")
    done = [task("a"), task("b", prompt="a hen")]
    rows = _write_run(out, done)
    got = _skip(out, done + [task("new")])
    assert image_reads == []
    assert got["tasks"] == ["images/new.png"] and got["stale"] == []
    by_name = {r["file_name"]: r for r in got["skipped"]}
    for row in rows:
        kept = by_name[row["file_name"]]
        assert {k: kept[k] for k in ("sha256", "bytes", "uri", "prompt", "seed", "request_fingerprint",
                                     "model_fingerprint")} == \
               {k: row[k] for k in ("sha256", "bytes", "uri", "prompt", "seed", "request_fingerprint",
                                    "model_fingerprint")}
        assert kept["generation_ms"] is None


def test_an_edited_prompt_is_generated_again_and_counted_stale(tmp_path, image_reads):
    out = str(tmp_path / "out")
    _write_run(out, [task("a"), task("b")])
    got = _skip(out, [task("a", prompt="a fox, edited"), task("b")])
    assert got["tasks"] == ["images/a.png"] and got["stale"] == ["images/a.png"]
    assert [r["file_name"] for r in got["skipped"]] == ["images/b.png"]
    assert image_reads == []


@pytest.mark.parametrize("new_model", [OTHER_DTYPE, OTHER_LENGTH], ids=["dtype", "max_sequence_length"])
def test_another_model_regenerates_every_image(tmp_path, image_reads, new_model):
    out = str(tmp_path / "out")
    _write_run(out, [task("a"), task("b")])
    got = _skip(out, [task("a"), task("b")], model_fp=new_model)
    assert got["tasks"] == ["images/a.png", "images/b.png"]
    assert sorted(got["stale"]) == ["images/a.png", "images/b.png"] and got["skipped"] == []


def test_images_of_a_run_killed_before_its_manifest_are_read_and_checked(tmp_path, image_reads):
    out = str(tmp_path / "out")
    kept = [task("a"), task("b")]
    _write_run(out, kept[:1])  # an earlier complete run: its manifest lists a.png
    _write_run(out, kept[1:], manifest=False)  # the killed run wrote b.png, never its manifest
    _write_run(out, [task("old")], model_fp=OTHER_DTYPE, manifest=False)  # by another model, unrecorded
    damaged = task("cut")
    write_bytes_atomic(layout.join(out, damaged.file_name), _png(damaged)[:-20])
    got = _skip(out, kept + [task("old"), damaged])
    assert sorted(os.path.basename(p) for p in image_reads) == ["b.png", "cut.png", "old.png"]
    assert got["tasks"] == ["images/cut.png", "images/old.png"] and got["stale"] == ["images/old.png"]
    rows = {r["file_name"]: r for r in got["skipped"]}
    assert sorted(rows) == ["images/a.png", "images/b.png"]
    assert rows["images/b.png"]["request_fingerprint"] == request_fingerprint(kept[1])
    assert rows["images/b.png"]["model_fingerprint"] == MODEL


def test_a_recorded_row_of_another_size_than_the_listed_image_is_read(tmp_path, image_reads):
    out = str(tmp_path / "out")
    rows = _write_run(out, [task("a")])
    write_bytes_atomic(layout.join(out, "images/a.png"), _png(task("a"))[:-20])  # replaced by hand, cut short
    got = _skip(out, [task("a")])
    assert len(image_reads) == 1 and got["tasks"] == ["images/a.png"] and rows[0]["bytes"] > 0


# --------------------------------------------------------------------------------------------- webdataset
class _FakeModel:
    """What load_model returns (Beam's Shared keeps a weak reference to it)."""


class _FakeHandler:
    """Just enough of Flux2KleinModelHandler for PackShardFn: seeded pixels, counted calls."""

    def __init__(self):
        self.batches = 0

    def set_environment_vars(self):
        pass

    def share_model_across_processes(self):
        return False

    def load_model(self):
        return _FakeModel()

    def run_inference(self, tasks, model):
        self.batches += 1
        for t in tasks:
            r = t.request
            pixels = np.random.default_rng(t.seed).integers(0, 256, (r.height, r.width, 3), dtype=np.uint8)
            yield PredictionResult(t, GeneratedImage(task=t, pixels=pixels, num_inference_steps=4, guidance_scale=1.0,
                                                     prompt_truncated=False, model="m", generation_ms=1.0))


def _pack(out: str, tasks, skip_existing: bool, model_fp=MODEL):
    handler = _FakeHandler()
    fn = PackShardFn(out, handler, ImageEncoding(), samples_per_shard=4, batch_size=4, skip_existing=skip_existing,
                     threads=1, model_fingerprint=model_fp)
    fn.setup()
    try:
        outs = list(fn.process((0, list(enumerate(tasks)))))
    finally:
        fn.teardown()
    tagged = {}
    for o in outs:
        tagged.setdefault(getattr(o, "tag", "manifest"), []).append(getattr(o, "value", o))
    return handler, tagged


def test_webdataset_shard_with_an_edited_prompt_is_generated_again(tmp_path):
    out = str(tmp_path / "out")
    tasks = [task("a"), task("b"), task("c")]
    _pack(out, tasks, skip_existing=False)
    handler, tagged = _pack(out, tasks, skip_existing=True)  # same requests and model: kept, nothing generated
    assert handler.batches == 0 and len(tagged[EXISTING_TAG]) == 3 and STALE_TAG not in tagged
    edited = [tasks[0], task("b", prompt="a hen"), tasks[2]]
    handler, tagged = _pack(out, edited, skip_existing=True)
    assert handler.batches == 1 and tagged[STALE_TAG] == ["000000001"] and EXISTING_TAG not in tagged
    with open(shards.sidecar_path(out, 0), "rb") as f:
        assert [r["prompt"] for r in shards.read_sidecar(f.read())] == ["a fox", "a hen", "a fox"]
    handler, tagged = _pack(out, edited, skip_existing=True, model_fp=OTHER_LENGTH)  # another model
    assert handler.batches == 1 and len(tagged[STALE_TAG]) == 3
    with open(shards.sidecar_path(out, 0), "rb") as f:
        assert {r["model_fingerprint"] for r in shards.read_sidecar(f.read())} == {OTHER_LENGTH}
    with open(shards.stats_path(out, 0)) as f:
        assert json.load(f)["successes"] == 3
