"""The TPU preflight (pipeline/preflight.py, its core model/preflight/aot.py) and the bundled presets
(model/loading/presets).

The preflight compiles for a TPU topology with libtpu's compiler on this CPU machine: the tiny checkpoint for v5e:2x2
with 2 model shards and the splash kernel, which Mosaic compiles (its custom call is in the compiled text). Without
libtpu the compiling tests are skipped. No figure of speed is asserted: the preflight reports the compiler's estimates.
"""

import json
import os
import subprocess
import sys

import pytest

from paths import REPO as ROOT  # noqa: E402
TINY = dict(topology="v5e:2x2", height=64, width=64, batch_size=2, max_sequence_length=32)
JSON_KEYS = {"model", "topology", "chips", "model_shards", "data_replicas", "hbm_bytes_per_chip",
             "resident_bytes_per_chip", "peak_bytes_per_chip", "fits", "est_seconds_per_image", "attention", "programs"}
PROGRAM_KEYS = {"argument_bytes", "temp_bytes", "output_bytes", "flops", "optimal_seconds", "compile_s",
                "mosaic_kernels"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pipeline.preflight", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _flags(model: str, **overrides) -> list[str]:
    return [f"--{k}={v}" for k, v in {"model": model, **TINY, **overrides}.items()]


# ------------------------------------------------------------------------------------------------ --help (no libtpu)
def test_help_explains_every_option_and_ends_with_a_tiny_example():
    from pipeline.preflight import DEMO_MODEL, EXAMPLE, build_parser, parse_args

    hidden = {"--hbm_bytes"}  # a test hook, not for users
    for action in build_parser()._actions:  # noqa: SLF001
        flag = max(action.option_strings, key=len, default="")
        if flag in ("--help",) + tuple(hidden):
            continue
        assert action.help and len(action.help) > 10, f"{flag} has no help text"
    result = _cli("--help")
    assert result.returncode == 0 and result.stdout.rstrip().endswith(EXAMPLE.rstrip()), result.stdout[-1500:]
    commands = [line.strip() for line in EXAMPLE.replace("\\\n", " ").splitlines()
                if line.strip().startswith("python -m pipeline.preflight")]
    tiny = commands[0].split()[3:]
    args = parse_args(tiny)  # the example is a command line the preflight accepts
    assert args.model == DEMO_MODEL and args.topology.endswith(":1x1") and args.height * args.width <= 128 * 128


# ------------------------------------------------------------------------------------------------ presets (no libtpu)

@pytest.mark.parametrize("name", ["klein-4b", "klein-9b", "klein-base-4b", "klein-base-9b"])
def test_presets_hold_the_published_configs(name):
    from model.loading.presets import preset_config

    cfg = preset_config(name)
    nine = name.endswith("9b")
    tr, te = cfg.transformer, cfg.text_encoder
    assert (tr.num_layers, tr.num_single_layers, tr.num_attention_heads) == ((8, 24, 32) if nine else (5, 20, 24))
    assert tr.joint_attention_dim == 3 * te.hidden_size == (12288 if nine else 7680)
    assert (te.hidden_size, te.intermediate_size) == ((4096, 12288) if nine else (2560, 9728))
    assert (te.num_hidden_layers, te.num_attention_heads, te.num_key_value_heads, te.head_dim) == (36, 32, 8, 128)
    assert (cfg.vae.latent_channels, cfg.vae.block_out_channels, cfg.size_multiple) == (32, (128, 256, 512, 512), 16)
    assert cfg.scheduler.use_dynamic_shifting and tr.guidance_embeds is False
    assert cfg.is_distilled is ("base" not in name)


def test_unknown_preset_names_the_value():
    from model.errors import ConfigError
    from model.loading.presets import preset_folder

    with pytest.raises(ConfigError, match="klein-2b"):
        preset_folder("klein-2b")


def test_presets_are_package_data():
    """setup.py ships every preset file (an installed package has no source tree to read them from)."""
    import ast
    import fnmatch

    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    data = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                for kw in node.keywords if kw.arg == "package_data")
    patterns = ast.literal_eval(data)["model.loading.presets"]
    presets = os.path.join(ROOT, "model", "loading", "presets")
    files = [os.path.relpath(os.path.join(d, f), presets) for d, _, fs in os.walk(presets) for f in fs
             if f.endswith(".json")]
    assert len(files) == 20
    assert all(any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/") for p in patterns) for f in files)


def test_attention_flops_of_klein_9b_at_1024():
    """4 x Lq x Lk x width per block over the padded joint sequence (512 text + 4096 image tokens), the last block's
    queries the image tokens only; none in the decode (its attention is XLA's, which XLA counts)."""
    from model.preflight.estimate import attention_flops_per_image
    from model.loading.presets import preset_config

    flops = attention_flops_per_image(preset_config("klein-9b"), text_len=512, image_tokens=4096, steps=4, cfg=False)
    assert flops["denoise"] == (4 * 4608**2 * 4096 * 32 - 4 * 512 * 4608 * 4096) * 4
    assert flops["decode"] == 0.0
    causal = 4 * 512**2 * 32 * 128 * 27 * (5 / 8)  # 4 blocks of 128: 10 of 16 run
    assert flops["encode"] == pytest.approx(causal)


def test_a_program_the_compiler_refuses_does_not_fit():
    """libtpu refuses a program larger than HBM at compile time; the report then says so, with its figure."""
    import types

    from model import CHIPS, ProgramStats, Report
    from model.preflight.hlo_stats import refused_program_stats
    from pipeline.preflight import format_report, shortfall_message

    message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
               "HLO temporaries (19.75G) exceeds available HBM (15.75G). HLO module: jit_denoise.")
    refused = refused_program_stats("denoise", message, parameter_bytes=18 * 1024**3, kernel_flops=1.0,
                                    loop_trips=4, compile_s=1.0)
    assert refused.temp_bytes == int(1.75 * 1024**3) and refused.compile_error.startswith("RESOURCE_EXHAUSTED")
    fine = ProgramStats("encode", 10, 5, 1, 0, 10, 1e9, 1e9, 1e-3, 0.0, 1.0, 0, 1)
    topology = types.SimpleNamespace(devices=(object(),), devices_per_chip=1, chip=CHIPS["TPU v5 lite"],
                                     name="v5e:1x1", chips=1, hosts=1)
    report = Report(model="m", topology=topology, dtype="bfloat16", height=1024, width=1024, batch=1, steps=4,
                    cfg=False, model_shards=1, attention="splash", parameter_bytes={"transformer": 18 * 1024**3},
                    programs={"encode": fine, "denoise": refused}, hbm_bytes_per_chip=16 * 1024**3)
    assert not report.fits and report.largest_program == "denoise"
    assert "the compiler refused denoise" in shortfall_message(report)
    assert report.to_json()["est_seconds_per_image"] is None
    assert "denoise: refused by the compiler: RESOURCE_EXHAUSTED" in format_report(report)


