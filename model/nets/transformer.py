"""Flux2 MMDiT (diffusers' Flux2Transformer2DModel) in Flax NNX.

Inputs per call: image tokens [B, N, in_channels], text embeddings [B, T, joint_attention_dim], the timestep as
sigma (= t / 1000) [B], and RoPE cos/sin tables [T + N, head_dim] for the [text ; image] sequence (see
`rope_tables`). Output: the flow velocity [B, N, out_channels]. With reference images (editing) the image tokens are
[target ; references] and `target_tokens` keeps the output to the target's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import heads_kernel
from .attention import attention, attention_heads, traced_devices, traced_forms, traced_platform
from ..config.configs import TransformerConfig
from .layers import Linear, RMSNorm, layer_norm, precision_for, round_to_dtype, traced_once_per_structure
from .quantize import Int8Linear
from ..parallel.shard_order import join_parts, split_parts

# ----------------------------------------------------------------------------------------------- positions / RoPE


def text_ids(length: int) -> np.ndarray:
    """(T, H, W, L) position ids of text tokens: (0, 0, 0, l)."""
    ids = np.zeros((length, 4), dtype=np.int64)
    ids[:, 3] = np.arange(length)
    return ids


def image_ids(grid_h: int, grid_w: int) -> np.ndarray:
    """(T, H, W, L) position ids of image tokens in row-major order: (0, i, j, 0)."""
    ii, jj = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    ids = np.zeros((grid_h * grid_w, 4), dtype=np.int64)
    ids[:, 1] = ii.reshape(-1)
    ids[:, 2] = jj.reshape(-1)
    return ids


def reference_ids(grids) -> np.ndarray:
    """(T, H, W, L) position ids of reference images' tokens, image k at time 10 + 10 * k with its own row-major
    (i, j) from 0 (diffusers' _prepare_image_ids, scale 10); [sum(h * w), 4], empty for no references."""
    parts = []
    for k, (grid_h, grid_w) in enumerate(grids):
        ids = image_ids(grid_h, grid_w)
        ids[:, 0] = 10 + 10 * k
        parts.append(ids)
    return np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)


