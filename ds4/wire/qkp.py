"""qkp6: the pipeline-stage wire (shared/spec/wire.md §1, with the changes listed below).

One model is served as contiguous layer ranges; the head sends the mHC state rows (n_hc × n_embd
float32 per token) and the token ids of each chunk to the next stage, which runs its layers and
either forwards the rows to its own next stage or, as the last stage, answers with greedy ids
and what the head's sampler needs of the final position. Everything is little-endian and
fixed-layout.

Connection, client first (optionally inside TLS, `ds4.wire.tls`):

    client -> {u32 magic, u32 flags}
    [flags & FLAG_AUTH]  client -> 32-byte client nonce
                         worker -> u32 magic, 32-byte server nonce, 32-byte server proof
                         client -> 32-byte client proof (only once the server proof checked out)
    worker -> Hello (48 bytes, its first field the magic)

The proofs are `ds4.wire.auth`'s (HMAC-SHA256 keyed by the token, protocol b"6pkq", the magic as
it travels): the worker proves the token before the head sends anything of the model, so a
listener without the token gets no token ids and no rows, and the head fails with a clear error.

A worker that will not go on answers, in place of either of its records, with a refusal
(`ds4.wire.refusal`): `{u32 REFUSAL_MAGIC ("qkpR"), u32 reason_bytes}` + reason, then closes.
Both of its records begin with the magic, so the client tells a refusal by the first word and
fails with the worker's reason. The worker refuses so: a client whose hello is malformed or
whose auth flag does not match its own (before the proofs), a client whose proof is wrong, whose
numerics differ or whose chain behind this stage does not fit (after the proofs: a stranger
learns nothing of the stage's numerics), and, when it requires TLS, a client whose first bytes
are not a TLS handshake record (`ds4.wire.sniff`: it peeks before the TLS handshake and answers
a plain client in plain text).

Then frames: a 20-byte `Header` {u32 op, u32 slot, u32 n, u32 base, u32 topk} plus the op's
payload, each answered in order:

    op        request payload                        reply
    1 EVAL    n u32 token ids, n×n_hc×n_embd f32     last stage: n u32 greedy ids, then by `topk`:
              rows for positions [base, base + n)      0: nothing; 1..256: topk × {u32 id, f32 logit}
                                                       best first; TOPK_LOGITS (0xFFFFFFFF): n_vocab
                                                       f32, the final position's whole logits row
    2 BYE     none                                   none; the connection closes
    3 SAVE    none (n = snapshot index,              u32 status
              topk = live token count)
    4 LOAD    none (same)                            u32 status
    5 OPEN    none (slot = the slot to open)         u32 status (0, or STATUS_NO_SLOT)
    6 FREE    none (slot = the slot to give back)    u32 status (0, or STATUS_SLOT_NOT_OPEN)

Changes from qkp5 (hence the magic "qkp6"): the worker's auth record begins with the magic, and
any hello record of the worker may be replaced by a refusal, so a mismatch (numerics, the token,
TLS on one end only) fails at once with the worker's reason on both ends instead of a closed
connection the head can only guess at.

Changes from qkp4 to qkp5:
* Slots belong to connections. `slot` in a frame is the connection's own slot number
  (0..n_slots-1); OPEN binds it to one of the stage's `n_slots` slots taken from the free pool,
  FREE (or the connection closing) gives it back. `n_slots` (in the hello) is the stage's total
  across all connections, not what is free now: a client learns that from OPEN. An OPEN when every
  slot is held by some connection is answered with STATUS_NO_SLOT (the head turns it into an error
  saying so): a refusal, never a wait or a steal. An EVAL naming a slot this connection has not
  opened is a protocol violation: the stage closes the connection (an EVAL reply has no status
  field) and nothing is computed. SAVE/LOAD on such a slot are answered with STATUS_SLOT_NOT_OPEN.
  Snapshot indices are the connection's own too: SAVE binds index `n` to one of the stage's
  `--snapshots` entries (STATUS_SNAPSHOTS_FULL when all are bound to other connections), LOAD
  reads only what this connection saved, and the connection closing forgets them. So no connection
  can read or write another connection's sequences.
* `topk` = TOPK_LOGITS asks the last stage for the final position's whole logits row, which is
  what exact sampling needs on the paths the top 256 do not cover (the default min-p path, top-p,
  top_k > 256): with it the head samples from the same vector an unsplit engine samples from.
* A middle stage forwards OPEN and FREE to its next stage on the connection it opened for this
  client, and answers with its own refusal without forwarding; when the next stage refuses an
  OPEN it has granted, it gives its own slot back.

Choices this module makes where the spec leaves room (all ours, all local to qkp6):
* Both ends prove the token (`ds4.wire.auth`). A worker that has a token refuses a client
  without a proof or with a wrong one (a refusal, then it closes); a worker without a token
  cannot prove one and refuses a client that asks for it; a client that has a token refuses a
  stage that cannot prove it (`AuthRefused`).
* Deadlines: the whole hello, and a frame's payload once its header arrived, must come within
  the connection's io timeout however the bytes trickle in (`ds4.wire.deadline`). Until a peer
  has proven the token (`Conn.trusted`), buffers grow as bytes arrive, so a stalled frame costs
  at most about `GROW_FROM` bytes, not its announced size.
* flags bit1 (`FLAG_EXACT`) says the client runs "exact" numerics (clear: "ds4" numerics). Both
  ends of a link must compute the same function, and the hello has no other room to say so; a
  worker refuses a client whose numerics differ from its own, with a refusal naming the field
  ("numerics"), the worker's value and the client's.
* A reply pads the top-k list with (NO_TOKEN, -inf) when fewer than `topk` logits are finite,
  and the final position's greedy id is NO_TOKEN when it has no finite logit at all (the other
  positions' ids are the backend's argmax).
* A chain vouches for itself: a middle stage answers a hello only after its own next stage's
  hello passed the checks the head applies (`check_next_stage`), so the head, which sees only
  the first worker, knows the chain reaches n_layer. A middle stage passes `topk` through to
  the last stage (the `answers_topk` of `check_header`); a stage that neither is last nor
  forwards refuses topk > 0.
* SAVE/LOAD statuses: see STATUS_TEXT. A snapshot index outside the worker's `--snapshots`
  is answered with a status, not a closed connection: it says nothing about framing.

The limits every length is checked against come from the `Hello` of the receiving stage; a frame
is fully validated against them (header first, then the token ids) before anything is allocated
from its lengths or applied to a slot. `read_frame` takes a `recv_exact(n)` callable so the same
code reads a socket and, in tests, a recording fake.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import auth, refusal, sniff
from .address import format_hostport
from .deadline import Deadline

MAGIC = 0x716B7036  # "qkp6"
REFUSAL_MAGIC = 0x716B7052  # "qkpR": a refusal in place of the worker's next hello record
FLAG_AUTH = 1 << 0
FLAG_EXACT = 1 << 1
KNOWN_FLAGS = FLAG_AUTH | FLAG_EXACT

EVAL, BYE, SAVE, LOAD, OPEN, FREE = 1, 2, 3, 4, 5, 6
OPS = {EVAL: "EVAL", BYE: "BYE", SAVE: "SAVE", LOAD: "LOAD", OPEN: "OPEN", FREE: "FREE"}
STATUS_OPS = (SAVE, LOAD, OPEN, FREE)  # the ops answered with one u32 status

TOPK_MAX = 256
TOPK_LOGITS = 0xFFFFFFFF  # EVAL's topk asking for the whole logits row of the final position
NO_TOKEN = 0xFFFFFFFF
NONCE_BYTES = auth.NONCE_BYTES
PROOF_BYTES = auth.PROOF_BYTES
PROTOCOL = struct.pack("<I", MAGIC)  # the auth proofs' protocol name: the magic as it travels

# Sanity bounds on a peer's hello, so that even a hostile hello cannot make the client size
# anything absurd (the client also requires every dimension to equal its own model's).
MAX_ROW_FLOATS = 1 << 22
MAX_FRAME_BYTES = 1 << 31
SMALL_SEND = 1 << 17
# A receive buffer starts at most this large and doubles as bytes arrive: a peer that announces
# a large frame and stalls costs this much, not the announced size.
GROW_FROM = 16 << 10

CLIENT_HELLO = struct.Struct("<II")
WORD = struct.Struct("<I")  # the first field of each of the worker's hello records
HELLO = struct.Struct("<10IQ")
HEADER = struct.Struct("<5I")
STATUS = struct.Struct("<I")
PAIR = np.dtype([("id", "<u4"), ("logit", "<f4")])

STATUS_OK = 0
STATUS_NO_SNAPSHOT = 1  # LOAD of an index nothing was saved to (or saved by another count)
STATUS_BAD_INDEX = 2  # index >= the worker's --snapshots
STATUS_COUNT_MISMATCH = 3  # the live token count is not what the slot holds
STATUS_DOWNSTREAM = 4  # a later stage answered with a non-zero status
STATUS_NO_SLOT = 5  # OPEN: every slot of the stage is held by some connection
STATUS_SLOT_NOT_OPEN = 6  # SAVE/LOAD/FREE of a slot this connection has not opened
STATUS_SNAPSHOTS_FULL = 7  # SAVE: every snapshot entry is held by other connections
STATUS_TEXT = {
    STATUS_OK: "ok",
    STATUS_NO_SNAPSHOT: "no such snapshot",
    STATUS_BAD_INDEX: "snapshot index out of range",
    STATUS_COUNT_MISMATCH: "live token count does not match the slot",
    STATUS_DOWNSTREAM: "a later stage refused",
    STATUS_NO_SLOT: "every slot is held by another connection",
    STATUS_SLOT_NOT_OPEN: "the slot is not open on this connection",
    STATUS_SNAPSHOTS_FULL: "every snapshot entry is held by other connections",
}


class QkpError(Exception):
    """A protocol violation; `field` names the offending field (for the log line)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class QkpClosed(QkpError):
    """The peer closed the connection (or it timed out) while a record was expected."""


