"""The job's images/s divided by `generate()`'s images/s on the same model, size and batch: how much of the device's
rate the host side (encoding, writing, Beam) lets through. 1.0 means the device never waits for the host.

    python -m benchmarks.job_ratio --height 256 --width 256 --images 48 --batch_size 4 [--job_args "--image_format=jpeg"]

Uses the demo's tiny random-weight checkpoint (fast generation, so the host's share shows). `generate()` is timed
warm, batch after batch. The job (`pipeline.run`, FnApiRunner, in this process) is timed in its steady state: images
after the first batch over the time between the first and the last image file's modification, so the model load and
compilation are left out. Run it with another tree first on PYTHONPATH (as a file path, not -m) to measure that
tree's job. Prints both rates, the ratio, and JSON as the last line.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shlex
import sys
import tempfile
import time


def generate_rate(ckpt: str, height: int, width: int, images: int, batch_size: int, dtype: str = "float32") -> float:
    """Warm `generate()` images/s for `images` images in batches of `batch_size`."""
    import model
    from model.options import EngineOptions, LoadSettings

    gen = model.load(LoadSettings(model=ckpt, dtype=dtype, engine=EngineOptions(batch_size=batch_size)))
    prompts = [f"ratio prompt {i}" for i in range(images)]
    gen.generate(prompts[:batch_size], list(range(batch_size)), height, width)  # compile
    start = time.perf_counter()
    for i in range(0, images, batch_size):
        gen.generate(prompts[i:i + batch_size], list(range(i, i + batch_size)), height, width)
    return images / (time.perf_counter() - start)


def job_rate(ckpt: str, height: int, width: int, images: int, batch_size: int, job_args: list[str],
             dtype: str = "float32") -> float:
    """The job's steady-state images/s (see the module docstring)."""
    from pipeline.run import run

    work = tempfile.mkdtemp(prefix="job-ratio-")
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(images):
            f.write(json.dumps({"id": f"p{i:04d}", "prompt": f"ratio prompt {i}", "seed": i}) + "\n")
    run([f"--model={ckpt}", f"--input={prompts}", f"--output={work}/out", f"--height={height}", f"--width={width}",
         f"--batch_size={batch_size}", f"--dtype={dtype}", "--no_progress", *job_args])
    times = sorted(os.path.getmtime(p) for p in glob.glob(f"{work}/out/images/*"))
    if len(times) != images:
        raise RuntimeError(f"the job wrote {len(times)} images of {images}")
    return (images - batch_size) / (times[-1] - times[batch_size - 1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--job_args", default="", help="more arguments for the job, e.g. '--image_format=jpeg'")
    ap.add_argument("--preset", default="demo", help="'demo' (the demo's checkpoint) or a benchmarks preset, e.g. "
                    "klein-4b on a TPU chip")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    if args.preset == "demo":
        from pipeline.demo import demo_checkpoint

        ckpt = demo_checkpoint()
    else:
        from benchmarks.presets import ensure_checkpoint

        ckpt = ensure_checkpoint(args.preset)
    gen = generate_rate(ckpt, args.height, args.width, args.images, args.batch_size, args.dtype)
    gc.collect()  # the generator's device arrays go before the job loads the model again (one chip holds one copy)
    job = job_rate(ckpt, args.height, args.width, args.images, args.batch_size, shlex.split(args.job_args),
                   args.dtype)
    import pipeline

    print(f"generate(): {gen:.2f} images/s; job: {job:.2f} images/s; ratio {job / gen:.3f} "
          f"(code from {os.path.dirname(os.path.dirname(pipeline.__file__))})")
    print(json.dumps({"benchmark": "job_ratio", "preset": args.preset, "dtype": args.dtype, "height": args.height, "width": args.width, "images": args.images,
                      "batch_size": args.batch_size, "job_args": args.job_args, "generate_images_per_s": round(gen, 3),
                      "job_images_per_s": round(job, 3), "ratio": round(job / gen, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
