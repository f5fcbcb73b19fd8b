"""One end with TLS, the other without, and a pipeline numerics mismatch: each fails at once, on
both ends, with an error that names the mismatch (ds4/wire/sniff.py, ds4/wire/refusal.py).

Every pair runs on loopback sockets with io timeouts of SLOW_S, and must fail within FAST_S:
before these checks a plain DS4K sender and a TLS receiver waited for each other until the io
timeout, a plain tp-worker retried a TLS leader's silent close until its connect timeout, and
a pipeline head got a list of possible causes for a closed connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ds4
from ds4.core.gguf_model import GGUFModel
from ds4.core.tiny import make_tiny
from ds4.pipeline import PipelineRefused, SplitEngine, Stage, Worker
from ds4.tp.link import Options, TPRefused, accept_worker, join_leader, listen
from ds4.wire import ds4k, ds4t, qkp, refusal, sniff, tls

ROOT = Path(__file__).resolve().parents[1]
SLOW_S = 30.0  # every io timeout here: a mismatch that waits for one fails the FAST_S bound
FAST_S = 2.0  # a mismatch must fail within this on loopback (measured: a few ms)
T_OUT = 60.0  # bound on the waits of the test itself
CLI_TP_WAIT_S = 15  # the CLI leader's --tp-wait: room for the worker process to start and be refused


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("mix") / "test.gguf", preset="test", seed=1)


@pytest.fixture(scope="module")
def contexts(certs):
    """(server, client) contexts: the server's certificate, trusted by the client."""
    return (tls.server_context(tls.TlsFiles(certs / "cert.pem", certs / "key.pem")),
            tls.client_context(tls.TlsFiles(ca=certs / "cert.pem")))


class Timed:
    """`with Timed() as t: ...` -> t.seconds."""

    def __enter__(self):
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.seconds = time.monotonic() - self.t0


def test_looks_like_tls_reads_the_first_two_bytes_only():
    assert sniff.looks_like_tls(bytes([0x16, 0x03, 0x01]))  # a ClientHello's record
    assert sniff.looks_like_tls(bytes([0x15, 0x03]))  # an alert
    assert not sniff.looks_like_tls(bytes([0x16]))  # one byte says nothing yet
    for plain in (ds4k.OPENER.pack(ds4k.MAGIC), qkp.CLIENT_HELLO.pack(qkp.MAGIC, 0), b"T4SD",
                  b"GET / HTTP/1.1", bytes([0x16, 0x02])):
        assert not sniff.looks_like_tls(plain), plain


STALL_S = 1.0  # how long a peer that sent part of a TLS prefix stalls
# CPU the peek's thread may burn meanwhile. Measured per second of stall: a 1 ms retry loop
# 0.015 s; SO_RCVLOWAT 0.0002 s; the doubling back-off 0.0009 s.
STALL_CPU_BOUND_S = 0.005


@pytest.mark.parametrize("rcvlowat", [True, False], ids=["rcvlowat", "backoff"])
def test_peek_prefix_waits_for_a_stalled_byte_without_spinning(rcvlowat, monkeypatch):
    """A peer that sends one byte of the two-byte prefix and stalls: the peek waits for the
    rest without burning CPU (with SO_RCVLOWAT, or by backing off where there is none), and the
    timeout says how many bytes came."""
    if not rcvlowat:
        monkeypatch.setattr(sniff, "_set_rcvlowat", lambda sock, n: None)
    with socket.create_server(("127.0.0.1", 0)) as lsock, \
            socket.create_connection(lsock.getsockname()) as peer:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(SLOW_S)
            peer.sendall(bytes([sniff.TLS_HANDSHAKE_RECORD]))
            cpu0, t0 = time.thread_time(), time.monotonic()
            with pytest.raises(TimeoutError) as e:
                sniff.peek_prefix(conn, sniff.Deadline(STALL_S, "the peer's first bytes"))
            cpu, took = time.thread_time() - cpu0, time.monotonic() - t0
            assert conn.gettimeout() == SLOW_S  # (restored for the TLS handshake)
            assert conn.recv(2) == bytes([sniff.TLS_HANDSHAKE_RECORD])  # (peeked, not read)
    assert cpu < STALL_CPU_BOUND_S, cpu
    assert STALL_S <= took < STALL_S + FAST_S, took
    assert str(e.value) == f"the peer's first bytes: expected 2 bytes within {STALL_S:g} s, got 1"


