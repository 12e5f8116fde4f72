"""FLUX.2 [klein] in JAX/Flax NNX: load a diffusers-layout checkpoint and generate images.

Public API (fixed):
    gen = model.load(path_or_gs_uri, dtype="bfloat16")
    images = gen.generate(prompts=[...], seeds=[...], height=1024, width=1024, num_inference_steps=None,
                          guidance_scale=None, num_images_per_prompt=1)      # np.uint8 [N, H, W, 3]
    noise = model.initial_noise(seed, shape)                                  # np.float32
"""

from .errors import CheckpointError, ConfigError, ModelError, RequestError, UnsafeWeightsError
from .noise import initial_noise
from .generator import Flux2KleinGenerator, load

__all__ = [
    "load",
    "initial_noise",
    "Flux2KleinGenerator",
    "ModelError",
    "CheckpointError",
    "ConfigError",
    "RequestError",
    "UnsafeWeightsError",
]
