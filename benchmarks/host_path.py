"""The host's capacity: images/s through the job's own encode, write and manifest path, by format and thread count.

    python -m benchmarks.host_path --height 1024 --width 1024 --images 200 --threads 1,2,4 \\
        --image_format png1,png6,webp,jpeg --store local,emulator [--device_images_per_s 10.9]

Ready-made pixel arrays (smooth, seeded, with a little noise: compressible like a generated image, unlike pure
noise) go through `StoreImagesFn` exactly as the job's sinks run it (its encoder-thread pool, atomic writes,
manifest rows with the stored bytes' sha256), then the rows are written as the manifest file. No model and no Beam
runner: the device side is what RunInference adds on top. `png1`/`png6` are PNG at zlib level 1/6. `--store emulator` writes to
the local GCS emulator (tests/support/gcs_emulator.py), which runs in this process and shares its cores.

The device rates the host must sustain come first: images/s per worker host and per chip from the TPU compiler's
estimates (`--device_rates`, default the bundled `benchmarks/tpu_estimates_1024.json` that
`python -m benchmarks.tpu_estimates` produced; estimates, not measurements). `--device_images_per_s R` (default: the
fastest host there) is the rate each row is judged against: whether the host keeps up. Prints tables and, as its last
line, JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_SUPPORT = os.path.join(REPO, "tests", "support")  # gcs_emulator
LOGGER = logging.getLogger("benchmarks.host_path")
DEVICE_RATES = os.path.join(REPO, "benchmarks", "tpu_estimates_1024.json")
DISTINCT_IMAGES = 8  # pixel arrays cycled through, so memory stays small at any --images


def synthetic_pixels(height: int, width: int, seed: int) -> np.ndarray:
    """A seeded uint8 [H, W, 3] image: smooth waves plus mild noise, which compresses like a real picture."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(seed)
    waves = np.stack([128 + 100 * np.sin(x / (90 + 7 * c + seed) + c) * np.cos(y / (130 - 5 * c) - seed)
                      for c in range(3)], axis=-1)
    return np.clip(waves + rng.normal(0, 6, waves.shape), 0, 255).astype(np.uint8)


def parse_format(name: str):
    """'png1' / 'png6' / 'png' / 'webp' / 'jpeg' -> ImageEncoding; ValueError naming an unknown one."""
    from transforms.sinks.encoding import ImageEncoding

    if name.startswith("png") and name[3:].isdigit():
        return ImageEncoding("png", png_compress_level=int(name[3:]))
    try:
        return ImageEncoding(name)
    except ValueError:
        raise ValueError(f"--image_format entry {name!r} is not png<level>, png, webp or jpeg") from None


def make_results(height: int, width: int, n: int) -> list:
    """n GeneratedImages like the generation stage's, for distinct requests (one image each), pixels cycled."""
    from transforms.inference import GeneratedImage
    from transforms.requests import GenerationRequest, ImageTask

    pixels = [synthetic_pixels(height, width, s) for s in range(DISTINCT_IMAGES)]
    out = []
    for i in range(n):
        request = GenerationRequest(id=f"bench{i:05d}", prompt=f"benchmark prompt {i}", seed=i, height=height,
                                    width=width, num_inference_steps=None, guidance_scale=None, num_images=1,
                                    source="bench.jsonl", line=i + 1)
        task = ImageTask(request, 0)
        out.append(GeneratedImage(task, pixels[i % DISTINCT_IMAGES], 4, 1.0, False, "bench", 0.0))
    return out


def run_host_path(results: list, output: str, encoding, threads: int) -> dict:
    """Time the job's writer over `results` (one bundle) plus the manifest write; images/s and bytes."""
    from apache_beam.transforms.window import GlobalWindow
    from apache_beam.utils.timestamp import MIN_TIMESTAMP

    from transforms import layout
    from transforms.sinks.files import InImages
    from transforms.sinks.writes import StoreImagesFn, write_bytes_atomic

    fn = StoreImagesFn(InImages(output, encoding), encoding, threads=threads)
    fn.setup()
    try:
        start = time.perf_counter()
        fn.start_bundle()
        # As the runner calls it: each element in the global window (what a batch job's elements are in).
        rows = [wv.value for r in results for wv in fn.process(r, window=GlobalWindow(), timestamp=MIN_TIMESTAMP)]
        rows += [wv.value for wv in fn.finish_bundle()]
        write_bytes_atomic(layout.manifest_prefix(output) + "-00000-of-00001.jsonl",
                           ("\n".join(layout.to_json_line(row) for row in rows) + "\n").encode("utf-8"))
        seconds = time.perf_counter() - start
    finally:
        fn.teardown()
    if len(rows) != len(results):
        raise RuntimeError(f"{len(rows)} manifest rows for {len(results)} images")
    return {"images_per_s": len(results) / seconds, "seconds": seconds,
            "mean_bytes": sum(r["bytes"] for r in rows) / len(rows)}


