"""The benchmark's tools: the image-similarity tool, the generation benchmark end to end (also where torch and
diffusers cannot be imported, as in the worker image), its ablation variants, and its FLOP counts against XLA's."""

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


# ------------------------------------------------------------------------------------------------ generation benchmark


@pytest.mark.slow  # CI time: the benchmark command runs in CI through test_benchmark_runs_where_torch_and_diffusers_cannot_be_imported
def test_benchmark_command_reports_bf16_vs_fp32(tiny_ckpt, tmp_path):
    """The benchmark's one command runs end to end (tiny checkpoint, bf16) and reports, with the similarity tool,
    how far bf16 images are from fp32 ones on the same prompts and noise; its last line is the documented JSON."""
    out_dir = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.generate", "--checkpoint", tiny_ckpt, "--preset", "tiny", "--height", "64",
         "--width", "64", "--dtype", "bfloat16", "--batch", "1", "--repeats", "1", "--skip-ablation",
         "--skip-diffusers", "--skip-reference", "--out", str(out_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("ms_per_image", "ms_per_image_reference", "ms_per_image_diffusers", "speedup_vs_reference",
                "speedup_vs_diffusers", "mfu", "preset", "batch", "dtype", "backend"):
        assert key in final, key
    assert final["dtype"] == "bfloat16" and final["batch"] == 1 and final["steady_state_compiles"] == 0
    assert final["ms_per_image"] > 0 and 0 < final["mfu"] < 1
    assert -1 <= final["ssim_vs_float32"] < 1  # random tiny weights: bf16 rounding shows in the pixels
    images = out_dir / "images" / "tiny-64x64-bfloat16" / "b1"
    assert sorted(os.listdir(images / "optimised")) == sorted(os.listdir(images / "optimised-float32")) == ["00.png"]
    md = (out_dir / "tiny-64x64-bfloat16-b1.md").read_text()
    assert "Images bfloat16 vs float32 (optimised path in both): mean SSIM" in md
    results = json.loads((out_dir / "tiny-64x64-bfloat16-b1.json").read_text())
    assert results["batches"]["1"]["similarity"]["bfloat16_vs_float32"]["compared"] == 1


def test_analytic_flops_match_xla_cost_analysis(default_gen):
    """benchmarks/flops.py (used for MFU) agrees with XLA's own count of the compiled programs."""
    from benchmarks import flops as F
    from benchmarks.engines import JaxEngine

    h, w, steps = SIZE["height"], SIZE["width"], SIZE["num_inference_steps"]
    cfg = default_gen.config
    analytic = F.image_flops(cfg, h, w, steps, text_len=KW["max_sequence_length"], cfg_guidance=False,
                             encoder_layers=F.encoder_layers_run(cfg.text_encoder),
                             image_only_last_block=default_gen.lab.image_only_last_block,
                             fused_upsample=default_gen.lab.fused_upsample)
    xla = JaxEngine("optimised", default_gen).xla_flops(2, h, w, steps, False)
    for stage in ("encode", "denoise", "decode"):
        # XLA also counts elementwise work (norms, softmax, RoPE), which the analytic count leaves out.
        assert analytic[stage] <= xla[stage] * 1.01 and analytic[stage] >= 0.8 * xla[stage], (stage, analytic, xla)




# Runs a module as `python -m` would with torch and diffusers not importable (None in sys.modules: `import torch`
# raises ModuleNotFoundError and importlib.util.find_spec finds nothing, as where they are not installed), then fails
# (exit status 1) if any torch or diffusers module got loaded all the same.
WITHOUT_TORCH = textwrap.dedent("""
    import runpy, sys
    BLOCKED = ("torch", "diffusers")
    for name in BLOCKED:
        sys.modules[name] = None
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    loaded = sorted(m for m, v in sys.modules.items() if m.split(".")[0] in BLOCKED and v is not None)
    if loaded:
        sys.exit(f"torch/diffusers modules loaded: {loaded}")  # exit status 1
""")


def test_benchmark_runs_where_torch_and_diffusers_cannot_be_imported(tiny_ckpt, tmp_path):
    """With --skip-diffusers the benchmark never imports torch or diffusers, so it runs in the worker image (which
    has neither): the optimised and reference engines are measured stage by stage, the diffusers one is absent."""
    from benchmarks.engines import STAGES

    out_dir = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "benchmarks.generate", "--checkpoint", tiny_ckpt, "--preset", "tiny",
         "--height", "32", "--width", "32", "--dtype", "float32", "--batch", "1", "--repeats", "1", "--warmup", "1",
         "--skip-ablation", "--skip-diffusers", "--out", str(out_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert final["ms_per_image"] > 0 and 0 < final["mfu"] < 1 and final["steady_state_compiles"] == 0
    assert final["speedup_vs_reference"] > 0 and final["ms_per_image_diffusers"] is None
    results = json.loads((out_dir / "tiny-32x32-float32-b1.json").read_text())
    assert results["environment"]["torch"] is None and results["environment"]["diffusers"] is None
    engines = results["batches"]["1"]["engines"]
    assert sorted(engines) == ["optimised", "reference"]
    for name, e in engines.items():
        assert e["ms_per_image"] > 0 and e["images_per_s"] > 0 and e["flops_per_image"] > 0, name
        assert set(e["stages_ms_per_image"]) == set(STAGES), name
        assert all(v >= 0 for v in e["stages_ms_per_image"].values()), name
    assert engines["optimised"]["compile_cold_s"] > 0 and engines["optimised"]["compile_warm_s"] > 0
    assert "total" in results["batches"]["1"]["xla_flops_per_image"]


def test_ablation_has_a_row_for_every_switch():
    """Every EngineOptions and LabSwitches field is either an ablation row that changes that field alone (from the
    optimised path) or deliberately not one; the last row is the reference mode."""
    from benchmarks.engines import NOT_ABLATED, ablation_variants, optimised
    from model.lab import LabSwitches, reference_mode
    from model.options import EngineOptions

    base = optimised(2, "cache")
    rows = ablation_variants(2, "cache")
    fields = [f.name for f in dataclasses.fields(EngineOptions) + dataclasses.fields(LabSwitches)]
    missing = [f for f in fields if f not in NOT_ABLATED and f"-{f}" not in {r.name for r in rows}]
    assert not missing, f"add these switches to benchmarks/engines.py ABLATIONS (or NOT_ABLATED): {missing}"
    settings = lambda v: {**dataclasses.asdict(v.options), **dataclasses.asdict(v.lab)}  # noqa: E731
    for row in rows:
        if row.name[1:] in fields:  # "-fused_loop" ...
            changed = [f for f in fields if settings(row)[f] != settings(base)[f]]
            assert changed == [row.name[1:]], (row.name, changed)
    reference = reference_mode(batch_size=2)
    assert rows[-1].name == "reference" and (rows[-1].options, rows[-1].lab) == (reference["options"],
                                                                                  reference["lab"])


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
