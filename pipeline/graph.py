"""The job's Beam graph, from its spec (the options as checked groups, pipeline/specs.py) and what the launch resolved
(pipeline/launch.py: JobConfig). Every step is a transform from `transforms/`:

  patterns -> ReadRequests (+ ReadBigQueryRequests per table or query) -> DeduplicateRequests -> image tasks
  -> sink.plan() (what the output holds: --skip_existing; where each image goes)
  -> Generate: BatchByShape -> RunInference(Flux2KleinModelHandler).with_exception_handling()
  -> the sink of --output_format (transforms/sinks/registry.py) -> manifest, existing rows
  invalid records + conflicting ids + failed batches -> errors;   counts of everything -> summary.json
"""

from __future__ import annotations

import dataclasses
import enum

import apache_beam as beam
from apache_beam.options.pipeline_options import GoogleCloudOptions

from transforms import layout
from transforms.generation import Generate
from transforms.dataset_report import WriteDatasetReport
from transforms.dataset_stats import DatasetStats
from transforms.duplicates import NearDuplicateGroups, mark_duplicates, write_groups
from transforms.inference import Flux2KleinModelHandler
from transforms.inputs.bigquery import ReadBigQueryRequests, dataset_reference
from transforms.inputs.readers import WARNING_TAG, ReadRequests
from transforms.inputs.template import is_template
from transforms.inputs.template_records import ExpandTemplates
from transforms.preview import WritePreview
from transforms.progress import ReportTotal
from transforms.references import ResolveReferences
from transforms.score_card import WriteScoreHistograms
from transforms.requests import DUPLICATE_TAG, DeduplicateRequests, EnforceMaxImages
from transforms.row_files import WriteRowFile
from transforms.sinks import base as sinks, registry as sink_registry
from transforms.summary import WriteSummary

from . import output_lease
from .launch import JobConfig


def plain(value):
    """An option's value as the transforms and summary.json take it: an enum member as its plain value."""
    return value.value if isinstance(value, enum.Enum) else value


def reference_limits(job: JobConfig):
    """--max_reference_images/--max_reference_pixels and --reference_root, with this run's scope for the reference
    cache."""
    return dataclasses.replace(job.defaults.reference_limits, cache_scope=job.run_token, roots=job.spec.reference_roots,
                               read_timeout_s=job.spec.reliability.read_timeout_s)


def make_handler(job: JobConfig, handler_cls=Flux2KleinModelHandler, **extra) -> Flux2KleinModelHandler:
    """The job's ModelHandler (`handler_cls` lets tests wrap it with the very same arguments)."""
    limits, reliability = job.spec.limits, job.spec.reliability
    return handler_cls(job.load, large_model=limits.large_model, model_copies=limits.model_copies,
                       inference_retries=reliability.inference_retries,
                       require_accelerator=plain(reliability.require_accelerator),
                       env_vars=dict(reliability.worker_env), reference_limits=reference_limits(job),
                       inference_timeout_s=reliability.inference_timeout_s, **extra)


def make_sink(job: JobConfig, progress_dir: str | None) -> sinks.Sink:
    """The sink of --output_format (a row of transforms/sinks/registry.py): the one place the job chooses how its
    images are stored."""
    out = job.spec.output
    encoding = dataclasses.replace(out.encoding, c2pa=job.c2pa) if job.c2pa is not None else out.encoding
    settings = sinks.SinkSettings(out.output, encoding, job.model_fingerprint or None, out.skip_existing,
                                  job.spec.limits.encode_threads, progress_dir, quantize=job.load.engine.quantize,
                                  dtype=job.load.dtype,
                                  score_names=job.load.scores.names if job.load.scores is not None else (),
                                  score_rules=job.spec.scores.rules if job.spec.scores is not None else (),
                                  drop_near_duplicates=out.near_duplicate_distance if out.drop_near_duplicates
                                  else None)
    return sink_registry.sink_class(out.output_format).from_options(settings, out)


