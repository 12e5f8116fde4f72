"""WebDataset shards as img2dataset lays them out: names, keys, reproducible tar bytes, stats and sidecar rows.

    {output}/shards/{shard:05d}.tar            samples KEY.json, KEY.png (or .webp / .jpg), KEY.txt, in key order
    {output}/shards/{shard:05d}.parquet        every sample of the shard, failed ones included (status, error)
    {output}/shards/{shard:05d}_stats.json     count, successes, failures, duration: written LAST, the shard's
                                               completion marker (img2dataset's incremental mode reads it so)

Publication order (transforms/sinks/webdataset.py packs): the old marker is removed, then the tar is written, then
the sidecar, which names the tar's size and CRC32C (Parquet key-value metadata `tar_bytes`, `tar_crc32c`), then the
marker, which names both the tar's and the sidecar's size and CRC32C. `--skip_existing` keeps a shard only when
the objects now there are the ones its marker names (on gs:// the tar's CRC32C from its metadata, nothing
downloaded; locally the tar is hashed): a run stopped between any two of these writes leaves no marker, or one that
names other bytes, and the shard is packed again.

A sample's key is `shard * 10**ceil(log10(samples_per_shard)) + index`, zero-padded to 9 digits: digits only,
because WebDataset cuts a member name at its FIRST dot into key and extension. The tar bytes depend only on the
samples (fixed mtime, uid, gid, owner names; ustar headers; members sorted) and the umask (members get the mode the
umask allows, as the job's local files do: 0644 under umask 022, 0600 under 077), so a rerun over the same input
writes identical shards.

Pure functions only (no Beam); `write_file_atomic` is the one I/O helper, used by the shard packer.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import tarfile
from typing import Iterable

from . import identity, layout
from .atomic_files import umask, write_local_atomic, write_object_atomic
from .checksums import checksum_text

SHARDS_DIR = "shards"
DEFAULT_SAMPLES_PER_SHARD = 1000
KEY_DIGITS = 9
TAR_MTIME = 0  # every member's mtime: reproducible bytes (img2dataset and TarWriter take a fixed one too)
STATS_SUFFIX = "_stats.json"
SIDECAR_SUFFIX = ".parquet"
# KEY.json carries every manifest column; these two are not functions of the input, so the tar keeps them fixed:
# `uri` becomes the shard's path relative to the output, `generation_ms` null (the sidecar Parquet has the timing).
UNREPRODUCIBLE_FIELDS = ("uri", "generation_ms")


class ShardLayoutError(ValueError):
    """A shard number, index or samples-per-shard value outside what the layout can name."""

    def __init__(self, message: str, value):
        super().__init__(message)
        self.value = value


def check_samples_per_shard(samples_per_shard) -> int:
    if isinstance(samples_per_shard, bool) or not isinstance(samples_per_shard, int) or samples_per_shard < 1:
        raise ShardLayoutError(f"--samples_per_shard={samples_per_shard!r} is not an integer >= 1",
                               samples_per_shard)
    return samples_per_shard


def key_multiplier(samples_per_shard: int) -> int:
    """10**ceil(log10(samples_per_shard)), as img2dataset forms keys (1000 -> 1000, 1001 -> 10000, 1 -> 1)."""
    check_samples_per_shard(samples_per_shard)
    # Integer arithmetic: math.log10 of a large power of ten may round the wrong way.
    return 10 ** len(str(samples_per_shard - 1)) if samples_per_shard > 1 else 1


def shard_of(position: int, samples_per_shard: int) -> tuple[int, int]:
    """A sample's 0-based position in the job's input order -> (shard number, index inside the shard)."""
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ShardLayoutError(f"sample position {position!r} is not an integer >= 0", position)
    return divmod(position, check_samples_per_shard(samples_per_shard))


def sample_key(shard: int, index: int, samples_per_shard: int) -> str:
    """The sample's key: digits only, zero-padded to 9 (more digits only past 10**9 samples' worth of keys)."""
    if not 0 <= index < samples_per_shard:
        raise ShardLayoutError(f"index {index} is outside 0..{samples_per_shard - 1}", index)
    if shard < 0:
        raise ShardLayoutError(f"shard number {shard} is negative", shard)
    return f"{shard * key_multiplier(samples_per_shard) + index:0{KEY_DIGITS}d}"


def shard_name(shard: int) -> str:
    return f"{shard:05d}.tar"


def shard_relpath(shard: int) -> str:
    return f"{SHARDS_DIR}/{shard_name(shard)}"


def shard_path(output: str, shard: int) -> str:
    return layout.join(output, shard_relpath(shard))


def stats_path(output: str, shard: int) -> str:
    return layout.join(output, f"{SHARDS_DIR}/{shard:05d}{STATS_SUFFIX}")


def sidecar_path(output: str, shard: int) -> str:
    return layout.join(output, f"{SHARDS_DIR}/{shard:05d}{SIDECAR_SUFFIX}")


def stats_glob(output: str) -> str:
    return layout.join(output, f"{SHARDS_DIR}/*{STATS_SUFFIX}")


def shard_number_of_stats(path: str) -> int | None:
    """`.../00012_stats.json` -> 12; None for a name that is not a stats marker of this layout."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    stem = name[:-len(STATS_SUFFIX)] if name.endswith(STATS_SUFFIX) else ""
    return int(stem) if stem.isdigit() else None


