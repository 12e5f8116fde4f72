"""`load()` a diffusers-layout FLUX.2 [klein] checkpoint and `generate()` images from prompts and seeds.

A call runs in named stages, as diffusers' pipelines do: `check_inputs` (the request contract, reference images
preprocessed), `prepare_bucket` (the compiled programs, RoPE tables and schedule for its shape), then per batch
`encode_prompts` (`tokenize`, then `encode_tokens`), `prepare_latents`, `reference_tokens` (image-conditioned calls
only), `denoise`, `decode` and `to_host`. Benchmarks time the stages one by one through
these methods, and read XLA's cost analysis of a bucket's programs through `lower`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from .. import contract
from ..parallel import shard_order
from ..nets import scheduler as sched
from ..config.configs import PipelineConfig
from .programs import DecodedBatch, enable_compilation_cache
from ..errors import CheckpointError, NonFiniteImageError, RequestError
from .factory import COMPONENT_FOLDERS, DTYPES, Networks, build_programs, check_text_width
from .lru import LRUCache
from ..parallel.mesh import data_replicas, make_mesh, model_shards
from .noise import initial_noise
from ..options import DEFAULT_TEXT_ENCODER_OUT_LAYERS, EngineOptions, LoadSettings
from .buckets import Bucket, Sampling, bucket_for, default_guidance, default_steps, latent_grid, resolve_sampling
from .reference_encoder import ReferenceEncoder
from .reference_preprocess import ProcessedReference, preprocess_all, reference_signature as _reference_signature
from .results import GenerationResult, NonFinite  # noqa: F401 - GenerationResult: generate_result's type
from .runtime import start_runtime
from ..parallel.sharding import placement
from ..loading.tokenizer import PromptTokenizer
from ..nets.transformer import image_ids, reference_ids, rope_tables, text_ids
from ..loading.lora_source import merged_deltas, open_adapters
from ..nets.lora_bank import attach_banks
from ..loading.loader import (ComponentLoad, LoadTimes, load_component, load_components, release_host_memory,
                              validate_component)

logger = logging.getLogger(__name__)


def load(settings: LoadSettings | str, dtype: str = "bfloat16", *,
         max_sequence_length: int = contract.DEFAULT_MAX_SEQUENCE_LENGTH, batch_size: int | None = None,
         text_encoder_out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS, options: EngineOptions | None = None,
         cache_dir: str | None = None, variant: str | None = None, loras=(), lora_per_record: bool = False,
         vae: str | None = None,
         **engine_overrides) -> "Flux2KleinGenerator":
    """Load a checkpoint (local folder, gs:// URI or Hugging Face Hub id `owner/name[@revision]`; diffusers
    layout) in `dtype` and prepare it for generation.

    `settings` is a `LoadSettings` (as the job passes it), or the checkpoint's path with the other arguments.
    `variant`: which weight files, as diffusers' `from_pretrained(variant=...)` (e.g. "fp16" for
    `*.fp16.safetensors`); None takes the files without a variant, or a component's only variant when it has no
    others. The weights are cast to `dtype` whatever the files hold. `loras`: LoRA adapters (`[NAME=]SOURCE[:SCALE]`
    or model.config.lora_spec.LoraSpec) merged into the transformer's weights as they are placed, before any int8
    quantization; with `lora_per_record` they are applied unmerged instead (model.nets.lora_bank), and each
    `generate` call names the one its images use (or none). `vae`: another VAE in place of the checkpoint's (a folder,
    a .safetensors file with its config.json, gs:// or a Hub id; model/loading/vae_swap.py). `engine_overrides` name
    fields of `EngineOptions`."""
    if not isinstance(settings, LoadSettings):
        settings = LoadSettings.create(settings, dtype, max_sequence_length=max_sequence_length,
                                       batch_size=batch_size, text_encoder_out_layers=text_encoder_out_layers,
                                       options=options, cache_dir=cache_dir, variant=variant, loras=loras,
                                       lora_per_record=lora_per_record, vae=vae, **engine_overrides)
    elif engine_overrides:
        settings = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, **engine_overrides))
    return _load(settings)


_TOKENIZER_LOADER = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")


def _load(settings: LoadSettings) -> "Flux2KleinGenerator":
    """The load in four jobs: the checkpoint's folder, the preparations that need no device (configs, modules as
    shapes, every file's header checked), the weights placed on the mesh, and the generator assembled."""
    enable_compilation_cache(settings.engine.compilation_cache_dir)
    runtime = start_runtime()  # beside the preparations below, none of which needs a device
    root = checkpoint_folder(settings)
    clock = StepClock()
    prepared = prepare_load(settings, root, clock)
    placed = place_weights(prepared, settings.engine, runtime, clock)
    return assemble_generator(settings, prepared, placed, clock)


