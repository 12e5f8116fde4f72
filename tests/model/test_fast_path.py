"""The fast path: every EngineOptions switch gives the default's images, no compilation in steady state, prompt
de-duplication, the bounded embedding cache, data parallelism on 4 CPU devices."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

KW = dict(dtype="float32", max_sequence_length=32)
PROMPTS = ["a red fox in the snow", "a lighthouse at night", "a red fox in the snow"]  # one repeated prompt
SEEDS = [1, 2, 3]
SIZE = dict(height=32, width=48, num_inference_steps=2)
from paths import REPO  # noqa: E402


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    return int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max())


class CompileEvents:
    """Counts XLA backend compilations (persistent-cache reads included) while active."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _on(self, event, duration, **kw):
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._on)


@pytest.fixture(scope="module")
def default_gen(tiny_ckpt):
    import model

    return model.load(tiny_ckpt, **KW)


@pytest.fixture(scope="module")
def base_gen(tiny_base_ckpt):
    """The base (CFG) checkpoint with the default options, shared by the CFG tests of this module."""
    import model

    return model.load(tiny_base_ckpt, **KW)


@pytest.fixture(scope="module")
def default_images(default_gen):
    return default_gen.generate(PROMPTS, SEEDS, **SIZE)


@pytest.fixture
def restore_compilation_cache():
    """Options with compilation_cache_dir switch JAX's persistent cache on process-wide; switch it back off."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


# ------------------------------------------------------------------------------------------------ every switch

# Each EngineOptions field -> the options that turn it off (or change it) for the equality test. How the programs
# compute on each platform is not an option (model.nets.platform_forms): tests/model/test_model_parity.py checks each
# form against diffusers, test_heads_kernel.py the TPU heads kernel (interpreted), tests/pipeline/test_preflight.py and
# tests/tpu their use on TPUs.
SWITCHES = {
    "embed_cache_size": dict(embed_cache_size=0),
    "attention": dict(attention="xla"),  # not CPU's choice (blocked)
    "text_encoder_attention": dict(text_encoder_attention="xla"),
    "platform": dict(platform="cpu"),  # the backend's devices by name: the same images as the default one here
    "model_shards": dict(model_shards=1),  # one device here; 2 and 4 shards: the four-device tests
    "batch_size": dict(batch_size=2),  # 3 images: a full batch and a short final batch padded to 2
    "compilation_cache_dir": "tmp_cache_dir",
    "max_buckets": dict(max_buckets=None),  # every bucket's programs kept
}

# Switches that change the images on purpose, and the test that bounds how much.
CHANGES_IMAGES = {"quantize": "tests/model/test_quantize.py (int8 within the drift bounds of bf16)"}


def test_splash_kernel_gives_default_images(tiny_ckpt, default_images):
    """The TPU splash kernel (here in Pallas interpret mode) for the transformer and for the masked text encoder."""
    import model
    from model.engine.programs import EngineOptions

    gen = model.load(tiny_ckpt, options=EngineOptions(attention="splash", text_encoder_attention="splash"), **KW)
    assert max_diff(gen.generate(PROMPTS, SEEDS, **SIZE), default_images) <= 1


def _switch_fields():
    from model.options import EngineOptions

    return {f.name for f in dataclasses.fields(EngineOptions)}


def test_every_switch_is_covered():
    fields = _switch_fields()
    known = set(SWITCHES) | set(CHANGES_IMAGES)
    assert fields <= known, f"add the new EngineOptions switches to SWITCHES: {sorted(fields - known)}"


# The slowest switch, covered elsewhere, runs with -m slow (CI time): compilation_cache_dir by
# tests/pipeline/test_compile_cache.py.
SLOW_SWITCHES = {"compilation_cache_dir"}


@pytest.mark.parametrize("switch", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SWITCHES else s
                                    for s in sorted(SWITCHES)])
def test_switch_gives_default_images(switch, tiny_ckpt, default_images, tmp_path, restore_compilation_cache):
    import model

    if switch not in _switch_fields():
        pytest.skip(f"EngineOptions has no {switch!r} switch")
    change = SWITCHES[switch]
    if change == "tmp_cache_dir":
        options = dict(compilation_cache_dir=str(tmp_path / "xla-cache"))
    else:
        options = change
    gen = model.load(tiny_ckpt, **options, **KW)
    images = gen.generate(PROMPTS, SEEDS, **SIZE)
    assert max_diff(images, default_images) <= 1, f"{switch}: images differ from the default by more than 1/255"
    if change == "tmp_cache_dir":
        assert os.listdir(tmp_path / "xla-cache"), "the persistent compilation cache folder stayed empty"


def test_the_text_encoders_identical_layers_are_traced_once(tiny_ckpt, monkeypatch):
    """The text encoder's 27 layers run (and lower) as one traced function, called 27 times."""
    import collections

    import model
    from model.nets import qwen3

    traced = collections.Counter()
    original = qwen3.Qwen3DecoderLayer.__call__

    def counting(self, *args, **kwargs):
        traced["layer"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(qwen3.Qwen3DecoderLayer, "__call__", counting)
    gen = model.load(tiny_ckpt, **KW)
    gen.generate(PROMPTS[:1], SEEDS[:1], **SIZE)
    assert traced["layer"] == 1, traced
    assert len(gen.programs.modules()[0].model.layers) > 1


# ------------------------------------------------------------------------------------------------ steady state


def test_no_compilation_after_warm_up(tiny_ckpt):
    import model

    gen = model.load(tiny_ckpt, batch_size=2, **KW)
    gen.generate(PROMPTS, SEEDS, **SIZE)  # warm-up: one full batch and one short batch padded to 2
    compiled = gen.programs.compile_count
    with CompileEvents() as events:
        a = gen.generate(["a green cactus", "a blue boat", "a yellow kite"], [7, 8, 9], **SIZE)  # new prompts
        b = gen.generate(["a single short batch"], [10], **SIZE)  # short batch only
        c = gen.generate(["a blue boat"], [8], num_images_per_prompt=2, **SIZE)  # embedding-cache hit
    assert events.count == 0, f"{events.count} compilations after warm-up"
    assert gen.programs.compile_count == compiled
    assert a.shape == (3, 32, 48, 3) and b.shape == (1, 32, 48, 3) and c.shape == (2, 32, 48, 3)
    assert max_diff(a[1:2], c[:1]) <= 1  # padding and the cache change nothing


def test_buckets_beyond_max_buckets_are_dropped_least_recently_used_first(tiny_ckpt):
    """A worker asked for many sizes keeps the programs, RoPE tables and schedules of the `max_buckets` most
    recently used buckets only; a dropped bucket that comes back is compiled again and gives the same images."""
    import model

    gen = model.load(tiny_ckpt, max_buckets=2, **KW)
    sizes = [dict(height=32, width=48), dict(height=48, width=32), dict(height=32, width=32)]
    first = [gen.generate(PROMPTS[:1], SEEDS[:1], num_inference_steps=2, **hw) for hw in sizes]
    assert gen.programs.compile_count == 9
    programs, ropes, schedules = gen.programs._compiled, gen._rope_cache, gen._schedule_cache
    assert len(programs) == len(ropes) == len(schedules) == 2
    grids = [gen.latent_grid(hw["height"], hw["width"]) for hw in sizes]
    assert [(b.grid_h, b.grid_w) for b in programs] == grids[1:]  # 32x48 was the least recently used
    # RoPE tables are keyed by the target grid and the reference grids (none for text-to-image)
    assert list(ropes) == [(*g, ()) for g in grids[1:]] and programs.evictions == ropes.evictions == 1
    assert schedules.evictions == 0  # schedules depend on the token count only: 32x48 and 48x32 share one
    with CompileEvents() as events:
        again = gen.generate(PROMPTS[:1], SEEDS[:1], num_inference_steps=2, **sizes[2])  # kept: no compilation
    assert events.count == 0 and max_diff(again, first[2]) == 0
    back = gen.generate(PROMPTS[:1], SEEDS[:1], num_inference_steps=2, **sizes[0])  # dropped: compiled again
    assert gen.programs.compile_count == 12 and max_diff(back, first[0]) == 0
    assert [(b.grid_h, b.grid_w) for b in programs] == [grids[2], grids[0]]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_max_buckets_must_be_a_positive_integer_or_none(tiny_ckpt, bad):
    import model

    with pytest.raises(ValueError, match=f"max_buckets must be None or an integer >= 1, got {bad!r}"):
        model.load(tiny_ckpt, max_buckets=bad, **KW)


@pytest.mark.parametrize("bad", [None, 2.5, True, "8"])
def test_embed_cache_size_must_be_an_integer(tiny_ckpt, bad):
    """Refused by the options, by their own name, before anything is loaded (0 or less turns the cache off)."""
    import model
    from model.engine.programs import EngineOptions

    with pytest.raises(ValueError, match=f"embed_cache_size must be an integer .*, got {bad!r}"):
        model.load(tiny_ckpt, embed_cache_size=bad, **KW)
    batch_size = 0 if bad is None else bad  # None is a valid batch size (the number of images asked for)
    with pytest.raises(ValueError, match=f"batch_size must be an integer >= 1, got {batch_size!r}"):
        EngineOptions(batch_size=batch_size)  # the options refuse it themselves, not only load()


def test_lru_cache_makes_each_value_once_and_drops_the_least_recently_used():
    from model.engine.lru import LRUCache

    made = []
    cache = LRUCache(2, "test")
    get = lambda k: cache.get_or_make(k, lambda: made.append(k) or k.upper())  # noqa: E731
    assert [get("a"), get("b"), get("a"), get("c")] == ["A", "B", "A", "C"]  # "b" is now the least recent
    assert made == ["a", "b", "c"] and list(cache) == ["a", "c"] and "b" not in cache and cache.evictions == 1
    assert get("b") == "B" and made[-1] == "b" and list(cache) == ["c", "b"]
    unbounded = LRUCache(None)
    for i in range(100):
        unbounded.get_or_make(i, lambda: i)
    assert len(unbounded) == 100 and unbounded.evictions == 0
    with pytest.raises(ValueError, match="size must be None or an integer >= 1, got 0"):
        LRUCache(0)


def test_compile_events_are_seen(tiny_ckpt):
    """The listener used above does see compilations (so zero means zero)."""
    import jax
    import jax.numpy as jnp

    with CompileEvents() as events:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7)).block_until_ready()
    assert events.count >= 1