# --------------------------------------------------------------------------------------------- samples
@dataclasses.dataclass(frozen=True)
class Sample:
    """One image of a shard: its key, encoded bytes with their extension, and its manifest row."""

    key: str
    extension: str  # png, webp or jpg
    data: bytes
    row: dict  # the manifest row (layout.manifest_row) plus `key`


def sample_json(row: dict, shard: int) -> dict:
    """KEY.json: every manifest column plus `key`, with the run-dependent columns fixed (UNREPRODUCIBLE_FIELDS)."""
    out = dict(row)
    out["uri"] = shard_relpath(shard)
    out["generation_ms"] = None
    return out


def sample_members(sample: Sample, shard: int) -> list[tuple[str, bytes]]:
    """A sample's tar members, sorted by name: KEY.json, KEY.<image extension>, KEY.txt (the prompt)."""
    members = {
        f"{sample.key}.json": (json.dumps(sample_json(sample.row, shard), ensure_ascii=False, sort_keys=True,
                                          allow_nan=False) + "\n").encode("utf-8"),
        f"{sample.key}.{sample.extension}": sample.data,
        f"{sample.key}.txt": sample.row["prompt"].encode("utf-8"),
    }
    return sorted(members.items())


def write_tar(fileobj, samples: Iterable[Sample], shard: int) -> int:
    """Stream `samples`, in increasing key order (one at a time, so a shard never has to fit in memory), as a
    reproducible ustar tar into `fileobj`; returns the number of samples. ShardLayoutError for keys out of order."""
    n = 0
    previous = None
    mode = 0o666 & ~umask()  # what `open` gives a file: a private umask keeps the extracted images private too
    with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            if previous is not None and sample.key <= previous:
                raise ShardLayoutError(f"shard {shard}: key {sample.key} follows {previous} (keys must increase)",
                                       sample.key)
            previous = sample.key
            n += 1
            for name, data in sample_members(sample, shard):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mtime = TAR_MTIME
                info.mode = mode
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.type = tarfile.REGTYPE
                tar.addfile(info, io.BytesIO(data))
    return n


def tar_bytes(samples: Iterable[Sample], shard: int) -> bytes:
    buf = io.BytesIO()
    write_tar(buf, sorted(samples, key=lambda s: s.key), shard)
    return buf.getvalue()


