"""Optional C2PA: with `--c2pa_cert` and `--c2pa_key`, every stored image carries a signed C2PA manifest (made by
c2pa-python, the `c2pa` extra) whose `c2pa.created` action names the IPTC digital source type of AI-made media and
the model. The pixels are not touched: the manifest goes into its own chunk or segment.

The signer holds the certificate chain and key as PEM text (picklable, read once at launch); each worker thread
makes its c2pa Signer when it first signs. Without a certificate the job makes no C2PA and needs no c2pa package.
"""

from __future__ import annotations

import dataclasses
import json
import threading

from .provenance import CREATOR_TOOL, DIGITAL_SOURCE_TYPE

_local = threading.local()
BUILDER_SETTINGS = {"builder": {"thumbnail": {"enabled": False}}}


class C2paSettingsError(ValueError):
    """--c2pa_cert / --c2pa_key that cannot sign: one given without the other, unreadable, or a key c2pa refuses."""

    def __init__(self, message: str, value=None):
        super().__init__(message)
        self.value = value


def signing_algorithm(key_pem: bytes) -> str:
    """The C2PA algorithm of a PEM private key: es256/es384/es512 (EC P-256/384/521), ed25519, ps256 (RSA)."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        key = load_pem_private_key(key_pem, password=None)
    except Exception as e:  # noqa: BLE001 - not PEM, encrypted, unknown type
        raise C2paSettingsError(f"--c2pa_key is not an unencrypted PEM private key: {e}") from None
    if isinstance(key, ec.EllipticCurvePrivateKey):
        by_curve = {"secp256r1": "es256", "secp384r1": "es384", "secp521r1": "es512"}
        if key.curve.name not in by_curve:
            raise C2paSettingsError(f"--c2pa_key is on curve {key.curve.name}; C2PA signs with P-256, P-384 or "
                                    f"P-521", key.curve.name)
        return by_curve[key.curve.name]
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return "ed25519"
    if isinstance(key, rsa.RSAPrivateKey):
        return "ps256"
    raise C2paSettingsError(f"--c2pa_key is a {type(key).__name__}; C2PA signs with EC, Ed25519 or RSA keys")


def manifest_definition(*, model: str, title: str, mime_type: str) -> dict:
    """The C2PA manifest of one image: created by an AI model (IPTC trainedAlgorithmicMedia), by this job."""
    return {
        "claim_generator_info": [{"name": CREATOR_TOOL}],
        "title": title,
        "format": mime_type,
        "assertions": [{"label": "c2pa.actions", "data": {"actions": [{
            "action": "c2pa.created", "digitalSourceType": DIGITAL_SOURCE_TYPE,
            "softwareAgent": {"name": model}}]}}],
    }


@dataclasses.dataclass(frozen=True)
class C2paSigner:
    """The certificate chain (leaf first) and private key, PEM; `sign` puts a signed manifest into image bytes."""

    cert_pem: bytes
    key_pem: bytes
    algorithm: str = "es256"

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> "C2paSigner":
        """Checked now (at launch): the key's algorithm, and a signature c2pa makes with them."""
        signer = cls(cert_pem, key_pem, signing_algorithm(key_pem))
        try:
            signer._signer()
        except ImportError:
            raise C2paSettingsError("--c2pa_cert needs the c2pa package: pip install 'flux2-klein-beam[c2pa]'") \
                from None
        except Exception as e:  # noqa: BLE001 - c2pa's own error for a chain or key it refuses
            raise C2paSettingsError(f"--c2pa_cert/--c2pa_key cannot sign: {e}") from None
        return signer

    def _signer(self):
        import c2pa

        cached = getattr(_local, "signers", None)
        if cached is None:
            cached = _local.signers = {}
        made = cached.get(self)
        if made is None:
            info = c2pa.C2paSignerInfo(self.algorithm.encode(), self.cert_pem, self.key_pem, None)
            # No thumbnail: the image itself is the asset, and a thumbnail would add more bytes than a small image.
            context = c2pa.Context(settings=c2pa.Settings.from_json(json.dumps(BUILDER_SETTINGS)))
            made = cached[self] = (c2pa.Signer.from_info(info), context)
        return made

    def sign(self, data: bytes, mime_type: str, *, model: str, title: str) -> bytes:
        """`data` (an encoded image of `mime_type`) with a signed C2PA manifest in it."""
        import io

        import c2pa

        definition = json.dumps(manifest_definition(model=model, title=title, mime_type=mime_type))
        dest = io.BytesIO()
        signer, context = self._signer()
        with c2pa.Builder(definition, context) as builder:
            builder.sign(signer, mime_type, io.BytesIO(data), dest)
        return dest.getvalue()


def read_pem(path: str) -> bytes:
    from apache_beam.io.filesystems import FileSystems

    try:
        with FileSystems.open(path) as f:
            return f.read()
    except Exception as e:  # noqa: BLE001 - missing, unreadable
        raise C2paSettingsError(f"{path} cannot be read: {e}", path) from None


def signer_from_options(cert: str | None, key: str | None) -> C2paSigner | None:
    """The signer of --c2pa_cert/--c2pa_key (files, local or gs://), or None when neither is given."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise C2paSettingsError("--c2pa_cert and --c2pa_key go together: give both, or neither", cert or key)
    return C2paSigner.from_pem(read_pem(cert), read_pem(key))
