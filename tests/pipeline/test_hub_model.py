"""Hugging Face Hub ids as --model (model/loading/hub.py, pipeline/hub_model.py), against a stand-in Hub on 127.0.0.1
(tests/support/hub_server.py: the endpoints huggingface_hub's snapshot_download calls, gated repositories answered
as the Hub answers them) and, for Dataflow launches, the GCS emulator.

The snapshot of `tiny/klein` is downloaded once per module into a shared cache (`hub_cache`); tests that need an
empty cache or another endpoint make their own.
"""

import os
import sys

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from hub_server import HUB_COMMITS
from model.errors import (HubDependencyError, HubGatedRepoError, HubNetworkError, HubOfflineError,
                          HubRepoNotFoundError, HubRevisionNotFoundError)
from model.loading.hub import parse_hub_id, resolve_hub
from pipeline.errors import UsageError
from pipeline.launch import resolve_job
from pipeline.run import main

PIPELINE_FILES = {"model_index.json", "scheduler/scheduler_config.json", "transformer/config.json",
                  "text_encoder/config.json", "vae/config.json", "tokenizer/tokenizer.json"}
NOT_FETCHED = ("flux-2-klein-tiny.safetensors", "README.md", "transformer/diffusion_pytorch_model.fp16.safetensors",
               "vae/diffusion_pytorch_model.bin")


