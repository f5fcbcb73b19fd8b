"""Decoders shared by the matrix-vector and MoE kernels: the generic K-step `_mv_step`, the bit
and byte tricks of the integer decoders, the IQ2_XXS level tables and the XQ8 activation words.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import D_IQ2_UNROLLED, D_Q2_K_UNROLLED, _INTERP, _iq2_blk, _iq2_sign_index, _ld4, _ld_f16, _q2_blk, _s8f, _u8f, _wtile


@triton.jit
def _mv_step(xb, k0, wb, wh, wf, gridp, ksigns, row_off, rmask, rs, nw_ptr,
             TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr, NORM: tl.constexpr):
    """One K-step of a matrix-vector product: W[rows, k0 : k0 + NB·VB] ⊙ x̂, as a tile whose sum
    is the step's contribution. 216 (IQ2_XXS) and 110 (Q2_K) unroll the values of a unit and
    return [BN, NB, 1]; the generic decoder (_wtile) returns [BN, NB, VB]."""
    if TYPE == D_IQ2_UNROLLED:  # IQ2_XXS, one 32-value group per tile element, levels and signs as bytes
        u = k0 // 32 + tl.arange(0, NB)[None, :]  # group index in the row
        m = rmask[:, None]
        blk = _iq2_blk(row_off)[:, None] + u // 8  # IQ2S (layout.py)
        gw = blk * 16 + (u % 8) * 2
        d = _ld_f16(wh, 2 * blk, m)
        gq = tl.load(wf + gw, mask=m, other=0)
        aux = tl.load(wf + gw + 1, mask=m, other=0)
        db = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.25
        xu = xb + k0 + tl.arange(0, NB) * 32
        part = tl.zeros(d.shape, tl.float32)
        for sub in tl.static_range(4):
            gi = _iq2_grid_index(gq, sub)
            si = _iq2_sign_index(aux, sub)
            for h in tl.static_range(2):
                # 4 levels as int8 bytes, negated bytewise where the sign mask byte is 0xFF
                # (levels are >= 8, so ~v + 1 never carries into the next byte)
                lv = tl.load(gridp + 256 + 2 * gi + h)
                mk = tl.load(ksigns + 128 + 2 * si + h)
                sv = (lv ^ mk) + (mk & 0x01010101)
                for j in tl.static_range(4):
                    q = _s8f(sv >> (8 * j))
                    part += q * tl.load(xu + 8 * sub + 4 * h + j)[None, :]
        return (db * part)[:, :, None]
    elif TYPE == D_Q2_K_UNROLLED:  # Q2_K: 16 bytes (4 words) × 4 shifts = 64 values per tile element
        u = k0 // 64 + tl.arange(0, NB)[None, :]
        m = rmask[:, None]
        base, h, half, d, dmin, w0, w1, w2, w3 = _q2k_unit(wh, wf, row_off, m, u)
        u1 = k0 // 64 + tl.arange(0, NB)
        xk = xb + (u1 // 4) * 256 + ((u1 % 4) // 2) * 128 + (u1 % 2) * 16
        part = tl.zeros(d.shape, tl.float32)
        for sh in tl.static_range(4):
            sc = tl.load(wb + base + 8 * h + 2 * sh + half, mask=m, other=0).to(tl.int32)
            dl = d * (sc & 15).to(tl.float32)
            ml = dmin * (sc >> 4).to(tl.float32)
            acc_q = tl.zeros(d.shape, tl.float32)
            xs = tl.zeros([1, NB], tl.float32)
            for i4 in tl.static_range(4):
                if i4 == 0:
                    wd = w0
                elif i4 == 1:
                    wd = w1
                elif i4 == 2:
                    wd = w2
                else:
                    wd = w3
                xq = _ld4(xk + 32 * sh + 4 * i4)
                for i in tl.static_range(4):
                    q = _u8f((wd >> (8 * i + 2 * sh)) & 3)
                    xv = xq[i][None, :]
                    acc_q += q * xv
                    xs += xv
            part += dl * acc_q - ml * xs
        return part[:, :, None]
    else:
        kv = tl.arange(0, NB)[None, :, None] * VB + tl.arange(0, VB)[None, None, :]
        xv = tl.load(xb + k0 + kv)
        if NORM != 0:
            xv = xv / rs
            if NORM == 1:
                xv = xv * tl.load(nw_ptr + k0 + kv)
        return _wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB) * xv


@triton.jit
def _q2k_unit(wh, wf, row_off, m, u):
    """Q2_K 64-value units u [1, NB] of the rows at row_off (110, 111; Q2S): 16 quant bytes of one
    half (h) of a 128-value run, bytes [16·half, +16) of it, as 4 words, each shifted by 2·j
    holding 16 values of one 16-value run j. Returns (the block's first scale byte, h, half, d,
    dmin, the words)."""
    B = _q2_blk(row_off)[:, None] + u // 4
    h = (u % 4) // 2
    half = u % 2
    d = _ld_f16(wh, B * 4, m)
    dmin = _ld_f16(wh, B * 4 + 2, m)
    qw = B * 16 + h * 8 + half * 4
    w0 = tl.load(wf + qw, mask=m, other=0)
    w1 = tl.load(wf + qw + 1, mask=m, other=0)
    w2 = tl.load(wf + qw + 2, mask=m, other=0)
    w3 = tl.load(wf + qw + 3, mask=m, other=0)
    return B * 16, h, half, d, dmin, w0, w1, w2, w3


@triton.jit
def _b2f(qx, j: tl.constexpr):
    """Byte j of qx, a biased quant (value + 128), -> the value as float32 without an I2F: one
    byte permute builds 0x4B0000bb = 2^23 + byte, one subtraction removes 2^23 + 128."""
    if _INTERP:
        b = ((qx >> (8 * j)) & 0xFF) | 0x4B000000
    else:
        b = tl.inline_asm_elementwise(f"prmt.b32 $0, $1, 0x4B000000, {0x7440 + j};", "=r,r", [qx],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return b.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _split4(v, BN: tl.constexpr):
    """[BN] -> four [BN/4] row sets (rows 4i, 4i+2, 4i+1, 4i+3): a thread holds one element of
    each, so values it loads once (x) serve four rows. _join4 is the inverse."""
    a, b = tl.split(tl.reshape(v, [BN // 4, 2, 2]))
    v0, v1 = tl.split(a)
    v2, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _join4(y0, y1, y2, y3, BN: tl.constexpr):
    return tl.reshape(tl.join(tl.join(y0, y1), tl.join(y2, y3)), [BN])


_LVL_POS = tl.constexpr(0x00AB9988)  # bytes 128 + 8, 128 + 25, 128 + 43: the biased IQ2_XXS levels
_LVL_NEG = tl.constexpr(0x00556778)  # bytes 128 - 8, 128 - 25, 128 - 43 (codes 0, 1, 2)
_LVL_PRMT = tl.constexpr(f"{{ .reg .b32 a; mov.b32 a, {_LVL_POS.value:#010x}; "
                         f"prmt.b32 $0, a, {_LVL_NEG.value:#010x}, $1; }}")
_LVS_POS = tl.constexpr(0x002B1908)  # the levels 8, 25, 43 as signed bytes (decoder 418: dp4a operands)
_LVS_NEG = tl.constexpr(0x00D5E7F8)  # -8, -25, -43
_LVS_PRMT = tl.constexpr(f"{{ .reg .b32 a; mov.b32 a, {_LVS_POS.value:#010x}; "
                         f"prmt.b32 $0, a, {_LVS_NEG.value:#010x}, $1; }}")


@triton.jit
def _iq2_lut(sel, SIGNED: tl.constexpr = False):
    """Nibble i of sel (code | sign << 2) -> byte i = 128 + level, or 128 - level where signed:
    one byte permute over the 8 bytes of _LVL_POS (selectors 0-2) and _LVL_NEG (4-6). SIGNED:
    the level itself as a two's-complement byte (+level / -level), for _dp4a."""
    if _INTERP:
        out = sel & 0
        for i in tl.static_range(4):
            n = (sel >> (4 * i)) & 7
            if SIGNED:
                src = tl.where(n < 4, _LVS_POS, _LVS_NEG)
            else:
                src = tl.where(n < 4, _LVL_POS, _LVL_NEG)
            out = out | (((src >> (8 * (n & 3))) & 255) << (8 * i))
        return out
    elif SIGNED:
        return tl.inline_asm_elementwise(_LVS_PRMT, "=r,r", [sel], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_LVL_PRMT, "=r,r", [sel], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dp4a(a, b, c):
    """c + Σ_j a_j·b_j over the four signed bytes of the int32 words a and b: one instruction
    for four products, exact in int32 (the routed decoders 418 / 111 with x in XQ form)."""
    if _INTERP:
        for j in tl.static_range(4):
            c += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


# XQ: a vector in 32-value blocks of 16-bit fixed point for the integer decoders (418, 111). Block b
# has scale s_b = amax_b / 32639 and integers q = floor(x·(32639 / amax_b) + 0.5), split as
# q = 256·hi + lo with hi, lo signed bytes; its 16 words are, for each 8 values j = 0..3, the hi
# bytes of values 8j..8j+3 and 8j+4..8j+7, then their lo bytes (one 16-byte load per 8 values).
# Beside them: s_b, and s_b·Σq over each 16 values (the Q2_K minimum term). x is then exact to
# s_b / 2 = amax_b / 65278, where an f16 copy would be to 2^-11 of each value. XQ8 is the same
# with the 32 values of a block in the byte order of a Q8C block (word w: values w, w+8, w+16,
# w+24, its hi word at 4·(w // 2) + w % 2, its lo word 2 after it), so that one 16-byte load
# gives the x words of two Q8C quant words (decoder 309).
XQ_MAX = tl.constexpr(32639.0)  # 127·257: the largest q whose hi byte (q + 128) >> 8 is 127


@triton.jit
def _xq_words(v, PERM: tl.constexpr):
    """[NBLK, 32] signed bytes -> [NBLK, 8] words of 4: word w holds values 4w..4w+3, or with PERM
    values w, w+8, w+16, w+24 (the byte order of a Q8C block's word w)."""
    NBLK: tl.constexpr = v.shape[0]
    sh = tl.arange(0, 4)[None, None, :] * 8
    if PERM:
        g = tl.permute(tl.reshape(v, [NBLK, 4, 8]), (0, 2, 1))
    else:
        g = tl.reshape(v, [NBLK, 8, 4])
    return tl.sum((g & 255) << sh, axis=2)  # disjoint bytes: the sum of the shifted bytes is their OR


@triton.jit
def _xq_store(v, w_ptr, s_ptr, sum_ptr, blk0, bmask, PERM: tl.constexpr = False):
    """Blocks blk0 + [0, NBLK) of a vector, v [NBLK, 32] float, stored in XQ form (bmask [NBLK]:
    which blocks exist); PERM: in the Q8C byte order (XQ8, for decoder 309)."""
    NBLK: tl.constexpr = v.shape[0]
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, XQ_MAX / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.floor(v * inv[:, None] + 0.5).to(tl.int32)
    hi = (q + 128) >> 8
    lo = q - hi * 256
    hw = _xq_words(hi, PERM)  # [NBLK, 8]
    lw = _xq_words(lo, PERM)
    b = blk0 + tl.arange(0, NBLK)
    w = tl.arange(0, 8)[None, :]
    off = b[:, None] * 16 + (w // 2) * 4 + (w % 2)
    tl.store(w_ptr + off, hw, mask=bmask[:, None])
    tl.store(w_ptr + off + 2, lw, mask=bmask[:, None])
    s = amax / XQ_MAX
    tl.store(s_ptr + b, s, mask=bmask)
    qs = tl.sum(tl.reshape(q, [NBLK, 2, 16]), axis=2).to(tl.float32) * s[:, None]
    tl.store(sum_ptr + b[:, None] * 2 + tl.arange(0, 2)[None, :], qs, mask=bmask[:, None])


@triton.jit
def _iq2_grid_index(gq, sub: tl.constexpr):
    """Grid index of entry sub (0-3) of a group, from its grid-index word gq."""
    return (gq >> (8 * sub)) & 255
