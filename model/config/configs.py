"""Typed configs read from a diffusers-layout checkpoint's JSON files; no model size is hard-coded."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ..errors import ConfigError

# transformers' ACT2FN names this implementation runs, by the function each one is (model.nets.layers implements the
# forms): gelu is the exact erf form; gelu_new / gelu_pytorch_tanh / gelu_fast the tanh form.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu_erf", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "quick_gelu": "quick_gelu"}


# The classes Flux2KleinPipeline's model_index.json names (library, class) for the components this package
# re-implements; another class means other weights or, for the scheduler, other sampling (different images).
COMPONENT_CLASSES = {"transformer": "Flux2Transformer2DModel", "text_encoder": "Qwen3ForCausalLM",
                     "vae": "AutoencoderKLFlux2", "scheduler": "FlowMatchEulerDiscreteScheduler"}


def read_json(path: str) -> dict[str, Any]:
    """Read a JSON object from `path`, raising ConfigError naming the file when it is absent or malformed."""
    if not os.path.isfile(path):
        raise ConfigError("config file is missing", path=path)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file is not valid JSON: {e}", path=path) from e
    if not isinstance(data, dict):
        raise ConfigError("config file must hold a JSON object", path=path, value=type(data).__name__)
    return data


def _get(data: dict, key: str, typ, path: str, default=dataclasses.MISSING):
    """Fetch `key` from `data` checking its type; a missing key without default is a ConfigError."""
    if key not in data or data[key] is None:
        if default is dataclasses.MISSING:
            raise ConfigError("required config key is missing", path=path, key=key, value=None)
        return default
    value = data[key]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(typ, tuple):
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, typ[0]) and not isinstance(v, bool) for v in value)
        if not ok:
            raise ConfigError("config value has the wrong type", path=path, key=key, value=value)
        return tuple(value)
    if not isinstance(value, typ) or (typ in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"config value must be {typ.__name__}", path=path, key=key, value=value)
    return value


def _positive(cfg, path: str, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value <= 0:
            raise ConfigError("config value must be positive", path=path, key=name, value=value)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Flux2Transformer2DModel config (transformer/config.json)."""

    patch_size: int
    in_channels: int
    out_channels: int
    num_layers: int
    num_single_layers: int
    attention_head_dim: int
    num_attention_heads: int
    joint_attention_dim: int
    timestep_guidance_channels: int
    mlp_ratio: float
    axes_dims_rope: tuple[int, ...]
    rope_theta: float
    eps: float
    guidance_embeds: bool

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)

    @classmethod
    def from_dict(cls, d: dict, path: str = "transformer/config.json") -> "TransformerConfig":
        in_channels = _get(d, "in_channels", int, path, 128)
        cfg = cls(
            patch_size=_get(d, "patch_size", int, path, 1),
            in_channels=in_channels,
            out_channels=_get(d, "out_channels", int, path, in_channels),
            num_layers=_get(d, "num_layers", int, path, 8),
            num_single_layers=_get(d, "num_single_layers", int, path, 48),
            attention_head_dim=_get(d, "attention_head_dim", int, path, 128),
            num_attention_heads=_get(d, "num_attention_heads", int, path, 48),
            joint_attention_dim=_get(d, "joint_attention_dim", int, path, 15360),
            timestep_guidance_channels=_get(d, "timestep_guidance_channels", int, path, 256),
            mlp_ratio=_get(d, "mlp_ratio", float, path, 3.0),
            axes_dims_rope=_get(d, "axes_dims_rope", (int,), path, (32, 32, 32, 32)),
            rope_theta=_get(d, "rope_theta", float, path, 2000.0),
            eps=_get(d, "eps", float, path, 1e-6),
            guidance_embeds=_get(d, "guidance_embeds", bool, path, True),
        )
        _positive(cfg, path, "in_channels", "out_channels", "num_attention_heads", "attention_head_dim",
                  "joint_attention_dim", "timestep_guidance_channels", "mlp_ratio")
        for name in ("num_layers", "num_single_layers"):
            if getattr(cfg, name) < 0:
                raise ConfigError("config value must not be negative", path=path, key=name, value=getattr(cfg, name))
        if cfg.patch_size != 1:
            raise ConfigError("only patch_size 1 is supported (FLUX.2 patchifies in the VAE)", path=path,
                              key="patch_size", value=cfg.patch_size)
        if sum(cfg.axes_dims_rope) != cfg.attention_head_dim:
            raise ConfigError("axes_dims_rope must sum to attention_head_dim", path=path, key="axes_dims_rope",
                              value=cfg.axes_dims_rope)
        if any(a % 2 for a in cfg.axes_dims_rope):
            raise ConfigError("every RoPE axis width must be even", path=path, key="axes_dims_rope",
                              value=cfg.axes_dims_rope)
        if len(cfg.axes_dims_rope) > 4:  # positions have 4 axes (time, height, width, text index)
            raise ConfigError("axes_dims_rope may have at most 4 entries (one per position axis)", path=path,
                              key="axes_dims_rope", value=cfg.axes_dims_rope)
        return cfg


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _sliding_windows(d: dict, num_layers: int, path: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers' Qwen3Config derives it: `layer_types`
    when given, else layers from `max_window_layers` on slide when `use_sliding_window` is set."""
    use = _get(d, "use_sliding_window", bool, path, False)
    window = d.get("sliding_window", 4096) if use else None  # transformers' default; null stays None
    if window is not None:
        window = _get({"sliding_window": window}, "sliding_window", int, path)
    if window is not None and window < 1:
        raise ConfigError("sliding_window must be positive", path=path, key="sliding_window", value=window)
    types = d.get("layer_types")
    if types is None:
        first = _get(d, "max_window_layers", int, path, 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in _LAYER_TYPES for t in types)):
        raise ConfigError(f"layer_types must list {num_layers} entries, each one of {_LAYER_TYPES}", path=path,
                          key="layer_types", value=types)
    if "sliding_attention" in types and window is None:
        raise ConfigError("layer_types has sliding_attention layers but no sliding window is set (use_sliding_window "
                          "and sliding_window)", path=path, key="layer_types", value=types)
    return tuple(window if t == "sliding_attention" else None for t in types)


@dataclasses.dataclass(frozen=True)
class TextEncoderConfig:
    """Qwen3 decoder config (text_encoder/config.json); only what the hidden-state path needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool
    hidden_act: str = "silu"
    # Per decoder layer: the sliding-window size of a "sliding_attention" layer, None for full (causal) attention.
    sliding_windows: tuple[int | None, ...] = ()

    def window_of(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if layer < len(self.sliding_windows) else None

    @classmethod
    def from_dict(cls, d: dict, path: str = "text_encoder/config.json") -> "TextEncoderConfig":
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError("rope_parameters must be an object", path=path, key="rope_parameters", value=rope)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = d.get("rope_scaling")
        if rope_type not in (None, "default") or (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get(
                "type", "default")) != "default"):
            raise ConfigError("only the default (unscaled) RoPE is supported", path=path, key="rope_type",
                              value=rope_type if rope_type != "default" else scaling)
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        num_heads = _get(d, "num_attention_heads", int, path)
        hidden = _get(d, "hidden_size", int, path)
        cfg = cls(
            vocab_size=_get(d, "vocab_size", int, path),
            hidden_size=hidden,
            intermediate_size=_get(d, "intermediate_size", int, path),
            num_hidden_layers=_get(d, "num_hidden_layers", int, path),
            num_attention_heads=num_heads,
            num_key_value_heads=_get(d, "num_key_value_heads", int, path, num_heads),
            head_dim=_get(d, "head_dim", int, path, 128),
            rope_theta=_get({"rope_theta": theta}, "rope_theta", float, path),
            rms_norm_eps=_get(d, "rms_norm_eps", float, path, 1e-6),
            attention_bias=_get(d, "attention_bias", bool, path, False),
            hidden_act=_get(d, "hidden_act", str, path, "silu"),
        )
        _positive(cfg, path, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim")
        if cfg.hidden_act not in ACTIVATIONS:  # the real checkpoints use silu
            raise ConfigError(f"unsupported hidden_act; supported: {', '.join(sorted(ACTIVATIONS))}", path=path,
                              key="hidden_act", value=cfg.hidden_act)
        cfg = dataclasses.replace(cfg, sliding_windows=_sliding_windows(d, cfg.num_hidden_layers, path))
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads", path=path,
                              key="num_key_value_heads", value=cfg.num_key_value_heads)
        return cfg


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """AutoencoderKLFlux2 config (vae/config.json); decoder side plus the latent batch-norm."""

    in_channels: int
    out_channels: int
    latent_channels: int
    block_out_channels: tuple[int, ...]  # the decoder's (decoder_block_out_channels when the config sets it)
    encoder_block_out_channels: tuple[int, ...]
    layers_per_block: int
    norm_num_groups: int
    use_quant_conv: bool
    use_post_quant_conv: bool
    mid_block_add_attention: bool
    batch_norm_eps: float
    patch_size: tuple[int, int]

    @property
    def scale_factor(self) -> int:
        """Pixel size of one latent cell: 2 ** (number of decoder up-samplings)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def patched_channels(self) -> int:
        return self.latent_channels * self.patch_size[0] * self.patch_size[1]

    @classmethod
    def from_dict(cls, d: dict, path: str = "vae/config.json") -> "VAEConfig":
        up = d.get("up_block_types")
        if up is not None and any(t != "UpDecoderBlock2D" for t in up):
            raise ConfigError("only UpDecoderBlock2D decoder blocks are supported", path=path,
                              key="up_block_types", value=up)
        patch = _get(d, "patch_size", (int,), path, (2, 2))
        if tuple(patch) != (2, 2):
            # Flux2KleinPipeline patchifies latents 2x2 by construction, whatever the config says.
            raise ConfigError("only a (2, 2) latent patch is supported", path=path, key="patch_size", value=patch)
        encoder_chans = _get(d, "block_out_channels", (int,), path, (128, 256, 512, 512))
        decoder_chans = _get(d, "decoder_block_out_channels", (int,), path, encoder_chans)
        if len(decoder_chans) != len(encoder_chans) or not decoder_chans:
            # The pipeline sizes latents from block_out_channels; a decoder of another depth would mis-size images.
            raise ConfigError("decoder_block_out_channels must have as many entries as block_out_channels",
                              path=path, key="decoder_block_out_channels", value=decoder_chans)
        cfg = cls(
            in_channels=_get(d, "in_channels", int, path, 3),
            out_channels=_get(d, "out_channels", int, path, 3),
            latent_channels=_get(d, "latent_channels", int, path, 32),
            block_out_channels=decoder_chans,
            encoder_block_out_channels=encoder_chans,
            layers_per_block=_get(d, "layers_per_block", int, path, 2),
            norm_num_groups=_get(d, "norm_num_groups", int, path, 32),
            use_quant_conv=_get(d, "use_quant_conv", bool, path, True),
            use_post_quant_conv=_get(d, "use_post_quant_conv", bool, path, True),
            mid_block_add_attention=_get(d, "mid_block_add_attention", bool, path, True),
            batch_norm_eps=_get(d, "batch_norm_eps", float, path, 1e-4),
            patch_size=patch,
        )
        if up is not None and len(up) != len(cfg.block_out_channels):
            raise ConfigError("up_block_types and block_out_channels differ in length", path=path,
                              key="up_block_types", value=up)
        for c in cfg.block_out_channels + cfg.encoder_block_out_channels:
            if c % cfg.norm_num_groups:
                raise ConfigError("block_out_channels must be multiples of norm_num_groups", path=path,
                                  key="block_out_channels", value=cfg.encoder_block_out_channels)
        down = d.get("down_block_types")
        if down is not None and any(t != "DownEncoderBlock2D" for t in down):
            raise ConfigError("only DownEncoderBlock2D encoder blocks are supported", path=path,
                              key="down_block_types", value=down)
        if d.get("act_fn", "silu") != "silu":
            raise ConfigError("only the silu activation is supported", path=path, key="act_fn", value=d["act_fn"])
        _positive(cfg, path, "out_channels", "latent_channels", "layers_per_block", "norm_num_groups")
        return cfg


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """FlowMatchEulerDiscreteScheduler config (scheduler/scheduler_config.json), the parts this pipeline uses."""

    num_train_timesteps: int
    shift: float
    use_dynamic_shifting: bool
    time_shift_type: str
    shift_terminal: float | None
    invert_sigmas: bool

    @classmethod
    def from_dict(cls, d: dict, path: str = "scheduler/scheduler_config.json") -> "SchedulerConfig":
        for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "stochastic_sampling"):
            if d.get(key):
                raise ConfigError("unsupported scheduler option", path=path, key=key, value=d[key])
        cfg = cls(
            num_train_timesteps=_get(d, "num_train_timesteps", int, path, 1000),
            shift=_get(d, "shift", float, path, 1.0),
            use_dynamic_shifting=_get(d, "use_dynamic_shifting", bool, path, False),
            time_shift_type=_get(d, "time_shift_type", str, path, "exponential"),
            shift_terminal=_get(d, "shift_terminal", float, path, None),
            invert_sigmas=_get(d, "invert_sigmas", bool, path, False),
        )
        if cfg.time_shift_type not in ("exponential", "linear"):
            raise ConfigError("unknown time_shift_type", path=path, key="time_shift_type", value=cfg.time_shift_type)
        return cfg


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Everything read from one checkpoint folder."""

    transformer: TransformerConfig
    text_encoder: TextEncoderConfig
    vae: VAEConfig
    scheduler: SchedulerConfig
    is_distilled: bool

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE scale x latent patch)."""
        return self.vae.scale_factor * self.vae.patch_size[0]

    @classmethod
    def from_folder(cls, root: str) -> "PipelineConfig":
        index_path = os.path.join(root, "model_index.json")
        index = read_json(index_path)
        is_distilled = _get(index, "is_distilled", bool, index_path, False)
        for part in ("transformer", "text_encoder", "vae", "scheduler", "tokenizer"):
            entry = index.get(part)
            if entry is None or entry == [None, None]:
                raise ConfigError("model_index.json does not list a required component", path=index_path,
                                  key=part, value=entry)
            named = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
            if part in COMPONENT_CLASSES and named != COMPONENT_CLASSES[part]:
                raise ConfigError(f"model_index.json names {named!r} for the {part}, where FLUX.2 [klein] "
                                  f"(Flux2KleinPipeline) has a {COMPONENT_CLASSES[part]}: this checkpoint is of "
                                  f"another model", path=index_path, key=part, value=entry)
        sched_path = os.path.join(root, "scheduler", "scheduler_config.json")
        cfg = cls(
            transformer=TransformerConfig.from_dict(read_json(os.path.join(root, "transformer", "config.json")),
                                                    os.path.join(root, "transformer", "config.json")),
            text_encoder=TextEncoderConfig.from_dict(read_json(os.path.join(root, "text_encoder", "config.json")),
                                                     os.path.join(root, "text_encoder", "config.json")),
            vae=VAEConfig.from_dict(read_json(os.path.join(root, "vae", "config.json")),
                                    os.path.join(root, "vae", "config.json")),
            scheduler=SchedulerConfig.from_dict(read_json(sched_path), sched_path),
            is_distilled=is_distilled,
        )
        if cfg.vae.patched_channels != cfg.transformer.in_channels:
            raise ConfigError("VAE latent_channels x patch area must equal the transformer's in_channels",
                              path=os.path.join(root, "vae", "config.json"), key="latent_channels",
                              value=cfg.vae.latent_channels)
        return cfg
