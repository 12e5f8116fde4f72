"""The benchmarks' tools: the image-similarity tool, tpu_profile's EngineOptions variants, the input, host-path and
resume benchmarks."""

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
SIZE = dict(height=32, width=48, num_inference_steps=2)
from paths import REPO  # noqa: E402


@pytest.fixture(scope="module")
def default_gen(tiny_ckpt):
    import model

    return model.load(tiny_ckpt, **KW)


# ------------------------------------------------------------------------------------------------ similarity


def _write_pngs(folder, images):
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    for i, img in enumerate(images):
        Image.fromarray(img).save(os.path.join(folder, f"{i:02d}.png"))


def test_similarity_identical_and_different_folders(tmp_path):
    from benchmarks.similarity import compare_folders, ssim

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (3, 40, 36, 3), dtype=np.uint8)
    noisy = np.clip(base.astype(int) + rng.integers(-40, 41, base.shape), 0, 255).astype(np.uint8)
    _write_pngs(tmp_path / "a", base)
    _write_pngs(tmp_path / "b", base)
    _write_pngs(tmp_path / "c", noisy)
    same = compare_folders(str(tmp_path / "a"), str(tmp_path / "b"))
    assert same["compared"] == 3 and same["mean_ssim"] == pytest.approx(1.0) and same["min_ssim"] == 1.0
    assert same["max_abs_diff"] == 0 and same["mean_abs_diff"] == 0
    diff = compare_folders(str(tmp_path / "a"), str(tmp_path / "c"))
    assert diff["compared"] == 3 and diff["mean_ssim"] < 0.99 and diff["max_abs_diff"] > 0
    assert all(r["ssim"] < 1 for r in diff["images"])
    # SSIM properties: symmetric, 1 only for equal images, lower for stronger distortion.
    assert ssim(base[0], noisy[0]) == pytest.approx(ssim(noisy[0], base[0]))
    stronger = np.clip(base[0].astype(int) + rng.integers(-120, 121, base[0].shape), 0, 255).astype(np.uint8)
    assert ssim(base[0], stronger) < ssim(base[0], noisy[0]) < 1
    tiny = base[0, :5, :5]  # smaller than the 11x11 window
    assert ssim(tiny, tiny) == pytest.approx(1.0)


