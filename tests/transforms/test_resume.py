"""--skip_existing decides from the listing and the earlier manifest rows' fingerprints: kept images are never read
for their text (on gs:// never downloaded: the listing's CRC32C says which bytes are there; a local file is hashed),
stale ones (another prompt, another model) are generated again and counted, unrecorded ones are read and checked.
Rows vouch only for the bytes they name: an image a later, stopped run replaced is read and decided by its own
text, and a WebDataset shard is kept only when its tar and sidecar are the ones its marker names."""

import hashlib
import json
import os

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from transforms import layout, shards
from transforms.checksums import crc32c
from transforms.fingerprints import model_fingerprint, request_fingerprint
from transforms.identity import RECORDED_FIELDS, ModelIdentity
from transforms.inference import GeneratedImage
from transforms.provenance import xmp_packet
from transforms.requests import GenerationRequest, ImageTask
from transforms.sinks import base as sinks, writes
from transforms.sinks.encoding import ImageEncoding, encode_png, png_text
from transforms.sinks.existing import SkipExisting, existing_manifest_row
from transforms.sinks.webdataset import WebDatasetSink, staged_path, staging_dir
from transforms.sinks.writes import write_bytes_atomic
from pipeline_helpers import output  # noqa: F401 - a fixture: a local or gs:// output folder

MODEL = model_fingerprint("ckpt", dtype="float32", max_sequence_length=64)
OTHER_DTYPE = model_fingerprint("ckpt", dtype="bfloat16", max_sequence_length=64)
OTHER_LENGTH = model_fingerprint("ckpt", dtype="float32", max_sequence_length=32)
INT8 = model_fingerprint("ckpt", dtype="float32", max_sequence_length=64, quantize="int8")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def task(id, prompt="a fox", **kw) -> ImageTask:
    base = dict(id=id, prompt=prompt, seed=3, height=32, width=32, num_inference_steps=None, guidance_scale=None,
                num_images=1, source="p.jsonl", line=1)
    base.update(kw)
    return ImageTask(GenerationRequest(**base), 0)


def _png(t: ImageTask, model_fp=MODEL, level=None) -> bytes:
    pixels = np.random.default_rng(t.seed).integers(0, 256, (t.request.height, t.request.width, 3), dtype=np.uint8)
    return encode_png(pixels, png_text(t, num_inference_steps=4, guidance_scale=1.0, model="m",
                                       model_identity=model_fp), compress_level=level)


def _write_run(out: str, tasks, model_fp=MODEL, manifest=True, name="manifest-00000-of-00001.jsonl", level=None):
    """What an earlier run left: each task's image, and (unless killed first) its manifest rows."""
    rows = []
    for t in tasks:
        data = _png(t, model_fp, level)
        uri = layout.join(out, t.file_name)
        write_bytes_atomic(uri, data)
        rows.append(existing_manifest_row(t, data, uri, model_identity=model_fp))
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
    """Run SkipExisting; ({'tasks': file names, 'existing': rows, 'stale' / 'damaged' / 'missing': file names})."""
    import pickle
    import tempfile

    folder = tempfile.mkdtemp(prefix="skip-")
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        split = p | beam.Create(tasks) | SkipExisting(out, ImageEncoding(), model_fp)
        for name in NAMES:
            path = os.path.join(folder, name)
            _ = (split[name] | f"Collect{name}" >> beam.combiners.ToList()
                 | f"Keep{name}" >> beam.Map(lambda items, path=path: open(path, "wb").write(pickle.dumps(items))))
    got = {}
    for name in NAMES:
        with open(os.path.join(folder, name), "rb") as f:
            got[name] = pickle.load(f)
    got["tasks"] = sorted(t.file_name for t in got["tasks"])
    for name in ("stale", "damaged", "missing"):
        got[name] = sorted(got[name])  # a PCollection has no order
    return got


NAMES = ("tasks", "existing", "stale", "damaged", "missing")  # what SkipExisting returns


