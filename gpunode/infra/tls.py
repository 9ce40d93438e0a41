"""TLS for gpunode's servers: server contexts from PEM files, with one-line errors (TlsConfigError).

server_tls_context() is re-exported by gpunode.infra.http, where servers take
the context (HttpServer(..., ssl_context=...)). Contexts speak TLS 1.2 or later
and offer HTTP/1.1 only (ALPN), as the HTTP layer serves nothing else.
"""

from __future__ import annotations

import os
import ssl

from gpunode.config.files import open_regular, regular_path
from gpunode.errors import TlsConfigError


def server_tls_context(
    cert_file: str, key_file: str, client_ca_file: str | None = None, *, require_client_cert: bool = True
) -> ssl.SSLContext:
    """A server TLS context (TLS 1.2 or later, HTTP/1.1) from PEM files; TlsConfigError when one is unusable.

    With `client_ca_file`, clients must present a certificate signed by one of its CAs (or, with
    require_client_cert=False, a certificate they do present is verified against them).
    """
    # Each file is opened without blocking and must be a regular file (a FIFO put in its place must not
    # stall the server); OpenSSL then reads the very file that was checked, through its descriptor.
    fds: dict[str, int] = {}
    try:
        for what, path in (("certificate", cert_file), ("key", key_file), ("client CA", client_ca_file)):
            if path is not None:
                try:
                    fds[what] = open_regular(path)
                except OSError as err:
                    raise TlsConfigError(
                        f"cannot read the TLS {what} file {path}: {err.strerror or err}"
                    ) from None
        return _context(
            regular_path(fds["certificate"]),
            regular_path(fds["key"]),
            regular_path(fds["client CA"]) if "client CA" in fds else None,
            names=(cert_file, key_file, client_ca_file),
            require_client_cert=require_client_cert,
        )
    finally:
        for fd in fds.values():
            os.close(fd)


def _context(
    cert: str, key: str, ca: str | None, *, names: tuple[str, str, str | None], require_client_cert: bool
) -> ssl.SSLContext:
    cert_file, key_file, client_ca_file = names
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])

    def encrypted() -> bytes:
        raise TlsConfigError(
            f"the TLS key {key_file} is encrypted",
            hint="give the key unencrypted (openssl pkey -in KEY -out PLAIN)",
        )

    try:
        ctx.load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as err:
        why = (
            "the key does not belong to the certificate"
            if "KEY_VALUES_MISMATCH" in str(err)
            else (f"not a PEM certificate chain and private key ({err.reason or err})")
        )
        raise TlsConfigError(
            f"cannot use the TLS certificate {cert_file} with the key {key_file}: {why}"
        ) from None
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=ca)
        except ssl.SSLError as err:
            raise TlsConfigError(
                f"the client CA file {client_ca_file} holds no usable PEM certificate ({err.reason or err})",
                hint="give the PEM certificate(s) of the CA that signs the clients' certificates",
            ) from None
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx
