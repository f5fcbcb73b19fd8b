"""Attention: the KV store, the compressor (pool / update), the indexer scores and its top-k
selection, the sparse attention kernel and its combine.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .common import _NEG, _cos, _dot16, _dot_f32, _f16_round, _fp8_rows, _hi_lo, _pow2_scale, _qat_rows, _sin
from .decode import _xq_store
from .rules import rules


@triton.jit
def kv_store_kernel(kv_ptr, raw_ptr, pos_ptr, RAWCAP, D: tl.constexpr, NN: tl.constexpr, DS4: tl.constexpr,
                    DP: tl.constexpr):
    """Push K=V rows into the raw ring at (p0 + t) % RAWCAP, FP8-simulated and f16-rounded (ds4).
    DP: D padded to a power of two, the pad masked."""
    t = tl.program_id(0)
    c = tl.arange(0, DP)[None, :]
    cm = c < D
    x = tl.load(kv_ptr + t.to(tl.int64) * D + c, mask=cm, other=0.0)
    if DS4:
        if NN > 0:
            x = _fp8_rows(x, NN)
        x = _f16_round(x)
    row = (tl.load(pos_ptr) + t) % RAWCAP
    tl.store(raw_ptr + row.to(tl.int64) * D + c, x, mask=cm)


# ------------------------------------------------------------------------------------------------
# compressor (§3.5)


@triton.jit
def _comp_src(q, p0, M: tl.constexpr, CSA: tl.constexpr):
    """State row holding position q < p0 (the frontier at the chunk's start)."""
    if CSA:
        return tl.where(q // 4 == p0 // 4, 4 + q % 4, q % 4)
    else:
        return q % M


@triton.jit
def _comp_cand(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, w, p0, r0, i,
               M: tl.constexpr, D: tl.constexpr, C: tl.constexpr, CSA: tl.constexpr,
               RB: tl.constexpr, KV: tl.constexpr, NCAND: tl.constexpr):
    """Scores (ape included) and values of candidates r0..r0+RB of window w (those below NCAND),
    even / odd dims."""
    r = r0 + tl.arange(0, RB)
    if CSA:  # two lanes: the previous window's first and this window's second
        q = rules.csa_candidate_position(w, r, M)
        coff = rules.csa_candidate_lane(r, M, D)
    else:
        q = w * M + r
        coff = r * 0
    inchunk = q >= p0
    valid = (q >= 0) & (r < NCAND)
    srow = _comp_src(q, p0, M, CSA)
    crow = tl.where(inchunk, q - p0, 0)
    col_e = coff[:, None] + 2 * i[None, :]
    im = (i < D // 2)[None, :]  # (the pairs' pad past D / 2)
    ld_c = (inchunk & valid)[:, None] & im
    ld_s = ((~inchunk) & valid)[:, None] & im
    qm = tl.where(valid, q % M, 0)[:, None]
    sc_e = tl.where(ld_c, tl.load(sc_ptr + crow[:, None] * C + col_e, mask=ld_c, other=0.0)
                    + tl.load(ape_ptr + qm * C + col_e, mask=ld_c, other=0.0),
                    tl.load(ssc_ptr + srow[:, None] * C + col_e, mask=ld_s, other=float("-inf")))
    sc_o = tl.where(ld_c, tl.load(sc_ptr + crow[:, None] * C + col_e + 1, mask=ld_c, other=0.0)
                    + tl.load(ape_ptr + qm * C + col_e + 1, mask=ld_c, other=0.0),
                    tl.load(ssc_ptr + srow[:, None] * C + col_e + 1, mask=ld_s, other=float("-inf")))
    if KV:
        kv_e = tl.where(ld_c, tl.load(kv_ptr + crow[:, None] * C + col_e, mask=ld_c, other=0.0),
                        tl.load(skv_ptr + srow[:, None] * C + col_e, mask=ld_s, other=0.0))
        kv_o = tl.where(ld_c, tl.load(kv_ptr + crow[:, None] * C + col_e + 1, mask=ld_c, other=0.0),
                        tl.load(skv_ptr + srow[:, None] * C + col_e + 1, mask=ld_s, other=0.0))
    else:
        kv_e = sc_e
        kv_o = sc_o
    return sc_e, sc_o, kv_e, kv_o


@triton.jit
def comp_pool_kernel(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, nw_ptr, freq_ptr, pos_ptr, rows_ptr,
                     n, eps,
                     M: tl.constexpr, D: tl.constexpr, C: tl.constexpr, NROT: tl.constexpr,
                     CSA: tl.constexpr, NCAND: tl.constexpr, RB: tl.constexpr, MODE: tl.constexpr,
                     QS: tl.constexpr, LOGD: tl.constexpr, HDP: tl.constexpr):
    """One compressed row per program: the window w = p0 // M + program that closes inside the
    chunk (others exit). Candidates are the window's M positions (CSA: the previous window's
    first lane and this window's second lane, 8 rows), read from the chunk's projections or
    from the frontier state; per-dimension softmax pooling, RMSNorm, RoPE at the window's first
    position, then MODE 1: FP8 + f16, MODE 2: Hadamard + FP4 + f16 (D a power of two), MODE 0:
    none. HDP: D / 2 pairs padded to a power of two, the pad masked."""
    p0 = tl.load(pos_ptr)
    w = p0 // M + tl.program_id(0)
    if w * M + M - 1 < p0 + n:
        HD: tl.constexpr = HDP
        i = tl.arange(0, HD)
        im = i < D // 2
        mx_e = tl.full([HD], float("-inf"), tl.float32)
        mx_o = tl.full([HD], float("-inf"), tl.float32)
        for r0 in range(0, NCAND, RB):
            sc_e, sc_o, _, _ = _comp_cand(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, w, p0, r0, i,
                                          M, D, C, CSA, RB, False, NCAND)
            mx_e = tl.maximum(mx_e, tl.max(sc_e, axis=0))
            mx_o = tl.maximum(mx_o, tl.max(sc_o, axis=0))
        safe_e = rules.pool_shift(mx_e)
        safe_o = rules.pool_shift(mx_o)
        se = tl.zeros([HD], tl.float32)
        so = tl.zeros([HD], tl.float32)
        ae = tl.zeros([HD], tl.float32)
        ao = tl.zeros([HD], tl.float32)
        for r0 in range(0, NCAND, RB):
            sc_e, sc_o, kv_e, kv_o = _comp_cand(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, w, p0, r0, i,
                                                M, D, C, CSA, RB, True, NCAND)
            pe = rules.pool_weight(sc_e, safe_e[None, :])
            po = rules.pool_weight(sc_o, safe_o[None, :])
            se += tl.sum(pe, axis=0)
            so += tl.sum(po, axis=0)
            ae += tl.sum(pe * kv_e, axis=0)
            ao += tl.sum(po * kv_o, axis=0)
        xe = rules.pool_finish(ae, se)[None, :]
        xo = rules.pool_finish(ao, so)[None, :]
        rs = tl.sqrt_rn((tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)) / D + eps)[:, None]
        xe = xe / rs * tl.load(nw_ptr + 2 * i, mask=im, other=0.0)[None, :]
        xo = xo / rs * tl.load(nw_ptr + 2 * i + 1, mask=im, other=0.0)[None, :]
        k = i - (D - NROT) // 2
        km = ((k >= 0) & im)[None, :]
        theta = (w * M).to(tl.float32) * tl.load(freq_ptr + k, mask=(k >= 0) & im, other=0.0)
        c = _cos(theta)[None, :]
        s = _sin(theta)[None, :]
        ne, no = rules.rope_rotate(xe, xo, c, s)
        ne = tl.where(km, ne, xe)
        no = tl.where(km, no, xo)
        y = tl.reshape(tl.join(ne, no), [1, 2 * HD])
        if MODE == 1:
            if D - NROT > 0:
                y = _fp8_rows(y, D - NROT)
            y = _f16_round(y)
        elif MODE == 2:
            y = _f16_round(_qat_rows(y, QS, LOGD))
        c = tl.arange(0, 2 * HD)[None, :]
        tl.store(rows_ptr + w.to(tl.int64) * D + c, y, mask=c < D)


@triton.jit
def comp_update_kernel(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, pos_ptr, n,
                       M: tl.constexpr, C: tl.constexpr, CSA: tl.constexpr, NR: tl.constexpr,
                       BC: tl.constexpr, NRP: tl.constexpr):
    """The frontier after the chunk, as the reference leaves it: row (CSA: 4 +) q % M holds the
    last position q of the chunk with that residue (score includes ape); CSA rows 0..3 hold the
    last window closed in the chunk."""
    p0 = tl.load(pos_ptr)
    cb = tl.program_id(0)
    col = cb * BC + tl.arange(0, BC)
    cm = col < C
    r = tl.arange(0, NRP)  # NR state rows padded to a power of two; the pad is never stored
    last = p0 + n - 1
    if CSA:
        rr = r % 4
        q_cur = last - (((last - rr) % 4) + 4) % 4
        L = (p0 + n) // 4 - 1  # the last window closed in the chunk, if L >= p0 // 4
        q_prev = 4 * L + rr
        q = tl.where(r >= 4, q_cur, q_prev)
        do = tl.where(r >= 4, q_cur >= p0, L >= p0 // 4)
        old_row = tl.where(r >= 4, r, 4 + rr)  # where a pre-chunk position of that window sits
    else:
        q = last - (((last - r) % M) + M) % M
        do = q >= p0
        old_row = r
    do = do & (r < NR)
    inchunk = do & (q >= p0)
    fromold = do & (q < p0)
    crow = tl.where(inchunk, q - p0, 0)
    m_c = inchunk[:, None] & cm[None, :]
    m_o = fromold[:, None] & cm[None, :]
    colx = col[None, :]
    kv_new = tl.load(kv_ptr + crow[:, None] * C + colx, mask=m_c, other=0.0)
    sc_new = tl.load(sc_ptr + crow[:, None] * C + colx, mask=m_c, other=0.0) + \
        tl.load(ape_ptr + (q % M)[:, None] * C + colx, mask=m_c, other=0.0)
    kv_old = tl.load(skv_ptr + old_row[:, None] * C + colx, mask=m_o, other=0.0)
    sc_old = tl.load(ssc_ptr + old_row[:, None] * C + colx, mask=m_o, other=0.0)
    kv = tl.where(inchunk[:, None], kv_new, kv_old)
    sc = tl.where(inchunk[:, None], sc_new, sc_old)
    sm = do[:, None] & cm[None, :]
    tl.store(skv_ptr + r[:, None] * C + colx, kv, mask=sm)
    tl.store(ssc_ptr + r[:, None] * C + colx, sc, mask=sm)


# ------------------------------------------------------------------------------------------------
# indexer (§3.6)


# The one-query top-k's counts (idx_score_kernel's cnt_ptr, topk_one_kernel's kc_ptr): keys by
# their top 8 bits [0, 256), by their top 14 bits [256, 256 + 16384), then the top-k programs'
# start and end tickets, then each chunk's selected-row count plus one (0: not yet known).
TOPK_START = tl.constexpr(256 + 16384)
TOPK_END = tl.constexpr(256 + 16384 + 1)
TOPK_CHUNKS = tl.constexpr(256 + 16384 + 2)


@triton.jit
def idx_score_kernel(iq_ptr, hw_ptr, keys_ptr, out_ptr, pos_ptr, cnt_ptr, bkt_ptr, M, IH, CS, TOPK, hscale, NPT,
                     IHP: tl.constexpr, ID: tl.constexpr, BC: tl.constexpr, EXACT: tl.constexpr,
                     HIST: tl.constexpr = False, CAPB: tl.constexpr = 1, IDP: tl.constexpr = 0):
    """score[t, c] = Σ_h hw[t,h]·relu(iq[t,h]·k_c) over the rows c < (p0+t+1)//M.
    HIST (one query, more than TOPK rows visible): also count the scores' order-preserving keys
    by their top 8 bits (cnt_ptr[0, 256)) and their top 14 (cnt_ptr[256, 256 + 16384)), and put
    (key, row) in the bucket of the top 14 bits (bkt_ptr: keys [16384, CAPB], then rows; the
    first CAPB of a bucket), for topk_one_kernel, which reads them and clears the counts; the
    first program clears the start ticket and the chunk counts of its NPT programs (the last
    top-k has ended before this kernel starts; this one's top-k starts after it).
    IDP: ID padded to a power of two (0: ID is one), the pad zero in both operands."""
    t = tl.program_id(0)
    cb = tl.program_id(1)
    if HIST:
        if cb == 0:
            tl.store(cnt_ptr + TOPK_START, 0)
            for z in range(0, NPT, 1024):
                z4 = z + tl.arange(0, 1024)
                tl.store(cnt_ptr + TOPK_CHUNKS + z4, tl.zeros([1024], tl.int32), mask=z4 < NPT)
    vis = rules.visible_compressed_rows(tl.load(pos_ptr) + t, M)
    if cb * BC < vis:
        c = cb * BC + tl.arange(0, BC)
        cm = c < vis
        h = tl.arange(0, IHP)
        hm = h < IH
        d = tl.arange(0, ID if IDP == 0 else IDP)
        dm = d[None, :] < ID
        q = tl.load(iq_ptr + (t * IH + h[:, None]).to(tl.int64) * ID + d[None, :], mask=hm[:, None] & dm, other=0.0)
        k = tl.load(keys_ptr + c[:, None].to(tl.int64) * ID + d[None, :], mask=cm[:, None] & dm, other=0.0)
        s = tl.maximum(_dot_f32(q, tl.trans(k), tl.zeros([IHP, BC], tl.float32), EXACT), 0.0)  # [IHP, BC]
        hw = tl.load(hw_ptr + t * IH + h, mask=hm, other=0.0) / hscale
        sc = tl.sum(hw[:, None] * s, axis=0) + 0.0  # + 0.0: -0.0 ties +0.0 as in the reference
        tl.store(out_ptr + t.to(tl.int64) * CS + c, sc, mask=cm)
        if HIST:
            if vis > TOPK:
                key = _score_key(sc)
                # the top bytes are few distinct values (sign and exponent): counted in the
                # program first, so that a bin takes one atomic add per program
                hi = tl.histogram((key >> 24).to(tl.int32), 256, mask=cm)
                tl.atomic_add(cnt_ptr + tl.arange(0, 256), hi, mask=hi > 0, sem="relaxed")
                # a key's place in its bucket is the count before its own
                b = (key >> 18).to(tl.int32)
                slot = tl.atomic_add(cnt_ptr + 256 + b, 1, mask=cm, sem="relaxed")
                keep = cm & (slot < CAPB)
                tl.store(bkt_ptr + b * CAPB + slot, key.to(tl.int32, bitcast=True), mask=keep)
                tl.store(bkt_ptr + (16384 + b) * CAPB + slot, c, mask=keep)


@triton.jit
def _score_key(sc):
    """The order-preserving uint32 key of a float32 score (larger score, larger key)."""
    b = sc.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b ^ (-2147483648), ~b).to(tl.uint32, bitcast=True)


@triton.jit
def _keys_at(score_ptr, r, m):
    """The order-preserving keys of the scores at rows r (m: the rows to load)."""
    return _score_key(tl.load(score_ptr + r, mask=m, other=0.0))


@triton.jit
def _hist_digit(hist, need):
    """From the counts of a key digit's values (among keys that agree above it): the digit of
    the need-th largest key, need less the keys of the larger digits, and the count of that
    digit. One block-wide sum after the scan, the three packed in an int64: the digit in 9 bits,
    the keys of larger digits (fewer than need, so below 2^15 for need up to 2^15) in 15, the
    count in the rest."""
    ge = tl.cumsum(hist, 0, reverse=True)  # keys with this digit or a larger one
    at = (ge >= need) & (ge - hist < need)
    pk = tl.sum((ge >= need).to(tl.int64) + (tl.where(ge < need, hist, 0).to(tl.int64) << 9)
                + (tl.where(at, hist, 0).to(tl.int64) << 24), 0)
    return (pk & 511).to(tl.int32) - 1, need - ((pk >> 9) & 32767).to(tl.int32), (pk >> 24).to(tl.int32)


@triton.jit
def _key_to_float(U):
    """Inverse of the order-preserving float -> uint32 key (as int64 scalars)."""
    k = U - 2147483648
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.int32)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def topk_kernel(score_ptr, idx_ptr, cnt_ptr, pos_ptr, M, CS, TOPK, BC: tl.constexpr, CMAX: tl.constexpr):
    """The TOPK highest scores of a query's visible rows (ties: lower row first), as an
    increasing row list; all visible rows when there are at most TOPK. CMAX > 0: the scores fit
    in registers (one load, 32 bisection passes over registers); otherwise chunked passes."""
    t = tl.program_id(0)
    vis = rules.visible_compressed_rows(tl.load(pos_ptr) + t, M)
    out = idx_ptr + t.to(tl.int64) * TOPK
    srow = score_ptr + t.to(tl.int64) * CS
    if vis <= TOPK:
        for c0 in range(0, vis, BC):
            c = c0 + tl.arange(0, BC)
            tl.store(out + c, c, mask=c < vis)
        tl.store(cnt_ptr + t, vis)
    elif CMAX > 0:
        c = tl.arange(0, CMAX)
        cv = c < vis
        sc = tl.load(srow + c, mask=cv, other=float("-inf"))
        U = tl.full([1], 0, tl.int64)
        for bb in range(32):
            cand = U | (tl.full([1], 1, tl.int64) << (31 - bb))
            cnt = tl.sum((sc >= _key_to_float(cand)).to(tl.int32), axis=0)
            U = tl.where(cnt >= TOPK, cand, U)
        Tf = _key_to_float(U)
        gt = tl.sum((sc > Tf).to(tl.int32), axis=0)
        eq = (sc == Tf) & cv
        eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - eq.to(tl.int32)
        sel = (sc > Tf) | (eq & (eq_rank < TOPK - gt))
        where = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out + where, c, mask=sel)
        tl.store(cnt_ptr + t + tl.zeros([1], tl.int32), TOPK + tl.zeros([1], tl.int32))
    else:
        # the TOPK-th largest order-preserving key T, bit by bit from the top
        T = tl.zeros([1], tl.int64)
        for bb in range(32):
            cand = T | (tl.full([1], 1, tl.int64) << (31 - bb))
            cnt = tl.zeros([1], tl.int64)
            for c0 in range(0, vis, BC):
                c = c0 + tl.arange(0, BC)
                bits = tl.load(srow + c, mask=c < vis, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
                key = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
                cnt += tl.sum(((key >= cand) & (c < vis)).to(tl.int64), axis=0)
            T = tl.where(cnt >= TOPK, cand, T)
        gt = tl.zeros([1], tl.int64)
        for c0 in range(0, vis, BC):
            c = c0 + tl.arange(0, BC)
            bits = tl.load(srow + c, mask=c < vis, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
            key = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
            gt += tl.sum(((key > T) & (c < vis)).to(tl.int64), axis=0)
        need = TOPK - gt
        eq_seen = tl.zeros([1], tl.int64)
        n_out = tl.zeros([1], tl.int64)
        for c0 in range(0, vis, BC):
            c = c0 + tl.arange(0, BC)
            cv = c < vis
            bits = tl.load(srow + c, mask=cv, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
            key = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
            eq = (key == T) & cv
            eq_rank = eq_seen + tl.cumsum(eq.to(tl.int64), axis=0) - eq.to(tl.int64)
            sel = ((key > T) & cv) | (eq & (eq_rank < need))
            where = n_out + tl.cumsum(sel.to(tl.int64), axis=0) - 1
            tl.store(out + where, c, mask=sel)
            eq_seen += tl.sum(eq.to(tl.int64), axis=0)
            n_out += tl.sum(sel.to(tl.int64), axis=0)
        tl.store(cnt_ptr + t + tl.zeros([1], tl.int32), TOPK + tl.zeros([1], tl.int32))


@triton.jit
def _at_least(key, row, Lk, Lr):
    """(key, lower row first) at least (Lk, Lr): selected when (Lk, Lr) is the last selected."""
    return (key > Lk) | ((key == Lk) & (row <= Lr))


@triton.jit
def topk_one_kernel(score_ptr, idx_ptr, cnt_ptr, pos_ptr, kc_ptr, bkt_ptr, M, TOPK, NP,
                    CH: tl.constexpr, CAPB: tl.constexpr, LB: tl.constexpr, SB: tl.constexpr):
    """topk_kernel's selection for one query (decode) from what idx_score_kernel HIST left: the
    key counts and buckets. NP programs of CH rows each write the selected rows of one chunk.

    Each program on its own: the counts give the top 14 bits of the threshold key T (the TOPK-th
    largest) and how many keys share them; those keys are one bucket, ranked against each other
    by (key, then lower row), which gives the last selected (key, row) L. A row is selected when
    (its key, lower row first) is at least L; its place is the count of selected rows before it.
    A bucket past CAPB keys: L from bisection passes over every score instead (LB rows a pass).
    The last program to read the counts clears them for the next step.

    The rows selected before a chunk: each program publishes its chunk's count, then adds up
    those of the chunks before (SB at a time), waiting for any not yet published. A program takes
    its chunk by a start ticket, so the chunks it waits for belong to programs already running
    (never to one that waits for a free slot on the GPU behind it). The scores kernel clears the
    start ticket and the chunk counts."""
    pid = tl.program_id(0)
    vis = rules.visible_compressed_rows(tl.load(pos_ptr), M)
    if vis <= TOPK:
        c = pid * CH + tl.arange(0, CH)
        tl.store(idx_ptr + c, c, mask=c < vis)
        if pid == 0:
            tl.store(cnt_ptr, vis)
    else:
        q = pid  # (one program: no ticket, nothing before its chunk)
        if NP > 1:
            q = tl.atomic_add(kc_ptr + TOPK_START, 1, sem="relaxed")  # (awaited after the counts' loads)
        d1, need, _ = _hist_digit(tl.load(kc_ptr + tl.arange(0, 256)), TOPK)
        d2, need, n_c = _hist_digit(tl.load(kc_ptr + 256 + d1 * 64 + tl.arange(0, 64)), need)
        P = d1 * 64 + d2  # T's top 14 bits, shared by n_c keys; need of them are selected
        tl.debug_barrier()  # every thread's reads of the counts done before the end ticket
        # (release: the loads below need not wait for it; its answer is awaited last)
        ticket = tl.atomic_add(kc_ptr + TOPK_END, 1, sem="release")
        c = q * CH + tl.arange(0, CH)
        cv = c < vis
        key = _keys_at(score_ptr, c, cv)  # (in flight while L is found)
        if n_c <= CAPB:
            i = tl.arange(0, CAPB)
            im = i < n_c
            ck = tl.load(bkt_ptr + P * CAPB + i, mask=im, other=0).to(tl.uint32, bitcast=True)
            cr = tl.load(bkt_ptr + (16384 + P) * CAPB + i, mask=im, other=0)
            rank = tl.zeros([CAPB], tl.int32)
            for j0 in range(0, n_c, 32):  # the bucket's others, 32 at a time
                j = j0 + tl.arange(0, 32)
                jm = j < n_c
                kj = tl.load(bkt_ptr + P * CAPB + j, mask=jm, other=0).to(tl.uint32, bitcast=True)
                rj = tl.load(bkt_ptr + (16384 + P) * CAPB + j, mask=jm, other=0)
                beats = (kj[None, :] > ck[:, None]) | ((kj[None, :] == ck[:, None]) & (rj[None, :] < cr[:, None]))
                rank += tl.sum((beats & jm[None, :]).to(tl.int32), 1)
            # the one ranked need - 1 (a sum picks it; its key zero-extended by hand)
            last = tl.sum(tl.where(im & (rank == need - 1), ((ck.to(tl.int64) & 0xFFFFFFFF) << 32) | cr.to(tl.int64),
                                   0), 0)
            Lk = ((last >> 32) & 0xFFFFFFFF).to(tl.uint32)
            Lr = (last & 0xFFFFFFFF).to(tl.int32)
        else:
            Lk = P.to(tl.uint32) << 18
            for bb in range(18):
                cand = Lk | (tl.full([], 1, tl.uint32) << (17 - bb))
                acc = tl.zeros([LB], tl.int32)
                for c0 in range(0, vis, LB):
                    r = c0 + tl.arange(0, LB)
                    acc += ((r < vis) & (_keys_at(score_ptr, r, r < vis) >= cand)).to(tl.int32)
                Lk = tl.where(tl.sum(acc, 0) >= TOPK, cand, Lk)
            acc = tl.zeros([LB], tl.int32)
            for c0 in range(0, vis, LB):
                r = c0 + tl.arange(0, LB)
                acc += ((r < vis) & (_keys_at(score_ptr, r, r < vis) > Lk)).to(tl.int32)
            need = TOPK - tl.sum(acc, 0)  # keys equal to T to take, lowest rows first
            seen = tl.zeros([], tl.int32)
            Lr = tl.zeros([], tl.int32) - 1
            for c0 in range(0, vis, LB):
                r = c0 + tl.arange(0, LB)
                eq = ((r < vis) & (_keys_at(score_ptr, r, r < vis) == Lk)).to(tl.int32)
                Lr = tl.maximum(Lr, tl.max(tl.where((eq > 0) & (seen + tl.cumsum(eq, 0) == need), r, -1), 0))
                seen += tl.sum(eq, 0)
        sel = cv & _at_least(key, c, Lk, Lr)
        s1 = sel.to(tl.int32)
        if NP > 1:
            tl.atomic_xchg(kc_ptr + TOPK_CHUNKS + q, tl.sum(s1, 0) + 1, sem="relaxed")
        before = tl.zeros([], tl.int32)
        for b0 in range(0, q, SB):
            i = b0 + tl.arange(0, SB)
            im = i < q
            v = tl.where(im, tl.atomic_add(kc_ptr + TOPK_CHUNKS + i, 0, mask=im, sem="relaxed"), 1)
            while tl.min(v, 0) == 0:  # a chunk before not yet counted
                v = tl.where(im, tl.atomic_add(kc_ptr + TOPK_CHUNKS + i, 0, mask=im, sem="relaxed"), 1)
            before += tl.sum(v - 1, 0)
        tl.store(idx_ptr + before + tl.cumsum(s1, 0) - s1, c, mask=sel)
        if pid == 0:
            tl.store(cnt_ptr, TOPK)
        if ticket == NP - 1:  # every program has read the counts: the last clears them
            tl.atomic_add(kc_ptr + TOPK_END, 0, sem="acquire")  # (their reads before these stores)
            tl.store(kc_ptr + tl.arange(0, 256), tl.zeros([256], tl.int32))
            for z in range(0, 16384, 4096):
                tl.store(kc_ptr + 256 + z + tl.arange(0, 4096), tl.zeros([4096], tl.int32))
            tl.store(kc_ptr + TOPK_END, 0)


# ------------------------------------------------------------------------------------------------
# sink attention (§3.4 step 9)


@triton.jit
def attn_kernel(q_ptr, raw_ptr, comp_ptr, sel_ptr, cnt_ptr, pos_ptr, sink_ptr,
                mo_ptr, lo_ptr, ao_ptr,
                H, W, RAWCAP, M, TOPK, RS, qscale,
                D: tl.constexpr, HB: tl.constexpr, BR: tl.constexpr,
                COMP: tl.constexpr, SEL: tl.constexpr, SINGLE: tl.constexpr, KEXACT: tl.constexpr,
                F16: tl.constexpr = False, DP: tl.constexpr = 0):
    """Heads [hg·HB, +HB) of query t over its candidate rows [sp·RS, +RS): the raw window
    (positions max(0, p−W+1)..p, ring rows) then the visible (COMP) or selected (SEL) compressed
    rows. K = V. SINGLE: all rows in one program, sink included, normalised output; otherwise
    the running max, sum and unnormalised output of this split for attn_combine_kernel.

    F16 (needs KEXACT: cache rows that are f16 values): both products on fp16 tensor cores with
    the rows as exact fp16 operands and the other side in two fp16 terms (_hi_lo): q scaled per
    head by a power of two (_pow2_scale), the probabilities p <= 1 by 2^15, both undone exactly
    afterwards. That holds each term to 2^-22 of itself (of its head's largest q entry for q),
    as the tf32 pairs of the other path do, at twice their tensor-core rate and half their
    shared memory.

    DP: D padded to a power of two (0: D is one); the pad is zero in q and in the rows, so it
    adds nothing to a score, and is never stored."""
    t = tl.program_id(0)
    hg = tl.program_id(1)
    sp = tl.program_id(2)
    nsp = tl.num_programs(2)
    pos = tl.load(pos_ptr) + t
    lo = tl.maximum(pos - W + 1, 0)
    nraw = pos - lo + 1
    ncomp = 0
    if COMP:
        if SEL:
            ncomp = tl.load(cnt_ptr + t)
        else:
            ncomp = rules.visible_compressed_rows(pos, M)
    R = nraw + ncomp
    start = sp * RS
    end = tl.minimum(R, start + RS)
    h = hg * HB + tl.arange(0, HB)
    hm = h < H
    DA: tl.constexpr = D if DP == 0 else DP
    d = tl.arange(0, DA)
    dm = d[None, :] < D
    q = tl.load(q_ptr + (t * H + h[:, None]).to(tl.int64) * D + d[None, :], mask=hm[:, None] & dm, other=0.0)
    m_i = tl.full([HB], _NEG, tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, DA], tl.float32)
    if F16:
        q_s, q_inv = _pow2_scale(tl.max(tl.abs(q), axis=1))
        q_hi, q_lo = _hi_lo(q * q_s[:, None])
    for r0 in range(start, end, BR):
        r = r0 + tl.arange(0, BR)
        rm = r < end
        is_raw = r < nraw
        raw_row = ((lo + r) % RAWCAP).to(tl.int64)
        ci = r - nraw
        if SEL:
            crow = tl.load(sel_ptr + t.to(tl.int64) * TOPK + ci, mask=rm & (~is_raw), other=0).to(tl.int64)
        else:
            crow = ci.to(tl.int64)
        if COMP:
            rowp = tl.where(is_raw, raw_ptr + raw_row * D, comp_ptr + crow * D)
        else:
            rowp = raw_ptr + raw_row * D
        k = tl.load(rowp[:, None] + d[None, :], mask=rm[:, None] & dm, other=0.0)
        if F16:
            k16 = k.to(tl.float16)  # exact: the rows are f16 values
            s = (_dot16(q_hi, q_lo, k16, tl.zeros([HB, BR], tl.float32)) * q_inv[:, None]) / qscale
        else:
            s = _dot_f32(q, tl.trans(k), tl.zeros([HB, BR], tl.float32), KEXACT) / qscale
        s = tl.where(rm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F16:  # acc holds 2^15 times the output until the end
            p_hi, p_lo = _hi_lo(p * 32768.0)
            acc = _dot16(p_hi, p_lo, tl.trans(k16), acc * alpha[:, None])
        else:
            acc = _dot_f32(p, k, acc * alpha[:, None], KEXACT)
        m_i = m_new
    if F16:
        acc = acc * (1.0 / 32768.0)
    if SINGLE:
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
        mx = tl.maximum(m_i, sink)
        f = tl.exp(m_i - mx)
        den = l_i * f + tl.exp(sink - mx)
        o = acc * (f / den)[:, None]
        tl.store(ao_ptr + (t * H + h[:, None]).to(tl.int64) * D + d[None, :], o, mask=hm[:, None] & dm)
    else:
        pb = (t * nsp + sp) * H + h
        tl.store(mo_ptr + pb, m_i, mask=hm)
        tl.store(lo_ptr + pb, l_i, mask=hm)
        tl.store(ao_ptr + pb[:, None].to(tl.int64) * D + d[None, :], acc, mask=hm[:, None] & dm)


@triton.jit
def attn_combine_kernel(mo_ptr, lo_ptr, ao_ptr, sink_ptr, freq_ptr, pos_ptr, out_ptr, H, qw_ptr, qs_ptr, qsum_ptr,
                        S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, NROT: tl.constexpr,
                        ROPE_INV: tl.constexpr, BI: tl.constexpr, XQ8: tl.constexpr = False,
                        DEP: tl.constexpr = False):
    """Merge the S splits of one (query, head) with the sink, for the pairs [BI·program, +BI) of
    the head (grid axis 2: one program per head left most SMs idle for the few splits of a
    decode query over top-k rows); optionally the inverse tail RoPE. XQ8 (2·BI a multiple of
    32): the result also in XQ8 form (qw_ptr, qs_ptr, qsum_ptr: a token's H·D values a row), for
    the output projection's decoder 309. DEP: as matvec_xq_kernel."""
    if DEP:
        gdc_launch_dependents()
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SP)
    spm = sp < S
    pb = (t * S + sp) * H + h
    ms = tl.load(mo_ptr + pb, mask=spm, other=_NEG)
    ls = tl.load(lo_ptr + pb, mask=spm, other=0.0)
    sink = tl.load(sink_ptr + h)
    mx = tl.maximum(tl.max(ms, axis=0), sink)
    f = tl.exp(ms - mx)
    den = tl.sum(ls * f, axis=0) + tl.exp(sink - mx)
    i = tl.program_id(2) * BI + tl.arange(0, BI)
    im = i < D // 2  # (the last program's pairs past D / 2, where BI does not divide them)
    ab = ao_ptr + pb[:, None].to(tl.int64) * D + 2 * i[None, :]
    lm = spm[:, None] & im[None, :]
    xe = tl.sum(tl.load(ab, mask=lm, other=0.0) * f[:, None], axis=0) / den
    xo = tl.sum(tl.load(ab + 1, mask=lm, other=0.0) * f[:, None], axis=0) / den
    if ROPE_INV:
        k = i - (D - NROT) // 2
        km = (k >= 0) & im
        pos = tl.load(pos_ptr) + t
        theta = pos.to(tl.float32) * tl.load(freq_ptr + k, mask=km, other=0.0)
        c = _cos(theta)
        s = -_sin(theta)
        ne, no = rules.rope_rotate(xe, xo, c, s)
        ne = tl.where(km, ne, xe)
        no = tl.where(km, no, xo)
        xe = ne
        xo = no
    ob = out_ptr + (t * H + h).to(tl.int64) * D + 2 * i
    tl.store(ob, xe, mask=im)
    tl.store(ob + 1, xo, mask=im)
    if XQ8:
        NBLK: tl.constexpr = 2 * BI // 32
        hd = H * D
        v = tl.reshape(tl.join(xe, xo), [NBLK, 32])  # the values 2i, 2i + 1 in order
        _xq_store(v, qw_ptr + t * (hd // 2), qs_ptr + t * (hd // 32), qsum_ptr + t * (hd // 16),
                  (h * D + 2 * BI * tl.program_id(2)) // 32, tl.arange(0, NBLK) < NBLK, True)


# ---- greedy decoding on the device ----------------------------------------------------------------