def checkpoint_folder(settings: LoadSettings) -> str:
    """The local folder of the checkpoint: a gs:// prefix or Hub id copied (or found) in the cache, a folder as is,
    seen with --vae's VAE in place of its own; CheckpointError for a folder that does not exist."""
    root = settings.model
    from ..loading.hub import is_hub_id

    if root.startswith("gs://") or is_hub_id(root):
        from ..loading.checkpoint import resolve_checkpoint

        root = resolve_checkpoint(root, cache_dir=settings.cache_dir, variant=settings.variant)
    elif not os.path.isdir(root):
        raise CheckpointError("checkpoint folder does not exist", path=root)
    if settings.vae:  # the checkpoint as a folder whose vae/ is the VAE named (read exactly as its own)
        from ..loading.vae_swap import vae_files, with_vae

        root = with_vae(root, vae_files(settings.vae, settings.cache_dir))
    return root


class StepClock:
    """Seconds of each named step of the load since the previous one (benchmarks.startup reports them)."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.steps: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.steps[name], self.last = now - self.last, now


@dataclasses.dataclass
class PreparedLoad:
    """What the load knows before any weight is read: the configs, the modules to fill (as shapes), each component's
    (folder, module, every tensor a complete checkpoint holds, tensors that may be absent) and its checked files."""

    root: str
    config: PipelineConfig
    networks: Networks
    components: list  # (folder name, module, expected tensors, optional tensors), in COMPONENT_FOLDERS order
    files: list  # each component's tensor -> file, from the headers
    tokenizing: object  # the tokenizer's Future, loading on its own thread
    adapters: list = dataclasses.field(default_factory=list)  # LoRA adapters opened and checked, merged as placed
    per_record: bool = False  # the adapters applied unmerged, chosen per call, instead of merged


def prepare_load(settings: LoadSettings, root: str, clock: StepClock) -> PreparedLoad:
    """The configs read, the tokenizer started on its own thread, the modules made as shapes and every component's
    files, names, shapes and dtypes validated (headers only) before any weight is read: a broken shard anywhere fails
    in seconds, not after minutes of loading the components before it."""
    config = PipelineConfig.from_folder(root)
    # The tokenizer (with the transformers import it needs, seconds on a TPU host) loads, and is checked against the
    # text encoder, on its own thread beside the preparations and the weights' placing.
    tokenizing = _TOKENIZER_LOADER.submit(load_tokenizer, os.path.join(root, "tokenizer"),
                                          settings.max_sequence_length, config.text_encoder.vocab_size)
    check_text_width(config, settings.text_encoder_out_layers, path=os.path.join(root, "transformer", "config.json"))
    networks = Networks(config, settings.dtype, settings.text_encoder_out_layers, settings.engine.quantize)
    run_te, transformer_abs, run_vae = networks.run_modules()
    stored = networks.stored_tensors(transformer_abs)
    components = [(name, module, *stored[name])
                  for name, module in zip(COMPONENT_FOLDERS, (run_te, transformer_abs, run_vae))]
    clock.mark("shapes")
    files = [validate_component(os.path.join(root, name), expected=exp, optional=opt, variant=settings.variant)
             for name, _, exp, opt in components]
    # LoRA adapters: checked from their headers against the transformer, their factors read (small) to be merged
    # into its weights on the devices as they are placed.
    adapters = open_adapters(settings.loras, stored["transformer"][0], settings.cache_dir) if settings.loras else []
    clock.mark("validate")
    return PreparedLoad(root, config, networks, components, files, tokenizing, adapters, settings.lora_per_record)


@dataclasses.dataclass
class PlacedWeights:
    """The loaded modules on their mesh, the tokenizer, and where the load's time went."""

    modules: tuple  # (text_encoder, transformer, vae)
    mesh: object
    tokenizer: PromptTokenizer
    phases: dict  # model.loading.loader.LoadTimes, with the runtime's start, the wall time and the preparations' steps
    placed_at: float


