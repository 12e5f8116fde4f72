"""The threaded loader (model.loading.loader.load_component) gives exactly the parameters a plain one-tensor-at-a-time
read gives: every tensor of every component, bf16 and float32, on one device and split over 4 CPU devices, with the
layout made on the host (CPU's path) and by the device (the accelerators' path, forced here on CPU devices)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

CHECK = r'''
import json
import sys
import traceback

import jax
import numpy as np
import model
import model.loading.loader
from model.options import LoadSettings
from model.parallel import shard_order
from model.loading.loader import flat_params, to_jax_axes
from model.loading.safetensors_file import open_component


def check(path, dtype, shards, layout="host"):
    """Every parameter of the loaded generator equals the plain read of its tensor, bit for bit; their number.
    `layout`: "device" transposes on the (CPU) devices, as the loader does on accelerators."""
    platforms = model.loading.loader.DEVICE_TRANSPOSE_PLATFORMS
    model.loading.loader.DEVICE_TRANSPOSE_PLATFORMS = ("cpu", "tpu", "gpu") if layout == "device" else ()
    settings = LoadSettings.create(path, dtype, max_sequence_length=32, model_shards=shards)
    transposes = model.loading.loader.DEVICE_TRANSPOSES
    transposes.clear()
    prepared = []
    plain_prepare = model.loading.loader.prepare_device_transposes

    def prepare(components, placement):  # what the load compiles ahead, from the shapes and headers alone
        prepared.append(plain_prepare(components, placement))
        return prepared[-1]

    model.loading.loader.prepare_device_transposes = prepare
    try:
        gen = model.load(settings)
    finally:
        model.loading.loader.DEVICE_TRANSPOSE_PLATFORMS = platforms
        model.loading.loader.prepare_device_transposes = plain_prepare
    # Every transpose the weights took was among those prepared before the first tensor was read: none compiled
    # on the loading threads.
    assert prepared and prepared[0] == len(transposes), (prepared, len(transposes))
    assert (len(transposes) > 0) == (layout == "device"), len(transposes)
    te, tr, vae = gen.programs.modules()
    checked = placed_bytes = 0
    for folder, module in (("text_encoder", te), ("transformer", tr), ("vae", vae)):
        files = open_component(f"{path}/{folder}")
        perms = shard_order.stored_to_order(module)
        for name, value in flat_params(module).items():
            sf = files[name]
            want = to_jax_axes(name, sf.read(name), value.ndim)
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
            placed_bytes += want.nbytes
    phases = gen.load_phases  # what the loader reports having read and placed: exactly these tensors
    assert (phases["tensors"], phases["bytes"]) == (checked, placed_bytes), (phases, checked, placed_bytes)
    assert all(phases[k] >= 0 for k in ("read_s", "host_layout_s", "transfer_s", "device_layout_s", "prepare_s",
                                        "wall_s", "finish_s", "runtime_start_s",
                                        "runtime_wait_s")), phases
    return checked


if __name__ == "__main__":  # path, then dtype:shards:layout cases; one JSON line {case: parameters checked, or error}
    results = {}
    for case in sys.argv[2:]:
        dtype, shards, layout = case.split(":")
        try:
            results[case] = check(sys.argv[1], dtype, int(shards), layout)
        except Exception:  # noqa: BLE001 - reported per case
            results[case] = traceback.format_exc()
    print(json.dumps(results))
'''

# On one device the check runs in this (one-device) process; the split cases run together in one process with four
# CPU devices (a process per case cost its start-up and imports each time).
# Each path split once: the host layout over 2 devices in bf16, the device layout over 4 in float32 (the one-device
# cases cover the other dtype of each path).
SPLIT = [("bfloat16", 2, "host"), ("float32", 4, "device")]


@pytest.fixture(scope="module")
def split_results(tiny_ckpt):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    cases = (":".join(map(str, case)) for case in SPLIT)
    out = subprocess.run([sys.executable, "-c", CHECK, tiny_ckpt, *cases], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype,shards,layout", [("bfloat16", 1, "host"), ("float32", 1, "host"),
                                                ("bfloat16", 1, "device"), *SPLIT])
def test_threaded_loader_is_bit_identical_to_plain_reads(tiny_ckpt, dtype, shards, layout, request):
    if shards == 1:
        namespace = {"__name__": "parallel_loader_check"}
        exec(CHECK, namespace)  # noqa: S102 - the same check as the four-device process runs
        checked = namespace["check"](tiny_ckpt, dtype, 1, layout)
    else:
        checked = request.getfixturevalue("split_results")[f"{dtype}:{shards}:{layout}"]
        assert isinstance(checked, int), checked  # else the traceback of that case
    assert checked > 50


@pytest.mark.parametrize("shape", [(37, 53), (1030, 700), (512, 1536)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_contiguous_copies_transposed_weights_exactly(shape, dtype):
    """Transposed matrices (copied by blocks, edge blocks partial) and a conv kernel's 4-D transpose, byte for byte."""
    import ml_dtypes

    from model.loading.loader import contiguous

    rng = np.random.default_rng(0)
    a = rng.standard_normal(shape).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    for view in (a.T, a.reshape(shape[0], shape[1], 1, 1).transpose(2, 3, 1, 0)):
        got = contiguous(view)
        assert got.flags.c_contiguous and got.dtype == a.dtype and got.shape == view.shape
        assert got.tobytes() == np.ascontiguousarray(view).tobytes()


