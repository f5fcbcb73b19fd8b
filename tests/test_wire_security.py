"""Wires that hold against bad peers (issue #32): both ends prove the token, secrets off argv,
deadlines bound slow peers, a receiver survives bad connections, strangers cost little memory.

The proofs are checked against HMAC-SHA256 computed here from the byte layout in auth.py's
docstring; the impostor drills record every byte a listener without the token receives; the
memory drill reads a real `pipe-worker` process's VmRSS.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import os
import socket
import ssl
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ds4
from ds4.core.tiny import make_tiny
from ds4.pipeline import PipelineRefused, SplitEngine, Stage, Worker
from ds4.wire import auth, ds4k, qkp
from ds4.wire.deadline import Deadline, DeadlineExceeded
from bench_modules import bench_module

ROOT = Path(__file__).resolve().parents[1]
T_OUT = 10.0
PROMPT = [int(x) for x in np.random.default_rng(11).integers(0, 512, 9)]


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


# ---- the mutual proof ----------------------------------------------------------------------------


def test_proofs_follow_the_documented_layout():
    cn, sn = bytes(range(32)), bytes(range(32, 64))
    assert auth.server_proof("tok", b"DS4K", cn, sn) == \
        _hmac(b"tok", b"ds4 wire auth v2 server\0DS4K" + cn + sn)
    assert auth.client_proof("tok", b"DS4K", cn, sn) == \
        _hmac(b"tok", b"ds4 wire auth v2 client\0DS4K" + cn + sn)
    # no reflection across directions, no carrying to another wire
    assert auth.server_proof("tok", b"DS4K", cn, sn) != auth.client_proof("tok", b"DS4K", cn, sn)
    assert auth.server_proof("tok", b"DS4K", cn, sn) != auth.server_proof("tok", b"DS4T", cn, sn)
    with pytest.raises(ValueError, match="client_nonce: expected 32 bytes, got 31"):
        auth.server_proof("tok", b"DS4K", cn[:31], sn)


def test_client_proves_only_after_the_server_did():
    client, server = auth.ClientAuth("tok", b"DS4T"), auth.ServerAuth("tok", b"DS4T")
    with pytest.raises(auth.AuthError, match="only sent after the server proved"):
        client.proof()
    impostor = auth.ServerAuth("guess", b"DS4T")
    with pytest.raises(auth.AuthError, match="did not prove the auth token"):
        client.check_server(impostor.nonce, impostor.proof(client.nonce))
    with pytest.raises(auth.AuthError):
        client.proof()  # still nothing to send
    client.check_server(server.nonce, server.proof(client.nonce))
    server.check_client(client.proof())
    with pytest.raises(auth.AuthError, match="wrong auth token"):
        server.check_client(bytes(32))


# ---- secrets off the command line ----------------------------------------------------------------


def test_token_sources_and_warnings(tmp_path):
    long, env = "s3cret-0123456789abcdef", "env-0123456789abcdef"
    f = tmp_path / "token"
    f.write_text(f"  {long}\n")
    f.chmod(0o600)
    assert auth.resolve_token(token_file=f, environ={"DS4_WIRE_TOKEN": env}) == (long, [])
    assert auth.resolve_token(environ={"DS4_WIRE_TOKEN": env}) == (env, [])
    assert auth.resolve_token(environ={}) == (None, [])
    # a short secret loads, with a warning naming its length and the fix
    token, warnings = auth.resolve_token(environ={"DS4_WIRE_TOKEN": "s3cret"})
    assert token == "s3cret" and len(warnings) == 1
    assert "is 6 bytes" in warnings[0] and f"at least {auth.MIN_TOKEN_BYTES}" in warnings[0]
    for file in (None, f):  # a secret on the command line is refused, with or without a file
        with pytest.raises(ValueError, match="--auth-token: a secret on the command line .* --auth-token-file"):
            auth.resolve_token(token_file=file, argv_token="argv", environ={"DS4_WIRE_TOKEN": "env"})
    f.chmod(0o644)
    assert "readable by other users" in auth.resolve_token(token_file=f, environ={})[1][0]
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        auth.resolve_token(token_file=tmp_path / "empty", environ={})
    with pytest.raises(ValueError, match="cannot read"):
        auth.resolve_token(token_file=tmp_path / "missing", environ={})
    assert auth.exposure_warning("127.0.0.1", None) is None
    assert auth.exposure_warning("::1", None) is None
    assert auth.exposure_warning("0.0.0.0", "tok") is None
    assert "without an auth token" in auth.exposure_warning("0.0.0.0", None)


def test_cli_reads_the_token_file_and_refuses_argv(tmp_path):
    """kv-send with --auth-token exits 1 naming where the secret goes; --auth-token-file reads
    the file without a warning."""
    from typer.testing import CliRunner
    import typer

    from cli.kv import register

    app = typer.Typer()
    register(app)
    f = tmp_path / "token"
    f.write_text("tok-0123456789abcdef")
    f.chmod(0o600)
    runner = CliRunner()
    r = runner.invoke(app, ["kv-send", str(tmp_path / "none.dsv4"), "127.0.0.1:9",
                            "--auth-token", "tok"], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "process list" in r.stderr and "--auth-token-file" in r.stderr
    r = runner.invoke(app, ["kv-send", str(tmp_path / "none.dsv4"), "127.0.0.1:9",
                            "--auth-token-file", str(f)], env={"COLUMNS": "200"})
    assert "warning" not in r.stderr and "not found" in r.stderr
    r = runner.invoke(app, ["kv-recv", "0", "--out", str(tmp_path / "x"), "--host", "0.0.0.0",
                            "--wait", "0.2"], env={"COLUMNS": "200", "DS4_WIRE_TOKEN": ""})
    assert "without an auth token" in r.stderr and r.exit_code == 1


# ---- impostors get nothing -------------------------------------------------------------------------


class Impostor(threading.Thread):
    """A listener without the token: says `greeting`, answers anything with `answer`, and
    records every byte it is sent until the client closes."""

    def __init__(self, greeting: bytes = b"", answer: bytes = b""):
        super().__init__(daemon=True)
        self.greeting, self.answer = greeting, answer
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.got = b""

    def run(self):
        self.lsock.settimeout(T_OUT)
        with self.lsock, self.lsock.accept()[0] as c:
            c.settimeout(T_OUT)
            c.sendall(self.greeting)
            answered = False
            try:
                while data := c.recv(1 << 16):
                    self.got += data
                    if not answered and self.answer:
                        c.sendall(self.answer)
                        answered = True
            except OSError:
                pass

    def finish(self) -> bytes:
        self.join(T_OUT)
        assert not self.is_alive()
        return self.got


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("sec") / "test.gguf", preset="test", seed=1)


@pytest.fixture(scope="module")
def head_engine(model_path):
    return ds4.Engine.open(model_path, layers=range(0, 3))


@pytest.mark.parametrize("answer", [b"", bytes(64)], ids=["closes", "fake-proof"])
def test_impostor_stage_gets_no_token_ids(head_engine, answer):
    imp = Impostor(answer=answer)
    imp.start()
    split = SplitEngine(head_engine, ("127.0.0.1", imp.port), auth_token="s3cret", io_timeout=1.0)
    with pytest.raises(PipelineRefused, match="did not prove the auth token") as e:
        split.session(ctx=64).sync(PROMPT)
    assert "nothing was sent to it" in str(e.value)
    got = imp.finish()
    # the client hello and its nonce, nothing else: no proof, no header, no token ids
    assert len(got) == 8 + 32 and got[:8] == struct.pack("<II", qkp.MAGIC, qkp.FLAG_AUTH)


def test_a_real_stage_without_the_token_gets_nothing(model_path, head_engine):
    stage = Stage(ds4.Engine.open(model_path, layers=range(3, 5)), ctx=64, max_rows=8)
    frames = []
    stage.eval = frames.append  # what reaches the stage's compute
    w = Worker(stage, io_timeout=2.0).start()  # no token
    try:
        split = SplitEngine(head_engine, ("127.0.0.1", w.port), auth_token="s3cret", io_timeout=2.0)
        # it says so (a refusal record) instead of a proof; the head sends nothing more
        with pytest.raises(PipelineRefused, match="refused this head: auth: the client asks for "
                           "an auth token and this stage has none"):
            split.session(ctx=64).sync(PROMPT)
        assert frames == []
    finally:
        w.stop()


@pytest.fixture(scope="module")
def payload(model_path) -> bytes:
    eng = ds4.Engine.open(model_path)
    s = eng.session(ctx=64)
    s.sync(PROMPT)
    f = io.BytesIO()
    s.save_payload(f)
    return f.getvalue()


def test_impostor_receiver_gets_no_payload(payload):
    # one that does not ask for the token: sent nothing at all
    imp = Impostor(greeting=ds4k.HELLO.pack(ds4k.MAGIC, ds4k.VERSION, 0, 0, bytes(32)))
    imp.start()
    with pytest.raises(ds4k.DS4KError, match="does not prove the auth token") as e:
        ds4k.send_payload(payload, "127.0.0.1", imp.port, auth_token="s3cret", timeout=2.0)
    assert e.value.status == ds4k.AUTH_FAILED and "nothing was sent" in str(e.value)
    assert imp.finish() == ds4k.OPENER.pack(ds4k.MAGIC)  # the opener, nothing more
    # one that asks for it and answers with a made-up proof: the record header and the nonce
    imp = Impostor(greeting=ds4k.HELLO.pack(ds4k.MAGIC, ds4k.VERSION, ds4k.FLAG_AUTH, 0, bytes(32)),
                   answer=ds4k.REPLY.pack(ds4k.OK, 0) + bytes(32))
    imp.start()
    with pytest.raises(ds4k.DS4KError, match="did not prove the auth token"):
        ds4k.send_payload(payload, "127.0.0.1", imp.port, auth_token="s3cret", timeout=2.0)
    got = imp.finish()
    # the opener, the record header and the nonce: no proof, no manifest, no payload byte
    assert len(got) == ds4k.OPENER.size + ds4k.RECORD.size + 32
    assert struct.unpack_from("<4I", got) == (ds4k.MAGIC, ds4k.MAGIC, ds4k.VERSION, ds4k.FLAG_AUTH)


def test_cli_kv_send_refuses_an_impostor(model_path, payload, tmp_path):
    """`ds4 kv-send --auth-token-file` to a listener without the token: exit 1, a clear error,
    no "sent", and the listener got nothing."""
    from typer.testing import CliRunner
    import typer

    from cli.kv import register

    app = typer.Typer()
    register(app)
    src, tok = tmp_path / "s.dsv4", tmp_path / "token"
    src.write_bytes(payload)
    tok.write_text("s3cret")
    tok.chmod(0o600)
    imp = Impostor(greeting=ds4k.HELLO.pack(ds4k.MAGIC, ds4k.VERSION, 0, 0, bytes(32)))
    imp.start()
    r = CliRunner().invoke(app, ["kv-send", str(src), f"127.0.0.1:{imp.port}", "-m", str(model_path),
                                 "--auth-token-file", str(tok), "--io-timeout", "2"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "does not prove the auth token" in r.stderr, r.output
    assert "sent" not in r.stdout
    assert imp.finish() == ds4k.OPENER.pack(ds4k.MAGIC)


def test_ds4k_auth_bytes_follow_the_layout(payload, tmp_path):
    """A hand-written sender that follows ds4/wire/ds4k's steps 0-5 with proofs from the layout."""
    r = ds4k.Receiver(0, auth_token="tok", timeout=T_OUT)
    out = {}
    t = threading.Thread(target=lambda: out.update(m=r.receive(tmp_path / "p", T_OUT, max_failures=1)))
    t.start()
    m = ds4k.make_manifest(payload).encode()
    with socket.create_connection(("127.0.0.1", r.port), timeout=T_OUT) as c:
        c.sendall(struct.pack("<I", 0x4B345344))  # the opener
        hello = ds4k._recv_exact(c, 48, "hello")
        magic, version, flags, _ = struct.unpack_from("<4I", hello)
        assert (magic, version, flags) == (0x4B345344, 3, 1)
        sn, cn = hello[16:], bytes(range(100, 132))
        c.sendall(struct.pack("<4I", magic, 3, 1, len(m)) + cn)
        verdict = ds4k._recv_exact(c, 8 + 32, "verdict")
        assert verdict[:8] == struct.pack("<2I", 0, 0)
        assert verdict[8:] == _hmac(b"tok", b"ds4 wire auth v2 server\0DS4K" + cn + sn)
        c.sendall(_hmac(b"tok", b"ds4 wire auth v2 client\0DS4K" + cn + sn) + m)
        assert ds4k._recv_exact(c, 8, "manifest verdict") == struct.pack("<2I", 0, 0)
        c.sendall(payload)
        assert ds4k._recv_exact(c, 8, "final") == struct.pack("<2I", 0, 0)
    t.join(T_OUT)
    r.close()
    assert (tmp_path / "p").read_bytes() == payload


