"""`ds4 tp-worker` and `--tp-listen`: the commands of tensor parallel, end to end.

The worker runs as a real `ds4 tp-worker` subprocess; the leader command runs in this process
(typer's runner). Each run is checked against the same command on one rank: the text of a
greedy reply, a payload decoded elsewhere, a refused hello naming the field on both sides.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ds4.core.tiny import make_tiny

from cli.main import app

ROOT = Path(__file__).resolve().parents[1]
CLI = "from cli.main import app; app()"
WAIT = "60"  # --tp-wait / --connect-timeout: generous on a loaded 2-core machine
GATE_MS = "20000"
GREEDY = ["--temp", "0", "--numerics", "exact", "--backend", "reference", "--ctx", "256"]


pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("model") / "test.gguf", preset="test", seed=3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def worker(tmp_path: Path, model: Path, port: int, *extra) -> subprocess.Popen:
    """`ds4 tp-worker` in a subprocess; it keeps dialling until the leader listens."""
    return subprocess.Popen(
        [sys.executable, "-c", CLI, "tp-worker", "--leader", f"127.0.0.1:{port}", "-m", str(model),
         "--backend", "reference", "--numerics", "exact", "--connect-timeout", WAIT,
         "--gate-timeout-ms", GATE_MS, *map(str, extra)],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200",
             "DS4_CACHE": str(tmp_path / "cache")})


def leader_args(port: int) -> list[str]:
    return ["--tp-listen", f"127.0.0.1:{port}", "--tp-wait", WAIT, "--gate-timeout-ms", GATE_MS]


def finish(p: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    return p.returncode, err


def test_generate_on_two_ranks_prints_the_one_rank_reply(tmp_path, model):
    one = run("generate", "-m", model, "-p", "Tell me a story", "-n", "16", *GREEDY)
    assert one.exit_code == 0, one.output
    port = free_port()
    w = worker(tmp_path, model, port)
    two = run("generate", "-m", model, "-p", "Tell me a story", "-n", "16", *GREEDY,
              *leader_args(port), "--debug-hash")
    code, err = finish(w)
    assert two.exit_code == 0, two.output
    assert two.stdout == one.stdout and one.stdout.strip()
    assert "waiting up to" in two.stderr and "worker joined" in two.stderr
    assert code == 0, err
    assert "joined the leader" in err and "the leader stopped" in err


def tls_leader(certs: Path) -> list:
    return ["--tls-cert", certs / "cert.pem", "--tls-key", certs / "key.pem"]


def test_a_payload_prefilled_on_two_ranks_decodes_on_one(tmp_path, model, certs):
    """Over TLS: a worker that trusts only the leader's certificate joins (the TLS options reach
    the leader of `prefill --tp-listen`, which once ignored them)."""
    kv_one, kv_two = tmp_path / "one.dsv4", tmp_path / "two.dsv4"
    r = run("prefill", "-m", model, "-p", "What is a token?", "--save-kv", kv_one, "--ctx", "256",
            "--numerics", "exact", "--backend", "reference")
    assert r.exit_code == 0, r.output
    port = free_port()
    w = worker(tmp_path, model, port, "--tls-ca", certs / "cert.pem")
    r = run("prefill", "-m", model, "-p", "What is a token?", "--save-kv", kv_two, "--ctx", "256",
            "--numerics", "exact", "--backend", "reference", *leader_args(port), *tls_leader(certs))
    code, err = finish(w)
    assert r.exit_code == 0 and code == 0, (r.output, err)
    replies = []
    for kv in (kv_one, kv_two):
        d = run("decode", "-m", model, "--load-kv", kv, "-n", "12", "--temp", "0",
                "--numerics", "exact", "--backend", "reference")
        assert d.exit_code == 0, d.output
        replies.append(d.stdout)
    assert replies[0] == replies[1] and replies[0].strip()


def test_a_payload_prefilled_on_one_rank_decodes_on_two(tmp_path, model, certs):
    """Over TLS, as the test above, for `decode --tp-listen`."""
    kv = tmp_path / "one.dsv4"
    r = run("prefill", "-m", model, "-p", "Count to ten", "--save-kv", kv, "--ctx", "256",
            "--numerics", "exact", "--backend", "reference")
    assert r.exit_code == 0, r.output
    one = run("decode", "-m", model, "--load-kv", kv, "-n", "12", "--temp", "0",
              "--numerics", "exact", "--backend", "reference")
    port = free_port()
    w = worker(tmp_path, model, port, "--tls-ca", certs / "cert.pem")
    two = run("decode", "-m", model, "--load-kv", kv, "-n", "12", "--temp", "0",
              "--numerics", "exact", "--backend", "reference", *leader_args(port), *tls_leader(certs))
    code, err = finish(w)
    assert one.exit_code == 0 and two.exit_code == 0 and code == 0, (one.output, two.output, err)
    assert two.stdout == one.stdout and one.stdout.strip()


def test_a_worker_on_another_model_is_refused_by_both(tmp_path, model):
    other = make_tiny(tmp_path / "other.gguf", preset="test", seed=4)
    port = free_port()
    w = worker(tmp_path, other, port)
    r = run("generate", "-m", model, "-p", "hi", "-n", "2", *GREEDY, *leader_args(port))
    code, err = finish(w)
    assert r.exit_code == 1 and "fingerprint" in r.stderr and "does not fit" in r.stderr, r.output
    assert code == 1 and "fingerprint" in err, err


def test_tp_listen_and_split_next_do_not_combine(model):
    r = run("generate", "-m", model, "-p", "hi", "--tp-listen", "127.0.0.1:1",
            "--split-next", "127.0.0.1:2", "--layers", "0:1")
    assert r.exit_code == 1 and "do not combine" in r.stderr


def test_help_explains_the_tensor_parallel_options():
    r = run("tp-worker", "--help")
    assert r.exit_code == 0 and "--leader" in r.stdout and "--tp-transport" in r.stdout
    for command in ("generate", "prefill", "decode", "bench", "serve"):
        h = run(command, "--help")
        assert h.exit_code == 0 and "--tp-listen" in h.stdout and "--gate-timeout-ms" in h.stdout
        assert "--tls-cert" in h.stdout and "--tls-ca" in h.stdout, command


def test_bench_on_two_ranks_labels_the_pair(tmp_path, model, certs):
    """Over TLS, as the payload tests above."""
    port = free_port()
    w = worker(tmp_path, model, port, "--tls-ca", certs / "cert.pem")
    csv = tmp_path / "tp.csv"
    r = run("bench", "-m", model, "--backend", "reference", "--numerics", "exact", "--ctx-start", "16",
            "--ctx-max", "32", "-n", "4", "--csv", csv, *leader_args(port), *tls_leader(certs))
    code, err = finish(w)
    assert r.exit_code == 0 and code == 0, (r.output, err)
    rows = csv.read_text().splitlines()
    assert len(rows) == 3 and all(row.startswith("tp2:reference+reference,") for row in rows[1:])


def test_a_worker_with_other_numerics_is_refused_by_both(tmp_path, model):
    # (a silent mismatch would sum partials of two different computations)
    port = free_port()
    w = subprocess.Popen(
        [sys.executable, "-c", CLI, "tp-worker", "--leader", f"127.0.0.1:{port}", "-m", str(model),
         "--backend", "reference", "--numerics", "ds4", "--connect-timeout", WAIT],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "DS4_CACHE": str(tmp_path / "cache")})
    r = run("generate", "-m", model, "-p", "hi", "-n", "2", *GREEDY, *leader_args(port))
    code, err = finish(w)
    assert r.exit_code == 1 and "flags" in r.stderr and "numerics exact" in r.stderr, r.output
    assert code == 1 and "numerics exact" in err, err
