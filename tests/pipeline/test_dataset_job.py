"""From images to a dataset, end to end with the tiny checkpoint (issue #59): a prompt template and a JSONL file in
one job; every image's pHash in its manifest row; near-duplicate groups in duplicates/ (two records with the same
prompt and seed under different ids are one group, every other image alone); --drop_near_duplicates keeps the
group's first image in metadata.jsonl and marks the other `duplicate_of`; the slot values are labels in the
manifest, metadata.jsonl and the image text stays; provenance XMP in every PNG; the card's statistics. In-process,
one loaded model (tests/support/fault_jobs.py CachedHandler).
"""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

import fault_jobs
from fault_jobs import install_handler
from pipeline.run import run
from pipeline_helpers import HEIGHT, WIDTH, ckpt32, xla_cache  # noqa: F401 - fixtures
from transforms import phash, provenance

RECORDS = [{"id": "twin-a", "prompt": "a red fox", "seed": 5},
           {"id": "twin-b", "prompt": "a red fox", "seed": 5},   # the same image as twin-a under another id
           {"id": "other-seed", "prompt": "a red fox", "seed": 6}]
TEMPLATE = {"template": "a {animal} in {place}", "slots": {"animal": ["cat", "dog"], "place": {"file": "places.txt"}},
            "seed": 1}


@pytest.fixture(scope="module")
def loaded(ckpt32, xla_cache):
    return fault_jobs.load_cached(ckpt32, compilation_cache_dir=xla_cache)


def _argv(model, inputs, out, xla, *extra):
    return [f"--model={model}", *(f"--input={i}" for i in inputs), f"--output={out}", f"--height={HEIGHT}",
            f"--width={WIDTH}", "--dtype=float32", "--max_sequence_length=32", "--batch_size=2", "--seed=3",
            f"--compilation_cache_dir={xla}", "--runner=FnApiRunner", "--no_progress", *extra]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_template_job_groups_near_duplicates_and_labels_images(ckpt32, loaded, xla_cache, monkeypatch, tmp_path):
    (tmp_path / "places.txt").write_text("a garden\n\na kitchen\n")
    template = tmp_path / "pets.template.json"
    template.write_text(json.dumps(TEMPLATE))
    records = tmp_path / "p.jsonl"
    records.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    out = tmp_path / "out"
    install_handler(monkeypatch)
    run(_argv(ckpt32, [str(template), str(records)], out, xla_cache, "--drop_near_duplicates"))

    manifest = {r["id"]: r for f in (out / "manifest").glob("manifest-*.jsonl") for r in _rows(f)}
    assert len(manifest) == 3 + 4
    labelled = [r for r in manifest.values() if r["metadata"]]
    assert sorted((r["metadata"]["animal"], r["metadata"]["place"]) for r in labelled) == [
        ("cat", "a garden"), ("cat", "a kitchen"), ("dog", "a garden"), ("dog", "a kitchen")]
    assert all(r["prompt"] == f"a {r['metadata']['animal']} in {r['metadata']['place']}" for r in labelled)
    for row in manifest.values():
        with Image.open(out / row["file_name"]) as im:
            im.load()
            assert phash.phash_image(im) == row["phash"]
            assert provenance.read_xmp(im)["DigitalSourceType"] == provenance.DIGITAL_SOURCE_TYPE
            assert im.text["prompt"] == row["prompt"]

    groups = [g for f in (out / "duplicates").glob("duplicates-*.jsonl") for g in _rows(f)]
    assert [g["ids"] for g in groups] == [["twin-a", "twin-b"]] and groups[0]["distances"] == [0, 0]
    assert manifest["twin-b"]["duplicate_of"] == "twin-a"
    assert all("duplicate_of" not in r for i, r in manifest.items() if i != "twin-b")
    kept = {r["id"] for r in _rows(out / "metadata.jsonl")}
    assert kept == set(manifest) - {"twin-b"}
    assert (out / manifest["twin-b"]["file_name"]).is_file()  # the image file stays
    card = (out / "README.md").read_text()
    assert "1 near-duplicate groups (`duplicates/`) hold 2 images" in card and (out / "card" / "labels.png").is_file()
    # (A resume takes the hashes from the manifest: tests/transforms/test_resume.py, without a second job here.)


def test_webdataset_job_drops_near_duplicates_from_its_shards(ckpt32, loaded, xla_cache, monkeypatch, tmp_path):
    """--drop_near_duplicates with --output_format webdataset: the shard is packed again without twin-b (its tar,
    sidecar, sizes.json agree), twin-b's manifest row stays marked `duplicate_of`, and a --skip_existing rerun keeps
    the repacked shard as complete (nothing generated again, nothing changed)."""
    import tarfile

    from transforms import shards

    records = tmp_path / "p.jsonl"
    records.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    out = tmp_path / "out"
    install_handler(monkeypatch)
    argv = _argv(ckpt32, [str(records)], out, xla_cache, "--drop_near_duplicates", "--output_format=webdataset")
    run(argv)

    def state():
        manifest = {r["id"]: r for f in (out / "manifest").glob("*-*.jsonl") for r in _rows(f)}  # manifest, existing
        with tarfile.open(out / "shards" / "00000.tar") as tar:
            in_tar = sorted(json.load(tar.extractfile(m))["id"] for m in tar if m.name.endswith(".json"))
        sidecar = sorted(r["id"] for r in shards.read_sidecar((out / "shards" / "00000.parquet").read_bytes()))
        sizes = json.loads((out / "sizes.json").read_text())
        return manifest, in_tar, sidecar, sizes

    manifest, in_tar, sidecar, sizes = state()
    assert set(manifest) == {"twin-a", "twin-b", "other-seed"}
    assert manifest["twin-b"]["duplicate_of"] == "twin-a"
    assert in_tar == sidecar == ["other-seed", "twin-a"]
    assert list(sizes.values()) == [2]
    first = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}

    # Resumed with and without the flag: the marker's `dropped` rows count twin-b as there, and mark it.
    for rerun in ([*argv, "--skip_existing"], [a for a in argv if a != "--drop_near_duplicates"] + ["--skip_existing"]):
        run(rerun)
        manifest, in_tar, sidecar, sizes = state()
        assert {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == first  # the shard is kept as it is
        assert set(manifest) == {"twin-a", "twin-b", "other-seed"} and manifest["twin-b"]["duplicate_of"] == "twin-a"
        assert in_tar == sidecar == ["other-seed", "twin-a"] and list(sizes.values()) == [2]
