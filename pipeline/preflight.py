"""TPU preflight: compile the job's real programs for a TPU topology on this (CPU) machine, before renting any TPU.

`python -m pipeline.preflight --model M --topology T --height H --width W --batch_size B` reads only the configs of
`M` (a checkpoint, local or gs://, or a bundled preset: model.presets), builds the three programs a worker would run
(encode, the fused denoising loop, decode) with the job's sharding over the topology's chips (data replicas x model
shards, parameters as shapes only), compiles them with libtpu's compiler, and prints per program the per-chip bytes,
FLOPs per image, the compiler's time estimate, the Mosaic kernels and the compile time; then whether everything fits
in the chip's HBM and an estimate of seconds per image: the compiler's FLOPs and bytes at the efficiencies measured on
a TPU v5e chip (`V5E_CALIBRATION`), labelled "calibrated on v5e, not measured" for other chips.

Two corrections to XLA's cost analysis, both said in the output:
- it counts a loop body once: the denoising loop's FLOPs, bytes and seconds are multiplied by its steps;
- it knows nothing of Pallas kernels (splash attention, a Mosaic custom call: its FLOPs are not counted and its
  `optimal_seconds` is meaningless, even negative): attention is estimated from its FLOPs at its measured share of
  the chip's bf16 peak, and every program is timed by the calibrated roofline of the compiler's FLOPs and bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import sys
import time

from model import contract
from model.errors import ModelError
from model.options import DEFAULT_TEXT_ENCODER_OUT_LAYERS, DTYPE_NAMES, PROGRAMS

from .errors import UsageError

logger = logging.getLogger(__name__)

GiB = 1024**3
MOSAIC_CALL = "tpu_custom_call"
# Topology names libtpu 0.0.52 compiled for on a CPU machine (shown when a name is refused).
KNOWN_TOPOLOGIES = ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v6e:1x1", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1", "tpu7x:1x1",
                    "tpu7x:2x2x1")


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


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Shares of a chip's bf16 peak (and of its HBM bandwidth) that each kind of work reached when measured on a chip
    of that kind, and the host's own time per image (tokenize, initial noise, copy back), for the estimate."""

    chip: str                     # ChipSpec.name the figures were measured on
    matmul: float                 # XLA's FLOPs of the transformer and text-encoder programs (fused elementwise included)
    attention: float              # the splash kernels' FLOPs
    convolution: float            # the VAE decode's FLOPs
    memory: float                 # the roofline's bytes leg (not measured apart: no measured program was bytes-bound)
    host_seconds_per_image: float
    source: str


# Measured on one TPU v5e chip, 2026-12-06, klein-4B 1024x1024 bf16 batch 1 at be5473a (benchmarks/tpu_measured.json):
# denoise 998.1 ms, of which the splash kernels 170.6 ms (25.98 TFLOP) and the rest 827.5 ms for XLA's 113.65 TFLOP;
# decode 89.8 ms for 10.72 TFLOP; host 10.9 ms per image (tokenize, copy back). The text encoder (20.9 ms) was not
# used: it is the check (the estimate gives it 26.1 ms, bound by XLA's 21.0 GB of bytes at the nominal bandwidth).
V5E_CALIBRATION = Calibration("TPU v5e", matmul=0.697, attention=0.773, convolution=0.606, memory=1.0,
                              host_seconds_per_image=0.0109, source="benchmarks/tpu_measured.json")


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


def load_topology(name: str) -> Topology:
    """The topology `name` (e.g. "v5e:2x2", "tpu7x:1x1") from libtpu, compiling only: no TPU needs to be present."""
    # No metadata server off Google Cloud; and other processes may hold libtpu's lock (we never touch a device).
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401  (the TPU compiler)
    except ImportError as e:
        raise UsageError(f"the preflight compiles with libtpu, which is not installed ({e}); pip install "
                         f"libtpu==0.0.52") from None
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu raises plain runtime errors for unknown names
        raise UsageError(f"unknown TPU topology {name!r} ({str(e).splitlines()[0]}); names that compile include "
                         f"{', '.join(KNOWN_TOPOLOGIES)}") from None
    devices = list(desc.devices)
    first = devices[0].process_index
    local = tuple(d for d in devices if d.process_index == first)
    kind = local[0].device_kind
    if kind not in CHIPS:
        raise UsageError(f"topology {name!r} has devices of kind {kind!r}, whose HBM and peak this preflight does not "
                         f"know; known kinds: {', '.join(CHIPS)}")
    chips = {tuple(d.coords) for d in local}
    return Topology(name=name, devices=local, chip=CHIPS[kind], devices_per_chip=len(local) // len(chips),
                    hosts=len({d.process_index for d in devices}))


