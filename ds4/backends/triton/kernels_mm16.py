"""Prefill products as exact integers on fp16 tensor cores: the routed experts (IQ2_XXS gate/up,
Q2_K down).

The expert weights are block formats whose values are small integers times a few float scales.
Regrouped so that one float scale covers a whole 256-value super-block of a row, the integers stay
exact in fp16 (11 significant bits):

* IQ2_XXS: W = d·(0.5 + ls)·0.25·level·sign = d/8 · q with q = (2·ls + 1)·level·sign,
  |q| <= 31·43 = 1333 < 2^11; one scale d/8 per (row, super-block).
* Q2_K: W = d·sc·q − dmin·m per 16-value sub-block, so W·x = d·Σ (sc·q)·x − dmin·Σ_s m_s·X_s with
  X_s the sum of x over sub-block s: a K = 256 product of the integers sc·q <= 45 and a K = 16
  product of the integers m <= 15 with the sub-block sums (1/16 of the K = 256 work).

The activations are split once per chunk (split16_kernel): each token row is scaled per 256-value
chunk by a power of two s with max|x·s| < 2^15, and x·s = hi + lo in two fp16 terms, which holds x
to 2^-22 of each value (2^-38 of the chunk's largest below fp16's normal range). fp16 products are
exact (11 × 11 bits) and accumulate in float32, so each super-block's (hi + lo)·qᵀ has float32
accuracy; the tensor cores accumulate it over the super-block's 256 values (K-steps of KS) and
the float scales d / s are applied to the [BM, BN] partial sum once per super-block. Under the
"f16" prefill precision (LO False) the kernels take hi alone: x·s rounded once to fp16, half the
tensor-core products.

Each program decodes the [BN, KS] integer tiles of a super-block once and reuses them for its BM
assignments. The decoders are built from tl.join, so the 32 values a thread decodes (one IQ2_XXS
group, one Q2_K run) are contiguous in K and leave the registers as 16-byte stores into the
tensor cores' shared-memory tile, in a column order free of bank conflicts (_tile_k). Rows past
the weight's end decode its last row again, so no weight load needs a mask. On the GPU the
integers reach fp16 through byte permutes and fp16x2 fused multiply-adds in inline PTX
(_u8x4_f16, _iq2_lut): about one instruction a value where float32 arithmetic and conversions
took four; the interpreter evaluates the same steps with integer and float32 operations. The
kernels run unpipelined (num_stages=1): the pipeliner would stage the decoders' table lookups
through shared memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels.common import _INTERP, _dot16, _f16_lo, _hi_lo, _iq2_signs, _ld4, _ld_f16, _opaque, _pow2_scale, _swiglu, _u8f
from .kernels.decode import _iq2_grid_index, _iq2_lut

_Q2_FIELDS = tl.constexpr(0x03030303)  # the low 2-bit field of each byte
# the K bits that trade places in a 128-wide tile's columns (_tile_k) and their distance
_TILE_BIT_A = tl.constexpr(16)
_TILE_BIT_B = tl.constexpr(64)
_TILE_BIT_GAP = tl.constexpr(2)


# ------------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _h2(v):
    """v (float32, exact in fp16) as the bits of the fp16 pair (v, v)."""
    b = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _u8x4_f16(w, mul, OFFSET: tl.constexpr):
    """The 4 bytes of w, unsigned integers u that stand for u − OFFSET, as the 4 fp16 values
    mul·(u − OFFSET), exactly (mul and the results small integers: |mul·(u − OFFSET)| < 2^11).

    On the GPU, two instructions per pair of values: a byte permute puts u under the exponent
    bits of 1024 (0x64: fp16 1024 + u, exact for u < 1024), and one fused fp16x2 multiply-add
    with −(1024 + OFFSET)·mul (exact in fp16 for the scales here) leaves mul·(u − OFFSET) with a
    single rounding of an exact integer. The interpreter evaluates the same values in float32."""
    if _INTERP:
        off = mul * -OFFSET
        return ((w & 0xFF).to(tl.float32) * mul + off).to(tl.float16), \
            (((w >> 8) & 0xFF).to(tl.float32) * mul + off).to(tl.float16), \
            (((w >> 16) & 0xFF).to(tl.float32) * mul + off).to(tl.float16), \
            (((w >> 24) & 0xFF).to(tl.float32) * mul + off).to(tl.float16)
    else:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, e;
            mov.b32 e, 0x64646464;
            prmt.b32 t0, $4, e, 0x4140;
            prmt.b32 t1, $4, e, 0x4342;
            fma.rn.f16x2 t0, t0, $5, $6;
            fma.rn.f16x2 t1, t1, $5, $6;
            mov.b32 {$0, $1}, t0;
            mov.b32 {$2, $3}, t1;
            }""",
            "=h,=h,=h,=h,r,r,r", [w, _h2(mul), _h2(mul * -(1024.0 + OFFSET))],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def _join4(a, b, c, d):
    """[..., 2, 2] holding a, b, c, d in row-major order of the two new (in-thread) axes."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """[..., 2, 2, 2] holding v0..v7 in row-major order of the three new (in-thread) axes."""
    return tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))


@triton.jit
def _tile_k(KS: tl.constexpr):
    """The K offset (inside the K-step) of each column of a [BN, KS] integer tile, [KS] int32.

    A thread decodes 32 values contiguous in K (an IQ2_XXS group, a Q2_K run) and stores them as
    four 16-byte chunks; lanes 0-3 of a warp hold the K-step's four groups, lanes 4-7 the next
    row. With KS = 128 the tile's rows are two 128-byte swizzle blocks (columns 0-63, 64-127),
    and the 128-byte swizzle moves a chunk by the row's low bits only: groups g and g + 2 of a
    row then fall on the same banks in the same store, a 2-way conflict in every quarter-warp.
    So at KS = 128 the tile's columns hold K with bits 4 and 6 swapped (_TILE_BIT_A / _B): group
    bit 1 moves inside the swizzle block, and a quarter-warp's eight 16-byte chunks (groups 0-3,
    two rows) cover the eight bank groups. x is loaded in the same column order, so the product
    is unchanged; other K-steps keep K in order."""
    c = tl.arange(0, KS)
    if KS == 128:
        c = (c & ~(_TILE_BIT_A | _TILE_BIT_B)) | ((c & _TILE_BIT_A) << _TILE_BIT_GAP) \
            | ((c & _TILE_BIT_B) >> _TILE_BIT_GAP)
        c = tl.max_contiguous(tl.multiple_of(c, _TILE_BIT_A), _TILE_BIT_A)  # runs of 16 in K
    return c


@triton.jit
def _tile_order(q, BN: tl.constexpr, NG: tl.constexpr):
    """[BN, NG, 2, 2, 2, 2, 2] (group or run g, then the 5 bits of a value's place in it, top
    first) -> the [BN, 32·NG] tile, columns in _tile_k's order: at NG = 4 the place's top bit
    (K bit 4) and g's top bit (K bit 6) trade places."""
    if NG == 4:
        q = tl.reshape(q, [BN, 2, 2, 2, 2, 2, 2, 2])  # [BN, g1, g0, v4, v3, v2, v1, v0]
        q = tl.permute(q, (0, 3, 2, 1, 4, 5, 6, 7))  # [BN, v4, g0, g1, v3, v2, v1, v0]
    return tl.reshape(q, [BN, 32 * NG])