# ------------------------------------------------------------------------------------------------ prompts


def test_identical_prompts_are_encoded_once(tiny_ckpt):
    import model

    gen = model.load(tiny_ckpt, embed_cache_size=0, **KW)
    n0 = gen.stats["prompts_encoded"]
    images = gen.generate(["same", "same", "other", "same"], [1, 2, 3, 4], **SIZE)
    assert gen.stats["prompts_encoded"] - n0 == 2
    n1 = gen.stats["prompts_encoded"]
    many = gen.generate(["one prompt"], [11], num_images_per_prompt=3, **SIZE)
    assert gen.stats["prompts_encoded"] - n1 == 1
    assert many.shape[0] == 3 and max_diff(many[0], many[1]) > 0  # seeds 11, 12, 13 differ
    # each row got its own prompt's embedding back: as if generated alone
    assert max_diff(images[2:], gen.generate(["other", "same"], [3, 4], **SIZE)) == 0


def test_embedding_cache_is_bounded_and_reused(tiny_ckpt):
    import model

    gen = model.load(tiny_ckpt, embed_cache_size=2, batch_size=1, **KW)
    first = gen.generate(["p0"], [0], **SIZE)
    for i in range(1, 5):
        gen.generate([f"p{i}"], [i], **SIZE)
        assert len(gen._embed_cache) <= 2
    assert list(gen._embed_cache) == ["p3", "p4"]  # least recently used evicted first
    encoded, hits = gen.stats["prompts_encoded"], gen.stats["embed_cache_hits"]
    gen.generate(["p4"], [4], **SIZE)
    assert gen.stats["prompts_encoded"] == encoded and gen.stats["embed_cache_hits"] == hits + 1
    again = gen.generate(["p0"], [0], **SIZE)  # evicted: encoded again, same image
    assert gen.stats["prompts_encoded"] == encoded + 1
    assert max_diff(first, again) == 0
    assert len(gen._embed_cache) == 2


