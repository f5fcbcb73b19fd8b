"""The DS4 forward pass, written once against the backend op interface (ds4/backends/base.py).

A chunk of tokens at absolute positions [p0, p0 + n) runs layer-major: every layer's attention
sublayer for the whole chunk, then its FFN sublayer, then the next layer. Within a chunk the ops
respect causality themselves (the raw window and compressed rows a query sees depend on its own
position), so one chunk, many chunks and token-by-token decode compute the same function.
Several chunks of one prompt may also share their FFN sublayers (forward_chunks), which treat
each token alone. Spec §3 has every formula; the comments here point at its sections.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .tp_split import Gate
from .weights import LayerWeights, ModelWeights


class Partner(Protocol):
    """A tensor-parallel rank's link to the other ranks (ds4/tp): the two gates of each layer
    sum the ranks' partial sublayer outputs. Ranks on different backends also take the
    leader's routing (`routing`) and hidden state (`adopt`), which same-backend ranks already
    compute bit for bit (wire.md §2); `layer_done` sees the hidden state after each layer (the
    --debug-hash check); `begin_chunk` comes before a chunk's first gate (forward_chunk). None
    in the graph's arguments = one rank, the whole model."""

    def gate(self, be, il: int, gate: Gate, partial) -> Any: ...

    def routing(self, be, il: int, ids, weights) -> tuple[Any, Any]: ...

    def adopt(self, be, il: int, gate: Gate, X) -> Any: ...

    def layer_done(self, be, il: int, X) -> None: ...

    def begin_chunk(self, p0: int, rows: int, logits: bool) -> None: ...


def attention_sublayer(be, L: LayerWeights, st, X, p0: int, tp: Partner | None = None):
    """§3.4: mHC collapse, Q/KV projections, tail RoPE, cache update, sink attention, output."""
    il = L.il
    x_in, post, comb = be.hc_pre(X, L.hc_attn)
    a = be.rms_norm(x_in, L.attn_norm)
    # (issued first: the rest of the query path waits for it; the branches below do not)
    qa = be.linear(a, L.attn_q_a)
    # The KV path, the compressors and the indexer feed only the attention, not the query path:
    # a backend may run each beside it (Backend.branch). They write disjoint parts of the state.
    with be.branch():
        kv = be.rope(be.rms_norm(be.linear(a, L.attn_kv), L.attn_kv_a_norm), p0, il)
        be.kv_store(st, kv, p0)
    if L.compressor is not None:
        with be.branch():
            # Compress before attending: a token that closes a window sees its own window's row.
            be.compressor(st, a, L.compressor, p0, il, indexer=False)
    if L.indexer is not None:
        with be.branch():
            be.compressor(st, a, L.indexer.compressor, p0, il, indexer=True)
    qr = be.rms_norm(qa, L.attn_q_a_norm)  # also the indexer's input
    selected = None
    if L.indexer is not None:
        with be.branch():  # (its scores read the indexer rows the compressor above appends)
            selected = be.indexer_select(st, qr, a, L.indexer, p0, il)
    q = be.rope(be.head_norm(be.linear(qr, L.attn_q_b)), p0, il)
    o = be.attention(q, st, L.attn_sinks, p0, il, selected)
    y = be.grouped_output(be.rope(o, p0, il, inverse=True), L.attn_output_a, L.attn_output_b)
    if tp is None:
        return be.hc_post(y, X, post, comb)
    y = tp.gate(be, il, Gate.ATTN, y)  # this rank's heads only: sum the ranks' outputs (wire.md §2)
    return tp.adopt(be, il, Gate.ATTN, be.hc_post(y, X, post, comb))


def ffn_sublayer(be, L: LayerWeights, X, tokens: np.ndarray, tp: Partner | None = None):
    """§3.7: mHC collapse, routing (hash or top-k), routed + shared experts, mHC expand."""
    il = L.il
    x_in, post, comb = be.hc_pre(X, L.hc_ffn)
    f = be.rms_norm(x_in, L.ffn_norm)
    ids, weights = be.router(f, L.ffn_gate_inp, L.exp_probs_b, L.tid2eid, tokens, il)
    if tp is not None:
        ids, weights = tp.routing(be, il, ids, weights)
    if L.experts is not None:  # a tensor-parallel rank holds a contiguous part of the experts
        ids, weights = be.expert_part(ids, weights, L.experts.start, len(L.experts))
    shared = None
    if L.ffn_gate_shexp is not None:  # (a tensor-parallel rank other than 0 has none)
        with be.branch():  # the shared expert does not wait for the routing, nor the routed for it
            shared = be.shared_expert(f, L.ffn_gate_shexp, L.ffn_up_shexp, L.ffn_down_shexp, il)
    y = be.moe(f, ids, weights, L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps, il)
    if shared is not None:
        y = be.add(y, shared)
    if tp is None:
        return be.hc_post(y, X, post, comb)
    y = tp.gate(be, il, Gate.FFN, y)
    return tp.adopt(be, il, Gate.FFN, be.hc_post(y, X, post, comb))


