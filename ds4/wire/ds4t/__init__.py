"""DS4T: the two-rank tensor-parallel wire (shared/spec/wire.md §2).

The leader (rank 0) mirrors every session call to the worker (rank 1) on a **control**
connection; inside each layer the two ranks swap their partial sublayer outputs on a **data**
connection and both add `partial_rank0 + partial_rank1`, in that order. This package is the
protocol only: records, limits, checks and the two channels; it touches no tensors of the model.

Connections: the leader listens, the worker dials twice; the first accepted connection is
control, the second data. On each, both ends send their `Hello` at once and read the peer's.
Everything is little-endian and fixed-layout; offsets in bytes.

Hello (72 bytes, both directions; a leader may send a refusal in its place, see below):

    0  u32 magic 0x44533454 ("DS4T")   36  u32 n_expert
    4  u32 version (1)                  40  u32 n_head
    8  u32 role (0 leader, 1 worker)    44  u32 ctx
   12  u32 flags (bit0 AUTH,            48  u32 gates_per_token (= 2 × n_layer)
       bit1 DEBUG_HASH, bit2 TORCH_GATES,
       bit3 EXACT numerics)
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

Refusal: `{u32 magic 0x44533452 ("DS4R"), u32 reason_bytes}` + reason (UTF-8, at most 4 KiB,
`ds4.wire.refusal`), sent by a leader in place of its hello, after which it closes. A leader
that requires TLS peeks at a new connection's first bytes before its TLS handshake
(`ds4.wire.sniff`) and refuses so a worker that connected in plain text (its hello's first
bytes are not a TLS handshake record), so that the worker fails at once with the leader's
reason instead of retrying a closed connection. The hello's first field is its magic, so the
worker tells the two apart by the first four bytes. A plain end whose peer's first bytes are a
TLS record (a TLS worker's ClientHello) fails with `TlsMismatch`; a TLS worker that gets a plain
hello where the ServerHello belongs says that the leader runs without TLS.

Version: the refusal came into version 1 without a version bump (the hello, proofs and frames
are unchanged, and only a leader that refuses sends it). A worker reads the refusal only as the
worker; a leader reads "DS4R" from a peer as a bad magic, logs it and waits on. A worker of an
older ds4 that meets a refusal fails with DS4TError field "magic" ("expected 0x44533454 (DS4T
hello), got 0x44533452"; it reads 72 bytes first, so a refusal shorter than a hello reads as
a closed connection) instead of the leader's reason: the leader's log says why.

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
   13  SESSION_CREATE   u64 session, u32 ctx, u32 prefill_cap       (1 ≤ ctx ≤ agreed ctx,
                                                                     1 ≤ cap ≤ min(ctx, max_rows))
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
  handshake the leader sends a 24-byte store record `{u32 store_port, u32 record version 2,
  16-byte key prefix}` (`ds4.tp.link`): the port of the `torch.distributed` TCPStore it opened on
  its own address, where the worker joins as rank 1, and the prefix its keys live under (known
  only to the authenticated pair). Both ends must set it alike.
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

The code, one part per job (this package re-exports every name, so `from ds4.wire import ds4t;
ds4t.Hello` works): `base` (constants, structs, errors), `hello` (the hello record, `check_peer`,
`vocab_part`), `frames` (frame types, `Limits`, the control frames and their pack / read),
`channels` (`recv_exact`, `ControlChannel`, `handshake`, `mutual_auth`) and `gates` (gate
records, `GateChannel`, `reduce_in_rank_order`).
"""

from __future__ import annotations

from ...core.tp_split import Gate
from .base import (DEFAULT_GATE_TIMEOUT_MS, F32, FLAG_AUTH, FLAG_DEBUG_HASH, FLAG_EXACT, FLAG_TORCH_GATES,
                   FRAME_HEADER, FRAME_MAGIC, GATE_HEADER, GATE_MAGIC, GATES_PER_LAYER, HELLO,
                   KNOWN_FLAGS, MAGIC, MAX_CTX, MAX_EMBD, MAX_LAYERS, MAX_SLAB_BYTES, MAX_SPLIT_DIM,
                   MAX_VOCAB, N_RANK, PROTOCOL, REFUSAL_MAGIC, U32, VERSION, DS4TClosed, DS4TError,
                   GateDesync, GateTimeout, HelloRefused, PeerRefused, TlsMismatch)
from .hello import _MUST_MATCH, Backend, Hello, Role, check_peer, vocab_part
from .frames import (_VARIABLE, FRAME_TYPES, SENT_BY, AckStatus, CommandAck, Eval, Frame,
                     FrameType, Hash, Invalidate, Limits, Logits, RecvExact, Rewind, SessionCreate,
                     SessionDestroy, State, Stop, Sync, _check_token, _Fixed, check_frame_header,
                     pack_frame, read_frame, unpack_frame)
from .channels import (ControlChannel, _tls_pending, handshake, mutual_auth, recv_exact,
                       refusal_record)
from .gates import GateChannel, GateHeader, check_gate_header, reduce_in_rank_order

__all__ = [
    "Gate",
    # base
    "MAGIC", "FRAME_MAGIC", "GATE_MAGIC", "REFUSAL_MAGIC", "VERSION", "FLAG_AUTH", "FLAG_DEBUG_HASH",
    "FLAG_TORCH_GATES", "FLAG_EXACT", "PROTOCOL", "KNOWN_FLAGS", "N_RANK", "GATES_PER_LAYER",
    "DEFAULT_GATE_TIMEOUT_MS", "MAX_LAYERS", "MAX_EMBD", "MAX_VOCAB", "MAX_CTX", "MAX_SPLIT_DIM",
    "MAX_SLAB_BYTES", "HELLO", "FRAME_HEADER", "GATE_HEADER", "F32", "U32", "DS4TError",
    "DS4TClosed", "GateTimeout", "GateDesync", "HelloRefused", "PeerRefused", "TlsMismatch",
    # hello
    "Role", "Backend", "Hello", "check_peer", "vocab_part",
    # frames
    "FrameType", "SENT_BY", "AckStatus", "Limits", "Sync", "Eval", "Rewind", "SessionCreate",
    "Invalidate", "SessionDestroy", "Stop", "Hash", "CommandAck", "Logits", "State", "Frame",
    "FRAME_TYPES", "pack_frame", "check_frame_header", "RecvExact", "read_frame", "unpack_frame",
    # channels
    "recv_exact", "ControlChannel", "mutual_auth", "handshake", "refusal_record",
    # gates
    "GateHeader", "check_gate_header", "reduce_in_rank_order", "GateChannel",
]
# the private names of the single module this package was, for the tests that reach into them
__all__ += ["_MUST_MATCH", "_check_token", "_Fixed", "_VARIABLE", "_tls_pending"]
