"""`vae=` / `--vae`: another VAE in place of the checkpoint's, as FLUX.2's small decoder (decoder_block_out_channels
narrower than the encoder's). Parity: our images with the swapped VAE against diffusers' Flux2KleinPipeline with
that AutoencoderKLFlux2, on tiny random weights, within the suite's 4/255."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import model
from model.errors import CheckpointError
from model.loading.vae_swap import vae_files, vae_identity

MAX_LEN = 32
DECODER_CHANNELS = (12, 4)  # the tiny checkpoint's encoder has (8, 16): a decoder of other widths


@pytest.fixture(scope="module")
def small_decoder_vae(tmp_path_factory, tiny_ckpt):
    """A VAE saved as the small decoder's repository is: config.json and one safetensors file of another name."""
    from diffusers import AutoencoderKLFlux2
    from safetensors.torch import save_file

    from tiny_klein.builder import _perturb_

    config = json.load(open(os.path.join(tiny_ckpt, "vae", "config.json")))
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    vae = AutoencoderKLFlux2(**{**kwargs, "decoder_block_out_channels": DECODER_CHANNELS})
    _perturb_("vae", vae, seed=11)
    folder = tmp_path_factory.mktemp("small_decoder")
    vae.save_config(str(folder))
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()},
              str(folder / "full_encoder_small_decoder.safetensors"))
    return vae, str(folder / "full_encoder_small_decoder.safetensors")


def test_the_swapped_vae_matches_diffusers(tiny_ckpt, small_decoder_vae):
    from diffusers import Flux2KleinPipeline

    vae, weights = small_decoder_vae
    gen = model.load(tiny_ckpt, dtype="float32", max_sequence_length=MAX_LEN, vae=weights)
    assert gen.config.vae.block_out_channels == DECODER_CHANNELS
    assert gen.config.vae.encoder_block_out_channels == (8, 16)
    prompts, seeds = ["a red fox in snow", "a lighthouse"], [3, 4]
    ours = gen.generate(prompts, seeds, height=32, width=32, num_inference_steps=2)
    pipe = Flux2KleinPipeline.from_pretrained(tiny_ckpt, vae=vae.eval(), torch_dtype=torch.float32)
    noise = np.stack([model.initial_noise(s, gen.noise_shape(32, 32)) for s in seeds])
    ref = pipe(prompt=prompts, height=32, width=32, num_inference_steps=2, latents=torch.from_numpy(noise),
               output_type="np", max_sequence_length=MAX_LEN).images
    diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64) * 255.0)
    assert diff.max() <= 4.0 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    assert ref.std() > 0.05


def test_sources_and_identity(tmp_path, tiny_ckpt, small_decoder_vae):
    _, weights = small_decoder_vae
    folder = os.path.dirname(weights)
    by_file, by_folder = vae_files(weights), vae_files(folder)
    assert by_file == by_folder and by_file.config.endswith("config.json") and by_file.folder is None
    assert vae_identity(by_file) == vae_identity(by_folder)
    own = vae_files(os.path.join(tiny_ckpt, "vae"))  # a sharded component folder: read as it is
    assert own.folder is not None and len(own.weights) > 1 and vae_identity(own) != vae_identity(by_file)
    with pytest.raises(CheckpointError, match="does not exist"):
        vae_files(str(tmp_path / "nowhere"))
    lone = tmp_path / "lone"
    lone.mkdir()
    os.symlink(weights, lone / "vae.safetensors")
    with pytest.raises(CheckpointError, match="no config.json"):
        vae_files(str(lone / "vae.safetensors"))
