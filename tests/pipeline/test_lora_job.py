"""--lora at launch: each adapter checked from its header against the checkpoint's transformer (a key that fits no
parameter stops the launch, naming it), and its content and scale in the model fingerprint (a resume never keeps an
image made with another adapter or scale)."""

from __future__ import annotations

import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from safetensors.numpy import save_file

from pipeline.errors import UsageError
from pipeline.launch import resolve_job


def _adapter(path, rows=96, seed=0):
    """A BFL-layout adapter of the tiny transformer's first double block's image q/k/v (inner width 32)."""
    rng = np.random.default_rng(seed)
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": rng.standard_normal((4, 32), np.float32),
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": rng.standard_normal((rows, 4),
                                                                                                 np.float32)},
              str(path))
    return str(path)


def _job(tiny_ckpt, tmp_path, *loras, extra=()):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    return resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}",
                                        *(f"--lora={lora}" for lora in loras), *extra]))


def test_adapters_are_in_the_model_fingerprint(tiny_ckpt, tmp_path):
    style, other = _adapter(tmp_path / "style.safetensors"), _adapter(tmp_path / "other.safetensors", seed=1)
    plain = _job(tiny_ckpt, tmp_path)
    job = _job(tiny_ckpt, tmp_path, f"{style}:0.5")
    assert [(s.label, s.scale) for s in job.load.loras] == [("style", 0.5)]
    fingerprints = {plain.model_fingerprint, job.model_fingerprint,
                    _job(tiny_ckpt, tmp_path, f"{style}:0.6").model_fingerprint,
                    _job(tiny_ckpt, tmp_path, f"{other}:0.5").model_fingerprint}
    assert len(fingerprints) == 4  # no adapter, another scale, another adapter: each another model
    # The name records pick an adapter by does not make another model.
    assert _job(tiny_ckpt, tmp_path, f"renamed={style}:0.5").model_fingerprint == job.model_fingerprint


def test_adapter_that_fits_no_parameter_stops_the_launch(tiny_ckpt, tmp_path):
    bad = _adapter(tmp_path / "bad.safetensors", rows=90)
    with pytest.raises(UsageError, match=r"--lora.*img_attn\.qkv\.lora_B\.weight.*bad\.safetensors"):
        _job(tiny_ckpt, tmp_path, bad)
    with pytest.raises(UsageError, match="--lora"):
        _job(tiny_ckpt, tmp_path, str(tmp_path / "missing.safetensors"))


def test_per_record_adapters_are_the_records_to_name_not_the_models(tiny_ckpt, tmp_path):
    """--lora_per_record: the records may name the adapters (their identities in the request defaults), the workers
    load them unmerged, and the model fingerprint is the plain model's (each image's own adapter is in its request
    fingerprint)."""
    style = _adapter(tmp_path / "style.safetensors")
    job = _job(tiny_ckpt, tmp_path, f"{style}:0.5", extra=["--lora_per_record"])
    assert job.load.lora_per_record and [s.label for s in job.load.loras] == ["style"]
    assert [(name, scale) for name, _, scale in job.defaults.loras] == [("style", 0.5)]
    assert job.model_fingerprint == _job(tiny_ckpt, tmp_path).model_fingerprint
    assert _job(tiny_ckpt, tmp_path, f"{style}:0.5").defaults.loras == ()  # merged: no record names one


def test_a_job_with_per_record_adapters_records_each_images_adapter_and_resumes_by_it(tiny_ckpt, tmp_path):
    """A job whose records name two adapters or none: each manifest row names its image's adapter, an unknown name is
    an error row, and a resume after one adapter's scale changed makes again only that adapter's images."""
    import json

    from pipeline.run import main
    from tests.support.pipeline_helpers import rows

    wc, ink = _adapter(tmp_path / "wc.safetensors", seed=2), _adapter(tmp_path / "ink.safetensors", seed=3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "base", "prompt": "a fox"}, {"id": "wc", "prompt": "a fox", "lora": "wc"},
        {"id": "ink", "prompt": "a fox", "lora": "ink"}, {"id": "bad", "prompt": "a fox", "lora": "oil"}]))
    out = str(tmp_path / "out")
    args = [f"--model={tiny_ckpt}", f"--input={prompts}", f"--output={out}", "--dtype=float32", "--height=32",
            "--width=32", "--max_sequence_length=32", "--no_progress", "--lora_per_record", f"--lora=wc={wc}:0.5"]
    assert main([*args, f"--lora=ink={ink}"]) == 0
    made = {r["id"]: r for r in rows(out, "manifest")}
    assert set(made) == {"base", "wc", "ink"} and "lora" not in made["base"]
    assert made["wc"]["lora"]["name"] == "wc" and made["wc"]["lora"]["scale"] == 0.5
    assert len({made[i]["sha256"] for i in made}) == 3  # three adapters (none, wc, ink): three images
    (error,) = rows(out, "errors")
    assert error["field"] == "lora" and error["value"] == "oil" and "['wc', 'ink']" in error["reason"]
    main([*args, f"--lora=ink={ink}:0.7", "--skip_existing"])
    assert {r["id"] for r in rows(out, "existing")} == {"base", "wc"}  # ink's scale changed: made again
