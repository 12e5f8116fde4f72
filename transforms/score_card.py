"""`{output}/scores/`: a histogram of each score over the output's images (PNG, matplotlib) and a README.md that
shows them, written once every manifest row is known; the WebDataset card links the same images."""

from __future__ import annotations

import apache_beam as beam

from . import layout, retries, score_views

MAX_VALUES = 100_000  # scores sampled per histogram: its shape, without holding a large job's every row


class _WriteHistogramsFn(retries.CountingRetriesFn):
    def __init__(self, output: str, names: tuple[str, ...]):
        self._output = output
        self._names = names

    def process(self, scores: list[dict]):
        from .sinks.writes import write_bytes_atomic

        for name in self._names:
            values = [s.get(name) for s in scores if s.get(name) is not None]
            write_bytes_atomic(layout.join(self._output, score_views.histogram_file_name(name)),
                               score_views.histogram_png(name, values), mime_type="image/png")
        readme = f"# Scores of {len(scores)} images\n\n" + score_views.card_section(self._names, beside=True)
        write_bytes_atomic(layout.join(self._output, "scores/README.md"), readme.encode("utf-8"),
                           mime_type="text/markdown")
        yield len(scores)


class WriteScoreHistograms(beam.PTransform):
    """Manifest rows (this run's and those kept) -> `scores/NAME.png` for each of `names`, and scores/README.md."""

    def __init__(self, output: str, names: tuple[str, ...]):
        super().__init__()
        self._output = output
        self._names = tuple(names)

    def expand(self, rows):
        return (rows
                | "Scores" >> beam.Map(lambda row: row.get("scores") or {})
                | "SampleScores" >> beam.combiners.Sample.FixedSizeGlobally(MAX_VALUES)
                | "WriteHistograms" >> beam.ParDo(_WriteHistogramsFn(self._output, self._names)))
