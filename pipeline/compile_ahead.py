"""Compile a Dataflow job's TPU preflight ahead of its launch, so a matching launch compiles nothing.

`python -m pipeline.compile_ahead --temp_location=gs://BUCKET/temp [--model=M] <a settings file's pipeline options>`
reads the options as a launch does (pipeline/specs.py), finds the workers' TPU topology from them, and runs the
launch's own check (pipeline/launch_check.check_fits) at the job's defaults: the programs go to the job's shared
compilation cache and the answer to the store beside it (pipeline/preflight_store.py), under the key a launch with
the same options, model, image and versions looks up. templates/build.sh runs it in the launcher image it built, once
per TPU settings file. Without --model it is the checkpoint baked into the image (templates/main.py's default).
Prints one line per job: where the answer is, and what it says; exits 2 for options it cannot compile.
"""

from __future__ import annotations

import os
import sys
import types

from .errors import UsageError

BAKED_WEIGHTS = "/opt/flux2-klein/weights"  # templates/Dockerfile; templates/main.py's default --model
PLACEHOLDER_IO = ("--input=gs://compile-ahead/none.jsonl", "--output=gs://compile-ahead/none")  # never read


def ahead_job(argv: list[str]):
    """(the pipeline options, a job with the launch's spec, defaults and load settings, its TPU topology or None)
    for `argv`; nothing but the checkpoint's configs is read."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    from . import launch_check, probes
    from .launch import pipeline_options, runner_name
    from .options import Flux2KleinOptions
    from .specs import Runner, job_spec

    if not any(a.startswith("--model=") for a in argv) and os.path.isfile(os.path.join(BAKED_WEIGHTS,
                                                                                        "model_index.json")):
        argv = [*argv, f"--model={BAKED_WEIGHTS}"]
        os.environ[probes.CONFIGS_ONLY_ENV] = BAKED_WEIGHTS  # as templates/main.py sets it for a launch
    options = pipeline_options(["--runner=DataflowRunner", *PLACEHOLDER_IO, *argv])
    cloud = options.view_as(GoogleCloudOptions)
    runner = Runner(runner_name(options), False, cloud.temp_location, cloud.project)
    spec = job_spec(options.view_as(Flux2KleinOptions), runner)
    checkpoint = probes.read_checkpoint(probes.checkpoint_location(spec.model, runner), spec.model.model_variant)
    job = types.SimpleNamespace(spec=spec, defaults=spec.request_defaults(checkpoint.size_multiple),
                                load=spec.load_settings(checkpoint.location))
    return options, job, launch_check.job_topology(options)


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from . import launch_check

    try:
        _, job, topology = ahead_job(list(sys.argv[1:] if argv is None else argv))
        if topology is None:
            print("compile ahead: not TPU workers; nothing to compile")
            return 0
        if not job.load.engine.compilation_cache_dir:
            raise UsageError("no compilation cache to keep the programs and the answer in: give --temp_location="
                             "gs://BUCKET/temp (the launch's) or --compilation_cache_dir")
        answer = launch_check.check_fits(job, topology)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    source = answer["answer_source"]
    print(f"compile ahead: {topology} at batch {answer['batch']}{' (picked)' if answer.get('batch_picked') else ''}, "
          f"{answer['model_shards']} model shard(s), fits; "
          f"{'compiled now and stored' if source == 'compiled' else 'already stored at ' + source} in "
          f"{job.load.engine.compilation_cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