def place_weights(prepared: PreparedLoad, options: EngineOptions, runtime, clock: StepClock) -> PlacedWeights:
    """Each weight straight to its place on the mesh as it is read (split over the model axis, fused projections
    laid out per shard), so a model larger than one chip is never whole on the first one."""
    waiting = time.perf_counter()
    runtime_start_s = runtime.result()  # the runtime's own error (no chip, chip busy) is raised here
    runtime_wait_s = time.perf_counter() - waiting
    clock.mark("runtime_wait")
    mesh = make_mesh(options)
    transformer_abs = prepared.components[1][1]
    shard_order.order_for_shards(transformer_abs, model_shards(mesh))
    merge = prepared.adapters and not prepared.per_record
    deltas = {"transformer": merged_deltas(prepared.adapters)} if merge else {}
    loads = [ComponentLoad(os.path.join(prepared.root, name), module, exp, opt, f,
                           shard_order.stored_to_order(module), deltas.get(name))
             for (name, module, exp, opt), f in zip(prepared.components, prepared.files)]
    clock.mark("mesh")
    # The tokenizer goes on loading beside the weights (on a TPU host it still needed seconds after the runtime had
    # started); a broken one stops the loading threads as soon as it has failed. The device transposes the weights
    # need compile first (model.loading.loader.load_components), before any other program takes the compiler.
    tokenizing = prepared.tokenizing
    times, placing = LoadTimes(), time.perf_counter()
    modules = load_components(loads, placement=placement(mesh), times=times,
                              should_stop=lambda: tokenizing.exception() if tokenizing.done() else None)
    placed = time.perf_counter()
    tokenizer = tokenizing.result()  # its CheckpointError, if it failed after the last tensor was read
    clock.steps["tokenizer_wait_after_placing"] = time.perf_counter() - placed
    phases = dict(times.as_dict(), runtime_start_s=runtime_start_s, runtime_wait_s=runtime_wait_s,
                  prepare_s=placing - clock.start, wall_s=placed - placing,
                  prepare_steps_s={k: round(v, 3) for k, v in clock.steps.items()})
    return PlacedWeights(tuple(modules), mesh, tokenizer, phases, placed)


def load_vae_encoder(folder: str, networks: Networks, expected, optional, variant: str | None):
    """The VAE encoder for reference images, read from the (already validated) vae folder on first use."""
    return load_component(folder, networks.vae_encoder(), expected=expected, optional=optional,
                          tensor_to_file=validate_component(folder, expected=expected, optional=optional,
                                                            variant=variant))


def assemble_generator(settings: LoadSettings, prepared: PreparedLoad, placed: PlacedWeights,
                       clock: StepClock) -> "Flux2KleinGenerator":
    """The generator over the placed modules (its programs built over the mesh), with the load's phases."""
    finishing = time.perf_counter()
    phases = placed.phases
    _, _, vae_expected, vae_optional = prepared.components[2]
    vae_encoder = functools.partial(load_vae_encoder, os.path.join(prepared.root, "vae"), prepared.networks,
                                    vae_expected, vae_optional, settings.variant)
    release_host_memory()  # the host copies are gone: return their pages, the weights live on the devices
    logger.info("loaded %s (%s) in %.1f s; %d tensors, %.2f GB placed in %.1f s, thread-seconds: read %.1f, host "
                "layout %.1f, transfer %.1f, device layout %.1f", settings.model, settings.dtype,
                time.perf_counter() - clock.start, phases["tensors"], phases["bytes"] / 1e9, phases["wall_s"],
                phases["read_s"], phases["host_layout_s"], phases["transfer_s"], phases["device_layout_s"])
    if prepared.per_record and prepared.adapters:  # one bank of every adapter's factors per adapted layer
        transformer = placed.modules[1]
        attach_banks(transformer, [a.deltas() for a in prepared.adapters], DTYPES[settings.dtype],
                     shard_order.stored_to_order(transformer))
    generator = Flux2KleinGenerator(prepared.config, placed.tokenizer, *placed.modules, dtype=settings.dtype,
                                    options=settings.engine, model_id=settings.model, root=prepared.root,
                                    mesh=placed.mesh, vae_encoder_loader=vae_encoder)
    generator.load_phases = phases  # where the weights' load went (benchmarks.startup reports it)
    identities = tuple(a.identity for a in prepared.adapters)
    if prepared.per_record:  # each image's own adapter is part of its identity (`adapter_identity`)
        generator.adapters = identities
    else:
        generator.loras = identities  # merged adapters: part of every image's identity
    if settings.scores is not None:  # CLIP and its heads beside the generator, on the same mesh
        from .scoring import load_scorer

        generator.scorer = load_scorer(settings.scores, mesh=placed.mesh, dtype=DTYPES[settings.dtype],
                                       cache_dir=settings.cache_dir)
    phases["finish_s"] = time.perf_counter() - finishing  # host memory returned, the generator made
    return generator


