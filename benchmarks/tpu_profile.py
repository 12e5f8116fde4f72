"""Where a real-size image's device time goes: stage times, then a JAX profiler trace summed per program and per op.

    python -m benchmarks.tpu_profile --preset klein-4b --height 1024 --width 1024 --batch 1 --out $OUT
    python -m benchmarks.tpu_profile ... --vae small-decoder     # the decode with FLUX.2-small-decoder's shapes

On the machine it runs on (a TPU chip, or a CPU for a small preset): loads the preset's random-weight checkpoint in
bf16 (host RSS before and after), times `generate()` end to end and by stage (each stage waited on), then traces
one more staged call with `jax.profiler.trace` and sums the device op durations of the Perfetto trace per program
(encode, denoise, decode) and per op (fusion names with their HLO category). Writes <out>/profile-*.json (the top
ops) and prints one JSON line with the headline figures. A measurement tool: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import logging
import os
import re
import statistics
import tempfile
import time

from .engines import parse_options
from .runs import current_rss_mb, device_memory, host_memory_mb, measure_matmul_peak, progress


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tpu_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=60, help="ops kept per program in the JSON file")
    ap.add_argument("--no-trace", action="store_true", help="stage times only")
    ap.add_argument("--engine", default="", help="EngineOptions fields as key=value,key=value, e.g. quantize=int8")
    ap.add_argument("--variants", default="",
                    help="also time these EngineOptions variants (no trace), over the same weights where they fit: "
                    "name:key=value,...;name:..., e.g. \"b2:batch_size=2;b4:batch_size=4\"")
    ap.add_argument("--vae", default=None,
                    help="another VAE in place of the checkpoint's (model.load vae=): a folder or file, or "
                    "'small-decoder' for random weights in FLUX.2-small-decoder's shapes")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = ap.parse_args(argv)
    try:  # a wrong field fails here, before anything loads
        args.variant_options = [(name, parse_options(text)) for name, _, text in
                                (item.partition(":") for item in filter(None, args.variants.split(";")))]
        args.engine_options = parse_options(args.engine)
    except ValueError as e:
        ap.error(str(e))
    return args


def staged_times(engine, prompts, seeds, wl) -> dict:
    _, t = engine.staged(prompts, seeds, wl["height"], wl["width"], wl["steps"], 1.0)
    return {k: v * 1e3 for k, v in t.items()}


def program_of(name: str) -> str:
    """The generator program a jitted module name belongs to (jit_encode, jit_denoise, jit_decode...)."""
    for key in ("decode", "denoise", "encode"):  # "decode" before "encode", which it contains
        if key in name:
            return key
    return "other"


def summarise_trace(trace_dir: str, top: int) -> dict:
    """Device time per program and per op from the newest Perfetto trace under `trace_dir`."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
                   or glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not paths:
        return {"error": f"no trace written under {trace_dir}"}
    with gzip.open(paths[-1], "rt") as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    threads = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    modules = sorted(((e["ts"], e["ts"] + e["dur"], e["name"], e["pid"]) for e in spans
                      if "Module" in threads.get((e.get("pid"), e.get("tid")), "")), key=lambda m: m[0])
    starts = [m[0] for m in modules]
    per_program = collections.Counter()
    per_op: dict = collections.defaultdict(lambda: collections.Counter())
    long_names: dict = {}
    op_threads = {k for k, v in threads.items() if v in ("XLA Ops",) or v.endswith("XLA Ops")}
    for e in spans:
        key = (e.get("pid"), e.get("tid"))
        if key not in op_threads:
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        prog = program_of(modules[i][2]) if i >= 0 and modules[i][1] >= e["ts"] else "other"
        name = e["name"]
        per_op[prog][name] += e["dur"]
        args = e.get("args", {})
        if name not in long_names:
            long_names[name] = str(args.get("long_name") or args.get("hlo_op") or args.get("tf_op") or "")[:300]
        per_program[prog] += e["dur"]
    for m in modules:
        per_program["module:" + program_of(m[2])] += m[1] - m[0]
    out = {"trace": paths[-1], "thread_names": sorted(set(threads.values()))[:40],
           "per_program_us": dict(per_program), "ops": {}}
    for prog, ops in per_op.items():
        total = sum(ops.values())
        cats = collections.Counter()
        for name, us in ops.items():
            cats[_category(name, long_names.get(name, ""))] += us
        families = collections.Counter()
        for name, us in ops.items():
            families[re.sub(r"[._]?\d+$", "", re.sub(r"\.clone$", "", name))] += us
        loops = {n for n in ops if n.startswith("while")}  # a loop's span holds its body's ops: counted there
        rest = [(n, us) for n, us in ops.most_common() if n not in loops
                and _category(n, long_names.get(n, "")) not in ("matmul fusion", "convolution",
                                                                 "custom-call (splash)")]
        out["ops"][prog] = {"total_us": total, "loops_us": sum(ops[n] for n in loops),
                            "by_category_us": dict(cats.most_common()),
                            "by_family_us": dict(families.most_common(40)),
                            "top": [{"op": n, "us": us, "share": us / total, "hlo": long_names.get(n, "")}
                                    for n, us in ops.most_common(top)],
                            "top_other": [{"op": n, "us": us, "hlo": long_names.get(n, "")} for n, us in rest[:top]]}
    return out


