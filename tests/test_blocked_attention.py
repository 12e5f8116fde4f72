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
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_auto_is_blocked_on_cpu():
    import jax

    from model.attention import resolve_implementation

    if jax.default_backend() == "cpu":
        assert resolve_implementation("auto") == resolve_implementation("auto", masked=True) == "blocked"
