"""A resume knows the model by its content: the same checkpoint folder with one tensor edited in place (same configs,
file names and sizes, even the same mtime: a fine-tune saved the same way, or weights edited where they lie) is
another model, so `--skip_existing` makes every image again and counts it stale, and the rows name the new model."""

import os
import shutil

from pipeline.run import run
from pipeline_helpers import MODEL_ARGS, ckpt32, rows  # noqa: F401 - ckpt32 is a fixture


def _edit_one_tensor_in_place(folder: str) -> str:
    """Flip the lowest bit of a value of the last tensor of one weight file, keeping its size and mtime."""
    weights = sorted(os.path.join(top, name) for top, _dirs, names in os.walk(folder)
                     for name in names if name.endswith(".safetensors") and "transformer" in top)[-1]
    st = os.stat(weights)
    with open(weights, "r+b") as f:
        f.seek(st.st_size - 4)  # a low mantissa byte of one of the last values, never the header
        byte = f.read(1)
        f.seek(st.st_size - 4)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(weights) == st.st_size
    return weights


def test_another_checkpoint_with_the_same_files_regenerates_everything_as_stale(ckpt32, tmp_path, monkeypatch):
    monkeypatch.setenv("FLUX2_KLEIN_CACHE", str(tmp_path / "cache"))
    ckpt = str(shutil.copytree(ckpt32, tmp_path / "ckpt"))
    source = tmp_path / "p.txt"
    source.write_text("".join(f"prompt number {i}\n" for i in range(5)))
    out = tmp_path / "out"
    argv = [f"--model={ckpt}", f"--input={source}", f"--output={out}", *MODEL_ARGS, "--runner=FnApiRunner",
            "--no_progress"]
    _, first = run(argv)
    assert first["images_generated"] == 5
    before = {r["model_fingerprint"] for r in rows(str(out), "manifest")}
    _edit_one_tensor_in_place(ckpt)
    _, second = run(argv + ["--skip_existing"])
    assert (second["skipped"], second["images_generated"], second["stale"]) == (0, 5, 5)
    after = {r["model_fingerprint"] for r in rows(str(out), "manifest")}
    assert len(before) == len(after) == 1 and before != after


def test_a_resume_remakes_each_damaged_image_and_the_summary_says_why(ckpt32, tmp_path):
    """Issue 57's user damaged 4 images of a finished job: one copied over another, one truncated, one with a byte
    flipped, one deleted. The `--skip_existing` rerun makes those 4 again, byte for byte, and its summary counts
    each by what was wrong (it once said "stale 1" and nothing of the other 3). Every row names its dtype."""
    source = tmp_path / "p.txt"
    source.write_text("".join(f"prompt number {i}\n" for i in range(5)))
    out = tmp_path / "out"
    argv = [f"--model={ckpt32}", f"--input={source}", f"--output={out}", *MODEL_ARGS, "--runner=FnApiRunner",
            "--no_progress"]
    run(argv)
    images = out / "images"
    names = sorted(os.listdir(images))
    made = {name: (images / name).read_bytes() for name in names}
    (images / names[1]).write_bytes(made[names[0]])
    (images / names[2]).write_bytes(made[names[2]][: len(made[names[2]]) // 2])
    flipped = bytearray(made[names[3]])
    flipped[len(flipped) // 2] ^= 0xFF
    (images / names[3]).write_bytes(bytes(flipped))
    (images / names[4]).unlink()
    _, second = run(argv + ["--skip_existing"])
    assert {name: (images / name).read_bytes() for name in os.listdir(images)} == made
    assert (second["images_generated"], second["skipped"]) == (4, 1)
    assert (second["stale"], second["damaged"], second["missing"]) == (1, 2, 1)
    every_row = rows(str(out), "manifest") + rows(str(out), "existing")
    assert len(every_row) == 5 and {(r["dtype"], r["quantize"]) for r in every_row} == {("float32", "none")}
