"""Beam side of `--output_format webdataset`: place every image in a shard from the input alone, then generate and
pack each shard in one DoFn.

Why this shape: a tar must hold exactly the samples the input puts in it, in key order, written once. So the
small rows (image tasks: prompt and parameters, never pixels) are grouped by shard, and one DoFn call per shard
generates its images, encodes them on a thread pool, spools them to local disk, streams the tar in key order to
its final name (one atomic object upload; locally a temporary file and a rename), writes the sidecar Parquet, and
writes the `_stats.json` marker LAST. Image bytes never go through a shuffle. A retried bundle regenerates the
same pixels and so rewrites the same bytes; a shard is never visible half-written.

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
import traceback
import uuid
from typing import Any, Iterable

import apache_beam as beam
from apache_beam.metrics import Metrics

from . import layout, retries, shards
from .metrics import NAMESPACE as METRICS_NAMESPACE
from .generation import failed_batch_rows, non_finite_row
from .sinks.encoding import ImageEncoding, generated_text
from .sinks.writes import default_encode_threads, read_bytes, write_bytes_atomic

LOGGER = logging.getLogger(__name__)
LINES_PER_BLOCK = 10_000  # lines of one input file whose tasks are ordered together (bounds one group's size)
ERRORS_TAG = "errors"
EXISTING_TAG = "existing"
SHARDS_TAG = "shards"
STALE_TAG = "stale"


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


# --------------------------------------------------------------------------------------------- packing
def shape_batches(entries: list, batch_size: int) -> list[list]:
    """(index, task) entries -> batches of at most `batch_size` tasks of one shape, in index order within a shape."""
    by_shape: dict[str, list] = {}
    for entry in entries:
        by_shape.setdefault(entry[1].shape_key, []).append(entry)
    batches = []
    for key in sorted(by_shape):
        group = by_shape[key]
        batches.extend(group[i:i + batch_size] for i in range(0, len(group), batch_size))
    return batches


@dataclasses.dataclass(frozen=True)
class _Stale:
    """A complete shard whose samples at `keys` were made for other requests or by another model."""

    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Made:
    """What a packed image's manifest row needs of its GeneratedImage, without the pixels."""

    task: Any
    num_inference_steps: int
    guidance_scale: float
    prompt_truncated: bool
    model: str
    generation_ms: float


def _encode_to(path: str, generated, encoding: ImageEncoding, model_fingerprint: str | None = None
               ) -> tuple[int, str]:
    import hashlib

    data = encoding.encode(generated.pixels, generated_text(generated, model_fingerprint))
    with open(path, "wb") as f:
        f.write(data)
    return len(data), hashlib.sha256(data).hexdigest()


