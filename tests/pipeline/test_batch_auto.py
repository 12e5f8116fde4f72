"""--batch_size auto (the default): which batch a job runs at, and how the launch finds the TPU chips to fit it to.

Dataflow launches are covered end to end in tests/templates/test_templates.py (the dry runs); here: the options, a
local run without a TPU (the default batch), and a local run on a machine with a TPU, which the launch recognises
(the TPU runtime's accelerator type, the PCI bus) and fits in a child process with libtpu's compiler.
"""

import logging
import os

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from model import DEFAULT_BATCH_SIZE, attached_topology
from pipeline.errors import UsageError
from pipeline.options import Flux2KleinOptions


def _job(tmp_path, model: str, *args: str):
    from pipeline.launch import resolve_job

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n")
    options = PipelineOptions([f"--model={model}", f"--input={prompts}", f"--output={tmp_path / 'out'}",
                               "--height=64", "--width=64", *args])
    return options, resolve_job(options)


# ------------------------------------------------------------------------------------------------ options
def test_batch_size_is_auto_by_default_and_takes_a_number(tmp_path, tiny_ckpt):
    from pipeline.usage import check_arguments

    _, job = _job(tmp_path, tiny_ckpt)
    assert job.spec.limits.auto_batch and job.spec.limits.max_batch_size == 8
    assert job.load.engine.batch_size == DEFAULT_BATCH_SIZE  # until the launch picks one
    _, job = _job(tmp_path, tiny_ckpt, "--batch_size=AUTO", "--max_batch_size=2")
    assert job.spec.limits.auto_batch and job.load.engine.batch_size == 2  # the default, within the cap
    _, job = _job(tmp_path, tiny_ckpt, "--batch_size=3")
    assert not job.spec.limits.auto_batch and job.load.engine.batch_size == 3
    with pytest.raises(UsageError, match="--batch_size=many: expected a whole number or auto"):
        check_arguments(["--batch_size=many"])
    for bad in ("--batch_size=0", "--max_batch_size=0"):
        with pytest.raises(UsageError, match=bad.split("=")[0]):
            _job(tmp_path, tiny_ckpt, bad)


def test_a_local_run_without_a_tpu_keeps_the_default_and_says_so(tmp_path, tiny_ckpt, capsys):
    from pipeline.launch import tpu_preflight

    options, job = _job(tmp_path, tiny_ckpt)
    job = tpu_preflight(options, job, local=True)  # this machine has no TPU (JAX is on the CPU)
    assert job.load.engine.batch_size == DEFAULT_BATCH_SIZE and "no TPU topology" in job.batch_choice
    assert options.view_as(Flux2KleinOptions).batch_size == DEFAULT_BATCH_SIZE
    assert "TPU preflight" not in capsys.readouterr().out
    options, job = _job(tmp_path, tiny_ckpt, "--batch_size=3")
    assert tpu_preflight(options, job, local=True).batch_choice is None  # a number is the user's: not checked


# ------------------------------------------------------------------------------------------------ finding the chips
def test_attached_topology_from_the_runtime_accelerator_type_or_the_pci_bus(tmp_path):
    assert attached_topology("v5litepod-1") == "v5e:1x1" and attached_topology("v5litepod-4") == "v5e:2x2"
    assert attached_topology("v6e-8") == "v6e:2x4"
    assert attached_topology("v5litepod-3") is None and attached_topology("v9-1") is None

    def bus(*devices):
        root = tmp_path / f"pci{len(os.listdir(tmp_path))}"
        for i, (vendor, device) in enumerate(devices):
            (root / f"0000:00:0{i}.0").mkdir(parents=True)
            (root / f"0000:00:0{i}.0" / "vendor").write_text(vendor + "\n")
            (root / f"0000:00:0{i}.0" / "device").write_text(device + "\n")
        return str(root)

    nic = ("0x1af4", "0x1000")  # not Google's: not counted
    assert attached_topology(pci_devices=bus(nic, ("0x1ae0", "0x0063"))) == "v5e:1x1"
    assert attached_topology(pci_devices=bus(*[("0x1ae0", "0x006f")] * 4, nic)) == "v6e:2x2"
    assert attached_topology(pci_devices=bus(("0x1ae0", "0x0063"), ("0x1ae0", "0x006f"))) is None  # mixed
    assert attached_topology(pci_devices=bus(nic)) is None
    assert attached_topology(pci_devices=str(tmp_path / "missing")) is None


