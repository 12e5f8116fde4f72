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
