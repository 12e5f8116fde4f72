"""Checkpoint loading: name/shape mapping against the real FLUX.2-klein configs (meta device, no download) and a
clear, typed error naming the file and tensor for every kind of broken checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model
from model.config.configs import PipelineConfig, TextEncoderConfig, TransformerConfig, VAEConfig
from model.nets.qwen3 import Qwen3TextEncoder
from model.nets.transformer import Flux2Transformer
from model.nets.vae import Flux2VAEDecoder
from model.loading.loader import expected_tensors, flat_params

KLEIN_TRANSFORMER = {
    "4b": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680),
    "9b": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288),
}
KLEIN_COMMON = dict(patch_size=1, in_channels=128, out_channels=None, attention_head_dim=128,
                    timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32], rope_theta=2000,
                    eps=1e-6, guidance_embeds=False)
QWEN3 = {
    "4b": dict(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
    "9b": dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False),
}
QWEN3_COMMON = dict(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                    attention_bias=False)


def _abstract(factory):
    return nnx.eval_shape(factory)





@pytest.mark.parametrize("size", ["4b", "9b"])
def test_mapping_matches_real_klein_configs_on_meta_device(size):
    """Our expected tensor names/shapes == the state dicts of diffusers/transformers models built with the published
    configs on the meta device; parameter counts agree too."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tcfg = {**KLEIN_COMMON, **KLEIN_TRANSFORMER[size]}
    qcfg = {**QWEN3_COMMON, **QWEN3[size]}
    with torch.device("meta"):
        ref_t = Flux2Transformer2DModel(**tcfg)
        ref_v = AutoencoderKLFlux2()
        ref_q = Qwen3ForCausalLM(Qwen3Config(**qcfg))
    checks = [
        (ref_t, _abstract(lambda: Flux2Transformer(TransformerConfig.from_dict(tcfg), dtype=jnp.bfloat16,
                                                   rngs=nnx.Rngs(0))), {}),
        (ref_v, _abstract(lambda: Flux2VAEDecoder(VAEConfig.from_dict(dict(ref_v.config)), with_encoder=True,
                                                  dtype=jnp.bfloat16, rngs=nnx.Rngs(0))),
         {"bn.num_batches_tracked": ()}),
        (ref_q, _abstract(lambda: Qwen3TextEncoder(TextEncoderConfig.from_dict(ref_q.config.to_dict()),
                                                   full_depth=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))),
         {"lm_head.weight": (151936, qcfg["hidden_size"])}),
    ]
    for ref, abstract, extra in checks:
        ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
        ours = expected_tensors(abstract, extra)
        assert ours == ref_shapes, (set(ours) ^ set(ref_shapes))
        # Parameter count of our abstract model == the reference's parameters (+ the BN running stats, which we
        # hold as parameters); the untied lm_head is a reference parameter we never build.
        n_ours = sum(int(np.prod(v.shape)) for v in flat_params(abstract).values())
        n_ref = sum(p.numel() for _, p in ref.named_parameters())
        n_ref += sum(b.numel() for n, b in ref.named_buffers() if n.startswith("bn.running"))
        if ref is ref_q and not qcfg["tie_word_embeddings"]:
            n_ref -= 151936 * qcfg["hidden_size"]
        assert n_ours == n_ref
    if size == "4b":
        n = sum(int(np.prod(s)) for s in expected_tensors(checks[0][1]).values())
        assert abs(n - 3.876e9) < 0.01e9


