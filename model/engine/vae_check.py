"""--vae checked against the checkpoint it goes with before any weight is read: its config, its latent channels and
every tensor's name and shape from its weights' header. It sits in the engine room because the expected tensors come
from the networks' own modules (model/engine/factory.py); the VAE's files are found by model/loading/vae_swap.py."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..loading.vae_swap import VaeFiles


def check_vae(files: VaeFiles, config) -> None:
    """Check a VAE against the checkpoint it goes with (`config`: its PipelineConfig), from its config and weight
    headers alone, as the launch checks a checkpoint's own: its config read as a FLUX.2 VAE's, its latent channels
    the transformer's, every tensor the model needs present with the shape its config gives. ConfigError or
    CheckpointError naming the key or tensor and the file."""
    from ..errors import ConfigError
    from ..config.configs import VAEConfig, read_json
    from ..loading.stored_tensors import validate_component
    from ..loading.vae_swap import vae_view
    from .factory import Networks  # JAX: the tensors' names and shapes come from the model's modules

    vae = VAEConfig.from_dict(read_json(files.config), files.config)
    if vae.patched_channels != config.transformer.in_channels:
        raise ConfigError("the VAE's latent_channels x patch area must equal the transformer's in_channels "
                          f"({config.transformer.in_channels})", path=files.config, key="latent_channels",
                          value=vae.latent_channels)
    expected, optional = Networks(dataclasses.replace(config, vae=vae), out_layers=(-1,)).stored_tensors()["vae"]
    validate_component(vae_view(files), expected=expected, optional=optional)
