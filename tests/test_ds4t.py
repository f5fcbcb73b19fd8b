"""DS4T records (wire.md §2): byte layouts written out by hand from ds4/wire/ds4t/__init__.py's docstring,
round trips, hostile and truncated bytes (only DS4TError, lengths refused before payloads are
read), gate desync and stalled peers over real socketpairs, and the hello handshake.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.wire import ds4t

FP = 0x1122334455667788
LEADER = ds4t.Hello.for_model(ds4t.Role.LEADER, fingerprint=FP, n_layer=4, n_embd=64,
                              n_vocab=1001, n_expert=8, n_head=4, ctx=128, auth=True)
WORKER = dataclasses.replace(LEADER, role=ds4t.Role.WORKER, rank=1, ctx=4096)
LIMITS = ds4t.Limits.from_hello(LEADER, max_rows=16)
SMALL = ds4t.Limits(n_layer=4, n_embd=64, n_vocab=5, ctx=128, max_rows=16)  # LOGITS: rows 2..4
STATEFUL = dataclasses.replace(LIMITS, max_state_bytes=5)  # STATE payloads of up to 5 bytes
U32 = 0xFFFFFFFF
PROPS = settings(max_examples=150, deadline=None, derandomize=True)
FEW = settings(max_examples=25, deadline=None, derandomize=True)
SLACK = 0.5  # scheduling slack on a loaded 2-core machine


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


# ---- byte layouts, by hand from the docstring -------------------------------------------------------

HELLO_BYTES = h(
    "54345344 01000000 00000000 01000000"  # magic "DS4T", version 1, role leader, flags AUTH
    "8877665544332211"  # fingerprint
    "04000000 40000000 e9030000 08000000"  # n_layer 4, n_embd 64, n_vocab 1001, n_expert 8
    "04000000 80000000 08000000 02000000"  # n_head 4, ctx 128, gates_per_token 8, n_rank 2
    "00000000 00000000 0000000000000000")  # rank 0, backend 0 (reference), reserved

FRAMES = [  # (frame, limits, bytes): header {magic "DS4C", type, bytes} + payload
    (ds4t.Sync(5, np.array([1, 1000])), LIMITS,
     h("43345344 01000000 14000000 0500000000000000 02000000 01000000 e8030000")),
    (ds4t.Eval(0x0102, 7, 1000), LIMITS,
     h("43345344 02000000 14000000 0201000000000000 0700000000000000 e8030000")),
    (ds4t.Rewind(5, 128), LIMITS, h("43345344 03000000 0c000000 0500000000000000 80000000")),
    (ds4t.Invalidate(5), LIMITS, h("43345344 04000000 08000000 0500000000000000")),
    (ds4t.Stop(), LIMITS, h("43345344 05000000 00000000")),
    (ds4t.Hash(3, 0xDEADBEEF00000001), LIMITS,
     h("43345344 06000000 10000000 0300000000000000 01000000efbeadde")),
    (ds4t.Logits(2, np.array([1.0, -2.0, 0.5])), SMALL,
     h("43345344 0a000000 14000000 02000000 03000000 0000803f 000000c0 0000003f")),
    (ds4t.SessionCreate(9, 64, 16), LIMITS,
     h("43345344 0d000000 10000000 0900000000000000 40000000 10000000")),
    (ds4t.SessionDestroy(9), LIMITS, h("43345344 0e000000 08000000 0900000000000000")),
    (ds4t.CommandAck(9, ds4t.AckStatus.FAILED), LIMITS,
     h("43345344 11000000 0c000000 0900000000000000 ffffffff")),
    (ds4t.State(9, b"\x01\x02\x03"), STATEFUL, h("43345344 19000000 0b000000 0900000000000000 010203")),
]

GATE_BYTES = h("47345344 0300 0100 0807060504030201 02000000 0100 0000")  # "DS4G", layer 3, FFN, …
GATE = ds4t.GateHeader(3, ds4t.Gate.FFN, 0x0102030405060708, 2, 1)


def same_frame(a, b) -> bool:
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not np.array_equal(np.asarray(x, np.float64), np.asarray(y, np.float64)):
                return False
        elif x != y:
            return False
    return True


def test_hello_layout_and_round_trip():
    assert len(HELLO_BYTES) == 72 and LEADER.pack() == HELLO_BYTES
    assert ds4t.Hello.unpack(HELLO_BYTES) == LEADER
    assert ds4t.Hello.unpack(WORKER.pack()) == WORKER


@pytest.mark.parametrize("frame,limits,wire", FRAMES, ids=[type(f[0]).__name__ for f in FRAMES])
def test_frame_layout_and_round_trip(frame, limits, wire):
    assert ds4t.pack_frame(frame) == wire
    assert same_frame(ds4t.unpack_frame(wire, limits), frame)
    rec = Recorder(wire)
    assert same_frame(ds4t.read_frame(rec, limits), frame) and rec.pos == len(wire)


def test_session_create_bounds_the_prefill_cap():
    with pytest.raises(ds4t.DS4TError, match="prefill_cap: SESSION_CREATE prefill_cap expected 1..8"):
        ds4t.unpack_frame(ds4t.pack_frame(ds4t.SessionCreate(1, 8, 9)), LIMITS)  # (ctx 8)
    with pytest.raises(ds4t.DS4TError, match="expected 1..16"):  # (the bulk gate bound)
        ds4t.unpack_frame(ds4t.pack_frame(ds4t.SessionCreate(1, 64, 17)), LIMITS)


def test_state_is_bounded_by_this_ends_limit():
    frame = ds4t.pack_frame(ds4t.State(9, bytes(6)))
    with pytest.raises(ds4t.DS4TError, match="STATE expected 9..13 bytes"):
        ds4t.unpack_frame(frame, STATEFUL)
    with pytest.raises(ds4t.DS4TError, match="STATE expected"):  # no bound: no STATE at all
        ds4t.unpack_frame(ds4t.pack_frame(ds4t.State(9, b"x")), LIMITS)


def test_debug_hash_is_the_leaders_choice():
    worker = dataclasses.replace(WORKER, flags=WORKER.flags | ds4t.FLAG_DEBUG_HASH)
    assert ds4t.check_peer(LEADER, worker) == LEADER.ctx
    assert ds4t.Hello.unpack(worker.pack()) == worker


def test_every_type_has_a_layout_and_a_sender():
    assert {type(f) for f, _, _ in FRAMES} == set(ds4t.FRAME_TYPES.values())
    assert set().union(*ds4t.SENT_BY.values()) == set(ds4t.FrameType)


def test_hash_frames_go_from_the_worker_only():
    """The leader compares the worker's hidden-state hashes with its own and sends none: a HASH
    from the leader is refused at its header, naming the type, before a handler sees it."""
    frame = ds4t.pack_frame(ds4t.Hash(3, 0xABCD))
    assert ds4t.check_frame_header(frame[:ds4t.FRAME_HEADER.size], LIMITS, ds4t.Role.WORKER)[0] == \
        ds4t.FrameType.HASH
    with pytest.raises(ds4t.DS4TError, match="HASH is not a frame a leader sends") as e:
        ds4t.check_frame_header(frame[:ds4t.FRAME_HEADER.size], LIMITS, ds4t.Role.LEADER)
    assert e.value.field == "type"


def test_hello_for_a_gguf(tmp_path):
    # The fields come from gguf-py's reader and the fingerprint from hashlib over the file's
    # metadata section and tensor directory plus its size (wire.md), not from ds4's own code.
    import hashlib

    from gguf import GGUFReader

    from ds4.core.gguf_model import GGUFModel
    from ds4.core.tiny import make_tiny

    path = make_tiny(tmp_path / "test.gguf", preset="test", seed=1)
    hello = ds4t.Hello.for_gguf(GGUFModel(path), ds4t.Role.WORKER, ctx=256)
    reader = GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    digest = hashlib.sha256(path.read_bytes()[:reader.data_offset]
                            + path.stat().st_size.to_bytes(8, "little")).digest()
    assert hello.fingerprint == int.from_bytes(digest[:8], "little")
    assert (hello.n_layer, hello.n_embd, hello.n_expert, hello.n_head) == (
        meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"],
        meta[f"{arch}.expert_count"], meta[f"{arch}.attention.head_count"])
    assert hello.n_vocab == meta[f"{arch}.vocab_size"]
    assert (hello.role, hello.rank, hello.ctx, hello.gates_per_token) == (1, 1, 256, 2 * hello.n_layer)


def test_gate_header_layout():
    assert GATE.pack() == GATE_BYTES and ds4t.GateHeader.unpack(GATE_BYTES) == GATE


def test_limits_from_the_hello():
    assert (LIMITS.ctx, LIMITS.max_rows, LIMITS.n_embd) == (128, 16, 64)
    assert LIMITS.max_frame_bytes(ds4t.FrameType.SYNC) == 12 + 4 * 128
    assert LIMITS.worker_vocab_parts() == {500: 501}  # rank 1 holds rows 500..1000
    assert LIMITS.max_frame_bytes(ds4t.FrameType.LOGITS) == 8 + 4 * 501
    assert LIMITS.slab_bytes(16) == 16 * 64 * 4
    for max_rows in (0, 129):
        with pytest.raises(ds4t.DS4TError, match="max_rows"):
            ds4t.Limits.from_hello(LEADER, max_rows=max_rows)


def test_vocab_parts_cover_the_vocabulary():
    for n_vocab, n_rank in ((1001, 2), (1000, 2), (7, 3), (129280, 4)):
        parts = [ds4t.vocab_part(n_vocab, n_rank, r) for r in range(n_rank)]
        assert parts[0][0] == 0 and sum(c for _, c in parts) == n_vocab
        assert all(f + c == nf for (f, c), (nf, _) in zip(parts, parts[1:]))


def test_reduce_is_in_rank_order():
    # In f32, (1e8 + 1) - 1e8 is 0 while (1e8 - 1e8) + 1 is 1: the order is observable.
    p = [np.float32([1e8]), np.float32([1.0]), np.float32([-1e8])]
    assert ds4t.reduce_in_rank_order(p)[0] == 0.0
    assert ds4t.reduce_in_rank_order([p[0], p[2], p[1]])[0] == 1.0


# ---- hello checks --------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,name", [
    ("version", 2, "version"), ("n_layer", 0, "n_layer"), ("n_embd", 1 << 17, "n_embd"),
    ("ctx", 0, "ctx"), ("gates_per_token", 7, "gates_per_token"), ("n_rank", 3, "n_rank"),
    ("rank", 1, "rank"), ("n_expert", 9, "n_expert"), ("n_head", 5, "n_head"),
    ("flags", 16, "flags"),  # (bits 0-3 are AUTH, DEBUG_HASH, TORCH_GATES, EXACT; bit 4 unknown)
])
def test_hello_consistency_names_the_field(field, value, name):
    with pytest.raises(ds4t.DS4TError) as e:
        ds4t.Hello.unpack(dataclasses.replace(LEADER, **{field: value}).pack())
    assert e.value.field == name


@pytest.mark.parametrize("offset,field", [(0, "magic"), (8, "role"), (60, "backend"), (64, "reserved"),
                                          (68, "reserved")])
def test_hello_bad_bytes_name_the_field(offset, field):
    buf = bytearray(HELLO_BYTES)
    buf[offset] ^= 0x40
    with pytest.raises(ds4t.DS4TError) as e:
        ds4t.Hello.unpack(bytes(buf))
    assert e.value.field == field


@pytest.mark.parametrize("field,value", [
    ("fingerprint", FP ^ 1), ("n_layer", 5), ("n_embd", 128), ("n_vocab", 1000),
    ("n_expert", 16), ("n_head", 8), ("flags", 0),
])
def test_check_peer_names_the_field_and_both_values(field, value):
    other = dataclasses.replace(WORKER, **{field: value})
    if field == "n_layer":
        other = dataclasses.replace(other, gates_per_token=2 * value)
    with pytest.raises(ds4t.HelloRefused) as e:
        ds4t.check_peer(LEADER, other)
    assert e.value.field == field
    shown = (lambda v: f"{v:016x}") if field == "fingerprint" else str
    assert shown(getattr(LEADER, field)) in str(e.value) and shown(value) in str(e.value)


def test_check_peer_roles_and_ctx():
    assert ds4t.check_peer(LEADER, WORKER) == 128  # the worker adopts the leader's ctx
    assert ds4t.check_peer(WORKER, LEADER) == 128
    with pytest.raises(ds4t.HelloRefused, match="roles must differ") as e:
        ds4t.check_peer(LEADER, LEADER)
    assert e.value.field == "role"


@PROPS
@given(st.binary(min_size=68, max_size=68))
def test_any_hello_is_refused_or_consistent(rest):
    try:
        hello = ds4t.Hello.unpack(HELLO_BYTES[:4] + rest)
    except ds4t.DS4TError:
        return
    hello.check()
    assert hello.gates_per_token == 2 * hello.n_layer and hello.rank == hello.role
    assert 1 <= hello.ctx <= ds4t.MAX_CTX and 1 <= hello.n_embd <= ds4t.MAX_EMBD


@PROPS
@given(st.integers(0, 200))
def test_a_hello_of_the_wrong_length_is_refused(n):
    buf = (HELLO_BYTES * 3)[:n]
    if n == 72:
        return
    with pytest.raises(ds4t.DS4TError) as e:
        ds4t.Hello.unpack(buf)
    assert e.value.field == "hello"


# ---- hostile and truncated frames ----------------------------------------------------------------


class Recorder:
    """A recv_exact that serves `data` and records every size asked for."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.asked = data, 0, []

    def __call__(self, n: int) -> bytes:
        self.asked.append(n)
        if self.pos + n > len(self.data):
            raise ds4t.DS4TClosed("eof", "short")
        out = self.data[self.pos: self.pos + n]
        self.pos += n
        return out


