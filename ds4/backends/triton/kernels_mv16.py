"""Decode (one-token) products on fp16 tensor cores.

A matrix-vector product is memory-bound: at the H200's 4.3 TB/s a Q8_0 weight byte must cost
the SM well under 8 instructions, and the FMA decoders of kernels.py spend 6 to 19 per value
while reading their blocks in 2-byte pieces. Here the weight bytes come in coalesced 16-byte
loads, become exact fp16 integers in about one instruction per value, and the multiply-adds go
to the tensor cores, with the activation as the other operand:

* Q8_0 rows are streams of 34-byte blocks (f16 d, 32 int8 quants); 8 blocks make a 272-byte
  group, which starts 16-byte aligned in every row of a K % 256 == 0 matrix. A group is read as
  its first 256 bytes plus a 16-byte tail (quants 16..31 of block 7), and multiplied by a
  block-diagonal activation tile A[16, 256]: row 8·t + b holds term t of x̂ at the bytes of block
  b's quants and zeros elsewhere (the scale bytes included). One K = 256 product then gives
  each block's integer dot product separately, for both terms, and the per-block scales d apply
  to the [16, BN] result: float32 accuracy, as in kernels_mm16.py.
* x̂ (x, or its RMSNorm) is scaled per group by a power of two s and split as x̂·s = hi + lo in
  fp16 (to 2^-22 of each value); the fp16 products of integers are exact and accumulate in
  float32, so only the accumulation rounds.

W is the right operand (W rows on the accumulator's columns), so a program may hold any
multiple of 16 rows: the small decode matrices still spread over the whole GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _INTERP, _swiglu
from .kernels_mm16 import _hi_lo, _pow2_scale


@triton.jit
def _q8_f16(w):
    """uint8 bytes holding int8 quants -> the quants as fp16 (exact). Four bytes per 32-bit
    register: XOR 0x80 biases them to 0..255, a byte permute makes the halves 0x64bb
    (1024 + byte), and one packed subtraction of 1152 leaves the signed value, two per op."""
    if _INTERP:
        return w.to(tl.int8, bitcast=True).to(tl.float16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, c, m; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64646464; "
            "mov.b32 c, 0x64806480; prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; "
            "sub.rn.f16x2 $0, $0, c; sub.rn.f16x2 $1, $1, c; }",
            "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _dot_f16(a, b, acc):
    """acc + a·b on fp16 tensor cores (the interpreter's fp16 products are not trustworthy: it
    gets the same products in float32, which are exact for these operands too)."""
    if _INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _x_scale(xb, nw_ptr, eps, NG: tl.constexpr, NORM: tl.constexpr):
    """(1/rms, s, 1/s) of x̂ = x (NORM 0) or its RMSNorm (weighted, NORM 1; unweighted, 2), with
    s one power of two for the whole of x̂ (max|x̂·s| in [2^14, 2^15)): x̂·s loses relative
    precision only where it falls below fp16's normal range, 2^-29 under its largest value."""
    kv = tl.arange(0, 256)
    ss = tl.zeros([256], tl.float32)
    mx = tl.zeros([256], tl.float32)
    for i in tl.static_range(NG):  # unrolled: every load is issued before the first use
        xv = tl.load(xb + i * 256 + kv)
        ss += xv * xv
        if NORM == 1:
            xv = xv * tl.load(nw_ptr + i * 256 + kv)
        mx = tl.maximum(mx, tl.abs(xv))
    ir = 1.0
    if NORM != 0:
        ir = 1.0 / tl.sqrt_rn(tl.sum(ss) / (NG * 256) + eps)
    s, inv = _pow2_scale(tl.max(mx) * ir)
    return ir, s, inv


@triton.jit
def _x_tiles(xb, nw_ptr, g, ir, s, NORM: tl.constexpr):
    """The block-diagonal activation tiles of 256-value group g: a [16, 256] over the group's
    first 256 weight bytes and at [16, 16] over its 16-byte tail (fp16; see the module doc)."""
    kb = tl.arange(0, 256)
    blk = kb // 34
    isq = kb - 34 * blk >= 2
    xe = g * 256 + kb - 2 * blk - 2  # byte k holds quant (k % 34) - 2 of block k // 34
    kt = tl.arange(0, 16)
    m16 = tl.arange(0, 16)
    hi_row = (m16 < 8)[:, None]
    xv = tl.load(xb + xe, mask=isq, other=0.0)
    xt = tl.load(xb + g * 256 + 240 + kt)  # the tail: quants 16..31 of block 7
    if NORM != 0:
        xv = xv * ir
        xt = xt * ir
        if NORM == 1:
            xv = xv * tl.load(nw_ptr + xe, mask=isq, other=0.0)
            xt = xt * tl.load(nw_ptr + g * 256 + 240 + kt)
    hv, lv = _hi_lo(xv * s)
    ht, lt = _hi_lo(xt * s)
    sel = ((m16 % 8)[:, None] == blk[None, :]) & isq[None, :]
    a = tl.where(sel, tl.where(hi_row, hv[None, :], lv[None, :]), 0.0).to(tl.float16)
    at = tl.where(((m16 % 8) == 7)[:, None], tl.where(hi_row, ht[None, :], lt[None, :]), 0.0).to(tl.float16)
    return a, at


