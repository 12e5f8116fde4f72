"""The forms the programs compute in on each platform, picked in one place from the platform and the chip's kind.

Each form is the same map as diffusers' (tests/model/test_model_parity.py checks every one on CPU), in the shape
that was fastest where it is used (docs/performance.md): on TPUs RoPE swaps pairs by a matmul, the VAE upsamples by
a transposed conv, splash attention reads q, k and v laid out by model.nets.heads_kernel, and one-device attention on
TPU v5 lite runs the flash kernel; elsewhere the plain forms. JAX-free: a pure function of two strings.
"""

from __future__ import annotations

import dataclasses

# The splash kernel's smallest block; sequences are padded to a multiple of the chosen block.
SPLASH_BLOCK = 128
# Splash block triples (block_q, block_kv, block_kv_compute) with the rate each reached in TFLOP/s of the unpadded
# work on one chip (`python -m benchmarks.splash_sweep`, klein-4B's attention at 1024x1024, heads MEASURED_HEAD_DIM
# wide; docs/performance.md). Triples past 1536 do not compile on v5e (scoped VMEM).
MEASURED_HEAD_DIM = 128
SPLASH_MEASURED = {
    "TPU v5 lite": {(1536, 1536, 512): 109.8, (1152, 2304, 384): 109.3, (768, 1536, 768): 106.5,
                    (1024, 1024, 512): 104.5, (512, 512, 512): 92.0, (1152, 1152, 384): 91.8},
}
# Other generations, not measured on a chip: the largest power-of-two block up to this size (a multiple of the
# MXU's width that keeps a block's float32 logits inside VMEM; the preflight compiles it for each generation), 512
# for a TPU not named here.
SPLASH_MAX_BLOCK = {"TPU v5": 512, "TPU v6 lite": 1024, "TPU7x": 1024}
DEFAULT_TPU_MAX_BLOCK = 512
# Chips whose one-device unmasked attention runs the flash kernel (model/nets/flash_attention.py: every key of a head in
# one block, which splash cannot hold in its scoped VMEM) instead of splash: measured faster there.
FLASH_KERNEL_CHIPS = ("TPU v5 lite",)

ROPE_FORMS = ("pairs", "matmul")
UPSAMPLE_FORMS = ("phases", "dilated")


@dataclasses.dataclass(frozen=True)
class PlatformForms:
    """How the programs compute on one platform: the defaults are every platform's but the TPU's."""

    # RoPE's pair swap (model.nets.transformer): "pairs" splits the lanes into pairs (fastest on XLA:CPU), "matmul"
    # multiplies by the signed pair-swap matrix on the MXU (a trailing axis of 2 tiles 64x wider on a TPU).
    rope: str = "pairs"
    # The VAE's upsample-then-conv (model.nets.vae.Upsample): "phases", one low-resolution 2x2 conv with the four output
    # phases as channels (fastest on CPU); "dilated", one transposed conv that a TPU runs without touching the zeros.
    upsample: str = "phases"
    # Splash attention on one device reads q, k and v laid out head-major by model.nets.heads_kernel (norm, RoPE and
    # scale on the way), a Pallas kernel for TPUs.
    heads_kernel: bool = False
    # One-device unmasked attention runs model.nets.flash_attention instead of splash.
    flash_kernel: bool = False
    # Splash block triples measured on this chip for MEASURED_HEAD_DIM-wide heads, with their TFLOP/s.
    splash_measured: tuple[tuple[tuple[int, int, int], float], ...] = ()
    # Otherwise splash's blocks: the largest power-of-two multiple of SPLASH_BLOCK up to this.
    splash_max_block: int = SPLASH_BLOCK

    def __post_init__(self):
        if self.rope not in ROPE_FORMS:
            raise ValueError(f"unknown RoPE form {self.rope!r}; choose one of {ROPE_FORMS}")
        if self.upsample not in UPSAMPLE_FORMS:
            raise ValueError(f"unknown upsample form {self.upsample!r}; choose one of {UPSAMPLE_FORMS}")


def forms_for(platform: str, device_kind: str | None = None) -> PlatformForms:
    """The forms for JAX platform `platform` ("cpu", "gpu", "tpu") and, on TPUs, the chip's `device_kind` (JAX's
    `device.device_kind`, e.g. "TPU v5 lite"), which picks the flash kernel and the splash blocks."""
    if platform != "tpu":
        return PlatformForms()
    kind = device_kind or ""
    return PlatformForms(rope="matmul", upsample="dilated", heads_kernel=True, flash_kernel=kind in FLASH_KERNEL_CHIPS,
                         splash_measured=tuple(SPLASH_MEASURED.get(kind, {}).items()),
                         splash_max_block=SPLASH_MAX_BLOCK.get(kind, DEFAULT_TPU_MAX_BLOCK))


def splash_blocks(forms: PlatformForms, lq: int, lk: int, head_dim: int = MEASURED_HEAD_DIM) -> tuple[int, int, int]:
    """(block_q, block_kv, block_kv_compute) for queries and keys of lengths lq, lk (padded up to the blocks by the
    caller). Measured chip and head width: the triple with the least padded work per unit of measured rate (ties:
    the larger block). Otherwise (wider heads take more VMEM per block, e.g. the VAE's 512): the largest power-of-two
    multiple of SPLASH_BLOCK up to `forms.splash_max_block` that divides both lengths after padding them to
    SPLASH_BLOCK."""
    if forms.splash_measured and head_dim == MEASURED_HEAD_DIM:
        def cost(item):
            (bq, bkv, _), rate = item
            return (-(-lq // bq) * bq) * (-(-lk // bkv) * bkv) / rate, -bq * bkv

        return min(forms.splash_measured, key=cost)[0]
    lq, lk = -(-lq // SPLASH_BLOCK) * SPLASH_BLOCK, -(-lk // SPLASH_BLOCK) * SPLASH_BLOCK
    block = SPLASH_BLOCK
    while block * 2 <= forms.splash_max_block and lq % (block * 2) == 0 and lk % (block * 2) == 0:
        block *= 2
    return block, block, block
