"""Reference images of image-conditioned requests: where they are, reading them with bounds, a per-process cache.

A record's `reference_images` lists paths: `gs://` URIs or local paths, relative ones resolved against the folder of
the input file that holds the record (`resolve_path`). Each reference is read with bounded size before decoding
(`read_reference`): at most `ReferenceLimits.max_bytes` bytes are read, and the width x height its header declares
is checked against `--max_reference_pixels` before any pixel is decoded, so a decompression bomb (a small file
declaring huge dimensions) is a `ReferenceError`, never an out-of-memory. A side under 64 px or an aspect above 8
(diffusers' own checks, `model.check_reference_size`) is one too. Decoded as `diffusers.utils.load_image` does:
EXIF orientation applied, then RGB.

`ReferenceCache` holds decoded references per worker process, bounded by their pixel bytes and least recently used
first out, keyed by URI: many requests sharing a reference read it once.

Where references may be read from is an allowlist (`--reference_root`, `check_allowed`): a resolved reference must
lie inside one of the job's roots (local folders or gs:// prefixes; by default the folders of the `--input`
patterns), after `..` is resolved and, for local files, after symlinks are followed; any other is an error row. The request remembers each reference's
sha256 when the job first reads it; a later read whose bytes differ (the file was replaced during the job) is an
error, not a silent mix of two versions.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import logging
import os
import posixpath
import threading
import time
from typing import Any, Callable, Sequence

import apache_beam as beam
import cachetools
from apache_beam.metrics import Metrics

from model import (DEFAULT_MAX_REFERENCE_IMAGES, DEFAULT_MAX_REFERENCE_PIXELS, DEFAULT_SIZE_MULTIPLE,  # JAX-free
                   ReferenceImageError, check_reference_size, reference_signature as model_reference_signature)

from . import layout, retries
from .bounded_reads import NotARegularFile, ReadTimeout, open_timed
from .defaults import DEFAULT_READ_TIMEOUT_S
from .metrics import NAMESPACE as METRICS_NAMESPACE

LOGGER = logging.getLogger(__name__)

FIELD = "reference_images"
# Bytes a reference file may take beyond 4 bytes per pixel (RGBA, uncompressed: no image format is larger than
# that by more than its headers and metadata: 1 MiB leaves room for EXIF, XMP and an ICC profile).
_BYTES_SLACK = 2**20
# Decoded references one worker process keeps (RGB bytes): a few dozen 1-4 MP photos.
DEFAULT_CACHE_BYTES = 512 * 2**20


class ReferenceError(ValueError):
    """A reference that cannot be used: missing, unreadable, not an image, too large, too small, too elongated, or
    replaced during the job. `uri` is the reference, `reason` why (the message names both)."""

    def __init__(self, uri: str, reason: str, *, transient: bool = False):
        super().__init__(f"reference image {uri!r} {reason}")
        self.uri = uri
        self.reason = reason
        self.field = FIELD
        self.value = uri
        self.transient = transient  # a read that failed for a reason that may pass (never cached)


@dataclasses.dataclass(frozen=True)
class ReferenceLimits:
    """--max_reference_images and --max_reference_pixels; the byte limit of a file follows from the pixels.
    `cache_scope` names one job run: the process cache reuses a reference only within its scope, so a second job
    in the same process (a local runner, a test) reads files again rather than trusting an older copy."""

    max_images: int = DEFAULT_MAX_REFERENCE_IMAGES
    max_pixels: int = DEFAULT_MAX_REFERENCE_PIXELS
    cache_scope: str = ""
    # --reference_root: the folders / gs:// prefixes references may be read from (normalised, `normalise_root`);
    # () allows none; None allows any path (library use only: the job always sets them).
    roots: tuple[str, ...] | None = None
    # --read_timeout_s: a reference's whole read (open, bytes, retries) ends within it; None: no limit.
    read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S

    @property
    def max_bytes(self) -> int:
        return 4 * self.max_pixels + _BYTES_SLACK


@dataclasses.dataclass(frozen=True, eq=False)
class Reference:
    """One decoded reference: its URI, the sha256 of its file, and the image (PIL, RGB, loaded)."""

    uri: str
    sha256: str
    image: Any  # PIL.Image.Image, mode RGB

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) as decoded (EXIF orientation applied)."""
        return self.image.size


