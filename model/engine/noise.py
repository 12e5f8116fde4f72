"""Initial latent noise as a pure function of (seed, shape): the same on every backend, batch and device count."""

from __future__ import annotations

import numpy as np

from ..contract import validate_seed
from ..errors import RequestError


def initial_noise(seed: int, shape) -> np.ndarray:
    """Standard-normal float32 noise of `shape` drawn from numpy's PCG64 seeded with `seed` alone.

    For an image of height x width this is `(in_channels, height // m, width // m)` with m = 2 x the VAE scale (16 for
    the real VAE; `Flux2KleinGenerator.noise_shape` computes it), in the patchified layout that
    diffusers' Flux2KleinPipeline accepts as `latents` (one batch row per image).
    """
    seed = validate_seed(seed)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise RequestError(f"noise shape must be non-negative, got {shape}", value=shape)
    return np.random.Generator(np.random.PCG64(seed)).standard_normal(shape, dtype=np.float32)
