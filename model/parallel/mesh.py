"""The (data, model) device mesh the programs run on, and the one check that a shard count fits the devices.

`model_shards` devices hold one copy of the weights between them (tensor parallel over the "model" axis); the batch
is split over the len(devices) / model_shards copies (the "data" axis). The loader, the generator and the preflight
all build their mesh here, so they agree on it.
"""

from __future__ import annotations

import logging

from ..errors import ModelError

logger = logging.getLogger(__name__)

DATA, MODEL = "data", "model"


class ShardCountError(ModelError, ValueError):
    """`model_shards` does not divide the devices a mesh is made of; carries both (`model_shards`, `devices`: the
    count) and the devices' kind."""

    def __init__(self, model_shards: int, devices: int, device_kind: str):
        self.model_shards = model_shards
        self.devices = devices
        self.device_kind = device_kind
        super().__init__(f"model_shards={model_shards} must divide the number of devices, {devices} ({device_kind})")


def shard_counts(devices: int) -> list[int]:
    """The model-shard counts a mesh of `devices` devices allows (its divisors), ascending."""
    return [d for d in range(1, devices + 1) if devices % d == 0]


def check_model_shards(model_shards: int, devices) -> None:
    """ShardCountError unless `model_shards` is a positive divisor of len(devices)."""
    devices = list(devices)
    if model_shards < 1 or len(devices) % model_shards:
        raise ShardCountError(model_shards, len(devices), devices[0].device_kind)


def make_mesh(options, devices=None):
    """The (data, model) mesh of the programs: over `devices` (default: all local devices of `options.platform`),
    `options.model_shards` of them holding one copy of the weights. `options`: a model.options.EngineOptions.

    `jax.make_mesh` orders TPU devices by their physical links (on CPU it keeps the given order); its axes are made
    Auto, the sharding mode the programs are written for (its default is Explicit). A device set it has no physical
    layout for (a v4 topology's one device per core) keeps the given order."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    if devices is None:
        devices = jax.local_devices(backend=options.platform)
    devices = list(devices)
    check_model_shards(options.model_shards, devices)
    shape, names = (len(devices) // options.model_shards, options.model_shards), (DATA, MODEL)
    try:
        return jax.make_mesh(shape, names, (AxisType.Auto, AxisType.Auto), devices=devices)
    except (AssertionError, ValueError) as e:  # mesh_utils asserts one device per chip on TPUs after v3
        logger.info("devices in the given order for the mesh (%s): %s", devices[0].device_kind, e)
        return Mesh(np.array(devices).reshape(shape), names)


def model_shards(mesh) -> int:
    """Devices that hold one copy of the weights between them."""
    return int(mesh.shape.get(MODEL, 1))


def data_replicas(mesh) -> int:
    """Copies of the weights on the mesh: the batch is split over them."""
    return int(mesh.shape.get(DATA, 1))
