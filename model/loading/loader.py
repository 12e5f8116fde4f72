"""safetensors -> NNX state: validate a component's names/shapes/dtypes against the model, then convert and place its
tensors one by one (the files are read by model/loading/safetensors_file.py).

Each tensor is cast to its parameter's dtype and laid out for JAX one at a time, so peak host memory stays near one copy
of the weights in the target dtype.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ..errors import CheckpointError
from ..nets.quantize import QuantScale, is_quantized, quantize_columns, scale_path, source_dtype
from .safetensors_file import ReadBuffers
from .stored_tensors import validate_component


# Threads that read, lay out and place tensors at once (host memory holds at most one tensor per thread).
LOAD_THREADS = max(1, min(8, os.cpu_count() or 1))


# Side of the square blocks a transposed matrix is copied by: 512 x 512 2-byte values (512 KiB) stay in a core's
# cache while each is read by rows and written by columns.
TRANSPOSE_BLOCK = 512


def _transposed_copy(matrix: np.ndarray) -> np.ndarray:
    """C-contiguous copy of the 2-D transposed view `matrix` (its .T is C-contiguous), block by block: faster on CPU
    than numpy's one strided copy for klein's weights (docs/performance.md); accelerators transpose on the device."""
    rows, cols = matrix.shape
    out = np.empty((rows, cols), matrix.dtype)
    step = TRANSPOSE_BLOCK
    for i in range(0, rows, step):
        for j in range(0, cols, step):
            out[i:i + step, j:j + step] = matrix[i:i + step, j:j + step]
    return out


def contiguous(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of a (transposed) view; 2-byte floats (bfloat16, float16) are copied as uint16, whose
    copy loop releases the GIL (ml_dtypes' bfloat16 copies hold it), so loading threads copy in parallel. A
    transposed matrix is copied by cache-sized blocks (`_transposed_copy`)."""
    if array.flags.c_contiguous:
        return array
    two_byte_float = array.dtype.itemsize == 2 and array.dtype.kind in "fV"
    view = array.view(np.uint16) if two_byte_float else array
    if view.ndim == 2 and view.T.flags.c_contiguous and view.dtype != object:
        copied = _transposed_copy(view)
    else:
        copied = np.ascontiguousarray(view)
    return copied.view(array.dtype) if two_byte_float else copied


# Platforms whose loader sends matrices and conv kernels in torch's layout and transposes them on the device, and
# reads each tensor into its thread's reused host buffer (ReadBuffers; the device keeps its own copy). On a CPU
# "device" the transpose is the same host copy either way, compiling each shape's transpose costs more, and a
# placed array may be the host memory itself (which would pin a whole reused buffer). A weight with a LoRA delta to
# merge takes the device's layout on every platform: the merge is part of that program.
DEVICE_TRANSPOSE_PLATFORMS = ("tpu", "gpu")


def _platform(sharding) -> str:
    return next(iter(sharding.device_set)).platform


