"""Helpers shared by the end-to-end pipeline tests: reading a job's outputs and metrics back."""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
from apache_beam.io.filesystems import FileSystems
from PIL import Image

from transforms import layout


def read(path: str) -> bytes:
    with FileSystems.open(path, compression_type="uncompressed") as f:
        return f.read()


def rows(output: str, kind: str) -> list[dict]:
    """Every row of `{output}/{kind}/{kind}-*.jsonl` (kind: manifest or errors; existing: manifest/existing-*)."""
    folder = layout.MANIFEST_DIR if kind == layout.EXISTING_PREFIX else kind
    pattern = layout.join(output, f"{folder}/{kind}-*.jsonl")
    out = []
    for meta in FileSystems.match([pattern])[0].metadata_list:
        out.extend(json.loads(line) for line in read(meta.path).decode("utf-8").splitlines() if line.strip())
    return out


def image_names(output: str) -> set[str]:
    return {m.path.rsplit("/", 1)[-1] for m in FileSystems.match([layout.images_glob(output)])[0].metadata_list}


def decode(data: bytes) -> tuple[np.ndarray, dict]:
    im = Image.open(io.BytesIO(data))
    im.load()
    return np.asarray(im.convert("RGB")), dict(im.text)


def check_manifest_matches_images(output: str, manifest: list[dict], size: dict[str, tuple[int, int]]) -> None:
    """Every manifest row describes the object it names: sha256, byte count, decodable PNG of the row's size."""
    for row in manifest:
        for field in layout.MANIFEST_FIELDS:
            assert field in row, (field, row)
        data = read(layout.join(output, row["file_name"]))
        assert row["uri"] == layout.join(output, row["file_name"])
        assert hashlib.sha256(data).hexdigest() == row["sha256"]
        assert len(data) == row["bytes"]
        pixels, text = decode(data)
        assert pixels.shape == (row["height"], row["width"], 3)
        if row["id"] in size:
            assert pixels.shape[:2] == size[row["id"]]
        assert text["prompt"] == row["prompt"] and text["seed"] == str(row["seed"])
        assert text["model"] == row["model"]
        assert text["num_inference_steps"] == str(row["num_inference_steps"])


def counters(result, namespace: str = "flux2") -> dict[str, int]:
    """{counter name: value summed over every step that reports it} (e.g. model loads are reported from whichever
    step of the process runs next)."""
    out: dict[str, int] = {}
    for c in result.metrics().query()["counters"]:
        if c.key.metric.namespace == namespace:
            out[c.key.metric.name] = out.get(c.key.metric.name, 0) + c.committed
    return out


# --------------------------------------------------------------------------------------------- shared fixtures
# Imported by the end-to-end test modules. One tiny checkpoint, one image shape and one persistent XLA cache for all
# of them, so the session compiles the job's programs once and every later worker process reads them from disk.
import pytest  # noqa: E402

# A tiny checkpoint whose VAE needs multiples of 32: a 48x48 request passes the job's validation (multiple of 16)
# but the model rejects it, which makes a real failing batch without faking anything.
SPEC32 = dict(vae_block_out_channels=(4, 4, 4, 4, 4), max_shard_size="16KB")
HEIGHT, WIDTH = 32, 64  # not square, so a swapped height/width would show
MODEL_ARGS = ["--dtype=float32", "--max_sequence_length=32", "--batch_size=2", f"--height={HEIGHT}",
              f"--width={WIDTH}"]


@pytest.fixture(scope="session")
def ckpt32(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(**SPEC32)


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory):
    """The session's persistent XLA cache (tests/conftest.py's JAX_COMPILATION_CACHE_DIR), which every pytest-xdist
    worker and their subprocesses share: a job's programs compiled by one worker are read from disk by the others.
    (A folder per worker compiled the same job programs in each worker, and a job in a worker switched that
    process's cache to it for the tests that followed: `--compilation_cache_dir` is process-wide.)"""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(params=["local", "gcs"])
def output(request, tmp_path):
    """An output folder: local, or a gs:// prefix on the GCS emulator."""
    if request.param == "local":
        return str(tmp_path / "out")
    emulator = request.getfixturevalue("gcs_emulator")
    return f"gs://{emulator.new_bucket()}/out"


def wait_for_images(job, out, count: int, timeout_s: float = 300, poll_s: float = 0.2) -> None:
    """Wait until the job process `job` has written `count` images under `out`/images, ended, or `timeout_s` passed."""
    import time

    images = os.path.join(str(out), "images")
    deadline = time.time() + timeout_s
    while time.time() < deadline and job.poll() is None:
        if os.path.isdir(images) and len(os.listdir(images)) >= count:
            return
        time.sleep(poll_s)
