"""Unmasked flash attention (online softmax) as a Pallas TPU kernel that holds every key of a head in one block.

Splash streams the keys in blocks of at most 1536 on a v5e chip: its scoped VMEM (16 MiB) holds no more. This kernel
raises the scoped limit (VMEM_LIMIT_BYTES) so a query block meets all of a head's keys and values in one grid step,
which removes the per-block pipeline overhead; inside, it walks the keys in slices of `block_kv_compute` with the
usual running max and rescale. On one v5e chip it measured faster than splash at klein's shapes, with the same output
(docs/performance.md; `python -m benchmarks.attention_kernels` times it per block pair). float32 logits and
accumulators; the probabilities meet v in v's dtype, as splash does. Lengths longer than a block are cut into the
largest blocks of a multiple of 128 tokens that divide them (`kernel_blocks`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # the initial running max (splash's value)
VMEM_LIMIT_BYTES = 64 * 1024 * 1024  # a v5e core has 128 MiB of VMEM, 16 MiB scoped by default
BLOCK_Q, BLOCK_KV, BLOCK_KV_COMPUTE = 1536, 4608, 512  # the measured best on v5e for 4608 tokens


def fit_block(requested: int, length: int) -> int | None:
    """The block for `length` tokens: the whole length when it is no more than `requested`, else the largest multiple
    of 128 up to `requested` that divides it; None when there is none."""
    if length <= requested:
        return length
    for block in range(requested - requested % LANES, 0, -LANES):
        if length % block == 0:
            return block
    return None


def kernel_blocks(lq: int, lk: int, block_q: int = BLOCK_Q, block_kv: int = BLOCK_KV,
                  block_kv_compute: int = BLOCK_KV_COMPUTE) -> tuple[int, int, int] | None:
    """The (block_q, block_kv, block_kv_compute) the kernel runs for these lengths and requested blocks: query and key
    blocks fitted to the lengths (`fit_block`), the key slices a whole key block when they do not divide it; None
    when no block fits."""
    bq, bkv = fit_block(block_q, lq), fit_block(block_kv, lk)
    if bq is None or bkv is None:
        return None
    return bq, bkv, block_kv_compute if bkv % block_kv_compute == 0 else bkv


def fits(lq: int, lk: int) -> bool:
    """Whether the kernel takes queries and keys of these lengths at the default blocks (blocks that divide them)."""
    return lq % 8 == 0 and lk % LANES == 0 and kernel_blocks(lq, lk) is not None


def _lanes(x, width: int):
    """A lane-replicated [rows, 128] array as [rows, width]."""
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    return x[:, :width] if width < LANES else jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def _kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, bkv_compute: int, pv_dtype):
    """One (batch row, head, query block, key block) step; scratch: the running max m and row sum l ([bq, 128],
    lane-replicated, as splash keeps them) and the float32 accumulator."""
    j, last = pl.program_id(3), pl.num_programs(3) - 1
    d = q_ref.shape[1]

    @pl.when(j == 0)
    def _init():
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)

    def step(c, carry):
        k = k_ref[pl.ds(c * bkv_compute, bkv_compute), :]
        v = v_ref[pl.ds(c * bkv_compute, bkv_compute), :]
        s = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - _lanes(m_next, bkv_compute))
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_ref[...] + jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
        pv = lax.dot_general(p.astype(pv_dtype), v.astype(pv_dtype), (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        acc_ref[...] = _lanes(alpha, d) * acc_ref[...] + pv
        return carry

    lax.fori_loop(0, k_ref.shape[0] // bkv_compute, step, 0, unroll=True)

    @pl.when(j == last)
    def _end():
        o_ref[...] = (acc_ref[...] / _lanes(l_ref[...], d)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_q", "block_kv", "block_kv_compute"))
def flash_attention(qh, kh, vh, *, interpret: bool = False, block_q: int = BLOCK_Q, block_kv: int = BLOCK_KV,
                    block_kv_compute: int = BLOCK_KV_COMPUTE):
    """softmax(q k^T) v on head-major q, k, v [B, H, L, D] (q already scaled), [B, Lq, H, D] in q's dtype out, like
    `model.nets.attention.attention_heads`; lengths the blocks do not divide are refused (`fits`)."""

    b, h, lq, d = qh.shape
    lk = kh.shape[2]
    blocks = kernel_blocks(lq, lk, block_q, block_kv, block_kv_compute)
    if blocks is None:
        raise ValueError(f"flash_attention: no block of at most {block_q} / {block_kv} tokens, a multiple of {LANES}, "
                         f"divides the lengths {lq} / {lk}")
    bq, bkv, bkvc = blocks
    lane_dense = d % LANES == 0  # then the output is written straight into [B, Lq, H * D] (no transpose after)
    if lane_dense:
        out_shape = jax.ShapeDtypeStruct((b, lq, h * d), qh.dtype)
        out_spec = pl.BlockSpec((None, bq, d), lambda bb, hh, i, j: (bb, i, hh))
    else:
        out_shape = jax.ShapeDtypeStruct((b, h, lq, d), qh.dtype)
        out_spec = pl.BlockSpec((None, None, bq, d), lambda bb, hh, i, j: (bb, hh, i, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, bkv_compute=bkvc, pv_dtype=vh.dtype),
        grid=(b, h, lq // bq, lk // bkv),
        in_specs=[pl.BlockSpec((None, None, bq, d), lambda bb, hh, i, j: (bb, hh, i, 0)),
                  pl.BlockSpec((None, None, bkv, d), lambda bb, hh, i, j: (bb, hh, j, 0)),
                  pl.BlockSpec((None, None, bkv, d), lambda bb, hh, i, j: (bb, hh, j, 0))],
        out_specs=out_spec,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret, name="flash_attention",
    )(qh, kh, vh)
    return out.reshape(b, lq, h, d) if lane_dense else out.transpose(0, 2, 1, 3)
