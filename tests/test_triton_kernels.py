"""Each Triton kernel against the reference backend (or the numpy definitions it uses), on random
inputs (seeds.py: the same every run unless DS4_TEST_SEED says otherwise). Without a GPU the
kernels run under TRITON_INTERPRET=1 on small shapes; with one, the same tests run compiled."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (conftest.py)

import gguf.quants as gq  # noqa: E402
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ds4.backends.reference.backend import ReferenceBackend, rope_tail  # noqa: E402
from ds4.backends.triton.backend import TritonBackend, _grid_table  # noqa: E402
from ds4.backends.triton.layout import Q8C, q8_chunks  # noqa: E402
from ds4.core import numerics as nx  # noqa: E402
from ds4.core.gguf_model import GGUFModel, Tensor  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.quants import dequantize_rows, random_blocks, row_bytes  # noqa: E402
from ds4.core.rope import layer_inv_freq  # noqa: E402
from ds4.core.state import FILL, SessionLayout, layer_state_shapes  # noqa: E402
from ds4.core.tiny import make_tiny  # noqa: E402
from ds4.core.weights import bind_weights  # noqa: E402
from seeds import rng_for_test  # noqa: E402


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture
def rng(request):
    return rng_for_test(request)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tk") / "test.gguf"
    make_tiny(path, preset="test", seed=3)
    return GGUFModel(path)


@pytest.fixture(scope="module", params=["ds4", "exact"])
def pair(request, model):
    """(reference backend, its weights, triton backend, its weights)"""
    ref = ReferenceBackend(model.config, numerics=request.param)
    tri = TritonBackend(model.config, numerics=request.param, device=DEVICE)
    return ref, bind_weights(model, ref.upload), tri, bind_weights(model, tri.upload)


def _t(tri, x, dtype=torch.float32):
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype=dtype, device=tri.dev)


def _states(ref, tri, cfg, il, ctx=128, rng=None):
    """The same layer state on both backends, filled with random (f16-exact) values."""
    layout = SessionLayout.create(cfg, ctx)
    shapes = layer_state_shapes(cfg, layout, il)
    rs = ref.alloc_state(shapes, FILL)
    if rng is not None:
        for k, v in rs.items():
            if k.endswith("_score"):
                continue
            v[...] = nx.f16_round(rng.standard_normal(v.shape).astype(np.float32))
    ts = tri.alloc_state(shapes, FILL)
    for k in rs:
        tri.state_from_numpy(ts, k, rs[k])
    return rs, ts


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


def _cfg():
    from ds4.core.tiny import preset_config

    return preset_config("test")


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


@pytest.mark.parametrize("heads", [64, 1], ids=["heads64", "heads1"])
def test_norms_and_rope(pair, heads, rng, monkeypatch):
    """heads: heads per RoPE program in decode (rope_rows_decode; 1: a program per head)."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    n = 3
    monkeypatch.setattr(tri, "rope_rows_decode", heads)
    for il in (0, 2):  # plain RoPE and YaRN
        q = rng.standard_normal((n, cfg.n_head * cfg.head_dim)).astype(np.float32) * 2
        want = ref.rope(ref.head_norm(q), 1000, il)
        got = tri.to_numpy(tri.rope(tri.head_norm(_t(tri, q)), 1000, il))
        assert _rel(got, want) < 1e-5
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


def test_indexer_select(pair, rng):
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il = 2
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
        assert not tri._topk_counts.any()  # one query's key counts and ticket: top-k cleared them
        tri.topk_reg_max = 0  # the chunked top-k used past 16384 rows
        got = tri.indexer_select(ts, _t(tri, qr), _t(tri, a), W_t, p0, il)
        tri.topk_reg_max = 16384
        assert np.array_equal(got.mask(want.shape[1]), want), (p0, n)


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


def test_topk_ties_and_signed_zeros():
    """The register top-k on scores with many ties, ±0 among them and negative values, against
    a stable sort written here: the TOPK largest, equal scores by lower row, rows increasing."""
    from ds4.backends.triton import kernels as K

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


