"""Image encoding, the one place that turns pixels into stored bytes: PNG (text chunks), WebP and JPEG (EXIF), and
the text every image carries (prompt, seed, steps, guidance, model, its identity record, references).

The bytes depend only on the pixels, the image's text and the encoding options, never on the thread that encodes
them, so a retried bundle writes the same bytes again. Every sink encodes through `ImageEncoding.encode`; a resumed
job reads an image's text back with `read_image_text`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json

import numpy as np

from .. import layout
from ..identity import ImageIdentity, ModelIdentity
# --image_format choices and the encoders' defaults live in layout (light enough for the option table)
from ..layout import DEFAULT_PNG_COMPRESS_LEVEL, DEFAULT_QUALITY, IMAGE_FORMATS
from ..provenance import PNG_XMP_KEY

PNG_SOFTWARE = "flux2-klein-beam"
MIME_TYPES = {"png": "image/png", "webp": "image/webp", "jpeg": "image/jpeg"}
PIL_FORMATS = {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}
EXIF_IMAGE_DESCRIPTION = 0x010E  # WebP/JPEG: the PNG text chunks as one JSON object, in this EXIF tag
EXIF_SOFTWARE = 0x0131
JPEG_MAX_EXIF_BYTES = 65_000  # a JPEG APP1 segment holds at most 65,533 bytes of EXIF


def png_text(task, *, num_inference_steps: int, guidance_scale: float, model: str,
             prompt_truncated: bool | None = None, model_identity: ModelIdentity | str | None = None) -> dict[str, str]:
    """The text an image of `task` carries (PNG text chunks; WebP/JPEG EXIF): prompt, seed, steps, guidance and
    model (plus the id, size, whether the prompt was truncated and the image's identity, transforms/identity.py:
    the request's and the model's fingerprints, the model's dtype and quantization), all as strings; a resumed job
    rebuilds an image's manifest row from them. `model_identity`: the job's model (a bare fingerprint: only that)."""
    r = task.request
    text = {
        "prompt": r.prompt,
        "seed": str(task.seed),
        "num_inference_steps": str(int(num_inference_steps)),
        "guidance_scale": repr(float(guidance_scale)),
        "model": model,
        "id": r.id,
        "height": str(r.height),
        "width": str(r.width),
        "Software": PNG_SOFTWARE,
        **ImageIdentity.of(task, model_identity).text(),
    }
    if prompt_truncated is not None:
        text["prompt_truncated"] = "true" if prompt_truncated else "false"
    if r.reference_images:
        text["reference_images"] = reference_text(r)
    return text


def reference_text(request) -> str:
    """An image-conditioned request's references as its image text carries them: JSON [{uri, sha256}, ...]."""
    return json.dumps(request.reference_entries(), ensure_ascii=False, separators=(",", ":"))


def generated_text(generated, model_identity: ModelIdentity | str | None = None) -> dict[str, str]:
    """The text of a GeneratedImage (transforms/inference.py): what its generate call reported."""
    return png_text(generated.task, num_inference_steps=generated.num_inference_steps,
                    guidance_scale=generated.guidance_scale, model=generated.model,
                    prompt_truncated=generated.prompt_truncated, model_identity=model_identity)


def image_xmp(generated, model_identity: ModelIdentity | str | None = None) -> str:
    """The provenance XMP of a GeneratedImage (transforms/provenance.py): AI-made, by its model, and the
    fingerprints of its identity record (transforms/identity.py), the same the image's text carries."""
    from ..provenance import xmp_packet

    identity = ImageIdentity.of(generated.task, model_identity)
    return xmp_packet(model=generated.model, request_fingerprint=identity.request_fingerprint,
                      model_fingerprint=identity.model.model_fingerprint, image_id=generated.task.request.id)


def encode_png(pixels: np.ndarray, text: dict[str, str] | None = None,
               compress_level: int | None = None) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes with `text` as iTXt chunks (UTF-8); deterministic for the same input.
    `compress_level` (zlib, 0-9) defaults to DEFAULT_PNG_COMPRESS_LEVEL."""
    return ImageEncoding("png", DEFAULT_PNG_COMPRESS_LEVEL if compress_level is None else compress_level) \
        .encode(pixels, text)


@dataclasses.dataclass(frozen=True)
class ImageEncoding:
    """How images are stored: `format` (png, webp, jpeg), zlib level of PNG, quality (1-100) of WebP and JPEG."""

    format: str = "png"
    png_compress_level: int = DEFAULT_PNG_COMPRESS_LEVEL
    quality: int = DEFAULT_QUALITY
    c2pa: object = None  # a transforms.c2pa_signing.C2paSigner (--c2pa_cert/--c2pa_key), or None: no C2PA

    def __post_init__(self):
        if self.format not in IMAGE_FORMATS:
            raise ValueError(f"--image_format={self.format!r} is not one of {', '.join(IMAGE_FORMATS)}")
        if isinstance(self.png_compress_level, bool) or not isinstance(self.png_compress_level, int) \
                or not 0 <= self.png_compress_level <= 9:
            raise ValueError(f"--png_compress_level={self.png_compress_level!r} is not an integer from 0 to 9")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ValueError(f"--quality={self.quality!r} is not an integer from 1 to 100")

    @property
    def mime_type(self) -> str:
        return MIME_TYPES[self.format]

    @property
    def extension(self) -> str:
        """The stored files' extension (png, webp, jpg)."""
        return layout.IMAGE_EXTENSIONS[self.format]

    def stored_name(self, file_name: str) -> str:
        """A task's file name with this format's extension."""
        return layout.stored_image_name(file_name, self.format)

    def encode(self, pixels: np.ndarray, text: dict[str, str] | None = None, xmp: str | None = None) -> bytes:
        """uint8 [H, W, 3] -> bytes of this format carrying `text` (PNG: iTXt chunks; WebP/JPEG: EXIF, see
        `exif_description`) and the XMP packet `xmp` (transforms/provenance.py: PNG's XML:com.adobe.xmp iTXt chunk,
        the WebP/JPEG XMP chunk); the same input gives the same bytes, whichever thread encodes it."""
        from PIL import Image, PngImagePlugin

        pixels = np.asarray(pixels)
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
            raise ValueError(f"expected uint8 [H, W, 3] pixels, got {pixels.dtype} {pixels.shape}")
        image = Image.fromarray(pixels, mode="RGB")
        buf = io.BytesIO()
        if self.format == "png":
            info = PngImagePlugin.PngInfo()
            for key, value in (text or {}).items():
                info.add_itxt(key, value)
            if xmp:
                info.add_itxt(PNG_XMP_KEY, xmp)
            image.save(buf, format="PNG", pnginfo=info, compress_level=self.png_compress_level)
        else:
            exif = Image.Exif()
            exif[EXIF_IMAGE_DESCRIPTION] = exif_description(text or {}, jpeg=self.format == "jpeg")
            exif[EXIF_SOFTWARE] = PNG_SOFTWARE
            extra = {"xmp": xmp.encode("utf-8")} if xmp else {}
            image.save(buf, format=PIL_FORMATS[self.format], quality=self.quality, exif=exif.tobytes(), **extra)
        return buf.getvalue()


def exif_description(text: dict[str, str], *, jpeg: bool = False) -> str:
    """The image's text (png_text) as the EXIF ImageDescription of a WebP or JPEG: one JSON object, ASCII-escaped
    (EXIF text is ASCII) so every prompt round-trips. A JPEG's EXIF is capped at 64 KiB: when the prompt does not
    fit, `prompt_sha256` stands in for it (the manifest row still has the whole prompt)."""
    out = json.dumps(text, ensure_ascii=True, sort_keys=True)
    if jpeg and len(out) > JPEG_MAX_EXIF_BYTES and "prompt" in text:
        short = dict(text)
        short["prompt_sha256"] = hashlib.sha256(short.pop("prompt").encode("utf-8")).hexdigest()
        out = json.dumps(short, ensure_ascii=True, sort_keys=True)
    return out


# Image text keys written by earlier versions beside today's (the same values): read when today's key is absent.
EARLIER_TEXT_KEYS = {"num_inference_steps": "steps", "guidance_scale": "guidance"}


def read_image_text(image) -> dict[str, str]:
    """The text an open PIL image carries: PNG text chunks, or the JSON of a WebP/JPEG EXIF ImageDescription; a
    key an earlier version spelled otherwise (EARLIER_TEXT_KEYS) under today's name."""
    if image.format == "PNG":
        text = dict(getattr(image, "text", {}) or {})
    else:
        raw = image.getexif().get(EXIF_IMAGE_DESCRIPTION)
        try:
            found = json.loads(raw) if raw else {}
        except ValueError:
            found = {}
        text = {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
    for key, earlier in EARLIER_TEXT_KEYS.items():
        if key not in text and earlier in text:
            text[key] = text[earlier]
    return text
