"""TPU preflight: compile the job's real programs for a TPU topology on this (CPU) machine, before renting any TPU.

`python -m pipeline.preflight --model M --topology T --height H --width W [--batch_size B]` reads only the configs
of `M` (a checkpoint, local or gs://, or a bundled preset: model.loading.presets), builds the three programs a worker
would run (encode, the fused denoising loop, decode) with the job's sharding over the topology's chips (data replicas x
model shards, parameters as shapes only), compiles them with libtpu's compiler, and prints per program the per-chip
bytes, FLOPs per image, the calibrated time, the Mosaic kernels and the compile time; then whether everything fits
in the chip's HBM and an estimate of seconds per image: the compiler's FLOPs and bytes at the efficiencies measured on
a TPU v5e chip (`V5E_CALIBRATION`), labelled "calibrated on v5e, not measured" for other chips. `--batch_size auto`
(the default, as the job's) searches the fastest batch per image up to `--max_batch_size` that fits, as the job's
launch does.
With `--compilation_cache_dir` (the job's) the programs go to JAX's persistent cache there and the answer is kept
beside it (pipeline/preflight_store.py), the store the launch uses: the same request again answers at once, compiling
nothing. Each program's compile logs its progress; Ctrl-C ends the command at once (exit 130), storing nothing.

Two corrections to XLA's cost analysis, both said in the output:
- it counts a loop body once: the denoising loop's FLOPs, bytes and seconds are multiplied by its steps;
- it knows nothing of Pallas kernels (splash attention, a Mosaic custom call: its FLOPs are not counted): attention
  is estimated from its FLOPs at its measured share of the chip's bf16 peak, and every program is timed by the
  calibrated roofline of the compiler's FLOPs and bytes. XLA's own `optimal_seconds` is not shown: libtpu 0.0.52
  gives negative values (for the decode too, which holds no kernel), and the JSON has it only where it is positive
  for a program without kernels.

This module is the command line (arguments, the printed tables, exit codes); the compiling and the estimates are the
model's (`model.fit`, model/preflight/aot.py), made with the generator's own factory, mesh and plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys

from model import (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_TEXT_ENCODER_OUT_LAYERS,
                   DTYPE_NAMES, PRESET_NAMES, QUANTIZE_MODES, Limits, ModelError, Report, ShardCountError,
                   TopologyError, count, format_bytes, is_preset, load_topology, preset_config, read_config,
                   shard_counts, validate)

from .errors import UsageError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreflightRequest:
    """What to compile: the model, the topology and the job's shape options (as `python -m pipeline.run` takes)."""

    model: str
    topology: str
    height: int
    width: int
    batch_size: int | None  # None: the fastest per image up to max_batch_size that fits
    dtype: str = "bfloat16"
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    model_shards: int | None = None     # None: the fewest that fit
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH
    hbm_bytes: int | None = None        # testing: HBM per chip instead of the chip's own
    text_encoder_out_layers: tuple[int, ...] = DEFAULT_TEXT_ENCODER_OUT_LAYERS
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    quantize: str = "none"              # as the job's --quantize
    reserved_bytes: int = 0             # per chip, kept free for what else runs there (--score_model's scorer)


def resolve_model(model: str):
    """`model`'s configs: a bundled preset's, or a checkpoint's (local or gs://; configs only, never a weight)."""
    if is_preset(model) and not os.path.isdir(model):
        return preset_config(model)
    if "://" not in model and not os.path.isdir(model):
        raise UsageError(f"--model {model!r} is neither a checkpoint folder nor a preset ({', '.join(PRESET_NAMES)})")
    return read_config(model)


def preflight(request: PreflightRequest, *, dump_dir: str | None = None) -> Report:
    """Check the request's options, then compile its programs for its topology and report (model.fit): without
    `model_shards`, the fewest shards (a divisor of the worker's devices) whose programs fit, else the most shards'
    report with advice. UsageError for an option the preflight cannot take."""
    config = resolve_model(request.model)
    if request.dtype not in DTYPE_NAMES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {request.dtype!r}")
    if request.batch_size is not None:
        count("batch_size", request.batch_size)
    count("max_batch_size", request.max_batch_size)
    text_len = count("max_sequence_length", request.max_sequence_length)
    valid = validate(prompt="", height=request.height, width=request.width,
                     num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
                     limits=Limits(size_multiple=config.size_multiple))
    try:
        topology = load_topology(request.topology)
        from model import fit  # JAX: loaded when the preflight compiles

        hbm_bytes = request.hbm_bytes
        if request.reserved_bytes:  # the generator's programs get what the scorer leaves of the chip
            hbm_bytes = (hbm_bytes or topology.chip.hbm_bytes) - request.reserved_bytes

        return fit(config, topology, model=request.model, dtype=request.dtype, height=request.height,
                   width=request.width, batch_size=request.batch_size, text_len=text_len,
                   num_inference_steps=valid.num_inference_steps, guidance_scale=valid.guidance_scale,
                   model_shards=request.model_shards, hbm_bytes=hbm_bytes,
                   out_layers=request.text_encoder_out_layers, dump_dir=dump_dir,
                   max_batch_size=request.max_batch_size, quantize=request.quantize)
    except TopologyError as e:
        raise UsageError(str(e)) from None
    except ShardCountError as e:
        raise UsageError(f"--model_shards {e.model_shards} must divide the {e.devices} devices of one "
                         f"{request.topology} host (choose from {shard_counts(e.devices)})") from None


