"""A worker's start-up, phase by phase: imports, checkpoint fetch, reading and placing weights, compiling (or loading
from the compilation cache), first image. Each run is a fresh process, as a new worker is.

    python -m benchmarks.startup --preset small --height 256 --width 256            # CPU
    python -m benchmarks.startup --preset klein-4b --height 1024 --width 1024       # a TPU chip
    python -m benchmarks.startup --model gs://bucket/ckpt ...                        # with the gs:// copy

The load also starts the accelerator runtime, beside reading configs, tokenizer and headers (`--runtime-first` starts
it before the load instead); its rows split the load's wall time (runtime start, preparing, placing the weights,
finishing) and the loading threads' time. The measured shape's programs compile after the load, as in the job.

Runs cold (an empty compilation cache and, for gs://, an empty checkpoint cache) and then warm (the same caches, as a
worker that starts after another of the same job). Prints a table and, last, one JSON line. A measurement tool:
nothing here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--model", default=None, help="a checkpoint folder or gs:// prefix instead of the preset's")
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-sequence-length", type=int, default=None)
    ap.add_argument("--runtime-first", action="store_true", help="start the accelerator runtime before the load, "
                    "not beside its preparations (as before model.engine.runtime.start_runtime)")
    ap.add_argument("--keep-caches", default=None, metavar="DIR", help="put the runs' caches in DIR (emptied "
                    "first) and leave them there, for a later warm run or a profile")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-cache", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def child(args) -> dict:
    """One worker start, timed from this process's start (the parent passes its launch time)."""
    t0 = float(os.environ["STARTUP_T0"])
    out = {"process_start_s": time.time() - t0}
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the parent keeps the load's lines
    start = time.perf_counter()
    import jax  # noqa: F401

    import model
    from model.engine.compile_events import counts
    out["imports_s"] = time.perf_counter() - start
    start = time.perf_counter()
    if args.runtime_first:  # as before the load started the runtime itself, beside its own preparations
        from model.engine.runtime import start_runtime

        start_runtime().result()  # the load's own start, with its settings, waited for here
    out["backend_init_s"] = time.perf_counter() - start
    counts()
    path = args.model
    start = time.perf_counter()
    if path.startswith("gs://"):
        from model.loading.checkpoint import resolve_checkpoint

        path = resolve_checkpoint(path, cache_dir=args.checkpoint_cache)
    out["fetch_s"] = time.perf_counter() - start
    weight_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
                       if f.endswith(".safetensors"))
    out["rss_before_load_gb"] = _rss_gb()
    start = time.perf_counter()
    from model.options import EngineOptions, LoadSettings

    gen = model.load(LoadSettings(model=path, dtype=args.dtype, max_sequence_length=args.max_sequence_length,
                                  engine=EngineOptions(batch_size=1, compilation_cache_dir=args.cache)))
    out["load_s"] = time.perf_counter() - start
    out["backend"] = jax.default_backend()
    from model.engine.runtime import PREMAPPED_BUFFER_ENV

    out["runtime_settings"] = {PREMAPPED_BUFFER_ENV: os.environ.get(PREMAPPED_BUFFER_ENV)}  # inherited or the load's
    out["rss_after_load_gb"] = _rss_gb()
    out["weight_gb"] = weight_bytes / 1e9  # the checkpoint's files; the load reads only the tensors the model uses
    # what was read and placed: the parameters the devices hold (one device: every loaded tensor, in the model's dtype)
    placed = gen.programs.parameter_bytes_per_device()
    out["loaded_gb"] = sum(placed.values()) / 1e9
    out["load_gb_per_s"] = out["loaded_gb"] / out["load_s"]
    # the weights' own rate: read, placed and laid out, over the placing's wall time (the load also holds the
    # preparations)
    out["placing_gb_per_s"] = gen.load_phases["bytes"] / 1e9 / gen.load_phases["wall_s"]
    out["load_phases"] = gen.load_phases  # thread-seconds per phase of placing the weights, and its wall time
    size = dict(height=args.height, width=args.width)
    start = time.perf_counter()
    gen.prepare_bucket(gen.check_inputs(["a red fox"], [0], **size))  # the bucket's three programs
    out["compile_s"] = time.perf_counter() - start
    out.update({f"xla_{k}": v for k, v in counts().items()})
    start = time.perf_counter()
    gen.generate(["a red fox"], [0], **size)
    out["first_image_s"] = time.perf_counter() - start
    out["first_image_after_start_s"] = time.time() - t0
    out["rss_gb"] = _rss_gb()
    return out


