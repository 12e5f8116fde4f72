"""LoRA adapters applied unmerged, chosen per batch: y = x @ W + (x @ A) @ B beside the base matmul.

Each adapted linear layer holds a bank of every adapter's factors (`lora_down` [adapters + 1, in, rank], `lora_up`
[adapters + 1, rank, out], zero-padded to the largest rank, the adapter's scale folded into its up factor; entry 0 is
all zeros: no adapter). A program picks one entry of every bank with `choose_adapter(state, index)`: the index is an
argument of the compiled program, not part of its shape, so one compile serves every adapter and the base model. One
copy of the base weights (bf16 or int8) serves them all; the LoRA path runs in the model's float dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


ADAPTERS_AXIS, RANK_AXIS = "lora_adapters", "lora_rank"  # logical axes of a bank (model.parallel.sharding)


class LoraFactor(nnx.Variable):
    """A bank of LoRA factors of one linear layer: attached after the load (`attach_banks`), never read from the
    checkpoint."""


def lora_term(layer, x, take):
    """(x @ A) @ B of the layer's chosen adapter (None where the layer has no bank), its columns selected by `take`
    as the base matmul's are. A bank no adapter was chosen from (a module called outside the programs) is the base."""
    down = getattr(layer, "lora_down", None)
    if down is None:
        return None
    a, b = down[...], layer.lora_up[...]
    if a.ndim == 3:
        a, b = a[0], b[0]
    if take is not None:
        b = take(b)
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # as layers.precision_for
    return jnp.dot(jnp.dot(x.astype(a.dtype), a, precision=precision), b, precision=precision)


def choose_adapter(state, index):
    """`state` (a transformer's, with banks) with every bank replaced by its entry `index` (an int32 scalar, may be
    traced): 0 = no adapter, i = the job's i-th unmerged adapter."""
    def pick(x):
        if isinstance(x, LoraFactor):
            return x.replace(jax.lax.dynamic_index_in_dim(x.get_value(), index, 0, keepdims=False))
        return x
    return jax.tree.map(pick, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def bank_arrays(deltas: list, in_features: int, out_features: int, dtype):
    """(down [n + 1, in, R], up [n + 1, R, out]) in JAX layout of one parameter's LoraDelta per adapter (None where
    an adapter leaves it alone), R the largest rank; the scale folded into up, entry 0 zeros."""
    rank = max(d.down.shape[0] for d in deltas if d is not None)
    down = np.zeros((len(deltas) + 1, in_features, rank), np.float32)
    up = np.zeros((len(deltas) + 1, rank, out_features), np.float32)
    for i, d in enumerate(deltas, start=1):
        if d is not None:
            r = d.down.shape[0]
            down[i, :, :r] = d.down.T
            up[i, :r, :] = d.scale * d.up.T
    return jnp.asarray(down, dtype), jnp.asarray(up, dtype)


def attach_banks(transformer: nnx.Module, adapters: list[dict], dtype, moves: dict | None = None) -> int:
    """Give each linear layer of `transformer` that any of `adapters` ({parameter name: LoraDelta} each, in the
    job's order: bank entry i + 1 is adapter i) its banks, laid out as its weight is (`moves`: {weight path: (order,
    axis)}, model.parallel.shard_order.stored_to_order) and declaring the weight's logical axes. Returns how many
    layers got one."""
    moves = moves or {}
    names = sorted({name for deltas in adapters for name in deltas})
    for name in names:
        path = tuple(int(p) if p.isdigit() else p for p in name.split("."))
        layer = transformer
        for part in path[:-1]:
            layer = layer[part] if isinstance(part, int) else getattr(layer, part)
        weight = layer.weight
        in_features, out_features = weight.get_value().shape
        down, up = bank_arrays([deltas.get(name) for deltas in adapters], in_features, out_features, dtype)
        order, axis = moves.get(path, (None, None))
        if order is not None:
            if axis == 0:
                down = jnp.take(down, jnp.asarray(order), axis=1)
            else:
                up = jnp.take(up, jnp.asarray(order), axis=2)
        in_axis, out_axis = weight.get_metadata()["logical_axes"]
        layer.lora_down = LoraFactor(down, logical_axes=(ADAPTERS_AXIS, in_axis, RANK_AXIS))
        layer.lora_up = LoraFactor(up, logical_axes=(ADAPTERS_AXIS, RANK_AXIS, out_axis))
    return len(names)
