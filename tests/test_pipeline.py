"""Pipeline split gates (wire.md §1) with real `ds4 pipe-worker` processes on loopback.

Every worker is a separate process started through the CLI command (`python -m cli.pipe
pipe-worker ...`, the same function cli/main.py registers). The test model has 5 layers with hash
routing in layers 0..2, so the stage boundaries used here are: 2 (inside the hash layers),
1 and 3 (a 3-stage chain), and 4 (after them). Every comparison is against the unsplit engine.
"""

from __future__ import annotations

import os
import socket
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
from ds4.core.sampling import GREEDY, Rng, SamplingParams
from ds4.core.tiny import make_tiny
from ds4.pipeline import PipelineError, PipelineRefused, SplitEngine, next_token, topk_for
from ds4.wire import qkp
from bench_modules import bench_module
from serve_helpers import Proc

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret"
PROMPT_A = [int(x) for x in np.random.default_rng(7).integers(0, 512, 20)]
PROMPT_B = [int(x) for x in np.random.default_rng(8).integers(0, 512, 13)]
N_GEN = 8
CTX = 128


class WorkerProc(Proc):
    """`pipe-worker` in its own process; `port` comes from its first stdout line."""

    def __init__(self, model: Path, layers: str, *args: str, port: int = 0, log_dir: Path):
        log = log_dir / f"worker-{layers.replace(':', '-')}-{time.monotonic_ns()}.log"
        super().__init__(["pipe-worker", str(port), layers, "-m", str(model), *args], log)

    def wait_ready(self, timeout: float = 60.0) -> "WorkerProc":
        return self.wait_listening(timeout)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_all(*workers: WorkerProc) -> None:
    for w in workers:
        w.wait_ready()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("pipe") / "test.gguf", preset="test", seed=1)


@pytest.fixture(scope="module")
def other_model(model_path, tmp_path_factory) -> Path:
    """The same shapes under another name: another fingerprint (weights are not hashed)."""
    data = model_path.read_bytes()
    assert data.count(b"ds4-synthetic-test") == 1
    path = tmp_path_factory.mktemp("other") / "other.gguf"
    path.write_bytes(data.replace(b"ds4-synthetic-test", b"ds4-synthetic-tesT"))
    return path


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def workers(model_path, logs):
    """The shared stages. last35 <- mid13 form a 3-stage chain behind a head running 0:1."""
    common = ("--max-rows", "6", "--io-timeout", "20")
    last35 = WorkerProc(model_path, "3:5", "--slots", "2", "--snapshots", "2", *common, log_dir=logs)
    last25 = WorkerProc(model_path, "2:5", "--ctx", "256", *common, log_dir=logs)
    token_file = logs / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    last45 = WorkerProc(model_path, "4:5", "--auth-token-file", str(token_file), *common, log_dir=logs)
    procs = [last35, last25, last45]
    try:
        start_all(*procs)
        mid13 = WorkerProc(model_path, "1:3", "--slots", "2", "--snapshots", "2",
                           "--next", last35.addr, *common, log_dir=logs)
        procs.append(mid13)
        start_all(mid13)
        yield {"chain": mid13, "last35": last35, "inside": last25, "after": last45}
    finally:
        for p in procs:
            p.kill()


@pytest.fixture(scope="module")
def unsplit(model_path):
    return ds4.Engine.open(model_path)


def generate(session, prompt, n=N_GEN, params=GREEDY, seed=0) -> list[int]:
    rng = Rng(seed)
    session.sync(prompt)
    out = []
    for _ in range(n):
        t = next_token(session, params, rng)
        out.append(t)
        session.eval(t)
    return out


@pytest.fixture(scope="module")
def reference(unsplit):
    return {name: generate(unsplit.session(ctx=CTX), p) for name, p in (("A", PROMPT_A), ("B", PROMPT_B))}


def head(model, worker, a, **kw) -> SplitEngine:
    kw.setdefault("io_timeout", 20.0)
    kw.setdefault("connect_timeout", 5.0)
    return SplitEngine.open(model, worker.addr, f"0:{a}", **kw)


# ---- token identity -------------------------------------------------------------------------------


@pytest.mark.parametrize("where,a,token", [("inside", 2, None), ("after", 4, TOKEN), ("chain", 1, None)],
                         ids=["split-inside-hash-layers", "split-after-hash-layers", "3-stage-chain"])