def rope_tables(ids: np.ndarray, axes_dims, theta: float):
    """Interleaved (pairwise) RoPE cos/sin [S, sum(axes_dims)] as float32, angles computed in float64."""
    pos = ids.astype(np.float32).astype(np.float64)
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64)[: dim // 2] / dim))
        angles = np.outer(pos[:, axis], freqs)
        cos_parts.append(np.repeat(np.cos(angles), 2, axis=1))
        sin_parts.append(np.repeat(np.sin(angles), 2, axis=1))
    return (np.concatenate(cos_parts, axis=1).astype(np.float32),
            np.concatenate(sin_parts, axis=1).astype(np.float32))


def apply_interleaved_rope(x, cos, sin):
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [B, S, H, D] by cos/sin [S, D]: x * cos + [-x[2i+1], x[2i]] * sin
    in float32, x's dtype out, the pair swap in the traced-for platform's form (model.nets.platform_forms)."""
    partner = _rope_partner(x, traced_forms().rope)
    return (x.astype(jnp.float32) * cos[None, :, None, :] + partner * sin[None, :, None, :]).astype(x.dtype)


def _rope_partner(x, form: str):
    """[-x[2i+1], x[2i]] for each pair of the last axis, float32, in one of model.nets.platform_forms.ROPE_FORMS (the
    same bits either way): `pairs` splits the lanes into pairs (a trailing axis of 2); `matmul` multiplies by the
    signed pair-swap matrix on the MXU (each output is one input times +-1: exact, in bf16 passes too, since bf16
    inputs are exact in them and float32 ones trace at the highest precision)."""
    x32 = x.astype(jnp.float32)
    d = x.shape[-1]
    if form == "pairs":
        pairs = x32.reshape(*x.shape[:-1], -1, 2)
        return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    if form != "matmul":
        raise ValueError(f"unknown RoPE form {form!r}")
    swap = np.zeros((d, d), np.float32)
    swap[np.arange(1, d, 2), np.arange(0, d, 2)] = -1.0  # out[2i] = -x[2i+1]
    swap[np.arange(0, d, 2), np.arange(1, d, 2)] = 1.0   # out[2i+1] = x[2i]
    return jnp.einsum("...d,de->...e", x, jnp.asarray(swap, x.dtype), preferred_element_type=jnp.float32,
                      precision=precision_for(x.dtype))


def heads_kernel_mode(implementation: str, head_dim: int, *lengths: int):
    """Whether attention's q, k, v go through `model.nets.heads_kernel` for sequences of these lengths (zero lengths
    ignored) in the program being traced: False, "compiled" or "interpret"."""
    return heads_kernel.applies(implementation, traced_devices(), traced_forms().heads_kernel, traced_platform(),
                                head_dim, *(n for n in lengths if n))


def timestep_from_sigma(sigma, dtype):
    """t = sigma * 1000 as diffusers' model computes it (`sigma.to(dtype) * 1000`), float32: rounded to the model's
    dtype before and after the product, explicitly, since XLA may skip bfloat16 roundings and a 1-unit change of t
    turns the fastest sinusoid by 1 rad."""
    return round_to_dtype(round_to_dtype(sigma, dtype) * 1000, dtype)


def timestep_sinusoid(t, dim: int):
    """[cos | sin] sinusoidal embedding of t [B] (flip_sin_to_cos, no frequency shift), float32; an odd `dim` ends
    with a zero channel, as diffusers pads it."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = t.astype(jnp.float32)[:, None] * freqs[None, :]
    parts = [jnp.cos(angles), jnp.sin(angles)]
    if dim % 2:
        parts.append(jnp.zeros_like(angles[:, :1]))
    return jnp.concatenate(parts, axis=-1)


# ----------------------------------------------------------------------------------------------- modules


