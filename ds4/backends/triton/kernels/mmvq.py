"""Matrix-vector products (decode): the activation quantizer `xq_kernel`, `matvec_kernel` and
`matvec_xq_kernel`, with the split-K reduction helpers.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .common import D_IQ2_GROUPS, D_IQ2_GROUPS_SMEM, D_Q8C_FLOAT, _ld4
from .decode import _dp4a, _mv_step, _xq_store
from .decode_rows import _iq2_group_rows, _q8c_rows, _row_join, _row_sets


@triton.jit
def xq_kernel(x_ptr, sx_t, w_ptr, s_ptr, sum_ptr, K, NBLK: tl.constexpr, PERM: tl.constexpr = False):
    """x [n, K] -> XQ, or XQ8 with PERM (K a multiple of 32): NBLK blocks of one token per program."""
    t = tl.program_id(0)
    b = tl.program_id(1) * NBLK + tl.arange(0, NBLK)
    bm = b < K // 32
    v = tl.load(x_ptr + t.to(tl.int64) * sx_t + b[:, None] * 32 + tl.arange(0, 32)[None, :], mask=bm[:, None],
                other=0.0)
    _xq_store(v, w_ptr + t * (K // 2), s_ptr + t * (K // 32), sum_ptr + t * (K // 16), tl.program_id(1) * NBLK, bm,
              PERM)


@triton.jit
def _pdl_wait():
    """griddepcontrol.wait: the kernel ahead on the stream has finished and its writes are
    visible. Returns 0 for the caller to add to the addresses of what that kernel wrote, so that
    LLVM does not schedule pure inline-assembly loads (_ld4) above the wait; ptxas sees the 0,
    so those loads must also be coherent ones (_ld4 NC=False): it keeps those below the wait
    (tests/test_triton_experts.py::test_early_launch_loads_x_after_its_wait)."""
    return tl.inline_asm_elementwise("griddepcontrol.wait;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _q8c_xq_q2(w64, ro, m, c0, c, b, p, r: tl.constexpr):
    """TYPE 309, one K-step's quant word pairs of row set r."""
    return tl.load(w64 + ro[r] // 2 + (c0 + c) * 34 + 2 + b * 4 + p, mask=m[r], other=0)


@triton.jit
def _q8c_xq_d(wh, ro, m, c0, c, b, r: tl.constexpr):
    """TYPE 309, one K-step's block scales (f16 bits) of row set r."""
    return tl.load(wh + ro[r] * 2 + (c0 + c) * 136 + b, mask=m[r], other=0)


@triton.jit
def _q8c_xq_step(acc, xw, xs, w64, wh, ro, m, pre, c0, c, b, p, R: tl.constexpr, NC: tl.constexpr,
                 PRE: tl.constexpr):
    """TYPE 309, one K-step: the accumulators plus the blocks' scaled integer dot products with
    x. PRE: the step's weights are `pre` (per row set its quant word pairs and scales, loaded
    before x), else each row set's are loaded after x. NC: x through the non-coherent path (_ld4)."""
    blk = (c0 + c) * 8 + b  # x's 32-value block
    h0, h1, l0, l1 = _ld4(xw + blk * 16 + p * 4, True, NC)
    sx = tl.load(xs + blk)
    nacc = ()
    for r in tl.static_range(R):
        if PRE:
            q2 = pre[r][0]
        else:
            q2 = _q8c_xq_q2(w64, ro, m, c0, c, b, p, r)
        qa = q2.to(tl.int32) ^ -2139062144  # 0x80808080: biased bytes -> signed
        qb = (q2 >> 32).to(tl.int32) ^ -2139062144
        z = tl.zeros(qa.shape, tl.int32)
        hs = _dp4a(qb, h1, _dp4a(qa, h0, z))
        ls = _dp4a(qb, l1, _dp4a(qa, l0, z))
        if PRE:
            d = pre[r][1]
        else:
            d = _q8c_xq_d(wh, ro, m, c0, c, b, r)
        d = d.to(tl.float16, bitcast=True)
        nacc = nacc + (acc[r] + (hs * 256 + ls).to(tl.float32) * (d.to(tl.float32) * sx),)
    return nacc


@triton.jit
def _q8c_xq_rows(xw, xs, wf, wh, row_off, rmask, K, sk, BN: tl.constexpr, NC: tl.constexpr, R: tl.constexpr,
                 S: tl.constexpr, PDL: tl.constexpr = False):
    """TYPE 309: W[rows]·x for Q8C rows on x in XQ8 form (xw: its words, xs: its block scales)
    over part sk of S of K, NC 256-value chunks per K-step, R rows per thread. A tile element is
    a pair of a block's quant words (one 8-byte load per row) and the four x words they meet (one
    16-byte load for the R rows): a quant byte q + 128 becomes q by one XOR per word, and the
    block's partial sum is four integer dot products (hi and lo bytes of x), exact in int32,
    scaled once by d·s. Where 308 loads x as floats (4 bytes a value), this loads 2.
    PDL (a launch that may start before the kernel ahead of it on its stream ends): the first
    K-step's weights are loaded, then the program waits for that kernel (griddepcontrol.wait)
    before it reads x, so the loads overlap that kernel's tail instead of following it."""
    ro = _row_sets(tl.multiple_of(row_off // 4, 4), R)  # in words (rows start on 16 bytes)
    m = _row_sets(rmask, R)
    c = tl.arange(0, NC)[None, :, None, None]
    b = tl.arange(0, 8)[None, None, :, None]
    p = tl.arange(0, 4)[None, None, None, :]  # the quant word pair 2p, 2p + 1 of block b
    w64 = wf.to(tl.pointer_type(tl.int64))
    acc = ()
    for r in tl.static_range(R):
        acc = acc + (tl.zeros([BN // R, NC, 8, 4], tl.float32),)
    IS = K // (256 * NC) // S
    i0 = sk * IS
    i1 = i0
    if PDL:
        pre = ()
        for r in tl.static_range(R):
            pre = pre + ((_q8c_xq_q2(w64, ro, m, i0 * NC, c, b, p, r), _q8c_xq_d(wh, ro, m, i0 * NC, c, b, r)),)
        z0 = _pdl_wait()
        xw += z0
        xs += z0
        acc = _q8c_xq_step(acc, xw, xs, w64, wh, ro, m, pre, i0 * NC, c, b, p, R, False, True)
        i1 = i0 + 1
    for i in range(i1, i0 + IS):
        acc = _q8c_xq_step(acc, xw, xs, w64, wh, ro, m, (), i * NC, c, b, p, R, not PDL, False)
    ys = ()
    for r in tl.static_range(R):
        ys = ys + (tl.sum(tl.sum(tl.sum(acc[r], axis=3), axis=2), axis=1),)
    return _row_join(ys, R, BN)


@triton.jit
def matvec_xq_kernel(xw_ptr, xs_ptr, sx_t, sx_g, wh, wf, out_ptr, so_t, ws_ptr, cnt_ptr, N, K, RB, GROUP_ROWS,
                     qw_ptr, qs_ptr, qsum_ptr,
                     BN: tl.constexpr, NB: tl.constexpr, R: tl.constexpr, S: tl.constexpr = 1,
                     XQOUT: tl.constexpr = False, PDL: tl.constexpr = False, DEP: tl.constexpr = False):
    """matvec_kernel for Q8C rows on x in XQ8 form (decoder 309): out[t, r] = W[r] · x[t], K split
    in S parts as there. sx_t, sx_g (values, multiples of 32): x's token stride and the column
    offset of each group of GROUP_ROWS rows. XQOUT (S = 1, N a multiple of 32): out also in XQ8
    form (qw_ptr, qs_ptr, qsum_ptr), for the next product's 309 without a launch of its own: a
    program of 32 rows or more stores its blocks, else the last of a block's 32 / BN programs to
    arrive (a ticket, as in _split_store) reads the block back from L2 and stores it.
    PDL: launched to start before the kernel ahead of it ends (_q8c_xq_rows); DEP: the kernel
    after it may launch once every program of this one has started (gdc_launch_dependents)."""
    if DEP:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    t = tl.program_id(1)
    sk = tl.program_id(2)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    xo = t * sx_t + ((pid * BN) // GROUP_ROWS) * sx_g
    y = _q8c_xq_rows(xw_ptr + xo // 2, xs_ptr + xo // 32, wf, wh, rows.to(tl.int64) * RB, rmask, K, sk, BN, NB, R, S,
                     PDL)
    _split_store(y, out_ptr + t * so_t, rows, rmask, ws_ptr + t * S * N, cnt_ptr, t * tl.num_programs(0) + pid,
                 sk, N, S)
    if XQOUT:
        qw, qs, qsum = qw_ptr + t * (N // 2), qs_ptr + t * (N // 32), qsum_ptr + t * (N // 16)
        if BN >= 32:
            b = (pid * BN) // 32 + tl.arange(0, BN // 32)
            _xq_store(tl.reshape(y, [BN // 32, 32]), qw, qs, qsum, (pid * BN) // 32, b < N // 32, True)
        else:
            blk = (pid * BN) // 32
            if _split_last(cnt_ptr, t * (N // 32) + blk, 32 // BN):
                v = tl.load(out_ptr + t * so_t + blk * 32 + tl.arange(0, 32), cache_modifier=".cg")
                _xq_store(tl.reshape(v, [1, 32]), qw, qs, qsum, blk, tl.arange(0, 1) < 1, True)
                _split_reset(cnt_ptr, t * (N // 32) + blk)


@triton.jit
def _mv_rows(xb, wb, wh, wf, gridp, ksigns, row_off, rmask, K, sk, rs, nw_ptr, eps,
             BN: tl.constexpr, TYPE: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr,
             VA: tl.constexpr, NORM: tl.constexpr, S: tl.constexpr = 1):
    """W[rows] · x̂ for BN rows over part sk of S equal parts of K: the K loop of every
    matrix-vector kernel (308: VA is the rows per thread, NB the chunks per K-step). NORM with
    S = 1: the norm's scale comes from the x values the loop loads (rs unused); with S > 1 the
    caller passes it (matvec_kernel's prologue: a program then sees only part of x)."""
    if TYPE == D_IQ2_GROUPS or TYPE == D_IQ2_GROUPS_SMEM:  # no fused norm (nor in 216, 110: _mv_cfg picks the generic one then)
        y = _iq2_group_rows(xb, wh, wf, gridp, row_off, rmask, K, sk, BN, NB, S, TYPE == D_IQ2_GROUPS_SMEM)
    elif TYPE == D_Q8C_FLOAT:
        y, ss = _q8c_rows(xb, wf, wh, row_off, rmask, K, sk, rs, nw_ptr, BN, NB, VA, NORM, S)
    else:
        BK: tl.constexpr = NB * VB
        IS = K // BK // S
        acc = tl.zeros([BN, NB, VA], tl.float32)
        ssv = tl.zeros([1, NB, VB], tl.float32)
        kv = tl.arange(0, NB)[None, :, None] * VB + tl.arange(0, VB)[None, None, :]
        for i in range(sk * IS, sk * IS + IS):
            if NORM != 0 and S == 1:  # (the step's x again, from L1: _mv_step loads it too)
                xr = tl.load(xb + i * BK + kv)
                ssv += xr * xr
            acc += _mv_step(xb, i * BK, wb, wh, wf, gridp, ksigns, row_off, rmask, rs, nw_ptr, TYPE, NB, VB, NORM)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        ss = tl.sum(ssv)
    if NORM != 0 and S == 1:
        y = y / tl.sqrt_rn(ss / K + eps)
    return y


@triton.jit
def _split_store(y, out_ptr, rows, rmask, ws_ptr, cnt_ptr, tile, sk, N, S: tl.constexpr):
    """Store y [BN] (rows of one output tile) or, with K split in S parts (grid axis 2 = sk), its
    part: each program writes its partial sum to the workspace (ws_ptr: this token's [S, N]), and
    the tile's last program to arrive (a ticket from an acq_rel counter) adds the S partials in the
    order 0..S−1, so the result does not depend on the order the programs ran in, and resets the
    counter for the next launch."""
    if S == 1:
        tl.store(out_ptr + rows, y, mask=rmask)
    else:
        tl.store(ws_ptr + sk * N + rows, y, mask=rmask)
        if _split_last(cnt_ptr, tile, S):
            tl.store(out_ptr + rows, _split_sum(ws_ptr, rows, rmask, N, S), mask=rmask)
            _split_reset(cnt_ptr, tile)


@triton.jit
def _split_last(cnt_ptr, tile, S: tl.constexpr):
    """Whether this program is the last of the tile's S to arrive, once its partials are stored."""
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == S - 1


@triton.jit
def _split_sum(ws_ptr, rows, rmask, stride, S: tl.constexpr):
    """The S partials at ws_ptr + j·stride, added in the order j = 0..S−1 (read from L2: other
    SMs wrote them)."""
    tot = tl.zeros(rows.shape, tl.float32)
    for j in tl.static_range(S):
        tot += tl.load(ws_ptr + j * stride + rows, mask=rmask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def _split_reset(cnt_ptr, tile):
    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def matvec_kernel(x_ptr, sx_t, sx_g, nw_ptr, wb, wh, wf, gridp, ksigns, out_ptr, so_t, ws_ptr, cnt_ptr,
                  N, K, RB, GROUP_ROWS, eps,
                  TYPE: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, VB: tl.constexpr,
                  VA: tl.constexpr, NORM: tl.constexpr, S: tl.constexpr = 1):
    """out[t, r] = W[r] · x̂[t] for a few tokens t (grid axis 1), K split in S parts (grid axis
    2, _split_store) where the rows alone make too few programs to keep enough bytes in flight.
    NORM 1/2 applies the weighted / unweighted RMSNorm to x first: each program works out the
    scale itself (x is small, the weight is not), from the x values its K loop loads when it has
    the whole of K, else in a prologue over all of x. Either way every program redoes that work
    on x, so where the programs together would read x 2^22 times over the backend normalises x
    once first instead (norm_fuse_max). Rows r of group g = r // GROUP_ROWS read x at column
    offset g·sx_g (grouped projections)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    sk = tl.program_id(2)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    row_off = rows.to(tl.int64) * RB
    xb = x_ptr + t * sx_t + ((pid * BN) // GROUP_ROWS) * sx_g
    rs = 1.0
    if NORM != 0 and S > 1:  # 2048 values per step: a few independent loads, not one per K-step
        kv = tl.arange(0, 2048)
        ss = tl.zeros([2048], tl.float32)
        for k0 in range(0, K, 2048):
            xv = tl.load(xb + k0 + kv, mask=k0 + kv < K, other=0.0)
            ss += xv * xv
        rs = tl.sqrt_rn(tl.sum(ss) / K + eps)
    y = _mv_rows(xb, wb, wh, wf, gridp, ksigns, row_off, rmask, K, sk, rs, nw_ptr, eps, BN, TYPE, NB, VB, VA, NORM, S)
    _split_store(y, out_ptr + t * so_t, rows, rmask, ws_ptr + t * S * N, cnt_ptr, t * tl.num_programs(0) + pid,
                 sk, N, S)
