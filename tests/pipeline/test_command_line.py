"""The command line a new user meets: --help, unknown options and bad values stopped at launch, the option
table of docs/options.md, and the demo at a real-model size (512x512)."""

import json
import os
import re
import subprocess
import sys

import pytest

from pipeline import option_specs
from pipeline.errors import OptionValueError, UnknownOptionError, UsageError
from pipeline.option_specs import GROUPS, OPTIONS, options_by_group
from pipeline.run import main
from pipeline.usage import (
    COMMON_BEAM_OPTIONS, check_arguments, check_arguments_quickly, format_help, known_options_parser, markdown_table,
    quick_parser,
)

from paths import REPO  # noqa: E402

METADATA = os.path.join(REPO, "templates", "metadata.json")


def command(*args, cwd=REPO, timeout=300):
    """`python -m pipeline.run ARGS` in a fresh interpreter, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def flat(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------------------------------------------- --help
def test_help_lists_every_option_with_its_default_and_description():
    proc = command("--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("usage: python -m pipeline.run") and proc.stderr == ""
    for name in (p["name"] for p in json.load(open(METADATA))["parameters"]):
        assert re.search(rf"--{name}\b", out), f"--help does not list --{name}, a parameter of metadata.json"
    text = flat(out)
    for option in OPTIONS:
        assert f"--{option.name}" in out and f"(default: {option.default_text})" in text, option.name
        assert flat(option.help) in text, option.name
    lines = out.splitlines()
    starts = [lines.index(f"{title}:") for title, _ in options_by_group()]
    assert starts == sorted(starts)  # the groups, in order, each option under its own
    for (title, options), start, end in zip(options_by_group(), starts, starts[1:] + [len(lines)]):
        assert [line.split("=")[0].split("[")[0].strip() for line in lines[start:end] if line.startswith("  --")] \
            == [o.flag for o in options], title
    assert [key for key, _ in GROUPS] == ["input", "output", "model", "generation", "limits", "reliability", "scores"]
    assert "--help_beam" in out.split("Scores and filters:")[-1]  # it ends with where Beam's options are listed


def test_help_beam_lists_beams_options(capsys):
    assert main(["--help_beam"]) == 0
    out = capsys.readouterr().out
    for name in ("--runner", "--direct_num_workers", "--project", "--region", "--sdk_container_image",
                 "--number_of_worker_harness_threads", "--dataflow_service_options"):
        assert name in out, name
    assert "--num_inference_steps" not in out  # the job's own are in --help


def test_option_declarations():
    """Each option is declared once, in a group, with a one-line description (what --help, docs/options.md and
    metadata.json show) and a default --help can show."""
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names)) and option_specs.OPTION_NAMES == tuple(names)
    for option in OPTIONS:
        assert option.group in dict(GROUPS), option.name
        assert "\n" not in option.help and len(option.help) <= 120 and option.help.endswith("."), option.name
        assert "For example:" not in option.help and option.default_text, option.name
    known = {s for a in known_options_parser()._actions for s in a.option_strings}
    assert {f"--{name}" for name in COMMON_BEAM_OPTIONS} <= known - {o.flag for o in OPTIONS}


def test_an_option_in_an_undeclared_group_is_an_error(monkeypatch):
    stray = option_specs.Option("stray", "no_such_group", "A stray option.")
    monkeypatch.setattr(option_specs, "OPTIONS", OPTIONS + (stray,))
    with pytest.raises(ValueError, match="--stray has group 'no_such_group'"):
        options_by_group()


def test_options_page_table_matches_help():
    """docs/options.md holds `python -m pipeline.usage --markdown` unchanged, and the README links it."""
    with open(os.path.join(REPO, "docs", "options.md")) as fh:
        page = fh.read()
    table = markdown_table()
    assert table in page, "docs/options.md's option table is stale: paste `python -m pipeline.usage --markdown`"
    with open(os.path.join(REPO, "README.md")) as fh:
        assert "(docs/options.md)" in fh.read()
    text = flat(format_help())
    rows = re.findall(r"^\| `(--[a-z0-9_]+)` \| (.*?) \| (.*?) \|$", table, re.M)
    assert [r[0] for r in rows] == [o.flag for o in OPTIONS]
    for flag, default, description in rows:
        unescaped = lambda cell: cell.replace("\\|", "|").replace("\\*", "*")  # noqa: E731
        assert f"(default: {unescaped(default)})" in text and flat(unescaped(description)) in text, flag


# ------------------------------------------------------------------------------------------ unknown options
@pytest.mark.parametrize("args, unknown, suggestion", [
    (["--num_inference_step=8"], "--num_inference_step=8", "--num_inference_steps"),  # a job option
    (["--hieght", "64"], "--hieght", "--height"),  # its value is not reported on its own
    (["--num-inference-steps=8"], "--num-inference-steps=8", "--num_inference_steps"),
    (["--direct_num_worker=2"], "--direct_num_worker=2", "--direct_num_workers"),  # a Beam option
    (["--runer=DataflowRunner"], "--runer=DataflowRunner", "--runner"),
])
def test_misspelled_options_fail_before_any_work(args, unknown, suggestion, tmp_path, capsys):
    """With neither --model nor --input the job would run the demo; with a model folder and input that do not exist
    it would fail on those: a misspelled option stops it first, naming the option it most likely meant."""
    out = tmp_path / "out"
    for extra in ([], [f"--model={tmp_path / 'missing'}", f"--input={tmp_path / 'missing.jsonl'}"]):
        assert main([*args, *extra, f"--output={out}"]) == 2
        captured = capsys.readouterr()
        assert f"error: unknown option {unknown} (did you mean {suggestion}?)" in captured.err
        assert "--help" in captured.err and "RANDOM-WEIGHT" not in captured.out
        assert not out.exists()
    with pytest.raises(UnknownOptionError) as e:
        check_arguments(args)
    assert e.value.unknown == [(unknown, suggestion)]


def test_unknown_options_exit_2_on_the_command_line(tmp_path):
    proc = command("--num_inference_step", "8", f"--output={tmp_path / 'out'}", "stray", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: unknown option --num_inference_step (did you mean --num_inference_steps?)")
    assert "unexpected argument 'stray'" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("arg, option, value, accepted", [
    ("--height=abc", "--height", "abc", "expected a whole number"),
    ("--dtype=float64", "--dtype", "float64", "expected one of bfloat16, float32"),
    ("--input_format=xml", "--input_format", "xml", "expected one of auto, jsonl, csv, tsv, parquet, text, template"),
    ("--guidance_scale=high", "--guidance_scale", "high", "expected a number"),
    ("--require_accelerator=cuda", "--require_accelerator", "cuda", "expected one of tpu, gpu"),
    ("--direct_num_workers=two", "--direct_num_workers", "two", "expected a whole number"),  # a Beam option's
])
def test_bad_values_fail_before_any_work_naming_what_is_accepted(arg, option, value, accepted, tmp_path, capsys):
    with pytest.raises(OptionValueError) as e:
        check_arguments([arg])
    assert (e.value.option, e.value.value, e.value.accepted) == (option, value, accepted)
    out = tmp_path / "out"
    assert main([arg, f"--output={out}"]) == 2
    captured = capsys.readouterr()
    assert f"error: {option}={value}: {accepted}" in captured.err and "RANDOM-WEIGHT" not in captured.out
    assert not out.exists()


def test_other_bad_values_are_usage_errors():
    with pytest.raises(UsageError, match=r"--skip_existing: expected true or false, got 'maybe'"):
        check_arguments(["--skip_existing=maybe"])
    with pytest.raises(OptionValueError, match=r"--height: needs a value: --height=PIXELS"):
        check_arguments(["--height"])


def test_known_beam_options_pass(tmp_path):
    """Runner, direct-runner, Dataflow, worker, setup and debug options are Beam's, and stay accepted."""
    check_arguments([
        "--runner=DataflowRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2",
        "--project=p", "--region=us-central1", f"--temp_location={tmp_path}", "--staging_location=gs://b/s",
        "--job_name=flux2", "--labels=team=ml", "--template_location=gs://b/t.json", "--service_account_email=a@b.c",
        "--sdk_container_image=example.com/img:tag", "--sdk_location=container", "--setup_file=./setup.py",
        "--machine_type=g2-standard-8", "--max_num_workers=4", "--num_workers=1", "--disk_size_gb=150",
        "--number_of_worker_harness_threads=1", "--experiments=a", "--experiments=b", "--worker_zone=us-central1-b",
        "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1", "--no_wait_until_finish",
        "--dry_run=True", "--save_main_session", "--pickle_library=cloudpickle",
        # and the job's own, in both forms a switch takes
        "--input", "a.jsonl", "--input=b.jsonl", "--skip_existing", "--large_model=false", "--seed=-1",
    ])