# ---- deadlines and a receiver that outlives bad connections --------------------------------------


def test_deadline():
    d = Deadline(0.05, "the thing")
    assert 0 < d.left() <= 0.05 and not d.expired and d.timeout(10.0) <= 0.05
    time.sleep(0.06)
    assert d.expired and d.left() == 0
    with pytest.raises(DeadlineExceeded, match="the thing did not complete within 0.05 s"):
        d.check()
    assert Deadline(None).timeout(3.0) == 3.0


def _bench():
    return bench_module("reliability", "bench_reliability")


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_dripping_sender_is_dropped_at_the_deadline(where):
    # one byte every 0.2 s never trips a 1 s read timeout; the deadline ends it
    r = _bench().slow_receiver(where, io_timeout=1.0, drip_s=0.2, limit_s=8.0, min_rate=4096.0)
    assert r["seconds_to_refusal"] is not None and r["seconds_to_refusal"] < 3.5, r
    assert "did not" in r["reason"] and "within" in r["reason"], r


def test_a_frame_must_arrive_within_one_io_timeout(model_path):
    """The token ids 0.7 s after the header and the rows 0.7 s later: each part within the
    1 s io timeout, the frame as a whole not, so the worker drops it without an answer."""
    stage = Stage(ds4.Engine.open(model_path, layers=range(3, 5)), ctx=64, max_rows=8)
    w = Worker(stage, io_timeout=1.0).start()
    try:
        conn = qkp.Conn.connect("127.0.0.1", w.port, 5.0)
        hello = qkp.client_handshake(conn, None, False)
        rows = np.zeros((1, hello.n_hc, hello.n_embd), "<f4").tobytes()
        conn.send(qkp.Header(qkp.EVAL, 0, 1, 0, 0).pack())
        time.sleep(0.7)
        conn.send(np.array([1], "<u4").tobytes())
        time.sleep(0.7)
        with contextlib.suppress(OSError):
            conn.send(rows)
        with pytest.raises(qkp.QkpClosed) as e:
            conn.recv_exact(1, timeout=3.0)
        assert e.value.field == "eof"  # closed, not answered
        conn.close()
    finally:
        w.stop()