# klein-4B 1024x1024 bf16 batch 1 on v5e:1x1 as libtpu 0.0.52 compiled it (XLA's FLOPs, the splash kernels' FLOPs and
# XLA's bytes accessed, per image): encode and denoise at cb29942, decode with the transposed-conv upsample and
# one-pass GroupNorm statistics (c7479de, XLA's attention); and what one TPU v5e chip measured for them
# (benchmarks/tpu_measured.json; the decode and the image in the same process at c7479de, 2026-12-06).
KLEIN_4B_V5E = {"encode": (2.7954e12, 7.2478e10, 2.1021e10), "denoise": (1.12875e14, 2.5976e13, 1.46891e11),
                "decode": (9.2769e12, 0.0, 2.5436e10)}
# Measured on the v5e chip with the flash attention kernel (benchmarks/tpu_measured.json: int8_session_2026_12_07);
# the int8 programs count the same FLOPs (the preflight compiled 113.04 TFLOP for its denoise against 112.87).
MEASURED_MS = {"encode": 20.8, "denoise": 838.5, "decode": 66.6, "image": 927.6}
MEASURED_INT8_MS = {"encode": 14.4, "denoise": 581.1, "decode": 66.6, "image": 664.2}
KLEIN_4B_V5E_INT8 = {"encode": (2.7993e12, 7.2478e10, 1.7774e10), "denoise": (1.13039e14, 2.5976e13, 1.84261e11),
                     "decode": (9.2769e12, 0.0, 2.5436e10)}


