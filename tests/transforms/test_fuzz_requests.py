"""Property-based fuzzing of the request parser (transforms/inputs/) over JSONL, CSV, TSV and text.

Properties, for every input the strategies can build:
- the parser never raises: every record becomes either a GenerationRequest or an error row;
- every error row names its source and line and carries a non-empty reason (and the offending record, cut short);
- nothing is dropped or invented: one output per non-blank line (JSONL, text), in line order;
- every good record becomes exactly the request it describes (prompt kept byte for byte, defaults applied);
- a table's header is never a prompt, and its other columns come back as the record's metadata, cell for cell;
- every bad record is rejected for the reason that was planted in it (`field` names the offending part);
- every request that comes out is safe to use: a valid id (so a safe file name), sizes that are positive
  multiples of 16 within --max_pixels, seeds that leave room for every image, finite guidance, a prompt that
  encodes to UTF-8.

Inputs: random bytes, huge lines (10 MB), deeply nested JSON, NaN/Infinity, enormous integers and unicode edge
cases (RTL/bidi marks, zero-width characters, BOM, NUL, lone surrogates, non-characters). Runs derandomized (the
same examples on every run) so CI is stable.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from model.contract import DEFAULT_SIZE_MULTIPLE as SIZE_MULTIPLE
from model.contract import MAX_IMAGES_PER_REQUEST, MAX_SEED, MAX_STEPS
from transforms import layout
from transforms.inputs.delimited import DIALECTS
from transforms.inputs.identity import MAX_ID_CHARS, derive_id, derive_seed, unprintable
from transforms.inputs.jsonl import MAX_JSON_DEPTH
from transforms.inputs.readers import parse_lines
from transforms.inputs.validation import RequestDefaults
from transforms.requests import GenerationRequest

D = RequestDefaults(height=64, width=32, seed=7)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
FIELDS_NUMERIC = ("height", "width", "seed", "num_inference_steps", "guidance_scale", "num_images")

# Characters that have broken text pipelines before: bidi controls, zero-width characters, BOM, NUL and other C0
# controls, combining marks, non-characters, astral code points, quoting and escaping characters, shell and path
# metacharacters.
EDGE_CHARS = ["\u200f", "\u200e", "\u202e", "\u202d", "\u2066", "\u2067", "\u2069", "\u061c", "\u200b", "\u200c",
              "\u200d", "\u2060", "\ufeff", "\x00", "\x01", "\x1b", "\x7f", "\x85", "\u2028", "\u0301", "\u0308",
              "\ufffd", "\ufffe", "\uffff", "\U0010ffff", "\U0001f600", "\u05d0", "\u0627", "\u4e2d", "\u00e9",
              '"', "\\", ",", "'", "{", "}", "[", "\t", " ", "../", "%2e%2e", "$(", "`", ";", "|", "%s", "{0}"]
unicode_text = st.lists(st.one_of(st.sampled_from(EDGE_CHARS), st.characters(exclude_categories=("Cs",))),
                        min_size=1, max_size=40).map("".join)


def _good_prompt(p: str) -> bool:
    return bool(p.strip())


prompts = unicode_text.filter(_good_prompt)
ids = st.one_of(  # the plain ids of the earlier rule, and natural ones (no spaces at the ends: CSV cells are stripped)
    st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}", fullmatch=True),
    st.text(min_size=1, max_size=60).filter(lambda s: s == s.strip() and s and unprintable(s) is None),
)
bad_ids = st.one_of(  # not printable, blank or too long (printable ids of any other shape are valid)
    st.sampled_from(["a\x00b", "x\n", "a\tb", "", "   ", "a" * (MAX_ID_CHARS + 1), "\u202eevil", "x\u200b",
                     "\x7f", "a\u2028b"]),
    st.text(min_size=1, max_size=40).filter(lambda s: unprintable(s) is not None),
)


@st.composite
def valid_fields(draw) -> dict:
    """A record every field of which is valid (each optional field present or not)."""
    rec = {"prompt": draw(prompts)}
    if draw(st.booleans()):
        rec["id"] = draw(ids)
    if draw(st.booleans()):
        rec["height"] = SIZE_MULTIPLE * draw(st.integers(1, 128))
    if draw(st.booleans()):
        rec["width"] = SIZE_MULTIPLE * draw(st.integers(1, 128))
    h, w = rec.get("height", D.height), rec.get("width", D.width)
    assume(h * w <= D.max_pixels)
    if draw(st.booleans()):
        rec["num_inference_steps"] = draw(st.integers(1, MAX_STEPS))
    if draw(st.booleans()):
        rec["guidance_scale"] = draw(st.floats(0, 1e6, allow_nan=False, allow_infinity=False))
    if draw(st.booleans()):
        rec["num_images"] = draw(st.integers(1, MAX_IMAGES_PER_REQUEST))
    if draw(st.booleans()):
        rec["seed"] = draw(st.integers(0, MAX_SEED - rec.get("num_images", 1)))
    return rec


def expected_request(rec: dict, *, prompt: str | None = None) -> tuple:
    """What a valid record must become: (id, prompt, seed, height, width, steps, guidance, num_images)."""
    prompt = rec["prompt"] if prompt is None else prompt
    h, w = rec.get("height", D.height), rec.get("width", D.width)
    steps, guidance = rec.get("num_inference_steps"), rec.get("guidance_scale")
    guidance = None if guidance is None else float(guidance)
    n = rec.get("num_images", D.num_images)
    seed = rec.get("seed")
    rid = rec.get("id") or derive_id(prompt, h, w, steps, guidance, n, seed)
    if seed is None:
        seed = derive_seed(D.seed, rid)
    return rid, prompt, seed, h, w, steps, guidance, n


def as_tuple(r: GenerationRequest) -> tuple:
    return r.id, r.prompt, r.seed, r.height, r.width, r.num_inference_steps, r.guidance_scale, r.num_images


# A planted defect: (field, how to corrupt the record, words expected in the reason)
def _set(field, value):
    def corrupt(rec):
        rec = dict(rec)
        rec[field] = value
        return rec
    return corrupt


@st.composite
def planted_defect(draw):
    """A JSON-level defect for one field -> (corrupt(rec) -> rec, field, accepted reason fragments)."""
    huge = draw(st.integers(10**18, 10**4000) | st.integers(-(10**4000), -(10**18)))
    kind = draw(st.sampled_from([
        "missing_prompt", "prompt_type", "prompt_blank", "bad_id", "id_type", "size_not_multiple",
        "size_nonpositive", "size_huge", "size_type", "steps_range", "steps_float", "guidance_negative",
        "guidance_type", "guidance_overflow", "images_range", "seed_negative", "seed_huge", "seed_float",
        "seed_string", "int_overflow_float",
    ]))
    size_field = draw(st.sampled_from(["height", "width"]))
    if kind == "missing_prompt":
        return (lambda rec: {k: v for k, v in rec.items() if k != "prompt"}), "prompt", ["missing prompt"]
    if kind == "prompt_type":
        value = draw(st.one_of(st.integers(), st.booleans(), st.lists(st.text(max_size=3), max_size=2),
                               st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
        return _set("prompt", value), "prompt", ["prompt must be a string"]
    if kind == "prompt_blank":
        value = draw(st.text(alphabet=" \t\r\n\u2028\u3000\x1c\x85", max_size=5))
        return _set("prompt", value), "prompt", ["prompt is empty"]
    if kind == "bad_id":
        return _set("id", draw(bad_ids)), "id", ["1-256 printable characters"]
    if kind == "id_type":
        return _set("id", draw(st.one_of(st.booleans(), st.lists(st.integers(), max_size=2),
                                         st.floats(allow_nan=False, allow_infinity=False)))), \
            "id", ["id must be a string"]
    if kind == "size_not_multiple":
        v = draw(st.integers(1, 100_000).filter(lambda x: x % SIZE_MULTIPLE))
        return _set(size_field, v), size_field, ["positive multiple of 16"]
    if kind == "size_nonpositive":
        return _set(size_field, draw(st.integers(-(10**30), 0))), size_field, ["positive multiple of 16"]
    if kind == "size_huge":
        return _set(size_field, SIZE_MULTIPLE * draw(st.integers(10**6, 10**40))), "height", ["max_pixels"]
    if kind == "size_type":
        return _set(size_field, draw(st.sampled_from(["512", True, [16], {"v": 16}, 16.5]))), size_field, \
            ["must be an integer"]
    if kind == "steps_range":
        return _set("num_inference_steps", draw(st.integers(MAX_STEPS + 1, 10**30) | st.integers(-(10**30), 0))), \
            "num_inference_steps", ["num_inference_steps must be in"]
    if kind == "steps_float":
        return _set("num_inference_steps", draw(st.floats(0.1, 999.9).filter(lambda x: not x.is_integer()))), \
            "num_inference_steps", ["must be an integer"]
    if kind == "guidance_negative":
        return _set("guidance_scale", draw(st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False))), \
            "guidance_scale", ["guidance_scale must be >= 0"]
    if kind == "guidance_type":
        return _set("guidance_scale", draw(st.sampled_from(["high", True, [], {}]))), "guidance_scale", \
            ["must be a number"]
    if kind == "guidance_overflow":  # 1e400 parses as inf in JSON
        return _set("guidance_scale", "__RAW__1e400"), "guidance_scale", ["finite"]
    if kind == "images_range":
        return _set("num_images", draw(st.integers(MAX_IMAGES_PER_REQUEST + 1, 10**30) | st.integers(-5, 0))), \
            "num_images", ["num_images must be in"]
    if kind == "seed_negative":
        return _set("seed", draw(st.integers(-(10**30), -1))), "seed", ["seed must be a non-negative integer"]
    if kind == "seed_huge":
        return _set("seed", huge if huge > 0 else -huge), "seed", ["seed must be a non-negative integer"]
    if kind == "seed_float":
        return _set("seed", draw(st.floats(0.5, 1e6).filter(lambda x: not x.is_integer()))), "seed", \
            ["seed must be an integer"]
    if kind == "seed_string":
        return _set("seed", draw(st.sampled_from(["7", "", "0x10", "nan"]))), "seed", ["seed must be an integer"]
    if kind == "int_overflow_float":
        field = draw(st.sampled_from(["height", "width", "seed", "num_inference_steps", "num_images"]))
        return _set(field, "__RAW__" + draw(st.sampled_from(["1e400", "-1e400", "1e300"]))), field, \
            ["must be an integer"]
    raise AssertionError(kind)


def dumps(rec: dict, ensure_ascii: bool) -> str:
    """JSON for a record; values "__RAW__x" are written as the bare token x (numbers JSON can carry but Python's
    json module would not write, such as 1e400)."""
    raw = {k: v[len("__RAW__"):] for k, v in rec.items() if isinstance(v, str) and v.startswith("__RAW__")}
    text = json.dumps({k: (f"@@{k}@@" if k in raw else v) for k, v in rec.items()}, ensure_ascii=ensure_ascii)
    for k, token in raw.items():
        text = text.replace(json.dumps(f"@@{k}@@"), token)
    return text


def check_request_is_safe(r: GenerationRequest) -> None:
    assert 1 <= len(r.id) <= MAX_ID_CHARS and unprintable(r.id) is None and r.id.strip(), r.id
    assert layout.image_file_name(r.id, 0, 1) == f"images/{layout.image_stem(r.id)}.png"
    assert layout.PLAIN_ID.match(layout.image_stem(r.id))
    assert r.height > 0 and r.width > 0 and r.height % SIZE_MULTIPLE == 0 and r.width % SIZE_MULTIPLE == 0
    assert r.height * r.width <= D.max_pixels
    assert 1 <= r.num_images <= MAX_IMAGES_PER_REQUEST
    assert isinstance(r.seed, int) and 0 <= r.seed and r.seed + r.num_images - 1 < MAX_SEED
    assert r.num_inference_steps is None or 1 <= r.num_inference_steps <= MAX_STEPS
    assert r.guidance_scale is None or (math.isfinite(r.guidance_scale) and r.guidance_scale >= 0)
    assert isinstance(r.prompt, str) and r.prompt.strip()
    r.prompt.encode("utf-8")  # no lone surrogates: the prompt can go into a PNG chunk, a JSON row, a tokenizer


def check_error_row(row: dict, source: str) -> None:
    assert isinstance(row, dict), row
    assert row["source"] == source and isinstance(row["line"], int) and row["line"] >= 0
    assert isinstance(row["reason"], str) and row["reason"].strip()
    assert row["kind"] in (layout.INVALID_RECORD, layout.UNREADABLE_INPUT)  # the latter: a table's header
    assert row["record"] is None or len(row["record"]) <= layout.MAX_RECORD_CHARS + 40
    layout.to_json_line(row).encode("utf-8")  # every row can be written to a UTF-8 file


def check_outputs(out: list, source: str) -> None:
    for o in out:
        if isinstance(o, GenerationRequest):
            check_request_is_safe(o)
            assert o.source == source
        else:
            check_error_row(o, source)


def nonblank_lines(data: bytes) -> list[int]:
    """Line numbers (1-based) a line-oriented parser must answer for: undecodable lines and lines with text."""
    numbers = []
    for n, raw in enumerate(io.BytesIO(data), 1):
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            numbers.append(n)
            continue
        if text.strip():
            numbers.append(n)
    return numbers


def line_of(o) -> int:
    return o.line if isinstance(o, GenerationRequest) else o["line"]


# ============================================================================================ random bytes
@FUZZ
@given(data=st.binary(max_size=3000), fmt=st.sampled_from(["jsonl", "csv", "tsv", "text"]))
def test_random_bytes_never_crash_and_every_line_is_answered(data, fmt):
    source = f"fuzz.{fmt}"
    out = parse_lines(data, source, fmt, D)
    check_outputs(out, source)
    if fmt in ("jsonl", "text"):
        assert [line_of(o) for o in out] == nonblank_lines(data)
    else:
        total = data.count(b"\n") + 1
        assert all(0 <= line_of(o) <= total for o in out)


@FUZZ
@given(lines=st.lists(st.one_of(st.binary(max_size=80),
                                st.builds(lambda r, a: dumps(r, a).encode(), valid_fields(), st.booleans())),
                      max_size=12),
       fmt=st.sampled_from(["jsonl", "text"]))
def test_json_like_garbage_mixed_with_records(lines, fmt):
    data = b"\n".join(line.replace(b"\n", b" ") for line in lines)
    out = parse_lines(data, "mix." + fmt, fmt, D)
    check_outputs(out, "mix." + fmt)
    assert [line_of(o) for o in out] == nonblank_lines(data)


# ============================================================================================ JSONL oracle
@FUZZ
@given(records=st.lists(st.tuples(valid_fields(), st.none() | planted_defect(), st.booleans()), min_size=1,
                        max_size=8),
       blank_every=st.integers(2, 5))
def test_jsonl_good_records_become_requests_and_bad_ones_errors_with_the_planted_reason(records, blank_every):
    lines, expect = [], {}
    for rec, defect, ascii_only in records:
        if len(lines) % blank_every == blank_every - 1:
            lines.append("   ")  # blank lines are skipped but still counted
        if defect is None:
            lines.append(dumps(rec, ascii_only))
            expect[len(lines)] = ("ok", expected_request(rec))
        else:
            corrupt, field, words = defect
            lines.append(dumps(corrupt(rec), ascii_only))
            expect[len(lines)] = ("bad", field, words)
    out = parse_lines("\n".join(lines).encode("utf-8"), "p.jsonl", "jsonl", D)
    check_outputs(out, "p.jsonl")
    assert [line_of(o) for o in out] == sorted(expect)
    for o in out:
        e = expect[line_of(o)]
        if e[0] == "ok":
            assert isinstance(o, GenerationRequest), (o, e)
            assert as_tuple(o) == e[1]
        else:
            _, field, words = e
            assert isinstance(o, dict), (o, e)
            if "malformed JSON" in o["reason"]:  # integers over Python's 4300-digit limit are not JSON we read
                assert "digits" in o["reason"], o
                continue
            assert any(w in o["reason"] for w in words) and o.get("field") in (field, "height", "width"), (o, e)


NON_JSON_NUMBERS = ["NaN", "Infinity", "-Infinity", "nan", "inf", "0x10", "+5", ".5", "5.", "1_000", "00", "--1"]


@FUZZ
@given(rec=valid_fields(), field=st.sampled_from(FIELDS_NUMERIC + ("prompt", "id")),
       token=st.sampled_from(NON_JSON_NUMBERS + ["1e999", "-1e999"]))
def test_nan_infinity_and_non_json_numbers_are_rejected(rec, field, token):
    rec = dict(rec, **{field: "__RAW__" + token})
    out = parse_lines(dumps(rec, True).encode(), "p.jsonl", "jsonl", D)
    assert len(out) == 1
    check_outputs(out, "p.jsonl")
    assert isinstance(out[0], dict), (token, field, out)
    if token in NON_JSON_NUMBERS:
        assert "malformed JSON" in out[0]["reason"]
    else:  # 1e999 is valid JSON for an overflowing number: Python reads inf, the field's rule rejects it
        assert out[0]["field"] in (field, "height"), out


@pytest.mark.parametrize("depth", [10, 500, 5000, 200_000])
@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deeply_nested_json_is_an_error_row_not_a_crash(depth, inside, opener):
    closer = "]" if opener == "[" else "}"
    nested = opener * depth + "1" + closer * depth
    line = ('{"prompt": "x", "extra": ' + nested + "}") if inside else nested
    out = parse_lines(line.encode(), "deep.jsonl", "jsonl", D)  # never RecursionError
    assert len(out) == 1
    check_outputs(out, "deep.jsonl")
    if depth > MAX_JSON_DEPTH:
        assert isinstance(out[0], dict) and out[0]["field"] == "record", out[0]
        assert f"nested too deeply: more than {MAX_JSON_DEPTH} levels" in out[0]["reason"], out[0]
    elif inside:
        assert isinstance(out[0], GenerationRequest), out[0]  # unknown fields may nest a little
    else:
        assert isinstance(out[0], dict), out[0]  # not an object with a prompt


# ============================================================================================ unicode
@FUZZ
@given(prompt=prompts, fmt=st.sampled_from(["jsonl", "csv", "tsv", "text"]), ascii_only=st.booleans(),
       first=st.booleans())
def test_unicode_edge_cases_in_prompts_are_kept_exactly(prompt, fmt, ascii_only, first):
    """RTL/bidi marks, zero-width characters, NUL, BOM, combining marks: a prompt is data, kept byte for byte
    (JSONL, CSV), or stripped of surrounding whitespace (text, one prompt per line)."""
    if fmt == "jsonl":
        data = dumps({"prompt": prompt}, ascii_only).encode("utf-8")
        expected = prompt
    elif fmt in ("csv", "tsv"):
        assume("\r" not in prompt)  # the CSV reader normalises line breaks inside quoted fields
        buf = io.StringIO()
        csv.writer(buf, dialect=DIALECTS[fmt], lineterminator="\n").writerows([["prompt"], [prompt]])
        data = buf.getvalue().encode("utf-8")
        expected = prompt
    else:
        assume("\n" not in prompt)
        data = prompt.encode("utf-8") if first else b"\n" + prompt.encode("utf-8")
        # a UTF-8 BOM at the very start of a file is not part of the first prompt
        expected = (prompt[1:] if first and prompt.startswith("\ufeff") else prompt).strip()
    out = parse_lines(data, "u." + fmt, fmt, D)
    if not expected.strip():
        assert out == [] or isinstance(out[0], dict)
        return
    assert len(out) == 1, out
    check_outputs(out, "u." + fmt)
    assert isinstance(out[0], GenerationRequest), out
    assert out[0].prompt == expected


LONE_SURROGATES = ["\\ud800", "\\udfff", "\\udbff\\u0041", "a\\ud83d", "\\ude00b"]


@pytest.mark.parametrize("escape", LONE_SURROGATES)
@pytest.mark.parametrize("with_id", [False, True])
def test_lone_surrogates_in_a_json_prompt_are_rejected(escape, with_id):
    """JSON can spell a lone surrogate ("\\ud800"); such a string cannot be encoded as UTF-8, so it could not go
    into a PNG text chunk, the manifest or the tokenizer. It must be an error row, not a crash and not a request."""
    line = '{"prompt": "cat ' + escape + '"' + (', "id": "sur"' if with_id else "") + "}"
    out = parse_lines(line.encode(), "s.jsonl", "jsonl", D)  # never UnicodeEncodeError
    assert len(out) == 1
    assert isinstance(out[0], dict), out[0]  # not a request that fails later in the PNG/manifest/tokenizer
    check_error_row(out[0], "s.jsonl")
    assert out[0]["field"] == "prompt" and "not valid Unicode" in out[0]["reason"]
    assert out[0]["id"] == ("sur" if with_id else None)
    assert escape.split("\\u")[1][:4] in out[0]["value"].lower()  # the surrogate shown escaped (\\udXXX)


@FUZZ
@given(rec=valid_fields(), bad=st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf",
                                                 b"\xe2\x82", b"\x80"]),
       fmt=st.sampled_from(["jsonl", "text", "csv", "tsv"]))
def test_non_utf8_lines_are_error_rows(rec, bad, fmt):
    if fmt == "jsonl":
        line = dumps(rec, True).encode()
        line = line.replace(b'"prompt": "', b'"prompt": "' + bad, 1)
        data = b'{"prompt": "before"}\n' + line + b'\n{"prompt": "after"}\n'
    elif fmt == "text":
        data = b"before\n" + bad + b"x\nafter\n"
    else:
        data = b"prompt\nbefore\n" + bad + b"x\nafter\n"
    out = parse_lines(data, "b." + fmt, fmt, D)
    check_outputs(out, "b." + fmt)
    kinds = [(line_of(o), isinstance(o, GenerationRequest)) for o in out]
    header = fmt in ("csv", "tsv")
    assert kinds == [(1 + header, True), (2 + header, False), (3 + header, True)], out
    assert "not valid UTF-8" in out[1]["reason"] and out[1]["field"] == "encoding"


# ============================================================================================ CSV oracle
@FUZZ
@given(records=st.lists(valid_fields(), min_size=1, max_size=6),
       junk=st.sampled_from(["abc", "nan", "inf", "-inf", "1e400", "12abc", "0x1f", "1,5", "١٦", "1e5000",
                             "9" * 4000, "-" + "9" * 4000]),
       junk_field=st.sampled_from(FIELDS_NUMERIC), junk_row=st.integers(0, 5), fmt=st.sampled_from(["csv", "tsv"]))
def test_csv_good_rows_become_requests_and_bad_cells_error_rows(records, junk, junk_field, junk_row, fmt):
    assume(all("\r" not in r["prompt"] for r in records))
    header = ["prompt", "id"] + list(FIELDS_NUMERIC)
    buf = io.StringIO()
    w = csv.writer(buf, dialect=DIALECTS[fmt], lineterminator="\n")
    w.writerow(header)
    for i, rec in enumerate(records):
        row = {k: ("" if rec.get(k) is None else (repr(rec[k]) if isinstance(rec[k], float) else str(rec[k])))
               for k in header}
        if i == junk_row:
            row[junk_field] = junk
        w.writerow([row[k] for k in header])
    out = parse_lines(buf.getvalue().encode("utf-8"), "p." + fmt, fmt, D)
    check_outputs(out, "p." + fmt)
    assert len(out) == len(records)
    for i, (o, rec) in enumerate(zip(out, records)):
        if i != junk_row:
            assert isinstance(o, GenerationRequest), o
            assert as_tuple(o) == expected_request(rec)
        elif junk == "١٦":
            pass  # Arabic-Indic digits: int()/float() read them as 16; either outcome is safe (checked above)
        else:
            assert isinstance(o, dict), (junk, junk_field, o)
            assert o["field"] in (junk_field, "height"), o


# ============================================================================================ huge inputs
MB10 = 10 * 1024 * 1024


@pytest.mark.parametrize("fmt, data", [
    ("jsonl", b'{"prompt": "' + b"a" * MB10 + b'"}\n{"prompt": "next"}\n'),
    ("jsonl", b"{" * MB10 + b'\n{"prompt": "next"}\n'),
    ("jsonl", b'{"prompt": "x", "pad": "' + b"\xff" * MB10 + b'"}\n{"prompt": "next"}\n'),
    ("text", b"word " * (MB10 // 5) + b'\nnext\n'),
    ("csv", b"prompt,seed\n" + b"a" * MB10 + b",1\nnext,2\n"),
    ("csv", b'prompt\n"' + b"a" * MB10 + b"\nnext\n"),  # an unterminated quote swallows the rest of the file
    ("tsv", b"prompt\tseed\n" + b"a" * MB10 + b"\t1\nnext\t2\n"),
])
def test_10mb_lines_are_answered_quickly_and_error_rows_stay_small(fmt, data):
    start = time.monotonic()
    out = parse_lines(data, "big." + fmt, fmt, D)
    assert time.monotonic() - start < 20
    check_outputs(out, "big." + fmt)
    assert 1 <= len(out) <= 2
    for o in out:
        if isinstance(o, dict):
            assert len(layout.to_json_line(o)) < 5000  # the row cites the record, it does not carry 10 MB
    if data.count(b"next") and not data.startswith(b'prompt\n"'):
        assert isinstance(out[-1], GenerationRequest) and out[-1].prompt == "next"  # the file goes on


@pytest.mark.parametrize("fmt, line", [
    ("jsonl", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
    ("csv", b"prompt,seed\nx," + b"9" * 5000),
    ("csv", b"prompt,height\nx," + b"1" * 4301),
    ("tsv", b"prompt\tseed\nx\t" + b"9" * 5000),
    ("text", b"9" * 5000),
])
def test_integers_beyond_pythons_digit_limit_are_error_rows(fmt, line):
    out = parse_lines(line, "i." + fmt, fmt, D)  # never ValueError from int()
    assert len(out) == 1
    check_outputs(out, "i." + fmt)
    if fmt in ("csv", "tsv"):
        field = line.split(b"\n")[0].replace(b"\t", b",").split(b",")[1].decode()
        assert isinstance(out[0], dict) and out[0]["field"] == field and "digit" in out[0]["reason"], out[0]


# ============================================================================================ TSV tables
cells = st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\r"), max_size=12)
extra_names = st.from_regex(r"[A-Za-z][A-Za-z0-9 _]{0,10}", fullmatch=True).filter(
    lambda n: n.strip() == n and n.casefold() not in {f.casefold() for f in ("prompt",) + FIELDS_NUMERIC + ("id",)})


@FUZZ
@given(prompts_col=st.lists(prompts.filter(lambda p: "\r" not in p), min_size=1, max_size=6),
       names=st.lists(extra_names, max_size=3, unique=True), data=st.data(), fmt=st.sampled_from(["tsv", "csv"]))
def test_table_header_is_never_a_prompt_and_extra_cells_are_metadata(prompts_col, names, data, fmt):
    """One request per row, with that row's prompt cell; the header row never becomes a request; every other column
    comes back under its header name, exactly as written (tabs, quotes and commas inside cells included)."""
    header = ["Prompt"] + names  # the prompt column found ignoring case
    rows = [[p] + [data.draw(cells) for _ in names] for p in prompts_col]
    buf = io.StringIO()
    csv.writer(buf, dialect=DIALECTS[fmt], lineterminator="\n").writerows([header] + rows)
    out = parse_lines(buf.getvalue().encode("utf-8"), "t." + fmt, fmt, D)
    check_outputs(out, "t." + fmt)
    assert len(out) == len(rows), out
    for o, row in zip(out, rows):
        assert isinstance(o, GenerationRequest), o
        assert o.prompt == row[0]  # row by row, so the header row ("Prompt") is not among them
        expected = {n: v for n, v in zip(names, row[1:])}
        assert o.metadata_values() == expected