class HelloRefused(QkpError):
    """The peer's hello does not fit this end (wrong model, range, sizes); says exactly why."""


class AuthRefused(QkpError):
    """The stage did not prove the shared token: nothing of the model was sent to it."""


class Refused(HelloRefused):
    """The stage sent a refusal record in place of its hello; `reason` is its text (which names
    the field, the stage's value and the client's)."""

    def __init__(self, reason: str):
        super().__init__("refused", reason)
        self.reason = reason


class TlsMismatch(HelloRefused):
    """One end speaks TLS, the other plain text."""


# ---- records --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """What a stage tells its client: its layers, the model's dimensions and its limits."""

    layer_first: int
    layer_end: int
    n_layer: int
    n_embd: int
    n_hc: int
    n_slots: int
    n_ctx: int
    n_vocab: int
    max_rows: int
    fingerprint: int  # first 8 bytes of the model fingerprint, little-endian

    @property
    def row_floats(self) -> int:
        return self.n_hc * self.n_embd

    @property
    def last(self) -> bool:
        return self.layer_end == self.n_layer

    def pack(self) -> bytes:
        return HELLO.pack(MAGIC, self.layer_first, self.layer_end, self.n_layer, self.n_embd,
                          self.n_hc, self.n_slots, self.n_ctx, self.n_vocab, self.max_rows,
                          self.fingerprint)

    @classmethod
    def unpack(cls, buf: bytes) -> "Hello":
        magic, *rest = HELLO.unpack(buf)
        if magic != MAGIC:
            raise QkpError("magic", f"expected {MAGIC:#010x} (qkp6), got {magic:#010x}")
        hello = cls(*rest)
        hello.check()
        return hello

    def check(self) -> None:
        """Internal consistency; raises QkpError naming the first bad field."""
        if not 0 <= self.layer_first < self.layer_end <= self.n_layer:
            raise QkpError("layer_first", f"expected 0 <= first < end <= n_layer, got "
                           f"{self.layer_first}:{self.layer_end} of {self.n_layer}")
        for name in ("n_embd", "n_hc", "n_slots", "n_ctx", "n_vocab", "max_rows"):
            if getattr(self, name) < 1:
                raise QkpError(name, f"expected at least 1, got {getattr(self, name)}")
        if self.row_floats > MAX_ROW_FLOATS:
            raise QkpError("n_embd", f"n_hc × n_embd = {self.row_floats} floats per row is over "
                           f"the limit {MAX_ROW_FLOATS}")
        if self.max_rows > self.n_ctx:
            raise QkpError("max_rows", f"expected at most n_ctx={self.n_ctx}, got {self.max_rows}")
        if self.max_rows * (4 + 4 * self.row_floats) > MAX_FRAME_BYTES:
            raise QkpError("max_rows", f"a frame of {self.max_rows} rows would be over "
                           f"{MAX_FRAME_BYTES} bytes")

    def request_bytes(self, h: "Header") -> int:
        """Payload bytes that follow a (validated) header."""
        return h.n * (4 + 4 * self.row_floats) if h.op == EVAL else 0

    def eval_reply_bytes(self, n: int, topk: int) -> int:
        """Reply to an EVAL from a stage that answers with ids (the last stage, or a chain)."""
        if topk == TOPK_LOGITS:
            return 4 * n + 4 * self.n_vocab
        return 4 * n + PAIR.itemsize * topk


