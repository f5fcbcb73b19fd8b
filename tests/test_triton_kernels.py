"""Each Triton kernel against the reference backend (or the numpy definitions it uses), on random
inputs (seeds.py: the same every run unless DS4_TEST_SEED says otherwise): block formats, the
numerics simulations, mHC, norms and RoPE, the compressor, indexer and attention
(test_triton_experts.py: routing and experts; test_triton_sampling.py: the next-token kernels).
Without a GPU the kernels run under TRITON_INTERPRET=1 on small shapes; with one, compiled."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import gguf.quants as gq  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ds4.backends.reference.backend import rope_tail  # noqa: E402
from ds4.backends.triton import kernels as K  # noqa: E402
from ds4.backends.triton.backend import TritonBackend  # noqa: E402
from ds4.backends.triton.kernels.common import _iq2_sign_index, _iq2_signs  # noqa: E402
from ds4.backends.triton.layout import Q8C  # noqa: E402
from ds4.core import numerics as nx  # noqa: E402
from ds4.core.gguf_model import Tensor  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.quants import dequantize_rows, random_blocks, row_bytes  # noqa: E402
from ds4.core.rope import layer_inv_freq  # noqa: E402
from ds4.core.state import FILL  # noqa: E402
from triton_pair import DEVICE, _cfg, _check_xq, _rel, _states, _t, several_tiles  # noqa: E402
from triton_pair import model, pair, rng  # noqa: E402,F401  (fixtures)


# ---- block formats ------------------------------------------------------------------------------

# (type, row length): Q8_0 rows of 512 go to the device as Q8C chunks, rows of 160 stay GGUF blocks
LINEAR_TYPES = [(T.F32, 512), (T.F16, 512), (T.BF16, 512), (T.Q8_0, 512), (T.Q8_0, 160), (T.Q2_K, 512),
                (T.Q4_K, 512), (T.IQ2_XXS, 512)]


@pytest.mark.parametrize("ttype,K", LINEAR_TYPES, ids=lambda v: v.name if isinstance(v, T) else str(v))
def test_linear_reads_every_block_format(ttype, K, rng):
    """Matrix-vector (decode) and matrix-matrix (prefill) products on the uploaded blocks equal
    the numpy decode of the GGUF bytes followed by a float64 product."""
    cfg = _cfg()
    tri = TritonBackend(cfg, device=DEVICE)
    N = 40
    raw = random_blocks(ttype, N * K, rng, scale=0.05)
    w = tri.upload(Tensor("w", ttype, (K, N), raw))
    assert w.kt == (Q8C if ttype == T.Q8_0 and K % 256 == 0 else int(ttype))
    dense = dequantize_rows(raw.reshape(N, row_bytes(ttype, K)), ttype, K).astype(np.float64)
    # decode: the generic and every specialised block decoder; prefill: float32-decoded tiles,
    # and (Q8_0, Q2_K, IQ2_XXS) integer units on bf16 tensor cores, x in three bf16 terms
    paths = [{w.kt: p} for p in TritonBackend.MV_PATHS.get(w.kt, ())]
    cases = [(1, {}, None)] + [(n, p, None) for p in paths for n in (1, 3)]
    for n, mv_types, prec in cases + [(19, {}, "ieee"), (19, {}, "bf16x3")]:
        tri.mv_types = mv_types
        plain = not mv_types
        if prec:
            tri.prec = prec
        x = rng.standard_normal((n, K)).astype(np.float32)
        y = tri.to_numpy(tri.linear(_t(tri, x), w))
        assert y.shape == (n, N)
        want_x = x.astype(np.float64)
        if mv_types.get(w.kt) == 309:  # x in XQ8 form: the product of the x it stands for
            want_x = _check_xq(*[tri.to_numpy(t) for t in tri._xq(_t(tri, x), perm=True)], x, perm=True)
        assert _rel(y, want_x @ dense.T) < 2e-6, (ttype.name, n, plain, prec)
    # decode with the RMSNorm fused into the product (decoders without a fused norm hand it on)
    tri.mv_types = dict(TritonBackend(cfg, device=DEVICE).mv_types)
    x = rng.standard_normal((1, K)).astype(np.float32) * 3
    nwv = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw = tri.upload(Tensor("nw", T.F32, (K,), nwv.view(np.uint8)))
    xn = x / np.sqrt((x.astype(np.float64) ** 2).mean() + cfg.rms_eps) * nwv
    # fused, and (norm_fuse_max = 1: the programs would read x too often) normalised first
    for fuse_max, kernels in ((1 << 40, ["matvec_kernel"]), (1, ["rms_kernel", "matvec_kernel"])):
        tri.norm_fuse_max, tri.ledger = fuse_max, []
        y = tri.to_numpy(tri.linear(tri.rms_norm(_t(tri, x), nw), w))
        assert [k for k, _ in tri.ledger] == kernels
        assert _rel(y, xn @ dense.T) < 2e-6, (ttype.name, "fused norm", fuse_max)


def test_q8c_prefill_products_on_two_fp16_planes(rng):
    """Q8C prefill products under bf16x3 (q8_hl): the weight split exactly into two fp16 planes
    (q8c_hl_kernel), three fp16 products against x in two terms (matmul_f16w_kernel WLO; four
    with the low terms' product, hl_products). Against the float64 product of gguf-py's decode,
    value by value within 2^-20 of Σ|x||w|: blocks whose scales span 2^-14..1 of their row's
    largest, x values from 1 down to 2^-24 of their row's largest, ragged tiles (19 tokens, 48
    rows), groups; and the same bound with q8_hl off (matmul_kernel). On a GPU the bound also
    catches one tensor-core accumulator over K (hl_fresh off exceeds it; the errors measured:
    bench/triton/results_h100/q8hl-accuracy-2026-12-06.csv)."""
    tri = several_tiles(TritonBackend(_cfg(), device=DEVICE))
    N, K = 48, 512
    blocks = random_blocks(T.Q8_0, N * K, rng, scale=0.05).reshape(-1, 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    spread = np.exp2(-rng.integers(0, 15, len(blocks))).astype(np.float32)[:, None]
    blocks[:, :2] = (d * spread).astype("<f2").view(np.uint8)
    raw = blocks.reshape(-1)
    w = tri.upload(Tensor("w", T.Q8_0, (K, N), raw))
    assert w.kt == Q8C and tri.prec == "bf16x3" and tri.q8_hl
    dense = gq.dequantize(raw.reshape(N, row_bytes(T.Q8_0, K)), GGMLQuantizationType(int(T.Q8_0))).astype(np.float64)

    def x_of(n, width):
        mag = np.exp2(-rng.uniform(0, 24, (n, width)))
        return (rng.choice([-1.0, 1.0], (n, width)) * mag).astype(np.float32)

    def check(y, x, dw, what):
        want = x.astype(np.float64) @ dw.T
        bound = np.abs(x.astype(np.float64)) @ np.abs(dw).T * 2.0 ** -20
        assert np.isfinite(y).all() and (np.abs(y - want) <= bound).all(), what

    x = x_of(19, K)
    for hl, products in ((True, 4), (True, 3), (False, 4)):
        tri.q8_hl, tri.hl_products, tri.ledger = hl, products, []
        y = tri.to_numpy(tri.linear(_t(tri, x), w))
        ran = [k for k, _ in tri.ledger]
        assert ran == (["x16_kernel", "q8c_hl_kernel", "matmul_f16w_kernel"] if hl else ["matmul_kernel"]), ran
        check(y, x, dense, ("plain", hl, products))
    tri.q8_hl, tri.hl_products = True, 3
    xg = x_of(19, 3 * K)
    y = tri.to_numpy(tri._linear(_t(tri, xg), w, group_rows=16, group_stride=K))
    for g in range(3):
        check(y[:, 16 * g:16 * (g + 1)], xg[:, g * K:(g + 1) * K], dense[16 * g:16 * (g + 1)], ("group", g))


def test_a_prefill_groups_chunks_split_each_q8c_weight_once(rng):
    """Between a prefill group's rows (its chunks' attention sublayers) and concat_rows (its FFN),
    a Q8C weight's fp16 planes are made once and serve every chunk (hl_keep); then made anew.
    The products equal those on planes made per chunk, bit for bit, and gguf-py's within 2^-20
    of Σ|x||w|."""
    tri = several_tiles(TritonBackend(_cfg(), device=DEVICE))
    N, K, C = 48, 512, 16
    raws = [random_blocks(T.Q8_0, N * K, rng, scale=0.05) for _ in range(2)]
    ws = [tri.upload(Tensor(f"w{i}", T.Q8_0, (K, N), r)) for i, r in enumerate(raws)]
    dense = [gq.dequantize(r.reshape(N, row_bytes(T.Q8_0, K)), GGMLQuantizationType(int(T.Q8_0))).astype(np.float64)
             for r in raws]
    x = rng.standard_normal((2 * C, K)).astype(np.float32)
    xt = _t(tri, x)

    def group(keep):
        tri.hl_keep, tri.ledger = keep, []
        tri.begin_chunk({}, np.zeros(2 * C, np.int64), 0, False)
        ys = [tri.to_numpy(tri.linear(tri.rows(xt, a, a + C), w)) for a in (0, C) for w in ws]
        tri.concat_rows([xt[:C], xt[C:]])
        ys.append(tri.to_numpy(tri.linear(xt[:C], ws[0])))  # the FFN's (or the next layer's) own
        return ys, [k for k, _ in tri.ledger].count("q8c_hl_kernel")

    kept, splits = group(True)
    fresh, fresh_splits = group(False)
    assert (splits, fresh_splits) == (3, 5)
    for i, (a, w) in enumerate([(0, 0), (0, 1), (C, 0), (C, 1), (0, 0)]):
        assert np.array_equal(kept[i], fresh[i]), i
        want = x[a:a + C].astype(np.float64) @ dense[w].T
        assert (np.abs(kept[i] - want) <= np.abs(x[a:a + C]) @ np.abs(dense[w]).T * 2.0 ** -20).all(), i


@pytest.mark.parametrize("ttype,fast", [(T.IQ2_XXS, 417), (T.Q2_K, 110)], ids=["IQ2_XXS", "Q2_K"])
def test_decoders_with_16_byte_x_loads_fall_back_on_unaligned_rows(ttype, fast, rng):
    """417 (416) and 110 load x 16 bytes at a time, so a row of x that does not start on 16 bytes (a
    view one float in) takes the generic decoder, and the product is still right."""
    tri = TritonBackend(_cfg(), device=DEVICE)
    N, K = 24, 512
    raw = random_blocks(ttype, N * K, rng, scale=0.05)
    w = tri.upload(Tensor("w", ttype, (K, N), raw))
    tri.mv_types = {**tri.mv_types, w.kt: fast}  # (whatever the tuning's default decoder)
    assert tri._mv_cfg(w.kt, N, K)["TYPE"] == fast
    assert tri._mv_cfg(w.kt, N, K, x16=False)["TYPE"] == int(ttype)
    dense = gq.dequantize(raw.reshape(N, row_bytes(ttype, K)), GGMLQuantizationType(int(ttype))).astype(np.float64)
    for off in (0, 1):
        xb = rng.standard_normal((2, K + 4)).astype(np.float32)
        x = _t(tri, xb)[:, off:off + K]
        y = tri.to_numpy(tri.linear(x, w))
        assert _rel(y, xb[:, off:off + K].astype(np.float64) @ dense.T) < 2e-6, off


def test_split_k_and_the_per_shape_table(rng, tmp_path):
    """Decode products with K split over programs (matvec_kernel's split-K: partial sums added
    by the last program of each tile, in a fixed order) for the FMA decoders, with the fused
    RMSNorm, grouped rows and several tokens, chosen through the per-shape table as a tuned
    table file names them; twice, so the tickets reset. Against numpy decode + float64."""
    from ds4.backends.triton.backend import load_mv_shapes

    cfg = _cfg()
    tri = TritonBackend(cfg, device=DEVICE)
    N, K = 48, 1024
    table = tmp_path / "shapes.json"
    table.write_text(json.dumps({"shapes": {f"linear,{Q8C},{N},{K}": [308, 256, 16, 4, 4, 4],
                                            f"linear,{int(T.F16)},{N},{K}": [int(T.F16), 256, 16, 4, 2]}}))
    tri.mv_shapes = load_mv_shapes(str(table))
    assert tri.mv_shapes[("linear", Q8C, N, K)] == (308, 256, 16, 4, 4, 4)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"shapes": {"lineer,80,48,1024": [308, 256, 16, 4]}}))
    with pytest.raises(ValueError, match="lineer"):
        load_mv_shapes(str(bad))
    os.environ["DS4_TRITON_MV_SHAPES"] = str(tmp_path / "missing.json")
    try:
        with pytest.raises(ValueError, match="DS4_TRITON_MV_SHAPES"):
            TritonBackend(cfg, device=DEVICE)
    finally:
        del os.environ["DS4_TRITON_MV_SHAPES"]
    nwv = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw = tri.upload(Tensor("nw", T.F32, (K,), nwv.view(np.uint8)))
    # 308: K in 4 parts, one chunk per step, four rows per thread; in 2 parts, two chunks per
    # step, one and two rows per thread
    q8 = ((308, 256, 16, 4, 4, 4), (308, 512, 16, 4, 2, 1), (308, 512, 8, 4, 2, 2))
    for ttype, splits in ((T.Q8_0, q8), (T.F16, ((int(T.F16), 256, 16, 4, 2),))):
        raw = random_blocks(ttype, N * K, rng, scale=0.05)
        w = tri.upload(Tensor("w", ttype, (K, N), raw))
        dense = dequantize_rows(raw.reshape(N, row_bytes(ttype, K)), ttype, K).astype(np.float64)
        tri.mv_shapes[("linear", w.kt, N, K)] = (416, 1024, 32, 4)  # another layout's decoder
        with pytest.raises(ValueError, match="decoder 416"):
            tri.linear(_t(tri, rng.standard_normal((1, K)).astype(np.float32)), w)
        for entry in splits:
            tri.mv_shapes[("linear", w.kt, N, K)] = entry
            for n in (1, 3):
                x = rng.standard_normal((n, K)).astype(np.float64)
                tri.ledger = []
                for _ in range(2):
                    y = tri.to_numpy(tri.linear(_t(tri, x.astype(np.float32)), w))
                    assert _rel(y, x @ dense.T) < 2e-6, (ttype.name, entry, n)
                assert tri.ledger[0][0] == "matvec_kernel"
                ms = np.sqrt((x ** 2).mean(axis=1, keepdims=True) + cfg.rms_eps)
                y = tri.to_numpy(tri.linear(tri.rms_norm(_t(tri, x.astype(np.float32)), nw), w))
                assert _rel(y, (x / ms * nwv) @ dense.T) < 2e-6, (ttype.name, entry, n, "norm")
                xg = rng.standard_normal((n, 3 * K))
                y = tri.to_numpy(tri._linear(_t(tri, xg.astype(np.float32)), w, group_rows=16, group_stride=K))
                want = np.concatenate([xg[:, g * K:(g + 1) * K] @ dense[16 * g:16 * (g + 1)].T for g in range(3)], 1)
                assert _rel(y, want) < 2e-6, (ttype.name, entry, n, "groups")
    assert not tri._split_cnt.any()  # every tile's ticket is back at zero


def test_linear_fused_norm_and_groups(pair, rng):
    ref, wr, tri, wt = pair
    L_r, L_t = wr.layers[3], wt.layers[3]
    cfg = ref.cfg
    for n in (1, 2, 17):
        x = rng.standard_normal((n, cfg.n_embd)).astype(np.float32) * 3
        want = ref.linear(ref.rms_norm(x, L_r.attn_norm), L_r.attn_q_a)
        got = tri.to_numpy(tri.linear(tri.rms_norm(_t(tri, x), L_t.attn_norm), L_t.attn_q_a))
        assert _rel(got, want) < 2e-6
        o = rng.standard_normal((n, cfg.n_head, cfg.head_dim)).astype(np.float32)
        want = ref.grouped_output(o, L_r.attn_output_a, L_r.attn_output_b)
        got = tri.to_numpy(tri.grouped_output(_t(tri, o), L_t.attn_output_a, L_t.attn_output_b))
        assert _rel(got, want) < 2e-6


# ---- numerics simulations -----------------------------------------------------------------------

def test_fp8_and_f16_cache_rows_are_bit_exact(pair, rng):
    ref, _, tri, _ = pair
    cfg = ref.cfg
    rs, ts = _states(ref, tri, cfg, 0)
    n = 5
    kv = (rng.standard_normal((n, cfg.head_dim)) * rng.uniform(0.01, 300, (n, 1))).astype(np.float32)
    kv[0, :64] = 0  # an all-zero FP8 block
    ref.kv_store(rs, kv, 13)
    tri.kv_store(ts, _t(tri, kv), 13)
    assert np.array_equal(tri.state_to_numpy(ts, "raw"), rs["raw"])


def test_indexer_qat_matches_numerics(pair, rng, monkeypatch):
    """Hadamard + FP4 of the indexer's queries (rope_kernel's QAT path) against ds4.core.numerics."""
    ref, _, tri, _ = pair
    cfg = ref.cfg
    n, IH, ID = 3, cfg.indexer_heads, cfg.indexer_head_dim
    x = rng.standard_normal((n, IH, ID)).astype(np.float32) * rng.uniform(0.1, 10, (n, IH, 1)).astype(np.float32)
    il = 2
    want = rope_tail(x, np.arange(40, 40 + n), layer_inv_freq(cfg, il), cfg.n_rot)
    want = nx.indexer_qat(want) if ref.ds4_numerics else want
    tri._set_pos(40)
    for heads in (64, 1):  # heads per program (rope_rows_decode)
        monkeypatch.setattr(tri, "rope_rows_decode", heads)
        got = tri.to_numpy(tri._rope(_t(tri, x), il, inverse=False, qat=tri.ds4_numerics))
        # a value on an FP4 rounding boundary may round the other way after a 1-ulp RoPE difference
        bad = np.abs(got - want) > 1e-5 * np.abs(want).max()
        assert bad.mean() < 0.01, heads


# ---- mHC, norms, RoPE ---------------------------------------------------------------------------

def test_hc_pre_post(pair, rng, monkeypatch):
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    for n in (1, 4, 20):  # 4 and 20: several tokens per mixing program (one partial)
        X = rng.standard_normal((n, cfg.n_hc, cfg.n_embd)).astype(np.float32)
        a = ref.hc_pre(X, wr.layers[1].hc_ffn)
        # one token: the finalize as two launches (x_in; post and comb) and as one
        for beside in ((True, False) if n == 1 else (True,)):
            monkeypatch.setattr(tri, "hc_comb_beside", beside)
            b = [tri.to_numpy(v) for v in tri.hc_pre(_t(tri, X), wt.layers[1].hc_ffn)]
            for u, v in zip(a, b):
                assert _rel(v, u) < 1e-5, (n, beside)
        monkeypatch.setattr(tri, "hc_comb_beside", True)
        y = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        y2 = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        want = ref.hc_post(y + y2, X, a[1], a[2])
        got = tri.to_numpy(tri.hc_post(tri.add(_t(tri, y), _t(tri, y2)), _t(tri, X), _t(tri, a[1]), _t(tri, a[2])))
        assert _rel(got, want) < 1e-6
        # the next collapse straight after an expand: one token computes the expand inside its
        # mixing kernel (hc_mix_kernel EXPAND), more tokens materialise it first
        Xn = tri.hc_post(_t(tri, y), _t(tri, X), _t(tri, a[1]), _t(tri, a[2]))
        nxt = [tri.to_numpy(v) for v in tri.hc_pre(Xn, wt.layers[2].hc_attn)]
        Xw = ref.hc_post(y, X, a[1], a[2])
        for u, v in zip(ref.hc_pre(Xw, wr.layers[2].hc_attn), nxt):
            assert _rel(v, u) < 1e-5
        assert _rel(tri.to_numpy(Xn), Xw) < 1e-6


def test_concat_rows_writes_pending_expansions_in_place(pair, rng):
    """concat_rows (graph.forward_chunks) of chunk states, pending mHC expansions among them (one
    with two summed outputs), equals the reference's expansions one after another, bit for bit
    against each expansion made alone; rows gives a chunk back."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    parts, want, alone = [], [], []
    for i, n in enumerate((3, 5, 2)):
        X = rng.standard_normal((n, cfg.n_hc, cfg.n_embd)).astype(np.float32)
        _, post, comb = ref.hc_pre(X, wr.layers[1].hc_ffn)
        y, y2 = (rng.standard_normal((n, cfg.n_embd)).astype(np.float32) for _ in range(2))
        if i == 2:  # an array already made: copied as it is
            parts.append(_t(tri, X))
            want.append(X)
            alone.append(X)
            continue
        ys = tri.add(_t(tri, y), _t(tri, y2)) if i == 1 else _t(tri, y)
        args = (_t(tri, X), _t(tri, post), _t(tri, comb))
        parts.append(tri.hc_post(ys, *args))
        want.append(ref.hc_post(y + y2 if i == 1 else y, X, post, comb))
        alone.append(tri.to_numpy(tri.hc_post(tri.add(_t(tri, y), _t(tri, y2)) if i == 1 else _t(tri, y), *args)))
    got = tri.concat_rows(parts)
    assert tuple(got.shape) == (10, cfg.n_hc, cfg.n_embd)
    assert _rel(tri.to_numpy(got), np.concatenate(want)) < 1e-6
    assert np.array_equal(tri.to_numpy(got), np.concatenate(alone))
    assert np.array_equal(tri.to_numpy(tri.rows(got, 3, 8)), alone[1])


