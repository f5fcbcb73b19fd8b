"""Drill: signals leave nothing behind. The `ds4` CLI (and a bare atomic writer) run in a
subprocess, are stopped with SIGTERM or SIGINT in the middle of writing, and must leave no
`.part` file beside the target and no `ds4-kv-*` directory in the temporary directory."""

from __future__ import annotations

import hashlib
import io
import json
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

import ds4
from ds4.core.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
DS4 = "import sys; from cli.main import main; sys.argv[0] = 'ds4'; main()"
T_OUT = 30.0
SIGNALS = [signal.SIGTERM, signal.SIGINT]
# Each child first puts SIGINT and SIGHUP back as a fresh Python has them: a suite started in the
# background (`&` ignores SIGINT) or under nohup (SIGHUP) passes the ignoring on to its children,
# and a command that inherits it rightly stays deaf to that signal.
FRESH_SIGNALS = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n")
HELLO_BYTES, REPLY_BYTES, OPENER_BYTES = 48, 8, 4  # DS4K (ds4/wire/ds4k/)
DS4K_MAGIC, DS4K_VERSION = 0x4B345344, 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("m") / "test.gguf", preset="test", seed=1)


@pytest.fixture(scope="module")
def payload(model_path) -> bytes:
    eng = ds4.Engine.open(model_path)
    s = eng.session(ctx=64)
    s.sync([int(x) for x in np.random.default_rng(3).integers(0, 512, 21)])
    f = io.BytesIO()
    s.save_payload(f)
    return f.getvalue()


def start(tmp_path: Path, code: str, *args) -> subprocess.Popen:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", FRESH_SIGNALS + code, *map(str, args)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp),
                                 "COLUMNS": "200", "DS4_CACHE": str(tmp_path / "cache")})


def wait_line(p: subprocess.Popen, stream, prefix: str) -> str:
    deadline, seen = time.monotonic() + T_OUT, ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.5)
        if ready:
            line = stream.readline()
            seen += line
            if line.startswith(prefix):
                return line
            if not line and p.poll() is not None:
                break
    p.kill()
    raise AssertionError(f"no {prefix!r} line: {seen}")


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + T_OUT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def stop(p: subprocess.Popen, sig: int) -> tuple[int, str]:
    p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=T_OUT)
    finally:
        p.kill()
    return p.returncode, err


