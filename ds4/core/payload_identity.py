"""The identity trailer of a DSV4 payload file: which model it belongs to, and a checksum.

After ds4's v1/v2 body (spec ds4-model.md §4.1/§4.2, and its MTP tail, if any) a payload file
written by ds4 (`identity=True`, the default) ends with:

    offset from the trailer's start   size  field
    0                                 n     model name: UTF-8 file name of the GGUF (n ≤ 255)
    n                                 32    model fingerprint (SHA-256, wire.md common rules)
    n + 32                            32    SHA-256 of the body: every byte before the trailer
    n + 64                            8     u64 body_bytes (the trailer starts there)
    n + 72                            4     u32 name_bytes = n
    n + 76                            4     u32 trailer version = 1
    n + 80                            4     u32 trailer_bytes = n + 88
    n + 84                            4     u32 magic 0x49345344 (b"DS4I")

It is found from the end of the file (the last 4 bytes are the magic and body_bytes +
trailer_bytes is the file size), so the header and the body are unchanged: a reader that takes
the payload's size from its header (ds4's `ds4_session_payload_bytes`, a KVC entry's
payload_bytes, or `nbytes=body_bytes` in payload.py) reads the body as before. Loading refuses a
trailer that names another model (naming both) or whose SHA-256 does not match the body; a bare
payload loads as before. The name is informational (messages only) and not checksummed.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from dataclasses import dataclass
from pathlib import Path

E_MODEL = "KV checkpoint was saved from another model"
E_CHECKSUM = "KV checkpoint is corrupt"
E_IDENTITY = "KV checkpoint has a malformed identity trailer"


# The identity trailer (ours, after the v1/v2 body): see the module docstring.
IDENTITY_MAGIC = 0x49345344  # b"DS4I"
IDENTITY_VERSION = 1
# fingerprint, body SHA-256, u64 body_bytes, u32 name_bytes, u32 version, u32 trailer_bytes, magic
IDENTITY_FOOTER = struct.Struct("<32s32sQIIII")
IDENTITY_FOOTER_BYTES = IDENTITY_FOOTER.size  # 88
MAX_MODEL_NAME_BYTES = 255
DIGEST_BYTES = 32  # SHA-256


SHORT_HEX = 16  # hex digits of a hash that a message shows


def _hex(value: bytes | str) -> str:
    return value if isinstance(value, str) else value.hex()


def short_hex(value: bytes | str, digits: int | None = None) -> str:
    """The first `digits` (default SHORT_HEX) hex digits of `value` (bytes, or already in hex),
    and "…" if there are more."""
    h = _hex(value)
    digits = SHORT_HEX if digits is None else digits
    return h if digits >= len(h) else f"{h[:digits]}…"


def distinct_digits(a: bytes | str, b: bytes | str) -> int:
    """How many hex digits a message comparing `a` and `b` shows of each: SHORT_HEX; where those
    are the same in both, up to the first digit that differs and 3 more (short_hex shows all 64
    where fewer are left), so that two different values never read the same."""
    first = next((i for i, (x, y) in enumerate(zip(_hex(a), _hex(b))) if x != y), 0)
    return SHORT_HEX if first < SHORT_HEX else first + 4


class PayloadError(ValueError):
    """A payload that cannot be read into this session; the message starts with ds4's text
    (payload.py re-exports it)."""


def _fail(message: str, detail: str = "") -> "PayloadError":
    return PayloadError(f"{message}: {detail}" if detail else message)


@dataclass(frozen=True)
class ModelRef:
    """Which model a payload belongs to: its fingerprint (wire.md) and file name (for messages)."""

    fingerprint: bytes
    name: str = ""

    @classmethod
    def of(cls, model) -> "ModelRef | None":
        """The ref of a GGUFModel (None for an object without a fingerprint)."""
        fp = getattr(model, "fingerprint", None)
        if not isinstance(fp, (bytes, bytearray)) or len(fp) != DIGEST_BYTES:
            return None
        path = getattr(model, "path", None)
        return cls(bytes(fp), Path(path).name if path is not None else "")

    def describe(self, digits: int | None = None) -> str:
        """Its name and fingerprint, the latter in `digits` hex digits (default SHORT_HEX)."""
        name = f"{self.name} " if self.name else ""
        return f"{name}(fingerprint {short_hex(self.fingerprint, digits)})"


@dataclass(frozen=True)
class Identity:
    """A parsed identity trailer."""

    model: ModelRef
    sha256: bytes  # of the body: every byte before the trailer
    body_bytes: int

    @property
    def trailer_bytes(self) -> int:
        return len(_name_bytes(self.model.name)) + IDENTITY_FOOTER_BYTES

    def pack(self) -> bytes:
        name = _name_bytes(self.model.name)
        return name + IDENTITY_FOOTER.pack(self.model.fingerprint, self.sha256, self.body_bytes,
                                           len(name), IDENTITY_VERSION,
                                           len(name) + IDENTITY_FOOTER_BYTES, IDENTITY_MAGIC)


def trailer_start(model: ModelRef, n: int) -> bytes:
    """The first n bytes of the identity trailer ds4 writes after a payload of `model` (its name,
    then its fingerprint): what a file cut n bytes into that trailer ends with."""
    return (_name_bytes(model.name) + model.fingerprint)[:n]


def _name_bytes(name: str) -> bytes:
    b = name.encode("utf-8")[:MAX_MODEL_NAME_BYTES]
    return b.decode("utf-8", "ignore").encode("utf-8")  # never a split character


def parse_identity(end: bytes, total: int) -> Identity | None:
    """The identity trailer at the end of a `total`-byte payload, given its last bytes (at least
    the footer plus the longest name, or all of them); None when it ends without one."""
    if len(end) < IDENTITY_FOOTER_BYTES or total < IDENTITY_FOOTER_BYTES:
        return None
    fp, digest, body, n_name, version, n_trailer, magic = IDENTITY_FOOTER.unpack(
        end[-IDENTITY_FOOTER_BYTES:])
    if magic != IDENTITY_MAGIC:
        return None
    if version != IDENTITY_VERSION:
        raise _fail(E_IDENTITY, f"version: expected {IDENTITY_VERSION}, got {version}")
    if n_name > MAX_MODEL_NAME_BYTES:
        raise _fail(E_IDENTITY, f"name_bytes: expected at most {MAX_MODEL_NAME_BYTES}, got {n_name}")
    if n_trailer != n_name + IDENTITY_FOOTER_BYTES:
        raise _fail(E_IDENTITY, f"trailer_bytes: expected {n_name + IDENTITY_FOOTER_BYTES}, "
                                f"got {n_trailer}")
    if body + n_trailer != total:
        raise _fail(E_IDENTITY, f"body_bytes: expected {total - n_trailer} (the file has {total} "
                                f"bytes), got {body}")
    if len(end) < n_trailer:
        raise ValueError("parse_identity: pass at least the whole trailer")
    try:
        name = end[len(end) - n_trailer: len(end) - IDENTITY_FOOTER_BYTES].decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(E_IDENTITY, "the model name is not UTF-8") from None
    return Identity(ModelRef(fp, name), digest, body)


_TRAILER_MAX = MAX_MODEL_NAME_BYTES + IDENTITY_FOOTER_BYTES


def read_identity(src, nbytes: int | None = None) -> Identity | None:
    """The identity trailer of a payload (bytes, a path or a seekable stream, whose position is
    kept); None for a bare v1/v2 payload or a stream that cannot seek."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = memoryview(src).cast("B")
        total = len(data) if nbytes is None else min(nbytes, len(data))
        return parse_identity(bytes(data[max(0, total - _TRAILER_MAX): total]), total)
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            return read_identity(f, nbytes)
    try:
        pos = src.tell()
        end = src.seek(0, os.SEEK_END) if nbytes is None else pos + nbytes
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    try:
        total = end - pos
        start = max(pos, end - _TRAILER_MAX)
        src.seek(start)
        got = src.read(end - start)
        return parse_identity(got, total) if len(got) == end - start else None
    finally:
        src.seek(pos)


