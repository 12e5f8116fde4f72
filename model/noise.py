"""Initial latent noise as a pure function of (seed, shape): the same on every backend, batch and device count."""

from __future__ import annotations

import numpy as np

from .errors import RequestError

MAX_SEED = 2**63


def is_integer(value) -> bool:
    """A Python or numpy integer, and not a bool (True is an int in Python, never a count or a seed here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def optional_count(name: str, value) -> int | None:
    """`value` as int if it is None or an integer >= 1 (a size, a number of things), else ValueError naming it."""
    if value is not None and (not is_integer(value) or value < 1):
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
    return None if value is None else int(value)


def validate_seed(seed) -> int:
    """Return `seed` as int if it is an integer in [0, 2**63), else raise RequestError naming it."""
    if not is_integer(seed):
        raise RequestError(f"seed must be an integer in [0, 2**63), got {seed!r}", value=seed)
    seed = int(seed)
    if not 0 <= seed < MAX_SEED:
        raise RequestError(f"seed must be in [0, 2**63), got {seed}", value=seed)
    return seed


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