# --------------------------------------------------------------------------------------------- paths
def resolve_path(path: str, source: str) -> str:
    """A record's reference path as the URI the job reads: gs:// and absolute local paths as given (normalised);
    a relative path against the folder of `source`, the input file holding the record. ValueError for another
    scheme, a relative path in a record that comes from no file (a BigQuery row), or a path no file can have: a NUL
    character, or text without a UTF-8 form (a lone surrogate, which JSON can spell; neither GCS nor the manifest
    could name it)."""
    path = path.strip()
    if not path:
        raise ValueError("an empty path")
    if "\x00" in path:
        raise ValueError(f"{path!r} contains a NUL character, which no file name can hold")
    if not layout.utf8_encodable(path):
        raise ValueError(f"{path!r} is not valid Unicode text (a lone surrogate): no file "
                         f"name the job can read or record")
    if "://" in path:
        scheme, rest = path.split("://", 1)
        if scheme != "gs":
            raise ValueError(f"{path!r}: only gs:// and local paths are read")
        bucket, _, name = rest.partition("/")
        if not bucket or not name:
            raise ValueError(f"{path!r} names no object")
        return f"gs://{bucket}/{posixpath.normpath(name)}"
    if os.path.isabs(path):
        return os.path.normpath(path)
    if source.startswith("gs://"):
        return resolve_path(posixpath.join(source.rsplit("/", 1)[0], path), "")
    if not os.path.isabs(source):  # a BigQuery table (bq://...) or query (bq-query): no folder to resolve in
        raise ValueError(f"{path!r} is relative, but the record comes from no input file ({source or 'no source'}); "
                         f"give a gs:// URI or an absolute path")
    resolved = os.path.normpath(os.path.join(os.path.dirname(source), path))
    if not layout.utf8_encodable(resolved):  # the input file's folder has a name that is not UTF-8
        raise ValueError(f"{path!r} resolves to {resolved!r}, which is not valid Unicode text "
                         f"(the input file's folder name is not UTF-8); give a gs:// URI or an absolute path")
    return resolved


# --------------------------------------------------------------------------------------------- allowed roots
_GLOB_CHARACTERS = ("*", "?", "[")


def normalise_root(root: str) -> str:
    """A --reference_root as the checks compare it: 'gs://bucket' or 'gs://bucket/prefix' (no trailing '/'), or
    an absolute, normalised local folder. ValueError naming it for another scheme, a bucket-less URI or a glob."""
    text = root.strip()
    if not text:
        raise ValueError("--reference_root has an empty entry")
    if any(c in text for c in _GLOB_CHARACTERS):
        raise ValueError(f"--reference_root={root!r} contains a glob character; give a folder or a gs:// prefix")
    if "://" in text:
        scheme, rest = text.split("://", 1)
        bucket, _, name = rest.partition("/")
        if scheme != "gs" or not bucket:
            raise ValueError(f"--reference_root={root!r} is neither a local folder nor a gs://bucket[/prefix]")
        name = posixpath.normpath(name) if name.strip("/") else ""
        if name == ".." or name.startswith("../"):
            raise ValueError(f"--reference_root={root!r} leaves its bucket")
        return f"gs://{bucket}" + (f"/{name}" if name and name != "." else "")
    return os.path.normpath(os.path.abspath(text))


def default_roots(patterns: Sequence[str]) -> tuple[str, ...]:
    """The roots a job allows when --reference_root is not given: the folder of each --input file pattern (the part
    before its first glob character, up to its last '/'). BigQuery input has no folder and adds none."""
    roots: dict[str, None] = {}
    for pattern in patterns:
        cut = min([pattern.index(c) for c in _GLOB_CHARACTERS if c in pattern] + [len(pattern)])
        head = pattern[:cut]
        if "://" in head:
            scheme, rest = head.split("://", 1)
            folder = f"{scheme}://{rest.rsplit('/', 1)[0]}" if "/" in rest else f"{scheme}://{rest}"
        else:
            folder = os.path.dirname(head) or "."
        roots[normalise_root(folder)] = None
    return tuple(roots)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_allowed(uri: str, roots: Sequence[str] | None) -> None:
    """ReferenceError naming `uri` and the allowed roots unless the reference lies inside one of `roots`: its
    normalised path (no '..' left to climb out), and for a local file also its real path (symlinks followed, so a
    link inside a root to a file outside it is refused). `roots` None: any path is allowed."""
    if roots is None:
        return
    allowed = ", ".join(roots) if roots else "none"
    hint = (f"the allowed reference roots are: {allowed} (--reference_root; by default the folders of the --input "
            f"files, none for BigQuery input)")
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        bucket, _, name = rest.partition("/")
        name = posixpath.normpath(name) if name else ""
        if scheme != "gs" or not bucket or name == ".." or name.startswith("../"):
            raise ReferenceError(uri, f"is not a path inside a reference root; {hint}")
        if not any(r.startswith("gs://") and _inside(f"gs://{bucket}/{name}", r) for r in roots):
            raise ReferenceError(uri, f"is outside every reference root; {hint}")
        return
    if not os.path.isabs(uri):
        raise ReferenceError(uri, f"is not an absolute path inside a reference root; {hint}")
    local = [r for r in roots if "://" not in r]
    path = os.path.normpath(uri)
    if not any(_inside(path, r) for r in local):
        raise ReferenceError(uri, f"is outside every reference root; {hint}")
    try:
        real = os.path.realpath(path)
    except (ValueError, UnicodeError, OSError) as e:  # a NUL, a lone surrogate: no file has such a path
        raise ReferenceError(uri, f"cannot be opened as a path ({type(e).__name__}: {e})") from None
    if not any(_inside(real, os.path.realpath(r)) for r in local):
        raise ReferenceError(uri, f"resolves (through a symlink) to {real!r}, outside every reference root; {hint}")


