"""Matmul rates at klein's shapes: bf16, raw int8, and W8A8 as the int8 layers run it.

    python -m benchmarks.int8_matmul [--preset klein-4b] [--height 1024 --width 1024] [--only NAME]

On the machine it runs on (a TPU chip): for each of the transformer's projection shapes at the given image size
(tokens M = image tokens, text tokens, or both for single-stream blocks), the milliseconds and TFLOP/s (TOPS for int8)
of `jnp.dot` in bf16, `lax.dot_general` on int8 operands into int32, and `model.nets.quantize.int8_matmul` (activations
quantized per token, int32 accumulation, scales in the epilogue). Prints one JSON line last. A measurement tool:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import time


def shapes(config, height: int, width: int, text_len: int = 512) -> dict:
    """{name: (M, K, N)} of the transformer's block projections for one image of height x width."""
    tr = config.transformer
    img = (height // config.size_multiple) * (width // config.size_multiple)
    d, m = tr.inner_dim, tr.mlp_hidden_dim
    return {"single fused in": (img + text_len, d, 3 * d + 2 * m), "single out": (img + text_len, d + m, d),
            "double q/k/v/out (image)": (img, d, d), "double mlp in (image)": (img, d, 2 * m),
            "double mlp out (image)": (img, m, d), "double q/k/v/out (text)": (text_len, d, d),
            "double mlp in (text)": (text_len, d, 2 * m)}


def timed(fn, *args, repeats: int) -> float:
    """Seconds per call (after one warm-up call)."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.int8_matmul", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="klein-4b")
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--only", default="", help="only the shapes whose name contains this")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from model import preset_config
    from model.nets.quantize import int8_matmul, quantize_columns

    bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
    raw = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32))
    xla = jax.jit(lambda x, q, s: int8_matmul(x, q, s, jnp.bfloat16))
    rows = {}
    for name, (m, k, n) in shapes(preset_config(args.preset), args.height, args.width).items():
        if args.only not in name:
            continue
        x = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        q, s = quantize_columns(w)
        xi = jax.random.randint(jax.random.PRNGKey(2), (m, k), -127, 127, jnp.int8)
        flops = 2 * m * k * n
        row = {"m": m, "k": k, "n": n}
        for label, fn, operands in (("bf16", bf16, (x, w)), ("int8_raw", raw, (xi, q)), ("w8a8", xla, (x, q, s))):
            seconds = timed(fn, *operands, repeats=args.repeats)
            row[f"{label}_ms"] = seconds * 1e3
            row[f"{label}_tflops"] = flops / seconds / 1e12
        row["speedup_w8a8"] = row["bf16_ms"] / row["w8a8_ms"]
        rows[name] = row
        print(name, json.dumps({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()}),
              flush=True)
    result = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "shapes": rows,
              "numpy": np.__version__}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