# ------------------------------------------------------------------------------------------------- the demo
@pytest.mark.slow  # CI time: the demo itself runs in CI (test_pipeline_cli.py::test_readme_demo_command)
def test_demo_at_512(tmp_path):
    """The demo checkpoint has the real model's VAE scale (8) and patching (multiples of 16), so 512x512 costs it
    what it costs the real model, relatively (1024 image tokens), and completes here."""
    out = tmp_path / "out"
    proc = command("--height=512", "--width=512", f"--output={out}", "--no_progress", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["demo"], summary["images_generated"], summary["failed"]) == (True, 7, 0)
    from PIL import Image

    sizes = {Image.open(out / "images" / name).size for name in os.listdir(out / "images")}
    assert sizes == {(512, 512)}


def test_demo_checkpoint_has_the_real_models_scale():
    from tiny_klein import DEMO_SPEC, TinySpec

    from pipeline.demo import DEMO_SIZE

    assert (DEMO_SPEC.vae_scale_factor, DEMO_SPEC.size_multiple) == (8, 16)
    assert DEMO_SIZE % DEMO_SPEC.size_multiple == 0
    assert TinySpec().vae_scale_factor == 2  # the test fixtures' checkpoint is unchanged


# ------------------------------------------------------------------------------------------------ fast errors
@pytest.mark.parametrize("args,words", [
    (["--heigth", "5"], "unknown option --heigth (did you mean --height?)"),
    (["--height=abc"], "--height=abc: expected a whole number"),
    (["--runer=DataflowRunner"], "unknown option --runer=DataflowRunner (did you mean --runner?)"),  # Beam's
    (["--direct_num_workers=two"], "--direct_num_workers=two: expected a whole number"),
])
def test_argument_errors_come_before_importing_beam_jax_and_torch(args, words):
    """A typo or a bad value is answered before the job's heavy imports: neither Beam (seconds to import, any module
    of it), JAX nor torch is imported when the one-line error is printed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipeline.run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    said = [line for line in lines if not line.startswith("import time:")]
    assert len(said) == 1 and said[0].startswith("error: ") and words in said[0], said
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    heavy = sorted(m for m in imported if m.split(".")[0] in ("apache_beam", "jax", "torch"))
    assert not heavy, f"imported before the argument error: {heavy[:10]}"


def test_the_early_check_knows_every_option_the_job_knows():
    """The command line checks arguments before importing the job: the options known then are all of them."""
    code = ("from pipeline import usage\n"
            "names = lambda: {s for a in usage.known_options_parser()._actions for s in a.option_strings}\n"
            "early = names()\n"
            "import pipeline.run, apache_beam.runners.dataflow.dataflow_runner\n"
            "print(sorted(names() - early))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_the_beam_flags_snapshot_is_current():
    """The quick check knows Beam's flags from pipeline/beam_flags.py; regenerated from the installed Beam's option
    classes (in a fresh interpreter: the classes the command line sees), it must not change."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "pipeline.usage", "--beam_flags"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(os.path.join(REPO, "pipeline", "beam_flags.py")) as f:
        assert f.read() == proc.stdout, ("pipeline/beam_flags.py does not match the installed apache-beam's options: "
                                         "regenerate it with `python -m pipeline.usage --beam_flags > "
                                         "pipeline/beam_flags.py`")


