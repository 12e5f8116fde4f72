"""Compiled programs of the generator: encode, fused denoise loop, decode to uint8; shape buckets and the mesh.

All device work for one batch is three executables, compiled ahead of time per bucket (batch, height, width,
steps, CFG) and reused: the text encoder, the whole denoising loop as one `lax.scan` (sigmas staged on device and
indexed by the step counter), and the VAE decode with the latents donated, ending in uint8 pixels.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .layers import round_to_dtype
from .lru import LRUCache
from .noise import is_integer, optional_count

logger = logging.getLogger(__name__)
# Donation is a no-op on backends that cannot alias the buffers (CPU); that is expected, not worth a warning.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


# XLA:CPU options per program. Eigen (YNNPACK's fusions off) for the text encoder and the VAE decode, XLA's defaults
# (YNNPACK dots) for the transformer. Measured on a 2-core AMD EPYC (small preset, 256x256, fp32): Eigen decodes in
# 97 ms instead of 165; YNNPACK runs the attention dots (contraction over a head dim of 32) about 2x faster than
# Eigen, one transformer block 4.4 ms instead of 5.3-5.9, and the whole image 786 -> 678 ms at batch 1 and 728 -> 607
# ms/img at batch 4. Either library's blocking depends on the matrix sizes, so a batched dot may round an image
# differently with its batch; the job promises the same bytes however requests are batched, which is why these
# options go together with `per_image` (every program then sees one image at a time, whatever the batch).
EIGEN_DOTS = (("xla_cpu_experimental_ynn_fusion_type", ""),)
PROGRAMS = ("encode", "denoise", "decode")
# (program, options) pairs; a program not listed compiles with XLA's defaults.
DEFAULT_CPU_COMPILER_OPTIONS: tuple = (("encode", EIGEN_DOTS), ("decode", EIGEN_DOTS))


# The pipeline's arithmetic between model calls, rounded where diffusers (PyTorch) rounds in a low-precision dtype;
# float32 is plain float32 arithmetic (round_to_dtype adds nothing there).


def model_timestep(timestep, dtype, batch: int):
    """The sigma the pipeline hands the model, [batch]: t rounded to the model's dtype, / 1000, rounded again."""
    return jnp.broadcast_to(round_to_dtype(round_to_dtype(timestep, dtype) / 1000, dtype), (batch,))


def euler_step(x, v, sigma, sigma_next):
    """x + (sigma_next - sigma) * v as diffusers' scheduler step: the step size and its product with v rounded to v's
    dtype, the sum in float32, then x's dtype."""
    r = lambda a: round_to_dtype(a, v.dtype)  # noqa: E731
    update = r(r(sigma_next - sigma) * v.astype(jnp.float32))
    return (x.astype(jnp.float32) + update).astype(x.dtype)