@dataclasses.dataclass(frozen=True)
class PreflightRequest:
    """What to compile: the model, the topology and the job's shape options (as `python -m pipeline.run` takes)."""

    model: str
    topology: str
    height: int
    width: int
    batch_size: int
    dtype: str = "bfloat16"
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    model_shards: int | None = None     # None: the fewest that fit
    max_sequence_length: int = contract.DEFAULT_MAX_SEQUENCE_LENGTH
    hbm_bytes: int | None = None        # testing: HBM per chip instead of the chip's own
    text_encoder_out_layers: tuple[int, ...] = DEFAULT_TEXT_ENCODER_OUT_LAYERS


def resolve_model(model: str):
    """`model`'s configs: a bundled preset's, or a checkpoint's (local or gs://; configs only, never a weight)."""
    from model.checkpoint import read_config
    from model.presets import PRESET_NAMES, is_preset, preset_config

    if is_preset(model) and not os.path.isdir(model):
        return preset_config(model)
    if "://" not in model and not os.path.isdir(model):
        raise UsageError(f"--model {model!r} is neither a checkpoint folder nor a preset ({', '.join(PRESET_NAMES)})")
    return read_config(model)


# ------------------------------------------------------------------------------------------------ pure estimates

def _padded(n: int) -> int:
    from model.attention import SPLASH_BLOCK

    return -(-n // SPLASH_BLOCK) * SPLASH_BLOCK


def attention_flops_per_image(config, *, text_len: int, image_tokens: int, steps: int, cfg: bool,
                              out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS, image_only_last_block: bool = True) -> dict:
    """FLOPs of the attention kernels (q k^T and p v, 2 x 2 x Lq x Lk x width) per image and program, over the
    lengths the splash kernel runs (padded to its block): what XLA's cost analysis leaves out."""
    from model.qwen3 import layers_to_run

    tr, te = config.transformer, config.text_encoder
    seq = _padded(text_len + image_tokens)
    blocks = tr.num_layers + tr.num_single_layers
    per_pass = 4 * seq * seq * tr.inner_dim * blocks
    if image_only_last_block and tr.num_single_layers:  # the last block's queries are the image tokens only
        per_pass -= 4 * (seq - _padded(image_tokens)) * seq * tr.inner_dim
    length = _padded(text_len)
    nb = length // 128 if length >= 128 else 1
    causal_share = (nb + 1) / (2 * nb)  # the kernel skips the blocks above the diagonal
    text_layers = layers_to_run(te, out_layers)[0]
    encode = 4 * length * length * te.num_attention_heads * te.head_dim * causal_share * text_layers
    return {"encode": float(encode), "denoise": float(per_pass * steps * (2 if cfg else 1)), "decode": 0.0}


def kernel_split(config, shards: int) -> dict:
    """Over how many devices of a data replica each program's attention heads are split (1: every shard runs all)."""
    tr, te = config.transformer, config.text_encoder
    text = shards if te.num_attention_heads % shards == 0 and te.num_key_value_heads % shards == 0 else 1
    return {"encode": text, "denoise": shards if tr.num_attention_heads % shards == 0 else 1, "decode": 1}


@dataclasses.dataclass(frozen=True)
class ProgramStats:
    """One compiled program, per device as the compiler reports it (loop trips applied), plus its attention kernels."""

    name: str
    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    alias_bytes: int
    parameter_bytes: int    # of the module whose parameters it takes (resident, counted once for the whole job)
    flops: float            # XLA's count, loop trips applied (the Mosaic kernels not included)
    bytes_accessed: float
    optimal_seconds: float  # XLA's estimate, loop trips applied
    kernel_flops: float     # the attention kernels' FLOPs on one device
    compile_s: float
    mosaic_kernels: int
    loop_trips: int
    text_source: str = "compiled"  # where the Mosaic kernels were counted: "compiled", else "lowered"
    compile_error: str | None = None  # the compiler refused it: out of HBM (its other figures are then unknown)
    # Cross-device collectives in the compiled program, per device and per run of the program text (a loop body,
    # such as one denoising step, is written once): {kind: [ops, result bytes]}; None when the text is not the
    # compiled one (GSPMD places collectives while compiling, so the lowered text has none to count).
    collectives: dict | None = None

    @property
    def transient_bytes(self) -> int:
        """What it needs beyond the resident parameters: temporaries, outputs not aliased to an input, its other
        arguments (argument bytes carry TPU layout padding, so this is slightly conservative)."""
        return (self.temp_bytes + self.output_bytes - self.alias_bytes
                + max(0, self.argument_bytes - self.parameter_bytes))

    def est_seconds(self, chip: ChipSpec, devices_per_chip: int, calibration: Calibration = V5E_CALIBRATION) -> float:
        """Seconds for one run, calibrated: the roofline of XLA's FLOPs (at the measured share of the bf16 peak for
        the program's kind of work: convolutions for decode, matmuls otherwise) and bytes, plus the attention
        kernels' FLOPs at their measured share of the peak (all per device)."""
        peak, bandwidth = chip.bf16_flops / devices_per_chip, chip.hbm_bandwidth / devices_per_chip
        compute = calibration.convolution if self.name == "decode" else calibration.matmul
        rest = max(self.flops / (peak * compute), self.bytes_accessed / (bandwidth * calibration.memory))
        return rest + self.kernel_flops / (peak * calibration.attention)



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
        return program.est_seconds(self.topology.chip, self.topology.devices_per_chip)

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
        """The programs' calibrated time per image plus the host's measured time per image."""
        return self.est_seconds_per_batch / self.batch + V5E_CALIBRATION.host_seconds_per_image

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
            "height": self.height, "width": self.width, "batch": self.batch,
            "batch_per_replica": self.batch // self.data_replicas, "steps": self.steps, "cfg": self.cfg,
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
                "optimal_seconds": _finite(p.optimal_seconds), "est_seconds": _finite(self.est_seconds(p)),
                "bytes_accessed": _finite(p.bytes_accessed * len(self.topology.devices) / self.batch),
                "est_basis": "calibrated roofline",
                "compile_s": round(p.compile_s, 2), "mosaic_kernels": p.mosaic_kernels,
                "mosaic_counted_in": p.text_source, "compile_error": p.compile_error,
                "loop_trips": p.loop_trips,
                "collectives_per_device": p.collectives} for p in self.programs.values()},
            "advice": list(self.advice),
        }


