"""Where a decode step's host time goes, on the GPU: 8 timed `Session.eval` steps at contexts 4096
and 32768 on the full-size synthetic model, then 8 more under cProfile (top 12 by own time).
The step's Python walk over the graph's ops runs while the captured graph replays; the time
spent blocked in `.cpu()` (the logits' copy) is the GPU's.

    PYTHONPATH=. python bench/triton/host_profile.py
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
        pr = cProfile.Profile()
        pr.enable()
        for i in range(8):
            s.eval(20 + i)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
