"""Splash attention block sizes measured on the chip at the transformer's real shapes.

    python -m benchmarks.splash_sweep --heads 24 --seq 4608 --head-dim 128 --out $OUT

Times one attention call (bf16 q/k/v [heads, seq, head_dim], no mask) for each kernel form and block triple
(block_q, block_kv, block_kv_compute): `mha` (one kernel over every head, as model.nets.attention runs it since the
sweep), `mqa` (the multi-query kernel with one query head, vmapped over heads: the form used before), with and
without kv segment ids (needed only when keys are padded or masked), and XLA's attention for reference. A triple
the chip cannot compile (scoped VMEM) is reported with its error, not dropped. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

DEFAULT_TRIPLES = ("512,512,512 1024,1024,512 1024,1024,1024 1152,1152,384 1152,2304,384 1536,1536,512 "
                   "1536,1536,768 1536,1536,1536 1536,4608,512 2304,2304,768 2304,2304,1152 768,1536,768 "
                   "2304,1536,512 4608,1536,512 1536,2304,768 1152,4608,384")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.splash_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--seq", type=int, default=4608, help="512 text + 4096 image tokens at 1024x1024")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--triples", default=DEFAULT_TRIPLES, help="block_q,block_kv,block_kv_compute ...")
    ap.add_argument("--forms", default="mha,mha+segments,mqa+segments")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def time_fn(fn, *args, iters: int) -> float:
    """Median ms of `iters` calls of a jitted fn (after one warm-up call), each waited on."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def build(form: str, triple, heads: int, seq: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    bq, bkv, bkvc = triple
    pad = -seq % max(bq, bkv)
    length = seq + pad
    sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc)
    segmented = "segments" in form or pad
    seg = jnp.ones((length,), jnp.int32)
    kv_seg = seg.at[seq:].set(0) if pad else seg
    segments = splash.SegmentIds(q=seg, kv=kv_seg) if segmented else None

    def padded(x):
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0))) if pad else x

    if form.startswith("mha"):
        kernel = splash.make_splash_mha(splash.MultiHeadMask([splash.FullMask((length, length))] * heads),
                                        block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                        interpret=jax.default_backend() != "tpu")

        def run(q, k, v):
            return kernel(padded(q), padded(k), padded(v), segment_ids=segments)[:, :seq]
    else:
        kernel = splash.make_splash_mqa(splash.MultiHeadMask([splash.FullMask((length, length))]),
                                        block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                        interpret=jax.default_backend() != "tpu")

        def run(q, k, v):
            one = lambda qq, kk, vv: kernel(qq[None], kk, vv, segment_ids=segments)[0]  # noqa: E731
            return jax.vmap(one)(padded(q), padded(k), padded(v))[:, :seq]

    return jax.jit(run)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 3)
    shape = (args.heads, args.seq, args.head_dim)
    q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
    q = q * (args.head_dim ** -0.5)
    flops = 4.0 * args.heads * args.seq * args.seq * args.head_dim
    rows = []
    xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None], scale=1.0,
        implementation="xla"))
    try:
        ms = time_fn(xla, q, k, v, iters=args.iters)
        rows.append({"form": "xla", "triple": None, "ms": ms, "tflops": flops / ms / 1e9})
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        rows.append({"form": "xla", "triple": None, "error": str(e).splitlines()[0][:200]})
    reference = None
    for form in args.forms.split(","):
        for text in args.triples.split():
            triple = tuple(int(x) for x in text.split(","))
            row = {"form": form, "triple": list(triple)}
            try:
                fn = build(form, triple, args.heads, args.seq)
                ms = time_fn(fn, q, k, v, iters=args.iters)
                out = fn(q, k, v)
                if reference is None:
                    reference = out
                row.update(ms=ms, tflops=flops / ms / 1e9,
                           max_diff=float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32)))))
            except Exception as e:  # noqa: BLE001 - a triple that does not compile is a result too
                row["error"] = " ".join(str(e).split())[:300]
            rows.append(row)
            print(f"{form:14s} {str(triple):22s} " + (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TF/s"
                                                      if "ms" in row else "error: " + row["error"][:120]),
                  flush=True)
    ok = [r for r in rows if "ms" in r and r["form"] != "xla"]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    result = {"device_kind": jax.devices()[0].device_kind, "heads": args.heads, "seq": args.seq,
              "head_dim": args.head_dim, "gflop_per_call": flops / 1e9, "best": best, "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"splash-sweep-h{args.heads}-s{args.seq}.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return result


if __name__ == "__main__":
    main()
