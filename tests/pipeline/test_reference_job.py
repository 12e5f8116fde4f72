"""Image-conditioned generation in the job, on the GCS emulator: records with `reference_images` (objects in the
bucket, and a local path relative to the input file) give the images `generator.generate(reference_images=...)`
gives for the same requests; every unusable reference (missing, not an image, too small, too elongated, a
decompression bomb, a file over the byte limit) is one error row naming it and why, and the rest of the job goes on.
The four job runs share one loaded model (tests/support/fault_jobs.py CachedHandler: the job's own handler, loaded
once per process); the expected pixels come from a separate `model.load`.
"""

import hashlib
import inspect
import json

import model
import numpy as np

from fault_jobs import install_handler
from pipeline.run import run
from pipeline_helpers import counters, decode, image_names, read, rows, xla_cache  # noqa: F401 - xla_cache fixture
from reference_files import pil, png, png_declaring
from transforms.inputs.identity import derive_id

SIZE = 32
MAX_REFERENCE_PIXELS = 256 * 256  # keeps the byte limit of a reference file small: 4 * 65536 + 1 MiB
ARGS = ["--dtype=float32", "--max_sequence_length=32", "--batch_size=2", f"--height={SIZE}", f"--width={SIZE}",
        f"--max_reference_pixels={MAX_REFERENCE_PIXELS}", "--runner=FnApiRunner", "--no_progress"]


