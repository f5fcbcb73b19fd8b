"""`ds4 bench`: the frontier walk (incremental prefill, probe, restore), CSV, tables, the PNG
plotter and --compare, on the test model."""

from __future__ import annotations

import csv
import io
import os
import struct
import zlib

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import ds4
from ds4 import bench
from ds4.bench_plot import PALETTE, Panel, Series, encode_png, render_chart
from ds4.engine import Session

from cli.bench import register

SMALL = ["--ctx-start", "16", "--ctx-max", "64", "--step-mul", "2", "--gen-tokens", "4"]


pytestmark = pytest.mark.usefixtures("private_cache")



@pytest.fixture(scope="module")
def engine(model_path):
    return ds4.Engine.open(model_path)


def run(*args):
    app = typer.Typer()
    register(app)

    @app.command("other")  # a second command, so `bench` is a subcommand as in the real app
    def other() -> None:
        pass

    return CliRunner().invoke(app, ["bench", *[str(a) for a in args]])


def read_png(data: bytes) -> np.ndarray:
    """Parse a PNG back independently: check the signature and every chunk's CRC, and unfilter
    8-bit RGB scanlines (filter types 0-4)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + n
    assert pos == len(data)
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    img = np.zeros((h, 3 * w), dtype=np.int32)
    prev = np.zeros(3 * w, dtype=np.int32)
    for y in range(h):
        ftype = raw[y * (1 + 3 * w)]
        line = np.frombuffer(raw, np.uint8, 3 * w, y * (1 + 3 * w) + 1).astype(np.int32)
        cur = line.copy() if ftype == 0 else np.zeros_like(line)
        for i in range(3 * w) if ftype else ():
            a = cur[i - 3] if i >= 3 else 0
            b, c = prev[i], prev[i - 3] if i >= 3 else 0
            if ftype == 0:
                pred = 0
            elif ftype == 1:
                pred = a
            elif ftype == 2:
                pred = b
            elif ftype == 3:
                pred = (a + b) // 2
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
            cur[i] = (line[i] + pred) & 0xFF
        img[y], prev = cur, cur
    return img.reshape(h, w, 3).astype(np.uint8)


def count_color(img: np.ndarray, color) -> int:
    return int(np.all(img == np.array(color, dtype=np.uint8), axis=-1).sum())


def parse_csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


# ---- the library --------------------------------------------------------------------------------

def test_frontiers():
    assert bench.frontiers(16, 64, step_mul=2) == [16, 32, 64]
    assert bench.frontiers(16, 64, step_incr=16) == [16, 32, 48, 64]
    assert bench.frontiers(16, 70, step_incr=16) == [16, 32, 48, 64, 70]  # ctx_max always last
    assert bench.frontiers(10, 40, step_mul=1.5) == [10, 15, 23, 35, 40]
    assert bench.frontiers(1, 3, step_mul=1.01) == [1, 2, 3]  # at least +1
    assert bench.frontiers(8, 8, step_incr=4) == [8]
    for bad in (dict(), dict(step_incr=4, step_mul=2.0), dict(step_mul=1.0), dict(step_incr=0)):
        with pytest.raises(ValueError):
            bench.frontiers(16, 64, **bad)
    with pytest.raises(ValueError):
        bench.frontiers(64, 16, step_incr=4)


def test_bench_tokens_are_fixed_and_valid(engine):
    tok = engine.tokenizer
    seq = bench.bench_tokens(tok, 300)
    assert len(seq) == 300 and seq[0] == tok.bos_id
    assert all(0 <= t < engine.config.n_vocab for t in seq)
    unit = tok.encode(bench.BENCH_TEXT)
    assert seq[1:1 + len(unit)] == unit and seq[1 + len(unit):1 + 2 * len(unit)] == unit[:299 - len(unit)]
    assert bench.bench_tokens(tok, 300) == seq and bench.bench_tokens(tok, 40) == seq[:40]


def greedy(engine, prefix: list[int], n: int) -> list[int]:
    s = engine.session(ctx=len(prefix) + n)
    s.sync(prefix)
    out = []
    for _ in range(n):
        t = int(np.argmax(s.logits))
        s.eval(t)
        out.append(t)
    return out


def test_walk_prefills_only_new_tokens_and_restores(engine, monkeypatch):
    calls: list[tuple[int, int, int]] = []  # (session, position, tokens prefilled)
    original = Session._prefill

    def spy(self, new):
        calls.append((id(self), len(self.tokens), len(new)))
        return original(self, new)

    monkeypatch.setattr(Session, "_prefill", spy)
    seq = bench.bench_tokens(engine.tokenizer, 64)
    session = engine.session(ctx=64 + 4)
    rows = bench.run_bench(engine, seq, [16, 32, 64], gen_tokens=4, session=session, warmup=False)

    assert {c[0] for c in calls} == {id(session)}
    expected, prev = [], 0
    for f in (16, 32, 64):
        expected.append((prev, f - prev))                        # the new interval only
        expected += [(f + i, 1) for i in range(4)]               # the probe, from the frontier
        prev = f                                                 # restored: back at f
    assert [c[1:] for c in calls] == expected
    assert [r.prefill_tokens for r in rows] == [16, 16, 32]
    assert [r.frontier for r in rows] == [16, 32, 64]

    monkeypatch.setattr(Session, "_prefill", original)
    # Restored after the last probe: exactly the sequence prefix, with its logits.
    assert session.tokens == seq[:64]
    fresh = engine.session(ctx=64)
    fresh.sync(seq[:64])
    np.testing.assert_allclose(session.logits, fresh.logits, rtol=0, atol=1e-5 * np.abs(fresh.logits).max())
    # Each probe is the greedy continuation of its prefix, computed independently.
    for r in rows:
        assert len(r.probe) == 4 and r.probe == greedy(engine, seq[:r.frontier], 4)
        assert r.prefill_tok_s > 0 and r.gen_tok_s > 0 and r.backend == "reference"
        assert r.device.startswith("cpu: ") and "core" in r.device


def test_repeat_reruns_each_interval_and_probe_from_its_snapshot(engine, monkeypatch):
    calls: list[tuple[int, int]] = []
    original = Session._prefill

    def spy(self, new):
        calls.append((len(self.tokens), len(new)))
        return original(self, new)

    seq = bench.bench_tokens(engine.tokenizer, 32)
    once = bench.run_bench(engine, seq, [16, 32], gen_tokens=3, warmup=False)
    monkeypatch.setattr(Session, "_prefill", spy)
    session = engine.session(ctx=35)
    rows = bench.run_bench(engine, seq, [16, 32], gen_tokens=3, session=session, warmup=False,
                           repeat=2)
    expected, prev = [], 0
    for f in (16, 32):
        expected += [(prev, f - prev)] * 2 + [(f + i, 1) for i in range(3)] * 2
        prev = f
    assert calls == expected
    assert [r.probe for r in rows] == [r.probe for r in once]
    assert session.tokens == seq


def test_state_bytes(engine):
    seq = bench.bench_tokens(engine.tokenizer, 64)
    rows = bench.run_bench(engine, seq, [16, 32, 64], gen_tokens=2, warmup=False)
    session = engine.session(ctx=66)
    assert all(r.state_bytes == session.snapshot().nbytes for r in rows)  # the allocation
    kv = [r.kv_bytes for r in rows]
    assert kv[0] < kv[1] < kv[2] < rows[0].state_bytes  # live rows grow with the context
    # Counted by hand: per layer, raw rows inside the window, T // ratio compressed (and indexer)
    # rows of head_dim (indexer_head_dim) float32, plus the compressor frontiers.
    cfg = engine.config
    shapes = session.snapshot().arrays
    for r in rows:
        want = 0
        for il, arrays in shapes.items():
            want += min(r.frontier, cfg.sliding_window) * cfg.head_dim * 4
            if cfg.ratio(il):
                want += r.frontier // cfg.ratio(il) * cfg.head_dim * 4
                want += sum(a.nbytes for n, a in arrays.items() if n.endswith(("_kv", "_score")))
            if "index" in arrays:
                want += r.frontier // cfg.ratio(il) * cfg.indexer_head_dim * 4
        assert r.kv_bytes == want


def test_run_bench_rejects_a_short_session(engine):
    seq = bench.bench_tokens(engine.tokenizer, 64)
    with pytest.raises(ValueError, match="ctx"):
        bench.run_bench(engine, seq, [16, 64], gen_tokens=4, session=engine.session(ctx=64))
    with pytest.raises(ValueError, match="fewer than"):
        bench.run_bench(engine, seq[:32], [16, 64], gen_tokens=4)


# ---- the PNG renderer ---------------------------------------------------------------------------

def test_png_encoder_round_trips():
    rgb = np.random.default_rng(0).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    assert np.array_equal(read_png(encode_png(rgb)), rgb)


def test_chart_draws_series_axes_and_legend():
    panels = [Panel("prefill tokens/s", "context (tokens)",
                    [Series("alpha", [16, 32, 64, 128], [100, 90, 80, 70]),
                     Series("beta", [16, 32, 64, 128], [10, 20, 30, 40])]),
              Panel("generation tokens/s", "context (tokens)",
                    [Series("alpha", [16, 128], [5, 4]), Series("beta", [16, 128], [1, 2])])]
    img = read_png(render_chart(panels, width=900, panel_height=300, title="Test 123"))
    assert img.shape[1] == 900 and img.shape[0] > 300
    assert count_color(img, PALETTE[0]) > 300 and count_color(img, PALETTE[1]) > 300
    assert count_color(img, PALETTE[2]) == 0                    # only two series
    assert count_color(img, (0, 0, 0)) > 500                    # axes, title text
    assert count_color(img, (40, 40, 40)) > 500                 # tick labels, legend text


# ---- the command --------------------------------------------------------------------------------

def test_cli_csv_on_stdout(model_path):
    r = run("-m", model_path, *SMALL)
    assert r.exit_code == 0, r.output
    rows = parse_csv(r.stdout)
    assert tuple(rows[0].keys()) == bench.CSV_COLUMNS
    assert [int(x["frontier"]) for x in rows] == [16, 32, 64]
    assert [int(x["prefill_tokens"]) for x in rows] == [16, 16, 32]
    assert {x["gen_tokens"] for x in rows} == {"4"} and {x["backend"] for x in rows} == {"reference"}
    assert all(float(x["prefill_tok_s"]) > 0 and float(x["gen_tok_s"]) > 0 for x in rows)
    assert rows[0]["device"].startswith("cpu: ")
    assert rows[0]["model"] == ds4.Engine.open(model_path).config.name != ""
    assert len({x["state_bytes"] for x in rows}) == 1
    assert "prefill tok/s" in r.stderr and "gen tok/s" in r.stderr  # the table, on the terminal


def test_cli_csv_file_and_plot(model_path, tmp_path):
    out_csv, png = tmp_path / "run.csv", tmp_path / "run.png"
    r = run("-m", model_path, "--ctx-start", "16", "--ctx-max", "40", "--step-incr", "12",
            "--gen-tokens", "3", "--csv", out_csv, "--plot", png)
    assert r.exit_code == 0, r.output
    assert "prefill tok/s" in r.stdout and "backend," not in r.stdout  # table on stdout, CSV in file
    rows = bench.read_csv(out_csv)
    assert [x.frontier for x in rows] == [16, 28, 40] and [x.prefill_tokens for x in rows] == [16, 12, 12]
    assert all(x.gen_tokens == 3 for x in rows)
    img = read_png(png.read_bytes())
    assert img.shape[1] == 1280 and count_color(img, PALETTE[0]) > 200


def test_cli_plots_existing_csvs_without_running(model_path, tmp_path, monkeypatch):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    assert run("-m", model_path, *SMALL, "--csv", a).exit_code == 0
    rows = bench.read_csv(a)
    for x in rows:  # a second "backend", twice as fast
        x.backend, x.prefill_tok_s, x.gen_tok_s = "other", 2 * x.prefill_tok_s, 2 * x.gen_tok_s
    with open(b, "w") as f:
        bench.write_csv(rows, f)

    import cli.bench

    def no_engine(*a, **k):
        raise AssertionError("--from must not open a model")

    monkeypatch.setattr(cli.bench, "open_engine", no_engine)
    png = tmp_path / "both.png"
    r = run("--plot", png, "--from", a, "--from", b)
    assert r.exit_code == 0, r.output
    assert "2 series" in r.stdout
    img = read_png(png.read_bytes())
    assert count_color(img, PALETTE[0]) > 200 and count_color(img, PALETTE[1]) > 200

    r = run("--from", a)
    assert r.exit_code == 1 and "--plot" in r.output
    r = run("--plot", png, "--from", a, "--backend", "reference")
    assert r.exit_code == 1 and "without running" in r.output


def test_cli_compare_prints_ratios(model_path):
    r = run("-m", model_path, *SMALL, "--compare", "reference,reference")
    assert r.exit_code == 0, r.output
    rows = parse_csv(r.stdout)
    assert [x["frontier"] for x in rows] == ["16", "32", "64"] * 2  # the same sequence twice
    assert "prefill reference/reference" in r.stderr and "gen reference/reference" in r.stderr
    ratio_lines = [ln for ln in r.stderr.splitlines() if "×" in ln]
    assert len(ratio_lines) == 3 and all("yes" in ln for ln in ratio_lines)  # same probes


@pytest.mark.skipif("auto" not in ds4.backends.BACKENDS, reason="no 'auto' backend name")
def test_cli_compare_resolves_auto(model_path):
    r = run("-m", model_path, "--ctx-start", "8", "--ctx-max", "16", "--gen-tokens", "2",
            "--compare", "reference,auto")
    assert r.exit_code == 0, r.output
    want = ds4.backends.resolve_backend("auto")
    assert [x["backend"] for x in parse_csv(r.stdout)] == ["reference"] * 2 + [want] * 2
    assert f"prefill {want}/reference" in r.stderr


def test_cli_compare_names_a_missing_backend(model_path, monkeypatch):
    from ds4 import backends

    monkeypatch.setitem(backends.BACKENDS, "ghost", "ds4.backends.ghost_nowhere:Ghost")
    r = run("-m", model_path, *SMALL, "--compare", "reference,ghost")
    assert r.exit_code == 1 and "ghost" in r.output and "not available" in r.output
    assert "backend," not in r.stdout  # failed before running anything
    r = run("-m", model_path, *SMALL, "--compare", "reference,nosuch")
    assert r.exit_code == 1 and "nosuch" in r.output

    from ds4.backends import BACKENDS, available

    missing = [b for b in BACKENDS if b != "auto" and b not in available()]
    if missing:  # one backend: the same error, before the CSV header reaches stdout
        r = run("-m", model_path, *SMALL, "--backend", missing[0])
        assert r.exit_code == 1 and missing[0] in r.stderr and "not available" in r.stderr
        assert r.stdout == ""


def _mlx_available() -> bool:
    try:
        ds4.backends.backend_class("mlx")
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(_mlx_available(), reason="the mlx backend is available here")
def test_cli_compare_without_mlx_fails_clearly(model_path):
    r = run("-m", model_path, *SMALL, "--compare", "reference,mlx")
    assert r.exit_code == 1
    assert "mlx" in r.output and "not available" in r.output


@pytest.mark.skipif(not _mlx_available(), reason="the mlx backend is not available here")
def test_cli_compare_reference_mlx(model_path):
    r = run("-m", model_path, *SMALL, "--compare", "reference,mlx")
    assert r.exit_code == 0, r.output
    rows = parse_csv(r.stdout)
    assert [x["backend"] for x in rows] == ["reference"] * 3 + ["mlx"] * 3
    assert "prefill mlx/reference" in r.stderr


def test_cli_rejects_bad_walks(model_path):
    r = run("-m", model_path, "--step-incr", "8", "--step-mul", "2")
    assert r.exit_code == 1 and "not both" in r.output
    r = run("-m", model_path, "--ctx-start", "64", "--ctx-max", "16")
    assert r.exit_code == 1 and "--ctx-max" in r.output
    r = run("-m", model_path, "--ctx-start", "16", "--ctx-max", "4096", "--gen-tokens", "4")
    assert r.exit_code == 1 and "context_length" in r.output
    r = run("-m", model_path, "--compare", "reference,reference", "--backend", "reference")
    assert r.exit_code == 1 and "not both" in r.output


# ---- --csv: validate first, append unless --overwrite ------------------------------------------

def test_cli_csv_is_left_alone_when_the_run_cannot_start(model_path, tmp_path):
    out_csv = tmp_path / "keep.csv"
    out_csv.write_text("backend,device\nold,row\n")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(model_path.read_bytes()[:1000])
    r = run("-m", broken, *SMALL, "--csv", out_csv, "--overwrite")
    assert r.exit_code == 1 and "broken.gguf" in r.stderr, r.output
    r = run("-m", model_path, *SMALL[:2], "--ctx-max", "100000", "--csv", out_csv, "--overwrite")
    assert r.exit_code == 1 and "context_length" in r.stderr, r.output
    # not a ds4 bench CSV: refused without --overwrite
    r = run("-m", model_path, *SMALL, "--csv", out_csv)
    assert r.exit_code == 1 and "not a ds4 bench CSV" in r.stderr and "--overwrite" in r.stderr
    assert out_csv.read_text() == "backend,device\nold,row\n"
    r = run("-m", model_path, *SMALL, "--csv", tmp_path / "no" / "dir.csv")
    assert r.exit_code == 1 and "directory does not exist" in r.stderr
    # (a plot's directory too, before the run: it was found missing after it, the run lost)
    r = run("-m", model_path, *SMALL, "--plot", tmp_path / "no" / "run.png")
    assert r.exit_code == 1 and "--plot: directory does not exist" in r.stderr and "tokens/s" not in r.output
    r = run("-m", model_path, *SMALL, "--overwrite")
    assert r.exit_code == 1 and "give --csv" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["broken.gguf", "keep.csv"]  # no .part left


def test_cli_csv_appends_unless_overwrite(model_path, tmp_path):
    out_csv = tmp_path / "runs.csv"
    assert run("-m", model_path, *SMALL, "--csv", out_csv).exit_code == 0
    assert run("-m", model_path, *SMALL, "--csv", out_csv).exit_code == 0
    text = out_csv.read_text()
    assert text.count("backend,") == 1  # one header
    assert [x.frontier for x in bench.read_csv(out_csv)] == [16, 32, 64, 16, 32, 64]
    r = run("-m", model_path, *SMALL, "--csv", out_csv, "--overwrite")
    assert r.exit_code == 0, r.output
    assert [x.frontier for x in bench.read_csv(out_csv)] == [16, 32, 64]
    assert os.listdir(tmp_path) == ["runs.csv"]


def _one_row_csv(path):
    row = bench.BenchRow("reference", "cpu", "m.gguf", 16, 16, 0.5, 32.0, 4, 0.25, 16.0, 1024, 4096)
    with open(path, "w", newline="") as f:
        bench.write_csv([row], f)
    return path


def test_cli_plot_from_csvs_checks_its_directory_first(tmp_path, read_only_dir):
    """--plot --from: the same check as on a run, before the CSVs are read (a missing directory
    was found only when the PNG's temporary file could not be made)."""
    good = _one_row_csv(tmp_path / "good.csv")
    r = run("--plot", tmp_path / "nodir" / "p.png", "--from", good)
    assert r.exit_code == 1, r.output
    assert f"--plot: directory does not exist: {tmp_path / 'nodir'}" in r.stderr
    assert "Errno" not in r.output
    r = run("--plot", read_only_dir / "p.png", "--from", good)
    assert r.exit_code == 1 and f"--plot: directory not writable: {read_only_dir}" in r.stderr, r.output
    r = run("--plot", f"{tmp_path}/p.png/", "--from", good)
    assert r.exit_code == 1, r.output
    assert f"--plot: expected a file path, got a directory path '{tmp_path}/p.png/'" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["good.csv", "ro"] and os.listdir(read_only_dir) == []
    r = run("--plot", tmp_path / "p.png", "--from", good)  # (the same CSV plots)
    assert r.exit_code == 0 and (tmp_path / "p.png").is_file(), r.output


def test_cli_csv_that_is_not_utf8_names_the_option_and_file(model_path, tmp_path):
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"backend,dev\xbdice\n")
    r = run("-m", model_path, *SMALL, "--csv", binary)
    assert r.exit_code == 1, r.output
    assert f"--csv {binary}: not UTF-8 text (byte 11 is 0xbd)" in r.stderr and "codec" not in r.output
    assert binary.read_bytes() == b"backend,dev\xbdice\n"
    # --from: the byte's offset in the file, past the decoder's first chunk
    late = _one_row_csv(tmp_path / "late.csv")
    text = late.read_bytes()
    late.write_bytes(text + b"x" * 9000 + b"\xbd\n")
    r = run("--plot", tmp_path / "p.png", "--from", late)
    assert r.exit_code == 1, r.output
    assert f"--from {late}: not UTF-8 text (byte {len(text) + 9000} is 0xbd)" in r.stderr
    assert "codec" not in r.output and not (tmp_path / "p.png").exists()


def test_cli_csv_checks_where_it_writes(model_path, tmp_path, read_only_dir):
    """A new --csv needs a directory that takes a file (it is written beside and renamed);
    appending to an existing one needs only the file (it is opened in place)."""
    r = run("-m", model_path, *SMALL, "--csv", read_only_dir / "new.csv")
    assert r.exit_code == 1 and f"--csv: directory not writable: {read_only_dir}" in r.stderr, r.output
    assert "tokens/s" not in r.output
    r = run("-m", model_path, *SMALL, "--csv", f"{tmp_path}/new/")
    assert r.exit_code == 1, r.output
    assert f"--csv: expected a file path, got a directory path '{tmp_path}/new/'" in r.stderr
    assert not (tmp_path / "new").exists()
    old = _one_row_csv(tmp_path / "old.csv")
    read_only_dir.chmod(0o755)
    os.replace(old, read_only_dir / "old.csv")
    read_only_dir.chmod(0o555)
    r = run("-m", model_path, *SMALL, "--csv", read_only_dir / "old.csv")
    assert r.exit_code == 0, r.output
    assert [x.frontier for x in bench.read_csv(read_only_dir / "old.csv")] == [16, 16, 32, 64]
