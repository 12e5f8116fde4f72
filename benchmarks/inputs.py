"""Read + validate throughput of the prompt formats: JSONL, TSV and Parquet side by side (reading must never be what
limits images/s).

    python -m benchmarks.inputs                       # 1,000 prompts per format, best of 3
    python -m benchmarks.inputs --prompts 100000 --repeats 1 --out benchmarks/results/inputs.json

For each format it writes one file of the same prompts (an id, a seed, a size and two extra columns each), then
times `transforms.inputs.readers.ReadRequests` on it on Beam's FnApiRunner (the DirectRunner family, one process): file
match, read, column mapping, validation, counted at the end. That figure includes the runner's fixed cost of
starting a pipeline (about a second), so it is also given without Beam: the same file parsed in-process
(`parse_lines`). Prints a table and one JSON object (records/s per format and path); image generation is not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

FORMATS = ("jsonl", "tsv", "parquet")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=1000, help="records per file")
    p.add_argument("--repeats", type=int, default=3, help="runs per format and path; the fastest is reported")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def prompt_rows(n: int) -> list[dict]:
    """`n` distinct records like a published benchmark's: a prompt, id, seed, size and two extra columns."""
    return [{"id": f"p{i:06d}", "prompt": f"a photo of object {i} on a table, studio light, {i % 7} colours",
             "seed": i, "height": 512 + 16 * (i % 4), "width": 512, "category": ["animals", "text", "scenes"][i % 3],
             "note": "" if i % 2 else f"note {i}"} for i in range(n)]


def write_inputs(folder: str, rows: list[dict]) -> dict[str, str]:
    """{format: path} of the same records as JSONL, TSV (with a header) and Parquet (row groups of 10,000)."""
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {fmt: os.path.join(folder, f"prompts.{fmt}") for fmt in FORMATS}
    with open(paths["jsonl"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(paths["tsv"], "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), dialect="excel-tab", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"], row_group_size=10_000)
    return paths


def time_beam(path: str, defaults, expected: int) -> float:
    """Seconds to read and validate `path` through ReadRequests on FnApiRunner (which must give `expected`
    requests, or the run fails)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.testing.util import assert_that, equal_to

    from transforms.inputs.readers import ReadRequests

    start = time.perf_counter()
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        read = p | beam.Create([path]) | ReadRequests("auto", defaults)
        assert_that(read["requests"] | beam.combiners.Count.Globally(), equal_to([expected]))
    return time.perf_counter() - start


def time_parse(path: str, fmt: str, defaults) -> tuple[float, int]:
    """Seconds to parse and validate the file in-process (no Beam), and the requests it gave."""
    from transforms.inputs.readers import parse_lines
    from transforms.requests import GenerationRequest

    start = time.perf_counter()
    with open(path, "rb") as f:
        out = parse_lines(f.read(), path, fmt, defaults)
    elapsed = time.perf_counter() - start
    return elapsed, sum(isinstance(o, GenerationRequest) for o in out)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transforms.inputs.validation import RequestDefaults

    defaults = RequestDefaults()
    result = {"prompts": args.prompts, "repeats": args.repeats, "runner": "FnApiRunner (in_memory)",
              "cpu_count": os.cpu_count(), "formats": {}}
    with tempfile.TemporaryDirectory(prefix="bench-inputs-") as folder:
        paths = write_inputs(folder, prompt_rows(args.prompts))
        for fmt in FORMATS:
            beam_s = min(time_beam(paths[fmt], defaults, args.prompts) for _ in range(args.repeats))
            parse_runs = [time_parse(paths[fmt], fmt, defaults) for _ in range(args.repeats)]
            parse_s, parsed = min(parse_runs)
            if parsed != args.prompts:
                print(f"error: {fmt}: {parsed} of {args.prompts} records became requests", file=sys.stderr)
                return 1
            result["formats"][fmt] = {
                "file_bytes": os.path.getsize(paths[fmt]),
                "beam_s": round(beam_s, 3), "beam_records_per_s": round(args.prompts / beam_s, 1),
                "parse_s": round(parse_s, 4), "parse_records_per_s": round(args.prompts / parse_s, 1)}
    print(f"{'format':8} {'file bytes':>11} {'ReadRequests (Beam)':>22} {'parse only':>16}")
    for fmt, r in result["formats"].items():
        print(f"{fmt:8} {r['file_bytes']:>11} {r['beam_records_per_s']:>13.0f} rec/s {r['beam_s']:>5.2f}s "
              f"{r['parse_records_per_s']:>10.0f} rec/s")
    print(json.dumps(result))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
