"""FLUX.2 [klein] in JAX/Flax NNX: load a diffusers-layout checkpoint and generate images.

    gen = model.load(path_or_gs_uri, dtype="bfloat16")
    images = gen.generate(prompts=[...], seeds=[...], height=1024, width=1024, num_inference_steps=None,
                          guidance_scale=None, num_images_per_prompt=1)      # np.uint8 [N, H, W, 3]
    noise = model.initial_noise(seed, shape)                                  # np.float32
    edited = gen.generate(prompts=[...], seeds=[...], reference_images=[[img, ...], ...])  # one list per prompt
    sig = model.reference_signature(images, size_multiple)                    # JAX-free, for bucketing

This package is the model's one public surface: the job (pipeline/) and its Beam building blocks (transforms/)
import from `model` only (tests/model/test_front_door.py checks it). Its rooms (storage/, config/, parallel/, nets/,
loading/, engine/, preflight/, in layers: tests/model/test_rooms.py) are internals: they may be split, merged or
renamed without notice. Importing `model` is cheap and does not load JAX: the request contract, the errors and the
options are imported with it, every other name on first use.

- Loading and generating: `load` (which starts the accelerator runtime itself; `start_runtime` starts it earlier, on a
  thread, in a process that will load; `apply_runtime_defaults` sets the runtime's settings before either),
  `Flux2KleinGenerator`, `LoadSettings`, `EngineOptions`, `DTYPE_NAMES`, `QUANTIZE_MODES`,
  `DEFAULT_TEXT_ENCODER_OUT_LAYERS`, `DEFAULT_BATCH_SIZE` (without a TPU to fit), `DEFAULT_MAX_BATCH_SIZE` (the most
  a search for the batch that fits tries), `initial_noise`; `enable_compilation_cache`, `compile_counts` (this
  process's XLA compilations, persistent-cache hits and lease waits).
- The request contract (model/contract.py): `validate` and its parts (`validate_prompt`, `validate_seed`,
  `validate_reference_count`), `count`, `optional_count`, `is_integer`, `show`, `Limits`, the DEFAULT_* limits and
  `MAX_IMAGES_PER_REQUEST`. Reference images: `MIN_REFERENCE_SIDE` (the smallest side one may have),
  `check_reference_size`, `reference_signature` (their processed sizes, JAX-free).
- Checkpoints: `read_config`, `read_config_and_digest` (configs only; `check_weights=True` checks each weight
  file the loader reads from its header and size, no weight read), `is_hub_id`, `resolve_hub`, `with_revision`,
  `HubSnapshot`, `validate_variant`, `cache_root`; the bundled presets: `PRESET_NAMES`, `is_preset`,
  `preset_config`; --vae (model/loading/vae_swap.py): `vae_files`, `check_vae` (against a checkpoint's config, from
  headers), `vae_identity`.
- Storage (model/storage/, JAX- and Beam-free): `gcs_client` (the one GCS client: this machine's credentials, else
  anonymous, or the emulator), `split_gs_uri`, `split_gs_object`, `join_gs_uri`, `upload_files` (transfer_manager),
  `write_local_atomic`, `finish_or_abandon` (an object upload finalised whole or abandoned), `umask`, `crc32c`,
  `checksum_text`, `local_digests` (CRC32C as GCS lists it).
- Sampling and parallelism (JAX-free): `resolve_sampling` (the checkpoint's steps and guidance), `shard_counts`.
- Leases (storage; the compile lease's stores, which the job's output lease uses too): `LocalLeases`, `GcsLeases`,
  `Holder`, `decide` (with its verdicts `TAKE_OVER`, `WAIT`), `process_alive`.
- TPU preflight: `load_topology` (`Topology`, `CHIPS`; `ATTACHED`: this machine's own chips), `attached_topology`
  (their name, without opening them); the TPU catalogue (model/preflight/tpu_catalogue.py): `TPU_DATAFLOW_CHIPS`
  (Dataflow accelerator type -> chip name), `TPU_DEVICE_KINDS` (JAX's device kind -> chip name), `tpu_host_topology`,
  `tpu_machine_topology`; `fit` (compile for the topology and report: `Report`, `ProgramStats`,
  `V5E_CALIBRATION`), `format_bytes`, `GiB`.
- Scores (model/engine/scoring.py: CLIP and its heads beside the generator): `ScoreSettings`
  (model/config/score_settings.py; `LoadSettings.scores`), `DEFAULT_SCORE_MODEL`, `parse_labels`, `parse_head`
  (JAX-free); `check_score_files` (a launch's check of local score files), `scorer_reserved_bytes` (what the TPU
  preflight leaves to the scorer).
- Errors: `ModelError` and its kinds (model/errors.py), `ShardCountError`, `TopologyError`.
"""

from __future__ import annotations

import importlib

from .contract import (DEFAULT_MAX_PIXELS, DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_REFERENCE_IMAGES,
                       DEFAULT_MAX_REFERENCE_PIXELS, DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_SIZE, DEFAULT_SIZE_MULTIPLE,
                       MAX_IMAGES_PER_REQUEST, Limits, count, is_integer, optional_count, show, validate,
                       validate_prompt, validate_reference_count, validate_seed)
from .engine.noise import initial_noise
from .errors import (CheckpointError, ConfigError, HubError, LoraError, ModelError, NonFiniteImageError,
                     ReferenceImageError, RequestError, UnsafeWeightsError)
