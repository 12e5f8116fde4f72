"""The benchmark's report: the markdown tables, the JSON file, speed-ups (of medians and paired by repetition) and
the headline numbers."""

from __future__ import annotations

import json
import os
import statistics

import numpy as np

from .engines import STAGES


def _f(x, digits=1):
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "–"
    return f"{x:,.{digits}f}"


def torch_diffusers(env: dict) -> str:
    if env.get("diffusers") is None:
        return "torch and diffusers not loaded (diffusers engine not run)"
    return f"torch {env['torch']} ({env['torch_threads']} threads), diffusers {env['diffusers']}"


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"## FLUX.2 [klein] generation benchmark: preset `{res['preset']}`, {res['height']}x{res['width']}, "
             f"{res['dtype']}, {res['steps']} steps, guidance {res['guidance']}",
             "",
             f"Backend `{env['backend']}` ({env['device_kind']}, {env['device_count']} device(s)), "
             f"{env['cpu_count']} CPU cores, jax {env['jax']}, {torch_diffusers(env)}. Matmul peak measured in this "
             f"run: {res['matmul_peak']['best_flops_per_s'] / 1e9:,.1f} GFLOP/s ({res['matmul_peak']['dtype']}, "
             f"n={res['matmul_peak']['n']}). Median of {res['repeats']} interleaved repetitions after "
             f"{res['warmup']} warm-up; new prompts every repetition.", ""]
    for key, b in res["batches"].items():
        lines += [f"### Batch {key}", "",
                  "| engine | ms/img | ms/img excl. PNG | img/s | CPU ms/img | tokenize | encode | denoise | decode "
                  "| d2h | host uint8 | PNG | GFLOP/img | MFU | load s | compile cold s | compile warm s "
                  "| first call s |",
                  "|---" * 18 + "|"]
        for name, e in b["engines"].items():
            st = e.get("stages_ms_per_image", {})
            lines.append(
                f"| {name} | {_f(e['ms_per_image'])} | {_f(e['ms_per_image_excl_save'])} | "
                f"{_f(e['images_per_s'], 3)} | {_f(e['cpu_ms_per_image'])} | "
                + " | ".join(_f(st.get(k)) for k in STAGES)
                + f" | {_f(e['flops_per_image'] / 1e9)} | {_f(100 * e['mfu'], 2)}% | {_f(e.get('load_s'))} | "
                f"{_f(e.get('compile_cold_s'))} | {_f(e.get('compile_warm_s'))} | {_f(e.get('first_call_s'))} |")
        lines.append("")
        lines.append("Stage columns: ms per image from staged runs (each stage waited on). "
                     "Compile cold/warm: AOT compile of the bucket with an empty / a filled persistent cache "
                     f"(cold: {b['engines']['optimised']['compile_cold_events']['compiles']} compiles; warm: "
                     f"{b['engines']['optimised']['compile_warm_events']['cache_hits']} persistent-cache hits). "
                     f"Compiles during the timed repetitions: {b['engines']['optimised']['steady_state_compiles']}.")
        sp = b.get("speedups", {})
        lines.append("")
        lines.append("Speed-up of the optimised path (ms/img incl. PNG; excl. PNG in brackets): " + ", ".join(
            f"{k.replace('speedup_vs_', 'vs ')} {_f(v, 2)}x ({_f(sp.get(k + '_excl_save'), 2)}x)"
            for k, v in sp.items() if not k.endswith("_excl_save")) + ".")
        paired = b.get("paired_speedups", {})
        if paired:
            lines.append("Paired by repetition (excl. PNG; median, min-max over the repetitions): " + ", ".join(
                f"{k.replace('_', ' ')} {_f(v['median'], 2)}x ({_f(v['min'], 2)}-{_f(v['max'], 2)}x)"
                for k, v in paired.items()) + ".")
        for k, s in b.get("similarity", {}).items():
            what = k.replace("_", " ") + ("" if k.startswith("optimised_") else " (optimised path in both)")
            lines.append(f"Images {what}: mean SSIM {_f(s['mean_ssim'], 5)}, min SSIM "
                         f"{_f(s['min_ssim'], 5)}, max |diff| {s['max_abs_diff']}, mean |diff| "
                         f"{_f(s['mean_abs_diff'], 4)} ({s['compared']} images).")
        mem = b.get("device_memory")
        lines.append(f"Peak host RSS: {_f(b['engines']['optimised']['peak_rss_mb_so_far'])} MiB (process, so far); "
                     f"device memory: {mem if mem else 'not reported by this backend'}.")
        xf = b.get("xla_flops_per_image", {})
        if "total" in xf:
            an = b["engines"]["optimised"]["flops_per_image_by_stage"]
            lines.append("FLOPs/img analytic vs XLA cost analysis (GFLOP): " + ", ".join(
                f"{k} {an[k] / 1e9:,.2f} / {xf[k] / 1e9:,.2f}" for k in ("encode", "denoise", "decode", "total"))
                + ".")
        if "ablation" in b:
            lines += ["", f"#### Ablation, batch {key} (each optimisation off in turn; ms/img excl. PNG)", "",
                      "| variant | switched off | ms/img new prompts | vs optimised | ms/img same prompts again "
                      "| ms/img one prompt x batch | first call s | compiles on first call |",
                      "|---|---|---|---|---|---|---|---|"]
            for a in b["ablation"]:
                lines.append(f"| {a['variant']} | {a['switched_off']} | {_f(a['ms_per_image_excl_save'])} | "
                             f"{_f(a['vs_optimised'], 2)}x | {_f(a['cached_prompts_ms_per_image'])} | "
                             f"{_f(a['one_prompt_ms_per_image'])} | {_f(a['first_call_s'], 2)} | "
                             f"{a['compiles_first_call']} |")
            lines.append("")
            lines.append("'vs optimised' > 1 means slower without the optimisation. First call: a fresh generator's "
                         "first batch with the persistent compilation cache off (compile + run). 'same prompts "
                         "again' repeats the previous call's prompts (embedding cache); 'one prompt x batch' "
                         "asks for the whole batch from one prompt (de-duplication).")
        lines.append("")
    return "\n".join(lines) + "\n"


