"""PNG encoding with text chunks, atomic writes (local and GCS emulator), skip-existing, error rows, summary."""

import hashlib
import io
import json
import os
import re

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to
from PIL import Image

from transforms import layout
from transforms.generation import failed_batch_rows
from transforms.progress import ProgressWriter, progress_line, read_progress
from transforms.requests import GenerationRequest, ImageTask
from transforms.sinks.encoding import encode_png, png_text
from transforms.sinks.existing import ExistingImageMismatch, SkipExisting, existing_manifest_row
from transforms.sinks.writes import read_bytes, write_bytes_atomic
from transforms.summary import build_summary, format_summary


def request(id="r1", num_images=1, **kw):
    base = dict(id=id, prompt="un café ☕ at dawn", seed=11, height=32, width=48, num_inference_steps=None,
                guidance_scale=None, num_images=num_images, source="gs://b/p.jsonl", line=3)
    base.update(kw)
    return GenerationRequest(**base)


def test_layout():
    assert layout.image_file_name("a", 0, 1) == "images/a.png"
    assert layout.image_file_name("a", 2, 3) == "images/a-2.png"
    assert layout.join("gs://b/out/", "images/a.png") == "gs://b/out/images/a.png"
    assert layout.join("/tmp/out", "images/a.png") == os.path.join("/tmp/out", "images", "a.png")
    assert layout.manifest_prefix("gs://b/o") == "gs://b/o/manifest/manifest"
    assert layout.errors_prefix("gs://b/o") == "gs://b/o/errors/errors"
    assert layout.summary_path("gs://b/o") == "gs://b/o/summary.json"


def test_png_roundtrip_with_text_chunks_and_deterministic_bytes():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)
    task = ImageTask(request(num_images=2), 1)
    text = png_text(task, num_inference_steps=4, guidance_scale=1.0, model="gs://m/klein")
    data = encode_png(pixels, text)
    assert data == encode_png(pixels, text)  # a retried bundle writes the same bytes
    im = Image.open(io.BytesIO(data))
    assert im.format == "PNG" and im.size == (48, 32) and im.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(im), pixels)
    assert im.text["prompt"] == "un café ☕ at dawn"
    assert im.text["seed"] == "12"  # image 1 of the request: seed + 1
    assert im.text["num_inference_steps"] == "4" and im.text["guidance_scale"] == "1.0"
    assert im.text["model"] == "gs://m/klein" and im.text["id"] == "r1"
    with pytest.raises(ValueError):
        encode_png(pixels.astype(np.float32))


def test_local_atomic_write_leaves_no_temporary_files(tmp_path):
    path = str(tmp_path / "images" / "a.png")
    write_bytes_atomic(path, b"one")
    write_bytes_atomic(path, b"two")
    assert open(path, "rb").read() == b"two"
    assert os.listdir(tmp_path / "images") == ["a.png"]
    assert read_bytes(path) == b"two"


def test_gcs_write_is_one_object(gcs_emulator, gcs_bucket):
    uri = f"gs://{gcs_bucket}/out/images/a.png"
    write_bytes_atomic(uri, b"\x89PNG-bytes", mime_type="image/png")
    blobs = gcs_emulator.list_blobs(f"gs://{gcs_bucket}/out/")
    assert list(blobs) == ["out/images/a.png"]
    assert blobs["out/images/a.png"].content_type == "image/png"
    assert gcs_emulator.read_bytes(uri) == b"\x89PNG-bytes"
    assert read_bytes(uri) == b"\x89PNG-bytes"


def test_failed_batch_rows_one_per_image():
    tasks = [ImageTask(request("a"), 0), ImageTask(request("b", num_images=2), 1)]
    err = MemoryError("RESOURCE_EXHAUSTED: out of memory allocating 3.2GiB")
    rows = list(failed_batch_rows((tasks, (type(err), repr(err), ["Traceback ..."]))))
    assert [(r["id"], r["file_name"], r["line"], r["kind"]) for r in rows] == [
        ("a", "images/a.png", 3, layout.INFERENCE_FAILED), ("b", "images/b-1.png", 3, layout.INFERENCE_FAILED)]
    assert all("MemoryError" in r["reason"] and "out of memory" in r["reason"] for r in rows)
    assert json.loads(rows[1]["record"])["seed"] == 12
    assert rows[0]["source"] == "gs://b/p.jsonl"


def test_out_of_memory_rows_say_so_and_what_to_change():
    """A batch the machine cannot hold: the row says out of memory, at which size and batch, and the remedy, with
    the allocator's message after it; other failures keep the plain message."""
    from transforms.inference import is_out_of_memory, is_retriable

    tasks = [ImageTask(request("a", height=512, width=256), 0), ImageTask(request("b", height=512, width=256), 0)]
    oom = "JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 72000000000 bytes.')"
    rows = list(failed_batch_rows((tasks, (RuntimeError, oom, ["Traceback ..."]))))
    for row in rows:
        assert row["reason"].startswith("out of memory: this machine cannot hold one image at 512x256 (its batch of "
                                        "2 was also tried in parts, down to one image).")
        assert "--height" in row["reason"] and "more chips" in row["reason"] and oom in row["reason"]
    fault = RuntimeError("device lost")
    (row,) = failed_batch_rows(([tasks[0]], (type(fault), repr(fault), [])))
    assert row["reason"] == f"inference failed for a batch of 1 image(s): {fault!r}"
    assert is_out_of_memory(MemoryError()) and is_out_of_memory(oom) and not is_out_of_memory(fault)
    # by status and type, not by a substring that a prompt or a path can hold
    for text in ("RuntimeError: cannot read gs://b/BLOOM/ref.png", "ValueError: prompt 'BATHROOM OOM' is too long",
                 "FileNotFoundError: /data/out of memory lane.png", "ValueError: not RESOURCE_EXHAUSTED: really"):
        assert not is_out_of_memory(text), text
    assert is_out_of_memory("XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes")
    assert is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 72000000000 bytes."))
    assert not is_out_of_memory(RuntimeError("lost device while reading BLOOM.png"))
    assert not is_retriable(MemoryError()) and not is_retriable(RuntimeError(oom)) and is_retriable(fault)


