"""--skip_existing on the local GCS emulator: the stage that decides which images a resumed job keeps, before
(every listed image downloaded and checked) and after (the listing plus the earlier manifest rows' fingerprints).

    python -m benchmarks.resume --images 10000

N small PNGs (a few KB, with the text and fingerprints the writer gives them) and their manifest rows are put in
the emulator directly (no model runs), then SkipExisting runs over N matching tasks on FnApiRunner, both ways.
Counted: image objects read, bytes downloaded (images, and the manifest rows the new way reads), wall time. The
emulator serves from this machine through one Python process, so seconds say little about Cloud Storage; the
objects and bytes are the point. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time


def _fake_images(n: int, model_fp: str):
    """N tasks and, for each, the PNG bytes and manifest row an earlier run would have left."""
    import numpy as np

    from transforms.sinks.encoding import encode_png, png_text
    from transforms.sinks.existing import existing_manifest_row
    from transforms.requests import GenerationRequest, ImageTask

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)  # ~3 KB as PNG
    out = []
    for i in range(n):
        task = ImageTask(GenerationRequest(id=f"img{i:07d}", prompt=f"prompt number {i}", seed=i, height=32,
                                           width=32, num_inference_steps=4, guidance_scale=1.0, num_images=1,
                                           source="p.jsonl", line=i + 1), 0)
        data = encode_png(pixels, png_text(task, num_inference_steps=4, guidance_scale=1.0, model="bench",
                                           model_identity=model_fp))
        out.append((task, data, existing_manifest_row(task, data, "", model_identity=model_fp)))
    return out


def _run_skip(output: str, tasks, model_fp: str, read_manifest: bool, counts_path: str) -> dict:
    """SkipExisting over `tasks`; objects and bytes read through transforms.sinks.writes.read_bytes (FnApiRunner runs
    in this process), and the skipped/stale/to-generate counts."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from transforms.sinks import writes
    from transforms.sinks.encoding import ImageEncoding
    from transforms.sinks.existing import SkipExisting

    reads = {"objects": 0, "bytes": 0}
    real = writes.read_bytes

    def counting(path):
        data = real(path)
        reads["objects"] += 1
        reads["bytes"] += len(data)
        return data

    writes.read_bytes = counting
    try:
        start = time.perf_counter()
        with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
            split = p | beam.Create(tasks) | SkipExisting(output, ImageEncoding(), model_fp,
                                                          read_manifest=read_manifest)
            for name in ("tasks", "existing", "stale"):
                path = os.path.join(counts_path, f"{name}-{read_manifest}")
                _ = (split[name] | f"Count{name}" >> beam.combiners.Count.Globally()
                     | f"Save{name}" >> beam.Map(lambda n, path=path: open(path, "w").write(str(n))))
        seconds = time.perf_counter() - start
    finally:
        writes.read_bytes = real
    counted = {}
    for name in ("tasks", "existing", "stale"):
        with open(os.path.join(counts_path, f"{name}-{read_manifest}")) as f:
            counted[name] = int(f.read())
    return {"seconds": round(seconds, 3), "objects_read": reads["objects"], "image_bytes_read": reads["bytes"],
            "skipped": counted["existing"], "to_generate": counted["tasks"], "stale": counted["stale"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.resume", description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=10_000, help="images already written (default 10000)")
    ap.add_argument("--upload_threads", type=int, default=16)
    args = ap.parse_args(argv)
    if args.images < 1:
        ap.error(f"--images must be >= 1, got {args.images}")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))
    from gcs_emulator import start_emulator

    from transforms import layout
    from transforms.fingerprints import model_fingerprint

    model_fp = model_fingerprint("bench-checkpoint", dtype="bfloat16", max_sequence_length=512)
    made = _fake_images(args.images, model_fp)
    rows = {}
    with start_emulator() as emulator, tempfile.TemporaryDirectory() as tmp:
        bucket = "resume-bench"
        emulator.client().create_bucket(bucket)
        output = f"gs://{bucket}/out"
        manifest = "".join(layout.to_json_line(dict(row, uri=layout.join(output, task.file_name))) + "\n"
                           for task, _, row in made).encode("utf-8")
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.upload_threads) as pool:
            list(pool.map(lambda m: emulator.upload_bytes(layout.join(output, m[0].file_name), m[1], "image/png"),
                          made))
        emulator.upload_bytes(layout.join(output, "manifest/manifest-00000-of-00001.jsonl"), manifest)
        upload_s = time.perf_counter() - start
        tasks = [task for task, _, _ in made]
        for name, read_manifest in (("before: read every image", False), ("after: listing + fingerprints", True)):
            row = _run_skip(output, tasks, model_fp, read_manifest, tmp)
            row["manifest_bytes_read"] = len(manifest) if read_manifest else 0
            rows[name] = row
    image_bytes = sum(len(d) for _, d, _ in made)
    print(f"{args.images} images ({image_bytes / args.images / 1024:.1f} KB each) put in the emulator in "
          f"{upload_s:.1f} s")
    print(f"{'way':32s} {'seconds':>8s} {'objects read':>13s} {'image bytes':>12s} {'manifest bytes':>15s} "
          f"{'skipped':>8s} {'stale':>6s}")
    for name, r in rows.items():
        print(f"{name:32s} {r['seconds']:8.2f} {r['objects_read']:13d} {r['image_bytes_read']:12d} "
              f"{r['manifest_bytes_read']:15d} {r['skipped']:8d} {r['stale']:6d}")
    result = {"images": args.images, "image_bytes_each": round(image_bytes / args.images), "ways": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
