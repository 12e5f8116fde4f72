"""CLIP's image preprocessing on the device, as transformers' `CLIPImageProcessor` does it with PIL.

The processor resizes the shortest side to `shortest_edge` with PIL's bicubic filter, center-crops to `crop_size`,
then rescales to [0, 1] and normalizes with CLIP's mean and std. PIL resizes 8-bit images in two passes (columns,
then rows), each with per-output-pixel kernels stretched by the downscale factor (antialiasing), weights in 22-bit
fixed point, and rounds and clips to 8 bits between and after the passes. Here each pass is one matmul with the
same fixed-point weights (`resize_matrix`, built on the host: the sizes are static) and the same rounding, so the
pixels CLIP sees match PIL's (an output value off by one where float32 rounds a sum that PIL's integers do not).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, CLIPImageProcessor's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PIL_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC: the only resample this module implements
_PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed-point coefficients for 8-bit images (Resample.c)


@dataclasses.dataclass(frozen=True)
class ImageProcessing:
    """What `preprocessor_config.json` says: the shortest side after resizing, the crop, mean and std."""

    shortest_edge: int = 224
    crop_height: int = 224
    crop_width: int = 224
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_folder(cls, folder: str, image_size: int) -> "ImageProcessing":
        """The checkpoint's preprocessor_config.json, or CLIP's defaults at the vision tower's `image_size`;
        ConfigError for a processor this module does not reproduce (another resample, no resize or crop)."""
        path = os.path.join(folder, "preprocessor_config.json")
        if not os.path.isfile(path):
            return cls(image_size, image_size, image_size)
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the score model's preprocessor config: {e}", path=path) from e
        for key, wanted in (("resample", PIL_BICUBIC), ("do_resize", True), ("do_center_crop", True),
                            ("do_normalize", True), ("do_rescale", True)):
            if d.get(key, wanted) != wanted:
                raise ConfigError(f"the score model's image processing must have {key}={wanted!r}", path=path,
                                  key=key, value=d.get(key))
        size, crop = d.get("size", {"shortest_edge": image_size}), d.get("crop_size", image_size)
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if not isinstance(size, dict) or "shortest_edge" not in size:
            raise ConfigError("the score model's resize must name shortest_edge", path=path, key="size", value=size)
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(int(size["shortest_edge"]), int(crop["height"]), int(crop["width"]),
                   tuple(float(v) for v in d.get("image_mean", CLIP_MEAN)),
                   tuple(float(v) for v in d.get("image_std", CLIP_STD)))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' shortest-edge rule: the short side becomes `shortest_edge`, the long one int(scaled)."""
        short, long = (height, width) if height <= width else (width, height)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)


def _bicubic(x: np.ndarray) -> np.ndarray:
    """PIL's bicubic kernel (a = -0.5)."""
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def resize_matrix(in_size: int, out_size: int) -> np.ndarray:
    """[in_size, out_size] float32: output pixel j = sum_i input_i * M[i, j], with Pillow's bicubic coefficients
    for this size (kernel support stretched by the downscale factor, normalized per output pixel, rounded to
    Pillow's fixed point)."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = 2.0 * filter_scale
    out = np.zeros((in_size, out_size), np.float64)
    for j in range(out_size):
        center = (j + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        taps = _bicubic((np.arange(lo, hi) - center + 0.5) / filter_scale)
        total = taps.sum()
        if total != 0:
            taps = taps / total
        unit = 1 << _PRECISION_BITS
        fixed = np.where(taps < 0, np.trunc(-0.5 + taps * unit), np.trunc(0.5 + taps * unit))
        out[lo:hi, j] = fixed / unit
    return out.astype(np.float32)


def _round_clip_8bit(x):
    """Pillow's (sum + half) >> bits, then clip to [0, 255]."""
    return jnp.clip(jnp.floor(x + 0.5), 0.0, 255.0)


def preprocess(pixels, processing: ImageProcessing):
    """uint8 pixels [B, H, W, 3] -> float32 [B, crop_h, crop_w, 3], normalized: what CLIP's vision tower reads."""
    _, h, w, _ = pixels.shape
    rh, rw = processing.resized_size(h, w)
    x = pixels.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST  # the sums must keep float32's bits: bf16 passes would move pixels by several
    if rw != w:  # PIL skips a pass whose size does not change
        x = _round_clip_8bit(jnp.einsum("bhwc,wo->bhoc", x, jnp.asarray(resize_matrix(w, rw)), precision=hi))
    if rh != h:
        x = _round_clip_8bit(jnp.einsum("bhwc,ho->bowc", x, jnp.asarray(resize_matrix(h, rh)), precision=hi))
    top, left = (rh - processing.crop_height) // 2, (rw - processing.crop_width) // 2
    if top < 0 or left < 0:
        raise ValueError(f"a {h}x{w} image resized to {rh}x{rw} is smaller than the crop "
                         f"{processing.crop_height}x{processing.crop_width}")
    x = x[:, top:top + processing.crop_height, left:left + processing.crop_width]
    mean, std = jnp.asarray(processing.mean, jnp.float32), jnp.asarray(processing.std, jnp.float32)
    return (x / 255.0 - mean) / std
