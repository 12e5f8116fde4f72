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
import functools
import logging
import threading
import time
import warnings
from typing import Any, Callable, NamedTuple
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .compile_lease import compile_lowered
from .cpu_images import ImageThreads, compiler_options_for, concurrent_images_for, image_by_image, per_image_for
from ..nets.layers import precision_scope
from ..nets.lora_bank import choose_adapter
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


# ------------------------------------------------------------------------------------------------ the programs
# Each program is a module-level function of `TraceSettings` (what it is traced with) and its arguments; the settings
# are bound with functools.partial when it is jitted, so the functions themselves close over nothing.


@dataclasses.dataclass(frozen=True)
class TraceSettings:
    """What every program is traced with: the modules' graphs, the compute dtype, the attention kernels, the mesh, and
    how a batch is split into turns (`rows` for encode and denoise, `decode_rows` for the decode)."""

    text_encoder: nnx.GraphDef
    transformer: nnx.GraphDef
    vae: nnx.GraphDef
    dtype: Any
    attention: str  # the transformer's attention kernels (model.nets.attention.IMPLEMENTATIONS)
    text_attention: str
    mesh: Mesh
    rows: Callable
    decode_rows: Callable


def encode(s: TraceSettings, state, ids, mask):
    """The text encoder's hidden states for token ids and their mask."""
    return s.rows(functools.partial(_encode_rows, nnx.merge(s.text_encoder, state), s), ids, mask)


def _encode_rows(model, s: TraceSettings, ids, mask):
    return model(ids, mask, implementation=s.text_attention).astype(s.dtype)


def velocity(s: TraceSettings, state, x, txt, t, cos, sin, neg_txt, guidance_scale, refs):
    """The target tokens' velocity; `refs` (reference tokens, or None) follow them in the image sequence and are the
    same in both CFG branches, as in diffusers."""
    model = nnx.merge(s.transformer, state)
    kw = dict(implementation=s.attention, target_tokens=x.shape[1])
    if refs is not None:
        x = jnp.concatenate([x, refs.astype(x.dtype)], axis=1)
    if neg_txt is None:
        return model(x, txt, t, cos, sin, **kw)
    both = model(jnp.concatenate([x, x]), jnp.concatenate([txt, neg_txt]), jnp.concatenate([t, t]), cos, sin, **kw)
    pos, neg = jnp.split(both, 2)
    return guidance_mix(pos, neg, guidance_scale)


def denoise(s: TraceSettings, state, latents, txt, neg_txt, refs, sigmas, timesteps, cos, sin, guidance_scale,
            adapter):
    """The whole denoising loop, in the batch's turns, with the unmerged LoRA adapter `adapter` (an int32 scalar:
    0 = none; data, not part of the program's shape: model.nets.lora_bank)."""
    state = choose_adapter(state, adapter)
    loop = functools.partial(denoise_batch, s, state, sigmas=sigmas, timesteps=timesteps, cos=cos, sin=sin,
                             guidance_scale=guidance_scale)
    return s.rows(loop, latents, txt, neg_txt, refs)


def denoise_batch(s: TraceSettings, state, latents, txt, neg_txt, refs, *, sigmas, timesteps, cos, sin,
                  guidance_scale):
    """The denoising loop over one turn's rows: one `lax.scan` of Euler steps, sigmas indexed by the step."""
    step = functools.partial(_denoise_step, s, state, txt=txt, neg_txt=neg_txt, refs=refs, sigmas=sigmas,
                             timesteps=timesteps, cos=cos, sin=sin, guidance_scale=guidance_scale)
    out, _ = jax.lax.scan(step, latents, jnp.arange(timesteps.shape[0]))
    return out


def _denoise_step(s: TraceSettings, state, x, i, *, txt, neg_txt, refs, sigmas, timesteps, cos, sin,
                  guidance_scale):
    t = model_timestep(timesteps[i], x.dtype, x.shape[0])
    v = velocity(s, state, x, txt, t, cos, sin, neg_txt, guidance_scale, refs)
    return euler_step(x, v, sigmas[i], sigmas[i + 1]), None


