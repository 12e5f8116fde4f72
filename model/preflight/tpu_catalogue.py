"""The one catalogue of the TPUs the job knows by name: each kind's chip name in libtpu's topology names, its
Dataflow accelerator type and machine types, its TPU runtime and JAX names, and the one-host grids.

Read by the launch (pipeline/launch_check.py: which topology the workers have), the topology code
(model/preflight/topology.py: which chips this machine has) and the worker settings (templates/settings.py, which
loads this file by its path: standard library only, no import of the package).
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class TpuKind:
    """One TPU generation as each tool names it (None where the job has no such name for it)."""

    chip: str  # libtpu's chip name in topology names: "v5e" in "v5e:2x2"
    dataflow_type: str  # Dataflow's worker_accelerator type
    machine_prefix: str | None = None  # Dataflow's machine types: f"{machine_prefix}-{chips}t"
    runtime_name: str | None = None  # the TPU runtime's TPU_ACCELERATOR_TYPE: f"{runtime_name}-{chips}"
    device_kind: str | None = None  # JAX's device_kind of one chip
    pci_device: str | None = None  # the chip's device id on the PCI bus (Google's vendor id: GOOGLE_PCI_VENDOR)


KINDS = (
    TpuKind("v5e", "tpu-v5-lite-podslice", "ct5lp-hightpu", "v5litepod", "TPU v5 lite", "0x0063"),
    TpuKind("v6e", "tpu-v6e-slice", "ct6e-standard", "v6e", "TPU v6 lite", "0x006f"),
    TpuKind("v5p", "tpu-v5p-slice"),
)
# One host's chips -> its grid in topology names ("v5e:2x2"): the single-host slices the job runs on.
HOST_GRIDS = {1: "1x1", 4: "2x2", 8: "2x4"}
GOOGLE_PCI_VENDOR = "0x1ae0"

# Dataflow accelerator type -> chip name ("tpu-v5-lite-podslice" -> "v5e").
DATAFLOW_CHIPS = {k.dataflow_type: k.chip for k in KINDS}
# Dataflow accelerator type -> {grid: the machine type Dataflow requires for it}.
MACHINE_TYPES = {k.dataflow_type: {grid: f"{k.machine_prefix}-{chips}t" for chips, grid in HOST_GRIDS.items()}
                 for k in KINDS if k.machine_prefix}
# Dataflow accelerator type -> the TPU runtime's name for it (TPU_ACCELERATOR_TYPE's version part).
RUNTIME_NAMES = {k.dataflow_type: k.runtime_name for k in KINDS if k.runtime_name}
# JAX's device kind -> chip name; PCI device id -> chip name.
DEVICE_KINDS = {k.device_kind: k.chip for k in KINDS if k.device_kind}
PCI_DEVICES = {k.pci_device: k.chip for k in KINDS if k.pci_device}

_MACHINE_TYPE = re.compile(r"^([a-z0-9-]+)-([1-9][0-9]*)t$")


def host_topology(chip: str, chips: int) -> str | None:
    """The topology name of one host holding `chips` chips of `chip` ("v5e", 4 -> "v5e:2x2"); None for a count no
    one-host slice has."""
    grid = HOST_GRIDS.get(chips)
    return f"{chip}:{grid}" if grid else None


def machine_topology(machine_type: str | None) -> str | None:
    """The topology of a Dataflow TPU machine type ("ct5lp-hightpu-4t" -> "v5e:2x2"); None for any other."""
    match = _MACHINE_TYPE.match(machine_type or "")
    if not match:
        return None
    kind = next((k for k in KINDS if k.machine_prefix == match.group(1)), None)
    return host_topology(kind.chip, int(match.group(2))) if kind else None


def runtime_topology(accelerator_type: str) -> str | None:
    """The topology of the TPU runtime's accelerator type ("v5litepod-1" -> "v5e:1x1", "v6e-4" -> "v6e:2x2"); None
    for one that names no one-host slice of a kind known here."""
    version, _, chips = accelerator_type.strip().partition("-")
    kind = next((k for k in KINDS if k.runtime_name == version), None)
    return host_topology(kind.chip, int(chips)) if kind and chips.isdigit() else None