@pytest.mark.parametrize("heads", [64, 1], ids=["heads64", "heads1"])
def test_norms_and_rope(pair, heads, rng, monkeypatch):
    """heads: heads per RoPE program in decode (rope_rows_decode; 1: a program per head).
    Positions past FAST_TRIG_LIMIT take the float64 range reduction on a GPU."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    n = 3
    monkeypatch.setattr(tri, "rope_rows_decode", heads)
    for il in (0, 2):  # plain RoPE and YaRN
        q = rng.standard_normal((n, cfg.n_head * cfg.head_dim)).astype(np.float32) * 2
        for p0 in (1000, 250000):
            want = ref.rope(ref.head_norm(q), p0, il)
            got = tri.to_numpy(tri.rope(tri.head_norm(_t(tri, q)), p0, il))
            assert _rel(got, want) < 1e-5, p0
        kv = rng.standard_normal((n, cfg.head_dim)).astype(np.float32)
        w = wr.layers[il].attn_kv_a_norm
        want = ref.rope(ref.rms_norm(kv, w), 77, il)
        got = tri.to_numpy(tri.rope(tri.rms_norm(_t(tri, kv), wt.layers[il].attn_kv_a_norm), 77, il))
        assert _rel(got, want) < 1e-5
        o = rng.standard_normal((n, cfg.n_head, cfg.head_dim)).astype(np.float32)
        want = ref.rope(o, 5000, il, inverse=True)
        got = tri.to_numpy(tri.rope(_t(tri, o), 5000, il, inverse=True))
        assert _rel(got, want) < 1e-5
    x = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
    assert _rel(tri.to_numpy(tri.rms_norm(_t(tri, x))), ref.rms_norm(x)) < 1e-6


# ---- compressor, indexer, attention -------------------------------------------------------------

@pytest.mark.parametrize("il,indexer", [(2, False), (2, True), (3, False)], ids=["csa", "indexer", "hca"])
def test_compressor_over_chunks(pair, il, indexer, rng):
    """The frontier state and the compressed rows after a run of chunks of varied sizes."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    rs, ts = _states(ref, tri, cfg, il)
    w_r = wr.layers[il].indexer.compressor if indexer else wr.layers[il].compressor
    w_t = wt.layers[il].indexer.compressor if indexer else wt.layers[il].compressor
    prefix = "index" if indexer else "comp"
    p = 0
    for n in (3, 1, 6, 1, 1, 9, 2):
        a = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        ref.compressor(rs, a, w_r, p, il, indexer)
        tri.compressor(ts, _t(tri, a), w_t, p, il, indexer)
        p += n
        for k in (prefix, prefix + "_kv", prefix + "_score"):
            got, want = tri.state_to_numpy(ts, k), rs[k]
            fin = np.isfinite(want)
            assert np.array_equal(fin, np.isfinite(got)), k
            if not fin.any():
                continue
            if k == prefix and ref.ds4_numerics:
                # a value on an FP8 / FP4 rounding boundary may round the other way after a
                # 1-ulp difference upstream: a rare element may be off by one quantum
                close = np.abs(got[fin] - want[fin]) <= 1e-5 * np.abs(want[fin]).max()
                assert close.mean() > 0.98, (k, p)
            else:
                assert _rel(got[fin], want[fin]) < 1e-5, (k, p)
    assert p // cfg.ratio(il) >= 2


