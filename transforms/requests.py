"""Typed requests and what the job does with them once read: `GenerationRequest` (one validated record),
`ImageTask` (one image of it), `DeduplicateRequests` (one request per id, no two writing one file) and
`EnforceMaxImages` (--max_images).

Records become requests in transforms/inputs/ (readers, coercion, validation, ids and seeds).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import apache_beam as beam
from apache_beam.metrics import Metrics

from . import layout
from .metrics import NAMESPACE as METRICS_NAMESPACE

INVALID_TAG = "invalid"
DUPLICATE_TAG = "duplicates"


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One validated record: everything needed to generate its images and name them."""

    id: str
    prompt: str
    seed: int
    height: int
    width: int
    num_inference_steps: int | None
    guidance_scale: float | None
    num_images: int
    source: str = ""
    line: int | None = 0  # None where the source has no order (a BigQuery row)
    metadata: str = ""  # the record's extra columns as compact JSON ("" for none), for its manifest rows
    # Image-conditioned generation: the references' URIs (resolved, as read), and once the job has read them
    # (ResolveReferences) the sha256 of each file and each one's processed size (height, width), which batches share.
    reference_images: tuple[str, ...] = ()
    reference_sha256: tuple[str, ...] = ()
    reference_signature: tuple[tuple[int, int], ...] = ()
    # The job's unmerged LoRA adapter the record names (--lora_per_record; "" = none) and its identity: the adapter
    # file's sha256 and the scale, part of the image's fingerprint and manifest row.
    lora: str = ""
    lora_sha256: str = ""
    lora_scale: float = 1.0

    def params(self) -> tuple:
        """What makes two records with the same id the same request (where they came from does not)."""
        return (self.prompt, self.seed, self.height, self.width, self.num_inference_steps, self.guidance_scale,
                self.num_images, self.reference_images) + ((self.lora,) if self.lora else ())

    def lora_entry(self) -> dict | None:
        """The adapter as the manifest and the fingerprint carry it: {name, sha256, scale}, None for none."""
        return {"name": self.lora, "sha256": self.lora_sha256, "scale": self.lora_scale} if self.lora else None

    def with_references_read(self, sha256: tuple[str, ...], signature: tuple[tuple[int, int], ...]
                             ) -> "GenerationRequest":
        """This request once its references are read: each file's sha256 and processed size (id unchanged)."""
        if len(sha256) != len(self.reference_images) or len(signature) != len(self.reference_images):
            raise ValueError(f"request {self.id!r} has {len(self.reference_images)} references, got "
                             f"{len(sha256)} digests and {len(signature)} sizes")
        return dataclasses.replace(self, reference_sha256=tuple(sha256), reference_signature=tuple(signature))

    def reference_entries(self) -> list[dict]:
        """The references as the manifest and the image text carry them: [{uri, sha256}] ([] for none)."""
        return [{"uri": uri, "sha256": sha} for uri, sha in zip(self.reference_images, self.reference_sha256)]

    def tasks(self) -> list["ImageTask"]:
        return [ImageTask(self, j) for j in range(self.num_images)]

    def metadata_values(self) -> dict:
        """The extra columns by name, typed as read ({} when the record had none)."""
        return json.loads(self.metadata) if self.metadata else {}

    def position(self) -> tuple:
        """Where the record came from, as a sort key that never compares None with a number: the first of several
        records with one id is the one kept (rows without a line are ordered by their parameters)."""
        return self.source, -1 if self.line is None else self.line, repr(self.params())


