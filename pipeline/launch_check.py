"""The TPU preflight at launch: a Dataflow job for TPU workers is compiled for the workers' topology before it is
submitted, so a job whose programs cannot fit the chips' HBM never starts (and bills) its workers.

The topology comes from the job's `worker_accelerator` service option (as the settings files and `templates/run.sh`
pass it: `--dataflow_service_options` or, through a Flex Template, `--experiments`), else from a TPU machine type.
The programs it compiles are written to the job's shared compilation cache (`--compilation_cache_dir`, by default
under `--temp_location`): a worker whose JAX, libtpu and chips match the launcher's loads them instead of compiling.
The check compiles at the job's default size, batch, steps, dtype and `--model_shards` (records that ask for more
pixels are not covered); `--skip_preflight` skips it. Local runners and GPU or CPU workers are never checked.
"""

from __future__ import annotations

import logging
import os
import re

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


def check_fits(job, topology: str):
    """Compile `job`'s programs for `topology` at its defaults; UsageError naming the shortfall and what would
    fit when they do not. Returns the preflight's report."""
    from .preflight import PreflightRequest, format_report, preflight, shortfall_message

    d = job.defaults
    request = PreflightRequest(model=job.model, topology=topology, height=d.height, width=d.width,
                               batch_size=job.batch_size, dtype=job.dtype, num_inference_steps=d.num_inference_steps,
                               guidance_scale=d.guidance_scale, model_shards=job.load.engine.model_shards,
                               max_sequence_length=job.max_sequence_length, hbm_bytes=hbm_bytes_override())
    logger.info("TPU preflight: compiling %s for %s at %dx%d, batch %d, %d model shard(s) (--skip_preflight skips)",
                job.model, topology, d.height, d.width, job.batch_size, request.model_shards)
    cache = job.load.engine.compilation_cache_dir
    if cache:  # the workers' shared cache: what the launch compiles for their chips is there when they start
        from model.api import enable_compilation_cache

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
