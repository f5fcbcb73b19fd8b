"""Payload files carry their identity (ds4/core/payload.py, identity trailer): the trailer's bytes
built by hand from the documented layout, another model's file refused naming both models, a
corrupted body or trailer refused, readers that take the size from the header still read the
body, a payload with no tokens refused on load; `kv-send` names the file's model; `prefill`
checks where the payload goes before it prefills."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import ds4
import ds4.engine
from ds4.core import payload as pl
from ds4.core.payload import PayloadError
from ds4.core.tiny import make_tiny
from ds4.wire import ds4k
from ds4.wire.ds4k import DS4KError, Receiver

PROMPT = [int(x) for x in np.random.default_rng(17).integers(0, 512, 21)]
T_OUT = 10.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two models of the same layout and different weights: `a.gguf` and `b.gguf`."""
    d = tmp_path_factory.mktemp("models")
    return (ds4.Engine.open(make_tiny(d / "a.gguf", preset="test", seed=1)),
            ds4.Engine.open(make_tiny(d / "b.gguf", preset="test", seed=2)))


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """(file saved from model a, its bare body)."""
    a, _ = models
    s = a.session(ctx=64)
    s.sync(PROMPT)
    path = tmp_path_factory.mktemp("kv") / "a.dsv4"
    s.save_payload(path)
    bare = io.BytesIO()
    s.save_payload(bare, identity=False)
    return path, bare.getvalue()


def test_the_trailer_bytes_follow_the_documented_layout(models, saved):
    a, _ = models
    path, body = saved
    name = b"a.gguf"
    fp = hashlib.sha256()  # wire.md: metadata + tensor directory, plus the file size
    with open(a.model.path, "rb") as f:
        fp.update(f.read(a.model._reader.data_offset))
    fp.update(struct.pack("<Q", os.path.getsize(a.model.path)))
    want = (body + name + fp.digest() + hashlib.sha256(body).digest()
            + struct.pack("<QIIII", len(body), len(name), 1, len(name) + 88, 0x49345344))
    assert path.read_bytes() == want
    assert want[-4:] == b"DS4I"


def test_a_reader_taking_the_size_from_the_header_reads_the_body(models, saved):
    a, _ = models
    path, body = saved
    p = pl.read_payload(path, a.config, nbytes=len(body))  # as ds4's loader is given the size
    assert p.identity is None and p.nbytes == len(body)
    s = a.session(ctx=64)
    s.load_payload(body)  # a bare v1/v2 body still loads
    assert s.tokens == PROMPT


def test_another_models_file_is_refused_naming_both(models, saved):
    a, b = models
    path, _ = saved
    target = b.session(ctx=64)
    with pytest.raises(PayloadError, match="^" + pl.E_MODEL) as e:
        target.load_payload(path)
    msg = str(e.value)
    assert "a.gguf" in msg and "b.gguf" in msg
    assert a.model.fingerprint.hex()[:16] in msg and b.model.fingerprint.hex()[:16] in msg
    assert target.tokens == []
    with pytest.raises(PayloadError, match=pl.E_MODEL):  # the receiver's cheap check too
        pl.check_payload(path, b.config, os.path.getsize(path), pl.ModelRef.of(b.model))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


def test_a_corrupted_file_is_refused(models, saved):
    a, _ = models
    path, body = saved
    data = path.read_bytes()
    logits_at = 52 + 4 * len(PROMPT) + 4 * 7  # a logit: every structural check still passes
    cases = [
        (_flip(data, logits_at), pl.E_CHECKSUM),
        (_flip(data, len(body) - 3), pl.E_CHECKSUM),  # the last layer's last value
        (_flip(data, len(body) + 6 + 40), pl.E_CHECKSUM),  # the stored SHA-256
        (_flip(data, len(body) + 6 + 3), pl.E_MODEL),  # the fingerprint
        (_flip(data, len(data) - 8), pl.E_IDENTITY),  # trailer_bytes
        # a cut trailer is no trailer: bytes after the body, and the message says it may be one
        (data[:-1], pl.E_TRAILING + r": more bytes after the \d+-byte payload \(or the file was cut short inside "
                                    r"its identity trailer\)"),
        (data[:len(body) + 10], pl.E_TRAILING + r": 10 bytes .*cut short inside its identity trailer"),
        # cut 16 bytes in: the size of a version-2 MTP tail, but the bytes are the trailer's start
        (data[:len(body) + 16], pl.E_TRAILING + r": 16 bytes after the \d+-byte payload are the start of "
                                             r"the identity trailer of .*cut short inside its identity trailer"),
    ]
    for bad, message in cases:
        s = a.session(ctx=64)
        with pytest.raises(PayloadError, match="^" + message):
            s.load_payload(bad)
        assert s.tokens == []