def run_layers(be, w: ModelWeights, states: dict, X, tokens: np.ndarray, p0: int, layers: range,
               tp: Partner | None = None):
    """Layers [first, end) over a chunk; X is the mHC state [n, HC, E] entering `first`."""
    for il in layers:
        L = w.layers[il]
        X = attention_sublayer(be, L, states[il], X, p0, tp)
        X = ffn_sublayer(be, L, X, tokens, tp)
        if tp is not None:
            tp.layer_done(be, il, X)
    return X


def forward_chunk(be, w: ModelWeights, states: dict, tokens: np.ndarray, p0: int, logits: bool = True,
                  tp: Partner | None = None):
    """Embed, all layers, and (optionally) the logits of the chunk's last token (a tensor-parallel
    rank: of its vocabulary part)."""
    be.begin_chunk(states, tokens, p0, logits)
    if tp is not None:
        tp.begin_chunk(p0, len(tokens), logits)
    X = be.embed(w.token_embd, tokens)
    X = run_layers(be, w, states, X, tokens, p0, range(w.cfg.n_layer), tp)
    return be.output_logits(X, w.output_hc, w.output_norm, w.output) if logits else None


def forward_chunks(be, w: ModelWeights, states: dict, tokens: np.ndarray, bounds: list[tuple[int, int]],
                   logits: bool = True):
    """Consecutive chunks `bounds` ([a, b) each, absolute; `tokens` holds all of theirs in order)
    in one pass over the layers: at each layer every chunk's attention sublayer, in order, then
    one FFN sublayer over all their rows. A chunk's attention at layer l reads only layer l's
    state, which the chunks before it have written by then, and the FFN sublayer takes each
    token alone, so this computes what forward_chunk does chunk by chunk (bit for bit where a
    backend's FFN products treat a row alike whatever rows come with it); the routed experts,
    seeing every token of the group at once, fill their grouped tiles better (the backend's
    prefill_ffn_rows). One rank only: tensor-parallel ranks exchange each chunk's gates in
    chunk order (wire.md §2)."""
    p0 = bounds[0][0]
    if sum(b - a for a, b in bounds) != len(tokens) or any(
            b0 != a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:])):
        raise ValueError(f"forward_chunks: bounds {bounds} are not consecutive chunks of "
                         f"the {len(tokens)} tokens")
    be.begin_chunk(states, tokens, p0, logits)
    X = be.embed(w.token_embd, tokens)
    for il in range(w.cfg.n_layer):
        L = w.layers[il]
        parts = [attention_sublayer(be, L, states[il], be.rows(X, a - p0, b - p0), a) for a, b in bounds]
        X = ffn_sublayer(be, L, be.concat_rows(parts), tokens)
    return be.output_logits(X, w.output_hc, w.output_norm, w.output) if logits else None


def chunk_groups(bounds: list[tuple[int, int]], rows: int, min_rows: int = 1) -> list[list[tuple[int, int]]]:
    """Consecutive chunks gathered into groups of at most `rows` tokens for forward_chunks (a
    chunk longer than `rows` stays alone; rows 0: every chunk alone). A chunk of fewer than
    `min_rows` tokens stays alone too: a backend whose FFN takes other kernels for so few rows
    (Triton's matrix-vector paths) would give its rows other arithmetic inside a group."""
    groups: list[list[tuple[int, int]]] = []
    total = 0
    for a, b in bounds:
        last = groups[-1][-1] if groups else None
        if last and total + (b - a) <= rows and min(b - a, last[1] - last[0]) >= min_rows:
            groups[-1].append((a, b))
            total += b - a
        else:
            groups.append([(a, b)])
            total = b - a
    return groups


def chunk_bounds(start: int, end: int, prefill_cap: int) -> list[tuple[int, int]]:
    """Split [start, end) at multiples of prefill_cap, so chunks align to absolute positions
    and compressor rows finalise in the same order as in a cold run."""
    out = []
    p = start
    while p < end:
        q = min(end, (p // prefill_cap + 1) * prefill_cap)
        out.append((p, q))
        p = q
    return out


