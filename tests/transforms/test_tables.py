"""Prompt tables: TSV and Parquet readers, column mapping, extra columns (metadata), BigQuery row conversion, the
launch-time header check and the warning for a text file that looks like a table."""

import datetime
import decimal
import json

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

from tables import damage_row_group, parquet_bytes, tsv_bytes
from transforms import layout
from transforms.inputs.bigquery import QUERY_SOURCE, BigQueryInput, dataset_reference, row_record, table_spec
from transforms.inputs.check import InputCheckError, check_input_files
from transforms.inputs.columns import ColumnError, ColumnMap, ColumnResolver, parse_column_map
from transforms.inputs.formats import InputFormatError, detect_format, header_warning
from transforms.inputs.identity import derive_id
from transforms.inputs.json_values import to_json_value
from transforms.inputs.readers import WARNING_TAG, ReadRequests, parse_lines
from transforms.inputs.validation import RequestDefaults, parse_raw
from transforms.requests import GenerationRequest

D = RequestDefaults(height=64, width=32, seed=7)


def requests_and_errors(out):
    return [o for o in out if isinstance(o, GenerationRequest)], [o for o in out if isinstance(o, dict)]


# ============================================================================================ TSV
BENCHMARK_TSV = tsv_bytes([
    ["Prompt", "Category", "Challenge", "Note"],
    ["A red fox in snow", "Animals", "Simple Detail", ""],
    ["A sign that says \"hello, world\"", "Text", "Quoted, with a comma", "from a paper"],
    ["tab\tinside a quoted cell", "Edge", "", "n"],
])


def test_tsv_header_is_never_a_prompt_and_extra_columns_are_metadata():
    out = parse_lines(BENCHMARK_TSV, "parti.tsv", "tsv", D)
    reqs, errors = requests_and_errors(out)
    assert errors == []
    assert [(r.line, r.prompt) for r in reqs] == [(2, "A red fox in snow"), (3, 'A sign that says "hello, world"'),
                                                    (4, "tab\tinside a quoted cell")]
    assert reqs[1].metadata_values() == {"Category": "Text", "Challenge": "Quoted, with a comma",
                                         "Note": "from a paper"}
    assert list(reqs[0].metadata_values()) == ["Category", "Challenge", "Note"]  # the table's column order
    # The prompt column is matched ignoring case ("Prompt"); the id is derived from the prompt as for any record.
    assert reqs[0].id == derive_id("A red fox in snow", 64, 32, None, None, 1, None)


def test_tsv_generation_columns_are_typed_from_text_and_bad_rows_name_their_line():
    data = tsv_bytes([["prompt", "seed", "height", "id", "tag"], ["a", "5", "32", "a1", "x"], ["b", "1.5", "", "b1", ""],
                      ["c", "", "", "c1", "z", "one too many"]])
    out = parse_lines(data, "p.tsv", "tsv", D)
    assert (out[0].seed, out[0].height, out[0].id, out[0].metadata_values()) == (5, 32, "a1", {"tag": "x"})
    assert out[1]["line"] == 3 and out[1]["field"] == "seed" and out[1]["id"] == "b1"
    assert out[1]["record"] == "b\t1.5\t\tb1\t"  # the row as written in the file
    assert out[2]["line"] == 4 and "TSV row has 6 fields, the header has 5" in out[2]["reason"]


def test_tsv_without_its_prompt_column_is_one_error_row_naming_the_columns():
    out = parse_lines(tsv_bytes([["text", "note"], ["a", "b"], ["c", "d"]]), "p.tsv", "tsv", D)
    assert len(out) == 1 and out[0]["kind"] == layout.UNREADABLE_INPUT and out[0]["line"] == 1
    assert "no prompt column 'prompt'" in out[0]["reason"] and "'text', 'note'" in out[0]["reason"]


