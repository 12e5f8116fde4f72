"""The fast path's switches that only benchmarks and tests turn off: each one an optimisation that can be measured
against its absence (the benchmark's ablation rows), and all of them off at once in the reference mode, the naive
path that the fast one is compared with. A deployment never sets these; it sets `model.options.EngineOptions`."""

from __future__ import annotations

import dataclasses

from .options import EngineOptions


@dataclasses.dataclass(frozen=True)
class LabSwitches:
    """Optimisations of the fast path (all on by default but `vae_splash`, measured slower); `reference=True`
    selects the naive path."""

    reference: bool = False            # tokenizer made per call (and every switch below off, see reference_mode)
    fused_loop: bool = True            # all steps in one lax.scan program
    truncated_encoder: bool = True     # stop the text encoder at the deepest needed layer
    device_uint8: bool = True          # pixels -> uint8 on device, only uint8 crosses to host
    dedupe_prompts: bool = True        # encode identical prompts of a batch once
    aot_compile: bool = True           # compile each bucket ahead of time, concurrently
    overlap_host: bool = True          # prepare the next batch while the device works on this one
    image_only_last_block: bool = True  # last transformer block: outputs for image tokens only (text ones unused)
    fused_upsample: bool = True        # VAE: upsample x2 + 3x3 conv without the upsampled copy (4/9 FLOPs)
    tpu_upsample: str = "dilated"      # its form on TPUs: dilated | phases | plain (model.vae.UPSAMPLE_FORMS)
    # VAE mid-block attention by the splash kernel: off | tpu | interpret. Off by default: it made the decode slower on
    # a v5e chip (docs/performance.md)
    vae_splash: str = "off"
    vae_one_pass_norm: bool = True     # VAE GroupNorms: both sums in one pass (fused into the producing conv)
    tpu_rope: str = "matmul"           # RoPE's form on TPUs: matmul | roll | pairs (model.transformer._rope_partner)
    heads_kernel: str = "tpu"          # q/k norm, RoPE, head-major layout in one kernel: tpu | off | interpret
    # Identical layers traced and lowered once per program (each a jitted call, which XLA inlines), and the text
    # encoder's RoPE tables one constant: on by default, it halves the lowering and made images and the warm start
    # faster on a v5e chip (docs/performance.md).
    layers_traced_once: bool = True

    @property
    def fused(self) -> bool:
        """Whether the denoising loop runs as one program (the reference mode always steps from Python)."""
        return self.fused_loop and not self.reference


LAB_FIELDS = frozenset(f.name for f in dataclasses.fields(LabSwitches))


def reference_mode(**engine_overrides) -> dict:
    """`model.load` keyword arguments for the naive path: every switch off, plain attention, no caches, XLA's CPU
    defaults, batched programs. Use as `model.load(path, **reference_mode())`."""
    engine = dict(embed_cache_size=0, attention="dot", text_encoder_attention="dot", cpu_compiler_options=(),
                  per_image=False)
    engine.update(engine_overrides)
    lab = LabSwitches(reference=True, fused_loop=False, truncated_encoder=False, device_uint8=False,
                      dedupe_prompts=False, aot_compile=False, overlap_host=False, image_only_last_block=False,
                      fused_upsample=False, tpu_upsample="plain", vae_splash="off",
                      vae_one_pass_norm=False,
                      tpu_rope="pairs", heads_kernel="off", layers_traced_once=False)
    return {"options": EngineOptions(**engine), "lab": lab}


def split_overrides(overrides: dict) -> tuple[dict, dict]:
    """`model.load`'s keyword overrides -> (EngineOptions fields, LabSwitches fields)."""
    lab = {k: v for k, v in overrides.items() if k in LAB_FIELDS}
    return {k: v for k, v in overrides.items() if k not in LAB_FIELDS}, lab


def parse_overrides(items) -> dict:
    """`key=value` items from a benchmark's command line as keyword overrides: true/false as booleans, digits as
    integers, anything else as text (`split_overrides` then sorts them into engine and lab fields)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return out
