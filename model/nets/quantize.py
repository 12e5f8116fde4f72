"""int8 linear layers (W8A8): weights symmetric per output channel, activations per token, int32 accumulation.

A quantized layer stores its weight as int8 [in, out] with a float32 scale per output column (`weight_scale`, a
`QuantScale`: derived from the checkpoint's weight, never read from it). The weight is quantized as it is loaded
(`quantize_columns`, on the device that holds it: model.loading.loader), and each call quantizes its input per token
(`quantize_rows`), multiplies int8 by int8 into int32 and applies both scales in the epilogue. The v5e MXU
multiplies int8 at twice its bf16 rate; docs/performance.md has the measured figures.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..parallel.sharding import param
from .lora_bank import lora_term

QMAX = 127.0  # symmetric int8: -127..127 (no -128, so negation and the scale stay exact)
QUANTIZED_FROM = "quantized_from"  # metadata of a quantized weight: the float dtype it is quantized from


class QuantScale(nnx.Variable):
    """A quantized weight's per-column scale: filled by the loader from the weight it quantizes, not a checkpoint
    tensor (model.loading.loader skips it when matching names)."""


def quantize_columns(w):
    """(int8 values, float32 scale per column) of a float matrix [in, out]: w ~= values * scale, symmetric, each
    column's largest magnitude at 127 (an all-zero column gets scale 1)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=0)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    values = jnp.clip(jnp.round(w32 / scale), -QMAX, QMAX).astype(jnp.int8)
    return values, scale


def quantize_rows(x):
    """(int8 values, float32 scale [..., 1]) of activations [..., K], one scale per token (row)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    values = jnp.clip(jnp.round(x32 / scale), -QMAX, QMAX).astype(jnp.int8)
    return values, scale


def int8_matmul(x, values, scale, out_dtype):
    """x [..., K] (float) times an int8 weight [K, N] with per-column `scale` [N]: x quantized per token, int8 x int8
    accumulated in int32, both scales applied to the float32 product, `out_dtype` out."""
    xq, x_scale = quantize_rows(x)
    acc = jax.lax.dot_general(xq, values, (((xq.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * x_scale * scale).astype(out_dtype)


class Int8Linear(nnx.Module):
    """`model.nets.layers.Linear` with an int8 weight [in, out] and its per-column float32 scale; inputs are quantized
    per token on each call, the output has the float dtype the weight was quantized from."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, rngs: nnx.Rngs,
                 axes: tuple[str, str]):
        del rngs
        self.weight = nnx.Param(jnp.zeros((in_features, out_features), jnp.int8), logical_axes=tuple(axes),
                                **{QUANTIZED_FROM: jnp.dtype(dtype).name})
        self.weight_scale = QuantScale(jnp.ones((out_features,), jnp.float32), logical_axes=tuple(axes[1:]))
        self.bias = param(jnp.zeros((out_features,), dtype), axes[1:]) if bias else None
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x):
        return self.columns(x, None)

    def columns(self, x, take):
        """x times the columns `take` selects (a function of an array's last axis; None: all of them)."""
        values, scale = self.weight[...], self.weight_scale[...]
        if take is not None:
            values, scale = take(values), take(scale)
        y = int8_matmul(x, values, scale, self.dtype)
        lora = lora_term(self, x, take)  # unmerged LoRA adapters in the float dtype, beside the int8 matmul
        if lora is not None:
            y = y + lora.astype(self.dtype)
        if self.bias is not None:
            bias = self.bias[...]
            y = y + (bias if take is None else take(bias))
        return y


def is_quantized(variable) -> bool:
    """Whether a parameter is an int8 weight the loader quantizes from its checkpoint's float tensor."""
    return QUANTIZED_FROM in variable.get_metadata()


def source_dtype(variable):
    """The float dtype a quantized weight is read from the checkpoint as (its layer's compute dtype)."""
    return jnp.dtype(variable.get_metadata()[QUANTIZED_FROM])


def scale_path(weight_path: tuple) -> tuple:
    """The path of a quantized weight's scale (its sibling `weight_scale`)."""
    return (*weight_path[:-1], "weight_scale")


def relative_error(approx, exact) -> float:
    """||approx - exact|| / ||exact||, in float64 on the host (the drift measures' one definition)."""
    a = np.asarray(approx, np.float64)
    e = np.asarray(exact, np.float64)
    den = float(np.linalg.norm(e))
    num = float(np.linalg.norm(a - e))
    return num / den if den else (0.0 if num == 0 else math.inf)
