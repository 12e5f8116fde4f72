"""The scores on the preview page (a sort control per score, captions, escaped labels) and the histograms, plus the
score filters' rules (parsing, the first rule broken, NaN never passing)."""

import math

import pytest

from html_pages import parse
from transforms import score_filters, score_views
from transforms.preview import render_html

HOSTILE = 'label:<b>x</b>" onmouseover="alert(1)'


def _item(i, scores, filtered=None):
    return {"id": f"img{i}", "prompt": "p", "seed": i, "width": 32, "height": 32, "link": f"../images/img{i}.png",
            "link_text": f"images/img{i}.png", "member": None, "thumb": b"\xff\xd8", "scores": scores,
            "filtered": filtered}


def test_preview_sorts_by_each_score_and_escapes_label_names():
    items = [_item(0, {"clip_score": 30.5, HOSTILE: 0.25}),
             _item(1, {"clip_score": 12.0, HOSTILE: 0.75},
                   {"score": "clip_score", "value": 12.0, "threshold": 22.0, "rule": "clip_score>=22"})]
    page = render_html(items, title="t")
    parsed = parse(page)
    assert parsed.handlers == [] and "<b>x</b>" not in page  # the label is text, never markup
    assert 'id="sort"' in page and "clip_score, highest first" in page and "function" in page
    assert page.count("data-scores=") == 2 and "filtered: clip_score&gt;=22" in page
    plain = render_html([dict(_item(0, None), scores=None)], title="t")
    assert 'id="sort"' not in plain and "<script>" not in plain  # unscored outputs keep the page they had


def test_histograms_are_png_and_the_card_shows_them():
    png = score_views.histogram_png("label:nsfw content", [0.1, 0.2, 0.9, None])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert score_views.histogram_file_name("label:nsfw content") == "scores/label_nsfw_content.png"
    section = score_views.card_section(["clip_score", "label:nsfw content"])
    assert "![clip_score](scores/clip_score.png)" in section and "scores/label_nsfw_content.png" in section


def test_rules_parse_and_the_first_broken_one_is_named():
    rules = score_filters.parse_rules(["clip_score=22"], ["label:a=b content=0.5"])
    assert [r.text for r in rules] == ["clip_score>=22", "label:a=b content<=0.5"]
    assert score_filters.first_broken({"clip_score": 25, "label:a=b content": 0.4}, rules) is None
    assert score_filters.first_broken({"clip_score": 21.5, "label:a=b content": 0.9}, rules)["rule"] == \
        "clip_score>=22"
    broken = score_filters.first_broken({"clip_score": math.nan, "label:a=b content": 0.1}, rules)
    assert broken["score"] == "clip_score" and broken["value"] is None  # NaN never passes, and is written null
    with pytest.raises(ValueError, match="--min_score takes SCORE=THRESHOLD"):
        score_filters.parse_rule("clip_score", score_filters.MIN)
    with pytest.raises(ValueError, match="names 'label:cat'"):
        score_filters.check_rules(score_filters.parse_rules([], ["label:cat=0.5"]), ("clip_score", "label:dog"))
