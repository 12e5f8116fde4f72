"""A prompt template of N combinations, expanded and validated: in one process (the pure functions every worker
runs) and through the Beam step (ExpandTemplates on the local runner), with the peak RSS of each.

    python -m benchmarks.templates [--combinations 100000] [--beam]

The template has three slots (N/1000 x 100 x 10) whose vocabularies are files, as a user's would be.
Prints the figures, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time


def _peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def write_template(folder: str, combinations: int) -> str:
    """A three-slot template of `combinations` (a multiple of 1,000) with file vocabularies."""
    sizes = (combinations // 1000, 100, 10)
    for name, size in zip(("subject", "place", "style"), sizes):
        with open(os.path.join(folder, f"{name}.txt"), "w") as f:
            f.write("\n".join(f"{name} number {i}" for i in range(size)) + "\n")
    path = os.path.join(folder, "bench.template.json")
    with open(path, "w") as f:
        json.dump({"template": "a photo of {subject} in {place}, {style}",
                   "slots": {n: {"file": f"{n}.txt"} for n in ("subject", "place", "style")}, "seed": 1}, f)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--combinations", type=int, default=100_000)
    parser.add_argument("--beam", action="store_true", help="also run the Beam step on the local runner")
    args = parser.parse_args(argv)
    from transforms.inputs.template import load_template
    from transforms.inputs.template_records import template_request
    from transforms.inputs.validation import RequestDefaults

    folder = tempfile.mkdtemp(prefix="template-bench-")
    started = time.perf_counter()
    template = load_template(write_template(folder, args.combinations))
    defaults = RequestDefaults()
    valid = sum(1 for i in range(template.count) if not isinstance(template_request(template, i, defaults), dict))
    result = {"combinations": template.count, "valid": valid,
              "one_process_s": round(time.perf_counter() - started, 2), "one_process_peak_rss_mib": _peak_rss_mib()}
    if args.beam:
        import apache_beam as beam

        from transforms.inputs.template_records import ExpandTemplates

        started = time.perf_counter()
        with beam.Pipeline(argv=["--runner=FnApiRunner"]) as p:
            out = p | ExpandTemplates([template], defaults)
            counted = out["requests"] | beam.combiners.Count.Globally()
            counted | beam.Map(lambda n: open(os.path.join(folder, "count"), "w").write(str(n)))
        with open(os.path.join(folder, "count")) as f:
            result.update(beam_requests=int(f.read()), beam_s=round(time.perf_counter() - started, 2),
                          beam_peak_rss_mib=_peak_rss_mib())
    result["load_average"] = os.getloadavg()[0]
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps({"benchmark": "templates", **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
