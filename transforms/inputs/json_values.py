"""Values read from typed sources (Parquet through pyarrow, BigQuery rows) as JSON values for the manifest.

Extra columns travel to the manifest's `metadata` typed as read: numbers stay numbers, strings strings, nested
lists and structs become arrays and objects. What JSON has no type for is written in its usual text form (dates and
times ISO 8601, decimals exactly as digits, bytes base64), and a non-finite float, which JSON cannot carry, is null.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import math
import numbers
from typing import Any

# Nested values are walked without recursion limits mattering: Parquet and BigQuery nest far less than this.
_MAX_DEPTH = 64


def to_json_value(value: Any, _depth: int = 0) -> Any:
    """`value` (a Python value as pyarrow's `to_pylist` or Beam's BigQuery reader yield it) as a JSON value."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if _depth >= _MAX_DEPTH:
        return repr(value)[:200]
    if isinstance(value, dict):
        return {str(k): to_json_value(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, _depth + 1) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, decimal.Decimal):
        return str(value) if value.is_finite() else None
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, numbers.Integral):  # numpy integers and the like
        return int(value)
    if isinstance(value, numbers.Real):
        return to_json_value(float(value))
    return str(value)
