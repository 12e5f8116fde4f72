"""The cost of grouping near-duplicate pHashes (transforms/duplicates.py) for N images, and the estimate for more.

    python -m benchmarks.near_duplicates [--hashes 100000] [--distance 4] [--beam] [--estimate 1000000]

Random 64-bit hashes (as far apart as different images' are) plus 1% near copies. Two parts are timed in one
process: keying every hash by its distance + 1 bands (linear in N), and comparing within each band's buckets: a
cost per bucket (at most 2^b buckets of a b-bit band) plus a cost per pair compared (a bucket holds about N / 2^b
hashes, so the pairs grow as N^2 / 2^b per band). Both are fitted from runs at N/4 and N, and the estimate for
--estimate hashes uses the counted buckets and pairs of that size (every bucket then filled), not a guess.
`--beam` also runs the whole Beam step on the local runner.
Prints the figures, then one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import sys
import time


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    values = [rng.getrandbits(64) for _ in range(n)]
    values += [values[i] ^ (1 << rng.randrange(64)) for i in range(0, n, 100)]
    return [{"id": f"r{i:08d}", "file_name": f"images/r{i:08d}.png", "phash": f"{v:016x}"}
            for i, v in enumerate(values)]


def run_pure(rows: list[dict], distance: int) -> dict:
    from transforms import duplicates

    started = time.perf_counter()
    buckets = collections.defaultdict(list)
    for row in rows:
        m = duplicates.member(row)
        for key in duplicates.band_keys(int(m[2], 16), distance):
            buckets[key].append(m)
    keyed_s = time.perf_counter() - started
    started = time.perf_counter()
    compared = sum(len(ms) * (len(ms) - 1) // 2 for ms in buckets.values())
    pairs = [p for key, ms in buckets.items() for p in duplicates.bucket_pairs(key, ms, distance)]
    compare_s = time.perf_counter() - started
    started = time.perf_counter()
    groups = duplicates.components(pairs)
    return {"keyed_s": round(keyed_s, 2), "compare_s": round(compare_s, 2),
            "components_s": round(time.perf_counter() - started, 3), "buckets": len(buckets),
            "largest_bucket": max(len(ms) for ms in buckets.values()), "pairs_compared": compared,
            "pairs_found": len(pairs), "groups": len(groups)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hashes", type=int, default=100_000)
    parser.add_argument("--distance", type=int, default=4)
    parser.add_argument("--estimate", type=int, default=1_000_000)
    parser.add_argument("--beam", action="store_true")
    args = parser.parse_args(argv)
    from transforms.duplicates import bands

    quarter = run_pure(make_rows(args.hashes // 4, seed=1), args.distance)
    rows = make_rows(args.hashes)
    result = {"hashes": len(rows), "distance": args.distance, **run_pure(rows, args.distance),
              "quarter": quarter}
    # compare_s = per_bucket * buckets + per_pair * pairs, from the two runs
    (b1, p1, t1), (b2, p2, t2) = ((r["buckets"], r["pairs_compared"], r["compare_s"]) for r in (quarter, result))
    det = b1 * p2 - b2 * p1
    per_bucket, per_pair = max(0.0, (t1 * p2 - t2 * p1) / det), max(0.0, (b1 * t2 - b2 * t1) / det)
    ratio = args.estimate / len(rows)
    buckets = sum(min(2 ** width, args.estimate) for _, width in bands(args.distance))
    pairs = int(result["pairs_compared"] * ratio ** 2)
    result.update(per_bucket_us=round(per_bucket * 1e6, 2), per_pair_ns=round(per_pair * 1e9, 2),
                  estimate_hashes=args.estimate, estimate_buckets=buckets, estimate_pairs_compared=pairs,
                  estimate_one_process_s=round(result["keyed_s"] * ratio + per_bucket * buckets + per_pair * pairs
                                               + result["components_s"] * ratio, 1))
    if args.beam:
        import apache_beam as beam

        from transforms.duplicates import NearDuplicateGroups

        started = time.perf_counter()
        with beam.Pipeline(argv=["--runner=FnApiRunner"]) as p:
            _ = p | beam.Create(rows) | NearDuplicateGroups(args.distance) | beam.combiners.Count.Globally()
        result["beam_s"] = round(time.perf_counter() - started, 2)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["load_average"] = os.getloadavg()[0]
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps({"benchmark": "near_duplicates", **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
