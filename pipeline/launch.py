"""The launch, before and around the job's graph: the runner, the checks of the options against the checkpoint and
the files (`resolve_job`), the TPU preflight, the local accelerator runtime's early start, Beam's own check of its
options, and the output: its lease, the check for a previous run's results and the removal of this run's temporary
folders when it stops (`holding_output`). What the job could not run is a UsageError here, before any work (exit 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid

import apache_beam as beam
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions, StandardOptions, TestOptions

from transforms.fingerprints import model_fingerprint, scoring_identity
from transforms.inputs.validation import RequestDefaults

from model import LoadSettings

from . import launch_check, new_folders, output_lease, probes
from .errors import UsageError
from .options import Flux2KleinOptions
from .output_check import check_output
from .specs import JobSpec, Runner, job_spec

DEFAULT_RUNNER = "FnApiRunner"
LOCAL_RUNNERS = ("fnapirunner", "directrunner", "bundlebaseddirectrunner", "switchingdirectrunner")


def pipeline_options(argv: list[str]) -> PipelineOptions:
    """The command line's options, on FnApiRunner when no --runner is given (pipeline/run.py says why)."""
    options = PipelineOptions(argv)
    if options.view_as(StandardOptions).runner is None:
        options.view_as(StandardOptions).runner = DEFAULT_RUNNER
    return options


def runner_name(options: PipelineOptions) -> str:
    runner = options.view_as(StandardOptions).runner
    if runner is None:
        return DEFAULT_RUNNER
    return runner if isinstance(runner, str) else type(runner).__name__


def is_local_runner(options: PipelineOptions) -> bool:
    return runner_name(options).rsplit(".", 1)[-1].lower() in LOCAL_RUNNERS


def is_dry_run(options: PipelineOptions) -> bool:
    """`--dry_run` on any runner: the launch checks the options, the model and every input record and says what the
    job would do (pipeline/dry_run.py); nothing is generated or written. A remote runner (Dataflow) also translates
    the job without submitting it."""
    return bool(options.view_as(TestOptions).dry_run)


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


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """Everything the graph needs: the options as checked groups (`spec`: input, output, model, generation, limits,
    reliability; pipeline/specs.py), read there as they are, and what the launch resolved with the checkpoint and
    the files (pipeline/probes.py)."""

    spec: JobSpec
    load: LoadSettings  # goes unchanged through the handler to model.load (the checkpoint, dtype, batch size)
    defaults: RequestDefaults  # what a record that does not say gets, and its limits (the checkpoint's size multiple)
    input_warnings: tuple[str, ...] = ()  # found at launch (a --column_map column a table lacks)
    case_insensitive_output: bool = False  # a local output folder where 'A.png' and 'a.png' are one file
    # What the loaded model is (transforms/fingerprints.py): stored with every image, compared by --skip_existing.
    model_fingerprint: str = ""
    run_token: str = ""  # this launch, so a worker process's reference cache never serves an earlier job's copy
    # How --batch_size auto became `load.engine.batch_size` (the launch's TPU preflight, or the default); None:
    # --batch_size N.
    batch_choice: str | None = None
    preflight: dict | None = None  # the TPU preflight's figures (topology, batch, estimate), when it ran
    templates: tuple = ()  # the --input templates, read and checked (transforms/inputs/template.py)
    c2pa: object = None  # transforms.c2pa_signing.C2paSigner of --c2pa_cert/--c2pa_key, checked by signing once


