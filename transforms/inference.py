"""The RunInference ModelHandler around `model.load(...).generate(...)`, and shape-bucketed batching.

Batches never mix shapes: image tasks are keyed by (height, width, steps, guidance, and for image-conditioned
requests each reference's processed size: one batch shares its reference token counts) and grouped into batches of at
most `--batch_size` per key (GroupIntoBatches), then spread over workers. The handler is used `with_no_batching()`:
each element it receives is one such pre-built batch, and it makes one `generate` call for it. A short batch is
padded to the compiled batch size inside `generate`, so it is not recompiled.

Loading: `load_model` imports `model` lazily (pickling the handler never pulls in JAX), resolves the checkpoint
(a `gs://` one is copied once per machine to a local cache by `model.loading.checkpoint`) and compiles it once per
worker process, or once per machine with `large_model=True` / `model_copies=N` (Beam then serves the model from one
process to the others; results cross the process boundary as numpy).

Timeout: each generate call runs in a watchdog thread and is waited for at most `--inference_timeout_s`, counted from
when the call gets the model (loading in `setup` and waiting behind other batches of the process do not count; the
first batch of a shape compiles within it). A hung device call cannot be cancelled: the batch becomes
`inference_timeout` error rows, and the model is held by the stuck call, so this process's later batches on that
model fail fast the same way (the job goes on and ends; a `--skip_existing` rerun generates them) until the call
returns, when the model is used again.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import typing
import time
from typing import Any, Iterable, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from . import references
from .metrics import NAMESPACE as METRICS_NAMESPACE
from .requests import ImageTask
from .defaults import DEFAULT_INFERENCE_RETRIES, DEFAULT_INFERENCE_TIMEOUT_S

LOGGER = logging.getLogger(__name__)
_WAIT_POLL_S = 0.5  # how often a batch waiting for a model held by a stuck call checks on it
# Running out of memory is told by the error's type (MemoryError) or by XLA's status code, which leads the message of
# its runtime errors ("RESOURCE_EXHAUSTED: Out of memory allocating ..."); never by a word anywhere in the text, where a
# prompt or path ("BLOOM", "bathroom") could put it. Text forms: "Type: message" and "Type('message')".
_OUT_OF_MEMORY_TEXT = re.compile(r"^(?:[\w.]+(?:: |\(['\"]))?RESOURCE_EXHAUSTED\b|^(?:[\w.]+\.)?MemoryError\b")


def is_out_of_memory(error: BaseException | str) -> bool:
    """Whether a failed generate call (the exception, or its text as a dead-letter row carries it) ran out of host
    or accelerator memory, by type or status code: the same batch would need the same memory again."""
    if isinstance(error, MemoryError):
        return True
    text = error if isinstance(error, str) else str(error)
    return bool(_OUT_OF_MEMORY_TEXT.match(text.strip()))


class InferenceTimeout(TimeoutError):
    """A batch whose generate call ran past --inference_timeout_s, or that could not run because an earlier call on
    the same model is still stuck. Never retried in the job: the device is held by the call that does not return."""


def is_retriable(error: BaseException) -> bool:
    """Whether a failed generate call is worth running again: not for bad input (ValueError/TypeError), memory
    exhaustion (the same batch needs the same memory) or a timeout (the device is still busy with the stuck call);
    yes for everything else (a lost device, a runtime fault)."""
    return not (isinstance(error, (ValueError, TypeError, InferenceTimeout)) or is_out_of_memory(error))


class _ModelGate:
    """One model's turn-taking in this process, and the call stuck on it, if any: a call that ran past the timeout
    keeps the gate until it returns, so that no other batch is queued behind a device that does not answer."""

    def __init__(self):
        self.lock = threading.Lock()  # held by the running call; released by its thread when the call returns
        self.stuck: tuple[threading.Thread, float, str] | None = None  # (thread, monotonic start, first id)

    def check(self, n_images: int) -> None:
        """InferenceTimeout while a timed-out call on this model has not returned; forget it once it has."""
        stuck = self.stuck
        if stuck is None:
            return
        thread, started, first_id = stuck
        if thread.is_alive():
            raise InferenceTimeout(
                f"not run: a batch of this worker process (first id {first_id!r}) timed out "
                f"{time.monotonic() - started:.0f} s ago and its generate call has not returned, so the model is "
                f"unusable until it does; these {n_images} image(s) were not generated (rerun with --skip_existing)")
        self.stuck = None
        LOGGER.warning("the generate call that timed out (first id %s) returned after %.0f s: the model is used "
                       "again", first_id, time.monotonic() - started)


_gates: dict[int, _ModelGate] = {}
_gates_lock = threading.Lock()


def _gate_for(model: Any) -> _ModelGate:
    """The gate of `model` (a loaded model or Beam's proxy to a shared one), by identity: one per model object."""
    with _gates_lock:
        return _gates.setdefault(id(model), _ModelGate())


def call_with_timeout(model: Any, call, timeout_s: float, n_images: int, first_id: str):
    """`call()` (one generate call on `model`) in a watchdog thread, waited for at most `timeout_s` seconds from
    when the model is free (0: no limit, called in this thread). InferenceTimeout when it runs longer: the call
    goes on in its thread, holding the model, and later calls on the model raise InferenceTimeout at once until
    it returns. The call's own exception is raised unchanged."""
    if not timeout_s:
        return call()
    gate = _gate_for(model)
    gate.check(n_images)
    while not gate.lock.acquire(timeout=_WAIT_POLL_S):
        gate.check(n_images)
    box: dict = {}

    def run():
        try:
            box["out"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which raises it
            box["error"] = e
        finally:
            gate.lock.release()

    thread = threading.Thread(target=run, name=f"flux2-generate-{first_id}"[:64], daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        gate.stuck = (thread, started, first_id)
        Metrics.counter(METRICS_NAMESPACE, "inference_timeouts").inc()
        LOGGER.error("generate for a batch of %d image(s) (first id %s) ran past --inference_timeout_s=%s; its "
                     "images become error rows and this process's later batches on the model fail until the call "
                     "returns", n_images, first_id, timeout_s)
        raise InferenceTimeout(f"timed out: generate for a batch of {n_images} image(s) ran past "
                               f"--inference_timeout_s={timeout_s:g} s (the first batch of a shape compiles within "
                               f"it; raise the limit if that is what takes the time)")
    if "error" in box:
        raise box["error"]
    return box["out"]

# Why JAX on a worker may find no accelerator of the kind the job asked for (shown in AcceleratorError).
_LIKELY_CAUSES = {
    "tpu": "libtpu missing from the image (build the tpu variant, jax[tpu]); the VM has no TPU (check the "
           "worker_accelerator service option and the machine type); the TPU_* runtime variables of --worker_env do "
           "not match the host (TPU_ACCELERATOR_TYPE, TPU_CHIPS_PER_HOST_BOUNDS); or another process holds "
           "/dev/vfio (run one SDK process per VM)",
    "gpu": "no NVIDIA driver on the VM (install-nvidia-driver missing from the worker_accelerator service option); "
           "a driver older than the image's CUDA wheels need (cuda12: 525.60.13 or newer, cuda13: 580 or newer); or "
           "an image built without jax[cuda12]",
}


class AcceleratorError(RuntimeError):
    """JAX on this worker found another platform than --require_accelerator names. Raised at model load, so that a
    job meant for TPU/GPU stops with the cause instead of generating at CPU speed for hours."""

    def __init__(self, expected: str, found: str, devices: str, reason: str):
        self.expected = expected
        self.found = found
        self.devices = devices
        self.reason = reason
        super().__init__(f"--require_accelerator={expected}, but JAX on this worker uses {found!r} ({devices}); "
                         f"JAX says: {reason}. Likely causes: {_LIKELY_CAUSES.get(expected, 'unknown platform')}")


def describe_devices(devices: Sequence[Any]) -> str:
    """'4 x TPU v5 lite (tpu, 15.8 GiB each)': the chips a model load will use, for the worker log."""
    if not devices:
        return "no devices"
    first = devices[0]
    try:
        limit = (first.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - some backends have no memory statistics
        limit = None
    memory = f", {limit / 2**30:.1f} GiB each" if limit else ""
    return f"{len(devices)} x {first.device_kind} ({first.platform}{memory})"


def check_accelerator(required: str | None) -> str:
    """Log the local devices JAX found and return their description; AcceleratorError when `required` ('tpu' or
    'gpu') is not JAX's platform here. Call it before the model loads: it is what the model's mesh will use."""
    import jax

    found = jax.default_backend()
    devices = describe_devices(jax.local_devices())
    LOGGER.info("model load on %s (JAX backend %s)", devices, found)
    if required is None or found == required:
        return devices
    try:  # the missing backend's own error names the cause (libtpu not found, no CUDA driver, ...)
        jax.local_devices(backend=required)
        reason = f"the {required} backend exists but is not JAX's default"
    except RuntimeError as e:
        reason = str(e)
    raise AcceleratorError(required, found, devices, reason)


# Loads are counted in a Beam counter, but a model is loaded in DoFn.setup (or in whichever process serves a shared
# model), where Beam has no metrics context; so loads are noted here and reported from the next bundle of the
# same process (run_inference, or the fused image writer's finish_bundle). Besides `model_loads`, each process counts
# once in `processes_with_model` (it loaded the model) and in `generating_processes` (it ran a batch): names that
# are the same in every job, unlike per-process ones. model_loads == processes_with_model: each loaded it once;
# more generating processes than processes with the model: they share a copy (--large_model).
_pending_loads = 0
_loads_here = 0  # every load of this process, reported or not
_counted = {"processes_with_model": False, "generating_processes": False}  # this process, in this job's counters
_pending_lock = threading.Lock()


def _note_model_load() -> None:
    global _pending_loads, _loads_here
    with _pending_lock:
        _pending_loads += 1
        _loads_here += 1


def model_loads_in_this_process() -> int:
    """How many times this process has loaded the model (since it started, whatever was reported)."""
    with _pending_lock:
        return _loads_here


def discard_pending_model_loads() -> int:
    """Forget loads noted in this process and not yet reported (returns how many): a job calls it as it starts, so
    its `model_loads` counts its own loads, not one an earlier job or caller in the same process left unreported;
    and this process counts anew in the job's `processes_with_model` and `generating_processes`."""
    global _pending_loads
    with _pending_lock:
        n, _pending_loads = _pending_loads, 0
        _counted.update(dict.fromkeys(_counted, False))
    return n


def _count_this_process(name: str) -> None:
    """Add this process to the counter `name` once per job."""
    with _pending_lock:
        first, _counted[name] = not _counted[name], True
    if first:
        Metrics.counter(METRICS_NAMESPACE, name).inc()


def flush_model_load_metrics() -> None:
    """Report loads noted in this process into the `model_loads` counter, and this process into
    `processes_with_model` (call from inside a bundle)."""
    global _pending_loads
    with _pending_lock:
        n, _pending_loads = _pending_loads, 0
    if n:
        Metrics.counter(METRICS_NAMESPACE, "model_loads").inc(n)
        _count_this_process("processes_with_model")


_reported_compiles = {"compiles": 0, "cache_hits": 0, "lease_waits": 0}


def flush_compile_metrics() -> None:
    """Report this process's XLA compilations and persistent-cache hits since the last report (`xla_compiles`,
    `xla_cache_hits`): a job whose programs all come from the compilation cache shows no compiles. `xla_lease_waits`:
    the programs it waited for another worker to compile (model/engine/compile_lease.py)."""
    from model import compile_counts

    now = compile_counts()
    with _pending_lock:
        delta = {k: now[k] - _reported_compiles[k] for k in _reported_compiles}
        _reported_compiles.update({k: now[k] for k in _reported_compiles})
    for key, n in delta.items():
        if n:
            Metrics.counter(METRICS_NAMESPACE, f"xla_{key}").inc(n)


@dataclasses.dataclass(frozen=True)
class GeneratedImage:
    """One image of a generate call (its slice of the model's GenerationResult) with its task: what every sink
    receives. Host pixels plus the parameters that were actually used; what the image is made by is the sink's
    to record (transforms/identity.py)."""

    task: ImageTask
    pixels: np.ndarray  # uint8 [H, W, 3]
    num_inference_steps: int
    guidance_scale: float
    prompt_truncated: bool
    model: str
    generation_ms: float  # this image's share of its batch's generate() wall time
    nonfinite: str | None = None  # why its values are not an image (NaN or inf: stage and share), else None
    scores: dict | None = None  # {score name: value} with --score_model (model.config.score_settings), else None
    filtered: dict | None = None  # the score filter it breaks (transforms/score_filters.py), else None

    @property
    def phash(self) -> str:
        """Its pixels' perceptual hash (transforms/phash.py): an output of this image, like its pixels, never part
        of its identity (transforms/identity.py); the sink records it in the image's row."""
        from .phash import phash_pixels

        return phash_pixels(self.pixels)


class LoadedGenerator:
    """What `load_model` returns: the generator behind one method, so that a model shared across processes (served
    through a Beam proxy, which forwards method calls only) costs one round trip per batch and returns the model's
    own GenerationResult, pickled as it is (numpy images, NonFinite records). The generator serialises its own
    calls (Beam runs bundles on several threads of a process)."""

    def __init__(self, generator: Any):
        self._gen = generator

    def generate_batch(self, prompts: list[str], seeds: list[int], height: int, width: int,
                       num_inference_steps: int | None, guidance_scale: float | None,
                       reference_images: list[list] | None = None, batch_size: int | None = None,
                       lora: str | None = None):
        """One image per prompt; None steps/guidance take the checkpoint's defaults (generate resolves them).
        `reference_images`: one list of references (PIL images) per prompt, or None for text-to-image.
        `batch_size`: the programs' batch for this call (None: the engine's; see generate_result). `lora`: the
        unmerged adapter every image uses (None: none). Returns the generator's GenerationResult, its images as a
        numpy array."""
        extra = {} if reference_images is None else {"reference_images": reference_images}
        if lora:
            extra["lora"] = lora
        out = self._gen.generate_result(prompts=list(prompts), seeds=list(seeds), height=height, width=width,
                                        num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                                        batch_size=batch_size, **extra)
        return out if isinstance(out.images, np.ndarray) else dataclasses.replace(out, images=np.asarray(out.images))


def split_result(tasks: list[ImageTask], out) -> list[PredictionResult]:
    """A generate call's GenerationResult (model.engine.generator) -> one PredictionResult per task, whose
    `inference` is the task's GeneratedImage; counts the prompts that were truncated."""
    images = np.asarray(out.images)
    if images.shape[0] != len(tasks):
        raise RuntimeError(f"generate returned {images.shape[0]} images for {len(tasks)} prompts")
    per_image_ms = out.seconds * 1000.0 / len(tasks)
    truncated = sum(1 for t, flag in zip(tasks, out.prompt_truncated) if flag and t.index == 0)
    if truncated:
        Metrics.counter(METRICS_NAMESPACE, "prompts_truncated").inc(truncated)
    nonfinite = tuple(out.nonfinite) or (None,) * len(tasks)
    scores = tuple(getattr(out, "scores", ())) or (None,) * len(tasks)  # with --score_model: {name: value} each
    return [PredictionResult(task, GeneratedImage(
        task=task, pixels=images[i], num_inference_steps=out.num_inference_steps, guidance_scale=out.guidance_scale,
        prompt_truncated=bool(out.prompt_truncated[i]), model=str(out.model), generation_ms=per_image_ms,
        nonfinite=None if nonfinite[i] is None else nonfinite[i].describe(), scores=scores[i]), model_id=str(out.model))
        for i, task in enumerate(tasks)]


class Flux2KleinModelHandler(ModelHandler[Sequence[ImageTask], PredictionResult, LoadedGenerator]):
    """RunInference handler: one element = one batch of same-shape ImageTasks -> one PredictionResult per task
    whose `inference` is a GeneratedImage. Use it as `RunInference(handler.with_no_batching())`."""

    def __init__(self, settings, *, large_model: bool = False, model_copies: int | None = None,
                 env_vars: dict | None = None, inference_retries: int = DEFAULT_INFERENCE_RETRIES,
                 retry_backoff_s: float = 1.0, load_kwargs: dict | None = None,
                 require_accelerator: str | None = None,
                 reference_limits: references.ReferenceLimits | None = None,
                 inference_timeout_s: float = DEFAULT_INFERENCE_TIMEOUT_S, **load_args):
        """`settings` is the `model.options.LoadSettings` that `model.load` receives unchanged, or a checkpoint path
        with `model.load`'s keyword arguments (`dtype=`, `batch_size=`, ...; `load_kwargs` adds more of them). A
        failed batch is run again up to `inference_retries` times (backoff `retry_backoff_s`, doubling) unless the
        failure is deterministic (see `is_retriable`). `env_vars` are set before the model loads (Beam's
        RunInference does it in setup); `require_accelerator` ('tpu' or 'gpu') makes the load fail on another
        platform (see `check_accelerator`). `reference_limits` bound the reference images read for a batch (read
        through the process's cache: usually already there from ResolveReferences). A generate call running past
        `inference_timeout_s` seconds (0: no limit) fails its batch with InferenceTimeout (see `call_with_timeout`)."""
        super().__init__(large_model=large_model, model_copies=model_copies, env_vars=env_vars or {})
        if require_accelerator not in (None, *_LIKELY_CAUSES):
            raise ValueError(f"require_accelerator must be one of {sorted(_LIKELY_CAUSES)} or None, got "
                             f"{require_accelerator!r}")
        self._require_accelerator = require_accelerator
        self._reference_limits = reference_limits or references.ReferenceLimits()
        from model import LoadSettings  # JAX-free

        if not isinstance(settings, LoadSettings):
            settings = LoadSettings.create(settings, **load_args, **(load_kwargs or {}))
        elif load_args or load_kwargs:
            raise TypeError("give either LoadSettings or a path with load arguments, not both")
        if inference_retries < 0:
            raise ValueError(f"inference_retries must be >= 0, got {inference_retries}")
        self._inference_retries = int(inference_retries)
        self._retry_backoff_s = float(retry_backoff_s)
        if not inference_timeout_s >= 0:
            raise ValueError(f"inference_timeout_s must be >= 0 (0: no limit), got {inference_timeout_s!r}")
        self._inference_timeout_s = inference_timeout_s
        # shape key -> the compiled batch its batches run with here, below the smallest that ran out of memory
        self._fits: dict[str, int] = {}
        self._fits_lock = threading.Lock()
        self.settings = settings

    def load_model(self) -> LoadedGenerator:
        import model  # lazy: JAX and the model code load only on workers, when the model is needed

        model.apply_runtime_defaults()  # before anything here starts the runtime; --worker_env's settings are kept
        if self._require_accelerator:
            # Before the checkpoint is copied or read: a worker without its accelerator stops here, with the cause.
            check_accelerator(self._require_accelerator)
        model.compile_counts()  # start counting compilations before the first one
        gen = model.load(self.settings)  # starts the runtime itself, beside reading the checkpoint's headers
        if not self._require_accelerator:
            check_accelerator(None)  # logs the devices the model uses
        _note_model_load()
        return LoadedGenerator(gen)

    def run_inference(self, batch: Sequence[ImageTask], model: LoadedGenerator,
                      inference_args: dict | None = None) -> Iterable[PredictionResult]:
        """One generate call for the batch, run again on a transient failure; a batch that runs out of memory runs
        again in two halves, down to single images. What still fails raises (and RunInference's exception handling
        turns it into one error row per image of the batch)."""
        flush_model_load_metrics()
        flush_compile_metrics()
        tasks = list(batch)
        if not tasks:
            return []
        keys = {t.shape_key for t in tasks}
        if len(keys) != 1:
            raise ValueError(f"a batch mixes shapes {sorted(keys)}; batches must be grouped by shape first")
        Metrics.counter(METRICS_NAMESPACE, "batches").inc()
        _count_this_process("generating_processes")
        Metrics.distribution(METRICS_NAMESPACE, "batch_size").update(len(tasks))
        return self._run_in_parts_that_fit(tasks, model)

    def _run_in_parts_that_fit(self, tasks: list[ImageTask], model: LoadedGenerator) -> list[PredictionResult]:
        """The batch at once, or, once a batch of its shape ran out of memory here, in parts compiled for a smaller
        batch; a part that runs out of memory runs again compiled for half as many images, down to one (whose
        failure is raised). The default --batch_size of 4 does not fit one v5e chip with klein-4B at 1024x1024:
        without this, every image of such a job failed."""
        key = tasks[0].shape_key
        limit = self._fits.get(key)  # the compiled batch of this shape that may fit (None: the engine's own)
        if limit is not None and len(tasks) > limit:
            return [result for start in range(0, len(tasks), limit)
                    for result in self._run_in_parts_that_fit(tasks[start:start + limit], model)]
        try:
            return self._run_with_retries(tasks, model, limit)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is handled here; the rest propagates unchanged
            if not is_out_of_memory(e):
                raise
            # The programs that ran out of memory were compiled for `tried` images (a short batch is padded to it).
            tried = max(len(tasks), limit or self.settings.engine.batch_size or 0)
            if tried <= 1:
                raise
            smaller = (min(len(tasks), tried) + 1) // 2
            with self._fits_lock:
                self._fits[key] = min(self._fits.get(key, smaller), smaller)
            Metrics.counter(METRICS_NAMESPACE, "batches_split_for_memory").inc()
            LOGGER.warning("a batch of %d image(s) at %dx%d, compiled for %d, ran out of memory (%.200s); running "
                           "it, and later batches of this shape, compiled for at most %d (a smaller --batch_size "
                           "avoids the attempt)", len(tasks), tasks[0].request.height, tasks[0].request.width, tried,
                           e, self._fits[key])
            return self._run_in_parts_that_fit(tasks, model)

    def _run_with_retries(self, tasks: list[ImageTask], model: LoadedGenerator,
                          compiled_batch: int | None = None) -> list[PredictionResult]:
        """One generate call, run again on a transient failure (see `is_retriable`) up to --inference_retries."""
        attempt = 0
        while True:
            try:
                results = self.generate_once(tasks, model, compiled_batch)
                flush_compile_metrics()  # this batch's compiles (its bucket's first)
                return results
            except Exception as e:  # noqa: BLE001 - classified below; what is not retried propagates unchanged
                if attempt >= self._inference_retries or not is_retriable(e):
                    raise
                attempt += 1
                Metrics.counter(METRICS_NAMESPACE, "inference_retries").inc()
                delay = self._retry_backoff_s * 2 ** (attempt - 1)
                # The batch's ids, never its prompts: prompt text is not logged at INFO or above.
                LOGGER.warning("generate failed for a batch of %d image(s) (%s: %.200s); retry %d of %d in %.1f s; "
                               "first id %s", len(tasks), type(e).__name__, e, attempt, self._inference_retries,
                               delay, tasks[0].request.id)
                time.sleep(delay)

    def generate_once(self, tasks: list[ImageTask], model: LoadedGenerator,
                      compiled_batch: int | None = None) -> list[PredictionResult]:
        """One attempt: generate the batch (programs compiled for `compiled_batch` images; None: the engine's
        batch) and wrap each image in a PredictionResult."""
        first = tasks[0].request
        refs = None
        if first.reference_images:  # the same files the request was resolved with (checked by sha256)
            refs = [[r.image for r in references.read_all(t.request.reference_images, self._reference_limits,
                                                          t.request.reference_sha256)] for t in tasks]
        prompts, seeds = [t.request.prompt for t in tasks], [t.seed for t in tasks]
        extra = {} if compiled_batch is None else {"batch_size": compiled_batch}
        if first.lora:  # batches are grouped by adapter (ImageTask.shape_key)
            extra["lora"] = first.lora
        out = call_with_timeout(
            model, lambda: model.generate_batch(prompts, seeds, first.height, first.width, first.num_inference_steps,
                                                first.guidance_scale, refs, **extra),
            self._inference_timeout_s, len(tasks), first.id)
        return split_result(tasks, out)

    def get_num_bytes(self, batch: Sequence[ImageTask]) -> int:
        return sum(len(t.request.prompt.encode("utf-8")) for t in batch)

    def get_metrics_namespace(self) -> str:
        return "RunInference_flux2"

    def update_model_path(self, model_path: str | None = None):
        if model_path:
            self.settings = dataclasses.replace(self.settings, model=model_path)


class BatchByShape(beam.PTransform):
    """ImageTasks -> lists of at most `batch_size` tasks sharing (height, width, steps, guidance and the processed
    size of each reference image), spread over workers."""

    def __init__(self, batch_size: int):
        super().__init__()
        from model import count  # JAX-free

        self._batch_size = count("batch_size", batch_size)

    def expand(self, tasks):
        return (tasks
                | "KeyByShape" >> beam.Map(lambda t: (t.shape_key, t)).with_output_types(
                    beam.typehints.KV[str, typing.Any])
                | "GroupIntoBatches" >> beam.GroupIntoBatches(self._batch_size)
                | "DropKey" >> beam.Map(lambda kv: sorted(kv[1], key=lambda t: (t.request.id, t.index)))
                | "SpreadBatches" >> beam.Reshuffle())
