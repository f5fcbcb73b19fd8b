"""Ops of the Triton backend around the residual stream: embedding, mHC collapse / expand, RMS
norm, the linear op, add and the output logits."""

from __future__ import annotations

from . import kernels as K
from .plumbing import QWeight, _Expanded, _HeadNormed, _Normed, _Rows, _Sum, _cdiv, _largest_pow2_divisor, _op, _pow2


class _HcOps:
    """The residual-stream ops of TritonBackend (a mixin: it uses the state TritonBackend.__init__ sets up)."""

    @_op
    def embed(self, token_embd: QWeight, tokens):
        cfg = self.cfg
        n, E, HC = len(tokens), cfg.n_embd, cfg.n_hc
        tok = self._tokens_dev(tokens)
        X = self._new((n, HC, E))
        NB, VB = self._blocks(token_embd.kt, E, 1024)
        self._launch(K.embed_kernel, (n, E // (NB * VB)), tok, token_embd.b8, token_embd.i16, token_embd.f32,
                     self._gridp, self._ksigns, X, E, token_embd.RB, HC=HC, TYPE=token_embd.kt,
                     NB=NB, VB=VB, nbytes=n * (token_embd.RB + 4 * HC * E))
        return X

    def _hc_collapse(self, X, hc, head: bool, into=None):
        """(x_in, post, comb) of the mHC collapse of X [n, HC, E]; into: those three to write
        (row ranges of a group's, _hc_pre_by_chunk)."""
        cfg = self.cfg
        n, HC, E = X.shape
        Kd = HC * E
        fn = hc.fn
        NR = fn.N
        NM = _pow2(NR)
        # BT tokens per program share each weight tile on the tensor cores (hc_mix_kernel)
        BT = 1 if n < self.hc_mix_bt[0] else min(self.hc_mix_bt[1], _pow2(n))
        # one token per program: the mixing kernel also computes a pending mHC expand
        ex = X if isinstance(X, _Expanded) and X.val is None and BT == 1 and self.fuse_expand else None
        if ex is None:
            X = self._val(X)
            d = self._dummy_f
            expand = (d, d, d, d, d)
        else:
            X = ex.val = self._new((n, HC, E))
            expand = (ex.y, ex.y2 if ex.y2 is not None else ex.y, ex.X, ex.post, ex.comb)
        # (32-value K-steps for BT > 1: larger ones spill registers, sm_90 SASS; one token: up to
        # 128, one K-step per program where hc_mix_split parts make them shorter)
        cap = self.hc_mix_step or (32 if BT > 1 else max(32, min(128, Kd // self.hc_mix_split)))
        NB, VB = self._blocks(fn.kt, Kd, cap)
        BK = NB * VB
        # K parts: about hc_mix_programs programs over the rows, at most hc_mix_split a tile
        split = max(1, min(self.hc_mix_split, max(self.hc_mix_programs, self.hc_mix_split) // _cdiv(n, BT)))
        split = min(split, Kd // BK)
        split = _largest_pow2_divisor(Kd // BK, split)
        part = self._new((n, split, NM))
        ss = self._new((n, split))
        self._launch(K.hc_mix_kernel, (_cdiv(n, BT), split), X, fn.b8, fn.i16, fn.f32, self._gridp, self._ksigns,
                     part, ss, n, NR, Kd, fn.RB, Kd // split, *expand, E, NM=NM, TYPE=fn.kt, NB=NB, VB=VB,
                     BT=BT, EXPAND=ex is not None, HAS_Y2=ex is not None and ex.y2 is not None, HC=HC,
                     num_warps=4, nbytes=fn.RB * NR * _cdiv(n, BT) + 4 * X.numel() * (3 if ex is not None else 1))
        if into is not None:
            x_in, post, comb = into
        else:
            x_in = self._new((n, E))
            post = self._dummy_f if head else self._new((n, HC))
            comb = self._dummy_f if head else self._new((n, HC, HC))
        BT = min(_pow2(n), 32) if self.interpret else 1
        BE = min(1024 // BT if self.interpret else self.hc_fin_be, _pow2(E))
        consts = (n, E, cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iter)
        kw = dict(SPLIT=split, HC=HC, NM=NM, BE=BE, BT=BT, HEAD=head, RELOAD=self.hc_comb_reload, num_warps=4)
        d = self._dummy_f
        if not head and self.hc_comb_beside and n == 1:
            # x_in first, post and comb (the Sinkhorn) beside the sublayer, which needs only x_in
            # (on a side stream in a decode step; in order elsewhere, so that every one-token
            # collapse runs the same two kernels: one launch doing both parts gave other bits, as
            # the compiler laid out its reductions differently). Each launch takes only the
            # buffers it writes: the side streams order readers after the launch that took a
            # buffer first (lanes.py)
            self._launch(K.hc_finalize_kernel, (_cdiv(n, BT), _cdiv(E, BE)), X, part, ss, hc.scale.vec,
                         hc.base.vec, x_in, d, d, *consts, PART=1, **kw, nbytes=4 * (X.numel() + n * E))
            with self.branch():
                self._launch(K.hc_finalize_kernel, (_cdiv(n, BT), 1), d, part, ss, hc.scale.vec, hc.base.vec,
                             d, post, comb, *consts, PART=2, **kw, nbytes=4 * n * split * NM)
        else:
            self._launch(K.hc_finalize_kernel, (_cdiv(n, BT), _cdiv(E, BE)), X, part, ss, hc.scale.vec,
                         hc.base.vec, x_in, post, comb, *consts, **kw, nbytes=4 * (X.numel() + n * E))
        return x_in, post, comb

    @_op
    def hc_pre(self, X, hc):
        if isinstance(X, _Rows):
            return self._hc_pre_by_chunk(X.val, hc, X.parts)
        return self._hc_collapse(X, hc, head=False)

    def _hc_pre_by_chunk(self, X, hc, parts):
        """The FFN's mHC collapse over a group's rows (concat_rows), one chunk's rows at a time:
        the mixing kernel's tile and K split follow the rows it gets, and this way each chunk's
        rows get what they get alone (one collapse over the group summed 4 K parts of a 2048
        chunk's rows in 1, and other parts for a shorter chunk)."""
        n, HC, E = X.shape
        out = (self._new((n, E)), self._new((n, HC)), self._new((n, HC, HC)))
        r = 0
        for m in parts:
            self._hc_collapse(X[r:r + m], hc, head=False, into=tuple(t[r:r + m] for t in out))
            r += m
        return out

    @_op
    def hc_post(self, y, X, post, comb):
        y2 = None
        if isinstance(y, _Sum) and y.val is None:
            y, y2 = self._val(y.a), self._val(y.b)
        else:
            y = self._val(y)
        return _Expanded(y, y2, self._val(X), post, comb)

    @_op
    def rms_norm(self, x, weight=None):
        return _Normed(x, weight)

    @_op
    def linear(self, x, w):
        return self._linear(x, w)

    @_op
    def head_norm(self, q):
        return _HeadNormed(q, self.cfg.n_head, self.cfg.head_dim)

    @_op
    def add(self, a, b):
        return _Sum(a, b)

    def rows(self, X, a, b):
        # a group's chunks run their attention sublayers one after another from here to
        # concat_rows, each on the same weights: their fp16 planes are made once (_q8c_hl)
        self._hl_kept = self._hl_kept if self._hl_kept is not None else {}
        return self._val(X)[a:b]

    def concat_rows(self, parts):
        """The chunks' mHC states as one [n, HC, E] tensor (a _Rows, which names the chunks for
        the FFN's collapse): an expansion not yet made is written straight into its rows (one
        pass, as materialising it alone would take)."""
        self._hl_kept = None  # (the layer's attention weights are done with)
        n = sum(int(p.shape[0]) for p in parts)
        out = self._new((n, *parts[0].shape[1:]))
        r = 0
        for p in parts:
            m = int(p.shape[0])
            if isinstance(p, _Expanded) and p.val is None:
                self._expand_into(p, out[r:r + m])
            else:
                out[r:r + m].copy_(self._val(p))
            r += m
        return _Rows(out, [int(p.shape[0]) for p in parts])

    @_op
    def output_logits(self, X, hc, norm, out):
        X = self._val(X)
        x_in, _, _ = self._hc_collapse(X[-1:], hc, head=True)
        logits = self._linear(_Normed(x_in, norm), out)
        if self._step is not None:
            self._next_token(logits[0])
        return logits[0]