def test_a_bad_and_a_stalled_connection_do_not_end_the_receiver(payload, tmp_path):
    r = ds4k.Receiver(0, timeout=5.0)
    out: dict = {}

    def land():
        try:
            out["m"] = r.receive(tmp_path / "p.dsv4", accept_timeout=T_OUT)
        except ds4k.DS4KError as e:
            out["e"] = e

    t = threading.Thread(target=land, daemon=True)
    t.start()
    staller = socket.create_connection(("127.0.0.1", r.port), timeout=T_OUT)  # says nothing
    with socket.create_connection(("127.0.0.1", r.port), timeout=T_OUT) as bad:
        bad.recv(ds4k.HELLO.size)
        bad.sendall(b"GET / HTTP/1.0\r\n\r\n")
        status, reason = ds4k._read_reply(bad, "reply")
        assert status == ds4k.BAD_RECORD and "opener magic" in reason
    t0 = time.monotonic()
    sent = ds4k.send_payload(payload, "127.0.0.1", r.port, timeout=T_OUT)
    assert time.monotonic() - t0 < 3.0  # not behind the staller's 5 s timeout
    t.join(T_OUT)
    staller.close()
    r.close()
    assert out.get("m") == sent and (tmp_path / "p.dsv4").read_bytes() == payload
    assert len(r.failures) == 1 and "opener magic" in r.failures[0].reason