@dataclasses.dataclass(frozen=True)
class ImageTask:
    """Image `index` of a request: the unit that is batched, generated and written."""

    request: GenerationRequest
    index: int

    @property
    def seed(self) -> int:
        return self.request.seed + self.index

    @property
    def file_name(self) -> str:
        return layout.image_file_name(self.request.id, self.index, self.request.num_images)

    @functools.cached_property
    def request_fingerprint(self) -> str:
        """transforms/fingerprints.py's request fingerprint of this image, computed once: it is kept with the task
        (pickled with it) wherever the task goes, and a task placed elsewhere keeps it (`placed`)."""
        from .fingerprints import request_fingerprint

        return request_fingerprint(self)

    def keeping_fingerprint(self, placed: "ImageTask") -> "ImageTask":
        """`placed` (this image's task as a sink places it: a subclass with its shard and key) with this task's
        request fingerprint, when it is already computed."""
        if "request_fingerprint" in self.__dict__:
            placed.__dict__["request_fingerprint"] = self.__dict__["request_fingerprint"]
        return placed

    @property
    def shape_key(self) -> str:
        """Batches never mix these: (height, width, steps, guidance, the processed size of each reference, so
        that a batch's rows have the same reference token counts, and the LoRA adapter), as a deterministic string
        key."""
        r = self.request
        key = f"{r.height}x{r.width}/steps={r.num_inference_steps}/guidance={r.guidance_scale}"
        if r.reference_images:
            key += "/refs=" + ",".join(f"{h}x{w}" for h, w in r.reference_signature)
        if r.lora:  # one adapter per batch: the generate call names it (model.nets.lora_bank)
            key += "/lora=" + r.lora
        return key


class MaxImagesExceeded(RuntimeError):
    """The job would generate more images than --max_images allows."""


def max_images_message(count: int, limit: int) -> str:
    return (f"the job would generate {count} images, above --max_images={limit}; nothing was generated. Raise "
            f"--max_images or split the input")


def _within_max_images(task, count: int, limit: int):
    if count > limit:
        raise MaxImagesExceeded(max_images_message(count, limit))
    return task


class EnforceMaxImages(beam.PTransform):
    """Image tasks -> the same tasks, or the job fails before any of them reaches inference when there are more
    than `limit`. The count is a side input, so the runner finishes counting before the first task passes: a job
    over the limit produces nothing, and nothing already produced (a resumed job's images) is touched."""

    def __init__(self, limit: int):
        super().__init__()
        self._limit = limit

    def expand(self, tasks):
        count = tasks | "CountImages" >> beam.combiners.Count.Globally()
        return tasks | "CheckMaxImages" >> beam.Map(_within_max_images, beam.pvalue.AsSingleton(count), self._limit)


def _request_fields(request: GenerationRequest) -> dict:
    """A request's parameters for an error row (where it came from is in the row already)."""
    return {k: v for k, v in dataclasses.asdict(request).items() if k not in ("source", "line", "metadata")}


class _DeduplicateFn(beam.DoFn):
    """(id, [requests]) -> the first request (by source, line), plus an error row for each later record with the
    same id but different parameters. Identical repeats are dropped (generated once) and counted."""

    def __init__(self):
        self._duplicates = Metrics.counter(METRICS_NAMESPACE, "records_duplicate")
        self._conflicts = Metrics.counter(METRICS_NAMESPACE, "records_conflicting_id")
        self._invalid = Metrics.counter(METRICS_NAMESPACE, "records_invalid")  # same counter as the parser's

    def process(self, element):
        request_id, requests = element
        ordered = sorted(requests, key=GenerationRequest.position)
        first = ordered[0]
        yield first
        for other in ordered[1:]:
            if other.params() == first.params():
                self._duplicates.inc()
                yield beam.pvalue.TaggedOutput(DUPLICATE_TAG, other)
                continue
            self._conflicts.inc()
            self._invalid.inc()
            differing = [name for name, a, b in zip(
                ("prompt", "seed", "height", "width", "num_inference_steps", "guidance_scale", "num_images",
                 "reference_images"),
                first.params(), other.params()) if a != b]
            yield beam.pvalue.TaggedOutput(INVALID_TAG, layout.error_row(
                source=other.source, line=other.line, id=request_id, kind=layout.DUPLICATE_ID,
                reason=(f"duplicate id {request_id!r} with conflicting parameters ({', '.join(differing)} differ "
                        f"from {first.source}:{first.line}, which is kept)"),
                record=_request_fields(other),
                field="id", value=request_id))


def _name_collisions(element):
    """(file name as the output folder compares it, [(file name, request that would write it)]) -> (id, (its file
    name, the kept request's file name, kept request)) for every request but the first (by source, line) when
    several different requests claim the name."""
    _, claimants = element
    ordered = sorted(claimants, key=lambda c: c[1].position())
    kept_name, kept = ordered[0]
    for name, other in ordered[1:]:
        yield other.id, (name, kept_name, kept)