class PackShardFn(beam.DoFn):
    """(shard, [(index, ImageTask)]) -> generates, packs and writes the shard; main output: manifest rows of its
    images; tagged: `errors` (failed images), `existing` (rows of a complete shard --skip_existing kept),
    `shards` ({shard, nsamples, ...} for the indexes). `model_fingerprint` goes into every sample's text, row and
    sidecar row (transforms/fingerprints.py)."""

    def __init__(self, output: str, handler, encoding: ImageEncoding, samples_per_shard: int, batch_size: int,
                 skip_existing: bool = False, progress_dir: str | None = None, threads: int | None = None,
                 model_fingerprint: str | None = None):
        from apache_beam.utils import shared

        self._output = output
        self._model_fingerprint = model_fingerprint or None
        self._handler = handler
        self._encoding = encoding
        self._per_shard = samples_per_shard
        self._batch_size = batch_size
        self._skip_existing = skip_existing
        self._progress_dir = progress_dir
        self._threads = threads
        self._shared = shared.Shared()
        self._tag = f"flux2-shards-{uuid.uuid4().hex}"
        self._written = Metrics.counter(METRICS_NAMESPACE, "images_generated")
        self._bytes = Metrics.counter(METRICS_NAMESPACE, "image_bytes_written")
        self._shards_written = Metrics.counter(METRICS_NAMESPACE, "shards_written")
        self._shards_kept = Metrics.counter(METRICS_NAMESPACE, "shards_skipped")
        self._stale = Metrics.counter(METRICS_NAMESPACE, "images_stale")
        self._nonfinite = Metrics.counter(METRICS_NAMESPACE, "images_non_finite")
        self._gen_ms = Metrics.distribution(METRICS_NAMESPACE, "generation_ms_per_image")

    def setup(self):
        retries.install()
        self._model = None
        threads = self._threads or default_encode_threads()
        self._limit = 2 * threads  # images of a shard waiting for an encoder at most
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="flux2-pack")
        self._progress = None
        if self._progress_dir:
            from .progress import ProgressWriter

            self._progress = ProgressWriter(self._progress_dir)

    def teardown(self):
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def finish_bundle(self):
        from .inference import flush_model_load_metrics

        flush_model_load_metrics()
        retries.flush_to_metrics()
        if self._progress is not None:
            self._progress.flush()

    def _loaded(self):
        """The model, loaded on the first shard that needs generating (a resumed run of complete shards loads
        none): one per process, or one per machine shared by its processes when the handler asks for it."""
        if self._model is None:
            self._handler.set_environment_vars()
            if self._handler.share_model_across_processes():
                from apache_beam.utils import multi_process_shared

                self._model = multi_process_shared.MultiProcessShared(
                    self._handler.load_model, tag=self._tag, always_proxy=True).acquire()
            else:
                self._model = self._shared.acquire(self._handler.load_model, tag=self._tag)
        return self._model

    def process(self, element):
        shard, entries = element
        entries = sorted(entries, key=lambda e: e[0])
        if self._skip_existing:
            kept = self._complete_shard(shard, entries)
            if kept is not None and not isinstance(kept, list):  # complete, but made for other requests or model
                self._stale.inc(len(kept.keys))
                LOGGER.info("--skip_existing: shard %05d has %d image(s) made for another request or model; "
                            "generating it again", shard, len(kept.keys))
                for key in kept.keys:
                    yield beam.pvalue.TaggedOutput(STALE_TAG, key)
            elif kept is not None:
                self._shards_kept.inc()
                for row in kept:
                    yield beam.pvalue.TaggedOutput(EXISTING_TAG, row)
                yield beam.pvalue.TaggedOutput(SHARDS_TAG, {"shard": shard, "nsamples": len(kept), "kept": True})
                return
        yield from self._pack(shard, entries)

    def _complete_shard(self, shard: int, entries: list) -> "list[dict] | _Stale | None":
        """The manifest rows of a shard a previous run completed (its marker says every planned sample is in its
        tar) for the same requests and model (each sidecar row's fingerprints are those of the task at its key),
        read from its sidecar; None when it must be generated (no marker, failures, another plan); _Stale (the keys
        whose rows differ) when it is complete but made for other requests or by another model."""
        planned = len(entries)
        try:
            stats = json.loads(read_bytes(shards.stats_path(self._output, shard)).decode("utf-8"))
            rows = shards.read_sidecar(read_bytes(shards.sidecar_path(self._output, shard)))
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged marker or sidecar: generate the shard again
            LOGGER.warning("--skip_existing: shard %05d's marker or sidecar cannot be read (%s); generating it again",
                           shard, e)
            return None
        if not shards.is_complete(stats, planned) or len(rows) != planned \
                or any(r.get("status") != "success" for r in rows):
            LOGGER.info("--skip_existing: shard %05d is incomplete (%s); generating it again", shard,
                        {k: stats.get(k) for k in ("count", "successes", "failures")})
            return None
        by_key = {r.get("key"): r for r in rows}
        stale = []
        for index, task in entries:
            key = shards.sample_key(shard, index, self._per_shard)
            if key not in by_key:
                LOGGER.info("--skip_existing: shard %05d lacks key %s; generating it again", shard, key)
                return None
            if not shards.sidecar_row_matches(by_key[key], task, self._model_fingerprint):
                stale.append(key)
        if stale:
            return _Stale(tuple(stale))
        uri = shards.shard_path(self._output, shard)
        kept = []
        for index, task in entries:
            key = shards.sample_key(shard, index, self._per_shard)
            row = by_key[key]
            kept.append(layout.manifest_row(
                task, file_name=row["file_name"], uri=uri, sha256=row["sha256"], num_bytes=row["bytes"],
                num_inference_steps=row["num_inference_steps"], guidance_scale=row["guidance_scale"],
                prompt_truncated=row["prompt_truncated"], model=row["model"], generation_ms=row["generation_ms"],
                model_fingerprint=row["model_fingerprint"], key=key))
        return kept

    def _pack(self, shard: int, entries: list):
        started = time.time()
        key_of = {id(task): shards.sample_key(shard, index, self._per_shard) for index, task in entries}
        spool = tempfile.mkdtemp(prefix=f"flux2-shard-{shard:05d}-")
        try:
            # key -> (what the manifest row needs, future of (bytes, sha256)). The pixels are dropped once
            # encoded to the spool; at most `limit` images wait for an encoder, bounding memory per shard.
            stored: dict[str, tuple] = {}
            waiting: collections.deque = collections.deque()
            errors: list[tuple[str, Any, dict]] = []
            for batch in shape_batches(entries, self._batch_size):
                tasks = [task for _, task in batch]
                try:
                    results = list(self._handler.run_inference(tasks, self._loaded()))
                except Exception as e:  # noqa: BLE001 - one error row per image, as RunInference's DLQ gives
                    exc = (type(e), repr(e), traceback.format_exception(e))
                    for task, row in zip(tasks, failed_batch_rows((tasks, exc))):
                        errors.append((key_of[id(task)], task, row))
                    continue
                for task, result in zip(tasks, results):
                    key = key_of[id(task)]
                    g = result.inference
                    if g.nonfinite is not None:  # NaN/inf values: an error row, no sample
                        self._nonfinite.inc()
                        errors.append((key, task, non_finite_row(task, g.nonfinite)))
                        continue
                    future = self._pool.submit(_encode_to, os.path.join(spool, key), g, self._encoding,
                                               self._model_fingerprint)
                    stored[key] = (_Made(g.task, g.num_inference_steps, g.guidance_scale, g.prompt_truncated,
                                         g.model, g.generation_ms), future)
                    waiting.append(future)
                    del g, result
                    while len(waiting) > self._limit:
                        waiting.popleft().result()
            rows, sidecar = [], []
            extension = layout.IMAGE_EXTENSIONS[self._encoding.format]
            uri = shards.shard_path(self._output, shard)
            for key in sorted(stored):
                generated, future = stored[key]
                num_bytes, sha256 = future.result()
                row = layout.manifest_row(
                    generated.task, file_name=f"{key}.{extension}", uri=uri, sha256=sha256, num_bytes=num_bytes,
                    num_inference_steps=generated.num_inference_steps, guidance_scale=generated.guidance_scale,
                    prompt_truncated=generated.prompt_truncated, model=generated.model,
                    generation_ms=generated.generation_ms, model_fingerprint=self._model_fingerprint, key=key)
                rows.append(row)
                sidecar.append(shards.success_sidecar_row(row))
            for key, task, error in errors:
                sidecar.append(shards.failed_sidecar_row(key, task, error, self._model_fingerprint))

            def samples():
                for row in rows:
                    with open(os.path.join(spool, row["key"]), "rb") as f:
                        yield shards.Sample(row["key"], extension, f.read(), row)

            tar_file = os.path.join(spool, "shard.tar")
            with open(tar_file, "wb") as f:
                shards.write_tar(f, samples(), shard)
            shards.write_file_atomic(uri, tar_file, "application/x-tar")
            write_bytes_atomic(shards.sidecar_path(self._output, shard), shards.sidecar_bytes(sidecar),
                               mime_type="application/vnd.apache.parquet")
            by_kind: dict[str, int] = {}
            for _, _, error in errors:
                by_kind[error["kind"]] = by_kind.get(error["kind"], 0) + 1
            finished = time.time()
            stats = shards.shard_stats(shard, count=len(entries), successes=len(rows), failures=len(errors),
                                       duration_s=finished - started, start_time=started, end_time=finished,
                                       failures_by_kind=by_kind)
            # Last: the marker says the tar and the sidecar are complete.
            write_bytes_atomic(shards.stats_path(self._output, shard),
                               (json.dumps(stats, indent=2, sort_keys=True) + "\n").encode("utf-8"),
                               mime_type="application/json")
        finally:
            shutil.rmtree(spool, ignore_errors=True)
        self._shards_written.inc()
        for row in rows:
            self._written.inc()
            self._bytes.inc(row["bytes"])
            self._gen_ms.update(int(round(row["generation_ms"] or 0)))
            yield row
        if self._progress is not None:
            self._progress.add(len(rows))
        for _, _, error in errors:
            yield beam.pvalue.TaggedOutput(ERRORS_TAG, error)
        yield beam.pvalue.TaggedOutput(SHARDS_TAG, {"shard": shard, "nsamples": len(rows), "kept": False})


