"""Matrix-vector tiling sweep on the GPU for the decode shapes of DS4 Flash.

For each (block format, rows, K) of a decode step, times the matvec / MoE kernels over a grid of
(K-step values, rows per program, warps) on random valid blocks (4 weight copies in rotation, so
L2 does not hold them) and prints the best configuration and its bandwidth. The winners go into
TritonBackend.mv_tune (or the DS4_TRITON_MV_TUNE environment variable).

    PYTHONPATH=. python bench/triton/tune_mv.py [--out tune.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import numpy as np
import torch
import triton

from ds4.backends.triton import kernels as K
from ds4.backends.triton.backend import _cdiv, _grid_codes
from ds4.backends.triton.synthetic import _quant_blocks
from ds4.core.quants import IQ2XXS_KSIGNS, GGMLType as T, row_bytes

dev = "cuda"
gridp = torch.tensor(_grid_codes(), dtype=torch.int32, device=dev)
ksigns = torch.tensor(IQ2XXS_KSIGNS.astype(np.int32), dtype=torch.int32, device=dev)
g = torch.Generator(device=dev).manual_seed(0)


def weights(t: T, n_values: int, copies: int):
    out = []
    for _ in range(copies):
        if t == T.F16:
            u8 = (torch.randn(n_values, device=dev, generator=g) * 0.02).half().view(torch.uint8)
        else:
            u8 = _quant_blocks(t, n_values, 0.02, dev, g)
        out.append((u8, u8.view(torch.int16), u8.view(torch.int32)))
    return out


def blocks(t, K_, cap):
    VB = K.UNIT[int(t)]
    NB = 1
    while NB * 2 * VB <= cap and K_ % (NB * 2 * VB) == 0:
        NB *= 2
    return NB, VB


def bench(fn, reps=50):
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median") * 1e-3


def sweep_linear(t: T, N: int, K_: int, caps, bns, warps, pairs=(False,)):
    ws = weights(t, N * K_, 4)
    x = torch.randn(1, K_, device=dev)
    out = torch.empty(1, N, device=dev)
    nbytes = row_bytes(t, K_) * N
    best = best_pairs = None
    for cap, BN, nw, pr in itertools.product(caps, bns, warps, pairs):
        NB, VB = blocks(t, K_, cap)
        TY = 108 if pr else int(t)
        VA = VB // 2 if pr else VB
        i = [0]

        def fn():
            u8, i16, _ = ws[i[0] % 4]
            i[0] += 1
            K.matvec_kernel[(_cdiv(N, BN), 1)](x, K_, 0, x, u8, i16, i16, gridp, ksigns, out, N, N, K_,
                                               row_bytes(t, K_), 1 << 30, 1e-6, TYPE=TY, BN=BN, NB=NB,
                                               VB=VB, VA=VA, NORM=0, num_warps=nw)
        try:
            s = bench(fn)
        except Exception as e:  # noqa: BLE001
            print(f"  {t.name} cap={cap} BN={BN} w={nw} pairs={pr}: {type(e).__name__}", file=sys.stderr)
            continue
        r = dict(type=t.name, N=N, K=K_, cap=cap, BN=BN, warps=nw, pairs=pr, us=s * 1e6, GBps=nbytes / s / 1e9)
        print(f"  {t.name:8s} {N:6d}x{K_:5d} cap={cap:4d} BN={BN:2d} w={nw} pairs={int(pr)}: "
              f"{r['us']:8.1f} us {r['GBps']:7.0f} GB/s", file=sys.stderr)
        if best is None or s < best[0]:
            best = (s, r)
        if pr and (best_pairs is None or s < best_pairs[0]):
            best_pairs = (s, r)
    out = dict(best[1])
    if best_pairs is not None:
        out["best_pairs"] = best_pairs[1]
    return out


UNROLLED = {T.IQ2_XXS: (216, 32), T.Q2_K: (110, 64)}  # decoded type id, values per unit


def blocks_u(t, K_, cap):
    """(TYPE, NB, VB, VA) of the unrolled matrix-vector paths."""
    ty, VB = UNROLLED[t]
    NB = 1
    while NB * 2 * VB <= cap and K_ % (NB * 2 * VB) == 0:
        NB *= 2
    return ty, NB, VB, 1


def sweep_moe(t_gate: T, t_down: T, E: int, F: int, n_exp: int, slots: int, caps, bns, warps):
    gw = weights(t_gate, n_exp * F * E, 2)
    uw = weights(t_gate, n_exp * F * E, 2)
    dw = weights(t_down, n_exp * E * F, 2)
    x = torch.randn(1, E, device=dev)
    ids = torch.tensor(np.random.default_rng(0).choice(n_exp, slots, replace=False), dtype=torch.int32, device=dev)
    wts = torch.rand(slots, device=dev)
    h = torch.empty(slots, F, device=dev)
    out = torch.empty(1, E, device=dev)
    rbg, rbd = row_bytes(t_gate, E), row_bytes(t_down, F)
    res = {}
    for kind in ("gateup", "down"):
        best = None
        for cap, BN, nw in itertools.product(caps, bns, warps):
            i = [0]
            if kind == "gateup":
                TY, NB, VB, VA = blocks_u(t_gate, E, cap)
                nbytes = 2 * slots * F * rbg

                def fn():
                    (gu, gh, _), (uu, uh, _) = gw[i[0] % 2], uw[i[0] % 2]
                    i[0] += 1
                    K.moe_gateup_mv_kernel[(_cdiv(F, BN), slots)](x, E, ids, wts, gu, gh, gh, uu, uh, uh, gridp,
                                                                  ksigns, h, F, E, rbg, F * rbg, slots, 10.0,
                                                                  TYPE=TY, BN=BN, NB=NB, VB=VB, VA=VA,
                                                                  ROUTED=True, num_warps=nw)
            else:
                TY, NB, VB, VA = blocks_u(t_down, F, cap)
                nbytes = slots * E * rbd

                def fn():
                    du, dh, dw32 = dw[i[0] % 2]
                    i[0] += 1
                    K.moe_down_mv_kernel[(_cdiv(E, BN), 1)](h, ids, du, dh, dw32, gridp, ksigns, out, E, F, rbd,
                                                            E * rbd, KSLOTS=slots, TYPE=TY, BN=BN,
                                                            NB=NB, VB=VB, VA=VA, num_warps=nw)
            try:
                s = bench(fn)
            except Exception as e:  # noqa: BLE001
                print(f"  {kind} cap={cap} BN={BN} w={nw}: {type(e).__name__} {e}", file=sys.stderr)
                continue
            r = dict(kind=kind, cap=cap, BN=BN, warps=nw, us=s * 1e6, GBps=nbytes / s / 1e9)
            print(f"  moe {kind:6s} cap={cap:4d} BN={BN:2d} w={nw}: {r['us']:8.1f} us {r['GBps']:7.0f} GB/s",
                  file=sys.stderr)
            if best is None or s < best[0]:
                best = (s, r)
        res[kind] = best[1]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune.json")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0)}
    res["moe_q2"] = sweep_moe(T.IQ2_XXS, T.Q2_K, 4096, 2048, 16, 6, (256, 512, 1024), (4, 8, 16, 32), (4, 8))
    res["q8_outa"] = sweep_linear(T.Q8_0, 8192, 4096, (256, 512), (8, 16, 32), (4, 8), pairs=(False, True))
    res["q8_outb"] = sweep_linear(T.Q8_0, 4096, 8192, (256, 512), (4, 8, 16), (4, 8), pairs=(False, True))
    if not a.quick:
        res["q8_qb"] = sweep_linear(T.Q8_0, 32768, 1024, (256, 512), (8, 16, 32), (4, 8), pairs=(False, True))
    res["seconds"] = time.time() - t0
    # the backend's mv_tune entries: decoded type -> (K-step values, rows per program, warps)
    q8 = min((res["q8_outa"]["best_pairs"], res["q8_outb"]["best_pairs"]), key=lambda r: -r["GBps"])
    res["mv_tune"] = {"216": [res["moe_q2"]["gateup"]["cap"], res["moe_q2"]["gateup"]["BN"], res["moe_q2"]["gateup"]["warps"]],
                      "110": [res["moe_q2"]["down"]["cap"], res["moe_q2"]["down"]["BN"], res["moe_q2"]["down"]["warps"]],
                      "108": [q8["cap"], q8["BN"], q8["warps"]]}
    json.dump(res, open(a.out, "w"), indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
