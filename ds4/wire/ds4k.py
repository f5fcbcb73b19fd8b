"""DS4K: hand a DSV4 session payload to another node over TCP (wire.md §3).

    # decode node                                   # prefill node
    receive_payload(7411, "snap.dsv4",              send_payload("snap.dsv4", "10.0.0.2", 7411,
                    fingerprint=model.fingerprint)               fingerprint=model.fingerprint)

The payload travels byte for byte; the receiver checks the manifest before a payload byte moves,
streams to a temporary file beside the destination, verifies the SHA-256 (and the payload's
header, and with a model its exact size), fsyncs and renames. On any failure nothing is left at
the destination and the sender gets the reason.

Connection, sender = client, receiver = server; integers little-endian (inside TLS when the
receiver has `--tls-cert`, `ds4.wire.tls`):

1. server → client, hello (48 bytes):
   `u32 magic 0x4b345344 ("DS4K"), u32 version 2, u32 flags (bit0: the token must be proven),
   u32 0, 32-byte server nonce` (fresh random bytes per connection).
   A sender that has a token refuses a receiver whose flags do not ask for it, sending nothing.
2. client → server, record header (16 bytes):
   `u32 magic, u32 version 2, u32 flags (bit0: auth), u32 manifest_bytes` (≤ 64 KiB);
   if flags bit0: the 32-byte client nonce.
3. server → client, verdict on the header: `u32 status, u32 reason_bytes` + reason (UTF-8,
   ≤ 4 KiB); if status 0 and flags bit0: the 32-byte server proof (`ds4.wire.auth`, protocol
   b"DS4K"). Anything but status 0: the server closes the connection.
4. client → server: if flags bit0, the 32-byte client proof, sent only once the server proof
   checked out; then the manifest: `manifest_bytes` of UTF-8 JSON, one flat object with
   `fingerprint` (hex SHA-256 of the model, wire.md common rules, or null), `payload_bytes`,
   `sha256` (hex, of the payload), `n_tokens`, `ctx`, `version` (the payload's header fields)
   and `created` (unix seconds); nesting deeper than `MAX_MANIFEST_DEPTH` is refused unparsed.
5. server → client, manifest verdict, same record as 3 (no proof). Status 0: send the payload.
6. client → server: exactly `payload_bytes` bytes of payload, in chunks of any size.
7. server → client, final reply, same record as 5: status 0 once the file is in place.

Version 2 differs from version 1 (wire.md §3) in steps 2–4: both ends prove the token, the
receiver first, so a listener that does not know it learns nothing of the session. A refused
manifest (model, size, auth) is answered before the payload is streamed.

A probe is a record with `manifest_bytes` 0: steps 1–5 as above (the hello checked, the token
proven both ways), then the receiver answers step 5 with status 0 and closes; it is not a
failure and the receiver goes on waiting. A sender that has the payload still to make
(`ds4 prefill --send-kv`) probes first (`probe_receiver`), so that a dead host, a listener that
is not a DS4K receiver or a token mismatch fails before the work, not after it.

Deadlines: steps 1–5 must finish within the io timeout, and the payload within the io timeout
plus `payload_bytes / min_rate`, however the bytes trickle in. A receiver serves several
connections at once (up to `max_conns`); a bad, refused or slow one is logged and dropped while
the receiver keeps waiting for a payload until its own deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import ssl
import struct
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.config import ModelConfig
from ..core.atomic import atomic_path
from ..core.payload import HEADER_BYTES, ModelRef, PayloadError, check_payload
from . import auth
from .deadline import Deadline

log = logging.getLogger("ds4.wire.ds4k")

MAGIC = 0x4B345344  # b"DS4K"
VERSION = 2
PROTOCOL = b"DS4K"  # the auth proofs' protocol name
FLAG_AUTH = 1
HELLO = struct.Struct("<4I32s")
RECORD = struct.Struct("<4I")
REPLY = struct.Struct("<2I")
PROOF_BYTES = auth.PROOF_BYTES
NONCE_BYTES = auth.NONCE_BYTES
MAX_MANIFEST_BYTES = 64 << 10
MAX_MANIFEST_DEPTH = 2  # the manifest is one flat object; a little room for a later field
MAX_REASON_BYTES = 4 << 10
DEFAULT_MAX_BYTES = 16 << 30  # a real-model session of ~1.2M tokens; --max-kv-bytes raises it
DEFAULT_TIMEOUT = 120.0
PROBE_CONNECT_TIMEOUT = 10.0  # how long a probe retries a refused connection (a starting receiver)
CHUNK = 1 << 20
# The payload's deadline grows with its size at this floor rate: a sender slower than this
# (after the first io timeout) is dropped. Loopback and LAN transfers run at hundreds of MB/s.
DEFAULT_MIN_RATE = 1 << 20
DEFAULT_MAX_CONNS = 16
ACCEPT_POLL = 0.2  # how often the accept loop looks at its deadline and at "done"
ACCEPT_POLL_MIN = 0.01

# reply status codes
OK = 0
BAD_RECORD = 1
AUTH_FAILED = 2
REFUSED = 3  # the manifest: another model, over the limit, no room
INCOMPLETE = 4  # the payload stopped short or stalled
CORRUPT = 5  # SHA-256 or payload header mismatch
IO_ERROR = 6  # the receiver could not write the file

STATUS_NAMES = {OK: "ok", BAD_RECORD: "bad record", AUTH_FAILED: "authentication failed",
                REFUSED: "refused", INCOMPLETE: "incomplete", CORRUPT: "corrupt", IO_ERROR: "I/O error"}


PROBE_MANIFEST_BYTES = 0  # a record announcing no manifest is a probe (a real one is never empty)


class _Probed(Exception):
    """The peer ran steps 1–5 with no manifest (`probe_receiver`) and was answered: not a failure."""


class DS4KError(RuntimeError):
    """A failed handoff; `status` is the reply code, `reason` the receiver's text."""

    def __init__(self, message: str, status: int = BAD_RECORD, reason: str = ""):
        super().__init__(message)
        self.status = status
        self.reason = reason or message


