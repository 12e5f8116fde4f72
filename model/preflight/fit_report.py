"""The preflight's answer for one (model, topology, shape, shard count): what one chip holds at its peak, whether
that fits its HBM, the calibrated time per image, the machine-readable form, and what would fit when it does not.
Importing it does not load JAX.
"""

from __future__ import annotations

import dataclasses
import math

from .estimate import V5E_CALIBRATION, ProgramStats, batch_term
from .topology import CHIPS, GiB, Topology


def runs_flash_kernel(chip, devices: int) -> bool:
    """Whether the attention runs the flash kernel: one-device programs on a chip whose forms say so
    (model.nets.platform_forms)."""
    from ..nets.platform_forms import forms_for

    return devices == 1 and any(spec is chip and forms_for("tpu", kind).flash_kernel for kind, spec in CHIPS.items())


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything the preflight found for one (model, topology, shape, shard count)."""

    model: str
    topology: Topology
    dtype: str
    height: int
    width: int
    batch: int                  # compiled batch (all data replicas)
    steps: int
    cfg: bool
    model_shards: int
    attention: str
    parameter_bytes: dict       # per device, by module
    programs: dict              # name -> ProgramStats
    hbm_bytes_per_chip: int
    auto_shards: bool = False   # the shard count was picked by the preflight
    advice: tuple = ()
    batch_picked: bool = False  # the batch is the fastest up to `max_batch_size` that fits (model.preflight.aot.fit)
    max_batch_size: int | None = None
    batch_trials: tuple = ()    # every batch compiled to find it: (batch, model shards, peak bytes per chip, fits)
    quantize: str = "none"      # EngineOptions.quantize the programs were built with

    @property
    def data_replicas(self) -> int:
        return len(self.topology.devices) // self.model_shards

    def per_chip(self, per_device: float) -> float:
        return per_device * self.topology.devices_per_chip

    @property
    def resident_bytes_per_chip(self) -> int:
        """Every program's parameters live on the chip at once."""
        return int(self.per_chip(sum(self.parameter_bytes.values())))

    @property
    def largest_program(self) -> str:
        """The program that needs the most beyond the parameters (one the compiler refused first)."""
        return max(self.programs.values(), key=lambda p: (p.compile_error is not None, p.transient_bytes)).name

    @property
    def peak_bytes_per_chip(self) -> int:
        return self.resident_bytes_per_chip + int(self.per_chip(self.programs[self.largest_program].transient_bytes))

    @property
    def fits(self) -> bool:
        refused = any(p.compile_error for p in self.programs.values())
        return not refused and self.peak_bytes_per_chip <= self.hbm_bytes_per_chip

    def flops_per_image(self, program: ProgramStats) -> float:
        """All devices' work on one image: (XLA's FLOPs + kernel FLOPs) per device x devices / compiled batch."""
        return (program.flops + program.kernel_flops) * len(self.topology.devices) / self.batch

    def est_seconds(self, program: ProgramStats) -> float:
        return program.est_seconds(self.topology.chip, self.topology.devices_per_chip, int8=self.quantize == "int8",
                                   flash=self.flash_attention)

    @property
    def flash_attention(self) -> bool:
        return runs_flash_kernel(self.topology.chip, len(self.topology.devices))

    @property
    def seconds_at_peak_per_image(self) -> float:
        """The compute-bound floor: every program's FLOPs on one device at the device's bf16 peak, per image."""
        peak = self.topology.chip.bf16_flops / self.topology.devices_per_chip
        return sum(p.flops + p.kernel_flops for p in self.programs.values()) / peak / self.batch

    @property
    def est_seconds_per_batch(self) -> float:
        return sum(self.est_seconds(p) for p in self.programs.values())

    @property
    def est_seconds_per_image(self) -> float:
        """The programs' calibrated time per image plus the host's measured time per image and what the batch per
        data replica adds to it (model.preflight.estimate.batch_term)."""
        return (self.est_seconds_per_batch / self.batch + V5E_CALIBRATION.host_seconds_per_image
                + batch_term(self.batch // self.data_replicas, int8=self.quantize == "int8"))

    @property
    def estimate_label(self) -> str:
        """What the estimate is: calibrated on the chip kind it is for, or carried over from v5e to another chip."""
        if self.topology.chip.name == V5E_CALIBRATION.chip:
            return (f"calibrated estimate: the compiler's FLOPs and bytes at efficiencies measured on a "
                    f"{V5E_CALIBRATION.chip} chip ({V5E_CALIBRATION.source})")
        return (f"calibrated on v5e, not measured: the compiler's FLOPs and bytes for {self.topology.chip.name} at the "
                f"efficiencies measured on a {V5E_CALIBRATION.chip} chip")

    def to_json(self) -> dict:
        """The machine-readable report (the CLI's last line)."""
        return {
            "model": self.model, "topology": self.topology.name, "chip": self.topology.chip.name,
            "chips": self.topology.chips, "devices": len(self.topology.devices),
            "devices_per_chip": self.topology.devices_per_chip, "hosts": self.topology.hosts, "dtype": self.dtype,
            "quantize": self.quantize,
            "height": self.height, "width": self.width, "batch": self.batch,
            "batch_per_replica": self.batch // self.data_replicas, "steps": self.steps, "cfg": self.cfg,
            "batch_picked": self.batch_picked, "max_batch_size": self.max_batch_size,
            "batch_search": [{"batch": b, "model_shards": s, "peak_bytes_per_chip": int(peak), "fits": ok}
                             for b, s, peak, ok in self.batch_trials],
            "model_shards": self.model_shards, "model_shards_picked": self.auto_shards,
            "data_replicas": self.data_replicas, "hbm_bytes_per_chip": self.hbm_bytes_per_chip,
            "parameter_bytes_per_chip": {k: int(self.per_chip(v)) for k, v in self.parameter_bytes.items()},
            "resident_bytes_per_chip": self.resident_bytes_per_chip, "peak_bytes_per_chip": self.peak_bytes_per_chip,
            "largest_program": self.largest_program, "fits": self.fits,
            "headroom_bytes": self.hbm_bytes_per_chip - self.peak_bytes_per_chip,
            "bf16_peak_flops_per_chip": self.topology.chip.bf16_flops,
            "est_seconds_per_image": _finite(self.est_seconds_per_image),
            "seconds_at_peak_per_image": _finite(self.seconds_at_peak_per_image),
            "images_per_hour_per_host": _finite(3600.0 / self.est_seconds_per_image)
            if self.est_seconds_per_image else None,
            "attention": self.attention, "estimate": self.estimate_label,
            "calibration": dataclasses.asdict(V5E_CALIBRATION),
            "programs": {p.name: {
                "argument_bytes": int(self.per_chip(p.argument_bytes)), "temp_bytes": int(self.per_chip(p.temp_bytes)),
                "output_bytes": int(self.per_chip(p.output_bytes)), "flops": _finite(self.flops_per_image(p)),
                "kernel_flops": p.kernel_flops * len(self.topology.devices) / self.batch,
                "optimal_seconds": meaningful_optimal_seconds(p), "est_seconds": _finite(self.est_seconds(p)),
                "bytes_accessed": _finite(p.bytes_accessed * len(self.topology.devices) / self.batch),
                "est_basis": "calibrated roofline",
                "compile_s": round(p.compile_s, 2), "mosaic_kernels": p.mosaic_kernels,
                "mosaic_counted_in": p.text_source, "compile_error": p.compile_error,
                "loop_trips": p.loop_trips,
                "collectives_per_device": p.collectives} for p in self.programs.values()},
            "advice": list(self.advice),
        }


def fit_advice(report: Report, resident_by_shards: dict, smaller: Report | None = None) -> tuple[str, ...]:
    """What would fit when `report` does not: `smaller`, the largest smaller batch that fits on this chip (compiled:
    its peak), more shards (their parameters per chip), a chip with more HBM. `resident_by_shards`: shard count ->
    bytes per chip."""
    cap, shortfall = report.hbm_bytes_per_chip, report.peak_bytes_per_chip - report.hbm_bytes_per_chip
    transient = report.peak_bytes_per_chip - report.resident_bytes_per_chip
    advice = []
    if smaller is not None:
        shards = "" if smaller.model_shards == report.model_shards else f" with --model_shards {smaller.model_shards}"
        advice.append(f"a smaller batch: --batch_size {smaller.batch}{shards} fits "
                      f"({format_bytes(smaller.peak_bytes_per_chip)} of {format_bytes(cap)} per chip; "
                      f"--batch_size auto picks it)")
    more = [s for s, r in sorted(resident_by_shards.items()) if s > report.model_shards and r + transient <= cap]
    if more:
        advice.append(f"more shards: --model_shards {more[0]} holds {format_bytes(resident_by_shards[more[0]])} of "
                      f"parameters per chip (run the preflight with it to check the programs)")
    bigger = [c for c in CHIPS.values() if c.hbm_bytes >= report.peak_bytes_per_chip and c.hbm_bytes > cap]
    if bigger:
        advice.append("a larger machine type: " + ", ".join(f"{c.name} ({format_bytes(c.hbm_bytes)} per chip)"
                                                            for c in sorted(bigger, key=lambda c: c.hbm_bytes)))
    if not advice:
        advice.append(f"a topology with more chips and --model_shards over them (short by {format_bytes(shortfall)} "
                      f"per chip)")
    return tuple(advice)


def meaningful_optimal_seconds(program: ProgramStats) -> float | None:
    """XLA's own time estimate where it means something: None for a program holding Mosaic kernels (XLA cannot see
    inside them; it gives such programs nonsense, negative values included) or one it did not compile."""
    if program.mosaic_kernels or not math.isfinite(program.optimal_seconds) or program.optimal_seconds < 0:
        return None
    return program.optimal_seconds


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity: None stands for a figure that is not known."""
    return x if math.isfinite(x) else None


def format_bytes(n: float) -> str:
    """Bytes for a reader: GiB, or MiB below one GiB (tiny test models)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 1024**2:.1f} MiB"
