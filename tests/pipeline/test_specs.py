"""The option table's groups as typed specs (pipeline/specs.py): one field an option, enums for choices, each
option's own checks and the defaults that depend on the run, without the checkpoint or any file."""

import dataclasses
import types

import pytest

from pipeline.demo import DEMO_DTYPE, DEMO_PROMPTS, DEMO_SIZE
from pipeline.errors import UsageError
from pipeline.option_specs import GROUPS, OPTIONS
from pipeline.specs import (
    SPECS, Accelerator, Dtype, ExistingResults, ImageFormat, InputFormat, OutputFormat, Quantize, Runner, job_spec,
)

LOCAL = Runner("FnApiRunner", local=True)
DATAFLOW = Runner("DataflowRunner", local=False, temp_location="gs://b/tmp", project="p")


def options(**given):
    """The options as Beam parses them: each option's default, then `given`."""
    values = {o.name: o.default for o in OPTIONS}
    values.update(given)
    return types.SimpleNamespace(**values)


def spec(runner=LOCAL, **given):
    return job_spec(options(**given), runner)


def test_each_group_has_a_spec_whose_fields_are_its_options():
    assert set(SPECS) == {key for key, _ in GROUPS}
    for key, cls in SPECS.items():
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        assert fields == {o.name for o in OPTIONS if o.group == key}, key
        assert cls.__dataclass_params__.frozen, key


def test_choices_are_enums_that_read_as_their_values():
    s = spec(input=["a.jsonl"], model="ckpt", image_format="webp", output_format="webdataset", dtype="float32",
             require_accelerator="tpu", input_format="csv")
    assert s.input.input_format is InputFormat.CSV and s.output.image_format is ImageFormat.WEBP
    assert s.output.output_format is OutputFormat.WEBDATASET and s.output.output_format == "webdataset"
    assert s.model.dtype is Dtype.FLOAT32 and s.reliability.require_accelerator is Accelerator.TPU
    assert s.model.dtype == "float32" and f"{s.output.image_format}" == "webp"
    assert s.output.existing is ExistingResults.STOP
    assert spec(input=["a.jsonl"], model="m", skip_existing=True).output.existing is ExistingResults.SKIP
    assert spec(input=["a.jsonl"], model="m", overwrite=True).output.existing is ExistingResults.OVERWRITE
    for option in OPTIONS:  # each enum has exactly its option's choices
        enum = {"input_format": InputFormat, "image_format": ImageFormat, "output_format": OutputFormat,
                "dtype": Dtype, "require_accelerator": Accelerator, "quantize": Quantize}.get(option.name)
        assert enum is None or tuple(enum) == option.choices, option.name


def test_defaults_follow_the_checkpoint_and_the_inputs():
    demo = spec()
    assert demo.demo and demo.tiny and demo.input.files == (DEMO_PROMPTS,)
    assert (demo.generation.height, demo.generation.width, demo.model.dtype) == (DEMO_SIZE, DEMO_SIZE, DEMO_DTYPE)
    assert demo.output.output == "./output"
    mine = spec(input=["a.jsonl,gs://b/*.csv", "bq://p.d.t"], model="ckpt", height=64)
    assert not mine.demo and not mine.tiny and mine.input.files == ("a.jsonl", "gs://b/*.csv")
    assert [b.source for b in mine.input.bigquery] == ["bq://p.d.t"]
    assert (mine.generation.height, mine.generation.width, mine.model.dtype) == (64, 1024, "bfloat16")
    assert mine.reference_roots[1:] == ("gs://b",)  # the folders of the files (a table has none)
    assert spec(input=["a.jsonl"], demo_checkpoint=True).tiny
    env = spec(input=["a.jsonl"], model="m", worker_env="A=1;B=x=y").reliability.worker_env
    assert env == (("A", "1"), ("B", "x=y"))
    assert mine.model.quantize is Quantize.NONE
    int8 = spec(input=["a.jsonl"], model="ckpt", quantize="int8")
    assert int8.model.quantize is Quantize.INT8
    assert int8.load_settings("ckpt").engine.quantize == "int8"