def fit_advice(report: Report, resident_by_shards: dict) -> tuple[str, ...]:
    """What would fit when `report` does not: more shards (their parameters per chip), a smaller batch (by the
    largest program's bytes per image), a chip with more HBM. `resident_by_shards`: shard count -> bytes per chip."""
    cap, shortfall = report.hbm_bytes_per_chip, report.peak_bytes_per_chip - report.hbm_bytes_per_chip
    transient = report.peak_bytes_per_chip - report.resident_bytes_per_chip
    advice = []
    more = [s for s, r in sorted(resident_by_shards.items()) if s > report.model_shards and r + transient <= cap]
    if more:
        advice.append(f"more shards: --model_shards {more[0]} holds {_gib(resident_by_shards[more[0]])} of parameters "
                      f"per chip (run the preflight with it to check the programs)")
    per_replica = report.batch // report.data_replicas
    if per_replica > 1:
        fitting = int((cap - report.resident_bytes_per_chip) // max(1, transient / per_replica))
        if 1 <= fitting < per_replica:
            advice.append(f"a smaller batch: about --batch_size {fitting * report.data_replicas} "
                          f"({fitting} per data replica)")
    bigger = [c for c in CHIPS.values() if c.hbm_bytes >= report.peak_bytes_per_chip and c.hbm_bytes > cap]
    if bigger:
        advice.append("a larger machine type: " + ", ".join(f"{c.name} ({_gib(c.hbm_bytes)} per chip)"
                                                            for c in sorted(bigger, key=lambda c: c.hbm_bytes)))
    if not advice:
        advice.append(f"a topology with more chips and --model_shards over them (short by {_gib(shortfall)} per "
                      f"chip)")
    return tuple(advice)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _gib(n: float) -> str:
    """Bytes for a reader: GiB, or MiB below one GiB (tiny test models)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 1024**2:.1f} MiB"


# ------------------------------------------------------------------------------------------------ compiling

def abstract_modules(config, dtype: str, out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS):
    """(text encoder, transformer, VAE decoder) as the job builds them, shapes only (model.factory)."""
    from model.factory import Networks, check_text_width

    check_text_width(config, out_layers)
    return Networks(config, dtype, tuple(out_layers)).run_modules()


def build_programs(modules, topology: Topology, *, dtype: str, model_shards: int, text_len: int):
    """The job's CompiledPrograms over the topology's devices, parameters as sharded shapes; (programs, attention)."""
    from model.factory import build_programs
    from model.mesh import make_mesh
    from model.options import EngineOptions

    options = EngineOptions(model_shards=model_shards, cpu_compiler_options=())
    try:
        mesh = make_mesh(options, devices=list(topology.devices))
    except ValueError as e:
        raise UsageError(f"--model_shards {model_shards}: {e}") from None
    programs = build_programs(modules, dtype=dtype, mesh=mesh, options=options, text_len=text_len, abstract=True)
    return programs, programs.attention


# What compiling a lowered program gave, by (device kind, mesh shape, hash of the lowered text): a process that
# preflights several models or batches (benchmarks.tpu_estimates) compiles an identical program once.
_COMPILED: dict = {}


def compile_programs(programs, config, bucket, kernel_flops: dict, *, dump_dir: str | None = None) -> dict:
    """Lower and compile encode, the fused denoise loop and decode for `bucket`; {name: ProgramStats}."""
    tr = config.transformer
    lowered = programs.lower(bucket, tr.in_channels, tr.joint_attention_dim, tr.attention_head_dim, fused=True)
    params = programs.parameter_bytes_per_device()
    modules = {"encode": "text_encoder", "denoise": "transformer", "decode": "vae"}
    stats = {}
    for name, low in zip(PROGRAMS, lowered):
        key = (programs.mesh.devices.flat[0].device_kind, programs.mesh.devices.shape,
               hashlib.sha256(low.as_text().encode()).hexdigest())
        fresh = key not in _COMPILED
        if fresh:  # e.g. the same VAE decode for klein-4B and klein-9B on the same mesh
            start = time.perf_counter()
            try:
                compiled = low.compile()
            except Exception as e:  # noqa: BLE001 - JaxRuntimeError; only running out of HBM is an answer
                if not is_out_of_hbm(e):
                    raise
                _COMPILED[key] = (None, str(e), "", "none", time.perf_counter() - start)
            else:
                _COMPILED[key] = (compiled.memory_analysis(), compiled.cost_analysis(), *program_text(compiled, low),
                                  time.perf_counter() - start)
        memory, cost, text, source, seconds = _COMPILED[key]
        trips = bucket.steps if name == "denoise" else 1
        if memory is None:  # `cost` holds the compiler's refusal
            stats[name] = refused_program_stats(name, cost, parameter_bytes=params[modules[name]],
                                                kernel_flops=kernel_flops[name], loop_trips=trips, compile_s=seconds)
            logger.info("the compiler refused %s: %s", name, stats[name].compile_error)
            continue
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            with open(os.path.join(dump_dir, f"{name}.txt" if source == "compiled" else f"{name}.lowered.txt"),
                      "w") as f:
                f.write(text)
        stats[name] = program_stats(name, memory, cost, text,
                                    parameter_bytes=params[modules[name]], kernel_flops=kernel_flops[name],
                                    loop_trips=trips, compile_s=seconds,
                                    text_source=source)
        logger.info("compiled %s in %.1f s%s", name, seconds, "" if fresh else " (the same program, compiled earlier)")
    return stats


def count_kernel_calls(text: str, source: str = "compiled") -> int:
    """Mosaic kernel calls in a program's text: custom calls in the compiled HLO; in the lowered (StableHLO) text,
    where a kernel sits in a function called from many places, every call site of every function holding one."""
    if source == "compiled":
        return text.count(MOSAIC_CALL)
    calls, current = {}, None
    for line in text.splitlines():
        start = re.match(r"\s*func\.func (?:public |private )?@([^\s(]+)\(", line)
        if start:
            current = calls[start.group(1)] = []
        elif current is not None:
            current.extend(re.findall(r"call @([^\s(]+)\(", line))

    @functools.lru_cache(maxsize=None)
    def kernels(function: str) -> int:
        return sum(1 if c == MOSAIC_CALL else kernels(c) for c in calls.get(function, ()) if c != function)

    return kernels("main")


def program_text(compiled, lowered) -> tuple[str, str]:
    """(text, "compiled") of the optimised program, or (text, "lowered") of the program before XLA's passes when the
    compiled one cannot be printed (libtpu 0.0.52's TPU v7 programs hold async ops this jaxlib cannot read back);
    both hold the Mosaic kernels' custom calls."""
    try:
        return compiled.as_text(), "compiled"
    except Exception as e:  # noqa: BLE001 - a JaxRuntimeError from the HLO proto round trip
        logger.warning("the compiled program cannot be printed (%s); counting Mosaic kernels in the lowered one",
                       str(e).splitlines()[0][:200])
        return lowered.as_text(), "lowered"


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COLLECTIVE_LINE = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def collective_traffic(text: str) -> dict:
    """{kind: [ops, bytes]} of the cross-device collectives in a compiled HLO text: each op's result arrays (an async
    op is counted at its -start; its -done carries the same data). Bytes are per device, the data each op moves
    into or out of one device's memory, before the interconnect's own overheads."""
    out: dict = {}
    for line in text.splitlines():
        match = _COLLECTIVE_LINE.search(line)
        if not match or "-done(" in line:
            continue
        result, kind = match.groups()
        if kind + "-start(" in line and result.startswith("("):  # (operand aliases..., result): the last array
            arrays = _ARRAY.findall(result)[-1:]
        else:
            arrays = _ARRAY.findall(result)
        size = sum(_DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
                   for dtype, dims in arrays)
        ops, total = out.get(kind, [0, 0])
        out[kind] = [ops + 1, total + size]
    return out


def is_out_of_hbm(error: Exception) -> bool:
    """Whether a compile error is the TPU compiler finding the program too large for the device's HBM."""
    return "RESOURCE_EXHAUSTED" in str(error) or "HbmOom" in str(error)


_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def refused_program_stats(name, message: str, *, parameter_bytes: int, kernel_flops: float, loop_trips: int,
                          compile_s: float) -> ProgramStats:
    """ProgramStats of a program the compiler refused for lack of HBM: the memory it said was required (its
    parameters included) stands as parameters plus temporaries; FLOPs and seconds are unknown (NaN)."""
    sizes = re.findall(r"\(([\d.]+)([KMGT]?)i?B?\)", message)
    required = int(float(sizes[0][0]) * _SIZE_UNITS[sizes[0][1]]) if sizes else 0
    first = next((line for line in message.splitlines() if "memory" in line or "HBM" in line), message)
    nan = float("nan")
    return ProgramStats(name=name, argument_bytes=int(parameter_bytes), temp_bytes=max(0, required - parameter_bytes),
                        output_bytes=0, alias_bytes=0, parameter_bytes=int(parameter_bytes), flops=nan,
                        bytes_accessed=nan, optimal_seconds=nan, kernel_flops=float(kernel_flops),
                        compile_s=compile_s, mosaic_kernels=0, loop_trips=loop_trips, text_source="none",
                        compile_error=first.strip()[:400])


def program_stats(name, memory, cost, text: str, *, parameter_bytes: int, kernel_flops: float, loop_trips: int,
                  compile_s: float, text_source: str = "compiled") -> ProgramStats:
    """ProgramStats from a compiled program's memory and cost analyses (XLA counts a loop body once: x trips)."""
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    return ProgramStats(
        name=name, argument_bytes=int(memory.argument_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes), alias_bytes=int(memory.alias_size_in_bytes),
        parameter_bytes=int(parameter_bytes), flops=float(cost.get("flops", 0.0)) * loop_trips,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)) * loop_trips,
        optimal_seconds=float(cost.get("optimal_seconds", float("nan"))) * loop_trips,
        kernel_flops=float(kernel_flops), compile_s=compile_s, mosaic_kernels=count_kernel_calls(text, text_source),
        loop_trips=loop_trips, text_source=text_source,
        collectives=collective_traffic(text) if text_source == "compiled" else None)


