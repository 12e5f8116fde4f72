"""The row files a rerun replaces: no 'No shards found to finalize' warning when there are no rows, and the previous
run's file always replaced."""

import logging

import apache_beam as beam

from transforms.row_files import WriteRowFile


def _write(lines, prefix):
    with beam.Pipeline("FnApiRunner") as p:
        _ = p | beam.Create(lines).with_output_types(str) | WriteRowFile(prefix, ".jsonl")


def test_rerun_without_rows_replaces_silently(tmp_path, caplog):
    prefix = str(tmp_path / "errors")
    final = tmp_path / "errors-00000-of-00001.jsonl"
    _write(['{"id": "a"}'], prefix)
    assert final.read_text() == '{"id": "a"}\n'
    with caplog.at_level(logging.WARNING, logger="apache_beam.io.filebasedsink"):
        _write([], prefix)  # the previous file is replaced by an empty one
        assert final.read_text() == ""
        _write([], prefix)  # an empty file again over an empty file: Beam's WriteToText warned here
    assert final.read_text() == ""
    assert not [r for r in caplog.records if "No shards found" in r.getMessage()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["errors-00000-of-00001.jsonl"]
