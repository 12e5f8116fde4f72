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

from transforms.beam_adapter import options_class

from .usage import declare_job_options

Flux2KleinOptions = options_class(
    "Flux2KleinOptions", __name__, "Options of `python -m pipeline.run` (FLUX.2 [klein] batch text-to-image), from "
                                   "`OPTIONS`.", declare_job_options)