def test_prompt_id_columns_and_column_map():
    data = tsv_bytes([["caption", "key", "cfg", "step", "prompt", "seed"],
                      ["a lake", "k1", "2.5", "3", "not the prompt here", "9"]])
    columns = ColumnMap(prompt_column="caption", id_column="key",
                        renames=parse_column_map("cfg=guidance_scale, step=num_inference_steps"))
    (r,) = parse_lines(data, "p.tsv", "tsv", D, columns)
    assert (r.prompt, r.id, r.guidance_scale, r.num_inference_steps, r.seed) == ("a lake", "k1", 2.5, 3, 9)
    assert r.metadata_values() == {"prompt": "not the prompt here"}  # a column named "prompt" is just a column now


@pytest.mark.parametrize("header, words", [
    (["prompt", "cfg", "guidance_scale"], "two columns for guidance_scale: 'cfg' and 'guidance_scale'"),
    (["Prompt", "PROMPT"], "several columns named like the prompt column"),
    (["prompt", "seed", "seed"], "names the column 'seed' more than once"),
])
def test_headers_that_cannot_give_requests(header, words):
    columns = ColumnMap(renames=parse_column_map("cfg=guidance_scale"))
    with pytest.raises(ColumnError, match=words):
        columns.resolve(header, "the header")
    out = parse_lines(tsv_bytes([header, ["x"] * len(header)]), "p.tsv", "tsv", D, columns)
    assert len(out) == 1 and words in out[0]["reason"]


@pytest.mark.parametrize("text, words", [
    ("cfg", "not of the form old=new"), ("cfg=", "not of the form"), ("a=prompt", "--prompt_column"),
    ("a=id", "--id_column"), ("a=colour", "'colour' is not one of"), ("a=seed,a=height", "renames the column 'a' twice"),
])
def test_column_map_errors_name_the_entry(text, words):
    with pytest.raises(ValueError, match=words):
        parse_column_map(text)


def test_column_options_that_contradict_each_other():
    for bad, words in [(ColumnMap(prompt_column="x", id_column="x"), "both name"),
                       (ColumnMap(prompt_column=" "), "--prompt_column must name a column"),
                       (ColumnMap(prompt_column="text", renames=(("text", "seed"),)), "prompt or id column")]:
        with pytest.raises(ValueError, match=words):
            bad.validate()


def test_jsonl_unknown_keys_are_metadata_and_the_prompt_key_follows_the_options():
    line = b'{"Prompt": "p", "uid": "u1", "style": {"a": [1, 2.5]}, "n": 3, "ok": true, "nothing": null}'
    (r,) = parse_lines(line, "a.jsonl", "jsonl", D, ColumnMap(id_column="uid"))
    assert (r.prompt, r.id) == ("p", "u1")
    assert r.metadata_values() == {"style": {"a": [1, 2.5]}, "n": 3, "ok": True, "nothing": None}
    (row,) = parse_lines(b'{"text": "p", "n": 1}', "a.jsonl", "jsonl", D)
    assert row["field"] == "prompt" and row["reason"].startswith("missing prompt") and "'text', 'n'" in row["reason"]


def test_metadata_bound_rejects_the_record_not_the_job():
    small = RequestDefaults(height=64, width=32, max_metadata_bytes=40)
    out = parse_lines(b'{"prompt": "a", "note": "short"}\n{"prompt": "b", "note": "' + b"x" * 100 + b'"}\n',
                      "a.jsonl", "jsonl", small)
    assert isinstance(out[0], GenerationRequest)
    assert out[1]["field"] == "metadata" and "above --max_metadata_bytes=40" in out[1]["reason"]
    assert "the largest: 'note'" in out[1]["reason"] and out[1]["value"] > 100
    none = RequestDefaults(height=64, width=32, max_metadata_bytes=0)
    assert isinstance(parse_lines(b'{"prompt": "a"}', "a.jsonl", "jsonl", none)[0], GenerationRequest)
    assert parse_lines(b'{"prompt": "a", "x": 1}', "a.jsonl", "jsonl", none)[0]["field"] == "metadata"


