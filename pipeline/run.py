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
  -> sink.plan() (what the output holds: --skip_existing; where each image goes)
  -> Generate: BatchByShape -> RunInference(Flux2KleinModelHandler).with_exception_handling()
  -> the sink of --output_format (transforms/sinks/: files or webdataset) -> manifest, existing rows
  invalid records + conflicting ids + failed batches -> errors;   counts of everything -> summary.json
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all: a signal while the modules below import is one line and exit 130
    from pipeline.interrupts import install_while_starting

    install_while_starting()

import contextlib
import dataclasses
import enum
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import uuid

if __name__ == "__main__":  # `python -m pipeline.run`: --help and argument errors before the heavy imports below
    from pipeline.usage import exit_on_usage_error

    exit_on_usage_error(sys.argv[1:])

import apache_beam as beam  # noqa: E402 - after the command line's own check
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions, StandardOptions, TestOptions

from transforms import layout, retries, sinks
from transforms.fingerprints import model_fingerprint
from transforms.generation import Generate
from transforms.inference import Flux2KleinModelHandler, discard_pending_model_loads
from transforms.inputs.bigquery import ReadBigQueryRequests, dataset_reference
from transforms.inputs.readers import WARNING_TAG, ReadRequests
from transforms.inputs.validation import RequestDefaults
from transforms.metrics import NAMESPACE as METRICS_NAMESPACE
from transforms.sinks.writes import read_bytes, write_bytes_atomic
from transforms.summary import WriteSummary, format_summary
from transforms.preview import WritePreview
from transforms.progress import ProgressReporter, ReportTotal, read_progress
from transforms.references import ResolveReferences
from transforms.requests import DUPLICATE_TAG, DeduplicateRequests, EnforceMaxImages, MaxImagesExceeded

from model.api import LoadSettings, ModelError

from . import interrupts, launch_check, log_filters, output_lease, probes
from .demo import DEMO_CHECKPOINT_NOTICE, DEMO_DONE, demo_notice
from .disk_full import DiskFull, disk_full_error, disk_full_line
from .errors import UsageError
from .option_specs import DEFAULT_OUTPUT
from .options import Flux2KleinOptions
from .output_check import check_output
from .specs import JobSpec, Runner, job_spec
from .usage import BEAM_HELP_FLAG, HELP_FLAGS, check_arguments, format_beam_help, format_help

logger = logging.getLogger("pipeline.run")

DEFAULT_RUNNER = "FnApiRunner"
LOCAL_RUNNERS = ("fnapirunner", "directrunner", "bundlebaseddirectrunner", "switchingdirectrunner")