def shard_stats(shard: int, *, count: int, successes: int, failures: int, duration_s: float, start_time: float,
                end_time: float, failures_by_kind: dict | None = None, tar: "Digest | None" = None,
                sidecar: "Digest | None" = None) -> dict:
    """`{shard:05d}_stats.json`, with img2dataset's fields (count, successes, failed_to_generate, duration, ...),
    and the size and CRC32C of the tar and the sidecar it vouches for."""
    digests = {}
    if tar is not None:
        digests.update({TAR_BYTES: tar.size, TAR_CRC32C: tar.crc32c})
    if sidecar is not None:
        digests.update({SIDECAR_BYTES: sidecar.size, SIDECAR_CRC32C: sidecar.crc32c})
    return {
        **digests,
        "shard": shard,
        "tar": shard_name(shard),
        "count": int(count),
        "successes": int(successes),
        "failures": int(failures),
        "failed_to_generate": int(failures),
        "duration": round(float(duration_s), 3),
        "start_time": round(float(start_time), 3),
        "end_time": round(float(end_time), 3),
        "status_dict": {"success": int(successes), **{k: int(v) for k, v in sorted((failures_by_kind or {}).items())}},
    }


def is_complete(stats: dict, planned: int) -> bool:
    """Whether a shard whose marker says `stats` can be kept as it is by --skip_existing: every one of the
    `planned` samples it should hold is in its tar (a shard with failed images is generated again)."""
    return stats.get("failures") == 0 and stats.get("successes") == planned and stats.get("count") == planned


# --------------------------------------------------------------------------------------------- sidecar rows
# The image's identity record (transforms/identity.py) closes every row.
SIDECAR_COLUMNS = ("key", "status", "error_message", "id", "file_name", "uri", "prompt", "prompt_truncated", "seed",
                   "height", "width", "num_inference_steps", "guidance_scale", "model", "sha256", "bytes", "crc32c",
                   "generation_ms", "metadata", "source", "line", *identity.RECORDED_FIELDS, "phash")


def sidecar_schema():
    import pyarrow as pa

    types = {"key": "string", "status": "string", "error_message": "string", "id": "string", "file_name": "string",
             "uri": "string", "prompt": "string", "prompt_truncated": "bool_", "seed": "int64", "height": "int64",
             "width": "int64", "num_inference_steps": "int64", "guidance_scale": "float64", "model": "string",
             "sha256": "string", "bytes": "int64", "crc32c": "string", "generation_ms": "float64",
             "metadata": "string", "source": "string", "line": "int64", **identity.ARROW_TYPES, "phash": "string"}
    return pa.schema([(name, getattr(pa, types[name])()) for name in SIDECAR_COLUMNS])


def success_sidecar_row(row: dict) -> dict:
    """A manifest row (with `key`) as a sidecar row: status success; `metadata` as JSON text (a fixed schema)."""
    out = {name: row.get(name) for name in SIDECAR_COLUMNS}
    out["status"] = "success"
    out["error_message"] = None
    out["metadata"] = json.dumps(row.get("metadata") or {}, ensure_ascii=False, sort_keys=True)
    return out


def failed_sidecar_row(key: str, task, error: dict, model_identity=None) -> dict:
    """A failed image's sidecar row: what was asked for (its identity, transforms/identity.py, by the job's model
    `model_identity`), status failed and the error row's kind and reason."""
    r = task.request
    out = {name: None for name in SIDECAR_COLUMNS}
    out.update(key=key, status="failed", error_message=f"{error.get('kind')}: {error.get('reason')}", id=r.id,
               prompt=r.prompt, seed=task.seed, height=r.height, width=r.width,
               num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale,
               metadata=json.dumps(r.metadata_values(), ensure_ascii=False, sort_keys=True),
               source=layout.writable_text(r.source),
               line=r.line, **identity.ImageIdentity.of(task, model_identity).fields())
    return out


# What the sidecar (Parquet key-value metadata) and the marker record of the objects they vouch for.
TAR_BYTES, TAR_CRC32C = "tar_bytes", "tar_crc32c"
SIDECAR_BYTES, SIDECAR_CRC32C = "sidecar_bytes", "sidecar_crc32c"


