"""Compiled programs of the generator: encode, fused denoise loop, decode to uint8, per shape bucket.

All device work for one batch is three executables, compiled ahead of time per bucket (batch, height, width,
steps, CFG, reference tokens) and reused: the text encoder, the whole denoising loop as one `lax.scan` (sigmas staged
on device and indexed by the step counter), and the VAE decode with the latents donated, one image per data replica
at a time, ending in uint8 pixels.
Image-conditioned generation adds the reference images' latent tokens as an input of the denoising program (appended
after the noisy target tokens at every step; only the target tokens' velocity is kept), so one program serves any
references with the same token count.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from typing import NamedTuple
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .compile_lease import compile_lowered
from .cpu_images import ImageThreads, compiler_options_for, concurrent_images_for, image_by_image, per_image_for
from ..nets.layers import precision_scope
from .lru import LRUCache
from ..options import PROGRAMS, EngineOptions
from ..nets import attention as attention_lib
from ..parallel import shard_order, sharding
from ..parallel.mesh import data_replicas, model_shards
from .buckets import Bucket
from ..nets.scheduler import euler_step, guidance_mix, model_timestep
from ..loading.loader import release_host_memory

logger = logging.getLogger(__name__)
# Donation is a no-op on backends that cannot alias the buffers (CPU); that is expected, not worth a warning.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


def enable_compilation_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at `path` (local folder or gs://) so restarts skip compiling."""
    if not path:
        return
    if jax.config.jax_compilation_cache_dir != path:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", path)
        # JAX opens its cache once per process: one opened earlier at another folder (an earlier load's, or the
        # JAX_COMPILATION_CACHE_DIR one) would otherwise go on receiving the programs meant for this one.
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class DecodedBatch(NamedTuple):
    """What the decode program returns: the pixels, and per image the share of non-finite values in the denoised
    latents and in the decoded image (float32 [B] each; 0 for a sound image)."""

    pixels: jax.Array
    latents_nonfinite: jax.Array
    image_nonfinite: jax.Array


def one_image_per_replica(replicas: int, batched: NamedSharding):
    """`rows(fn, x)`: fn over the batch `x` (split over `replicas` as `batched`) in turns of one image per replica
    (lax.map); each replica keeps its own rows, so no image moves between devices. fn on the whole batch when each
    replica holds one image."""
    def rows(fn, x):
        batch = x.shape[0]
        per_replica = batch // replicas
        if per_replica <= 1:
            return fn(x)
        # Image r * per_replica + j (replica r's j-th row) goes to turn j, column r.
        turns = jnp.swapaxes(x.reshape((replicas, per_replica) + x.shape[1:]), 0, 1)
        out = jax.lax.map(lambda row: fn(jax.lax.with_sharding_constraint(row, batched)), turns)
        return jnp.swapaxes(out, 0, 1).reshape((batch,) + out.shape[2:])

    return rows


