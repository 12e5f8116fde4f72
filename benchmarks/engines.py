"""Where the benchmark builds what it compares: the JAX generator (optimised, reference and the ablation variants,
from `model.options.EngineOptions` and `model.lab.LabSwitches`) and diffusers' pipeline on PyTorch.

An engine has `generate(prompts, seeds, h, w, steps, guidance, images_per_prompt)` (end to end, the public API) and
`staged(...)` (one batch stage by stage, waiting after each: the STAGES timings). The JAX engine times the
generator's own public stages; nothing here re-implements its batch loop.

torch and diffusers are imported only when a `DiffusersEngine` is made (or its versions are asked for): the JAX
side runs where neither is installed (the worker image).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
import warnings

import numpy as np

from model.lab import LabSwitches, reference_mode, split_overrides
from model.options import EIGEN_DOTS, PROGRAMS, EngineOptions

logger = logging.getLogger("benchmarks.engines")

STAGES = ("tokenize", "encode", "denoise", "decode", "d2h", "host_uint8", "png")


# ------------------------------------------------------------------------------------------------------ JAX


class JaxEngine:
    """A loaded model.Flux2KleinGenerator: end-to-end runs through `generate`, staged runs through its stages."""

    def __init__(self, name: str, gen):
        self.name = name
        self.gen = gen

    def generate(self, prompts, seeds, h, w, steps, guidance, images_per_prompt=1, references=None) -> np.ndarray:
        """`references`: one list of reference images for every prompt (image-conditioned generation), or None."""
        return self.gen.generate(prompts, seeds, height=h, width=w, num_inference_steps=steps,
                                 guidance_scale=guidance, num_images_per_prompt=images_per_prompt,
                                 reference_images=None if references is None else [list(references)] * len(prompts))

    def plan(self, n: int, h: int, w: int, steps: int, use_cfg: bool):
        """The generator's plan for n images of h x w (its programs compiled on first use, as `generate` would)."""
        from model.generator import GenerationInputs

        inputs = GenerationInputs(prompts=("",) * n, seeds=tuple(range(n)), height=h, width=w,
                                  num_inference_steps=int(steps), guidance_scale=4.0 if use_cfg else 1.0,
                                  use_cfg=use_cfg)
        return self.gen.plan_bucket(inputs)

    def staged(self, prompts, seeds, h, w, steps, guidance) -> tuple[np.ndarray, dict]:
        """One batch through the generator's stages, each waited on: tokenize (with the initial noise), encode,
        denoise, decode, d2h, host uint8."""
        import jax

        gen = self.gen
        inputs = gen.check_inputs(prompts, seeds, h, w, steps, guidance)
        plan = gen.plan_bucket(inputs)
        n = len(inputs.prompts)
        if n > plan.batch:
            raise ValueError("staged runs take at most one compiled batch")
        pad = gen.padding(plan, n)
        t = {}

        start = time.perf_counter()
        tokens = gen.tokenize(list(inputs.prompts), plan)[:2]
        neg_tokens = gen.tokenize([""] * (n + pad), plan)[:2] if inputs.use_cfg else None
        latents = gen.prepare_latents(list(inputs.seeds), plan, pad)
        jax.block_until_ready((tokens, neg_tokens, latents))
        t["tokenize"] = time.perf_counter() - start

        start = time.perf_counter()
        txt = gen.encode_tokens(*tokens, plan)
        neg = gen.encode_tokens(*neg_tokens, plan) if neg_tokens else None
        jax.block_until_ready((txt, neg))
        t["encode"] = time.perf_counter() - start

        start = time.perf_counter()
        latents = jax.block_until_ready(gen.denoise(latents, txt, neg, plan))
        t["denoise"] = time.perf_counter() - start

        start = time.perf_counter()
        pixels = jax.block_until_ready(gen.decode(latents, plan))
        t["decode"] = time.perf_counter() - start

        start = time.perf_counter()
        pixels = jax.device_get(pixels)
        t["d2h"] = time.perf_counter() - start

        start = time.perf_counter()
        host = gen.to_host(pixels, n)
        t["host_uint8"] = time.perf_counter() - start
        return host, t

    def xla_flops(self, n, h, w, steps, use_cfg) -> dict:
        """XLA's own FLOP counts per image of the encoder, the denoising steps (one step's count x steps) and the
        decoder (HLO cost analysis of the lowered programs)."""
        from model.cpu_images import per_image_for

        gen = self.gen
        plan = self.plan(n, h, w, steps, use_cfg)
        # XLA counts a loop body once, so image-by-image programs (a lax.map over the batch) are counted on one image.
        if per_image_for(gen.mesh, gen.options):
            plan = dataclasses.replace(plan, bucket=dataclasses.replace(plan.bucket, batch=1))

        def flops(lowered):
            cost = lowered.cost_analysis()
            if isinstance(cost, (list, tuple)):
                cost = cost[0]
            if not cost:  # TPU: the lowered program has no cost analysis before compiling
                cost = lowered.compile().cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            return float((cost or {}).get("flops", float("nan"))) / plan.batch

        encode, step, decode = gen.lower(plan, fused=False)  # one step: a fused loop's body would count once
        out = {"encode": flops(encode), "denoise": flops(step) * steps, "decode": flops(decode)}
        out["total"] = out["encode"] + out["denoise"] + out["decode"]
        return out


@dataclasses.dataclass(frozen=True)
class Variant:
    """A configuration of the JAX engine: an ablation row, the optimised path or the reference path."""

    name: str
    switched_off: str
    options: EngineOptions
    lab: LabSwitches = LabSwitches()