def _klein_4b_report(chip_kind: str, quantize: str = "none"):
    import types

    from model import CHIPS, ProgramStats, Report

    programs = {name: ProgramStats(name, 10, 5, 1, 0, 10, flops, nbytes, -1.0, kernel, 1.0, 1 if kernel else 0, 1)
                for name, (flops, kernel, nbytes) in (KLEIN_4B_V5E_INT8 if quantize == "int8" else KLEIN_4B_V5E).items()}
    topology = types.SimpleNamespace(devices=(object(),), devices_per_chip=1, chip=CHIPS[chip_kind], name="x:1x1",
                                     chips=1, hosts=1)
    return Report(model="klein-4b", topology=topology, dtype="bfloat16", height=1024, width=1024, batch=1, steps=4,
                  cfg=False, model_shards=1, attention="splash", parameter_bytes={"transformer": 1},
                  programs=programs, hbm_bytes_per_chip=16 * 1024**3, quantize=quantize)


@pytest.mark.parametrize("quantize, measured", [("none", MEASURED_MS), ("int8", MEASURED_INT8_MS)])
def test_calibrated_estimate_within_ten_percent_of_the_chip(quantize, measured):
    """The estimate for the measured configuration, bf16 and int8, is within 10% of the chip per image and for the
    programs that hold 97% of the time; the text encoder, whose time the calibration did not use, within 60% (it is
    bound by XLA's byte count, which overstates what the chip moves: more so in int8)."""
    report = _klein_4b_report("TPU v5 lite", quantize)
    assert report.flash_attention
    for name, program in report.programs.items():
        bound = 0.60 if name == "encode" else 0.10
        assert abs(report.est_seconds(program) * 1e3 / measured[name] - 1) <= bound, name
    assert abs(report.est_seconds_per_image * 1e3 / measured["image"] - 1) <= 0.10
    assert report.estimate_label.startswith("calibrated estimate")


def test_other_chips_are_labelled_calibrated_on_v5e_not_measured():
    report = _klein_4b_report("TPU v6 lite")
    assert report.estimate_label.startswith("calibrated on v5e, not measured")
    assert report.to_json()["estimate"] == report.estimate_label


# ------------------------------------------------------------------------------------------------ compiling (libtpu)

@pytest.fixture(scope="module")
def libtpu():
    return pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed: pip install libtpu")


def _programs(model, topology, shards, text_len):
    """The preflight's programs for `model` (a preset or checkpoint) over `topology` with `shards` model shards."""
    from model.preflight.aot import programs_for_topology
    from model.engine.factory import Networks
    from pipeline.preflight import resolve_model

    config = resolve_model(model)
    modules = Networks(config, "bfloat16").run_modules()
    return config, programs_for_topology(modules, topology, dtype="bfloat16", model_shards=shards,
                                         text_len=text_len)


