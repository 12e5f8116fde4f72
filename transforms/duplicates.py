"""Near-duplicate images across a whole job: groups of images whose pHashes (transforms/phash.py) lie within
`--near_duplicate_distance` bits of each other, found without comparing all pairs.

Pigeonhole bands: the 64 bits are cut into distance + 1 bands; two hashes at most `distance` bits apart differ in
at most `distance` bands, so they agree on at least one. Each image is keyed by each (band, its bits there); only
images that share a key are compared, and a pair is compared under the first band they share, so it is reported
once. Identical hashes are chained to their first image, never compared pairwise. The pairs found (few: near
duplicates are the exception) are joined into groups (connected components) in one step.

    {output}/duplicates/duplicates-*.jsonl   one object per group:
        {"ids": [...], "file_names": [...], "distances": [...], "phashes": [...]}
        sorted by (id, file name); the first image is the one kept; distances[i]: bits between image i and it

`--drop_near_duplicates` keeps that first image of each group in metadata.jsonl, or in the WebDataset shards
(sinks/shard_drops.py), and, marked `duplicate_of` in the manifest, the others point at it; the image files stay.
"""

from __future__ import annotations

import collections
import logging
from typing import Iterable, Iterator

import apache_beam as beam
import numpy as np

from . import layout
from .defaults import DEFAULT_NEAR_DUPLICATE_DISTANCE, MAX_NEAR_DUPLICATE_DISTANCE  # noqa: F401 - re-exported
from .phash import HASH_BITS, as_int

LOGGER = logging.getLogger(__name__)
DUPLICATES_DIR = "duplicates"
DUPLICATES_PREFIX = "duplicates"
COMPARE_ROWS = 256  # hashes of one bucket compared with all the others in one array operation (bounds its memory)


def duplicates_prefix(output: str) -> str:
    return layout.join(output, f"{DUPLICATES_DIR}/{DUPLICATES_PREFIX}")


def check_distance(distance) -> int:
    if isinstance(distance, bool) or not isinstance(distance, int) or not 0 <= distance <= MAX_NEAR_DUPLICATE_DISTANCE:
        raise ValueError(f"--near_duplicate_distance={distance!r} is not an integer from 0 to "
                         f"{MAX_NEAR_DUPLICATE_DISTANCE}")
    return distance


