"""`python -m pipeline.run`: prompts (GCS or local) -> RunInference on FLUX.2 [klein] -> PNGs, manifest, errors.

    python -m pipeline.run                                   # the bundled demo (tiny random weights -> noise)
    python -m pipeline.run --help                            # the job's options; --help_beam: Beam's
    python -m pipeline.run --model=gs://b/FLUX.2-klein-4B --input='gs://b/prompts/*.jsonl' --output=gs://b/out
    python -m pipeline.run --model=black-forest-labs/FLUX.2-klein-4B --input=prompts.jsonl   # a Hugging Face Hub id
    python -m pipeline.run ... --direct_running_mode=multi_processing --direct_num_workers=2
    python -m pipeline.run --model=... --input=prompts.tsv --prompt_column=Prompt --output=...
    python -m pipeline.run --model=... --input=bq://project.dataset.table --temp_location=gs://b/tmp ...
    python -m pipeline.run ... --runner=DataflowRunner --project=... --region=... --temp_location=gs://...

Runner: with no `--runner`, the job runs on Beam's FnApiRunner (the DirectRunner family's portable Python runner,
honouring `--direct_running_mode` / `--direct_num_workers`). Beam's plain `DirectRunner` would first try the Prism
runner, a binary it downloads from GitHub (fails or hangs offline); naming FnApiRunner skips that.

The graph (every step a transform from `transforms/`):
  patterns -> ReadRequests (+ ReadBigQueryRequests per table or query) -> DeduplicateRequests -> image tasks
  -> [SkipExisting] -> BatchByShape
  -> RunInference(Flux2KleinModelHandler).with_exception_handling() -> WriteImages -> manifest
  invalid records + conflicting ids + failed batches -> errors;   counts of everything -> summary.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid

if __name__ == "__main__":  # `python -m pipeline.run`: --help and argument errors before the heavy imports below
    from pipeline.usage import exit_on_usage_error

    exit_on_usage_error(sys.argv[1:])

import apache_beam as beam  # noqa: E402 - after the command line's own check
from apache_beam.io.filesystems import FileSystems
from apache_beam.ml.inference.base import RunInference
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions, StandardOptions, TestOptions

from pipeline.compile_cache import resolve_compilation_cache
from transforms import layout, retries
from transforms.bigquery_input import BigQueryInput, ReadBigQueryRequests, dataset_reference, is_table_uri
from transforms.columns import ColumnMap, parse_column_map
from transforms.fingerprints import model_fingerprint
from transforms.input_check import InputCheckError, check_input_files
from transforms.inference import DEFAULT_INFERENCE_TIMEOUT_S, BatchByShape, Flux2KleinModelHandler
from transforms.metrics import NAMESPACE as METRICS_NAMESPACE
from transforms.outputs import (
    NON_FINITE_TAG, ImageEncoding, SkipExisting, SplitNonFinite, WriteImagesFn, WriteSummary, failed_batch_rows,
    format_summary, read_bytes, write_bytes_atomic,
)
from transforms.preview import DEFAULT_PREVIEW, WritePreview, check_preview
from transforms.progress import ProgressReporter, ReportTotal
from transforms.references import ResolveReferences, default_roots, normalise_root
from transforms.shard_writer import WriteShardIndexes, WriteShards
from transforms.shards import DEFAULT_SAMPLES_PER_SHARD, OUTPUT_FORMATS, check_samples_per_shard
from transforms.requests import (
    DUPLICATE_TAG, WARNING_TAG, DeduplicateRequests, EnforceMaxImages, MaxImagesExceeded, ReadRequests,
    RequestDefaults, csv_field_limit_for,
)

from model.api import (DEFAULT_MAX_SEQUENCE_LENGTH, EngineOptions, LoadSettings, ModelError, count, is_hub_id,
                       optional_count, read_config_and_digest, validate_variant)

from .demo import DEMO_CHECKPOINT_NOTICE, DEMO_DONE, DEMO_DTYPE, DEMO_PROMPTS, DEMO_SIZE, demo_checkpoint, demo_notice
from . import launch_check
from .output_check import check_output
from .errors import UsageError
from .hub_model import hub_model
from .options import DEFAULT_BATCH_SIZE, DEFAULT_OUTPUT, DEFAULT_SIZE, Flux2KleinOptions
from .usage import BEAM_HELP_FLAG, HELP_FLAGS, check_arguments, format_beam_help, format_help

logger = logging.getLogger("pipeline.run")

DEFAULT_RUNNER = "FnApiRunner"
LOCAL_RUNNERS = ("fnapirunner", "directrunner", "bundlebaseddirectrunner", "switchingdirectrunner")
GLOB_CHARACTERS = ("*", "?", "[", "]")
EXAMPLE_HUB_ID = "black-forest-labs/FLUX.2-klein-4B"  # pattern characters of Beam's file matching (fnmatch / glob)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """Everything the graph needs, resolved from the options (demo defaults applied)."""

    patterns: tuple[str, ...]
    input_format: str
    output: str
    load: LoadSettings  # goes unchanged through the handler to model.load
    defaults: RequestDefaults
    skip_existing: bool
    large_model: bool
    model_copies: int | None
    demo: bool = False
    max_images: int | None = None  # most images the job may generate (--max_images); None: no limit
    inference_retries: int = 2  # extra attempts for a failed inference batch (--inference_retries)
    inference_timeout_s: int = DEFAULT_INFERENCE_TIMEOUT_S  # --inference_timeout_s; 0: no limit
    case_insensitive_output: bool = False  # a local output folder where 'A.png' and 'a.png' are one file
    require_accelerator: str | None = None  # 'tpu' or 'gpu': a worker whose JAX finds another platform stops at load
    worker_env: tuple[tuple[str, str], ...] = ()  # (NAME, value) set on each worker before the model loads
    columns: ColumnMap = ColumnMap()  # which column is which generation field (--prompt_column, --column_map, ...)
    bigquery: tuple[BigQueryInput, ...] = ()  # BigQuery tables (--input bq://...) and --input_query
    bigquery_temp_dataset: str | None = None  # project.dataset for --input_query's result (None: Beam makes one)
    input_warnings: tuple[str, ...] = ()  # found at launch (a --column_map column a table lacks)
    encoding: ImageEncoding = ImageEncoding()  # --image_format, --png_compress_level, --quality
    encode_threads: int | None = None  # encoder threads per worker process (--encode_threads); None: its cores
    run_token: str = ""  # this launch, so a worker process's reference cache never serves an earlier job's copy
    output_format: str = "files"  # --output_format: files (one object per image) or webdataset (tar shards)
    samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD  # --samples_per_shard (webdataset)
    preview: int = DEFAULT_PREVIEW  # --preview: images in preview/index.html; 0: no preview
    # What the loaded model is (transforms/fingerprints.py): stored with every image, compared by --skip_existing.
    model_fingerprint: str = ""
    reference_roots: tuple[str, ...] = ()  # --reference_root (normalised), else the --input files' folders

    @property
    def reference_limits(self):
        """--max_reference_images/--max_reference_pixels and --reference_root, with this run's scope for the
        reference cache."""
        return dataclasses.replace(self.defaults.reference_limits, cache_scope=self.run_token,
                                   roots=self.reference_roots)

    @property
    def webdataset(self) -> bool:
        return self.output_format == "webdataset"

    @property
    def model(self) -> str:
        return self.load.model

    @property
    def dtype(self) -> str:
        return self.load.dtype

    @property
    def model_variant(self) -> str | None:
        return self.load.variant

    @property
    def max_sequence_length(self) -> int:
        return self.load.max_sequence_length

    @property
    def batch_size(self) -> int:
        return self.load.engine.batch_size


def is_case_insensitive_folder(folder: str) -> bool:
    """Whether file names differing only in case name the same file in `folder` (macOS, Windows; created if needed):
    a probe file with a lower-case name is looked up under its upper-case name."""
    os.makedirs(folder, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".case-probe-", dir=folder)
    os.close(fd)
    try:
        head, name = os.path.split(probe)
        return os.path.exists(os.path.join(head, name.upper()))
    finally:
        os.remove(probe)


def runner_name(options: PipelineOptions) -> str:
    runner = options.view_as(StandardOptions).runner
    if runner is None:
        return DEFAULT_RUNNER
    return runner if isinstance(runner, str) else type(runner).__name__


def is_local_runner(options: PipelineOptions) -> bool:
    return runner_name(options).rsplit(".", 1)[-1].lower() in LOCAL_RUNNERS


def resolve_job(options: PipelineOptions) -> JobConfig:
    """Apply defaults (and the demo's), and check everything that can be checked before the job starts."""
    o = options.view_as(Flux2KleinOptions)
    patterns = o.input_patterns()
    tables = [p for p in patterns if is_table_uri(p)]
    patterns = [p for p in patterns if not is_table_uri(p)]
    if o.demo_checkpoint and o.model is not None:
        raise UsageError(f"--demo_checkpoint and --model={o.model!r} both name the checkpoint; give one")
    if o.demo_checkpoint and not is_local_runner(options):
        raise UsageError(f"--demo_checkpoint is built on this machine, which the workers of {runner_name(options)} "
                         f"cannot read; give --model=gs://... (a copy of a checkpoint)")
    demo = not (patterns or tables or o.input_query is not None) and o.model is None
    tiny = demo or bool(o.demo_checkpoint)  # the demo's checkpoint, sizes and dtype
    if demo:
        model_uri = demo_checkpoint()
        patterns = [DEMO_PROMPTS]
    else:
        if not (patterns or tables or o.input_query is not None):
            raise UsageError("--input is required with --model (or --input_query; omit --input and --model to run "
                             "the bundled demo)")
        if o.model is None and not o.demo_checkpoint:
            raise UsageError("--model is required with --input; to try your input on the bundled tiny "
                             "random-weight checkpoint (noise images), add --demo_checkpoint; omit both --input and "
                             "--model to run the bundled demo")
        model_uri = o.model if o.model is not None else demo_checkpoint()
        if not is_hub_id(model_uri) and "://" not in model_uri and not os.path.isdir(model_uri):
            raise UsageError(f"--model={model_uri!r} is not a folder (give a diffusers-layout checkpoint folder, "
                             f"a gs:// prefix or a Hugging Face Hub id such as {EXAMPLE_HUB_ID})")

    output = o.output or DEFAULT_OUTPUT
    if any(c in output for c in GLOB_CHARACTERS):
        # Beam's file sinks find their temporary files by pattern: a '[' in the path would make the job fail after
        # every image was written, before the manifest.
        raise UsageError(f"--output={output!r} contains a glob character ({', '.join(GLOB_CHARACTERS)}), which "
                         f"Beam's file sinks cannot use in a path; choose another output location")
    if not is_local_runner(options) and "://" not in output:
        raise UsageError(f"--output={output!r} is a local path, which the workers of {runner_name(options)} cannot "
                         f"share; give a gs:// location")
    size = DEMO_SIZE if tiny else DEFAULT_SIZE
    if o.max_images is not None and o.max_images < 1:
        raise UsageError(f"--max_images must be >= 1, got {o.max_images}")
    if o.inference_retries is None or o.inference_retries < 0:
        raise UsageError(f"--inference_retries must be >= 0, got {o.inference_retries}")
    if o.inference_timeout_s is None or o.inference_timeout_s < 0:
        raise UsageError(f"--inference_timeout_s must be >= 0 (0: no limit), got {o.inference_timeout_s}")
    try:
        optional_count("--model_copies", o.model_copies)
        validate_variant(o.model_variant, name="--model_variant")
        worker_env = tuple(o.worker_env_vars().items())
        if not demo and is_hub_id(model_uri):  # downloaded (or found cached) once, here, before anything else
            model_uri = hub_model(model_uri, o.model_variant, local_runner=is_local_runner(options),
                                  model_cache=o.model_cache,
                                  temp_location=options.view_as(GoogleCloudOptions).temp_location)
        encoding = ImageEncoding(o.image_format, o.png_compress_level, o.quality)
        optional_count("--encode_threads", o.encode_threads)
        if o.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"--output_format={o.output_format!r} is not one of {', '.join(OUTPUT_FORMATS)}")
        check_samples_per_shard(o.samples_per_shard)
        check_preview(o.preview)
        load = LoadSettings(
            model=model_uri, dtype=o.dtype or (DEMO_DTYPE if tiny else "bfloat16"), variant=o.model_variant,
            max_sequence_length=count("--max_sequence_length", o.max_sequence_length
                                      if o.max_sequence_length is not None else DEFAULT_MAX_SEQUENCE_LENGTH),
            cache_dir=o.checkpoint_cache_dir,
            engine=EngineOptions(batch_size=count("--batch_size", o.batch_size if o.batch_size is not None
                                                  else DEFAULT_BATCH_SIZE),
                                 model_shards=count("--model_shards", o.model_shards),
                                 compilation_cache_dir=resolve_compilation_cache(
                                     o.compilation_cache_dir, local_runner=is_local_runner(options),
                                     temp_location=options.view_as(GoogleCloudOptions).temp_location)))
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:  # the configs alone: the job must accept exactly the sizes that generate() accepts
        config, checkpoint = read_config_and_digest(model_uri, load.variant)
        size_multiple = config.size_multiple
    except ModelError as e:
        raise UsageError(f"--model={model_uri!r} cannot be read as a FLUX.2 [klein] checkpoint: "
                         f"{type(e).__name__}: {e}") from e
    defaults = RequestDefaults(
        height=o.height if o.height is not None else size,
        width=o.width if o.width is not None else size,
        num_inference_steps=o.num_inference_steps,
        guidance_scale=o.guidance_scale,
        num_images=o.num_images,
        seed=o.seed,
        max_pixels=o.max_pixels,
        max_prompt_bytes=o.max_prompt_bytes,
        size_multiple=size_multiple,
        max_metadata_bytes=o.max_metadata_bytes,
        max_reference_images=o.max_reference_images,
        max_reference_pixels=o.max_reference_pixels,
    )
    try:
        defaults.validate()
        # The job's default shape compiles while the weights load (model.options.LoadSettings.precompile).
        load = dataclasses.replace(load, precompile=((defaults.height, defaults.width, defaults.num_inference_steps,
                                                      defaults.guidance_scale),))
        columns = ColumnMap(prompt_column=o.prompt_column, id_column=o.id_column,
                            renames=parse_column_map(o.column_map)).validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    bigquery = _bigquery_inputs(options, tables, o.input_query, o.bigquery_temp_dataset)
    reference_roots = _reference_roots(o.reference_root, patterns)

    files: dict[str, None] = {}  # every matched file once, in order
    for pattern in patterns:
        try:
            matched = FileSystems.match([pattern])[0].metadata_list
        except Exception as e:  # noqa: BLE001 - any filesystem error means the same thing to the user
            raise UsageError(f"--input {pattern!r} cannot be read: {e}") from e
        if not matched:
            raise UsageError(f"--input {pattern!r} matches no file")
        if all("://" not in m.path and os.path.isdir(m.path) for m in matched):
            raise UsageError(f"--input {pattern!r} is a folder, not a file; give the files in it, e.g. "
                             f"{os.path.join(pattern, '*.jsonl')!r}")
        files.update((m.path, None) for m in matched)
    try:  # a table must have its prompt column: say so now, not in one error row per record
        input_warnings = check_input_files(list(files), o.input_format, columns,
                                           csv_field_limit_for(defaults.max_prompt_bytes))
    except InputCheckError as e:
        raise UsageError(str(e)) from None
    for warning in input_warnings:
        logger.warning("%s", warning)
    case_insensitive = False
    if "://" not in output:
        try:
            case_insensitive = is_case_insensitive_folder(output)
        except OSError as e:
            raise UsageError(f"--output={output!r} cannot be written: {e}") from e
    return JobConfig(patterns=tuple(patterns), input_format=o.input_format, output=output, load=load,
                     defaults=defaults, skip_existing=bool(o.skip_existing), large_model=bool(o.large_model),
                     model_copies=o.model_copies, demo=demo, max_images=o.max_images,
                     inference_retries=o.inference_retries, inference_timeout_s=o.inference_timeout_s,
                     case_insensitive_output=case_insensitive,
                     require_accelerator=o.require_accelerator, worker_env=worker_env, encoding=encoding,
                     encode_threads=o.encode_threads, output_format=o.output_format,
                     samples_per_shard=o.samples_per_shard, preview=o.preview, columns=columns, bigquery=bigquery,
                     bigquery_temp_dataset=o.bigquery_temp_dataset, input_warnings=tuple(input_warnings),
                     reference_roots=reference_roots, run_token=uuid.uuid4().hex,
                     model_fingerprint=model_fingerprint(
                         checkpoint, dtype=load.dtype, max_sequence_length=load.max_sequence_length,
                         text_encoder_out_layers=load.text_encoder_out_layers))