def _permuted(sharding, order: tuple[int, ...]):
    """The sharding of a torch-layout tensor whose JAX-layout transpose (axes `order`) has `sharding`, so that the
    transpose moves no data between devices: torch axis order[k] is split as JAX axis k is."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(order) - len(sharding.spec))
    stored = [None] * len(order)
    for k, axis in enumerate(order):
        stored[axis] = spec[k]
    return NamedSharding(sharding.mesh, PartitionSpec(*stored))


def _factor_shardings(stored_sharding):
    """Where a LoRA delta's stacked factors (down, up, scales: `stacked_factors`) go for a torch-layout weight
    [out, in] placed by `stored_sharding`: the down factor [rank, in] split by columns as the weight is, the up factor
    [out, rank] by rows, the scales [rank] on every device; so their product is made where the weight's blocks lie,
    moving no data between devices."""
    if not isinstance(stored_sharding, NamedSharding):
        return stored_sharding, stored_sharding, stored_sharding
    spec = tuple(stored_sharding.spec) + (None, None)
    mesh = stored_sharding.mesh
    return (NamedSharding(mesh, PartitionSpec(None, spec[1])), NamedSharding(mesh, PartitionSpec(spec[0], None)),
            NamedSharding(mesh, PartitionSpec()))


def _layout_program(order, quantize: bool, merge: bool):
    """The device's layout of one weight: its LoRA delta (up * scales) @ down merged in float32 (`merge`), the
    transpose to JAX layout, then the int8 quantization (`quantize`, model.nets.quantize)."""
    def layout(weight, *factors):
        if merge:
            down, up, scales = factors
            delta = jnp.matmul(up * scales, down, precision=jax.lax.Precision.HIGHEST)
            weight = (weight.astype(jnp.float32) + delta).astype(weight.dtype)
        weight = jnp.transpose(weight, order)
        return quantize_columns(weight) if quantize else weight

    return layout


class DeviceTransposes:
    """Compiled device layouts (torch layout -> JAX layout on the device, a LoRA delta merged and int8 quantized
    where asked), one per (axes order, stored shape, dtype, sharding, scale sharding, LoRA rank) and process,
    compiled on their own threads as soon as the loader knows the shapes: a cold start compiles them before the
    generator's large programs take the compiler (placing waited for them behind those programs otherwise:
    docs/performance.md), a warm one reads them from the persistent compilation cache before the weights are read.
    A merged adapter's scale is an argument, so every adapted weight of one shape and rank shares one program, which
    replaces the transpose that weight needs anyway."""

    THREADS = 4

    def __init__(self):
        self._lock = threading.Lock()
        self._compiled: dict = {}  # key -> Future of the compiled layout
        self._pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="transpose-compile")

    @staticmethod
    def key(order: tuple[int, ...], stored_shape: tuple[int, ...], dtype, sharding, scale_sharding=None,
            rank: int = 0) -> tuple:
        """`scale_sharding`: the program also quantizes to int8 (model.nets.quantize), its scale placed so; `rank`:
        it first merges a LoRA delta of that rank (the adapters' ranks summed: `stacked_factors`), 0 for none."""
        return tuple(order), tuple(stored_shape), np.dtype(dtype).name, sharding, scale_sharding, int(rank)

    def prepare(self, key: tuple):
        """The future of the compiled layout `key`, submitted for compiling if it is not already."""
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, *key)
            return future

    def get(self, key: tuple):
        return self.prepare(key).result()

    def clear(self) -> None:
        with self._lock:
            self._compiled.clear()

    def __len__(self) -> int:
        return len(self._compiled)

    def keys(self) -> list[tuple]:
        with self._lock:
            return list(self._compiled)

    @staticmethod
    def _compile(order, stored_shape, dtype, sharding, scale_sharding, rank):
        stored_sharding = _permuted(sharding, order)
        specs = [jax.ShapeDtypeStruct(stored_shape, jnp.dtype(dtype), sharding=stored_sharding)]
        if rank:
            down_sharding, up_sharding, scales_sharding = _factor_shardings(stored_sharding)
            out, width = stored_shape
            specs += [jax.ShapeDtypeStruct((rank, width), jnp.float32, sharding=down_sharding),
                      jax.ShapeDtypeStruct((out, rank), jnp.float32, sharding=up_sharding),
                      jax.ShapeDtypeStruct((rank,), jnp.float32, sharding=scales_sharding)]
        quantize = scale_sharding is not None
        layout = jax.jit(_layout_program(tuple(order), quantize, bool(rank)),
                         out_shardings=(sharding, scale_sharding) if quantize else sharding)
        lowered = layout.lower(*specs)
        return lowered.compile()


@functools.lru_cache(maxsize=None)
def _quantizer(sharding, scale_sharding):
    """`quantize_columns` on the device, its outputs placed by the two shardings (jit compiles per shape)."""
    return jax.jit(quantize_columns, out_shardings=(sharding, scale_sharding))


DEVICE_TRANSPOSES = DeviceTransposes()


def release_host_memory() -> None:
    """Give the heap pages freed by loading back to the OS (glibc's malloc_trim), so a process whose weights now
    live on an accelerator does not keep their host copies' pages resident; a no-op without glibc."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# --------------------------------------------------------------------------------------------- name / layout mapping


def flat_params(module_or_abstract) -> dict[str, jax.ShapeDtypeStruct]:
    """Checkpoint-style dotted names of every parameter of an NNX module (or abstract module), in JAX layout."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module_or_abstract, nnx.Param)):
        value = var.get_value() if hasattr(var, "get_value") else var.value
        out[".".join(str(p) for p in path)] = value
    return out


