"""Templates (transforms/inputs/template.py) -> validated `GenerationRequest`s, in the pipeline: each template's
records are cut into ranges of positions that are spread over the workers, and every worker makes its records from
their positions alone. No process ever holds a template's product, or even the list of its positions.

A record is validated as any other (transforms/inputs/validation.py): its prompt, the template's `parameters` and
its id; its slot values are its labels, kept as its metadata (a column per slot in the manifest rows,
metadata.jsonl and the WebDataset json). A record that fails (a prompt over --max_prompt_bytes) is its error row.
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam.metrics import Metrics

from .. import layout
from ..metrics import NAMESPACE as METRICS_NAMESPACE
from ..requests import INVALID_TAG
from .coercion import InvalidRecord
from .template import Template, chunks
from .validation import RequestDefaults, validate_record

CHUNK_RECORDS = 5000  # positions one work item expands: small enough to spread, large enough to be cheap


def template_request(template: Template, position: int, defaults: RequestDefaults):
    """Record number `position` of `template` as a GenerationRequest, or its error row."""
    request_id, prompt, labels = template.record(position)
    fields = {**dict(template.parameters), "prompt": prompt, "id": request_id}
    try:
        return validate_record(fields, defaults, source=template.source, line=position + 1, extra=labels)
    except InvalidRecord as e:
        return layout.error_row(source=template.source, line=position + 1, reason=e.reason, record=prompt,
                                id=request_id, field=e.field, value=e.value, kind=e.kind)


class _ExpandRangeFn(beam.DoFn):
    """(template number, start, stop) -> the requests of those positions (main) or their error rows (INVALID_TAG)."""

    def __init__(self, templates: tuple[Template, ...], defaults: RequestDefaults):
        self._templates = templates
        self._defaults = defaults
        self._read = Metrics.counter(METRICS_NAMESPACE, "records_read")
        self._invalid = Metrics.counter(METRICS_NAMESPACE, "records_invalid")

    def process(self, work):
        number, start, stop = work
        template = self._templates[number]
        for position in range(start, stop):
            self._read.inc()
            made = template_request(template, position, self._defaults)
            if isinstance(made, dict):
                self._invalid.inc()
                yield beam.pvalue.TaggedOutput(INVALID_TAG, made)
            else:
                yield made


class ExpandTemplates(beam.PTransform):
    """PBegin -> {'requests': ..., 'invalid': error rows} of every record of `templates` (checked at launch)."""

    def __init__(self, templates, defaults: RequestDefaults, chunk_records: int = CHUNK_RECORDS):
        super().__init__()
        self._templates = tuple(templates)
        self._defaults = defaults
        self._chunk = chunk_records

    def expand(self, pbegin):
        work = [(number, start, stop) for number, t in enumerate(self._templates)
                for start, stop in chunks(t.count, self._chunk)]
        out = (pbegin
               | "TemplateRanges" >> beam.Create(work)
               | "SpreadRanges" >> beam.Reshuffle()
               | "ExpandRanges" >> beam.ParDo(_ExpandRangeFn(self._templates, self._defaults))
               .with_outputs(INVALID_TAG, main="requests"))
        return {"requests": out.requests, "invalid": out[INVALID_TAG]}
