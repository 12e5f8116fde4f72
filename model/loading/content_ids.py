"""What a checkpoint's files hold: the crc32c of each file's bytes, which GCS lists for every object at no cost.

A local file's crc32c is computed here, the very value GCS stores for it (a folder and its upload have one digest):
CHUNK-byte slices read with `os.pread` by READ_THREADS threads (both the read and google_crc32c's C loop release the
GIL), their crcs joined with `crc32c_combine` (model/storage/crc32c.py). Each result is cached under
`file-crc32c/` in the project's cache folder (model/loading/cache_paths.py), one small JSON file per path written
atomically (concurrent launches never see half a record), and trusted only while the file's path, size, mtime, ctime,
inode and device are those recorded: a second launch on the same files reads none of their bytes, and an edit in
place (even one that restores the mtime: the ctime moves) is read again.

`python -m model.loading.content_ids FOLDER` prints `{relative path: [size, crc32c]}` of every file under FOLDER: what a
Flex Template build records beside the configs it gives the launcher (RECORD_FILE), which cannot see the weights.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import sys
import tempfile
import time

from ..storage.crc32c import crc32c_combine, to_base64
from .cache_paths import cache_root

logger = logging.getLogger(__name__)

CHUNK = 2 * 1024 * 1024  # bytes read and checksummed at a time (small: their memory is reused; GIL freed >= 1 MiB)
READ_THREADS = 8  # slices read at once, over all files (memory: READ_THREADS x CHUNK)
CACHE_FOLDER = "file-crc32c"
MAX_RECORDS = 10_000  # past this many records in the cache, those of files that are gone are dropped
RECORD_FILE = ".flux2-content.json"  # {relative path: [size, crc32c]} of a checkpoint, recorded where it was whole


# --------------------------------------------------------------------------------------------- files
def _slice_crc(path: str, offset: int, length: int) -> int:
    import google_crc32c

    fd = os.open(path, os.O_RDONLY)
    try:
        crc, done = 0, 0
        while done < length:
            data = os.pread(fd, length - done, offset + done)
            if not data:
                raise OSError(f"{path} ended at byte {offset + done} while it was read (it is being changed)")
            crc = google_crc32c.extend(crc, data)
            done += len(data)
        return crc
    finally:
        os.close(fd)


def _stat_key(path: str, st: os.stat_result) -> dict:
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


def cache_folder() -> str:
    return os.path.join(cache_root(), CACHE_FOLDER)


def _record_path(folder: str, real_path: str) -> str:
    return os.path.join(folder, hashlib.sha256(real_path.encode("utf-8", "surrogateescape")).hexdigest()[:40] + ".json")


def _cached(folder: str, key: dict) -> str | None:
    try:
        with open(_record_path(folder, key["path"]), "rb") as f:
            record = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in key.items()):
        return None
    crc = record.get("crc32c")
    return crc if isinstance(crc, str) else None


def _store(folder: str, key: dict, crc: str) -> None:
    """Write the record atomically (a temporary file renamed over it); a cache that cannot be written is skipped."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".new-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**key, "crc32c": crc}, f)
            os.replace(tmp, _record_path(folder, key["path"]))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logger.info("cannot cache the crc32c of %s in %s: %s", key["path"], folder, e)
        return
    _prune(folder)


def _prune(folder: str, keep: int = MAX_RECORDS) -> None:
    """Past `keep` records, drop those whose file is gone (checkpoints deleted, test folders)."""
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith(".")]
    except OSError:
        return
    if len(names) <= keep:
        return
    for name in names:
        record = os.path.join(folder, name)
        try:
            with open(record, "rb") as f:
                path = json.loads(f.read()).get("path")
            if not isinstance(path, str) or not os.path.exists(path):
                os.unlink(record)
        except (OSError, ValueError, AttributeError):
            continue


def file_crc32c(paths: list[str], *, cache: str | None = None, threads: int = READ_THREADS,
                chunk: int = CHUNK) -> dict[str, str]:
    """{path: crc32c (base64, as GCS lists it)} of local files: from the cache where a record matches the file as it
    is now, else read (in parallel slices) and recorded. `cache`: the records' folder (default: `cache_folder()`)."""
    folder = cache or cache_folder()
    out, todo = {}, []
    for path in paths:
        st = os.stat(path)
        key = _stat_key(path, st)
        found = _cached(folder, key)
        if found is not None:
            out[path] = found
        else:
            todo.append((path, key))
    if not todo:
        return out
    start, total = time.monotonic(), sum(key["size"] for _, key in todo)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        slices = {path: [pool.submit(_slice_crc, path, offset, min(chunk, key["size"] - offset))
                         for offset in range(0, key["size"], chunk)] for path, key in todo}
        for path, key in todo:
            crc, done = 0, 0
            for future in slices[path]:
                length = min(chunk, key["size"] - done)
                crc = crc32c_combine(crc, future.result(), length)
                done += length
            out[path] = to_base64(crc)
            if _stat_key(path, os.stat(path)) == key:  # not changed while it was read: the record can be trusted
                _store(folder, key, out[path])
    logger.info("read the crc32c of %d checkpoint file(s), %.2f GB, in %.1f s", len(todo), total / 1e9,
                time.monotonic() - start)
    return out


def folder_contents(folder: str) -> dict[str, list]:
    """{path relative to `folder` ('/'-separated): [size, crc32c]} of every file under it."""
    paths = {}
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(top, name)
            paths[os.path.relpath(path, folder).replace(os.sep, "/")] = path
    crcs = file_crc32c(list(paths.values()))
    return {rel: [os.path.getsize(path), crcs[path]] for rel, path in paths.items()}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python -m model.loading.content_ids FOLDER   (prints {path: [size, crc32c]} of its files)",
              file=sys.stderr)
        return 2
    json.dump({rel: entry for rel, entry in folder_contents(argv[0]).items() if rel != RECORD_FILE},
              sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
