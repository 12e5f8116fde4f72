"""Editing benchmark: the cost of image-conditioned generation (klein's reference images) against text-to-image at
the same output size, ours and diffusers', side by side in one run.

    python -m benchmarks.editing --preset small --height 64 --width 64 --refs 0,1,3 --repeats 3

For each reference count (0 = text-to-image) both engines generate the same images (same weights, same noise, the
same references: random smooth images of --ref-size pixels, all of one size); each engine is warmed up once per
count (our first call compiles the denoise program for that reference token count and the VAE encoder for the
reference size), then the repetitions are interleaved and the median seconds per image reported, with the ratio to
text-to-image. Our warm-up (compile) time per count is reported too. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings

import numpy as np

from . import engines
from .runs import peak_rss_mb, progress


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.editing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint folder instead of the preset's")
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--ref-size", type=int, default=None, help="reference side in pixels (default: the output's)")
    ap.add_argument("--refs", default="0,1,3", help="reference counts, comma separated (0 = text-to-image)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-diffusers", action="store_true")
    return ap.parse_args(argv)


def reference_images(count: int, size: int, seed: int = 0) -> list[np.ndarray]:
    """`count` smooth random RGB images of size x size (noise upsampled: closer to photos than white noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        small = rng.integers(0, 256, (max(size // 8, 2),) * 2 + (3,), dtype=np.uint8)
        out.append(np.asarray(Image.fromarray(small).resize((size, size), Image.Resampling.BILINEAR)))
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    from benchmarks.presets import PRESETS, ensure_checkpoint

    import model

    path = args.checkpoint or ensure_checkpoint(args.preset)
    max_seq = PRESETS[args.preset]["max_sequence_length"]
    counts = [int(c) for c in args.refs.split(",")]
    ref_size = args.ref_size or max(args.height, args.width, 64)
    h, w, n = args.height, args.width, args.batch
    progress(f"loading {path}")
    ours = engines.JaxEngine("ours", model.load(path, dtype=args.dtype, max_sequence_length=max_seq))
    eng = [ours]
    if not args.skip_diffusers and engines.diffusers_available():
        eng.append(engines.DiffusersEngine(path, args.dtype, max_seq))
    refs = {c: reference_images(c, ref_size) for c in counts}
    prompts = [f"edit number {i}" for i in range(n)]
    warm: dict = {}
    times: dict = {(e.name, c): [] for e in eng for c in counts}
    for c in counts:
        for e in eng:
            progress(f"warm-up {e.name}, {c} reference(s)")
            start = time.perf_counter()
            e.generate(prompts, list(range(n)), h, w, args.steps, 1.0, references=refs[c] or None)
            warm[(e.name, c)] = time.perf_counter() - start
    for r in range(args.repeats):
        for c in counts:
            for e in eng:
                seeds = list(range(100 * (r + 1), 100 * (r + 1) + n))
                start = time.perf_counter()
                e.generate(prompts, seeds, h, w, args.steps, 1.0, references=refs[c] or None)
                times[(e.name, c)].append((time.perf_counter() - start) / n)
    med = {k: statistics.median(v) for k, v in times.items()}
    m = ours.gen.size_multiple
    tokens = {c: sum((a // m) * (b // m) for a, b in ours.gen.reference_signature(refs[c])) for c in counts}
    target_tokens = (h // m) * (w // m)
    print(f"\nEditing vs text-to-image: preset {args.preset}, {h}x{w} output, references {ref_size}x{ref_size}, "
          f"batch {n}, {args.steps} steps, {args.dtype}, median of {args.repeats}")
    names = [e.name for e in eng]
    header = "| refs | image tokens (target + refs) | " + " | ".join(
        f"{m} s/img | {m} vs t2i" for m in names) + " | ours first call (compile) s |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for c in counts:
        cells = []
        for name in names:
            base = med.get((name, 0)) if 0 in counts else None
            ratio = f"{med[(name, c)] / base:.2f}x" if base else "-"
            cells.append(f"{med[(name, c)]:.3f} | {ratio}")
        print(f"| {c} | {target_tokens} + {tokens[c]} | " + " | ".join(cells) + f" | {warm[('ours', c)]:.1f} |")
    result = {"preset": args.preset, "height": h, "width": w, "ref_size": ref_size, "batch": n, "steps": args.steps,
              "dtype": args.dtype, "repeats": args.repeats,
              "seconds_per_image": {name: {str(c): round(med[(name, c)], 4) for c in counts} for name in names},
              "ours_first_call_seconds": {str(c): round(warm[("ours", c)], 2) for c in counts},
              "reference_tokens": {str(c): tokens[c] for c in counts}, "target_tokens": target_tokens,
              "references_encoded": ours.gen.stats["references_encoded"],
              "encoder_sizes_compiled": len(ours.gen.reference_encoder.sizes) if ours.gen.reference_encoder else 0,
              "peak_rss_mb": round(peak_rss_mb(), 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