@dataclass(frozen=True)
class Header:
    """Frame header. EVAL: `n` token ids then `n` rows for positions [base, base + n), `topk`
    what the reply carries (0, 1..TOPK_MAX pairs, or TOPK_LOGITS); SAVE/LOAD: `n` = snapshot
    index, `topk` = live token count; OPEN/FREE: only `slot`; BYE: nothing."""

    op: int
    slot: int
    n: int
    base: int
    topk: int

    def pack(self) -> bytes:
        return HEADER.pack(self.op, self.slot, self.n, self.base, self.topk)

    @classmethod
    def unpack(cls, buf: bytes) -> "Header":
        return cls(*HEADER.unpack(buf))


def check_header(h: Header, limits: Hello, *, answers_topk: bool) -> None:
    """Validate a header against the receiving stage's hello before reading its payload.

    `answers_topk`: the stage can honour topk > 0 (it is the last stage, or it forwards to one).
    """
    if h.op not in OPS:
        raise QkpError("op", f"expected one of {sorted(OPS)}, got {h.op}")
    if h.op == BYE:
        return
    if h.slot >= limits.n_slots:
        raise QkpError("slot", f"expected < {limits.n_slots}, got {h.slot}")
    if h.op == EVAL:
        if not 1 <= h.n <= limits.max_rows:
            raise QkpError("n", f"expected 1..{limits.max_rows} rows, got {h.n}")
        if h.base > limits.n_ctx - h.n:
            raise QkpError("base", f"positions {h.base}+{h.n} run past n_ctx={limits.n_ctx}")
        if h.topk > TOPK_MAX and h.topk != TOPK_LOGITS:
            raise QkpError("topk", f"expected at most {TOPK_MAX} or {TOPK_LOGITS:#x} (the logits "
                           f"row), got {h.topk}")
        if h.topk and not answers_topk:
            raise QkpError("topk", f"expected 0 on a stage that is not the last, got {h.topk}")
    elif h.op in (SAVE, LOAD):  # n: the snapshot index (answered by status), topk: token count
        if h.topk > limits.n_ctx:
            raise QkpError("topk", f"live token count {h.topk} is over n_ctx={limits.n_ctx}")


