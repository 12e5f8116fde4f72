"""Find the diffusers-layout checkpoint folder: a local folder as-is, or a `gs://` copy in a local cache.

A `gs://bucket/prefix` checkpoint is copied once per machine into
`<cache>/checkpoints/<sha256 of the uri>/<fingerprint>/`, `<cache>` being the project's cache folder
(model/loading/cache_paths.py: `$FLUX2_KLEIN_CACHE`, else `$XDG_CACHE_HOME/flux2-klein-beam`, else
`~/.cache/flux2-klein-beam`); `cache_dir` replaces `<cache>/checkpoints`. A Hugging Face Hub id (`owner/name`) is
resolved by model/loading/hub.py. The fingerprint hashes the object listing
(names, sizes, checksums, generations), so a checkpoint re-uploaded under the same URI gets a fresh copy instead of a
stale one.

- Objects are fetched by google-cloud-storage's transfer_manager (`download_chunks_concurrently`): 32 MiB byte ranges,
  16 requests in flight, each range's crc32c computed as it is written and combined into the object's, which must be
  the crc32c GCS lists for it (no second read); a mismatch or a short read raises CheckpointError naming the object,
  and nothing of the copy is kept.
- An object stored with `Content-Encoding: gzip` (`gsutil cp -Z` / `-z json`, `gcloud storage cp --gzip-local-all`)
  is copied as stored, verified, then decompressed: the cache holds the file that was uploaded.
- Pickle weight files (.bin/.pt/.pth/.ckpt) are refused while listing, before anything is copied; of default and
  variant weight files side by side (`model.fp16.safetensors`), only the chosen set is copied.
- Concurrent processes (Beam SDK workers on one VM) coordinate through a file lock: one copies into a temporary
  folder, verifies, then renames it into place atomically; the others wait and reuse the finished copy.
- Copies of the same URI superseded by a re-upload are deleted once unused for `SUPERSEDED_COPY_AGE_S` (a use
  touches a copy's marker; the delay spares a process still loading a copy it resolved just before the re-upload),
  as are the leftovers of copies cut short that long ago; one being copied (its lock held) is left alone.

Uses google-cloud-storage, which honours `STORAGE_EMULATOR_HOST` (tests run against a local emulator).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import glob
import gzip
import hashlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
import time
import zlib

from ..storage import gcs
from ..storage.gcs import split as split_gs_uri
from ..storage.transfers import SLICE_BYTES, SLICE_THREADS, download_object, read_range
from .cache_paths import cache_root
from ..config.configs import PipelineConfig
from ..errors import CheckpointError, ConfigError, UnsafeWeightsError
from .weight_files import select_weight_files, weight_file_variant

logger = logging.getLogger(__name__)

UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
COMPLETE_MARKER = ".flux2-complete.json"
_DOWNLOAD_THREADS = 4   # objects copied at once
_SLICE_THREADS = SLICE_THREADS  # byte-range requests in flight, shared by those objects
_SLICE = SLICE_BYTES  # one range request
_CHUNK = 8 * 1024 * 1024
GZIP_HEAD_CHUNK = 256 * 1024  # stored bytes read at a time for the header of a gzip-encoded weight file
SUPERSEDED_COPY_AGE_S = 3600.0
PARTIAL_PREFIX = ".partial-"  # a copy in progress: PARTIAL_PREFIX + fingerprint + "-" + random, renamed when complete
_copies_made = 0  # gs:// checkpoints this process copied (not reused from the cache); see copies_made()


def copies_made() -> int:
    """How many gs:// checkpoints this process has copied into the cache (reuses do not count)."""
    return _copies_made


def default_cache_root() -> str:
    """Where gs:// checkpoints are copied when no `cache_dir` is given: `checkpoints/` in the project's cache."""
    return os.path.join(cache_root(), "checkpoints")


