"""Options, usage errors, the command line, the Dataflow translation (offline dry run) and the bundled demo."""

import json
import os
import subprocess
import sys

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.option_specs import OPTION_NAMES
from pipeline.options import Flux2KleinOptions
from pipeline.launch import resolve_job
from pipeline.run import UsageError, run
from pipeline.specs import input_list

from paths import REPO  # noqa: E402


def options(*argv):
    return PipelineOptions(list(argv)).view_as(Flux2KleinOptions)


def test_option_parsing():
    o = options("--input=a.jsonl,gs://b/*.csv", "--input", "c.txt", "--skip_existing", "--large_model=false",
                "--num_images=3", "--guidance_scale=2.5", "--dtype=float32")
    assert input_list(o.input) == ("a.jsonl", "gs://b/*.csv", "c.txt")
    assert o.skip_existing is True and o.large_model is False and o.no_progress is False
    assert (o.num_images, o.guidance_scale, o.dtype, o.height, o.num_inference_steps) == (3, 2.5, "float32", None,
                                                                                         None)
    assert options("--skip_existing=true").skip_existing is True
    assert options("--skip_existing=False").skip_existing is False
    all_options = options().get_all_options()
    assert all(name in all_options for name in OPTION_NAMES)


def test_usage_errors(tmp_path, tiny_ckpt):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError, match="--model is required"):
        resolve_job(PipelineOptions([f"--input={prompts}"]))
    with pytest.raises(UsageError, match="--input is required"):
        resolve_job(PipelineOptions([f"--model={tiny_ckpt}"]))
    with pytest.raises(UsageError, match="matches no file"):
        resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={tmp_path / 'nope*.jsonl'}"]))
    with pytest.raises(UsageError, match="is not a folder"):
        resolve_job(PipelineOptions([f"--model={tmp_path / 'missing'}", f"--input={prompts}"]))
    with pytest.raises(UsageError, match="height"):
        resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}", "--height=101"]))
    with pytest.raises(UsageError, match="gs:// location"):
        resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}", "--runner=DataflowRunner",
                                     "--output=/tmp/out"]))
    with pytest.raises(UsageError, match="is a folder, not a file"):
        resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={tmp_path}"]))
    with pytest.raises(UsageError, match="contains a glob character"):  # Beam's sinks would fail after the images
        resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}", f"--output={tmp_path}/run[1]"]))
    with pytest.raises(UsageError, match="--model_variant must be .* got '../fp16'"):
        resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}", "--model_variant=../fp16"]))
    from pipeline.graph import make_handler

    job = resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}", "--model_variant=fp16"]))
    assert job.load.variant == "fp16" and make_handler(job).settings.variant == "fp16"
    from pipeline.probes import is_case_insensitive_folder

    assert is_case_insensitive_folder(str(tmp_path / "new")) is False  # Linux; created, and the probe removed
    assert os.listdir(tmp_path / "new") == []
    job = resolve_job(PipelineOptions([f"--model={tiny_ckpt}", f"--input={prompts}"]))
    assert (job.spec.output.output, job.load.dtype, job.load.engine.batch_size, job.load.max_sequence_length,
            job.defaults.height, job.spec.demo) == \
        ("./output", "bfloat16", 4, 512, 1024, False)


def test_accelerator_options(tmp_path, tiny_ckpt):
    """--worker_env and --require_accelerator (set by the Dataflow settings files) reach the job's model handler."""
    from pipeline.graph import make_handler

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    base = [f"--model={tiny_ckpt}", f"--input={prompts}"]
    job = resolve_job(PipelineOptions([*base, "--require_accelerator=tpu",
                                       "--worker_env=TPU_SKIP_MDS_QUERY=1;TPU_HOST_BOUNDS=1,1,1;EMPTY="]))
    assert job.spec.reliability.require_accelerator == "tpu"
    assert dict(job.spec.reliability.worker_env) == {"TPU_SKIP_MDS_QUERY": "1", "TPU_HOST_BOUNDS": "1,1,1", "EMPTY": ""}
    handler = make_handler(job)
    assert handler._env_vars == dict(job.spec.reliability.worker_env) and handler._require_accelerator == "tpu"
    plain = make_handler(resolve_job(PipelineOptions(base)))
    assert plain._env_vars == {} and plain._require_accelerator is None
    for bad in ("tpu_skip=1", "A=1;A=2", "A"):
        with pytest.raises(UsageError, match=f"--worker_env entry '{bad.split(';')[-1]}'"):
            resolve_job(PipelineOptions([*base, f"--worker_env={bad}"]))
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        resolve_job(PipelineOptions([*base, "--require_accelerator=cuda"]))