# Embedding tables (torch's nn.Embedding: [rows, width], kept as they are): Qwen3's, and CLIP's (model.nets.clip).
EMBEDDING_TABLES = ("embed_tokens.weight", "token_embedding.weight", "position_embedding.weight")


def jax_axes_order(name: str, ndim: int, target_ndim: int) -> tuple[int, ...] | None:
    """The axes order that takes a torch-layout tensor to JAX layout (None: same layout). Linear [out, in] ->
    [in, out]; Conv [O, I, kh, kw] -> [kh, kw, I, O]; embedding tables keep torch's [vocab, width]."""
    if name.endswith(EMBEDDING_TABLES):
        return None
    if ndim == 4 and target_ndim == 2:  # legacy 1x1-conv attention projections, squeezed first (`squeezed`)
        ndim = 2
    return {2: (1, 0), 4: (2, 3, 1, 0)}.get(ndim)


def squeezed(array: np.ndarray, target_ndim: int) -> np.ndarray:
    """A legacy 1x1-conv attention projection [O, I, 1, 1] as the [O, I] matrix its 2-D parameter is; else as is."""
    return array[:, :, 0, 0] if array.ndim == 4 and target_ndim == 2 else array


def to_jax_axes(name: str, array: np.ndarray, target_ndim: int) -> np.ndarray:
    """torch layout -> JAX layout on the host (a view): see `jax_axes_order`."""
    order = jax_axes_order(name, array.ndim, target_ndim)
    array = squeezed(array, target_ndim)
    return array if order is None else array.transpose(order)


def torch_shape(name: str, jax_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint (torch) shape of a parameter given its JAX shape; inverse of `to_jax_axes`."""
    if name.endswith(EMBEDDING_TABLES):
        return tuple(jax_shape)
    if len(jax_shape) == 2:
        return (jax_shape[1], jax_shape[0])
    if len(jax_shape) == 4:
        kh, kw, i, o = jax_shape
        return (o, i, kh, kw)
    return tuple(jax_shape)


def expected_tensors(full_abstract, extra: dict[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor name (with torch shape) that a complete checkpoint of this component holds."""
    names = {n: torch_shape(n, v.shape) for n, v in flat_params(full_abstract).items()}
    names.update(extra or {})
    return names


@dataclasses.dataclass
class LoadTimes:
    """Where the loading threads' time went, summed over the threads (their phases overlap in wall time): reading
    the files, host-side casts and layout copies, host-to-device transfers, and layouts made on the device."""

    tensors: int = 0
    bytes: int = 0
    read_s: float = 0.0
    host_layout_s: float = 0.0
    transfer_s: float = 0.0
    device_layout_s: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, **seconds: float) -> None:
        with self._lock:
            self.tensors += 1
            self.bytes += nbytes
            for phase, value in seconds.items():
                setattr(self, phase, getattr(self, phase) + value)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


@dataclasses.dataclass
class ComponentLoad:
    """One component to fill (see `load_component` for the fields): several load through one pool of threads."""

    folder: str
    abstract_module: object
    expected: dict
    optional: Iterable[str] = ()
    tensor_to_file: dict | None = None
    permutations: dict | None = None
    deltas: dict | None = None  # {parameter name: (LoraDelta, ...)}: merged into those weights (model.loading.lora)


def device_layout_keys(components: list[ComponentLoad], placement) -> set[tuple]:
    """The DEVICE_TRANSPOSES keys loading `components` with `placement` needs: one per distinct device layout (every
    transpose on an accelerator; every weight with a LoRA delta to merge, on any platform). Their tensor files must
    be known (validated); only shapes are read."""
    needed = set()
    for c in components:
        if c.tensor_to_file is None:
            continue
        variables = dict(nnx.to_flat_state(nnx.state(c.abstract_module)))
        for path, var in variables.items():
            name = ".".join(str(p) for p in path)
            sf = c.tensor_to_file.get(name)
            if sf is None:
                continue
            target = var.get_value() if hasattr(var, "get_value") else var.value
            sharding = placement(path, var)
            order = jax_axes_order(name, len(sf.entries[name][1]), len(target.shape))
            rank = lora_rank((c.deltas or {}).get(name))
            if rank or (order is not None and _platform(sharding) in DEVICE_TRANSPOSE_PLATFORMS):
                dtype, scale_sharding = _stored_dtype(var, target), _scale_sharding(path, variables, placement)
                order = order or tuple(range(len(target.shape)))
                needed.add(DEVICE_TRANSPOSES.key(order, torch_shape(name, target.shape), dtype, sharding,
                                                 scale_sharding, rank))
    return needed


