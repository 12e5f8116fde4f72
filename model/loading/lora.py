"""LoRA adapters for the transformer: which of its parameters a LoRA file's keys adapt, checked from the file's
header, and the low-rank factors read from it.

Read layouts, as diffusers' Flux2LoraLoaderMixin reads them:
- diffusers / PEFT: `transformer.<module>.lora_A.weight` (or bare `<module>...`, or PEFT's
  `base_model.model.<module>...`), its alpha in the file's `lora_adapter_metadata`;
- kohya: `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight` / `.lora_up.weight` / `.alpha`;
- BFL / ai-toolkit: `diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`, `single_blocks.0.linear1`, ...

A fused BFL q/k/v projection adapts three of our parameters: they share its down factor (A) and each takes a third
of its up factor's (B) rows. Module names are diffusers' `Flux2Transformer2DModel` names, which are ours
(model/nets/transformer.py): `<module>.weight` is the parameter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np

from ..errors import LoraError

# Key prefixes of adapters for the text encoder (diffusers, kohya): refused, only transformer adapters are read.
TEXT_ENCODER_PREFIXES = ("text_encoder.", "text_encoder_2.", "lora_te_", "lora_te1_", "lora_te2_", "te.",
                         "text_model.")

# BFL module (after `double_blocks.N.` / `single_blocks.N.`) -> our modules (in the block); a q/k/v module splits its
# up factor's rows in as many equal parts.
DOUBLE_BLOCK_MODULES = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.linear_in",),
    "img_mlp.2": ("ff.linear_out",),
    "txt_mlp.0": ("ff_context.linear_in",),
    "txt_mlp.2": ("ff_context.linear_out",),
}
SINGLE_BLOCK_MODULES = {"linear1": ("attn.to_qkv_mlp_proj",), "linear2": ("attn.to_out",)}
OTHER_MODULES = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
}
# kohya writes a BFL module's dots as underscores; these are its names with dots (longest first where one is the
# start of another).
KOHYA_MODULES = sorted([*DOUBLE_BLOCK_MODULES, *SINGLE_BLOCK_MODULES, *OTHER_MODULES], key=len, reverse=True)


@dataclasses.dataclass(frozen=True)
class Factor:
    """A factor's tensor in the file, or `part` (index, count) of its rows in equal parts."""

    key: str
    part: tuple[int, int] | None = None

    def rows(self, shape: tuple[int, ...]) -> tuple[int, int]:
        if self.part is None:
            return 0, shape[0]
        index, count = self.part
        size = shape[0] // count
        return index * size, (index + 1) * size


@dataclasses.dataclass(frozen=True)
class ModuleAdapter:
    """One adapted parameter `<module>.weight` [out, in]: delta = scale * up @ down, with down [rank, in] and up
    [out, rank]; `scale` is the file's alpha / rank (1 without an alpha)."""

    module: str
    down: Factor
    up: Factor
    scale: float
    alpha_key: str | None = None  # kohya's `.alpha` tensor: the scale is its value / rank, read with the factors

    @property
    def parameter(self) -> str:
        return self.module + ".weight"


@dataclasses.dataclass(frozen=True)
class LoraDelta:
    """The factors of one adapted parameter, in torch layout, as float32: delta = scale * up @ down."""

    down: np.ndarray
    up: np.ndarray
    scale: float


def refuse_text_encoder(keys) -> None:
    for key in keys:
        if key.startswith(TEXT_ENCODER_PREFIXES):
            raise LoraError("this adapter adapts the text encoder: only transformer adapters are read", tensor=key)


def _kohya_module(stem: str, key: str) -> str:
    """`lora_unet_double_blocks_0_img_attn_qkv` -> `double_blocks.0.img_attn.qkv` (BFL's name)."""
    rest = stem.removeprefix("lora_unet_")
    match = re.fullmatch(r"(double_blocks|single_blocks)_(\d+)_(.+)", rest)
    prefix, rest = (f"{match[1]}.{match[2]}.", match[3]) if match else ("", rest)
    for name in KOHYA_MODULES:
        if rest == name.replace(".", "_"):
            return prefix + name
    raise LoraError("kohya LoRA key names no module of the FLUX.2 transformer", tensor=key)