def build_pipeline(p: beam.Pipeline, job: JobConfig, *, started_at: float, progress_dir: str | None = None,
                   release_lease: str | None = None) -> dict:
    """Add the job's transforms to `p`; returns its main PCollections by name. `release_lease`: the token of the
    output's lease, which the job's last step removes (a remote job, whose launcher does not wait for its end)."""
    spec, output = job.spec, job.spec.output.output
    read = _read_inputs(p, job)
    dedup = read["requests"] | "Deduplicate" >> DeduplicateRequests(fold_case=job.case_insensitive_output)
    # Reference images are read (bounded, cached per process) before any image is planned: a bad one is one error
    # row for its request; the others get each reference's sha256 and processed size (part of the batch shape).
    resolved = dedup["requests"] | "ResolveReferences" >> ResolveReferences(reference_limits(job),
                                                                            job.defaults.size_multiple)
    planned = resolved["requests"] | "ExpandImages" >> beam.FlatMap(lambda r: r.tasks())
    sink = make_sink(job, progress_dir)
    # What the output already holds (--skip_existing) and where each image will go, before anything is generated.
    placed = dict(planned | "PlanOutput" >> sink.plan())
    tasks = _limited(placed.pop(sinks.TASKS), spec.limits.max_images, progress_dir)
    rules = spec.scores.rules if spec.scores is not None else ()
    generated = tasks | "Generate" >> Generate(make_handler(job), job.load.engine.batch_size, rules)
    written = {**generated, **placed} | "WriteOutput" >> sink
    manifest, existing, failed = written[sinks.MANIFEST], written[sinks.EXISTING], written[sinks.ERRORS]
    # Near-duplicate groups across every image of the output (transforms/duplicates.py), and their marks.
    groups = (((manifest, existing) | "EveryImageHashed" >> beam.Flatten())
              | "NearDuplicates" >> NearDuplicateGroups(spec.output.near_duplicate_distance))
    if spec.output.drop_near_duplicates:
        manifest = mark_duplicates(manifest, groups, "MarkManifestDuplicates")
        existing = mark_duplicates(existing, groups, "MarkExistingDuplicates")

    invalid = (read["invalid"], dedup["invalid"], resolved["invalid"]) | "AllInvalid" >> beam.Flatten()
    errors = (invalid, failed) | "AllErrors" >> beam.Flatten()
    every_image = (manifest, existing) | "EveryImage" >> beam.Flatten()
    # The card's and the preview's statistics: labels per slot, near-duplicate groups, errors by kind.
    stats = {"rows": every_image, "groups": groups, "errors": errors} | "DatasetStats" >> DatasetStats()
    report = stats | "DatasetReport" >> WriteDatasetReport(output, spec.output.encoding.extension,
                                                           written[sinks.DONE])
    after = [*_row_files(output, manifest, existing, errors), written[sinks.DONE], write_groups(groups, output),
             report]
    if spec.output.preview:
        after.append(every_image | "Preview" >> WritePreview(output, spec.output.preview, stats))
    if job.load.scores is not None:  # a histogram of each score (scores/), which the dataset card shows
        after.append(every_image | "ScoreHistograms" >> WriteScoreHistograms(output, job.load.scores.names))

    counted = {
        "records_read": (read["requests"], read["invalid"]) | "AllRecords" >> beam.Flatten(),
        "requests": resolved["requests"],
        "images_planned": planned,
        "images_generated": manifest,
        "skipped": existing,
        "stale": written[sinks.STALE],
        "damaged": written[sinks.DAMAGED],
        "missing": written[sinks.MISSING],
        "invalid": invalid,
        "duplicates": dedup[DUPLICATE_TAG],
        "failed": failed,
        "prompts_truncated": (manifest
                              | "TruncatedRows" >> beam.Filter(lambda row: row["prompt_truncated"])
                              | "TruncatedIds" >> beam.Map(lambda row: row["id"])
                              | "DistinctTruncated" >> beam.Distinct()),
    }
    summary = counted | "Summary" >> WriteSummary(
        output, started_at, extra=_summary_fields(job), after=after, rows={"warnings": read[WARNING_TAG]},
        tallies={"errors_by_reason": errors | "ErrorKinds" >> beam.Map(lambda row: row.get("kind") or "error"),
                 **({"filtered_by_rule": (manifest, existing) | "EveryRow" >> beam.Flatten()
                     | "FilteredRows" >> beam.Filter(lambda row: row.get("filtered"))
                     | "FilteredRules" >> beam.Map(lambda row: row["filtered"]["rule"])} if rules else {})})
    if release_lease:
        summary | "ReleaseOutputLease" >> beam.Map(output_lease.release_from_job, output, release_lease)
    return {"manifest": manifest, "errors": errors, "summary": summary, "tasks": tasks}


