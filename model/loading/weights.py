"""safetensors -> NNX state: find the files, validate names/shapes/dtypes against the model, convert tensor by tensor.

Safetensors files are parsed here directly (header + positioned reads) so that bfloat16 works without a framework and a
truncated shard is detected before any value is read. Each tensor is cast to its parameter's dtype and laid out
for JAX one at a time, so peak host memory stays near one copy of the weights in the target dtype.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import logging
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ..errors import CheckpointError, UnsafeWeightsError
from ..contract import is_integer
from ..nets.quantize import QuantScale, is_quantized, quantize_columns, scale_path, source_dtype
from .weight_files import select_weight_files

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
MAX_HEADER_BYTES = 100 * 1024 * 1024
# How a Git LFS pointer file starts ("version https://git-lfs.github.com/spec/v1"): a clone made without git-lfs
# holds these in place of the weights.
LFS_POINTER_START = b"version "
# Threads that read, lay out and place tensors at once (host memory holds at most one tensor per thread).
LOAD_THREADS = max(1, min(8, os.cpu_count() or 1))


class SafetensorsFile:
    """One .safetensors file: its parsed header and lazy, memory-mapped access to each tensor.

    `path` is a local file, or, with `size` and `read_range(offset, length) -> bytes`, any file whose size and bytes
    can be had (the launch reads a gs:// object's first 8 bytes and header by ranged reads, its size from the
    listing: `read` is then unavailable). `size` None: unknown (an object stored gzip-encoded), so a file cut short
    is not detected from its header."""

    def __init__(self, path: str, *, size: int | None = None, read_range=None):
        self.path = path
        try:
            if read_range is None:
                size = os.path.getsize(path)
                with open(path, "rb") as f:
                    header_len, header = self._parse_start(f.read(8), size, f.read)
            else:
                header_len, header = self._parse_start(read_range(0, 8), size, lambda n: read_range(8, n))
        except OSError as e:
            raise CheckpointError(f"cannot read weight file: {e}", path=path) from e
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"safetensors header is not valid JSON: {e}", path=path) from e
        if not isinstance(header, dict):
            raise CheckpointError("safetensors header is not a JSON object", path=path)
        header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        data_len = None if size is None else size - self.data_start
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError("malformed safetensors header entry", path=path, tensor=name) from e
            if not all(_is_count(v) for v in (*shape, begin, end)) or not isinstance(dtype, str):
                raise CheckpointError(f"malformed safetensors header entry: shape {shape!r} and data_offsets "
                                      f"{[begin, end]!r} must be non-negative integers, dtype a string",
                                      path=path, tensor=name)
            if dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"unsupported safetensors dtype {dtype}", path=path, tensor=name)
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
            if end - begin != nbytes or begin < 0:
                raise CheckpointError(f"tensor byte range [{begin}, {end}) does not match dtype {dtype} and shape "
                                      f"{list(shape)}", path=path, tensor=name)
            if data_len is not None and end > data_len:
                raise CheckpointError(f"safetensors file is truncated: tensor needs bytes up to {end} but the file "
                                      f"holds {data_len} data bytes", path=path, tensor=name)
            self.entries[name] = (dtype, shape, begin, end)
        # The tensors' byte ranges must not overlap (two weights reading the same bytes), as safetensors requires.
        ranges = sorted((begin, end, name) for name, (_, _, begin, end) in self.entries.items() if end > begin)
        for (_, end_a, name_a), (begin_b, _, name_b) in zip(ranges, ranges[1:]):
            if begin_b < end_a:
                raise CheckpointError(f"tensor byte ranges overlap: {name_a!r} and {name_b!r} share bytes", path=path,
                                      tensor=name_b)

    def _parse_start(self, raw: bytes, size: int | None, read_header) -> tuple[int, object]:
        """(header length, decoded header) from the file's first 8 bytes and `read_header(n)`, its next n bytes;
        CheckpointError for an empty file, a Git LFS pointer in place of the weights, a header the file cannot hold."""
        if size == 0 or (size is None and not raw):
            raise CheckpointError("weight file is empty (0 bytes): not a safetensors file", path=self.path)
        if len(raw) < 8:
            raise CheckpointError("safetensors file is truncated (no header)", path=self.path)
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > MAX_HEADER_BYTES or (size is not None and 8 + header_len > size):
            if raw == LFS_POINTER_START:
                raise CheckpointError(f"a Git LFS pointer file ({size} bytes), not the weights: fetch them (`git lfs "
                                      f"pull` in the clone, or download the model with huggingface_hub)",
                                      path=self.path)
            raise CheckpointError(f"safetensors header length {header_len} is invalid for a file of {size} bytes "
                                  f"(truncated or not a safetensors file)", path=self.path)
        data = read_header(header_len)
        if len(data) < header_len:
            raise CheckpointError(f"safetensors file is truncated: its header of {header_len} bytes ends after "
                                  f"{len(data)}", path=self.path)
        return header_len, json.loads(data.decode("utf-8"))

    def read(self, name: str, buffers: "ReadBuffers | None" = None) -> np.ndarray:
        """The tensor as a numpy array, read by positioned reads of READ_CHUNK_BYTES on the shared reading threads
        (no memory map stays resident): a fresh array, or one in the calling thread's buffer from `buffers`, valid
        until that thread's next read."""
        dtype, shape, begin, end = self.entries[name]
        raw = np.empty(end - begin, np.uint8) if buffers is None else buffers.take(end - begin)
        if raw.nbytes:
            read_into(self.path, memoryview(raw), self.data_start + begin, tensor=name)
        return raw.view(SAFETENSORS_DTYPES[dtype]).reshape(shape)


