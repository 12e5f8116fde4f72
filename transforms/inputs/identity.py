"""Request ids and seeds: a given id is checked (it names the request's image files), a missing one derived from the
request's content, a missing seed from the job's `--seed` and the id; so a rerun of the same input gives the same
names and the same pixels.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping

from model.contract import show

from .coercion import InvalidRecord, type_name

ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")


def _canonical(params: Mapping[str, Any]) -> bytes:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def derive_id(prompt: str, height: int, width: int, num_inference_steps, guidance_scale, num_images: int,
              seed: int | None, reference_images: tuple[str, ...] = ()) -> str:
    """A stable id from the prompt and the (defaults-applied) parameters: same content -> same id, every run.
    The references' URIs (as resolved) count when there are any: other references, another request."""
    params = {"prompt": prompt, "height": height, "width": width, "num_inference_steps": num_inference_steps,
              "guidance_scale": guidance_scale, "num_images": num_images}
    if seed is not None:
        params["seed"] = seed
    if reference_images:
        params["reference_images"] = list(reference_images)
    return hashlib.sha256(_canonical(params)).hexdigest()[:20]


def derive_seed(base_seed: int, request_id: str) -> int:
    """A seed from the job's `--seed` and the request id, in [0, 2**32)."""
    digest = hashlib.sha256(f"{base_seed}/{request_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big")


def validate_id(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidRecord(f"id must be a string, got {type_name(value)} {show(value)}", field="id", value=value)
    text = str(value)
    if not ID_PATTERN.match(text):
        raise InvalidRecord(f"id must match [A-Za-z0-9._-]{{1,128}}, got {show(text)}", field="id", value=value)
    if text.startswith("."):
        raise InvalidRecord(f"id must not start with a dot, got {text!r}", field="id", value=value)
    return text
