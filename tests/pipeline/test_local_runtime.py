"""A local run whose worker is the launching process starts the accelerator runtime before the pipeline does, beside
the launch's checks; never where the model loads in another process, on a CPU-only machine, or before --worker_env's
variables are set (they are set first)."""

import os
import types

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

import model
from pipeline.launch import start_local_runtime


def _job(large_model=False, model_copies=None, worker_env=()):
    """The parts of a job's spec (pipeline/specs.py) that decide it."""
    return types.SimpleNamespace(limits=types.SimpleNamespace(large_model=large_model, model_copies=model_copies),
                                 reliability=types.SimpleNamespace(worker_env=worker_env))


@pytest.fixture
def starts(monkeypatch):
    calls = []
    monkeypatch.setattr(model, "start_runtime", lambda: calls.append("started"))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    return calls


def test_an_in_process_run_on_an_accelerator_starts_the_runtime_early(starts):
    for argv in ([], ["--direct_running_mode=in_memory"], ["--direct_running_mode=multi_threading"]):
        assert start_local_runtime(PipelineOptions(argv), _job(), device_nodes=lambda: ["/dev/accel0"])
    assert starts == ["started"] * 3


@pytest.mark.parametrize("argv, job, nodes", [
    (["--direct_running_mode=multi_processing"], _job(), ["/dev/accel0"]),  # the workers are other processes
    ([], _job(large_model=True), ["/dev/accel0"]),      # the model loads in a model server process
    ([], _job(model_copies=2), ["/dev/accel0"]),
    ([], _job(), []),                                   # no accelerator here
])
def test_no_early_start_where_the_worker_is_elsewhere_or_has_no_accelerator(starts, argv, job, nodes):
    assert not start_local_runtime(PipelineOptions(argv), job, device_nodes=lambda: nodes)
    assert starts == []


def test_the_worker_env_is_set_before_the_early_start(monkeypatch):
    """The worker is this process: --worker_env's variables (the TPU runtime's settings) are in its environment
    before the runtime starts, as the model handler would set them before its load."""
    seen = []
    monkeypatch.setattr(model, "start_runtime", lambda: seen.append(os.environ.get("TPU_PREMAPPED_BUFFER_SIZE")))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("TPU_PREMAPPED_BUFFER_SIZE", "1")  # restored after the test
    job = _job(worker_env=(("TPU_PREMAPPED_BUFFER_SIZE", "2147483648"),))
    assert start_local_runtime(PipelineOptions([]), job, device_nodes=lambda: ["/dev/vfio/0"])
    assert seen == ["2147483648"]


def test_jax_platforms_cpu_means_no_accelerator_runtime(starts, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not start_local_runtime(PipelineOptions([]), _job(), device_nodes=lambda: ["/dev/accel0"])
    assert starts == []
