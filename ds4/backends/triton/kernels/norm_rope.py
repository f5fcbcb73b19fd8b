"""Elementwise and normalisation kernels: embedding, RMS norm, add, SwiGLU, the hyper-connection
mix / finalize / post kernels, and RoPE.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .common import T_F16, _cache_rows, _dot_f32, _qat_rows, _swiglu, _tail_rope, _wtile
from .decode import _xq_store
from .rules import rules


@triton.jit
def embed_kernel(tok_ptr, wb, wh, wf, gridp, ksigns, x_ptr, E, RB,
                 HC: tl.constexpr, TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr):
    t = tl.program_id(0)
    eb = tl.program_id(1)
    tok = tl.load(tok_ptr + t).to(tl.int64)
    BE: tl.constexpr = NB * VB
    row = _wtile(wb, wh, wf, gridp, ksigns, tok * RB + tl.zeros([1], tl.int64), tl.full([1], 1, tl.int1),
                 eb * NB, TYPE, NB, VB)
    row = tl.reshape(row, [BE])
    c = eb * BE + tl.arange(0, BE)
    for h in tl.static_range(HC):
        tl.store(x_ptr + (t * HC + h) * E + c, row)


@triton.jit
def rms_kernel(x_ptr, w_ptr, out_ptr, D, eps, xw_ptr, xs_ptr, xsum_ptr, BD: tl.constexpr, WEIGHTED: tl.constexpr,
               XQ: tl.constexpr = False, PERM: tl.constexpr = False, DEP: tl.constexpr = False):
    """One row's RMSNorm; XQ (BD = D, a multiple of 32) also stores the result in XQ form, for
    the routed experts' integer decoder (418), or XQ8 with PERM (309). DEP: as matvec_xq_kernel."""
    if DEP:
        gdc_launch_dependents()
    r = tl.program_id(0)
    c = tl.arange(0, BD)
    cm = c < D
    x = tl.load(x_ptr + r.to(tl.int64) * D + c, mask=cm, other=0.0)
    y = x / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    if WEIGHTED:
        y = y * tl.load(w_ptr + c, mask=cm, other=0.0)
    tl.store(out_ptr + r.to(tl.int64) * D + c, y, mask=cm)
    if XQ:
        NBLK: tl.constexpr = BD // 32
        _xq_store(tl.reshape(y, [NBLK, 32]), xw_ptr + r * (D // 2), xs_ptr + r * (D // 32), xsum_ptr + r * (D // 16),
                  0, tl.arange(0, NBLK) < NBLK, PERM)


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, tl.load(a_ptr + i, mask=m) + tl.load(b_ptr + i, mask=m), mask=m)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, out_ptr, n, clamp, BLOCK: tl.constexpr):
    """The clamped SwiGLU of gate and up products computed apart (§3.7)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, _swiglu(tl.load(g_ptr + i, mask=m), tl.load(u_ptr + i, mask=m), clamp), mask=m)


@triton.jit
def hc_mix_kernel(x_ptr, wb, wh, wf, gridp, ksigns, part_ptr, ss_ptr, n, NR, K, RB, KCHUNK,
                  y_ptr, y2_ptr, xo_ptr, post_ptr, comb_ptr, E,
                  NM: tl.constexpr, TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr,
                  BT: tl.constexpr = 1, EXPAND: tl.constexpr = False, HAS_Y2: tl.constexpr = False,
                  HC: tl.constexpr = 4):
    """Partial mHC mixing projections fn[NR, K] · X[t] over one K chunk, and the partial Σ X²,
    for tokens [BT·program, +BT). BT = 1 (decode): FMAs. BT > 1 (prefill): tf32 tensor-core
    products to float32 accuracy (_dot_f32; F16 weights are exact in tf32), so that a weight
    tile read from L2 serves BT tokens instead of one (one token per program read all of fn
    per token).
    EXPAND (BT = 1): X is first computed from the previous sublayer, as hc_post_kernel would
    (X[j] = post[j]·(y + y2) + Σ_i comb[i][j]·Xo[i]), and stored to x_ptr; the expand then
    needs no launch of its own on the decode path."""
    sp = tl.program_id(1)
    nsp = tl.num_programs(1)
    rows = tl.arange(0, NM)
    rmask = rows < NR
    row_off = rows.to(tl.int64) * RB
    BK: tl.constexpr = NB * VB
    if BT == 1:
        t = tl.program_id(0)
        kv = tl.arange(0, NB)[None, :, None] * VB + tl.arange(0, VB)[None, None, :]
        acc = tl.zeros([NM, NB, VB], tl.float32)
        ss = tl.zeros([1, NB, VB], tl.float32)
        xb = x_ptr + t.to(tl.int64) * K
        for k0 in range(sp * KCHUNK, sp * KCHUNK + KCHUNK, BK):
            if EXPAND:
                k = k0 + kv
                j = k // E
                e = k - j * E
                y = tl.load(y_ptr + t.to(tl.int64) * E + e)
                if HAS_Y2:
                    y = y + tl.load(y2_ptr + t.to(tl.int64) * E + e)
                cb = comb_ptr + t * HC * HC + j
                mixed = tl.load(cb) * tl.load(xo_ptr + (t * HC).to(tl.int64) * E + e)
                for i in tl.static_range(1, HC):
                    mixed += tl.load(cb + i * HC) * tl.load(xo_ptr + (t * HC + i).to(tl.int64) * E + e)
                xv = tl.load(post_ptr + t * HC + j) * y + mixed
                tl.store(xb + k, xv)
            else:
                xv = tl.load(xb + k0 + kv)
            ss += xv * xv
            acc += _wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB) * xv
        tl.store(part_ptr + (t * nsp + sp) * NM + rows, tl.sum(tl.sum(acc, axis=2), axis=1))
        tl.store(ss_ptr + t * nsp + sp, tl.sum(ss))
    else:
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        tm = t < n
        kk = tl.arange(0, BK)
        acc = tl.zeros([BT, NM], tl.float32)
        ss = tl.zeros([BT, BK], tl.float32)
        xb = x_ptr + t[:, None].to(tl.int64) * K
        for k0 in range(sp * KCHUNK, sp * KCHUNK + KCHUNK, BK):
            xt = tl.load(xb + k0 + kk[None, :], mask=tm[:, None], other=0.0)
            ss += xt * xt
            w = tl.reshape(_wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB), [NM, BK])
            acc = _dot_f32(xt, tl.trans(w), acc, TYPE == T_F16)
        tp = (t * nsp + sp).to(tl.int64)
        tl.store(part_ptr + tp[:, None] * NM + rows[None, :], acc, mask=tm[:, None])
        tl.store(ss_ptr + tp, tl.sum(ss, axis=1), mask=tm)


@triton.jit
def hc_finalize_kernel(x_ptr, part_ptr, ss_ptr, scale_ptr, base_ptr, xin_ptr, post_ptr, comb_ptr,
                       n, E, eps, hc_eps, ITERS,
                       SPLIT: tl.constexpr, HC: tl.constexpr, NM: tl.constexpr, BE: tl.constexpr,
                       BT: tl.constexpr, HEAD: tl.constexpr, PART: tl.constexpr = 0, RELOAD: tl.constexpr = 0):
    """mHC collapse (§3.2) of tokens [tb·BT, +BT): pre/post/comb from the mixing projections
    (Sinkhorn on comb), and x_in[e-block] = Σ_i pre[i]·X[i]. HEAD: the output head (pre only).
    PART 1: pre and x_in only; PART 2: post and comb only (one program per token block). The
    sublayer needs x_in at once and post/comb only at its expand, so a decode step runs the two
    parts side by side and the Sinkhorn iterations leave the critical path. Comb is the core's
    Sinkhorn on a [BT, HC, HC] tile: for one token its row and column sums are warp shuffles.
    RELOAD (PART 2, one token): the tile goes through comb_ptr before the iterations, so they run
    on the tile's own layout rather than on the one its sum over SPLIT partials left, which
    spreads the 16 values over more lanes (8 shuffles an iteration instead of 4 at SPLIT 128)."""
    tb = tl.program_id(0)
    eb = tl.program_id(1)
    t = tb * BT + tl.arange(0, BT)
    tm = t < n
    tc = tl.where(tm, t, 0)
    sp = tl.arange(0, SPLIT)
    ss = tl.sum(tl.load(ss_ptr + tc[:, None] * SPLIT + sp[None, :]), axis=1)  # [BT]
    rs = tl.sqrt_rn(ss / (HC * E) + eps)
    pbase = part_ptr + (tc[:, None] * SPLIT + sp[None, :]) * NM  # [BT, SPLIT]
    i = tl.arange(0, HC)
    pre = tl.sum(tl.load(pbase[:, :, None] + i[None, None, :]), axis=1) / rs[:, None]  # [BT, HC]
    pre = rules.mhc_pre_weights(pre, tl.load(scale_ptr), tl.load(base_ptr + i)[None, :], hc_eps)
    if not HEAD and PART != 1:
        if eb == 0:
            post = tl.sum(tl.load(pbase[:, :, None] + HC + i[None, None, :]), axis=1) / rs[:, None]
            post = rules.mhc_post_weights(post, tl.load(scale_ptr + 1), tl.load(base_ptr + HC + i)[None, :])
            tl.store(post_ptr + tc[:, None] * HC + i[None, :], post, mask=tm[:, None])
            cidx = 2 * HC + i[:, None] * HC + i[None, :]  # [HC, HC]
            # all SPLIT partials in one tile (a loop of SPLIT dependent steps is a serial chain)
            cp = part_ptr + (tc[:, None, None, None] * SPLIT + sp[None, :, None, None]) * NM
            c = tl.sum(tl.load(cp + cidx[None, None, :, :]), axis=1) / rs[:, None, None]
            c = c * tl.load(scale_ptr + 2) + tl.load(base_ptr + cidx)[None, :, :]
            cq = comb_ptr + tc[:, None, None] * HC * HC + (cidx - 2 * HC)[None, :, :]  # (the comb tile)
            if BT == 1 and PART == 2 and RELOAD:
                tl.store(cq, c)
                tl.debug_barrier()  # (other threads load what one stored)
                c = tl.load(cq)
                tl.debug_barrier()  # every thread has loaded before the result is stored over it
            c = rules.sinkhorn(c, ITERS, hc_eps)
            tl.store(cq, c, mask=tm[:, None, None])
    if PART != 2:
        e = eb * BE + tl.arange(0, BE)
        em = e < E
        X = tl.load(x_ptr + (tc[:, None, None] * HC + i[None, :, None]).to(tl.int64) * E + e[None, None, :],
                    mask=tm[:, None, None] & em[None, None, :], other=0.0)
        tl.store(xin_ptr + tc[:, None].to(tl.int64) * E + e[None, :], tl.sum(pre[:, :, None] * X, axis=1),
                 mask=tm[:, None] & em[None, :])


@triton.jit
def hc_post_kernel(y_ptr, y2_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, E,
                   HC: tl.constexpr, BE: tl.constexpr, HAS_Y2: tl.constexpr):
    """mHC expand (§3.3): X_new[j] = post[j]·y + Σ_i comb[i][j]·X[i] (y = y + y2 fused)."""
    t = tl.program_id(0)
    eb = tl.program_id(1)
    e = eb * BE + tl.arange(0, BE)
    em = e < E
    y = tl.load(y_ptr + t.to(tl.int64) * E + e, mask=em, other=0.0)
    if HAS_Y2:
        y = y + tl.load(y2_ptr + t.to(tl.int64) * E + e, mask=em, other=0.0)
    i = tl.arange(0, HC)
    X = tl.load(x_ptr + (t * HC + i[:, None]).to(tl.int64) * E + e[None, :], mask=em[None, :], other=0.0)
    post = tl.load(post_ptr + t * HC + i)
    comb = tl.load(comb_ptr + t * HC * HC + i[:, None] * HC + i[None, :])  # [i, j]
    mixed = tl.sum(comb[:, :, None] * X[:, None, :], axis=0)  # [j, e]
    out = post[:, None] * y[None, :] + mixed
    tl.store(out_ptr + (t * HC + i[:, None]).to(tl.int64) * E + e[None, :], out, mask=em[None, :])


# ------------------------------------------------------------------------------------------------
# RoPE, cache rows


@triton.jit
def rope_kernel(x_ptr, out_ptr, nw_ptr, freq_ptr, pos_ptr, ROWS, eps,
                D: tl.constexpr, NROT: tl.constexpr, BR: tl.constexpr,
                NORM: tl.constexpr, INVERSE: tl.constexpr, QAT: tl.constexpr, QS: tl.constexpr,
                LOGD: tl.constexpr, HDP: tl.constexpr,
                RING: tl.constexpr = False, RAWCAP=1, NN: tl.constexpr = 0, DS4: tl.constexpr = False):
    """Tail RoPE (adjacent pairs of the last NROT dims) of rows [n, ROWS, D] at positions p0 + t,
    optionally after a per-row RMSNorm (NORM 1 weighted, 2 unweighted) and followed by the
    indexer's Hadamard + FP4 simulation (QAT: D a power of two). HDP: D / 2 pairs padded to a
    power of two (tl.arange's sizes), the pad masked. A row is loaded and stored whole, then split
    into its even and odd dims in registers: loads of every other value took each sector twice.
    RING (ROWS 1): out_ptr is the raw window's ring and each row goes to its row (p0 + t) %
    RAWCAP as kv_store_kernel stores it (DS4: FP8-simulated below NN, then f16-rounded): the KV
    row's RoPE and store in one launch."""
    t = tl.program_id(0)
    rb = tl.program_id(1)
    HD: tl.constexpr = D // 2
    r = rb * BR + tl.arange(0, BR)
    rm = r < ROWS
    base = (t * ROWS + r).to(tl.int64) * D
    i = tl.arange(0, HDP)
    im = i < HD
    j = tl.arange(0, 2)
    pr = base[:, None, None] + 2 * i[None, :, None] + j[None, None, :]  # [BR, HDP, 2]: the pairs
    pm = (rm[:, None] & im[None, :])[:, :, None]  # (one mask a pair: its loads vectorise)
    xe, xo = tl.split(tl.load(x_ptr + pr, mask=pm, other=0.0))
    if NORM != 0:
        rs = tl.sqrt_rn((tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)) / D + eps)[:, None]
        xe = xe / rs
        xo = xo / rs
        if NORM == 1:
            xe = xe * tl.load(nw_ptr + 2 * i, mask=im, other=0.0)[None, :]
            xo = xo * tl.load(nw_ptr + 2 * i + 1, mask=im, other=0.0)[None, :]
    pos = tl.load(pos_ptr) + t
    ne, no = _tail_rope(xe, xo, i[None, :], im[None, :], pos, freq_ptr, D, NROT, INVERSE)
    if RING:
        y = tl.reshape(tl.join(ne, no), [BR, 2 * HDP])  # (the pad past D is zero)
        if DS4:
            y = _cache_rows(y, NN)
        col = tl.arange(0, 2 * HDP)[None, :]
        tl.store(out_ptr + (pos % RAWCAP).to(tl.int64) * D + col, y, mask=rm[:, None] & (col < D))
    elif QAT:
        y = _qat_rows(tl.reshape(tl.join(ne, no), [BR, D]), QS, LOGD)
        tl.store(out_ptr + base[:, None] + tl.arange(0, D)[None, :], y, mask=rm[:, None])
    else:
        tl.store(out_ptr + pr, tl.join(ne, no), mask=pm)