def test_same_fingerprints_skip_without_reading_any_image(tmp_path, image_reads):
    out = str(tmp_path / "out")
    done = [task("a"), task("b", prompt="a hen")]
    rows = _write_run(out, done)
    got = _skip(out, done + [task("new")])
    assert image_reads == []
    assert got["tasks"] == ["images/new.png"] and got["stale"] == []
    by_name = {r["file_name"]: r for r in got["existing"]}
    for row in rows:
        kept = by_name[row["file_name"]]
        # the pHash too comes from the earlier row: no image was read (transforms/phash.py)
        assert {k: kept[k] for k in ("sha256", "bytes", "uri", "prompt", "seed", "request_fingerprint",
                                     "model_fingerprint", "phash")} == \
               {k: row[k] for k in ("sha256", "bytes", "uri", "prompt", "seed", "request_fingerprint",
                                    "model_fingerprint", "phash")}
        assert len(kept["phash"]) == 16
        assert kept["generation_ms"] is None


def test_an_edited_prompt_is_generated_again_and_counted_stale(tmp_path, image_reads):
    out = str(tmp_path / "out")
    _write_run(out, [task("a"), task("b")])
    got = _skip(out, [task("a", prompt="a fox, edited"), task("b")])
    assert got["tasks"] == ["images/a.png"] and got["stale"] == ["images/a.png"]
    assert [r["file_name"] for r in got["existing"]] == ["images/b.png"]
    assert image_reads == []


