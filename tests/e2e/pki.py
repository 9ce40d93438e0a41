"""Certificates and keys for a throw-away control plane: one CA, serving and client certificates, and the
service-account signing key pair, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=2)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


@dataclass(frozen=True)
class CertFiles:
    """A certificate and its private key on disk."""

    cert: Path
    key: Path


class CertificateAuthority:
    """A self-signed CA that issues serving and client certificates into a directory."""

    def __init__(self, directory: Path, name: str = "gpunode-e2e-ca") -> None:
        """Create the CA's key and certificate in `directory` (ca.crt, ca.key)."""
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / "ca.crt"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        _write_key(directory / "ca.key", self._key)

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        server: bool = False,
        client: bool = False,
        organizations: tuple[str, ...] = (),
        hosts: tuple[str, ...] = (),
        valid: tuple[datetime.datetime, datetime.datetime] | None = None,
    ) -> CertFiles:
        """A certificate for `common_name` (SANs `hosts`: IPs or DNS names) as <name>.crt and <name>.key;
        `valid`: (not before, not after), default from five minutes ago for two days."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid[0] if valid else now - datetime.timedelta(minutes=5))
            .not_valid_after(valid[1] if valid else now + _VALID)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if hosts:
            sans: list[x509.GeneralName] = []
            for h in hosts:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(h)))
                except ValueError:
                    sans.append(x509.DNSName(h))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        files = CertFiles(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(files.key, key)
        return files


def service_account_keys(directory: Path) -> CertFiles:
    """An RSA key pair for signing service-account tokens: sa.pub (as `cert`) and sa.key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    files = CertFiles(directory / "sa.pub", directory / "sa.key")
    files.cert.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    _write_key(files.key, key)
    return files
