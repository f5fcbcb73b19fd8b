"""One routed-MoE prefill layer at DS4 Flash's shapes on the Triton backend: the IQ2_XXS gate/up
and Q2_K down experts through `backend.moe` (under bf16x3 the integer kernels: the gate/up on fp16
tensor cores, kernels_mm16.py, the down on int8 ones, kernels_mm8.py), timed per kernel, with the
layer's output checked against a float64 evaluation from gguf-py's dequantisation on a few tokens.

Fewer experts than the model's 256 keep the weights small; the default 32 experts with 256
tokens of 6 slots give an expert 48 assignments on average, as a 2048-token chunk does with 256.
`--variants` times other backend settings on the same weights in the same run, each checked
the same way (JSON: name -> attributes, e.g. `'{"fp16down": {"moe_down_i8": false}}'`: the fp16
down of kernels_mm16.py instead of the int8 one). Small enough to run under Nsight Compute:

    PYTHONPATH=. python bench/triton/bench_moe16.py --out moe16.csv
    ncu --clock-control none -k regex:'moe_.*mm(8|16)' -c 2 --section SpeedOfLight \\
        python bench/triton/bench_moe16.py --check 0
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as GQT
from torch.profiler import ProfilerActivity, profile
from gguf import quants as gq

from ds4.backends.triton.backend import TritonBackend
from ds4.core.gguf_model import Tensor
from ds4.core.quants import GGMLType as T
from ds4.core.quants import random_blocks
from ds4.core.tiny import preset_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (run as a script or imported by path)
from settings import check_settings  # noqa: E402

LAYER = 4  # whose SwiGLU clamp the layer takes
PROFILED_CALLS = 10


def _dense(raw: np.ndarray, ttype: T, n_exp: int, e: int, K: int, N: int) -> np.ndarray:
    """Expert e of n_exp as float64 [N, K] (gguf-py)."""
    per = raw.size // n_exp
    return np.asarray(gq.dequantize(raw[e * per:(e + 1) * per], GQT(int(ttype))), np.float64).reshape(N, K)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=6, help="experts a token (DS4 Flash: 6)")
    ap.add_argument("--ff", type=int, default=2048, help="expert width F (DS4 Flash: 2048)")
    ap.add_argument("--embd", type=int, default=4096, help="model width E (DS4 Flash: 4096)")
    ap.add_argument("--check", type=int, default=2, help="tokens checked against float64 (0: none)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="", help="CSV of the kernels' times (appended)")
    ap.add_argument("--device", default="cuda", help="cpu: a check only, under TRITON_INTERPRET=1 (no timing)")
    ap.add_argument("--variants", default="{}", help="JSON: name -> backend attributes, timed after the base")
    a = ap.parse_args()
    dev = a.device
    rng = np.random.default_rng(a.seed)
    be = TritonBackend(preset_config("test"), device=dev, dot_precision="bf16x3")
    be.moe_int16 = True
    NE, n, k, F, E = a.experts, a.tokens, a.slots, a.ff, a.embd
    t0 = time.time()
    shapes = ((T.IQ2_XXS, E, F), (T.IQ2_XXS, E, F), (T.Q2_K, F, E))  # gate, up, down: (type, K, N)
    raws, weights = [], []
    for ttype, K, N in shapes:
        raw = random_blocks(ttype, NE * N * K, rng, scale=0.05)
        raws.append(raw)
        weights.append(be.upload(Tensor("w", ttype, (K, N, NE), raw)))
    print(f"weights: {time.time() - t0:.1f} s", flush=True)
    x = torch.from_numpy((rng.standard_normal((n, E)) * 0.1).astype(np.float32)).to(dev)
    ids = np.stack([rng.choice(NE, k, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    ids_d, wts_d = torch.from_numpy(ids).to(dev), torch.from_numpy(wts).to(dev)

    def layer():
        return be.moe(x, ids_d, wts_d, *weights, LAYER)

    variants = {"base": {}, **json.loads(a.variants)}
    for name, attrs in variants.items():  # every setting exists before anything is measured
        check_settings(be, attrs, f"--variants {name}")
    base = {attr: getattr(be, attr) for attrs in variants.values() for attr in attrs}
    X = x.double().cpu().numpy()
    clamp = float(be.cfg.swiglu_clamp[LAYER])
    want = {}
    for t in np.linspace(0, n - 1, a.check).astype(int) if a.check else ():
        w_t, s_t = np.zeros(E), np.zeros(E)
        for j in range(k):
            G, U, D = (_dense(raw, tt, NE, ids[t, j], K, N) for raw, (tt, K, N) in zip(raws, shapes))
            g = np.minimum(G @ X[t], clamp)
            h = g / (1.0 + np.exp(-g)) * np.clip(U @ X[t], -clamp, clamp)
            w_t += wts[t, j] * (D @ h)
            s_t += wts[t, j] * (np.abs(D) @ np.abs(h))
        want[t] = (w_t, s_t)
    device = torch.cuda.get_device_name(0) if dev == "cuda" else dev
    for name, attrs in variants.items():
        for attr, v in {**base, **attrs}.items():
            setattr(be, attr, v)
        be.ledger = []
        out = layer().double().cpu().numpy()
        kernels = [kname for kname, _ in be.ledger]
        be.ledger = None
        worst = max((float(np.abs(out[t] - w_t).max() / s_t.max()) for t, (w_t, s_t) in want.items()), default=0.0)
        if a.check:
            print(f"[{name}] max error over max Σ|w||h|, {a.check} tokens: {worst:.2e}", flush=True)
        print(f"[{name}] kernels:", " ".join(kernels), flush=True)
        if dev != "cuda":
            continue
        layer()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_CALLS):
                layer()
            torch.cuda.synchronize()
        rows = [(ev.key, ev.device_time_total / ev.count) for ev in prof.key_averages()
                if ev.key in kernels and ev.count]
        print(f"[{name}] {device}, {NE} experts, {n} tokens, {k} slots:")
        for kname, us in sorted(rows, key=lambda r: -r[1]):
            print(f"  {kname:28s} {us:9.1f} µs")
        if a.out:
            new = not os.path.exists(a.out)
            with open(a.out, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["device", "variant", "experts", "tokens", "slots", "ff", "embd", "kernel",
                                "us_per_call", "max_rel_error"])
                for kname, us in rows:
                    w.writerow([device, name, NE, n, k, F, E, kname, f"{us:.1f}", f"{worst:.2e}" if a.check else ""])


if __name__ == "__main__":
    main()
