"""Probe: Q8_0 decode products on rows repacked at upload (quants first, then the row's scales).

A GGUF Q8_0 row is a stream of 34-byte blocks (f16 scale, 32 int8 quants), so a decoder reads it
in 2-byte pieces (108) or unpicks 16-byte segments that straddle blocks (208). Repacked, row r
holds its K quants biased by 128 (as bytes q + 128), the 32 of a block interleaved so that word w
holds values w, w+8, w+16, w+24 (byte j of the block's 8 words = values 8j..8j+7, a contiguous
slice of x), then its K/32 f16 scales: the same bytes per row (34·K/32), every quant word 4-byte
aligned. A word becomes 4 floats by one byte permute and one subtraction each (K._b2f).

This times that decoder against the backend's decode path of the time (GGUF layout, 108 / 208
and their per-shape table) on every Q8_0 decode shape, in CUDA graphs of 8 calls over rotating
copies. The design went into the backend as layout Q8C and decoder 308 (`current` is now that);
the probe's kernels stay as the record of results_h200/tune_paths/q8_rows_probe.json.

    PYTHONPATH=. python bench/triton/q8_rows_probe.py --out q8_rows_probe.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import triton
import triton.language as tl

from ds4.backends.triton import kernels as K
from ds4.backends.triton.backend import QWeight, TritonBackend
from ds4.core.quants import GGMLType as T, row_bytes
from ds4.core.tiny import preset_config

from ds4.backends.triton.synthetic import _quant_blocks

dev = "cuda"


def repack(u8: torch.Tensor, N: int, Kd: int) -> torch.Tensor:
    nb = Kd // 32
    b = u8.view(N, nb, 34)
    d = b[:, :, :2].reshape(N, 2 * nb)
    q = (b[:, :, 2:] ^ 0x80).reshape(N, nb, 4, 8).transpose(-1, -2).reshape(N, Kd)
    return torch.cat([q, d], dim=1).contiguous().reshape(-1)


@triton.jit
def q8r_mv_kernel(x_ptr, w32, wh, out_ptr, ws_ptr, cnt_ptr, N, K_, RW,
                  BN: tl.constexpr, NBLK: tl.constexpr, S: tl.constexpr):
    pid = tl.program_id(0)
    sk = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    rw = rows.to(tl.int64) * RW  # row start in words (RW = 34·K/128)
    m = rmask[:, None, None]
    b = tl.arange(0, NBLK)[None, :, None]
    w = tl.arange(0, 8)[None, None, :]
    nblk = K_ // 32
    IS = nblk // NBLK // S
    acc = tl.zeros([BN, NBLK, 8], tl.float32)
    for i in range(sk * IS, sk * IS + IS):
        b0 = i * NBLK
        wv = tl.load(w32 + rw[:, None, None] + (b0 + b) * 8 + w, mask=m, other=0)
        d = tl.load(wh + rw[:, None, None] * 2 + K_ // 2 + b0 + b, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        xb = x_ptr + (b0 + b) * 32 + w
        p = K._b2f(wv, 0) * tl.load(xb)
        p += K._b2f(wv, 1) * tl.load(xb + 8)
        p += K._b2f(wv, 2) * tl.load(xb + 16)
        p += K._b2f(wv, 3) * tl.load(xb + 24)
        acc += p * d
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    K._split_store(y, out_ptr, rows, rmask, ws_ptr, cnt_ptr, pid, sk, N, S)


@triton.jit
def q8r2_mv_kernel(x_ptr, w32, wh, out_ptr, ws_ptr, cnt_ptr, N, K_, RW,
                   BN: tl.constexpr, NBLK: tl.constexpr, S: tl.constexpr):
    """As q8r_mv_kernel with the rows as two sets (rows 2i, 2i+1): each x load serves both."""
    pid = tl.program_id(0)
    sk = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    rw = rows.to(tl.int64) * RW
    ra, rb = tl.split(tl.reshape(rw, [BN // 2, 2]))
    ma, mb = tl.split(tl.reshape(rmask, [BN // 2, 2]))
    ra = ra[:, None, None]
    rb = rb[:, None, None]
    ma = ma[:, None, None]
    mb = mb[:, None, None]
    b = tl.arange(0, NBLK)[None, :, None]
    w = tl.arange(0, 8)[None, None, :]
    nblk = K_ // 32
    IS = nblk // NBLK // S
    aa = tl.zeros([BN // 2, NBLK, 8], tl.float32)
    ab = tl.zeros([BN // 2, NBLK, 8], tl.float32)
    for i in range(sk * IS, sk * IS + IS):
        b0 = i * NBLK
        wa = tl.load(w32 + ra + (b0 + b) * 8 + w, mask=ma, other=0)
        wb_ = tl.load(w32 + rb + (b0 + b) * 8 + w, mask=mb, other=0)
        da = tl.load(wh + ra * 2 + K_ // 2 + b0 + b, mask=ma, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        db = tl.load(wh + rb * 2 + K_ // 2 + b0 + b, mask=mb, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        xb = x_ptr + (b0 + b) * 32 + w
        pa = tl.zeros([BN // 2, NBLK, 8], tl.float32)
        pb = tl.zeros([BN // 2, NBLK, 8], tl.float32)
        for j in tl.static_range(4):
            xv = tl.load(xb + 8 * j)
            pa += K._b2f(wa, j) * xv
            pb += K._b2f(wb_, j) * xv
        aa += pa * da
        ab += pb * db
    ya = tl.sum(tl.sum(aa, axis=2), axis=1)
    yb = tl.sum(tl.sum(ab, axis=2), axis=1)
    y = tl.reshape(tl.join(ya, yb), [BN])
    K._split_store(y, out_ptr, rows, rmask, ws_ptr, cnt_ptr, pid, sk, N, S)


@triton.jit
def q8r4_mv_kernel(x_ptr, w32, wh, out_ptr, ws_ptr, cnt_ptr, N, K_, RW,
                   BN: tl.constexpr, NBLK: tl.constexpr, S: tl.constexpr):
    """As q8r_mv_kernel with the rows as four sets (K._split4): each x load serves four rows."""
    pid = tl.program_id(0)
    sk = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    rw = rows.to(tl.int64) * RW
    o0, o1, o2, o3 = K._split4(rw, BN)
    m0, m1, m2, m3 = K._split4(rmask, BN)
    ro = (o0[:, None, None], o1[:, None, None], o2[:, None, None], o3[:, None, None])
    mm = (m0[:, None, None], m1[:, None, None], m2[:, None, None], m3[:, None, None])
    b = tl.arange(0, NBLK)[None, :, None]
    w = tl.arange(0, 8)[None, None, :]
    nblk = K_ // 32
    IS = nblk // NBLK // S
    acc = (tl.zeros([BN // 4, NBLK, 8], tl.float32),) * 4
    for i in range(sk * IS, sk * IS + IS):
        b0 = i * NBLK
        wv = ()
        for r in tl.static_range(4):
            wv = wv + (tl.load(w32 + ro[r] + (b0 + b) * 8 + w, mask=mm[r], other=0),)
        xb = x_ptr + (b0 + b) * 32 + w
        ps = (tl.zeros([BN // 4, NBLK, 8], tl.float32),) * 4
        for j in tl.static_range(4):
            xv = tl.load(xb + 8 * j)
            nps = ()
            for r in tl.static_range(4):
                nps = nps + (ps[r] + K._b2f(wv[r], j) * xv,)
            ps = nps
        nacc = ()
        for r in tl.static_range(4):
            d = tl.load(wh + ro[r] * 2 + K_ // 2 + b0 + b, mask=mm[r], other=0).to(tl.float16, bitcast=True).to(tl.float32)
            nacc = nacc + (acc[r] + ps[r] * d,)
        acc = nacc
    y = K._join4(tl.sum(tl.sum(acc[0], axis=2), axis=1), tl.sum(tl.sum(acc[1], axis=2), axis=1),
                 tl.sum(tl.sum(acc[2], axis=2), axis=1), tl.sum(tl.sum(acc[3], axis=2), axis=1), BN)
    K._split_store(y, out_ptr, rows, rmask, ws_ptr, cnt_ptr, pid, sk, N, S)


TILES = [(16, 8, 4), (8, 8, 4), (8, 16, 4), (4, 16, 4), (4, 32, 4), (2, 32, 4), (2, 64, 4), (1, 64, 4),
         (1, 128, 4), (32, 8, 4), (16, 16, 4), (4, 64, 8), (2, 128, 8), (32, 4, 4), (16, 4, 4), (8, 32, 4),
         (64, 4, 4), (8, 8, 2), (4, 16, 2), (16, 8, 8)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="q8_rows_probe.json")
    a = ap.parse_args()
    T0 = time.time()
    from tune_paths import emit, graph_time

    g = torch.Generator(device=dev).manual_seed(0)
    cfg = preset_config("flash")
    be = TritonBackend(cfg, numerics="exact", cuda_graphs=False)  # the shipped per-shape table
    cnt = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    rows: list[dict] = []
    shapes = (("wo_b", 4096, 8192), ("wq_b", 32768, 1024), ("wo_a", 8192, 4096), ("head", 129280, 4096),
              ("wq_a", 1024, 4096), ("wkv", 512, 4096), ("shared down", 4096, 2048), ("gate+up as one", 4096, 4096))
    for name, N, Kd in shapes:
        copies = 3 if N * Kd > 1e8 else 8
        gg = [_quant_blocks(T.Q8_0, N * Kd, 1.0 / np.sqrt(Kd), dev, g) for _ in range(copies)]
        ws = [QWeight(f"w{i}", T.Q8_0, (Kd, N), u) for i, u in enumerate(gg)]
        rp = [repack(u, N, Kd) for u in gg]
        x = torch.randn(1, Kd, device=dev)
        nbytes = row_bytes(T.Q8_0, Kd) * N
        # reference: float64 from the GGUF bytes
        bl = gg[0].view(N, Kd // 32, 34)
        d0 = bl[:, :, :2].contiguous().view(torch.float16).double()
        q0 = bl[:, :, 2:].contiguous().view(torch.int8).double()
        ref = ((q0 * d0).reshape(N, Kd) @ x[0].double())
        del bl, d0, q0
        scale = float(ref.abs().max())
        s = graph_time(lambda i: be.linear(x, ws[i % copies]))
        y = be.linear(x, ws[0])[0]
        emit(rows, dict(op=name, N=N, K=Kd, path="current", us=s * 1e6, GBps=nbytes / s / 1e9,
                        err=float((y.double() - ref).abs().max()) / scale))
        out = torch.empty(N, device=dev)
        RW = row_bytes(T.Q8_0, Kd) // 4
        for kern, kname in ((q8r_mv_kernel, "q8r"), (q8r2_mv_kernel, "q8r2"), (q8r4_mv_kernel, "q8r4")):
            for BN, NBLK, warps in TILES:
                if (kname == "q8r2" and BN < 2) or (kname == "q8r4" and BN < 4):
                    continue
                steps = Kd // 32 // NBLK
                if steps < 1:
                    continue
                progs = (N + BN - 1) // BN
                auto = 1
                while auto < 8 and progs * auto < 528 and steps % (2 * auto) == 0:
                    auto *= 2
                for S in sorted({1, auto}):
                    wsp = torch.empty(S, N, device=dev)
                    grid = ((N + BN - 1) // BN, S)

                    def fn(i, BN=BN, NBLK=NBLK, S=S, warps=warps, grid=grid, wsp=wsp, kern=kern):
                        u = rp[i % copies]
                        kern[grid](x, u.view(torch.int32), u.view(torch.int16), out, wsp, cnt, N, Kd, RW,
                                   BN=BN, NBLK=NBLK, S=S, num_warps=warps)
                        return out
                    try:
                        fn(0)
                        err = float((out.double() - ref).abs().max()) / scale
                        s = graph_time(fn)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {name} {kname} {BN} {NBLK} {S}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    emit(rows, dict(op=name, N=N, K=Kd, path=kname, BN=BN, NBLK=NBLK, S=S, warps=warps,
                                    us=s * 1e6, GBps=nbytes / s / 1e9, err=err))
        del gg, ws, rp
        torch.cuda.empty_cache()
        json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), open(a.out, "w"), indent=1)
        print(f"[{time.time() - T0:.0f}s] {name}", flush=True)
    print("\nop | current us | best q8r us (tile) | best q8r2 us (tile) | ratio")
    for name, N, Kd in shapes:
        rs = [r for r in rows if r["op"] == name]
        cur = next(r for r in rs if r["path"] == "current")
        line = f"{name} | {cur['us']:.1f} ({cur['err']:.1g})"
        best_all = cur["us"]
        for p in ("q8r", "q8r2", "q8r4"):
            c = [r for r in rs if r["path"] == p]
            if c:
                b = min(c, key=lambda r: r["us"])
                best_all = min(best_all, b["us"])
                line += f" | {b['us']:.1f} {b['GBps']:.0f}GB/s ({b['BN']},{b['NBLK']},{b['S']},{b['warps']}) err {b['err']:.1g}"
        print(line + f" | {cur['us'] / best_all:.2f}x")
    print(f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
