"""The job's command line: `--help`, `--help_beam`, the option table (docs/options.md), and the launch check of
arguments.

Beam's option parsing keeps the arguments it knows and silently drops the rest, so a misspelled option
(`--num_inference_step=8`, `--hieght=64`) used to run the job with the default. `check_arguments` parses the
arguments against every option of the job and of every registered Beam `PipelineOptions` class (runner, Dataflow,
worker, direct-runner options) and raises a UsageError, before any input is read or any model loaded, for an
argument that is none of them (naming the closest known option) or a value that does not parse.

Importing Beam takes seconds, so this module imports it only where it needs Beam's classes: `--help` and the
quick check (`check_arguments_quickly`: the job's option table and a snapshot of Beam's flags, pipeline/beam_flags.py)
answer a typo or a bad value without it.

    python -m pipeline.usage --markdown     # the option table of docs/options.md (a test checks that it has it)
    python -m pipeline.usage --beam_flags > pipeline/beam_flags.py   # the snapshot, after a Beam upgrade
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import re
import shutil
import sys
import textwrap

from transforms import beam_adapter

from .errors import OptionValueError, UnknownOptionError, UsageError
from .option_specs import AUTO_BATCH, Option, options_by_group
from .switches import normalized as normalized_switches

PROG = "python -m pipeline.run"
HELP_FLAGS = ("-h", "--help")
BEAM_HELP_FLAG = "--help_beam"
HELP_WIDTH = 120  # at most; a narrower terminal narrows it (COLUMNS too), output to a pipe or file keeps it
# Beam options a launch of this job commonly sets (listed at the end of --help; --help_beam lists them all).
COMMON_BEAM_OPTIONS = (
    "runner", "direct_running_mode", "direct_num_workers", "project", "region", "temp_location", "staging_location",
    "job_name", "sdk_container_image", "sdk_location", "experiments", "dataflow_service_options", "machine_type",
    "max_num_workers", "number_of_worker_harness_threads", "disk_size_gb", "disk_type", "worker_zone",
)

DESCRIPTION = (
    "FLUX.2 [klein] text-to-image as an Apache Beam batch job: prompt files in; PNGs, a manifest, error rows and "
    "summary.json out (docs/io-contract.md). With neither --input nor --model it runs the "
    "bundled demo: a tiny random-weight checkpoint, so noise images. Options take --name=value; switches also work "
    "bare (--skip_existing). An argument that is not an option of the job or of Beam stops the job before it starts."
)


class _CheckingParser(argparse.ArgumentParser):
    """An argument parser like Beam's, raising the job's UsageError instead of printing argparse's usage and
    exiting, that keeps the arguments declared on it (`arguments`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._declared: list[argparse.Action] = []

    def error(self, message):
        raise UsageError(message)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self._declared.append(action)
        return action

    def add_value_provider_argument(self, *args, **kwargs):
        """Beam's option classes may declare options with this, which only Beam's parser class has."""
        beam_adapter.add_value_provider_argument(self, *args, **kwargs)

    @property
    def arguments(self) -> list[argparse.Action]:
        """The arguments declared, in order; one a later declaration replaced entirely (conflict_handler="resolve"
        takes its option strings away) is left out."""
        return [action for action in self._declared if action.option_strings]

    def option_strings(self) -> list[str]:
        return [s for action in self.arguments for s in action.option_strings]


def _new_parser() -> _CheckingParser:
    # Like Beam's own parsing: no abbreviations (--num_inference_step is not --num_inference_steps), and a later
    # declaration of an option name replaces an earlier one instead of failing.
    return _CheckingParser(prog=PROG, add_help=False, allow_abbrev=False, conflict_handler="resolve",
                           exit_on_error=False)


def option_classes() -> list[type]:
    """The job's options class and every registered Beam `PipelineOptions` class that declares options, each once,
    in Beam's order. Imports Beam."""
    from .options import Flux2KleinOptions  # noqa: F401 - registers the job's class

    return beam_adapter.option_classes()


def declare_job_options(parser) -> None:
    """The job's options (the table `OPTIONS`) on an argparse parser, in their --help groups."""
    for title, options in options_by_group():
        group = parser.add_argument_group(f"FLUX.2 [klein] job: {title}")
        for option in options:
            option.add_to(group)


def known_options_parser() -> _CheckingParser:
    """A parser that knows every option of the job and of Beam (the arguments `PipelineOptions` would use)."""
    from .options import Flux2KleinOptions

    parser = _new_parser()
    for cls in option_classes():
        if cls is Flux2KleinOptions:
            _declare_flat(parser)
        else:
            beam_adapter.declare_options(cls, parser)
    return parser


def _declare_flat(parser) -> None:
    """The job's options straight on `parser` (no groups: the checking parser keeps what is declared on it)."""
    for _, options in options_by_group():
        for option in options:
            option.add_to(parser)


def check_arguments(argv: list[str]) -> None:
    """UsageError (exit status 2 from the command line) unless every argument is a known option with a value that
    parses: UnknownOptionError names each unknown argument and the closest known option, OptionValueError the
    option, its value and what it accepts."""
    _check(known_options_parser(), argv)


def check_arguments_quickly(argv: list[str]) -> None:
    """`check_arguments` without importing Beam: Beam's options come from the snapshot pipeline/beam_flags.py. Raises
    only the UsageError `check_arguments` would raise; when the arguments use a Beam option whose values the snapshot
    cannot check, an error is left to `check_arguments` (that option's value might be the first error)."""
    parser, unchecked = quick_parser()
    try:
        _check(parser, argv)
    except UsageError:
        if any(arg.split("=", 1)[0] in unchecked for arg in argv):
            return
        raise


def quick_parser() -> tuple[_CheckingParser, set[str]]:
    """A parser like `known_options_parser`'s, from the job's option table and Beam's flags as snapshot in
    pipeline/beam_flags.py (Beam's parsers in the order Beam registers them, then the job's), and the flags whose
    values it cannot check as Beam does (a type or action of Beam's own): it accepts any value for those."""
    from .beam_flags import FLAGS

    parser, unchecked = _new_parser(), set()
    for flags, nargs, type_name, choices in FLAGS:
        kwargs = {"action": "store_true"} if nargs == 0 else {"nargs": nargs}
        if type_name in _QUICK_TYPES:
            kwargs["type"] = _QUICK_TYPES[type_name]
        elif type_name is not None:
            unchecked.update(flags)
        if choices is not None:
            kwargs["choices"] = choices
        parser.add_argument(*flags, **kwargs)
    _declare_flat(parser)
    return parser, unchecked


# Value types of Beam's flags that the quick parser checks as Beam does (argparse names them in its messages).
_QUICK_TYPES = {"int": int, "float": float, "str": str}


def beam_flag_specs() -> list[tuple[tuple[str, ...], object, str | None, tuple[str, ...] | None]]:
    """Beam's flags as the quick parser declares them, read from Beam's registered option classes (imports Beam):
    (option strings, argparse's nargs (0: takes no value), type, choices) per argument, in Beam's order; type 'other'
    where Beam's check of the value is its own (a type function or action class of Beam's), None where any text is
    accepted."""
    from .options import Flux2KleinOptions

    parser = _new_parser()
    for cls in option_classes():
        if cls is not Flux2KleinOptions:
            beam_adapter.declare_options(cls, parser)
    specs = []
    for action in parser.arguments:
        type_name = None if action.type is None else getattr(action.type, "__name__", "other")
        if type_name not in (None, *_QUICK_TYPES) or type(action).__module__ != "argparse":
            type_name = "other"
        choices = tuple(action.choices) if action.choices is not None else None
        specs.append((tuple(action.option_strings), action.nargs, type_name, choices))
    return specs


def beam_flags_module() -> str:
    """The text of pipeline/beam_flags.py for the installed Beam (`python -m pipeline.usage --beam_flags`)."""
    import apache_beam

    entries = "".join(f"    {spec!r},\n" for spec in beam_flag_specs())
    return _BEAM_FLAGS_MODULE.format(version=apache_beam.__version__, entries=entries)


_BEAM_FLAGS_MODULE = '''"""Beam's own flags, from apache-beam {version}: what `check_arguments_quickly` (pipeline/usage.py) accepts
besides the job's options, so that a typo is answered without importing Beam. Generated; after a Beam upgrade run

    python -m pipeline.usage --beam_flags > pipeline/beam_flags.py

(tests/pipeline/test_command_line.py fails while it is stale). Each entry: (option strings, argparse's nargs (0: no
value), value type, choices); type 'other' is a check of Beam's own that the quick check does not repeat.
"""

BEAM_VERSION = "{version}"

FLAGS = (
{entries})
'''


def _check(parser: _CheckingParser, argv: list[str]) -> None:
    try:
        _, unknown = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as e:
        raise _value_error(e) from None
    if unknown:
        raise UnknownOptionError(_unknown_arguments(unknown, parser.option_strings()),
                                 f"'{PROG} --help' lists the job's options, '{PROG} {BEAM_HELP_FLAG}' Beam's")


def exit_on_usage_error(argv: list[str]) -> None:
    """The command line's first step, before the job's heavy imports (Beam, JAX, the transforms): print --help and
    exit 0, or print the one-line error of an argument that is no option or a value that does not parse and exit 2,
    from the job's option table and the snapshot of Beam's flags (`check_arguments_quickly`). Anything else returns:
    the job parses its arguments once, against Beam's own option classes (`check_arguments`, pipeline/run.py)."""
    if any(arg in HELP_FLAGS for arg in argv):
        print(format_help(), end="")
        sys.exit(0)
    if BEAM_HELP_FLAG in argv:
        return  # Beam's own option classes: every one is registered only once the job's modules are imported
    try:
        argv = normalized_switches(argv)  # Beam's true/false options spelled as the job's switches
        check_arguments_quickly(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _unknown_arguments(unknown: list[str], known: list[str]) -> list[tuple[str, str | None]]:
    """(argument, closest known option) for each argument argparse left over; the value that follows an unknown
    `--name value` belongs to it and is not listed again."""
    job = [option.flag for _, options in options_by_group() for option in options]
    found: list[tuple[str, str | None]] = []
    previous = None
    for arg in unknown:
        if arg.startswith("-") and arg != "--":
            found.append((arg, closest_option(arg, job, known)))
        elif not (previous and previous.startswith("-") and "=" not in previous):
            found.append((arg, None))
        previous = arg
    return found


def closest_option(argument: str, job: list[str], known: list[str]) -> str | None:
    """The known option an unknown `argument` most likely meant: the same name with '_' for '-', else a job option
    that is very close, else any option that is close; None when nothing is."""
    name = "--" + argument.split("=", 1)[0].lstrip("-").replace("-", "_")
    if argument.split("=", 1)[0] in HELP_FLAGS + (BEAM_HELP_FLAG,):
        return f"'{PROG} {argument}' on its own"
    if name in known:
        return name
    for candidates, cutoff in ((job, 0.8), (known, 0.6)):
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
        if close:
            return close[0]
    return None


def _value_error(error: argparse.ArgumentError) -> OptionValueError:
    """argparse's complaint about a value as an OptionValueError that says what the option accepts."""
    option, message = error.argument_name or "argument", error.message
    match = re.fullmatch(r"invalid (\w+) value: (.*)", message)
    if match:
        kind = {"int": "a whole number", "float": "a number", "batch_size_value": f"a whole number or {AUTO_BATCH}"
                }.get(match.group(1), f"a {match.group(1)} value")
        return OptionValueError(option, _literal(match.group(2)), f"expected {kind}")
    match = re.fullmatch(r"invalid choice: (.*?) \(choose from (.*)\)", message)
    if match:
        choices = ", ".join(_literal(c.strip()) for c in match.group(2).split(","))
        return OptionValueError(option, _literal(match.group(1)), f"expected one of {choices}")
    if message == "expected one argument":
        metavar = {o.flag: o.metavar for _, options in options_by_group() for o in options}.get(option, "VALUE")
        return OptionValueError(option, None, f"needs a value: {option}={metavar}")
    return OptionValueError(option, None, message)


def _literal(text: str) -> str:
    """A value as argparse quoted it ('abc'), unquoted."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return str(value)


# ---------------------------------------------------------------------------------------------------------- help
def _invocation(option: Option) -> str:
    if option.switch:
        return f"{option.flag}[=true|false]"
    if option.choices:
        return f"{option.flag}={{{','.join(option.choices)}}}"
    return f"{option.flag}={option.metavar}"


def _help_width() -> int:
    return max(60, min(HELP_WIDTH, shutil.get_terminal_size((HELP_WIDTH, 24)).columns))


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, _help_width(), initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def format_help() -> str:
    """What `python -m pipeline.run --help` prints: the job's options by group, each with its default and its
    one-line description, then where Beam's own options are listed."""
    lines = [f"usage: {PROG} [--input=FILES --model=CHECKPOINT] [--output=FOLDER] [--name=value ...]", "",
             _wrap(DESCRIPTION)]
    for title, options in options_by_group():
        lines += ["", f"{title}:"]
        for option in options:
            lines.append(f"  {_invocation(option)}  (default: {option.default_text})")
            lines.append(_wrap(option.help, "      "))
    beam = ", ".join(f"--{name}" for name in COMMON_BEAM_OPTIONS)
    lines += ["", _wrap(f"Beam's own options pass through to Beam, for example {beam}. With no --runner the job "
                        f"runs on Beam's FnApiRunner, in this process; templates/README.md shows a Dataflow launch. "
                        f"--dry_run (any runner) runs the launch checks, reads and validates every input record and "
                        f"prints what the job would do (records, images, invalid rows, batch, estimate), generating "
                        f"and writing nothing (the output is not checked); the TPU preflight writes to the "
                        f"compilation cache (--skip_preflight skips it). With --runner=DataflowRunner it also "
                        f"translates the job and needs a valid gs:// --temp_location. Every Beam option, with its "
                        f"help:"),
              f"  {PROG} {BEAM_HELP_FLAG}", "", "exit status:"]
    lines += [f"  {code}  {_wrap(text, ' ' * 5).strip()}" for code, text in EXIT_STATUSES]
    return "\n".join(lines) + "\n"


# What `python -m pipeline.run` exits with (its --help and the README list them).
EXIT_STATUSES = (
    (0, "the job ran and generated images (or skipped them as already there), or --allow_empty was given"),
    (1, "the job ran but generated no image: no record was read, or every request was invalid or failed (the "
        "errors file names each); or the job itself failed"),
    (2, "a usage error: an unknown option, a bad value, an input or model that cannot be used, an output holding a "
        "previous run's results without --skip_existing or --overwrite; nothing ran"),
    (130, "interrupted by Ctrl-C (SIGINT) at any moment: one line says how many images were written; run the same "
          "command with --skip_existing to finish (SIGTERM: 143)"),
)


def format_beam_help() -> str:
    """What `python -m pipeline.run --help_beam` prints: every registered Beam option class's options and help."""
    from .options import Flux2KleinOptions

    parser = _CheckingParser(prog=PROG, usage=argparse.SUPPRESS, add_help=False, allow_abbrev=False,
                             conflict_handler="resolve", formatter_class=_help_formatter,
                             description=f"Beam's options, which {PROG} passes to Beam ('{PROG} --help' lists the "
                                         f"job's own):")
    for cls in option_classes():
        if cls is not Flux2KleinOptions:
            section = parser.add_argument_group(cls.__name__)
            section.add_value_provider_argument = functools.partial(beam_adapter.add_value_provider_argument, section)
            beam_adapter.declare_options(cls, section)
    return parser.format_help()


def _help_formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=_help_width())


def markdown_table() -> str:
    """The option table of docs/options.md: option, default and description of every job option, by group."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("*", "\\*")

    rows = ["| option | default | what it does |", "|---|---|---|"]
    for title, options in options_by_group():
        rows.append(f"| **{cell(title)}** | | |")
        for option in options:
            rows.append(f"| `{option.flag}` | {cell(option.default_text)} | {cell(option.help)} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--markdown"]:
        print(markdown_table(), end="")
        return 0
    if args == ["--beam_flags"]:
        print(beam_flags_module(), end="")
        return 0
    print(f"usage: python -m pipeline.usage --markdown | --beam_flags   (the job's own help: {PROG} --help)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
