"""Records -> validated requests or error rows: formats, every rejection reason, stable ids and seeds, dedup."""

import json

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import given, settings
from hypothesis import strategies as st

from model.contract import MAX_SEED
from transforms import layout
from transforms.inputs.formats import detect_format
from transforms.inputs.identity import derive_id
from transforms.inputs.readers import ReadRequests, parse_lines
from transforms.inputs.validation import RequestDefaults
from transforms.requests import DUPLICATE_TAG, DeduplicateRequests, GenerationRequest

D = RequestDefaults(height=64, width=32, seed=7)


def one(line: bytes, fmt="jsonl", defaults=D):
    out = parse_lines(line, "src." + fmt, fmt, defaults)
    assert len(out) == 1, out
    return out[0]


def rejected(line, fmt="jsonl", defaults=D):
    row = one(line, fmt, defaults)
    assert isinstance(row, dict), row
    assert row["source"] == "src." + fmt and row["line"] == 1 and row["kind"] == layout.INVALID_RECORD
    return row


def test_valid_record_applies_defaults_and_derives_id_and_seed():
    r = one(b'{"prompt": "a cat"}')
    assert isinstance(r, GenerationRequest)
    assert (r.prompt, r.height, r.width, r.num_images, r.num_inference_steps, r.guidance_scale) == \
        ("a cat", 64, 32, 1, None, None)
    assert layout.image_file_name(r.id, 0, 1) == f"images/{r.id}.png"
    assert 0 <= r.seed < 2**32
    # Same content -> same id and seed; another --seed -> same id, another seed.
    again = one(b'{"prompt": "a cat"}')
    assert (again.id, again.seed) == (r.id, r.seed)
    other = one(b'{"prompt": "a cat"}', defaults=RequestDefaults(height=64, width=32, seed=8))
    assert other.id == r.id and other.seed != r.seed
    # Any parameter change changes the id.
    assert one(b'{"prompt": "a cat", "height": 32}').id != r.id
    assert one(b'{"prompt": "a cat", "seed": 3}').id != r.id


def test_explicit_fields():
    r = one(b'{"id": "x_1.a-b", "prompt": "p", "seed": 5, "height": 48, "width": 16, "num_inference_steps": 3, '
            b'"guidance_scale": 2, "num_images": 3, "extra": "ignored"}')
    assert (r.id, r.seed, r.height, r.width, r.num_inference_steps, r.guidance_scale, r.num_images) == \
        ("x_1.a-b", 5, 48, 16, 3, 2.0, 3)
    assert [t.file_name for t in r.tasks()] == ["images/x_1.a-b-0.png", "images/x_1.a-b-1.png",
                                                "images/x_1.a-b-2.png"]
    assert [t.seed for t in r.tasks()] == [5, 6, 7]
    assert len({t.shape_key for t in r.tasks()}) == 1
    assert one(b'{"id": 17, "prompt": "p"}').id == "17"
    assert one(b'{"prompt": "p", "height": 64.0}').height == 64