def _reference_roots(given: list[str] | None, patterns: list[str]) -> tuple[str, ...]:
    """--reference_root (repeated or comma-separated) normalised; without it the folders of the --input file
    patterns (BigQuery input adds none: its rows' references must then be allowed explicitly)."""
    entries = [e for value in given or [] for e in str(value).split(",")]
    if not entries:
        return default_roots(patterns)
    try:
        return tuple(dict.fromkeys(normalise_root(e) for e in entries))
    except ValueError as e:
        raise UsageError(str(e)) from None


def _bigquery_inputs(options: PipelineOptions, tables: list[str], query: str | None,
                     temp_dataset: str | None) -> tuple[BigQueryInput, ...]:
    """The BigQuery reads asked for (--input bq://..., --input_query), their spelling and needs checked."""
    from transforms.bigquery_input import table_spec

    reads = []
    try:
        for uri in dict.fromkeys(tables):
            table_spec(uri)
            reads.append(BigQueryInput(uri=uri))
        if query is not None:
            if not query.strip():
                raise ValueError("--input_query is empty")
            reads.append(BigQueryInput(query=query))
        if temp_dataset is not None:
            dataset_reference(temp_dataset, options.view_as(GoogleCloudOptions).project)
    except ValueError as e:
        raise UsageError(str(e)) from None
    temp_location = options.view_as(GoogleCloudOptions).temp_location
    if reads and not (temp_location or "").startswith("gs://"):
        raise UsageError("reading from BigQuery exports the rows through --temp_location: give a gs:// one, e.g. "
                         "--temp_location=gs://BUCKET/tmp")
    return tuple(reads)


