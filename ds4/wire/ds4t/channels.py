"""DS4T on a socket, except the gates: `recv_exact` (exactly n bytes within a deadline, TLS-aware
through `_tls_pending`), the `ControlChannel` that carries frames between leader and worker,
and connection setup: `handshake` (exchange and check the hellos, or take a leader's refusal)
with `mutual_auth`, the shared-secret proof that runs right after the hellos when FLAG_AUTH is
set, and `refusal_record`, the leader's refusal in place of its hello.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from typing import Callable

from .. import auth, refusal, sniff
from .base import (FLAG_AUTH, FRAME_HEADER, HELLO, MAGIC, PROTOCOL, REFUSAL_MAGIC, DS4TClosed,
                   DS4TError, PeerRefused, TlsMismatch)
from .frames import Frame, Limits, pack_frame, read_frame
from .hello import Hello, Role, check_peer

# the slowest a frame's bytes may move past the io timeout: a STATE frame carries a whole session
# (gigabytes at a long context on the real model), which no fixed timeout fits (as DS4K's
# payload, whose deadline grows the same way)
MIN_FRAME_RATE = 1 << 20  # bytes a second


def _tls_pending(sock: socket.socket) -> bool:
    """Whether TLS holds decrypted bytes of this socket in its own buffer, which a poll of the
    descriptor cannot see (a plain socket has none)."""
    pending = getattr(sock, "pending", None)
    return bool(pending and pending())


def recv_exact(sock: socket.socket, n: int, timeout: float | None, what: str) -> bytearray:
    """Exactly n bytes from a blocking socket, all within `timeout` seconds (None: no limit)."""
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    deadline = None if timeout is None else time.monotonic() + timeout
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while got < n:
        # wait in poll, never in recv: the socket's own timeout is for sends only
        if deadline is None:
            wait = -1
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DS4TClosed("timeout", f"{what}: {got} of {n} bytes within {timeout:g} s")
            wait = max(1, int(left * 1000))
        if not _tls_pending(sock) and not poller.poll(wait):
            continue
        try:
            k = sock.recv_into(view[got:])
        except OSError as e:
            raise DS4TClosed("eof", f"{what}: {e}") from None
        if k == 0:
            raise DS4TClosed("eof", f"{what}: the peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


class ControlChannel:
    """The control connection: mirrored commands leader -> worker, acks and LOGITS back."""

    def __init__(self, sock: socket.socket, limits: Limits, peer_role: Role, io_timeout: float):
        self.sock, self.limits, self.io_timeout = sock, limits, io_timeout
        self.peer_role = Role(peer_role)
        sock.settimeout(io_timeout)  # sends

    def allowance(self, nbytes: int) -> float:
        """Seconds a frame of nbytes may take: the io timeout, plus its bytes at MIN_FRAME_RATE."""
        return self.io_timeout + nbytes / MIN_FRAME_RATE

    def send(self, frame: Frame) -> None:
        data = pack_frame(frame)
        allowed = self.allowance(len(data))
        try:
            self.sock.settimeout(allowed)  # (sendall's timeout covers the whole frame)
            self.sock.sendall(data)
        except TimeoutError:
            raise DS4TClosed("timeout", f"sending {frame.TYPE.name}: the peer did not read its {len(data)} bytes "
                             f"within {allowed:g} s") from None
        except OSError as e:
            raise DS4TClosed("eof", f"sending {frame.TYPE.name}: {e}") from None
        finally:
            with contextlib.suppress(OSError):  # (a socket the failure closed)
                self.sock.settimeout(self.io_timeout)

    def recv(self, idle_timeout: float | None = None) -> Frame:
        """The next frame. The header may take `idle_timeout` (None: a worker idles until the
        leader sends or closes); the rest of the frame must follow within its allowance."""
        head = recv_exact(self.sock, FRAME_HEADER.size, idle_timeout, "control frame header")
        return read_frame(lambda n: recv_exact(self.sock, n, self.allowance(n), "control frame"),
                          self.limits, header=bytes(head), sender=self.peer_role)


def mutual_auth(token: str | bytes, role: Role, timeout: float) -> Callable[[socket.socket], None]:
    """The `authenticate` callable for `handshake` on one end: `ds4.wire.auth`'s mutual proof of
    `token`, the leader as the server. Every read of it ends within `timeout` seconds in all."""
    role = Role(role)
    if not token:  # refused here, not at the first connection
        raise ValueError("auth token: expected a non-empty secret")

    def send(sock: socket.socket, data: bytes, what: str) -> None:
        try:
            sock.sendall(data)
        except OSError as e:
            raise DS4TClosed("eof", f"sending {what}: {e}") from None

    def read(sock: socket.socket, n: int, what: str, until: float) -> bytes:
        left = until - time.monotonic()
        if left <= 0:
            raise DS4TClosed("timeout", f"{what}: the auth exchange took over {timeout:g} s")
        return bytes(recv_exact(sock, n, left, what))

    def as_leader(sock: socket.socket) -> None:
        until = time.monotonic() + timeout
        me = auth.ServerAuth(token, PROTOCOL)
        client_nonce = read(sock, auth.NONCE_BYTES, "the worker's auth nonce", until)
        send(sock, me.nonce + me.proof(client_nonce), "the leader's auth proof")
        try:
            me.check_client(read(sock, auth.PROOF_BYTES, "the worker's auth proof", until))
        except auth.AuthError as e:
            raise DS4TError("auth", f"the worker did not prove the shared secret: {e}") from None

    def as_worker(sock: socket.socket) -> None:
        until = time.monotonic() + timeout
        me = auth.ClientAuth(token, PROTOCOL)
        send(sock, me.nonce, "the worker's auth nonce")
        server_nonce = read(sock, auth.NONCE_BYTES, "the leader's auth nonce", until)
        try:
            me.check_server(server_nonce, read(sock, auth.PROOF_BYTES, "the leader's auth proof",
                                               until))
        except auth.AuthError:
            raise DS4TError("auth", "the leader did not prove the shared secret (it does not know "
                            "it, or it is not the leader you meant to reach); it got only this "
                            "worker's hello and nonce") from None
        send(sock, me.proof(), "the worker's auth proof")

    return as_leader if role == Role.LEADER else as_worker


def refusal_record(reason: str) -> bytes:
    """A leader's refusal, sent in place of its hello (`sniff.refuse` sends it)."""
    return refusal.pack(REFUSAL_MAGIC, reason)