def test_each_image_a_user_damaged_is_remade_and_counted_by_what_was_wrong(tmp_path):
    """Issue 57's user: one image copied over another, one truncated, one with a byte flipped, one deleted. All four
    are generated again, and each is counted: stale (the copy is another request's image), damaged (2), missing."""
    out = str(tmp_path / "out")
    tasks = [task(name, prompt=f"prompt {name}") for name in "abcdef"]
    _write_run(out, tasks)
    images = os.path.join(out, layout.IMAGES_DIR)
    with open(os.path.join(images, "a.png"), "rb") as f:
        copied = f.read()
    with open(os.path.join(images, "b.png"), "wb") as f:
        f.write(copied)
    with open(os.path.join(images, "c.png"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(images, "c.png")) // 2)
    with open(os.path.join(images, "d.png"), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(images, "d.png")) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.remove(os.path.join(images, "e.png"))
    got = _skip(out, tasks)
    assert got["tasks"] == ["images/b.png", "images/c.png", "images/d.png", "images/e.png"]
    assert (got["stale"], got["damaged"], got["missing"]) == (["images/b.png"], ["images/c.png", "images/d.png"],
                                                               ["images/e.png"])
    assert sorted(r["file_name"] for r in got["existing"]) == ["images/a.png", "images/f.png"]


def _old_png(t: ImageTask, model_fp=MODEL) -> bytes:
    """An image as the code before the identity record wrote it: steps and guidance under two keys each, no dtype."""
    pixels = np.random.default_rng(t.seed).integers(0, 256, (t.request.height, t.request.width, 3), dtype=np.uint8)
    text = {"prompt": t.request.prompt, "seed": str(t.seed), "num_inference_steps": "4", "steps": "4",
            "guidance_scale": "1.0", "guidance": "1.0", "model": "m", "quantize": "none", "id": t.request.id,
            "height": str(t.request.height), "width": str(t.request.width), "Software": "flux2-klein-beam",
            "request_fingerprint": request_fingerprint(t), "model_fingerprint": model_fp, "prompt_truncated": "false"}
    return encode_png(pixels, text)


def _old_row(t: ImageTask, data: bytes, uri: str, model_fp=MODEL) -> dict:
    """A manifest row as the code before the identity record wrote it (no dtype; quantize among the figures)."""
    r = t.request
    return {"id": r.id, "file_name": t.file_name, "uri": uri, "prompt": r.prompt, "prompt_truncated": False,
            "seed": t.seed, "height": r.height, "width": r.width, "num_inference_steps": 4, "guidance_scale": 1.0,
            "model": "m", "quantize": "none", "sha256": sha256(data), "bytes": len(data), "crc32c": crc32c(data),
            "generation_ms": 12.5, "metadata": {}, "request_fingerprint": request_fingerprint(t),
            "model_fingerprint": model_fp, "source": r.source, "line": r.line}


def test_an_output_written_before_the_identity_record_still_resumes(tmp_path, image_reads):
    """Images and rows of the earlier format (both spellings of steps and guidance, no dtype) are kept: those with
    rows without being read, those without by their text (read under either spelling); the kept rows name the
    job's dtype, which their model fingerprint covers."""
    out = str(tmp_path / "out")
    with_rows, without_rows = [task("a"), task("b", prompt="a hen")], [task("c", prompt="a cat")]
    rows = []
    for t in with_rows + without_rows:
        data = _old_png(t)
        uri = layout.join(out, t.file_name)
        write_bytes_atomic(uri, data)
        if t in with_rows:
            rows.append(_old_row(t, data, uri))
    write_bytes_atomic(layout.join(out, "manifest/manifest-00000-of-00001.jsonl"),
                       "".join(layout.to_json_line(r) + "\n" for r in rows).encode())
    job = ModelIdentity(MODEL, dtype="float32")
    got = _skip(out, with_rows + without_rows, job)
    assert got["tasks"] == [] and (got["stale"], got["damaged"], got["missing"]) == ([], [], [])
    assert image_reads == [layout.join(out, "images/c.png")]  # only the image no row describes
    kept = {r["file_name"]: r for r in got["existing"]}
    assert set(kept) == {"images/a.png", "images/b.png", "images/c.png"}
    assert {(r["dtype"], r["quantize"], r["num_inference_steps"], r["guidance_scale"]) for r in kept.values()} \
        == {("float32", "none", 4, 1.0)}
    # Steps and guidance under the earlier spelling alone are read too.
    t = task("d", prompt="a dog")
    text = {k: v for k, v in png_text(t, num_inference_steps=4, guidance_scale=1.0, model="m",
                                      model_identity=job).items() if k not in ("num_inference_steps", "guidance_scale")}
    data = encode_png(np.zeros((32, 32, 3), np.uint8), dict(text, steps="4", guidance="1.0"))
    row = existing_manifest_row(t, data, "u", model_identity=job)
    assert (row["num_inference_steps"], row["guidance_scale"], row["dtype"]) == (4, 1.0, "float32")


def test_images_and_rows_name_their_dtype_once_and_steps_and_guidance_one_way(tmp_path):
    t = task("a")
    text = png_text(t, num_inference_steps=4, guidance_scale=1.5, model="m",
                    model_identity=ModelIdentity(MODEL, dtype="bfloat16", quantize="int8"))
    assert "steps" not in text and "guidance" not in text
    assert (text["num_inference_steps"], text["guidance_scale"], text["dtype"], text["quantize"]) == \
        ("4", "1.5", "bfloat16", "int8")
    data = encode_png(np.zeros((32, 32, 3), np.uint8), text)
    row = existing_manifest_row(t, data, "u", model_identity=ModelIdentity(MODEL, dtype="bfloat16", quantize="int8"))
    assert (row["dtype"], row["quantize"], row["model_fingerprint"]) == ("bfloat16", "int8", MODEL)
    assert set(RECORDED_FIELDS) <= set(row)


@pytest.mark.parametrize("new_model", [OTHER_DTYPE, OTHER_LENGTH, INT8], ids=["dtype", "max_sequence_length", "int8"])
def test_another_model_regenerates_every_image(tmp_path, image_reads, new_model):
    out = str(tmp_path / "out")
    _write_run(out, [task("a"), task("b")])
    got = _skip(out, [task("a"), task("b")], model_fp=new_model)
    assert got["tasks"] == ["images/a.png", "images/b.png"]
    assert sorted(got["stale"]) == ["images/a.png", "images/b.png"] and got["existing"] == []


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
    rows = {r["file_name"]: r for r in got["existing"]}
    assert sorted(rows) == ["images/a.png", "images/b.png"]
    assert rows["images/b.png"]["request_fingerprint"] == request_fingerprint(kept[1])
    assert rows["images/b.png"]["model_fingerprint"] == MODEL


def test_a_recorded_row_of_another_size_than_the_listed_image_is_read(tmp_path, image_reads):
    out = str(tmp_path / "out")
    rows = _write_run(out, [task("a")])
    write_bytes_atomic(layout.join(out, "images/a.png"), _png(task("a"))[:-20])  # replaced by hand, cut short
    got = _skip(out, [task("a")])
    assert len(image_reads) == 1 and got["tasks"] == ["images/a.png"] and rows[0]["bytes"] > 0


def test_natural_ids_resume_under_their_safe_names(tmp_path, image_reads):
    """Images of ids outside [A-Za-z0-9._-] are stored as <slug>-<hash>.png: a rerun finds them there, recorded or
    (a killed run's) read and checked against the id their text carries, and its rows keep the ids as given."""
    out = str(tmp_path / "out")
    done = [task("img 0001"), task("café 2", prompt="a hen"), task("a/b")]
    _write_run(out, done[:1])  # recorded in a manifest
    _write_run(out, done[1:], manifest=False)  # a killed run's: read and checked
    new = task("img 0003")
    got = _skip(out, done + [new])
    names = {t.request.id: t.file_name for t in done + [new]}
    assert names["img 0001"] == f"images/img_0001-{layout.image_stem('img 0001')[-12:]}.png"
    assert names["café 2"].startswith("images/cafe_2-") and names["a/b"].startswith("images/a_b-")
    assert got["tasks"] == [names["img 0003"]] and got["stale"] == []
    assert sorted((r["id"], r["file_name"]) for r in got["existing"]) == \
        sorted((t.request.id, t.file_name) for t in done)
    assert sorted(os.path.basename(p) for p in image_reads) == sorted(
        os.path.basename(names[i]) for i in ("café 2", "a/b"))


def test_images_a_stopped_run_replaced_are_not_kept_by_the_rows_it_left(output, image_reads):
    """Run A completes; run B, another prompt over the same ids, replaces two images and is stopped before its
    manifest; run A again: the rows A left name bytes that are no longer there (PNG level 0: every image has the
    same size, so the size cannot tell), so the two images are read, found to be B's and made again."""
    out = output
    done = [task(f"i{n}", prompt="a fox") for n in range(4)]
    rows = _write_run(out, done, level=0)
    replaced = [task(f"i{n}", prompt="a cat") for n in range(2)]  # run B's, same length: same size at level 0
    for t in replaced:
        data = _png(t, level=0)
        assert len(data) == rows[0]["bytes"]
        write_bytes_atomic(layout.join(out, t.file_name), data)
    got = _skip(out, done)
    assert got["tasks"] == ["images/i0.png", "images/i1.png"] and got["stale"] == ["images/i0.png", "images/i1.png"]
    assert sorted(r["file_name"] for r in got["existing"]) == ["images/i2.png", "images/i3.png"]
    assert sorted(os.path.basename(p) for p in image_reads) == ["i0.png", "i1.png"]  # only those: their text decides
    for row in got["existing"]:
        data = writes.read_bytes(row["uri"])
        assert (row["sha256"], row["bytes"], row["crc32c"]) == (sha256(data), len(data), crc32c(data))


def test_rows_without_a_checksum_are_checked_against_the_image(output, image_reads):
    """Rows of a run before the CRC32C was recorded: locally the file's sha256 is compared; on gs:// the image is
    read and checked (its rows cannot say which bytes they name without reading it), and kept."""
    out = output
    done = [task("a"), task("b")]
    rows = _write_run(out, done, manifest=False)
    old = "".join(layout.to_json_line({k: v for k, v in r.items() if k != "crc32c"}) + "\n" for r in rows)
    write_bytes_atomic(layout.join(out, "manifest/manifest-00000-of-00001.jsonl"), old.encode())
    got = _skip(out, done)
    assert got["tasks"] == [] and sorted(r["file_name"] for r in got["existing"]) == ["images/a.png", "images/b.png"]
    assert len(image_reads) == (0 if layout.is_local_path(out) else 2)
    assert all(r["crc32c"] for r in got["existing"])


# --------------------------------------------------------------------------------------------- webdataset
def _pixels(t) -> np.ndarray:
    r = t.request
    return np.random.default_rng(t.seed).integers(0, 256, (r.height, r.width, 3), dtype=np.uint8)


def _generate(t) -> GeneratedImage:
    """What the generation stage gives for a task (the same task object back, as RunInference does)."""
    return GeneratedImage(task=t, pixels=_pixels(t), num_inference_steps=4, guidance_scale=1.0,
                          prompt_truncated=False, model="m", generation_ms=1.0)


def _wds(out: str, tasks, skip_existing: bool, model_fp=MODEL, per_shard=4) -> dict:
    """The WebDataset sink around a stand-in generation stage, on FnApiRunner: {name: elements} of what it planned
    and wrote ('generated': keys of the tasks it had generated)."""
    import pickle
    import tempfile

    folder = tempfile.mkdtemp(prefix="wds-")
    sink = WebDatasetSink(sinks.SinkSettings(out, ImageEncoding(), model_fp, skip_existing, 1), per_shard)
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        planned = dict(p | beam.Create(tasks) | sink.plan())
        todo = planned.pop(sinks.TASKS)
        made = {sinks.IMAGES: todo | "Generate" >> beam.Map(_generate),
                sinks.FAILED: p | "NoFailures" >> beam.Create([])}
        written = {**made, **planned} | sink
        found = {"generated": todo | beam.Map(lambda t: t.key), "manifest": written[sinks.MANIFEST],
                 "existing": written[sinks.EXISTING], "stale": written[sinks.STALE],
                 "missing": written[sinks.MISSING], "damaged": written[sinks.DAMAGED]}
        for name, pcoll in found.items():
            path = os.path.join(folder, name)
            _ = (pcoll | f"Collect{name}" >> beam.combiners.ToList()
                 | f"Keep{name}" >> beam.Map(lambda items, path=path: open(path, "wb").write(pickle.dumps(items))))
    got = {}
    for name in found:
        with open(os.path.join(folder, name), "rb") as f:
            got[name] = pickle.load(f)
    got["generated"] = sorted(got["generated"])
    got["missing"] = sorted(got["missing"])
    return got


def _sidecar(out: str, shard: int = 0) -> list[dict]:
    with open(shards.sidecar_path(out, shard), "rb") as f:
        return shards.read_sidecar(f.read())


def test_webdataset_shard_with_an_edited_prompt_is_generated_again(tmp_path):
    out = str(tmp_path / "out")
    tasks = [task("a", line=1), task("b", line=2), task("c", line=3)]
    first = _wds(out, tasks, skip_existing=False)
    assert first["generated"] == ["000000000", "000000001", "000000002"] and len(first["manifest"]) == 3
    assert not os.path.exists(staging_dir(out))  # the staged images are gone once the shard is packed
    kept = _wds(out, tasks, skip_existing=True)  # same requests and model: kept, nothing generated
    assert kept["generated"] == [] and kept["manifest"] == [] and kept["stale"] == []
    assert sorted(r["key"] for r in kept["existing"]) == ["000000000", "000000001", "000000002"]
    by_key = {r["key"]: r for r in first["manifest"]}
    for row in kept["existing"]:  # the one row builder: the same row, but for the time it took
        assert dict(row, generation_ms=None) == dict(by_key[row["key"]], generation_ms=None)
    edited = [tasks[0], task("b", prompt="a hen", line=2), tasks[2]]
    again = _wds(out, edited, skip_existing=True)
    assert len(again["generated"]) == 3 and again["stale"] == ["000000001"] and again["existing"] == []
    assert again["missing"] == again["damaged"] == []  # a whole shard made again: counted by its stale samples
    assert [r["prompt"] for r in _sidecar(out)] == ["a fox", "a hen", "a fox"]
    other = _wds(out, edited, skip_existing=True, model_fp=OTHER_LENGTH)  # another model
    assert len(other["generated"]) == 3 and len(other["stale"]) == 3
    assert {r["model_fingerprint"] for r in _sidecar(out)} == {OTHER_LENGTH}
    with open(shards.stats_path(out, 0)) as f:
        assert json.load(f)["successes"] == 3


def test_webdataset_rerun_reuses_the_images_a_killed_run_staged(tmp_path):
    """A run killed after generating, before packing, left staged images: a --skip_existing rerun packs those that
    are the tasks' (their text says so) without generating them, generates the rest, and removes the staging."""
    out = str(tmp_path / "out")
    tasks = [task(rid, line=i) for i, rid in enumerate("abcde", 1)]
    reference = _wds(str(tmp_path / "reference"), tasks, skip_existing=False)
    keys = {t.request.id: shards.sample_key(*divmod(i, 4), 4) for i, t in enumerate(tasks)}
    for rid, prompt in (("a", "a fox"), ("b", "a fox"), ("e", "a fox"), ("c", "another prompt")):
        t = task(rid, prompt=prompt, line="abcde".index(rid) + 1)
        text = png_text(t, num_inference_steps=4, guidance_scale=1.0, model="m", prompt_truncated=False,
                        model_identity=MODEL)
        xmp = xmp_packet(model="m", request_fingerprint=t.request_fingerprint, model_fingerprint=MODEL,
                         image_id=t.request.id)  # staged as the writer stores it: with its provenance
        write_bytes_atomic(staged_path(out, keys[rid], "png"), ImageEncoding("png").encode(_pixels(t), text, xmp=xmp))
    got = _wds(out, tasks, skip_existing=True)
    assert got["generated"] == [keys["c"], keys["d"]]  # c's staged image is another request's
    assert got["missing"] == [keys["c"], keys["d"]] and got["damaged"] == []  # no whole shard holds them
    assert sorted(r["key"] for r in got["existing"]) == [keys["a"], keys["b"], keys["e"]]
    assert all(r["generation_ms"] is None for r in got["existing"])
    assert not os.path.exists(staging_dir(out))
    for shard in (0, 1):  # the same shards as a run that generated everything
        with open(shards.shard_path(out, shard), "rb") as f, \
                open(shards.shard_path(str(tmp_path / "reference"), shard), "rb") as g:
            assert f.read() == g.read()
    assert len(reference["manifest"]) == 5


def _read(path: str) -> bytes:
    return writes.read_bytes(path)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_shard_whose_sidecar_write_failed_after_its_tar_is_packed_again(where, tmp_path, monkeypatch, request):
    """Run A packs a shard; run B, another prompt for one of its samples, replaces the tar and fails writing the
    sidecar (on gs:// the fault proxy refuses the sidecar's upload; locally the write raises): run A's command
    again with --skip_existing must not keep the tar B left under A's sidecar: it packs the shard again, and the
    tar is A's, byte for byte."""
    import contextlib

    from transforms.sinks import webdataset

    tasks = [task("a", line=1), task("b", line=2), task("c", line=3)]
    edited = [tasks[0], task("b", prompt="a hen", line=2), tasks[2]]
    reference = str(tmp_path / "reference")
    _wds(reference, tasks, skip_existing=False)
    with contextlib.ExitStack() as stack:
        if where == "local":
            out, proxy = str(tmp_path / "out"), None
        else:
            from fault_jobs import fast_gcs_retries
            from fault_proxy import in_front_of

            emulator = request.getfixturevalue("gcs_emulator")
            out = f"gs://{emulator.new_bucket()}/out"
            # Every request of the three runs goes through the proxy (objects written through it are read back
            # through it: their media links name it).
            proxy = stack.enter_context(in_front_of(emulator, monkeypatch))
        _wds(out, tasks, skip_existing=False)
        assert _read(shards.shard_path(out, 0)) == _read(shards.shard_path(reference, 0))

        if proxy is None:
            real = webdataset.write_bytes_atomic

            def failing(path, data, mime_type="application/octet-stream"):
                if path.endswith(shards.SIDECAR_SUFFIX):
                    raise OSError("injected: the sidecar's write failed (the run was stopped here)")
                return real(path, data, mime_type)

            with monkeypatch.context() as m:
                m.setattr(webdataset, "write_bytes_atomic", failing)
                with pytest.raises(Exception, match="injected"):
                    _wds(out, edited, skip_existing=True)
        else:
            from fault_proxy import FaultRule

            with monkeypatch.context() as m:
                fast_gcs_retries(m, timeout=2.0)
                proxy.add_rule(FaultRule(fraction=1.0, kinds={"upload"}, name=r"shards/00000\.parquet",
                                         actions=("503",)))
                with pytest.raises(Exception):
                    _wds(out, edited, skip_existing=True)
                proxy.clear_rules()
            assert proxy.stats()["injected_by_kind"].get("upload", 0) >= 1
        assert _read(shards.shard_path(out, 0)) != _read(shards.shard_path(reference, 0))  # B's tar is there

        again = _wds(out, tasks, skip_existing=True)  # packed again; B's staged images of A's requests are reused
        assert "000000001" in again["generated"] and \
            sorted(again["generated"] + [r["key"] for r in again["existing"]]) == ["000000000", "000000001",
                                                                                  "000000002"]
        assert _read(shards.shard_path(out, 0)) == _read(shards.shard_path(reference, 0))


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_shard_is_kept_only_when_its_tar_is_the_one_its_marker_names(where, tmp_path, request):
    """A tar replaced under a complete marker and sidecar (by hand, or a run whose marker could not be removed) is
    told by its CRC32C (gs://: its metadata; locally hashed) and packed again; with the tar the marker names, the
    shard is kept without generating anything."""
    tasks = [task("a", line=1), task("b", line=2)]
    other = str(tmp_path / "other")
    _wds(other, [tasks[0], task("b", prompt="a hen", line=2)], skip_existing=False)
    if where == "local":
        out = str(tmp_path / "out")
    else:
        out = f"gs://{request.getfixturevalue('gcs_emulator').new_bucket()}/out"
    first = _wds(out, tasks, skip_existing=False)
    stats = json.loads(_read(shards.stats_path(out, 0)))
    tar = _read(shards.shard_path(out, 0))
    assert (stats[shards.TAR_BYTES], stats[shards.TAR_CRC32C]) == (len(tar), crc32c(tar))
    assert shards.sidecar_tar(_read(shards.sidecar_path(out, 0))) == shards.Digest(len(tar), crc32c(tar))
    kept = _wds(out, tasks, skip_existing=True)
    assert kept["generated"] == [] and len(kept["existing"]) == 2
    assert [r["crc32c"] for r in kept["existing"]] == [r["crc32c"] for r in first["manifest"]]

    write_bytes_atomic(shards.shard_path(out, 0), _read(shards.shard_path(other, 0)))
    again = _wds(out, tasks, skip_existing=True)
    assert again["generated"] == ["000000000", "000000001"]
    assert _read(shards.shard_path(out, 0)) == tar


def test_a_marker_from_before_the_checksums_is_checked_against_the_tars_images(tmp_path):
    """A marker without the tar's CRC32C (an older run's): the tar is read and each image's sha256 compared with its
    sidecar row; kept when they agree, packed again when they do not."""
    out = str(tmp_path / "out")
    tasks = [task("a", line=1), task("b", line=2)]
    _wds(out, tasks, skip_existing=False)
    stats = json.loads(_read(shards.stats_path(out, 0)))
    old = {k: v for k, v in stats.items() if k not in (shards.TAR_BYTES, shards.TAR_CRC32C, shards.SIDECAR_BYTES,
                                                         shards.SIDECAR_CRC32C)}
    write_bytes_atomic(shards.stats_path(out, 0), json.dumps(old).encode())
    assert _wds(out, tasks, skip_existing=True)["generated"] == []
    other = str(tmp_path / "other")
    _wds(other, [tasks[0], task("b", prompt="a hen", line=2)], skip_existing=False)
    write_bytes_atomic(shards.shard_path(out, 0), _read(shards.shard_path(other, 0)))
    write_bytes_atomic(shards.stats_path(out, 0), json.dumps(old).encode())
    assert _wds(out, tasks, skip_existing=True)["generated"] == ["000000000", "000000001"]
