"""The TPU preflight at launch: a Dataflow job for TPU workers is compiled for the workers' topology before it is
submitted, so a job whose programs cannot fit the chips' HBM never starts (and bills) its workers.

The topology comes from the job's `worker_accelerator` service option (as the settings files and `templates/run.sh`
pass it: `--dataflow_service_options` or, through a Flex Template, `--experiments`), else from a TPU machine type.
The programs it compiles are written to the job's shared compilation cache (`--compilation_cache_dir`, by default
under `--temp_location`): a worker whose JAX, libtpu and chips match the launcher's loads them instead of compiling.
The check compiles at the job's default size, batch, steps, dtype and `--model_shards` (records that ask for more
pixels are not covered); `--skip_preflight` skips it. With `--batch_size auto` (the default) it picks the batch: the
largest up to `--max_batch_size` whose programs fit (model.fit's search), which the job then runs at.

A local run checks nothing, except that with `--batch_size auto` on a machine with a TPU attached the batch is picked
the same way, for the chips found here (`local_tpu_topology`), by the preflight in a child process that never opens
the chips (`pick_local_batch`). GPU and CPU workers are never checked; auto is then DEFAULT_BATCH_SIZE.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

from model import ATTACHED, attached_topology

from .errors import UsageError

logger = logging.getLogger("pipeline.launch_check")

# Bytes of HBM per chip to check against instead of the chip's own (leave room for something else on the chip;
# the tests use it to make a tiny model not fit).
HBM_BYTES_ENV = "FLUX2_PREFLIGHT_HBM_BYTES"
# Dataflow's TPU accelerator types -> libtpu's chip names in topology names ("v5e:2x2").
TPU_CHIP_NAMES = {"tpu-v5-lite-podslice": "v5e", "tpu-v6e-slice": "v6e", "tpu-v5p-slice": "v5p"}
# TPU machine types -> topology, for a job that names the machine but no accelerator option.
_MACHINE_TOPOLOGY = re.compile(r"^(ct5lp-hightpu|ct6e-standard)-(1|4|8)t$")
_MACHINE_CHIPS = {"ct5lp-hightpu": "v5e", "ct6e-standard": "v6e"}
_CHIP_GRIDS = {"1": "1x1", "4": "2x2", "8": "2x4"}


def accelerator_fields(spec: str) -> dict[str, str]:
    """`type:tpu-v5-lite-podslice;topology:2x2` -> {'type': ..., 'topology': ...} (a bare flag maps to '')."""
    fields = {}
    for part in spec.split(";"):
        key, _, value = part.strip().partition(":")
        if key:
            fields[key] = value
    return fields


def tpu_topology(service_options: list[str], machine_type: str | None = None) -> str | None:
    """The libtpu topology name of the workers ("v5e:2x2"), or None when they are not TPU workers."""
    for option in service_options:
        if option.startswith("worker_accelerator="):
            fields = accelerator_fields(option[len("worker_accelerator="):])
            kind = fields.get("type", "")
            if not kind.startswith("tpu-"):
                return None
            if kind not in TPU_CHIP_NAMES:
                raise UsageError(f"worker_accelerator type {kind!r} is a TPU the preflight does not know "
                                 f"(known: {', '.join(TPU_CHIP_NAMES)}); pass --skip_preflight to launch unchecked")
            if not fields.get("topology"):
                raise UsageError(f"worker_accelerator {option!r} names no topology (e.g. topology:2x2)")
            return f"{TPU_CHIP_NAMES[kind]}:{fields['topology']}"
    match = _MACHINE_TOPOLOGY.match(machine_type or "")
    if match:
        return f"{_MACHINE_CHIPS[match.group(1)]}:{_CHIP_GRIDS[match.group(2)]}"
    return None


def job_topology(options) -> str | None:
    """The TPU topology the job's Dataflow workers will have, from its pipeline options (None: not TPU workers)."""
    from apache_beam.options.pipeline_options import DebugOptions, GoogleCloudOptions, WorkerOptions

    service = list(options.view_as(GoogleCloudOptions).dataflow_service_options or [])
    service += list(options.view_as(DebugOptions).experiments or [])
    return tpu_topology(service, options.view_as(WorkerOptions).machine_type)