def make_handler(job: JobConfig, handler_cls=Flux2KleinModelHandler, **extra) -> Flux2KleinModelHandler:
    """The job's ModelHandler (`handler_cls` lets tests wrap it with the very same arguments)."""
    return handler_cls(job.load, large_model=job.large_model, model_copies=job.model_copies,
                       inference_retries=job.inference_retries, require_accelerator=job.require_accelerator,
                       env_vars=dict(job.worker_env), reference_limits=job.reference_limits,
                       inference_timeout_s=job.inference_timeout_s, **extra)


def build_pipeline(p: beam.Pipeline, job: JobConfig, *, started_at: float, progress_dir: str | None = None) -> dict:
    """Add the job's transforms to `p`; returns its main PCollections by name."""
    read = _read_inputs(p, job)
    dedup = read["requests"] | "Deduplicate" >> DeduplicateRequests(fold_case=job.case_insensitive_output)
    # Reference images are read (bounded, cached per process) before any image is planned: a bad one is one error
    # row for its request; the others get each reference's sha256 and processed size (part of the batch shape).
    resolved = dedup["requests"] | "ResolveReferences" >> ResolveReferences(job.reference_limits,
                                                                            job.defaults.size_multiple)
    planned = resolved["requests"] | "ExpandImages" >> beam.FlatMap(lambda r: r.tasks())
    tasks, skipped, stale = planned, None, None
    if job.skip_existing and not job.webdataset:  # webdataset: whole shards are kept or made (WriteShards)
        split = planned | "SkipExisting" >> SkipExisting(job.output, job.encoding, job.model_fingerprint)
        tasks, skipped, stale = split["tasks"], split["skipped"], split["stale"]
    if job.max_images is not None:
        # Counts what this run would generate (skipped images excluded; webdataset: every image of the input, as
        # complete shards are only known once grouped) and fails before inference when over.
        tasks = tasks | "MaxImages" >> EnforceMaxImages(job.max_images)
    if progress_dir:
        total = tasks | "ProgressTotal" >> ReportTotal(progress_dir)
        # Taking the total as a side input makes the runner finish counting before any batch is generated, so the
        # progress line knows the total from the first image on.
        tasks = tasks | "AfterTotal" >> beam.Map(lambda t, _n: t, beam.pvalue.AsSingleton(total))

    if job.webdataset:
        packed = tasks | "WriteShards" >> WriteShards(
            job.output, make_handler(job), job.encoding, job.samples_per_shard, job.batch_size,
            skip_existing=job.skip_existing, progress_dir=progress_dir, threads=job.encode_threads,
            model_fingerprint=job.model_fingerprint)
        manifest, failed, skipped = packed["manifest"], packed["errors"], packed["existing"]
        stale = packed["stale"] if job.skip_existing else None
        index_files = packed["shards"] | "ShardIndexes" >> WriteShardIndexes(
            job.output, job.samples_per_shard, layout.IMAGE_EXTENSIONS[job.encoding.format])
    else:
        batches = tasks | "BatchByShape" >> BatchByShape(job.batch_size)
        results, dlq = batches | "RunInference" >> RunInference(make_handler(job).with_no_batching()) \
            .with_exception_handling()
        split = results | "SplitNonFinite" >> beam.ParDo(SplitNonFinite()).with_outputs(NON_FINITE_TAG,
                                                                                        main="sound")
        manifest = split.sound | "WriteImages" >> beam.ParDo(WriteImagesFn(
            job.output, progress_dir, job.encoding, job.encode_threads, model_fingerprint=job.model_fingerprint))
        failed = ((dlq.failed_inferences | "FailedBatchRows" >> beam.FlatMap(failed_batch_rows)),
                  split[NON_FINITE_TAG]) | "FailedImages" >> beam.Flatten()

    invalid = (read["invalid"], dedup["invalid"], resolved["invalid"]) | "AllInvalid" >> beam.Flatten()
    errors = (invalid, failed) | "AllErrors" >> beam.Flatten()
    # One shard each, under fixed names: a rerun into the same output replaces the previous run's files instead of
    # leaving stale shards next to them (so the manifest always lists exactly what the latest run generated, and
    # existing-* what it found already there).
    manifest_files = (manifest
                      | "ManifestJson" >> beam.Map(layout.to_json_line)
                      | "WriteManifest" >> beam.io.WriteToText(layout.manifest_prefix(job.output),
                                                               file_name_suffix=layout.ROWS_SUFFIX, num_shards=1))
    # Rows of the images found already written. Written (empty) by every run, so that an earlier run's file never
    # lingers, and only once this run's images are all written (a failed run leaves the previous files as they
    # were): manifest-* and existing-* of the latest run list every image of the output exactly once.
    found = skipped if skipped is not None else p | "NoExistingRows" >> beam.Create([])
    manifest_done = manifest | "ImagesDone" >> beam.combiners.Count.Globally()
    existing_rows = found | "AfterImages" >> beam.Map(lambda row, _done: row, beam.pvalue.AsSingleton(manifest_done))
    existing_files = (existing_rows
                      | "ExistingJson" >> beam.Map(layout.to_json_line)
                      | "WriteExisting" >> beam.io.WriteToText(layout.existing_prefix(job.output),
                                                               file_name_suffix=layout.ROWS_SUFFIX, num_shards=1))
    error_files = (errors
                   | "ErrorsJson" >> beam.Map(layout.to_json_line)
                   | "WriteErrors" >> beam.io.WriteToText(layout.errors_prefix(job.output),
                                                          file_name_suffix=layout.ROWS_SUFFIX, num_shards=1))
    every_image = (manifest, existing_rows) | "EveryImage" >> beam.Flatten()
    after = [manifest_files, existing_files, error_files]
    if job.webdataset:
        after.append(index_files)
    else:
        # datasets' imagefolder: metadata.jsonl at the output's root, `file_name` relative to it, one row per image
        # of the output (this run's and those a --skip_existing run kept), written once every image is.
        after.append(every_image
                     | "MetadataJson" >> beam.Map(layout.to_json_line)
                     | "WriteMetadata" >> beam.io.WriteToText(layout.metadata_path(job.output),
                                                              shard_name_template="", num_shards=1))
    if job.preview:
        after.append(every_image | "Preview" >> WritePreview(job.output, job.preview, job.webdataset))

    records = (read["requests"], read["invalid"]) | "AllRecords" >> beam.Flatten()
    truncated = (manifest
                 | "TruncatedRows" >> beam.Filter(lambda row: row["prompt_truncated"])
                 | "TruncatedIds" >> beam.Map(lambda row: row["id"])
                 | "DistinctTruncated" >> beam.Distinct())
    counted = {
        "records_read": records,
        "requests": resolved["requests"],
        "images_planned": planned,
        "images_generated": manifest,
        "invalid": invalid,
        "duplicates": dedup[DUPLICATE_TAG],
        "failed": failed,
        "prompts_truncated": truncated,
    }
    if skipped is not None:
        counted["skipped"] = skipped
    if stale is not None:
        counted["stale"] = stale
    summary = counted | "Summary" >> WriteSummary(job.output, started_at, extra={
        "model": job.model, "output": job.output, "input": list(job.patterns) + [b.source for b in job.bigquery],
        "demo": job.demo, "batch_size": job.batch_size, "dtype": job.dtype, "output_format": job.output_format},
        after=after, rows={"warnings": read[WARNING_TAG]},
        tallies={"errors_by_reason": errors | "ErrorKinds" >> beam.Map(lambda row: row.get("kind") or "error")})
    return {"manifest": manifest, "errors": errors, "summary": summary, "tasks": tasks}