# ------------------------------------------------------------------------------------------------ devices

# The images of one device come from this (one-device) test process, where the module's generators have compiled
# their programs already; the four-device process computes only the parallel images and compares them with those.
DP_PROMPTS = ["a red fox", "a lighthouse", "a red fox", "", "a kite"]  # 5 images, padded to 8 = 2 per device
DP_ARGS = dict(prompts=DP_PROMPTS, seeds=[1, 2, 3, 4, 5], height=32, width=48, num_inference_steps=2)

DATA_PARALLEL_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, jax, model
    assert len(jax.devices()) == 4, jax.devices()
    kw = dict(dtype="float32", max_sequence_length=32)
    a = np.load(sys.argv[2])  # the images of a one-device process
    four = model.load(sys.argv[1], **kw)
    b = four.generate(**json.loads(sys.argv[3]))
    print(json.dumps({"max_diff": int(np.abs(a.astype(int) - b).max()), "shape": list(b.shape),
                      "mesh": {k: int(v) for k, v in four.mesh.shape.items()}}))
""")


def test_data_parallel_on_four_cpu_devices_equals_one_device(tiny_ckpt, default_gen, tmp_path):
    """All local devices split the batch: 5 images padded to 8, 2 per device, the one-device images within 1/255."""
    one_device = tmp_path / "one-device.npy"
    np.save(one_device, default_gen.generate(**DP_ARGS))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", DATA_PARALLEL_SCRIPT, tiny_ckpt, str(one_device),
                          json.dumps(DP_ARGS)], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mesh"] == {"data": 4, "model": 1} and result["shape"] == [5, 32, 48, 3]
    assert result["max_diff"] <= 1


MODEL_SHARDS_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, jax, model
    assert len(jax.devices()) == 4, jax.devices()
    ckpt, cfg_scale, ref_file, only = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:]
    kw = dict(dtype="float32", max_sequence_length=32)
    args = dict(prompts=["a red fox", "a lighthouse", "a kite"], seeds=[1, 2, 3], height=32, width=48,
                num_inference_steps=2, guidance_scale=cfg_scale)
    out = {}
    ref = np.load(ref_file)  # the images of one device, made by the caller in a one-device process
    cases = {"2x2": dict(model_shards=2), "1x4": dict(model_shards=4),
             "2x2-splash": dict(model_shards=2, attention="splash", text_encoder_attention="splash")}
    cases = {k: v for k, v in cases.items() if not only or k in only}
    put, split_at_read = jax.device_put, []

    def spy(x, device=None, *a, **k):  # weights read from the files go straight to their split placement
        if isinstance(x, np.ndarray) and "model" in str(getattr(device, "spec", "")):
            split_at_read.append(x.shape)
        return put(x, device, *a, **k)

    jax.device_put = spy
    for name, options in cases.items():
        split_at_read.clear()
        gen = model.load(ckpt, **options, **kw)
        out[name] = {"max_diff": int(np.abs(ref.astype(int) - gen.generate(**args)).max()),
                     "mesh": {k: int(v) for k, v in gen.mesh.shape.items()},
                     "bytes": gen.programs.parameter_bytes_per_device(), "split_at_read": len(split_at_read)}
    print(json.dumps(out))
""")


