"""The JAX generator as the benchmarks drive it: end-to-end runs through `generate`, staged runs through its public
stages (the STAGES timings), and generators with other `model.options.EngineOptions` over the same weights (the
variants of `benchmarks.tpu_profile`). Nothing here re-implements the generator's batch loop.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from model.options import EngineOptions

STAGES = ("tokenize", "encode", "denoise", "decode", "d2h", "host_uint8")


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

    def prepare(self, n: int, h: int, w: int, steps: int, use_cfg: bool):
        """The generator's prepared bucket for n images of h x w (its programs compiled on first use, as `generate`
        would)."""
        from model.engine.generator import GenerationInputs

        inputs = GenerationInputs(prompts=("",) * n, seeds=tuple(range(n)), height=h, width=w,
                                  num_inference_steps=int(steps), guidance_scale=4.0 if use_cfg else 1.0,
                                  use_cfg=use_cfg)
        return self.gen.prepare_bucket(inputs)

    def staged(self, prompts, seeds, h, w, steps, guidance) -> tuple[np.ndarray, dict]:
        """One batch through the generator's stages, each waited on: tokenize (with the initial noise), encode,
        denoise, decode, d2h, host uint8."""
        import jax

        gen = self.gen
        inputs = gen.check_inputs(prompts, seeds, h, w, steps, guidance)
        prepared = gen.prepare_bucket(inputs)
        n = len(inputs.prompts)
        if n > prepared.batch:
            raise ValueError("staged runs take at most one compiled batch")
        pad = gen.padding(prepared, n)
        t = {}

        start = time.perf_counter()
        tokens = gen.tokenize(list(inputs.prompts), prepared)[:2]
        neg_tokens = gen.tokenize([""] * (n + pad), prepared)[:2] if inputs.use_cfg else None
        latents = gen.prepare_latents(list(inputs.seeds), prepared, pad)
        jax.block_until_ready((tokens, neg_tokens, latents))
        t["tokenize"] = time.perf_counter() - start

        start = time.perf_counter()
        txt = gen.encode_tokens(*tokens, prepared)
        neg = gen.encode_tokens(*neg_tokens, prepared) if neg_tokens else None
        jax.block_until_ready((txt, neg))
        t["encode"] = time.perf_counter() - start

        start = time.perf_counter()
        latents = jax.block_until_ready(gen.denoise(latents, txt, neg, prepared))
        t["denoise"] = time.perf_counter() - start

        start = time.perf_counter()
        pixels = jax.block_until_ready(gen.decode(latents, prepared))
        t["decode"] = time.perf_counter() - start

        start = time.perf_counter()
        pixels = jax.device_get(pixels)
        t["d2h"] = time.perf_counter() - start

        start = time.perf_counter()
        host = gen.to_host(pixels, n)
        t["host_uint8"] = time.perf_counter() - start
        return host, t


def parse_options(text: str) -> dict:
    """`key=value,key=value` from a benchmark's command line as EngineOptions fields: true/false as booleans, digits
    as integers, anything else as text; ValueError naming a key that is not a field."""
    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"{key!r} is not an EngineOptions field; choose from {sorted(fields)}")
        out[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return out


def with_options(base_gen, path: str, options: EngineOptions):
    """A generator running `options`: over the base generator's loaded weights when they fit them (the same
    quantization and model shards: the same modules and layout), else loaded again from `path`."""
    from model.engine.generator import Flux2KleinGenerator

    base = base_gen.options
    if (options.quantize, options.model_shards) == (base.quantize, base.model_shards):
        te, tr, vae = base_gen.programs.modules()
        return Flux2KleinGenerator(base_gen.config, base_gen.tokenizer, te, tr, vae, dtype=base_gen.dtype,
                                   options=options, model_id=base_gen.model_id, root=base_gen.root,
                                   vae_encoder_loader=getattr(base_gen.reference_encoder, "loader", None))
    import model

    return model.load(path, base_gen.dtype, max_sequence_length=base_gen.max_sequence_length, options=options)