class TimestepEmbedding(nnx.Module):
    def __init__(self, in_channels: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.linear_1 = Linear(in_channels, dim, bias=False, dtype=dtype, rngs=rngs, axes=("timestep", "embed"))
        self.linear_2 = Linear(dim, dim, bias=False, dtype=dtype, rngs=rngs, axes=("embed", "embed"))

    def __call__(self, x):
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class TimestepGuidanceEmbeddings(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.channels = cfg.timestep_guidance_channels
        self.timestep_embedder = TimestepEmbedding(self.channels, cfg.inner_dim, dtype=dtype, rngs=rngs)
        self.guidance_embedder = (TimestepEmbedding(self.channels, cfg.inner_dim, dtype=dtype, rngs=rngs)
                                  if cfg.guidance_embeds else None)

    def __call__(self, timestep, guidance, dtype):
        emb = self.timestep_embedder(timestep_sinusoid(timestep, self.channels).astype(dtype))
        if guidance is not None and self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(timestep_sinusoid(guidance, self.channels).astype(dtype))
        return emb


class Modulation(nnx.Module):
    """SiLU -> Linear(D -> 3 * sets * D), split into `sets` (shift, scale, gate) triples of [B, 1, D]."""

    def __init__(self, dim: int, sets: int, *, dtype, rngs: nnx.Rngs):
        self.sets = sets
        self.linear = Linear(dim, dim * 3 * sets, bias=False, dtype=dtype, rngs=rngs, axes=("embed", "modulation"))

    def __call__(self, temb):
        mod = self.linear(jax.nn.silu(temb))[:, None, :]
        chunks = jnp.split(mod, 3 * self.sets, axis=-1)
        return tuple(tuple(chunks[3 * i: 3 * i + 3]) for i in range(self.sets))


class FeedForward(nnx.Module):
    """SwiGLU MLP: linear_in (D -> 2M), SiLU(first half) * second half, linear_out (M -> D).

    `order_shards` > 1: linear_in's columns are laid out shard-major (model.parallel.shard_order), so each of that many
    chips holds matching slices of both halves."""

    def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs, linear=Linear):
        self.hidden = hidden
        self.order_shards = 1
        self.linear_in = linear(dim, 2 * hidden, bias=False, dtype=dtype, rngs=rngs, axes=("embed", "mlp"))
        self.linear_out = linear(hidden, dim, bias=False, dtype=dtype, rngs=rngs, axes=("mlp", "embed"))

    def fused_parts(self):
        """The fused projection whose output parts model.parallel.shard_order lays out per shard."""
        return [("linear_in", 1, (self.hidden, self.hidden))]

    def __call__(self, x):
        a, b = split_parts(self.linear_in(x), (self.hidden, self.hidden), self.order_shards)
        return self.linear_out(jax.nn.silu(a) * b)


class JointAttention(nnx.Module):
    """Double-stream attention: separate q/k/v for image and text, one attention over [text ; image]."""

    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs, linear=Linear):
        d, hd = cfg.inner_dim, cfg.attention_head_dim
        self.heads, self.head_dim = cfg.num_attention_heads, hd
        fan_out, fan_in = ("embed", "heads"), ("heads", "embed")  # logical axes (model.parallel.sharding)
        self.to_q = linear(d, d, bias=False, dtype=dtype, rngs=rngs, axes=fan_out)
        self.to_k = linear(d, d, bias=False, dtype=dtype, rngs=rngs, axes=fan_out)
        self.to_v = linear(d, d, bias=False, dtype=dtype, rngs=rngs, axes=fan_out)
        self.norm_q = RMSNorm(hd, eps=cfg.eps, dtype=dtype)
        self.norm_k = RMSNorm(hd, eps=cfg.eps, dtype=dtype)
        self.to_out = nnx.List([linear(d, d, bias=False, dtype=dtype, rngs=rngs, axes=fan_in)])
        self.add_q_proj = linear(d, d, bias=False, dtype=dtype, rngs=rngs, axes=fan_out)
        self.add_k_proj = linear(d, d, bias=False, dtype=dtype, rngs=rngs, axes=fan_out)
        self.add_v_proj = linear(d, d, bias=False, dtype=dtype, rngs=rngs, axes=fan_out)
        self.norm_added_q = RMSNorm(hd, eps=cfg.eps, dtype=dtype)
        self.norm_added_k = RMSNorm(hd, eps=cfg.eps, dtype=dtype)
        self.to_add_out = linear(d, d, bias=False, dtype=dtype, rngs=rngs, axes=fan_in)

    def _heads(self, x):
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)

    def __call__(self, img, txt, cos, sin, implementation):
        t = txt.shape[1]
        mode = heads_kernel_mode(implementation, self.head_dim, t, img.shape[1])
        if mode:
            return self._with_heads_kernel(img, txt, cos, sin, mode == "interpret")
        q = jnp.concatenate([self.norm_added_q(self._heads(self.add_q_proj(txt))),
                             self.norm_q(self._heads(self.to_q(img)))], axis=1)
        k = jnp.concatenate([self.norm_added_k(self._heads(self.add_k_proj(txt))),
                             self.norm_k(self._heads(self.to_k(img)))], axis=1)
        v = jnp.concatenate([self._heads(self.add_v_proj(txt)), self._heads(self.to_v(img))], axis=1)
        q = apply_interleaved_rope(q, cos, sin)
        k = apply_interleaved_rope(k, cos, sin)
        out = attention(q, k, v, implementation=implementation)
        out = out.reshape(*out.shape[:2], -1)
        return self.to_out[0](out[:, t:]), self.to_add_out(out[:, :t])

    def _with_heads_kernel(self, img, txt, cos, sin, interpret: bool):
        """The same attention with q, k, v laid out head-major by `model.nets.heads_kernel` (normed, rotated,
        scaled)."""
        t, heads, hd = txt.shape[1], self.heads, self.head_dim
        rope_txt, rope_img = dict(cos=cos[:t], sin=sin[:t]), dict(cos=cos[t:], sin=sin[t:])

        def both(txt_proj, img_proj, txt_norm=None, img_norm=None, **extra):
            parts = []
            for proj, x, norm, rope in ((txt_proj, txt, txt_norm, rope_txt), (img_proj, img, img_norm, rope_img)):
                kw = dict(weight=norm.weight[...], eps=norm.eps, **rope, **extra) if norm is not None else {}
                parts.append(heads_kernel.head_major(proj(x), 0, heads, hd, interpret=interpret, **kw))
            return jnp.concatenate(parts, axis=2)

        q = both(self.add_q_proj, self.to_q, self.norm_added_q, self.norm_q, scale=1.0 / math.sqrt(hd))
        k = both(self.add_k_proj, self.to_k, self.norm_added_k, self.norm_k)
        v = both(self.add_v_proj, self.to_v)
        out = attention_heads(q, k, v)
        out = out.reshape(*out.shape[:2], -1)
        return self.to_out[0](out[:, t:]), self.to_add_out(out[:, :t])