def bands(distance: int) -> list[tuple[int, int]]:
    """(shift, width) of each of the distance + 1 bands of a 64-bit hash, widths as equal as they can be."""
    count = distance + 1
    widths = [HASH_BITS // count + (1 if i < HASH_BITS % count else 0) for i in range(count)]
    out, shift = [], HASH_BITS
    for width in widths:
        shift -= width
        out.append((shift, width))
    return out


def band_keys(value: int, distance: int) -> list[tuple[int, int]]:
    """(band number, the hash's bits in that band) for every band."""
    return [(n, (value >> shift) & ((1 << width) - 1)) for n, (shift, width) in enumerate(bands(distance))]


def member(row: dict) -> tuple[str, str, str] | None:
    """A manifest row as (id, file name, phash), or None when it has no pHash (a row of an older run)."""
    phash = row.get("phash")
    if not phash:
        return None
    return row["id"], row["file_name"], phash


def bucket_pairs(key, members: Iterable[tuple[str, str, str]], distance: int
                 ) -> Iterator[tuple[tuple, tuple, int]]:
    """The pairs (a, b, bits) of one band key's members that lie within `distance` and share no earlier band (so
    each pair comes from one bucket only). Identical hashes: chained to the first member, from band 0 alone."""
    band = key[0]
    by_hash: dict[str, list] = collections.defaultdict(list)
    for m in members:
        by_hash[m[2]].append(m)
    firsts = []
    for same in by_hash.values():
        same.sort()
        if band == 0:
            for other in same[1:]:
                yield same[0], other, 0
        firsts.append(same[0])
    if len(firsts) < 2:
        return
    firsts.sort()
    values = np.array([as_int(m[2]) for m in firsts], dtype=np.uint64)
    masks = [np.uint64(((1 << width) - 1) << shift) for shift, width in bands(distance)[:band]]
    for start in range(0, len(values), COMPARE_ROWS):  # every pair (i < j) at once, a block of rows at a time
        rows = values[start:start + COMPARE_ROWS, None]
        bits = np.bitwise_count(rows ^ values[None, :])
        close = (bits <= distance) & (np.arange(len(values))[None, :] > np.arange(start, start + len(rows))[:, None])
        for mask in masks:  # a pair that agrees on an earlier band is that band's to report
            close &= (rows & mask) != (values[None, :] & mask)
        for i, j in zip(*np.nonzero(close)):
            yield firsts[start + i], firsts[j], int(bits[i, j])


def components(pairs: Iterable[tuple[tuple, tuple, int]]) -> list[dict]:
    """Pairs of members -> groups (connected components), each sorted, first kept: {ids, file_names, distances,
    phashes}, distances counted from the first member."""
    parent: dict = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b, _ in pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict = collections.defaultdict(list)
    for m in list(parent):
        groups[root(m)].append(m)
    out = []
    for members in groups.values():
        members.sort()
        first = as_int(members[0][2])
        out.append({"ids": [m[0] for m in members], "file_names": [m[1] for m in members],
                    "distances": [(as_int(m[2]) ^ first).bit_count() for m in members],
                    "phashes": [m[2] for m in members]})
    out.sort(key=lambda g: (g["ids"][0], g["file_names"][0]))
    return out


def duplicate_of(group: dict) -> Iterator[tuple[str, str]]:
    """(file name, the id of the image kept in the group) for every image of `group` but the first."""
    for file_name in group["file_names"][1:]:
        yield file_name, group["ids"][0]


class NearDuplicateGroups(beam.PTransform):
    """Manifest rows -> near-duplicate groups (dicts as the module docstring says), across every row given."""

    def __init__(self, distance: int):
        super().__init__()
        self._distance = check_distance(distance)

    def expand(self, rows):
        d = self._distance
        pairs = (rows
                 | "Members" >> beam.FlatMap(lambda row: [m] if (m := member(row)) else [])
                 | "BandKeys" >> beam.FlatMap(lambda m: ((key, m) for key in band_keys(as_int(m[2]), d)))
                 | "ByBand" >> beam.GroupByKey()
                 | "ClosePairs" >> beam.FlatMap(lambda kv: bucket_pairs(kv[0], kv[1], d)))
        return (pairs
                | "AllPairs" >> beam.combiners.ToList()
                | "Components" >> beam.FlatMap(components))


def mark_duplicates(rows, groups, label: str = "MarkDuplicates"):
    """Manifest rows with `duplicate_of` (the id of the image kept) on every image of a group but the first."""
    dup = groups | f"{label}Of" >> beam.FlatMap(duplicate_of)

    def mark(row, of):
        kept = of.get(row["file_name"])
        return {**row, "duplicate_of": kept} if kept is not None else row

    return rows | label >> beam.Map(mark, beam.pvalue.AsDict(dup))


def keep_one_per_group(rows, groups, label: str = "KeepOnePerGroup"):
    """Manifest rows less every image of a group but the first (--drop_near_duplicates)."""
    dup = groups | f"{label}Dropped" >> beam.FlatMap(duplicate_of)
    return rows | label >> beam.Filter(lambda row, of: row["file_name"] not in of, beam.pvalue.AsDict(dup))


def write_groups(groups, output: str):
    """duplicates/duplicates-*.jsonl: one group a line; one shard under a fixed name, so a rerun replaces it."""
    return (groups
            | "GroupsJson" >> beam.Map(layout.to_json_line)
            | "WriteGroups" >> beam.io.WriteToText(duplicates_prefix(output), file_name_suffix=layout.ROWS_SUFFIX,
                                                   num_shards=1))
