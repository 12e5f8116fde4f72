"""The preflight's answers, kept by content beside the compilation cache, so a launch that asks what an earlier one
asked compiles nothing for the check.

An answer (the preflight's JSON report: fits, batch, memory per chip, estimate) is stored under
`{--compilation_cache_dir}/preflight-answers/{key}.json`, local or gs://, where the key is the sha256 of every field
that could change it (`answer_fields`): the model's configs (what the preflight reads of it; the launch checks the
weight files' headers against them before the preflight runs), this code, the topology, the job's shape and
numerics, the batch asked for, the versions of jax, jaxlib and libtpu and the compiler's flags. An entry that cannot
be read as an answer, or whose recorded fields are not this key's, is ignored with a warning and never trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

logger = logging.getLogger("pipeline.preflight_store")

STORE_FOLDER = "preflight-answers"
FORMAT = 1  # of an entry; a new one misses every older entry
# The compiler's own settings from the environment: they can change what a program needs.
COMPILER_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
VERSIONED_PACKAGES = ("jax", "jaxlib", "libtpu", "libtpu-nightly")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StoreEntryError(ValueError):
    """A stored entry that is not a usable answer for the key it was looked up by (the reason in the message)."""


def package_versions() -> dict:
    """The installed versions of the packages that compile the programs (None: not installed)."""
    from importlib import metadata

    found = {}
    for name in VERSIONED_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def compiler_flags() -> dict:
    return {name: os.environ.get(name, "") for name in COMPILER_FLAG_VARIABLES}


def model_identity(config) -> str:
    """sha256 of the model's configs as the preflight reads them (model.loading.config.PipelineConfig): the same for
    a preset and a checkpoint with the same configs, different for any field that differs."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def code_identity() -> str:
    """sha256 of the source of the packages that build and measure the programs (model/, and this preflight), so an
    answer never outlives the code that found it."""
    digest = hashlib.sha256()
    for top in ("model", "pipeline"):
        for folder, dirs, files in sorted(os.walk(os.path.join(_ROOT, top))):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith((".py", ".json"))):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, _ROOT).encode())
                with open(path, "rb") as f:
                    digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def answer_fields(config, request) -> dict:
    """Everything the answer to `request` (pipeline.preflight.PreflightRequest) for the model of `config` depends on;
    the checkpoint's defaults filled in, so a request that leaves steps or guidance to them and one that names them
    ask the same."""
    from model import resolve_sampling

    sampling = resolve_sampling(config, request.num_inference_steps, request.guidance_scale)
    return {"format": FORMAT, "model": model_identity(config), "code": code_identity(),
            "topology": request.topology, "height": request.height, "width": request.width,
            "steps": sampling.num_inference_steps, "guidance": sampling.guidance_scale, "dtype": request.dtype,
            "quantize": request.quantize, "model_shards": request.model_shards,
            "max_sequence_length": request.max_sequence_length,
            "text_encoder_out_layers": list(request.text_encoder_out_layers),
            "batch_size": request.batch_size if request.batch_size is not None else "auto",
            "max_batch_size": request.max_batch_size if request.batch_size is None else None,
            "hbm_bytes": request.hbm_bytes, "reserved_bytes": request.reserved_bytes,
            "versions": package_versions(), "compiler_flags": compiler_flags()}


def answer_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class AnswerStore:
    """The answers kept under one compilation cache folder (local or gs://)."""

    cache_dir: str

    @property
    def folder(self) -> str:
        return self.cache_dir.rstrip("/") + "/" + STORE_FOLDER

    def path(self, key: str) -> str:
        return f"{self.folder}/{key}.json"

    def path_for(self, fields: dict) -> str:
        return self.path(answer_key(fields))

    def load(self, fields: dict) -> dict | None:
        """The stored answer for `fields`, or None: none stored, or an entry that is not one (a warning says why)."""
        key = answer_key(fields)
        path = self.path(key)
        try:
            data = _read(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("the stored preflight answer %s cannot be read (%s); compiling instead", path, e)
            return None
        try:
            return entry_answer(data, key, fields)
        except StoreEntryError as e:
            logger.warning("ignoring the stored preflight answer %s: %s; compiling instead", path, e)
            return None

    def save(self, fields: dict, answer: dict) -> str | None:
        """Store `answer` for `fields`, whole or not at all; returns where, or None when it could not be written (a
        warning says why: the answer in hand is still good, the next launch compiles again)."""
        key = answer_key(fields)
        path = self.path(key)
        data = json.dumps({"key": key, "fields": fields, "answer": answer}, sort_keys=True).encode()
        try:
            _write(path, data)
        except Exception as e:  # noqa: BLE001 - any storage error (OSError, GCS's own) only loses the keeping
            logger.warning("the preflight answer could not be stored at %s (%s: %s); the next launch compiles "
                           "again", path, type(e).__name__, e)
            return None
        return path


def entry_answer(data: bytes, key: str, fields: dict) -> dict:
    """The answer an entry's bytes hold for `key`; StoreEntryError when they are not JSON, not an entry, or were
    written for another key (naming the first field that differs)."""
    try:
        entry = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreEntryError(f"not JSON ({e})") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("answer"), dict):
        raise StoreEntryError("no answer in it")
    stored = entry.get("fields")
    if entry.get("key") != key or stored != fields:
        differing = sorted(k for k in set(fields) | set(stored or {}) if (stored or {}).get(k) != fields.get(k))
        raise StoreEntryError(f"written for another key (differs in: {', '.join(differing) or 'the key'})")
    answer = entry["answer"]
    if not isinstance(answer.get("fits"), bool) or not isinstance(answer.get("batch"), int):
        raise StoreEntryError("its answer lacks fits or batch")
    return answer


def _read(path: str) -> bytes:
    if "://" not in path:
        with open(path, "rb") as f:
            return f.read()
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    if not FileSystems.exists(path):
        raise FileNotFoundError(path)
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    from transforms.atomic_files import write_local_atomic, write_object_atomic

    if "://" not in path:
        write_local_atomic(path, lambda out: out.write(data))
    else:
        write_object_atomic(path, lambda out: out.write(data), "application/json")
