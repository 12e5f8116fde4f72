"""What scoring costs on the chip: CLIP ViT-L/14 (real shapes, random weights) beside klein at real shapes.

    python -m benchmarks.score_chip --preset klein-4b --height 1024 --width 1024 --batch 1 --out $OUT

For each of bf16 and int8 (--quantize): loads the preset's random-weight checkpoint, times `generate()` per image
without and with the scorer attached (CLIP, three zero-shot labels, a LAION-layout head; the prompts are new each
run, so their text is encoded too), alternating the two, and the scoring program alone on the decode's pixels; the
scoring program's compiled memory (XLA's memory analysis) and the scorer's parameters; the device's peak memory; and
the chip's free memory after the generator's largest program at this batch against what the scorer adds, i.e.
whether `--batch_size auto`'s batch still fits. Prints one line per figure and a JSON line last. A measurement
tool: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

from .runs import device_memory, progress

# CLIPModel config of openai/clip-vit-large-patch14 (transformers' layout), the default score model.
VIT_L14 = {
    "architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": 768,
    "text_config": {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                    "layer_norm_eps": 1e-5, "eos_token_id": 2},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "hidden_act": "quick_gelu",
                      "layer_norm_eps": 1e-5},
}
LAION_HEAD = (768, 1024, 128, 64, 16, 1)  # LAION's improved aesthetic predictor on ViT-L/14 embeddings
LABELS = ("a photo", "a drawing", "nsfw content")


def save_byte_tokenizer(folder: str) -> None:
    """A byte-level CLIP tokenizer (one token per byte, and per byte ending a word; no merges), its two special
    tokens last: enough to tokenize any prompt into ids below any CLIP vocabulary's size."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": 256 + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = 512, 513
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(folder)


def build_clip_checkpoint(folder: str) -> str:
    """ViT-L/14's shapes with random bf16 weights (no torch), the byte tokenizer and CLIP's image processing, plus a
    LAION-layout head at `folder`/head/aesthetic.safetensors; built once."""
    import jax.numpy as jnp

    from model.engine.scoring import clip_tensors
    from model.nets.clip import CLIPConfig

    from .realsize import write_safetensors_component

    if os.path.isfile(head_path(folder)):
        return folder
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(VIT_L14, f)
    _, expected, optional = clip_tensors(CLIPConfig.from_dict(VIT_L14), jnp.bfloat16)
    write_safetensors_component(folder, {k: v for k, v in expected.items() if k not in optional}, "model")
    save_byte_tokenizer(folder)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump({"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
                   "resample": 3, "size": {"shortest_edge": 224}, "image_processor_type": "CLIPImageProcessor"}, f)
    head = {f"layers.{2 * i}.weight": (n_out, n_in) for i, (n_in, n_out) in
            enumerate(zip(LAION_HEAD[:-1], LAION_HEAD[1:]))}
    head.update({f"layers.{2 * i}.bias": (n_out,) for i, n_out in enumerate(LAION_HEAD[1:])})
    write_safetensors_component(os.path.join(folder, "head"), head, "aesthetic")
    _single_file(os.path.join(folder, "head"), head_path(folder))
    return folder


def head_path(folder: str) -> str:
    return os.path.join(folder, "head", "aesthetic.safetensors")


def _single_file(sharded: str, path: str) -> None:
    """The head's one shard as a plain safetensors file (what --score_heads reads), its index removed."""
    for name in os.listdir(sharded):
        if name.endswith(".index.json"):
            os.remove(os.path.join(sharded, name))
        elif name.endswith(".safetensors") and name != os.path.basename(path):
            os.replace(os.path.join(sharded, name), path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.score_chip", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="klein-4b", choices=["tiny", "small", "klein-4b", "klein-9b"])
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quantize", default="none,int8", help="the quantize modes to measure, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compilation_cache_dir", default=None,
                    help="JAX's persistent compilation cache (default: xla-cache under the benchmarks' cache): the "
                         "generator's programs, compiled again for their memory figures, are read back from it")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    return ap.parse_args(argv)