def speedups(engines: dict) -> dict:
    """Speed-up of the optimised path over each other engine: ratio of the medians, with and without PNG saving."""
    opt = engines["optimised"]
    out = {}
    for other in ("reference", "diffusers"):
        if other in engines:
            out[f"speedup_vs_{other}"] = engines[other]["ms_per_image"] / opt["ms_per_image"]
            out[f"speedup_vs_{other}_excl_save"] = (engines[other]["ms_per_image_excl_save"]
                                                   / opt["ms_per_image_excl_save"])
    return out


def paired_speedups(engines: dict) -> dict:
    """Speed-up repetition by repetition (excl. PNG): the engines of one repetition run back to back, so a slow spell
    of a shared machine hits both sides of most ratios; their median and range show how far noise moves the result."""
    opt = engines["optimised"]["generate_s_runs"]
    out = {}
    for other in ("reference", "diffusers"):
        if other in engines:
            ratios = [o / x for o, x in zip(engines[other]["generate_s_runs"], opt)]
            out[f"vs_{other}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def headline(res: dict, key: str) -> dict:
    b = res["batches"][key]
    e = b["engines"]
    opt = e["optimised"]
    out = {
        "ms_per_image": opt["ms_per_image"],
        "ms_per_image_excl_save": opt["ms_per_image_excl_save"],
        "images_per_s": opt["images_per_s"],
        "ms_per_image_reference": e.get("reference", {}).get("ms_per_image"),
        "ms_per_image_diffusers": e.get("diffusers", {}).get("ms_per_image"),
        **b.get("speedups", {}),
        "mfu": opt["mfu"],
        "compile_cold_s": opt["compile_cold_s"],
        "compile_warm_s": opt["compile_warm_s"],
        "steady_state_compiles": opt["steady_state_compiles"],
        "peak_rss_mb": opt["peak_rss_mb_so_far"],
    }
    out.setdefault("speedup_vs_reference", None)
    out.setdefault("speedup_vs_diffusers", None)
    for k, s in b.get("similarity", {}).items():  # optimised_vs_reference -> ssim_vs_reference, bfloat16_vs_float32 ...
        out[f"ssim_vs_{k.split('_vs_')[1]}"] = s["min_ssim"]
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def write_results(res: dict, out: str, stem: str) -> str:
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    md = markdown(res)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(md)
    return md
