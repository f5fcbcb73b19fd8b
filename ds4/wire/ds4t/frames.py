"""DS4T control frames: the frame types and who may send them (`SENT_BY`), `Limits` (what a
receiver accepts, from the agreed hello), one dataclass per frame with its payload encoding and
validation, and `pack_frame` / `check_frame_header` / `read_frame` / `unpack_frame`, which check
a header against the limits before a payload byte is read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Callable, ClassVar

import numpy as np

from ...core.tp_split import Gate
from .base import F32, FRAME_HEADER, FRAME_MAGIC, MAX_CTX, MAX_SLAB_BYTES, N_RANK, U32, DS4TError
from .hello import Hello, Role, vocab_part


class FrameType(IntEnum):
    SYNC = 1
    EVAL = 2
    REWIND = 3
    INVALIDATE = 4
    STOP = 5
    HASH = 6
    LOGITS = 10
    SESSION_CREATE = 13
    SESSION_DESTROY = 14
    COMMAND_ACK = 17
    STATE = 25


# Who may send what on the control connection: a frame from the wrong end is a protocol error.
SENT_BY = {
    # (HASH goes one way: the leader compares the worker's hashes with its own)
    Role.LEADER: frozenset({FrameType.SYNC, FrameType.EVAL, FrameType.REWIND, FrameType.INVALIDATE,
                            FrameType.STOP, FrameType.SESSION_CREATE, FrameType.SESSION_DESTROY,
                            FrameType.STATE}),
    Role.WORKER: frozenset({FrameType.HASH, FrameType.LOGITS, FrameType.COMMAND_ACK}),
}


class AckStatus(IntEnum):
    OK = 0
    UNAVAILABLE = 1
    FAILED = -1


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts, from the agreed hello and the prefill chunk cap."""

    n_layer: int
    n_embd: int
    n_vocab: int
    ctx: int
    max_rows: int  # rows of one bulk gate record (the prefill chunk cap)
    n_rank: int = N_RANK
    max_state_bytes: int = 0  # a STATE frame's payload (a full-ctx DSV4 payload); 0 refuses STATE
    n_hc: int = 1  # HIDDEN records carry n_hc × n_embd per row (from this end's model)
    n_route: int = 1  # ROUTE records carry 2 × n_route per row (experts per token)

    @classmethod
    def from_hello(cls, hello: Hello, max_rows: int, ctx: int | None = None,
                   max_state_bytes: int = 0, n_hc: int = 1, n_route: int = 1) -> "Limits":
        """`ctx`: the agreed one (check_peer's result); default the hello's own.
        `max_state_bytes`, `n_hc`, `n_route`: from this end's own model and ctx."""
        lim = cls(hello.n_layer, hello.n_embd, hello.n_vocab, hello.ctx if ctx is None else ctx,
                  max_rows, hello.n_rank, max_state_bytes, n_hc, n_route)
        if not 1 <= lim.ctx <= MAX_CTX:
            raise DS4TError("ctx", f"expected 1..{MAX_CTX}, got {lim.ctx}")
        if not 1 <= max_rows <= lim.ctx:
            raise DS4TError("max_rows", f"expected 1..ctx={lim.ctx}, got {max_rows}")
        if lim.slab_bytes(max_rows, Gate.HIDDEN) > MAX_SLAB_BYTES:
            raise DS4TError("max_rows", f"a slab of {max_rows} rows × {lim.width(Gate.HIDDEN)} f32 is over "
                            f"{MAX_SLAB_BYTES} bytes")
        return lim

    def width(self, gate: Gate) -> int:
        """f32 words per row of a record of this gate."""
        if gate == Gate.HIDDEN:
            return self.n_hc * self.n_embd
        if gate == Gate.ROUTE:
            return 2 * self.n_route
        return self.n_embd

    def slab_bytes(self, rows: int, gate: Gate = Gate.ATTN) -> int:
        return rows * self.width(gate) * F32.itemsize

    def worker_vocab_parts(self) -> dict[int, int]:
        """vocab_first -> count for every rank that sends LOGITS (all but the leader)."""
        parts = (vocab_part(self.n_vocab, self.n_rank, r) for r in range(1, self.n_rank))
        return dict(parts)

    def max_frame_bytes(self, ftype: FrameType) -> int:
        if ftype == FrameType.SYNC:
            return Sync.FIXED.size + U32.itemsize * self.ctx
        if ftype == FrameType.LOGITS:
            return Logits.FIXED.size + F32.itemsize * max(self.worker_vocab_parts().values())
        if ftype == FrameType.STATE:
            return State.FIXED.size + self.max_state_bytes
        return FRAME_TYPES[ftype].FIXED.size


def _check_token(token: int, limits: Limits, where: str) -> None:
    if token >= limits.n_vocab:
        raise DS4TError("token", f"{where}: token id {token} is not below n_vocab={limits.n_vocab}")