# --------------------------------------------------------------------------------------------- reading
READ_ATTEMPTS = 3  # reads of a reference whose failure may be transient (a dropped connection, a 5xx)
READ_BACKOFF_S = 0.5


def _read_bounded(uri: str, max_bytes: int, timeout_s: float | None = DEFAULT_READ_TIMEOUT_S) -> bytes:
    """The reference's bytes; a read that fails for a reason that may pass is tried READ_ATTEMPTS times, all within
    `timeout_s` (--read_timeout_s) from the first open: a read that stalls past it is a ReferenceError."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for attempt in range(READ_ATTEMPTS):
        try:
            return _read_bounded_once(uri, max_bytes, timeout_s, deadline)
        except ReferenceError as e:
            left = None if deadline is None else deadline - time.monotonic()
            if not e.transient or attempt == READ_ATTEMPTS - 1 or (left is not None and left <= 0):
                raise
            time.sleep(READ_BACKOFF_S * 2 ** attempt if left is None else min(READ_BACKOFF_S * 2 ** attempt, left))
    raise AssertionError("unreachable")


def _read_bounded_once(uri: str, max_bytes: int, timeout_s: float | None = DEFAULT_READ_TIMEOUT_S,
                       deadline: float | None = None) -> bytes:
    """One attempt: a local file only if it is a regular file (a FIFO, device or folder is refused before any
    read, so it cannot block), every open and read within the limit (transforms/bounded_reads.py)."""
    try:
        with open_timed(uri, timeout_s, deadline, what=f"reading reference {layout.writable_text(uri)!r}") as f:
            data = f.read(max_bytes + 1)
    except NotARegularFile as e:
        raise ReferenceError(uri, "is a folder, not a file" if e.kind == "a folder" else
                             f"is {e.kind}, not a regular file (only regular files and gs:// objects are read)") \
            from None
    except ReadTimeout as e:
        raise ReferenceError(uri, f"could not be read: {e}", transient=True) from None
    except Exception as e:  # noqa: BLE001 - Beam wraps the store's errors; the cause is what the row shows
        cause = e
        while getattr(cause, "__cause__", None) is not None:
            cause = cause.__cause__
        text = f"{type(e).__name__}: {e}"
        missing = isinstance(e, FileNotFoundError) or isinstance(cause, FileNotFoundError) or "Not found" in text \
            or "No such file" in text or "404" in text
        if missing:
            raise ReferenceError(uri, "does not exist") from None
        if isinstance(e, IsADirectoryError):
            raise ReferenceError(uri, "is a folder, not a file") from None
        if isinstance(e, (ValueError, UnicodeError)) or (isinstance(e, OSError) and e.errno in _NOT_A_PATH):
            raise ReferenceError(uri, f"cannot be opened as a path: {layout.truncate_record(text, 300)}") from None
        raise ReferenceError(uri, f"cannot be read: {layout.truncate_record(text, 300)}", transient=True) from None
    if len(data) > max_bytes:
        raise ReferenceError(uri, f"is larger than {max_bytes} bytes, the most a reference of "
                                  f"--max_reference_pixels may take (refused before decoding)")
    return data


# Errors of a path no retry can open (a name too long, a folder on the way that is a file, a loop of links).
_NOT_A_PATH = frozenset(getattr(errno, name) for name in ("ENAMETOOLONG", "ENOTDIR", "ELOOP", "EINVAL")
                        if hasattr(errno, name))


def decode_reference(uri: str, data: bytes, limits: ReferenceLimits) -> Reference:
    """A reference file's bytes -> Reference; the declared size is checked before any pixel is decoded."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    digest = hashlib.sha256(data).hexdigest()
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:  # PIL's own limit, above ours unless ours is raised past 89 MP
        raise ReferenceError(uri, f"declares too many pixels ({e})") from None
    except UnidentifiedImageError:
        raise ReferenceError(uri, "is not an image PIL can read") from None
    except Exception as e:  # noqa: BLE001 - a damaged header raises many types
        raise ReferenceError(uri, f"is not a readable image ({type(e).__name__}: {e})") from None
    with im:
        width, height = im.size
        if width * height > limits.max_pixels:
            raise ReferenceError(uri, f"is {width}x{height} = {width * height} pixels, above --max_reference_pixels="
                                      f"{limits.max_pixels} (refused before decoding)")
        try:
            check_reference_size(width, height)
        except ReferenceImageError as e:
            raise ReferenceError(uri, f"cannot be used: {e}") from None
        try:
            im.load()
            image = ImageOps.exif_transpose(im).convert("RGB")  # as diffusers.utils.load_image
        except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
            raise ReferenceError(uri, f"cannot be decoded ({type(e).__name__}: {e})") from None
    return Reference(uri=uri, sha256=digest, image=image)


