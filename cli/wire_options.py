"""Options every networked command shares: the shared secret, TLS files, io timeout.

    token = wire_token(auth_token, auth_token_file)        # prints the warnings on stderr
    warn_exposed(host, token)                               # a server beyond loopback, no token
    ctx = server_tls(tls_cert, tls_key, tls_ca)             # or client_tls(...); None without TLS

The secret comes from `--auth-token-file FILE`, else `DS4_WIRE_TOKEN`; `--auth-token VALUE` is
refused (every local user can read a process's arguments).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from .common import CLIError, err
from .options import check_range

AuthTokenFileOption = Annotated[Optional[Path], typer.Option(
    "--auth-token-file", metavar="FILE", dir_okay=False, show_default=False,
    help="Read the shared secret from FILE (keep it mode 600). Both ends prove it (HMAC-SHA256 "
         "over each other's nonce) before any model data moves. Default: $DS4_WIRE_TOKEN.")]

# (kept, hidden, so that a secret given on the command line gets an error saying where it goes
# instead of "no such option")
AuthTokenOption = Annotated[Optional[str], typer.Option(
    "--auth-token", metavar="TOKEN", show_default=False, hidden=True,
    help="Refused: a secret on the command line is visible to every local user; use "
         "--auth-token-file or DS4_WIRE_TOKEN.")]

TlsCertOption = Annotated[Optional[Path], typer.Option(
    "--tls-cert", metavar="PEM", dir_okay=False, show_default=False,
    help="TLS certificate (PEM) of this end; a server with TLS needs it and --tls-key.")]

TlsKeyOption = Annotated[Optional[Path], typer.Option(
    "--tls-key", metavar="PEM", dir_okay=False, show_default=False,
    help="Private key (PEM) of --tls-cert.")]

TlsCaOption = Annotated[Optional[Path], typer.Option(
    "--tls-ca", metavar="PEM", dir_okay=False, show_default=False,
    help="CA certificates (PEM) to trust: a client checks the server's certificate and host "
         "against them; a server then requires client certificates signed by them.")]

DEFAULT_IO_TIMEOUT = 120.0  # seconds: --io-timeout's default on every networked command

IoTimeoutOption = Annotated[float, typer.Option(
    "--io-timeout", metavar="SECONDS", callback=check_range(0.0, lo_open=True),
    help="Longest wait for a peer's bytes; a hello and a frame must also finish within it "
         "(a transfer within it plus its size at 1 MiB/s).")]


def warn(message: str) -> None:
    err.print(Text.assemble(("warning: ", "bold yellow"), (message, "yellow")), soft_wrap=True)


def wire_token(auth_token: str | None, auth_token_file: Path | None) -> str | None:
    """The shared secret (or None), warnings printed; a bad file is a CLIError."""
    from ds4.wire.auth import resolve_token

    try:
        token, warnings = resolve_token(token_file=auth_token_file, argv_token=auth_token)
    except ValueError as e:
        raise CLIError(str(e)) from None
    for w in warnings:
        warn(w)
    return token


def warn_exposed(host: str, token: str | None) -> None:
    from ds4.wire.auth import exposure_warning

    message = exposure_warning(host, token)
    if message:
        warn(message)


def _files(cert, key, ca):
    from ds4.wire.tls import TlsFiles

    return TlsFiles(cert, key, ca)


def server_tls(cert: Path | None, key: Path | None, ca: Path | None):
    from ds4.wire.tls import server_context

    try:
        return server_context(_files(cert, key, ca))
    except ValueError as e:
        raise CLIError(str(e)) from None


def client_tls(cert: Path | None, key: Path | None, ca: Path | None):
    from ds4.wire.tls import client_context

    try:
        return client_context(_files(cert, key, ca))
    except ValueError as e:
        raise CLIError(str(e)) from None