def device_rates(path: str) -> list[dict]:
    """Images/s per worker host and per chip for each fitting row of a tpu_estimates JSON (the compiler's estimate)."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    out = []
    for r in rows:
        if r.get("fits") and r.get("est_seconds_per_image"):
            host = 1.0 / r["est_seconds_per_image"]
            out.append({"model": r["model"], "topology": r["topology"], "batch": r["batch"],
                        "model_shards": r["model_shards"], "host_images_per_s": round(host, 2),
                        "chip_images_per_s": round(host / r["chips"], 2)})
    return out


def measure(outputs: dict, encodings: dict, thread_counts: list[int], results, args) -> list[dict]:
    """One row per store, format and thread count, printed as it is measured."""
    rows = []
    print(f"host path, {args.height}x{args.width}, {args.images} images, {os.cpu_count()} cores")
    print(f"{'store':9} {'format':7} {'threads':>7} {'images/s':>9} {'KiB/image':>10}"
          + ("  keeps up with device" if args.device_images_per_s else ""))
    for store, base in outputs.items():
        for name, encoding in encodings.items():
            for threads in thread_counts:
                figures = run_host_path(results, f"{base.rstrip('/')}/{name}-t{threads}", encoding, threads)
                row = {"store": store, "format": name, "threads": threads,
                       "images_per_s": round(figures["images_per_s"], 2),
                       "kib_per_image": round(figures["mean_bytes"] / 1024, 1)}
                if args.device_images_per_s:
                    row["keeps_up"] = figures["images_per_s"] >= args.device_images_per_s
                rows.append(row)
                print(f"{store:9} {name:7} {threads:>7} {row['images_per_s']:>9.2f} {row['kib_per_image']:>10.1f}"
                      + (f"  {'yes' if row['keeps_up'] else 'NO'}" if args.device_images_per_s else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--threads", default="1,2,4", help="comma-separated encoder thread counts")
    ap.add_argument("--image_format", default="png1,png6,webp,jpeg",
                    help="comma-separated: png<level> (png1, png6), png (the job's default level), webp, jpeg")
    ap.add_argument("--store", default="local,emulator", help="comma-separated: local, emulator")
    ap.add_argument("--device_images_per_s", type=float, default=None,
                    help="the device's images/s that the host must sustain (default: the fastest host in --device_rates)")
    ap.add_argument("--device_rates", default=DEVICE_RATES,
                    help="tpu_estimates JSON giving the device rates to sustain ('' for none)")
    args = ap.parse_args(argv)
    rates = device_rates(args.device_rates) if args.device_rates else []
    if rates:
        print("device rates the host must sustain (TPU compiler's estimate, 1024x1024, 4 steps; not measured):")
        print(f"{'model':9} {'topology':10} {'batch':>5} {'shards':>6} {'host img/s':>10} {'chip img/s':>10}")
        for r in rates:
            print(f"{r['model']:9} {r['topology']:10} {r['batch']:>5} {r['model_shards']:>6} "
                  f"{r['host_images_per_s']:>10.2f} {r['chip_images_per_s']:>10.2f}")
        if args.device_images_per_s is None:
            args.device_images_per_s = max(r["host_images_per_s"] for r in rates)
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, REPO)
    encodings = {name: parse_format(name) for name in args.image_format.split(",")}
    thread_counts = [int(t) for t in args.threads.split(",")]
    stores = args.store.split(",")
    results = make_results(args.height, args.width, args.images)
    with contextlib.ExitStack() as cleanup:
        outputs = {}
        if "local" in stores:
            outputs["local"] = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="host-path-"))
        if "emulator" in stores:
            sys.path.insert(0, TESTS_SUPPORT)
            from gcs_emulator import start_emulator

            emulator = cleanup.enter_context(start_emulator())
            outputs["emulator"] = f"gs://{emulator.new_bucket('bench')}"
        rows = measure(outputs, encodings, thread_counts, results, args)
    print(json.dumps({"benchmark": "host_path", "height": args.height, "width": args.width, "images": args.images,
                      "cores": os.cpu_count(), "device_images_per_s": args.device_images_per_s,
                      "device_rates": rates, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