def test_metadata_that_cannot_be_written_as_utf8_is_an_error_row():
    (row,) = parse_lines(b'{"prompt": "a", "note": "\\ud800"}', "a.jsonl", "jsonl", D)
    assert row["field"] == "note" and "not valid Unicode" in row["reason"]


def test_unnamed_columns_are_metadata_only_when_they_hold_something():
    (a, b) = parse_lines(b"prompt\tnote\t\nx\tn\t\ny\tn\tleft over\n", "p.tsv", "tsv", D)
    assert a.metadata_values() == {"note": "n"} and b.metadata_values() == {"note": "n", "": "left over"}


# ============================================================================================ Parquet
def parquet_out(data: bytes, columns: ColumnMap = ColumnMap(), defaults=D):
    return parse_lines(data, "t.parquet", "parquet", defaults, columns)


def test_parquet_types_row_groups_dictionaries_and_nulls():
    import pyarrow as pa

    n = 10
    data = parquet_bytes({
        "prompt": [f"prompt {i}" for i in range(n)],
        "seed": [100 + i for i in range(n)],
        "height": [32 if i % 2 else None for i in range(n)],  # null: the default
        "width": pa.array([16] * n, pa.int16()),
        "guidance_scale": pa.array([1.5] * n, pa.float32()),
        "category": [["a", "b"][i % 2] for i in range(n)],
        "note": [None if i % 3 else f"n{i}" for i in range(n)],
        "score": [i / 4 for i in range(n)],
    }, row_group_size=3, dictionary=("prompt", "category"), types={"note": pa.large_string()})
    out = parquet_out(data)
    assert all(isinstance(o, GenerationRequest) for o in out), out
    assert [o.line for o in out] == list(range(1, n + 1))  # row numbers across the 4 row groups
    assert [(o.prompt, o.seed, o.height, o.width, o.guidance_scale) for o in out[:2]] == \
        [("prompt 0", 100, 64, 16, 1.5), ("prompt 1", 101, 32, 16, 1.5)]
    assert out[3].metadata_values() == {"category": "b", "note": "n3", "score": 0.75}
    assert out[1].metadata_values() == {"category": "b", "note": None, "score": 0.25}  # null stays null


@pytest.mark.parametrize("column, values, field, words", [
    ("prompt", ["ok", None], "prompt", "missing prompt"),
    ("prompt", [["nested"], ["x"]], "prompt", "prompt must be a string, got list"),
    ("prompt", [{"a": "b"}, {"a": "c"}], "prompt", "prompt must be a string, got dict"),
    ("prompt", [b"bytes", b"x"], "prompt", "prompt must be a string, got bytes"),
    ("seed", [1.0, 1.5], "seed", "seed must be an integer, got 1.5"),
    ("height", ["32", "48"], "height", "height must be an integer, got string"),
])
def test_parquet_bad_values_are_error_rows_as_for_json(column, values, field, words):
    columns = {"prompt": ["a", "b"], column: values}
    out = parquet_out(parquet_bytes(columns))
    bad = [o for o in out if isinstance(o, dict)]
    assert len(out) == 2 and len(bad) >= 1, out
    assert bad[-1]["line"] == 2 and bad[-1]["field"] == field and words in bad[-1]["reason"], bad
    json.dumps(bad[-1])
    if column == "seed":
        assert out[0].seed == 1  # an integral float seed is that integer, as in JSON


def test_truncated_parquet_is_one_error_row_naming_the_file():
    data = parquet_bytes({"prompt": ["a", "b", "c"]}, row_group_size=1)
    out = parquet_out(data[: len(data) - 20])
    assert [(o["source"], o["line"], o["kind"], o["field"]) for o in out] == \
        [("t.parquet", 1, layout.UNREADABLE_INPUT, "file")]
    assert "cannot be read as Parquet" in out[0]["reason"] and "none of its rows" in out[0]["reason"]


