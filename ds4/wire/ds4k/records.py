"""DS4K's records, shared by sender and receiver: the constants and reply status codes, the
`DS4KError` a failed handoff raises, the `Manifest` (JSON, checked and depth-bounded before it
is parsed), and the record-level I/O both ends use: `_recv_exact` under a deadline,
`_send_reply` / `_read_reply` for the status records. (Addresses: `ds4.wire.address`.)
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from dataclasses import asdict, dataclass

from .. import auth, refusal
from ..deadline import Deadline

MAGIC = 0x4B345344  # b"DS4K"
VERSION = 3
PROTOCOL = b"DS4K"  # the auth proofs' protocol name
FLAG_AUTH = 1
OPENER = struct.Struct("<I")  # step 0: the sender's magic, its first bytes on every connection
HELLO = struct.Struct("<4I32s")
RECORD = struct.Struct("<4I")
REPLY = struct.Struct("<2I")  # status, reason_bytes: the refusal record's layout (ds4.wire.refusal)
PROOF_BYTES = auth.PROOF_BYTES
NONCE_BYTES = auth.NONCE_BYTES
MAX_MANIFEST_BYTES = 64 << 10
MAX_MANIFEST_DEPTH = 2  # the manifest is one flat object; a little room for a later field
MAX_REASON_BYTES = refusal.MAX_REASON_BYTES
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
TLS_MISMATCH = 7  # one end speaks TLS, the other plain text

STATUS_NAMES = {OK: "ok", BAD_RECORD: "bad record", AUTH_FAILED: "authentication failed",
                REFUSED: "refused", INCOMPLETE: "incomplete", CORRUPT: "corrupt", IO_ERROR: "I/O error",
                TLS_MISMATCH: "TLS mismatch"}


PROBE_MANIFEST_BYTES = 0  # a record announcing no manifest is a probe (a real one is never empty)


class _Probed(Exception):
    """The peer ran steps 0–5 with no manifest (`probe_receiver`) and was answered: not a failure."""


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
        except ValueError as e:  # json's own limits, e.g. an integer of over 4300 digits
            raise ValueError(f"manifest: a value JSON cannot read ({e})") from None
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


def _reply(status: int, reason: str = "") -> bytes:
    """A status record: the refusal record with the status in the magic's place, so its reason is
    cut to MAX_REASON_BYTES at a character boundary (the peer reads valid UTF-8)."""
    return refusal.pack(status, reason)


def _send_reply(sock: socket.socket, status: int, reason: str = "") -> None:
    with contextlib.suppress(OSError):  # the peer may be gone; the receiver reports either way
        sock.sendall(_reply(status, reason))


def _read_reply(sock: socket.socket, what: str, deadline: Deadline | None = None) -> tuple[int, str]:
    status, n = REPLY.unpack(_recv_exact(sock, REPLY.size, what, deadline))
    return status, _read_reason(sock, n, what, deadline)


def _read_reason(sock: socket.socket, n: int, what: str, deadline: Deadline | None = None) -> str:
    """The reason text of a reply whose header announced `n` bytes (checked before the read)."""
    if n > MAX_REASON_BYTES:
        raise DS4KError(f"{what}: reason of {n} bytes is over the {MAX_REASON_BYTES}-byte limit")
    return _recv_exact(sock, n, what, deadline).decode("utf-8", "replace")