def collision_cause(request: GenerationRequest, file_name: str, kept: GenerationRequest, kept_name: str) -> str:
    """Why `request`'s image `file_name` is the kept request's image `kept_name`, for the error row: an image number,
    a case difference the output folder does not keep, or an id that is the other one's safe file name."""
    if file_name != kept_name:
        return f"the output folder does not tell upper from lower case, and {kept_name!r} is that file"
    if kept.num_images > 1 or request.num_images > 1:
        return ("{stem}-{j}.png names the images of a request with num_images > 1, so an id such as 'x-1' collides "
                "with request 'x'")
    return ("an id outside [A-Za-z0-9._-] is stored under a safe form of it with a hash, and the other id is that "
            "very name")


class _DropCollidingFn(beam.DoFn):
    """(id, {'request': [request], 'collisions': [(file name, kept file name, kept request)]}) -> the request, or
    one error row when one of its image names is another request's (`{id}-{j}.png` of a multi-image request vs an
    id `x-1`; names differing in case only, in a case-insensitive output folder)."""

    def __init__(self):
        self._collisions = Metrics.counter(METRICS_NAMESPACE, "records_file_name_collision")
        self._invalid = Metrics.counter(METRICS_NAMESPACE, "records_invalid")

    def process(self, element):
        request_id, joined = element
        for request in joined["request"]:
            if not joined["collisions"]:
                yield request
                continue
            file_name, kept_name, kept = min(joined["collisions"], key=lambda c: (c[2].position(), c[0]))
            self._collisions.inc()
            self._invalid.inc()
            yield beam.pvalue.TaggedOutput(INVALID_TAG, layout.error_row(
                source=request.source, line=request.line, id=request_id, kind=layout.FILE_NAME_COLLISION,
                reason=(f"its image {file_name!r} would overwrite an image of request {kept.id!r} ({kept.source}:"
                        f"{kept.line}), which is kept: {collision_cause(request, file_name, kept, kept_name)}; "
                        f"choose another id"),
                record=_request_fields(request),
                field="id", value=request_id, file_name=file_name))


class DeduplicateRequests(beam.PTransform):
    """Requests -> {'requests': one per id, 'invalid': error rows for conflicting duplicate ids and for requests
    whose image file names another request already writes, 'duplicates': identical repeats (dropped: generated
    once)}. `fold_case`: file names that differ only in case are the same file (a case-insensitive output folder,
    as on macOS and Windows)."""

    def __init__(self, fold_case: bool = False):
        super().__init__()
        self._fold_case = fold_case

    def expand(self, requests):
        fold = (lambda name: name.lower()) if self._fold_case else (lambda name: name)
        out = (requests
               | "KeyById" >> beam.Map(lambda r: (r.id, r))
               | "GroupById" >> beam.GroupByKey()
               | "PickFirst" >> beam.ParDo(_DeduplicateFn()).with_outputs(INVALID_TAG, DUPLICATE_TAG,
                                                                          main="requests"))
        # Different ids can still name the same file ("x" with 2 images writes x-1.png, as does id "x-1"): the
        # later request (by source, line) is rejected whole, so no image is overwritten by another request's.
        collisions = (out.requests
                      | "KeyByFileName" >> beam.FlatMap(lambda r: [(fold(t.file_name), (t.file_name, r))
                                                                   for t in r.tasks()])
                      | "GroupByFileName" >> beam.GroupByKey()
                      | "Collisions" >> beam.FlatMap(_name_collisions))
        checked = ({"request": out.requests | "KeyKeptById" >> beam.Map(lambda r: (r.id, r)),
                    "collisions": collisions}
                   | "JoinCollisions" >> beam.CoGroupByKey()
                   | "DropColliding" >> beam.ParDo(_DropCollidingFn()).with_outputs(INVALID_TAG, main="requests"))
        invalid = (out[INVALID_TAG], checked[INVALID_TAG]) | "DedupInvalid" >> beam.Flatten()
        return {"requests": checked.requests, "invalid": invalid, DUPLICATE_TAG: out[DUPLICATE_TAG]}