def measure(ckpt: str, clip_folder: str, quantize: str, args) -> dict:
    import jax
    import jax.numpy as jnp

    import model
    from model.engine.scoring import load_scorer
    from model.config.score_settings import ScoreSettings

    gen = model.load(ckpt, dtype="bfloat16", batch_size=args.batch, quantize=quantize)
    settings = ScoreSettings(clip_folder, labels=LABELS,
                             heads=(("aesthetic", head_path(clip_folder)),))
    start = time.perf_counter()
    scorer = load_scorer(settings, mesh=gen.mesh, dtype=jnp.bfloat16)
    load_s = time.perf_counter() - start
    h, w, b = args.height, args.width, args.batch

    def run(tag: str, scored: bool) -> float:
        gen.scorer = scorer if scored else None
        prompts = [f"{tag}: a watercolour of a lighthouse, variant {i}" for i in range(b)]
        began = time.perf_counter()
        gen.generate(prompts, list(range(b)), height=h, width=w, num_inference_steps=args.steps)
        return (time.perf_counter() - began) * 1e3 / b

    run("warm plain", False)
    compile_start = time.perf_counter()
    run("warm scored", True)
    first_scored_s = time.perf_counter() - compile_start
    plain, scored = [], []
    for r in range(args.repeats):  # alternated, so drift in the chip's clock hits both alike
        plain.append(run(f"plain {r}", False))
        scored.append(run(f"scored {r}", True))
    pixels = jax.device_put(jnp.zeros((b, h, w, 3), jnp.uint8), scorer.batched)
    alone = []
    for r in range(args.repeats + 2):
        began = time.perf_counter()
        jax.block_until_ready(scorer.score(pixels, [f"alone {r} {i}" for i in range(b)]))
        alone.append((time.perf_counter() - began) * 1e3 / b)
    compiled = scorer.lower(b, h, w).compile()
    mem = compiled.memory_analysis()
    score_temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0)
    score_params = sum(x.nbytes for x in jax.tree.leaves((scorer.state, scorer.head_states)))
    lowered = gen.lower(gen.prepare_bucket(gen.check_inputs([""] * b, list(range(b)), h, w, args.steps)))
    gen_temp = max(int(getattr(low.compile().memory_analysis(), "temp_size_in_bytes", 0) or 0) for low in lowered)
    gen_params = sum(gen.programs.parameter_bytes_per_device().values())
    limit = (device_memory() or {}).get("bytes_limit") or 0
    plain_ms, scored_ms = statistics.median(plain), statistics.median(scored)
    result = {
        "quantize": quantize, "batch": b, "plain_ms_per_image": plain_ms, "scored_ms_per_image": scored_ms,
        "scoring_share": (scored_ms - plain_ms) / plain_ms, "score_program_ms_per_image": statistics.median(alone[2:]),
        "score_program_share": statistics.median(alone[2:]) / plain_ms, "plain_runs": plain, "scored_runs": scored,
        "scorer_load_s": load_s, "first_scored_call_s": first_scored_s,
        "scorer_param_bytes": score_params, "score_program_temp_bytes": score_temp,
        "generator_param_bytes": gen_params, "generator_largest_program_temp_bytes": gen_temp,
        "bytes_limit": limit, "device_memory": device_memory(),
        "fits_with_scorer": bool(limit) and gen_params + score_params + max(gen_temp, score_temp) <= limit,
        "headroom_bytes_with_scorer": limit - gen_params - score_params - max(gen_temp, score_temp) if limit else None,
        "texts_encoded": scorer.texts_encoded,
    }
    del gen, scorer
    gc.collect()
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    from . import presets

    import model

    model.enable_compilation_cache(args.compilation_cache_dir
                                   or os.path.join(presets.bench_cache_root(), "xla-cache"))
    ckpt = presets.ensure_checkpoint(args.preset)
    clip_folder = build_clip_checkpoint(os.path.join(presets.bench_cache_root(), "clip-vit-l14-realsize"))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for quantize in filter(None, args.quantize.split(",")):
        progress(f"{args.preset} {args.height}x{args.width} batch {args.batch} quantize={quantize}")
        row = measure(ckpt, clip_folder, quantize, args)
        progress(f"  plain {row['plain_ms_per_image']:.1f} ms/image, scored {row['scored_ms_per_image']:.1f} "
                 f"({100 * row['scoring_share']:+.2f}%), score program alone {row['score_program_ms_per_image']:.2f} "
                 f"ms/image ({100 * row['score_program_share']:.2f}%); scorer params "
                 f"{row['scorer_param_bytes'] / 2**20:.0f} MiB, score program temp "
                 f"{row['score_program_temp_bytes'] / 2**20:.0f} MiB, fits with scorer: {row['fits_with_scorer']}")
        rows.append(row)
    result = {"benchmark": "score_chip", "preset": args.preset, "height": args.height, "width": args.width,
              "steps": args.steps, "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
              "score_model": "ViT-L/14 shapes, random bf16 weights", "labels": list(LABELS), "heads": ["aesthetic"],
              "runs": rows}
    with open(os.path.join(args.out, f"score_chip-{args.preset}-{args.height}x{args.width}-b{args.batch}.json"),
              "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
