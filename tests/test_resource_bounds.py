"""Resource bounds: what one request (or one job) may ask for is bounded, with a clear error naming the limit.

Enforced today (transforms/requests.py, pipeline/run.py):
- `--max_pixels` (default 4 MP) for every record and for the job's own defaults;
- images per request (`num_images` <= 64), steps (<= 1000), seed range;
- a request's images are generated `--batch_size` at a time, never all at once.
Not enforced yet (tests xfail with what is missing; see the issue 6 report for the exact change):
- a maximum prompt size in bytes (a 10 MB JSONL/text prompt is accepted today);
- a maximum line length while reading (a line is read whole into memory before it is parsed);
- a maximum number of images per job.
"""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from transforms import requests as req
from transforms.requests import GenerationRequest, RequestDefaults, iter_raw_records, parse_lines


def _one(record: dict, defaults: RequestDefaults):
    out = parse_lines(json.dumps(record).encode(), "b.jsonl", "jsonl", defaults)
    assert len(out) == 1
    return out[0]


def test_max_pixels_is_enforced_per_record_with_the_limit_in_the_reason():
    d = RequestDefaults(height=32, width=32, max_pixels=64 * 64)
    assert isinstance(_one({"prompt": "p", "height": 64, "width": 64}, d), GenerationRequest)  # at the limit
    row = _one({"prompt": "p", "height": 64, "width": 80}, d)
    assert isinstance(row, dict) and "--max_pixels=4096" in row["reason"] and "64x80" in row["reason"]
    # the default limit: 4 megapixels
    row = _one({"prompt": "p", "height": 2048, "width": 2064}, RequestDefaults())
    assert isinstance(row, dict) and "max_pixels" in row["reason"]


def test_max_pixels_option_reaches_validation_and_checks_the_defaults(tmp_path):
    from pipeline.run import UsageError, resolve_job

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    base = [f"--model={tmp_path}", f"--input={prompts}"]
    job = resolve_job(PipelineOptions(base + ["--max_pixels=4096", "--height=64", "--width=64"]))
    assert job.defaults.max_pixels == 4096
    assert isinstance(_one({"prompt": "p", "height": 80, "width": 64}, job.defaults), dict)
    with pytest.raises(UsageError, match="max_pixels"):
        resolve_job(PipelineOptions(base + ["--max_pixels=4096", "--height=128", "--width=128"]))
    with pytest.raises(UsageError, match="max_pixels"):
        resolve_job(PipelineOptions(base + ["--max_pixels=0"]))


def test_images_per_request_steps_and_seeds_are_bounded(tmp_path):
    from pipeline.run import UsageError, resolve_job

    d = RequestDefaults(height=32, width=32)
    for record, words in [({"num_images": req.MAX_IMAGES_PER_REQUEST + 1}, "num_images must be in [1, 64]"),
                          ({"num_images": 10**12}, "num_images must be in"),
                          ({"num_inference_steps": 10**9}, "num_inference_steps must be in [1, 1000]"),
                          ({"seed": 2**64}, "seed must be a non-negative integer")]:
        row = _one({"prompt": "p", **record}, d)
        assert isinstance(row, dict) and words in row["reason"], row
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError, match="num_images"):
        resolve_job(PipelineOptions([f"--model={tmp_path}", f"--input={prompts}", "--num_images=65"]))


def test_a_request_for_many_images_is_generated_batch_size_at_a_time():
    import apache_beam as beam
    from apache_beam.testing.util import assert_that

    from transforms.inference import BatchByShape

    r = _one({"id": "many", "prompt": "p", "num_images": req.MAX_IMAGES_PER_REQUEST}, RequestDefaults(32, 32))

    def check(batches):
        sizes = sorted(len(b) for b in batches)
        assert sum(sizes) == req.MAX_IMAGES_PER_REQUEST and max(sizes) <= 4, sizes

    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        batches = p | beam.Create(r.tasks()) | BatchByShape(4)
        assert_that(batches, check)


# --------------------------------------------------------------------------------------------- not yet enforced
def _prompt_limit():
    for name in ("MAX_PROMPT_BYTES", "DEFAULT_MAX_PROMPT_BYTES"):
        if hasattr(req, name):
            return getattr(req, name)
    if "max_prompt_bytes" in {f.name for f in __import__("dataclasses").fields(RequestDefaults)}:
        return RequestDefaults().max_prompt_bytes
    return None


@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_prompt_size_is_bounded(fmt):
    limit = _prompt_limit()
    big = "a" * (10 * 1024 * 1024)
    data = json.dumps({"prompt": big}).encode() if fmt == "jsonl" else big.encode()
    out = parse_lines(data, "big." + fmt, fmt, RequestDefaults(32, 32))
    if limit is None and isinstance(out[0], GenerationRequest):
        pytest.xfail("MISSING (transforms/requests.py): no maximum prompt size; a 10 MB prompt becomes a request "
                     "(and 10 MB PNG text chunks and manifest rows)")
    # rejected as a prompt above the limit, or already as a line above the reader's line cap
    assert isinstance(out[0], dict) and "bytes" in out[0]["reason"] and out[0]["field"] in ("prompt", "record")
    if limit is not None:
        ok = "é" * (limit // 2)
        assert isinstance(parse_lines(json.dumps({"prompt": ok}).encode(), "p", "jsonl", RequestDefaults(32, 32))[0],
                          GenerationRequest)


class _EndlessLine(io.RawIOBase):
    """`size` bytes of 'a' with no line break, produced lazily (a file someone forgot the newlines in)."""

    def __init__(self, size: int):
        self._left = size

    def readable(self):
        return True

    def readinto(self, b):
        n = min(len(b), self._left)
        b[:n] = b"a" * n
        self._left -= n
        return n


def test_reading_a_line_is_bounded_in_memory():
    size = 64 * 1024 * 1024
    tracemalloc.start()
    try:
        out = [r for r in iter_raw_records(io.BufferedReader(_EndlessLine(size)), "huge.txt", "text")]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(out) == 1
    if peak > size // 2:
        pytest.xfail(f"MISSING (transforms/requests.py _decoded_lines): a {size >> 20} MB line is read whole "
                     f"(peak {peak >> 20} MB); read lines with a length cap and reject longer ones as error rows")
    assert out[0].error is not None and "long" in out[0].error["reason"]


def test_images_per_job_is_bounded(tmp_path):
    """A job that plans more images than --max_images fails before generating anything, naming the limit."""
    from pipeline.options import Flux2KleinOptions
    from pipeline.run import run

    names = set(PipelineOptions([]).view_as(Flux2KleinOptions).get_all_options())
    if "max_images" not in names:
        pytest.xfail("MISSING (pipeline/options.py, pipeline/run.py): no --max_images (per-job image limit)")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "num_images": 2}\n{"prompt": "b"}\n')
    (tmp_path / "model").mkdir()  # never loaded: the limit stops the job first
    out = tmp_path / "out"
    with pytest.raises(Exception) as e:
        run([f"--model={tmp_path / 'model'}", f"--input={tmp_path / 'p.jsonl'}", f"--output={out}", "--height=32",
             "--width=32", "--max_images=2", "--runner=FnApiRunner", "--no_progress"])
    assert "--max_images=2" in str(e.value) and "3 images" in str(e.value), str(e.value)[:1000]
    assert not (out / "images").exists() and not (out / "summary.json").exists()