# ------------------------------------------------------------------------------------------------ output

def _seconds(s: float) -> str:
    if s != s:  # NaN
        return "n/a"
    return f"{s * 1e3:.1f} ms" if abs(s) < 1 else f"{s:.2f} s"


def format_report(report: Report) -> str:
    """The human-readable tables: one row per program, then the whole worker."""
    topo = report.topology
    picked = f"; picked: the fastest per image up to {report.max_batch_size} that fits" if report.batch_picked else ""
    if report.batch_picked and not report.fits:
        picked = f"; none up to {report.max_batch_size} fits"
    quantized = " with int8 projections" if report.quantize == "int8" else ""
    head = (f"{report.model} on {topo.name} ({topo.chips} x {topo.chip.name}, {len(topo.devices)} devices"
            f"{f', first of {topo.hosts} hosts' if topo.hosts > 1 else ''}), {report.dtype}{quantized}, "
            f"{report.height}x{report.width}, {report.steps} steps{' with CFG' if report.cfg else ''}, batch "
            f"{report.batch} ({report.batch // report.data_replicas} per data replica{picked})")
    shards = (f"{report.model_shards} model shard(s) x {report.data_replicas} data replica(s)"
              f"{' (picked: the fewest that fit)' if report.auto_shards and report.fits else ''}")
    # GFLOP/image: all chips' work, so a program repeated on every model shard counts each
    rows = [("program", "args/chip", "temp/chip", "out/chip", "GFLOP/image", "est s", "Mosaic", "compile s")]
    for p in report.programs.values():
        flops = report.flops_per_image(p)
        rows.append((p.name, format_bytes(report.per_chip(p.argument_bytes)),
                     format_bytes(report.per_chip(p.temp_bytes)), format_bytes(report.per_chip(p.output_bytes)),
                     "refused" if p.compile_error else f"{flops / 1e9:,.{0 if flops >= 1e10 else 3}f}",
                     _seconds(report.est_seconds(p)), str(p.mosaic_kernels),
                     f"{p.compile_s:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    table += [f"{p.name}: refused by the compiler: {p.compile_error}" for p in report.programs.values()
              if p.compile_error]
    spi = report.est_seconds_per_image
    whole = [
        f"parameters resident per chip: {format_bytes(report.resident_bytes_per_chip)} ("
        + ", ".join(f"{k} {format_bytes(report.per_chip(v))}" for k, v in report.parameter_bytes.items()) + ")",
        f"peak per chip: {format_bytes(report.peak_bytes_per_chip)} (resident + {report.largest_program}'s "
        f"temporaries, outputs and other arguments)",
        f"HBM per chip: {format_bytes(report.hbm_bytes_per_chip)}; headroom "
        f"{format_bytes(report.hbm_bytes_per_chip - report.peak_bytes_per_chip)}; "
        f"fits: {'yes' if report.fits else 'NO'}",
        f"estimated {_seconds(spi)} per image, {3600 / spi:,.0f} images/hour per worker host ({report.estimate_label};"
        f" compute-bound floor: {_seconds(report.seconds_at_peak_per_image)} per image, every FLOP at the bf16 peak)"
        if spi and math.isfinite(spi) else "estimated time: n/a (a program was not compiled)",
    ]
    notes = [
        f"Bytes and FLOPs are the compiler's for {topo.chip.name} (bf16 peak {topo.chip.bf16_flops / 1e12:,.0f} "
        f"TFLOP/s per chip); the time is a {report.estimate_label}, not a measurement of this configuration.",
        f"Attention runs in {report.attention} kernels (Mosaic custom calls), which XLA's cost analysis does not see: "
        f"their FLOPs are added from the shapes. est s is the calibrated roofline; XLA's own time estimate "
        f"(optimal_seconds) is not shown: it cannot see such kernels, and libtpu gives it negative values.",
        f"XLA counts a loop body once: denoise is multiplied by its {report.steps} steps. GFLOP/image is the work of "
        f"all chips (the VAE decode, not split, runs on every model shard). Collectives between shards are not timed.",
    ]
    traffic = [f"{p.name}: " + ", ".join(f"{kind} {ops} x = {format_bytes(size)}" for kind, (ops, size) in
                                         sorted(p.collectives.items()))
               for p in report.programs.values() if p.collectives]
    if traffic:
        traffic = ["collectives per device (per denoising step for denoise; not timed):", *traffic]
    searched = []
    if report.batch_trials and (report.batch_picked or len(report.batch_trials) > 1):
        what = f"batch search (up to {report.max_batch_size})" if report.batch_picked else "batches compiled"
        searched = [f"{what}: " + ", ".join(f"{b}{f' with {s} shards' if s != report.model_shards else ''} "
                                            f"{'fits' if ok else 'does not fit'} ({format_bytes(peak)})"
                                            for b, s, peak, ok in report.batch_trials)]
    out = [head, shards, *searched, "", *table, "", *whole, "", *traffic, *([""] if traffic else []), *notes]
    if not report.fits:
        out += ["", shortfall_message(report)] + [f"  would fit: {a}" for a in report.advice]
    return "\n".join(out)


def shortfall_message(report: Report) -> str:
    """The non-fit line: which program, and by how much it misses the chip's HBM."""
    refused = report.programs[report.largest_program].compile_error
    if refused:
        return (f"does not fit: the compiler refused {report.largest_program} with {report.model_shards} model "
                f"shard(s): {refused}; about {format_bytes(report.peak_bytes_per_chip - report.hbm_bytes_per_chip)} "
                f"per chip short of the {format_bytes(report.hbm_bytes_per_chip)} of HBM")
    return (f"does not fit: {report.largest_program} peaks at {format_bytes(report.peak_bytes_per_chip)} per chip "
            f"with {report.model_shards} model shard(s), "
            f"{format_bytes(report.peak_bytes_per_chip - report.hbm_bytes_per_chip)} more than the "
            f"{format_bytes(report.hbm_bytes_per_chip)} of HBM per chip")


DEMO_MODEL = "demo"  # --model=demo: the bundled demo's tiny random-weight checkpoint (built on first use)
EXAMPLE = f"""\
example: the bundled demo's tiny checkpoint for one v5e chip, about a minute on a CPU (needs the TPU compiler:
pip install -e '.[preflight]', and the demo's: '.[demo]'):
  python -m pipeline.preflight --model={DEMO_MODEL} --topology=v5e:1x1 --height=128 --width=128 --batch_size=1 \\
      --max_sequence_length=32
then the real model, from its preset (configs only, no weights needed), on four chips:
  python -m pipeline.preflight --model=klein-4b --topology=v5e:2x2 --height=1024 --width=1024
(without --batch_size it finds the fastest batch per image up to --max_batch_size that fits, as the job's launch does)
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line's options, each with its help, and EXAMPLE at the end of --help."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.preflight", description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Checkpoint (local folder or gs://; configs only), a preset: "
                                                       "klein-4b, klein-9b, klein-base-4b, klein-base-9b, or "
                                                       f"'{DEMO_MODEL}' (the bundled demo's tiny checkpoint).")
    parser.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:1x1, v5e:2x2, v6e:2x2, tpu7x:1x1; "
                                                          "'attached': this machine's own chips.")
    parser.add_argument("--height", type=int, required=True, help="Image height in pixels, as the job's --height.")
    parser.add_argument("--width", type=int, required=True, help="Image width in pixels, as the job's --width.")
    parser.add_argument("--batch_size", type=batch_size_value, default=None, metavar="N|auto",
                        help="The job's --batch_size (images per compiled batch, rounded up to whole data replicas); "
                             "default auto: the fastest per image up to --max_batch_size that fits.")
    parser.add_argument("--max_batch_size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                        help="The most images per batch --batch_size auto tries, as the job's --max_batch_size "
                             "(default: %(default)s).")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES,
                        help="Compute dtype, as the job's --dtype (default: %(default)s).")
    parser.add_argument("--quantize", default="none", choices=QUANTIZE_MODES,
                        help="As the job's --quantize: int8 weights and activations in the projections "
                             "(default: %(default)s).")
    parser.add_argument("--num_inference_steps", type=int, default=None,
                        help="Denoising steps (default: the checkpoint's: 4 distilled, 50 base).")
    parser.add_argument("--guidance_scale", type=float, default=None,
                        help="Guidance scale, as the job's --guidance_scale (default: the checkpoint's).")
    parser.add_argument("--model_shards", type=int, default=None,
                        help="Devices sharing one copy of the weights (default: the fewest that fit).")
    parser.add_argument("--max_sequence_length", type=int, default=DEFAULT_MAX_SEQUENCE_LENGTH,
                        help="Text-encoder tokens per prompt, as the job's --max_sequence_length "
                             "(default: %(default)s).")
    parser.add_argument("--compilation_cache_dir", default=None, metavar="DIR",
                        help="The job's --compilation_cache_dir (local or gs://): the compiled programs go to JAX's "
                             "persistent cache there, and the answer is kept beside it (preflight-answers/), so a "
                             "run with the same model, options, versions and compiler flags answers at once.")
    parser.add_argument("--dump_dir", default=None, help="Write each compiled program's text to DIR/<program>.txt.")
    parser.add_argument("--hbm_bytes", type=int, default=None, help=argparse.SUPPRESS)  # testing: force a capacity
    parser.add_argument("--reserved_bytes", type=int, default=0, metavar="BYTES",
                        help="Bytes per chip kept free for what runs beside the generator (the job's --score_model "
                             "scorer; the launch fills it in). Default: none.")
    return parser


def batch_size_value(text: str) -> int | None:
    """--batch_size: a number, or 'auto' (None: the search)."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of images or 'auto', got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from model import fit  # JAX, as before any compiling

    for name in (__name__, fit.__module__):  # and the model's progress through the compiling
        logging.getLogger(name).setLevel(logging.INFO)
    if args.model == DEMO_MODEL and not os.path.isdir(args.model):
        from .demo import demo_checkpoint

        try:
            args.model = demo_checkpoint()
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    request = PreflightRequest(model=args.model, topology=args.topology, height=args.height, width=args.width,
                               batch_size=args.batch_size, dtype=args.dtype,
                               num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
                               model_shards=args.model_shards, max_sequence_length=args.max_sequence_length,
                               hbm_bytes=args.hbm_bytes, max_batch_size=args.max_batch_size,
                               quantize=args.quantize, reserved_bytes=args.reserved_bytes)
    store = fields = None
    try:
        if args.compilation_cache_dir and args.dump_dir is None:  # a dump asks for the programs' text: compile
            from .preflight_store import AnswerStore, answer_fields

            store = AnswerStore(args.compilation_cache_dir)
            fields = answer_fields(resolve_model(request.model), request)
            answer = store.load(fields)
            if answer is not None:
                print(format_stored(answer, store.path_for(fields)))
                print(json.dumps(answer))
                return _exit_status(answer)
        if args.compilation_cache_dir:
            from model import enable_compilation_cache

            enable_compilation_cache(args.compilation_cache_dir)
        report = interruptible(lambda: preflight(request, dump_dir=args.dump_dir))
    except (UsageError, ModelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    answer = report.to_json()
    if not report.fits:
        answer["shortfall"] = shortfall_message(report)
    if store is not None:
        path = store.save(fields, answer)
        if path:
            logger.info("the answer is stored at %s: the same request answers from it without compiling", path)
    print(format_report(report))
    print(json.dumps(answer))
    return _exit_status(answer)


def _exit_status(answer: dict) -> int:
    """0 when the programs fit, else 1 with the shortfall on stderr."""
    if answer["fits"]:
        return 0
    print(f"error: {answer.get('shortfall') or 'does not fit'}", file=sys.stderr)
    return 1


def format_stored(answer: dict, path: str) -> str:
    """The lines of a stored answer: where it came from, and what it says."""
    picked = " (picked)" if answer.get("batch_picked") else ""
    return (f"preflight answer stored at {path} (compiled nothing): {answer['model']} on {answer['topology']}, "
            f"batch {answer['batch']}{picked}, {answer['model_shards']} model shard(s); peak "
            f"{format_bytes(answer['peak_bytes_per_chip'])} of {format_bytes(answer['hbm_bytes_per_chip'])} per "
            f"chip; fits: {'yes' if answer['fits'] else 'NO'}; estimated "
            f"{_seconds(answer['est_seconds_per_image'] or float('nan'))} per image")


INTERRUPTED_STATUS = 130


def interruptible(work):
    """`work()`'s result, run on a thread while this (main) thread waits, so that Ctrl-C ends the process at once
    with status 130 even while the compiler holds its thread for minutes; nothing is stored (the answer is stored
    only after `work` returns)."""
    import threading

    box: dict = {}

    def run():
        try:
            box["result"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread as it is
            box["error"] = e

    thread = threading.Thread(target=run, name="preflight", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    except KeyboardInterrupt:
        print("interrupted: the preflight stopped; nothing was stored", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED_STATUS)
    if "error" in box:
        raise box["error"]
    return box["result"]


if __name__ == "__main__":
    sys.exit(main())
