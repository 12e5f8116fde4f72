"""Every tensor a complete checkpoint holds, by name with its torch shape, from its config alone (no JAX), and the
check of a component folder against them from the files' headers (`validate_component`).

The names and shapes of diffusers' Flux2Transformer2DModel and AutoencoderKLFlux2 and of transformers'
Qwen3ForCausalLM, as model/nets builds them: what the launch checks the weight files' headers against before any
worker starts, without loading JAX. tests/model/test_stored_tensors.py checks that they are exactly the tensors of
the networks (model.engine.factory.Networks.stored_tensors, read from the Flax modules' shapes).
"""

from __future__ import annotations

from typing import Iterable

from ..config.configs import PipelineConfig, TextEncoderConfig, TransformerConfig, VAEConfig
from ..errors import CheckpointError
from .safetensors_file import FLOAT_DTYPES, open_component

# The checkpoint's folders whose weights the loader reads, in the order it loads them.
COMPONENT_FOLDERS = ("text_encoder", "transformer", "vae")

Shapes = dict[str, tuple[int, ...]]


def _linear(name: str, fan_in: int, fan_out: int, bias: bool = False) -> Shapes:
    out = {f"{name}.weight": (fan_out, fan_in)}
    if bias:
        out[f"{name}.bias"] = (fan_out,)
    return out


def _conv(name: str, fan_in: int, fan_out: int, kernel: int) -> Shapes:
    return {f"{name}.weight": (fan_out, fan_in, kernel, kernel), f"{name}.bias": (fan_out,)}


def _group_norm(name: str, channels: int) -> Shapes:
    return {f"{name}.weight": (channels,), f"{name}.bias": (channels,)}


# --------------------------------------------------------------------------------------------- text encoder
def text_encoder_tensors(cfg: TextEncoderConfig) -> Shapes:
    """Qwen3ForCausalLM's tensors, every layer (`lm_head.weight` too: tied to the embedding, it may be absent)."""
    d, q_dim, kv_dim = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out: Shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}"
        out[f"{layer}.input_layernorm.weight"] = (d,)
        out[f"{layer}.post_attention_layernorm.weight"] = (d,)
        for proj, fan_in, fan_out in (("q_proj", d, q_dim), ("k_proj", d, kv_dim), ("v_proj", d, kv_dim),
                                      ("o_proj", q_dim, d)):
            out.update(_linear(f"{layer}.self_attn.{proj}", fan_in, fan_out, cfg.attention_bias))
        out[f"{layer}.self_attn.q_norm.weight"] = (cfg.head_dim,)
        out[f"{layer}.self_attn.k_norm.weight"] = (cfg.head_dim,)
        for proj, fan_in, fan_out in (("gate_proj", d, cfg.intermediate_size), ("up_proj", d, cfg.intermediate_size),
                                      ("down_proj", cfg.intermediate_size, d)):
            out.update(_linear(f"{layer}.mlp.{proj}", fan_in, fan_out))
    out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


# --------------------------------------------------------------------------------------------- transformer
def transformer_tensors(cfg: TransformerConfig) -> Shapes:
    """Flux2Transformer2DModel's tensors (no biases)."""
    d, hd, m = cfg.inner_dim, cfg.attention_head_dim, cfg.mlp_hidden_dim
    out: Shapes = {}
    embedders = ("timestep_embedder", "guidance_embedder") if cfg.guidance_embeds else ("timestep_embedder",)
    for embedder in embedders:
        out.update(_linear(f"time_guidance_embed.{embedder}.linear_1", cfg.timestep_guidance_channels, d))
        out.update(_linear(f"time_guidance_embed.{embedder}.linear_2", d, d))
    for name, sets in (("double_stream_modulation_img", 2), ("double_stream_modulation_txt", 2),
                       ("single_stream_modulation", 1)):
        out.update(_linear(f"{name}.linear", d, d * 3 * sets))
    out.update(_linear("x_embedder", cfg.in_channels, d))
    out.update(_linear("context_embedder", cfg.joint_attention_dim, d))
    for i in range(cfg.num_layers):
        block = f"transformer_blocks.{i}"
        for proj in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            out.update(_linear(f"{block}.attn.{proj}", d, d))
        for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            out[f"{block}.attn.{norm}.weight"] = (hd,)
        for ff in ("ff", "ff_context"):
            out.update(_linear(f"{block}.{ff}.linear_in", d, 2 * m))
            out.update(_linear(f"{block}.{ff}.linear_out", m, d))
    for i in range(cfg.num_single_layers):
        block = f"single_transformer_blocks.{i}"
        out.update(_linear(f"{block}.attn.to_qkv_mlp_proj", d, 3 * d + 2 * m))
        out.update(_linear(f"{block}.attn.to_out", d + m, d))
        out[f"{block}.attn.norm_q.weight"] = (hd,)
        out[f"{block}.attn.norm_k.weight"] = (hd,)
    out.update(_linear("norm_out.linear", d, 2 * d))
    out.update(_linear("proj_out", d, cfg.patch_size ** 2 * cfg.out_channels))
    return out


# --------------------------------------------------------------------------------------------- VAE
def _resnet(name: str, fan_in: int, fan_out: int) -> Shapes:
    out = {**_group_norm(f"{name}.norm1", fan_in), **_conv(f"{name}.conv1", fan_in, fan_out, 3),
           **_group_norm(f"{name}.norm2", fan_out), **_conv(f"{name}.conv2", fan_out, fan_out, 3)}
    if fan_in != fan_out:
        out.update(_conv(f"{name}.conv_shortcut", fan_in, fan_out, 1))
    return out


