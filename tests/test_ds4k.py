"""DS4K transfers (wire.md §3) over real loopback sockets: exact bytes land atomically; a flipped
byte in transit, a sender killed half-way, another model's payload, an over-limit size, a wrong
auth token, a bad record and a stalled sender are each rejected with a clear reason on both ends
and leave nothing at the destination; and the CLI's network paths (`prefill --send-kv`,
`decode --recv-kv`, `kv-send`, `kv-recv`)."""

from __future__ import annotations

import io
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import ds4
from ds4.core.chat import encode_prompt
from ds4.core.tiny import make_tiny, preset_config
from ds4.wire import ds4k
from ds4.wire.ds4k import DS4KError, Receiver, send_payload

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, 512, 21)]
T_OUT = 10.0  # every socket wait in these tests is bounded


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("m") / "test.gguf", preset="test", seed=1)


@pytest.fixture(scope="module")
def eng(model_path):
    return ds4.Engine.open(model_path)


@pytest.fixture(scope="module")
def payload(eng) -> bytes:
    s = eng.session(ctx=64)
    s.sync(PROMPT)
    f = io.BytesIO()
    s.save_payload(f)
    return f.getvalue()


class Landing(threading.Thread):
    """receiver.receive(out) in a thread; .result is the manifest or the exception."""

    def __init__(self, receiver: Receiver, out: Path):
        super().__init__(daemon=True)
        self.receiver, self.out, self.result = receiver, out, None

    def run(self):
        try:
            self.result = self.receiver.receive(self.out, accept_timeout=T_OUT, max_failures=1)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.result = e

    def finish(self):
        self.join(T_OUT + 5)
        assert not self.is_alive(), "receiver hung"
        self.receiver.close()
        return self.result


def receiver(eng, **kw) -> Receiver:
    kw.setdefault("fingerprint", eng.model.fingerprint)
    kw.setdefault("config", eng.config)
    kw.setdefault("timeout", T_OUT)
    return Receiver(0, **kw)


def assert_rejected(landing: Landing, status: int, words: list[str], dest_dir: Path):
    err = landing.finish()
    assert isinstance(err, DS4KError), err
    assert err.status == status, (err.status, str(err))
    for w in words:
        assert w in str(err), str(err)
    assert os.listdir(dest_dir) == [], "something was left at the destination"


# ---- transfers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["bytes", "path"])
def test_payload_lands_byte_for_byte(eng, payload, tmp_path, source):
    dest = tmp_path / "in"
    dest.mkdir()
    src: object = payload
    if source == "path":
        src = tmp_path / "out.dsv4"
        src.write_bytes(payload)
    r = receiver(eng)
    assert r.host == "127.0.0.1"  # loopback unless told otherwise
    land = Landing(r, dest / "s.dsv4")
    land.start()
    sent = send_payload(src, "127.0.0.1", r.port, fingerprint=eng.model.fingerprint, timeout=T_OUT)
    got = land.finish()
    assert got == sent
    assert (sent.payload_bytes, sent.n_tokens, sent.ctx, sent.version) == (len(payload), 21, 64, 2)
    assert sent.fingerprint == eng.model.fingerprint.hex()
    assert (dest / "s.dsv4").read_bytes() == payload
    assert os.listdir(dest) == ["s.dsv4"]  # no temporary file left behind
    s = eng.session(ctx=64)
    s.load_payload(dest / "s.dsv4")
    assert s.tokens == PROMPT


def test_auth_token(eng, payload, tmp_path):
    r = receiver(eng, auth_token="s3cret")
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    send_payload(payload, "127.0.0.1", r.port, fingerprint=eng.model.fingerprint,
                 auth_token="s3cret", timeout=T_OUT)
    assert not isinstance(land.finish(), Exception)
    os.unlink(tmp_path / "s.dsv4")

    r = receiver(eng, auth_token="s3cret")
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="did not prove the auth token") as e:  # it checks first
        send_payload(payload, "127.0.0.1", r.port, fingerprint=eng.model.fingerprint,
                     auth_token="guess", timeout=T_OUT)
    assert e.value.status == ds4k.AUTH_FAILED
    assert_rejected(land, ds4k.INCOMPLETE, ["auth proof"], tmp_path)

    r = receiver(eng, auth_token="s3cret")
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="requires an auth token"):
        send_payload(payload, "127.0.0.1", r.port, fingerprint=eng.model.fingerprint, timeout=T_OUT)
    # it closed after the hello without a record: a failed connection, not a probe
    assert_rejected(land, ds4k.INCOMPLETE, ["closed"], tmp_path)


