"""Where a one-CTA top-k over 8192 visible scores (16384 registers, 8 warps) spends its time:
each building block alone, 200 launches in a CUDA graph. Scratch kernels, not the shipped ones.

    PYTHONPATH=. python bench/triton/topk_parts_probe.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from topk_probe import graph_us  # noqa: E402


@triton.jit
def k_load_sum(s_ptr, o_ptr, vis, CMAX: tl.constexpr):
    c = tl.arange(0, CMAX)
    x = tl.load(s_ptr + c, mask=c < vis, other=0.0)
    tl.store(o_ptr, tl.sum(x, 0))


@triton.jit
def k_load_scan(s_ptr, o_ptr, vis, CMAX: tl.constexpr):
    c = tl.arange(0, CMAX)
    x = tl.load(s_ptr + c, mask=c < vis, other=0.0)
    sel = (x > 1.5) & (c < vis)
    w = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(o_ptr + w, c, mask=sel)


@triton.jit
def k_load_scan2d(s_ptr, o_ptr, vis, CMAX: tl.constexpr, R: tl.constexpr):
    # rows of R consecutive elements: scan along a row, then over the rows' totals
    c = tl.arange(0, CMAX // R)[:, None] * R + tl.arange(0, R)[None, :]
    x = tl.load(s_ptr + c, mask=c < vis, other=0.0)
    sel = ((x > 1.5) & (c < vis)).to(tl.int32)
    inrow = tl.cumsum(sel, 1)
    tot = tl.sum(sel, 1)
    before = tl.cumsum(tot, 0) - tot
    w = before[:, None] + inrow - 1
    tl.store(o_ptr + w, c, mask=sel > 0)


@triton.jit
def k_bisect(s_ptr, o_ptr, vis, CMAX: tl.constexpr, PASSES: tl.constexpr):
    c = tl.arange(0, CMAX)
    x = tl.load(s_ptr + c, mask=c < vis, other=float("-inf"))
    T = tl.zeros([], tl.float32)
    for bb in range(PASSES):
        cand = T + bb * 0.001
        cnt = tl.sum((x >= cand).to(tl.int32), 0)
        T = tl.where(cnt >= 512, cand, T)
    tl.store(o_ptr, T)


@triton.jit
def k_scatter_zero(s_ptr, h_ptr, vis, CMAX: tl.constexpr):
    c = tl.arange(0, CMAX)
    x = tl.load(s_ptr + c, mask=c < vis, other=0.0)
    p16 = (x.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    tl.store(h_ptr + p16, tl.zeros([CMAX], tl.int32), mask=c < vis)


@triton.jit
def k_hist2(s_ptr, o_ptr, n, CC: tl.constexpr):
    i = tl.arange(0, CC)
    v = tl.load(s_ptr + i, mask=i < n, other=0.0).to(tl.int32, bitcast=True) & 0xFFFF
    h1 = tl.histogram(v >> 8, 256, mask=i < n)
    h2 = tl.histogram(v & 255, 256, mask=(i < n) & ((v >> 8) == 7))
    tl.store(o_ptr + tl.arange(0, 256), h1 + h2)


def main() -> None:
    dev = torch.device("cuda")
    out = []
    for vis, cmax, warps in ((1034, 2048, 4), (8202, 16384, 8), (8202, 16384, 16), (8202, 16384, 32)):
        s = torch.randn(cmax, device=dev)
        o = torch.zeros(cmax, dtype=torch.int32, device=dev)
        of = torch.zeros(cmax, device=dev)
        h = torch.zeros(65536, dtype=torch.int32, device=dev)
        parts = {
            "empty(load+sum)": lambda: k_load_sum[(1,)](s, of, vis, CMAX=cmax, num_warps=warps),
            "load+scan+store": lambda: k_load_scan[(1,)](s, o, vis, CMAX=cmax, num_warps=warps),
            "scan2d R=16": lambda: k_load_scan2d[(1,)](s, o, vis, CMAX=cmax, R=16, num_warps=warps),
            "scan2d R=64": lambda: k_load_scan2d[(1,)](s, o, vis, CMAX=cmax, R=64, num_warps=warps),
            "bisect 32": lambda: k_bisect[(1,)](s, of, vis, CMAX=cmax, PASSES=32, num_warps=warps),
            "bisect 8": lambda: k_bisect[(1,)](s, of, vis, CMAX=cmax, PASSES=8, num_warps=warps),
            "scatter zero": lambda: k_scatter_zero[(1,)](s, h, vis, CMAX=cmax, num_warps=warps),
            "2 histograms of 1024": lambda: k_hist2[(1,)](s, o, 1000, CC=1024, num_warps=warps),
        }
        for name, fn in parts.items():
            try:
                fn()
                torch.cuda.synchronize()
                us = graph_us(fn)
            except Exception as e:  # noqa: BLE001
                us = float("nan")
                print(name, "failed:", str(e)[:200], file=sys.stderr)
            out.append((vis, cmax, warps, name, us))
            print(f"{vis:6d} {cmax:6d} w{warps:<3d} {name:22s} {us:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