def _limited(tasks, max_images: int | None, progress_dir: str | None):
    """The tasks to generate, held to --max_images and counted for the progress line first."""
    if max_images is not None:
        # Counts what this run would generate (images kept from an earlier run excluded) and fails before
        # inference when over.
        tasks = tasks | "MaxImages" >> EnforceMaxImages(max_images)
    if progress_dir:
        total = tasks | "ProgressTotal" >> ReportTotal(progress_dir)
        # Taking the total as a side input makes the runner finish counting before any batch is generated, so the
        # progress line knows the total from the first image on.
        tasks = tasks | "AfterTotal" >> beam.Map(lambda t, _n: t, beam.pvalue.AsSingleton(total))
    return tasks


def _row_files(output: str, manifest, existing, errors) -> list:
    """manifest-*, existing-* and errors-* written; one shard each, under fixed names: a rerun into the same output
    replaces the previous run's files instead of leaving stale shards next to them (so the manifest always lists
    exactly what the latest run generated, and existing-* what it found already there). existing-* is written
    (empty) by every run, so that an earlier run's file never lingers, and only once this run's images are all
    written (the sink releases those rows then): a failed run leaves the previous files as they were, and manifest-*
    and existing-* of the latest run list every image of the output exactly once."""
    return [rows
            | f"{name}Json" >> beam.Map(layout.to_json_line)
            | f"Write{name}" >> WriteRowFile(prefix, layout.ROWS_SUFFIX)
            for name, rows, prefix in (("Manifest", manifest, layout.manifest_prefix(output)),
                                       ("Existing", existing, layout.existing_prefix(output)),
                                       ("Errors", errors, layout.errors_prefix(output)))]


def _summary_fields(job: JobConfig) -> dict:
    """What summary.json says of the job itself, beside the counts."""
    spec = job.spec
    return {"model": job.load.model, "output": spec.output.output,
            "input": list(spec.input.files) + [b.source for b in spec.input.bigquery], "demo": spec.demo,
            "batch_size": job.load.engine.batch_size, "batch_size_auto": job.batch_choice is not None,
            "batch_size_chosen": job.batch_choice, "dtype": job.load.dtype, "quantize": job.load.engine.quantize,
            "vae": job.load.vae,
            "output_format": plain(spec.output.output_format)}


def _read_inputs(p: beam.Pipeline, job: JobConfig) -> dict:
    """{'requests', 'invalid', 'warnings'} of every input: the files, each BigQuery table or query, and the
    warnings found at launch."""
    source = job.spec.input
    reads = []
    templates = {t.source for t in job.templates}
    files = [f for f in source.files if not is_template(f, plain(source.input_format)) and f not in templates]
    if job.templates:
        reads.append(p | "ExpandTemplates" >> ExpandTemplates(job.templates, job.defaults))
    if files:
        patterns = p | "InputPatterns" >> beam.Create(files)
        reads.append(patterns | "ReadRequests" >> ReadRequests(plain(source.input_format), job.defaults,
                                                               source.columns, job.spec.reliability.read_timeout_s))
    temp_dataset = None
    if source.bigquery_temp_dataset is not None:
        temp_dataset = dataset_reference(source.bigquery_temp_dataset, p.options.view_as(GoogleCloudOptions).project)
    for i, query in enumerate(source.bigquery):
        reads.append(p | f"ReadBigQuery{i}" >> ReadBigQueryRequests(query, job.defaults, source.columns,
                                                                     temp_dataset))
    launch = [{"source": "launch", "line": None, "warning": w} for w in job.input_warnings]
    warnings = [r[WARNING_TAG] for r in reads if WARNING_TAG in r] + [p | "LaunchWarnings" >> beam.Create(launch)]
    return {"requests": tuple(r["requests"] for r in reads) | "AllRequests" >> beam.Flatten(),
            "invalid": tuple(r["invalid"] for r in reads) | "AllReadInvalid" >> beam.Flatten(),
            WARNING_TAG: tuple(warnings) | "AllWarnings" >> beam.Flatten()}
