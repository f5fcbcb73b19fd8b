"""DS4K: hand a DSV4 session payload to another node over TCP (wire.md §3).

    # decode node                                   # prefill node
    receive_payload(7411, "snap.dsv4",              send_payload("snap.dsv4", "10.0.0.2", 7411,
                    fingerprint=model.fingerprint)               fingerprint=model.fingerprint)

The payload travels byte for byte; the receiver checks the manifest before a payload byte moves,
streams to a temporary file beside the destination, verifies the SHA-256 (and the payload's
header, and with a model its exact size), fsyncs and renames. On any failure nothing is left at
the destination and the sender gets the reason.

Connection, sender = client, receiver = server; integers little-endian:

1. server → client, hello (48 bytes):
   `u32 magic 0x4b345344 ("DS4K"), u32 version 1, u32 flags (bit0: an auth proof is required),
   u32 0, 32-byte nonce` (fresh random bytes per connection).
2. client → server, record header (16 bytes):
   `u32 magic, u32 version 1, u32 flags (bit0: a proof follows), u32 manifest_bytes`;
   if flags bit0: the 32-byte proof `HMAC-SHA256(key = token as UTF-8, msg = b"DS4K" + nonce)`;
   then the manifest: `manifest_bytes` (≤ 64 KiB) of UTF-8 JSON, an object with
   `fingerprint` (hex SHA-256 of the model, wire.md common rules, or null), `payload_bytes`,
   `sha256` (hex, of the payload), `n_tokens`, `ctx`, `version` (the payload's header fields)
   and `created` (unix seconds).
3. server → client, manifest verdict: `u32 status, u32 reason_bytes` + reason (UTF-8, ≤ 4 KiB).
   Status 0: send the payload. Anything else: the server closes the connection.
4. client → server: exactly `payload_bytes` bytes of payload, in chunks of any size.
5. server → client, final reply, same record as 3: status 0 once the file is in place.

Step 3 refines wire.md's single reply: a refused manifest (model, size, auth) is answered
before the payload is streamed. Every blocking read has a timeout; a dead peer is an error.

A sender that has the payload still to make (`ds4 prefill --send-kv`) first probes the receiver
(`probe_receiver`: connect, read and check the hello, close) so that a dead or wrong peer fails
before the work, not after it; the receiver takes a connection that closes without sending a
byte for such a probe and waits for the next one.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.config import ModelConfig
from ..core.payload import HEADER_BYTES, ModelRef, PayloadError, check_payload, fsync_dir

MAGIC = 0x4B345344  # b"DS4K"
VERSION = 1
FLAG_AUTH = 1
HELLO = struct.Struct("<4I32s")
RECORD = struct.Struct("<4I")
REPLY = struct.Struct("<2I")
PROOF_BYTES = 32
MAX_MANIFEST_BYTES = 64 << 10
MAX_REASON_BYTES = 4 << 10
DEFAULT_MAX_BYTES = 16 << 30  # a real-model session of ~1.2M tokens; --max-kv-bytes raises it
DEFAULT_TIMEOUT = 120.0
PROBE_CONNECT_TIMEOUT = 10.0  # how long a probe retries a refused connection (a starting receiver)
CHUNK = 1 << 20

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


class _Probed(Exception):
    """The peer read the hello and closed without a record: `probe_receiver`."""


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
        try:
            obj = json.loads(data.decode("utf-8"))
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


def _is_hex(v, n: int) -> bool:
    return isinstance(v, str) and len(v) == n and all(c in "0123456789abcdefABCDEF" for c in v)


def _fingerprint_hex(fp) -> str | None:
    if fp is None:
        return None
    return fp.hex() if isinstance(fp, (bytes, bytearray)) else str(fp).lower()


def _proof(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode("utf-8"), b"DS4K" + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            b = sock.recv(min(n - len(buf), CHUNK))
        except socket.timeout:
            raise DS4KError(f"timed out waiting for {what}", INCOMPLETE) from None
        if not b:
            raise DS4KError(f"connection closed after {len(buf)} of {n} bytes of {what}", INCOMPLETE)
        buf += b
    return bytes(buf)


def _send_reply(sock: socket.socket, status: int, reason: str = "") -> None:
    r = reason.encode("utf-8")[:MAX_REASON_BYTES]
    with contextlib.suppress(OSError):  # the peer may be gone; the receiver reports either way
        sock.sendall(REPLY.pack(status, len(r)) + r)


def _read_reply(sock: socket.socket, what: str) -> tuple[int, str]:
    status, n = REPLY.unpack(_recv_exact(sock, REPLY.size, what))
    if n > MAX_REASON_BYTES:
        raise DS4KError(f"{what}: reason of {n} bytes is over the {MAX_REASON_BYTES}-byte limit")
    return status, _recv_exact(sock, n, what).decode("utf-8", "replace")


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


def _connect(host: str, port: int, timeout: float, connect_timeout: float) -> socket.socket:
    """Connect, retrying a refused connection until connect_timeout (the receiver may start
    listening a little after the sender starts)."""
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=timeout)
        except (ConnectionRefusedError, ConnectionResetError) as e:
            if time.monotonic() >= deadline:
                raise DS4KError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
            time.sleep(0.05)
        except OSError as e:
            raise DS4KError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None


def _check_hello(sock: socket.socket, host: str, port: int, auth_token: str | None) -> bytes:
    """Read the receiver's hello; returns its nonce. (open_transfer checks it the same way;
    kept apart while the hello's auth changes land.)"""
    magic, version, flags, _, nonce = HELLO.unpack(_recv_exact(sock, HELLO.size, "the receiver's hello"))
    if magic != MAGIC or version != VERSION:
        raise DS4KError(f"{host}:{port} is not a DS4K v{VERSION} receiver "
                        f"(magic {magic:#010x}, version {version})")
    if flags & FLAG_AUTH and not auth_token:
        raise DS4KError(f"{host}:{port} requires an auth token (--auth-token / DS4_WIRE_TOKEN)",
                        AUTH_FAILED)
    return nonce