def optimised(batch: int, cache_dir: str | None = None) -> Variant:
    return Variant("optimised", "nothing (all optimisations on)",
                   EngineOptions(batch_size=batch, compilation_cache_dir=cache_dir))


def reference(batch: int) -> Variant:
    mode = reference_mode(batch_size=batch)
    return Variant("reference", "everything off (reference mode)", mode["options"], mode["lab"])


# Each switch (an EngineOptions or LabSwitches field) -> (what turning it off means, the change that does).
ABLATIONS = {
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
    "cpu_compiler_options": ("XLA:CPU defaults in every program (YNNPACK dots/convs)", dict(cpu_compiler_options=())),
    "per_image": ("batched programs (not image by image)", dict(per_image=False)),
    "concurrent_images": ("a batch's images one after the other (lax.map)", dict(concurrent_images=1)),
    "image_only_last_block": ("last block computes text tokens too", dict(image_only_last_block=False)),
    "fused_upsample": ("VAE upsamples, then a 3x3 conv at the high resolution", dict(fused_upsample=False)),
    "tpu_upsample": ("VAE upsample as a plain upsampled copy and 3x3 conv on TPUs", dict(tpu_upsample="plain")),
    "vae_one_pass_norm": ("VAE GroupNorm statistics in two passes (centred first)", dict(vae_one_pass_norm=False)),
    "tpu_rope": ("RoPE by splitting pairs on TPUs (CPU always does)", dict(tpu_rope="pairs")),
    "heads_kernel": ("q/k norm, RoPE and head layout by XLA on TPUs (CPU always is)", dict(heads_kernel="off")),
    "layers_traced_once": ("each layer traced and lowered where it is called", dict(layers_traced_once=False)),
}
# Not rows: reference mode is the last row; the persistent cache's effect is the cold/warm compile columns;
# batch_size is the workload; max_buckets bounds memory over many sizes (one size here); context parallelism is a
# layout over several devices, off by default; vae_splash is off by default (measured slower on v5e);
NOT_ABLATED = ("reference", "batch_size", "compilation_cache_dir", "max_buckets", "context_parallel", "model_shards",
               "platform", "vae_splash", "quantize")  # quantize: another model (benchmarks.drift, benchmarks.quality)


def ablation_variants(batch: int, cache_dir: str | None) -> list[Variant]:
    """Each optimisation (EngineOptions and LabSwitches field) off in turn, then Eigen everywhere, then everything
    off (the reference mode). A field not in ABLATIONS that defaults to True gets a row turning it False."""
    base = optimised(batch, cache_dir)
    rows = []
    for f in dataclasses.fields(LabSwitches) + dataclasses.fields(EngineOptions):
        if f.name in NOT_ABLATED:
            continue
        if f.name in ABLATIONS:
            what, change = ABLATIONS[f.name]
        elif isinstance(f.default, bool) and f.default:
            what, change = f"{f.name}=False", {f.name: False}
        else:
            continue
        engine, lab = split_overrides(change)
        rows.append(Variant(f"-{f.name}", what, dataclasses.replace(base.options, **engine),
                            dataclasses.replace(base.lab, **lab)))
    eigen = tuple((p, EIGEN_DOTS) for p in PROGRAMS)
    rows.append(Variant("-denoise_ynnpack", "Eigen dots in the transformer too (Eigen everywhere)",
                        dataclasses.replace(base.options, cpu_compiler_options=eigen), base.lab))
    rows.append(reference(batch))
    return rows


def load_variant(path: str, dtype: str, max_seq: int, variant: Variant):
    import model

    return model.load(path, dtype, max_sequence_length=max_seq, options=variant.options, lab=variant.lab)


def make_variant(base_gen, path: str, dtype: str, max_seq: int, variant: Variant):
    """A generator for `variant`; shares the base generator's weights when the encoder depth allows."""
    from model.generator import Flux2KleinGenerator

    def depth(lab):
        return lab.truncated_encoder and not lab.reference

    if depth(variant.lab) == depth(base_gen.lab):
        try:
            te, tr, vae = base_gen.programs.modules()
            return Flux2KleinGenerator(base_gen.config, base_gen.tokenizer, te, tr, vae, dtype=base_gen.dtype,
                                       options=variant.options, model_id=base_gen.model_id, root=base_gen.root,
                                       lab=variant.lab, vae_encoder_loader=getattr(
                                           base_gen.reference_encoder, "loader", None))
        except Exception as e:  # the constructor changed: fall back to a full load
            logger.info("sharing weights failed (%s); loading again", e)
    return load_variant(path, dtype, max_seq, variant)


# ------------------------------------------------------------------------------------------------------ diffusers


def diffusers_available() -> bool:
    """Whether torch and diffusers are installed (found without importing them)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("torch", "diffusers"))
    except (ImportError, ValueError):
        return False


def diffusers_versions() -> dict:
    """torch and diffusers versions and torch's thread count (imports both: only when diffusers is benchmarked)."""
    import diffusers
    import torch

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "torch_threads": torch.get_num_threads()}


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

    def generate(self, prompts, seeds, h, w, steps, guidance, images_per_prompt=1, references=None) -> np.ndarray:
        """`references`: the call's reference images (PIL, or uint8 arrays made PIL), diffusers' `image=`."""
        from PIL import Image

        seeds = [s + j for s in seeds for j in range(images_per_prompt)]
        image = None if not references else [r if isinstance(r, Image.Image) else Image.fromarray(r)
                                             for r in references]
        with self.torch.inference_mode():
            out = self.pipe(prompt=list(prompts), image=image, latents=self._latents(seeds, h, w), height=h, width=w,
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
