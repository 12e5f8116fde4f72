"""The dataset card's and the preview's statistics (transforms/dataset_stats.py, plots.py, dataset_card.py,
dataset_report.py): label counts per slot from the rows' metadata, near-duplicate groups and errors by kind, as
figures in the card and as PNG bar charts that decode; the preview page with them renders in headless Chromium."""

import io

import apache_beam as beam
from apache_beam.testing.util import assert_that, equal_to
from PIL import Image

from html_pages import Links, rendered_dom, screenshot
from transforms import dataset_card, plots, preview
from transforms.dataset_report import stats_html
from transforms.dataset_stats import DatasetStats, summarize

ROWS = [{"id": f"r{i}", "file_name": f"images/r{i}.png",
         "metadata": {"animal": ["cat", "dog", "eel"][i % 3], "place": ["garden", "roof"][i % 2], "n": i}}
        for i in range(12)]
GROUPS = [{"ids": ["r1", "r4"], "file_names": ["images/r1.png", "images/r4.png"], "distances": [0, 1]},
          {"ids": ["r2", "r5", "r8"], "file_names": ["images/r2.png", "images/r5.png", "images/r8.png"],
           "distances": [0, 0, 2]}]
ERRORS = [{"kind": "invalid_record"}, {"kind": "invalid_record"}, {"kind": "inference_failed"}]
STATS = summarize({"animal": {"cat": 4, "dog": 4, "eel": 4}, "place": {"garden": 6, "roof": 6}}, GROUPS,
                  {"invalid_record": 2, "inference_failed": 1}, 12)


def test_stats_step_counts_labels_groups_and_errors():
    with beam.Pipeline() as p:
        stats = {"rows": p | "Rows" >> beam.Create(ROWS), "groups": p | "Groups" >> beam.Create(GROUPS),
                 "errors": p | "Errors" >> beam.Create(ERRORS)} | DatasetStats()
        assert_that(stats, equal_to([STATS]))
    assert STATS["largest_group"] == {"size": 3, "ids": ["r2", "r5", "r8"]} and STATS["duplicate_groups"] == 2


def test_card_section_and_plots():
    card = dataset_card.with_stats(dataset_card.files_card("/data/out", "png"), STATS)
    assert "12 images labelled by `animal` (3 values), `place` (2 values)" in card
    assert "2 near-duplicate groups (`duplicates/`) hold 5 images; the largest has 3 (`r2`, `r5`, `r8`)" in card
    assert "3 error rows (`errors/`): inference_failed: 1, invalid_record: 2." in card
    assert "](card/labels.png)" in card and "](card/errors.png)" in card
    again = dataset_card.with_stats(card, {**STATS, "duplicate_groups": 0})
    assert again.count(dataset_card.STATS_MARKER) == 1 and "No near-duplicate images" in again
    for png in (plots.labels_png(STATS["labels"]), plots.errors_png(STATS["errors_by_kind"])):
        with Image.open(io.BytesIO(png)) as im:
            assert im.format == "PNG" and im.width > 300 and im.height > 150
    assert plots.top_counts({str(i): i for i in range(30)}, 3) == [("29", 29), ("28", 28), ("27", 27),
                                                                   ("(27 others)", sum(range(27)))]


def test_preview_page_with_stats_renders_in_chromium(tmp_path):
    page = preview.render_html([], title="t", total=0, stats=stats_html(STATS))
    index = tmp_path / "index.html"
    index.write_text(page, encoding="utf-8")
    parsed = Links()
    parsed.feed(rendered_dom(index))
    assert parsed.tags.count("img") == 2 and "section" in parsed.tags
    text = " ".join(parsed.text)
    assert "2 near-duplicate groups hold 5 images; the largest has 3: r2, r5, r8." in text
    screenshot(index, tmp_path / "shot.png")
    with Image.open(tmp_path / "shot.png") as shot:
        assert shot.getextrema() != ((255, 255), (255, 255), (255, 255))
