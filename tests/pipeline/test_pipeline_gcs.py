"""The whole job on a local GCS emulator: checkpoint, prompts and outputs all in gs://, tiny real checkpoint.

One job run covers: JSONL + CSV + text inputs, every valid record -> exactly one decodable PNG of the right size and
one manifest row whose sha256 matches the object, every invalid record -> one error row with its reason, a batch the
model rejects -> error rows while the rest of the job continues, batches never mixing shapes, the job's pixels equal
to `model.generate`, the summary and metrics; then a `--skip_existing` rerun that writes no image and leaves every
existing image object untouched.
"""

import gzip
import hashlib
import json

import model
import numpy as np
import pytest

from pipeline.run import run
from transforms.inference import _note_model_load
from pipeline_helpers import (  # noqa: F401 - ckpt32 and xla_cache are fixtures
    HEIGHT, MODEL_ARGS, WIDTH, check_manifest_matches_images, ckpt32, counters, decode, image_names, read, rows,
    xla_cache,
)
from transforms import layout
from transforms.inputs.identity import derive_id, derive_seed
from transforms.inputs.validation import RequestDefaults

JSONL = "\n".join([
    '{"id": "cat", "prompt": "a cat on a mat", "seed": 1}',                    # 1 valid
    '{"id": "dog", "prompt": "a dog", "seed": 5, "num_images": 2}',           # 2 valid, two images
    '{"prompt": "no id given"}',                                               # 3 valid, derived id and seed
    '{"id": "cat", "prompt": "a cat on a mat", "seed": 1}',                    # 4 identical duplicate: generated once
    '{"id": "sized", "prompt": "a wide view", "height": 32, "seed": 2}',       # 5 valid, explicit size
    '{"id": "odd", "prompt": "model rejects 48", "height": 48, "width": 48}',  # 6 a 16-multiple, not this VAE's 32
    '{"id": "cat", "prompt": "another cat"}',                                  # 7 conflicting duplicate id
    '{"prompt": "broken json"',                                                # 8
    '{"id": "nop"}',                                                           # 9 missing prompt
    '{"prompt": "p", "height": 100}',                                          # 10 not a multiple of 32
    '{"prompt": "p", "seed": -3}',                                             # 11 negative seed
    '{"prompt": "p", "id": "tab\\there"}',                                     # 12 id with a control character
    '{"prompt": "p", "num_inference_steps": 0}',                               # 13 steps out of range
    '{"prompt": "p", "width": "32"}',                                          # 14 wrong type
]).encode() + b'\n{"prompt": "bad \xff byte"}\n'                               # 15 not UTF-8
JSONL += json.dumps({"id": "long", "prompt": "a very long prompt " * 20, "seed": 4}).encode() + b"\n"  # 16 truncated
JSONL += b'{"id": "dog-1", "prompt": "names the file of dog\'s image 1"}\n'  # 17 its image name is taken by dog

# A gzip file cut short (an incomplete upload): its complete first line is a record, the rest one error row.
CUT_GZ = gzip.compress(b'{"id": "gz-a", "prompt": "a kept record", "seed": 8}\n{"id": "gz-b", "prompt": "cut off"}\n')[:-12]

CSV = "id,prompt,seed\ncsv ok/é,a red fox in snow,9\ncsv-bad,a red fox,abc\n".encode()  # a natural id on gs://
TEXT = b"a lighthouse at dusk\n\na mountain lake\n"

EXPECTED_ERRORS = {  # (file, line) -> words in the reason
    ("prompts.jsonl", 6): "positive multiple of 32",  # the checkpoint's rule, read at launch
    ("prompts.jsonl", 7): "conflicting",
    ("prompts.jsonl", 8): "malformed JSON",
    ("prompts.jsonl", 9): "missing prompt",
    ("prompts.jsonl", 10): "multiple of 32",
    ("prompts.jsonl", 11): "seed must be a non-negative integer",
    ("prompts.jsonl", 12): "U+0009 (Cc, not printable)",
    ("prompts.jsonl", 13): "num_inference_steps must be in",
    ("prompts.jsonl", 14): "width must be an integer",
    ("prompts.jsonl", 15): "not valid UTF-8",
    ("prompts.jsonl", 17): "would overwrite an image of request 'dog'",
    ("prompts.csv", 3): "seed must be an integer",
    ("cut.jsonl.gz", 2): "the gzip data ends before its end marker",
}