def test_split_is_token_identical_to_unsplit(model_path, workers, reference, where, a, token):
    with head(model_path, workers[where], a, auth_token=token) as eng:
        assert eng.connect().layer_first == a
        s = eng.session(ctx=CTX)
        assert generate(s, PROMPT_A) == reference["A"]
        # prefix reuse: a longer prompt continues at base = len(held), a different one restarts
        s.sync(PROMPT_A + reference["A"][:3])
        assert s.greedy == reference["A"][3]
        assert generate(s, PROMPT_B) == reference["B"]


def test_prefill_streams_with_at_most_two_frames_in_flight(model_path, workers, reference):
    with head(model_path, workers["chain"], 1) as eng:
        s = eng.session(ctx=CTX)
        link, seen, peak = eng.link, [], [0]
        send, recv = link.send_eval, link.recv_eval

        def send_eval(slot, base, tokens, rows, topk):
            seen.append((base, len(tokens), topk))
            send(slot, base, tokens, rows, topk)
            peak[0] = max(peak[0], link.in_flight)

        link.send_eval, link.recv_eval = send_eval, recv
        s.sync(PROMPT_A)
        assert [b for b, _, _ in seen] == [0, 6, 12, 18] and peak[0] == 2  # max_rows 6
        assert s.greedy == reference["A"][0]


def test_sampling_on_the_head_reproduces_a_seed(model_path, workers, unsplit):
    params = SamplingParams(temperature=0.9, top_k=40)
    with head(model_path, workers["chain"], 1, sampling=params) as eng:
        split = generate(eng.session(ctx=CTX), PROMPT_A, 12, params, seed=5)
    assert split == generate(unsplit.session(ctx=CTX), PROMPT_A, 12, params, seed=5)
    assert split != generate(unsplit.session(ctx=CTX), PROMPT_A, 12, GREEDY)


SAMPLERS = {
    "default": SamplingParams(),  # T 1, min-p 0.05
    "hot-min-p": SamplingParams(temperature=1.5),  # more than 256 tokens pass min-p
    "top-p": SamplingParams(top_p=0.95, min_p=0.0),  # the nucleus is wider than 256
    "top-k-40": SamplingParams(temperature=0.8, top_k=40),
    "top-k-300": SamplingParams(top_k=300, min_p=0.0),
}


def _survivors(logits, params) -> int:
    """Tokens with exp((l - l_max) / T) >= min_p: what the min-p path draws from."""
    x = logits.astype(np.float64)
    return int((np.exp((x - x.max()) / params.temperature) >= params.min_p).sum())


@pytest.mark.parametrize("where,a", [("inside", 2), ("chain", 1)], ids=["2-stage", "3-stage"])
def test_split_sampling_is_token_identical_to_unsplit(model_path, workers, unsplit, where, a):
    """Every sampler, several seeds: SplitSession.sample yields what Session.sample yields,
    and the rng ends in the same state."""
    cold = unsplit.session(ctx=CTX)
    cold.sync(PROMPT_A)
    assert _survivors(cold.logits, SAMPLERS["hot-min-p"]) > qkp.TOPK_MAX  # the case exercised
    with head(model_path, workers[where], a) as eng:
        s = eng.session(ctx=CTX)
        for name, params in SAMPLERS.items():
            for seed in ((1, 2) if where == "inside" else (3,)):
                want_rng, got_rng = Rng(seed), Rng(seed)
                ref = unsplit.session(ctx=CTX)
                ref.sync(PROMPT_A)
                want = list(ref.sample(N_GEN, params, want_rng))
                s.sampling = params
                s.sync(PROMPT_A)
                got = list(s.sample(N_GEN, params, got_rng))
                assert got == want, (name, seed)
                assert got_rng.state == want_rng.state and s.tokens == ref.tokens
                if topk_for(params) == qkp.TOPK_LOGITS:
                    assert np.array_equal(s.logits, ref.logits)
        # a session synced greedily and then sampled replays once, and stays exact
        s.sampling = GREEDY
        s.sync(PROMPT_B)
        ref = unsplit.session(ctx=CTX)
        ref.sync(PROMPT_B)
        params = SAMPLERS["top-p"]
        assert list(s.sample(4, params, Rng(7))) == list(ref.sample(4, params, Rng(7)))
        assert next_token(s, params, Rng(8)) == next_token(ref, params, Rng(8))