def test_a_receiver_keeps_the_latest_failures_only(payload, tmp_path, monkeypatch):
    """A receiver that waits on through failed connections counts them all but keeps only the
    latest KEPT_FAILURES (one waiting without a time limit would grow with every bad peer)."""
    from ds4.wire.ds4k import receiver

    monkeypatch.setattr(receiver, "KEPT_FAILURES", 2)
    r = ds4k.Receiver(0, timeout=5.0)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(m=r.receive(tmp_path / "p.dsv4", accept_timeout=T_OUT)),
                         daemon=True)
    t.start()
    for i in range(3):
        with socket.create_connection(("127.0.0.1", r.port), timeout=T_OUT) as bad:
            bad.recv(ds4k.HELLO.size)
            bad.sendall(b"GET /%d HTTP/1.0\r\n\r\n" % i)
            assert ds4k._read_reply(bad, "reply")[0] == ds4k.BAD_RECORD
    sent = ds4k.send_payload(payload, "127.0.0.1", r.port, timeout=T_OUT)
    t.join(T_OUT)
    r.close()
    assert out.get("m") == sent
    assert r.n_failures == 3 and len(r.failures) == 2


def test_cli_kv_recv_outlives_a_bad_connection(model_path, payload, tmp_path):
    """`ds4 kv-recv`: a garbage connection is one warning line; the real sender's payload lands."""
    import select
    import subprocess

    src = tmp_path / "s.dsv4"
    src.write_bytes(payload)
    dest = tmp_path / "in"
    dest.mkdir()
    code = "import typer; from cli.kv import register; app = typer.Typer(); register(app); app()"
    p = subprocess.Popen([sys.executable, "-c", code, "kv-recv", "0", "--out", str(dest / "r.dsv4"),
                          "-m", str(model_path), "--wait", "60"], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200",
                              "DS4_WIRE_TOKEN": ""})
    try:
        port, seen = None, ""
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            if select.select([p.stderr], [], [], 1.0)[0]:
                line = p.stderr.readline()
                seen += line
                if line.startswith("listening on "):
                    port = int(line.rsplit(":", 1)[1])
                elif not line:
                    break
        assert port, seen
        with socket.create_connection(("127.0.0.1", port), timeout=T_OUT) as bad:
            bad.recv(ds4k.HELLO.size)
            bad.sendall(bytes(16))
            assert ds4k._read_reply(bad, "reply")[0] == ds4k.BAD_RECORD
        ds4k.send_payload(src, "127.0.0.1", port, fingerprint=ds4.Engine.open(model_path).model.fingerprint,
                          timeout=T_OUT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert "received" in out and err.count("warning:") == 1 and "opener magic" in err
    assert (dest / "r.dsv4").read_bytes() == payload


def test_a_refused_manifest_gets_its_reason_and_the_receiver_waits(payload, tmp_path):
    r = ds4k.Receiver(0, timeout=5.0, fingerprint=bytes(32))
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(
        m=_catch(lambda: r.receive(tmp_path / "p.dsv4", accept_timeout=1.5))), daemon=True)
    t.start()
    with pytest.raises(ds4k.DS4KError, match="different model"):
        ds4k.send_payload(payload, "127.0.0.1", r.port, fingerprint=bytes(range(32)), timeout=T_OUT)
    t.join(T_OUT)
    r.close()
    e = out["m"]
    assert isinstance(e, ds4k.DS4KError) and "no payload landed within 1.5 s" in str(e)
    assert "different model" in str(e) and os.listdir(tmp_path) == []


