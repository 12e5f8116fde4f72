"""LoRA adapters against diffusers' Flux2KleinPipeline + peft on the tiny random checkpoint: the diffusers/PEFT files
written by peft and diffusers' own save function, kohya and BFL files in the keys diffusers converts from (the inverse
of its conversion, here), merged at two scales, two at once against `set_adapters`; and the launch's one-line
refusals of keys and shapes that fit no parameter.

Tolerances as tests/model/test_model_parity.py: the transformer within 2e-4, images within 4/255.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import model
from model.loading.lora_source import open_adapter
from model.config.lora_spec import LoraSpec

RANK = 4
# BFL module -> (diffusers modules, in order of the fused output's rows); the inverse of diffusers' conversion.
BFL_TO_DIFFUSERS = {
    "double_blocks.0.img_attn.qkv": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                     "transformer_blocks.0.attn.to_v"],
    "double_blocks.0.txt_attn.qkv": ["transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.add_k_proj",
                                     "transformer_blocks.0.attn.add_v_proj"],
    "double_blocks.0.img_attn.proj": ["transformer_blocks.0.attn.to_out.0"],
    "double_blocks.0.txt_attn.proj": ["transformer_blocks.0.attn.to_add_out"],
    "double_blocks.0.img_mlp.0": ["transformer_blocks.0.ff.linear_in"],
    "double_blocks.0.img_mlp.2": ["transformer_blocks.0.ff.linear_out"],
    "double_blocks.0.txt_mlp.0": ["transformer_blocks.0.ff_context.linear_in"],
    "double_blocks.0.txt_mlp.2": ["transformer_blocks.0.ff_context.linear_out"],
    "single_blocks.1.linear1": ["single_transformer_blocks.1.attn.to_qkv_mlp_proj"],
    "single_blocks.0.linear2": ["single_transformer_blocks.0.attn.to_out"],
    "img_in": ["x_embedder"],
    "time_in.out_layer": ["time_guidance_embed.timestep_embedder.linear_2"],
    "final_layer.linear": ["proj_out"],
}
BFL_ONLY = {"final_layer.adaLN_modulation.1": ["norm_out.linear"],
            "double_stream_modulation_img.lin": ["double_stream_modulation_img.linear"]}
# The modules peft adapts (a regular expression PEFT matches against the whole module name): every kind of projection.
DIFFUSERS_TARGETS = (r".*\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_v_proj|to_add_out|linear_in|linear_out|"
                     r"to_qkv_mlp_proj)|single_transformer_blocks\.\d+\.attn\.to_out|x_embedder|proj_out|"
                     r"norm_out\.linear")


def _np(t):
    return t.detach().float().numpy()


@pytest.fixture(scope="module")
def linear_shapes(tiny_ckpt):
    from diffusers import Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel.from_pretrained(tiny_ckpt, subfolder="transformer")
    return {n: tuple(m.weight.shape) for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}


def _peft_lora(tiny_ckpt, path, *, alpha, seed, prefix=None):
    """A LoRA trained-like (random A and B) by peft on diffusers' transformer, saved by save_lora_weights."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel.from_pretrained(tiny_ckpt, subfolder="transformer")
    config = LoraConfig(r=RANK, lora_alpha=alpha, target_modules=DIFFUSERS_TARGETS, init_lora_weights=False)
    transformer.add_adapter(config)
    state = get_peft_model_state_dict(transformer)
    Flux2KleinPipeline.save_lora_weights(str(path), transformer_lora_layers=state,
                                         transformer_lora_adapter_metadata=config.to_dict())
    file = path / "pytorch_lora_weights.safetensors"
    if prefix:  # PEFT's own prefix in place of diffusers' `transformer.`, on the blocks (all diffusers reads there)
        from safetensors import safe_open

        with safe_open(str(file), "np") as f:
            tensors = {prefix + k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys() if "blocks." in k}
            metadata = f.metadata()
        file = path / "peft.safetensors"
        save_file(tensors, str(file), metadata)
    return str(file)