@pytest.mark.parametrize("chunk", [None, 8], ids=["one top-k program", "top-k programs of 8 rows"])
def test_indexer_select(pair, rng, chunk, monkeypatch):
    """The indexer's selection against the reference at prefill and decode positions, one call
    after another. With top-k programs of 8 rows a decode step's top-k is several programs that
    add up each other's counts, and each call starts from the tickets and counts the one before
    left (the scores kernel clears them)."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il = 2
    programs = []  # a decode step's top-k programs
    if chunk is not None:
        monkeypatch.setattr(tri, "topk_rows", chunk)
    rs, ts = _states(ref, tri, cfg, il, rng=rng)
    m = cfg.ratio(il)
    W_r, W_t = wr.layers[il].indexer, wt.layers[il].indexer
    for p0, n in ((4, 3), (30, 1), (37, 4), (60, 20), (120, 1)):
        qr = rng.standard_normal((n, cfg.q_lora_rank)).astype(np.float32)
        a = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        want = ref.indexer_select(rs, qr, a, W_r, p0, il)
        got = tri.indexer_select(ts, _t(tri, qr), _t(tri, a), W_t, p0, il)
        if want is None:
            assert got is None and (p0 + n) // m <= cfg.indexer_top_k
            continue
        assert np.array_equal(got.mask(want.shape[1]), want), (p0, n)
        # one query's key counts and end ticket: top-k cleared them
        assert not tri._topk_counts[:K.TOPK_START.value].any() and tri._topk_counts[K.TOPK_END.value] == 0
        if chunk is not None and n == 1:  # the tickets the programs took (one program takes none)
            programs.append(-(-((p0 + 1) // m) // chunk))
            assert tri._topk_counts[K.TOPK_START.value] == (programs[-1] if programs[-1] > 1 else 0)
        tri.topk_reg_max = 0  # the chunked top-k used past 16384 rows
        got = tri.indexer_select(ts, _t(tri, qr), _t(tri, a), W_t, p0, il)
        tri.topk_reg_max = 16384
        assert np.array_equal(got.mask(want.shape[1]), want), (p0, n)
    assert chunk is None or max(programs) > 1


def test_indexer_select_failure_leaves_no_counts(pair, rng, monkeypatch):
    """A one-query selection that fails after the scores kernel counted (here: the top-k's launch
    raises) leaves the key counts at zero, and the next selection matches the reference."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il = 2
    rs, ts = _states(ref, tri, cfg, il, rng=rng)
    W_r, W_t = wr.layers[il].indexer, wt.layers[il].indexer
    qr = rng.standard_normal((1, cfg.q_lora_rank)).astype(np.float32)
    a = rng.standard_normal((1, cfg.n_embd)).astype(np.float32)
    launch = tri._launch

    def failing(kern, *args, **kw):
        if kern.fn.__name__ == "topk_one_kernel":
            raise RuntimeError("launch failed")
        return launch(kern, *args, **kw)

    monkeypatch.setattr(tri, "_launch", failing)
    with pytest.raises(RuntimeError, match="launch failed"):
        tri.indexer_select(ts, _t(tri, qr), _t(tri, a), W_t, 120, il)
    assert not tri._topk_counts.any()
    monkeypatch.setattr(tri, "_launch", launch)
    want = ref.indexer_select(rs, qr, a, W_r, 120, il)
    got = tri.indexer_select(ts, _t(tri, qr), _t(tri, a), W_t, 120, il)
    assert np.array_equal(got.mask(want.shape[1]), want)


