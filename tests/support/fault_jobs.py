"""Shared by the pipeline-level fault tests (tests/pipeline/test_fault_pipeline.py) and the soak (benchmarks/soak.py).

- `CachedHandler`: the job's real ModelHandler, except that a model loaded once in this process is reused by the
  next job run in it (key: checkpoint, dtype, text length, batch size). Fault tests run the job several times
  in-process; loading the tiny model costs ~15 s on a loaded 2-core machine, generating it costs milliseconds.
- `FaultyHandler`: the same, plus injected inference faults: chosen calls (or a fraction of batches) raise a
  transient error ("a bundle that fails"), and every batch of one shape bucket raises an out-of-memory-like error
  ("a bucket that never fits"). Its settings travel with the pickled handler, so they hold in every worker.
- `install_handler(monkeypatch, cls, **kw)`: makes `pipeline.graph.build_pipeline` use one of those handlers.
- `expected_png(loaded, task)`: the exact PNG bytes the job must write for an image task, computed from one
  `generate` call for that single image (so equal bytes also prove batch composition does not change pixels).
- `fast_gcs_retries(...)`: Beam's GCS retry policy (same predicate, so the same errors are retried) with short
  back-off and an optional deadline, for in-process runs.
- `JobOutputs`: read a job's output folder back (objects, generations, manifest/errors rows) straight from the
  emulator, bypassing any proxy.
"""

from __future__ import annotations

import hashlib
import json
import threading

from transforms import layout
from transforms.identity import ModelIdentity
from transforms.inference import Flux2KleinModelHandler
from transforms.sinks.encoding import png_text

_MODELS: dict = {}
_MODELS_LOCK = threading.Lock()


class CachedHandler(Flux2KleinModelHandler):
    def _key(self):
        return self.settings

    def load_model(self):
        with _MODELS_LOCK:
            key = self._key()
            if key not in _MODELS:
                _MODELS[key] = super().load_model()
            return _MODELS[key]


# What FaultyHandler raised in this process (the runner unpickles handlers in this process when it runs in memory).
RAISED: list = []
_FAULTS_LOCK = threading.Lock()
_CALLS = {"n": 0}
_ATTEMPTS: dict = {}

OOM_MESSAGE = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes. "
               "(injected by tests/support/fault_jobs.py for shape bucket {key})")


def reset_faults() -> None:
    with _FAULTS_LOCK:
        RAISED.clear()
        _ATTEMPTS.clear()
        _CALLS["n"] = 0


class FaultyHandler(CachedHandler):
    """`fail_calls`: 1-based numbers of this process's inference calls that raise a transient error;
    `fail_rate`: fraction of attempts (chosen by a hash of the batch's content, attempt number and `fault_seed`)
    that raise it;
    `doomed_shape`: a shape-key prefix (e.g. "32x64/") whose every batch raises an out-of-memory error."""

    def __init__(self, *args, fail_calls=(), fail_rate: float = 0.0, fault_seed: int = 0,
                 doomed_shape: str | None = None, **kwargs):
        kwargs.setdefault("retry_backoff_s", 0.02)  # the job's retries, without its production back-off
        super().__init__(*args, **kwargs)
        self._fail_calls = frozenset(fail_calls)
        self._fail_rate = fail_rate
        self._fault_seed = fault_seed
        self._doomed = doomed_shape

    def generate_once(self, tasks, model, compiled_batch=None):
        # Faults are injected per attempt, under the handler's own retry loop (run_inference), as real ones are.
        key = tasks[0].shape_key if tasks else ""
        names = [t.file_name for t in tasks]
        with _FAULTS_LOCK:
            if self._doomed and key.startswith(self._doomed):
                RAISED.append(("oom", names))
                raise RuntimeError(OOM_MESSAGE.format(key=key))
            _CALLS["n"] += 1
            call = _CALLS["n"]
            # A fresh draw for every attempt at the batch (its n-th attempt in this process), as a transient fault
            # would be: the job's retries can ride over it.
            _ATTEMPTS[tuple(sorted(names))] = attempt = _ATTEMPTS.get(tuple(sorted(names)), 0) + 1
            digest = hashlib.sha256(f"{self._fault_seed}/{attempt}/{sorted(names)}".encode()).digest()
            by_rate = int.from_bytes(digest[:8], "big") / 2**64 < self._fail_rate
            if call in self._fail_calls or by_rate:
                RAISED.append(("transient", names))
                raise RuntimeError(f"injected transient fault in inference call {call} (a worker lost its "
                                   f"accelerator)")
        return super().generate_once(tasks, model, compiled_batch)