def _mid_block(name: str, ch: int, attention: bool) -> Shapes:
    out = {**_resnet(f"{name}.resnets.0", ch, ch), **_resnet(f"{name}.resnets.1", ch, ch)}
    if attention:
        attn = f"{name}.attentions.0"
        out.update(_group_norm(f"{attn}.group_norm", ch))
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            out.update(_linear(f"{attn}.{proj}", ch, ch, bias=True))
    return out


def vae_tensors(cfg: VAEConfig) -> Shapes:
    """AutoencoderKLFlux2's tensors: encoder, quant convs, decoder and the latent BatchNorm's statistics
    (`bn.num_batches_tracked`, a scalar no computation reads, may be absent)."""
    out: Shapes = {}
    chans = list(cfg.encoder_block_out_channels)
    out.update(_conv("encoder.conv_in", cfg.in_channels, chans[0], 3))
    prev = chans[0]
    for i, ch in enumerate(chans):
        for j in range(cfg.layers_per_block):
            out.update(_resnet(f"encoder.down_blocks.{i}.resnets.{j}", prev if j == 0 else ch, ch))
        if i != len(chans) - 1:
            out.update(_conv(f"encoder.down_blocks.{i}.downsamplers.0.conv", ch, ch, 3))
        prev = ch
    out.update(_mid_block("encoder.mid_block", chans[-1], cfg.mid_block_add_attention))
    out.update(_group_norm("encoder.conv_norm_out", chans[-1]))
    out.update(_conv("encoder.conv_out", chans[-1], 2 * cfg.latent_channels, 3))
    if cfg.use_quant_conv:
        out.update(_conv("quant_conv", 2 * cfg.latent_channels, 2 * cfg.latent_channels, 1))
    if cfg.use_post_quant_conv:
        out.update(_conv("post_quant_conv", cfg.latent_channels, cfg.latent_channels, 1))
    chans = list(cfg.block_out_channels)
    out.update(_conv("decoder.conv_in", cfg.latent_channels, chans[-1], 3))
    out.update(_mid_block("decoder.mid_block", chans[-1], cfg.mid_block_add_attention))
    prev = chans[-1]
    for i, ch in enumerate(reversed(chans)):
        for j in range(cfg.layers_per_block + 1):
            out.update(_resnet(f"decoder.up_blocks.{i}.resnets.{j}", prev if j == 0 else ch, ch))
        if i != len(chans) - 1:
            out.update(_conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", ch, ch, 3))
        prev = ch
    out.update(_group_norm("decoder.conv_norm_out", chans[0]))
    out.update(_conv("decoder.conv_out", chans[0], cfg.out_channels, 3))
    out["bn.running_mean"] = (cfg.patched_channels,)
    out["bn.running_var"] = (cfg.patched_channels,)
    out["bn.num_batches_tracked"] = ()
    return out


def stored_tensors(config: PipelineConfig) -> dict[str, tuple[Shapes, Shapes]]:
    """{component folder: (every tensor a complete checkpoint holds there, by name with its torch shape; those of
    them that may be absent)} for the folders the loader reads (COMPONENT_FOLDERS)."""
    te = config.text_encoder
    return {
        "text_encoder": (text_encoder_tensors(te), {"lm_head.weight": (te.vocab_size, te.hidden_size)}),
        "transformer": (transformer_tensors(config.transformer), {}),
        "vae": (vae_tensors(config.vae), {"bn.num_batches_tracked": ()}),
    }


def validate_component(folder, *, expected: dict[str, tuple[int, ...]], optional: Iterable[str] = (),
                       variant: str | None = None):
    """Check a component folder against the names/shapes a complete checkpoint holds, reading headers only.

    Every name of `expected` must be present with its shape, except those in `optional`; any other name in the
    checkpoint is an error. `variant`: which weight files (see `select_weight_files`). `folder`: as `open_component`
    takes it. Returns {tensor name: file} for `load_component`.
    """
    tensor_to_file = open_component(folder, variant)
    where = folder if isinstance(folder, str) else folder.path
    optional = set(optional)
    unexpected = sorted(set(tensor_to_file) - set(expected))
    if unexpected:
        sf = tensor_to_file[unexpected[0]]
        raise CheckpointError(f"unexpected tensor in checkpoint ({len(unexpected)} in all: {unexpected[:5]})",
                              path=sf.path, tensor=unexpected[0])
    missing = sorted(set(expected) - set(tensor_to_file) - optional)
    if missing:
        raise CheckpointError(f"tensor missing from checkpoint ({len(missing)} in all: {missing[:5]})",
                              path=where, tensor=missing[0])
    for name, sf in tensor_to_file.items():
        dtype, shape, _, _ = sf.entries[name]
        if tuple(shape) != tuple(expected[name]) and not (len(expected[name]) == 2 and tuple(shape) == (
                *expected[name], 1, 1)):
            raise CheckpointError(f"shape mismatch: checkpoint has {list(shape)}, model expects "
                                  f"{list(expected[name])}", path=sf.path, tensor=name)
        if dtype not in FLOAT_DTYPES and not name.endswith(("num_batches_tracked", "position_ids")):
            raise CheckpointError(f"weight has non-float dtype {dtype}", path=sf.path, tensor=name)
    return tensor_to_file
