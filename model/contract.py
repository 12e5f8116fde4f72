"""The request contract: the limits of a generation request and the one validation of its parameters.

`generate()` and the batch job's record validation both call `validate`, with the size multiple read from the
checkpoint's configs (`PipelineConfig.size_multiple`), so the two can never disagree on what is a valid request.
Pure Python and numpy (no JAX): the job's readers and its launcher import it without loading the model stack.
Messages name the argument or the limit by its field (`max_pixels=4096`), never a command-line flag: the job names
its own options when it reports them (transforms/inputs/coercion.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import RequestError

# Seeds are numpy PCG64 seeds in [0, 2**63) (model.engine.noise); image j of a request uses seed + j.
MAX_SEED = 2**63
# The programs take guidance as float32: a larger value would become infinity there (and black images).
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The flow-matching schedule has 1000 training timesteps; more sampling steps than that is never meaningful.
MAX_STEPS = 1000
# The published klein VAE (8x) with the transformer's 2x2 latent patch; a checkpoint's own value comes from its
# configs (PipelineConfig.size_multiple). This default only serves callers that have no checkpoint at hand.
DEFAULT_SIZE_MULTIPLE = 16
# Height and width when none is given: FLUX.2 [klein]'s native resolution.
DEFAULT_SIZE = 1024
# 4 megapixels (2048 x 2048), the largest output FLUX.2 is documented for.
DEFAULT_MAX_PIXELS = 2048 * 2048
# A prompt is text for a 512-token encoder, a PNG text chunk and a manifest row: 64 KiB of UTF-8 is far more than
# any real prompt and keeps one record from blowing up every row it is copied into.
DEFAULT_MAX_PROMPT_BYTES = 64 * 1024
# Images one request of the job may ask for (generate()'s num_images_per_prompt has no such limit).
MAX_IMAGES_PER_REQUEST = 64
# Text-encoder tokens per prompt, as diffusers' Flux2KleinPipeline; longer prompts are truncated.
DEFAULT_MAX_SEQUENCE_LENGTH = 512


def is_integer(value) -> bool:
    """A Python or numpy integer, and not a bool (True is an int in Python, never a count or a seed here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def optional_count(name: str, value) -> int | None:
    """`value` as int if it is None or an integer >= 1 (a size, a number of things), else ValueError naming it."""
    if value is not None and (not is_integer(value) or value < 1):
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
    return None if value is None else int(value)


def count(name: str, value) -> int:
    """`value` as int if it is an integer >= 1, else ValueError naming it (batch sizes, sequence lengths)."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request may ask for. `size_multiple` is the checkpoint's; None for a limit means none."""

    size_multiple: int = DEFAULT_SIZE_MULTIPLE
    max_pixels: int | None = None
    max_prompt_bytes: int | None = None
    max_images: int | None = None


@dataclasses.dataclass(frozen=True)
class ValidRequest:
    """Validated generation parameters; `num_inference_steps`/`guidance_scale` None = the model's defaults."""

    prompt: str
    seed: int | None
    height: int
    width: int
    num_inference_steps: int | None
    guidance_scale: float | None
    num_images: int


def _fail(field: str, message: str, value) -> RequestError:
    return RequestError(message, field=field, value=value)


def nearest_valid_sizes(value: int, multiple: int) -> tuple[int, ...]:
    low = (value // multiple) * multiple
    return tuple(v for v in (low, low + multiple) if v > 0)


def validate_size(name: str, value, multiple: int) -> int:
    """A height/width must be a positive multiple of `multiple`; otherwise RequestError naming value and fixes."""
    if not is_integer(value) or value <= 0 or value % multiple:
        if is_integer(value) and value > 0:
            hint = f"; nearest valid sizes: {list(nearest_valid_sizes(int(value), multiple))}"
        else:
            hint = f"; use a positive multiple of {multiple} such as {multiple * 64}"
        raise _fail(name, f"{name} must be a positive multiple of {multiple}, got {show(value)}{hint}", value)
    return int(value)


def validate_seed(seed, num_images: int = 1) -> int:
    """`seed` as int if it is an integer with seed + num_images - 1 < 2**63 (image j uses seed + j)."""
    if not is_integer(seed):
        raise _fail("seed", f"seed must be an integer in [0, 2**63), got {show(seed)}", seed)
    seed = int(seed)
    if not 0 <= seed <= MAX_SEED - num_images:
        room = "2**63" if num_images == 1 else "2**63 - num_images + 1"
        raise _fail("seed", f"seed must be a non-negative integer below {room}, got {show(seed)}", seed)
    return seed


def validate_prompt(prompt, max_bytes: int | None = None) -> str:
    """A prompt is a string with a UTF-8 form (no lone surrogates) of at most `max_bytes` bytes."""
    if not isinstance(prompt, str):
        raise _fail("prompt", f"prompt must be a string, got {type(prompt).__name__} {show(prompt)}", prompt)
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError as e:  # JSON can spell a lone surrogate ("\ud800"); it has no UTF-8 form
        raise _fail("prompt", f"prompt is not valid Unicode text: lone surrogate U+{ord(prompt[e.start]):04X} at "
                              f"character {e.start}",
                    prompt.encode("utf-8", "backslashreplace").decode("utf-8")) from None
    if max_bytes is not None and size > max_bytes:
        raise _fail("prompt", f"prompt is {size} bytes (UTF-8), above max_prompt_bytes={max_bytes}", prompt)
    return prompt


def validate_steps(steps) -> int | None:
    if steps is None:
        return None
    if not is_integer(steps):
        raise _fail("num_inference_steps", f"num_inference_steps must be an integer in [1, {MAX_STEPS}], got "
                                           f"{show(steps)}", steps)
    if not 1 <= steps <= MAX_STEPS:
        raise _fail("num_inference_steps", f"num_inference_steps must be in [1, {MAX_STEPS}], got {show(steps)}",
                    steps)
    return int(steps)


def validate_guidance(guidance) -> float | None:
    """A finite number in [0, largest float32]; -0.0 becomes 0.0 (the same request, the same derived id)."""
    if guidance is None:
        return None
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float, np.integer, np.floating)):
        raise _fail("guidance_scale", f"guidance_scale must be a number, got {show(guidance)}", guidance)
    value = float(guidance)
    if not np.isfinite(value):
        raise _fail("guidance_scale", f"guidance_scale must be a finite number, got {show(guidance)}", guidance)
    if value < 0:
        raise _fail("guidance_scale", f"guidance_scale must be >= 0, got {value}", value)
    if value > FLOAT32_MAX:
        raise _fail("guidance_scale", f"guidance_scale must be at most {FLOAT32_MAX:.7g} (the largest float32), got "
                                      f"{value}", value)
    return value + 0.0


