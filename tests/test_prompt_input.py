"""Where the user message comes from: `-p -` (generate, prefill) is stdin's text less exactly one
trailing newline ("\\n" or "\\r\\n", what `echo` and a here-string add); `--prompt-file` (prefill)
is the file's bytes, newlines and all. The expected prompts are tokenized here from the text
written out by hand, and compared with the tokens the command prefilled. Text that is not UTF-8
(-p, -p -, --system, a chat line) is refused naming where it came from."""

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


# ---- text that is not UTF-8 -----------------------------------------------------------------------
# Under a UTF-8 or C locale Python decodes argv (and stdin) with surrogateescape: the byte 0xe9 of
# b"caf\xe9" arrives as the lone surrogate U+DCE9. It reached the tokenizer, and HF tokenizers
# failed with "TypeError: TextEncodeInput must be Union[...]" (exit 1, a traceback).

@pytest.mark.parametrize("args, stdin, line", [
    (["generate", "-p", "caf\udce9", "-n", 1], None,
     "Invalid value for '--prompt': expected UTF-8 text, got the byte 0xe9 at character 3"),
    (["generate", "-p", "-", "-n", 1], b"caf\xe9\n",
     "Invalid value for '--prompt': stdin: expected UTF-8 text, got the byte 0xe9 at character 3"),
    (["generate", "-p", "hi", "--system", "\udce9", "-n", 1], None,
     "Invalid value for '--system': expected UTF-8 text, got the byte 0xe9 at character 0"),
    (["prefill", "-p", "caf\udce9", "--save-kv", "{kv}"], None,
     "Invalid value for '--prompt': expected UTF-8 text, got the byte 0xe9 at character 3"),
    (["prefill", "-p", "-", "--save-kv", "{kv}"], b"ok\ncaf\xe9\n",
     "Invalid value for '--prompt': stdin: expected UTF-8 text, got the byte 0xe9 at character 6"),
    (["prefill", "-p", "hi", "--system", "ab\udcff", "--save-kv", "{kv}"], None,
     "Invalid value for '--system': expected UTF-8 text, got the byte 0xff at character 2"),
    (["chat", "--system", "\udce9"], b"hi\n",
     "Invalid value for '--system': expected UTF-8 text, got the byte 0xe9 at character 0"),
])
def test_text_that_is_not_utf8_is_refused_naming_the_option(model_path, tmp_path, args, stdin, line):
    """A command-line error (exit 2) on one line, naming the option, the byte and where; nothing
    is prefilled or saved. (The in-process runner's stdin is strict UTF-8, as Python's is under
    a locale such as en_US.UTF-8: that was a UnicodeDecodeError traceback.)"""
    kv = tmp_path / "s.dsv4"
    r = run(*[kv if a == "{kv}" else a for a in args], "-m", model_path, "--backend", "reference",
            input=stdin)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: {line} (see '") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == "" and not kv.exists()


def utf8_mode_env(tmp_path) -> dict:
    """A process's environment in which argv and stdin are UTF-8 decoded with surrogateescape,
    whatever the locale (Python's UTF-8 mode)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "DS4_CACHE": str(tmp_path / "cache"), "PYTHONUTF8": "1",
            "COLUMNS": "200"}


def test_bytes_that_are_not_utf8_in_argv_or_stdin_are_refused(model_path, tmp_path):
    """The same through a real process, with the bytes themselves in argv and on stdin."""
    base = [sys.executable, "-m", "cli.main", "generate", "-m", str(model_path), "-n", "1",
            "--backend", "reference", "-p"]
    for prompt, stdin, source in ((b"caf\xe9", b"", ""), (b"-", b"caf\xe9\n", "stdin: ")):
        r = subprocess.run(base + [prompt], input=stdin, cwd=ROOT, env=utf8_mode_env(tmp_path),
                           capture_output=True, timeout=300)
        assert r.returncode == 2, r.stderr.decode()
        assert r.stderr.decode().startswith(f"error: Invalid value for '--prompt': {source}expected UTF-8 text, "
                                            f"got the byte 0xe9 at character 3 (see '"), r.stderr.decode()


@pytest.mark.parametrize("in_process", [True, False])
def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(model_path, eng, tmp_path, in_process):
    """`ds4 chat` says so on one line and reads the next one; the conversation is kept (the
    turn after it reuses the first turn and its one-token reply). It was a traceback that
    ended the chat: a UnicodeDecodeError from a strict stdin (in process), a TypeError from
    the tokenizer where stdin is surrogateescape (a process in UTF-8 mode)."""
    from cli.chat import turn_tokens

    args = ["chat", "-m", model_path, "--backend", "reference", "-n", 1, "--temp", 0]
    stdin = b"hi\ncaf\xe9 ok\nthere\n"
    if in_process:
        r = run(*args, input=stdin)
        code, stderr = r.exit_code, r.stderr
    else:
        p = subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], input=stdin, cwd=ROOT,
                           env=utf8_mode_env(tmp_path), capture_output=True, timeout=300)
        code, stderr = p.returncode, p.stderr.decode()
    assert code == 0, stderr
    errors = [s for s in stderr.splitlines() if s.startswith("error:")]
    assert errors == ["error: this line: expected UTF-8 text, got the byte 0xe9 at character 3 (not sent)"]
    first = len(turn_tokens(eng.tokenizer, [], "hi", True, "You are a helpful assistant"))
    turns = re.findall(r"prefilled \d+ new tokens \((\d+) reused\)", stderr)
    assert turns == ["0", str(first + 1)], stderr
