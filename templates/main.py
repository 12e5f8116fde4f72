"""Flex Template entry point (FLEX_TEMPLATE_PYTHON_PY_FILE=/template/main.py in the launcher image).

Dataflow's template launcher runs `python main.py --runner=DataflowRunner --project=... --<parameter>=<value> ...`.
This hands those arguments to the job's own entry point (`pipeline.run.main`, what `python -m pipeline.run` runs)
and returns as soon as the job is submitted: pipeline.run waits only on local runners. A Flex Template launcher
must not wait for its job (during a template launch there is no job id to wait on yet, and Beam's
wait_until_finish raises); `--no_wait_until_finish`, Beam's standard option for that, is added as a second guard.

Two defaults for launches from the image:
- `--no_wait_until_finish` is added when absent;
- `--model=$FLUX2_WEIGHTS_DIR` is added when the job names no checkpoint and the build baked one in: the worker
  image holds the checkpoint there, the launcher image only its JSON configs, enough to check the launch's configs
  (CONFIGS_ONLY_ENV tells the launch so: the weight files, which it cannot see, are checked by the workers' loader).
"""

from __future__ import annotations

import logging
import os
import sys

NO_WAIT = "--no_wait_until_finish"
WEIGHTS_ENV = "FLUX2_WEIGHTS_DIR"
CONFIGS_ONLY_ENV = "FLUX2_CONFIGS_ONLY"  # pipeline/probes.py reads the same name


def _has_option(argv: list[str], name: str) -> bool:
    return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv)


def launcher_argv(argv: list[str], environ: dict | None = None) -> list[str]:
    """The launcher's arguments plus the two defaults above."""
    environ = os.environ if environ is None else environ
    out = list(argv)
    baked = environ.get(WEIGHTS_ENV, "")
    if not _has_option(out, "model") and baked and os.path.isfile(os.path.join(baked, "model_index.json")):
        out.append(f"--model={baked}")
        environ[CONFIGS_ONLY_ENV] = baked
    if not _has_option(out, NO_WAIT[2:]):
        out.append(NO_WAIT)
    return out


def main(argv: list[str] | None = None) -> int:
    """Submit the job; returns the exit status of `python -m pipeline.run` (2 with a one-line error for an unknown
    option, a bad value or a bad combination, before any work; the launcher log then shows it)."""
    # INFO so the launcher log shows Beam's submission messages (pipeline.run would settle for WARNING).
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pipeline import run as job  # imported here so that `import main` stays cheap

    return job.main(launcher_argv(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
