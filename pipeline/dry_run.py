"""`--dry_run`, on every runner: after the launch's checks of the options and the model (pipeline/launch.py), every
input record is read and validated here, in the launching process, as the job's readers do (the same parser, the
same error rows), and the job is told in a few lines: records, requests, images, invalid rows by kind, identical
repeats, the batch, and where a TPU is known the estimated time and cost. Nothing is generated, and nothing is
written under the output (no lease, no folder).

Records are held one at a time; what is kept per request is its id and parameters' hash and its image file names,
so a file of hundreds of thousands of records needs tens of megabytes. BigQuery inputs are not read (that needs a
query job); the lines say so.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
import types

from apache_beam.io.filesystems import FileSystems

from transforms.inputs.readers import WARNING_TAG, _ReadRequestsFn, canonical_path
from transforms.inputs.template_records import template_request
from transforms.requests import INVALID_TAG, GenerationRequest, max_images_message

from .errors import UsageError

# List prices per chip-hour in US dollars by TPU chip (docs/performance.md says where they come from; v6e's is the
# on-demand price, assumed).
PRICE_PER_CHIP_HOUR = {"v5e": 1.20, "v6e": 2.70}


@dataclasses.dataclass
class InputSurvey:
    """What the inputs hold, as the job would read them."""

    files: int = 0
    records: int = 0  # records read (requests and invalid rows of the readers)
    requests: int = 0  # distinct requests the job would plan
    images: int = 0  # images those requests ask for
    duplicates: int = 0  # identical repeats of an id (generated once)
    invalid: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # error rows by kind
    warnings: list = dataclasses.field(default_factory=list)
    bigquery_sources: int = 0  # tables and queries not read by a dry run
    seconds: float = 0.0

    @property
    def invalid_rows(self) -> int:
        return sum(self.invalid.values())


def _readable(path: str):
    """What the readers' DoFn takes for a file (Beam's ReadableFile: only its path is used)."""
    return types.SimpleNamespace(metadata=types.SimpleNamespace(path=path))


def _params_digest(request: GenerationRequest) -> bytes:
    return hashlib.sha256(repr(request.params()).encode("utf-8", "surrogatepass")).digest()[:16]


def survey_inputs(job) -> InputSurvey:
    """Read and validate every record of the job's input files, then take the repeats and conflicts out as the job's
    DeduplicateRequests does (a later record with the same id: an identical repeat, or a conflicting error row; a
    request naming an image file another request writes: an error row)."""
    source, started = job.spec.input, time.perf_counter()
    survey = InputSurvey(bigquery_sources=len(source.bigquery))
    paths: dict[str, None] = {}
    for pattern in source.files:
        for metadata in FileSystems.match([pattern])[0].metadata_list:
            paths.setdefault(canonical_path(metadata.path), None)
    templates = {canonical_path(t.source) for t in job.templates}  # read at launch, expanded below
    fn = _ReadRequestsFn(_plain(source.input_format), job.defaults, source.columns, job.spec.reliability.read_timeout_s)
    fn.setup()
    fold = str.lower if job.case_insensitive_output else (lambda name: name)
    first: dict[str, bytes] = {}  # id -> its first record's parameters (hashed)
    owner: dict[str, str] = {}  # image file name (folded) -> the id that writes it
    for path in sorted(p for p in paths if p not in templates):  # GenerationRequest.position's order
        survey.files += 1
        for out in fn.process(_readable(path)):
            tag = getattr(out, "tag", None)
            if tag == WARNING_TAG:
                survey.warnings.append(out.value["warning"])
                continue
            survey.records += 1
            if tag == INVALID_TAG:
                survey.invalid[out.value.get("kind") or "error"] += 1
                continue
            _plan(out, survey, first, owner, fold)
    for template in job.templates:  # every record, made and validated as the job's ExpandTemplates makes it
        survey.files += 1
        for position in range(template.count):
            survey.records += 1
            made = template_request(template, position, job.defaults)
            if isinstance(made, dict):
                survey.invalid[made.get("kind") or "error"] += 1
            else:
                _plan(made, survey, first, owner, fold)
    survey.seconds = time.perf_counter() - started
    return survey


def _plan(request: GenerationRequest, survey: InputSurvey, first: dict, owner: dict, fold) -> None:
    digest = _params_digest(request)
    seen = first.get(request.id)
    if seen is not None:
        if seen == digest:
            survey.duplicates += 1
        else:
            survey.invalid["conflicting_id"] += 1
        return
    first[request.id] = digest
    names = [fold(task.file_name) for task in request.tasks()]
    if any(owner.get(name, request.id) != request.id for name in names):
        survey.invalid["file_name_collision"] += 1
        return
    for name in names:
        owner[name] = request.id
    survey.requests += 1
    survey.images += request.num_images


def _plain(value):
    return getattr(value, "value", value)


def estimate_lines(images: int, preflight: dict | None) -> list[str]:
    """The estimated time and cost of `images` on the TPU the preflight compiled for, or why there is none."""
    if not preflight or not preflight.get("est_seconds_per_image"):
        return ["estimate: none (no TPU topology known: the TPU preflight gives one for TPU workers or a local TPU)"]
    per_image, chips, chip = preflight["est_seconds_per_image"], preflight.get("chips", 1), preflight.get("chip")
    worker_hours = images * per_image / 3600
    line = (f"estimate: {per_image:.3f} s per image on one {preflight.get('topology')} worker, so "
            f"{_duration(images * per_image)} on one worker for {images} images ({worker_hours * chips:.2f} "
            f"chip-hours")
    price = PRICE_PER_CHIP_HOUR.get(chip)
    if price is not None:
        line += f", about ${worker_hours * chips * price:.2f} at ${price:.2f} per {chip} chip-hour"
    return [line + "; start-up not counted; the preflight's calibrated estimate)"]


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{s:02d}"


def summary_lines(job, survey: InputSurvey, runner: str) -> list[str]:
    """What the dry run prints: what the job would do, and that it did nothing."""
    kinds = ", ".join(f"{kind} {n}" for kind, n in survey.invalid.most_common())
    lines = [f"dry run ({runner}): the options and the model {job.load.model} were checked, and every record of "
             f"{survey.files} input file(s) read in {survey.seconds:.1f} s",
             f"records {survey.records}: {survey.requests} request(s) for {survey.images} image(s), "
             f"{survey.invalid_rows} invalid row(s){f' ({kinds})' if kinds else ''}, {survey.duplicates} identical "
             f"repeat(s)"]
    if survey.bigquery_sources:
        lines.append(f"not read: {survey.bigquery_sources} BigQuery table(s) or query(ies) (the job reads them)")
    lines += [f"warning: {w}" for w in survey.warnings]
    d = job.defaults
    steps = f"{d.num_inference_steps} steps" if d.num_inference_steps else "the checkpoint's steps"
    lines.append(f"batch {job.load.engine.batch_size}: {job.batch_choice or 'given by --batch_size'}; a record that "
                 f"gives none gets {d.height}x{d.width} and {steps}")
    lines += estimate_lines(survey.images, job.preflight)
    lines.append(f"nothing generated, nothing written under {job.spec.output.output}")
    return lines


def check_max_images(job, survey: InputSurvey) -> None:
    """UsageError when the job would stop at --max_images (it would generate nothing)."""
    limit = job.spec.limits.max_images
    if limit is not None and survey.images > limit:
        raise UsageError(max_images_message(survey.images, limit).replace("nothing was generated",
                                                                          "the job would generate nothing"))
