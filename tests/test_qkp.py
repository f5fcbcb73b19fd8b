"""qkp6 records (wire.md §1): hello, frames, auth, limits; hostile input against a live worker.

The property tests feed random headers and lengths to the frame reader through a recording fake
(it must never ask for more bytes than the hello's limits allow, and nothing past the header of a
bad one), and random frames to a worker on loopback (only that connection closes; a second,
long-lived connection keeps getting correct answers).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4
from ds4.core.tiny import make_tiny
from ds4.pipeline import Stage, Worker
from ds4.wire import qkp

LIMITS = qkp.Hello(layer_first=3, layer_end=5, n_layer=5, n_embd=256, n_hc=4, n_slots=2,
                   n_ctx=64, n_vocab=512, max_rows=8, fingerprint=0x1234_5678_9ABC_DEF0)
U32 = 0xFFFFFFFF


# ---- records ---------------------------------------------------------------------------------------


def test_hello_round_trip_and_layout():
    buf = LIMITS.pack()
    assert len(buf) == 48 and struct.unpack_from("<I", buf)[0] == 0x716B7036  # "qkp6"
    assert qkp.Hello.unpack(buf) == LIMITS
    assert LIMITS.row_floats == 1024 and LIMITS.last
    assert qkp.HEADER.size == 20


@pytest.mark.parametrize("field,value,name", [
    ("layer_first", 5, "layer_first"), ("layer_end", 6, "layer_first"), ("n_embd", 0, "n_embd"),
    ("n_slots", 0, "n_slots"), ("max_rows", 65, "max_rows"), ("n_embd", 1 << 21, "n_embd"),
])
def test_hello_consistency_names_the_field(field, value, name):
    import dataclasses

    bad = dataclasses.replace(LIMITS, **{field: value})
    with pytest.raises(qkp.QkpError) as e:
        qkp.Hello.unpack(bad.pack())
    assert e.value.field == name


def test_hello_bad_magic():
    buf = bytearray(LIMITS.pack())
    buf[0] ^= 1
    with pytest.raises(qkp.QkpError, match="magic"):
        qkp.Hello.unpack(bytes(buf))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=44, max_size=44))
def test_any_hello_is_refused_or_consistent(rest):
    buf = struct.pack("<I", qkp.MAGIC) + rest
    try:
        h = qkp.Hello.unpack(buf)
    except qkp.QkpError:
        return
    assert 0 <= h.layer_first < h.layer_end <= h.n_layer
    assert 1 <= h.max_rows <= h.n_ctx and h.row_floats <= qkp.MAX_ROW_FLOATS
    assert h.max_rows * (4 + 4 * h.row_floats) <= qkp.MAX_FRAME_BYTES


@pytest.mark.parametrize("hdr,field", [
    ((0, 0, 1, 0, 0), "op"), ((7, 0, 1, 0, 0), "op"), ((5, 2, 0, 0, 0), "slot"), ((1, 2, 1, 0, 0), "slot"),
    ((1, 0, 0, 0, 0), "n"), ((1, 0, 9, 0, 0), "n"), ((1, 0, U32, 0, 0), "n"),
    ((1, 0, 8, 57, 0), "base"), ((1, 0, 1, U32, 0), "base"), ((1, 0, 1, 0, 257), "topk"),
    ((1, 0, 1, 0, U32 - 1), "topk"),
    ((3, U32, 0, 0, 0), "slot"), ((4, 0, 0, 0, 65), "topk"),
])
def test_header_checks_name_the_field(hdr, field):
    with pytest.raises(qkp.QkpError) as e:
        qkp.check_header(qkp.Header(*hdr), LIMITS, answers_topk=True)
    assert e.value.field == field


def test_header_limits_accept_edges():
    for hdr in [(1, 1, 8, 56, 256), (1, 0, 1, 63, 0), (1, 0, 1, 0, U32), (5, 1, U32, U32, U32),
                (6, 0, 0, 0, 0), (2, U32, U32, U32, U32), (3, 1, U32, 0, 64)]:
        qkp.check_header(qkp.Header(*hdr), LIMITS, answers_topk=True)
    with pytest.raises(qkp.QkpError, match="topk"):  # topk only where it can be answered
        qkp.check_header(qkp.Header(1, 0, 1, 0, 1), LIMITS, answers_topk=False)


class Recorder:
    """A recv_exact that serves `data` and records every size asked for."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.asked = data, 0, []

    def __call__(self, n: int) -> bytearray:
        self.asked.append(n)
        if self.pos + n > len(self.data):
            raise qkp.QkpClosed("eof", "short")
        out = bytearray(self.data[self.pos: self.pos + n])
        self.pos += n
        return out