def _from_spec(group: str, name: str):
    """A JobConfig attribute read from one group of its spec, with an enum as its plain value: the names the graph
    (build_pipeline, make_handler, the sinks) reads, as before the groups."""

    def get(job: "JobConfig"):
        value = getattr(getattr(job.spec, group), name)
        return value.value if isinstance(value, enum.Enum) else value

    return property(get, doc=f"spec.{group}.{name}")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """Everything the graph needs: the options as checked groups (`spec`: input, output, model, generation, limits,
    reliability; pipeline/specs.py) and what the launch resolved with the checkpoint and the files
    (pipeline/probes.py)."""

    spec: JobSpec
    load: LoadSettings  # goes unchanged through the handler to model.load
    defaults: RequestDefaults  # what a record that does not say gets, and its limits (the checkpoint's size multiple)
    input_warnings: tuple[str, ...] = ()  # found at launch (a --column_map column a table lacks)
    case_insensitive_output: bool = False  # a local output folder where 'A.png' and 'a.png' are one file
    # What the loaded model is (transforms/fingerprints.py): stored with every image, compared by --skip_existing.
    model_fingerprint: str = ""
    run_token: str = ""  # this launch, so a worker process's reference cache never serves an earlier job's copy
    # How --batch_size auto became `batch_size` (the launch's TPU preflight, or the default); None: --batch_size N.
    batch_choice: str | None = None

    patterns = _from_spec("input", "files")  # input file patterns (the demo's prompts for the demo)
    input_format = _from_spec("input", "input_format")
    columns = _from_spec("input", "columns")  # which column is which generation field
    bigquery = _from_spec("input", "bigquery")  # BigQuery tables (--input bq://...) and --input_query
    bigquery_temp_dataset = _from_spec("input", "bigquery_temp_dataset")  # None: Beam makes one
    output = _from_spec("output", "output")
    encoding = _from_spec("output", "encoding")  # --image_format, --png_compress_level, --quality
    output_format = _from_spec("output", "output_format")  # files (one object per image) or webdataset (tar shards)
    webdataset = _from_spec("output", "webdataset")
    samples_per_shard = _from_spec("output", "samples_per_shard")
    preview = _from_spec("output", "preview")  # images in preview/index.html; 0: no preview
    skip_existing = _from_spec("output", "skip_existing")
    large_model = _from_spec("limits", "large_model")
    model_copies = _from_spec("limits", "model_copies")
    encode_threads = _from_spec("limits", "encode_threads")  # per worker process; None: its cores
    max_images = _from_spec("limits", "max_images")  # most images the job may generate; None: no limit
    inference_retries = _from_spec("reliability", "inference_retries")
    inference_timeout_s = _from_spec("reliability", "inference_timeout_s")  # 0: no limit
    read_timeout_s = _from_spec("reliability", "read_timeout_s")  # each read of an input or reference
    require_accelerator = _from_spec("reliability", "require_accelerator")  # a worker on another platform stops
    worker_env = _from_spec("reliability", "worker_env")  # (NAME, value) set on each worker before the model loads

    @property
    def demo(self) -> bool:
        return self.spec.demo

    @property
    def reference_roots(self) -> tuple[str, ...]:
        return self.spec.reference_roots

    @property
    def reference_limits(self):
        """--max_reference_images/--max_reference_pixels and --reference_root, with this run's scope for the
        reference cache."""
        return dataclasses.replace(self.defaults.reference_limits, cache_scope=self.run_token,
                                   roots=self.reference_roots, read_timeout_s=self.read_timeout_s)

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


def runner_name(options: PipelineOptions) -> str:
    runner = options.view_as(StandardOptions).runner
    if runner is None:
        return DEFAULT_RUNNER
    return runner if isinstance(runner, str) else type(runner).__name__


def is_local_runner(options: PipelineOptions) -> bool:
    return runner_name(options).rsplit(".", 1)[-1].lower() in LOCAL_RUNNERS


def is_dry_run(options: PipelineOptions) -> bool:
    """`--dry_run=True` on a remote runner (Dataflow): the job is translated, not submitted, and writes nothing. (The
    local runners ignore the flag and run the job.)"""
    return bool(options.view_as(TestOptions).dry_run) and not is_local_runner(options)


def check_dry_run_locations(options: PipelineOptions) -> None:
    """UsageError unless a dry run has a valid gs:// --temp_location or --staging_location: without one, Beam's check
    of the options looks up (or creates) a default bucket through the Cloud APIs, which a dry run must not need."""
    from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator

    cloud = options.view_as(GoogleCloudOptions)
    validator = PipelineOptionsValidator(options, None)
    errors = [validator.validate_gcs_path(cloud, name) for name in ("temp_location", "staging_location")]
    if all(errors):
        raise UsageError(f"--dry_run=True needs a valid gs:// --temp_location (or --staging_location), e.g. "
                         f"--temp_location=gs://BUCKET/tmp (nothing is written there): without one Beam looks up or "
                         f"creates a default bucket through the Cloud APIs ({' '.join(errors[0][0].split())})")


def resolve_job(options: PipelineOptions) -> JobConfig:
    """The options as checked groups (pipeline/specs.py), then what the launch finds with them (pipeline/probes.py):
    the checkpoint and its configs, what BigQuery needs, the input files and their headers, the output folder.
    UsageError before any work for anything the job could not run."""
    cloud = options.view_as(GoogleCloudOptions)
    runner = Runner(runner_name(options), is_local_runner(options), cloud.temp_location, cloud.project)
    spec = job_spec(options.view_as(Flux2KleinOptions), runner)
    probes.check_gcs_reachable(probes.gcs_paths_read(spec, output_checked=not is_dry_run(options)))
    checkpoint = probes.read_checkpoint(probes.checkpoint_location(spec.model, runner), spec.model.model_variant)
    defaults = spec.request_defaults(checkpoint.size_multiple)
    load = spec.load_settings(checkpoint.location)
    probes.check_bigquery(spec.input, runner)
    files = probes.match_inputs(spec.input.files)
    return JobConfig(spec=spec, load=load, defaults=defaults,
                     input_warnings=probes.check_inputs(files, spec.input, spec.limits.max_prompt_bytes,
                                                        spec.reliability.read_timeout_s),
                     case_insensitive_output=probes.case_insensitive_output(spec.output.output),
                     run_token=uuid.uuid4().hex, model_fingerprint=model_fingerprint(
                         checkpoint.digest, dtype=load.dtype, max_sequence_length=load.max_sequence_length,
                         text_encoder_out_layers=load.text_encoder_out_layers, quantize=load.engine.quantize))