def use_hub(monkeypatch, endpoint: str, cache: str) -> None:
    """huggingface_hub talks to `endpoint` (read at each call by model/loading/hub.py) and keeps snapshots in the
    standard Hub cache of HF_HOME=`cache`/hf-home (no token saved by `hf auth login` there either)."""
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("FLUX2_KLEIN_CACHE", cache)
    monkeypatch.setenv("HF_HOME", os.path.join(cache, "hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE",
                 "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def hub_cache(stand_in_hub, tmp_path_factory):
    """A project cache holding the snapshot of tiny/klein (main), downloaded once from the stand-in Hub."""
    cache = str(tmp_path_factory.mktemp("hub-cache"))
    with pytest.MonkeyPatch.context() as mp:
        use_hub(mp, stand_in_hub.endpoint, cache)
        stand_in_hub.clear()
        snapshot = resolve_hub("tiny/klein")
    return cache, snapshot, list(stand_in_hub.requests)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "a red fox"}\n')
    return str(path)


def test_hub_id_grammar(tmp_path, monkeypatch):
    assert parse_hub_id("black-forest-labs/FLUX.2-klein-4B").repo_id == "black-forest-labs/FLUX.2-klein-4B"
    ref = parse_hub_id("owner/name@refs/pr/1")
    assert (ref.repo_id, ref.revision) == ("owner/name", "refs/pr/1")
    for not_hub in ("./owner/name", "gs://bucket/model", "/abs/model", "a/b/c", "a/..", "name", "owner/name@"):
        assert parse_hub_id(not_hub) is None, not_hub
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert parse_hub_id("owner/name") is None  # an existing relative folder wins


def test_hub_id_snapshot_and_load(hub_cache, stand_in_hub):
    """The snapshot holds what the pipeline reads and nothing else the repository has; model.load takes the id
    (the snapshot already cached: no file is downloaded again). A generate from it is what any local folder gives,
    which the model tests cover; compiling one here would double this test's time."""
    import model

    cache, snapshot, requests = hub_cache
    assert snapshot.commit == HUB_COMMITS["main"] and snapshot.path.startswith(cache)
    files = {os.path.relpath(os.path.join(top, n), snapshot.path) for top, _, names in os.walk(snapshot.path)
             for n in names}
    assert PIPELINE_FILES <= files and not files & set(NOT_FETCHED)
    assert any(f.startswith("transformer/diffusion_pytorch_model-") for f in files)
    asked = " ".join(path for _, path, _ in requests)
    assert "/api/models/tiny/klein/revision/main" in asked
    assert not [name for name in NOT_FETCHED if name in asked], asked
    with pytest.MonkeyPatch.context() as mp:
        use_hub(mp, stand_in_hub.endpoint, cache)
        stand_in_hub.clear()
        gen = model.load("tiny/klein", dtype="float32")  # every tensor checked against the model and loaded
    assert gen.config.transformer.num_layers == 1 and stand_in_hub.requests  # asked the Hub, fetched nothing new
    assert not [path for _, path, _ in stand_in_hub.requests if "/resolve/" in path]


def test_job_takes_a_hub_id_and_its_revision(hub_cache, stand_in_hub, monkeypatch, prompts, tmp_path):
    cache, snapshot, _ = hub_cache
    use_hub(monkeypatch, stand_in_hub.endpoint, cache)
    job = resolve_job(PipelineOptions(["--model=tiny/klein", f"--input={prompts}", f"--output={tmp_path}/out"]))
    assert job.load.model == snapshot.path  # local runner: the workers load the snapshot folder
    stand_in_hub.clear()
    job = resolve_job(PipelineOptions(["--model=tiny/klein@v1", f"--input={prompts}", f"--output={tmp_path}/out"]))
    assert os.path.basename(job.load.model) == HUB_COMMITS["v1"]
    assert ("GET", "/api/models/tiny/klein/revision/v1", None) in stand_in_hub.requests


def test_model_revision_option_and_its_conflict_with_the_id(hub_cache, stand_in_hub, monkeypatch, prompts, tmp_path,
                                                            capsys):
    """--model_revision is the revision of a Hub id, as @rev is; both given and different is a usage error (exit 2)
    before any request; a revision without a Hub id too."""
    cache, _, _ = hub_cache
    use_hub(monkeypatch, stand_in_hub.endpoint, cache)
    base = [f"--input={prompts}", f"--output={tmp_path}/out"]
    for model in (["--model=tiny/klein", "--model_revision=v1"], ["--model=tiny/klein@v1", "--model_revision=v1"]):
        job = resolve_job(PipelineOptions([*model, *base]))
        assert os.path.basename(job.load.model) == HUB_COMMITS["v1"] and job.spec.model.model == "tiny/klein@v1"
    stand_in_hub.clear()
    capsys.readouterr()
    for argv, words in ((["--model=tiny/klein@v1", "--model_revision=main"], "asks for revision 'v1' and "
                         "--model_revision='main' for another"),
                        ([f"--model={tmp_path}", "--model_revision=v1"], "is not one"),
                        (["--model=tiny/klein", "--model_revision=a b"], "must be a branch, tag or commit")):
        assert main([*argv, *base]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and "Traceback" not in err, err
    assert stand_in_hub.requests == []


def test_the_standard_hub_cache_is_used_and_a_model_fetched_by_hf_download_is_not_fetched_again(
        stand_in_hub, monkeypatch, tmp_path):
    """Snapshots live in huggingface_hub's own cache ($HF_HUB_CACHE, else $HF_HOME/hub): `hf download` fills it,
    and the launch then only asks the Hub which commit the revision is, downloading no file."""
    import subprocess

    home = tmp_path / "hf-home"
    use_hub(monkeypatch, stand_in_hub.endpoint, str(tmp_path / "project-cache"))
    monkeypatch.setenv("HF_HOME", str(home))
    hf = os.path.join(os.path.dirname(sys.executable), "hf")
    done = subprocess.run([hf, "download", "tiny/klein"], env=dict(os.environ), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    stand_in_hub.clear()
    snapshot = resolve_hub("tiny/klein")
    assert snapshot.path == str(home / "hub" / "models--tiny--klein" / "snapshots" / HUB_COMMITS["main"])
    assert stand_in_hub.requests and not [p for _, p, _ in stand_in_hub.requests if "/resolve/" in p]
    assert not (tmp_path / "project-cache").exists()
    # HF_HUB_CACHE wins over HF_HOME
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert resolve_hub("tiny/klein").path.startswith(str(tmp_path / "hub-cache") + os.sep)


def test_gated_repository_stops_the_launch(stand_in_hub, monkeypatch, prompts, tmp_path, capsys):
    use_hub(monkeypatch, stand_in_hub.endpoint, str(tmp_path / "cache"))
    assert main(["--model=tiny/gated", f"--input={prompts}", f"--output={tmp_path}/out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model='tiny/gated'") and "Traceback" not in err
    assert "licence" in err and "HF_TOKEN" in err and f"{stand_in_hub.endpoint}/tiny/gated" in err
    # with a token that has not accepted the licence: sent to the Hub, answered 403, the same advice
    monkeypatch.setenv("HF_TOKEN", "hf_not_accepted")
    stand_in_hub.clear()
    with pytest.raises(HubGatedRepoError, match="accept its licence") as e:
        resolve_hub("tiny/gated")
    assert e.value.model == "tiny/gated" and e.value.endpoint == stand_in_hub.endpoint
    assert stand_in_hub.requests[0][2] == "Bearer hf_not_accepted"
    assert not os.path.exists(tmp_path / "out" / "images")


def test_unknown_repository_revision_and_endpoint(stand_in_hub, monkeypatch, tmp_path):
    use_hub(monkeypatch, stand_in_hub.endpoint, str(tmp_path / "cache"))
    with pytest.raises(HubRepoNotFoundError, match="no repository tiny/nope on http://127.0.0.1"):
        resolve_hub("tiny/nope")
    with pytest.raises(HubRevisionNotFoundError, match="tiny/klein has no revision 'v9'"):
        resolve_hub("tiny/klein@v9")
    from hub_server import StandInHub

    closed = StandInHub({})
    closed.stop()  # a port nothing listens on
    monkeypatch.setenv("HF_ENDPOINT", closed.endpoint)
    with pytest.raises(HubNetworkError) as e:
        resolve_hub("tiny/klein")
    assert closed.endpoint in str(e.value) and e.value.endpoint == closed.endpoint


def test_offline_mode(hub_cache, stand_in_hub, monkeypatch, prompts, tmp_path, capsys):
    """HF_HUB_OFFLINE=1: the cached snapshot, without a single request; without one, a clear launch error."""
    cache, snapshot, _ = hub_cache
    use_hub(monkeypatch, stand_in_hub.endpoint, cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    stand_in_hub.clear()
    assert resolve_hub("tiny/klein").path == snapshot.path
    job = resolve_job(PipelineOptions(["--model=tiny/klein", f"--input={prompts}", f"--output={tmp_path}/out"]))
    assert job.load.model == snapshot.path and stand_in_hub.requests == []
    with pytest.raises(HubOfflineError, match="no cached snapshot of tiny/klein@v9"):
        resolve_hub("tiny/klein@v9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["--model=tiny/klein", f"--input={prompts}", f"--output={tmp_path}/out"]) == 2
    err = capsys.readouterr().err
    assert "offline mode (HF_HUB_OFFLINE)" in err and "no cached snapshot of tiny/klein" in err
    assert stand_in_hub.requests == []


def test_missing_package_names_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` raises ImportError
    with pytest.raises(HubDependencyError, match=r"pip install 'huggingface_hub==2\.4\.0'"):
        resolve_hub("tiny/klein")


def test_dataflow_launch_copies_the_snapshot_to_gcs_once(hub_cache, stand_in_hub, gcs_emulator, gcs_bucket,
                                                         monkeypatch, tmp_path):
    """A Dataflow launch resolves the id here, copies the snapshot to {--model_cache or --temp_location}/
    flux2-klein-models/{owner}--{name}@{commit}/ (marker last) and hands the workers that prefix; a second launch
    copies nothing. The workers' copy of that prefix is the snapshot, byte for byte."""
    from model.loading.checkpoint import resolve_checkpoint
    from pipeline import hub_model
    from pipeline.graph import make_handler

    cache, snapshot, _ = hub_cache
    use_hub(monkeypatch, stand_in_hub.endpoint, cache)
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_bytes(f"{b}/in/p.jsonl", b'{"prompt": "x"}\n')
    argv = ["--model=tiny/klein", f"--input={b}/in/p.jsonl", f"--output={b}/out", "--runner=DataflowRunner",
            "--project=test-project", "--region=us-central1", f"--temp_location={b}/tmp"]
    job = resolve_job(PipelineOptions(argv))
    prefix = f"{b}/tmp/flux2-klein-models/tiny--klein@{HUB_COMMITS['main']}"
    assert job.load.model == prefix and make_handler(job).settings.model == prefix
    objects = gcs_emulator.list_blobs(prefix)
    marker = f"tmp/flux2-klein-models/tiny--klein@{HUB_COMMITS['main']}/{hub_model.SNAPSHOT_MARKER}"
    assert marker in objects and f"{prefix[len(b) + 1:]}/model_index.json" in objects
    assert max(o.updated for o in objects.values()) == objects[marker].updated  # written last

    assert resolve_job(PipelineOptions(argv)).load.model == prefix
    assert gcs_emulator.list_blobs(prefix)[marker].generation == objects[marker].generation  # nothing rewritten

    worker_copy = resolve_checkpoint(prefix, cache_dir=str(tmp_path / "worker"))
    for top, _, names in os.walk(snapshot.path):
        for name in names:
            rel = os.path.relpath(os.path.join(top, name), snapshot.path)
            with open(os.path.join(top, name), "rb") as a, open(os.path.join(worker_copy, rel), "rb") as c:
                assert a.read() == c.read(), rel

    # --model_cache wins over --temp_location; a local one is refused before any download
    job = resolve_job(PipelineOptions([*argv, f"--model_cache={b}/models"]))
    assert job.load.model == f"{b}/models/flux2-klein-models/tiny--klein@{HUB_COMMITS['main']}"
    stand_in_hub.clear()
    with pytest.raises(UsageError, match="--model_cache='/tmp/models' is not one"):
        resolve_job(PipelineOptions([*argv, "--model_cache=/tmp/models"]))
    assert stand_in_hub.requests == []


def test_a_failed_upload_leaves_no_marker_and_the_next_launch_copies_again(hub_cache, gcs_emulator, gcs_bucket,
                                                                           monkeypatch):
    """One file of the snapshot cannot be uploaded: the copy fails naming the error and writes no marker (workers
    would otherwise load an incomplete copy); the next launch copies it whole."""
    from fault_proxy import FaultRule, in_front_of
    from pipeline import hub_model

    from google.cloud.storage.retry import DEFAULT_RETRY

    _, snapshot, _ = hub_cache
    base = f"gs://{gcs_bucket}/models"
    monkeypatch.setattr(hub_model, "UPLOAD_RETRY", DEFAULT_RETRY.with_delay(initial=0.02, maximum=0.1).with_timeout(1))
    with in_front_of(gcs_emulator, monkeypatch, seed=1) as proxy:
        proxy.set_rules([FaultRule(fraction=1.0, kinds={"upload"}, name=r"/vae/config\.json$", actions=("503",))])
        with pytest.raises(Exception, match="503"):
            hub_model.copy_snapshot_to_gcs(snapshot, base)
        prefix = f"{base}/{hub_model.MODELS_FOLDER}/{snapshot.folder_name}"
        copied = gcs_emulator.list_blobs(prefix)
        assert copied and not [n for n in copied if n.endswith(hub_model.SNAPSHOT_MARKER)]
        proxy.clear_rules()
        assert hub_model.copy_snapshot_to_gcs(snapshot, base) == prefix
    names = {n[len(prefix) - len(f"gs://{gcs_bucket}/") + 1:] for n in gcs_emulator.list_blobs(prefix)}
    expected = {os.path.relpath(os.path.join(top, n), snapshot.path) for top, _, ns in os.walk(snapshot.path)
                for n in ns}
    assert names == expected | {hub_model.SNAPSHOT_MARKER}
