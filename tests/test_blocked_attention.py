"""The block-wise (online-softmax) attention equals the plain one: masks, grouped-query heads, odd lengths."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("lq,lk,h,hkv,masked", [(256, 256, 4, 4, False), (96, 512, 4, 1, True), (40, 70, 2, 2, True),
                                                (768, 768, 4, 4, False)])
def test_blocked_matches_dot(lq, lk, h, hkv, masked):
    import jax.numpy as jnp

    from model.attention import attention

    rng = np.random.default_rng(lq + lk)
    q = jnp.asarray(rng.standard_normal((2, lq, h, 32), np.float32))
    k = jnp.asarray(rng.standard_normal((2, lk, hkv, 32), np.float32) * 3)
    v = jnp.asarray(rng.standard_normal((2, lk, hkv, 32), np.float32))
    mask = None
    if masked:  # causal-style plus padding, with one fully masked row (it averages v in both forms)
        mask = np.tril(np.ones((lq, lk), bool), k=lk - lq)[None, None] & (np.arange(lk) < lk - 7)[None, None, None]
        mask = np.broadcast_to(mask, (2, 1, lq, lk)).copy()
        mask[1, 0, 3] = False
        mask = jnp.asarray(mask)
    want = np.asarray(attention(q, k, v, mask=mask, implementation="dot"))
    got = np.asarray(attention(q, k, v, mask=mask, implementation="blocked"))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # the scale is folded into q: other rounding


def test_auto_is_blocked_on_cpu():
    import jax

    from model.attention import resolve_implementation

    if jax.default_backend() == "cpu":
        assert resolve_implementation("auto") == resolve_implementation("auto", masked=True) == "blocked"


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_padding_key_blocks_are_skipped_without_changing_a_bit(padding_side):
    """The text encoder's mask (causal + padding, 512 keys, 20 real tokens): with right padding the key blocks of
    padding are skipped and the result is bit-identical to computing them; with left padding (fully masked rows)
    nothing is skipped. Both equal the plain attention."""
    import jax
    import jax.numpy as jnp

    from model import attention as attn

    rng = np.random.default_rng(7)
    lk, real = 512, 20
    q = jnp.asarray(rng.standard_normal((2, lk, 4, 32), np.float32))
    k = jnp.asarray(rng.standard_normal((2, lk, 1, 32), np.float32) * 3)
    v = jnp.asarray(rng.standard_normal((2, lk, 1, 32), np.float32))
    keep = np.arange(lk) < real if padding_side == "right" else np.arange(lk) >= lk - real
    mask = jnp.asarray(np.tril(np.ones((lk, lk), bool))[None, None] & keep[None, None, None])
    scale = 1.0 / np.sqrt(32.0)
    blocked = jax.jit(lambda q, k, v, m: attn._blocked_attention(q, k, v, m, scale))
    got = np.asarray(blocked(q, k, v, mask))
    # the same computation with every block forced to run: a fully masked extra query row disables skipping
    q1 = jnp.concatenate([q, q[:, :1]], axis=1)
    m1 = jnp.concatenate([mask, jnp.zeros((1, 1, 1, lk), bool)], axis=2)
    every_block = np.asarray(blocked(q1, k, v, m1))[:, :lk]
    np.testing.assert_array_equal(got, every_block)
    want = np.asarray(attn.attention(q, k, v, mask=mask, implementation="dot"))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # the scale is folded into q: other rounding