def guidance_mix(pos, neg, scale):
    """Classifier-free guidance neg + scale * (pos - neg), rounded to the velocities' dtype after each op; the scale
    (a Python float in diffusers) stays float32."""
    dtype = pos.dtype
    r = lambda a: round_to_dtype(a, dtype)  # noqa: E731
    pos, neg = pos.astype(jnp.float32), neg.astype(jnp.float32)
    return r(neg + r(scale * r(pos - neg))).astype(dtype)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Switches of the fast path (all on by default); `reference=True` selects the naive path for comparison."""

    reference: bool = False            # Python step loop, full-depth encoder, host uint8, tokenizer per call
    fused_loop: bool = True            # all steps in one lax.scan program
    truncated_encoder: bool = True     # stop the text encoder at the deepest needed layer
    device_uint8: bool = True          # pixels -> uint8 on device, only uint8 crosses to host
    dedupe_prompts: bool = True        # encode identical prompts of a batch once
    embed_cache_size: int = 16         # bounded in-process cache of text embeddings (0 = off)
    aot_compile: bool = True           # compile each bucket ahead of time, concurrently
    overlap_host: bool = True          # prepare the next batch while the device works on this one
    attention: str = "auto"            # transformer attention: auto | dot | xla | cudnn
    text_encoder_attention: str = "auto"  # text encoder attention (masked): auto = blocked on CPU, xla elsewhere
    image_only_last_block: bool = True  # last transformer block: outputs for image tokens only (text ones unused)
    fused_upsample: bool = True        # VAE: upsample x2 + 3x3 conv as one 2x2 conv at the low resolution (4/9 FLOPs)
    data_parallel: bool = True         # shard the batch over all local devices
    context_parallel: bool = False     # instead shard the image-token sequence over all local devices (latency)
    batch_size: int | None = None      # compiled batch size; None = the number of images asked for
    compilation_cache_dir: str | None = None  # persistent XLA cache (local path or gs://)
    # Shape buckets whose compiled programs (and RoPE tables, schedules) a process keeps; beyond it the least recently
    # used is dropped (compiled again, from the persistent cache when set, if it comes back). None = keep all. A
    # bucket's three CPU executables measured ~16 MB of host memory for the small preset (8 sizes, kept vs 2 kept).
    max_buckets: int | None = 16
    # Run each program image by image inside (lax.map): None = on a one-device CPU mesh, where it keeps an image's
    # bytes independent of its batch and costs nothing (one image already fills the CPU); never on a bigger mesh.
    per_image: bool | None = None
    # Image by image on CPU: how many images of a batch run at once, each an execution of the one-image programs in
    # its own thread. One image leaves the cores partly idle (its many small ops split badly over threads), so two at
    # once measured 20-30% more images/s at batch 4 on 2 cores; an image's bytes are those of the one-image programs
    # whatever the batch. None = 2 where `per_image` applies on CPU (else 1); 1 = one after the other (lax.map).
    concurrent_images: int | None = None
    # XLA:CPU compiler options (DebugOptions names) by program (encode / denoise / decode), applied only when the
    # programs run on CPU; a program not listed, and () for all, gets XLA's defaults.
    cpu_compiler_options: tuple[tuple[str, tuple[tuple[str, str | bool | int], ...]], ...] = \
        DEFAULT_CPU_COMPILER_OPTIONS

    def __post_init__(self):
        unknown = [p for p, _ in self.cpu_compiler_options if p not in PROGRAMS]
        if unknown:
            raise ValueError(f"cpu_compiler_options names unknown programs {unknown}; choose from {PROGRAMS}")
        optional_count("max_buckets", self.max_buckets)
        optional_count("concurrent_images", self.concurrent_images)
        if self.batch_size is not None and (not is_integer(self.batch_size) or self.batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not is_integer(self.embed_cache_size):
            raise ValueError(f"embed_cache_size must be an integer (0 or less = off), got {self.embed_cache_size!r}")

    @classmethod
    def reference_mode(cls, **kw) -> "EngineOptions":
        return cls(reference=True, fused_loop=False, truncated_encoder=False, device_uint8=False,
                   dedupe_prompts=False, embed_cache_size=0, aot_compile=False, overlap_host=False,
                   attention="dot", text_encoder_attention="dot", cpu_compiler_options=(), per_image=False,
                   image_only_last_block=False, fused_upsample=False, **kw)


def enable_compilation_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at `path` (local folder or gs://) so restarts skip compiling."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def on_cpu(mesh: Mesh) -> bool:
    """Whether every device of `mesh` is a CPU."""
    return all(d.platform == "cpu" for d in mesh.devices.flat)


def compiler_options_for(mesh: Mesh, options: EngineOptions, program: str) -> dict | None:
    """The XLA compiler options for `program` on `mesh`: its CPU options, only when every device is a CPU."""
    if program not in PROGRAMS:
        raise ValueError(f"unknown program {program!r}; choose from {PROGRAMS}")
    if not on_cpu(mesh):
        return None
    chosen = dict(options.cpu_compiler_options).get(program)
    return dict(chosen) if chosen else None


def per_image_for(mesh: Mesh, options: EngineOptions) -> bool:
    """Whether the programs on `mesh` run image by image: as asked, by default on a one-device CPU mesh; never on
    a mesh of several devices (the batch is split over them instead)."""
    if mesh.devices.size != 1:
        return False
    if options.per_image is None:
        return on_cpu(mesh)
    return bool(options.per_image)


def concurrent_images_for(mesh: Mesh, options: EngineOptions) -> int:
    """How many images of a batch run at once (threads over the one-image programs): as asked where the programs run
    image by image, by default 2 there on CPU; 1 (the batch in one program) everywhere else."""
    if not per_image_for(mesh, options):
        return 1
    if options.concurrent_images is None:
        return 2 if on_cpu(mesh) else 1
    return int(options.concurrent_images)


# Positions of the per-image arguments of each program (the rest are shared: parameters, schedule, RoPE tables).
BATCHED_ARGS = {"encode": (1, 2), "denoise": (1, 2, 3), "decode": (1,)}


def make_mesh(options: EngineOptions) -> Mesh:
    """One mesh axis over the local devices (all of them for data or context parallelism, else the first)."""
    use_all = options.data_parallel or options.context_parallel
    devices = jax.local_devices() if use_all else jax.local_devices()[:1]
    return Mesh(np.array(devices), ("data",))


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Everything a compiled executable is specialised on."""

    batch: int
    grid_h: int
    grid_w: int
    steps: int
    cfg: bool