def resolve_checkpoint(uri: str, cache_dir: str | None = None, variant: str | None = None, *, hub_files=None) -> str:
    """The local folder holding the checkpoint at `uri` (a local folder, `gs://bucket/prefix`, or a Hugging Face
    Hub id `owner/name[@revision]`, model/loading/hub.py). From GCS and the Hub only the weight files of `variant` are
    fetched (see `model.loading.weight_files.select_weight_files`); `cache_dir` applies to gs:// copies. `hub_files`:
    which files of a Hub repository (`resolve_hub`'s `files`; default: a diffusers layout's)."""
    if not isinstance(uri, str) or not uri:
        raise CheckpointError("checkpoint location must be a non-empty string", path=repr(uri))
    if uri.startswith("gs://"):
        return _resolve_gcs(uri, cache_dir, variant)
    if "://" in uri:
        raise CheckpointError("unsupported checkpoint location: use a local folder, a gs:// URI or a Hugging Face "
                              "Hub id (owner/name)", path=uri)
    from .hub import is_hub_id, resolve_hub  # an existing local path is never a Hub id

    if is_hub_id(uri):
        return resolve_hub(uri, variant, files=hub_files).path
    if not os.path.exists(uri):
        raise CheckpointError("checkpoint folder does not exist", path=uri)
    if not os.path.isdir(uri):
        raise CheckpointError("checkpoint location is not a folder", path=uri)
    return uri


# The JSON files that PipelineConfig reads, relative to the checkpoint root.
CONFIG_FILES = ("model_index.json", "transformer/config.json", "text_encoder/config.json", "vae/config.json",
                "scheduler/scheduler_config.json")


def read_config(uri: str, variant: str | None = None) -> PipelineConfig:
    """The checkpoint's configs alone, local or gs:// (no weight is read or copied; each config object is checked
    against its GCS checksums): what a launcher needs to check requests before any worker starts."""
    if not (isinstance(uri, str) and uri.startswith("gs://")):
        return PipelineConfig.from_folder(resolve_checkpoint(uri, variant=variant))
    return read_config_and_digest(uri, variant)[0]


def read_config_and_digest(uri: str, variant: str | None = None, *, check_weights: bool = False,
                           configs_only: bool = False) -> tuple[PipelineConfig, str]:
    """`read_config`, and the checkpoint's content digest (`checkpoint_digest`) from the same listing and config
    reads: the launcher learns both at once. On gs:// no weight is read (GCS lists each object's crc32c); a local
    folder's files are read once per machine (model/loading/content_ids.py caches their crc32c). `check_weights`: also
    check every weight file the loader would read (`check_weight_files`) from its size and header alone: CheckpointError
    naming the first that is missing, is no safetensors file, is cut short or lacks a tensor of the model.
    `configs_only`: the local folder holds a checkpoint's JSON files without its weights (a Flex Template launcher):
    its digest is the whole checkpoint's when the build recorded every file's crc32c there (RECORD_FILE), else that
    of what the folder holds (the weights do not count)."""
    if not (isinstance(uri, str) and uri.startswith("gs://")):
        folder = resolve_checkpoint(uri, variant=variant)
        config = PipelineConfig.from_folder(folder)
        if check_weights:
            check_weight_files(config, lambda name: os.path.join(folder, name), variant)
        recorded = _recorded_contents(folder, variant) if configs_only else None
        return config, checkpoint_digest(recorded or _local_contents(folder, variant), folder)
    uri = uri.rstrip("/")
    bucket, prefix = split_gs_uri(uri)
    blobs = {_relative(b.name, prefix): b for b in _list_objects(gcs.client(), uri, variant)}
    with tempfile.TemporaryDirectory(prefix="flux2-configs-") as tmp:
        for rel in CONFIG_FILES:
            if rel in blobs:  # a missing one is named by PipelineConfig below
                _download_one(blobs[rel], os.path.join(tmp, rel), f"{uri}/{rel}")
        try:
            config = PipelineConfig.from_folder(tmp)
        except ConfigError as e:
            raise ConfigError(str(e).replace(tmp, uri)) from None
        if check_weights:
            check_weight_files(config, lambda name: GcsFolder(f"{uri}/{name}", {
                rel[len(name) + 1:]: b for rel, b in blobs.items()
                if rel.startswith(name + "/") and "/" not in rel[len(name) + 1:]}, os.path.join(tmp, name)), variant)
        return config, checkpoint_digest({rel: (int(b.size or 0), _content_id(b)) for rel, b in blobs.items()}, tmp)