word = st.one_of(st.integers(0, U32), st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 9, 56, 63, 64,
                                                       256, 257, 1 << 31, U32]))


@settings(max_examples=400, deadline=None)
@given(st.tuples(word, word, word, word, word), st.binary(max_size=64), st.booleans())
def test_reader_never_asks_past_the_limits(hdr, tail, full):
    h = qkp.Header(*hdr)
    payload = tail
    if full and h.op == qkp.EVAL and 1 <= h.n <= LIMITS.max_rows:
        rng = np.random.default_rng(len(tail))
        payload = (rng.integers(0, 600, h.n).astype("<u4").tobytes()
                   + rng.standard_normal(h.n * LIMITS.row_floats).astype("<f4").tobytes())
    rec = Recorder(h.pack() + payload)
    max_payload = LIMITS.max_rows * (4 + 4 * LIMITS.row_floats)
    try:
        qkp.check_header(h, LIMITS, answers_topk=True)
        valid_header = True
    except qkp.QkpError:
        valid_header = False
    try:
        frame = qkp.read_frame(rec, LIMITS, answers_topk=True)
    except qkp.QkpError:
        frame = None
    assert rec.asked[0] == qkp.HEADER.size
    assert all(n <= max(qkp.HEADER.size, max_payload) for n in rec.asked)
    if not valid_header:
        assert rec.asked == [qkp.HEADER.size] and frame is None
    elif frame is not None and h.op == qkp.EVAL:
        assert sum(rec.asked) == qkp.HEADER.size + LIMITS.request_bytes(h)
        assert frame.rows.shape == (h.n, 4, 256) and (frame.tokens < 512).all()


def test_bad_token_id_is_refused_before_the_rows_are_read():
    h = qkp.Header(qkp.EVAL, 0, 2, 0, 0)
    rec = Recorder(h.pack() + np.array([3, 512], "<u4").tobytes() + bytes(8 * 4096))
    with pytest.raises(qkp.QkpError) as e:
        qkp.read_frame(rec, LIMITS, answers_topk=True)
    assert e.value.field == "tokens" and rec.asked == [20, 8]


def test_eval_reply_round_trip_pads_missing_candidates():
    buf = qkp.pack_eval_reply(np.array([7, 9], "<u4"), [(5, 2.5), (1, -1.0)], topk=4)
    assert len(buf) == LIMITS.eval_reply_bytes(2, 4) == 8 + 32
    ids, pairs = qkp.unpack_eval_reply(buf, 2, 4)
    assert ids.tolist() == [7, 9]
    assert pairs["id"].tolist() == [5, 1, qkp.NO_TOKEN, qkp.NO_TOKEN]
    assert pairs["logit"][:2].tolist() == [2.5, -1.0] and np.isneginf(pairs["logit"][2:]).all()


def test_eval_reply_with_the_logits_row():
    """topk = TOPK_LOGITS: n u32 ids, then n_vocab f32 (the layout written out by hand)."""
    logits = np.random.default_rng(2).standard_normal(LIMITS.n_vocab).astype(np.float32)
    buf = qkp.pack_eval_reply(np.array([7, 9], "<u4"), [], qkp.TOPK_LOGITS, logits)
    assert len(buf) == LIMITS.eval_reply_bytes(2, qkp.TOPK_LOGITS) == 8 + 4 * 512
    assert buf == struct.pack("<2I", 7, 9) + struct.pack(f"<{LIMITS.n_vocab}f", *logits.tolist())
    ids, row = qkp.unpack_eval_reply(buf, 2, qkp.TOPK_LOGITS)
    assert ids.tolist() == [7, 9] and np.array_equal(row, logits)