def _bfl_lora(linear_shapes, path, *, seed, kohya=False):
    """Random factors in BFL (ai-toolkit) keys, or kohya's (with an alpha), for the modules BFL_TO_DIFFUSERS names."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for bfl, ours in {**BFL_TO_DIFFUSERS, **({} if kohya else BFL_ONLY)}.items():
        out = sum(linear_shapes[m][0] for m in ours)
        width = linear_shapes[ours[0]][1]
        down = (rng.standard_normal((RANK, width)) * 0.3).astype(np.float32)
        up = (rng.standard_normal((out, RANK)) * 0.3).astype(np.float32)
        if kohya:
            stem = "lora_unet_" + bfl.replace(".", "_")
            tensors.update({f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up,
                            f"{stem}.alpha": np.asarray(2.0 * RANK, np.float32)})
        else:
            tensors.update({f"diffusion_model.{bfl}.lora_A.weight": down, f"diffusion_model.{bfl}.lora_B.weight": up})
    file = path / ("kohya.safetensors" if kohya else "bfl.safetensors")
    save_file(tensors, str(file))
    return str(file)


def _velocities(transformer_call, cfg):
    from model.nets.transformer import image_ids, rope_tables, text_ids

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 15, cfg.in_channels)).astype(np.float32)
    text = rng.standard_normal((2, 8, cfg.joint_attention_dim)).astype(np.float32)
    sigma = np.array([0.9, 0.37], np.float32)
    ids_t, ids_i = text_ids(8), image_ids(3, 5)
    return transformer_call(hidden, text, sigma, ids_t, ids_i, rope_tables(np.concatenate([ids_t, ids_i]),
                                                                           cfg.axes_dims_rope, cfg.rope_theta))


def _ours(tiny_ckpt, loras):
    gen = model.load(tiny_ckpt, dtype="float32", max_sequence_length=8, loras=loras)
    _, transformer = gen.programs.modules()[:2]
    return gen, _velocities(lambda h, t, s, _a, _b, rope: np.asarray(transformer(h, t, s, *rope, None,
                                                                                 implementation="xla")),
                            gen.config.transformer)


def _diffusers(pipe, cfg):
    def call(h, t, s, ids_t, ids_i, _rope):
        with torch.no_grad():
            return _np(pipe.transformer(hidden_states=torch.from_numpy(h), encoder_hidden_states=torch.from_numpy(t),
                                        timestep=torch.from_numpy(s), img_ids=torch.from_numpy(ids_i),
                                        txt_ids=torch.from_numpy(ids_t), return_dict=False)[0])
    return _velocities(call, cfg)


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(tiny_ckpt, torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def lora_files(tiny_ckpt, linear_shapes, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    for name in ("diffusers", "peft", "bfl", "kohya", "second"):
        (root / name).mkdir()
    return {
        "diffusers": _peft_lora(tiny_ckpt, root / "diffusers", alpha=2 * RANK, seed=1),  # alpha / rank = 2
        "peft": _peft_lora(tiny_ckpt, root / "peft", alpha=RANK, seed=2, prefix="base_model.model."),
        "bfl": _bfl_lora(linear_shapes, root / "bfl", seed=3),
        "kohya": _bfl_lora(linear_shapes, root / "kohya", seed=4, kohya=True),
        "second": _peft_lora(tiny_ckpt, root / "second", alpha=RANK, seed=5),
    }


@pytest.mark.parametrize("layout,scale", [("diffusers", 1.0), ("diffusers", 0.45), ("peft", 0.8), ("bfl", 0.6),
                                          ("kohya", 1.0)])
def test_merged_adapter_matches_diffusers(layout, scale, tiny_ckpt, pipe, lora_files):
    """Each layout, merged at load, gives diffusers' velocities with the adapter loaded and weighted by `scale`."""
    pipe.load_lora_weights(lora_files[layout], adapter_name=layout)
    try:
        pipe.enable_lora()
        pipe.set_adapters([layout], [scale])
        gen, ours = _ours(tiny_ckpt, [f"{lora_files[layout]}:{scale}"])
        want = _diffusers(pipe, gen.config.transformer)
        pipe.disable_lora()
        base = _diffusers(pipe, gen.config.transformer)
    finally:
        pipe.delete_adapters(layout)
    assert np.abs(want - base).max() > 1e-2, "the adapter changes nothing: the check would prove nothing"
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=1e-4)
    digest = hashlib.sha256(open(lora_files[layout], "rb").read()).hexdigest()
    assert gen.loras == ({"name": os.path.basename(lora_files[layout]).removesuffix(".safetensors"),
                          "sha256": digest, "scale": scale},)