@pytest.mark.parametrize("line, field, words", [
    (b'{"prompt": "a", ', "record", "malformed JSON"),
    (b'["a"]', "record", "JSON object"),
    (b'{"prompt": "x", "seed": NaN}', "record", "malformed JSON"),
    (b'{"id": "a"}', "prompt", "missing prompt"),
    (b'{"prompt": null}', "prompt", "missing prompt"),
    (b'{"prompt": 12}', "prompt", "prompt must be a string"),
    (b'{"prompt": ["a"]}', "prompt", "prompt must be a string"),
    (b'{"prompt": "   "}', "prompt", "prompt is empty"),
    (b'{"prompt": "p", "height": "512"}', "height", "height must be an integer"),
    (b'{"prompt": "p", "width": true}', "width", "width must be an integer"),
    (b'{"prompt": "p", "height": 100}', "height", "positive multiple of 16"),
    (b'{"prompt": "p", "width": 0}', "width", "positive multiple of 16"),
    (b'{"prompt": "p", "height": -16}', "height", "positive multiple of 16"),
    (b'{"prompt": "p", "height": 4096, "width": 2048}', "height", "max_pixels"),
    (b'{"prompt": "p", "num_inference_steps": 0}', "num_inference_steps", "num_inference_steps must be in"),
    (b'{"prompt": "p", "num_inference_steps": 1001}', "num_inference_steps", "num_inference_steps must be in"),
    (b'{"prompt": "p", "num_inference_steps": 2.5}', "num_inference_steps", "must be an integer"),
    (b'{"prompt": "p", "guidance_scale": "high"}', "guidance_scale", "must be a number"),
    (b'{"prompt": "p", "guidance_scale": -1}', "guidance_scale", "guidance_scale must be >= 0"),
    (b'{"prompt": "p", "num_images": 0}', "num_images", "num_images must be in"),
    (b'{"prompt": "p", "seed": -1}', "seed", "seed must be a non-negative integer"),
    (b'{"prompt": "p", "seed": 1.5}', "seed", "seed must be an integer"),
    (b'{"prompt": "p", "seed": "7"}', "seed", "seed must be an integer"),
    (b'{"prompt": "p", "seed": 9223372036854775808}', "seed", "seed must be a non-negative integer"),
    (b'{"prompt": "p", "id": "tab\\there"}', "id", "U+0009 (Cc, not printable)"),
    (b'{"prompt": "p", "id": "nul\\u0000"}', "id", "U+0000 (Cc, not printable)"),
    (b'{"prompt": "p", "id": "zero\\u200bwidth"}', "id", "U+200B (Cf, not printable)"),
    (b'{"prompt": "p", "id": ""}', "id", "1-256 printable characters, got an empty id"),
    (b'{"prompt": "p", "id": "   "}', "id", "1-256 printable characters, got a blank id"),
    (b'{"prompt": "p", "id": "' + b"a" * 257 + b'"}', "id", "got 257 characters"),
    (b'{"prompt": "p", "id": ["a"]}', "id", "id must be a string"),
    (b'{"prompt": "caf\xe9"}', "encoding", "not valid UTF-8"),
])
def test_invalid_records_give_one_error_row_with_reason(line, field, words):
    row = rejected(line)
    assert words in row["reason"], row
    assert row["field"] == field
    assert row["record"] == line.decode("utf-8", errors="backslashreplace")  # the record as written
    json.dumps(row)  # every row is JSON-serialisable


def test_natural_ids_are_kept_exactly_and_named_readably():
    """An id of printable characters is the request's id as given (manifest, image text, error rows); its images get
    a safe readable name with a hash of the exact id. Ids of the earlier rule keep their names (old outputs resume)."""
    import hashlib

    def digest(text):
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    for given, name in (("img 0001", f"images/img_0001-{digest('img 0001')}.png"),
                        ("café-1", f"images/cafe-1-{digest('café-1')}.png"),
                        ("a/b/../c", f"images/a_b_.._c-{digest('a/b/../c')}.png"),
                        (".hidden", f"images/hidden-{digest('.hidden')}.png"),
                        ("日本", f"images/{digest('日本')}.png"),
                        ("cat", "images/cat.png"), ("x_1.a-b", "images/x_1.a-b.png"),
                        ("a" * 128, f"images/{'a' * 128}.png")):
        for fmt, data in (("jsonl", json.dumps({"id": given, "prompt": "p"}, ensure_ascii=False).encode()),
                          ("csv", f'id,prompt\n"{given}",p\n'.encode())):
            r = one(data, fmt)
            assert isinstance(r, GenerationRequest), r
            assert r.id == given and [t.file_name for t in r.tasks()] == [name], (fmt, given)
    two = one(json.dumps({"id": "img 0001", "prompt": "p", "num_images": 2}).encode())
    assert [t.file_name for t in two.tasks()] == [f"images/img_0001-{digest('img 0001')}-{j}.png" for j in (0, 1)]
    # the id decides the seed as given: the same id in another spelling is another request
    assert one(b'{"id": "img 0001", "prompt": "p"}').seed != one(b'{"id": "img_0001", "prompt": "p"}').seed


