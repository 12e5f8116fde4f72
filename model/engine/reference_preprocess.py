"""Reference images of image-conditioned generation (klein's multi-reference editing), prepared on the host.

JAX-free, so the job can bucket requests by `reference_signature` without loading the model. Each reference goes
the way diffusers' Flux2KleinPipeline takes it (the parity reference):
1. checks: each side at least MIN_SIDE pixels, aspect ratio at most MAX_ASPECT;
2. over MAX_AREA pixels: resized (PIL LANCZOS, in the image's own mode: a palette image with its palette, RGBA with
   alpha) to about MAX_AREA, each side int()-truncated;
3. centre-cropped (no resize) to multiples of the checkpoint's size multiple (VAE scale x latent patch);
4. converted to RGB, scaled to [-1, 1] float32.
Numpy arrays (uint8 HxWx3 or HxWx4) become PIL images first (RGB or RGBA) and follow the same path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

from ..contract import DEFAULT_SIZE_MULTIPLE
from ..errors import ReferenceImageError

MIN_SIDE = 64               # diffusers' check_image_input: min_side_length
MAX_ASPECT = 8              # ... max_aspect_ratio
MAX_AREA = 1024 * 1024      # the pipeline's _resize_to_target_area cap (pixels)

Signature = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessedReference:
    """One reference ready for the VAE encoder: float32 [H, W, 3] pixels in [-1, 1] and a digest of them (equal
    digests = the same encoder input, encoded once)."""

    pixels: np.ndarray
    digest: str

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) in pixels."""
        return self.pixels.shape[0], self.pixels.shape[1]


def _pil():
    import PIL.Image

    return PIL.Image


def _pixel_size(image, index=None, prompt_index=None) -> tuple[int, int]:
    """(width, height) of a PIL image or a uint8 HxWx3 / HxWx4 array, checked for type, dtype and shape."""
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] not in (3, 4):
            raise ReferenceImageError("a reference array must be H x W x 3 (RGB) or H x W x 4 (RGBA)",
                                      reason="shape", index=index, prompt_index=prompt_index, value=image.shape)
        if image.dtype != np.uint8:
            raise ReferenceImageError("a reference array must be uint8", reason="dtype", index=index,
                                      prompt_index=prompt_index, value=str(image.dtype))
        return image.shape[1], image.shape[0]
    if isinstance(image, _pil().Image):
        return image.size
    raise ReferenceImageError("a reference must be a PIL image or a uint8 numpy array", reason="type", index=index,
                              prompt_index=prompt_index, value=type(image).__name__)


def check_size(width: int, height: int, index=None, prompt_index=None) -> None:
    """diffusers' check_image_input: both sides >= MIN_SIDE, aspect ratio <= MAX_ASPECT."""
    if width < MIN_SIDE or height < MIN_SIDE:
        raise ReferenceImageError(f"a reference image must be at least {MIN_SIDE} px on each side, got "
                                  f"{width}x{height}", reason="too_small", index=index, prompt_index=prompt_index,
                                  value=(width, height))
    ratio = max(width / height, height / width)
    if ratio > MAX_ASPECT:
        raise ReferenceImageError(f"a reference image's aspect ratio must be at most {MAX_ASPECT}:1, got "
                                  f"{width}x{height} ({ratio:.2f}:1)", reason="aspect_ratio", index=index,
                                  prompt_index=prompt_index, value=ratio)


def capped_size(width: int, height: int, max_area: int = MAX_AREA) -> tuple[int, int]:
    """(width, height) after the area cap: unchanged up to `max_area` pixels, else scaled by sqrt(max_area / area)
    with each side truncated by int(), as diffusers' _resize_to_target_area."""
    if width * height <= max_area:
        return width, height
    scale = math.sqrt(max_area / (width * height))
    return int(width * scale), int(height * scale)


def processed_size(width: int, height: int, size_multiple: int = DEFAULT_SIZE_MULTIPLE) -> tuple[int, int]:
    """(height, width) the encoder sees for a reference of `width` x `height` pixels: area cap, then each side
    down to a multiple of `size_multiple`."""
    w, h = capped_size(width, height)
    return h // size_multiple * size_multiple, w // size_multiple * size_multiple