@pytest.mark.parametrize("given, words", [
    (dict(max_images=0), "--max_images must be >= 1, got 0"),
    (dict(inference_retries=-1), "--inference_retries must be >= 0, got -1"),
    (dict(inference_timeout_s=-5), "--inference_timeout_s must be >= 0 (0: no limit), got -5"),
    (dict(model_copies=0), "--model_copies must be None or an integer >= 1"),
    (dict(encode_threads=0), "--encode_threads must be None or an integer >= 1"),
    (dict(batch_size=0), "--batch_size must be an integer >= 1"),
    (dict(max_sequence_length=0), "--max_sequence_length must be an integer >= 1"),
    (dict(max_prompt_bytes=0), "--max_prompt_bytes must be an integer >= 1"),
    (dict(max_metadata_bytes=-1), "--max_metadata_bytes must be an integer >= 0"),
    (dict(max_reference_images=0), "--max_reference_images"),
    (dict(max_reference_pixels=4000), "--max_reference_pixels must be an integer >= 4096 (64 x 64)"),
    (dict(reference_root=["http://x"]), "--reference_root='http://x' is neither"),
    (dict(model_variant="../fp16"), "--model_variant must be a weight-file variant name"),
    (dict(worker_env="a=1"), "--worker_env entry 'a=1'"),
    (dict(quality=0), "--quality=0 is not an integer from 1 to 100"),
    (dict(samples_per_shard=0), "--samples_per_shard=0"),
    (dict(preview=-1), "--preview=-1"),
    (dict(output="out[1]"), "contains a glob character"),
    (dict(skip_existing=True, overwrite=True), "give one"),
    (dict(prompt_column="id"), "both name the column"),
    (dict(column_map="x"), "--column_map"),
    (dict(input=["bq://nodots"]), "is not a BigQuery table"),
    (dict(input_query=" "), "--input_query is empty"),
])
def test_each_option_is_checked_alone_naming_it(given, words):
    with pytest.raises(UsageError) as e:
        spec(**{"input": ["a.jsonl"], "model": "ckpt", **given})
    assert words in str(e.value)


def test_combinations_are_checked_naming_the_options():
    with pytest.raises(UsageError, match="--model is required"):
        spec(input=["a.jsonl"])
    with pytest.raises(UsageError, match="--input is required"):
        spec(model="ckpt")
    with pytest.raises(UsageError, match="both name the checkpoint"):
        spec(input=["a.jsonl"], model="ckpt", demo_checkpoint=True)
    with pytest.raises(UsageError, match="--demo_checkpoint is built on this machine, which the workers of "
                                         "DataflowRunner"):
        spec(DATAFLOW, input=["a.jsonl"], demo_checkpoint=True)
    with pytest.raises(UsageError, match="is a local path, which the workers of DataflowRunner cannot share"):
        spec(DATAFLOW, input=["a.jsonl"], model="gs://b/m")
    assert spec(DATAFLOW, input=["a.jsonl"], model="gs://b/m", output="gs://b/out").output.output == "gs://b/out"


def test_the_checkpoints_size_multiple_checks_the_generation_defaults():
    s = spec(input=["a.jsonl"], model="ckpt", height=24, width=40, max_pixels=4096)
    assert s.request_defaults(8).height == 24
    with pytest.raises(UsageError, match="invalid default for --height"):
        s.request_defaults(16)
    with pytest.raises(UsageError, match="--max_pixels must be an integer >= 256"):
        spec(input=["a.jsonl"], model="ckpt", max_pixels=0).request_defaults(16)
    load = s.load_settings("/ckpt")
    assert (load.model, load.dtype, load.engine.batch_size) == ("/ckpt", "bfloat16", 4)


def test_the_job_holds_the_spec_and_what_the_launch_resolved_not_copies_of_the_options():
    """The graph reads the options from the spec's groups (pipeline/graph.py): the launch's JobConfig adds only what
    it resolved (load settings, request defaults, fingerprint, ...), with no alias of an option beside them."""
    from pipeline.launch import JobConfig

    fields = {f.name for f in dataclasses.fields(JobConfig)}
    assert "spec" in fields and not fields & {o.name for o in OPTIONS}
    assert not [name for name, value in vars(JobConfig).items() if isinstance(value, property)]