def _catch(fn):
    try:
        return fn()
    except ds4k.DS4KError as e:
        return e


# ---- DS4K records under random input ---------------------------------------------------------------


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300),
                 json_values.map(lambda v: json.dumps(v).encode()),
                 st.integers(1, 20000).map(lambda d: b"[" * d + b"]" * d),
                 st.integers(1, 20000).map(lambda d: b'{"a":' * d + b"1" + b"}" * d)))
def test_any_manifest_is_parsed_or_refused_with_a_value_error(data):
    try:
        m = ds4k.Manifest.decode(data)
    except ValueError as e:
        assert str(e)
        return
    assert min(m.payload_bytes, m.n_tokens, m.ctx, m.version, m.created) >= 0
    assert len(m.sha256) == 64 and (m.fingerprint is None or len(m.fingerprint) == 64)
    assert ds4k.Manifest.decode(m.encode()) == m


@settings(max_examples=200, deadline=None)
@given(st.builds(ds4k.Manifest, st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex)),
                 st.integers(0, 2**63), st.binary(min_size=32, max_size=32).map(bytes.hex),
                 st.integers(0, 2**31), st.integers(0, 2**31), st.integers(0, 2**31),
                 st.integers(0, 2**40)))
def test_manifest_round_trip(m):
    assert ds4k.Manifest.decode(m.encode()) == m