def validate_num_images(num_images, limit: int | None = None, name: str = "num_images") -> int:
    top = "" if limit is None else f", {limit}"
    if not is_integer(num_images) or num_images < 1 or (limit is not None and num_images > limit):
        raise _fail(name, f"{name} must be {'an integer >= 1' if limit is None else 'in [1' + top + ']'}, got "
                          f"{show(num_images)}", num_images)
    return int(num_images)


def validate(*, prompt, height, width, num_inference_steps=None, guidance_scale=None, num_images=1, seed=None,
             limits: Limits = Limits()) -> ValidRequest:
    """The one validation of a generation request; raises RequestError (with `field` and `value`) at the first
    problem, checked in this order: prompt, height, width, pixels, steps, guidance, number of images, seed."""
    prompt = validate_prompt(prompt, limits.max_prompt_bytes)
    height = validate_size("height", height, limits.size_multiple)
    width = validate_size("width", width, limits.size_multiple)
    if limits.max_pixels is not None:
        for name, v in (("height", height), ("width", width)):
            if v > limits.max_pixels:  # checked alone first: the product of two huge values is not even printable
                raise _fail(name, f"{name} = {show(v)} is above max_pixels={limits.max_pixels}", v)
        if height * width > limits.max_pixels:
            raise _fail("height", f"height x width = {height}x{width} = {height * width} pixels is above "
                                  f"max_pixels={limits.max_pixels}", [height, width])
    steps = validate_steps(num_inference_steps)
    guidance = validate_guidance(guidance_scale)
    num_images = validate_num_images(num_images, limits.max_images)
    if seed is not None:
        seed = validate_seed(seed, num_images)
    return ValidRequest(prompt=prompt, seed=seed, height=height, width=width, num_inference_steps=steps,
                        guidance_scale=guidance, num_images=num_images)


def show(value, limit: int = 200) -> str:
    """A value for a message: repr, cut to `limit` characters (never huge, never raising)."""
    if is_integer(value) and int(value).bit_length() > 256:
        return f"an integer of about {int(int(value).bit_length() * 0.30103)} digits"
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


# --------------------------------------------------------------------------------------------- reference images
# Image-conditioned generation (multi-reference editing): the job's limits on what a record may ask for. The
# model's own checks of a reference (sides, aspect ratio) are model/engine/reference_preprocess.py.
# References one job request may give (diffusers has no limit; every reference adds its tokens to the joint
# attention sequence, up to 4096 per 1 MP reference, so a few are already the cost of a larger image).
DEFAULT_MAX_REFERENCE_IMAGES = 4
# Largest reference the job decodes (width x height as stored, before the model resizes it to 1 MP): 16.7 MP, more
# than any camera photo up to 4096 x 4096, and 64 MiB as RGBA; a file declaring more is refused before decoding.
DEFAULT_MAX_REFERENCE_PIXELS = 4096 * 4096


def validate_reference_count(count_, limit: int | None = None) -> int:
    """The number of references of one request: at most `limit` (the job's max_reference_images)."""
    if limit is not None and count_ > limit:
        raise _fail("reference_images", f"reference_images lists {count_} images, above max_reference_images="
                                        f"{limit}", count_)
    return int(count_)