def test_error_rows_carry_the_id_as_given():
    row = rejected(json.dumps({"id": "img 0001", "prompt": "p", "height": 7}).encode())
    assert row["id"] == "img 0001" and row["field"] == "height"
    row = rejected(b'{"id": "tab\\there", "prompt": "p"}')
    assert row["id"] == "tab\there" and row["field"] == "id"
    row = rejected(json.dumps({"id": "x" * 300, "prompt": "p"}).encode())
    assert row["id"].startswith("x" * 256) and "more chars" in row["id"]
    row = rejected(b'{"id": 17, "prompt": "p", "height": 7}')
    assert row["id"] == "17"
    row = rejected(b'{"prompt": "p", "height": 7}')  # no id: the row's source and line name the record
    assert row["id"] is None and (row["source"], row["line"]) == ("src.jsonl", 1)


def test_an_id_that_is_another_ids_safe_name_is_a_collision(tmp_path):
    """'img 0001' is stored as img_0001-<hash>.png; a later request whose id is that very name is rejected, and the
    row names both ids and the file."""
    stem = layout.image_stem("img 0001")
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "img 0001", "prompt": "fox"}) + "\n"
                                      + json.dumps({"id": stem, "prompt": "whale"}) + "\n"
                                      + json.dumps({"id": "img 0002", "prompt": "free"}) + "\n")

    def build(p):
        dedup = p | beam.Create([str(tmp_path / "a.jsonl")]) | ReadRequests("auto", D)
        dedup = dedup["requests"] | DeduplicateRequests()
        assert_that(dedup["requests"] | beam.Map(lambda r: r.id), equal_to(["img 0001", "img 0002"]), label="kept")
        assert_that(dedup["invalid"] | "rows" >> beam.Map(
            lambda row: (row["id"], row["line"], row["kind"], row["file_name"], "request 'img 0001'" in row["reason"],
                         "safe form" in row["reason"])),
            equal_to([(stem, 2, layout.FILE_NAME_COLLISION, f"images/{stem}.png", True, True)]), label="invalid")

    _run(build)


def test_seed_upper_bound_leaves_room_for_every_image():
    ok = one(json.dumps({"prompt": "p", "seed": MAX_SEED - 2, "num_images": 2}).encode())
    assert [t.seed for t in ok.tasks()] == [MAX_SEED - 2, MAX_SEED - 1]
    rejected(json.dumps({"prompt": "p", "seed": MAX_SEED - 1, "num_images": 2}).encode())


def test_error_rows_keep_the_id_when_it_is_valid_and_truncate_the_record():
    row = rejected(json.dumps({"id": "ok", "prompt": "p" * 5000, "height": 7}).encode())
    assert row["id"] == "ok" and row["value"] == 7
    assert len(row["record"]) < 1100 and "more chars" in row["record"]


def test_jsonl_line_numbers_skip_blank_lines_and_bom():
    out = parse_lines(b'\xef\xbb\xbf{"prompt": "a"}\n\n  \n{"prompt": 1}\r\n{"prompt": "c"}', "f.jsonl", "jsonl", D)
    assert [(type(o).__name__, o.line if hasattr(o, "line") else o["line"]) for o in out] == \
        [("GenerationRequest", 1), ("dict", 4), ("GenerationRequest", 5)]