def test_truncated_encoder_runs_27_layers_for_real_config():
    cfg = TextEncoderConfig.from_dict({**QWEN3_COMMON, **QWEN3["4b"]})
    enc = _abstract(lambda: Qwen3TextEncoder(cfg, (9, 18, 27), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert len(enc.model.layers) == 27 and enc.model.norm is None


# ----------------------------------------------------------------------------------------------- broken checkpoints


@pytest.fixture()
def ckpt_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return str(dst)


def _index(folder):
    name = next(n for n in os.listdir(folder) if n.endswith(".index.json"))
    path = os.path.join(folder, name)
    with open(path) as f:
        return path, json.load(f)


def _load(path):
    return model.load(path, dtype="float32", max_sequence_length=16)


def test_missing_shard_names_the_file(ckpt_copy):
    folder = os.path.join(ckpt_copy, "transformer")
    _, idx = _index(folder)
    shard = sorted(set(idx["weight_map"].values()))[-1]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(model.CheckpointError, match="missing") as e:
        _load(ckpt_copy)
    assert shard in str(e.value)


def test_truncated_shard_names_file_and_tensor(ckpt_copy):
    folder = os.path.join(ckpt_copy, "vae")
    _, idx = _index(folder)
    shard = os.path.join(folder, sorted(set(idx["weight_map"].values()))[0])
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 7)
    with pytest.raises(model.CheckpointError, match="truncated") as e:
        _load(ckpt_copy)
    assert shard in str(e.value) and e.value.tensor


def test_tensor_missing_from_index_is_an_error(ckpt_copy):
    folder = os.path.join(ckpt_copy, "transformer")
    path, idx = _index(folder)
    name = "proj_out.weight"
    del idx["weight_map"][name]
    with open(path, "w") as f:
        json.dump(idx, f)
    with pytest.raises(model.CheckpointError, match="proj_out.weight"):
        _load(ckpt_copy)


def _rewrite_shard(folder, edit):
    """Apply `edit(tensors: dict) -> None` to the shard holding proj_out.weight and update the index."""
    from safetensors.numpy import load_file, save_file

    path, idx = _index(folder)
    shard = idx["weight_map"]["proj_out.weight"]
    tensors = load_file(os.path.join(folder, shard))
    edit(tensors)
    save_file(tensors, os.path.join(folder, shard))
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != shard}
    idx["weight_map"].update(dict.fromkeys(tensors, shard))
    with open(path, "w") as f:
        json.dump(idx, f)


def test_wrong_shape_names_tensor(ckpt_copy):
    folder = os.path.join(ckpt_copy, "transformer")
    _rewrite_shard(folder, lambda t: t.__setitem__("proj_out.weight", t["proj_out.weight"][:, :-1].copy()))
    with pytest.raises(model.CheckpointError, match="shape mismatch") as e:
        _load(ckpt_copy)
    assert e.value.tensor == "proj_out.weight"


def test_wrong_dtype_is_an_error(ckpt_copy):
    folder = os.path.join(ckpt_copy, "transformer")
    _rewrite_shard(folder, lambda t: t.__setitem__("proj_out.weight", t["proj_out.weight"].astype(np.int32)))
    with pytest.raises(model.CheckpointError, match="dtype") as e:
        _load(ckpt_copy)
    assert e.value.tensor == "proj_out.weight"


def test_unexpected_tensor_is_an_error(ckpt_copy):
    folder = os.path.join(ckpt_copy, "transformer")
    _rewrite_shard(folder, lambda t: t.__setitem__("extra.weight", np.ones((2, 2), np.float32)))
    with pytest.raises(model.CheckpointError, match="unexpected") as e:
        _load(ckpt_copy)
    assert e.value.tensor == "extra.weight"


def test_missing_tensor_is_an_error_not_zero_filled(ckpt_copy):
    folder = os.path.join(ckpt_copy, "transformer")
    _rewrite_shard(folder, lambda t: t.pop("proj_out.weight"))
    with pytest.raises(model.CheckpointError, match="missing") as e:
        _load(ckpt_copy)
    assert e.value.tensor == "proj_out.weight"


def test_corrupted_config_names_the_file(ckpt_copy):
    path = os.path.join(ckpt_copy, "transformer", "config.json")
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(model.ConfigError, match="not valid JSON") as e:
        _load(ckpt_copy)
    assert e.value.path == path


