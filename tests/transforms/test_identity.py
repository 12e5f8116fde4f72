"""The image-identity record (transforms/identity.py): one record, computed once per image, that image text,
manifest rows, sidecar rows and the resume checks all write and read the same way."""

import numpy as np
from apache_beam.coders import coders

from transforms import fingerprints, layout, shards
from transforms.identity import DECISIVE_FIELDS, RECORDED_FIELDS, ImageIdentity, ModelIdentity
from transforms.requests import GenerationRequest, ImageTask
from transforms.sinks.encoding import encode_png, png_text
from transforms.sinks.existing import existing_manifest_row

MODEL = ModelIdentity("mfp", dtype="bfloat16", quantize="int8")


def task(**kw) -> ImageTask:
    base = dict(id="a", prompt="a fox", seed=3, height=32, width=32, num_inference_steps=None, guidance_scale=None,
                num_images=1, source="p.jsonl", line=1)
    return ImageTask(GenerationRequest(**{**base, **kw}), 0)


def test_every_writer_records_the_same_fields_of_one_record():
    t = task()
    fields = ImageIdentity.of(t, MODEL).fields()
    assert tuple(fields) == RECORDED_FIELDS == ("request_fingerprint", "model_fingerprint", "dtype", "quantize")
    assert DECISIVE_FIELDS == ("request_fingerprint", "model_fingerprint")
    text = png_text(t, num_inference_steps=4, guidance_scale=1.0, model="m", model_identity=MODEL)
    row = existing_manifest_row(t, encode_png(np.zeros((32, 32, 3), np.uint8), text), "u", model_identity=MODEL)
    failed = shards.failed_sidecar_row("000000000", t, {"kind": "k", "reason": "r"}, MODEL)
    assert {k: text[k] for k in RECORDED_FIELDS} == {k: str(v) for k, v in fields.items()}
    assert {k: row[k] for k in RECORDED_FIELDS} == {k: failed[k] for k in RECORDED_FIELDS} == fields
    assert set(RECORDED_FIELDS) <= set(layout.MANIFEST_FIELDS) and set(RECORDED_FIELDS) <= set(shards.SIDECAR_COLUMNS)
    assert set(shards.SIDECAR_COLUMNS) == set(shards.sidecar_schema().names)


def test_only_a_decisive_field_recorded_otherwise_makes_an_image_another():
    mine = ImageIdentity.of(task(), MODEL)
    assert mine.differs_from(mine.fields()) is None
    assert mine.differs_from({}) is None  # an image of a run before fingerprints: compared field by field elsewhere
    assert mine.differs_from({"dtype": "float32", "quantize": "none"}) is None  # named, and covered by the fingerprint
    assert mine.differs_from({**mine.fields(), "model_fingerprint": "other"}) == "model_fingerprint"
    assert mine.differs_from({"request_fingerprint": "other"}) == "request_fingerprint"
    assert ModelIdentity.of("mfp") == ModelIdentity("mfp") and ModelIdentity.of(MODEL) is MODEL
    assert ModelIdentity.recorded_in({"model_fingerprint": "mfp", "dtype": "bfloat16"}) == \
        ModelIdentity("mfp", dtype="bfloat16", quantize="none")


def test_the_request_fingerprint_is_computed_once_per_image_and_travels_with_its_task(monkeypatch):
    calls = []
    real = fingerprints.request_fingerprint
    monkeypatch.setattr(fingerprints, "request_fingerprint", lambda t: calls.append(t) or real(t))
    t = task()
    text = png_text(t, num_inference_steps=4, guidance_scale=1.0, model="m", model_identity=MODEL)
    coder = coders.FastPrimitivesCoder()
    back = coder.decode(coder.encode(t))  # as Beam hands the task from one stage to the next
    row = existing_manifest_row(back, encode_png(np.zeros((32, 32, 3), np.uint8), text), "u", model_identity=MODEL)
    shards.sidecar_row_matches(row, back, MODEL)
    assert len(calls) == 1 and row["request_fingerprint"] == real(t)