def probe_receiver(host: str, port: int, *, auth_token: str | None = None,
                   timeout: float = DEFAULT_TIMEOUT,
                   connect_timeout: float | None = None) -> None:
    """Connect, check the receiver's hello and close without a record: raises DS4KError when
    nothing listens there, it is not a DS4K receiver, or it wants a token we do not have."""
    wait = PROBE_CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
    with _connect(host, port, timeout, wait) as sock:
        _check_hello(sock, host, port, auth_token)


def open_transfer(host: str, port: int, manifest: Manifest, *, auth_token: str | None = None,
                  timeout: float = DEFAULT_TIMEOUT, connect_timeout: float | None = None) -> socket.socket:
    """Steps 1–3: connect, prove the token, send the manifest; returns the socket once the
    receiver accepts it (raises DS4KError with its reason otherwise)."""
    sock = _connect(host, port, timeout, timeout if connect_timeout is None else connect_timeout)
    try:
        magic, version, flags, _, nonce = HELLO.unpack(_recv_exact(sock, HELLO.size, "the receiver's hello"))
        if magic != MAGIC or version != VERSION:
            raise DS4KError(f"{host}:{port} is not a DS4K v{VERSION} receiver "
                            f"(magic {magic:#010x}, version {version})")
        if flags & FLAG_AUTH and not auth_token:
            raise DS4KError(f"{host}:{port} requires an auth token (--auth-token / DS4_WIRE_TOKEN)",
                            AUTH_FAILED)
        m = manifest.encode()
        out = RECORD.pack(MAGIC, VERSION, FLAG_AUTH if auth_token else 0, len(m))
        if auth_token:
            out += _proof(auth_token, nonce)
        sock.sendall(out + m)
        status, reason = _read_reply(sock, "the receiver's verdict on the manifest")
        if status != OK:
            raise DS4KError(f"receiver refused the payload ({STATUS_NAMES.get(status, status)}): "
                            f"{reason}", status, reason)
        return sock
    except BaseException:
        sock.close()
        raise


def send_payload(src, host: str, port: int, *, fingerprint=None, auth_token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, connect_timeout: float | None = None) -> Manifest:
    """Send a payload (a path or bytes) to a DS4K receiver; returns the manifest sent. Raises
    DS4KError with the receiver's reason when it refuses or fails the transfer."""
    manifest = make_manifest(src, fingerprint)
    with open_transfer(host, port, manifest, auth_token=auth_token, timeout=timeout,
                       connect_timeout=connect_timeout) as sock:
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
        status, reason = _read_reply(sock, "the receiver's reply")
        if status != OK:
            raise DS4KError(f"receiver failed the transfer ({STATUS_NAMES.get(status, status)}): "
                            f"{reason}", status, reason)
    return manifest


# ---- receiver -----------------------------------------------------------------------------------

