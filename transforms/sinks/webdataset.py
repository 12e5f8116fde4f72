"""`--output_format webdataset`: img2dataset's tar shards (transforms/shards.py), placed by the input alone and
packed from images the job's one generation stage made (--drop_near_duplicates: transforms/sinks/shard_drops.py
packs a shard again without the near duplicates it drops, once the job's groups are known).

    plan      tasks -> a shard and an index each, from the input alone (AssignShards); one small group per shard
              (never pixels): a complete shard made for the same requests and model is kept (--skip_existing),
              the other shards' tasks become ShardTasks, which carry their shard and key through generation
    expand    each generated image is encoded and written, as it comes, to a staging object
              `shards/.staging/KEY.png` (StoreImagesFn, as the files sink writes its images); the small rows are
              grouped by shard, and one worker per shard streams its staged images in key order into the tar (one
              atomic upload), writes the sidecar Parquet, and the `_stats.json` marker LAST. Once every shard is
              packed, the staging folder is removed, and the indexes (dataset.json, sizes.json, README.md) written.

Image bytes never go through a shuffle. A retried bundle regenerates the same pixels and so restages the same bytes;
a shard is never visible half-written. A run killed before its shards were packed leaves its staged images: a
`--skip_existing` rerun reuses those that check out (the image's text names the task at that key, as a files
output's images are checked), and any run into that output removes the staging folder when it ends.

Positions: tasks are ordered by (source file, line, request parameters, image index), counted per block of lines
of a file, and a task's position is its block's offset (the counts of the blocks before it) plus its rank in the
block. Invalid records take no position, so two runs over the same input place every image identically.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Iterable

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from .. import dataset_card, layout, retries, shards
from ..checksums import crc32c, stored
from ..identity import ImageIdentity, ModelIdentity
from ..metrics import NAMESPACE as METRICS_NAMESPACE
from ..requests import ImageTask
from .base import DAMAGED, DONE, ERRORS, EXISTING, FAILED, IMAGES, MANIFEST, MISSING, STALE, TASKS, Sink, \
    SinkSettings, after, error_rows
from .encoding import ImageEncoding
from .existing import ExistingImageMismatch, check_existing_image
from .shard_drops import dropped_rows, with_duplicate_of
from .writes import InFiltered, Placement, StoreImagesFn, default_encode_threads, read_bytes, write_bytes_atomic

LOGGER = logging.getLogger(__name__)
LINES_PER_BLOCK = 10_000  # lines of one input file whose tasks are ordered together (bounds one group's size)
STAGING_DIR = f"{shards.SHARDS_DIR}/.staging"
KEPT_SHARDS = "kept_shards"  # what plan() hands expand(): {shard, nsamples, kept} of each complete shard kept
REUSED = "reused"  # (shard, ("reused", manifest row)) of each staged image a --skip_existing run reuses
SHARDS_TAG = "shards"


# --------------------------------------------------------------------------------------------- positions
def block_of(task) -> tuple[str, int]:
    r = task.request
    return (r.source, -1 if r.line is None else r.line // LINES_PER_BLOCK)


def order_in_block(task) -> tuple:
    r = task.request
    return (-1 if r.line is None else r.line, repr(r.params()), r.id, task.index)


def block_offsets(counts: Iterable[tuple[tuple[str, int], int]]) -> dict[tuple[str, int], int]:
    """{block: number of tasks in every block before it}, blocks in (source, block number) order."""
    offsets, total = {}, 0
    for block, n in sorted(counts):
        offsets[block] = total
        total += n
    return offsets


class _PositionFn(beam.DoFn):
    def __init__(self, samples_per_shard: int):
        self._per_shard = samples_per_shard

    def process(self, element, counts):
        block, tasks = element
        offset = block_offsets(counts)[block]  # a few entries per file (one per LINES_PER_BLOCK lines)
        for rank, task in enumerate(sorted(tasks, key=order_in_block)):
            shard, index = shards.shard_of(offset + rank, self._per_shard)
            yield shard, (index, task)


class AssignShards(beam.PTransform):
    """ImageTasks -> (shard number, (index in shard, ImageTask)), decided by the input alone."""

    def __init__(self, samples_per_shard: int):
        super().__init__()
        self._per_shard = shards.check_samples_per_shard(samples_per_shard)

    def expand(self, tasks):
        keyed = tasks | "ByBlock" >> beam.Map(lambda t: (block_of(t), t))
        counts = keyed | "CountBlocks" >> beam.combiners.Count.PerKey()
        return (keyed
                | "GroupBlocks" >> beam.GroupByKey()
                | "Position" >> beam.ParDo(_PositionFn(self._per_shard), beam.pvalue.AsList(counts)))


@dataclasses.dataclass(frozen=True)
class ShardTask(ImageTask):
    """An image task placed in a shard: generated as any ImageTask, it tells the sink its shard and sample key."""

    shard: int
    key: str


# --------------------------------------------------------------------------------------------- staging
def staging_dir(output: str) -> str:
    return layout.join(output, STAGING_DIR)


def staged_path(output: str, key: str, extension: str) -> str:
    return layout.join(output, f"{STAGING_DIR}/{key}.{extension}")


def remove_staging(output: str, attempts: int = 5) -> None:
    """Remove the staging folder and every staged image in it (none there: nothing to do). On an object store each
    listed object is deleted, listed again until none is left (a delete that failed is tried again)."""
    root = staging_dir(output)
    if layout.is_local_path(root):
        if os.path.isdir(root):
            shutil.rmtree(root)
        return
    for attempt in range(attempts):
        found = [m.path for m in FileSystems.match([layout.join(root, "*")])[0].metadata_list]
        if not found:
            return
        try:
            FileSystems.delete(found)
        except Exception as e:  # noqa: BLE001 - BeamIOError naming each object that could not be deleted
            LOGGER.warning("removing %d staged image(s) under %s: %s; trying again", len(found), root, e)
            time.sleep(0.5 * 2 ** attempt)
    if FileSystems.match([layout.join(root, "*")])[0].metadata_list:
        raise OSError(f"staged images are left under {root} after {attempts} attempts to remove them")


@dataclasses.dataclass(frozen=True)
class InShard:
    """Where the WebDataset sink puts a ShardTask's image: named by its key in its shard's tar (the manifest row's
    `file_name` and `uri`), staged meanwhile at `shards/.staging/KEY.png`."""

    output: str
    encoding: ImageEncoding = ImageEncoding()

    def __call__(self, task: ShardTask) -> Placement:
        extension = self.encoding.extension
        return Placement(file_name=f"{task.key}.{extension}", uri=shards.shard_path(self.output, task.shard),
                         write_to=staged_path(self.output, task.key, extension), key=task.key)


def remove_marker(output: str, shard: int) -> None:
    """Remove a shard's `_stats.json` (none: nothing to do), before its tar is replaced: until the new marker is
    written, nothing says the shard is complete. A delete that fails is logged: the marker would still name the
    old tar's CRC32C, which the new tar does not have."""
    path = shards.stats_path(output, shard)
    if layout.is_local_path(path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    try:
        if FileSystems.exists(path):
            FileSystems.delete([path])
    except Exception as e:  # noqa: BLE001 - see above: the checksums still tell the old marker from the new tar
        LOGGER.warning("could not remove the old marker %s before packing its shard again: %s", path, e)


def tar_rows_mismatch(path: str, rows: list[dict], extension: str) -> str | None:
    """Why the images of the tar at `path` are not those its sidecar rows record (their sha256), or None when they
    are; the tar is streamed (one member at a time), never held whole."""
    import hashlib
    import tarfile

    from apache_beam.io.filesystem import CompressionTypes

    want = {r["key"]: r.get("sha256") for r in rows if r.get("status") == "success"}
    found = {}
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f, \
                tarfile.open(fileobj=f, mode="r|") as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if ext == extension and member.isfile():
                    digest, data = hashlib.sha256(), tar.extractfile(member)
                    while chunk := data.read(2**20):
                        digest.update(chunk)
                    found[key] = digest.hexdigest()
    except (tarfile.TarError, OSError) as e:
        return f"its tar cannot be read ({e})"
    if found != want:
        return "its tar does not hold the images its sidecar records"
    return None


# --------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class _Stale:
    """A complete shard whose samples at `keys` were made for other requests or by another model."""

    keys: tuple[str, ...]


class _PlanShardFn(retries.CountingRetriesFn):
    """(shard, {entries: [(index, ImageTask)], staged: [(key, size)]}) -> the shard's ShardTasks to generate (main
    output); tagged EXISTING (rows of a complete shard --skip_existing keeps), STALE (keys of a complete shard
    made for other requests or by another model), KEPT_SHARDS ({shard, nsamples, kept}) and REUSED ((shard,
    ("reused", row)) of a staged image that checks out)."""

    def __init__(self, settings: SinkSettings, samples_per_shard: int):
        self._s = settings
        self._per_shard = samples_per_shard
        self._kept = Metrics.counter(METRICS_NAMESPACE, "shards_skipped")
        self._stale = Metrics.counter(METRICS_NAMESPACE, "images_stale")
        self._reused = Metrics.counter(METRICS_NAMESPACE, "staged_images_reused")
        self._changed = Metrics.counter(METRICS_NAMESPACE, "shards_changed")

    def process(self, element):
        shard, grouped = element
        entries = sorted(grouped["entries"], key=lambda e: e[0])
        tasks = [t.keeping_fingerprint(ShardTask(t.request, t.index, shard,
                                                 shards.sample_key(shard, i, self._per_shard)))
                 for i, t in entries]
        if not tasks:  # staged images of a shard this input does not have
            return
        if not self._s.skip_existing:
            yield from tasks
            return
        kept = self._complete_shard(shard, tasks)
        if isinstance(kept, _Stale):  # complete, but made for other requests or model
            self._stale.inc(len(kept.keys))
            LOGGER.info("--skip_existing: shard %05d has %d image(s) made for another request or model; "
                        "generating it again", shard, len(kept.keys))
            for key in kept.keys:
                yield beam.pvalue.TaggedOutput(STALE, key)
        elif kept is not None:
            self._kept.inc()
            for row in kept:
                yield beam.pvalue.TaggedOutput(EXISTING, row)
            in_tar = sum(1 for row in kept if "duplicate_of" not in row)  # less the near duplicates dropped
            yield beam.pvalue.TaggedOutput(KEPT_SHARDS, {"shard": shard, "nsamples": in_tar, "kept": True})
            return
        staged = dict(grouped["staged"])
        for task in tasks:
            row = self._reuse(task) if task.key in staged else None
            if row is None:
                if kept is None:  # no whole shard holds it (a stale shard's samples are counted STALE)
                    yield beam.pvalue.TaggedOutput(MISSING, task.key)
                yield task
            else:
                self._reused.inc()
                yield beam.pvalue.TaggedOutput(REUSED, (shard, ("reused", row)))

    def _complete_shard(self, shard: int, tasks: list[ShardTask]) -> "list[dict] | _Stale | None":
        """The manifest rows of a shard a previous run completed (its marker says every planned sample is in its
        tar) for the same requests and model (each sidecar row's fingerprints are those of the task at its key),
        from its sidecar; None when it must be generated (no marker, failures, another plan); _Stale (the keys
        whose rows differ) when it is complete but made for other requests or by another model."""
        output = self._s.output
        try:
            stats = json.loads(read_bytes(shards.stats_path(output, shard)).decode("utf-8"))
            sidecar_data = read_bytes(shards.sidecar_path(output, shard))
            rows = shards.read_sidecar(sidecar_data)
            why = self._not_vouched(shard, stats, sidecar_data, rows)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged marker or sidecar: generate the shard again
            LOGGER.warning("--skip_existing: shard %05d's marker or sidecar cannot be read (%s); generating it again",
                           shard, e)
            return None
        if why is not None:
            self._changed.inc()
            LOGGER.warning("--skip_existing: shard %05d: %s (a run stopped while packing it?); packing it again",
                           shard, why)
            return None
        planned = len(tasks)
        dropped = dropped_rows(stats)  # --drop_near_duplicates: samples of the shard left out of its tar
        if not shards.is_complete(stats, planned - len(dropped)) or len(rows) != planned - len(dropped) \
                or any(r.get("status") != "success" for r in rows):
            LOGGER.info("--skip_existing: shard %05d is incomplete (%s); generating it again", shard,
                        {k: stats.get(k) for k in ("count", "successes", "failures")})
            return None
        by_key = {r.get("key"): r for r in (*rows, *dropped)}
        stale = []
        for task in tasks:
            if task.key not in by_key:
                LOGGER.info("--skip_existing: shard %05d lacks key %s; generating it again", shard, task.key)
                return None
            if not shards.sidecar_row_matches(by_key[task.key], task, self._s.model_identity):
                stale.append(task.key)
        if stale:
            return _Stale(tuple(stale))
        uri = shards.shard_path(output, shard)
        gone = {r["key"]: r.get("duplicate_of") for r in dropped}
        return [with_duplicate_of(layout.manifest_row(
            task, file_name=row["file_name"], uri=uri, sha256=row["sha256"], num_bytes=row["bytes"],
            num_inference_steps=row["num_inference_steps"], guidance_scale=row["guidance_scale"],
            prompt_truncated=row["prompt_truncated"], model=row["model"], generation_ms=row["generation_ms"],
            identity=ImageIdentity.of(task, self._made_by(row)), key=task.key, crc32c=row.get("crc32c"),
            phash=row.get("phash")), gone.get(task.key))  # a kept shard's pHashes come from its sidecar
            for task, row in ((task, by_key[task.key]) for task in tasks)]

    def _made_by(self, row: dict) -> ModelIdentity:
        """The model a kept sample's row records: the job's when its model fingerprint is the job's (it covers the
        dtype and quantization), else what the row says (a row of a run before fingerprints)."""
        job = self._s.model_identity
        return job if job.model_fingerprint and row.get("model_fingerprint") == job.model_fingerprint \
            else ModelIdentity.recorded_in(row)

    def _not_vouched(self, shard: int, stats: dict, sidecar_data: bytes, rows: list[dict]) -> str | None:
        """Why the shard's objects are not the ones its marker vouches for, or None when they are: the sidecar has
        the size and CRC32C the marker names, and so has the tar now stored (gs://: from its metadata; locally the
        tar is hashed). A marker of a run before these were recorded: each image in the tar must have the sha256
        its sidecar row records (the tar is read)."""
        output = self._s.output
        named = shards.marker_digests(stats)
        if named is None:
            return tar_rows_mismatch(shards.shard_path(output, shard), rows, self._s.encoding.extension)
        tar, sidecar = named
        if shards.Digest(len(sidecar_data), crc32c(sidecar_data)) != sidecar:
            return "its sidecar is not the one its marker names"
        if shards.sidecar_tar(sidecar_data) not in (None, tar):
            return "its sidecar names another tar than its marker"
        found = stored(shards.shard_path(output, shard))
        if found is None:
            return "its tar is missing"
        if (found.size, found.crc32c) != (tar.size, tar.crc32c):
            return (f"its tar ({found.size} bytes, crc32c {found.crc32c}) is not the one its marker names "
                    f"({tar.size} bytes, crc32c {tar.crc32c})")
        return None

    def _reuse(self, task: ShardTask) -> dict | None:
        """The manifest row of the image a killed run staged at the task's key, if it is that task's (checked as a
        files output's image is); None: generate it."""
        place = InShard(self._s.output, self._s.encoding)(task)
        try:
            found = check_existing_image(task, read_bytes(place.write_to), self._s.encoding,
                                         self._s.model_identity, name=place.write_to)
        except FileNotFoundError:
            return None
        except ExistingImageMismatch as e:
            LOGGER.info("--skip_existing: staged %s; generating it again", e)
            return None
        return found.row(task, file_name=place.file_name, uri=place.uri, key=task.key)


class PlanShards(beam.PTransform):
    """ImageTasks -> {TASKS: ShardTasks to generate, EXISTING, STALE, MISSING, KEPT_SHARDS, REUSED} (see
    _PlanShardFn; DAMAGED: none, a shard that is not whole counts its samples MISSING); the
    staged images are listed once, and only under --skip_existing."""

    def __init__(self, settings: SinkSettings, samples_per_shard: int):
        super().__init__()
        self._s = settings
        self._per_shard = shards.check_samples_per_shard(samples_per_shard)

    def expand(self, tasks):
        from apache_beam.io import fileio

        placed = tasks | "AssignShards" >> AssignShards(self._per_shard)
        p = tasks.pipeline
        if self._s.skip_existing:
            per_shard, ext = self._per_shard, self._s.encoding.extension
            staged = (p
                      | "StagedGlob" >> beam.Create([layout.join(staging_dir(self._s.output), f"*.{ext}")])
                      | "ListStaged" >> fileio.MatchAll(empty_match_treatment=fileio.EmptyMatchTreatment.ALLOW)
                      | "StagedKeys" >> beam.FlatMap(lambda m: _staged_key(m.path, m.size_in_bytes, per_shard)))
        else:
            staged = p | "NothingStaged" >> beam.Create([])
        out = ({"entries": placed, "staged": staged}
               | "ByShard" >> beam.CoGroupByKey()
               | "PlanShards" >> beam.ParDo(_PlanShardFn(self._s, self._per_shard))
               .with_outputs(EXISTING, STALE, MISSING, KEPT_SHARDS, REUSED, main=TASKS))
        return {TASKS: out[TASKS], EXISTING: out[EXISTING], STALE: out[STALE], MISSING: out[MISSING],
                DAMAGED: p | "NoDamaged" >> beam.Create([]), KEPT_SHARDS: out[KEPT_SHARDS], REUSED: out[REUSED]}


def _staged_key(path: str, size: int, samples_per_shard: int):
    """A listed staged image -> (shard, (key, size)); nothing for a name that is not a sample key."""
    key = path.replace("\\", "/").rsplit("/", 1)[-1].split(".", 1)[0]
    if key.isdigit():
        yield int(key) // shards.key_multiplier(samples_per_shard), (key, size)


# --------------------------------------------------------------------------------------------- packing
class _PackShardFn(retries.CountingRetriesFn):
    """(shard, [("made" | "reused", manifest row) | ("failed", key, ShardTask, error row)]) -> streams the staged
    images of the shard in key order into its tar, writes the sidecar and the stats marker last; main output:
    the rows of the images this run made; tagged EXISTING: those it reused, SHARDS_TAG: {shard, nsamples, kept}."""

    def __init__(self, settings: SinkSettings):
        self._s = settings
        self._shards_written = Metrics.counter(METRICS_NAMESPACE, "shards_written")

    def setup(self):
        super().setup()
        threads = self._s.encode_threads or default_encode_threads()
        self._window = 2 * threads  # staged images read ahead at most
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="flux2-pack")

    def teardown(self):
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def process(self, element):
        shard, items = element
        started = time.time()
        output, extension = self._s.output, self._s.encoding.extension
        rows, reused, failures = [], set(), []
        for item in items:
            if item[0] == "failed":
                failures.append(item[1:])
            else:
                rows.append(item[1])
                if item[0] == "reused":
                    reused.add(item[1]["key"])
        rows.sort(key=lambda r: r["key"])
        failures.sort(key=lambda f: f[0])
        sidecar = [shards.success_sidecar_row(row) for row in rows]
        sidecar += [shards.failed_sidecar_row(key, task, error, self._s.model_identity)
                    for key, task, error in failures]
        # The order of publication: first the old marker goes (a run stopped from here on leaves no marker), then
        # the tar, the sidecar naming the tar's size and CRC32C, and last the marker naming both: whatever a stop
        # between two writes leaves, no marker vouches for bytes it does not name (_complete_shard checks).
        remove_marker(output, shard)
        spool = tempfile.mkdtemp(prefix=f"flux2-shard-{shard:05d}-")
        try:
            tar_file = os.path.join(spool, "shard.tar")
            with open(tar_file, "wb") as f:
                digesting = shards.DigestingWriter(f)
                shards.write_tar(digesting, self._samples(rows, extension), shard)
            tar = digesting.digest()
            shards.write_file_atomic(shards.shard_path(output, shard), tar_file, "application/x-tar")
        finally:
            shutil.rmtree(spool, ignore_errors=True)
        sidecar_data = shards.sidecar_bytes(sidecar, tar)
        write_bytes_atomic(shards.sidecar_path(output, shard), sidecar_data,
                           mime_type="application/vnd.apache.parquet")
        by_kind: dict[str, int] = {}
        for _, _, error in failures:
            by_kind[error["kind"]] = by_kind.get(error["kind"], 0) + 1
        finished = time.time()
        stats = shards.shard_stats(shard, count=len(rows) + len(failures), successes=len(rows),
                                   failures=len(failures), duration_s=finished - started, start_time=started,
                                   end_time=finished, failures_by_kind=by_kind, tar=tar,
                                   sidecar=shards.Digest(len(sidecar_data), crc32c(sidecar_data)))
        # Last: the marker says the tar and the sidecar are complete.
        write_bytes_atomic(shards.stats_path(output, shard),
                           (json.dumps(stats, indent=2, sort_keys=True) + "\n").encode("utf-8"),
                           mime_type="application/json")
        self._shards_written.inc()
        for row in rows:
            yield beam.pvalue.TaggedOutput(EXISTING, row) if row["key"] in reused else row
        yield beam.pvalue.TaggedOutput(SHARDS_TAG, {"shard": shard, "nsamples": len(rows), "kept": False})

    def _samples(self, rows: list[dict], extension: str):
        """The shard's samples in key order, their staged bytes read ahead on the pool (at most `window` held),
        each checked against its row's sha256."""
        import hashlib

        pending: collections.deque = collections.deque()

        def take():
            row, future = pending.popleft()
            data = future.result()
            if hashlib.sha256(data).hexdigest() != row["sha256"]:
                raise OSError(f"staged image of key {row['key']} is not the one generated (its sha256 differs): "
                              f"another job writing into {self._s.output}?")
            return shards.Sample(row["key"], extension, data, row)

        for row in rows:
            pending.append((row, self._pool.submit(read_bytes, staged_path(self._s.output, row["key"], extension))))
            if len(pending) >= self._window:
                yield take()
        while pending:
            yield take()


