"""q, k and v put in the splash kernel's head-major layout in one pass over HBM, with the q/k RMSNorm, the interleaved
RoPE and the softmax scale applied on the way (a Pallas kernel for TPUs).

Why: XLA splits "norm, rotate, scale, transpose to [B, H, S, D]" into several fusions that write float32 copies of q
and k, which took longer than this kernel's whole work (docs/performance.md). This kernel reads
each 128-lane head block of the projection's output once, where the projection left it (a column offset into the
fused [q | k | v | mlp] output, so no slice is copied first), and writes the layout the attention kernel reads.

The arithmetic is the XLA path's, operation for operation (`reference_heads`): RMSNorm in float32, rounded to the
model's dtype, times the weight; RoPE in float32, rounded; times the scale in the model's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Tokens per grid step: the largest of these dividing the sequence (v5e: blocks of 1536 x 128 keep a step's buffers,
# double-buffered in and out with the float32 cos/sin, near 8 MiB of the 16 MiB scoped VMEM).
TOKEN_BLOCKS = (1536, 1024, 512, 256, 128, 64, 32, 16)


def token_block(length: int) -> int | None:
    """Tokens per grid step for a sequence of `length`, or None when no block divides it (the XLA path is used)."""
    return next((b for b in TOKEN_BLOCKS if length % b == 0), None)


def rope_partner(x32):
    """[-x[2i+1], x[2i]] for each pair of the last axis (float32): the lanes rolled one either way and selected."""
    even = jnp.arange(x32.shape[-1]) % 2 == 0
    return jnp.where(even, -jnp.roll(x32, -1, axis=-1), jnp.roll(x32, 1, axis=-1))


def _transform(x, weight, cos, sin, scale, eps: float):
    """One head's [S, D] block: RMSNorm (if `weight`), RoPE (if `cos`), scale (if `scale`), in x's dtype out."""
    dtype = x.dtype
    if weight is not None:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        x = (x32.astype(dtype).astype(jnp.float32) * weight.astype(jnp.float32)).astype(dtype)
    if cos is not None:
        x32 = x.astype(jnp.float32)
        x = (x32 * cos + _partner_in_kernel(x32) * sin).astype(dtype)
    if scale is not None:
        x = (x.astype(jnp.float32) * jnp.asarray(scale, dtype).astype(jnp.float32)).astype(dtype)
    return x


def _partner_in_kernel(x32):
    """`rope_partner` with the TPU lane roll (jnp.roll's direction: element i moves to i + shift)."""
    from jax.experimental.pallas import tpu as pltpu

    d = x32.shape[-1]
    lane = jax.lax.broadcasted_iota(jnp.int32, x32.shape, x32.ndim - 1)
    next_lane = pltpu.roll(x32, d - 1, x32.ndim - 1)  # x[i + 1] at lane i
    prev_lane = pltpu.roll(x32, 1, x32.ndim - 1)      # x[i - 1] at lane i
    return jnp.where(lane % 2 == 0, -next_lane, prev_lane)


def reference_heads(x, column: int, heads: int, head_dim: int, *, weight=None, eps: float = 1e-6, cos=None,
                    sin=None, scale=None):
    """The XLA form of `head_major`: the same products in the same order, [B, H, S, D]."""
    b, s, _ = x.shape
    part = jax.lax.slice_in_dim(x, column, column + heads * head_dim, axis=2).reshape(b, s, heads, head_dim)
    dtype = part.dtype
    if weight is not None:
        x32 = part.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        part = x32.astype(dtype) * weight.astype(dtype)
    if cos is not None:
        x32 = part.astype(jnp.float32)
        part = (x32 * cos[None, :, None, :] + rope_partner(x32) * sin[None, :, None, :]).astype(dtype)
    if scale is not None:
        part = part * jnp.asarray(scale, dtype)
    return part.transpose(0, 2, 1, 3)


def head_major(x, column: int, heads: int, head_dim: int, *, weight=None, eps: float = 1e-6, cos=None, sin=None,
               scale=None, interpret: bool | None = None):
    """Heads `heads` x `head_dim` read from x [B, S, C] at columns column.., as [B, H, S, D] in x's dtype, with the
    RMSNorm `weight` [D], RoPE `cos`/`sin` [S, D] (float32) and `scale` applied if given (in that order).

    `interpret`: run the Pallas kernel in interpret mode (default: only where the platform is not a TPU)."""
    from jax.experimental import pallas as pl

    b, s, c = x.shape
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    if column % head_dim or column + heads * head_dim > c or (head_dim % 128 and not interpret):
        raise ValueError(f"head_major needs whole heads (of 128 lanes on TPU) inside the columns: column {column}, "
                         f"heads {heads} x {head_dim}, {c} columns")
    block = token_block(s)
    if block is None:
        raise ValueError(f"head_major: no token block of {TOKEN_BLOCKS} divides the sequence length {s}")
    first_head = column // head_dim
    with_norm, with_rope = weight is not None, cos is not None
    inputs = [x]
    in_specs = [pl.BlockSpec((None, block, head_dim), lambda bi, si, hi: (bi, si, first_head + hi))]
    if with_norm:
        inputs.append(weight.reshape(1, head_dim))
        in_specs.append(pl.BlockSpec((1, head_dim), lambda bi, si, hi: (0, 0)))
    if with_rope:
        inputs += [cos.astype(jnp.float32), sin.astype(jnp.float32)]
        in_specs += [pl.BlockSpec((block, head_dim), lambda bi, si, hi: (si, 0))] * 2

    def kernel(*refs):
        x_ref, *rest = refs
        w_ref = rest.pop(0) if with_norm else None
        cos_ref, sin_ref = (rest.pop(0), rest.pop(0)) if with_rope else (None, None)
        (o_ref,) = rest
        o_ref[...] = _transform(x_ref[...], None if w_ref is None else w_ref[...],
                                None if cos_ref is None else cos_ref[...], None if sin_ref is None else sin_ref[...],
                                scale, eps)

    # Heads innermost: the cos/sin blocks stay put across a token block's heads, so they are fetched once per block.
    return pl.pallas_call(
        kernel, grid=(b, s // block, heads), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, block, head_dim), lambda bi, si, hi: (bi, hi, si, 0)),
        out_shape=jax.ShapeDtypeStruct((b, heads, s, head_dim), x.dtype), interpret=interpret,
        name="heads_norm_rope" if with_norm else "heads_layout")(*inputs)


def applies(implementation: str, mesh_devices: int, enabled: bool, platform: str, head_dim: int,
            *lengths: int) -> bool | str:
    """Whether attention's inputs go through the kernel, where the platform's forms enable it
    (model.nets.platform_forms), for splash attention on one device over sequences of these lengths: False, "compiled"
    (on TPUs, heads of whole 128-lane tiles) or "interpret" (elsewhere: the tests' way to check it on CPU)."""
    if not enabled or implementation != "splash" or mesh_devices > 1:
        return False
    if any(token_block(n) is None for n in lengths):
        return False
    if platform != "tpu":
        return "interpret"
    return "compiled" if head_dim % 128 == 0 else False
