"""What a merged LoRA adapter costs on the chip: the merge's time per adapter rank, and int8 speed after the merge.

    python -m benchmarks.lora_chip --preset klein-4b --height 1024 --width 1024 --out $OUT

On the machine it runs on (a TPU chip; a CPU with --preset small): writes random BFL-layout adapters of every block
projection of the preset's random-weight checkpoint (rank 32 and 128), then
- merge_s: each adapter opened and checked from its header, its factors read, and merged into bf16 weights of the
  transformer's shapes on the device, each merged weight quantized to int8 as the loader does (what the load adds);
- int8 ms per image (median of --repeats) with no adapter, then with the rank-32 adapter merged by `model.load`
  (the same programs: the second load compiles nothing new when the compilation cache holds them).
Per-record adapters applied unmerged are not built yet: `unmerged_ms_per_image` is null. Prints one JSON line last.
A measurement tool: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import tempfile
import time

import numpy as np

from .runs import progress

RANKS = (32, 128)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lora_chip", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    return ap.parse_args(argv)


def transformer_linears(checkpoint: str) -> dict[str, tuple[int, int]]:
    """{module: (out, in)} of every 2-D transformer weight, from the checkpoint's headers."""
    from model.loading.safetensors_file import open_component

    files = open_component(os.path.join(checkpoint, "transformer"), None)
    return {name.removesuffix(".weight"): tuple(f.entries[name][1]) for name, f in files.items()
            if name.endswith(".weight") and len(f.entries[name][1]) == 2}


def write_adapter(path: str, linears: dict[str, tuple[int, int]], rank: int, seed: int = 0) -> int:
    """A random adapter of every block projection in diffusers' keys; returns its parameter count."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (out, width) in linears.items():
        if "blocks." not in module:
            continue
        tensors[f"transformer.{module}.lora_A.weight"] = (rng.standard_normal((rank, width)) * 0.01).astype(np.float16)
        tensors[f"transformer.{module}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.01).astype(np.float16)
    save_file(tensors, path)
    return sum(t.size for t in tensors.values())


def time_merge(path: str, linears: dict[str, tuple[int, int]]) -> dict:
    """The load's added work for one adapter: open + check from the header, read the factors, merge each on the
    device into a bf16 weight of its shape and quantize it to int8 (each step waited on)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from model.loading.loader import _quantizer, merge_deltas
    from model.loading.lora_source import open_adapter
    from model.config.lora_spec import LoraSpec

    parameters = {m + ".weight": shape for m, shape in linears.items()}
    sharding = SingleDeviceSharding(jax.devices()[0])
    start = time.perf_counter()
    adapter = open_adapter(LoraSpec(path), parameters)
    deltas = adapter.deltas()
    read_s = time.perf_counter() - start
    # One bf16 weight per shape, in JAX's [in, out] layout as the loader holds it before quantizing (the whole
    # transformer at once would not leave the chip room for the loads that follow).
    by_shape = {shape: jax.device_put(jnp.zeros(shape[::-1], jnp.bfloat16), sharding)
                for shape in {parameters[name] for name in deltas}}
    weights = {name: by_shape[parameters[name]] for name in deltas}
    jax.block_until_ready(list(by_shape.values()))
    start = time.perf_counter()
    for name, delta in deltas.items():
        merged = merge_deltas(weights[name], (delta,), sharding, transposed=True)
        jax.block_until_ready(_quantizer(sharding, sharding)(merged))
    first_s = time.perf_counter() - start  # compiles each shape's merge once, as a cold load does
    start = time.perf_counter()
    for name, delta in deltas.items():
        merged = merge_deltas(weights[name], (delta,), sharding, transposed=True)
        jax.block_until_ready(_quantizer(sharding, sharding)(merged))
    return {"open_and_read_s": read_s, "device_merge_cold_s": first_s,
            "device_merge_warm_s": time.perf_counter() - start, "merge_s": read_s + first_s,
            "parameters_adapted": len(deltas)}


def ms_per_image(gen, args) -> list[float]:
    prompts = ["a photograph of a lighthouse at dusk"]
    gen.generate(prompts, [0], height=args.height, width=args.width, num_inference_steps=args.steps)  # compile
    runs = []
    for r in range(args.repeats):
        start = time.perf_counter()
        gen.generate([f"run {r}: a watercolour of a harbour"], [r], height=args.height, width=args.width,
                     num_inference_steps=args.steps)
        runs.append((time.perf_counter() - start) * 1e3)
    return runs


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import jax

    import model
    from . import presets

    path = presets.ensure_checkpoint(args.preset)
    os.makedirs(args.out, exist_ok=True)
    linears = transformer_linears(path)
    scratch = tempfile.mkdtemp(prefix="lora-chip-")
    adapters = {rank: os.path.join(scratch, f"rank{rank}.safetensors") for rank in RANKS}
    result = {"preset": args.preset, "height": args.height, "width": args.width, "steps": args.steps,
              "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "merge": {}}
    for rank, file in adapters.items():
        params = write_adapter(file, linears, rank)
        result["merge"][f"rank{rank}"] = {"adapter_parameters": params, **time_merge(file, linears)}
        progress(f"rank {rank}: {result['merge'][f'rank{rank}']}")
    cache = os.path.join(scratch, "xla-cache")
    timings = {}
    for label, loras in (("int8", ()), ("int8_merged_rank32", (f"{adapters[32]}:0.8",))):
        start = time.perf_counter()
        gen = model.load(path, dtype="bfloat16", quantize="int8", batch_size=1, compilation_cache_dir=cache,
                         loras=loras)
        load_s = time.perf_counter() - start
        runs = ms_per_image(gen, args)
        timings[label] = {"load_s": load_s, "ms_per_image": statistics.median(runs), "runs_ms": runs}
        progress(f"{label}: {timings[label]}")
        del gen
        gc.collect()  # the first model's device memory is free before the second loads
    result.update(timings)
    result["merged_over_plain"] = timings["int8_merged_rank32"]["ms_per_image"] / timings["int8"]["ms_per_image"]
    result["unmerged_ms_per_image"] = None  # per-record adapters applied unmerged: not built yet
    with open(os.path.join(args.out, f"lora-{args.preset}-{args.height}x{args.width}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
