"""The MLX backend: every op of ds4/backends/base.py as MLX ops; Metal on macOS, CPU on Linux.

Weights stay quantized (ds4/backends/mlx/quants.py): Q8_0 and Q4_K run through MLX's quantized
matmuls in a lossless transcoding, IQ2_XXS and Q2_K are decoded by MLX ops at use (for the MoE,
only the experts the router selected, gathered on the device).

The ops only build a lazy MLX graph. Nothing in a forward step goes back to the host: routing ids,
indexer masks and expert gathers stay MLX arrays, and everything that depends on positions (ring
rows, windows that close, visibility masks, RoPE angles) is known on the host from `p0` and the
chunk length before the step starts, so it enters the graph as constants. A decode step is
therefore one graph, evaluated once by `to_numpy(logits)` together with every state array the
step updated; a prefill chunk without logits is evaluated when the next chunk starts.

Semantics are the reference backend's, op for op (same state layout, same compressor frontier,
same tie rules for top-k); only float32 rounding differs. RoPE angles are computed with numpy
exactly as the reference does them, and the ds4 numerics are bit-identical (numerics.py).
"""

from __future__ import annotations

from functools import partial

import numpy as np

import mlx.core as mx

from ...core import rules
from ...core.config import ModelConfig
from ...core.gguf_model import Tensor
from ...core.rope import layer_inv_freq
from ..base import Backend
from . import numerics as nx
from .quants import Weight, upload

HEAD_BLOCK_ROWS = 8192
_NEG_INF = float("-inf")


def _f32(v) -> mx.array:
    return mx.array(np.float32(v))


mx_rules = rules.bind(mx, _f32)  # the core's rules on MLX arrays


def _sigmoid(x):
    return mx_rules.sigmoid(x)


def _swiglu(g, u, clamp: float):
    g = mx.minimum(g, clamp)
    u = mx.clip(u, -clamp, clamp)
    return g * _sigmoid(g) * u


def _softplus(x):
    # ds4's thresholds: x > 20 -> x, x < −20 -> e^x
    return mx.where(x > 20, x, mx.where(x < -20, mx.exp(mx.minimum(x, 0.0)),
                                        mx.log1p(mx.exp(mx.minimum(x, 20.0)))))


def kv_round(kv: mx.array, n_nope: int) -> mx.array:
    """A K/V cache row in ds4 numerics: FP8 round trip of the non-RoPE dims, then f16."""
    return nx.f16_round(nx.fp8_kv_roundtrip(kv, n_nope))


def index_round(x: mx.array) -> mx.array:
    """An indexer key row in ds4 numerics: Hadamard + FP4 round trip, then f16."""
    return nx.f16_round(nx.indexer_qat(x))


def sink_softmax(s: mx.array, mask: mx.array, sink: mx.array):
    """Masked scores [n, H, R] with a per-head sink logit -> (weights p, denominators [n, H])."""
    s = mx.where(mask[:, None, :], s, _NEG_INF)
    m = mx.maximum(s.max(axis=-1), sink)
    p = mx.exp(s - m[..., None])
    return p, p.sum(axis=-1) + mx.exp(sink - m)


def softmax_pool(scores: mx.array, values: mx.array) -> mx.array:
    """§3.5 (core.rules.softmax_pool) over axis 1, the rows of each window [w, rows, d]."""
    return mx_rules.softmax_pool(scores, values, 1)


def hc_split(mix: mx.array, scale: mx.array, base: mx.array, n_hc: int, iters: int, eps: float):
    """§3.2 (core.rules.mhc_split) in MLX: -> (pre [n, HC], post [n, HC], comb [n, HC, HC])."""
    return mx_rules.mhc_split(mix, scale, base, n_hc, iters, eps)


def topk_mask_stable(score: mx.array, k: int) -> mx.array:
    """Boolean mask of the k highest entries of each row, ties going to the lower index
    (np.argsort(-score, kind="stable")[:k]); rows need at least k finite entries.
    Threshold form: everything above the k-th largest value, plus the first entries equal to it."""
    kth = mx.topk(score, k, axis=-1).min(axis=-1, keepdims=True)
    above = score > kth
    tie = score == kth
    room = k - above.sum(axis=-1, keepdims=True)
    return above | (tie & (mx.cumsum(tie.astype(mx.int32), axis=-1) <= room))


def topk_ids_stable(score: mx.array, k: int) -> mx.array:
    """[n, E] -> the ids of the k highest scores, best first, ties to the lower id: k rounds of
    argmax (which returns the first maximum), each masking the id it took."""
    col = mx.arange(score.shape[-1])[None, :]
    out = []
    for _ in range(k):
        i = mx.argmax(score, axis=-1)
        out.append(i)
        score = mx.where(col == i[:, None], _NEG_INF, score)
    return mx.stack(out, axis=1)