def test_required_accelerator_stops_a_cpu_job_at_model_load(tmp_path, tiny_ckpt):
    """On this CPU-only machine a job that requires a GPU fails at model load, naming the platforms, and writes no
    image: it never generates at CPU speed."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    out = tmp_path / "out"
    with pytest.raises(Exception) as e:
        run([f"--model={tiny_ckpt}", f"--input={prompts}", f"--output={out}", "--no_progress",
             "--require_accelerator=gpu"])
    assert "AcceleratorError" in f"{type(e.value).__name__}: {e.value}"
    assert "--require_accelerator=gpu" in str(e.value) and "'cpu'" in str(e.value)
    assert not list(out.glob("images/*.png"))


def test_demo_checkpoint_runs_your_input_on_the_demo_checkpoint(monkeypatch, tmp_path, tiny_ckpt, capsys):
    """--demo_checkpoint: the user's --input on the bundled tiny checkpoint at the demo's size and dtype; the refusal
    of --input without --model says so."""
    import pipeline.graph as graph
    from pipeline import probes

    monkeypatch.setattr(probes, "demo_checkpoint", lambda: tiny_ckpt)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError, match="add --demo_checkpoint"):
        resolve_job(PipelineOptions([f"--input={prompts}"]))
    job = resolve_job(PipelineOptions([f"--input={prompts}", "--demo_checkpoint", f"--output={tmp_path / 'o'}"]))
    assert (job.load.model, job.spec.input.files, job.spec.demo) == (tiny_ckpt, (str(prompts),), False)
    assert (job.defaults.height, job.defaults.width, job.load.dtype) == (128, 128, "float32")
    assert resolve_job(PipelineOptions([f"--input={prompts}", "--demo_checkpoint", "--height=64",
                                        f"--output={tmp_path / 'o'}"])).defaults.height == 64
    with pytest.raises(UsageError, match="--demo_checkpoint and --model=.* both name the checkpoint"):
        resolve_job(PipelineOptions([f"--input={prompts}", "--demo_checkpoint", f"--model={tiny_ckpt}"]))
    with pytest.raises(UsageError, match="--demo_checkpoint is built on this machine"):
        resolve_job(PipelineOptions([f"--input={prompts}", "--demo_checkpoint", "--runner=DataflowRunner"]))

    def built(*args, **kwargs):
        raise RuntimeError("graph built")

    monkeypatch.setattr(graph, "build_pipeline", built)
    with pytest.raises(RuntimeError, match="graph built"):
        run([f"--input={prompts}", "--demo_checkpoint", f"--output={tmp_path / 'o'}", "--no_progress"])
    assert "--demo_checkpoint: your prompts on the bundled tiny RANDOM-WEIGHT checkpoint" in capsys.readouterr().out


def test_command_line_reports_usage_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline.run", f"--input={tmp_path}/p.jsonl"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "error: --model is required" in proc.stderr and "Traceback" not in proc.stderr


def test_dataflow_translation_dry_run(gcs_emulator, gcs_bucket, tiny_ckpt, capsys):
    """The job translates for Dataflow (runner v2 proto, everything pickles) without any network access."""
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_dir(tiny_ckpt, f"{b}/models/klein")  # the launcher reads its configs
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", b'{"prompt": "x"}\n')
    result, summary = run([f"--model={b}/models/klein", f"--input={b}/in/p.jsonl", f"--output={b}/out",
                           "--runner=DataflowRunner", "--dry_run=True", "--project=test-project",
                           "--region=us-central1", f"--temp_location={b}/tmp", "--sdk_location=container",
                           "--sdk_container_image=example.com/flux2-klein:test",
                           "--experiments=no_use_multiple_sdk_containers", "--large_model"])
    assert summary is None and str(result.state) == "DONE"
    assert capsys.readouterr().out.strip().splitlines()[-1] == \
        f"translated (dry run) for DataflowRunner: nothing submitted or written; the output {b}/out was not " \
        f"checked for a previous run's results"
    labels = {t.unique_name for t in result.job.proto_pipeline.components.transforms.values()}
    for name in ("ReadRequests", "Deduplicate", "PlanOutput", "Generate/BatchByShape", "Generate/RunInference",
                 "WriteOutput/WriteImages", "WriteManifest", "WriteErrors", "Summary"):
        assert name in labels, name
    assert "PlanOutput/NoExisting" in labels and not any("ListImages" in label for label in labels)  # no resume
    assert not gcs_emulator.list_blobs(f"{b}/out")  # nothing ran, nothing written


def _offline(env: dict) -> dict:
    """`env` for a process with no network: every HTTP(S) request goes to a proxy port nothing listens on (refused
    at once, as an offline machine's requests fail), no emulator, no metadata-server probe."""
    from gcs_emulator import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in env.items() if k.lower() not in ("no_proxy", "storage_emulator_host")}
    return dict(env, HTTPS_PROXY=dead, HTTP_PROXY=dead, https_proxy=dead, http_proxy=dead, NO_GCE_CHECK="true")


DRY_RUN = ["--runner=DataflowRunner", "--dry_run=True", "--project=test-project", "--region=us-central1",
           "--skip_preflight"]


