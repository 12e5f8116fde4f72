"""The preflight compiles a batch's programs at once (model/preflight/aot.py compile_concurrently): their compiles
overlap in time, and a compiler error is raised in the caller. Fake lowered programs stand for XLA's (whose compile,
like time.sleep here, releases the GIL)."""

import threading
import time

import pytest

from model.preflight.aot import compile_concurrently


class FakeLowered:
    """A lowered program whose compile takes `seconds` and records when it ran, or raises `error`."""

    def __init__(self, spans: dict, name: str, seconds: float = 0.3, error: Exception | None = None):
        self.spans, self.name, self.seconds, self.error = spans, name, seconds, error

    def compile(self):
        start = time.monotonic()
        time.sleep(self.seconds)
        self.spans[self.name] = (start, time.monotonic())
        if self.error:
            raise self.error
        return self

    def memory_analysis(self):
        return f"memory of {self.name}"

    def cost_analysis(self):
        return {}

    def as_text(self):
        return f"HloModule {self.name}"


def test_the_programs_compile_at_once_and_keep_their_own_results():
    spans: dict = {}
    names = ("denoise", "decode", "encode")
    results = compile_concurrently({name: FakeLowered(spans, name) for name in names})
    assert {k: v[:4] for k, v in results.items()} == {
        name: (f"memory of {name}", {}, f"HloModule {name}", "compiled") for name in names}
    assert max(start for start, _ in spans.values()) < min(end for _, end in spans.values()), spans


def test_a_compiler_error_reaches_the_caller_after_every_compile_ended():
    spans: dict = {}
    with pytest.raises(ValueError, match="bad program"):
        compile_concurrently({"denoise": FakeLowered(spans, "denoise", error=ValueError("bad program")),
                              "decode": FakeLowered(spans, "decode", seconds=0.5)})
    assert set(spans) == {"denoise", "decode"}
    assert not [t for t in threading.enumerate() if t.name.startswith("compile-")]
