"""Scaled dot-product attention with interchangeable implementations and an optional boolean mask.

Shapes: q [B, Lq, H, D], k/v [B, Lk, Hkv, D] with H a multiple of Hkv (grouped-query attention); mask is boolean,
broadcastable to [B, H, Lq, Lk], True where a query may attend to a key.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "dot", "xla", "cudnn", "blocked")
KEY_BLOCK = 256  # keys per block of the block-wise attention (a whole sequence when it does not divide)


def resolve_implementation(name: str, masked: bool = False) -> str:
    """Map a requested implementation to one available on the current backend (with a logged fallback).

    `masked`: the caller passes a mask (the text encoder); "auto" then never picks cuDNN, whose masked path it avoids.
    """
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {IMPLEMENTATIONS}")
    backend = jax.default_backend()
    if name == "auto":  # on CPU the block-wise form measured ~1.8x faster than XLA's (768 tokens, 4 heads, D 32)
        return {"gpu": "xla" if masked else "cudnn", "cpu": "blocked"}.get(backend, "xla")
    if name == "cudnn" and backend != "gpu":
        logger.warning("attention implementation 'cudnn' needs a GPU; using 'xla' on %s", backend)
        return "xla"
    return name


def _dot_attention(q, k, v, mask, scale):
    """Plain einsum attention with a float32 softmax; the readable reference implementation."""
    b, lq, h, d = q.shape
    hkv = k.shape[2]
    if hkv != h:
        k = jnp.repeat(k, h // hkv, axis=2)
        v = jnp.repeat(v, h // hkv, axis=2)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32, precision=precision) * scale
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=precision)


def _blocked_attention(q, k, v, mask, scale, block=KEY_BLOCK):
    """Online-softmax attention over key blocks (a lax.scan): logits stay [B, Hkv, G*Lq, block], float32 accumulators.

    The layout is made once, outside the loop: queries grouped by the key/value head they share ([B, Hkv, G*Lq, D],
    so grouped-query attention needs no repeated K/V) and, in float32, already scaled; keys and values as
    [n, B, Hkv, block, D]. Measured ~15% faster than einsums on [B, L, H, D] blocks (768 tokens, 4 heads, D 32)."""
    b, lq, h, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    block = block if lk % block == 0 else lk
    n = lk // block
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    fold_scale = q.dtype == jnp.float32  # in bf16 the scale stays on the float32 logits
    qg = (q * scale if fold_scale else q).reshape(b, lq, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, d)
    kb = k.reshape(b, n, block, hkv, d).transpose(1, 0, 3, 2, 4)
    vb = v.reshape(b, n, block, hkv, d).transpose(1, 0, 3, 2, 4)
    skippable = None
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, h, lq, lk))
        # A key block masked for every query adds exactly nothing once each row has seen one unmasked key (its
        # weights are exp(min - max) = 0), so it is skipped: the text encoder's padding keys. Only when no row is
        # fully masked, whose result (the mean of v, as in `_dot_attention`) needs every block.
        skippable = jnp.all(jnp.any(mask, axis=-1))
        mask = mask.reshape(b, hkv, g * lq, n, block).transpose(3, 0, 1, 2, 4)
    low = jnp.finfo(jnp.float32).min  # masked logits as in `_dot_attention` (a fully masked row averages v)

    def step(carry, blk):
        kk, vv, mm = blk
        if mm is None:
            return update(carry, kk, vv, None), None
        return jax.lax.cond(jnp.any(mm) | ~skippable, lambda c: update(c, kk, vv, mm), lambda c: c, carry), None

    def update(carry, kk, vv, mm):
        m, total, acc = carry
        logits = jnp.einsum("bhqd,bhkd->bhqk", qg, kk, preferred_element_type=jnp.float32, precision=precision)
        if not fold_scale:
            logits = logits * scale
        if mm is not None:
            logits = jnp.where(mm, logits, low)
        m_new = jnp.maximum(m, logits.max(-1))
        p = jnp.exp(logits - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32,
                        precision=precision)
        return m_new, total * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (jnp.full((b, hkv, g * lq), -jnp.inf, jnp.float32), jnp.zeros((b, hkv, g * lq), jnp.float32),
            jnp.zeros((b, hkv, g * lq, d), jnp.float32))
    # Unrolled (a few blocks): bit-identical, and XLA schedules the blocks together (text encoder ~10% faster).
    (_, total, acc), _ = jax.lax.scan(step, init, (kb, vb, mask), unroll=True)
    out = acc / total[..., None]  # [B, Hkv, G*Lq, D] -> [B, Lq, H, D]
    return out.reshape(b, hkv, g, lq, d).transpose(0, 3, 1, 2, 4).reshape(b, lq, h, d)


def attention(q, k, v, *, mask=None, implementation: str = "xla"):
    """Softmax(q k^T / sqrt(D)) v with the chosen implementation; returns [B, Lq, H, D] in q's dtype."""
    scale = 1.0 / (q.shape[-1] ** 0.5)
    if implementation == "dot":
        return _dot_attention(q, k, v, mask, scale).astype(q.dtype)
    if implementation == "blocked":
        return _blocked_attention(q, k, v, mask, scale).astype(q.dtype)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    impl = "cudnn" if implementation == "cudnn" else "xla"
    if impl == "cudnn" and (q.dtype not in (jnp.bfloat16, jnp.float16)):
        impl = "xla"
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=impl).astype(q.dtype)