@dataclass
class Frame:
    header: Header
    tokens: np.ndarray | None = None  # uint32 [n]
    rows: np.ndarray | None = None  # float32 [n, n_hc, n_embd]


RecvExact = Callable[[int], bytes | bytearray | memoryview]


def read_frame(recv_exact: RecvExact, limits: Hello, *, answers_topk: bool,
               header: bytes | None = None) -> Frame:
    """Read one frame: the header (unless given), its checks, then exactly the payload the
    checks allowed, whose token ids are checked before the rows are read."""
    h = Header.unpack(bytes(recv_exact(HEADER.size) if header is None else header))
    check_header(h, limits, answers_topk=answers_topk)
    if h.op != EVAL:
        return Frame(h)
    tokens = np.frombuffer(recv_exact(4 * h.n), dtype="<u4")
    bad = np.flatnonzero(tokens >= limits.n_vocab)
    if bad.size:
        raise QkpError("tokens", f"token id {int(tokens[bad[0]])} at row {int(bad[0])} is not "
                       f"below n_vocab={limits.n_vocab}")
    rows = np.frombuffer(recv_exact(4 * h.n * limits.row_floats), dtype="<f4")
    return Frame(h, tokens, rows.reshape(h.n, limits.n_hc, limits.n_embd))


def pack_eval_reply(ids: np.ndarray, candidates: list[tuple[int, float]], topk: int,
                    logits: np.ndarray | None = None) -> bytes:
    """The last stage's EVAL reply: ids, then `topk` pairs, or (TOPK_LOGITS) the `logits` row."""
    if topk == TOPK_LOGITS:
        return np.asarray(ids, dtype="<u4").tobytes() + np.asarray(logits, dtype="<f4").tobytes()
    pairs = np.empty(topk, dtype=PAIR)
    pairs["id"] = NO_TOKEN
    pairs["logit"] = -np.inf
    for i, (tid, logit) in enumerate(candidates[:topk]):
        pairs[i] = (tid, logit)
    return np.asarray(ids, dtype="<u4").tobytes() + pairs.tobytes()


