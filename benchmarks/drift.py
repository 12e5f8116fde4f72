"""How far a quantized model drifts from bf16 on the same weights and noise: velocity per step, images' PSNR and SSIM.

    python -m benchmarks.drift --preset small [--height 256 --width 256] [--prompts 4]
    python -m benchmarks.drift --preset klein-4b --height 1024 --width 1024      # on a TPU chip

Loads the preset's random-weight checkpoint (or --checkpoint) twice, in bf16 and with --quantize (int8), and for the
same prompts and seeds reports, per denoising step, the relative error ||v_q - v|| / ||v|| of the quantized model's
velocity against bf16's at bf16's own latents (each model with its own text embeddings), then both models' images
and their PSNR (dB) and SSIM per image. Random weights are not a trained model: these figures show the quantization
error's size on the real shapes, not how a trained model's images change (benchmarks.quality on your weights). Prints
one JSON line last. A measurement tool: nothing is asserted (tests/model/test_quantize.py bounds the tiny case).
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np


def trajectory(gen, prompts, seeds, height: int, width: int, latents=None) -> dict:
    """The denoising loop of `gen` run step by step from its initial noise: {latents: the input of each step,
    velocities: what `gen` computes there}. Given `latents` (another model's trajectory), each step's velocity is
    `gen`'s at those latents instead, so two models are compared on the same inputs, each with its own text
    embeddings. Host arrays, so the models need not be loaded at once."""
    from model.nets.scheduler import euler_step

    inputs = gen.check_inputs(prompts, seeds, height, width)
    prepared = gen.prepare_bucket(inputs)
    txt, _ = gen.encode_prompts(list(inputs.prompts), prepared)
    neg = gen.encode_prompts([""] * len(inputs.prompts), prepared)[0] if inputs.use_cfg else None
    x = gen.prepare_latents(list(inputs.seeds), prepared)
    sigmas = np.asarray(prepared.sigmas)
    out = {"latents": [], "velocities": []}
    for step in range(prepared.bucket.steps):
        if latents is not None:
            x = jax_put(latents[step], x)
        v = gen.velocity(x, txt, neg, prepared, step)
        out["latents"].append(np.asarray(x, np.float32))
        out["velocities"].append(np.asarray(v, np.float32))
        x = euler_step(x, v, sigmas[step], sigmas[step + 1])
    return out


def jax_put(host, like):
    """`host` on the devices as `like` is (dtype and sharding)."""
    import jax

    return jax.device_put(host.astype(like.dtype), like.sharding)


def velocity_errors(reference: dict, candidate: dict) -> list[float]:
    """Per step, ||v_candidate - v_reference|| / ||v_reference|| of two `trajectory` results on the same latents."""
    from model.nets.quantize import relative_error

    return [relative_error(c, r) for c, r in zip(candidate["velocities"], reference["velocities"])]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images in dB (inf when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def image_similarity(reference: np.ndarray, candidate: np.ndarray) -> list[dict]:
    """[{psnr, ssim, max_abs}] per image of two uint8 batches [N, H, W, 3]."""
    from .similarity import ssim

    return [{"psnr": psnr(a, b), "ssim": ssim(a, b), "max_abs": int(np.abs(a.astype(int) - b).max())}
            for a, b in zip(reference, candidate)]


def measure(checkpoint: str, *, quantize: str, prompts: list[str], seeds: list[int], height: int, width: int) -> dict:
    """Velocity errors per step and image similarity of `quantize` against bf16 on `checkpoint`; one model loaded at a
    time (a real-size model in both forms may not fit one chip)."""
    import gc

    import model

    results = []
    for options in ({}, {"quantize": quantize}):
        gen = model.load(checkpoint, dtype="bfloat16", **options)
        steps = trajectory(gen, prompts, seeds, height, width, results[0][0]["latents"] if results else None)
        results.append((steps, gen.generate(prompts, seeds, height=height, width=width)))
        del gen
        gc.collect()
    (ref_steps, ref_images), (steps, images) = results
    similarity = image_similarity(ref_images, images)
    return {"quantize": quantize, "height": height, "width": width,
            "velocity_relative_error": velocity_errors(ref_steps, steps), "images": similarity,
            "psnr_min": min(i["psnr"] for i in similarity), "ssim_min": min(i["ssim"] for i in similarity)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.drift", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--quantize", default="int8")
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=2)
    args = ap.parse_args(argv)
    from . import presets

    path = args.checkpoint or presets.ensure_checkpoint(args.preset)
    prompts = [f"a photograph of object {i} on a wooden table, soft light" for i in range(args.prompts)]
    result = {"preset": args.preset, **measure(path, quantize=args.quantize, prompts=prompts,
                                               seeds=list(range(args.prompts)), height=args.height,
                                               width=args.width)}
    for step, err in enumerate(result["velocity_relative_error"]):
        print(f"step {step}: velocity relative error {err:.4f}")
    for i, image in enumerate(result["images"]):
        print(f"image {i}: PSNR {image['psnr']:.2f} dB, SSIM {image['ssim']:.4f}, max |diff| {image['max_abs']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