def check_weight_files(config: PipelineConfig, folder_of, variant: str | None = None) -> None:
    """Check the weight files of each component folder the loader reads (`folder_of(name)`: a local path or a
    `GcsFolder`) as the loader does before reading any weight (`validate_component`, with the tensors the config
    says a complete checkpoint holds: model/loading/stored_tensors.py), from headers and sizes only; CheckpointError
    naming the file otherwise. JAX-free."""
    from .stored_tensors import COMPONENT_FOLDERS, stored_tensors, validate_component

    stored = stored_tensors(config)
    for name in COMPONENT_FOLDERS:
        expected, optional = stored[name]
        validate_component(folder_of(name), expected=expected, optional=optional, variant=variant)


class GcsFolder:
    """A component folder under a gs:// prefix, as safetensors_file.open_component reads one (see LocalFolder there),
    from the listing's objects {name: blob}: of a weight file only its first 8 bytes and its header are read, by
    ranged reads, its size is the listing's; the index is read whole (into `scratch`, checked against its
    checksums). Nothing is copied into the checkpoint cache."""

    def __init__(self, uri: str, blobs: dict, scratch: str):
        self.path = uri
        self._blobs = blobs
        self._scratch = scratch

    def names(self) -> list[str] | None:
        return sorted(self._blobs) or None

    def path_of(self, name: str) -> str:
        return f"{self.path}/{name}"

    def has(self, name: str) -> bool:
        return name in self._blobs

    def read_bytes(self, name: str) -> bytes:
        dest = os.path.join(self._scratch, name)
        _download_one(self._blobs[name], dest, self.path_of(name))
        with open(dest, "rb") as f:
            return f.read()

    def weights(self, name: str):
        from .safetensors_file import SafetensorsFile

        blob, uri = self._blobs[name], self.path_of(name)
        if (blob.content_encoding or "").strip().lower() == "gzip":  # its stored size is not the file's
            return SafetensorsFile(uri, size=None, read_range=_GzipPrefix(blob, uri).read)
        return SafetensorsFile(uri, size=int(blob.size or 0),
                               read_range=lambda offset, length: read_range(blob, offset, length, uri))


class _GzipPrefix:
    """The first bytes of a gs:// object stored with `Content-Encoding: gzip`, as uploaded: its stored bytes are
    read from the start, GZIP_HEAD_CHUNK at a time, and decompressed as far as a read needs."""

    def __init__(self, blob, object_uri: str):
        self._blob, self._uri = blob, object_uri
        self._inflate = zlib.decompressobj(wbits=31)
        self._data, self._stored = b"", 0

    def read(self, offset: int, length: int) -> bytes:
        while len(self._data) < offset + length and self._stored < int(self._blob.size or 0):
            raw = read_range(self._blob, self._stored, GZIP_HEAD_CHUNK, self._uri)
            self._stored += len(raw)
            try:
                self._data += self._inflate.decompress(raw)
            except zlib.error as e:
                raise CheckpointError(f"object is stored with Content-Encoding gzip but is not valid gzip data: {e}",
                                      path=self._uri) from e
            if not raw:
                break
        return self._data[offset:offset + length]


def _local_listing(folder: str, variant: str | None) -> dict[str, int]:
    """{path relative to `folder`: size} of a local checkpoint's files, other variants' weights and hidden files
    (this project's markers, partial copies) left out, as `_list_objects` leaves them out of a GCS listing."""
    listing = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        visible = [f for f in files if not f.startswith(".") and not f.lower().endswith(UNSAFE_SUFFIXES)]
        for name in _of_variant(visible, variant, root):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            listing[rel] = os.path.getsize(os.path.join(root, name))
    return listing


