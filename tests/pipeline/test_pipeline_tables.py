"""Prompt tables through the whole job: TSV and Parquet, local and on gs:// (the GCS emulator), in the multi-process
DirectRunner; the launch checks of table inputs; the BigQuery graph in the Dataflow runner's offline dry run.

A TSV benchmark table with a header and extra columns gives one image per row with that row's prompt cell (the
header is never a prompt) and its extra columns in the manifest; a Parquet table's seeds and sizes are the images'
seeds and sizes; a text file whose first line is a table's header is read as asked but warns in summary.json.
"""

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.launch import resolve_job
from pipeline.run import UsageError, run
from pipeline_helpers import (  # noqa: F401 - ckpt32 and xla_cache are fixtures
    HEIGHT, MODEL_ARGS, check_manifest_matches_images, ckpt32, image_names, rows, xla_cache,
)
from tables import parquet_bytes, tsv_bytes

MULTI_PROCESS = ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2",
                 "--no_progress"]

TSV = [["Prompt", "Category", "Challenge", "Note"],
       ["a red fox in snow", "Animals", "Simple Detail", ""],
       ["a sign that says \"open\"", "Text", "Quoted, with a comma", "from the paper"],
       ["two owls\tat night", "Animals", "Counting", "tab inside the cell"]]

PARQUET_ROWS = {  # several row groups, dictionary-encoded strings, nulls; seeds and sizes per row
    "prompt": ["a lighthouse", "a mountain lake", None, "a desert road", "a city at dusk", "a bridge"],
    "seed": [11, 12, 13, 14.5, 15, 16],  # float column: 14.5 has a fraction (an error row), the rest are integers
    "height": [32, 64, 32, 32, None, 32],  # null: the job's --height
    "width": [64, 32, 64, 64, 64, 32],
    "category": ["land", "water", "land", "land", "city", "city"],
    "score": [0.5, 1.0, None, 2.0, 2.5, 3.0],
}
PARQUET_GOOD = [0, 1, 4, 5]  # the rows that give images


def table_parquet() -> bytes:
    return parquet_bytes(PARQUET_ROWS, row_group_size=2, dictionary=("prompt", "category"))


def check_table_outputs(out: str, summary: dict, *, text_header: bool) -> dict:
    """The checks shared by the local and the gs:// job; returns the manifest rows by prompt."""
    manifest = rows(out, "manifest")
    check_manifest_matches_images(out, manifest, {})
    by_prompt = {r["prompt"]: r for r in manifest}
    assert len(by_prompt) == len(manifest)
    # TSV: one image per row, each with its row's prompt cell and its extra columns; the header is no prompt.
    for row in TSV[1:]:
        got = by_prompt[row[0]]
        assert got["metadata"] == dict(zip(TSV[0][1:], row[1:])), got
        assert got["source"].endswith("prompts.tsv")
    assert "Prompt" not in by_prompt
    # Parquet: the table's seeds and sizes (a null height is the job's), its other columns as metadata.
    for i in PARQUET_GOOD:
        got = by_prompt[PARQUET_ROWS["prompt"][i]]
        height = PARQUET_ROWS["height"][i] or HEIGHT
        assert (got["seed"], got["height"], got["width"], got["line"]) == \
            (PARQUET_ROWS["seed"][i], height, PARQUET_ROWS["width"][i], i + 1), got
        assert got["metadata"] == {"category": PARQUET_ROWS["category"][i], "score": PARQUET_ROWS["score"][i]}
    errors = {(e["source"].rsplit("/", 1)[-1], e["line"]): e for e in rows(out, "errors")}
    assert errors[("table.parquet", 3)]["field"] == "prompt" and "missing prompt" in errors[("table.parquet", 3)][
        "reason"]
    assert errors[("table.parquet", 4)]["field"] == "seed" and "14.5" in errors[("table.parquet", 4)]["reason"]
    expected_images = len(TSV) - 1 + len(PARQUET_GOOD) + (2 if text_header else 0)
    assert summary["images_generated"] == len(manifest) == len(image_names(out)) == expected_images
    return by_prompt


@pytest.mark.slow  # CI time: the tables are read in CI by tests/transforms/test_tables.py, multi-process jobs by test_pipeline_local.py
def test_tables_local_multi_process(tmp_path, ckpt32, xla_cache):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "prompts.tsv").write_bytes(tsv_bytes(TSV))
    (inputs / "table.parquet").write_bytes(table_parquet())
    (inputs / "cut.parquet").write_bytes(table_parquet()[:-30])
    (inputs / "notes.txt").write_bytes(b"Prompt\tCategory\na heron\tbirds\n")  # a table's header, read as text
    out = tmp_path / "out"
    _, summary = run([f"--model={ckpt32}", f"--input={inputs}/*", f"--output={out}", *MODEL_ARGS,
                      f"--compilation_cache_dir={xla_cache}", *MULTI_PROCESS])
    by_prompt = check_table_outputs(str(out), summary, text_header=True)
    assert "Prompt\tCategory" in by_prompt  # read as asked, one prompt per line ...
    (warning,) = summary["warnings"]  # ... with a warning in summary.json
    assert warning["source"].endswith("notes.txt") and warning["line"] == 1 and summary["warnings_count"] == 1
    assert "looks like the header of a table" in warning["warning"]
    errors = rows(str(out), "errors")
    cut = [e for e in errors if e["source"].endswith("cut.parquet")]
    assert [(e["line"], e["kind"]) for e in cut] == [(1, "unreadable_input")]
    assert summary["invalid"] == len(errors) == 3


