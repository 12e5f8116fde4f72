"""A throwaway C2PA signing chain for tests: a test CA and a leaf certificate it signs (P-256), with the
extensions c2pa's certificate profile asks of a signer (key usage digitalSignature, EKU emailProtection, subject
and authority key identifiers, not a CA). Never trusted by anyone: c2pa reads its manifests as signed, untrusted."""

from __future__ import annotations

import datetime


def signing_chain() -> tuple[bytes, bytes]:
    """(certificate chain PEM, leaf first; private key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, "flux2-klein-beam tests")])

    def usage(sign: bool):
        return x509.KeyUsage(digital_signature=sign, content_commitment=False, key_encipherment=False,
                             data_encipherment=False, key_agreement=False, key_cert_sign=not sign, crl_sign=not sign,
                             encipher_only=False, decipher_only=False)

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def cert(subject, public_key, ca: bool):
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name("test CA"))
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=7))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                   .add_extension(usage(not ca), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))
        if not ca:
            builder = (builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]),
                                             critical=False)
                       .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                      critical=False))
        return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    chain = cert("test signer", key.public_key(), False) + cert("test CA", ca_key.public_key(), True)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return chain, pem
