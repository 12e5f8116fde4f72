"""The launch check of `--output`: a folder that already holds a previous run's results needs a choice.

Without one, a second run into the same output would silently replace the first run's images, manifest and shards.
So when the output holds any of RESULTS, the launch stops (exit 2) unless `--skip_existing` (keep them, generate
only what is missing) or `--overwrite` (generate everything again and replace them) is given. The bundled demo run
with no `--output` replaces its own earlier output (a `summary.json` that says `"demo": true`), nothing else.
The files of a run that generated no image (every record invalid: a failed run whose rerun is its fix) are replaced
without a choice: the listings found no image and its `summary.json` says it generated and kept none.
The check is a few listings of one entry each (local or gs:// through Beam's FileSystems) and, only when they find
results, one read of `summary.json`, before any model loads.
"""

from __future__ import annotations

import json
import logging
import os

from transforms import layout
from transforms.preview import PREVIEW_DIR
from transforms.shards import SHARDS_DIR

from .errors import UsageError

logger = logging.getLogger("pipeline.output_check")

# What a run writes directly under --output: folders (with a trailing '/') and files.
RESULTS = (f"{layout.IMAGES_DIR}/", f"{SHARDS_DIR}/", f"{layout.MANIFEST_DIR}/", f"{layout.ERRORS_DIR}/",
           f"{PREVIEW_DIR}/", layout.SUMMARY_FILE, layout.METADATA_FILE)
IMAGE_RESULTS = (f"{layout.IMAGES_DIR}/", f"{SHARDS_DIR}/")  # where images are: the files' folder, the tar shards


def _local_has(output: str, entry: str) -> bool:
    path = os.path.join(output, entry.rstrip("/"))
    if not entry.endswith("/"):
        return os.path.isfile(path)
    try:
        with os.scandir(path) as found:
            return any(not e.name.startswith("beam-temp-") for e in found)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _remote_has(output: str, entry: str) -> bool:
    from apache_beam.io.filesystems import FileSystems

    pattern = layout.join(output, entry + "*" if entry.endswith("/") else entry)
    try:
        return bool(FileSystems.match([pattern], limits=[1])[0].metadata_list)
    except Exception as e:  # noqa: BLE001 - Beam wraps every listing error alike (a missing prefix lists nothing)
        raise UsageError(f"--output={output!r} cannot be listed: {e}") from e


def previous_results(output: str) -> list[str]:
    """The entries of RESULTS that `output` holds (a folder counts when it has something in it)."""
    has = _local_has if layout.is_local_path(output) else _remote_has
    return [entry for entry in RESULTS if has(output, entry)]


def read_summary(output: str) -> dict | None:
    """`output`'s summary.json, or None when there is none or it is not a JSON object (not one of ours)."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    try:
        with FileSystems.open(layout.summary_path(output), compression_type=CompressionTypes.UNCOMPRESSED) as f:
            summary = json.loads(f.read().decode("utf-8"))
    except Exception:  # noqa: BLE001 - no summary, or not one of ours
        return None
    return summary if isinstance(summary, dict) else None


def holds_demo_output(output: str) -> bool:
    """Whether `output`'s summary.json says the bundled demo wrote it."""
    return (read_summary(output) or {}).get("demo") is True


def holds_only_a_failed_run(output: str, found: list[str]) -> bool:
    """Whether the results `found` in `output` (`previous_results`) are those of a run that wrote no image: the
    listings found nothing under images/ or shards/, and its summary.json says it generated none and kept none.
    Replacing them loses no image: its manifest lists none, its errors file only what the rerun will say again."""
    if layout.SUMMARY_FILE not in found or any(entry in found for entry in IMAGE_RESULTS):
        return False
    summary = read_summary(output) or {}
    return summary.get("images_generated") == 0 and summary.get("skipped") == 0


def check_output(output: str, *, skip_existing: bool, overwrite: bool, demo_default_output: bool = False
                 ) -> str | None:
    """UsageError when `output` holds a previous run's results and neither --skip_existing nor --overwrite says what
    to do with them (or both are given). Returns a line to print when the demo replaces its own earlier output."""
    if skip_existing and overwrite:
        raise UsageError("--skip_existing keeps the images already written and --overwrite replaces them; give one")
    if skip_existing or overwrite:
        return None
    found = previous_results(output)
    if not found:
        return None
    if demo_default_output and holds_demo_output(output):
        return f"replacing the previous demo output in {output} (give --output to write elsewhere)"
    if holds_only_a_failed_run(output, found):
        return (f"replacing the files of a previous run in {output} that generated no image (its summary.json says "
                f"so and it holds no image)")
    raise UsageError(f"--output={output!r} already holds a previous run's results ({', '.join(found)}); pass "
                     f"--skip_existing to keep them and generate only what is missing, or --overwrite to generate "
                     f"everything again and replace them (or choose another --output)")