def test_damaged_row_group_keeps_the_rows_before_it():
    data = parquet_bytes({"prompt": [f"p{i}" for i in range(9)], "seed": list(range(9))}, row_group_size=3)
    out = parquet_out(damage_row_group(data, 2))
    reqs, errors = requests_and_errors(out)
    assert [r.prompt for r in reqs] == [f"p{i}" for i in range(6)]  # the first two row groups
    assert [(e["line"], e["kind"]) for e in errors] == [(7, layout.UNREADABLE_INPUT)]
    assert "row group 2 of 3 is damaged" in errors[0]["reason"] and "from row 7 on" in errors[0]["reason"]


def test_parquet_schema_without_the_prompt_column_is_one_error_row():
    out = parquet_out(parquet_bytes({"caption": ["a", "b"], "seed": [1, 2]}))
    assert len(out) == 1 and "the Parquet schema has no prompt column 'prompt'" in out[0]["reason"]
    assert "'caption', 'seed'" in out[0]["reason"]
    ok = parquet_out(parquet_bytes({"caption": ["a", "b"]}), ColumnMap(prompt_column="caption"))
    assert [o.prompt for o in ok] == ["a", "b"]


def test_compressed_parquet_is_refused_with_the_reason():
    import gzip

    out = parse_lines(gzip.compress(parquet_bytes({"prompt": ["a"]})), "t.parquet.gz", "parquet", D)
    assert len(out) == 1 and "cannot be read through gzip" in out[0]["reason"]


def test_json_values_of_typed_sources():
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    assert to_json_value({"t": when, "d": datetime.date(2026, 1, 2), "n": decimal.Decimal("1.10"),
                          "b": b"\x00\xff", "f": float("inf"), "l": (1, [2.5, None]), "m": [("k", 1)]}) == \
        {"t": "2026-01-02T03:04:05+00:00", "d": "2026-01-02", "n": "1.10", "b": "AP8=", "f": None,
         "l": [1, [2.5, None]], "m": [["k", 1]]}


# ============================================================================================ BigQuery rows
def test_bigquery_rows_as_beam_yields_them():
    """Beam's BigQuery reader yields a dict per row with Python types: the same mapping and checks as JSON."""
    columns = ColumnMap(prompt_column="text", renames=parse_column_map("cfg=guidance_scale"))
    resolver = ColumnResolver(columns)
    rows = [
        {"text": "a lighthouse", "seed": 3, "cfg": decimal.Decimal("2.5"), "height": decimal.Decimal("32"),
         "created": datetime.datetime(2026, 5, 1, 12, 0), "raw": b"\x01", "tags": ["x", "y"], "extra": None},
        {"text": None, "seed": 1},
        {"text": "p", "seed": 2.5},
        {"caption": "no text column"},
    ]
    out = [parse_raw(row_record(r, "bq://proj.ds.prompts"), D, resolver) for r in rows]
    r = out[0]
    assert (r.prompt, r.seed, r.guidance_scale, r.height, r.source, r.line) == \
        ("a lighthouse", 3, 2.5, 32, "bq://proj.ds.prompts", None)
    assert r.metadata_values() == {"created": "2026-05-01T12:00:00", "raw": "AQ==", "tags": ["x", "y"], "extra": None}
    assert [(e["line"], e["field"], e["reason"][:22]) for e in out[1:]] == [
        (None, "prompt", "missing prompt"), (None, "seed", "seed must be an intege"),
        (None, "prompt", "missing prompt: the re")]
    assert "'caption'" in out[3]["reason"]


def test_bigquery_names():
    assert table_spec("bq://my-project.prompts.parti") == "my-project:prompts.parti"
    assert table_spec("bq://example.com:proj.ds.t") == "example.com:proj:ds.t"
    for bad in ("bq://ds.table", "bq://p.ds.", "bq://p..t", "bq://p.ds.t/x"):
        with pytest.raises(ValueError, match="bq://project.dataset.table"):
            table_spec(bad)
    assert BigQueryInput(uri="bq://p.d.t").source == "bq://p.d.t" and BigQueryInput(query="SELECT 1").source == \
        QUERY_SOURCE
    ref = dataset_reference("proj.tmp", None)
    assert (ref.projectId, ref.datasetId) == ("proj", "tmp")
    assert dataset_reference("tmp", "dflt").projectId == "dflt"
    with pytest.raises(ValueError, match="--bigquery_temp_dataset"):
        dataset_reference("tmp", None)


