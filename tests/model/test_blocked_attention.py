"""Every attention implementation equals plain softmax attention (float64 numpy, tests/support): masks (dense,
causal, key padding), grouped-query heads, odd lengths; the block-wise one also skips padding blocks without changing
a bit. The splash kernel runs in Pallas interpret mode off TPU."""

from __future__ import annotations

import numpy as np
import pytest
from attention_reference import plain_attention


@pytest.mark.parametrize("lq,lk,h,hkv,masked", [(256, 256, 4, 4, False), (96, 512, 4, 1, True), (40, 70, 2, 2, True),
                                                (768, 768, 4, 4, False)])
def test_blocked_matches_plain_attention(lq, lk, h, hkv, masked):
    import jax.numpy as jnp

    from model.nets.attention import attention

    rng = np.random.default_rng(lq + lk)
    q = jnp.asarray(rng.standard_normal((2, lq, h, 32), np.float32))
    k = jnp.asarray(rng.standard_normal((2, lk, hkv, 32), np.float32) * 3)
    v = jnp.asarray(rng.standard_normal((2, lk, hkv, 32), np.float32))
    mask = None
    if masked:  # causal-style plus padding, with one fully masked row (zeros in both forms)
        mask = np.tril(np.ones((lq, lk), bool), k=lk - lq)[None, None] & (np.arange(lk) < lk - 7)[None, None, None]
        mask = np.broadcast_to(mask, (2, 1, lq, lk)).copy()
        mask[1, 0, 3] = False
        mask = jnp.asarray(mask)
    want = plain_attention(q, k, v, mask)
    got = np.asarray(attention(q, k, v, mask=mask, implementation="blocked"))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # the scale is folded into q: other rounding


def test_auto_is_blocked_on_cpu():
    import jax

    from model.nets.attention import resolve_implementation

    if jax.default_backend() == "cpu":
        assert resolve_implementation("auto") == resolve_implementation("auto", masked=True) == "blocked"


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("lk,real", [(512, 20), (300, 20), (300, 290)])
def test_padding_key_blocks_are_skipped_without_changing_a_bit(padding_side, lk, real):
    """The text encoder's mask (causal + padding, e.g. 512 keys, 20 real tokens): the key blocks of padding are
    skipped and the result is bit-identical to computing them, with right padding and with left padding (whose rows
    before the first real token see no key: zeros); a length that is no multiple of the block is padded to whole
    blocks. All equal the plain attention."""
    import jax
    import jax.numpy as jnp

    from model.nets import attention as attn

    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, lk, 4, 32), np.float32))
    k = jnp.asarray(rng.standard_normal((2, lk, 1, 32), np.float32) * 3)
    v = jnp.asarray(rng.standard_normal((2, lk, 1, 32), np.float32))
    keep = np.arange(lk) < real if padding_side == "right" else np.arange(lk) >= lk - real
    mask = jnp.asarray(np.tril(np.ones((lk, lk), bool))[None, None] & keep[None, None, None])
    scale = 1.0 / np.sqrt(32.0)
    blocked = jax.jit(lambda q, k, v, m: attn._blocked_attention(q, k, v, m, scale))
    every_block = jax.jit(lambda q, k, v, m: attn._blocked_attention(q, k, v, m, scale, skip_masked_blocks=False))
    has_key = np.asarray(attn._rows_with_any_key(mask, False, None, lk))
    got = np.where(has_key, np.asarray(blocked(q, k, v, mask)), 0)
    np.testing.assert_array_equal(got, np.where(has_key, np.asarray(every_block(q, k, v, mask)), 0))
    np.testing.assert_array_equal(got, np.asarray(attn.attention(q, k, v, mask=mask, implementation="blocked")))
    np.testing.assert_allclose(got, plain_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["blocked", "xla", "splash"])
@pytest.mark.parametrize("lq,h,hkv,padding", [(40, 4, 2, "right"), (40, 4, 2, "left"), (130, 2, 2, "right"),
                                              (256, 4, 1, "left"), (512, 4, 1, "left"), (24, 3, 3, None)])