def _png_for(task, *, steps=4, guidance=1.0, truncated=False, size=None) -> bytes:
    h, w = size or (task.request.height, task.request.width)
    pixels = np.random.default_rng(task.seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return encode_png(pixels, png_text(task, num_inference_steps=steps, guidance_scale=guidance, model="m",
                                       prompt_truncated=truncated))


def test_skip_existing_keeps_checked_images_and_replaces_the_rest(tmp_path):
    out = str(tmp_path / "out")
    done, todo = ImageTask(request("done"), 0), ImageTask(request("todo"), 0)
    multi = request("multi", num_images=2).tasks()
    damaged, other = ImageTask(request("damaged"), 0), ImageTask(request("other"), 0)
    for task in (done, multi[1]):
        write_bytes_atomic(layout.join(out, task.file_name), _png_for(task))
    write_bytes_atomic(layout.join(out, damaged.file_name), _png_for(damaged)[:-20])  # cut short
    write_bytes_atomic(layout.join(out, other.file_name), _png_for(ImageTask(request("other", seed=99), 0)))
    tasks = [done, todo, *multi, damaged, other]
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        split = p | beam.Create(tasks) | SkipExisting(out)
        assert_that(split["tasks"] | "t" >> beam.Map(lambda t: t.file_name),
                    equal_to(["images/todo.png", "images/multi-0.png", "images/damaged.png", "images/other.png"]),
                    label="todo")
        assert_that(split["existing"] | "s" >> beam.Map(lambda row: (row["file_name"], row["seed"],
                                                                     row["generation_ms"])),
                    equal_to([("images/done.png", 11, None), ("images/multi-1.png", 12, None)]), label="skipped")


def test_existing_manifest_row_rebuilds_the_row_and_names_each_mismatch():
    task = ImageTask(request("a", num_inference_steps=4), 0)
    data = _png_for(task, truncated=True)
    row = existing_manifest_row(task, data, "gs://b/out/images/a.png")
    assert row["sha256"] == hashlib.sha256(data).hexdigest() and row["bytes"] == len(data)
    assert (row["prompt"], row["seed"], row["num_inference_steps"], row["guidance_scale"]) == \
        ("un café ☕ at dawn", 11, 4, 1.0)
    assert row["prompt_truncated"] is True and row["model"] == "m" and row["generation_ms"] is None
    assert list(row)[:len(layout.MANIFEST_FIELDS)] == list(layout.MANIFEST_FIELDS)
    cases = {
        "not a readable PNG": data[:-20],
        "is 48x48 (WxH)": _png_for(task, size=(48, 48)),
        "its 'seed' differs": _png_for(ImageTask(request("a", seed=5, num_inference_steps=4), 0)),
        "its 'prompt' differs": _png_for(ImageTask(request("a", prompt="x", num_inference_steps=4), 0)),
        "its 'num_inference_steps' differs": _png_for(task, steps=8),
    }
    for words, bad in cases.items():
        with pytest.raises(ExistingImageMismatch, match=re.escape(words)):
            existing_manifest_row(task, bad, "u")


def test_skip_existing_with_no_output_yet(tmp_path):
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        split = p | beam.Create([ImageTask(request("a"), 0)]) | SkipExisting(str(tmp_path / "nothing"))
        assert_that(split["tasks"] | beam.Map(lambda t: t.file_name), equal_to(["images/a.png"]))


def test_summary_figures():
    s = build_summary({"records_read": 10, "images_generated": 6, "invalid": 3, "failed": 1}, started_at=100.0,
                      finished_at=103.0, extra={"model": "m"})
    assert s["records_read"] == 10 and s["skipped"] == 0 and s["failed"] == 1
    assert s["wall_time_s"] == 3.0 and s["images_per_s"] == 2.0 and s["model"] == "m"


def test_summary_line_says_why_a_resume_made_images_again():
    s = build_summary({"records_read": 5, "images_generated": 4, "skipped": 1, "stale": 1, "damaged": 2,
                       "missing": 1}, started_at=100.0, finished_at=104.0)
    assert (s["stale"], s["damaged"], s["missing"]) == (1, 2, 1)
    line = format_summary(s)
    assert "stale (generated again) 1, damaged (generated again) 2, missing (generated again) 1" in line
    assert "damaged" not in format_summary(build_summary({"images_generated": 1}, started_at=0, finished_at=1))


def test_progress_files_and_line(tmp_path):
    folder = str(tmp_path)
    assert read_progress(folder) == (0, None)
    w1, w2 = ProgressWriter(folder, interval=0), ProgressWriter(folder, interval=0)
    w1.add(3)
    w2.add(2)
    with open(os.path.join(folder, "total"), "w") as f:
        f.write("10")
    assert read_progress(folder) == (5, 10)
    assert progress_line(5, 10, 2.5, 4.0) == "[progress] 5/10 images, 2.50 images/s, ETA 0:00:02, elapsed 0:00:04"
    assert progress_line(0, None, 0.0, 1.0).startswith("[progress] 0/? images")