def test_two_slots_interleaved_each_match_unsplit(model_path, workers, reference):
    with head(model_path, workers["chain"], 1, slots=2) as eng:
        a, b = eng.session(ctx=CTX), eng.session(ctx=CTX)
        with pytest.raises(PipelineError, match="slots"):
            eng.session(ctx=CTX)
        a.sync(PROMPT_A)
        b.sync(PROMPT_B)
        outs = {"A": [], "B": []}
        for _ in range(N_GEN):
            for name, s in (("A", a), ("B", b)):
                t = s.greedy
                outs[name].append(t)
                s.eval(t)
        assert outs == reference


# ---- sessions belong to their connection ---------------------------------------------------------


def _drain_closed(conn, limit=5.0) -> bytes:
    """What the worker sends before it closes `conn`; fails if it answers nothing and stays open."""
    got = b""
    deadline = time.monotonic() + limit
    while True:
        try:
            got += bytes(conn.recv_exact(1, timeout=max(0.01, deadline - time.monotonic())))
        except qkp.QkpClosed as e:
            assert e.field == "eof", "the worker neither answered nor closed the connection"
            return got


def test_rogue_connection_cannot_touch_another_session(model_path, workers, reference):
    """A second connection writing the head's slot number at the head's position is closed
    unanswered; opening a slot of its own on a full worker is refused; the head's text is the
    unsplit text."""
    w = workers["inside"]  # --slots 1
    with head(model_path, w, 2) as eng:
        s = eng.session(ctx=CTX)
        s.sync(PROMPT_A)
        out = []
        for _ in range(3):
            out.append(s.greedy)
            s.eval(out[-1])
        hello = eng.link.hello
        rows = np.random.default_rng(9).standard_normal((1, hello.n_hc, hello.n_embd)).astype("<f4")
        rogue = qkp.Conn.connect("127.0.0.1", w.port, 5.0)
        assert qkp.client_handshake(rogue, None, exact=False) == hello
        rogue.send(qkp.Header(qkp.EVAL, s.slot, 1, len(s.tokens), 0).pack(),
                   np.array([5], "<u4"), rows)
        assert _drain_closed(rogue) == b""
        rogue.close()
        rogue = qkp.Conn.connect("127.0.0.1", w.port, 5.0)
        qkp.client_handshake(rogue, None, exact=False)
        rogue.send(qkp.Header(qkp.OPEN, s.slot, 0, 0, 0).pack())
        assert qkp.STATUS.unpack(bytes(rogue.recv_exact(4)))[0] == qkp.STATUS_NO_SLOT
        rogue.close()
        for _ in range(N_GEN - 3):
            out.append(s.greedy)
            s.eval(out[-1])
        assert out == reference["A"]
    assert "slot 0 is not open on this connection" in w.log.read_text()


PROMPTS = {"A": PROMPT_A, "B": PROMPT_B,
           "C": [int(x) for x in np.random.default_rng(9).integers(0, 512, 17)],
           "D": [int(x) for x in np.random.default_rng(10).integers(0, 512, 9)]}


