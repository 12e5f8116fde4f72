"""JSONL input: one JSON object a line -> raw records, or an error row for a line that is not one."""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

from .. import layout
from .coercion import type_name
from .lines import decoded_lines
from .records import RawRecord

# Records are flat objects; unknown fields may nest, but not without bound (a deep value would crash the JSON
# decoder, repr and json.dumps of the error row with RecursionError).
MAX_JSON_DEPTH = 64


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
                source=source, line=number, reason=f"record must be a JSON object, got {type_name(obj)}",
                record=text, field="record", value=obj))
            continue
        if obj.repeated:  # which of the values was meant is unknowable: reject rather than keep the last one
            names = ", ".join(repr(k) for k in obj.repeated)
            yield RawRecord(source, number, error=layout.error_row(
                source=source, line=number, reason=f"record has the key {names} more than once", record=text,
                field=obj.repeated[0]))
            continue
        yield RawRecord(source, number, fields=dict(obj), text=text)
