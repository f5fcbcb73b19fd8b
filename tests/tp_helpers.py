"""Helpers for tests/test_tp.py: rank engines, pairs with the worker in a thread, and workers in a
subprocess (for faults a thread cannot have: SIGKILL, SIGSTOP; and torch.distributed, whose
default process group is one per process).

As a script it is that subprocess worker:

    python tests/tp_helpers.py MODEL PORT BACKEND NUMERICS TRANSPORT GATE_TIMEOUT_MS IO_TIMEOUT_S
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent


def rank_engine(path, backend: str, numerics: str, rank: int, **backend_options):
    """rank's share of the model bound to a backend (what TPEngine / TPWorker.open bind)."""
    from ds4.tp.rank import open_rank

    return open_rank(path, rank, backend, numerics, **backend_options)


def leader_on(engine, ctx: int, opts=None, wait_s: float = 60.0):
    """A TPEngine around an already bound rank-0 engine, listening on a free loopback port."""
    from ds4.tp import Options, TPEngine
    from ds4.tp.link import listen

    return TPEngine(engine, listen(HOST, 0), ctx, opts or Options(gate_timeout_ms=20000), wait_s)


class ThreadWorker:
    """A TPWorker serving in a daemon thread; `error` is what it raised (None: it returned)."""

    def __init__(self, addr, engine=None, path=None, backend="reference", numerics="exact",
                 opts=None, before_serve=None):
        from ds4.tp import Options, TPWorker

        self.error: BaseException | None = None
        self.worker = None
        opts = opts or Options(gate_timeout_ms=20000)

        def run():
            try:
                self.worker = TPWorker.open(path, addr, backend=backend, numerics=numerics, opts=opts,
                                            engine=engine)
                if before_serve is not None:
                    before_serve(self.worker)
                self.worker.serve()
            except BaseException as e:  # noqa: BLE001 (reported to the test)
                self.error = e

        self.thread = threading.Thread(target=run, name="tp-worker", daemon=True)
        self.thread.start()

    def join(self, timeout: float = 60.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the worker thread did not finish"


@contextlib.contextmanager
def threaded_pair(lead_engine, worker_engine, ctx: int, lead_opts=None, worker_opts=None,
                  before_serve=None, check_worker: bool = True):
    """Leader (this thread) + worker (a thread) over loopback; yields the TPEngine."""
    tp = leader_on(lead_engine, ctx, lead_opts)
    w = ThreadWorker(tp.address, engine=worker_engine, opts=worker_opts, before_serve=before_serve)
    try:
        tp.ensure_worker()
        yield tp
    finally:
        tp.close()
        w.join()
    if check_worker and w.error is not None:
        raise AssertionError(f"the worker failed: {w.error!r}") from w.error


def one_rank_run(engine, prompt, n: int, ctx: int):
    """(logits after the prompt, n greedy tokens, logits after them) on one session."""
    s = engine.session(ctx=ctx)
    s.sync(prompt)
    first = s.logits.copy()
    toks = list(s.greedy(n))
    return first, toks, s.logits.copy()


def tp_run(tp, prompt, n: int):
    s = tp.session()
    s.sync(prompt)
    first = s.logits.copy()
    toks = list(s.greedy(n))
    out = first, toks, s.logits.copy()
    s.close()
    return out


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (b: the one-rank reference)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.isfinite(a).all()
    return float(np.abs(a - b).max() / np.abs(b).max())


class ProcWorker:
    """A TPWorker in a subprocess (this file as a script); its log goes to `log`."""

    def __init__(self, path, addr, log: Path, backend="reference", numerics="exact", transport="tcp",
                 gate_timeout_ms: int = 20000, io_timeout: float = 60.0):
        self.log = log
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(path), str(addr[1]), backend,
                 numerics, transport, str(gate_timeout_ms), str(io_timeout)],
                stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO), env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _worker_main(argv: list[str]) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="worker %(levelname)s %(message)s")
    from ds4.tp import Options, TPWorker

    path, port, backend, numerics, transport, gate_ms, io_s = argv
    t0 = time.monotonic()
    w = TPWorker.open(path, (HOST, int(port)), backend=backend, numerics=numerics,
                      opts=Options(transport=transport, gate_timeout_ms=int(gate_ms), io_timeout=float(io_s)))
    print(f"worker joined after {time.monotonic() - t0:.2f} s", flush=True)
    w.serve()
    print(f"worker done after {w.commands} commands", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
