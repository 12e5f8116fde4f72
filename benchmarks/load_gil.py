"""Placing weights beside a precompile, by GIL switch interval: each row is a fresh process that loads a preset with
its programs compiling meanwhile (forced on CPU here, as on accelerators) and reports the placing's wall time.

    python -m benchmarks.load_gil --preset small --intervals-ms 5 0.25 0.1

A measurement tool: nothing here is asserted. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import json, sys, tempfile, time
import model, model.generator as g
from model.options import EngineOptions, LoadSettings
path, size, interval, precompile = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
g.PRECOMPILE_PLATFORMS = ("cpu", "tpu", "gpu")
g.LOADING_SWITCH_INTERVAL_S = interval / 1e3
start = time.perf_counter()
gen = model.load(LoadSettings(model=path, dtype="bfloat16", max_sequence_length=512,
                              engine=EngineOptions(batch_size=1, compilation_cache_dir=tempfile.mkdtemp()),
                              precompile=((size, size, None, None),) if precompile else ()))
print(json.dumps({"load_s": time.perf_counter() - start, "placing_wall_s": gen.load_phases["wall_s"]}))
'''


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.load_gil", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--size", type=int, default=256, help="the precompiled square size")
    ap.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 0.25, 0.1])
    args = ap.parse_args(argv)
    from . import presets

    path = presets.ensure_checkpoint(args.preset)
    rows = []
    for precompile, interval in [(False, 5.0)] + [(True, i) for i in args.intervals_ms]:
        done = subprocess.run([sys.executable, "-c", CHILD, path, str(args.size), str(interval), str(int(precompile))],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"load failed:\n{done.stderr[-3000:]}")
        row = dict(precompile=precompile, switch_ms=interval, **json.loads(done.stdout.strip().splitlines()[-1]))
        rows.append(row)
        print(f"precompile {str(precompile):5}  switch {interval:5.2f} ms  placing {row['placing_wall_s']:6.2f} s  "
              f"load {row['load_s']:6.2f} s", flush=True)
    result = {"preset": args.preset, "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
