"""benchmarks/quality.py on the tiny checkpoint: a prompt file read as the job reads it (an invalid record skipped),
each image in bf16 and int8 with the same seed, PSNR/SSIM per image and their distribution, the side-by-side page
worst first with every prompt escaped (also as headless chromium renders it), one model in memory at a time."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from html_pages import parse, rendered_dom, screenshot

# test_quantize.py's shapes: in one test session the compiled programs are shared through the XLA cache.
SIZE = ["--height", "64", "--width", "96", "--max_sequence_length", "32"]
HOSTILE = "a lighthouse <script>document.title='pwned'</script> at dusk & </figcaption><b>bold</b>"
RECORDS = [
    {"id": "fox", "prompt": "a red fox in snow", "seed": 3},
    {"id": "odd", "prompt": "a size that is no multiple", "height": 66},
    {"id": "hostile", "prompt": HOSTILE, "seed": 4},
]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def run(tiny_ckpt, tmp_path_factory):
    """main() once: (the returned report, the output folder, stdout)."""
    from benchmarks import quality

    folder = tmp_path_factory.mktemp("quality")
    prompts = _jsonl(folder / "prompts.jsonl", RECORDS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = quality.main(["--model", tiny_ckpt, "--input", prompts, "--output", str(folder / "out"), *SIZE])
    return report, folder / "out", out.getvalue()


def test_every_valid_prompt_is_compared_and_the_invalid_one_reported(run):
    report, out, stdout = run
    last = json.loads(stdout.strip().splitlines()[-1])
    assert last == json.loads((out / "quality.json").read_text())  # the JSON line is last, and the file holds it
    assert last["quantize"] == "int8" and last["dtype"] == "bfloat16"
    assert sorted(i["id"] for i in last["images"]) == ["fox", "hostile"]
    assert [(s["line"], s["field"]) for s in last["skipped"]] == [(2, "height")]
    for image in last["images"]:
        assert math.isfinite(image["psnr"]) and image["psnr"] > 0, image
        assert 0 < image["ssim"] <= 1 and image["max_abs"] > 0, image  # int8 is not bf16 by another name
        assert image["seed"] == {"fox": 3, "hostile": 4}[image["id"]] and image["error"] is None
        pixels = {}
        for folder in ("reference", "int8", "diff"):
            with Image.open(out / folder / f"{image['id']}.png") as im:
                pixels[folder] = np.asarray(im.convert("RGB")).astype(int)
            assert pixels[folder].shape == (64, 96, 3)
        assert not np.array_equal(pixels["reference"], pixels["int8"])
        assert np.array_equal(pixels["diff"], np.minimum(abs(pixels["reference"] - pixels["int8"]) * 8, 255))
    for name in ("psnr", "ssim"):
        values = sorted(i[name] for i in last["images"])
        stats = last["distribution"][name]
        assert stats["min"] == values[0] and stats["max"] == values[-1] and stats["p5"] == values[0]
        assert stats["median"] == pytest.approx(sum(values) / 2) == stats["mean"]
    assert last["flagged"] == sum(i["psnr"] < 30 or i["ssim"] < 0.9 for i in last["images"])


def test_the_page_shows_the_worst_first_with_relative_links(run):
    report, out, _ = run
    page = (out / "index.html").read_text(encoding="utf-8")
    images = json.loads((out / "quality.json").read_text())["images"]
    worst_first = [i["id"] for i in sorted(images, key=lambda i: (i["ssim"], i["psnr"]))]
    assert [i["id"] for i in images] == worst_first
    shown = [page.index(f"<b>{name}</b>") for name in worst_first]
    assert shown == sorted(shown)  # the page's rows in that order
    for image in images:
        assert f"SSIM {image['ssim']:.4f}" in page and f"PSNR {image['psnr']:.2f} dB" in page
    parsed = parse(page)
    files = list(parsed.refs)
    assert files and all("://" not in r and not r.startswith("/") for r in files)
    assert {r for r in files if r.endswith(".png")} == {f"{d}/{i}.png" for d in ("reference", "int8", "diff")
                                                        for i in ("fox", "hostile")}
    for ref in files:
        assert (out / ref).is_file(), ref


def test_the_page_escapes_prompts(run):
    _, out, _ = run
    page = (out / "index.html").read_text(encoding="utf-8")
    parsed = parse(page)
    assert "script" not in parsed.tags and parsed.handlers == [] and "<b>bold</b>" not in page
    assert "&lt;script&gt;" in page and HOSTILE in "".join(parsed.text)  # shown whole, as text


def test_chromium_renders_the_page_without_running_injected_script(run, tmp_path):
    _, out, _ = run
    dom = rendered_dom(out / "index.html")
    parsed = parse(dom)
    assert "<title>Quantization check: int8 against reference (bfloat16)</title>" in dom  # not "pwned"
    assert "script" not in parsed.tags and parsed.handlers == []
    assert parsed.tags.count("section") == 2 and parsed.tags.count("img") == 6
    shot = tmp_path / "page.png"
    screenshot(out / "index.html", shot)
    with Image.open(shot) as im:
        pixels = np.asarray(im.convert("RGB"))
    assert pixels.std() > 10  # the images drew (a blank or text-only page is nearly uniform)


def test_a_phase_frees_its_model_before_the_next_loads(tiny_ckpt, tmp_path):
    import jax

    from benchmarks import quality
    from transforms.inputs.columns import ColumnMap
    from transforms.inputs.validation import RequestDefaults

    requests, _ = quality.read_requests(_jsonl(tmp_path / "p.jsonl", RECORDS[:1]), "auto",
                                        RequestDefaults(height=64, width=96, size_multiple=4), ColumnMap())
    tasks, _ = quality.image_tasks(requests, 8)
    before = sum(a.nbytes for a in jax.live_arrays())
    failed, _ = quality.generate_phase(tiny_ckpt, tasks, str(tmp_path / "ref"), dtype="bfloat16", quantize="none",
                                       batch_size=1, max_sequence_length=32)
    assert failed == {} and (tmp_path / "ref" / "fox.png").is_file()
    assert sum(a.nbytes for a in jax.live_arrays()) == before  # no weight of the model is left on the device


def test_records_are_read_as_the_job_reads_them(tmp_path):
    from benchmarks import quality
    from transforms.inputs.columns import ColumnMap
    from transforms.inputs.validation import RequestDefaults

    table = tmp_path / "prompts.csv"
    table.write_text("caption,id,seed,num_images,width\n"
                     "a cat,cat,7,2,\n"
                     "a dog,dog,,1,32\n"
                     "a cat,cat,7,2,\n"           # the same request again: dropped silently
                     "another cat,cat,8,1,\n"     # the same id, other parameters: skipped
                     ",empty,1,1,\n", encoding="utf-8")  # no prompt: invalid
    defaults = RequestDefaults(height=16, width=24, seed=5, size_multiple=4)
    requests, errors = quality.read_requests(str(table), "auto", defaults, ColumnMap(prompt_column="caption"))
    assert [e["line"] for e in errors] == [6]
    kept, skipped = quality.comparable(requests)
    assert [r.id for r in kept] == ["cat", "dog"] and [s["line"] for s in skipped] == [5]
    dog = kept[1]
    assert (dog.height, dog.width, dog.prompt) == (16, 32, "a dog") and dog.seed != 5  # derived, as the job does
    tasks, left_out = quality.image_tasks(kept, 2)
    assert [(quality.file_name(t), t.seed) for t in tasks] == [("cat-0.png", 7), ("cat-1.png", 8)]
    assert left_out == 1
    assert [[quality.file_name(t) for t in b] for b in quality.batches(quality.image_tasks(kept, 9)[0], 1)] == \
        [["cat-0.png"], ["cat-1.png"], ["dog.png"]]


def test_distribution_and_order_handle_identical_and_failed_images():
    from benchmarks import quality

    stats = quality.distribution([40.0, math.inf, 20.0, math.inf])
    assert stats["min"] == 20.0 and stats["p5"] == 20.0 and stats["median"] == math.inf
    assert quality.distribution([]) == dict.fromkeys(("min", "p5", "median", "mean", "max"))
    assert quality.distribution([0.5, 0.9, 0.7])["p5"] == 0.5  # an observation, never an interpolation
    images = [{"file": "a", "psnr": 35.0, "ssim": 0.95}, {"file": "b", "psnr": None, "ssim": None},
              {"file": "c", "psnr": 25.0, "ssim": 0.95}, {"file": "d", "psnr": math.inf, "ssim": 1.0}]
    assert [i["file"] for i in quality.worst_first(images)] == ["b", "c", "a", "d"]
    assert [quality.is_flagged(i, 30.0, 0.9) for i in images] == [False, True, True, False]
    assert json.loads(json.dumps(quality.json_safe({"x": [math.inf, 1.5]}), allow_nan=False)) == {"x": [None, 1.5]}


def test_an_input_without_a_comparable_record_is_a_usage_error(tiny_ckpt, tmp_path, capsys):
    from benchmarks import quality

    prompts = _jsonl(tmp_path / "p.jsonl", RECORDS[1:2])
    for input_, says in ((prompts, "holds no record to compare"), (str(tmp_path / "none*.jsonl"), "matches no file")):
        with pytest.raises(SystemExit) as exit_:
            quality.main(["--model", tiny_ckpt, "--input", input_, "--output", str(tmp_path / "out"), *SIZE])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing generated