def _category(name: str, long_name: str) -> str:
    text = (name + " " + long_name).lower()
    if "custom-call" in text or "splash" in text or "tpu_custom_call" in text or "mosaic" in text:
        return "custom-call (splash)"
    if "convolution" in text or re.search(r"\bconv", text):
        return "convolution"
    if "dot" in text or "matmul" in text:
        return "matmul fusion"
    if "fusion" in text:
        return "other fusion"
    if "copy" in text or "transpose" in text:
        return "copy/transpose"
    return "other"


def _trimmed_rss() -> float:
    """RSS after glibc returns the freed heap (compilers and transfers free much of what they took)."""
    from model.loading.loader import release_host_memory

    release_host_memory()
    return current_rss_mb()


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    rss_start = current_rss_mb()
    import jax

    import model
    from . import presets
    from .engines import JaxEngine

    path = args.checkpoint or presets.ensure_checkpoint(args.preset)
    os.makedirs(args.out, exist_ok=True)
    rss_imported = current_rss_mb()
    jax.devices()  # the runtime's own host memory (13.6 GB on a v5e chip) counts before the load, not in it
    rss_before = current_rss_mb()
    start = time.perf_counter()
    vae = presets.ensure_small_decoder_vae() if args.vae == "small-decoder" else args.vae
    gen = model.load(path, dtype=args.dtype, batch_size=args.batch, vae=vae, **args.engine_options)
    load_s = time.perf_counter() - start
    rss_after = current_rss_mb()
    host_after_load = host_memory_mb()
    progress(f"loaded in {load_s:.1f} s; RSS {rss_before:.0f} -> {rss_after:.0f} MB")
    engine = JaxEngine("ours", gen)
    wl = {"height": args.height, "width": args.width, "steps": args.steps}
    prompts = [f"a photograph of object {i} on a table" for i in range(args.batch)]
    start = time.perf_counter()
    engine.generate(prompts, list(range(args.batch)), args.height, args.width, args.steps, 1.0)
    first_s = time.perf_counter() - start
    e2e = []
    for r in range(args.repeats):
        p = [f"run {r}: a watercolour of a lighthouse, variant {i}" for i in range(args.batch)]
        start = time.perf_counter()
        images = engine.generate(p, list(range(args.batch)), args.height, args.width, args.steps, 1.0)
        e2e.append((time.perf_counter() - start) * 1e3 / args.batch)
    stages = [staged_times(engine, [f"staged {r} {i}" for i in range(args.batch)], list(range(args.batch)), wl)
              for r in range(args.repeats)]
    stage_ms = {k: statistics.median(s[k] for s in stages) / args.batch for k in stages[0]}
    finite = bool(images.size) and int(images.min()) >= 0
    result = {"preset": args.preset, "height": args.height, "width": args.width, "batch": args.batch,
              "dtype": args.dtype, "steps": args.steps, "engine": args.engine, "vae": args.vae,
              "vae_decoder_channels": list(gen.config.vae.block_out_channels),
              "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
              "ms_per_image": statistics.median(e2e), "ms_per_image_runs": e2e, "stage_ms_per_image": stage_ms,
              "first_call_s": first_s, "load_s": load_s,
              "rss_mb": {"start": rss_start, "imported": rss_imported, "before_load": rss_before,
                         "after_load": rss_after, "after_runs": current_rss_mb()},
              "host_memory_mb": {"after_load": host_after_load, "after_runs": host_memory_mb()},
              "rss_after_trim_mb": _trimmed_rss(),
              "device_memory": device_memory(), "images_ok": finite}
    peak = measure_matmul_peak(args.dtype)
    result["matmul_peak_tflops"] = peak["best_flops_per_s"] / 1e12
    if not args.no_trace:
        trace_dir = tempfile.mkdtemp(prefix="trace-")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            staged_times(engine, ["traced prompt"] * args.batch, list(range(args.batch)), wl)
        try:
            summary = summarise_trace(trace_dir, args.top)
        except Exception as e:  # keep the timings when the trace cannot be read
            summary = {"error": repr(e)}
        result["profile_per_program_us"] = summary.get("per_program_us")
        result["profile_categories_us"] = {p: v["by_category_us"] for p, v in summary.get("ops", {}).items()}
        stem = f"profile-{args.preset}-{args.height}x{args.width}-b{args.batch}"
        if args.engine:
            stem += "-" + re.sub(r"[^A-Za-z0-9]+", "_", args.engine)
        if args.vae:
            stem += "-vae_" + re.sub(r"[^A-Za-z0-9]+", "_", os.path.basename(args.vae.rstrip("/")))
        with open(os.path.join(args.out, stem + ".json"), "w") as fh:
            json.dump({**result, "profile": summary}, fh, indent=1)
    if args.variants:
        result["variants"] = time_variants(gen, path, args)
        with open(os.path.join(args.out, f"variants-{args.preset}-{args.height}x{args.width}.json"), "w") as fh:
            json.dump(result["variants"], fh, indent=1)
    print(json.dumps(result))
    return result


