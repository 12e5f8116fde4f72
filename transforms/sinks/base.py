"""The sink interface: where a job's generated images go, and what the output already holds.

A sink is a PTransform, as Beam's own sinks are (WriteToText, WriteToParquet: one `expand` each), applied after the
job's one generation stage (transforms/generation.py):

    planned = tasks | sink.plan()            # {TASKS: to generate, EXISTING: rows, STALE: names, ...}
    made = planned[TASKS] | Generate(handler, batch_size)          # {IMAGES, FAILED}
    written = {**made, **the rest of planned} | sink
    # {MANIFEST: rows of the images this run stored, EXISTING: rows of the images found already there,
    #  ERRORS: error rows of the images that failed, STALE / DAMAGED / MISSING: names of images made again because
    #  the one there was another request's or model's / unreadable or damaged / not there, DONE: the sink's own files}

`plan()` runs before anything is generated: it looks at what the output already holds (`--skip_existing`) and may
give the tasks what the sink needs to know of them once generated (a shard and a key); whatever else it returns
besides TASKS (EXISTING, STALE and the sink's own collections) comes back to `expand` with the generated images.
Every sink builds its rows with the one builder (`layout.manifest_row`), encodes with `sinks.encoding` and stores
with `sinks.writes.StoreImagesFn`, so references, metrics and error rows are alike whichever sink is chosen. What
is common to every sink (the manifest, existing and errors files, the preview, the summary) the pipeline writes
from the collections a sink returns.
"""

from __future__ import annotations

import dataclasses

import apache_beam as beam

from ..generation import FAILED, IMAGES  # noqa: F401  (re-exported: the keys of what `expand` receives)
from ..identity import ModelIdentity
from .encoding import ImageEncoding

TASKS = "tasks"
MANIFEST = "manifest"
EXISTING = "existing"
ERRORS = "errors"
STALE = "stale"
DAMAGED = "damaged"  # names of images already there that were unreadable or damaged, so generated again
MISSING = "missing"  # names of images a --skip_existing run did not find there (deleted, or never written)
DONE = "done"


@dataclasses.dataclass(frozen=True)
class SinkSettings:
    """What every sink is told: the output folder (local or gs://), how images are encoded, the model fingerprint
    every image records, whether to keep what the output already holds (--skip_existing), encoder threads per
    worker process (None: its cores) and the local progress folder (None: no progress line)."""

    output: str
    encoding: ImageEncoding = ImageEncoding()
    model_fingerprint: str | None = None
    skip_existing: bool = False
    encode_threads: int | None = None
    progress_dir: str | None = None
    quantize: str = "none"  # the model's quantization, which the dataset card states
    dtype: str | None = None  # the model's dtype (--dtype), which every image records
    score_names: tuple[str, ...] = ()  # --score_model's scores, whose histograms the dataset card shows
    score_rules: tuple = ()  # --min_score / --max_score (transforms/score_filters.py): a resume applies them again
    drop_near_duplicates: int | None = None  # --drop_near_duplicates: the distance of its groups; None: keep all

    @property
    def model_identity(self) -> ModelIdentity:
        """What every image records of the model that made it (transforms/identity.py)."""
        return ModelIdentity(model_fingerprint=self.model_fingerprint, dtype=self.dtype, quantize=self.quantize)


class Sink(beam.PTransform):
    """Generated images -> stored, with their manifest rows. Subclasses implement `expand` (see the module docstring
    for what it receives and returns), `images_where` and, if the output can already hold images or the tasks need
    placing first, `plan`; a row of transforms/sinks/registry.py names the --output_format that selects them."""

    def __init__(self, settings: SinkSettings):
        super().__init__()
        self.settings = settings

    @classmethod
    def from_options(cls, settings: SinkSettings, output) -> "Sink":
        """The sink for the job's output options (`output`: the --output_format group's values as attributes, e.g.
        pipeline/specs.py's OutputSpec); a sink with options of its own reads them here."""
        return cls(settings)

    @classmethod
    def images_where(cls, output: str) -> str:
        """Where this sink's images are under `output`, as the job's closing lines name them."""
        raise NotImplementedError

    @classmethod
    def manifest_note(cls, output: str) -> str:
        """What the closing lines add after the manifest's location: the sink's own index of the images ("": none)."""
        return ""

    def plan(self) -> beam.PTransform:
        """Tasks -> {TASKS: those to generate, EXISTING: manifest rows of images already there, STALE: names of
        images there that were made for another request or model, ...}. By default the output holds nothing."""
        return NothingExisting()


class NothingExisting(beam.PTransform):
    """Tasks -> {TASKS: all of them, EXISTING, STALE, DAMAGED and MISSING: empty}."""

    def expand(self, tasks):
        return {TASKS: tasks, **{name: tasks.pipeline | f"No{name.title()}" >> beam.Create([])
                                 for name in (EXISTING, STALE, DAMAGED, MISSING)}}


def after(rows, done, label: str = "After"):
    """`rows`, released only once `done` is complete (a side input: the runner finishes `done` first)."""
    finished = done | f"{label}Count" >> beam.combiners.Count.Globally()
    return rows | label >> beam.Map(lambda row, _n: row, beam.pvalue.AsSingleton(finished))


def error_rows(failed):
    """FAILED ((task, error row) pairs) -> the error rows."""
    return failed | "ErrorRows" >> beam.Map(lambda pair: pair[1])
