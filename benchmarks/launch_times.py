"""A launch as a new user runs it on a TPU machine: `python -m pipeline.run` with the v5e settings' options (without
the Dataflow-only ones), no --batch_size (auto: the launch's TPU preflight picks it), a few prompts, timed from the
command's start to its first image on disk.

    python -m benchmarks.launch_times --preset klein-4b --height 1024 --width 1024 --prompts 8     # a TPU chip

For each weights kind (bf16, int8) it runs the same command twice: with an empty compilation cache and preflight
answer store (`cold`: the preflight compiles, the job's compile should find its programs in the cache), then again
with both filled (`warm`: the answer is stored, so the launch compiles nothing for the check). Prints a table and,
last, one JSON line. A measurement tool: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

# Options of a settings file that only a Dataflow job takes (its machines, disks, container).
DATAFLOW_ONLY = ("machine_type", "dataflow_service_options", "disk_size_gb", "max_num_workers",
                 "sdk_container_image", "sdk_location")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
PICKED = re.compile(r"TPU preflight: fits (\S+) with (\d+) model shard\(s\) at batch (\d+)[^\n]*\(([^)]*)\)\s*$", re.M)


def settings_options(name: str) -> list[str]:
    """The settings file's pipeline options for a run on this machine: the Dataflow-only ones dropped."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates"))
    try:
        import settings
    finally:
        sys.path.pop(0)
    options = settings.load(name, "unused:tpu-0", "unused", "unused-a").beam_args()
    return [o for o in options if o.partition("=")[0].lstrip("-") not in DATAFLOW_ONLY]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.launch_times", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="klein-4b", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of the preset's")
    ap.add_argument("--settings", default="tpu-v5e", help="the settings file whose options the run takes")
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--weights", default="bf16,int8", help="comma-separated: bf16, int8")
    ap.add_argument("--timeout-s", type=float, default=300, help="stop a run after this long")
    return ap.parse_args(argv)


def first_image(folder: str) -> str | None:
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(IMAGE_SUFFIXES):
                return os.path.join(root, name)
    return None


def timed_run(cmd: list[str], output: str, timeout_s: float) -> dict:
    """Run `cmd`; seconds from its start to the first image under `output/images` and to its end, its output."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    first = None
    while proc.poll() is None and time.monotonic() - start < timeout_s:
        if first is None and first_image(os.path.join(output, "images")):
            first = time.monotonic() - start
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    end = time.monotonic() - start
    reader.join(5)
    if first is None and first_image(os.path.join(output, "images")):
        first = end
    text = "".join(lines)
    picked = PICKED.findall(text)
    return {"first_image_s": first, "end_s": end, "exit": proc.returncode,
            "batch": int(picked[-1][2]) if picked else None, "answer": picked[-1][3] if picked else None,
            "tail": text[-3000:] if proc.returncode else ""}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from . import presets

    model = args.model or presets.ensure_checkpoint(args.preset)
    options = settings_options(args.settings)
    results = {}
    with tempfile.TemporaryDirectory(prefix="launch-times-") as tmp:
        prompts = os.path.join(tmp, "prompts.txt")
        with open(prompts, "w") as f:
            f.write("".join(f"a photo of a red fox in the snow, number {i}\n" for i in range(args.prompts)))
        for weights in [w for w in args.weights.split(",") if w]:
            cache = os.path.join(tmp, f"cache-{weights}")  # the compilation cache and the answers beside it
            for run in ("cold", "warm"):
                output = os.path.join(tmp, f"out-{weights}-{run}")
                cmd = [sys.executable, "-m", "pipeline.run", f"--model={model}", f"--input={prompts}",
                       f"--output={output}", f"--height={args.height}", f"--width={args.width}",
                       f"--compilation_cache_dir={cache}", *options,
                       *(["--quantize=int8"] if weights == "int8" else [])]
                print(f"[launch_times] {weights} {run}: {' '.join(cmd)}", file=sys.stderr, flush=True)
                results[f"{weights}_{run}"] = timed_run(cmd, output, args.timeout_s)
                print(f"[launch_times] {weights} {run}: {json.dumps(results[f'{weights}_{run}'])}", file=sys.stderr,
                      flush=True)
                shutil.rmtree(output, ignore_errors=True)
    rows = [("run", "first image s", "command end s", "batch", "preflight answer", "exit")]
    for key, r in results.items():
        first = "-" if r["first_image_s"] is None else f"{r['first_image_s']:.1f}"
        rows.append((key, first, f"{r['end_s']:.1f}", str(r["batch"]), str(r["answer"]), str(r["exit"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows))
    result = {"model": model, "settings": args.settings, "options": options, "height": args.height,
              "width": args.width, "prompts": args.prompts, "runs": results}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
