"""The bounds on int8's drift from bf16 on the tiny checkpoint, shared by the CPU tests and the chip's.

Chosen from measurement (benchmarks.drift on the tiny checkpoint, CPU: velocity relative error 0.017-0.031 per step,
PSNR 45.2-45.4 dB, SSIM 0.9997), with about 2x margin; a doubled scale on one layer breaks them
(tests/model/test_quantize.py)."""

VELOCITY_BOUND = 0.06   # relative error of a step's velocity
PSNR_BOUND = 38.0       # dB, per image
SSIM_BOUND = 0.995      # per image
ARGS = dict(prompts=["a red fox in snow", "a lighthouse at dusk"], seeds=[3, 4], height=64, width=96)


def drift(reference, candidate, args=ARGS) -> list[float]:
    """benchmarks.drift's velocity errors per step of `candidate` against `reference` on `args`."""
    from benchmarks.drift import trajectory, velocity_errors

    shape = (args["prompts"], args["seeds"], args["height"], args["width"])
    steps = trajectory(reference, *shape)
    return velocity_errors(steps, trajectory(candidate, *shape, latents=steps["latents"]))


def within_bounds(images) -> bool:
    """Whether every image pair of benchmarks.drift.image_similarity is within PSNR_BOUND and SSIM_BOUND."""
    return all(i["psnr"] > PSNR_BOUND and i["ssim"] > SSIM_BOUND for i in images)
