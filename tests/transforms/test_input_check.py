"""The launch check of JSONL inputs: a first file none of whose first records has the prompt column stops the
launch naming the column, the file and the keys found; records without it further on are left to the job."""

import gzip
import json

import pytest

from transforms.inputs.check import JSONL_RECORDS, InputCheckError, check_input_files
from transforms.inputs.columns import ColumnMap


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_jsonl_without_the_prompt_key_is_refused_naming_file_column_and_keys(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(_jsonl([{"promt": "a fox", "id": "a"}, {"promt": "a lighthouse"}]))
    with pytest.raises(InputCheckError) as e:
        check_input_files([str(path)], "auto", ColumnMap())
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    assert "prompt column 'prompt'" in message and "'promt', 'id'" in message
    assert "did you mean --prompt_column=promt?" in message


def test_compressed_jsonl_is_checked_too(tmp_path):
    path = tmp_path / "prompts.jsonl.gz"
    path.write_bytes(gzip.compress(_jsonl([{"caption": "a fox"}] * 3)))
    with pytest.raises(InputCheckError, match=r"prompts.jsonl.gz: none of its 3 record\(s\) has the prompt column "
                                              r"'text'.*'caption'"):
        check_input_files([str(path)], "auto", ColumnMap(prompt_column="text"))


def test_one_record_with_the_prompt_among_the_first_is_enough(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"not json\n\n" + _jsonl([{"text": "a"}, {"Prompt": "b"}]))  # matched ignoring case
    assert check_input_files([str(path)], "auto", ColumnMap()) == []


def test_only_the_first_records_are_read(tmp_path):
    """A prompt past the first JSONL_RECORDS records is not looked for: the launch stops (the file would give
    mostly error rows); a later file is not read at all."""
    late = tmp_path / "a.jsonl"
    late.write_bytes(_jsonl([{"text": "x"}] * JSONL_RECORDS + [{"prompt": "y"}]))
    with pytest.raises(InputCheckError, match=f"none of its first {JSONL_RECORDS} records"):
        check_input_files([str(late)], "auto", ColumnMap())
    good = tmp_path / "b.jsonl"
    good.write_bytes(_jsonl([{"prompt": "y"}]))
    assert check_input_files([str(good), str(late)], "auto", ColumnMap()) == []


def test_unreadable_or_empty_jsonl_is_left_to_the_job(tmp_path):
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(_jsonl([{"text": "x"}] * 50))[:30])
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert check_input_files([str(cut)], "auto", ColumnMap()) == []
    assert check_input_files([str(empty)], "auto", ColumnMap()) == []


@pytest.mark.parametrize("content,words", [
    (b'{"prompt": "a",}\n{prompt: "b"}\n', "line 1: malformed JSON: Expecting property name enclosed in double quotes"),
    (b'\n["a fox"]\n"a lighthouse"\n', "line 2: record must be a JSON object, got array"),
    (b"a fox\na lighthouse\n", "line 1: malformed JSON: Expecting value"),
], ids=["malformed", "not-objects", "plain-text"])
def test_jsonl_whose_first_lines_are_all_malformed_is_refused_naming_line_and_message(tmp_path, content, words):
    """Every line would be an error row after the model has loaded: the launch says so, naming the file, the first
    bad line and what the JSON parser said about it."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputCheckError) as e:
        check_input_files([str(path)], "auto", ColumnMap())
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--input {path}: none of its ") and words in message, message
    assert "is a JSON object" in message


def test_one_json_object_among_the_malformed_lines_is_enough(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"not json\n" * 5 + _jsonl([{"prompt": "a"}]))
    assert check_input_files([str(path)], "auto", ColumnMap()) == []
