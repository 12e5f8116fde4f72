"""`{output}/preview/`: something to look at after a run: a static gallery of the first N images by id.

    {output}/preview/index.html         self-contained page: thumbnails inlined as data: URIs, each with its id,
                                        prompt, seed and size, linking to the full image (files) or its shard
                                        (webdataset); every link relative, so the folder opens locally or copied
    {output}/preview/contact_sheet.jpg  the same thumbnails on one grid image

Every prompt and id goes through html.escape (a prompt is user data: `<script>` must stay text). The contact sheet
is a .jpg in its own folder: `datasets`' imagefolder only yields the images metadata.jsonl lists, so it is never
taken for a sample. Pure rendering functions, then the Beam transform that reads the images and writes the files.
"""

from __future__ import annotations

import base64
import html
import io
import logging
import tarfile
import urllib.parse

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from . import layout, retries, score_views

LOGGER = logging.getLogger(__name__)
PREVIEW_DIR = "preview"
INDEX_FILE = "index.html"
CONTACT_SHEET = "contact_sheet.jpg"
MAX_PREVIEW = 1000  # the page inlines every thumbnail: keep it a page, not a dataset
THUMB_SIZE = 160
SHEET_COLUMNS = 8
# The look of the project's pages: this gallery and benchmarks/quality.py's side-by-side comparison.
PAGE_STYLE = """body { font-family: system-ui, sans-serif; margin: 1em; background: #fafafa; color: #222; }
figure { margin: 0; background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
figure img { display: block; margin: 0 auto; max-width: 100%; image-rendering: pixelated; min-width: 96px; }
figcaption { font-size: 12px; overflow-wrap: anywhere; }
.p { color: #444; display: block; max-height: 8.5em; overflow-y: auto; }
.s { color: #264; } .f { color: #a22; }"""


class PreviewError(ValueError):
    def __init__(self, message: str, value):
        super().__init__(message)
        self.value = value


