"""The TPU preflight at launch: a Dataflow job for TPU workers is compiled for the workers' topology before it is
submitted, so a job whose programs cannot fit the chips' HBM never starts (and bills) its workers.

The topology comes from the job's `worker_accelerator` service option (as the settings files and `templates/run.sh`
pass it: `--dataflow_service_options` or, through a Flex Template, `--experiments`), else from a TPU machine type.
The check compiles at the job's default size, batch, steps, dtype and `--model_shards` (records that ask for more
pixels are not covered); `--skip_preflight` skips it. With `--batch_size auto` (the default) it picks the batch: the
fastest per image up to `--max_batch_size` whose programs fit (model.fit's search), which the job then runs at.

Its answer is kept beside the job's compilation cache (`--compilation_cache_dir`, by default under
`--temp_location`; pipeline/preflight_store.py): a launch whose key is stored compiles nothing for the check. Else
`python -m pipeline.preflight` compiles in a child process (its progress lines shown as they come; Ctrl-C kills it),
writing the programs to that cache, where a worker whose JAX, libtpu and chips match finds them instead of
compiling, and the answer is stored.

A local run checks nothing, except that with `--batch_size auto` on a machine with a TPU attached the batch is picked
the same way, for the chips found here (`local_tpu_topology`), by the preflight in a child process that compiles on
those chips and releases them (`pick_local_batch`), leaving the job's programs in its compilation cache. GPU and CPU workers are never checked; auto is then DEFAULT_BATCH_SIZE.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from model import (ATTACHED, TPU_DATAFLOW_CHIPS, TPU_DEVICE_KINDS, attached_topology, tpu_host_topology,
                   tpu_machine_topology)

from .errors import UsageError

logger = logging.getLogger("pipeline.launch_check")

# Bytes of HBM per chip to check against instead of the chip's own (leave room for something else on the chip;
# the tests use it to make a tiny model not fit).
HBM_BYTES_ENV = "FLUX2_PREFLIGHT_HBM_BYTES"
# Dataflow's TPU accelerator types -> libtpu's chip names in topology names ("v5e:2x2"): the TPU catalogue's.
TPU_CHIP_NAMES = TPU_DATAFLOW_CHIPS


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
    return tpu_machine_topology(machine_type)  # a job that names the machine but no accelerator option


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


def job_request(job, topology: str):
    """The preflight request of `job` at its defaults for `topology` (pipeline.preflight.PreflightRequest)."""
    from .preflight import PreflightRequest

    d, limits, load = job.defaults, job.spec.limits, job.load
    return PreflightRequest(model=load.model, topology=topology, height=d.height, width=d.width,
                            batch_size=None if limits.auto_batch else load.engine.batch_size, dtype=load.dtype,
                            num_inference_steps=d.num_inference_steps, guidance_scale=d.guidance_scale,
                            model_shards=load.engine.model_shards, max_sequence_length=load.max_sequence_length,
                            hbm_bytes=hbm_bytes_override(), max_batch_size=limits.max_batch_size,
                            quantize=load.engine.quantize, reserved_bytes=_scorer_bytes(job))


def stored_answer(job, topology: str):
    """(the store, the key's fields, the answer stored for `job` on `topology` or None); (None, None, None) when the
    job has no compilation cache to keep answers beside (pipeline/preflight_store.py)."""
    cache = job.load.engine.compilation_cache_dir
    if not cache:
        return None, None, None
    from .preflight import resolve_model
    from .preflight_store import AnswerStore, answer_fields

    store = AnswerStore(cache)
    fields = answer_fields(resolve_model(job.load.model), job_request(job, topology))
    return store, fields, store.load(fields)


def _sourced(answer: dict, store, fields, compiled: bool) -> dict:
    """The preflight's answer with "answer_source": "compiled" (and kept in the store, where there is one) for one
    just compiled, else the stored entry's path."""
    if not compiled:
        return {**answer, "answer_source": store.path_for(fields)}
    if store is not None:
        store.save(fields, answer)
    return {**answer, "answer_source": "compiled"}


def check_fits(job, topology: str) -> dict:
    """The preflight's answer for `job`'s programs on `topology` at its defaults (with --batch_size auto, the fastest
    batch per image up to --max_batch_size that fits): the stored one when the job's compilation cache holds it for
    the same key, else compiled in a child process (`python -m pipeline.preflight`, its progress shown, its programs
    written to the job's compilation cache for the workers) and stored. UsageError naming the shortfall and what
    would fit (a smaller batch first) when they do not fit. The answer's "answer_source" says where it came from."""
    store, fields, answer = stored_answer(job, topology)
    compiled = answer is None
    if compiled:
        request = job_request(job, topology)
        logger.info("TPU preflight: compiling %s for %s at %dx%d, batch %s, %s model shard(s) (--skip_preflight "
                    "skips)", request.model, topology, request.height, request.width,
                    f"auto (up to {request.max_batch_size})" if request.batch_size is None else request.batch_size,
                    request.model_shards or "auto")
        cache = job.load.engine.compilation_cache_dir
        if cache:
            logger.info("TPU preflight: compiled programs go to the job's compilation cache %s", cache)
        say_compiling(topology, cache, request.batch_size is None)
        answer, why = _child_preflight(preflight_args(request, cache), {})
        if answer is None:
            raise UsageError(f"TPU preflight for {topology}: {why} (--skip_preflight launches without it)")
    answer = _sourced(answer, store, fields, compiled)
    if not answer["fits"]:
        advice = "; ".join(answer.get("advice") or [])
        raise UsageError(f"TPU preflight for {topology}: {answer.get('shortfall') or 'does not fit'}"
                         f"{'; would fit: ' + advice if advice else ''}. The job was not submitted "
                         f"(--skip_preflight launches it anyway)")
    return answer


def say_compiling(topology: str, cache: str | None, auto: bool) -> None:
    """The launch's line before it compiles: for what, and why (no stored answer)."""
    where = f"no stored answer in {cache}" if cache else "no compilation cache to keep its answer"
    print(f"TPU preflight: compiling the job for {topology}{' to pick its batch' if auto else ''} ({where}; "
          f"minutes for a real-size model, its progress below)", flush=True)


def preflight_args(request, cache: str | None) -> dict:
    """`python -m pipeline.preflight`'s arguments for `request`, writing to the compilation cache `cache`."""
    return {"model": request.model, "topology": request.topology, "height": request.height,
            "width": request.width,
            "batch_size": "auto" if request.batch_size is None else request.batch_size,
            "max_batch_size": request.max_batch_size, "dtype": request.dtype, "quantize": request.quantize,
            "model_shards": request.model_shards, "max_sequence_length": request.max_sequence_length,
            "num_inference_steps": request.num_inference_steps, "guidance_scale": request.guidance_scale,
            "hbm_bytes": request.hbm_bytes, "reserved_bytes": request.reserved_bytes or None,
            "compilation_cache_dir": cache}


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
    topology = (tpu_host_topology(TPU_DEVICE_KINDS[kind], int(count))
                if not out.returncode and kind in TPU_DEVICE_KINDS and count.isdigit() else None)
    if topology is None:
        logger.info("no TPU topology found by JAX here (%s)", (out.stderr.strip().splitlines() or ["-"])[-1])
    return topology


def pick_local_batch(job, topology: str) -> dict:
    """--batch_size auto on this machine's TPU: the preflight's answer for the job on `topology` at its defaults,
    the stored one when the job's compilation cache holds it for the same key, else found by `python -m
    pipeline.preflight` in a child process and stored. The child compiles on this machine's chips themselves
    (`--topology=attached`, with the worker's environment; it releases them when it ends, before this process, the
    local worker, starts its own runtime): the programs it writes to the job's compilation cache are then compiled
    for the very devices, client and options the job compiles for, which JAX's cache keys name, so the job's first
    compile of them is a cache hit. Only where JAX cannot open the chips here (held by another process, say) does a
    second child compile for `topology` without them (JAX_PLATFORMS=cpu, libtpu's compiler). Returns the preflight's
    JSON answer ("answer_source": where it came from); UsageError when nothing fits or the preflight cannot run."""
    store, fields, report = stored_answer(job, topology)
    why = "does not fit"
    compiled = report is None
    if compiled:
        request = job_request(job, topology)
        args = preflight_args(request, job.load.engine.compilation_cache_dir)
        logger.info("TPU preflight: picking the batch for this machine's %s (--batch_size auto; --skip_preflight "
                    "skips)", topology)
        say_compiling(topology, job.load.engine.compilation_cache_dir, request.batch_size is None)
        on_chips = {**dict(job.spec.reliability.worker_env), "JAX_PLATFORMS": "tpu"}
        report, why = _child_preflight({**args, "topology": ATTACHED}, on_chips)
        if report is None:
            logger.info("TPU preflight on this machine's chips: %s; compiling for %s without them instead", why,
                        topology)
            report, why = _child_preflight(args, {"JAX_PLATFORMS": "cpu"})
        if report is None:
            raise UsageError(f"TPU preflight for this machine's {topology}: {why} (--skip_preflight, or a "
                             f"--batch_size, runs without it)")
    report = _sourced(report, store, fields, compiled)
    if not report["fits"]:
        advice = "; ".join(report.get("advice") or [])
        raise UsageError(f"TPU preflight for this machine's {topology}: {report.get('shortfall') or why}"
                         f"{'; would fit: ' + advice if advice else ''}")
    return report


def _child_preflight(args: dict, env: dict) -> tuple[dict | None, str]:
    """(the JSON report, its error line) of `python -m pipeline.preflight` with `args` in a child process with `env`
    added to this one's environment; (None, why) when it gave no report. The child's progress lines are shown as
    they come; Ctrl-C (or any exception here) kills the child and waits for it before it goes on up, so nothing of
    it is left running (and it stores nothing: its answer is stored only once it has one)."""
    import threading

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where this `pipeline` package is
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    child = subprocess.Popen([sys.executable, "-m", "pipeline.preflight",
                              *(f"--{k}={v}" for k, v in args.items() if v is not None)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)  # its own group: this process alone decides when it ends
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.append(child.stdout.read()), daemon=True)
    reader.start()
    stderr = []
    try:
        for line in child.stderr:
            stderr.append(line)
            shown = progress_line(line)
            if shown:
                print(f"TPU preflight: {shown}", flush=True)
        child.wait()
        reader.join()
    except BaseException:
        child.kill()
        child.wait()
        raise
    out, err = "".join(stdout), "".join(stderr)
    errors = [line.removeprefix("error: ") for line in err.strip().splitlines() if line.startswith("error: ")]
    reports = [line for line in out.splitlines() if line.startswith("{")]
    if not reports:
        return None, (errors or err.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
    logger.info("TPU preflight:\n%s", out[:out.rfind(reports[-1])].rstrip())
    return json.loads(reports[-1]), (errors or ["does not fit"])[-1]


_PROGRESS_LOGGERS = ("INFO model.preflight.aot: ", "INFO pipeline.preflight: ")


def progress_line(line: str) -> str | None:
    """The message of a child preflight's progress line (its compiling, logged at INFO), else None."""
    for prefix in _PROGRESS_LOGGERS:
        if line.startswith(prefix):
            return line[len(prefix):].rstrip()
    return None
