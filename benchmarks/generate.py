"""End-to-end generation benchmark: optimised path vs reference path vs diffusers, plus an ablation of every switch.

    python -m benchmarks.generate --preset small --height 256 --width 256 --batch 1,4

In one process and on the same random weights and the same noise (`model.initial_noise`), for each batch size:

1. the optimised path (`EngineOptions()` and `LabSwitches()`), its compile time with an empty persistent compilation
   cache (cold) and again from a fresh generator over the same cache folder (warm);
2. the reference path (`model.lab.reference_mode()`), unless --skip-reference;
3. diffusers' `Flux2KleinPipeline` on PyTorch (same dtype, `latents=` the same noise), unless --skip-diffusers.
   torch and diffusers are imported only for it: with --skip-diffusers, or where they are not installed (then the
   engine is skipped with a note), the benchmark runs in the worker image, e.g. on an accelerator:

       python -m benchmarks.generate --preset klein-4b --height 1024 --width 1024 --batch 4 --dtype bfloat16 \\
         --skip-diffusers --skip-reference --skip-ablation

Each is warmed up, then the repetitions are interleaved (optimised, reference, diffusers, optimised, ...) so that a
change in machine load hits all of them alike; the median is reported. Every repetition uses new prompts, so the
optimised path's embedding cache never helps the headline numbers (the ablation measures it separately).

End-to-end numbers come from the public API (`gen.generate`, `pipe(...)`) plus PNG encoding of every image. The
per-stage split (tokenize, encode, denoise, decode, device-to-host, host uint8 conversion, PNG) comes from separate
staged runs that call each engine's stages one at a time (the generator's public stage methods; diffusers'
sub-models) and wait after each.

MFU = analytic model FLOPs per image (benchmarks/flops.py: the encoder layers actually run, transformer blocks x
steps x (2 with CFG), VAE decoder convs) / seconds per image (excluding PNG saving) / the matmul rate measured in
this run (best of several square `jnp.dot`s in the benchmark dtype).

Writes <out>/<preset>-<H>x<W>-<dtype>-b<batches>.json and .md, the compared PNGs under <out>/images/, and prints as
its last line one JSON object with the headline numbers.

The engines and variants are built in benchmarks/engines.py, run and timed in benchmarks/runs.py and reported by
benchmarks/reports.py; this module is the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import tempfile
import warnings

from . import engines, reports
from .runs import CompileCounter, Workload, bench_batch, measure_matmul_peak, peak_rss_mb, progress

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint folder instead of the preset's")
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", default="1", help="batch size, or several separated by commas (e.g. 1,4)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=None, help="default: the checkpoint's (4 distilled, 50 --base)")
    ap.add_argument("--guidance", type=float, default=None,
                    help="default: the checkpoint's (1.0 distilled, 4.0 --base)")
    ap.add_argument("--base", action="store_true", help="non-distilled checkpoint of the preset (CFG)")
    ap.add_argument("--max-sequence-length", type=int, default=None, help="default: the preset's (512; tiny 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ablation-repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--skip-diffusers", action="store_true",
                    help="no diffusers engine: torch and diffusers are then never imported (automatic where either "
                         "is not installed)")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--skip-ablation", action="store_true")
    ap.add_argument("--compare-dtype", default=None, choices=["float32", "bfloat16", "none"],
                    help="also render the last repetition's prompts and noise with the optimised path in this dtype "
                         "and report image similarity against it (default: float32 when --dtype is bfloat16)")
    ap.add_argument("--cache-root", default=None, help="where preset checkpoints are built and kept")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    if not args.batches or min(args.batches) < 1:
        ap.error("--batch needs positive integers")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.compare_dtype is None:
        args.compare_dtype = "float32" if args.dtype != "float32" else "none"
    if args.compare_dtype == "none":
        args.compare_dtype = None
    return args


def environment(with_diffusers: bool) -> dict:
    """The machine and library versions; torch's and diffusers' only when the diffusers engine runs (None else)."""
    import jax

    dev = jax.local_devices()[0]
    versions = engines.diffusers_versions() if with_diffusers else dict(torch=None, diffusers=None, torch_threads=None)
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.local_device_count(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__, **versions, "python": platform.python_version(),
            "machine": platform.machine()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore", message=".*donated buffers.*")
    if not args.skip_diffusers and not engines.diffusers_available():
        progress("torch or diffusers is not installed: the diffusers engine is skipped (as with --skip-diffusers)")
        args.skip_diffusers = True
    os.makedirs(args.out, exist_ok=True)
    cache_dir = tempfile.mkdtemp(prefix=".compile-cache-", dir=args.out)
    # The persistent cache must be configured before this process compiles anything.
    from model.engine import enable_compilation_cache

    enable_compilation_cache(cache_dir)
    import jax

    from . import presets

    counter = CompileCounter()
    try:
        if args.max_sequence_length is None:
            args.max_sequence_length = presets.PRESETS[args.preset]["max_sequence_length"]
        progress(f"checkpoint for preset {args.preset} ...")
        path = args.checkpoint or presets.ensure_checkpoint(args.preset, distilled=not args.base,
                                                            cache_root=args.cache_root)
        from model.checkpoint import read_config
        from model.plan import resolve_sampling

        sampling = resolve_sampling(read_config(path), args.steps or None, args.guidance)  # the checkpoint's defaults
        steps, guidance = sampling.num_inference_steps, sampling.guidance_scale
        peak = measure_matmul_peak(args.dtype)
        progress(f"matmul peak {peak['best_flops_per_s'] / 1e9:.1f} GFLOP/s")
        res = {
            "preset": args.preset, "checkpoint": path, "height": args.height, "width": args.width,
            "dtype": args.dtype, "steps": steps, "guidance": guidance, "repeats": args.repeats,
            "warmup": args.warmup, "max_sequence_length": args.max_sequence_length,
            "environment": environment(not args.skip_diffusers), "matmul_peak": peak, "batches": {},
        }
        img_root = os.path.join(args.out, "images", f"{args.preset}-{args.height}x{args.width}-{args.dtype}")
        engines_cache: dict = {}
        stem = f"{args.preset}-{args.height}x{args.width}-{args.dtype}-b{'_'.join(map(str, args.batches))}"
        for batch in args.batches:
            progress(f"batch {batch} ...")
            wl = Workload(args.height, args.width, steps, guidance, batch)
            b = bench_batch(args, path, wl, cache_dir, counter, peak, img_root, engines_cache)
            b["speedups"] = reports.speedups(b["engines"])
            b["paired_speedups"] = reports.paired_speedups(b["engines"])
            res["batches"][str(batch)] = b
            progress(f"batch {batch}: " + json.dumps(reports.headline(res, str(batch))))
            res["peak_rss_mb"] = peak_rss_mb()
            md = reports.write_results(res, args.out, stem)  # after every batch: a long run keeps what it finished
        print(md)
        first = str(args.batches[0])
        final = {**reports.headline(res, first), "preset": args.preset, "batch": args.batches[0], "dtype": args.dtype,
                 "backend": jax.default_backend(), "height": args.height, "width": args.width, "steps": steps}
        if len(args.batches) > 1:
            final["by_batch"] = {k: reports.headline(res, k) for k in res["batches"]}
        final["results"] = os.path.join(args.out, stem + ".json")
        print(json.dumps(final))
        return final
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
