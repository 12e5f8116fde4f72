"""Trace-time settings held in context variables: set for a `with` block, restored after it."""

from __future__ import annotations

import contextlib
import contextvars


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value):
    """Set `var` to `value` inside the block and restore what it was on the way out, also on errors."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