def test_csv_with_header_multiline_fields_and_bad_rows():
    data = (b'id,prompt,height,seed\r\n'
            b'a,"two\nlines",32,1\r\n'
            b'b,,32,\r\n'
            b'c,hello,abc,\r\n'
            b'd,x,16,1,extra\r\n'
            b'\xff,bad,16,\r\n'
            b'\r\n'
            b'e,"quoted, comma",,\r\n')
    out = parse_lines(data, "p.csv", "csv", D)
    summary = [(o.id, o.line, o.prompt, o.height) if isinstance(o, GenerationRequest) else (o["line"], o["reason"])
               for o in out]
    assert summary[0] == ("a", 2, "two\nlines", 32)
    assert summary[1] == (4, "missing prompt")
    assert summary[2][0] == 5 and "height must be an integer" in summary[2][1]
    assert summary[3][0] == 6 and "fields" in summary[3][1]
    assert summary[4][0] == 7 and "UTF-8" in summary[4][1]
    assert summary[5] == ("e", 9, "quoted, comma", 64)
    assert out[0].seed == 1  # CSV numbers are parsed from text; empty cells mean "not given"


def test_malformed_csv_rows_cite_their_first_line():
    """A row the CSV reader cannot parse (text after a closing quote; a quote never closed) names its line and
    carries that line's text, so the row can be found and fixed."""
    out = parse_lines(b'id,prompt\nok,fine\nbad,"quoted"tail\nlast,"never closed\nmore text\n', "p.csv", "csv", D)
    rows = [(o["line"], o["record"], o["reason"][:17]) for o in out if isinstance(o, dict)]
    assert rows == [(3, 'bad,"quoted"tail', "malformed CSV row"), (4, 'last,"never closed', "malformed CSV row")]
    assert [o.id for o in out if isinstance(o, GenerationRequest)] == ["ok"]


def test_csv_without_prompt_column_is_one_error_row_naming_the_columns():
    """The launch refuses such a file; should one still reach a worker, it is one row for the file, not one per row."""
    out = parse_lines(b"text,height\nhello,32\nbye,16\n", "p.csv", "csv", D)
    assert [(o["line"], o["kind"], o["field"]) for o in out] == [(1, layout.UNREADABLE_INPUT, "prompt")]
    assert "no prompt column 'prompt'" in out[0]["reason"] and "'text', 'height'" in out[0]["reason"]
    assert "none of the file's records were read" in out[0]["reason"]


def test_text_lines_are_prompts():
    out = parse_lines(b"a red fox\n\n  spaced out  \n\xfe\xff\nlast", "p.txt", "text", D)
    assert [(o.prompt, o.line) if isinstance(o, GenerationRequest) else o["line"] for o in out] == \
        [("a red fox", 1), ("spaced out", 3), 4, ("last", 5)]


def test_detect_format():
    assert detect_format("gs://b/x/p.jsonl") == "jsonl"
    assert detect_format("p.NDJSON") == "jsonl"
    assert detect_format("/tmp/p.csv.gz") == "csv"
    assert detect_format("p.txt") == "text"
    assert detect_format("prompts") == "text"
    assert detect_format("p.txt", "csv") == "csv"
    with pytest.raises(ValueError):
        detect_format("p.txt", "xml")


def test_defaults_are_validated():
    RequestDefaults().validate()
    for bad in (dict(height=100), dict(num_inference_steps=0), dict(num_images=0), dict(seed=-1),
                dict(guidance_scale=-2.0), dict(height=4096, width=4096)):
        with pytest.raises(ValueError):
            RequestDefaults(**bad).validate()


@settings(max_examples=200, deadline=None)
@given(prompt=st.text(min_size=1).filter(lambda s: s.strip()), h=st.integers(1, 16), w=st.integers(1, 16),
       steps=st.none() | st.integers(1, 1000), guidance=st.none() | st.floats(0, 50),
       n=st.integers(1, 4), seed=st.none() | st.integers(0, 2**62))