# ---- handshake and sockets -------------------------------------------------------------------------


def _pair(timeout=2.0):
    a, b = socket.socketpair()
    return qkp.Conn(a, timeout, "client"), qkp.Conn(b, timeout, "server")


def _handshake(server_token, client_token, server_exact=False, client_exact=False):
    client, server = _pair()
    result = {}

    def serve():
        try:
            result["flags"] = qkp.read_client_hello(server, server_token, server_exact)
            server.send(LIMITS.pack())
        except qkp.QkpError as e:
            result["error"] = e
            if not isinstance(e, qkp.QkpClosed):
                qkp.refuse(server.sock, e)  # as the worker does
        finally:
            server.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        hello = qkp.client_handshake(client, client_token, client_exact)
    except qkp.QkpError as e:
        hello = e
    t.join(5)
    client.close()
    return hello, result


def test_auth_and_numerics_in_the_hello():
    hello, res = _handshake("s3cret", "s3cret")
    assert hello == LIMITS and res["flags"] == qkp.FLAG_AUTH
    hello, res = _handshake(None, None, True, True)
    assert hello == LIMITS and res["flags"] == qkp.FLAG_EXACT
    hello, res = _handshake(None, "unused")  # a stage without a token cannot prove one: it says so
    assert isinstance(hello, qkp.Refused) and "auth: the client asks for an auth token and this " \
        "stage has none" in hello.reason
    assert res["error"].field == "auth" and "has none" in str(res["error"])
    # a wrong token: the client sees the stage's proof fail first and sends nothing more
    hello, res = _handshake("s3cret", "wrong")
    assert isinstance(hello, qkp.AuthRefused) and "did not prove" in str(hello)
    assert isinstance(res["error"], qkp.QkpClosed)
    hello, res = _handshake("s3cret", None)
    assert isinstance(hello, qkp.Refused) and "sent no proof" in hello.reason
    assert res["error"].field == "auth" and "sent no proof" in str(res["error"])


@pytest.mark.parametrize("token", [None, "s3cret"])
@pytest.mark.parametrize("stage_exact", [False, True])
def test_a_numerics_mismatch_names_the_field_and_both_values_on_both_ends(token, stage_exact):
    """The stage refuses (after the proofs, when there is a token) with a record naming the
    field, its own value and the client's; the client raises with that text."""
    hello, res = _handshake(token, token, server_exact=stage_exact, client_exact=not stage_exact)
    ours, theirs = ("exact", "ds4") if stage_exact else ("ds4", "exact")
    want = f"numerics: expected {ours} (the stage's --numerics), got {theirs} (the client's)"
    assert res["error"].field == "numerics" and want in str(res["error"])
    assert isinstance(hello, qkp.Refused) and want in hello.reason


def test_hello_auth_bytes_follow_the_layout():
    """The hello with a token, byte for byte as the qkp.py docstring and auth.py lay it out."""
    import hashlib
    import hmac

    client, server = _pair()
    t = threading.Thread(target=lambda: qkp.client_handshake(client, "tok", False), daemon=True)
    t.start()
    first = bytes(server.recv_exact(8 + 32))
    assert first[:8] == struct.pack("<II", 0x716B7036, 1)
    cn, sn = first[8:], bytes(range(32))
    sp = hmac.new(b"tok", b"ds4 wire auth v2 server\0" + b"6pkq" + cn + sn, hashlib.sha256).digest()
    server.send(struct.pack("<I", 0x716B7036) + sn + sp)  # the magic, then nonce and proof
    cp = bytes(server.recv_exact(32))
    assert cp == hmac.new(b"tok", b"ds4 wire auth v2 client\0" + b"6pkq" + cn + sn,
                          hashlib.sha256).digest()
    server.send(LIMITS.pack())
    t.join(5)
    assert not t.is_alive()
    client.close()
    server.close()