class WriteShards(beam.PTransform):
    """ImageTasks -> {'manifest', 'errors', 'existing', 'shards'}: every shard generated, packed and marked."""

    def __init__(self, output: str, handler, encoding: ImageEncoding, samples_per_shard: int, batch_size: int,
                 skip_existing: bool = False, progress_dir: str | None = None, threads: int | None = None,
                 model_fingerprint: str | None = None):
        super().__init__()
        self._fn = PackShardFn(output, handler, encoding, samples_per_shard, batch_size, skip_existing,
                               progress_dir, threads, model_fingerprint)
        self._per_shard = samples_per_shard

    def expand(self, tasks):
        out = (tasks
               | "AssignShards" >> AssignShards(self._per_shard)
               | "GroupByShard" >> beam.GroupByKey()  # one element per shard: small rows, never pixels
               | "PackShards" >> beam.ParDo(self._fn).with_outputs(ERRORS_TAG, EXISTING_TAG, SHARDS_TAG, STALE_TAG,
                                                                   main="manifest"))
        return {"manifest": out.manifest, "errors": out[ERRORS_TAG], "existing": out[EXISTING_TAG],
                "shards": out[SHARDS_TAG], "stale": out[STALE_TAG]}


# --------------------------------------------------------------------------------------------- indexes
class _WriteIndexesFn(beam.DoFn):
    def __init__(self, output: str, samples_per_shard: int, image_extension: str):
        self._output = output
        self._per_shard = samples_per_shard
        self._extension = image_extension

    def setup(self):
        retries.install()

    def finish_bundle(self):
        retries.flush_to_metrics()

    def process(self, infos):
        from . import dataset_card

        infos = sorted(infos, key=lambda i: i["shard"])
        files = {
            dataset_card.WIDS_INDEX: dataset_card.wids_index(infos),
            dataset_card.SIZES_FILE: dataset_card.sizes(infos),
        }
        for name, value in files.items():
            write_bytes_atomic(layout.join(self._output, name),
                               (json.dumps(value, indent=2) + "\n").encode("utf-8"), mime_type="application/json")
        card = dataset_card.card(self._output, infos, self._per_shard, self._extension)
        write_bytes_atomic(layout.join(self._output, dataset_card.CARD_FILE), card.encode("utf-8"),
                           mime_type="text/markdown")
        yield len(infos)


class WriteShardIndexes(beam.PTransform):
    """The `shards` output of WriteShards -> dataset.json (wids), sizes.json (open_clip), README.md (datasets)."""

    def __init__(self, output: str, samples_per_shard: int, image_extension: str):
        super().__init__()
        self._fn = _WriteIndexesFn(output, samples_per_shard, image_extension)

    def expand(self, infos):
        return (infos
                | "AllShards" >> beam.combiners.ToList()
                | "WriteIndexes" >> beam.ParDo(self._fn))