class DoubleStreamBlock(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs, linear=Linear):
        self.eps = cfg.eps
        self.attn = JointAttention(cfg, dtype=dtype, rngs=rngs, linear=linear)
        self.ff = FeedForward(cfg.inner_dim, cfg.mlp_hidden_dim, dtype=dtype, rngs=rngs, linear=linear)
        self.ff_context = FeedForward(cfg.inner_dim, cfg.mlp_hidden_dim, dtype=dtype, rngs=rngs, linear=linear)

    def __call__(self, img, txt, mod_img, mod_txt, cos, sin, implementation):
        (shift, scale, gate), (shift2, scale2, gate2) = mod_img
        (cshift, cscale, cgate), (cshift2, cscale2, cgate2) = mod_txt
        img_attn, txt_attn = self.attn(layer_norm(img, self.eps) * (1 + scale) + shift,
                                       layer_norm(txt, self.eps) * (1 + cscale) + cshift, cos, sin, implementation)
        img = img + gate * img_attn
        img = img + gate2 * self.ff(layer_norm(img, self.eps) * (1 + scale2) + shift2)
        txt = txt + cgate * txt_attn
        txt = txt + cgate2 * self.ff_context(layer_norm(txt, self.eps) * (1 + cscale2) + cshift2)
        return img, txt