def check_preview(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_PREVIEW:
        raise PreviewError(f"--preview={n!r} is not an integer from 0 (off) to {MAX_PREVIEW}", n)
    return n


def thumbnail(data: bytes, size: int = THUMB_SIZE):
    """An image's bytes -> a PIL RGB image scaled to fit size x size (small images enlarged, pixels kept sharp)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
        scale = size / max(im.width, im.height)
        target = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
        return im.resize(target, Image.Resampling.NEAREST if scale > 1 else Image.Resampling.LANCZOS)


def jpeg_bytes(image, quality: int = 85) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def contact_sheet(thumbs: list, size: int = THUMB_SIZE, columns: int = SHEET_COLUMNS) -> bytes:
    """The thumbnails on a grid (row-major, in gallery order), as JPEG bytes."""
    from PIL import Image

    columns = max(1, min(columns, len(thumbs) or 1))
    rows = max(1, -(-len(thumbs) // columns))
    sheet = Image.new("RGB", (columns * size, rows * size), (32, 32, 32))
    for i, thumb in enumerate(thumbs):
        x, y = (i % columns) * size, (i // columns) * size
        sheet.paste(thumb, (x + (size - thumb.width) // 2, y + (size - thumb.height) // 2))
    return jpeg_bytes(sheet)


def relative_link(path: str) -> str:
    """A path relative to {output} as a URL relative to preview/index.html (quoted: ids may hold any character)."""
    return "../" + urllib.parse.quote(path, safe="/")


def render_html(items: list[dict], *, title: str, total: int | None = None, stats: str = "") -> str:
    """`items`: [{id, prompt, seed, width, height, link, thumb (JPEG bytes), member (or None)}] -> the page."""
    e = lambda v: html.escape(str(v), quote=True)  # noqa: E731
    cards = []
    for item in items:
        thumb = "data:image/jpeg;base64," + base64.b64encode(item["thumb"]).decode("ascii")
        where = f' &middot; {e(item["member"])} in' if item.get("member") else ""
        cards.append(
            f'<figure{score_views.card_attributes(item)}><a href="{e(item["link"])}"><img src="{thumb}" '
            f'alt="{e(item["id"])}" '
            f'title="{e(item["prompt"])}"></a><figcaption><b>{e(item["id"])}</b>{where} '
            f'<a href="{e(item["link"])}">{e(item["link_text"])}</a><br>seed {e(item["seed"])} &middot; '
            f'{e(item["width"])}x{e(item["height"])}<br><span class="p">{e(item["prompt"])}</span>'
            f'{score_views.card_caption(item)}</figcaption></figure>')
    names = score_views.score_names(items)  # --score_model: sortable by each score
    shown = f"{len(items)} of {total}" if total is not None else f"{len(items)}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
{PAGE_STYLE}
main {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 12px; }}
.plot {{ max-width: 100%; display: block; margin: 8px 0; }}
</style></head>
<body><h1>{e(title)}</h1>
<p>The first {shown} images by id. <a href="{CONTACT_SHEET}">Contact sheet</a> &middot;
<a href="../summary.json">summary.json</a></p>
{score_views.sort_control(names)}
{stats}
<main>
{chr(10).join(cards)}
</main>{score_views.SORT_SCRIPT if names else ""}</body></html>
"""


# --------------------------------------------------------------------------------------------- Beam
def _read(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


def _member_bytes(tar_uri: str, names: set[str]) -> dict[str, bytes]:
    """The members `names` of one tar, read in one streaming pass."""
    found = {}
    with FileSystems.open(tar_uri, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        with tarfile.open(fileobj=f, mode="r|") as tar:
            for info in tar:
                if info.name in names:
                    found[info.name] = tar.extractfile(info).read()
                    if len(found) == len(names):
                        break
    return found


def shard_relpath_of(uri: str) -> str:
    """The row's shard (`.../shards/00012.tar`) relative to the output: its last two path parts."""
    return "/".join(uri.replace("\\", "/").rsplit("/", 2)[-2:])


def in_shard(row: dict) -> bool:
    """Whether a manifest row's image is a member of a WebDataset shard (its `uri` is the tar) rather than a file."""
    return row["uri"].endswith(".tar")


class _WritePreviewFn(retries.CountingRetriesFn):
    def __init__(self, output: str):
        self._output = output

    def process(self, rows, total, stats=None):
        from .sinks.writes import write_bytes_atomic

        rows = sorted(rows, key=lambda r: (r["id"], r["file_name"]))
        data: dict[int, bytes] = {}
        by_shard: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            if in_shard(row):
                by_shard.setdefault(shard_relpath_of(row["uri"]), []).append(i)
                continue
            try:
                data[i] = _read(layout.join(self._output, row["file_name"]))
            except FileNotFoundError:
                LOGGER.warning("preview: %s is gone; left out", row["file_name"])
        for rel, indices in sorted(by_shard.items()):
            members = _member_bytes(layout.join(self._output, rel), {rows[i]["file_name"] for i in indices})
            for i in indices:
                if rows[i]["file_name"] in members:
                    data[i] = members[rows[i]["file_name"]]
        items, thumbs = [], []
        for i, row in enumerate(rows):
            if i not in data:
                continue
            thumb = thumbnail(data[i])
            thumbs.append(thumb)
            if in_shard(row):
                link = shard_relpath_of(row["uri"])
                member = row["file_name"]
            else:
                link, member = row["file_name"], None
            items.append({"id": row["id"], "prompt": row["prompt"], "seed": row["seed"], "width": row["width"],
                          "height": row["height"], "link": relative_link(link), "link_text": link,
                          "member": member, "thumb": jpeg_bytes(thumb),
                          **({"scores": row["scores"], "filtered": row.get("filtered")} if "scores" in row else {})})
        folder = layout.join(self._output, PREVIEW_DIR)
        write_bytes_atomic(layout.join(folder, CONTACT_SHEET), contact_sheet(thumbs), mime_type="image/jpeg")
        from .dataset_report import stats_html

        page = render_html(items, title="Generated images: preview", total=total,
                           stats=stats_html(stats[0] if stats else None))
        write_bytes_atomic(layout.join(folder, INDEX_FILE), page.encode("utf-8"), mime_type="text/html")
        yield len(items)


class WritePreview(beam.PTransform):
    """Manifest rows (this run's and those found already written) -> preview/index.html and contact_sheet.jpg of
    the first `n` by id. Only the n rows are gathered in one place; the images are read back from the output (a
    row whose `uri` is a tar, from that WebDataset shard; else its file)."""

    def __init__(self, output: str, n: int, stats=None):
        super().__init__()
        self._output = output
        self._n = check_preview(n)
        self._stats = stats  # a PCollection of the one stats dict (transforms/dataset_stats.py), or None

    def expand(self, rows):
        first = rows | "FirstById" >> beam.combiners.Top.Of(
            self._n, key=lambda r: (r["id"], r["file_name"]), reverse=True)
        total = rows | "CountAll" >> beam.combiners.Count.Globally()
        extra = [beam.pvalue.AsList(self._stats)] if self._stats is not None else []
        return first | "WritePreview" >> beam.ParDo(_WritePreviewFn(self._output), beam.pvalue.AsSingleton(total),
                                                    *extra)