def unpack_eval_reply(buf: bytes, n: int, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids uint32 [n], pairs PAIR [topk]), or with TOPK_LOGITS (ids, logits float32
    [n_vocab]); `buf` is exactly eval_reply_bytes(n, topk)."""
    ids = np.frombuffer(buf, dtype="<u4", count=n)
    if topk == TOPK_LOGITS:
        return ids, np.frombuffer(buf, dtype="<f4", offset=4 * n)
    pairs = np.frombuffer(buf, dtype=PAIR, count=topk, offset=4 * n)
    return ids, pairs


# ---- hello and auth ---------------------------------------------------------------------------------


def client_handshake(conn: "Conn", token: str | None, exact: bool) -> Hello:
    """Send the client hello; with a token, exchange nonces and check the stage's proof before
    sending this end's. Returns the stage's validated hello. The whole exchange must finish
    within the connection's io timeout. Raises AuthRefused when the stage does not prove the
    token (nothing of the model has been sent then), Refused with the stage's reason when it
    refused this client."""
    deadline = Deadline(conn.timeout, f"the qkp hello with {conn.peer}")
    flags = (FLAG_AUTH if token else 0) | (FLAG_EXACT if exact else 0)
    if not token:
        conn.send(CLIENT_HELLO.pack(MAGIC, flags))
        return _read_hello(conn, deadline)
    me = auth.ClientAuth(token, PROTOCOL)
    conn.send(CLIENT_HELLO.pack(MAGIC, flags) + me.nonce)
    try:
        first = _first_word(conn, deadline)
        if WORD.unpack(first)[0] != MAGIC:
            raise AuthRefused("auth", f"{conn.peer} did not prove the auth token (it answered "
                              f"{first.hex()}, not a qkp6 stage's magic); nothing was sent to it")
        got = bytes(conn.recv_exact(NONCE_BYTES + PROOF_BYTES, deadline=deadline))
    except (QkpClosed, ConnectionError) as e:  # a reset: it closed with our nonce unread
        raise AuthRefused("auth", f"{conn.peer} did not prove the auth token ({e}); nothing "
                          "was sent to it. It may have another token, or not be a ds4 "
                          "pipe-worker of this version (qkp6)") from None
    try:
        me.check_server(got[:NONCE_BYTES], got[NONCE_BYTES:])
    except auth.AuthError as e:
        raise AuthRefused("auth", f"{conn.peer}: {e}; nothing was sent to it") from None
    conn.send(me.proof())
    return _read_hello(conn, deadline)


def _first_word(conn: "Conn", deadline: Deadline) -> bytes:
    """The first field of the stage's next hello record (its magic); Refused when the stage
    sent a refusal there, TlsMismatch when it speaks TLS to this plain end."""
    first = bytes(conn.recv_exact(WORD.size, deadline=deadline))
    if sniff.looks_like_tls(first):
        raise TlsMismatch("tls", sniff.tls_peer_reason(f"stage at {conn.peer}", "end"))
    if WORD.unpack(first)[0] == REFUSAL_MAGIC:
        try:
            reason = refusal.read_reason(lambda n: conn.recv_exact(n, deadline=deadline))
        except ValueError as e:
            raise QkpError("refusal", str(e)) from None
        raise Refused(reason)
    return first


def _read_hello(conn: "Conn", deadline: Deadline) -> Hello:
    first = _first_word(conn, deadline)
    return Hello.unpack(first + bytes(conn.recv_exact(HELLO.size - WORD.size, deadline=deadline)))


def read_client_hello(conn: "Conn", token: str | None, exact: bool) -> int:
    """The stage's half of the hello up to (not including) its reply: read the client hello,
    prove the token and check the client's proof, check the numerics, all within the
    connection's io timeout. Returns the client's flags; the caller then sends its `Hello` (a
    middle stage first makes sure its own next stage is there), or `refuse`s the client with
    the QkpError this raised."""
    deadline = Deadline(conn.timeout, f"the qkp hello from {conn.peer}")
    first = bytes(conn.recv_exact(CLIENT_HELLO.size, deadline=deadline))
    if sniff.looks_like_tls(first):  # (only a plain stage reads a ClientHello here)
        raise TlsMismatch("tls", sniff.tls_peer_reason("client", "stage"))
    magic, flags = CLIENT_HELLO.unpack(first)
    if magic != MAGIC:
        raise QkpError("magic", f"expected {MAGIC:#010x} (qkp6), got {magic:#010x}")
    if flags & ~KNOWN_FLAGS:
        raise QkpError("flags", f"unknown bits {flags & ~KNOWN_FLAGS:#x}")
    if flags & FLAG_AUTH and not token:
        raise QkpError("auth", "the client asks for an auth token and this stage has none "
                       "(--auth-token-file / DS4_WIRE_TOKEN)")
    if token and not flags & FLAG_AUTH:
        raise QkpError("auth", "this stage requires an auth token (--auth-token-file / "
                       "DS4_WIRE_TOKEN) and the client sent no proof")
    if token:
        me = auth.ServerAuth(token, PROTOCOL)
        client_nonce = bytes(conn.recv_exact(NONCE_BYTES, deadline=deadline))
        conn.send(WORD.pack(MAGIC) + me.nonce + me.proof(client_nonce))
        try:
            me.check_client(bytes(conn.recv_exact(PROOF_BYTES, deadline=deadline)))
        except auth.AuthError as e:
            raise QkpError("auth", str(e)) from None
    if bool(flags & FLAG_EXACT) != exact:
        raise QkpError("numerics", f"expected {numerics_name(exact)} (the stage's --numerics), "
                       f"got {numerics_name(bool(flags & FLAG_EXACT))} (the client's); every "
                       "stage and the head must run the same --numerics")
    return flags


def numerics_name(exact: bool) -> str:
    return "exact" if exact else "ds4"


def refusal_record(e: QkpError) -> bytes:
    return refusal.pack(REFUSAL_MAGIC, str(e))


def refuse(sock: socket.socket, e: QkpError) -> None:
    """Answer a client that will not be served with a refusal naming why (`e`), in place of the
    stage's next hello record; the caller closes the socket."""
    sniff.refuse(sock, refusal_record(e))