def test_property_derived_ids_are_valid_and_stable(prompt, h, w, steps, guidance, n, seed):
    rec = {"prompt": prompt, "height": h * 16, "width": w * 16, "num_inference_steps": steps,
           "guidance_scale": guidance, "num_images": n, "seed": seed}
    line = json.dumps(rec).encode()
    a, b = one(line), one(line)
    assert isinstance(a, GenerationRequest) and a == b
    assert a.id == derive_id(prompt, h * 16, w * 16, steps, guidance, n, seed)
    assert layout.image_file_name(a.id, n - 1, n).startswith("images/" + a.id)
    assert 0 <= a.seed and a.seed + n - 1 < MAX_SEED


def _run(build):
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        build(p)


def test_read_and_deduplicate_in_beam(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(
        b'{"id": "same", "prompt": "p"}\n{"id": "same", "prompt": "p"}\n'
        b'{"id": "clash", "prompt": "first"}\n{"id": "clash", "prompt": "second"}\nnot json\n')
    (tmp_path / "b.txt").write_bytes(b"hello\nworld\n")
    (tmp_path / "c.csv").write_bytes(b"prompt,id\nfrom csv,csv1\n")

    def build(p):
        read = (p | beam.Create([str(tmp_path / "*.jsonl"), str(tmp_path / "b.txt"), str(tmp_path / "c.csv")])
                | ReadRequests("auto", D))
        dedup = read["requests"] | DeduplicateRequests()
        assert_that(dedup["requests"] | "ids" >> beam.Map(lambda r: (r.id, r.prompt, r.line)), equal_to([
            ("same", "p", 1), ("clash", "first", 3), (derive_id("hello", 64, 32, None, None, 1, None), "hello", 1),
            (derive_id("world", 64, 32, None, None, 1, None), "world", 2), ("csv1", "from csv", 2)]),
            label="requests")
        assert_that(read["invalid"] | "bad" >> beam.Map(lambda row: (row["line"], row["reason"][:14])),
                    equal_to([(5, "malformed JSON")]), label="invalid")
        assert_that(dedup["invalid"] | "clash" >> beam.Map(lambda row: (row["id"], row["line"], row["kind"],
                                                                          "conflicting" in row["reason"])),
                    equal_to([("clash", 4, layout.DUPLICATE_ID, True)]), label="conflicts")
        assert_that(dedup[DUPLICATE_TAG] | "dups" >> beam.Map(lambda r: (r.id, r.line)), equal_to([("same", 2)]),
                    label="duplicates")

    _run(build)


def test_read_in_beam_reports_unreadable_files_and_keeps_what_precedes_the_damage(tmp_path):
    """A cut .gz gives its complete lines' records plus one error row; a non-gzip .gz and a folder give one error
    row each; the same file spelled two ways is read once; nothing stops the job."""
    import gzip

    whole = b"".join(b'{"id": "g%d", "prompt": "p%d"}\n' % (i, i) for i in range(2000))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(whole)[:-9])  # only the gzip trailer (CRC, size) is cut
    (tmp_path / "fake.txt.gz").write_bytes(b"plain text, not gzip\n")
    (tmp_path / "ok.txt").write_bytes(b"one prompt\n")
    (tmp_path / "sub.txt").mkdir()  # a glob leaves folders out; the folder itself (the launch refuses it) is an error

    def build(p):
        read = (p | beam.Create([str(tmp_path / "*.gz"), str(tmp_path / "*.txt"), str(tmp_path / "." / "ok.txt"),
                                 str(tmp_path / "sub.txt")])
                | ReadRequests("auto", D))
        assert_that(read["requests"] | beam.combiners.Count.Globally(), equal_to([2001]), label="requests")
        assert_that(read["invalid"] | "rows" >> beam.Map(lambda row: (row["source"].rsplit("/", 1)[-1], row["line"],
                                                                      row["kind"], row["reason"][:40].strip())),
                    equal_to([("cut.jsonl.gz", 2001, layout.UNREADABLE_INPUT, "input file cannot be read to its end:"
                                                                              " th"),
                              ("fake.txt.gz", 1, layout.UNREADABLE_INPUT, "input file cannot be read to its end:"
                                                                          " no"),
                              ("sub.txt", None, layout.UNREADABLE_INPUT, "input file cannot be opened: it is a fol")]),
                    label="invalid")

    _run(build)


