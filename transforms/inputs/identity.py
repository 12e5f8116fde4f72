"""Request ids and seeds: a given id is checked (1-256 printable characters, kept exactly as given; its image files
get a safe form of it, transforms/layout.py `image_stem`), a missing one derived from the request's content, a
missing seed from the job's `--seed` and the id; so a rerun of the same input gives the same names and the same
pixels.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any, Mapping

from model import show

from .coercion import InvalidRecord, type_name

MAX_ID_CHARS = 256
# Unicode categories an id may not hold: controls (NUL, tab, newline, DEL, C1), format characters (zero-width,
# bidirectional controls), lone surrogates (no UTF-8 form), private use, unassigned, line and paragraph separators.
# Everything else is printable: letters, marks, digits, punctuation, symbols and spaces.
UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
ID_RULE = f"1-{MAX_ID_CHARS} printable characters"


def _canonical(params: Mapping[str, Any]) -> bytes:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def derive_id(prompt: str, height: int, width: int, num_inference_steps, guidance_scale, num_images: int,
              seed: int | None, reference_images: tuple[str, ...] = (), lora: str = "") -> str:
    """A stable id from the prompt and the (defaults-applied) parameters: same content -> same id, every run.
    The references' URIs (as resolved) count when there are any: other references, another request."""
    params = {"prompt": prompt, "height": height, "width": width, "num_inference_steps": num_inference_steps,
              "guidance_scale": guidance_scale, "num_images": num_images}
    if seed is not None:
        params["seed"] = seed
    if reference_images:
        params["reference_images"] = list(reference_images)
    if lora:  # another adapter, another request
        params["lora"] = lora
    return hashlib.sha256(_canonical(params)).hexdigest()[:20]


def derive_seed(base_seed: int, request_id: str) -> int:
    """A seed from the job's `--seed` and the request id, in [0, 2**32)."""
    digest = hashlib.sha256(f"{base_seed}/{request_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big")


def unprintable(text: str) -> str | None:
    """The first character of `text` an id may not hold, or None."""
    for ch in text:
        if unicodedata.category(ch) in UNPRINTABLE_CATEGORIES:
            return ch
    return None


def validate_id(value: Any) -> str:
    """A record's id as the request's id: a string (or an integer, as its decimal text) of 1-256 printable
    characters, not blank; kept exactly as given. InvalidRecord naming what is wrong otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidRecord(f"id must be a string, got {type_name(value)} {show(value)}", field="id", value=value)
    if isinstance(value, int) and abs(value) >= 10 ** MAX_ID_CHARS:
        raise InvalidRecord(f"id must be {ID_RULE}, got {show(value)}", field="id", value=value)
    text = str(value)
    if not text.strip():
        raise InvalidRecord(f"id must be {ID_RULE}, got {'an empty' if not text else 'a blank'} id {show(text)}",
                            field="id", value=value)
    if len(text) > MAX_ID_CHARS:
        raise InvalidRecord(f"id must be {ID_RULE}, got {len(text)} characters: {show(text, 60)}", field="id",
                            value=value)
    bad = unprintable(text)
    if bad is not None:
        raise InvalidRecord(f"id must be {ID_RULE}, got U+{ord(bad):04X} ({unicodedata.category(bad)}, not "
                            f"printable) in {show(text)}", field="id", value=value)
    return text
