"""An output that already holds a previous run's results needs a choice (--skip_existing or --overwrite), else the
launch stops with exit 2 before any model loads; the bundled demo without --output replaces its own output only."""

import json

import pytest

import pipeline.run as job_run
from pipeline import probes
from pipeline.errors import UsageError
from pipeline.output_check import RESULTS, check_output, previous_results


def _previous_run(out, demo=False):
    (out / "images").mkdir(parents=True)
    (out / "images" / "a.png").write_bytes(b"png")
    (out / "summary.json").write_text(json.dumps({"demo": demo, "images_generated": 1}))


def test_an_output_with_results_needs_skip_existing_or_overwrite(tmp_path):
    out = tmp_path / "out"
    assert check_output(str(out), skip_existing=False, overwrite=False) is None  # not there yet
    out.mkdir()
    (out / "beam-temp-x").mkdir()  # what a killed run leaves: not a result
    (out / "images").mkdir()  # an empty folder: nothing to lose
    assert previous_results(str(out)) == []
    _previous_run(tmp_path / "full")
    with pytest.raises(UsageError) as e:
        check_output(str(tmp_path / "full"), skip_existing=False, overwrite=False)
    message = str(e.value)
    assert "--skip_existing" in message and "--overwrite" in message and "images/, summary.json" in message
    assert str(tmp_path / "full") in message and "\n" not in message
    assert check_output(str(tmp_path / "full"), skip_existing=True, overwrite=False) is None
    assert check_output(str(tmp_path / "full"), skip_existing=False, overwrite=True) is None
    with pytest.raises(UsageError, match="give one"):
        check_output(str(tmp_path / "full"), skip_existing=True, overwrite=True)


@pytest.mark.parametrize("entry", RESULTS)
def test_each_kind_of_result_counts(tmp_path, entry):
    path = tmp_path / entry.rstrip("/")
    if entry.endswith("/"):
        path.mkdir()
        (path / "x").write_bytes(b"x")
    else:
        path.write_bytes(b"x")
    assert previous_results(str(tmp_path)) == [entry]


def test_results_on_gcs_are_found_by_a_listing(gcs_emulator, gcs_bucket):
    out = f"gs://{gcs_bucket}/out"
    assert previous_results(out) == []
    gcs_emulator.upload_bytes(f"{out}/shards/00000.tar", b"tar")
    assert previous_results(out) == ["shards/"]
    with pytest.raises(UsageError, match="--overwrite"):
        check_output(out, skip_existing=False, overwrite=False)


def test_the_demo_replaces_its_own_output_only(tmp_path):
    _previous_run(tmp_path / "demo", demo=True)
    _previous_run(tmp_path / "real", demo=False)
    line = check_output(str(tmp_path / "demo"), skip_existing=False, overwrite=False, demo_default_output=True)
    assert "replacing the previous demo output" in line
    with pytest.raises(UsageError, match="already holds"):
        check_output(str(tmp_path / "real"), skip_existing=False, overwrite=False, demo_default_output=True)
    with pytest.raises(UsageError, match="already holds"):  # the demo with --output given: the user's folder
        check_output(str(tmp_path / "demo"), skip_existing=False, overwrite=False)


class _Built(Exception):
    """Raised instead of building the graph: the launch got past every check."""


@pytest.fixture
def launch_only(monkeypatch, tiny_ckpt, tmp_path):
    """`pipeline.run` up to building the graph, in tmp_path, the demo on the tiny checkpoint (no model loads)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(probes, "demo_checkpoint", lambda: tiny_ckpt)

    def build(*args, **kwargs):
        raise _Built()

    monkeypatch.setattr(job_run, "build_pipeline", build)


def test_running_the_demo_twice_replaces_its_own_output(launch_only, tmp_path, capsys):
    """`python -m pipeline.run` twice in a row on a fresh clone: the second run replaces the first's ./output."""
    _previous_run(tmp_path / "output", demo=True)
    with pytest.raises(_Built):
        job_run.run(["--no_progress"])
    assert "replacing the previous demo output in ./output" in capsys.readouterr().out
    assert job_run.main(["--no_progress", "--output=./output"]) == 2  # named by the user: a choice is needed
    assert "--skip_existing" in capsys.readouterr().err


def test_the_command_line_stops_with_exit_2_naming_both_choices(launch_only, tmp_path, tiny_ckpt, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    _previous_run(tmp_path / "out")
    argv = [f"--model={tiny_ckpt}", f"--input={prompts}", f"--output={tmp_path / 'out'}", "--no_progress"]
    assert job_run.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a previous run's results" in err[0] and "--overwrite" in err[0]
    for choice in ("--overwrite", "--skip_existing"):
        with pytest.raises(_Built):
            job_run.run(argv + [choice])
