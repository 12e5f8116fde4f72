"""A merged LoRA adapter compiles no program of its own: each adapted weight's delta is merged by the device-layout
program (transpose, int8 quantization) the weight takes anyway, one per shape and rank, the adapter's scale an
argument. Counted on the tiny checkpoint (the accelerators' device layout forced on the CPU) and, from shapes alone,
for klein-4B's transformer with an adapter of every block projection."""

from __future__ import annotations

import os
import types

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding
from safetensors.numpy import save_file

import model
import model.engine.generator as generator_module
import model.loading.loader as loader
from model.engine.compile_events import BACKEND_COMPILE_EVENT
from model.loading.lora import LoraDelta
from model.loading.safetensors_file import open_component

RANK = 4


def _adapter_of_every_block_projection(checkpoint: str, path: str) -> dict[str, tuple[int, int]]:
    """A random diffusers-keys adapter of every 2-D weight in the transformer's blocks; {parameter: torch shape}."""
    files = open_component(os.path.join(checkpoint, "transformer"), None)
    shapes = {name: tuple(f.entries[name][1]) for name, f in files.items()
              if name.endswith(".weight") and "blocks." in name and len(f.entries[name][1]) == 2}
    rng = np.random.default_rng(0)
    tensors = {}
    for name, (out, width) in shapes.items():
        module = name.removesuffix(".weight")
        tensors[f"transformer.{module}.lora_A.weight"] = rng.standard_normal((RANK, width)).astype(np.float32)
        tensors[f"transformer.{module}.lora_B.weight"] = rng.standard_normal((out, RANK)).astype(np.float32)
    save_file(tensors, path)
    return shapes


def _load_counting_compiles(monkeypatch, checkpoint, **load):
    """The generator, the device layouts its load compiled and the programs built while its weights were placed."""
    built = []

    def on_duration(event, duration, **_):
        if event == BACKEND_COMPILE_EVENT:
            built.append(duration)

    plain_load = generator_module.load_components

    def counted(*args, **kwargs):
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            return plain_load(*args, **kwargs)
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)

    monkeypatch.setattr(generator_module, "load_components", counted)
    monkeypatch.setattr(loader, "DEVICE_TRANSPOSE_PLATFORMS", ("cpu", "tpu", "gpu"))
    loader.DEVICE_TRANSPOSES.clear()
    gen = model.load(checkpoint, dtype="float32", max_sequence_length=8, quantize="int8", **load)
    return gen, loader.DEVICE_TRANSPOSES.keys(), len(built)


def test_merge_compiles_one_layout_per_shape_and_rank(monkeypatch, tiny_ckpt, tmp_path):
    """With every block projection adapted, the load builds exactly the layout programs it prepared (no merge
    program beside them), one with the merge per adapted shape, each replacing the transpose of that shape."""
    adapted = _adapter_of_every_block_projection(tiny_ckpt, str(tmp_path / "every.safetensors"))
    _, plain_keys, plain_built = _load_counting_compiles(monkeypatch, tiny_ckpt)
    gen, keys, built = _load_counting_compiles(monkeypatch, tiny_ckpt, loras=[f"{tmp_path / 'every.safetensors'}:0.7"])
    assert gen.loras and built == len(keys) and plain_built == len(plain_keys), (built, len(keys))
    merging = [k for k in keys if k[-1]]
    assert sorted(k[1] for k in merging) == sorted(set(adapted.values()))
    assert {k[-1] for k in merging} == {RANK}
    # every merging layout takes the place of a transpose the plain load makes; a transpose stays only where a
    # weight of the same shape is not adapted
    without_rank = {k[:-1] for k in plain_keys}
    assert all(k[:-1] in without_rank for k in merging)
    assert len(keys) - len(plain_keys) <= len(merging)


@pytest.mark.parametrize("rank", [32, 128])
def test_klein_4b_adapter_adds_no_layout_program(monkeypatch, rank):
    """klein-4B's transformer in int8 with an adapter of every block projection: as many device-layout programs as
    without it, the merging ones one per distinct adapted shape (from the shapes alone: nothing allocated)."""
    from model.engine.factory import Networks
    from model.loading.presets import preset_config

    monkeypatch.setattr(loader, "DEVICE_TRANSPOSE_PLATFORMS", ("cpu", "tpu", "gpu"))
    transformer = Networks(preset_config("klein-4b"), "bfloat16", quantize="int8").transformer()
    expected = loader.expected_tensors(transformer)
    files = {name: types.SimpleNamespace(entries={name: ("BF16", shape, 0, 0)}) for name, shape in expected.items()}
    adapted = {name: shape for name, shape in expected.items()
               if "blocks." in name and name.endswith(".weight") and len(shape) == 2}
    deltas = {name: (LoraDelta(np.broadcast_to(np.float32(0), (rank, shape[1])),
                               np.broadcast_to(np.float32(0), (shape[0], rank)), 1.0),)
              for name, shape in adapted.items()}
    device = SingleDeviceSharding(jax.devices()[0])
    place = lambda path, var: device  # noqa: E731

    def keys(with_deltas):
        load = loader.ComponentLoad("transformer", transformer, expected, tensor_to_file=files,
                                    deltas=deltas if with_deltas else None)
        return loader.device_layout_keys([load], place)

    plain, merging = keys(False), keys(True)
    assert len(adapted) == 100  # 5 double blocks x 12 projections, 20 single blocks x 2
    assert sorted(k[1] for k in merging if k[-1]) == sorted(set(adapted.values()))
    assert len(merging) <= len(plain) + 1, (len(merging), len(plain))


SPLIT_MERGE = r'''
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model.loading import loader
from model.loading.lora import LoraDelta

mesh = Mesh(np.array(jax.devices()).reshape(1, 4), ("data", "model"))
rng = np.random.default_rng(0)
weight = rng.standard_normal((24, 16)).astype(np.float32)  # torch layout [out, in]
deltas = (LoraDelta(rng.standard_normal((3, 16)).astype(np.float32), rng.standard_normal((24, 3)).astype(np.float32),
                    0.5), LoraDelta(rng.standard_normal((2, 16)).astype(np.float32),
                                    rng.standard_normal((24, 2)).astype(np.float32), -1.5))
want = (weight + sum(d.scale * d.up.astype(np.float64) @ d.down for d in deltas)).T
for spec in (PartitionSpec(None, "model"), PartitionSpec("model", None)):  # JAX layout [in, out] split either way
    sharding = NamedSharding(mesh, spec)
    stored = loader._permuted(sharding, (1, 0))
    layout = loader.DEVICE_TRANSPOSES.get(loader.DEVICE_TRANSPOSES.key((1, 0), weight.shape, weight.dtype, sharding,
                                                                       None, loader.lora_rank(deltas)))
    args = [jax.device_put(weight, stored), *jax.device_put(loader.stacked_factors(deltas),
                                                            loader._factor_shardings(stored))]
    got = layout(*args)
    assert got.sharding.is_equivalent_to(sharding, 2), (got.sharding, spec)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
print("ok")
'''


def test_merge_of_a_weight_split_over_devices():
    """A weight split over 4 (CPU) devices either way merges its stacked deltas (two adapters, their own scales)
    where its blocks lie: W + sum scale_k up_k @ down_k, transposed, placed as the weight's parameter is."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", SPLIT_MERGE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