def test_two_adapters_images_match_set_adapters(tiny_ckpt, pipe, lora_files):
    """Two adapters merged together give the images of diffusers' pipeline with both active (set_adapters)."""
    from tests.model.test_model_parity import _assert_images_close, _reference_images

    pipe.load_lora_weights(lora_files["diffusers"], adapter_name="a")
    pipe.load_lora_weights(lora_files["bfl"], adapter_name="b")
    try:
        pipe.enable_lora()
        pipe.set_adapters(["a", "b"], [0.7, 0.4])
        gen = model.load(tiny_ckpt, dtype="float32", max_sequence_length=32,
                         loras=[f"a={lora_files['diffusers']}:0.7", f"b={lora_files['bfl']}:0.4"])
        ours = gen.generate(["a red cat on a mat", ""], [3, 11], height=32, width=32, num_inference_steps=2)
        ref = _reference_images(pipe, ["a red cat on a mat", ""], [3, 11], 32, 32, 2, 1.0, 1,
                                gen.noise_shape(32, 32))
    finally:
        pipe.delete_adapters(["a", "b"])
    _assert_images_close(ours, ref)
    assert [lora["name"] for lora in gen.loras] == ["a", "b"]


# ------------------------------------------------------------------------------------------------- refusals


def _file(tmp_path, tensors, name="bad.safetensors"):
    path = tmp_path / name
    save_file({k: np.zeros(s, np.float32) for k, s in tensors.items()}, str(path))
    return str(path)


@pytest.mark.parametrize("tensors,key,words", [
    ({"transformer.transformer_blocks.0.attn.to_qq.lora_A.weight": (4, 32),
      "transformer.transformer_blocks.0.attn.to_qq.lora_B.weight": (32, 4)},
     "transformer.transformer_blocks.0.attn.to_qq.lora_A.weight", "no linear layer"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": (4, 48),
      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": (32, 4)},
     "transformer.transformer_blocks.0.attn.to_q.lora_A.weight", "does not fit"),
    ({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": (4, 32),
      "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": (90, 4)},
     "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight", "does not fit"),
    ({"diffusion_model.double_blocks.0.img_attn.norm.lora_A.weight": (4, 32),
      "diffusion_model.double_blocks.0.img_attn.norm.lora_B.weight": (32, 4)},
     "diffusion_model.double_blocks.0.img_attn.norm.lora_A.weight", "names no module"),
    ({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": (4, 32)},
     "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", "without its pair"),
    ({"text_encoder.layers.0.q_proj.lora_A.weight": (4, 16),
      "text_encoder.layers.0.q_proj.lora_B.weight": (16, 4)},
     "text_encoder.layers.0.q_proj.lora_A.weight", "only transformer adapters are read"),
])
def test_bad_adapter_is_refused_naming_the_key(tmp_path, linear_shapes, tensors, key, words):
    path = _file(tmp_path, tensors)
    with pytest.raises(model.LoraError, match=words) as info:
        open_adapter(LoraSpec(path), {n + ".weight": s for n, s in linear_shapes.items()})
    assert info.value.tensor == key and info.value.path == path


@pytest.mark.parametrize("text,spec", [
    ("style.safetensors", LoraSpec("style.safetensors")),
    ("gs://b/x/style.safetensors:0.8", LoraSpec("gs://b/x/style.safetensors", 0.8)),
    ("ink=owner/repo/w.safetensors:1.5", LoraSpec("owner/repo/w.safetensors", 1.5, "ink")),
    ("gs://b/folder", LoraSpec("gs://b/folder")),
])
def test_lora_spec_parse(text, spec):
    assert LoraSpec.parse(text) == spec
    assert LoraSpec.parse("gs://b/x/style.safetensors:0.8").label == "style"


def test_int8_quantizes_the_merged_weight(tiny_ckpt, lora_files):
    """With --quantize int8 the adapter is merged first: the int8 weight and scale are those of the merged float
    weight (a fused q/k/v adapter's third for to_k), not the base weight's with an adapter added after."""
    from safetensors.numpy import load_file

    from model.nets.quantize import quantize_columns

    plain = model.load(tiny_ckpt, dtype="float32", max_sequence_length=8)
    int8 = model.load(tiny_ckpt, dtype="float32", max_sequence_length=8, quantize="int8",
                      loras=[f"{lora_files['bfl']}:0.6"])
    attn = lambda gen: gen.programs.modules()[1].transformer_blocks[0].attn  # noqa: E731
    base = np.asarray(attn(plain).to_k.weight[...])  # [in, out]
    tensors = load_file(lora_files["bfl"])
    down = tensors["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"]
    up = np.split(tensors["diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight"], 3)[1]
    values, scale = quantize_columns(base + 0.6 * (up @ down).T)
    # int8 steps apart by at most one (a float32 sum in another order may round a half the other way)
    assert np.abs(np.asarray(attn(int8).to_k.weight[...], np.int32) - np.asarray(values, np.int32)).max() <= 1
    np.testing.assert_allclose(np.asarray(attn(int8).to_k.weight_scale[...]), np.asarray(scale), rtol=1e-6)
