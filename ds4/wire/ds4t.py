"""DS4T: the two-rank tensor-parallel wire (shared/spec/wire.md §2).

The leader (rank 0) mirrors every session call to the worker (rank 1) on a **control**
connection; inside each layer the two ranks swap their partial sublayer outputs on a **data**
connection and both add `partial_rank0 + partial_rank1`, in that order. This module is the
protocol only: records, limits, checks and the two channels; it touches no tensors of the model.

Connections: the leader listens, the worker dials twice; the first accepted connection is
control, the second data. On each, both ends send their `Hello` at once and read the peer's.
Everything is little-endian and fixed-layout; offsets in bytes.

Hello (72 bytes, both directions):

    0  u32 magic 0x44533454 ("DS4T")   36  u32 n_expert
    4  u32 version (1)                  40  u32 n_head
    8  u32 role (0 leader, 1 worker)    44  u32 ctx
   12  u32 flags (bit0 AUTH,            48  u32 gates_per_token (= 2 × n_layer)
       bit1 DEBUG_HASH, bit2 TORCH_GATES)
   16  u64 fingerprint (first 8 bytes   52  u32 n_rank (2)
       of the model's SHA-256, LE)      56  u32 rank (0 leader, 1 worker)
   24  u32 n_layer                      60  u32 backend (Backend: 0 reference,
                                            1 mlx, 2 triton)
                                        64  8 bytes reserved, zero
   28  u32 n_embd
   32  u32 n_vocab

`check_peer`: everything but ctx and DEBUG_HASH must be equal (the worker adopts the leader's ctx
and its DEBUG_HASH, the `--debug-hash` lockstep check, which only the leader chooses); roles and
ranks must differ. flags bit0 (AUTH) says "the shared mutual-auth handshake follows the hellos
on this connection"; both ends must agree on it, and when it is set `handshake` calls the
shared handshake (its `authenticate` argument) right after the hellos are exchanged and before
any frame or gate moves: a peer that cannot prove the secret never sees a frame, and nothing
sized by a peer is allocated before that (the hello is fixed at 72 bytes).

`mutual_auth(token, role, timeout)` is that argument: `ds4.wire.auth`'s proof with protocol
`PROTOCOL` (the hello magic as it travels, b"T4SD"), the leader as the server (it listens). On
each connection, right after the hellos (32-byte nonces and HMAC-SHA256 proofs, auth.py):

    worker -> leader  client_nonce
    leader -> worker  server_nonce, server_proof      (over both nonces)
    worker -> leader  client_proof                    (only once server_proof checked out)

The leader has then proven the secret before the worker sends anything but its hello and a
nonce, and the worker before the leader sends a frame or a gate record; a failed proof is
`DS4TError` with field "auth" and the connection is not used.

Control frame: a 12-byte header `{u32 magic 0x44533443 ("DS4C"), u32 type, u32 bytes}`, then
`bytes` of payload. `bytes` is checked against the type's limit (from the agreed hello) before
the payload is read. Types keep ds4_tp.h's numbers:

    1  SYNC             u64 session, u32 count, count × u32 token   (count ≤ ctx, token < n_vocab)
    2  EVAL             u64 session, u64 seq, u32 token             (20 bytes)
    3  REWIND           u64 session, u32 pos                        (pos ≤ ctx)
    4  INVALIDATE       u64 session
    5  STOP             (none)
    6  HASH             u64 seq, u64 hash                           (--debug-hash lockstep check)
   10  LOGITS           u32 vocab_first, u32 count, count × f32     (a worker rank's vocab part)
   13  SESSION_CREATE   u64 session, u32 ctx                        (1 ≤ ctx ≤ agreed ctx)
   14  SESSION_DESTROY  u64 session
   17  COMMAND_ACK      u64 session, i32 status                     (AckStatus: 0, 1, -1)
   25  STATE            u64 session, then a DSV4 session payload    (≤ Limits.max_state_bytes)

The leader sends 1–6, 13, 14 and 25; the worker sends 6 (its hash for the same seq), 10 and 17
(`SENT_BY`); a frame from the wrong end is refused on its header. EVAL's seq is the gate seq
of the first record that token exchanges, so a worker that drifted is caught at the command,
not a layer later. A worker may idle any time for the next header; once a header is in, the
rest of the frame must follow within the io timeout.

Gate record on the data connection (24-byte header + payload):

    0  u32 magic 0x44533447 ("DS4G")    16  u32 rows
    4  u16 layer                        20  u16 rank (the sender's)
    6  u16 gate (0 ATTN, 1 FFN,         22  u16 reserved, zero
       2 HIDDEN, 3 ROUTE)
    8  u64 seq
    then rows × width f32, row-major: ATTN / FFN the sender's partial sum (width n_embd)

Each side writes its record while reading the peer's (full duplex, so a bulk slab larger than
the socket buffers cannot deadlock two writers); the receiver checks the header against what it
expects (magic, rank, layer, gate, seq, rows) before it reads a payload byte, and any mismatch
is `GateDesync` naming the expected and the actual value, never a silently wrong sum. `seq` is a
counter both ranks advance by one per exchanged record, from 1. Decode: one row per record;
prefill: one bulk record per layer and gate with all rows of the chunk (rows ≤ the chunk cap
given to `Limits`). The whole exchange has one deadline, `--gate-timeout-ms` (default 750): a
frozen peer is `GateTimeout`, not a hang; a failed channel refuses further exchanges.

Ranks on different backends (the hellos' `backend` differ) compute the replicated ops (mHC,
norms, router) with different roundings, so their hidden states would drift apart in the last
bits and, worse, a near-tie in the router could send one token to different experts on the two
ranks (an expert counted twice or not at all). Such a pair runs *canonical*: the leader's
hidden state and routing are the pair's. Two more records then travel each layer, both ends
sending as for any gate (the worker's copy is ignored, so the exchange, its deadline and its
checks stay one mechanism): ROUTE after the router (width 2·k: the k expert ids as int32 bits,
then the k weights) and HIDDEN after each sublayer's mHC expand (width n_hc·n_embd: the whole
hidden state), which the worker adopts. Same-backend pairs compute the same bits on both ranks
and send neither. The widths come from the receiver's own model (the fingerprint says it is
the same one), as do its bounds.

DS4 changes from ds4_tp.h (why):
* The hello carries DS4's split dimensions (n_expert, n_head) and the rank count and index
  instead of gguf_bytes / model_id / quant_bits and the gate-slot mask: the fingerprint covers
  the file, DS4 always fires ATTN then FFN in every layer (gates_per_token = 2 × n_layer, so no
  mask), and the rank fields are what an N-rank pair needs.
* Separate magics for hello, control and gate records, so a swapped accept order or a stream
  that lost framing is a clear `magic` error instead of a misread length.
* The gate header adds `rows` and `rank`: a bulk record's size is stated and checked, not
  assumed, and an N-rank reduce knows whose partial it holds.
* LOGITS states which vocab part it carries (vocab_first, count) instead of relying on the
  receiver's arithmetic; it must be exactly a worker rank's part.
* STATE (25, new) hands a session's whole state to the worker as a DSV4 payload (spec §4.1):
  every rank holds the whole session state (the KV cache is one latent; compressors and indexer
  are replicated), so a session loaded from a payload, restored from a snapshot or rebuilt for
  a worker that re-joined is one transfer, not a replay. Its bound is the payload of a full
  ctx, computed by the receiver from its own model (0 = refused).
* TORCH_GATES (`--tp-transport nccl|gloo`): the gate records do not travel on the data
  connection but through `torch.distributed` (an all-gather of the partials, each stamped with
  the same 24-byte header fields, checked the same way). Right after the data connection's
  handshake the leader sends `{u32 store_port, u32 reserved 0}`: the port of the
  `torch.distributed` TCPStore it opened on its own address, where the worker joins as rank 1.
  Both ends must set it alike.
* After every command the worker answers, in order: with DEBUG_HASH one HASH per layer that
  ran (seq = that layer's FFN gate seq, value = a hash of the hidden state after the layer), a
  LOGITS when the command produced logits, then COMMAND_ACK.
* Not used by DS4 and refused as unknown types: the RDMA frames (7, 9, 19, 20), SYNC_ACK (8),
  speculative VERIFY (11, 12), EVAL/MIXED_BATCH (15, 16), multimodal SYNC (18), GLM_MTP (21),
  SYNC_CHECKPOINT (22), DSPARK_DRAFT (23), SPEC_RESTORE (24). Transport is TCP only.

N ranks (the plan; this version refuses n_rank ≠ 2): routed experts and attention heads (with
their output groups) split in N contiguous parts, rank r holding experts [r·E/N, (r+1)·E/N)
and heads [r·H/N, (r+1)·H/N) (the hello checks that E and H divide by n_rank); the shared
expert stays on rank 0; the vocabulary is split the same way (`vocab_part`), every worker
sending LOGITS for its part. A gate becomes an all-gather of N partials on a data connection
per peer, each record stamped with its sender's rank, and every rank reduces
`((p0 + p1) + p2) + …` in rank order (`reduce_in_rank_order`), so all ranks hold bit-identical
sums. The hello already carries n_rank and rank; the leader accepts 2 × (N − 1) connections and
checks that the ranks it sees are exactly 1..N−1.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Callable, ClassVar

import numpy as np

from ..core.tp_split import Gate
from . import auth

MAGIC = 0x44533454  # "DS4T": the hello
FRAME_MAGIC = 0x44533443  # "DS4C": a control frame
GATE_MAGIC = 0x44533447  # "DS4G": a gate record
VERSION = 1
FLAG_AUTH = 1 << 0
FLAG_DEBUG_HASH = 1 << 1  # the leader's choice; the worker adopts it
FLAG_TORCH_GATES = 1 << 2  # gates through torch.distributed (NCCL / gloo), not the data connection
PROTOCOL = struct.pack("<I", MAGIC)  # the auth proofs' protocol name: b"T4SD", as it travels
KNOWN_FLAGS = FLAG_AUTH | FLAG_DEBUG_HASH | FLAG_TORCH_GATES
N_RANK = 2  # the only rank count this version serves
GATES_PER_LAYER = 2
DEFAULT_GATE_TIMEOUT_MS = 750

# Sanity bounds on any hello, so even a hostile one cannot make a receiver size anything absurd
# (check_peer then requires every dimension to equal this end's model).
MAX_LAYERS = 0xFFFF  # the gate header's u16 layer
MAX_EMBD = 1 << 16
MAX_VOCAB = 1 << 24
MAX_CTX = 1 << 24
MAX_SPLIT_DIM = 1 << 16  # n_expert, n_head
MAX_SLAB_BYTES = 1 << 31  # one bulk gate record's payload

HELLO = struct.Struct("<4IQ9I3I")
FRAME_HEADER = struct.Struct("<3I")
GATE_HEADER = struct.Struct("<IHHQIHH")
F32 = np.dtype("<f4")
U32 = np.dtype("<u4")


class Role(IntEnum):
    LEADER = 0
    WORKER = 1


class Backend(IntEnum):
    REFERENCE = 0
    MLX = 1
    TRITON = 2

    @classmethod
    def named(cls, name: str) -> "Backend":
        return cls[name.upper()]


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
    Role.LEADER: frozenset({FrameType.SYNC, FrameType.EVAL, FrameType.REWIND, FrameType.INVALIDATE,
                            FrameType.STOP, FrameType.HASH, FrameType.SESSION_CREATE,
                            FrameType.SESSION_DESTROY, FrameType.STATE}),
    Role.WORKER: frozenset({FrameType.HASH, FrameType.LOGITS, FrameType.COMMAND_ACK}),
}


class AckStatus(IntEnum):
    OK = 0
    UNAVAILABLE = 1
    FAILED = -1


class DS4TError(Exception):
    """A protocol violation or a failed exchange; `field` names what was wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class DS4TClosed(DS4TError):
    """The peer closed the connection, or went quiet past the deadline, mid-record."""