@pytest.mark.parametrize("case", ["spread", "ties", "boundary", "crowded"])
def test_topk_one_from_counts_and_buckets(case):
    """The one-query top-k of several programs (topk_one_kernel) from key counts and buckets
    laid out here by numpy (as idx_score_kernel HIST leaves them; bucket entries in a random
    order), against a stable sort written here: the TOPK largest, equal scores by lower row,
    rows increasing. Both ways to the last selected key: ranking the threshold's bucket, and
    (a bucket past its capacity) bisection over every score; the counts and the ticket are left
    at zero for the next step, and nothing is written past TOPK."""
    from ds4.backends.triton import kernels as K

    CS, CH, CAPB = 300, 64, 32
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
        counts = np.zeros(256 + 16384 + 16, np.int32)
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
        NP = -(-(CS + 40) // CH)  # a capacity past the visible rows, as in a decode step's graph
        K.topk_one_kernel[(NP,)](torch.from_numpy(sc).to(DEVICE), idx, cnt, pos, counts_t,
                                 torch.from_numpy(buckets.reshape(-1)).to(DEVICE), 1, TOPK, NP, CH=CH, CAPB=CAPB, LB=CH,
                                 NLB=NP)
        assert int(cnt[0]) == TOPK
        got = idx.cpu().numpy()
        assert np.array_equal(got[:TOPK], want) and (got[TOPK:] == -1).all(), (case, seed)
        assert not counts_t.any(), (case, seed)


@pytest.mark.parametrize("il", [0, 2, 3], ids=["sliding", "csa", "hca"])
def test_attention(pair, il, rng, monkeypatch):
    """Both product paths against the reference: under ds4 numerics fp16 tensor cores (the
    default) and tf32 pairs; exact numerics have only the tf32 one."""
    ref, wr, tri, wt = pair
    for f16 in (True, False) if ref.ds4_numerics else (False,):
        monkeypatch.setattr(tri, "attn_f16", f16)
        _check_attention(ref, wr, tri, wt, il, rng)


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
        if n == 1:  # the split decode path with the inverse RoPE fused into the merge
            want_inv = ref.rope(want, p0, il, inverse=True)
            comb = tri.rope(tri.attention(_t(tri, q), ts, sinks_t, p0, il, tsel), p0, il, inverse=True)
            tri.ledger = []
            xq = [tri.to_numpy(t) for t in tri._xq(comb, perm=True)]  # the merge stores both forms
            assert [k for k, _ in tri.ledger] == ["attn_combine_kernel"]
            got_inv = tri.to_numpy(comb)
            assert _rel(got_inv, want_inv) < 1e-5
            _check_xq(*xq, got_inv.reshape(1, -1), perm=True)


# ---- routing and experts ------------------------------------------------------------------------

def test_router_hash_and_topk(pair, rng):
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    n = 5
    tokens = rng.integers(0, cfg.n_vocab, n)
    for il in (0, 4):  # hash layer, top-k layer with bias
        L_r, L_t = wr.layers[il], wt.layers[il]
        f = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        ids, w = ref.router(f, L_r.ffn_gate_inp, L_r.exp_probs_b, L_r.tid2eid, tokens, il)
        tids, tw = tri.router(_t(tri, f), L_t.ffn_gate_inp, L_t.exp_probs_b, L_t.tid2eid, tokens, il)
        assert np.array_equal(tri.to_numpy(tids), ids)
        assert _rel(tri.to_numpy(tw), w) < 1e-5


def test_router_ties_pick_the_lower_expert(model):
    """Equal logits: the stable order of the reference (lower expert id first)."""
    cfg = model.config
    ref, tri = ReferenceBackend(cfg), TritonBackend(cfg, device=DEVICE)
    gate = np.zeros((cfg.n_expert, cfg.n_embd), np.float32)
    gate[[1, 5, 6]] = 1.0  # three equal winners, the rest tied at zero
    t = Tensor("g", T.F32, (cfg.n_embd, cfg.n_expert), gate.reshape(-1).view(np.uint8))
    f = np.ones((2, cfg.n_embd), np.float32)
    ids, _ = ref.router(f, t, None, None, np.zeros(2, np.int64), 4)
    tids, _ = tri.router(_t(tri, f), tri.upload(t), None, None, np.zeros(2, np.int64), 4)
    assert np.array_equal(tri.to_numpy(tids), ids)
    # every logit 0: equal scores p0 = sqrt(softplus(0)); a bias of -p0 brings experts 3 and 7 to
    # the same score near zero (a few ulps either side, or ±0), the rest to p0 - 5: negative, tied
    t0 = Tensor("g0", T.F32, (cfg.n_embd, cfg.n_expert), np.zeros(gate.size, np.float32).view(np.uint8))
    bias = np.full(cfg.n_expert, -5.0, np.float32)
    bias[[3, 7]] = -np.sqrt(np.log1p(np.exp(np.float32(0))), dtype=np.float32)
    b = Tensor("b", T.F32, (cfg.n_expert,), bias.view(np.uint8))
    ids, w = ref.router(f, t0, b, None, np.zeros(2, np.int64), 4)
    tids, tw = tri.router(_t(tri, f), tri.upload(t0), tri.upload(b), None, np.zeros(2, np.int64), 4)
    assert ids[0, :2].tolist() == [3, 7] and ids[0, 2:].tolist() == [0, 1, 2, 4, 5, 6][:cfg.n_expert_used - 2]
    assert np.array_equal(tri.to_numpy(tids), ids)
    assert _rel(tri.to_numpy(tw), w) < 1e-6


def _xq_round(v: np.ndarray) -> np.ndarray:
    """v rounded as the XQ form stores it (written out here, not taken from the kernels): blocks
    of 32 values, s = amax / 32639, q = floor(v · (32639 / amax) + 0.5) in float32, value s·q."""
    b = np.asarray(v, np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(32639) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.floor(b * inv.astype(np.float32) + np.float32(0.5))
    return (q.astype(np.float64) * (amax.astype(np.float64) / 32639)).reshape(v.shape)


def _moe_rounded(ref, f, ids, w, L, il, x_xq: bool, h_xq: bool) -> np.ndarray:
    """The reference's routed experts (dense float64 products of its decoded weights) with x
    and / or h rounded to XQ, as decoders 418 / 111 read them."""
    from ds4.backends.reference.backend import _swiglu

    x = _xq_round(f) if x_xq else f.astype(np.float64)
    out = np.zeros(f.shape, np.float64)
    for t in range(f.shape[0]):
        for j, e in enumerate(ids[t]):
            g = ref._matrix(L.ffn_gate_exps, e).astype(np.float64) @ x[t]
            u = ref._matrix(L.ffn_up_exps, e).astype(np.float64) @ x[t]
            h = _swiglu(g.astype(np.float32), u.astype(np.float32), ref.cfg.swiglu_clamp[il]) * w[t, j]
            h = _xq_round(h) if h_xq else h.astype(np.float64)
            out[t] += ref._matrix(L.ffn_down_exps, e).astype(np.float64) @ h
    return out


@pytest.mark.parametrize("n", [1, 3, 20], ids=["decode", "few", "prefill"])
def test_moe_and_shared_expert(pair, n, rng):
    """Routed and shared experts against the reference. The decode decoders on x (h) in XQ form
    (418 gate/up, 111 / 113 down) match the reference on XQ-rounded x (h) to 6e-5 (h's rounding can
    go the other way where the two h differ in their last bits: a step of 1/32639 of a block's
    largest value; one draw measured 3.6e-5 on the H200), and the float reference to 1e-4 (XQ
    keeps 16 bits of each block's largest value); the float decoders match it to 1e-5."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il = 4
    L_r, L_t = wr.layers[il], wt.layers[il]
    f = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_expert, cfg.n_expert_used, replace=False) for _ in range(n)])
    w = rng.uniform(0.1, 1, (n, cfg.n_expert_used)).astype(np.float32)
    want = ref.moe(f, ids, w, L_r.ffn_gate_exps, L_r.ffn_up_exps, L_r.ffn_down_exps, il)

    def routed():
        tri.ledger = []
        return tri.to_numpy(tri.moe(_t(tri, f), _t(tri, ids, torch.int32), _t(tri, w),
                                    L_t.ffn_gate_exps, L_t.ffn_up_exps, L_t.ffn_down_exps, il))

    if n >= 16:
        assert _rel(routed(), want) < 1e-5
    else:  # the routed-expert decoders of the matrix-vector kernels: each gate/up decoder with
        # the integer down (113), the other downs with the integer gate/up (418), and both float;
        # three tokens only the integer pair and both float (the interpreter takes seconds a call)
        saved = dict(tri.mv_types)
        gt, dt = int(L_t.ffn_gate_exps.type), int(L_t.ffn_down_exps.type)
        pairs = [(gp, 113) for gp in TritonBackend.MV_PATHS[gt]] + [(418, 111), (418, 110), (417, 110)]
        assert set(TritonBackend.MV_PATHS[dt]) == {110, 111, 113}
        try:
            for gp, dp in (pairs if n == 1 else [(418, 113), (417, 110)]):
                tri.mv_types = {**saved, gt: gp, dt: dp}
                got = routed()
                x_xq, h_xq = gp == 418, dp in (111, 113)
                assert ("xq_kernel" in [k for k, _ in tri.ledger]) == x_xq
                if x_xq or h_xq:
                    assert _rel(got, _moe_rounded(ref, f, ids, w, L_r, il, x_xq, h_xq)) < 6e-5, (gp, dp)
                    assert _rel(got, want) < 1e-4, (gp, dp)
                else:
                    assert _rel(got, want) < 1e-5, (gp, dp)
        finally:
            tri.mv_types = saved
    want = ref.shared_expert(f, L_r.ffn_gate_shexp, L_r.ffn_up_shexp, L_r.ffn_down_shexp, il)
    got = tri.to_numpy(tri.shared_expert(_t(tri, f), L_t.ffn_gate_shexp, L_t.ffn_up_shexp, L_t.ffn_down_shexp, il))
    assert _rel(got, want) < 1e-5


def test_q2s_down_rows_past_the_tile(rng):
    """Decoder 113 with a row count that is not a multiple of its programs' rows (the rows past
    the tensor read its first row and are not stored) and two tokens, against gguf-py's decode of
    the GGUF Q2_K bytes times the XQ-rounded h, summed over each token's slots."""
    tri = TritonBackend(_cfg(), device=DEVICE)
    NE, F, E, n, k = 3, 512, 84, 2, 2
    raw = random_blocks(T.Q2_K, NE * E * F, rng, scale=0.05)
    down = tri.upload(Tensor("down", T.Q2_K, (F, E, NE), raw))
    dense = gq.dequantize(raw.reshape(NE * E, row_bytes(T.Q2_K, F)), GGMLQuantizationType.Q2_K).reshape(NE, E, F)
    ids = np.array([[2, 0], [1, 2]], np.int32)
    h = rng.standard_normal((n * k, F)).astype(np.float32)
    tri.mv_types = {**tri.mv_types, down.kt: 113}  # (whatever the tuning's default decoder)
    c = tri._mv_cfg(down.kt, E, F, n, kind="down", xq=True)
    assert c["TYPE"] == 113 and E % c["BN"], c  # (programs of 8 rows on the H200, 128 in the interpreter)
    out = tri.to_numpy(tri._down_mv(_t(tri, h), _t(tri, ids, torch.int32), down, n, k, c=c,
                                    hq=tri._xq(_t(tri, h))))
    hr = _xq_round(h).reshape(n, k, F)
    want = np.einsum("tjef,tjf->te", dense[ids].astype(np.float64), hr)
    # (float32 sums of 2 × 512 products against float64: 2.4e-6 seen on the H200 for one random
    # draw, over the 2e-6 this bound was; 1e-5 as for the other float32 products here)
    assert _rel(out, want) < 1e-5


# Compiled for sm_90 in a process without the interpreter (kernels/ picks its inline assembly
# at import), its SASS listed by the cuobjdump that ships with Triton.
_PDL_SASS = r"""
import glob, json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4.backends.triton import kernels as K
sig = {n: "i32" for n in ("sx_t", "sx_g", "so_t", "N", "K", "RB", "GROUP_ROWS")}
sig.update(xw_ptr="*i32", xs_ptr="*fp32", wh="*i16", wf="*i32", out_ptr="*fp32", ws_ptr="*fp32", cnt_ptr="*i32",
           qw_ptr="*i32", qs_ptr="*fp32", qsum_ptr="*fp32")
tool = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))[0]
out = []
for const, warps in json.loads(sys.argv[1]):
    const = dict(const, PDL=True, DEP=True)
    src = ASTSource(fn=K.matvec_xq_kernel, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(17)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    path = tempfile.mktemp(suffix=".cubin")
    open(path, "wb").write(k.asm["cubin"])
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    out.append([ln.split(";")[0].split("*/")[-1].strip() for ln in sass.splitlines() if "LDG" in ln or "ACQBULK" in ln])
print(json.dumps(out))
"""


def test_early_launch_loads_x_after_its_wait():
    """Decoder 309 launched before the kernel that writes its x ends (PDL, the H200's tilings of
    wq_b, wo_a and wo_b) waits (ACQBULK) before it loads x: the only loads above the wait are the
    first K-step's weights (masked by the rows), and no load takes the non-coherent path. With x
    on that path the compiler moved a load of x above the wait in wq_b's tiling, and the H200's
    logits changed from run to run."""
    import subprocess
    import sys

    tilings = [({"BN": 8, "NB": 1, "R": 1, "S": 1, "XQOUT": False}, 4),
               ({"BN": 4, "NB": 2, "R": 4, "S": 1, "XQOUT": True}, 2),
               ({"BN": 4, "NB": 4, "R": 4, "S": 1, "XQOUT": False}, 4)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PDL_SASS, json.dumps(tilings)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for (const, _), loads in zip(tilings, json.loads(run.stdout.splitlines()[-1])):
        assert loads.count("ACQBULK") == 1, (const, loads)
        before = loads[:loads.index("ACQBULK")]
        assert before and all(ld.startswith("@") for ld in before), (const, before)  # masked: weights
        assert not any("CONSTANT" in ld for ld in loads), (const, loads)
        assert any(not ld.startswith("@") for ld in loads[loads.index("ACQBULK") + 1:]), (const, loads)  # x


def test_iq2_nibble_table():
    """The 416 decoder's level table (gridp[768:1024]): nibble j of entry e holds the code of
    value j (levels 8, 25, 43 -> 0, 1, 2) and leaves bits 2-3 clear for the sign it ORs in;
    against gguf-py's IQ2_XXS grid."""
    gq.IQ2_XXS.init_grid()
    nib = _grid_table()[768:1024].view(np.uint32).astype(np.int64)
    assert nib.shape == (256,)
    codes = (nib[:, None] >> (4 * np.arange(8))) & 15  # [entry, value]
    assert (codes <= 2).all()
    assert np.array_equal(np.array([8.0, 25.0, 43.0])[codes], np.asarray(gq.IQ2_XXS.grid).reshape(256, 8))


def _check_xq(words, scales, sums, x, perm=False):
    """The XQ form of x [n, K] (words [n, K/2] int32, scales [n, K/32], 16-value sums [n, K/16])
    read back byte by byte as the layout is written out here: per 32-value block 16 words, for
    each 8 values j the hi bytes of values 8j..8j+3, of 8j+4..8j+7, then their lo bytes;
    q = 256·hi + lo. perm (XQ8): for each pair of words 2p, 2p+1 the hi bytes of word w = values
    w, w+8, w+16, w+24 (byte j: value 8j + w), then their lo bytes. Against x rounded by hand: q
    within 1 of floor(x·32639/amax + 0.5) (the GPU's division may round the other way),
    s = amax / 32639, sums s·Σq per 16 values. Returns the x the form stands for, q·s."""
    n, Kd = x.shape
    b = x.reshape(n, Kd // 32, 32).astype(np.float32)
    amax = np.abs(b).max(axis=2)
    by = words.reshape(n, Kd // 32, 4, 4, 1).view(np.uint8).reshape(n, Kd // 32, 4, 4, 4)  # [.., j | p, word, byte]
    if perm:  # [.., p, e, byte j] of word w = 2p + e -> value 8j + w
        hi = by[:, :, :, 0:2].reshape(n, Kd // 32, 8, 4).transpose(0, 1, 3, 2).view(np.int8).astype(np.int64)
        lo = by[:, :, :, 2:4].reshape(n, Kd // 32, 8, 4).transpose(0, 1, 3, 2).view(np.int8).astype(np.int64)
    else:
        hi = np.concatenate([by[:, :, :, 0], by[:, :, :, 1]], axis=3).view(np.int8).astype(np.int64)
        lo = np.concatenate([by[:, :, :, 2], by[:, :, :, 3]], axis=3).view(np.int8).astype(np.int64)
    q = (256 * hi + lo).reshape(n, Kd // 32, 32)
    inv = np.where(amax > 0, np.float32(32639) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    want_q = np.floor(b * inv[:, :, None].astype(np.float32) + np.float32(0.5)).astype(np.int64)
    assert np.abs(q - want_q).max() <= 1 and (q != want_q).mean() < 0.01
    assert np.abs(q).max() <= 32639
    assert np.allclose(scales, amax / 32639, rtol=1e-6, atol=0)
    want_sums = q.reshape(n, Kd // 16, 16).sum(axis=2) * np.repeat(scales, 2, axis=1)
    assert np.allclose(sums, want_sums, rtol=1e-6, atol=1e-30)
    return (q * scales.astype(np.float64)[:, :, None]).reshape(n, Kd)


def test_xq_form(pair, rng):
    """x in XQ form, from xq_kernel (a plain tensor; a block count the programs do not divide)
    and from rms_kernel with the norm (a normed x: no launch of its own, the float result beside
    it), against the layout and rounding written out by hand (_check_xq)."""
    tri = pair[2]
    x = rng.standard_normal((2, 288)).astype(np.float32) * rng.uniform(0.01, 10, (2, 288)).astype(np.float32)
    x[1, 32:64] = 0  # a block of zeros: scale 0
    tri.ledger = []
    xq = [tri.to_numpy(t) for t in tri._xq(_t(tri, x))]
    assert [k for k, _ in tri.ledger] == ["xq_kernel"]
    _check_xq(*xq, x)
    assert (xq[1][1, 1] == 0) and not xq[0][1, 16:32].any()
    cfg = tri.cfg
    x = rng.standard_normal((3, cfg.n_embd)).astype(np.float32) * 4
    nwv = rng.uniform(0.5, 1.5, cfg.n_embd).astype(np.float32)
    nw = tri.upload(Tensor("nw", T.F32, (cfg.n_embd,), nwv.view(np.uint8)))
    f = tri.rms_norm(_t(tri, x), nw)
    tri.ledger = []
    xq = [tri.to_numpy(t) for t in tri._xq(f)]
    assert tri._xq(f)[0] is f.xq[0]  # kept for the next reader
    assert [k for k, _ in tri.ledger] == ["rms_kernel"]
    xn = tri.to_numpy(tri._val(f))
    assert _rel(xn, x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + cfg.rms_eps) * nwv) < 2e-6
    _check_xq(*xq, xn)


def test_q8c_on_xq8(rng):
    """Decoder 309: Q8C rows on x in XQ8 form (xq_kernel for a plain x, rms_kernel for a normed
    one, the layout checked by _check_xq), through the per-shape table: one to eight rows per
    thread, K whole and split in parts, grouped rows, one and three tokens. Against the x the
    XQ8 words stand for (read back by hand) times numpy's decode of the GGUF rows, in float64;
    a 308 entry of the same shape keeps x as floats."""
    cfg = _cfg()
    tri = TritonBackend(cfg, device=DEVICE)
    N, K = 48, 1024
    raw = random_blocks(T.Q8_0, N * K, rng, scale=0.05)
    w = tri.upload(Tensor("w", T.Q8_0, (K, N), raw))
    dense = dequantize_rows(raw.reshape(N, row_bytes(T.Q8_0, K)), T.Q8_0, K).astype(np.float64)
    nwv = rng.uniform(0.5, 1.5, K).astype(np.float32)
    nw = tri.upload(Tensor("nw", T.F32, (K,), nwv.view(np.uint8)))
    for entry in ((309, 256, 16, 4, 4, 4), (309, 512, 16, 4, 2, 8), (309, 256, 8, 4, 1, 1), (309, 1024, 8, 2, 1, 2)):
        tri.mv_shapes[("linear", w.kt, N, K)] = entry
        for n in (1, 3):
            x = (rng.standard_normal((n, K)) * rng.uniform(0.1, 3, (n, K))).astype(np.float32)
            tri.ledger = []
            xq = tri._xq(_t(tri, x), perm=True)
            xd = _check_xq(*[tri.to_numpy(t) for t in xq], x, perm=True)
            for _ in range(2):  # twice: the split-K tickets reset
                y = tri.to_numpy(tri.linear(_t(tri, x), w))
                assert _rel(y, xd @ dense.T) < 2e-6, (entry, n)
                assert _rel(y, x.astype(np.float64) @ dense.T) < 1e-4, (entry, n)
            assert [k for k, _ in tri.ledger] == ["xq_kernel"] + ["xq_kernel", "matvec_xq_kernel"] * 2
            f = tri.rms_norm(_t(tri, x), nw)
            tri.ledger = []
            y = tri.to_numpy(tri.linear(f, w))
            assert [k for k, _ in tri.ledger] == ["rms_kernel", "matvec_xq_kernel"]
            xn = tri.to_numpy(tri._val(f))
            xd = _check_xq(*[tri.to_numpy(t) for t in f.xq8], xn, perm=True)
            assert _rel(y, xd @ dense.T) < 2e-6, (entry, n, "norm")
            xg = (rng.standard_normal((n, 3 * K))).astype(np.float32)
            y = tri.to_numpy(tri._linear(_t(tri, xg), w, group_rows=16, group_stride=K))
            xd = _check_xq(*[tri.to_numpy(t) for t in tri._xq(_t(tri, xg), perm=True)], xg, perm=True)
            want = np.concatenate([xd[:, g * K:(g + 1) * K] @ dense[16 * g:16 * (g + 1)].T for g in range(3)], 1)
            assert _rel(y, want) < 2e-6, (entry, n, "groups")
    # the result in XQ8 form too (XQOUT): 16-row programs in groups (the last of a block's two
    # stores it), 64-row programs (each its own blocks); with K in parts a plain result
    N2 = 64
    raw2 = random_blocks(T.Q8_0, N2 * K, rng, scale=0.05)
    w2 = tri.upload(Tensor("w2", T.Q8_0, (K, N2), raw2))
    dense2 = dequantize_rows(raw2.reshape(N2, row_bytes(T.Q8_0, K)), T.Q8_0, K).astype(np.float64)
    for entry, gr in (((309, 256, 16, 4, 1, 4), 16), ((309, 256, 64, 4, 1, 8), 0), ((309, 256, 16, 4, 2, 4), 0)):
        tri.mv_shapes[("linear", w2.kt, N2, K)] = entry
        for n in (1, 2):
            x = rng.standard_normal((n, (N2 // gr if gr else 1) * K)).astype(np.float32)
            y = tri._linear(_t(tri, x), w2, group_rows=gr, group_stride=K if gr else 0, xq_out=True)
            xd = _check_xq(*[tri.to_numpy(t) for t in tri._xq(_t(tri, x), perm=True)], x, perm=True)
            want = (np.concatenate([xd[:, g * K:(g + 1) * K] @ dense2[gr * g:gr * (g + 1)].T for g in range(N2 // gr)], 1)
                    if gr else xd @ dense2.T)
            assert _rel(tri.to_numpy(y), want) < 2e-6, (entry, n)
            if entry[4] == 1:
                _check_xq(*[tri.to_numpy(t) for t in y.xq8], tri.to_numpy(y), perm=True)
            else:
                assert isinstance(y, torch.Tensor)
    tri.mv_shapes[("linear", w.kt, N, K)] = (308, 256, 16, 4, 1, 4)
    x = rng.standard_normal((1, K)).astype(np.float32)
    tri.ledger = []
    assert _rel(tri.to_numpy(tri.linear(_t(tri, x), w)), x.astype(np.float64) @ dense.T) < 2e-6
    assert [k for k, _ in tri.ledger] == ["matvec_kernel"]
    assert not tri._split_cnt.any()


# The experts' products are the same under both numerics (ds4 numerics round the cache rows, the
# compressor and the indexer, not the experts' inputs or weights), so each decoder family runs once,
# on the ds4-numerics pair: the interpreter takes a minute over either.
@pytest.mark.parametrize("pair", ["ds4"], indirect=True)
@pytest.mark.parametrize("gp,dp", [(417, 110), (418, 113)], ids=["float", "xq"])
def test_split_k_experts(pair, gp, dp, rng):
    """The routed gate/up (IQ2_XXS, 417 / 418), down (Q2_K, 110 / 113) and shared-expert products
    (gate/up 308, then 309) of a decode step with K split in two (the tile's last program adds
    the partials, then the SwiGLU; 418 then stores h in XQ form) match the reference; twice, so
    the tickets reset. 418
    takes two K-steps per part, loading each step's groups a step ahead the first time
    (mv_prefetch) and not the second."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    il = 4
    L_r, L_t = wr.layers[il], wt.layers[il]
    g, d, sg = L_t.ffn_gate_exps, L_t.ffn_down_exps, L_t.ffn_gate_shexp
    saved, saved_pf = dict(tri.mv_shapes), tri.mv_prefetch
    try:
        # float: the float decoders; xq: those on x and h in XQ form (113: 128-value halves, one
        # a K-step, two rows per thread)
        tri.mv_shapes = {("gateup", int(g.type), g.N, g.K): (gp, 128 if gp == 417 else 64, 16, 4, 2),
                         ("down", int(d.type), d.N, d.K): (dp, 128, 16, 4, 2) if dp == 110 else
                         (dp, 128, 16, 4, 2, 2),
                         ("gateup", sg.kt, sg.N, sg.K): (308 if gp == 417 else 309, 256, 16, 4, 2, 4)}
        for n in ((1, 3) if gp == 417 else (3,)):  # (the interpreter takes minutes over these)
            f = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
            ids = np.stack([rng.choice(cfg.n_expert, cfg.n_expert_used, replace=False) for _ in range(n)])
            w = rng.uniform(0.1, 1, (n, cfg.n_expert_used)).astype(np.float32)
            if gp == 418:  # (tolerance: test_moe_and_shared_expert)
                want, tol = _moe_rounded(ref, f, ids, w, L_r, il, True, True), 6e-5
            else:
                want, tol = ref.moe(f, ids, w, L_r.ffn_gate_exps, L_r.ffn_up_exps, L_r.ffn_down_exps, il), 1e-5
            want_sh = ref.shared_expert(f, L_r.ffn_gate_shexp, L_r.ffn_up_shexp, L_r.ffn_down_shexp, il)
            for again in (False, True):
                tri.mv_prefetch = not again
                tri.ledger = []
                got = tri.to_numpy(tri.moe(_t(tri, f), _t(tri, ids, torch.int32), _t(tri, w),
                                           L_t.ffn_gate_exps, L_t.ffn_up_exps, L_t.ffn_down_exps, il))
                assert _rel(got, want) < tol, (gp, n)
                got = tri.to_numpy(tri.shared_expert(_t(tri, f), L_t.ffn_gate_shexp, L_t.ffn_up_shexp,
                                                     L_t.ffn_down_shexp, il))
                # (309: the shared gate/up on x in XQ8 form, which rounds x to amax / 65278)
                assert _rel(got, want_sh) < (1e-5 if gp == 417 else 1e-4), (gp, n)
                kernels = [k for k, _ in tri.ledger if k != "xq_kernel"]
                assert kernels[:3] == ["moe_gateup_mv_kernel", "moe_down_mv_kernel", "moe_gateup_mv_kernel"]
        assert not tri._split_cnt.any()
    finally:
        tri.mv_shapes = saved
        tri.mv_prefetch = saved_pf


def test_embed_and_output_head(pair, rng):
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    tokens = rng.integers(0, cfg.n_vocab, 3)
    assert np.array_equal(tri.to_numpy(tri.embed(wt.token_embd, tokens)), ref.embed(wr.token_embd, tokens))
    X = rng.standard_normal((3, cfg.n_hc, cfg.n_embd)).astype(np.float32)
    want = ref.output_logits(X, wr.output_hc, wr.output_norm, wr.output)
    got = tri.to_numpy(tri.output_logits(_t(tri, X), wt.output_hc, wt.output_norm, wt.output))
    assert got.shape == (cfg.n_vocab,) and _rel(got, want) < 1e-5


def test_weights_stay_quantized(pair, model):
    """Every uploaded tensor holds its GGUF bytes (no dequantized copy): as they are, for Q8_0
    rows of a multiple of 256 values the same bytes rearranged into Q8C chunks, and for IQ2_XXS
    its blocks' quant bytes and scales in two arrays (IQ2S)."""
    _, _, tri, wt = pair
    for name in ("blk.3.ffn_down_exps.weight", "blk.2.attn_q_b.weight", "output.weight", "blk.3.ffn_gate_exps.weight"):
        src = model.tensor(name)
        got = {"blk.3.ffn_down_exps.weight": wt.layers[3].ffn_down_exps,
               "blk.2.attn_q_b.weight": wt.layers[2].attn_q_b, "output.weight": wt.output,
               "blk.3.ffn_gate_exps.weight": wt.layers[3].ffn_gate_exps}[name]
        assert got.u8.dtype == torch.uint8 and got.nbytes == src.n_bytes
        raw = torch.from_numpy(np.array(src.raw, dtype=np.uint8).reshape(-1))
        chunked = src.type == T.Q8_0 and src.dims[0] % 256 == 0
        assert got.kt == (Q8C if chunked else int(src.type)), name
        want = q8_chunks(raw, src.dims[0]) if chunked else raw
        if src.type == T.IQ2_XXS:  # blocks d | qs[64] -> all qs, then all d
            blocks = raw.reshape(-1, 66)
            want = torch.cat([blocks[:, 2:].reshape(-1), blocks[:, :2].reshape(-1)])
        if src.type == T.Q2_K:  # blocks scales[16] | qs[64] | d | dmin -> all qs, all scales, all (d, dmin)
            blocks = raw.reshape(-1, 84)
            want = torch.cat([blocks[:, 16:80].reshape(-1), blocks[:, :16].reshape(-1), blocks[:, 80:].reshape(-1)])
        assert np.array_equal(got.u8.cpu().numpy(), want.numpy()), name
    assert wt.output.kt == Q8C and wt.layers[2].attn_q_b.kt == int(T.Q8_0)  # both layouts are here


def test_greedy_next_is_the_first_largest_finite_logit(rng):
    """greedy_next_kernel against sampling.argmax: the first index among equal maxima, NaN and
    ±inf never chosen; with no finite logit the host gets -1 and the next step token 0. The
    token lands in the ring at the position's remainder, and the position advances by one."""
    from ds4.core.sampling import argmax

    V = 1000
    ties = rng.integers(-3, 4, V).astype(np.float32)  # many equal maxima
    spiked = rng.standard_normal(V).astype(np.float32)
    spiked[rng.choice(V, 40, replace=False)] = np.nan
    spiked[rng.choice(V, 3, replace=False)] = np.inf
    spiked[rng.choice(V, 3, replace=False)] = -np.inf
    late = np.full(V, -np.inf, np.float32)
    late[V - 1] = -1e30  # the only finite logit, in the last lane of the partial block
    masked = np.full(V, np.nan, np.float32)
    masked[::7] = -np.inf
    for x, pos in [(rng.standard_normal(V).astype(np.float32), 42), (ties, 41), (spiked, 7), (late, 40),
                   (masked, 43)]:
        want = argmax(x) if np.isfinite(x).any() else -1
        ring, tok, after, cnt = _greedy_next(x, pos)
        assert ring == [want if i == pos % 4 else -5 for i in range(4)]
        assert tok == max(want, 0) and after == pos + 1
        assert cnt == 0  # the ticket is back to zero for the next step


def _greedy_next(x, pos, draw=None):
    """greedy_next_kernel, then sample_next_kernel with draw = (T, min_p, U) at the ring slot
    (T = 0 without), on 256-logit programs (four, the last one partial, for 1000 logits):
    (ring, token, position, ticket) after them; the slot's T is 0 after, the others' untouched."""
    from ds4.backends.triton import kernels as K

    G = 4
    best = torch.full((G,), 123.0, device=DEVICE)
    at = torch.full((G,), -9, dtype=torch.int32, device=DEVICE)
    mass = torch.full((G,), 5.0, dtype=torch.float64, device=DEVICE)
    cnt = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    top = torch.zeros(1, device=DEVICE)
    tok = torch.full((1,), 77, dtype=torch.int32, device=DEVICE)
    p = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    ring = torch.full((4,), -5, dtype=torch.int32, device=DEVICE)
    draws = torch.full((4, 3), 9.0, dtype=torch.float64, device=DEVICE)  # other slots: T = 9
    draws[pos % 4] = torch.tensor(draw or (0.0, 0.0, 0.0), dtype=torch.float64)
    logits = torch.from_numpy(x).to(DEVICE)
    K.greedy_next_kernel[(G,)](logits, x.size, best, at, cnt, top, tok, p, ring, R=4, BLOCK=256, G=G)
    K.sample_next_kernel[(G,)](logits, x.size, mass, cnt, top, tok, p, ring, draws, R=4, BLOCK=256, G=G)
    assert draws[pos % 4, 0] == 0 and (draws[[i for i in range(4) if i != pos % 4], 0] == 9).all()
    return ring.cpu().tolist(), int(tok.item()), int(p.item()), int(cnt.item())


class _Uniform:
    def __init__(self, u):
        self.u = u

    def uniform(self):
        return self.u


def test_sample_next_is_ds4s_default_sampling_path(rng):
    """sample_next_kernel against sampling.sample on its default path (min-p relative to the best
    token, one draw scanned in id order), on random logits, some not finite, over draws U from 0
    to just below 1 and temperatures / min-p values that keep one to hundreds of tokens; the
    token lands where greedy's did (ring slot, next token)."""
    from ds4.core.sampling import SamplingParams, sample

    V = 1000
    for k, (temp, min_p) in enumerate([(1.0, 0.05), (0.7, 0.0), (2.0, 0.5), (0.25, 0.05), (1.0, 1.0)]):
        x = (rng.standard_normal(V) * 3).astype(np.float32)
        if k % 2:
            x[rng.choice(V, 30, replace=False)] = np.nan
            x[rng.choice(V, 30, replace=False)] = -np.inf
        x[rng.integers(V)] = x[np.isfinite(x)].max()  # a tie at the top
        params = SamplingParams(temperature=temp, min_p=min_p)
        t32, m32 = float(np.float32(temp)), float(np.float32(min_p))
        for u in [0.0, 1 - 2 ** -24, *rng.random(6)]:
            want = sample(x, params, _Uniform(u))
            pos = int(rng.integers(0, 1000))
            ring, tok, after, cnt = _greedy_next(x, pos, (t32, m32, u))
            assert ring[pos % 4] == want == tok, (temp, min_p, u)
            assert after == pos + 1 and cnt == 0