def prepare_device_transposes(components: list[ComponentLoad], placement) -> int:
    """Start compiling (on DEVICE_TRANSPOSES' threads) every device layout that loading `components` with
    `placement` will make (`device_layout_keys`); returns how many the tensors need."""
    needed = device_layout_keys(components, placement)
    for key in needed:
        DEVICE_TRANSPOSES.prepare(key)
    return len(needed)


def _stored_dtype(var, target):
    """The dtype a tensor is cast to on the host: its parameter's, or for an int8 weight the float dtype it is
    quantized from on the device."""
    return source_dtype(var) if is_quantized(var) else target.dtype


def _scale_sharding(path, variables: dict, placement):
    """Where a quantized weight's scale goes (None for a weight that is not quantized)."""
    if not is_quantized(variables[path]):
        return None
    scale = scale_path(path)
    return placement(scale, variables[scale])


def load_component(folder: str, abstract_module, *, expected: dict[str, tuple[int, ...]],
                   optional: Iterable[str] = (), tensor_to_file: dict | None = None, placement=None,
                   permutations: dict | None = None, times: LoadTimes | None = None):
    """Fill `abstract_module` (from nnx.eval_shape) with the folder's weights and return the concrete module.

    The folder is validated first (see `validate_component`) unless its result is passed in. Only the module's
    own parameters are read; each is cast to the parameter's dtype. `placement(path, variable)`: the sharding each
    tensor is put at as soon as it is read (so a model split over several chips never sits whole on one; default:
    the default device). `permutations`: {path: (order, axis)} applied to a tensor first (model.parallel.shard_order).
    `times`: where each phase's thread-seconds are added (see LoadTimes).
    """
    (module,) = load_components([ComponentLoad(folder, abstract_module, expected, optional, tensor_to_file,
                                               permutations)], placement=placement, times=times)
    return module


@dataclasses.dataclass
class ResolvedComponent:
    """A component ready to load: its module split into graph and flat abstract state, with its validated tensor
    files, its shard permutations and the parameters read from the files (an int8 weight's scale is no checkpoint
    tensor: its weight's job fills it, model.nets.quantize)."""

    load: ComponentLoad
    graphdef: object
    flat: list
    tensor_to_file: dict
    permutations: dict
    variables: dict
    read: list


def resolve(components: list[ComponentLoad]) -> list[ResolvedComponent]:
    """Validate each component's files (unless given) and check every parameter it reads has a tensor there."""
    resolved = []
    for c in components:
        tensor_to_file = c.tensor_to_file
        if tensor_to_file is None:
            tensor_to_file = validate_component(c.folder, expected=c.expected, optional=c.optional)
        graphdef, abstract_state = nnx.split(c.abstract_module)
        flat = nnx.to_flat_state(abstract_state)
        read = [(path, var) for path, var in flat if not isinstance(var, QuantScale)]
        for path, _ in read:
            name = ".".join(str(p) for p in path)
            if name not in tensor_to_file:
                raise CheckpointError("model parameter has no tensor in the checkpoint", path=c.folder, tensor=name)
        resolved.append(ResolvedComponent(dataclasses.replace(c, tensor_to_file=tensor_to_file), graphdef, flat,
                                          tensor_to_file, c.permutations or {}, dict(flat), read))
    return resolved


@dataclasses.dataclass
class Placing:
    """What every loading thread shares while it places tensors (see `load_components`)."""

    resolved: list[ResolvedComponent]
    placement: object  # (path, variable) -> sharding, or None: the default device
    default_sharding: object
    buffers: ReadBuffers
    times: LoadTimes | None
    should_stop: object

    def sharding(self, path, var):
        return self.placement(path, var) if self.placement is not None else self.default_sharding


