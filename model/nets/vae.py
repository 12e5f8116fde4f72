"""Flux2 VAE decoder (diffusers' AutoencoderKLFlux2 decode path) in Flax NNX, NHWC internally.

`decode_latents` turns the transformer's packed tokens into pixels: batch-norm de-normalisation with the VAE's
running statistics, 2x2 unpatchify, post-quant conv, decoder. The encoder is not needed for text-to-image; reference
images (image-conditioned generation) go through `Flux2VAEEncoder`, loaded separately on first use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .attention import traced_forms
from ..config.configs import VAEConfig
from .layers import Conv2d, GroupNorm, Linear, precision_for
from .platform_forms import UPSAMPLE_FORMS
from ..parallel.sharding import param

RESNET_EPS = 1e-6


class ResnetBlock(nnx.Module):
    def __init__(self, in_ch: int, out_ch: int, groups: int, *, dtype, rngs: nnx.Rngs):
        self.norm1 = GroupNorm(groups, in_ch, eps=RESNET_EPS, dtype=dtype)
        self.conv1 = Conv2d(in_ch, out_ch, 3, padding=1, dtype=dtype, rngs=rngs)
        self.norm2 = GroupNorm(groups, out_ch, eps=RESNET_EPS, dtype=dtype)
        self.conv2 = Conv2d(out_ch, out_ch, 3, padding=1, dtype=dtype, rngs=rngs)
        self.conv_shortcut = Conv2d(in_ch, out_ch, 1, padding=0, dtype=dtype, rngs=rngs) if in_ch != out_ch else None

    def __call__(self, x, one_pass_norm: bool = False):
        h = self.conv1(jax.nn.silu(self.norm1(x, one_pass_norm)))
        h = self.conv2(jax.nn.silu(self.norm2(h, one_pass_norm)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + h


class SpatialAttention(nnx.Module):
    """Single-head self-attention over all h*w positions, with a residual connection."""

    def __init__(self, ch: int, groups: int, *, dtype, rngs: nnx.Rngs):
        self.group_norm = GroupNorm(groups, ch, eps=RESNET_EPS, dtype=dtype)
        axes = ("channels", "channels")  # small: replicated on every device (model.parallel.sharding)
        self.to_q = Linear(ch, ch, bias=True, dtype=dtype, rngs=rngs, axes=axes)
        self.to_k = Linear(ch, ch, bias=True, dtype=dtype, rngs=rngs, axes=axes)
        self.to_v = Linear(ch, ch, bias=True, dtype=dtype, rngs=rngs, axes=axes)
        self.to_out = nnx.List([Linear(ch, ch, bias=True, dtype=dtype, rngs=rngs, axes=axes)])

    def __call__(self, x, one_pass_norm: bool = False):
        b, h, w, c = x.shape
        t = self.group_norm(x, one_pass_norm).reshape(b, h * w, c)
        q, k, v = self.to_q(t), self.to_k(t), self.to_v(t)
        precision = precision_for(q.dtype)
        logits = jnp.einsum("bqc,bkc->bqk", q, k, preferred_element_type=jnp.float32,
                            precision=precision) / jnp.sqrt(jnp.float32(c))
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = self.to_out[0](jnp.einsum("bqk,bkc->bqc", probs, v, precision=precision))
        return x + out.reshape(b, h, w, c)


class MidBlock(nnx.Module):
    def __init__(self, ch: int, groups: int, add_attention: bool, *, dtype, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock(ch, ch, groups, dtype=dtype, rngs=rngs) for _ in range(2)])
        self.attentions = nnx.List([SpatialAttention(ch, groups, dtype=dtype, rngs=rngs)]) if add_attention else None

    def __call__(self, x, one_pass_norm: bool = False):
        x = self.resnets[0](x, one_pass_norm)
        if self.attentions is not None:
            x = self.attentions[0](x, one_pass_norm)
        return self.resnets[1](x, one_pass_norm)


# Nearest x2 then a 3x3 conv, seen from the low resolution: output row 2i+a reads input rows (i-1, i) with kernel rows
# (0 | 1+2) when a = 0, and (i, i+1) with (0+1 | 2) when a = 1; columns likewise. _PHASE_TAPS[a, tap, kernel row].
_PHASE_TAPS = np.array([[[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]], np.float32)
# The same map as a transposed convolution: the input dilated by 2 (zeros between pixels) under a 4x4 kernel whose
# rows are kernel rows (0, 0+1, 1+2, 2) (a zero-dilated row meets exactly the kernel rows its nearest copies met).
_DILATED_TAPS = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1], [0, 0, 1]], np.float32)


class Upsample(nnx.Module):
    """Nearest-neighbour x2 then a 3x3 conv (diffusers' order), without the upsampled copy and with 4/9 of its
    multiply-adds (the kernel's taps summed in float32 first), in one of model.nets.platform_forms.UPSAMPLE_FORMS:
    - "phases": one 2x2 conv at the low resolution with the four output phases as channels, then interleaved (the
      fastest on CPU);
    - "dilated": one transposed conv, a 4x4 kernel over the zero-dilated input, which XLA's TPU convolution runs
      without touching the zeros and writes straight into the next conv's layout (no interleave)."""

    def __init__(self, ch: int, *, dtype, rngs: nnx.Rngs):
        self.conv = Conv2d(ch, ch, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x, form: str):
        if form not in UPSAMPLE_FORMS:
            raise ValueError(f"unknown upsample form {form!r}; choose one of {UPSAMPLE_FORMS}")
        b, h, w, c = x.shape
        weight = self.conv.weight[...]
        co = weight.shape[-1]
        precision = precision_for(weight.dtype)
        numbers = ("NHWC", "HWIO", "NHWC")
        if form == "dilated":
            kernel = jnp.einsum("rm,sn,mnio->rsio", _DILATED_TAPS, _DILATED_TAPS, weight.astype(jnp.float32),
                                precision=jax.lax.Precision.HIGHEST).astype(weight.dtype)
            y = jax.lax.conv_general_dilated(x.astype(weight.dtype), kernel, (1, 1), ((2, 2), (2, 2)),
                                             lhs_dilation=(2, 2), dimension_numbers=numbers, precision=precision)
            return y + self.conv.bias[...]
        # kernel[r, s, i, (a, b, o)]: phase (a, b)'s 2x2 kernel, its taps summed in float32
        kernel = jnp.einsum("arm,bsn,mnio->rsiabo", _PHASE_TAPS, _PHASE_TAPS, weight.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST).reshape(2, 2, c, 4 * co).astype(weight.dtype)
        xp = jnp.pad(x.astype(weight.dtype), ((0, 0), (1, 1), (1, 1), (0, 0)))
        y = jax.lax.conv_general_dilated(xp, kernel, (1, 1), "VALID", dimension_numbers=numbers, precision=precision)
        y = y.reshape(b, h + 1, w + 1, 2, 2, co)  # phase (a, b) of output pixel (i, j) sits at y[i + a, j + b, a, b]
        rows = [jnp.stack([y[:, a:a + h, bb:bb + w, a, bb] for bb in range(2)], axis=3) for a in range(2)]
        return jnp.stack(rows, axis=2).reshape(b, 2 * h, 2 * w, co) + self.conv.bias[...]


def _resnets(in_ch: int, out_ch: int, count: int, groups: int, *, dtype, rngs: nnx.Rngs) -> nnx.List:
    """An up or down block's ResnetBlocks: the first takes `in_ch` channels to `out_ch`, the others keep `out_ch`."""
    return nnx.List([ResnetBlock(in_ch if i == 0 else out_ch, out_ch, groups, dtype=dtype, rngs=rngs)
                     for i in range(count)])


class UpBlock(nnx.Module):
    def __init__(self, in_ch: int, out_ch: int, num_resnets: int, groups: int, add_upsample: bool, *, dtype,
                 rngs: nnx.Rngs):
        self.resnets = _resnets(in_ch, out_ch, num_resnets, groups, dtype=dtype, rngs=rngs)
        self.upsamplers = nnx.List([Upsample(out_ch, dtype=dtype, rngs=rngs)]) if add_upsample else None

    def __call__(self, x, upsample: str):
        for resnet in self.resnets:
            x = resnet(x, one_pass_norm=True)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, upsample)
        return x


class Decoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs):
        chans = list(cfg.block_out_channels)
        groups = cfg.norm_num_groups
        self.conv_in = Conv2d(cfg.latent_channels, chans[-1], 3, padding=1, dtype=dtype, rngs=rngs)
        self.mid_block = MidBlock(chans[-1], groups, cfg.mid_block_add_attention, dtype=dtype, rngs=rngs)
        reversed_chans = list(reversed(chans))
        blocks = []
        prev = reversed_chans[0]
        for i, out_ch in enumerate(reversed_chans):
            blocks.append(UpBlock(prev, out_ch, cfg.layers_per_block + 1, groups, i != len(chans) - 1,
                                  dtype=dtype, rngs=rngs))
            prev = out_ch
        self.up_blocks = nnx.List(blocks)
        self.conv_norm_out = GroupNorm(groups, chans[0], eps=RESNET_EPS, dtype=dtype)
        self.conv_out = Conv2d(chans[0], cfg.out_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, z, upsample: str | None = None):
        """The decoder's GroupNorms take their statistics in one pass (model.nets.layers.GroupNorm); `upsample`: the
        upsampling convs' form (None: the traced-for platform's, model.nets.platform_forms)."""
        upsample = upsample or traced_forms().upsample
        x = self.mid_block(self.conv_in(z), one_pass_norm=True)
        for block in self.up_blocks:
            x = block(x, upsample)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x, one_pass=True)))