def _rss_gb() -> float | None:
    """This process's resident memory in GB (None off Linux)."""
    from .runs import host_memory_mb

    rss_mb = host_memory_mb().get("rss")  # MiB, from the kernel's kB
    return None if rss_mb is None else rss_mb * 1024 / 1e6


def run_child(args, cache: str, checkpoint_cache: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", f"--model={args.model}", f"--cache={cache}",
           f"--checkpoint-cache={checkpoint_cache}", f"--height={args.height}", f"--width={args.width}",
           f"--dtype={args.dtype}", f"--max-sequence-length={args.max_sequence_length}",
           *(["--runtime-first"] if args.runtime_first else [])]
    env = dict(os.environ, STARTUP_T0=repr(time.time()))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"start-up run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for line in done.stderr.splitlines():  # the load's own account: placing, precompiling, waiting, compiling
        if line.startswith(("model.engine.generator:", "model.engine.programs:")):
            print(f"[startup] {line}", file=sys.stderr, flush=True)
    print(f"[startup] run done: {json.dumps(result)}", file=sys.stderr, flush=True)  # kept if a later run is cut off
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    from . import presets

    if args.model is None:
        args.model = presets.ensure_checkpoint(args.preset)
    if args.max_sequence_length is None:
        args.max_sequence_length = presets.PRESETS[args.preset]["max_sequence_length"]
    with contextlib.ExitStack() as stack:
        if args.keep_caches:
            shutil.rmtree(args.keep_caches, ignore_errors=True)  # the cold run starts from empty caches
            tmp = args.keep_caches
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="startup-"))
        cache, ckpt_cache = os.path.join(tmp, "xla"), os.path.join(tmp, "checkpoints")
        runs = {"cold": run_child(args, cache, ckpt_cache), "warm": run_child(args, cache, ckpt_cache)}
    rows = [("phase", "cold s", "warm s")]
    for key in ("process_start", "imports", "backend_init", "fetch", "load", "compile", "first_image",
                "first_image_after_start"):
        rows.append((key, f"{runs['cold'][key + '_s']:.2f}", f"{runs['warm'][key + '_s']:.2f}"))
    rows.append(("weights loaded GB", *(f"{runs[r]['loaded_gb']:.2f}" for r in ("cold", "warm"))))
    rows.append(("weights GB/s (of the load)", *(f"{runs[r]['load_gb_per_s']:.2f}" for r in ("cold", "warm"))))
    rows.append(("weights GB/s (of placing)", *(f"{runs[r]['placing_gb_per_s']:.2f}" for r in ("cold", "warm"))))
    for key in ("runtime_start", "runtime_wait", "prepare", "wall", "finish"):
        name = {"wall": "placing weights", "runtime_start": "runtime start (beside prepare)",
                "prepare": "prepare (with runtime wait)"}.get(key, key)
        rows.append((f"load: {name} s", *(f"{runs[r]['load_phases'][key + '_s']:.2f}" for r in ("cold", "warm"))))
    for key in runs["warm"]["load_phases"].get("prepare_steps_s", {}):  # the preparations' steps, in order
        rows.append((f"prepare: {key} s", *(f"{runs[r]['load_phases']['prepare_steps_s'].get(key, float('nan')):.2f}"
                                            for r in ("cold", "warm"))))
    for key in ("read", "host_layout", "transfer", "device_layout"):
        rows.append((f"placing: {key} thread-s",
                     *(f"{runs[r]['load_phases'][key + '_s']:.1f}" for r in ("cold", "warm"))))
    for key in ("rss_before_load", "rss_after_load", "rss"):
        rows.append((key + " GB", *(f"{runs[r][key + '_gb'] or float('nan'):.2f}" for r in ("cold", "warm"))))
    rows.append(("XLA compiles / cache hits", f"{runs['cold']['xla_compiles']} / {runs['cold']['xla_cache_hits']}",
                 f"{runs['warm']['xla_compiles']} / {runs['warm']['xla_cache_hits']}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print("\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                    for r in rows))
    # the runtime's and compiler's settings the runs inherited (e.g. TPU_PREMAPPED_BUFFER_SIZE, XLA_FLAGS)
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("TPU_", "LIBTPU_", "XLA_", "JAX_"))}
    result = {"model": args.model, "height": args.height, "width": args.width, "dtype": args.dtype,
              "runtime_first": args.runtime_first,
              "environment": settings,
              "backend": runs["cold"]["backend"], **runs}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