def make_handler(job: JobConfig, handler_cls=Flux2KleinModelHandler, **extra) -> Flux2KleinModelHandler:
    """The job's ModelHandler (`handler_cls` lets tests wrap it with the very same arguments)."""
    return handler_cls(job.load, large_model=job.large_model, model_copies=job.model_copies,
                       inference_retries=job.inference_retries, require_accelerator=job.require_accelerator,
                       env_vars=dict(job.worker_env), reference_limits=job.reference_limits,
                       inference_timeout_s=job.inference_timeout_s, **extra)


def build_pipeline(p: beam.Pipeline, job: JobConfig, *, started_at: float, progress_dir: str | None = None,
                   release_lease: str | None = None) -> dict:
    """Add the job's transforms to `p`; returns its main PCollections by name. `release_lease`: the token of the
    output's lease, which the job's last step removes (a remote job, whose launcher does not wait for its end)."""
    read = _read_inputs(p, job)
    dedup = read["requests"] | "Deduplicate" >> DeduplicateRequests(fold_case=job.case_insensitive_output)
    # Reference images are read (bounded, cached per process) before any image is planned: a bad one is one error
    # row for its request; the others get each reference's sha256 and processed size (part of the batch shape).
    resolved = dedup["requests"] | "ResolveReferences" >> ResolveReferences(job.reference_limits,
                                                                            job.defaults.size_multiple)
    planned = resolved["requests"] | "ExpandImages" >> beam.FlatMap(lambda r: r.tasks())
    sink = _sink(job, progress_dir)
    # What the output already holds (--skip_existing) and where each image will go, before anything is generated.
    placed = dict(planned | "PlanOutput" >> sink.plan())
    tasks = placed.pop(sinks.TASKS)
    if job.max_images is not None:
        # Counts what this run would generate (images kept from an earlier run excluded) and fails before
        # inference when over.
        tasks = tasks | "MaxImages" >> EnforceMaxImages(job.max_images)
    if progress_dir:
        total = tasks | "ProgressTotal" >> ReportTotal(progress_dir)
        # Taking the total as a side input makes the runner finish counting before any batch is generated, so the
        # progress line knows the total from the first image on.
        tasks = tasks | "AfterTotal" >> beam.Map(lambda t, _n: t, beam.pvalue.AsSingleton(total))
    generated = tasks | "Generate" >> Generate(make_handler(job), job.batch_size)
    written = {**generated, **placed} | "WriteOutput" >> sink
    manifest, existing, failed = written[sinks.MANIFEST], written[sinks.EXISTING], written[sinks.ERRORS]

    invalid = (read["invalid"], dedup["invalid"], resolved["invalid"]) | "AllInvalid" >> beam.Flatten()
    errors = (invalid, failed) | "AllErrors" >> beam.Flatten()
    # One shard each, under fixed names: a rerun into the same output replaces the previous run's files instead of
    # leaving stale shards next to them (so the manifest always lists exactly what the latest run generated, and
    # existing-* what it found already there). existing-* is written (empty) by every run, so that an earlier run's
    # file never lingers, and only once this run's images are all written (the sink releases those rows then): a
    # failed run leaves the previous files as they were, and manifest-* and existing-* of the latest run list every
    # image of the output exactly once.
    rows_files = [
        rows
        | f"{name}Json" >> beam.Map(layout.to_json_line)
        | f"Write{name}" >> beam.io.WriteToText(prefix, file_name_suffix=layout.ROWS_SUFFIX, num_shards=1)
        for name, rows, prefix in (("Manifest", manifest, layout.manifest_prefix(job.output)),
                                   ("Existing", existing, layout.existing_prefix(job.output)),
                                   ("Errors", errors, layout.errors_prefix(job.output)))]
    after = [*rows_files, written[sinks.DONE]]
    if job.preview:
        every_image = (manifest, existing) | "EveryImage" >> beam.Flatten()
        after.append(every_image | "Preview" >> WritePreview(job.output, job.preview))

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
        "skipped": existing,
        "stale": written[sinks.STALE],
        "invalid": invalid,
        "duplicates": dedup[DUPLICATE_TAG],
        "failed": failed,
        "prompts_truncated": truncated,
    }
    summary = counted | "Summary" >> WriteSummary(job.output, started_at, extra={
        "model": job.model, "output": job.output, "input": list(job.patterns) + [b.source for b in job.bigquery],
        "demo": job.demo, "batch_size": job.batch_size, "batch_size_auto": job.batch_choice is not None,
        "batch_size_chosen": job.batch_choice, "dtype": job.dtype, "quantize": job.load.engine.quantize,
        "output_format": job.output_format},
        after=after, rows={"warnings": read[WARNING_TAG]},
        tallies={"errors_by_reason": errors | "ErrorKinds" >> beam.Map(lambda row: row.get("kind") or "error")})
    if release_lease:
        summary | "ReleaseOutputLease" >> beam.Map(output_lease.release_from_job, job.output, release_lease)
    return {"manifest": manifest, "errors": errors, "summary": summary, "tasks": tasks}


