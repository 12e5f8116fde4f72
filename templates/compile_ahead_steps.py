"""The compile-ahead step of templates/build.sh: for each TPU settings file, the launch's TPU preflight of its default
job (`python -m pipeline.compile_ahead`, run in the launcher image just built, with the jax, libtpu and code a launch
of this build runs), writing the programs and the answer to the jobs' shared compilation cache under
gs://BUCKET/temp (where templates/run.sh's --temp-location puts it). A launch of the same settings and model then
finds its answer there and compiles nothing.

  python3 templates/compile_ahead_steps.py --launcher-image IMG --worker-image IMG --project P --region R \\
      --bucket B [--settings NAME[,NAME...]] --format cloudbuild|docker

cloudbuild: a Cloud Build config (JSON) with one step per settings file; docker: one `docker run` line per settings
file (with --local-docker). Standard library only, like settings.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import List, Optional, Sequence

import settings

# Cloud Build's machine for the step: a preflight compiling batches of a real-size model peaks above 5 GB of RSS.
BUILD_MACHINE = "E2_HIGHCPU_8"
BUILD_TIMEOUT = "3600s"


def tpu_settings(names: Optional[str]) -> List[str]:
    """The TPU settings to compile ahead: `names` (comma-separated), else every TPU settings file."""
    chosen = [n for n in names.split(",") if n] if names else [n for n in settings.available()
                                                               if settings.load(n).variant == "tpu"]
    for name in chosen:
        if settings.load(name).variant != "tpu":
            raise settings.SettingsError(f"{name} is not a TPU settings file: nothing to compile ahead")
    return chosen


def job_args(name: str, worker_image: str, project: str, region: str, bucket: str) -> List[str]:
    """`python -m pipeline.compile_ahead`'s arguments for the default job of settings `name` (the zone only fills in
    the settings' disk type, which does not change what is compiled)."""
    s = settings.load(name, worker_image, project, f"{region}-a")
    return ["-m", "pipeline.compile_ahead", f"--temp_location=gs://{bucket}/temp", f"--project={project}",
            f"--region={region}", *s.beam_args()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--launcher-image", "--worker-image", "--project", "--region", "--bucket"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--settings", default=None, help="comma-separated settings names (default: every TPU one)")
    ap.add_argument("--format", choices=("cloudbuild", "docker"), required=True)
    args = ap.parse_args(argv)
    try:
        names = tpu_settings(args.settings)
        jobs = {n: job_args(n, args.worker_image, args.project, args.region, args.bucket) for n in names}
    except settings.SettingsError as e:
        print(f"compile_ahead_steps.py: {e}", file=sys.stderr)
        return 2
    if args.format == "cloudbuild":
        steps = [{"id": f"compile-ahead-{n}", "name": args.launcher_image, "entrypoint": "python", "args": a}
                 for n, a in jobs.items()]
        print(json.dumps({"steps": steps, "timeout": BUILD_TIMEOUT, "options": {"machineType": BUILD_MACHINE}},
                         indent=1))
    else:
        for a in jobs.values():
            credentials = os.path.expanduser("~/.config/gcloud")  # the caller's application default credentials
            print(shlex.join(["docker", "run", "--rm", "-v", f"{credentials}:/root/.config/gcloud:ro",
                              "--entrypoint", "python", args.launcher_image, *a]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
