"""Near-duplicate groups (transforms/duplicates.py): the band keys find every pair within the distance that all
pairs would (checked against brute force), each once; groups are components with the smallest id first; the Beam
step gives the same groups."""

import itertools
import random

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from transforms import duplicates


def _rows(n=400, seed=0, distance=4):
    rng = random.Random(seed)
    values = [rng.getrandbits(64) for _ in range(n)]
    for i in range(0, 60, 3):  # near copies of some: 0..distance+2 bits flipped
        flips = rng.sample(range(64), rng.randint(0, distance + 2))
        values.append(values[i] ^ sum(1 << b for b in flips))
    return [{"id": f"r{i:04d}", "file_name": f"images/r{i:04d}.png", "phash": f"{v:016x}"}
            for i, v in enumerate(values)]


def _brute_groups(rows, distance):
    members = [duplicates.member(r) for r in rows]
    pairs = [(a, b, 0) for a, b in itertools.combinations(members, 2)
             if (int(a[2], 16) ^ int(b[2], 16)).bit_count() <= distance]
    return duplicates.components(pairs)


def _banded_groups(rows, distance):
    buckets = {}
    for m in map(duplicates.member, rows):
        for key in duplicates.band_keys(int(m[2], 16), distance):
            buckets.setdefault(key, []).append(m)
    pairs = [p for key, ms in buckets.items() for p in duplicates.bucket_pairs(key, ms, distance)]
    assert len({(a, b) for a, b, _ in pairs}) == len(pairs)  # each pair from one bucket only
    return duplicates.components(pairs)


@pytest.mark.parametrize("distance", [0, 2, 4, 8])
def test_bands_find_what_all_pairs_find(distance):
    rows = _rows(distance=distance)
    want = _brute_groups(rows, distance)
    assert want, "the data has near duplicates"
    assert _banded_groups(rows, distance) == want


def test_bands_cover_64_bits_and_identical_hashes_chain():
    for d in range(0, 17):
        assert sum(w for _, w in duplicates.bands(d)) == 64 and len(duplicates.bands(d)) == d + 1
    same = [{"id": i, "file_name": f"{i}.png", "phash": "00ff00ff00ff00ff"} for i in "cab"]
    groups = _banded_groups(same, 4)
    assert groups == [{"ids": ["a", "b", "c"], "file_names": ["a.png", "b.png", "c.png"], "distances": [0, 0, 0],
                       "phashes": ["00ff00ff00ff00ff"] * 3}]
    assert list(duplicates.duplicate_of(groups[0])) == [("b.png", "a"), ("c.png", "a")]
    with pytest.raises(ValueError, match="near_duplicate_distance"):
        duplicates.check_distance(17)


def test_beam_step_groups_across_the_whole_collection():
    rows = _rows(120, seed=1) + [{"id": "old", "file_name": "images/old.png", "phash": None}]
    want = _brute_groups(rows[:-1], 4)
    with beam.Pipeline() as p:
        groups = p | beam.Create(rows) | duplicates.NearDuplicateGroups(4)
        assert_that(groups, equal_to(want))
