"""Starting the accelerator runtime for a worker that loads one model and then moves only small arrays: the TPU
runtime's settings that it reads once, when it starts, and the start itself on a thread beside the load."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax

logger = logging.getLogger(__name__)

# The TPU runtime maps and pins a host buffer for transfers when it starts: 4 GiB unless this says otherwise. 1 GiB
# starts the runtime faster with less host memory and places the weights as fast; below it transfers slow sharply
# (docs/performance.md). A user's own TPU_PREMAPPED_BUFFER_SIZE is kept.
PREMAPPED_BUFFER_ENV = "TPU_PREMAPPED_BUFFER_SIZE"
DEFAULT_PREMAPPED_BUFFER_BYTES = 1 << 30


def apply_runtime_defaults(environ=os.environ) -> dict[str, str]:
    """Set the worker's runtime settings that `environ` does not already name; returns those it set. They take
    effect only if the runtime has not started yet in this process."""
    chosen = {}
    if PREMAPPED_BUFFER_ENV not in environ:
        chosen[PREMAPPED_BUFFER_ENV] = str(DEFAULT_PREMAPPED_BUFFER_BYTES)
    environ.update(chosen)
    if chosen:
        logger.debug("accelerator runtime settings chosen by the worker: %s", chosen)
    return chosen


# The runtime starts on this thread while a load reads the checkpoint's configs, tokenizer and headers and builds
# the model's shapes, none of which needs a device.
_STARTER = ThreadPoolExecutor(1, thread_name_prefix="runtime-start")


def start_runtime() -> Future:
    """The runtime's settings, then jax.devices() on the starter thread; the future's result is the seconds the
    start took (near 0 once started), and its exception the runtime's own error (no chip, chip busy)."""
    apply_runtime_defaults()

    def start() -> float:
        began = time.perf_counter()
        jax.devices()
        return time.perf_counter() - began

    return _STARTER.submit(start)