MAX_PAYLOAD = max(LIMITS.max_frame_bytes(t) for t in ds4t.FrameType)
word = st.one_of(st.integers(0, U32), st.sampled_from([0, 1, 4, 8, 12, 16, 20, 24, 524, 525, 2012,
                                                       1 << 31, U32]))
ftype = st.one_of(st.sampled_from([int(t) for t in ds4t.FrameType] + [7, 8, 11, 24, 0]),
                  st.integers(0, U32))


@PROPS
@given(ftype, word, st.binary(max_size=64))
def test_reader_never_asks_past_the_limits(t, nbytes, tail):
    header = h("43345344") + t.to_bytes(4, "little") + nbytes.to_bytes(4, "little")
    rec = Recorder(header + tail + bytes(MAX_PAYLOAD))
    try:
        ds4t.check_frame_header(header, LIMITS)
        valid = True
    except ds4t.DS4TError:
        valid = False
    try:
        ds4t.read_frame(rec, LIMITS)
    except ds4t.DS4TError:
        pass
    assert rec.asked[0] == 12
    if not valid:  # refused on the header alone: not a payload byte was asked for
        assert rec.asked == [12]
    else:
        assert rec.asked == [12, nbytes] if nbytes else rec.asked == [12]
        assert nbytes <= LIMITS.max_frame_bytes(ds4t.FrameType(t))