def test_a_dataflow_dry_run_of_local_files_needs_no_network(tmp_path, tiny_ckpt):
    """The README's dry run with a local checkpoint and input and a gs:// output: translated offline in seconds. The
    output is not listed (a dry run writes nothing), and no default bucket is looked up."""
    import time

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    env = _offline(dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)))
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pipeline.run", *DRY_RUN, "--temp_location=gs://flux2-dry/tmp",
                               f"--model={tiny_ckpt}", f"--input={prompts}", "--output=gs://flux2-dry/out"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the offline dry run was still trying after {e.timeout} s: {(e.stderr or b'')[-2000:]!r}")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "translated (dry run) for DataflowRunner" in proc.stdout
    assert "not checked" in proc.stdout  # it says what it did not do
    assert elapsed < 30, elapsed


def test_a_dry_run_that_needs_gcs_offline_fails_in_seconds_with_one_line(tmp_path, tiny_ckpt, monkeypatch, capsys):
    """A gs:// checkpoint cannot be read offline: one line saying so, within seconds (not after two minutes of
    retries); a dry run without a valid gs:// temp location (Beam would look up a default bucket) and options Beam
    refuses are one line too."""
    import time

    from pipeline.run import main

    for name, value in _offline(dict(os.environ)).items():
        monkeypatch.setenv(name, value)
    for name in ("STORAGE_EMULATOR_HOST", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    start = time.monotonic()
    status = main([*DRY_RUN, "--temp_location=gs://flux2-dry/tmp", "--model=gs://flux2-dry/models/klein",
                   f"--input={prompts}", "--output=gs://flux2-dry/out"])
    elapsed = time.monotonic() - start
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: --model='gs://flux2-dry/models/klein' is on Google Cloud Storage") and \
        "cannot be reached" in lines[0], lines
    assert elapsed < 30, elapsed
    for argv, words in ((["--temp_location=gs://b/tmp", f"--model={tiny_ckpt}"], "needs a valid gs:// --temp_location"),
                        (["--temp_location=gs://flux2-dry/tmp", f"--model={tiny_ckpt}", "--project=p"],
                         "Invalid Project ID (p)")):
        assert main([*DRY_RUN, *argv, f"--input={prompts}", "--output=gs://flux2-dry/out"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], lines


def test_a_submitted_dataflow_job_prints_its_id_and_console_link():
    """Beam logs the job id and the console link at INFO, which the command line does not show: the launch prints
    them (a dry run has no job and says so)."""
    from apache_beam.runners.runner import PipelineResult, PipelineState

    from pipeline.closing import submitted_job_id, submitted_lines

    job = "2026-01-02_03_04_05-1234567890123456789"
    assert submitted_lines("DataflowRunner", "gs://b/out", dry_run=False, job_id=job, region="us-central1",
                           project="my-project") == [
        "submitted to DataflowRunner; outputs will be under gs://b/out",
        f"job id: {job}",
        f"console: https://console.cloud.google.com/dataflow/jobs/us-central1/{job}?project=my-project"]
    assert submitted_lines("DataflowRunner", "gs://b/out", dry_run=True, job_id=None, region="us-central1",
                           project="p") == ["translated (dry run) for DataflowRunner: nothing submitted or written; "
                                            "the output gs://b/out was not checked for a previous run's results"]
    assert submitted_lines("DataflowRunner", "gs://b/out", dry_run=False, job_id=job)[1:] == [f"job id: {job}"]

    class Submitted(PipelineResult):  # a DataflowPipelineResult's part the launch reads
        def job_id(self):
            return job

    assert submitted_job_id(Submitted(PipelineState.RUNNING)) == job
    assert submitted_job_id(PipelineResult(PipelineState.DONE)) is None  # what a dry run returns


def test_readme_demo_command(tmp_path):
    """`python -m pipeline.run` with no --model/--input: the bundled demo, from any working folder."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "pipeline.run"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANDOM-WEIGHT" in proc.stdout and "--model" in proc.stdout and "noise" in proc.stdout
    assert "summary: records read 6, images generated 7" in proc.stdout
    assert "[progress] 7/7 images" in proc.stderr
    out = tmp_path / "output"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["demo"] is True and summary["images_generated"] == 7 and summary["invalid"] == 0
    # --batch_size auto with no TPU to fit: the default, and summary.json says how it was chosen
    assert (summary["batch_size"], summary["batch_size_auto"]) == (4, True)
    assert "no TPU topology" in summary["batch_size_chosen"]
    assert len(os.listdir(out / "images")) == 7
    manifest = (out / "manifest").glob("manifest-*.jsonl")
    assert sum(len(f.read_text().splitlines()) for f in manifest) == 7


def test_unloadable_checkpoint_fails_the_job(gcs_emulator, gcs_bucket):
    """A model that cannot be loaded stops the job with the model's error (naming the checkpoint), rather than
    turning every batch into an error row."""
    from model.errors import CheckpointError

    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", b'{"prompt": "x"}\n')
    with pytest.raises(Exception) as e:
        run([f"--model={b}/models/missing", f"--input={b}/in/p.jsonl", f"--output={b}/out", "--no_progress"])
    assert isinstance(e.value, CheckpointError) or "CheckpointError" in str(e.value)
    assert f"{b}/models/missing" in str(e.value)
    assert not gcs_emulator.list_blobs(f"{b}/out/images/")
