"""One request contract: the job accepts exactly the sizes `generate()` accepts, read from the checkpoint's VAE.

The tiny checkpoints' VAEs are not the published one (scale 8, sizes in multiples of 16): a checkpoint with a
three-block VAE (scale 4, multiples of 8) must get images at 8-multiples that are not 16-multiples, and a record
whose size is not a multiple of 8 is an invalid record naming the multiple, never an inference failure.
"""

import json

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline_helpers import rows

SIZES = [8, 16, 24, 28, 32, 36, 40, 48, 12, 20]


@pytest.fixture(scope="module")
def ckpt_scale4(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(vae_block_out_channels=(8, 8, 16))


def _accepted_by_generate(gen, height, width) -> bool:
    import model

    try:
        gen.check_inputs(["p"], [0], height, width)
        return True
    except model.RequestError:
        return False


def test_job_and_generate_accept_the_same_sizes(ckpt_scale4, tmp_path):
    import model
    from pipeline.launch import resolve_job
    from transforms.inputs.readers import parse_lines
    from transforms.requests import GenerationRequest

    gen = model.load(ckpt_scale4, dtype="float32", max_sequence_length=16)
    assert gen.size_multiple == 8  # not the published 16: the job must not assume it
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    job = resolve_job(PipelineOptions([f"--model={ckpt_scale4}", f"--input={prompts}", "--height=24", "--width=40"]))
    assert job.defaults.size_multiple == 8
    records = [{"prompt": "p", "height": h, "width": w} for h in SIZES for w in (8, 20)]
    parsed = parse_lines("\n".join(json.dumps(r) for r in records).encode(), "s.jsonl", "jsonl", job.defaults)
    for record, out in zip(records, parsed):
        by_job = isinstance(out, GenerationRequest)
        assert by_job == _accepted_by_generate(gen, record["height"], record["width"]), (record, out)
        if not by_job:
            assert "positive multiple of 8" in out["reason"] and out["field"] in ("height", "width"), out
    assert sum(isinstance(o, GenerationRequest) for o in parsed) == sum(s % 8 == 0 for s in SIZES)  # width 8 only


def test_job_generates_the_checkpoint_sizes_and_rejects_the_others(ckpt_scale4, tmp_path):
    from pipeline.run import run

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "ok", "prompt": "a cat", "height": 24, "width": 40}\n'
                       '{"id": "bad", "prompt": "a dog", "height": 20, "width": 40}\n')
    out = tmp_path / "out"
    _, summary = run([f"--model={ckpt_scale4}", f"--input={prompts}", f"--output={out}", "--dtype=float32",
                      "--max_sequence_length=16", "--num_inference_steps=1", "--batch_size=1", "--no_progress"])
    assert summary["images_generated"] == 1 and summary["invalid"] == 1 and summary["failed"] == 0
    (error,) = rows(str(out), "errors")
    assert error["id"] == "bad" and error["field"] == "height" and "positive multiple of 8" in error["reason"]
    (row,) = rows(str(out), "manifest")
    assert (row["id"], row["height"], row["width"]) == ("ok", 24, 40)
