"""The safetensors reader: a weight file's header parsed and checked, its tensors read by positioned reads, and a
component folder's tensors mapped to the files that hold them. JAX-free.

Safetensors files are parsed here directly (header + positioned reads) so that bfloat16 works without a framework and a
truncated shard is detected before any value is read. The loader (model/loading/loader.py) turns what is read here
into the model's parameters on the devices.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from ..contract import is_integer
from ..errors import CheckpointError, UnsafeWeightsError
from .weight_files import select_weight_files

if TYPE_CHECKING:
    import jax

logger = logging.getLogger(__name__)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Bytes per element of each dtype a header may name: what checking a header needs (ml_dtypes, for bfloat16's numpy
# type, is imported only where a tensor is read: `numpy_dtype`).
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
MAX_HEADER_BYTES = 100 * 1024 * 1024
# How a Git LFS pointer file starts ("version https://git-lfs.github.com/spec/v1"): a clone made without git-lfs
# holds these in place of the weights.
LFS_POINTER_START = b"version "


def numpy_dtype(name: str):
    """The numpy type of a safetensors dtype name (bfloat16: ml_dtypes')."""
    if name == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
            "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}[name]


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
        # Free-form strings (a LoRA's adapter config, for one: model.loading.lora).
        metadata = header.pop("__metadata__", None)
        self.metadata: dict = metadata if isinstance(metadata, dict) else {}
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
            nbytes = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dtype]
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
        return raw.view(numpy_dtype(dtype)).reshape(shape)


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
