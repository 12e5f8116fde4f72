"""The image writer off the critical path: PNG/WebP/JPEG with their metadata, the encoder-thread pool run by Beam's
own runner (byte-identical outputs whatever the thread count, one manifest row per image, a failed write fails the
bundle and the rerun completes it), and a slow store (every image write delayed) that the pool's back-pressure keeps
to a bounded number of images held in memory, measured from outside the writer, with nothing lost."""

from __future__ import annotations

import hashlib
import io
import json
import os

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to
from PIL import Image

from transforms import layout
from transforms.inference import GeneratedImage
from transforms.sinks.encoding import ImageEncoding, png_text, read_image_text
from transforms.sinks.existing import ExistingImageMismatch, SkipExisting, existing_manifest_row
from transforms.sinks.files import InImages
from transforms.sinks.writes import StoreImagesFn, read_bytes
from transforms.requests import GenerationRequest, ImageTask

FORMATS = {"png": ImageEncoding("png"), "png6": ImageEncoding("png", png_compress_level=6),
           "webp": ImageEncoding("webp", quality=80), "jpeg": ImageEncoding("jpeg", quality=85)}


def _request(id="r1", num_images=1, prompt="un café ☕ at dawn", **kw):
    base = dict(id=id, prompt=prompt, seed=11, height=32, width=48, num_inference_steps=None, guidance_scale=None,
                num_images=num_images, source="gs://b/p.jsonl", line=3)
    base.update(kw)
    return GenerationRequest(**base)


def _generated(task: ImageTask) -> GeneratedImage:
    """A GeneratedImage with smooth, seeded pixels (compressible, like a real image)."""
    r = task.request
    y, x = np.mgrid[0:r.height, 0:r.width]
    rng = np.random.default_rng(task.seed)
    pixels = (x[..., None] * 3 + y[..., None] * 2 + rng.integers(0, 24, (r.height, r.width, 3))) % 256
    return GeneratedImage(task=task, pixels=pixels.astype(np.uint8), num_inference_steps=4, guidance_scale=1.0,
                          prompt_truncated=False, model="gs://m/klein", generation_ms=12.5)


