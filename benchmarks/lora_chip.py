"""What a LoRA adapter costs on the chip: the merge's time per adapter rank, int8 speed after the merge, and the cost
per image of adapters applied unmerged, chosen per record.

    python -m benchmarks.lora_chip --preset klein-4b --height 1024 --width 1024 --out $OUT
    python -m benchmarks.lora_chip --preset klein-4b --height 1024 --width 1024 --skip_merged --out $OUT
    python -m benchmarks.lora_chip --preset klein-4b --height 1024 --width 1024 --unmerged_dtypes '' --out $OUT
    python -m benchmarks.lora_chip --preset klein-4b --merge_only --out $OUT
    python -m benchmarks.lora_chip --preset klein-4b --compile_only

On the machine it runs on (a TPU chip; a CPU with --preset small): writes random BFL-layout adapters of every block
projection of the preset's random-weight checkpoint (rank 32 and 128), then
- merge_s: what the adapter adds to a cold load: it opened and checked from its header, its factors read, and the
  adapted weights (bf16, the transformer's shapes) laid out on the device as the loader does, the delta merged by
  the program that transposes and quantizes each to int8 (one per shape and rank, compiled ahead on the loader's
  threads), less the same weights' plain layouts (which a load without the adapter makes anyway); the programs, the
  backend compiles and their seconds are reported beside it (merge_and_layout_s: the layouts' time included);
- int8 ms per image (median of --repeats) with no adapter, then with the rank-32 adapter merged by `model.load`
  (the same programs: the second load compiles nothing new when the compilation cache holds them);
- unmerged (--lora_per_record), for each of --unmerged_dtypes (int8, bfloat16): two rank-32 adapters loaded unmerged,
  ms per image with no adapter, adapter a and adapter b (one compiled program for all three), against the same dtype
  loaded without adapters. `unmerged_ms_per_image`: int8's median over the adapters' runs; `unmerged_over_plain`:
  that over the plain int8 model's. --skip_merged leaves out the merge and the merged model; --unmerged_dtypes ''
  the unmerged ones; --merge_only every model; --compile_only compiles the preset's layout programs from its shapes
  alone (a CPU check of klein-4B's program count and compile seconds, no checkpoint).
Prints one JSON line last. A measurement tool: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import functools
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
    ap.add_argument("--merge_only", action="store_true", help="only the merge times: no model is loaded")
    ap.add_argument("--compile_only", action="store_true",
                    help="only the layout programs of a real-size preset compiled from its shapes (no checkpoint; "
                         "runs on a CPU): their count and compile seconds, plain and with each rank's adapter")
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


def _layout_keys(parameters: dict, names, sharding, deltas: dict | None) -> dict:
    """{parameter: the DEVICE_TRANSPOSES key the loader lays it out with}: bf16 sent in torch layout, transposed and
    quantized to int8 on the device, its LoRA delta merged first where `deltas` has one."""
    from model.loading.loader import DeviceTransposes, lora_rank

    return {name: DeviceTransposes.key((1, 0), parameters[name], "bfloat16", sharding, sharding,
                                       lora_rank((deltas[name],) if deltas else None)) for name in names}


def compile_layouts(keys) -> dict:
    """Every distinct program of `keys` compiled at once on a fresh DeviceTransposes' threads, as the loader does
    before the weights are read: seconds, programs, backend compiles and their summed seconds."""
    from model.loading.loader import DeviceTransposes

    transposes, counter = DeviceTransposes(), _compile_counter()
    snap, start = counter.snapshot(), time.perf_counter()
    programs = {key: transposes.prepare(key) for key in set(keys)}
    compiled = {key: future.result() for key, future in programs.items()}
    spent = counter.since(snap)
    return {"compiled": compiled, "compile_wall_s": time.perf_counter() - start, "programs": len(programs),
            "compiles": spent["compiles"], "compile_thread_s": spent["compile_seconds"]}


@functools.lru_cache(maxsize=None)
def _compile_counter():
    """The process's one CompileCounter (its listeners stay registered)."""
    from .runs import CompileCounter

    return CompileCounter()


