"""Ahead-of-time compiling for a TPU topology this machine does not have: the generator's own programs, built by
model.engine.factory from parameter shapes over the topology's devices, compiled by libtpu, and the fewest model shards
whose programs fit a chip's HBM (the preflight's core; pipeline/preflight.py is its command line).

Two corrections to XLA's cost analysis, both reported: it counts a loop body once (the denoising loop's figures are
multiplied by its steps), and it knows nothing of Pallas kernels (the splash attention's FLOPs are added from the
shapes, model.preflight.estimate).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time

from ..config.configs import PipelineConfig
from ..engine.factory import Networks, build_programs, check_text_width
from .batch_search import Trial, best_batch, fastest, next_batch
from .fit_report import Report, fit_advice, format_bytes
from .hlo_stats import is_out_of_hbm, program_stats, program_text, refused_program_stats
from .estimate import attention_flops_per_image, batch_term, kernel_split
from ..parallel.mesh import check_model_shards, make_mesh, shard_counts
from ..options import DEFAULT_MAX_BATCH_SIZE, DEFAULT_TEXT_ENCODER_OUT_LAYERS, PROGRAMS, EngineOptions
from ..engine.buckets import bucket_for, resolve_sampling
from .topology import Topology

logger = logging.getLogger(__name__)

# What compiling a lowered program gave, by (device kind, mesh shape, hash of the lowered text): a process that
# preflights several models or batches (benchmarks.tpu_estimates) compiles an identical program once.
_COMPILED: dict = {}


def topology_options(model_shards: int) -> EngineOptions:
    """The engine options a worker of the topology runs with: `model_shards` shards."""
    return EngineOptions(model_shards=model_shards)


def programs_for_topology(modules, topology: Topology, *, dtype: str, model_shards: int, text_len: int):
    """The generator's programs over the topology's devices with `model_shards` shards, parameters as sharded
    shapes (model.engine.factory.build_programs)."""
    options = topology_options(model_shards)
    mesh = make_mesh(options, devices=list(topology.devices))
    return build_programs(modules, dtype=dtype, mesh=mesh, options=options, text_len=text_len, abstract=True)


# Seconds between the progress lines while one program compiles (a real-size program takes minutes).
PROGRESS_EVERY_S = 15.0


@contextlib.contextmanager
def progress_lines(what: str, every_s: float = PROGRESS_EVERY_S):
    """Log `what` now and, with the seconds since, every `every_s` until the block ends: a compile of minutes is
    never minutes of silence."""
    start = time.perf_counter()
    logger.info("%s", what)
    done = threading.Event()

    def tick():
        while not done.wait(every_s):
            logger.info("%s, %.0f s", what, time.perf_counter() - start)

    ticker = threading.Thread(target=tick, name="compile-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()


def _compile_one(low) -> tuple:
    """What compiling the lowered program `low` gave, as _COMPILED keeps it: (memory analysis, cost analysis, text,
    text source, seconds), or (None, the compiler's refusal, "", "none", seconds) when it runs out of HBM."""
    start = time.perf_counter()
    try:
        compiled = low.compile()
    except Exception as e:  # noqa: BLE001 - JaxRuntimeError; only running out of HBM is an answer
        if not is_out_of_hbm(e):
            raise
        return None, str(e), "", "none", time.perf_counter() - start
    return (compiled.memory_analysis(), compiled.cost_analysis(), *program_text(compiled, low),
            time.perf_counter() - start)


def compile_concurrently(lowered: dict) -> dict:
    """{key: _compile_one(lowered program)} for every {key: lowered program}, all compiled at once on daemon threads
    (XLA's compile releases the GIL, so the programs take about the longest one's time, not their sum; daemon: a
    Ctrl-C that ends the process does not wait for them). The first error, in `lowered`'s order, is raised."""
    results: dict = {}

    def run(key, low):
        try:
            results[key] = _compile_one(low)
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread below
            results[key] = e

    threads = [threading.Thread(target=run, args=item, name=f"compile-{n}", daemon=True)
               for n, item in enumerate(lowered.items())]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # short joins: the calling thread stays interruptible
            thread.join(0.2)
    for key in lowered:
        if isinstance(results[key], BaseException):
            raise results[key]
    return results


def compile_programs(programs, config: PipelineConfig, bucket, kernel_flops: dict, *,
                     dump_dir: str | None = None, transient_limit: float | None = None,
                     order: tuple[str, ...] = PROGRAMS, label: str = "") -> dict:
    """Lower encode, the fused denoise loop and decode for `bucket`, compile them all at once (compile_concurrently),
    and read their figures in `order`; {name: ProgramStats}. With `transient_limit` (bytes per device beyond the
    parameters) the reading stops at the first program that is refused or needs more: the batch cannot fit, and the
    others' figures would not change that (so `order` puts the likely largest first). All are compiled even so (at
    once: the batch takes its longest program's time, which a refused batch may then wait for too)."""
    tr = config.transformer
    lowered = dict(zip(PROGRAMS, programs.lower(bucket, tr.in_channels, tr.joint_attention_dim,
                                                tr.attention_head_dim)))
    params = programs.parameter_bytes_per_device()
    modules = {"encode": "text_encoder", "denoise": "transformer", "decode": "vae"}
    keys = {name: (programs.mesh.devices.flat[0].device_kind, programs.mesh.devices.shape,
                   hashlib.sha256(lowered[name].as_text().encode()).hexdigest()) for name in order}
    # e.g. the same VAE decode for klein-4B and klein-9B on the same mesh is compiled once
    fresh: dict = {}
    for name in order:
        if keys[name] not in _COMPILED:
            fresh.setdefault(keys[name], lowered[name])
    if fresh:
        names = [name for name in order if keys[name] in fresh]
        what = (f"{len(names)} programs at once ({', '.join(names)})" if len(names) > 1 else
                f"program {names[0]}")
        with progress_lines(f"compiling {label or f'batch {bucket.batch}'}: {what}"):
            _COMPILED.update(compile_concurrently(fresh))
    stats = {}
    for name in order:
        memory, cost, text, source, seconds = _COMPILED[keys[name]]
        trips = {"denoise": bucket.steps, "decode": programs.decode_turns(bucket.batch)}.get(name, 1)
        if memory is None:  # `cost` holds the compiler's refusal
            stats[name] = refused_program_stats(name, cost, parameter_bytes=params[modules[name]],
                                                kernel_flops=kernel_flops[name], loop_trips=trips, compile_s=seconds)
            logger.info("the compiler refused %s: %s", name, stats[name].compile_error)
        else:
            if dump_dir:
                os.makedirs(dump_dir, exist_ok=True)
                with open(os.path.join(dump_dir, f"{name}.txt" if source == "compiled" else f"{name}.lowered.txt"),
                          "w") as f:
                    f.write(text)
            stats[name] = program_stats(name, memory, cost, text,
                                        parameter_bytes=params[modules[name]], kernel_flops=kernel_flops[name],
                                        loop_trips=trips, compile_s=seconds,
                                        text_source=source)
            logger.info("compiled %s in %.1f s%s", name, seconds,
                        "" if keys[name] in fresh else " (the same program, compiled earlier)")
        if transient_limit is not None and (stats[name].compile_error
                                            or stats[name].transient_bytes > transient_limit):
            logger.info("batch %d: %s alone does not fit; the other programs' figures are not read", bucket.batch,
                        name)
            break
    return {name: stats[name] for name in PROGRAMS if name in stats}


def resident_bytes_for(modules, devices, shards: int) -> int:
    """Parameter bytes one device holds with `shards` model shards over `devices` (model.parallel.sharding's layout)."""
    from flax import nnx

    from ..parallel import sharding

    mesh = make_mesh(topology_options(shards), devices=list(devices))
    return sum(sharding.bytes_per_device(state, sharding.state_shardings(state, mesh))
               for state in (nnx.state(m) for m in modules))


class _Fitting:
    """The programs of one (model, topology, shape) at any shard count and batch, compiled on demand and each
    (shard count, batch per data replica) once: what `fit` searches over."""

    def __init__(self, config: PipelineConfig, topology: Topology, *, model: str, dtype: str, height: int,
                 width: int, text_len: int, sampling, capacity: int, out_layers, dump_dir: str | None,
                 auto_shards: bool, quantize: str = "none"):
        self.config, self.topology, self.model, self.dtype = config, topology, model, dtype
        self.height, self.width, self.text_len, self.sampling = height, width, text_len, sampling
        self.capacity, self.out_layers, self.dump_dir, self.auto_shards = capacity, out_layers, dump_dir, auto_shards
        self.devices = len(topology.devices)
        self.quantize = quantize
        self.modules = Networks(config, dtype, tuple(out_layers), quantize=quantize).run_modules()
        self.resident_by_shards = {s: resident_bytes_for(self.modules, topology.devices, s) * topology.devices_per_chip
                                   for s in shard_counts(self.devices)}
        self._programs: dict = {}
        self._reports: dict = {}  # (shards, batch per replica) -> (Report, complete)

    def report(self, shards: int, per_replica: int, *, complete: bool = True) -> Report:
        """The report for `per_replica` images on each of the data replicas of `shards` model shards; not
        `complete`: the compiling stops at the first program that does not fit (compile_programs)."""
        done = self._reports.get((shards, per_replica))
        if done and (done[1] or not complete):
            return done[0]
        if shards not in self._programs:
            self._programs[shards] = programs_for_topology(self.modules, self.topology, dtype=self.dtype,
                                                           model_shards=shards, text_len=self.text_len)
        programs = self._programs[shards]
        replicas = self.devices // shards
        steps, cfg = self.sampling.num_inference_steps, self.sampling.use_cfg
        bucket = bucket_for(self.config, height=self.height, width=self.width, sampling=self.sampling,
                            batch=per_replica * replicas, data_replicas=replicas)
        per_image = attention_flops_per_image(self.config, text_len=self.text_len,
                                              image_tokens=bucket.grid_h * bucket.grid_w, steps=steps, cfg=cfg,
                                              out_layers=self.out_layers)
        split = kernel_split(self.config, shards)
        per_device = {k: v * (bucket.batch // replicas) / split[k] for k, v in per_image.items()}
        logger.info("compiling %s for %s: batch %d, %d model shard(s) x %d data replica(s)", self.model,
                    self.topology.name, bucket.batch, shards, replicas)
        parameters = programs.parameter_bytes_per_device()
        limit, order = None, PROGRAMS
        if not complete:  # bytes per device beyond the parameters that the chip still holds
            limit = (self.capacity / self.topology.devices_per_chip) - sum(parameters.values())
            order = self._largest_first(shards)
        stats = compile_programs(programs, self.config, bucket, per_device, dump_dir=self.dump_dir,
                                 transient_limit=limit, order=order,
                                 label=f"batch {bucket.batch} for {self.topology.name}")
        report = Report(model=self.model, topology=self.topology, dtype=self.dtype, height=self.height,
                        width=self.width, batch=bucket.batch, steps=steps, cfg=cfg, model_shards=shards,
                        attention=programs.attention, parameter_bytes=parameters, programs=stats,
                        hbm_bytes_per_chip=self.capacity, auto_shards=self.auto_shards, quantize=self.quantize)
        self._reports[(shards, per_replica)] = (report, len(stats) == len(PROGRAMS))
        return report

    def _largest_first(self, shards: int) -> tuple[str, ...]:
        """The programs by their bytes beyond the parameters at the largest batch compiled so far with `shards`
        (the decode at 1024x1024, the denoising loop at small sizes), the largest first: at a larger batch the first
        is the likeliest not to fit, and the others are then not compiled."""
        done = [r for (s, _), (r, complete) in sorted(self._reports.items()) if s == shards and complete]
        if not done:
            return ("denoise", "decode", "encode")
        return tuple(sorted(PROGRAMS, key=lambda name: -done[-1].programs[name].transient_bytes))

    def trials(self, shards: int) -> list[Trial]:
        """What the batches compiled so far at `shards` said, per data replica."""
        replicas = self.devices // shards
        return [Trial(r.batch // replicas, r.fits, r.peak_bytes_per_chip - r.resident_bytes_per_chip)
                for (s, _), (r, _) in sorted(self._reports.items()) if s == shards]

    def largest(self, shards: int, cap: int) -> Report | None:
        """The complete report of the largest batch per data replica up to `cap` that fits with `shards` shards
        (model.preflight.batch_search), or None when one image per replica does not fit."""
        free = self.capacity - self.resident_by_shards[shards]
        while (batch := next_batch(self.trials(shards), free, cap)) is not None:
            self.report(shards, batch, complete=False)
        best = best_batch([t for t in self.trials(shards) if t.batch <= cap], cap)
        return self.report(shards, best) if best else None

    def fastest(self, shards: int, cap: int) -> Report | None:
        """The complete report of the batch per data replica up to `cap` that fits with `shards` shards and is the
        fastest per image (a near-tie goes to the smaller: batch_search.fastest), or None when one image per replica
        does not fit. One image is compiled first; its figures, with the calibrated batch terms (estimate.batch_term),
        name the likely fastest batch, which is compiled next; should it not fit, the largest smaller batch that does
        (the figures' time per image falls up to the fastest batch, so that one is the fastest of those that fit).
        Compiles one batch when one image is the likely fastest, two when the likely fastest fits."""
        one = self.report(shards, 1, complete=False)
        if not one.fits:
            return None
        int8 = self.quantize == "int8"
        predicted = {b: one.est_seconds_per_image + batch_term(b, int8=int8) for b in range(1, cap + 1)}
        likely = fastest(predicted)
        logger.info("batch %d per data replica is the likely fastest per image (%.1f ms by the estimate)", likely,
                    predicted[likely] * 1e3)
        if likely == 1:
            return one
        candidate = self.report(shards, likely, complete=False)
        if not candidate.fits:
            candidate = self.largest(shards, likely - 1)
        replicas = self.devices // shards
        by_batch = {1: one, candidate.batch // replicas: candidate}
        return by_batch[fastest({b: r.est_seconds_per_image for b, r in by_batch.items()})]

    def searched(self) -> tuple:
        """Every batch compiled, in order: (batch, model shards, peak bytes per chip, fits)."""
        return tuple((r.batch, s, r.peak_bytes_per_chip, r.fits) for (s, _), (r, _) in sorted(self._reports.items()))


def fit(config: PipelineConfig, topology: Topology, *, model: str, dtype: str, height: int, width: int,
        batch_size: int | None, text_len: int, num_inference_steps: int | None = None,
        guidance_scale: float | None = None, model_shards: int | None = None, hbm_bytes: int | None = None,
        out_layers=DEFAULT_TEXT_ENCODER_OUT_LAYERS, dump_dir: str | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, quantize: str = "none") -> Report:
    """Compile the programs of `config` (named `model` in the report) for `topology` and report; without
    `model_shards`, the fewest shards (a divisor of the worker's devices) whose programs fit, else the most shards'
    report with advice. `batch_size` None: the fastest batch per image up to `max_batch_size` (at least one image per
    data replica) that fits (`_Fitting.fastest`), searched at the fewest shards where one image per replica fits; a
    given batch that does not fit gets the largest smaller batch that does in its advice. Steps and guidance None:
    the checkpoint's. ShardCountError for a `model_shards` that does not divide the devices; the arguments are
    otherwise taken as valid (model.contract checks them). `quantize`: as EngineOptions.quantize (int8 weights and
    their time)."""
    sampling = resolve_sampling(config, num_inference_steps, guidance_scale)
    devices = len(topology.devices)
    if model_shards is not None:
        check_model_shards(model_shards, topology.devices)
    capacity = hbm_bytes or topology.chip.hbm_bytes
    check_text_width(config, out_layers)
    fitting = _Fitting(config, topology, model=model, dtype=dtype, height=height, width=width, text_len=text_len,
                       sampling=sampling, capacity=capacity, out_layers=out_layers, dump_dir=dump_dir,
                       auto_shards=model_shards is None, quantize=quantize)
    candidates = [model_shards] if model_shards else shard_counts(devices)
    usable = [s for s in candidates[:-1] if fitting.resident_by_shards[s] <= capacity] + candidates[-1:]
    for s in candidates:
        if s not in usable:
            logger.info("%d model shard(s): the parameters alone take %s per chip, above %s; trying more",
                        s, format_bytes(fitting.resident_by_shards[s]), format_bytes(capacity))

    def cap(shards: int) -> int:  # images per data replica
        return max(1, max_batch_size // (devices // shards))

    if batch_size is None:
        for shards in usable:
            best = fitting.fastest(shards, cap(shards))
            if best is not None:
                logger.info("picked batch %d: the fastest per image up to %d that fits with %d model shard(s) (%d "
                            "batch(es) compiled)", best.batch, max_batch_size, shards, len(fitting.searched()))
                return dataclasses.replace(best, batch_picked=True, max_batch_size=max_batch_size,
                                           batch_trials=fitting.searched())
            logger.info("%d model shard(s): one image per data replica does not fit", shards)
        report = fitting.report(usable[-1], 1)
        return dataclasses.replace(report, batch_picked=True, max_batch_size=max_batch_size,
                                   batch_trials=fitting.searched(),
                                   advice=fit_advice(report, fitting.resident_by_shards))
    report = None
    for shards in usable:
        per_replica = -(-batch_size // (devices // shards))
        report = fitting.report(shards, per_replica)
        if report.fits:
            return report
        if shards != usable[-1]:
            logger.info("%d model shard(s) peak at %s per chip, above %s; trying more", shards,
                        format_bytes(report.peak_bytes_per_chip), format_bytes(capacity))
    smaller = None
    for shards in usable:  # the largest batch below the one asked for that fits, with the fewest shards
        per_replica = -(-batch_size // (devices // shards))
        smaller = fitting.largest(shards, per_replica - 1) if per_replica > 1 else None
        if smaller is not None:
            break
    return dataclasses.replace(report, batch_trials=fitting.searched(),
                               advice=fit_advice(report, fitting.resident_by_shards, smaller=smaller))