def resolve_job(options: PipelineOptions) -> JobConfig:
    """The options as checked groups (pipeline/specs.py), then what the launch finds with them (pipeline/probes.py):
    the checkpoint and its configs, what BigQuery needs, the input files and their headers, the output folder.
    UsageError before any work for anything the job could not run."""
    cloud = options.view_as(GoogleCloudOptions)
    runner = Runner(runner_name(options), is_local_runner(options), cloud.temp_location, cloud.project)
    spec = job_spec(options.view_as(Flux2KleinOptions), runner)
    probes.check_gcs_reachable(probes.gcs_paths_read(spec, output_checked=not is_dry_run(options)))
    checkpoint = probes.read_checkpoint(probes.checkpoint_location(spec.model, runner), spec.model.model_variant)
    loras = probes.check_loras(spec.model, checkpoint.location)
    vae = probes.check_vae(spec.model.vae, checkpoint.location, spec.model.model_variant,
                           spec.model.checkpoint_cache_dir)
    defaults = spec.request_defaults(checkpoint.size_multiple, loras)
    load = spec.load_settings(checkpoint.location)
    if load.scores is not None:
        from .score_checks import check_scores

        check_scores(load.scores)
    probes.check_bigquery(spec.input, runner)
    files = probes.match_inputs(spec.input.files)
    templates = probes.load_templates(files, spec, defaults)
    files = [f for f in files if f not in {t.source for t in templates}]
    return JobConfig(spec=spec, load=load, defaults=defaults, templates=templates, c2pa=probes.c2pa_signer(spec.output),
                     input_warnings=probes.check_inputs(files, spec.input, spec.limits.max_prompt_bytes,
                                                        spec.reliability.read_timeout_s),
                     case_insensitive_output=probes.case_insensitive_output(spec.output.output),
                     run_token=uuid.uuid4().hex, model_fingerprint=model_fingerprint(
                         checkpoint.digest, dtype=load.dtype, max_sequence_length=load.max_sequence_length,
                         text_encoder_out_layers=load.text_encoder_out_layers, quantize=load.engine.quantize,
                         # per-record adapters are in each image's request fingerprint instead
                         loras=() if spec.model.lora_per_record else loras, vae=vae,
                         scoring=scoring_identity(load.scores, _rules_in_fingerprint(spec))))


def _rules_in_fingerprint(spec) -> tuple:
    """The score filters the model fingerprint records: none for `files`, whose resume applies them again to each
    kept image; all for `webdataset`, whose kept shards are kept whole (other thresholds make the shards again)."""
    if spec.scores is None or str(getattr(spec.output.output_format, "value", spec.output.output_format)) == "files":
        return ()
    return spec.scores.rules


# ------------------------------------------------------------------------------------------------ the accelerator
def accelerator_device_nodes() -> list[str]:
    """The TPU or NVIDIA device nodes of this machine (none on a CPU-only one)."""
    import glob

    return glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*") + glob.glob("/dev/nvidia[0-9]*")


def start_local_runtime(options: PipelineOptions, spec: JobSpec, device_nodes=accelerator_device_nodes) -> bool:
    """On a local run whose worker is this process (not multi_processing, no model server process: --large_model
    and --model_copies load it elsewhere) on a machine with an accelerator, start the accelerator runtime now, on
    its own thread beside the pipeline's start, instead of when the model loads: seconds of a TPU host's job start
    (model.start_runtime; its error, if any, is raised by the load). --worker_env's variables are set in this
    process first, as the worker (this process) would set them before its model loads: the runtime reads them when
    it starts. Returns whether it started."""
    mode = options.get_all_options().get("direct_running_mode")
    elsewhere = spec.limits.large_model or spec.limits.model_copies  # a model server process loads it
    if mode == "multi_processing" or elsewhere:
        return False
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu" or not device_nodes():
        return False
    import model

    os.environ.update(dict(spec.reliability.worker_env))
    model.start_runtime()
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


