"""Where parameters live on the (data, model) mesh: each parameter declares logical axes, one table maps them.

Every parameter is created with the logical names of its axes (`logical_axes` metadata, given where the layers
declare it: model/nets/layers.py, and the networks that pick the names); `LOGICAL_AXIS_RULES` maps each name to a mesh
axis or to None (replicated), as MaxText's logical axis rules do. Nothing is decided by a layer's name, and a
parameter without declared axes, or with a name the table does not know, is an error rather than silently
replicated.

The scheme is Megatron's tensor parallelism, left to XLA's partitioner: projections that fan out (attention q/k/v,
the MLP's input, the single blocks' fused qkv+MLP input) are split by output features, those that fan back in by
input features, the text encoder's embedding table by vocabulary rows; attention heads therefore live on the chip
that computed them and each block costs one all-reduce per stream. Fused projections are stored shard-major
(model.parallel.shard_order) so each chip's even slice holds matching parts. Norms, modulation, embedders and the VAE
are small and stay replicated, as does any dimension the mesh axis does not divide (correct, only less memory saved).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..errors import ModelError
from .mesh import MODEL

# Logical axis name -> mesh axis (None: replicated). Every name a parameter declares must be listed here.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": MODEL,        # embedding table rows
    "heads": MODEL,        # attention features: q/k/v outputs, the output projection's inputs
    "kv_heads": MODEL,     # the text encoder's grouped key/value features
    "mlp": MODEL,          # MLP hidden features (the SwiGLU's [a | b], shard-major)
    "heads_mlp": MODEL,    # the single blocks' fused [q | k | v | a | b] outputs and [attention | mlp] inputs
    "embed": None,         # the residual stream's width
    "text_embed": None,    # the stacked text-encoder states the transformer reads
    "latent": None,        # patchified latent channels
    "timestep": None,      # sinusoidal timestep channels
    "modulation": None,    # the adaptive norms' shift/scale/gate sets
    "norm": None,          # norm scales and biases, BatchNorm statistics
    "channels": None,      # the VAE's attention features
    "conv_height": None, "conv_width": None, "conv_in": None, "conv_out": None,  # the VAE's convolution kernels
    "lora_adapters": None, "lora_rank": None,  # unmerged LoRA banks' entries and rank (model.nets.lora_bank)
    "score": None,         # the scoring model's (CLIP, its heads) parameters: small next to the generator's, replicated
}


class AxesError(ModelError, ValueError):
    """A parameter declares no logical axes, the wrong number, or a name LOGICAL_AXIS_RULES does not list; `path`
    names the parameter, `axes` is what it declared (None: nothing)."""

    def __init__(self, message: str, *, path: str, axes):
        self.path = path
        self.axes = axes
        super().__init__(f"{message}: parameter {path!r} declares logical axes {axes!r}")


def param(value, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter holding `value` whose axes are named `axes` (keys of LOGICAL_AXIS_RULES), one per dimension."""
    return nnx.Param(value, logical_axes=tuple(axes))


def declared_axes(variable, path: str = "?") -> tuple[str, ...]:
    """The logical axes a parameter declares, checked against its shape and the rules; AxesError otherwise."""
    axes = variable.get_metadata().get("logical_axes")
    shape = variable.get_value().shape
    if axes is None:
        raise AxesError("no logical axes declared", path=path, axes=None)
    if len(axes) != len(shape):
        raise AxesError(f"{len(axes)} axes for a parameter of shape {tuple(shape)}", path=path, axes=axes)
    unknown = [a for a in axes if a not in LOGICAL_AXIS_RULES]
    if unknown:
        raise AxesError(f"logical axes {unknown} are not in LOGICAL_AXIS_RULES", path=path, axes=axes)
    return tuple(axes)


def partition_spec(axes: tuple[str, ...], shape, mesh_shape) -> P:
    """The PartitionSpec of a parameter of `shape` with logical `axes` on a mesh of `mesh_shape` ({axis: size}): each
    axis on its rule's mesh axis where that axis has several devices and divides the dimension, else replicated."""
    spec = []
    for axis, size in zip(axes, shape):
        mesh_axis = LOGICAL_AXIS_RULES[axis]
        devices = mesh_shape.get(mesh_axis, 1) if mesh_axis else 1
        spec.append(mesh_axis if devices > 1 and size % devices == 0 else None)
    return P(*spec) if any(spec) else P()


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def state_shardings(state, mesh: Mesh):
    """NamedShardings for every parameter of an NNX state, by its declared axes (same tree structure)."""
    mesh_shape = dict(mesh.shape)
    variables = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)[0]
    shardings = [NamedSharding(mesh, partition_spec(declared_axes(var, _path_name(path)), var.get_value().shape,
                                                    mesh_shape)) for path, var in variables]
    return jax.tree.unflatten(jax.tree.structure(state), shardings)


def placement(mesh: Mesh):
    """`place(path, variable) -> NamedSharding` for weights as they are read (model.loading.loader.load_component): the
    shardings `state_shardings` gives, so a model split over several chips is never whole on one of them."""
    mesh_shape = dict(mesh.shape)
    return lambda path, var: NamedSharding(mesh, partition_spec(
        declared_axes(var, ".".join(str(p) for p in path)), var.get_value().shape, mesh_shape))


def bytes_per_device(state, shardings) -> int:
    """Bytes one device holds of `state` laid out by `shardings` (its shard of every leaf)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total
