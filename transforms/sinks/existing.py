"""What an output already holds, for `--skip_existing`: an image written earlier is checked against the task it
would be made for, from the earlier manifest rows' fingerprints or from the image's own bytes and text.

Rows vouch only for the bytes they name: an image is kept by its rows alone when the object now there has the
CRC32C they record (gs://: from the listing, nothing downloaded) or, locally, the sha256 (the file is hashed). An
object whose bytes no row names (a run replaced it and was stopped before writing its manifest, or anything else
wrote it) is read, and its own text decides: the image carries the request and model fingerprints it was made
for, so it is authoritative for its own bytes, whatever rows an earlier run left.

The files sink uses `SkipExisting` (every image of `images/`); the WebDataset sink checks whole shards from their
sidecars and reuses staged images with `check_existing_image` (transforms/sinks/webdataset.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
from typing import Iterable

import apache_beam as beam
from apache_beam.metrics import Metrics

from .. import layout, retries
from ..checksums import Stored, crc32c, list_folder, local_digests
from ..identity import DECISIVE_FIELDS, RECORDED_FIELDS as IDENTITY_FIELDS, ImageIdentity, ModelIdentity
from ..phash import phash_image
from ..metrics import NAMESPACE as METRICS_NAMESPACE
from ..score_filters import first_broken
from . import writes
from .encoding import PIL_FORMATS, ImageEncoding, read_image_text, reference_text

LOGGER = logging.getLogger(__name__)
SKIPPED_TAG = "skipped"
STALE_TAG = "stale"
DAMAGED_TAG = "damaged"
MISSING_TAG = "missing"
# Why an image is stale, by the decisive identity field (transforms/identity.py) it records otherwise.
STALE_BECAUSE = {
    "request_fingerprint": "was made for another request (its request fingerprint differs)",
    "model_fingerprint": "was made by another model (its model fingerprint differs: another checkpoint, dtype, "
                         "quantization or max_sequence_length)",
}


class ExistingImageMismatch(ValueError):
    """An image already at a task's name is not that task's image (other request, wrong size, damaged bytes)."""

    def __init__(self, file_name: str, problem: str):
        super().__init__(f"{file_name}: {problem}")
        self.file_name = file_name
        self.problem = problem


class StaleImage(ExistingImageMismatch):
    """A sound image already at a task's name that was made for another request or by another model (its
    fingerprints, or the fields its text records, differ): generated again and counted `stale`."""


@dataclasses.dataclass(frozen=True)
class FoundImage:
    """What an image already written says of itself, once checked against its task: the figures of its manifest
    row that the task does not give."""

    sha256: str
    num_bytes: int
    num_inference_steps: int
    guidance_scale: float
    prompt_truncated: bool | None
    model: str
    made_by: ModelIdentity  # the model identity it records (the job's, when its model fingerprint is the job's)
    crc32c: str | None = None
    phash: str | None = None
    scores: dict | None = None  # --score_model: what the earlier run scored it (and the filter it broke)
    filtered: dict | None = None

    def row(self, task, *, file_name: str, uri: str, key: str | None = None) -> dict:
        """Its manifest row (generation_ms None: its time was not measured by this run)."""
        return layout.manifest_row(
            task, file_name=file_name, uri=uri, sha256=self.sha256, num_bytes=self.num_bytes,
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            prompt_truncated=self.prompt_truncated, model=self.model, generation_ms=None,
            identity=ImageIdentity.of(task, self.made_by), key=key, crc32c=self.crc32c, phash=self.phash,
            scores=self.scores, filtered=self.filtered)


def check_existing_image(task, data: bytes, encoding: ImageEncoding | None = None,
                         model_identity: ModelIdentity | str | None = None, name: str | None = None) -> FoundImage:
    """Check that `data` (an image a previous run wrote, named `name` in messages: the task's stored file name by
    default) is `task`'s image, from its bytes and the text it carries (PNG text chunks; the EXIF description of a
    WebP or JPEG).

    Raises ExistingImageMismatch unless the bytes are a complete, undamaged image of the encoding's format (PNG:
    every chunk checksum; WebP/JPEG: all pixels decode), and StaleImage unless it has the task's size and its text
    records the task's id, prompt (or its sha256, for a JPEG whose EXIF could not hold it) and seed, its steps and
    guidance when the record gives them, and the decisive fields of the image's identity (transforms/identity.py:
    the task's request fingerprint, the model fingerprint of `model_identity`) that the text has (images of older
    runs do not; their model_fingerprint is then None). Text keys of earlier versions are read too
    (encoding.EARLIER_TEXT_KEYS)."""
    from PIL import Image

    encoding = encoding or ImageEncoding()
    expected_format = PIL_FORMATS[encoding.format]
    r = task.request
    file_name = name or encoding.stored_name(task.file_name)
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, size, text = im.format, im.size, read_image_text(im)
            im.load()  # a truncated WebP/JPEG fails to decode here; the pixels give the pHash
            phash = phash_image(im)
        if fmt == "PNG":
            with Image.open(io.BytesIO(data)) as im:
                im.verify()  # every chunk's CRC, through IEND: a truncated or damaged file fails here
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes; all mean the same here
        raise ExistingImageMismatch(file_name, f"not a readable {expected_format} ({type(e).__name__}: {e})") \
            from None
    if fmt != expected_format:
        raise ExistingImageMismatch(file_name, f"is {fmt}, not {expected_format}")
    if size != (r.width, r.height):
        raise StaleImage(file_name, f"is {size[0]}x{size[1]} (WxH), the request asks for {r.width}x{r.height}")
    expected = {"id": r.id, "seed": str(task.seed)}
    if "prompt" in text or "prompt_sha256" not in text:
        expected["prompt"] = r.prompt
    else:
        expected["prompt_sha256"] = hashlib.sha256(r.prompt.encode("utf-8")).hexdigest()
    if r.num_inference_steps is not None:
        expected["num_inference_steps"] = str(int(r.num_inference_steps))
    if r.guidance_scale is not None:
        expected["guidance_scale"] = repr(float(r.guidance_scale))
    # References: the same files (URIs and sha256); an image without references is not one made with them.
    expected["reference_images"] = reference_text(r) if r.reference_images else None
    for key, value in expected.items():
        if text.get(key) != value:
            raise StaleImage(file_name, f"was made for another request (its {key!r} differs)")
    identity = ImageIdentity.of(task, model_identity)
    differs = identity.differs_from(text)
    if differs:
        raise StaleImage(file_name, STALE_BECAUSE.get(differs, f"was made otherwise (its {differs!r} differs)"))
    try:
        steps, guidance = int(text["num_inference_steps"]), float(text["guidance_scale"])
    except (KeyError, ValueError):
        raise ExistingImageMismatch(file_name, "lacks its steps/guidance text") from None
    truncated = {"true": True, "false": False}.get(text.get("prompt_truncated", ""))
    made_by = identity.model if identity.model.model_fingerprint and \
        text.get("model_fingerprint") == identity.model.model_fingerprint else ModelIdentity.recorded_in(text)
    return FoundImage(sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data), num_inference_steps=steps,
                      guidance_scale=guidance, prompt_truncated=truncated, model=text.get("model", ""),
                      made_by=made_by, crc32c=crc32c(data), phash=phash)


def existing_manifest_row(task, data: bytes, uri: str, encoding: ImageEncoding | None = None,
                          model_identity: ModelIdentity | str | None = None) -> dict:
    """The manifest row of an image a previous run wrote for `task` at `uri` under its stored file name, rebuilt
    from its bytes and text; ExistingImageMismatch / StaleImage as `check_existing_image` says."""
    encoding = encoding or ImageEncoding()
    found = check_existing_image(task, data, encoding, model_identity)
    return found.row(task, file_name=encoding.stored_name(task.file_name), uri=uri)


class _SkipExistingFn(retries.CountingRetriesFn):
    """Reads and checks each listed image (the listing as a side input {file name: Stored}): a task whose image
    checks out -> its manifest row (tagged `skipped`); else the task, to be generated (an image made for another
    request or model is counted `stale` and tagged so; a damaged one is counted replaced and tagged `damaged`; one
    not there is tagged `missing`). What --skip_existing does for an image no earlier manifest row describes; alone,
    the whole check of runs before fingerprints."""

    def __init__(self, output: str, encoding: ImageEncoding | None = None,
                 model_identity: ModelIdentity | str | None = None, score_rules: tuple = ()):
        self._output = output
        self._encoding = encoding or ImageEncoding()
        self._model = ModelIdentity.of(model_identity)
        self._score_rules = tuple(score_rules)  # the job's score filters, applied again to a kept image's scores
        self._skipped = Metrics.counter(METRICS_NAMESPACE, "images_skipped")
        self._replaced = Metrics.counter(METRICS_NAMESPACE, "existing_images_replaced")
        self._stale = Metrics.counter(METRICS_NAMESPACE, "images_stale")
        self._read = Metrics.counter(METRICS_NAMESPACE, "existing_images_read")
        self._hashed = Metrics.counter(METRICS_NAMESPACE, "existing_images_hashed")
        self._changed = Metrics.counter(METRICS_NAMESPACE, "existing_images_changed")
        self._refiltered_count = Metrics.counter(METRICS_NAMESPACE, "existing_images_refiltered")

    def process(self, task, existing):
        if self._encoding.stored_name(task.file_name) not in existing:
            yield from self._missing_task(task)
            return
        yield from self._read_and_check(task)

    def _read_and_check(self, task, file_name: str | None = None):
        """`file_name`: where the image is (default: its name under images/; a filtered one's under filtered/)."""
        file_name = file_name or self._encoding.stored_name(task.file_name)
        uri = layout.join(self._output, file_name)
        try:
            data = writes.read_bytes(uri)
        except FileNotFoundError:  # deleted since the listing
            yield from self._missing_task(task)
            return
        self._read.inc()
        try:
            row = existing_manifest_row(task, data, uri, self._encoding, self._model)
        except StaleImage as e:
            yield from self._stale_task(task, str(e))
            return
        except ExistingImageMismatch as e:
            self._replaced.inc()
            LOGGER.warning("--skip_existing: %s; generating it again", e)
            yield beam.pvalue.TaggedOutput(DAMAGED_TAG, file_name)
            yield task
            return
        self._skipped.inc()
        yield beam.pvalue.TaggedOutput(SKIPPED_TAG, row)

    def _missing_task(self, task):
        yield beam.pvalue.TaggedOutput(MISSING_TAG, self._encoding.stored_name(task.file_name))
        yield task

    def _stale_task(self, task, why: str):
        self._stale.inc()
        LOGGER.info("--skip_existing: %s; generating it again", why)
        yield beam.pvalue.TaggedOutput(STALE_TAG, self._encoding.stored_name(task.file_name))
        yield task


def move_object(output: str, source: str, target: str) -> None:
    """Move `source` to `target` (names relative to `output`): the bytes written atomically there first, then the
    old object deleted, so a stop in between leaves both, never neither."""
    from apache_beam.io.filesystems import FileSystems

    writes.write_bytes_atomic(layout.join(output, target), writes.read_bytes(layout.join(output, source)))
    FileSystems.delete([layout.join(output, source)])


# What a skip decision needs of an earlier manifest row (never its prompt or metadata, which can be large).
RECORDED_FIELDS = ("bytes", "sha256", "crc32c", "model", "prompt_truncated", "num_inference_steps",
                   "guidance_scale", *IDENTITY_FIELDS, "phash", "scores", "filtered")


def recorded_rows(readable_file) -> Iterable[tuple[str, dict]]:
    """An earlier run's manifest file (manifest-*.jsonl or existing-*.jsonl) -> (file name, RECORDED_FIELDS) for
    each row with both fingerprints, read line by line. Rows without them (older runs) and lines that do not parse
    are left out: their images are read and checked instead."""
    with readable_file.open() as f:
        for number, line in enumerate(io.TextIOWrapper(f, encoding="utf-8", errors="replace"), 1):
            try:
                row = json.loads(line)
                file_name = row["file_name"]
            except (ValueError, KeyError, TypeError):
                if line.strip():
                    LOGGER.warning("--skip_existing: line %d of %s is not a manifest row; ignored", number,
                                   readable_file.metadata.path)
                continue
            if isinstance(file_name, str) and row.get("request_fingerprint") and row.get("model_fingerprint"):
                yield file_name, {k: row.get(k) for k in RECORDED_FIELDS}


class _DecideExistingFn(_SkipExistingFn):
    """(file name, {tasks, listed: [Stored], recorded rows}) -> the same outputs as _SkipExistingFn, from the listing
    and the earlier manifest rows: the rows that describe the object now there (the CRC32C the gs:// listing gives,
    or locally the file's sha256, and the size they record) decide. All of them carrying the task's request
    fingerprint and this model's: skipped without being read; all carrying others: stale. An object no row
    describes (a run killed before its manifest was written, or one that replaced the bytes an older row names),
    or rows that disagree: read and checked as _SkipExistingFn does, its own text deciding."""

    def process(self, element, existing=None):
        file_name, found = element
        listed, recorded = list(found["listed"]), list(found["recorded"])
        if not listed and found.get("filtered"):  # a score filter left it out: under filtered/ (score_filters.py)
            listed, file_name = list(found["filtered"]), layout.filtered_file_name(file_name)
        for task in found["tasks"]:
            if not listed:
                yield from self._missing_task(task)
            elif not recorded:
                yield from self._read_and_check(task, file_name)
            else:
                yield from self._decide(task, file_name, listed[0], recorded)

    def _describing(self, file_name: str, listed: Stored, recorded: list[dict]) -> tuple[list[dict], Stored] | None:
        """The rows that name the bytes now stored (with the object's figures, CRC32C included); None when a local
        file is gone since the listing."""
        if listed.crc32c is not None:  # gs://: the listing says which bytes the object holds
            return [r for r in recorded if r.get("crc32c") == listed.crc32c and r.get("bytes") == listed.size], listed
        try:
            size, sha, crc = local_digests(layout.join(self._output, file_name))
        except FileNotFoundError:
            return None
        self._hashed.inc()
        return [r for r in recorded if r.get("sha256") == sha and r.get("bytes") == size], Stored(size, crc)

    def _decide(self, task, file_name: str, listed: Stored, recorded: list[dict]):
        described = self._describing(file_name, listed, recorded)
        if described is None:
            yield from self._missing_task(task)
            return
        rows, stored = described
        if not rows:  # the bytes there are not the ones any row names: the image's own text decides
            self._changed.inc()
            LOGGER.info("--skip_existing: %s is not the image its manifest rows name (its bytes changed since: a "
                        "run stopped while replacing it?); reading it", file_name)
            yield from self._read_and_check(task, file_name)
            return
        mine = ImageIdentity.of(task, self._model).fields()
        want = tuple(mine[name] for name in DECISIVE_FIELDS)
        prints = {tuple(rec.get(name) for name in DECISIVE_FIELDS) for rec in rows}
        if want not in prints:  # named by the last field that differs: the model's before the request's
            which = next(name for i, name in reversed(list(enumerate(DECISIVE_FIELDS)))
                         if any(p[i] != want[i] for p in prints))
            yield from self._stale_task(task, f"{file_name}: its manifest row has another "
                                              f"{which.replace('_', ' ')}")
            return
        if len(prints) > 1:  # rows that disagree about these very bytes: look at them
            yield from self._read_and_check(task, file_name)
            return
        rec = rows[0]
        self._skipped.inc()
        found = FoundImage(sha256=rec["sha256"], num_bytes=stored.size, num_inference_steps=rec["num_inference_steps"],
                           guidance_scale=rec["guidance_scale"], prompt_truncated=rec["prompt_truncated"],
                           model=rec["model"], made_by=self._model, crc32c=stored.crc32c, phash=rec.get("phash"),
                           scores=rec.get("scores"), filtered=rec.get("filtered"))
        if found.scores is not None:  # this run's thresholds (none: every image in the dataset) decide
            found, file_name = self._refiltered(task, found, file_name)
        yield beam.pvalue.TaggedOutput(SKIPPED_TAG, found.row(task, file_name=file_name,
                                                              uri=layout.join(self._output, file_name)))

    def _refiltered(self, task, found: FoundImage, file_name: str) -> tuple[FoundImage, str]:
        """A kept image's filter decision under this run's rules (transforms/score_filters.py), the image moved
        between images/ and filtered/ when it changed; (its figures, where it now is)."""
        filtered = first_broken(found.scores, self._score_rules)
        in_images = self._encoding.stored_name(task.file_name)
        target = layout.filtered_file_name(in_images) if filtered else in_images
        if target != file_name:
            move_object(self._output, file_name, target)
            self._refiltered_count.inc()
        return dataclasses.replace(found, filtered=filtered), target


def _in_images(file_name: str) -> str:
    """A filtered image's name as its task's (`filtered/x.png` -> `images/x.png`); any other name as it is."""
    prefix = layout.FILTERED_DIR + "/"
    return f"{layout.IMAGES_DIR}/{file_name[len(prefix):]}" if file_name.startswith(prefix) else file_name


class SkipExisting(beam.PTransform):
    """Image tasks -> {'tasks': those still to generate, 'existing': manifest rows of the images already there,
    'stale': file names of images already there that were made for another request or model, 'damaged': of images
    there that are unreadable or damaged, 'missing': of images not there}: the files sink's
    plan (transforms/sinks/files.py) under --skip_existing.

    The existing images are listed once (`{output}/images/*.png`, or the extension of the job's --image_format;
    on gs:// with each object's CRC32C), and the earlier runs' manifest rows (`manifest/*.jsonl`: manifest-* and
    existing-*) read once, keeping only their fingerprints and stored figures. Both are joined with the tasks by
    file name (_DecideExistingFn), so that an image whose rows name its very bytes (the listed CRC32C; locally the
    file's sha256) and say it is this request's, made by this model (`model_fingerprint`), is skipped without
    being read. Images no row describes, bytes included, are read and checked (`existing_manifest_row`). Every kept image's row goes to manifest/existing-*.jsonl, so a resumed job's
    manifests still list every image, including those of a run that was killed before writing its manifest.
    `read_manifest=False`: every listed image is read and checked (the behaviour before fingerprints; benchmarks).
    """

    def __init__(self, output: str, encoding: ImageEncoding | None = None,
                 model_identity: ModelIdentity | str | None = None, read_manifest: bool = True,
                 score_rules: tuple = ()):
        """`score_rules`: the job's score filters, applied again to each kept image's recorded scores (the image is
        moved between images/ and filtered/ when its decision changes)."""
        super().__init__()
        self._output = output
        self._encoding = encoding or ImageEncoding()
        self._model = ModelIdentity.of(model_identity)
        self._read_manifest = read_manifest
        self._score_rules = tuple(score_rules)

    def expand(self, tasks):
        from apache_beam.io import fileio

        output, encoding = self._output, self._encoding
        suffix = "." + encoding.extension
        listed = (tasks.pipeline
                  | "ImagesFolder" >> beam.Create([layout.join(output, layout.IMAGES_DIR)])
                  | "ListImages" >> beam.FlatMap(lambda folder: ((f"{layout.IMAGES_DIR}/{name}", found)
                                                                 for name, found in list_folder(folder, suffix))))
        fn_args = (output, encoding, self._model, self._score_rules)
        if not self._read_manifest:
            out = tasks | "SkipExisting" >> beam.ParDo(_SkipExistingFn(*fn_args), beam.pvalue.AsDict(listed)) \
                .with_outputs(SKIPPED_TAG, STALE_TAG, DAMAGED_TAG, MISSING_TAG, main="tasks")
        else:
            recorded = (tasks.pipeline
                        | "ManifestGlob" >> beam.Create([layout.manifest_rows_glob(output)])
                        | "ListManifests" >> fileio.MatchAll(empty_match_treatment=fileio.EmptyMatchTreatment.ALLOW)
                        | "OpenManifests" >> fileio.ReadMatches()
                        | "RecordedRows" >> beam.FlatMap(recorded_rows))
            keyed = tasks | "ByFileName" >> beam.Map(lambda t: (encoding.stored_name(t.file_name), t))
            # Images a score filter left out (filtered/NAME), joined with their task under images/NAME.
            filtered = (tasks.pipeline
                        | "FilteredFolder" >> beam.Create([layout.join(output, layout.FILTERED_DIR)])
                        | "ListFiltered" >> beam.FlatMap(lambda folder: ((f"{layout.IMAGES_DIR}/{name}", found)
                                                                         for name, found in list_folder(folder,
                                                                                                        suffix))))
            recorded = recorded | "UnfilteredNames" >> beam.Map(lambda kv: (_in_images(kv[0]), kv[1]))
            out = ({"tasks": keyed, "listed": listed, "recorded": recorded, "filtered": filtered}
                   | "JoinExisting" >> beam.CoGroupByKey()
                   | "DecideExisting" >> beam.ParDo(_DecideExistingFn(*fn_args))
                   .with_outputs(SKIPPED_TAG, STALE_TAG, DAMAGED_TAG, MISSING_TAG, main="tasks"))
        return {"tasks": out.tasks, "existing": out[SKIPPED_TAG], "stale": out[STALE_TAG],
                DAMAGED_TAG: out[DAMAGED_TAG], MISSING_TAG: out[MISSING_TAG]}
