"""The single homes of what a call runs with: the checkpoint's defaults and the shape bucket (model.engine.buckets),
the mesh and its shard check (model.parallel.mesh)."""

import types

import pytest


def _config(distilled: bool):
    from model.loading.presets import preset_config

    return preset_config("klein-4b" if distilled else "klein-base-4b")


def test_checkpoint_defaults_as_diffusers():
    """Distilled: 4 steps, no guidance (a scale above 1 is ignored); base: 50 steps, CFG at 4.0 unless <= 1."""
    from model.engine.buckets import Sampling, resolve_sampling

    distilled, base = _config(True), _config(False)
    assert resolve_sampling(distilled) == Sampling(4, 1.0, False)
    assert resolve_sampling(distilled, 8, 3.5) == Sampling(8, 3.5, False)
    assert resolve_sampling(base) == Sampling(50, 4.0, True)
    assert resolve_sampling(base, guidance_scale=1.0).use_cfg is False


def test_bucket_rounds_the_batch_to_whole_data_replicas():
    from model.engine.buckets import Sampling, bucket_for, compiled_batch

    assert [compiled_batch(b, 4) for b in (1, 4, 5, 8)] == [4, 4, 8, 8]
    config, sampling = _config(True), Sampling(4, 1.0, False)
    bucket = bucket_for(config, height=1024, width=768, sampling=sampling, batch=3, data_replicas=2)
    assert (bucket.batch, bucket.grid_h, bucket.grid_w, bucket.steps, bucket.cfg, bucket.ref_tokens) == (
        4, 64, 48, 4, False, 0)
    edit = bucket_for(config, height=64, width=64, sampling=sampling, batch=3, data_replicas=2,
                      reference_sizes=((64, 32), (32, 32)))
    assert (edit.batch, edit.ref_tokens) == (4, 4 * 2 + 2 * 2)  # each reference's latent tokens


def _devices(n, kind="TPU v5 lite"):
    return [types.SimpleNamespace(device_kind=kind, id=i) for i in range(n)]


def test_shard_count_is_checked_in_one_place():
    from model.errors import ModelError
    from model.parallel.mesh import ShardCountError, check_model_shards, shard_counts

    assert shard_counts(8) == [1, 2, 4, 8] and shard_counts(6) == [1, 2, 3, 6]
    check_model_shards(2, _devices(4))
    for bad in (3, 0, -2):
        with pytest.raises(ShardCountError) as info:
            check_model_shards(bad, _devices(4))
        assert (info.value.model_shards, info.value.devices, info.value.device_kind) == (bad, 4, "TPU v5 lite")
        assert isinstance(info.value, ModelError) and isinstance(info.value, ValueError)
    assert str(info.value) == "model_shards=-2 must divide the number of devices, 4 (TPU v5 lite)"


def test_make_mesh_over_the_local_devices():
    from jax.sharding import AxisType

    from model.parallel.mesh import ShardCountError, data_replicas, make_mesh, model_shards
    from model.options import EngineOptions

    mesh = make_mesh(EngineOptions())
    assert mesh.axis_names == ("data", "model") and model_shards(mesh) == 1
    assert set(mesh.axis_types) == {AxisType.Auto}  # the sharding mode the programs are written for
    assert data_replicas(mesh) == mesh.devices.size
    with pytest.raises(ShardCountError, match="must divide the number of devices"):
        make_mesh(EngineOptions(model_shards=mesh.devices.size + 1))


def test_a_topologys_mesh_follows_the_chips_links_and_per_core_devices_keep_their_order():
    """On a v5e 2x2 the four model shards are a ring of neighbouring chips (jax.make_mesh's physical order; the
    devices' own order puts chips 1 and 2, diagonal, next to each other); a v4 topology's one device per core, which
    jax.make_mesh refuses, is laid out in the given order."""
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed")
    from model.preflight.aot import topology_options
    from model.parallel.mesh import make_mesh
    from model.preflight.topology import load_topology

    mesh = make_mesh(topology_options(4), devices=list(load_topology("v5e:2x2").devices))
    chips = [tuple(d.coords) for d in mesh.devices.flat]
    assert mesh.devices.shape == (1, 4) and sorted(chips) == sorted(set(chips))
    for a, b in zip(chips, chips[1:] + chips[:1]):
        assert sum(abs(x - y) for x, y in zip(a, b)) == 1, chips
    v4 = list(load_topology("v4:2x2x1").devices)
    mesh = make_mesh(topology_options(2), devices=v4)
    assert mesh.devices.shape == (len(v4) // 2, 2) and list(mesh.devices.flat) == v4

