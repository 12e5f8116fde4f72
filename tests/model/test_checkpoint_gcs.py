"""model.loading.checkpoint.resolve_checkpoint against a real local GCS emulator: copy once, verify, refuse pickles."""

import gzip
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from model.loading import checkpoint
from model.errors import CheckpointError, UnsafeWeightsError

FILES = {
    "model_index.json": b'{"_class_name": "Flux2KleinPipeline", "is_distilled": true}',
    "transformer/config.json": b'{"num_layers": 1}',
    "transformer/diffusion_pytorch_model.safetensors": bytes(range(256)) * 64,
    "vae/diffusion_pytorch_model.safetensors": b"\x00\x01" * 5000,
    "tokenizer/tokenizer.json": '{"vocab": "\u00e9t\u00e9"}'.encode("utf-8"),
}


def _upload(emulator, bucket, prefix, files=FILES):
    for rel, data in files.items():
        emulator.upload_bytes(f"gs://{bucket}/{prefix}/{rel}", data)
    return f"gs://{bucket}/{prefix}"


def _tree(folder):
    out = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            if name == checkpoint.COMPLETE_MARKER:
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder).replace(os.sep, "/")] = f.read()
    return out


def test_local_folder_is_returned_as_is(tmp_path):
    assert checkpoint.resolve_checkpoint(str(tmp_path)) == str(tmp_path)
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist") as e:
        checkpoint.resolve_checkpoint(missing)
    assert missing in str(e.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a folder"):
        checkpoint.resolve_checkpoint(str(tmp_path / "file"))
    with pytest.raises(CheckpointError, match="unsupported"):
        checkpoint.resolve_checkpoint("s3://bucket/ckpt")


def test_gcs_checkpoint_is_copied_verified_and_reused(gcs_emulator, gcs_bucket, tmp_path):
    uri = _upload(gcs_emulator, gcs_bucket, "klein")
    cache = str(tmp_path / "cache")
    before = checkpoint.copies_made()
    path = checkpoint.resolve_checkpoint(uri + "/", cache_dir=cache)
    assert path.startswith(cache) and os.path.isfile(os.path.join(path, checkpoint.COMPLETE_MARKER))
    assert _tree(path) == FILES
    assert checkpoint.copies_made() == before + 1
    # A complete cache is reused: no second copy, same folder, files untouched.
    mtime = os.stat(os.path.join(path, "model_index.json")).st_mtime_ns
    assert checkpoint.resolve_checkpoint(uri, cache_dir=cache) == path
    assert checkpoint.copies_made() == before + 1
    assert os.stat(os.path.join(path, "model_index.json")).st_mtime_ns == mtime
    # Nothing half-written is left next to it.
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".partial-")]


def test_reuploaded_checkpoint_gets_a_fresh_copy(gcs_emulator, gcs_bucket, tmp_path):
    uri = _upload(gcs_emulator, gcs_bucket, "klein")
    cache = str(tmp_path / "cache")
    first = checkpoint.resolve_checkpoint(uri, cache_dir=cache)
    changed = dict(FILES, **{"transformer/config.json": b'{"num_layers": 2}'})
    _upload(gcs_emulator, gcs_bucket, "klein", changed)
    second = checkpoint.resolve_checkpoint(uri, cache_dir=cache)
    assert second != first
    assert _tree(second) == changed