@dataclass(frozen=True)
class Manifest:
    fingerprint: str | None
    payload_bytes: int
    sha256: str
    n_tokens: int
    ctx: int
    version: int
    created: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> "Manifest":
        """Parse and check a manifest; ValueError names the field (never RecursionError)."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest_bytes: {len(data)} is over the {MAX_MANIFEST_BYTES}-byte limit")
        try:
            text = bytes(data).decode("utf-8")
            depth = _json_depth(text)
            if depth > MAX_MANIFEST_DEPTH:
                raise ValueError(f"manifest: nested {depth} deep, expected a flat JSON object "
                                 f"(at most {MAX_MANIFEST_DEPTH} levels)")
            obj = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"manifest is not UTF-8 JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError("manifest is not a JSON object")
        for key in ("payload_bytes", "n_tokens", "ctx", "version", "created"):
            v = obj.get(key)
            if type(v) is not int or v < 0:
                raise ValueError(f"manifest.{key}: expected a non-negative integer, got {v!r}")
        fp = obj.get("fingerprint")
        if fp is not None and not _is_hex(fp, 64):
            raise ValueError(f"manifest.fingerprint: expected 64 hex digits or null, got {fp!r}")
        if not _is_hex(obj.get("sha256"), 64):
            raise ValueError(f"manifest.sha256: expected 64 hex digits, got {obj.get('sha256')!r}")
        return cls(fp if fp is None else fp.lower(), obj["payload_bytes"], obj["sha256"].lower(),
                   obj["n_tokens"], obj["ctx"], obj["version"], obj["created"])


def _json_depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings (so json.loads never recurses deeply)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _is_hex(v, n: int) -> bool:
    return isinstance(v, str) and len(v) == n and all(c in "0123456789abcdefABCDEF" for c in v)


def _fingerprint_hex(fp) -> str | None:
    if fp is None:
        return None
    return fp.hex() if isinstance(fp, (bytes, bytearray)) else str(fp).lower()


def _recv_exact(sock: socket.socket, n: int, what: str, deadline: Deadline | None = None,
                timeout: float | None = None) -> bytes:
    """n bytes; each read waits at most `timeout` (default: the socket's), all of them end by
    `deadline`. The buffer grows as bytes arrive."""
    per_read = sock.gettimeout() if timeout is None else timeout
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            if deadline.expired:
                raise DS4KError(f"{deadline.what} did not complete within {deadline.seconds:g} s "
                                f"({len(buf)} of {n} bytes of {what} came)", INCOMPLETE)
            sock.settimeout(deadline.timeout(per_read))
        try:
            b = sock.recv(min(n - len(buf), CHUNK))
        except socket.timeout:
            if deadline is not None and deadline.expired:
                continue  # reported above with the deadline's words
            raise DS4KError(f"timed out waiting for {what}", INCOMPLETE) from None
        finally:
            if deadline is not None:
                sock.settimeout(per_read)
        if not b:
            raise DS4KError(f"connection closed after {len(buf)} of {n} bytes of {what}", INCOMPLETE)
        buf += b
    return bytes(buf)


def _send_reply(sock: socket.socket, status: int, reason: str = "") -> None:
    r = reason.encode("utf-8")[:MAX_REASON_BYTES]
    with contextlib.suppress(OSError):  # the peer may be gone; the receiver reports either way
        sock.sendall(REPLY.pack(status, len(r)) + r)


def _read_reply(sock: socket.socket, what: str, deadline: Deadline | None = None) -> tuple[int, str]:
    status, n = REPLY.unpack(_recv_exact(sock, REPLY.size, what, deadline))
    if n > MAX_REASON_BYTES:
        raise DS4KError(f"{what}: reason of {n} bytes is over the {MAX_REASON_BYTES}-byte limit")
    return status, _recv_exact(sock, n, what, deadline).decode("utf-8", "replace")


def parse_hostport(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """"host:port", "[v6]:port" or ":port" -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or default_host, int(port)


# ---- sender -------------------------------------------------------------------------------------

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
                raise DS4KError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
            time.sleep(0.05)
        except OSError as e:
            raise DS4KError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock, server_hostname=host)
    except (OSError, ssl.SSLError) as e:
        sock.close()
        raise DS4KError(f"TLS with {host}:{port} failed: {e}") from None