def _sink(job: JobConfig, progress_dir: str | None) -> sinks.Sink:
    """The sink of --output_format: the one place the job chooses how its images are stored."""
    settings = sinks.SinkSettings(job.output, job.encoding, job.model_fingerprint or None, job.skip_existing,
                                  job.encode_threads, progress_dir, quantize=job.load.engine.quantize)
    if job.output_format == sinks.WebDatasetSink.output_format:
        return sinks.WebDatasetSink(settings, job.samples_per_shard)
    return sinks.FilesSink(settings)


def _read_inputs(p: beam.Pipeline, job: JobConfig) -> dict:
    """{'requests', 'invalid', 'warnings'} of every input: the files, each BigQuery table or query, and the
    warnings found at launch."""
    reads = []
    if job.patterns:
        patterns = p | "InputPatterns" >> beam.Create(list(job.patterns))
        reads.append(patterns | "ReadRequests" >> ReadRequests(job.input_format, job.defaults, job.columns,
                                                               job.read_timeout_s))
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
    discard_pending_model_loads()  # and only its model loads
    local = is_local_runner(options)
    if local:
        quiet_tpu_runtime()
    dry_run = is_dry_run(options)
    if dry_run:
        check_dry_run_locations(options)
    job = resolve_job(options)
    o = options.view_as(Flux2KleinOptions)
    wait = local if wait is None else wait
    if dry_run:  # a dry run writes nothing: what the output holds does not matter to it, nor who writes there
        return _run_holding(options, job, None, local=local, dry_run=True, replacing=None, wait=wait)
    # First the output's lease: a job running there is named, and nothing of it is touched (exit 2). This process
    # holds it (refreshing it) while it launches, and runs, a local job; a remote job's last step removes it.
    lease = output_lease.take_output_lease(job.output, job=job.run_token[:12])
    submitted = False
    CLEANUP.update(temp_removed=0, output=job.output)
    try:
        lease.clear_leftovers()  # what stopped or killed runs left behind (never a result: before the check)
        replacing = check_output(job.output, skip_existing=job.skip_existing, overwrite=bool(o.overwrite),
                                 demo_default_output=job.demo and o.output is None)
        lease.start_heartbeat()
        result, summary = _run_holding(options, job, lease, local=local, dry_run=False, replacing=replacing,
                                       wait=wait)
        submitted = not wait
        if submitted:
            cloud = options.view_as(GoogleCloudOptions)
            lease.hand_to_job(_job_id(result) or cloud.job_name or "",
                              output_lease.dataflow_runner(cloud.project, cloud.region))
        return result, summary
    except BaseException:
        CLEANUP["temp_removed"] = lease.remove_own_temp()
        raise
    finally:
        if not submitted:  # a submitted job holds the lease until its last step
            lease.release()