def assert_clean(rc: int, err: str, sig: int, *dirs: Path) -> None:
    assert rc != 0 and rc != -sig, (rc, err)  # it unwound and exited, not killed outright
    if sig == signal.SIGTERM:
        assert rc == 128 + sig, (rc, err)
    assert "Traceback" not in err, err
    for d in dirs:
        left = [n for n in os.listdir(d) if n.endswith(".part") or n.startswith("ds4-kv-")]
        assert left == [], f"left behind in {d}: {left}"


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_kv_recv_stopped_mid_payload(tmp_path, payload, sig):
    dest = tmp_path / "in"
    dest.mkdir()
    p = start(tmp_path, DS4, "kv-recv", 0, "--out", dest / "r.dsv4")
    port = int(wait_line(p, p.stderr, "listening on ").rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=T_OUT) as c:
        c.sendall(struct.pack("<I", DS4K_MAGIC))  # the opener
        c.recv(HELLO_BYTES, socket.MSG_WAITALL)
        manifest = json.dumps({"fingerprint": None, "payload_bytes": len(payload),
                               "sha256": hashlib.sha256(payload).hexdigest(), "n_tokens": 21,
                               "ctx": 64, "version": 2, "created": 0}).encode()
        # DS4K v3 without a token: the record header and the manifest each get a verdict
        c.sendall(struct.pack("<4I", DS4K_MAGIC, DS4K_VERSION, 0, len(manifest)))
        assert struct.unpack("<2I", c.recv(REPLY_BYTES, socket.MSG_WAITALL))[0] == 0
        c.sendall(manifest)
        assert struct.unpack("<2I", c.recv(REPLY_BYTES, socket.MSG_WAITALL))[0] == 0
        c.sendall(payload[: len(payload) // 2])
        wait_for(lambda: any(n.endswith(".part") for n in os.listdir(dest)), "the .part file")
        rc, err = stop(p, sig)
    assert_clean(rc, err, sig, dest, tmp_path / "tmp")
    assert os.listdir(dest) == []


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_decode_recv_kv_stopped_while_waiting(tmp_path, model_path, sig):
    p = start(tmp_path, DS4, "decode", "-m", model_path, "--recv-kv", 0, "-n", 2)
    wait_line(p, p.stderr, "listening on ")
    assert [n for n in os.listdir(tmp_path / "tmp") if n.startswith("ds4-kv-")]  # it is there
    rc, err = stop(p, sig)
    assert_clean(rc, err, sig, tmp_path / "tmp")


@pytest.mark.parametrize("sig", SIGNALS + [signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_pipe_worker_stopped_exits_as_every_command(tmp_path, model_path, sig):
    """A stage stopped by a signal exits 128 + the signal (130 for Ctrl-C), as the README says of
    every command: it exited 0, which a supervisor reads as a clean finish."""
    p = start(tmp_path, DS4, "pipe-worker", "-m", model_path, 0, "3:5")
    wait_line(p, p.stdout, "listening on ")
    rc, err = stop(p, sig)
    assert rc == 128 + sig and "Traceback" not in err, (rc, err)


class StallingReceiver(threading.Thread):
    """A DS4K receiver that answers probes, accepts the manifest, then never replies."""

    def __init__(self):
        super().__init__(daemon=True)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.got_manifest = threading.Event()
        self.conns = []

    def run(self):
        self.srv.settimeout(T_OUT)
        with self.srv:
            while True:
                c, _ = self.srv.accept()
                self.conns.append(c)
                # DS4K v3 without a token: opener, hello; record header, verdict; manifest, verdict
                c.recv(OPENER_BYTES, socket.MSG_WAITALL)
                c.sendall(struct.pack("<4I32s", DS4K_MAGIC, DS4K_VERSION, 0, 0, b"\0" * 32))
                head = c.recv(16, socket.MSG_WAITALL)
                (n,) = struct.unpack_from("<I", head, 12)
                c.sendall(struct.pack("<2I", 0, 0))
                if n == 0:  # a probe: no manifest follows
                    c.sendall(struct.pack("<2I", 0, 0))
                    continue
                c.recv(n, socket.MSG_WAITALL)
                c.sendall(struct.pack("<2I", 0, 0))
                self.got_manifest.set()
                return  # reads nothing more: the sender stalls in the payload or its reply


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_prefill_send_kv_stopped_mid_transfer(tmp_path, model_path, sig):
    r = StallingReceiver()
    r.start()
    p = start(tmp_path, DS4, "prefill", "-m", model_path, "-p", "hello", "--send-kv",
              f"127.0.0.1:{r.port}", "--io-timeout", 60)
    wait_for(r.got_manifest.is_set, "the manifest")
    time.sleep(0.2)
    rc, err = stop(p, sig)
    for c in r.conns:
        c.close()
    assert_clean(rc, err, sig, tmp_path / "tmp")


WRITER = """
import sys, time
from ds4.core.atomic import atomic_file
with atomic_file(sys.argv[1]) as f:
    f.write(b"half a payload")
    print("writing", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_an_atomic_writer_stopped_mid_write(tmp_path, sig):
    """What `prefill --save-kv`, `bench --csv --overwrite` and every other atomic write use."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "s.dsv4").write_bytes(b"old")
    p = start(tmp_path, WRITER, out / "s.dsv4")
    wait_line(p, p.stdout, "writing")
    assert len(os.listdir(out)) == 2  # the target and its .part
    p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=T_OUT)
    finally:
        p.kill()
    # SIGTERM unwinds into exit code 143; an uncaught KeyboardInterrupt ends Python by SIGINT
    # itself once the stack has unwound
    assert p.returncode == (128 + sig if sig == signal.SIGTERM else -sig), err
    assert os.listdir(out) == ["s.dsv4"] and (out / "s.dsv4").read_bytes() == b"old"


def test_signals_unwind_raises_in_the_block_and_restores_the_handlers(tmp_path):
    from ds4.core.atomic import Terminated, atomic_file, signals_unwind, temp_dir

    seen = []
    old = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with pytest.raises(Terminated) as e:
            with signals_unwind(), signals_unwind():  # nested: the outer one owns the handlers
                with temp_dir("ds4-kv-") as d, atomic_file(tmp_path / "x.bin") as f:
                    f.write(b"x")
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # the signal arrives before this ends
        assert e.value.code == 128 + signal.SIGTERM and "SIGTERM" in str(e.value)
        assert not d.exists() and os.listdir(tmp_path) == []
        os.kill(os.getpid(), signal.SIGTERM)  # outside the block: the caller's handler again
        wait_for(lambda: seen == [signal.SIGTERM], "the caller's handler")
    finally:
        signal.signal(signal.SIGTERM, old)
