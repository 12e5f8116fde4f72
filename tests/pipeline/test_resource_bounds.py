"""Resource bounds: what one request (or one job) may ask for is bounded, with a clear error naming the limit.

Enforced (transforms/inputs/, pipeline/graph.py):
- `--max_pixels` (default 4 MP) for every record and for the job's own defaults;
- images per request (`num_images` <= 64), steps (<= 1000), seed range;
- a request's images are generated `--batch_size` at a time, never all at once;
- `--max_prompt_bytes` (default 64 KiB of UTF-8) per prompt;
- a maximum line length while reading (16 MiB), read in bounded chunks: a longer line is one error row;
- `--max_images` (default 10,000,000) per job: a job over it fails before generating anything.
"""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from model.contract import DEFAULT_MAX_PROMPT_BYTES, MAX_IMAGES_PER_REQUEST
from transforms.inputs.lines import MAX_LINE_BYTES
from transforms.inputs.readers import iter_raw_records, parse_lines
from transforms.inputs.validation import RequestDefaults
from transforms.requests import GenerationRequest


def _one(record: dict, defaults: RequestDefaults):
    out = parse_lines(json.dumps(record).encode(), "b.jsonl", "jsonl", defaults)
    assert len(out) == 1
    return out[0]


def test_max_pixels_is_enforced_per_record_with_the_limit_in_the_reason():
    d = RequestDefaults(height=32, width=32, max_pixels=64 * 64)
    assert isinstance(_one({"prompt": "p", "height": 64, "width": 64}, d), GenerationRequest)  # at the limit
    row = _one({"prompt": "p", "height": 64, "width": 80}, d)
    assert isinstance(row, dict) and "--max_pixels=4096" in row["reason"] and "64x80" in row["reason"]
    # the model's contract names the limit by field; the job's row names the option
    from model import contract
    from model.errors import RequestError

    with pytest.raises(RequestError, match="above max_pixels=4096") as e:
        contract.validate(prompt="p", height=64, width=80, limits=contract.Limits(max_pixels=4096))
    assert "--" not in str(e.value)
    # the default limit: 4 megapixels
    row = _one({"prompt": "p", "height": 2048, "width": 2064}, RequestDefaults())
    assert isinstance(row, dict) and "max_pixels" in row["reason"]


def test_max_pixels_option_reaches_validation_and_checks_the_defaults(tmp_path, tiny_ckpt):
    from pipeline.errors import UsageError
    from pipeline.launch import resolve_job

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    base = [f"--model={tiny_ckpt}", f"--input={prompts}"]
    job = resolve_job(PipelineOptions(base + ["--max_pixels=4096", "--height=64", "--width=64"]))
    assert job.defaults.max_pixels == 4096
    assert isinstance(_one({"prompt": "p", "height": 80, "width": 64}, job.defaults), dict)
    with pytest.raises(UsageError, match="max_pixels"):
        resolve_job(PipelineOptions(base + ["--max_pixels=4096", "--height=128", "--width=128"]))
    with pytest.raises(UsageError, match="max_pixels"):
        resolve_job(PipelineOptions(base + ["--max_pixels=0"]))


def test_images_per_request_steps_and_seeds_are_bounded(tmp_path, tiny_ckpt):
    from pipeline.errors import UsageError
    from pipeline.launch import resolve_job

    d = RequestDefaults(height=32, width=32)
    for record, words in [({"num_images": MAX_IMAGES_PER_REQUEST + 1}, "num_images must be in [1, 64]"),
                          ({"num_images": 10**12}, "num_images must be in"),
                          ({"num_inference_steps": 10**9}, "num_inference_steps must be in [1, 1000]"),
                          ({"seed": 2**64}, "seed must be a non-negative integer")]:
        row = _one({"prompt": "p", **record}, d)
        assert isinstance(row, dict) and words in row["reason"], row
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError, match="num_images"):
        resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}", "--num_images=65"]))