@dataclass(frozen=True, eq=False)  # arrays: compare fields, not frames
class Sync:
    session: int
    tokens: np.ndarray  # uint32 [count]
    TYPE: ClassVar = FrameType.SYNC
    FIXED: ClassVar = struct.Struct("<QI")

    def payload(self) -> list:
        t = np.ascontiguousarray(self.tokens, dtype=U32)
        return [self.FIXED.pack(self.session, t.size), t]

    @classmethod
    def decode(cls, buf: memoryview, limits: Limits) -> "Sync":
        session, count = cls.FIXED.unpack_from(buf)
        stated = (len(buf) - cls.FIXED.size) // U32.itemsize
        if count != stated:
            raise DS4TError("count", f"SYNC says {count} tokens, its length holds {stated}")
        tokens = np.frombuffer(buf, U32, count, cls.FIXED.size)
        bad = np.flatnonzero(tokens >= limits.n_vocab)
        if bad.size:
            _check_token(int(tokens[bad[0]]), limits, f"SYNC row {int(bad[0])}")
        return cls(session, tokens)


class _Fixed:
    """A fixed-size frame: its dataclass fields, in order, are the FIXED struct's."""

    FIXED: ClassVar = struct.Struct("<")

    def payload(self) -> list:
        return [self.FIXED.pack(*(getattr(self, f.name) for f in fields(self)))]

    @classmethod
    def decode(cls, buf: memoryview, limits: Limits):
        frame = cls(*cls.FIXED.unpack(buf))
        frame.validate(limits)
        return frame

    def validate(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True)
class Eval(_Fixed):
    session: int
    seq: int  # the gate seq of the first record this token exchanges
    token: int
    TYPE: ClassVar = FrameType.EVAL
    FIXED: ClassVar = struct.Struct("<QQI")

    def validate(self, limits: Limits) -> None:
        _check_token(self.token, limits, "EVAL")


@dataclass(frozen=True)
class Rewind(_Fixed):
    session: int
    pos: int
    TYPE: ClassVar = FrameType.REWIND
    FIXED: ClassVar = struct.Struct("<QI")

    def validate(self, limits: Limits) -> None:
        if self.pos > limits.ctx:
            raise DS4TError("pos", f"REWIND to {self.pos} is past ctx={limits.ctx}")


@dataclass(frozen=True)
class SessionCreate(_Fixed):
    session: int
    ctx: int
    prefill_cap: int  # the session's chunk: both ranks must cut a prefill alike
    TYPE: ClassVar = FrameType.SESSION_CREATE
    FIXED: ClassVar = struct.Struct("<QII")

    def validate(self, limits: Limits) -> None:
        if not 1 <= self.ctx <= limits.ctx:
            raise DS4TError("ctx", f"SESSION_CREATE ctx expected 1..{limits.ctx}, got {self.ctx}")
        top = min(self.ctx, limits.max_rows)
        if not 1 <= self.prefill_cap <= top:
            raise DS4TError("prefill_cap", f"SESSION_CREATE prefill_cap expected 1..{top} "
                            f"(ctx and the bulk gate bound), got {self.prefill_cap}")


@dataclass(frozen=True)
class Invalidate(_Fixed):
    session: int
    TYPE: ClassVar = FrameType.INVALIDATE
    FIXED: ClassVar = struct.Struct("<Q")


@dataclass(frozen=True)
class SessionDestroy(_Fixed):
    session: int
    TYPE: ClassVar = FrameType.SESSION_DESTROY
    FIXED: ClassVar = struct.Struct("<Q")


@dataclass(frozen=True)
class Stop(_Fixed):
    TYPE: ClassVar = FrameType.STOP


@dataclass(frozen=True)
class Hash(_Fixed):
    seq: int
    value: int  # the rank's hidden-state hash after token `seq`
    TYPE: ClassVar = FrameType.HASH
    FIXED: ClassVar = struct.Struct("<QQ")


@dataclass(frozen=True)
class CommandAck(_Fixed):
    session: int
    status: AckStatus
    TYPE: ClassVar = FrameType.COMMAND_ACK
    FIXED: ClassVar = struct.Struct("<Qi")

    @classmethod
    def decode(cls, buf: memoryview, limits: Limits) -> "CommandAck":
        session, status = cls.FIXED.unpack(buf)
        if status not in tuple(AckStatus):
            raise DS4TError("status", f"expected one of {[int(s) for s in AckStatus]}, got {status}")
        return cls(session, AckStatus(status))


@dataclass(frozen=True, eq=False)
class Logits:
    vocab_first: int
    logits: np.ndarray  # float32 [count]
    TYPE: ClassVar = FrameType.LOGITS
    FIXED: ClassVar = struct.Struct("<II")

    def payload(self) -> list:
        v = np.ascontiguousarray(self.logits, dtype=F32)
        return [self.FIXED.pack(self.vocab_first, v.size), v]

    @classmethod
    def decode(cls, buf: memoryview, limits: Limits) -> "Logits":
        first, count = cls.FIXED.unpack_from(buf)
        parts = limits.worker_vocab_parts()
        if first not in parts:
            want = ", ".join(f"{f}+{c}" for f, c in parts.items())
            raise DS4TError("vocab_first", f"LOGITS for rows {first}+{count} is not a worker's "
                            f"vocab part ({want})")
        if parts[first] != count:
            raise DS4TError("count", f"LOGITS for rows {first}+{count}: the worker's part from row {first} "
                            f"has {parts[first]} rows")
        stated = (len(buf) - cls.FIXED.size) // F32.itemsize
        if stated != count:
            raise DS4TError("count", f"LOGITS says {count} floats, its length holds {stated}")
        return cls(first, np.frombuffer(buf, F32, count, cls.FIXED.size))