def test_config_with_wrong_type_names_key(ckpt_copy):
    path = os.path.join(ckpt_copy, "vae", "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["latent_channels"] = "many"
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(model.ConfigError) as e:
        _load(ckpt_copy)
    assert e.value.key == "latent_channels"


@pytest.mark.parametrize("part,entry,words", [
    ("text_encoder", ["transformers", "Mistral3ForConditionalGeneration"], "'Mistral3ForConditionalGeneration' for the "
                                                                           "text_encoder.*Qwen3ForCausalLM"),
    ("scheduler", ["diffusers", "FlowMatchHeunDiscreteScheduler"], "FlowMatchEulerDiscreteScheduler"),
    ("transformer", ["diffusers", "FluxTransformer2DModel"], "Flux2Transformer2DModel"),
    ("vae", [None, None], "does not list a required component"),
])
def test_model_index_naming_other_components_is_a_config_error(ckpt_copy, part, entry, words):
    """A checkpoint of another model (FLUX.2 [dev]'s Mistral encoder, FLUX.1's transformer) or with another
    sampler is refused by name before any weight is read, not loaded into the wrong model or sampled differently."""
    path = os.path.join(ckpt_copy, "model_index.json")
    with open(path) as f:
        index = json.load(f)
    index[part] = entry
    with open(path, "w") as f:
        json.dump(index, f)
    with pytest.raises(model.ConfigError, match=words) as e:
        _load(ckpt_copy)
    assert (e.value.path, e.value.key) == (path, part)


def test_pickle_only_weights_are_refused(ckpt_copy):
    folder = os.path.join(ckpt_copy, "vae")
    for n in os.listdir(folder):
        if n.endswith((".safetensors", ".json")) and n != "config.json":
            os.remove(os.path.join(folder, n))
    with open(os.path.join(folder, "diffusion_pytorch_model.bin"), "wb") as f:
        f.write(b"\x80\x04not really a pickle")
    with pytest.raises(model.UnsafeWeightsError, match="pickle"):
        _load(ckpt_copy)


def test_missing_folder_and_component(tmp_path, ckpt_copy):
    with pytest.raises(model.CheckpointError):
        _load(str(tmp_path / "nope"))
    shutil.rmtree(os.path.join(ckpt_copy, "text_encoder"))
    with pytest.raises(model.ModelError):
        _load(ckpt_copy)


def test_bad_sizes_name_value_and_nearest(tiny_ckpt):
    gen = _load(tiny_ckpt)
    m = gen.size_multiple
    with pytest.raises(ValueError, match=rf"height.*{10 * m + 1}.*\[{10 * m}, {11 * m}\]"):
        gen.generate(["x"], [0], height=10 * m + 1, width=32)
    for bad in (0, -16, 15.5):  # None is the default size (or, with references, the first reference's), as diffusers
        with pytest.raises(ValueError, match="width"):
            gen.generate(["x"], [0], height=32, width=bad)
    with pytest.raises(ValueError, match="seed"):
        gen.generate(["x"], [-1], height=32, width=32)
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        gen.generate(["x", "y"], [0], height=32, width=32)


def test_bfloat16_load_keeps_bn_stats_in_float32(tiny_ckpt):
    gen = model.load(tiny_ckpt, dtype="bfloat16", max_sequence_length=16)
    te, tr, vae = gen.programs.modules()
    assert tr.proj_out.weight.dtype == jnp.bfloat16 and te.model.embed_tokens.weight.dtype == jnp.bfloat16
    assert vae.bn.running_var.dtype == jnp.float32
    assert PipelineConfig.from_folder(tiny_ckpt).is_distilled


def test_every_component_is_validated_before_any_weight_is_read(ckpt_copy, monkeypatch):
    """A broken VAE shard fails the load before the text encoder or transformer weights are read."""
    import model.engine.generator as generator

    reads = []
    monkeypatch.setattr(generator, "load_component", lambda folder, *a, **k: reads.append(folder))
    folder = os.path.join(ckpt_copy, "vae")
    _, idx = _index(folder)
    shard = os.path.join(folder, sorted(set(idx["weight_map"].values()))[-1])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 3)
    with pytest.raises(model.CheckpointError, match="truncated"):
        _load(ckpt_copy)
    assert reads == []


