"""The job with --quantize int8: every image records its model's quantization (manifest row, image text, WebDataset
sidecar, the dataset card), and a resume over an unquantized run's output makes every image again, counted stale."""

import pyarrow.parquet as pq

from pipeline.run import run
from pipeline_helpers import (  # noqa: F401 - ckpt32 and xla_cache are fixtures
    MODEL_ARGS, ckpt32, decode, read, rows, xla_cache,
)
from transforms import layout

PROMPTS = ['{"id": "a", "prompt": "a red fox", "seed": 1}', '{"id": "b", "prompt": "a lighthouse", "seed": 2}']


def _job(tmp_path, out, ckpt, cache, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    args = [a for a in MODEL_ARGS if not a.startswith("--dtype")] + ["--dtype=bfloat16"]
    return run([f"--model={ckpt}", f"--input={prompts}", f"--output={out}", *args,
                f"--compilation_cache_dir={cache}", "--no_progress", *extra])[1]


def test_int8_images_record_it_and_a_resume_over_bf16_images_makes_them_again(tmp_path, ckpt32, xla_cache):
    out = tmp_path / "out"
    first = _job(tmp_path, out, ckpt32, xla_cache)
    bf16_rows = {r["id"]: r for r in rows(str(out), "manifest")}
    assert first["images_generated"] == 2 and {r["quantize"] for r in bf16_rows.values()} == {"none"}
    second = _job(tmp_path, out, ckpt32, xla_cache, "--quantize=int8", "--skip_existing")
    assert second["images_generated"] == 2 and second["stale"] == 2 and second["skipped"] == 0
    assert (first["quantize"], second["quantize"]) == ("none", "int8")  # summary.json says which
    int8_rows = {r["id"]: r for r in rows(str(out), "manifest")}
    for key, row in int8_rows.items():
        assert row["quantize"] == "int8"
        assert row["model_fingerprint"] != bf16_rows[key]["model_fingerprint"]
        _, text = decode(read(layout.join(str(out), row["file_name"])))
        assert text["quantize"] == "int8" and text["model_fingerprint"] == row["model_fingerprint"]
    third = _job(tmp_path, out, ckpt32, xla_cache, "--quantize=int8", "--skip_existing")
    assert third["images_generated"] == 0 and third["skipped"] == 2  # int8 images are kept by an int8 resume


def test_webdataset_shards_and_card_state_the_quantization(tmp_path, ckpt32, xla_cache):
    out = tmp_path / "wds"
    summary = _job(tmp_path, out, ckpt32, xla_cache, "--quantize=int8", "--output_format=webdataset")
    assert summary["images_generated"] == 2
    sidecars = sorted((out / "shards").glob("*.parquet"))
    assert sidecars and {r["quantize"] for f in sidecars for r in pq.read_table(f).to_pylist()} == {"int8"}
    card = (out / "README.md").read_text()
    assert "--quantize int8" in card
    assert {r["quantize"] for r in rows(str(out), "manifest")} == {"int8"}
