"""`--output_format files`: one object per image under `{output}/images/`, and `metadata.jsonl` for datasets.

    {output}/images/{id}.png (or {id}-{j}.png; .webp / .jpg)   written atomically as each image is generated
    {output}/metadata.jsonl    every image's manifest row (this run's and those found already there), `file_name`
                               relative to {output}: what Hugging Face `datasets`' imagefolder reads
"""

from __future__ import annotations

import dataclasses

import apache_beam as beam

from .. import layout
from .base import DAMAGED, DONE, ERRORS, EXISTING, FAILED, IMAGES, MANIFEST, MISSING, STALE, NothingExisting, Sink, \
    after, error_rows
from .encoding import ImageEncoding
from .existing import SkipExisting
from .writes import InFiltered, Placement, StoreImagesFn


@dataclasses.dataclass(frozen=True)
class InImages:
    """Where the files sink puts an image: `images/{name}` with the encoding's extension, written in place."""

    output: str
    encoding: ImageEncoding = ImageEncoding()

    def __call__(self, task) -> Placement:
        name = self.encoding.stored_name(task.file_name)
        uri = layout.join(self.output, name)
        return Placement(file_name=name, uri=uri, write_to=uri)


class FilesSink(Sink):
    """Each generated image stored at its own name as it comes (StoreImagesFn); `--skip_existing` keeps the images
    already there that were made for the same request and model (SkipExisting). `metadata.jsonl` lists every image
    of the output once all are written."""

    @classmethod
    def images_where(cls, output: str) -> str:
        return layout.join(output, layout.IMAGES_DIR + "/")

    @classmethod
    def manifest_note(cls, output: str) -> str:
        return f" (and {layout.metadata_path(output)} for Hugging Face imagefolder)"

    def plan(self) -> beam.PTransform:
        s = self.settings
        if not s.skip_existing:
            return NothingExisting()
        return SkipExisting(s.output, s.encoding, s.model_identity, score_rules=s.score_rules)

    def expand(self, inputs):
        s = self.settings
        manifest = inputs[IMAGES] | "WriteImages" >> beam.ParDo(StoreImagesFn(
            InImages(s.output, s.encoding), s.encoding, s.encode_threads, model_identity=s.model_identity,
            progress_dir=s.progress_dir, filtered_place=InFiltered(s.output, s.encoding)))
        # Rows of the images found already written, released once this run's images are all written.
        existing = after(inputs[EXISTING], manifest, "AfterImages")
        # datasets' imagefolder: metadata.jsonl at the output's root, `file_name` relative to it, one row per image
        # of the output (this run's and those a --skip_existing run kept), written once every image is.
        every = (manifest, existing) | "EveryImage" >> beam.Flatten()
        if s.drop_near_duplicates is not None:  # one image per near-duplicate group (transforms/duplicates.py)
            from ..duplicates import NearDuplicateGroups, keep_one_per_group

            every = keep_one_per_group(every, every | "NearDuplicates" >> NearDuplicateGroups(s.drop_near_duplicates))
        metadata = (every
                    | "InDataset" >> beam.Filter(lambda row: not row.get("filtered"))  # score filters: filtered/
                    | "MetadataJson" >> beam.Map(layout.to_json_line)
                    | "WriteMetadata" >> beam.io.WriteToText(layout.metadata_path(s.output), shard_name_template="",
                                                             num_shards=1))
        return {MANIFEST: manifest, EXISTING: existing, ERRORS: error_rows(inputs[FAILED]), STALE: inputs[STALE],
                DAMAGED: inputs[DAMAGED], MISSING: inputs[MISSING], DONE: metadata}
