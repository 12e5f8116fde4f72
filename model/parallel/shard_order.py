"""Shard-major order of fused projections, so that splitting them over the model axis needs no resharding.

A fused projection's output is several parts side by side: [q | k | v | mlp_a | mlp_b] in the single-stream blocks,
[a | b] in the SwiGLU MLPs. Split evenly over S shards as stored, shard 0 would hold q and part of k, so taking the
parts apart moves data between chips (the preflight saw 72 all-to-alls, 1.68 GiB per device and denoising step, for
klein-9B on 4 shards). Laid out shard-major instead, shard s holds [q_s | k_s | v_s | a_s | b_s] (the s-th slice of
every part): its even split is exactly each chip's heads and MLP columns. The projection that consumes the parts
again (the single blocks' to_out) has its input rows laid out the same way. With S = 1 the order is the stored one.

Pure index arithmetic (`shard_major_order`, `split_parts`, `join_parts`) plus `order_for_shards(module, shards)`, which
permutes a loaded module's weights in place and records the order on the modules that read it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def usable_shards(sizes, shards: int) -> int:
    """The shard count an order can use for parts of these sizes: `shards` when it divides every part, else 1."""
    return shards if shards > 1 and all(n % shards == 0 for n in sizes) else 1


def shard_major_order(sizes, shards: int) -> np.ndarray:
    """Index j of the shard-major order holds index order[j] of the stored order (parts `sizes`, in order)."""
    offsets = np.cumsum((0,) + tuple(sizes))[:-1]
    return np.concatenate([np.arange(off + s * (n // shards), off + (s + 1) * (n // shards))
                           for s in range(shards) for off, n in zip(offsets, sizes)])


def split_parts(x, sizes, shards: int):
    """The parts of `x`'s last axis (shard-major over `shards`), each in its stored order."""
    lead, per_shard = x.shape[:-1], [n // shards for n in sizes]
    blocks = x.reshape(*lead, shards, sum(per_shard))
    starts = np.cumsum([0] + per_shard)
    return [blocks[..., a:b].reshape(*lead, n) for a, b, n in zip(starts[:-1], starts[1:], sizes)]


def join_parts(parts, shards: int):
    """The inverse of `split_parts`: parts (stored order) side by side in the shard-major order."""
    lead = parts[0].shape[:-1]
    blocks = [p.reshape(*lead, shards, p.shape[-1] // shards) for p in parts]
    return jnp.concatenate(blocks, axis=-1).reshape(*lead, sum(p.shape[-1] for p in parts))


def _permute(param: nnx.Param, order: np.ndarray, axis: int) -> None:
    value = param.get_value()
    if isinstance(value, jax.ShapeDtypeStruct):  # abstract modules (the preflight): shapes only, nothing to move
        return
    param.set_value(jnp.take(value, jnp.asarray(order), axis=axis))


def order_for_shards(module: nnx.Module, shards: int) -> nnx.Module:
    """Permute every fused projection of `module` (a loaded transformer) into the shard-major order for `shards`,
    in place; idempotent, and a module laid out for another count is first returned to the stored order."""
    for _, layer in nnx.iter_modules(module):
        if not hasattr(layer, "fused_parts"):
            continue
        fused = layer.fused_parts()  # [(linear's attribute, axis of its weight to permute, part sizes)]
        new = usable_shards([n for _, _, sizes in fused for n in sizes], shards)
        if new == layer.order_shards:
            continue
        for name, axis, sizes in fused:
            back = np.argsort(shard_major_order(sizes, layer.order_shards))  # current order -> stored
            order = back[shard_major_order(sizes, new)]  # stored -> new, composed
            linear = getattr(layer, name)
            _permute(linear.weight, order, axis)
            if axis == 1:  # a column's bias and int8 scale (model.nets.quantize) move with it
                for per_column in ("bias", "weight_scale"):
                    if getattr(linear, per_column, None) is not None:
                        _permute(getattr(linear, per_column), order, 0)
            bank = getattr(linear, "lora_down" if axis == 0 else "lora_up", None)  # model.nets.lora_bank
            if bank is not None:  # [adapters, in, rank] / [adapters, rank, out]: the weight's axis is 1 / 2
                _permute(bank, order, 1 + axis)
        layer.order_shards = new
    return module


def stored_to_order(module: nnx.Module) -> dict[tuple, tuple[np.ndarray, int]]:
    """{parameter path: (order, axis)}: how each weight read from the checkpoint (stored order) is permuted into the
    order `module` records (`order_for_shards` on the abstract module, before loading); weights not listed stay as
    stored."""
    moves = {}
    for path, layer in nnx.iter_modules(module):
        if not hasattr(layer, "fused_parts") or layer.order_shards == 1:
            continue
        for name, axis, sizes in layer.fused_parts():
            order = shard_major_order(sizes, layer.order_shards)
            moves[(*path, name, "weight")] = (order, axis)
            if axis == 1 and getattr(getattr(layer, name), "bias", None) is not None:
                moves[(*path, name, "bias")] = (order, 0)
    return moves