def _handshake(host: str, port: int, manifest: bytes, *, auth_token: str | None,
               timeout: float, connect_timeout: float,
               tls: ssl.SSLContext | None) -> socket.socket:
    """Steps 1–5 for `open_transfer` and `probe_receiver`: connect, check the receiver's hello,
    prove the token both ways (the receiver first), send `manifest` (empty: a probe) and read
    the receiver's verdict on it. Returns the socket once the verdict is status 0; raises
    DS4KError with the reason otherwise. The whole exchange must finish within `timeout`."""
    where = f"{host}:{port}"
    sock = _connect(host, port, timeout, connect_timeout, tls)
    deadline = Deadline(timeout, f"the DS4K hello with {where}")
    try:
        magic, version, flags, _, server_nonce = HELLO.unpack(
            _recv_exact(sock, HELLO.size, "the receiver's hello", deadline))
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


def probe_receiver(host: str, port: int, *, auth_token: str | None = None,
                   timeout: float = DEFAULT_TIMEOUT, connect_timeout: float | None = None,
                   tls: ssl.SSLContext | None = None) -> None:
    """Steps 1–5 with no manifest, then close: raises DS4KError when nothing listens there
    (after retrying a refused connection for `connect_timeout`, default PROBE_CONNECT_TIMEOUT),
    it is not a DS4K receiver, or the two ends do not share the token. The receiver counts a
    probe as no failure and goes on waiting."""
    wait = PROBE_CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
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