@triton.jit
def _q8_group(wb, wh, rb, dh, rm, g, a, at):
    """[16, BN]: row 8·t + b holds d_b · (term t of x̂ over block b) · q_b of the BN rows' group g;
    rb [1, BN] are the rows' byte offsets, dh [16, BN] the halfwords of their block scales."""
    gb = rb + g * 272
    kb = tl.arange(0, 256)[:, None]
    kt = tl.arange(0, 16)[:, None]
    wm = tl.load(wb + gb + kb, mask=rm, other=0)  # [256, BN]: 16-byte runs along K
    wt = tl.load(wb + gb + 256 + kt, mask=rm, other=0)  # [16, BN]
    c = _dot_f16(a, _q8_f16(wm), tl.zeros(dh.shape, tl.float32))
    c = _dot_f16(at, _q8_f16(wt), c)
    d = tl.load(wh + dh + g * 136, mask=rm, other=0).to(tl.float16, bitcast=True)
    return c * d.to(tl.float32)


@triton.jit
def q8_mv16_kernel(x_ptr, sx_t, sx_g, nw_ptr, wb, wh, out_ptr, so_t, N, RB, GROUP_ROWS, eps,
                   NG: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, NORM: tl.constexpr):
    """out[t, r] = W[r] · x̂[t] for Q8_0 rows W of K = 256·NG values and a few tokens t (grid axis 1),
    G groups of 256 values per K-step.
    NORM 1/2: x̂ is the weighted / unweighted RMSNorm of x. Rows r of group g = r // GROUP_ROWS
    read x at column offset g·sx_g (grouped projections; BN divides GROUP_ROWS)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    ro = rows.to(tl.int64) * RB
    xb = x_ptr + t * sx_t + ((pid * BN) // GROUP_ROWS) * sx_g
    ir, s, inv = _x_scale(xb, nw_ptr, eps, NG, NORM)
    rm = rmask[None, :]
    rb = ro[None, :]
    dh = (ro // 2)[None, :] + 17 * (tl.arange(0, 16) % 8)[:, None]  # block (m % 8)'s scale
    acc = tl.zeros([16, BN], tl.float32)
    for g0 in range(0, NG, G):
        for j in tl.static_range(G):
            a, at = _x_tiles(xb, nw_ptr, g0 + j, ir, s, NORM)
            acc += _q8_group(wb, wh, rb, dh, rm, g0 + j, a, at)
    tl.store(out_ptr + t * so_t + rows, tl.sum(acc, axis=0) * inv, mask=rmask)


@triton.jit
def q8_gateup_mv16_kernel(x_ptr, sx_t, ids_ptr, wts_ptr, gb, gh, ub, uh, h_ptr, F, RB, EXP_BYTES, KSLOTS, clamp,
                          NG: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, ROUTED: tl.constexpr):
    """h[s, r] = w_s · swiglu(gate_e[r]·x, up_e[r]·x) for Q8_0 experts, slot s = t·KSLOTS + j of
    expert e = ids[s] (ROUTED), or the shared expert (e = 0, no weight): both weights share the
    activation tiles."""
    pid = tl.program_id(0)
    sl = tl.program_id(1)
    t = sl // KSLOTS
    if ROUTED:
        e = tl.load(ids_ptr + sl).to(tl.int64)
    else:
        e = 0
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < F
    ro = e * EXP_BYTES + rows.to(tl.int64) * RB
    xb = x_ptr + t * sx_t
    ir, s, inv = _x_scale(xb, xb, 0.0, NG, 0)
    rm = rmask[None, :]
    rb = ro[None, :]
    dh = (ro // 2)[None, :] + 17 * (tl.arange(0, 16) % 8)[:, None]
    acc_g = tl.zeros([16, BN], tl.float32)
    acc_u = tl.zeros([16, BN], tl.float32)
    for g0 in range(0, NG, G):
        for j in tl.static_range(G):
            a, at = _x_tiles(xb, xb, g0 + j, ir, s, 0)
            acc_g += _q8_group(gb, gh, rb, dh, rm, g0 + j, a, at)
            acc_u += _q8_group(ub, uh, rb, dh, rm, g0 + j, a, at)
    h = _swiglu(tl.sum(acc_g, axis=0) * inv, tl.sum(acc_u, axis=0) * inv, clamp)
    if ROUTED:
        h = h * tl.load(wts_ptr + sl)
    tl.store(h_ptr + sl * F + rows, h, mask=rmask)
