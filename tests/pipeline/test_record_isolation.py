"""A record cannot hurt its neighbours: the whole job, beside good records, with records whose data no code path
expected (a reference path with a NUL or a lone surrogate, a JSON key with a lone surrogate, numbers JSON cannot
write), a reference that is a FIFO, and on gs:// a reference whose reads stall (the fault proxy holds its
responses). The good records' images are written, each bad record is one error row naming its file and line, and
the run exits 0 as any run with some invalid records does. The job runs in this process on the tiny checkpoint
(one model load for the module: tests/support/fault_jobs.py CachedHandler)."""

import json
import os

from fault_jobs import install_handler
from fault_proxy import FaultRule, in_front_of
from pipeline.run import main
from pipeline_helpers import image_names, read, rows, xla_cache  # noqa: F401 - xla_cache is a fixture
from reference_files import png

SIZE = 32
ARGS = ["--dtype=float32", "--max_sequence_length=32", "--batch_size=2", f"--height={SIZE}", f"--width={SIZE}",
        "--runner=FnApiRunner", "--no_progress", "--preview=0"]

# Lines of a JSONL file as written (JSON escapes kept: "\ud800" is a lone surrogate, "\u0000" a NUL).
BAD_LINES = {
    "nul-ref": r'{"id": "nul-ref", "prompt": "p", "reference_images": ["refs/a\u0000b.png"]}',
    "surrogate-ref": r'{"id": "surrogate-ref", "prompt": "p", "reference_images": ["refs/\ud800.png"]}',
    "surrogate-key": r'{"id": "surrogate-key", "prompt": "p", "\ud800": 1}',
    "surrogate-value": r'{"id": "surrogate-value", "prompt": "p", "note": {"\udfff": "x"}}',
}
GOOD_LINES = ['{"id": "good-1", "prompt": "a red fox", "seed": 1, "ratio": 1e999}',  # infinite: metadata null
              json.dumps({"id": "good-2", "prompt": "a lighthouse", "seed": 2})]


def _write_rows_readable(out: str):
    """Every row file of the output is UTF-8 JSON, one object a line."""
    for kind in ("manifest", "errors"):
        for row in rows(out, kind):
            assert isinstance(row, dict)


def _check(out: str, status: int, expected: dict, source: str):
    assert status == 0
    assert image_names(out) == {"good-1.png", "good-2.png"}
    manifest = {r["id"]: r for r in rows(out, "manifest")}
    assert set(manifest) == {"good-1", "good-2"} and manifest["good-1"]["metadata"] == {"ratio": None}
    errors = {e["line"]: e for e in rows(out, "errors")}
    assert set(errors) == set(expected), errors
    for line, (kind, words) in expected.items():
        e = errors[line]
        assert (e["source"], e["kind"]) == (source, kind), e
        assert words in e["reason"], e
    _write_rows_readable(out)
    summary = json.loads(read(f"{out}/summary.json"))
    assert (summary["images_generated"], summary["invalid"]) == (2, len(expected))


def test_bad_records_are_their_own_error_rows_locally(tiny_ckpt, xla_cache, tmp_path, monkeypatch):
    install_handler(monkeypatch)
    folder = tmp_path / "in"
    (folder / "refs").mkdir(parents=True)
    os.mkfifo(folder / "refs" / "pipe.png")  # nobody writes to it: an open or read would block for good
    lines = GOOD_LINES[:1] + list(BAD_LINES.values()) + [
        json.dumps({"id": "fifo-ref", "prompt": "p", "reference_images": ["refs/pipe.png"]}), GOOD_LINES[1]]
    source = folder / "prompts.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    status = main([f"--model={tiny_ckpt}", f"--input={source}", f"--output={out}", *ARGS,
                   f"--compilation_cache_dir={xla_cache}", "--read_timeout_s=5"])
    _check(out, status, {
        2: ("invalid_reference", "contains a NUL character"),
        3: ("invalid_reference", "is not valid Unicode text (a lone surrogate)"),
        4: ("invalid_record", "is not valid Unicode text (a lone surrogate)"),
        5: ("invalid_record", "is not valid Unicode text (a lone surrogate)"),
        6: ("invalid_reference", "is a FIFO (named pipe), not a regular file"),
    }, str(source))
    assert rows(out, "errors")[0]["record"] is not None


def test_bad_records_and_stalled_references_on_gcs(gcs_emulator, gcs_bucket, tiny_ckpt, xla_cache, tmp_path,
                                                   monkeypatch):
    """On gs://: the same records, a reference whose every read stalls (an invalid_reference row within
    --read_timeout_s) and one whose first read stalls (read again on a fresh request: its image is made)."""
    install_handler(monkeypatch)
    b = f"gs://{gcs_bucket}"
    gcs_emulator.upload_bytes(f"{b}/in/refs/stuck.png", png(64, 64, seed=1))
    gcs_emulator.upload_bytes(f"{b}/in/refs/slow.png", png(64, 64, seed=2))
    lines = GOOD_LINES[:1] + [
        r'{"id": "nul-ref", "prompt": "p", "reference_images": ["gs://' + gcs_bucket + r'/in/refs/a\u0000.png"]}',
        BAD_LINES["surrogate-ref"], BAD_LINES["surrogate-key"],
        json.dumps({"id": "stuck-ref", "prompt": "p", "reference_images": ["refs/stuck.png"]}),
        json.dumps({"id": "slow-ref", "prompt": "p", "reference_images": ["refs/slow.png"]}),
        GOOD_LINES[1]]
    gcs_emulator.upload_bytes(f"{b}/in/prompts.jsonl", ("\n".join(lines) + "\n").encode())
    out = f"{b}/out"
    with in_front_of(gcs_emulator, monkeypatch) as proxy:
        proxy.add_rule(FaultRule(fraction=1.0, kinds={"read"}, name="refs/stuck.png", actions=("delay",),
                                 delay_s=10))
        proxy.add_rule(FaultRule(fraction=1.0, kinds={"read"}, name="refs/slow.png", actions=("delay",),
                                 delay_s=10, limit=1))
        status = main([f"--model={tiny_ckpt}", f"--input={b}/in/prompts.jsonl", f"--output={out}", *ARGS,
                       f"--compilation_cache_dir={xla_cache}", "--read_timeout_s=3"])
        proxy.clear_rules()  # the outputs are read back through the proxy that wrote them (their media links)
        errors = {e["line"]: e for e in rows(out, "errors")}
        names = image_names(out)
    assert status == 0
    assert names == {"good-1.png", "good-2.png", "slow-ref.png"}, errors
    assert errors[5]["value"] == f"{b}/in/refs/stuck.png"
    assert "did not return within --read_timeout_s=3 s" in errors[5]["reason"]
    expected = {2: ("invalid_reference", "contains a NUL character"),
                3: ("invalid_reference", "is not valid Unicode text (a lone surrogate)"),
                4: ("invalid_record", "is not valid Unicode text (a lone surrogate)"),
                5: ("invalid_reference", "could not be read")}
    assert set(errors) == set(expected), errors
    for line, (kind, words) in expected.items():
        assert (errors[line]["source"], errors[line]["kind"]) == (f"{b}/in/prompts.jsonl", kind), errors[line]
        assert words in errors[line]["reason"], errors[line]