def test_a_local_tpu_is_fitted_only_where_jax_may_use_it(tmp_path, tiny_ckpt, monkeypatch):
    from pipeline.launch_check import local_tpu_topology

    _, job = _job(tmp_path, tiny_ckpt, "--worker_env=TPU_ACCELERATOR_TYPE=v5litepod-4")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert local_tpu_topology(job, tpu_attached=True) == "v5e:2x2"  # --worker_env's, as the worker will have it
    assert local_tpu_topology(job, tpu_attached=False) is None  # no TPU device on this machine
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert local_tpu_topology(job, tpu_attached=True) is None  # JAX kept off the TPU
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
    _, job = _job(tmp_path, tiny_ckpt)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-1")
    assert local_tpu_topology(job, tpu_attached=True) == "v6e:1x1"  # the environment's


def test_a_local_run_on_a_tpu_machine_runs_the_batch_that_fits(tmp_path, tiny_ckpt, monkeypatch, capsys):
    """On a machine whose TPU device nodes exist, a local --batch_size auto run is fitted to its chips: the preflight
    compiles in a child process (on the chips; here, with none to open, for the named topology on the CPU) and the
    job and its options take the batch it picked (which batch the search picks: tests/pipeline/test_preflight.py). Here a v5e chip, named by --worker_env as the
    settings files name it; then one too small for the tiny model, which stops the launch."""
    pytest.importorskip("libtpu", reason="the TPU preflight compiles with libtpu")
    from pipeline import launch

    monkeypatch.setattr(launch, "accelerator_device_nodes", lambda: ["/dev/accel0"])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # as on the TPU machine (each child sets its own)
    tpu_job = ("--worker_env=TPU_ACCELERATOR_TYPE=v5litepod-1", "--max_sequence_length=32", "--max_batch_size=1")
    options, job = _job(tmp_path, tiny_ckpt, *tpu_job)
    job = launch.tpu_preflight(options, job, local=True)
    assert job.load.engine.batch_size == 1
    assert "fit v5e:1x1" in job.batch_choice and options.view_as(Flux2KleinOptions).batch_size == 1
    assert "TPU preflight: fits v5e:1x1 with 1 model shard(s) at batch 1 (picked)" in capsys.readouterr().out

    monkeypatch.setenv("FLUX2_PREFLIGHT_HBM_BYTES", "1000")  # not even the parameters
    options, job = _job(tmp_path, tiny_ckpt, *tpu_job)
    with pytest.raises(UsageError, match="TPU preflight for this machine's v5e:1x1: .*does not fit"):
        launch.tpu_preflight(options, job, local=True)


def test_the_local_preflight_compiles_on_the_chips_first_then_for_the_topology_without_them(tmp_path, tiny_ckpt,
                                                                                             caplog):
    """The child preflight compiles on the machine's own chips (`--topology=attached`: the programs the job's first
    compile then finds in the cache); where JAX cannot open them it compiles for the topology the launch named
    without them. On this machine, which has no chips and whose libtpu knows no such topology, both fail and the
    launch stops, naming the last reason."""
    pytest.importorskip("libtpu", reason="the TPU preflight compiles with libtpu")
    from pipeline.launch_check import pick_local_batch

    caplog.set_level(logging.INFO, logger="pipeline.launch_check")  # the usual path on a TPU machine: no warning
    _, job = _job(tmp_path, tiny_ckpt, "--max_sequence_length=32")
    with pytest.raises(UsageError, match=r"TPU preflight for this machine's v9z:1x1: unknown TPU topology 'v9z:1x1'"):
        pick_local_batch(job, "v9z:1x1")
    assert "on this machine's chips: no TPU chips attached here" in caplog.text
    assert "compiling for v9z:1x1 without them instead" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
