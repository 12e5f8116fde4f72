"""--vae at launch: checked like the checkpoint's own weights (config, shapes from the header: exit 2 naming the
tensor), and part of the model fingerprint (a resume never keeps an image made with another VAE)."""

import json
import os

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.errors import UsageError
from pipeline.launch import resolve_job


@pytest.fixture(scope="module")
def narrow_vae(tmp_path_factory, tiny_ckpt):
    """A VAE whose decoder is narrower than its encoder, saved as a folder with config.json and one file."""
    from diffusers import AutoencoderKLFlux2
    from safetensors.torch import save_file

    config = json.load(open(os.path.join(tiny_ckpt, "vae", "config.json")))
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    vae = AutoencoderKLFlux2(**{**kwargs, "decoder_block_out_channels": (4, 8)})
    folder = tmp_path_factory.mktemp("narrow")
    vae.save_config(str(folder))
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(folder / "small_decoder.safetensors"))
    return folder


def _job(tiny_ckpt, tmp_path, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    return resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}", f"--output={tmp_path / 'o'}",
                                        *extra]))


def test_a_vae_is_checked_at_launch_and_in_the_fingerprint(tiny_ckpt, tmp_path, narrow_vae):
    plain = _job(tiny_ckpt, tmp_path)
    swapped = _job(tiny_ckpt, tmp_path, f"--vae={narrow_vae / 'small_decoder.safetensors'}")
    assert swapped.load.vae == str(narrow_vae / "small_decoder.safetensors")
    assert swapped.model_fingerprint != plain.model_fingerprint
    assert _job(tiny_ckpt, tmp_path, f"--vae={narrow_vae}").model_fingerprint == swapped.model_fingerprint
    # The config says other decoder widths than the weights hold: the first mis-shaped tensor is named.
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.load(open(narrow_vae / "config.json"))
    (bad / "config.json").write_text(json.dumps({**config, "decoder_block_out_channels": [8, 8]}))
    os.symlink(narrow_vae / "small_decoder.safetensors", bad / "small_decoder.safetensors")
    with pytest.raises(UsageError, match=r"--vae=.*cannot replace the checkpoint's VAE: CheckpointError.*tensor='decoder\."):
        _job(tiny_ckpt, tmp_path, f"--vae={bad}")
    with pytest.raises(UsageError, match="--vae=.*does not exist"):
        _job(tiny_ckpt, tmp_path, f"--vae={tmp_path / 'missing.safetensors'}")
