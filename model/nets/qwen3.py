"""Qwen3 text encoder (decoder-only) in Flax NNX, run only up to the deepest hidden state FLUX.2 needs.

Hidden state k follows transformers' convention: 0 is the embedding output, k in 1..N-1 the raw residual stream
after decoder layer k-1, and N (the last layer) the stream after the final RMSNorm. Layers past the deepest
requested state are never built or run; no LM head exists here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .attention import attention
from ..config.configs import TextEncoderConfig
from .layers import ACTIVATIONS, Embed, Linear, RMSNorm, traced_once_per_structure
from .quantize import Int8Linear


def rope_tables(positions: np.ndarray, head_dim: int, theta: float):
    """Llama/Qwen (rotate-half) RoPE cos/sin of shape [L, head_dim] as float32."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    freqs = np.outer(positions.astype(np.float32), inv_freq).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rotate_half(x, cos, sin):
    """x [B, L, H, D] rotated by cos/sin [L, D] in the rotate-half convention, result cast to x's dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[None, :, None, :].astype(x.dtype)
    sin = sin[None, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def sliding_window_mask(length: int, window: int) -> np.ndarray:
    """[1, 1, L, L] booleans: query i may see key j when i - j < window (transformers' sliding-window overlay; the
    causal and padding masks are added by `attention`)."""
    pos = np.arange(length)
    return (pos[:, None] - pos[None, :] < window)[None, None]


class Qwen3Attention(nnx.Module):
    def __init__(self, cfg: TextEncoderConfig, *, dtype, rngs: nnx.Rngs, sliding_window: int | None = None,
                 linear=Linear):
        self.sliding_window = sliding_window
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = linear(cfg.hidden_size, q_dim, bias=bias, dtype=dtype, rngs=rngs, axes=("embed", "heads"))
        self.k_proj = linear(cfg.hidden_size, kv_dim, bias=bias, dtype=dtype, rngs=rngs, axes=("embed", "kv_heads"))
        self.v_proj = linear(cfg.hidden_size, kv_dim, bias=bias, dtype=dtype, rngs=rngs, axes=("embed", "kv_heads"))
        self.o_proj = linear(q_dim, cfg.hidden_size, bias=bias, dtype=dtype, rngs=rngs, axes=("heads", "embed"))
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, cos, sin, key_mask, implementation):
        """Causal self-attention; `key_mask` [B, L] marks the real (non-padding) tokens."""
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, length, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, length, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, length, self.num_kv_heads, self.head_dim)
        q = apply_rotate_half(q, cos, sin)
        k = apply_rotate_half(k, cos, sin)
        window = self.sliding_window
        mask = jnp.asarray(sliding_window_mask(length, window)) if window is not None and window < length else None
        out = attention(q, k, v, mask=mask, causal=True, key_mask=key_mask, implementation=implementation)
        return self.o_proj(out.reshape(b, length, self.num_heads * self.head_dim))


class Qwen3MLP(nnx.Module):
    def __init__(self, cfg: TextEncoderConfig, *, dtype, rngs: nnx.Rngs, linear=Linear):
        self.act = cfg.hidden_act
        hidden, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear(hidden, inner, bias=False, dtype=dtype, rngs=rngs, axes=("embed", "mlp"))
        self.up_proj = linear(hidden, inner, bias=False, dtype=dtype, rngs=rngs, axes=("embed", "mlp"))
        self.down_proj = linear(inner, hidden, bias=False, dtype=dtype, rngs=rngs, axes=("mlp", "embed"))

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextEncoderConfig, *, dtype, rngs: nnx.Rngs, sliding_window: int | None = None,
                 linear=Linear):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Qwen3Attention(cfg, dtype=dtype, rngs=rngs, sliding_window=sliding_window, linear=linear)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = Qwen3MLP(cfg, dtype=dtype, rngs=rngs, linear=linear)

    def __call__(self, x, cos, sin, key_mask, implementation):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_mask, implementation)
        return x + self.mlp(self.post_attention_layernorm(x))


def normalize_out_layers(cfg: TextEncoderConfig, out_layers) -> tuple[int, ...]:
    """Hidden-state indices in 0..N; negative ones count from the end as diffusers' `hidden_states[k]` does (-1 is N,
    the normed last state)."""
    n = cfg.num_hidden_layers
    out = tuple(int(k) for k in out_layers)
    if not out:
        raise ValueError("text_encoder_out_layers must name at least one hidden state")
    for k in out:
        if not -(n + 1) <= k <= n:
            raise ValueError(f"text encoder hidden state {k} does not exist: the checkpoint's Qwen3 has {n} layers, so "
                             f"valid indices are 0..{n} (or -{n + 1}..-1 from the end)")
    return tuple(k % (n + 1) for k in out)


def layers_to_run(cfg: TextEncoderConfig, out_layers) -> tuple[int, bool]:
    """(number of decoder layers to run, whether the final norm is needed) for the requested hidden states."""
    out_layers = normalize_out_layers(cfg, out_layers)
    deepest = max(out_layers)
    return deepest, deepest == cfg.num_hidden_layers


class Qwen3Body(nnx.Module):
    """`model.*` of Qwen3ForCausalLM, truncated to `num_layers` decoder layers (plus the final norm if needed)."""

    def __init__(self, cfg: TextEncoderConfig, num_layers: int, with_final_norm: bool, *, dtype, rngs: nnx.Rngs,
                 linear=Linear):
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Qwen3DecoderLayer(cfg, dtype=dtype, rngs=rngs, sliding_window=cfg.window_of(i),
                                                  linear=linear)
                                for i in range(num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype) if with_final_norm else None


class Qwen3TextEncoder(nnx.Module):
    """Returns the requested hidden states stacked per token as [B, L, len(out_layers) * hidden]."""

    def __init__(self, cfg: TextEncoderConfig, out_layers=(9, 18, 27), *, full_depth: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs, quantize: str = "none"):
        """`quantize`: "int8" makes the decoder layers' projections int8 layers (model.nets.quantize)."""
        self.config = cfg
        self.out_layers = normalize_out_layers(cfg, out_layers)
        num_layers, with_norm = layers_to_run(cfg, self.out_layers)
        if full_depth:  # the whole stack, as transformers has it (every tensor of the checkpoint)
            num_layers, with_norm = cfg.num_hidden_layers, True
        self.model = Qwen3Body(cfg, num_layers, with_norm, dtype=dtype, rngs=rngs,
                               linear=Int8Linear if quantize == "int8" else Linear)

    def __call__(self, input_ids, attention_mask, *, implementation: str = "xla"):
        """Identical layers are traced once (model.nets.layers.traced_once_per_structure), and the RoPE tables are one
        constant each (as numpy arrays every layer's q and k would embed their own copy: 108 constants, 28.7 MB of
        klein-4B's lowered encode program)."""
        cfg = self.config
        length = input_ids.shape[1]
        cos, sin = (jnp.asarray(t) for t in rope_tables(np.arange(length), cfg.head_dim, cfg.rope_theta))
        key_mask = attention_mask.astype(bool)  # causal and key-padding masks, applied by `attention`
        x = self.model.embed_tokens(input_ids)
        states = [x]
        call = traced_once_per_structure()
        for i, layer in enumerate(self.model.layers):
            x = call(layer, x, cos, sin, key_mask, implementation=implementation)
            if i + 1 == cfg.num_hidden_layers:
                x = self.model.norm(x)  # transformers' last hidden state is the normed one
            states.append(x)
        picked = [states[k] for k in self.out_layers]
        return jnp.concatenate(picked, axis=-1)