class Downsample(nnx.Module):
    """Pad right/bottom by one, then a stride-2 3x3 conv (diffusers' Downsample2D with padding 0)."""

    def __init__(self, ch: int, *, dtype, rngs: nnx.Rngs):
        self.conv = Conv2d(ch, ch, 3, padding=0, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        w = self.conv.weight[...]
        y = jax.lax.conv_general_dilated(x.astype(w.dtype), w, (2, 2), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=precision_for(w.dtype))
        return y + self.conv.bias[...]


class DownBlock(nnx.Module):
    def __init__(self, in_ch: int, out_ch: int, num_resnets: int, groups: int, add_downsample: bool, *, dtype,
                 rngs: nnx.Rngs):
        self.resnets = _resnets(in_ch, out_ch, num_resnets, groups, dtype=dtype, rngs=rngs)
        self.downsamplers = nnx.List([Downsample(out_ch, dtype=dtype, rngs=rngs)]) if add_downsample else None

    def __call__(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x


class Encoder(nnx.Module):
    """Image -> [mean | logvar] latents. Only needed for reference images (and to validate every checkpoint name)."""

    def __init__(self, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs):
        chans = list(cfg.encoder_block_out_channels)
        groups = cfg.norm_num_groups
        self.conv_in = Conv2d(cfg.in_channels, chans[0], 3, padding=1, dtype=dtype, rngs=rngs)
        blocks, prev = [], chans[0]
        for i, out_ch in enumerate(chans):
            blocks.append(DownBlock(prev, out_ch, cfg.layers_per_block, groups, i != len(chans) - 1,
                                    dtype=dtype, rngs=rngs))
            prev = out_ch
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(chans[-1], groups, cfg.mid_block_add_attention, dtype=dtype, rngs=rngs)
        self.conv_norm_out = GroupNorm(groups, chans[-1], eps=RESNET_EPS, dtype=dtype)
        self.conv_out = Conv2d(chans[-1], 2 * cfg.latent_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(self.mid_block(x))))


class BatchNormStats(nnx.Module):
    """The VAE's latent BatchNorm2d: only its running statistics are used (by hand, in `decode_latents`)."""

    def __init__(self, channels: int, *, dtype=jnp.float32):
        self.running_mean = param(jnp.zeros((channels,), jnp.float32), ("norm",))
        self.running_var = param(jnp.ones((channels,), jnp.float32), ("norm",))
        self.num_batches_tracked = None  # present in checkpoints (int64 scalar); unused, see loading/loader.py


class Flux2VAEDecoder(nnx.Module):
    """Decoder side of AutoencoderKLFlux2 (plus, optionally, its encoder) with the latent BN statistics."""

    def __init__(self, cfg: VAEConfig, *, with_encoder: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        if with_encoder:  # the whole AutoencoderKLFlux2, e.g. to validate every checkpoint tensor name
            self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
            self.quant_conv = (Conv2d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1, padding=0, dtype=dtype,
                                      rngs=rngs) if cfg.use_quant_conv else None)
        self.post_quant_conv = (Conv2d(cfg.latent_channels, cfg.latent_channels, 1, padding=0, dtype=dtype, rngs=rngs)
                                if cfg.use_post_quant_conv else None)
        self.decoder = Decoder(cfg, dtype=dtype, rngs=rngs)
        self.bn = BatchNormStats(cfg.patched_channels)

    def decode(self, z, upsample: str | None = None):
        """z: NHWC latents [B, h, w, latent_channels] -> NHWC image [B, H, W, out_channels] in about [-1, 1].
        `upsample`: the upsampling convs' form (None: the platform's, `Decoder`)."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z, upsample)

    def decode_latents(self, tokens, grid_h: int, grid_w: int, upsample: str | None = None):
        """Packed tokens [B, grid_h*grid_w, C*p*p] -> image [B, H, W, out]: BN de-norm, unpatchify, decode."""
        cfg = self.config
        ph, pw = cfg.patch_size
        b = tokens.shape[0]
        x = tokens.reshape(b, grid_h, grid_w, cfg.patched_channels)  # row-major tokens = NHWC patch grid
        std = jnp.sqrt(self.bn.running_var[...].astype(jnp.float32) + cfg.batch_norm_eps)
        x = (x.astype(jnp.float32) * std + self.bn.running_mean[...].astype(jnp.float32)).astype(tokens.dtype)
        # patched channel index = c * (ph * pw) + dy * pw + dx
        x = x.reshape(b, grid_h, grid_w, cfg.latent_channels, ph, pw)
        x = x.transpose(0, 1, 4, 2, 5, 3).reshape(b, grid_h * ph, grid_w * pw, cfg.latent_channels)
        return self.decode(x, upsample)


def patchify_tokens(z):
    """NHWC latents [B, h, w, C] -> row-major tokens [B, (h/2)*(w/2), C*4] of 2x2 patches, patched channel
    index c * 4 + dy * 2 + dx (the inverse of `decode_latents`' unpatchify)."""
    b, h, w, c = z.shape
    z = z.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)


def normalize_tokens(tokens, running_mean, running_var, eps: float):
    """(tokens - mean) / sqrt(var + eps) with the VAE's latent BN statistics, in the tokens' dtype (diffusers casts
    mean and std to the latents' dtype before the arithmetic)."""
    dtype = tokens.dtype
    std = jnp.sqrt(running_var.astype(dtype) + jnp.asarray(eps, dtype))
    return (tokens - running_mean.astype(dtype)) / std


class Flux2VAEEncoder(nnx.Module):
    """Encoder side of AutoencoderKLFlux2 (encoder, quant conv, latent BN statistics) for reference images; its
    parameter names are the checkpoint's, so it loads from the vae folder on its own, only when needed."""

    def __init__(self, cfg: VAEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.quant_conv = (Conv2d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1, padding=0, dtype=dtype,
                                  rngs=rngs) if cfg.use_quant_conv else None)
        self.bn = BatchNormStats(cfg.patched_channels)

    def posterior_mean(self, pixels):
        """NHWC image [B, H, W, 3] in [-1, 1] -> the posterior mean [B, H/s, W/s, latent_channels] (diffusers'
        `latent_dist.mode()`)."""
        moments = self.encoder(pixels)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return moments[..., :self.config.latent_channels]

    def encode_tokens(self, pixels):
        """NHWC image [B, H, W, 3] -> normalised latent tokens [B, (H/m)*(W/m), patched_channels] (m = the size
        multiple), as the transformer takes reference tokens."""
        z = patchify_tokens(self.posterior_mean(pixels))
        return normalize_tokens(z, self.bn.running_mean[...], self.bn.running_var[...], self.config.batch_norm_eps)
