"""The launch checks every weight file the workers will read, from headers and sizes only, before anything runs: a
checkpoint folder without usable weights is one `error:` line and exit 2, with nothing created in the output; a
model load that still fails on a worker is one line too (no tracebacks), and Beam's temporary folders are removed."""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

import pipeline.run as job_run
from pipeline_helpers import MODEL_ARGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LFS_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
               b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 123456\n")
MISSING_TENSOR = "model.layers.0.self_attn.q_norm.weight"


def _shards(ckpt, component):
    folder = os.path.join(ckpt, component)
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def _no_safetensors(ckpt):
    for component in ("text_encoder", "transformer", "vae"):
        folder = os.path.join(ckpt, component)
        for name in os.listdir(folder):
            if ".safetensors" in name:
                os.remove(os.path.join(folder, name))
    return os.path.join(ckpt, "text_encoder"), "no .safetensors weights found"


def _lfs_pointer(ckpt):
    path = _shards(ckpt, "transformer")[0]
    with open(path, "wb") as f:
        f.write(LFS_POINTER)
    return path, "Git LFS pointer"


def _empty(ckpt):
    path = _shards(ckpt, "vae")[-1]
    open(path, "wb").close()
    return path, "empty (0 bytes)"


def _truncated(ckpt):
    path = _shards(ckpt, "text_encoder")[0]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)  # the header still says where every tensor ends
    return path, "truncated"


def _tensor_missing(ckpt):
    """One tensor taken out of its shard and of the index: a checkpoint that does not cover the model."""
    from safetensors.numpy import load_file, save_file

    folder = os.path.join(ckpt, "text_encoder")
    index_path = os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".index.json")))
    with open(index_path) as f:
        index = json.load(f)
    shard = os.path.join(folder, index["weight_map"].pop(MISSING_TENSOR))
    tensors = load_file(shard)
    del tensors[MISSING_TENSOR]
    save_file(tensors, shard)
    with open(index_path, "w") as f:
        json.dump(index, f)
    return folder, "tensor missing from checkpoint"


BREAKS = {"no_safetensors": _no_safetensors, "lfs_pointer": _lfs_pointer, "empty_file": _empty,
          "truncated_file": _truncated, "tensor_missing": _tensor_missing}


@pytest.fixture
def broken_copy(tiny_ckpt, tmp_path):
    def make(kind):
        ckpt = str(tmp_path / "ckpt")
        shutil.copytree(tiny_ckpt, ckpt)
        return ckpt, *BREAKS[kind](ckpt)

    return make


@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_a_checkpoint_without_usable_weights_stops_the_launch(kind, broken_copy, tmp_path, capsys):
    ckpt, named, words = broken_copy(kind)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    out = tmp_path / "out"
    status = job_run.main([f"--model={ckpt}", f"--input={prompts}", f"--output={out}", *MODEL_ARGS, "--no_progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith(f"error: --model={ckpt!r}"), err
    assert words in err[0] and repr(named) in err[0], err[0]
    if kind == "tensor_missing":
        assert MISSING_TENSOR in err[0]
    assert not out.exists()  # nothing created: the launch stopped before the output was looked at


def _header_end(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("kind", ["truncated_file", "lfs_pointer"])
def test_a_gcs_checkpoint_is_checked_from_its_headers_alone(kind, broken_copy, gcs_emulator, gcs_bucket, tmp_path,
                                                            monkeypatch, capsys):
    """The same on gs://: one line naming the object; of each weight object only its first 8 bytes and its header
    are downloaded (ranged reads), and nothing is copied into the checkpoint cache."""
    from google.cloud.storage import Blob

    ckpt, named, words = broken_copy(kind)
    uri = f"gs://{gcs_bucket}/models/klein"
    gcs_emulator.upload_dir(ckpt, uri)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLUX2_KLEIN_CACHE", str(cache))
    reads = []  # (object name, first byte, last byte) of every download, as the real client makes it
    download = Blob.download_as_bytes

    def recorded(self, *args, **kwargs):
        reads.append((self.name, kwargs.get("start"), kwargs.get("end")))
        return download(self, *args, **kwargs)

    monkeypatch.setattr(Blob, "download_as_bytes", recorded)
    out = tmp_path / "out"
    status = job_run.main([f"--model={uri}", f"--input={prompts}", f"--output={out}", *MODEL_ARGS, "--no_progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    rel = os.path.relpath(named, ckpt).replace(os.sep, "/")
    assert len(err) == 1 and words in err[0] and f"{uri}/{rel}" in err[0], err
    weights = [r for r in reads if r[0].endswith(".safetensors")]
    assert weights, reads
    for name, first, last in weights:
        local = os.path.join(ckpt, *name.split("/")[2:])
        assert first is not None and last is not None, (name, first, last)  # a ranged read, never the whole object
        limit = 8 if kind == "lfs_pointer" and local == named else _header_end(local)
        assert last < limit, (name, first, last, limit)
    assert not cache.exists() or not os.listdir(cache)
    assert not out.exists()


def test_a_model_load_that_fails_on_a_worker_is_one_line(tiny_ckpt, tmp_path):
    """The launch passed (the weights are sound) but the worker's loader refuses the checkpoint (here a tokenizer
    without its chat template): exit 2 with one `error:` line naming the problem, no traceback, and no
    `beam-temp-*` folder left in the output."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    folder = ckpt / "tokenizer"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        if (folder / extra).exists():
            (folder / extra).unlink()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pipeline.run", f"--model={ckpt}", f"--input={prompts}",
                           f"--output={out}", *MODEL_ARGS, "--no_progress"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: --model={str(ckpt)!r} could not be loaded"), lines
    assert "CheckpointError" in lines[0] and "chat template" in lines[0] and "[while running" not in lines[0]
    assert not list(out.rglob("beam-temp-*")), list(out.rglob("*"))