# Bytes one positioned read asks for, and how many such reads run at once (for every tensor being loaded): a file
# system without a page cache (a TPU host's 9p root) reads many times faster with many small reads in flight than
# with one large read per tensor (docs/performance.md).
READ_CHUNK_BYTES = 8 << 20
READ_THREADS = 32
_READING_THREADS = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="weights-read")  # threads start on demand


def _read_range(fd: int, view: memoryview, offset: int, path: str, tensor: str) -> None:
    """Fill `view` from the file at `offset`, across short reads; a file that ends first is a CheckpointError."""
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"cannot read weight file: {e}", path=path, tensor=tensor) from e
        if got == 0:
            raise CheckpointError("safetensors file ended before the tensor's data", path=path, tensor=tensor)
        done += got


def read_into(path: str, buffer: memoryview, offset: int, *, tensor: str = "") -> None:
    """Fill `buffer` (bytes) from `path` at `offset`: one read per READ_CHUNK_BYTES, run on the shared reading
    threads when there are several, so one large tensor is read by many threads at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"cannot read weight file: {e}", path=path, tensor=tensor) from e
    try:
        starts = range(0, len(buffer), READ_CHUNK_BYTES)
        if len(starts) == 1:
            _read_range(fd, buffer, offset, path, tensor)
            return
        reads = [_READING_THREADS.submit(_read_range, fd, buffer[s:s + READ_CHUNK_BYTES], offset + s, path, tensor)
                 for s in starts]
        for r in reads:  # every read ends (its error raised) before the file is closed
            r.exception()
        for r in reads:
            r.result()
    finally:
        os.close(fd)


# The largest buffer a loading thread keeps for its next tensor (larger tensors, such as a text encoder's token
# embedding, are read into their own). Host memory while loading: at most one such buffer per loading thread.
READ_BUFFER_MAX_BYTES = 512 << 20


class ReadBuffers:
    """One reusable host buffer per loading thread, which each tensor is read into once the device holds a copy of
    the thread's previous one: on a TPU host (gVisor) pages written for the first time are several times slower
    than reused ones (docs/performance.md)."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = READ_BUFFER_MAX_BYTES if max_bytes is None else max_bytes
        self._local = threading.local()

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` bytes of the calling thread's buffer (grown to fit), or fresh ones past `max_bytes`."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is not None and buffer.nbytes >= nbytes:
            return buffer[:nbytes]
        if nbytes > self.max_bytes:
            return np.empty(nbytes, np.uint8)
        self._local.buffer = None  # the smaller buffer's pages go back before the larger one's are taken
        self._local.buffer = np.empty(nbytes, np.uint8)
        return self._local.buffer

    def keep_unless_aliased(self, placed: jax.Array) -> None:
        """Give up the calling thread's buffer if `placed` may still use its memory (a CPU backend can place a host
        array without copying it); on accelerators the device holds its own copy once the transfer is done."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            return
        start, stop = buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes
        for shard in placed.addressable_shards:
            try:
                pointer = shard.data.unsafe_buffer_pointer()
            except Exception:  # noqa: BLE001 - a backend that cannot tell: assume it aliases
                pointer = start
            if start <= pointer < stop:
                self._local.buffer = None
                return


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
# placed array may be the host memory itself (which would pin a whole reused buffer).
DEVICE_LAYOUT_PLATFORMS = ("tpu", "gpu")


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


class DeviceTransposes:
    """Compiled transposes (torch layout -> JAX layout on the device), one per (axes order, stored shape, dtype,
    sharding) and process, compiled on their own threads as soon as the loader knows the shapes: a cold start
    compiles them before the generator's large programs take the compiler (placing waited for them behind those
    programs otherwise: docs/performance.md), a warm one reads them from the persistent compilation cache before the
    weights are read."""

    THREADS = 4

    def __init__(self):
        self._lock = threading.Lock()
        self._compiled: dict = {}  # key -> Future of the compiled transpose
        self._pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="transpose-compile")

    @staticmethod
    def key(order: tuple[int, ...], stored_shape: tuple[int, ...], dtype, sharding, scale_sharding=None) -> tuple:
        """`scale_sharding`: the transpose also quantizes to int8 (model.nets.quantize), its scale placed so."""
        return tuple(order), tuple(stored_shape), np.dtype(dtype).name, sharding, scale_sharding

    def prepare(self, key: tuple):
        """The future of the compiled transpose `key`, submitted for compiling if it is not already."""
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

    @staticmethod
    def _compile(order, stored_shape, dtype, sharding, scale_sharding):
        spec = jax.ShapeDtypeStruct(stored_shape, jnp.dtype(dtype), sharding=_permuted(sharding, order))
        if scale_sharding is None:
            transpose = jax.jit(functools.partial(jnp.transpose, axes=order), out_shardings=sharding)
        else:
            transpose = jax.jit(lambda w: quantize_columns(jnp.transpose(w, order)),
                                out_shardings=(sharding, scale_sharding))
        lowered = transpose.lower(spec)
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


def _is_count(value) -> bool:
    return is_integer(value) and value >= 0


class LocalFolder:
    """A component folder on this machine, as `open_component` reads it: its file names, a small file's bytes (the
    index), a weight file's parsed header. model.loading.checkpoint's `GcsFolder` answers the same for a gs://
    prefix."""

    def __init__(self, path: str):
        self.path = path

    def names(self) -> list[str] | None:
        """The folder's file names, sorted; None when there is no such folder."""
        return sorted(os.listdir(self.path)) if os.path.isdir(self.path) else None

    def path_of(self, name: str) -> str:
        return os.path.join(self.path, name)

    def has(self, name: str) -> bool:
        return os.path.isfile(self.path_of(name))

    def read_bytes(self, name: str) -> bytes:
        with open(self.path_of(name), "rb") as f:
            return f.read()

    def weights(self, name: str) -> SafetensorsFile:
        return SafetensorsFile(self.path_of(name))


def open_component(folder, variant: str | None = None) -> dict[str, SafetensorsFile]:
    """Map every tensor name of a component folder (e.g. `transformer/`) to the file holding it.

    Accepts one .safetensors file or shards listed by a `*.safetensors.index.json`, of the `variant` chosen by
    `select_weight_files` (other variants' files are ignored). Pickle weights are refused. `folder`: a local path,
    or an object that reads one as `LocalFolder` does (the launch's view of a gs:// prefix, headers only).
    """
    source = LocalFolder(folder) if isinstance(folder, str) else folder
    names = source.names()
    if names is None:
        raise CheckpointError("component folder is missing", path=source.path)
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    selected = select_weight_files(names, variant, source.path)
    indexes = [n for n in selected if n.endswith(".json")]
    singles = [n for n in selected if n.endswith(".safetensors")]
    if not singles and not indexes:
        if pickles:
            raise UnsafeWeightsError("only pickle weights found; this loader reads safetensors only (pickle files "
                                     "can execute code). Convert them with safetensors first",
                                     path=source.path_of(pickles[0]))
        raise CheckpointError("no .safetensors weights found", path=source.path)
    if pickles:
        logger.warning("ignoring pickle weight files %s in %s (safetensors are used)", pickles, source.path)
    files: dict[str, SafetensorsFile] = {}
    tensor_to_file: dict[str, SafetensorsFile] = {}
    if indexes:
        if len(indexes) > 1:
            raise CheckpointError(f"several safetensors index files: {indexes}", path=source.path)
        index_path = source.path_of(indexes[0])
        try:
            weight_map = json.loads(source.read_bytes(indexes[0]).decode("utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"unreadable safetensors index: {e}", path=index_path) from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError("the index's weight_map must map tensor names to shard file names",
                                  path=index_path)
        for tensor, shard in weight_map.items():
            shard_path = source.path_of(shard)
            if os.path.basename(shard) != shard:
                raise CheckpointError("shard name in index must be a plain file name", path=index_path, tensor=tensor)
            if shard not in files:
                if not source.has(shard):
                    raise CheckpointError("shard listed in the index is missing", path=shard_path, tensor=tensor)
                files[shard] = source.weights(shard)
            if tensor not in files[shard].entries:
                raise CheckpointError("index lists a tensor that its shard does not contain", path=shard_path,
                                      tensor=tensor)
            tensor_to_file[tensor] = files[shard]
        for shard, sf in files.items():
            for tensor in sf.entries:
                if weight_map.get(tensor) != shard:
                    raise CheckpointError("shard holds a tensor that the index does not list for it",
                                          path=sf.path, tensor=tensor)
        for n in singles:
            if n not in files:
                raise CheckpointError("safetensors file is not listed in the index", path=source.path_of(n))
    else:
        if len(singles) > 1:
            raise CheckpointError(f"several safetensors files but no index: {singles}", path=source.path)
        sf = source.weights(singles[0])
        tensor_to_file = dict.fromkeys(sf.entries, sf)
    return tensor_to_file


# --------------------------------------------------------------------------------------------- name / layout mapping


def flat_params(module_or_abstract) -> dict[str, jax.ShapeDtypeStruct]:
    """Checkpoint-style dotted names of every parameter of an NNX module (or abstract module), in JAX layout."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module_or_abstract, nnx.Param)):
        value = var.get_value() if hasattr(var, "get_value") else var.value
        out[".".join(str(p) for p in path)] = value
    return out


def jax_layout_order(name: str, ndim: int, target_ndim: int) -> tuple[int, ...] | None:
    """The axes order that takes a torch-layout tensor to JAX layout (None: same layout). Linear [out, in] ->
    [in, out]; Conv [O, I, kh, kw] -> [kh, kw, I, O]; embedding tables keep torch's [vocab, width]."""
    if name.endswith("embed_tokens.weight"):
        return None
    if ndim == 4 and target_ndim == 2:  # legacy 1x1-conv attention projections, squeezed first (`squeezed`)
        ndim = 2
    return {2: (1, 0), 4: (2, 3, 1, 0)}.get(ndim)


def squeezed(array: np.ndarray, target_ndim: int) -> np.ndarray:
    """A legacy 1x1-conv attention projection [O, I, 1, 1] as the [O, I] matrix its 2-D parameter is; else as is."""
    return array[:, :, 0, 0] if array.ndim == 4 and target_ndim == 2 else array


def to_jax_layout(name: str, array: np.ndarray, target_ndim: int) -> np.ndarray:
    """torch layout -> JAX layout on the host (a view): see `jax_layout_order`."""
    order = jax_layout_order(name, array.ndim, target_ndim)
    array = squeezed(array, target_ndim)
    return array if order is None else array.transpose(order)


def torch_shape(name: str, jax_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint (torch) shape of a parameter given its JAX shape; inverse of `to_jax_layout`."""
    if name.endswith("embed_tokens.weight"):
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


def validate_component(folder, *, expected: dict[str, tuple[int, ...]], optional: Iterable[str] = (),
                       variant: str | None = None):
    """Check a component folder against the names/shapes a complete checkpoint holds, reading headers only.

    Every name of `expected` must be present with its shape, except those in `optional`; any other name in the
    checkpoint is an error. `variant`: which weight files (see `select_weight_files`). `folder`: as `open_component`
    takes it. Returns {tensor name: file} for `load_component`.
    """
    tensor_to_file = open_component(folder, variant)
    where = folder if isinstance(folder, str) else folder.path
    optional = set(optional)
    unexpected = sorted(set(tensor_to_file) - set(expected))
    if unexpected:
        sf = tensor_to_file[unexpected[0]]
        raise CheckpointError(f"unexpected tensor in checkpoint ({len(unexpected)} in all: {unexpected[:5]})",
                              path=sf.path, tensor=unexpected[0])
    missing = sorted(set(expected) - set(tensor_to_file) - optional)
    if missing:
        raise CheckpointError(f"tensor missing from checkpoint ({len(missing)} in all: {missing[:5]})",
                              path=where, tensor=missing[0])
    for name, sf in tensor_to_file.items():
        dtype, shape, _, _ = sf.entries[name]
        if tuple(shape) != tuple(expected[name]) and not (len(expected[name]) == 2 and tuple(shape) == (
                *expected[name], 1, 1)):
            raise CheckpointError(f"shape mismatch: checkpoint has {list(shape)}, model expects "
                                  f"{list(expected[name])}", path=sf.path, tensor=name)
        if dtype not in FLOAT_DTYPES and not name.endswith("num_batches_tracked"):
            raise CheckpointError(f"weight has non-float dtype {dtype}", path=sf.path, tensor=name)
    return tensor_to_file


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


def prepare_device_transposes(components: list[ComponentLoad], placement) -> int:
    """Start compiling (on DEVICE_TRANSPOSES' threads) every transpose that loading `components` with `placement`
    will make on the device; returns how many the tensors need. Their tensor files must be known (validated)."""
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
            order = jax_layout_order(name, len(sf.entries[name][1]), len(target.shape))
            if order is not None and _platform(sharding) in DEVICE_LAYOUT_PLATFORMS:
                dtype, scale_sharding = _stored_dtype(var, target), _scale_sharding(path, variables, placement)
                needed.add(DEVICE_TRANSPOSES.key(order, torch_shape(name, target.shape), dtype, sharding,
                                                 scale_sharding))
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


def load_components(components: list[ComponentLoad], *, placement=None, times: LoadTimes | None = None,
                    should_stop=None) -> list:
    """`load_component` for several components at once, their tensors in one queue for the same loading threads:
    no thread waits for the last large tensors of one component before the next component's start.
    `should_stop()`: an exception to raise instead of reading the next tensor (e.g. a tokenizer that failed to load
    meanwhile), or None to go on."""
    jobs = []  # (component index, path, abstract variable)
    graphs = []
    resolved = []  # the components with their validated tensor files
    for index, c in enumerate(components):
        tensor_to_file = c.tensor_to_file
        if tensor_to_file is None:
            tensor_to_file = validate_component(c.folder, expected=c.expected, optional=c.optional)
        graphdef, abstract_state = nnx.split(c.abstract_module)
        flat = nnx.to_flat_state(abstract_state)
        # An int8 weight's scale is no checkpoint tensor: its weight's job fills it (model.nets.quantize).
        read = [(path, var) for path, var in flat if not isinstance(var, QuantScale)]
        for path, _ in read:
            name = ".".join(str(p) for p in path)
            if name not in tensor_to_file:
                raise CheckpointError("model parameter has no tensor in the checkpoint", path=c.folder, tensor=name)
        graphs.append((graphdef, flat, tensor_to_file, c.permutations or {}, dict(flat)))
        resolved.append(dataclasses.replace(c, tensor_to_file=tensor_to_file))
        jobs.extend((index, path, var) for path, var in read)

    default_sharding = SingleDeviceSharding(jax.devices()[0]) if placement is None else None
    buffers = ReadBuffers()
    # Every transpose the tensors need, compiled (or read from the compilation cache) on the transposes' threads
    # while the first tensors are read (a no-op for those a caller prepared already).
    prepare_device_transposes(resolved, placement or (lambda path, var: default_sharding))

    def place(job):
        index, path, var = job
        if should_stop is not None:
            stop = should_stop()
            if stop is not None:
                raise stop
        _, _, tensor_to_file, permutations, variables = graphs[index]
        name = ".".join(str(p) for p in path)
        target = var.get_value() if hasattr(var, "get_value") else var.value
        sf = tensor_to_file[name]
        sharding = placement(path, var) if placement is not None else default_sharding
        scale_sharding = None
        if is_quantized(var):
            scale_var = variables[scale_path(path)]
            scale_sharding = placement(scale_path(path), scale_var) if placement is not None else default_sharding
        accelerator = _platform(sharding) in DEVICE_LAYOUT_PLATFORMS
        clock = time.perf_counter()
        array = squeezed(sf.read(name, buffers if accelerator else None), len(target.shape))
        read_s, clock = time.perf_counter() - clock, time.perf_counter()
        order = jax_layout_order(name, array.ndim, len(target.shape))
        stored_shape = array.shape if order is None else tuple(array.shape[a] for a in order)
        if tuple(stored_shape) != tuple(target.shape):
            raise CheckpointError(f"converted shape {list(stored_shape)} differs from the model's "
                                  f"{list(target.shape)}", path=sf.path, tensor=name)
        if tuple(path) in permutations:  # along the JAX layout's `axis`, which is torch's axis order[axis]
            perm, axis = permutations[tuple(path)]
            array = np.take(array, perm, axis=axis if order is None else order[axis])
        array = array.astype(_stored_dtype(var, target), copy=False)
        on_device = order is not None and accelerator
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
            stored = jax.device_put(array, _permuted(sharding, order)).block_until_ready()
            transfer_s, clock = time.perf_counter() - clock, time.perf_counter()
            transpose = DEVICE_TRANSPOSES.get(DEVICE_TRANSPOSES.key(order, array.shape, array.dtype, sharding,
                                                                    scale_sharding))
            placed = jax.block_until_ready(transpose(stored))
        else:
            placed = jnp.asarray(array) if placement is None else jax.device_put(array, sharding)
            placed = placed.block_until_ready()
            transfer_s, clock = time.perf_counter() - clock, time.perf_counter()
            if scale_sharding is not None:  # int8 on the device that holds the float copy (model.nets.quantize)
                placed = jax.block_until_ready(_quantizer(sharding, scale_sharding)(placed))
        if accelerator:
            buffers.keep_unless_aliased(placed[0] if scale_sharding is not None else placed)
        if times is not None:
            times.add(array.nbytes, read_s=read_s, host_layout_s=host_s, transfer_s=transfer_s,
                      device_layout_s=time.perf_counter() - clock)
        if scale_sharding is None:
            return [((index, path), var.replace(placed))]
        values, scale = placed
        return [((index, path), var.replace(values)), ((index, scale_path(path)), scale_var.replace(scale))]

    # Tensors are read, laid out and sent to the devices by several threads at once: file reads, the layout copies
    # (as 16-bit integers for 2-byte floats, which numpy copies without the GIL) and host-to-device transfers overlap.
    # They are taken in the order they lie in the files, so the threads' reads move through each file together.
    def position(job):
        index, path, _ = job
        name = ".".join(str(p) for p in path)
        sf = graphs[index][2][name]
        return sf.path, sf.entries[name][2]

    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        placed = dict(leaf for leaves in pool.map(place, sorted(jobs, key=position)) for leaf in leaves)
    modules = []
    for index, (graphdef, flat, _, _, _) in enumerate(graphs):
        leaves = [(path, placed[(index, path)]) for path, _ in flat]
        modules.append(nnx.merge(graphdef, nnx.from_flat_state(leaves)))
    return modules
