"""int8 (W8A8) on the chip: the tiny checkpoint's drift from bf16 within the CPU tests' bounds, the chip's int8 images
within those bounds of the CPU's int8 images, and klein-4B at its real shapes in int8 (finite images, no second
compile, and the device memory it holds, printed for the note)."""

import jax
import numpy as np

from drift_bounds import ARGS, VELOCITY_BOUND, drift, within_bounds


def _load(path, platform=None, **kw):
    import model

    return model.load(path, "bfloat16", max_sequence_length=32, platform=platform, **kw)


def test_int8_drift_on_the_chip_within_the_cpu_bounds(chip_checkpoint):
    from benchmarks.drift import image_similarity

    path = chip_checkpoint()
    bf16, int8 = _load(path), _load(path, quantize="int8")
    assert int8.mesh.devices.flat[0].platform == jax.default_backend()
    errors = drift(bf16, int8)
    images = image_similarity(bf16.generate(**ARGS), int8.generate(**ARGS))
    print(f"int8 vs bf16 on the chip: velocity relative error per step {[round(e, 4) for e in errors]}, "
          f"images {images}")
    assert max(errors) < VELOCITY_BOUND, errors
    assert within_bounds(images), images


def test_int8_on_the_chip_within_the_bounds_of_the_cpus_int8(chip_checkpoint):
    from benchmarks.drift import image_similarity

    path = chip_checkpoint()
    chip, host = _load(path, quantize="int8"), _load(path, platform="cpu", quantize="int8")
    images = image_similarity(host.generate(**ARGS), chip.generate(**ARGS))
    print(f"int8 chip vs CPU: {images}")
    assert within_bounds(images), images


def test_klein_4b_1024_int8_generates_without_recompiling_in_less_memory():
    import model
    from benchmarks.presets import ensure_checkpoint
    from benchmarks.runs import CompileCounter, device_memory

    counter = CompileCounter()
    gen = model.load(ensure_checkpoint("klein-4b"), "bfloat16", batch_size=1, quantize="int8")
    size = dict(height=1024, width=1024, num_inference_steps=4)
    first = gen.generate(["a lighthouse at night"], [1], **size)
    compiles = counter.snapshot()["compiles"]
    second = gen.generate(["a watercolour of a harbour"], [2], **size)
    assert counter.snapshot()["compiles"] == compiles, "the second call of the same shape compiled again"
    assert first.shape == second.shape == (1, 1024, 1024, 3) and first.dtype == np.uint8
    assert second.std() > 1.0
    memory = device_memory()
    print(f"int8 device memory after two calls: {memory}")
    assert memory and memory["bytes_in_use"] < 10e9  # int8 projections: about 8.2 GB against bf16's 14.2
