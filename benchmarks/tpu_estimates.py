"""The compiler's estimates for klein-4B and klein-9B on TPU machine types: a markdown table and a JSON line.

For each model and topology the preflight (pipeline/preflight.py) compiles the real programs at batch 1 (with the
fewest model shards that fit), then searches the largest batch that fits at that shard count as `--batch_size auto`
does (model/preflight/batch_search.py: a line through the bytes of the batches compiled so far predicts the next batch
to try, and each prediction is compiled to check it). Every figure is the compiler's estimate from XLA's cost analysis
plus attention at the chip's bf16 peak, not a measurement; the published 430 ms per image (klein-9B on one TPU v7 chip) stands beside it for comparison.

    python -m benchmarks.tpu_estimates [--models klein-4b,klein-9b] [--topologies v5e:1x1,...] [--max_batch 16]

The README's sizing table is made from the preflight's own reports instead (benchmarks/sizing_table.py).

Compiling the real models takes minutes per program on a small machine: run it in the background.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from model import GiB, Report
from pipeline.preflight import PreflightRequest, preflight

DEFAULT_MODELS = ("klein-4b", "klein-9b")
# v5e-1, v5e-4, v6e-1, v6e-4 and one TPU v7 chip (libtpu names it tpu7x; each chip is two devices).
DEFAULT_TOPOLOGIES = ("v5e:1x1", "v5e:2x2", "v6e:1x1", "v6e:2x2", "tpu7x:1x1")
# Black Forest Labs' figure for klein-9B: seconds per 1024x1024 image, 4 steps, on one TPU v7 chip.
PUBLISHED = {("klein-9b", "TPU v7", 1): 0.430}


def picked_batch(request: PreflightRequest, first: Report, max_batch: int) -> Report:
    """The largest batch up to `max_batch` per data replica that fits at `first`'s shard count: the preflight's own
    search (--batch_size auto, model.preflight.batch_search), which reuses what `first` compiled."""
    return preflight(dataclasses.replace(request, batch_size=None, model_shards=first.model_shards,
                                         max_batch_size=max_batch * first.data_replicas))


def row(report: Report, label: str) -> dict:
    """One table row: the report's headline figures."""
    data = report.to_json()
    flops = sum(float("nan") if p["flops"] is None else p["flops"] for p in data["programs"].values())
    published = PUBLISHED.get((report.model, report.topology.chip.name, report.topology.chips))
    return {"model": report.model, "topology": report.topology.name, "chip": report.topology.chip.name,
            "chips": report.topology.chips, "row": label, "batch": report.batch, "model_shards": report.model_shards,
            "fits": report.fits, "peak_gib_per_chip": report.peak_bytes_per_chip / GiB,
            "hbm_gib_per_chip": report.hbm_bytes_per_chip / GiB, "est_seconds_per_image": report.est_seconds_per_image,
            "images_per_hour": data["images_per_hour_per_host"], "tflop_per_image": flops / 1e12,
            "bf16_peak_tflops_per_chip": report.topology.chip.bf16_flops / 1e12,
            "seconds_at_peak": report.seconds_at_peak_per_image,
            "published_seconds_per_image": published, "report": data}


def markdown(rows: list[dict], height: int, width: int, steps: int, max_batch: int) -> str:
    """The table, titled as what it is: calibrated on v5e, measured on no chip it lists."""
    out = [f"Preflight estimates (the compiler's FLOPs and bytes at the efficiencies measured on a TPU v5e chip; "
           f"calibrated on v5e, not measured on these configurations), "
           f"{height}x{width}, {steps} steps, bfloat16; best batch searched up to {max_batch} per data replica:", "",
           "| model | topology (chip) | row | batch | shards | fits | peak / HBM per chip | est s/image | images/h "
           "| TFLOP/image | bf16 peak TF/s/chip | s/image at peak | published s/image |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['topology']} | failed: {r['error'].splitlines()[0]} |" + " |" * 10)
            continue
        published = f"{r['published_seconds_per_image']:.3f}" if r["published_seconds_per_image"] else ""
        per_hour = f"{r['images_per_hour']:,.0f}" if r["images_per_hour"] else "n/a"
        out.append(f"| {r['model']} | {r['topology']} ({r['chips']} x {r['chip']}) | {r['row']} | {r['batch']} | "
                   f"{r['model_shards']} | {'yes' if r['fits'] else 'no'} | {r['peak_gib_per_chip']:.1f} / "
                   f"{r['hbm_gib_per_chip']:.1f} GiB | {r['est_seconds_per_image']:.3f} | "
                   f"{per_hour} | {r['tflop_per_image']:.1f} | "
                   f"{r['bf16_peak_tflops_per_chip']:,.0f} | {r['seconds_at_peak']:.3f} | {published} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tpu_estimates", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--topologies", default=",".join(DEFAULT_TOPOLOGIES))
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--num_inference_steps", type=int, default=4)
    parser.add_argument("--max_batch", type=int, default=16, help="Largest batch per data replica to try.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = []
    for model in args.models.split(","):
        for topology in args.topologies.split(","):
            start = time.perf_counter()
            request = PreflightRequest(model=model, topology=topology, height=args.height, width=args.width,
                                       batch_size=1, num_inference_steps=args.num_inference_steps)
            try:
                first = preflight(request)
                rows.append(row(first, "batch 1"))
                if first.fits:
                    best = picked_batch(request, first, args.max_batch)
                    if best.batch != first.batch:
                        rows.append(row(best, "best batch"))
            except Exception as e:  # noqa: BLE001 - one machine type failing to compile must not lose the others
                logging.exception("%s on %s failed", model, topology)
                rows.append({"model": model, "topology": topology, "error": f"{type(e).__name__}: {e}"[:300]})
            logging.info("%s on %s done in %.0f s", model, topology, time.perf_counter() - start)
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "report"}), file=sys.stderr, flush=True)
    print(markdown(rows, args.height, args.width, args.num_inference_steps, args.max_batch))
    print(json.dumps({"estimate": "compiler", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
