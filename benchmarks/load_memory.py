"""Peak host RSS and time of `model.load` for a real-size checkpoint (random weights), in a fresh process.

    python -m benchmarks.load_memory --preset klein-4b --dtype bfloat16 --dir /tmp/klein-4b-random
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="klein-4b", choices=["klein-4b", "klein-9b"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--dir", default=None, help="where to write (or reuse) the random checkpoint")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    path = args.dir or f"/tmp/{args.preset}-random"
    if args.child:
        import model

        start = time.perf_counter()
        gen = model.load(path, dtype=args.dtype, max_sequence_length=512)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB
        n = sum(int(v.size) for m in gen.programs.modules() for v in __import__("jax").tree.leaves(
            __import__("flax").nnx.state(m)))
        print(json.dumps({"preset": args.preset, "dtype": args.dtype, "load_seconds": round(seconds, 1),
                          "peak_rss_gib": round(peak, 2), "loaded_parameters": n}))
        return
    if not os.path.exists(os.path.join(path, "model_index.json")):
        from benchmarks.realsize import build_realsize_checkpoint

        t = time.perf_counter()
        build_realsize_checkpoint(path, args.preset)
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    out = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", "--child", "--preset", args.preset,
                          "--dtype", args.dtype, "--dir", path], check=True, capture_output=True, text=True)
    print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