def test_a_request_for_many_images_is_generated_batch_size_at_a_time():
    import apache_beam as beam
    from apache_beam.testing.util import assert_that

    from transforms.inference import BatchByShape

    r = _one({"id": "many", "prompt": "p", "num_images": MAX_IMAGES_PER_REQUEST}, RequestDefaults(32, 32))

    def check(batches):
        sizes = sorted(len(b) for b in batches)
        assert sum(sizes) == MAX_IMAGES_PER_REQUEST and max(sizes) <= 4, sizes

    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        batches = p | beam.Create(r.tasks()) | BatchByShape(4)
        assert_that(batches, check)


# --------------------------------------------------------------------------------------------- not yet enforced
@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_prompt_size_is_bounded(fmt):
    limit = RequestDefaults().max_prompt_bytes
    assert limit == DEFAULT_MAX_PROMPT_BYTES == 64 * 1024
    big = "a" * (10 * 1024 * 1024)
    data = json.dumps({"prompt": big}).encode() if fmt == "jsonl" else big.encode()
    out = parse_lines(data, "big." + fmt, fmt, RequestDefaults(32, 32))
    # a 10 MB prompt would otherwise become 10 MB PNG text chunks and manifest rows
    assert isinstance(out[0], dict) and out[0]["field"] == "prompt", out[0]["reason"]
    assert f"{len(big)} bytes" in out[0]["reason"] and f"--max_prompt_bytes={limit}" in out[0]["reason"]
    ok = "é" * (limit // 2)  # exactly at the limit, in UTF-8 bytes
    assert isinstance(parse_lines(json.dumps({"prompt": ok}).encode(), "p", "jsonl", RequestDefaults(32, 32))[0],
                      GenerationRequest)
    row = parse_lines(json.dumps({"prompt": ok + "a"}).encode(), "p", "jsonl", RequestDefaults(32, 32))[0]
    assert isinstance(row, dict) and f"{limit + 1} bytes" in row["reason"]
    # the option reaches validation
    small = RequestDefaults(32, 32, max_prompt_bytes=4)
    assert isinstance(parse_lines(b"abcd\nabcde\n", "p.txt", "text", small)[0], GenerationRequest)
    assert isinstance(parse_lines(b"abcd\nabcde\n", "p.txt", "text", small)[1], dict)


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
    assert peak <= size // 2, f"a {size >> 20} MB line was read whole (peak {peak >> 20} MB)"
    assert out[0].error is not None and "long" in out[0].error["reason"]
    assert f"{size} bytes" in out[0].error["reason"] and len(out[0].error["record"]) < 1000


def test_a_line_over_the_cap_is_one_error_row_and_the_file_goes_on():
    cap = MAX_LINE_BYTES
    data = b"first\n" + b"x" * cap + b"\n" + b"y" * (cap + 1) + b"\r\nlast\n"
    out = [r for r in iter_raw_records(io.BufferedReader(io.BytesIO(data)), "f.txt", "text")]
    assert [r.line for r in out] == [1, 2, 3, 4]
    assert out[0].fields["prompt"] == "first" and out[3].fields["prompt"] == "last"
    assert out[1].error is None and len(out[1].text) == cap  # exactly at the cap: read
    assert out[2].error is not None and "too long" in out[2].error["reason"] and out[2].error["field"] == "record"


def test_images_per_job_is_bounded(tmp_path, tiny_ckpt):
    """A job that plans more images than --max_images fails before generating anything: one `error:` line naming
    the limit (no ERROR log line, no traceback), exit 2, and nothing made under the output (no empty manifest/ or
    errors/ folder, not even the output folder)."""
    import subprocess
    import sys
    from pathlib import Path

    from pipeline.options import Flux2KleinOptions

    assert PipelineOptions([]).view_as(Flux2KleinOptions).max_images == 10_000_000
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "num_images": 2}\n{"prompt": "b"}\n')
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pipeline.run", f"--model={tiny_ckpt}",
                           f"--input={tmp_path / 'p.jsonl'}", f"--output={out}", "--height=32", "--width=32",
                           "--max_images=2", "--no_progress"], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: the job would generate 3 images, above --max_images=2"), \
        proc.stderr[-3000:]
    assert "[while running" not in lines[0]
    assert not out.exists(), sorted(map(str, out.rglob("*")))