def hbm_bytes_override() -> int | None:
    """HBM_BYTES_ENV as a positive integer, or None when unset; UsageError naming a bad value."""
    value = os.environ.get(HBM_BYTES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{HBM_BYTES_ENV} must be a positive number of bytes, got {value!r}")
    return int(value)


def _scorer_bytes(job) -> int:
    """What --score_model's scorer keeps on each chip (0 without it), at the largest batch auto may pick."""
    load, d = job.load, job.defaults
    if load.scores is None:
        return 0
    from .score_checks import reserved_bytes

    batch = job.spec.limits.max_batch_size if job.spec.limits.auto_batch else load.engine.batch_size
    return reserved_bytes(load.scores, load.dtype, d.height, d.width, batch)


def check_fits(job, topology: str):
    """Compile `job`'s programs for `topology` at its defaults; with --batch_size auto, the largest batch up to
    --max_batch_size that fits. UsageError naming the shortfall and what would fit (a smaller batch first) when they
    do not. Returns the preflight's report (its `batch` is the one to run)."""
    from .preflight import PreflightRequest, format_report, preflight, shortfall_message

    d, limits, load = job.defaults, job.spec.limits, job.load
    request = PreflightRequest(model=load.model, topology=topology, height=d.height, width=d.width,
                               batch_size=None if limits.auto_batch else load.engine.batch_size, dtype=load.dtype,
                               num_inference_steps=d.num_inference_steps, guidance_scale=d.guidance_scale,
                               model_shards=load.engine.model_shards, max_sequence_length=load.max_sequence_length,
                               hbm_bytes=hbm_bytes_override(), max_batch_size=limits.max_batch_size,
                               quantize=load.engine.quantize, reserved_bytes=_scorer_bytes(job))
    logger.info("TPU preflight: compiling %s for %s at %dx%d, batch %s, %d model shard(s) (--skip_preflight skips)",
                load.model, topology, d.height, d.width,
                f"auto (up to {limits.max_batch_size})" if limits.auto_batch else load.engine.batch_size,
                request.model_shards)
    cache = load.engine.compilation_cache_dir
    if cache:  # the workers' shared cache: what the launch compiles for their chips is there when they start
        from model import enable_compilation_cache

        enable_compilation_cache(cache)
        logger.info("TPU preflight: compiled programs go to the job's compilation cache %s", cache)
    try:
        report = preflight(request)
    except UsageError as e:
        raise UsageError(f"TPU preflight for {topology}: {e} (--skip_preflight launches without it)") from None
    logger.info("TPU preflight:\n%s", format_report(report))
    if not report.fits:
        advice = "; ".join(report.advice)
        raise UsageError(f"TPU preflight for {topology}: {shortfall_message(report)}"
                         f"{'; would fit: ' + advice if advice else ''}. The job was not submitted "
                         f"(--skip_preflight launches it anyway)")
    return report


def local_tpu_topology(job, *, tpu_attached: bool) -> str | None:
    """The topology of the TPU chips a local run's worker will use, or None (no TPU device here, or JAX kept off
    it by JAX_PLATFORMS): named by the TPU runtime's accelerator type (--worker_env's TPU_ACCELERATOR_TYPE, else
    the environment's), else by the chips on the PCI bus, else by asking JAX in a child process
    (`probe_local_devices`)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if not tpu_attached or (platforms and "tpu" not in platforms.split(",")):
        return None
    env = dict(job.spec.reliability.worker_env)
    accelerator = env.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_ACCELERATOR_TYPE")
    return attached_topology(accelerator) or attached_topology() or probe_local_devices(env)


# JAX's device kinds -> libtpu's chip names in topology names; devices of one host -> its grid.
_DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v6 lite": "v6e"}
_LOCAL_GRIDS = {1: "1x1", 4: "2x2", 8: "2x4"}
_PROBE = "import jax; d = jax.devices('tpu'); print(d[0].device_kind, len(d), sep=';')"


def probe_local_devices(worker_env: dict, timeout_s: float = 180) -> str | None:
    """This machine's TPU topology as JAX finds it, in a child process (with the worker's environment) that opens
    the chips and ends, so this process never holds them; None when it finds no v5e or v6e chips."""
    env = {**os.environ, **worker_env, "JAX_PLATFORMS": "tpu"}
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    kind, _, count = (out.stdout.strip().splitlines() or [""])[-1].partition(";")
    if out.returncode or kind not in _DEVICE_KINDS or not count.isdigit() or int(count) not in _LOCAL_GRIDS:
        logger.info("no TPU topology found by JAX here (%s)", (out.stderr.strip().splitlines() or ["-"])[-1])
        return None
    return f"{_DEVICE_KINDS[kind]}:{_LOCAL_GRIDS[int(count)]}"


def pick_local_batch(job, topology: str) -> dict:
    """--batch_size auto on this machine's TPU: the preflight (`python -m pipeline.preflight`) searches the largest
    batch up to --max_batch_size that fits `topology` at the job's defaults, in a child process kept to the CPU
    (JAX_PLATFORMS=cpu: it compiles with libtpu but never opens the chips, and this process, the local worker, does
    not load libtpu before its own runtime starts). Should libtpu refuse to compile for that topology here, the child
    compiles on the chips themselves instead (`--topology=attached`, with the worker's environment; it releases them
    when it ends). Returns the preflight's JSON report; UsageError when nothing fits or the preflight cannot run."""
    d, limits, load = job.defaults, job.spec.limits, job.load
    args = {"model": load.model, "height": d.height, "width": d.width, "batch_size": "auto",
            "max_batch_size": limits.max_batch_size, "dtype": load.dtype, "quantize": load.engine.quantize,
            "model_shards": load.engine.model_shards,
            "max_sequence_length": load.max_sequence_length, "num_inference_steps": d.num_inference_steps,
            "guidance_scale": d.guidance_scale, "hbm_bytes": hbm_bytes_override()}
    logger.info("TPU preflight: picking the batch for this machine's %s (--batch_size auto; --skip_preflight "
                "skips)", topology)
    report, why = _child_preflight({**args, "topology": topology}, {"JAX_PLATFORMS": "cpu"})
    if report is None:
        # The usual case on a TPU machine itself: its libtpu compiles for its own chips' layout only.
        logger.info("TPU preflight for %s here: %s; compiling on this machine's chips instead", topology, why)
        on_chips = {**dict(job.spec.reliability.worker_env), "JAX_PLATFORMS": "tpu"}
        report, why = _child_preflight({**args, "topology": ATTACHED}, on_chips)
    if report is None:
        raise UsageError(f"TPU preflight for this machine's {topology}: {why} (--skip_preflight, or a --batch_size, "
                         f"runs without it)")
    if not report["fits"]:
        advice = "; ".join(report.get("advice") or [])
        raise UsageError(f"TPU preflight for this machine's {topology}: {why}"
                         f"{'; would fit: ' + advice if advice else ''}")
    return report


def _child_preflight(args: dict, env: dict) -> tuple[dict | None, str]:
    """(the JSON report, its error line) of `python -m pipeline.preflight` with `args` in a child process with `env`
    added to this one's environment; (None, why) when it gave no report."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where this `pipeline` package is
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-m", "pipeline.preflight",
                          *(f"--{k}={v}" for k, v in args.items() if v is not None)],
                         env=env, capture_output=True, text=True)
    errors = [line.removeprefix("error: ") for line in out.stderr.strip().splitlines() if line.startswith("error: ")]
    reports = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not reports:
        return None, (errors or out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
    logger.info("TPU preflight:\n%s", out.stdout[:out.stdout.rfind(reports[-1])].rstrip())
    return json.loads(reports[-1]), (errors or ["does not fit"])[-1]