def verify_digest(src, ident: Identity) -> None:
    """Hash a payload's body (bytes or a path) against its trailer; raises PayloadError."""
    h = hashlib.sha256()
    if isinstance(src, (bytes, bytearray, memoryview)):
        h.update(memoryview(src).cast("B")[: ident.body_bytes])
    else:
        with open(src, "rb") as f:
            left = ident.body_bytes
            while left and (b := f.read(min(left, _HASH_CHUNK))):
                h.update(b)
                left -= len(b)
    _check_digest(h.digest(), ident)


_HASH_CHUNK = 1 << 20


def check_model(ident: Identity | None, model: ModelRef | None) -> None:
    """Refuse a payload whose trailer names another model than `model`."""
    if ident is not None and model is not None and ident.model.fingerprint != model.fingerprint:
        digits = distinct_digits(ident.model.fingerprint, model.fingerprint)
        raise _fail(E_MODEL, f"the file was saved from {ident.model.describe(digits)}, this is "
                             f"{model.describe(digits)}")


def _check_digest(got: bytes, ident: Identity) -> None:
    if got != ident.sha256:
        digits = distinct_digits(got, ident.sha256)
        raise _fail(E_CHECKSUM, f"the SHA-256 of its {ident.body_bytes} body bytes is {short_hex(got, digits)}, "
                                f"the trailer says {short_hex(ident.sha256, digits)}")