def prepare(resolved: list[ResolvedComponent], *, placement=None, times: LoadTimes | None = None,
            should_stop=None) -> Placing:
    """The loading threads' shared state; starts compiling every transpose the tensors need (or reading it from the
    compilation cache) on the transposes' threads while the first tensors are read (a no-op for those a caller
    prepared already)."""
    default_sharding = SingleDeviceSharding(jax.devices()[0]) if placement is None else None
    prepare_device_transposes([r.load for r in resolved], placement or (lambda path, var: default_sharding))
    return Placing(resolved, placement, default_sharding, ReadBuffers(), times, should_stop)


def place(placing: Placing, job) -> list:
    """Read one parameter's tensor, lay it out and put it on its devices (int8 weights quantized there): its
    ((component index, path), variable) leaves, the scale's too for an int8 weight."""
    index, path, var = job
    if placing.should_stop is not None:
        stop = placing.should_stop()
        if stop is not None:
            raise stop
    component = placing.resolved[index]
    name = ".".join(str(p) for p in path)
    target = var.get_value() if hasattr(var, "get_value") else var.value
    sf = component.tensor_to_file[name]
    sharding = placing.sharding(path, var)
    scale_sharding = None
    if is_quantized(var):
        scale_var = component.variables[scale_path(path)]
        scale_sharding = placing.sharding(scale_path(path), scale_var)
    accelerator = _platform(sharding) in DEVICE_TRANSPOSE_PLATFORMS
    clock = time.perf_counter()
    array = squeezed(sf.read(name, placing.buffers if accelerator else None), len(target.shape))
    read_s, clock = time.perf_counter() - clock, time.perf_counter()
    order = jax_axes_order(name, array.ndim, len(target.shape))
    stored_shape = array.shape if order is None else tuple(array.shape[a] for a in order)
    if tuple(stored_shape) != tuple(target.shape):
        raise CheckpointError(f"converted shape {list(stored_shape)} differs from the model's "
                              f"{list(target.shape)}", path=sf.path, tensor=name)
    if tuple(path) in component.permutations:  # along the JAX layout's `axis`, which is torch's axis order[axis]
        perm, axis = component.permutations[tuple(path)]
        array = np.take(array, perm, axis=axis if order is None else order[axis])
    deltas = (component.load.deltas or {}).get(name)
    if deltas:
        deltas = _permuted_deltas(deltas, component.permutations.get(tuple(path)), order)
    array = array.astype(_stored_dtype(var, target), copy=False)
    # A weight with a LoRA delta is laid out by the device on every platform: one program merges, transposes and
    # quantizes it (the merge is no program of its own).
    on_device = (order is not None and accelerator) or bool(deltas)
    if on_device and order is None:  # merged in the layout it is stored in
        order = tuple(range(array.ndim))
    if on_device:
        array = np.ascontiguousarray(array)
    else:
        array = contiguous(array if order is None else array.transpose(order))
    host_s, clock = time.perf_counter() - clock, time.perf_counter()
    # Each step is waited on, so the host copy is released as soon as the device holds the tensor (host memory
    # holds at most one tensor per loading thread, whatever the model's size) and each phase is timed.
    if on_device:
        # Sent in torch's layout and transposed by the device, whose memory does it in microseconds; the host
        # copies it would take instead were most of the load on a TPU host (docs/performance.md).
        stored_sharding = _permuted(sharding, order)
        stored = [jax.device_put(array, stored_sharding)]
        if deltas:  # merged in torch's layout, before the transpose and any int8 quantization
            stored += jax.device_put(stacked_factors(deltas), _factor_shardings(stored_sharding))
        stored = jax.block_until_ready(stored)
        transfer_s, clock = time.perf_counter() - clock, time.perf_counter()
        layout = DEVICE_TRANSPOSES.get(DEVICE_TRANSPOSES.key(order, array.shape, array.dtype, sharding,
                                                             scale_sharding, lora_rank(deltas)))
        placed = jax.block_until_ready(layout(*stored))
    else:
        placed = jnp.asarray(array) if placing.placement is None else jax.device_put(array, sharding)
        placed = placed.block_until_ready()
        transfer_s, clock = time.perf_counter() - clock, time.perf_counter()
        if scale_sharding is not None:  # int8 on the device that holds the float copy (model.nets.quantize)
            placed = jax.block_until_ready(_quantizer(sharding, scale_sharding)(placed))
    if accelerator:
        placing.buffers.keep_unless_aliased(placed[0] if scale_sharding is not None else placed)
    if placing.times is not None:
        placing.times.add(array.nbytes, read_s=read_s, host_layout_s=host_s, transfer_s=transfer_s,
                          device_layout_s=time.perf_counter() - clock)
    if scale_sharding is None:
        return [((index, path), var.replace(placed))]
    values, scale = placed
    return [((index, path), var.replace(values)), ((index, scale_path(path)), scale_var.replace(scale))]