class GateTimeout(DS4TClosed):
    """A gate exchange did not finish within the gate timeout."""


class GateDesync(DS4TError):
    """The peer's gate record is for another layer, gate, seq, row count or rank."""


class HelloRefused(DS4TError):
    """The peer's hello does not fit this end; the message names the field and both values."""


# ---- hello ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    role: Role
    flags: int
    fingerprint: int  # first 8 bytes of the model fingerprint, little-endian
    n_layer: int
    n_embd: int
    n_vocab: int
    n_expert: int
    n_head: int
    ctx: int
    gates_per_token: int
    n_rank: int
    rank: int
    version: int = VERSION
    backend: int = Backend.REFERENCE

    @classmethod
    def for_gguf(cls, model, role: Role, ctx: int, *, auth: bool = False,
                 debug_hash: bool = False, torch_gates: bool = False,
                 backend: str = "reference") -> "Hello":
        """The hello for a loaded `ds4.core.gguf_model.GGUFModel` (its config and fingerprint)."""
        c = model.config
        return cls.for_model(role, fingerprint=model.fingerprint64, n_layer=c.n_layer,
                             n_embd=c.n_embd, n_vocab=c.n_vocab, n_expert=c.n_expert,
                             n_head=c.n_head, ctx=ctx, auth=auth, debug_hash=debug_hash,
                             torch_gates=torch_gates, backend=backend)

    @classmethod
    def for_model(cls, role: Role, *, fingerprint: int, n_layer: int, n_embd: int, n_vocab: int,
                  n_expert: int, n_head: int, ctx: int, auth: bool = False,
                  debug_hash: bool = False, torch_gates: bool = False,
                  backend: str = "reference") -> "Hello":
        """The hello of a two-rank pair member (rank = role)."""
        flags = ((FLAG_AUTH if auth else 0) | (FLAG_DEBUG_HASH if debug_hash else 0)
                 | (FLAG_TORCH_GATES if torch_gates else 0))
        return cls(Role(role), flags, fingerprint, n_layer, n_embd, n_vocab,
                   n_expert, n_head, ctx, GATES_PER_LAYER * n_layer, N_RANK, int(role),
                   backend=Backend.named(backend))

    def pack(self) -> bytes:
        return HELLO.pack(MAGIC, self.version, self.role, self.flags, self.fingerprint,
                          self.n_layer, self.n_embd, self.n_vocab, self.n_expert, self.n_head,
                          self.ctx, self.gates_per_token, self.n_rank, self.rank, self.backend, 0, 0)

    @classmethod
    def unpack(cls, buf: bytes) -> "Hello":
        if len(buf) != HELLO.size:
            raise DS4TError("hello", f"expected {HELLO.size} bytes, got {len(buf)}")
        (magic, version, role, flags, fp, n_layer, n_embd, n_vocab, n_expert, n_head, ctx,
         gpt, n_rank, rank, backend, *reserved) = HELLO.unpack(buf)
        if magic != MAGIC:
            raise DS4TError("magic", f"expected {MAGIC:#010x} (DS4T hello), got {magic:#010x}")
        if version != VERSION:
            raise DS4TError("version", f"expected {VERSION}, got {version}")
        if role not in tuple(Role):
            raise DS4TError("role", f"expected 0 (leader) or 1 (worker), got {role}")
        if flags & ~KNOWN_FLAGS:
            raise DS4TError("flags", f"unknown bits {flags & ~KNOWN_FLAGS:#x}")
        if any(reserved):
            raise DS4TError("reserved", f"expected zero, got {reserved}")
        if backend not in tuple(Backend):
            raise DS4TError("backend", f"expected one of {[int(b) for b in Backend]}, got {backend}")
        hello = cls(Role(role), flags, fp, n_layer, n_embd, n_vocab, n_expert, n_head, ctx, gpt,
                    n_rank, rank, version, Backend(backend))
        hello.check()
        return hello

    def check(self) -> None:
        """Internal consistency; raises DS4TError naming the first bad field."""
        for name, top in (("n_layer", MAX_LAYERS), ("n_embd", MAX_EMBD), ("n_vocab", MAX_VOCAB),
                          ("n_expert", MAX_SPLIT_DIM), ("n_head", MAX_SPLIT_DIM), ("ctx", MAX_CTX)):
            v = getattr(self, name)
            if not 1 <= v <= top:
                raise DS4TError(name, f"expected 1..{top}, got {v}")
        if self.gates_per_token != GATES_PER_LAYER * self.n_layer:
            raise DS4TError("gates_per_token", f"expected {GATES_PER_LAYER} × n_layer = "
                            f"{GATES_PER_LAYER * self.n_layer}, got {self.gates_per_token}")
        if self.n_rank != N_RANK:
            raise DS4TError("n_rank", f"expected {N_RANK} (this version), got {self.n_rank}")
        if self.rank != self.role:
            raise DS4TError("rank", f"expected {int(self.role)} for the {self.role.name.lower()}, "
                            f"got {self.rank}")
        for name in ("n_expert", "n_head"):
            if getattr(self, name) % self.n_rank:
                raise DS4TError(name, f"expected a multiple of n_rank={self.n_rank}, "
                                f"got {getattr(self, name)}")


