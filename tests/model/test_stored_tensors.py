"""The launch checks a checkpoint's weight files against the tensors its config says it holds, without JAX
(model/loading/stored_tensors.py): those names and shapes must be exactly the networks' own (the Flax modules'
parameters, read as shapes by model.engine.factory.Networks), for every feature a config can switch."""

import dataclasses

import pytest

from model import preset_config
from model.engine.factory import Networks
from model.loading.stored_tensors import stored_tensors


def _small(config):
    """A klein preset's structure at a small size (few layers, narrow), so the networks' shapes come quickly."""
    tr = dataclasses.replace(config.transformer, num_layers=2, num_single_layers=2, num_attention_heads=2,
                             attention_head_dim=16, axes_dims_rope=(4, 4, 4, 4), joint_attention_dim=48,
                             timestep_guidance_channels=32, in_channels=16, out_channels=16)
    te = dataclasses.replace(config.text_encoder, vocab_size=64, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             sliding_windows=())
    vae = dataclasses.replace(config.vae, block_out_channels=(8, 16), encoder_block_out_channels=(8, 16),
                              layers_per_block=1, norm_num_groups=4, latent_channels=4)
    return dataclasses.replace(config, transformer=tr, text_encoder=te, vae=vae)


def _variants():
    base = _small(preset_config("klein-4b"))
    yield "klein-4b, small", base
    yield "guidance embedder", dataclasses.replace(
        base, transformer=dataclasses.replace(base.transformer, guidance_embeds=True))
    yield "attention biases", dataclasses.replace(
        base, text_encoder=dataclasses.replace(base.text_encoder, attention_bias=True))
    yield "no quant convs, no mid attention, other decoder widths", dataclasses.replace(base, vae=dataclasses.replace(
        base.vae, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        block_out_channels=(8, 8, 16), layers_per_block=2))


@pytest.mark.parametrize("name, config", list(_variants()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_launch_expects_the_networks_tensors(name, config):
    assert stored_tensors(config) == Networks(config, out_layers=(-1,)).stored_tensors()


def test_the_launch_expects_klein_9b_tensors():
    """A published config at its real size (shapes only: nothing is allocated)."""
    config = preset_config("klein-9b")
    assert stored_tensors(config) == Networks(config, out_layers=(-1,)).stored_tensors()