def test_peek_prefix_says_no_bytes_came_when_none_did():
    with socket.create_server(("127.0.0.1", 0)) as lsock, \
            socket.create_connection(lsock.getsockname()):
        conn, _ = lsock.accept()
        with conn, pytest.raises(TimeoutError, match="expected 2 bytes within 0.2 s, got 0"):
            sniff.peek_prefix(conn, sniff.Deadline(0.2, "the peer's first bytes"))


class _Refusal:
    """A wire's refusal for `sniff.accept_tls`, counting its calls."""

    def __init__(self, record: bytes | None):
        self.record, self.error, self.calls = record, ValueError("plain peer"), 0

    def __call__(self):
        self.calls += 1
        return self.error, self.record


@contextlib.contextmanager
def _accepted():
    """(the server's accepted socket, the peer's), on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as lsock, \
            socket.create_connection(lsock.getsockname(), timeout=T_OUT) as peer:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(SLOW_S)
            yield conn, peer


def _read_to_eof(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got


@pytest.mark.parametrize("record", [b"NO TLS HERE", None], ids=["record", "caller-answers"])
def test_accept_tls_refuses_a_plain_peer_with_the_wires_record(contexts, record):
    """A plain peer gets no handshake: the wire's record (none where its caller answers), then
    the end of the connection, and the wire's error is raised."""
    server, _ = contexts
    refusal, plain = _Refusal(record), b"GET / HTTP/1.0\r\n\r\n"
    with _accepted() as (conn, peer):
        peer.sendall(plain)
        peer.shutdown(socket.SHUT_WR)  # (the refusal's drain ends at once)
        with pytest.raises(ValueError) as e:
            sniff.accept_tls(server, conn, sniff.Deadline(SLOW_S, "first bytes"), refusal)
        assert e.value is refusal.error and refusal.calls == 1
        if record is None:  # (nothing was read either: DS4K's caller reads the opener next)
            assert conn.recv(len(plain)) == plain
            conn.shutdown(socket.SHUT_WR)
        assert _read_to_eof(peer) == (record or b"")  # (a reset would raise here)


def test_accept_tls_wraps_a_tls_peer_and_refuses_nothing(contexts):
    """A ClientHello gets the handshake: what comes back carries the peer's bytes over TLS."""
    server, client = contexts
    refusal = _Refusal(b"NO TLS HERE")
    with _accepted() as (conn, peer):
        def dial():
            with client.wrap_socket(peer, server_hostname="127.0.0.1") as c:
                c.sendall(b"ping")
                c.recv(1)

        t = threading.Thread(target=dial, daemon=True)
        t.start()
        with sniff.accept_tls(server, conn, sniff.Deadline(SLOW_S, "first bytes"), refusal) as s:
            assert isinstance(s, ssl.SSLSocket) and s.recv(4) == b"ping"
            s.sendall(b"!")
        t.join(T_OUT)
    assert refusal.calls == 0


# ---- DS4K: prefill --send-kv / kv-send against decode --recv-kv / kv-recv ------------------------


