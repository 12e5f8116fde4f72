"""What the launch finds out from the machine and the storage the options name, before the job starts.

The checkpoint (the demo's, built on first use; a local folder; a gs:// prefix; a Hugging Face Hub id, downloaded
once) and its configs, the files each `--input` pattern matches and their headers, what a BigQuery read needs, and
whether the output folder tells 'A.png' from 'a.png'; first, whether the GCS API answers at all when the launch has
gs:// paths to read (offline, the clients' retries would take two minutes to say so). Everything that only looks at
the option values is pipeline/specs.py; pipeline/output_check.py looks for a previous run's results in the output.
Each probe raises a UsageError naming the option whose value it could not use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import tempfile

from apache_beam.io.filesystems import FileSystems

from model import ModelError, is_hub_id, read_config_and_digest
from transforms.bounded_reads import file_kind
from transforms.defaults import DEFAULT_READ_TIMEOUT_S
from transforms.inputs.bigquery import dataset_reference
from transforms.inputs.check import InputCheckError, check_input_files
from transforms.inputs.delimited import field_limit_for

from .demo import demo_checkpoint
from .errors import UsageError
from .hub_model import hub_model
from .specs import InputSpec, JobSpec, ModelSpec, Runner

logger = logging.getLogger("pipeline.probes")

EXAMPLE_HUB_ID = "black-forest-labs/FLUX.2-klein-4B"
GCS_PROBE_TIMEOUT_S = 5.0  # how long the launch waits for the GCS API to answer at all before saying it cannot


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The checkpoint the workers load, as the launch found it (its configs, and its weight files' headers: no
    weight is read)."""

    location: str  # a local folder or a gs:// prefix
    size_multiple: int  # heights and widths are multiples of it (the job accepts what generate() accepts)
    digest: str  # what the checkpoint holds, by content (the model's checkpoint_digest): in the model fingerprint


def gcs_paths_read(spec: JobSpec, *, output_checked: bool) -> list[tuple[str, str]]:
    """(option, gs:// path) of what the launch reads on GCS: the checkpoint, the input files, a Hub id's gs:// copy
    for remote workers, and the output when it is checked for a previous run's results."""
    model, found = spec.model.model, []
    if model and model.startswith("gs://"):
        found.append(("--model", model))
    elif model and is_hub_id(model) and not spec.runner.local:
        found.append(("--model_cache" if spec.model.model_cache else "--temp_location",
                      spec.model.model_cache or spec.runner.temp_location or ""))
    found += [("--input", path) for path in spec.input.files]
    if output_checked:
        found.append(("--output", spec.output.output))
    return [(option, path) for option, path in found if path.startswith("gs://")]


def gcs_endpoint() -> str:
    """The URL of the GCS API this process talks to: the emulator's (STORAGE_EMULATOR_HOST) or Google's."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return "https://storage.googleapis.com"
    return host if "://" in host else f"http://{host}"


def check_gcs_reachable(paths: list[tuple[str, str]], timeout_s: float = GCS_PROBE_TIMEOUT_S) -> None:
    """UsageError within about `timeout_s` when the launch has gs:// `paths` to read and the GCS API does not answer
    at all (offline, no DNS, a firewall): Beam's and the storage client's own retries take two minutes to give up.
    Any HTTP answer will do (through the proxies the environment names, as the clients go); nothing is read."""
    if not paths:
        return
    import requests

    endpoint = gcs_endpoint()
    try:
        requests.head(endpoint, timeout=timeout_s, allow_redirects=False)
    except requests.RequestException as e:
        option, path = paths[0]
        cause = getattr(e.args[0], "reason", None) if e.args else None  # urllib3's: what failed, without the URL
        reason = " ".join(str(cause or e).split())
        raise UsageError(f"{option}={path!r} is on Google Cloud Storage, and {endpoint} cannot be reached within "
                         f"{timeout_s:g} s ({type(cause or e).__name__}: {reason[:300]}); check the network, or give "
                         f"local paths") from None


def checkpoint_location(spec: ModelSpec, runner: Runner) -> str:
    """Where the checkpoint `--model` names is for the workers: the demo's (none named; built on first use), a
    local folder or gs:// prefix as given, or a Hub id's snapshot (downloaded, or found cached, once, here)."""
    model = spec.model
    if model is None:
        return demo_checkpoint()
    if is_hub_id(model):
        return hub_model(model, spec.model_variant, local_runner=runner.local, model_cache=spec.model_cache,
                         temp_location=runner.temp_location)
    if "://" not in model and not os.path.isdir(model):
        raise UsageError(f"--model={model!r} is not a folder (give a diffusers-layout checkpoint folder, "
                         f"a gs:// prefix or a Hugging Face Hub id such as {EXAMPLE_HUB_ID})")
    return model


# Set by templates/main.py to the folder of checkpoint configs a Flex Template launcher defaults --model to.
CONFIGS_ONLY_ENV = "FLUX2_CONFIGS_ONLY"


