"""A record's `lora` column (--lora_per_record): the adapter it names is checked against the job's, batches are keyed
by it, and its sha256 and scale are in the image's request fingerprint and manifest row; a record naming none keeps
the identity it had without adapters."""

from __future__ import annotations

import re

import pytest

from transforms import layout
from transforms.fingerprints import request_fingerprint
from transforms.identity import ImageIdentity
from transforms.inputs.records import RawRecord
from transforms.inputs.validation import RequestDefaults, parse_raw, validate_record

ADAPTERS = (("wc", "a" * 64, 0.8), ("ink", "b" * 64, 1.0))
DEFAULTS = RequestDefaults(height=32, width=32, size_multiple=16, loras=ADAPTERS)


def _request(defaults=DEFAULTS, text_values=False, **fields):
    return validate_record({"prompt": "a lighthouse", "seed": 3, **fields}, defaults, source="p.jsonl", line=1,
                           text_values=text_values)


def _row(request):
    return layout.manifest_row(request.tasks()[0], file_name="x.png", uri="x.png", sha256="0", num_bytes=1,
                               num_inference_steps=4, guidance_scale=1.0, prompt_truncated=False, model="m",
                               generation_ms=1.0, identity=ImageIdentity.of(request.tasks()[0], "f"))


def test_a_named_adapter_is_in_the_requests_identity_batch_key_and_manifest_row():
    base, wc, ink = _request(), _request(lora="wc"), _request(lora=" ink ")
    assert (wc.lora, wc.lora_sha256, wc.lora_scale) == ADAPTERS[0] and ink.lora == "ink"
    assert len({base.id, wc.id, ink.id}) == 3  # derived ids: another adapter, another request
    keys = {r.tasks()[0].shape_key for r in (base, wc, ink)}
    assert len(keys) == 3  # batches never mix adapters
    prints = {request_fingerprint(r.tasks()[0]) for r in (base, wc, ink)}
    assert len(prints) == 3
    assert _row(wc)["lora"] == {"name": "wc", "sha256": "a" * 64, "scale": 0.8} and "lora" not in _row(base)


def test_a_record_without_an_adapter_keeps_the_identity_it_had_without_adapters():
    plain = RequestDefaults(height=32, width=32, size_multiple=16)
    for empty in ({}, {"lora": None}, {"lora": ""}):
        request = _request(**empty)
        assert request.id == _request(plain).id and request.lora == ""
        assert request_fingerprint(request.tasks()[0]) == request_fingerprint(_request(plain).tasks()[0])
    assert _request(text_values=True, lora="").lora == ""


def test_another_scale_or_file_of_the_same_name_is_another_image():
    other = RequestDefaults(height=32, width=32, size_multiple=16, loras=(("wc", "a" * 64, 0.5),))
    assert request_fingerprint(_request(other, lora="wc").tasks()[0]) != \
        request_fingerprint(_request(lora="wc").tasks()[0])


@pytest.mark.parametrize("defaults,words", [(DEFAULTS, r"'style'.*\['wc', 'ink'\]"),
                                            (RequestDefaults(), "no per-record adapters")])
def test_an_unknown_adapter_is_an_error_row_naming_it_and_the_jobs_adapters(defaults, words):
    row = parse_raw(RawRecord(source="p.jsonl", line=4, fields={"prompt": "x", "lora": "style"}), defaults)
    assert isinstance(row, dict) and row["field"] == "lora" and row["value"] == "style"
    assert row["kind"] == layout.INVALID_RECORD
    assert re.search(words, row["reason"]), row["reason"]