def _receiving(r: ds4k.Receiver, tmp_path: Path) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["m"] = r.receive(tmp_path / "p.dsv4", accept_timeout=T_OUT, max_failures=1)
        except ds4k.DS4KError as e:
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_ds4k_plain_sender_at_a_tls_receiver_fails_at_once(contexts, tmp_path):
    server, _ = contexts
    with ds4k.Receiver(0, timeout=SLOW_S, tls=server) as r:
        t, out = _receiving(r, tmp_path)
        with Timed() as took, pytest.raises(ds4k.DS4KError) as e:
            ds4k.probe_receiver("127.0.0.1", r.port, timeout=SLOW_S)  # what prefill runs first
        t.join(T_OUT)
    assert took.seconds < FAST_S, took.seconds
    assert e.value.status == ds4k.TLS_MISMATCH
    assert "refused the connection (TLS mismatch): the sender connected in plain text but this " \
        "receiver requires TLS" in str(e.value) and "--tls-ca" in str(e.value)
    got = out["e"]  # the receiver's side of it
    assert got.status == ds4k.TLS_MISMATCH and "the sender connected in plain text" in got.reason
    assert os.listdir(tmp_path) == []


def test_ds4k_tls_sender_at_a_plain_receiver_fails_at_once(contexts, tmp_path):
    _, client = contexts
    with ds4k.Receiver(0, timeout=SLOW_S) as r:
        t, out = _receiving(r, tmp_path)
        with Timed() as took, pytest.raises(ds4k.DS4KError) as e:
            ds4k.probe_receiver("127.0.0.1", r.port, timeout=SLOW_S, tls=client)
        t.join(T_OUT)
    assert took.seconds < FAST_S, took.seconds
    assert e.value.status == ds4k.TLS_MISMATCH
    assert f"the receiver at 127.0.0.1:{r.port} answered in plain text, not TLS" in str(e.value)
    got = out["e"]
    assert got.status == ds4k.TLS_MISMATCH
    assert "the sender speaks TLS" in got.reason and "this receiver runs without TLS" in got.reason


RECV_TIMEOUT_S = 1.5  # a receiver's io timeout where the test waits for it to pass
TRICKLE_PAUSE = 0.6  # the part of it a stranger waits between its two first bytes


def test_ds4k_a_trickling_stranger_holds_a_tls_receiver_for_one_io_timeout(contexts, tmp_path):
    """The peek at the first bytes and the read of the opener share one deadline: a stranger
    that sends a byte, waits, sends one more and stalls is dropped one io timeout after it
    connected (each had a deadline of its own: 1 + TRICKLE_PAUSE io timeouts here)."""
    server, _ = contexts
    with ds4k.Receiver(0, timeout=RECV_TIMEOUT_S, tls=server) as r:
        t, out = _receiving(r, tmp_path)
        with socket.create_connection(("127.0.0.1", r.port), timeout=T_OUT) as c:
            t0 = time.monotonic()
            c.sendall(b"G")
            time.sleep(RECV_TIMEOUT_S * TRICKLE_PAUSE)
            c.sendall(b"E")
            t.join(T_OUT)
            took = time.monotonic() - t0
    assert RECV_TIMEOUT_S <= took < RECV_TIMEOUT_S * (1 + TRICKLE_PAUSE / 2), took
    assert f"the sender's first bytes and opener did not complete within {RECV_TIMEOUT_S:g} s" \
        in out["e"].reason, out


def test_ds4k_a_stranger_at_a_tls_receiver_is_told_too(contexts, tmp_path):
    """Plain bytes that are not a DS4K opener: refused in plain text, in the receiver's words."""
    server, _ = contexts
    with ds4k.Receiver(0, timeout=SLOW_S, tls=server) as r:
        t, out = _receiving(r, tmp_path)
        with socket.create_connection(("127.0.0.1", r.port), timeout=T_OUT) as c:
            c.sendall(b"GET / HTTP/1.0\r\n\r\n")
            status, reason = ds4k._read_reply(c, "reply")
        t.join(T_OUT)
    assert status == ds4k.TLS_MISMATCH and "requires TLS" in reason and "474554" in reason
    assert out["e"].status == ds4k.TLS_MISMATCH


