"""Attention: the KV store, the compressor (pool / update), the sparse attention kernel and its
combine (the indexer's scores and top-k: indexer.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .common import _NEG, _cache_rows, _dot16, _dot_f32, _f16_round, _hi_lo, _pow2_scale, _qat_rows, _tail_rope
from .decode import _xq_store
from .rules import rules


@triton.jit
def kv_store_kernel(kv_ptr, raw_ptr, pos_ptr, RAWCAP, D: tl.constexpr, NN: tl.constexpr, DS4: tl.constexpr,
                    DP: tl.constexpr):
    """Push K=V rows into the raw ring at (p0 + t) % RAWCAP, FP8-simulated and f16-rounded (ds4;
    the ring may be float16, the store's cast then exact). DP: D padded to a power of two, the
    pad masked."""
    t = tl.program_id(0)
    c = tl.arange(0, DP)[None, :]
    cm = c < D
    x = tl.load(kv_ptr + t.to(tl.int64) * D + c, mask=cm, other=0.0)
    if DS4:
        x = _cache_rows(x, NN)
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
        ne, no = _tail_rope(xe, xo, i[None, :], im[None, :], w * M, freq_ptr, D, NROT, False)
        y = tl.reshape(tl.join(ne, no), [1, 2 * HD])
        if MODE == 1:
            y = _cache_rows(y, D - NROT)
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
# sink attention (§3.4 step 9)


@triton.jit
def attn_kernel(q_ptr, raw_ptr, comp_ptr, sel_ptr, cnt_ptr, pos_ptr, sink_ptr,
                mo_ptr, lo_ptr, ao_ptr,
                H, W, RAWCAP, M, TOPK, RS, qscale, freq_ptr, eps,
                D: tl.constexpr, HB: tl.constexpr, BR: tl.constexpr,
                COMP: tl.constexpr, SEL: tl.constexpr, SINGLE: tl.constexpr, KEXACT: tl.constexpr,
                F16: tl.constexpr = False, DP: tl.constexpr = 0, NROT: tl.constexpr = 0,
                Q_ROPE: tl.constexpr = False, ROPE_INV: tl.constexpr = False):
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
    adds nothing to a score, and is never stored.

    Q_ROPE: q_ptr holds the query before its per-head RMSNorm and tail RoPE (freq_ptr, NROT),
    which the program applies as it loads q, as rope_kernel would; ROPE_INV (SINGLE): the output
    takes the inverse tail RoPE before it is stored. A prefill chunk's query and output then make
    no trip through memory of their own (each is n·H·D floats, read and written once more by a
    rope_kernel launch)."""
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
    if Q_ROPE:
        i = tl.arange(0, DA // 2)
        im = i < D // 2
        j = tl.arange(0, 2)
        pr = (t * H + h[:, None, None]).to(tl.int64) * D + 2 * i[None, :, None] + j[None, None, :]
        qe, qo = tl.split(tl.load(q_ptr + pr, mask=(hm[:, None] & im[None, :])[:, :, None], other=0.0))
        rs = tl.sqrt_rn((tl.sum(qe * qe, axis=1) + tl.sum(qo * qo, axis=1)) / D + eps)[:, None]
        qe, qo = _tail_rope(qe / rs, qo / rs, i[None, :], im[None, :], pos, freq_ptr, D, NROT, False)
        q = tl.reshape(tl.join(qe, qo), [HB, DA])
    else:
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
        k = tl.load(rowp[:, None] + d[None, :], mask=rm[:, None] & dm, other=0.0)  # (float16 or float32 rows)
        if F16:
            k16 = k.to(tl.float16)  # exact: the rows are f16 values
            s = (_dot16(q_hi, q_lo, k16, tl.zeros([HB, BR], tl.float32)) * q_inv[:, None]) / qscale
        else:
            k = k.to(tl.float32)
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
        if ROPE_INV:
            i = tl.arange(0, DA // 2)
            oe, oo = tl.split(tl.reshape(o, [HB, DA // 2, 2]))
            oe, oo = _tail_rope(oe, oo, i[None, :], (i < D // 2)[None, :], pos, freq_ptr, D, NROT, True)
            o = tl.reshape(tl.join(oe, oo), [HB, DA])
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
    the output projection's decoder 309. DEP: as matvec_xq_kernel. Each split's pairs are loaded
    (and the result stored) as [pairs, 2] and split in registers: loading the even and the odd
    values apart fetched every sector twice."""
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
    j = tl.arange(0, 2)
    v = tl.load(ab[:, :, None] + j[None, None, :], mask=lm[:, :, None], other=0.0)  # [SP, BI, 2]
    xe, xo = tl.split(tl.sum(v * f[:, None, None], axis=0) / den)
    if ROPE_INV:
        xe, xo = _tail_rope(xe, xo, i, im, tl.load(pos_ptr) + t, freq_ptr, D, NROT, True)
    ob = out_ptr + (t * H + h).to(tl.int64) * D + 2 * i
    tl.store(ob[:, None] + j[None, :], tl.join(xe, xo), mask=im[:, None])
    if XQ8:
        NBLK: tl.constexpr = 2 * BI // 32
        hd = H * D
        v = tl.reshape(tl.join(xe, xo), [NBLK, 32])  # the values 2i, 2i + 1 in order
        _xq_store(v, qw_ptr + t * (hd // 2), qs_ptr + t * (hd // 32), qsum_ptr + t * (hd // 16),
                  (h * D + 2 * BI * tl.program_id(2)) // 32, tl.arange(0, NBLK) < NBLK, True)


# ---- greedy decoding on the device ----------------------------------------------------------------