@dataclass(frozen=True, eq=False)
class State:
    session: int
    payload: bytes  # a DSV4 session payload (its own reader checks it against the model)
    TYPE: ClassVar = FrameType.STATE
    FIXED: ClassVar = struct.Struct("<Q")

    def payload_parts(self) -> list:
        return [self.FIXED.pack(self.session), self.payload]

    @classmethod
    def decode(cls, buf: memoryview, limits: Limits) -> "State":
        (session,) = cls.FIXED.unpack_from(buf)
        return cls(session, bytes(buf[cls.FIXED.size:]))


Frame = (Sync | Eval | Rewind | Invalidate | Stop | Hash | Logits | SessionCreate | SessionDestroy
         | CommandAck | State)
FRAME_TYPES: dict[FrameType, type] = {cls.TYPE: cls for cls in (
    Sync, Eval, Rewind, Invalidate, Stop, Hash, Logits, SessionCreate, SessionDestroy, CommandAck,
    State)}
_VARIABLE = (FrameType.SYNC, FrameType.LOGITS)  # (STATE: any byte count up to its bound)


def pack_frame(frame: Frame) -> bytes:
    parts = frame.payload_parts() if isinstance(frame, State) else frame.payload()
    body = b"".join(memoryview(p).cast("B") for p in parts)
    return FRAME_HEADER.pack(FRAME_MAGIC, frame.TYPE, len(body)) + body


def check_frame_header(buf: bytes, limits: Limits, sender: Role | None = None) -> tuple[FrameType, int]:
    """Validate a 12-byte frame header; -> (type, payload bytes), bounded by `limits`.
    `sender`: the peer's role, whose frames (SENT_BY) are the only ones accepted."""
    if len(buf) != FRAME_HEADER.size:
        raise DS4TError("header", f"expected {FRAME_HEADER.size} bytes, got {len(buf)}")
    magic, ftype, nbytes = FRAME_HEADER.unpack(buf)
    if magic != FRAME_MAGIC:
        raise DS4TError("magic", f"expected {FRAME_MAGIC:#010x} (DS4T control frame), "
                        f"got {magic:#010x}")
    if ftype not in FRAME_TYPES:
        raise DS4TError("type", f"expected one of {sorted(int(t) for t in FRAME_TYPES)}, got {ftype}")
    ftype = FrameType(ftype)
    if sender is not None and ftype not in SENT_BY[sender]:
        raise DS4TError("type", f"{ftype.name} is not a frame a {sender.name.lower()} sends")
    fixed, top = FRAME_TYPES[ftype].FIXED.size, limits.max_frame_bytes(ftype)
    if ftype in _VARIABLE:
        if not fixed <= nbytes <= top or (nbytes - fixed) % 4:
            raise DS4TError("bytes", f"{ftype.name} expected {fixed}..{top} bytes "
                            f"({fixed} + 4 × n), got {nbytes}")
    elif ftype == FrameType.STATE:
        if not fixed < nbytes <= top:
            raise DS4TError("bytes", f"STATE expected {fixed + 1}..{top} bytes (this end's bound "
                            f"for a full-ctx payload), got {nbytes}")
    elif nbytes != fixed:
        raise DS4TError("bytes", f"{ftype.name} expected {fixed} bytes, got {nbytes}")
    return ftype, nbytes


RecvExact = Callable[[int], bytes | bytearray | memoryview]


def read_frame(recv_exact: RecvExact, limits: Limits, header: bytes | None = None,
               sender: Role | None = None) -> Frame:
    """Read one frame: the header (unless given), its checks, then exactly the payload bytes
    the checks allowed; the payload is validated before the frame is returned."""
    ftype, nbytes = check_frame_header(bytes(recv_exact(FRAME_HEADER.size) if header is None
                                             else header), limits, sender)
    body = memoryview(bytes(recv_exact(nbytes)) if nbytes else b"")
    return FRAME_TYPES[ftype].decode(body, limits)


def unpack_frame(buf: bytes, limits: Limits) -> Frame:
    """One whole frame from bytes: truncated or trailing bytes are refused."""
    buf = memoryview(bytes(buf))
    ftype, nbytes = check_frame_header(bytes(buf[:FRAME_HEADER.size]), limits)
    body = buf[FRAME_HEADER.size:]
    if len(body) != nbytes:
        raise DS4TError("bytes", f"{ftype.name} header says {nbytes} payload bytes, "
                        f"{len(body)} follow")
    return FRAME_TYPES[ftype].decode(body, limits)
