"""The benchmark's runs: workloads, timed end-to-end and staged runs, the ablation, compile and memory counters, and
the matmul peak that MFU is measured against. `bench_batch` runs everything for one batch size."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import resource
import shutil
import statistics
import sys
import time

import numpy as np

from model.compile_events import BACKEND_COMPILE_EVENT, CACHE_HIT_EVENT, CACHE_MISS_EVENT

from . import engines as E
from .engines import STAGES, JaxEngine

BASE_PROMPTS = [
    "A small cactus with a happy face in the Sahara desert at sunset",
    "A photograph of a red fox sitting in the snow, soft morning light",
    "An astronaut riding a horse on the moon, highly detailed digital art",
    "A cozy wooden cabin in a pine forest beside a quiet lake",
    "A watercolor painting of a lighthouse on a rocky coast",
    "A cat wearing a tiny hat and reading a book by the window",
    "The city skyline at night with neon signs reflected in the wet street",
    "A bowl of fresh fruit on a kitchen table, studio photo",
]



def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Workload:
    height: int
    width: int
    steps: int
    guidance: float
    batch: int


def prompts_for(run: int, n: int) -> list[str]:
    """n distinct prompts for run number `run` (different in every run, identical across engines)."""
    return [f"{BASE_PROMPTS[(run + i) % len(BASE_PROMPTS)]}, take {run}-{i}" for i in range(n)]


def seeds_for(run: int, n: int) -> list[int]:
    return [1000 * run + i for i in range(n)]


# ------------------------------------------------------------------------------------------------------ counters


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def host_memory_mb() -> dict:
    """The process's resident memory split as the kernel counts it (MB): `rss`, `anon` (heap, mallocs),
    `file` (mapped files, shared libraries) and `shmem` (shared memory, e.g. a runtime's DMA buffers)."""
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                name = line.split(None, 1)[0] if line.strip() else ""
                if name in keys:
                    out[keys[name]] = round(int(line.split()[1]) / 1024.0, 1)
    except OSError:  # not Linux
        pass
    return out


def current_rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # e.g. a bare TPU machine: the kernel's own figure
        return host_memory_mb().get("rss", float("nan"))


def device_memory() -> dict | None:
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # pragma: no cover - backend dependent
        stats = None
    if not stats:
        return None
    keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(v) for k, v in stats.items() if k in keep}


class CompileCounter:
    """Counts JAX backend compilations (and persistent-cache hits/misses) through jax.monitoring listeners."""

    def __init__(self):
        import jax.monitoring as monitoring

        self.compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0
        self.cache_misses = 0

        def on_duration(event, duration, **kw):
            if event == BACKEND_COMPILE_EVENT:
                self.compiles += 1
                self.compile_seconds += duration

        def on_event(event, **kw):
            if event == CACHE_HIT_EVENT:
                self.cache_hits += 1
            elif event == CACHE_MISS_EVENT:
                self.cache_misses += 1

        monitoring.register_event_duration_secs_listener(on_duration)
        monitoring.register_event_listener(on_event)

    def snapshot(self) -> dict:
        return {"compiles": self.compiles, "compile_seconds": self.compile_seconds, "cache_hits": self.cache_hits,
                "cache_misses": self.cache_misses}

    def since(self, snap: dict) -> dict:
        now = self.snapshot()
        return {k: now[k] - snap[k] for k in now}


