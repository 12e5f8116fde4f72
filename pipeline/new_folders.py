"""The empty folders a failed local run made under its output, removed: a run stopped before it wrote anything (over
--max_images, a model that does not load) leaves the output as it found it, not with empty manifest/ and errors/.

Only folders that did not exist when the run started and hold no file (at any depth) are removed; gs:// outputs have
no folders of their own, so there is nothing to do there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FoldersBefore:
    """A local output as the run found it: whether it existed, and the names at its top."""

    output: str | None  # None: not a local folder (gs://): nothing to clean
    existed: bool = False
    names: frozenset = frozenset()


def folders_before(output: str) -> FoldersBefore:
    """What is at the top of a local `output` before the run writes there."""
    if "://" in output:
        return FoldersBefore(None)
    if not os.path.isdir(output):
        return FoldersBefore(output, existed=False)
    return FoldersBefore(output, existed=True, names=frozenset(os.listdir(output)))


def _holds_no_file(path: str) -> bool:
    return all(not files for _, _, files in os.walk(path))


def remove_new_empty_folders(before: FoldersBefore) -> list[str]:
    """Remove the folders this run made under the output that hold no file, and the output itself when the run made
    it and it is empty now. Returns the paths removed; a folder that cannot be removed is left (logged)."""
    output = before.output
    if output is None or not os.path.isdir(output):
        return []
    removed = []
    for name in sorted(set(os.listdir(output)) - before.names):
        path = os.path.join(output, name)
        if os.path.isdir(path) and not os.path.islink(path) and _holds_no_file(path):
            try:
                shutil.rmtree(path)
                removed.append(path)
            except OSError as e:
                logger.info("could not remove the empty folder %s: %s", path, e)
    if not before.existed and not os.listdir(output):
        try:
            os.rmdir(output)
            removed.append(output)
        except OSError as e:
            logger.info("could not remove the empty folder %s: %s", output, e)
    return removed