# --------------------------------------------------------------------------------------------- indexes
class _WriteIndexesFn(retries.CountingRetriesFn):
    def __init__(self, output: str, samples_per_shard: int, image_extension: str, quantize: str = "none",
                 score_names: tuple[str, ...] = ()):
        self._output = output
        self._per_shard = samples_per_shard
        self._extension = image_extension
        self._quantize = quantize
        self._score_names = tuple(score_names)

    def process(self, infos):
        infos = sorted(infos, key=lambda i: i["shard"])
        files = {
            dataset_card.WIDS_INDEX: dataset_card.wids_index(infos),
            dataset_card.SIZES_FILE: dataset_card.sizes(infos),
        }
        for name, value in files.items():
            write_bytes_atomic(layout.join(self._output, name),
                               (json.dumps(value, indent=2) + "\n").encode("utf-8"), mime_type="application/json")
        card = dataset_card.card(self._output, infos, self._per_shard, self._extension, self._quantize,
                                 self._score_names)
        write_bytes_atomic(layout.join(self._output, dataset_card.CARD_FILE), card.encode("utf-8"),
                           mime_type="text/markdown")
        yield len(infos)


class WriteShardIndexes(beam.PTransform):
    """{shard, nsamples} of every shard -> dataset.json (wids), sizes.json (open_clip), README.md (datasets)."""

    def __init__(self, output: str, samples_per_shard: int, image_extension: str, quantize: str = "none",
                 score_names: tuple[str, ...] = ()):
        super().__init__()
        self._fn = _WriteIndexesFn(output, samples_per_shard, image_extension, quantize, score_names)

    def expand(self, infos):
        return (infos
                | "AllShards" >> beam.combiners.ToList()
                | "WriteIndexes" >> beam.ParDo(self._fn))