frames = st.one_of(
    st.builds(ds4t.Sync, st.integers(0, 2**64 - 1),
              st.lists(st.integers(0, 1000), max_size=128).map(lambda v: np.array(v, np.uint32))),
    st.builds(ds4t.Eval, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 1000)),
    st.builds(ds4t.Rewind, st.integers(0, 2**64 - 1), st.integers(0, 128)),
    st.builds(ds4t.Invalidate, st.integers(0, 2**64 - 1)),
    st.builds(ds4t.Stop),
    st.builds(ds4t.Hash, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    st.builds(ds4t.Logits, st.just(500), st.integers(0, 2**32 - 1).map(
        lambda seed: np.random.default_rng(seed).standard_normal(501, dtype=np.float32))),
    st.integers(1, 128).flatmap(lambda ctx: st.builds(
        ds4t.SessionCreate, st.integers(0, 2**64 - 1), st.just(ctx), st.integers(1, min(ctx, 16)))),
    st.builds(ds4t.SessionDestroy, st.integers(0, 2**64 - 1)),
    st.builds(ds4t.CommandAck, st.integers(0, 2**64 - 1), st.sampled_from(list(ds4t.AckStatus))),
)


@PROPS
@given(frames, st.data())
def test_frames_round_trip_and_refuse_truncation(frame, data):
    wire = ds4t.pack_frame(frame)
    assert same_frame(ds4t.unpack_frame(wire, LIMITS), frame)
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(ds4t.DS4TError):
        ds4t.unpack_frame(wire[:cut], LIMITS)
    with pytest.raises(ds4t.DS4TError):
        ds4t.read_frame(Recorder(wire[:cut]), LIMITS)
    with pytest.raises(ds4t.DS4TError, match="bytes"):
        ds4t.unpack_frame(wire + b"\0", LIMITS)


