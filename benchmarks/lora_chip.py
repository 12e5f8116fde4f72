"""What a LoRA adapter costs on the chip: the merge's time per adapter rank, int8 speed after the merge, and the cost
per image of adapters applied unmerged, chosen per record.

    python -m benchmarks.lora_chip --preset klein-4b --height 1024 --width 1024 --out $OUT
    python -m benchmarks.lora_chip --preset klein-4b --height 1024 --width 1024 --skip_merged --out $OUT

On the machine it runs on (a TPU chip; a CPU with --preset small): writes random BFL-layout adapters of every block
projection of the preset's random-weight checkpoint (rank 32 and 128), then
- merge_s: each adapter opened and checked from its header, its factors read, and merged into bf16 weights of the
  transformer's shapes on the device, each merged weight quantized to int8 as the loader does (what the load adds);
- int8 ms per image (median of --repeats) with no adapter, then with the rank-32 adapter merged by `model.load`
  (the same programs: the second load compiles nothing new when the compilation cache holds them);
- unmerged (--lora_per_record), for each of --unmerged_dtypes (int8, bfloat16): two rank-32 adapters loaded unmerged,
  ms per image with no adapter, adapter a and adapter b (one compiled program for all three), against the same dtype
  loaded without adapters. `unmerged_ms_per_image`: int8's median over the adapters' runs; `unmerged_over_plain`:
  that over the plain int8 model's. --skip_merged leaves out the merge and the merged model.
Prints one JSON line last. A measurement tool: nothing here is asserted.
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
    ap.add_argument("--unmerged_dtypes", default="int8,bfloat16",
                    help="comma-separated: int8 and/or bfloat16 for the unmerged per-record adapters; '' for none")
    ap.add_argument("--skip_merged", action="store_true", help="only the plain and unmerged models")
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


def ms_per_image(gen, args, lora: str | None = None) -> list[float]:
    """Each of --repeats one-image calls' milliseconds (a first call compiles), with the unmerged adapter `lora`."""
    prompts = ["a photograph of a lighthouse at dusk"]
    gen.generate(prompts, [0], height=args.height, width=args.width, num_inference_steps=args.steps,
                 lora=lora)  # compile
    runs = []
    for r in range(args.repeats):
        start = time.perf_counter()
        # a prompt of its own per run and adapter: every run encodes its prompt, as the plain model's runs do
        gen.generate([f"run {r} ({lora}): a watercolour of a harbour"], [r], height=args.height, width=args.width,
                     num_inference_steps=args.steps, lora=lora)
        runs.append((time.perf_counter() - start) * 1e3)
    return runs


def time_model(path, cache, args, label, timings, **load) -> None:
    """Load, then ms per image for each adapter `timings[label]` asks for (None: the base), the model freed after."""
    import model

    names = (None, "a", "b") if load.get("lora_per_record") else (None,)
    start = time.perf_counter()
    gen = model.load(path, dtype="bfloat16", batch_size=1, compilation_cache_dir=cache, **load)
    load_s = time.perf_counter() - start
    entry = {"load_s": load_s}
    for name in names:
        runs = ms_per_image(gen, args, name)
        entry[f"{name or 'base'}_ms_per_image"] = statistics.median(runs)
        entry[f"{name or 'base'}_runs_ms"] = runs
    entry["ms_per_image"] = entry[f"{names[-1] or 'base'}_ms_per_image"]
    entry["compiles"] = gen.programs.compile_count
    timings[label] = entry
    progress(f"{label}: {entry}")
    del gen
    gc.collect()  # this model's device memory is free before the next loads


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import jax

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
        if not args.skip_merged:
            result["merge"][f"rank{rank}"] = {"adapter_parameters": params, **time_merge(file, linears)}
            progress(f"rank {rank}: {result['merge'][f'rank{rank}']}")
    second = os.path.join(scratch, "rank32-b.safetensors")
    write_adapter(second, linears, 32, seed=1)
    cache = os.path.join(scratch, "xla-cache")
    timings = {}
    per_record = dict(lora_per_record=True, loras=(f"a={adapters[32]}:0.8", f"b={second}:1.0"))
    runs = [("int8", dict(quantize="int8"))]
    if not args.skip_merged:
        runs.append(("int8_merged_rank32", dict(quantize="int8", loras=(f"{adapters[32]}:0.8",))))
    for dtype in filter(None, args.unmerged_dtypes.split(",")):
        quantize = "int8" if dtype == "int8" else "none"
        if dtype != "int8":
            runs.append((dtype, dict(quantize=quantize)))
        runs.append((f"{dtype}_unmerged_2x_rank32", dict(quantize=quantize, **per_record)))
    for label, load in runs:
        time_model(path, cache, args, label, timings, **load)
    result.update(timings)
    if "int8_merged_rank32" in timings:
        result["merged_over_plain"] = timings["int8_merged_rank32"]["ms_per_image"] / timings["int8"]["ms_per_image"]
    for dtype in filter(None, args.unmerged_dtypes.split(",")):
        entry, plain = timings[f"{dtype}_unmerged_2x_rank32"], timings[dtype]
        adapter_ms = statistics.median(entry["a_runs_ms"] + entry["b_runs_ms"])
        result[f"{dtype}_unmerged_over_plain"] = adapter_ms / plain["ms_per_image"]
        result[f"{dtype}_unmerged_base_over_plain"] = entry["base_ms_per_image"] / plain["ms_per_image"]
        if dtype == "int8":
            result["unmerged_ms_per_image"] = adapter_ms
            result["unmerged_over_plain"] = result["int8_unmerged_over_plain"]
    result.setdefault("unmerged_ms_per_image", None)
    with open(os.path.join(args.out, f"lora-{args.preset}-{args.height}x{args.width}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