def _read_inputs(p: beam.Pipeline, job: JobConfig) -> dict:
    """{'requests', 'invalid', 'warnings'} of every input: the files, each BigQuery table or query, and the
    warnings found at launch."""
    reads = []
    if job.patterns:
        patterns = p | "InputPatterns" >> beam.Create(list(job.patterns))
        reads.append(patterns | "ReadRequests" >> ReadRequests(job.input_format, job.defaults, job.columns))
    temp_dataset = None
    if job.bigquery_temp_dataset is not None:
        temp_dataset = dataset_reference(job.bigquery_temp_dataset,
                                         p.options.view_as(GoogleCloudOptions).project)
    for i, source in enumerate(job.bigquery):
        reads.append(p | f"ReadBigQuery{i}" >> ReadBigQueryRequests(source, job.defaults, job.columns,
                                                                     temp_dataset))
    launch = [{"source": "launch", "line": None, "warning": w} for w in job.input_warnings]
    warnings = [r[WARNING_TAG] for r in reads if WARNING_TAG in r] + [p | "LaunchWarnings" >> beam.Create(launch)]
    return {"requests": tuple(r["requests"] for r in reads) | "AllRequests" >> beam.Flatten(),
            "invalid": tuple(r["invalid"] for r in reads) | "AllReadInvalid" >> beam.Flatten(),
            WARNING_TAG: tuple(warnings) | "AllWarnings" >> beam.Flatten()}


