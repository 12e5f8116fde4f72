"""Prompt records (JSONL, CSV/TSV with a header, Parquet, plain text) -> validated `GenerationRequest`s, or error rows.

Every record is validated into a typed request. A record that cannot be read or fails validation becomes one
error row (source file, line, offending value, reason) and never stops the job. A request without an `id` gets a
stable id derived from its prompt and parameters; without a `seed`, one derived from the job's `--seed` and the id,
so re-running the same input gives the same names and the same pixels. Columns are mapped to generation fields by
`transforms/columns.py`; every other column (or JSON key) is kept as the request's metadata, for its manifest rows.

Pure parsing and validation functions first (usable and testable without Beam), then the Beam transforms.
"""

from __future__ import annotations

import dataclasses
import decimal
import hashlib
import json
import logging
import math
import os
import re
from typing import Any, Iterable, Iterator, Mapping

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.metrics import Metrics

from model import contract
from model.contract import (  # noqa: F401  (the limits, re-exported for the job's callers)
    DEFAULT_MAX_PIXELS, DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_REFERENCE_IMAGES, DEFAULT_MAX_REFERENCE_PIXELS,
    DEFAULT_SIZE, DEFAULT_SIZE_MULTIPLE, MAX_IMAGES_PER_REQUEST, MAX_SEED, MAX_STEPS, show,
)
from model.errors import RequestError

from . import input_files, layout, references, retries
from .columns import FIELDS, ColumnError, ColumnMap, ColumnResolver, Resolved  # noqa: F401  (FIELDS re-exported)
from .defaults import DEFAULT_MAX_METADATA_BYTES
from .delimited import DEFAULT_FIELD_LIMIT as _CSV_DEFAULT_FIELD_LIMIT
from .delimited import field_limit_for as csv_field_limit_for
from .delimited import iter_delimited
from .input_formats import FORMATS, InputFormatError, detect_format, header_warning  # noqa: F401  (re-exported)
from .json_values import to_json_value
from .lines import MAX_LINE_BYTES, decoded_lines  # noqa: F401  (MAX_LINE_BYTES re-exported)
from .metrics import NAMESPACE as METRICS_NAMESPACE
from .parquet_input import iter_parquet
from .records import RawRecord, unreadable

logger = logging.getLogger(__name__)

ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")
# Records are flat objects; unknown fields may nest, but not without bound (a deep value would crash the JSON
# decoder, repr and json.dumps of the error row with RecursionError).
MAX_JSON_DEPTH = 64
# Every integer field is far below 2**64 (20 digits); longer digit strings are rejected without converting them
# (int() of more than 4300 digits raises).
_MAX_INT_DIGITS = 40


