"""The output formats are one table (transforms/sinks/registry.py): --output_format's choices, default and
description, the sink the job builds and where the closing lines say its images are all come from its rows, and
reading it imports no Beam."""

import os
import subprocess
import sys

import pytest

from pipeline.option_specs import OPTIONS
from transforms.sinks import registry
from transforms.sinks.base import Sink, SinkSettings
from transforms.sinks.files import FilesSink
from transforms.sinks.webdataset import WebDatasetSink

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_row_names_a_sink_once():
    assert len(set(registry.OUTPUT_FORMATS)) == len(registry.SINKS)
    assert {name: registry.sink_class(name) for name in registry.OUTPUT_FORMATS} == {
        "files": FilesSink, "webdataset": WebDatasetSink}
    for name in registry.OUTPUT_FORMATS:
        assert issubclass(registry.sink_class(name), Sink)
    with pytest.raises(KeyError):
        registry.sink_class("parquet")


def test_the_option_is_the_table():
    option = next(o for o in OPTIONS if o.name == "output_format")
    assert option.choices == registry.OUTPUT_FORMATS and option.default == registry.DEFAULT_OUTPUT_FORMAT == "files"
    assert option.help == registry.description() == ("Layout of the outputs: files (one object per image, "
                                                      "metadata.jsonl for datasets) or webdataset (tar shards).")


def test_a_new_row_is_a_new_choice_with_its_words(monkeypatch):
    row = registry.SinkRow("copies", "the files layout again", "transforms.sinks.files:FilesSink")
    monkeypatch.setattr(registry, "SINKS", registry.SINKS + (row,))
    assert registry.description() == ("Layout of the outputs: files (one object per image, metadata.jsonl for "
                                      "datasets), webdataset (tar shards) or copies (the files layout again).")
    assert registry.sink_class("copies") is FilesSink


def test_each_sink_is_built_from_the_output_options_and_names_where_its_images_are():
    settings = SinkSettings("gs://b/out")

    class Output:  # the output group's values, as the job's spec has them
        samples_per_shard = 7

    wds = registry.sink_class("webdataset").from_options(settings, Output)
    assert isinstance(wds, WebDatasetSink) and wds.samples_per_shard == 7 and wds.settings is settings
    assert type(registry.sink_class("files").from_options(settings, Output)) is FilesSink
    assert WebDatasetSink.images_where("gs://b/out") == "gs://b/out/shards/*.tar"
    assert WebDatasetSink.manifest_note("gs://b/out") == ""
    assert FilesSink.images_where("gs://b/out") == "gs://b/out/images/"
    assert FilesSink.manifest_note("gs://b/out") == " (and gs://b/out/metadata.jsonl for Hugging Face imagefolder)"


def test_reading_the_table_imports_no_beam():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    code = ("import sys\nfrom transforms.sinks import registry\nregistry.description()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'apache_beam'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