@dataclasses.dataclass(frozen=True)
class Digest:
    """An object's size and CRC32C (base64, as GCS lists it)."""

    size: int
    crc32c: str


def sidecar_bytes(rows: list[dict], tar: Digest | None = None) -> bytes:
    """The sidecar Parquet of `rows`; with `tar`, naming the tar it describes (its size and CRC32C)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = sidecar_schema()
    if tar is not None:
        schema = schema.with_metadata({TAR_BYTES: str(tar.size), TAR_CRC32C: tar.crc32c})
    table = pa.Table.from_pylist(sorted(rows, key=lambda r: r["key"]), schema=schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def read_sidecar(data: bytes) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(io.BytesIO(data)).to_pylist()


def sidecar_tar(data: bytes) -> Digest | None:
    """The tar a sidecar names (None: a sidecar written before it named one)."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(io.BytesIO(data)).metadata or {}
    size, crc = meta.get(TAR_BYTES.encode()), meta.get(TAR_CRC32C.encode())
    if size is None or crc is None:
        return None
    return Digest(int(size), crc.decode("ascii"))


def marker_digests(stats: dict) -> tuple[Digest, Digest] | None:
    """(tar, sidecar) as a marker names them (None: a marker written before it named them)."""
    try:
        return (Digest(int(stats[TAR_BYTES]), str(stats[TAR_CRC32C])),
                Digest(int(stats[SIDECAR_BYTES]), str(stats[SIDECAR_CRC32C])))
    except (KeyError, TypeError, ValueError):
        return None


class DigestingWriter:
    """A binary writer that passes bytes on to `out` and keeps their size and CRC32C (for a tar being spooled)."""

    def __init__(self, out):
        import google_crc32c

        self._out = out
        self._crc = google_crc32c.Checksum()
        self.size = 0

    def write(self, data) -> int:
        data = bytes(data)
        self._crc.update(data)
        self.size += len(data)
        return self._out.write(data)

    def digest(self) -> Digest:
        return Digest(self.size, checksum_text(self._crc))


def sidecar_row_matches(row: dict, task, model_identity) -> bool:
    """Whether a success sidecar row is the sample `task` asks for, made by the model of `model_identity`
    (transforms/identity.py; a bare model fingerprint will do): the decisive fields of their identity records
    agree. A row of a run before fingerprints (none recorded) is compared field by field (id, prompt, seed, size;
    steps and guidance where the request sets them), its model taken on trust."""
    if row.get("request_fingerprint"):
        mine = identity.ImageIdentity.of(task, model_identity).fields()
        return all(row.get(name) == mine[name] for name in identity.DECISIVE_FIELDS)
    r = task.request
    expected = {"id": r.id, "prompt": r.prompt, "seed": task.seed, "height": r.height, "width": r.width}
    if r.num_inference_steps is not None:
        expected["num_inference_steps"] = r.num_inference_steps
    if r.guidance_scale is not None:
        expected["guidance_scale"] = float(r.guidance_scale)
    return all(row.get(k) == v for k, v in expected.items())


# --------------------------------------------------------------------------------------------- I/O
def write_file_atomic(path: str, source_path: str, mime_type: str, chunk: int = 8 << 20) -> None:
    """Copy the local file `source_path` to `path` so that no reader ever sees part of it: a local path gets a
    temporary name in its folder then an atomic rename; an object store one upload, which becomes visible only
    when complete (on failure the upload is abandoned, never finalised with part of the bytes)."""
    if layout.is_local_path(path):
        with open(source_path, "rb") as src:
            write_local_atomic(path, lambda out: shutil.copyfileobj(src, out, chunk))
        return
    with open(source_path, "rb") as src:
        write_object_atomic(path, lambda out: shutil.copyfileobj(src, out, chunk), mime_type)
