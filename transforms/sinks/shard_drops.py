"""`--drop_near_duplicates` for the WebDataset layout: once the job-wide near-duplicate groups are known
(transforms/duplicates.py), each shard holding a dropped sample is packed again without it.

The shards are packed as images are made, before the groups are known; so a shard is rewritten afterwards, in
the order its packing uses: the old marker goes first, then the new tar (its members copied from the old one, less
the dropped samples), the new sidecar (less their rows) and last the new marker. The marker lists the dropped
samples' sidecar rows under `dropped` (each with `duplicate_of`, the id of the image kept): a `--skip_existing`
rerun counts them as planned samples of the shard, and takes their manifest rows from there. A dropped sample's
image is out of the tar for good: a rerun whose groups no longer drop it says so and keeps it out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import tempfile

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from .. import retries, shards
from ..checksums import crc32c
from ..metrics import NAMESPACE as METRICS_NAMESPACE
from .writes import read_bytes, write_bytes_atomic

LOGGER = logging.getLogger(__name__)
DROPPED = "dropped"  # the marker's list of the sidecar rows of the samples dropped from its tar


def dropped_rows(stats: dict) -> list[dict]:
    """The sidecar rows of the samples a shard's marker says were dropped as near duplicates (none: [])."""
    return list(stats.get(DROPPED) or ())


def with_duplicate_of(row: dict, kept_id: str | None) -> dict:
    """A manifest row, with `duplicate_of` when its sample was dropped from the tar as a near duplicate of
    `kept_id` (None: the row as it is)."""
    return row if kept_id is None else {**row, "duplicate_of": kept_id}


def copy_tar_without(source, target, keys: set[str]) -> None:
    """Stream the tar `source` into `target` member by member, less the members of the samples at `keys`."""
    with tarfile.open(fileobj=source, mode="r|") as old, \
            tarfile.open(fileobj=target, mode="w|", format=tarfile.USTAR_FORMAT) as new:
        for member in old:
            if member.name.split(".", 1)[0] in keys:
                continue
            new.addfile(member, old.extractfile(member) if member.isfile() else None)


def drop_from_shard(output: str, shard: int, dropped: dict[str, str]) -> int:
    """Pack shard `shard` again without the samples at the keys of `dropped` ({key: id of the image kept}) that
    its tar still holds; returns the number of samples its tar holds after."""
    from .webdataset import remove_marker

    stats = json.loads(read_bytes(shards.stats_path(output, shard)).decode("utf-8"))
    rows = shards.read_sidecar(read_bytes(shards.sidecar_path(output, shard)))
    already = {r["key"] for r in dropped_rows(stats)}
    for key in sorted(already - set(dropped)):
        LOGGER.warning("shard %05d: sample %s was dropped as a near duplicate by an earlier run; its image is no "
                       "longer in the tar, so it stays out", shard, key)
    drop = {r["key"] for r in rows if r["key"] in dropped and r.get("status") == "success"}
    if not drop:
        return int(stats.get("successes", 0))
    kept_rows = [r for r in rows if r["key"] not in drop]
    gone = dropped_rows(stats) + [{**r, "duplicate_of": dropped[r["key"]]} for r in rows if r["key"] in drop]
    remove_marker(output, shard)  # until the new marker is written, nothing says the shard is complete
    spool = tempfile.mkdtemp(prefix=f"flux2-repack-{shard:05d}-")
    try:
        tar_file = os.path.join(spool, "shard.tar")
        with FileSystems.open(shards.shard_path(output, shard), compression_type=CompressionTypes.UNCOMPRESSED) \
                as source, open(tar_file, "wb") as f:
            digesting = shards.DigestingWriter(f)
            copy_tar_without(source, digesting, drop)
        tar = digesting.digest()
        shards.write_file_atomic(shards.shard_path(output, shard), tar_file, "application/x-tar")
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    sidecar_data = shards.sidecar_bytes(kept_rows, tar)
    write_bytes_atomic(shards.sidecar_path(output, shard), sidecar_data, mime_type="application/vnd.apache.parquet")
    successes = int(stats["successes"]) - len(drop)
    stats.update({shards.TAR_BYTES: tar.size, shards.TAR_CRC32C: tar.crc32c,
                  shards.SIDECAR_BYTES: len(sidecar_data), shards.SIDECAR_CRC32C: crc32c(sidecar_data),
                  "count": int(stats["count"]) - len(drop), "successes": successes,
                  DROPPED: sorted(gone, key=lambda r: r["key"])})
    write_bytes_atomic(shards.stats_path(output, shard),
                       (json.dumps(stats, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8"),
                       mime_type="application/json")
    LOGGER.info("shard %05d: %d near-duplicate sample(s) dropped; %d left", shard, len(drop), successes)
    return successes


class _DropFromShardFn(retries.CountingRetriesFn):
    """(shard, {info: [{shard, nsamples, kept}], dropped: [(key, kept id)]}) -> the shard's info, its nsamples
    what its tar holds once the dropped samples are out."""

    def __init__(self, output: str):
        self._output = output
        self._repacked = Metrics.counter(METRICS_NAMESPACE, "shards_repacked_without_duplicates")

    def process(self, element):
        shard, grouped = element
        for info in grouped["info"]:
            dropped = dict(grouped["dropped"])
            if dropped:
                self._repacked.inc()
                info = {**info, "nsamples": drop_from_shard(self._output, shard, dropped)}
            yield info


class DropNearDuplicatesFromShards(beam.PTransform):
    """{rows: manifest rows of every image of the output, infos: {shard, nsamples, kept} of every shard packed or
    kept} -> the infos, each shard holding a dropped near duplicate packed again without it."""

    def __init__(self, output: str, samples_per_shard: int, distance: int):
        super().__init__()
        self._output = output
        self._per_shard = samples_per_shard
        self._distance = distance

    def expand(self, inputs):
        from ..duplicates import NearDuplicateGroups, duplicate_of

        rows, infos = inputs["rows"], inputs["infos"]
        per_shard = self._per_shard
        groups = rows | "Groups" >> NearDuplicateGroups(self._distance)
        of = groups | "DroppedOf" >> beam.FlatMap(duplicate_of)

        def in_shard(row, of):
            kept = of.get(row["file_name"])
            if kept is not None and row.get("key") and not row.get("filtered"):
                yield int(row["key"]) // shards.key_multiplier(per_shard), (row["key"], kept)

        dropped = rows | "DroppedByShard" >> beam.FlatMap(in_shard, beam.pvalue.AsDict(of))
        keyed = infos | "InfoByShard" >> beam.Map(lambda info: (info["shard"], info))
        return ({"info": keyed, "dropped": dropped}
                | "WithDropped" >> beam.CoGroupByKey()
                | "DropFromShards" >> beam.ParDo(_DropFromShardFn(self._output)))
