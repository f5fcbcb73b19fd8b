"""The exact-integer fp16 prefill kernels (kernels_mm16.py: IQ2_XXS / Q2_K routed experts; the F16
linears on two fp16 terms) against float64 products of the weights as gguf-py decodes them. Without
a GPU they run under TRITON_INTERPRET=1 (conftest.py) on small shapes; with one, compiled."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
gq = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as GQT  # noqa: E402

from ds4.backends.triton import kernels_mm16 as K16  # noqa: E402
from ds4.backends.triton.backend import TritonBackend, _cdiv  # noqa: E402
from ds4.core.gguf_model import Tensor  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.quants import random_blocks  # noqa: E402
from ds4.core.tiny import preset_config  # noqa: E402
from seeds import rng_for_test  # noqa: E402
from sm90 import compile_sm90, ptx_sm90  # noqa: E402
from triton_pair import several_tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Errors are measured against the first-order error scale of each output (for a product,
# Σ|w|·|x| over the terms the kernel multiplies: for Q2_K the two of w = d·sc·q − dmin·m; through
# the SwiGLU, the same propagated): x in two fp16 terms holds it to 2^-22, and the float32
# accumulation adds a few 2^-24 where it rounds to nearest; Hopper's tensor cores truncate their
# float32 sums instead, which can double that, so the bound is 2^-19. (Against max |output|
# instead, a row with cancellation exceeded 2e-6 on the H200's tensor-core accumulation; Q2_K
# against Σ|w|·|x|, where w's two terms cancel, reached 1.1e-6 there.)
TOL = 2.0 ** -19


@pytest.fixture
def rng(request):
    return rng_for_test(request)  # seeds.py


@pytest.fixture(scope="module")
def tri():
    # the fp16 integer path (bf16x3 products with moe_int16), whatever the tuning's defaults
    be = several_tiles(TritonBackend(preset_config("test"), device=DEVICE, dot_precision="bf16x3"))
    be.moe_int16 = True
    be.moe_down_i8 = False  # the fp16 down (test_triton_mm8.py has the int8 one)
    return be


def _experts(tri, ttype, K, N, NE, rng, terms=False):
    """NE experts of N rows × K values of random valid blocks: (device weight, float64 [NE, N, K])
    decoded by gguf-py (the independent reference). terms (Q2_K): also the magnitudes the kernel
    adds, |d·sc·q| + |dmin·m| per value (its error scale: the two terms are products of their own
    and w = d·sc·q − dmin·m may cancel), with dmin·m read from each 84-byte block's bytes
    (scales[16]: m in the high nibbles | qs[64] | f16 d | f16 dmin)."""
    raw = random_blocks(ttype, NE * N * K, rng, scale=0.05)
    dense = np.asarray(gq.dequantize(raw, GQT(int(ttype))), dtype=np.float64).reshape(NE, N, K)
    w = tri.upload(Tensor("w", ttype, (K, N, NE), raw))
    if not terms:
        return w, dense
    assert ttype == T.Q2_K
    b = np.asarray(raw, np.uint8).reshape(-1, 84)
    dmin = b[:, 82:84].copy().view(np.float16).astype(np.float64)  # [blocks, 1]
    mins = dmin * (b[:, :16] >> 4).astype(np.float64)  # [blocks, 16 sub-blocks]
    mins = np.repeat(mins, 16, axis=1).reshape(NE, N, K)  # per value
    return w, dense, np.abs(dense + mins) + np.abs(mins)


def _activations(rows, K, rng):
    """Rows spanning several orders of magnitude: per row, per element, one all-zero row and one
    row whose single huge element dwarfs the rest of its chunk."""
    x = rng.standard_normal((rows, K)) * 10.0 ** rng.uniform(-3, 3, (rows, 1)) * 10.0 ** rng.uniform(-2, 2, (rows, K))
    x[0] = 0.0
    x[1, 300] = 3.0e6
    return x.astype(np.float32)


def _rel_rows(got, want, scale):
    """max |error| / max scale over each row with a non-zero scale (scale: the outputs' error
    scale, Σ|w|·|x| or _swiglu_scale; rows with a zero reference must come out exactly zero)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - want).max(axis=1)
    top = np.asarray(scale, np.float64).max(axis=1)
    assert np.all(err[np.abs(want).max(axis=1) == 0] == 0)
    nz = top > 0
    return float((err[nz] / top[nz]).max())