class CompiledPrograms:
    """Builds and caches the three jitted/AOT-compiled programs for each bucket."""

    def __init__(self, text_encoder, transformer, vae, *, dtype, options: EngineOptions, text_len: int,
                 attention: str, text_attention: str, mesh: Mesh, abstract: bool = False):
        """`abstract`: the modules hold shapes only (nnx.eval_shape) and the programs are only lowered and compiled
        (`lowered`), never run: how the preflight compiles for a TPU topology this machine does not have."""
        self.dtype = dtype
        self.options = options
        self.attention = attention  # the transformer's attention kernels (model.nets.attention.IMPLEMENTATIONS)
        self.text_len = text_len
        self.mesh = mesh
        self.replicated = NamedSharding(mesh, P())
        # The batch axis is split over the mesh's data replicas.
        self.batched = NamedSharding(mesh, P("data"))
        # Fused projections laid out per shard (model.parallel.shard_order); a no-op when the loader did it already.
        shard_order.order_for_shards(transformer, model_shards(mesh))
        te_graph, te_state = nnx.split(text_encoder)
        tr_graph, tr_state = nnx.split(transformer)
        vae_graph, vae_state = nnx.split(vae)
        # Parameters are placed on the devices once, split over the model axis as they declare
        # (model.parallel.sharding); every program takes them as arguments.
        self.te_state, self.tr_state, self.vae_state = (self._place(state, abstract)
                                                        for state in (te_state, tr_state, vae_state))
        self._graphs = (te_graph, tr_graph, vae_graph)
        self.compile_count = 0
        self.build_seconds: dict = {}  # bucket -> seconds lowering, and compiling each program (AOT builds)
        self._lock = threading.RLock()  # re-entered when a batch's programs are built from the one-image ones
        self._compiled: LRUCache = LRUCache(options.max_buckets, "compiled programs")
        self.concurrent_images = concurrent_images_for(mesh)
        self.threads = ImageThreads(self.concurrent_images)  # used when concurrent_images > 1
        rows = image_by_image(per_image_for(mesh))
        # The decode runs one image per replica at a time on every platform: its activations grow with the batch,
        # so a whole batch at once needs more memory (the largest program at batch 2 and above) and runs slower per
        # image than the same images one by one (docs/performance.md).
        decode_rows = rows if per_image_for(mesh) else one_image_per_replica(data_replicas(mesh), self.batched)

        def on_mesh(fn):
            """`fn` traced for this mesh: the attention kernels partition themselves over it, and the forms of its
            platform are the ones traced (model.nets.platform_forms)."""
            def traced(*args):
                with attention_lib.mesh_context(mesh), precision_scope(dtype):
                    return fn(*args)

            traced.__name__ = traced.__qualname__ = fn.__name__  # programs keep their names (profiles group by them)
            return traced

        @on_mesh
        def encode(state, ids, mask):
            model = nnx.merge(te_graph, state)
            return rows(lambda i, m: model(i, m, implementation=text_attention).astype(dtype), ids, mask)

        def velocity(state, x, txt, t, cos, sin, neg_txt, guidance_scale, refs):
            """The target tokens' velocity; `refs` (reference tokens, or None) follow them in the image sequence and
            are the same in both CFG branches, as in diffusers."""
            model = nnx.merge(tr_graph, state)
            kw = dict(implementation=attention, target_tokens=x.shape[1])
            if refs is not None:
                x = jnp.concatenate([x, refs.astype(x.dtype)], axis=1)
            if neg_txt is None:
                return model(x, txt, t, cos, sin, **kw)
            both = model(jnp.concatenate([x, x]), jnp.concatenate([txt, neg_txt]), jnp.concatenate([t, t]),
                         cos, sin, **kw)
            pos, neg = jnp.split(both, 2)
            return guidance_mix(pos, neg, guidance_scale)

        @on_mesh
        def denoise(state, latents, txt, neg_txt, refs, sigmas, timesteps, cos, sin, guidance_scale):
            return rows(lambda x, tx, ntx, r: denoise_batch(state, x, tx, ntx, r, sigmas, timesteps, cos, sin,
                                                            guidance_scale), latents, txt, neg_txt, refs)

        def denoise_batch(state, latents, txt, neg_txt, refs, sigmas, timesteps, cos, sin, guidance_scale):
            batch = latents.shape[0]

            def step(x, i):
                t = model_timestep(timesteps[i], x.dtype, batch)
                v = velocity(state, x, txt, t, cos, sin, neg_txt, guidance_scale, refs)
                return euler_step(x, v, sigmas[i], sigmas[i + 1]), None

            out, _ = jax.lax.scan(step, latents, jnp.arange(timesteps.shape[0]))
            return out

        @on_mesh
        def velocity_at(state, x, txt, neg_txt, refs, timestep, cos, sin, guidance_scale):
            """One step's velocity (as the denoising loop computes it) at latents `x`: drift measures compare it."""
            return rows(lambda x, tx, ntx, r: velocity(state, x, tx, model_timestep(timestep, x.dtype, x.shape[0]),
                                                       cos, sin, ntx, guidance_scale, r), x, txt, neg_txt, refs)

        @on_mesh
        def decode(state, tokens, grid_h, grid_w):
            model = nnx.merge(vae_graph, state)
            image = decode_rows(lambda t: model.decode_latents(t, grid_h, grid_w).astype(jnp.float32), tokens)
            # The share of values that are not finite, per image, in what the denoising loop handed over and in the
            # decoded pixels (clipping would turn NaN into plausible-looking pixels): DecodedBatch.nonfinite.
            latents_bad = jnp.mean(~jnp.isfinite(tokens.astype(jnp.float32)), axis=(1, 2))
            image_bad = jnp.mean(~jnp.isfinite(image), axis=(1, 2, 3))
            pixels = jnp.round(jnp.clip(image / 2 + 0.5, 0.0, 1.0) * 255.0).astype(jnp.uint8)  # only uint8 to host
            return DecodedBatch(pixels, latents_bad, image_bad)

        # Compiler options ride on the jitted functions, so AOT `.lower().compile()` and plain jit both get them.
        def copts(program):
            return compiler_options_for(mesh, program)

        self._encode = jax.jit(encode, compiler_options=copts("encode"))
        self._denoise = jax.jit(denoise, donate_argnums=(1,), compiler_options=copts("denoise"))
        self.velocity = jax.jit(velocity_at, compiler_options=copts("denoise"))
        self._decode = jax.jit(decode, static_argnums=(2, 3), donate_argnums=(1,), compiler_options=copts("decode"))

    def decode_turns(self, batch: int) -> int:
        """How many times the decode program runs its body for a batch (a loop XLA's cost analysis counts once)."""
        return max(1, batch // data_replicas(self.mesh))

    def _place(self, state, abstract: bool):
        """A module's parameters on the mesh, split by model.parallel.sharding (shapes with shardings when
        `abstract`)."""
        shardings = sharding.state_shardings(state, self.mesh)
        if abstract:
            return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
        return jax.device_put(state, shardings)

    def parameter_bytes_per_device(self) -> dict:
        """Bytes of each module's parameters one device holds: {'text_encoder', 'transformer', 'vae'}."""
        states = {"text_encoder": self.te_state, "transformer": self.tr_state, "vae": self.vae_state}
        return {name: sharding.bytes_per_device(state, jax.tree.map(lambda x: x.sharding, state))
                for name, state in states.items()}

    @property
    def image_runs(self):
        """One-image program runs by program name (when images run in threads)."""
        return self.threads.runs

    @property
    def any_batch(self) -> bool:
        """Whether the programs take any number of rows (run image by image in threads): no padding rows needed."""
        return self.concurrent_images > 1

    def modules(self):
        """(text_encoder, transformer, vae) as NNX modules over the device-resident parameters."""
        states = (self.te_state, self.tr_state, self.vae_state)
        return tuple(nnx.merge(g, s) for g, s in zip(self._graphs, states))

    # ---------------------------------------------------------------------------------------------- specs

    def _spec(self, shape, dtype, batched=True):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.batched if batched else self.replicated)

    def _latents_spec(self, b: "Bucket", in_channels):
        return self._spec((b.batch, b.grid_h * b.grid_w, in_channels), self.dtype)

    def _encode_args(self, batch):
        return (self.te_state, self._spec((batch, self.text_len), jnp.int32),
                self._spec((batch, self.text_len), jnp.int32))

    def _denoise_args(self, b: Bucket, in_channels, joint_dim, head_dim):
        seq = self.text_len + b.grid_h * b.grid_w + b.ref_tokens
        txt = self._spec((b.batch, self.text_len, joint_dim), self.dtype)
        refs = self._spec((b.batch, b.ref_tokens, in_channels), self.dtype) if b.ref_tokens else None
        return (self.tr_state, self._latents_spec(b, in_channels), txt,
                txt if b.cfg else None, refs, self._spec((b.steps + 1,), jnp.float32, False),
                self._spec((b.steps,), jnp.float32, False), self._spec((seq, head_dim), jnp.float32, False),
                self._spec((seq, head_dim), jnp.float32, False), self._spec((), jnp.float32, False))

    def _decode_args(self, b: Bucket, in_channels):
        return (self.vae_state, self._latents_spec(b, in_channels), b.grid_h, b.grid_w)

    def programs(self, b: Bucket, in_channels, joint_dim, head_dim):
        """(encode, denoise, decode) callables for a bucket, compiled once (concurrently) and then reused while the
        bucket is among the `max_buckets` most recently used."""
        with self._lock:
            if self.concurrent_images > 1 and b.batch > 1:  # the one-image programs, run image by image
                one = self.programs(dataclasses.replace(b, batch=1), in_channels, joint_dim, head_dim)
                return tuple(self.threads.wrap(name, fn) for name, fn in zip(PROGRAMS, one))
            return self._compiled.get_or_make(b, lambda: self._build(b, in_channels, joint_dim, head_dim))

    def lower(self, b: Bucket, in_channels, joint_dim, head_dim):
        """[encode, denoise (the whole loop), decode] lowered for the bucket's shapes."""
        return [self._encode.lower(*self._encode_args(b.batch)),
                self._denoise.lower(*self._denoise_args(b, in_channels, joint_dim, head_dim)),
                self._decode.lower(*self._decode_args(b, in_channels))]

    def _build(self, b: Bucket, in_channels, joint_dim, head_dim):
        """The bucket's programs, compiled ahead of time (the three concurrently)."""
        start = time.perf_counter()
        lowered = self.lower(b, in_channels, joint_dim, head_dim)
        lowered_at = time.perf_counter()
        devices = list(self.mesh.devices.flat)

        def compile_one(low):
            """(the program compiled, seconds)."""
            began = time.perf_counter()
            return compile_lowered(low, devices), time.perf_counter() - began

        with ThreadPoolExecutor(3) as pool:
            # Under a compile lease: of the workers sharing the compilation cache only the first compiles a program,
            # the others wait and then load it from the cache (model/engine/compile_lease.py).
            (encode_c, encode_s), (denoise_c, denoise_s), (decode_c, decode_s) = pool.map(compile_one, lowered)
        # where the bucket's build went: lowering the three, then each one's compile (or persistent-cache load)
        self.build_seconds[b] = {"lower": lowered_at - start, "encode": encode_s, "denoise": denoise_s,
                                 "decode": decode_s}
        self.compile_count += 3
        # The compilers free most of the host memory they took, but glibc keeps it unless asked (docs/performance.md).
        release_host_memory()
        logger.info("compiled bucket %s in %.1f s", b, time.perf_counter() - start)

        def decode_fn(state, tokens, grid_h, grid_w):
            return decode_c(state, tokens)

        return (encode_c, denoise_c, decode_fn)