def check_next_stage(peer: Hello, *, layer_end: int, n_layer: int, n_embd: int, n_hc: int,
                     n_vocab: int, fingerprint: int, n_slots: int, n_ctx: int,
                     max_rows: int = 1) -> None:
    """The head's (and a middle stage's) rules for the stage after it; HelloRefused says why."""
    def refuse(field: str, msg: str):
        raise HelloRefused(field, msg)

    if peer.fingerprint != fingerprint:
        refuse("fingerprint", f"the next stage serves another model (fingerprint "
               f"{peer.fingerprint:016x}, this one {fingerprint:016x})")
    for name, ours in (("n_layer", n_layer), ("n_embd", n_embd), ("n_hc", n_hc), ("n_vocab", n_vocab)):
        if getattr(peer, name) != ours:
            refuse(name, f"the next stage has {name}={getattr(peer, name)}, this one {ours}")
    if peer.layer_first != layer_end:
        refuse("layer_first", f"the next stage runs layers {peer.layer_first}:{peer.layer_end}, "
               f"but this stage ends at layer {layer_end}: the ranges must be contiguous")
    if peer.n_slots < n_slots:
        refuse("n_slots", f"the next stage has {peer.n_slots} slots, fewer than the {n_slots} needed")
    if peer.n_ctx < n_ctx:
        refuse("n_ctx", f"the next stage has ctx {peer.n_ctx}, less than the {n_ctx} needed")
    if peer.max_rows < max_rows:
        refuse("max_rows", f"the next stage takes {peer.max_rows} rows a frame, fewer than "
               f"the {max_rows} needed")