def _local_contents(folder: str, variant: str | None) -> dict[str, tuple[int, str]]:
    """{relative path: (size, crc32c)} of `_local_listing`'s files (their crc32c read once, then cached)."""
    from .content_ids import file_crc32c

    listing = _local_listing(folder, variant)
    paths = {rel: os.path.join(folder, *rel.split("/")) for rel in listing if rel not in CONFIG_FILES}
    crcs = file_crc32c(list(paths.values()))
    return {rel: (size, crcs.get(paths.get(rel), "")) for rel, size in listing.items()}


def _recorded_contents(folder: str, variant: str | None) -> dict[str, tuple[int, str]] | None:
    """What a build recorded of the whole checkpoint beside its configs (model.loading.content_ids.RECORD_FILE:
    {relative path: [size, crc32c]}), narrowed to the files a load of `variant` reads; None without a record."""
    from .content_ids import RECORD_FILE

    try:
        with open(os.path.join(folder, RECORD_FILE), "rb") as f:
            recorded = json.loads(f.read())
        entries = {str(rel): (int(size), str(crc)) for rel, (size, crc) in recorded.items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"the record of the checkpoint's files cannot be read: {e}",
                              path=os.path.join(folder, RECORD_FILE)) from e
    kept = {}
    by_folder: dict[str, list[str]] = {}
    for rel in entries:
        parts = rel.split("/")
        if rel.lower().endswith(UNSAFE_SUFFIXES) or any(p.startswith(".") for p in parts):
            continue
        by_folder.setdefault(posixpath.dirname(rel), []).append(parts[-1])
    for top, names in by_folder.items():
        for name in _of_variant(names, variant, os.path.join(folder, top)):
            rel = posixpath.join(top, name) if top else name
            kept[rel] = entries[rel]
    return kept


def _content_id(blob) -> str:
    """What GCS lists of an object's bytes: its crc32c (every object has one), else its md5, else its generation."""
    if blob.crc32c:
        return str(blob.crc32c)
    return f"md5:{blob.md5_hash}" if blob.md5_hash else f"generation:{blob.generation}"