def tpu_preflight(options: PipelineOptions, job: JobConfig, *, local: bool) -> JobConfig:
    """For TPU workers (unless --skip_preflight): compile the job for their topology first; UsageError (nothing
    submitted) if it cannot fit. With --batch_size auto the batch is the fastest per image up to --max_batch_size that
    fits there, also on a local run with this machine's TPU (pipeline/launch_check.py); with no TPU topology to fit, the
    default (model.DEFAULT_BATCH_SIZE, at most --max_batch_size). Returns the job with its batch; the submitted
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
        batch = job.load.engine.batch_size
        return _with_batch(options, job, batch, f"the default, {batch} ({why})")
    figures = (launch_check.pick_local_batch(job, topology) if local
               else launch_check.check_fits(job, topology))
    if auto:
        job = _with_batch(options, job, figures["batch"], f"the fastest per image up to {figures['max_batch_size']} "
                                                           f"whose programs fit {topology} (TPU preflight at launch)")
    source = figures.get("answer_source", "compiled")
    source = "compiled now" if source == "compiled" else f"stored answer {source}, compiled nothing"
    print(f"TPU preflight: fits {topology} with {figures['model_shards']} model shard(s) at batch "
          f"{figures['batch']}{' (picked)' if auto else ''}: peak {figures['peak_bytes_per_chip'] / 2**30:.2f} of "
          f"{figures['hbm_bytes_per_chip'] / 2**30:.2f} GiB per chip (compiler's estimate; {source})", flush=True)
    return dataclasses.replace(job, preflight=figures)


def _with_batch(options: PipelineOptions, job: JobConfig, batch: int, choice: str) -> JobConfig:
    """`job` at `batch` images per compiled batch (what every worker's model compiles), with how it was chosen for
    summary.json; the pipeline options that go to the runner say the number instead of 'auto'."""
    options.view_as(Flux2KleinOptions).batch_size = batch
    engine = dataclasses.replace(job.load.engine, batch_size=batch)
    return dataclasses.replace(job, load=dataclasses.replace(job.load, engine=engine), batch_choice=choice)


def beam_pipeline(options: PipelineOptions) -> beam.Pipeline:
    """The job's Beam pipeline; Beam's own check of its options (a project id, a region, gs:// locations) failing
    is a UsageError naming what it found."""
    try:
        return beam.Pipeline(options=options)
    except ValueError as e:
        if not str(e).startswith("Pipeline has validations errors"):
            raise
        found = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        raise UsageError(f"Beam's check of the options failed: {' '.join(found)}") from None


# ------------------------------------------------------------------------------------------------ the output
# What the last run cleaned up when it stopped (main's line after a signal says it).
CLEANUP: dict = {"temp_removed": 0, "output": None}


@dataclasses.dataclass
class HeldOutput:
    """The output while this run holds its lease: the lease, and the line saying what this run replaces (None)."""

    lease: output_lease.OutputLease
    replacing: str | None
    submitted: bool = False  # handed to a submitted job, whose last step removes the lease

    def hand_to_job(self, job_id: str | None, options: PipelineOptions) -> None:
        """A submitted (remote) job holds the lease from now on, until its last step: its launcher does not wait."""
        self.submitted = True
        cloud = options.view_as(GoogleCloudOptions)
        self.lease.hand_to_job(job_id or cloud.job_name or "",
                               output_lease.dataflow_runner(cloud.project, cloud.region))


@contextlib.contextmanager
def holding_output(job: JobConfig, *, overwrite: bool, demo_default_output: bool):
    """Take the output's lease first (a job running there is named, and nothing of it is touched: UsageError), clear
    what stopped or killed runs left behind, check the output for a previous run's results (pipeline/output_check.py)
    and keep the lease fresh while this process launches, and runs, a local job. On any exception, Ctrl-C included,
    the temporary folders of this run are removed (`CLEANUP` says how many); the lease is released at the end unless
    a submitted job holds it (`HeldOutput.hand_to_job`)."""
    output = job.spec.output.output
    before = new_folders.folders_before(output)  # a run that fails leaves no empty folder of its own there
    held = HeldOutput(output_lease.take_output_lease(output, job=job.run_token[:12]), None)
    CLEANUP.update(temp_removed=0, output=output)
    failed = False
    try:
        held.lease.clear_leftovers()  # what stopped or killed runs left behind (never a result: before the check)
        held.replacing = check_output(output, skip_existing=job.spec.output.skip_existing, overwrite=overwrite,
                                      demo_default_output=demo_default_output)
        held.lease.start_heartbeat()
        yield held
    except BaseException:
        CLEANUP["temp_removed"] = held.lease.remove_own_temp()
        failed = True
        raise
    finally:
        if not held.submitted:  # a submitted job holds the lease until its last step
            held.lease.release()
            if failed:
                new_folders.remove_new_empty_folders(before)
