"""TPU topologies as libtpu's compiler sees them, with no TPU present: the devices of one worker host and what its
chips hold and reach (vendor figures), for compiling ahead of time (model.preflight.aot).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile

from ..errors import ModelError
from .tpu_catalogue import GOOGLE_PCI_VENDOR, PCI_DEVICES, host_topology, runtime_topology

GiB = 1024**3
# Topology names libtpu 0.0.52 compiled for on a CPU machine (shown when a name is refused).
KNOWN_TOPOLOGIES = ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v6e:1x1", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1", "tpu7x:1x1",
                    "tpu7x:2x2x1")


class TopologyError(ModelError, ValueError):
    """A TPU topology cannot be compiled for: libtpu missing, a name it does not know, or chips of a kind without
    figures here; `topology` is the name asked for."""

    def __init__(self, message: str, *, topology: str):
        self.topology = topology
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """A TPU chip's vendor figures: what its memory holds and how fast it can go (per chip, all its cores)."""

    name: str
    hbm_bytes: int
    bf16_flops: float      # peak bf16 FLOP/s
    hbm_bandwidth: float   # bytes/s


# By the `device_kind` libtpu reports. TPU v7's 192 GB is taken as 10**9 bytes per GB (the smaller reading).
CHIPS = {
    "TPU v4": ChipSpec("TPU v4", 32 * GiB, 275e12, 1.2e12),
    "TPU v5 lite": ChipSpec("TPU v5e", 16 * GiB, 197e12, 819e9),
    "TPU v5": ChipSpec("TPU v5p", 95 * GiB, 459e12, 2.765e12),
    "TPU v6 lite": ChipSpec("TPU v6e", 32 * GiB, 918e12, 1.64e12),
    "TPU7x": ChipSpec("TPU v7", 192 * 10**9, 2307e12, 7.37e12),
}


# What libtpu prints on stderr as it starts on a machine that is no TPU VM (no metadata server, no worker list), from
# its C++ logging before any log level applies: warnings about TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES and an
# INVALID_ARGUMENT error with its source trace. None of it concerns compiling ahead of time.
_STARTUP_NOISE = re.compile(r"could not determine TPU|Logging before InitGoogle|unexpected worker hostname|"
                            r"^=== Source Location Trace|^[\w./-]+\.cc:\d+$")


@contextlib.contextmanager
def quiet_libtpu_start():
    """Hold back what the process writes to stderr (file descriptor 2, where libtpu's C++ logging goes) while libtpu
    starts, then write it out without libtpu's start-up noise (`_STARTUP_NOISE`): other lines, errors included,
    still reach stderr."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to keep clean
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode("utf-8", "replace").splitlines()
                    if not _STARTUP_NOISE.search(line.strip())]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class Topology:
    """One worker's share of a TPU topology: the devices of its first host (a Dataflow worker is one host)."""

    name: str
    devices: tuple
    chip: ChipSpec
    devices_per_chip: int  # 2 on TPU v7 (two TensorCores, each its own device), else 1
    hosts: int

    @property
    def chips(self) -> int:
        return len(self.devices) // self.devices_per_chip


ATTACHED = "attached"  # load_topology's name for this machine's own TPU chips


def load_topology(name: str) -> Topology:
    """The topology `name` (e.g. "v5e:2x2", "tpu7x:1x1") from libtpu, compiling only: no TPU needs to be present.
    ATTACHED: this machine's chips themselves (`attached_chips`)."""
    if name == ATTACHED:
        return attached_chips()
    # No metadata server off Google Cloud; and other processes may hold libtpu's lock (we never touch a device).
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401  (the TPU compiler)
    except ImportError as e:
        raise TopologyError(f"the preflight compiles with libtpu, which is not installed ({e}); pip install "
                            f"libtpu==0.0.52", topology=name) from None
    from jax.experimental import topologies

    try:
        with quiet_libtpu_start():
            desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu raises plain runtime errors for unknown names
        why = str(e).splitlines()[0]
        if name in KNOWN_TOPOLOGIES:  # e.g. on a TPU machine, whose libtpu keeps to its own chips' host bounds
            raise TopologyError(f"libtpu here does not compile for TPU topology {name!r} ({why})",
                                topology=name) from None
        raise TopologyError(f"unknown TPU topology {name!r} ({why}); names that compile include "
                            f"{', '.join(KNOWN_TOPOLOGIES)}", topology=name) from None
    devices = list(desc.devices)
    first = devices[0].process_index
    local = tuple(d for d in devices if d.process_index == first)
    kind = local[0].device_kind
    if kind not in CHIPS:
        raise TopologyError(f"topology {name!r} has devices of kind {kind!r}, whose HBM and peak this preflight does "
                            f"not know; known kinds: {', '.join(CHIPS)}", topology=name)
    chips = {tuple(d.coords) for d in local}
    return Topology(name=name, devices=local, chip=CHIPS[kind], devices_per_chip=len(local) // len(chips),
                    hosts=len({d.process_index for d in devices}))


def attached_chips() -> Topology:
    """This machine's TPU chips as JAX opens them (this process holds them until it ends), to compile for them
    directly; their HBM is what the runtime lets programs use, a little under the vendor figure (15.75 of 16 GiB on
    v5e). TopologyError when there are none, or of a kind without figures here."""
    import jax

    try:
        with quiet_libtpu_start():
            devices = tuple(jax.devices("tpu"))
    except RuntimeError as e:
        raise TopologyError(f"no TPU chips attached here ({str(e).splitlines()[0]})", topology=ATTACHED) from None
    kind = devices[0].device_kind
    if kind not in CHIPS:
        raise TopologyError(f"this machine's TPU devices are of kind {kind!r}, whose HBM and peak this preflight does "
                            f"not know; known kinds: {', '.join(CHIPS)}", topology=ATTACHED)
    chips = {tuple(d.coords) for d in devices}
    per_chip = len(devices) // len(chips)
    chip = CHIPS[kind]
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if limit:
        chip = dataclasses.replace(chip, hbm_bytes=min(chip.hbm_bytes, int(limit) * per_chip))
    return Topology(name=f"{ATTACHED} {len(chips)} x {chip.name}", devices=devices, chip=chip,
                    devices_per_chip=per_chip, hosts=1)




def attached_topology(accelerator_type: str | None = None, pci_devices: str = "/sys/bus/pci/devices") -> str | None:
    """The topology name ("v5e:1x1") of the TPU chips of this machine, without starting the TPU runtime: from the
    runtime's accelerator type when one is given ("v5litepod-1", "v6e-4"), else from the TPU chips on the PCI bus;
    None when neither names a one-host v5e or v6e slice."""
    if accelerator_type:  # the TPU runtime's TPU_ACCELERATOR_TYPE, as the settings files set it: version-chips
        return runtime_topology(accelerator_type)
    found = []
    try:
        for name in sorted(os.listdir(pci_devices)):
            folder = os.path.join(pci_devices, name)
            try:
                with open(os.path.join(folder, "vendor")) as v, open(os.path.join(folder, "device")) as d:
                    if v.read().strip() == GOOGLE_PCI_VENDOR:  # the ids JAX's own hardware check reads
                        found.append(PCI_DEVICES.get(d.read().strip()))
            except OSError:
                continue
    except OSError:
        return None
    kinds = set(found)
    if len(kinds) != 1 or None in kinds:
        return None
    return host_topology(kinds.pop(), len(found))
