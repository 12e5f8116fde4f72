"""The model package's public surface for the job (pipeline/): every name the launcher and its tools may use.

The other modules of `model` are its internals: they may be split, merged or renamed without notice, so pipeline/
imports from here only (tests/model checks it). Importing this module does not load JAX: the names that need it
(`load`, `fit`, `enable_compilation_cache`, `start_runtime`) are imported on first use.

- Loading and generating: `load` (which starts the accelerator runtime itself; `start_runtime` starts it earlier, on a
  thread, in a process that will load), `LoadSettings`, `EngineOptions`, `DTYPE_NAMES`,
  `DEFAULT_TEXT_ENCODER_OUT_LAYERS`, `DEFAULT_BATCH_SIZE` (without a TPU to fit), `DEFAULT_MAX_BATCH_SIZE` (the most
  a search for the batch that fits tries).
- The request contract (model.contract): `validate`, `count`, `optional_count`, `is_integer`, `Limits` and the DEFAULT_*
  limits; `MIN_REFERENCE_SIDE`, the smallest side a reference image may have.
- Checkpoints: `read_config`, `read_config_and_digest` (configs only; `check_weights=True` checks each weight
  file the loader reads from its header and size, no weight read), `is_hub_id`, `resolve_hub`, `with_revision`,
  `HubSnapshot`, `validate_variant`, `split_gs_uri`, `gcs_client`, `cache_root`; the bundled presets: `PRESET_NAMES`,
  `is_preset`,
  `preset_config`.
- Deployment plan (JAX-free): `resolve_sampling` (the checkpoint's steps and guidance), `shard_counts`.
- Leases (JAX-free; model.engine.compile_lease, which the job's output lease uses too): `LocalLeases`, `GcsLeases`,
  `Holder`, `decide` (with its verdicts `TAKE_OVER`, `WAIT`), `process_alive`.
- TPU preflight: `load_topology` (`Topology`, `CHIPS`; `ATTACHED`: this machine's own chips), `attached_topology`
  (their name, without opening them), `fit` (compile for the topology and report: `Report`, `ProgramStats`,
  `V5E_CALIBRATION`), `format_bytes`, `GiB`.
- Errors: `ModelError` and its kinds, `ShardCountError`, `TopologyError`.
"""

from __future__ import annotations

from .loading.cache_paths import cache_root
from .loading.checkpoint import read_config, read_config_and_digest, split_gs_uri
from .contract import (DEFAULT_MAX_PIXELS, DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_REFERENCE_IMAGES,
                       DEFAULT_MAX_REFERENCE_PIXELS, DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_SIZE, Limits, count,
                       is_integer, optional_count, validate)
from .errors import (CheckpointError, ConfigError, HubError, ModelError, NonFiniteImageError, ReferenceImageError,
                     RequestError, UnsafeWeightsError)
from .preflight.estimate import V5E_CALIBRATION, ProgramStats
from .preflight.fit_report import Report, format_bytes
from .loading.hub import HubSnapshot, is_hub_id, resolve_hub, with_revision
from .engine.compile_lease import TAKE_OVER, WAIT, GcsLeases, Holder, LocalLeases, decide, process_alive
from .parallel.mesh import ShardCountError, shard_counts
from .options import (DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_SIZE, DEFAULT_TEXT_ENCODER_OUT_LAYERS, DTYPE_NAMES,
                      QUANTIZE_MODES, EngineOptions, LoadSettings)
from .engine.buckets import resolve_sampling
from .loading.presets import PRESET_NAMES, is_preset, preset_config
from .engine.reference_preprocess import MIN_SIDE as MIN_REFERENCE_SIDE
from .preflight.topology import ATTACHED, CHIPS, GiB, Topology, TopologyError, attached_topology, load_topology
from .loading.weight_files import validate_variant

# Imported on first use (they load JAX): name -> (module, attribute).
_LAZY = {"load": ("engine.generator", "load"), "fit": ("preflight.aot", "fit"),
         "enable_compilation_cache": ("engine.programs", "enable_compilation_cache"),
         "start_runtime": ("engine.runtime", "start_runtime")}

__all__ = sorted([
    "cache_root", "read_config", "read_config_and_digest", "split_gs_uri", "gcs_client",
    "DEFAULT_MAX_PIXELS", "DEFAULT_MAX_PROMPT_BYTES", "DEFAULT_MAX_REFERENCE_IMAGES", "DEFAULT_MAX_REFERENCE_PIXELS",
    "DEFAULT_MAX_SEQUENCE_LENGTH", "DEFAULT_SIZE", "Limits", "count", "is_integer", "optional_count", "validate",
    "MIN_REFERENCE_SIDE",
    "CheckpointError", "ConfigError", "HubError", "ModelError", "NonFiniteImageError", "ReferenceImageError",
    "RequestError", "UnsafeWeightsError", "ShardCountError", "TopologyError",
    "V5E_CALIBRATION", "ProgramStats", "Report", "format_bytes", "HubSnapshot", "is_hub_id", "resolve_hub",
    "shard_counts", "DEFAULT_BATCH_SIZE", "DEFAULT_MAX_BATCH_SIZE", "DEFAULT_TEXT_ENCODER_OUT_LAYERS", "DTYPE_NAMES",
    "QUANTIZE_MODES", "EngineOptions", "LoadSettings", "resolve_sampling", "PRESET_NAMES", "is_preset", "preset_config",
    "CHIPS", "GiB", "Topology", "load_topology", "attached_topology", "ATTACHED", "validate_variant", "with_revision",
    "TAKE_OVER", "WAIT", "GcsLeases", "Holder", "LocalLeases", "decide", "process_alive", *_LAZY,
])


def gcs_client():
    """The google-cloud-storage client the checkpoint reader uses (anonymous where no credentials are found)."""
    from .loading.checkpoint import _client

    return _client()


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __package__), attribute)
    raise AttributeError(f"module 'model.api' has no attribute {name!r}")
