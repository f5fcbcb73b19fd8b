"""Attention ops of the Triton backend: RoPE, the KV store, the compressor, the indexer's
selection, attention with its split merge, and the grouped output projection."""

from __future__ import annotations

import numpy as np
import torch

from ...core.rules import visible_compressed_rows
from . import kernels as K
from .plumbing import (
    MM_MIN, Selection, _AttnOut, _AttnParts, _Combined, _HeadNormed, _Normed, _Roped, _cdiv, _op, _pad_dim, _pow2,
)


ATTN_STEP = 16  # KV rows per step of a decode attention program
# one-query top-k: the most programs (chunks of rows; more rows a chunk past that) and the chunk
# counts a program adds up at a time
TOPK_MAX_CHUNKS = 4096
TOPK_SUM_BLOCK = 256


class _AttentionOps:
    """The attention ops of TritonBackend (a mixin: it uses the state TritonBackend.__init__ sets up)."""

    def _rope(self, x, il: int, inverse: bool, qat: bool = False, rows_dim: tuple | None = None, ring=None):
        """The rotated rows, or with ring (the raw window of one-row x) stored into it as
        kv_store stores them."""
        norm, nw = 0, self._dummy_f
        if isinstance(x, _HeadNormed) and x.val is None:
            src = self._val(x.x)
            n, ROWS, D = src.shape[0], x.H, x.D
            norm = 2
            shape = (n, ROWS, D)
        elif isinstance(x, _Normed) and x.val is None:
            src = self._val(x.x)
            n, D = src.shape
            ROWS = 1
            norm = 2 if x.w is None else 1
            nw = self._dummy_f if x.w is None else x.w.vec
            shape = (n, D)
        else:
            src = self._val(x)
            shape = tuple(src.shape)
            n = shape[0]
            if rows_dim is not None:
                ROWS, D = rows_dim
                shape = (n, ROWS, D)
            else:
                D = shape[-1]
                ROWS = int(np.prod(shape[1:-1], dtype=np.int64)) if len(shape) > 2 else 1
        if ring is not None and (ROWS, D) != (1, ring.shape[1]):
            raise ValueError(f"rope into the raw window: expected rows of {ring.shape[1]} values, got {shape}")
        out = self._new(shape) if ring is None else ring
        BR, warps = self.rope_tile_prefill if n >= MM_MIN else (self.rope_rows_decode, 4)
        BR = min(_pow2(ROWS), BR)
        warps = max(1, min(warps, BR * D // 256))
        self._launch(K.rope_kernel, (n, _cdiv(ROWS, BR)), src, out, nw, self._freq[il], self._pos, ROWS,
                     self.cfg.rms_eps, D=D, NROT=self.cfg.n_rot, BR=BR, NORM=norm, INVERSE=inverse,
                     QAT=qat, QS=float(np.float32(1.0 / np.sqrt(D))), LOGD=max(0, D.bit_length() - 1),
                     HDP=_pow2(D // 2), RING=ring is not None, RAWCAP=1 if ring is None else ring.shape[0],
                     NN=self.cfg.n_nope, DS4=self.ds4_numerics, num_warps=warps,
                     nbytes=(4 + out.element_size()) * n * ROWS * D)
        return out

    @_op
    def rope(self, x, p0, il, inverse=False):
        self._set_pos(p0)
        if inverse and isinstance(x, _AttnParts) and x.val is None:
            return _Combined(x)
        if inverse and isinstance(x, _AttnOut) and x.val is None:
            return x.take(True)
        if not inverse and self._fuses_query_rope(x):
            return _Roped(x, il, p0)  # (the query: attention normalises and rotates it as it loads it)
        if not inverse and self.fuse_kv_store and isinstance(x, _Normed) and x.val is None and len(x.shape) == 2:
            return _Roped(x, il, p0)  # (the KV row: kv_store rotates and stores it in one launch)
        return self._rope(x, il, inverse)

    @_op
    def kv_store(self, st, kv, p0):
        self._set_pos(p0)
        raw = st["raw"]
        if isinstance(kv, _Roped) and kv.val is None and kv.p0 == p0:
            self._rope(kv.x, kv.il, inverse=False, ring=raw)
            return
        kv = self._val(kv)
        n, D = kv.shape
        self._launch(K.kv_store_kernel, (n,), kv, raw, self._pos, raw.shape[0], D=D, NN=self.cfg.n_nope,
                     DS4=self.ds4_numerics, DP=_pow2(D), num_warps=4, nbytes=(4 + raw.element_size()) * n * D)

    @_op
    def compressor(self, st, a, w, p0, il, indexer):
        cfg = self.cfg
        self._set_pos(p0)
        m = cfg.ratio(il)
        d = cfg.indexer_head_dim if indexer else cfg.head_dim
        csa = cfg.compressor_lanes(il) > 1
        C = cfg.compressor_lanes(il) * d
        prefix = "index" if indexer else "comp"
        skv, ssc, rows = st[prefix + "_kv"], st[prefix + "_score"], st[prefix]
        with self.branch():  # (in a decode step: the two products on two streams)
            sc_all = self._linear(a, w.gate)
        kv_all = self._linear(a, w.kv)
        n = kv_all.shape[0]
        nwin = 1 if self._step is not None else (p0 + n) // m - p0 // m
        mode = (2 if indexer else 1) if self.ds4_numerics else 0
        ncand = 8 if csa else m
        if nwin > 0:
            self._launch(K.comp_pool_kernel, (nwin,), kv_all, sc_all, w.ape.f32, skv, ssc, w.norm.vec,
                         self._freq[il], self._pos, rows, n, cfg.rms_eps,
                         M=m, D=d, C=C, NROT=cfg.n_rot, CSA=csa, NCAND=ncand, RB=min(_pow2(ncand), 8),
                         MODE=mode, QS=float(np.float32(1.0 / np.sqrt(d))), LOGD=max(0, d.bit_length() - 1),
                         HDP=_pow2(d // 2), num_warps=4,
                         nbytes=4 * nwin * 2 * ncand * d * 2)
        BC = min(_pow2(C), (64 if ncand <= 8 else 16) if not self.interpret else 1024)
        self._launch(K.comp_update_kernel, (_cdiv(C, BC),), kv_all, sc_all, w.ape.f32, skv, ssc, self._pos, n,
                     M=m, C=C, CSA=csa, NR=ncand, BC=BC, NRP=_pow2(ncand), num_warps=4, nbytes=4 * 4 * ncand * C)

    @_op
    def indexer_select(self, st, qr, a, w, p0, il):
        cfg = self.cfg
        self._set_pos(p0)
        m = cfg.ratio(il)
        n = qr.shape[0]
        top_k = cfg.indexer_top_k
        if self._step is None:
            cs = visible_compressed_rows(p0 + n - 1, m)
            if cs <= top_k:
                return None
        else:
            cs = st["index"].shape[0]
        IH, ID = cfg.indexer_heads, cfg.indexer_head_dim
        with self.branch():  # (decode step: the head weights beside the queries' product and RoPE)
            hw = self._linear(a, w.proj)
        iq = self._rope(self._linear(qr, w.q_b), il, inverse=False, qat=self.ds4_numerics, rows_dim=(IH, ID))
        scores = self._new((n, cs))
        BC = self.idx_score_rows
        hist = self.topk_hist and n == 1
        capb = self.topk_bucket
        nbkt = 2 * K.TOPK_BUCKETS.value * capb  # (keys, then rows)
        if hist and (self._topk_buckets is None or self._topk_buckets.numel() != nbkt):
            # torch fills it on the main stream, and this branch's stream forked before that
            self._topk_buckets = torch.zeros(nbkt, dtype=torch.int32, device=self.dev)
            self._follow_main()
        bkt = self._topk_buckets if hist else self._dummy_i
        if self.query_waits_index == "rope":
            self._hold_main()
        try:
            ch = max(self.topk_rows, _pow2(_cdiv(cs, TOPK_MAX_CHUNKS)))
            npr = _cdiv(cs, ch)  # one-query top-k: programs of ch rows
            self._launch(K.idx_score_kernel, (n, _cdiv(cs, BC)), iq, hw, st["index"], scores, self._pos,
                         self._topk_counts, bkt, m, IH, cs, top_k, float(np.float32(np.sqrt(ID * IH))), npr,
                         IHP=max(16, _pow2(IH)), ID=ID, BC=BC, EXACT=self.ds4_numerics, HIST=hist, CAPB=capb, IDP=_pad_dim(ID),
                         KB16=st["index"].dtype == torch.bfloat16, num_warps=self.idx_score_warps,
                         nbytes=n * (cs * ID * st["index"].element_size() + 4 * (IH * ID + cs)))
            if self.query_waits_index == "score":
                self._hold_main()
            idx = self._new((n, top_k), torch.int32)
            cnt = self._new((n,), torch.int32)
            if hist:
                self._launch(K.topk_one_kernel, (npr,), scores, idx, cnt, self._pos, self._topk_counts,
                             bkt, m, top_k, npr, CH=ch, CAPB=capb, LB=max(ch, _pow2(cs) // 16),
                             SB=min(_pow2(npr), TOPK_SUM_BLOCK), num_warps=self.topk_warps, nbytes=4 * cs)
            else:
                cmax = _pow2(cs) if cs <= self.topk_reg_max else 0
                self._launch(K.topk_kernel, (n,), scores, idx, cnt, self._pos, m, cs, top_k,
                             BC=256 if not self.interpret else 1024, CMAX=cmax,
                             num_warps=8 if cmax > 4096 else 4, nbytes=4 * n * cs)
        except BaseException:
            # the scores kernel may have counted without a top-k to clear the counts: the next
            # selection would start from them
            if hist:
                self._topk_counts.zero_()
            raise
        return Selection(idx, cnt, top_k)

    def _fuses_query_rope(self, x) -> bool:
        """Whether x, a prefill chunk's head-normed query, is left for attention to normalise and
        rotate as it loads it (attn_q_rope)."""
        return (self.attn_q_rope and self._step is None and isinstance(x, _HeadNormed) and x.val is None
                and x.shape[0] > 1)

    @_op
    def attention(self, q, st, sinks, p0, il, selected):
        cfg = self.cfg
        self._set_pos(p0)
        q_rope = (isinstance(q, _Roped) and q.val is None and isinstance(q.x, _HeadNormed)
                  and (q.p0, q.il) == (p0, il) and q.shape[0] > 1)
        if q_rope:
            n, H, D = q.shape
            q = self._val(q.x.x)  # (before its norm: [n, H·D] rows)
        else:
            q = self._val(q)
            n, H, D = q.shape
        raw = st["raw"]
        W = min(cfg.sliding_window, raw.shape[0])
        m = cfg.ratio(il)
        comp = m != 0
        sel = selected is not None
        HB = self.attn_decode_heads
        common = (q, raw, st["comp"] if comp else raw,
                  selected.idx if sel else self._dummy_i, selected.count if sel else self._dummy_i,
                  self._pos, sinks.vec)
        qscale = float(np.float32(np.sqrt(D)))
        f16 = bool(self.attn_f16 and self.ds4_numerics)
        rope = (self._freq[il], cfg.rms_eps)
        if n > 1:
            HBp, BR, warps, stages = ((16, 16, 8, 1) if self.interpret else
                                      self.attn_tile if f16 else self.attn_tile_tf32)

            def launch(rope_inverse: bool):
                out = self._new((n, H, D))
                self._launch(K.attn_kernel, (n, _cdiv(H, HBp), 1), *common, self._dummy_f, self._dummy_f, out,
                             H, W, raw.shape[0], max(m, 1), cfg.indexer_top_k, 1 << 30, qscale, *rope,
                             D=D, HB=HBp, BR=BR, COMP=comp, SEL=sel, SINGLE=True, KEXACT=self.ds4_numerics,
                             F16=f16, DP=_pad_dim(D), NROT=cfg.n_rot, Q_ROPE=q_rope, ROPE_INV=rope_inverse,
                             num_warps=warps, num_stages=stages,
                             nbytes=n * (8 * H * D + (W + cfg.indexer_top_k) * D * raw.element_size()))
                return out
            if self.attn_o_rope and self._step is None:
                return _AttnOut(launch, (n, H, D))
            return launch(False)
        if self._step is not None:
            ncomp = (cfg.indexer_top_k if sel else st["comp"].shape[0]) if comp else 0
        else:
            vis = visible_compressed_rows(p0 + n - 1, m) if comp else 0
            ncomp = min(vis, cfg.indexer_top_k) if sel else vis
        rows = W + ncomp
        # rows per program: attn_split_rows, or more where that would make over attn_max_splits
        # splits (whole steps of 16 rows), so that long histories do not multiply the programs
        RS = self.attn_split_rows
        if _cdiv(rows, RS) > self.attn_max_splits:
            RS = _cdiv(_cdiv(rows, self.attn_max_splits), ATTN_STEP) * ATTN_STEP
        S = max(1, _cdiv(rows, RS))
        mo = self._new((n, S, H))
        lo = self._new((n, S, H))
        ao = self._new((n, S, H, D))
        self._launch(K.attn_kernel, (n, _cdiv(H, HB), S), *common, mo, lo, ao,
                     H, W, raw.shape[0], max(m, 1), cfg.indexer_top_k, RS, qscale, *rope,
                     D=D, HB=HB, BR=ATTN_STEP, COMP=comp, SEL=sel, SINGLE=False, KEXACT=self.ds4_numerics,
                     F16=f16, DP=_pad_dim(D), num_warps=8,
                     nbytes=(W + ncomp) * D * _cdiv(H, HB) * raw.element_size() + 8 * S * H * D)
        return _AttnParts(mo, lo, ao, S, sinks, il, n, H, D)

    def _combine_pairs(self, D: int) -> int:
        """Pairs of a head per attn_combine_kernel program."""
        return min(_pow2(D // 2), self.combine_pairs)

    def _combine_xq8(self, D: int) -> bool:
        """Whether the merge can store its result in XQ8 form: every program's pairs are whole
        32-value blocks of the head."""
        BI = self._combine_pairs(D)
        return (D // 2) % BI == 0 and (2 * BI) % 32 == 0

    def _combine(self, x: _AttnParts, rope_inverse: bool, xq=None):
        """The merged splits; with xq (buffers from _xq_new; 32-value blocks within a program's
        pairs) also in XQ8 form."""
        out = self._new((x.n, x.H, x.D))
        BI = self._combine_pairs(x.D)
        if xq is not None and not self._combine_xq8(x.D):
            raise ValueError(f"attention merge in XQ8 form: expected {BI}-pair programs of 32-value "
                             f"blocks to tile the head's {x.D // 2} pairs")
        q = xq if xq is not None else (self._dummy_i, self._dummy_f, self._dummy_f)
        self._launch(K.attn_combine_kernel, (x.n, x.H, _cdiv(x.D // 2, BI)), x.mo, x.lo, x.ao, x.sink.vec,
                     self._freq[x.il], self._pos, out, x.H, *q, S=x.S, SP=_pow2(x.S), D=x.D, NROT=self.cfg.n_rot,
                     ROPE_INV=rope_inverse, BI=BI, XQ8=xq is not None, DEP=xq is not None and self._pdl("combine"),
                     num_warps=4, nbytes=4 * x.ao.numel() + 4 * out.numel() + (3 * out.numel() if xq else 0))
        return out

    @_op
    def grouped_output(self, o, w_a, w_b):
        cfg = self.cfg
        n = o.shape[0]
        width = int(np.prod(o.shape[1:]))
        # o stays lazy (the merge then stores its XQ8 form too) where w_a's decoder reads that form
        x = o if isinstance(o, _Combined) and self._takes_xq8(w_a, n) else self._val(o).reshape(n, width)
        low = self._linear(x, w_a, group_rows=cfg.o_lora_rank, group_stride=width // cfg.o_groups,
                           xq_out=self.xq_out and self._takes_xq8(w_b, n))
        return self._linear(low, w_b)
