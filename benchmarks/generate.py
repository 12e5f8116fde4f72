"""End-to-end generation benchmark: optimised path vs reference path vs diffusers, plus an ablation of every switch.

    python -m benchmarks.generate --preset small --height 256 --width 256 --batch 1,4

In one process and on the same random weights and the same noise (`model.initial_noise`), for each batch size:

1. the optimised path (`EngineOptions()`), its compile time with an empty persistent compilation cache (cold) and
   again from a fresh generator over the same cache folder (warm);
2. the reference path (`EngineOptions.reference_mode()`);
3. diffusers' `Flux2KleinPipeline` on PyTorch (same dtype, `latents=` the same noise), unless --skip-diffusers.

Each is warmed up, then the repetitions are interleaved (optimised, reference, diffusers, optimised, ...) so that a
change in machine load hits all of them alike; the median is reported. Every repetition uses new prompts, so the
optimised path's embedding cache never helps the headline numbers (the ablation measures it separately).

End-to-end numbers come from the public API (`gen.generate`, `pipe(...)`) plus PNG encoding of every image. The
per-stage split (tokenize, encode, denoise, decode, device-to-host, host uint8 conversion, PNG) comes from separate
staged runs that call each engine's compiled programs / sub-models one stage at a time and wait after each.

MFU = analytic model FLOPs per image (benchmarks/flops.py: the encoder layers actually run, transformer blocks x
steps x (2 with CFG), VAE decoder convs) / seconds per image (excluding PNG saving) / the matmul rate measured in
this run (best of several square `jnp.dot`s in the benchmark dtype).

Writes <out>/<preset>-<H>x<W>-<dtype>-b<batches>.json and .md, the compared PNGs under <out>/images/, and prints as
its last line one JSON object with the headline numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import logging
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

logger = logging.getLogger("benchmarks.generate")

BASE_PROMPTS = [
    "A small cactus with a happy face in the Sahara desert at sunset",
    "A photograph of a red fox sitting in the snow, soft morning light",
    "An astronaut riding a horse on the moon, highly detailed digital art",
    "A cozy wooden cabin in a pine forest beside a quiet lake",
    "A watercolor painting of a lighthouse on a rocky coast",
    "A cat wearing a tiny hat and reading a book by the window",
    "The city skyline at night with neon signs reflected in the wet street",
    "A bowl of fresh fruit on a kitchen table, studio photo",
]

STAGES = ("tokenize", "encode", "denoise", "decode", "d2h", "host_uint8", "png")

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def prompts_for(run: int, n: int) -> list[str]:
    """n distinct prompts for run number `run` (different in every run, identical across engines)."""
    return [f"{BASE_PROMPTS[(run + i) % len(BASE_PROMPTS)]}, take {run}-{i}" for i in range(n)]


def seeds_for(run: int, n: int) -> list[int]:
    return [1000 * run + i for i in range(n)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def current_rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        return float("nan")


def save_pngs(images: np.ndarray, folder: str | None) -> float:
    """Encode every image as PNG (into `folder` when given, else in memory); seconds taken."""
    from PIL import Image

    start = time.perf_counter()
    for i, img in enumerate(images):
        if folder:
            Image.fromarray(img).save(os.path.join(folder, f"{i:02d}.png"), format="PNG")
        else:
            Image.fromarray(img).save(io.BytesIO(), format="PNG")
    return time.perf_counter() - start


class CompileCounter:
    """Counts JAX backend compilations (and persistent-cache hits/misses) through jax.monitoring listeners."""

    def __init__(self):
        import jax.monitoring as monitoring

        self.compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0
        self.cache_misses = 0

        def on_duration(event, duration, **kw):
            if event == BACKEND_COMPILE_EVENT:
                self.compiles += 1
                self.compile_seconds += duration

        def on_event(event, **kw):
            if event == "/jax/compilation_cache/cache_hits":
                self.cache_hits += 1
            elif event == "/jax/compilation_cache/cache_misses":
                self.cache_misses += 1

        monitoring.register_event_duration_secs_listener(on_duration)
        monitoring.register_event_listener(on_event)

    def snapshot(self) -> dict:
        return {"compiles": self.compiles, "compile_seconds": self.compile_seconds, "cache_hits": self.cache_hits,
                "cache_misses": self.cache_misses}

    def since(self, snap: dict) -> dict:
        now = self.snapshot()
        return {k: now[k] - snap[k] for k in now}


def measure_matmul_peak(dtype: str, repeats: int = 5) -> dict:
    """FLOP/s of the best of `repeats` square jnp.dot calls (size 2048 on CPU, 8192 on accelerators)."""
    import jax
    import jax.numpy as jnp

    n = 2048 if jax.default_backend() == "cpu" else 8192
    jdt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    a = jax.random.normal(jax.random.key(0), (n, n), jdt)
    b = jax.random.normal(jax.random.key(1), (n, n), jdt)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jdt))
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    flops = 2.0 * n ** 3
    return {"n": n, "dtype": dtype, "best_flops_per_s": flops / min(times),
            "median_flops_per_s": flops / statistics.median(times)}


# ------------------------------------------------------------------------------------------------------ engines


class JaxEngine:
    """A loaded model.Flux2KleinGenerator: end-to-end runs through `generate`, staged runs through its programs."""

    def __init__(self, name: str, gen):
        self.name = name
        self.gen = gen

    def generate(self, prompts, seeds, h, w, steps, guidance, images_per_prompt=1) -> np.ndarray:
        return self.gen.generate(prompts, seeds, height=h, width=w, num_inference_steps=steps,
                                 guidance_scale=guidance, num_images_per_prompt=images_per_prompt)

    def _batch(self, n: int) -> int:
        """The compiled batch size `generate` uses for n images (mirrors Flux2KleinGenerator.generate)."""
        gen = self.gen
        batch = gen.options.batch_size or n
        if not getattr(gen.options, "context_parallel", False):
            n_dev = gen.mesh.devices.size
            batch = -(-batch // n_dev) * n_dev
        return batch

    def programs(self, n: int, h: int, w: int, steps: int, use_cfg: bool):
        from model.engine import Bucket

        gen = self.gen
        tr = gen.config.transformer
        gh, gw = gen.latent_grid(h, w)
        bucket = Bucket(self._batch(n), gh, gw, int(steps), use_cfg)
        return gen.programs.programs(bucket, tr.in_channels, tr.joint_attention_dim, tr.attention_head_dim)

    def staged(self, prompts, seeds, h, w, steps, guidance) -> tuple[np.ndarray, dict]:
        """One batch through tokenize / encode / denoise / decode / d2h / host uint8, timed stage by stage."""
        import jax
        import jax.numpy as jnp

        from model.generator import DTYPES
        from model.noise import initial_noise
        from model.tokenizer import PromptTokenizer

        gen, opts, progs = self.gen, self.gen.options, self.gen.programs
        tr = gen.config.transformer
        gh, gw = gen.latent_grid(h, w)
        n = len(prompts)
        batch = self._batch(n)
        if n > batch:
            raise ValueError("staged runs take at most one compiled batch")
        pad = batch - n
        use_cfg = guidance > 1 and not gen.is_distilled
        encode_fn, denoise_fn, decode_fn = self.programs(n, h, w, steps, use_cfg)
        cos, sin = gen._rope(gh, gw)
        sig, ts = gen._schedule(int(steps), gh, gw, None)
        gscale = jnp.float32(guidance)
        dtype = DTYPES[gen.dtype]
        lat_sharding = (progs.latents_sharding(gh * gw) if hasattr(progs, "latents_sharding") else progs.batched)
        t = {}

        start = time.perf_counter()
        tokenizer = gen.tokenizer if not opts.reference else PromptTokenizer(
            os.path.join(gen.root, "tokenizer"), gen.max_sequence_length)
        tok = tokenizer(list(prompts) + list(prompts[:1]) * pad)
        ids = jax.device_put(tok.input_ids, progs.batched)
        mask = jax.device_put(tok.attention_mask, progs.batched)
        if use_cfg:
            ntok = tokenizer([""] * batch)
            nids = jax.device_put(ntok.input_ids, progs.batched)
            nmask = jax.device_put(ntok.attention_mask, progs.batched)
        noise = np.stack([initial_noise(s, (tr.in_channels, gh, gw)) for s in seeds]
                         + [np.zeros((tr.in_channels, gh, gw), np.float32)] * pad)
        latents = jax.device_put(noise.reshape(batch, tr.in_channels, gh * gw).transpose(0, 2, 1).astype(dtype),
                                 lat_sharding)
        jax.block_until_ready((ids, mask, latents))
        t["tokenize"] = time.perf_counter() - start

        start = time.perf_counter()
        txt = encode_fn(progs.te_state, ids, mask)
        neg = encode_fn(progs.te_state, nids, nmask) if use_cfg else None
        jax.block_until_ready((txt, neg))
        t["encode"] = time.perf_counter() - start

        start = time.perf_counter()
        if opts.fused_loop and not opts.reference:
            latents = denoise_fn(progs.tr_state, latents, txt, neg, sig, ts, cos, sin, gscale)
        else:
            for i in range(int(steps)):
                latents = progs._single_step(progs.tr_state, latents, txt, neg, sig[i], sig[i + 1], ts[i], cos, sin,
                                             gscale)
        jax.block_until_ready(latents)
        t["denoise"] = time.perf_counter() - start

        start = time.perf_counter()
        pixels = decode_fn(progs.vae_state, latents, gh, gw, opts.device_uint8)
        jax.block_until_ready(pixels)
        t["decode"] = time.perf_counter() - start

        start = time.perf_counter()
        host = np.asarray(jax.device_get(pixels))[:n]
        t["d2h"] = time.perf_counter() - start

        start = time.perf_counter()
        if host.dtype != np.uint8:
            host = np.round(np.clip(host / 2 + 0.5, 0.0, 1.0) * 255.0).astype(np.uint8)
        t["host_uint8"] = time.perf_counter() - start
        return host, t

    def xla_flops(self, n, h, w, steps, use_cfg) -> dict:
        """XLA's own FLOP counts of the encoder, one transformer step and the decoder (HLO cost analysis)."""
        import jax
        import jax.numpy as jnp

        from model.engine import per_image_for
        from model.generator import DTYPES

        gen, progs = self.gen, self.gen.programs
        tr = gen.config.transformer
        gh, gw = gen.latent_grid(h, w)
        # XLA counts a loop body once, so image-by-image programs (a lax.map over the batch) are counted on one image.
        batch = 1 if per_image_for(progs.mesh, gen.options) else self._batch(n)
        dtype = DTYPES[gen.dtype]
        out = {}

        def flops(lowered):
            cost = lowered.cost_analysis()
            if isinstance(cost, (list, tuple)):
                cost = cost[0]
            return float(cost.get("flops", float("nan"))) / batch

        ids = jax.ShapeDtypeStruct((batch, gen.max_sequence_length), jnp.int32)
        out["encode"] = flops(progs._encode.lower(progs.te_state, ids, ids))
        lat = jax.ShapeDtypeStruct((batch, gh * gw, tr.in_channels), dtype)
        txt = jax.ShapeDtypeStruct((batch, gen.max_sequence_length, tr.joint_attention_dim), dtype)
        seq = gen.max_sequence_length + gh * gw
        f32 = jnp.float32
        tab = jax.ShapeDtypeStruct((seq, tr.attention_head_dim), f32)
        sc = jax.ShapeDtypeStruct((), f32)
        step = flops(progs._single_step.lower(progs.tr_state, lat, txt, txt if use_cfg else None, sc, sc, sc, tab,
                                              tab, sc))
        out["denoise"] = step * steps
        out["decode"] = flops(progs._decode.lower(progs.vae_state, lat, gh, gw, gen.options.device_uint8))
        out["total"] = out["encode"] + out["denoise"] + out["decode"]
        return out


