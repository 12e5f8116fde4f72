"""The per-record boundary: whatever interpreting one record's data raises, of any exception type, becomes that
record's error row (its file and line), and every error row can be encoded by Beam and written as UTF-8 JSON; the
other records go on. Faults of a type no reader raises are injected into the real code path (monkeypatch), as the
fault tests inject inference faults."""

import os

import apache_beam as beam
import pytest
from apache_beam.coders.coders import FastPrimitivesCoder
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

from reference_files import png
from transforms import layout, references
from transforms.inputs import readers, validation
from transforms.inputs.readers import ReadRequests, parse_lines
from transforms.inputs.validation import RequestDefaults
from transforms.references import ReferenceLimits, ResolveReferences
from transforms.requests import GenerationRequest

D = RequestDefaults(height=32, width=32)


def _run(build):
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        build(p)


def _writable(row: dict) -> None:
    FastPrimitivesCoder().encode(row)
    layout.to_json_line(row).encode("utf-8")


# Lines no reader expected: JSON escapes kept (a lone surrogate, a NUL), numbers JSON cannot write back.
ODD = [
    r'{"prompt": "p", "\ud800": 1}',
    r'{"prompt": "p", "note": {"\udfff": [1e999]}}',
    r'{"prompt": "p", "reference_images": ["a\u0000b.png"]}',
    r'{"prompt": "p", "reference_images": ["\ud800.png"]}',
    r'{"prompt": "p", "reference_images": ["gs://b/\udcff.png"]}',
    r'{"prompt": "p", "id": "\ud800"}',
    r'{"\ud800": "p"}',
]


def test_records_no_reader_expected_are_error_rows_that_can_be_written(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_bytes(("\n".join(ODD + ['{"id": "ok", "prompt": "p", "x": 1e999}']) + "\n")
                     .encode("utf-8", "surrogatepass"))
    out = parse_lines(path.read_bytes(), str(path), "jsonl", D)
    rows = [r for r in out if isinstance(r, dict)]
    assert [r["line"] for r in rows] == list(range(1, len(ODD) + 1))
    assert [r["kind"] for r in rows] == ["invalid_record"] * 2 + ["invalid_reference"] * 3 + ["invalid_record"] * 2
    for row in rows:
        _writable(row)
    [ok] = [r for r in out if isinstance(r, GenerationRequest)]
    assert ok.metadata == '{"x":null}'

    def build(p):
        read = p | beam.Create([str(path)]) | ReadRequests("auto", D)
        assert_that(read["requests"] | beam.Map(lambda r: r.id), equal_to(["ok"]), label="requests")
        assert_that(read["invalid"] | beam.Map(lambda r: (r["source"], r["line"])),
                    equal_to([(str(path), n) for n in range(1, len(ODD) + 1)]), label="rows")
        _ = read["invalid"] | beam.Map(_writable)

    _run(build)


def test_any_exception_while_interpreting_a_record_is_its_row(tmp_path, monkeypatch):
    real = validation.derive_id

    def derive_id(prompt, *args):
        if prompt == "boom":
            raise KeyError("a fault no reader raises")
        return real(prompt, *args)

    monkeypatch.setattr(validation, "derive_id", derive_id)
    path = tmp_path / "p.txt"
    path.write_text("first\nboom\nlast\n")

    def build(p):
        read = p | beam.Create([str(path)]) | ReadRequests("auto", D)
        assert_that(read["requests"] | beam.Map(lambda r: r.prompt), equal_to(["first", "last"]), label="requests")
        assert_that(read["invalid"] | beam.Map(lambda r: (r["line"], r["kind"], r["reason"], r["record"])),
                    equal_to([(2, "invalid_record", "record could not be read: KeyError: 'a fault no reader raises'",
                               "boom")]), label="rows")

    _run(build)


def test_a_reader_that_raises_part_way_keeps_the_records_before_and_one_row(tmp_path, monkeypatch):
    real = readers.iter_raw_records

    def breaking(stream, source, fmt, *args):
        for n, raw in enumerate(real(stream, source, fmt, *args)):
            if n == 2:
                raise RuntimeError("the file's reader broke")
            yield raw

    monkeypatch.setattr(readers, "iter_raw_records", breaking)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"id": "r{i}", "prompt": "p{i}"}}\n' for i in range(5)))

    def build(p):
        read = p | beam.Create([str(path)]) | ReadRequests("auto", D)
        assert_that(read["requests"] | beam.Map(lambda r: r.id), equal_to(["r0", "r1"]), label="requests")
        assert_that(read["invalid"] | beam.Map(lambda r: (r["kind"], r["reason"])),
                    equal_to([("unreadable_input", "input file cannot be read to its end: RuntimeError: the file's "
                               "reader broke; the records from line 3 on were not read")]), label="rows")

    _run(build)


