"""The output formats (`--output_format`): one row per sink, the one place that names them.

The option's choices, its default (the first row) and its description (`--help`, docs/options.md's table, the Flex
Template's metadata.json) come from `SINKS`, and the job builds the sink of the chosen row (pipeline/graph.py).
Beam-free, as the option table that reads it is: a row names its sink class by module and class, imported only
when the job builds its graph (`sink_class`). Adding a sink is a `Sink` subclass (transforms/sinks/base.py) and a
row here.
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class SinkRow:
    """One --output_format: its value, what it writes (a few words for the option's description) and its sink."""

    name: str
    writes: str
    sink: str  # "module:Class" of its transforms.sinks.base.Sink subclass


SINKS = (
    SinkRow("files", "one object per image, metadata.jsonl for datasets", "transforms.sinks.files:FilesSink"),
    SinkRow("webdataset", "tar shards", "transforms.sinks.webdataset:WebDatasetSink"),
)

OUTPUT_FORMATS = tuple(row.name for row in SINKS)  # --output_format's choices
DEFAULT_OUTPUT_FORMAT = OUTPUT_FORMATS[0]


def description() -> str:
    """--output_format's one-line description: every format and what it writes."""
    each = [f"{row.name} ({row.writes})" for row in SINKS]
    listed = each[0] if len(each) == 1 else f"{', '.join(each[:-1])} or {each[-1]}"
    return f"Layout of the outputs: {listed}."


def sink_class(name: str) -> type:
    """The Sink subclass of --output_format `name` (importing it imports Beam); KeyError for an unknown name."""
    row = {r.name: r for r in SINKS}[str(name)]
    module, _, cls = row.sink.partition(":")
    return getattr(importlib.import_module(module), cls)