def _job(gcs_emulator, bucket, ckpt, tmp_path, records, xla_cache, extra=()):
    """Write the records to a local input file next to refs/; the job's arguments, output and that folder."""
    b = f"gs://{bucket}"
    local = tmp_path / "in"
    (local / "refs").mkdir(parents=True, exist_ok=True)
    (local / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = f"{b}/out"
    argv = [f"--model={ckpt}", f"--input={local / 'prompts.jsonl'}", f"--output={out}", *ARGS,
            f"--compilation_cache_dir={xla_cache}", f"--reference_root={local},{b}/refs", *extra]
    return argv, out, local


def test_bad_references_are_one_error_row_each(gcs_emulator, gcs_bucket, tiny_ckpt, xla_cache, tmp_path, monkeypatch):
    install_handler(monkeypatch)
    b = f"gs://{gcs_bucket}"
    files = {
        "not-image.png": b"this is text, not an image",
        "small.png": png(64, 48),
        "bomb.png": png_declaring(5000, 5000),  # 25 MP declared in a file of a few KiB
        "big.png": b"\x89PNG" + bytes(4 * MAX_REFERENCE_PIXELS + 2**20),  # over the byte limit
    }
    for name, data in files.items():
        gcs_emulator.upload_bytes(f"{b}/refs/{name}", data)
    other = f"gs://{gcs_emulator.new_bucket('other')}"
    gcs_emulator.upload_bytes(f"{other}/refs/a.png", png(64, 64))  # readable by the worker, but not allowed
    records = [
        {"id": "plain", "prompt": "no references", "seed": 1},
        {"id": "missing", "prompt": "p", "reference_images": [f"{b}/refs/nope.png"]},
        {"id": "missing-again", "prompt": "q", "reference_images": [f"{b}/refs/nope.png"]},  # read once
        {"id": "not-image", "prompt": "p", "reference_images": [f"{b}/refs/not-image.png"]},
        {"id": "small", "prompt": "p", "reference_images": [f"{b}/refs/small.png"]},
        {"id": "long", "prompt": "p", "reference_images": ["refs/long.png"]},  # local, relative to the input
        {"id": "bomb", "prompt": "p", "reference_images": [f"{b}/refs/bomb.png"]},
        {"id": "big", "prompt": "p", "reference_images": [f"{b}/refs/big.png"]},
        {"id": "too-many", "prompt": "p", "reference_images": ["a.png"] * 5},
        {"id": "other-bucket", "prompt": "p", "reference_images": [f"{other}/refs/a.png"]},
        {"id": "escape", "prompt": "p", "reference_images": ["../secret.png"]},  # out of the input's folder
    ]
    argv, out, local = _job(gcs_emulator, gcs_bucket, tiny_ckpt, tmp_path, records, xla_cache)
    (local / "refs" / "long.png").write_bytes(png(64, 600))
    (tmp_path / "secret.png").write_bytes(png(64, 64))
    result, summary = run(argv)

    assert image_names(out) == {"plain.png"}
    assert [r["id"] for r in rows(out, "manifest")] == ["plain"]
    assert "reference_images" not in rows(out, "manifest")[0]
    errors = {e["id"]: e for e in rows(out, "errors")}
    expected = {
        "missing": (f"{b}/refs/nope.png", "does not exist"),
        "missing-again": (f"{b}/refs/nope.png", "does not exist"),
        "not-image": (f"{b}/refs/not-image.png", "is not an image"),
        "small": (f"{b}/refs/small.png", "must be at least 64 px on each side, got 64x48"),
        "long": (str(local / "refs" / "long.png"), "aspect ratio must be at most 8:1, got 64x600 (9.38:1)"),
        "bomb": (f"{b}/refs/bomb.png", "above --max_reference_pixels=65536 (refused before decoding)"),
        "big": (f"{b}/refs/big.png", "is larger than 1310720 bytes"),
        "other-bucket": (f"{other}/refs/a.png", f"outside every reference root; the allowed reference roots are: "
                                                f"{local}, {b}/refs"),
        "escape": (str(tmp_path / "secret.png"), "outside every reference root"),
    }
    assert set(errors) == set(expected) | {"too-many"}
    for rid, (uri, words) in expected.items():
        e = errors[rid]
        assert (e["kind"], e["field"], e["value"]) == ("invalid_reference", "reference_images", uri), e
        assert words in e["reason"] and uri in e["reason"], e
    assert errors["too-many"]["kind"] == "invalid_record"
    assert "above --max_reference_images=4" in errors["too-many"]["reason"]
    assert (summary["images_generated"], summary["invalid"], summary["failed"]) == (1, 10, 0)
    c = counters(result)
    assert c["reference_reads"] == 6  # every distinct allowed reference once, the shared missing one too


def test_reference_job_gives_the_models_pixels(gcs_emulator, gcs_bucket, tiny_ckpt, xla_cache, tmp_path, monkeypatch):
    # No skip guard: generate() taking reference_images is the contract this test checks, so a rename of that
    # parameter must fail here, not turn the test into a skip.
    from model.engine.generator import Flux2KleinGenerator

    assert "reference_images" in inspect.signature(Flux2KleinGenerator.generate).parameters, (
        "Flux2KleinGenerator.generate() no longer takes reference_images: the job's editing path is broken")
    install_handler(monkeypatch)
    b = f"gs://{gcs_bucket}"
    a_bytes, c_bytes = png(64, 64, seed=1), png(80, 64, seed=2, mode="RGBA")
    gcs_emulator.upload_bytes(f"{b}/refs/a.png", a_bytes)
    records = [
        {"id": "gs-ref", "prompt": "a red fox", "seed": 1, "reference_images": [f"{b}/refs/a.png"]},
        {"id": "local-ref", "prompt": "a red fox", "seed": 2, "reference_images": ["refs/c.png"]},
        {"id": "two-refs", "prompt": "a fox and a hat", "seed": 3,
         "reference_images": [f"{b}/refs/a.png", "refs/c.png"]},
        {"prompt": "same prompt", "seed": 4, "reference_images": [f"{b}/refs/a.png"]},
        {"prompt": "same prompt", "seed": 4, "reference_images": ["refs/c.png"]},
        {"id": "plain", "prompt": "a red fox", "seed": 1},
    ]
    argv, out, local = _job(gcs_emulator, gcs_bucket, tiny_ckpt, tmp_path, records, xla_cache)
    (local / "refs" / "c.png").write_bytes(c_bytes)
    c_uri = str(local / "refs" / "c.png")
    result, summary = run(argv)

    ids = {rid: derive_id("same prompt", SIZE, SIZE, None, None, 1, 4, (uri,))
           for rid, uri in (("same-a", f"{b}/refs/a.png"), ("same-c", c_uri))}
    assert ids["same-a"] != ids["same-c"]
    assert image_names(out) == {"gs-ref.png", "local-ref.png", "two-refs.png", "plain.png",
                                f"{ids['same-a']}.png", f"{ids['same-c']}.png"}
    assert rows(out, "errors") == [] and summary["images_generated"] == 6
    # Each file read and decoded once: resolving read it, and the generate calls found it in the process's cache.
    assert counters(result)["reference_reads"] == 2
    manifest = {r["id"]: r for r in rows(out, "manifest")}
    sha = {f"{b}/refs/a.png": hashlib.sha256(a_bytes).hexdigest(),
           c_uri: hashlib.sha256(c_bytes).hexdigest()}
    assert manifest["two-refs"]["reference_images"] == [{"uri": u, "sha256": sha[u]} for u in (f"{b}/refs/a.png",
                                                                                              c_uri)]
    assert "reference_images" not in manifest["plain"]
    c = counters(result)
    assert c["reference_reads"] == 2  # two files, six requests: each read once
    # Batches by reference signature: [a] x2, [c] x2, [a, c], none -> 4 batches of at most 2 for 6 images.
    assert c["batches"] == 4

    gen = model.load(tiny_ckpt, dtype="float32", max_sequence_length=32, batch_size=2,
                     compilation_cache_dir=xla_cache)
    a, c = pil(a_bytes), pil(c_bytes)
    expected = {
        "gs-ref": ("a red fox", 1, [a]), "local-ref": ("a red fox", 2, [c]), "two-refs": ("a fox and a hat", 3, [a, c]),
        ids["same-a"]: ("same prompt", 4, [a]), ids["same-c"]: ("same prompt", 4, [c]),
    }
    for rid, (prompt, seed, refs) in expected.items():
        want = gen.generate(prompts=[prompt], seeds=[seed], height=SIZE, width=SIZE, reference_images=[refs])[0]
        pixels, text = decode(read(f"{out}/images/{rid}.png"))
        np.testing.assert_array_equal(pixels, want, err_msg=rid)
        assert json.loads(text["reference_images"]) == manifest[rid]["reference_images"]
    plain = gen.generate(prompts=["a red fox"], seeds=[1], height=SIZE, width=SIZE)[0]
    np.testing.assert_array_equal(decode(read(f"{out}/images/plain.png"))[0], plain)

    # --- resume: nothing generated again, every image found and listed with its references
    before = {n: blob.generation for n, blob in gcs_emulator.list_blobs(f"{out}/images/").items()}
    _, summary2 = run(argv + ["--skip_existing"])
    assert {n: blob.generation for n, blob in gcs_emulator.list_blobs(f"{out}/images/").items()} == before
    assert (summary2["images_generated"], summary2["skipped"]) == (0, 6)
    existing = {r["id"]: r for r in rows(out, "existing")}
    assert existing["two-refs"]["reference_images"] == manifest["two-refs"]["reference_images"]

    # --- a reference replaced by other content: its requests are generated again, the others are kept
    (local / "refs" / "c.png").write_bytes(png(80, 64, seed=5))
    _, summary3 = run(argv + ["--skip_existing"])
    assert (summary3["images_generated"], summary3["skipped"]) == (3, 3)
