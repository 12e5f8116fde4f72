"""Score heads: a stack of linear layers on the normalized CLIP image embedding, read from safetensors.

The layout is LAION's improved aesthetic predictor (an `nn.Sequential` of `Linear` layers with `Dropout`s between,
no activation): tensors `layers.{i}.weight` [out, in] and `layers.{i}.bias` [out], indices with gaps where the
dropouts were. Which indices are layers is read from the keys; the layers must chain (each one's input is the
previous one's output), the first must read the embedding's width and the last give one value. Anything else is
refused (`HeadLayoutError`, naming the keys it found), since a head in another layout would give meaningless scores.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
from flax import nnx

from ..errors import CheckpointError
from ..parallel.sharding import param
from .layers import precision_for

_KEY = re.compile(r"layers\.(\d+)\.(weight|bias)\Z")


class HeadLayoutError(CheckpointError):
    """A score head's safetensors file is not a stack of `layers.{i}.weight` / `layers.{i}.bias` linear layers
    that reads the embedding and gives one value; the message names what was found."""


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """The linear layers of a head: their indices in the stack and their (in, out) sizes."""

    indices: tuple[int, ...]
    sizes: tuple[tuple[int, int], ...]


def head_layout(shapes: dict[str, tuple[int, ...]], embed_dim: int, path: str) -> HeadLayout:
    """The layout of a head file from its tensors' {name: shape}; HeadLayoutError unless it is the LAION layout
    described above for embeddings of width `embed_dim`."""
    def refuse(why):
        names = sorted(shapes)
        shown = ", ".join(f"{n} {list(shapes[n])}" for n in names[:8]) + (" ..." if len(names) > 8 else "")
        return HeadLayoutError(f"not a score head in LAION's aesthetic-predictor layout (linear layers "
                               f"layers.N.weight/bias chained from the {embed_dim}-wide image embedding to one "
                               f"value): {why}; the file holds {shown or 'no tensors'}", path=path)

    if not shapes:
        raise refuse("no tensors")
    others = [n for n in shapes if not _KEY.match(n)]
    if others:
        raise refuse(f"{len(others)} tensor(s) outside that layout, e.g. {others[0]!r}")
    indices = sorted({int(_KEY.match(n).group(1)) for n in shapes})
    sizes, width = [], embed_dim
    for i in indices:
        w, b = shapes.get(f"layers.{i}.weight"), shapes.get(f"layers.{i}.bias")
        if w is None or b is None or len(w) != 2 or tuple(b) != (w[0],):
            raise refuse(f"layer {i} is not a Linear with weight [out, in] and bias [out]")
        if w[1] != width:
            raise refuse(f"layer {i} reads {w[1]} values where {width} arrive")
        sizes.append((int(w[1]), int(w[0])))
        width = int(w[0])
    if width != 1:
        raise refuse(f"the last layer gives {width} values, not one score")
    return HeadLayout(tuple(indices), tuple(sizes))


class LinearStackHead(nnx.Module):
    """The head's layers, named as in the file (`layers.{i}`), applied in order with no activation between."""

    def __init__(self, layout: HeadLayout, *, dtype=jnp.float32):
        self.indices = layout.indices
        self.layers = nnx.Dict({str(i): _Linear(n_in, n_out, dtype) for i, (n_in, n_out) in
                                zip(layout.indices, layout.sizes)})

    def __call__(self, embeds):
        """Normalized image embeddings [B, D] -> scores [B] (float32)."""
        x = embeds.astype(jnp.float32)
        for i in self.indices:
            x = self.layers[str(i)](x)
        return x[:, 0]


class _Linear(nnx.Module):
    def __init__(self, n_in: int, n_out: int, dtype):
        self.weight = param(jnp.zeros((n_in, n_out), dtype), ("score", "score"))
        self.bias = param(jnp.zeros((n_out,), dtype), ("score",))

    def __call__(self, x):
        w = self.weight[...]
        return jnp.dot(x.astype(w.dtype), w, precision=precision_for(jnp.float32)).astype(jnp.float32) + \
            self.bias[...].astype(jnp.float32)