def read_reference(uri: str, limits: ReferenceLimits = ReferenceLimits()) -> Reference:
    """Read and decode one reference (local or gs://) within `limits` (its bytes within --read_timeout_s);
    ReferenceError saying why not."""
    return decode_reference(uri, _read_bounded(uri, limits.max_bytes, limits.read_timeout_s), limits)


# --------------------------------------------------------------------------------------------- signature
def reference_signature(images: Sequence[Any], size_multiple: int = DEFAULT_SIZE_MULTIPLE
                        ) -> tuple[tuple[int, int], ...]:
    """Each reference's processed (height, width) for a checkpoint of `size_multiple`: the part of a batch's shape
    the references set (the model's own `model.reference_signature`)."""
    return tuple((int(h), int(w)) for h, w in model_reference_signature(list(images), size_multiple))


# --------------------------------------------------------------------------------------------- cache
class ReferenceCache:
    """Decoded references of one process by (job scope, URI), at most `max_bytes` of RGB pixels (least recently used out);
    references that cannot be used are remembered too (one read answers every request that shares them).
    Thread-safe: two threads asking for one URI read it once."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.max_bytes = max_bytes
        # (scope, uri) -> (Reference | ReferenceError, cost); an entry dearer than the bound counts as the bound, so
        # it is kept alone (everything else dropped) until the next entry comes
        self._items = cachetools.LRUCache(maxsize=max_bytes, getsizeof=lambda entry: min(entry[1], max_bytes))
        self._lock = threading.Lock()
        self._reading: dict[str, threading.Lock] = {}
        self.reads = 0  # files actually read by this cache (for tests and logs)

    def get(self, uri: str, limits: ReferenceLimits, expected_sha256: str | None = None) -> Reference:
        """The reference at `uri`, read at most once while cached; ReferenceError when it cannot be used, or when
        its bytes are no longer `expected_sha256` (read again once first: the cached copy may be the stale one)."""
        found = self._lookup(uri, limits)
        if expected_sha256 is not None and found.sha256 != expected_sha256:
            self.forget(uri, limits)
            found = self._lookup(uri, limits)
            if found.sha256 != expected_sha256:
                raise ReferenceError(uri, f"changed during the job (sha256 {found.sha256[:12]}..., first read as "
                                          f"{expected_sha256[:12]}...)")
        return found

    def forget(self, uri: str, limits: ReferenceLimits = ReferenceLimits()) -> None:
        with self._lock:
            self._items.pop((limits.cache_scope, uri), None)

    def _lookup(self, uri: str, limits: ReferenceLimits) -> Reference:
        key = (limits.cache_scope, uri)
        with self._lock:
            lock = self._reading.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                entry = self._items.get(key)  # a hit is now the most recently used
            if entry is None:
                entry = self._read(key, limits)
            value = entry[0]
        with self._lock:
            self._reading.pop(key, None)
        if isinstance(value, ReferenceError):
            raise value
        return value

    def _read(self, key: tuple[str, str], limits: ReferenceLimits):
        uri = key[1]
        Metrics.counter(METRICS_NAMESPACE, "reference_reads").inc()
        self.reads += 1
        try:
            value = read_reference(uri, limits)
            cost = value.size[0] * value.size[1] * 3
        except ReferenceError as e:
            if e.transient:  # not cached: the next request that needs it reads it again
                return e, 0
            value, cost = e, 1024
        with self._lock:
            self._items[key] = (value, cost)  # drops the least recently used past max_bytes
        return value, cost


_process_cache: ReferenceCache | None = None
_process_lock = threading.Lock()


def process_cache() -> ReferenceCache:
    """The one ReferenceCache of this worker process."""
    global _process_cache
    with _process_lock:
        if _process_cache is None:
            _process_cache = ReferenceCache()
        return _process_cache


def read_all(uris: Sequence[str], limits: ReferenceLimits, sha256: Sequence[str] | None = None,
             cache: Callable[[], ReferenceCache] = process_cache) -> list[Reference]:
    """The references of one request, through the process cache; the first that cannot be used (outside the
    limits' roots included) raises."""
    for uri in uris:
        check_allowed(uri, limits.roots)
    c = cache()
    return [c.get(uri, limits, None if sha256 is None else sha256[i]) for i, uri in enumerate(uris)]


# --------------------------------------------------------------------------------------------- Beam
INVALID_TAG = "invalid"


def _request_record(request) -> dict:
    return {"prompt": request.prompt, "seed": request.seed, "height": request.height, "width": request.width,
            "reference_images": list(request.reference_images)}


class _ResolveReferencesFn(retries.CountingRetriesFn):
    """A request with references -> the same request with each reference's sha256 and processed size (read through
    the process cache), or one error row naming the first reference that cannot be used and why. Requests without
    references pass unchanged."""

    def __init__(self, limits: ReferenceLimits, size_multiple: int):
        self._limits = limits
        self._size_multiple = size_multiple
        self._invalid = Metrics.counter(METRICS_NAMESPACE, "records_invalid")
        self._bad = Metrics.counter(METRICS_NAMESPACE, "references_invalid")

    def process(self, request):
        """The per-record boundary of references: whatever checking, reading or decoding one of this request's
        references raises, the request becomes one invalid_reference row naming it, and the job goes on."""
        if not request.reference_images:
            yield request
            return
        uri = request.reference_images[0]
        try:
            for uri in request.reference_images:
                check_allowed(uri, self._limits.roots)
            cache = process_cache()
            refs = []
            for uri in request.reference_images:
                refs.append(cache.get(uri, self._limits))
            uri = None
            resolved = request.with_references_read(
                tuple(r.sha256 for r in refs), reference_signature([r.image for r in refs], self._size_multiple))
        except ReferenceError as e:
            yield self._invalid_row(request, str(e), e.uri)
            return
        except Exception as e:  # noqa: BLE001 - every exception type: this request's reference data caused it
            LOGGER.warning("reading the references of request %r raised %s; it is an error row and the job goes on",
                           layout.writable_text(request.id), type(e).__name__, exc_info=True)
            which = f"reference image {layout.writable_text(uri)!r}" if uri is not None else "its reference images"
            yield self._invalid_row(request, f"{which} could not be used: {type(e).__name__}: {e}", uri)
            return
        yield resolved

    def _invalid_row(self, request, reason: str, uri: str | None):
        self._invalid.inc()
        self._bad.inc()
        return beam.pvalue.TaggedOutput(INVALID_TAG, layout.error_row(
            source=request.source, line=request.line, id=request.id, kind=layout.INVALID_REFERENCE,
            reason=layout.truncate_record(reason, 600), record=_request_record(request), field=FIELD, value=uri))


class ResolveReferences(beam.PTransform):
    """Requests -> {'requests': with their references' sha256 and signature, 'invalid': one error row per request
    with a reference that cannot be used (outside the allowed roots, missing, unreadable, not an image, too large,
    too small, too elongated)}.
    Runs before the images are planned, so a bad reference costs one row, not one per image."""

    def __init__(self, limits: ReferenceLimits, size_multiple: int = DEFAULT_SIZE_MULTIPLE):
        super().__init__()
        self._limits = limits
        self._size_multiple = size_multiple  # the checkpoint's, as the model processes references

    def expand(self, requests):
        fn = _ResolveReferencesFn(self._limits, self._size_multiple)
        out = requests | "ReadReferences" >> beam.ParDo(fn).with_outputs(INVALID_TAG, main="requests")
        return {"requests": out.requests, "invalid": out[INVALID_TAG]}
