"""Provenance in every stored image (transforms/provenance.py, c2pa_signing.py): PNG, WebP and JPEG carry the IPTC
digital source type of AI-made media, the model and the fingerprints as XMP that Pillow reads back, beside their
prompt text, with the pixels unchanged; signed with a test certificate, c2pa's own Reader finds the manifest and
its `c2pa.created` action; without a certificate there is no C2PA and nothing needs c2pa."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from c2pa_certs import signing_chain
from transforms import provenance
from transforms.c2pa_signing import C2paSettingsError, C2paSigner, signer_from_options
from transforms.sinks.encoding import ImageEncoding, read_image_text

PIXELS = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
XMP = provenance.xmp_packet(model="gs://bucket/klein & co", request_fingerprint="ab" * 16,
                            model_fingerprint="cd" * 16, image_id="<id>")
FORMATS = ["png", "webp", "jpeg"]


def _open(data):
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_carries_the_provenance_and_keeps_its_text_and_pixels(fmt):
    encoding = ImageEncoding(fmt, quality=100)
    plain = encoding.encode(PIXELS, {"prompt": "a fox"})
    marked = encoding.encode(PIXELS, {"prompt": "a fox"}, xmp=XMP)
    im = _open(marked)
    assert provenance.read_xmp(im) == {
        "DigitalSourceType": provenance.DIGITAL_SOURCE_TYPE, "AISystemUsed": "gs://bucket/klein & co",
        "CreatorTool": "flux2-klein-beam", "RequestFingerprint": "ab" * 16, "ModelFingerprint": "cd" * 16,
        "Id": "<id>"}
    assert read_image_text(im)["prompt"] == "a fox"
    assert np.array_equal(np.asarray(im.convert("RGB")), np.asarray(_open(plain).convert("RGB")))
    assert provenance.read_xmp(_open(plain)) == {}


def test_c2pa_signed_images_read_back_with_c2pa_and_pixels_unchanged(tmp_path):
    c2pa = pytest.importorskip("c2pa")
    chain, key = signing_chain()
    (tmp_path / "chain.pem").write_bytes(chain)
    (tmp_path / "key.pem").write_bytes(key)
    signer = signer_from_options(str(tmp_path / "chain.pem"), str(tmp_path / "key.pem"))
    for fmt in FORMATS:
        encoding = ImageEncoding(fmt)
        data = encoding.encode(PIXELS, {"prompt": "a fox"}, xmp=XMP)
        signed = signer.sign(data, encoding.mime_type, model="klein-4b", title=f"images/a.{encoding.extension}")
        with c2pa.Reader(encoding.mime_type, io.BytesIO(signed)) as reader:
            store = json.loads(reader.json())
        manifest = store["manifests"][store["active_manifest"]]
        actions = [a for assertion in manifest["assertions"] if assertion["label"].startswith("c2pa.actions")
                   for a in assertion["data"]["actions"]]
        assert actions[0]["action"] == "c2pa.created"
        assert actions[0]["digitalSourceType"] == provenance.DIGITAL_SOURCE_TYPE
        assert actions[0]["softwareAgent"]["name"] == "klein-4b"
        im = _open(signed)
        assert np.array_equal(np.asarray(im.convert("RGB")), np.asarray(_open(data).convert("RGB"))), fmt
        assert provenance.read_xmp(im)["DigitalSourceType"] == provenance.DIGITAL_SOURCE_TYPE


def test_without_a_certificate_nothing_signs_and_bad_settings_are_named(tmp_path):
    assert signer_from_options(None, None) is None
    with pytest.raises(C2paSettingsError, match="go together"):
        signer_from_options(str(tmp_path / "chain.pem"), None)
    with pytest.raises(C2paSettingsError, match="cannot be read"):
        signer_from_options(str(tmp_path / "none.pem"), str(tmp_path / "none.pem"))
    with pytest.raises(C2paSettingsError, match="not an unencrypted PEM private key"):
        C2paSigner.from_pem(b"x", b"not a key")


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_the_writer_stores_signed_images_with_provenance_and_their_phash(tmp_path, fmt):
    """What every sink stores (sinks/writes.store_image): XMP provenance, C2PA when the encoding has a signer, and the
    pHash of the pixels as generated."""
    c2pa = pytest.importorskip("c2pa")
    from transforms.identity import ModelIdentity
    from transforms.inference import GeneratedImage
    from transforms.phash import phash_pixels
    from transforms.requests import GenerationRequest
    from transforms.sinks.writes import Placement, store_image

    task = GenerationRequest(id="r1", prompt="a fox", seed=3, height=32, width=48, num_inference_steps=None,
                             guidance_scale=None, num_images=1).tasks()[0]
    generated = GeneratedImage(task=task, pixels=PIXELS, num_inference_steps=4, guidance_scale=1.0,
                               prompt_truncated=False, model="klein-4b", generation_ms=1.0)
    encoding = ImageEncoding(fmt, quality=100, c2pa=C2paSigner.from_pem(*signing_chain()))
    path = str(tmp_path / f"r1.{encoding.extension}")
    made_by = ModelIdentity(model_fingerprint="ef" * 16, dtype="bfloat16")
    stored = store_image(generated, Placement("images/r1", path, path), encoding, model_identity=made_by)
    assert stored.phash == phash_pixels(PIXELS) == generated.phash
    data = open(path, "rb").read()
    im = _open(data)
    xmp, text = provenance.read_xmp(im), read_image_text(im)
    assert text["prompt"] == "a fox"
    # the XMP names the fingerprints of the image's identity record, the same its text carries
    assert xmp["RequestFingerprint"] == text["request_fingerprint"] == task.request_fingerprint
    assert xmp["ModelFingerprint"] == text["model_fingerprint"] == "ef" * 16
    with c2pa.Reader(encoding.mime_type, io.BytesIO(data)) as reader:
        assert "c2pa.created" in reader.json()
