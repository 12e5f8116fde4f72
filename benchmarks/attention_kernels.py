"""The flash attention kernel (model/nets/flash_attention.py) per block pair against splash, at klein-4B's attention
shape.

    python -m benchmarks.attention_kernels            # on a TPU chip: 24 heads x 4608 tokens x 128, B=1, bf16
    python -m benchmarks.attention_kernels --small    # anywhere (Pallas interpret mode off TPU): 2 x 512 x 128

Inputs as the transformer makes them: q and k RMS-normed with weights near 1, q scaled by 1/sqrt(D), v normal.
Times splash (`model.nets.attention._splash_heads` at the blocks model.nets.platform_forms picks for the chip, as
`attention_heads` runs it where the flash kernel is not used) and the flash kernel for each (block_q, block_kv) asked
for, fitted to the length as the kernel fits them (at 4608 tokens 1024 becomes 768; every row gives the blocks that
ran). Each row: ms per call, TFLOP/s (4 B H L^2 D per call), max |out - splash| and max |out - float32 reference|
(NaN for a non-finite output); a block pair that does not compile is a row with its error. Prints a table, then one
JSON line.
The kernel's defaults (model.nets.flash_attention.BLOCK_Q, BLOCK_KV, BLOCK_KV_COMPUTE) are the best row on v5e.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attention_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="2 heads x 512 tokens, small blocks: for CPU tests")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--seq", type=int, default=4608, help="512 text + 4096 image tokens at 1024x1024")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block-q", default="512,1024,1536", help="query blocks to time (fitted to --seq)")
    ap.add_argument("--block-kv", default="1024,2304,4608", help="key blocks to time (fitted to --seq); 4608: "
                    "every key of a head in one block")
    ap.add_argument("--block-kv-compute", type=int, default=512, help="keys per matmul inside a key block")
    ap.add_argument("--iters", type=int, default=10, help="calls per timed batch")
    ap.add_argument("--batches", type=int, default=3, help="timed batches per kernel, the median kept")
    args = ap.parse_args(argv)
    if args.small:
        args.heads, args.seq, args.block_q, args.block_kv, args.iters = 2, 512, "512", "256,512", 1
        args.block_kv_compute, args.batches = 128, 1
    return args


def realistic_inputs(batch: int, heads: int, seq: int, head_dim: int, seed: int = 0):
    """bf16 q, k, v [B, H, L, D]: q and k RMS-normed with weights ~ 1 (+-5%), q times 1/sqrt(D); v standard normal."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 5)
    shape = (batch, heads, seq, head_dim)

    def normed(key, weight_key):
        x = jax.random.normal(key, shape, jnp.float32)
        weight = 1.0 + 0.05 * jax.random.normal(weight_key, (head_dim,), jnp.float32)
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * weight

    q = (normed(keys[0], keys[1]) * head_dim ** -0.5).astype(jnp.bfloat16)
    k = normed(keys[2], keys[3]).astype(jnp.bfloat16)
    v = jax.random.normal(keys[4], shape, jnp.bfloat16)
    return q, k, v


def reference(q, k, v):
    """float32 softmax attention, one head at a time (the whole logits of one head fit easily), [B, L, H, D]."""
    import jax
    import jax.numpy as jnp

    def one(qh, kh, vh):  # [B, L, D]
        s = jnp.einsum("bqd,bkd->bqk", qh.astype(jnp.float32), kh.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), vh.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)

    out = jax.lax.map(lambda t: one(*t), (q.transpose(1, 0, 2, 3), k.transpose(1, 0, 2, 3), v.transpose(1, 0, 2, 3)))
    return jax.jit(lambda o: o.transpose(1, 2, 0, 3))(out)


def time_fn(fn, *args, iters: int, batches: int = 3) -> float:
    """ms per call: the median over `batches` batches of `iters` back-to-back calls (after a warm-up call)."""
    import jax

    jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(batches):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(per_call)


def flash_pairs(args) -> list[tuple[int, int, int]]:
    """The distinct (block_q, block_kv, block_kv_compute) the kernel runs for the block pairs asked for, in order."""
    from model.nets.flash_attention import kernel_blocks

    pairs = []
    for bq in (int(x) for x in args.block_q.split(",")):
        for bkv in (int(x) for x in args.block_kv.split(",")):
            blocks = kernel_blocks(args.seq, args.seq, bq, bkv, args.block_kv_compute)
            if blocks is None:
                raise SystemExit(f"no block of at most {bq} / {bkv} tokens divides --seq {args.seq}")
            if blocks not in pairs:
                pairs.append(blocks)
    return pairs


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from model.nets.attention import _splash_heads
    from model.nets.flash_attention import flash_attention
    from model.nets.platform_forms import forms_for

    interpret = jax.default_backend() != "tpu"
    forms = forms_for(jax.devices()[0].platform, jax.devices()[0].device_kind)
    q, k, v = realistic_inputs(args.batch, args.heads, args.seq, args.head_dim)
    flops = 4.0 * args.batch * args.heads * args.seq * args.seq * args.head_dim
    want = reference(q, k, v)

    def diff(out, to):  # NaN when the kernel's output is not finite (a max over NaNs need not be NaN)
        d = jnp.abs(out.astype(jnp.float32) - to.astype(jnp.float32))
        return float(jnp.where(jnp.all(jnp.isfinite(d)), jnp.max(d), jnp.nan))

    def measure(name, fn, **extra):
        row = {"kernel": name, **extra}
        try:
            ms = time_fn(fn, q, k, v, iters=args.iters, batches=args.batches)
            out = fn(q, k, v)
            row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 2), max_diff_splash=diff(out, splash_out),
                       max_diff_f32=diff(out, want))
        except Exception as e:  # noqa: BLE001 - a block pair that does not compile is a result too
            row["error"] = " ".join(str(e).split())[:300]
        text = (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TF/s  |d splash| {row['max_diff_splash']:.2e}  "
                f"|d f32| {row['max_diff_f32']:.2e}" if "ms" in row else "error: " + row["error"][:120])
        print(f"{name:7s} {str(extra.get('blocks', '')):18s} {text}", flush=True)
        return row

    # splash as attention_heads runs it off the flash kernel's chips: [B, H, L, D] out, laid out as [B, L, H, D]
    splash = jax.jit(lambda q, k, v: _splash_heads(q, k, v, False, None, interpret, forms).transpose(0, 2, 1, 3))
    splash_out = splash(q, k, v)
    rows = [measure("splash", splash)]
    for bq, bkv, bkvc in flash_pairs(args):
        fn = jax.jit(lambda q, k, v, bq=bq, bkv=bkv, bkvc=bkvc: flash_attention(
            q, k, v, interpret=interpret, block_q=bq, block_kv=bkv, block_kv_compute=bkvc))
        rows.append(measure("flash", fn, blocks=[bq, bkv, bkvc]))
    best = min((r for r in rows[1:] if "ms" in r), key=lambda r: r["ms"], default=None)
    result = {"device_kind": jax.devices()[0].device_kind, "interpret": interpret,
              "shape": [args.batch, args.heads, args.seq, args.head_dim], "gflop_per_call": flops / 1e9,
              "splash": rows[0], "best": best,
              "speedup_over_splash": (round(rows[0]["ms"] / best["ms"], 3)
                                      if best is not None and "ms" in rows[0] else None),
              "rows": rows[1:]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
