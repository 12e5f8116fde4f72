"""Where a job's workers keep their persistent XLA compilation cache, shared by all workers of the job.

`--compilation_cache_dir` unset (or `auto`): on Dataflow `{--temp_location}/flux2-klein-xla-cache` (a gs:// prefix
every worker of the job reads and writes, so a worker that starts after the first compiled finds its programs
there); on a local runner `xla/` under the project's cache folder (model/loading/cache_paths.py), so a second run on the
same machine compiles nothing. `off` turns it off; any other value is the folder or gs:// prefix to use. JAX keys
each entry by the program, the compiler options, JAX/libtpu versions and the devices, so one prefix can serve jobs
of different models and chips.
"""

from __future__ import annotations

import os

from model import cache_root

AUTO, OFF = "auto", "off"
SHARED_FOLDER = "flux2-klein-xla-cache"


def resolve_compilation_cache(value: str | None, *, local_runner: bool, temp_location: str | None) -> str | None:
    """The compilation cache folder the workers use, or None for none."""
    if value is not None and value.strip().lower() in (OFF, "none", "false", "0"):
        return None
    if value not in (None, "", AUTO):
        return value
    if local_runner:
        return os.path.join(cache_root(), "xla")
    if temp_location and "://" in temp_location:
        return temp_location.rstrip("/") + "/" + SHARED_FOLDER
    return None  # a remote runner without a shared temp location: every worker compiles for itself