def test_two_shards_compile_splash_and_halve_the_weights(libtpu, tiny_ckpt, tmp_path):
    from model import load_topology
    from pipeline.preflight import PreflightRequest, preflight

    topology = load_topology("v5e:2x2")
    assert (topology.chips, topology.devices_per_chip) == (4, 1)
    one, two = (_programs(tiny_ckpt, topology, s, 32)[1] for s in (1, 2))
    before, after = one.parameter_bytes_per_device(), two.parameter_bytes_per_device()
    for module, state in (("transformer", two.tr_state), ("text_encoder", two.te_state)):
        # The split layers halve; the small replicated ones (norms, modulation, embedders) stay whole. Their share is
        # large in the tiny model (a third of its transformer), small in the real ones (test below).
        kept = _replicated_bytes(state)
        assert after[module] - kept == (before[module] - kept) / 2, (module, before, after, kept)
    assert after["text_encoder"] < 0.6 * before["text_encoder"]
    assert after["vae"] == before["vae"]  # replicated

    report = preflight(PreflightRequest(model=tiny_ckpt, model_shards=2, **TINY), dump_dir=str(tmp_path))
    assert (report.model_shards, report.data_replicas, report.attention) == (2, 2, "splash")
    assert report.resident_bytes_per_chip == sum(after.values())
    assert report.programs["encode"].mosaic_kernels > 0 and report.programs["denoise"].mosaic_kernels > 0
    assert "tpu_custom_call" in (tmp_path / "denoise.txt").read_text()
    assert report.fits
    # tensor parallel: the row-split projections of every denoising step end in all-reduces over the model axis
    denoise = report.programs["denoise"].collectives
    assert denoise and denoise.get("all-reduce", [0, 0])[0] > 0 and denoise["all-reduce"][1] > 0, denoise
    # and nothing else: the fused projections are laid out per shard (model.parallel.shard_order), so no data moves
    # between chips to take their parts apart (the stored layout cost all-to-alls and collective-permutes here)
    assert set(denoise) == {"all-reduce"}, denoise
    assert report.to_json()["programs"]["denoise"]["collectives_per_device"] == denoise


def test_collective_traffic_reads_compiled_hlo():
    from model.preflight.hlo_stats import collective_traffic

    text = "\n".join([
        "  %all-reduce.1 = bf16[2,64,128]{2,1,0} all-reduce(bf16[2,64,128]{2,1,0} %x), replica_groups={{0,1}}",
        "  %ars = (f32[8]{0}, f32[8]{0}) all-reduce-start(f32[8]{0} %y), channel_id=3",
        "  %ard = f32[8]{0} all-reduce-done((f32[8]{0}, f32[8]{0}) %ars)",
        "  %ag = f32[4,16]{1,0} all-gather(f32[2,16]{1,0} %z), dimensions={0}",
        "  %add = f32[4,16]{1,0} add(f32[4,16]{1,0} %a, f32[4,16]{1,0} %b)",
    ])
    assert collective_traffic(text) == {"all-reduce": [2, 2 * 64 * 128 * 2 + 8 * 4], "all-gather": [1, 4 * 16 * 4]}


def test_kernel_calls_counted_alike_in_the_lowered_text(libtpu, tiny_ckpt, tmp_path):
    """The fallback for programs whose compiled text cannot be printed (TPU v7) counts as the compiled text does.
    Compiled by the preflight's own compile_programs, which writes the compiled text it read its counts from (and,
    in this process, reuses what test_two_shards_compile_splash_and_halve_the_weights compiled for these programs)."""
    from model.preflight.aot import compile_programs
    from model import load_topology
    from model.preflight.hlo_stats import count_kernel_calls
    from model.options import PROGRAMS
    from model.engine.buckets import Bucket

    config, programs = _programs(tiny_ckpt, load_topology("v5e:2x2"), 2, 32)
    tr = config.transformer
    bucket = Bucket(2, 16, 16, 4, False)
    lowered = programs.lower(bucket, tr.in_channels, tr.joint_attention_dim, tr.attention_head_dim)
    compile_programs(programs, config, bucket, {name: 0.0 for name in PROGRAMS}, dump_dir=str(tmp_path))
    for name, low in zip(PROGRAMS[:2], lowered[:2]):
        compiled_text = (tmp_path / f"{name}.txt").read_text()  # the compiled text, not the lowered fallback
        assert count_kernel_calls(low.as_text(), "lowered") == count_kernel_calls(compiled_text) > 0, name