# The SHA-256 of no bytes, and the same with its 21st hex digit changed (f -> 0): the two share
# their first 20 digits, more than a message's usual 16.
EMPTY_SHA = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
EMPTY_SHA_20 = "e3b0c44298fc1c149afb04c8996fb92427ae41e4649b934ca495991b7852b855"


def test_two_hashes_that_share_16_digits_are_shown_until_they_differ():
    """A message shows 16 hex digits of a hash; where those of the two hashes it compares are the
    same, it shows both up to the first digit that differs and 3 more (all 64 where fewer are
    left). They read "cafa462a7b7831cb…" twice."""
    with pytest.raises(PayloadError, match="^" + pl.E_CHECKSUM + ": the SHA-256 of its 0 body bytes is "
                       "e3b0c44298fc1c149afbf4c8…, the trailer says e3b0c44298fc1c149afb04c8…$"):
        pl.verify_digest(b"", pl.Identity(pl.ModelRef(b"\0" * 32), bytes.fromhex(EMPTY_SHA_20), 0))
    a = pl.ModelRef(bytes.fromhex("cafa462a7b7831cb" + "11" * 23 + "0e"), "x.gguf")
    b = pl.ModelRef(bytes.fromhex("cafa462a7b7831cb" + "11" * 23 + "0f"), "x.gguf")
    c = pl.ModelRef(bytes.fromhex("cafa462a7b7831cc" + "11" * 23 + "0e"), "y.gguf")
    cases = [
        (a, b, "x.gguf (fingerprint cafa462a7b7831cb" + "11" * 23 + "0e), "  # the last digit: all 64
               "this is x.gguf (fingerprint cafa462a7b7831cb" + "11" * 23 + "0f)"),
        (a, c, "x.gguf (fingerprint cafa462a7b7831cb…), this is y.gguf (fingerprint cafa462a7b7831cc…)"),
    ]
    for saved_from, this, says in cases:
        with pytest.raises(PayloadError) as e:
            pl.check_model(pl.Identity(saved_from, b"\0" * 32, 0), this)
        assert str(e.value) == f"{pl.E_MODEL}: the file was saved from {says}"


def test_a_flipped_byte_deep_in_the_trailer_shows_two_different_values(cli, models, saved, tmp_path):
    """`ds4 decode` of a file with a byte flipped 30 bytes from its end (in the stored SHA-256:
    hex digit 53 differs) or 60 (in the fingerprint: digit 57) shows each pair of values up to
    that digit and 3 more."""
    a, _ = models
    path, body = saved
    data = path.read_bytes()
    fp, sha = a.model.fingerprint.hex(), hashlib.sha256(body).hexdigest()
    bad_fp, bad_sha = _flip(a.model.fingerprint, 28).hex(), _flip(hashlib.sha256(body).digest(), 26).hex()
    for back, says in (
            (30, f"{pl.E_CHECKSUM}: the SHA-256 of its {len(body)} body bytes is {sha[:57]}…, "
                 f"the trailer says {bad_sha[:57]}…"),
            (60, f"{pl.E_MODEL}: the file was saved from a.gguf (fingerprint {bad_fp[:61]}…), "
                 f"this is a.gguf (fingerprint {fp[:61]}…)")):
        bad = tmp_path / f"{back}.dsv4"
        bad.write_bytes(_flip(data, len(data) - back))
        r = cli("decode", "-m", a.model.path, "--load-kv", bad, "-n", 1, "--backend", "reference")
        assert r.exit_code == 1, r.output
        assert says in r.stderr, r.stderr


