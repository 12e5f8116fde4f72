"""What a generate call gives back: its images and the facts reported with them, as plain picklable values.

JAX-free on purpose: a model shared across processes (`--large_model`, `--model_copies`) returns a GenerationResult
to the process that asked, which unpickles it without importing JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """An image whose values stopped being finite (overflow, bad weights, a kernel fault): the stage whose output
    first held NaN or inf, and the share of that output's values that are not finite."""

    stage: str       # "denoise" (the latents) or "decode" (the pixels)
    fraction: float

    def describe(self) -> str:
        return f"non-finite values after {self.stage}: {self.fraction:.1%} of the values are NaN or inf"


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What `generate_result` returns: the images and the facts a caller reports with them."""

    images: np.ndarray                 # uint8 [N, H, W, 3]
    prompt_truncated: tuple[bool, ...]  # per image: its prompt was longer than max_sequence_length tokens
    num_inference_steps: int           # as resolved (the checkpoint's default when not given)
    guidance_scale: float
    model: str
    seconds: float                     # wall time of the call (the lock's wait not counted)
    # per image: None, or where its values stopped being finite (its pixels are then not an image: do not save them)
    nonfinite: tuple = ()
    # per image: {score name: value} when the generator scores its images (model.engine.scoring), else empty
    scores: tuple = ()
