"""`ds4 chat` (multi-turn on one session, only new turns prefilled, /save, /think, /reset),
`ds4 --version`, and `--backend auto` choosing by machine and saying so once."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from serve_helpers import ROOT

N = 3


def _spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _cli(*args, input=None):
    p = _spawn(*args)
    out, err = p.communicate(input, timeout=600)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _expected_backend() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return "triton"
    except ImportError:
        pass
    if sys.platform == "darwin":
        pytest.skip("the Metal check is the backend registry's own")
    return "reference"


def test_version():
    import ds4

    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ds4 {ds4.__version__}"


def test_chat_turns_reuse_the_session(tmp_path):
    import ds4
    from ds4.core.default_model import default_model_path

    save = tmp_path / "chat.dsv4"
    chat = _spawn("chat", "-n", N, "-t", 0, "--nothink", "--system", "")  # runs while we compute
    eng = ds4.Engine.open(None, backend="reference")
    tok = eng.tokenizer
    eos = tok.eos_id

    def greedy(ids):
        s = eng.session(ctx=4096)
        s.sync(ids)
        return list(s.greedy(N, stop={eos}))

    def close(held):
        return held if held[-1] == eos else held + [eos]

    missing = tmp_path / "missing" / "x.dsv4"  # (a failed /save is said, and the chat goes on)
    model = default_model_path()
    folder = f"{tmp_path}/folder/"  # (names a directory: not written as a file `folder`)
    script = (f"Hello\nAgain\n/save {missing}\n/save {folder}\n/save {model}\n/save {save}\n/think on\n"
              "More\n/reset\n"
              "/think off\nHello\n")
    chat.stdin.write(script)  # (a few bytes: the pipe holds them until the chat reads)
    chat.stdin.flush()
    ids1 = [tok.bos_id, tok.user_id] + tok.encode("Hello") + [tok.assistant_id, tok.think_end_id]
    g1 = greedy(ids1)
    ids2 = close(ids1 + g1) + [tok.user_id] + tok.encode("Again") + [tok.assistant_id, tok.think_end_id]
    g2 = greedy(ids2)
    held3 = ids2 + g2
    ids3 = close(held3) + [tok.user_id] + tok.encode("More") + [tok.assistant_id, tok.think_start_id]
    out, err = chat.communicate(timeout=600)
    r = subprocess.CompletedProcess(chat.args, chat.returncode, out, err)
    assert r.returncode == 0, r.stderr
    want = _expected_backend()
    assert r.stderr.count(f"backend: {want} (--backend auto)") == 1
    turns = [(int(a), int(b)) for a, b in re.findall(r"prefilled (\d+) new tokens \((\d+) reused\)", r.stderr)]
    replies = r.stdout.split("\n")
    assert turns[0] == (len(ids1), 0)
    assert turns[1] == (len(ids2) - len(ids1 + g1), len(ids1 + g1))  # only the new turn
    assert turns[2] == (len(ids3) - len(held3), len(held3))
    assert turns[3] == (len(ids1), 0)  # after /reset
    no_eos = lambda g: [t for t in g if t != eos]  # noqa: E731
    assert replies[0] == tok.decode(no_eos(g1)) == replies[3]
    assert replies[1] == tok.decode(no_eos(g2))
    assert f"not saved to {missing}: /save: directory does not exist: {missing.parent}" in r.stderr
    assert f"not saved to {folder}: /save: expected a file path, got a directory path {folder!r}" in r.stderr
    assert not (tmp_path / "folder").exists()
    assert f"not saved to {model}: /save: {model} is the model file this command reads" in r.stderr
    # /save wrote the session after the second turn as a DSV4 payload
    s = eng.session(ctx=4096)
    s.load_payload(save)
    assert s.tokens == held3
