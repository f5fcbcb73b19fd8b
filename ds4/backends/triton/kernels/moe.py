"""Mixture-of-experts kernels: the router, the routed experts' gate/up and down products for
decode (mv) and prefill (mm), and the reduction of the expert outputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import D_IQ2_GROUPS_XQ, D_Q2S_HALVES_XQ, D_Q2_K_XQ, D_Q8C_XQ8, _dot_units, _swiglu, _wtile
from .decode import _xq_store
from .decode_rows import _iq2_group_rows, _q2k_int_rows, _q2s_slots
from .mmvq import _mv_rows, _q8c_xq_rows, _split_last, _split_reset, _split_store, _split_sum
from .mmq import _mm_rows
from .rules import rules


@triton.jit
def moe_gateup_mv_kernel(x_ptr, sx_t, ids_ptr, wts_ptr,
                         gb, gh, gf, ub, uh, uf, gridp, ksigns, h_ptr, ws_ptr, cnt_ptr,
                         xw_ptr, xs_ptr, hw_ptr, hs_ptr, hsum_ptr,
                         F, K, RB, EXP_BYTES, KSLOTS, clamp,
                         TYPE: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr,
                         VA: tl.constexpr, ROUTED: tl.constexpr, S: tl.constexpr = 1,
                         QOUT: tl.constexpr = False, PF: tl.constexpr = False):
    """h[s, r] = w_s · swiglu(gate_e[r]·x, up_e[r]·x) for slot s = t·KSLOTS + j of expert
    e = ids[s] (ROUTED), or the shared expert (e = 0, no weight); K split in S parts as in
    matvec_kernel (the last program of a tile adds the partial gate and up sums, then applies
    the SwiGLU). TYPE 418 reads x in XQ form (xw_ptr, xs_ptr: [n, K/2] words, [n, K/32] scales),
    309 (Q8C, the shared expert) in XQ8 form;
    QOUT also stores h in XQ form (hw_ptr, hs_ptr, hsum_ptr) for the down decoder 111: a tile's
    BN rows (a multiple of 32) are whole blocks. PF: 418 issues each K-step's group loads one step
    ahead (_iq2_group_rows)."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    sk = tl.program_id(2)
    t = s // KSLOTS
    if ROUTED:
        e = tl.load(ids_ptr + s).to(tl.int64)
    else:
        e = 0
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < F
    row_off = e * EXP_BYTES + rows.to(tl.int64) * RB
    xb = x_ptr + t * sx_t
    if TYPE == D_IQ2_GROUPS_XQ:
        xw = xw_ptr + t * (K // 2)
        xs = xs_ptr + t * (K // 32)
        g = _iq2_group_rows(xw, gh, gf, gridp, row_off, rmask, K, sk, BN, NB, S, False, xs, True, PF)
        u = _iq2_group_rows(xw, uh, uf, gridp, row_off, rmask, K, sk, BN, NB, S, False, xs, True, PF)
    elif TYPE == D_Q8C_XQ8:
        xw = xw_ptr + t * (K // 2)
        xs = xs_ptr + t * (K // 32)
        g = _q8c_xq_rows(xw, xs, gf, gh, row_off, rmask, K, sk, BN, NB, VA, S)
        u = _q8c_xq_rows(xw, xs, uf, uh, row_off, rmask, K, sk, BN, NB, VA, S)
    else:
        g = _mv_rows(xb, gb, gh, gf, gridp, ksigns, row_off, rmask, K, sk, 1.0, xb, 0.0, BN, TYPE, NB, VB, VA, 0, S)
        u = _mv_rows(xb, ub, uh, uf, gridp, ksigns, row_off, rmask, K, sk, 1.0, xb, 0.0, BN, TYPE, NB, VB, VA, 0, S)
    done = True
    if S > 1:  # partial sums to this slot's [S, 2, F] workspace; the tile's last program goes on
        wsl = ws_ptr + s * (S * 2 * F)
        tl.store(wsl + sk * 2 * F + rows, g, mask=rmask)
        tl.store(wsl + sk * 2 * F + F + rows, u, mask=rmask)
        tile = s * tl.num_programs(0) + pid
        done = _split_last(cnt_ptr, tile, S)
        if done:
            g = _split_sum(wsl, rows, rmask, 2 * F, S)
            u = _split_sum(wsl + F, rows, rmask, 2 * F, S)
            _split_reset(cnt_ptr, tile)
    if done:
        h = _swiglu(g, u, clamp)
        if ROUTED:
            h = h * tl.load(wts_ptr + s)
        tl.store(h_ptr + s * F + rows, h, mask=rmask)
        if QOUT:
            NBLK: tl.constexpr = BN // 32
            b0 = pid * NBLK
            _xq_store(tl.reshape(h, [NBLK, 32]), hw_ptr + s * (F // 2), hs_ptr + s * (F // 32),
                      hsum_ptr + s * (F // 16), b0, b0 + tl.arange(0, NBLK) < F // 32)


@triton.jit
def moe_down_mv_kernel(h_ptr, ids_ptr, db, dh, df, gridp, ksigns, out_ptr, ws_ptr, cnt_ptr,
                       hw_ptr, hs_ptr, hsum_ptr, E, F, RB, EXP_BYTES,
                       KSLOTS: tl.constexpr, TYPE: tl.constexpr, BN: tl.constexpr,
                       NB: tl.constexpr, VB: tl.constexpr, VA: tl.constexpr, S: tl.constexpr = 1,
                       IS: tl.constexpr = 1):
    """out[t, r] = Σ_j down_{ids[t,j]}[r] · h[t·KSLOTS + j], summed in slot order (113: the slots
    add per tile element, then the halves); F split in S parts as in matvec_kernel. TYPEs 111 and
    113 read h in XQ form (hw_ptr, hs_ptr, hsum_ptr); 113 takes NB 128-value halves per K-step, VA
    rows per thread and IS K-steps per part (_q2s_slots)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    sk = tl.program_id(2)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < E
    out = tl.zeros([BN], tl.float32)
    if TYPE == D_Q2S_HALVES_XQ:
        out = _q2s_slots(ids_ptr, t, hw_ptr, hs_ptr, hsum_ptr, db, dh, df, rows, rmask, F, RB, EXP_BYTES, sk,
                         KSLOTS, BN, NB, VA, IS)
    else:
        for j in tl.static_range(KSLOTS):
            s = t * KSLOTS + j
            e = tl.load(ids_ptr + s).to(tl.int64)
            row_off = e * EXP_BYTES + rows.to(tl.int64) * RB
            hb = h_ptr + s * F
            if TYPE == D_Q2_K_XQ:
                out += _q2k_int_rows(hw_ptr + s * (F // 2), hs_ptr + s * (F // 32), hsum_ptr + s * (F // 16),
                                     db, dh, df, row_off, rmask, F, sk, BN, NB, S)
            else:
                out += _mv_rows(hb, db, dh, df, gridp, ksigns, row_off, rmask, F, sk, 1.0, hb, 0.0, BN, TYPE, NB,
                                VB, VA, 0, S)
    _split_store(out, out_ptr + t * E, rows, rmask, ws_ptr + t * S * E, cnt_ptr, t * tl.num_programs(0) + pid,
                 sk, E, S)


@triton.jit
def moe_gateup_mm_kernel(x_ptr, sx_t, tok_ptr, wts_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr,
                         gb, gh, gf, ub, uh, uf, gridp, ksigns, h_ptr,
                         F, K, RB, EXP_BYTES, clamp,
                         TYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                         VB: tl.constexpr, ROUTED: tl.constexpr, PREC: tl.constexpr, U: tl.constexpr = 0,
                         TERMS: tl.constexpr = 3):
    """Prefill: one tile of BM assignments (token, slot) of one expert, sorted by expert.
    h[a, r] = w_a · swiglu(gate_e[r]·x[tok_a], up_e[r]·x[tok_a])."""
    tile = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(tile_e_ptr + tile)
    if e >= 0:
        r0 = tl.load(tile_r0_ptr + tile)
        rend = tl.load(tile_end_ptr + tile)
        a = r0 + tl.arange(0, BM)
        am = a < rend
        if ROUTED:
            tok = tl.load(tok_ptr + a, mask=am, other=0).to(tl.int64)
        else:
            tok = a.to(tl.int64)
        rows = pn * BN + tl.arange(0, BN)
        rmask = rows < F
        row_off = e.to(tl.int64) * EXP_BYTES + rows.to(tl.int64) * RB
        BK: tl.constexpr = NB * VB
        kk = tl.arange(0, BK)
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        if U > 0:
            for k0 in range(0, K, NB * U):
                acc_g = _dot_units(x_ptr, sx_t, tok, am, k0, gb, gh, row_off, rmask, acc_g, NB, TYPE, TERMS)
                acc_u = _dot_units(x_ptr, sx_t, tok, am, k0, ub, uh, row_off, rmask, acc_u, NB, TYPE, TERMS)
        else:
            for k0 in range(0, K, BK):
                xt = tl.load(x_ptr + tok[:, None] * sx_t + k0 + kk[None, :], mask=am[:, None], other=0.0)
                wg = tl.reshape(_wtile(gb, gh, gf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB), [BN, BK])
                acc_g = tl.dot(xt, tl.trans(wg), acc_g, input_precision=PREC)
                wu = tl.reshape(_wtile(ub, uh, uf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB), [BN, BK])
                acc_u = tl.dot(xt, tl.trans(wu), acc_u, input_precision=PREC)
        h = _swiglu(acc_g, acc_u, clamp)
        if ROUTED:
            h = h * tl.load(wts_ptr + a, mask=am, other=0.0)[:, None]
        tl.store(h_ptr + a[:, None].to(tl.int64) * F + rows[None, :], h, mask=am[:, None] & rmask[None, :])


@triton.jit
def moe_down_mm_kernel(h_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr, db, dh, df, gridp, ksigns, out_ptr,
                       E, F, RB, EXP_BYTES,
                       TYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                       VB: tl.constexpr, PREC: tl.constexpr, U: tl.constexpr = 0, TERMS: tl.constexpr = 3):
    """Prefill: out_sorted[a, r] = down_e[r] · h[a] for one tile of expert e's assignments."""
    tile = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(tile_e_ptr + tile)
    if e >= 0:
        r0 = tl.load(tile_r0_ptr + tile)
        rend = tl.load(tile_end_ptr + tile)
        a = r0 + tl.arange(0, BM)
        am = a < rend
        rows = pn * BN + tl.arange(0, BN)
        rmask = rows < E
        row_off = e.to(tl.int64) * EXP_BYTES + rows.to(tl.int64) * RB
        acc = _mm_rows(h_ptr, F, a, am, F, db, dh, df, gridp, ksigns, row_off, rmask, BM, BN, TYPE, NB, VB, PREC, U,
                       TERMS)
        tl.store(out_ptr + a[:, None].to(tl.int64) * E + rows[None, :], acc, mask=am[:, None] & rmask[None, :])


@triton.jit
def moe_reduce_kernel(src_ptr, inv_ptr, out_ptr, E, KSLOTS: tl.constexpr, BE: tl.constexpr):
    """out[t] = Σ_j src[inv[t·KSLOTS + j]] in slot order (the reference's summation order)."""
    t = tl.program_id(0)
    eb = tl.program_id(1)
    c = eb * BE + tl.arange(0, BE)
    cm = c < E
    acc = tl.zeros([BE], tl.float32)
    for j in tl.static_range(KSLOTS):
        r = tl.load(inv_ptr + t * KSLOTS + j).to(tl.int64)
        acc += tl.load(src_ptr + r * E + c, mask=cm, other=0.0)
    tl.store(out_ptr + t * E + c, acc, mask=cm)


@triton.jit
def router_kernel(logit_ptr, NE, bias_ptr, tid_ptr, tok_ptr, ids_ptr, w_ptr, scale,
                  KSEL: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HASH: tl.constexpr):
    """p = sqrt(softplus(logits)); ids = hash table row or top-k of p + bias (ties: lower id);
    weights = the core's router_scale of p[ids] and their sum (spec §3.7)."""
    t = tl.program_id(0)
    idx = tl.arange(0, BE)
    em = idx < NE
    x = tl.load(logit_ptr + t * NE + idx, mask=em, other=0.0)
    ex = tl.exp(tl.minimum(x, 20.0))
    one = 1.0 + ex
    lp = tl.where(one == 1.0, ex, tl.log(one) * ex / (one - 1.0))  # accurate log1p
    sp = tl.where(x > 20.0, x, tl.where(x < -20.0, tl.exp(tl.minimum(x, 0.0)), lp))
    p = tl.sqrt_rn(sp)
    kk = tl.arange(0, KP)
    km = kk < KSEL
    if HASH:
        tok = tl.load(tok_ptr + t).to(tl.int64)
        ids = tl.load(tid_ptr + tok * KSEL + kk, mask=km, other=0)
        w = tl.sum(tl.where(idx[None, :] == ids[:, None], p[None, :], 0.0), axis=1)
        w = tl.where(km, w, 0.0)
    else:
        sel = p
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + idx, mask=em, other=0.0)
        sel = tl.where(em, sel, float("-inf"))
        ids = tl.zeros([KP], tl.int32)
        w = tl.zeros([KP], tl.float32)
        for j in tl.static_range(KSEL):
            # the best score, then the lowest id holding it (-0 equals +0 here, as in the reference)
            mx = tl.max(sel, axis=0)
            i = tl.min(tl.where(sel == mx, idx, BE), axis=0)
            ids = tl.where(kk == j, i, ids)
            w = tl.where(kk == j, tl.sum(tl.where(idx == i, p, 0.0), axis=0), w)
            sel = tl.where(idx == i, float("-inf"), sel)
    tot = tl.sum(w, axis=0)
    w = rules.router_scale(w, tot, scale)
    tl.store(ids_ptr + t * KSEL + kk, ids, mask=km)
    tl.store(w_ptr + t * KSEL + kk, w, mask=km)


# ------------------------------------------------------------------------------------------------
# element-wise, norms, mHC