# The distilled case runs with -m slow (CI time): the base model with CFG goes through the same sharded programs and more.
@pytest.mark.parametrize("base", [pytest.param(False, marks=pytest.mark.slow), True], ids=["distilled", "base-cfg"])
def test_model_shards_on_four_cpu_devices_equal_one_device(tiny_ckpt, tiny_base_ckpt, default_gen, base_gen, base,
                                                           tmp_path):
    """Tensor parallel weights (model.parallel.sharding) over 2 and 4 devices, data x model = 2 x 2 (with the splash
    kernels too): the images of one device within 1/255 (fused projections laid out per shard,
    model.parallel.shard_order), each weight placed split as it is read, and each device holds less of the transformer
    and text encoder as the shards grow."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    # The one-device images come from this process's generators (their programs are compiled already). The base
    # model with CFG (both branches in one batch) runs the data x model case only; the distilled one runs all.
    gen, scale = (base_gen, 4.0) if base else (default_gen, 1.0)
    ref = tmp_path / "one-device.npy"
    np.save(ref, gen.generate(prompts=["a red fox", "a lighthouse", "a kite"], seeds=[1, 2, 3], height=32, width=48,
                              num_inference_steps=2, guidance_scale=scale))
    ckpt, only = (tiny_base_ckpt, ["2x2"]) if base else (tiny_ckpt, [])
    out = subprocess.run([sys.executable, "-c", MODEL_SHARDS_SCRIPT, ckpt, str(scale), str(ref), *only], env=env,
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["2x2"]["mesh"] == {"data": 2, "model": 2}
    assert result["2x2"]["max_diff"] <= 1 and result["2x2"]["split_at_read"] > 0, result["2x2"]
    if base:
        return
    assert result["2x2-splash"]["mesh"] == {"data": 2, "model": 2} and result["1x4"]["mesh"] == {"data": 1, "model": 4}
    for name in ("2x2", "1x4", "2x2-splash"):
        assert result[name]["max_diff"] <= 1, (name, result[name])
        assert result[name]["split_at_read"] > 0, (name, result[name])  # never whole on the first device first
    whole = default_gen.programs.parameter_bytes_per_device()  # one device holds every parameter
    for module in ("transformer", "text_encoder"):
        one, two, four = whole[module], result["2x2"]["bytes"][module], result["1x4"]["bytes"][module]
        assert four < two < one, (module, one, two, four)
    assert result["2x2-splash"]["bytes"]["vae"] == whole["vae"]  # small: replicated


def test_cpu_compiler_options_apply_per_program_and_on_cpu_only():
    """Eigen runs the encoder's and decoder's dots (no YNNPACK fusions) and XLA's defaults (YNNPACK) the
    transformer's; the options are never given to other platforms, and unknown program names are refused."""
    import types

    import jax
    import numpy as np
    from model.engine.cpu_images import EIGEN_DOTS, compiler_options_for
    from model.parallel.mesh import make_mesh
    from model.options import EngineOptions

    mesh = make_mesh(EngineOptions())
    assert compiler_options_for(mesh, "encode") == dict(EIGEN_DOTS)
    assert compiler_options_for(mesh, "decode") == dict(EIGEN_DOTS)
    assert compiler_options_for(mesh, "denoise") is None
    gpu_mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")]))
    assert compiler_options_for(gpu_mesh, "encode") is None
    with pytest.raises(ValueError, match="vae"):
        compiler_options_for(mesh, "vae")
    # An attention-shaped dot: YNNPACK takes it under XLA's defaults, Eigen under the encoder's options.
    q = jax.numpy.ones((4, 768, 32))

    def text(program):
        fn = jax.jit(lambda a: a @ a.transpose(0, 2, 1), compiler_options=compiler_options_for(mesh, program))
        return fn.lower(q).compile().as_text()

    assert "ynn_fusion" not in text("encode")
    assert "ynn_fusion" in text("denoise")


