"""Unmasked attention with a fixed softmax shift per query (a Pallas TPU kernel), for measuring against splash.

Online softmax keeps a running row max m and, at every key block, rescales the row sum l and the output accumulator
by exp(m_old - m_new). When a bound on every logit of a row is known before the first block, a fixed shift m_i can
replace the running max: each key block is then only p = exp(s - m_i), l += rowsum(p), acc += p @ v, with no row max,
no rescale. The bound is Cauchy-Schwarz: |s_ij| = |q_i . k_j| <= U_i = |q_i| max_j |k_j|; and the row's largest logit
is at least L_i = max(q_i . mean_j k_j, -U_i), a mean being at most the max.

The gate, in two lines: every weight below e^hi cannot overflow l or acc (N e^hi max|v| < float32's max), and a
row's largest weight above e^lo leaves every term that matters a normal float; that weight's exponent lies in
[L_i - m_i, U_i - m_i], so a row is safe iff U_i - L_i <= hi - lo, with m_i = (U_i + L_i - hi - lo) / 2 centring it.
In full, with N keys, a = ln max|v| and float32's ln(max) 88.72, ln(min normal) -87.34, ln(eps) -16.64:
hi = 88.72 - ln N - max(a, 0) - 1 keeps l <= N e^hi and |acc| <= N e^hi max|v| finite; lo = -87.34 + ln N + 16.64
- min(a, 0) + 1 keeps the terms flushed to zero (TPUs flush subnormals: each < e^-87.34, N of them) below a float32
eps of l and of acc / max|v|. (klein-4B: N 4608, max|v| 1 to 100: hi - lo is 136 to 140.) The gate is one decision
per (head, query block): where any row fails, that block runs the exact online softmax, in the same kernel, on a
flag its first key step sets.

Measured on one v5e chip (`python -m benchmarks.attention_fixed_max`, klein-4B's 24 heads x 4608 x 128, bf16):
splash 1.89 ms per call; this kernel at blocks (1536, 1024, 512) gate on 1.81, auto 1.85, off 1.97 ms; at
(1536, 4608, 512) on 1.62, auto 1.80, off 1.55 ms (169 TFLOP/s, output bit-identical to splash's). The shift pays
only with small key blocks; with every key in one block (this kernel raises the scoped VMEM limit, splash cannot)
the online softmax is near the MXU's rate and the shift's per-block set-up (|q_i|, the gate) costs more than the
max and rescale it saves.

Contract as `model.attention.attention_heads`: head-major q, k, v [B, H, L, D], q already scaled by 1/sqrt(D);
returns [B, Lq, H, D] in q's dtype. float32 logits and accumulators; the probabilities meet v in v's dtype (bf16 for
a bf16 model, as an MXU-rate PV product needs). Lengths must be multiples of the blocks used: a block larger than a
length is shrunk to the largest multiple of 128 dividing it (or the whole length), and a length with none is refused
(klein's 4608 = 3 x 1536 = 9 x 512). Not wired into the model: `benchmarks/attention_fixed_max.py` measures it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LN_F32_MAX = math.log(float(np.finfo(np.float32).max))    # 88.72
LN_F32_TINY = math.log(float(np.finfo(np.float32).tiny))  # -87.34: the smallest normal (TPUs flush subnormals)
LN_F32_EPS = math.log(2.0 ** -24)                          # -16.64: half an ulp of 1
GATE_MARGIN = 1.0  # nats kept clear at each end, for the rounding of the bounds and of the logits themselves
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # the online path's initial running max (splash's value)
GATES = ("auto", "on", "off")  # per-block gate; forced fixed shift everywhere; online softmax everywhere
LANES = 128
VMEM_LIMIT_BYTES = 64 * 1024 * 1024  # v5e has 128 MiB of VMEM, 16 MiB scoped by default


def fit_block(requested: int, length: int, what: str) -> int:
    """The block for `length` tokens: `requested` if it divides it, else the largest multiple of 128 below it that
    does, or the whole length when that is no larger; a ValueError naming the length when none divides it."""
    if length <= requested:
        return length
    for block in range(requested - requested % LANES, 0, -LANES):
        if length % block == 0:
            return block
    raise ValueError(f"fixed_max_attention: {what} length {length} has no block of at most {requested} tokens that "
                     f"is a multiple of {LANES} and divides it; pad it to a multiple of {LANES}")


def key_stats(kh, vh):
    """[B, H, 8, D] float32 per head: row 0 mean_j k_j, row 1 max_j |k_j|, row 2 hi, row 3 lo (the gate's exponent
    limits from the number of keys and max |v|, see the module's docstring); rows 4-7 zero (an (8, 128) tile)."""
    b, h, n, d = kh.shape
    k = kh.astype(jnp.float32)
    mean = jnp.mean(k, axis=2)
    kmax = jnp.sqrt(jnp.max(jnp.sum(k * k, axis=-1), axis=2))
    a = jnp.log(jnp.max(jnp.abs(vh.astype(jnp.float32)), axis=(2, 3)))  # -inf for all-zero v: the gate fails
    hi = LN_F32_MAX - math.log(n) - jnp.maximum(a, 0.0) - GATE_MARGIN
    lo = LN_F32_TINY + math.log(n) - LN_F32_EPS - jnp.minimum(a, 0.0) + GATE_MARGIN
    rows = [mean] + [jnp.broadcast_to(x[..., None], (b, h, d)) for x in (kmax, hi, lo)]
    return jnp.concatenate([jnp.stack(rows, axis=2), jnp.zeros((b, h, 4, d), jnp.float32)], axis=2)


def row_shift(q, stats):
    """(safe [bq, 1] bool, shift [bq, 1] float32) for queries q [bq, D] of one head with its `key_stats` [8, D]:
    the gate and the fixed shift m_i of the module's docstring. Used inside the kernel and by `fixed_max_gate`."""
    q = q.astype(jnp.float32)
    mean, kmax, hi, lo = stats[0:1, :], stats[1:2, 0:1], stats[2:3, 0:1], stats[3:4, 0:1]
    upper = jnp.sqrt(jnp.sum(q * q, axis=1, keepdims=True)) * kmax
    lower = jnp.maximum(jnp.sum(q * mean, axis=1, keepdims=True), -upper)
    return upper - lower <= hi - lo, (upper + lower - hi - lo) * 0.5


def fixed_max_gate(qh, kh, vh, block_q: int = 1536):
    """[B, H, Lq // block] booleans: True where a query block passes the gate (runs with the fixed shift under
    gate="auto"), computed outside the kernel with the kernel's own functions."""
    b, h, lq, d = qh.shape
    bq = fit_block(block_q, lq, "query")
    stats = key_stats(kh, vh)
    safe, _ = jax.vmap(jax.vmap(row_shift))(qh, stats)
    return jnp.all(safe.reshape(b, h, lq // bq, bq), axis=-1)


def _lanes(x, width: int):
    """A lane-replicated [rows, 128] array as [rows, width]."""
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    return x[:, :width] if width < LANES else jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def _kernel(*refs, gate: str, bkv_compute: int, pv_dtype, flags_out: bool):
    """One (batch row, head, query block, key block) step. Scratch: the shift or running max m, the row sum l (both
    [bq, 128] lane-replicated, as splash keeps them), the float32 accumulator, and the block's flag (SMEM)."""
    if gate == "off":
        q_ref, k_ref, v_ref, *refs = refs
        stats_ref = None
    else:
        stats_ref, q_ref, k_ref, v_ref, *refs = refs
    o_ref, *refs = refs
    flags_ref = refs.pop(0) if flags_out else None
    m_ref, l_ref, acc_ref, flag_ref = refs
    j, last = pl.program_id(3), pl.num_programs(3) - 1
    bq, d = q_ref.shape
    f32 = jnp.float32

    @pl.when(j == 0)
    def _init():
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)
        if gate == "off":
            m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
            use = 0
        else:
            safe, shift = row_shift(q_ref[...], stats_ref[...])
            use = jnp.min(safe.astype(jnp.int32)) if gate == "auto" else 1
            m_ref[...] = jnp.where(use == 1, jnp.broadcast_to(shift, m_ref.shape), MASK_VALUE)
        flag_ref[0] = use
        if flags_ref is not None:
            flags_ref[...] = jnp.full(flags_ref.shape, use, jnp.int32)

    def logits(c):
        k = k_ref[pl.ds(c * bkv_compute, bkv_compute), :]
        return lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=f32)

    def pv(p, c):
        v = v_ref[pl.ds(c * bkv_compute, bkv_compute), :]
        return lax.dot_general(p.astype(pv_dtype), v.astype(pv_dtype), (((1,), (0,)), ((), ())),
                               preferred_element_type=f32)

    def fixed_step(c, carry):
        p = jnp.exp(logits(c) - _lanes(m_ref[...], bkv_compute))
        l_ref[...] += jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
        acc_ref[...] += pv(p, c)
        return carry

    def online_step(c, carry):
        s = logits(c)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - _lanes(m_next, bkv_compute))
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_ref[...] + jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
        acc_ref[...] = _lanes(alpha, d) * acc_ref[...] + pv(p, c)
        return carry

    steps = k_ref.shape[0] // bkv_compute

    def run(step):
        def loop():
            lax.fori_loop(0, steps, step, 0, unroll=True)
        return loop

    if gate == "on":
        run(fixed_step)()
    elif gate == "off":
        run(online_step)()
    else:
        pl.when(flag_ref[0] == 1)(run(fixed_step))
        pl.when(flag_ref[0] != 1)(run(online_step))

    @pl.when(j == last)
    def _end():
        o_ref[...] = (acc_ref[...] / _lanes(l_ref[...], d)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_q", "block_kv", "block_kv_compute", "gate",
                                             "return_flags"))
