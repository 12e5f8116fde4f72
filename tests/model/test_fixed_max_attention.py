"""model.fixed_max_attention: the fixed-shift kernel equals softmax attention (a float32 reference and the splash path,
both interpreted here) where its gate passes, falls back to the online softmax block by block where it fails, and
compiles for a v5e chip at klein-4B's attention shape (libtpu's compiler, no chip needed)."""

from __future__ import annotations

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


def _run(q, k, v, gate="auto", block=128):
    import jax.numpy as jnp

    from model.fixed_max_attention import fixed_max_attention

    out, flags = fixed_max_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), interpret=True, block_q=block,
                                     block_kv=block, block_kv_compute=block, gate=gate, return_flags=True)
    return np.asarray(out, np.float32), np.asarray(flags)


def _splash(q, k, v):
    import jax.numpy as jnp

    from model.attention import attention_heads

    return np.asarray(attention_heads(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)), np.float32)


def _gate(q, k, v, block=128):
    import jax.numpy as jnp

    from model.fixed_max_attention import fixed_max_gate

    return np.asarray(fixed_max_gate(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), block_q=block))


# Two shapes shared by the tests, so that each interpreted kernel is traced once per shape: (B, H, Lq, Lk, D).
NARROW = (1, 2, 256, 384, 32)  # the output as [B, H, Lq, D], transposed after the kernel
WIDE = (2, 3, 384, 256, 128)   # D = 128: the output written straight into [B, Lq, H * D]