@pytest.mark.parametrize("field,kw", [
    ("fingerprint", dict(fingerprint=1)), ("n_embd", dict(n_embd=128)),
    ("layer_first", dict(layer_end=4)), ("n_slots", dict(n_slots=3)), ("n_ctx", dict(n_ctx=65)),
    ("max_rows", dict(max_rows=9)),
])
def test_next_stage_rules(field, kw):
    base = dict(layer_end=3, n_layer=5, n_embd=256, n_hc=4, n_vocab=512,
                fingerprint=LIMITS.fingerprint, n_slots=2, n_ctx=64, max_rows=8)
    qkp.check_next_stage(LIMITS, **base)
    with pytest.raises(qkp.HelloRefused) as e:
        qkp.check_next_stage(LIMITS, **{**base, **kw})
    assert e.value.field == field


def test_reads_time_out_and_see_eof():
    client, server = _pair(timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(qkp.QkpClosed) as e:
        client.recv_exact(4)
    assert e.value.field == "timeout" and time.monotonic() - t0 < 2
    server.send(b"ab")
    server.close()
    with pytest.raises(qkp.QkpClosed) as e:
        client.recv_exact(4)
    assert e.value.field == "eof" and "2 of 4" in str(e.value)
    client.close()


# ---- a live worker under hostile frames ------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("qkp") / "test.gguf", preset="test", seed=1)
    eng = ds4.Engine.open(path, layers=range(3, 5))
    stage = Stage(eng, slots=2, ctx=64, snapshots=1, max_rows=8)
    w = Worker(stage, io_timeout=0.5, idle_timeout=30.0).start()
    yield w
    w.stop()


def _connect(w, token=None):
    conn = qkp.Conn.connect("127.0.0.1", w.port, 5.0)
    return conn, qkp.client_handshake(conn, token, exact=False)


def _open(conn, slot, op=qkp.OPEN) -> int:
    conn.send(qkp.Header(op, slot, 0, 0, 0).pack())
    return qkp.STATUS.unpack(bytes(conn.recv_exact(4)))[0]


def _eval_frame(hello, slot, base, tokens, seed=0):
    rows = np.random.default_rng(seed).standard_normal(
        (len(tokens), hello.n_hc, hello.n_embd)).astype("<f4")
    return qkp.Header(qkp.EVAL, slot, len(tokens), base, 3).pack() + \
        np.asarray(tokens, "<u4").tobytes() + rows.tobytes()


class Good:
    """A long-lived connection that must keep getting the same correct answer."""

    def __init__(self, w):
        self.conn, self.hello = _connect(w)
        assert _open(self.conn, 1) == qkp.STATUS_OK
        self.frame = _eval_frame(self.hello, 1, 0, [1, 2, 3, 4, 5], seed=1)
        self.expected = self.ask()

    def ask(self) -> bytes:
        self.conn.send(self.frame)
        return bytes(self.conn.recv_exact(self.hello.eval_reply_bytes(5, 3)))


def _drain(conn, limit=3.0) -> bytes:
    """Everything the worker sends until it closes; fails if it neither answers nor closes."""
    got = b""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            chunk = bytes(conn.recv_exact(1, timeout=deadline - time.monotonic()))
        except qkp.QkpClosed as e:
            assert e.field == "eof", "the worker neither answered nor closed the connection"
            return got
        got += chunk
    raise AssertionError("the worker kept the connection open")


def test_stage_statuses_and_positions(worker):
    conn, hello = _connect(worker)
    assert hello.layer_first == 3 and hello.last and hello.n_slots == 2 and hello.max_rows == 8

    def status(op, slot, index, count):
        conn.send(qkp.Header(op, slot, index, 0, count).pack())
        return qkp.STATUS.unpack(bytes(conn.recv_exact(4)))[0]

    assert status(qkp.LOAD, 0, 0, 0) == qkp.STATUS_NO_SNAPSHOT
    assert status(qkp.SAVE, 0, 1, 0) == qkp.STATUS_BAD_INDEX
    assert status(qkp.SAVE, 0, 0, 0) == qkp.STATUS_SLOT_NOT_OPEN
    assert _open(conn, 0) == qkp.STATUS_OK and _open(conn, 1) == qkp.STATUS_OK
    conn.send(_eval_frame(hello, 0, 0, [9, 8, 7]))
    ids, pairs = qkp.unpack_eval_reply(bytes(conn.recv_exact(hello.eval_reply_bytes(3, 3))), 3, 3)
    assert (ids < 512).all() and (pairs["id"] < 512).all()
    assert list(pairs["logit"]) == sorted(pairs["logit"], reverse=True)
    assert status(qkp.SAVE, 0, 0, 2) == qkp.STATUS_COUNT_MISMATCH
    assert status(qkp.SAVE, 0, 0, 3) == qkp.STATUS_OK
    assert status(qkp.LOAD, 1, 0, 2) == qkp.STATUS_NO_SNAPSHOT
    assert status(qkp.LOAD, 1, 0, 3) == qkp.STATUS_OK
    conn.send(_eval_frame(hello, 1, 3, [1]))  # slot 1 continues from the loaded prefix
    conn.recv_exact(hello.eval_reply_bytes(1, 3))
    conn.send(_eval_frame(hello, 1, 7, [1]))  # a gap: position out of range closes
    assert _drain(conn) == b""
    conn.close()


def _wait_all_free(w, timeout=5.0) -> None:
    """A closed connection's slots come back when its thread sees the close."""
    deadline = time.monotonic() + timeout
    while any(s.owner is not None for s in w.stage.slots) or any(w.stage.snapshots):
        assert time.monotonic() < deadline, "the worker kept a closed connection's slots"
        time.sleep(0.01)


def test_a_connection_touches_only_its_own_slots(worker):
    """Slots and snapshots belong to the connection that opened them (qkp OPEN / FREE)."""
    _wait_all_free(worker)
    ok = qkp.STATUS_OK
    # what A's slot answers when nobody else is connected: the reference for A below
    ref, hello = _connect(worker)
    assert _open(ref, 0) == ok
    ref.send(_eval_frame(hello, 0, 0, [9, 8, 7], seed=3))
    ref.recv_exact(hello.eval_reply_bytes(3, 3))
    ref.send(_eval_frame(hello, 0, 3, [1], seed=4))
    expected = bytes(ref.recv_exact(hello.eval_reply_bytes(1, 3)))
    assert _open(ref, 0, qkp.FREE) == ok and _open(ref, 0, qkp.FREE) == qkp.STATUS_SLOT_NOT_OPEN
    ref.close()

    a, _ = _connect(worker)
    assert _open(a, 0) == ok
    a.send(_eval_frame(hello, 0, 0, [9, 8, 7], seed=3))
    a.recv_exact(hello.eval_reply_bytes(3, 3))
    a.send(qkp.Header(qkp.SAVE, 0, 0, 0, 3).pack())
    assert qkp.STATUS.unpack(bytes(a.recv_exact(4)))[0] == ok

    # a rogue connection writing A's slot number at A's position, without opening it: closed,
    # nothing answered
    rogue, _ = _connect(worker)
    rogue.send(_eval_frame(hello, 0, 3, [2], seed=5))
    assert _drain(rogue) == b""
    rogue.close()
    # one that opens its own slot 0 gets the other stage slot, and its frames land there
    b, _ = _connect(worker)
    assert _open(b, 0) == ok
    assert _open(b, 1) == qkp.STATUS_NO_SLOT  # both stage slots are held: refused, no steal
    b.send(_eval_frame(hello, 0, 0, [4, 4], seed=6))
    b.recv_exact(hello.eval_reply_bytes(2, 3))
    b.send(qkp.Header(qkp.LOAD, 0, 0, 0, 3).pack())  # A's snapshot index 0: not B's
    assert qkp.STATUS.unpack(bytes(b.recv_exact(4)))[0] == qkp.STATUS_NO_SNAPSHOT
    b.send(qkp.Header(qkp.SAVE, 0, 0, 0, 2).pack())  # the one entry is A's
    assert qkp.STATUS.unpack(bytes(b.recv_exact(4)))[0] == qkp.STATUS_SNAPSHOTS_FULL

    a.send(_eval_frame(hello, 0, 3, [1], seed=4))
    assert bytes(a.recv_exact(hello.eval_reply_bytes(1, 3))) == expected
    assert _open(b, 0, qkp.FREE) == ok
    c, _ = _connect(worker)
    assert _open(c, 1) == ok  # B's slot went back to the pool
    for conn in (a, b, c):
        conn.close()
    _wait_all_free(worker)


@pytest.fixture(scope="module")
def good(worker):
    return Good(worker)


frame_words = st.tuples(
    st.sampled_from([0, 1, 1, 1, 2, 3, 4, 5, U32]),
    st.sampled_from([0, 1, 2, U32]) | st.integers(0, U32),
    st.sampled_from([0, 1, 2, 8, 9, 1 << 20, U32]) | st.integers(0, U32),
    st.sampled_from([0, 0, 5, 56, 63, 64, U32]) | st.integers(0, U32),
    st.sampled_from([0, 0, 1, 256, 257, U32]) | st.integers(0, U32),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame_words, st.sampled_from(["none", "short", "exact", "bad_tokens", "random"]),
       st.binary(max_size=48))
def test_hostile_frames_close_only_their_connection(worker, good, hdr, shape, noise):
    conn, hello = _connect(worker)
    h = qkp.Header(*hdr)
    if shape == "exact" and h.op == qkp.EVAL and 1 <= h.n <= hello.max_rows:
        payload = _eval_frame(hello, 0, 0, [i % 512 for i in range(h.n)])[20:]
    elif shape == "bad_tokens" and h.op == qkp.EVAL and 1 <= h.n <= hello.max_rows:
        payload = np.full(h.n, 70000, "<u4").tobytes() + bytes(4 * h.n * hello.row_floats)
    elif shape == "short":
        payload = noise[:7]
    elif shape == "random":
        payload = noise
    else:
        payload = b""
    try:
        conn.send(h.pack() + payload)
        conn.sock.shutdown(socket.SHUT_WR)  # the worker sees EOF instead of waiting
    except OSError:
        pass  # it may already have closed on the header
    try:
        qkp.check_header(h, hello, answers_topk=True)
        ok_header = True
    except qkp.QkpError:
        ok_header = False
    got = _drain(conn)
    if not ok_header:
        assert got == b""  # refused: nothing answered, nothing applied
    conn.close()
    assert good.ask() == good.expected


hello_bytes = st.one_of(
    st.binary(max_size=80),
    st.builds(lambda flags, tail: struct.pack("<II", qkp.MAGIC, flags) + tail,
              st.sampled_from([0, 1, 2, 3, 4, U32]) | st.integers(0, U32), st.binary(max_size=72)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hello_bytes)
def test_hostile_hellos_are_closed(worker, good, data):
    sock = socket.create_connection(("127.0.0.1", worker.port), timeout=5)
    conn = qkp.Conn(sock, 5.0, "fuzz")
    try:
        conn.send(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    got = _drain(conn)
    magic, flags = struct.unpack("<II", data[:8]) if len(data) >= 8 else (None, None)
    if magic != qkp.MAGIC or flags:  # bad magic, unknown bits, other numerics, a token
        # this worker has no token: it cannot prove one, and says only why (a refusal record,
        # when a whole client hello came), never its hello
        if got:
            refusal_magic, n = struct.unpack_from("<II", got)
            assert refusal_magic == qkp.REFUSAL_MAGIC and len(got) == 8 + n, got
        assert worker.stage.hello.pack() not in got
    else:
        assert got[:48] == worker.stage.hello.pack()
    conn.close()
    assert good.ask() == good.expected
