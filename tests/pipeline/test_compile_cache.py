"""The shared compilation cache is on by default: a second run of the same job compiles nothing.

Each run is its own process (as a worker is), without the suite's JAX_COMPILATION_CACHE_DIR, with the project's
cache folder in a temporary place; compilations and cache hits are read from the job's `xla_*` counters.
"""

import os
import re
import subprocess
import sys

from pipeline.compile_cache import SHARED_FOLDER, resolve_compilation_cache
from pipeline_helpers import MODEL_ARGS, ckpt32  # noqa: F401 - ckpt32 is a fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_folders(monkeypatch, tmp_path):
    monkeypatch.setenv("FLUX2_KLEIN_CACHE", str(tmp_path))
    assert resolve_compilation_cache(None, local_runner=True, temp_location=None) == str(tmp_path / "xla")
    assert resolve_compilation_cache("auto", local_runner=False, temp_location="gs://b/tmp/") == \
        f"gs://b/tmp/{SHARED_FOLDER}"
    assert resolve_compilation_cache(None, local_runner=False, temp_location=None) is None
    assert resolve_compilation_cache("off", local_runner=True, temp_location=None) is None
    assert resolve_compilation_cache("gs://c/x", local_runner=False, temp_location="gs://b/t") == "gs://c/x"


def _run(ckpt, tmp_path, name, *extra) -> dict:
    source = tmp_path / "prompts.txt"
    source.write_text("a red fox\na lighthouse\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")
           and not k.startswith("JAX_PERSISTENT_CACHE")}
    env.update(FLUX2_KLEIN_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "pipeline.run", f"--model={ckpt}", f"--input={source}",
                          f"--output={tmp_path / name}", *MODEL_ARGS, "--runner=FnApiRunner", "--no_progress", *extra],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = dict(re.findall(r"\b(xla_\w+)=(\d+)", out.stdout + out.stderr))
    return {k: int(v) for k, v in metrics.items()}


def test_second_run_compiles_nothing(ckpt32, tmp_path):
    first = _run(ckpt32, tmp_path, "one")
    assert first.get("xla_compiles", 0) > 0, first
    assert os.listdir(tmp_path / "cache" / "xla")  # the programs were written to the default folder
    second = _run(ckpt32, tmp_path, "two")
    assert second.get("xla_compiles", 0) == 0 and second.get("xla_cache_hits", 0) > 0, second


# The preflight's compile on this machine's own devices (what `--topology=attached` does on a TPU machine, here on
# the CPU device), writing to the compilation cache `argv[2]`, as the launch's child preflight does.
_PREFLIGHT_HERE = """
import sys
import jax
from model import enable_compilation_cache, fit, read_config
from model.preflight.topology import CHIPS, Topology

enable_compilation_cache(sys.argv[2])
here = Topology(name="this machine", devices=tuple(jax.devices()), chip=CHIPS["TPU v5 lite"], devices_per_chip=1,
                hosts=1)
report = fit(read_config(sys.argv[1]), here, model=sys.argv[1], dtype="float32", height=32, width=64, batch_size=1,
             text_len=int(sys.argv[3]))
assert report.fits, report
"""
BIG_PROGRAMS = ("jit_encode-", "jit_denoise-", "jit_decode-")


def _big_entries(cache) -> set:
    return {name for name in os.listdir(cache) if name.startswith(BIG_PROGRAMS)}


def test_the_job_finds_the_programs_the_preflight_compiled_on_its_devices(ckpt32, tmp_path):
    """After the preflight has compiled the job's programs for this machine's devices into the job's compilation
    cache, the job's first compile of encode, denoise and decode is a cache hit: no entry of its own is written for
    them (a program that differed in its text, shardings, donation or compiler options would be compiled and
    written under another key)."""
    cache = tmp_path / "xla"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get(
        "PYTHONPATH")))))
    out = subprocess.run([sys.executable, "-c", _PREFLIGHT_HERE, ckpt32, str(cache), "32"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = _big_entries(cache)
    assert len(compiled) == 3, sorted(os.listdir(cache))
    job = _run(ckpt32, tmp_path, "job", "--batch_size=1", f"--compilation_cache_dir={cache}")
    assert _big_entries(cache) == compiled, sorted(_big_entries(cache) - compiled)  # nothing compiled again
    assert job.get("xla_cache_hits", 0) >= 3, job