def reference_signature(images, size_multiple: int = DEFAULT_SIZE_MULTIPLE) -> Signature:
    """The processed (height, width) of each reference, in order: what the compiled programs are specialised on
    (their reference token counts). Requests with equal signatures can share a batch. Pure and cheap (reads the
    sizes only); raises ReferenceImageError for an image that `preprocess` would refuse. `size_multiple` is the
    checkpoint's (`PipelineConfig.size_multiple`, `Flux2KleinGenerator.size_multiple`)."""
    out = []
    for i, image in enumerate(images or ()):
        width, height = _pixel_size(image, i)
        check_size(width, height, i)
        out.append(processed_size(width, height, size_multiple))
    return tuple(out)


def to_pil(image, index=None, prompt_index=None):
    """A PIL image of a reference: PIL images as they are, uint8 arrays as RGB (HxWx3) or RGBA (HxWx4)."""
    _pixel_size(image, index, prompt_index)
    if isinstance(image, np.ndarray):
        return _pil().fromarray(np.ascontiguousarray(image))  # uint8 HxWx3 -> RGB, HxWx4 -> RGBA
    return image


def preprocess(image, size_multiple: int = DEFAULT_SIZE_MULTIPLE, index=None, prompt_index=None) -> \
        ProcessedReference:
    """One reference as the encoder takes it (see the module docstring for the steps)."""
    PIL = _pil()
    img = to_pil(image, index, prompt_index)
    width, height = img.size
    check_size(width, height, index, prompt_index)
    new_w, new_h = capped_size(width, height)
    if (new_w, new_h) != (width, height):
        img = img.resize((new_w, new_h), PIL.Resampling.LANCZOS)  # in the image's own mode, as diffusers
    out_h, out_w = new_h // size_multiple * size_multiple, new_w // size_multiple * size_multiple
    if out_h < size_multiple or out_w < size_multiple:  # only for a size multiple above MIN_SIDE
        raise ReferenceImageError(f"a reference image must be at least {size_multiple} px on each side",
                                  reason="too_small", index=index, prompt_index=prompt_index, value=(width, height))
    left, top = (new_w - out_w) // 2, (new_h - out_h) // 2
    rgb = np.ascontiguousarray(np.asarray(img.crop((left, top, left + out_w, top + out_h)).convert("RGB")))
    digest = hashlib.sha256(rgb.tobytes()).hexdigest()
    pixels = 2.0 * (rgb.astype(np.float32) / 255.0) - 1.0  # diffusers' pil_to_numpy then normalize, in float32
    return ProcessedReference(pixels=pixels, digest=f"{out_h}x{out_w}:{digest}")


def preprocess_all(reference_images, num_prompts: int, size_multiple: int = DEFAULT_SIZE_MULTIPLE) -> \
        tuple[tuple[ProcessedReference, ...], ...] | None:
    """Every prompt's references processed, one tuple per prompt; None when there are none at all (text-to-image).

    Every prompt must have the same signature (the compiled programs take one reference token count per call): a
    prompt whose processed sizes differ from the first prompt's raises ReferenceImageError(reason="signature")."""
    if reference_images is None:
        return None
    if isinstance(reference_images, (str, bytes, np.ndarray)) or not hasattr(reference_images, "__len__"):
        raise ReferenceImageError("reference_images must be one list of references per prompt", reason="type",
                                  value=type(reference_images).__name__)
    if len(reference_images) != num_prompts:
        raise ReferenceImageError(f"reference_images must hold one list per prompt: got {len(reference_images)} "
                                  f"lists for {num_prompts} prompts", reason="count", value=len(reference_images))
    lists = []
    for p, refs in enumerate(reference_images):
        if refs is None:
            refs = ()
        if isinstance(refs, np.ndarray) or not isinstance(refs, (list, tuple)):
            raise ReferenceImageError("each prompt's references must be a list (of PIL images or uint8 arrays)",
                                      reason="type", prompt_index=p, value=type(refs).__name__)
        lists.append(list(refs))
    if not any(lists):
        return None
    processed = tuple(tuple(preprocess(img, size_multiple, i, p) for i, img in enumerate(refs))
                      for p, refs in enumerate(lists))
    first = tuple(r.size for r in processed[0])
    for p, refs in enumerate(processed):
        sig = tuple(r.size for r in refs)
        if sig != first:
            raise ReferenceImageError(f"all prompts of one call must have references of the same processed sizes; "
                                      f"prompt 0 has {first}, this one {sig} (group requests by "
                                      f"model.engine.reference_preprocess.reference_signature)", reason="signature",
                                      prompt_index=p, value=(first, sig))
    return processed