def test_the_quick_check_knows_what_the_full_check_knows():
    """Every option string of the full check (Beam's parsers and the job's) is in the quick check, taking the same
    values: same nargs, type and choices, except for the flags whose check is Beam's own, which it lists."""

    def table(parser, unchecked=frozenset()):
        return {s: (a.nargs, None if s in unchecked else getattr(a.type, "__name__", None),
                    None if s in unchecked else (tuple(a.choices) if a.choices is not None else None))
                for a in parser._actions for s in a.option_strings}

    quick, unchecked = quick_parser()
    assert unchecked and "--experiments" in unchecked and "--runner" not in unchecked
    assert table(quick, unchecked) == table(known_options_parser(), unchecked)


@pytest.mark.parametrize("args", [
    ["--heigth", "5"], ["--height=abc", "--heigth=5"], ["--heigth=5", "--height=abc"], ["--height"],
    ["--skip_existing=maybe"], ["--streaming=yes"], ["--num_workers=-x"], ["--flexrs_goal=FAST"],
    ["--runner", "--height=16"], ["stray", "--runner=x", "--seed", "1", "--sed=2"], ["--input", "a", "-x"],
    ["--experiments=a", "--heigth=5"],  # a flag whose check is Beam's own: the full check says
    ["--beam_services=not-json", "--heigth=5"],  # its value is the first error
])
def test_the_quick_check_says_what_the_full_check_says(args):
    with pytest.raises(UsageError) as full:
        check_arguments(args)
    try:
        check_arguments_quickly(args)
    except UsageError as quick:
        assert (type(quick), str(quick)) == (type(full.value), str(full.value))
    else:
        assert {a.split("=", 1)[0] for a in args} & quick_parser()[1], "the quick check missed an error"
