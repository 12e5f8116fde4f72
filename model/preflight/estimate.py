"""What the compiler's figures say a program costs on a TPU chip: the attention kernels' FLOPs (which XLA's cost
analysis does not see), each compiled program's per-device figures, and its time by a roofline calibrated on a
measured chip. Arithmetic on figures; importing it does not load JAX.
"""

from __future__ import annotations

import dataclasses

from ..options import DEFAULT_TEXT_ENCODER_OUT_LAYERS
from .topology import ChipSpec


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Shares of a chip's bf16 peak (and of its HBM bandwidth) that each kind of work reached when measured on a chip
    of that kind, and the host's own time per image (tokenize, initial noise, copy back), for the estimate."""

    chip: str                     # ChipSpec.name the figures were measured on
    matmul: float                 # XLA's FLOPs of the transformer and text-encoder programs (fused elementwise included)
    int8_matmul: float            # the same programs' FLOPs with int8 projections (nets.quantize): int8 runs 2x bf16
    attention: float              # the splash kernels' FLOPs
    flash_attention: float        # the flash kernel's FLOPs, on its chips (nets.platform_forms.FLASH_KERNEL_CHIPS)
    convolution: float            # the VAE decode's FLOPs
    memory: float                 # the roofline's bytes leg (not measured apart: no measured program was bytes-bound)
    host_seconds_per_image: float
    source: str
    # What the batch per data replica adds to an image's time beyond the compiler's figures, which scale with it (see
    # `batch_term`): seconds per batch (shared by its images) and seconds per image per further image in the batch.
    batch_overhead: float = 0.0
    batch_growth: float = 0.0
    int8_batch_overhead: float = 0.0
    int8_batch_growth: float = 0.0


# Fitted to klein-4B's stage times at 1024x1024, batch 1, on one TPU v5e chip (benchmarks/tpu_measured.json); how each
# share follows from those times is in docs/performance.md. The convolution share folds in the decode's memory-bound
# passes, which the roofline's bytes leg does not bind; the text encoder is left out of the fit to check it.
# The batch terms are fitted to klein-4B's measured seconds per image at batches 1, 2 and 4 (int8) and 1 and 2 (bf16)
# on the same chip (docs/performance.md); bf16's growth, with two batches measured, is taken as int8's.
V5E_CALIBRATION = Calibration("TPU v5e", matmul=0.838, int8_matmul=1.347, attention=0.781, flash_attention=0.851,
                              convolution=0.706, memory=1.0,
                              host_seconds_per_image=0.0111, source="benchmarks/tpu_measured.json",
                              batch_overhead=0.04907, batch_growth=0.02303,
                              int8_batch_overhead=0.11107, int8_batch_growth=0.02303)


def batch_term(per_replica: int, *, int8: bool, calibration: Calibration = V5E_CALIBRATION) -> float:
    """Seconds per image that a batch of `per_replica` images on each data replica adds to (or takes from) the time at
    one image, beyond what the compiler's FLOPs and bytes say: a per-batch cost shared by the batch's images (the
    launch of each program and its steps) less at larger batches, and a cost per image that grows with the batch
    (larger activations, the decode's turns). Zero at one image, where the shares were fitted."""
    overhead = calibration.int8_batch_overhead if int8 else calibration.batch_overhead
    growth = calibration.int8_batch_growth if int8 else calibration.batch_growth
    return overhead * (1.0 / per_replica - 1.0) + growth * (per_replica - 1)


def _padded(n: int) -> int:
    """`n` tokens padded to whole blocks of the splash kernel."""
    from ..nets.platform_forms import SPLASH_BLOCK

    return -(-n // SPLASH_BLOCK) * SPLASH_BLOCK


def attention_flops_per_image(config, *, text_len: int, image_tokens: int, steps: int, cfg: bool,
                              out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS) -> dict:
    """FLOPs of the attention kernels (q k^T and p v, 2 x 2 x Lq x Lk x width) per image and program, over the
    lengths the splash kernel runs (padded to its block): what XLA's cost analysis leaves out. The decode's attention
    is XLA's (counted by XLA): 0 there."""
    from ..nets.qwen3 import layers_to_run

    tr, te = config.transformer, config.text_encoder
    seq = _padded(text_len + image_tokens)
    blocks = tr.num_layers + tr.num_single_layers
    per_pass = 4 * seq * seq * tr.inner_dim * blocks
    if tr.num_single_layers:  # the last block's queries are the image tokens only
        per_pass -= 4 * (seq - _padded(image_tokens)) * seq * tr.inner_dim
    length = _padded(text_len)
    nb = length // 128 if length >= 128 else 1
    causal_share = (nb + 1) / (2 * nb)  # the kernel skips the blocks above the diagonal
    text_layers = layers_to_run(te, out_layers)[0]
    encode = 4 * length * length * te.num_attention_heads * te.head_dim * causal_share * text_layers
    return {"encode": float(encode), "denoise": float(per_pass * steps * (2 if cfg else 1)), "decode": 0.0}


def kernel_split(config, shards: int) -> dict:
    """Over how many devices of a data replica each program's attention heads are split (1: every shard runs all):
    the splash kernel's own rule (model.nets.attention), heads split where the shard count divides them."""
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

    def est_seconds(self, chip: ChipSpec, devices_per_chip: int, calibration: Calibration = V5E_CALIBRATION, *,
                    int8: bool = False, flash: bool = False) -> float:
        """Seconds for one run, calibrated: the roofline of XLA's FLOPs (at the measured share of the bf16 peak for
        the program's kind of work: convolutions for decode, matmuls otherwise, int8 matmuls for the int8 model's
        encode and denoise) and bytes, plus the attention kernels' FLOPs at their measured share of the peak (`flash`:
        the flash kernel's, else splash's; all per device)."""
        peak, bandwidth = chip.bf16_flops / devices_per_chip, chip.hbm_bandwidth / devices_per_chip
        matmul = calibration.int8_matmul if int8 else calibration.matmul
        compute = calibration.convolution if self.name == "decode" else matmul
        rest = max(self.flops / (peak * compute), self.bytes_accessed / (bandwidth * calibration.memory))
        attention = calibration.flash_attention if flash else calibration.attention
        return rest + self.kernel_flops / (peak * attention)
