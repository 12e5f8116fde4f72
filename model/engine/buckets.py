"""What a call compiles and runs with, decided once for the generator and the preflight: the checkpoint's sampling
defaults, the latent grid of an image size, and the shape bucket (batch rounded to whole data replicas).

JAX-free: the job's launcher and the preflight plan without a device.
"""

from __future__ import annotations

import dataclasses

from ..config.configs import PipelineConfig

# The checkpoint's defaults, exactly as diffusers' Flux2KleinPipeline: a guidance-distilled model runs 4 steps
# without guidance, a base model 50 steps with classifier-free guidance 4.0.
DISTILLED_STEPS, DISTILLED_GUIDANCE = 4, 1.0
BASE_STEPS, BASE_GUIDANCE = 50, 4.0


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A call's resolved steps and guidance, and whether it runs classifier-free guidance (two branches a step)."""

    num_inference_steps: int
    guidance_scale: float
    use_cfg: bool


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Everything a compiled executable is specialised on."""

    batch: int
    grid_h: int
    grid_w: int
    steps: int
    cfg: bool
    ref_tokens: int = 0  # reference-image tokens appended to the target's (0: text-to-image)


def default_steps(config: PipelineConfig) -> int:
    """The checkpoint's number of denoising steps."""
    return DISTILLED_STEPS if config.is_distilled else BASE_STEPS


def default_guidance(config: PipelineConfig) -> float:
    """The checkpoint's guidance scale."""
    return DISTILLED_GUIDANCE if config.is_distilled else BASE_GUIDANCE


def resolve_sampling(config: PipelineConfig, num_inference_steps: int | None = None,
                     guidance_scale: float | None = None) -> Sampling:
    """Steps and guidance as asked, else the checkpoint's; CFG only on base models with a scale above 1 (a distilled
    model ignores the scale)."""
    steps = default_steps(config) if num_inference_steps is None else int(num_inference_steps)
    guidance = default_guidance(config) if guidance_scale is None else float(guidance_scale)
    return Sampling(steps, guidance, use_cfg=guidance > 1 and not config.is_distilled)


def latent_grid(config: PipelineConfig, height: int, width: int) -> tuple[int, int]:
    """Latent tokens per column and per row of an image (its pixels over the checkpoint's size multiple)."""
    return height // config.size_multiple, width // config.size_multiple


def compiled_batch(batch: int, data_replicas: int) -> int:
    """`batch` rounded up to whole data replicas: each copy of the weights takes an equal share of the batch."""
    return -(-batch // data_replicas) * data_replicas


def bucket_for(config: PipelineConfig, *, height: int, width: int, sampling: Sampling, batch: int,
                data_replicas: int, reference_sizes: tuple[tuple[int, int], ...] = ()) -> Bucket:
    """The bucket of a call: its latent grid, `batch` rounded to whole data replicas, and its references' token
    count."""
    grid_h, grid_w = latent_grid(config, height, width)
    rows = compiled_batch(batch, data_replicas)
    ref_tokens = sum(h * w for h, w in (latent_grid(config, *size) for size in reference_sizes))
    return Bucket(rows, grid_h, grid_w, sampling.num_inference_steps, sampling.use_cfg, ref_tokens)