def test_a_bigquery_row_that_cannot_be_converted_is_its_row(monkeypatch):
    from transforms.inputs import bigquery

    def row_record(row, source):
        raise TypeError("a column type no reader knows")

    monkeypatch.setattr(bigquery, "row_record", row_record)
    fn = bigquery._ParseRowsFn("bq://p.d.t", D, validation.ColumnMap())
    fn.setup()
    [out] = list(fn.process({"prompt": "p"}))
    assert out.tag == "invalid" and out.value["source"] == "bq://p.d.t"
    assert out.value["reason"] == "record could not be read: TypeError: a column type no reader knows"


def test_any_exception_while_resolving_references_is_the_requests_row(tmp_path, monkeypatch):
    folder = tmp_path / "refs"
    folder.mkdir()
    (folder / "a.png").write_bytes(png(64, 64, seed=1))
    (folder / "b.png").write_bytes(png(80, 64, seed=2))
    real = references.reference_signature

    def signature(images, multiple):
        if images[0].size == (80, 64):
            raise ZeroDivisionError("a fault no reader raises")
        return real(images, multiple)

    monkeypatch.setattr(references, "reference_signature", signature)
    base = dict(prompt="p", seed=1, height=32, width=32, num_inference_steps=None, guidance_scale=None, num_images=1,
                source=str(tmp_path / "in.jsonl"))
    requests = [GenerationRequest(id="a", line=1, reference_images=(str(folder / "a.png"),), **base),
                GenerationRequest(id="b", line=2, reference_images=(str(folder / "b.png"),), **base),
                # built without validation: a path no file can have still reaches the resolver, and is its row
                GenerationRequest(id="nul", line=3, reference_images=(str(folder / "a\x00.png"),), **base),
                GenerationRequest(id="surrogate", line=4, reference_images=(str(folder / "\ud800.png"),), **base)]
    limits = ReferenceLimits(roots=(str(tmp_path),), cache_scope=os.urandom(8).hex())

    def build(p):
        out = p | beam.Create(requests) | ResolveReferences(limits, 16)
        assert_that(out["requests"] | beam.Map(lambda r: (r.id, r.reference_signature)),
                    equal_to([("a", ((64, 64),))]), label="requests")
        words = {"b": "could not be used: ZeroDivisionError: a fault no reader raises",
                 "nul": "cannot be opened as a path (ValueError", "surrogate": "cannot be opened as a path"}
        assert_that(out["invalid"] | beam.Map(lambda r: (r["id"], r["line"], r["kind"], words[r["id"]] in r["reason"],
                                                          r["source"])),
                    equal_to([(rid, line, "invalid_reference", True, base["source"])
                              for rid, line in (("b", 2), ("nul", 3), ("surrogate", 4))]), label="rows")
        _ = out["invalid"] | beam.Map(_writable)

    _run(build)


@pytest.mark.parametrize("text", ["\ud800", "a\udcffb", "\x00", 'q"uote'])
def test_an_error_row_can_always_be_written(text):
    row = layout.error_row(source=text, line=3, reason=text, record={text: text}, id=text, field=text,
                           value={text: [float("nan")]}, file_name=text)
    _writable(row)
    assert row["line"] == 3 and row["kind"] == "invalid_record"
