"""The preview gallery (transforms/preview.py): every prompt escaped, only relative links, and the page as a real
browser (headless chromium, when installed) renders it: no injected element, no script run."""

import io

import numpy as np
import pytest
from PIL import Image

from html_pages import Links, rendered_dom
from transforms import preview

HOSTILE = ['<script>document.title="pwned"</script>', '"><img src=x onerror="document.title=\'pwned\'">',
           "a & b </figcaption><b>bold</b>"]


def _png(color) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 64, 3), color, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _page(tmp_path):
    items = []
    for i, prompt in enumerate(HOSTILE):
        thumb = preview.jpeg_bytes(preview.thumbnail(_png(40 * i)))
        items.append({"id": f"id-{i}<i>", "prompt": prompt, "seed": i, "width": 64, "height": 32,
                      "link": preview.relative_link(f"images/id-{i}.png"), "link_text": f"images/id-{i}.png",
                      "member": None, "thumb": thumb})
        (tmp_path / "images").mkdir(exist_ok=True)
        (tmp_path / "images" / f"id-{i}.png").write_bytes(_png(40 * i))
    folder = tmp_path / "preview"
    folder.mkdir()
    (folder / preview.CONTACT_SHEET).write_bytes(preview.contact_sheet(
        [preview.thumbnail(_png(40 * i)) for i in range(3)]))
    (tmp_path / "summary.json").write_text("{}")
    page = preview.render_html(items, title="t", total=3)
    (folder / preview.INDEX_FILE).write_text(page, encoding="utf-8")
    return folder / preview.INDEX_FILE, page


def test_page_escapes_prompts_and_links_only_existing_relative_files(tmp_path):
    index, page = _page(tmp_path)
    parsed = Links()
    parsed.feed(page)
    assert "script" not in parsed.tags and parsed.handlers == [] and parsed.tags.count("img") == 3
    assert "<b>bold</b>" not in page and "&lt;script&gt;" in page
    text = "".join(parsed.text)
    for prompt in HOSTILE:
        assert prompt in text  # shown as text, whole
    files = [r for r in parsed.refs if not r.startswith("data:")]
    assert files and all("://" not in r and not r.startswith("/") for r in files)
    for ref in files:
        assert (index.parent / ref).resolve().is_file(), ref
    sheet = Image.open(index.parent / preview.CONTACT_SHEET)
    assert sheet.size == (3 * preview.THUMB_SIZE, preview.THUMB_SIZE)


def test_preview_count_is_checked():
    assert preview.check_preview(0) == 0 and preview.check_preview(64) == 64
    for bad in (-1, preview.MAX_PREVIEW + 1, 1.5, True):
        with pytest.raises(preview.PreviewError):
            preview.check_preview(bad)


def test_chromium_renders_the_page_without_running_injected_script(tmp_path):
    index, _ = _page(tmp_path)
    dom = rendered_dom(index)
    parsed = Links()
    parsed.feed(dom)
    assert "<title>t</title>" in dom  # an executed injection would have set the title to "pwned"
    assert "pwned" not in "".join(t for t in parsed.text if "document.title" not in t)
    assert "script" not in parsed.tags and parsed.handlers == [] and parsed.tags.count("figure") == 3