# ---- sockets ------------------------------------------------------------------------------------------


class Conn:
    """A TCP (or TLS) connection whose every read has a deadline (a dead or trickling peer is an
    error, not a hang).

    The socket keeps one timeout (for sends); reads wait with poll() against their own deadline,
    so a reader and a writer thread may share the connection.
    """

    def __init__(self, sock: socket.socket, timeout: float, peer: str = "?"):
        self.sock = sock
        self.timeout = timeout
        self.peer = peer
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        self._tls = isinstance(sock, ssl.SSLSocket)
        # A peer that proved the token gets whole buffers at once; any other one only as much
        # as it has sent (a buffer that doubles from GROW_FROM).
        self.trusted = False
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float, connect_timeout: float | None = None,
                tls: ssl.SSLContext | None = None) -> "Conn":
        sock = socket.create_connection((host, port), timeout=connect_timeout or timeout)
        if tls is not None:
            try:
                sock = sniff.wrap_client(tls, sock, host, f"the stage at {format_hostport(host, port)}")
            except BaseException:
                sock.close()
                raise
        return cls(sock, timeout, format_hostport(host, port))

    def _readable(self, left: float) -> bool:
        if self._tls and self.sock.pending():  # decrypted bytes poll() cannot see
            return True
        return bool(self._poll.poll(max(1, int(left * 1000))))

    def recv_exact(self, n: int, timeout: float | None = None,
                   deadline: Deadline | None = None) -> bytearray:
        """Exactly n bytes, all of them within `timeout` (default: the connection's) and before
        `deadline` when one is given. The buffer grows as bytes arrive (from `GROW_FROM`)."""
        limit = Deadline(self.timeout if timeout is None else timeout)
        if deadline is not None and deadline.at < limit.at:
            limit = deadline
        buf = bytearray(n if self.trusted else min(n, GROW_FROM))
        got = 0
        while got < n:
            left = limit.left()
            if left <= 0 or not self._readable(left):
                if not limit.expired:
                    continue
                raise QkpClosed("timeout", f"no data from {self.peer} within the "
                                + ("deadline" if limit is deadline else "timeout")
                                + (f" ({got} of {n} bytes came)" if got else ""))
            if got == len(buf):  # full: double it (never past n)
                buf += bytes(min(n, 2 * len(buf)) - len(buf))
            with memoryview(buf) as whole, whole[got:] as view:
                k = self.sock.recv_into(view)
            if k == 0:
                raise QkpClosed("eof", f"{self.peer} closed the connection"
                                + (f" after {got} of {n} bytes" if got else ""))
            got += k
        return buf

    def send(self, *parts) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        if len(views) > 1 and sum(v.nbytes for v in views) <= SMALL_SEND:
            self.sock.sendall(b"".join(views))  # one segment for header + small payload
        else:
            for v in views:
                self.sock.sendall(v)

    def closed_by_peer(self) -> bool:
        """True when the peer closed (or sent something unasked) while we expect nothing."""
        try:
            return bool(self._poll.poll(0))  # EOF, a reset, or bytes nobody asked for
        except (OSError, ValueError):
            return True

    def shutdown(self) -> None:
        """Wake any thread blocked on this connection; close() follows."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        self.shutdown()
        self.sock.close()