def test_superseded_copies_are_deleted_once_unused_for_a_while(gcs_emulator, gcs_bucket, tmp_path):
    """After a re-upload the old copy stays while it may still be in use (a process that resolved it just before),
    and is deleted by a later load once unused for SUPERSEDED_COPY_AGE_S, as is an old cut-short leftover; a copy
    in progress (its lock held) is never touched."""
    import fcntl

    uri = _upload(gcs_emulator, gcs_bucket, "klein-old")
    cache = str(tmp_path / "cache")
    first = checkpoint.resolve_checkpoint(uri, cache_dir=cache)
    _upload(gcs_emulator, gcs_bucket, "klein-old", dict(FILES, **{"transformer/config.json": b'{"num_layers": 3}'}))
    second = checkpoint.resolve_checkpoint(uri, cache_dir=cache)
    assert second != first and os.path.isfile(os.path.join(first, "model_index.json"))  # used moments ago: kept

    root = os.path.dirname(first)
    cut = os.path.join(root, f".partial-{'a' * 16}-x1y2")  # a copy of another listing cut short long ago
    busy = os.path.join(root, f".partial-{'b' * 16}-z3w4")  # a copy of another listing in progress
    for folder in (cut, busy):
        os.makedirs(os.path.join(folder, "vae"))
    long_ago = time.time() - checkpoint.SUPERSEDED_COPY_AGE_S - 60
    for path in (os.path.join(first, checkpoint.COMPLETE_MARKER), cut, busy):
        os.utime(path, (long_ago, long_ago))
    with open(os.path.join(root, f"{'b' * 16}.lock"), "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        assert checkpoint.resolve_checkpoint(uri, cache_dir=cache) == second
    assert not os.path.exists(first) and not os.path.exists(cut)
    assert os.path.isdir(busy) and _tree(second)["transformer/config.json"] == b'{"num_layers": 3}'
    # The copy in use is never the one deleted, however old its last use.
    os.utime(os.path.join(second, checkpoint.COMPLETE_MARKER), (long_ago, long_ago))
    assert checkpoint.resolve_checkpoint(uri, cache_dir=cache) == second and os.path.isdir(second)


@pytest.mark.parametrize("rel,stored,words", [
    # same size, different bytes, old checksums
    ("vae/diffusion_pytorch_model.safetensors", b"\x00\x02" * 5000, "checksum mismatch"),
    # the stored bytes end before the size GCS lists (a cut upload): the range read comes back short
    ("transformer/diffusion_pytorch_model.safetensors",
     FILES["transformer/diffusion_pytorch_model.safetensors"][:8192], "short read|size mismatch"),
], ids=["checksum", "truncated"])
def test_a_damaged_object_is_named_and_no_copy_is_kept(gcs_emulator, gcs_bucket, tmp_path, monkeypatch, rel, stored,
                                                       words):
    monkeypatch.setattr(checkpoint, "_SLICE", 4096)  # several slices per object
    uri = _upload(gcs_emulator, gcs_bucket, "klein")
    bad = f"{uri}/{rel}"
    gcs_emulator.corrupt_object(bad, stored)
    cache = str(tmp_path / "cache")
    with pytest.raises(CheckpointError, match=words) as e:
        checkpoint.resolve_checkpoint(uri, cache_dir=cache)
    assert bad in str(e.value)
    _assert_nothing_left(cache)


def test_objects_copied_in_slices_are_byte_identical(gcs_emulator, gcs_bucket, tmp_path, monkeypatch):
    """Sliced, checksummed-while-written copies equal the uploaded files, however the slices fall."""
    monkeypatch.setattr(checkpoint, "_SLICE", 1000)  # not a divisor of any file size
    uri = _upload(gcs_emulator, gcs_bucket, "klein")
    path = checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "cache"))
    for rel, want in FILES.items():
        with open(os.path.join(path, rel), "rb") as fh:
            assert fh.read() == want, rel


def test_range_reads_that_fail_are_retried_and_the_copy_is_whole(gcs_emulator, gcs_bucket, tmp_path, monkeypatch):
    """A third of the range reads fail (503, 429, a reset connection, a response that never comes back): each is
    retried by the client and the copy is byte-identical, its checksums verified."""
    from fault_proxy import FaultRule, in_front_of

    monkeypatch.setattr(checkpoint, "_SLICE", 256 * 1024)  # four ranges per weight file
    files = dict(FILES, **{f"transformer/diffusion_pytorch_model-0000{i}-of-00002.safetensors":
                           os.urandom(1_000_000 + 7 * i) for i in (1, 2)})
    del files["transformer/diffusion_pytorch_model.safetensors"]
    uri = _upload(gcs_emulator, gcs_bucket, "klein-faults", files)
    with in_front_of(gcs_emulator, monkeypatch, seed=3) as proxy:
        proxy.set_rules([FaultRule(fraction=0.3, kinds={"read"}, actions=("503", "429", "reset", "reset_after"))])
        path = checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "cache"))
        stats = proxy.stats()
    assert stats["injected_by_kind"].get("read", 0) >= 2 and stats["unretried"] == [], stats
    assert _tree(path) == files