def _edit_header(path, edit):
    """Rewrite a safetensors file's JSON header with `edit(header) -> None`, keeping its data bytes."""
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(n)), f.read()
    edit(header)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("edit,words", [
    (lambda h, t: h[t].update(data_offsets=[str(v) for v in h[t]["data_offsets"]]), "must be non-negative integers"),
    (lambda h, t: h[t].update(data_offsets=[float(v) for v in h[t]["data_offsets"]]), "must be non-negative integers"),
    (lambda h, t: h[t].update(dtype=["F32"]), "must be non-negative integers"),
    (lambda h, t: h[t].update(data_offsets=h[next(k for k in h if k not in (t, "__metadata__") and h[k]["dtype"] ==
                                              h[t]["dtype"] and h[k]["shape"] == h[t]["shape"])]["data_offsets"]),
     "overlap"),
])
def test_malformed_safetensors_headers_are_checkpoint_errors(ckpt_copy, edit, words):
    """Caught while validating headers, before any weight is read: wrong types, and two tensors on the same bytes
    (one weight silently copying another)."""
    folder = os.path.join(ckpt_copy, "text_encoder")
    _, idx = _index(folder)
    tensor = "model.layers.0.self_attn.q_norm.weight"
    shard = os.path.join(folder, idx["weight_map"][tensor])
    _edit_header(shard, lambda h: edit(h, tensor))
    with pytest.raises(model.CheckpointError, match=words):
        _load(ckpt_copy)


def test_index_weight_map_of_the_wrong_shape_is_a_checkpoint_error(ckpt_copy):
    path, idx = _index(os.path.join(ckpt_copy, "vae"))
    with open(path, "w") as f:
        json.dump({"weight_map": list(idx["weight_map"])}, f)
    with pytest.raises(model.CheckpointError, match="weight_map must map"):
        _load(ckpt_copy)


def _edit_json(path, edit):
    """Rewrite a JSON file with `edit(obj) -> None`."""
    with open(path) as f:
        obj = json.load(f)
    edit(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


def test_tokenizer_and_text_encoder_must_belong_together(ckpt_copy):
    """A tokenizer with ids past the embedding table gave NaN embeddings and black images, silently."""
    from safetensors.numpy import load_file, save_file

    from model.loading.tokenizer import PromptTokenizer

    rows = len(PromptTokenizer(os.path.join(ckpt_copy, "tokenizer")).tokenizer) - 5
    folder = os.path.join(ckpt_copy, "text_encoder")
    shard = os.path.join(folder, _index(folder)[1]["weight_map"]["model.embed_tokens.weight"])
    tensors = load_file(shard)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:rows]
    save_file(tensors, shard)
    _edit_json(os.path.join(folder, "config.json"), lambda cfg: cfg.update(vocab_size=rows))
    with pytest.raises(model.CheckpointError, match="do not belong together"):
        _load(ckpt_copy)


def test_tokenizer_without_chat_template_is_refused_at_load(ckpt_copy):
    folder = os.path.join(ckpt_copy, "tokenizer")
    _edit_json(os.path.join(folder, "tokenizer_config.json"), lambda cfg: cfg.pop("chat_template", None))
    for extra in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(folder, extra)):
            os.remove(os.path.join(folder, extra))
    with pytest.raises(model.CheckpointError, match="chat template"):
        _load(ckpt_copy)