def test_read_in_beam_from_gcs_objects_stored_gzip_encoded(gcs_emulator, gcs_bucket):
    """`gsutil cp -Z` stores gzip bytes under the plain name with Content-Encoding gzip, and Beam's GCS reader
    returns them as stored: they are decompressed (a cut one keeps its complete lines; a .gz file uploaded so, gzip
    inside gzip, both times), plain objects read as-is, and one Beam will not open is an error row."""
    import gzip

    def upload(name, data, encoding=None):
        blob = gcs_emulator.client().bucket(gcs_bucket).blob(name)
        blob.content_encoding = encoding
        blob.upload_from_string(data, content_type="text/plain")

    lines = b"".join(b'{"id": "z%d", "prompt": "p%d"}\n' % (i, i) for i in range(300))
    upload("in/zipped.jsonl", gzip.compress(lines), "gzip")
    upload("in/cut.jsonl", gzip.compress(lines)[:-9], "gzip")
    upload("in/plain.txt", "un prompt \u00e9t\u00e9\n".encode())
    # `gsutil cp -Z prompts.jsonl.gz`: gzip inside gzip, both layers undone (one by the suffix, one by the bytes)
    upload("in/twice.jsonl.gz", gzip.compress(gzip.compress(lines)), "gzip")
    # Beam refuses gzip-encoded objects typed application/gzip ("doubly compressed"): one error row, not a crash.
    blob = gcs_emulator.client().bucket(gcs_bucket).blob("in/double.jsonl.gz")
    blob.content_encoding = "gzip"
    blob.upload_from_string(gzip.compress(gzip.compress(lines)), content_type="application/gzip")

    def build(p):
        read = p | beam.Create([f"gs://{gcs_bucket}/in/*"]) | ReadRequests("auto", D)
        assert_that(read["requests"] | beam.Map(lambda r: (r.source.rsplit("/", 1)[-1], r.id)) | beam.Distinct()
                    | beam.combiners.Count.PerKey(), equal_to([("zipped.jsonl", 300), ("cut.jsonl", 300),
                                                               ("plain.txt", 1), ("twice.jsonl.gz", 300)]),
                    label="requests")
        assert_that(read["invalid"] | "rows" >> beam.Map(lambda row: (row["source"].rsplit("/", 1)[-1], row["line"],
                                                                      row["kind"])),
                    equal_to([("cut.jsonl", 301, layout.UNREADABLE_INPUT),
                              ("double.jsonl.gz", None, layout.UNREADABLE_INPUT)]), label="invalid")
        assert_that(read["invalid"] | "why" >> beam.Filter(lambda row: row["line"] is None)
                    | beam.Map(lambda row: row["reason"]),
                    equal_to(["input file cannot be opened: Doubly compressed files not supported."]), label="why")

    _run(build)


def test_file_name_collisions_reject_the_later_request(tmp_path):
    """Request 'x' with 2 images writes x-0.png and x-1.png; a later request with id 'x-1' would overwrite one."""
    (tmp_path / "a.jsonl").write_bytes(b'{"id": "x", "prompt": "fox", "num_images": 2}\n'
                                       b'{"id": "x-1", "prompt": "whale"}\n{"id": "x-2", "prompt": "free"}\n')

    def build(p):
        dedup = p | beam.Create([str(tmp_path / "a.jsonl")]) | ReadRequests("auto", D)
        dedup = dedup["requests"] | DeduplicateRequests()
        assert_that(dedup["requests"] | beam.Map(lambda r: r.id), equal_to(["x", "x-2"]), label="kept")
        assert_that(dedup["invalid"] | "rows" >> beam.Map(lambda row: (row["id"], row["line"], row["kind"],
                                                                        "images/x-1.png" in row["reason"])),
                    equal_to([("x-1", 2, layout.FILE_NAME_COLLISION, True)]), label="invalid")

    _run(build)