def _bfl_modules(module: str, key: str) -> tuple[str, ...]:
    """Our modules for a BFL module name (already-expanded diffusers names pass through)."""
    if module.startswith("sformer_blocks."):  # an alias some exports write
        module = "transformer_blocks." + module.removeprefix("sformer_blocks.")
    if module.startswith(("transformer_blocks.", "single_transformer_blocks.")):
        return (module,)
    match = re.fullmatch(r"(double_blocks|single_blocks)\.(\d+)\.(.+)", module)
    if match:
        table, ours = ((DOUBLE_BLOCK_MODULES, "transformer_blocks") if match[1] == "double_blocks"
                       else (SINGLE_BLOCK_MODULES, "single_transformer_blocks"))
        if match[3] in table:
            return tuple(f"{ours}.{match[2]}.{m}" for m in table[match[3]])
    elif module in OTHER_MODULES:
        return (OTHER_MODULES[module],)
    raise LoraError("LoRA key (BFL / ai-toolkit layout) names no module of the FLUX.2 transformer", tensor=key)


_SUFFIXES = {".lora_A.weight": "down", ".lora_down.weight": "down", ".lora_B.weight": "up",
             ".lora_up.weight": "up", ".alpha": "alpha"}


def _split_key(key: str) -> tuple[str, str]:
    for suffix, role in _SUFFIXES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    raise LoraError("not a LoRA key (expected .lora_A/.lora_B/.lora_down/.lora_up .weight or .alpha): DoRA, LoKr "
                    "and bias adapters are not read", tensor=key)