def test_a_payload_with_no_tokens_is_refused_on_load(models, saved):
    a, _ = models
    _, body = saved
    cfg = a.config
    # header by hand (spec §4.1) with n_tokens = 0 and raw_live = 0, counts all 0
    h = list(struct.unpack_from("<13I", body))
    h[7], h[12] = 0, 0
    empty = (struct.pack("<13I", *h) + body[52 + 4 * len(PROMPT): 52 + 4 * len(PROMPT) + 4 * cfg.n_vocab]
             + b"\0" * (8 * cfg.n_layer))
    for il in range(cfg.n_layer):
        for name, (r, w) in pl.layer_sections(cfg, il, 0, 0, 0):
            empty += b"\0" * (4 * r * w)
    with pytest.raises(PayloadError, match="^" + pl.E_EMPTY):
        a.session(ctx=64).load_payload(empty)
    with pytest.raises(PayloadError, match="^" + pl.E_EMPTY):
        pl.check_payload(empty, cfg, len(empty))


# ---- CLI ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli():
    from cli.kv import register

    app = typer.Typer()
    register(app)
    runner = CliRunner()
    return lambda *args, **kw: runner.invoke(app, [str(a) for a in args], **kw)


def test_kv_send_takes_the_model_from_the_file(cli, models, saved, tmp_path, monkeypatch):
    a, b = models
    path, _ = saved
    monkeypatch.setenv("DS4_CACHE", str(tmp_path / "cache"))  # no default model is made
    out: dict = {}
    with Receiver(0, fingerprint=a.model.fingerprint, config=a.config, timeout=T_OUT) as r:
        t = threading.Thread(target=lambda: out.update(m=r.receive(tmp_path / "r.dsv4", T_OUT)),
                             daemon=True)
        t.start()
        res = cli("kv-send", path, f"127.0.0.1:{r.port}")
        t.join(T_OUT)
    assert res.exit_code == 0, res.output
    assert out["m"].fingerprint == a.model.fingerprint.hex()
    assert (tmp_path / "r.dsv4").read_bytes() == path.read_bytes()
    assert not (tmp_path / "cache").exists()
    # -m of another model: refused before anything is sent, naming both
    res = cli("kv-send", path, "127.0.0.1:9", "-m", b.model.path)
    assert res.exit_code == 1 and pl.E_MODEL in res.stderr
    assert "a.gguf" in res.stderr and "b.gguf" in res.stderr


def _no_prefill(monkeypatch):
    def sync(*a, **k):
        raise AssertionError("prefilled before checking where the payload goes")

    monkeypatch.setattr(ds4.engine.Session, "sync", sync)


def test_prefill_save_kv_checks_the_directory_first(cli, models, tmp_path, monkeypatch):
    a, _ = models
    _no_prefill(monkeypatch)
    r = cli("prefill", "-m", a.model.path, "-p", "hi", "--save-kv", tmp_path / "no" / "x.dsv4")
    assert r.exit_code == 1 and "directory does not exist" in r.stderr, r.output


def test_prefill_save_kv_checks_the_directory_is_writable_first(cli, models, tmp_path, monkeypatch,
                                                                read_only_dir):
    """A directory that cannot take the file is refused before the prefill, naming the option
    (it failed after the prefill, with a Permission denied on the temporary file)."""
    a, _ = models
    _no_prefill(monkeypatch)
    r = cli("prefill", "-m", a.model.path, "-p", "hi", "--save-kv", read_only_dir / "x.dsv4")
    assert r.exit_code == 1 and f"--save-kv: directory not writable: {read_only_dir}" in r.stderr, r.output
    (tmp_path / "file").write_bytes(b"")
    r = cli("prefill", "-m", a.model.path, "-p", "hi", "--save-kv", tmp_path / "file" / "x.dsv4")
    assert r.exit_code == 1 and f"--save-kv: not a directory: {tmp_path / 'file'}" in r.stderr, r.output
    assert os.listdir(read_only_dir) == []


