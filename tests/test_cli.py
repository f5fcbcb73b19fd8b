"""The `ds4` command line: help, make-tiny, inspect, generate, and how errors are reported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import ds4
from ds4.core import tiny
from ds4.core.chat import DEFAULT_SYSTEM, encode_prompt
from ds4.core.gguf_model import GGUFModel
from ds4.core.gguf_write import write_gguf
from ds4.core.layout import expected_tensors
from ds4.core.quants import row_bytes
from ds4.core.tiny import make_tiny, preset_config, preset_vocabulary

from cli.main import app

ROOT = Path(__file__).resolve().parents[1]
STATS = re.compile(r"prompt: (\d+) tokens, .*tokens/s .* generated: (\d+) tokens, .*tokens/s")


pytestmark = pytest.mark.usefixtures("private_cache")



def run(*args: str, input: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def stats(stderr: str) -> tuple[int, int]:
    m = STATS.search(stderr)
    assert m, f"no stats line in stderr: {stderr!r}"
    return int(m.group(1)), int(m.group(2))


# ---- help ---------------------------------------------------------------------------------------

def test_help_lists_commands():
    r = run("--help")
    assert r.exit_code == 0
    for command in ("inspect", "make-tiny", "generate"):
        assert command in r.stdout


def test_no_command_prints_the_help_without_an_empty_error():
    """`ds4` alone answers with the help (exit 2, as click does); it ended with a line
    "error:  (see 'ds4 --help')" holding no error."""
    r = run()
    assert r.exit_code == 2
    assert "generate" in r.output and "error" not in r.output.lower(), r.output


@pytest.mark.parametrize("command, options", [
    ("inspect", []),
    ("make-tiny", ["--preset", "--experts", "--seed", "--yes"]),
    ("generate", ["--model", "--prompt", "--tokens", "--temp", "--top-k", "--top-p", "--min-p",
                  "--seed", "--nothink", "--system", "--ctx", "--prefill-cap", "--backend", "--numerics"]),
    ("chat", ["--ctx", "--prefill-cap"]),
    ("serve", ["--ctx", "--prefill-cap"]),
    ("bench", ["--prefill-cap"]),
])
def test_command_help_explains_options(command, options):
    r = run(command, "--help")
    assert r.exit_code == 0
    for option in options:
        assert option in r.stdout


def test_console_script_entry_point():
    # `main()` is what the `ds4` script runs; importing cli.main must not run anything.
    code = "import cli.main as m; m.main()"
    r = subprocess.run([sys.executable, "-c", code, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stdout
    r = subprocess.run([sys.executable, "-c", "import cli.main"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""


# ---- make-tiny ----------------------------------------------------------------------------------

def test_make_tiny_is_deterministic(tmp_path):
    paths = {name: tmp_path / f"{name}.gguf" for name in ("a", "b", "c")}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        r = run("make-tiny", paths[name], "--preset", "test", "--seed", seed)
        assert r.exit_code == 0, r.output
        fp = GGUFModel(paths[name]).fingerprint.hex()
        assert fp in r.stdout
        assert f"{paths[name].stat().st_size:,} bytes" in r.stdout
    assert paths["a"].read_bytes() == paths["b"].read_bytes()
    assert paths["a"].read_bytes() != paths["c"].read_bytes()


def test_make_tiny_experts_option(tmp_path):
    out = tmp_path / "q8.gguf"
    r = run("make-tiny", out, "--preset", "test", "--experts", "q8")
    assert r.exit_code == 0, r.output
    m = GGUFModel(out)
    assert m.tensor("blk.0.ffn_gate_exps.weight").type.name == "Q8_0"


def test_make_tiny_flash_needs_yes(tmp_path):
    out = tmp_path / "flash.gguf"
    r = run("make-tiny", out, "--preset", "flash")
    assert r.exit_code == 1
    assert "--yes" in r.stderr and "GiB" in r.stderr
    assert not out.exists()


def test_make_tiny_bad_preset(tmp_path):
    r = run("make-tiny", tmp_path / "x.gguf", "--preset", "huge")
    assert r.exit_code == 2
    assert "--preset" in r.stderr


# ---- inspect ------------------------------------------------------------------------------------

def test_inspect_valid_model(model_path):
    r = run("inspect", model_path)
    assert r.exit_code == 0, r.output
    m = GGUFModel(model_path)
    assert m.fingerprint.hex() in r.stdout
    assert "valid DS4 layout" in r.stdout
    assert m.config.name in r.stdout
    rows = [[c for c in ln.split() if c not in ("│", "┃")] for ln in r.stdout.splitlines()]
    total = sum(size for _, size in m.census().values())
    for type_name, (count, size) in m.census().items():
        row = next((row for row in rows if row[:1] == [type_name]), None)
        assert row == [type_name, str(count), f"{size:,}", f"{100 * size / total:.1f}%"]
    # per-layer compress ratios and kinds
    for il, ratio in enumerate(m.config.compress_ratios):
        row = next(row for row in rows if row[:2] == [str(il), str(ratio)])
        assert row[2] == m.config.layer_kind(il)


def _write_broken(path: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    tokens, merges = preset_vocabulary("test")
    cfg = preset_config("test", vocab_size=len(tokens))
    data = {}
    for spec in expected_tensors(cfg).values():
        if spec.name == drop:
            continue
        dims = spec.dims
        if spec.name == reshape:
            dims = (dims[0], dims[1] + 1, *dims[2:])
        n_rows = int(np.prod(dims[1:], dtype=np.int64))
        data[spec.name] = (spec.shipped, dims,
                           np.zeros(row_bytes(spec.shipped, dims[0]) * n_rows, np.uint8))
    return write_gguf(path, cfg, data, tokens, merges)


def test_inspect_missing_tensor(tmp_path):
    path = _write_broken(tmp_path / "missing.gguf", drop="blk.1.attn_q_a.weight")
    r = run("inspect", path)
    assert r.exit_code == 1
    assert "blk.1.attn_q_a.weight" in r.stderr and "missing" in r.stderr
    assert "Traceback" not in r.output


def test_inspect_wrong_dims(tmp_path):
    path = _write_broken(tmp_path / "dims.gguf", reshape="output.weight")
    r = run("inspect", path)
    assert r.exit_code == 1
    assert "output.weight" in r.stderr and "dims" in r.stderr
    assert "Traceback" not in r.output


def test_inspect_truncated(tmp_path, model_path):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(model_path.read_bytes()[: model_path.stat().st_size // 2])
    r = run("inspect", path)
    assert r.exit_code == 1
    assert r.stderr.startswith("error:")
    assert "Traceback" not in r.output


def test_a_vocabulary_that_is_not_utf8_names_its_key(tmp_path, model_path):
    """A token that is not UTF-8 text: generate and chat exit 1 naming the key and the token's
    index (it was a traceback ending in a bare UnicodeDecodeError)."""
    import struct

    from ds4.core.gguf_model import GGUFModel

    tokens = GGUFModel(model_path).vocabulary[0]
    index = max(range(len(tokens)), key=lambda i: len(tokens[i].encode("utf-8")))  # (a unique string)
    token = tokens[index].encode("utf-8")
    data = bytearray(model_path.read_bytes())
    at = data.find(struct.pack("<Q", len(token)) + token) + 8
    data[at] = 0xFF  # (never a UTF-8 byte)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    for args in (["generate", "-m", str(bad), "-p", "hi", "-n", "1"], ["chat", "-m", str(bad)]):
        r = run(*args, input="/quit\n")
        assert r.exit_code == 1, r.output
        assert f"tokenizer.ggml.tokens[{index}]: expected UTF-8 text" in r.stderr and "Traceback" not in r.output


def test_inspect_missing_file(tmp_path):
    r = run("inspect", tmp_path / "nope.gguf")
    assert r.exit_code == 1
    assert "nope.gguf" in r.stderr


def test_embedded_default_model_created_once(monkeypatch):
    # Stand in the fast test preset for the default one; the CLI's first-run path is the same.
    real = tiny.make_tiny
    monkeypatch.setattr(tiny, "make_tiny", lambda path, **kw: real(path, **{**kw, "preset": "test"}))
    r = run("inspect")
    assert r.exit_code == 0, r.output
    assert "creating the embedded default model" in r.stderr
    assert os.environ["DS4_CACHE"] in r.stdout
    r = run("inspect")
    assert r.exit_code == 0 and "creating" not in r.stderr
    r = run("generate", "-p", "hi", "-n", "2", "--temp", "0")
    assert r.exit_code == 0, r.output
    assert stats(r.stderr)[1] <= 2


# ---- generate -----------------------------------------------------------------------------------

def greedy_reference(path: Path, prompt: str, n: int, system=DEFAULT_SYSTEM, think=True):
    eng = ds4.Engine.open(path)
    ids = encode_prompt(eng.tokenizer, prompt, system=system, think=think)
    s = eng.session(ctx=4096)
    s.sync(ids)
    out: list[int] = []
    while len(out) < n:
        token = int(np.argmax(s.logits))
        if token == eng.tokenizer.eos_id:
            break
        out.append(token)
        s.eval(token)
    return ids, out, eng.tokenizer


@pytest.mark.parametrize("extra, system, think", [
    ([], DEFAULT_SYSTEM, True),
    (["--nothink", "--system", ""], None, False),
])
def test_generate_greedy_matches_library(model_path, extra, system, think):
    ids, out, tok = greedy_reference(model_path, "Hello there", 8, system=system, think=think)
    r = run("generate", "-m", model_path, "-p", "Hello there", "-n", 8, "--temp", 0, *extra)
    assert r.exit_code == 0, r.output
    assert r.stdout_bytes == (tok.decode(out) + "\n").encode("utf-8")
    assert stats(r.stderr) == (len(ids), len(out))


def test_generate_seeded_sampling_repeats(model_path):
    args = ["generate", "-m", model_path, "-p", "Tell me a story", "-n", 12, "--temp", 1]
    a = run(*args, "--seed", 7)
    b = run(*args, "--seed", 7)
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert a.stdout_bytes == b.stdout_bytes
    assert "seed 7" in a.stderr
    stats(a.stderr)


def test_generate_prompt_from_stdin(model_path):
    a = run("generate", "-m", model_path, "-p", "-", "-n", 4, "--temp", 0, input="Hello there")
    b = run("generate", "-m", model_path, "-p", "Hello there", "-n", 4, "--temp", 0)
    assert a.exit_code == 0 and a.stdout_bytes == b.stdout_bytes


@pytest.mark.parametrize("args, option", [
    (["--backend", "nope"], "--backend"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--temp", "-1"], "--temp"),
    (["--min-p", "1.5"], "--min-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--numerics", "fast"], "--numerics"),
    (["-n", "-1"], "--tokens"),
    (["--ctx", "1"], "--ctx"),
])
def test_generate_bad_option(model_path, args, option):
    r = run("generate", "-m", model_path, "-p", "hi", *args)
    assert r.exit_code == 2
    value = args[-1]  # the error names the option and the value it got
    assert option in r.stderr and (f"got {value}" in r.stderr or repr(value) in r.stderr), r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


@pytest.mark.parametrize("args, words", [
    (["--ctx", "100000"], ["--ctx", "context_length"]),
    (["--ctx", "8"], ["prompt", "--ctx"]),
    (["--ctx", "64", "--prefill-cap", "65"], ["--prefill-cap 65", "--ctx 64"]),
    (["-m", "/nonexistent/model.gguf"], ["not found", "model.gguf"]),
])
def test_generate_runtime_errors(model_path, args, words):
    r = run("generate", "-m", model_path, "-p", "hi", *args)
    assert r.exit_code == 1
    line = r.stderr.strip()
    assert line.startswith("error:") and "\n" not in line
    for word in words:
        assert word in line
    assert "Traceback" not in r.output


def test_generate_unavailable_backend(model_path):
    from ds4.backends import BACKENDS, available

    missing = [b for b in BACKENDS if b not in available()]
    if not missing:
        pytest.skip("every backend is available here")
    r = run("generate", "-m", model_path, "-p", "hi", "--backend", missing[0])
    assert r.exit_code == 1
    assert missing[0] in r.stderr and "Traceback" not in r.output


def test_generate_prefill_cap_reaches_the_session(model_path, monkeypatch):
    """--prefill-cap 3: the session prefills in chunks of 3 tokens (its layout says so), and the
    greedy text is a library session's at that prefill_cap."""
    eng = ds4.Engine.open(model_path)
    ids = encode_prompt(eng.tokenizer, "Hello there")
    s = eng.session(ctx=4096, prefill_cap=3)
    s.sync(ids)
    out = list(s.greedy(6, stop={eng.tokenizer.eos_id}))
    caps = []
    real = ds4.Engine.session

    def spy(self, *a, **kw):
        session = real(self, *a, **kw)
        caps.append(session.layout.prefill_cap)
        return session

    monkeypatch.setattr(ds4.Engine, "session", spy)
    r = run("generate", "-m", model_path, "-p", "Hello there", "-n", 6, "--temp", 0, "--prefill-cap", 3)
    assert r.exit_code == 0, r.output
    assert r.stdout_bytes == (eng.tokenizer.decode(out) + "\n").encode("utf-8")
    assert caps == [3]


def test_generate_stops_when_context_is_full(model_path):
    ids, _, _ = greedy_reference(model_path, "Hello there", 0)
    r = run("generate", "-m", model_path, "-p", "Hello there", "-n", 64, "--temp", 0,
            "--ctx", len(ids) + 3)
    assert r.exit_code == 0, r.output
    assert "context is full" in r.stderr
    prompt_tokens, generated = stats(r.stderr)
    assert prompt_tokens == len(ids) and generated <= 3
