"""Two worker processes that reach the same programs at the same moment, with one empty compilation cache: only one
compiles each program, the other waits for its lease and then finds the program in the cache."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = """
import json, os, sys, time
import jax.numpy as jnp
import model
from model.engine.compile_events import counts
from model.options import EngineOptions, LoadSettings

ckpt, cache, barrier = sys.argv[1:4]
counts()
gen = model.load(LoadSettings(model=ckpt, dtype="float32", max_sequence_length=16,
                              engine=EngineOptions(batch_size=1, compilation_cache_dir=cache)))
inputs = gen.check_inputs(["a red fox"], [0], 32, 48, num_inference_steps=None, guidance_scale=None)
# The small eager programs around the bucket's (RoPE tables, schedule, the guidance scalar) made before counting,
# so that only the bucket's three programs compile under the counters
grid = gen.latent_grid(32, 48)
gen.rope(*grid), gen.schedule(inputs.num_inference_steps, *grid), jnp.float32(inputs.guidance_scale)
open(os.path.join(barrier, str(os.getpid())), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(barrier)) < 2 and time.monotonic() < deadline:  # both loaded: compile at the same moment
    time.sleep(0.01)
before = counts()
gen.prepare_bucket(inputs)
after = counts()
print(json.dumps({k: after[k] - before[k] for k in after}))
"""


def test_two_workers_compile_each_program_once(tiny_ckpt, tmp_path):
    cache, barrier = tmp_path / "xla", tmp_path / "barrier"
    barrier.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p))
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, tiny_ckpt, str(cache), str(barrier)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    results = []
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    # Each of the bucket's programs (encode, denoise, decode) compiled by one worker only; the other waited for its
    # lease and then loaded it from the cache.
    assert sum(r["compiles"] for r in results) == 3, results
    assert sum(r["cache_hits"] for r in results) == 3, results
    assert sum(r["lease_waits"] for r in results) == 3, results
    assert os.listdir(cache / "leases") == []  # every lease removed
