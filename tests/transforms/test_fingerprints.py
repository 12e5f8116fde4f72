"""Request and model fingerprints: what changes them, what does not, and that every output row carries them."""

import dataclasses
import glob
import os
import shutil

import numpy as np
import pytest

from model.loading import checkpoint
from transforms import layout, shards
from transforms.fingerprints import model_fingerprint, request_fingerprint
from transforms.requests import GenerationRequest, ImageTask
from transforms.sinks.encoding import encode_png, png_text
from transforms.sinks.existing import existing_manifest_row


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """The crc32c records of the files these tests hash go to a cache of their own."""
    monkeypatch.setenv("FLUX2_KLEIN_CACHE", str(tmp_path / "cache"))


def task(**kw) -> ImageTask:
    base = dict(id="r1", prompt="a red fox", seed=7, height=32, width=32, num_inference_steps=None,
                guidance_scale=None, num_images=1, source="p.jsonl", line=1, metadata='{"k": 1}')
    base.update(kw)
    return ImageTask(GenerationRequest(**base), 0)


def test_request_fingerprint_covers_the_fields_that_change_pixels_only():
    fp = request_fingerprint(task())
    assert len(fp) == 32 and fp == request_fingerprint(task())
    # Where the record came from and its extra columns do not change pixels.
    assert request_fingerprint(task(source="other.jsonl", line=9, metadata="")) == fp
    changed = [task(prompt="a blue fox"), task(seed=8), task(height=64), task(width=64), task(num_inference_steps=4),
               task(guidance_scale=2.0),
               task(reference_images=("r.png",), reference_sha256=("ab",), reference_signature=((64, 64),))]
    assert len({request_fingerprint(t) for t in changed} | {fp}) == len(changed) + 1
    # Image 1 of a request is made with seed + 1: the pixels, and so the fingerprint, of that seed.
    assert request_fingerprint(ImageTask(task(num_images=2).request, 1)) == request_fingerprint(task(seed=8))
    ref = dict(reference_images=("r.png",), reference_signature=((64, 64),))
    assert request_fingerprint(task(**ref, reference_sha256=("ab",))) != \
        request_fingerprint(task(**ref, reference_sha256=("cd",)))


def test_model_fingerprint_covers_checkpoint_dtype_quantization_and_sequence_length():
    base = dict(dtype="bfloat16", max_sequence_length=512, text_encoder_out_layers=(9, 18, 27))
    fp = model_fingerprint("c1", **base)
    assert fp == model_fingerprint("c1", **base) == model_fingerprint("c1", **base, quantize="none")
    others = [model_fingerprint("c2", **base), model_fingerprint("c1", **dict(base, dtype="float32")),
              model_fingerprint("c1", **dict(base, max_sequence_length=256)),
              model_fingerprint("c1", **dict(base, text_encoder_out_layers=(9, 18))),
              model_fingerprint("c1", **dict(base, quantize="int8"))]
    assert len(set(others) | {fp}) == 6


