"""The refusal record qkp and DS4T send in place of a hello record they will not send.

    {u32 magic, u32 reason_bytes} + reason (UTF-8, at most MAX_REASON_BYTES)

Each wire has its own refusal magic, distinct from its hello magics, and every record a server
sends during its hello begins with a u32 magic, so the client tells a refusal from the record
it expected by the first four bytes; the server closes the connection after it. A refusal is
what a peer gets instead of a bare close, so that it can say why ("numerics: expected ds4 ...",
"this stage requires TLS ...") instead of guessing; it carries only the reason, never model
data, and a stranger may get one.
"""

from __future__ import annotations

import struct
from typing import Callable

REFUSAL = struct.Struct("<II")  # magic, reason_bytes
WORD = struct.Struct("<I")  # the first field of any hello record: its magic
MAX_REASON_BYTES = 4 << 10


def pack(magic: int, reason: str) -> bytes:
    """The record, its reason cut to MAX_REASON_BYTES (at a character boundary)."""
    text = reason.encode("utf-8")[:MAX_REASON_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return REFUSAL.pack(magic, len(text)) + text


def read_reason(recv_exact: Callable[[int], bytes]) -> str:
    """The reason of a refusal whose magic was read already; ValueError when its length is over
    MAX_REASON_BYTES (nothing is allocated from a longer one)."""
    (n,) = WORD.unpack(bytes(recv_exact(WORD.size)))
    if n > MAX_REASON_BYTES:
        raise ValueError(f"reason_bytes: expected at most {MAX_REASON_BYTES}, got {n}")
    return bytes(recv_exact(n)).decode("utf-8", "replace")