def test_job_on_gcs_end_to_end(gcs_emulator, gcs_bucket, ckpt32, xla_cache, tmp_path):
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_dir(ckpt32, f"{b}/models/klein-tiny")
    gcs_emulator.upload_bytes(f"{b}/in/prompts.jsonl", JSONL)
    gcs_emulator.upload_bytes(f"{b}/in/prompts.csv", CSV)
    gcs_emulator.upload_bytes(f"{b}/in/more/prompts.txt", TEXT)
    gcs_emulator.upload_bytes(f"{b}/in/cut.jsonl.gz", CUT_GZ)
    out = f"{b}/out"
    argv = [f"--model={b}/models/klein-tiny", f"--input={b}/in/*.jsonl,{b}/in/*.csv", f"--input={b}/in/more/*",
            f"--input={b}/in/*.gz",
            f"--output={out}", *MODEL_ARGS, "--seed=3", f"--checkpoint_cache_dir={tmp_path / 'ckpt-cache'}",
            f"--compilation_cache_dir={xla_cache}", "--runner=FnApiRunner", "--no_progress"]
    _note_model_load()  # a load another caller in this process left unreported: not this job's (model_loads == 1)
    result, summary = run(argv)

    # --- images: exactly one per valid record (two for num_images=2), right sizes
    defaults = RequestDefaults(height=HEIGHT, width=WIDTH, seed=3)
    derived = derive_id("no id given", HEIGHT, WIDTH, None, None, 1, None)
    text_ids = [derive_id(p, HEIGHT, WIDTH, None, None, 1, None) for p in ("a lighthouse at dusk", "a mountain lake")]
    natural = f"{layout.image_stem('csv ok/é')}.png"
    assert natural.startswith("csv_ok_e-")
    expected = {"cat.png", "dog-0.png", "dog-1.png", f"{derived}.png", "sized.png", natural, "long.png",
                "gz-a.png"} | \
        {f"{i}.png" for i in text_ids}
    assert image_names(out) == expected

    manifest = rows(out, "manifest")
    assert sorted(r["file_name"] for r in manifest) == sorted(f"images/{n}" for n in expected)
    check_manifest_matches_images(out, manifest, {"sized": (32, WIDTH), "cat": (HEIGHT, WIDTH)})
    by_file = {r["file_name"]: r for r in manifest}
    assert by_file["images/dog-1.png"]["seed"] == 6
    assert by_file[f"images/{natural}"]["id"] == "csv ok/é" and by_file[f"images/{natural}"]["seed"] == 9
    assert by_file[f"images/{derived}.png"]["seed"] == derive_seed(defaults.seed, derived)
    assert all(r["num_inference_steps"] == 4 and r["model"] == f"{b}/models/klein-tiny" for r in manifest)
    # Longer than --max_sequence_length=32 tokens: truncated (as the reference does), flagged, counted.
    assert [r["id"] for r in manifest if r["prompt_truncated"]] == ["long"]

    # --- errors: one row per invalid record / failed image, with the right reason
    errors = rows(out, "errors")
    got = {(e["source"].rsplit("/", 1)[-1], e["line"]): e for e in errors}
    assert len(errors) == len(EXPECTED_ERRORS) == len(got)
    for key, words in EXPECTED_ERRORS.items():
        assert words in got[key]["reason"], (key, got[key])
    assert got[("prompts.jsonl", 6)]["id"] == "odd" and got[("prompts.jsonl", 6)]["kind"] == "invalid_record"
    assert got[("prompts.jsonl", 7)]["id"] == "cat"
    assert got[("prompts.jsonl", 17)]["kind"] == "file_name_collision" and got[("prompts.jsonl", 17)]["id"] == "dog-1"
    assert got[("cut.jsonl.gz", 2)]["kind"] == "unreadable_input"
    assert by_file["images/dog-1.png"]["prompt"] == "a dog"  # the collision did not overwrite dog's image

    # --- summary and metrics
    stored = json.loads(read(f"{out}/summary.json"))
    assert stored == summary
    assert (summary["records_read"], summary["images_generated"], summary["invalid"], summary["failed"],
            summary["duplicates"], summary["skipped"], summary["prompts_truncated"]) == (23, 10, 13, 0, 1, 0, 1)
    assert summary["wall_time_s"] > 0 and summary["images_per_s"] > 0
    c = counters(result)
    assert c["model_loads"] == 1
    assert (c["images_generated"], c["records_read"], c["records_invalid"], c.get("images_failed", 0),
            c["records_duplicate"], c["prompts_truncated"], c["records_file_name_collision"]) == \
        (10, 23, 13, 0, 1, 1, 1)
    dist = {d.key.metric.name: d.committed for d in result.metrics().query()["distributions"]
            if d.key.metric.namespace == "flux2"}
    assert dist["batch_size"].max <= 2 and dist["batch_size"].sum == 10  # failed batches: test_fault_pipeline.py
    assert dist["generation_ms_per_image"].count == 10

    # --- the job's pixels are the model's pixels for the same request
    gen = model.load(ckpt32, dtype="float32", max_sequence_length=32, batch_size=2, compilation_cache_dir=xla_cache)
    cat = gen.generate(prompts=["a cat on a mat"], seeds=[1], height=HEIGHT, width=WIDTH)[0]
    np.testing.assert_array_equal(decode(read(f"{out}/images/cat.png"))[0], cat)
    dogs = gen.generate(prompts=["a dog"], seeds=[5], height=HEIGHT, width=WIDTH, num_images_per_prompt=2)
    np.testing.assert_array_equal(decode(read(f"{out}/images/dog-1.png"))[0], dogs[1])

    # --- rerun with --skip_existing: nothing rewritten, same generation numbers, empty manifest
    before = {name: blob.generation for name, blob in gcs_emulator.list_blobs(f"{out}/images/").items()}
    result2, summary2 = run(argv + ["--skip_existing"])
    after = {name: blob.generation for name, blob in gcs_emulator.list_blobs(f"{out}/images/").items()}
    assert after == before
    assert rows(out, "manifest") == []
    assert (summary2["images_generated"], summary2["skipped"], summary2["failed"]) == (0, 10, 0)
    assert counters(result2)["images_skipped"] == 10
    assert hashlib.sha256(read(f"{out}/images/cat.png")).hexdigest() == by_file["images/cat.png"]["sha256"]
