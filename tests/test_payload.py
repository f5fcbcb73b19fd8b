"""The DSV4 session payload (spec ds4-model.md §4.1/§4.2): bytes built by hand from the spec,
versions 1/2 and the MTP tail, every loader check (and that a rejected load changes nothing),
continuation from the saved logits ≡ uninterrupted generation on every backend, bit parity of
load → save across every pair of backends, atomic files, and `ds4 prefill` / `ds4 decode`."""

from __future__ import annotations

import io
import itertools
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import ds4
import ds4.engine
from ds4.backends import available
from ds4.core import payload as pl
from ds4.core.chat import encode_prompt
from ds4.core.payload import PayloadError
from ds4.core.tiny import make_tiny, preset_config

BACKENDS = available()
RNG = np.random.default_rng(11)
PROMPT = [int(x) for x in RNG.integers(0, 512, 48)]
LONG = [int(x) for x in RNG.integers(0, 512, 270)]
NEAR_TIE = 1e-3  # top-2 logit gap, relative to the largest |logit|, below which backends may differ


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("m") / "test.gguf", preset="test", seed=1)


_engines: dict = {}


def engine(model_path, backend="reference"):
    key = (str(model_path), backend)
    if key not in _engines:
        _engines[key] = ds4.Engine.open(model_path, backend=backend)
    return _engines[key]


@pytest.fixture(scope="module")
def ref(model_path):
    return engine(model_path)


def prefilled(eng, tokens, ctx=64, prefill_cap=None):
    s = eng.session(ctx=ctx, prefill_cap=prefill_cap)
    s.sync(tokens)
    return s


def payload_of(s, version=2, identity=False) -> bytes:
    """The bare body (ds4's bytes) by default; identity=True: as files are written."""
    f = io.BytesIO()
    n = s.save_payload(f, version=version, identity=identity)
    assert n == len(f.getvalue())
    return f.getvalue()


def greedy(s, n) -> tuple[list[int], list[float]]:
    """n greedy tokens, and the relative top-2 gap at each step."""
    toks, gaps = [], []
    for _ in range(n):
        lg = s.logits
        top2 = np.sort(lg)[-2:]
        gaps.append(float((top2[1] - top2[0]) / np.abs(lg).max()))
        toks.append(int(np.argmax(lg)))
        s.eval(toks[-1])
    return toks, gaps


def assert_same_up_to_near_ties(ref_toks, ref_gaps, toks):
    for i, (a, b) in enumerate(zip(ref_toks, toks)):
        if a != b:
            assert ref_gaps[i] < NEAR_TIE, f"step {i}: {b} ≠ {a} with a top-2 gap of {ref_gaps[i]:.2e}"
            return  # after a certified near-tie the sequences may part ways
    assert len(ref_toks) == len(toks)


def state_of(s):
    snap = s.snapshot()
    return snap.tokens, snap.logits, snap.arrays


def assert_state_equal(a, b):
    assert a[0] == b[0]
    assert (a[1] is None and b[1] is None) or np.array_equal(a[1], b[1])
    for il in a[2]:
        for name in a[2][il]:
            assert np.array_equal(a[2][il][name], b[2][il][name], equal_nan=True), (il, name)


# ---- the bytes, from the spec -------------------------------------------------------------------

