"""Reference images -> latent tokens on the devices: the VAE encoder, loaded on first use and compiled per size.

Text-to-image never needs the encoder, so its weights are read from the checkpoint only when the first reference
image arrives (a one-off read of the vae folder's encoder tensors; the VAE is small next to the transformer), and a
text-only process keeps its memory as before. The program is one jitted function: JAX compiles it once per reference
size (its cache is keyed by shape). Within a call, equal references (same processed pixels) are encoded once.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..parallel import sharding
from .cpu_images import compiler_options_for
from ..nets.layers import precision_scope
from .reference_preprocess import ProcessedReference

logger = logging.getLogger(__name__)


class ReferenceEncoder:
    """Encodes processed reference images to normalised latent tokens [h * w, C] with the VAE encoder.

    `loader()` returns the concrete `model.nets.vae.Flux2VAEEncoder` (called once, on first use); `mesh` places its
    parameters (replicated, as the VAE's declare) and picks the CPU compiler options."""

    def __init__(self, loader, *, mesh, dtype):
        self._loader = loader
        self._mesh = mesh
        self._dtype = dtype
        self._graph = None
        self._state = None
        self._lock = threading.Lock()
        self.sizes = set()          # (h, w) pixel sizes seen, each one compiled program
        self.encoded = 0            # references run through the encoder (after de-duplication)
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def encode(state, pixels):
            module = nnx.merge(self._graph, state)
            with precision_scope(dtype):
                return module.encode_tokens(pixels.astype(dtype)).astype(dtype)

        # a convolution network like the decoder: the decoder's CPU compiler options
        self._encode = jax.jit(encode, compiler_options=compiler_options_for(mesh, "decode"))

    @property
    def loader(self):
        """The function that loads the encoder (to share it with another generator over the same weights)."""
        return self._loader

    @property
    def loaded(self) -> bool:
        return self._state is not None

    def _ensure_loaded(self):
        with self._lock:
            if self._state is None:
                start = time.perf_counter()
                graph, state = nnx.split(self._loader())
                self._state = jax.device_put(state, sharding.state_shardings(state, self._mesh))
                self._graph = graph
                logger.info("loaded the VAE encoder for reference images in %.1f s", time.perf_counter() - start)

    def encode_one(self, pixels: np.ndarray):
        """Float32 [H, W, 3] pixels in [-1, 1] -> tokens [1, (H/m)*(W/m), C] on the devices (replicated)."""
        self._ensure_loaded()
        self.sizes.add(pixels.shape[:2])
        self.encoded += 1
        return self._encode(self._state, jax.device_put(np.asarray(pixels, np.float32)[None], self._replicated))

    def encode(self, references, cache: dict | None = None) -> dict[str, jax.Array]:
        """{digest: tokens [h*w, C]} for the distinct references among `references` (ProcessedReference), added to
        `cache` when given (a call's references are encoded once however many batches use them)."""
        out = {} if cache is None else cache
        for ref in references:
            if ref.digest not in out:
                out[ref.digest] = self.encode_one(ref.pixels)[0]
        return out

    def batch_tokens(self, rows: list[tuple[ProcessedReference, ...]], sharding_, cache: dict | None = None):
        """Reference tokens [len(rows), R, C] for the batch: each row its references' tokens concatenated in order
        (R the same for every row), placed with `sharding_` (the batch's). `cache`: see `encode`."""
        tokens = self.encode([r for row in rows for r in row], cache)
        batch = jnp.stack([jnp.concatenate([tokens[r.digest] for r in row], axis=0) for row in rows])
        return jax.device_put(batch, sharding_)
