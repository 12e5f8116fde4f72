"""The README's TPU sizing table, made from the preflight's own reports (benchmarks/sizing_1024.json), never typed.

Each row of the JSON is one `python -m pipeline.preflight` run: its JSON report line (`report`), where and with which
compiler it was compiled (`compiled_on`) and a note. The README holds the table between SIZING_BEGIN and SIZING_END;
tests/benchmarks/test_sizing_table.py checks that it equals this module's output.

    python -m benchmarks.sizing_table                       # the table, with its markers, for README.md
    python -m pipeline.preflight --model=klein-4b --topology=v5e:1x1 --height=1024 --width=1024 > run.out
    python -m benchmarks.sizing_table --add run.out --compiled-on "CPU machine, libtpu 0.0.52" [--note TEXT]

`--add` puts the run's report in the JSON (in place of an earlier row for the same model, topology, size and batch
choice). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SIZING_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sizing_1024.json")
SIZING_BEGIN = "<!-- sizing:begin -->"
SIZING_END = "<!-- sizing:end -->"
GiB = 1024**3


# List prices per chip-hour (Dataflow bills TPU jobs by the chip-hour); v6e's is assumed (docs/performance.md).
PRICES = {"TPU v5e": 1.20, "TPU v6e": 2.70}


def estimate(report: dict) -> float:
    """Seconds per image per worker by the current calibration (model.preflight.estimate) from the report's compiled
    figures, so a recalibration reaches every row that has them without compiling again (older rows keep their
    estimate)."""
    from model.preflight.estimate import V5E_CALIBRATION, ProgramStats, batch_term
    from model.preflight.fit_report import runs_flash_kernel
    from model.preflight.topology import CHIPS

    chip = next(spec for spec in CHIPS.values() if spec.name == report["chip"])
    flash = runs_flash_kernel(chip, report["devices"])
    seconds = 0.0
    per_device = report["batch"] / report["devices"]  # the report's figures are per image, the estimate's per device
    for name, p in report["programs"].items():
        kernel = p["kernel_flops"] * per_device
        stats = ProgramStats(name, 0, 0, 0, 0, 0, p["flops"] * per_device - kernel, p["bytes_accessed"] * per_device,
                             0.0, kernel, 0.0, 0, 1)
        seconds += stats.est_seconds(chip, report["devices_per_chip"], int8=report.get("quantize") == "int8",
                                     flash=flash)
    int8 = report.get("quantize") == "int8"
    per_replica = report.get("batch_per_replica", report["batch"] // report.get("data_replicas", 1))
    return (seconds / report["batch"] + V5E_CALIBRATION.host_seconds_per_image
            + batch_term(per_replica, int8=int8))


def _cell(row: dict) -> list[str]:
    r = row["report"]
    weights = "int8" if r.get("quantize") == "int8" else r.get("dtype", "bfloat16").replace("bfloat16", "bf16")
    machine = f"{r['chip'].replace('TPU ', '')} ({r['chips']})"
    memory = f"{r['peak_bytes_per_chip'] / GiB:.1f} of {r['hbm_bytes_per_chip'] / GiB:.0f}"
    if not r["fits"]:
        return [r["model"], machine, weights, "-", memory, "does not fit", "-", "estimated"]
    measured = row.get("measured_s_per_image")
    seconds = measured or (estimate(r) if "programs" in r else r["est_seconds_per_image"])
    price = PRICES.get(r["chip"])
    cost = f"{1000 * seconds * r['chips'] * price / 3600:.2f}" if price else "-"
    batch = f"{r['batch']}" + (" (auto)" if r.get("batch_picked") else "")
    figure = f"measured ({r['chip'].replace('TPU ', '')})" if measured else "estimated"
    return [r["model"], machine, weights, batch, memory, f"{seconds:.3f}", cost, figure]


def table(data: dict) -> str:
    """The markdown table of `data` (the JSON's contents), between its markers."""
    head = ["model", "TPU (chips per worker)", "weights", "batch", "peak of HBM, GiB per chip",
            "s per image per worker", "$ per 1,000 images", "figure"]
    lines = [SIZING_BEGIN, "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(row)) + " |" for row in data["rows"]]
    return "\n".join(lines + [SIZING_END]) + "\n"


def readme_table(text: str) -> str | None:
    """The table in a README's `text`, markers included; None when it has no markers."""
    start, end = text.find(SIZING_BEGIN), text.find(SIZING_END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(SIZING_END)] + "\n"


def preflight_report(path: str) -> dict:
    """The report of a `python -m pipeline.preflight` run saved in `path` (its last line that is a JSON object)."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError(f"{path} holds no preflight report (the JSON line python -m pipeline.preflight prints last)")
    return json.loads(lines[-1])


def add(data: dict, report: dict, compiled_on: str, note: str = "") -> dict:
    """`data` with `report` as a row, in place of a row of the same model, topology, size, quantization and batch
    choice (else last)."""
    def key(r: dict) -> tuple:
        return (r["model"], r["topology"], r.get("height"), r.get("width"), r.get("quantize", "none"),
                bool(r.get("batch_picked")), None if r.get("batch_picked") else r["batch"])

    new = {"compiled_on": compiled_on, "note": note, "report": report}
    rows = [new if key(row["report"]) == key(report) else row for row in data["rows"]]
    return dict(data, rows=rows if new in rows else [*rows, new])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sizing_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=SIZING_JSON, help="The rows (default: %(default)s).")
    parser.add_argument("--add", metavar="FILE", help="Add the report of a preflight run's output saved in FILE.")
    parser.add_argument("--compiled-on", help="With --add: the machine and libtpu build that compiled it.")
    parser.add_argument("--note", default="", help="With --add: what the row is (shown in the table).")
    args = parser.parse_args(argv)
    with open(args.json, encoding="utf-8") as f:
        data = json.load(f)
    if args.add:
        if not args.compiled_on:
            parser.error("--add needs --compiled-on")
        data = add(data, preflight_report(args.add), args.compiled_on, args.note)
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1) + "\n")
    print(table(data), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
