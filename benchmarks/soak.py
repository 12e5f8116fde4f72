"""Soak: many requests through the multi-process DirectRunner against the local GCS emulator, with faults on.

    python benchmarks/soak.py                          # 5,000 requests (long: tens of minutes on 2 cores)
    python benchmarks/soak.py --requests 600 --workers 2

What runs: `pipeline.run.run()` (FnApiRunner, --direct_running_mode=multi_processing) on the tiny random-weight
checkpoint (copied from gs:// once per machine, like a real worker), prompts in several JSONL files on gs://,
images/manifest/errors written back to gs://, every GCS request through tests/support/fault_proxy.py at --gcs_fault_rate
(503/429/connection reset/delay, by request kind), a fraction of inference batches failing with an injected
transient error (tests/support/fault_jobs.py FaultyHandler), and planted invalid records.

Reports (stdout and <out>.json):
- throughput: images/s over the whole job and over the inference phase (first to last image);
- memory: RSS of every SDK worker process sampled over time, its peak, its value at the end of warm-up (when 20%
  of the images exist) and its growth after warm-up (MB, and MB per 1,000 images by least squares);
- the count check: valid requests = images + failed-image error rows, invalid records = invalid rows, and zero
  duplicates (every manifest file name once, every error row's image once, the two sets disjoint, every manifest
  row's object present with the manifest's sha256);
- faults injected per request kind and action, the retries the proxy saw, and the retries the job reported.
Exits 1 when the count check fails.

Not part of CI (tests/pipeline/test_soak.py runs a small one and is marked slow).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests", "support")  # fault_proxy, fault_jobs, gcs_emulator
for _p in (REPO, TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

SIZE, STEPS = 32, 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=5000, help="valid requests (each one image)")
    p.add_argument("--invalid_every", type=int, default=250, help="plant one invalid record every N lines (0: none)")
    p.add_argument("--files", type=int, default=4, help="prompt files the requests are spread over")
    p.add_argument("--workers", type=int, default=2, help="--direct_num_workers (SDK worker processes)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--gcs_fault_rate", type=float, default=0.02, help="fraction of GCS requests faulted")
    p.add_argument("--inference_fault_rate", type=float, default=0.02, help="fraction of batches that raise")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sample_s", type=float, default=1.0, help="memory/progress sampling period")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "soak"),
                   help="result path prefix (.json is appended)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- sampling
class Sampler(threading.Thread):
    """Every `period` s: images stored so far, and the RSS of this process and of every SDK worker process."""

    def __init__(self, emulator, bucket: str, prefix: str, period: float):
        super().__init__(daemon=True, name="soak-sampler")
        import psutil

        self._psutil = psutil
        self._storage = emulator._server._storage
        self._bucket, self._prefix, self._period = bucket, prefix, period
        self._stop_event = threading.Event()
        self.samples: list[dict] = []  # {"t", "images", "rss": {pid: bytes}, "launcher_rss"}
        self.roles: dict[int, str] = {}

    def _images(self) -> int:
        for _ in range(5):
            try:
                names = list(self._storage.objects.get(self._bucket, {}))
                return sum(1 for n in names if n.startswith(self._prefix))
            except RuntimeError:  # the emulator thread changed the dict while we copied it
                continue
        return -1

    def run(self):
        me = self._psutil.Process()
        start = time.monotonic()
        deadline = start + 24 * 3600
        while not self._stop_event.is_set() and time.monotonic() < deadline:
            rss = {}
            try:
                children = me.children(recursive=True)
            except self._psutil.Error:
                children = []
            for child in children:
                try:
                    cmd = child.cmdline()
                    # the worker itself (python -m ...sdk_worker_main), not a shell wrapping it
                    if not any("sdk_worker_main" in c for c in cmd) or "python" not in os.path.basename(cmd[0]):
                        continue
                    rss[child.pid] = child.memory_info().rss
                    self.roles[child.pid] = "sdk_worker"
                except self._psutil.Error:
                    continue
            self.samples.append({"t": round(time.monotonic() - start, 2), "images": self._images(), "rss": rss,
                                 "launcher_rss": me.memory_info().rss})
            self._stop_event.wait(self._period)

    def stop(self):
        self._stop_event.set()
        self.join(timeout=10)


def memory_report(samples: list[dict], total_images: int) -> dict:
    """Per worker: peak RSS, RSS at the end of warm-up (20% of the images stored), growth after it."""
    warm_at = max(1, int(0.2 * total_images))
    per_pid: dict[int, list[tuple[float, int, int]]] = collections.defaultdict(list)
    for s in samples:
        for pid, rss in s["rss"].items():
            per_pid[pid].append((s["t"], s["images"], rss))
    out = {}
    for pid, series in per_pid.items():
        peak = max(r for _, _, r in series)
        warm = [r for _, n, r in series if n >= warm_at]
        after = [(n, r) for _, n, r in series if n >= warm_at]
        slope = None
        if len(after) >= 3 and after[-1][0] > after[0][0]:
            xs = [n for n, _ in after]
            ys = [r for _, r in after]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            if var:
                slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var * 1000 / 1e6  # MB per 1000 images
        out[str(pid)] = {
            "samples": len(series),
            "peak_rss_mb": round(peak / 1e6, 1),
            "rss_at_warmup_end_mb": round(warm[0] / 1e6, 1) if warm else None,
            "max_rss_after_warmup_mb": round(max(warm) / 1e6, 1) if warm else None,
            "growth_after_warmup_mb": round((max(warm) - warm[0]) / 1e6, 1) if warm else None,
            "slope_mb_per_1000_images": round(slope, 2) if slope is not None else None,
            "rss_over_time_mb": [(t, n, round(r / 1e6, 1)) for t, n, r in series[:: max(1, len(series) // 40)]],
        }
    return out


# --------------------------------------------------------------------------------------------- inputs
def write_inputs(emulator, bucket: str, n: int, files: int, invalid_every: int) -> tuple[list[str], int]:
    """N valid requests (ids s00000...) over `files` JSONL files, plus planted invalid lines; returns
    (the valid ids, the number of invalid lines)."""
    lines = [[] for _ in range(files)]
    ids, invalid, written = [], 0, 0
    for i in range(n):
        f = i % files
        rid = f"s{i:05d}"
        ids.append(rid)
        lines[f].append(json.dumps({"id": rid, "prompt": f"soak prompt {i}: a {['red', 'green', 'blue'][i % 3]} "
                                                          f"house by a lake, number {i}"}))
        written += 1
        if invalid_every and written % invalid_every == 0:
            lines[f].append(json.dumps({"id": f"bad{i:05d}", "prompt": "x", "height": 7}))
            invalid += 1
    for f, content in enumerate(lines):
        emulator.upload_bytes(f"gs://{bucket}/in/prompts-{f}.jsonl", ("\n".join(content) + "\n").encode())
    return ids, invalid


# --------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    from gcs_emulator import start_emulator

    emulator = start_emulator()  # sets STORAGE_EMULATOR_HOST, NO_GCE_CHECK and the workers' sitecustomize
    import fault_jobs
    from fault_proxy import FaultProxy, FaultRule
    from tiny_klein import ensure_demo_checkpoint
    from pipeline.run import run

    bucket = emulator.new_bucket("soak")
    b = f"gs://{bucket}"
    ckpt = ensure_demo_checkpoint()
    emulator.upload_dir(ckpt, f"{b}/models/tiny")
    ids, n_invalid = write_inputs(emulator, bucket, args.requests, args.files, args.invalid_every)
    work = tempfile.mkdtemp(prefix="soak-")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), REPO, TESTS) if p)
    fault_jobs.install_handler(None, fault_jobs.FaultyHandler, fail_rate=args.inference_fault_rate,
                               fault_seed=args.seed)

    kinds = ("read", "list", "upload", "copy", "delete", "batch")
    rules = [FaultRule(fraction=args.gcs_fault_rate, kinds={k}, actions=("503", "429", "reset", "delay"),
                       delay_s=0.2) for k in kinds] if args.gcs_fault_rate > 0 else []
    proxy = FaultProxy(emulator.host, seed=args.seed, rules=rules).start()
    emulator.client()  # the checks below read straight from the emulator
    os.environ["STORAGE_EMULATOR_HOST"] = proxy.url

    sampler = Sampler(emulator, bucket, "out/images/", args.sample_s)
    argv = [f"--model={b}/models/tiny", f"--input={b}/in/*.jsonl", f"--output={b}/out", f"--height={SIZE}",
            f"--width={SIZE}", f"--num_inference_steps={STEPS}", "--dtype=float32", "--max_sequence_length=32",
            f"--batch_size={args.batch_size}", f"--seed={args.seed}",
            f"--checkpoint_cache_dir={os.path.join(work, 'ckpt')}",
            f"--compilation_cache_dir={os.path.join(work, 'xla')}", "--runner=FnApiRunner",
            "--direct_running_mode=multi_processing", f"--direct_num_workers={args.workers}", "--no_progress"]
    print(f"soak: {args.requests} requests (+{n_invalid} invalid) in {args.files} files, {args.workers} worker "
          f"processes, batch {args.batch_size}, GCS faults {args.gcs_fault_rate:.1%}, inference faults "
          f"{args.inference_fault_rate:.1%}", flush=True)
    sampler.start()
    start = time.monotonic()
    error = None
    summary = None
    try:
        _, summary = run(argv)
    except Exception as e:  # noqa: BLE001 - reported below, the count check still runs
        error = f"{type(e).__name__}: {e}"
    wall = time.monotonic() - start
    sampler.stop()
    stats = proxy.stats()
    proxy.clear_rules()
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.host

    # ---- the count check, from what is stored
    out = fault_jobs.JobOutputs(emulator, f"{b}/out")
    manifest, errors = out.rows("manifest"), out.rows("errors")
    blobs = out.blobs()
    stored_images = {n.split("/out/", 1)[-1] if "/out/" in n else n[len("out/"):] for n in blobs
                     if n.startswith("out/images/")}
    manifest_names = [r["file_name"] for r in manifest]
    failed_names = [e["file_name"] for e in errors if e.get("kind") == "inference_failed"]
    invalid_rows = [e for e in errors if e.get("kind") == "invalid_record"]
    expected = {f"images/{i}.png" for i in ids}
    dup_manifest = len(manifest_names) - len(set(manifest_names))
    dup_failed = len(failed_names) - len(set(failed_names))
    overlap = set(manifest_names) & set(failed_names)
    sha_bad = 0
    for row in manifest[:: max(1, len(manifest) // 200)]:  # spot-check up to ~200 objects' bytes
        data = emulator.read_bytes(f"{b}/out/{row['file_name']}")
        sha_bad += hashlib.sha256(data).hexdigest() != row["sha256"]
    lost = expected - set(manifest_names) - set(failed_names)
    checks = {
        "requests": len(ids),
        "images": len(set(manifest_names)),
        "stored_image_objects": len(stored_images),
        "failed_image_rows": len(set(failed_names)),
        "invalid_rows": len(invalid_rows),
        "invalid_planted": n_invalid,
        "requests_eq_images_plus_errors": len(ids) == len(set(manifest_names)) + len(set(failed_names)),
        "lost": len(lost),
        "duplicates": dup_manifest + dup_failed + len(overlap),
        "unexpected": len((set(manifest_names) | set(failed_names)) - expected),
        "images_without_manifest_row": len(stored_images - set(manifest_names)),
        "sha256_mismatches_in_spot_check": sha_bad,
    }
    ok = (error is None and checks["requests_eq_images_plus_errors"] and not checks["lost"]
          and not checks["duplicates"] and not checks["unexpected"] and checks["invalid_rows"] == n_invalid
          and not checks["images_without_manifest_row"] and not sha_bad)

    times = [s["t"] for s in sampler.samples if s["images"] > 0]
    first_t = times[0] if times else None
    last = next((s for s in reversed(sampler.samples) if s["images"] >= len(stored_images)), None)
    infer_s = (last["t"] - first_t) if (last and first_t is not None and last["t"] > first_t) else None
    memory = memory_report(sampler.samples, len(stored_images))
    result = {
        "config": vars(args),
        "ok": ok,
        "error": error,
        "wall_s": round(wall, 1),
        "images_per_s_job": round(len(stored_images) / wall, 2),
        "images_per_s_inference_phase": round(len(stored_images) / infer_s, 2) if infer_s else None,
        "first_image_after_s": first_t,
        "summary": summary,
        "checks": checks,
        "faults": {"gcs": stats, "inference_batches_failed_rows": len(set(failed_names))},
        "memory_per_worker": memory,
        "launcher_peak_rss_mb": round(max((s["launcher_rss"] for s in sampler.samples), default=0) / 1e6, 1),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    path = args.out + ".json"
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    proxy.stop()
    emulator.stop()

    print(f"soak: {'OK' if ok else 'FAILED'} in {wall:.0f} s; {checks['images']} images, "
          f"{checks['failed_image_rows']} failed, {checks['invalid_rows']} invalid, lost {checks['lost']}, "
          f"duplicates {checks['duplicates']}; {result['images_per_s_job']} images/s overall, "
          f"{result['images_per_s_inference_phase']} images/s once generating")
    print(f"soak: GCS faults injected {stats['injected_total']} ({stats['injected_by_kind']}; "
          f"{stats['injected_by_action']}), retries seen {stats['retries_total']}, unretried "
          f"{stats['unretried_faults']}")
    if summary:
        print(f"soak: retries the job reported (summary.json): {summary.get('retries')}")
    for pid, m in memory.items():
        print(f"soak: worker {pid}: peak RSS {m['peak_rss_mb']} MB, at warm-up end {m['rss_at_warmup_end_mb']} MB, "
              f"growth after warm-up {m['growth_after_warmup_mb']} MB, slope {m['slope_mb_per_1000_images']} "
              f"MB/1000 images")
    if error:
        print(f"soak: job error: {error[:2000]}")
    print(f"soak: results in {path}")
    print(json.dumps({k: result[k] for k in ("ok", "wall_s", "images_per_s_job", "images_per_s_inference_phase")}
                     | {"checks": checks}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