def fixed_max_attention(qh, kh, vh, *, interpret: bool = False, block_q: int = 1536, block_kv: int = 4608,
                        block_kv_compute: int = 512, gate: str = "auto", return_flags: bool = False):
    """softmax(q k^T) v on head-major q, k, v [B, H, L, D] (q already scaled), [B, Lq, H, D] in q's dtype out, like
    `model.attention.attention_heads`. `gate`: "auto" (the fixed shift where the module's gate passes, online softmax
    elsewhere), "on" (the fixed shift everywhere, even where unsafe: for measuring), "off" (online softmax
    everywhere). `return_flags`: also [B, H, Lq // block_q] booleans, True where a block ran with the fixed shift."""
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; choose one of {GATES}")
    if qh.ndim != 4 or kh.shape != vh.shape or qh.shape[:2] != kh.shape[:2] or qh.shape[3] != kh.shape[3]:
        raise ValueError(f"fixed_max_attention takes q [B, H, Lq, D] and k, v [B, H, Lk, D]; got q {qh.shape}, "
                         f"k {kh.shape}, v {vh.shape}")
    b, h, lq, d = qh.shape
    lk = kh.shape[2]
    bq = fit_block(block_q, lq, "query")
    bkv = fit_block(block_kv, lk, "key")
    bkvc = block_kv_compute if bkv % block_kv_compute == 0 else bkv
    nq, nk = lq // bq, lk // bkv
    lane_dense = d % LANES == 0  # then the output is written straight into [B, Lq, H * D] (no transpose after)
    if lane_dense:
        out_shape = jax.ShapeDtypeStruct((b, lq, h * d), qh.dtype)
        out_spec = pl.BlockSpec((None, bq, d), lambda bb, hh, i, j: (bb, i, hh))
    else:
        out_shape = jax.ShapeDtypeStruct((b, h, lq, d), qh.dtype)
        out_spec = pl.BlockSpec((None, None, bq, d), lambda bb, hh, i, j: (bb, hh, i, 0))
    in_specs = [pl.BlockSpec((None, None, bq, d), lambda bb, hh, i, j: (bb, hh, i, 0)),
                pl.BlockSpec((None, None, bkv, d), lambda bb, hh, i, j: (bb, hh, j, 0)),
                pl.BlockSpec((None, None, bkv, d), lambda bb, hh, i, j: (bb, hh, j, 0))]
    args = [qh, kh, vh]
    if gate != "off":
        in_specs.insert(0, pl.BlockSpec((None, None, 8, d), lambda bb, hh, i, j: (bb, hh, 0, 0)))
        args.insert(0, key_stats(kh, vh))
    out_shapes, out_specs = [out_shape], [out_spec]
    if return_flags:
        out_shapes.append(jax.ShapeDtypeStruct((b, h, nq * 8, LANES), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, 8, LANES), lambda bb, hh, i, j: (bb, hh, i, 0)))
    kernel = functools.partial(_kernel, gate=gate, bkv_compute=bkvc, pv_dtype=vh.dtype, flags_out=return_flags)
    outs = pl.pallas_call(
        kernel,
        grid=(b, h, nq, nk),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, d), jnp.float32), pltpu.SMEM((1,), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
    )(*args)
    out = outs[0].reshape(b, lq, h, d) if lane_dense else outs[0].transpose(0, 2, 1, 3)
    if return_flags:
        return out, outs[1][:, :, ::8, 0] == 1
    return out