def test_decode_program_forms_by_platform(libtpu):
    """On TPUs klein's decode program upsamples by transposed (lhs-dilated) convs, the TPU's form
    (model.nets.platform_forms), no other conv is dilated and no kernel is called (its mid-block attention is XLA's);
    the same program for a CPU has no dilated conv (the phases form). Lowered only (no compile). The forms' pixels:
    tests/model/test_model_parity.py."""
    import re

    import jax

    from model.preflight.aot import topology_options
    from model import load_topology
    from model.engine.factory import Networks, build_programs
    from model.preflight.hlo_stats import count_kernel_calls
    from model.parallel.mesh import make_mesh
    from model.engine.buckets import Bucket
    from model.nets.platform_forms import forms_for
    from pipeline.preflight import resolve_model

    config = resolve_model("klein-4b")
    modules = Networks(config, "bfloat16").run_modules()

    def dilated_convs_and_kernels(devices) -> tuple[int, int]:
        mesh = make_mesh(topology_options(1), devices=devices)
        programs = build_programs(modules, dtype="bfloat16", mesh=mesh, options=topology_options(1), text_len=32,
                                  abstract=True)
        text = programs.lower_program("decode", Bucket(1, 16, 16, 4, False), config.transformer.in_channels).as_text()
        return len(re.findall(r"lhs_dilate = \[2, 2\]", text)), count_kernel_calls(text, "lowered")

    assert (forms_for("tpu").upsample, forms_for("cpu").upsample) == ("dilated", "phases")
    upsamplers = len(config.vae.block_out_channels) - 1
    assert dilated_convs_and_kernels(list(load_topology("v5e:1x1").devices)) == (upsamplers, 0)
    assert dilated_convs_and_kernels(jax.devices("cpu")[:1]) == (0, 0)


def _replicated_bytes(state) -> int:
    """Bytes of the parameters a sharded state leaves whole on every device."""
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)
               if all(axis is None for axis in x.sharding.spec))


@pytest.mark.parametrize("preset", ["klein-4b", "klein-9b"])
def test_real_weights_halve_over_two_shards(libtpu, preset):
    """Shapes only: the published models' transformer and text encoder take under 0.6 of their bytes per chip."""
    from model import load_topology

    one, two = (_programs(preset, load_topology("v5e:2x2"), s, 512)[1].parameter_bytes_per_device()
                for s in (1, 2))
    for module in ("transformer", "text_encoder"):
        assert two[module] < 0.6 * one[module], (module, one, two)


@pytest.fixture
def preflight_main(capsys):
    """`pipeline.preflight.main` in this process: (exit status, stdout, stderr). The tables and exit statuses are
    main()'s; `python -m pipeline.preflight` hands its status to the shell (test_the_command_exits_with_mains_status).
    In this process the programs test_two_shards_compile_splash_and_halve_the_weights compiled for the same request
    are reused (model/preflight/aot.py keeps what it compiled by the lowered text), so the report is not compiled again.
    main() turns its loggers to INFO: they are put back afterwards."""
    import logging

    from pipeline.preflight import main

    loggers = [logging.getLogger(name) for name in ("pipeline.preflight", "model.preflight.aot")]
    levels = [logger.level for logger in loggers]

    def call(*args: str):
        status = main(list(args))
        out, err = capsys.readouterr()
        return status, out, err

    yield call
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def test_cli_prints_the_tables_and_a_json_line(libtpu, tiny_ckpt, preflight_main):
    status, stdout, stderr = preflight_main(*_flags(tiny_ckpt, model_shards=2))
    assert status == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert JSON_KEYS <= set(report)
    assert set(report["programs"]) == {"encode", "denoise", "decode"}
    assert all(PROGRAM_KEYS <= set(p) for p in report["programs"].values())
    assert report["fits"] is True and report["model_shards"] == 2 and report["data_replicas"] == 2
    assert report["programs"]["denoise"]["mosaic_kernels"] > 0
    assert "not a measurement of this configuration" in stdout and "fits: yes" in stdout
    assert report["estimate"].startswith("calibrated estimate") and report["calibration"]["chip"] == "TPU v5e"
    # XLA's own time estimate is not shown where it means nothing (Mosaic kernels; libtpu gives negative values)
    header = next(line for line in lines if line.startswith("program"))
    assert "optimal" not in header and "est s" in header
    for name, program in report["programs"].items():
        assert program["optimal_seconds"] is None or program["optimal_seconds"] >= 0, name
        if program["mosaic_kernels"]:
            assert program["optimal_seconds"] is None, name


