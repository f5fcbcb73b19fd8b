"""Mutual proof of a shared secret, shared by every ds4 wire (qkp6, DS4K and DS4T).

Both ends prove that they know the token before any model data moves: the server first, over a
nonce the client chose, so a listener that does not know the token learns nothing but a nonce
and a record header; then the client, over a nonce the server chose. Neither proof can be
replayed on another connection (fresh nonces on both sides), reflected to the other direction
(distinct labels) or carried to another protocol (the protocol name is in the message).

Byte layout (HMAC-SHA256, key = the token as UTF-8, `||` = concatenation):

    client_nonce  32 random bytes, chosen by the client
    server_nonce  32 random bytes, chosen by the server
    server_proof  HMAC(token, b"ds4 wire auth v2 server\\0" || protocol || client_nonce || server_nonce)
    client_proof  HMAC(token, b"ds4 wire auth v2 client\\0" || protocol || client_nonce || server_nonce)

`protocol` is the wire's 4-byte magic as it travels (b"6pkq" for qkp6's little-endian u32,
b"DS4K", b"T4SD" for DS4T's 0x44533454). Each wire decides where the nonces and proofs sit in
its records (see qkp.py, ds4k/ and ds4t/; on DS4T the leader is the server); the order
is always: both nonces exchanged, server proof checked by the client, then client proof
checked by the server, then model data. Proofs are compared in
constant time (`hmac.compare_digest`).

What the proof does not do: it authenticates the two ends once, at the start; it does not
encrypt or bind the rest of the connection, so a peer on the path can read the frames and relay
or alter them. Links that cross untrusted networks use TLS as well (`ds4.wire.tls`).

Secrets: `resolve_token` reads the token from a file, the environment (`DS4_WIRE_TOKEN`), or
(deprecated, with a warning) the command line, and `exposure_warning` says when a server binds
beyond loopback without one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import stat
from pathlib import Path

NONCE_BYTES = 32
PROOF_BYTES = 32
SERVER_LABEL = b"ds4 wire auth v2 server\0"
CLIENT_LABEL = b"ds4 wire auth v2 client\0"
TOKEN_ENV = "DS4_WIRE_TOKEN"
# A token file is a secret, not a document: anything larger is the wrong file.
MAX_TOKEN_FILE_BYTES = 4096
# a secret shorter than this is warned about: a server proves it first, over a nonce the client
# chose, so anyone who can connect may take a proof away and guess a short secret offline
MIN_TOKEN_BYTES = 16


class AuthError(Exception):
    """The peer did not prove the shared secret (or proved it out of order)."""


def _key(token: str | bytes) -> bytes:
    key = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not key:
        raise ValueError("auth token: expected a non-empty secret")
    return key


def _check_nonce(name: str, nonce: bytes) -> bytes:
    nonce = bytes(nonce)
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"{name}: expected {NONCE_BYTES} bytes, got {len(nonce)}")
    return nonce


def server_proof(token: str | bytes, protocol: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    msg = SERVER_LABEL + protocol + _check_nonce("client_nonce", client_nonce) + \
        _check_nonce("server_nonce", server_nonce)
    return hmac.new(_key(token), msg, hashlib.sha256).digest()


def client_proof(token: str | bytes, protocol: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    msg = CLIENT_LABEL + protocol + _check_nonce("client_nonce", client_nonce) + \
        _check_nonce("server_nonce", server_nonce)
    return hmac.new(_key(token), msg, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class ClientAuth:
    """The client's half for one connection: send `nonce`, check the server's proof, and only
    then `proof()` (which refuses to run before the server proved itself)."""

    def __init__(self, token: str | bytes, protocol: bytes):
        self.token, self.protocol = token, protocol
        self.nonce = new_nonce()
        self._server_nonce: bytes | None = None

    def check_server(self, server_nonce: bytes, proof: bytes) -> None:
        want = server_proof(self.token, self.protocol, self.nonce, server_nonce)
        if not hmac.compare_digest(bytes(proof), want):
            raise AuthError("the server did not prove the auth token (it does not know it, or "
                            "it is not the server you meant to reach)")
        self._server_nonce = bytes(server_nonce)

    def proof(self) -> bytes:
        if self._server_nonce is None:
            raise AuthError("the client proof is only sent after the server proved the token")
        return client_proof(self.token, self.protocol, self.nonce, self._server_nonce)


class ServerAuth:
    """The server's half for one connection: `nonce` to send, `proof(client_nonce)` to send,
    then `check_client(proof)`."""

    def __init__(self, token: str | bytes, protocol: bytes):
        self.token, self.protocol = token, protocol
        self.nonce = new_nonce()
        self._client_nonce: bytes | None = None

    def proof(self, client_nonce: bytes) -> bytes:
        self._client_nonce = _check_nonce("client_nonce", client_nonce)
        return server_proof(self.token, self.protocol, self._client_nonce, self.nonce)

    def check_client(self, proof: bytes) -> None:
        if self._client_nonce is None:
            raise AuthError("no client nonce was received before the client proof")
        want = client_proof(self.token, self.protocol, self._client_nonce, self.nonce)
        if not hmac.compare_digest(bytes(proof), want):
            raise AuthError("wrong auth token")


# ---- where the secret comes from ----------------------------------------------------------------


def read_token_file(path: str | os.PathLike) -> tuple[str, str | None]:
    """The token in `path` (surrounding whitespace stripped) and a warning when the file is
    readable by other users (None otherwise)."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--auth-token-file: {p} is not a regular file")
        if st.st_size > MAX_TOKEN_FILE_BYTES:
            raise ValueError(f"--auth-token-file: {p} is {st.st_size} bytes; a token file holds "
                             f"one secret of at most {MAX_TOKEN_FILE_BYTES} bytes")
        text = p.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--auth-token-file: cannot read {p}: {e}") from None
    if not text:
        raise ValueError(f"--auth-token-file: {p} is empty")
    warning = None
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        warning = (f"{p} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                   f"chmod 600 it")
    return text, warning


def resolve_token(*, token_file: str | os.PathLike | None = None, argv_token: str | None = None,
                  environ=None) -> tuple[str | None, list[str]]:
    """The shared secret and the warnings to print: from `--auth-token-file`, else from
    `DS4_WIRE_TOKEN`. A secret given on the command line (`--auth-token`) is refused: every
    local user can read it in the process list."""
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    if argv_token is not None:
        raise ValueError("--auth-token: a secret on the command line is visible to every local user "
                         "in the process list; give it as --auth-token-file FILE (mode 600) or in "
                         f"${TOKEN_ENV}")
    if token_file is not None:
        token, warning = read_token_file(token_file)
        if warning:
            warnings.append(warning)
    else:
        token = environ.get(TOKEN_ENV) or None
    size = len(token.encode()) if token is not None else None
    if size is not None and size < MIN_TOKEN_BYTES:
        warnings.append(f"the auth token is {size} bytes: anyone who can connect may take a proof of it "
                        f"away and guess a short one offline; use at least {MIN_TOKEN_BYTES} random bytes "
                        "(e.g. `openssl rand -hex 32`)")
    return token, warnings


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def exposure_warning(host: str, token: str | None) -> str | None:
    """A warning when a server listens beyond loopback and anyone who can reach it may connect."""
    if token or is_loopback(host):
        return None
    return (f"listening on {host} without an auth token: anyone who can reach this port can "
            "connect; set --auth-token-file FILE (or DS4_WIRE_TOKEN) on both ends")
