"""Benchmark presets and their random-weight checkpoints (built once, cached).

- `tiny`: the test fixtures' TinySpec (seconds to build and run).
- `small`: the real klein-4B block structure (5 double + 20 single transformer blocks, a 36-layer Qwen3 encoder
  read at hidden states 9/18/27, 4-level VAE decoder with 2 resnets per level, 128 latent channels) with every width
  divided by ~20 so that one 256x256 image takes seconds on a 2-core CPU. Its compute splits roughly like the real
  model's at 256x256 (transformer >> text encoder > VAE).
- `klein-4b`, `klein-9b`: the published shapes with random bf16 weights (benchmarks/realsize.py), for accelerators
  and memory checks.
"""

from __future__ import annotations

import dataclasses
import os

from model.loading.cache_paths import cache_root
from tiny_klein import TinySpec, build_tiny_checkpoint, spec_hash

SMALL_SPEC = TinySpec(
    num_layers=5, num_single_layers=20, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 8, 8, 8),
    mlp_ratio=3.0, timestep_guidance_channels=256,
    text_hidden_size=128, text_intermediate_size=480, text_num_layers=36, text_heads=4, text_kv_heads=1,
    text_head_dim=32, text_out_layers=(9, 18, 27),
    vae_block_out_channels=(16, 32, 64, 64), vae_layers_per_block=2, vae_latent_channels=32, vae_norm_num_groups=16,
    max_shard_size="4MB",
)

PRESETS = {
    "tiny": {"spec": TinySpec(), "max_sequence_length": 32},
    "small": {"spec": SMALL_SPEC, "max_sequence_length": 512},
    "klein-4b": {"realsize": "klein-4b", "max_sequence_length": 512},
    "klein-9b": {"realsize": "klein-9b", "max_sequence_length": 512},
}


def bench_cache_root() -> str:
    """Where the presets' checkpoints are cached: `bench/` in the project's cache folder
    (model/loading/cache_paths.py)."""
    return os.path.join(cache_root(), "bench")


def ensure_checkpoint(preset: str, *, distilled: bool = True, cache_root: str | None = None) -> str:
    """Path of the preset's checkpoint folder, building it on first use (atomically: build next to it, rename)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    root = cache_root or bench_cache_root()
    entry = PRESETS[preset]
    if "spec" in entry:
        spec = dataclasses.replace(entry["spec"], distilled=distilled)
        final = os.path.join(root, f"{preset}-{spec_hash(spec)}")
        if not os.path.isfile(os.path.join(final, "model_index.json")):
            os.makedirs(root, exist_ok=True)
            build_tiny_checkpoint(final, spec, overwrite=True)
        return final
    if not distilled:
        raise ValueError("the real-size presets are built distilled only")
    from benchmarks.realsize import build_realsize_checkpoint

    final = os.path.join(root, f"{preset}-realsize")
    if not os.path.isfile(os.path.join(final, "model_index.json")):
        _build_once(final, lambda tmp: build_realsize_checkpoint(tmp, entry["realsize"]))
    return final


def _build_once(final: str, build) -> None:
    """`build(folder)` into a temporary folder beside `final`, renamed into place whole (a killed build leaves none)."""
    import shutil
    import tempfile

    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}-", dir=os.path.dirname(final))
    try:
        build(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_small_decoder_vae(cache_root: str | None = None) -> str:
    """A VAE folder in FLUX.2-small-decoder's shapes (full encoder, decoder widths 96-192-384-384; random bf16
    weights), built on first use (atomically), for `model.load(..., vae=...)` and `--vae`."""
    from benchmarks.realsize import build_realsize_vae

    final = os.path.join(cache_root or bench_cache_root(), "small-decoder-vae-realsize")
    if not os.path.isfile(os.path.join(final, "config.json")):
        _build_once(final, build_realsize_vae)
    return final
