"""The DS4K sender (the client): `make_manifest` of a payload, the connect and steps 0–5
(`_handshake`: send the opener, check the receiver's hello or refusal, prove the token both
ways, the receiver first, and get the verdict on the manifest), `probe_receiver` (the same with
no manifest), `open_transfer` and `send_payload`, which streams the payload and reads the
receiver's final reply.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import time

from ...core.payload import HEADER_BYTES, check_payload
from .. import auth, sniff
from ..address import format_hostport
from ..deadline import Deadline
from .records import (AUTH_FAILED, CHUNK, DEFAULT_TIMEOUT, FLAG_AUTH, HELLO, INCOMPLETE, MAGIC,
                      OK, OPENER, PROOF_BYTES, PROTOCOL, RECORD, STATUS_NAMES, TLS_MISMATCH,
                      VERSION, DS4KError, Manifest, _fingerprint_hex, _read_reason, _read_reply,
                      _recv_exact)

def make_manifest(src, fingerprint=None) -> Manifest:
    """The manifest of a payload (path or bytes): size, SHA-256, header fields."""
    h = hashlib.sha256()
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = memoryview(src).cast("B")
        size, head = len(data), bytes(data[:HEADER_BYTES])
        h.update(data)
    else:
        size = os.path.getsize(src)
        with open(src, "rb") as f:
            head = f.read(HEADER_BYTES)
            f.seek(0)
            while b := f.read(CHUNK):
                h.update(b)
    hdr = check_payload(head)  # a DSV4 payload at all: magic and version
    return Manifest(_fingerprint_hex(fingerprint), size, h.hexdigest(), hdr.n_tokens, hdr.ctx,
                    hdr.version, int(time.time()))


def _connect(host: str, port: int, timeout: float, connect_timeout: float,
             tls: ssl.SSLContext | None = None) -> socket.socket:
    """Connect, retrying a refused connection until connect_timeout (the receiver may start
    listening a little after the sender starts)."""
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            break
        except (ConnectionRefusedError, ConnectionResetError) as e:
            if time.monotonic() >= deadline:
                raise DS4KError(f"cannot connect to {format_hostport(host, port)}: "
                                f"{e.strerror or e} (retried for {connect_timeout:g} s)") from None
            time.sleep(0.05)
        except OSError as e:
            raise DS4KError(f"cannot connect to {format_hostport(host, port)}: {e.strerror or e}") from None
    if tls is None:
        return sock
    try:
        return sniff.wrap_client(tls, sock, host, f"the receiver at {format_hostport(host, port)}")
    except sniff.PlainPeer as e:
        sock.close()
        raise DS4KError(str(e), TLS_MISMATCH) from None
    except (OSError, ssl.SSLError) as e:
        sock.close()
        raise DS4KError(f"TLS with {format_hostport(host, port)} failed: {e}") from None


def _handshake(host: str, port: int, manifest: bytes, *, auth_token: str | None,
               timeout: float, connect_timeout: float,
               tls: ssl.SSLContext | None) -> socket.socket:
    """Steps 0–5 for `open_transfer` and `probe_receiver`: connect, send the opener, check the
    receiver's hello, prove the token both ways (the receiver first), send `manifest` (empty: a
    probe) and read the receiver's verdict on it. Returns the socket once the verdict is status
    0; raises DS4KError with the reason otherwise. The whole exchange must finish within
    `timeout`."""
    where = format_hostport(host, port)
    sock = _connect(host, port, timeout, connect_timeout, tls)
    deadline = Deadline(timeout, f"the DS4K hello with {where}")
    try:
        sock.sendall(OPENER.pack(MAGIC))
        magic, version, flags, _, server_nonce = _read_hello(sock, where, deadline)
        if magic != MAGIC or version != VERSION:
            raise DS4KError(f"{where} is not a DS4K v{VERSION} receiver "
                            f"(magic {magic:#010x}, version {version})")
        if flags & FLAG_AUTH and not auth_token:
            raise DS4KError(f"{where} requires an auth token (--auth-token-file / DS4_WIRE_TOKEN)",
                            AUTH_FAILED)
        if auth_token and not flags & FLAG_AUTH:
            raise DS4KError(f"{where} does not prove the auth token (it has none, or it is not the "
                            "receiver you meant to reach); nothing was sent to it", AUTH_FAILED)
        me = auth.ClientAuth(auth_token, PROTOCOL) if auth_token else None
        head = RECORD.pack(MAGIC, VERSION, FLAG_AUTH if me else 0, len(manifest))
        sock.sendall(head + (me.nonce if me else b""))
        status, reason = _read_reply(sock, "the receiver's verdict on the record", deadline)
        if status != OK:
            raise DS4KError(f"receiver refused the record ({STATUS_NAMES.get(status, status)}): "
                            f"{reason}", status, reason)
        if me is not None:
            proof = _recv_exact(sock, PROOF_BYTES, "the receiver's auth proof", deadline)
            try:
                me.check_server(server_nonce, proof)
            except auth.AuthError as e:
                raise DS4KError(f"{where}: {e}; nothing was sent to it", AUTH_FAILED) from None
        sock.sendall((me.proof() if me else b"") + manifest)
        status, reason = _read_reply(sock, "the receiver's verdict on the manifest", deadline)
        if status != OK:
            raise DS4KError(f"receiver refused the payload ({STATUS_NAMES.get(status, status)}): "
                            f"{reason}", status, reason)
        return sock
    except DS4KError:
        sock.close()
        raise
    except (OSError, ssl.SSLError) as e:
        sock.close()
        raise DS4KError(f"connection to {where} failed during the hello: {e}", INCOMPLETE) from None
    except BaseException:
        sock.close()
        raise


def _read_hello(sock: socket.socket, where: str, deadline: Deadline) -> tuple:
    """Step 1: the receiver's hello, or the refusal it sent instead (DS4KError with its status
    and reason; the first u32 of a hello is the magic, of a refusal a status)."""
    first = _recv_exact(sock, OPENER.size, "the receiver's hello", deadline)
    if sniff.looks_like_tls(first):
        raise DS4KError(sniff.tls_peer_reason(f"receiver at {where}", "sender"), TLS_MISMATCH)
    (word,) = OPENER.unpack(first)
    if word != MAGIC and word in STATUS_NAMES and word != OK:
        (n,) = OPENER.unpack(_recv_exact(sock, OPENER.size, "the receiver's refusal", deadline))
        reason = _read_reason(sock, n, "the receiver's refusal", deadline)
        raise DS4KError(f"receiver refused the connection ({STATUS_NAMES[word]}): {reason}", word,
                        reason)
    return HELLO.unpack(first + _recv_exact(sock, HELLO.size - OPENER.size, "the receiver's hello",
                                            deadline))


def probe_receiver(host: str, port: int, *, auth_token: str | None = None,
                   timeout: float = DEFAULT_TIMEOUT, connect_timeout: float | None = None,
                   tls: ssl.SSLContext | None = None) -> None:
    """Steps 1–5 with no manifest, then close: raises DS4KError when nothing listens there
    (after retrying a refused connection for `connect_timeout`, default PROBE_CONNECT_TIMEOUT),
    it is not a DS4K receiver, or the two ends do not share the token. The receiver counts a
    probe as no failure and goes on waiting."""
    from .. import ds4k  # the package: PROBE_CONNECT_TIMEOUT is read (and patched) there

    wait = ds4k.PROBE_CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
    _handshake(host, port, b"", auth_token=auth_token, timeout=timeout, connect_timeout=wait,
               tls=tls).close()


def open_transfer(host: str, port: int, manifest: Manifest, *, auth_token: str | None = None,
                  timeout: float = DEFAULT_TIMEOUT, connect_timeout: float | None = None,
                  tls: ssl.SSLContext | None = None) -> socket.socket:
    """Steps 1–5: connect, prove the token both ways (the receiver first), send the manifest;
    returns the socket once the receiver accepts it (raises DS4KError with its reason
    otherwise). The whole exchange must finish within `timeout`."""
    return _handshake(host, port, manifest.encode(), auth_token=auth_token, timeout=timeout,
                      connect_timeout=timeout if connect_timeout is None else connect_timeout,
                      tls=tls)


def send_payload(src, host: str, port: int, *, fingerprint=None, auth_token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, connect_timeout: float | None = None,
                 tls: ssl.SSLContext | None = None) -> Manifest:
    """Send a payload (a path or bytes) to a DS4K receiver; returns the manifest sent. Raises
    DS4KError with the receiver's reason when it refuses or fails the transfer."""
    manifest = make_manifest(src, fingerprint)
    with open_transfer(host, port, manifest, auth_token=auth_token, timeout=timeout,
                       connect_timeout=connect_timeout, tls=tls) as sock:
        try:
            if isinstance(src, (bytes, bytearray, memoryview)):
                data = memoryview(src).cast("B")
                for i in range(0, len(data), CHUNK):
                    sock.sendall(data[i: i + CHUNK])
            else:
                with open(src, "rb") as f:
                    sock.sendfile(f, 0, manifest.payload_bytes)
        except (BrokenPipeError, ConnectionResetError) as e:
            # the receiver gave up mid-stream; its reply (if any) says why
            try:
                status, reason = _read_reply(sock, "the receiver's reply")
            except DS4KError:
                raise DS4KError(f"connection lost while sending the payload: {e}", INCOMPLETE) from None
            raise DS4KError(f"receiver failed the transfer ({STATUS_NAMES.get(status, status)}): "
                            f"{reason}", status, reason) from None
        except socket.timeout:
            raise DS4KError("timed out sending the payload", INCOMPLETE) from None
        status, reason = _read_reply(sock, "the receiver's reply",
                                     Deadline(timeout, "the receiver's final reply"))
        if status != OK:
            raise DS4KError(f"receiver failed the transfer ({STATUS_NAMES.get(status, status)}): "
                            f"{reason}", status, reason)
    return manifest
