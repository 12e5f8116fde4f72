"""Ids and prompts can never choose where a file goes, prompt text is never executed or logged in full at INFO, and
weights are read only from safetensors.

- Ids with NUL, control, bidi/zero-width (format) characters, blank or longer than 256 characters are rejected by
  the parser with a reason; hostile but printable ids (path traversal `../`, absolute paths, `%2e%2e`,
  backslashes, a leading dot, drive letters, shell metacharacters) are accepted as ids, kept exactly, and their
  images get a safe name (transforms/layout.py image_stem).
- For every id the parser accepts (property-tested), the image's object name is `images/<stem>.png` (or
  `-<j>.png`) with only [A-Za-z0-9._-] in the stem, never a leading dot, and, joined to the output, stays inside
  `{output}/images/` for gs:// and local outputs alike; a request without an id gets a hex id, whatever its prompt
  says.
- Requests are only ever constructed by the validator (checked on the source), so object names are built only
  from validated ids.
- The runtime code (model/, transforms/, pipeline/) never starts a process or a shell, never evaluates text and
  never unpickles; the loader reads safetensors only.
- Reading and validating hostile records in Beam logs no prompt in full at INFO (caplog); the whole job is checked
  the same way in tests/pipeline/test_fault_pipeline.py.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import posixpath
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transforms import layout
from transforms.inputs.coercion import InvalidRecord
from transforms.inputs.identity import validate_id
from transforms.inputs.readers import parse_lines
from transforms.inputs.validation import RequestDefaults
from transforms.requests import GenerationRequest

from paths import REPO  # noqa: E402
RUNTIME_PACKAGES = ("model", "transforms", "pipeline")
D = RequestDefaults(height=32, width=32, seed=1)
PROPS = settings(max_examples=150, deadline=None, derandomize=True, database=None)

# Not printable, blank or too long: an error row.
REFUSED_IDS = [
    "a\x00b", "\x00", "a\tb", "a\nb", "a\r", "x\n", "", "   ", "a" * 257, "\u202egnp.exe", "x\u200b",
    "a\x7fb", "a\x85b", "a\u2028b", "\ud800", "\ue000",
]
# Printable: accepted, kept as given, stored under a safe name.
HOSTILE_IDS = [
    "../x", "../../etc/passwd", "..", ".", "./x", "x/..", "a/b", "/abs", "/", "//server/share", "a\\b", "..\\x",
    "\\\\server\\share", "C:\\Windows", "C:x", "%2e%2e", "%2e%2e%2fx", "..%2f", "%2fetc", "%00", ".hidden",
    ".png", "..png", "~", "~root", "$(reboot)", "`id`", "a;rm -rf", "a|b", "a b", "a" * 129, "caf\u00e9",
    "\uff0e\uff0e", "*", "?", "[a]", "{a}", "a:b", "a@b", "a+b", "a'b", 'a"b', "a<b", "a>b", "a&b", "a#b", "a=b",
    "a,b", "CON", "nul.txt", "\u65e5\u672c", "\U0001f98a fox", "\u00a0nbsp",
]
SAFE_FILE = re.compile(r"images/[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}(-\d{1,2})?\.png\Z")


def _csv(rows) -> bytes:
    import csv
    import io

    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue().encode("utf-8")


@pytest.mark.parametrize("bad", REFUSED_IDS)
def test_unprintable_blank_or_long_ids_are_rejected_with_a_reason(bad):
    with pytest.raises(InvalidRecord) as e:
        validate_id(bad)
    assert e.value.field == "id" and "1-256 printable characters" in e.value.reason
    # ... and the same through every input format: an error row naming the id field, never a request.
    for fmt in ("jsonl", "csv"):
        if fmt == "csv" and (bad.strip() == "" or "\n" in bad or "\r" in bad or "\ud800" in bad
                             or "\x85" in bad or "\u2028" in bad):
            continue  # blank after the CSV reader's stripping, spans rows, or no UTF-8: covered by the JSONL case
        data = json.dumps({"id": bad, "prompt": "p"}).encode() if fmt == "jsonl" else _csv([["id", "prompt"], [bad, "p"]])
        out = parse_lines(data, "x." + fmt, fmt, D)
        assert len(out) == 1 and isinstance(out[0], dict), (fmt, bad, out)
        assert out[0]["field"] == "id"
        json.dumps(out[0], ensure_ascii=False).encode("utf-8")  # the row can be written, whatever the id holds


@pytest.mark.parametrize("hostile", HOSTILE_IDS)
def test_hostile_printable_ids_are_kept_and_stored_under_a_safe_name(hostile):
    out = parse_lines(json.dumps({"id": hostile, "prompt": "p", "num_images": 2}).encode(), "x.jsonl", "jsonl", D)
    assert len(out) == 1 and isinstance(out[0], GenerationRequest), out
    assert out[0].id == hostile  # exactly as given
    names = [t.file_name for t in out[0].tasks()]
    assert all(SAFE_FILE.match(n) for n in names), names
    assert len(set(names)) == 2 and all(len(n.encode()) < 120 for n in names)


@PROPS
@given(candidate=st.one_of(st.text(max_size=140), st.from_regex(r"[A-Za-z0-9._%/\\-]{0,20}", fullmatch=True),
                           st.integers()))
def test_every_accepted_id_names_a_file_inside_images(candidate):
    try:
        rid = validate_id(candidate)
    except InvalidRecord:
        return
    assert rid == (str(candidate) if not isinstance(candidate, str) else candidate)  # kept exactly
    for n, j in ((1, 0), (3, 2), (64, 63)):
        name = layout.image_file_name(rid, j, n)
        assert SAFE_FILE.match(name), name
        # the name stays in the images folder: no separator, never "." or "..", unchanged by normalisation
        folder, base = posixpath.split(name)
        assert folder == layout.IMAGES_DIR and base not in (".", "..") and posixpath.normpath(name) == name, name
        for output in ("gs://bucket/out", "/data/out"):
            full = layout.join(output, name)
            folder = posixpath.normpath(posixpath.join(output.replace("gs://", "/gs/"), "images"))
            resolved = posixpath.normpath(full.replace("gs://", "/gs/"))
            assert posixpath.dirname(resolved) == folder, (rid, full)


@PROPS
@given(a=st.text(min_size=1, max_size=300), b=st.text(min_size=1, max_size=300))
def test_image_stems_are_safe_and_tell_ids_apart_even_without_case(a, b):
    import hashlib

    for rid in (a, b):
        stem = layout.image_stem(rid)
        assert re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}", stem) and len(stem.encode()) <= 128, (rid, stem)
        if layout.PLAIN_ID.match(rid):
            assert stem == rid  # the earlier rule's ids keep their names: old outputs resume
        else:
            digest = hashlib.sha256(rid.encode("utf-8", "surrogatepass")).hexdigest()[:layout.STEM_HASH_HEX]
            assert stem == digest or stem.endswith("-" + digest), (rid, stem)
    if a != b and not (layout.PLAIN_ID.match(a) and layout.PLAIN_ID.match(b)):
        assert layout.image_stem(a) != layout.image_stem(b)
        if not (layout.PLAIN_ID.match(a) or layout.PLAIN_ID.match(b)):  # hashes are lower case: folding keeps them apart
            assert layout.image_stem(a).lower() != layout.image_stem(b).lower()


@PROPS
@given(prompt=st.text(min_size=1).filter(str.strip), n=st.integers(1, 4))
def test_without_an_id_the_prompt_cannot_steer_the_name(prompt, n):
    for text in (prompt, "../../" + prompt, "/etc/" + prompt + "\x00", "%2e%2e/" + prompt):
        out = parse_lines(json.dumps({"prompt": text, "num_images": n}).encode(), "p.jsonl", "jsonl", D)
        assert len(out) == 1 and isinstance(out[0], GenerationRequest)
        assert re.fullmatch(r"[0-9a-f]{20}", out[0].id)
        assert all(SAFE_FILE.match(t.file_name) for t in out[0].tasks())


def _runtime_sources():
    for package in RUNTIME_PACKAGES:
        for root, _dirs, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    rel = os.path.relpath(path, REPO)
                    with open(path, encoding="utf-8") as f:
                        yield rel, ast.parse(f.read(), filename=rel)


# tiny_klein/ builds tiny checkpoints for tests, demo and benchmarks with the reference libraries (torch); it is not
# a runtime package, and of the runtime's modules only the demo imports it (when the demo runs).
BUILDER_IMPORTERS = {os.path.join("pipeline", "demo.py")}


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


# The launch (not a worker) picks a local TPU's batch with the preflight in a child process, a fixed argv of this
# Python (never a shell), so that libtpu never loads in the launching process (pipeline/launch_check.py).
SUBPROCESS_USERS = {os.path.join("pipeline", "launch_check.py")}


def test_runtime_code_never_runs_a_shell_evaluates_text_or_unpickles():
    banned_modules = {"subprocess", "pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "torch", "pty"}
    problems = []
    for rel, tree in _runtime_sources():
        banned = banned_modules if rel in BUILDER_IMPORTERS else banned_modules | {"tiny_klein"}
        if rel in SUBPROCESS_USERS:
            banned = banned - {"subprocess"}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for m in mods:
                    if m.split(".")[0] in banned:
                        problems.append(f"{rel}:{node.lineno} imports {m}")
        for node, owner, name in _calls(tree):
            if name in ("eval", "exec", "compile") and owner in ("", "builtins"):
                problems.append(f"{rel}:{node.lineno} calls {name}()")
            if owner == "os" and (name in ("system", "popen", "startfile") or name.startswith(("exec", "spawn"))):
                problems.append(f"{rel}:{node.lineno} calls os.{name}()")
            if any(k.arg == "shell" for k in node.keywords):
                problems.append(f"{rel}:{node.lineno} passes shell=")
            if any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                   for k in node.keywords):
                problems.append(f"{rel}:{node.lineno} allows pickle in numpy")
    assert not problems, problems


def test_requests_are_only_built_by_the_validator():
    """Object names come from GenerationRequest.id; the only code that constructs a GenerationRequest is
    validate_record (which validates the id or derives a hex one)."""
    builders = []
    for rel, tree in _runtime_sources():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node, _owner, name in _calls(fn):
                    if name in ("GenerationRequest", "replace") and (
                            name == "GenerationRequest" or any(
                                isinstance(a, ast.Name) and a.id in ("request", "r", "req") for a in node.args)):
                        builders.append((rel, fn.name, name))
    validator = os.path.join("transforms", "inputs", "validation.py")
    assert builders == [(validator, "validate_record", "GenerationRequest")], builders


def test_image_names_come_from_the_request_id_only():
    from transforms.requests import ImageTask

    r = GenerationRequest(id="abc", prompt="../../../etc/passwd\x00 $(rm -rf /)", seed=1, height=32, width=32,
                          num_inference_steps=None, guidance_scale=None, num_images=2, source="s", line=1)
    assert [ImageTask(r, j).file_name for j in range(2)] == ["images/abc-0.png", "images/abc-1.png"]


def test_loader_reads_safetensors_only(tmp_path):
    """A checkpoint component that only has pickle weights is refused (never unpickled), whatever the suffix."""
    from model.errors import UnsafeWeightsError
    from model.loading.safetensors_file import open_component

    for suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"):
        folder = tmp_path / suffix.strip(".")
        folder.mkdir()
        # A pickle that would run code if anything unpickled it.
        (folder / f"diffusion_pytorch_model{suffix}").write_bytes(
            b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
        with pytest.raises(UnsafeWeightsError) as e:
            open_component(str(folder))
        assert suffix in str(e.value)
    assert not (tmp_path / "pwned").exists()


SECRET = "SECRET-PROMPT-" + "x" * 200 + "-END"


def test_reading_hostile_records_logs_no_prompt_at_info(tmp_path, caplog):
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from transforms.inputs.readers import ReadRequests
    from transforms.requests import DeduplicateRequests

    lines = [
        {"id": "ok", "prompt": SECRET},
        {"id": "../evil", "prompt": SECRET + " 1"},
        {"id": "ok", "prompt": SECRET + " conflicting"},
        {"prompt": SECRET + " bad size", "height": 7},
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n" + SECRET + " not json\n")
    caplog.set_level(logging.INFO)
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
        read = p | beam.Create([str(tmp_path / "p.jsonl")]) | ReadRequests("auto", D)
        dedup = read["requests"] | DeduplicateRequests()
        _ = (read["invalid"], dedup["invalid"]) | beam.Flatten() | beam.Map(lambda row: row["reason"])
    assert caplog.records  # the runner did log at INFO
    # any level, and the prompt's first words (a log line that cuts the prompt short still shows them)
    leaked = [r for r in caplog.records if SECRET[:20] in r.getMessage()]
    assert not leaked, [r.getMessage()[:200] for r in leaked]