def _swiglu_scale(g, u, sg, su, clamp):
    """First-order error scale of swiglu(g, u) when g, u carry errors of scale sg, su (the clamps
    only shrink it)."""
    gc, uc = np.minimum(g, clamp), np.clip(u, -clamp, clamp)
    sig = 0.5 * (1.0 + np.tanh(0.5 * gc))  # the logistic function, without exp overflow
    return np.abs(sig * (1.0 + gc * (1.0 - sig)) * uc) * sg + np.abs(gc * sig) * su


def _schedule(tri, ids, NE):
    """The backend's expert-sorted assignment order and tile schedule."""
    flat = torch.from_numpy(ids.reshape(-1).astype(np.int64))
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=NE)
    T_, te, tr0, tend = tri._tiles(flat.numel(), counts.to(tri.dev), tri.moe16_bm)
    return order.numpy(), T_, te, tr0, tend


def _below_clamp(x, rng):
    """Rows rescaled to a max of 10^-3..1: gate products mostly inside the SwiGLU clamp, where a
    float32 evaluation is well conditioned (far outside, min(g, clamp) amplifies the products'
    rounding)."""
    top = np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-30)
    return (x * (10.0 ** rng.uniform(-3, 0, (x.shape[0], 1)) / top)).astype(np.float32)


def _swiglu64(g, u, clamp):
    g = np.minimum(g, clamp)
    return g / (1.0 + np.exp(-g)) * np.clip(u, -clamp, clamp)


def test_split_is_exact_to_float32(tri, rng):
    """hi + lo reproduce x·s to 2^-22 of each value or 2^-38 of the chunk max (the 16-value sums
    to float32 rounding or 2^-34 of the chunk max); s is a power of two; a zero chunk stays zero."""
    x = _activations(24, 512, rng)
    xh, xl, xi, gh, gl = [t.cpu().numpy() for t in tri._split16(torch.from_numpy(x).to(tri.dev), sums=True)]
    inv = np.repeat(xi.astype(np.float64), 256, axis=1)
    back = (xh.astype(np.float64) + xl.astype(np.float64)) * inv
    x64 = x.astype(np.float64)
    cmax = np.repeat(np.abs(x64).reshape(24, 2, 256).max(axis=2), 256, axis=1)
    assert np.all(np.abs(back - x64) <= 2.0 ** -22 * np.abs(x64) + 2.0 ** -38 * cmax)
    assert np.all(np.frexp(xi)[0] == 0.5)  # powers of two
    assert np.abs(xh.astype(np.float64)).max() <= 2 ** 15  # x·s < 2^15 may round up to 2^15
    sums = (gh.astype(np.float64) + gl.astype(np.float64)) * 16 * np.repeat(xi.astype(np.float64), 16, axis=1)
    want = x64.reshape(24, 32, 16).sum(axis=2)
    floor = np.repeat(cmax[:, ::256], 16, axis=1) * 2.0 ** -34  # lo below fp16's normal range
    assert np.all(np.abs(sums - want) <= 1e-6 * np.abs(x64).reshape(24, 32, 16).sum(axis=2) + floor)
    assert not xh[0].any() and not xl[0].any()


