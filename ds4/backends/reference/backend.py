"""The reference backend: every op in plain numpy float32, the correctness oracle.

Weights stay as memory-mapped GGUF blocks; a matrix is decoded when an op needs it and kept in a
small byte-bounded LRU (so one layer's working set is reused across a chunk without the model
ever being held in float32). The embedding decodes only the looked-up rows, the output head
decodes row blocks, and the MoE decodes only the experts a chunk selected.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from ...core import numerics as nx
from ...core import rules
from ...core.config import ModelConfig
from ...core.gguf_model import Tensor
from ...core.quants import dequantize_rows
from ...core.rope import layer_inv_freq
from ..base import Backend

HEAD_BLOCK_ROWS = 8192


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return x / np.sqrt(ms + np.float32(eps))


def _matvecs(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """x [n, in] @ m[out, in]ᵀ one row at a time.

    A batched GEMM rounds differently from a GEMV, so a row's result would depend on how many
    tokens share its chunk; the oracle must give bit-identical results for one-shot prefill,
    chunked prefill and decode (the ds4 numerics' FP8/FP4 rounding would amplify any difference).
    """
    out = np.empty((x.shape[0], m.shape[0]), dtype=np.float32)
    for i in range(x.shape[0]):
        out[i] = m @ x[i]
    return out


_sigmoid = rules.sigmoid


def _softplus(x):
    # ds4's thresholds: x > 20 -> x, x < −20 -> e^x
    return np.where(x > 20, x, np.where(x < -20, np.exp(np.minimum(x, 0)), np.log1p(np.exp(np.minimum(x, 20)))))


def _swiglu(g: np.ndarray, u: np.ndarray, clamp: float) -> np.ndarray:
    g = np.minimum(g, clamp)
    u = np.clip(u, -clamp, clamp)
    return g * _sigmoid(g) * u


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, cfg: ModelConfig, numerics: str = "ds4", cache_bytes: int | None = None):
        super().__init__(cfg, numerics)
        env = os.environ.get("DS4_REFERENCE_CACHE_MB")
        self.cache_bytes = cache_bytes if cache_bytes is not None else (
            int(env) << 20 if env else 256 << 20)
        self._cache: OrderedDict = OrderedDict()
        self._cached = 0
        self._freq = {il: layer_inv_freq(cfg, il) for il in range(cfg.n_layer)}

    # ---- memory ---------------------------------------------------------------------------------

    def upload(self, tensor: Tensor) -> Tensor:
        return tensor  # stays a view into the mapped file

    def _matrix(self, t: Tensor, expert: int | None = None) -> np.ndarray:
        """Decoded float32 [out, in] (of one expert for 3-D tensors), through the LRU."""
        key = (t.name, expert)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        rows = t.rows() if expert is None else t.expert(expert)
        m = dequantize_rows(rows, t.type, t.dims[0]).astype(np.float32, copy=False)
        if m.nbytes <= self.cache_bytes:
            self._cache[key] = m
            self._cached += m.nbytes
            while self._cached > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes
        return m

    def _vector(self, t: Tensor) -> np.ndarray:
        return self._matrix(t).reshape(-1)

    def alloc_state(self, shapes, fill):
        return {k: np.full(s, fill[k], dtype=np.float32) for k, s in shapes.items()}

    def state_to_numpy(self, st, name):
        return st[name].copy()

    def state_from_numpy(self, st, name, value):
        if value.shape != st[name].shape:
            raise ValueError(f"state {name}: expected shape {st[name].shape}, got {value.shape}")
        st[name][...] = value

    def to_numpy(self, x):
        return np.asarray(x)

    def from_numpy(self, x):
        return np.ascontiguousarray(x, dtype=np.float32)

    # ---- ops ------------------------------------------------------------------------------------

    def embed(self, token_embd: Tensor, tokens):
        rows = token_embd.rows()[np.asarray(tokens, dtype=np.int64)]
        e = dequantize_rows(rows, token_embd.type, token_embd.dims[0]).astype(np.float32)
        return np.repeat(e[:, None, :], self.cfg.n_hc, axis=1)

    def hc_pre(self, X, hc):
        cfg = self.cfg
        n, HC, E = X.shape
        flat = _rms(X.reshape(n, HC * E), cfg.rms_eps)
        mix = _matvecs(flat, self._matrix(hc.fn))  # [n, (2+HC)·HC]
        pre, post, comb = rules.mhc_split(mix, self._vector(hc.scale), self._vector(hc.base), HC,
                                          cfg.hc_sinkhorn_iter, cfg.hc_eps)
        comb = comb.astype(np.float32)
        x_in = (pre[:, :, None] * X).sum(axis=1)
        return x_in.astype(np.float32), post.astype(np.float32), comb

    def hc_post(self, y, X, post, comb):
        mixed = (comb[:, :, :, None] * X[:, :, None, :]).sum(axis=1)  # Σ_i comb[i][j]·X[i]
        return (post[:, :, None] * y[:, None, :] + mixed).astype(np.float32)

    def rms_norm(self, x, weight=None):
        y = _rms(x, self.cfg.rms_eps)
        return y if weight is None else y * self._vector(weight)

    def linear(self, x, w):
        return _matvecs(x, self._matrix(w))

    def head_norm(self, q):
        n = q.shape[0]
        return _rms(q.reshape(n, self.cfg.n_head, self.cfg.head_dim), self.cfg.rms_eps)

    def rope(self, x, p0, il, inverse=False):
        return rope_tail(x, np.arange(p0, p0 + x.shape[0]), self._freq[il], self.cfg.n_rot, inverse)

    def kv_store(self, st, kv, p0):
        if self.ds4_numerics:
            kv = nx.f16_round(nx.fp8_kv_roundtrip(kv, self.cfg.n_nope))
        raw = st["raw"]
        rows = np.arange(p0, p0 + kv.shape[0]) % raw.shape[0]
        raw[rows] = kv

    def compressor(self, st, a, w, p0, il, indexer):
        cfg = self.cfg
        m = cfg.ratio(il)
        overlap = cfg.compressor_lanes(il) > 1
        off = m if overlap else 0  # frontier rows 0..m−1 of a two-lane compressor: previous window
        d = cfg.indexer_head_dim if indexer else cfg.head_dim
        prefix = "index" if indexer else "comp"
        state_kv, state_score, rows = st[prefix + "_kv"], st[prefix + "_score"], st[prefix]
        kv_all = self.linear(a, w.kv)  # [n, c·d]
        sc_all = self.linear(a, w.gate)
        ape = self._matrix(w.ape)  # [m, c·d]
        freq = self._freq[il]
        for i in range(a.shape[0]):
            pos = p0 + i
            row = off + pos % m
            state_kv[row] = kv_all[i]
            state_score[row] = sc_all[i] + ape[pos % m]
            if (pos + 1) % m:
                continue
            if overlap:
                sc = rules.overlapping_lanes(state_score[:m], state_score[m:], d)
                kv = rules.overlapping_lanes(state_kv[:m], state_kv[m:], d)
            else:
                sc, kv = state_score, state_kv
            pooled = softmax_pool(sc, kv)
            out = self.rms_norm(pooled[None], w.norm)
            out = rope_tail(out, np.array([pos + 1 - m]), freq, cfg.n_rot)
            if self.ds4_numerics:
                out = nx.indexer_qat(out) if indexer else nx.fp8_kv_roundtrip(out, cfg.n_nope)
                out = nx.f16_round(out)
            rows[pos // m] = out[0]
            if overlap:
                state_kv[:m] = state_kv[m:]
                state_score[:m] = state_score[m:]

    def indexer_scores(self, st, qr, a, w, p0, il) -> list[np.ndarray]:
        """§3.6: each query's score of every compressed row it may see, Σ_h w_h·relu(q_h·k)."""
        cfg = self.cfg
        n = qr.shape[0]
        pos = np.arange(p0, p0 + n)
        visible = rules.visible_compressed_rows(pos, cfg.ratio(il))
        IH, ID = cfg.indexer_heads, cfg.indexer_head_dim
        iq = self.linear(qr, w.q_b).reshape(n, IH, ID)
        iq = rope_tail(iq, pos, self._freq[il], cfg.n_rot)
        if self.ds4_numerics:
            iq = nx.indexer_qat(iq)
        hw = self.linear(a, w.proj) / np.float32(np.sqrt(ID * IH))  # [n, IH]
        return [hw[i] @ np.maximum(_matvecs(iq[i], st["index"][: visible[i]]), 0) for i in range(n)]

    def indexer_select(self, st, qr, a, w, p0, il):
        cfg = self.cfg
        n = qr.shape[0]
        visible = rules.visible_compressed_rows(np.arange(p0, p0 + n), cfg.ratio(il))
        if visible.max() <= cfg.indexer_top_k:
            return None
        C = int(visible.max())
        mask = np.arange(C)[None, :] < visible[:, None]
        for i, score in enumerate(self.indexer_scores(st, qr, a, w, p0, il)):
            if visible[i] > cfg.indexer_top_k:
                # stable descending sort: among equal scores the lower row index wins
                order = np.argsort(-score, kind="stable")
                keep = np.zeros(C, dtype=bool)
                keep[order[: cfg.indexer_top_k]] = True
                mask[i] = keep
        return mask

    def attention(self, q, st, sinks, p0, il, selected):
        cfg = self.cfg
        n, H, D = q.shape
        raw = st["raw"]
        W = min(cfg.sliding_window, raw.shape[0])
        m = cfg.ratio(il)
        sink = self._vector(sinks)  # [H]
        out = np.empty_like(q)
        for i in range(n):  # each query over exactly the rows it sees
            t = p0 + i
            keys = raw[np.arange(max(0, t - W + 1), t + 1) % raw.shape[0]]
            if m:
                visible = np.arange(rules.visible_compressed_rows(t, m))
                if selected is not None:
                    visible = visible[selected[i, : visible.size]]
                keys = np.concatenate([keys, st["comp"][visible]])
            s = _matvecs(q[i], keys) / np.float32(np.sqrt(D))  # [H, R]; K = V
            mx = np.maximum(s.max(axis=1), sink)
            p = np.exp(s - mx[:, None])
            denom = p.sum(axis=1) + np.exp(sink - mx)
            out[i] = _matvecs(p, keys.T) / denom[:, None]
        return out

    def grouped_output(self, o, w_a, w_b):
        cfg = self.cfg
        n = o.shape[0]
        G = cfg.o_groups
        og = o.reshape(n, G, -1)  # group g = heads g·H/G … (g+1)·H/G − 1
        A = self._matrix(w_a).reshape(G, cfg.o_lora_rank, -1)
        low = np.concatenate([_matvecs(og[:, g], A[g]) for g in range(G)], axis=1)
        return _matvecs(low, self._matrix(w_b))

    def router_scores(self, f, gate_inp, bias) -> tuple[np.ndarray, np.ndarray]:
        """§3.7: the experts' weights p [n, n_expert] and the selection scores (p + bias)."""
        p = np.sqrt(_softplus(self.linear(f, gate_inp)))
        return p, (p if bias is None else p + self._vector(bias))

    def router(self, f, gate_inp, bias, tid2eid, tokens, il):
        cfg = self.cfg
        p, sel = self.router_scores(f, gate_inp, bias)
        if tid2eid is not None:
            table = tid2eid.values()  # [vocab, k]
            ids = table[np.asarray(tokens, dtype=np.int64)].astype(np.int64)
        else:
            ids = np.argsort(-sel, axis=1, kind="stable")[:, : cfg.n_expert_used]
        w = rules.router_weights(np.take_along_axis(p, ids, axis=1), cfg.expert_weights_scale)
        return ids, w.astype(np.float32)

    def moe(self, f, ids, weights, gate, up, down, il):
        clamp = self.cfg.swiglu_clamp[il]
        out = np.zeros_like(f)
        contrib = np.zeros((f.shape[0], ids.shape[1], f.shape[1]), dtype=np.float32)
        for e in np.unique(ids):
            tok, slot = np.nonzero(ids == e)
            x = f[tok]
            h = _swiglu(_matvecs(x, self._matrix(gate, e)), _matvecs(x, self._matrix(up, e)), clamp)
            h = h * weights[tok, slot][:, None]
            contrib[tok, slot] = _matvecs(h, self._matrix(down, e))
        # sum the k contributions in slot order, whatever order the experts were visited in
        for k in range(ids.shape[1]):
            out += contrib[:, k]
        return out

    def ids_from_numpy(self, ids):
        return np.asarray(ids, dtype=np.int64)

    def expert_part(self, ids, weights, first, count):
        mine = (ids >= first) & (ids < first + count)
        return np.where(mine, ids - first, 0), np.where(mine, weights, np.float32(0)).astype(np.float32)

    def shared_expert(self, f, gate, up, down, il):
        h = _swiglu(self.linear(f, gate), self.linear(f, up), self.cfg.swiglu_clamp[il])
        return self.linear(h, down)

    def add(self, a, b):
        return a + b

    def concat_rows(self, parts):
        return np.concatenate(parts, axis=0)

    def _head_input(self, X, hc, norm):
        """§3.8 up to the LM head: mHC collapse with the head's weights, then the final norm."""
        cfg = self.cfg
        flat = _rms(X.reshape(X.shape[0], -1), cfg.rms_eps)
        mix = _matvecs(flat, self._matrix(hc.fn))
        pre = rules.mhc_pre_weights(mix, self._vector(hc.scale)[0], self._vector(hc.base), cfg.hc_eps)
        return self.rms_norm((pre[:, :, None] * X).sum(axis=1).astype(np.float32), norm)

    def _head_blocks(self, out):
        """The LM head decoded in bounded row blocks (it is the largest matrix of the model), or
        whole from the cache where it fits there."""
        if out.dims[0] * out.dims[1] * 4 <= self.cache_bytes:
            yield 0, self._matrix(out)
            return
        rows = out.rows()
        for r in range(0, rows.shape[0], HEAD_BLOCK_ROWS):
            yield r, dequantize_rows(rows[r: r + HEAD_BLOCK_ROWS], out.type, out.dims[0])

    def output_logits(self, X, hc, norm, out):
        h = self._head_input(X[-1:], hc, norm)[0]
        logits = np.empty(out.dims[1], dtype=np.float32)
        for r, blk in self._head_blocks(out):
            logits[r: r + blk.shape[0]] = blk @ h
        return logits

    def output_argmax(self, X, hc, norm, out):
        h = self._head_input(X, hc, norm)
        best = np.full(X.shape[0], -np.inf, dtype=np.float32)
        ids = np.zeros(X.shape[0], dtype=np.int64)
        for r, blk in self._head_blocks(out):
            scores = _matvecs(h, blk)  # row by row, as output_logits computes them
            arg = np.argmax(scores, axis=1)
            val = scores[np.arange(len(arg)), arg]
            better = val > best  # strict: on a tie the earlier block (lower id) keeps it
            best[better], ids[better] = val[better], r + arg[better]
        return ids


def softmax_pool(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """§3.5 (core.rules.softmax_pool) over the rows of one window [rows, d]."""
    return rules.softmax_pool(scores, values, 0).astype(np.float32)


def rope_tail(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, n_rot: int,
              inverse: bool = False) -> np.ndarray:
    """Rotate adjacent pairs of the last n_rot dims of rows [n, ..., d] at per-row positions."""
    theta = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [n, n_rot/2]
    cos, sin = np.cos(theta), np.sin(theta)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (n_rot // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    y = np.array(x, dtype=np.float32, copy=True)
    t = y[..., -n_rot:]
    t[..., 0::2], t[..., 1::2] = rules.rope_rotate(t[..., 0::2].copy(), t[..., 1::2].copy(), cos, sin)
    return y
