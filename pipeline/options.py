"""The job's pipeline options as Beam's `Flux2KleinOptions`, built from the option table `OPTIONS`.

The table (how each option parses, its group, its one-line description) lives in pipeline/option_specs.py, which
does not import Beam so that the command line can check its arguments before importing it; it is re-exported here.
To add an option, add one `Option(...)` to `OPTIONS` there; the job reads it as
`options.view_as(Flux2KleinOptions).<name>`.

Standard Beam options (`--runner`, `--direct_running_mode`, `--direct_num_workers`, Dataflow's `--project`,
`--region`, `--temp_location`, `--sdk_container_image`, ...) are Beam's own and pass straight through; an argument
that is neither is rejected at launch (pipeline/usage.py).

Every option takes `--name=value`, which is how Dataflow Flex Templates pass parameters; the switches
(`--skip_existing`, `--overwrite`, `--large_model`, `--no_progress`) also work bare, and take `=true` / `=false`.
"""

from __future__ import annotations

import re

from apache_beam.options.pipeline_options import PipelineOptions

# The option table and its constants, re-exported: callers import them from here.
from .option_specs import (  # noqa: F401
    ACCELERATORS, DEFAULT_BATCH_SIZE, DEFAULT_MAX_IMAGES, DEFAULT_OUTPUT, DTYPES, GROUPS, INPUT_FORMATS, OPTION_NAMES,
    OPTIONS, Option, options_by_group, str2bool,
)
# Defaults the option table takes from the model and the transforms, re-exported as before.
from .option_specs import (  # noqa: F401
    DEFAULT_INFERENCE_RETRIES, DEFAULT_INFERENCE_TIMEOUT_S, DEFAULT_MAX_METADATA_BYTES, DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_REFERENCE_IMAGES, DEFAULT_MAX_REFERENCE_PIXELS, DEFAULT_MAX_SEQUENCE_LENGTH,
    DEFAULT_PNG_COMPRESS_LEVEL, DEFAULT_PREVIEW, DEFAULT_QUALITY, DEFAULT_SAMPLES_PER_SHARD, DEFAULT_SIZE, DEMO_DTYPE,
    DEMO_SIZE, FORMATS, IMAGE_FORMATS, OUTPUT_FORMATS,
)

_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


class Flux2KleinOptions(PipelineOptions):
    """Options of `python -m pipeline.run` (FLUX.2 [klein] batch text-to-image), from `OPTIONS`."""

    @classmethod
    def _add_argparse_args(cls, parser):
        for title, options in options_by_group():
            group = parser.add_argument_group(f"FLUX.2 [klein] job: {title}")
            for option in options:
                option.add_to(group)

    # ------------------------------------------------------------------------------------------------------------
    def input_patterns(self) -> list[str]:
        """--input as a flat list: repeated flags and comma-separated values both work."""
        patterns: list[str] = []
        for value in self.input or []:
            patterns.extend(p.strip() for p in str(value).split(",") if p.strip())
        return patterns

    def worker_env_vars(self) -> dict[str, str]:
        """--worker_env as {NAME: value}; ValueError naming the entry that is not NAME=value."""
        env: dict[str, str] = {}
        for entry in filter(None, (self.worker_env or "").split(";")):
            name, sep, value = entry.partition("=")
            if not sep or not _ENV_NAME.fullmatch(name) or name in env:
                raise ValueError(f"--worker_env entry {entry!r} is not a new NAME=value pair (NAME in capitals, "
                                 f"digits and '_'; pairs separated by ';')")
            env[name] = value
        return env
