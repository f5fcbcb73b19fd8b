"""Device diagnostic: per-step logits error of the Triton backend (CUDA graphs on / off) against
the reference on the test preset, over several random models and prompts."""
import os
import sys

import numpy as np

import ds4
from ds4.core.tiny import make_tiny


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
    p = f"/tmp/diag{seed}.gguf"
    make_tiny(p, preset="test", seed=100 + seed)
    prompt = [int(x) for x in np.random.default_rng(seed).integers(0, 512, 24)]
    for num in ("ds4", "exact"):
        ref = ds4.Engine.open(p, backend="reference", numerics=num)
        g = ds4.Engine.open(p, backend="triton", numerics=num)
        e = ds4.Engine.open(p, backend="triton", numerics=num, cuda_graphs=False)
        sr, sg, se = ref.session(ctx=64), g.session(ctx=64), e.session(ctx=64)
        for s in (sr, sg, se):
            s.sync(prompt)
        row = [f"{rel(sg.logits, sr.logits):.1e}/{rel(se.logits, sr.logits):.1e}"]
        for _ in range(6):
            t = int(np.argmax(sr.logits))
            for s in (sr, sg, se):
                s.eval(t)
            row.append(f"{rel(sg.logits, sr.logits):.1e}/{rel(se.logits, sr.logits):.1e}/{rel(sg.logits, se.logits):.0e}")
        top2 = np.sort(sr.logits)[-2:]
        print(seed, num, " ".join(row), flush=True)