def velocity_at(s: TraceSettings, state, x, txt, neg_txt, refs, timestep, cos, sin, guidance_scale, adapter=0):
    """One step's velocity (as the denoising loop computes it) at latents `x`: drift measures compare it."""
    state = choose_adapter(state, adapter)
    one = functools.partial(_velocity_rows, s, state, timestep=timestep, cos=cos, sin=sin,
                            guidance_scale=guidance_scale)
    return s.rows(one, x, txt, neg_txt, refs)


def _velocity_rows(s: TraceSettings, state, x, txt, neg_txt, refs, *, timestep, cos, sin, guidance_scale):
    return velocity(s, state, x, txt, model_timestep(timestep, x.dtype, x.shape[0]), cos, sin, neg_txt,
                    guidance_scale, refs)


def decode(s: TraceSettings, state, tokens, grid_h, grid_w):
    """uint8 pixels of the denoised latent tokens, and per image the share of non-finite values in each."""
    model = nnx.merge(s.vae, state)
    image = s.decode_rows(functools.partial(_decode_rows, model, grid_h, grid_w), tokens)
    # The share of values that are not finite, per image, in what the denoising loop handed over and in the decoded
    # pixels (clipping would turn NaN into plausible-looking pixels): DecodedBatch.nonfinite.
    latents_bad = jnp.mean(~jnp.isfinite(tokens.astype(jnp.float32)), axis=(1, 2))
    image_bad = jnp.mean(~jnp.isfinite(image), axis=(1, 2, 3))
    pixels = jnp.round(jnp.clip(image / 2 + 0.5, 0.0, 1.0) * 255.0).astype(jnp.uint8)  # only uint8 to the host
    return DecodedBatch(pixels, latents_bad, image_bad)


def _decode_rows(model, grid_h, grid_w, tokens):
    return model.decode_latents(tokens, grid_h, grid_w).astype(jnp.float32)


def traced_on_mesh(fn, s: TraceSettings):
    """`fn` with its settings bound, traced for their mesh: the attention kernels partition themselves over it, and
    the forms of its platform are the ones traced (model.nets.platform_forms). Keeps `fn`'s name (profiles group
    programs by it)."""
    traced = functools.partial(_on_mesh, fn, s)
    traced.__name__ = traced.__qualname__ = fn.__name__  # not functools.wraps: jit reads the signature, (*args)
    return traced


def _on_mesh(fn, s: TraceSettings, *args):
    with attention_lib.mesh_context(s.mesh), precision_scope(s.dtype):
        return fn(s, *args)


@dataclasses.dataclass(frozen=True)
class ProgramDef:
    """One program of a bucket's compiled set: its function, the module whose parameters it takes first, how it is
    jitted, its arguments' shapes for a bucket, and which of them hold one row per image (run image by image)."""

    fn: Callable  # fn(TraceSettings, state, *args)
    module: str  # "text_encoder", "transformer" or "vae"
    arg_specs: Callable  # arg_specs(CompiledPrograms, Bucket, Dims) -> the arguments after the state, as shapes
    batched_args: tuple[int, ...]  # positions (counting the state as 0) of the per-image arguments
    donate_argnums: tuple[int, ...] = ()
    static_argnums: tuple[int, ...] = ()  # given when lowered, dropped when the compiled program is called


class Dims(NamedTuple):
    """The transformer's sizes the programs' argument shapes need."""

    in_channels: int
    joint_dim: int
    head_dim: int


def _encode_specs(p: "CompiledPrograms", b: Bucket, d: Dims):
    return (p.spec((b.batch, p.text_len), jnp.int32), p.spec((b.batch, p.text_len), jnp.int32))


def _denoise_specs(p: "CompiledPrograms", b: Bucket, d: Dims):
    seq = p.text_len + b.grid_h * b.grid_w + b.ref_tokens
    txt = p.spec((b.batch, p.text_len, d.joint_dim), p.dtype)
    refs = p.spec((b.batch, b.ref_tokens, d.in_channels), p.dtype) if b.ref_tokens else None
    return (p.latents_spec(b, d.in_channels), txt, txt if b.cfg else None, refs,
            p.spec((b.steps + 1,), jnp.float32, False), p.spec((b.steps,), jnp.float32, False),
            p.spec((seq, d.head_dim), jnp.float32, False), p.spec((seq, d.head_dim), jnp.float32, False),
            p.spec((), jnp.float32, False), p.spec((), jnp.int32, False))


