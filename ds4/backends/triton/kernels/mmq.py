"""Matrix-matrix products (prefill) of quantized weights: `matmul_kernel` (every type), Q8C rows
on int8 tensor cores with x in fixed point as int8 planes (`xq_planes_kernel`,
`matmul_xq_kernel`), and the "f16" precision's path for Q8C and F16 rows (`x16_kernel`,
`matmul_f16w_kernel`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _INTERP, T_Q8C, _dot_units, _ld_f16, _pow2_scale, _q8c_value, _wtile
from .decode import _xq_fixed


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
# Q8C rows on int8 tensor cores: x in fixed point per 32-value block, its bytes as int8 planes.
# TERMS 2: XQ, the 16-bit form the decode's integer products read (decode._xq_fixed); TERMS 3:
# 24 bits, XQ3_MAX = 127·65793 (the largest q whose three signed bytes fit), which holds each
# value to amax / 2^24 of its block: float32's reach.

XQ3_MAX = tl.constexpr(8355711.0)


@triton.jit
def _signed_byte(q):
    """The low byte of q as a signed byte (q − it is then a multiple of 256)."""
    return ((q + 128) & 255) - 128


@triton.jit
def xq_planes_kernel(x_ptr, sx, out_ptr, s_ptr, R, K, TERMS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """x [R, K] float32 (row stride sx) -> its fixed point per 32-value block: out [TERMS, R, K]
    int8, the planes of q's signed bytes from the highest (value = s·q, q = Σ_t 256^(TERMS−1−t)·
    plane_t), each block's values in the Q8C byte order (byte p of a block holds value
    _q8c_value(p)) so that a Q8C row's quant bytes meet the x bytes they multiply in order; s
    [R, K / 32] float32, the block scales. BC: a divisor of K, a multiple of 32; programs [row
    tiles, K / BC]."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < R
    r64 = r.to(tl.int64)
    k0 = tl.program_id(1) * BC
    j = tl.arange(0, BC)
    src = (j // 32) * 32 + _q8c_value(j % 32)
    v = tl.load(x_ptr + r64[:, None] * sx + k0 + src[None, :], mask=rm[:, None], other=0.0)
    NBK: tl.constexpr = BC // 32
    off = r64[:, None] * K + k0 + j[None, :]
    PS = R.to(tl.int64) * K
    if TERMS == 2:
        _, hi, lo, s = _xq_fixed(tl.reshape(v, [BR * NBK, 32]))
        tl.store(out_ptr + off, tl.reshape(hi, [BR, BC]).to(tl.int8), mask=rm[:, None])
        tl.store(out_ptr + PS + off, tl.reshape(lo, [BR, BC]).to(tl.int8), mask=rm[:, None])
    else:
        vb = tl.reshape(v, [BR * NBK, 32])
        amax = tl.max(tl.abs(vb), axis=1)
        inv = tl.where(amax > 0, XQ3_MAX / tl.where(amax > 0, amax, 1.0), 0.0)
        # (amax·inv itself may land half a step above XQ3_MAX in float32, where the step is 1/2)
        q = tl.minimum(tl.maximum(tl.floor(vb * inv[:, None] + 0.5), -XQ3_MAX), XQ3_MAX).to(tl.int32)
        lo = _signed_byte(q)
        q = (q - lo) >> 8
        mid = _signed_byte(q)
        hi = (q - mid) >> 8
        s = amax / XQ3_MAX
        tl.store(out_ptr + off, tl.reshape(hi, [BR, BC]).to(tl.int8), mask=rm[:, None])
        tl.store(out_ptr + PS + off, tl.reshape(mid, [BR, BC]).to(tl.int8), mask=rm[:, None])
        tl.store(out_ptr + 2 * PS + off, tl.reshape(lo, [BR, BC]).to(tl.int8), mask=rm[:, None])
    b = tl.arange(0, NBK)
    tl.store(s_ptr + r64[:, None] * (K // 32) + k0 // 32 + b[None, :], tl.reshape(s, [BR, NBK]), mask=rm[:, None])


@triton.jit
def matmul_xq_kernel(xq_ptr, xs_ptr, SX, PS, wb, wh, out_ptr, so_t, M, N, K, RB, GROUP_ROWS, sx_g,
                     TERMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GM: tl.constexpr):
    """out[M, N] = x[M, K] · W[N, K]ᵀ for Q8C rows, x as TERMS int8 planes (PS apart) of SX values
    a row and block scales (xq_planes_kernel). Each 32-value block is TERMS int8 tensor-core
    products, x's bytes against the quant bytes (q + 128 made q by flipping the top bit), exact
    in int32 and joined as Σ 256^(TERMS−1−t)·product_t (the last term in float32 for 3); the block
    then adds its sum times x's and W's block scales to the float32 accumulator. Rows of group
    g = r // GROUP_ROWS read x at column offset g·sx_g (a multiple of 256). Programs run GM row
    tiles of x per column tile of W, so that neighbours share W in L2."""
    tm, mm, r0, rows, rmask = _tile_of(M, N, BM, BN, GM)
    ro = rows.to(tl.int64) * RB
    xo = (r0 // GROUP_ROWS) * sx_g
    xrow = xq_ptr + tm[:, None].to(tl.int64) * SX + xo
    srow = tm.to(tl.int64) * (SX // 32) + xo // 32
    kk = tl.arange(0, 32)
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, K, 32):
        c = ro + (kb // 256) * 272  # the chunk: 8 f16 scales, then 256 quant bytes
        i = (kb // 32) % 8
        qb = tl.load(wb + c[:, None] + 16 + i * 32 + kk[None, :], mask=rmask[:, None], other=128)
        qt = tl.trans((qb ^ 128).to(tl.int8, bitcast=True))
        x0 = tl.load(xrow + kb + kk[None, :], mask=mm[:, None], other=0)
        x1 = tl.load(xrow + PS + kb + kk[None, :], mask=mm[:, None], other=0)
        p = tl.dot(x1, qt, tl.dot(x0, qt, out_dtype=tl.int32) * 256, out_dtype=tl.int32).to(tl.float32)
        if TERMS == 3:
            x2 = tl.load(xrow + 2 * PS + kb + kk[None, :], mask=mm[:, None], other=0)
            p = p * 256.0 + tl.dot(x2, qt, out_dtype=tl.int32).to(tl.float32)
        sx = tl.load(xs_ptr + srow + kb // 32, mask=mm, other=0.0)
        d = _ld_f16(wh, c + 2 * i, rmask)
        acc += (p * sx[:, None]) * d[None, :]
    tl.store(out_ptr + tm[:, None].to(tl.int64) * so_t + rows[None, :], acc, mask=mm[:, None] & rmask[None, :])


# ------------------------------------------------------------------------------------------------
# the "f16" precision's products on Q8C and F16 rows: one fp16 product per K-step, the scales
# folded into the load


@triton.jit
def x16_kernel(x_ptr, sx, out_ptr, inv_ptr, R, K, BR: tl.constexpr, BC: tl.constexpr, PERM: tl.constexpr):
    """x [R, K] float32 (row stride sx) -> out [R, K] fp16 = x·s rounded once and inv [R] = 1/s, s a
    power of two per row with the row's max·s in [2^14, 2^15) (_pow2_scale). PERM: each 256-value
    chunk's values in Q8C quant byte order (value 32·b + _q8c_value(p) of the chunk at byte
    32·b + p), so that a Q8C row's quant bytes meet the x values they multiply in order. BC: a
    divisor of K, a multiple of 256."""
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
        tl.store(out_ptr + r64[:, None] * K + k0 + j[None, :], (x * s[:, None]).to(tl.float16), mask=rm[:, None])
    tl.store(inv_ptr + r, inv, mask=rm)


@triton.jit
def matmul_f16w_kernel(x_ptr, xinv_ptr, SX, wb, wh, wt_ptr, out_ptr, so_t, M, N, K, RB, GROUP_ROWS, sx_g,
                       TYPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GM: tl.constexpr):
    """out[M, N] = x[M, K] · W[N, K]ᵀ under the "f16" precision: x from x16_kernel (rows of SX
    values, fp16, 1/s per row; in quant byte order for Q8C) and W as fp16 values, so the K loop
    is plain fp16 tensor-core products into one float32 accumulator and 1/s applies once at the
    end. TYPE Q8C: each weight q·d·t rounded once to fp16 as its bytes load (t [N] at wt_ptr: a
    power of two per row with the row's max |q·d|·t in [2^14, 2^15); 1/t applies at the end);
    TYPE F16: the weights as they are. Rows of group g = r // GROUP_ROWS read x at column offset
    g·sx_g (a multiple of 256). BK: a divisor of 256. Programs run GM row tiles of x per column
    tile of W, so that neighbours share W in L2. The block scales load once per block and are
    broadcast through a reshape: loading them per value, which keeps the tile's layout, made the
    kernel far slower (bench/triton/README.md)."""
    tm, mm, r0, rows, rmask = _tile_of(M, N, BM, BN, GM)
    ro = rows.to(tl.int64) * RB
    if TYPE == T_Q8C:
        t = tl.load(wt_ptr + rows, mask=rmask, other=1.0)
    kk = tl.arange(0, BK)
    xrow = x_ptr + tm[:, None].to(tl.int64) * SX + (r0 // GROUP_ROWS) * sx_g
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        xt = tl.load(xrow + k0 + kk[None, :], mask=mm[:, None], other=0.0)
        if TYPE == T_Q8C:
            c = ro + (k0 // 256) * 272  # the chunk: 8 f16 scales, then 256 quant bytes
            p = k0 % 256
            q = tl.load(wb + c[:, None] + 16 + p + kk[None, :], mask=rmask[:, None], other=128).to(tl.int32)
            qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # byte − 128, exactly (see _u8f)
            NU: tl.constexpr = BK // 32
            d = _ld_f16(wh, c[:, None] + (p // 32 + tl.arange(0, NU))[None, :] * 2, rmask[:, None]) * t[:, None]
            w = tl.reshape(tl.reshape(qf, [BN, NU, 32]) * d[:, :, None], [BN, BK]).to(tl.float16)
        else:
            w = tl.load(wh + ro[:, None] // 2 + k0 + kk[None, :], mask=rmask[:, None], other=0).to(tl.float16,
                                                                                                  bitcast=True)
        if _INTERP:  # the interpreter's fp16 products are not trustworthy: the same values in float32
            acc = tl.dot(xt.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    out = acc * tl.load(xinv_ptr + tm, mask=mm, other=0.0)[:, None]
    if TYPE == T_Q8C:
        out = out * (1.0 / t)[None, :]
    tl.store(out_ptr + tm[:, None].to(tl.int64) * so_t + rows[None, :], out, mask=mm[:, None] & rmask[None, :])