def load_tokenizer(folder: str, max_length: int, vocab_size: int) -> PromptTokenizer:
    """The checkpoint's tokenizer; CheckpointError if it has ids past the text encoder's embedding table (they would
    read NaN: black images)."""
    tokenizer = PromptTokenizer(folder, max_length)
    if len(tokenizer.tokenizer) > vocab_size:
        raise CheckpointError(f"the tokenizer has {len(tokenizer.tokenizer)} tokens but the text encoder's embedding "
                              f"table only {vocab_size} rows (vocab_size): tokenizer and text encoder do not belong "
                              f"together", path=folder)
    return tokenizer


@dataclasses.dataclass(frozen=True)
class GenerationInputs:
    """A call's validated inputs, one entry per image (image j of prompt i uses seed seeds[i] + j)."""

    prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    use_cfg: bool
    # Image-conditioned calls: each image's processed references (all with the same sizes); None = text-to-image.
    references: tuple[tuple[ProcessedReference, ...], ...] | None = None
    adapter: int = 0  # the unmerged LoRA adapter of every image (its bank entry; 0 = none)

    @property
    def reference_sizes(self) -> tuple[tuple[int, int], ...]:
        """The processed (height, width) of each reference (the call's signature); () for text-to-image."""
        return tuple(r.size for r in self.references[0]) if self.references else ()


@dataclasses.dataclass(frozen=True)
class PreparedBucket:
    """What a shape bucket runs with: its compiled programs, RoPE tables and schedule, on the devices."""

    bucket: Bucket
    encode_fn: object
    denoise_fn: object
    decode_fn: object
    cos: object
    sin: object
    sigmas: object
    timesteps: object
    guidance: object  # float32 scalar

    @property
    def batch(self) -> int:
        return self.bucket.batch