# What the last run() cleaned up when it stopped (main's line after a signal says it).
CLEANUP: dict = {"temp_removed": 0, "output": None}


def _job_id(result) -> str:
    """The submitted job's id (Dataflow's), or "" when the runner has none."""
    try:
        return str(result.job_id() or "")
    except Exception:  # noqa: BLE001 - a runner without job ids
        return ""


def _run_holding(options: PipelineOptions, job: JobConfig, lease, *, local: bool, dry_run: bool, replacing, wait):
    """The rest of `run`, once the output's lease is held (`lease`; None for a dry run, which writes nothing)."""
    o = options.view_as(Flux2KleinOptions)
    job = _tpu_preflight(options, job, local=local)
    if local:
        start_local_runtime(options, job)
    if job.demo:
        print(demo_notice(job.model, job.patterns[0], job.output), flush=True)
    elif o.demo_checkpoint:
        print(DEMO_CHECKPOINT_NOTICE.format(model=job.model), flush=True)
    if replacing:
        print(replacing, flush=True)

    progress_dir = None
    show_progress = wait and local and not options.view_as(Flux2KleinOptions).no_progress
    if wait and local:  # the workers' counts: the progress line, and what is left when a disk fills
        progress_dir = tempfile.mkdtemp(prefix="flux2-progress-")
    started_at = time.time()
    try:
        p = beam.Pipeline(options=options)
    except ValueError as e:  # Beam's own check of its options (a project id, a region, gs:// locations)
        if not str(e).startswith("Pipeline has validations errors"):
            raise
        found = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        raise UsageError(f"Beam's check of the options failed: {' '.join(found)}") from None
    release = lease.holder.token if lease is not None and lease.tag is not None and not wait else None
    build_pipeline(p, job, started_at=started_at, progress_dir=progress_dir, release_lease=release)
    if not wait:
        result = p.run()
        cloud = options.view_as(GoogleCloudOptions)
        for line in submitted_lines(runner_name(options), job.output, dry_run=dry_run,
                                    job_id=submitted_job_id(result), region=cloud.region, project=cloud.project):
            print(line, flush=True)
        return result, None
    # FnApiRunner runs the whole job inside p.run(): the progress reporter has to be polling before it starts.
    try:
        with ProgressReporter(progress_dir) if show_progress else contextlib.nullcontext():
            result = p.run()
            result.wait_until_finish()
    except Exception as e:
        limit = _max_images_error(e)
        if limit:
            raise UsageError(limit) from e
        full = disk_full_error(e)
        if full:
            total = read_progress(progress_dir)[1] if progress_dir else None
            raise DiskFull(disk_full_line(full, job.output, total, started_at)) from e
        failed_load = model_load_error(e)
        if failed_load:  # the launch checked the checkpoint; it changed since, or its copy failed on a worker
            raise UsageError(f"--model={job.model!r} could not be loaded, so no image was generated: "
                             f"{failed_load}") from e
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


def accelerator_device_nodes() -> list[str]:
    """The TPU or NVIDIA device nodes of this machine (none on a CPU-only one)."""
    import glob

    return glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*") + glob.glob("/dev/nvidia[0-9]*")


def start_local_runtime(options: PipelineOptions, job: JobConfig, device_nodes=accelerator_device_nodes) -> bool:
    """On a local run whose worker is this process (not multi_processing, no model server process: --large_model
    and --model_copies load it elsewhere) on a machine with an accelerator, start the accelerator runtime now, on
    its own thread beside the launch's checks and the pipeline's start, instead of when the model loads: seconds
    of a TPU host's job start (model.runtime.start_runtime; its error, if any, is raised by the load). Skipped when
    --worker_env sets variables: the worker sets them before its runtime starts. Returns whether it started."""
    mode = options.get_all_options().get("direct_running_mode")
    if mode == "multi_processing" or job.large_model or job.model_copies or job.worker_env:
        return False
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu" or not device_nodes():
        return False
    from model import api

    api.start_runtime()
    return True


