"""The threaded loader (model.weights.load_component) gives exactly the parameters a plain one-tensor-at-a-time read
gives: every tensor of every component, bf16 and float32, on one device and split over 4 CPU devices."""

import os
import subprocess
import sys

import numpy as np
import pytest

CHECK = r'''
import sys
import jax
import numpy as np
from flax import nnx
import model
from model import shard_layout
from model.weights import SafetensorsFile, flat_params, open_component, to_jax_layout

path, dtype, shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
gen = model.load(path, dtype, max_sequence_length=32, model_shards=shards)
te, tr, vae = gen.programs.modules()
checked = 0
for folder, module in (("text_encoder", te), ("transformer", tr), ("vae", vae)):
    files = open_component(f"{path}/{folder}")
    perms = shard_layout.stored_to_layout(module)
    for name, value in flat_params(module).items():
        sf = files[name]
        want = to_jax_layout(name, sf.read(name), value.ndim)
        key = tuple(int(p) if p.isdigit() else p for p in name.split("."))
        if key in perms:
            order, axis = perms[key]
            want = np.take(want, order, axis=axis)
        want = np.asarray(want.astype(value.dtype))
        got = np.asarray(jax.device_get(value))
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), f"{name} differs"
        if shards > 1 and value.ndim == 2:
            assert len(value.sharding.device_set) == len(jax.devices()), name
        checked += 1
print("checked", checked)
'''


@pytest.mark.parametrize("dtype,shards", [("bfloat16", 1), ("float32", 1), ("bfloat16", 2), ("float32", 4)])
def test_threaded_loader_is_bit_identical_to_plain_reads(tiny_ckpt, dtype, shards):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if shards > 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    out = subprocess.run([sys.executable, "-c", CHECK, tiny_ckpt, dtype, str(shards)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 50


@pytest.mark.parametrize("shape", [(37, 53), (1030, 700), (512, 1536)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_contiguous_copies_transposed_weights_exactly(shape, dtype):
    """Transposed matrices (copied by blocks, edge blocks partial) and a conv kernel's 4-D transpose, byte for byte."""
    import ml_dtypes

    from model.weights import contiguous

    rng = np.random.default_rng(0)
    a = rng.standard_normal(shape).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    for view in (a.T, a.reshape(shape[0], shape[1], 1, 1).transpose(2, 3, 1, 0)):
        got = contiguous(view)
        assert got.flags.c_contiguous and got.dtype == a.dtype and got.shape == view.shape
        assert got.tobytes() == np.ascontiguousarray(view).tobytes()
