"""A checkpoint's files by content (model/loading/content_ids.py): the crc32c GCS would list for each, read in parallel
slices, cached by path, size, mtime, ctime, inode and device, and the record a Flex Template build keeps of it."""

import json
import os
import shutil
import subprocess
import sys
import threading

import google_crc32c
import pytest

from model.loading import checkpoint, content_ids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _crc(data: bytes) -> str:
    return content_ids.to_base64(google_crc32c.value(data))


def _write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_slices_joined_give_the_crc32c_of_the_whole_file(tmp_path):
    chunk = 1 << 12
    sizes = [0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk + 5]
    paths = [_write(tmp_path / f"f{n}", os.urandom(n)) for n in sizes]
    got = content_ids.file_crc32c(paths, cache=str(tmp_path / "cache"), chunk=chunk, threads=3)
    for path in paths:
        with open(path, "rb") as f:
            assert got[path] == _crc(f.read()), path
    a, b = os.urandom(1000), os.urandom(777)
    assert content_ids.crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == \
        google_crc32c.value(a + b)


def _record(cache, path):
    [name] = [n for n in os.listdir(cache) if n.endswith(".json")]
    with open(os.path.join(cache, name)) as f:
        return os.path.join(cache, name), json.load(f)


def test_a_record_is_used_only_while_the_file_is_the_one_it_describes(tmp_path):
    cache = str(tmp_path / "cache")
    path = _write(tmp_path / "w.safetensors", b"a" * 5000)
    first = content_ids.file_crc32c([path], cache=cache)[path]
    record_path, record = _record(cache, path)
    assert record["crc32c"] == first and record["size"] == 5000
    # The record is what a second launch uses: it reads no byte of the file (a record saying otherwise is believed).
    with open(record_path, "w") as f:
        json.dump(dict(record, crc32c="planted="), f)
    assert content_ids.file_crc32c([path], cache=cache)[path] == "planted="
    # Same size, same mtime, other bytes (edited in place, its time restored): the ctime moved, it is read again.
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"b")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert content_ids.file_crc32c([path], cache=cache)[path] == _crc(b"b" + b"a" * 4999)
    # Replaced by another file (another inode) with the same size and mtime: read again.
    other = _write(tmp_path / "other", b"c" * 5000)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    assert content_ids.file_crc32c([path], cache=cache)[path] == _crc(b"c" * 5000)
    # A torn or foreign record is ignored.
    with open(record_path, "w") as f:
        f.write('{"path": ')
    assert content_ids.file_crc32c([path], cache=cache)[path] == _crc(b"c" * 5000)


def test_concurrent_launches_leave_one_whole_record(tmp_path):
    cache = str(tmp_path / "cache")
    path = _write(tmp_path / "w.safetensors", os.urandom(300_000))
    results, barrier = [], threading.Barrier(6)

    def launch():
        barrier.wait()
        results.append(content_ids.file_crc32c([path], cache=cache, chunk=1 << 14)[path])

    threads = [threading.Thread(target=launch) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with open(path, "rb") as f:
        assert set(results) == {_crc(f.read())} and len(results) == 6
    assert sorted(os.listdir(cache)) == [os.path.basename(_record(cache, path)[0])]  # no temporary file left


def test_a_cache_that_cannot_be_written_only_costs_a_read(tmp_path):
    path = _write(tmp_path / "w", b"x" * 10)
    blocked = _write(tmp_path / "not-a-folder", b"")
    assert content_ids.file_crc32c([path], cache=blocked)[path] == _crc(b"x" * 10)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUX2_KLEIN_CACHE", str(tmp_path / "cache"))


def test_a_configs_only_folder_with_the_builds_record_has_the_whole_checkpoints_digest(tiny_ckpt, tmp_path,
                                                                                        own_cache):
    """What a Flex Template launcher sees: the JSON files only, and the record the build made of every file."""
    _, whole = checkpoint.read_config_and_digest(tiny_ckpt)
    configs = tmp_path / "configs"
    for top, _dirs, names in os.walk(tiny_ckpt):
        for name in names:
            if name.endswith(".json") and not name.startswith("."):
                rel = os.path.relpath(os.path.join(top, name), tiny_ckpt)
                os.makedirs(configs / os.path.dirname(rel), exist_ok=True)
                shutil.copy(os.path.join(top, name), configs / rel)
    _, without_record = checkpoint.read_config_and_digest(str(configs), configs_only=True)
    assert without_record != whole  # the limit: without the record the weights cannot count
    recorded = subprocess.run([sys.executable, "-m", "model.loading.content_ids", tiny_ckpt], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=True).stdout
    (configs / content_ids.RECORD_FILE).write_text(recorded)
    _, with_record = checkpoint.read_config_and_digest(str(configs), configs_only=True)
    assert with_record == whole