# ============================================================================================ formats, launch check
def test_detect_format_for_tables():
    assert [detect_format(p) for p in ("a.tsv", "a.TSV.gz", "a.parquet", "b.pq", "c.tab")] == \
        ["tsv", "tsv", "parquet", "parquet", "tsv"]
    assert detect_format("notes.txt", "tsv") == "tsv"
    for table in ("a.tsv", "a.csv.gz", "a.parquet"):
        with pytest.raises(InputFormatError, match="never read as plain text"):
            detect_format(table, "text")


@pytest.mark.parametrize("line, looks", [
    ("prompt\tcategory\tnote", True), ("Prompt,Category", True), ('"id","prompt"', True), ("a cat, a dog", False),
    ("a red fox in the snow", False), ("seed", False),
])
def test_header_warning(line, looks):
    assert (header_warning(line, ColumnMap().known_names()) is not None) == looks


def test_launch_check_names_the_columns_a_table_has(tmp_path):
    (tmp_path / "ok.tsv").write_bytes(BENCHMARK_TSV)
    (tmp_path / "bad.tsv").write_bytes(tsv_bytes([["caption", "cat"], ["a", "b"]]))
    (tmp_path / "bad.parquet").write_bytes(parquet_bytes({"caption": ["a"]}))
    (tmp_path / "cut.parquet").write_bytes(parquet_bytes({"caption": ["a"]})[:30])  # left to the job: an error row
    # records, not a table: one with the prompt among the first is enough, the rest are checked per record
    (tmp_path / "p.jsonl").write_text('{"prompt": "y"}\n{"caption": "x"}\n')
    paths = [str(tmp_path / n) for n in ("ok.tsv", "cut.parquet", "p.jsonl")]
    assert check_input_files(paths, "auto", ColumnMap()) == []
    for name, words in (("bad.tsv", "its header has no prompt column 'prompt' (--prompt_column); its columns are: "
                                    "'caption', 'cat'"),
                        ("bad.parquet", "its Parquet schema has no prompt column 'prompt'")):
        with pytest.raises(InputCheckError) as e:
            check_input_files(paths + [str(tmp_path / name)], "auto", ColumnMap())
        assert str(tmp_path / name) in str(e.value) and words in str(e.value)
    warnings = check_input_files([str(tmp_path / "ok.tsv")], "auto", ColumnMap(renames=(("cfg", "guidance_scale"),)))
    assert len(warnings) == 1 and "renames 'cfg'" in warnings[0] and "'Prompt', 'Category'" in warnings[0]
    with pytest.raises(InputCheckError, match="never read as plain text"):
        check_input_files([str(tmp_path / "ok.tsv")], "text", ColumnMap())


# ============================================================================================ in Beam
def test_read_tables_in_beam_local_and_gcs(tmp_path, gcs_emulator, gcs_bucket):
    """TSV and Parquet through ReadRequests on local files and gs:// objects; a text file with a header warns."""
    parquet = parquet_bytes({"prompt": [f"q{i}" for i in range(7)], "seed": list(range(7))}, row_group_size=2,
                            dictionary=("prompt",))
    (tmp_path / "a.tsv").write_bytes(BENCHMARK_TSV)
    (tmp_path / "b.parquet").write_bytes(parquet)
    (tmp_path / "c.txt").write_bytes(b"prompt\tcategory\nan owl\tbirds\n")
    gcs_emulator.upload_bytes(f"gs://{gcs_bucket}/in/a.tsv", BENCHMARK_TSV)
    gcs_emulator.upload_bytes(f"gs://{gcs_bucket}/in/b.parquet", parquet)

    def build(p):
        read = p | beam.Create([str(tmp_path / "*"), f"gs://{gcs_bucket}/in/*"]) | ReadRequests("auto", D)
        assert_that(read["requests"] | beam.Map(lambda r: r.source.split("/")[0] + r.source.rsplit(".", 1)[-1])
                    | beam.combiners.Count.PerElement(),
                    equal_to([("tsv", 3), ("parquet", 7), ("txt", 2), ("gs:tsv", 3), ("gs:parquet", 7)]),
                    label="requests")
        assert_that(read["invalid"], equal_to([]), label="invalid")
        assert_that(read[WARNING_TAG] | beam.Map(lambda w: (w["source"].rsplit("/", 1)[-1], w["line"],
                                                            "contains tabs" in w["warning"])),
                    equal_to([("c.txt", 1, True)]), label="warnings")

    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        build(p)


