"""pHash cost and the Hamming distances that choose --near_duplicate_distance (transforms/phash.py).

    python -m benchmarks.phash speed [--size 1024] [--images 200]
    python -m benchmarks.phash distances [--prompts 6] [--seeds 4] [--out DIR]

`speed`: wall and CPU (process) milliseconds per image of `phash_pixels` on random RGB images of size x size (CPU
time is what a shared machine cannot inflate). `distances`: a job on the bundled demo checkpoint (tiny random
weights, its own size) with every prompt at every seed, and once more each prompt's first seed under another id;
then the distances between the manifest's hashes: identical images (same prompt and seed), the same prompt at other
seeds, other prompts, and each image against itself re-encoded as JPEG (quality 90 and 75) and resized by 5%.
Prints the figures, then one JSON line.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np


def speed(size: int, images: int) -> dict:
    from transforms.phash import phash_pixels

    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(8)]
    phash_pixels(pictures[0])  # the DCT matrix, imports
    walls, cpus = [], []
    for i in range(images):
        w, c = time.perf_counter(), time.process_time()
        phash_pixels(pictures[i % len(pictures)])
        walls.append((time.perf_counter() - w) * 1e3)
        cpus.append((time.process_time() - c) * 1e3)
    return {"size": size, "images": images, "wall_ms_median": round(statistics.median(walls), 3),
            "wall_ms_min": round(min(walls), 3), "cpu_ms_mean": round(sum(cpus) / images, 3),
            "load_average": os.getloadavg()[0]}


def _summary(values: list[int]) -> dict:
    if not values:
        return {}
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def distances(prompts: int, seeds: int, out: str | None) -> dict:
    from PIL import Image

    from pipeline.run import run
    from transforms.phash import distance, phash_image

    words = ["a red fox in snow", "a lighthouse at dusk", "a bowl of ramen", "a city street in rain",
             "a mountain lake", "a portrait of an old sailor", "a field of sunflowers", "a robot reading"]
    records = [{"id": f"p{p}-s{s}", "prompt": words[p % len(words)], "seed": 100 + s}
               for p in range(prompts) for s in range(seeds)]
    records += [{"id": f"p{p}-s0-again", "prompt": words[p % len(words)], "seed": 100} for p in range(prompts)]
    work = out or tempfile.mkdtemp(prefix="phash-distances-")
    inp = os.path.join(work, "prompts.jsonl")
    os.makedirs(work, exist_ok=True)
    with open(inp, "w") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    output = os.path.join(work, "out")
    run([f"--input={inp}", f"--output={output}", "--demo_checkpoint", "--no_progress", "--overwrite"])
    rows = {}
    for name in os.listdir(os.path.join(output, "manifest")):
        if name.startswith("manifest-"):
            with open(os.path.join(output, "manifest", name)) as f:
                rows.update((r["id"], r) for r in map(json.loads, f) if r)
    identical, same_prompt, other_prompt = [], [], []
    for a, b in itertools.combinations(sorted(rows), 2):
        pa, pb = rows[a]["id"].split("-")[0], rows[b]["id"].split("-")[0]
        d = distance(rows[a]["phash"], rows[b]["phash"])
        same_seed = rows[a]["seed"] == rows[b]["seed"]
        (identical if pa == pb and same_seed else same_prompt if pa == pb else other_prompt).append(d)
    reencoded = {"jpeg90": [], "jpeg75": [], "resized95": []}
    for row in rows.values():
        with Image.open(os.path.join(output, row["file_name"])) as im:
            im = im.convert("RGB")
            for label, quality in (("jpeg90", 90), ("jpeg75", 75)):
                buf = io.BytesIO()
                im.save(buf, format="JPEG", quality=quality)
                reencoded[label].append(distance(row["phash"], phash_image(Image.open(buf))))
            smaller = im.resize((round(im.width * 0.95), round(im.height * 0.95)), Image.Resampling.BILINEAR)
            reencoded["resized95"].append(distance(row["phash"], phash_image(smaller)))
    return {"images": len(rows), "size": [next(iter(rows.values()))["height"], next(iter(rows.values()))["width"]],
            "identical": _summary(identical), "same_prompt_other_seed": _summary(same_prompt),
            "other_prompt": _summary(other_prompt), **{k: _summary(v) for k, v in reencoded.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--size", type=int, default=1024)
    s.add_argument("--images", type=int, default=200)
    d = sub.add_parser("distances")
    d.add_argument("--prompts", type=int, default=6)
    d.add_argument("--seeds", type=int, default=4)
    d.add_argument("--out")
    args = parser.parse_args(argv)
    result = speed(args.size, args.images) if args.what == "speed" else distances(args.prompts, args.seeds, args.out)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps({"benchmark": f"phash_{args.what}", **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