def _permuted_deltas(deltas: tuple, permutation, order) -> tuple:
    """LoRA factors whose product is permuted as the weight is (`permutation` (perm, JAX axis), model.parallel.
    shard_order): the up factor's rows for torch's axis 0, the down factor's columns for its axis 1."""
    if permutation is None:
        return deltas
    perm, axis = permutation
    torch_axis = axis if order is None else order[axis]
    return tuple(dataclasses.replace(d, up=d.up[perm]) if torch_axis == 0 else
                 dataclasses.replace(d, down=d.down[:, perm]) for d in deltas)


def lora_rank(deltas) -> int:
    """The rank of a weight's LoRA deltas stacked into one (`stacked_factors`): their ranks summed; 0 for none."""
    return sum(d.down.shape[0] for d in deltas) if deltas else 0


def stacked_factors(deltas: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(down [rank, in], up [out, rank], scales [rank]) of a weight's LoRA deltas as one: sum_k scale_k up_k @ down_k
    = (up * scales) @ down with the factors stacked along the rank and each column's scale its adapter's."""
    down = np.concatenate([d.down for d in deltas], axis=0).astype(np.float32, copy=False)
    up = np.concatenate([d.up for d in deltas], axis=1).astype(np.float32, copy=False)
    scales = np.concatenate([np.full(d.down.shape[0], d.scale, np.float32) for d in deltas])
    return down, up, scales


def _file_position(resolved: list[ResolvedComponent], job):
    """Where a job's tensor lies: (file, offset)."""
    index, path, _ = job
    name = ".".join(str(p) for p in path)
    sf = resolved[index].tensor_to_file[name]
    return sf.path, sf.entries[name][2]


def assemble(resolved: list[ResolvedComponent], placed: dict) -> list:
    """The concrete modules from their graphs and placed leaves {(component index, path): variable}."""
    modules = []
    for index, r in enumerate(resolved):
        leaves = [(path, placed[(index, path)]) for path, _ in r.flat]
        modules.append(nnx.merge(r.graphdef, nnx.from_flat_state(leaves)))
    return modules


def load_components(components: list[ComponentLoad], *, placement=None, times: LoadTimes | None = None,
                    should_stop=None) -> list:
    """`load_component` for several components at once, their tensors in one queue for the same loading threads:
    no thread waits for the last large tensors of one component before the next component's start.
    `should_stop()`: an exception to raise instead of reading the next tensor (e.g. a tokenizer that failed to load
    meanwhile), or None to go on. Runs resolve -> prepare -> place (per tensor) -> assemble."""
    resolved = resolve(components)
    placing = prepare(resolved, placement=placement, times=times, should_stop=should_stop)
    jobs = [(index, path, var) for index, r in enumerate(resolved) for path, var in r.read]
    # Tensors are read, laid out and sent to the devices by several threads at once: file reads, the layout copies
    # (as 16-bit integers for 2-byte floats, which numpy copies without the GIL) and host-to-device transfers overlap.
    # They are taken in the order they lie in the files, so the threads' reads move through each file together.
    jobs.sort(key=functools.partial(_file_position, resolved))
    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        placed = dict(leaf for leaves in pool.map(functools.partial(place, placing), jobs) for leaf in leaves)
    return assemble(resolved, placed)
