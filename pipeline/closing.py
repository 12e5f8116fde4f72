"""What a run prints when it ends: a local run's summary, its warnings, where its results are and the job's metrics
(`finish`, which also adds the retry counts to summary.json); a launch that does not wait, where the outputs go and
the submitted job's id and console page (`submitted_lines`)."""

from __future__ import annotations

import json
import logging
import sys

from transforms import layout, retries
from transforms.metrics import NAMESPACE as METRICS_NAMESPACE
from transforms.sinks import registry as sink_registry
from transforms.sinks.writes import read_bytes, write_bytes_atomic
from transforms.summary import format_summary

from .demo import DEMO_DONE
from .launch import JobConfig

logger = logging.getLogger("pipeline.run")  # the command line's name in its log

DATAFLOW_CONSOLE = "https://console.cloud.google.com/dataflow/jobs/{region}/{job_id}?project={project}"


def finish(job: JobConfig, result) -> dict:
    """After a local run: summary.json with the retry counts added, and the lines that close the run. Returns the
    summary."""
    output = job.spec.output.output
    summary = json.loads(read_bytes(layout.summary_path(output)).decode("utf-8"))
    metrics = _query_metrics(result)  # once: the retry figures and the printed metrics both come from it
    counters = _flux2_counters(metrics)
    summary = _add_retries(output, summary, counters)
    print(f"summary: {format_summary(summary)}")
    for row in summary.get("warnings", []):
        print(f"warning: {row['warning']}", file=sys.stderr)
    for line in closing_lines(job, summary):
        print(line)
    _print_metrics(metrics, counters)
    if job.spec.demo:
        print(DEMO_DONE)
    return summary


def closing_lines(job: JobConfig, summary: dict) -> list[str]:
    """Where the results are: the images (or shards), the manifest, the sink's own index (metadata.jsonl), the
    preview, and the errors file when the run wrote error rows."""
    out, sink = job.spec.output.output, sink_registry.sink_class(job.spec.output.output_format)
    lines = [f"images: {sink.images_where(out)}",
             f"manifest: {layout.manifest_prefix(out)}-*.jsonl{sink.manifest_note(out)}"]
    if job.spec.output.preview:
        lines.append(f"preview: {layout.join(out, 'preview/index.html')} (open it in a browser)")
    if summary.get("invalid", 0) + summary.get("failed", 0) + summary.get("duplicates", 0):
        lines.append(f"errors: {layout.errors_prefix(out)}-*.jsonl (one row per record or image that failed, "
                     f"with the reason)")
    lines.append(f"summary: {layout.summary_path(out)}")
    return lines


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


def _add_retries(output: str, summary: dict, counters: dict[str, int]) -> dict:
    """Add what the job retried (GCS requests, inference batches) to summary.json once the job is over: the
    figures are Beam counters, which only the finished job knows (a Dataflow job shows them in its metrics)."""
    figures = {"gcs": counters.get(retries.GCS_RETRIES, 0) + retries.take_pending(),
               "inference": counters.get("inference_retries", 0)}
    summary = dict(summary, retries=figures)
    try:
        write_bytes_atomic(layout.summary_path(output), (json.dumps(summary, indent=2) + "\n").encode("utf-8"),
                           mime_type="application/json")
    except Exception as e:  # noqa: BLE001 - the job's outputs are complete; only this addition is lost
        logger.warning("could not add the retry counts to %s: %s", layout.summary_path(output), e)
    return summary


def _print_metrics(metrics: dict | None, counters: dict[str, int]) -> None:
    """The job's counters (`_flux2_counters` of `metrics`) and its batch size and time per image."""
    if metrics is None:
        return
    dists = {d.key.metric.name: d.committed for d in metrics["distributions"]
             if d.key.metric.namespace == METRICS_NAMESPACE}
    if counters:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(counters.items()))
        print(f"metrics: {shown}")
    for name in ("batch_size", "generation_ms_per_image"):
        d = dists.get(name)
        if d is not None and d.count:
            print(f"metrics: {name} count={d.count} mean={d.mean:.1f} min={d.min} max={d.max}")
