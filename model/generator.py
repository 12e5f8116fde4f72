"""`load()` a diffusers-layout FLUX.2 [klein] checkpoint and `generate()` images from prompts and seeds."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import scheduler as sched
from .config import PipelineConfig
from .engine import Bucket, CompiledPrograms, EngineOptions, enable_compilation_cache, make_mesh
from .errors import CheckpointError, ConfigError, RequestError
from .lru import LRUCache
from .noise import initial_noise, is_integer, validate_seed
from .qwen3 import Qwen3TextEncoder
from .tokenizer import PromptTokenizer
from .transformer import Flux2Transformer, image_ids, rope_tables, text_ids
from .vae import Flux2VAEDecoder
from .weight_files import validate_variant
from .weights import expected_tensors, load_component, validate_component

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT_TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def nearest_valid_sizes(value: int, multiple: int) -> tuple[int, ...]:
    low = (value // multiple) * multiple
    return tuple(v for v in (low, low + multiple) if v > 0)


def validate_size(name: str, value, multiple: int) -> int:
    """A height/width must be a positive multiple of `multiple`; otherwise RequestError naming value and fixes."""
    if not is_integer(value) or value <= 0 or value % multiple:
        if is_integer(value) and value > 0:
            hint = f"; nearest valid sizes: {list(nearest_valid_sizes(int(value), multiple))}"
        else:
            hint = f"; use a positive multiple of {multiple} such as {multiple * 64}"
        raise RequestError(f"{name} must be a positive multiple of {multiple}, got {value!r}{hint}", value=value)
    return int(value)


def _abstract(factory):
    return nnx.eval_shape(factory)


def load(path_or_uri: str, dtype: str = "bfloat16", *, max_sequence_length: int = 512, batch_size: int | None = None,
         text_encoder_out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS, options: EngineOptions | None = None,
         cache_dir: str | None = None, variant: str | None = None, **option_overrides) -> "Flux2KleinGenerator":
    """Load a checkpoint (local folder or gs:// URI, diffusers layout) in `dtype` and prepare it for generation.

    `variant`: which weight files, as diffusers' `from_pretrained(variant=...)` (e.g. "fp16" for
    `*.fp16.safetensors`); None takes the files without a variant, or a component's only variant when it has no
    others. The weights are cast to `dtype` whatever the files hold."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    validate_variant(variant)
    options = options or EngineOptions()
    if batch_size is not None:
        option_overrides["batch_size"] = batch_size
    options = dataclasses.replace(options, **option_overrides)
    enable_compilation_cache(options.compilation_cache_dir)
    root = str(path_or_uri)
    if root.startswith("gs://"):
        from .checkpoint import resolve_checkpoint

        root = resolve_checkpoint(root, cache_dir=cache_dir, variant=variant)
    elif not os.path.isdir(root):
        raise CheckpointError("checkpoint folder does not exist", path=root)
    start = time.perf_counter()
    config = PipelineConfig.from_folder(root)
    jdtype = DTYPES[dtype]
    out_layers = tuple(int(k) for k in text_encoder_out_layers)
    te_cfg, tr_cfg, vae_cfg = config.text_encoder, config.transformer, config.vae
    if len(out_layers) * te_cfg.hidden_size != tr_cfg.joint_attention_dim:
        raise ConfigError(f"{len(out_layers)} text-encoder hidden states of width {te_cfg.hidden_size} do not match "
                          f"the transformer's joint_attention_dim", path=os.path.join(root, "transformer",
                                                                                       "config.json"),
                          key="joint_attention_dim", value=tr_cfg.joint_attention_dim)
    tokenizer = PromptTokenizer(os.path.join(root, "tokenizer"), max_sequence_length)
    if len(tokenizer.tokenizer) > te_cfg.vocab_size:  # an id past the embedding table would read NaN: black images
        raise CheckpointError(f"the tokenizer has {len(tokenizer.tokenizer)} tokens but the text encoder's embedding "
                              f"table only {te_cfg.vocab_size} rows (vocab_size): tokenizer and text encoder do not "
                              f"belong together", path=os.path.join(root, "tokenizer"))
    rngs = lambda: nnx.Rngs(0)  # noqa: E731  (abstract init only; values come from the checkpoint)

    full_te = _abstract(lambda: Qwen3TextEncoder(te_cfg, out_layers, full_depth=True, dtype=jdtype, rngs=rngs()))
    run_te = _abstract(lambda: Qwen3TextEncoder(te_cfg, out_layers, full_depth=not options.truncated_encoder
                                                or options.reference, dtype=jdtype, rngs=rngs()))
    transformer_abs = _abstract(lambda: Flux2Transformer(tr_cfg, dtype=jdtype, rngs=rngs()))
    full_vae = _abstract(lambda: Flux2VAEDecoder(vae_cfg, with_encoder=True, dtype=jdtype, rngs=rngs()))
    run_vae = _abstract(lambda: Flux2VAEDecoder(vae_cfg, dtype=jdtype, rngs=rngs()))
    lm_head = {"lm_head.weight": (te_cfg.vocab_size, te_cfg.hidden_size)}
    bn_count = {"bn.num_batches_tracked": ()}
    components = [  # (folder, module to fill, every tensor a complete checkpoint holds, tensors that may be absent)
        ("text_encoder", run_te, expected_tensors(full_te, lm_head), lm_head),
        ("transformer", transformer_abs, expected_tensors(transformer_abs), {}),
        ("vae", run_vae, expected_tensors(full_vae, bn_count), bn_count),
    ]
    # Validate every component's files, names, shapes and dtypes (headers only) before reading any weight, so a
    # broken shard anywhere fails in seconds, not after minutes of loading the components before it.
    files = [validate_component(os.path.join(root, name), expected=exp, optional=opt, variant=variant)
             for name, _, exp, opt in components]
    text_encoder, transformer, vae = (
        load_component(os.path.join(root, name), module, expected=exp, optional=opt, tensor_to_file=f)
        for (name, module, exp, opt), f in zip(components, files))
    logger.info("loaded %s (%s) in %.1f s", path_or_uri, dtype, time.perf_counter() - start)
    return Flux2KleinGenerator(config, tokenizer, text_encoder, transformer, vae, dtype=dtype, options=options,
                               model_id=str(path_or_uri), root=root)