@pytest.mark.parametrize("tail", ["newfile/", "newfile/.", "."])
def test_prefill_save_kv_refuses_a_directory_path(cli, models, tmp_path, monkeypatch, tail):
    """A path that names a directory is refused, not written as a file (pathlib drops the
    trailing "/": `--save-kv out/` wrote a file `out`)."""
    a, _ = models
    _no_prefill(monkeypatch)
    dest = f"{tmp_path}/{tail}"
    r = cli("prefill", "-m", a.model.path, "-p", "hi", "--save-kv", dest)
    assert r.exit_code == 1, r.output
    assert f"--save-kv: expected a file path, got a directory path {dest!r}" in r.stderr, r.output
    assert os.listdir(tmp_path) == []


def test_prefill_send_kv_to_a_dead_host_fails_before_prefilling(cli, models, monkeypatch):
    a, _ = models
    _no_prefill(monkeypatch)
    monkeypatch.setattr(ds4k, "PROBE_CONNECT_TIMEOUT", 0.5)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    r = cli("prefill", "-m", a.model.path, "-p", "hi", "--send-kv", f"127.0.0.1:{port}")
    assert r.exit_code == 1 and "cannot connect" in r.stderr, r.output
    assert time.monotonic() - t0 < 5
    # something that is not a DS4K receiver: refused on its hello
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def answer():
            c, _ = srv.accept()
            with c:
                c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"\0" * 48)
        th = threading.Thread(target=answer, daemon=True)
        th.start()
        r = cli("prefill", "-m", a.model.path, "-p", "hi", "--send-kv",
                f"127.0.0.1:{srv.getsockname()[1]}")
        th.join(T_OUT)
    assert r.exit_code == 1 and "not a DS4K" in r.stderr, r.output


def test_a_probe_does_not_end_the_receiver(models, saved, tmp_path):
    a, _ = models
    path, _ = saved
    out: dict = {}
    with Receiver(0, fingerprint=a.model.fingerprint, config=a.config, timeout=T_OUT) as r:
        t = threading.Thread(target=lambda: out.update(m=r.receive(tmp_path / "r.dsv4", T_OUT)),
                             daemon=True)
        t.start()
        ds4k.probe_receiver("127.0.0.1", r.port, timeout=T_OUT)
        ds4k.send_payload(path, "127.0.0.1", r.port, fingerprint=a.model.fingerprint, timeout=T_OUT)
        t.join(T_OUT)
    assert "m" in out and (tmp_path / "r.dsv4").read_bytes() == path.read_bytes()
    with pytest.raises(DS4KError, match="requires an auth token"):
        with Receiver(0, auth_token="t", timeout=T_OUT) as r:
            threading.Thread(target=lambda: _swallow(r.receive, tmp_path / "s.dsv4", 2.0),
                             daemon=True).start()
            ds4k.probe_receiver("127.0.0.1", r.port, timeout=T_OUT)


def _swallow(f, *a):
    try:
        f(*a)
    except (DS4KError, OSError):  # the test closes the receiver under it
        pass


def test_the_receiver_checks_the_files_model_not_only_the_manifest(models, saved, tmp_path):
    a, b = models
    path, _ = saved
    out: dict = {}
    with Receiver(0, fingerprint=b.model.fingerprint, config=b.config, timeout=T_OUT) as r:
        def land():  # (max_failures=1: the refusal ends the wait, not the accept timeout)
            try:
                r.receive(tmp_path / "r.dsv4", T_OUT, max_failures=1)
            except DS4KError as e:
                out["e"] = e
        t = threading.Thread(target=land, daemon=True)
        t.start()
        with pytest.raises(DS4KError, match=pl.E_MODEL):  # a manifest that claims model b
            ds4k.send_payload(path, "127.0.0.1", r.port, fingerprint=b.model.fingerprint,
                              timeout=T_OUT)
        t.join(T_OUT)
    assert out["e"].status == ds4k.CORRUPT and "a.gguf" in out["e"].reason
    assert os.listdir(tmp_path) == []


def test_decode_refuses_another_models_file(cli, models, saved):
    a, b = models
    path, _ = saved
    r = cli("decode", "-m", b.model.path, "--load-kv", path, "-n", 2)
    assert r.exit_code == 1 and pl.E_MODEL in r.stderr, r.output
    assert "a.gguf" in r.stderr and "b.gguf" in r.stderr and "Traceback" not in r.output
