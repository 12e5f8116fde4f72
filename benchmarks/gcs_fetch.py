"""gs:// checkpoint copy throughput on the local GCS emulator: sliced parallel ranges (model.loading.checkpoint) against
one stream per object, the same objects, checksums verified either way.

    python -m benchmarks.gcs_fetch --mb 256 --files 2

The emulator serves from this machine's disk through one Python process, so the absolute MB/s say little about
Cloud Storage; the comparison of the two ways is the point. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gcs_fetch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="total object size")
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))
    from gcs_emulator import start_emulator

    from model.loading import checkpoint

    rows = {}
    with start_emulator() as emulator, tempfile.TemporaryDirectory() as tmp:
        bucket = "fetch-bench"
        emulator.client().create_bucket(bucket)
        per_file = args.mb * 2**20 // args.files
        block = os.urandom(2**20)
        for i in range(args.files):
            emulator.upload_bytes(f"gs://{bucket}/ckpt/part-{i}.safetensors", block * (per_file // 2**20))
        ways = {"one stream per object": dict(_SLICE=1 << 62, _SLICE_THREADS=1),
                "sliced ranges (default)": {}}
        saved = {k: getattr(checkpoint, k) for k in ("_SLICE", "_SLICE_THREADS")}
        for name, settings in ways.items():
            times = []
            for r in range(args.repeats):
                for k, v in {**saved, **settings}.items():
                    setattr(checkpoint, k, v)
                cache = os.path.join(tmp, f"cache-{len(rows)}-{r}")
                start = time.perf_counter()
                checkpoint.resolve_checkpoint(f"gs://{bucket}/ckpt", cache_dir=cache)
                times.append(time.perf_counter() - start)
                shutil.rmtree(cache)
            best = min(times)
            rows[name] = {"seconds": best, "mb_per_s": args.mb / best}
        for k, v in saved.items():
            setattr(checkpoint, k, v)
    for name, r in rows.items():
        print(f"{name:26s} {r['seconds']:7.2f} s  {r['mb_per_s']:8.1f} MB/s")
    result = {"mb": args.mb, "files": args.files, "ways": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
