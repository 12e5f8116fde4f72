"""Beam's own true/false options spelled as the job's switches are (`--name`, `--name=true`, `--name=false`), before
anything parses the command line.

The job's switches (pipeline/option_specs.py) take all three spellings. Beam's take one each: most are argparse
`store_true` flags that refuse a value (`--streaming=true` is an error), and `--dry_run` is a plain option whose
value is kept as text, so a bare `--dry_run` is refused ("needs a value") and `--dry_run=false` is a true string.
`normalized` rewrites each to the one spelling Beam takes: a true value as that spelling, a false one dropped.
"""

from __future__ import annotations

from .beam_flags import FLAGS
from .errors import OptionValueError
from .option_specs import str2bool

# Beam's true/false options that take a value (argparse default False, the value kept as text); a test checks this
# list against Beam's option classes.
VALUE_SWITCHES = ("--dry_run",)
# Beam's flags that take no value (argparse store_true / store_false).
FLAG_SWITCHES = frozenset(name for names, nargs, _, _ in FLAGS if nargs == 0 for name in names)
_TRUE = "True"  # what Beam's value-taking switches are given when true


def _truth(option: str, value: str) -> bool:
    try:
        return str2bool(value)
    except Exception:  # noqa: BLE001 - argparse's ArgumentTypeError: said as the job's own value error
        raise OptionValueError(option, value, "expected true or false") from None


def _is_truth_word(text: str) -> bool:
    try:
        str2bool(text)
    except Exception:  # noqa: BLE001
        return False
    return text != ""


def normalized(argv: list[str]) -> list[str]:
    """`argv` with each of Beam's switches in the spelling Beam takes: `--flag=true` -> `--flag` and `--flag=false`
    dropped for flags that take no value; `--dry_run`, `--dry_run=true` or `--dry_run true` -> `--dry_run=True`
    and a false value dropped. OptionValueError for a value that is neither true nor false."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out.extend(args[i - 1:])
            break
        name, has_value, value = arg.partition("=")
        if name in VALUE_SWITCHES:
            if not has_value and i < len(args) and _is_truth_word(args[i]):
                value, has_value = args[i], True
                i += 1
            if not has_value or _truth(name, value):
                out.append(f"{name}={_TRUE}")
            continue
        if name in FLAG_SWITCHES and has_value:
            if _truth(name, value):
                out.append(name)
            continue
        out.append(arg)
    return out
