"""The card's statistics, written once every image is: `{output}/card/labels.png` and `errors.png` (bar charts,
transforms/plots.py), `{output}/card/stats.json`, and the closing section of `{output}/README.md` (the WebDataset
sink's card, or a files output's own, transforms/dataset_card.py)."""

from __future__ import annotations

import json
import logging

import apache_beam as beam

from . import dataset_card, layout, retries

LOGGER = logging.getLogger(__name__)


def card_path(output: str) -> str:
    return layout.join(output, dataset_card.CARD_FILE)


def plot_path(output: str, name: str) -> str:
    return layout.join(output, f"{dataset_card.PLOTS_DIR}/{name}")


class _WriteReportFn(retries.CountingRetriesFn):
    def __init__(self, output: str, image_extension: str):
        self._output = output
        self._extension = image_extension

    def process(self, stats, _done=None):
        from . import plots
        from .sinks.writes import read_bytes, write_bytes_atomic

        out = self._output
        if stats["labels"]:
            write_bytes_atomic(plot_path(out, dataset_card.LABELS_PLOT), plots.labels_png(stats["labels"]),
                               mime_type="image/png")
        if stats["errors_by_kind"]:
            write_bytes_atomic(plot_path(out, dataset_card.ERRORS_PLOT), plots.errors_png(stats["errors_by_kind"]),
                               mime_type="image/png")
        write_bytes_atomic(plot_path(out, "stats.json"), json.dumps(stats, indent=1).encode("utf-8"),
                           mime_type="application/json")
        try:  # the WebDataset sink's card (written before this step runs), else the files output's own
            card = read_bytes(card_path(out)).decode("utf-8")
        except Exception:  # noqa: BLE001 - not there yet: a files output
            card = dataset_card.files_card(out, self._extension)
        write_bytes_atomic(card_path(out), dataset_card.with_stats(card, stats).encode("utf-8"),
                           mime_type="text/markdown")
        yield stats


class WriteDatasetReport(beam.PTransform):
    """The stats dict (transforms/dataset_stats.py) -> card/ plots, card/stats.json and the card's last section,
    once `done` (the sink's own files, the card among them) is complete."""

    def __init__(self, output: str, image_extension: str, done=None):
        super().__init__()
        self._output = output
        self._extension = image_extension
        self._done = done

    def expand(self, stats):
        extra = []
        if self._done is not None:
            extra = [beam.pvalue.AsList(self._done | "SinkDone" >> beam.combiners.Count.Globally())]
        return stats | "WriteReport" >> beam.ParDo(_WriteReportFn(self._output, self._extension), *extra)


def stats_html(stats: dict | None) -> str:
    """The preview page's statistics: the figures and the plots inlined as data: URIs (the page stands alone)."""
    import base64
    import html

    if not stats:
        return ""
    from . import plots

    e = lambda v: html.escape(str(v), quote=True)  # noqa: E731
    parts = ['<section class="stats"><h2>Labels, near duplicates and errors</h2>']

    def img(png: bytes, alt: str) -> str:
        return f'<img class="plot" alt="{e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'

    if stats["labels"]:
        slots = ", ".join(f"{e(s)} ({len(v)} values)" for s, v in stats["labels"].items())
        parts.append(f"<p>{stats['images']} images labelled by {slots}.</p>")
        parts.append(img(plots.labels_png(stats["labels"]), "Images per label"))
    largest = stats.get("largest_group")
    if stats["duplicate_groups"]:
        parts.append(f"<p>{stats['duplicate_groups']} near-duplicate groups hold {stats['images_in_groups']} "
                     f"images; the largest has {largest['size']}: {e(', '.join(largest['ids']))}.</p>")
    else:
        parts.append("<p>No near-duplicate images.</p>")
    if stats["errors_by_kind"]:
        parts.append(f"<p>{sum(stats['errors_by_kind'].values())} error rows: "
                     f"{e(', '.join(f'{k}: {n}' for k, n in stats['errors_by_kind'].items()))}.</p>")
        parts.append(img(plots.errors_png(stats["errors_by_kind"]), "Errors by kind"))
    else:
        parts.append("<p>No error rows.</p>")
    parts.append("</section>")
    return "\n".join(parts)
