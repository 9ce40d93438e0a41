"""A throw-away CA, server and client certificates for TLS tests, made with the `cryptography` package."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the CA certificate that signed both
    cert: Path  # the server's certificate (127.0.0.1, localhost)
    key: Path
    client_cert: Path
    client_key: Path
    other_key: Path  # a key that belongs to no certificate here
    ca_key: Path  # the CA's key, to issue more certificates (issue_server_cert)

    def client_context(self, *, with_cert: bool) -> ssl.SSLContext:
        """A client context trusting the CA, presenting the client certificate when asked to."""
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if with_cert:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return path


def _cert(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        builder = builder.add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def make_tls_files(directory: Path) -> TlsFiles:
    """Write a CA, a server certificate and a client certificate (with their keys) under `directory`."""
    ca_key = _key()
    ca = _cert("gpunode test CA", ca_key, None, ca_key, ca=True)
    server_key, client_key = _key(), _key()
    server = _cert("localhost", server_key, ca.subject, ca_key, server=True)
    client = _cert("prometheus", client_key, ca.subject, ca_key)

    def pem(cert: x509.Certificate, name: str) -> Path:
        path = directory / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    return TlsFiles(
        ca=pem(ca, "ca.crt"),
        cert=pem(server, "tls.crt"),
        key=_write_key(server_key, directory / "tls.key"),
        client_cert=pem(client, "client.crt"),
        client_key=_write_key(client_key, directory / "client.key"),
        other_key=_write_key(_key(), directory / "other.key"),
        ca_key=_write_key(ca_key, directory / "ca.key"),
    )


def issue_server_cert(tls: TlsFiles) -> tuple[bytes, bytes]:
    """A new server certificate (127.0.0.1, localhost) from the same CA, with its own key: (cert, key) PEM."""
    ca_key = serialization.load_pem_private_key(tls.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(tls.ca.read_bytes())
    key = _key()
    cert = _cert("localhost", key, ca.subject, ca_key, server=True)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
