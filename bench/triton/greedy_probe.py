"""What choosing the next token on the device costs a decode step (Session.sample on the
full-size synthetic model): replays of the captured step, which ends with the argmax
(greedy_next_kernel) and the sampler (sample_next_kernel, idle unless the host wrote a draw),
with and without a draw (T = 1, min-p 0.05); replays of a step captured without them (a position
increment instead), alone and with the argmax launched after each replay; Session.greedy's,
Session.sample's (ds4's default parameters) and Session.eval's wall time per token, and the
host's time in chain_launch and waiting in chain_token.

    PYTHONPATH=. python bench/triton/greedy_probe.py [--ctx 4096] [--steps 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import ds4
from ds4.backends.triton import kernels as K
from ds4.backends.triton.backend import _cdiv, _pow2
from ds4.core.gguf_write import write_sparse_gguf
from ds4.core.sampling import Rng, SamplingParams
from ds4.core.tiny import preset_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_full import fill_state  # noqa: E402

GGUF = "/tmp/ds4-flash-sparse.gguf"


def gpu_ms(fn, n: int) -> float:
    """GPU time of n calls of fn queued back to back, per call, in ms."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    cfg = preset_config("flash")
    write_sparse_gguf(GGUF, cfg, {}, [f"<t{i}>" for i in range(cfg.n_vocab)], [])
    eng = ds4.Engine.open(GGUF, backend="triton", synthetic=True)
    be = eng.backend
    n = a.steps
    rng = np.random.default_rng(1)
    history = [int(x) for x in rng.integers(0, cfg.n_vocab, a.ctx)]

    def session():
        s = eng.session(ctx=a.ctx + 8 * n + 64)
        fill_state(s, 1)
        s._tokens = list(history)
        s.eval(1)  # eager
        s.eval(2)  # captured
        return s, next(x for x in be._graphs.values() if x.states is s.states)

    s, e = session()
    in_graph = be._next_token
    be._next_token = lambda logits: be._pos.add_(1)  # the same step, its argmax left out
    s2, e2 = session()
    be._next_token = in_graph
    logits = e2.outputs[-1]
    V = logits.numel()
    G = _pow2(_cdiv(V, be.chain_block))  # (the grid _next_token launches)
    scratch = torch.zeros(2, dtype=torch.int32, device="cuda")  # (token, position) of the argmax after
    ring = torch.zeros(4, dtype=torch.int32, device="cuda")

    def after():
        e2.graph.replay()
        K.greedy_next_kernel[(G,)](logits, V, be._chain_best, be._chain_at, be._chain_cnt, be._chain_top,
                                   scratch[:1], scratch[1:], ring, R=4, BLOCK=be.chain_block, G=G, num_warps=4)

    p = len(s._tokens)
    after()  # (compiled here, not in the timed loop: scratch[1:] specialises differently)
    rows = []
    draws = torch.tensor([1.0, 0.05, 0.5] * 4, dtype=torch.float64, device="cuda")

    def drawn():  # every slot's draw set again (the step clears its own)
        be._chain_draws.copy_(draws)
        e.graph.replay()

    for name, fn in [("replay, argmax (+ idle sampler) in the graph", e.graph.replay),
                     ("replay after a 96-byte copy, argmax + a draw (T 1, min-p 0.05)", drawn),
                     ("replay, no argmax", e2.graph.replay),
                     ("replay, no argmax, then the argmax kernel", after)]:
        be._pos.fill_(p)  # (each replay advances the device's position: back to p each time)
        rows.append((name, gpu_ms(fn, n)))
    be._chain_draws.zero_()
    be._pos.fill_(p)
    torch.cuda.synchronize()
    host = {"launch": [], "token": []}
    launch, token = be.chain_launch, be.chain_token

    def timed(name, fn):
        def f(*x, **kw):
            t = time.perf_counter()
            out = fn(*x, **kw)
            host[name].append(time.perf_counter() - t)
            return out
        return f

    be.chain_launch, be.chain_token = timed("launch", launch), timed("token", token)
    t0 = time.perf_counter()
    got = list(s.greedy(n))
    rows.append(("Session.greedy, wall per token", (time.perf_counter() - t0) * 1e3 / n))
    be.chain_launch, be.chain_token = launch, token
    assert len(got) == n
    rows.append(("  host: chain_launch (median)", 1e3 * float(np.median(host["launch"]))))
    rows.append(("  host: chain_token's wait (median)", 1e3 * float(np.median(host["token"]))))
    t0 = time.perf_counter()
    drawn = list(s.sample(n, SamplingParams(), Rng(1)))
    rows.append(("Session.sample (T 1, min-p 0.05), wall per token", (time.perf_counter() - t0) * 1e3 / n))
    assert len(drawn) == n
    t0 = time.perf_counter()
    for t in got:
        s.eval(t)
    rows.append(("Session.eval (logits to the host), wall per token", (time.perf_counter() - t0) * 1e3 / n))
    print(f"\nctx {a.ctx}, {n} steps, {torch.cuda.get_device_name(0)}")
    print("| what | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.4f} |")


if __name__ == "__main__":
    main()
