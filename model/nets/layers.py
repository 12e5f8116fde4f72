"""Small NNX building blocks shared by the three networks.

Parameters are named like their PyTorch counterparts (`weight`, `bias`) and stored in JAX layout, so a module's
state path joined with dots is exactly the diffusers/transformers checkpoint key (see loading/loader.py). Each declares
the logical names of its axes (model.parallel.sharding), which say where it lives on a mesh.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..config.configs import ACTIVATIONS as CONFIG_ACTIVATIONS
from ..parallel.sharding import param
from .lora_bank import lora_term


def precision_for(dtype):
    """Full-precision matmuls for float32 models (GPUs/TPUs would otherwise use TF32/bf16 passes)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def precision_scope(dtype):
    """The matmul precision `dtype` promises, for everything traced inside (einsums, convolutions, XLA's attention,
    tests' references): float32 runs float32 passes ("highest"); TPUs (bf16 passes) and GPUs (TF32) would
    otherwise multiply float32 operands at reduced precision by default. Other dtypes keep the backend's default."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def round_to_dtype(x, dtype):
    """x rounded to `dtype`'s precision, as float32, by an explicit op that compilers keep.

    PyTorch rounds the result of every bfloat16 op; XLA may keep such intermediates in float32 ("excess precision"),
    and does so inside fused programs. Where a rounding changes the images (the timestep, fed to sinusoids whose
    fastest frequency turns 1 rad per unit of t), it is made explicit with this. For float32 no op is added (an
    identity rounding would still keep XLA from fusing a multiply-add, and change float32 images by 1/255 here and
    there)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.asarray(x, jnp.float32)
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(jnp.asarray(x, jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant)


_ACTIVATION_FORMS = {
    "silu": jax.nn.silu, "relu": jax.nn.relu,
    "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}
# transformers' ACT2FN by name, for the names the configs accept (model.config.configs.ACTIVATIONS).
ACTIVATIONS = {name: _ACTIVATION_FORMS[form] for name, form in CONFIG_ACTIVATIONS.items()}


def _init(rngs: nnx.Rngs, shape, dtype, scale: float, axes: tuple[str, ...]):
    """Placeholder values: modules are only ever built abstractly (nnx.eval_shape) and filled from a checkpoint,
    so a random initialiser would only cost tracing time."""
    del rngs, scale
    return param(jnp.zeros(shape, dtype), axes)


class Linear(nnx.Module):
    """y = x @ W + b with W stored as [in, out] (the transpose of torch's [out, in]); `axes`: the logical names of
    (in, out) (model.parallel.sharding), the bias takes the out one."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, rngs: nnx.Rngs,
                 axes: tuple[str, str]):
        self.weight = _init(rngs, (in_features, out_features), dtype, 1.0 / math.sqrt(in_features), axes)
        self.bias = param(jnp.zeros((out_features,), dtype), axes[1:]) if bias else None

    def __call__(self, x):
        return self.columns(x, None)

    def columns(self, x, take):
        """x times the columns `take` selects (a function of an array's last axis; None: all of them)."""
        w = self.weight[...]
        if take is not None:
            w = take(w)
        y = jnp.dot(x.astype(w.dtype), w, precision=precision_for(w.dtype))
        lora = lora_term(self, x, take)  # unmerged LoRA adapters (model.nets.lora_bank), where attached
        if lora is not None:
            y = y + lora
        if self.bias is not None:
            y = y + (self.bias[...] if take is None else take(self.bias[...]))
        return y


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, computed in float32 and scaled by a learned weight."""

    def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs | None = None):
        self.weight = param(jnp.ones((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x):
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return x32.astype(dtype) * self.weight[...].astype(dtype)


def layer_norm(x, eps: float):
    """LayerNorm over the last axis without affine parameters, computed in float32."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(dtype)


# Convolutions with fewer output channels (the VAE's RGB conv_out) run with zero channels up to this many: XLA:CPU's
# convolution is faster with 8 than with 3 (docs/performance.md); free elsewhere (MXU/tensor-core tiles are wider).
MIN_CONV_OUT_CHANNELS = 8


class Conv2d(nnx.Module):
    """2-D convolution on NHWC tensors; weight stored as [kh, kw, in, out] (torch: [out, in, kh, kw])."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, padding: int, dtype,
                 rngs: nnx.Rngs):
        fan_in = in_channels * kernel_size * kernel_size
        self.weight = _init(rngs, (kernel_size, kernel_size, in_channels, out_channels), dtype,
                            1.0 / math.sqrt(fan_in), ("conv_height", "conv_width", "conv_in", "conv_out"))
        self.bias = param(jnp.zeros((out_channels,), dtype), ("conv_out",))
        self.padding = padding

    def __call__(self, x):
        p = self.padding
        w = self.weight[...]
        out = w.shape[-1]
        if out < MIN_CONV_OUT_CHANNELS:  # zero output channels, sliced off below
            w = jnp.pad(w, ((0, 0),) * 3 + ((0, MIN_CONV_OUT_CHANNELS - out),))
        y = jax.lax.conv_general_dilated(
            x.astype(w.dtype), w, window_strides=(1, 1), padding=((p, p), (p, p)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=precision_for(w.dtype))
        return y[..., :out] + self.bias[...]


class GroupNorm(nnx.Module):
    """GroupNorm on NHWC tensors with affine weight/bias, statistics in float32."""

    def __init__(self, num_groups: int, num_channels: int, *, eps: float, dtype, rngs: nnx.Rngs | None = None):
        self.weight = param(jnp.ones((num_channels,), dtype), ("norm",))
        self.bias = param(jnp.zeros((num_channels,), dtype), ("norm",))
        self.num_groups = num_groups
        self.eps = eps

    def __call__(self, x, one_pass: bool = False):
        """`one_pass`: the variance as E[x^2] - E[x]^2 (float32, clamped at 0), both sums taken in the same pass over
        x, which XLA folds into the producing conv's output (no second read of x); False centres first (two passes,
        as torch does). The VAE decoder takes one pass, its encoder two. One pass loses log2(1 + mean^2/var) of
        float32's 24 bits: nothing a bf16 output keeps unless a group's mean is hundreds of its standard deviations."""
        dtype = x.dtype
        b, h, w, c = x.shape
        g = self.num_groups
        per_group = c // g
        count = h * w * per_group
        x32 = x.astype(jnp.float32).reshape(b, h * w, c)

        def group_mean(sums):  # [B, C] sums over the positions -> [B, 1, C], every channel given its group's mean
            means = sums.reshape(b, g, per_group).sum(-1) / count
            return jnp.repeat(means, per_group, axis=1)[:, None, :]

        # sums over the positions first (a reduction along the major axis, vectorised over the channels; faster on CPU
        # than one reduction over (H, W, channels of the group): docs/performance.md), then over the group's channels
        mean = group_mean(jnp.sum(x32, axis=1))
        if one_pass:
            var = jnp.maximum(group_mean(jnp.sum(x32 * x32, axis=1)) - mean * mean, 0.0)
            y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        else:
            centered = x32 - mean
            y = centered * jax.lax.rsqrt(group_mean(jnp.sum(centered * centered, axis=1)) + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(dtype).reshape(b, h, w, c)


class Embed(nnx.Module):
    """Token embedding table [vocab, dim] named `weight` like torch's nn.Embedding; split by rows on a mesh."""

    def __init__(self, num_embeddings: int, features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = _init(rngs, (num_embeddings, features), dtype, 1.0, ("vocab", "embed"))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


def traced_once_per_structure():
    """A caller of blocks as one jitted function of their parameters, made anew for each trace of the model: blocks
    of the same structure and static arguments are traced and lowered once per trace (XLA inlines the calls), and
    nothing is reused across traces, whose context (kernels, precision, mesh) may differ. The function is a new
    closure each time because JAX caches traces by function, not by jit object."""
    def run_block(graphdef, state, args, static):
        return nnx.merge(graphdef, state)(*args, **dict(static))

    jitted = jax.jit(run_block, static_argnums=(0, 3))

    def call(block, *args, **static):
        graphdef, state = nnx.split(block)
        return jitted(graphdef, state, args, tuple(sorted(static.items())))

    return call