# ------------------------------------------------------------------------------------------------
# activations


@triton.jit
def _split_chunk(x_ptr, sx, R, BR: tl.constexpr):
    """A split kernel's block of x [R, K] (row stride sx): rows [BR·program 0, +BR) of the
    256-value chunk c = program 1 -> (the rows as int64, their mask, c, the chunk's K offsets,
    the values [BR, 256], zero past row R)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < R
    c = tl.program_id(1)
    k = c * 256 + tl.arange(0, 256)
    r64 = r.to(tl.int64)
    return r64, rm, c, k, tl.load(x_ptr + r64[:, None] * sx + k[None, :], mask=rm[:, None], other=0.0)


@triton.jit
def split16_kernel(x_ptr, sx, xh_ptr, xl_ptr, xi_ptr, gh_ptr, gl_ptr, R, K,
                   BR: tl.constexpr, SUMS: tl.constexpr, LO: tl.constexpr = True):
    """Rows [BR·program, +BR) and chunk c = program 1 of x [R, K] (row stride sx):
    xh, xl [R, K] fp16 with x·s ≈ xh + xl (_hi_lo: to 2^-22 of each value, 2^-39 of the chunk's
    max at least), xi [R, K/256] = 1/s.
    SUMS: also the 16-value sums of x·s, divided by 16 (so they stay below 2^15), as gh + gl
    [R, K/16] fp16: the Q2_K min term multiplies them. LO False: xh (and gh) alone, x·s rounded
    once to fp16 (the "f16" prefill precision); xl and gl are not written."""
    r64, rm, c, k, x = _split_chunk(x_ptr, sx, R, BR)
    s, inv = _pow2_scale(tl.max(tl.abs(x), axis=1))
    xs = x * s[:, None]  # exact: a power of two
    hi, lo = _hi_lo(xs)
    o = r64[:, None] * K + k[None, :]
    tl.store(xh_ptr + o, hi, mask=rm[:, None])
    if LO:
        tl.store(xl_ptr + o, lo, mask=rm[:, None])
    tl.store(xi_ptr + r64 * (K // 256) + c, inv, mask=rm)
    if SUMS:
        g = tl.sum(tl.reshape(xs, [BR, 16, 16]), axis=2) * 0.0625
        g_hi, g_lo = _hi_lo(g)
        og = r64[:, None] * (K // 16) + c * 16 + tl.arange(0, 16)[None, :]
        tl.store(gh_ptr + og, g_hi, mask=rm[:, None])
        if LO:
            tl.store(gl_ptr + og, g_lo, mask=rm[:, None])


# ------------------------------------------------------------------------------------------------
# decoders: [BN, KS] integer tiles (fp16) of KS values inside one super-block, with the per-row
# float scale of that super-block


@triton.jit
def _iq2_tile(wf, nib, blk, g0, NG: tl.constexpr):
    """Groups [g0, g0 + NG) of the IQ2_XXS super-blocks blk [BN] (indices from wf [BN], each
    row's IQ2S quant words as 8-byte units: layout.py) -> the integers q [BN, 32·NG] fp16 of
    W = d/8·q (d: _iq2_scale), columns in _tile_k's order.

    Block: f16 d, then 8 groups of 32 values = 4 grid-index bytes + u32 aux (4 × 7 sign-index
    bits, interleaved in IQ2S; ls in the top 4). Per grid entry (8 values) one 32-bit lookup
    gives its 8 level codes as nibbles (nib: 1 KB, 8 cache lines for a warp's scattered lookups);
    the signs are computed (_iq2_signs) and join the codes, and a byte permute per 4 values turns
    them into 128 ± level (_iq2_lut), which become (2·ls + 1)·level·sign in fp16 (_u8x4_f16). A
    thread decodes whole groups: its 32 values are contiguous in K. (The group axis leads the
    work tensors [NG, BN]: Triton then lays threads along K first, and the tile reaches shared
    memory K-major, in 16-byte stores.) A group's grid-index and aux words come in one 8-byte
    load."""
    BN: tl.constexpr = blk.shape[0]
    gw = blk[None, :].to(tl.int64) * 8 + (g0 + tl.arange(0, NG))[:, None]  # [NG, BN]: 8 bytes a group
    ga = tl.load(wf[None, :] + _opaque(gw))  # (_opaque: the load keeps the tile's layout)
    gq = ga.to(tl.int32)
    aux = (ga >> 32).to(tl.int32)
    mul = _u8f(2 * ((aux >> 28) & 15) + 1)[:, :, None, None]  # 2·ls + 1, per group
    gi = _join4(_iq2_grid_index(gq, 0), _iq2_grid_index(gq, 1), _iq2_grid_index(gq, 2),
                _iq2_grid_index(gq, 3))  # [NG, BN, 2, 2]: the 4 entries
    signs = _join4(_iq2_signs(aux, 0), _iq2_signs(aux, 1), _iq2_signs(aux, 2), _iq2_signs(aux, 3))
    sel = tl.load(nib + gi) | signs  # (the lookups through the L1: up to 8 of the table's lines a warp)
    a0, a1, a2, a3 = _u8x4_f16(_iq2_lut(sel), mul, 128)  # values 0-3 of each entry
    a4, a5, a6, a7 = _u8x4_f16(_iq2_lut(sel >> 16), mul, 128)
    q = _join8(a0, a1, a2, a3, a4, a5, a6, a7)
    q = tl.permute(q, (1, 0, 2, 3, 4, 5, 6))  # [BN, NG, 2, 2, 2, 2, 2]: value 32·g + 8·entry + i
    return _tile_order(q, BN, NG).to(tl.float16)


@triton.jit
def _iq2_scale(wh, blk):
    """d/8 of the IQ2_XXS super-blocks blk [BN] (indices from wh [BN], each row's IQ2S scales;
    W = d/8·q)."""
    return _ld_f16(wh, 2 * blk, True) * 0.125


@triton.jit
def _q2_bytes(w0, w1, w2, w3, w4, w5, w6, w7, sc0, sc1):
    """sc·q of the 8 qs words of a run (already shifted to the run's 2-bit field) -> 4 tensors,
    one per byte of the words, each [..., 2, 2, 2] in word order; words 0..3 lie in the run's
    first sub-block (scale sc0), 4..7 in its second (sc1)."""
    a0, a1, a2, a3 = _u8x4_f16(w0 & _Q2_FIELDS, sc0, 0)
    b0, b1, b2, b3 = _u8x4_f16(w1 & _Q2_FIELDS, sc0, 0)
    c0, c1, c2, c3 = _u8x4_f16(w2 & _Q2_FIELDS, sc0, 0)
    d0, d1, d2, d3 = _u8x4_f16(w3 & _Q2_FIELDS, sc0, 0)
    e0, e1, e2, e3 = _u8x4_f16(w4 & _Q2_FIELDS, sc1, 0)
    f0, f1, f2, f3 = _u8x4_f16(w5 & _Q2_FIELDS, sc1, 0)
    g0, g1, g2, g3 = _u8x4_f16(w6 & _Q2_FIELDS, sc1, 0)
    h0, h1, h2, h3 = _u8x4_f16(w7 & _Q2_FIELDS, sc1, 0)
    return (_join8(a0, b0, c0, d0, e0, f0, g0, h0), _join8(a1, b1, c1, d1, e1, f1, g1, h1),
            _join8(a2, b2, c2, d2, e2, f2, g2, h2), _join8(a3, b3, c3, d3, e3, f3, g3, h3))


@triton.jit
def _q2k_tile(ww, ws, blk, r0, NR: tl.constexpr):
    """Runs [r0, r0 + NR) of 32 values of the Q2_K super-blocks blk [BN] (Q2S, layout.py: quant
    words ww, scale words ws) -> a [BN, 32·NR] fp16 = sc·q; W = d·a − dmin·m (_q2k_scales,
    _q2k_mins).

    Block: qs[64], scales[16] (low nibble sc, high nibble m), f16 d, f16 dmin. Run
    r = 4h + sh holds values 128h + 32·sh + 4·j + b, which sit in qs word 8h + j, byte b, bits
    2·sh; value 4·j + b of the run lies in sub-block 8h + 2·sh + j // 4. A thread decodes a
    whole run (32 values contiguous in K) from the 8 words of its half; the 4 runs of a half read
    the same words, in two 16-byte loads. (Runs lead the work tensors [NR, BN], as groups do in
    _iq2_tile.)"""
    BN: tl.constexpr = blk.shape[0]
    bq = (blk * 16)[None, :]  # the block's first quant word
    r = r0 + tl.arange(0, NR)[:, None]
    h = r >> 2
    sh = r & 3
    # scale bytes 8h + 2·sh + (0, 1): word 2h + sh // 2 of the block's 4, bytes 2·(sh % 2) + (0, 1)
    scw = tl.load(ws + (blk * 4)[None, :] + 2 * h + (sh >> 1))
    sft = 16 * (sh & 1)
    sc0 = _u8f((scw >> sft) & 15)  # the low nibbles: the sub-block scales
    sc1 = _u8f((scw >> (sft + 8)) & 15)
    wq = bq + 8 * h  # qs word j = 0 of the half
    qsh = 2 * sh
    w0, w1, w2, w3 = _ld4(ww + wq, INT=True)  # the half's 8 words: two 16-byte loads
    w4, w5, w6, w7 = _ld4(ww + wq + 4, INT=True)
    w0, w1, w2, w3 = w0 >> qsh, w1 >> qsh, w2 >> qsh, w3 >> qsh
    w4, w5, w6, w7 = w4 >> qsh, w5 >> qsh, w6 >> qsh, w7 >> qsh
    # value 4·j + b of the run: words (j) on the first three new axes, bytes (b) on the last two
    b0, b1, b2, b3 = _q2_bytes(w0, w1, w2, w3, w4, w5, w6, w7, sc0, sc1)
    a = _join4(b0, b1, b2, b3)
    a = tl.permute(a, (1, 0, 2, 3, 4, 5, 6))  # [BN, NR, 2, 2, 2, 2, 2]: value 32·run + 4·j + b
    return _tile_order(a, BN, NR).to(tl.float16)


@triton.jit
def _q2k_scales(wh, blk):
    """(d, dmin) of the Q2_K super-blocks blk [BN] (Q2S: wh the (d, dmin) halfwords), from one
    32-bit load: d in the low half, dmin in the high."""
    dd = tl.load(wh.to(tl.pointer_type(tl.int32)) + blk)
    return _f16_lo(dd), _f16_lo(dd >> 16)


@triton.jit
def _q2k_mins(ws, blk):
    """m of the 16 sub-blocks of the Q2_K super-blocks blk [BN] (Q2S: ws the scale words),
    [BN, 16] fp16: the high nibbles of the block's 4 scale words."""
    BN: tl.constexpr = blk.shape[0]
    sw = tl.load(ws + (blk * 4)[:, None] + tl.arange(0, 4)[None, :])
    mn = _join4((sw >> 4) & 15, (sw >> 12) & 15, (sw >> 20) & 15, (sw >> 28) & 15)
    return tl.reshape(_u8f(mn), [BN, 16]).to(tl.float16)


# ------------------------------------------------------------------------------------------------
# experts


@triton.jit
def _tile_rows(tok_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr, tile, BM: tl.constexpr, ROUTED: tl.constexpr):
    """(expert e, assignments a [BM], their mask, the rows of x they read) of a tile of the
    schedule: BM expert-sorted (token, slot) assignments (ROUTED: the rows are their tokens), or
    BM tokens of the shared expert. tok_ptr is read only when ROUTED (the down kernel's rows are
    the sorted assignments themselves). The rows of a tile past its segment's end read the
    segment's last row again (every tile holds one): their outputs are never stored, and the
    loads of x then need no mask (no zero fill a K-step)."""
    e = tl.load(tile_e_ptr + tile)
    a = tl.load(tile_r0_ptr + tile) + tl.arange(0, BM)
    end = tl.load(tile_end_ptr + tile)
    am = a < end
    ac = tl.minimum(a, end - 1)
    if ROUTED:
        tok = tl.load(tok_ptr + ac).to(tl.int64)
    else:
        tok = ac.to(tl.int64)
    return e, a, am, tok


@triton.jit
def moe_gateup_mm16_kernel(xh_ptr, xl_ptr, xi_ptr, tok_ptr, wts_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr,
                           gh, uh, gf, uf, nib, h_ptr, F, K, RB, EXP_BYTES, clamp,
                           BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, ROUTED: tl.constexpr,
                           LO: tl.constexpr = True):
    """Prefill gate/up in IQ2_XXS for one tile of assignments and BN rows:
    h[a, r] = w_a · swiglu(gate_e[r]·x[tok_a], up_e[r]·x[tok_a]), x given split by
    split16_kernel; gh / uh, gf / uf: the IQ2S scales and quant words of gate and up. Per super-block
    the scales d/8 and 1/s combine once; its 256 values go in K-steps of KS (a divisor of 256).
    Gate's BN rows and up's are one [2·BN, KS] operand: each tensor-core product of N = 2·BN
    reads the x tile from shared memory once for both weights, where two products of N = BN
    read it twice."""
    tile = tl.program_id(0)
    pn = tl.program_id(1)
    e, a, am, tok = _tile_rows(tok_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr, tile, BM, ROUTED)
    if e >= 0:
        rows = pn * BN + tl.arange(0, BN)
        rmask = rows < F  # rows past F decode row F - 1 again: the loads need no mask
        NS = K // 256
        eb = e.to(tl.int64) * (EXP_BYTES // 66)  # the expert's first block: its scales and quant words
        up = tl.arange(0, 2 * BN) >= BN  # the operand's rows: gate's BN, then up's
        wq = tl.where(up, uf + eb * 16, gf + eb * 16).to(tl.pointer_type(tl.int64))
        ws = tl.where(up, uh + eb, gh + eb)
        rb = tl.minimum(pn * BN + tl.arange(0, 2 * BN) % BN, F - 1) * NS  # first blocks (32-bit)
        xo = tok[:, None] * K + _tile_k(KS)[None, :]
        acc = tl.zeros([BM, 2 * BN], tl.float32)
        for sb in range(0, NS):
            blk = rb + sb
            # the super-block's integer products accumulate on the tensor cores; its scales once
            p = tl.zeros([BM, 2 * BN], tl.float32)
            for part in range(0, 256 // KS):
                k0 = sb * 256 + part * KS
                xh = tl.load(xh_ptr + xo + k0)
                xl = tl.load(xl_ptr + xo + k0) if LO else xh
                p = _dot16(xh, xl, _iq2_tile(wq, nib, blk, part * (KS // 32), KS // 32), p, LO)
            inv = tl.load(xi_ptr + tok * NS + sb)[:, None]
            acc += p * (inv * _iq2_scale(ws, blk)[None, :])
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN]), (0, 2, 1)))
        hv = _swiglu(acc_g, acc_u, clamp)
        if ROUTED:
            hv = hv * tl.load(wts_ptr + a, mask=am, other=0.0)[:, None]
        tl.store(h_ptr + a[:, None].to(tl.int64) * F + rows[None, :], hv, mask=am[:, None] & rmask[None, :])


@triton.jit
def moe_down_mm16_kernel(xh_ptr, xl_ptr, xi_ptr, gh_ptr, gl_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr,
                         ww, ws, wh, out_ptr, E, F, RB, EXP_BYTES,
                         BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, LO: tl.constexpr = True):
    """Prefill down in Q2_K (Q2S: quant words ww, scale words ws, (d, dmin) halfwords wh):
    out_sorted[a, r] = down_e[r] · h[a] for one tile of expert e's assignments, h given split by
    split16_kernel. The d·(sc·q) term per super-block in K-steps of KS values (a divisor of
    256), then the dmin·m term over the 16-value sums of h."""
    tile = tl.program_id(0)
    pn = tl.program_id(1)
    e, a, am, a64 = _tile_rows(tile_e_ptr, tile_e_ptr, tile_r0_ptr, tile_end_ptr, tile, BM, False)
    if e >= 0:
        rows = pn * BN + tl.arange(0, BN)
        rmask = rows < E  # rows past E decode row E - 1 again: the loads need no mask
        eb = e.to(tl.int64) * (EXP_BYTES // 84)  # the expert's first block
        we = ww + eb * 16  # its first quant word, scale word, (d, dmin) halfword
        se = ws + eb * 4
        he = wh + eb * 2
        rb = tl.minimum(rows, E - 1) * (RB // 84)  # the rows' first blocks inside the expert (32-bit)
        NS = F // 256
        xo = a64[:, None] * F + _tile_k(KS)[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for sb in range(0, NS):
            bo = rb + sb
            p = tl.zeros([BM, BN], tl.float32)
            for part in range(0, 256 // KS):
                k0 = sb * 256 + part * KS
                xh = tl.load(xh_ptr + xo + k0)
                xl = tl.load(xl_ptr + xo + k0) if LO else xh
                p = _dot16(xh, xl, _q2k_tile(we, se, bo, part * (KS // 32), KS // 32), p, LO)
            # the min term: 16-value sums (/16, hence 16·dmin) times m, a K = 16 product
            go = a64[:, None] * (F // 16) + sb * 16 + tl.arange(0, 16)[None, :]
            gh = tl.load(gh_ptr + go)
            gl = tl.load(gl_ptr + go) if LO else gh
            pm = _dot16(gh, gl, _q2k_mins(se, bo), tl.zeros([BM, BN], tl.float32), LO)
            d, dmin = _q2k_scales(he, bo)
            inv = tl.load(xi_ptr + a64 * NS + sb)[:, None]
            acc += (p * d[None, :] - pm * (16.0 * dmin)[None, :]) * inv
        tl.store(out_ptr + a64[:, None] * E + rows[None, :], acc, mask=am[:, None] & rmask[None, :])