_MUST_MATCH = ("version", "flags", "fingerprint", "n_layer", "n_embd", "n_vocab", "n_expert",
               "n_head", "gates_per_token", "n_rank")


def check_peer(mine: Hello, theirs: Hello) -> int:
    """The rules for a peer's hello; returns the ctx both run with (the leader's).

    HelloRefused names the field and both sides' values."""
    def show(name: str, v: int) -> str:
        return f"{v:016x}" if name == "fingerprint" else str(v)

    for name in _MUST_MATCH:
        a, b = getattr(mine, name), getattr(theirs, name)
        if name == "flags":  # (DEBUG_HASH is the leader's alone)
            a, b = a & ~FLAG_DEBUG_HASH, b & ~FLAG_DEBUG_HASH
        if a != b:
            why = ""
            if name == "flags":
                why = (" (one end has a shared secret, the other not)" if (a ^ b) & FLAG_AUTH else
                       " (one end exchanges gates through torch.distributed, the other over TCP)")
            raise HelloRefused(name, f"this {mine.role.name.lower()} has {show(name, a)}, the peer "
                               f"{theirs.role.name.lower()} has {show(name, b)}{why}")
    if mine.role == theirs.role:
        raise HelloRefused("role", f"both ends are {mine.role.name.lower()}s; roles must differ")
    if mine.rank == theirs.rank:
        raise HelloRefused("rank", f"both ends are rank {mine.rank}; ranks must differ")
    return mine.ctx if mine.role == Role.LEADER else theirs.ctx