def test_ds4k_a_tls_receiver_sends_its_hello_at_once_to_an_old_sender(contexts, tmp_path):
    """A version-2 sender speaks TLS, sends nothing first (it has no opener) and waits for the
    hello: a TLS receiver sends it right after the handshake, so the sender sees version 3 at
    once (were the receiver to wait for the opener first, both would wait for the io timeout)."""
    server, client = contexts
    with ds4k.Receiver(0, timeout=SLOW_S, tls=server) as r:
        t, out = _receiving(r, tmp_path)
        with Timed() as took, socket.create_connection(("127.0.0.1", r.port), timeout=5) as raw, \
                client.wrap_socket(raw, server_hostname="127.0.0.1") as c:
            hello = ds4k._recv_exact(c, ds4k.HELLO.size, "the hello")
        t.join(T_OUT)
    assert took.seconds < FAST_S, took.seconds
    magic, version, _flags, _zero, _nonce = ds4k.HELLO.unpack(hello)
    assert (magic, version) == (ds4k.MAGIC, ds4k.VERSION) and ds4k.VERSION == 3
    assert out["e"].status == ds4k.INCOMPLETE  # (the old sender hung up after the hello)
    assert os.listdir(tmp_path) == []


def _spawn_kv_recv(tmp_path: Path, *args) -> tuple[subprocess.Popen, int]:
    code = "import typer; from cli.kv import register; app = typer.Typer(); register(app); app()"
    p = subprocess.Popen([sys.executable, "-c", code, "kv-recv", "0", *map(str, args)], cwd=ROOT,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200",
                              "DS4_WIRE_TOKEN": "", "DS4_CACHE": str(tmp_path / "cache")})
    deadline, seen = time.monotonic() + T_OUT, ""
    while time.monotonic() < deadline:
        if select.select([p.stderr], [], [], 1.0)[0]:
            line = p.stderr.readline()
            seen += line
            if line.startswith("listening on "):
                return p, int(line.rsplit(":", 1)[1])
            if not line:
                break
    p.kill()
    raise AssertionError(f"kv-recv did not start: {seen}")


def test_cli_prefill_send_kv_plain_at_a_tls_kv_recv(model_path, certs, tmp_path):
    """`ds4 prefill --send-kv` without TLS against `ds4 kv-recv --tls-cert/--tls-key`: the prefill
    fails at its probe, before prefilling, with the receiver's reason; the receiver prints one
    warning line naming the mismatch at once and keeps waiting for a sender that fits."""
    from cli.kv import register
    import typer

    p, port = _spawn_kv_recv(tmp_path, "--out", tmp_path / "r.dsv4", "--wait", "60",
                             "--io-timeout", SLOW_S, "--tls-cert", certs / "cert.pem",
                             "--tls-key", certs / "key.pem")
    try:
        app = typer.Typer()
        register(app)
        with Timed() as took:
            r = CliRunner().invoke(app, ["prefill", "-m", str(model_path), "-p", "hi", "--send-kv",
                                         f"127.0.0.1:{port}", "--io-timeout", str(SLOW_S)],
                                   env={"COLUMNS": "200", "DS4_WIRE_TOKEN": ""})
        assert r.exit_code == 1, r.output
        assert "receiver refused the connection (TLS mismatch)" in r.stderr, r.stderr
        assert "requires TLS" in r.stderr and "prefilling" not in r.stderr
        assert took.seconds < SLOW_S / 2, took.seconds  # (the whole command, model load included)
        line = ""
        while "warning:" not in line and select.select([p.stderr], [], [], FAST_S)[0]:
            line = p.stderr.readline()
        assert "warning:" in line
        assert "connected in plain text but this receiver requires TLS" in line
        assert p.poll() is None  # still waiting
    finally:
        p.kill()
        p.communicate()


# ---- DS4T: tp-worker against --tp-listen ---------------------------------------------------


