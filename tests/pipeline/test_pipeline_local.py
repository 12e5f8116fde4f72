"""The job on local paths with the multi-process DirectRunner (FnApiRunner, 2 worker processes).

The model is loaded once per worker process by default, and once per machine with `--large_model` (the other process
uses it through Beam's shared-model proxy), whatever the output format; asserted from the handler's metrics. Also covers CSV and text
inputs given as local paths.
"""

import os

import pytest

from pipeline.run import run
from pipeline_helpers import (  # noqa: F401 - ckpt32 and xla_cache are fixtures
    MODEL_ARGS, check_manifest_matches_images, ckpt32, counters, image_names, pids, rows, xla_cache,
)

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
    loads = pids(c, "model_loads_in_process_")
    batches = pids(c, "batches_in_process_")
    assert c["model_loads"] == 1 and list(loads.values()) == [1], loads
    # Both worker processes generated, through the one shared copy.
    assert len(batches) == 2, batches
    assert sum(batches.values()) == N_PROMPTS // 2


def test_model_loaded_once_per_worker_process(inputs, tmp_path, ckpt32, xla_cache):
    c = _job(inputs, tmp_path / "out", ckpt32, xla_cache)
    loads = pids(c, "model_loads_in_process_")
    batches = pids(c, "batches_in_process_")
    assert os.getpid() not in loads  # the workers loaded it, not the launcher
    assert set(loads.values()) == {1}, loads  # once per process that loaded it
    assert c["model_loads"] == len(loads) <= 2
    assert set(batches) <= set(loads)  # every process that generated had loaded its own copy
    assert sum(batches.values()) == N_PROMPTS // 2


@pytest.mark.slow  # CI time: every output goes through the one generation stage test_large_model_loaded_once_per_machine covers
def test_large_model_is_shared_for_webdataset_output_too(inputs, tmp_path, ckpt32, xla_cache):
    """The WebDataset sink neither loads nor shares the model: the one generation stage does (RunInference's
    large_model), as for files."""
    out = tmp_path / "out"
    result, summary = run(_argv(inputs, out, ckpt32, xla_cache, "--large_model", "--output_format=webdataset",
                                "--samples_per_shard=5"))
    assert (summary["images_generated"], summary["failed"]) == (N_PROMPTS, 0)
    c = counters(result)
    loads = pids(c, "model_loads_in_process_")
    assert c["model_loads"] == 1 and list(loads.values()) == [1], loads
    assert sum(pids(c, "batches_in_process_").values()) == N_PROMPTS // 2
    assert sorted(os.listdir(out / "shards")) == [f"{s:05d}{ext}" for s in range(3)
                                                  for ext in (".parquet", ".tar", "_stats.json")]
