"""CLIP (text and vision towers with their projections) in Flax NNX, for scoring generated images.

Config first, then the forward top to bottom, as transformers' `CLIPModel`: the same tensor names (a module's state
path joined with dots is the checkpoint key), the same pre-LayerNorm encoder layers, the class token of the vision
tower and the end-of-text token of the text tower as the pooled outputs, both projected without bias. The scores
(model.scoring) use the L2-normalized embeddings and `logit_scale.exp()`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError
from ..config.configs import ACTIVATIONS as CONFIG_ACTIVATIONS
from ..parallel.sharding import param
from .attention import attention
from .layers import ACTIVATIONS, Linear, precision_for

# transformers' CLIPTextConfig / CLIPVisionConfig defaults, for keys a config.json leaves out.
TEXT_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                     num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                     eos_token_id=2)
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)


@dataclasses.dataclass(frozen=True)
class TowerConfig:
    """One tower's transformer: width, depth, heads, MLP and LayerNorm settings."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig(TowerConfig):
    vocab_size: int = 49408
    max_position_embeddings: int = 77
    eos_token_id: int = 2


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig(TowerConfig):
    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """A `CLIPModel` config.json: both towers and the shared embedding width."""

    text: CLIPTextConfig
    vision: CLIPVisionConfig
    projection_dim: int = 512

    @classmethod
    def from_file(cls, path: str) -> "CLIPConfig":
        """ConfigError naming the key when the file is not a CLIPModel config this module can run."""
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the score model's config: {e}", path=path) from e
        return cls.from_dict(d, path)

    @classmethod
    def from_dict(cls, d: dict, path: str | None = None) -> "CLIPConfig":
        if not isinstance(d, dict) or not isinstance(d.get("text_config"), dict) or not isinstance(
                d.get("vision_config"), dict):
            raise ConfigError("not a CLIPModel config: text_config and vision_config are needed", path=path,
                              key="model_type", value=d.get("model_type") if isinstance(d, dict) else d)
        archs = d.get("architectures") or ["CLIPModel"]
        if "CLIPModel" not in archs:
            raise ConfigError("the score model must be a CLIPModel checkpoint (both towers and projections)",
                              path=path, key="architectures", value=archs)
        text = _tower(CLIPTextConfig, TEXT_DEFAULTS, d["text_config"], path, "text_config")
        vision = _tower(CLIPVisionConfig, VISION_DEFAULTS, d["vision_config"], path, "vision_config")
        if vision.image_size % vision.patch_size:
            raise ConfigError("image_size must be a multiple of patch_size", path=path,
                              key="vision_config.image_size", value=vision.image_size)
        return cls(text=text, vision=vision, projection_dim=int(d.get("projection_dim", 512)))


def _tower(kind, defaults: dict, d: dict, path, where: str):
    fields = {f.name for f in dataclasses.fields(kind)}
    values = {k: d.get(k, v) for k, v in defaults.items() if k in fields}
    if values["hidden_act"] not in CONFIG_ACTIVATIONS:
        raise ConfigError(f"unsupported hidden_act; supported: {', '.join(sorted(CONFIG_ACTIVATIONS))}", path=path,
                          key=f"{where}.hidden_act", value=values["hidden_act"])
    if values["hidden_size"] % values["num_attention_heads"]:
        raise ConfigError("hidden_size must be a multiple of num_attention_heads", path=path,
                          key=f"{where}.hidden_size", value=values["hidden_size"])
    return kind(**{k: (float(v) if k == "layer_norm_eps" else v if k == "hidden_act" else int(v))
                   for k, v in values.items()})


def read_config(folder: str) -> CLIPConfig:
    return CLIPConfig.from_file(os.path.join(folder, "config.json"))


# ------------------------------------------------------------------------------------------------------ layers


class LayerNorm(nnx.Module):
    """torch's LayerNorm over the last axis with weight and bias, statistics in float32."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = param(jnp.ones((dim,), dtype), ("norm",))
        self.bias = param(jnp.zeros((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Table(nnx.Module):
    """An embedding table [rows, width] named `weight` (torch's nn.Embedding), replicated."""

    def __init__(self, rows: int, width: int, *, dtype):
        self.weight = param(jnp.zeros((rows, width), dtype), ("score", "score"))


class CLIPAttention(nnx.Module):
    def __init__(self, cfg: TowerConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj = Linear(d, d, bias=True, dtype=dtype, rngs=rngs, axes=("score", "score"))
        self.k_proj = Linear(d, d, bias=True, dtype=dtype, rngs=rngs, axes=("score", "score"))
        self.v_proj = Linear(d, d, bias=True, dtype=dtype, rngs=rngs, axes=("score", "score"))
        self.out_proj = Linear(d, d, bias=True, dtype=dtype, rngs=rngs, axes=("score", "score"))

    def __call__(self, x, causal: bool, key_mask):
        b, n, _ = x.shape
        heads = lambda t: t.reshape(b, n, self.num_heads, self.head_dim)  # noqa: E731
        out = attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), causal=causal,
                        key_mask=key_mask, implementation="xla")
        return self.out_proj(out.reshape(b, n, -1))


