"""Mixture-of-experts ops of the Triton backend: the router, the routed experts (decode
matrix-vector kernels, prefill grouped tiles or integer fp16 tiles), XQ quantization of
activations and the shared expert."""

from __future__ import annotations

import numpy as np
import torch

from . import kernels as K
from . import kernels_mm16 as K16
from . import kernels_mm8 as K8
from .formats import Decoder, KernelType
from .plumbing import MM_MIN, QWeight, _Combined, _Normed, _cdiv, _op, _pow2, _x16
from .tuning import INTEGER_PRECISIONS

SWIGLU_BLOCK = 1024  # values per program of swiglu_kernel
MM8_PLANES = (3, 2)  # the int8 down's digit planes of h (kernels_mm8.py)


class _MoeOps:
    """The mixture-of-experts ops of TritonBackend (a mixin: it uses the state TritonBackend.__init__ sets up)."""

    @_op
    def router(self, f, gate_inp, bias, tid2eid, tokens, il):
        cfg = self.cfg
        logits = self._linear(f, gate_inp)
        n, NE = logits.shape
        k = cfg.n_expert_used
        ids = self._new((n, k), torch.int32)
        wts = self._new((n, k))
        self._launch(K.router_kernel, (n,), logits, NE, bias.vec if bias is not None else self._dummy_f,
                     tid2eid.i32 if tid2eid is not None else self._dummy_i, self._tokens_dev(tokens), ids, wts,
                     float(cfg.expert_weights_scale), KSEL=k, KP=_pow2(k), BE=_pow2(NE),
                     HAS_BIAS=bias is not None, HASH=tid2eid is not None,
                     num_warps=1, nbytes=8 * n * NE)  # one warp: its reductions need no barrier
        return ids, wts

    def _gateup_mv(self, x, gate: QWeight, up: QWeight, ids, wts, slots: int, kslots: int, clamp: float,
                   c: dict | None = None, xq=None, hq=None):
        """Decode gate/up products -> h [slots, F]. c: the launch parameters (_mv_cfg), xq: x in
        XQ form where c's decoder reads it (418), hq: buffers (_xq_new) that also get h in XQ form."""
        E, F = gate.K, gate.N
        h = self._new((slots, F))
        routed = ids is not None
        if c is None:
            c = self._mv_cfg(gate.kt, F, E, slots, kind="gateup", x16=_x16(x, x.stride(0)))
        qout = hq is not None
        if qout:  # a tile stores whole 32-value XQ blocks of h
            c = dict(c, BN=max(c["BN"], 32))
        S = c["S"]
        self._tiles_ok(_cdiv(F, c["BN"]) * slots, S)
        hq = hq if qout else (self._dummy_i, self._dummy_f, self._dummy_f)
        xw, xs = (xq[0], xq[1]) if c["TYPE"] in (Decoder.IQ2_GROUPS_XQ, Decoder.Q8C_XQ8) else (self._dummy_i, self._dummy_f)
        self._launch(K.moe_gateup_mv_kernel, (_cdiv(F, c["BN"]), slots, S), x, x.stride(0),
                     ids if routed else self._dummy_i, wts if routed else self._dummy_f,
                     gate.b8, gate.i16, gate.f32, up.b8, up.i16, up.f32, self._gridp, self._ksigns, h,
                     self._new((slots, S, 2, F)) if S > 1 else self._dummy_f, self._tickets(),
                     xw, xs, *hq, F, E, gate.RB, F * gate.RB, kslots, float(clamp), ROUTED=routed, QOUT=qout, **c,
                     nbytes=slots * (2 * F * gate.RB + 4 * (E + F)))
        return h

    def _down_mv(self, h, ids, down: QWeight, n: int, k: int, c: dict | None = None, hq=None):
        """Decode down products: out[t] = Σ_j down_{ids[t, j]} · h[t·k + j], in slot order (h in
        XQ form, hq, where c's decoder reads it: 111, 113)."""
        F, E = down.K, down.N
        out = self._new((n, E))
        if c is None:
            c = self._mv_cfg(down.kt, E, F, n, kind="down", x16=_x16(h, F))
        S = c["S"]
        self._tiles_ok(_cdiv(E, c["BN"]) * n, S)
        hq = hq if c["TYPE"] in (Decoder.Q2_K_XQ, Decoder.Q2S_HALVES_XQ) else (self._dummy_i, self._dummy_f, self._dummy_f)
        self._launch(K.moe_down_mv_kernel, (_cdiv(E, c["BN"]), n, S), h, ids, down.b8, down.i16, down.f32,
                     self._gridp, self._ksigns, out, self._new((n, S, E)) if S > 1 else self._dummy_f,
                     self._tickets(), *hq, E, F, down.RB, E * down.RB, KSLOTS=k, **c,
                     nbytes=n * k * (E * down.RB + 4 * F) + 4 * n * E)
        return out

    def _routed_mv(self, f, gate: QWeight, up: QWeight, down: QWeight, ids, wts, n: int, k: int, clamp: float):
        """The routed experts of a decode step. With the integer decoders (418 for the gate/up,
        113 or 111 for the down) x and h go to them in XQ form: x from the norm's kernel
        (_xq), h from the gate/up's own tiles."""
        E, F = gate.K, gate.N
        cg = self._mv_cfg(gate.kt, F, E, n * k, kind="gateup", xq=E % 32 == 0 and up.kt == gate.kt)
        xq = self._xq(f) if cg["TYPE"] == Decoder.IQ2_GROUPS_XQ else None  # (before _val: the norm's kernel writes both)
        x = self._val(f)
        if xq is None:  # a float decoder of x: its own alignment check
            cg = self._mv_cfg(gate.kt, F, E, n * k, kind="gateup", x16=_x16(x, x.stride(0)))
        # the down's decoder: 111 and 113 read h in XQ form, which the gate/up then also stores
        cd = self._mv_cfg(down.kt, E, F, n, kind="down", xq=F % 32 == 0)
        hq = self._xq_new(n * k, F) if cd["TYPE"] in (Decoder.Q2_K_XQ, Decoder.Q2S_HALVES_XQ) else None
        h = self._gateup_mv(x, gate, up, ids, wts, n * k, k, clamp, c=cg, xq=xq, hq=hq)
        if hq is None:  # a float decoder of h: its own alignment check
            cd = self._mv_cfg(down.kt, E, F, n, kind="down", x16=_x16(h, F))
        return self._down_mv(h, ids, down, n, k, c=cd, hq=hq)

    def _rms(self, x: _Normed, xq=None, perm: bool = False) -> torch.Tensor:
        """x's RMSNorm (rms_kernel), and with xq (buffers from _xq_new; x's width a power of two)
        the result in XQ form too (XQ8 with perm)."""
        src = self._val(x.x)
        n, D = src.shape
        out = self._new((n, D))
        w = self._dummy_f if x.w is None else x.w.vec
        q = xq if xq is not None else (self._dummy_i, self._dummy_f, self._dummy_f)
        self._launch(K.rms_kernel, (n,), src, w, out, D, self.cfg.rms_eps, *q, BD=_pow2(D),
                     WEIGHTED=x.w is not None, XQ=xq is not None, PERM=perm, DEP=perm and self._pdl("rms"), num_warps=4,
                     nbytes=8 * src.numel() + (3 * n * D if xq is not None else 0))
        return out

    def _xq_new(self, n: int, Kd: int):
        """Buffers of n rows of Kd values in XQ form (kernels._xq_store): words, block scales,
        16-value sums."""
        return self._new((n, Kd // 2), torch.int32), self._new((n, Kd // 32)), self._new((n, Kd // 16))

    def _xq(self, x, perm: bool = False):
        """x [n, K] (K a multiple of 32) in XQ form, or XQ8 with perm (the Q8C decoder 309). A
        normed x not yet materialised gets it from its rms_kernel, the attention's merge (XQ8) from
        attn_combine_kernel, with no launch of their own, and keeps it for its next reader."""
        slot = "xq8" if perm else "xq"
        if getattr(x, slot, None) is not None:
            return getattr(x, slot)
        n, Kd = x.shape[0], int(np.prod(x.shape[1:]))
        xq = self._xq_new(n, Kd)
        if isinstance(x, _Normed) and x.val is None and _pow2(Kd) == Kd:
            x.val = self._rms(x, xq, perm)
        elif isinstance(x, _Combined) and x.val is None and perm and self._combine_xq8(x.parts.D):
            x.val = self._combine(x.parts, rope_inverse=True, xq=xq)
        else:
            src = self._val(x)
            NBLK = 8
            self._launch(K.xq_kernel, (n, _cdiv(Kd // 32, NBLK)), src, src.stride(0), *xq, Kd, NBLK=NBLK,
                         PERM=perm, num_warps=4, nbytes=7 * n * Kd)
        if isinstance(x, (_Normed, _Combined)):
            setattr(x, slot, xq)
        return xq

    def _tiles(self, n_assign: int, counts: torch.Tensor, BM: int):
        """Tile schedule of the expert-sorted assignments: expert, first row, segment end."""
        NE = counts.shape[0]
        T = _cdiv(n_assign, BM) + NE
        tiles = (counts + BM - 1) // BM
        tend = torch.cumsum(tiles, 0)
        tstart = tend - tiles
        send = torch.cumsum(counts, 0)
        sstart = send - counts
        t = torch.arange(T, device=self.dev)
        e = torch.searchsorted(tend, t, right=True)
        ec = e.clamp(max=NE - 1)
        tile_e = torch.where(e < NE, ec, -1).to(torch.int32)
        tile_r0 = (sstart[ec] + (t - tstart[ec]) * BM).to(torch.int32)
        tile_end = send[ec].to(torch.int32)
        return T, tile_e, tile_r0, tile_end

    @_op
    def moe(self, f, ids, weights, gate, up, down, il):
        cfg = self.cfg
        x = self._val(f)
        n, E = x.shape
        k = ids.shape[1]
        F = gate.N
        clamp = cfg.swiglu_clamp[il]
        if n < MM_MIN:
            return self._routed_mv(f, gate, up, down, ids, weights, n, k, clamp)
        # prefill: group the (token, slot) assignments by expert
        NE = gate.n_exp
        flat = ids.reshape(-1).to(torch.int64)
        order = torch.sort(flat, stable=True).indices
        # assignments per expert without torch.bincount, which reads the largest id back to the
        # host: a stream synchronisation per layer, and the GPU then idles while the host queues
        # the next kernels (the 8192-token prefill's GPU was idle 6 % of the time with it)
        counts = torch.zeros(NE, dtype=torch.int64, device=self.dev).index_add_(0, flat, torch.ones_like(flat))
        gu16 = self._moe16(gate, KernelType.IQ2_XXS) and up.type == gate.type
        dn16 = self._moe16(down, KernelType.Q2_K)
        BM = self.moe16_bm if gu16 or dn16 else 64
        T, tile_e, tile_r0, tile_end = self._tiles(n * k, counts, BM)
        tok_sorted = (order // k).to(torch.int32)
        w_sorted = weights.reshape(-1)[order].contiguous()
        inv = torch.empty_like(order)
        inv[order] = torch.arange(n * k, device=self.dev)
        inv = inv.to(torch.int32)
        h = torch.empty((n * k, F), dtype=torch.float32, device=self.dev)
        if gu16:
            xh, xl, xi, _, _ = self._split16(x, sums=False)
            BN, KS, warps, stages = self.moe16_tile["gateup"]
            nib = self._grid_nibbles
            self._launch(K16.moe_gateup_mm16_kernel, (T, _cdiv(F, BN)), xh, xl, xi, tok_sorted, w_sorted,
                         tile_e, tile_r0, tile_end, gate.i16, up.i16, gate.f32, up.f32, nib, h, F, E,
                         gate.RB, F * gate.RB, float(clamp), BM=BM, BN=BN, KS=KS, ROUTED=True, LO=self._x_lo,
                         num_warps=warps, num_stages=stages,
                         flops=4 * n * k * F * E, nbytes=2 * gate.nbytes + 4 * n * k * (E + F))
        else:
            BN, warps = self.moe_tile["gateup"]
            self._launch(K.moe_gateup_mm_kernel, (T, _cdiv(F, BN)), x, x.stride(0), tok_sorted, w_sorted,
                         tile_e, tile_r0, tile_end, gate.b8, gate.i16, gate.f32, up.b8, up.i16, up.f32,
                         self._gridp, self._ksigns, h, F, E, gate.RB, F * gate.RB, float(clamp),
                         TYPE=gate.kt, BM=BM, BN=BN, ROUTED=True, **self._mm_cfg(gate.kt, E),
                         num_warps=warps, num_stages=2,
                         flops=4 * n * k * F * E, nbytes=2 * gate.nbytes + 4 * n * k * (E + F))
        osort = torch.empty((n * k, E), dtype=torch.float32, device=self.dev)
        if dn16 and self.moe_down_i8 and self._x_lo:
            p0, _, _, hi, gh, gl = self._split8(h)  # (the kernel finds the planes from p0)
            BN, KS, warps, stages = self.mm8_tile
            self._launch(K8.moe_down_mm8_kernel, (T, _cdiv(E, BN)), p0, hi, gh, gl, tile_e, tile_r0,
                         tile_end, down.f32.view(torch.int32), down.b8.view(torch.int32), down.i16, osort, E, F,
                         down.RB, E * down.RB, p0.numel(), BM=BM, BN=BN, KS=KS, PLANES=self.mm8_planes, num_warps=warps,
                         num_stages=stages,
                         flops=2 * n * k * E * F, nbytes=down.nbytes + 4 * n * k * (E + F))
        elif dn16:
            hh, hl, hi, gh, gl = self._split16(h, sums=True)
            BN, KS, warps, stages = self.moe16_tile["down"]
            self._launch(K16.moe_down_mm16_kernel, (T, _cdiv(E, BN)), hh, hl, hi, gh, gl, tile_e, tile_r0,
                         tile_end, down.f32, down.b8.view(torch.int32), down.i16, osort, E, F, down.RB,
                         E * down.RB, BM=BM, BN=BN, KS=KS, LO=self._x_lo,
                         num_warps=warps, num_stages=stages,
                         flops=2 * n * k * E * F, nbytes=down.nbytes + 4 * n * k * (E + F))
        else:
            BN, warps = self.moe_tile["down"]
            self._launch(K.moe_down_mm_kernel, (T, _cdiv(E, BN)), h, tile_e, tile_r0, tile_end,
                         down.b8, down.i16, down.f32, self._gridp, self._ksigns, osort, E, F, down.RB,
                         E * down.RB, TYPE=down.kt, BM=BM, BN=BN, **self._mm_cfg(down.kt, F),
                         num_warps=warps, num_stages=2,
                         flops=2 * n * k * E * F, nbytes=down.nbytes + 4 * n * k * (E + F))
        out = self._new((n, E))
        BE = min(1024, _pow2(E))
        self._launch(K.moe_reduce_kernel, (n, _cdiv(E, BE)), osort, inv, out, E, KSLOTS=k, BE=BE,
                     num_warps=4, nbytes=4 * n * E * (k + 1))
        return out

    def _moe16(self, w: QWeight, ttype: int) -> bool:
        """Whether expert weight w takes the exact-integer fp16 path (kernels_mm16.py)."""
        return self.moe_int16 and self.prec in INTEGER_PRECISIONS and int(w.type) == int(ttype) and w.K % 256 == 0

    def _split16(self, x: torch.Tensor, sums: bool):
        """x [R, K] float32 -> (hi, lo [R, K] fp16, 1/s [R, K/256], and with sums the 16-value
        sums / 16 as hi, lo [R, K/16] fp16): x·s = hi + lo per 256-value chunk (split16_kernel).
        Under "f16" (no low terms) lo is hi itself, a placeholder that nothing writes or reads."""
        R, Kd = x.shape
        f16 = dict(dtype=torch.float16, device=self.dev)
        xh = torch.empty((R, Kd), **f16)
        xl = torch.empty((R, Kd), **f16) if self._x_lo else xh
        xi = torch.empty((R, Kd // 256), dtype=torch.float32, device=self.dev)
        gh = torch.empty((R, Kd // 16), **f16) if sums else xh
        gl = torch.empty((R, Kd // 16), **f16) if sums and self._x_lo else gh
        BR = 64 if self.interpret else 8
        self._launch(K16.split16_kernel, (_cdiv(R, BR), Kd // 256), x, x.stride(0), xh, xl, xi, gh, gl, R, Kd,
                     BR=BR, SUMS=sums, LO=self._x_lo, num_warps=4, nbytes=(8 if self._x_lo else 6) * R * Kd)
        return xh, xl, xi, gh, gl

    def _split8(self, x: torch.Tensor):
        """x [R, K] float32 -> its int8 digit planes p0, p1, p2 [R, K] (p2 is p1 itself, unwritten,
        with two planes), 1/s [R, K/256] and the 16-value sums of q over the planes' divisor as
        hi, lo [R, K/16] fp16 (split8_kernel)."""
        if self.mm8_planes not in MM8_PLANES:
            raise ValueError(f"mm8_planes: expected one of {MM8_PLANES}, got {self.mm8_planes!r}")
        R, Kd = x.shape
        planes = torch.empty((self.mm8_planes, R, Kd), dtype=torch.int8, device=self.dev)
        p0, p1, p2 = planes[0], planes[1], planes[-1]  # (one buffer: one product reads two planes at once)
        xi = torch.empty((R, Kd // 256), dtype=torch.float32, device=self.dev)
        gh, gl = (torch.empty((R, Kd // 16), dtype=torch.float16, device=self.dev) for _ in range(2))
        BR = 64 if self.interpret else 8
        self._launch(K8.split8_kernel, (_cdiv(R, BR), Kd // 256), x, x.stride(0), p0, p1, p2, xi, gh, gl, R, Kd,
                     BR=BR, PLANES=self.mm8_planes, num_warps=4, nbytes=(4 + self.mm8_planes) * R * Kd)
        return p0, p1, p2, xi, gh, gl

    def ids_from_numpy(self, ids):
        return torch.from_numpy(np.asarray(ids, dtype=np.int32)).to(self.dev)

    @_op
    def expert_part(self, ids, weights, first, count):
        mine = (ids >= first) & (ids < first + count)
        return (torch.where(mine, ids - first, torch.zeros_like(ids)),
                torch.where(mine, weights, torch.zeros_like(weights)))

    def _swiglu(self, g, u, clamp: float):
        """SwiGLU of gate and up products [n, F] (swiglu_kernel). h is a step buffer (_new): in a
        decode step's branch a torch temporary would go back to the main stream's pool when this
        returns, while the branch's stream may still be about to write and read it."""
        h = self._new(g.shape, g.dtype)
        N = g.numel()
        self._launch(K.swiglu_kernel, (_cdiv(N, SWIGLU_BLOCK),), g, u, h, N, float(clamp), BLOCK=SWIGLU_BLOCK,
                     nbytes=12 * N)
        return h

    @_op
    def shared_expert(self, f, gate, up, down, il):
        cfg = self.cfg
        if gate.kt != up.kt or gate.RB != up.RB:
            # The layout lets the shared gate and up differ in type; the fused gate/up kernels
            # decode both with one decoder, so such a pair takes two products and the SwiGLU.
            g, u = self._val(self._linear(f, gate)), self._val(self._linear(f, up))
            return self._linear(self._swiglu(g, u, cfg.swiglu_clamp[il]), down)
        if (isinstance(f, _Normed) and f.shape[0] < MM_MIN and f.shape[1] % 32 == 0
                and self.mv_types.get(KernelType.IQ2_XXS) == Decoder.IQ2_GROUPS_XQ):
            # the routed experts' gate/up (418) reads f in XQ form: the norm's kernel here, beside
            # the router, writes it with the float f this reads (else it would be a launch of its
            # own between the router and the routed experts)
            self._xq(f)
        x = self._val(f)
        n, E = x.shape
        F = gate.N
        clamp = cfg.swiglu_clamp[il]
        if n < MM_MIN:
            c = self._mv_cfg(gate.kt, F, E, n, kind="gateup", x16=_x16(x, x.stride(0)),
                             xq=gate.kt == KernelType.Q8C and up.kt == gate.kt)
            xq = self._xq(f, perm=True) if c["TYPE"] == Decoder.Q8C_XQ8 else None  # (f's norm wrote XQ: a launch)
            h = self._gateup_mv(x, gate, up, None, None, n, 1, clamp, c=c, xq=xq)
        elif self.shared_hl and gate.kt == KernelType.Q8C and self._x_lo and self._f16w(gate, x, 0):
            # bf16x3 on two fp16 planes (Linear._matmul16): x split once for both products
            split = self._x16_for(gate, x)  # (up: the same layout, so the same split)
            g = self._matmul16(x, gate, self._new((n, F)), split=split)
            u = self._matmul16(x, up, self._new((n, F)), split=split)
            h = self._swiglu(g, u, clamp)
        else:
            BM = 64
            mc = self._mm_cfg(gate.kt, E)
            BN, warps = self.moe_tile["shared" if mc["U"] else "gateup"]
            T = _cdiv(n, BM)
            tile_e = torch.zeros(T, dtype=torch.int32, device=self.dev)
            tile_r0 = torch.arange(0, n, BM, dtype=torch.int32, device=self.dev)
            tile_end = torch.full((T,), n, dtype=torch.int32, device=self.dev)
            h = torch.empty((n, F), dtype=torch.float32, device=self.dev)
            self._launch(K.moe_gateup_mm_kernel, (T, _cdiv(F, BN)), x, x.stride(0), self._dummy_i, self._dummy_f,
                         tile_e, tile_r0, tile_end, gate.b8, gate.i16, gate.f32, up.b8, up.i16, up.f32,
                         self._gridp, self._ksigns, h, F, E, gate.RB, 0, float(clamp),
                         TYPE=gate.kt, BM=BM, BN=BN, ROUTED=False, **mc,
                         num_warps=warps, num_stages=2, flops=4 * n * F * E, nbytes=2 * gate.nbytes + 4 * n * (E + F))
        return self._linear(h, down)