def vocab_part(n_vocab: int, n_rank: int, rank: int) -> tuple[int, int]:
    """(first, count) of the vocabulary rows rank `rank` computes in the output head."""
    first = rank * n_vocab // n_rank
    return first, (rank + 1) * n_vocab // n_rank - first


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


# ---- control frames -----------------------------------------------------------------------------


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
    TYPE: ClassVar = FrameType.SESSION_CREATE
    FIXED: ClassVar = struct.Struct("<QI")

    def validate(self, limits: Limits) -> None:
        if not 1 <= self.ctx <= limits.ctx:
            raise DS4TError("ctx", f"SESSION_CREATE ctx expected 1..{limits.ctx}, got {self.ctx}")


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
        if parts.get(first) != count:
            want = ", ".join(f"{f}+{c}" for f, c in parts.items())
            raise DS4TError("vocab_first", f"LOGITS for rows {first}+{count} is not a worker's "
                            f"vocab part ({want})")
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


# ---- gate records -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateHeader:
    layer: int
    gate: Gate
    seq: int
    rows: int
    rank: int

    def pack(self) -> bytes:
        return GATE_HEADER.pack(GATE_MAGIC, self.layer, self.gate, self.seq, self.rows, self.rank, 0)

    @classmethod
    def unpack(cls, buf: bytes) -> "GateHeader":
        if len(buf) != GATE_HEADER.size:
            raise DS4TError("gate header", f"expected {GATE_HEADER.size} bytes, got {len(buf)}")
        magic, layer, gate, seq, rows, rank, reserved = GATE_HEADER.unpack(buf)
        if magic != GATE_MAGIC:
            raise DS4TError("magic", f"expected {GATE_MAGIC:#010x} (DS4T gate record), "
                            f"got {magic:#010x}")
        if gate not in tuple(Gate):
            raise DS4TError("gate", f"expected 0 (ATTN), 1 (FFN), 2 (HIDDEN) or 3 (ROUTE), got {gate}")
        if reserved:
            raise DS4TError("reserved", f"expected zero, got {reserved}")
        return cls(layer, Gate(gate), seq, rows, rank)

    def describe(self) -> str:
        return f"layer {self.layer} {self.gate.name} seq {self.seq} ({self.rows} rows, rank {self.rank})"