def checkpoint_digest(listing: dict[str, tuple[int, str]], config_folder: str) -> str:
    """sha256 (hex) of what a checkpoint holds: the bytes of its config files (CONFIG_FILES, read from
    `config_folder`) and the name, size and crc32c of every other file in `listing` ({relative path: (size,
    crc32c)}: weights and their index, tokenizer files): any changed tensor changes it. Where the checkpoint lives
    does not count (a local file's crc32c is the one GCS lists for its upload)."""
    configs = {}
    for rel in CONFIG_FILES:
        path = os.path.join(config_folder, *rel.split("/"))
        if os.path.exists(path):
            with open(path, "rb") as f:
                configs[rel] = hashlib.sha256(f.read()).hexdigest()
    files = sorted((rel, int(size), str(crc)) for rel, (size, crc) in listing.items() if rel not in CONFIG_FILES)
    return hashlib.sha256(json.dumps({"configs": configs, "files": files}, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------- GCS
def _list_objects(client, uri: str, variant: str | None = None) -> list:
    bucket, prefix = split_gs_uri(uri)
    list_prefix = prefix + "/" if prefix else ""
    try:
        blobs = [b for b in client.list_blobs(bucket, prefix=list_prefix) if not b.name.endswith("/")]
    except Exception as e:
        raise CheckpointError(f"cannot list the checkpoint objects: {type(e).__name__}: {e}", path=uri) from e
    if not blobs:
        raise CheckpointError("no objects under this checkpoint prefix", path=uri)
    # Pickle weights are never downloaded: next to safetensors in the same folder they are skipped (as the local
    # loader ignores them), alone they are refused.
    folders_with_safetensors = {b.name.rsplit("/", 1)[0] for b in blobs if ".safetensors" in b.name.lower()}
    kept = []
    for blob in blobs:
        if blob.name.lower().endswith(UNSAFE_SUFFIXES):
            if blob.name.rsplit("/", 1)[0] not in folders_with_safetensors:
                raise UnsafeWeightsError(
                    "pickle-based weight file refused (only safetensors are loaded); remove it from the checkpoint",
                    path=f"gs://{bucket}/{blob.name}")
            logger.warning("not downloading pickle weight file gs://%s/%s (the safetensors next to it are used)",
                           bucket, blob.name)
            continue
        kept.append(blob)
    return _weights_of_variant(kept, variant, bucket)


def _weights_of_variant(blobs: list, variant: str | None, bucket: str) -> list:
    """The blobs without the weight files of other variants, folder by folder (a checkpoint may hold, say, float32
    weights and `fp16` variant copies side by side: only one set is downloaded)."""
    by_folder: dict[str, list] = {}
    for blob in blobs:
        folder, name = posixpath.split(blob.name)
        by_folder.setdefault(folder, []).append((blob, name))
    kept = []
    for folder, entries in by_folder.items():
        names = set(_of_variant([n for _, n in entries], variant, f"gs://{bucket}/{folder}"))
        kept += [b for b, n in entries if n in names]
    return kept


def _of_variant(names: list[str], variant: str | None, where: str) -> list[str]:
    """The names of one folder's files without the weight files of other variants (`select_weight_files` picks the
    weights; every file that is no variant's weights is kept): what the local, recorded and gs:// listings keep."""
    chosen = set(select_weight_files(names, variant, where))
    return [n for n in names if n in chosen or weight_file_variant(n) is None]


def _relative(blob_name: str, prefix: str) -> str:
    rel = blob_name[len(prefix) + 1:] if prefix else blob_name
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError("object name cannot be mapped to a local file", path=blob_name)
    return rel


def _fingerprint(uri: str, blobs: list) -> str:
    listing = sorted((b.name, b.size, b.crc32c, b.md5_hash, b.generation) for b in blobs)
    return hashlib.sha256(json.dumps([uri, listing], default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: str, wait: bool = True):
    """Hold the exclusive lock `path` (created if needed); `wait=False` raises BlockingIOError when it is held."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "a+")
    except OSError as e:
        raise CheckpointError(f"the checkpoint cache folder cannot be used: {e}", path=os.path.dirname(path)) from e
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _download_one(blob, dest: str, object_uri: str, threads: int = _SLICE_THREADS) -> int:
    """Copy one object to `dest` as stored, checked against its listed crc32c (model/storage/transfers.py:
    `_SLICE`-byte ranges on `threads` threads), then decompress a gzip-encoded one. CheckpointError naming the
    object for a short read, a size or checksum mismatch (the caller removes the partial copy). Returns the size of
    the file written."""
    gzip_encoded = (blob.content_encoding or "").strip().lower() == "gzip"  # a download resets it: read it first
    download_object(blob, dest, object_uri, threads=threads, chunk_size=_SLICE)
    if gzip_encoded:
        _gunzip_in_place(dest, object_uri)
    return os.path.getsize(dest)


def _gunzip_in_place(path: str, object_uri: str) -> None:
    """Replace the verified gzip bytes of a `Content-Encoding: gzip` object by the data they encode."""
    unpacked = path + ".gunzip"
    try:
        with gzip.open(path, "rb") as src, open(unpacked, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
    except (OSError, EOFError, zlib.error) as e:  # the partial copy's folder is removed by the caller
        raise CheckpointError(f"object is stored with Content-Encoding gzip but is not valid gzip data: {e}",
                              path=object_uri) from e
    os.replace(unpacked, path)


def _resolve_gcs(uri: str, cache_dir: str | None, variant: str | None = None) -> str:
    uri = uri.rstrip("/")
    bucket, prefix = split_gs_uri(uri)
    client = gcs.client()
    blobs = _list_objects(client, uri, variant)
    rels = {b.name: _relative(b.name, prefix) for b in blobs}

    root = os.path.join(cache_dir or default_cache_root(), hashlib.sha256(uri.encode()).hexdigest()[:32])
    fingerprint = _fingerprint(uri, blobs)
    final = os.path.join(root, fingerprint)
    if not os.path.isfile(os.path.join(final, COMPLETE_MARKER)):
        _copy_once(uri, bucket, blobs, rels, root, fingerprint)
    _mark_used(final)
    _delete_superseded_copies(root, keep=fingerprint)
    return final


def _copy_once(uri: str, bucket: str, blobs: list, rels: dict, root: str, fingerprint: str) -> None:
    """Copy the objects into `root/fingerprint` unless another process has (under the fingerprint's lock)."""
    final = os.path.join(root, fingerprint)
    with _file_lock(final + ".lock"):
        if os.path.isfile(os.path.join(final, COMPLETE_MARKER)):
            return  # another process finished the copy while we waited
        if os.path.exists(final):  # a folder without the marker is not ours to trust: copy again
            shutil.rmtree(final, ignore_errors=True)
        # Copies of this fingerprint left by a process that died mid-copy (killed: no cleanup ran); with the lock
        # held nobody else is copying it, so they are all stale.
        partial = f"{PARTIAL_PREFIX}{fingerprint}-"
        for stale in glob.glob(os.path.join(root, partial + "*")):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=partial, dir=root)
        try:
            start = time.monotonic()
            at_once = max(1, min(_DOWNLOAD_THREADS, len(blobs)))
            threads = max(1, _SLICE_THREADS // at_once)  # the range requests in flight, shared by those objects
            with concurrent.futures.ThreadPoolExecutor(max_workers=at_once) as pool:
                futures = [pool.submit(_download_one, b, os.path.join(tmp, *rels[b.name].split("/")),
                                       f"gs://{bucket}/{b.name}", threads)
                           for b in sorted(blobs, key=lambda b: -int(b.size or 0))]  # the largest first
                total = 0
                for fut in concurrent.futures.as_completed(futures):
                    total += fut.result()
            with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
                json.dump({"uri": uri, "objects": len(blobs), "bytes": total,
                           "copied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
            os.rename(tmp, final)
            global _copies_made
            _copies_made += 1
            logger.info("copied checkpoint %s (%d objects, %.1f MB) to %s in %.1f s", uri, len(blobs), total / 1e6,
                        final, time.monotonic() - start)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _mark_used(final: str) -> None:
    """Record a use of the copy (its marker's mtime), which keeps it from being deleted as superseded for a while."""
    try:
        os.utime(os.path.join(final, COMPLETE_MARKER))
    except OSError:  # a read-only cache: nothing is deleted from it either
        pass


def _delete_superseded_copies(root: str, keep: str) -> None:
    """Delete the other copies (and cut-short leftovers) of this URI unused for SUPERSEDED_COPY_AGE_S, each under
    its fingerprint's lock taken without waiting (a copy in progress holds it: left alone)."""
    cutoff = time.time() - SUPERSEDED_COPY_AGE_S
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if name.endswith(".lock"):
            continue
        path = os.path.join(root, name)
        fingerprint = name[len(PARTIAL_PREFIX):].split("-", 1)[0] if name.startswith(PARTIAL_PREFIX) else name
        if fingerprint == keep or not os.path.isdir(path):
            continue
        marker = os.path.join(path, COMPLETE_MARKER)
        try:
            last_use = os.path.getmtime(marker if os.path.exists(marker) else path)
        except OSError:
            continue
        if last_use > cutoff:
            continue
        try:
            with _file_lock(os.path.join(root, fingerprint + ".lock"), wait=False):
                shutil.rmtree(path, ignore_errors=True)
        except (BlockingIOError, CheckpointError):  # being copied, or the lock cannot be made: left alone
            continue
        logger.info("deleted superseded checkpoint copy %s (unused for over %.0f s)", path, SUPERSEDED_COPY_AGE_S)