def _leading(model, opts: Options) -> tuple[socket.socket, threading.Thread, dict]:
    lsock = listen("127.0.0.1", 0)
    out: dict = {}

    def run():
        try:
            out["pair"] = accept_worker(lsock, model, 64, opts, wait_s=SLOW_S)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["e"] = e
        out["t"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lsock, t, out


@pytest.mark.parametrize("leader_tls", [True, False], ids=["tls-leader", "plain-leader"])
def test_ds4t_mismatch_fails_the_worker_at_once_and_the_leader_waits_on(model_path, contexts,
                                                                        leader_tls, caplog):
    """The worker of the other TLS kind fails at once with the mismatch; the leader (without a
    token) logs the reason and keeps waiting, since any stranger could send what that worker
    sent, and a worker that fits still joins."""
    server, client = contexts
    model = GGUFModel(model_path)
    lead = Options(io_timeout=SLOW_S, tls=server if leader_tls else None)
    wrong = Options(io_timeout=SLOW_S, tls=None if leader_tls else client)
    right = Options(io_timeout=SLOW_S, tls=client if leader_tls else None)
    lsock, t, out = _leading(model, lead)
    port = lsock.getsockname()[1]
    try:
        with caplog.at_level(logging.WARNING, logger="ds4.tp"):
            with Timed() as took, pytest.raises(TPRefused) as e:  # not TPClosed: no retries
                join_leader("127.0.0.1", port, model, wrong, connect_timeout=SLOW_S)
            assert took.seconds < FAST_S, took.seconds
            _wait_for_log(caplog, "tls: the worker")
            _a_worker_still_joins(port, t, out, model, right)
    finally:
        lsock.close()
    if leader_tls:
        assert "refused this worker: tls: the worker connected in plain text but this leader " \
            "requires TLS" in str(e.value)
        assert "tls: the worker connected in plain text" in caplog.text
    else:
        assert "answered in plain text, not TLS" in str(e.value)
        assert "tls: the worker speaks TLS" in caplog.text
        assert "this leader runs without TLS" in caplog.text


def _a_worker_still_joins(port: int, t: threading.Thread, out: dict, model, opts: Options) -> None:
    """The leader (_leading) is still waiting, nothing having ended its wait: a worker that fits
    joins it."""
    assert t.is_alive() and "e" not in out, out
    pair = join_leader("127.0.0.1", port, model, opts, connect_timeout=SLOW_S)
    t.join(T_OUT)
    pair.close()
    out["pair"].close()


def _wait_for_log(caplog, text: str) -> None:
    """Until `text` is logged (the leader's handshake threads log a dropped peer)."""
    give_up = time.monotonic() + T_OUT
    while text not in caplog.text:
        assert time.monotonic() < give_up, caplog.text
        time.sleep(0.01)


def _stranger(port: int, payload: bytes) -> None:
    """Connect, send `payload`, and read until the leader closes (or a short while passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=FAST_S) as s:
        s.sendall(payload)
        with contextlib.suppress(OSError):
            while s.recv(4096):
                pass


def _client_hello() -> bytes:
    """The first flight of a real TLS client (its ClientHello), as a stranger would send it."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls_obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls_obj.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("case", ["http-at-mtls-leader", "client-hello-at-plain-leader",
                                  "refusal-at-plain-leader"])
