"""A record's generation fields -> a validated `GenerationRequest`, or the error row saying why not.

`RequestDefaults` is what a record that does not say gets (from the job's options) and the limits it is held to;
`validate_record` applies them, the types (transforms/inputs/coercion.py), model.contract's one validation of the
parameters, and the id and seed rules (transforms/inputs/identity.py). `parse_raw` does it for a record as read,
with its columns mapped (transforms/inputs/columns.py) and its other columns kept as metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from model import (
    DEFAULT_MAX_PIXELS, DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_REFERENCE_IMAGES, DEFAULT_MAX_REFERENCE_PIXELS,
    DEFAULT_SIZE, DEFAULT_SIZE_MULTIPLE, MAX_IMAGES_PER_REQUEST, Limits, RequestError, is_integer,
    validate as validate_request, validate_prompt, validate_seed,
)

from .. import layout, references
from ..defaults import DEFAULT_MAX_METADATA_BYTES, DEFAULT_NUM_IMAGES, DEFAULT_SEED
from ..requests import GenerationRequest
from .coercion import InvalidRecord, absent, as_float, as_int, as_references, contract_or_invalid, metadata_json
from .columns import ColumnError, ColumnMap, ColumnResolver
from .identity import MAX_ID_CHARS, derive_id, derive_seed, validate_id
from .json_values import to_json_value
from .records import RawRecord


@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    """What a record that does not say gets; from the pipeline options. `None` steps/guidance mean "the model's
    own default" (4 steps / no guidance for the distilled klein, 50 / 4.0 for the base), resolved at inference."""

    height: int = DEFAULT_SIZE
    width: int = DEFAULT_SIZE
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    num_images: int = DEFAULT_NUM_IMAGES
    seed: int = DEFAULT_SEED
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    # Heights and widths are multiples of this: the checkpoint's (PipelineConfig.size_multiple), which the launcher
    # reads from its configs, so that the job accepts exactly the sizes generate() accepts.
    size_multiple: int = DEFAULT_SIZE_MULTIPLE
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES  # a record's extra columns, as compact JSON
    max_reference_images: int = DEFAULT_MAX_REFERENCE_IMAGES  # references one record may list
    max_reference_pixels: int = DEFAULT_MAX_REFERENCE_PIXELS  # largest reference (width x height as stored)
    # The adapters a record may name in its `lora` column (--lora with --lora_per_record): (name, sha256, scale).
    loras: tuple[tuple[str, str, float], ...] = ()

    @property
    def reference_limits(self) -> references.ReferenceLimits:
        return references.ReferenceLimits(max_images=self.max_reference_images,
                                          max_pixels=self.max_reference_pixels)

    @property
    def limits(self) -> Limits:
        return Limits(size_multiple=self.size_multiple, max_pixels=self.max_pixels,
                               max_prompt_bytes=self.max_prompt_bytes, max_images=MAX_IMAGES_PER_REQUEST)

    def validate(self) -> "RequestDefaults":
        """Raise ValueError naming the option when a default could never give a valid request with this size
        multiple (the limits that need no checkpoint are checked with the options, pipeline/specs.py)."""
        smallest = self.size_multiple * self.size_multiple
        if not is_integer(self.max_pixels) or self.max_pixels < smallest:
            raise ValueError(f"--max_pixels must be an integer >= {smallest}, got {self.max_pixels!r}")
        probe = {"prompt": "x"}
        try:
            validate_record(probe, self, source="<options>", line=0)
        except InvalidRecord as e:
            raise ValueError(f"invalid default for --{e.field}: {e.reason}") from None
        try:
            validate_seed(self.seed)
        except RequestError as e:
            raise ValueError(f"--{e}") from None
        return self