def time_variants(gen, path, args) -> dict:
    """ms per image (end to end and by stage, medians of --repeats) of each variant of --variants: the loaded
    generator's options with the variant's fields changed (model.options.EngineOptions)."""
    import dataclasses

    from .engines import JaxEngine, with_options

    out = {}
    for name, fields in args.variant_options:
        options = dataclasses.replace(gen.options, **fields)
        try:
            engine = JaxEngine(name, with_options(gen, path, options))
            n = options.batch_size or args.batch
            wl = {"height": args.height, "width": args.width, "steps": args.steps}
            engine.generate([f"{name} warm-up {i}" for i in range(n)], list(range(n)), args.height, args.width,
                            args.steps, 1.0)
            e2e = []
            for r in range(args.repeats):
                start = time.perf_counter()
                engine.generate([f"{name} {r} {i}" for i in range(n)], list(range(n)), args.height, args.width,
                                args.steps, 1.0)
                e2e.append((time.perf_counter() - start) * 1e3 / n)
            stages = [staged_times(engine, [f"{name} staged {r} {i}" for i in range(n)], list(range(n)), wl)
                      for r in range(args.repeats)]
            out[name] = {"batch": n, "options": fields, "ms_per_image": statistics.median(e2e),
                         "stage_ms_per_image": {k: statistics.median(s[k] for s in stages) / n for k in stages[0]},
                         "device_memory": device_memory()}
        except Exception as e:  # noqa: BLE001 - e.g. a batch that does not fit: reported
            out[name] = {"error": " ".join(str(e).split())[:400]}
        progress(f"variant {name}: {json.dumps(out[name])}")
    return out


if __name__ == "__main__":
    main()