def _decode_specs(p: "CompiledPrograms", b: Bucket, d: Dims):
    return (p.latents_spec(b, d.in_channels), b.grid_h, b.grid_w)


# A bucket's compiled set, in the order of model.options.PROGRAMS (the names the preflight and the CPU options use).
# To add a program: a module-level function of (TraceSettings, state, ...), an entry here, and its name in PROGRAMS.
BUCKET_PROGRAMS: dict[str, ProgramDef] = {
    "encode": ProgramDef(encode, "text_encoder", _encode_specs, batched_args=(1, 2)),
    "denoise": ProgramDef(denoise, "transformer", _denoise_specs, batched_args=(1, 2, 3, 4),  # latents, text, neg, refs
                          donate_argnums=(1,)),
    "decode": ProgramDef(decode, "vae", _decode_specs, batched_args=(1,), donate_argnums=(1,),
                         static_argnums=(2, 3)),
}
if tuple(BUCKET_PROGRAMS) != PROGRAMS:
    raise ImportError(f"the compiled programs {tuple(BUCKET_PROGRAMS)} are not model.options.PROGRAMS {PROGRAMS}")


def jit_program(name: str, s: TraceSettings, program: ProgramDef | None = None):
    """The program `name` jitted for `s`'s mesh, with its compiler options (they ride on the jitted function, so AOT
    `.lower().compile()` and plain jit both get them)."""
    program = program or BUCKET_PROGRAMS[name]
    return jax.jit(traced_on_mesh(program.fn, s), donate_argnums=program.donate_argnums,
                   static_argnums=program.static_argnums, compiler_options=compiler_options_for(s.mesh, name))


def decode_rows_for(mesh: Mesh, batched: NamedSharding, rows):
    """How the decode splits a batch: image by image where every program does, else one image per data replica at a
    time on every platform: its activations grow with the batch, so a whole batch at once needs more memory (the
    largest program at batch 2 and above) and runs slower per image than the same images one by one
    (docs/performance.md)."""
    return rows if per_image_for(mesh) else one_image_per_replica(data_replicas(mesh), batched)


def drop_static_args(compiled, static_argnums: tuple[int, ...]):
    """A compiled program callable with the jitted function's arguments: the static ones (baked in) are dropped."""
    if not static_argnums:
        return compiled
    return functools.partial(_call_without, compiled, frozenset(static_argnums))


def _call_without(compiled, static: frozenset, *args):
    return compiled(*(a for i, a in enumerate(args) if i not in static))


