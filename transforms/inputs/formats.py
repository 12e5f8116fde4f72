"""Which reader an input file gets: its format from `--input_format` or its extension, and the header check of text.

A table (`.csv`, `.tsv`, `.parquet`) is never read as plain text: its header would become a prompt and every row's
other cells would be glued to its prompt. A plain-text file whose first line looks like a table's header is still
read as text when that is what was asked, but `header_warning` says so (the job logs it and puts it in summary.json).
"""

from __future__ import annotations

FORMATS = ("jsonl", "csv", "tsv", "parquet", "text")
TABLE_FORMATS = ("csv", "tsv", "parquet")  # formats with named columns fixed by the file (a header or a schema)
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv",
               ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet", ".txt": "text"}
_COMPRESSION_SUFFIXES = (".gz", ".gzip", ".bz2", ".zst", ".zstd", ".deflate", ".lzma", ".xz")


class InputFormatError(ValueError):
    """A file that cannot be read in the format asked for (a table asked to be read as plain text)."""


def format_from_name(path: str) -> str | None:
    """The format a file's extension names (compression suffixes such as .gz ignored), or None."""
    name = path.lower().rsplit("/", 1)[-1]
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    for ext, fmt in _EXTENSIONS.items():
        if name.endswith(ext):
            return fmt
    return None


def detect_format(path: str, override: str | None = None) -> str:
    """One of FORMATS: `override` when given (not 'auto'), else from the extension; anything unrecognised is plain
    text, one prompt per line. Raises InputFormatError for a table (.csv, .tsv, .parquet) with override 'text'."""
    by_name = format_from_name(path)
    if override and override != "auto":
        if override not in FORMATS:
            raise ValueError(f"--input_format must be one of auto, {', '.join(FORMATS)}; got {override!r}")
        if override == "text" and by_name in TABLE_FORMATS:
            raise InputFormatError(f"{path} is a {by_name.upper()} table by its name and is never read as plain text "
                                   f"(its header would become a prompt); drop --input_format=text or rename the file")
        return override
    return by_name or "text"


def header_warning(first_line: str, column_names) -> str | None:
    """Why the first line of a plain-text file looks like the header of a table (tabs, or commas and a known
    column name from `column_names`, compared without case), or None when it looks like a prompt."""
    if "\t" in first_line:
        return "it contains tabs (the header of a TSV table?)"
    cells = [cell.strip().strip('"').strip().casefold() for cell in first_line.split(",")]
    known = {name.casefold() for name in column_names}
    named = [cell for cell in cells if cell in known]
    if len(cells) > 1 and named:
        return f"it has commas and the column name {named[0]!r} (the header of a CSV table?)"
    return None