def quiet_tpu_runtime() -> None:
    """On a machine without a TPU, keep JAX from starting the TPU runtime that the [test]/[preflight] extras install
    (libtpu): it finds no chip and prints INVALID_ARGUMENT / 'could not determine TPU' lines that read like failures.
    Only when JAX_PLATFORMS is unset, libtpu is installed, and neither a TPU nor an NVIDIA device node exists; the
    setting reaches the runner's worker processes through the environment."""
    import importlib.util

    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if accelerator_device_nodes():
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


DATAFLOW_CONSOLE = "https://console.cloud.google.com/dataflow/jobs/{region}/{job_id}?project={project}"


def submitted_lines(runner: str, output: str, *, dry_run: bool, job_id: str | None = None, region: str | None = None,
                    project: str | None = None) -> list[str]:
    """What a launch that does not wait prints: where the outputs go, and for a submitted job its id and the
    Dataflow console page that follows it (Beam logs them at INFO, which the command line does not show)."""
    if dry_run:
        return [f"translated (dry run) for {runner}: nothing submitted or written; the output {output} was not "
                f"checked for a previous run's results"]
    lines = [f"submitted to {runner}; outputs will be under {output}"]
    if job_id:
        lines.append(f"job id: {job_id}")
        if region and project:
            lines.append(f"console: {DATAFLOW_CONSOLE.format(region=region, job_id=job_id, project=project)}")
    return lines


def submitted_job_id(result) -> str | None:
    """The id of the job `result` stands for (a DataflowPipelineResult's job_id()); None for a dry run's result
    or a runner without job ids."""
    try:
        job_id = result.job_id()
    except Exception:  # noqa: BLE001 - no job: nothing to say
        return None
    return job_id if isinstance(job_id, str) and job_id else None


def _tpu_preflight(options: PipelineOptions, job: JobConfig, *, local: bool) -> JobConfig:
    """For TPU workers (unless --skip_preflight): compile the job for their topology first; UsageError (nothing
    submitted) if it cannot fit. With --batch_size auto the batch is the largest up to --max_batch_size that fits
    there, also on a local run with this machine's TPU (pipeline/launch_check.py); with no TPU topology to fit, the
    default (model.api.DEFAULT_BATCH_SIZE, at most --max_batch_size). Returns the job with its batch; the submitted
    options carry it too."""
    auto = job.spec.limits.auto_batch
    skip = options.view_as(Flux2KleinOptions).skip_preflight
    if skip or (local and not auto):
        topology = None
    elif local:
        tpu_nodes = [node for node in accelerator_device_nodes() if "nvidia" not in node]
        topology = launch_check.local_tpu_topology(job, tpu_attached=bool(tpu_nodes))
    else:
        topology = launch_check.job_topology(options)
    if topology is None:
        if not auto:
            return job
        why = "--skip_preflight" if skip else "no TPU topology to fit it to"
        return _with_batch(options, job, job.batch_size, f"the default, {job.batch_size} ({why})")
    print(f"TPU preflight: compiling the job for {topology}{' to pick its batch' if auto else ''} (minutes for a "
          f"real-size model)", flush=True)
    figures = (launch_check.pick_local_batch(job, topology) if local
               else launch_check.check_fits(job, topology).to_json())
    if auto:
        job = _with_batch(options, job, figures["batch"], f"the largest up to {figures['max_batch_size']} whose "
                                                           f"programs fit {topology} (TPU preflight at launch)")
    print(f"TPU preflight: fits {topology} with {figures['model_shards']} model shard(s) at batch "
          f"{figures['batch']}{' (picked)' if auto else ''}: peak {figures['peak_bytes_per_chip'] / 2**30:.2f} of "
          f"{figures['hbm_bytes_per_chip'] / 2**30:.2f} GiB per chip (compiler's estimate)", flush=True)
    return job


def _with_batch(options: PipelineOptions, job: JobConfig, batch: int, choice: str) -> JobConfig:
    """`job` at `batch` images per compiled batch (what every worker's model compiles), with how it was chosen for
    summary.json; the pipeline options that go to the runner say the number instead of 'auto'."""
    options.view_as(Flux2KleinOptions).batch_size = batch
    engine = dataclasses.replace(job.load.engine, batch_size=batch)
    return dataclasses.replace(job, load=dataclasses.replace(job.load, engine=engine), batch_choice=choice)


