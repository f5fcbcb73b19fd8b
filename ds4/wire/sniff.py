"""TLS or plain text? What the first bytes of a connection say, so that one end with `--tls-*`
and the other without fail at once, each with an error that says so.

Left alone, such a pair fails badly: a TLS server (`ssl`) that gets plain bytes fails its
handshake and closes without a word (OpenSSL answers a record that is not TLS with no alert),
which a plain client reads as a dropped connection (and may retry); a plain server reads a
TLS ClientHello as a bad magic; and where the plain server speaks first, both ends wait for the
other until the io timeout. So:

* a TLS server peeks at a new connection's first `TLS_PREFIX_BYTES` before its handshake
  (`peek_prefix`): a ClientHello is a TLS handshake record, whose first two bytes are the
  record type `TLS_HANDSHAKE_RECORD` and the major version `TLS_MAJOR_VERSION`. Anything else
  is a plain peer, which the wire answers in plain text with its own refusal record
  (`refuse`), naming the mismatch. `accept_tls` is that whole path, once for every wire: only
  the refusal differs between them;
* a plain end checks the first bytes it reads from its peer (`looks_like_tls`);
* a TLS client whose handshake meets a plain answer gets ssl's "wrong version number" (the
  answer is no TLS record); `wrap_client` raises `PlainPeer` for it instead.

Only the first two bytes are looked at here; the TLS itself is the ssl module's, unchanged.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from typing import Callable

from .deadline import Deadline

# A TLS record begins {u8 content type, u16 legacy version}; every version's major byte is 3
# (SSL 3.0 up to TLS 1.3, whose records say 3.1 or 3.3), RFC 8446 §5.1.
TLS_HANDSHAKE_RECORD = 0x16  # a ClientHello or ServerHello
TLS_ALERT_RECORD = 0x15
TLS_MAJOR_VERSION = 0x03
TLS_PREFIX_BYTES = 2  # the type and the major version: all that is looked at
# ssl's reasons for a handshake whose answer is not a TLS record (OpenSSL 3 says the first, older
# ones the second; the others are what a plain length read as a TLS one can give)
PLAIN_ANSWER_REASONS = frozenset({"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL",
                                  "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE"})
# When bytes of a prefix came but not all of it, the rest is waited for without spinning: a peek
# does not consume, so poll() would report the same bytes at once, forever. Where the socket has
# SO_RCVLOWAT (Linux, the BSDs, macOS), poll() is told to wake only once TLS_PREFIX_BYTES are in
# (or the peer closed); elsewhere, and after a peer that sent part of a prefix and closed, the
# peek is retried after a pause that doubles from PEEK_PAUSE_S up to PEEK_PAUSE_MAX_S, so a peer
# that stalls costs at most a few wake-ups a second, not a thousand.
PEEK_PAUSE_S = 0.001
PEEK_PAUSE_MAX_S = 0.25
# How long an end that refused its peer keeps reading what the peer still sends (and throws it
# away) before closing: a socket closed with unread bytes resets the connection, and the reset
# may overtake the refusal on its way.
REFUSAL_LINGER_S = 2.0
DRAIN_CHUNK = 4096

TLS_HINT = ("give both ends the TLS options (--tls-cert/--tls-key on the listening end, --tls-ca "
            "on the connecting one) or neither")


class PlainPeer(ssl.SSLError):
    """A TLS client's handshake got a plain-text answer: the server runs without TLS."""

    def __str__(self) -> str:  # (SSLError shows its args as a tuple)
        return self.args[0]


def looks_like_tls(first: bytes) -> bool:
    """Whether a connection's first bytes are a TLS record (a ClientHello, or an alert)."""
    return (len(first) >= TLS_PREFIX_BYTES and first[0] in (TLS_HANDSHAKE_RECORD, TLS_ALERT_RECORD)
            and first[1] == TLS_MAJOR_VERSION)


