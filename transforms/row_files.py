"""The job's row files (manifest-*, existing-*, errors-*): a text sink with a fixed number of shards under fixed names,
which a rerun into the same output replaces.

Beam's WriteToText looks for the files it replaces with the shard count its workers wrote. When the rows are none
(no error, nothing found existing), that count is 0, so the previous run's file is not removed first; the empty shard
Beam then adds finds it in place, is judged the same file (a local file's checksum is its size) and is dropped, with
the warning 'No shards found to finalize'. Here the files replaced are looked up with the shard count the sink
writes in the end, so the previous file is removed and this run's empty one takes its place, silently.
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam.io import textio


class _FixedShardsTextSink(textio._TextSink):  # noqa: SLF001 - WriteToText's own sink, one step corrected
    """WriteToText's sink whose pre-finalize step removes the files of the shard count it finally writes."""

    def pre_finalize(self, init_result, writer_results):
        written = list(writer_results)
        return super().pre_finalize(init_result, written + [None] * max(0, self.num_shards - len(written)))


class WriteRowFile(beam.PTransform):
    """Lines -> `prefix-SSSSS-of-NNNNN<suffix>` in `num_shards` files, replacing a previous run's files of that name,
    written even when there are no lines (an empty file)."""

    def __init__(self, prefix: str, suffix: str, num_shards: int = 1):
        super().__init__()
        self._sink = _FixedShardsTextSink(prefix, suffix, num_shards=num_shards)

    def expand(self, lines):
        return lines | beam.io.Write(self._sink)
