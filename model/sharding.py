"""Where parameters and activations live on a (data, model) mesh: tensor parallelism over the model axis.

The scheme is Megatron's, expressed as GSPMD shardings and left to XLA's partitioner: every projection that fans
out (attention q/k/v, the MLP's input, the single blocks' fused qkv+MLP input) is split by output features
(column-parallel, P(None, "model")), every projection that fans back in (attention output, the MLP's output) by input
features (row-parallel, P("model", None)); the text encoder's embedding table is split by vocabulary rows. Attention
heads therefore live on the chip that computed them, and each block costs one all-reduce of its output per stream.
Fused projections (the single blocks' [q | k | v | mlp] and the SwiGLU [a | b]) are stored shard-major
(model.shard_layout), so that each chip's even slice holds matching parts and taking them apart moves no data.
Weights are placed split as they are read (`placement`), so a model larger than one chip never sits whole on one.
Norms, modulation, embedders and the VAE are small and stay replicated, as does any dimension the shard count does
not divide (correct, only less memory saved). The batch is split over the data axis.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .mesh import MODEL, model_shards

# Layer names (the diffusers/transformers module names) by how their [in, out] weight is split.
COLUMN_PARALLEL = frozenset({"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "linear_in",
                             "to_qkv_mlp_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW_PARALLEL = frozenset({"to_out", "to_add_out", "linear_out", "o_proj", "down_proj"})
VOCAB_PARALLEL = frozenset({"embed_tokens"})


def layer_name(path) -> str | None:
    """The module a parameter belongs to: the last name before 'weight'/'bias', list indices skipped
    (('transformer_blocks', 0, 'attn', 'to_out', 0, 'weight') -> 'to_out')."""
    names = [str(p) for p in path if not isinstance(p, int) and not str(p).isdigit()]
    return names[-2] if len(names) >= 2 else None


def partition_spec(path, shape, shards: int) -> P:
    """The PartitionSpec of one parameter on a mesh whose model axis has `shards` devices."""
    if shards <= 1 or not shape:
        return P()
    name, leaf = layer_name(path), str(path[-1])
    dims = len(shape)
    if name in COLUMN_PARALLEL:
        split = dims - 1 if leaf == "weight" or dims == 1 else None  # [in, out] weight or [out] bias: out
    elif name in ROW_PARALLEL and leaf == "weight" and dims == 2:
        split = 0  # [in, out]: in (the bias is added once, after the all-reduce: replicated)
    elif name in VOCAB_PARALLEL and dims == 2:
        split = 0  # [vocab, hidden]
    else:
        return P()
    if split is None or shape[split] % shards:
        return P()
    return P(*[MODEL if d == split else None for d in range(dims)])


def state_shardings(state, mesh: Mesh, split: bool = True):
    """NamedShardings for every leaf of an NNX state (same tree structure); `split=False` replicates every leaf
    (the VAE: small, and its mid-block attention is not worth a collective)."""
    shards = model_shards(mesh) if split else 1

    def one(path, leaf):
        keys = tuple(k.key if hasattr(k, "key") else k.idx for k in path if not hasattr(k, "name"))  # no `.value`
        return NamedSharding(mesh, partition_spec(keys, getattr(leaf, "shape", ()), shards))

    return jax.tree_util.tree_map_with_path(one, state)


def placement(mesh: Mesh, split: bool = True):
    """`place(path, shape) -> NamedSharding` for weights as they are read (model.weights.load_component): the same
    shardings `state_shardings` gives, so a model split over several chips is never whole on one of them."""
    shards = model_shards(mesh) if split else 1
    return lambda path, shape: NamedSharding(mesh, partition_spec(tuple(path), shape, shards))


def bytes_per_device(state, shardings) -> int:
    """Bytes one device holds of `state` laid out by `shardings` (its shard of every leaf)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total
