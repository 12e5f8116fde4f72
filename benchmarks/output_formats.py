"""The same job in each --output_format, side by side: objects written, bytes, wall time and images/s.

    python -m benchmarks.output_formats --images 1000 [--height 64 --width 64 --batch_size 8 --samples_per_shard 1000]

Uses the demo's tiny random-weight checkpoint on a local output with Beam's FnApiRunner (the DirectRunner family),
one fresh `python -m pipeline.run` process per format, so each figure includes starting Beam and loading the
model, as a user's run does. A warm-up run first fills a persistent XLA cache that both runs then read, so neither
format pays the compilation and the other not. Objects are the files under the output afterwards (images or shards, manifests,
preview, indexes). Prints a table, then JSON as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

FORMATS = ("files", "webdataset")


def write_prompts(path: str, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i:06d}", "prompt": f"benchmark prompt number {i}", "seed": i}) + "\n")


def count_objects(folder: str) -> tuple[int, int]:
    """(files, bytes) under `folder`, recursively."""
    files = size = 0
    for root, _, names in os.walk(folder):
        for name in names:
            files += 1
            size += os.path.getsize(os.path.join(root, name))
    return files, size


def run_format(fmt: str, ckpt: str, prompts: str, out: str, args) -> dict:
    cmd = [sys.executable, "-m", "pipeline.run", f"--model={ckpt}", f"--input={prompts}", f"--output={out}",
           f"--output_format={fmt}", f"--height={args.height}", f"--width={args.width}",
           f"--batch_size={args.batch_size}", f"--samples_per_shard={args.samples_per_shard}", "--dtype=float32",
           "--max_sequence_length=32", "--no_progress", f"--compilation_cache_dir={args.cache}", "--preview=64"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{fmt} run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    objects, size = count_objects(out)
    return {"format": fmt, "images": summary["images_generated"], "failed": summary["failed"],
            "objects": objects, "bytes": size, "wall_s": round(wall, 2),
            "images_per_s": round(summary["images_generated"] / wall, 3),
            "job_images_per_s": summary["images_per_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--samples_per_shard", type=int, default=1000)
    ap.add_argument("--keep", action="store_true", help="keep the outputs (their folder is printed)")
    args = ap.parse_args(argv)
    from pipeline.demo import demo_checkpoint

    ckpt = demo_checkpoint()
    work = tempfile.mkdtemp(prefix="output-formats-")
    prompts = os.path.join(work, "prompts.jsonl")
    write_prompts(prompts, args.images)
    args.cache = os.path.join(work, "xla-cache")
    warm = os.path.join(work, "warm.jsonl")
    write_prompts(warm, args.batch_size)
    rows = []
    try:
        run_format("files", ckpt, warm, os.path.join(work, "warm"), args)
        for fmt in FORMATS:
            rows.append(run_format(fmt, ckpt, prompts, os.path.join(work, fmt), args))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{args.images} images, {args.height}x{args.width}, batch {args.batch_size}, tiny demo checkpoint, "
          f"local output, FnApiRunner" + (f"; outputs in {work}" if args.keep else ""))
    print(f"{'format':<12}{'images':>8}{'objects':>9}{'MB':>9}{'wall s':>9}{'images/s':>10}{'job images/s':>14}")
    for r in rows:
        print(f"{r['format']:<12}{r['images']:>8}{r['objects']:>9}{r['bytes'] / 1e6:>9.2f}{r['wall_s']:>9.1f}"
              f"{r['images_per_s']:>10.2f}{r['job_images_per_s']:>14.2f}")
    print(json.dumps({"benchmark": "output_formats", "images": args.images, "height": args.height,
                      "width": args.width, "batch_size": args.batch_size,
                      "samples_per_shard": args.samples_per_shard, "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