class Flux2KleinGenerator:
    """A loaded FLUX.2 [klein] model: text encoder, transformer, VAE decoder, scheduler and tokenizer."""

    def __init__(self, config: PipelineConfig, tokenizer: PromptTokenizer, text_encoder, transformer, vae, *,
                 dtype: str, options: EngineOptions, model_id: str, root: str):
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.options = options
        self.model_id = model_id
        self.root = root
        self.max_sequence_length = tokenizer.max_length
        self.is_distilled = config.is_distilled
        self.default_num_inference_steps = 4 if config.is_distilled else 50
        self.default_guidance_scale = 1.0 if config.is_distilled else 4.0
        self.size_multiple = config.size_multiple
        from .attention import resolve_implementation

        self.mesh = make_mesh(options)
        devices = self.mesh.devices.size
        self.programs = CompiledPrograms(
            text_encoder, transformer, vae, dtype=DTYPES[dtype], options=options, text_len=tokenizer.max_length,
            attention=resolve_implementation(options.attention, devices=devices),
            text_attention=resolve_implementation(options.text_encoder_attention, masked=True, devices=devices),
            mesh=self.mesh)
        self._embed_cache: LRUCache | None = (
            LRUCache(options.embed_cache_size, "text embeddings", log_drops=False) if options.embed_cache_size > 0
            else None)
        self._rope_cache: LRUCache = LRUCache(options.max_buckets, "RoPE tables")
        self._schedule_cache: LRUCache = LRUCache(options.max_buckets, "schedules")
        self.stats = collections.Counter()
        # generate() calls are serialised: they share the embedding cache and the device (which runs one at a time).
        self._generate_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------------ helpers

    def prompt_truncated(self, prompts: list[str]) -> list[bool]:
        """Whether each prompt is longer than max_sequence_length tokens (it will be truncated, never rejected)."""
        return list(self.tokenizer(list(prompts)).truncated)

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        return height // self.size_multiple, width // self.size_multiple

    def noise_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """Shape of `model.initial_noise` for one image: (in_channels, height // 16, width // 16)."""
        gh, gw = self.latent_grid(height, width)
        return (self.config.transformer.in_channels, gh, gw)

    def _rope(self, grid_h, grid_w):
        """RoPE cos/sin tables of the [text ; image] sequence for a latent grid, on the devices (cached)."""
        def make():
            ids = np.concatenate([text_ids(self.max_sequence_length), image_ids(grid_h, grid_w)])
            cos, sin = rope_tables(ids, self.config.transformer.axes_dims_rope, self.config.transformer.rope_theta)
            rep = self.programs.replicated
            return jax.device_put(cos, rep), jax.device_put(sin, rep)

        return self._rope_cache.get((grid_h, grid_w), make)

    def _schedule(self, steps, grid_h, grid_w, sigmas):
        """Sigmas and timesteps for (steps, image tokens, custom sigmas), on the devices (cached)."""
        def make():
            s, t = sched.flow_match_schedule(self.config.scheduler, steps, grid_h * grid_w, sigmas)
            rep = self.programs.replicated
            return jax.device_put(s, rep), jax.device_put(t, rep)

        key = (steps, grid_h * grid_w, None if sigmas is None else tuple(float(s) for s in sigmas))
        return self._schedule_cache.get(key, make)

    def _encode(self, prompts: list[str], batch: int, encode_fn):
        """Text embeddings [len(prompts), L, J] on device; unique prompts encoded once, recent ones cached."""
        opts = self.options
        unique = list(dict.fromkeys(prompts)) if opts.dedupe_prompts else list(prompts)
        cache = self._embed_cache
        todo = [p for p in unique if cache is None or p not in cache]  # `unique` is de-duplicated only if asked
        fresh = {}
        tokenizer = self.tokenizer if not opts.reference else PromptTokenizer(
            os.path.join(self.root, "tokenizer"), self.max_sequence_length)
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            tok = tokenizer(chunk if self.programs.any_batch else chunk + [""] * (batch - len(chunk)))
            ids = jax.device_put(tok.input_ids, self.programs.batched)
            mask = jax.device_put(tok.attention_mask, self.programs.batched)
            embeds = encode_fn(self.programs.te_state, ids, mask)
            for i, p in enumerate(chunk):
                fresh[p] = embeds[i]
            self.stats["prompts_encoded"] += len(chunk)
        rows = []
        for p in prompts:
            if p in fresh:
                e = fresh[p]
            else:
                e = cache[p]  # now the most recently used
                self.stats["embed_cache_hits"] += 1
            rows.append(e)
        if cache is not None:
            for p, e in fresh.items():
                cache.put(p, e)
        return jax.device_put(jnp.stack(rows), self.programs.batched)

    # ------------------------------------------------------------------------------------------------ generate

    def generate(self, prompts, seeds, height: int = 1024, width: int = 1024, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, num_images_per_prompt: int = 1, sigmas=None) -> np.ndarray:
        """Images for `prompts` (image j of prompt i uses seed seeds[i] + j) as uint8 [N, H, W, 3]. Safe to call from
        several threads: calls run one after the other."""
        with self._generate_lock:
            return self._generate(prompts, seeds, height, width, num_inference_steps, guidance_scale,
                                  num_images_per_prompt, sigmas)

    def _generate(self, prompts, seeds, height, width, num_inference_steps, guidance_scale, num_images_per_prompt,
                  sigmas) -> np.ndarray:
        if isinstance(prompts, str):
            raise RequestError("prompts must be a list of strings, not a single string", value=prompts)
        prompts, seeds = list(prompts), list(seeds)
        for p in prompts:
            if not isinstance(p, str):
                raise RequestError(f"every prompt must be a string, got {type(p).__name__}", value=p)
            try:  # checked up front: a bad prompt in a later batch would otherwise discard the batches before it
                p.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"prompt is not valid Unicode text: lone surrogate U+{ord(p[e.start]):04X} at "
                                   f"character {e.start}", value=p) from None
        if len(prompts) != len(seeds):
            raise RequestError(f"got {len(prompts)} prompts but {len(seeds)} seeds", value=len(seeds))
        if not is_integer(num_images_per_prompt) or num_images_per_prompt < 1:
            raise RequestError(f"num_images_per_prompt must be an integer >= 1, got {num_images_per_prompt!r}",
                               value=num_images_per_prompt)
        seeds = [validate_seed(s) for s in seeds]
        height = validate_size("height", height, self.size_multiple)
        width = validate_size("width", width, self.size_multiple)
        steps = self.default_num_inference_steps if num_inference_steps is None else num_inference_steps
        if not is_integer(steps) or steps < 1:
            raise RequestError(f"num_inference_steps must be an integer >= 1, got {steps!r}", value=steps)
        guidance = self.default_guidance_scale if guidance_scale is None else guidance_scale
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float, np.integer, np.floating)):
            raise RequestError(f"guidance_scale must be a number, got {guidance_scale!r}", value=guidance_scale)
        guidance = float(guidance)
        # The programs take it as float32: a larger value would become infinity there (and black images).
        if not np.isfinite(guidance) or abs(guidance) > FLOAT32_MAX:
            raise RequestError(f"guidance_scale must be a finite float32 number (|value| <= {FLOAT32_MAX:.7g}), got "
                               f"{guidance_scale!r}", value=guidance_scale)
        if guidance > 1 and self.is_distilled:
            logger.warning("guidance_scale %.2f is ignored: the checkpoint is guidance-distilled", guidance)
        use_cfg = guidance > 1 and not self.is_distilled
        k = int(num_images_per_prompt)
        image_prompts = [p for p in prompts for _ in range(k)]
        image_seeds = [s + j for s in seeds for j in range(k)]
        for s in image_seeds:
            validate_seed(s)
        if not image_prompts:
            return np.zeros((0, height, width, 3), np.uint8)
        grid_h, grid_w = self.latent_grid(height, width)
        n_dev = self.mesh.devices.size
        batch = self.options.batch_size or len(image_prompts)
        if not self.options.context_parallel:
            batch = -(-batch // n_dev) * n_dev  # a multiple of the device count
        bucket = Bucket(batch, grid_h, grid_w, int(steps), use_cfg)
        tr = self.config.transformer
        encode_fn, denoise_fn, decode_fn = self.programs.programs(
            bucket, tr.in_channels, tr.joint_attention_dim, tr.attention_head_dim)
        cos, sin = self._rope(grid_h, grid_w)
        sig, ts = self._schedule(int(steps), grid_h, grid_w, sigmas)
        gscale = jnp.float32(guidance)
        dtype = DTYPES[self.dtype]

        outputs: list[np.ndarray] = []
        pending = None
        for start in range(0, len(image_prompts), batch):
            chunk_p = image_prompts[start:start + batch]
            chunk_s = image_seeds[start:start + batch]
            real = len(chunk_p)
            pad = 0 if self.programs.any_batch else batch - real  # padding rows would be computed for nothing
            noise = np.stack([initial_noise(s, (tr.in_channels, grid_h, grid_w)) for s in chunk_s]
                             + [np.zeros((tr.in_channels, grid_h, grid_w), np.float32)] * pad)
            tokens = noise.reshape(real + pad, tr.in_channels, grid_h * grid_w).transpose(0, 2, 1)
            latents = jax.device_put(tokens.astype(dtype), self.programs.latents_sharding(grid_h * grid_w))
            txt = self._encode(chunk_p + chunk_p[:1] * pad, batch, encode_fn)
            neg = self._encode([""] * (real + pad), batch, encode_fn) if use_cfg else None
            if self.options.fused_loop and not self.options.reference:
                latents = denoise_fn(self.programs.tr_state, latents, txt, neg, sig, ts, cos, sin, gscale)
            else:
                sig_host, ts_host = np.asarray(sig), np.asarray(ts)
                for i in range(int(steps)):  # one dispatch per step, the naive path kept for comparison
                    latents = denoise_fn(self.programs.tr_state, latents, txt, neg, sig_host[i], sig_host[i + 1],
                                         ts_host[i], cos, sin, gscale)
            pixels = decode_fn(self.programs.vae_state, latents, grid_h, grid_w, self.options.device_uint8)
            # Dispatch is asynchronous: with overlap on, the previous batch's pixels are copied to the host (and
            # the next batch tokenized) while the device works on this one.
            if pending is not None:
                outputs.append(self._to_host(*pending))
            pending = (pixels, real)
            if not self.options.overlap_host:
                outputs.append(self._to_host(*pending))
                pending = None
        if pending is not None:
            outputs.append(self._to_host(*pending))
        self.stats["images"] += len(image_prompts)
        return np.concatenate(outputs)

    def _to_host(self, pixels, real: int) -> np.ndarray:
        host = np.asarray(jax.device_get(pixels))[:real]
        if host.dtype != np.uint8:  # reference path: convert on the host like diffusers' postprocess
            host = np.round(np.clip(host / 2 + 0.5, 0.0, 1.0) * 255.0).astype(np.uint8)
        return host
