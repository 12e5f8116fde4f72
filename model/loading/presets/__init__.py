"""The published FLUX.2 [klein] configs (no weights), bundled so tools can size the real models without a checkpoint.

Each preset is a diffusers-layout folder of config files only (model_index.json, transformer/, text_encoder/, vae/,
scheduler/), read by `PipelineConfig.from_folder` like a checkpoint's. The values are the published ones as gathered
in the project's reference notes (transformer config, the Qwen3-4B / Qwen3-8B text encoders, the FLUX.2 VAE and
scheduler); the base variants differ only by `is_distilled: false` (50 steps with CFG by default). There is no
tokenizer: presets serve compilation and sizing (the preflight), never generation.
"""

from __future__ import annotations

import os

from ...config.configs import PipelineConfig
from ...errors import ConfigError

PRESETS_DIR = os.path.dirname(os.path.abspath(__file__))
PRESET_NAMES = ("klein-4b", "klein-9b", "klein-base-4b", "klein-base-9b")


def is_preset(name: str) -> bool:
    """Whether `name` names a bundled preset."""
    return name in PRESET_NAMES


def preset_folder(name: str) -> str:
    """The folder holding preset `name`'s config files; ConfigError naming it when there is no such preset."""
    if not is_preset(name):
        raise ConfigError(f"unknown model preset; choose one of {', '.join(PRESET_NAMES)}", key="preset", value=name)
    return os.path.join(PRESETS_DIR, name)


def preset_config(name: str) -> PipelineConfig:
    """Preset `name`'s configs, read and checked as a checkpoint's would be."""
    return PipelineConfig.from_folder(preset_folder(name))
