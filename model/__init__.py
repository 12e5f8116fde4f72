"""FLUX.2 [klein] in JAX/Flax NNX: load a diffusers-layout checkpoint and generate images.

Public API:
    gen = model.load(path_or_gs_uri, dtype="bfloat16")
    images = gen.generate(prompts=[...], seeds=[...], height=1024, width=1024, num_inference_steps=None,
                          guidance_scale=None, num_images_per_prompt=1)      # np.uint8 [N, H, W, 3]
    noise = model.initial_noise(seed, shape)                                  # np.float32
    edited = gen.generate(prompts=[...], seeds=[...], reference_images=[[img, ...], ...])  # one list per prompt
    sig = model.engine.reference_preprocess.reference_signature(images, size_multiple)         # JAX-free, for bucketing

Importing the package is cheap and JAX-free (the job's readers and launcher use `model.contract` and
`model.loading.config`); `load` and the generator class import JAX on first use. The job (pipeline/) imports `model.api`
only: the names it may use, the preflight's among them.
"""

from .errors import (CheckpointError, ConfigError, ModelError, NonFiniteImageError, ReferenceImageError, RequestError,
                     UnsafeWeightsError)
from .engine.noise import initial_noise

__all__ = [
    "load",
    "initial_noise",
    "Flux2KleinGenerator",
    "ModelError",
    "CheckpointError",
    "ConfigError",
    "RequestError",
    "ReferenceImageError",
    "UnsafeWeightsError",
    "NonFiniteImageError",
]


def __getattr__(name: str):
    """`load` and `Flux2KleinGenerator` on first use, so that `import model.contract` never loads JAX."""
    if name in ("load", "Flux2KleinGenerator"):
        from .engine import generator

        return getattr(generator, name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