def test_ds4t_a_stranger_cannot_end_a_leaders_wait(model_path, certs, contexts, case, caplog):
    """A leader without a token that meets a stranger (an HTTP request at a mutual-TLS leader, a
    TLS ClientHello at a plain one, a DS4R refusal record, which only a leader may send) logs it
    with the reason, drops it and keeps waiting; a worker that fits joins afterwards."""
    server, client = contexts
    model = GGUFModel(model_path)
    if case == "http-at-mtls-leader":
        files = tls.TlsFiles(certs / "cert.pem", certs / "key.pem", certs / "cert.pem")
        lead = Options(io_timeout=SLOW_S, tls=tls.server_context(files))
        right = Options(io_timeout=SLOW_S, tls=tls.client_context(files))
        payload, reason = b"GET / HTTP/1.0\r\n\r\n", "tls: the worker connected in plain text"
    elif case == "client-hello-at-plain-leader":
        lead = right = Options(io_timeout=SLOW_S)
        payload, reason = _client_hello(), "tls: the worker speaks TLS"
    else:
        lead = right = Options(io_timeout=SLOW_S)
        payload = refusal.pack(ds4t.REFUSAL_MAGIC, "go away")
        reason = f"magic: expected {ds4t.MAGIC:#010x} (DS4T hello), got {ds4t.REFUSAL_MAGIC:#010x}"
    lsock, t, out = _leading(model, lead)
    port = lsock.getsockname()[1]
    try:
        with caplog.at_level(logging.WARNING, logger="ds4.tp"):
            _stranger(port, payload)
            _wait_for_log(caplog, reason)
            _a_worker_still_joins(port, t, out, model, right)
    finally:
        lsock.close()
    assert "refused 127.0.0.1" in caplog.text


def test_ds4t_a_tls_leader_with_a_token_tells_a_plain_worker_and_waits_on(model_path, contexts):
    """With a token, a peer that proved nothing cannot end the leader's wait: the plain worker
    is refused with the reason, and the leader still pairs with a worker that fits."""
    server, client = contexts
    model = GGUFModel(model_path)
    lsock, t, out = _leading(model, Options(io_timeout=SLOW_S, tls=server, auth_token="s3cret"))
    port = lsock.getsockname()[1]
    try:
        with Timed() as took, pytest.raises(TPRefused, match="requires TLS"):
            join_leader("127.0.0.1", port, model, Options(io_timeout=SLOW_S, auth_token="s3cret"),
                        connect_timeout=SLOW_S)
        assert took.seconds < FAST_S and t.is_alive()
        pair = join_leader("127.0.0.1", port, model,
                           Options(io_timeout=SLOW_S, auth_token="s3cret", tls=client),
                           connect_timeout=SLOW_S)
        t.join(T_OUT)
        pair.close()
        out["pair"].close()
    finally:
        lsock.close()


def test_cli_plain_tp_worker_at_a_tls_leader_exits_at_once(model_path, certs, tmp_path, caplog):
    """`ds4 tp-worker` without TLS against `ds4 generate --tp-listen --tls-cert/--tls-key`: the
    worker exits with the leader's reason instead of retrying for its --connect-timeout; the
    leader logs the mismatch and waits on (a stranger must not end its wait) until --tp-wait."""
    from cli.main import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import app; app()", "tp-worker", "--leader",
         f"127.0.0.1:{port}", "-m", str(model_path), "--backend", "reference",
         "--connect-timeout", "60"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200",
                                     "DS4_WIRE_TOKEN": "", "DS4_CACHE": str(tmp_path / "cache")})
    try:
        with caplog.at_level(logging.WARNING, logger="ds4.tp"):
            r = CliRunner().invoke(app, ["generate", "-m", str(model_path), "-p", "hi", "-n", "2",
                                         "--backend", "reference", "--tp-listen",
                                         f"127.0.0.1:{port}", "--tp-wait", str(CLI_TP_WAIT_S),
                                         "--tls-cert", str(certs / "cert.pem"),
                                         "--tls-key", str(certs / "key.pem")],
                                   env={"COLUMNS": "200", "DS4_WIRE_TOKEN": "",
                                        "DS4_CACHE": str(tmp_path / "cache")})
        _, err = w.communicate(timeout=15)  # (it retried for 60 s before)
    finally:
        w.kill()
    assert r.exit_code == 1 and "no worker joined" in r.stderr, r.output
    assert "the worker connected in plain text but this leader requires TLS" in caplog.text
    assert w.returncode == 1 and "refused this worker: tls: the worker connected in plain text" \
        in err, err


# ---- qkp: pipe-worker against --split-next -------------------------------------------------


@pytest.fixture(scope="module")
def head_engine(model_path):
    return ds4.Engine.open(model_path, layers=range(0, 3))