def test_gateup_iq2xxs(tri, rng):
    """h[a] = w_a·swiglu(gate_e·x[t], up_e·x[t]) for expert-sorted assignments, F not a multiple
    of the row block; a huge clamp so the products themselves are compared."""
    NE, F, E, n, k = 4, 96, 512, 33, 3
    gate, G = _experts(tri, T.IQ2_XXS, E, F, NE, rng)
    up, U = _experts(tri, T.IQ2_XXS, E, F, NE, rng)
    x = _activations(n, E, rng)
    ids = np.stack([rng.choice(NE, k, replace=False) for _ in range(n)])
    ids[:, 0] = 2  # one expert with more than one tile of assignments
    wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    order, T_, te, tr0, tend = _schedule(tri, ids, NE)
    tok = torch.from_numpy((order // k).astype(np.int32)).to(tri.dev)
    wsort = torch.from_numpy(wts.reshape(-1)[order]).to(tri.dev)
    xh, xl, xi, _, _ = tri._split16(torch.from_numpy(x).to(tri.dev), sums=False)
    h = torch.zeros((n * k, F), dtype=torch.float32, device=tri.dev)
    BN, KS, warps, stages = tri.moe16_tile["gateup"]
    clamp = 1.0e30
    nib = tri._grid_nibbles
    tri._launch(K16.moe_gateup_mm16_kernel, (T_, _cdiv(F, BN)), xh, xl, xi, tok, wsort, te, tr0, tend,
                gate.i16, up.i16, gate.f32, up.f32, nib, h, F, E, gate.RB, F * gate.RB, clamp,
                BM=tri.moe16_bm, BN=BN, KS=KS, ROUTED=True, num_warps=warps, num_stages=stages)
    t, e = order // k, ids.reshape(-1)[order]
    x64 = x.astype(np.float64)[t]
    g = np.einsum("afk,ak->af", G[e], x64)
    u = np.einsum("afk,ak->af", U[e], x64)
    wa = wts.reshape(-1)[order][:, None].astype(np.float64)
    want = wa * _swiglu64(g, u, clamp)
    scale = wa * _swiglu_scale(g, u, np.einsum("afk,ak->af", np.abs(G[e]), np.abs(x64)),
                               np.einsum("afk,ak->af", np.abs(U[e]), np.abs(x64)), clamp)
    assert _rel_rows(h.cpu().numpy(), want, scale) < TOL


def test_down_q2k(tri, rng):
    """out[a] = down_e·h[a] for expert-sorted assignments (the min term through the sub-block
    sums), E not a multiple of the row block."""
    NE, F, E, n, k = 3, 512, 80, 30, 3
    down, D, Dm = _experts(tri, T.Q2_K, F, E, NE, rng, terms=True)
    h = _activations(n * k, F, rng)
    ids = np.stack([rng.choice(NE, k, replace=False) for _ in range(n)])
    order, T_, te, tr0, tend = _schedule(tri, ids, NE)
    hs = h[order]  # the down kernel reads h in sorted order
    hh, hl, hi, gh, gl = tri._split16(torch.from_numpy(hs).to(tri.dev), sums=True)
    out = torch.zeros((n * k, E), dtype=torch.float32, device=tri.dev)
    BN, KS, warps, stages = tri.moe16_tile["down"]
    tri._launch(K16.moe_down_mm16_kernel, (T_, _cdiv(E, BN)), hh, hl, hi, gh, gl, te, tr0, tend,
                down.f32, down.b8.view(torch.int32), down.i16, out, E, F, down.RB, E * down.RB,
                BM=tri.moe16_bm, BN=BN, KS=KS, num_warps=warps, num_stages=stages)
    e = ids.reshape(-1)[order]
    want = np.einsum("aek,ak->ae", D[e], hs.astype(np.float64))
    assert _rel_rows(out.cpu().numpy(), want, np.einsum("aek,ak->ae", Dm[e], np.abs(hs.astype(np.float64)))) < TOL


def _moe_layer(be, rng, NE, n):
    """backend.moe on the prefill branch for n tokens over NE IQ2_XXS / Q2_K experts (2 a token,
    layer 4's SwiGLU clamp): (its output, the float64 layer, the output's first-order error scale,
    the kernels it ran)."""
    F, E, k, il = 256, 512, 2, 4
    gate, G = _experts(be, T.IQ2_XXS, E, F, NE, rng)
    up, U = _experts(be, T.IQ2_XXS, E, F, NE, rng)
    down, D, Dm = _experts(be, T.Q2_K, F, E, NE, rng, terms=True)
    x = _below_clamp(_activations(n, E, rng), rng)
    ids = np.stack([rng.choice(NE, k, replace=False) for _ in range(n)])
    wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    be.ledger = []
    got = be.to_numpy(be.moe(torch.from_numpy(x).to(be.dev), torch.from_numpy(ids.astype(np.int32)).to(be.dev),
                             torch.from_numpy(wts).to(be.dev), gate, up, down, il))
    ran, be.ledger = [name for name, _ in be.ledger], None
    clamp = float(be.cfg.swiglu_clamp[il])
    x64 = x.astype(np.float64)
    ax = np.abs(x64)
    want, scale = np.zeros((n, E)), np.zeros((n, E))
    for j in range(k):
        e = ids[:, j]
        g, u = np.einsum("tfk,tk->tf", G[e], x64), np.einsum("tfk,tk->tf", U[e], x64)
        hv = _swiglu64(g, u, clamp)
        sh = _swiglu_scale(g, u, np.einsum("tfk,tk->tf", np.abs(G[e]), ax), np.einsum("tfk,tk->tf", np.abs(U[e]), ax), clamp)
        want += wts[:, j, None].astype(np.float64) * np.einsum("tef,tf->te", D[e], hv)
        scale += wts[:, j, None].astype(np.float64) * np.einsum("tef,tf->te", Dm[e], np.abs(hv) + sh)
    return got, want, scale, ran


def test_moe_prefill_end_to_end(tri, rng):
    """backend.moe on the prefill branch (both new kernels, the slot-order reduction) against a
    float64 evaluation of the layer, with the model's SwiGLU clamp."""
    got, want, scale, ran = _moe_layer(tri, rng, NE=5, n=20)
    assert _rel_rows(got, want, scale) < TOL
    assert "moe_gateup_mm16_kernel" in ran and "moe_down_mm16_kernel" in ran, ran


# ---- F16 linears under bf16x3: x in two fp16 terms against the exact weights (f16_x2) ------------

def test_f16_rows_take_two_fp16_terms(tri, rng):
    """F16 prefill products under bf16x3 run on fp16 tensor cores with x as hi + lo (x16_kernel,
    matmul_f16w_kernel with LO), dense and grouped, to float32 accuracy (TOL is far below one
    fp16 rounding of x, 2^-12); with f16_x2 off they take tf32x3 (matmul_kernel), as do rows
    whose K is not a multiple of 256."""
    N, K, n = 40, 512, 19
    w, W = _experts(tri, T.F16, K, N, 1, rng)
    x = _activations(n, K, rng)
    xt = torch.from_numpy(x).to(tri.dev)
    x64 = x.astype(np.float64)
    tri.ledger = []
    assert _rel_rows(tri.to_numpy(tri.linear(xt, w)), x64 @ W[0].T, np.abs(x64) @ np.abs(W[0]).T) < TOL
    wg, Wg = _experts(tri, T.F16, 256, 64, 1, rng)  # two groups of 32 rows, each on its own 256 columns
    got = tri.to_numpy(tri._linear(xt, wg, group_rows=32, group_stride=256))
    want = np.concatenate([x64[:, :256] @ Wg[0, :32].T, x64[:, 256:] @ Wg[0, 32:].T], axis=1)
    ax, aw = np.abs(x64), np.abs(Wg[0])
    scale = np.concatenate([ax[:, :256] @ aw[:32].T, ax[:, 256:] @ aw[32:].T], axis=1)
    assert _rel_rows(got, want, scale) < TOL
    w2, W2 = _experts(tri, T.F16, 160, N, 1, rng)
    assert _rel_rows(tri.to_numpy(tri.linear(xt[:, :160], w2)), x64[:, :160] @ W2[0].T,
                     np.abs(x64[:, :160]) @ np.abs(W2[0]).T) < TOL
    tri.f16_x2 = False
    try:
        assert _rel_rows(tri.to_numpy(tri.linear(xt, w)), x64 @ W[0].T, np.abs(x64) @ np.abs(W[0]).T) < TOL
    finally:
        tri.f16_x2 = True
    ran = [name for name, _ in tri.ledger]
    tri.ledger = None
    assert ran == ["x16_kernel", "matmul_f16w_kernel", "x16_kernel", "matmul_f16w_kernel", "matmul_kernel",
                   "matmul_kernel"], ran


def test_normed_input_is_split_once_per_byte_order(tri, rng):
    """Prefill products that read one normed input (as wq_a, wkv and the compressors' and
    indexer's products read a layer's) split it once for the Q8C rows and once for the F16 rows,
    not once a product, and each result equals the product of a fresh input against float64."""
    n, K = 19, 512
    x = (rng.standard_normal((n, K)) * 10.0 ** rng.uniform(-2, 2, (n, 1))).astype(np.float32)
    xt = torch.from_numpy(x).to(tri.dev)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    norm = tri.upload(Tensor("nw", T.F32, (K,), nw.view(np.uint8)))
    x64 = x.astype(np.float64)
    ms = np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + tri.cfg.rms_eps)
    a64 = x64 / ms * nw.astype(np.float64)
    ws = [_experts(tri, t, K, N, 1, rng) for t, N in ((T.Q8_0, 48), (T.Q8_0, 32), (T.F16, 40), (T.F16, 24))]
    shared = tri.rms_norm(xt, norm)
    tri.ledger = []
    got = [tri.to_numpy(tri.linear(shared, w)) for w, _ in ws]
    ran = [name for name, _ in tri.ledger]
    tri.ledger = []
    alone = [tri.to_numpy(tri.linear(tri.rms_norm(xt, norm), w)) for w, _ in ws]
    ran_alone = [name for name, _ in tri.ledger]
    tri.ledger = None
    assert ran.count("x16_kernel") == 2 and ran_alone.count("x16_kernel") == 4, (ran, ran_alone)
    for g, a, (_, W) in zip(got, alone, ws):
        assert np.array_equal(g, a)
        assert _rel_rows(g, a64 @ W[0].T, np.abs(a64) @ np.abs(W[0]).T) < 1e-6


# ---- the "f16" prefill precision: x rounded once to fp16, one product per block ------------------

def _f16_rounded(x, block):
    """x as the "f16" precision feeds the tensor cores, in float64: per row and block of `block`
    values, x·s rounded once to fp16 and scaled back, s = 2^(14 − ⌊log2 max|x|⌋) (so the block's
    largest value lands in [2^14, 2^15); an all-zero block stays zero)."""
    x64 = np.asarray(x, np.float64)
    b = x64.reshape(x64.shape[0], -1, block)
    mx = np.abs(b).max(axis=2, keepdims=True)
    s = np.ldexp(1.0, 14 - np.floor(np.log2(np.where(mx > 0, mx, 1.0))).astype(int))
    return ((b * s).astype(np.float16).astype(np.float64) / s).reshape(x64.shape)


@pytest.fixture(scope="module")
def tri16():
    be = several_tiles(TritonBackend(preset_config("test"), device=DEVICE, dot_precision="f16"))
    be.moe_int16 = True
    be.q8_f16w = True  # the fp16 path for Q8C and F16 rows, whatever the tuning's default
    be.f16w_types = (80, 1)
    return be


def _one_rounding(got, x, W, block, w_rounded=False):
    """The product got of x [n, K] and W [N, K] equals the float64 product of x as the "f16"
    precision rounds it (blocks of `block` values; with w_rounded W's rows too, whole) to float32
    accumulation, and differs from the exact product by more than float32 accumulation would (so
    the values really were rounded), by at most one (two) fp16 roundings: all against Σ|w|·|x|."""
    x64 = x.astype(np.float64)
    scale = np.abs(x64) @ np.abs(W).T
    W16 = _f16_rounded(W, W.shape[1]) if w_rounded else W
    assert _rel_rows(got, _f16_rounded(x, block) @ W16.T, scale) < TOL
    err = _rel_rows(got, x64 @ W.T, scale)
    assert 4 * TOL < err < 2.0 ** (-10 if w_rounded else -11), err


def test_f16_precision_needs_ds4_numerics():
    with pytest.raises(ValueError, match="numerics 'ds4'.*'exact'"):
        TritonBackend(preset_config("test"), numerics="exact", device=DEVICE, dot_precision="f16")


def test_f16_linear_rounds_x_once(tri16, rng):
    """Q8_0 prefill products under "f16": by default x and the weights in fp16, one scale per row
    each (matmul_f16w_kernel, K a multiple of 256, also grouped); the bf16 path's kernel on one
    fp16 term (blocks of 32, and the only path where K is not a multiple of 256). F16 rows: x in
    fp16 (matmul_f16w_kernel)."""
    N, K, n = 40, 512, 19
    w, W = _experts(tri16, T.Q8_0, K, N, 1, rng)
    x = _activations(n, K, rng)
    x[0] = rng.standard_normal(K)  # (the all-zero row of _activations shows nothing here)
    xt = torch.from_numpy(x).to(tri16.dev)
    tri16.ledger, tri16.flop_ledger = [], []
    _one_rounding(tri16.to_numpy(tri16.linear(xt, w)), x, W[0], K, w_rounded=True)
    assert w.f16_row_scale is not None
    assert tri16.flop_ledger == [("matmul_f16w_kernel", 2 * n * N * K)]  # what the benchmark's TFLOP/s divide
    tri16.flop_ledger = None
    tri16.q8_f16w = False
    try:
        _one_rounding(tri16.to_numpy(tri16.linear(xt, w)), x, W[0], 32)
    finally:
        tri16.q8_f16w = True
    w2, W2 = _experts(tri16, T.Q8_0, 160, N, 1, rng)  # Q8_0 rows that are not Q8C chunks
    _one_rounding(tri16.to_numpy(tri16.linear(xt[:, :160], w2)), x[:, :160], W2[0], 32)
    # two groups of 32 rows, each reading its own 256 columns of x
    wg, Wg = _experts(tri16, T.Q8_0, 256, 64, 1, rng)
    got = tri16.to_numpy(tri16._linear(xt, wg, group_rows=32, group_stride=256))
    xr, W16 = _f16_rounded(x, K), _f16_rounded(Wg[0], 256)
    want = np.concatenate([xr[:, :256] @ W16[:32].T, xr[:, 256:] @ W16[32:].T], axis=1)
    ax, aw = np.abs(x.astype(np.float64)), np.abs(Wg[0])
    scale = np.concatenate([ax[:, :256] @ aw[:32].T, ax[:, 256:] @ aw[32:].T], axis=1)
    assert _rel_rows(got, want, scale) < TOL
    wh, Wh = _experts(tri16, T.F16, K, N, 1, rng)  # F16 rows: x rounded, the weights as they are
    _one_rounding(tri16.to_numpy(tri16.linear(xt, wh)), x, Wh[0], K)
    ran = [name for name, _ in tri16.ledger]
    tri16.ledger = None
    assert ran == ["x16_kernel", "matmul_f16w_kernel", "matmul_kernel", "matmul_kernel",
                   "x16_kernel", "matmul_f16w_kernel", "x16_kernel", "matmul_f16w_kernel"], ran


def test_f16_experts_round_x_once(tri16, rng):
    """The routed experts' prefill kernels under "f16" (backend.moe: IQ2_XXS gate/up, Q2_K down,
    each on x·s in one fp16 term): within the one-rounding bound of the float64 layer, and not
    float32-accurate (the low terms really are dropped)."""
    got, want, scale, ran = _moe_layer(tri16, rng, NE=3, n=17)
    assert "moe_gateup_mm16_kernel" in ran and "moe_down_mm16_kernel" in ran, ran
    # two roundings of 2^-12 each (x, then h), against the first-order error scale
    err = _rel_rows(got, want, scale)
    assert 4 * TOL < err < 2.0 ** -10, err


# The kernels of both precisions compiled for sm_90: "f16" must issue a third of bf16x3's
# tensor-core products on Q8_0 and half of the two-term path's on the experts, and its fp16 kernel
# (Q8C and F16 rows) must run on wgmma; the same kernel on x's two terms (F16 rows under bf16x3)
# issues twice its products, and on two terms of x and of W (Q8C rows under bf16x3) four times
# (three without the low terms' product).
_PTR = {"wb": "*u8", "wh": "*i16", "wf": "*i32", "gridp": "*i32", "ksigns": "*i32", "gb": "*u8", "gh": "*i16",
        "gf": "*i32", "ub": "*u8", "uh": "*i16", "uf": "*i32", "nib": "*i32", "tok_ptr": "*i32",
        "tile_e_ptr": "*i32", "tile_r0_ptr": "*i32", "tile_end_ptr": "*i32", "ww": "*i32", "ws": "*i32",
        "xh_ptr": "*fp16", "xl_ptr": "*fp16", "gh_ptr": "*fp16", "gl_ptr": "*fp16", "clamp": "fp32"}
_PAIRS = {"matmul": ("kernels", "matmul_kernel", dict(TYPE=80, BM=64, BN=128, NB=1, VB=32, PREC="tf32x3", U=32),
                     "TERMS", (3, 1)),
          "gateup": ("kernels_mm16", "moe_gateup_mm16_kernel", dict(BM=64, BN=64, KS=128, ROUTED=True), "LO",
                     (True, False)),
          "down": ("kernels_mm16", "moe_down_mm16_kernel", dict(BM=64, BN=64, KS=128), "LO", (True, False))}


def test_f16_kernels_compile_for_sm90_with_fewer_products():
    cases = [(mod, name, {**cx, flag: v}, _PTR, dict(num_warps=4, num_stages=1))
             for mod, name, cx, flag, values in _PAIRS.values() for v in values]
    f16 = {"x_ptr": "*fp16", "xl_ptr": "*fp16", "wl_ptr": "*fp16"}
    cases += [("kernels", "matmul_f16w_kernel", dict(TYPE=t, BM=128, BN=128, BK=64, GM=8, LO=lo, WLO=wlo, FRESH=lo),
               {**_PTR, **f16, "wh": "*i16" if t == 80 else "*fp16"}, dict(num_warps=8, num_stages=3))
              for t, lo, wlo in ((80, False, 0), (1, False, 0), (1, True, 0), (1, True, 4), (1, True, 3))]
    # Q8C, F16, F16 on two terms (bf16x3), Q8C split into two fp16 planes (q8_hl, read as F16 rows)
    n = [len(re.findall(r"wgmma\.mma_async", p)) for p in ptx_sm90(cases)]
    for i, name in enumerate(_PAIRS):
        full, one = n[2 * i], n[2 * i + 1]
        assert full == (3 if name == "matmul" else 2) * one > 0, (name, n)
    assert min(n[-5:-3]) > 0, n  # the fp16 path: its products on wgmma
    # two terms of x: twice the products; and of W: four times, or three without the low terms' product
    assert n[-3] == 2 * n[-4] and n[-2] == 4 * n[-4] and n[-1] == 3 * n[-4], n


def test_fp16_path_tiles_fit_the_shared_memory_they_are_given():
    """load_tuning fits the fp16 path's tiles to a GPU's shared memory (tuning.fit_stages): the
    kernel compiled for sm_90 at each fitted tile, its loads aligned as a launch specialises them
    (so the pipeliner stages them), uses no more than that memory; at the H100/H200's 227 KiB the
    default three-stage tile stays."""
    from ds4.backends.triton.tuning import TritonTuning, load_tuning

    f16 = {**_PTR, "x_ptr": "*fp16", "xl_ptr": "*fp16", "wl_ptr": "*fp16", "wh": "*fp16"}
    aligned = ("x_ptr", "xl_ptr", "xinv_ptr", "wb", "wh", "wt_ptr", "out_ptr", "wl_ptr", "SX", "so_t", "K", "RB",
               "sx_g", "N")
    limits = (232448, 101376)  # sm_90's and sm_89's per-block shared memory
    tiles = [load_tuning(False, ms, env={"DS4_TRITON_MV_SHAPES": ""}).hl_tile for ms in limits]
    assert tiles[0] == TritonTuning().hl_tile and tiles[1] != tiles[0]
    cases = [("kernels", "matmul_f16w_kernel", dict(TYPE=1, BM=BM, BN=BN, BK=BK, GM=GM, LO=True, WLO=3, FRESH=True),
              f16, dict(num_warps=warps, num_stages=stages), aligned)
             for BM, BN, BK, GM, warps, stages in tiles]
    for ms, (ptx, shared) in zip(limits, compile_sm90(cases)):
        assert "cp.async" in ptx and 0 < shared <= ms, (ms, shared)


def test_ffn_rows_come_from_the_environment():
    """DS4_TRITON_FFN_ROWS sets how many prompt rows run their FFN sublayers together (0: chunk
    by chunk, for a GPU short of memory); anything but a whole number names the variable."""
    from ds4.backends.triton.tuning import load_tuning

    base = {"DS4_TRITON_MV_SHAPES": ""}
    assert load_tuning(False, None, env=base).prefill_ffn_rows == 8192
    assert load_tuning(False, None, env={**base, "DS4_TRITON_FFN_ROWS": "0"}).prefill_ffn_rows == 0
    assert load_tuning(False, None, env={**base, "DS4_TRITON_FFN_ROWS": "4096"}).prefill_ffn_rows == 4096
    with pytest.raises(ValueError, match="DS4_TRITON_FFN_ROWS: expected a whole number.*got '-1'"):
        load_tuning(False, None, env={**base, "DS4_TRITON_FFN_ROWS": "-1"})