def validate_record(fields: Mapping[str, Any], defaults: RequestDefaults, *, source: str, line: int | None,
                    text_values: bool = False, extra: Mapping[str, Any] | None = None) -> GenerationRequest:
    """Validate one record (generation fields by name: a JSON object's, or a CSV row's when `text_values`: every
    value is a string and empty means absent) into a request; raise InvalidRecord with the first problem found.
    `extra`: the record's other columns, kept as its metadata (bounded by --max_metadata_bytes)."""
    prompt = fields.get("prompt")
    if prompt is None or (text_values and prompt == ""):
        raise InvalidRecord("missing prompt", field="prompt", value=prompt)
    contract_or_invalid(validate_prompt, prompt, defaults.max_prompt_bytes)  # before the id, as before
    if not prompt.strip():
        raise InvalidRecord("prompt is empty", field="prompt", value=prompt)
    raw_id = fields.get("id")
    request_id = None if absent(raw_id, text_values) else validate_id(raw_id.strip() if text_values else raw_id)
    values = dict(height=as_int(fields, "height", defaults.height, text_values),
                  width=as_int(fields, "width", defaults.width, text_values),
                  num_inference_steps=as_int(fields, "num_inference_steps", defaults.num_inference_steps,
                                              text_values),
                  guidance_scale=as_float(fields, "guidance_scale", defaults.guidance_scale, text_values),
                  num_images=as_int(fields, "num_images", defaults.num_images, text_values),
                  seed=as_int(fields, "seed", None, text_values))
    valid = contract_or_invalid(lambda: validate_request(prompt=prompt, limits=defaults.limits, **values))
    prompt, height, width = valid.prompt, valid.height, valid.width
    steps, guidance, num_images, seed = valid.num_inference_steps, valid.guidance_scale, valid.num_images, valid.seed

    refs = as_references(fields, source, defaults.max_reference_images, text_values)
    lora = _lora(fields, defaults)

    if request_id is None:
        request_id = derive_id(prompt, height, width, steps, guidance, num_images, seed, refs, lora[0] if lora else "")
    if seed is None:
        seed = derive_seed(defaults.seed, request_id)
    metadata = metadata_json(extra, defaults.max_metadata_bytes) if extra else ""
    return GenerationRequest(id=request_id, prompt=prompt, seed=seed, height=height, width=width,
                             num_inference_steps=steps, guidance_scale=guidance, num_images=num_images,
                             source=source, line=line, metadata=metadata, reference_images=refs,
                             **({"lora": lora[0], "lora_sha256": lora[1], "lora_scale": lora[2]} if lora else {}))


def _lora(fields: Mapping[str, Any], defaults: RequestDefaults) -> tuple | None:
    """The job's adapter the record's `lora` column names, (name, sha256, scale); None when it names none (missing,
    null or empty); InvalidRecord naming the value and the adapters the job has otherwise."""
    value = fields.get("lora")
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise InvalidRecord(f"lora must be the name of one of the job's adapters, got a {type(value).__name__}",
                            field="lora", value=value)
    name = value.strip()
    for adapter in defaults.loras:
        if adapter[0] == name:
            return adapter
    have = (f"the job's adapters are {[a[0] for a in defaults.loras]}" if defaults.loras else
            "the job has no per-record adapters (--lora NAME=SOURCE with --lora_per_record)")
    raise InvalidRecord(f"unknown LoRA adapter {name!r}: {have}", field="lora", value=name)


def parse_raw(raw: RawRecord, defaults: RequestDefaults, resolver: ColumnResolver | None = None
              ) -> GenerationRequest | dict:
    """A request, or the error row explaining why this record is rejected. `resolver` maps the columns of records
    whose reader does not know them for the whole file (JSONL, BigQuery); default: the standard column names."""
    if raw.error is not None:
        return raw.error
    resolved = raw.columns or (resolver or ColumnResolver(ColumnMap())).resolve(raw.fields.keys())
    if isinstance(resolved, ColumnError):
        return layout.error_row(source=raw.source, line=raw.line, reason=resolved.reason, record=_record_text(raw),
                                field=resolved.field)
    fields, extra = resolved.split(raw.fields)
    try:
        return validate_record(fields, defaults, source=raw.source, line=raw.line, text_values=raw.text_values,
                               extra=extra)
    except InvalidRecord as e:
        return layout.error_row(source=raw.source, line=raw.line, reason=e.reason, record=_record_text(raw),
                                id=_given_id(fields, raw.text_values), field=e.field, value=e.value, kind=e.kind)


def _given_id(fields: Mapping[str, Any], text_values: bool) -> str | None:
    """The record's id as given (a string or an integer, as text; cut and escaped to be writable when it is too
    long or not valid Unicode), so that an error row names the record by it; None when the record has none. The
    row's source and line say where the record is either way."""
    rid = fields.get("id")
    if isinstance(rid, str) and text_values:
        rid = rid.strip()
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return None
    if isinstance(rid, int) and abs(rid) >= 10 ** MAX_ID_CHARS:
        return None
    return layout.truncate_record(str(rid), MAX_ID_CHARS)


def _record_text(raw: RawRecord):
    """What an error row shows of the record: as written in its file when known, else its columns."""
    if raw.text is not None:
        return raw.text
    return {str(k): to_json_value(v) for k, v in raw.fields.items()}
