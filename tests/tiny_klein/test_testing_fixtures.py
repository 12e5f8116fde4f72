"""The tiny random checkpoints (tiny_klein/) look like real klein repos and are usable by the diffusers
reference: sharded safetensors, no zero or identity weights, deterministic bytes, non-saturated images that depend
on the prompt, and Qwen3's chat template."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from tiny_klein import (DEMO_SPEC, QWEN3_CHAT_TEMPLATE, SPECIAL_TOKENS, TinySpec, build_tiny_checkpoint,
                        ensure_demo_checkpoint, spec_hash)

from paths import REPO  # noqa: E402
COMPONENT_FILES = {
    "transformer": ("config.json", "diffusion_pytorch_model.safetensors.index.json"),
    "vae": ("config.json", "diffusion_pytorch_model.safetensors.index.json"),
    "text_encoder": ("config.json", "model.safetensors.index.json"),
    "tokenizer": ("tokenizer.json", "tokenizer_config.json"),
    "scheduler": ("scheduler_config.json",),
}


def _read_json(*parts):
    with open(os.path.join(*parts)) as f:
        return json.load(f)


def _all_files(root):
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*"), recursive=True)
                  if os.path.isfile(p))


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(tiny_ckpt)


def _generate(pipe, prompt, height=32, width=32, steps=2, **kw):
    import torch

    out = pipe(prompt=prompt, height=height, width=width, num_inference_steps=steps, output_type="np",
               max_sequence_length=32, generator=torch.Generator("cpu").manual_seed(0), **kw)
    return out.images


def _assert_not_saturated(img):
    assert np.isfinite(img).all()
    clipped = np.mean((img <= 0.0) | (img >= 1.0))
    assert clipped < 0.2, f"{clipped:.1%} of the pixels are clipped"
    assert 0.25 < img.mean() < 0.75, img.mean()
    assert img.std() > 0.1, img.std()
    assert len(np.unique(np.round(img, 3))) > 200


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture, distilled", [("tiny_ckpt", True), ("tiny_base_ckpt", False)])
def test_diffusers_layout_and_sharding(request, fixture, distilled):
    root = request.getfixturevalue(fixture)
    index = _read_json(root, "model_index.json")
    assert index["_class_name"] == "Flux2KleinPipeline"
    assert index["is_distilled"] is distilled
    assert index["transformer"] == ["diffusers", "Flux2Transformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLFlux2"]
    assert index["text_encoder"] == ["transformers", "Qwen3ForCausalLM"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert index["tokenizer"][0] == "transformers"
    for comp, files in COMPONENT_FILES.items():
        for f in files:
            assert os.path.isfile(os.path.join(root, comp, f)), f"{comp}/{f} missing"
    for comp in ("transformer", "vae", "text_encoder"):
        folder = os.path.join(root, comp)
        (index_name,) = [f for f in os.listdir(folder) if f.endswith(".safetensors.index.json")]
        weight_map = _read_json(folder, index_name)["weight_map"]
        shards = sorted(set(weight_map.values()))
        on_disk = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        assert len(shards) >= 2 and shards == on_disk, (comp, shards, on_disk)
        keys = set()
        for shard in shards:
            with safe_open(os.path.join(folder, shard), framework="numpy") as f:
                for k in f.keys():
                    assert weight_map[k] == shard
                    keys.add(k)
        assert keys == set(weight_map)


def test_configs_match_spec(tiny_ckpt):
    spec = TinySpec()
    tr = _read_json(tiny_ckpt, "transformer", "config.json")
    te = _read_json(tiny_ckpt, "text_encoder", "config.json")
    vae = _read_json(tiny_ckpt, "vae", "config.json")
    sch = _read_json(tiny_ckpt, "scheduler", "scheduler_config.json")
    assert tr["joint_attention_dim"] == 3 * te["hidden_size"] == spec.joint_attention_dim
    assert tr["in_channels"] == 4 * vae["latent_channels"]
    assert tr["guidance_embeds"] is False and sum(tr["axes_dims_rope"]) == tr["attention_head_dim"]
    assert te["num_hidden_layers"] >= 27 and te["head_dim"] == spec.text_head_dim
    assert te["num_attention_heads"] != te["num_key_value_heads"]  # exercises GQA
    assert te["rope_parameters"]["rope_theta"] == spec.text_rope_theta
    assert vae["block_out_channels"] == list(spec.vae_block_out_channels)
    assert {k: sch[k] for k in ("num_train_timesteps", "shift", "use_dynamic_shifting", "time_shift_type",
                                "base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len")} == {
        "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "time_shift_type": "exponential",
        "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}


def test_no_zero_or_identity_weights(tiny_ckpt):
    n = 0
    for path in sorted(glob.glob(os.path.join(tiny_ckpt, "*", "*.safetensors"))):
        with safe_open(path, framework="numpy") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                n += 1
                assert np.any(t != 0), f"{k} in {path} is all zero"
                if t.dtype.kind == "f":
                    assert np.isfinite(t).all(), k
                    assert not np.all(t == 1), f"{k} is all ones"
                    if t.ndim == 2 and t.shape[0] == t.shape[1]:
                        assert not np.allclose(t, np.eye(t.shape[0])), f"{k} is an identity"
                    if t.size > 1:
                        assert np.unique(t).size > 1, f"{k} is constant"
    assert n > 100


def test_same_spec_gives_identical_bytes(tiny_ckpt, tmp_path):
    again = build_tiny_checkpoint(str(tmp_path / "again"), TinySpec())
    files = _all_files(tiny_ckpt)
    assert files == _all_files(again)
    assert any(f.endswith(".safetensors") for f in files)
    for f in files:
        with open(os.path.join(tiny_ckpt, f), "rb") as a, open(os.path.join(again, f), "rb") as b:
            assert a.read() == b.read(), f"{f} differs between two builds of the same spec"


def test_seed_changes_weights_only(tiny_ckpt, tmp_path):
    other = build_tiny_checkpoint(str(tmp_path / "seed1"), TinySpec(seed=1))
    for comp in ("transformer", "text_encoder", "vae"):
        with safe_open(glob.glob(os.path.join(tiny_ckpt, comp, "*.safetensors"))[0], framework="numpy") as f:
            name = next(k for k in f.keys() if f.get_tensor(k).dtype.kind == "f")
            mine = f.get_tensor(name)
        other_index = glob.glob(os.path.join(other, comp, "*.index.json"))[0]
        shard = _read_json(other_index)["weight_map"][name]
        with safe_open(os.path.join(other, comp, shard), framework="numpy") as f:
            assert f.get_tensor(name).shape == mine.shape and not np.array_equal(f.get_tensor(name), mine), name
    for f in ("model_index.json", "transformer/config.json", "tokenizer/tokenizer.json"):
        assert _read_json(tiny_ckpt, f) == _read_json(other, f)


def test_build_refuses_to_clobber(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_checkpoint(str(tmp_path / "x"))
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError):
        TinySpec(attention_head_dim=16, axes_dims_rope=(4, 4, 4, 2)).validate()
    with pytest.raises(ValueError):
        TinySpec(text_num_layers=20).validate()  # the default out layers (9, 18, 27) need 27 layers


def test_diffusers_generates_prompt_dependent_unsaturated_images(pipe):
    a = _generate(pipe, "a red fox sitting in the snow")
    b = _generate(pipe, "an astronaut riding a horse on the moon")
    assert a.shape == (1, 32, 32, 3)
    _assert_not_saturated(a)
    _assert_not_saturated(b)
    diff = np.abs(a - b)
    assert diff.mean() > 3e-3 and diff.max() > 0.03, (diff.mean(), diff.max())
    again = _generate(pipe, "a red fox sitting in the snow")
    np.testing.assert_array_equal(a, again)


def test_diffusers_non_square_and_base_cfg(pipe, tiny_base_ckpt):
    from diffusers import Flux2KleinPipeline

    img = _generate(pipe, "a lighthouse on a rocky coast", height=64, width=48)
    assert img.shape == (1, 64, 48, 3)
    _assert_not_saturated(img)

    base = Flux2KleinPipeline.from_pretrained(tiny_base_ckpt)
    assert base.config.is_distilled is False
    img = _generate(base, "a lighthouse on a rocky coast", guidance_scale=4.0)
    _assert_not_saturated(img)


def test_chat_template_and_special_tokens(tiny_ckpt):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(tiny_ckpt, "tokenizer"))
    assert tok.is_fast
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE
    prompt = "A small cactus with a happy face"
    messages = [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    text_thinking = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text_thinking == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    for t, i in ids.items():
        assert tok(t, add_special_tokens=False).input_ids == [i], t
    assert list(ids.values()) == list(range(ids["<|endoftext|>"], ids["<|endoftext|>"] + len(SPECIAL_TOKENS)))
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"

    enc = tok(text, padding="max_length", truncation=True, max_length=64)
    n = sum(enc.attention_mask)
    assert 0 < n < 64 and enc.input_ids[n:] == [ids["<|endoftext|>"]] * (64 - n)
    assert enc.input_ids[0] == ids["<|im_start|>"]
    real = enc.input_ids[:n]
    assert real.count(ids["<|im_start|>"]) == 2 and real.count(ids["<|im_end|>"]) == 1
    assert real.index(ids["<think>"]) < real.index(ids["</think>"])
    assert tok.decode(real) == text

    # the raw tokenizer.json (what a runtime without transformers' Python classes would load) agrees
    raw = Tokenizer.from_file(os.path.join(tiny_ckpt, "tokenizer", "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == enc.input_ids[:n]
    # the text encoder's embedding table covers the tokenizer
    assert _read_json(tiny_ckpt, "text_encoder", "config.json")["vocab_size"] >= len(tok)


def test_ensure_demo_checkpoint_builds_once(tmp_path):
    path = ensure_demo_checkpoint(str(tmp_path))
    assert os.path.basename(path) == f"demo-{spec_hash(DEMO_SPEC)}"
    assert _read_json(path, "model_index.json")["is_distilled"] is DEMO_SPEC.distilled
    stamp = os.stat(os.path.join(path, "model_index.json")).st_mtime_ns
    assert ensure_demo_checkpoint(str(tmp_path)) == path
    assert os.stat(os.path.join(path, "model_index.json")).st_mtime_ns == stamp
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no staging folders left behind


@pytest.mark.parametrize("imports, absent", [
    ("tiny_klein", ("torch", "diffusers")),  # the builder imports the reference stack only to build
    # The runtime never imports the builder. (Not torch either, but Beam's RunInference imports torch itself when it
    # is installed: apache_beam.ml.inference.base -> model_manager.)
    ("model, transforms.requests, pipeline.run", ("tiny_klein", "diffusers")),
])
def test_imports_leave_out_the_reference_stack(imports, absent):
    code = f"import sys, {imports}; print([m for m in sys.modules if m.split('.')[0] in {absent!r}])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


HELD_OUT_LIKE = dict(vae_block_out_channels=(8, 8, 16, 16), vae_layers_per_block=2, vae_latent_channels=8,
                     num_layers=2, num_single_layers=3, num_attention_heads=3, attention_head_dim=32,
                     axes_dims_rope=(8, 8, 8, 8), text_hidden_size=24, text_num_layers=27, text_heads=4,
                     text_kv_heads=2, text_head_dim=16, text_tie_word_embeddings=False, seed=7)


def test_other_spec_real_vae_depth(tiny_checkpoint_factory):
    from diffusers import Flux2KleinPipeline

    root = tiny_checkpoint_factory(**HELD_OUT_LIKE)
    te = _read_json(root, "text_encoder", "config.json")
    assert te["tie_word_embeddings"] is False
    with open(os.path.join(root, "text_encoder", "model.safetensors.index.json")) as f:
        assert "lm_head.weight" in json.load(f)["weight_map"]
    pipe = Flux2KleinPipeline.from_pretrained(root)
    assert pipe.vae_scale_factor == 8
    img = _generate(pipe, "a bowl of fresh fruit", height=64, width=48)
    assert img.shape == (1, 64, 48, 3)
    _assert_not_saturated(img)


def test_bfloat16_spec(tiny_checkpoint_factory):
    import torch
    from diffusers import Flux2KleinPipeline

    root = tiny_checkpoint_factory(dtype="bfloat16")
    for path in glob.glob(os.path.join(root, "*", "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                assert t.dtype in (torch.bfloat16, torch.int64), (k, t.dtype)
                assert bool((t != 0).any()), k
    # like the real bf16 repos, diffusers needs the dtype spelled out (transformers alone defaults to "auto")
    pipe = Flux2KleinPipeline.from_pretrained(root, dtype=torch.bfloat16)
    _assert_not_saturated(_generate(pipe, "an owl on a branch").astype(np.float32))
