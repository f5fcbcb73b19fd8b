"""Linear layers of the Triton backend: decode products (matrix-vector, or the Q8C_XQ8 path on
x in XQ8 form) and prefill products (matrix-matrix, or the fp16 path: Q8C and F16 rows under
the "f16" precision; under bf16x3 F16 rows on x in two fp16 terms, and Q8C rows split into two
fp16 planes against x in two terms)."""

from __future__ import annotations

import torch

from . import kernels as K
from .formats import Decoder, KernelType
from .plumbing import MM_MIN, QWeight, _Normed, _Quantized, _cdiv, _largest_pow2_divisor, _x16
from .tuning import INTEGER_PRECISIONS, ONE_TERM

ROW_SCALE_ROWS = 8192  # rows per pass of _row_scale
MAX_POW2 = 126  # the largest scale exponent whose reciprocal stays a normal float32
# the most weights whose fp16 planes a prefill group keeps (hl_keep): a layer's attention has up
# to five Q8C weights; the bound caps what a group cut short by an error leaves behind
HL_KEEP_MAX = 8


class _LinearOps:
    """The linear layers of TritonBackend (a mixin: it uses the state TritonBackend.__init__ sets up)."""

    # ---- linear layers --------------------------------------------------------------------------

    def _takes_xq8(self, w: QWeight, n: int) -> bool:
        """Whether a decode product of n tokens on w reads x in XQ8 form (decoder 309)."""
        return n < MM_MIN and w.kt == KernelType.Q8C and self._mv_cfg(w.kt, w.N, w.K, n, xq=True)["TYPE"] == Decoder.Q8C_XQ8

    def _linear(self, x, w: QWeight, group_rows: int = 0, group_stride: int = 0, xq_out: bool = False):
        """x [n, K(·groups)] -> [n, N]. Rows of group g read x columns [g·stride, +K). xq_out: the
        result also in XQ8 form where the product can store it (309; then a _Quantized)."""
        N, Kd = w.N, w.K
        gr = group_rows or (1 << 30)
        if x.shape[0] < MM_MIN and w.kt == KernelType.Q8C and group_stride % 32 == 0:
            c = self._mv_cfg(w.kt, N, Kd, x.shape[0], xq=True)  # (the test of _takes_xq8, its config kept)
            if c["TYPE"] == Decoder.Q8C_XQ8:
                return self._linear_xq(x, w, c, gr, group_stride, xq_out)
        norm = 0
        nw = self._dummy_f
        if isinstance(x, _Normed) and x.val is None and x.shape[0] < MM_MIN and not group_rows:
            src = self._val(x.x)
            norm = 2 if x.w is None else 1
            nw = self._dummy_f if x.w is None else x.w.vec
            c = self._mv_cfg(w.kt, N, Kd, src.shape[0], norm, x16=_x16(src, src.stride(0)))
            if _cdiv(N, c["BN"]) * Kd >= self.norm_fuse_max:  # normalise x once instead (rms_kernel)
                src, norm, nw = self._val(x), 0, self._dummy_f
        else:
            src = self._val(x)
        n = src.shape[0]
        sx_t = src.stride(0)
        out = self._new((n, N))
        if n < MM_MIN:
            c = self._mv_cfg(w.kt, N, Kd, n, norm, x16=_x16(src, sx_t, group_stride))
            if group_rows:
                c["BN"] = min(c["BN"], _largest_pow2_divisor(group_rows, c["BN"]))
            S = c["S"]
            tiles = _cdiv(N, c["BN"])
            self._tiles_ok(tiles * n, S)
            ws = self._new((n, S, N)) if S > 1 else self._dummy_f
            self._launch(K.matvec_kernel, (tiles, n, S), src, sx_t, group_stride, nw,
                         w.b8, w.i16, w.f32, self._gridp, self._ksigns, out, N, ws, self._tickets(),
                         N, Kd, w.RB, gr, self.cfg.rms_eps, NORM=norm, **c,
                         nbytes=w.RB * N + 4 * n * (Kd + N))
        elif self._f16w(w, src, group_stride):
            self._matmul16(src, w, out, group_rows, group_stride, split=self._split_of(x, w, src))
        else:
            mc = self._mm_cfg(w.kt, Kd)
            BM, BN, warps = self.mm_tile_q8 if mc["U"] and not self.interpret else self.mm_tile
            if group_rows:
                BN = min(BN, _largest_pow2_divisor(group_rows, BN))
            self._launch(K.matmul_kernel, (_cdiv(n, BM), _cdiv(N, BN)), src, sx_t, group_stride,
                         w.b8, w.i16, w.f32, self._gridp, self._ksigns, out, N,
                         n, N, Kd, w.RB, gr, TYPE=w.kt, BM=BM, BN=BN, **mc,
                         num_warps=warps, num_stages=2, flops=2 * n * N * Kd, nbytes=w.RB * N + 4 * n * (Kd + N))
        return out

    def _matmul16(self, src, w: QWeight, out, group_rows: int = 0, group_stride: int = 0, split=None):
        """out [n, N] = src · Wᵀ on the fp16 path (matmul_f16w_kernel; _f16w says when it applies).
        split: src's _x16_for(w, src) when a caller already has it (products that share their x)."""
        n, N, Kd = src.shape[0], w.N, w.K
        q8 = w.kt == KernelType.Q8C
        lo = self._x_lo  # F16 rows under bf16x3: x in two fp16 terms
        hl = q8 and lo  # Q8C rows under bf16x3: W in two fp16 planes too (q8_hl)
        xs, xl, xinv = split or self._x16_for(w, src)
        # two terms of x (bf16x3): hl_tile, whose 8 warps hold the partial sum beside the accumulator
        BM, BN, BK, GM, warps, stages = self.hl_tile if lo else self.f16w_tile
        if group_rows:
            BN = min(BN, _largest_pow2_divisor(group_rows, BN))
        t = self._row_scale(w) if q8 else self._dummy_f
        # F16 rows as fp16 (a load straight into the tensor cores' tiles is what gets pipelined)
        wh, RB, kt, wl = (w.i16 if q8 else w.i16.view(torch.float16)), w.RB, w.kt, self._dummy_h
        if hl:
            wh, wl = self._q8c_hl(w, t)
            RB, kt = 2 * Kd, KernelType.F16
        self._launch(K.matmul_f16w_kernel, (_cdiv(n, BM) * _cdiv(N, BN),), xs, xl, xinv, xs.shape[1], w.b8,
                     wh, t, out, N, n, N, Kd, RB, group_rows or (1 << 30), group_stride, wl,
                     TYPE=kt, BM=BM, BN=BN, BK=BK, GM=GM, LO=lo, WLO=self.hl_products if hl else 0,
                     FRESH=lo and self.hl_fresh,
                     num_warps=warps, num_stages=stages,
                     flops=2 * n * N * Kd, nbytes=RB * N * (2 if hl else 1) + (4 if lo else 2) * n * Kd + 4 * n * N)
        return out

    def _f16w(self, w: QWeight, x, group_stride: int) -> bool:
        """Whether a prefill product takes the fp16 path (matmul_f16w_kernel): under the "f16"
        precision Q8C or F16 rows (f16w_types), under bf16x3 F16 rows (f16_x2), whose weights are
        exact in fp16, and Q8C rows split into two fp16 planes (q8_hl); whole 256-value chunks of
        x and groups starting on chunk boundaries."""
        if self.prec == ONE_TERM:
            takes = self.q8_f16w and w.kt in self.f16w_types
        else:
            takes = self.prec in INTEGER_PRECISIONS and (
                (self.f16_x2 and w.kt == KernelType.F16) or (self.q8_hl and w.kt == KernelType.Q8C))
        return (takes and x.shape[1] % 256 == 0 and w.K % 256 == 0 and group_stride % 256 == 0
                and x.stride(1) == 1)

    def _split_of(self, x, w: QWeight, src):
        """src (x materialised)'s _x16_for(w, src), kept on a lazy normed x for the other prefill
        products that read it (a layer's attention input feeds wq_a, wkv and the compressors' and
        indexer's products: two splits, one per byte order, instead of up to seven); None for
        other inputs (_matmul16 splits them itself)."""
        if not isinstance(x, _Normed):
            return None
        key = (w.kt == KernelType.Q8C, self._x_lo)
        if key not in x.x16:
            x.x16[key] = self._x16_for(w, src)
        return x.x16[key]

    def _x16_for(self, w: QWeight, x):
        """x split as _matmul16 multiplies it by w: in Q8C quant byte order for Q8C rows, with
        its low term unless the precision rounds x once (_x16)."""
        return self._x16(x, perm=w.kt == KernelType.Q8C, lo=self._x_lo)

    def _x16(self, x, perm: bool, lo: bool = False):
        """x [R, K] float32 -> (x·s in fp16 [R, K], with perm each chunk in Q8C byte order; with lo
        what x·s − that rounds to in fp16, else the first again as a placeholder; 1/s [R]):
        x16_kernel."""
        R, Kd = x.shape
        xs = torch.empty((R, Kd), dtype=torch.float16, device=self.dev)
        xl = torch.empty((R, Kd), dtype=torch.float16, device=self.dev) if lo else xs
        inv = torch.empty(R, dtype=torch.float32, device=self.dev)
        BR = 16 if self.interpret else 4
        self._launch(K.x16_kernel, (_cdiv(R, BR),), x, x.stride(0), xs, xl, inv, R, Kd, BR=BR, BC=256, PERM=perm,
                     LO=lo, num_warps=4, nbytes=(12 if lo else 10) * R * Kd)
        return xs, xl, inv

    def _q8c_hl(self, w: QWeight, t):
        """Q8C rows [N, K] -> (hi, lo) [N, K] fp16, hi + lo = each weight times its row's t,
        exactly, in quant byte order: q8c_hl_kernel, into buffers of this product only, or of
        the layer's chunks in a prefill group (hl_keep: the same planes for each chunk)."""
        kept = self._hl_kept if self.hl_keep else None
        if kept is not None and id(w) in kept and kept[id(w)][0] is w:
            return kept[id(w)][1:]
        hi = torch.empty((w.N, w.K), dtype=torch.float16, device=self.dev)
        lo = torch.empty_like(hi)
        BR = self.hl_split_rows
        self._launch(K.q8c_hl_kernel, (_cdiv(w.N, BR), w.K // 256), w.b8, w.i16, t, hi, lo, w.N, w.K, w.RB,
                     BR=BR, num_warps=4, nbytes=w.RB * w.N + 4 * w.N * w.K)
        if kept is not None:
            kept[id(w)] = (w, hi, lo)
            while len(kept) > HL_KEEP_MAX:
                kept.pop(next(iter(kept)))
        return hi, lo

    def _row_scale(self, w: QWeight):
        """The powers of two t [N] that bring each Q8C row's largest |q·d| into [2^14, 2^15) (the
        fp16 weights of matmul_f16w_kernel), computed once per weight from its bytes."""
        t = w.f16_row_scale
        if t is None:
            rows = w.u8.reshape(w.N, w.K // 256, 272)
            m = torch.empty(w.N, dtype=torch.float32, device=self.dev)
            for r0 in range(0, w.N, ROW_SCALE_ROWS):  # bounded temporaries for the 129280-row head
                b = rows[r0:r0 + ROW_SCALE_ROWS]
                d = b[..., :16].contiguous().view(torch.float16).float().abs()  # [rows, chunks, 8]
                q = (b[..., 16:].to(torch.int16) - 128).abs().reshape(*d.shape, 32).amax(-1).float()
                m[r0:r0 + ROW_SCALE_ROWS] = (q * d).amax(dim=(1, 2))  # exact: q·d has 8 + 11 bits
            _, e = torch.frexp(m)  # m = f·2^e with f in [0.5, 1): m·2^(15−e) lies in [2^14, 2^15)
            t = torch.where(m > 0, torch.ldexp(torch.ones_like(m), (15 - e).clamp(max=MAX_POW2)),
                            torch.ones_like(m))
            w.f16_row_scale = t
        return t

    def _linear_xq(self, x, w: QWeight, c: dict, gr: int, group_stride: int, xq_out: bool):
        """A decode product on Q8C rows through decoder 309 (c: its _mv_cfg), x in XQ8 form; with
        xq_out and one K part, the result in XQ8 form too (-> _Quantized)."""
        xw, xs, _ = self._xq(x, perm=True)
        n, N = x.shape[0], w.N
        width = 2 * xw.shape[1]
        BN = _largest_pow2_divisor(gr, c["BN"])  # a program's rows within one group (gr: 2^30 without groups)
        S = c["S"]
        tiles = _cdiv(N, BN)
        self._tiles_ok(tiles * n, S)
        xq_out = xq_out and S == 1 and N % 32 == 0
        if xq_out:
            self._tiles_ok(n * N // 32, 2)  # a ticket per 32-row block
        q = self._xq_new(n, N) if xq_out else (self._dummy_i, self._dummy_f, self._dummy_f)
        out = self._new((n, N))
        ws = self._new((n, S, N)) if S > 1 else self._dummy_f
        pdl = dict(PDL=True, DEP=self._pdl("xq"), launch_pdl=True) if self._pdl() else {}
        self._launch(K.matvec_xq_kernel, (tiles, n, S), xw, xs, width, group_stride, w.i16, w.f32, out, N,
                     ws, self._tickets(), N, w.K, w.RB, gr, *q, BN=BN, NB=c["NB"], R=c["VA"], S=S, XQOUT=xq_out,
                     num_warps=c["num_warps"], nbytes=w.RB * N + 2 * n * width + (7 if xq_out else 4) * n * N, **pdl)
        return _Quantized(out, q) if xq_out else out
