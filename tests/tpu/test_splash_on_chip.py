"""The splash kernel runs compiled (Mosaic), not interpreted, and gives XLA attention's output within bf16 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.nets.attention import attention
from model.nets.platform_forms import forms_for, splash_blocks

# (batch, query length, key length, heads, key/value heads, causal, left-padded prompts): the transformer's shape at
# 1024x1024 (blocks measured on v5e, no padding), one that needs padding, and the text encoder's masked GQA.
CASES = [(1, 4608, 4608, 4, 4, False, False), (2, 700, 700, 2, 2, False, False), (2, 512, 512, 8, 2, True, True)]
ATOL = 2e-2  # bf16 outputs of magnitude ~1


def _chip_forms():
    return forms_for("tpu", jax.devices()[0].device_kind)


def _inputs(b, lq, lk, h, hkv, dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (b, lq, h, 128), dtype), jax.random.normal(keys[1], (b, lk, hkv, 128), dtype),
            jax.random.normal(keys[2], (b, lk, hkv, 128), dtype))


@pytest.mark.parametrize("case", CASES, ids=["transformer-4608", "padded-700", "text-gqa-causal-masked"])
def test_splash_is_mosaic_and_matches_xla(case):
    b, lq, lk, h, hkv, causal, padded = case
    q, k, v = _inputs(b, lq, lk, h, hkv, jnp.bfloat16)
    key_mask = (jnp.arange(lk)[None, :] >= jnp.array([[0], [lk // 3]])) if padded else None

    def run(impl):
        return jax.jit(lambda q, k, v: attention(q, k, v, causal=causal, key_mask=key_mask, implementation=impl))

    compiled = run("splash").lower(q, k, v).compile().as_text()
    assert "tpu_custom_call" in compiled, "the splash kernel did not compile to a Mosaic custom call"
    got = np.asarray(run("splash")(q, k, v).astype(jnp.float32))
    want = np.asarray(run("xla")(q, k, v).astype(jnp.float32))
    err = float(np.max(np.abs(got - want)))
    print(f"{case}: blocks {splash_blocks(_chip_forms(), lq, lk)}, max |splash - xla| {err:.2e}")
    assert np.isfinite(got).all() and err <= ATOL


def test_measured_blocks_are_used_on_v5e():
    kind = jax.devices()[0].device_kind
    if kind != "TPU v5 lite":
        pytest.skip(f"blocks were measured on TPU v5 lite; this chip is {kind}")
    assert splash_blocks(_chip_forms(), 4608, 4608) == (1536, 1536, 512)
