"""Scores and filters end to end (tiny klein, tiny random CLIP with a LAION-layout head): every manifest row carries
the image's scores, equal to the scorer's on the stored pixels; a --min_score rule puts the images it breaks under
filtered/, out of metadata.jsonl, with a `filtered` field naming score, value and threshold; summary.json counts
them per rule; a --skip_existing resume with other thresholds generates nothing and filters the kept images again
(moving those whose decision changed); the launch refuses a head in another layout and a filter naming an unknown score."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeline.errors import UsageError
from pipeline.run import run
from pipeline_helpers import MODEL_ARGS, ckpt32, decode, rows, xla_cache  # noqa: F401 - fixtures
from tiny_clip import build_tiny_clip, save_head

RECORDS = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(
    ["a red fox in snow", "a blue house", "a bowl of fruit", "two cats", "rain at night", "a tall ship"])]
# With these seeds the rules split the images: clip_score 0 for four of them, "a photo" above 0.2 for one more.
RULES = ("--min_score=clip_score=5", "--max_score=label:a photo=0.2")


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("score-model")
    build_tiny_clip(str(folder / "clip"))
    save_head(str(folder / "aesthetic.safetensors"), sizes=(16, 8, 1))
    return folder


def _argv(ckpt, inp, out, xla, clip_dir, *extra):
    return [f"--model={ckpt}", f"--input={inp}", f"--output={out}", *MODEL_ARGS, "--runner=FnApiRunner",
            "--no_progress", f"--compilation_cache_dir={xla}", f"--score_model={clip_dir / 'clip'}",
            "--score_labels=a photo,a drawing", f"--score_heads=aesthetic={clip_dir / 'aesthetic.safetensors'}",
            *extra]


def test_scores_in_manifest_and_filters_route_images_out(ckpt32, xla_cache, clip_dir, tmp_path):
    import jax.numpy as jnp

    from model.engine.scoring import load_scorer
    from model.options import EngineOptions
    from model.parallel.mesh import make_mesh
    from model.config.score_settings import ScoreSettings

    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    out = tmp_path / "out"
    _, summary = run(_argv(ckpt32, inp, out, xla_cache, clip_dir, *RULES))
    manifest = {r["id"]: r for r in rows(str(out), "manifest")}
    assert set(manifest) == {r["id"] for r in RECORDS}  # every image keeps its row
    low = {i for i, r in manifest.items() if r["scores"]["clip_score"] < 5}
    photo = {i for i, r in manifest.items() if r["scores"]["label:a photo"] > 0.2} - low  # the first rule broken
    broken = low | photo
    assert low and photo and len(broken) < len(RECORDS)  # both rules and the dataset have images
    scorer = load_scorer(ScoreSettings(str(clip_dir / "clip"), labels=("a photo", "a drawing"),
                                       heads=(("aesthetic", str(clip_dir / "aesthetic.safetensors")),)),
                         mesh=make_mesh(EngineOptions()), dtype=jnp.float32)
    stored = [manifest[r["id"]] for r in RECORDS]
    pixels = np.stack([decode((out / row["file_name"]).read_bytes())[0] for row in stored])
    expected = scorer.to_host(scorer.score(jnp.asarray(pixels), [row["prompt"] for row in stored]), len(stored))
    for row, want in zip(stored, expected):
        assert row["scores"].keys() == want.keys()
        np.testing.assert_allclose(list(row["scores"].values()), list(want.values()), rtol=1e-4, atol=1e-4)
        if row["id"] in low:
            assert row["filtered"] == {"score": "clip_score", "value": row["scores"]["clip_score"],
                                       "threshold": 5.0, "rule": "clip_score>=5"}
        elif row["id"] in photo:
            assert row["filtered"] == {"score": "label:a photo", "value": row["scores"]["label:a photo"],
                                       "threshold": 0.2, "rule": "label:a photo<=0.2"}
        if row["id"] in broken:
            assert row["file_name"].startswith("filtered/")
        else:
            assert row["filtered"] is None and row["file_name"].startswith("images/")
        assert (out / row["file_name"]).is_file()
    listed = [json.loads(line)["id"] for line in (out / "metadata.jsonl").read_text().splitlines()]
    assert sorted(listed) == sorted(set(manifest) - broken)
    assert sorted(os.listdir(out / "filtered")) == sorted(f"{i}.png" for i in broken)
    assert summary["filtered_by_rule"] == {"clip_score>=5": len(low), "label:a photo<=0.2": len(photo)}
    assert summary["images_generated"] == len(RECORDS)

    # A resume with other thresholds generates nothing: the kept images' scores are filtered again, and the images
    # whose decision changed move (the label rule dropped: its images go back to images/, the others stay).
    _, again = run(_argv(ckpt32, inp, out, xla_cache, clip_dir, RULES[0], "--skip_existing"))
    assert again["images_generated"] == 0 and again["skipped"] == len(RECORDS) and again["stale"] == 0
    kept = {r["id"]: r for r in rows(str(out), "existing")}
    for i, row in manifest.items():
        assert kept[i]["scores"] == row["scores"]
        assert kept[i]["filtered"] == (row["filtered"] if i in low else None)
        assert kept[i]["file_name"] == (row["file_name"] if i in low else f"images/{i}.png")
        assert (out / kept[i]["file_name"]).read_bytes() and kept[i]["sha256"] == row["sha256"]
    assert sorted(os.listdir(out / "filtered")) == sorted(f"{i}.png" for i in low)
    listed = [json.loads(line)["id"] for line in (out / "metadata.jsonl").read_text().splitlines()]
    assert sorted(listed) == sorted(set(manifest) - low)
    assert again["filtered_by_rule"] == {"clip_score>=5": len(low)}


def test_launch_refuses_heads_in_other_layouts_and_unknown_scores(ckpt32, xla_cache, clip_dir, tmp_path):
    from safetensors.numpy import save_file

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(RECORDS[0]) + "\n")
    other = tmp_path / "mlp.safetensors"
    save_file({"mlp.fc1.weight": np.zeros((8, 16), np.float32)}, str(other))
    argv = _argv(ckpt32, inp, tmp_path / "o1", xla_cache, clip_dir)
    with pytest.raises(UsageError, match=r"mlp\.fc1\.weight"):
        run(argv[:-1] + [f"--score_heads=aesthetic={other}"])
    with pytest.raises(UsageError, match="label:a cat"):
        run(argv + ["--max_score=label:a cat=0.5"])
    assert not (tmp_path / "o1" / "images").exists()
