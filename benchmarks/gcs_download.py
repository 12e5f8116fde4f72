"""Time the gs:// checkpoint copy (model.loading.checkpoint.resolve_checkpoint, its default settings) on the local GCS
emulator: a checkpoint-like folder (the config files and a few weight files of random bytes) is uploaded once, then
copied `--repeats` times, each into a fresh cache folder, and checked byte for byte against what was uploaded.

    python -m benchmarks.gcs_download --sizes 256,128,128,64 --repeats 3

The emulator runs in a process of its own, serving from memory, so the copy does not share an interpreter lock with
it; its absolute MB/s still say little about Cloud Storage: compare trees or settings on one machine. Prints one line
per copy and a JSON line last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support")
CONFIGS = ("model_index.json", "transformer/config.json", "text_encoder/config.json", "vae/config.json",
           "scheduler/scheduler_config.json", "tokenizer/tokenizer_config.json")
WEIGHTS = ("transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
           "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
           "text_encoder/model.safetensors", "vae/diffusion_pytorch_model.safetensors")


def _serve(host_queue, stop) -> None:
    """The emulator's process: start it, say where it listens, serve until told to stop."""
    sys.path.insert(0, SUPPORT)
    from gcs_emulator import start_emulator

    with start_emulator() as emulator:
        host_queue.put(emulator.host)
        stop.wait()


def _objects(sizes_mib: list[int]) -> dict[str, bytes]:
    """{relative name: bytes}: small JSON configs and one weight file of random bytes per size (MiB)."""
    if len(sizes_mib) > len(WEIGHTS):
        raise SystemExit(f"at most {len(WEIGHTS)} weight files")
    objects = {name: json.dumps({"_name": name}).encode() for name in CONFIGS}
    for name, mib in zip(WEIGHTS, sizes_mib):
        objects[name] = os.urandom(mib * 2**20)
    return objects


def _digests(folder: str, names) -> dict[str, str]:
    out = {}
    for name in names:
        with open(os.path.join(folder, *name.split("/")), "rb") as f:
            out[name] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gcs_download", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,128,128,64", help="weight file sizes in MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    ctx = multiprocessing.get_context("spawn")
    host_queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(host_queue, stop), daemon=True)
    server.start()
    try:
        host = host_queue.get(timeout=120)
        os.environ.update({"STORAGE_EMULATOR_HOST": host, "NO_GCE_CHECK": "true", "GOOGLE_APPLICATION_CREDENTIALS": "",
                           "GOOGLE_CLOUD_PROJECT": "test-project"})
        from google.cloud import storage

        from model.loading import checkpoint

        objects = _objects(sizes)
        expected = {name: hashlib.sha256(data).hexdigest() for name, data in objects.items()}
        total_mib = sum(len(d) for d in objects.values()) / 2**20
        bucket = storage.Client(project="test-project").create_bucket("download-bench")
        for name, data in objects.items():
            bucket.blob(f"ckpt/{name}").upload_from_string(data)
        del objects
        uri = "gs://download-bench/ckpt"
        seconds = []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                cache = os.path.join(tmp, f"cache-{r}")
                start = time.perf_counter()
                folder = checkpoint.resolve_checkpoint(uri, cache_dir=cache)
                seconds.append(time.perf_counter() - start)
                if _digests(folder, expected) != expected:
                    raise SystemExit(f"copy {r + 1}: the files differ from the uploaded ones")
                print(f"copy {r + 1}: {seconds[-1]:6.2f} s  {total_mib / seconds[-1]:7.1f} MiB/s")
                shutil.rmtree(cache)
    finally:
        stop.set()
        server.join(timeout=30)
    tree = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint.__file__)))
    result = {"tree": tree, "mib": round(total_mib, 1), "weight_files_mib": sizes,
              "seconds": [round(s, 3) for s in seconds], "median_s": round(statistics.median(seconds), 3),
              "median_mib_per_s": round(total_mib / statistics.median(seconds), 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
