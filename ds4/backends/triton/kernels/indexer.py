"""The indexer (§3.6): each query's scores of the compressed rows it sees, and the top-k
selection of rows from them (one program per query, or several programs for one query from the
key counts and buckets the scores kernel leaves).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _INTERP, _dot_f32
from .rules import rules


# The one-query top-k's counts (idx_score_kernel's cnt_ptr, topk_one_kernel's kc_ptr): keys by
# their top 8 bits [0, TOPK_DIGIT_BINS), by their top 14 bits (a bucket each) [TOPK_DIGIT_BINS,
# + TOPK_BUCKETS), then the top-k programs' start and end tickets, then each chunk's selected-row
# count plus one (0: not yet known). A bucket's top 14 bits are the first digit's 8, then a
# second digit of 6 (TOPK_DIGIT2_BINS values); TOPK_BUCKET_SHIFT key bits lie below them.
TOPK_DIGIT_BINS = tl.constexpr(256)
TOPK_DIGIT2_BINS = tl.constexpr(64)
TOPK_BUCKETS = tl.constexpr(TOPK_DIGIT_BINS.value * TOPK_DIGIT2_BINS.value)
TOPK_BUCKET_SHIFT = tl.constexpr(18)
TOPK_START = tl.constexpr(TOPK_DIGIT_BINS.value + TOPK_BUCKETS.value)
TOPK_END = tl.constexpr(TOPK_START.value + 1)
TOPK_CHUNKS = tl.constexpr(TOPK_START.value + 2)


@triton.jit
def idx_score_kernel(iq_ptr, hw_ptr, keys_ptr, out_ptr, pos_ptr, cnt_ptr, bkt_ptr, M, IH, CS, TOPK, hscale, NPT,
                     IHP: tl.constexpr, ID: tl.constexpr, BC: tl.constexpr, EXACT: tl.constexpr,
                     HIST: tl.constexpr = False, CAPB: tl.constexpr = 1, IDP: tl.constexpr = 0,
                     KB16: tl.constexpr = False):
    """score[t, c] = Σ_h hw[t,h]·relu(iq[t,h]·k_c) over the rows c < (p0+t+1)//M.
    HIST (one query, more than TOPK rows visible): also count the scores' order-preserving keys
    by their top 8 bits and their top 14 in cnt_ptr (the layout above), and put (key, row) in
    the bucket of the top 14 bits (bkt_ptr: keys [TOPK_BUCKETS, CAPB], then rows; the
    first CAPB of a bucket), for topk_one_kernel, which reads them and clears the counts; the
    first program clears the start ticket and the chunk counts of its NPT programs (the last
    top-k has ended before this kernel starts; this one's top-k starts after it).
    IDP: ID padded to a power of two (0: ID is one), the pad zero in both operands.
    KB16: the rows are bfloat16 and the queries exact in it (numerics "ds4": QAT values of at most
    3 significant bits), so one bf16 product is exact per term, summed in float32 as the tf32
    pair sums it (the interpreter: its float32 product, as its bf16 one is unusable)."""
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
        s0 = tl.zeros([IHP, BC], tl.float32)
        if KB16 and not _INTERP:
            s = tl.dot(q.to(tl.bfloat16), tl.trans(k), s0)
        elif KB16:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), s0, input_precision="ieee")
        else:
            s = _dot_f32(q, tl.trans(k), s0, EXACT)
        s = tl.maximum(s, 0.0)  # [IHP, BC]
        hw = tl.load(hw_ptr + t * IH + h, mask=hm, other=0.0) / hscale
        sc = tl.sum(hw[:, None] * s, axis=0) + 0.0  # + 0.0: -0.0 ties +0.0 as in the reference
        tl.store(out_ptr + t.to(tl.int64) * CS + c, sc, mask=cm)
        if HIST:
            if vis > TOPK:
                key = _score_key(sc)
                # the top bytes are few distinct values (sign and exponent): counted in the
                # program first, so that a bin takes one atomic add per program
                hi = tl.histogram((key >> 24).to(tl.int32), TOPK_DIGIT_BINS, mask=cm)
                tl.atomic_add(cnt_ptr + tl.arange(0, TOPK_DIGIT_BINS), hi, mask=hi > 0, sem="relaxed")
                # a key's place in its bucket is the count before its own
                b = (key >> TOPK_BUCKET_SHIFT).to(tl.int32)
                slot = tl.atomic_add(cnt_ptr + TOPK_DIGIT_BINS + b, 1, mask=cm, sem="relaxed")
                keep = cm & (slot < CAPB)
                tl.store(bkt_ptr + b * CAPB + slot, key.to(tl.int32, bitcast=True), mask=keep)
                tl.store(bkt_ptr + (TOPK_BUCKETS + b) * CAPB + slot, c, mask=keep)


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
                key = _keys_at(srow, c, c < vis).to(tl.int64)
                cnt += tl.sum(((key >= cand) & (c < vis)).to(tl.int64), axis=0)
            T = tl.where(cnt >= TOPK, cand, T)
        gt = tl.zeros([1], tl.int64)
        for c0 in range(0, vis, BC):
            c = c0 + tl.arange(0, BC)
            key = _keys_at(srow, c, c < vis).to(tl.int64)
            gt += tl.sum(((key > T) & (c < vis)).to(tl.int64), axis=0)
        need = TOPK - gt
        eq_seen = tl.zeros([1], tl.int64)
        n_out = tl.zeros([1], tl.int64)
        for c0 in range(0, vis, BC):
            c = c0 + tl.arange(0, BC)
            cv = c < vis
            key = _keys_at(srow, c, cv).to(tl.int64)
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
        d1, need, _ = _hist_digit(tl.load(kc_ptr + tl.arange(0, TOPK_DIGIT_BINS)), TOPK)
        d2, need, n_c = _hist_digit(tl.load(kc_ptr + TOPK_DIGIT_BINS + d1 * TOPK_DIGIT2_BINS
                                             + tl.arange(0, TOPK_DIGIT2_BINS)), need)
        P = d1 * TOPK_DIGIT2_BINS + d2  # T's top 14 bits, shared by n_c keys; need of them are selected
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
            cr = tl.load(bkt_ptr + (TOPK_BUCKETS + P) * CAPB + i, mask=im, other=0)
            rank = tl.zeros([CAPB], tl.int32)
            for j0 in range(0, n_c, 32):  # the bucket's others, 32 at a time
                j = j0 + tl.arange(0, 32)
                jm = j < n_c
                kj = tl.load(bkt_ptr + P * CAPB + j, mask=jm, other=0).to(tl.uint32, bitcast=True)
                rj = tl.load(bkt_ptr + (TOPK_BUCKETS + P) * CAPB + j, mask=jm, other=0)
                beats = (kj[None, :] > ck[:, None]) | ((kj[None, :] == ck[:, None]) & (rj[None, :] < cr[:, None]))
                rank += tl.sum((beats & jm[None, :]).to(tl.int32), 1)
            # the one ranked need - 1 (a sum picks it; its key zero-extended by hand)
            last = tl.sum(tl.where(im & (rank == need - 1), ((ck.to(tl.int64) & 0xFFFFFFFF) << 32) | cr.to(tl.int64),
                                   0), 0)
            Lk = ((last >> 32) & 0xFFFFFFFF).to(tl.uint32)
            Lr = (last & 0xFFFFFFFF).to(tl.int32)
        else:
            Lk = P.to(tl.uint32) << TOPK_BUCKET_SHIFT
            for bb in range(TOPK_BUCKET_SHIFT):
                cand = Lk | (tl.full([], 1, tl.uint32) << (TOPK_BUCKET_SHIFT - 1 - bb))
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
            tl.store(kc_ptr + tl.arange(0, TOPK_DIGIT_BINS), tl.zeros([TOPK_DIGIT_BINS], tl.int32))
            for z in range(0, TOPK_BUCKETS, 4096):
                tl.store(kc_ptr + TOPK_DIGIT_BINS + z + tl.arange(0, 4096), tl.zeros([4096], tl.int32))
            tl.store(kc_ptr + TOPK_END, 0)