def read_checkpoint(location: str, variant: str | None) -> Checkpoint:
    """The checkpoint's configs and digest, and its weight files checked from their headers and sizes (every file
    the workers' loader reads, of `variant`: no LFS pointer, empty or cut short file, every tensor of the model);
    UsageError naming the file when they cannot be read as FLUX.2 [klein]'s."""
    configs_only = os.environ.get(CONFIGS_ONLY_ENV) == location
    if configs_only:
        logger.info("--model=%s holds the checkpoint's configs only (a Flex Template launcher): its weights are in the "
                    "worker image, where the loader checks them; the model is identified by the build's record of "
                    "their crc32c when the image has one, else by the configs alone", location)
    try:
        config, digest = read_config_and_digest(location, variant, check_weights=not configs_only,
                                                configs_only=configs_only)
    except ModelError as e:
        raise UsageError(f"--model={location!r} cannot be read as a FLUX.2 [klein] checkpoint: "
                         f"{type(e).__name__}: {e}") from e
    return Checkpoint(location=location, size_multiple=config.size_multiple, digest=digest)


def check_loras(spec, location: str) -> tuple[dict, ...]:
    """The --lora adapters checked from their headers against the checkpoint at `location`: their identities (name,
    sha256, scale) for the model fingerprint; UsageError naming the adapter and its key that fits no parameter."""
    if not spec.lora:
        return ()
    import model

    try:
        return model.check_loras(spec.lora, model.read_config(location, spec.model_variant),
                                 spec.checkpoint_cache_dir)
    except ModelError as e:
        raise UsageError(f"--lora cannot be applied to this checkpoint's transformer: {type(e).__name__}: {e}") from e


def check_vae(source: str | None, location: str, variant: str | None, cache_dir: str | None) -> str | None:
    """--vae checked against the checkpoint at `location` as its own VAE would be (config, latent channels, every
    tensor's name and shape from the weights' header: model/loading/vae_swap.py); its content identity, for the model
    fingerprint (None without --vae). UsageError naming the key or tensor and the file."""
    if not source:
        return None
    from model import check_vae as check_against, read_config, vae_files, vae_identity

    try:
        files = vae_files(source, cache_dir)
        check_against(files, read_config(location, variant))
        return vae_identity(files)
    except ModelError as e:
        raise UsageError(f"--vae={source!r} cannot replace the checkpoint's VAE: {type(e).__name__}: {e}") from e


def check_bigquery(spec: InputSpec, runner: Runner) -> None:
    """What BigQuery reads need from the runner's options: --bigquery_temp_dataset in --project (or named whole),
    and a gs:// --temp_location to export the rows through."""
    if spec.bigquery_temp_dataset is not None:
        try:
            dataset_reference(spec.bigquery_temp_dataset, runner.project)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if spec.bigquery and not (runner.temp_location or "").startswith("gs://"):
        raise UsageError("reading from BigQuery exports the rows through --temp_location: give a gs:// one, e.g. "
                         "--temp_location=gs://BUCKET/tmp")


def match_inputs(patterns: tuple[str, ...]) -> list[str]:
    """Every file the --input patterns match, once each, in order; UsageError for a pattern that matches none, only
    folders, or cannot be listed."""
    files: dict[str, None] = {}
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
        odd = [m.path for m in matched if "://" not in m.path and not _regular_or_folder(m.path)]
        if odd and len(odd) == len(matched):  # a FIFO or device would block the read: only regular files are read
            raise UsageError(f"--input {pattern!r} is not a regular file ({_kind(odd[0])}); give a file")
        files.update((m.path, None) for m in matched)
    return list(files)


def _regular_or_folder(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return True  # gone since the match: the job reports it
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode)


def _kind(path: str) -> str:
    try:
        return file_kind(os.stat(path).st_mode)
    except OSError as e:
        return str(e)


def c2pa_signer(output):
    """The C2PA signer of --c2pa_cert/--c2pa_key (None without them), checked by signing once: UsageError else."""
    from transforms.c2pa_signing import C2paSettingsError, signer_from_options

    try:
        return signer_from_options(output.c2pa_cert, output.c2pa_key)
    except C2paSettingsError as e:
        raise UsageError(str(e)) from None


def load_templates(files: list[str], spec, defaults) -> tuple:
    """The input files that are prompt templates, read and checked with their vocabularies and held to
    --max_images (transforms/inputs/template.py); UsageError naming what is wrong."""
    from transforms.inputs.template import TemplateError, check_total, is_template, load_template

    fmt = getattr(spec.input.input_format, "value", spec.input.input_format)
    try:
        templates = tuple(load_template(f) for f in files if is_template(f, fmt))
        check_total(list(templates), defaults.num_images, spec.limits.max_images)
    except TemplateError as e:
        raise UsageError(str(e)) from None
    return templates


def check_inputs(files: list[str], spec: InputSpec, max_prompt_bytes: int,
                 read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S) -> tuple[str, ...]:
    """Each table's header (and the first JSONL records) must give the prompt column: said now, not in one error
    row per record. Returns the warnings (logged), such as a --column_map column a table lacks. Each read returns
    within `read_timeout_s` (a file that cannot be read in time is left to the job's error rows)."""
    try:
        warnings = check_input_files(files, str(spec.input_format), spec.columns, field_limit_for(max_prompt_bytes),
                                     read_timeout_s)
    except InputCheckError as e:
        raise UsageError(str(e)) from None
    for warning in warnings:
        logger.warning("%s", warning)
    return tuple(warnings)


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


def case_insensitive_output(output: str) -> bool:
    """Whether a local --output folder folds case; a gs:// output never does. An output not made yet is judged by
    the nearest folder above it that exists (the same file system), so the launch creates nothing there."""
    if "://" in output:
        return False
    folder = os.path.abspath(output)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return is_case_insensitive_folder(folder)
    except OSError as e:
        raise UsageError(f"--output={output!r} cannot be written: {e}") from e
