"""A local run on a machine without a TPU prints no TPU-runtime lines, even with libtpu installed (the [test] and
[preflight] extras install it): JAX is kept to the CPU before it starts."""

import os
import subprocess
import sys

import pytest

from pipeline_helpers import MODEL_ARGS, ckpt32  # noqa: F401 - ckpt32 is a fixture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOISE = ("could not determine TPU", "INVALID_ARGUMENT", "libtpu", "TPU_WORKER_HOSTNAMES", "E0000", "InitGoogle")


def test_a_local_run_prints_no_tpu_runtime_lines(ckpt32, tmp_path):
    pytest.importorskip("libtpu", reason="the noise comes from libtpu, which is not installed here")
    if any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0")):
        pytest.skip("this machine has a TPU")
    source = tmp_path / "prompts.txt"
    source.write_text("a red fox\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user's shell has it
    out = subprocess.run([sys.executable, "-m", "pipeline.run", f"--model={ckpt32}", f"--input={source}",
                          f"--output={tmp_path / 'out'}", *MODEL_ARGS, "--runner=FnApiRunner", "--no_progress"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    noisy = [line for line in out.stderr.splitlines() if any(word in line for word in NOISE)]
    assert not noisy, noisy