@pytest.mark.parametrize("shape", [NARROW, WIDE], ids=["d32", "d128"])
def test_where_the_gate_passes_every_block_runs_the_fixed_shift_and_equals_softmax(shape):
    """(a) Random inputs pass the gate in every block: the fixed-shift path alone, equal to the float32 reference and
    to splash, and bit-identical to the gate forced on; the online path (gate off) equal too."""
    b, h, lq, lk, d = shape
    q, k, v = _inputs(*shape)
    got, flags = _run(q, k, v)
    assert got.shape == (b, lq, h, d) and flags.shape == (b, h, lq // 128) and flags.all()
    assert _gate(q, k, v).all()
    np.testing.assert_allclose(got, _reference(q, k, v), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(got, _splash(q, k, v), atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(got, _run(q, k, v, gate="on")[0])
    online, off_flags = _run(q, k, v, gate="off")
    assert not off_flags.any()
    np.testing.assert_allclose(online, _reference(q, k, v), atol=TOL, rtol=TOL)


def _unsafe(q, k, row_slice, head, batch, kind):
    """q rows made to fail the gate: "overflow" (aligned with the longest key, logits ~ +200: the forced fixed shift
    overflows exp) or "underflow" (every key given a common direction, q opposite to it: all logits ~ -130, and
    the forced shift's weights all flush to zero)."""
    q, k = q.copy(), k.copy()
    if kind == "overflow":
        longest = np.argmax(np.linalg.norm(k[batch, head], axis=-1))
        top = k[batch, head, longest]
        q[batch, head, row_slice] = top * (200.0 / float(top @ top))
    else:
        u = np.zeros(k.shape[-1], np.float32)
        u[0] = 12.0
        k[batch, head] += u
        q[batch, head, row_slice] = -u * 0.9 + 0.05 * q[batch, head, row_slice]
    return q, k


@pytest.mark.parametrize("kind", ["overflow", "underflow"])
def test_blocks_that_fail_the_gate_run_the_online_softmax(kind):
    """(b) One query block of one head made unsafe: the gate is off for exactly that block (in the kernel and in
    `fixed_max_gate`), the output still equals the reference and splash; the fixed shift forced there is wrong."""
    q, k, v = _inputs(*NARROW, seed=1)
    q, k = _unsafe(q, k, slice(128, 256), head=1, batch=0, kind=kind)
    want = np.ones((1, 2, 2), bool)
    want[0, 1, 1] = False
    got, flags = _run(q, k, v)
    np.testing.assert_array_equal(flags, want)
    np.testing.assert_array_equal(_gate(q, k, v), want)
    reference = _reference(q, k, v)
    np.testing.assert_allclose(got, reference, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(got, _splash(q, k, v), atol=TOL, rtol=TOL)
    forced, _ = _run(q, k, v, gate="on")
    bad = forced[0, 128:, 1]
    assert not (np.isfinite(bad).all() and np.allclose(bad, reference[0, 128:, 1], atol=1e-2))
    np.testing.assert_array_equal(forced[0, :128], got[0, :128])  # the safe blocks: the same fixed-shift path


def test_heads_and_batch_rows_take_their_own_path():
    """(c) Mixed heads in one call: head 0 safe, head 1 unsafe in every block, head 2 unsafe in one block, and the
    second batch row safe everywhere; each (row, head, block) takes its own path and all equal softmax."""
    q, k, v = _inputs(*WIDE, seed=2)
    q, k = _unsafe(q, k, slice(0, 384), head=1, batch=0, kind="overflow")
    q, k = _unsafe(q, k, slice(256, 384), head=2, batch=0, kind="underflow")
    want = np.ones((2, 3, 3), bool)
    want[0, 1, :] = False
    want[0, 2, 2] = False
    got, flags = _run(q, k, v)
    np.testing.assert_array_equal(flags, want)
    np.testing.assert_array_equal(_gate(q, k, v), want)
    np.testing.assert_allclose(got, _reference(q, k, v), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(got, _splash(q, k, v), atol=TOL, rtol=TOL)


def test_bfloat16_within_the_splash_paths_rounding():
    """bf16 q, k, v (the model's): the probabilities meet v in bf16 for the PV product; the output stays within
    two bf16 roundings of the largest output of the float32 reference, as close as splash's."""
    import jax.numpy as jnp

    q, k, v = _inputs(*WIDE, seed=3)
    q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    reference = _reference(q, k, v)
    bound = 2 * 2.0 ** -8 * np.abs(reference).max()
    splash_err = np.abs(_splash(*bf) - reference).max()
    for gate in ("auto", "off"):
        got, flags = _run(*bf, gate=gate)
        assert flags.all() == (gate == "auto")
        err = np.abs(got - reference).max()
        assert err <= bound and err <= 2 * splash_err, (gate, err, splash_err, bound)


def test_block_sizes_are_fitted_or_refused():
    from model.fixed_max_attention import fit_block

    assert fit_block(1536, 4608, "query") == 1536 and fit_block(4608, 4608, "key") == 4608
    assert fit_block(1024, 4608, "key") == 768 and fit_block(512, 300, "key") == 300
    with pytest.raises(ValueError, match="length 1000"):
        fit_block(512, 1000, "key")


def test_compiles_for_v5e_at_klein_4b_shape():
    """24 heads x 4608 tokens x 128, bf16, batch 1 and 2, for one v5e chip: a Mosaic kernel within the VMEM limit it
    asks for, both paths (the per-block gate) compiled in (libtpu's compiler, no chip). Key blocks of 1024: the
    default whole-sequence block compiles too but takes libtpu several times longer."""
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed: pip install libtpu")
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from model.fixed_max_attention import fixed_max_attention
    from model.tpu_topology import load_topology

    device = load_topology("v5e:1x1").devices[0]
    for batch in (1, 2):
        x = jax.ShapeDtypeStruct((batch, 24, 4608, 128), jnp.bfloat16, sharding=SingleDeviceSharding(device))
        lowered = jax.jit(lambda q, k, v: fixed_max_attention(q, k, v, block_kv=1024)).lower(x, x, x)
        assert "tpu_custom_call" in lowered.compile().as_text(), batch


def test_benchmark_small_runs_here():
    """`python -m benchmarks.attention_fixed_max --small` (interpret mode off TPU): a row for every gate, the kernel
    within bf16 rounding of splash and of the float32 reference."""
    from benchmarks.attention_fixed_max import main

    result = main(["--small"])
    assert result["shape"] == [1, 2, 512, 128] and result["gate_pass_share"] == 1.0
    assert {r["kernel"] for r in result["rows"]} == {"gate-on", "gate-auto", "gate-off"} and len(result["rows"]) == 3
    for row in result["rows"]:
        assert row["max_diff_splash"] <= 4e-3 and row["max_diff_f32"] <= 4e-3, row
