"""The indexer's scores + top-k of one decode query alone on the GPU, on the flash shapes (64
heads x 128, top 512) at the contexts bench_full.py decodes (capacity ctx + 40 tokens, as its
sessions): the one-program 32-pass bisection (topk_kernel) against topk_one_kernel after the
scores kernel's key counts and buckets (HIST), in its tilings, and with buckets too small
(the bisection fallback).

Each variant: idx_score_kernel then the top-k, 200 times in a CUDA graph, and each kernel's own
time from the profiler over 20 eager steps; the selections are checked equal to numpy's stable
sort of the scores (and the counts left at zero). Also the size of the threshold's bucket.

    PYTHONPATH=. python bench/triton/topk_probe.py --out bench/triton/results_h200/topk
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from ds4.backends.triton import kernels as K


def graph_us(fn, reps: int = 200) -> float:
    """µs per call of fn (already run once): reps calls captured in one CUDA graph, replayed
    once to warm it, then three replays timed with events."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(3):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (3 * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/triton/results/topk")
    ap.add_argument("--ctx", default="4096,32768")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    IH, ID, TOPK, M = 64, 128, 512, 4
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for ctx in [int(c) for c in a.ctx.split(",")]:
        cs = (ctx + 40) // M
        vis = (ctx + 1) // M
        cmax = 1 << (cs - 1).bit_length()
        keys = torch.randn(cs, ID, device=dev, generator=gen).half().float()
        iq = torch.randn(IH, ID, device=dev, generator=gen)
        hw = torch.randn(IH, device=dev, generator=gen)
        pos = torch.tensor([ctx], dtype=torch.int32, device=dev)
        scores = torch.zeros(1, cs, device=dev)
        counts = torch.zeros(256 + 16384 + 16, dtype=torch.int32, device=dev)
        buckets = {capb: torch.zeros(2 * 16384 * capb, dtype=torch.int32, device=dev) for capb in (16, 256)}
        idx = torch.zeros(1, TOPK, dtype=torch.int32, device=dev)
        cnt = torch.zeros(1, dtype=torch.int32, device=dev)
        warps = 8 if cmax > 4096 else 4

        def step(v: dict) -> None:
            hist = v["kind"] == "one"
            capb = v.get("capb", 256)
            K.idx_score_kernel[(1, (cs + 63) // 64)](iq, hw, keys, scores, pos, counts, buckets[capb], M, IH, cs, TOPK,
                                                     float(np.float32(np.sqrt(ID * IH))), IHP=64, ID=ID, BC=64,
                                                     EXACT=True, HIST=hist, CAPB=capb, num_warps=4)
            if v["kind"] == "bisect32":
                K.topk_kernel[(1,)](scores, idx, cnt, pos, M, cs, TOPK, BC=256, CMAX=cmax, num_warps=warps)
            elif hist:
                ch = v.get("ch", 1024)
                npr = -(-cs // ch)
                K.topk_one_kernel[(npr,)](scores, idx, cnt, pos, counts, buckets[capb], M, TOPK, npr, CH=ch,
                                          CAPB=capb, LB=ch, NLB=npr, num_warps=v.get("warps", 8))

        sc = None
        ref = None
        variants = {"bisect32": dict(kind="bisect32"), "one": dict(kind="one"), "one_w4": dict(kind="one", warps=4),
                    "one_ch512": dict(kind="one", ch=512), "one_ch2048": dict(kind="one", ch=2048, warps=8),
                    "one_overflow": dict(kind="one", capb=16), "scores_alone": dict(kind="none")}
        for name, v in variants.items():
            step(v)
            torch.cuda.synchronize()
            if sc is None:
                sc = scores[0, :vis].cpu().numpy()
                order = np.lexsort((np.arange(vis), -(sc + np.float32(0.0)).astype(np.float64)))
                ref = np.sort(order[:TOPK])
            got = idx[0].cpu().numpy()
            ok = bool(np.array_equal(got, ref)) and not bool(counts.any())
            us = graph_us(lambda: step(v), a.reps)
            ok = ok and bool(np.array_equal(idx[0].cpu().numpy(), ref)) and not bool(counts.any())
            if v["kind"] == "none":
                ok = None  # (no top-k ran)
            # each kernel's own time: 20 eager steps under the profiler
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    step(v)
                torch.cuda.synchronize()
            per = {}
            for ev in prof.key_averages():
                if "kernel" in ev.key:
                    per[ev.key] = round(ev.device_time_total / 20, 2) if hasattr(ev, "device_time_total") \
                        else round(ev.cuda_time_total / 20, 2)
            # the threshold's bucket: keys with its top 14 bits
            b = (sc + np.float32(0.0)).view(np.uint32)
            key = np.where(b >> 31 == 0, b | np.uint32(0x80000000), ~b).astype(np.uint32)
            T = np.sort(key)[::-1][TOPK - 1]
            n_c = int(((key >> 18) == (T >> 18)).sum())
            rows.append(dict(ctx=ctx, rows=vis, cmax=cmax, variant=name, us_score_plus_topk=round(us, 2),
                             same_selection=ok, bucket_keys=n_c, kernel_us=per))
            print(rows[-1], flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), open(os.path.join(a.out, "topk_probe.json"), "w"),
              indent=1)
    for r in rows:
        print(f"{r['ctx']:6d} {r['variant']:14s} {r['us_score_plus_topk']:8.2f} us  ok={r['same_selection']} "
              f"n_c={r['bucket_keys']} {r['kernel_us']}")


if __name__ == "__main__":
    main()
