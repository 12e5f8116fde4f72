"""Exit statuses that tell the truth: a run that generates nothing because its input was empty or every request
was invalid exits 1 with one line saying why (unless --allow_empty); a usage error exits 2; a good run 0."""

import os
import subprocess
import sys

import pytest

from pipeline_helpers import MODEL_ARGS, ckpt32  # noqa: F401 - ckpt32 is a fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(ckpt, source, out, *extra):
    return subprocess.run([sys.executable, "-m", "pipeline.run", f"--model={ckpt}", f"--input={source}",
                           f"--output={out}", *MODEL_ARGS, "--runner=FnApiRunner", "--no_progress", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("content,words", [
    ("", "the input held no record"),
], ids=["empty-input"])
def test_a_run_that_generates_nothing_exits_1_saying_why(ckpt32, tmp_path, content, words):
    source = tmp_path / "prompts.jsonl"
    source.write_text(content)
    out = _cli(ckpt32, source, tmp_path / "out")
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no image was generated") and words in last and "--allow_empty" in last
    allowed = _cli(ckpt32, source, tmp_path / "out2", "--allow_empty")
    assert allowed.returncode == 0, allowed.stderr[-2000:]


def test_every_request_invalid_is_said_as_the_reason():
    from pipeline.run import empty_run_reason

    reason = empty_run_reason({"records_read": 2, "invalid": 2, "failed": 0, "images_generated": 0})
    assert "all 2 request(s) were invalid or failed" in reason and "errors/errors-*.jsonl" in reason


def test_a_jsonl_input_without_its_prompt_key_is_a_launch_error(ckpt32, tmp_path):
    """A --prompt_column that none of the first JSONL records has stops the launch (exit 2, one line naming the
    column, the file and the keys found) instead of running the job into one error row per record."""
    source = tmp_path / "prompts.jsonl"
    source.write_text('{"text": "a fox"}\n{"text": "a lighthouse"}\n')
    out = _cli(ckpt32, source, tmp_path / "out")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --input {source}: "), lines
    assert "prompt column 'prompt'" in lines[0] and "'text'" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_jsonl_input_whose_lines_are_all_malformed_is_a_launch_error(ckpt32, tmp_path, capsys):
    """Every sampled line malformed: exit 2 before the model loads, one line naming the file, the first bad line and
    the JSON parser's message, and no output folder."""
    from pipeline.run import main

    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt": "a fox",}\n{"prompt": "a lighthouse"\n')
    out = tmp_path / "out"
    assert main([f"--model={ckpt32}", f"--input={source}", f"--output={out}", *MODEL_ARGS, "--no_progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --input {source}: none of its 2 line(s)"), lines
    assert "line 1: malformed JSON: Expecting property name enclosed in double quotes" in lines[0]
    assert not out.exists()


def test_exit_statuses_are_documented():
    from pipeline.usage import EXIT_STATUSES, format_help

    text = format_help()
    assert "exit status:" in text and all(f"  {code}  " in text for code, _ in EXIT_STATUSES)
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = fh.read()
    assert all(f"| {code} |" in readme for code, _ in EXIT_STATUSES)


def test_closing_lines_name_every_result(ckpt32, tmp_path):
    """The run's last lines say where the images, manifest, metadata.jsonl, preview, errors and summary are; a
    --skip_existing rerun says so without Beam's warnings about the files it replaces."""
    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt": "a fox"}\n{"prompt": ""}\n')
    out = _cli(ckpt32, source, tmp_path / "out", "--preview=4")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    for line in ("images: ", "manifest: ", "metadata.jsonl for Hugging Face imagefolder", "preview: ",
                 "preview/index.html", "errors: ", "summary: "):
        assert line in text, (line, text[-2000:])
    assert os.path.isfile(tmp_path / "out" / "preview" / "index.html")
    # A rerun replaces the row files under their fixed names: Beam's "Deleting 1 existing files in target path"
    # warnings say nothing the user needs and are not shown.
    again = _cli(ckpt32, source, tmp_path / "out", "--preview=4", "--skip_existing")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "existing files in target path" not in again.stderr, again.stderr[-2000:]
    assert "errors: " in again.stdout
