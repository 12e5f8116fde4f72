"""Scaled dot-product attention with interchangeable implementations and an optional boolean mask.

Shapes: q [B, Lq, H, D], k/v [B, Lk, Hkv, D] with H a multiple of Hkv (grouped-query attention); mask is boolean,
broadcastable to [B, H, Lq, Lk], True where a query may attend to a key.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "dot", "xla", "cudnn")


def resolve_implementation(name: str) -> str:
    """Map a requested implementation to one available on the current backend (with a logged fallback)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {IMPLEMENTATIONS}")
    backend = jax.default_backend()
    if name == "auto":
        return "cudnn" if backend == "gpu" else "xla"
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


def attention(q, k, v, *, mask=None, implementation: str = "xla"):
    """Softmax(q k^T / sqrt(D)) v with the chosen implementation; returns [B, Lq, H, D] in q's dtype."""
    scale = 1.0 / (q.shape[-1] ** 0.5)
    if implementation == "dot":
        return _dot_attention(q, k, v, mask, scale).astype(q.dtype)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    impl = "cudnn" if implementation == "cudnn" else "xla"
    if impl == "cudnn" and (q.dtype not in (jnp.bfloat16, jnp.float16)):
        impl = "xla"
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=impl).astype(q.dtype)