from .options import (DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_SIZE, DEFAULT_TEXT_ENCODER_OUT_LAYERS, DTYPE_NAMES,
                      QUANTIZE_MODES, EngineOptions, LoadSettings)
from .config.lora_spec import LoraSpec
from .config.score_settings import DEFAULT_SCORE_MODEL, ScoreSettings, parse_head, parse_labels

# Imported on first use, so that `import model` stays light and JAX-free: name -> (module, attribute). JAX_NAMES load
# JAX; the others do not.
_LAZY = {
    # JAX: loading, generating, compiling
    "load": ("engine.generator", "load"),
    "Flux2KleinGenerator": ("engine.generator", "Flux2KleinGenerator"),
    "fit": ("preflight.aot", "fit"),
    "enable_compilation_cache": ("engine.programs", "enable_compilation_cache"),
    "start_runtime": ("engine.runtime", "start_runtime"),
    "apply_runtime_defaults": ("engine.runtime", "apply_runtime_defaults"),
    "check_score_files": ("engine.scoring", "check_score_files"),
    "scorer_reserved_bytes": ("engine.scoring", "reserved_bytes"),
    # JAX-free
    "GenerationResult": ("engine.results", "GenerationResult"),
    "compile_counts": ("engine.compile_events", "counts"),
    "MIN_REFERENCE_SIDE": ("engine.reference_preprocess", "MIN_SIDE"),
    "check_reference_size": ("engine.reference_preprocess", "check_size"),
    "reference_signature": ("engine.reference_preprocess", "reference_signature"),
    "resolve_sampling": ("engine.buckets", "resolve_sampling"),
    "cache_root": ("loading.cache_paths", "cache_root"),
    **{name: ("loading.checkpoint", name) for name in ("read_config", "read_config_and_digest")},
    **{name: ("loading.hub", name) for name in ("HubSnapshot", "is_hub_id", "resolve_hub", "with_revision")},
    **{name: ("loading.presets", name) for name in ("PRESET_NAMES", "is_preset", "preset_config")},
    "validate_variant": ("options", "validate_variant"),
    "check_loras": ("loading.lora_source", "check_loras"),
    "ShardCountError": ("parallel.mesh", "ShardCountError"),
    "shard_counts": ("parallel.mesh", "shard_counts"),
    **{name: ("preflight.estimate", name) for name in ("V5E_CALIBRATION", "ProgramStats")},
    **{name: ("preflight.fit_report", name) for name in ("Report", "format_bytes")},
    **{name: ("preflight.topology", name)
       for name in ("ATTACHED", "CHIPS", "GiB", "Topology", "TopologyError", "attached_topology", "load_topology")},
    "TPU_DATAFLOW_CHIPS": ("preflight.tpu_catalogue", "DATAFLOW_CHIPS"),
    "TPU_DEVICE_KINDS": ("preflight.tpu_catalogue", "DEVICE_KINDS"),
    "tpu_host_topology": ("preflight.tpu_catalogue", "host_topology"),
    "tpu_machine_topology": ("preflight.tpu_catalogue", "machine_topology"),
    # JAX- and Beam-free: storage (model/storage/)
    "gcs_client": ("storage.gcs", "client"),
    "split_gs_uri": ("storage.gcs", "split"),
    "join_gs_uri": ("storage.gcs", "join"),
    "split_gs_object": ("storage.gcs", "split_object"),
    **{name: ("storage.leases", name)
       for name in ("TAKE_OVER", "WAIT", "GcsLeases", "Holder", "LocalLeases", "decide", "process_alive")},
    **{name: ("storage.atomic", name) for name in ("finish_or_abandon", "umask", "write_local_atomic")},
    **{name: ("storage.crc32c", name) for name in ("checksum_text", "crc32c", "local_digests")},
    "upload_files": ("storage.transfers", "upload_files"),
    # JAX-free: --vae (model/loading/vae_swap.py)
    **{name: ("loading.vae_swap", name) for name in ("check_vae", "vae_files", "vae_identity")},
}

JAX_NAMES = ("load", "Flux2KleinGenerator", "fit", "enable_compilation_cache", "start_runtime", "apply_runtime_defaults",
             "check_score_files", "scorer_reserved_bytes")

__all__ = sorted([
    "DEFAULT_MAX_PIXELS", "DEFAULT_MAX_PROMPT_BYTES", "DEFAULT_MAX_REFERENCE_IMAGES", "DEFAULT_MAX_REFERENCE_PIXELS",
    "DEFAULT_MAX_SEQUENCE_LENGTH", "DEFAULT_SIZE", "DEFAULT_SIZE_MULTIPLE", "MAX_IMAGES_PER_REQUEST", "Limits", "count",
    "is_integer", "optional_count", "show", "validate", "validate_prompt", "validate_reference_count", "validate_seed",
    "initial_noise",
    "CheckpointError", "ConfigError", "HubError", "LoraError", "ModelError", "NonFiniteImageError",
    "ReferenceImageError", "RequestError", "UnsafeWeightsError",
    "DEFAULT_BATCH_SIZE", "DEFAULT_MAX_BATCH_SIZE", "DEFAULT_TEXT_ENCODER_OUT_LAYERS", "DTYPE_NAMES", "QUANTIZE_MODES",
    "EngineOptions", "LoadSettings", "LoraSpec",
    "DEFAULT_SCORE_MODEL", "ScoreSettings", "parse_head", "parse_labels",
    *_LAZY,
])


def __getattr__(name: str):
    """The names of _LAZY on first use (then kept here)."""
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'model' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