def _query_metrics(result) -> dict | None:
    try:
        return result.metrics().query()
    except Exception:  # noqa: BLE001 - metrics are informative only
        return None


def _flux2_counters(metrics: dict | None) -> dict[str, int]:
    """The job's `flux2` counters, summed over the steps that report them ({} when the runner has none)."""
    counters: dict[str, int] = {}
    for c in (metrics or {}).get("counters", []):  # one name can be reported by several steps: sum them
        if c.key.metric.namespace == METRICS_NAMESPACE:
            counters[c.key.metric.name] = counters.get(c.key.metric.name, 0) + c.committed
    return counters


def _add_retries(job: JobConfig, summary: dict, counters: dict[str, int]) -> dict:
    """Add what the job retried (GCS requests, inference batches) to summary.json once the job is over: the
    figures are Beam counters, which only the finished job knows (a Dataflow job shows them in its metrics)."""
    figures = {"gcs": counters.get(retries.GCS_RETRIES, 0) + retries.take_pending(),
               "inference": counters.get("inference_retries", 0)}
    summary = dict(summary, retries=figures)
    try:
        write_bytes_atomic(layout.summary_path(job.output), (json.dumps(summary, indent=2) + "\n").encode("utf-8"),
                           mime_type="application/json")
    except Exception as e:  # noqa: BLE001 - the job's outputs are complete; only this addition is lost
        logger.warning("could not add the retry counts to %s: %s", layout.summary_path(job.output), e)
    return summary