def _check_narrow_refused(tri, ts, name, dtype, narrow):
    """A value of 13 significant bits into state `name`: refused naming the array, the type and
    the value where its rows are narrow (`dtype`), taken as it is where they are float32."""
    bad = tri.state_to_numpy(ts, name)
    bad[3, 5] = np.float32(1 + 2 ** -12)
    if narrow:
        with pytest.raises(ValueError, match=rf"state {name}: expected values exact in {dtype}.*1\.000244"):
            tri.state_from_numpy(ts, name, bad)
    else:
        tri.state_from_numpy(ts, name, bad)
        assert tri.state_to_numpy(ts, name)[3, 5] == bad[3, 5]


def test_indexer_rows_in_bf16_under_ds4_numerics(pair, rng, monkeypatch):
    """Numerics "ds4" keeps the indexer's rows in bfloat16 (index_bf16): the rows its compressor
    writes (Hadamard + FP4, then f16) are those float32 rows hold, bit for bit, and the
    selection is the one float32 rows give. A state value bfloat16 cannot hold is refused,
    naming the array and the value, where float32 rows take it."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il = 2
    rs, ts = _states(ref, tri, cfg, il, rng=rng)
    assert ts["index"].dtype == (torch.bfloat16 if ref.ds4_numerics else torch.float32)
    with monkeypatch.context() as mp:
        mp.setattr(tri, "index_bf16", False)
        ts32 = tri.alloc_state({k: v.shape for k, v in rs.items()}, FILL)
    assert ts32["index"].dtype == torch.float32
    for k in rs:
        tri.state_from_numpy(ts32, k, rs[k])
    W = wt.layers[il].indexer
    p0, n = 60, 20  # windows close inside the chunk: the compressor appends rows
    a = _t(tri, rng.standard_normal((n, cfg.n_embd)).astype(np.float32))
    qr = _t(tri, rng.standard_normal((n, cfg.q_lora_rank)).astype(np.float32))
    for st in (ts, ts32):
        tri.compressor(st, a, W.compressor, p0, il, True)
    rows = tri.state_to_numpy(ts, "index")
    assert np.array_equal(rows, tri.state_to_numpy(ts32, "index"))
    assert rows[p0 // cfg.ratio(il):(p0 + n) // cfg.ratio(il)].any()
    got = tri.indexer_select(ts, qr, a, W, p0 + n, il)
    want = tri.indexer_select(ts32, qr, a, W, p0 + n, il)
    assert np.array_equal(tri.to_numpy(got), tri.to_numpy(want))
    _check_narrow_refused(tri, ts, "index", "bfloat16", ref.ds4_numerics)


@pytest.mark.parametrize("n, p0", [(1, 37), (5, 126)], ids=["decode", "chunk-wrapping"])
def test_kv_row_rotated_into_the_ring(pair, rng, monkeypatch, n, p0):
    """kv_store of rope(rms_norm(kv)) (fuse_kv_store): one rope_kernel launch that stores the
    rows into the raw window, bit for bit what the rotated rows and kv_store_kernel store (the
    ring rows (p0 + t) % cap, the rest untouched), and the reference's rows."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il = 2
    rs, ts = _states(ref, tri, cfg, il, rng=rng)
    x = rng.standard_normal((n, cfg.head_dim)).astype(np.float32) * 3
    nw_r, nw_t = wr.layers[il].attn_kv_a_norm, wt.layers[il].attn_kv_a_norm
    ref.kv_store(rs, ref.rope(ref.rms_norm(x, nw_r), p0, il), p0)
    rows = {}
    for fuse in (True, False):
        monkeypatch.setattr(tri, "fuse_kv_store", fuse)
        st = {k: v.clone() for k, v in ts.items()}
        tri.ledger = []
        tri.kv_store(st, tri.rope(tri.rms_norm(_t(tri, x), nw_t), p0, il), p0)
        kernels = [k for k, _ in tri.ledger]
        assert kernels == (["rope_kernel"] if fuse else ["rope_kernel", "kv_store_kernel"])
        rows[fuse] = tri.state_to_numpy(st, "raw")
    assert np.array_equal(rows[True], rows[False])
    cap = rs["raw"].shape[0]
    written = (p0 + np.arange(n)) % cap
    untouched = np.setdiff1d(np.arange(cap), written)
    assert np.array_equal(rows[True][untouched], tri.state_to_numpy(ts, "raw")[untouched])
    # (a GPU's cos/sin may move a value across an FP8 rounding boundary: one such step is ~3e-3)
    assert _rel(rows[True][written], rs["raw"][written]) < 1e-2


