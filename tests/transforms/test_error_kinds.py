"""`layout.ERROR_KINDS` lists every kind of error row layout defines: the runbook's test reads it, so a kind left out
there is a kind of row no runbook check can see (INFERENCE_TIMEOUT once was)."""

import ast
import inspect

from transforms import layout


def _defined_kinds() -> dict[str, str]:
    """Every module-level constant of layout spelled as its own value upper-cased (INFERENCE_TIMEOUT =
    "inference_timeout"): how the kinds of error rows are written, and no other constant of the module is."""
    kinds = {}
    for node in ast.parse(inspect.getsource(layout)).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and len(node.targets) == 1:
            name, value = getattr(node.targets[0], "id", None), node.value.value
            if isinstance(value, str) and name == value.upper():
                kinds[name] = value
    return kinds


def test_every_kind_defined_is_in_error_kinds():
    kinds = _defined_kinds()
    assert {"INVALID_RECORD", "INFERENCE_FAILED", "INFERENCE_TIMEOUT", "NON_FINITE_IMAGE"} <= set(kinds)
    missing = sorted(name for name, value in kinds.items() if value not in layout.ERROR_KINDS)
    assert not missing, f"kinds of error rows missing from layout.ERROR_KINDS: {missing}"
    assert len(set(layout.ERROR_KINDS)) == len(layout.ERROR_KINDS) == len(kinds)
