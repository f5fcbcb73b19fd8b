"""Probe: the routed experts' Q2_K down decode product on rows rearranged at upload.

Why: the backend's 110 decoder runs the 6-expert down product (6 × 4096 × 2048 values, 16.5 MB)
at ~29 µs, ~580 GB/s. One thread decodes 64 values of one row, and loads the 64 x values it
multiplies one by one (nothing shares them: the tile's rows sit in other threads), the 16 quant
bytes as four word loads (84-byte blocks: words align to 4 bytes only) and a scale byte per 16.

In a Q2_K block, value 128h + 32·shift + l sits in quant byte 32h + l at bit 2·shift, so word w
of the 64 quant bytes holds, at each shift, four consecutive values 128(w // 8) + 32·shift +
4(w % 8) + 0..3: a contiguous slice of x. Layout probed (Q2C): per row, the quant bytes of its
K/256 blocks, then their 16-byte scale sets, then their (f16 d, f16 dmin): the same 84·K/256
bytes. Decoder: a K-step is [row sets, blocks, 16 words]; each x slice (and its sum, for the
min term) is loaded once for R rows per thread; a word's 2-bit fields at one shift become
floats with one byte permute and one subtraction each.

    PYTHONPATH=. python bench/triton/q2k_rows_probe.py --out q2k_rows_probe.json
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
from ds4.backends.triton.synthetic import _quant_blocks
from ds4.core.quants import GGMLType as T
from ds4.core.tiny import preset_config

dev = "cuda"


def q2c(u8: torch.Tensor, N: int, Kd: int) -> torch.Tensor:
    """GGUF Q2_K rows -> [quant bytes][scales][d, dmin] per row."""
    nb = Kd // 256
    b = u8.view(N, nb, 84)
    return torch.cat([b[:, :, 16:80].reshape(N, 64 * nb), b[:, :, :16].reshape(N, 16 * nb),
                      b[:, :, 80:84].reshape(N, 4 * nb)], 1).reshape(-1)


def deq_rows(u8: torch.Tensor, N: int, Kd: int) -> torch.Tensor:
    """float64 W [N, Kd] from GGUF Q2_K bytes (torch)."""
    nb = Kd // 256
    b = u8.view(N, nb, 84)
    sc = b[:, :, :16].long()
    qs = b[:, :, 16:80].long()
    d = b[:, :, 80:82].contiguous().view(torch.float16).double()  # [N, nb, 1]
    dmin = b[:, :, 82:84].contiguous().view(torch.float16).double()
    v = torch.arange(256, device=u8.device)
    q = (qs[:, :, 32 * (v // 128) + v % 32] >> (2 * ((v % 128) // 32))) & 3
    s = sc[:, :, v // 16]
    return (d * (s & 15).double() * q.double() - dmin * (s >> 4).double()).reshape(N, Kd)


@triton.jit
def _bf(qx, j: tl.constexpr):
    """Byte j of qx (0..255) as float32: one byte permute builds 2^23 + byte."""
    b = tl.inline_asm_elementwise(f"prmt.b32 $0, $1, 0x4B000000, {0x7440 + j};", "=r,r", [qx],
                                  dtype=tl.int32, is_pure=True, pack=1)
    return b.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _sets(v, R: tl.constexpr):
    BN: tl.constexpr = v.shape[0]
    if R == 4:
        a, b, c, d = K._split4(v, BN)
        return a[:, None, None], b[:, None, None], c[:, None, None], d[:, None, None]
    elif R == 2:
        a, b = tl.split(tl.reshape(v, [BN // 2, 2]))
        return a[:, None, None], b[:, None, None]
    else:
        return (v[:, None, None],)


@triton.jit
def _q2c_rows(xb, w32, wb, wh, roww, rmask, K_, BN: tl.constexpr, NB: tl.constexpr, R: tl.constexpr):
    nb = K_ // 256
    ro = _sets(roww, R)
    m = _sets(rmask, R)
    blk = tl.arange(0, NB)[None, :, None]
    w = tl.arange(0, 16)[None, None, :]
    hh = w // 8
    wl = w % 8
    acc = ()
    for r in tl.static_range(R):
        acc = acc + (tl.zeros([BN // R, NB, 16], tl.float32),)
    for i in range(nb // NB):
        bk = i * NB + blk
        qws = ()
        dds = ()
        for r in tl.static_range(R):
            qws = qws + (tl.load(w32 + ro[r] + bk * 16 + w, mask=m[r], other=0),)
            d = tl.load(wh + ro[r] * 2 + nb * 40 + bk * 2, mask=m[r], other=0).to(tl.float16, bitcast=True)
            dm = tl.load(wh + ro[r] * 2 + nb * 40 + bk * 2 + 1, mask=m[r], other=0).to(tl.float16, bitcast=True)
            dds = dds + ((d.to(tl.float32), dm.to(tl.float32)),)
        nacc = acc
        for sh in tl.static_range(4):
            xo = bk * 256 + 128 * hh + 32 * sh + 4 * wl
            x0 = tl.load(xb + xo)
            x1 = tl.load(xb + xo + 1)
            x2 = tl.load(xb + xo + 2)
            x3 = tl.load(xb + xo + 3)
            xsum = (x0 + x1) + (x2 + x3)
            s = 8 * hh + 2 * sh + wl // 4
            na = ()
            for r in tl.static_range(R):
                sc = tl.load(wb + ro[r] * 4 + nb * 64 + bk * 16 + s, mask=m[r], other=0).to(tl.int32)
                qq = (qws[r] >> (2 * sh)) & 0x03030303
                p = _bf(qq, 0) * x0 + _bf(qq, 1) * x1 + _bf(qq, 2) * x2 + _bf(qq, 3) * x3
                d, dm = dds[r]
                na = na + (nacc[r] + (d * (sc & 15).to(tl.float32)) * p - (dm * (sc >> 4).to(tl.float32)) * xsum,)
            nacc = na
        acc = nacc
    ys = ()
    for r in tl.static_range(R):
        ys = ys + (tl.sum(tl.sum(acc[r], axis=2), axis=1),)
    return K._row_join(ys, R, BN)


@triton.jit
def q2c_down_kernel(h_ptr, ids_ptr, dw, db, dh, out_ptr, E, F, RW, EXPW,
                    KSLOTS: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, R: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < E
    out = tl.zeros([BN], tl.float32)
    for j in tl.static_range(KSLOTS):
        s = t * KSLOTS + j
        e = tl.load(ids_ptr + s).to(tl.int64)
        roww = e * EXPW + rows.to(tl.int64) * RW
        out += _q2c_rows(h_ptr + s * F, dw, db, dh, roww, rmask, F, BN, NB, R)
    tl.store(out_ptr + t * E + rows, out, mask=rmask)


TILES = [(8, 8, 1, 4), (16, 8, 2, 4), (32, 8, 4, 4), (16, 4, 2, 2), (32, 4, 4, 4), (8, 4, 1, 2),
         (16, 8, 4, 2), (32, 8, 4, 8), (64, 8, 4, 8), (16, 2, 2, 1), (32, 2, 4, 2), (8, 8, 2, 2),
         (4, 8, 1, 1), (4, 8, 2, 1), (64, 4, 4, 8), (16, 8, 1, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="q2k_rows_probe.json")
    ap.add_argument("--experts", type=int, default=32)
    a = ap.parse_args()
    T0 = time.time()
    from tune_paths import emit, graph_time

    g = torch.Generator(device=dev).manual_seed(1)
    cfg = preset_config("flash")
    be = TritonBackend(cfg, numerics="exact", cuda_graphs=False)
    E, F, NE, k = 4096, 2048, a.experts, 6  # DS4 Flash: model width, expert rows, experts probed, used
    dq = _quant_blocks(T.Q2_K, NE * E * F, 1.0 / np.sqrt(F), dev, g)
    down = QWeight("down", T.Q2_K, (F, E, NE), dq)
    dc = q2c(dq, NE * E, F)
    hin = torch.randn(k, F, device=dev)
    calls = 8
    ids = [torch.tensor([(6 * i + j) % NE for j in range(k)], device=dev, dtype=torch.int32).view(1, k)
           for i in range(calls)]
    RB = F // 256 * 84
    nbytes = k * E * RB
    ref = sum(deq_rows(dq[e * E * RB:(e + 1) * E * RB], E, F) @ hin[j].double()
              for j, e in enumerate(ids[0][0].tolist()))
    scale = float(ref.abs().max())
    rows: list[dict] = []
    s = graph_time(lambda i: be._down_mv(hin, ids[i], down, 1, k), calls=calls)
    y = be._down_mv(hin, ids[0], down, 1, k)[0]
    emit(rows, dict(path="current", us=s * 1e6, GBps=nbytes / s / 1e9, err=float((y.double() - ref).abs().max()) / scale))
    out = torch.empty(1, E, device=dev)
    RW = RB // 4
    for BN, NB, R, warps in TILES:
        def fn(i, BN=BN, NB=NB, R=R, warps=warps):
            q2c_down_kernel[(E // BN, 1)](hin, ids[i], dc.view(torch.int32), dc, dc.view(torch.int16), out,
                                          E, F, RW, E * RW, KSLOTS=k, BN=BN, NB=NB, R=R, num_warps=warps)
            return out
        try:
            fn(0)
            err = float((out[0].double() - ref).abs().max()) / scale
            s = graph_time(fn, calls=calls)
        except Exception as e:  # noqa: BLE001
            print(f"  {BN},{NB},{R},{warps}: {type(e).__name__} {str(e)[:300]}", flush=True)
            continue
        emit(rows, dict(path="q2c", BN=BN, NB=NB, R=R, warps=warps, us=s * 1e6, GBps=nbytes / s / 1e9, err=err))
    json.dump(dict(device=torch.cuda.get_device_name(0), shape=[k, E, F], rows=rows), open(a.out, "w"), indent=1)
    print("\npath | best us | GB/s | tile (BN, NB, R, warps) | err")
    for p in dict.fromkeys(r["path"] for r in rows):
        b = min((r for r in rows if r["path"] == p), key=lambda r: r["us"])
        print(f"{p} | {b['us']:.1f} | {b['GBps']:.0f} | {b.get('BN')},{b.get('NB')},{b.get('R')},{b.get('warps')} | {b['err']:.2g}")
    print(f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
