"""Softmax attention written out in float64 numpy: the oracle the attention implementations are checked against."""

import numpy as np


def plain_attention(q, k, v, mask=None) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v for q [B, Lq, H, D], k/v [B, Lk, Hkv, D] (H a multiple of Hkv), float64; `mask`
    (boolean, broadcastable to [B, H, Lq, Lk]) allows a key where True, and a row that may attend to no key is zeros
    (as PyTorch's SDPA with a boolean mask)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    allowed = np.ones(logits.shape, bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), logits.shape)
    logits = np.where(allowed, logits, -np.inf)
    top = np.max(logits, axis=-1, keepdims=True)
    weights = np.where(allowed, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(-1, keepdims=True)
    probs = weights / np.where(total > 0, total, 1.0)
    return np.einsum("bhqk,bkhd->bqhd", probs, v)
