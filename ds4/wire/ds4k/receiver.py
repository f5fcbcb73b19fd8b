"""The DS4K receiver (the server): `Receiver` listens, serves up to `max_conns` connections at
once on their own threads, runs steps 0–7 on each (hello, proofs, manifest checks against this
end's model, size limit and free disk), streams the one payload that lands to a temporary file
beside the destination, verifies it and renames it into place; `receive_payload` wraps it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import ssl
import threading
import time
from pathlib import Path

from ...core.atomic import atomic_path
from ...core.config import ModelConfig
from ...core.payload import HEADER_BYTES, ModelRef, PayloadError, check_payload
from ...core.payload_identity import SHORT_HEX, distinct_digits, short_hex
from .. import auth, sniff
from ..address import format_hostport, listen_socket
from ..deadline import Deadline
from .records import (ACCEPT_POLL, ACCEPT_POLL_MIN, AUTH_FAILED, CHUNK, CORRUPT,
                      DEFAULT_MAX_BYTES, DEFAULT_MAX_CONNS, DEFAULT_MIN_RATE, DEFAULT_TIMEOUT,
                      FLAG_AUTH, HELLO, INCOMPLETE, IO_ERROR, MAGIC, MAX_MANIFEST_BYTES,
                      NONCE_BYTES, OK, OPENER, PROBE_MANIFEST_BYTES, PROOF_BYTES, PROTOCOL,
                      RECORD, REFUSED, REPLY, TLS_MISMATCH, VERSION, DS4KError, Manifest,
                      _fingerprint_hex, _Probed, _recv_exact, _reply, _send_reply)

log = logging.getLogger("ds4.wire.ds4k")

KEPT_FAILURES = 64  # the dropped connections a receiver keeps for its error message


def listen(host: str, port: int, max_conns: int = DEFAULT_MAX_CONNS) -> socket.socket:
    """A receiver's listener, as Receiver binds it (a port in use or a host that is not this
    machine's: ListenError, naming the address): bound before the model is loaded, it is
    Receiver's `sock`."""
    return listen_socket(host, port, max(4, max_conns))