def test_a_tokenizer_that_fails_while_the_weights_load_stops_the_loading(tiny_ckpt, monkeypatch):
    """The tokenizer loads beside the weights; when it fails, the loading threads stop at their next tensor with its
    error instead of reading the rest of the checkpoint first."""
    import threading

    from model.engine import generator
    from model.loading import loader, safetensors_file

    reads, some_read = [], threading.Event()
    plain_read = safetensors_file.SafetensorsFile.read

    def counting_read(self, name, buffers=None):
        reads.append(name)
        if len(reads) >= 3:
            some_read.set()
        return plain_read(self, name, buffers)

    class FailsOnceWeightsAreRead:
        def __init__(self, folder, max_length):
            assert some_read.wait(60), "no weight was read while the tokenizer loaded"
            raise model.CheckpointError("cannot load tokenizer: broken on purpose", path=folder)

    monkeypatch.setattr(safetensors_file.SafetensorsFile, "read", counting_read)
    monkeypatch.setattr(loader, "LOAD_THREADS", 1)  # one tensor at a time: the stop comes before the last
    monkeypatch.setattr(generator, "PromptTokenizer", FailsOnceWeightsAreRead)
    with pytest.raises(model.CheckpointError, match="broken on purpose"):
        _load(tiny_ckpt)
    components = ("text_encoder", "transformer")
    total = sum(len(model.loading.safetensors_file.open_component(os.path.join(tiny_ckpt, c))) for c in components)
    assert 3 <= len(reads) < total, f"{len(reads)} of more than {total} tensors read after the tokenizer failed"


def test_the_placing_time_leaves_out_the_wait_for_a_slower_tokenizer(tiny_ckpt, monkeypatch):
    """load_phases' placing (wall_s, the weights' GB/s) ends with the last tensor; a tokenizer still loading then is
    its own step (prepare_steps_s["tokenizer_wait_after_placing"])."""
    import threading
    import time

    from model.engine import generator

    placed = threading.Event()
    plain_load, plain_tokenizer = generator.load_components, generator.PromptTokenizer

    def load_then_signal(*args, **kwargs):
        modules = plain_load(*args, **kwargs)
        placed.set()
        return modules

    def tokenizer_done_after_the_weights(folder, max_length):
        assert placed.wait(60)
        time.sleep(0.5)
        return plain_tokenizer(folder, max_length)

    monkeypatch.setattr(generator, "load_components", load_then_signal)
    monkeypatch.setattr(generator, "PromptTokenizer", tokenizer_done_after_the_weights)
    began = time.perf_counter()
    phases = _load(tiny_ckpt).load_phases
    took = time.perf_counter() - began
    waited = phases["prepare_steps_s"]["tokenizer_wait_after_placing"]
    assert waited >= 0.5, phases
    assert phases["prepare_s"] + phases["wall_s"] + waited <= took, (phases, took)


def test_config_values_that_cannot_build_a_model(ckpt_copy):
    path = os.path.join(ckpt_copy, "transformer", "config.json")
    for key, value in (("mlp_ratio", 0), ("num_single_layers", -1)):
        _edit_json(path, lambda cfg: cfg.update({key: value}))
        with pytest.raises(model.ConfigError) as e:
            _load(ckpt_copy)
        assert e.value.key == key
        _edit_json(path, lambda cfg: cfg.update({key: 3 if key == "mlp_ratio" else 2}))


# ------------------------------------------------------------------------------------------------ weight variants
def _save_variant(src: str, dst: str, variant: str) -> str:
    """The checkpoint at `src` saved again by diffusers itself with `variant` (float32 values, variant file names)."""
    from diffusers import Flux2KleinPipeline

    Flux2KleinPipeline.from_pretrained(src).save_pretrained(dst, variant=variant, safe_serialization=True,
                                                            max_shard_size="64KB")
    return dst


def _weight_files(folder):
    return sorted(n for n in os.listdir(folder) if ".safetensors" in n)


def _states_equal(a, b):
    for x, y in ((a.programs.te_state, b.programs.te_state), (a.programs.tr_state, b.programs.tr_state),
                 (a.programs.vae_state, b.programs.vae_state)):
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_weight_file_names_of_variants():
    from model.loading.weight_files import weight_file_variant

    assert weight_file_variant("model.safetensors") == ("weights", None)
    assert weight_file_variant("model-00001-of-00002.safetensors") == ("weights", None)
    assert weight_file_variant("model.fp16.safetensors") == ("weights", "fp16")
    assert weight_file_variant("model.fp16-00001-of-00002.safetensors") == ("weights", "fp16")  # transformers
    assert weight_file_variant("diffusion_pytorch_model-00001-of-00002.fp16.safetensors") == ("weights", "fp16")
    assert weight_file_variant("model.safetensors.index.json") == ("index", None)
    assert weight_file_variant("model.safetensors.index.bf16.json") == ("index", "bf16")
    assert weight_file_variant("config.json") is None


