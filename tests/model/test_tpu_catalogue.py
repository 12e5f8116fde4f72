"""One TPU catalogue (model/preflight/tpu_catalogue.py) read by the launch, the topology code and the worker
settings: for every one-host slice a settings file can ask for, each of them names the same topology."""

import importlib.util
import sys

from paths import REPO

from model.preflight import topology, tpu_catalogue
from pipeline import launch_check


def _settings():
    spec = importlib.util.spec_from_file_location("flux2_settings_catalogue_test", f"{REPO}/templates/settings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_reader_names_the_same_topology(tmp_path):
    settings = _settings()
    seen = 0
    for kind, machines in settings.TPU_MACHINE_TYPES.items():
        chip = tpu_catalogue.DATAFLOW_CHIPS[kind]
        for grid, machine in machines.items():
            x, y = (int(n) for n in grid.split("x"))
            want = f"{chip}:{grid}"
            env = settings.tpu_runtime_env(kind, grid)
            assert launch_check.tpu_topology([], machine) == want
            assert launch_check.tpu_topology([f"worker_accelerator=type:{kind};topology:{grid}"], machine) == want
            assert topology.attached_topology(env["TPU_ACCELERATOR_TYPE"]) == want
            pci = tmp_path / want.replace(":", "-")
            for n in range(x * y):  # the machine's chips as the PCI bus lists them
                (pci / str(n)).mkdir(parents=True)
                (pci / str(n) / "vendor").write_text(tpu_catalogue.GOOGLE_PCI_VENDOR + "\n")
                device = next(k.pci_device for k in tpu_catalogue.KINDS if k.chip == chip)
                (pci / str(n) / "device").write_text(device + "\n")
            assert topology.attached_topology(pci_devices=str(pci)) == want
            seen += 1
    assert seen == 6  # v5e and v6e, each 1x1, 2x2 and 2x4


def test_dataflow_names():
    """As Dataflow's TPU pages name them: the machine type a slice requires, the runtime's accelerator type."""
    assert launch_check.tpu_topology([], "ct5lp-hightpu-4t") == "v5e:2x2"
    assert launch_check.tpu_topology([], "ct6e-standard-8t") == "v6e:2x4"
    assert topology.attached_topology("v5litepod-1") == "v5e:1x1"
    assert _settings().tpu_runtime_env("tpu-v6e-slice", "2x4")["TPU_ACCELERATOR_TYPE"] == "v6e-8"


def test_other_machines_name_no_topology():
    assert launch_check.tpu_topology([], "ct5lp-hightpu-2t") is None
    assert launch_check.tpu_topology([], "n1-standard-8") is None
    assert topology.attached_topology("v5litepod-16") is None
    assert topology.attached_topology("v5p-8") is None