def _print_metrics(metrics: dict | None) -> None:
    if metrics is None:
        return
    counters = _flux2_counters(metrics)
    dists = {d.key.metric.name: d.committed for d in metrics["distributions"] if d.key.metric.namespace == METRICS_NAMESPACE}
    if counters:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(counters.items()) if "_in_process_" not in k)
        print(f"metrics: {shown}")
    for name in ("batch_size", "generation_ms_per_image"):
        d = dists.get(name)
        if d is not None and d.count:
            print(f"metrics: {name} count={d.count} mean={d.mean:.1f} min={d.min} max={d.max}")


def run(argv: list[str] | None = None, *, wait: bool | None = None):
    """Build and run the job; returns (PipelineResult, summary dict or None). Local runners wait for the end.
    UsageError before any work for an argument that is not an option of the job or of Beam, or a bad value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check_arguments(argv)
    options = PipelineOptions(argv)
    if options.view_as(StandardOptions).runner is None:
        options.view_as(StandardOptions).runner = DEFAULT_RUNNER
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        _use_emulator_credentials()
    retries.install()
    retries.take_pending()  # count only this job's retries (an earlier job in this process may have left some)
    local = is_local_runner(options)
    if local:
        quiet_tpu_runtime()
    job = resolve_job(options)
    o = options.view_as(Flux2KleinOptions)
    replacing = check_output(job.output, skip_existing=job.skip_existing, overwrite=bool(o.overwrite),
                             demo_default_output=job.demo and o.output is None)
    if local:  # what a stopped or killed run left behind
        remove_beam_temp(job.output)
    wait = local if wait is None else wait
    if not local and not options.view_as(Flux2KleinOptions).skip_preflight:
        _tpu_preflight(options, job)
    if job.demo:
        print(demo_notice(job.model, job.patterns[0], job.output), flush=True)
    elif o.demo_checkpoint:
        print(DEMO_CHECKPOINT_NOTICE.format(model=job.model), flush=True)
    if replacing:
        print(replacing, flush=True)

    progress_dir = None
    show_progress = wait and local and not options.view_as(Flux2KleinOptions).no_progress
    if show_progress:
        progress_dir = tempfile.mkdtemp(prefix="flux2-progress-")
    started_at = time.time()
    p = beam.Pipeline(options=options)
    build_pipeline(p, job, started_at=started_at, progress_dir=progress_dir)
    if not wait:
        result = p.run()
        verb = "translated (dry run) for" if options.view_as(TestOptions).dry_run else "submitted to"
        print(f"{verb} {runner_name(options)}; outputs will be under {job.output}", flush=True)
        return result, None
    # FnApiRunner runs the whole job inside p.run(): the progress reporter has to be polling before it starts.
    try:
        with ProgressReporter(progress_dir) if progress_dir else contextlib.nullcontext():
            result = p.run()
            result.wait_until_finish()
    except Exception as e:
        limit = _max_images_error(e)
        if limit:
            raise UsageError(limit) from e
        raise
    finally:
        if progress_dir:
            shutil.rmtree(progress_dir, ignore_errors=True)
    summary = json.loads(read_bytes(layout.summary_path(job.output)).decode("utf-8"))
    metrics = _query_metrics(result)  # once: the retry figures and the printed metrics both come from it
    summary = _add_retries(job, summary, _flux2_counters(metrics))
    print(f"summary: {format_summary(summary)}")
    for row in summary.get("warnings", []):
        print(f"warning: {row['warning']}", file=sys.stderr)
    for line in closing_lines(job, summary):
        print(line)
    _print_metrics(metrics)
    if job.demo:
        print(DEMO_DONE)
    return result, summary


def quiet_tpu_runtime() -> None:
    """On a machine without a TPU, keep JAX from starting the TPU runtime that the [test]/[preflight] extras install
    (libtpu): it finds no chip and prints INVALID_ARGUMENT / 'could not determine TPU' lines that read like failures.
    Only when JAX_PLATFORMS is unset, libtpu is installed, and neither a TPU nor an NVIDIA device node exists; the
    setting reaches the runner's worker processes through the environment."""
    import glob
    import importlib.util

    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or glob.glob("/dev/nvidia[0-9]*"):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"


