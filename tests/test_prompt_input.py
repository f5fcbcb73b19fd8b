"""Where the user message comes from: `-p -` (generate, prefill) is stdin's text less exactly one
trailing newline ("\\n" or "\\r\\n", what `echo` and a here-string add); `--prompt-file` (prefill)
is the file's bytes, newlines and all. The expected prompts are tokenized here from the text
written out by hand, and compared with the tokens the command prefilled."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ds4
from ds4.core.chat import encode_prompt

from cli.common import strip_one_newline
from cli.main import app

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = re.compile(r"prompt: (\d+) tokens")


pytestmark = pytest.mark.usefixtures("private_cache")



@pytest.fixture(scope="module")
def eng(model_path):
    return ds4.Engine.open(model_path, backend="reference")


def run(*args, input: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def saved_tokens(eng, path: Path) -> list[int]:
    s = eng.session(ctx=4096)
    s.load_payload(path)
    return s.tokens


@pytest.mark.parametrize("text, want", [
    ("Hello there", "Hello there"),
    ("Hello there\n", "Hello there"),
    ("Hello there\r\n", "Hello there"),
    ("Hello there\n\n", "Hello there\n"),  # (a second newline is meant)
    ("Hello there\r\n\r\n", "Hello there\r\n"),
    ("Hello there\n\r", "Hello there\n\r"),  # (a lone "\r" is no newline here)
    ("\n", ""),
    ("", ""),
])
def test_strip_one_newline(text, want):
    assert strip_one_newline(text) == want


@pytest.mark.parametrize("stdin, message", [
    ("Hello there\n", "Hello there"),  # echo / <<<
    ("Hello there", "Hello there"),  # printf
    ("Hello there\n\n", "Hello there\n"),
])
def test_generate_prompt_from_stdin_drops_one_trailing_newline(model_path, eng, stdin, message):
    r = run("generate", "-m", model_path, "-p", "-", "-n", 0, "--backend", "reference", input=stdin)
    assert r.exit_code == 0, r.output
    want = len(encode_prompt(eng.tokenizer, message))
    assert int(PROMPT_TOKENS.search(r.stderr).group(1)) == want, (stdin, r.stderr)


@pytest.mark.parametrize("stdin, message", [
    ("Hello there\n", "Hello there"),
    ("Hello there\n\n", "Hello there\n"),
])
def test_prefill_prompt_from_stdin_drops_one_trailing_newline(model_path, eng, tmp_path, stdin, message):
    kv = tmp_path / "s.dsv4"
    r = run("prefill", "-m", model_path, "-p", "-", "--save-kv", kv, "--backend", "reference", input=stdin)
    assert r.exit_code == 0, r.output
    assert saved_tokens(eng, kv) == encode_prompt(eng.tokenizer, message)


def test_a_crlf_from_stdin_is_one_newline(model_path, eng, tmp_path):
    """A "\\r\\n" line end (a Windows echo, a CRLF file piped in) goes whole. In its own process:
    the test runner's stdin translates newlines, a real one does not."""
    kv = tmp_path / "s.dsv4"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS4_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "cli.main", "prefill", "-m", str(model_path), "-p", "-",
                        "--save-kv", str(kv), "--backend", "reference"],
                       input=b"Hello\r\nthere\r\n", cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert saved_tokens(eng, kv) == encode_prompt(eng.tokenizer, "Hello\r\nthere")


def test_prompt_file_is_taken_byte_for_byte(model_path, eng, tmp_path):
    """--prompt-file keeps every byte: its trailing newline, and "\\r\\n" as written (it was read
    in text mode, which turned "\\r\\n" into "\\n")."""
    text = "Hello\r\nthere\r\n"
    pf = tmp_path / "prompt.txt"
    pf.write_bytes(text.encode("utf-8"))
    kv = tmp_path / "s.dsv4"
    r = run("prefill", "-m", model_path, "--prompt-file", pf, "--save-kv", kv, "--backend", "reference")
    assert r.exit_code == 0, r.output
    assert saved_tokens(eng, kv) == encode_prompt(eng.tokenizer, text)


def test_the_help_says_what_stdin_and_a_file_keep():
    for command in ("generate", "prefill"):
        r = run(command, "--help")
        assert "less one trailing newline" in r.stdout, r.stdout
    assert "byte for byte" in run("prefill", "--help").stdout


def test_stdin_is_read_as_text_once(monkeypatch):
    """prompt_text reads stdin only for '-', and leaves any other prompt alone (a prompt that
    ends with a newline on the command line is the user's own)."""
    from cli.common import prompt_text

    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n", newline=""))
    assert prompt_text("typed\n") == "typed\n"
    assert prompt_text("-") == "from stdin"
