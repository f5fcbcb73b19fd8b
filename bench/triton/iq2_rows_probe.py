"""Probe: the routed experts' IQ2_XXS gate/up decode product (2 × 6 × 2048 × 4096 values, 25.9 MB).

Why: the backend's 416 decoder ran it at ~53.5 µs (~485 GB/s). Nsight Compute on the H200
(`ncu_decode.py`, results_h200/tune_paths/ncu_decode.txt): L1/TEX throughput 91 %, DRAM 10 %,
issue slots 39 %, 13 sectors per load request, the top stalls long scoreboard and LSU queue
(lg_throttle). Each 8-value grid entry cost two 8-byte gathers per row: its biased levels (2 KB
table) and its sign-mask bytes (1 KB table); 32 lanes gathering random entries touch many
sectors.

Decoders timed here (same run, same data, CUDA graphs of 8 calls over rotating experts):

  416 GT/ST: the backend's 416 structure (GGUF blocks, four row sets per thread) with
    GT 0: levels from the 8-byte biased-level table; GT 1: a 1 KB table of the entry's 8 level
          codes as nibbles, and one byte permute per 4 values (K._iq2_lut) for the biased bytes
    ST 0: signs from the 8-byte mask table; ST 1: computed (the 8th sign is the parity of the
          7: popc), spread to bytes (GT 0) or to bit 2 of each nibble (GT 1); ST 2 (GT 1 only):
          a 512 B table of the nibble sign bits
  iq2r GT/ST: rows rearranged at upload (IQ2R: per 32-row tile and block, the groups' 8-byte
    records of the 32 rows, then their scales), rows along lanes (x loads the same address in
    every lane), K in S parts added atomically into a zeroed output (the zeroing is timed too);
    GT 2: a 512 B table of 2-bit codes spread to nibbles with shifts.

Results (results_h200/tune_paths/iq2_rows_probe_g.json): 416 GT0 ST0 52.8 µs, GT0 ST1 44.3,
GT1 ST1 42.5 (the backend's 416 since), GT1 ST2 44.8; iq2r GT1 ST1 43.7 (64 rows, S 4).
Earlier runs of this probe's predecessors: iq2r without split K (iq2_rows_probe_r.json:
16–32 programs per slot, 89–212 µs), iq2r split (iq2_rows_probe_split.json), and a layout of
aligned grid words then aux words per row decoded as 416 (iq2_rows_probe_c.log: 66.1 against
53.4 µs).

    PYTHONPATH=. python bench/triton/iq2_rows_probe.py --out iq2_rows_probe.json
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
from ds4.backends.triton.backend import QWeight, TritonBackend, _grid_codes
from ds4.backends.triton.synthetic import _quant_blocks
from ds4.core.quants import IQ2XXS_GRID, IQ2XXS_KSIGNS, GGMLType as T
from ds4.core.tiny import preset_config

dev = "cuda"


def tables():
    codes = _grid_codes().astype(np.int64)  # [256] 2-bit codes, value j at bits 2j
    cj = (codes[:, None] >> (2 * np.arange(8))) & 3
    nib = (cj << (4 * np.arange(8))).sum(1).astype(np.uint32).view(np.int32)
    c16 = codes.astype(np.uint16).view(np.int16)
    s7 = np.arange(128)
    par = np.array([bin(v).count("1") & 1 for v in s7])
    assert np.array_equal(IQ2XXS_KSIGNS.astype(np.int64), s7 | (par << 7)), "ksigns: bit 7 is the parity"
    bits = (IQ2XXS_KSIGNS.astype(np.int64)[:, None] >> np.arange(8)) & 1
    sgn = (bits << (4 * np.arange(8) + 2)).sum(1).astype(np.uint32).view(np.int32)
    levels = IQ2XXS_GRID.astype(np.int64).reshape(256, 2, 4) + 128  # 416's first table: biased level bytes
    lv8 = (levels << (8 * np.arange(4))).sum(axis=2).astype(np.uint32).reshape(-1).view(np.int32)
    t = lambda a: torch.tensor(a, device=dev)  # noqa: E731
    return t(nib), t(c16), t(sgn), t(lv8)


@triton.jit
def _spread_codes(c):
    p = (c | (c << 8)) & 0x00FF00FF
    q = (p | (p << 4)) & 0x0F0F0F0F
    return (q | (q << 2)) & 0x33333333


RT = 32  # rows per tile of the IQ2R layout


def iq2r(u8: torch.Tensor, N: int, Kd: int) -> torch.Tensor:
    """GGUF IQ2_XXS rows -> IQ2R: per tile of RT rows and per 256-value block, the 8 groups'
    8-byte records of the RT rows (group-major: a warp's lanes, consecutive rows, read 8·RT
    contiguous bytes), then the RT f16 scales. Same 66 bytes per row and block."""
    nb = Kd // 256
    b = u8.view(N // RT, RT, nb, 66)
    rec = b[..., 2:].reshape(N // RT, RT, nb, 8, 8).permute(0, 2, 3, 1, 4).reshape(N // RT, nb, 64 * RT)
    d = b[..., :2].permute(0, 2, 1, 3).reshape(N // RT, nb, 2 * RT)
    return torch.cat([rec, d], dim=2).reshape(-1)


@triton.jit
def _iq2r_rows(xb, w64, wh, nibp, c16p, sgnp, rows, rmask, K_, sk,
               BN: tl.constexpr, NB: tl.constexpr, GT: tl.constexpr, ST: tl.constexpr, S: tl.constexpr):
    """IQ2R rows of one expert (w64 / wh point at its first byte), tile [NB groups, BN rows],
    rows along lanes; 32-bit offsets inside the expert."""
    nb = K_ // 256
    r = rows[None, :]
    m = rmask[None, :]
    rec0 = (r // 32) * (nb * 66 * 4) + (r % 32)  # in 8-byte records: the row's tile, its record
    d0 = (r // 32) * (nb * 66 * 16) + 32 * 32 + (r % 32)  # in halfwords: its first scale
    acc = tl.zeros([NB, BN], tl.float32)
    IS = K_ // (NB * 32) // S
    for i in range(sk * IS, sk * IS + IS):
        u = i * NB + tl.arange(0, NB)[:, None]
        rec = tl.load(w64 + rec0 + (u // 8) * (66 * 4) + (u % 8) * 32, mask=m, other=0)
        d = tl.load(wh + d0 + (u // 8) * (66 * 16), mask=m, other=0).to(tl.float16, bitcast=True)
        gw = rec.to(tl.int32)
        aux = (rec >> 32).to(tl.int32)
        db = d.to(tl.float32) * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        part = tl.zeros([NB, BN], tl.float32)
        xu = xb + u * 32
        for sub in tl.static_range(4):
            gi = (gw >> (8 * sub)) & 255
            s7 = (aux >> (7 * sub)) & 127
            if GT == 1:
                sel = tl.load(nibp + gi)
            else:
                sel = _spread_codes(tl.load(c16p + gi).to(tl.int32) & 0xFFFF)
            if ST == 2:
                sel = sel | tl.load(sgnp + s7)
            else:
                sel = sel | K._iq2_sign_nibbles(s7)
            for h in tl.static_range(2):
                qx = K._iq2_lut(sel >> (16 * h))
                for j in tl.static_range(4):
                    part += K._b2f(qx, j) * tl.load(xu + (8 * sub + 4 * h + j))
        acc += db * part
    return tl.sum(acc, axis=0)


@triton.jit
def iq2r_gateup_kernel(x_ptr, ids_ptr, g64, gh, u64, uh, nibp, c16p, sgnp, out_ptr, F, K_, EXPB, KSLOTS, SLOTS,
                       BN: tl.constexpr, NB: tl.constexpr, GT: tl.constexpr, ST: tl.constexpr, S: tl.constexpr):
    """K in S parts (grid axis 2), added into out (zeroed) atomically: timing only."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    sk = tl.program_id(2)
    t = s // KSLOTS
    e = tl.load(ids_ptr + s).to(tl.int64)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < F
    xb = x_ptr + t * K_
    g = _iq2r_rows(xb, g64 + e * (EXPB // 8), gh + e * (EXPB // 2), nibp, c16p, sgnp, rows, rmask, K_, sk, BN, NB, GT, ST, S)
    u = _iq2r_rows(xb, u64 + e * (EXPB // 8), uh + e * (EXPB // 2), nibp, c16p, sgnp, rows, rmask, K_, sk, BN, NB, GT, ST, S)
    tl.atomic_add(out_ptr + s * F + rows, g, mask=rmask, sem="relaxed")
    tl.atomic_add(out_ptr + (SLOTS + s) * F + rows, u, mask=rmask, sem="relaxed")


@triton.jit
def _signs01(s7, h: tl.constexpr):
    """Bytes 0x01 where values 4h..4h+3 of the entry with sign index s7 are negative (the 8th
    sign is the parity of the 7): one multiply spreads 4 bits to 4 bytes without carries."""
    s8 = s7 | ((K._popc(s7) & 1) << 7)
    return (((s8 >> (4 * h)) & 15) * 0x204081) & 0x01010101


@triton.jit
def _iq2g_step(xu, wh, lv8, nibp, mk8, sgnp, ro, m, u, GT: tl.constexpr, ST: tl.constexpr):
    """416's K-step (GGUF blocks, four row sets) with the levels from the 2 KB biased table
    (GT 0) or the 1 KB nibble table + prmt (GT 1); the signs from the 1 KB mask table (ST 0),
    by parity arithmetic (ST 1) or (GT 1 only) a 512 B table of nibble sign bits (ST 2)."""
    gs = K._iq2_group_words(wh, ro, m, u)
    for sub in tl.static_range(4):
        xs = ()
        for j in tl.static_range(8):
            xs = xs + (tl.load(xu + 8 * sub + j),)
        nxt = ()
        for r in tl.static_range(4):
            g01, g23, aux, db, part = gs[r]
            if sub < 2:
                gi = (g01 >> (8 * sub)) & 255
            else:
                gi = (g23 >> (8 * (sub - 2))) & 255
            s7 = (aux >> (7 * sub)) & 127
            if GT == 1:
                if ST == 2:
                    sel = tl.load(nibp + gi) | tl.load(sgnp + s7)
                else:
                    sel = tl.load(nibp + gi) | K._iq2_sign_nibbles(s7)
                for h in tl.static_range(2):
                    qx = K._iq2_lut(sel >> (16 * h))
                    for j in tl.static_range(4):
                        part += K._b2f(qx, j) * xs[4 * h + j]
            else:
                lv = tl.load(lv8 + gi)
                if ST == 0:
                    mk = tl.load(mk8 + s7)
                for h in tl.static_range(2):
                    lvh = (lv >> (32 * h)).to(tl.int32)
                    if ST == 1:
                        t = _signs01(s7, h)
                        qx = (lvh ^ (t * 255)) + t
                    else:
                        mkh = (mk >> (32 * h)).to(tl.int32)
                        qx = (lvh ^ mkh) + (mkh & 0x01010101)
                    for j in tl.static_range(4):
                        part += K._b2f(qx, j) * xs[4 * h + j]
            nxt = nxt + ((g01, g23, aux, db, part),)
        gs = nxt
    return gs[0][3] * gs[0][4], gs[1][3] * gs[1][4], gs[2][3] * gs[2][4], gs[3][3] * gs[3][4]


@triton.jit
def iq2g_gateup_kernel(x_ptr, ids_ptr, gh, uh, lv8p, nibp, mk8p, sgnp, out_ptr, F, K_, RB, EXPB, KSLOTS, SLOTS,
                       BN: tl.constexpr, NB: tl.constexpr, GT: tl.constexpr, ST: tl.constexpr):
    """The backend's 416 gate/up kernel on GGUF blocks (no swiglu: g and u stored) with _iq2g_step."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    t = s // KSLOTS
    e = tl.load(ids_ptr + s).to(tl.int64)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < F
    row_off = e * EXPB + rows.to(tl.int64) * RB
    xb = x_ptr + t * K_
    lv8 = lv8p.to(tl.pointer_type(tl.int64), bitcast=True)
    mk8 = mk8p.to(tl.pointer_type(tl.int64), bitcast=True)
    o0, o1, o2, o3 = K._split4(row_off, BN)
    m0, m1, m2, m3 = K._split4(rmask, BN)
    ro = (o0[:, None], o1[:, None], o2[:, None], o3[:, None])
    m = (m0[:, None], m1[:, None], m2[:, None], m3[:, None])
    for w in tl.static_range(2):
        wp = gh if w == 0 else uh
        a0 = tl.zeros([BN // 4, NB], tl.float32)
        a1 = tl.zeros([BN // 4, NB], tl.float32)
        a2 = tl.zeros([BN // 4, NB], tl.float32)
        a3 = tl.zeros([BN // 4, NB], tl.float32)
        for i in range(K_ // (NB * 32)):
            u = i * NB + tl.arange(0, NB)[None, :]
            p0, p1, p2, p3 = _iq2g_step(xb + u * 32, wp, lv8, nibp, mk8, sgnp, ro, m, u, GT, ST)
            a0 += p0
            a1 += p1
            a2 += p2
            a3 += p3
        y = K._join4(tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1), BN)
        tl.store(out_ptr + (w * SLOTS + s) * F + rows, y, mask=rmask)


def deq_rows(u8: torch.Tensor, N: int, Kd: int) -> torch.Tensor:
    """float64 W [N, Kd] from GGUF IQ2_XXS bytes (torch, on the device)."""
    nb = Kd // 256
    b = u8.view(N, nb, 66)
    d = b[:, :, :2].contiguous().view(torch.float16).double()  # [N, nb, 1]
    grp = b[:, :, 2:].contiguous().view(N, nb, 8, 8)
    gi = grp[..., :4].long()
    aux = grp[..., 4:].contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [N, nb, 8, 1]
    db = d[..., None] * (0.5 + (aux >> 28).double()) * 0.25  # [N, nb, 8, 1]
    grid = torch.tensor(IQ2XXS_GRID, device=dev, dtype=torch.float64)  # [256, 8]
    ks = torch.tensor(IQ2XXS_KSIGNS.astype(np.int64), device=dev)
    si = (aux >> torch.tensor([0, 7, 14, 21], device=dev)) & 127  # [N, nb, 8, 4]
    sb = (ks[si][..., None] >> torch.arange(8, device=dev)) & 1
    w = db[..., None] * grid[gi] * (1 - 2 * sb.double())  # [N, nb, 8, 4, 8]
    return w.reshape(N, Kd)


G_VARIANTS = [(0, 0), (0, 1), (1, 1), (1, 2)]
G_TILES = [(32, 32, 4), (16, 32, 4), (32, 16, 4)]
VARIANTS = [(1, 1), (2, 1)]
TILES = [(32, 8, 1, 4), (64, 8, 2, 4), (32, 8, 1, 8)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="iq2_rows_probe.json")
    ap.add_argument("--experts", type=int, default=32)
    a = ap.parse_args()
    T0 = time.time()
    from tune_paths import emit, graph_time

    g = torch.Generator(device=dev).manual_seed(0)
    cfg = preset_config("flash")
    be = TritonBackend(cfg, numerics="exact", cuda_graphs=False)
    F, Kd, NE, k = 2048, 4096, a.experts, 6  # DS4 Flash: expert rows, model width, experts probed, used
    gq = _quant_blocks(T.IQ2_XXS, NE * F * Kd, 1.0 / np.sqrt(Kd), dev, g)
    uq = _quant_blocks(T.IQ2_XXS, NE * F * Kd, 1.0 / np.sqrt(Kd), dev, g)
    gate = QWeight.place("gate", T.IQ2_XXS, (Kd, F, NE), gq)
    up = QWeight.place("up", T.IQ2_XXS, (Kd, F, NE), uq)
    gc, uc = iq2r(gq, NE * F, Kd), iq2r(uq, NE * F, Kd)
    x = torch.randn(1, Kd, device=dev)
    calls = 8
    ids = [torch.tensor([(6 * i + j) % NE for j in range(k)], device=dev, dtype=torch.int32).view(1, k)
           for i in range(calls)]
    wts = torch.ones(1, k, device=dev)
    nbytes = 2 * k * F * (Kd // 256 * 66)
    # reference for call 0: float64 g and u of the 6 experts
    RB = Kd // 256 * 66
    refs = []
    for q in (gq, uq):
        for e in ids[0][0].tolist():
            refs.append(deq_rows(q[e * F * RB:(e + 1) * F * RB], F, Kd) @ x[0].double())
    ref_g = torch.stack(refs[:k])
    ref_u = torch.stack(refs[k:])
    scale = float(torch.cat([ref_g, ref_u]).abs().max())
    rows: list[dict] = []
    clamp = 1e9
    s = graph_time(lambda i: be._gateup_mv(x, gate, up, ids[i], wts, k, k, clamp), calls=calls)
    h = be._gateup_mv(x, gate, up, ids[0], wts, k, k, clamp)
    ref_h = (ref_g * torch.sigmoid(ref_g) * ref_u)
    emit(rows, dict(path="current", us=s * 1e6, GBps=nbytes / s / 1e9,
                    err=float((h.double() - ref_h).abs().max() / ref_h.abs().max())))
    nib, c16, sgn, lv8p = tables()
    out = torch.empty(2, k, F, device=dev)
    mk8p = be._ksigns[128:]
    def measure(path: str, launch, **tile):
        """Check launch(i) (it fills out) against the float64 g / u, then time it."""
        try:
            launch(0)
            err = float(max((out[0].double() - ref_g).abs().max(), (out[1].double() - ref_u).abs().max())) / scale
            s = graph_time(launch, calls=calls)
        except Exception as e:  # noqa: BLE001
            print(f"  {path} {tile}: {type(e).__name__} {str(e)[:300]}", flush=True)
            return
        emit(rows, dict(path=path, **tile, us=s * 1e6, GBps=nbytes / s / 1e9, err=err))

    for GT, ST in G_VARIANTS:
        for BN, NB, warps in G_TILES:
            def fn(i, BN=BN, NB=NB, warps=warps, GT=GT, ST=ST):
                iq2g_gateup_kernel[(F // BN, k)](x, ids[i], gate.i16, up.i16, lv8p, nib, mk8p, sgn, out,
                                                 F, Kd, RB, F * RB, k, k, BN=BN, NB=NB, GT=GT, ST=ST, num_warps=warps)
                return out
            measure(f"416 GT{GT} ST{ST}", fn, BN=BN, NB=NB, warps=warps)
    for GT, ST in VARIANTS:
        for BN, NB, warps, S in TILES:
            def fn(i, BN=BN, NB=NB, warps=warps, GT=GT, ST=ST, S=S):
                out.zero_()
                iq2r_gateup_kernel[(F // BN, k, S)](x, ids[i], gc.view(torch.int64), gc.view(torch.int16),
                                                 uc.view(torch.int64), uc.view(torch.int16), nib, c16, sgn, out,
                                                 F, Kd, F * RB, k, k, BN=BN, NB=NB, GT=GT, ST=ST, S=S, num_warps=warps)
                return out
            measure(f"iq2r GT{GT} ST{ST}", fn, BN=BN, NB=NB, warps=warps, S=S)
        json.dump(dict(device=torch.cuda.get_device_name(0), shape=[k, F, Kd], rows=rows), open(a.out, "w"), indent=1)
        print(f"[{time.time() - T0:.0f}s] GT{GT} ST{ST}", flush=True)
    print("\npath | best us | GB/s | tile (BN, NB, warps, S) | err")
    for p in dict.fromkeys(r["path"] for r in rows):
        b = min((r for r in rows if r["path"] == p), key=lambda r: r["us"])
        print(f"{p} | {b['us']:.1f} | {b['GBps']:.0f} | {b.get('BN')},{b.get('NB')},{b.get('warps')},{b.get('S')} | {b['err']:.2g}")
    print(f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