def test_read_a_damaged_parquet_object_on_gcs(gcs_emulator, gcs_bucket):
    data = parquet_bytes({"prompt": [f"p{i}" for i in range(6)]}, row_group_size=2)
    gcs_emulator.upload_bytes(f"gs://{gcs_bucket}/in/damaged.parquet", damage_row_group(data, 1))
    gcs_emulator.upload_bytes(f"gs://{gcs_bucket}/in/cut.parquet", data[:-10])

    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        read = p | beam.Create([f"gs://{gcs_bucket}/in/*.parquet"]) | ReadRequests("auto", D)
        assert_that(read["requests"] | beam.Map(lambda r: r.prompt), equal_to(["p0", "p1"]), label="requests")
        assert_that(read["invalid"] | beam.Map(lambda e: (e["source"].rsplit("/", 1)[-1], e["line"], e["kind"])),
                    equal_to([("damaged.parquet", 3, layout.UNREADABLE_INPUT), ("cut.parquet", 1,
                                                                                  layout.UNREADABLE_INPUT)]),
                    label="invalid")


def test_text_file_read_as_asked_keeps_every_line(tmp_path):
    out = parse_lines(b"prompt,seed\na cat,3\n", "p.txt", "text", D)
    assert [o.prompt for o in out] == ["prompt,seed", "a cat,3"]  # read as asked; the job warns (see above)


# ---------------------------------------------------------------------------------------------- Parquet bombs

PARQUET_BOMB = r'''
import io, json, sys
import pyarrow as pa, pyarrow.parquet as pq
from transforms.inputs.columns import ColumnMap
from transforms.inputs.parquet import iter_parquet
big = "x" * (1 << 20)                       # 1 MiB, stored once in the dictionary page
huge = "y" * (20 << 20)                      # 20 MiB: above the 16 MiB bound for one record
indices = pa.array([0] * 2047 + [1, 2], pa.int32())  # built as a dictionary array: nothing expanded here
prompts = pa.DictionaryArray.from_arrays(indices, pa.array([big, huge, "a fox"]))
buf = io.BytesIO()
pq.write_table(pa.table({"prompt": prompts}), buf, compression="zstd", use_dictionary=True)
data = buf.getvalue()
good = errors = 0
last = None
for rec in iter_parquet(io.BytesIO(data), "bomb.parquet", ColumnMap()):
    if rec.error is not None:
        errors += 1
        reason = rec.error["reason"]
    else:
        good += 1
        last = rec.fields["prompt"][:5]
print(json.dumps([len(data), good, errors, reason[:40], last, int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])]))
'''


def test_a_parquet_dictionary_bomb_reads_within_bounded_memory():
    """A few KB of Parquet whose dictionary page stands for 2 GiB of strings: rows are sized from the dictionary
    before any is expanded, expanded at most 16 MiB at a time, and a row above the record bound is an error row
    that is never expanded; peak RSS (VmHWM: ru_maxrss would count the forking test process) stays far below."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PARQUET_BOMB], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    size, good, errors, reason, last, rss_kib = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"parquet bomb: {size / 1e3:.1f} KB -> 2 GiB of strings; peak RSS {rss_kib / 1024:.0f} MiB")
    assert size < 200_000 and good == 2048 and errors == 1 and reason.startswith("row is too long")
    assert last == "a fox" and rss_kib < 600 * 1024
