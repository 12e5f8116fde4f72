"""templates/README.md (the Dataflow runbook) against the code: every user-facing option, every kind of error row,
every file and folder the job writes and every input format is named there, so the runbook cannot fall behind."""

import glob
import json
import os
import re

from paths import REPO

RUNBOOK = os.path.join(REPO, "templates", "README.md")


def _runbook() -> str:
    with open(RUNBOOK, encoding="utf-8") as f:
        return f.read()


def test_every_option_is_in_the_runbook_or_the_template_metadata():
    from pipeline.option_specs import OPTIONS

    text = _runbook()
    with open(os.path.join(REPO, "templates", "metadata.json"), encoding="utf-8") as f:
        params = {p["name"] for p in json.load(f)["parameters"]}
    missing = [o.name for o in OPTIONS
               if o.name not in params and not re.search(rf"(--|\b){re.escape(o.name)}\b", text)]
    assert not missing, f"options neither in templates/README.md nor in metadata.json: {missing}"


def test_every_error_kind_is_in_the_runbook():
    from transforms import layout

    used = set()
    for path in glob.glob(os.path.join(REPO, "transforms", "*.py")) + glob.glob(os.path.join(REPO, "pipeline", "*.py")):
        with open(path, encoding="utf-8") as f:
            used |= {getattr(layout, name) for name in re.findall(r"kind=layout\.([A-Z_]+)", f.read())}
    assert used and used <= set(layout.ERROR_KINDS), f"kinds of error rows missing from ERROR_KINDS: {used}"
    text = _runbook()
    missing = [kind for kind in layout.ERROR_KINDS if f"`{kind}`" not in text]
    assert not missing, f"error kinds missing from templates/README.md: {missing}"


def test_every_output_the_job_writes_is_in_the_runbook():
    from transforms import dataset_card, layout, preview, shards
    from transforms.sinks import webdataset

    written = [f"{layout.IMAGES_DIR}/", f"{layout.MANIFEST_DIR}/{layout.MANIFEST_PREFIX}-",
               f"{layout.MANIFEST_DIR}/{layout.EXISTING_PREFIX}-", f"{layout.ERRORS_DIR}/{layout.ERRORS_PREFIX}-",
               layout.SUMMARY_FILE, layout.METADATA_FILE, f"{preview.PREVIEW_DIR}/{preview.INDEX_FILE}",
               preview.CONTACT_SHEET, f"{shards.SHARDS_DIR}/", shards.STATS_SUFFIX, dataset_card.WIDS_INDEX,
               dataset_card.SIZES_FILE, f"{webdataset.STAGING_DIR}/"]
    text = _runbook()
    layout_section = text.split("## Where outputs and errors land", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in written if name not in layout_section]
    assert not missing, f"outputs missing from the runbook's output layout: {missing}"


def test_every_input_format_is_in_the_runbook():
    from transforms.inputs.formats import FORMATS

    names = {"jsonl": "JSON Lines", "csv": "CSV", "tsv": "TSV", "parquet": "Parquet", "text": "one prompt per line"}
    assert set(names) == set(FORMATS)
    text = _runbook()
    assert all(names[f] in text for f in FORMATS) and "bq://" in text
