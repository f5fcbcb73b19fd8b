"""The routing and expert kernels of the Triton backend (router, routed and shared experts, the XQ
form of x and h and the products that read it, launched early or not, split-K experts), the
embedding and output head, and the uploaded weights' layouts, against the reference backend on
random inputs (seeds.py). Without a GPU the kernels run under TRITON_INTERPRET=1 on small shapes;
with one, compiled."""

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
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ds4.backends.reference.backend import ReferenceBackend  # noqa: E402
from ds4.backends.triton.backend import TritonBackend, _grid_table  # noqa: E402
from ds4.backends.triton.layout import Q8C, iq2_split, q8_chunks  # noqa: E402
from ds4.backends.triton.plumbing import MM_MIN  # noqa: E402
from ds4.core.gguf_model import Tensor  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.quants import dequantize_rows, random_blocks, row_bytes  # noqa: E402
from triton_pair import DEVICE, _cfg, _check_xq, _rel, _t  # noqa: E402
from triton_pair import model, pair, rng  # noqa: E402,F401  (fixtures)


# ---- routing and experts ------------------------------------------------------------------------

def test_router_hash_and_topk(pair, rng):
    """Five tokens (a decode product) and a prefill's MM_MIN tokens (matrix-matrix): the logits
    product, then router_kernel, against the reference's experts and weights."""
    ref, wr, tri, wt = pair
    cfg = ref.cfg
    for n, layers in ((5, (0, 4)), (MM_MIN, (4,))):  # hash layer, top-k layer with bias
        tokens = rng.integers(0, cfg.n_vocab, n)
        for il in layers:
            L_r, L_t = wr.layers[il], wt.layers[il]
            f = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
            ids, w = ref.router(f, L_r.ffn_gate_inp, L_r.exp_probs_b, L_r.tid2eid, tokens, il)
            tri.ledger = []
            tids, tw = tri.router(_t(tri, f), L_t.ffn_gate_inp, L_t.exp_probs_b, L_t.tid2eid, tokens, il)
            assert [k for k, _ in tri.ledger][-1] == "router_kernel"
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
    tri.ledger = []
    got = tri.to_numpy(tri.shared_expert(_t(tri, f), L_t.ffn_gate_shexp, L_t.ffn_up_shexp, L_t.ffn_down_shexp, il))
    assert _rel(got, want) < 1e-5
    if n >= 16:  # Q8C gate/up under bf16x3: two products on fp16 planes of one split of f, the SwiGLU
        assert L_t.ffn_gate_shexp.kt == Q8C
        ran = [k for k, _ in tri.ledger]
        assert ran[:6] == ["x16_kernel", "q8c_hl_kernel", "matmul_f16w_kernel", "q8c_hl_kernel",
                           "matmul_f16w_kernel", "swiglu_kernel"], ran


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
        # (the interpreter takes minutes over these: 418's second pass, the tickets' reset and
        # no prefetch, runs on the first token alone)
        for n in ((1, 3) if gp == 417 else (3,)):
            f = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
            ids = np.stack([rng.choice(cfg.n_expert, cfg.n_expert_used, replace=False) for _ in range(n)])
            w = rng.uniform(0.1, 1, (n, cfg.n_expert_used)).astype(np.float32)
            if gp == 418:  # (tolerance: test_moe_and_shared_expert)
                want, tol = _moe_rounded(ref, f, ids, w, L_r, il, True, True), 6e-5
            else:
                want, tol = ref.moe(f, ids, w, L_r.ffn_gate_exps, L_r.ffn_up_exps, L_r.ffn_down_exps, il), 1e-5
            want_sh = ref.shared_expert(f, L_r.ffn_gate_shexp, L_r.ffn_up_shexp, L_r.ffn_down_shexp, il)
            for again in (False, True):
                m = 1 if again and gp == 418 else n
                tri.mv_prefetch = not again
                tri.ledger = []
                got = tri.to_numpy(tri.moe(_t(tri, f[:m]), _t(tri, ids[:m], torch.int32), _t(tri, w[:m]),
                                           L_t.ffn_gate_exps, L_t.ffn_up_exps, L_t.ffn_down_exps, il))
                assert _rel(got, want[:m]) < tol, (gp, n, again)
                got = tri.to_numpy(tri.shared_expert(_t(tri, f[:m]), L_t.ffn_gate_shexp, L_t.ffn_up_shexp,
                                                     L_t.ffn_down_shexp, il))
                # (309: the shared gate/up on x in XQ8 form, which rounds x to amax / 65278)
                assert _rel(got, want_sh[:m]) < (1e-5 if gp == 417 else 1e-4), (gp, n, again)
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
    its blocks' quant bytes and scales in two arrays (IQ2S, the groups' sign bits interleaved)."""
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
        if src.type == T.IQ2_XXS:  # all qs (sign indices interleaved), then all d: test_triton_layout's bytes
            want = iq2_split(raw)
        if src.type == T.Q2_K:  # blocks scales[16] | qs[64] | d | dmin -> all qs, all scales, all (d, dmin)
            blocks = raw.reshape(-1, 84)
            want = torch.cat([blocks[:, 16:80].reshape(-1), blocks[:, :16].reshape(-1), blocks[:, 80:].reshape(-1)])
        assert np.array_equal(got.u8.cpu().numpy(), want.numpy()), name
    assert wt.output.kt == Q8C and wt.layers[2].attn_q_b.kt == int(T.Q8_0)  # both layouts are here