class CompiledPrograms:
    """Builds and caches the three jitted/AOT-compiled programs for each bucket."""

    def __init__(self, text_encoder, transformer, vae, *, dtype, options: EngineOptions, text_len: int,
                 attention: str, text_attention: str, mesh: Mesh):
        self.dtype = dtype
        self.options = options
        self.text_len = text_len
        self.mesh = mesh
        self.replicated = NamedSharding(mesh, P())
        # Data parallel: the batch axis is split over the mesh. Context parallel: the batch is replicated and the
        # image-token axis of the latents is split instead; XLA gathers K/V for attention.
        self.context_parallel = options.context_parallel
        self.batched = NamedSharding(mesh, P() if options.context_parallel else P("data"))
        te_graph, te_state = nnx.split(text_encoder)
        tr_graph, tr_state = nnx.split(transformer)
        vae_graph, vae_state = nnx.split(vae)
        # Parameters are placed on the devices once (replicated); every program takes them as arguments.
        self.te_state = jax.device_put(te_state, self.replicated)
        self.tr_state = jax.device_put(tr_state, self.replicated)
        self.vae_state = jax.device_put(vae_state, self.replicated)
        self._graphs = (te_graph, tr_graph, vae_graph)
        self.compile_count = 0
        self._lock = threading.RLock()  # re-entered when a batch's programs are built from the one-image ones
        self._compiled: LRUCache = LRUCache(options.max_buckets, "compiled programs")
        self.concurrent_images = concurrent_images_for(mesh, options)
        self.image_runs = collections.Counter()  # one-image program runs by program name (threads only)
        self._pool = None  # the threads that run images at once, started on first use

        per_image = per_image_for(mesh, options)

        def rows(fn, *arrays):
            """fn over the batch image by image (lax.map, each call on a batch of one) when `per_image`."""
            if not per_image:
                return fn(*arrays)
            out = jax.lax.map(lambda row: fn(*jax.tree.map(lambda a: a[None], row)), arrays)
            return jax.tree.map(lambda o: o.reshape((-1,) + o.shape[2:]), out)

        def encode(state, ids, mask):
            model = nnx.merge(te_graph, state)
            return rows(lambda i, m: model(i, m, implementation=text_attention).astype(dtype), ids, mask)

        def velocity(state, x, txt, t, cos, sin, neg_txt, guidance_scale):
            model = nnx.merge(tr_graph, state)
            kw = dict(implementation=attention, image_only_last_block=options.image_only_last_block)
            if neg_txt is None:
                return model(x, txt, t, cos, sin, **kw)
            both = model(jnp.concatenate([x, x]), jnp.concatenate([txt, neg_txt]), jnp.concatenate([t, t]),
                         cos, sin, **kw)
            pos, neg = jnp.split(both, 2)
            return guidance_mix(pos, neg, guidance_scale)

        def denoise(state, latents, txt, neg_txt, sigmas, timesteps, cos, sin, guidance_scale):
            return rows(lambda x, tx, ntx: denoise_batch(state, x, tx, ntx, sigmas, timesteps, cos, sin,
                                                         guidance_scale), latents, txt, neg_txt)

        def denoise_batch(state, latents, txt, neg_txt, sigmas, timesteps, cos, sin, guidance_scale):
            batch = latents.shape[0]

            def step(x, i):
                t = model_timestep(timesteps[i], x.dtype, batch)
                v = velocity(state, x, txt, t, cos, sin, neg_txt, guidance_scale)
                return euler_step(x, v, sigmas[i], sigmas[i + 1]), None

            out, _ = jax.lax.scan(step, latents, jnp.arange(timesteps.shape[0]))
            return out

        def single_step(state, x, txt, neg_txt, sigma, sigma_next, timestep, cos, sin, guidance_scale):
            def one(x, txt, neg_txt):
                t = model_timestep(timestep, x.dtype, x.shape[0])
                return euler_step(x, velocity(state, x, txt, t, cos, sin, neg_txt, guidance_scale), sigma, sigma_next)

            return rows(one, x, txt, neg_txt)

        def decode(state, tokens, grid_h, grid_w, to_uint8):
            model = nnx.merge(vae_graph, state)
            fused = options.fused_upsample
            image = rows(lambda t: model.decode_latents(t, grid_h, grid_w, fused).astype(jnp.float32), tokens)
            if not to_uint8:
                return image
            return jnp.round(jnp.clip(image / 2 + 0.5, 0.0, 1.0) * 255.0).astype(jnp.uint8)

        # Compiler options ride on the jitted functions, so AOT `.lower().compile()` and plain jit both get them.
        def copts(program):
            return compiler_options_for(mesh, options, program)

        self._encode = jax.jit(encode, compiler_options=copts("encode"))
        self._denoise = jax.jit(denoise, donate_argnums=(1,), compiler_options=copts("denoise"))
        self._single_step = jax.jit(single_step, donate_argnums=(1,), compiler_options=copts("denoise"))
        self._decode = jax.jit(decode, static_argnums=(2, 3, 4), donate_argnums=(1,), compiler_options=copts("decode"))

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

    def latents_sharding(self, num_tokens: int) -> NamedSharding:
        """Sharding of latent tokens [B, N, C]: over N in context-parallel mode when N divides evenly."""
        if self.context_parallel and num_tokens % self.mesh.devices.size == 0:
            return NamedSharding(self.mesh, P(None, "data"))
        return self.batched

    def _latents_spec(self, b: "Bucket", in_channels):
        n = b.grid_h * b.grid_w
        return jax.ShapeDtypeStruct((b.batch, n, in_channels), self.dtype, sharding=self.latents_sharding(n))

    def _encode_args(self, batch):
        return (self.te_state, self._spec((batch, self.text_len), jnp.int32),
                self._spec((batch, self.text_len), jnp.int32))

    def _denoise_args(self, b: Bucket, in_channels, joint_dim, head_dim):
        seq = self.text_len + b.grid_h * b.grid_w
        txt = self._spec((b.batch, self.text_len, joint_dim), self.dtype)
        return (self.tr_state, self._latents_spec(b, in_channels), txt,
                txt if b.cfg else None, self._spec((b.steps + 1,), jnp.float32, False),
                self._spec((b.steps,), jnp.float32, False), self._spec((seq, head_dim), jnp.float32, False),
                self._spec((seq, head_dim), jnp.float32, False), self._spec((), jnp.float32, False))

    def _decode_args(self, b: Bucket, in_channels):
        return (self.vae_state, self._latents_spec(b, in_channels), b.grid_h, b.grid_w, self.options.device_uint8)

    def programs(self, b: Bucket, in_channels, joint_dim, head_dim):
        """(encode, denoise, decode) callables for a bucket, compiled once (concurrently) and then reused while the
        bucket is among the `max_buckets` most recently used."""
        with self._lock:
            if self.concurrent_images > 1 and b.batch > 1:  # the one-image programs, run image by image
                one = self.programs(dataclasses.replace(b, batch=1), in_channels, joint_dim, head_dim)
                return tuple(self._image_by_image(name, fn) for name, fn in zip(PROGRAMS, one))
            return self._compiled.get(b, lambda: self._build(b, in_channels, joint_dim, head_dim))

    def _build(self, b: Bucket, in_channels, joint_dim, head_dim):
        """The bucket's programs: compiled ahead of time (the three concurrently), or the jitted functions."""
        if not self.options.aot_compile:
            fused = self.options.fused_loop and not self.options.reference
            return (self._encode, self._denoise if fused else self._single_step, self._decode)
        start = time.perf_counter()
        denoise_args = self._denoise_args(b, in_channels, joint_dim, head_dim)
        if self.options.fused_loop and not self.options.reference:
            denoise_lowered = self._denoise.lower(*denoise_args)
        else:  # the per-step program: (state, x, txt, neg, sigma, sigma_next, timestep, cos, sin, scale)
            scalar = self._spec((), jnp.float32, False)
            state, x, txt, neg, _, _, cos, sin, scale = denoise_args
            denoise_lowered = self._single_step.lower(state, x, txt, neg, scalar, scalar, scalar, cos, sin, scale)
        lowered = [self._encode.lower(*self._encode_args(b.batch)), denoise_lowered,
                   self._decode.lower(*self._decode_args(b, in_channels))]
        with ThreadPoolExecutor(3) as pool:
            encode_c, denoise_c, decode_c = pool.map(lambda low: low.compile(), lowered)
        self.compile_count += 3
        logger.info("compiled bucket %s in %.1f s", b, time.perf_counter() - start)

        def decode_fn(state, tokens, grid_h, grid_w, to_uint8):
            return decode_c(state, tokens)

        return (encode_c, denoise_c, decode_fn)

    def _image_by_image(self, name: str, fn):
        """`fn`, the one-image program `name`, over any number of images: each image's slice of the per-image
        arguments in its own call, `concurrent_images` calls at once in threads (a CPU device runs calls from
        different threads side by side, one thread's calls one after the other); outputs concatenated in order."""
        batched = BATCHED_ARGS[name]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrent_images, thread_name_prefix="image")

        def run(*args):
            count = args[batched[0]].shape[0]
            self.image_runs[name] += count

            def one(i):
                row = [a[i:i + 1] if k in batched and a is not None else a for k, a in enumerate(args)]
                return jax.block_until_ready(fn(*row))

            outs = list(self._pool.map(one, range(count)))
            return jax.tree.map(lambda *o: jnp.concatenate(o), *outs)

        return run