@settings(max_examples=25, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.binary(max_size=64))
def test_any_record_header_is_refused_with_a_reason_or_read(header, tail):
    """A receiver answers any record header with a verdict; only a well-formed one gets OK."""
    r = ds4k.Receiver(0, timeout=1.0)
    res: dict = {}
    never = Path(tempfile.gettempdir()) / "ds4-test-never-lands.dsv4"
    t = threading.Thread(target=lambda: res.update(e=_catch(
        lambda: r.receive(never, accept_timeout=5.0, max_failures=1))), daemon=True)
    t.start()
    with socket.create_connection(("127.0.0.1", r.port), timeout=T_OUT) as c:
        c.recv(ds4k.HELLO.size)
        c.sendall(ds4k.OPENER.pack(ds4k.MAGIC) + header + tail)
        with contextlib.suppress(OSError):  # it may have answered and closed already
            c.shutdown(socket.SHUT_WR)
        status, reason = ds4k._read_reply(c, "verdict")
    t.join(T_OUT)
    r.close()
    magic, version, flags, n = struct.unpack("<4I", header)
    ok = magic == ds4k.MAGIC and version == ds4k.VERSION and flags == 0 and n <= ds4k.MAX_MANIFEST_BYTES
    assert (status == ds4k.OK) == ok, (status, reason)
    if not ok:
        assert reason and isinstance(res["e"], ds4k.DS4KError)


@settings(max_examples=30, deadline=None)
@given(st.one_of(st.binary(max_size=60),
                 st.builds(lambda v, f, rest: ds4k.HELLO.pack(ds4k.MAGIC, v, f, 0, rest),
                           st.sampled_from([1, 2, 3]), st.sampled_from([0, 1, 2, 3]),
                           st.binary(min_size=32, max_size=32))),
       st.booleans())
def test_any_receiver_hello_is_refused_before_model_data_or_accepted(hello, with_token):
    """A sender facing any hello sends model data (a manifest) only to a well-formed DS4K v2
    receiver that does not need a token it lacks, or that proves the one it has."""
    imp = Impostor(greeting=hello)
    imp.start()
    m = ds4k.Manifest(None, 100, "0" * 64, 1, 64, 2, 0)
    try:
        sock = ds4k.open_transfer("127.0.0.1", imp.port, m, auth_token="tok" if with_token else None,
                                  timeout=0.3)
        sock.close()
        accepted = True
    except ds4k.DS4KError:
        accepted = False
    got = imp.finish()
    assert not accepted  # an impostor never sends verdicts: the client must give up
    assert m.encode() not in got  # and the manifest never left


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=4, max_size=4), st.integers(0, 2**32 - 1), st.binary(max_size=40))
def test_any_qkp_client_hello_gets_a_hello_only_when_well_formed(magic, flags, tail):
    a, b = socket.socketpair()
    client, server = qkp.Conn(a, 0.5, "c"), qkp.Conn(b, 0.5, "s")
    client.send(magic + struct.pack("<I", flags) + tail)
    with contextlib.suppress(OSError):
        a.shutdown(socket.SHUT_WR)
    try:
        got = qkp.read_client_hello(server, "tok", False)
    except qkp.QkpError as e:
        got = e
    server.close()
    client.close()
    well_formed = magic == struct.pack("<I", qkp.MAGIC) and flags == qkp.FLAG_AUTH
    if not well_formed:
        assert isinstance(got, qkp.QkpError)
    else:  # a nonce may be there, the proof never is (random bytes are not the proof)
        assert isinstance(got, qkp.QkpError) and got.field in ("auth", "eof", "timeout")