class MLXBackend(Backend):
    name = "mlx"

    def __init__(self, cfg: ModelConfig, numerics: str = "ds4", compile: bool | None = None,
                 query_block: int = 256, expert_decode_bytes: int = 1 << 30):
        """`compile`: mx.compile the elementwise chains (default: on Metal only); `query_block`:
        queries scored at once in attention and the indexer; `expert_decode_bytes`: the float32
        bytes of IQ2_XXS / Q2_K (or float) experts decoded at once when a chunk uses them all."""
        super().__init__(cfg, numerics)
        self.query_block = int(query_block)
        self.expert_decode_bytes = int(expert_decode_bytes)
        self._freq = {il: layer_inv_freq(cfg, il) for il in range(cfg.n_layer)}
        self._pending: dict[int, dict] = {}  # states a step updated, evaluated with its result
        self.resident_bytes = 0  # bytes of the MLX arrays holding weights
        self.weights: list[Weight] = []
        # mx.compile fuses the small elementwise chains (Sinkhorn, SwiGLU, the ds4 numerics).
        # On Metal that saves kernel launches; on the CPU each fused kernel is first built by the
        # C++ compiler (about a second, cached on disk), so it is opt-in there.
        self.compiled = mx.metal.is_available() if compile is None else bool(compile)
        maybe = mx.compile if self.compiled else (lambda f: f)
        self._hc_split = maybe(partial(hc_split, n_hc=cfg.n_hc, iters=cfg.hc_sinkhorn_iter,
                                       eps=cfg.hc_eps))
        self._swiglu = maybe(_swiglu)
        self._kv_round = maybe(partial(kv_round, n_nope=cfg.n_nope))
        self._index_round = maybe(index_round)
        self._sink_softmax = maybe(sink_softmax)
        self._index_qat = maybe(nx.indexer_qat)

    @property
    def device(self) -> str:
        return "metal" if mx.default_device() == mx.gpu else "cpu"

    # ---- memory ---------------------------------------------------------------------------------

    def upload(self, tensor: Tensor) -> Weight:
        w = upload(tensor)
        mx.eval(*w.arrays)
        self.weights.append(w)
        self.resident_bytes += w.nbytes
        return w

    def alloc_state(self, shapes, fill):
        st = {k: mx.full(s, fill[k], dtype=mx.float32) for k, s in shapes.items()}
        mx.eval(*st.values())
        return st

    def state_to_numpy(self, st, name):
        return np.array(st[name], dtype=np.float32, copy=True)

    def state_from_numpy(self, st, name, value):
        value = np.asarray(value)
        if value.shape != tuple(st[name].shape):
            raise ValueError(f"state {name}: expected shape {tuple(st[name].shape)}, "
                             f"got {value.shape}")
        st[name] = mx.array(value.astype(np.float32, copy=False))

    def _touched(self, st) -> None:
        self._pending[id(st)] = st

    def _pending_arrays(self) -> list[mx.array]:
        arrays = [a for st in self._pending.values() for a in st.values()]
        self._pending.clear()
        return arrays

    def to_numpy(self, x):
        mx.eval(x, *self._pending_arrays())  # the step's one evaluation
        return np.array(x, copy=True)

    def from_numpy(self, x) -> mx.array:
        """Host rows (e.g. a pipeline stage's incoming mHC state) as an MLX array."""
        return mx.array(np.ascontiguousarray(x, dtype=np.float32))

    # ---- helpers --------------------------------------------------------------------------------

    def _rms(self, x):
        ms = mx.mean(mx.square(x), axis=-1, keepdims=True)
        return x / mx.sqrt(ms + _f32(self.cfg.rms_eps))

    def _rope_at(self, x, positions: np.ndarray, il: int, inverse: bool = False):
        """Tail RoPE of rows [n, ..., d] at per-row positions (angles in numpy, as the reference
        computes them)."""
        n_rot = self.cfg.n_rot
        theta = positions.astype(np.float32)[:, None] * self._freq[il][None, :]
        cos, sin = np.cos(theta), np.sin(theta)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (n_rot // 2,)
        cos, sin = mx.array(cos.reshape(shape)), mx.array(sin.reshape(shape))
        d = x.shape[-1]
        pairs = x[..., d - n_rot:].reshape(*x.shape[:-1], n_rot // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        rot = mx.stack(mx_rules.rope_rotate(a, b, cos, sin), axis=-1)
        rot = rot.reshape(*x.shape[:-1], n_rot)
        return mx.concatenate([x[..., : d - n_rot], rot], axis=-1)

    # ---- ops ------------------------------------------------------------------------------------

    def embed(self, token_embd: Weight, tokens):
        if self._pending:  # the previous prefill chunk's state: evaluate it before the next chunk
            mx.eval(*self._pending_arrays())
        ids = mx.array(np.asarray(tokens, dtype=np.int64).astype(np.uint32))
        e = token_embd.take(ids).f32()
        return mx.broadcast_to(e[:, None, :], (e.shape[0], self.cfg.n_hc, e.shape[1]))

    def hc_pre(self, X, hc):
        n, HC, E = X.shape
        mix = hc.fn.matmul(self._rms(X.reshape(n, HC * E)))  # [n, (2+HC)·HC]
        pre, post, comb = self._hc_split(mix, hc.scale.f32(), hc.base.f32())
        return (pre[:, None, :] @ X)[:, 0, :], post, comb

    def hc_post(self, y, X, post, comb):
        # X_new[j] = post[j]·y + Σ_i comb[i][j]·X[i]
        return post[:, :, None] * y[:, None, :] + mx.swapaxes(comb, 1, 2) @ X

    def rms_norm(self, x, weight=None):
        y = self._rms(x)
        return y if weight is None else y * weight.f32()

    def linear(self, x, w):
        return w.matmul(x)

    def head_norm(self, q):
        return self._rms(q.reshape(q.shape[0], self.cfg.n_head, self.cfg.head_dim))

    def rope(self, x, p0, il, inverse=False):
        return self._rope_at(x, np.arange(p0, p0 + x.shape[0]), il, inverse)

    def _write_ring(self, ring, rows, p0: int):
        """rows [n, D] for positions p0.. into ring rows p % cap (at most two contiguous runs)."""
        cap, n = ring.shape[0], rows.shape[0]
        if n > cap:  # only the last cap positions survive
            rows, p0, n = rows[n - cap:], p0 + n - cap, cap
        start = p0 % cap
        first = min(n, cap - start)
        ring = mx.slice_update(ring, rows[:first], mx.array([start]), axes=(0,))
        if first < n:
            ring = mx.slice_update(ring, rows[first:], mx.array([0]), axes=(0,))
        return ring

    def kv_store(self, st, kv, p0):
        if self.ds4_numerics:
            kv = self._kv_round(kv)
        st["raw"] = self._write_ring(st["raw"], kv, p0)
        self._touched(st)

    def compressor(self, st, a, w, p0, il, indexer):
        """The reference's token loop, vectorised over the chunk: the frontier rows of the open
        window(s) and the chunk's new rows form one timeline; every window that closes in the
        chunk is a contiguous run of it, pooled at once; the new frontier keeps, per row, the
        latest position with that row's residue (what the loop leaves behind)."""
        cfg = self.cfg
        m = cfg.ratio(il)
        overlap = cfg.compressor_lanes(il) > 1
        d = cfg.indexer_head_dim if indexer else cfg.head_dim
        prefix = "index" if indexer else "comp"
        n = a.shape[0]
        T = p0 + n
        pos = np.arange(p0, T)
        kv_new = w.kv.matmul(a)  # [n, c·d]
        sc_new = w.gate.matmul(a) + mx.take(w.ape.f32(), mx.array(pos % m), axis=0)
        skv, ssc = st[prefix + "_kv"], st[prefix + "_score"]
        off = m if overlap else 0  # rows 0..m−1 of a two-lane frontier: the previous window
        w0, w1 = p0 // m, T // m  # windows w0 .. w1−1 close in this chunk
        fill = p0 - w0 * m  # tokens of window w0 already in the frontier
        tl_kv = mx.concatenate([skv[: off + fill], kv_new]) if off + fill else kv_new
        tl_sc = mx.concatenate([ssc[: off + fill], sc_new]) if off + fill else sc_new
        t0 = w0 * m - off  # position of timeline row 0

        nw = w1 - w0
        if nw:
            cur_kv = tl_kv[off: off + nw * m].reshape(nw, m, -1)
            cur_sc = tl_sc[off: off + nw * m].reshape(nw, m, -1)
            if overlap:
                prev_kv = tl_kv[: nw * m].reshape(nw, m, -1)
                prev_sc = tl_sc[: nw * m].reshape(nw, m, -1)
                kv = mx_rules.overlapping_lanes(prev_kv, cur_kv, d)
                sc = mx_rules.overlapping_lanes(prev_sc, cur_sc, d)
            else:
                kv, sc = cur_kv, cur_sc
            out = self.rms_norm(softmax_pool(sc, kv), w.norm)
            out = self._rope_at(out, np.arange(w0, w1) * m, il)
            if self.ds4_numerics:
                out = self._index_round(out) if indexer else self._kv_round(out)
            st[prefix] = mx.slice_update(st[prefix], out, mx.array([w0]), axes=(0,))

        # the new frontier: row off + q % m <- position q for the chunk's last m positions; for
        # two lanes rows 0..m−1 <- the last window that closed
        rows = skv.shape[0]
        src = np.arange(rows)
        for q in range(max(w0 * m, T - m), T):
            src[off + q % m] = rows + q - t0
        if overlap and nw:
            src[:m] = rows + (w1 - 1) * m - t0 + np.arange(m)
        src = mx.array(src.astype(np.int32))
        st[prefix + "_kv"] = mx.take(mx.concatenate([skv, tl_kv]), src, axis=0)
        st[prefix + "_score"] = mx.take(mx.concatenate([ssc, tl_sc]), src, axis=0)
        self._touched(st)

    def _query_blocks(self, n: int):
        """[i0, i1) blocks of a chunk's queries, so score matrices stay bounded in long prefills."""
        b = self.query_block
        return [(i, min(n, i + b)) for i in range(0, n, b)]

    def indexer_select(self, st, qr, a, w, p0, il):
        cfg = self.cfg
        n = qr.shape[0]
        m = cfg.ratio(il)
        pos = np.arange(p0, p0 + n)
        visible = rules.visible_compressed_rows(pos, m)
        k = cfg.indexer_top_k
        if visible.max() <= k:
            return None
        IH, ID = cfg.indexer_heads, cfg.indexer_head_dim
        iq = self._rope_at(w.q_b.matmul(qr).reshape(n, IH, ID), pos, il)
        if self.ds4_numerics:
            iq = self._index_qat(iq)
        hw = w.proj.matmul(a) / _f32(np.sqrt(ID * IH))  # [n, IH]
        C = int(visible.max())
        keys = st["index"][:C]
        masks = []
        for i0, i1 in self._query_blocks(n):
            s = mx.maximum(iq[i0:i1] @ keys.T, 0.0)  # [b, IH, C]
            score = (hw[i0:i1, None, :] @ s)[:, 0, :]  # Σ_h w_h·relu(q_h·k)
            in_range = mx.array(np.arange(C)[None, :] < visible[i0:i1, None])
            if visible[i0:i1].max() > k:
                big = mx.array((visible[i0:i1] > k)[:, None])
                score = mx.where(in_range, score, _NEG_INF)
                in_range = mx.where(big, topk_mask_stable(score, k), in_range)
            masks.append(in_range)
        return mx.concatenate(masks) if len(masks) > 1 else masks[0]

    def attention(self, q, st, sinks, p0, il, selected):
        cfg = self.cfg
        n, H, D = q.shape
        raw = st["raw"]
        cap = raw.shape[0]
        W = min(cfg.sliding_window, cap)
        m = cfg.ratio(il)
        T = p0 + n
        r = np.arange(cap)[None, :]
        held = r + cap * ((T - 1 - r) // cap)  # the position ring row r holds after the chunk
        C = T // m if m else 0
        comp = st["comp"][:C] if C else None
        scale, sink = _f32(np.sqrt(D)), sinks.f32()
        out = []
        for i0, i1 in self._query_blocks(n):
            t = np.arange(p0 + i0, p0 + i1)[:, None]
            qb = q[i0:i1]
            s = (qb @ raw.T) / scale  # [b, H, cap]
            mask = mx.array((held >= 0) & (held >= t - W + 1) & (held <= t))
            if C:
                vis = mx.array(np.arange(C)[None, :] < rules.visible_compressed_rows(t, m))
                if selected is not None:
                    vis = vis & selected[i0:i1]
                s = mx.concatenate([s, (qb @ comp.T) / scale], axis=-1)
                mask = mx.concatenate([mask, vis], axis=-1)
            p, denom = self._sink_softmax(s, mask, sink)
            o = p[..., :cap] @ raw
            if C:
                o = o + p[..., cap:] @ comp
            out.append(o / denom[..., None])
        return mx.concatenate(out) if len(out) > 1 else out[0]

    def grouped_output(self, o, w_a, w_b):
        cfg = self.cfg
        n, G, r = o.shape[0], cfg.o_groups, cfg.o_lora_rank
        og = o.reshape(n, G, -1)  # group g = heads g·H/G … (g+1)·H/G − 1
        low = [w_a.slice_rows(g * r, (g + 1) * r).matmul(og[:, g]) for g in range(G)]
        return w_b.matmul(mx.concatenate(low, axis=1))

    def router(self, f, gate_inp, bias, tid2eid, tokens, il):
        cfg = self.cfg
        p = mx.sqrt(_softplus(gate_inp.matmul(f)))  # [n, n_expert]
        if tid2eid is not None:
            ids = tid2eid.take(mx.array(np.asarray(tokens, dtype=np.int64).astype(np.uint32))).data
        else:
            ids = topk_ids_stable(p if bias is None else p + bias.f32(), cfg.n_expert_used)
        ids = ids.astype(mx.uint32)
        w = mx.take_along_axis(p, ids, axis=1)
        return ids, mx_rules.router_weights(w, cfg.expert_weights_scale)

    def _experts_mm(self, x, w: Weight, idx):
        """x [n, s, 1, in] (s = 1 or k) through expert w[idx[t, j]] -> [n, k, 1, out]."""
        if w.form == "affine":  # MLX's quantized kernels read the experts in place
            s, b = w.affine_params()
            return mx.gather_qmm(x, w.data, s, b, rhs_indices=idx, transpose=True,
                                 group_size=32, bits=w.bits)
        E, out_dim, in_dim = w.shape
        per = max(1, self.expert_decode_bytes // (4 * out_dim * in_dim))
        if per >= E:
            return mx.gather_mm(x, w.f32().swapaxes(-1, -2), rhs_indices=idx)
        # decoding every expert at once would not fit: decode `per` experts at a time; each
        # (token, slot) takes its one product from the block holding its expert (the others add
        # exact zeros, so the sum is that product unchanged)
        y = None
        for e0 in range(0, E, per):
            e1 = min(E, e0 + per)
            inside = (idx >= e0) & (idx < e1)
            local = mx.where(inside, idx - e0, 0).astype(mx.uint32)
            block = w.take(mx.arange(e0, e1)).f32().swapaxes(-1, -2)
            part = mx.where(inside[..., None, None], mx.gather_mm(x, block, rhs_indices=local), 0.0)
            y = part if y is None else y + part
        return y

    def moe(self, f, ids, weights, gate, up, down, il):
        n, k = ids.shape
        if n * k < gate.shape[0]:
            # decode and short chunks: gather the selected experts' blocks on the device, so only
            # they are decoded; slot j of token t uses gathered expert t·k + j
            flat = ids.reshape(-1)
            gate, up, down = gate.take(flat), up.take(flat), down.take(flat)
            idx = mx.arange(n * k, dtype=mx.uint32).reshape(n, k)
        else:
            idx = ids
        x = f[:, None, None, :]
        h = self._swiglu(self._experts_mm(x, gate, idx), self._experts_mm(x, up, idx),
                         self.cfg.swiglu_clamp[il])
        y = self._experts_mm(h * weights[:, :, None, None], down, idx)[:, :, 0, :]  # [n, k, E]
        out = y[:, 0]
        for j in range(1, k):  # the k contributions in slot order
            out = out + y[:, j]
        return out

    def ids_from_numpy(self, ids):
        return mx.array(np.asarray(ids, dtype=np.uint32))

    def expert_part(self, ids, weights, first, count):
        mine = (ids >= first) & (ids < first + count)
        return (mx.where(mine, ids - first, 0).astype(ids.dtype),
                mx.where(mine, weights, mx.array(0.0, dtype=weights.dtype)))

    def shared_expert(self, f, gate, up, down, il):
        h = self._swiglu(gate.matmul(f), up.matmul(f), self.cfg.swiglu_clamp[il])
        return down.matmul(h)

    def add(self, a, b):
        return a + b

    def concat_rows(self, parts):
        return mx.concatenate(parts, axis=0)

    def output_logits(self, X, hc, norm, out):
        cfg = self.cfg
        x = X[-1:]  # [1, HC, E]
        flat = self._rms(x.reshape(1, -1))
        mix = hc.fn.matmul(flat)
        pre = mx_rules.mhc_pre_weights(mix, hc.scale.f32()[0], hc.base.f32(), cfg.hc_eps)
        h = self.rms_norm((pre[:, None, :] @ x)[:, 0, :], norm)  # [1, E]
        if out.form == "affine":
            return out.matmul(h)[0]
        rows = out.shape[0]  # float heads are cast to float32 a block of rows at a time
        return mx.concatenate([out.slice_rows(r, min(rows, r + HEAD_BLOCK_ROWS)).matmul(h)[0]
                               for r in range(0, rows, HEAD_BLOCK_ROWS)])