def _hmac(key: bytes, msg: bytes) -> bytes:
    import hashlib
    import hmac

    return hmac.new(key, msg, hashlib.sha256).digest()


def test_a_probe_proves_the_token_and_the_receiver_waits(eng, payload, tmp_path):
    """A probe (steps 0-5 with manifest_bytes 0) gets the same mutual proof as a transfer and a
    status 0 verdict; it is no failure, and the receiver still takes the next sender's payload."""
    r = receiver(eng, auth_token="s3cret")
    land = Landing(r, tmp_path / "s.dsv4")  # max_failures=1: a probe counted as one would end it
    land.start()
    # by hand, from the layout in ds4/wire/ds4k/__init__.py and auth.py
    with socket.create_connection(("127.0.0.1", r.port), timeout=T_OUT) as c:
        c.sendall(struct.pack("<I", 0x4B345344))  # the opener
        hello = ds4k._recv_exact(c, 48, "hello")
        assert struct.unpack_from("<4I", hello) == (0x4B345344, 3, 1, 0)
        sn, cn = hello[16:], bytes(range(7, 39))
        c.sendall(struct.pack("<4I", 0x4B345344, 3, 1, 0) + cn)
        verdict = ds4k._recv_exact(c, 8 + 32, "verdict")
        assert verdict == struct.pack("<2I", 0, 0) + _hmac(b"s3cret", b"ds4 wire auth v2 server\0DS4K" + cn + sn)
        c.sendall(_hmac(b"s3cret", b"ds4 wire auth v2 client\0DS4K" + cn + sn))
        assert ds4k._recv_exact(c, 8, "probe verdict") == struct.pack("<2I", 0, 0)
        assert c.recv(1) == b""  # and it closes
    ds4k.probe_receiver("127.0.0.1", r.port, auth_token="s3cret", timeout=T_OUT)
    assert r.failures == [] and land.is_alive()
    send_payload(payload, "127.0.0.1", r.port, fingerprint=eng.model.fingerprint,
                 auth_token="s3cret", timeout=T_OUT)
    assert not isinstance(land.finish(), Exception)
    assert (tmp_path / "s.dsv4").read_bytes() == payload and r.failures == []
    os.unlink(tmp_path / "s.dsv4")

    # a probe with the wrong token is stopped by the receiver's proof, before it proves anything
    r = receiver(eng, auth_token="s3cret")
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="did not prove the auth token") as e:
        ds4k.probe_receiver("127.0.0.1", r.port, auth_token="guess", timeout=T_OUT)
    assert e.value.status == ds4k.AUTH_FAILED
    assert_rejected(land, ds4k.INCOMPLETE, ["auth proof"], tmp_path)
    # a probe without a token against a receiver that wants one, and with one against one that
    # cannot prove it
    r = receiver(eng, auth_token="s3cret")
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="requires an auth token"):
        ds4k.probe_receiver("127.0.0.1", r.port, timeout=T_OUT)
    assert_rejected(land, ds4k.INCOMPLETE, ["closed"], tmp_path)
    r = receiver(eng)
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="does not prove the auth token"):
        ds4k.probe_receiver("127.0.0.1", r.port, auth_token="s3cret", timeout=T_OUT)
    assert_rejected(land, ds4k.INCOMPLETE, ["closed"], tmp_path)