# ---- memory per stranger ---------------------------------------------------------------------------


MAX_IDLE_STRANGER_BYTES = 64 << 10


def test_stalled_strangers_cost_little_worker_memory(model_path):
    """100 strangers each announce a max_rows EVAL frame (2 MiB of rows) and stall: the
    worker process grows by at most 64 KiB per connection, not by the announced size."""
    r = _bench().strangers(model_path, 100, "eval", settle=0.7)
    assert r["bytes_per_connection"] <= MAX_IDLE_STRANGER_BYTES, r


@pytest.mark.parametrize("trusted", [False, True])
def test_receive_buffers_grow_with_the_bytes_until_the_peer_is_trusted(trusted):
    """A 2 MiB read of which 100 bytes came: a stranger's connection holds about GROW_FROM,
    one that proved the token the whole buffer (tracemalloc's peak while it waits)."""
    import tracemalloc

    a, b = socket.socketpair()
    conn = qkp.Conn(b, 0.5, "peer")
    conn.trusted = trusted
    a.sendall(bytes(100))
    tracemalloc.start()
    try:
        with pytest.raises(qkp.QkpClosed, match="100 of 2097152 bytes"):
            conn.recv_exact(2 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        a.close()
        conn.close()
    if trusted:
        assert peak >= 2 << 20
    else:
        assert peak <= 2 * qkp.GROW_FROM


def test_max_conns_closes_the_rest(model_path):
    stage = Stage(ds4.Engine.open(model_path, layers=range(3, 5)), ctx=64, max_rows=8)
    w = Worker(stage, io_timeout=5.0, max_conns=2).start()
    socks = [socket.create_connection(("127.0.0.1", w.port), timeout=T_OUT) for _ in range(3)]
    try:
        socks[2].settimeout(3.0)
        assert socks[2].recv(1) == b""  # closed at once
        assert w.refused_conns == 1
        conn = qkp.Conn(socks[0], 5.0, "ok")
        assert qkp.client_handshake(conn, None, False) == stage.hello  # the first two are served
    finally:
        for s in socks:
            s.close()
        w.stop()


# ---- TLS -------------------------------------------------------------------------------------------


# (the `certs` fixture: conftest.py)


def test_qkp_and_ds4k_over_tls(certs, model_path, head_engine, payload, tmp_path):
    from ds4.wire import tls

    # qkp with mutual TLS (the worker requires a client certificate), DS4K with a server one
    files = tls.TlsFiles(certs / "cert.pem", certs / "key.pem", certs / "cert.pem")
    server, client = tls.server_context(files), tls.client_context(files)
    stage = Stage(ds4.Engine.open(model_path, layers=range(3, 5)), ctx=64, max_rows=8)
    w = Worker(stage, io_timeout=5.0, auth_token="tok", tls_server=server).start()
    try:
        with SplitEngine(head_engine, ("127.0.0.1", w.port), auth_token="tok", tls=client) as split:
            s = split.session(ctx=64)
            s.sync(PROMPT)
            whole = ds4.Engine.open(model_path).session(ctx=64)
            whole.sync(PROMPT)
            assert s.greedy == int(np.argmax(whole.logits))
        plain = SplitEngine(head_engine, ("127.0.0.1", w.port), auth_token="tok", io_timeout=1.0)
        with pytest.raises(PipelineRefused):  # a client without TLS gets nowhere
            plain.connect()
        no_cert = tls.client_context(tls.TlsFiles(ca=certs / "cert.pem"))
        anonymous = SplitEngine(head_engine, ("127.0.0.1", w.port), auth_token="tok", tls=no_cert)
        with pytest.raises(PipelineRefused, match="TLS with the next stage"):
            anonymous.connect()
        untrusting = ssl.create_default_context()  # the system's CAs never signed it
        with pytest.raises(ssl.SSLCertVerificationError):
            qkp.Conn.connect("127.0.0.1", w.port, 2.0, tls=untrusting)
    finally:
        w.stop()
    server = tls.server_context(tls.TlsFiles(certs / "cert.pem", certs / "key.pem"))
    client = tls.client_context(tls.TlsFiles(ca=certs / "cert.pem"))
    r = ds4k.Receiver(0, timeout=T_OUT, tls=server)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(m=r.receive(tmp_path / "p", T_OUT, max_failures=1)))
    t.start()
    ds4k.send_payload(payload, "127.0.0.1", r.port, timeout=T_OUT, tls=client)
    t.join(T_OUT)
    r.close()
    assert (tmp_path / "p").read_bytes() == payload