def test_similarity_command_line(tmp_path):
    rng = np.random.default_rng(1)
    imgs = rng.integers(0, 256, (2, 24, 24, 3), dtype=np.uint8)
    _write_pngs(tmp_path / "a", imgs)
    _write_pngs(tmp_path / "b", imgs[::-1])
    _write_pngs(tmp_path / "b2", imgs)
    os.remove(tmp_path / "b2" / "01.png")
    run = lambda *a: subprocess.run([sys.executable, "-m", "benchmarks.similarity", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, cwd=REPO, timeout=120)
    out = run(tmp_path / "a", tmp_path / "a")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mean_ssim"] == pytest.approx(1.0)
    out = run(tmp_path / "a", tmp_path / "b", "--min-ssim", "0.99")
    assert out.returncode == 1 and json.loads(out.stdout)["mean_ssim"] < 0.5
    out = run(tmp_path / "a", tmp_path / "b2")
    res = json.loads(out.stdout)
    assert out.returncode == 0 and res["compared"] == 1 and res["only_in_a"] == ["01.png"]


# ------------------------------------------------------------------------------------------------ tpu_profile


def test_profile_variants_are_engine_options_fields(default_gen, tiny_ckpt, tmp_path, capsys):
    """`benchmarks.tpu_profile --variants` reads each variant as EngineOptions fields (a name that is not one is
    refused before anything loads) and times it over the loaded generator: a row per variant."""
    from benchmarks import tpu_profile
    from benchmarks.engines import STAGES

    argv = ["--preset", "tiny", "--checkpoint", tiny_ckpt, "--height", "32", "--width", "32", "--steps", "1",
            "--dtype", "float32", "--repeats", "1", "--no-trace", "--out", str(tmp_path)]
    args = tpu_profile.parse_args(argv + ["--variants", "b2:batch_size=2;int8:quantize=int8"])
    assert args.variant_options == [("b2", {"batch_size": 2}), ("int8", {"quantize": "int8"})]
    with pytest.raises(SystemExit):
        tpu_profile.parse_args(argv + ["--variants", "x:fused_loop=false"])
    assert "'fused_loop' is not an EngineOptions field" in capsys.readouterr().err
    args.variant_options = args.variant_options[:1]
    row = tpu_profile.time_variants(default_gen, tiny_ckpt, args)["b2"]
    assert row["batch"] == 2 and row["options"] == {"batch_size": 2} and row["ms_per_image"] > 0, row
    assert set(row["stage_ms_per_image"]) == set(STAGES)


def test_a_variant_shares_the_loaded_weights_unless_its_modules_differ(default_gen, tiny_ckpt):
    """Another batch runs over the base generator's own parameter arrays; int8 needs other modules, so it loads
    again, and its transformer's projections are int8 (the variant really is quantized)."""
    import jax
    from benchmarks.engines import with_options
    from model.nets.quantize import Int8Linear

    def leaves(gen):
        return jax.tree.leaves(gen.programs.tr_state)

    batch = with_options(default_gen, tiny_ckpt, dataclasses.replace(default_gen.options, batch_size=2))
    assert batch.options.batch_size == 2 and all(a is b for a, b in zip(leaves(batch), leaves(default_gen)))
    int8 = with_options(default_gen, tiny_ckpt, dataclasses.replace(default_gen.options, quantize="int8"))
    _, transformer, _ = int8.programs.modules()
    assert int8.options.quantize == "int8"
    assert isinstance(transformer.single_transformer_blocks[0].attn.to_out, Int8Linear)


def test_input_benchmark_reads_every_format(capsys):
    """`python -m benchmarks.inputs`: every format's records all become requests, timed with and without Beam."""
    from benchmarks import inputs

    assert inputs.main(["--prompts", "40", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["formats"]) == {"jsonl", "tsv", "parquet"}
    for figures in result["formats"].values():
        assert figures["beam_records_per_s"] > 0 and figures["parse_records_per_s"] > 0


# ------------------------------------------------------------------------------------------------ host path


def test_host_path_benchmark_exits_and_cleans_up_after_the_emulator(tmp_path):
    """The host-path benchmark prints a row per store and its JSON line, then exits (the emulator stopped) and leaves
    no local output behind."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.host_path", "--height", "16", "--width", "16",
                           "--images", "2", "--threads", "1", "--image_format", "png1", "--store", "local,emulator",
                           "--device_images_per_s", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["store"], r["format"], r["threads"]) for r in report["rows"]] == [("local", "png1", 1),
                                                                                 ("emulator", "png1", 1)]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("host-path-")]


def test_a_process_that_never_stops_its_emulator_still_exits():
    """The emulator serves from a daemon thread, so a script or test process that ends without stop() (an exception,
    a forgotten call) does not wait on it forever."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(REPO, "tests", "support")!r})
        from gcs_emulator import start_emulator
        print(start_emulator().new_bucket("left-running"))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("left-running-"), proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ resume


def test_resume_benchmark_reads_no_image_the_new_way():
    """benchmarks.resume on 20 images: the old way reads every image, the new one none, and both keep all 20."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.resume", "--images", "20"], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ways = json.loads(proc.stdout.strip().splitlines()[-1])["ways"]
    before, after = ways["before: read every image"], ways["after: listing + fingerprints"]
    assert (before["objects_read"], before["skipped"]) == (20, 20) and before["image_bytes_read"] > 0
    assert (after["objects_read"], after["image_bytes_read"], after["skipped"]) == (0, 0, 20)
    assert after["manifest_bytes_read"] > 0 and before["stale"] == after["stale"] == 0


# ------------------------------------------------------------------------------------------------ launch_times

def test_launch_times_runs_and_phases(tmp_path):
    """launch_times times the runs asked for, in order, refuses an unknown one by name, and reads each phase's
    seconds, the batch and the compile counts off a job's output as its lines came."""
    from benchmarks import launch_times

    assert launch_times.wanted_runs("bf16,int8", "int8_warm,bf16_cold,bf16_warm") == [
        ("bf16", "cold"), ("bf16", "warm"), ("int8", "warm")]
    assert launch_times.wanted_runs("bf16", "int8_warm,bf16_warm") == [("bf16", "warm")]
    with pytest.raises(ValueError, match="'fp8_warm'"):
        launch_times.wanted_runs("bf16", "fp8_warm")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import time
        print("TPU preflight: fits v5e:1x1 with 1 model shard(s) at batch 2 (picked): peak 9.00 of 15.75 GiB per "
              "chip (compiler's estimate; stored answer /c/preflight-answers/k.json, compiled nothing)", flush=True)
        time.sleep(0.3)
        print("INFO model.engine.generator: loaded /m (bfloat16) in 9.0 s", flush=True)
        print("INFO model.engine.programs: compiled bucket Bucket(batch=2) in 1.0 s", flush=True)
        print("metrics: batches=4, xla_cache_hits=36, xla_compiles=2", flush=True)
    """))
    log = tmp_path / "run.log"
    r = launch_times.timed_run([sys.executable, str(script)], str(tmp_path / "out"), 60, str(log))
    assert r["exit"] == 0 and r["batch"] == 2 and "stored answer" in r["answer"]
    assert r["xla_cache_hits"] == 36 and r["xla_compiles"] == 2
    assert r["preflight_s"] < r["model_loaded_s"] <= r["first_compile_s"] and r["model_loaded_s"] >= 0.3
    assert r["first_image_s"] is None  # no image was written
    assert "loaded /m" in log.read_text() and "bf16_warm" in launch_times.format_table({"bf16_warm": r})