class FlipProxy(threading.Thread):
    """Forwards one connection to `port`, flipping one bit of the sender's stream at `at`."""

    def __init__(self, port: int, at: int):
        super().__init__(daemon=True)
        self.target, self.at = port, at
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]

    def run(self):
        self.lsock.settimeout(T_OUT)
        with self.lsock, self.lsock.accept()[0] as c, \
                socket.create_connection(("127.0.0.1", self.target), timeout=T_OUT) as u:
            c.settimeout(T_OUT)

            def back():
                try:
                    while data := u.recv(1 << 16):
                        c.sendall(data)
                except OSError:
                    pass
                finally:
                    try:
                        c.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass

            t = threading.Thread(target=back, daemon=True)
            t.start()
            n = 0
            try:
                while data := c.recv(1 << 16):
                    if n <= self.at < n + len(data):
                        data = bytearray(data)
                        data[self.at - n] ^= 0x10
                    u.sendall(data)
                    n += len(data)
            except OSError:
                pass
            t.join(T_OUT)


def test_a_flipped_byte_in_transit_is_caught(eng, payload, tmp_path):
    r = receiver(eng)
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    proxy = FlipProxy(r.port, at=16 + 4096 + 777)  # past the record header and manifest
    proxy.start()
    with pytest.raises(DS4KError, match="SHA-256 mismatch") as e:
        send_payload(payload, "127.0.0.1", proxy.port, fingerprint=eng.model.fingerprint,
                     timeout=T_OUT)
    assert e.value.status == ds4k.CORRUPT
    assert_rejected(land, ds4k.CORRUPT, ["SHA-256 mismatch", "corrupted in transit"], tmp_path)
    proxy.join(T_OUT)


KILLED_SENDER = """
import os, signal, sys
from ds4.wire import ds4k
data = open(sys.argv[1], "rb").read()
m = ds4k.make_manifest(data, bytes.fromhex(sys.argv[3]))
sock = ds4k.open_transfer("127.0.0.1", int(sys.argv[2]), m, timeout=10)
sock.sendall(data[: len(data) // 2])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sender_killed_half_way_leaves_nothing(eng, payload, tmp_path):
    src = tmp_path / "src.dsv4"
    src.write_bytes(payload)
    dest = tmp_path / "in"
    dest.mkdir()
    r = receiver(eng)
    land = Landing(r, dest / "s.dsv4")
    land.start()
    p = subprocess.run([sys.executable, "-c", KILLED_SENDER, str(src), str(r.port),
                        eng.model.fingerprint.hex()], cwd=ROOT, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert_rejected(land, ds4k.INCOMPLETE,
                    [f"after {len(payload) // 2} of {len(payload)} payload bytes"], dest)


def test_a_model_that_shares_the_shown_digits_is_told_apart(eng, tmp_path):
    """Two fingerprints alike in their first 20 hex digits: the refusal shows both up to the first
    digit that differs and 3 more, so that the two never read the same."""
    mine = bytes.fromhex("ab" * 10 + "cd" + "00" * 21)
    theirs = "ab" * 10 + "ce" + "11" * 21
    r = receiver(eng, fingerprint=mine)
    try:
        m = ds4k.Manifest(theirs, 1, "00" * 32, 1, 1, 1, 0)
        with pytest.raises(DS4KError) as e:
            r._check_manifest(m, tmp_path / "s.dsv4")
    finally:
        r.close()
    # (digit 21 is the first that differs: 22 digits and 3 more)
    assert f"the manifest names model {'ab' * 10}ce111…, this receiver serves model {'ab' * 10}cd000…" in str(e.value)


def test_another_models_payload_is_refused(eng, payload, tmp_path):
    # A receiver serving another model: refused on the manifest, before the payload moves.
    r = receiver(eng, fingerprint=bytes(range(32)))
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="different model") as e:
        send_payload(payload, "127.0.0.1", r.port, fingerprint=eng.model.fingerprint, timeout=T_OUT)
    assert e.value.status == ds4k.REFUSED
    assert_rejected(land, ds4k.REFUSED, ["different model", eng.model.fingerprint.hex()[:16]], tmp_path)
    # A manifest without a fingerprint is refused by a receiver that has one.
    r = receiver(eng)
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="no model fingerprint"):
        send_payload(payload, "127.0.0.1", r.port, timeout=T_OUT)
    assert_rejected(land, ds4k.REFUSED, ["no model fingerprint"], tmp_path)
    # Same fingerprint claimed, but the payload's layout is another model's (the tiny preset).
    r = receiver(eng, fingerprint=None, config=preset_config("tiny"))
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="different DS4 layout"):
        send_payload(payload, "127.0.0.1", r.port, fingerprint=eng.model.fingerprint, timeout=T_OUT)
    assert_rejected(land, ds4k.CORRUPT, ["was written for a different DS4 layout"], tmp_path)


def test_an_over_limit_payload_is_refused_before_it_is_sent(eng, payload, tmp_path):
    r = receiver(eng, max_bytes=len(payload) - 1)
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    with pytest.raises(DS4KError, match="over the receiver's limit") as e:
        send_payload(payload, "127.0.0.1", r.port, fingerprint=eng.model.fingerprint, timeout=T_OUT)
    assert e.value.status == ds4k.REFUSED
    assert_rejected(land, ds4k.REFUSED, [f"{len(payload)} bytes is over", str(len(payload) - 1)], tmp_path)


def _raw_client(port: int, record: bytes) -> tuple[int, str]:
    """Send `record` after the opener and the hello; the first refusal (or the last OK) the
    receiver answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=T_OUT) as c:
        c.sendall(ds4k.OPENER.pack(ds4k.MAGIC))
        hello = ds4k._recv_exact(c, ds4k.HELLO.size, "hello")
        assert struct.unpack_from("<I", hello)[0] == ds4k.MAGIC
        c.sendall(record)
        status, reason = ds4k._read_reply(c, "reply")  # the verdict on the record header
        if status == ds4k.OK:
            status, reason = ds4k._read_reply(c, "reply")  # the verdict on the manifest
        return status, reason


