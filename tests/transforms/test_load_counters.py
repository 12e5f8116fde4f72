"""transforms/inference.py's per-process counters: names that are the same in every job (no process id in them),
each process counted once per job in `processes_with_model` and `generating_processes`, on a real in-process Beam
runner. The multi-process cases (one copy per worker process, one per machine): tests/pipeline/test_pipeline_local.py.
"""

import apache_beam as beam
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from pipeline_helpers import counters
from transforms import inference


class _LoadsAndBatches(beam.DoFn):
    """What the handler does in one process: loads noted outside a bundle (setup), then reported and counted from
    the batches' bundles."""

    def __init__(self, loads: int):
        self.loads = loads

    def setup(self):
        for _ in range(self.loads):
            inference._note_model_load()

    def process(self, element):
        inference.flush_model_load_metrics()
        inference._count_this_process("generating_processes")
        yield element


def _job(loads: int) -> dict:
    inference.discard_pending_model_loads()  # as pipeline.run does when a job starts
    p = beam.Pipeline(runner=FnApiRunner())
    _ = p | beam.Create(range(5)) | beam.ParDo(_LoadsAndBatches(loads))
    result = p.run()
    result.wait_until_finish()
    return counters(result)


def test_each_process_counts_once_per_job_under_fixed_names():
    before = inference.model_loads_in_this_process()
    first = _job(loads=2)
    assert first == {"model_loads": 2, "processes_with_model": 1, "generating_processes": 1}
    again = _job(loads=0)  # the next job in this process: it generates on the copy it already has
    assert again == {"generating_processes": 1}
    assert inference.model_loads_in_this_process() == before + 2