# --------------------------------------------------------------------------------------------- typed requests
@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    """What a record that does not say gets; from the pipeline options. `None` steps/guidance mean "the model's
    own default" (4 steps / no guidance for the distilled klein, 50 / 4.0 for the base), resolved at inference."""

    height: int = DEFAULT_SIZE
    width: int = DEFAULT_SIZE
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    num_images: int = 1
    seed: int = 0
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    # Heights and widths are multiples of this: the checkpoint's (PipelineConfig.size_multiple), which the launcher
    # reads from its configs, so that the job accepts exactly the sizes generate() accepts.
    size_multiple: int = DEFAULT_SIZE_MULTIPLE
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES  # a record's extra columns, as compact JSON
    max_reference_images: int = DEFAULT_MAX_REFERENCE_IMAGES  # references one record may list
    max_reference_pixels: int = DEFAULT_MAX_REFERENCE_PIXELS  # largest reference (width x height as stored)

    @property
    def reference_limits(self) -> references.ReferenceLimits:
        return references.ReferenceLimits(max_images=self.max_reference_images,
                                          max_pixels=self.max_reference_pixels)

    @property
    def limits(self) -> contract.Limits:
        return contract.Limits(size_multiple=self.size_multiple, max_pixels=self.max_pixels,
                               max_prompt_bytes=self.max_prompt_bytes, max_images=MAX_IMAGES_PER_REQUEST)

    def validate(self) -> "RequestDefaults":
        """Raise ValueError naming the option when a default could never give a valid request."""
        smallest = self.size_multiple * self.size_multiple
        if not contract.is_integer(self.max_pixels) or self.max_pixels < smallest:
            raise ValueError(f"--max_pixels must be an integer >= {smallest}, got {self.max_pixels!r}")
        contract.count("--max_prompt_bytes", self.max_prompt_bytes)
        if not contract.is_integer(self.max_metadata_bytes) or self.max_metadata_bytes < 0:
            raise ValueError(f"--max_metadata_bytes must be an integer >= 0, got {self.max_metadata_bytes!r}")
        contract.count("--max_reference_images", self.max_reference_images)
        from model.references import MIN_SIDE  # JAX-free

        smallest_reference = MIN_SIDE * MIN_SIDE
        if not contract.is_integer(self.max_reference_pixels) or self.max_reference_pixels < smallest_reference:
            raise ValueError(f"--max_reference_pixels must be an integer >= {smallest_reference} (64 x 64), got "
                             f"{self.max_reference_pixels!r}")
        probe = {"prompt": "x"}
        try:
            validate_record(probe, self, source="<options>", line=0)
        except InvalidRecord as e:
            raise ValueError(f"invalid default for --{e.field}: {e.reason}") from None
        try:
            contract.validate_seed(self.seed)
        except RequestError as e:
            raise ValueError(f"--{e}") from None
        return self


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One validated record: everything needed to generate its images and name them."""

    id: str
    prompt: str
    seed: int
    height: int
    width: int
    num_inference_steps: int | None
    guidance_scale: float | None
    num_images: int
    source: str = ""
    line: int | None = 0  # None where the source has no order (a BigQuery row)
    metadata: str = ""  # the record's extra columns as compact JSON ("" for none), for its manifest rows
    # Image-conditioned generation: the references' URIs (resolved, as read), and once the job has read them
    # (ResolveReferences) the sha256 of each file and each one's processed size (height, width), which batches share.
    reference_images: tuple[str, ...] = ()
    reference_sha256: tuple[str, ...] = ()
    reference_signature: tuple[tuple[int, int], ...] = ()

    def params(self) -> tuple:
        """What makes two records with the same id the same request (where they came from does not)."""
        return (self.prompt, self.seed, self.height, self.width, self.num_inference_steps, self.guidance_scale,
                self.num_images, self.reference_images)

    def with_references_read(self, sha256: tuple[str, ...], signature: tuple[tuple[int, int], ...]
                             ) -> "GenerationRequest":
        """This request once its references are read: each file's sha256 and processed size (id unchanged)."""
        if len(sha256) != len(self.reference_images) or len(signature) != len(self.reference_images):
            raise ValueError(f"request {self.id!r} has {len(self.reference_images)} references, got "
                             f"{len(sha256)} digests and {len(signature)} sizes")
        return dataclasses.replace(self, reference_sha256=tuple(sha256), reference_signature=tuple(signature))

    def reference_entries(self) -> list[dict]:
        """The references as the manifest and the image text carry them: [{uri, sha256}] ([] for none)."""
        return [{"uri": uri, "sha256": sha} for uri, sha in zip(self.reference_images, self.reference_sha256)]

    def tasks(self) -> list["ImageTask"]:
        return [ImageTask(self, j) for j in range(self.num_images)]

    def metadata_values(self) -> dict:
        """The extra columns by name, typed as read ({} when the record had none)."""
        return json.loads(self.metadata) if self.metadata else {}

    def position(self) -> tuple:
        """Where the record came from, as a sort key that never compares None with a number: the first of several
        records with one id is the one kept (rows without a line are ordered by their parameters)."""
        return self.source, -1 if self.line is None else self.line, repr(self.params())


@dataclasses.dataclass(frozen=True)
class ImageTask:
    """Image `index` of a request: the unit that is batched, generated and written."""

    request: GenerationRequest
    index: int

    @property
    def seed(self) -> int:
        return self.request.seed + self.index

    @property
    def file_name(self) -> str:
        return layout.image_file_name(self.request.id, self.index, self.request.num_images)

    @property
    def shape_key(self) -> str:
        """Batches never mix these: (height, width, steps, guidance, and the processed size of each reference, so
        that a batch's rows have the same reference token counts), as a deterministic string key."""
        r = self.request
        key = f"{r.height}x{r.width}/steps={r.num_inference_steps}/guidance={r.guidance_scale}"
        if r.reference_images:
            key += "/refs=" + ",".join(f"{h}x{w}" for h, w in r.reference_signature)
        return key