@pytest.mark.slow  # CI time: as above; the GCS job path runs in CI through test_pipeline_gcs.py
def test_tables_on_gcs_multi_process(gcs_emulator, gcs_bucket, ckpt32, xla_cache, tmp_path):
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_dir(ckpt32, f"{b}/models/klein-tiny")
    gcs_emulator.upload_bytes(f"{b}/in/prompts.tsv", tsv_bytes(TSV))
    gcs_emulator.upload_bytes(f"{b}/in/table.parquet", table_parquet())
    out = f"{b}/out"
    _, summary = run([f"--model={b}/models/klein-tiny", f"--input={b}/in/*", f"--output={out}", *MODEL_ARGS,
                      f"--checkpoint_cache_dir={tmp_path / 'ckpt-cache'}", f"--compilation_cache_dir={xla_cache}",
                      *MULTI_PROCESS])
    check_table_outputs(out, summary, text_header=False)
    assert "warnings" not in summary and summary["invalid"] == 2


# ============================================================================================ launch checks
def test_table_launch_errors(tmp_path, tiny_ckpt):
    (tmp_path / "captions.tsv").write_bytes(tsv_bytes([["caption", "style"], ["a", "b"]]))
    (tmp_path / "ok.tsv").write_bytes(tsv_bytes(TSV))
    (tmp_path / "t.parquet").write_bytes(parquet_bytes({"text": ["a"], "seed": [1]}))

    def job(*argv):
        return resolve_job(PipelineOptions([f"--model={tiny_ckpt}", *argv]))

    with pytest.raises(UsageError, match=r"captions.tsv: its header has no prompt column 'prompt' .* its columns "
                                         r"are: 'caption', 'style'"):
        job(f"--input={tmp_path}/*.tsv")
    with pytest.raises(UsageError, match=r"t.parquet: its Parquet schema has no prompt column 'prompt'.*'text', "
                                         r"'seed'"):
        job(f"--input={tmp_path}/t.parquet")
    assert job(f"--input={tmp_path}/t.parquet", "--prompt_column=TEXT").spec.input.columns.prompt_column == "TEXT"
    with pytest.raises(UsageError, match="never read as plain text"):
        job(f"--input={tmp_path}/ok.tsv", "--input_format=text")
    with pytest.raises(UsageError, match="not of the form old=new"):
        job(f"--input={tmp_path}/ok.tsv", "--column_map=cfg")
    with pytest.raises(UsageError, match="--max_metadata_bytes must be an integer >= 0"):
        job(f"--input={tmp_path}/ok.tsv", "--max_metadata_bytes=-1")
    with pytest.raises(UsageError, match="--temp_location"):
        job("--input=bq://proj.ds.prompts")
    with pytest.raises(UsageError, match="bq://project.dataset.table"):
        job("--input=bq://ds.prompts", "--temp_location=gs://b/tmp")
    with pytest.raises(UsageError, match="--input_query is empty"):
        job("--input_query= ", "--temp_location=gs://b/tmp")
    j = job(f"--input={tmp_path}/ok.tsv", "--column_map=Note=seed,cfg=guidance_scale")
    assert len(j.input_warnings) == 1 and "renames 'cfg'" in j.input_warnings[0]


def test_bigquery_graph_validates_in_the_dataflow_dry_run(gcs_emulator, gcs_bucket, tiny_ckpt):
    """A BigQuery table and a query next to a TSV file translate for Dataflow (runner v2 proto, everything pickles)
    without the BigQuery service: nothing is read, nothing written."""
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_dir(tiny_ckpt, f"{b}/models/klein")  # the launcher reads its configs
    gcs_emulator.upload_bytes(f"{b}/in/p.tsv", tsv_bytes([["caption", "cfg"], ["a fox", "2"]]))
    result, summary = run([f"--model={b}/models/klein", f"--input={b}/in/p.tsv,bq://test-project.prompts.parti",
                           "--input_query=SELECT caption, cfg, note FROM `test-project.prompts.drawbench`",
                           "--prompt_column=caption", "--column_map=cfg=guidance_scale",
                           "--bigquery_temp_dataset=test-project.beam_tmp",
                           f"--output={b}/out", "--runner=DataflowRunner", "--dry_run=True",
                           "--project=test-project", "--region=us-central1", f"--temp_location={b}/tmp",
                           "--sdk_location=container", "--sdk_container_image=example.com/flux2-klein:test"],
                          wait=False)
    assert summary is None and str(result.state) == "DONE"
    labels = {t.unique_name for t in result.job.proto_pipeline.components.transforms.values()}
    for name in ("ReadRequests", "ReadBigQuery0", "ReadBigQuery0/ReadRows", "ReadBigQuery0/ParseRows",
                 "ReadBigQuery1/ReadRows", "AllRequests", "Deduplicate", "Generate/RunInference", "WriteManifest",
                 "Summary"):
        assert name in labels, name
    assert not gcs_emulator.list_blobs(f"{b}/out")