def test_concurrent_heads_each_match_unsplit(model_path, logs, unsplit):
    """Four heads (four connections, each with its own slot 0) generate at once on one worker
    with --slots 4, each token-identical to unsplit; a fifth is refused, and gets a slot once
    one head has finished."""
    expected = {k: generate(unsplit.session(ctx=CTX), p) for k, p in PROMPTS.items()}
    w = WorkerProc(model_path, "2:5", "--slots", "4", "--max-rows", "6", log_dir=logs).wait_ready()
    engines = {k: head(model_path, w, 2) for k in PROMPTS}
    got, errors = {}, []
    start = threading.Barrier(len(PROMPTS))

    def run(name):
        try:
            s = engines[name].session(ctx=CTX)
            s.sync(PROMPTS[name][:1])  # every head holds its slot before any generates
            start.wait(timeout=30)
            got[name] = generate(s, PROMPTS[name])
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)
            start.abort()

    try:
        threads = [threading.Thread(target=run, args=(k,)) for k in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert got == expected
        with head(model_path, w, 2) as fifth:
            t0 = time.monotonic()
            s = fifth.session(ctx=CTX)
            with pytest.raises(PipelineRefused, match="no free slot"):
                s.sync(PROMPT_A)
            assert time.monotonic() - t0 < 5
            engines.pop("A").close()  # its connection closes: its slot goes back
            assert generate(s, PROMPT_A) == expected["A"]
    finally:
        for e in engines.values():
            e.close()
        w.kill()


def test_a_chain_refuses_a_head_when_its_last_stage_is_full(model_path, reference):
    """A head on a 3-stage chain whose last stage's one slot is held by a head connected to it
    directly: refused, and the middle stage gives back the slot it had granted."""
    from ds4.pipeline import Stage, Worker

    def stage(a, b):
        return Stage(ds4.Engine.open(model_path, layers=range(a, b)), slots=1, ctx=CTX, max_rows=6)

    last = Worker(stage(3, 5), io_timeout=10.0).start()
    mid = Worker(stage(1, 3), next_addr=("127.0.0.1", last.port), io_timeout=10.0).start()
    try:
        with SplitEngine.open(model_path, f"127.0.0.1:{last.port}", "0:3") as direct, \
                SplitEngine.open(model_path, f"127.0.0.1:{mid.port}", "0:1") as chained:
            s = direct.session(ctx=CTX)
            s.sync(PROMPT_A)
            t = chained.session(ctx=CTX)
            with pytest.raises(PipelineRefused, match="no free slot"):
                t.sync(PROMPT_A)
            assert all(x.owner is None for x in mid.stage.slots)  # given back
            s.close()  # FREE: the last stage's slot is free again
            assert generate(t, PROMPT_A) == reference["A"]
    finally:
        mid.stop()
        last.stop()


def test_snapshot_restores_a_prefix_on_every_stage(model_path, workers, unsplit):
    prefix, rest = PROMPT_A[:14], [5, 77, 300]
    cold = unsplit.session(ctx=CTX)
    expected = generate(cold, prefix + rest)
    with head(model_path, workers["chain"], 1, slots=2, snapshots=2) as eng:
        s, other = eng.session(ctx=CTX), eng.session(ctx=CTX)
        s.sync(prefix)
        snap = s.snapshot(1)
        s.sync(PROMPT_B)  # overwrites this slot on every stage
        bases = []
        send = eng.link.send_eval
        eng.link.send_eval = lambda slot, base, *r: (bases.append(base), send(slot, base, *r))
        s.restore(snap)
        assert s.tokens == prefix
        assert generate(s, prefix + rest) == expected
        assert bases[0] == len(prefix)  # continued after the restored prefix, no re-prefill
        bases.clear()
        other.restore(snap)  # any slot can load it
        assert generate(other, prefix + rest) == expected and bases[0] == len(prefix)
        with pytest.raises(ValueError, match="snapshot index"):
            s.snapshot(2)


# ---- different backends ------------------------------------------------------------------------------

def _require_backend(name: str, model: Path) -> None:
    """Skip unless `name` can run here at a test's speed (triton: on a CUDA GPU)."""
    from ds4.backends import backend_class
    from ds4.core.gguf_model import GGUFModel

    try:
        be = backend_class(name)(GGUFModel(model).config)
    except (RuntimeError, ImportError) as e:
        pytest.skip(f"backend {name} cannot run here: {e}")
    if name == "triton" and be.device == "cpu":
        pytest.skip("triton without CUDA runs interpreted (TRITON_INTERPRET): too slow here")


@pytest.mark.parametrize("head_backend,worker_backend", [
    ("reference", "mlx"), ("mlx", "reference"), ("reference", "triton"), ("triton", "reference")])
def test_head_and_worker_on_different_backends(model_path, logs, reference, head_backend, worker_backend):
    _require_backend(head_backend if worker_backend == "reference" else worker_backend, model_path)
    w = WorkerProc(model_path, "2:5", "--backend", worker_backend, log_dir=logs).wait_ready()
    try:
        with head(model_path, w, 2, backend=head_backend) as eng:
            assert generate(eng.session(ctx=CTX), PROMPT_A) == reference["A"]
    finally:
        w.kill()


# ---- failures ---------------------------------------------------------------------------------------


def test_worker_killed_mid_generation(model_path, logs, reference):
    """Kill the last stage between two decode steps, then the middle one while a prefill
    streams (two frames in flight): each time a clean PipelineError within seconds, the head survives, a request while
    the stage is down fails fast, and after a restart on the same port the next request
    succeeds."""
    opts = ("--io-timeout", "10", "--max-rows", "6")
    last = WorkerProc(model_path, "3:5", *opts, log_dir=logs).wait_ready()
    mid = WorkerProc(model_path, "1:3", "--next", last.addr, *opts, log_dir=logs).wait_ready()
    procs = [last, mid]
    long_prompt = [int(x) for x in np.random.default_rng(3).integers(0, 512, 120)]
    try:
        with head(model_path, mid, 1, io_timeout=10.0) as eng:
            for victim in ("last", "mid"):
                s = eng.session(ctx=CTX)
                s.sync(PROMPT_A)
                for t in reference["A"][:3]:
                    assert s.greedy == t
                    s.eval(t)
                proc = last if victim == "last" else mid
                t0 = time.monotonic()
                with pytest.raises(PipelineError) as e:
                    if victim == "last":
                        proc.kill()
                        s.eval(reference["A"][3])
                    else:  # killed while the prefill streams: after the 3rd of 20 replies
                        recv, seen = eng.link.recv_eval, []

                        def recv_then_kill(*a):
                            seen.append(recv(*a))
                            if len(seen) == 3:
                                proc.kill()
                            return seen[-1]

                        eng.link.recv_eval = recv_then_kill
                        try:
                            s.sync(long_prompt)
                        finally:
                            eng.link.recv_eval = recv
                assert time.monotonic() - t0 < 5
                assert "broke" in str(e.value) and "Traceback" not in str(e.value)
                t0 = time.monotonic()
                with pytest.raises(PipelineError, match="cannot reach|closed the connection"):
                    s.sync(PROMPT_A)  # still down: fails fast, no hang
                assert time.monotonic() - t0 < 5
                with pytest.raises(PipelineError, match="sync it again"):
                    s.eval(1)
                restarted = WorkerProc(model_path, "3:5" if victim == "last" else "1:3",
                                       *(["--next", last.addr] if victim == "mid" else []),
                                       *opts, port=proc.port, log_dir=logs).wait_ready()
                procs.append(restarted)
                if victim == "last":
                    last = restarted
                else:
                    mid = restarted
                assert generate(s, PROMPT_A) == reference["A"]
                s.close()
    finally:
        for p in procs:
            p.kill()


def test_a_session_replays_after_a_reconnect(model_path, workers, reference):
    """A connection lost between requests costs a re-prefill, not an error."""
    with head(model_path, workers["inside"], 2) as eng:
        s = eng.session(ctx=CTX)
        s.sync(PROMPT_A)
        eng.link.drop()  # as if the worker had closed an idle connection
        out = []
        for _ in range(N_GEN):
            out.append(s.greedy)
            s.eval(out[-1])
        assert out == reference["A"] and eng.link.generation == 2


def test_hello_refusals(model_path, other_model, workers):
    after, inside = workers["after"], workers["inside"]
    cases = [
        (dict(model=other_model, worker=after, a=4, auth_token=TOKEN), "fingerprint"),
        (dict(model=model_path, worker=after, a=2, auth_token=TOKEN), "contiguous"),
        (dict(model=model_path, worker=after, a=4, auth_token="wrong"), "did not prove the auth token"),
        (dict(model=model_path, worker=after, a=4, auth_token=""), "requires an auth token"),
        (dict(model=model_path, worker=inside, a=2, numerics="exact"), "numerics"),
        (dict(model=model_path, worker=inside, a=2, slots=2), "slots"),
    ]
    for kw, why in cases:
        eng = head(kw.pop("model"), kw.pop("worker"), kw.pop("a"), **kw)
        with pytest.raises(PipelineRefused, match=why):
            eng.connect()
    with head(model_path, inside, 2) as eng:  # ctx 256 on that worker
        with pytest.raises(PipelineRefused, match="ctx"):
            eng.session(ctx=512).sync([1, 2, 3])
    with head(model_path, after, 4, auth_token=TOKEN) as eng:  # and it still serves
        eng.session(ctx=CTX).sync([1, 2, 3])


def test_hostile_frames_close_only_that_connection(workers, model_path, reference):
    w = workers["inside"]
    for payload in (qkp.Header(qkp.EVAL, 0, qkp.NO_TOKEN, 0, 0).pack(),  # n far over max_rows
                    qkp.Header(9, 0, 1, 0, 0).pack(),  # unknown op
                    qkp.Header(qkp.EVAL, 0, 1, 0, 0).pack() + b"\xff\xff\xff\xff"):  # bad token id
        conn = qkp.Conn.connect("127.0.0.1", w.port, 5.0)
        qkp.client_handshake(conn, None, exact=False)
        conn.send(payload)
        with pytest.raises(qkp.QkpClosed) as e:
            conn.recv_exact(1)
        assert e.value.field == "eof"
        conn.close()
    time.sleep(0.2)
    log = w.log.read_text()
    assert "n: expected 1..6 rows" in log and "op: expected" in log and "tokens:" in log
    with head(model_path, w, 2) as eng:
        assert generate(eng.session(ctx=CTX), PROMPT_A) == reference["A"]


# ---- command line -----------------------------------------------------------------------------------


def _cli():
    from cli.pipe import register

    app = typer.Typer()

    @app.callback()
    def _root():
        pass

    register(app)
    return app


@pytest.mark.parametrize("args,why", [
    (["0", "0:3"], "A >= 1"), (["0", "1:3"], "needs --next"), (["0", "3:9"], "0 <= A < B <= 5"),
    (["0", "3:5", "--next", "127.0.0.1:1"], "no next stage"), (["0", "x"], "A:B"),
])
def test_pipe_worker_refuses_bad_ranges(model_path, args, why):
    r = CliRunner().invoke(_cli(), ["pipe-worker", *args, "-m", str(model_path)])
    assert r.exit_code == 1 and "error:" in r.output and why in r.output, r.output
    assert "Traceback" not in r.output


def test_open_split_engine_reports_a_missing_worker_as_one_line(model_path):
    from cli.pipe import open_split_engine

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = typer.Typer()

    @app.command()
    def go():
        open_split_engine(model_path, "reference", "ds4", f"127.0.0.1:{port}", "0:2")

    r = CliRunner().invoke(app, [])
    assert r.exit_code == 1 and "cannot reach the next stage" in r.output
    assert "Traceback" not in r.output


def test_bench_frame_round_trip_smoke():
    """bench/pipeline/bench_split.py's frame measurement, a few frames against a null stage."""
    bench_split = bench_module("pipeline", "bench_split")
    from ds4.pipeline import Worker

    w = Worker(bench_split.NullStage(4096, 4)).start()
    try:
        r = bench_split.frame_rtt(w.port, 4096, 4, iters=20, topk=8)
    finally:
        w.stop()
    assert r["row_bytes"] == 64 * 1024 and r["reply_bytes"] == 4 + 8 * 8 and r["median_us"] > 0


def test_cli_generate_split_next_equals_unsplit(model_path, logs):
    """`ds4 generate --split-next HOST:PORT --layers 0:3` prints the unsplit run's text."""
    worker = WorkerProc(model_path, "3:5", "--ctx", "4096", log_dir=logs).wait_ready()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "cli.main", "generate", "-m", str(model_path), "-p", "hello",
            "-n", "6", "--temp", "0"]
    # the default sampler (min-p 0.05) at T 1.5 draws from more than 256 tokens of this model
    sampled = base[:-2] + ["-n", "12", "--temp", "1.5", "--seed", "5"]
    split_args = ["--split-next", worker.addr, "--layers", "0:3"]
    runs = {}
    try:
        for name, argv in (("greedy", base), ("sampled", sampled)):
            runs[name] = [subprocess.run(argv + extra, cwd=ROOT, env=env, capture_output=True,
                                         text=True, timeout=120)
                          for extra in (split_args, [])]
        with head(model_path, worker, 3) as holder:  # takes the worker's one slot (--slots 1)
            holder.session(ctx=CTX).sync([1, 2, 3])
            full = subprocess.run(base + split_args, cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=120)
    finally:
        worker.kill()
    assert full.returncode == 1 and "error:" in full.stderr and "no free slot" in full.stderr
    assert full.stdout == "" and "Traceback" not in full.stderr
    for name, (split, whole) in runs.items():
        assert split.returncode == 0, split.stderr
        assert whole.returncode == 0, whole.stderr
        assert split.stdout == whole.stdout and len(whole.stdout.strip()) > 0, name
    assert "generated: 6 tokens" in runs["greedy"][0].stderr
    bad = subprocess.run(base + ["--layers", "0:3"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "--layers is only used with --split-next" in bad.stderr