def spec_payload(cfg, s, version=2) -> bytes:
    """ds4-model.md §4.1, written out field by field from the session's raw state (snapshot),
    without the payload module."""
    tokens, logits, arrays = s.tokens, s.logits, s.snapshot().arrays
    lay = s.layout
    T, L, D, ID, V = len(tokens), cfg.n_layer, cfg.head_dim, cfg.indexer_head_dim, cfg.n_vocab
    ratios = cfg.compress_ratios[:L]
    raw_window = min(cfg.sliding_window, lay.ctx)
    comp_cap = lay.ctx // min(r for r in ratios if r) + 2
    raw_live = min(raw_window, lay.raw_cap, T)
    out = struct.pack("<13I", 0x34565344, version, lay.ctx, lay.prefill_cap, lay.raw_cap, raw_window,
                      comp_cap, T, L, D, ID, V, raw_live)
    out += struct.pack(f"<{T}I", *tokens)
    out += struct.pack(f"<{V}f", *[float(x) for x in logits])
    n_comp = [T // r if r else 0 for r in ratios]
    n_index = [T // 4 if r == 4 else 0 for r in ratios]
    out += struct.pack(f"<{L}I", *n_comp) + struct.pack(f"<{L}I", *n_index)

    def f32(a):
        return struct.pack(f"<{a.size}f", *[float(x) for x in a.reshape(-1)])

    for il in range(L):
        st = arrays[il]
        for p in range(T - raw_live, T):  # logical order, oldest first
            out += f32(st["raw"][p % lay.raw_cap])
        if ratios[il]:
            m, c = ratios[il], 2 if ratios[il] == 4 else 1
            assert st["comp_kv"].shape == st["comp_score"].shape == (c * m, c * D)
            out += f32(st["comp"][: n_comp[il]]) + f32(st["comp_kv"]) + f32(st["comp_score"])
        if ratios[il] == 4:
            assert st["index_kv"].shape == st["index_score"].shape == (8, 2 * ID)
            out += f32(st["index"][: n_index[il]]) + f32(st["index_kv"]) + f32(st["index_score"])
    return out


@pytest.mark.parametrize("tokens, ctx, cap", [
    (PROMPT[:21], 64, None),  # partial compressor windows; the frontiers hold −∞ rows
    (LONG, 512, 16),  # 270 tokens in a 256-row ring: the raw window wraps
])
def test_bytes_match_the_spec_built_by_hand(ref, tokens, ctx, cap):
    s = prefilled(ref, tokens, ctx, cap)
    if ctx == 512:
        assert s.layout.raw_cap == 256 < len(tokens)
    data = payload_of(s)
    want = spec_payload(ref.config, s)
    assert data == want
    assert len(data) == pl.session_payload_bytes(ref.config, s.layout, len(tokens))
    assert data[:8] == b"DSV4\x02\x00\x00\x00"
    assert payload_of(s, version=1) == want[:4] + b"\x01" + want[5:]


def test_payload_size_of_the_real_model_matches_the_spec():
    cfg = preset_config("flash")
    frontiers = sum(4 * r * w for il in range(cfg.n_layer)
                    for name, (r, w) in pl.layer_sections(cfg, il, 0, 0, 0)
                    if name.endswith(("_kv", "_score")))
    assert frontiers == 12_206_080
    MiB, GiB = 1 << 20, 1 << 30
    assert round(pl.payload_bytes(cfg, 1) / MiB, 1) == 12.2
    assert round(pl.payload_bytes(cfg, 128) / MiB, 1) == 24.6
    assert round(pl.payload_bytes(cfg, 10_000) / MiB) == 154
    # The spec's "1.34 GiB" is 1335.5 MiB read as thousands of MiB: the exact size is 1.30 GiB.
    assert round(pl.payload_bytes(cfg, 100_000) / MiB / 1000, 2) == 1.34
    assert round(pl.payload_bytes(cfg, 100_000) / GiB, 2) == 1.30
    per_token = (pl.payload_bytes(cfg, 200_000) - pl.payload_bytes(cfg, 100_000)) / 100_000
    assert abs(per_token - 13_760) < 20  # ≈13.76 KB per extra token


# ---- versions -----------------------------------------------------------------------------------

def test_versions_1_and_2_and_the_mtp_tail(ref):
    s = prefilled(ref, PROMPT[:30])
    v2, v1 = payload_of(s), payload_of(s, version=1)
    tail = struct.pack("<IdI", 3, 0.75, 41)
    for data, back in ((v2, v2), (v1, v2), (v2 + tail, v2)):
        t = ref.session(ctx=64)
        t.load_payload(data)
        assert payload_of(t) == back
        assert payload_of(t, version=1) == v1
    p = pl.read_payload(v2 + tail, ref.config)
    assert p.mtp_tail == (3, 0.75, 41)
    for bad in (v1 + tail, v2 + tail + b"\0", v2 + tail[:15]):
        with pytest.raises(PayloadError, match=pl.E_TRAILING):
            ref.session(ctx=64).load_payload(bad)
    # 16 bytes whose average is no number are not an MTP tail (the spec gives the field no range)
    for ewma in (float("nan"), float("inf")):
        with pytest.raises(PayloadError, match=f"{pl.E_TRAILING}: 16 bytes .* no MTP tail: mtp_accept_ewma = "):
            ref.session(ctx=64).load_payload(v2 + struct.pack("<IdI", 3, ewma, 41))
    assert pl.read_payload(v2 + struct.pack("<IdI", 3, 2.5, 41), ref.config).mtp_tail == (3, 2.5, 41)
    with pytest.raises(ValueError, match="version"):
        s.save_payload(io.BytesIO(), version=3)


# ---- the loader's checks ------------------------------------------------------------------------

def _field(i, value):
    return lambda b: b[:4 * i] + struct.pack("<I", value) + b[4 * i + 4:]


def _count(cfg, T, which, il, delta):
    def mutate(b):
        at = 52 + 4 * T + 4 * cfg.n_vocab + 4 * cfg.n_layer * which + 4 * il
        (v,) = struct.unpack_from("<I", b, at)
        return b[:at] + struct.pack("<I", v + delta) + b[at + 4:]
    return mutate


T21 = 21
CASES = [  # (id, mutate bytes, target session (ctx, prefill_cap), message)
    ("magic", _field(0, 0x12345678), (64, None), pl.E_VERSION),
    ("version 0", _field(1, 0), (64, None), pl.E_VERSION),
    ("version 3", _field(1, 3), (64, None), pl.E_VERSION),
    ("smaller ctx", None, (32, None), pl.E_FIT),
    ("tokens ≥ ctx", _field(7, 64), (64, None), pl.E_FIT),
    ("n_layer", _field(8, 6), (64, None), pl.E_LAYOUT),
    ("head_dim", _field(9, 512), (64, None), pl.E_LAYOUT),
    ("indexer_head_dim", _field(10, 64), (64, None), pl.E_LAYOUT),
    ("vocab", _field(11, 129280), (64, None), pl.E_LAYOUT),
    ("prefill_cap", None, (64, 16), pl.E_CHUNK),
    ("raw_window", _field(5, 16), (64, None), pl.E_CHUNK),
    ("raw_cap 0", _field(4, 0), (64, None), pl.E_RING),
    ("raw_cap < raw_live", _field(4, 4), (64, None), pl.E_RING),
    ("raw_live", _field(12, 7), (64, None), pl.E_RING),
    ("comp_cap", _field(6, 64 // 4 + 3), (64, None), pl.E_COMP_CAP),
    ("n_comp ratio 4", None, (64, None), pl.E_COMP_ROWS),
    ("n_comp ratio 0", None, (64, None), pl.E_COMP_ROWS),
    ("n_comp over comp_cap", None, (64, None), pl.E_COMP_ROWS),
    ("n_index", None, (64, None), pl.E_INDEX_ROWS),
    ("n_index of an HCA layer", None, (64, None), pl.E_INDEX_ROWS),
    ("token id", lambda b: b[:52] + struct.pack("<I", 512) + b[56:], (64, None), pl.E_TOKEN),
    ("trailing byte", lambda b: b + b"\0", (64, None), pl.E_TRAILING),
    ("missing byte", lambda b: b[:-1], (64, None), pl.E_MISSING),
    ("header only", lambda b: b[:52], (64, None), pl.E_MISSING),
    ("empty", lambda b: b"", (64, None), pl.E_MISSING),
]


@pytest.fixture(scope="module")
def good(ref):
    return payload_of(prefilled(ref, PROMPT[:T21], ctx=64))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_check_rejects_and_leaves_the_session_as_it_was(ref, good, case):
    name, mutate, (ctx, cap), message = case
    cfg = ref.config
    counts = {"n_comp ratio 4": (0, 2, 1), "n_comp ratio 0": (0, 0, 1), "n_index": (1, 4, -1),
              "n_comp over comp_cap": (0, 3, 100), "n_index of an HCA layer": (1, 3, 1)}
    if name in counts:
        mutate = _count(cfg, T21, *counts[name])
    data = good if mutate is None else mutate(good)
    target = ref.session(ctx=ctx, prefill_cap=cap)
    target.sync(PROMPT[30:40])  # holds another sequence
    before = state_of(target)
    with pytest.raises(PayloadError, match="^" + message):
        target.load_payload(data)
    assert_state_equal(state_of(target), before)
    assert isinstance(PayloadError("x"), ValueError)


def test_declared_size_and_streams(ref, good):
    s = ref.session(ctx=64)
    with pytest.raises(PayloadError, match=pl.E_MISSING):
        s.load_payload(good, nbytes=len(good) - 1)
    with pytest.raises(PayloadError, match=pl.E_TRAILING):
        s.load_payload(good + b"\0" * 4, nbytes=len(good) + 4)
    f = io.BytesIO(good + b"NEXT")  # a stream that runs on past the payload
    s.load_payload(f, nbytes=len(good))
    assert f.read() == b"NEXT"
    assert payload_of(s) == good


def test_saving_needs_tokens_and_every_layer(ref, model_path):
    with pytest.raises(PayloadError, match="no tokens"):
        ref.session(ctx=64).save_payload(io.BytesIO())
    stage = ds4.Engine.open(model_path, layers=range(0, 2))
    with pytest.raises(PayloadError, match="every layer"):
        stage.session(ctx=64).save_payload(io.BytesIO())
    with pytest.raises(PayloadError, match="every layer"):
        stage.session(ctx=64).load_payload(b"")


# ---- continuing from a payload ------------------------------------------------------------------

def test_first_token_comes_from_the_saved_logits_without_evaluation(ref, good, monkeypatch):
    src = prefilled(ref, PROMPT[:T21], ctx=64)

    def no_eval(*a, **k):
        raise AssertionError("the model was evaluated")

    monkeypatch.setattr(ds4.engine, "forward_chunk", no_eval)
    s = ref.session(ctx=64)
    s.load_payload(good)
    assert s.tokens == PROMPT[:T21]
    assert s.logits.dtype == np.float32 and np.array_equal(s.logits, src.logits)
    assert int(np.argmax(s.logits)) == int(np.argmax(src.logits))


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_equals_prefill_save_load_decode(model_path, backend, tmp_path):
    eng = engine(model_path, backend)
    whole = prefilled(eng, PROMPT, ctx=128)
    want, _ = greedy(whole, 16)  # crosses further window closings and slides the raw window
    s = prefilled(eng, PROMPT, ctx=128)
    path = tmp_path / "s.dsv4"
    s.save_payload(path)
    d = eng.session(ctx=128)
    d.load_payload(path)
    got, _ = greedy(d, 16)
    assert got == want
    assert np.array_equal(d.logits, whole.logits)


def test_load_into_a_larger_context_rebuilds_the_ring(ref):
    """ctx 512 → 1024 (same prefill_cap): the raw rows move to new ring slots, the compressed
    caches grow, and decoding goes on bit for bit."""
    a = prefilled(ref, LONG, ctx=512, prefill_cap=16)
    data = payload_of(a)
    b = ref.session(ctx=1024, prefill_cap=16)
    b.load_payload(data)
    assert b.layout.raw_cap == a.layout.raw_cap == 256 and b.layout.comp_cap > a.layout.comp_cap
    ta, _ = greedy(a, 6)
    tb, _ = greedy(b, 6)
    assert ta == tb and np.array_equal(a.logits, b.logits)
    c = ref.session(ctx=512, prefill_cap=32)
    with pytest.raises(PayloadError, match=pl.E_CHUNK):
        c.load_payload(data)


@pytest.mark.parametrize("ctx", [7, 64])
def test_a_window_cut_short_by_its_ctx_loads_into_a_larger_one(ref, ctx):
    """Saved at a ctx below the sliding window (6 < 8), a session's raw window is its ctx and
    holds every token: a larger ctx (a larger window) takes it, and decodes as a session that
    ran there (`ds4 decode --ctx` was refused with a chunk-layout error)."""
    assert 6 < ref.config.sliding_window
    data = payload_of(prefilled(ref, PROMPT[:4], ctx=6, prefill_cap=6))
    b = ref.session(ctx=ctx, prefill_cap=6)
    b.load_payload(data)
    want = prefilled(ref, PROMPT[:4], ctx=ctx, prefill_cap=6)
    tb, _ = greedy(b, 2)
    tw, _ = greedy(want, 2)
    assert tb == tw and np.allclose(b.logits, want.logits, rtol=0, atol=1e-6 * np.abs(want.logits).max())


@pytest.mark.parametrize("a, b", list(itertools.product(BACKENDS, BACKENDS)))
def test_bit_parity_across_backends(model_path, a, b):
    """load → save gives back the input bytes on every backend; a payload saved on `a`, loaded on
    `b` and saved again is the same bytes; and `b` continues as `a` does (up to near-ties)."""
    ea, eb = engine(model_path, a), engine(model_path, b)
    sa = prefilled(ea, PROMPT[:45], ctx=128)  # 45: every compressor frontier is mid-window
    data = payload_of(sa)
    sb = eb.session(ctx=128)
    sb.load_payload(data)
    assert payload_of(sb) == data
    assert sb.tokens == sa.tokens and np.array_equal(sb.logits, sa.logits)
    assert payload_of(sb, version=1) == payload_of(sa, version=1)
    ref_toks, ref_gaps = greedy(sa, 8)
    toks, _ = greedy(sb, 8)
    assert_same_up_to_near_ties(ref_toks, ref_gaps, toks)


# ---- files --------------------------------------------------------------------------------------

def test_files_are_written_atomically(ref, tmp_path, monkeypatch):
    s = prefilled(ref, PROMPT[:T21], ctx=64)
    path = tmp_path / "s.dsv4"
    path.write_bytes(b"old")
    calls = {"n": 0}
    real = ref.backend.state_to_numpy

    def failing(st, name):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError("disk on fire")
        return real(st, name)

    monkeypatch.setattr(ref.backend, "state_to_numpy", failing)
    with pytest.raises(OSError, match="disk on fire"):
        s.save_payload(path)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["s.dsv4"]
    monkeypatch.setattr(ref.backend, "state_to_numpy", real)
    assert s.save_payload(str(path)) == path.stat().st_size
    assert path.read_bytes() == payload_of(s, identity=True) and os.listdir(tmp_path) == ["s.dsv4"]


# ---- CLI: ds4 prefill / ds4 decode --------------------------------------------------------------

@pytest.fixture(scope="module")
def cli():
    from cli.kv import register

    app = typer.Typer()
    register(app)
    runner = CliRunner()
    return lambda *args, **kw: runner.invoke(app, [str(a) for a in args], **kw)


def test_cli_prefill_then_decode_matches_a_greedy_loop(cli, ref, model_path, tmp_path):
    prompt = "Hello there"
    ids = encode_prompt(ref.tokenizer, prompt)
    s = prefilled(ref, ids, ctx=4096)
    out = []
    while len(out) < 10 and int(np.argmax(s.logits)) != ref.tokenizer.eos_id:
        out.append(int(np.argmax(s.logits)))
        s.eval(out[-1])
    kv = tmp_path / "p.dsv4"
    r = cli("prefill", "-m", model_path, "-p", prompt, "--save-kv", kv)
    assert r.exit_code == 0, r.output
    assert kv.read_bytes() == payload_of(prefilled(ref, ids, ctx=4096), identity=True)
    assert "saved" in r.stdout and f"prompt: {len(ids)} tokens" in r.stderr
    r = cli("decode", "-m", model_path, "--load-kv", kv, "-n", 10, "--temp", 0)
    assert r.exit_code == 0, r.output
    assert r.stdout_bytes == (ref.tokenizer.decode(out) + "\n").encode("utf-8")
    assert f"loaded: {len(ids)} tokens" in r.stderr and f"generated: {len(out)} tokens" in r.stderr
    pf = tmp_path / "prompt.txt"
    pf.write_text(prompt, encoding="utf-8")
    kv2 = tmp_path / "q.dsv4"
    assert cli("prefill", "-m", model_path, "--prompt-file", pf, "--save-kv", kv2).exit_code == 0
    assert kv2.read_bytes() == kv.read_bytes()


def test_cli_prefill_cap_is_the_chunk_the_payload_records(cli, ref, model_path, tmp_path):
    """--prefill-cap: the session prefills in chunks of that many tokens, so the saved payload is
    the library's at that prefill_cap, whose header field (u32 at byte 12, spec §payload) holds
    it; decode adopts it from the file. A cap over --ctx is refused naming both."""
    prompt = "Hello there, how are you today?"
    ids = encode_prompt(ref.tokenizer, prompt)
    cap = 5
    assert len(ids) > 2 * cap  # at least three chunks
    kv = tmp_path / "c.dsv4"
    r = cli("prefill", "-m", model_path, "-p", prompt, "--prefill-cap", cap, "--save-kv", kv)
    assert r.exit_code == 0, r.output
    body = kv.read_bytes()
    assert body == payload_of(prefilled(ref, ids, ctx=4096, prefill_cap=cap), identity=True)
    assert body != payload_of(prefilled(ref, ids, ctx=4096), identity=True)
    assert int.from_bytes(body[12:16], "little") == cap
    s = prefilled(ref, ids, ctx=4096, prefill_cap=cap)
    out = []
    while len(out) < 6 and int(np.argmax(s.logits)) != ref.tokenizer.eos_id:
        out.append(int(np.argmax(s.logits)))
        s.eval(out[-1])
    r = cli("decode", "-m", model_path, "--load-kv", kv, "-n", 6, "--temp", 0)
    assert r.exit_code == 0, r.output
    assert r.stdout_bytes == (ref.tokenizer.decode(out) + "\n").encode("utf-8")
    r = cli("prefill", "-m", model_path, "-p", prompt, "--ctx", 64, "--prefill-cap", 65, "--save-kv", kv)
    assert r.exit_code == 1 and "--prefill-cap 65 is more than --ctx 64" in r.stderr, r.output
    assert cli("prefill", "-m", model_path, "-p", prompt, "--prefill-cap", 0, "--save-kv", kv).exit_code == 2


@pytest.mark.parametrize("args", [
    ["prefill", "--save-kv", "x.dsv4"],  # no prompt
    ["prefill", "-p", "hi", "--prompt-file", "f.txt", "--save-kv", "x.dsv4"],
    ["prefill", "-p", "hi"],  # nowhere to put the session
    ["prefill", "-p", "hi", "--save-kv", "x", "--send-kv", "127.0.0.1:1"],
    ["prefill", "-p", "hi", "--send-kv", "localhost"],  # no port
    ["decode", "-n", "4"],
    ["decode", "--load-kv", "x", "--recv-kv", "7000"],
    ["decode", "--load-kv", "x", "--max-kv-bytes", "lots"],
    ["decode", "--load-kv", "x", "--max-kv-bytes", "inf"],  # (float('inf') overflows int())
])
def test_cli_bad_options(cli, args):
    r = cli(*args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args, option, says", [
    (["prefill", "-p", "hi", "--send-kv", "localhost"], "--send-kv", "expected HOST:PORT"),
    (["kv-send", "x.dsv4", "nohost"], "HOST:PORT", "expected HOST:PORT"),
    (["kv-recv", "0", "-o", "x.dsv4", "--max-kv-bytes", "0"], "--max-kv-bytes", "expected a positive size"),
    (["prefill", "--prompt-file", "nope.txt", "--save-kv", "x.dsv4"], "--prompt-file", "does not exist"),
    (["prefill", "--prompt-file", "{bad}", "--save-kv", "x.dsv4"], "--prompt-file", "byte 2 is 0xff"),
    (["generate", "-p", "hi", "--split-next", "nohost", "--layers", "0:2"], "--split-next", "expected HOST:PORT"),
    (["pipe-worker", "0", "2:5", "--next", "nohost"], "--next", "expected HOST:PORT"),
])
def test_cli_option_errors_name_the_option(tmp_path, args, option, says):
    """Values checked in a command's body name their option, as the parsed ones do (they said
    "Invalid value: ...", or gave a bare OSError / UnicodeDecodeError for a prompt file)."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ab\xffcd")
    from cli.main import app

    r = CliRunner().invoke(app, [a.replace("{bad}", str(bad)) for a in args])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}'" in r.output and says in r.output, r.output


def test_cli_decode_checks_a_payload_against_the_model_before_allocating(cli, model_path, good, tmp_path,
                                                                          monkeypatch):
    """A payload whose header asks for a context the model cannot hold (or whose body is not
    there) is refused from its header and size, before `decode` allocates the session it
    names: a 52-byte file must not cost a full-ctx session."""
    import dataclasses

    import ds4

    sessions = []
    real = ds4.Engine.session
    monkeypatch.setattr(ds4.Engine, "session", lambda self, *a, **k: sessions.append(k) or real(self, *a, **k))
    h = pl.Header.unpack(good[:pl.HEADER_BYTES])
    for name, blob in (("huge", dataclasses.replace(h, ctx=1 << 30).pack()),
                       ("cut", good[:pl.HEADER_BYTES + 8])):
        bad = tmp_path / f"{name}.dsv4"
        bad.write_bytes(blob)
        r = cli("decode", "-m", model_path, "--load-kv", bad, "-n", 2)
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert (pl.E_FIT if name == "huge" else pl.E_MISSING) in r.stderr, r.stderr
    assert sessions == []


def test_cli_outputs_never_replace_the_model(cli, model_path, tmp_path):
    """--save-kv (and kv-recv --out) naming the model file being read is refused before any
    work, and the model is left as it was."""
    import hashlib
    import shutil

    model_path = shutil.copy(model_path, tmp_path / "model.gguf")  # (the module's stays whole)
    before = hashlib.sha256(open(model_path, "rb").read()).hexdigest()
    r = cli("prefill", "-m", model_path, "-p", "hi", "--save-kv", model_path)
    assert r.exit_code == 1 and f"--save-kv: {model_path} is the model file this command reads" in r.stderr
    r = cli("kv-recv", "0", "-m", model_path, "--out", model_path, "--wait", "0.1")
    assert r.exit_code == 1 and f"--out: {model_path} is the model file this command reads" in r.stderr
    assert hashlib.sha256(open(model_path, "rb").read()).hexdigest() == before


def test_cli_decode_rejects_a_bad_payload(cli, ref, model_path, good, tmp_path):
    bad = tmp_path / "bad.dsv4"
    bad.write_bytes(good + b"\0")
    r = cli("decode", "-m", model_path, "--load-kv", bad, "-n", 2)
    assert r.exit_code == 1
    assert pl.E_TRAILING in r.stderr and "Traceback" not in r.output
    r = cli("decode", "-m", model_path, "--load-kv", tmp_path / "none.dsv4", "-n", 2)
    assert r.exit_code == 1 and "not found" in r.stderr
