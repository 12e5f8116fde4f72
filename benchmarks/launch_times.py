"""A launch as a new user runs it on a TPU machine: `python -m pipeline.run` with the v5e settings' options (without
the Dataflow-only ones), no --batch_size (auto: the launch's TPU preflight picks it), a few prompts, timed from the
command's start to its first image on disk.

    python -m benchmarks.launch_times --preset klein-4b --height 1024 --width 1024 --prompts 8     # a TPU chip
    python -m benchmarks.launch_times ... --runs bf16_cold,bf16_warm,int8_warm --out launch-logs

For each weights kind (bf16, int8) it runs the same command twice: with an empty compilation cache and preflight
answer store (`cold`: the preflight compiles, the job's compile should find its programs in the cache), then again
with both filled (`warm`: the answer is stored, so the launch compiles nothing for the check). `--runs` picks some of
them (e.g. `bf16_cold,bf16_warm,int8_warm`); a warm run whose cold one is not picked has its store and cache filled
first by the same command with `--dry_run` (untimed: the launch's preflight compiles and stores its answer, nothing
is generated), so the job's small programs (the loader's) compile in that warm run (its xla_compiles says how many).

Each job runs with the model's, the launch's and the handler's INFO lines (Beam's stay at WARNING); every line of its
output is kept, with the seconds since the command started, in `--out`/<run>.log. Per run it prints the seconds to
each phase: the launch's preflight line, the model loaded, the first bucket compiled (or loaded from the cache), the
first image on disk, and the job's compilations and cache hits. Prints a table and, last, one JSON line. A
measurement tool: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
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
# Where a run's time goes: the first line matching each, in the job's output.
PHASES = (("preflight_s", re.compile(r"^TPU preflight: fits ")),
          ("model_loaded_s", re.compile(r"model\.engine\.generator: loaded ")),
          ("first_compile_s", re.compile(r"model\.engine\.programs: compiled bucket ")))
METRIC = re.compile(r"\b(xla_compiles|xla_cache_hits|xla_lease_waits)=(\d+)")
# The job's own loggers shown at INFO (`--job` mode): the launch, the model's load and compiles, the handler's.
INFO_LOGGERS = ("pipeline", "model", "transforms")
RUN_NAMES = ("bf16_cold", "bf16_warm", "int8_cold", "int8_warm")
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
    ap.add_argument("--settings", default="tpu-v5e", help="the settings file whose options the run takes ('none': "
                    "none, e.g. to try this tool on a CPU)")
    ap.add_argument("--job_args", default="", help="more options for the job, e.g. '--dtype=float32'")
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--weights", default="bf16,int8", help="comma-separated: bf16, int8")
    ap.add_argument("--runs", default=",".join(RUN_NAMES),
                    help=f"comma-separated, of {', '.join(RUN_NAMES)} (only those of --weights)")
    ap.add_argument("--out", default="launch-times", help="folder for each run's log (<run>.log)")
    ap.add_argument("--timeout-s", type=float, default=300, help="stop a run after this long")
    return ap.parse_args(argv)


def run_job(argv: list[str]) -> None:
    """`python -m pipeline.run ARGV` with INFO_LOGGERS' lines shown (pipeline.run's own logging setup then keeps
    this one): the model's load and compile lines mark the phases."""
    import logging
    import runpy

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.WARNING)
    for name in INFO_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    sys.argv = ["pipeline.run", *argv]
    runpy.run_module("pipeline.run", run_name="__main__", alter_sys=True)


def first_image(folder: str) -> str | None:
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(IMAGE_SUFFIXES):
                return os.path.join(root, name)
    return None


