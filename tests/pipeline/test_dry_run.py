"""--dry_run on the local runner: every record read and checked, what the job would do said in a few lines, nothing
generated, nothing written under the output; Beam's switches spelled as the job's (bare, =true, =false)."""

import argparse
import json

import pytest

from pipeline.switches import FLAG_SWITCHES, VALUE_SWITCHES, normalized


def test_beam_switches_take_the_job_spellings():
    assert normalized(["--dry_run"]) == ["--dry_run=True"]
    assert normalized(["--dry_run=true", "--x=1"]) == ["--dry_run=True", "--x=1"]
    assert normalized(["--dry_run=false", "--x=1"]) == ["--x=1"]  # Beam took the text 'false' as true
    assert normalized(["--dry_run", "no", "--x=1"]) == ["--x=1"]
    assert normalized(["--streaming=true", "--save_main_session=0", "--no_progress"]) == ["--streaming",
                                                                                         "--no_progress"]
    with pytest.raises(Exception, match="--dry_run=maybe: expected true or false"):
        normalized(["--dry_run=maybe"])
    assert "--streaming" in FLAG_SWITCHES


def test_value_switches_are_every_true_false_option_of_beam_that_takes_a_value():
    """A Beam upgrade that adds such an option fails here until VALUE_SWITCHES lists it."""
    from pipeline.options import Flux2KleinOptions
    from pipeline.usage import _new_parser, option_classes

    parser = _new_parser()
    for cls in option_classes():
        if cls is not Flux2KleinOptions:
            cls._add_argparse_args(parser)
    found = {s for a in parser._actions if isinstance(a.default, bool) and a.nargs is None and a.type is None
             and not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)) for s in a.option_strings}
    assert found == set(VALUE_SWITCHES)


def test_a_local_dry_run_reads_every_record_and_writes_nothing(tmp_path, tiny_ckpt, capsys):
    from pipeline.errors import UsageError
    from pipeline.run import main, run

    records = [{"id": f"p{i}", "prompt": f"prompt {i}", "num_images": 1 + i % 2} for i in range(6)]
    records += [{"id": "bad", "prompt": "x", "height": 33}, {"id": "p0", "prompt": "prompt 0", "num_images": 1},
                {"id": "p1", "prompt": "another"}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    argv = [f"--model={tiny_ckpt}", f"--input={prompts}", f"--output={out}", "--height=32", "--width=32"]
    assert run([*argv, "--dry_run"]) == (None, None)
    lines = capsys.readouterr().out.splitlines()
    assert "records 9: 6 request(s) for 9 image(s), 2 invalid row(s) (invalid_record 1, conflicting_id 1), " \
           "1 identical repeat(s)" in lines, lines
    assert any(line.startswith("batch 4:") for line in lines) and any(line.startswith("estimate: none") for line in lines)
    assert not out.exists()
    with pytest.raises(UsageError, match="the job would generate 9 images, above --max_images=8"):
        run([*argv, "--dry_run=true", "--max_images=8"])
    assert not out.exists()
    assert main([*argv, "--dry_run=maybe"]) == 2
    assert "--dry_run=maybe: expected true or false" in capsys.readouterr().err


def test_the_estimate_comes_from_the_preflight_and_the_chip_price():
    from pipeline.dry_run import estimate_lines

    assert estimate_lines(10, None)[0].startswith("estimate: none")
    line = estimate_lines(3600, {"est_seconds_per_image": 0.5, "chips": 4, "chip": "v5e", "topology": "v5e:2x2"})[0]
    assert "0.500 s per image on one v5e:2x2 worker" in line and "0:30:00" in line
    assert "2.00 chip-hours" in line and "$2.40 at $1.20 per v5e chip-hour" in line


def test_a_dry_run_expands_templates_as_the_job_does(tmp_path, tiny_ckpt, capsys):
    """A template is read at launch and its records made and validated as ExpandTemplates makes them (a prompt
    over --max_prompt_bytes is its error row), never read as a file of records."""
    from pipeline.run import run

    (tmp_path / "places.txt").write_text("a field\n\na forest\n")
    template = tmp_path / "pets.template.json"
    template.write_text(json.dumps({"template": "a {animal} in {place}",
                                    "slots": {"animal": ["cat", "dog", "x" * 80], "place": {"file": "places.txt"}}}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "a fox", "num_images": 2}) + "\n")
    out = tmp_path / "out"
    argv = [f"--model={tiny_ckpt}", f"--input={template}", f"--input={prompts}", f"--output={out}", "--height=32",
            "--width=32", "--max_prompt_bytes=64", "--dry_run"]
    assert run(argv) == (None, None)
    lines = capsys.readouterr().out.splitlines()
    assert "records 7: 5 request(s) for 6 image(s), 2 invalid row(s) (invalid_record 2), 0 identical repeat(s)" \
        in lines, lines
    assert not out.exists()