def closing_lines(job: JobConfig, summary: dict) -> list[str]:
    """Where the results are: the images (or shards), the manifest, metadata.jsonl, the preview, and the errors
    file when the run wrote error rows."""
    out = job.output
    lines = [f"images: {layout.join(out, 'shards/*.tar' if job.webdataset else layout.IMAGES_DIR + '/')}",
             f"manifest: {layout.manifest_prefix(out)}-*.jsonl"
             + ("" if job.webdataset else f" (and {layout.metadata_path(out)} for Hugging Face imagefolder)")]
    if job.preview:
        lines.append(f"preview: {layout.join(out, 'preview/index.html')} (open it in a browser)")
    if summary.get("invalid", 0) + summary.get("failed", 0) + summary.get("duplicates", 0):
        lines.append(f"errors: {layout.errors_prefix(out)}-*.jsonl (one row per record or image that failed, "
                     f"with the reason)")
    lines.append(f"summary: {layout.summary_path(out)}")
    return lines


def _tpu_preflight(options: PipelineOptions, job: JobConfig) -> None:
    """For TPU workers: compile the job for their topology first; UsageError (nothing submitted) if it cannot fit."""
    topology = launch_check.job_topology(options)
    if topology is None:
        return
    report = launch_check.check_fits(job, topology)
    figures = report.to_json()
    print(f"TPU preflight: fits {topology} with {report.model_shards} model shard(s): peak "
          f"{figures['peak_bytes_per_chip'] / 2**30:.2f} of {figures['hbm_bytes_per_chip'] / 2**30:.2f} GiB per chip "
          f"(compiler's estimate)", flush=True)