def timed_run(cmd: list[str], output: str, timeout_s: float, log_path: str) -> dict:
    """Run `cmd`; seconds from its start to each phase (PHASES), the first image under `output/images` and its end,
    the batch it picked and its compile counts; every line of its output, with its time, written to `log_path`."""
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # each line as it is written: its time is when it was said
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic() - start, line) for line in proc.stdout),
                              daemon=True)
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
    with open(log_path, "w") as f:
        f.writelines(f"{t:8.2f} {line}" for t, line in lines)
    text = "".join(line for _, line in lines)
    phases = {name: next((round(t, 2) for t, line in lines if pattern.search(line)), None)
              for name, pattern in PHASES}
    picked = PICKED.findall(text)
    return {**phases, "first_image_s": first, "end_s": end, "exit": proc.returncode,
            "batch": int(picked[-1][2]) if picked else None, "answer": picked[-1][3] if picked else None,
            **{k: int(v) for k, v in METRIC.findall(text)}, "log": log_path,
            "tail": text[-3000:] if proc.returncode else ""}


def wanted_runs(weights: str, runs: str) -> list[tuple[str, str]]:
    """(weights, cold|warm) of each run to time, in order; ValueError naming an unknown run."""
    names = [r for r in runs.split(",") if r]
    unknown = [r for r in names if r not in RUN_NAMES]
    if unknown:
        raise ValueError(f"unknown --runs {unknown}; choose from {', '.join(RUN_NAMES)}")
    kinds = [w for w in weights.split(",") if w]
    return [(w, run) for w in kinds for run in ("cold", "warm") if f"{w}_{run}" in names]


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--job"]:  # the timed command itself: the job's own arguments follow
        return run_job(argv[1:])
    args = parse_args(argv)
    from . import presets

    runs = wanted_runs(args.weights, args.runs)
    model = args.model or presets.ensure_checkpoint(args.preset)
    options = settings_options(args.settings) if args.settings != "none" else []
    options += shlex.split(args.job_args)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="launch-times-") as tmp:
        prompts = os.path.join(tmp, "prompts.txt")
        with open(prompts, "w") as f:
            f.write("".join(f"a photo of a red fox in the snow, number {i}\n" for i in range(args.prompts)))
        for weights, run in runs:
            cache = os.path.join(tmp, f"cache-{weights}")  # the compilation cache and the answers beside it
            output = os.path.join(tmp, f"out-{weights}-{run}")
            cmd = [sys.executable, "-m", "benchmarks.launch_times", "--job", f"--model={model}", f"--input={prompts}",
                   f"--output={output}", f"--height={args.height}", f"--width={args.width}",
                   f"--compilation_cache_dir={cache}", *options, *(["--quantize=int8"] if weights == "int8" else [])]
            if run == "warm" and not os.path.isdir(cache):  # its cold run not picked: fill the store first
                print(f"[launch_times] {weights} prefill: {' '.join(cmd)} --dry_run", file=sys.stderr, flush=True)
                filled = timed_run([*cmd, "--dry_run"], output, args.timeout_s,
                                   os.path.join(args.out, f"{weights}_prefill.log"))
                print(f"[launch_times] {weights} prefill: {json.dumps(filled)}", file=sys.stderr, flush=True)
                shutil.rmtree(output, ignore_errors=True)
            print(f"[launch_times] {weights} {run}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            key = f"{weights}_{run}"
            results[key] = timed_run(cmd, output, args.timeout_s, os.path.join(args.out, f"{key}.log"))
            print(f"[launch_times] {key}: {json.dumps(results[key])}", file=sys.stderr, flush=True)
            shutil.rmtree(output, ignore_errors=True)
    print(format_table(results))
    result = {"model": model, "settings": args.settings, "options": options, "height": args.height,
              "width": args.width, "prompts": args.prompts, "runs": results}
    print(json.dumps(result))
    return result


def _s(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(results: dict) -> str:
    """One row per run: the seconds to each phase from the command's start, the batch, the compile counts."""
    rows = [("run", "preflight s", "model loaded s", "first compile s", "first image s", "end s", "batch",
             "compiles", "cache hits", "preflight answer", "exit")]
    for key, r in results.items():
        rows.append((key, _s(r["preflight_s"]), _s(r["model_loaded_s"]), _s(r["first_compile_s"]),
                     _s(r["first_image_s"]), _s(r["end_s"]), str(r["batch"]), str(r.get("xla_compiles", 0)),
                     str(r.get("xla_cache_hits", 0)), str(r["answer"]), str(r["exit"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


if __name__ == "__main__":
    main()
