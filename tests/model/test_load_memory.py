"""Host memory while loading stays bounded: beyond the parameters themselves (which a CPU "device" keeps in host
memory; an accelerator keeps them on the chip), the loader holds about one tensor per loading thread, whatever the
model's size. Measured in a fresh process as its peak RSS (VmHWM, which exec resets)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r'''
import json, os, sys
import numpy as np
import jax
from flax import nnx
from safetensors.numpy import save_file
from model.loading import loader, safetensors_file

folder, layers, rows, cols, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]


class Big(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(rows, cols, use_bias=False, rngs=rngs) for _ in range(layers)])


rng = np.random.default_rng(0)
save_file({f"layers.{i}.kernel": rng.standard_normal((cols, rows), dtype=np.float32) for i in range(layers)},
          os.path.join(folder, "model.safetensors"))
abstract = nnx.eval_shape(lambda: Big(nnx.Rngs(0)))
expected = loader.expected_tensors(abstract)
loader.LOAD_THREADS = 2
if keep == "keep":  # a faulty loader for the test's own check: every tensor's host copy kept until the end
    kept, plain = [], safetensors_file.SafetensorsFile.read
    reader = safetensors_file.SafetensorsFile
    reader.read = lambda self, name, buffers=None: kept.append(plain(self, name, buffers)) or kept[-1]


def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


jax.devices()
before = status_kib("VmRSS")
module = loader.load_component(folder, abstract, expected=expected)
peak = status_kib("VmHWM")
params = sum(v.nbytes for v in jax.tree.leaves(nnx.state(module)))
print(json.dumps({"before_kib": before, "peak_kib": peak, "param_bytes": params, "tensor_bytes": rows * cols * 4}))
'''


def _peak(tmp_path, keep="no"):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), "12", "1024", "16384", keep], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _overhead_within_bound(r) -> tuple[bool, float, float]:
    """(peak minus the parameters within the bound, that overhead in MB, the bound in MB): about one tensor in flight
    per loading thread (2 here) and its layout copy, plus 200 MB for the runtime's own allocations."""
    overhead = (r["peak_kib"] - r["before_kib"]) * 1024 - r["param_bytes"]
    bound = 4 * r["tensor_bytes"] + 200e6
    return overhead <= bound, overhead / 1e6, bound / 1e6


def test_loading_holds_about_one_tensor_per_thread_beyond_the_parameters(tmp_path):
    r = _peak(tmp_path)
    ok, overhead_mb, bound_mb = _overhead_within_bound(r)
    print(f"loading 12 x 64 MB: {overhead_mb:.0f} MB over the parameters at the peak (bound {bound_mb:.0f} MB)")
    assert ok, r


def test_the_bound_catches_a_loader_that_keeps_its_host_copies(tmp_path):
    ok, overhead_mb, _ = _overhead_within_bound(_peak(tmp_path, keep="keep"))
    assert not ok, f"a loader that keeps every tensor's host copy stayed within the bound ({overhead_mb:.0f} MB)"