def _assert_nothing_left(cache):
    """No usable (or half-copied) checkpoint copy is in the cache."""
    for _root, dirs, files in os.walk(cache):
        assert checkpoint.COMPLETE_MARKER not in files
        assert not [d for d in dirs if d.startswith(".partial-")]


def _upload_gzip_encoded(emulator, uri, data: bytes):
    """`data` stored as `gsutil cp -Z` / `-z json` stores it: Content-Encoding gzip, the object's bytes (and so its
    checksums) those of the gzip stream. `data` that is not gzip-compressed is stored as given."""
    bucket, name = uri[len("gs://"):].split("/", 1)
    blob = emulator.client().bucket(bucket).blob(name)
    blob.content_encoding = "gzip"
    blob.upload_from_string(data, content_type="application/octet-stream")


def test_gzip_content_encoded_objects_are_cached_decompressed(gcs_emulator, gcs_bucket, tmp_path):
    """Uploaded with gzip transcoding (config JSON and weights alike): the cache holds the original bytes."""
    uri = _upload(gcs_emulator, gcs_bucket, "klein-z")
    for rel in ("model_index.json", "vae/diffusion_pytorch_model.safetensors"):
        _upload_gzip_encoded(gcs_emulator, f"{uri}/{rel}", gzip.compress(FILES[rel], mtime=0))
    stored = gcs_emulator.list_blobs(f"{uri}/model_index.json")["klein-z/model_index.json"]
    assert stored.content_encoding == "gzip" and stored.size != len(FILES["model_index.json"])
    assert _tree(checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "cache"))) == FILES


def test_gzip_content_encoding_on_bytes_that_are_not_gzip_names_the_object(gcs_emulator, gcs_bucket, tmp_path):
    uri = _upload(gcs_emulator, gcs_bucket, "klein-badz")
    bad = f"{uri}/transformer/config.json"
    _upload_gzip_encoded(gcs_emulator, bad, FILES["transformer/config.json"])
    cache = str(tmp_path / "cache")
    with pytest.raises(CheckpointError, match="Content-Encoding gzip but is not valid gzip") as e:
        checkpoint.resolve_checkpoint(uri, cache_dir=cache)
    assert bad in str(e.value)
    _assert_nothing_left(cache)


@pytest.mark.parametrize("name", ["text_encoder/pytorch_model.bin", "extra/state.pth"])
def test_pickle_weights_are_refused_before_copying(gcs_emulator, gcs_bucket, tmp_path, name):
    """A folder whose only weights are pickles is refused before anything is copied."""
    uri = _upload(gcs_emulator, gcs_bucket, "klein", dict(FILES, **{name: b"pickle"}))
    cache = str(tmp_path / "cache")
    before = checkpoint.copies_made()
    with pytest.raises(UnsafeWeightsError) as e:
        checkpoint.resolve_checkpoint(uri, cache_dir=cache)
    assert f"{uri}/{name}" in str(e.value)
    assert checkpoint.copies_made() == before
    copied = [f for _r, _d, files in os.walk(cache) for f in files] if os.path.exists(cache) else []
    assert copied == []


@pytest.mark.parametrize("name", ["transformer/weights.pt", "vae/model.ckpt", "transformer/pytorch_model.bin"])
def test_pickle_weights_next_to_safetensors_are_never_downloaded(gcs_emulator, gcs_bucket, tmp_path, name):
    """As the local loader ignores them: the safetensors beside them are used, the pickle never reaches the disk."""
    uri = _upload(gcs_emulator, gcs_bucket, "klein-both", dict(FILES, **{name: b"pickle"}))
    local = checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "cache"))
    assert not os.path.exists(os.path.join(local, name))
    assert os.path.isfile(os.path.join(local, "transformer", "diffusion_pytorch_model.safetensors"))