def check_gate_header(got: GateHeader, expected: GateHeader) -> None:
    """GateDesync naming the first field where the peer's record is not the expected one."""
    for name in ("rank", "layer", "gate", "seq", "rows"):
        if getattr(got, name) != getattr(expected, name):
            raise GateDesync(name, f"gate desync: expected {expected.describe()}, the peer sent "
                             f"{got.describe()}")


def reduce_in_rank_order(partials: list[np.ndarray]) -> np.ndarray:
    """((p0 + p1) + p2) + …, f32: the same order on every rank, so bit-identical sums."""
    total = np.array(partials[0], dtype=F32, copy=True)
    for p in partials[1:]:
        total += p
    return total


class GateChannel:
    """One rank's end of the data connection: exchanges gate records with one peer.

    The socket is switched to non-blocking; every exchange sends and receives at once under
    one deadline. A failed exchange (desync, timeout, closed peer, bad record) marks the
    channel failed; later exchanges are refused.
    """

    def __init__(self, sock: socket.socket, limits: Limits, rank: int, peer_rank: int,
                 gate_timeout_ms: int = DEFAULT_GATE_TIMEOUT_MS):
        self.sock, self.limits = sock, limits
        self.rank, self.peer_rank = rank, peer_rank
        self.timeout = gate_timeout_ms / 1000
        self.failed: DS4TError | None = None
        sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLOUT)

    def exchange(self, layer: int, gate: Gate, seq: int, partial: np.ndarray) -> np.ndarray:
        """Send this rank's partial [rows, n_embd] f32 and return the peer's."""
        if self.failed is not None:
            raise DS4TError("failed", f"the gate channel already failed ({self.failed})")
        if partial.dtype != F32:  # partials are f32 on the wire; a silent cast would hide a bug
            raise ValueError(f"partial: expected float32, got {partial.dtype}")
        mine = np.ascontiguousarray(partial)
        if mine.ndim == 1:
            mine = mine.reshape(1, -1)
        rows = mine.shape[0]
        width = self.limits.width(Gate(gate))
        if mine.ndim != 2 or mine.shape[1] != width or not 1 <= rows <= self.limits.max_rows:
            raise ValueError(f"partial: expected [1..{self.limits.max_rows}, {width}], "
                             f"got {list(partial.shape)}")
        if not 0 <= layer < self.limits.n_layer:
            raise ValueError(f"layer: expected 0..{self.limits.n_layer - 1}, got {layer}")
        out = GateHeader(layer, Gate(gate), seq, rows, self.rank)
        expected = GateHeader(layer, Gate(gate), seq, rows, self.peer_rank)
        try:
            return self._exchange(out, expected, mine)
        except DS4TError as e:
            self.failed = e
            raise

    def all_reduce(self, layer: int, gate: Gate, seq: int, partial: np.ndarray) -> np.ndarray:
        """Exchange, then partial_rank0 + partial_rank1 (both ranks get the same bits). Two f32
        addends commute, so the rank order only shows from three ranks on; the same reduce
        serves both."""
        peer = self.exchange(layer, gate, seq, partial)
        mine = np.asarray(partial, dtype=F32).reshape(peer.shape)
        pair = [mine, peer] if self.rank < self.peer_rank else [peer, mine]
        return reduce_in_rank_order(pair)

    @staticmethod
    def _io(op, view: memoryview, expected: GateHeader) -> int:
        """One non-blocking send or recv_into; -1 when it would block (nothing moved)."""
        try:
            return op(view)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return -1
        except OSError as e:
            raise DS4TClosed("eof", f"gate {expected.describe()}: {e}") from None

    def _exchange(self, out: GateHeader, expected: GateHeader, mine: np.ndarray) -> np.ndarray:
        sends = [memoryview(out.pack()), memoryview(mine).cast("B")]
        head = bytearray(GATE_HEADER.size)
        peer = np.empty_like(mine)
        recvs = [memoryview(head), memoryview(peer).cast("B")]
        si = sent = ri = got = 0
        deadline = time.monotonic() + self.timeout
        while ri < len(recvs) or si < len(sends):
            # wait only for what is still to do, so a finished direction cannot spin the loop
            self._poll.modify(self.sock, (select.POLLIN if ri < len(recvs) else 0)
                              | (select.POLLOUT if si < len(sends) else 0))
            left = deadline - time.monotonic()
            if left <= 0:
                raise GateTimeout("timeout", f"gate {expected.describe()} not done within "
                                  f"{self.timeout * 1000:g} ms (ours {'sent' if si == len(sends) else 'not sent'}"
                                  f", the peer's {'in' if ri == len(recvs) else 'not in'})")
            buffered = ri < len(recvs) and _tls_pending(self.sock)
            for _, ev in self._poll.poll(0 if buffered else max(1, int(left * 1000))) or [(None, 0)]:
                if buffered:
                    ev |= select.POLLIN
                if ev & (select.POLLIN | select.POLLHUP | select.POLLERR) and ri < len(recvs):
                    k = self._io(self.sock.recv_into, recvs[ri][got:], expected)
                    if k == 0:
                        raise DS4TClosed("eof", f"gate {expected.describe()}: the peer closed "
                                         "the data connection")
                    got += max(k, 0)
                    if got == len(recvs[ri]):
                        if ri == 0:  # the header decides before a payload byte is read
                            check_gate_header(GateHeader.unpack(bytes(head)), expected)
                        ri, got = ri + 1, 0
                if ev & select.POLLOUT and si < len(sends):
                    sent += max(self._io(self.sock.send, sends[si][sent:], expected), 0)
                    if sent == len(sends[si]):
                        si, sent = si + 1, 0
        return peer


# ---- control connection and hello --------------------------------------------------------------


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

    def send(self, frame: Frame) -> None:
        try:
            self.sock.sendall(pack_frame(frame))
        except TimeoutError:
            raise DS4TClosed("timeout", f"sending {frame.TYPE.name}: the peer did not read it "
                             f"within {self.io_timeout:g} s") from None
        except OSError as e:
            raise DS4TClosed("eof", f"sending {frame.TYPE.name}: {e}") from None

    def recv(self, idle_timeout: float | None = None) -> Frame:
        """The next frame. The header may take `idle_timeout` (None: a worker idles until the
        leader sends or closes); the rest of the frame must follow within the io timeout."""
        head = recv_exact(self.sock, FRAME_HEADER.size, idle_timeout, "control frame header")
        return read_frame(lambda n: recv_exact(self.sock, n, self.io_timeout, "control frame"),
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
    theirs = Hello.unpack(bytes(recv_exact(sock, HELLO.size, timeout, "the peer's hello")))
    if (mine.flags ^ theirs.flags) & FLAG_AUTH:
        check_peer(mine, theirs)  # raises, naming flags
    if mine.flags & FLAG_AUTH:
        authenticate(sock)
    return theirs, check_peer(mine, theirs)
