"""How quantization changes the images of your own model and prompts: every prompt generated in bf16 and quantized
with the same seeds, PSNR and SSIM per image, their distribution, and a side-by-side page, worst first.

    python -m benchmarks.quality --model=black-forest-labs/FLUX.2-klein-4B --input=prompts.jsonl --quantize int8
    python -m benchmarks.quality --model=gs://bucket/klein-4b --input='prompts/*.csv' --prompt_column=caption \\
        --output=quality --max_images=64 --batch_size=4

--input is read as the job reads it (JSONL, CSV/TSV, Parquet or plain text, compressed or not; --prompt_column,
--id_column, --column_map): each record's seed, size, steps and guidance where it gives them, these options'
defaults otherwise. A record that fails the job's validation is reported and skipped. The reference model (--dtype,
bfloat16) is loaded, generates every image into {output}/reference/ and is freed; then the --quantize model does the
same into {output}/{quantize}/: one model in memory at a time (a real-size model in both forms may not fit one chip).
Per image: PSNR (dB), SSIM (benchmarks/similarity.py) and max |diff| (of 255); their min, 5th percentile, median,
mean and max; images below --min_psnr (30 dB) or --min_ssim (0.9) are flagged: look at those before trusting the
quantized model with a dataset (the thresholds are suggestions, not a verdict). {output}/index.html shows reference |
quantized | |difference| x 8 side by side, worst first (lowest SSIM, then PSNR); {output}/quality.json holds the
result. Prints a table, then the result as one JSON line last. PSNR of identical images is infinite: null in the JSON.
Records with reference images (editing) are skipped: this check is text-to-image. Exit 0 once compared (flagged
images included), 2 on a usage error (nothing generated).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import logging
import math
import posixpath
import sys

import numpy as np

LOGGER = logging.getLogger("benchmarks.quality")

MIN_PSNR = 30.0  # dB: below it an image is flagged
MIN_SSIM = 0.9
DIFF_GAIN = 8  # the difference image shows |reference - quantized| x DIFF_GAIN
DEFAULT_MAX_IMAGES = 64
REFERENCE_DIR = "reference"
DIFF_DIR = "diff"
INDEX_FILE = "index.html"
RESULT_FILE = "quality.json"


def parse_args(argv=None):
    from model import DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_SIZE, DTYPE_NAMES
    from model.options import QUANTIZE_MODES
    from transforms.inputs.columns import ColumnMap
    from transforms.inputs.formats import FORMATS

    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint: local folder, gs:// prefix or Hub id owner/name")
    ap.add_argument("--model_variant", default=None, help="weight-file variant (fp16 for *.fp16.safetensors)")
    ap.add_argument("--input", required=True, help="prompt file or glob (gs:// or local)")
    ap.add_argument("--input_format", default="auto", choices=("auto",) + FORMATS)
    ap.add_argument("--prompt_column", default=ColumnMap.prompt_column)
    ap.add_argument("--id_column", default=ColumnMap.id_column)
    ap.add_argument("--column_map", default=None, metavar="OLD=NEW,...")
    ap.add_argument("--quantize", default="int8", choices=[q for q in QUANTIZE_MODES if q != "none"])
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES, help="the reference's (and compute) dtype")
    ap.add_argument("--output", default="quality", help="folder (or gs:// prefix) of the images and the page")
    ap.add_argument("--height", type=int, default=DEFAULT_SIZE, help="for records that give none")
    ap.add_argument("--width", type=int, default=DEFAULT_SIZE, help="for records that give none")
    ap.add_argument("--num_inference_steps", type=int, default=None, help="default: the checkpoint's")
    ap.add_argument("--guidance_scale", type=float, default=None, help="default: the checkpoint's")
    ap.add_argument("--seed", type=int, default=0, help="base seed of records without one (as the job's --seed)")
    ap.add_argument("--batch_size", type=int, default=1, help="images per generate call")
    ap.add_argument("--max_images", type=int, default=DEFAULT_MAX_IMAGES, help="compare at most this many")
    ap.add_argument("--max_sequence_length", type=int, default=DEFAULT_MAX_SEQUENCE_LENGTH)
    ap.add_argument("--min_psnr", type=float, default=MIN_PSNR, help="flag images below this PSNR (dB)")
    ap.add_argument("--min_ssim", type=float, default=MIN_SSIM, help="flag images below this SSIM")
    args = ap.parse_args(argv)
    for name in ("batch_size", "max_images", "max_sequence_length"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return ap, args


# --------------------------------------------------------------------------------------------- input
def read_requests(pattern: str, input_format: str, defaults, columns) -> tuple[list, list[dict]]:
    """(valid GenerationRequests in file and line order, error rows) of every file `pattern` matches, read and
    validated as the job does; ValueError when it matches no file or a file cannot be read in the format asked."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    from transforms import layout
    from transforms.inputs.columns import ColumnResolver
    from transforms.inputs.delimited import field_limit_for
    from transforms.inputs.files import InputReadError, open_decompressed
    from transforms.inputs.formats import detect_format
    from transforms.inputs.readers import canonical_path, iter_raw_records
    from transforms.inputs.validation import parse_raw
    from transforms.requests import GenerationRequest

    try:
        matched = FileSystems.match([pattern])[0].metadata_list
    except Exception as e:  # noqa: BLE001 - Beam raises BeamIOError, or the filesystem's own, for a bad pattern
        raise ValueError(f"--input={pattern!r} cannot be listed: {e}") from None
    paths = sorted({canonical_path(m.path) for m in matched})
    if not paths:
        raise ValueError(f"--input={pattern!r} matches no file")
    resolver, limit = ColumnResolver(columns), field_limit_for(defaults.max_prompt_bytes)
    requests, errors = [], []
    for path in paths:
        fmt = detect_format(path, input_format)  # InputFormatError (a ValueError): a table asked as text
        with FileSystems.open(path, mime_type="application/octet-stream",
                              compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            stream = raw if fmt == "parquet" else open_decompressed(raw, path)
            try:
                for record in iter_raw_records(stream, path, fmt, limit, columns):
                    parsed = parse_raw(record, defaults, resolver)
                    (requests if isinstance(parsed, GenerationRequest) else errors).append(parsed)
            except InputReadError as e:
                done = stream.complete_lines
                errors.append(layout.error_row(source=path, line=done + 1, reason=f"input file cannot be read to "
                                               f"its end: {e}; the records from line {done + 1} on were not read"))
    return requests, errors


def _skip_row(request, reason: str) -> dict:
    from transforms import layout

    return layout.error_row(source=request.source, line=request.line, reason=reason, id=request.id,
                            record={"prompt": request.prompt})


def comparable(requests: list) -> tuple[list, list[dict]]:
    """(the requests to compare, rows of those left out): one request per id (a repeat with the same parameters is
    dropped silently, one with others is skipped, as the job rejects it), none with reference images."""
    kept, skipped, seen = [], [], {}
    for request in requests:
        first = seen.get(request.id)
        if first is not None:
            if first.params() != request.params():
                skipped.append(_skip_row(request, f"id {request.id!r} is used by another record with other "
                                                  f"parameters ({first.source}:{first.line}); the first is kept"))
            continue
        seen[request.id] = request
        if request.reference_images:
            skipped.append(_skip_row(request, "has reference images: this check compares text-to-image records"))
            continue
        kept.append(request)
    return kept, skipped


def image_tasks(requests: list, max_images: int) -> tuple[list, int]:
    """(the first `max_images` images of the requests, in input order; how many were left out)."""
    tasks = [task for request in requests for task in request.tasks()]
    return tasks[:max_images], max(0, len(tasks) - max_images)


def file_name(task) -> str:
    """The image's file name in each folder: the job's own (`{id}.png`, `{id}-{j}.png`)."""
    from transforms import layout

    return posixpath.basename(layout.image_file_name(task.request.id, task.index, task.request.num_images))


def batches(tasks: list, batch_size: int):
    """Lists of at most `batch_size` tasks that one generate call takes (same size, steps and guidance), the
    shapes in order of first appearance."""
    groups: dict[tuple, list] = {}
    for task in tasks:
        r = task.request
        groups.setdefault((r.height, r.width, r.num_inference_steps, r.guidance_scale), []).append(task)
    for group in groups.values():
        for start in range(0, len(group), batch_size):
            yield group[start:start + batch_size]


# --------------------------------------------------------------------------------------------- generation
def generate_phase(checkpoint: str, tasks: list, folder: str, *, dtype: str, quantize: str, batch_size: int,
                   max_sequence_length: int, variant: str | None = None) -> tuple[dict[str, str], dict]:
    """Load the model (`quantize` "none" or a mode), write every task's image as PNG into `folder`, free the model.
    Returns ({file name: why it was not written} for images that came out non-finite, facts of the run)."""
    import model
    from transforms import layout
    from transforms.sinks.encoding import encode_png
    from transforms.sinks.writes import write_bytes_atomic

    gen = model.load(checkpoint, dtype=dtype, quantize=quantize, batch_size=batch_size,
                     max_sequence_length=max_sequence_length, variant=variant)
    failed: dict[str, str] = {}
    facts = {"load_s": gen.load_phases.get("wall_s"), "generate_s": 0.0}
    done = 0
    try:
        for chunk in batches(tasks, batch_size):
            r = chunk[0].request
            result = gen.generate_result([t.request.prompt for t in chunk], [t.seed for t in chunk], r.height,
                                         r.width, r.num_inference_steps, r.guidance_scale)
            facts["generate_s"] += result.seconds
            for task, pixels, bad in zip(chunk, result.images, result.nonfinite or (None,) * len(chunk)):
                name = file_name(task)
                if bad is not None:
                    failed[name] = bad.describe()
                    continue
                write_bytes_atomic(layout.join(folder, name), encode_png(pixels), mime_type="image/png")
            done += len(chunk)
            LOGGER.info("%s: %d of %d images generated (%s)", quantize, done, len(tasks), folder)
    finally:
        # The only reference to the model: its weights (cycles included) are gone before the next model loads.
        del gen
        gc.collect()
    return failed, facts


# --------------------------------------------------------------------------------------------- comparison
def read_png(path: str) -> np.ndarray:
    from PIL import Image

    from transforms.sinks.writes import read_bytes

    with Image.open(io.BytesIO(read_bytes(path))) as im:
        return np.asarray(im.convert("RGB"))


def diff_image(reference: np.ndarray, candidate: np.ndarray, gain: int = DIFF_GAIN) -> np.ndarray:
    """|reference - candidate| x gain, clipped: where the images differ, bright."""
    diff = np.abs(reference.astype(np.int16) - candidate.astype(np.int16)) * gain
    return np.clip(diff, 0, 255).astype(np.uint8)


def compare(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """PSNR (dB, inf when identical), SSIM and max |diff| of two uint8 images."""
    from .drift import psnr
    from .similarity import ssim

    return {"psnr": psnr(reference, candidate), "ssim": ssim(reference, candidate),
            "max_abs": int(np.abs(reference.astype(np.int16) - candidate.astype(np.int16)).max())}


def distribution(values: list[float]) -> dict:
    """min, 5th percentile, median, mean and max (None each for no value). The 5th percentile is the observation at
    or below it (no interpolation: the lower side, and defined when some PSNRs are infinite)."""
    if not values:
        return {k: None for k in ("min", "p5", "median", "mean", "max")}
    a = np.asarray(values, np.float64)
    return {"min": float(a.min()), "p5": float(np.percentile(a, 5, method="lower")),
            "median": float(np.median(a)), "mean": float(a.mean()), "max": float(a.max())}


def worst_first(images: list[dict]) -> list[dict]:
    """Images not compared first, then by SSIM, then PSNR, ascending (the id breaks ties)."""
    def key(image):
        if image["ssim"] is None:
            return (0, 0.0, 0.0, image["file"])
        return (1, image["ssim"], image["psnr"], image["file"])

    return sorted(images, key=key)


def is_flagged(image: dict, min_psnr: float, min_ssim: float) -> bool:
    return image["ssim"] is None or image["psnr"] < min_psnr or image["ssim"] < min_ssim


def json_safe(value):
    """The report with infinite (and NaN) floats as null: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def table(report: dict, most: int = 10) -> str:
    """The report as text: distribution, flagged count, the worst images."""
    from .quality_page import format_psnr, format_ssim

    lines = [f"{report['quantize']} against {report['dtype']} on {report['model']}: {len(report['images'])} "
             f"image(s) compared, {len(report['skipped'])} record(s) skipped, {report['left_out']} image(s) over "
             f"--max_images left out", f"{'':10}{'min':>12}{'p5':>12}{'median':>12}{'mean':>12}{'max':>12}"]
    for name, fmt in (("PSNR", format_psnr), ("SSIM", format_ssim)):
        stats = report["distribution"][name.lower()]
        lines.append(f"{name:10}" + "".join(f"{fmt(stats[k]):>12}" for k in ("min", "p5", "median", "mean", "max")))
    t = report["thresholds"]
    lines.append(f"flagged (PSNR < {t['psnr']:g} dB or SSIM < {t['ssim']:g}, or not compared): {report['flagged']} "
                 f"of {len(report['images'])}: look at them first in {report['page']}")
    lines.append(f"worst {min(most, len(report['images']))}:  {'PSNR':>10}  {'SSIM':>7}  {'max|diff|':>9}  file")
    for image in report["images"][:most]:
        mark = "  <- " + (image["error"] or "flagged") if image["flagged"] else ""
        max_abs = "–" if image["max_abs"] is None else image["max_abs"]
        lines.append(f"          {format_psnr(image['psnr']):>10}  {format_ssim(image['ssim']):>7}  {max_abs:>9}  "
                     f"{image['file']}{mark}")
    for row in report["skipped"][:20]:
        lines.append(f"skipped {row['source']}:{row['line']}: {row['reason']}")
    if len(report["skipped"]) > 20:
        lines.append(f"... and {len(report['skipped']) - 20} more skipped records ({RESULT_FILE})")
    return "\n".join(lines)


def compare_folders(output: str, tasks: list, quantize: str, failed: dict[str, dict[str, str]],
                    min_psnr: float, min_ssim: float) -> list[dict]:
    """Per image: its request's facts, PSNR, SSIM, max |diff| and flag, the difference image written to
    {output}/diff/; paths relative to `output` (None where an image is missing)."""
    from transforms import layout
    from transforms.sinks.encoding import encode_png
    from transforms.sinks.writes import write_bytes_atomic

    images = []
    for task in tasks:
        name, r = file_name(task), task.request
        errors = [f"{label}: {failed[label][name]}" for label in (REFERENCE_DIR, quantize) if name in failed[label]]
        image = {"id": r.id, "file": name, "prompt": r.prompt, "seed": task.seed, "height": r.height,
                 "width": r.width, "num_inference_steps": r.num_inference_steps, "guidance_scale": r.guidance_scale,
                 "psnr": None, "ssim": None, "max_abs": None, "error": "; ".join(errors) or None,
                 "reference": None if name in failed[REFERENCE_DIR] else f"{REFERENCE_DIR}/{name}",
                 "candidate": None if name in failed[quantize] else f"{quantize}/{name}", "diff": None}
        if not errors:
            ref = read_png(layout.join(output, image["reference"]))
            cand = read_png(layout.join(output, image["candidate"]))
            image.update(compare(ref, cand))
            image["diff"] = f"{DIFF_DIR}/{name}"
            write_bytes_atomic(layout.join(output, image["diff"]), encode_png(diff_image(ref, cand)),
                               mime_type="image/png")
        image["flagged"] = is_flagged(image, min_psnr, min_ssim)
        images.append(image)
    return worst_first(images)


def main(argv=None) -> dict:
    ap, args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from model import CheckpointError, ModelError
    from model.loading.checkpoint import read_config, resolve_checkpoint
    from transforms import layout
    from transforms.inputs.columns import ColumnMap, parse_column_map
    from transforms.inputs.validation import RequestDefaults
    from transforms.sinks.writes import write_bytes_atomic

    from .quality_page import render

    try:
        columns = ColumnMap(args.prompt_column, args.id_column, parse_column_map(args.column_map)).validate()
        checkpoint = resolve_checkpoint(args.model, variant=args.model_variant)
        config = read_config(checkpoint, args.model_variant)
        defaults = RequestDefaults(height=args.height, width=args.width, num_inference_steps=args.num_inference_steps,
                                   guidance_scale=args.guidance_scale, seed=args.seed,
                                   size_multiple=config.size_multiple).validate()
        requests, skipped = read_requests(args.input, args.input_format, defaults, columns)
    except (ValueError, CheckpointError, ModelError) as e:
        ap.error(f"{type(e).__name__}: {e}" if isinstance(e, ModelError) else str(e))
    requests, left = comparable(requests)
    skipped += left
    tasks, left_out = image_tasks(requests, args.max_images)
    if not tasks:
        for row in skipped:
            print(f"skipped {row['source']}:{row['line']}: {row['reason']}", file=sys.stderr)
        ap.error(f"--input={args.input!r} holds no record to compare ({len(skipped)} skipped)")
    if left_out:
        LOGGER.info("--max_images=%d: the first %d images are compared, %d left out", args.max_images,
                    len(tasks), left_out)

    failed, facts = {}, {}
    common = dict(dtype=args.dtype, batch_size=args.batch_size, max_sequence_length=args.max_sequence_length,
                  variant=args.model_variant)
    for label, quantize in ((REFERENCE_DIR, "none"), (args.quantize, args.quantize)):
        LOGGER.info("%s: loading %s (%s, quantize=%s) and generating %d image(s)", label, checkpoint, args.dtype,
                    quantize, len(tasks))
        failed[label], facts[label] = generate_phase(checkpoint, tasks, layout.join(args.output, label),
                                                     quantize=quantize, **common)

    images = compare_folders(args.output, tasks, args.quantize, failed, args.min_psnr, args.min_ssim)
    compared = [i for i in images if i["ssim"] is not None]
    report = {"model": args.model, "checkpoint": checkpoint, "quantize": args.quantize, "dtype": args.dtype,
              "input": args.input, "output": args.output, "page": layout.join(args.output, INDEX_FILE),
              "thresholds": {"psnr": args.min_psnr, "ssim": args.min_ssim}, "diff_gain": DIFF_GAIN,
              "distribution": {"psnr": distribution([i["psnr"] for i in compared]),
                               "ssim": distribution([i["ssim"] for i in compared])},
              "flagged": sum(i["flagged"] for i in images), "identical": sum(i["max_abs"] == 0 for i in compared),
              "not_compared": len(images) - len(compared), "left_out": left_out, "phases": facts,
              "images": images, "skipped": skipped}
    page = render(report, reference_label=f"reference ({args.dtype})", candidate_label=args.quantize,
                  diff_label=f"|difference| x {DIFF_GAIN}", result_file=RESULT_FILE)
    write_bytes_atomic(layout.join(args.output, INDEX_FILE), page.encode("utf-8"), mime_type="text/html")
    line = json.dumps(json_safe(report), allow_nan=False)
    write_bytes_atomic(layout.join(args.output, RESULT_FILE), (line + "\n").encode("utf-8"),
                       mime_type="application/json")
    print(table(report))
    print(line)
    return report


if __name__ == "__main__":
    main()