def test_cache_rows_in_f16_under_ds4_numerics(pair, rng, monkeypatch):
    """Numerics "ds4" keeps the raw window's rows and the compressed attention rows in float16
    (cache_f16): the rows kv_store and the compressor write are those float32 rows hold, bit for
    bit, and attention over them gives float32 rows' output, for a decode query and a chunk: bit
    for bit on the fp16 product path, within 1e-5 on the tf32 pairs. A value float16 cannot hold
    is refused, naming the array and the value, where float32 rows take it."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il = 3  # an HCA layer: every compressed row is read
    monkeypatch.setattr(tri, "cache_f16", True)
    rs, ts = _states(ref, tri, cfg, il, rng=rng)
    want_dtype = torch.float16 if ref.ds4_numerics else torch.float32
    assert ts["raw"].dtype == want_dtype and ts["comp"].dtype == want_dtype
    with monkeypatch.context() as mp:
        mp.setattr(tri, "cache_f16", False)
        ts32 = tri.alloc_state({k: v.shape for k, v in rs.items()}, FILL)
    assert ts32["raw"].dtype == torch.float32 and ts32["comp"].dtype == torch.float32
    for k in rs:
        tri.state_from_numpy(ts32, k, rs[k])
    m = cfg.ratio(il)
    p0, n = 7 * m - 4, 12  # a window closes inside the chunk: the compressor appends a row
    a = _t(tri, rng.standard_normal((n, cfg.n_embd)).astype(np.float32))
    kv = _t(tri, rng.standard_normal((n, cfg.head_dim)).astype(np.float32) * 4)
    for st in (ts, ts32):
        tri.kv_store(st, kv, p0)
        tri.compressor(st, a, wt.layers[il].compressor, p0, il, False)
    for name in ("raw", "comp"):
        assert np.array_equal(tri.state_to_numpy(ts, name), tri.state_to_numpy(ts32, name)), name
    closed = (p0 + n) // m - 1
    assert not np.array_equal(tri.state_to_numpy(ts, "comp")[closed], rs["comp"][closed])
    sinks = wt.layers[il].attn_sinks
    for f16 in (True, False) if ref.ds4_numerics else (False,):
        monkeypatch.setattr(tri, "attn_f16", f16)
        for rows in (1, 5):  # the chunk's last positions
            p = p0 + n - rows
            q = _t(tri, rng.standard_normal((rows, cfg.n_head, cfg.head_dim)).astype(np.float32) * 3)
            got, want = (tri.to_numpy(tri.rope(tri.attention(q, st, sinks, p, il, None), p, il, inverse=True))
                         for st in (ts, ts32))
            if f16:  # the same fp16 operands either way
                assert np.array_equal(got, want), rows
            else:  # (a GPU may order the tf32 pairs' sums apart for float16 and float32 loads)
                assert _rel(got, want) < 1e-5, rows
    _check_narrow_refused(tri, ts, "raw", "float16", ref.ds4_numerics)


@triton.jit
def _iq2_signs_probe(aux_ptr, sig_ptr, idx_ptr, SUB: tl.constexpr):
    i = tl.arange(0, 128)
    a = tl.load(aux_ptr + i)
    tl.store(sig_ptr + i, _iq2_signs(a, SUB))
    tl.store(idx_ptr + i, _iq2_sign_index(a, SUB))


@pytest.mark.parametrize("sub", range(4))
def test_iq2_signs_from_interleaved_words(sub):
    """_iq2_signs and _iq2_sign_index on IQ2S group words (layout.py: bit i of entry e's 7-bit
    sign index at bit 4·i + e, the scale in bits 28-31): for every index of entry sub, with the
    other entries' bits and the scale random, the 8 signs at bit 2 of nibbles 0-7 (the 8th the
    parity of the 7: ggml's even sign patterns, as gguf-py's IQ2_XXS dequantizer reads them) and
    the index back as GGUF packs it."""
    gen = np.random.default_rng(5 + sub)
    s7 = np.arange(128, dtype=np.int64)
    words = gen.integers(0, 1 << 32, 128, dtype=np.int64)
    for i in range(7):  # entry sub's bits replaced by the index under test
        words = (words & ~(1 << (4 * i + sub))) | (((s7 >> i) & 1) << (4 * i + sub))
    aux = torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(DEVICE)
    sig = torch.zeros(128, dtype=torch.int32, device=DEVICE)
    idx = torch.zeros(128, dtype=torch.int32, device=DEVICE)
    _iq2_signs_probe[(1,)](aux, sig, idx, SUB=sub)
    want = np.zeros(128, dtype=np.int64)
    for i in range(7):
        want |= ((s7 >> i) & 1) << (4 * i + 2)
    parity = np.array([bin(int(v)).count("1") & 1 for v in s7])
    want |= parity.astype(np.int64) << 30
    assert np.array_equal(sig.cpu().numpy().view(np.uint32).astype(np.int64), want)
    assert np.array_equal(idx.cpu().numpy(), s7)


def test_scores_kernel_counts_keys_and_clears_tickets():
    """idx_score_kernel HIST for one query: the scores against numpy, every visible row's key
    counted once by its top 8 bits and once by its top 14 (as _order_key here makes them), each
    bucket holding its rows' (key, row) pairs once, in any order, and the top-k programs' start
    ticket and the chunk counts of its NPT programs cleared, nothing past them (the top-k leaves
    them set; on a GPU a stale count would be read as published). Half the key rows repeat
    others, so that rows share buckets."""
    gen = np.random.default_rng(11)
    IH, ID, CS, VIS, TOPK, NPT, CAPB = 4, 32, 48, 40, 8, 5, 64
    q = gen.standard_normal((IH, ID)).astype(np.float32)
    hw = gen.standard_normal(IH).astype(np.float32)
    keys = gen.standard_normal((CS, ID)).astype(np.float32)
    keys[1::2] = keys[gen.integers(0, CS // 2, CS // 2) * 2]
    hscale = np.float32(np.sqrt(ID * IH))
    want = ((hw / hscale)[:, None] * np.maximum(q @ keys[:VIS].T, 0)).sum(0)
    counts = torch.full((K.TOPK_CHUNKS.value + NPT + 3,), 7, dtype=torch.int32, device=DEVICE)
    counts[:K.TOPK_START.value] = 0  # (the key counts start at zero; the tickets do not need to)
    out = torch.zeros(CS, dtype=torch.float32, device=DEVICE)
    bkt = torch.zeros(2 * 16384 * CAPB, dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([VIS - 1], dtype=torch.int32, device=DEVICE)
    K.idx_score_kernel[(1, 1)](torch.from_numpy(q).to(DEVICE), torch.from_numpy(hw).to(DEVICE),
                               torch.from_numpy(keys).to(DEVICE), out, pos, counts, bkt, 1, IH, CS, TOPK, float(hscale),
                               NPT, IHP=16, ID=ID, BC=64, EXACT=False, HIST=True, CAPB=CAPB)
    got = out.cpu().numpy()
    assert _rel(got[:VIS], want) < 1e-5
    left = counts.cpu().numpy()
    key = _order_key(got[:VIS])
    assert np.array_equal(left[:256], np.bincount(key >> 24, minlength=256))
    per_bucket = np.bincount(key >> 18, minlength=16384)
    assert np.array_equal(left[256:256 + 16384], per_bucket)
    assert per_bucket.max() > 1  # (shared buckets)
    b = bkt.cpu().numpy().reshape(2, 16384, CAPB)
    for u in np.flatnonzero(per_bucket):
        n = per_bucket[u]
        held = sorted(zip(b[0, u, :n].view(np.uint32).tolist(), b[1, u, :n].tolist()))
        rows = np.flatnonzero(key >> 18 == u)
        assert held == sorted(zip(key[rows].tolist(), rows.tolist())), u
    assert not left[K.TOPK_START.value] and left[K.TOPK_END.value] == 7
    assert not left[K.TOPK_CHUNKS.value:K.TOPK_CHUNKS.value + NPT].any()
    assert (left[K.TOPK_CHUNKS.value + NPT:] == 7).all()


def test_topk_ties_and_signed_zeros():
    """The register top-k on scores with many ties, ±0 among them and negative values, against
    a stable sort written here: the TOPK largest, equal scores by lower row, rows increasing."""
    gen = np.random.default_rng(7)
    CS, TOPK = 200, 37
    for levels in ([-0.0, 0.0, 1.5, -2.0, 3.0], [0.0, -0.0], [-1.0, -1.5, -0.0, 2.0 ** -140]):
        sc = gen.choice(np.array(levels, np.float32), CS).astype(np.float32)
        # -0.0 and +0.0 are one value; the rest by value, then row
        order = sorted(range(CS), key=lambda r: (-(float(sc[r]) + 0.0), r))
        want = np.sort(np.array(order[:TOPK]))
        idx = torch.zeros(TOPK, dtype=torch.int32, device=DEVICE)
        cnt = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        pos = torch.tensor([CS - 1], dtype=torch.int32, device=DEVICE)
        K.topk_kernel[(1,)](torch.from_numpy(sc).to(DEVICE), idx, cnt, pos, 1, CS, TOPK, BC=256, CMAX=256)
        assert int(cnt[0]) == TOPK
        assert np.array_equal(idx.cpu().numpy(), want), levels


def _order_key(sc: np.ndarray) -> np.ndarray:
    """float32 -> uint32 with the floats' order: positive floats get the sign bit set, negative
    ones are complemented (so larger magnitude, smaller key); -0.0 is taken as +0.0 first."""
    b = (sc + np.float32(0.0)).view(np.uint32)
    return np.where(b >> 31 == 0, b | np.uint32(0x80000000), ~b).astype(np.uint32)


@pytest.mark.parametrize("NP", [1, 6])
@pytest.mark.parametrize("case", ["spread", "ties", "boundary", "crowded"])
def test_topk_one_from_counts_and_buckets(case, NP):
    """The one-query top-k of several programs (topk_one_kernel) from key counts and buckets
    laid out here by numpy (as idx_score_kernel HIST leaves them; bucket entries in a random
    order), against a stable sort written here: the TOPK largest, equal scores by lower row,
    rows increasing. Both ways to the last selected key: ranking the threshold's bucket, and
    (a bucket past its capacity) bisection over every score. Six programs (a capacity past the
    visible rows, as in a decode step's graph) add up the counts the chunks before theirs
    publish, each its selected rows plus one; one program (of 512 rows) has no chunk before it
    and publishes nothing. The key counts and the end ticket are left at zero for the next step,
    and nothing is written past TOPK."""
    CS, CAPB = 300, 32
    CH = 64 if NP > 1 else 512
    for seed in range(6):
        gen = np.random.default_rng(seed)
        TOPK = int(gen.integers(20, 120))
        if case == "spread":
            sc = (gen.standard_normal(CS) * 3).astype(np.float32)
        elif case in ("ties", "boundary"):  # (1 + k·2^-23: keys that differ in their lowest bits only)
            levels = [-0.0, 0.0, 1.5, -2.0, 3.0, 2.0 ** -140] + [1.0 + k * 2.0 ** -23 for k in (9, 13, 0x1F9)]
            sc = gen.choice(np.array(levels, np.float32), CS).astype(np.float32)
            if case == "boundary":  # exactly TOPK scores of 1.5 or more
                TOPK = int((sc >= 1.5).sum())
        else:  # every score within 2^-9 of 1: one bucket, past its capacity
            sc = (1.0 + gen.integers(0, 1 << 14, CS) * 2.0 ** -23).astype(np.float32)
        order = sorted(range(CS), key=lambda r: (-(float(sc[r]) + 0.0), r))
        want = np.sort(np.array(order[:TOPK]))
        key = _order_key(sc)
        counts = np.zeros(K.TOPK_CHUNKS.value + NP, np.int32)
        buckets = np.zeros((2, 16384, CAPB), np.int32)
        for r in gen.permutation(CS):  # any order of arrival
            b = int(key[r] >> 18)
            counts[key[r] >> 24] += 1
            slot = counts[256 + b]
            counts[256 + b] += 1
            if slot < CAPB:
                buckets[0, b, slot] = np.int32(key[r].view(np.int32))
                buckets[1, b, slot] = r
        counts_t = torch.from_numpy(counts).to(DEVICE)
        idx = torch.full((TOPK + 64,), -1, dtype=torch.int32, device=DEVICE)
        cnt = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        pos = torch.tensor([CS - 1], dtype=torch.int32, device=DEVICE)
        K.topk_one_kernel[(NP,)](torch.from_numpy(sc).to(DEVICE), idx, cnt, pos, counts_t,
                                 torch.from_numpy(buckets.reshape(-1)).to(DEVICE), 1, TOPK, NP, CH=CH, CAPB=CAPB, LB=CH,
                                 SB=2)
        assert int(cnt[0]) == TOPK
        got = idx.cpu().numpy()
        assert np.array_equal(got[:TOPK], want) and (got[TOPK:] == -1).all(), (case, seed)
        left = counts_t.cpu().numpy()
        assert not left[:K.TOPK_START.value].any() and left[K.TOPK_END.value] == 0, (case, seed)
        if NP > 1:  # the chunks' published counts, and every program's start ticket
            per_chunk = np.bincount(want // CH, minlength=NP)
            assert np.array_equal(left[K.TOPK_CHUNKS.value:], per_chunk + 1), (case, seed)
            assert left[K.TOPK_START.value] == NP
        else:
            assert not left[K.TOPK_START.value:].any(), (case, seed)


@pytest.mark.parametrize("il", [0, 2, 3], ids=["sliding", "csa", "hca"])
def test_attention(pair, il, rng, monkeypatch):
    """Both product paths against the reference: under ds4 numerics fp16 tensor cores (the
    default) and tf32 pairs; exact numerics have only the tf32 one."""
    ref, wr, tri, wt = pair
    for f16 in (True, False) if ref.ds4_numerics else (False,):
        monkeypatch.setattr(tri, "attn_f16", f16)
        _check_attention(ref, wr, tri, wt, il, rng)


def test_attention_splits_capped(pair, rng, monkeypatch):
    """attn_max_splits: a decode query's rows in at most that many programs per head group (then
    more rows a program than attn_split_rows), merged as before: the HCA layer at position 120
    (8 window + 15 compressed rows) in 6 programs of 4 rows, and capped at 2 (16 rows each),
    both against the reference."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il, p0 = 3, 120
    rs, ts = _states(ref, tri, cfg, il, rng=rng)
    sinks_r, sinks_t = wr.layers[il].attn_sinks, wt.layers[il].attn_sinks
    grids = []
    launch = tri._launch
    monkeypatch.setattr(tri, "_launch",
                        lambda kern, grid, *a, **k: (grids.append((kern.fn.__name__, grid)), launch(kern, grid, *a, **k))[1])
    monkeypatch.setattr(tri, "attn_split_rows", 4)
    q = rng.standard_normal((1, cfg.n_head, cfg.head_dim)).astype(np.float32) * 3
    want = ref.attention(q, rs, sinks_r, p0, il, None)
    for cap, splits, heads in ((1 << 30, 6, 16), (2, 2, 16), (2, 2, 32)):
        monkeypatch.setattr(tri, "attn_max_splits", cap)
        monkeypatch.setattr(tri, "attn_decode_heads", heads)  # (heads a program: one group here)
        grids.clear()
        got = tri.to_numpy(tri.attention(_t(tri, q), ts, sinks_t, p0, il, None))
        assert [g[2] for name, g in grids if name == "attn_kernel"] == [splits]
        assert _rel(got, want) < 1e-5, (cap, heads)