def _max_images_error(error: BaseException) -> str | None:
    """The --max_images message when `error` (however the runner wrapped it) is the job's image limit."""
    if isinstance(error, MaxImagesExceeded):
        return str(error)
    match = re.search(r"the job would generate \d+ images, above --max_images=\d+; .*?split the input", str(error))
    return match.group(0) if match else None


_STEP_SUFFIX = re.compile(r" \[while running '[^']*'\]")
# How a worker process's model error reads in the text Beam passes on from it (multi_processing workers).
_MODEL_ERROR_TEXT = re.compile(r"^model\.errors\.(\w+): (.+)$", re.MULTILINE)
# Beam's loggers that report a worker's failed DoFn setup, in this process or from a worker process.
_WORKER_ERROR_LOGGERS = ("apache_beam.runners.common", "apache_beam.runners.portability.local_job_service")


def model_load_error(error: BaseException) -> str | None:
    """'Kind: message' of the model.ModelError that `error` is or wraps (Beam re-raises a worker's exception with the
    step's name added, or, from a worker process, its traceback as text), else None: the model load failed on a
    worker (a failed batch never gets here: it becomes error rows)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ModelError):
            return f"{type(error).__name__}: {_STEP_SUFFIX.sub('', str(error))}"
        found = _MODEL_ERROR_TEXT.findall(str(error))
        if found:
            kind, message = found[-1]
            return f"{kind}: {_STEP_SUFFIX.sub('', message)}"
        error = error.__cause__ or error.__context__
    return None


class _WithoutModelLoadTraceback(logging.Filter):
    """Drops Beam's reports (tracebacks) of a worker's failed model load or of a full disk: `main` says it in one
    line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and (isinstance(record.exc_info[1], ModelError) or disk_full_error(record.exc_info[1])):
            return False
        message = record.getMessage()
        return "model.errors." not in message and disk_full_error(Exception(message)) is None


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
    for name in _WORKER_ERROR_LOGGERS:
        logging.getLogger(name).addFilter(_WithoutModelLoadTraceback())
    log_filters.quiet_replaced_row_files()  # a rerun replaces the row files under their fixed names: no warning
    previous = interrupts.install()
    try:
        return _run_to_status(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DiskFull as e:  # the job ran and stopped: what it wrote stays, the line says how to resume
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - a signal however Beam wrapped it; anything else re-raised
        interrupts.STATE.stopping = True  # first, before any call: a re-delivered interrupt must not raise in here
        signum = interrupts.STATE.received or interrupts.interrupting_signal(e)
        if signum is None:
            raise
        return _stop_after_signal(argv, signum)
    finally:
        if interrupts.STATE.received is None:  # after a signal the process leaves at once (interrupts.exit_process)
            interrupts.restore(previous)


def _run_to_status(argv: list[str]) -> int:
    """Run the job; 0, or 1 with one line when a finished run generated nothing (unless --allow_empty)."""
    _, summary = run(argv)
    reason = empty_run_reason(summary)
    if reason and not PipelineOptions(argv).view_as(Flux2KleinOptions).allow_empty:
        print(f"error: {reason} (--allow_empty accepts such a run)", file=sys.stderr)
        return 1
    return 0


def _stop_after_signal(argv: list[str], signum: int) -> int:
    """One line on what was written and how to resume; Beam's temporary folders removed; 128 + the signal."""
    logging.disable(logging.CRITICAL)  # Beam's threads report the interrupt at length: the line below says it
    output = PipelineOptions(argv).view_as(Flux2KleinOptions).output or DEFAULT_OUTPUT
    removed = CLEANUP["temp_removed"] if CLEANUP["output"] == output else 0  # this run's own, removed by run()
    try:
        written = len(FileSystems.match([layout.join(output, layout.IMAGES_DIR + "/*")])[0].metadata_list)
    except Exception:  # noqa: BLE001 - nothing listable: say nothing was written
        written = 0
    print(f"interrupted ({interrupts.signal_name(signum)}): {written} image(s) written under {output}"
          f"{f', {removed} temporary folder(s) removed' if removed else ''}; to resume, run the same command with "
          f"--skip_existing", file=sys.stderr, flush=True)
    return interrupts.status(signum)


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
    interrupts.exit_process(main())