class DiffusersEngine:
    """diffusers' Flux2KleinPipeline on PyTorch, fed the same noise through `latents=`."""

    name = "diffusers"

    def __init__(self, path: str, dtype: str, max_sequence_length: int):
        import torch
        from diffusers import Flux2KleinPipeline

        self.torch = torch
        self.tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.pipe = Flux2KleinPipeline.from_pretrained(path, torch_dtype=self.tdtype).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self.max_sequence_length = max_sequence_length

    def _latents(self, seeds, h, w):
        from model.noise import initial_noise

        c = self.pipe.transformer.config.in_channels
        s = self.pipe.vae_scale_factor * 2
        noise = np.stack([initial_noise(seed, (c, h // s, w // s)) for seed in seeds])
        return self.torch.from_numpy(noise).to(self.device, self.tdtype)

    def _sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    @staticmethod
    def _to_uint8(images) -> np.ndarray:
        return (np.asarray(images) * 255).round().astype(np.uint8)  # diffusers' numpy_to_pil conversion

    def generate(self, prompts, seeds, h, w, steps, guidance, images_per_prompt=1) -> np.ndarray:
        seeds = [s + j for s in seeds for j in range(images_per_prompt)]
        with self.torch.inference_mode():
            out = self.pipe(prompt=list(prompts), latents=self._latents(seeds, h, w), height=h, width=w,
                            num_inference_steps=steps, guidance_scale=guidance, output_type="np",
                            num_images_per_prompt=images_per_prompt, max_sequence_length=self.max_sequence_length)
        return self._to_uint8(out.images)

    def staged(self, prompts, seeds, h, w, steps, guidance) -> tuple[np.ndarray, dict]:
        torch, pipe = self.torch, self.pipe
        t = {}
        use_cfg = guidance > 1 and not pipe.config.is_distilled
        with torch.inference_mode():
            start = time.perf_counter()
            texts = list(prompts) + ([""] * len(prompts) if use_cfg else [])
            ids, masks = [], []
            for p in texts:  # exactly as Flux2KleinPipeline._get_qwen3_prompt_embeds
                text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                          add_generation_prompt=True, enable_thinking=False)
                enc = pipe.tokenizer(text, return_tensors="pt", padding="max_length", truncation=True,
                                     max_length=self.max_sequence_length)
                ids.append(enc["input_ids"])
                masks.append(enc["attention_mask"])
            ids = torch.cat(ids).to(self.device)
            masks = torch.cat(masks).to(self.device)
            latents = self._latents(seeds, h, w)
            self._sync()
            t["tokenize"] = time.perf_counter() - start

            start = time.perf_counter()
            out = pipe.text_encoder(input_ids=ids, attention_mask=masks, output_hidden_states=True, use_cache=False)
            emb = torch.stack([out.hidden_states[k] for k in (9, 18, 27)], dim=1).to(self.tdtype)
            b, c, length, d = emb.shape
            emb = emb.permute(0, 2, 1, 3).reshape(b, length, c * d)
            pos, neg = (emb[:len(prompts)], emb[len(prompts):]) if use_cfg else (emb, None)
            self._sync()
            t["encode"] = time.perf_counter() - start

            start = time.perf_counter()
            lat = pipe(prompt_embeds=pos, negative_prompt_embeds=neg, latents=latents, height=h, width=w,
                       num_inference_steps=steps, guidance_scale=guidance, output_type="latent").images
            self._sync()
            t["denoise"] = time.perf_counter() - start

            start = time.perf_counter()
            image = pipe.vae.decode(lat.to(pipe.vae.dtype), return_dict=False)[0]
            self._sync()
            t["decode"] = time.perf_counter() - start

            start = time.perf_counter()
            image = image.cpu()
            t["d2h"] = time.perf_counter() - start

            start = time.perf_counter()
            host = self._to_uint8(pipe.image_processor.postprocess(image, output_type="np"))
            t["host_uint8"] = time.perf_counter() - start
        return host, t


# ------------------------------------------------------------------------------------------------------ runs


@dataclasses.dataclass
class Workload:
    height: int
    width: int
    steps: int
    guidance: float
    batch: int


def run_e2e(engine, run: int, wl: Workload, png_dir: str | None) -> tuple[np.ndarray, dict]:
    """One end-to-end call of `wl.batch` new prompts; wall, process-CPU and PNG seconds."""
    prompts, seeds = prompts_for(run, wl.batch), seeds_for(run, wl.batch)
    cpu, wall = time.process_time(), time.perf_counter()
    images = engine.generate(prompts, seeds, wl.height, wl.width, wl.steps, wl.guidance)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    png = save_pngs(images, png_dir)
    return images, {"generate_s": wall, "cpu_s": cpu, "png_s": png}


def run_staged(engine, run: int, wl: Workload) -> dict:
    prompts, seeds = prompts_for(run, wl.batch), seeds_for(run, wl.batch)
    images, t = engine.staged(prompts, seeds, wl.height, wl.width, wl.steps, wl.guidance)
    t["png"] = save_pngs(images, None)
    return t


def summarise(e2e: list[dict], staged: list[dict], n: int) -> dict:
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    gen_s = med([r["generate_s"] for r in e2e])
    total_s = med([r["generate_s"] + r["png_s"] for r in e2e])
    out = {
        "ms_per_image": 1000 * total_s / n,
        "ms_per_image_excl_save": 1000 * gen_s / n,
        "images_per_s": n / total_s,
        "images_per_s_excl_save": n / gen_s,
        "cpu_ms_per_image": 1000 * med([r["cpu_s"] for r in e2e]) / n,
        "png_ms_per_image": 1000 * med([r["png_s"] for r in e2e]) / n,
        "repeats": len(e2e),
        "generate_s_runs": [round(r["generate_s"], 4) for r in e2e],
    }
    if staged:
        out["stages_ms_per_image"] = {k: 1000 * med([r[k] for r in staged]) / n for k in STAGES}
        out["stages_sum_ms_per_image"] = sum(out["stages_ms_per_image"].values())
    return out


def make_variant(base_gen, path: str, dtype: str, max_seq: int, options):
    """A generator with other EngineOptions; shares the base generator's weights when the encoder depth allows."""
    import model
    from model.generator import Flux2KleinGenerator

    same_depth = (options.truncated_encoder and not options.reference) == (
        base_gen.options.truncated_encoder and not base_gen.options.reference)
    if same_depth:
        try:
            te, tr, vae = base_gen.programs.modules()
            return Flux2KleinGenerator(base_gen.config, base_gen.tokenizer, te, tr, vae, dtype=base_gen.dtype,
                                       options=options, model_id=base_gen.model_id, root=base_gen.root)
        except Exception as e:  # the constructor changed: fall back to a full load
            logger.info("sharing weights failed (%s); loading again", e)
    return model.load(path, dtype, max_sequence_length=max_seq, options=options)


def ablation_variants(EngineOptions, batch: int, cache_dir: str | None) -> list[tuple[str, str, object]]:
    """(row name, what is switched off, options) for each optimisation off in turn, then everything off."""
    base = EngineOptions(batch_size=batch, compilation_cache_dir=cache_dir)
    known = {
        "fused_loop": ("Python step loop (one program per step)", dict(fused_loop=False)),
        "truncated_encoder": ("full-depth text encoder", dict(truncated_encoder=False)),
        "device_uint8": ("float pixels to host, uint8 on host", dict(device_uint8=False)),
        "dedupe_prompts": ("no prompt de-duplication", dict(dedupe_prompts=False)),
        "embed_cache_size": ("no embedding cache", dict(embed_cache_size=0)),
        "aot_compile": ("jit on first call instead of AOT", dict(aot_compile=False)),
        "overlap_host": ("no host/device overlap", dict(overlap_host=False)),
        "attention": ("transformer attention 'dot'", dict(attention="dot")),
        "text_encoder_attention": ("text encoder attention 'xla'", dict(text_encoder_attention="xla")),
        "data_parallel": ("one device only", dict(data_parallel=False)),
        "cpu_compiler_options": ("XLA:CPU defaults in every program (YNNPACK dots/convs)",
                                 dict(cpu_compiler_options=())),
        "per_image": ("batched programs (not image by image)", dict(per_image=False)),
        "concurrent_images": ("a batch's images one after the other (lax.map)", dict(concurrent_images=1)),
        "image_only_last_block": ("last block computes text tokens too", dict(image_only_last_block=False)),
        "fused_upsample": ("VAE upsamples, then a 3x3 conv at the high resolution", dict(fused_upsample=False)),
    }
    # Not rows: the persistent cache's effect is the cold/warm compile columns; batch_size is the workload;
    # max_buckets bounds memory over many sizes (one size here).
    skip = ("reference", "batch_size", "compilation_cache_dir", "max_buckets")
    rows = []
    for f in dataclasses.fields(EngineOptions):
        if f.name in skip:
            continue
        if f.name in known:
            what, change = known[f.name]
            rows.append((f"-{f.name}", what, dataclasses.replace(base, **change)))
        elif isinstance(f.default, bool) and f.default:
            rows.append((f"-{f.name}", f"{f.name}=False", dataclasses.replace(base, **{f.name: False})))
    from model.engine import EIGEN_DOTS, PROGRAMS

    eigen = tuple((p, EIGEN_DOTS) for p in PROGRAMS)
    rows.append(("-denoise_ynnpack", "Eigen dots in the transformer too (Eigen everywhere)",
                 dataclasses.replace(base, cpu_compiler_options=eigen)))
    rows.append(("reference", "everything off (reference mode)", EngineOptions.reference_mode(batch_size=batch)))
    return rows


@contextlib.contextmanager
def persistent_cache_disabled():
    """Turn JAX's persistent compilation cache off (so first calls really compile), then back on."""
    import jax
    from jax._src import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def run_ablation(base_gen, path, args, wl: Workload, cache_dir, counter) -> list[dict]:
    """Each optimisation off in turn: first-call time (compiling from scratch: no persistent cache), steady ms/img on
    new prompts, on repeated prompts (embedding cache), and with one prompt for the whole batch (de-duplication).
    Every variant is loaded first and the timed rounds are interleaved across variants."""
    from model.engine import EngineOptions

    base_opts = dataclasses.replace(base_gen.options, batch_size=wl.batch)
    rows = []
    for name, what, opts in [("optimised", "nothing (all optimisations on)", base_opts)] + ablation_variants(
            EngineOptions, wl.batch, cache_dir):
        start = time.perf_counter()
        gen = make_variant(base_gen, path, args.dtype, args.max_sequence_length, opts)
        rows.append({"variant": name, "switched_off": what, "gen": gen, "load_s": time.perf_counter() - start})
    run = 10_000
    with persistent_cache_disabled():
        for row in rows:  # first call: tokenizer, compile (AOT or jit) and one batch
            snap = counter.snapshot()
            start = time.perf_counter()
            row["gen"].generate(prompts_for(run, wl.batch), seeds_for(run, wl.batch), height=wl.height,
                                width=wl.width, num_inference_steps=wl.steps, guidance_scale=wl.guidance)
            row["first_call_s"] = time.perf_counter() - start
            row["compiles"] = counter.since(snap)
    times = {id(r): {"new": [], "cached": [], "one_prompt": []} for r in rows}
    for rep in range(args.ablation_repeats):
        run += 1
        for row in rows:
            eng = JaxEngine(row["variant"], row["gen"])
            prompts, seeds = prompts_for(run, wl.batch), seeds_for(run, wl.batch)
            start = time.perf_counter()
            eng.generate(prompts, seeds, wl.height, wl.width, wl.steps, wl.guidance)
            times[id(row)]["new"].append(time.perf_counter() - start)
            if rep == args.ablation_repeats - 1:
                start = time.perf_counter()  # the same prompts again: served from the embedding cache if on
                eng.generate(prompts, seeds, wl.height, wl.width, wl.steps, wl.guidance)
                times[id(row)]["cached"].append(time.perf_counter() - start)
                if wl.batch > 1:  # one prompt for the whole batch: encoded once if de-duplication is on
                    p = [f"{prompts[0]} (single)"]
                    start = time.perf_counter()
                    eng.generate(p, seeds[:1], wl.height, wl.width, wl.steps, wl.guidance, images_per_prompt=wl.batch)
                    times[id(row)]["one_prompt"].append(time.perf_counter() - start)
    base_ms = None
    out = []
    for row in rows:
        t = times[id(row)]
        ms = 1000 * statistics.median(t["new"]) / wl.batch
        base_ms = ms if base_ms is None else base_ms
        out.append({
            "variant": row["variant"], "switched_off": row["switched_off"],
            "ms_per_image_excl_save": ms, "vs_optimised": ms / base_ms,
            "cached_prompts_ms_per_image": 1000 * statistics.median(t["cached"]) / wl.batch if t["cached"] else None,
            "one_prompt_ms_per_image": (1000 * statistics.median(t["one_prompt"]) / wl.batch
                                        if t["one_prompt"] else None),
            "first_call_s": row["first_call_s"], "load_s": row.get("load_s"),
            "compiles_first_call": row["compiles"]["compiles"],
            "repeats": len(t["new"]),
        })
        row["gen"] = None
    gc.collect()
    return out


def render_in_dtype(path: str, args, wl: Workload, run: int, img_root: str) -> str:
    """The optimised path in `args.compare_dtype` on run `run`'s prompts and seeds, saved as PNGs next to the
    benchmarked dtype's; returns the folder (for 'bf16 vs fp32' image similarity)."""
    import model
    from model.engine import EngineOptions

    folder = os.path.join(img_root, f"b{wl.batch}", f"optimised-{args.compare_dtype}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    gen = model.load(path, args.compare_dtype, max_sequence_length=args.max_sequence_length,
                     options=EngineOptions(batch_size=wl.batch))
    run_e2e(JaxEngine(f"optimised-{args.compare_dtype}", gen), run, wl, folder)
    del gen
    gc.collect()
    return folder


def device_memory() -> dict | None:
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # pragma: no cover - backend dependent
        stats = None
    if not stats:
        return None
    keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(v) for k, v in stats.items() if k in keep}


def bench_batch(args, path, wl: Workload, cache_dir: str, counter, peak, img_root, engines_cache) -> dict:
    """Everything for one batch size; returns its results dict."""
    import jax

    import model
    from model.engine import EngineOptions

    from . import flops as F

    result: dict = {"batch": wl.batch, "engines": {}}
    # -- optimised: cold compile (empty persistent cache for this bucket), then warm from a fresh generator
    jax.clear_caches()
    start = time.perf_counter()
    cold_gen = model.load(path, args.dtype, max_sequence_length=args.max_sequence_length,
                          options=EngineOptions(batch_size=wl.batch, compilation_cache_dir=cache_dir))
    load_s = time.perf_counter() - start
    use_cfg = wl.guidance > 1 and not cold_gen.is_distilled
    snap = counter.snapshot()
    start = time.perf_counter()
    JaxEngine("optimised", cold_gen).programs(wl.batch, wl.height, wl.width, wl.steps, use_cfg)
    cold_s = time.perf_counter() - start
    cold = counter.since(snap)
    del cold_gen
    gc.collect()
    jax.clear_caches()
    rss0 = current_rss_mb()
    gen = model.load(path, args.dtype, max_sequence_length=args.max_sequence_length,
                     options=EngineOptions(batch_size=wl.batch, compilation_cache_dir=cache_dir))
    snap = counter.snapshot()
    start = time.perf_counter()
    opt = JaxEngine("optimised", gen)
    opt.programs(wl.batch, wl.height, wl.width, wl.steps, use_cfg)
    warm_s = time.perf_counter() - start
    warm = counter.since(snap)
    info = {"optimised": {"load_s": load_s, "compile_cold_s": cold_s, "compile_warm_s": warm_s,
                          "compile_cold_events": cold, "compile_warm_events": warm,
                          "rss_after_load_mb": current_rss_mb(), "rss_delta_load_mb": current_rss_mb() - rss0}}
    engines = [opt]
    if not args.skip_reference:
        rss0 = current_rss_mb()
        start = time.perf_counter()
        ref = JaxEngine("reference", model.load(path, args.dtype, max_sequence_length=args.max_sequence_length,
                                                options=EngineOptions.reference_mode(batch_size=wl.batch)))
        info["reference"] = {"load_s": time.perf_counter() - start, "rss_after_load_mb": current_rss_mb(),
                             "rss_delta_load_mb": current_rss_mb() - rss0}
        engines.append(ref)
    if not args.skip_diffusers:
        if "diffusers" not in engines_cache:
            rss0 = current_rss_mb()
            start = time.perf_counter()
            engines_cache["diffusers"] = DiffusersEngine(path, args.dtype, args.max_sequence_length)
            engines_cache["diffusers_info"] = {"load_s": time.perf_counter() - start,
                                               "rss_after_load_mb": current_rss_mb(),
                                               "rss_delta_load_mb": current_rss_mb() - rss0}
        engines.append(engines_cache["diffusers"])
        info["diffusers"] = dict(engines_cache["diffusers_info"])

    progress(f"batch {wl.batch}: engines loaded; warm-up and {args.repeats} interleaved repetitions")
    # -- warm-up (the first call of a jit path compiles: recorded as first_call_s), then interleaved repeats
    run = 0
    for w in range(max(1, args.warmup)):
        for eng in engines:
            snap = counter.snapshot()
            start = time.perf_counter()
            run_e2e(eng, run, wl, None)
            if w == 0:
                info[eng.name]["first_call_s"] = time.perf_counter() - start
                info[eng.name]["first_call_compiles"] = counter.since(snap)["compiles"]
        run += 1
    dirs = {}
    for eng in engines:
        dirs[eng.name] = os.path.join(img_root, f"b{wl.batch}", eng.name)
        shutil.rmtree(dirs[eng.name], ignore_errors=True)
        os.makedirs(dirs[eng.name])
    e2e = {eng.name: [] for eng in engines}
    steady_snap = counter.snapshot()
    for r in range(args.repeats):
        for eng in engines:
            _, rec = run_e2e(eng, run, wl, dirs[eng.name])
            e2e[eng.name].append(rec)
        run += 1
    saved_run = run - 1  # the PNGs on disk are this repetition's (same prompts and seeds for every engine)
    info["optimised"]["steady_state_compiles"] = counter.since(steady_snap)["compiles"]
    staged = {eng.name: [] for eng in engines}
    for r in range(args.repeats):
        for eng in engines:
            staged[eng.name].append(run_staged(eng, run, wl))
        run += 1

    # -- FLOPs, MFU, memory
    config = gen.config
    te_cfg = config.text_encoder
    common = dict(text_len=args.max_sequence_length, cfg_guidance=use_cfg)
    flops = {
        "optimised": F.image_flops(config, wl.height, wl.width, wl.steps,
                                   encoder_layers=F.encoder_layers_run(te_cfg),
                                   image_only_last_block=gen.options.image_only_last_block,
                                   fused_upsample=gen.options.fused_upsample, **common),
        "reference": F.image_flops(config, wl.height, wl.width, wl.steps,
                                   encoder_layers=te_cfg.num_hidden_layers, **common),
        "diffusers": F.image_flops(config, wl.height, wl.width, wl.steps,
                                   encoder_layers=te_cfg.num_hidden_layers, lm_head=True, **common),
    }
    try:
        result["xla_flops_per_image"] = opt.xla_flops(wl.batch, wl.height, wl.width, wl.steps, use_cfg)
    except Exception as e:  # cost analysis is best effort
        result["xla_flops_per_image"] = {"error": repr(e)}
    for eng in engines:
        s = summarise(e2e[eng.name], staged[eng.name], wl.batch)
        s.update(info[eng.name])
        s["flops_per_image"] = flops[eng.name]["total"]
        s["flops_per_image_by_stage"] = flops[eng.name]
        s["mfu"] = flops[eng.name]["total"] / (s["ms_per_image_excl_save"] / 1000) / peak["best_flops_per_s"]
        s["peak_rss_mb_so_far"] = peak_rss_mb()
        result["engines"][eng.name] = s
    result["device_memory"] = device_memory()

    # -- image agreement (the last repetition: same prompts and seeds for every engine)
    from .similarity import compare_folders

    def similarity(a: str, b: str) -> dict:
        r = compare_folders(dirs[a], dirs[b])
        return {k: r[k] for k in ("compared", "mean_ssim", "min_ssim", "max_abs_diff", "mean_abs_diff")}

    sim = {f"optimised_vs_{e.name}": similarity("optimised", e.name) for e in engines if e.name != "optimised"}
    if args.compare_dtype and args.compare_dtype != args.dtype:
        progress(f"batch {wl.batch}: the same prompts and noise in {args.compare_dtype} (image similarity)")
        dirs[args.compare_dtype] = render_in_dtype(path, args, wl, saved_run, img_root)
        sim[f"{args.dtype}_vs_{args.compare_dtype}"] = similarity("optimised", args.compare_dtype)
    result["similarity"] = sim
    result["image_dirs"] = dirs

    if not args.skip_ablation:
        progress(f"batch {wl.batch}: ablation")
        result["ablation"] = run_ablation(gen, path, args, wl, cache_dir, counter)
    del engines, opt
    gc.collect()
    return result


# ------------------------------------------------------------------------------------------------------ report


def _f(x, digits=1):
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "–"
    return f"{x:,.{digits}f}"


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"## FLUX.2 [klein] generation benchmark: preset `{res['preset']}`, {res['height']}x{res['width']}, "
             f"{res['dtype']}, {res['steps']} steps, guidance {res['guidance']}",
             "",
             f"Backend `{env['backend']}` ({env['device_kind']}, {env['device_count']} device(s)), "
             f"{env['cpu_count']} CPU cores, jax {env['jax']}, torch {env['torch']} ({env['torch_threads']} threads), "
             f"diffusers {env['diffusers']}. Matmul peak measured in this run: "
             f"{res['matmul_peak']['best_flops_per_s'] / 1e9:,.1f} GFLOP/s ({res['matmul_peak']['dtype']}, "
             f"n={res['matmul_peak']['n']}). Median of {res['repeats']} interleaved repetitions after "
             f"{res['warmup']} warm-up; new prompts every repetition.", ""]
    for key, b in res["batches"].items():
        lines += [f"### Batch {key}", "",
                  "| engine | ms/img | ms/img excl. PNG | img/s | CPU ms/img | tokenize | encode | denoise | decode "
                  "| d2h | host uint8 | PNG | GFLOP/img | MFU | load s | compile cold s | compile warm s "
                  "| first call s |",
                  "|---" * 18 + "|"]
        for name, e in b["engines"].items():
            st = e.get("stages_ms_per_image", {})
            lines.append(
                f"| {name} | {_f(e['ms_per_image'])} | {_f(e['ms_per_image_excl_save'])} | "
                f"{_f(e['images_per_s'], 3)} | {_f(e['cpu_ms_per_image'])} | "
                + " | ".join(_f(st.get(k)) for k in STAGES)
                + f" | {_f(e['flops_per_image'] / 1e9)} | {_f(100 * e['mfu'], 2)}% | {_f(e.get('load_s'))} | "
                f"{_f(e.get('compile_cold_s'))} | {_f(e.get('compile_warm_s'))} | {_f(e.get('first_call_s'))} |")
        lines.append("")
        lines.append("Stage columns: ms per image from staged runs (each stage waited on). "
                     "Compile cold/warm: AOT compile of the bucket with an empty / a filled persistent cache "
                     f"(cold: {b['engines']['optimised']['compile_cold_events']['compiles']} compiles; warm: "
                     f"{b['engines']['optimised']['compile_warm_events']['cache_hits']} persistent-cache hits). "
                     f"Compiles during the timed repetitions: {b['engines']['optimised']['steady_state_compiles']}.")
        sp = b.get("speedups", {})
        lines.append("")
        lines.append("Speed-up of the optimised path (ms/img incl. PNG; excl. PNG in brackets): " + ", ".join(
            f"{k.replace('speedup_vs_', 'vs ')} {_f(v, 2)}x ({_f(sp.get(k + '_excl_save'), 2)}x)"
            for k, v in sp.items() if not k.endswith("_excl_save")) + ".")
        paired = b.get("paired_speedups", {})
        if paired:
            lines.append("Paired by repetition (excl. PNG; median, min-max over the repetitions): " + ", ".join(
                f"{k.replace('_', ' ')} {_f(v['median'], 2)}x ({_f(v['min'], 2)}-{_f(v['max'], 2)}x)"
                for k, v in paired.items()) + ".")
        for k, s in b.get("similarity", {}).items():
            what = k.replace("_", " ") + ("" if k.startswith("optimised_") else " (optimised path in both)")
            lines.append(f"Images {what}: mean SSIM {_f(s['mean_ssim'], 5)}, min SSIM "
                         f"{_f(s['min_ssim'], 5)}, max |diff| {s['max_abs_diff']}, mean |diff| "
                         f"{_f(s['mean_abs_diff'], 4)} ({s['compared']} images).")
        mem = b.get("device_memory")
        lines.append(f"Peak host RSS: {_f(b['engines']['optimised']['peak_rss_mb_so_far'])} MiB (process, so far); "
                     f"device memory: {mem if mem else 'not reported by this backend'}.")
        xf = b.get("xla_flops_per_image", {})
        if "total" in xf:
            an = b["engines"]["optimised"]["flops_per_image_by_stage"]
            lines.append("FLOPs/img analytic vs XLA cost analysis (GFLOP): " + ", ".join(
                f"{k} {an[k] / 1e9:,.2f} / {xf[k] / 1e9:,.2f}" for k in ("encode", "denoise", "decode", "total"))
                + ".")
        if "ablation" in b:
            lines += ["", f"#### Ablation, batch {key} (each optimisation off in turn; ms/img excl. PNG)", "",
                      "| variant | switched off | ms/img new prompts | vs optimised | ms/img same prompts again "
                      "| ms/img one prompt x batch | first call s | compiles on first call |",
                      "|---|---|---|---|---|---|---|---|"]
            for a in b["ablation"]:
                lines.append(f"| {a['variant']} | {a['switched_off']} | {_f(a['ms_per_image_excl_save'])} | "
                             f"{_f(a['vs_optimised'], 2)}x | {_f(a['cached_prompts_ms_per_image'])} | "
                             f"{_f(a['one_prompt_ms_per_image'])} | {_f(a['first_call_s'], 2)} | "
                             f"{a['compiles_first_call']} |")
            lines.append("")
            lines.append("'vs optimised' > 1 means slower without the optimisation. First call: a fresh generator's "
                         "first batch with the persistent compilation cache off (compile + run). 'same prompts "
                         "again' repeats the previous call's prompts (embedding cache); 'one prompt x batch' "
                         "asks for the whole batch from one prompt (de-duplication).")
        lines.append("")
    return "\n".join(lines) + "\n"


def paired_speedups(engines: dict) -> dict:
    """Speed-up repetition by repetition (excl. PNG): the engines of one repetition run back to back, so a slow spell
    of a shared machine hits both sides of most ratios; their median and range show how far noise moves the result."""
    opt = engines["optimised"]["generate_s_runs"]
    out = {}
    for other in ("reference", "diffusers"):
        if other in engines:
            ratios = [o / x for o, x in zip(engines[other]["generate_s_runs"], opt)]
            out[f"vs_{other}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def headline(res: dict, key: str) -> dict:
    b = res["batches"][key]
    e = b["engines"]
    opt = e["optimised"]
    out = {
        "ms_per_image": opt["ms_per_image"],
        "ms_per_image_excl_save": opt["ms_per_image_excl_save"],
        "images_per_s": opt["images_per_s"],
        "ms_per_image_reference": e.get("reference", {}).get("ms_per_image"),
        "ms_per_image_diffusers": e.get("diffusers", {}).get("ms_per_image"),
        **b.get("speedups", {}),
        "mfu": opt["mfu"],
        "compile_cold_s": opt["compile_cold_s"],
        "compile_warm_s": opt["compile_warm_s"],
        "steady_state_compiles": opt["steady_state_compiles"],
        "peak_rss_mb": opt["peak_rss_mb_so_far"],
    }
    out.setdefault("speedup_vs_reference", None)
    out.setdefault("speedup_vs_diffusers", None)
    for k, s in b.get("similarity", {}).items():  # optimised_vs_reference -> ssim_vs_reference, bfloat16_vs_float32 ...
        out[f"ssim_vs_{k.split('_vs_')[1]}"] = s["min_ssim"]
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def write_results(res: dict, out: str, stem: str) -> str:
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    md = markdown(res)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(md)
    return md


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint folder instead of the preset's")
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", default="1", help="batch size, or several separated by commas (e.g. 1,4)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=None, help="default: 4 (distilled) or 50 (--base)")
    ap.add_argument("--guidance", type=float, default=None, help="default: 1.0 (distilled) or 4.0 (--base)")
    ap.add_argument("--base", action="store_true", help="non-distilled checkpoint of the preset (CFG)")
    ap.add_argument("--max-sequence-length", type=int, default=None, help="default: the preset's (512; tiny 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ablation-repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--skip-ablation", action="store_true")
    ap.add_argument("--compare-dtype", default=None, choices=["float32", "bfloat16", "none"],
                    help="also render the last repetition's prompts and noise with the optimised path in this dtype "
                         "and report image similarity against it (default: float32 when --dtype is bfloat16)")
    ap.add_argument("--cache-root", default=None, help="where preset checkpoints are built and kept")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    if not args.batches or min(args.batches) < 1:
        ap.error("--batch needs positive integers")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.compare_dtype is None:
        args.compare_dtype = "float32" if args.dtype != "float32" else "none"
    if args.compare_dtype == "none":
        args.compare_dtype = None
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore", message=".*donated buffers.*")
    os.makedirs(args.out, exist_ok=True)
    cache_dir = tempfile.mkdtemp(prefix=".compile-cache-", dir=args.out)
    # The persistent cache must be configured before this process compiles anything.
    from model.engine import enable_compilation_cache

    enable_compilation_cache(cache_dir)
    import jax

    from . import presets

    counter = CompileCounter()
    try:
        from .presets import PRESETS

        if args.max_sequence_length is None:
            args.max_sequence_length = PRESETS[args.preset]["max_sequence_length"]
        print(f"[bench] checkpoint for preset {args.preset} ...", file=sys.stderr, flush=True)
        path = args.checkpoint or presets.ensure_checkpoint(args.preset, distilled=not args.base,
                                                            cache_root=args.cache_root)
        steps = args.steps or (50 if args.base else 4)
        guidance = args.guidance if args.guidance is not None else (4.0 if args.base else 1.0)
        peak = measure_matmul_peak(args.dtype)
        print(f"[bench] matmul peak {peak['best_flops_per_s'] / 1e9:.1f} GFLOP/s", file=sys.stderr, flush=True)
        import diffusers
        import torch

        dev = jax.local_devices()[0]
        res = {
            "preset": args.preset, "checkpoint": path, "height": args.height, "width": args.width,
            "dtype": args.dtype, "steps": steps, "guidance": guidance, "repeats": args.repeats,
            "warmup": args.warmup, "max_sequence_length": args.max_sequence_length,
            "environment": {"backend": jax.default_backend(), "device_kind": dev.device_kind,
                            "device_count": jax.local_device_count(), "cpu_count": os.cpu_count(),
                            "jax": jax.__version__, "torch": torch.__version__, "diffusers": diffusers.__version__,
                            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                            "machine": platform.machine()},
            "matmul_peak": peak, "batches": {},
        }
        img_root = os.path.join(args.out, "images", f"{args.preset}-{args.height}x{args.width}-{args.dtype}")
        engines_cache: dict = {}
        stem = f"{args.preset}-{args.height}x{args.width}-{args.dtype}-b{'_'.join(map(str, args.batches))}"
        for batch in args.batches:
            print(f"[bench] batch {batch} ...", file=sys.stderr, flush=True)
            wl = Workload(args.height, args.width, steps, guidance, batch)
            b = bench_batch(args, path, wl, cache_dir, counter, peak, img_root, engines_cache)
            e = b["engines"]
            sp = {}
            for other in ("reference", "diffusers"):
                if other in e:
                    sp[f"speedup_vs_{other}"] = e[other]["ms_per_image"] / e["optimised"]["ms_per_image"]
                    sp[f"speedup_vs_{other}_excl_save"] = (e[other]["ms_per_image_excl_save"]
                                                           / e["optimised"]["ms_per_image_excl_save"])
            b["speedups"] = sp
            b["paired_speedups"] = paired_speedups(e)
            res["batches"][str(batch)] = b
            print(f"[bench] batch {batch}: " + json.dumps(headline(res, str(batch))), file=sys.stderr, flush=True)
            res["peak_rss_mb"] = peak_rss_mb()
            md = write_results(res, args.out, stem)  # after every batch: a long run keeps what it finished
        print(md)
        first = str(args.batches[0])
        final = {**headline(res, first), "preset": args.preset, "batch": args.batches[0], "dtype": args.dtype,
                 "backend": jax.default_backend(), "height": args.height, "width": args.width, "steps": steps}
        if len(args.batches) > 1:
            final["by_batch"] = {k: headline(res, k) for k in res["batches"]}
        final["results"] = os.path.join(args.out, stem + ".json")
        print(json.dumps(final))
        return final
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