class Receiver:
    """A listening DS4K endpoint (bound on construction, so port 0 picks a free port).

    `receive()` serves up to `max_conns` connections at once, each on its own thread, until one
    payload has landed; a connection that is malformed, unauthenticated, refused or too slow is
    logged (logger "ds4.wire.ds4k") and dropped, and the receiver keeps waiting.
    """

    def __init__(self, port: int, *, host: str = "127.0.0.1", fingerprint=None,
                 config: ModelConfig | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 auth_token: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 min_rate: float = DEFAULT_MIN_RATE, max_conns: int = DEFAULT_MAX_CONNS,
                 tls: ssl.SSLContext | None = None, sock: socket.socket | None = None):
        """`sock`: a socket already listening (see `listen`), which the receiver then owns, so
        that a caller binds before it loads the model (port and host are then the socket's);
        None: bind host:port here."""
        if max_conns < 1 or min_rate <= 0:
            raise ValueError(f"max_conns: expected at least 1 (and min_rate > 0), got "
                             f"{max_conns}, {min_rate}")
        self.fingerprint = _fingerprint_hex(fingerprint)
        self.config = config
        self.max_bytes = max_bytes
        self.auth_token = auth_token or None
        self.timeout = timeout
        self.min_rate = min_rate
        self.max_conns = max_conns
        self.tls = tls
        # the dropped connections of the last receive(): how many, and the latest KEPT_FAILURES
        # (a receiver waiting without a time limit must not grow with every peer that fails)
        self.n_failures = 0
        self.failures: list[DS4KError] = []
        # (a port in use or a host that is not this machine's: ListenError, naming the address)
        self.sock = sock if sock is not None else listen(host, port, max_conns)
        self.host, self.port = self.sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._landing = threading.Lock()  # one payload streams to the destination at a time

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def receive(self, out_path: str | os.PathLike, accept_timeout: float | None = None, *,
                max_failures: int | None = None) -> Manifest:
        """Wait until a sender's payload has landed at out_path (returns its manifest).

        Failed connections are told why, logged, counted in `self.n_failures` (the latest kept in
        `self.failures`) and dropped; the wait goes on until `accept_timeout` seconds have passed
        (None: no limit) or `max_failures` connections failed, then DS4KError says what went wrong
        (the last failure's status and reason). Nothing is left at out_path unless a payload
        landed whole."""
        out_path = Path(out_path)
        if not out_path.parent.is_dir():
            raise DS4KError(f"destination directory does not exist: {out_path.parent}", IO_ERROR)
        deadline = Deadline(accept_timeout, "receiving a payload")
        self.failures, self.n_failures = [], 0
        done = threading.Event()  # the wait is over: a payload landed, or too many failed
        landed = threading.Event()  # set under the landing lock: nobody else may land now
        result: list[Manifest] = []
        active: dict[socket.socket, dict] = {}  # accepted socket -> {"sock": what to shut down}

        def serve(conn: socket.socket, peer: str, holder: dict) -> None:
            try:
                m = self._serve_one(conn, peer, out_path, landed, holder)
                with self._lock:
                    result.append(m)
                done.set()
            except _Probed:
                log.info("DS4K %s: answered a probe", peer)
            except DS4KError as e:
                if done.is_set():
                    return  # dropped because the wait is over, not for what it sent
                log.warning("DS4K %s: dropped: %s", peer, e.reason)
                with self._lock:
                    self.failures.append(DS4KError(f"rejected the transfer from {peer}: {e.reason}",
                                                   e.status, e.reason))
                    del self.failures[:-KEPT_FAILURES]
                    self.n_failures += 1
                    if max_failures is not None and self.n_failures >= max_failures:
                        done.set()
            finally:
                with self._lock:
                    active.pop(conn, None)
                with contextlib.suppress(OSError):
                    holder["sock"].close()

        threads: list[threading.Thread] = []
        try:
            while not done.is_set():
                if deadline.expired:
                    break
                self.sock.settimeout(max(ACCEPT_POLL_MIN, min(ACCEPT_POLL, deadline.left())))
                try:
                    conn, addr = self.sock.accept()
                except socket.timeout:
                    continue
                except OSError as e:  # out of file descriptors, an aborted connection: go on
                    log.warning("DS4K: accept failed: %s", e)
                    time.sleep(ACCEPT_POLL_MIN)
                    continue
                peer = format_hostport(*addr[:2])
                holder = {"sock": conn}
                with self._lock:
                    full = len(active) >= self.max_conns
                    if not full:
                        active[conn] = holder
                if full:
                    log.warning("DS4K %s: refused: %d connections are open", peer, self.max_conns)
                    conn.close()
                    continue
                t = threading.Thread(target=serve, args=(conn, peer, holder), daemon=True,
                                     name=f"ds4k-{peer}")
                threads[:] = [x for x in threads if x.is_alive()]  # (finished ones go: the list stays bounded)
                threads.append(t)
                t.start()
        finally:
            done.set()
            with self._lock:
                others = [h["sock"] for h in active.values()]
            for sock in others:  # the payload landed (or time is up): drop the rest
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            for t in threads:
                t.join(self.timeout + 1)
        if result:
            return result[0]
        if self.failures:
            last = self.failures[-1]
            if max_failures is not None and self.n_failures >= max_failures:
                raise last
            raise DS4KError(f"no payload landed within {accept_timeout:g} s; {self.n_failures} "
                            f"connection(s) failed, the last: {last.reason}", last.status, last.reason)
        raise DS4KError(f"no sender connected within {accept_timeout:g} s", INCOMPLETE)

    def _serve_one(self, conn: socket.socket, peer: str, out_path: Path, landed: threading.Event,
                   holder: dict) -> Manifest:
        """One connection, start to end; DS4KError (after telling the sender) on failure."""
        conn.settimeout(self.timeout)  # bounds the TLS handshake too
        try:
            try:
                if self.tls is not None:
                    conn = holder["sock"] = self._accept_tls(conn)
                return self._serve(conn, out_path, landed)
            except (OSError, ssl.SSLError) as e:  # the connection failed outside the payload
                raise DS4KError(f"connection error: {e}", INCOMPLETE) from None
        except DS4KError as e:
            if e.status == TLS_MISMATCH:  # the peer may still be sending: let it read why
                sniff.refuse(conn, _reply(e.status, e.reason))
            else:
                _send_reply(conn, e.status, e.reason)
            raise

    def _accept_tls(self, conn: socket.socket) -> ssl.SSLSocket:
        """The TLS socket of a sender; DS4KError (TLS_MISMATCH) when its first bytes are not a
        TLS record, i.e. it connected in plain text (its opener, step 0, names it). The error is
        not answered here: `_serve_one` answers it, as it answers every failure."""
        # (one deadline for the peek and the opener: a stranger that trickles its bytes holds
        # this slot for one io timeout, not one for each)
        deadline = Deadline(self.timeout, "the sender's first bytes and opener")

        def plain_sender() -> tuple[DS4KError, None]:
            opener = _recv_exact(conn, OPENER.size, "the sender's opener", deadline)
            what = "sender" if OPENER.unpack(opener)[0] == MAGIC else \
                f"peer (first bytes {opener.hex()}, neither TLS nor a DS4K opener)"
            return DS4KError(sniff.plain_client_reason(what, "receiver"), TLS_MISMATCH), None

        return sniff.accept_tls(self.tls, conn, deadline, plain_sender)

    def _serve(self, conn: socket.socket, out_path: Path, landed: threading.Event) -> Manifest:
        deadline = Deadline(self.timeout, "the DS4K hello")
        me = auth.ServerAuth(self.auth_token, PROTOCOL) if self.auth_token else None
        nonce = me.nonce if me else auth.new_nonce()
        conn.sendall(HELLO.pack(MAGIC, VERSION, FLAG_AUTH if me else 0, 0, nonce))
        opener = _recv_exact(conn, OPENER.size, "the sender's opener", deadline)
        if sniff.looks_like_tls(opener):  # (only a plain receiver can read a ClientHello here)
            raise DS4KError(sniff.tls_peer_reason("sender", "receiver"), TLS_MISMATCH)
        (word,) = OPENER.unpack(opener)
        if word != MAGIC:
            raise DS4KError(f"opener magic: expected {MAGIC:#010x}, got {word:#010x}")
        magic, version, flags, n = RECORD.unpack(
            _recv_exact(conn, RECORD.size, "the record header", deadline))
        if magic != MAGIC:
            raise DS4KError(f"record magic: expected {MAGIC:#010x}, got {magic:#010x}")
        if version != VERSION:
            raise DS4KError(f"record version: expected {VERSION}, got {version}")
        if flags & ~FLAG_AUTH:
            raise DS4KError(f"record flags: unknown bits {flags & ~FLAG_AUTH:#x}")
        if me is not None and not flags & FLAG_AUTH:
            raise DS4KError("authentication failed: no auth proof", AUTH_FAILED)
        if me is None and flags & FLAG_AUTH:
            raise DS4KError("authentication failed: this receiver has no auth token", AUTH_FAILED)
        client_nonce = _recv_exact(conn, NONCE_BYTES, "the client nonce", deadline) if me else None
        if n > MAX_MANIFEST_BYTES:
            raise DS4KError(f"manifest_bytes: {n} is over the {MAX_MANIFEST_BYTES}-byte limit")
        conn.sendall(REPLY.pack(OK, 0) + (me.proof(client_nonce) if me else b""))
        if me is not None:
            try:
                me.check_client(_recv_exact(conn, PROOF_BYTES, "the auth proof", deadline))
            except auth.AuthError as e:
                raise DS4KError(f"authentication failed: {e}", AUTH_FAILED) from None
        if n == PROBE_MANIFEST_BYTES:
            _send_reply(conn, OK)
            raise _Probed
        try:
            manifest = Manifest.decode(_recv_exact(conn, n, "the manifest", deadline))
        except ValueError as e:
            raise DS4KError(str(e)) from None
        self._check_manifest(manifest, out_path)
        if not self._landing.acquire(blocking=False):
            raise DS4KError("busy: another sender's payload is landing here", REFUSED)
        try:
            if landed.is_set():
                raise DS4KError("this receiver already has its payload", REFUSED)
            _send_reply(conn, OK)
            self._land(conn, manifest, out_path)
            landed.set()  # before the lock is released: no second payload replaces this one
        finally:
            self._landing.release()
        _send_reply(conn, OK)
        return manifest

    def _model_ref(self) -> ModelRef | None:
        """This receiver's model, for the payload's identity trailer (the file, not only the
        sender's manifest, must name it)."""
        return None if self.fingerprint is None else ModelRef(bytes.fromhex(self.fingerprint))

    def _check_manifest(self, m: Manifest, out_path: Path) -> None:
        if self.fingerprint is not None and m.fingerprint != self.fingerprint:
            digits = SHORT_HEX if m.fingerprint is None else distinct_digits(m.fingerprint, self.fingerprint)
            got = ("no model fingerprint" if m.fingerprint is None
                   else f"model {short_hex(m.fingerprint, digits)}")
            raise DS4KError(f"the payload is for a different model: the manifest names {got}, "
                            f"this receiver serves model {short_hex(self.fingerprint, digits)}", REFUSED)
        if m.payload_bytes > self.max_bytes:
            raise DS4KError(f"payload of {m.payload_bytes} bytes is over the receiver's limit of "
                            f"{self.max_bytes} bytes (--max-kv-bytes)", REFUSED)
        if m.payload_bytes < HEADER_BYTES:
            raise DS4KError(f"payload of {m.payload_bytes} bytes is smaller than a DSV4 header", REFUSED)
        free = shutil.disk_usage(out_path.parent).free
        if m.payload_bytes > free:
            raise DS4KError(f"not enough disk space at {out_path.parent}: {m.payload_bytes} bytes "
                            f"needed, {free} free", REFUSED)

    def _land(self, conn: socket.socket, m: Manifest, out_path: Path) -> None:
        """Stream the payload to a temporary file beside out_path and rename it into place
        only once the SHA-256, the header and the identity trailer check out."""
        try:
            with atomic_path(out_path) as tmp, open(tmp, "wb") as f:
                self._stream(conn, m, f)
                f.flush()
                try:
                    hdr = check_payload(tmp, self.config, m.payload_bytes, self._model_ref())
                except (PayloadError, OSError) as e:
                    raise DS4KError(f"not a valid payload for this model: {e}", CORRUPT) from None
                if (hdr.n_tokens, hdr.ctx, hdr.version) != (m.n_tokens, m.ctx, m.version):
                    raise DS4KError(f"the payload header (n_tokens {hdr.n_tokens}, ctx {hdr.ctx}, "
                                    f"version {hdr.version}) disagrees with the manifest", CORRUPT)
        except OSError as e:
            raise DS4KError(f"cannot write {out_path}: {e}", IO_ERROR) from None

    def _stream(self, conn: socket.socket, m: Manifest, f) -> None:
        """Exactly m.payload_bytes from the sender into f, within the payload's deadline, with
        the SHA-256 checked against the manifest."""
        h = hashlib.sha256()
        budget = self.timeout + m.payload_bytes / self.min_rate
        deadline = Deadline(budget, "the payload")
        left, buf = m.payload_bytes, memoryview(bytearray(CHUNK))
        while left:
            if deadline.expired:
                raise DS4KError(f"timed out: the payload did not arrive within {budget:g} s (the io "
                                f"timeout plus {self.min_rate:g} bytes/s): "
                                f"{m.payload_bytes - left} of {m.payload_bytes} payload "
                                "bytes received", INCOMPLETE)
            conn.settimeout(deadline.timeout(self.timeout))
            try:
                got = conn.recv_into(buf, min(left, CHUNK))
            except socket.timeout:
                if deadline.expired:
                    continue  # reported above
                raise DS4KError(f"timed out after {self.timeout:g} s with "
                                f"{m.payload_bytes - left} of {m.payload_bytes} payload "
                                "bytes received", INCOMPLETE) from None
            except OSError as e:
                raise DS4KError(f"connection lost after {m.payload_bytes - left} of "
                                f"{m.payload_bytes} payload bytes: {e}", INCOMPLETE) from None
            if not got:
                raise DS4KError(f"the sender closed the connection after "
                                f"{m.payload_bytes - left} of {m.payload_bytes} payload "
                                "bytes", INCOMPLETE)
            h.update(buf[:got])
            f.write(buf[:got])
            left -= got
        digest = h.hexdigest()
        if digest != m.sha256:
            digits = distinct_digits(digest, m.sha256)
            raise DS4KError(f"SHA-256 mismatch: the payload was corrupted in transit (received "
                            f"{short_hex(digest, digits)}, manifest {short_hex(m.sha256, digits)})", CORRUPT)


def receive_payload(port: int, out_path: str | os.PathLike, *, host: str = "127.0.0.1",
                    fingerprint=None, config: ModelConfig | None = None,
                    max_bytes: int = DEFAULT_MAX_BYTES, auth_token: str | None = None,
                    timeout: float = DEFAULT_TIMEOUT, accept_timeout: float | None = None,
                    tls: ssl.SSLContext | None = None) -> Manifest:
    """Listen on host:port until a sender's payload has landed at out_path."""
    with Receiver(port, host=host, fingerprint=fingerprint, config=config, max_bytes=max_bytes,
                  auth_token=auth_token, timeout=timeout, tls=tls) as r:
        return r.receive(out_path, accept_timeout)