def _fake_checkpoint(folder, weights=b"w" * 100):
    files = {"model_index.json": b"{}", "transformer/config.json": b'{"num_layers": 1}',
             "transformer/diffusion_pytorch_model.safetensors": weights,
             "tokenizer/tokenizer.json": b"{}", ".flux2-complete.json": b"{}"}
    for rel, data in files.items():
        path = os.path.join(folder, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(folder)


def _digest(folder, variant=None):
    return checkpoint.checkpoint_digest(checkpoint._local_contents(folder, variant), folder)


def _edit_in_place(path, offset=0):
    """Flip one byte of `path` where it is, keeping its size and its mtime (as a tool that edits weights in place
    and restores the time would): only the bytes differ."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_checkpoint_digest_changes_with_any_weight_byte(tmp_path):
    a = _fake_checkpoint(tmp_path / "a")
    digest = _digest(a)
    assert digest == _digest(a)  # the second time from the cache of crc32c
    assert digest == _digest(shutil.copytree(a, tmp_path / "elsewhere"))  # the location does not count
    # Same size, other bytes: another checkpoint (a fine-tune saved the same way).
    assert _digest(_fake_checkpoint(tmp_path / "same_size", b"x" * 100)) != digest
    assert _digest(_fake_checkpoint(tmp_path / "resized", b"w" * 101)) != digest
    b = _fake_checkpoint(tmp_path / "b")
    with open(os.path.join(b, "transformer", "config.json"), "wb") as f:
        f.write(b'{"num_layers": 2}')
    assert _digest(b) != digest
    # One byte edited in place, size and mtime kept: the cached crc32c is not trusted, the digest changes.
    _edit_in_place(os.path.join(a, "transformer", "diffusion_pytorch_model.safetensors"), offset=37)
    assert _digest(a) != digest


def _weight_file(folder):
    return sorted(glob.glob(os.path.join(folder, "transformer", "*.safetensors")))[-1]


def test_a_checkpoint_edited_in_place_has_another_digest_locally_and_on_gcs(tiny_ckpt, tmp_path, gcs_emulator,
                                                                             gcs_bucket):
    local = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    _, before = checkpoint.read_config_and_digest(str(local))
    weights = _weight_file(local)
    uri = f"gs://{gcs_bucket}/ckpt/" + os.path.relpath(weights, local).replace(os.sep, "/")
    gcs_emulator.upload_dir(str(local), f"gs://{gcs_bucket}/ckpt")
    assert checkpoint.read_config_and_digest(f"gs://{gcs_bucket}/ckpt")[1] == before
    size = os.path.getsize(weights)
    _edit_in_place(weights, offset=size - 1)  # the last byte: a tensor's, never the header's
    assert os.path.getsize(weights) == size
    _, after = checkpoint.read_config_and_digest(str(local))
    assert after != before
    with open(weights, "rb") as f:
        gcs_emulator.upload_bytes(uri, f.read())  # the same edit, uploaded over the object
    assert checkpoint.read_config_and_digest(f"gs://{gcs_bucket}/ckpt")[1] == after


def test_local_and_gcs_copies_of_a_checkpoint_have_one_digest(tiny_ckpt, gcs_emulator, gcs_bucket):
    config, local = checkpoint.read_config_and_digest(tiny_ckpt)
    for root, _dirs, names in os.walk(tiny_ckpt):
        for name in names:
            if not name.startswith("."):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, tiny_ckpt).replace(os.sep, "/")
                with open(path, "rb") as f:
                    gcs_emulator.upload_bytes(f"gs://{gcs_bucket}/ckpt/{rel}", f.read())
    remote_config, remote = checkpoint.read_config_and_digest(f"gs://{gcs_bucket}/ckpt")
    assert remote == local and remote_config == config


def test_rows_and_image_text_carry_the_fingerprints():
    t = task(num_inference_steps=4, guidance_scale=1.0)
    text = png_text(t, num_inference_steps=4, guidance_scale=1.0, model="m", model_identity="mfp")
    assert text["request_fingerprint"] == request_fingerprint(t) and text["model_fingerprint"] == "mfp"
    data = encode_png(np.zeros((32, 32, 3), np.uint8), text)
    row = existing_manifest_row(t, data, "u", model_identity="mfp")
    assert (row["request_fingerprint"], row["model_fingerprint"]) == (request_fingerprint(t), "mfp")
    assert list(row)[:len(layout.MANIFEST_FIELDS)] == list(layout.MANIFEST_FIELDS)
    # The sidecar keeps them: a kept shard's rows are compared by them (shards.sidecar_row_matches).
    side = shards.success_sidecar_row(dict(row, key="000000000"))
    back = shards.read_sidecar(shards.sidecar_bytes([side]))[0]
    assert (back["request_fingerprint"], back["model_fingerprint"]) == (request_fingerprint(t), "mfp")
    assert shards.sidecar_row_matches(back, t, "mfp") and not shards.sidecar_row_matches(back, t, "other")
    failed = shards.failed_sidecar_row("000000001", t, {"kind": "k", "reason": "r"}, "mfp")
    assert (failed["request_fingerprint"], failed["model_fingerprint"]) == (request_fingerprint(t), "mfp")


def test_job_config_carries_the_model_fingerprint(tiny_ckpt, tmp_path):
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.launch import resolve_job

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    args = [f"--model={tiny_ckpt}", f"--input={prompts}", f"--output={tmp_path / 'out'}"]
    job = resolve_job(PipelineOptions(args + ["--dtype=float32"]))
    assert len(job.model_fingerprint) == 32
    assert resolve_job(PipelineOptions(args + ["--dtype=float32"])).model_fingerprint == job.model_fingerprint
    assert resolve_job(PipelineOptions(args + ["--dtype=bfloat16"])).model_fingerprint != job.model_fingerprint
    assert resolve_job(PipelineOptions(args + ["--dtype=float32", "--max_sequence_length=64"])).model_fingerprint \
        != job.model_fingerprint
    assert dataclasses.replace(job).model_fingerprint == job.model_fingerprint