class Flux2KleinGenerator:
    """A loaded FLUX.2 [klein] model: text encoder, transformer, VAE decoder, scheduler and tokenizer."""

    def __init__(self, config: PipelineConfig, tokenizer: PromptTokenizer, text_encoder, transformer, vae, *,
                 dtype: str, options: EngineOptions, model_id: str, root: str, vae_encoder_loader=None, mesh=None):
        """`vae_encoder_loader()`: the concrete `Flux2VAEEncoder`, called on the first image-conditioned call (None:
        reference images are refused). `mesh`: the devices (None: `model.parallel.mesh.make_mesh(options)`)."""
        self.config = config
        self.tokenizer = tokenizer
        self.load_phases: dict = {}  # model.load's weight-loading phases (model.loading.loader.LoadTimes, plus wall_s)
        self.loras: tuple = ()  # the merged LoRA adapters' identities (model.loading.lora_source.LoraAdapter.identity)
        self.adapters: tuple = ()  # the unmerged adapters' identities, in bank order (entry i + 1 is adapters[i])
        self.dtype = dtype
        self.options = options
        self.model_id = model_id
        self.root = root
        self.max_sequence_length = tokenizer.max_length
        self.is_distilled = config.is_distilled
        self.default_num_inference_steps = default_steps(config)
        self.default_guidance_scale = default_guidance(config)
        self.size_multiple = config.size_multiple
        self.limits = contract.Limits(size_multiple=config.size_multiple)
        self.mesh = make_mesh(options) if mesh is None else mesh
        self.programs = build_programs((text_encoder, transformer, vae), dtype=dtype, mesh=self.mesh, options=options,
                                       text_len=tokenizer.max_length)
        # Text embeddings of recent prompts with whether each prompt was truncated: (embedding, truncated).
        self._embed_cache: LRUCache | None = (
            LRUCache(options.embed_cache_size, "text embeddings", log_drops=False) if options.embed_cache_size > 0
            else None)
        self._rope_cache: LRUCache = LRUCache(options.max_buckets, "RoPE tables")
        self._schedule_cache: LRUCache = LRUCache(options.max_buckets, "schedules")
        self.reference_encoder = (ReferenceEncoder(vae_encoder_loader, mesh=self.mesh, dtype=DTYPES[dtype])
                                  if vae_encoder_loader else None)
        self.stats = collections.Counter()
        self.scorer = None  # model.engine.scoring.Scorer: scores each batch's pixels while they are on the devices
        # generate() calls are serialised: they share the embedding cache and the device (which runs one at a time).
        self._generate_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------------ helpers

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        return latent_grid(self.config, height, width)

    def noise_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """Shape of `model.initial_noise` for one image: (in_channels, height // 16, width // 16)."""
        gh, gw = self.latent_grid(height, width)
        return (self.config.transformer.in_channels, gh, gw)

    def reference_signature(self, images) -> tuple[tuple[int, int], ...]:
        """`model.engine.reference_preprocess.reference_signature` with this checkpoint's size multiple: the processed
        (height, width) of each reference, what a call's reference token counts (and compiled programs) depend on."""
        return _reference_signature(images, self.size_multiple)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The names calls choose unmerged adapters by (`lora=`), in bank order."""
        return tuple(a["name"] for a in self.adapters)

    def adapter_index(self, name: str | None) -> int:
        """The bank entry of the unmerged adapter `name` (0 for None or "": the base model); RequestError naming the
        value and the adapters this generator has."""
        if not name:
            return 0
        if name in self.adapter_names:
            return self.adapter_names.index(name) + 1
        have = (f"its adapters are {list(self.adapter_names)}" if self.adapters else
                "its adapters are merged into every image" if self.loras else "it was loaded without adapters")
        raise RequestError(f"unknown LoRA adapter {name!r}: {have}", field="lora", value=name)

    def adapter_identity(self, name: str | None) -> dict | None:
        """The identity (name, sha256, scale) of the unmerged adapter `name`, None for the base model."""
        index = self.adapter_index(name)
        return self.adapters[index - 1] if index else None

    def rope(self, grid_h: int, grid_w: int, reference_grids: tuple[tuple[int, int], ...] = ()):
        """RoPE cos/sin tables of the [text ; target ; references] sequence for a target latent grid and the
        references' latent grids, on the devices (cached)."""
        def make():
            ids = np.concatenate([text_ids(self.max_sequence_length), image_ids(grid_h, grid_w),
                                  reference_ids(reference_grids)])
            cos, sin = rope_tables(ids, self.config.transformer.axes_dims_rope, self.config.transformer.rope_theta)
            rep = self.programs.replicated
            return jax.device_put(cos, rep), jax.device_put(sin, rep)

        return self._rope_cache.get_or_make((grid_h, grid_w, tuple(reference_grids)), make)

    def schedule(self, steps: int, grid_h: int, grid_w: int, sigmas=None):
        """Sigmas and timesteps for (steps, image tokens, custom sigmas), on the devices (cached)."""
        def make():
            s, t = sched.flow_match_schedule(self.config.scheduler, steps, grid_h * grid_w, sigmas)
            rep = self.programs.replicated
            return jax.device_put(s, rep), jax.device_put(t, rep)

        key = (steps, grid_h * grid_w, None if sigmas is None else tuple(float(s) for s in sigmas))
        return self._schedule_cache.get_or_make(key, make)

    # ------------------------------------------------------------------------------------------------ stages

    def check_inputs(self, prompts, seeds, height, width, num_inference_steps=None, guidance_scale=None,
                     num_images_per_prompt=1, reference_images=None, lora: str | None = None) -> GenerationInputs:
        """Validate a call by the request contract (model.contract) and resolve the checkpoint's defaults; one
        entry per image. Every prompt is checked up front: a bad one in a later batch would otherwise discard the
        batches computed before it. Reference images are preprocessed here (model.engine.reference_preprocess); with
        references a None height/width is the first reference's processed size, without them the contract's default."""
        if isinstance(prompts, str):
            raise RequestError("prompts must be a list of strings, not a single string", value=prompts)
        prompts, seeds = list(prompts), list(seeds)
        if len(prompts) != len(seeds):
            raise RequestError(f"got {len(prompts)} prompts but {len(seeds)} seeds", value=len(seeds))
        references = preprocess_all(reference_images, len(prompts), self.size_multiple)
        if references is not None and self.reference_encoder is None:
            raise RequestError("this generator was built without a VAE encoder: no reference images",
                               field="reference_images", value=len(references[0]))
        adapter = self.adapter_index(lora)
        first = references[0][0].size if references else (contract.DEFAULT_SIZE, contract.DEFAULT_SIZE)
        height = first[0] if height is None else height
        width = first[1] if width is None else width
        k = contract.validate_num_images(num_images_per_prompt, name="num_images_per_prompt")
        valid = [contract.validate(prompt=p, seed=s, height=height, width=width, num_inference_steps=num_inference_steps,
                                   guidance_scale=guidance_scale, num_images=k, limits=self.limits)
                 for p, s in zip(prompts, seeds)]
        if not valid:  # no prompt: the sizes and parameters are still checked
            contract.validate(prompt="", height=height, width=width, num_inference_steps=num_inference_steps,
                              guidance_scale=guidance_scale, limits=self.limits)
        sampling = resolve_sampling(self.config, num_inference_steps, guidance_scale)
        if sampling.guidance_scale > 1 and self.is_distilled:
            logger.warning("guidance_scale %.2f is ignored: the checkpoint is guidance-distilled",
                           sampling.guidance_scale)
        return GenerationInputs(prompts=tuple(v.prompt for v in valid for _ in range(k)),
                                seeds=tuple(v.seed + j for v in valid for j in range(k)),
                                height=int(height), width=int(width),
                                num_inference_steps=sampling.num_inference_steps,
                                guidance_scale=sampling.guidance_scale, use_cfg=sampling.use_cfg,
                                references=None if references is None else tuple(
                                    r for r in references for _ in range(k)), adapter=adapter)

    def prepare_bucket(self, inputs: GenerationInputs, sigmas=None, batch_size: int | None = None) -> PreparedBucket:
        """The bucket of a call's shape, its programs (compiled on first use), RoPE tables and schedule; the
        programs take `batch_size` images at once (None: the engine's batch, else the call's images)."""
        bucket = bucket_for(
            self.config, height=inputs.height, width=inputs.width,
            sampling=Sampling(inputs.num_inference_steps, inputs.guidance_scale, inputs.use_cfg),
            batch=batch_size or self.options.batch_size or len(inputs.prompts), data_replicas=data_replicas(self.mesh),
            reference_sizes=inputs.reference_sizes)
        tr = self.config.transformer
        encode_fn, denoise_fn, decode_fn = self.programs.programs(
            bucket, tr.in_channels, tr.joint_attention_dim, tr.attention_head_dim)
        ref_grids = tuple(self.latent_grid(h, w) for h, w in inputs.reference_sizes)
        cos, sin = self.rope(bucket.grid_h, bucket.grid_w, ref_grids)
        sig, ts = self.schedule(inputs.num_inference_steps, bucket.grid_h, bucket.grid_w, sigmas)
        return PreparedBucket(bucket, encode_fn, denoise_fn, decode_fn, cos, sin, sig, ts,
                              jnp.float32(inputs.guidance_scale))

    def padding(self, prepared: PreparedBucket, real: int) -> int:
        """Rows added to a short batch: none when the programs take any number of rows (image by image)."""
        return 0 if self.programs.any_batch else prepared.batch - real

    def tokenize(self, prompts: list[str], prepared: PreparedBucket):
        """(token ids, attention masks) of at most one batch of prompts on the devices, padded with empty prompts to
        the bucket's batch unless the programs take any number of rows, and whether each prompt was truncated."""
        pad = 0 if self.programs.any_batch else prepared.batch - len(prompts)
        tok = self.tokenizer(list(prompts) + [""] * pad)
        ids = jax.device_put(tok.input_ids, self.programs.batched)
        mask = jax.device_put(tok.attention_mask, self.programs.batched)
        return ids, mask, tuple(bool(t) for t in tok.truncated[:len(prompts)])

    def encode_tokens(self, ids, mask, prepared: PreparedBucket):
        """Text embeddings [B, L, J] of tokenized prompts (the bucket's encode program)."""
        return prepared.encode_fn(self.programs.te_state, ids, mask)

    def encode_prompts(self, prompts: list[str], prepared: PreparedBucket):
        """(text embeddings [len(prompts), L, J] on the devices, truncated flags per prompt); unique prompts encoded
        once (de-duplication), recent ones taken from the embedding cache."""
        batch = prepared.batch
        unique = list(dict.fromkeys(prompts))
        cache = self._embed_cache
        todo = [p for p in unique if cache is None or p not in cache]
        fresh = {}
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            ids, mask, truncated = self.tokenize(chunk, prepared)
            embeds = self.encode_tokens(ids, mask, prepared)
            for i, p in enumerate(chunk):
                fresh[p] = (embeds[i], truncated[i])
            self.stats["prompts_encoded"] += len(chunk)
        rows = []
        for p in prompts:
            if p in fresh:
                entry = fresh[p]
            else:
                entry = cache[p]  # now the most recently used
                self.stats["embed_cache_hits"] += 1
            rows.append(entry)
        if cache is not None:
            for p, entry in fresh.items():
                cache[p] = entry
        embeds = jax.device_put(jnp.stack([e for e, _ in rows]), self.programs.batched)
        return embeds, tuple(t for _, t in rows)

    def prepare_latents(self, seeds: list[int], prepared: PreparedBucket, pad: int = 0):
        """The initial noise of each image (model.initial_noise of its seed) as patchified latent tokens on the
        devices, plus `pad` zero rows."""
        tr, b = self.config.transformer, prepared.bucket
        shape = (tr.in_channels, b.grid_h, b.grid_w)
        noise = np.stack([initial_noise(s, shape) for s in seeds] + [np.zeros(shape, np.float32)] * pad)
        tokens = noise.reshape(len(seeds) + pad, tr.in_channels, b.grid_h * b.grid_w).transpose(0, 2, 1)
        return jax.device_put(tokens.astype(DTYPES[self.dtype]), self.programs.batched)

    def reference_tokens(self, references, prepared: PreparedBucket, pad: int = 0, cache: dict | None = None):
        """Latent tokens [rows, R, C] of each image's references (VAE encoder; equal references encoded once, and
        once per call when the call's `cache` dict is passed) on the devices, plus `pad` rows (copies of the
        first); None for text-to-image."""
        if not references:
            return None
        rows = list(references) + [references[0]] * pad
        before = self.reference_encoder.encoded
        tokens = self.reference_encoder.batch_tokens(rows, self.programs.batched, cache)
        self.stats["references_encoded"] += self.reference_encoder.encoded - before
        return tokens

    def denoise(self, latents, txt, neg, prepared: PreparedBucket, refs=None, adapter: int = 0):
        """Every denoising step, in one program (a lax.scan over the steps). `refs`: the reference tokens of
        image-conditioned calls (`reference_tokens`), else None; `adapter`: the unmerged LoRA adapter's bank entry
        (`adapter_index`; 0 = none)."""
        return prepared.denoise_fn(self.programs.tr_state, latents, txt, neg, refs, prepared.sigmas,
                                   prepared.timesteps, prepared.cos, prepared.sin, prepared.guidance,
                                   jnp.int32(adapter))

    def velocity(self, latents, txt, neg, prepared: PreparedBucket, step: int, refs=None):
        """The velocity the denoising loop takes at `step` from `latents` (for drift measures: benchmarks.drift)."""
        return self.programs.velocity(self.programs.tr_state, latents, txt, neg, refs, prepared.timesteps[step],
                                      prepared.cos, prepared.sin, prepared.guidance)

    def decode(self, latents, prepared: PreparedBucket) -> DecodedBatch:
        """Pixels on the devices, uint8 [B, H, W, 3], with each image's share of non-finite values
        (`DecodedBatch`)."""
        b = prepared.bucket
        return prepared.decode_fn(self.programs.vae_state, latents, b.grid_h, b.grid_w)

    def lower(self, prepared: PreparedBucket):
        """The bucket's (encode, denoise, decode) programs lowered for its shapes, not compiled (jax.stages.Lowered:
        HLO, XLA's cost analysis); denoise is the whole loop."""
        tr = self.config.transformer
        return self.programs.lower(prepared.bucket, tr.in_channels, tr.joint_attention_dim, tr.attention_head_dim)

    def to_host(self, decoded: DecodedBatch, real: int) -> np.ndarray:
        """The first `real` images as host uint8."""
        return np.asarray(jax.device_get(decoded.pixels))[:real]

    @staticmethod
    def nonfinite(decoded: DecodedBatch, real: int) -> list[NonFinite | None]:
        """Per image of the first `real`: where non-finite values appeared first (denoise, else decode) and their
        share of that stage's output, or None for a sound image."""
        latents, image = (np.asarray(jax.device_get(x))[:real] for x in (decoded.latents_nonfinite,
                                                                         decoded.image_nonfinite))
        return [NonFinite("denoise", float(lat)) if lat > 0 else NonFinite("decode", float(img)) if img > 0 else None
                for lat, img in zip(latents, image)]

    # ------------------------------------------------------------------------------------------------ generate

    def generate(self, prompts, seeds, height: int | None = None, width: int | None = None,
                 num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, num_images_per_prompt: int = 1, sigmas=None,
                 reference_images=None, lora: str | None = None) -> np.ndarray:
        """Images for `prompts` (image j of prompt i uses seed seeds[i] + j) as uint8 [N, H, W, 3]. Safe to call from
        several threads: calls run one after the other.

        `reference_images`: image-conditioned generation (klein's multi-reference editing, as diffusers'
        Flux2KleinPipeline(image=[...])): one list of references per prompt, each a PIL image or a uint8 HxWx3 /
        HxWx4 array; None or all lists empty = text-to-image. Every prompt's references must have the same processed
        sizes (`reference_signature`), else ReferenceImageError(reason="signature"). height/width None: the first
        reference's processed size with references, else contract.DEFAULT_SIZE. `lora`: the name of one of the
        unmerged adapters (`adapter_names`, loaded with lora_per_record) every image uses; None = the base model."""
        result = self.generate_result(prompts, seeds, height, width, num_inference_steps, guidance_scale,
                                      num_images_per_prompt, sigmas, reference_images, lora=lora)
        bad = {i: n for i, n in enumerate(result.nonfinite) if n is not None}
        if bad:
            raise NonFiniteImageError(bad)
        return result.images

    def generate_result(self, prompts, seeds, height: int | None = None, width: int | None = None,
                        num_inference_steps: int | None = None, guidance_scale: float | None = None,
                        num_images_per_prompt: int = 1, sigmas=None, reference_images=None,
                        batch_size: int | None = None, lora: str | None = None) -> GenerationResult:
        """`generate`, with the facts a caller reports beside the images: the resolved steps and guidance and
        whether each image's prompt was truncated (from the same tokenization that encoded it). `batch_size`: the
        images the programs of this call take at once, instead of the engine's (EngineOptions.batch_size): a
        smaller batch compiles programs of its own, e.g. after the engine's ran out of memory."""
        with self._generate_lock:
            start = time.perf_counter()
            inputs = self.check_inputs(prompts, seeds, height, width, num_inference_steps, guidance_scale,
                                       num_images_per_prompt, reference_images, lora)
            if batch_size is not None:
                contract.count("batch_size", batch_size)
            images, truncated, nonfinite, scores = self._run(inputs, sigmas, batch_size)
            return GenerationResult(images=images, prompt_truncated=truncated,
                                    num_inference_steps=inputs.num_inference_steps,
                                    guidance_scale=inputs.guidance_scale, model=self.model_id,
                                    seconds=time.perf_counter() - start, nonfinite=nonfinite, scores=scores)

    def _run(self, inputs: GenerationInputs, sigmas, batch_size: int | None = None):
        """(images, truncated, nonfinite, scores) of a checked call, in batches of the bucket's programs."""
        if not inputs.prompts:
            return np.zeros((0, inputs.height, inputs.width, 3), np.uint8), (), (), ()
        prepared = self.prepare_bucket(inputs, sigmas, batch_size)
        outputs: list[np.ndarray] = []
        nonfinite: list = []
        scores: list = []
        truncated: list[bool] = []
        pending = None
        reference_cache: dict = {}  # digest -> tokens: each distinct reference encoded once per call
        for start in range(0, len(inputs.prompts), prepared.batch):
            chunk_p = list(inputs.prompts[start:start + prepared.batch])
            chunk_s = list(inputs.seeds[start:start + prepared.batch])
            real = len(chunk_p)
            pad = self.padding(prepared, real)  # padding rows would be computed for nothing
            txt, flags = self.encode_prompts(chunk_p + chunk_p[:1] * pad, prepared)
            truncated.extend(flags[:real])
            neg = self.encode_prompts([""] * (real + pad), prepared)[0] if inputs.use_cfg else None
            # The noise is drawn on the host while the device runs the text encoder just dispatched.
            latents = self.prepare_latents(chunk_s, prepared, pad)
            refs = (self.reference_tokens(inputs.references[start:start + prepared.batch], prepared, pad,
                                          reference_cache)
                    if inputs.references else None)
            pixels = self.decode(self.denoise(latents, txt, neg, prepared, refs, inputs.adapter), prepared)
            # The scores are computed from the pixels where the decode left them (padding rows scored too).
            batch_scores = (self.scorer.score(pixels.pixels, chunk_p + chunk_p[:1] * pad)
                            if self.scorer is not None else None)
            # Dispatch is asynchronous: the previous batch's pixels are copied to the host (and the next batch
            # tokenized) while the device works on this one.
            if pending is not None:
                self._collect(pending, outputs, nonfinite, scores)
            pending = (pixels, real, batch_scores)
        if pending is not None:
            self._collect(pending, outputs, nonfinite, scores)
        self.stats["images"] += len(inputs.prompts)
        self.stats["images_nonfinite"] += sum(n is not None for n in nonfinite)
        return np.concatenate(outputs), tuple(truncated), tuple(nonfinite), tuple(scores)

    def _collect(self, pending, outputs: list, nonfinite: list, scores: list) -> None:
        """A finished batch's images, non-finite shares and scores, copied to the host."""
        pixels, real, batch_scores = pending
        outputs.append(self.to_host(pixels, real))
        nonfinite.extend(self.nonfinite(pixels, real))
        if batch_scores is not None:
            scores.extend(self.scorer.to_host(batch_scores, real))