def resident_bytes_for(modules, devices, shards: int) -> int:
    """Parameter bytes one device holds with `shards` model shards over `devices` (model.sharding's layout)."""
    from flax import nnx

    from model import sharding
    from model.mesh import make_mesh
    from model.options import EngineOptions

    mesh = make_mesh(EngineOptions(model_shards=shards, cpu_compiler_options=()), devices=list(devices))
    return sum(sharding.bytes_per_device(state, sharding.state_shardings(state, mesh))
               for state in (nnx.state(m) for m in modules))


def preflight(request: PreflightRequest, *, dump_dir: str | None = None) -> Report:
    """Compile the request's programs for its topology and report; without `model_shards`, the fewest shards (a
    divisor of the worker's devices) whose programs fit, else the most shards' report with advice."""
    from model.mesh import ShardCountError, check_model_shards, shard_counts
    from model.plan import bucket_for, resolve_sampling

    config = resolve_model(request.model)
    if request.dtype not in DTYPE_NAMES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {request.dtype!r}")
    contract.count("batch_size", request.batch_size)
    text_len = contract.count("max_sequence_length", request.max_sequence_length)
    valid = contract.validate(prompt="", height=request.height, width=request.width,
                              num_inference_steps=request.num_inference_steps,
                              guidance_scale=request.guidance_scale,
                              limits=contract.Limits(size_multiple=config.size_multiple))
    # The checkpoint's defaults, as the generator resolves them (model.plan).
    sampling = resolve_sampling(config, valid.num_inference_steps, valid.guidance_scale)
    steps, cfg = sampling.num_inference_steps, sampling.use_cfg
    topology = load_topology(request.topology)
    devices = len(topology.devices)
    if request.model_shards is not None:
        try:
            check_model_shards(request.model_shards, topology.devices)
        except ShardCountError:
            raise UsageError(f"--model_shards {request.model_shards} must divide the {devices} devices of one "
                             f"{request.topology} host (choose from {shard_counts(devices)})") from None
    capacity = request.hbm_bytes or topology.chip.hbm_bytes
    modules = abstract_modules(config, request.dtype, request.text_encoder_out_layers)
    candidates = [request.model_shards] if request.model_shards else shard_counts(devices)
    resident_by_shards = {s: resident_bytes_for(modules, topology.devices, s) * topology.devices_per_chip
                          for s in shard_counts(devices)}
    report = None
    for i, shards in enumerate(candidates):
        last = i == len(candidates) - 1
        if not last and resident_by_shards[shards] > capacity:
            logger.info("%d model shard(s): the parameters alone take %s per chip, above %s; trying more",
                        shards, _gib(resident_by_shards[shards]), _gib(capacity))
            continue
        programs, attention = build_programs(modules, topology, dtype=request.dtype, model_shards=shards,
                                             text_len=text_len)
        replicas = devices // shards
        bucket = bucket_for(config, height=request.height, width=request.width, sampling=sampling,
                            batch=request.batch_size, data_replicas=replicas)
        per_image = attention_flops_per_image(config, text_len=text_len, image_tokens=bucket.grid_h * bucket.grid_w,
                                              steps=steps, cfg=cfg, out_layers=request.text_encoder_out_layers)
        split = kernel_split(config, shards)
        per_device = {k: v * (bucket.batch // replicas) / split[k] for k, v in per_image.items()}
        logger.info("compiling %s for %s: batch %d, %d model shard(s) x %d data replica(s)", request.model,
                    request.topology, bucket.batch, shards, replicas)
        stats = compile_programs(programs, config, bucket, per_device, dump_dir=dump_dir)
        report = Report(model=request.model, topology=topology, dtype=request.dtype, height=request.height,
                        width=request.width, batch=bucket.batch, steps=steps, cfg=cfg, model_shards=shards,
                        attention=attention, parameter_bytes=programs.parameter_bytes_per_device(), programs=stats,
                        hbm_bytes_per_chip=capacity, auto_shards=request.model_shards is None)
        if report.fits:
            return report
        if not last:
            logger.info("%d model shard(s) peak at %s per chip, above %s; trying more", shards,
                        _gib(report.peak_bytes_per_chip), _gib(capacity))
    return dataclasses.replace(report, advice=fit_advice(report, resident_by_shards))


# ------------------------------------------------------------------------------------------------ output

def _seconds(s: float) -> str:
    if s != s:  # NaN
        return "n/a"
    return f"{s * 1e3:.1f} ms" if abs(s) < 1 else f"{s:.2f} s"


def format_report(report: Report) -> str:
    """The human-readable tables: one row per program, then the whole worker."""
    topo = report.topology
    head = (f"{report.model} on {topo.name} ({topo.chips} x {topo.chip.name}, {len(topo.devices)} devices"
            f"{f', first of {topo.hosts} hosts' if topo.hosts > 1 else ''}), {report.dtype}, "
            f"{report.height}x{report.width}, {report.steps} steps{' with CFG' if report.cfg else ''}, batch "
            f"{report.batch} ({report.batch // report.data_replicas} per data replica)")
    shards = (f"{report.model_shards} model shard(s) x {report.data_replicas} data replica(s)"
              f"{' (picked: the fewest that fit)' if report.auto_shards and report.fits else ''}")
    rows = [("program", "args/chip", "temp/chip", "out/chip", "GFLOP/image", "XLA optimal_s", "est s", "Mosaic",
             "compile s")]  # GFLOP/image: all chips' work, so a program repeated on every model shard counts each
    for p in report.programs.values():
        flops = report.flops_per_image(p)
        rows.append((p.name, _gib(report.per_chip(p.argument_bytes)), _gib(report.per_chip(p.temp_bytes)),
                     _gib(report.per_chip(p.output_bytes)),
                     "refused" if p.compile_error else f"{flops / 1e9:,.{0 if flops >= 1e10 else 3}f}",
                     _seconds(p.optimal_seconds), _seconds(report.est_seconds(p)), str(p.mosaic_kernels),
                     f"{p.compile_s:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    table += [f"{p.name}: refused by the compiler: {p.compile_error}" for p in report.programs.values()
              if p.compile_error]
    spi = report.est_seconds_per_image
    whole = [
        f"parameters resident per chip: {_gib(report.resident_bytes_per_chip)} ("
        + ", ".join(f"{k} {_gib(report.per_chip(v))}" for k, v in report.parameter_bytes.items()) + ")",
        f"peak per chip: {_gib(report.peak_bytes_per_chip)} (resident + {report.largest_program}'s temporaries, "
        f"outputs and other arguments)",
        f"HBM per chip: {_gib(report.hbm_bytes_per_chip)}; headroom "
        f"{_gib(report.hbm_bytes_per_chip - report.peak_bytes_per_chip)}; fits: {'yes' if report.fits else 'NO'}",
        f"estimated {_seconds(spi)} per image, {3600 / spi:,.0f} images/hour per worker host ({report.estimate_label};"
        f" compute-bound floor: {_seconds(report.seconds_at_peak_per_image)} per image, every FLOP at the bf16 peak)"
        if spi and math.isfinite(spi) else "estimated time: n/a (a program was not compiled)",
    ]
    notes = [
        f"Bytes and FLOPs are the compiler's for {topo.chip.name} (bf16 peak {topo.chip.bf16_flops / 1e12:,.0f} "
        f"TFLOP/s per chip); the time is a {report.estimate_label}, not a measurement of this configuration.",
        f"Attention runs in {report.attention} kernels (Mosaic custom calls), which XLA's cost analysis does not see: "
        f"their FLOPs are added from the shapes; XLA's optimal_seconds is shown but not used (not meaningful for "
        f"programs holding such kernels).",
        f"XLA counts a loop body once: denoise is multiplied by its {report.steps} steps. GFLOP/image is the work of "
        f"all chips (the VAE decode, not split, runs on every model shard). Collectives between shards are not timed.",
    ]
    traffic = [f"{p.name}: " + ", ".join(f"{kind} {ops} x = {_gib(size)}" for kind, (ops, size) in
                                         sorted(p.collectives.items()))
               for p in report.programs.values() if p.collectives]
    if traffic:
        traffic = ["collectives per device (per denoising step for denoise; not timed):", *traffic]
    out = [head, shards, "", *table, "", *whole, "", *traffic, *([""] if traffic else []), *notes]
    if not report.fits:
        out += ["", shortfall_message(report)] + [f"  would fit: {a}" for a in report.advice]
    return "\n".join(out)


def shortfall_message(report: Report) -> str:
    """The non-fit line: which program, and by how much it misses the chip's HBM."""
    refused = report.programs[report.largest_program].compile_error
    if refused:
        return (f"does not fit: the compiler refused {report.largest_program} with {report.model_shards} model "
                f"shard(s): {refused}; about {_gib(report.peak_bytes_per_chip - report.hbm_bytes_per_chip)} per chip "
                f"short of the {_gib(report.hbm_bytes_per_chip)} of HBM")
    return (f"does not fit: {report.largest_program} peaks at {_gib(report.peak_bytes_per_chip)} per chip with "
            f"{report.model_shards} model shard(s), {_gib(report.peak_bytes_per_chip - report.hbm_bytes_per_chip)} "
            f"more than the {_gib(report.hbm_bytes_per_chip)} of HBM per chip")


DEMO_MODEL = "demo"  # --model=demo: the bundled demo's tiny random-weight checkpoint (built on first use)
EXAMPLE = f"""\
example: the bundled demo's tiny checkpoint for one v5e chip, about a minute on a CPU (needs the TPU compiler:
pip install -e '.[preflight]', and the demo's: '.[demo]'):
  python -m pipeline.preflight --model={DEMO_MODEL} --topology=v5e:1x1 --height=128 --width=128 --batch_size=1 \\
      --max_sequence_length=32
then the real model, from its preset (configs only, no weights needed), on four chips:
  python -m pipeline.preflight --model=klein-4b --topology=v5e:2x2 --height=1024 --width=1024 --batch_size=4
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line's options, each with its help, and EXAMPLE at the end of --help."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.preflight", description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Checkpoint (local folder or gs://; configs only), a preset: "
                                                       "klein-4b, klein-9b, klein-base-4b, klein-base-9b, or "
                                                       f"'{DEMO_MODEL}' (the bundled demo's tiny checkpoint).")
    parser.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:1x1, v5e:2x2, v6e:2x2, tpu7x:1x1.")
    parser.add_argument("--height", type=int, required=True, help="Image height in pixels, as the job's --height.")
    parser.add_argument("--width", type=int, required=True, help="Image width in pixels, as the job's --width.")
    parser.add_argument("--batch_size", type=int, required=True, help="The job's --batch_size (images per compiled "
                                                                       "batch, rounded up to whole data replicas).")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES,
                        help="Compute dtype, as the job's --dtype (default: %(default)s).")
    parser.add_argument("--num_inference_steps", type=int, default=None,
                        help="Denoising steps (default: the checkpoint's: 4 distilled, 50 base).")
    parser.add_argument("--guidance_scale", type=float, default=None,
                        help="Guidance scale, as the job's --guidance_scale (default: the checkpoint's).")
    parser.add_argument("--model_shards", type=int, default=None,
                        help="Devices sharing one copy of the weights (default: the fewest that fit).")
    parser.add_argument("--max_sequence_length", type=int, default=contract.DEFAULT_MAX_SEQUENCE_LENGTH,
                        help="Text-encoder tokens per prompt, as the job's --max_sequence_length "
                             "(default: %(default)s).")
    parser.add_argument("--dump_dir", default=None, help="Write each compiled program's text to DIR/<program>.txt.")
    parser.add_argument("--hbm_bytes", type=int, default=None, help=argparse.SUPPRESS)  # testing: force a capacity
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    args = parse_args(argv)
    if args.model == DEMO_MODEL and not os.path.isdir(args.model):
        from .demo import demo_checkpoint

        try:
            args.model = demo_checkpoint()
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    request = PreflightRequest(model=args.model, topology=args.topology, height=args.height, width=args.width,
                               batch_size=args.batch_size, dtype=args.dtype,
                               num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
                               model_shards=args.model_shards, max_sequence_length=args.max_sequence_length,
                               hbm_bytes=args.hbm_bytes)
    try:
        report = preflight(request, dump_dir=args.dump_dir)
    except (UsageError, ModelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(json.dumps(report.to_json()))
    if not report.fits:
        print(f"error: {shortfall_message(report)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