def test_cli_exits_non_zero_naming_the_shortfall(libtpu, tiny_ckpt, preflight_main):
    status, stdout, stderr = preflight_main(*_flags(tiny_ckpt, model_shards=2, hbm_bytes=100_000))
    assert status == 1, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["fits"] is False and report["peak_bytes_per_chip"] > 100_000
    assert f"does not fit: {report['largest_program']} peaks at" in stderr
    assert "would fit: a larger machine type" in stdout


def test_the_command_exits_with_mains_status(libtpu, tiny_ckpt):
    """`python -m pipeline.preflight` exits with main()'s status (here 2, a bad option, which compiles nothing)
    and prints its error line on stderr, and nothing else: libtpu's start-up lines (TPU_ACCELERATOR_TYPE and
    TPU_WORKER_HOSTNAMES warnings, an E0000 INVALID_ARGUMENT with its source trace) are held back."""
    result = _cli(*_flags(tiny_ckpt, topology="v9z:1x1"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "unknown TPU topology 'v9z:1x1'" in result.stderr and result.stdout == ""
    assert result.stderr.strip().splitlines() == [line for line in result.stderr.strip().splitlines()
                                                  if line.startswith("error: ")], result.stderr


def test_libtpu_start_up_noise_is_held_back_and_other_lines_kept(capfd):
    """What the process writes to file descriptor 2 while libtpu starts comes out afterwards, without libtpu's
    start-up noise (its words, as libtpu 0.0.52 writes them on a machine that is no TPU VM)."""
    import os

    from model.preflight.topology import quiet_libtpu_start

    noise = ["Failed to find host bounds for accelerator type: WARNING: could not determine TPU accelerator type, "
             "please set env var `TPU_ACCELERATOR_TYPE` manually, otherwise libtpu.so may not properly initialize.",
             "WARNING: Logging before InitGoogle() is written to STDERR",
             "E0000 00:00:1796646520.629275    5575 common_lib.cc:906] INVALID_ARGUMENT: Error: unexpected worker "
             "hostname 'WARNING: could not determine TPU worker hostnames or IP addresses' from env var "
             "TPU_WORKER_HOSTNAMES.", "=== Source Location Trace: ===",
             "learning/45eac/tfrc/runtime/libtpu_init_utils.cc:370"]
    with quiet_libtpu_start():
        os.write(2, ("\n".join(noise[:2]) + "\nreal trouble: the compiler crashed\n" + "\n".join(noise[2:]) + "\n")
                 .encode())
    assert capfd.readouterr().err == "real trouble: the compiler crashed\n"


# ------------------------------------------------------------------------------------------------ batch auto
def test_auto_batch_is_the_largest_that_fits_and_a_batch_too_large_names_it(libtpu, tiny_ckpt, preflight_main):
    """--batch_size auto (the default): the fastest batch per image up to --max_batch_size whose programs fit, found
    by compiling one image per replica and the batch its figures and the batch terms name (a chip that holds one image
    per data replica but not two gets one); a given batch that does not fit is refused with the largest batch that
    does named first, before larger chips. In this process the programs for one
    image per replica are those test_two_shards_compile_splash_and_halve_the_weights compiled."""
    from pipeline.preflight import PreflightRequest, parse_args, preflight

    assert parse_args(["--model=m", "--topology=v5e:1x1", "--height=64", "--width=64"]).batch_size is None
    assert parse_args(["--model=m", "--topology=v5e:1x1", "--height=64", "--width=64",
                       "--batch_size=auto"]).batch_size is None
    one, two = (preflight(PreflightRequest(model=tiny_ckpt, model_shards=2, **{**TINY, "batch_size": 2 * n}))
                for n in (1, 2))  # one and two images on each of the 2 data replicas
    assert one.fits and two.fits and two.peak_bytes_per_chip > one.peak_bytes_per_chip
    # Two images per replica decode in two turns of a loop XLA counts once: the work per image is the same.
    assert two.programs["decode"].loop_trips == 2 and one.programs["decode"].loop_trips == 1
    for name in ("decode", "denoise"):
        assert two.flops_per_image(two.programs[name]) == pytest.approx(one.flops_per_image(one.programs[name]),
                                                                        rel=0.05), name
    hbm = (one.peak_bytes_per_chip + two.peak_bytes_per_chip) // 2

    status, stdout, stderr = preflight_main(*_flags(tiny_ckpt, model_shards=2, hbm_bytes=hbm, batch_size="auto"))
    assert status == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert (report["batch"], report["batch_picked"], report["max_batch_size"], report["fits"]) == (2, True, 8, True)
    # the batch terms name 2 images per replica the likely fastest for the tiny model: compiled, they do not fit
    assert [(t["batch"], t["fits"]) for t in report["batch_search"]] == [(2, True), (4, False)]
    assert "picked: the fastest per image up to 8 that fits" in stdout and "batch search (up to 8): 2 fits" in stdout

    asked = preflight(PreflightRequest(model=tiny_ckpt, model_shards=2, hbm_bytes=hbm, **{**TINY, "batch_size": 4}))
    assert not asked.fits and not asked.batch_picked
    assert asked.advice[0].startswith("a smaller batch: --batch_size 2 fits"), asked.advice
    assert any(a.startswith("a larger machine type") for a in asked.advice[1:]), asked.advice


@pytest.mark.parametrize("overrides, message", [
    (dict(topology="v9z:1x1"), "unknown TPU topology 'v9z:1x1'"),
    (dict(model_shards=3), "--model_shards 3 must divide the 4 devices"),
    (dict(height=66), "height must be a positive multiple of 4, got 66"),
])
def test_bad_arguments_exit_2(libtpu, tiny_ckpt, capsys, overrides, message):
    from pipeline.preflight import main

    assert main(_flags(tiny_ckpt, **overrides)) == 2
    assert message in capsys.readouterr().err


def test_a_known_topology_libtpu_refuses_here_is_not_called_unknown(libtpu, monkeypatch):
    """On a TPU machine libtpu may refuse a topology it knows (its own host bounds differ): the error says libtpu
    here refused it, with libtpu's reason, instead of calling a listed name unknown."""
    from jax.experimental import topologies

    from model.preflight.topology import TopologyError, load_topology

    reason = ('INVALID_ARGUMENT: Topology layout "v5e:1x1" is not divisible by the given (or default) '
              'chips_per_host_bounds "2x2x1"')

    def refuse(**kwargs):
        raise RuntimeError(reason)

    monkeypatch.setattr(topologies, "get_topology_desc", refuse)
    with pytest.raises(TopologyError) as refused:
        load_topology("v5e:1x1")
    assert str(refused.value) == f"libtpu here does not compile for TPU topology 'v5e:1x1' ({reason})"
