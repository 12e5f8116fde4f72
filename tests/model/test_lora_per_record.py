"""Unmerged LoRA adapters chosen per call (model.nets.lora_bank): each adapter's images are those of a model with that
adapter merged alone, the base's those of a model without adapters (within the suite's 4/255), all from one compile;
an unknown name is a RequestError naming it; an int8 layer adds the bf16/float LoRA path beside its int8 matmul.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import model
from model.errors import RequestError
from model.nets.lora_bank import LoraFactor, choose_adapter
from tests.model.test_lora import BFL_TO_DIFFUSERS, linear_shapes  # noqa: F401 - a fixture
from tests.model.test_model_parity import _assert_images_close

PROMPTS, SEEDS = ["a red cat on a mat"], [3]
ARGS = dict(height=32, width=32, num_inference_steps=2)


def _bfl_lora(linear_shapes, file, *, rank, seed):
    """Random factors of `rank` in BFL keys for the modules BFL_TO_DIFFUSERS names (fused q/k/v, the single blocks'
    fused projections in and out, embedders)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for bfl, ours in BFL_TO_DIFFUSERS.items():
        out, width = sum(linear_shapes[m][0] for m in ours), linear_shapes[ours[0]][1]
        tensors[f"diffusion_model.{bfl}.lora_A.weight"] = (rng.standard_normal((rank, width)) * 0.3).astype(np.float32)
        tensors[f"diffusion_model.{bfl}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.3).astype(np.float32)
    save_file(tensors, str(file))
    return str(file)


@pytest.fixture(scope="module")
def adapters(linear_shapes, tmp_path_factory):  # noqa: F811 - the fixture imported above
    root = tmp_path_factory.mktemp("per_record")
    # two ranks: the bank pads the smaller one with zeros
    return {"a": _bfl_lora(linear_shapes, root / "a.safetensors", rank=4, seed=7) + ":0.7",
            "b": _bfl_lora(linear_shapes, root / "b.safetensors", rank=2, seed=8) + ":1.3"}


@pytest.fixture(scope="module")
def per_record(tiny_ckpt, adapters):
    return model.load(tiny_ckpt, dtype="float32", max_sequence_length=32, lora_per_record=True,
                      loras=[f"{name}={source}" for name, source in adapters.items()])


def test_each_adapter_gives_the_images_of_a_run_with_it_merged_alone(tiny_ckpt, adapters, per_record):
    ours = {name: per_record.generate(PROMPTS, SEEDS, lora=name, **ARGS) for name in (None, "a", "b")}
    assert per_record.programs.compile_count == 3, "one compiled set serves every adapter and the base"
    for name in (None, "a", "b"):
        alone = model.load(tiny_ckpt, dtype="float32", max_sequence_length=32,
                           loras=[adapters[name]] if name else [])
        _assert_images_close(ours[name], alone.generate(PROMPTS, SEEDS, **ARGS).astype(np.float64) / 255.0)
    for name in ("a", "b"):
        assert np.abs(ours[name].astype(int) - ours[None]).max() > 16, f"adapter {name} changes nothing"
    assert per_record.adapter_names == ("a", "b") and per_record.loras == ()
    assert per_record.adapter_identity("b")["scale"] == 1.3 and per_record.adapter_identity(None) is None


def test_an_unknown_adapter_is_a_request_error_naming_it_and_the_adapters(per_record):
    with pytest.raises(RequestError, match=r"'style'.*\['a', 'b'\]") as e:
        per_record.generate(PROMPTS, SEEDS, lora="style", **ARGS)
    assert e.value.field == "lora" and e.value.value == "style"


def test_int8_layer_adds_the_chosen_adapter_beside_its_int8_matmul():
    from model.nets.quantize import Int8Linear, int8_matmul, quantize_columns

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    layer = Int8Linear(6, 5, bias=False, dtype=jnp.float32, rngs=nnx.Rngs(0), axes=("embed", "heads"))
    values, scale = quantize_columns(w)
    layer.weight.set_value(values)
    layer.weight_scale.set_value(scale)
    down = rng.standard_normal((3, 6, 2)).astype(np.float32)
    up = rng.standard_normal((3, 2, 5)).astype(np.float32)
    down[0], up[0] = 0, 0
    layer.lora_down = LoraFactor(jnp.asarray(down), logical_axes=("lora_adapters", "embed", "lora_rank"))
    layer.lora_up = LoraFactor(jnp.asarray(up), logical_axes=("lora_adapters", "lora_rank", "heads"))
    graph, state = nnx.split(layer)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    base = np.asarray(int8_matmul(x, values, scale, jnp.float32))
    for index in (0, 1, 2):
        y = np.asarray(nnx.merge(graph, choose_adapter(state, jnp.int32(index)))(x))
        np.testing.assert_allclose(y, base + x @ down[index] @ up[index], rtol=1e-5, atol=1e-5)


SHARDED = r"""
import json, sys
import numpy as np, jax, model
assert len(jax.devices()) == 4
ckpt, loras, args = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
gen = model.load(ckpt, dtype="float32", max_sequence_length=32, lora_per_record=True, loras=loras, model_shards=2)
np.save(sys.argv[4], np.stack([gen.generate(lora=name, **args) for name in (None, "b")]))
print(gen.programs.compile_count)
"""


def test_banks_split_over_model_shards_give_the_one_device_images(tiny_ckpt, adapters, per_record, tmp_path):
    """On a (2 data x 2 model) mesh of CPU devices the banks are split with their weights' columns and rows (and laid
    out per shard for the fused projections): the one-device images."""
    import json
    import os
    import subprocess
    import sys

    args = dict(prompts=PROMPTS, seeds=SEEDS, **ARGS)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    loras = json.dumps([f"{name}={source}" for name, source in adapters.items()])
    out = subprocess.run([sys.executable, "-c", SHARDED, tiny_ckpt, loras, json.dumps(args), str(tmp_path / "x.npy")],
                         env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    sharded = np.load(tmp_path / "x.npy")
    for image, name in zip(sharded, (None, "b")):
        _assert_images_close(image, per_record.generate(PROMPTS, SEEDS, lora=name, **ARGS).astype(np.float64) / 255)
