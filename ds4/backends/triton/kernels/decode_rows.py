"""Specialised row decoders of the decode shapes: IQ2_XXS groups (IQ2S layout), Q2_K integer
rows (Q2S layout), the MoE slot gathers, and Q8C rows on float or XQ8 activations.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _f16_lo, _iq2_blk, _iq2_signs, _ld2, _ld4, _ld_f16, _opaque, _q2_blk, _u8f
from .decode import _b2f, _dp4a, _iq2_grid_index, _iq2_lut, _join4, _q2k_unit, _split4


@triton.jit
def _iq2_group_words(wh, wf, rb, m, u, ok=True):
    """For each of the four row sets (rb, m: tuples of [BN/4, 1] first-block indices / masks) the
    words of IQ2_XXS groups u [1, NB] in IQ2S (wf: quant words, wh: scales; layout.py): (grid
    indices 0-3, signs + scale, d·(0.5 + scale)/4, a zero partial sum). A group's two words come
    in one 8-byte load (where GGUF's 66-byte blocks took four 2-byte ones); nothing is read where
    ok is false."""
    gs = ()
    for r in tl.static_range(4):
        blk = rb[r] + u // 8
        mk = m[r] & ok
        d = _ld_f16(wh, 2 * blk, mk)
        g2 = tl.load(wf.to(tl.pointer_type(tl.int64)) + _opaque(blk * 8 + u % 8), mask=mk, other=0)
        gq = g2.to(tl.int32)
        aux = (g2 >> 32).to(tl.int32)
        db = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        gs = gs + ((gq, aux, db, tl.zeros(d.shape, tl.float32)),)
    return gs


@triton.jit
def _lut16(tab, gis, NE: tl.constexpr):
    """tab[gi] for each of the 16 index tensors of the tuple gis (one shape, NE elements in all):
    one tl.gather, which goes through shared memory (the table stored once, two barriers), where
    16 calls would store it and wait 16 times. tl.join / tl.split stack and unstack them in
    registers, so the reshapes move no data."""
    a = ()
    for k in tl.static_range(8):
        a = a + (tl.join(gis[2 * k], gis[2 * k + 1]),)
    b = ()
    for k in tl.static_range(4):
        b = b + (tl.join(a[2 * k], a[2 * k + 1]),)
    d = tl.join(tl.join(b[0], b[1]), tl.join(b[2], b[3]))
    g = tl.reshape(tl.gather(tab, tl.reshape(d, [NE]), 0), d.shape)
    c0, c1 = tl.split(g)
    b = tl.split(c0) + tl.split(c1)
    a = ()
    for k in tl.static_range(4):
        a = a + tl.split(b[k])
    out = ()
    for k in tl.static_range(8):
        out = out + tl.split(a[k])
    return out


@triton.jit
def _iq2_levels_smem(gs, tab):
    """The level nibbles of the 16 grid entries of a K-step (entry sub of row set r at 4·sub + r)
    for the groups' words gs (_iq2_group_words), from the table tab in shared memory (_lut16)."""
    gis = ()
    for sub in tl.static_range(4):
        for r in tl.static_range(4):
            gis = gis + (_iq2_grid_index(gs[r][0], sub),)
    return _lut16(tab, gis, 16 * gs[0][0].shape[0] * gs[0][0].shape[1])


@triton.jit
def _iq2_group_step(xu, wh, wf, gridp, rb, m, u, tab, SMEM: tl.constexpr = False):
    """TYPE 416, one K-step: for each of the four row sets (rb, m: tuples of [BN/4, 1] first-block
    indices / masks) W·x over the 32-value IQ2_XXS groups u [1, NB]. Every x value is loaded
    once for the four rows. A grid entry's 8 level codes come as nibbles from one 4-byte lookup
    (gridp[768:1024]); its signs are computed (parity, then spread to bit 2 of each nibble), not
    looked up; one byte permute per 4 values gives the biased bytes 128 ± level (_iq2_lut) and
    _b2f the floats. (Looking up 8-byte levels and 8-byte sign masks instead, two gathers per entry
    and row, kept the L1 busy.) SMEM (TYPE 417): the 16 lookups
    of the step come from the table in shared memory (tab, _lut16), not through the L1."""
    gs = _iq2_group_words(wh, wf, rb, m, u)
    if SMEM:
        sels = _iq2_levels_smem(gs, tab)
    for sub in tl.static_range(4):
        xs = _ld4(xu + 8 * sub) + _ld4(xu + 8 * sub + 4)
        nxt = ()
        for r in tl.static_range(4):
            gq, aux, db, part = gs[r]
            if SMEM:
                lv = sels[4 * sub + r]
            else:
                lv = tl.load(gridp + 768 + _iq2_grid_index(gq, sub))
            sel = lv | _iq2_signs(aux, sub)
            for h in tl.static_range(2):
                qx = _iq2_lut(sel >> (16 * h))
                for j in tl.static_range(4):
                    part += _b2f(qx, j) * xs[4 * h + j]
            nxt = nxt + ((gq, aux, db, part),)
        gs = nxt
    return gs[0][2] * gs[0][3], gs[1][2] * gs[1][3], gs[2][2] * gs[2][3], gs[3][2] * gs[3][3]


@triton.jit
def _iq2_group_rows(xb, wh, wf, gridp, row_off, rmask, K, sk, BN: tl.constexpr, NB: tl.constexpr,
                    S: tl.constexpr, SMEM: tl.constexpr = False, xs=0, XQ: tl.constexpr = False,
                    PF: tl.constexpr = False):
    """TYPE 416 / 417 (SMEM) / 418 (XQ): W[rows]·x for IQ2_XXS rows (IQ2S: wf quant words, wh
    scales) over part sk of S of K, NB 32-value groups per K-step, four rows per thread. XQ: x in
    XQ form, xb its words and xs its block scales (an IQ2_XXS group and an XQ block are the same
    32 values). PF (with XQ): each step first issues the next step's group loads, then works on the
    ones the previous step issued (software pipelining by hand: a thread has two steps' weights in
    flight)."""
    tab = 0
    if SMEM or XQ:  # the level table, loaded once (_lut16 stores it to shared memory per K-step)
        tab = tl.load(gridp + 768 + tl.arange(0, 256))
    o0, o1, o2, o3 = _split4(_iq2_blk(row_off), BN)
    m0, m1, m2, m3 = _split4(rmask, BN)
    ro = (o0[:, None], o1[:, None], o2[:, None], o3[:, None])  # first-block indices
    m = (m0[:, None], m1[:, None], m2[:, None], m3[:, None])
    a0 = tl.zeros([BN // 4, NB], tl.float32)
    a1 = tl.zeros([BN // 4, NB], tl.float32)
    a2 = tl.zeros([BN // 4, NB], tl.float32)
    a3 = tl.zeros([BN // 4, NB], tl.float32)
    IS = K // (NB * 32) // S
    i0 = sk * IS
    if PF:  # (with XQ)
        nxt = _iq2_group_words(wh, wf, ro, m, i0 * NB + tl.arange(0, NB)[None, :])
    for i in range(i0, i0 + IS):
        u = i * NB + tl.arange(0, NB)[None, :]
        if XQ:
            if PF:
                gs = nxt
                nxt = _iq2_group_words(wh, wf, ro, m, u + NB, i + 1 < i0 + IS)
            else:
                gs = _iq2_group_words(wh, wf, ro, m, u)
            p0, p1, p2, p3 = _iq2_int_step(xb + u * 16, gs, tab)
            sx = tl.load(xs + u)
            p0, p1, p2, p3 = p0 * sx, p1 * sx, p2 * sx, p3 * sx
        else:
            p0, p1, p2, p3 = _iq2_group_step(xb + u * 32, wh, wf, gridp, ro, m, u, tab, SMEM)
        a0 += p0
        a1 += p1
        a2 += p2
        a3 += p3
    return _join4(tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1), BN)


@triton.jit
def _iq2_int_step(xw, gs, tab):
    """TYPE 418, one K-step: for each of the four row sets (as _iq2_group_step) W·x over the
    step's IQ2_XXS groups (gs), x in XQ form (xw: each group's first word). Per group and row the
    levels become signed bytes (one permute per 4 values) and meet x's hi and lo bytes in _dp4a,
    exactly in int32; one float product per group takes the scales (d·(0.5 + scale)/4 here, x's
    by the caller). Where 416 / 417 spend a byte-to-float and an FMA per value, this spends half
    a dp4a. gs: the groups' words (_iq2_group_words)."""
    sels = _iq2_levels_smem(gs, tab)
    ah = ()
    al = ()
    for r in tl.static_range(4):
        ah = ah + (tl.zeros(gs[r][0].shape, tl.int32),)
        al = al + (tl.zeros(gs[r][0].shape, tl.int32),)
    for sub in tl.static_range(4):
        h0, h1, l0, l1 = _ld4(xw + 4 * sub, True)  # hi bytes of values 0-3, 4-7, then their lo bytes
        nh = ()
        nl = ()
        for r in tl.static_range(4):
            sel = sels[4 * sub + r] | _iq2_signs(gs[r][1], sub)
            q0 = _iq2_lut(sel, True)
            q1 = _iq2_lut(sel >> 16, True)
            nh = nh + (_dp4a(q1, h1, _dp4a(q0, h0, ah[r])),)
            nl = nl + (_dp4a(q1, l1, _dp4a(q0, l0, al[r])),)
        ah = nh
        al = nl
    out = ()
    for r in tl.static_range(4):
        out = out + (gs[r][2] * (ah[r] * 256 + al[r]).to(tl.float32),)
    return out


@triton.jit
def _q2k_int_rows(xw, xs, xsum, wb, wh, wf, row_off, rmask, K, sk, BN: tl.constexpr, NB: tl.constexpr,
                  S: tl.constexpr):
    """TYPE 111: W[rows]·x for Q2_K rows over part sk of S of K, x in XQ form, NB 64-value units
    (16 quant bytes × 4 shifts, as 110) per K-step. A shift of a unit's 4 quant words is 16 values
    of one 16-value run (one scale and minimum): 4 + 4 _dp4a give Σq·hi and Σq·lo exactly, and the
    run adds d·sc·s·(256·Σq·hi + Σq·lo) − dmin·m·Σx (Σx from XQ's 16-value sums)."""
    mk = rmask[:, None]
    acc = tl.zeros([BN, NB], tl.float32)
    IS = K // (NB * 64) // S
    for i in range(sk * IS, sk * IS + IS):
        u = i * NB + tl.arange(0, NB)[None, :]
        base, h, half, d, dmin, w0, w1, w2, w3 = _q2k_unit(wh, wf, row_off, mk, u)
        for sh in tl.static_range(4):
            b32 = (u // 4) * 8 + h * 4 + sh  # x's 32-value block; the run is its half `half`
            xo = xw + b32 * 16 + half * 8
            a0, a1, a2, a3 = _ld4(xo, True)  # hi, hi, lo, lo of values 0-7 of the run
            b0, b1, b2, b3 = _ld4(xo + 4, True)  # of values 8-15
            q0 = (w0 >> (2 * sh)) & 0x03030303
            q1 = (w1 >> (2 * sh)) & 0x03030303
            q2 = (w2 >> (2 * sh)) & 0x03030303
            q3 = (w3 >> (2 * sh)) & 0x03030303
            qh = _dp4a(q3, b1, _dp4a(q2, b0, _dp4a(q1, a1, _dp4a(q0, a0, tl.zeros(q0.shape, tl.int32)))))
            ql = _dp4a(q3, b3, _dp4a(q2, b2, _dp4a(q1, a3, _dp4a(q0, a2, tl.zeros(q0.shape, tl.int32)))))
            sc = tl.load(wb + base + 8 * h + 2 * sh + half, mask=mk, other=0).to(tl.int32)
            sx = tl.load(xs + b32)
            sm = tl.load(xsum + b32 * 2 + half)
            acc += (d * sx) * (sc & 15).to(tl.float32) * (qh * 256 + ql).to(tl.float32) - \
                (dmin * sm) * (sc >> 4).to(tl.float32)
    return tl.sum(acc, axis=1)


@triton.jit
def _q2s_half_words(wb, wh, wf, B, h):
    """The words of half h (values 128h .. 128h + 127) of Q2_K blocks B in Q2S (layout.py), for
    decoder 113: its 8 quant words (two 16-byte loads; word 4·half + i holds, at bits 2·sh of
    byte b, the value 128h + 32·sh + 16·half + 4i + b), its 8 scale bytes (sub-blocks 8h .. 8h + 7
    in one 8-byte load: sub-block 8h + 2·sh + half is byte 2·sh + half), and d, dmin. Loads
    without masks: B must be a block of the tensor."""
    qa0, qa1, qa2, qa3 = _ld4(wf + B * 16 + h * 8, True)
    qb0, qb1, qb2, qb3 = _ld4(wf + B * 16 + h * 8 + 4, True)
    s0, s1 = _ld2(wb.to(tl.pointer_type(tl.int32)) + B * 4 + h * 2)
    dd = tl.load(wh.to(tl.pointer_type(tl.int32)) + B)  # f16 d in the low half, f16 dmin in the high
    d = _f16_lo(dd)
    dmin = _f16_lo(dd >> 16)
    return (qa0, qa1, qa2, qa3), (qb0, qb1, qb2, qb3), (s0, s1), d, dmin


@triton.jit
def _q2s_half_x(xw, xs, xsum, b0):
    """x in XQ form for the halves whose first 32-value block is b0 (their four blocks are the
    four shifts): per shift and run, the words of its 16 values (hi, hi, lo, lo of values 0-7, then
    of values 8-15: two 16-byte loads), the 4 block scales (one 16-byte load) and the 8 16-value
    sums (two)."""
    xq = ()
    for sh in tl.static_range(4):
        for half in tl.static_range(2):
            xq = xq + (_ld4(xw + (b0 + sh) * 16 + half * 8, True) + _ld4(xw + (b0 + sh) * 16 + half * 8 + 4, True),)
    sx = _ld4(xs + b0)
    sm = _ld4(xsum + b0 * 2) + _ld4(xsum + b0 * 2 + 4)
    return xq, sx, sm


@triton.jit
def _q2s_half_dot(ws, xh, acc):
    """acc + one half of Q2_K blocks (ws, from _q2s_half_words) · x (xh, from _q2s_half_x). Per
    shift: the 16 values of each of the two runs meet x's hi and lo bytes in 4 + 4 _dp4a
    (Σq·(256·hi + lo) exactly in int32), the two runs' sums take their scales sc in int32, and the
    shift adds d·s·Σ sc·q·(256·hi + lo) − dmin·Σ m·(s·Σq over the run) (one int-to-float per 32
    values; past 2^24 that conversion rounds, to 2^-24 of the shift's sum)."""
    qa, qb, sw, d, dmin = ws
    xq, sx, sm = xh
    for sh in tl.static_range(4):
        scw = sw[sh // 2]
        iq = tl.zeros(d.shape, tl.int32)
        for half in tl.static_range(2):
            if half == 0:
                qw = qa
            else:
                qw = qb
            a0, a1, a2, a3, c0, c1, c2, c3 = xq[2 * sh + half]
            q0 = (qw[0] >> (2 * sh)) & 0x03030303
            q1 = (qw[1] >> (2 * sh)) & 0x03030303
            q2 = (qw[2] >> (2 * sh)) & 0x03030303
            q3 = (qw[3] >> (2 * sh)) & 0x03030303
            qh = _dp4a(q3, c1, _dp4a(q2, c0, _dp4a(q1, a1, _dp4a(q0, a0, tl.zeros(q0.shape, tl.int32)))))
            qhl = _dp4a(q3, c3, _dp4a(q2, c2, _dp4a(q1, a3, _dp4a(q0, a2, qh * 256))))
            sc = (scw >> (8 * (2 * (sh % 2) + half))) & 255
            iq += qhl * (sc & 15)
            acc -= (dmin * sm[2 * sh + half]) * _u8f(sc >> 4)
        acc += (d * sx[sh]) * iq.to(tl.float32)
    return acc


@triton.jit
def _q2s_slots(ids_ptr, t, hw_ptr, hs_ptr, hsum_ptr, wb, wh, wf, rows, rmask, F, RB, EXP_BYTES, sk,
               KSLOTS: tl.constexpr, BN: tl.constexpr, NH: tl.constexpr, R: tl.constexpr, IS: tl.constexpr):
    """TYPE 113: Σ_j down_{ids[t, j]}[rows]·h[t·KSLOTS + j] for Q2_K experts in Q2S (layout.py)
    over part sk of F (IS K-steps a part), h in XQ form. A tile element is one 128-value half of
    a block of R rows (R rows per thread share the loads of h), NH halves per K-step: per row, two
    16-byte loads of quant words, one 8-byte load of the half's 8 scales and one word of (d, dmin),
    where 110 / 111 on GGUF's 84-byte blocks took four word loads, a load per scale byte and two
    for d, dmin. The tile is [BN / R, NH], a warp's lanes along the halves of a row; the slots
    add into it, and it is reduced over the halves once at the end (a reduction per slot, with
    its layout conversions through shared memory, was slower, and so were lanes along rows
    sharing each load of h).
    Each slot's weights are loaded before the slot before it computes, and the code has no loops
    (IS is a constexpr): a loop counted at run time was slower. Rows past the
    tensor read the expert's first row."""
    rsel = tl.where(rmask, rows, 0).to(tl.int64) * RB
    es = ()
    for j in tl.static_range(KSLOTS):
        es = es + (tl.load(ids_ptr + t * KSLOTS + j).to(tl.int64),)
    acc = ()
    for r in tl.static_range(R):
        acc = acc + (tl.zeros([BN // R, NH], tl.float32),)
    for i in tl.static_range(IS):
        g = (sk * IS + i) * NH + tl.arange(0, NH)[None, :]  # half index in the row
        bb = g // 2
        h = g % 2
        wn = _q2s_slot_words(wb, wh, wf, es[0] * EXP_BYTES + rsel, bb, h, R)
        for j in tl.static_range(KSLOTS):
            ws = wn
            if j + 1 < KSLOTS:
                wn = _q2s_slot_words(wb, wh, wf, es[j + 1] * EXP_BYTES + rsel, bb, h, R)
            s = t * KSLOTS + j
            xh = _q2s_half_x(hw_ptr + s * (F // 2), hs_ptr + s * (F // 32), hsum_ptr + s * (F // 16), bb * 8 + h * 4)
            out = ()
            for r in tl.static_range(R):
                out = out + (_q2s_half_dot(ws[r], xh, acc[r]),)
            acc = out
    ys = ()
    for r in tl.static_range(R):
        ys = ys + (tl.sum(acc[r], axis=1),)
    return _row_join(ys, R, BN)


@triton.jit
def _q2s_slot_words(wb, wh, wf, row_off, bb, h, R: tl.constexpr):
    """_q2s_half_words of halves (bb, h) [1, NH] for each of the R row sets of the rows at GGUF
    byte offsets row_off [BN]."""
    BN: tl.constexpr = row_off.shape[0]
    rs = _row_sets(_q2_blk(row_off), R)
    ws = ()
    for r in tl.static_range(R):
        ws = ws + (_q2s_half_words(wb, wh, wf, tl.reshape(rs[r], [BN // R, 1]) + bb, h),)
    return ws


@triton.jit
def _row_sets(v, R: tl.constexpr):
    """[BN] -> a tuple of R row sets [BN/R, 1, 1, 1] (R = 1, 2, 4 or 8): a thread holds one row of
    each, so what it loads once (x) serves R rows. _row_join is the inverse."""
    BN: tl.constexpr = v.shape[0]
    if R == 8:
        a, b = tl.split(tl.reshape(v, [BN // 2, 2]))
        a0, a1, a2, a3 = _split4(a, BN // 2)
        b0, b1, b2, b3 = _split4(b, BN // 2)
        return (a0[:, None, None, None], a1[:, None, None, None], a2[:, None, None, None], a3[:, None, None, None],
                b0[:, None, None, None], b1[:, None, None, None], b2[:, None, None, None], b3[:, None, None, None])
    elif R == 4:
        v0, v1, v2, v3 = _split4(v, BN)
        return v0[:, None, None, None], v1[:, None, None, None], v2[:, None, None, None], v3[:, None, None, None]
    elif R == 2:
        v0, v1 = tl.split(tl.reshape(v, [BN // 2, 2]))
        return v0[:, None, None, None], v1[:, None, None, None]
    else:
        return (v[:, None, None, None],)


@triton.jit
def _row_join(ys, R: tl.constexpr, BN: tl.constexpr):
    if R == 8:
        a = _join4(ys[0], ys[1], ys[2], ys[3], BN // 2)
        b = _join4(ys[4], ys[5], ys[6], ys[7], BN // 2)
        return tl.reshape(tl.join(a, b), [BN])
    elif R == 4:
        return _join4(ys[0], ys[1], ys[2], ys[3], BN)
    elif R == 2:
        return tl.reshape(tl.join(ys[0], ys[1]), [BN])
    else:
        return ys[0]


@triton.jit
def _q8c_rows(xb, ww, wh, row_off, rmask, K, sk, rs, nw_ptr, BN: tl.constexpr, NC: tl.constexpr,
              R: tl.constexpr, NORM: tl.constexpr, S: tl.constexpr):
    """TYPE 308: W[rows]·x̂ for Q8C rows over part sk of S of K, NC 256-value chunks per K-step,
    R rows per thread. A step's tile is [rows, chunk, block, word] int32 (a chunk's 64 quant words
    are contiguous: 16-byte loads); byte j of every word meets x at 8j + w, a contiguous slice of
    x loaded once for the R rows; each word's 4 values become floats by _b2f (the bytes are
    already biased by 128) and its sum takes the block scale. Returns (W·x, Σ x² of the x values
    it loaded; with the norm fused and K whole, S = 1, that is all of x, once: _mv_rows)."""
    ro = _row_sets(tl.multiple_of(row_off // 4, 4), R)  # in words (rows start on 16 bytes)
    m = _row_sets(rmask, R)
    c = tl.arange(0, NC)[None, :, None, None]
    b = tl.arange(0, 8)[None, None, :, None]
    w = tl.arange(0, 8)[None, None, None, :]
    xo = c * 256 + b * 32 + w  # x of byte 0 of each word
    acc = ()
    for r in tl.static_range(R):
        acc = acc + (tl.zeros([BN // R, NC, 8, 8], tl.float32),)
    ssv = tl.zeros([1, NC, 8, 8], tl.float32)
    IS = K // (256 * NC) // S
    for i in range(sk * IS, sk * IS + IS):
        c0 = i * NC
        ws = ()
        for r in tl.static_range(R):
            ws = ws + (tl.load(ww + ro[r] + (c0 + c) * 68 + 4 + b * 8 + w, mask=m[r], other=0),)
        ps = ()
        for r in tl.static_range(R):
            ps = ps + (tl.zeros([BN // R, NC, 8, 8], tl.float32),)
        for j in tl.static_range(4):
            xv = tl.load(xb + c0 * 256 + xo + 8 * j)
            if NORM != 0 and S == 1:
                ssv += xv * xv
            elif NORM != 0:
                xv = xv / rs
            if NORM == 1:
                xv = xv * tl.load(nw_ptr + c0 * 256 + xo + 8 * j)
            nps = ()
            for r in tl.static_range(R):
                nps = nps + (ps[r] + _b2f(ws[r], j) * xv,)
            ps = nps
        nacc = ()
        for r in tl.static_range(R):
            d = tl.load(wh + ro[r] * 2 + (c0 + c) * 136 + b, mask=m[r], other=0).to(tl.float16, bitcast=True)
            nacc = nacc + (acc[r] + ps[r] * d.to(tl.float32),)
        acc = nacc
    ys = ()
    for r in tl.static_range(R):
        ys = ys + (tl.sum(tl.sum(tl.sum(acc[r], axis=3), axis=2), axis=1),)
    return _row_join(ys, R, BN), tl.sum(ssv)
