"""Flex Template entry point (FLEX_TEMPLATE_PYTHON_PY_FILE=/template/main.py in the image).

Dataflow's template launcher runs `python main.py --runner=DataflowRunner --project=... --<parameter>=<value> ...`.
This file hands those arguments to the project's own entry point (`python -m pipeline.run`) and returns as soon as
the job is submitted: a Flex Template launcher must not wait for the job (during a template launch there is not
even a job id to wait on, and Beam's wait_until_finish raises). `--no_wait_until_finish` is Beam's standard option
for exactly that.
"""

from __future__ import annotations

import logging
import sys

NO_WAIT = "--no_wait_until_finish"


def launcher_argv(argv: list[str]) -> list[str]:
    """The launcher's arguments plus `--no_wait_until_finish` (once)."""
    return argv if NO_WAIT in argv else [*argv, NO_WAIT]


def main(argv: list[str] | None = None) -> None:
    logging.getLogger().setLevel(logging.INFO)
    from pipeline import run as job  # imported here so `import main` stays cheap for tests

    job.run(launcher_argv(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
