#!/usr/bin/env python3
"""Throughput, cost and `--max_num_workers` for a Dataflow run, from a benchmark's seconds per image.

    python3 templates/sizing.py --images 1000000 --seconds-per-image 1.2 --deadline-hours 8 \
        --startup-minutes 15 --price-per-worker-hour 2.50

The arithmetic (one model per worker, batches back to back once the worker is warm):

    images per worker-hour   R = 3600 / seconds_per_image
    workers for a deadline   W = ceil(N / (R * (deadline - startup)))
    wall time with W         T = startup + N / (W * R)
    worker-hours billed      W * T        (Dataflow bills each worker from VM start to VM stop)
    cost                     W * T * price_per_worker_hour;   per 1000 images: 1000 * price / R (warm)

Without a measurement, `--preflight FILE` takes the seconds per image (and the chips per worker) from the TPU
preflight's output (`python -m pipeline.preflight ... > FILE`; its last line is JSON): the compiler's estimate for
one worker host, which the output labels as such.

`startup` is what a new worker spends before its first image: VM and accelerator start, image pull, weights copy
(none when baked in), model load and XLA compilation (less with a warm --compilation_cache_dir).

TPU workers bill per chip-hour: Dataflow charges TPU chip-hours and no worker CPU or memory ("Dataflow support for
TPUs", Pricing), so a worker-hour of ct5lp-hightpu-4t costs 4 chip-hours. Give `--price-per-chip-hour` and
`--chips-per-worker` for TPU settings, `--price-per-worker-hour` (VM + GPU + disk) for GPU settings.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import NamedTuple, Optional, Sequence


class Plan(NamedTuple):
    images_per_worker_hour: float
    workers: int
    wall_hours: float
    worker_hours: float
    cost: Optional[float]
    cost_per_1000_images: Optional[float]


def plan(images: int, seconds_per_image: float, deadline_hours: float, startup_minutes: float = 15.0,
         price_per_worker_hour: Optional[float] = None, max_workers: Optional[int] = None) -> Plan:
    if images < 1 or seconds_per_image <= 0 or deadline_hours <= 0 or startup_minutes < 0:
        raise ValueError("images >= 1, seconds_per_image > 0, deadline_hours > 0 and startup_minutes >= 0")
    startup = startup_minutes / 60.0
    if deadline_hours <= startup:
        raise ValueError(f"the deadline ({deadline_hours} h) must exceed the worker start-up ({startup:.2f} h)")
    rate = 3600.0 / seconds_per_image
    workers = max(1, math.ceil(images / (rate * (deadline_hours - startup))))
    if max_workers is not None:
        workers = min(workers, max_workers)
    wall = startup + images / (workers * rate)
    worker_hours = workers * wall
    cost = None if price_per_worker_hour is None else worker_hours * price_per_worker_hour
    per_1000 = None if price_per_worker_hour is None else 1000.0 * price_per_worker_hour / rate
    return Plan(rate, workers, wall, worker_hours, cost, per_1000)


def read_preflight(path: str) -> dict:
    """The preflight report (the last JSON line of `python -m pipeline.preflight`'s output) in `path`."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError(f"{path} holds no preflight report (the JSON line python -m pipeline.preflight prints last)")
    report = json.loads(lines[-1])
    seconds = report.get("est_seconds_per_image")
    if not report.get("fits") or not seconds or seconds <= 0:
        raise ValueError(f"{path}: the preflight says {report.get('model')} does not fit {report.get('topology')} "
                         f"(or gave no estimate); size the job on settings that fit")
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, required=True, help="images to generate (records x num_images)")
    speed = ap.add_mutually_exclusive_group(required=True)
    speed.add_argument("--seconds-per-image", type=float,
                       help="steady-state seconds per image on ONE worker, from the benchmark on its accelerator")
    speed.add_argument("--preflight", metavar="FILE",
                       help="TPU: the output of python -m pipeline.preflight for the worker's topology (the "
                            "compiler's estimate of seconds per image per worker host, and its chips)")
    ap.add_argument("--deadline-hours", type=float, required=True)
    ap.add_argument("--startup-minutes", type=float, default=15.0)
    price = ap.add_mutually_exclusive_group()
    price.add_argument("--price-per-worker-hour", type=float, default=None,
                       help="GPU workers: VM + accelerator (+ disk) price of one worker for an hour, in your currency")
    price.add_argument("--price-per-chip-hour", type=float, default=None,
                       help="TPU workers: the TPU chip-hour price (Dataflow bills TPU jobs per chip-hour)")
    ap.add_argument("--chips-per-worker", type=int, default=None,
                    help="TPU chips per worker with --price-per-chip-hour: 1 for *-1t machines, 4 for *-4t "
                         "(default: the preflight's, else 1)")
    ap.add_argument("--quota-workers", type=int, default=None, help="cap from your accelerator quota")
    args = ap.parse_args(argv)
    try:
        seconds, chips, source = args.seconds_per_image, 1, None
        if args.preflight:
            report = read_preflight(args.preflight)
            seconds, chips = report["est_seconds_per_image"], report.get("chips", 1)
            source = (f"{report.get('model')} on {report.get('topology')}, {report.get('model_shards')} model "
                      f"shard(s), batch {report.get('batch')}")
            label = report.get("estimate") or "the TPU compiler's estimate"
        chips = args.chips_per_worker if args.chips_per_worker is not None else chips
        if chips < 1:
            raise ValueError(f"--chips-per-worker must be >= 1, got {chips}")
        worker_price = args.price_per_worker_hour
        if args.price_per_chip_hour is not None:
            worker_price = args.price_per_chip_hour * chips
        p = plan(args.images, seconds, args.deadline_hours, args.startup_minutes, worker_price, args.quota_workers)
    except (OSError, ValueError) as e:
        print(f"sizing.py: {e}", file=sys.stderr)
        return 2
    if source:
        print(f"seconds per image: {seconds:.3f} ({label} for {source}; not a measurement of it)")
    print(f"images per worker-hour: {p.images_per_worker_hour:,.0f}")
    print(f"workers (--max-workers): {p.workers}")
    late = " (past the deadline: quota-capped)" if p.wall_hours > args.deadline_hours + 1e-9 else ""
    print(f"wall time: {p.wall_hours:.2f} h{late}")
    print(f"worker-hours: {p.worker_hours:,.1f}")
    if args.price_per_chip_hour is not None:
        print(f"chip-hours: {p.worker_hours * chips:,.1f} (TPU jobs bill per chip-hour)")
    if p.cost is not None:
        print(f"cost: {p.cost:,.2f}  ({p.cost_per_1000_images:.3f} per 1000 images once warm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