class CLIPMLP(nnx.Module):
    def __init__(self, cfg: TowerConfig, *, dtype, rngs: nnx.Rngs):
        self.act = cfg.hidden_act
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype, rngs=rngs, axes=("score", "score"))
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype, rngs=rngs, axes=("score", "score"))

    def __call__(self, x):
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    """Pre-LayerNorm block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: TowerConfig, *, dtype, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = CLIPAttention(cfg, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, causal: bool = False, key_mask=None):
        x = x + self.self_attn(self.layer_norm1(x), causal, key_mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nnx.Module):
    def __init__(self, cfg: TowerConfig, *, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([CLIPEncoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])

    def __call__(self, x, causal: bool = False, key_mask=None):
        for layer in self.layers:
            x = layer(x, causal, key_mask)
        return x


# ------------------------------------------------------------------------------------------------------ towers


class CLIPTextEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, *, dtype):
        self.token_embedding = Table(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embedding = Table(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)

    def __call__(self, ids):
        positions = self.position_embedding.weight[...][:ids.shape[1]]
        return jnp.take(self.token_embedding.weight[...], ids, axis=0) + positions[None]


class CLIPTextTransformer(nnx.Module):
    """Token ids [B, L] -> the pooled output [B, hidden]: the final LayerNorm's state at the end-of-text token."""

    def __init__(self, cfg: CLIPTextConfig, *, dtype, rngs: nnx.Rngs):
        self.config = cfg
        self.embeddings = CLIPTextEmbeddings(cfg, dtype=dtype)
        self.encoder = CLIPEncoder(cfg, dtype=dtype, rngs=rngs)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, ids, attention_mask):
        x = self.encoder(self.embeddings(ids), causal=True, key_mask=attention_mask.astype(bool))
        x = self.final_layer_norm(x)
        if self.config.eos_token_id == 2:  # the original configs' eos id: the highest token id is the end of text
            eos = jnp.argmax(ids, axis=-1)
        else:  # the first end-of-text token
            eos = jnp.argmax((ids == self.config.eos_token_id).astype(jnp.int32), axis=-1)
        return jnp.take_along_axis(x, eos[:, None, None], axis=1)[:, 0]


class PatchConv(nnx.Module):
    """The patch embedding: a conv with stride = kernel = patch and no bias, stored [kh, kw, in, out] (torch: [out,
    in, kh, kw])."""

    def __init__(self, cfg: CLIPVisionConfig, *, dtype):
        self.weight = param(jnp.zeros((cfg.patch_size, cfg.patch_size, cfg.num_channels, cfg.hidden_size), dtype),
                            ("conv_height", "conv_width", "conv_in", "conv_out"))


class CLIPVisionEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, *, dtype):
        self.patch_size = cfg.patch_size
        self.class_embedding = param(jnp.zeros((cfg.hidden_size,), dtype), ("score",))
        self.patch_embedding = PatchConv(cfg, dtype=dtype)
        self.position_embedding = Table(cfg.num_patches + 1, cfg.hidden_size, dtype=dtype)

    def __call__(self, pixels):
        """pixels [B, H, W, C] (normalized) -> tokens [B, 1 + patches, hidden]."""
        w = self.patch_embedding.weight[...]
        p = self.patch_size
        patches = jax.lax.conv_general_dilated(pixels.astype(w.dtype), w, window_strides=(p, p), padding="VALID",
                                               dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                               precision=precision_for(w.dtype))
        b = patches.shape[0]
        patches = patches.reshape(b, -1, patches.shape[-1])
        cls = jnp.broadcast_to(self.class_embedding[...].astype(patches.dtype), (b, 1, patches.shape[-1]))
        return jnp.concatenate([cls, patches], axis=1) + self.position_embedding.weight[...][None]


class CLIPVisionTransformer(nnx.Module):
    """Normalized pixels [B, S, S, C] -> the pooled output [B, hidden]: the class token after post_layernorm."""

    def __init__(self, cfg: CLIPVisionConfig, *, dtype, rngs: nnx.Rngs):
        self.embeddings = CLIPVisionEmbeddings(cfg, dtype=dtype)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)  # transformers' spelling
        self.encoder = CLIPEncoder(cfg, dtype=dtype, rngs=rngs)
        self.post_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, pixels):
        x = self.encoder(self.pre_layrnorm(self.embeddings(pixels)))
        return self.post_layernorm(x[:, 0])


class CLIPModel(nnx.Module):
    """Both towers, their bias-free projections to `projection_dim`, and the learned `logit_scale` (log of the
    temperature's inverse)."""

    def __init__(self, cfg: CLIPConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.text_model = CLIPTextTransformer(cfg.text, dtype=dtype, rngs=rngs)
        self.vision_model = CLIPVisionTransformer(cfg.vision, dtype=dtype, rngs=rngs)
        self.text_projection = Linear(cfg.text.hidden_size, cfg.projection_dim, bias=False, dtype=dtype, rngs=rngs,
                                      axes=("score", "score"))
        self.visual_projection = Linear(cfg.vision.hidden_size, cfg.projection_dim, bias=False, dtype=dtype,
                                        rngs=rngs, axes=("score", "score"))
        self.logit_scale = param(jnp.zeros((), jnp.float32), ())

    def text_embeds(self, ids, attention_mask):
        """Projected text embeddings [B, projection_dim] (not normalized), float32."""
        return self.text_projection(self.text_model(ids, attention_mask)).astype(jnp.float32)

    def image_embeds(self, pixels):
        """Projected image embeddings [B, projection_dim] (not normalized) of normalized pixels, float32."""
        return self.visual_projection(self.vision_model(pixels)).astype(jnp.float32)


def unit(x):
    """Rows scaled to unit L2 norm (float32), as CLIP normalizes its embeddings."""
    x = x.astype(jnp.float32)
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)