def _metadata_alpha(metadata: dict):
    """(alpha of a module, use_rslora) from diffusers' `lora_adapter_metadata` (PEFT's LoraConfig as JSON)."""
    text = metadata.get("lora_adapter_metadata") if metadata else None
    if not text:
        return None, False
    try:
        config = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise LoraError(f"lora_adapter_metadata is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise LoraError("lora_adapter_metadata is not a JSON object")
    # A pipeline's save_lora_weights prefixes each component's config ("transformer.lora_alpha"); a model's does not.
    prefixed = {k.removeprefix("transformer."): v for k, v in config.items() if k.startswith("transformer.")}
    config = prefixed or config
    alpha, patterns = config.get("lora_alpha"), config.get("alpha_pattern") or {}

    def alpha_of(module: str):
        for pattern, value in patterns.items():  # PEFT matches a pattern against the module name's end
            if re.fullmatch(rf"(.*\.)?{pattern}", module):
                return float(value)
        return None if alpha is None else float(alpha)

    return alpha_of, bool(config.get("use_rslora"))


def _our_modules(module: str, key: str) -> tuple[str, ...]:
    """Our modules adapted by a file's module name, by its layout (its key prefix)."""
    if module.startswith("lora_unet_"):
        return _bfl_modules(_kohya_module(module, key), key)
    for prefix in ("base_model.model.", "diffusion_model."):
        if module.startswith(prefix):
            return _bfl_modules(module.removeprefix(prefix), key)
    return (module.removeprefix("transformer."),)


def plan_adapter(shapes: dict[str, tuple[int, ...]], metadata: dict | None = None) -> dict[str, ModuleAdapter]:
    """{our parameter name: its ModuleAdapter} for a LoRA file's tensors {key: shape} (header only); LoraError
    naming the key for a key of no known layout, a text-encoder adapter, or a factor without its pair. Whether the
    parameters exist is `check_adapter`'s."""
    refuse_text_encoder(shapes)
    kohya = any(k.endswith(".lora_down.weight") for k in shapes)
    alpha_of, rslora = (None, False) if kohya else _metadata_alpha(metadata or {})
    sources: dict[str, dict[str, str]] = {}  # the file's module -> {role: key}
    for key in shapes:
        module, role = _split_key(key)
        sources.setdefault(module, {})[role] = key
    plans: dict[str, ModuleAdapter] = {}
    for module, roles in sources.items():
        if "down" not in roles or "up" not in roles:
            raise LoraError("LoRA factor without its pair (lora_A/lora_down with lora_B/lora_up)",
                            tensor=next(iter(roles.values())))
        down, up = roles["down"], roles["up"]
        ours = _our_modules(module, down)
        alpha = alpha_of(ours[0]) if alpha_of else None
        rank = shapes[down][0] if len(shapes[down]) == 2 else 0
        scale = 1.0 if alpha is None or not rank else alpha / (math.sqrt(rank) if rslora else rank)
        for index, name in enumerate(ours):
            part = (index, len(ours)) if len(ours) > 1 else None
            plans[name + ".weight"] = ModuleAdapter(name, Factor(down), Factor(up, part), scale, roles.get("alpha"))
    return plans


def check_adapter(plans: dict[str, ModuleAdapter], shapes: dict[str, tuple[int, ...]],
                  parameters: dict[str, tuple[int, ...]]) -> None:
    """LoraError naming the key where an adapted parameter is not one of `parameters` ({name: torch shape [out,
    in]}: the transformer's) or a factor's shape does not fit it."""
    for name, plan in plans.items():
        target = parameters.get(name)
        if target is None or len(target) != 2:
            raise LoraError(f"LoRA key adapts {plan.module!r}, which is no linear layer of this transformer",
                            tensor=plan.down.key)
        down, up = shapes[plan.down.key], shapes[plan.up.key]
        if len(down) != 2 or len(up) != 2:
            raise LoraError(f"LoRA factor is not a matrix: shape {list(down if len(down) != 2 else up)}",
                            tensor=plan.down.key if len(down) != 2 else plan.up.key)
        start, stop = plan.up.rows(up)
        if plan.up.part is not None and up[0] % plan.up.part[1]:
            raise LoraError(f"fused q/k/v LoRA factor has {up[0]} rows, not 3 equal parts", tensor=plan.up.key)
        if down[1] != target[1]:
            raise LoraError(f"LoRA factor shape {list(down)} does not fit {plan.module} (input width {target[1]})",
                            tensor=plan.down.key)
        if stop - start != target[0] or up[1] != down[0]:
            raise LoraError(f"LoRA factor shape {list(up)} does not fit {plan.module} (output width {target[0]}, "
                            f"rank {down[0]})", tensor=plan.up.key)
        if plan.alpha_key is not None and int(np.prod(shapes[plan.alpha_key])) != 1:
            raise LoraError(f"LoRA alpha is not one number: shape {list(shapes[plan.alpha_key])}",
                            tensor=plan.alpha_key)


def read_deltas(plans: dict[str, ModuleAdapter], read, scale: float = 1.0) -> dict[str, LoraDelta]:
    """{parameter name: LoraDelta} with the factors read by `read(key) -> np.ndarray`, the user's `scale` and the
    file's alpha (kohya's `.alpha`: alpha / rank) folded into each delta's scale."""
    cache: dict[str, np.ndarray] = {}

    def tensor(key):
        if key not in cache:
            cache[key] = np.asarray(read(key), np.float32)
        return cache[key]

    deltas = {}
    for name, plan in plans.items():
        down, up = tensor(plan.down.key), tensor(plan.up.key)
        start, stop = plan.up.rows(up.shape)
        factor = plan.scale
        if plan.alpha_key is not None:
            factor = float(tensor(plan.alpha_key).reshape(())) / down.shape[0]
        deltas[name] = LoraDelta(down, np.ascontiguousarray(up[start:stop]), scale * factor)
    return deltas
