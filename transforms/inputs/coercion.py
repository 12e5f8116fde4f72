"""A record's values as the typed fields of a request: integers, numbers and reference paths from JSON, table cells
or BigQuery values, the extra columns as bounded JSON, and model.contract's checks as error rows (`InvalidRecord`).

A value that cannot be what its field needs raises `InvalidRecord` naming the field and the value; the reason becomes
the record's error row.
"""

from __future__ import annotations

import decimal
import json
import math
import re
from typing import Any, Mapping

from model import RequestError, show, validate_reference_count

from .. import layout, references
from .json_values import to_json_value

# Every integer field is far below 2**64 (20 digits); longer digit strings are rejected without converting them
# (int() of more than 4300 digits raises).
_MAX_INT_DIGITS = 40


class InvalidRecord(ValueError):
    """A record that cannot become a request; `field`/`value` name the offending part, `kind` the error row's kind
    (`invalid_record`; `invalid_reference` for a reference path no file can have)."""

    def __init__(self, reason: str, *, field: str | None = None, value: Any = None,
                 kind: str = layout.INVALID_RECORD):
        super().__init__(reason)
        self.reason = reason
        self.field = field
        self.value = value
        self.kind = kind


def type_name(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    return {str: "string", bool: "boolean", int: "integer", float: "number", list: "array",
            type(None): "null"}.get(type(value), type(value).__name__)


def absent(value: Any, text_values: bool) -> bool:
    return value is None or (text_values and isinstance(value, str) and value.strip() == "")


def plain_number(value: Any) -> Any:
    """A decimal (BigQuery NUMERIC) as the int or float it holds; anything else as it is."""
    if isinstance(value, decimal.Decimal) and value.is_finite():
        if value.adjusted() > _MAX_INT_DIGITS or value != value.to_integral_value():
            return float(value)  # far out of every field's range, or a fraction: rejected as such
        return int(value)
    return value


def given(fields: Mapping, name: str, text_values: bool) -> Any:
    """The field's value (a decimal as the number it holds), or None when the record does not give it."""
    value = plain_number(fields.get(name))
    return None if absent(value, text_values) else value


def as_int(fields: Mapping, name: str, default, text_values: bool):
    value = given(fields, name, text_values)
    if value is None:
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
        raise InvalidRecord(f"{name} must be an integer, got {type_name(value)} {show(value)}", field=name,
                            value=value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        raise InvalidRecord(f"{name} must be an integer, got {show(value)}", field=name, value=value)
    return value


def as_float(fields: Mapping, name: str, default, text_values: bool):
    value = given(fields, name, text_values)
    if value is None:
        return default
    if text_values and isinstance(value, str):
        try:
            f = float(value.strip())
        except ValueError:
            raise InvalidRecord(f"{name} must be a number, got {show(value)}", field=name, value=value) from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRecord(f"{name} must be a number, got {type_name(value)} {show(value)}", field=name,
                            value=value)
    else:
        f = float(value)
    if not math.isfinite(f):
        raise InvalidRecord(f"{name} must be a finite number, got {show(value)}", field=name, value=value)
    return f


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


def as_references(fields: Mapping, source: str, limit: int, text_values: bool) -> tuple[str, ...]:
    """`reference_images` as resolved URIs: a list of paths (JSON array, Parquet list, BigQuery REPEATED STRING) or
    one path; in a CSV/TSV cell a JSON array (`["a.png", "gs://b/c.png"]`) or one path. Absent, null, empty: none."""
    name = references.FIELD
    value = fields.get(name)
    if absent(value, text_values):
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
        raise InvalidRecord(f"{name} must be a list of paths (strings), got {type_name(value)} {show(value)}",
                            field=name, value=value)
    contract_or_invalid(validate_reference_count, len(value), limit)
    resolved = []
    for path in value:
        try:
            resolved.append(references.resolve_path(path, source))
        except ValueError as e:
            raise InvalidRecord(f"{name}: {e}", field=name, value=path, kind=layout.INVALID_REFERENCE) from None
    return tuple(resolved)