def _read_hello(sock: socket.socket, me: Role, timeout: float) -> Hello:
    """The peer's hello, all of it within `timeout`: PeerRefused when a leader sent a refusal in
    its place (read as the worker only), TlsMismatch when its first bytes are a TLS record (this
    end is plain), DS4TError "magic" at once for any other first word."""
    until = time.monotonic() + timeout
    peer = (Role.WORKER if me == Role.LEADER else Role.LEADER).name.lower()

    def read(n: int, what: str) -> bytes:
        return bytes(recv_exact(sock, n, max(0.0, until - time.monotonic()), what))

    first = read(refusal.WORD.size, "the peer's hello")
    if sniff.looks_like_tls(first):
        sniff.refuse(sock, b"")  # (it reads this end's plain hello, not a reset)
        raise TlsMismatch("tls", sniff.tls_peer_reason(peer, me.name.lower()))
    # (only a leader sends a refusal: a leader that reads one has met a stranger, and reads its
    # "DS4R" as the bad magic it is)
    (magic,) = refusal.WORD.unpack(first)
    if me == Role.WORKER and magic == REFUSAL_MAGIC:
        try:
            reason = refusal.read_reason(lambda n: read(n, "the peer's refusal"))
        except ValueError as e:
            raise DS4TError("refusal", str(e)) from None
        raise PeerRefused(reason)
    if magic != MAGIC:  # (told at once: a stranger need not send, or be waited for, 72 bytes)
        raise DS4TError("magic", f"expected {MAGIC:#010x} (DS4T hello), got {magic:#010x}")
    return Hello.unpack(first + read(HELLO.size - len(first), "the peer's hello"))


def handshake(sock: socket.socket, mine: Hello, *, timeout: float,
              authenticate: Callable[[socket.socket], None] | None = None) -> tuple[Hello, int]:
    """Both ends: send this end's hello, read and check the peer's; -> (peer hello, agreed ctx).

    With FLAG_AUTH set (on both ends, or check_peer refuses), `authenticate(sock)` runs the
    shared mutual-auth handshake (both ends prove the secret) after the 72-byte hellos and
    before anything else on this connection; it must raise on a failed proof.
    """
    if mine.flags & FLAG_AUTH and authenticate is None:
        raise ValueError("mine.flags has FLAG_AUTH but no authenticate callable was given")
    sock.settimeout(timeout)
    try:
        sock.sendall(mine.pack())
    except OSError as e:
        raise DS4TClosed("eof", f"sending the hello: {e}") from None
    theirs = _read_hello(sock, mine.role, timeout)
    if (mine.flags ^ theirs.flags) & FLAG_AUTH:
        check_peer(mine, theirs)  # raises, naming flags
    if mine.flags & FLAG_AUTH:
        authenticate(sock)
    return theirs, check_peer(mine, theirs)