@pytest.mark.parametrize("record, status, words", [
    (struct.pack("<4I", 0xDEADBEEF, 3, 0, 2) + b"{}", ds4k.BAD_RECORD, ["record magic"]),
    (struct.pack("<4I", ds4k.MAGIC, 9, 0, 2) + b"{}", ds4k.BAD_RECORD, ["record version"]),
    (struct.pack("<4I", ds4k.MAGIC, 3, 0, 1 << 20), ds4k.BAD_RECORD, ["manifest_bytes", "limit"]),
    (struct.pack("<4I", ds4k.MAGIC, 3, 0, 3) + b"{x]", ds4k.BAD_RECORD, ["JSON"]),
    (struct.pack("<4I", ds4k.MAGIC, 3, 0, 2) + b"{}", ds4k.BAD_RECORD, ["payload_bytes"]),
    (struct.pack("<4I", ds4k.MAGIC, 3, 0, 4000) + b"[" * 4000, ds4k.BAD_RECORD,
     ["nested 4000 deep", "flat JSON object"]),
    # an integer past json's 4300-digit limit: named as the manifest's, not json's bare text
    pytest.param(struct.pack("<4I", ds4k.MAGIC, 3, 0, 4419) + b'{"payload_bytes": ' + b"9" * 4400 + b"}",
                 ds4k.BAD_RECORD, ["manifest: a value JSON cannot read"], id="a 4400-digit integer"),
    (struct.pack("<4I", ds4k.MAGIC, 3, 1, 2) + bytes(32) + b"{}", ds4k.AUTH_FAILED,
     ["has no auth token"]),
])
def test_malformed_records_are_rejected(eng, tmp_path, record, status, words):
    r = receiver(eng)
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    got, reason = _raw_client(r.port, record)
    assert got == status and all(w in reason for w in words), reason
    assert_rejected(land, status, words, tmp_path)


def test_a_stalled_sender_times_out(eng, payload, tmp_path):
    r = receiver(eng, timeout=0.5)
    land = Landing(r, tmp_path / "s.dsv4")
    land.start()
    m = ds4k.make_manifest(payload, eng.model.fingerprint)
    with ds4k.open_transfer("127.0.0.1", r.port, m, timeout=T_OUT) as sock:
        sock.sendall(payload[:1000])
        assert_rejected(land, ds4k.INCOMPLETE, ["timed out", "1000 of"], tmp_path)


def test_sender_errors(eng, payload):
    with socket.create_server(("127.0.0.1", 0)) as s:  # a port nobody serves after close
        port = s.getsockname()[1]
    with pytest.raises(DS4KError, match=r"cannot connect.*\(retried for 0.3 s\)"):
        send_payload(payload, "127.0.0.1", port, timeout=1.0, connect_timeout=0.3)
    with pytest.raises(ValueError, match="unsupported session payload version.*expected 0x34565344, version 1 or 2"):
        send_payload(b"not a payload at all, but long enough to have a header......", "127.0.0.1", port)