class ParallelSelfAttention(nnx.Module):
    """Single-stream block core: one fused projection to [q | k | v | mlp_a | mlp_b], one output projection of
    [attention | mlp]. `order_shards` > 1: both are laid out shard-major (model.parallel.shard_order), so each of that
    many chips holds its heads' q, k, v, its MLP columns and the matching rows of the output projection."""

    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs, linear=Linear):
        d, m, hd = cfg.inner_dim, cfg.mlp_hidden_dim, cfg.attention_head_dim
        self.heads, self.head_dim, self.inner_dim, self.mlp_dim = cfg.num_attention_heads, hd, d, m
        self.order_shards = 1
        self.to_qkv_mlp_proj = linear(d, 3 * d + 2 * m, bias=False, dtype=dtype, rngs=rngs, axes=("embed", "heads_mlp"))
        self.norm_q = RMSNorm(hd, eps=cfg.eps, dtype=dtype)
        self.norm_k = RMSNorm(hd, eps=cfg.eps, dtype=dtype)
        self.to_out = linear(d + m, d, bias=False, dtype=dtype, rngs=rngs, axes=("heads_mlp", "embed"))

    def fused_parts(self):
        """The projections whose parts model.parallel.shard_order lays out per shard: columns in, rows out."""
        d, m = self.inner_dim, self.mlp_dim
        return [("to_qkv_mlp_proj", 1, (d, d, d, m, m)), ("to_out", 0, (d, m))]

    def __call__(self, x, cos, sin, implementation, queries_from: int = 0):
        """Outputs for the tokens x[:, queries_from:]; keys and values still come from every token. The last block
        passes the text length, since only the image tokens' outputs are used after it."""
        d, m, shards = self.inner_dim, self.mlp_dim, self.order_shards
        fused = self.to_qkv_mlp_proj(x[:, queries_from:])
        lengths = (x.shape[1] - queries_from, queries_from)
        mode = heads_kernel_mode(implementation, self.head_dim, *lengths) if shards == 1 else False
        if mode:
            return self._with_heads_kernel(x, fused, cos, sin, queries_from, mode == "interpret")
        q, k, v, a, b = split_parts(fused, (d, d, d, m, m), shards)
        if queries_from:  # keys and values of the tokens without outputs: only those columns of the projection
            kv = self.to_qkv_mlp_proj.columns(x[:, :queries_from], lambda a: a.reshape(
                *a.shape[:-1], shards, -1)[..., d // shards:3 * d // shards].reshape(*a.shape[:-1], 2 * d))
            k_text, v_text = split_parts(kv, (d, d), shards)
            k = jnp.concatenate([k_text, k], axis=1)
            v = jnp.concatenate([v_text, v], axis=1)
        heads = (self.heads, self.head_dim)
        q = apply_interleaved_rope(self.norm_q(q.reshape(*q.shape[:2], *heads)), cos[queries_from:],
                                   sin[queries_from:])
        k = apply_interleaved_rope(self.norm_k(k.reshape(*x.shape[:2], *heads)), cos, sin)
        out = attention(q, k, v.reshape(*x.shape[:2], *heads), implementation=implementation)
        return self.to_out(join_parts([out.reshape(*q.shape[:2], d), jax.nn.silu(a) * b], shards))

    def _with_heads_kernel(self, x, fused, cos, sin, queries_from: int, interpret: bool):
        """The same block (one layout shard) with q, k, v read head-major from the fused projection's output by
        `model.nets.heads_kernel` (normed, rotated, scaled), so no slice of it is copied on the way to attention."""
        d, m, heads, hd = self.inner_dim, self.mlp_dim, self.heads, self.head_dim
        kw = dict(interpret=interpret)
        norm_q = dict(weight=self.norm_q.weight[...], eps=self.norm_q.eps)
        norm_k = dict(weight=self.norm_k.weight[...], eps=self.norm_k.eps)
        rope = dict(cos=cos[queries_from:], sin=sin[queries_from:])
        q = heads_kernel.head_major(fused, 0, heads, hd, scale=1.0 / math.sqrt(hd), **norm_q, **rope, **kw)
        k = heads_kernel.head_major(fused, d, heads, hd, **norm_k, **rope, **kw)
        v = heads_kernel.head_major(fused, 2 * d, heads, hd, **kw)
        if queries_from:  # keys and values of the tokens without outputs: only those columns of the projection
            kv = self.to_qkv_mlp_proj.columns(x[:, :queries_from], lambda a: a[..., d:3 * d])
            rope_text = dict(cos=cos[:queries_from], sin=sin[:queries_from])
            k = jnp.concatenate([heads_kernel.head_major(kv, 0, heads, hd, **norm_k, **rope_text, **kw), k], axis=2)
            v = jnp.concatenate([heads_kernel.head_major(kv, d, heads, hd, **kw), v], axis=2)
        out = attention_heads(q, k, v)
        a, b = fused[..., 3 * d:3 * d + m], fused[..., 3 * d + m:]
        return self.to_out(jnp.concatenate([out.reshape(*out.shape[:2], d), jax.nn.silu(a) * b], axis=-1))


class SingleStreamBlock(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs, linear=Linear):
        self.eps = cfg.eps
        self.attn = ParallelSelfAttention(cfg, dtype=dtype, rngs=rngs, linear=linear)

    def __call__(self, x, mod, cos, sin, implementation, queries_from: int = 0):
        ((shift, scale, gate),) = mod
        out = self.attn(layer_norm(x, self.eps) * (1 + scale) + shift, cos, sin, implementation, queries_from)
        return x[:, queries_from:] + gate * out


class AdaLayerNormOut(nnx.Module):
    """Final norm: LayerNorm(x) * (1 + scale) + shift with [scale | shift] = Linear(SiLU(temb))."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.linear = Linear(dim, 2 * dim, bias=False, dtype=dtype, rngs=rngs, axes=("embed", "modulation"))

    def __call__(self, x, temb):
        scale, shift = jnp.split(self.linear(jax.nn.silu(temb)), 2, axis=-1)
        return layer_norm(x, self.eps) * (1 + scale[:, None, :]) + shift[:, None, :]


class Flux2Transformer(nnx.Module):
    """`quantize`: "int8" makes the blocks' attention and MLP projections int8 layers (model.nets.quantize); the
    embedders, modulation and output projection stay in `dtype`."""

    def __init__(self, cfg: TransformerConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, quantize: str = "none"):
        self.config = cfg
        d = cfg.inner_dim
        linear = Int8Linear if quantize == "int8" else Linear
        self.time_guidance_embed = TimestepGuidanceEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.double_stream_modulation_img = Modulation(d, 2, dtype=dtype, rngs=rngs)
        self.double_stream_modulation_txt = Modulation(d, 2, dtype=dtype, rngs=rngs)
        self.single_stream_modulation = Modulation(d, 1, dtype=dtype, rngs=rngs)
        self.x_embedder = Linear(cfg.in_channels, d, bias=False, dtype=dtype, rngs=rngs, axes=("latent", "embed"))
        self.context_embedder = Linear(cfg.joint_attention_dim, d, bias=False, dtype=dtype, rngs=rngs,
                                       axes=("text_embed", "embed"))
        self.transformer_blocks = nnx.List([DoubleStreamBlock(cfg, dtype=dtype, rngs=rngs, linear=linear)
                                            for _ in range(cfg.num_layers)])
        self.single_transformer_blocks = nnx.List([SingleStreamBlock(cfg, dtype=dtype, rngs=rngs, linear=linear)
                                                   for _ in range(cfg.num_single_layers)])
        self.norm_out = AdaLayerNormOut(d, cfg.eps, dtype=dtype, rngs=rngs)
        self.proj_out = Linear(d, cfg.patch_size ** 2 * cfg.out_channels, bias=False, dtype=dtype, rngs=rngs,
                               axes=("embed", "latent"))

    def __call__(self, hidden_states, encoder_hidden_states, timestep, cos, sin, guidance=None, *,
                 implementation: str = "xla", target_tokens: int | None = None):
        """Velocity for the image tokens. The last single-stream block computes outputs for the image tokens only
        (diffusers computes the text tokens' too, and discards them); identical blocks are traced once
        (model.nets.layers.traced_once_per_structure). `target_tokens`: only the first that many image tokens' velocity
        (the target's, before the references')."""
        dtype = self.x_embedder.weight.dtype
        timestep = timestep_from_sigma(timestep, dtype)
        if guidance is not None:
            guidance = timestep_from_sigma(guidance, dtype)
        temb = self.time_guidance_embed(timestep, guidance, dtype)
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)

        img = self.x_embedder(hidden_states)
        txt = self.context_embedder(encoder_hidden_states)
        call = traced_once_per_structure()
        for block in self.transformer_blocks:
            img, txt = call(block, img, txt, mod_img, mod_txt, cos, sin, implementation=implementation)
        num_txt = txt.shape[1]
        x = jnp.concatenate([txt, img], axis=1)
        last = len(self.single_transformer_blocks) - 1
        for i, block in enumerate(self.single_transformer_blocks):
            x = call(block, x, mod_single, cos, sin, implementation=implementation,
                     queries_from=num_txt if i == last else 0)
        start = x.shape[1] - img.shape[1]
        x = x[:, start:start + (img.shape[1] if target_tokens is None else target_tokens)]
        x = self.norm_out(x, temb)
        return self.proj_out(x)