def test_tls_files_are_checked():
    from ds4.wire import tls

    with pytest.raises(ValueError, match="needs its certificate and key"):
        tls.server_context(tls.TlsFiles(ca="ca.pem"))
    with pytest.raises(ValueError, match="got only --tls-cert"):
        tls.client_context(tls.TlsFiles(cert="c.pem"))
    with pytest.raises(ValueError, match="cannot load"):
        tls.server_context(tls.TlsFiles("missing.pem", "missing.pem"))
    assert tls.server_context(None) is None and tls.client_context(tls.TlsFiles()) is None


def test_ds4t_over_tls(certs):
    """DS4T's hello, mutual proof and frames run unchanged inside TLS (the leader listens), and
    a worker that does not trust the leader's certificate gets nowhere."""
    import socket

    from test_ds4t import LEADER, LIMITS, WORKER, _both, _leader, _rows, _worker

    from ds4.wire import ds4t, tls

    server = tls.server_context(tls.TlsFiles(certs / "cert.pem", certs / "key.pem"))
    client = tls.client_context(tls.TlsFiles(ca=certs / "cert.pem"))
    with socket.create_server(("127.0.0.1", 0)) as ls:
        port = ls.getsockname()[1]

        def leader():
            conn, _ = ls.accept()
            with server.wrap_socket(conn, server_side=True) as s:
                return _leader(s)

        def worker():
            with client.wrap_socket(socket.create_connection(("127.0.0.1", port), 5.0),
                                    server_hostname="127.0.0.1") as s:
                return _worker(s)

        a, b = _both(leader, worker)
        assert a == (WORKER, 128) and b == (LEADER, 128, ds4t.Stop())

        # the gate exchange on a TLS data connection: both ranks hold the same rank-order sum
        def rank(r, wrap):
            with wrap() as s:
                ch = ds4t.GateChannel(s, LIMITS, r, 1 - r, gate_timeout_ms=5000)
                return ch.all_reduce(0, ds4t.Gate.ATTN, 1, _rows(r, rows=3))

        def leader_data():
            conn, _ = ls.accept()
            return server.wrap_socket(conn, server_side=True)

        def worker_data():
            return client.wrap_socket(socket.create_connection(("127.0.0.1", port), 5.0),
                                      server_hostname="127.0.0.1")

        a, b = _both(lambda: rank(0, leader_data), lambda: rank(1, worker_data))
        assert np.array_equal(a, _rows(0, rows=3) + _rows(1, rows=3)) and np.array_equal(a, b)

        def stranger():  # trusts only the system's CAs, which never signed the leader's
            with ssl.create_default_context().wrap_socket(socket.create_connection(("127.0.0.1", port), 5.0),
                                                          server_hostname="127.0.0.1") as s:
                return _worker(s)

        def leader_refused():
            conn, _ = ls.accept()
            try:
                server.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError) as e:
                return e
            return None

        a, b = _both(leader_refused, stranger)
        assert isinstance(b, ssl.SSLCertVerificationError)
