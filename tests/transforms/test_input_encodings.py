"""Inputs saved as UTF-16 or UTF-32 with a byte-order mark (Excel's 'Unicode text', Windows tools) read as their text,
every record counted once; UTF-16 without its mark is an error row that names UTF-16 and the fix."""

import codecs
import gzip
import io

import pytest

from transforms.inputs.check import table_columns
from transforms.inputs.columns import ColumnMap, ColumnResolver
from transforms.inputs.files import InputReadError, open_decompressed
from transforms.inputs.readers import iter_raw_records
from transforms.inputs.validation import RequestDefaults, parse_raw
from transforms.requests import GenerationRequest

D = RequestDefaults()
CSV = 'id,prompt\nfox,"a red fox, asleep"\ncafé,un café au lait ☕\nlast,the end\n'


def read(data: bytes, name: str, fmt: str):
    stream = open_decompressed(io.BytesIO(data), name)
    resolver = ColumnResolver(ColumnMap())
    return [parse_raw(r, D, resolver) for r in iter_raw_records(stream, name, fmt)]


@pytest.mark.parametrize("encoding, bom", [("utf-16-le", codecs.BOM_UTF16_LE), ("utf-16-be", codecs.BOM_UTF16_BE),
                                           ("utf-32-le", codecs.BOM_UTF32_LE), ("utf-8", codecs.BOM_UTF8)])
def test_a_csv_with_a_byte_order_mark_reads_as_its_text(encoding, bom):
    data = bom + CSV.replace("\n", "\r\n").encode(encoding)
    out = read(data, "p.csv", "csv")
    assert all(isinstance(r, GenerationRequest) for r in out), out
    assert [(r.id, r.prompt, r.line) for r in out] == [
        ("fox", "a red fox, asleep", 2), ("café", "un café au lait ☕", 3), ("last", "the end", 4)]


def test_jsonl_text_and_compressed_utf16():
    jsonl = codecs.BOM_UTF16_LE + '{"id": "a", "prompt": "ü"}\n{"id": "b", "prompt": "two"}\n'.encode("utf-16-le")
    assert [r.prompt for r in read(jsonl, "p.jsonl", "jsonl")] == ["ü", "two"]
    text = gzip.compress(codecs.BOM_UTF16_BE + "one\ntwo\nthree\n".encode("utf-16-be"))
    assert [r.prompt for r in read(text, "p.txt.gz", "text")] == ["one", "two", "three"]


def test_the_launch_reads_a_utf16_header():
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".csv") as f:
        f.write(codecs.BOM_UTF16_LE + CSV.encode("utf-16-le"))
        f.flush()
        assert table_columns(f.name, "csv") == ["id", "prompt"]


def test_utf16_that_is_cut_says_so_after_the_records_before():
    data = codecs.BOM_UTF16_LE + "one\ntwo\n".encode("utf-16-le") + b"\x00\xdc"  # a lone low surrogate
    stream = open_decompressed(io.BytesIO(data), "p.txt")
    got = []
    with pytest.raises(InputReadError, match="not valid UTF-16.*save it again as UTF-8"):
        for raw in iter_raw_records(stream, "p.txt", "text"):
            got.append(raw.fields["prompt"])
    assert got == ["one", "two"]


def test_utf16_without_its_mark_is_one_error_naming_utf16_and_the_fix():
    for fmt, data in (("csv", "prompt,id\nhello,a\n".encode("utf-16-le")), ("text", "hello\n".encode("utf-16-be"))):
        stream = open_decompressed(io.BytesIO(data), f"p.{fmt}")
        with pytest.raises(InputReadError, match="UTF-16 text without a byte-order mark.*save it as UTF-8"):
            list(iter_raw_records(stream, f"p.{fmt}", fmt))
    # A prompt file that merely starts with a NUL is read as it is.
    assert [r.prompt for r in read(b"\x00a\nb\n", "p.txt", "text")] == ["\x00a", "b"]