# ---- CLI ----------------------------------------------------------------------------------------

CLI = "import typer; from cli.kv import register; app = typer.Typer(); register(app); app()"


@pytest.fixture(scope="module")
def cli():
    from cli.kv import register

    app = typer.Typer()
    register(app)
    runner = CliRunner()
    return lambda *args, **kw: runner.invoke(app, [str(a) for a in args], **kw)


def spawn(tmp_path, *args, env=None):
    """Start the CLI in a subprocess and wait for its `listening on HOST:PORT` line."""
    p = subprocess.Popen([sys.executable, "-c", CLI, *map(str, args)], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200",
                              "DS4_CACHE": str(tmp_path / "cache"), **(env or {})})
    deadline, seen = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stderr], [], [], 1.0)
        if ready:
            line = p.stderr.readline()
            seen += line
            if line.startswith("listening on "):
                return p, int(line.rsplit(":", 1)[1])
            if not line and p.poll() is not None:
                break
    p.kill()
    raise AssertionError(f"the receiver did not start: {seen}")


def finish(p):
    try:
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    return p.returncode, out, err


def test_cli_prefill_send_kv_to_decode_recv_kv(cli, eng, model_path, tmp_path):
    prompt = "Hello there"
    ids = encode_prompt(eng.tokenizer, prompt)
    s = eng.session(ctx=4096)
    s.sync(ids)
    want = []
    while len(want) < 8 and int(np.argmax(s.logits)) != eng.tokenizer.eos_id:
        want.append(int(np.argmax(s.logits)))
        s.eval(want[-1])
    p, port = spawn(tmp_path, "decode", "-m", model_path, "--recv-kv", 0, "-n", 8, "--temp", 0,
                    "--io-timeout", 30)
    r = cli("prefill", "-m", model_path, "-p", prompt, "--send-kv", f"127.0.0.1:{port}")
    rc, out, err = finish(p)
    assert r.exit_code == 0, r.output
    assert "sent" in r.stdout
    assert rc == 0, err
    assert out == eng.tokenizer.decode(want) + "\n"
    assert f"loaded: {len(ids)} tokens" in err


def test_cli_kv_send_and_kv_recv(cli, eng, model_path, payload, tmp_path):
    src = tmp_path / "s.dsv4"
    src.write_bytes(payload)
    dest = tmp_path / "in"
    dest.mkdir()
    p, port = spawn(tmp_path, "kv-recv", 0, "--out", dest / "r.dsv4", "-m", model_path,
                    env={"DS4_WIRE_TOKEN": "tok"})
    r = cli("kv-send", src, f"127.0.0.1:{port}", "-m", model_path, env={"DS4_WIRE_TOKEN": "tok"})
    rc, out, err = finish(p)
    assert r.exit_code == 0 and rc == 0, r.output + err
    assert "sent" in r.stdout and "received" in out
    assert (dest / "r.dsv4").read_bytes() == payload and os.listdir(dest) == ["r.dsv4"]

    # A refused transfer: both ends exit 1 with the reason, and nothing lands.
    os.unlink(dest / "r.dsv4")
    p, port = spawn(tmp_path, "kv-recv", 0, "--out", dest / "r.dsv4", "-m", model_path,
                    "--max-kv-bytes", "1K", "--wait", 3)
    r = cli("kv-send", src, f"127.0.0.1:{port}", "-m", model_path)
    rc, out, err = finish(p)
    assert r.exit_code == 1 and rc == 1
    assert "over the receiver's limit" in r.stderr and "over the receiver's limit" in err
    assert "Traceback" not in r.output + err
    assert os.listdir(dest) == []