class InvalidRecord(ValueError):
    """A record that cannot become a request; `field`/`value` name the offending part."""

    def __init__(self, reason: str, *, field: str | None = None, value: Any = None):
        super().__init__(reason)
        self.reason = reason
        self.field = field
        self.value = value


# --------------------------------------------------------------------------------------------- validation
def _type_name(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    return {str: "string", bool: "boolean", int: "integer", float: "number", list: "array",
            type(None): "null"}.get(type(value), type(value).__name__)


def _absent(value: Any, text_values: bool) -> bool:
    return value is None or (text_values and isinstance(value, str) and value.strip() == "")


def _plain_number(value: Any) -> Any:
    """A decimal (BigQuery NUMERIC) as the int or float it holds; anything else as it is."""
    if isinstance(value, decimal.Decimal) and value.is_finite():
        if value.adjusted() > _MAX_INT_DIGITS or value != value.to_integral_value():
            return float(value)  # far out of every field's range, or a fraction: rejected as such
        return int(value)
    return value


def _as_int(fields: Mapping, name: str, default, text_values: bool):
    value = _plain_number(fields.get(name))
    if _absent(value, text_values):
        return default
    if text_values and isinstance(value, str):
        s = value.strip()
        if re.fullmatch(r"[+-]?\d+", s):
            sign = "-" if s.startswith("-") else ""
            digits = s.lstrip("+-").lstrip("0") or "0"
            if len(digits) > _MAX_INT_DIGITS:
                raise InvalidRecord(f"{name} must be an integer in range, got a {len(digits)}-digit number",
                                    field=name, value=value)
            return int(sign + digits)
        try:
            f = float(s)
        except ValueError:
            raise InvalidRecord(f"{name} must be an integer, got {show(value)}", field=name,
                                    value=value) from None
        if math.isfinite(f) and f.is_integer() and abs(f) < 2**53:
            return int(f)
        raise InvalidRecord(f"{name} must be an integer, got {show(value)}", field=name, value=value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRecord(f"{name} must be an integer, got {_type_name(value)} {show(value)}", field=name,
                            value=value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        raise InvalidRecord(f"{name} must be an integer, got {show(value)}", field=name, value=value)
    return value


def _as_float(fields: Mapping, name: str, default, text_values: bool):
    value = _plain_number(fields.get(name))
    if _absent(value, text_values):
        return default
    if text_values and isinstance(value, str):
        try:
            f = float(value.strip())
        except ValueError:
            raise InvalidRecord(f"{name} must be a number, got {show(value)}", field=name, value=value) from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRecord(f"{name} must be a number, got {_type_name(value)} {show(value)}", field=name,
                            value=value)
    else:
        f = float(value)
    if not math.isfinite(f):
        raise InvalidRecord(f"{name} must be a finite number, got {show(value)}", field=name, value=value)
    return f


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
        raise InvalidRecord(f"id must be a string, got {_type_name(value)} {show(value)}", field="id", value=value)
    text = str(value)
    if not ID_PATTERN.match(text):
        raise InvalidRecord(f"id must match [A-Za-z0-9._-]{{1,128}}, got {show(text)}", field="id", value=value)
    if text.startswith("."):
        raise InvalidRecord(f"id must not start with a dot, got {text!r}", field="id", value=value)
    return text


# The limits that model.contract's messages name by field (`above max_pixels=4096`) and the job sets with the option
# of that name: its error rows name the option (`above --max_pixels=4096`).
_OPTION_LIMITS = re.compile(r"(?<![\w-])(max_pixels|max_prompt_bytes|max_reference_images)=")


def contract_or_invalid(check, *args):
    """`check(*args)` (a model.contract validation), its RequestError turned into an InvalidRecord whose reason
    names the job's option for a limit."""
    try:
        return check(*args)
    except RequestError as e:
        raise InvalidRecord(_OPTION_LIMITS.sub(r"--\1=", str(e)), field=e.field, value=e.value) from None


def metadata_json(extra: Mapping[str, Any], limit: int) -> str:
    """A record's extra columns as compact JSON, typed as read ("" for none; an unnamed column, as a trailing
    delimiter makes, only when it holds something); InvalidRecord when above `limit` bytes or not encodable."""
    values = {str(k): to_json_value(v) for k, v in extra.items() if k != "" or v not in ("", None)}
    if not values:
        return ""
    text = json.dumps(values, ensure_ascii=False, separators=(",", ":"))
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # JSON can spell a lone surrogate; the manifest is UTF-8
        bad = next(k for k, v in values.items()
                   if not layout.utf8_encodable(json.dumps({k: v}, ensure_ascii=False)))
        raise InvalidRecord(f"extra column {bad!r} is not valid Unicode text (a lone surrogate)", field=bad,
                            value=values[bad]) from None
    if size > limit:
        sizes = {k: len(json.dumps(v, ensure_ascii=False).encode("utf-8")) for k, v in values.items()}
        largest = max(sizes, key=sizes.get)
        raise InvalidRecord(f"extra columns take {size} bytes as JSON, above --max_metadata_bytes={limit} (the "
                            f"largest: {largest!r}, {sizes[largest]} bytes)", field="metadata", value=size)
    return text


def validate_record(fields: Mapping[str, Any], defaults: RequestDefaults, *, source: str, line: int | None,
                    text_values: bool = False, extra: Mapping[str, Any] | None = None) -> GenerationRequest:
    """Validate one record (generation fields by name: a JSON object's, or a CSV row's when `text_values`: every
    value is a string and empty means absent) into a request; raise InvalidRecord with the first problem found.
    `extra`: the record's other columns, kept as its metadata (bounded by --max_metadata_bytes)."""
    prompt = fields.get("prompt")
    if prompt is None or (text_values and prompt == ""):
        raise InvalidRecord("missing prompt", field="prompt", value=prompt)
    contract_or_invalid(contract.validate_prompt, prompt, defaults.max_prompt_bytes)  # before the id, as before
    if not prompt.strip():
        raise InvalidRecord("prompt is empty", field="prompt", value=prompt)
    raw_id = fields.get("id")
    request_id = None if _absent(raw_id, text_values) else validate_id(raw_id.strip() if text_values else raw_id)
    values = dict(height=_as_int(fields, "height", defaults.height, text_values),
                  width=_as_int(fields, "width", defaults.width, text_values),
                  num_inference_steps=_as_int(fields, "num_inference_steps", defaults.num_inference_steps,
                                              text_values),
                  guidance_scale=_as_float(fields, "guidance_scale", defaults.guidance_scale, text_values),
                  num_images=_as_int(fields, "num_images", defaults.num_images, text_values),
                  seed=_as_int(fields, "seed", None, text_values))
    valid = contract_or_invalid(lambda: contract.validate(prompt=prompt, limits=defaults.limits, **values))
    prompt, height, width = valid.prompt, valid.height, valid.width
    steps, guidance, num_images, seed = valid.num_inference_steps, valid.guidance_scale, valid.num_images, valid.seed

    refs = _as_references(fields, source, defaults.max_reference_images, text_values)

    if request_id is None:
        request_id = derive_id(prompt, height, width, steps, guidance, num_images, seed, refs)
    if seed is None:
        seed = derive_seed(defaults.seed, request_id)
    metadata = metadata_json(extra, defaults.max_metadata_bytes) if extra else ""
    return GenerationRequest(id=request_id, prompt=prompt, seed=seed, height=height, width=width,
                             num_inference_steps=steps, guidance_scale=guidance, num_images=num_images,
                             source=source, line=line, metadata=metadata, reference_images=refs)


def _as_references(fields: Mapping, source: str, limit: int, text_values: bool) -> tuple[str, ...]:
    """`reference_images` as resolved URIs: a list of paths (JSON array, Parquet list, BigQuery REPEATED STRING) or
    one path; in a CSV/TSV cell a JSON array (`["a.png", "gs://b/c.png"]`) or one path. Absent, null, empty: none."""
    name = references.FIELD
    value = fields.get(name)
    if _absent(value, text_values):
        return ()
    if isinstance(value, str) and text_values and value.strip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRecord(f"{name} must be a JSON array of paths or one path, got {show(value)} ({e})",
                                field=name, value=value) from None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRecord(f"{name} must be a list of paths (strings), got {_type_name(value)} {show(value)}",
                            field=name, value=value)
    contract_or_invalid(contract.validate_reference_count, len(value), limit)
    resolved = []
    for path in value:
        try:
            resolved.append(references.resolve_path(path, source))
        except ValueError as e:
            raise InvalidRecord(f"{name}: {e}", field=name, value=path) from None
    return tuple(resolved)


# --------------------------------------------------------------------------------------------- reading files
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


_TOO_DEEP = object()


def _nested_deeper_than(obj: Any, limit: int) -> bool:
    """Whether arrays/objects nest more than `limit` levels (the top level counts as 1); iterative, so any depth
    is safe to check."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


class _JsonObject(dict):
    """A decoded JSON object that remembers the keys it was given more than once (JSON keeps the last silently)."""

    repeated: tuple = ()


def _object_with_repeats(pairs):
    obj = _JsonObject(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        obj.repeated = tuple(dict.fromkeys(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def iter_jsonl(stream: Iterable[bytes], source: str) -> Iterator[RawRecord]:
    for number, text, error in decoded_lines(stream, source):
        if error is not None:
            yield error
            continue
        if not text.strip():
            continue
        try:
            obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_object_with_repeats)
        except ValueError as e:
            yield RawRecord(source, number, error=layout.error_row(
                source=source, line=number, reason=f"malformed JSON: {e}", record=text, field="record"))
            continue
        except RecursionError:  # deeper than the decoder can go: the same answer as a parsed but too deep record
            obj = _TOO_DEEP
        if obj is _TOO_DEEP or _nested_deeper_than(obj, MAX_JSON_DEPTH):
            yield RawRecord(source, number, error=layout.error_row(
                source=source, line=number, record=text, field="record",
                reason=f"record is nested too deeply: more than {MAX_JSON_DEPTH} levels of arrays/objects"))
            continue
        if not isinstance(obj, dict):
            yield RawRecord(source, number, error=layout.error_row(
                source=source, line=number, reason=f"record must be a JSON object, got {_type_name(obj)}",
                record=text, field="record", value=obj))
            continue
        if obj.repeated:  # which of the values was meant is unknowable: reject rather than keep the last one
            names = ", ".join(repr(k) for k in obj.repeated)
            yield RawRecord(source, number, error=layout.error_row(
                source=source, line=number, reason=f"record has the key {names} more than once", record=text,
                field=obj.repeated[0]))
            continue
        yield RawRecord(source, number, fields=dict(obj), text=text)


def iter_text(stream: Iterable[bytes], source: str) -> Iterator[RawRecord]:
    for number, text, error in decoded_lines(stream, source):
        if error is not None:
            yield error
        elif "\r" in text.strip():
            # Lines end at LF (or CRLF); a CR inside a line is most likely a file with CR-only (classic Mac) line
            # endings, whose prompts would otherwise run together into one.
            yield RawRecord(source, number, error=layout.error_row(
                source=source, line=number, record=text, field="record",
                reason="line contains a carriage return (CR) that does not end it: CR-only line endings? Convert the "
                       "file to LF or CRLF line endings"))
        elif text.strip():
            yield RawRecord(source, number, fields={"prompt": text.strip()}, text_values=True, text=text,
                            columns=TEXT_COLUMNS)


TEXT_COLUMNS = Resolved({"prompt": "prompt"})  # a text line's one field


def iter_raw_records(stream, source: str, fmt: str, csv_field_limit: int = _CSV_DEFAULT_FIELD_LIMIT,
                     columns: ColumnMap = ColumnMap()) -> Iterator[RawRecord]:
    """Every record of one file: `stream` is its decompressed bytes (a binary file object or an iterable of byte
    lines), for Parquet the file itself (seekable)."""
    if fmt == "jsonl":
        return iter_jsonl(stream, source)
    if fmt in ("csv", "tsv"):
        return iter_delimited(stream, source, fmt, columns, csv_field_limit)
    if fmt == "parquet":
        return iter_parquet(stream, source, columns)
    if fmt == "text":
        return iter_text(stream, source)
    raise ValueError(f"unknown input format {fmt!r}")


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
                                id=_valid_id_or_none(fields, raw.text_values), field=e.field, value=e.value)


def _valid_id_or_none(fields: Mapping[str, Any], text_values: bool) -> str | None:
    """The record's id, if it has a valid one (so an error row can name it)."""
    rid = fields.get("id")
    if isinstance(rid, str) and text_values:
        rid = rid.strip()
    if rid is None or rid == "":
        return None
    try:
        return validate_id(rid)
    except InvalidRecord:
        return None


def _record_text(raw: RawRecord):
    """What an error row shows of the record: as written in its file when known, else its columns."""
    if raw.text is not None:
        return raw.text
    return {str(k): to_json_value(v) for k, v in raw.fields.items()}


def parse_lines(data: bytes, source: str, fmt: str, defaults: RequestDefaults,
                columns: ColumnMap = ColumnMap()) -> list[GenerationRequest | dict]:
    """Convenience for tests and tools: every request or error row of one file's bytes."""
    import io

    limit = csv_field_limit_for(defaults.max_prompt_bytes)
    resolver = ColumnResolver(columns)
    return [parse_raw(r, defaults, resolver) for r in iter_raw_records(io.BytesIO(data), source, fmt, limit, columns)]


# --------------------------------------------------------------------------------------------- Beam transforms
INVALID_TAG = "invalid"
DUPLICATE_TAG = "duplicates"
WARNING_TAG = "warnings"


class ParseRecordsFn(beam.DoFn):
    """The part every reader shares: raw records -> GenerationRequest (main output) or error row (INVALID_TAG),
    counted. Subclasses implement `process` and hand their records to `_parsed`."""

    def __init__(self, defaults: RequestDefaults, columns: ColumnMap):
        self._defaults = defaults
        self._columns = columns
        self._resolver = None
        self._read = Metrics.counter(METRICS_NAMESPACE, "records_read")
        self._invalid = Metrics.counter(METRICS_NAMESPACE, "records_invalid")

    def setup(self):
        retries.install()
        self._resolver = ColumnResolver(self._columns)

    def finish_bundle(self):
        retries.flush_to_metrics()

    def _parsed(self, raw: RawRecord):
        self._read.inc()
        parsed = parse_raw(raw, self._defaults, self._resolver)
        if isinstance(parsed, GenerationRequest):
            return parsed
        self._invalid.inc()
        return beam.pvalue.TaggedOutput(INVALID_TAG, parsed)


class _ReadRequestsFn(ParseRecordsFn):
    """fileio.ReadableFile -> GenerationRequest (main output), error row (INVALID_TAG) or, for a text file whose
    first line looks like a table's header, a warning row (WARNING_TAG)."""

    def __init__(self, input_format: str | None, defaults: RequestDefaults, columns: ColumnMap = ColumnMap()):
        super().__init__(defaults, columns)
        self._input_format = input_format
        self._csv_field_limit = csv_field_limit_for(defaults.max_prompt_bytes)
        self._files = Metrics.counter(METRICS_NAMESPACE, "input_files")

    def process(self, readable_file):
        path = readable_file.metadata.path
        self._files.inc()
        try:
            fmt = detect_format(path, self._input_format)
        except InputFormatError as e:  # the launch refuses this; a file matched only since then gets a row
            yield self._parsed(unreadable(path, None, str(e), field="input_format"))
            return
        try:
            raw_file = readable_file.open(mime_type="application/octet-stream",
                                          compression_type=CompressionTypes.UNCOMPRESSED)
        except (IsADirectoryError, NotADirectoryError, PermissionError, FileNotFoundError, NotImplementedError) as e:
            # Deterministic: retrying cannot help (a folder matched by a glob, a file removed since the match, a GCS
            # object Beam refuses to read: Content-Encoding gzip with Content-Type application/gzip).
            yield self._parsed(unreadable(path, None, f"input file cannot be opened: {e}"))
            return
        with raw_file:
            # Parquet seeks in the file as stored; the line formats read its bytes with compression undone.
            stream = raw_file if fmt == "parquet" else input_files.open_decompressed(raw_file, path)
            first = fmt == "text"
            try:
                for raw in iter_raw_records(stream, path, fmt, self._csv_field_limit, self._columns):
                    if first and raw.text is not None:
                        first = False
                        warning = self._header_warning(raw)
                        if warning is not None:
                            yield beam.pvalue.TaggedOutput(WARNING_TAG, warning)
                    yield self._parsed(raw)
            except input_files.InputReadError as e:
                # The records of the complete lines before the damage are kept; the cut last line is not a record.
                done = stream.complete_lines
                yield self._parsed(unreadable(path, done + 1, f"input file cannot be read to its end: {e}; the "
                                                              f"records from line {done + 1} on were not read"))

    def _header_warning(self, raw: RawRecord) -> dict | None:
        """A warning row when a text file's first line looks like a table's header (the file is still read as
        asked: one prompt per line)."""
        why = header_warning(raw.text, self._columns.known_names())
        if why is None:
            return None
        warning = (f"{raw.source} is read as plain text (one prompt per line), but its first line looks like the "
                   f"header of a table: {why}; if it is a table, name it .csv/.tsv or pass --input_format")
        logger.warning("%s (line %s: %r)", warning, raw.line, layout.truncate_record(raw.text, 100))
        return {"source": raw.source, "line": raw.line, "warning": warning}


def canonical_path(path: str) -> str:
    """One spelling per file, so that a file matched by two patterns is read once: local paths absolute and
    normalised ('a/./b.txt' and 'a/b.txt' are one file); URIs (gs://...) as they are."""
    if "://" in path:
        return path
    return os.path.normpath(os.path.abspath(path))


class ReadRequests(beam.PTransform):
    """PCollection of file patterns (gs:// or local, globs allowed) -> {'requests': ..., 'invalid': error rows,
    'warnings': warning rows (text files that look like tables)}.

    Every pattern must match at least one file (the pipeline checks that before it starts, with a clear message).
    """

    def __init__(self, input_format: str | None, defaults: RequestDefaults, columns: ColumnMap = ColumnMap()):
        super().__init__()
        self._input_format = input_format
        self._defaults = defaults
        self._columns = columns

    def expand(self, patterns):
        from apache_beam.io import fileio

        files = (patterns
                 | "MatchInputs" >> fileio.MatchAll()
                 | "FilePaths" >> beam.Map(lambda metadata: canonical_path(metadata.path))
                 | "DistinctFiles" >> beam.Distinct()  # a file matched by two patterns is read once
                 | "ReadMatches" >> fileio.ReadMatches()  # opened uncompressed: input_files decompresses
                 | "SpreadFiles" >> beam.Reshuffle())
        parsed = files | "ParseRecords" >> beam.ParDo(
            _ReadRequestsFn(self._input_format, self._defaults, self._columns)).with_outputs(
                INVALID_TAG, WARNING_TAG, main="requests")
        return {"requests": parsed.requests, "invalid": parsed[INVALID_TAG], WARNING_TAG: parsed[WARNING_TAG]}


class MaxImagesExceeded(RuntimeError):
    """The job would generate more images than --max_images allows."""


def max_images_message(count: int, limit: int) -> str:
    return (f"the job would generate {count} images, above --max_images={limit}; nothing was generated. Raise "
            f"--max_images or split the input")


def _within_max_images(task, count: int, limit: int):
    if count > limit:
        raise MaxImagesExceeded(max_images_message(count, limit))
    return task


class EnforceMaxImages(beam.PTransform):
    """Image tasks -> the same tasks, or the job fails before any of them reaches inference when there are more
    than `limit`. The count is a side input, so the runner finishes counting before the first task passes: a job
    over the limit produces nothing, and nothing already produced (a resumed job's images) is touched."""

    def __init__(self, limit: int):
        super().__init__()
        self._limit = limit

    def expand(self, tasks):
        count = tasks | "CountImages" >> beam.combiners.Count.Globally()
        return tasks | "CheckMaxImages" >> beam.Map(_within_max_images, beam.pvalue.AsSingleton(count), self._limit)


def _request_fields(request: GenerationRequest) -> dict:
    """A request's parameters for an error row (where it came from is in the row already)."""
    return {k: v for k, v in dataclasses.asdict(request).items() if k not in ("source", "line", "metadata")}


class _DeduplicateFn(beam.DoFn):
    """(id, [requests]) -> the first request (by source, line), plus an error row for each later record with the
    same id but different parameters. Identical repeats are dropped (generated once) and counted."""

    def __init__(self):
        self._duplicates = Metrics.counter(METRICS_NAMESPACE, "records_duplicate")
        self._conflicts = Metrics.counter(METRICS_NAMESPACE, "records_conflicting_id")
        self._invalid = Metrics.counter(METRICS_NAMESPACE, "records_invalid")  # same counter as the parser's

    def process(self, element):
        request_id, requests = element
        ordered = sorted(requests, key=GenerationRequest.position)
        first = ordered[0]
        yield first
        for other in ordered[1:]:
            if other.params() == first.params():
                self._duplicates.inc()
                yield beam.pvalue.TaggedOutput(DUPLICATE_TAG, other)
                continue
            self._conflicts.inc()
            self._invalid.inc()
            differing = [name for name, a, b in zip(
                ("prompt", "seed", "height", "width", "num_inference_steps", "guidance_scale", "num_images",
                 "reference_images"),
                first.params(), other.params()) if a != b]
            yield beam.pvalue.TaggedOutput(INVALID_TAG, layout.error_row(
                source=other.source, line=other.line, id=request_id, kind=layout.DUPLICATE_ID,
                reason=(f"duplicate id {request_id!r} with conflicting parameters ({', '.join(differing)} differ "
                        f"from {first.source}:{first.line}, which is kept)"),
                record=_request_fields(other),
                field="id", value=request_id))


def _name_collisions(element):
    """(file name, [requests that would write it]) -> (id, (file name, kept request)) for every request but the
    first (by source, line) when several different requests claim the name."""
    file_name, claimants = element
    ordered = sorted(claimants, key=GenerationRequest.position)
    for other in ordered[1:]:
        yield other.id, (file_name, ordered[0])


class _DropCollidingFn(beam.DoFn):
    """(id, {'request': [request], 'collisions': [(file name, kept request)]}) -> the request, or one error row
    when one of its image names is another request's (`{id}-{j}.png` of a multi-image request vs an id `x-1`)."""

    def __init__(self):
        self._collisions = Metrics.counter(METRICS_NAMESPACE, "records_file_name_collision")
        self._invalid = Metrics.counter(METRICS_NAMESPACE, "records_invalid")

    def process(self, element):
        request_id, joined = element
        for request in joined["request"]:
            if not joined["collisions"]:
                yield request
                continue
            file_name, kept = min(joined["collisions"], key=lambda c: (c[1].position(), c[0]))
            self._collisions.inc()
            self._invalid.inc()
            yield beam.pvalue.TaggedOutput(INVALID_TAG, layout.error_row(
                source=request.source, line=request.line, id=request_id, kind=layout.FILE_NAME_COLLISION,
                reason=(f"its image {file_name!r} would overwrite an image of request {kept.id!r} ({kept.source}:"
                        f"{kept.line}), which is kept: {{id}}-{{j}}.png names the images of a request with "
                        f"num_images > 1, so an id such as 'x-1' collides with request 'x'; choose another id"),
                record=_request_fields(request),
                field="id", value=request_id))


class DeduplicateRequests(beam.PTransform):
    """Requests -> {'requests': one per id, 'invalid': error rows for conflicting duplicate ids and for requests
    whose image file names another request already writes, 'duplicates': identical repeats (dropped: generated
    once)}. `fold_case`: file names that differ only in case are the same file (a case-insensitive output folder,
    as on macOS and Windows)."""

    def __init__(self, fold_case: bool = False):
        super().__init__()
        self._fold_case = fold_case

    def expand(self, requests):
        fold = (lambda name: name.lower()) if self._fold_case else (lambda name: name)
        out = (requests
               | "KeyById" >> beam.Map(lambda r: (r.id, r))
               | "GroupById" >> beam.GroupByKey()
               | "PickFirst" >> beam.ParDo(_DeduplicateFn()).with_outputs(INVALID_TAG, DUPLICATE_TAG,
                                                                          main="requests"))
        # Different ids can still name the same file ("x" with 2 images writes x-1.png, as does id "x-1"): the
        # later request (by source, line) is rejected whole, so no image is overwritten by another request's.
        collisions = (out.requests
                      | "KeyByFileName" >> beam.FlatMap(lambda r: [(fold(t.file_name), r) for t in r.tasks()])
                      | "GroupByFileName" >> beam.GroupByKey()
                      | "Collisions" >> beam.FlatMap(_name_collisions))
        checked = ({"request": out.requests | "KeyKeptById" >> beam.Map(lambda r: (r.id, r)),
                    "collisions": collisions}
                   | "JoinCollisions" >> beam.CoGroupByKey()
                   | "DropColliding" >> beam.ParDo(_DropCollidingFn()).with_outputs(INVALID_TAG, main="requests"))
        invalid = (out[INVALID_TAG], checked[INVALID_TAG]) | "DedupInvalid" >> beam.Flatten()
        return {"requests": checked.requests, "invalid": invalid, DUPLICATE_TAG: out[DUPLICATE_TAG]}