def test_variant_only_checkpoint_loads_the_same_weights(tiny_ckpt, tmp_path):
    """A checkpoint written with save_pretrained(variant="fp16") (every component sharded with variant names) loads
    without naming the variant, and with it, to exactly the weights of the original."""
    dst = _save_variant(tiny_ckpt, str(tmp_path / "v"), "fp16")
    files = _weight_files(os.path.join(dst, "transformer"))
    assert files and all(".fp16" in n for n in files) and any(".index.fp16.json" in n for n in files)
    base = _load(tiny_ckpt)
    _states_equal(_load(dst), base)
    _states_equal(model.load(dst, dtype="float32", max_sequence_length=16, variant="fp16"), base)
    # a variant asked for that is not there falls back to the files without a variant (here: the only ones)
    _states_equal(model.load(tiny_ckpt, dtype="float32", max_sequence_length=16, variant="fp16"), base)


def test_default_and_variant_files_side_by_side(tiny_ckpt, tmp_path):
    """Default and fp16 files in the same folders: each load reads only its own set (the other set is broken here,
    so reading any of its files would fail), and several variants without default files need a choice."""
    both = str(tmp_path / "both")
    shutil.copytree(tiny_ckpt, both)
    variant = _save_variant(tiny_ckpt, str(tmp_path / "v"), "fp16")
    for component in ("transformer", "text_encoder", "vae"):
        for name in _weight_files(os.path.join(variant, component)):
            shutil.copy(os.path.join(variant, component, name), os.path.join(both, component, name))
    base = _load(tiny_ckpt)

    def truncate(folder, keep_variant):
        for component in ("transformer", "text_encoder", "vae"):
            for name in _weight_files(os.path.join(folder, component)):
                if name.endswith(".safetensors") and (".fp16" in name) != keep_variant:
                    with open(os.path.join(folder, component, name), "r+b") as f:
                        f.truncate(16)

    broken_variant = str(tmp_path / "broken-variant")
    shutil.copytree(both, broken_variant)
    truncate(broken_variant, keep_variant=False)  # the fp16 files cut short
    _states_equal(_load(broken_variant), base)
    with pytest.raises(model.CheckpointError, match=r"\.fp16"):
        model.load(broken_variant, dtype="float32", max_sequence_length=16, variant="fp16")

    broken_default = str(tmp_path / "broken-default")
    shutil.copytree(both, broken_default)
    truncate(broken_default, keep_variant=True)  # the default files cut short
    _states_equal(model.load(broken_default, dtype="float32", max_sequence_length=16, variant="fp16"), base)

    two_variants = str(tmp_path / "two")  # fp16 files and the same values under bf16 names
    shutil.copytree(variant, two_variants)
    for component in ("transformer", "text_encoder", "vae"):
        folder = os.path.join(two_variants, component)
        for name in _weight_files(folder):
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            if name.endswith(".json"):  # the index names its shards
                data = data.replace(b".fp16", b".bf16")
            with open(os.path.join(folder, name.replace("fp16", "bf16")), "wb") as f:
                f.write(data)
    with pytest.raises(model.CheckpointError, match=r"several variants \['bf16', 'fp16'\]"):
        _load(two_variants)
    with pytest.raises(model.CheckpointError, match=r"variant 'fp8'.*\['bf16', 'fp16'\]"):
        model.load(two_variants, dtype="float32", max_sequence_length=16, variant="fp8")
    _states_equal(model.load(two_variants, dtype="float32", max_sequence_length=16, variant="bf16"), base)
    with pytest.raises(ValueError, match="variant must be"):
        model.load(two_variants, dtype="float32", variant="fp16.x")
