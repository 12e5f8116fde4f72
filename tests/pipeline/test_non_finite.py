"""Images whose values overflow are error rows, never files: the generator reports where NaN/inf appeared, `generate`
raises, and the job writes an error row (kind non_finite_image) instead of the image, in both output formats."""

import json
import os
import shutil

import numpy as np
import pytest

from pipeline_helpers import MODEL_ARGS, ckpt32, rows  # noqa: F401 - ckpt32 is a fixture


def _overflowing_copy(ckpt: str, dest: str) -> str:
    """The checkpoint with the transformer's output projection scaled to float32's edge: its velocity overflows."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(ckpt, dest)
    folder = os.path.join(dest, "transformer")
    index = [n for n in os.listdir(folder) if n.endswith(".index.json")]
    if index:
        with open(os.path.join(folder, index[0])) as fh:
            name = json.load(fh)["weight_map"]["proj_out.weight"]
    else:
        name = next(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    tensors = load_file(os.path.join(folder, name))
    tensors["proj_out.weight"] = (np.sign(tensors["proj_out.weight"]) * 3e38).astype(tensors["proj_out.weight"].dtype)
    save_file(tensors, os.path.join(folder, name))
    return dest


@pytest.fixture(scope="module")
def bad_ckpt(ckpt32, tmp_path_factory):
    return _overflowing_copy(ckpt32, str(tmp_path_factory.mktemp("overflow") / "ckpt"))


def test_generator_reports_where_values_stopped_being_finite(bad_ckpt, ckpt32):
    import model

    bad = model.load(bad_ckpt, "float32", max_sequence_length=32)
    result = bad.generate_result(["a red fox", "a lighthouse"], [1, 2], height=32, width=64)
    assert [n.stage for n in result.nonfinite] == ["denoise", "denoise"]
    assert all(0 < n.fraction <= 1 for n in result.nonfinite)
    with pytest.raises(model.NonFiniteImageError, match="non-finite values after denoise") as e:
        bad.generate(["a red fox"], [1], height=32, width=64)
    assert set(e.value.images) == {0}
    good = model.load(ckpt32, "float32", max_sequence_length=32)
    assert good.generate_result(["a red fox"], [1], height=32, width=64).nonfinite == (None,)


@pytest.mark.parametrize("output_format", ["files", "webdataset"])
def test_job_writes_error_rows_not_images(bad_ckpt, tmp_path, output_format):
    from pipeline.run import run

    source = tmp_path / "prompts.txt"
    source.write_text("a red fox\na lighthouse\na bowl of cherries\n")
    out = tmp_path / "out"
    result, summary = run([f"--model={bad_ckpt}", f"--input={source}", f"--output={out}", *MODEL_ARGS,
                           f"--output_format={output_format}", "--runner=FnApiRunner", "--no_progress",
                           "--compilation_cache_dir=off"])
    errors = rows(str(out), "errors")
    assert summary["images_generated"] == 0 and len(errors) == 3
    assert {e["kind"] for e in errors} == {"non_finite_image"}
    assert all("non-finite values after denoise" in e["reason"] and "nothing was written" in e["reason"]
               for e in errors)
    assert not os.path.isdir(out / "images") or not os.listdir(out / "images")
    counters = {m.key.metric.name: m.committed for m in result.metrics().query()["counters"]}
    assert counters.get("images_non_finite") == 3