# --------------------------------------------------------------------------------------------- the sink
class WebDatasetSink(Sink):
    """Generated images -> tar shards of `samples_per_shard` samples, with sidecars, markers and indexes."""

    def __init__(self, settings: SinkSettings, samples_per_shard: int = shards.DEFAULT_SAMPLES_PER_SHARD):
        super().__init__(settings)
        self.samples_per_shard = shards.check_samples_per_shard(samples_per_shard)

    @classmethod
    def from_options(cls, settings: SinkSettings, output) -> "WebDatasetSink":
        return cls(settings, output.samples_per_shard)  # --samples_per_shard

    @classmethod
    def images_where(cls, output: str) -> str:
        return layout.join(output, f"{shards.SHARDS_DIR}/*.tar")

    def plan(self) -> beam.PTransform:
        return PlanShards(self.settings, self.samples_per_shard)

    def expand(self, inputs):
        s = self.settings
        staged = inputs[IMAGES] | "StageImages" >> beam.ParDo(StoreImagesFn(
            InShard(s.output, s.encoding), s.encoding, s.encode_threads, model_identity=s.model_identity,
            progress_dir=s.progress_dir, filtered_place=InFiltered(s.output, s.encoding)))
        # Images a score filter left out are under filtered/, in the manifest, never in a shard.
        filtered = staged | "FilteredOut" >> beam.Filter(lambda row: bool(row.get("filtered")))
        staged = staged | "InDataset" >> beam.Filter(lambda row: not row.get("filtered"))
        per_shard = self.samples_per_shard
        made = staged | "MadeByShard" >> beam.Map(
            lambda row: (int(row["key"]) // shards.key_multiplier(per_shard), ("made", row)))
        failed = inputs[FAILED] | "FailedByShard" >> beam.Map(
            lambda pair: (pair[0].shard, ("failed", pair[0].key, pair[0], pair[1])))
        packed = ((made, failed, inputs[REUSED])
                  | "ShardItems" >> beam.Flatten()
                  | "GroupByShard" >> beam.GroupByKey()  # one element per shard: small rows, never pixels
                  | "PackShards" >> beam.ParDo(_PackShardFn(s)).with_outputs(EXISTING, SHARDS_TAG, main=MANIFEST))
        manifest = (packed[MANIFEST], filtered) | "ShardedAndFiltered" >> beam.Flatten()
        infos = (inputs[KEPT_SHARDS], packed[SHARDS_TAG]) | "AllShardInfos" >> beam.Flatten()
        if s.drop_near_duplicates is not None:  # one sample per near-duplicate group in the shards
            from .shard_drops import DropNearDuplicatesFromShards

            every = (manifest, packed[EXISTING], inputs[EXISTING]) | "EveryImage" >> beam.Flatten()
            infos = {"rows": every, "infos": infos} | "DropNearDuplicates" >> DropNearDuplicatesFromShards(
                s.output, per_shard, s.drop_near_duplicates)
        indexes = infos | "ShardIndexes" >> WriteShardIndexes(s.output, per_shard, s.encoding.extension, s.quantize,
                                                              s.score_names)
        cleaned = (after(manifest.pipeline | "StagingDir" >> beam.Create([s.output]), packed[SHARDS_TAG],
                         "AfterPacking")
                   | "RemoveStaging" >> beam.Map(remove_staging))
        existing = after((inputs[EXISTING], packed[EXISTING]) | "AllExisting" >> beam.Flatten(), manifest,
                         "AfterImages")
        return {MANIFEST: manifest, EXISTING: existing, ERRORS: error_rows(inputs[FAILED]), STALE: inputs[STALE],
                DAMAGED: inputs[DAMAGED], MISSING: inputs[MISSING],
                DONE: (indexes, cleaned) | "SinkDone" >> beam.Flatten()}