class CompiledPrograms:
    """Builds and caches the jitted/AOT-compiled programs of BUCKET_PROGRAMS for each bucket."""

    def __init__(self, text_encoder, transformer, vae, *, dtype, options: EngineOptions, text_len: int,
                 attention: str, text_attention: str, mesh: Mesh, abstract: bool = False):
        """`abstract`: the modules hold shapes only (nnx.eval_shape) and the programs are only lowered and compiled
        (`lowered`), never run: how the preflight compiles for a TPU topology this machine does not have."""
        self.dtype = dtype
        self.options = options
        self.attention = attention
        self.text_len = text_len
        self.mesh = mesh
        self.replicated = NamedSharding(mesh, P())
        self.batched = NamedSharding(mesh, P("data"))  # the batch axis is split over the mesh's data replicas
        # Fused projections laid out per shard (model.parallel.shard_order); a no-op when the loader did it already.
        shard_order.order_for_shards(transformer, model_shards(mesh))
        graphs, states = zip(*(nnx.split(module) for module in (text_encoder, transformer, vae)))
        # Parameters are placed on the devices once, split over the model axis as they declare
        # (model.parallel.sharding); every program takes them as arguments.
        self.te_state, self.tr_state, self.vae_state = (self._place(state, abstract) for state in states)
        self._graphs = graphs
        self.compile_count = 0
        self.build_seconds: dict = {}  # bucket -> seconds lowering, and compiling each program (AOT builds)
        self._lock = threading.RLock()  # re-entered when a batch's programs are built from the one-image ones
        self._compiled: LRUCache = LRUCache(options.max_buckets, "compiled programs")
        self.concurrent_images = concurrent_images_for(mesh)
        self.threads = ImageThreads(self.concurrent_images)  # used when concurrent_images > 1
        rows = image_by_image(per_image_for(mesh))
        self.settings = TraceSettings(*graphs, dtype=dtype, attention=attention, text_attention=text_attention,
                                      mesh=mesh, rows=rows, decode_rows=decode_rows_for(mesh, self.batched, rows))
        self._jitted = {name: jit_program(name, self.settings) for name in BUCKET_PROGRAMS}
        # One step's velocity, with the denoising loop's compiler options (benchmarks.drift).
        self.velocity = jax.jit(traced_on_mesh(velocity_at, self.settings),
                                compiler_options=compiler_options_for(mesh, "denoise"))

    def state_of(self, module: str):
        """The device-resident parameters of "text_encoder", "transformer" or "vae"."""
        return {"text_encoder": self.te_state, "transformer": self.tr_state, "vae": self.vae_state}[module]

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
        return {name: sharding.bytes_per_device(state, jax.tree.map(lambda x: x.sharding, state))
                for name, state in ((m, self.state_of(m)) for m in ("text_encoder", "transformer", "vae"))}

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

    def spec(self, shape, dtype, batched=True):
        """An argument's shape, split over the data replicas (`batched`) or on every device."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.batched if batched else self.replicated)

    def latents_spec(self, b: Bucket, in_channels):
        return self.spec((b.batch, b.grid_h * b.grid_w, in_channels), self.dtype)

    def programs(self, b: Bucket, in_channels, joint_dim, head_dim):
        """The bucket's callables in PROGRAMS order (encode, denoise, decode), compiled once (concurrently) and then
        reused while the bucket is among the `max_buckets` most recently used."""
        with self._lock:
            if self.concurrent_images > 1 and b.batch > 1:  # the one-image programs, run image by image
                one = self.programs(dataclasses.replace(b, batch=1), in_channels, joint_dim, head_dim)
                return tuple(self.threads.wrap(name, fn, BUCKET_PROGRAMS[name].batched_args)
                             for name, fn in zip(BUCKET_PROGRAMS, one))
            dims = Dims(in_channels, joint_dim, head_dim)
            return self._compiled.get_or_make(b, lambda: self._build(b, dims))

    def lower(self, b: Bucket, in_channels, joint_dim, head_dim):
        """The bucket's programs lowered for its shapes, in PROGRAMS order (denoise: the whole loop)."""
        return [self.lower_program(name, b, in_channels, joint_dim, head_dim) for name in BUCKET_PROGRAMS]

    def lower_program(self, name: str, b: Bucket, in_channels, joint_dim=0, head_dim=0):
        """One program of the bucket lowered for its shapes (`joint_dim` and `head_dim`: the denoising loop's)."""
        program = BUCKET_PROGRAMS[name]
        specs = program.arg_specs(self, b, Dims(in_channels, joint_dim, head_dim))
        return self._jitted[name].lower(self.state_of(program.module), *specs)

    def _build(self, b: Bucket, dims: Dims):
        """The bucket's programs, compiled ahead of time (all of them concurrently)."""
        start = time.perf_counter()
        lowered = self.lower(b, *dims)
        lowered_at = time.perf_counter()
        devices = list(self.mesh.devices.flat)
        with ThreadPoolExecutor(len(lowered)) as pool:
            # Under a compile lease: of the workers sharing the compilation cache only the first compiles a program,
            # the others wait and then load it from the cache (model/engine/compile_lease.py).
            built = list(pool.map(functools.partial(_compile_timed, devices=devices), lowered))
        # where the bucket's build went: lowering them all, then each one's compile (or persistent-cache load)
        self.build_seconds[b] = {"lower": lowered_at - start,
                                 **{name: seconds for name, (_, seconds) in zip(BUCKET_PROGRAMS, built)}}
        self.compile_count += len(built)
        # The compilers free most of the host memory they took, but glibc keeps it unless asked (docs/performance.md).
        release_host_memory()
        logger.info("compiled bucket %s in %.1f s", b, time.perf_counter() - start)
        return tuple(drop_static_args(compiled, program.static_argnums)
                     for (compiled, _), program in zip(built, BUCKET_PROGRAMS.values()))


def _compile_timed(lowered, devices):
    """(the program compiled, seconds)."""
    began = time.perf_counter()
    return compile_lowered(lowered, devices), time.perf_counter() - began
