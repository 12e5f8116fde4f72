"""CPU execution: per-program XLA:CPU compiler options, image-by-image programs, and images run side by side.

On one CPU device the programs run image by image (each program sees a batch of one, whatever the batch), which
keeps an image's bytes independent of how requests are batched; CONCURRENT_IMAGES images of a batch then run at
once, each an execution of the one-image programs in its own thread. On accelerators and multi-device meshes none of
this applies: the batch is one program, split over the mesh.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..options import PROGRAMS

# XLA:CPU options per program. Eigen (YNNPACK's fusions off) for the text encoder and the VAE decode, XLA's defaults
# (YNNPACK dots) for the transformer: each the faster library for that program on CPU (docs/performance.md).
# Either library's blocking depends on the matrix sizes, so a batched dot may round an image differently with its
# batch; the job promises the same bytes however requests are batched, which is why these options go together with
# running image by image (every program then sees one image at a time, whatever the batch).
EIGEN_DOTS = (("xla_cpu_experimental_ynn_fusion_type", ""),)
# (program, options) pairs; a program not listed compiles with XLA's defaults.
CPU_COMPILER_OPTIONS: tuple = (("encode", EIGEN_DOTS), ("decode", EIGEN_DOTS))
# Images of a batch run at once on one CPU device, each an execution of the one-image programs in its own thread:
# one image leaves the cores partly idle (its many small ops split badly over threads), so 2 at once make more images
# per second (docs/performance.md); an image's bytes are those of the one-image programs whatever the batch.
CONCURRENT_IMAGES = 2

def on_cpu(mesh: Mesh) -> bool:
    """Whether every device of `mesh` is a CPU."""
    return all(d.platform == "cpu" for d in mesh.devices.flat)


def compiler_options_for(mesh: Mesh, program: str) -> dict | None:
    """The XLA compiler options for `program` on `mesh`: CPU_COMPILER_OPTIONS, only when every device is a CPU."""
    if program not in PROGRAMS:
        raise ValueError(f"unknown program {program!r}; choose from {PROGRAMS}")
    if not on_cpu(mesh):
        return None
    chosen = dict(CPU_COMPILER_OPTIONS).get(program)
    return dict(chosen) if chosen else None


def per_image_for(mesh: Mesh) -> bool:
    """Whether the programs on `mesh` run image by image: on a one-device CPU mesh only (a bigger mesh splits the
    batch over its devices; an accelerator fills its cores with the batch)."""
    return mesh.devices.size == 1 and on_cpu(mesh)


def concurrent_images_for(mesh: Mesh) -> int:
    """How many images of a batch run at once (threads over the one-image programs): CONCURRENT_IMAGES where the
    programs run image by image, 1 (the batch in one program) everywhere else."""
    return CONCURRENT_IMAGES if per_image_for(mesh) else 1


def image_by_image(per_image: bool):
    """`rows(fn, *arrays)`: fn over the batch image by image inside one program (lax.map, each call on a batch of
    one) when `per_image`, else fn on the whole batch."""
    def rows(fn, *arrays):
        if not per_image:
            return fn(*arrays)
        out = jax.lax.map(lambda row: fn(*jax.tree.map(lambda a: a[None], row)), arrays)
        return jax.tree.map(lambda o: o.reshape((-1,) + o.shape[2:]), out)

    return rows


class ImageThreads:
    """Runs the one-image programs over any number of images, `workers` images at once in threads (a CPU device runs
    calls from different threads side by side, one thread's calls one after the other)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.runs = collections.Counter()  # one-image program runs by program name
        self._pool = None  # started on first use

    def wrap(self, name: str, fn, batched: tuple[int, ...]):
        """`fn`, the one-image program `name`, over any number of images: each image's slice of the per-image
        arguments (at positions `batched`; the rest are shared: parameters, schedule, RoPE tables) in its own call;
        outputs concatenated in order."""

        def run(*args):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="image")
            count = args[batched[0]].shape[0]
            self.runs[name] += count

            def one(i):
                row = [a[i:i + 1] if k in batched and a is not None else a for k, a in enumerate(args)]
                return jax.block_until_ready(fn(*row))

            outs = list(self._pool.map(one, range(count)))
            return jax.tree.map(lambda *o: jnp.concatenate(o), *outs)

        return run
