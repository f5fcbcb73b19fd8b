"""Optional TLS for every ds4 wire (Python's `ssl`), from `--tls-cert/--tls-key/--tls-ca`.

The auth proof (`ds4.wire.auth`) shows each end knows the token but leaves the frames in clear;
across an untrusted network wrap the connection in TLS as well:

* a server needs `--tls-cert` and `--tls-key` (PEM); with `--tls-ca` it also requires every
  client to present a certificate signed by that CA (mutual TLS);
* a client with `--tls-ca` trusts only servers whose certificate that CA signed, and checks that
  the certificate names the host it dialled (DNS name or IP address); without `--tls-ca` it
  trusts the system's CAs. `--tls-cert/--tls-key` on a client present a client certificate.

TLS 1.2 is the oldest version accepted. The TLS handshake happens first, then the wire's own
hello and auth proof inside it.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsFiles:
    cert: str | os.PathLike | None = None
    key: str | os.PathLike | None = None
    ca: str | os.PathLike | None = None

    @property
    def enabled(self) -> bool:
        return any(x is not None for x in (self.cert, self.key, self.ca))


def _check_pair(files: TlsFiles, who: str) -> None:
    if (files.cert is None) != (files.key is None):
        raise ValueError(f"--tls-cert/--tls-key: a {who} needs both the certificate and its key, "
                         f"got only --tls-{'cert' if files.cert is not None else 'key'}")


def _load(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    try:
        if files.cert is not None:
            ctx.load_cert_chain(os.fspath(files.cert), os.fspath(files.key))
        if files.ca is not None:
            ctx.load_verify_locations(cafile=os.fspath(files.ca))
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"TLS: cannot load the certificate, key or CA file: {e}") from None


def server_context(files: TlsFiles | None) -> ssl.SSLContext | None:
    """The listening side's context, or None when no TLS file was given."""
    if files is None or not files.enabled:
        return None
    if files.cert is None:
        raise ValueError("--tls-cert/--tls-key: a server with TLS needs its certificate and key "
                         "(--tls-ca alone only says which clients to trust)")
    _check_pair(files, "server")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, files)
    if files.ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(files: TlsFiles | None) -> ssl.SSLContext | None:
    """The connecting side's context (verifies the server's certificate and host), or None."""
    if files is None or not files.enabled:
        return None
    _check_pair(files, "client")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH) if files.ca is None else \
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, files)
    return ctx
