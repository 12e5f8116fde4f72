"""The job on local paths with the multi-process DirectRunner (FnApiRunner, 2 worker processes).

The model is loaded once per worker process by default, and once per machine with `--large_model` (the other process
uses it through Beam's shared-model proxy), whatever the output format; asserted from the handler's metrics. Also covers CSV and text
inputs given as local paths.
"""

import os

import pytest

from pipeline.run import run
from pipeline_helpers import (  # noqa: F401 - ckpt32 and xla_cache are fixtures
    MODEL_ARGS, check_manifest_matches_images, ckpt32, counters, image_names, rows, xla_cache,
)
from transforms.inference import model_loads_in_this_process

N_PROMPTS = 12  # 6 batches of 2, spread over both workers


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    half = N_PROMPTS // 2
    (folder / "a.csv").write_text("id,prompt,seed\n" + "".join(f"c{i},prompt number {i},{i}\n" for i in range(half)))
    (folder / "b.txt").write_text("".join(f"text prompt {i}\n" for i in range(N_PROMPTS - half)))
    return folder


def _argv(inputs, out, ckpt, compile_cache, *extra):
    # Same checkpoint, shapes and XLA cache as the other end-to-end tests: the workers read compiled programs from
    # disk instead of compiling them again.
    return [f"--model={ckpt}", f"--input={inputs / 'a.csv'}", f"--input={inputs / 'b.txt'}", f"--output={out}",
            *MODEL_ARGS, f"--compilation_cache_dir={compile_cache}", "--runner=FnApiRunner",
            "--direct_running_mode=multi_processing", "--direct_num_workers=2", "--no_progress", *extra]


def _job(inputs, out, ckpt, compile_cache, *extra):
    result, summary = run(_argv(inputs, out, ckpt, compile_cache, *extra))
    manifest = rows(str(out), "manifest")
    assert summary["images_generated"] == N_PROMPTS and summary["invalid"] == 0 and summary["failed"] == 0
    assert len(image_names(str(out))) == N_PROMPTS
    assert len(manifest) == N_PROMPTS
    check_manifest_matches_images(str(out), manifest, {})
    assert rows(str(out), "errors") == []
    assert os.path.isfile(out / "summary.json")
    return counters(result)


def test_large_model_loaded_once_per_machine(inputs, tmp_path, ckpt32, xla_cache):
    c = _job(inputs, tmp_path / "out", ckpt32, xla_cache, "--large_model")
    assert c["model_loads"] == c["processes_with_model"] == 1
    # Both worker processes generated, through the one shared copy.
    assert c["generating_processes"] == 2, c
    assert c["batches"] == N_PROMPTS // 2


def test_model_loaded_once_per_worker_process(inputs, tmp_path, ckpt32, xla_cache):
    launcher_loads = model_loads_in_this_process()
    c = _job(inputs, tmp_path / "out", ckpt32, xla_cache)
    assert model_loads_in_this_process() == launcher_loads  # the workers loaded it, not the launcher
    assert c["model_loads"] == c["processes_with_model"] <= 2, c  # once per process that loaded it
    assert 1 <= c["generating_processes"] <= c["processes_with_model"], c  # none generated on another's copy
    assert c["batches"] == N_PROMPTS // 2


@pytest.mark.slow  # CI time: every output goes through the one generation stage test_large_model_loaded_once_per_machine covers
def test_large_model_is_shared_for_webdataset_output_too(inputs, tmp_path, ckpt32, xla_cache):
    """The WebDataset sink neither loads nor shares the model: the one generation stage does (RunInference's
    large_model), as for files."""
    out = tmp_path / "out"
    result, summary = run(_argv(inputs, out, ckpt32, xla_cache, "--large_model", "--output_format=webdataset",
                                "--samples_per_shard=5"))
    assert (summary["images_generated"], summary["failed"]) == (N_PROMPTS, 0)
    c = counters(result)
    assert c["model_loads"] == c["processes_with_model"] == 1, c
    assert c["batches"] == N_PROMPTS // 2
    assert sorted(os.listdir(out / "shards")) == [f"{s:05d}{ext}" for s in range(3)
                                                  for ext in (".parquet", ".tar", "_stats.json")]