def peek_prefix(sock: socket.socket, deadline: Deadline) -> bytes:
    """The first TLS_PREFIX_BYTES of a new connection, left unread for the TLS handshake; fewer
    when the peer closed first. TimeoutError, saying how many bytes came, when they do not all
    come before `deadline`."""
    per_read = sock.gettimeout()
    lowat = _set_rcvlowat(sock, TLS_PREFIX_BYTES)
    pause, first = PEEK_PAUSE_S, b""
    try:
        while True:
            if deadline.expired:
                raise TimeoutError(_short_prefix(first, deadline))
            sock.settimeout(deadline.timeout(per_read))
            try:
                first = sock.recv(TLS_PREFIX_BYTES, socket.MSG_PEEK)
            except TimeoutError:
                if deadline.expired:  # (else a per-read timeout: the loop says it, next round)
                    raise TimeoutError(_short_prefix(_peek_now(sock), deadline)) from None
                raise
            if len(first) >= TLS_PREFIX_BYTES or not first:
                return first
            time.sleep(min(pause, deadline.left()))
            pause = min(2 * pause, PEEK_PAUSE_MAX_S)
    finally:
        if lowat is not None:
            _set_rcvlowat(sock, lowat)
        sock.settimeout(per_read)


def _set_rcvlowat(sock: socket.socket, n: int) -> int | None:
    """Set SO_RCVLOWAT to `n`; -> the value before, or None where the socket has none."""
    opt = getattr(socket, "SO_RCVLOWAT", None)
    if opt is None:
        return None
    try:
        before = sock.getsockopt(socket.SOL_SOCKET, opt)
        sock.setsockopt(socket.SOL_SOCKET, opt, n)
    except OSError:
        return None
    return before


def _peek_now(sock: socket.socket) -> bytes:
    """What of the prefix has come so far, without waiting (for the timeout's message)."""
    sock.setblocking(False)
    try:
        return sock.recv(TLS_PREFIX_BYTES, socket.MSG_PEEK)
    except OSError:
        return b""


def _short_prefix(first: bytes, deadline: Deadline) -> str:
    return (f"{deadline.what}: expected {TLS_PREFIX_BYTES} bytes within {deadline.seconds:g} s, "
            f"got {len(first)}")


def accept_tls(ctx: ssl.SSLContext, sock: socket.socket, deadline: Deadline,
               refusal: Callable[[], tuple[Exception, bytes | None]]) -> ssl.SSLSocket:
    """A TLS server's socket for a new connection whose first bytes are a TLS record (or whose
    peer closed first: the handshake then says so). The peek waits until `deadline`, the
    handshake as long as the socket's timeout. A peer that connected in plain text would read
    a failed handshake as a closed connection, so it gets none: `refusal()` gives the wire's
    error and its refusal record, the record is sent (`refuse`) and the error raised. A record
    of None leaves the answer to the caller's error path (DS4K answers every failure there)."""
    first = peek_prefix(sock, deadline)
    if first and not looks_like_tls(first):
        error, record = refusal()
        if record is not None:
            refuse(sock, record)
        raise error
    return ctx.wrap_socket(sock, server_side=True)


def wrap_client(ctx: ssl.SSLContext, sock: socket.socket, host: str, what: str) -> ssl.SSLSocket:
    """`ctx.wrap_socket` for a client; PlainPeer (naming `what`, e.g. "the stage at h:p") when the
    server answered in plain text. Other failures (certificates, a reset) are ssl's own."""
    try:
        return ctx.wrap_socket(sock, server_hostname=host)
    except ssl.SSLError as e:
        if getattr(e, "reason", None) in PLAIN_ANSWER_REASONS:
            raise PlainPeer(plain_server_reason(what)) from None
        raise


def plain_server_reason(what: str) -> str:
    return (f"{what} answered in plain text, not TLS: it runs without --tls-cert/--tls-key; "
            f"{TLS_HINT}")


def plain_client_reason(peer: str, me: str) -> str:
    return f"the {peer} connected in plain text but this {me} requires TLS; {TLS_HINT}"


def tls_peer_reason(peer: str, me: str) -> str:
    return (f"the {peer} speaks TLS (its first bytes are a TLS record) but this {me} runs without "
            f"TLS; {TLS_HINT}")


def refuse(sock: socket.socket, record: bytes, linger: float = REFUSAL_LINGER_S) -> None:
    """Send a plain refusal record, end this side of the connection and read (and drop) what the
    peer still sends until it closes or `linger` seconds have passed, so that the peer reads the
    refusal instead of a reset. The caller closes the socket."""
    with contextlib.suppress(OSError):
        sock.sendall(record)
        sock.shutdown(socket.SHUT_WR)
        deadline = Deadline(linger, "the refusal")
        while not deadline.expired:
            sock.settimeout(deadline.left())
            if not sock.recv(DRAIN_CHUNK):
                return