@PROPS
@given(frames, st.data())
def test_mutated_frames_are_refused_or_decoded_within_limits(frame, data):
    wire = bytearray(ds4t.pack_frame(frame))
    for _ in range(data.draw(st.integers(1, 4))):
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    try:
        got = ds4t.unpack_frame(bytes(wire), LIMITS)
    except ds4t.DS4TError:
        return
    if isinstance(got, ds4t.Sync):
        assert got.tokens.size <= LIMITS.ctx and (got.tokens < LIMITS.n_vocab).all()
    elif isinstance(got, ds4t.Logits):
        assert (got.vocab_first, got.logits.size) == (500, 501)
    elif isinstance(got, ds4t.Eval):
        assert got.token < LIMITS.n_vocab
    elif isinstance(got, (ds4t.Rewind, ds4t.SessionCreate)):
        assert getattr(got, "pos", getattr(got, "ctx", 0)) <= LIMITS.ctx
        assert getattr(got, "prefill_cap", 1) <= min(getattr(got, "ctx", 1), LIMITS.max_rows)


@pytest.mark.parametrize("wire,field", [
    (h("43345344 01000000 0c000000 0500000000000000 01000000"), "count"),  # says 1, holds 0
    (h("43345344 01000000 10000000 0500000000000000 01000000 e9030000"), "token"),  # 1001
    (h("43345344 01000000") + (12 + 4 * 129).to_bytes(4, "little"), "bytes"),  # > ctx tokens
    (h("43345344 01000000 0e000000"), "bytes"),  # not 12 + 4n
    (h("43345344 02000000 14000000 0000000000000000 0000000000000000 e9030000"), "token"),
    (h("43345344 03000000 0c000000 0000000000000000 81000000"), "pos"),
    (h("43345344 0d000000 10000000 0000000000000000 00000000 01000000"), "ctx"),
    (h("43345344 0d000000 10000000 0000000000000000 81000000 01000000"), "ctx"),
    (h("43345344 0d000000 10000000 0000000000000000 40000000 00000000"), "prefill_cap"),
    (h("43345344 11000000 0c000000 0000000000000000 02000000"), "status"),
    (h("43345344 0a000000 14000000 00000000 03000000") + bytes(12), "vocab_first"),
    (h("43345344 0a000000 14000000 f4010000 03000000") + bytes(12), "count"),  # the part from 500 has 501
    (h("43345344 05000000 04000000 00000000"), "bytes"),
    (h("43345344 07000000 00000000"), "type"),  # RDMA_INFO: not DS4
    (h("54345344 05000000 00000000"), "magic"),  # a hello's magic
    (h("47345344 05000000 00000000"), "magic"),  # a gate record's magic
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_frames_name_the_field(wire, field):
    limits = SMALL if field == "vocab_first" else LIMITS
    with pytest.raises(ds4t.DS4TError) as e:
        ds4t.unpack_frame(wire, limits)
    assert e.value.field == field


@PROPS
@given(st.binary(min_size=0, max_size=30))
def test_any_gate_header_is_refused_or_valid(buf):
    try:
        got = ds4t.GateHeader.unpack(h("47345344") + buf)
    except ds4t.DS4TError:
        return
    assert len(buf) == 20 and got.gate in tuple(ds4t.Gate) and got.pack() == h("47345344") + buf


# ---- gate exchange over socketpairs --------------------------------------------------------------


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _rows(seed: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, LIMITS.n_embd), dtype=np.float32)


def _both(fa, fb):
    """Run fb in a thread and fa here; -> (result or exception of fa, of fb)."""
    out = {}

    def run(key, f):
        try:
            out[key] = f()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[key] = e

    t = threading.Thread(target=run, args=("b", fb))
    t.start()
    run("a", fa)
    t.join(10)
    assert not t.is_alive()
    return out["a"], out["b"]


def test_gate_sum_is_bit_identical_on_both_ranks(pair):
    leader = ds4t.GateChannel(pair[0], LIMITS, 0, 1, gate_timeout_ms=5000)
    worker = ds4t.GateChannel(pair[1], LIMITS, 1, 0, gate_timeout_ms=5000)
    for seq, (layer, gate, rows) in enumerate([(0, ds4t.Gate.ATTN, 1), (0, ds4t.Gate.FFN, 1),
                                               (3, ds4t.Gate.FFN, 16)], start=1):
        p0, p1 = _rows(seq, rows), _rows(100 + seq, rows)
        s0, s1 = _both(lambda: leader.all_reduce(layer, gate, seq, p0),
                       lambda: worker.all_reduce(layer, gate, seq, p1))
        assert s0.tobytes() == s1.tobytes() == (p0 + p1).tobytes()


def test_bulk_slab_larger_than_the_socket_buffers(pair):
    limits = ds4t.Limits(n_layer=4, n_embd=4096, n_vocab=1001, ctx=512, max_rows=256)
    leader = ds4t.GateChannel(pair[0], limits, 0, 1, gate_timeout_ms=10000)
    worker = ds4t.GateChannel(pair[1], limits, 1, 0, gate_timeout_ms=10000)
    rng = np.random.default_rng(7)
    p0, p1 = (rng.standard_normal((256, 4096), dtype=np.float32) for _ in range(2))  # 4 MiB each
    r0, r1 = _both(lambda: leader.exchange(2, ds4t.Gate.ATTN, 1, p0),
                   lambda: worker.exchange(2, ds4t.Gate.ATTN, 1, p1))
    assert np.array_equal(r0, p1) and np.array_equal(r1, p0)


@pytest.mark.parametrize("field,change", [
    ("layer", dict(layer=2)), ("gate", dict(gate=ds4t.Gate.ATTN)), ("seq", dict(seq=8)),
    ("rows", dict(rows=2)), ("rank", dict(rank=0)),
])
def test_gate_desync_names_expected_and_actual(pair, field, change):
    me = ds4t.GateChannel(pair[0], LIMITS, 0, 1, gate_timeout_ms=2000)
    sent = dataclasses.replace(ds4t.GateHeader(3, ds4t.Gate.FFN, 7, 1, 1), **change)
    payload = _rows(1, sent.rows).tobytes()
    pair[1].sendall(sent.pack() + payload)  # the peer's record waits in the buffer
    with pytest.raises(ds4t.GateDesync) as e:
        me.exchange(3, ds4t.Gate.FFN, 7, _rows(2))
    assert e.value.field == field
    assert "expected layer 3 FFN seq 7 (1 rows, rank 1)" in str(e.value)
    assert f"sent {sent.describe()}" in str(e.value)
    pair[1].settimeout(1)
    # refused on the header: the whole payload is still unread on our side
    pair[0].setblocking(True)
    pair[0].settimeout(1)
    assert pair[0].recv(len(payload) + 1, socket.MSG_PEEK) == payload
    with pytest.raises(ds4t.DS4TError, match="already failed"):  # the channel stays failed
        me.exchange(3, ds4t.Gate.FFN, 8, _rows(2))


PARTIAL_GATES = [ds4t.Gate.ATTN, ds4t.Gate.FFN]  # (n_embd wide; HIDDEN and ROUTE below)


def test_canonical_records_have_their_own_widths():
    lim = dataclasses.replace(LIMITS, n_hc=4, n_route=6)
    assert [lim.width(g) for g in ds4t.Gate] == [64, 64, 4 * 64, 2 * 6]
    a, b = socket.socketpair()
    try:
        me, peer = (ds4t.GateChannel(s, lim, r, 1 - r, gate_timeout_ms=2000) for r, s in ((0, a), (1, b)))
        with pytest.raises(ValueError, match=r"expected \[1..16, 12\]"):
            me.exchange(0, ds4t.Gate.ROUTE, 1, _rows(0, 1))
        mine = np.arange(12, dtype=np.float32).reshape(1, 12)
        out = {}
        t = threading.Thread(target=lambda: out.update(p=peer.exchange(0, ds4t.Gate.ROUTE, 1, -mine)))
        t.start()
        got = me.exchange(0, ds4t.Gate.ROUTE, 1, mine)
        t.join()
        assert np.array_equal(got, -mine) and np.array_equal(out["p"], mine)
    finally:
        a.close()
        b.close()


@FEW
@given(st.integers(0, 3), st.sampled_from(PARTIAL_GATES), st.integers(1, 2**64 - 1),
       st.integers(1, 16), st.integers(0, 3), st.sampled_from(PARTIAL_GATES),
       st.integers(1, 2**64 - 1), st.integers(1, 16))
def test_any_mismatch_is_a_desync_never_a_sum(layer, gate, seq, rows, layer2, gate2, seq2, rows2):
    a, b = socket.socketpair()
    try:
        me = ds4t.GateChannel(a, LIMITS, 0, 1, gate_timeout_ms=2000)
        theirs = ds4t.GateHeader(layer2, gate2, seq2, rows2, 1)
        b.sendall(theirs.pack() + bytes(4 * LIMITS.n_embd * rows2))
        same = (layer, gate, seq, rows) == (layer2, gate2, seq2, rows2)
        try:
            got = me.exchange(layer, gate, seq, _rows(0, rows))
        except ds4t.GateDesync:
            assert not same
            return
        assert same and got.shape == (rows, LIMITS.n_embd) and not got.any()
    finally:
        a.close()
        b.close()


@FEW
@given(st.binary(min_size=1, max_size=8), st.integers(0, 24 + 4 * 64 - 1), st.booleans())
def test_hostile_gate_bytes_are_refused_with_ds4t_errors(noise, at, close):
    a, b = socket.socketpair()
    try:
        me = ds4t.GateChannel(a, LIMITS, 0, 1, gate_timeout_ms=100)
        record = bytearray(ds4t.GateHeader(1, ds4t.Gate.ATTN, 5, 1, 1).pack() + _rows(3).tobytes())
        record[at: at + len(noise)] = noise  # overwrite (or, at the end, truncate / extend)
        b.sendall(bytes(record))
        if close:
            b.close()
        try:
            got = me.exchange(1, ds4t.Gate.ATTN, 5, _rows(4))
        except ds4t.DS4TError as e:
            if at < 24:
                assert e.field in ("magic", "gate", "reserved", "layer", "seq", "rows", "rank",
                                   "eof", "timeout")
            return
        assert bytes(record[:24]) == ds4t.GateHeader(1, ds4t.Gate.ATTN, 5, 1, 1).pack()
        assert got.tobytes() == bytes(record[24:24 + 4 * 64])
    finally:
        a.close()
        b.close()


def test_a_stalled_peer_times_out(pair):
    me = ds4t.GateChannel(pair[0], LIMITS, 0, 1, gate_timeout_ms=200)
    pair[1].sendall(GATE_BYTES[:1])  # one byte, then nothing
    t0 = time.monotonic()
    with pytest.raises(ds4t.GateTimeout) as e:
        me.exchange(3, ds4t.Gate.FFN, 1, _rows(0))
    took = time.monotonic() - t0
    assert 0.19 <= took < 0.2 + SLACK and e.value.field == "timeout"
    assert "layer 3 FFN seq 1" in str(e.value)


def test_a_stalled_payload_times_out(pair):
    me = ds4t.GateChannel(pair[0], LIMITS, 0, 1, gate_timeout_ms=200)
    pair[1].sendall(ds4t.GateHeader(0, ds4t.Gate.ATTN, 1, 1, 1).pack() + bytes(10))
    t0 = time.monotonic()
    with pytest.raises(ds4t.GateTimeout):
        me.exchange(0, ds4t.Gate.ATTN, 1, _rows(0))
    assert time.monotonic() - t0 < 0.2 + SLACK


def test_a_closed_peer_is_an_error(pair):
    me = ds4t.GateChannel(pair[0], LIMITS, 0, 1, gate_timeout_ms=2000)
    pair[1].sendall(GATE_BYTES[:5])
    pair[1].close()
    with pytest.raises(ds4t.DS4TClosed) as e:
        me.exchange(3, ds4t.Gate.FFN, 1, _rows(0))
    assert e.value.field == "eof"


def test_exchange_refuses_shapes_past_the_limits(pair):
    me = ds4t.GateChannel(pair[0], LIMITS, 0, 1)
    for bad in (np.zeros((17, 64), np.float32), np.zeros((1, 63), np.float32),
                np.zeros((1, 64), np.float64)):
        with pytest.raises(ValueError, match="partial"):
            me.exchange(0, ds4t.Gate.ATTN, 1, bad)
    with pytest.raises(ValueError, match="layer"):
        me.exchange(4, ds4t.Gate.ATTN, 1, _rows(0))


# ---- control channel and handshake ---------------------------------------------------------------


def test_control_channel_round_trip_and_stall(pair):
    lead = ds4t.ControlChannel(pair[0], LIMITS, ds4t.Role.WORKER, io_timeout=0.2)
    work = ds4t.ControlChannel(pair[1], LIMITS, ds4t.Role.LEADER, io_timeout=0.2)
    lead.send(ds4t.Sync(1, np.arange(5)))
    got = work.recv(idle_timeout=1)
    assert isinstance(got, ds4t.Sync) and got.tokens.tolist() == [0, 1, 2, 3, 4]
    work.send(ds4t.CommandAck(1, ds4t.AckStatus.OK))
    assert lead.recv(idle_timeout=1) == ds4t.CommandAck(1, ds4t.AckStatus.OK)
    work.send(ds4t.Sync(1, np.arange(5)))  # a SYNC from the worker: refused on its header
    with pytest.raises(ds4t.DS4TError, match="not a frame a worker sends") as e:
        lead.recv(idle_timeout=1)
    assert e.value.field == "type"
    pair[0].sendall(FRAMES[0][2][:16])  # the header and 4 payload bytes, then a stall
    t0 = time.monotonic()
    with pytest.raises(ds4t.DS4TClosed) as e:
        work.recv(idle_timeout=None)
    assert e.value.field == "timeout" and time.monotonic() - t0 < 0.2 + SLACK


def test_a_large_frame_may_take_longer_than_the_io_timeout(pair, monkeypatch):
    """A frame's bytes get the io timeout plus their size at MIN_FRAME_RATE (a STATE frame is a
    whole session): here, at a rate patched down to 200 bytes a second, a SYNC trickled over
    2.5 io timeouts arrives, where one io timeout for the whole frame cut it off."""
    from ds4.wire.ds4t import channels

    monkeypatch.setattr(channels, "MIN_FRAME_RATE", 200)
    work = ds4t.ControlChannel(pair[1], LIMITS, ds4t.Role.LEADER, io_timeout=0.2)
    wire = ds4t.pack_frame(ds4t.Sync(1, np.arange(64)))
    assert work.allowance(len(wire)) > 1.3  # (0.2 s + 280 bytes at 200 bytes a second)

    def trickle():
        for i in range(0, len(wire), len(wire) // 4 + 1):
            pair[0].sendall(wire[i:i + len(wire) // 4 + 1])
            time.sleep(0.15)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        got = work.recv(idle_timeout=1)
    finally:
        t.join()
    assert isinstance(got, ds4t.Sync) and got.tokens.tolist() == list(range(64))


def test_an_idle_worker_waits_past_the_io_timeout(pair):
    work = ds4t.ControlChannel(pair[1], LIMITS, ds4t.Role.LEADER, io_timeout=0.05)
    timer = threading.Timer(0.3, lambda: pair[0].sendall(FRAMES[4][2]))  # STOP, after 6 io timeouts
    timer.start()
    try:
        assert work.recv(idle_timeout=None) == ds4t.Stop()
    finally:
        timer.join()
    pair[0].close()
    with pytest.raises(ds4t.DS4TClosed) as e:
        work.recv(idle_timeout=None)
    assert e.value.field == "eof"


def _fake_auth(log: list, ok: bool = True):
    """Stands in for the shared mutual-auth handshake: records that it ran, swaps one byte."""
    def authenticate(sock):
        log.append(sock)
        sock.sendall(b"\1" if ok else b"\0")
        if ds4t.recv_exact(sock, 1, 1.0, "proof") != b"\1":
            raise ds4t.DS4TError("auth", "the peer did not prove the secret")
    return authenticate


def test_handshake_agrees_on_ctx_and_runs_auth(pair):
    log = []
    (theirs_a, ctx_a), (theirs_b, ctx_b) = _both(
        lambda: ds4t.handshake(pair[0], LEADER, timeout=1, authenticate=_fake_auth(log)),
        lambda: ds4t.handshake(pair[1], WORKER, timeout=1, authenticate=_fake_auth(log)))
    assert theirs_a == WORKER and theirs_b == LEADER and ctx_a == ctx_b == 128 and len(log) == 2


def test_handshake_refuses_a_failed_proof(pair):
    a, b = _both(lambda: ds4t.handshake(pair[0], LEADER, timeout=1, authenticate=_fake_auth([])),
                 lambda: ds4t.handshake(pair[1], WORKER, timeout=1,
                                        authenticate=_fake_auth([], ok=False)))
    assert isinstance(a, ds4t.DS4TError) and a.field == "auth"


def test_handshake_refusals_name_the_field(pair):
    plain = dataclasses.replace(WORKER, flags=0)
    log = []
    a, b = _both(lambda: ds4t.handshake(pair[0], LEADER, timeout=1, authenticate=_fake_auth(log)),
                 lambda: ds4t.handshake(pair[1], plain, timeout=1))
    assert a.field == b.field == "flags" and "shared secret" in str(a) and not log
    with pytest.raises(ValueError, match="authenticate"):
        ds4t.handshake(pair[0], LEADER, timeout=1)


def test_handshake_fingerprint_mismatch_and_silence(pair):
    other = dataclasses.replace(WORKER, fingerprint=FP + 1, flags=0)
    mine = dataclasses.replace(LEADER, flags=0)
    a, b = _both(lambda: ds4t.handshake(pair[0], mine, timeout=1),
                 lambda: ds4t.handshake(pair[1], other, timeout=1))
    assert isinstance(a, ds4t.HelloRefused) and a.field == b.field == "fingerprint"
    c, d = socket.socketpair()
    with c, d:
        t0 = time.monotonic()
        with pytest.raises(ds4t.DS4TClosed):
            ds4t.handshake(c, mine, timeout=0.2)
        assert time.monotonic() - t0 < 0.2 + SLACK


# ---- the shared mutual proof (ds4.wire.auth) on DS4T ----------------------------------------------

TOKEN = "s3cret"


def _hmac(key: str, msg: bytes) -> bytes:
    import hashlib
    import hmac

    return hmac.new(key.encode(), msg, hashlib.sha256).digest()


# the proofs' layout from auth.py's docstring; the protocol name is the hello magic as it travels
PROTOCOL = HELLO_BYTES[:4]


def server_proof(key: str, cn: bytes, sn: bytes) -> bytes:
    return _hmac(key, b"ds4 wire auth v2 server\0" + PROTOCOL + cn + sn)


def client_proof(key: str, cn: bytes, sn: bytes) -> bytes:
    return _hmac(key, b"ds4 wire auth v2 client\0" + PROTOCOL + cn + sn)


def _leader(sock, token=TOKEN, hello=LEADER):
    """A real leader: the handshake, then a STOP frame; closes the socket on any refusal."""
    try:
        auth = ds4t.mutual_auth(token, ds4t.Role.LEADER, 2.0) if hello.flags else None
        theirs, ctx = ds4t.handshake(sock, hello, timeout=2.0, authenticate=auth)
        ds4t.ControlChannel(sock, LIMITS, ds4t.Role.WORKER, io_timeout=2.0).send(ds4t.Stop())
        return theirs, ctx
    except Exception:
        sock.close()
        raise


def _worker(sock, token=TOKEN, hello=WORKER):
    """A real worker: the handshake, then it reads a frame and acks; closes on any refusal."""
    try:
        auth = ds4t.mutual_auth(token, ds4t.Role.WORKER, 2.0) if hello.flags else None
        theirs, ctx = ds4t.handshake(sock, hello, timeout=2.0, authenticate=auth)
        ch = ds4t.ControlChannel(sock, LIMITS, ds4t.Role.LEADER, io_timeout=2.0)
        frame = ch.recv(idle_timeout=2.0)
        ch.send(ds4t.CommandAck(0, ds4t.AckStatus.OK))
        return theirs, ctx, frame
    except Exception:
        sock.close()
        raise


def _read_all(sock, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    got = b""
    while data := sock.recv(1 << 16):
        got += data
    return got


def test_mutual_auth_with_the_same_token(pair):
    a, b = _both(lambda: _leader(pair[0]), lambda: _worker(pair[1]))
    assert a == (WORKER, 128) and b == (LEADER, 128, ds4t.Stop())
    # and the connection is in step after the proofs: the worker's ack is the next thing
    ack = ds4t.ControlChannel(pair[0], LIMITS, ds4t.Role.WORKER, io_timeout=2.0).recv(2.0)
    assert ack == ds4t.CommandAck(0, ds4t.AckStatus.OK)


def test_mutual_auth_bytes_follow_the_layout(pair):
    """A hand-written worker that knows the token, with proofs computed from the layout."""
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_catch(lambda: _leader(pair[0]))))
    t.start()
    w = pair[1]
    w.settimeout(5.0)
    w.sendall(WORKER.pack())
    assert ds4t.recv_exact(w, 72, 5.0, "hello") == HELLO_BYTES
    cn = bytes(range(40, 72))
    w.sendall(cn)
    sn_proof = bytes(ds4t.recv_exact(w, 64, 5.0, "nonce and proof"))
    sn = sn_proof[:32]
    assert sn_proof[32:] == server_proof(TOKEN, cn, sn)
    w.sendall(client_proof(TOKEN, cn, sn))
    assert ds4t.recv_exact(w, 12, 5.0, "STOP") == FRAMES[4][2]  # the first frame, nothing before
    t.join(5)
    assert out["r"] == (WORKER, 128)


def test_a_worker_without_the_token_gets_nothing_past_the_hello(pair):
    # an attacker's worker that sends a proof whatever the leader proved: it gets the leader's
    # nonce and proof (over its own nonce: nothing to replay), then the leader refuses it
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_catch(lambda: _leader(pair[0]))))
    t.start()
    w = pair[1]
    w.sendall(WORKER.pack())
    cn = bytes(32)
    w.sendall(cn)
    got = bytes(ds4t.recv_exact(w, 72 + 64, 5.0, "hello, nonce and proof"))
    assert got[:72] == HELLO_BYTES
    w.sendall(client_proof("guess", cn, got[72:104]))
    assert _read_all(w) == b""  # closed: no frame, no gate record
    t.join(5)
    e = out["r"]
    assert isinstance(e, ds4t.DS4TError) and e.field == "auth" and "did not prove" in str(e)


def test_honest_ends_with_different_tokens_refuse_each_other():
    a, b = socket.socketpair()
    with a, b:
        la, wb = _both(lambda: _leader(a), lambda: _worker(b, token="guess"))
    # the worker stops at the leader's proof and sends no proof of its own; the leader, waiting
    # for it, sees the worker close
    assert isinstance(wb, ds4t.DS4TError) and wb.field == "auth" and "leader did not prove" in str(wb)
    assert isinstance(la, ds4t.DS4TClosed) and la.field == "eof"
    # a worker with no token at all: refused on the hello's flags by both, no proof exchanged
    a, b = socket.socketpair()
    with a, b:
        la, wb = _both(lambda: _leader(a), lambda: _worker(b, hello=dataclasses.replace(WORKER, flags=0)))
    assert isinstance(la, ds4t.HelloRefused) and la.field == wb.field == "flags"


def test_an_impostor_leader_gets_no_frames_from_the_worker(pair):
    """A listener that does not know the token: it answers the worker's nonce with a made-up
    proof and records what the worker sends."""
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_catch(lambda: _worker(pair[1]))))
    t.start()
    imp = pair[0]
    imp.sendall(LEADER.pack())
    worker_hello = bytes(ds4t.recv_exact(imp, 72, 5.0, "hello"))
    cn = bytes(ds4t.recv_exact(imp, 32, 5.0, "nonce"))
    sn = bytes(range(32))
    imp.sendall(sn + server_proof("guess", cn, sn))
    rest = _read_all(imp)
    t.join(5)
    assert worker_hello == WORKER.pack() and rest == b""  # no proof, no ack, no frame
    e = out["r"]
    assert isinstance(e, ds4t.DS4TError) and e.field == "auth" and "leader did not prove" in str(e)
    # nor can it reflect the worker's own nonce back: the labels differ by direction
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=lambda: out.update(r=_catch(lambda: _worker(b))))
        t.start()
        a.sendall(LEADER.pack())
        ds4t.recv_exact(a, 72, 5.0, "hello")
        cn = bytes(ds4t.recv_exact(a, 32, 5.0, "nonce"))
        a.sendall(cn + client_proof("guess", cn, cn))
        assert _read_all(a) == b""
        t.join(5)
    assert isinstance(out["r"], ds4t.DS4TError) and out["r"].field == "auth"


def test_mutual_auth_refuses_an_empty_token_and_a_silent_peer(pair):
    with pytest.raises(ValueError, match="non-empty"):
        ds4t.mutual_auth("", ds4t.Role.LEADER, 1.0)
    t0 = time.monotonic()
    with pytest.raises(ds4t.DS4TClosed) as e:  # the worker sent its hello, then nothing
        ds4t.mutual_auth(TOKEN, ds4t.Role.LEADER, 0.2)(pair[0])
    assert e.value.field == "timeout" and time.monotonic() - t0 < 0.2 + SLACK


def _catch(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e