def test_images_run_one_by_one_two_at_a_time_on_one_cpu_device_only():
    import types

    import numpy as np
    from model.engine.cpu_images import concurrent_images_for, per_image_for
    from model.engine.programs import EngineOptions
    from model.parallel.mesh import make_mesh

    mesh = make_mesh(EngineOptions())
    assert per_image_for(mesh) is (mesh.devices.size == 1)
    one_cpu = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="cpu")]))
    assert per_image_for(one_cpu) is True and concurrent_images_for(one_cpu) == 2
    one_gpu = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")]))
    assert per_image_for(one_gpu) is False and concurrent_images_for(one_gpu) == 1
    four_cpus = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="cpu")] * 4))
    assert per_image_for(four_cpus) is False and concurrent_images_for(four_cpus) == 1  # the mesh splits the batch


def test_an_image_has_the_same_bytes_whatever_its_batch(tiny_ckpt, default_gen):
    """The default CPU path (Eigen dots, image by image) gives each image the same bytes alone, in a batch of three
    and in a padded batch: the job's promise that batching never changes an output."""
    import model

    gen = default_gen  # the default options, as loaded for this module
    batch = gen.generate(PROMPTS[:3], SEEDS[:3], **SIZE)
    alone = [gen.generate([p], [s], **SIZE)[0] for p, s in zip(PROMPTS[:3], SEEDS[:3])]
    padded = model.load(tiny_ckpt, batch_size=4, **KW).generate(PROMPTS[1:3], SEEDS[1:3], **SIZE)
    assert [max_diff(batch[i], alone[i]) for i in range(3)] == [0, 0, 0]
    assert [max_diff(padded[i], alone[i + 1]) for i in range(2)] == [0, 0]


