"""Which launch of a decode step waits for which (lanes.py), on the GPU: one eager step at context
4096 on the full-size synthetic model with every launch logged as (op, kernel, lane, the launches
of other lanes it waits for). The replay timeline (bench_full.py) names kernels only; this
names the edges between them, to find what holds up a launch on the critical path.

    PYTHONPATH=. python bench/triton/lanes_dag.py [--layer 10] [--out lanes_dag.txt]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import ds4
from ds4.core.gguf_write import write_sparse_gguf
from ds4.core.tiny import preset_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_full import fill_state  # noqa: E402

GGUF = "/tmp/ds4-flash-sparse.gguf"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", type=int, default=10, help="the layer whose launches to print")
    ap.add_argument("--out", default="lanes_dag.txt")
    a = ap.parse_args()
    if not os.path.exists(GGUF):
        cfg = preset_config("flash")
        write_sparse_gguf(GGUF, cfg, {}, [f"<t{i}>" for i in range(cfg.n_vocab)], [])
    eng = ds4.Engine.open(GGUF, backend="triton", synthetic=True)
    be = eng.backend
    s = eng.session(ctx=4096 + 8)
    fill_state(s, 0)
    s._tokens = [int(x) for x in np.random.default_rng(0).integers(0, 1000, 4096)]
    s.eval(1)  # compiles everything first (the logged step is the next, eager again: a fresh session)
    s2 = eng.session(ctx=4096 + 8)
    fill_state(s2, 0)
    s2._tokens = list(s._tokens)

    cur = {"op": "?"}
    log = []
    ops = ("embed", "hc_pre", "hc_post", "rms_norm", "linear", "rope", "kv_store", "compressor",
           "indexer_select", "head_norm", "attention", "grouped_output", "router", "shared_expert", "moe",
           "add", "output_logits")
    for name in ops:
        fn = getattr(be, name)

        def wrapped(*args, _fn=fn, _name=name, **kw):
            prev = cur["op"]
            cur["op"] = _name
            try:
                return _fn(*args, **kw)
            finally:
                cur["op"] = prev

        setattr(be, name, wrapped)

    launch = be._launch

    def logged(kern, grid, *args, **kw):
        ln = be._lanes
        waits = []
        if ln is not None and ln.active:
            wait = ln._wait

            def rec(x, y, n, _wait=wait):
                if x != y and n > ln.seen[x][y]:
                    waits.append((y, n))
                _wait(x, y, n)

            ln._wait = rec
            lane = ln.lane
            if not ln.forked[lane]:  # joins the step: waits for all of lane 0's launches so far
                waits.append((0, ln.count[0]))
            try:
                launch(kern, grid, *args, **kw)
            finally:
                ln._wait = wait
            log.append((cur["op"], kern.fn.__name__, lane, ln.count[lane], waits))
        else:
            launch(kern, grid, *args, **kw)

    be._launch = logged
    s2.eval(2)  # eager (warm) step of the new session, side lanes active
    starts = [i for i, r in enumerate(log) if r[1] == "hc_mix_kernel"]
    lo = starts[2 * a.layer] if len(starts) > 2 * a.layer else 0
    hi = starts[2 * a.layer + 2] if len(starts) > 2 * a.layer + 2 else len(log)
    lines = [f"layer {a.layer}: launch (lane.number) op kernel <- waits on (lane.number)"]
    for op, k, lane, n, waits in log[lo:hi]:
        lines.append(f"{lane}.{n:<4d} {op:15s} {k:26s} <- " + " ".join(f"{y}.{m}" for y, m in waits))
    text = "\n".join(lines)
    print(text)
    with open(a.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