def test_only_the_chosen_variant_is_downloaded(gcs_emulator, gcs_bucket, tmp_path):
    """Default and fp16 weight files side by side (sharded fp16 with its index): without a variant only the default
    files are copied, with variant="fp16" only the fp16 ones; every other file comes along either way."""
    fp16 = {
        "transformer/diffusion_pytorch_model.safetensors.index.fp16.json": b'{"weight_map": {}}',
        "transformer/diffusion_pytorch_model.fp16-00001-of-00002.safetensors": b"a" * 100,
        "transformer/diffusion_pytorch_model.fp16-00002-of-00002.safetensors": b"b" * 100,
        "vae/diffusion_pytorch_model.fp16.safetensors": b"c" * 100,
    }
    uri = _upload(gcs_emulator, gcs_bucket, "klein-variants", dict(FILES, **fp16))
    default = _tree(checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "cache")))
    assert default == FILES
    chosen = _tree(checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "cache"), variant="fp16"))
    assert chosen == {**{k: v for k, v in FILES.items() if ".safetensors" not in k}, **fp16}
    with pytest.raises(ValueError, match="variant must be"):
        checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "cache"), variant="../x")


def test_cut_copies_of_a_killed_process_are_removed_and_a_bad_cache_dir_is_typed(gcs_emulator, gcs_bucket, tmp_path):
    uri = _upload(gcs_emulator, gcs_bucket, "klein-kill")
    cache = tmp_path / "cache"
    local = checkpoint.resolve_checkpoint(uri, cache_dir=str(cache))
    root, fingerprint = os.path.split(local)
    shutil.rmtree(local)  # as if this copy had never finished: a process was killed while copying it
    os.makedirs(os.path.join(root, f".partial-{fingerprint}-dead"))
    assert checkpoint.resolve_checkpoint(uri, cache_dir=str(cache)) == local
    assert [d for d in os.listdir(root) if d.startswith(".partial-")] == []
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointError, match="cache folder cannot be used"):
        checkpoint.resolve_checkpoint(uri, cache_dir=str(tmp_path / "a-file" / "cache"))


def test_empty_prefix_is_an_error(gcs_emulator, gcs_bucket, tmp_path):
    with pytest.raises(CheckpointError, match="no objects"):
        checkpoint.resolve_checkpoint(f"gs://{gcs_bucket}/nothing-here", cache_dir=str(tmp_path))


def test_concurrent_processes_copy_once(gcs_emulator, gcs_bucket, tmp_path):
    uri = _upload(gcs_emulator, gcs_bucket, "klein")
    cache = str(tmp_path / "cache")
    gate = tmp_path / "gate"
    gate.mkdir()
    # Each child imports everything, says it is ready, then waits for the go file: the three resolve calls start
    # together, so they really race for the lock.
    code = ("import json, os, sys, time; from model.loading import checkpoint; gate = sys.argv[3]; "
            "open(os.path.join(gate, f'ready-{os.getpid()}'), 'w').close(); "
            "exec('while not os.path.exists(os.path.join(gate, \"go\")): time.sleep(0.01)'); "
            "p = checkpoint.resolve_checkpoint(sys.argv[1], cache_dir=sys.argv[2]); "
            "print(json.dumps({'path': p, 'copies': checkpoint.copies_made()}))")
    from paths import REPO as repo
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", code, uri, cache, str(gate)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, cwd=repo) for _ in range(3)]
    deadline = time.monotonic() + 120
    while len([n for n in os.listdir(gate) if n.startswith("ready-")]) < 3:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "children did not start"
        time.sleep(0.02)
    (gate / "go").touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    assert len({r["path"] for r in results}) == 1
    assert sum(r["copies"] for r in results) == 1
    assert _tree(results[0]["path"]) == FILES