def test_cli_kv_send_checks_the_file_first(cli, model_path, payload, tmp_path):
    bad = tmp_path / "bad.dsv4"
    bad.write_bytes(payload[:-200])  # the identity trailer and the end of the body are gone
    r = cli("kv-send", bad, "127.0.0.1:9", "-m", model_path)
    assert r.exit_code == 1 and "missing payload bytes" in r.stderr
    r = cli("kv-send", tmp_path / "none.dsv4", "127.0.0.1:9", "-m", model_path)
    assert r.exit_code == 1 and "not found" in r.stderr
    r = cli("kv-recv", 0, "--out", tmp_path / "no" / "dir" / "x.dsv4")
    assert r.exit_code == 1 and "does not exist" in r.stderr


def test_cli_kv_recv_checks_the_out_directory_at_startup(cli, tmp_path, read_only_dir):
    """A directory the payload cannot be written to is refused before listening (the receiver
    listened, and every transfer failed late on its temporary file); a path that names a
    directory is refused rather than written as a file."""
    r = cli("kv-recv", 0, "--out", read_only_dir / "x.dsv4", "--wait", 1)
    assert r.exit_code == 1 and f"--out: directory not writable: {read_only_dir}" in r.stderr, r.output
    assert "listening on" not in r.output
    dest = f"{tmp_path}/new/"
    r = cli("kv-recv", 0, "--out", dest, "--wait", 1)
    assert r.exit_code == 1, r.output
    assert f"--out: expected a file path, got a directory path {dest!r}" in r.stderr
    assert "listening on" not in r.output and sorted(os.listdir(tmp_path)) == ["ro"]


@pytest.fixture
def busy_port():
    """A loopback port another socket listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_cli_receivers_name_the_option_and_address_they_cannot_listen_on(cli, model_path, tmp_path,
                                                                          busy_port):
    out = tmp_path / "x.dsv4"
    r = cli("kv-recv", busy_port, "--out", out, "--wait", 1)
    assert r.exit_code == 1, r.output
    assert f"error: PORT: cannot listen on 127.0.0.1:{busy_port}: Address already in use" in r.stderr
    # the host's fault names --host (192.0.2.1: a documentation address, no machine's own)
    r = cli("kv-recv", 0, "--out", out, "--host", "192.0.2.1", "--wait", 1, env={"DS4_WIRE_TOKEN": "t"})
    assert r.exit_code == 1, r.output
    assert "error: --host: cannot listen on 192.0.2.1:0: " in r.stderr and "Errno" not in r.output
    r = cli("decode", "-m", model_path, "--recv-kv", busy_port, "--wait", 1)
    assert r.exit_code == 1, r.output
    assert f"error: --recv-kv: cannot listen on 127.0.0.1:{busy_port}: Address already in use" in r.stderr
    assert "Traceback" not in r.output and not out.exists()


def test_decode_recv_kv_binds_before_it_loads_the_model(cli, tmp_path, busy_port):
    """`decode --recv-kv` binds its port before it opens the model (minutes for the real one): a
    port in use is its error even when the model is no GGUF at all, with --tp-listen too."""
    not_a_model = tmp_path / "not-a-model.gguf"
    not_a_model.write_bytes(b"not a GGUF file\n" * 64)
    want = f"error: --recv-kv: cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    for extra in [[], ["--tp-listen", "127.0.0.1:0", "--tp-wait", 0.2]]:
        r = cli("decode", "-m", not_a_model, "--recv-kv", busy_port, "--wait", 1, *extra)
        assert r.exit_code == 1 and want in r.stderr, (extra, r.output)
        assert "Traceback" not in r.output


def test_a_status_reply_cuts_its_reason_at_a_character():
    """A status record is {u32 status, u32 reason_bytes} + UTF-8 reason of at most 4096 bytes
    (written out here from wire.md); an over-long reason is cut at a character boundary, so a
    two-byte character straddling the limit goes whole."""
    assert ds4k.records._reply(7, "ok") == struct.pack("<II", 7, 2) + b"ok"
    assert ds4k.records._reply(0) == struct.pack("<II", 0, 0)
    cut = ds4k.records._reply(3, "a" * 4095 + "é" + "b")
    assert cut == struct.pack("<II", 3, 4095) + b"a" * 4095
    whole = ds4k.records._reply(3, "a" * 4094 + "é")
    assert whole == struct.pack("<II", 3, 4096) + ("a" * 4094 + "é").encode()
