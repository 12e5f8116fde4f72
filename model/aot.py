"""Ahead-of-time compiling for a TPU topology this machine does not have: the generator's own programs, built by
model.factory from parameter shapes over the topology's devices, compiled by libtpu, and the fewest model shards
whose programs fit a chip's HBM (the preflight's core; pipeline/preflight.py is its command line).

Two corrections to XLA's cost analysis, both reported: it counts a loop body once (the denoising loop's figures are
multiplied by its steps), and it knows nothing of Pallas kernels (the splash attention's FLOPs are added from the
shapes, model.estimate).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time

from .config import PipelineConfig
from .factory import Networks, build_programs, check_text_width
from .fit_report import Report, fit_advice, format_bytes
from .hlo_stats import is_out_of_hbm, program_stats, program_text, refused_program_stats
from .estimate import attention_flops_per_image, kernel_split
from .mesh import check_model_shards, make_mesh, shard_counts
from .options import DEFAULT_TEXT_ENCODER_OUT_LAYERS, PROGRAMS, EngineOptions
from .plan import bucket_for, resolve_sampling
from .tpu_topology import Topology

logger = logging.getLogger(__name__)

# What compiling a lowered program gave, by (device kind, mesh shape, hash of the lowered text): a process that
# preflights several models or batches (benchmarks.tpu_estimates) compiles an identical program once.
_COMPILED: dict = {}


def topology_options(model_shards: int) -> EngineOptions:
    """The engine options a worker of the topology runs with: `model_shards` shards, no CPU compiler options."""
    return EngineOptions(model_shards=model_shards, cpu_compiler_options=())


def programs_for_topology(modules, topology: Topology, *, dtype: str, model_shards: int, text_len: int):
    """The generator's programs over the topology's devices with `model_shards` shards, parameters as sharded
    shapes (model.factory.build_programs)."""
    options = topology_options(model_shards)
    mesh = make_mesh(options, devices=list(topology.devices))
    return build_programs(modules, dtype=dtype, mesh=mesh, options=options, text_len=text_len, abstract=True)


def compile_programs(programs, config: PipelineConfig, bucket, kernel_flops: dict, *,
                     dump_dir: str | None = None) -> dict:
    """Lower and compile encode, the fused denoise loop and decode for `bucket`; {name: ProgramStats}."""
    tr = config.transformer
    lowered = programs.lower(bucket, tr.in_channels, tr.joint_attention_dim, tr.attention_head_dim, fused=True)
    params = programs.parameter_bytes_per_device()
    modules = {"encode": "text_encoder", "denoise": "transformer", "decode": "vae"}
    stats = {}
    for name, low in zip(PROGRAMS, lowered):
        key = (programs.mesh.devices.flat[0].device_kind, programs.mesh.devices.shape,
               hashlib.sha256(low.as_text().encode()).hexdigest())
        fresh = key not in _COMPILED
        if fresh:  # e.g. the same VAE decode for klein-4B and klein-9B on the same mesh
            start = time.perf_counter()
            try:
                compiled = low.compile()
            except Exception as e:  # noqa: BLE001 - JaxRuntimeError; only running out of HBM is an answer
                if not is_out_of_hbm(e):
                    raise
                _COMPILED[key] = (None, str(e), "", "none", time.perf_counter() - start)
            else:
                _COMPILED[key] = (compiled.memory_analysis(), compiled.cost_analysis(), *program_text(compiled, low),
                                  time.perf_counter() - start)
        memory, cost, text, source, seconds = _COMPILED[key]
        trips = bucket.steps if name == "denoise" else 1
        if memory is None:  # `cost` holds the compiler's refusal
            stats[name] = refused_program_stats(name, cost, parameter_bytes=params[modules[name]],
                                                kernel_flops=kernel_flops[name], loop_trips=trips, compile_s=seconds)
            logger.info("the compiler refused %s: %s", name, stats[name].compile_error)
            continue
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            with open(os.path.join(dump_dir, f"{name}.txt" if source == "compiled" else f"{name}.lowered.txt"),
                      "w") as f:
                f.write(text)
        stats[name] = program_stats(name, memory, cost, text,
                                    parameter_bytes=params[modules[name]], kernel_flops=kernel_flops[name],
                                    loop_trips=trips, compile_s=seconds,
                                    text_source=source)
        logger.info("compiled %s in %.1f s%s", name, seconds, "" if fresh else " (the same program, compiled earlier)")
    return stats


def resident_bytes_for(modules, devices, shards: int) -> int:
    """Parameter bytes one device holds with `shards` model shards over `devices` (model.sharding's layout)."""
    from flax import nnx

    from . import sharding

    mesh = make_mesh(topology_options(shards), devices=list(devices))
    return sum(sharding.bytes_per_device(state, sharding.state_shardings(state, mesh))
               for state in (nnx.state(m) for m in modules))


def fit(config: PipelineConfig, topology: Topology, *, model: str, dtype: str, height: int, width: int,
        batch_size: int, text_len: int, num_inference_steps: int | None = None, guidance_scale: float | None = None,
        model_shards: int | None = None, hbm_bytes: int | None = None, out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS,
        dump_dir: str | None = None) -> Report:
    """Compile the programs of `config` (named `model` in the report) for `topology` and report; without
    `model_shards`, the fewest shards (a divisor of the worker's devices) whose programs fit, else the most shards'
    report with advice. Steps and guidance None: the checkpoint's. ShardCountError for a `model_shards` that does
    not divide the devices; the arguments are otherwise taken as valid (model.contract checks them)."""
    sampling = resolve_sampling(config, num_inference_steps, guidance_scale)
    steps, cfg = sampling.num_inference_steps, sampling.use_cfg
    devices = len(topology.devices)
    if model_shards is not None:
        check_model_shards(model_shards, topology.devices)
    capacity = hbm_bytes or topology.chip.hbm_bytes
    check_text_width(config, out_layers)
    modules = Networks(config, dtype, tuple(out_layers)).run_modules()
    candidates = [model_shards] if model_shards else shard_counts(devices)
    resident_by_shards = {s: resident_bytes_for(modules, topology.devices, s) * topology.devices_per_chip
                          for s in shard_counts(devices)}
    report = None
    for i, shards in enumerate(candidates):
        last = i == len(candidates) - 1
        if not last and resident_by_shards[shards] > capacity:
            logger.info("%d model shard(s): the parameters alone take %s per chip, above %s; trying more",
                        shards, format_bytes(resident_by_shards[shards]), format_bytes(capacity))
            continue
        programs = programs_for_topology(modules, topology, dtype=dtype, model_shards=shards, text_len=text_len)
        replicas = devices // shards
        bucket = bucket_for(config, height=height, width=width, sampling=sampling, batch=batch_size,
                            data_replicas=replicas)
        per_image = attention_flops_per_image(config, text_len=text_len, image_tokens=bucket.grid_h * bucket.grid_w,
                                              steps=steps, cfg=cfg, out_layers=out_layers,
                                              vae_splash=programs.decode_forms.attention == "splash")
        split = kernel_split(config, shards)
        per_device = {k: v * (bucket.batch // replicas) / split[k] for k, v in per_image.items()}
        logger.info("compiling %s for %s: batch %d, %d model shard(s) x %d data replica(s)", model, topology.name,
                    bucket.batch, shards, replicas)
        stats = compile_programs(programs, config, bucket, per_device, dump_dir=dump_dir)
        report = Report(model=model, topology=topology, dtype=dtype, height=height, width=width, batch=bucket.batch,
                        steps=steps, cfg=cfg, model_shards=shards, attention=programs.attention,
                        parameter_bytes=programs.parameter_bytes_per_device(), programs=stats,
                        hbm_bytes_per_chip=capacity, auto_shards=model_shards is None)
        if report.fits:
            return report
        if not last:
            logger.info("%d model shard(s) peak at %s per chip, above %s; trying more", shards,
                        format_bytes(report.peak_bytes_per_chip), format_bytes(capacity))
    return dataclasses.replace(report, advice=fit_advice(report, resident_by_shards))
