"""klein-4B at its real shapes (random bf16 weights) on one chip: 1024x1024 images that are finite, a second call
that compiles nothing, and the device memory it holds (printed for the note)."""

import jax
import numpy as np


def test_klein_4b_1024_generates_without_recompiling():
    import model
    from benchmarks.presets import ensure_checkpoint
    from benchmarks.runs import CompileCounter, device_memory

    counter = CompileCounter()
    gen = model.load(ensure_checkpoint("klein-4b"), "bfloat16", batch_size=1)
    size = dict(height=1024, width=1024, num_inference_steps=4)
    inputs = gen.check_inputs(["a red fox in the snow"], [0], **size)
    plan = gen.prepare_bucket(inputs)
    txt, _ = gen.encode_prompts(list(inputs.prompts), plan)
    latents = gen.denoise(gen.prepare_latents([0], plan), txt, None, plan)
    assert bool(jnp_isfinite(latents)), "the denoised latents hold NaN or inf"
    first = gen.generate(["a lighthouse at night"], [1], **size)
    compiles = counter.snapshot()["compiles"]
    second = gen.generate(["a watercolour of a harbour"], [2], **size)
    assert counter.snapshot()["compiles"] == compiles, "the second call of the same shape compiled again"
    assert first.shape == second.shape == (1, 1024, 1024, 3) and first.dtype == np.uint8
    assert second.std() > 1.0  # noise from random weights, not a constant (NaN pixels cast to one value)
    memory = device_memory()
    print(f"device memory after two calls: {memory}")
    assert memory and memory["bytes_in_use"] > 12e9  # the weights (13 GB of bf16) live on the chip


def jnp_isfinite(x):
    import jax.numpy as jnp

    return jax.device_get(jnp.isfinite(x.astype(jnp.float32)).all())