def test_repeated_json_keys_are_rejected():
    row = rejected(b'{"prompt": "a", "id": "k", "prompt": "b"}')
    assert "'prompt' more than once" in row["reason"] and row["field"] == "prompt"


def test_text_with_cr_only_line_endings_is_rejected_not_merged():
    row = rejected(b"one\rtwo\rthree\r", fmt="text")
    assert "carriage return" in row["reason"]
    assert isinstance(one(b"crlf line\r\n", fmt="text"), GenerationRequest)


def test_csv_row_with_an_undecodable_line_is_rejected_whole():
    out = parse_lines(b'prompt,id\n"first part\ncaf\xe9\nlast part",q1\nnext,n1\n', "s.csv", "csv", D)
    assert [(type(o).__name__, o["line"] if isinstance(o, dict) else o.id) for o in out] == \
        [("dict", 3), ("GenerationRequest", "n1")]
    assert "not valid UTF-8" in out[0]["reason"]


def test_csv_header_problems_are_one_error_row_for_the_file():
    out = parse_lines(b"prompt,prompt\na,b\nc,d\n", "s.csv", "csv", D)
    assert len(out) == 1 and "'prompt' more than once" in out[0]["reason"] and out[0]["line"] == 1
    out = parse_lines(b"pr\xffompt\nx\n", "s.csv", "csv", D)
    assert [o["line"] for o in out] == [1] and "header (line 1) cannot be read" in out[0]["reason"]
    assert "not valid UTF-8" in out[0]["reason"] and out[0]["kind"] == layout.UNREADABLE_INPUT


def test_csv_prompts_up_to_max_prompt_bytes_are_read():
    big = "x" * 200_000
    data = f"prompt,id\n{big},big\nsmall,s\n".encode()
    out = parse_lines(data, "s.csv", "csv", RequestDefaults(height=64, width=32, max_prompt_bytes=300_000))
    assert [o.id for o in out] == ["big", "s"] and len(out[0].prompt) == 200_000
    out = parse_lines(data, "s.csv", "csv", D)  # default limit: a clear reason, the next row still read
    assert "longer than" in out[0]["reason"] and out[1].id == "s"


def test_guidance_must_fit_float32_and_negative_zero_is_zero():
    row = rejected(b'{"prompt": "p", "guidance_scale": 1e39}')
    assert row["field"] == "guidance_scale" and "largest float32" in row["reason"]
    assert one(b'{"prompt": "p", "guidance_scale": -0.0}').id == one(b'{"prompt": "p", "guidance_scale": 0}').id


def test_file_names_differing_in_case_collide_in_a_case_insensitive_folder(tmp_path):
    """On macOS/Windows output folders 'Cat.png' and 'cat.png' are one file: the job folds case there."""
    (tmp_path / "a.jsonl").write_bytes(b'{"id": "Cat", "prompt": "upper"}\n{"id": "cat", "prompt": "lower"}\n')

    def build(p):
        read = p | beam.Create([str(tmp_path / "a.jsonl")]) | ReadRequests("auto", D)
        exact = read["requests"] | "exact" >> DeduplicateRequests()
        folded = read["requests"] | "folded" >> DeduplicateRequests(fold_case=True)
        assert_that(exact["requests"] | "e" >> beam.Map(lambda r: r.id), equal_to(["Cat", "cat"]), label="exact")
        assert_that(folded["requests"] | "f" >> beam.Map(lambda r: r.id), equal_to(["Cat"]), label="folded")
        assert_that(folded["invalid"] | "i" >> beam.Map(lambda row: (row["id"], row["kind"])),
                    equal_to([("cat", layout.FILE_NAME_COLLISION)]), label="invalid")

    _run(build)