def _stage(model_path, numerics="ds4") -> Stage:
    return Stage(ds4.Engine.open(model_path, layers=range(3, 5), numerics=numerics), ctx=64,
                 max_rows=8)


@pytest.mark.parametrize("token", [None, "s3cret"])
@pytest.mark.parametrize("stage_tls", [True, False], ids=["tls-stage", "plain-stage"])
def test_qkp_tls_mismatch_fails_at_once_on_both_ends(model_path, head_engine, contexts, caplog,
                                                     stage_tls, token):
    server, client = contexts
    w = Worker(_stage(model_path), io_timeout=SLOW_S, auth_token=token,
               tls_server=server if stage_tls else None).start()
    try:
        split = SplitEngine(head_engine, ("127.0.0.1", w.port), auth_token=token or "",
                            io_timeout=SLOW_S, tls=None if stage_tls else client)
        with caplog.at_level(logging.WARNING, "ds4.pipeline"), Timed() as took, \
                pytest.raises(PipelineRefused) as e:
            split.connect()
        deadline = time.monotonic() + FAST_S
        while "tls:" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)  # (the worker's thread logs as it closes)
    finally:
        w.stop()
    assert took.seconds < FAST_S, took.seconds
    if stage_tls:
        assert f"the next stage at 127.0.0.1:{w.port} refused this head: tls: the client connected " \
            "in plain text but this stage requires TLS" in str(e.value)
        assert "tls: the client connected in plain text but this stage requires TLS" in caplog.text
    else:
        assert f"the stage at 127.0.0.1:{w.port} answered in plain text, not TLS" in str(e.value)
        assert "tls: the client speaks TLS" in caplog.text
        assert "this stage runs without TLS" in caplog.text


@pytest.mark.parametrize("token,with_tls", [(None, False), ("s3cret", False), ("s3cret", True)])
def test_qkp_numerics_mismatch_names_the_field_and_both_values(model_path, head_engine, contexts,
                                                               caplog, token, with_tls):
    server, client = contexts if with_tls else (None, None)
    w = Worker(_stage(model_path, "exact"), io_timeout=SLOW_S, auth_token=token,
               tls_server=server).start()
    try:
        split = SplitEngine(head_engine, ("127.0.0.1", w.port), auth_token=token or "",
                            io_timeout=SLOW_S, tls=client)  # ds4 numerics
        with caplog.at_level(logging.WARNING, "ds4.pipeline"), Timed() as took, \
                pytest.raises(PipelineRefused) as e:
            split.connect()
        deadline = time.monotonic() + FAST_S
        while "numerics" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    want = "numerics: expected exact (the stage's --numerics), got ds4 (the client's)"
    assert took.seconds < FAST_S
    assert f"the next stage at 127.0.0.1:{w.port} refused this head: {want}" in str(e.value)
    assert want in caplog.text


def test_qkp_a_middle_stage_passes_its_next_stages_refusal_on(model_path, head_engine):
    """The last stage runs exact numerics, the middle stage and the head ds4: the head learns
    which stage refused and why, not that a connection closed."""
    last = Worker(Stage(ds4.Engine.open(model_path, layers=range(4, 5), numerics="exact"), ctx=64,
                        max_rows=8), io_timeout=SLOW_S).start()
    mid = Worker(Stage(ds4.Engine.open(model_path, layers=range(3, 4)), ctx=64, max_rows=8),
                 io_timeout=SLOW_S, next_addr=("127.0.0.1", last.port)).start()
    try:
        split = SplitEngine(head_engine, ("127.0.0.1", mid.port), io_timeout=SLOW_S)
        with Timed() as took, pytest.raises(PipelineRefused) as e:
            split.connect()
    finally:
        mid.stop()
        last.stop()
    assert took.seconds < FAST_S
    assert f"refused this head: next: the next stage at 127.0.0.1:{last.port} refused: numerics: " \
        "expected exact (the stage's --numerics), got ds4 (the client's)" in str(e.value)