def run_layouts(parameters: dict, names, sharding, deltas: dict | None) -> dict:
    """The device layouts of the weights `names` (one bf16 weight per shape, in torch layout, reused), as the loader
    makes them: the programs compiled ahead, then each weight (with its stacked LoRA factors sent as the loader
    sends them) laid out and waited on. `cold_s` counts the compiles; `warm_s` the same work compiled already."""
    import jax
    import ml_dtypes

    from model.loading.loader import _factor_shardings, stacked_factors

    keys = _layout_keys(parameters, names, sharding, deltas)
    weights = {shape: jax.device_put(np.zeros(shape, ml_dtypes.bfloat16), sharding)
               for shape in {parameters[name] for name in names}}
    jax.block_until_ready(list(weights.values()))

    def lay_out(compiled):
        for name in names:
            args = [weights[parameters[name]]]
            if deltas:
                args += jax.device_put(stacked_factors((deltas[name],)), _factor_shardings(sharding))
            jax.block_until_ready(compiled[keys[name]](*args))

    start = time.perf_counter()
    compiling = compile_layouts(keys.values())
    compiled = compiling.pop("compiled")
    lay_out(compiled)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    lay_out(compiled)
    return {"cold_s": cold_s, "warm_s": time.perf_counter() - start, **compiling}


def time_merge(path: str, linears: dict[str, tuple[int, int]]) -> dict:
    """What one adapter adds to a cold load: open + check from the header and read the factors, then the adapted
    weights' device layouts with their deltas merged against the same weights' plain layouts (transpose and int8
    quantization, which a load without the adapter makes anyway). `merge_s` = read + (merging layouts' cold time -
    plain layouts' cold time); `merge_and_layout_s` = read + the merging layouts' cold time, the layouts included."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from model.config.lora_spec import LoraSpec
    from model.loading.lora_source import open_adapter

    parameters = {m + ".weight": shape for m, shape in linears.items()}
    sharding = SingleDeviceSharding(jax.devices()[0])
    start = time.perf_counter()
    adapter = open_adapter(LoraSpec(path), parameters)
    deltas = adapter.deltas()
    read_s = time.perf_counter() - start
    names = sorted(deltas)
    # a first small program of each kind, so neither measure below pays the compiler's start in this process
    warm_up = {"warm_up.weight": (8, 16)}
    run_layouts(warm_up, list(warm_up), sharding, None)
    plain = run_layouts(parameters, names, sharding, None)
    merging = run_layouts(parameters, names, sharding, deltas)
    return {"open_and_read_s": read_s, "device_merge_cold_s": merging["cold_s"],
            "device_merge_warm_s": merging["warm_s"], "plain_layout_cold_s": plain["cold_s"],
            "plain_layout_warm_s": plain["warm_s"],
            "merge_s": read_s + max(0.0, merging["cold_s"] - plain["cold_s"]),
            "merge_and_layout_s": read_s + merging["cold_s"], "parameters_adapted": len(deltas),
            "merge_programs": merging["programs"], "merge_compiles": merging["compiles"],
            "merge_compile_thread_s": merging["compile_thread_s"], "merge_compile_wall_s": merging["compile_wall_s"],
            "plain_programs": plain["programs"], "plain_compiles": plain["compiles"],
            "plain_compile_thread_s": plain["compile_thread_s"], "plain_compile_wall_s": plain["compile_wall_s"]}


def compile_only(preset: str, ranks) -> dict:
    """The preset's layout programs compiled from shapes alone (no checkpoint, nothing allocated: a CPU check of a
    real-size preset): for every block projection, plain and with an adapter of each rank."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from model.engine.factory import Networks
    from model.loading.loader import expected_tensors
    from model.loading.lora import LoraDelta
    from model.loading.presets import preset_config

    transformer = Networks(preset_config(preset), "bfloat16", quantize="int8").transformer()
    parameters = {name: shape for name, shape in expected_tensors(transformer).items()
                  if "blocks." in name and name.endswith(".weight") and len(shape) == 2}
    sharding = SingleDeviceSharding(jax.devices()[0])
    out = {"parameters_adapted": len(parameters)}
    compile_layouts(_layout_keys({"warm_up.weight": (8, 16)}, ["warm_up.weight"], sharding, None).values())
    for label, rank in [("plain", 0), *((f"rank{r}", r) for r in ranks)]:
        deltas = None if not rank else {
            name: LoraDelta(np.broadcast_to(np.float32(0), (rank, shape[1])),
                            np.broadcast_to(np.float32(0), (shape[0], rank)), 1.0)
            for name, shape in parameters.items()}
        entry = compile_layouts(_layout_keys(parameters, sorted(parameters), sharding, deltas).values())
        entry.pop("compiled")
        out[label] = entry
        progress(f"{label}: {entry}")
    return out


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

    if args.compile_only:
        result = {"preset": args.preset, "backend": jax.default_backend(), "compile_only": compile_only(args.preset,
                                                                                                      RANKS)}
        print(json.dumps(result))
        return result
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
    if args.merge_only:
        print(json.dumps(result))
        return result
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
