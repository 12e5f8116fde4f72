"""model.nets.heads_kernel on the chip: compiled (Mosaic), equal to the XLA form within one bf16 rounding at klein-4B's
shapes, and a transformer with 128-wide heads gives the XLA path's velocity within bf16 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.nets.heads_kernel import head_major, reference_heads

# (tokens, columns of the projection's output): the single-stream block's fused [q | k | v | mlp] at 1024x1024, and
# a double-stream block's text projection.
SHAPES = [(4608, 27648), (512, 3072)]


@pytest.mark.parametrize("shape", SHAPES, ids=["fused-4608", "text-512"])
def test_heads_kernel_is_mosaic_and_within_one_bf16_rounding(shape):
    s, c = shape
    keys = jax.random.split(jax.random.key(0), 4)
    x = (3 * jax.random.normal(keys[0], (1, s, c))).astype(jnp.bfloat16)
    w = (1 + 0.3 * jax.random.normal(keys[1], (128,))).astype(jnp.bfloat16)
    cos, sin = (jax.random.normal(k, (s, 128), jnp.float32) for k in keys[2:])
    heads = min(24, c // 128)
    cases = {"q": (0, dict(weight=w, cos=cos, sin=sin, scale=128 ** -0.5)), "v": (0, {})}
    if c >= 3 * heads * 128:
        cases["k"] = (heads * 128, dict(weight=w, cos=cos, sin=sin))
        cases["v"] = (2 * heads * 128, {})
    for name, (column, kw) in cases.items():
        kernel = jax.jit(lambda x: head_major(x, column, heads, 128, eps=1e-6, **kw))
        assert "tpu_custom_call" in kernel.lower(x).compile().as_text(), f"{name}: not a Mosaic kernel"
        got = np.asarray(kernel(x).astype(jnp.float32))
        want = np.asarray(jax.jit(lambda x: reference_heads(x, column, heads, 128, eps=1e-6, **kw))(x)
                          .astype(jnp.float32))
        # XLA on TPU may keep float32 between the steps where the kernel rounds to bf16 as diffusers does (excess
        # precision), so the two differ by roundings of the head row's values: bounded by 2 bf16 ulps of its largest.
        err, row_scale = np.abs(got - want), np.max(np.abs(want), axis=-1, keepdims=True)
        print(f"{shape} {name}: max |kernel - xla| {err.max():.2e}, elements differing {np.mean(err > 0):.2%}, "
              f"max error / row's largest value {np.max(err / np.maximum(row_scale, 1e-30)):.2e}")
        assert np.all(err <= 2.0 ** -6 * row_scale), name


def test_transformer_with_the_kernel_within_bf16_rounding(monkeypatch):
    """bf16, splash: the kernel's velocity vs the XLA path's differs less than the XLA path's own bf16 rounding
    (its distance from the float32 model), over a small transformer with klein's 128-wide heads."""
    import dataclasses

    from flax import nnx

    import model.nets.transformer as transformer_lib
    from model.config.configs import TransformerConfig
    from model.nets.layers import precision_scope
    from model.nets.platform_forms import forms_for
    from model.nets.transformer import Flux2Transformer, image_ids, rope_tables, text_ids

    cfg = TransformerConfig(patch_size=1, in_channels=64, out_channels=64, num_layers=1, num_single_layers=2,
                            attention_head_dim=128, num_attention_heads=4, joint_attention_dim=256,
                            timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                            rope_theta=2000.0, eps=1e-6, guidance_embeds=False)
    model32 = Flux2Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    state = nnx.state(model32, nnx.Param)  # no weight left at its initial zeros or ones
    nnx.update(model32, jax.tree.map(lambda a: a + jnp.asarray(0.05 * rng.normal(size=a.shape), a.dtype), state))
    model16 = Flux2Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(model16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model32, nnx.Param)))
    ids = np.concatenate([text_ids(512), image_ids(32, 32)])
    cos, sin = (jnp.asarray(t) for t in rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta))
    img = jax.random.normal(jax.random.key(1), (1, 1024, 64))
    txt = jax.random.normal(jax.random.key(2), (1, 512, 256))
    t = jnp.array([0.6])

    chip = forms_for("tpu", jax.devices()[0].device_kind)  # the chip's forms: with the kernel

    def velocity(model, dtype, implementation, kernel):
        forms = dataclasses.replace(chip, heads_kernel=kernel)
        monkeypatch.setattr(transformer_lib, "traced_forms", lambda: forms)
        with precision_scope(dtype):
            fn = jax.jit(lambda a, b: model(a.astype(dtype), b.astype(dtype), t, cos, sin,
                                            implementation=implementation))
            return np.asarray(fn(img, txt).astype(jnp.float32))

    with_kernel = velocity(model16, jnp.bfloat16, "splash", True)
    without = velocity(model16, jnp.bfloat16, "splash", False)
    reference = velocity(model32, jnp.float32, "xla", False)
    kernel_diff, rounding = np.mean(np.abs(with_kernel - without)), np.mean(np.abs(without - reference))
    print(f"velocity: kernel vs XLA path {kernel_diff:.2e} (mean |difference|); bf16 vs float32 {rounding:.2e}")
    assert np.isfinite(with_kernel).all() and kernel_diff <= rounding