def test_causal_and_key_masks_match_the_dense_mask(impl, lq, h, hkv, padding):
    """`causal=True, key_mask=...` (how the text encoder asks) == the same mask written out dense, for every
    implementation: right padding, left padding (rows before the first real token see no key: zeros),
    lengths that are not a multiple of any block, grouped-query heads; without a key mask, causal alone."""
    import jax.numpy as jnp

    from model.nets.attention import attention

    rng = np.random.default_rng(lq * 10 + h)
    q = jnp.asarray(rng.standard_normal((2, lq, h, 16), np.float32))
    k = jnp.asarray(rng.standard_normal((2, lq, hkv, 16), np.float32) * 3)
    v = jnp.asarray(rng.standard_normal((2, lq, hkv, 16), np.float32))
    key_mask = None
    if padding:
        real = np.array([lq // 3, lq // 2 - 5])  # a different number of real tokens in each row
        pos = np.arange(lq)[None]
        key_mask = pos < real[:, None] if padding == "right" else pos >= lq - real[:, None]
    dense = np.tril(np.ones((lq, lq), bool))[None, None]
    if key_mask is not None:
        dense = dense & key_mask[:, None, None, :]
    want = plain_attention(q, k, v, dense)
    got = np.asarray(attention(q, k, v, causal=True, key_mask=None if key_mask is None else jnp.asarray(key_mask),
                               implementation=impl))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lq,lk", [(24, 24), (100, 300)])
def test_splash_without_masks_matches_plain_attention(lq, lk):
    """The transformer's case: no mask, lengths padded up to the kernel's block and the padding keys excluded."""
    import jax.numpy as jnp

    from model.nets.attention import attention

    rng = np.random.default_rng(lq)
    q = jnp.asarray(rng.standard_normal((2, lq, 4, 16), np.float32))
    k = jnp.asarray(rng.standard_normal((2, lk, 4, 16), np.float32) * 3)
    v = jnp.asarray(rng.standard_normal((2, lk, 4, 16), np.float32))
    want = plain_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(attention(q, k, v, implementation="splash")), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_a_splash_kernel_built_in_one_program_serves_the_next(causal):
    """The kernel is cached by shape; built while one program was traced (the denoise loop of one bucket), it must
    hold no tracer of that trace when another program (the next bucket, the encoder) uses it."""
    import jax
    import jax.numpy as jnp

    from model.nets.attention import _splash_kernel, attention

    _splash_kernel.cache_clear()  # built here first, inside a trace, whatever ran before
    q = jnp.asarray(np.random.default_rng(5).standard_normal((1, 40, 2, 8), np.float32))
    first = jax.jit(lambda x: attention(x, x, x, causal=causal, implementation="splash"))(q)
    second = jax.jit(lambda x: attention(x, x, x, causal=causal, implementation="splash") + 0)(q)
    want = plain_attention(q, q, q, np.tril(np.ones((40, 40), bool)) if causal else None)
    assert _splash_kernel.cache_info().hits >= 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    np.testing.assert_allclose(np.asarray(second), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_structured_masks_skip_the_same_blocks_bit_for_bit():
    """The blocked attention given (causal, key_mask) computes exactly what it computes from the dense mask."""
    import jax
    import jax.numpy as jnp

    from model.nets import attention as attn

    rng = np.random.default_rng(3)
    lk, real = 512, 20
    q = jnp.asarray(rng.standard_normal((2, lk, 4, 32), np.float32))
    k = jnp.asarray(rng.standard_normal((2, lk, 1, 32), np.float32) * 3)
    v = jnp.asarray(rng.standard_normal((2, lk, 1, 32), np.float32))
    keys = jnp.asarray(np.broadcast_to(np.arange(lk) < real, (2, lk)))
    dense = jnp.tril(jnp.ones((lk, lk), bool))[None, None] & keys[:, None, None, :]
    scale = 1.0 / np.sqrt(32.0)
    structured = jax.jit(lambda q, k, v, m: attn._blocked_attention(q, k, v, None, scale, causal=True, key_mask=m))
    from_dense = jax.jit(lambda q, k, v, m: attn._blocked_attention(q, k, v, m, scale))
    np.testing.assert_array_equal(np.asarray(structured(q, k, v, keys)), np.asarray(from_dense(q, k, v, dense)))


def test_auto_picks_splash_on_one_tpu_chip_only():
    import jax

    from model.nets.attention import resolve_implementation

    if jax.default_backend() == "tpu":
        assert resolve_implementation("auto") == "splash"  # on any mesh: partitioned with shard_map
    else:  # elsewhere 'splash' stays what was asked for (Pallas interpret mode), 'auto' never picks it
        assert resolve_implementation("splash") == "splash"
        assert "splash" not in {resolve_implementation("auto", masked=m, devices=d) for m in (0, 1) for d in (1, 4)}


@pytest.mark.parametrize("impl", ["blocked", "xla", "splash"])
def test_rows_with_no_allowed_key_are_zero_like_torch_sdpa(impl):
    """A left-padded prompt's pad rows see no key under causal + padding masks: PyTorch's SDPA (transformers'
    default attention) returns zeros there, and so does every implementation here."""
    import jax.numpy as jnp
    import torch

    from model.nets.attention import attention

    rng = np.random.default_rng(5)
    lq, h = 48, 2
    q, k, v = (rng.standard_normal((2, lq, h, 16), np.float32) for _ in range(3))
    key_mask = np.arange(lq)[None] >= np.array([[10], [0]])  # row 0: 10 left pads; row 1: none
    got = np.asarray(attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True,
                               key_mask=jnp.asarray(key_mask), implementation=impl))
    dense = torch.from_numpy(np.tril(np.ones((lq, lq), bool))[None, None] & key_mask[:, None, None, :])
    t = [torch.from_numpy(a).transpose(1, 2) for a in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=dense).transpose(1, 2).numpy()
    assert np.all(got[0, :10] == 0) and np.all(want[0, :10] == 0)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lk", [512, 300])
def test_a_short_prompts_padding_blocks_are_never_read(lk):
    """The text encoder's case (causal + right padding, 20 real tokens): every key block past the first 128 keys is
    padding and skipped, so even NaN values there cannot reach the output (a computed block would give weight 0 x NaN
    = NaN). Holds for a length that is no multiple of the block too (padded to whole blocks)."""
    import jax.numpy as jnp

    from model.nets import attention as attn

    rng = np.random.default_rng(11)
    real = 20
    q = jnp.asarray(rng.standard_normal((1, lk, 4, 32), np.float32))
    k = rng.standard_normal((1, lk, 1, 32), np.float32)
    v = rng.standard_normal((1, lk, 1, 32), np.float32)
    k[:, attn.MASKED_KEY_BLOCK:] = np.nan
    v[:, attn.MASKED_KEY_BLOCK:] = np.nan
    key_mask = jnp.asarray(np.arange(lk)[None] < real)
    got = np.asarray(attn.attention(q, jnp.asarray(k), jnp.asarray(v), causal=True, key_mask=key_mask,
                                    implementation="blocked"))
    assert np.isfinite(got).all()
    clean_k, clean_v = np.nan_to_num(k), np.nan_to_num(v)
    want = plain_attention(q, clean_k, clean_v, np.tril(np.ones((lk, lk), bool)) & np.asarray(key_mask)[:, None, None])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