@pytest.mark.parametrize("chunk", [1000, 4096, 1 << 20])
def test_tensors_read_in_chunks_equal_safetensors_own_reads(tmp_path, monkeypatch, chunk):
    """A tensor larger than a read (chunks that split elements, and a short last chunk) is read on the shared
    reading threads byte for byte as the safetensors library reads it."""
    import ml_dtypes
    import torch
    from safetensors.torch import save_file

    from model.loading import safetensors_file

    monkeypatch.setattr(safetensors_file, "READ_CHUNK_BYTES", chunk)
    torch.manual_seed(0)
    tensors = {"a": torch.randn(333, 257, dtype=torch.bfloat16), "b": torch.randn(1001, dtype=torch.float32),
               "c": torch.randn(3, dtype=torch.float16), "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    sf = safetensors_file.SafetensorsFile(path)
    buffers = safetensors_file.ReadBuffers()  # as the loader reads: each tensor into the thread's one reused buffer
    for name, t in tensors.items():
        want = t.float().numpy().astype(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
        for got in (sf.read(name), sf.read(name, buffers)):
            assert got.shape == tuple(t.shape) and got.dtype == want.dtype, name
            assert got.tobytes() == want.tobytes(), name


def test_each_loading_thread_reads_into_one_buffer_grown_up_to_a_cap():
    """A thread's next tensor goes into the same memory (fresh pages were the v5e host's slowest step), grown when
    a tensor needs more; a tensor past the cap gets its own memory and the thread keeps its buffer; threads never
    share one."""
    from concurrent.futures import ThreadPoolExecutor

    from model.loading.safetensors_file import ReadBuffers

    buffers = ReadBuffers(max_bytes=1 << 20)
    first = buffers.take(1000)
    assert buffers.take(500).ctypes.data == first.ctypes.data and buffers.take(500).nbytes == 500
    grown = buffers.take(4000)
    assert grown.nbytes == 4000 and buffers.take(3000).ctypes.data == grown.ctypes.data
    past_cap = buffers.take(2 << 20)
    assert past_cap.nbytes == 2 << 20 and past_cap.ctypes.data != grown.ctypes.data
    assert buffers.take(10).ctypes.data == grown.ctypes.data
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(lambda: buffers.take(10).ctypes.data != grown.ctypes.data).result()


def test_a_thread_gives_up_its_buffer_when_the_placed_array_uses_that_memory():
    """Reuse needs the device to hold its own copy. JAX's CPU backend places 64-byte aligned host memory as is (and
    copies other memory): the thread then takes new memory for its next tensor, and the placed values stay."""
    import jax

    from model.loading.safetensors_file import ReadBuffers

    buffers = ReadBuffers()
    raw = buffers.take(1 << 16)
    aligned = (-raw.ctypes.data) % 64
    unaligned = raw[aligned + 8:aligned + 8 + 4096].view(np.float32)
    unaligned[:] = np.arange(1024)
    copied = jax.device_put(unaligned).block_until_ready()
    assert copied.unsafe_buffer_pointer() != unaligned.ctypes.data
    buffers.keep_unless_aliased(copied)
    assert buffers.take(1 << 16).ctypes.data == raw.ctypes.data  # a copy: the buffer is kept
    values = raw[aligned:aligned + 4096].view(np.float32)
    values[:] = np.arange(1024)
    aliased = jax.device_put(values).block_until_ready()
    assert aliased.unsafe_buffer_pointer() == values.ctypes.data  # the same memory, really
    buffers.keep_unless_aliased(aliased)
    refilled = buffers.take(1 << 16)
    refilled[:] = 0
    assert refilled.ctypes.data != raw.ctypes.data
    assert np.array_equal(np.asarray(aliased), np.arange(1024, dtype=np.float32))


def test_a_file_cut_short_after_validation_fails_the_read_naming_file_and_tensor(tmp_path, monkeypatch):
    """The file shrinks between the header check and the read (a copy still being written, a shrinking mount):
    the chunked read stops with a CheckpointError naming the file and the tensor, not with zeros."""
    import torch
    from safetensors.torch import save_file

    from model.loading import safetensors_file
    from model.errors import CheckpointError

    monkeypatch.setattr(safetensors_file, "READ_CHUNK_BYTES", 4096)
    path = str(tmp_path / "w.safetensors")
    save_file({"big": torch.randn(64, 1024)}, path)
    sf = safetensors_file.SafetensorsFile(path)
    os.truncate(path, os.path.getsize(path) - 50_000)
    for buffers in (None, safetensors_file.ReadBuffers()):  # into a fresh array, and into a loading thread's buffer
        with pytest.raises(CheckpointError) as err:
            sf.read("big", buffers)
        assert "ended before the tensor's data" in str(err.value)
        assert path in str(err.value) and "big" in str(err.value)
