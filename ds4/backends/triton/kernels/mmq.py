"""Matrix-matrix products (prefill) of quantized weights: `matmul_kernel`."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot_units, _wtile


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


# ------------------------------------------------------------------------------------------------
# routed and shared experts
