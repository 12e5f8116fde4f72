"""model.nets.flash_attention: the kernel equals softmax attention (a float32 reference and the splash path, both
interpreted here) for several shapes and fitted blocks, refuses lengths its blocks cannot divide, compiles for a v5e
chip at klein-4B's attention shape, and `attention_heads` runs it on the chips of FLASH_KERNEL_CHIPS only (libtpu's
compiler, no chip needed)."""

from __future__ import annotations

import re

import numpy as np
import pytest

TOL = 2e-5  # float32 inputs: as the existing attention tests (the splash and block-wise forms against the plain one)


def _inputs(b, h, lq, lk, d, seed=0):
    """float32 q (scaled by 1/sqrt(D)), k (x3, as the attention tests), v: [B, H, L, D]."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, lq, d), np.float32) / np.sqrt(d)
    k = rng.standard_normal((b, h, lk, d), np.float32) * 3
    v = rng.standard_normal((b, h, lk, d), np.float32)
    return q, k, v


def _reference(q, k, v):
    """float32 softmax(q k^T) v as [B, Lq, H, D] (numpy, float64 inside)."""
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    out = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    return out.transpose(0, 2, 1, 3)


def _flash(q, k, v, blocks=None):
    import jax.numpy as jnp

    from model.nets.flash_attention import flash_attention

    sizes = {} if blocks is None else dict(zip(("block_q", "block_kv", "block_kv_compute"), blocks))
    out = flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), interpret=True, **sizes)
    return np.asarray(out, np.float32)


def _splash(q, k, v):
    """`attention_heads` off TPU: the splash kernel, interpreted."""
    import jax.numpy as jnp

    from model.nets.attention import attention_heads

    return np.asarray(attention_heads(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)), np.float32)


# (B, H, Lq, Lk, D), the blocks asked for (None: the defaults) and the blocks the kernel runs for these lengths.
CASES = {
    # D 64: the output as [B, H, Lq, D], transposed after the kernel; key blocks shrunk from 256 to 128 (384 keys)
    "d64-b2-shrunk": ((2, 2, 256, 384, 64), (128, 256, 128), (128, 128, 128)),
    # D 128: the output written straight into [B, Lq, H * D]; the defaults hold each whole sequence in one block, and
    # the keys in one slice (512-key slices do not divide 256)
    "d128-b2-defaults": ((2, 3, 384, 256, 128), None, (384, 256, 256)),
    # D 128, query blocks shrunk from 512 to 128 (640) and key blocks to 384 (768), three 128-key slices in each
    "d128-shrunk": ((1, 2, 640, 768, 128), (512, 512, 128), (128, 384, 128)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_the_float32_reference_and_splash(case):
    from model.nets.flash_attention import kernel_blocks

    shape, blocks, fitted = CASES[case]
    b, h, lq, lk, d = shape
    assert kernel_blocks(lq, lk, *(blocks or ())) == fitted
    q, k, v = _inputs(*shape)
    got = _flash(q, k, v, blocks)
    assert got.shape == (b, lq, h, d)
    np.testing.assert_allclose(got, _reference(q, k, v), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(got, _splash(q, k, v), atol=TOL, rtol=TOL)


def test_bfloat16_within_the_splash_paths_rounding():
    """bf16 q, k, v (the model's): the probabilities meet v in bf16 for the PV product; the output is bf16, within
    two bf16 roundings of the largest output of the float32 reference, and as close to it as splash's."""
    import jax.numpy as jnp

    q, k, v = _inputs(*CASES["d128-b2-defaults"][0], seed=3)
    q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    from model.nets.flash_attention import flash_attention

    assert flash_attention(*bf, interpret=True).dtype == jnp.bfloat16
    reference = _reference(q, k, v)
    bound = 2 * 2.0 ** -8 * np.abs(reference).max()
    splash_err = np.abs(_splash(*bf) - reference).max()
    err = np.abs(_flash(*bf) - reference).max()
    assert err <= bound and err <= 2 * splash_err, (err, splash_err, bound)


def test_blocks_are_fitted_to_the_lengths_or_refused():
    import jax.numpy as jnp

    from model.nets.flash_attention import fit_block, fits, flash_attention, kernel_blocks

    assert fit_block(1536, 4608) == 1536 and fit_block(4608, 4608) == 4608 and fit_block(1024, 4608) == 768
    assert fit_block(512, 300) == 300 and fit_block(1536, 4096) == 1024
    assert fit_block(512, 1000) is None and fit_block(1536, 4600) is None
    assert kernel_blocks(4608, 4608) == (1536, 4608, 512) and kernel_blocks(4608, 4608, 1024, 1024) == (768, 768, 768)
    assert kernel_blocks(4608, 4600, 1536, 1024) is None  # 4600 keys: more than a 1024 block, no block divides them
    assert fits(4608, 4608) and fits(512, 512) and fits(1000, 1024) and fits(4096, 16384)
    # 100: not a multiple of 8 queries nor of 128 keys; 4600: no multiple of 128 divides it; 1544 queries: more than
    # a query block and no multiple of 128 divides them
    assert not fits(100, 100) and not fits(4600, 4600) and not fits(4608, 4600) and not fits(1544, 1536)
    x = jnp.zeros((1, 1, 4600, 128), jnp.float32)
    with pytest.raises(ValueError, match="4600"):
        flash_attention(x, x, x, interpret=True)


def _load_device(topology: str):
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed: pip install libtpu")
    from model.preflight.topology import load_topology

    return load_topology(topology).devices[0]


def _kernels(hlo: str) -> set[str]:
    """The names of the Mosaic kernels (tpu_custom_call instructions) in compiled HLO text, without their suffixes."""
    return {m.group(1) for m in re.finditer(r"%([A-Za-z_]+)[.\d]* = [^\n]*custom_call_target=\"tpu_custom_call\"",
                                            hlo)}


def test_compiles_for_v5e_at_klein_4b_shape():
    """24 heads x 4608 tokens x 128, bf16, batch 1, at the default blocks (every key of a head in one block): one
    Mosaic kernel within the VMEM limit it asks for (libtpu's compiler, no chip)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from model.nets.flash_attention import flash_attention

    device = _load_device("v5e:1x1")
    x = jax.ShapeDtypeStruct((1, 24, 4608, 128), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    compiled = flash_attention.lower(x, x, x).compile()
    assert _kernels(compiled.as_text()) == {"flash_attention"}
    assert compiled.out_info.shape == (1, 4608, 24, 128)


@pytest.mark.parametrize("topology,lq,lk,kernel", [("v5e:1x1", 512, 512, "flash_attention"),
                                                   ("v6e:1x1", 512, 512, "splash"), ("v5e:1x1", 100, 100, "splash"),
                                                   ("v5e:1x1", 1544, 1536, "splash")])
def test_attention_heads_runs_the_flash_kernel_on_the_listed_chips_only(topology, lq, lk, kernel):
    """`attention_heads` traced for a one-chip mesh: the flash kernel on v5e (FLASH_KERNEL_CHIPS), splash on v6e and on
    v5e for lengths the flash kernel refuses (100: no multiple of 8 or 128; 1544 queries: no block divides them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from model.nets.attention import attention_heads, mesh_context
    from model.nets.platform_forms import FLASH_KERNEL_CHIPS

    device = _load_device(topology)
    assert (device.device_kind in FLASH_KERNEL_CHIPS) == topology.startswith("v5e")
    mesh = Mesh(np.array([device]).reshape(1, 1), ("data", "model"))
    q, kv = (jax.ShapeDtypeStruct((1, 2, n, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P())) for n in (lq, lk))
    with mesh_context(mesh):
        compiled = jax.jit(attention_heads).lower(q, kv, kv).compile()
    names = _kernels(compiled.as_text())
    assert len(names) == 1 and next(iter(names)).startswith(kernel), names
    assert compiled.out_info.shape == (1, lq, 2, 128)
