"""A batch that runs out of memory runs again in halves, down to single images, and later batches of its shape start
in parts below the smallest size that failed: a job's default --batch_size gives images, not error rows, on a
machine that holds fewer images at once (klein-4B at 1024x1024 on one v5e chip holds one)."""

import numpy as np
import pytest

from model import GenerationResult
from transforms.inference import Flux2KleinModelHandler
from transforms.requests import GenerationRequest, ImageTask

OOM = ("RESOURCE_EXHAUSTED: E0101: RuntimeProgramAllocationFailure: Error loading program 'jit_denoise': "
       "Attempting to reserve 3.41G at the bottom of memory.")


class HoldsAtMost:
    """A stand-in for the loaded model that holds programs of at most `fits` images at once, as a chip does. Its
    programs take `engine_batch` images (None: as many as the call has) unless the call names its own batch; a
    shorter call is padded to them, as the generator pads it."""

    def __init__(self, fits: int, error: Exception | None = None, engine_batch: int | None = None):
        self.fits, self.error, self.engine_batch, self.calls, self.compiled = fits, error, engine_batch, [], []

    def generate_batch(self, prompts, seeds, height, width, num_inference_steps, guidance_scale,
                       reference_images=None, batch_size=None):
        self.calls.append(len(prompts))
        compiled = batch_size or self.engine_batch or len(prompts)
        self.compiled.append(compiled)
        if self.error is not None:
            raise self.error
        if min(compiled, len(prompts)) < len(prompts):
            raise AssertionError("the generator runs a call larger than its batch in several batches")
        if compiled > self.fits:
            raise RuntimeError(OOM)
        n = len(prompts)
        return GenerationResult(images=np.stack([np.full((height, width, 3), s % 251, np.uint8) for s in seeds]),
                                prompt_truncated=(False,) * n, nonfinite=(None,) * n, num_inference_steps=4,
                                guidance_scale=1.0, model="m", seconds=0.01 * n)


def _tasks(n: int, height: int = 32, first: int = 0) -> list[ImageTask]:
    return [ImageTask(GenerationRequest(id=f"r{i}", prompt=f"prompt {i}", seed=i, height=height, width=48,
                                        num_inference_steps=None, guidance_scale=None, num_images=1, source="s",
                                        line=i + 1), 0) for i in range(first, first + n)]


@pytest.fixture
def handler(tmp_path):
    return Flux2KleinModelHandler(str(tmp_path), dtype="float32", inference_retries=0, inference_timeout_s=0)


def _ids(results) -> list[str]:
    return [r.example.request.id for r in results]


def test_a_batch_that_does_not_fit_runs_in_halves_down_to_what_fits(handler):
    model = HoldsAtMost(1)
    batch = _tasks(4)
    results = handler.run_inference(batch, model)
    assert _ids(results) == ["r0", "r1", "r2", "r3"]  # every image, in the batch's order
    assert [int(r.inference.pixels[0, 0, 0]) for r in results] == [0, 1, 2, 3]  # each image its own seed's
    assert model.calls == [4, 2, 1, 1, 1, 1]  # 4 and 2 ran out of memory; the second half starts below 2 at once
    model.calls.clear()
    assert _ids(handler.run_inference(_tasks(4, first=4), model)) == ["r4", "r5", "r6", "r7"]
    assert model.calls == [1, 1, 1, 1], "a later batch of the shape tried a size that had run out of memory"
    model.calls.clear()
    handler.run_inference(_tasks(2, height=64), model)  # another shape: its own attempt
    assert model.calls == [2, 1, 1]


def test_later_batches_start_at_the_largest_size_below_the_failure(handler):
    model = HoldsAtMost(2)
    assert _ids(handler.run_inference(_tasks(3), model)) == ["r0", "r1", "r2"]
    assert model.calls == [3, 2, 1]
    model.calls.clear()
    handler.run_inference(_tasks(4), model)
    assert model.calls == [2, 2]


def test_what_does_not_fit_alone_or_is_not_memory_still_fails(handler):
    model = HoldsAtMost(0)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        handler.run_inference(_tasks(2), model)
    assert model.calls == [2, 1]  # the first single image fails: the batch's images become error rows
    broken = HoldsAtMost(4, error=ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        handler.run_inference(_tasks(3, height=64), broken)
    assert broken.calls == [3], "only running out of memory splits a batch"


def test_a_short_batch_padded_to_the_engines_batch_runs_compiled_for_fewer_images(tmp_path):
    """The engine's batch of 4 pads a batch of 3, or a lone image, to 4: running it again in parts of the same
    compiled batch would run out of memory again. The parts compile for fewer images instead."""
    handler = Flux2KleinModelHandler(str(tmp_path), dtype="float32", batch_size=4, inference_retries=0,
                                     inference_timeout_s=0)
    model = HoldsAtMost(1, engine_batch=4)
    assert _ids(handler.run_inference(_tasks(3), model)) == ["r0", "r1", "r2"]
    assert list(zip(model.calls, model.compiled)) == [(3, 4), (2, 2), (1, 1), (1, 1), (1, 1)]
    model.calls.clear(), model.compiled.clear()
    assert _ids(handler.run_inference(_tasks(1, height=64), model)) == ["r0"]  # a lone image of another shape
    assert list(zip(model.calls, model.compiled)) == [(1, 4), (1, 1)]
    model.calls.clear(), model.compiled.clear()
    handler.run_inference(_tasks(2, height=64), model)  # its shape's later batches start at what fitted
    assert list(zip(model.calls, model.compiled)) == [(1, 1), (1, 1)]


def test_a_generate_call_s_result_crosses_to_another_process_without_jax():
    """A shared model (--large_model) hands the model's own GenerationResult to the process that asked: unpickling
    it there imports no JAX, and the handler slices it into the GeneratedImage every sink receives."""
    import os
    import pickle
    import subprocess
    import sys

    from model.engine.results import NonFinite
    from transforms.inference import split_result

    result = GenerationResult(images=np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3),
                              prompt_truncated=(True, False), num_inference_steps=4, guidance_scale=1.0, model="m",
                              seconds=0.5, nonfinite=(None, NonFinite("decode", 0.25)))
    code = ("import pickle, sys; r = pickle.loads(sys.stdin.buffer.read()); "
            "print(type(r).__name__, 'jax' in sys.modules, r.nonfinite[1].describe())")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(result), cwd=repo, env=env,
                         capture_output=True, check=True, timeout=120)
    assert out.stdout.decode().split(" ", 2)[:2] == ["GenerationResult", "False"]
    images = [p.inference for p in split_result(_tasks(2), result)]
    assert [im.prompt_truncated for im in images] == [True, False] and images[0].generation_ms == 250.0
    assert (images[1].pixels == result.images[1]).all() and images[0].nonfinite is None
    assert images[1].nonfinite == "non-finite values after decode: 25.0% of the values are NaN or inf"
