"""What the dataset card and the preview say of a job's output besides its images: label counts per slot (the
string values of the rows' `metadata`: a template's slots, or a table's extra columns), the near-duplicate groups
(how many, the largest, images marked) and the error rows by kind. One Beam step gathers them into one dict."""

from __future__ import annotations

import apache_beam as beam

MAX_LABEL_VALUES = 10_000  # distinct values counted per slot (a free-text column is not a label): the rest as one
OTHER = "(other values)"
SLOTS_KEPT = 12  # slots charted: the ones with the fewest distinct values (labels rather than free text)


def row_labels(row: dict):
    """(slot, value) of every text label of a manifest row."""
    for key, value in (row.get("metadata") or {}).items():
        if isinstance(value, str):
            yield key, value


class LabelCounts(beam.CombineFn):
    """Manifest rows -> {slot: {value: images}}, at most MAX_LABEL_VALUES values a slot."""

    def create_accumulator(self):
        return {}

    def add_input(self, acc, row):
        for slot, value in row_labels(row):
            counts = acc.setdefault(slot, {})
            if value not in counts and len(counts) >= MAX_LABEL_VALUES:
                value = OTHER
            counts[value] = counts.get(value, 0) + 1
        return acc

    def merge_accumulators(self, accs):
        out: dict = {}
        for acc in accs:
            for slot, counts in acc.items():
                merged = out.setdefault(slot, {})
                for value, n in counts.items():
                    if value not in merged and len(merged) >= MAX_LABEL_VALUES:
                        value = OTHER
                    merged[value] = merged.get(value, 0) + n
        return out

    def extract_output(self, acc):
        kept = sorted(acc, key=lambda slot: (len(acc[slot]), slot))[:SLOTS_KEPT]
        return {slot: acc[slot] for slot in sorted(kept)}


def summarize(labels: dict, groups: list[dict], errors_by_kind: dict, images: int) -> dict:
    """The one dict the card and the preview render."""
    sizes = [len(g["ids"]) for g in groups]
    largest = max(groups, key=lambda g: len(g["ids"]), default=None)  # groups come sorted: ties keep the first
    return {"images": images, "labels": labels, "duplicate_groups": len(groups),
            "images_in_groups": sum(sizes), "duplicates_beyond_first": sum(sizes) - len(sizes),
            "largest_group": {"size": len(largest["ids"]), "ids": largest["ids"][:10]} if largest else None,
            "errors_by_kind": dict(sorted(errors_by_kind.items()))}


class DatasetStats(beam.PTransform):
    """{'rows': every image's manifest row, 'groups': near-duplicate groups, 'errors': error rows} -> one stats
    dict (`summarize`)."""

    def expand(self, inputs):
        labels = inputs["rows"] | "LabelCounts" >> beam.CombineGlobally(LabelCounts())
        images = inputs["rows"] | "CountImages" >> beam.combiners.Count.Globally()
        groups = inputs["groups"] | "AllGroups" >> beam.combiners.ToList()
        kinds = (inputs["errors"]
                 | "ErrorKind" >> beam.Map(lambda row: row.get("kind") or "error")
                 | "CountKinds" >> beam.combiners.Count.PerElement()
                 | "KindsDict" >> beam.combiners.ToDict())
        return (labels | "Summarize" >> beam.Map(
            lambda lab, grp, kin, n: summarize(lab, grp, kin, n), beam.pvalue.AsSingleton(groups),
            beam.pvalue.AsSingleton(kinds), beam.pvalue.AsSingleton(images)))
