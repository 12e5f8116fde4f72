"""The job's pipeline options as Beam's `Flux2KleinOptions`, built from the option table `OPTIONS`.

The table (how each option parses, its group, its one-line description, its default) lives in
pipeline/option_specs.py, which does not import Beam so that the command line can check its arguments before
importing it.
To add an option, add one `Option(...)` to `OPTIONS` there and a field of that name to its group's spec
(pipeline/specs.py), which is how the job reads it.

Standard Beam options (`--runner`, `--direct_running_mode`, `--direct_num_workers`, Dataflow's `--project`,
`--region`, `--temp_location`, `--sdk_container_image`, ...) are Beam's own and pass straight through; an argument
that is neither is rejected at launch (pipeline/usage.py).

Every option takes `--name=value`, which is how Dataflow Flex Templates pass parameters; the switches
(`--skip_existing`, `--overwrite`, `--large_model`, `--no_progress`) also work bare, and take `=true` / `=false`.
"""

from __future__ import annotations

from apache_beam.options.pipeline_options import PipelineOptions

from .option_specs import options_by_group


class Flux2KleinOptions(PipelineOptions):
    """Options of `python -m pipeline.run` (FLUX.2 [klein] batch text-to-image), from `OPTIONS`."""

    @classmethod
    def _add_argparse_args(cls, parser):
        for title, options in options_by_group():
            group = parser.add_argument_group(f"FLUX.2 [klein] job: {title}")
            for option in options:
                option.add_to(group)
