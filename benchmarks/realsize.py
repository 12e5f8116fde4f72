"""Write FLUX.2-klein checkpoints with the REAL 4B/9B shapes and random bf16 weights, without torch.

Tensor names and shapes come from the model's own abstract modules, which tests/model/test_weights.py proves equal to
diffusers'/transformers' state dicts for the published configs. Used to measure loading memory and speed.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from model.config.configs import PipelineConfig
from model.engine.factory import Networks
from model.loading.loader import expected_tensors

PRESETS = {
    "klein-4b": (dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680),
                 dict(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)),
    "klein-9b": (dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288),
                 dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)),
}
TRANSFORMER_COMMON = dict(_class_name="Flux2Transformer2DModel", patch_size=1, in_channels=128, out_channels=None,
                          attention_head_dim=128, timestep_guidance_channels=256, mlp_ratio=3.0,
                          axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, eps=1e-6, guidance_embeds=False)
QWEN_COMMON = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                   max_position_embeddings=40960, rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu",
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16")
VAE_CONFIG = dict(_class_name="AutoencoderKLFlux2", in_channels=3, out_channels=3, block_out_channels=[128, 256, 512, 512],
                  layers_per_block=2, latent_channels=32, norm_num_groups=32, use_quant_conv=True,
                  use_post_quant_conv=True, mid_block_add_attention=True, batch_norm_eps=1e-4,
                  batch_norm_momentum=0.1, patch_size=[2, 2], sample_size=1024,
                  up_block_types=["UpDecoderBlock2D"] * 4, down_block_types=["DownEncoderBlock2D"] * 4)
SCHEDULER_CONFIG = dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=3.0,
                        use_dynamic_shifting=True, time_shift_type="exponential", base_shift=0.5, max_shift=1.15,
                        base_image_seq_len=256, max_image_seq_len=4096)
SHARD_BYTES = 2 * 1024**3


def _random_block(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(1 << 20).astype(np.float32) * 0.02)


def _fill(shape, block: np.ndarray, name: str) -> np.ndarray:
    """Cheap non-constant bf16 values: a random block tiled over the tensor (norm weights around 1)."""
    n = int(np.prod(shape))
    if name.endswith("running_var") or (len(shape) == 1 and "norm" in name):
        block = 1.0 + block
    # Cast the block once and tile its bits: the same values as tiling and then casting, several times faster.
    return np.resize(block.astype(ml_dtypes.bfloat16).view(np.uint16), n).view(ml_dtypes.bfloat16).reshape(shape)


def write_safetensors_component(folder: str, tensors: dict[str, tuple], file_stem: str, seed: int = 0) -> None:
    """Write `tensors` (name -> shape) as sharded bf16 safetensors with an index, one tensor in memory at a time."""
    os.makedirs(folder, exist_ok=True)
    block = _random_block(seed)
    names = sorted(tensors)
    shards, current, size = [], [], 0
    for name in names:
        nbytes = int(np.prod(tensors[name])) * 2 if name != "bn.num_batches_tracked" else 8
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    weight_map = {}

    def write_shard(i: int, shard: list[str]) -> None:
        fname = f"{file_stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in shard:
            shape = tensors[name]
            if name == "bn.num_batches_tracked":
                header[name] = {"dtype": "I64", "shape": [], "data_offsets": [offset, offset + 8]}
                offset += 8
            else:
                nbytes = int(np.prod(shape)) * 2
                header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(folder, fname), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name in shard:
                if name == "bn.num_batches_tracked":
                    f.write(np.array(1000, np.int64).tobytes())
                else:
                    f.write(memoryview(_fill(tensors[name], block, name).reshape(-1).view(np.uint8)))

    # Shards are written at once, one thread each (one tensor in memory per thread): on a TPU host's 9p file
    # system one stream writes far below what several do.
    with ThreadPoolExecutor(min(8, len(shards))) as pool:
        list(pool.map(write_shard, range(len(shards)), shards))
    with open(os.path.join(folder, f"{file_stem}.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def build_realsize_checkpoint(path: str, preset: str = "klein-4b") -> str:
    """A complete diffusers-layout folder with the preset's real shapes (random weights, tiny tokenizer)."""
    from tiny_klein import build_tiny_tokenizer

    tcfg, qcfg = PRESETS[preset]
    transformer_cfg = {**TRANSFORMER_COMMON, **tcfg}
    qwen_cfg = {**QWEN_COMMON, **qcfg}

    def dump(obj, *parts):
        os.makedirs(os.path.join(path, *parts[:-1]), exist_ok=True)
        with open(os.path.join(path, *parts), "w") as f:
            json.dump(obj, f, indent=1)

    dump(transformer_cfg, "transformer", "config.json")
    dump(qwen_cfg, "text_encoder", "config.json")
    dump(VAE_CONFIG, "vae", "config.json")
    dump(SCHEDULER_CONFIG, "scheduler", "scheduler_config.json")
    dump({"_class_name": "Flux2KleinPipeline", "is_distilled": True, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
          "text_encoder": ["transformers", "Qwen3ForCausalLM"], "tokenizer": ["transformers", "Qwen2TokenizerFast"],
          "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]},
         "model_index.json")
    build_tiny_tokenizer().save_pretrained(os.path.join(path, "tokenizer"))
    networks = Networks(PipelineConfig.from_folder(path), "bfloat16")  # the configs just written, as the loader reads
    tr = networks.transformer()
    te = networks.text_encoder(full_depth=True)
    vae = networks.vae_decoder(with_encoder=True)
    te_names = expected_tensors(te)
    if not qcfg["tie_word_embeddings"]:
        te_names["lm_head.weight"] = (151936, qcfg["hidden_size"])
    write_safetensors_component(os.path.join(path, "transformer"), expected_tensors(tr), "diffusion_pytorch_model", 1)
    write_safetensors_component(os.path.join(path, "text_encoder"), te_names, "model", 2)
    write_safetensors_component(os.path.join(path, "vae"), expected_tensors(vae, {"bn.num_batches_tracked": ()}),
                                "diffusion_pytorch_model", 3)
    return path


# FLUX.2-small-decoder's decoder widths (its config.json's decoder_block_out_channels); the encoder keeps the full one.
SMALL_DECODER_CHANNELS = [96, 192, 384, 384]


def build_realsize_vae(path: str, decoder_block_out_channels=SMALL_DECODER_CHANNELS) -> str:
    """A VAE folder (config.json and bf16 safetensors) with the real FLUX.2 encoder and a decoder of these widths:
    random weights in the shapes of FLUX.2-small-decoder, for `model.load(..., vae=path)`."""
    from model.config.configs import VAEConfig

    config = {**VAE_CONFIG, "decoder_block_out_channels": list(decoder_block_out_channels)}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    from flax import nnx
    import jax.numpy as jnp

    from model.nets.vae import Flux2VAEDecoder

    vae_cfg = VAEConfig.from_dict(config, os.path.join(path, "config.json"))
    abstract = nnx.eval_shape(lambda: Flux2VAEDecoder(vae_cfg, with_encoder=True, dtype=jnp.bfloat16,
                                                      rngs=nnx.Rngs(0)))
    write_safetensors_component(path, expected_tensors(abstract, {"bn.num_batches_tracked": ()}),
                                "diffusion_pytorch_model", 4)
    return path
