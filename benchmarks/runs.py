"""Measurement helpers the benchmarks and the chip tests share: progress lines, host and device memory, compile
counters, and the matmul peak a device's rate is compared with."""

from __future__ import annotations

import statistics
import sys
import time

from model.engine.compile_events import BACKEND_COMPILE_EVENT, CACHE_HIT_EVENT, CACHE_MISS_EVENT


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------ counters


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
