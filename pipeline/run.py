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

The job: its launch (pipeline/launch.py: the checks, the TPU preflight, the output's lease), its graph
(pipeline/graph.py), the lines that close it (pipeline/closing.py) and, here, the command line: exit statuses, and
Ctrl-C / SIGTERM (pipeline/interrupts.py) stopping it with one line on what was written and how to resume.
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all: a signal while the modules below import is one line and exit 130
    from pipeline.interrupts import install_while_starting

    install_while_starting()

import contextlib
import logging
import shutil
import sys
import tempfile
import time

if __name__ == "__main__":  # `python -m pipeline.run`: --help and argument errors before the heavy imports below
    from pipeline.usage import exit_on_usage_error

    exit_on_usage_error(sys.argv[1:])

from apache_beam.io.filesystems import FileSystems  # noqa: E402 - after the command line's quick check
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

from transforms import layout, retries
from transforms.inference import discard_pending_model_loads
from transforms.progress import ProgressReporter

from . import closing, failures, graph, interrupts, launch, log_filters
from .demo import DEMO_CHECKPOINT_NOTICE, demo_notice
from .disk_full import DiskFull
from .dry_run import check_max_images, summary_lines, survey_inputs
from .errors import UsageError
from .option_specs import DEFAULT_OUTPUT
from .options import Flux2KleinOptions
from .switches import normalized as normalized_switches
from .usage import BEAM_HELP_FLAG, HELP_FLAGS, check_arguments, format_beam_help, format_help


def parse(argv: list[str]) -> PipelineOptions:
    """The command line's options, parsed once: UsageError for an argument that is not an option of the job or of
    Beam, or a value that does not parse; FnApiRunner when no --runner is given."""
    argv = normalized_switches(argv)  # --dry_run bare, =true or =false: as the job's switches
    check_arguments(argv)
    return launch.pipeline_options(argv)


def run(argv: list[str] | None = None, *, wait: bool | None = None):
    """Build and run the job; returns (PipelineResult, summary dict or None). Local runners wait for the end.
    UsageError before any work for an argument that is not an option of the job or of Beam, or a bad value."""
    return run_options(parse(list(sys.argv[1:] if argv is None else argv)), wait=wait)


def run_options(options: PipelineOptions, *, wait: bool | None = None):
    """`run` with the command line already parsed (`parse`)."""
    retries.install()
    retries.take_pending()  # count only this job's retries (an earlier job in this process may have left some)
    discard_pending_model_loads()  # and only its model loads
    local = launch.is_local_runner(options)
    if local:
        launch.quiet_tpu_runtime()
    dry_run = launch.is_dry_run(options)
    if dry_run and not local:
        launch.check_dry_run_locations(options)
    job = launch.resolve_job(options)
    o = options.view_as(Flux2KleinOptions)
    wait = local if wait is None else wait
    if dry_run:  # a dry run writes nothing: what the output holds does not matter to it, nor who writes there
        return _run_holding(options, job, None, local=local, dry_run=True, replacing=None, wait=wait)
    # First the output's lease: a job running there is named, and nothing of it is touched (exit 2). This process
    # holds it (refreshing it) while it launches, and runs, a local job; a remote job's last step removes it.
    with launch.holding_output(job, overwrite=bool(o.overwrite),
                               demo_default_output=job.spec.demo and o.output is None) as held:
        result, summary = _run_holding(options, job, held.lease, local=local, dry_run=False,
                                       replacing=held.replacing, wait=wait)
        if not wait:
            held.hand_to_job(closing.submitted_job_id(result), options)
        return result, summary


def _run_holding(options: PipelineOptions, job: launch.JobConfig, lease, *, local: bool, dry_run: bool, replacing,
                 wait):
    """The rest of `run`, once the output's lease is held (`lease`; None for a dry run, which writes nothing)."""
    o = options.view_as(Flux2KleinOptions)
    job = launch.tpu_preflight(options, job, local=local)
    if dry_run:  # every record read and checked here; what the job would do, said in a few lines
        survey = survey_inputs(job)
        for line in summary_lines(job, survey, launch.runner_name(options)):
            print(line, flush=True)
        check_max_images(job, survey)
        if local:  # a local runner has nothing to translate: nothing more is done
            return None, None
    if local:
        launch.start_local_runtime(options, job.spec)
    output = job.spec.output.output
    if job.spec.demo:
        print(demo_notice(job.load.model, job.spec.input.files[0], output), flush=True)
    elif o.demo_checkpoint:
        print(DEMO_CHECKPOINT_NOTICE.format(model=job.load.model), flush=True)
    if replacing:
        print(replacing, flush=True)

    progress_dir = None
    show_progress = wait and local and not o.no_progress
    if wait and local:  # the workers' counts: the progress line, and what is left when a disk fills
        progress_dir = tempfile.mkdtemp(prefix="flux2-progress-")
    started_at = time.time()
    p = launch.beam_pipeline(options)
    release = lease.holder.token if lease is not None and lease.tag is not None and not wait else None
    graph.build_pipeline(p, job, started_at=started_at, progress_dir=progress_dir, release_lease=release)
    if not wait:
        result = p.run()
        cloud = options.view_as(GoogleCloudOptions)
        for line in closing.submitted_lines(launch.runner_name(options), output, dry_run=dry_run,
                                            job_id=closing.submitted_job_id(result), region=cloud.region,
                                            project=cloud.project):
            print(line, flush=True)
        return result, None
    # FnApiRunner runs the whole job inside p.run(): the progress reporter has to be polling before it starts.
    try:
        with ProgressReporter(progress_dir) if show_progress else contextlib.nullcontext():
            result = p.run()
            result.wait_until_finish()
    except Exception as e:
        said = failures.explained(e, model=job.load.model, output=output, progress_dir=progress_dir,
                                  started_at=started_at)
        if said is not None:
            raise said from e
        raise
    finally:
        if progress_dir:
            shutil.rmtree(progress_dir, ignore_errors=True)
    return result, closing.finish(job, result)


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
    failures.quiet_worker_tracebacks()
    log_filters.quiet_replaced_row_files()  # a rerun replaces the row files under their fixed names: no warning
    previous = interrupts.install()
    options = None
    try:
        options = parse(argv)
        return _run_to_status(options)
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
        return _stop_after_signal(options, argv, signum)
    finally:
        if interrupts.STATE.received is None:  # after a signal the process leaves at once (interrupts.exit_process)
            interrupts.restore(previous)


def _run_to_status(options: PipelineOptions) -> int:
    """Run the job; 0, or 1 with one line when a finished run generated nothing (unless --allow_empty)."""
    _, summary = run_options(options)
    reason = empty_run_reason(summary)
    if reason and not options.view_as(Flux2KleinOptions).allow_empty:
        print(f"error: {reason} (--allow_empty accepts such a run)", file=sys.stderr)
        return 1
    return 0


def _stop_after_signal(options: PipelineOptions | None, argv: list[str], signum: int) -> int:
    """One line on what was written and how to resume; Beam's temporary folders removed; 128 + the signal.
    `options`: the parsed command line (None when the signal came while it was parsed)."""
    logging.disable(logging.CRITICAL)  # Beam's threads report the interrupt at length: the line below says it
    try:
        options = options or launch.pipeline_options(argv)
        output = options.view_as(Flux2KleinOptions).output or DEFAULT_OUTPUT
    except Exception:  # noqa: BLE001 - a command line that does not parse: where a run writes by default
        output = DEFAULT_OUTPUT
    cleanup = launch.CLEANUP  # this run's own temporary folders, removed by run()
    removed = cleanup["temp_removed"] if cleanup["output"] == output else 0
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