def install_handler(monkeypatch, cls=CachedHandler, **extra):
    """Make the job build `cls(..., **extra)` where it would build Flux2KleinModelHandler (same arguments)."""
    import pipeline.graph as graph_module

    original = getattr(graph_module.make_handler, "original", graph_module.make_handler)  # never wrap a wrapper

    def make_handler(job):
        return original(job, handler_cls=cls, **extra)

    make_handler.original = original

    if monkeypatch is None:
        graph_module.make_handler = make_handler
    else:
        monkeypatch.setattr(graph_module, "make_handler", make_handler)


def load_cached(model: str, *, dtype="float32", max_sequence_length=32, batch_size=2, compilation_cache_dir=None):
    load_kwargs = {"compilation_cache_dir": compilation_cache_dir} if compilation_cache_dir else {}
    loaded = CachedHandler(model, dtype=dtype, max_sequence_length=max_sequence_length, batch_size=batch_size,
                           load_kwargs=load_kwargs).load_model()
    _FINGERPRINTS[id(loaded)] = ModelIdentity(
        job_model_fingerprint(model, dtype=dtype, max_sequence_length=max_sequence_length), dtype=dtype)
    return loaded


_FINGERPRINTS: dict = {}  # id(loaded generator) -> the model identity a job with its settings records


def job_model_fingerprint(model: str, *, dtype: str, max_sequence_length: int) -> str:
    """The model fingerprint a job loading `model` with these settings stores with its images (pipeline.launch)."""
    from model.loading.checkpoint import read_config_and_digest
    from model.options import DEFAULT_TEXT_ENCODER_OUT_LAYERS
    from transforms.fingerprints import model_fingerprint

    _, digest = read_config_and_digest(model)
    return model_fingerprint(digest, dtype=dtype, max_sequence_length=max_sequence_length,
                             text_encoder_out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS)


def expected_png(loaded, task) -> bytes:
    r = task.request
    from transforms.provenance import xmp_packet
    from transforms.sinks.encoding import ImageEncoding

    out = loaded.generate_batch([r.prompt], [task.seed], r.height, r.width, r.num_inference_steps, r.guidance_scale)
    made_by = ModelIdentity.of(_FINGERPRINTS.get(id(loaded)))
    text = png_text(task, num_inference_steps=out.num_inference_steps, guidance_scale=out.guidance_scale,
                    model=out.model, prompt_truncated=out.prompt_truncated[0], model_identity=made_by)
    xmp = xmp_packet(model=out.model, request_fingerprint=task.request_fingerprint,
                     model_fingerprint=made_by.model_fingerprint, image_id=r.id)  # the provenance every image carries
    return ImageEncoding("png").encode(out.images[0], text, xmp=xmp)


def fast_gcs_retries(monkeypatch, *, initial=0.02, maximum=0.3, timeout=60.0):
    from apache_beam.io.gcp import gcsio_retry

    fast = gcsio_retry.DEFAULT_RETRY_WITH_THROTTLING_COUNTER.with_delay(initial=initial, maximum=maximum,
                                                                         multiplier=2).with_timeout(timeout)
    monkeypatch.setattr(gcsio_retry, "DEFAULT_RETRY_WITH_THROTTLING_COUNTER", fast)
    return fast


class JobOutputs:
    """A job's `gs://bucket/prefix` output, read straight from the emulator."""

    def __init__(self, emulator, output: str):
        self.emulator = emulator
        self.output = output.rstrip("/")

    def blobs(self) -> dict:
        return self.emulator.list_blobs(self.output + "/")

    def relnames(self) -> set[str]:
        prefix = self.output.split("/", 3)[3] + "/"
        return {name[len(prefix):] for name in self.blobs()}

    def images(self) -> dict[str, bytes]:
        return {rel: self.emulator.read_bytes(f"{self.output}/{rel}") for rel in self.relnames()
                if rel.startswith(layout.IMAGES_DIR + "/")}

    def generations(self) -> dict[str, int]:
        prefix = self.output.split("/", 3)[3] + "/"
        return {name[len(prefix):]: b.generation for name, b in self.blobs().items()
                if name[len(prefix):].startswith(layout.IMAGES_DIR + "/")}

    def rows(self, kind: str) -> list[dict]:
        """Rows of `manifest`, `existing` (under manifest/) or `errors`."""
        folder = layout.MANIFEST_DIR if kind == layout.EXISTING_PREFIX else kind
        out = []
        for rel in sorted(self.relnames()):
            if rel.startswith(f"{folder}/{kind}-") and rel.endswith(layout.ROWS_SUFFIX):
                data = self.emulator.read_bytes(f"{self.output}/{rel}").decode("utf-8")
                out.extend(json.loads(line) for line in data.splitlines() if line.strip())
        return out

    def summary(self) -> dict | None:
        if layout.SUMMARY_FILE not in self.relnames():
            return None
        return json.loads(self.emulator.read_bytes(f"{self.output}/{layout.SUMMARY_FILE}"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