def _max_images_error(error: BaseException) -> str | None:
    """The --max_images message when `error` (however the runner wrapped it) is the job's image limit."""
    if isinstance(error, MaxImagesExceeded):
        return str(error)
    match = re.search(r"the job would generate \d+ images, above --max_images=\d+; .*?split the input", str(error))
    return match.group(0) if match else None


def _use_emulator_credentials() -> None:
    """Against a local GCS emulator (STORAGE_EMULATOR_HOST), skip Beam's ~20 s credential lookup: Beam then
    connects anonymously, which is what the emulator wants. Has no effect on real GCS runs."""
    try:
        from apache_beam.internal.gcp import auth

        auth._Credentials._credentials_init = True
        auth._Credentials._credentials = None
    except Exception:  # noqa: BLE001 - private Beam API; without it runs are only slower
        pass


def main(argv: list[str] | None = None) -> int:
    """The command line: --help / --help_beam print the options; a usage error is one line and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in HELP_FLAGS for arg in argv):
        print(format_help(), end="")
        return 0
    if BEAM_HELP_FLAG in argv:
        print(format_beam_help(), end="")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        result, summary = run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # noqa: BLE001 - a signal however Beam wrapped it; anything else re-raised
        signum = _interrupting_signal(e)
        if signum is None:
            raise
        return _stop_after_signal(argv, signum)
    reason = empty_run_reason(summary)
    if reason and not PipelineOptions(argv).view_as(Flux2KleinOptions).allow_empty:
        print(f"error: {reason} (--allow_empty accepts such a run)", file=sys.stderr)
        return 1
    return 0


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt is for SIGINT."""


def _raise_interrupted(signum, frame):
    """Stop the run where it is: Beam's own reports of the interrupt (tracebacks from its threads) are silenced, the
    one line of `_stop_after_signal` says what happened."""
    logging.disable(logging.CRITICAL)
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _interrupting_signal(error: BaseException) -> int | None:
    """SIGINT or SIGTERM when `error` is the interrupt (or Beam's RuntimeError wrapping one), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, KeyboardInterrupt) or "KeyboardInterrupt" in str(error):
            return signal.SIGINT
        if isinstance(error, Terminated) or "Terminated" in type(error).__name__:
            return signal.SIGTERM
        error = error.__cause__ or error.__context__
    return None


def _stop_after_signal(argv: list[str], signum: int) -> int:
    """One line on what was written and how to resume; Beam's temporary folders removed; 128 + the signal."""
    logging.disable(logging.CRITICAL)  # Beam's threads report the interrupt at length: the line below says it
    output = PipelineOptions(argv).view_as(Flux2KleinOptions).output or DEFAULT_OUTPUT
    removed = remove_beam_temp(output)
    try:
        written = len(FileSystems.match([layout.join(output, layout.IMAGES_DIR + "/*")])[0].metadata_list)
    except Exception:  # noqa: BLE001 - nothing listable: say nothing was written
        written = 0
    name = "SIGINT" if signum == signal.SIGINT else "SIGTERM"
    print(f"interrupted ({name}): {written} image(s) written under {output}"
          f"{f', {removed} temporary folder(s) removed' if removed else ''}; to resume, run the same command with "
          f"--skip_existing", file=sys.stderr, flush=True)
    return 128 + signum


def remove_beam_temp(output: str) -> int:
    """Remove the `beam-temp-*` folders Beam's file sinks leave under `output` when a run is stopped (a killed run's
    too); returns how many. Only runs of this job write under `output`."""
    import glob

    count = 0
    for folder in ("", layout.MANIFEST_DIR, layout.ERRORS_DIR):
        if layout.is_local_path(output):
            for top in glob.glob(os.path.join(output, folder, "beam-temp-*")):
                shutil.rmtree(top, ignore_errors=True)
                count += 1
            continue
        try:
            objects = [m.path for m in FileSystems.match([layout.join(output, (folder + "/" if folder else "")
                                                                      + "beam-temp-*/**")])[0].metadata_list]
        except Exception:  # noqa: BLE001 - nothing there
            continue
        if objects:
            FileSystems.delete(objects)
            count += len({p.split("beam-temp-", 1)[1].split("/", 1)[0] for p in objects})
    return count


def empty_run_reason(summary: dict | None) -> str | None:
    """Why a finished run that generated nothing is not a success, or None (a submitted job has no summary)."""
    if not summary or summary.get("images_generated", 0) or summary.get("skipped", 0):
        return None
    if not summary.get("records_read", 0):
        return "no image was generated: the input held no record"
    bad = summary.get("invalid", 0) + summary.get("failed", 0)
    if bad:
        return (f"no image was generated: all {bad} request(s) were invalid or failed (see the errors file: "
                f"errors/errors-*.jsonl under the output)")
    return None


if __name__ == "__main__":
    sys.exit(main())
