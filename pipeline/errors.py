"""The job's command-line errors, shared by pipeline/run.py, pipeline/usage.py and pipeline/demo.py (re-exported by
pipeline.run)."""

from __future__ import annotations

from typing import Iterator


def exception_chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error`, then what it was raised from or during (`__cause__`, else `__context__`), each once: where a
    worker's error is found inside the exceptions Beam wraps it in."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


class UsageError(ValueError):
    """A bad combination of options, reported without a traceback."""


class UnknownOptionError(UsageError):
    """Arguments that are neither options of the job nor of Beam: Beam alone would drop them silently, so that a
    misspelled option ran with its default. `unknown` is [(argument, closest known option or None), ...]."""

    def __init__(self, unknown: list[tuple[str, str | None]], hint: str):
        self.unknown = list(unknown)
        parts = [f"unknown option {arg}" + (f" (did you mean {close}?)" if close else "") if arg.startswith("-")
                 else f"unexpected argument {arg!r} (options take the form --name=value)"
                 for arg, close in self.unknown]
        super().__init__("; ".join(parts) + f"; {hint}")


class OptionValueError(UsageError):
    """A value an option cannot take (not a number, not one of its choices, missing); names the option, the value
    and what the option accepts."""

    def __init__(self, option: str, value: str | None, accepted: str):
        self.option, self.value, self.accepted = option, value, accepted
        given = f"{option}={value}" if value is not None else option
        super().__init__(f"{given}: {accepted}")