class Receiver:
    """A listening DS4K endpoint (bound on construction, so port 0 picks a free port)."""

    def __init__(self, port: int, *, host: str = "127.0.0.1", fingerprint=None,
                 config: ModelConfig | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 auth_token: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.fingerprint = _fingerprint_hex(fingerprint)
        self.config = config
        self.max_bytes = max_bytes
        self.auth_token = auth_token or None
        self.timeout = timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(4)
        except BaseException:
            self.sock.close()
            raise
        self.host, self.port = self.sock.getsockname()[:2]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def receive(self, out_path: str | os.PathLike, accept_timeout: float | None = None) -> Manifest:
        """Accept one sender and land its payload at out_path; raises DS4KError (after telling
        the sender) when the transfer is refused or fails, leaving nothing at out_path."""
        out_path = Path(out_path)
        if not out_path.parent.is_dir():
            raise DS4KError(f"destination directory does not exist: {out_path.parent}", IO_ERROR)
        deadline = None if accept_timeout is None else time.monotonic() + accept_timeout
        while True:  # until a sender sends a record (probes only read the hello)
            self.sock.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
            try:
                conn, peer = self.sock.accept()
            except socket.timeout:
                raise DS4KError(f"no sender connected within {accept_timeout:g} s", INCOMPLETE) from None
            with conn:
                conn.settimeout(self.timeout)
                try:
                    try:
                        return self._serve(conn, out_path)
                    except _Probed:
                        continue
                    except OSError as e:  # the connection failed outside the payload stream
                        raise DS4KError(f"connection error: {e}", INCOMPLETE) from None
                except DS4KError as e:
                    _send_reply(conn, e.status, e.reason)
                    raise DS4KError(f"rejected the transfer from {peer[0]}:{peer[1]}: {e.reason}",
                                    e.status, e.reason) from None

    def _serve(self, conn: socket.socket, out_path: Path) -> Manifest:
        nonce = secrets.token_bytes(32)
        conn.sendall(HELLO.pack(MAGIC, VERSION, FLAG_AUTH if self.auth_token else 0, 0, nonce))
        try:
            first = conn.recv(RECORD.size)
        except socket.timeout:
            raise DS4KError("timed out waiting for the record header", INCOMPLETE) from None
        if not first:
            raise _Probed
        head = first + _recv_exact(conn, RECORD.size - len(first), "the record header")
        magic, version, flags, n = RECORD.unpack(head)
        if magic != MAGIC:
            raise DS4KError(f"record magic: expected {MAGIC:#010x}, got {magic:#010x}")
        if version != VERSION:
            raise DS4KError(f"record version: expected {VERSION}, got {version}")
        proof = _recv_exact(conn, PROOF_BYTES, "the auth proof") if flags & FLAG_AUTH else None
        if self.auth_token and (proof is None or
                                not hmac.compare_digest(proof, _proof(self.auth_token, nonce))):
            raise DS4KError("authentication failed: " + ("no auth proof" if proof is None
                                                         else "wrong auth token"), AUTH_FAILED)
        if n > MAX_MANIFEST_BYTES:
            raise DS4KError(f"manifest_bytes: {n} is over the {MAX_MANIFEST_BYTES}-byte limit")
        try:
            manifest = Manifest.decode(_recv_exact(conn, n, "the manifest"))
        except ValueError as e:
            raise DS4KError(str(e)) from None
        self._check_manifest(manifest, out_path)
        _send_reply(conn, OK)
        self._land(conn, manifest, out_path)
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
        fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".part", dir=out_path.parent)
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as f:
                left, buf = m.payload_bytes, memoryview(bytearray(CHUNK))
                while left:
                    try:
                        got = conn.recv_into(buf, min(left, CHUNK))
                    except socket.timeout:
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
                f.flush()
                try:
                    hdr = check_payload(tmp, self.config, m.payload_bytes, self._model_ref())
                except (PayloadError, OSError) as e:
                    raise DS4KError(f"not a valid payload for this model: {e}", CORRUPT) from None
                if (hdr.n_tokens, hdr.ctx, hdr.version) != (m.n_tokens, m.ctx, m.version):
                    raise DS4KError(f"the payload header (n_tokens {hdr.n_tokens}, ctx {hdr.ctx}, "
                                    f"version {hdr.version}) disagrees with the manifest", CORRUPT)
                os.fsync(f.fileno())
            os.replace(tmp, out_path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise DS4KError(f"cannot write {out_path}: {e}", IO_ERROR) from None
            raise
        fsync_dir(out_path.parent)


def receive_payload(port: int, out_path: str | os.PathLike, *, host: str = "127.0.0.1",
                    fingerprint=None, config: ModelConfig | None = None,
                    max_bytes: int = DEFAULT_MAX_BYTES, auth_token: str | None = None,
                    timeout: float = DEFAULT_TIMEOUT, accept_timeout: float | None = None) -> Manifest:
    """Listen on host:port, accept one sender and land its payload at out_path."""
    with Receiver(port, host=host, fingerprint=fingerprint, config=config, max_bytes=max_bytes,
                  auth_token=auth_token, timeout=timeout) as r:
        return r.receive(out_path, accept_timeout)
