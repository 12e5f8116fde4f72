"""The product's comments and docstrings say what and why, not when, where or at which commit: no commit ids, no
dates and no lent machines by letter in the .py files of the runtime packages (model/, transforms/, pipeline/,
templates/, tiny_klein/). Measurements and their history live in docs/performance.md and
benchmarks/tpu_measured.json, which may name all three; benchmarks/ and tests/ are not scanned.

Only comments and string literals are read (Python's tokenizer), so a number such as `2307e12` in code is never
taken for a commit id."""

from __future__ import annotations

import io
import os
import re
import tokenize

from paths import REPO

PACKAGES = ("model", "transforms", "pipeline", "templates", "tiny_klein")
# A git object id as a comment quotes one: 7 to 40 lowercase hex digits with at least one letter and one digit (all
# digits is a number; all letters is a word such as "defaced").
COMMIT = re.compile(r"(?<![0-9A-Za-z.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z])")
DATE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")
MACHINE = re.compile(r"\bmachines? [A-Z]\b")
NAMES = {"ed25519"}  # hex-looking names of standards, not commits
KINDS = {"commit id": COMMIT, "date": DATE, "machine by letter": MACHINE}


def diary_marks(source: str, name: str = "<source>") -> list[str]:
    """`name:line: kind 'text'` for each commit id, date or lettered machine in `source`'s comments and strings."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        for offset, line in enumerate(token.string.splitlines()):
            for kind, pattern in KINDS.items():
                for match in pattern.finditer(line):
                    if match.group() in NAMES or line[:match.start()].endswith("/"):
                        continue  # a standard's name (a key algorithm), or a date in a namespace URI's path
                    found.append(f"{name}:{token.start[0] + offset}: {kind} {match.group()!r}")
    return found


def runtime_sources():
    """(path relative to the repository, text) of every .py file of the runtime packages."""
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(REPO, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for file in sorted(files):
                if file.endswith(".py"):
                    path = os.path.join(folder, file)
                    with open(path, encoding="utf-8") as f:
                        yield os.path.relpath(path, REPO), f.read()


def test_the_scan_finds_each_kind_in_comments_and_strings_only():
    """A diary line of each kind is found with its line; the same characters as code, a float's exponent, a word
    of hex letters or a lowercase machine are not."""
    source = (
        "SCALE = 2307e12  # the vendor's figure\n"
        "RATE = 7.37e12\n"
        "# 952.9 against 970.0 ms (traced_once_15358e1)\n"
        "x = 1  # measured on machine D\n"
        '"""Blocks measured on one chip (2026-12-06, at c7479de)."""\n'
        "# a defaced, faded 1234567 cafe; any machine is fine\n"
    )
    assert diary_marks(source, "f.py") == [
        "f.py:3: commit id '15358e1'",
        "f.py:4: machine by letter 'machine D'",
        "f.py:5: commit id 'c7479de'",
        "f.py:5: date '2026-12-06'",
    ]


def test_no_commit_ids_dates_or_machines_in_the_runtime_code():
    """Every mark names file:line; move the figure or history to docs/performance.md and leave a pointer."""
    sources = list(runtime_sources())
    assert len(sources) > 100  # the packages were found
    marks = [mark for path, text in sources for mark in diary_marks(text, path)]
    assert not marks, "diary marks in runtime code (move them to docs/performance.md):\n" + "\n".join(marks)
