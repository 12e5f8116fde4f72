"""An output that already holds a previous run's results needs a choice (--skip_existing or --overwrite), else the
launch stops with exit 2 before any model loads; the bundled demo without --output replaces its own output only, and
the files of a run that generated no image (a failed run) are replaced by its rerun."""

import json

import pytest

import pipeline.graph as graph
import pipeline.run as job_run
from pipeline import probes
from pipeline.errors import UsageError
from pipeline.output_check import RESULTS, check_output, previous_results
from pipeline_helpers import HEIGHT, MODEL_ARGS, ckpt32, image_names  # noqa: F401 - ckpt32 is a fixture


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

    monkeypatch.setattr(graph, "build_pipeline", build)


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


def _failed_run(out, **summary):
    """What a run whose every record was invalid leaves: no image, empty manifests, its error rows, a preview page,
    and a summary.json that says it generated and kept nothing."""
    for folder, name, text in (("manifest", "manifest-00000-of-00001.jsonl", ""),
                               ("manifest", "existing-00000-of-00001.jsonl", ""),
                               ("errors", "errors-00000-of-00001.jsonl", '{"kind": "invalid_record"}\n'),
                               ("preview", "index.html", "<html></html>")):
        (out / folder).mkdir(parents=True, exist_ok=True)
        (out / folder / name).write_text(text)
    (out / "metadata.jsonl").write_text("")
    (out / "summary.json").write_text(json.dumps({"records_read": 2, "invalid": 2, "images_generated": 0,
                                                  "skipped": 0, "demo": False, **summary}))


def test_the_files_of_a_run_that_generated_no_image_are_replaced_without_a_choice(tmp_path):
    _failed_run(tmp_path / "failed")
    line = check_output(str(tmp_path / "failed"), skip_existing=False, overwrite=False)
    assert line and "generated no image" in line and str(tmp_path / "failed") in line
    # Anything that may hold an image still needs the choice: an image listed, a summary that counts images, none.
    _failed_run(tmp_path / "image")
    (tmp_path / "image" / "images").mkdir()
    (tmp_path / "image" / "images" / "a.png").write_bytes(b"png")
    _failed_run(tmp_path / "counted", images_generated=3)
    _failed_run(tmp_path / "kept", skipped=1)
    _failed_run(tmp_path / "no-summary")
    (tmp_path / "no-summary" / "summary.json").unlink()
    _failed_run(tmp_path / "bad-summary")
    (tmp_path / "bad-summary" / "summary.json").write_text("not json")
    for name in ("image", "counted", "kept", "no-summary", "bad-summary"):
        with pytest.raises(UsageError, match="already holds"):
            check_output(str(tmp_path / name), skip_existing=False, overwrite=False)


def test_a_failed_run_on_gcs_is_told_by_the_same_one_entry_listings(gcs_emulator, gcs_bucket, tmp_path):
    _failed_run(tmp_path / "failed")
    out = f"gs://{gcs_bucket}/out"
    gcs_emulator.upload_dir(str(tmp_path / "failed"), out)
    assert "generated no image" in check_output(out, skip_existing=False, overwrite=False)
    gcs_emulator.upload_bytes(f"{out}/shards/00000.tar", b"tar")  # a webdataset shard: images
    with pytest.raises(UsageError, match=r"already holds a previous run's results \(shards/"):
        check_output(out, skip_existing=False, overwrite=False)


def test_a_failed_run_does_not_block_its_fix(ckpt32, tmp_path, capsys):
    """Every record invalid: the run exits 1 and writes its summary and error rows. The same command on the
    corrected input then runs without --overwrite and replaces them."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    argv = [f"--model={ckpt32}", f"--input={prompts}", f"--output={out}", *MODEL_ARGS, "--no_progress"]
    prompts.write_text(json.dumps({"id": "fox", "prompt": "a fox", "height": HEIGHT + 1}) + "\n")
    assert job_run.main(argv) == 1
    assert json.loads((out / "summary.json").read_text())["invalid"] == 1 and not image_names(str(out))
    capsys.readouterr()
    prompts.write_text(json.dumps({"id": "fox", "prompt": "a fox"}) + "\n")
    assert job_run.main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr()
    assert "generated no image" in printed.out and not printed.err.startswith("error:")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["images_generated"] == 1 and summary["invalid"] == 0
    assert image_names(str(out)) == {"fox.png"}
    assert (out / "errors" / "errors-00000-of-00001.jsonl").read_text() == ""  # the failed run's rows replaced