def _check_attention(ref, wr, tri, wt, il, rng):
    cfg = ref.cfg
    rs, ts = _states(ref, tri, cfg, il, rng=rng)
    sinks_r, sinks_t = wr.layers[il].attn_sinks, wt.layers[il].attn_sinks
    m = cfg.ratio(il)
    for p0, n in ((0, 1), (5, 2), (50, 1), (61, 17)):
        q = rng.standard_normal((n, cfg.n_head, cfg.head_dim)).astype(np.float32) * 3
        sel = None
        if m == 4 and (p0 + n) // m > cfg.indexer_top_k:
            sel = np.zeros((n, (p0 + n) // m), dtype=bool)
            for i in range(n):
                vis = (p0 + i + 1) // m
                keep = rng.choice(vis, min(vis, cfg.indexer_top_k), replace=False)
                sel[i, keep] = True
        want = ref.attention(q, rs, sinks_r, p0, il, sel)
        tsel = None
        if sel is not None:
            from ds4.backends.triton.backend import Selection

            idx = np.zeros((n, cfg.indexer_top_k), np.int32)
            cnt = np.zeros(n, np.int32)
            for i in range(n):
                r = np.nonzero(sel[i])[0]
                idx[i, : r.size], cnt[i] = r, r.size
            tsel = Selection(_t(tri, idx, torch.int32), _t(tri, cnt, torch.int32), cfg.indexer_top_k)
        got = tri.to_numpy(tri.attention(_t(tri, q), ts, sinks_t, p0, il, tsel))
        assert _rel(got, want) < 1e-5, (p0, n, tri.attn_f16)
        if n > 1:  # a chunk: the query's head norm and RoPE as the kernel loads it (attn_q_rope),
            # the inverse RoPE as it stores the output (attn_o_rope): fewer launches, the same result
            qr = rng.standard_normal((n, cfg.n_head * cfg.head_dim)).astype(np.float32) * 3
            want_r = ref.rope(ref.attention(ref.rope(ref.head_norm(qr), p0, il), rs, sinks_r, p0, il, sel),
                              p0, il, inverse=True)
            got_r, tuned = {}, (tri.attn_q_rope, tri.attn_o_rope)
            try:
                for fq, fo in ((True, True), (True, False), (False, True), (False, False)):
                    tri.attn_q_rope, tri.attn_o_rope, tri.ledger = fq, fo, []
                    o = tri.attention(tri.rope(tri.head_norm(_t(tri, qr)), p0, il), ts, sinks_t, p0, il, tsel)
                    got_r[fq, fo] = tri.to_numpy(tri.rope(o, p0, il, inverse=True))
                    launched = [k for k, _ in tri.ledger]
                    assert launched == ["rope_kernel"] * (not fq) + ["attn_kernel"] + ["rope_kernel"] * (not fo)
                    if fo:  # (launched by its inverse RoPE: a second read is refused, not run on moved state)
                        with pytest.raises(RuntimeError, match="already read with its inverse RoPE"):
                            tri.rope(o, p0, il, inverse=True)
                    assert _rel(got_r[fq, fo], want_r) < 1e-5, (p0, n, fq, fo)
            finally:
                (tri.attn_q_rope, tri.attn_o_rope), tri.ledger = tuned, None
            for v in got_r.values():
                assert _rel(v, got_r[False, False]) < 1e-6
        if n == 1:  # the split decode path with the inverse RoPE fused into the merge
            want_inv = ref.rope(want, p0, il, inverse=True)
            comb = tri.rope(tri.attention(_t(tri, q), ts, sinks_t, p0, il, tsel), p0, il, inverse=True)
            tri.ledger = []
            xq = [tri.to_numpy(t) for t in tri._xq(comb, perm=True)]  # the merge stores both forms
            assert [k for k, _ in tri.ledger] == ["attn_combine_kernel"]
            got_inv = tri.to_numpy(comb)
            assert _rel(got_inv, want_inv) < 1e-5
            _check_xq(*xq, got_inv.reshape(1, -1), perm=True)
