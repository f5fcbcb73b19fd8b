"""Where a decode step's host time goes, on the GPU: 8 timed `Session.eval` steps at contexts 4096
and 32768 on the full-size synthetic model, then 8 more under cProfile (top 12 by own time).
The step's Python walk over the graph's ops runs while the captured graph replays; the time
spent blocked in `.cpu()` (the logits' copy) is the GPU's.

    PYTHONPATH=. python bench/triton/host_profile.py [--phases]

--phases: only the timed steps and each phase's median host time (`phases`), no cProfile.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import numpy as np
import torch

import ds4
from ds4.core.gguf_write import write_sparse_gguf
from ds4.core.tiny import preset_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_full import fill_state  # noqa: E402

GGUF = "/tmp/ds4-flash-sparse.gguf"


class _TimedGraph:
    """A captured graph whose replay() notes when the host call returned."""

    def __init__(self, graph, marks):
        self.graph, self.marks = graph, marks

    def replay(self):
        t = time.perf_counter()
        self.graph.replay()
        self.marks["replayed"] = time.perf_counter()
        self.marks["launch"] = self.marks["replayed"] - t


def phases(eng, s, steps: int = 32) -> dict:
    """Median host time of each phase of a replayed step, in ms: up to graph.replay()'s return
    (token and position to the device, the launch; and the replay() call alone), the op walk
    after it, the wait + copy of the logits (to_numpy), and what the session does after; then
    the logits copy alone."""
    be = eng.backend
    entry = next(e for e in be._graphs.values() if e.states is s.states)
    marks: dict = {}
    entry.graph = _TimedGraph(entry.graph, marks)
    to_numpy = be.to_numpy

    def timed_to_numpy(x):
        marks["walked"] = time.perf_counter()
        out = to_numpy(x)
        marks["copied"] = time.perf_counter()
        return out

    be.to_numpy = timed_to_numpy
    rows = []
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            s.eval(40 + i)
            t1 = time.perf_counter()
            rows.append((marks["replayed"] - t0, marks["launch"], marks["walked"] - marks["replayed"],
                         marks["copied"] - marks["walked"], t1 - marks["copied"], t1 - t0))
    finally:
        be.to_numpy = to_numpy
        entry.graph = entry.graph.graph
    med = np.median(np.array(rows), axis=0) * 1e3
    logits = torch.zeros(eng.config.n_vocab, device="cuda")
    torch.cuda.synchronize()
    cp = []
    for _ in range(20):
        t0 = time.perf_counter()
        logits.cpu().numpy()
        cp.append(time.perf_counter() - t0)
    return dict(to_replay_return=med[0], of_which_replay_call=med[1], op_walk=med[2], logits_wait_copy=med[3],
                after=med[4], step=med[5], logits_copy_alone=float(np.median(cp) * 1e3))


def main() -> None:
    if not os.path.exists(GGUF):
        cfg = preset_config("flash")
        write_sparse_gguf(GGUF, cfg, {}, [f"<t{i}>" for i in range(cfg.n_vocab)], [])
    eng = ds4.Engine.open(GGUF, backend="triton", synthetic=True)
    for ctx in (4096, 32768):
        s = eng.session(ctx=ctx + 64)
        fill_state(s, 0)
        rng = np.random.default_rng(0)
        s._tokens = [int(x) for x in rng.integers(0, 1000, ctx)]  # the history the state stands for
        s.eval(1)  # eager
        s.eval(2)  # captured
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(8):
            s.eval(3 + i)
        print(ctx, "ms/step", (time.perf_counter() - t) / 8 * 1e3)
        print(ctx, "phases (ms, medians of 32 steps):",
              ", ".join(f"{k} {v:.3f}" for k, v in phases(eng, s).items()), flush=True)
        if "--phases" in sys.argv:  # no cProfile
            continue
        pr = cProfile.Profile()
        pr.enable()
        for i in range(8):
            s.eval(20 + i)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
