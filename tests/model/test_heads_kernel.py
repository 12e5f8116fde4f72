"""model.nets.heads_kernel: q, k, v laid out head-major with the norm, RoPE and scale fused (Pallas; interpret mode
here, compiled on the chip in tests/tpu/test_heads_kernel_on_chip.py)."""

import numpy as np
import pytest


def _rounding_ok(got, want, dtype):
    """Equal within one rounding of `dtype` (relative), the difference a reordered float32 reduction can make."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rel = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -20
    return np.all(np.abs(got - want) <= rel * np.abs(want) + 1e-6), float(np.max(np.abs(got - want)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_equals_the_xla_form_within_one_rounding(dtype):
    import jax.numpy as jnp
    from model.nets.heads_kernel import head_major, reference_heads

    rng = np.random.default_rng(0)
    b, s, h, d = 2, 48, 3, 32
    x = jnp.asarray(rng.normal(size=(b, s, 5 * h * d)) * 3, dtype)
    w = jnp.asarray(rng.normal(size=(d,)), dtype)
    cos, sin = (jnp.asarray(rng.normal(size=(s, d)), jnp.float32) for _ in range(2))
    cases = {"q": dict(weight=w, cos=cos, sin=sin, scale=d ** -0.5), "k": dict(weight=w, cos=cos, sin=sin), "v": {}}
    for column, (name, kw) in zip((0, h * d, 2 * h * d), cases.items()):
        got = head_major(x, column, h, d, eps=1e-6, interpret=True, **kw)
        want = reference_heads(x, column, h, d, eps=1e-6, **kw)
        assert got.shape == (b, h, s, d) and got.dtype == x.dtype
        ok, err = _rounding_ok(got, want, dtype)
        assert ok, f"{name}: max difference {err}"
        if name == "v":  # a pure layout change: exact
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_reference_form_is_the_models_norm_rope_and_scale():
    """reference_heads is what the transformer computes on the XLA path: RMSNorm, interleaved RoPE, q * scale."""
    import jax.numpy as jnp
    from model.nets.heads_kernel import reference_heads
    from model.nets.layers import RMSNorm
    from model.nets.transformer import apply_interleaved_rope

    rng = np.random.default_rng(1)
    b, s, h, d = 1, 16, 2, 32
    x = jnp.asarray(rng.normal(size=(b, s, 2 * h * d)), jnp.bfloat16)
    norm = RMSNorm(d, eps=1e-6, dtype=jnp.bfloat16)
    norm.weight[...] = jnp.asarray(rng.normal(size=(d,)), jnp.bfloat16)
    cos, sin = (jnp.asarray(rng.normal(size=(s, d)), jnp.float32) for _ in range(2))
    scale = d ** -0.5
    part = x[..., h * d:].reshape(b, s, h, d)
    model_q = apply_interleaved_rope(norm(part), cos, sin) * jnp.asarray(scale, jnp.bfloat16)
    got = reference_heads(x, h * d, h, d, weight=norm.weight[...], eps=1e-6, cos=cos, sin=sin, scale=scale)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(model_q.transpose(0, 2, 1, 3), np.float32))


def test_transformer_with_the_kernel_gives_the_same_velocity(tiny_ckpt, monkeypatch):
    """Double- and single-stream blocks (and the last block's image-only queries) with q, k, v from the kernel:
    float32 velocities equal to the XLA path's, with every weight perturbed (none left zero or one)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    import model.nets.transformer as transformer_lib
    from model.config.configs import PipelineConfig
    from model.nets import heads_kernel
    from model.nets.heads_kernel import head_major
    from model.nets.platform_forms import PlatformForms
    from model.nets.transformer import Flux2Transformer
    from transformer_inputs import transformer_inputs

    cfg = PipelineConfig.from_folder(tiny_ckpt).transformer
    model = Flux2Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(2)
    state = nnx.state(model, nnx.Param)  # every weight moved off its initial zeros or ones
    noisy = jax.tree.map(lambda a: a + jnp.asarray(0.2 * rng.normal(size=a.shape), a.dtype), state)
    nnx.update(model, noisy)
    img, txt, t, cos, sin = transformer_inputs(cfg, text_len=16, grid_h=4, grid_w=8)

    calls = []
    monkeypatch.setattr(heads_kernel, "head_major", lambda *a, **k: calls.append(k) or head_major(*a, **k))

    def velocity():  # the last block's queries are the image tokens only: its keys join two kernel outputs
        return np.asarray(jax.jit(lambda a, b: model(a, b, t, cos, sin, implementation="splash"))(img, txt))

    want = velocity()  # CPU's forms: no heads kernel
    assert not calls and np.abs(want).max() > 0.1
    # forms with the kernel, as on a TPU: here in Pallas interpret mode
    monkeypatch.setattr(transformer_lib, "traced_forms", lambda: PlatformForms(heads_kernel=True))
    np.testing.assert_allclose(velocity(), want, rtol=1e-5, atol=1e-5)
    blocks = cfg.num_layers * 6 + cfg.num_single_layers * 3 + 2  # q, k, v for text and image; the last block's
    assert len(calls) == blocks and sum("cos" in k for k in calls) == cfg.num_layers * 4 + cfg.num_single_layers * 2 + 1


def test_the_kernel_applies_to_splash_on_one_device_only():
    from model.nets.heads_kernel import applies
    from model.nets.platform_forms import forms_for

    tpu, cpu = forms_for("tpu", "TPU v6 lite").heads_kernel, forms_for("cpu").heads_kernel
    assert tpu and not cpu  # the platforms' forms: the kernel on TPUs only
    assert applies("splash", 1, tpu, "tpu", 128, 512, 4096) == "compiled"
    assert not applies("splash", 1, cpu, "cpu", 128, 512, 4096)      # CPU: the XLA path
    assert not applies("xla", 1, tpu, "tpu", 128, 512)               # float32 models' attention on TPU
    assert not applies("splash", 4, tpu, "tpu", 128, 512)            # sharded programs keep the XLA path
    assert not applies("splash", 1, tpu, "tpu", 64, 512)             # heads narrower than a 128-lane tile
    assert not applies("splash", 1, tpu, "tpu", 128, 4104)           # no token block divides the sequence
    assert applies("splash", 1, True, "cpu", 32, 48) == "interpret"  # forced on off TPU (the tests): interpreted