def _results(n: int) -> list[GeneratedImage]:
    tasks = [t for i in range(n // 2) for t in _request(f"img{i:03d}", num_images=2).tasks()]
    return [_generated(t) for t in tasks]


def _write(results, output, encoding, threads, max_in_flight=None):
    """Run Create(results) -> StoreImagesFn (as the files sink runs it) -> WriteToText on FnApiRunner; the manifest
    rows and the runner's metrics. The rows go to a local file next to a local output (to a temporary folder for a gs:// one)."""
    import tempfile

    rows_prefix = os.path.join(tempfile.mkdtemp(prefix="rows-"), "manifest")
    p = beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"]))
    _ = (p | beam.Create(results, reshuffle=False)
         | beam.ParDo(StoreImagesFn(InImages(str(output), encoding), encoding, threads=threads,
                                    max_in_flight=max_in_flight))
         | beam.Map(layout.to_json_line)
         | beam.io.WriteToText(rows_prefix, file_name_suffix=".jsonl", num_shards=1))
    result = p.run()
    result.wait_until_finish()
    with open(rows_prefix + "-00000-of-00001.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return rows, result.metrics().query()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_carries_the_text_and_skip_existing_recognises_it(name):
    encoding = FORMATS[name]
    task = _request(num_images=2).tasks()[1]
    gen = _generated(task)
    text = png_text(task, num_inference_steps=4, guidance_scale=1.0, model="gs://m/klein", prompt_truncated=False)
    data = encoding.encode(gen.pixels, text)
    assert data == encoding.encode(gen.pixels, text)  # deterministic: a retry writes the same bytes
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}[encoding.format]
        assert read_image_text(im) == text  # the prompt and every parameter, non-ASCII included
    stored = encoding.stored_name(task.file_name)
    assert stored == "images/r1-1." + layout.IMAGE_EXTENSIONS[encoding.format]
    row = existing_manifest_row(task, data, "gs://b/o/" + stored, encoding)
    assert row["file_name"] == stored and row["sha256"] == hashlib.sha256(data).hexdigest()
    assert row["prompt"] == task.request.prompt and row["num_inference_steps"] == 4
    with pytest.raises(ExistingImageMismatch, match="another request"):
        existing_manifest_row(_request(num_images=2, prompt="another").tasks()[1], data, "x", encoding)
    with pytest.raises(ExistingImageMismatch, match="not a readable"):
        existing_manifest_row(task, data[: len(data) // 2], "x", encoding)
    other = ImageEncoding("jpeg") if encoding.format != "jpeg" else ImageEncoding("png")
    with pytest.raises(ExistingImageMismatch, match=f"not {'JPEG' if other.format == 'jpeg' else 'PNG'}"):
        existing_manifest_row(task, data, "x", other)


def test_jpeg_keeps_a_prompt_too_long_for_its_exif_as_a_hash():
    """A JPEG's EXIF holds at most 64 KiB: a 60 KiB non-ASCII prompt is kept as its sha256 and still recognised."""
    task = _request(prompt="☕" * 20_000).tasks()[0]
    encoding = ImageEncoding("jpeg")
    text = png_text(task, num_inference_steps=4, guidance_scale=1.0, model="m")
    data = encoding.encode(_generated(task).pixels, text)
    with Image.open(io.BytesIO(data)) as im:
        kept = read_image_text(im)
    assert "prompt" not in kept and kept["prompt_sha256"] == hashlib.sha256(task.request.prompt.encode()).hexdigest()
    assert existing_manifest_row(task, data, "x", encoding)["prompt"] == task.request.prompt
    with pytest.raises(ExistingImageMismatch, match="prompt_sha256"):
        existing_manifest_row(_request(prompt="☕" * 20_001).tasks()[0], data, "x", encoding)


@pytest.mark.parametrize("bad, message", [
    (dict(format="gif"), "--image_format='gif'"), (dict(png_compress_level=10), "--png_compress_level=10"),
    (dict(quality=0), "--quality=0"), (dict(quality=True), "--quality=True")])
def test_bad_encoding_values_are_named(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ImageEncoding(**bad)
    with pytest.raises(ValueError, match="--encode_threads=0"):
        StoreImagesFn(InImages("out"), threads=0)


@pytest.mark.parametrize("name", ["png", "webp", "jpeg"])
def test_outputs_are_byte_identical_whatever_the_thread_count(tmp_path, name):
    encoding = FORMATS[name]
    results = _results(12)
    outputs = {}
    for threads in (1, 2, 4):
        out = tmp_path / f"t{threads}"
        rows, _ = _write(results, out, encoding, threads)
        files = {f: (out / "images" / f).read_bytes() for f in sorted(os.listdir(out / "images"))}
        assert len(files) == len(results) and not [f for f in files if f.endswith(".tmp")]  # atomic: no leftovers
        assert sorted(r["file_name"] for r in rows) == sorted(f"images/{f}" for f in files)  # one row per image
        for row in rows:
            assert row["sha256"] == hashlib.sha256(files[row["file_name"].split("/")[1]]).hexdigest()
        outputs[threads] = (files, sorted(json.dumps({k: v for k, v in r.items() if k != "uri"}) for r in rows))
    assert outputs[1] == outputs[2] == outputs[4]


def test_a_failed_write_fails_the_bundle_and_the_rerun_completes_it(tmp_path):
    """One image cannot be stored (a folder has its name): the job fails instead of dropping it, leaves no partial
    file, and once the obstacle is gone a rerun (what a retried bundle does) writes every image, same bytes."""
    results = _results(8)
    out = tmp_path / "out"
    blocker = out / "images" / "img002-1.png"
    blocker.mkdir(parents=True)
    with pytest.raises(Exception, match="img002-1"):
        _write(results, out, ImageEncoding(), threads=2)
    assert not [f for f in os.listdir(out / "images") if f.endswith(".tmp")]
    blocker.rmdir()
    rows, _ = _write(results, out, ImageEncoding(), threads=2)
    assert len(rows) == 8 and len(os.listdir(out / "images")) == 8
    reference, _ = _write(results, tmp_path / "ref", ImageEncoding(), threads=1)
    for row in rows:
        name = row["file_name"].split("/")[1]
        assert (out / "images" / name).read_bytes() == (tmp_path / "ref" / "images" / name).read_bytes()


def test_skip_existing_lists_the_images_of_the_jobs_format(tmp_path):
    out = str(tmp_path / "out")
    webp = ImageEncoding("webp")
    results = _results(4)
    _write(results[:2], out, webp, threads=2)
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        split = p | beam.Create([r.task for r in results]) | SkipExisting(out, webp)
        assert_that(split["existing"] | "Skipped" >> beam.Map(lambda r: r["file_name"]),
                    equal_to(["images/img000-0.webp", "images/img000-1.webp"]), label="CheckSkipped")
        # The tasks keep their own (format-free) names; the writer gives them the format's extension.
        assert_that(split["tasks"] | "Todo" >> beam.Map(lambda t: t.file_name),
                    equal_to(["images/img001-0.png", "images/img001-1.png"]), label="CheckTodo")


def test_slow_store_holds_a_bounded_number_of_images_and_loses_none(tmp_path, monkeypatch):
    """Every image write is delayed: measured from outside the writer (weak references to every image handed to
    it, counted by the slow store at each write and by the feeder after each new image), at most `max_in_flight`
    images plus the one being handed over are alive at once, the bound is reached (the store is the bottleneck),
    and every image arrives with the sha256 of its manifest row. The writer is driven directly, so no runner holds
    copies of the elements: what is alive is what the writer keeps."""
    import threading
    import time
    import weakref

    from apache_beam.transforms.window import GlobalWindow
    from apache_beam.utils.timestamp import MIN_TIMESTAMP

    from transforms.sinks import writes

    n, limit = 16, 3
    handed: list = []  # a weak reference to every GeneratedImage handed to the writer
    peak = {"store": 0, "feeder": 0}
    lock = threading.Lock()
    real_write = writes.write_bytes_atomic

    def note(where):
        with lock:
            peak[where] = max(peak[where], sum(ref() is not None for ref in handed))

    def slow_write(uri, data, **kwargs):
        note("store")
        time.sleep(0.05)
        real_write(uri, data, **kwargs)

    monkeypatch.setattr(writes, "write_bytes_atomic", slow_write)
    out = str(tmp_path / "slow")
    tasks = [t for i in range(n // 2) for t in _request(f"img{i:03d}", num_images=2, height=256, width=256).tasks()]
    fn = StoreImagesFn(InImages(out), ImageEncoding(), threads=2, max_in_flight=limit)
    fn.setup()
    rows = []
    try:
        fn.start_bundle()
        for task in tasks:
            result = _generated(task)  # made just in time, as the generation stage hands them over
            handed.append(weakref.ref(result))
            note("feeder")
            rows += [w.value for w in fn.process(result, window=GlobalWindow(), timestamp=MIN_TIMESTAMP)]
            del result
        rows += [w.value for w in fn.finish_bundle()]
    finally:
        fn.teardown()
    assert max(peak.values()) <= limit + 1, peak  # the writer's `limit` plus the image being handed over
    assert peak["feeder"] == limit + 1, peak  # the bound was reached: the store was the bottleneck
    assert len(rows) == n and len({r["file_name"] for r in rows}) == n
    for row in rows:
        assert hashlib.sha256(read_bytes(row["uri"])).hexdigest() == row["sha256"]
    assert len(os.listdir(os.path.join(out, "images"))) == n
    assert all(ref() is None for ref in handed)  # nothing kept once written