@contextlib.contextmanager
def persistent_cache_disabled():
    """Turn JAX's persistent compilation cache off (so first calls really compile), then back on."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def measure_matmul_peak(dtype: str, repeats: int = 5) -> dict:
    """FLOP/s of the best of `repeats` square jnp.dot calls (size 2048 on CPU, 8192 on accelerators)."""
    import jax
    import jax.numpy as jnp

    n = 2048 if jax.default_backend() == "cpu" else 8192
    jdt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    a = jax.random.normal(jax.random.key(0), (n, n), jdt)
    b = jax.random.normal(jax.random.key(1), (n, n), jdt)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jdt))
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    flops = 2.0 * n ** 3
    return {"n": n, "dtype": dtype, "best_flops_per_s": flops / min(times),
            "median_flops_per_s": flops / statistics.median(times)}


# ------------------------------------------------------------------------------------------------------ timed runs


def save_pngs(images: np.ndarray, folder: str | None) -> float:
    """Encode every image as PNG (into `folder` when given, else in memory); seconds taken."""
    from PIL import Image

    start = time.perf_counter()
    for i, img in enumerate(images):
        if folder:
            Image.fromarray(img).save(os.path.join(folder, f"{i:02d}.png"), format="PNG")
        else:
            Image.fromarray(img).save(io.BytesIO(), format="PNG")
    return time.perf_counter() - start


def run_e2e(engine, run: int, wl: Workload, png_dir: str | None) -> tuple[np.ndarray, dict]:
    """One end-to-end call of `wl.batch` new prompts; wall, process-CPU and PNG seconds."""
    prompts, seeds = prompts_for(run, wl.batch), seeds_for(run, wl.batch)
    cpu, wall = time.process_time(), time.perf_counter()
    images = engine.generate(prompts, seeds, wl.height, wl.width, wl.steps, wl.guidance)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    png = save_pngs(images, png_dir)
    return images, {"generate_s": wall, "cpu_s": cpu, "png_s": png}


def run_staged(engine, run: int, wl: Workload) -> dict:
    prompts, seeds = prompts_for(run, wl.batch), seeds_for(run, wl.batch)
    images, t = engine.staged(prompts, seeds, wl.height, wl.width, wl.steps, wl.guidance)
    t["png"] = save_pngs(images, None)
    return t


def summarise(e2e: list[dict], staged: list[dict], n: int) -> dict:
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    gen_s = med([r["generate_s"] for r in e2e])
    total_s = med([r["generate_s"] + r["png_s"] for r in e2e])
    out = {
        "ms_per_image": 1000 * total_s / n,
        "ms_per_image_excl_save": 1000 * gen_s / n,
        "images_per_s": n / total_s,
        "images_per_s_excl_save": n / gen_s,
        "cpu_ms_per_image": 1000 * med([r["cpu_s"] for r in e2e]) / n,
        "png_ms_per_image": 1000 * med([r["png_s"] for r in e2e]) / n,
        "repeats": len(e2e),
        "generate_s_runs": [round(r["generate_s"], 4) for r in e2e],
    }
    if staged:
        out["stages_ms_per_image"] = {k: 1000 * med([r[k] for r in staged]) / n for k in STAGES}
        out["stages_sum_ms_per_image"] = sum(out["stages_ms_per_image"].values())
    return out


# ------------------------------------------------------------------------------------------------------ ablation


def run_ablation(base_gen, path, args, wl: Workload, cache_dir, counter) -> list[dict]:
    """Each optimisation off in turn: first-call time (compiling from scratch: no persistent cache), steady ms/img on
    new prompts, on repeated prompts (embedding cache), and with one prompt for the whole batch (de-duplication).
    Every variant is loaded first and the timed rounds are interleaved across variants."""
    base = E.Variant("optimised", "nothing (all optimisations on)",
                     dataclasses.replace(base_gen.options, batch_size=wl.batch), base_gen.lab)
    rows = []
    for variant in [base] + E.ablation_variants(wl.batch, cache_dir):
        start = time.perf_counter()
        gen = E.make_variant(base_gen, path, args.dtype, args.max_sequence_length, variant)
        rows.append({"variant": variant.name, "switched_off": variant.switched_off, "gen": gen,
                     "load_s": time.perf_counter() - start})
    run = 10_000
    with persistent_cache_disabled():
        for row in rows:  # first call: tokenizer, compile (AOT or jit) and one batch
            snap = counter.snapshot()
            start = time.perf_counter()
            row["gen"].generate(prompts_for(run, wl.batch), seeds_for(run, wl.batch), height=wl.height,
                                width=wl.width, num_inference_steps=wl.steps, guidance_scale=wl.guidance)
            row["first_call_s"] = time.perf_counter() - start
            row["compiles"] = counter.since(snap)
    times = {id(r): {"new": [], "cached": [], "one_prompt": []} for r in rows}
    for rep in range(args.ablation_repeats):
        run += 1
        for row in rows:
            eng = JaxEngine(row["variant"], row["gen"])
            prompts, seeds = prompts_for(run, wl.batch), seeds_for(run, wl.batch)
            start = time.perf_counter()
            eng.generate(prompts, seeds, wl.height, wl.width, wl.steps, wl.guidance)
            times[id(row)]["new"].append(time.perf_counter() - start)
            if rep == args.ablation_repeats - 1:
                start = time.perf_counter()  # the same prompts again: served from the embedding cache if on
                eng.generate(prompts, seeds, wl.height, wl.width, wl.steps, wl.guidance)
                times[id(row)]["cached"].append(time.perf_counter() - start)
                if wl.batch > 1:  # one prompt for the whole batch: encoded once if de-duplication is on
                    p = [f"{prompts[0]} (single)"]
                    start = time.perf_counter()
                    eng.generate(p, seeds[:1], wl.height, wl.width, wl.steps, wl.guidance, images_per_prompt=wl.batch)
                    times[id(row)]["one_prompt"].append(time.perf_counter() - start)
    base_ms = None
    out = []
    for row in rows:
        t = times[id(row)]
        ms = 1000 * statistics.median(t["new"]) / wl.batch
        base_ms = ms if base_ms is None else base_ms
        out.append({
            "variant": row["variant"], "switched_off": row["switched_off"],
            "ms_per_image_excl_save": ms, "vs_optimised": ms / base_ms,
            "cached_prompts_ms_per_image": 1000 * statistics.median(t["cached"]) / wl.batch if t["cached"] else None,
            "one_prompt_ms_per_image": (1000 * statistics.median(t["one_prompt"]) / wl.batch
                                        if t["one_prompt"] else None),
            "first_call_s": row["first_call_s"], "load_s": row.get("load_s"),
            "compiles_first_call": row["compiles"]["compiles"],
            "repeats": len(t["new"]),
        })
        row["gen"] = None
    gc.collect()
    return out


# ------------------------------------------------------------------------------------------------------ one batch


def render_in_dtype(path: str, args, wl: Workload, run: int, img_root: str) -> str:
    """The optimised path in `args.compare_dtype` on run `run`'s prompts and seeds, saved as PNGs next to the
    benchmarked dtype's; returns the folder (for 'bf16 vs fp32' image similarity)."""
    folder = os.path.join(img_root, f"b{wl.batch}", f"optimised-{args.compare_dtype}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    gen = E.load_variant(path, args.compare_dtype, args.max_sequence_length, E.optimised(wl.batch))
    run_e2e(JaxEngine(f"optimised-{args.compare_dtype}", gen), run, wl, folder)
    del gen
    gc.collect()
    return folder


def _loaded(make) -> tuple[object, dict]:
    """make() and its load time and host-memory growth."""
    rss0 = current_rss_mb()
    start = time.perf_counter()
    obj = make()
    return obj, {"load_s": time.perf_counter() - start, "rss_after_load_mb": current_rss_mb(),
                 "rss_delta_load_mb": current_rss_mb() - rss0}


def _timed_plan(engine: JaxEngine, wl: Workload, use_cfg: bool, counter) -> tuple[float, dict]:
    """Seconds to compile the workload's bucket (AOT) and the compile events meanwhile."""
    snap = counter.snapshot()
    start = time.perf_counter()
    engine.plan(wl.batch, wl.height, wl.width, wl.steps, use_cfg)
    return time.perf_counter() - start, counter.since(snap)


def bench_batch(args, path, wl: Workload, cache_dir: str, counter, peak, img_root, engines_cache) -> dict:
    """Everything for one batch size; returns its results dict."""
    import jax

    from . import flops as F

    result: dict = {"batch": wl.batch, "engines": {}}
    load = lambda variant: E.load_variant(path, args.dtype, args.max_sequence_length, variant)  # noqa: E731
    # -- optimised: cold compile (empty persistent cache for this bucket), then warm from a fresh generator
    jax.clear_caches()
    start = time.perf_counter()
    cold_gen = load(E.optimised(wl.batch, cache_dir))
    load_s = time.perf_counter() - start
    use_cfg = wl.guidance > 1 and not cold_gen.is_distilled
    cold_s, cold = _timed_plan(JaxEngine("optimised", cold_gen), wl, use_cfg, counter)
    del cold_gen
    gc.collect()
    jax.clear_caches()
    rss0 = current_rss_mb()
    gen = load(E.optimised(wl.batch, cache_dir))
    opt = JaxEngine("optimised", gen)
    warm_s, warm = _timed_plan(opt, wl, use_cfg, counter)
    info = {"optimised": {"load_s": load_s, "compile_cold_s": cold_s, "compile_warm_s": warm_s,
                          "compile_cold_events": cold, "compile_warm_events": warm,
                          "rss_after_load_mb": current_rss_mb(), "rss_delta_load_mb": current_rss_mb() - rss0}}
    engines = [opt]
    if not args.skip_reference:
        ref, info["reference"] = _loaded(lambda: JaxEngine("reference", load(E.reference(wl.batch))))
        engines.append(ref)
    if not args.skip_diffusers:
        if "diffusers" not in engines_cache:
            engines_cache["diffusers"], engines_cache["diffusers_info"] = _loaded(
                lambda: E.DiffusersEngine(path, args.dtype, args.max_sequence_length))
        engines.append(engines_cache["diffusers"])
        info["diffusers"] = dict(engines_cache["diffusers_info"])

    progress(f"batch {wl.batch}: engines loaded; warm-up and {args.repeats} interleaved repetitions")
    # -- warm-up (the first call of a jit path compiles: recorded as first_call_s), then interleaved repeats
    run = 0
    for w in range(max(1, args.warmup)):
        for eng in engines:
            snap = counter.snapshot()
            start = time.perf_counter()
            run_e2e(eng, run, wl, None)
            if w == 0:
                info[eng.name]["first_call_s"] = time.perf_counter() - start
                info[eng.name]["first_call_compiles"] = counter.since(snap)["compiles"]
        run += 1
    dirs = {}
    for eng in engines:
        dirs[eng.name] = os.path.join(img_root, f"b{wl.batch}", eng.name)
        shutil.rmtree(dirs[eng.name], ignore_errors=True)
        os.makedirs(dirs[eng.name])
    e2e = {eng.name: [] for eng in engines}
    steady_snap = counter.snapshot()
    for r in range(args.repeats):
        for eng in engines:
            _, rec = run_e2e(eng, run, wl, dirs[eng.name])
            e2e[eng.name].append(rec)
        run += 1
    saved_run = run - 1  # the PNGs on disk are this repetition's (same prompts and seeds for every engine)
    info["optimised"]["steady_state_compiles"] = counter.since(steady_snap)["compiles"]
    staged = {eng.name: [] for eng in engines}
    for r in range(args.repeats):
        for eng in engines:
            staged[eng.name].append(run_staged(eng, run, wl))
        run += 1

    # -- FLOPs, MFU, memory
    config = gen.config
    te_cfg = config.text_encoder
    common = dict(text_len=args.max_sequence_length, cfg_guidance=use_cfg)
    flops = {
        "optimised": F.image_flops(config, wl.height, wl.width, wl.steps,
                                   encoder_layers=F.encoder_layers_run(te_cfg),
                                   image_only_last_block=gen.lab.image_only_last_block,
                                   fused_upsample=gen.programs.decode_forms.upsample != "plain", **common),
        "reference": F.image_flops(config, wl.height, wl.width, wl.steps,
                                   encoder_layers=te_cfg.num_hidden_layers, **common),
        "diffusers": F.image_flops(config, wl.height, wl.width, wl.steps,
                                   encoder_layers=te_cfg.num_hidden_layers, lm_head=True, **common),
    }
    try:
        result["xla_flops_per_image"] = opt.xla_flops(wl.batch, wl.height, wl.width, wl.steps, use_cfg)
    except Exception as e:  # cost analysis is best effort
        result["xla_flops_per_image"] = {"error": repr(e)}
    for eng in engines:
        s = summarise(e2e[eng.name], staged[eng.name], wl.batch)
        s.update(info[eng.name])
        s["flops_per_image"] = flops[eng.name]["total"]
        s["flops_per_image_by_stage"] = flops[eng.name]
        s["mfu"] = flops[eng.name]["total"] / (s["ms_per_image_excl_save"] / 1000) / peak["best_flops_per_s"]
        s["peak_rss_mb_so_far"] = peak_rss_mb()
        result["engines"][eng.name] = s
    result["device_memory"] = device_memory()

    # -- image agreement (the last repetition: same prompts and seeds for every engine)
    from .similarity import compare_folders

    def similarity(a: str, b: str) -> dict:
        r = compare_folders(dirs[a], dirs[b])
        return {k: r[k] for k in ("compared", "mean_ssim", "min_ssim", "max_abs_diff", "mean_abs_diff")}

    sim = {f"optimised_vs_{e.name}": similarity("optimised", e.name) for e in engines if e.name != "optimised"}
    if args.compare_dtype and args.compare_dtype != args.dtype:
        progress(f"batch {wl.batch}: the same prompts and noise in {args.compare_dtype} (image similarity)")
        dirs[args.compare_dtype] = render_in_dtype(path, args, wl, saved_run, img_root)
        sim[f"{args.dtype}_vs_{args.compare_dtype}"] = similarity("optimised", args.compare_dtype)
    result["similarity"] = sim
    result["image_dirs"] = dirs

    if not args.skip_ablation:
        progress(f"batch {wl.batch}: ablation")
        result["ablation"] = run_ablation(gen, path, args, wl, cache_dir, counter)
    del engines, opt
    gc.collect()
    return result