def test_concurrent_images_run_the_one_image_programs_in_threads(tiny_ckpt):
    """On one CPU device a batch's images run two at a time, each through the one-image programs (compiled once
    for every batch size): the same bytes as alone, and no compilation for a new batch size."""
    import model

    gen = model.load(tiny_ckpt, **KW)
    if gen.programs.concurrent_images == 1:
        pytest.skip("images run side by side on a one-device CPU mesh only")
    assert gen.programs.concurrent_images == 2
    images = gen.generate(PROMPTS[:3], SEEDS[:3], **SIZE)
    assert gen.programs.compile_count == 3  # the batch-1 encode, denoise and decode only
    assert len(gen.programs.threads._pool._threads) == 2
    with CompileEvents() as events:
        pair = gen.generate(PROMPTS[1:3], SEEDS[1:3], **SIZE)  # another batch size: the same programs
    assert events.count == 0 and gen.programs.compile_count == 3
    assert max_diff(pair, images[1:]) == 0


def test_concurrent_images_compute_no_padding_rows(tiny_ckpt):
    """Image by image, a short batch is not padded up to the batch size, nor the prompts to encode: 3 images of 2
    distinct prompts with batch_size 4 run the encoder twice and the transformer and decoder three times."""
    import model

    gen = model.load(tiny_ckpt, batch_size=4, **KW)
    if not gen.programs.any_batch:
        pytest.skip("images run side by side on a one-device CPU mesh only")
    images = gen.generate(PROMPTS, SEEDS, **SIZE)
    assert dict(gen.programs.image_runs) == {"encode": 2, "denoise": 3, "decode": 3}
    alone = model.load(tiny_ckpt, batch_size=1, **KW).generate(PROMPTS[2:], SEEDS[2:], **SIZE)
    assert images.shape == (3, 32, 48, 3) and max_diff(images[2:], alone) == 0