# ---- receiver -----------------------------------------------------------------------------------

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
                 tls: ssl.SSLContext | None = None):
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
        self.failures: list[DS4KError] = []  # every dropped connection of the last receive()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(max(4, max_conns))
        except BaseException:
            self.sock.close()
            raise
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

        Failed connections are told why, logged, kept in `self.failures` and dropped; the wait
        goes on until `accept_timeout` seconds have passed (None: no limit) or `max_failures`
        connections failed, then DS4KError says what went wrong (the last failure's status and
        reason). Nothing is left at out_path unless a payload landed whole."""
        out_path = Path(out_path)
        if not out_path.parent.is_dir():
            raise DS4KError(f"destination directory does not exist: {out_path.parent}", IO_ERROR)
        deadline = Deadline(accept_timeout, "receiving a payload")
        self.failures = []
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
                    if max_failures is not None and len(self.failures) >= max_failures:
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
                peer = f"{addr[0]}:{addr[1]}"
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
            if max_failures is not None and len(self.failures) >= max_failures:
                raise last
            raise DS4KError(f"no payload landed within {accept_timeout:g} s; {len(self.failures)} "
                            f"connection(s) failed, the last: {last.reason}", last.status, last.reason)
        raise DS4KError(f"no sender connected within {accept_timeout:g} s", INCOMPLETE)

    def _serve_one(self, conn: socket.socket, peer: str, out_path: Path, landed: threading.Event,
                   holder: dict) -> Manifest:
        """One connection, start to end; DS4KError (after telling the sender) on failure."""
        conn.settimeout(self.timeout)  # bounds the TLS handshake too
        try:
            try:
                if self.tls is not None:
                    conn = holder["sock"] = self.tls.wrap_socket(conn, server_side=True)
                return self._serve(conn, out_path, landed)
            except (OSError, ssl.SSLError) as e:  # the connection failed outside the payload
                raise DS4KError(f"connection error: {e}", INCOMPLETE) from None
        except DS4KError as e:
            _send_reply(conn, e.status, e.reason)
            raise

    def _serve(self, conn: socket.socket, out_path: Path, landed: threading.Event) -> Manifest:
        deadline = Deadline(self.timeout, "the DS4K hello")
        me = auth.ServerAuth(self.auth_token, PROTOCOL) if self.auth_token else None
        nonce = me.nonce if me else auth.new_nonce()
        conn.sendall(HELLO.pack(MAGIC, VERSION, FLAG_AUTH if me else 0, 0, nonce))
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
            got = "no model fingerprint" if m.fingerprint is None else f"model {m.fingerprint[:16]}…"
            raise DS4KError(f"the payload is for a different model: the manifest names {got}, "
                            f"this receiver serves model {self.fingerprint[:16]}…", REFUSED)
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
            raise DS4KError(f"SHA-256 mismatch: the payload was corrupted in transit "
                            f"(received {digest[:16]}…, manifest {m.sha256[:16]}…)", CORRUPT)


def receive_payload(port: int, out_path: str | os.PathLike, *, host: str = "127.0.0.1",
                    fingerprint=None, config: ModelConfig | None = None,
                    max_bytes: int = DEFAULT_MAX_BYTES, auth_token: str | None = None,
                    timeout: float = DEFAULT_TIMEOUT, accept_timeout: float | None = None,
                    tls: ssl.SSLContext | None = None) -> Manifest:
    """Listen on host:port until a sender's payload has landed at out_path."""
    with Receiver(port, host=host, fingerprint=fingerprint, config=config, max_bytes=max_bytes,
                  auth_token=auth_token, timeout=timeout, tls=tls) as r:
        return r.receive(out_path, accept_timeout)
