"""Matrix-matrix products (prefill) of quantized weights: `matmul_kernel` (every type) and the
fp16 path (`x16_kernel`, `matmul_f16w_kernel`): the "f16" precision's Q8C and F16 rows, and under
bf16x3 F16 rows and Q8C rows split into two exact fp16 planes (`q8c_hl_kernel`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import T_Q8C, _dot16, _dot_units, _hi_lo, _ld_f16, _pow2_scale, _q8c_value, _wtile


@triton.jit
def _mm_rows(x_ptr, sx_t, tm, mm, K, wb, wh, wf, gridp, ksigns, row_off, rmask,
             BM: tl.constexpr, BN: tl.constexpr, TYPE: tl.constexpr, NB: tl.constexpr,
             VB: tl.constexpr, PREC: tl.constexpr, U: tl.constexpr, TERMS: tl.constexpr):
    """x[tm, :K] · W[rows]ᵀ -> [BM, BN]: the K loop of the matrix-matrix kernels (gate/up keeps
    its own, which shares each x tile between the two weights)."""
    acc = tl.zeros([BM, BN], tl.float32)
    if U > 0:
        for k0 in range(0, K, NB * U):
            acc = _dot_units(x_ptr, sx_t, tm, mm, k0, wb, wh, row_off, rmask, acc, NB, TYPE, TERMS)
    else:
        BK: tl.constexpr = NB * VB
        kk = tl.arange(0, BK)
        for k0 in range(0, K, BK):
            xt = tl.load(x_ptr + tm[:, None].to(tl.int64) * sx_t + k0 + kk[None, :], mask=mm[:, None], other=0.0)
            w = tl.reshape(_wtile(wb, wh, wf, gridp, ksigns, row_off, rmask, k0 // VB, TYPE, NB, VB), [BN, BK])
            acc = tl.dot(xt, tl.trans(w), acc, input_precision=PREC)
    return acc


@triton.jit
def matmul_kernel(x_ptr, sx_t, sx_g, wb, wh, wf, gridp, ksigns, out_ptr, so_t,
                  M, N, K, RB, GROUP_ROWS,
                  TYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                  VB: tl.constexpr, PREC: tl.constexpr, U: tl.constexpr = 0, TERMS: tl.constexpr = 3):
    """out[M, N] = x[M, K] · W[N, K]ᵀ with W decoded tile by tile (prefill). U > 0: Q8_0 blocks
    as integers on 16-bit tensor cores, x in TERMS terms (_dot_units), NB blocks per K-step."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    tm = pm * BM + tl.arange(0, BM)
    mm = tm < M
    rows = pn * BN + tl.arange(0, BN)
    rmask = rows < N
    row_off = rows.to(tl.int64) * RB
    xb = x_ptr + ((pn * BN) // GROUP_ROWS) * sx_g
    acc = _mm_rows(xb, sx_t, tm, mm, K, wb, wh, wf, gridp, ksigns, row_off, rmask, BM, BN, TYPE, NB, VB, PREC, U,
                   TERMS)
    tl.store(out_ptr + tm[:, None].to(tl.int64) * so_t + rows[None, :], acc,
             mask=mm[:, None] & rmask[None, :])


@triton.jit
def _tile_of(M, N, BM: tl.constexpr, BN: tl.constexpr, GM: tl.constexpr):
    """This program's rows of x and of W (the first one r0, then all), with their masks, in a
    one-dimensional grid that runs GM row tiles of x per row tile of W, so that neighbouring
    programs share W's tile in L2."""
    pid = tl.program_id(0)
    per = GM * tl.cdiv(N, BN)
    m0 = (pid // per) * GM
    gm = tl.minimum(tl.cdiv(M, BM) - m0, GM)
    tm = (m0 + (pid % per) % gm) * BM + tl.arange(0, BM)
    r0 = ((pid % per) // gm) * BN
    rows = r0 + tl.arange(0, BN)
    return tm, tm < M, r0, rows, rows < N


# ------------------------------------------------------------------------------------------------
# the "f16" precision's products on Q8C and F16 rows: one fp16 product per K-step, the scales
# folded into the load


@triton.jit
def x16_kernel(x_ptr, sx, out_ptr, lo_ptr, inv_ptr, R, K, BR: tl.constexpr, BC: tl.constexpr, PERM: tl.constexpr,
               LO: tl.constexpr = False):
    """x [R, K] float32 (row stride sx) -> out [R, K] fp16 = x·s rounded once and inv [R] = 1/s, s a
    power of two per row with the row's max·s in [2^14, 2^15) (_pow2_scale). PERM: each 256-value
    chunk's values in Q8C quant byte order (value 32·b + _q8c_value(p) of the chunk at byte
    32·b + p), so that a Q8C row's quant bytes meet the x values they multiply in order. LO: also
    lo [R, K] fp16, what x·s − out rounds to (_hi_lo: out + lo holds x·s to 2^-22). BC: a divisor
    of K, a multiple of 256."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < R
    r64 = r.to(tl.int64)
    j = tl.arange(0, BC)
    if PERM:
        src = (j // 32) * 32 + _q8c_value(j % 32)  # the value at byte j of a run of whole blocks
    else:
        src = j
    mx = tl.zeros([BR], tl.float32)
    for k0 in range(0, K, BC):
        x = tl.load(x_ptr + r64[:, None] * sx + k0 + j[None, :], mask=rm[:, None], other=0.0)
        mx = tl.maximum(mx, tl.max(tl.abs(x), axis=1))
    s, inv = _pow2_scale(mx)
    for k0 in range(0, K, BC):
        x = tl.load(x_ptr + r64[:, None] * sx + k0 + src[None, :], mask=rm[:, None], other=0.0)
        o = r64[:, None] * K + k0 + j[None, :]
        hi, lo = _hi_lo(x * s[:, None])  # (the scaling is exact)
        tl.store(out_ptr + o, hi, mask=rm[:, None])
        if LO:
            tl.store(lo_ptr + o, lo, mask=rm[:, None])
    tl.store(inv_ptr + r, inv, mask=rm)


@triton.jit
def _q8c_scaled(wb, wh, c, p, t, rmask, BN: tl.constexpr, BK: tl.constexpr):
    """Values [p, p + BK) of the Q8C chunks at byte offsets c [BN] (8 f16 scales, then 256 quant
    bytes), in quant byte order, times t [BN]: q·d·t [BN, BK] float32, exact (8 + 11 significant
    bits, t a power of two). p: a multiple of 32. The scales load once per block and are
    broadcast through a reshape: loading them per value, which keeps the tile's layout, made the
    fp16 products far slower (bench/triton/README.md)."""
    kk = tl.arange(0, BK)
    q = tl.load(wb + c[:, None] + 16 + p + kk[None, :], mask=rmask[:, None], other=128).to(tl.int32)
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # byte − 128, exactly (see _u8f)
    NU: tl.constexpr = BK // 32
    d = _ld_f16(wh, c[:, None] + (p // 32 + tl.arange(0, NU))[None, :] * 2, rmask[:, None]) * t[:, None]
    return tl.reshape(tl.reshape(qf, [BN, NU, 32]) * d[:, :, None], [BN, BK])


@triton.jit
def _f16w_step(x_ptr, xl_ptr, xo, mm, wb, wh, wl_ptr, ro, rmask, t, k0, acc,
               TYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LO: tl.constexpr, WLO: tl.constexpr):
    """acc + x[:, k0 : k0 + BK] · W[rows, k0 : k0 + BK]ᵀ: one K-step of matmul_f16w_kernel."""
    kk = tl.arange(0, BK)
    xt = tl.load(x_ptr + xo + k0, mask=mm[:, None], other=0.0)
    if TYPE == T_Q8C:
        w = _q8c_scaled(wb, wh, ro + (k0 // 256) * 272, k0 % 256, t, rmask, BN, BK).to(tl.float16)
    else:
        w = tl.load(wh + ro[:, None] // 2 + k0 + kk[None, :], mask=rmask[:, None], other=0.0)
    xl = tl.load(xl_ptr + xo + k0, mask=mm[:, None], other=0.0) if LO else xt
    if WLO > 0:  # the low plane's products first: the smaller terms before the larger
        wl = tl.load(wl_ptr + ro[:, None] // 2 + k0 + kk[None, :], mask=rmask[:, None], other=0.0)
        acc = _dot16(xt, xl, wl, acc, LO and WLO == 4)
    return _dot16(xt, xl, w, acc, LO)


@triton.jit
def matmul_f16w_kernel(x_ptr, xl_ptr, xinv_ptr, SX, wb, wh, wt_ptr, out_ptr, so_t, M, N, K, RB, GROUP_ROWS,
                       sx_g, wl_ptr, TYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GM: tl.constexpr, LO: tl.constexpr = False, WLO: tl.constexpr = 0,
                       FRESH: tl.constexpr = False):
    """out[M, N] = x[M, K] · W[N, K]ᵀ on fp16 tensor cores: x from x16_kernel (rows of SX values,
    fp16, 1/s per row; in quant byte order for Q8C) and W as fp16 values, so the K loop is plain
    fp16 products into one float32 accumulator and 1/s applies once at the end. TYPE Q8C: each
    weight q·d·t rounded once to fp16 as its bytes load (t [N] at wt_ptr: a power of two per row
    with the row's max |q·d|·t in [2^14, 2^15); 1/t applies at the end); TYPE F16: the weights
    as they are. LO: x's low term too (xl_ptr), two exact products a K-step, so F16 rows get
    float32-grade products; without it (the "f16" precision) x is rounded once. Rows of group
    g = r // GROUP_ROWS read x at column offset g·sx_g (a multiple of 256). BK: a divisor of
    256. Programs run GM row tiles of x per column tile of W, so that neighbours share W in L2.
    WLO 4 or 3 (TYPE F16, with LO): W in two fp16 planes, wh + wl (q8c_hl_kernel's split of Q8C
    rows, exact, scaled by t [N] at wt_ptr), and the four products of the two terms of x and of
    W, so that only x's 22 bits round, or three: the low terms' product, under 2^-24 of |x|·|w|,
    left out; 1/t applies at the end.
    FRESH: the tensor cores sum each K-step from zero and the kernel adds those partial sums in
    float32. The tensor cores align each product to the largest addend and drop the bits
    below, so one accumulator over all of K loses the small products against the large running
    sum; partial sums lose them only against their own size."""
    tm, mm, r0, rows, rmask = _tile_of(M, N, BM, BN, GM)
    ro = rows.to(tl.int64) * RB
    if TYPE == T_Q8C or WLO > 0:
        t = tl.load(wt_ptr + rows, mask=rmask, other=1.0)
    else:
        t = tl.full([BN], 1.0, tl.float32)
    kk = tl.arange(0, BK)
    xo = tm[:, None].to(tl.int64) * SX + (r0 // GROUP_ROWS) * sx_g + kk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        if FRESH:
            acc += _f16w_step(x_ptr, xl_ptr, xo, mm, wb, wh, wl_ptr, ro, rmask, t, k0, tl.zeros([BM, BN], tl.float32),
                              TYPE, BN, BK, LO, WLO)
        else:
            acc = _f16w_step(x_ptr, xl_ptr, xo, mm, wb, wh, wl_ptr, ro, rmask, t, k0, acc, TYPE, BN, BK, LO, WLO)
    out = acc * tl.load(xinv_ptr + tm, mask=mm, other=0.0)[:, None]
    if TYPE == T_Q8C or WLO > 0:
        out = out * (1.0 / t)[None, :]
    tl.store(out_ptr + tm[:, None].to(tl.int64) * so_t + rows[None, :], out, mask=mm[:, None] & rmask[None, :])


@triton.jit
def q8c_hl_kernel(wb, wh, wt_ptr, hi_ptr, lo_ptr, N, K, RB, BR: tl.constexpr):
    """Rows [BR·program, +BR) and 256-value chunk c = program 1 of Q8C rows [N, K] -> hi, lo
    [N, K] fp16 with hi + lo = q·d·t exactly, in quant byte order (x16_kernel's PERM order): q·d
    has 8 + 11 significant bits and t [N] (Linear._row_scale) brings the row's largest into
    [2^14, 2^15), so hi holds its top 11 bits and lo the rest (_hi_lo); lo is exact in fp16
    (its subnormals included) unless its block's scale is under 2^-21 of the row's largest, and
    then within 2^-39 of the row's largest. A transient copy of one weight, which
    matmul_f16w_kernel (WLO > 0) then reads as plain fp16 tiles."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < N
    c = tl.program_id(1)
    r64 = r.to(tl.int64)
    t = tl.load(wt_ptr + r, mask=rm, other=1.0)
    hi, lo = _hi_lo(_q8c_scaled(wb, wh, r64 * RB + c * 272, 0, t, rm, BR, 256))
    o = r64[:, None] * K + c * 256 + tl.arange(0, 256)[None, :]
    tl.store(hi_ptr + o, hi, mask=rm[:, None])
    tl.store(lo_ptr + o, lo, mask=rm[:, None])
