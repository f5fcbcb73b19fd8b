"""The MLX backend against the reference backend (the oracle), on the CPU (`mlx[cpu]`).

* the ds4 numerics in MLX are bit-identical to ds4/core/numerics.py (ties and subnormals too);
* every block decoder, and the lossless Q8_0 / Q4_K transcoding into MLX's quantized layout,
  reproduces gguf-py's dequantizer bit for bit;
* every op matches the reference on random inputs (seeds.py: DS4_TEST_SEED=<n> draws another set);
* whole models (q2 / q4 / q8 experts) give the reference's logits within 1e-4 for one-shot
  prefill, chunked prefill and decode, and the same greedy tokens, in both numerics modes;
* weights stay quantized (resident ≤ 1.15 × the GGUF), the state round-trips exactly, a decode
  step is one lazy graph, and `ds4 generate --backend mlx` runs.

ds4 numerics are discontinuous: an FP8 / FP4 / f16 rounding or a top-k choice flips when two
float32 computations of its input land on either side of a boundary, and the flipped cache row
then feeds every later token. Free-running sessions of two different float32 implementations
therefore drift apart at such flips however exact each op is (measured on the test models over
8 prompts: 1e-5 to 1e-1 relative after 16–48 free-running prefill tokens, and a greedy token
changed away from any near-tie once an indexer choice flipped). The ds4-numerics model tests
run MLX *pinned* to the reference: at every discontinuous op (kv_store, compressor,
indexer_select, router) the reference's result is checked and then used by both. A differing
result is allowed only at a certified near-tie: a rounding flip only where MLX's unrounded value
agrees with the reference's within float32 error (and MLX's rounded value is numpy's rounding of
its own unrounded value, bit for bit), a different top-k only where the scores of the swapped
entries agree. All continuous computation stays MLX's own. Exact numerics run free.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter, deque
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import gguf  # noqa: E402

import ds4  # noqa: E402
from ds4.backends import backend_class, resolve_backend  # noqa: E402
from ds4.backends.mlx import numerics as mnx  # noqa: E402
from ds4.backends.mlx.backend import MLXBackend, topk_ids_stable, topk_mask_stable  # noqa: E402
from ds4.backends.mlx.quants import upload  # noqa: E402
from ds4.backends.reference.backend import ReferenceBackend, _matvecs, _softplus, rope_tail  # noqa: E402
from ds4.core import numerics as nx  # noqa: E402
from ds4.core.gguf_model import GGUFModel, Tensor  # noqa: E402
from ds4.core.graph import forward_chunk  # noqa: E402
from ds4.core.quants import GGMLType, dequantize, encode, random_blocks  # noqa: E402
from ds4.core.state import FILL, SessionLayout, layer_state_shapes  # noqa: E402
from ds4.core.tiny import make_tiny  # noqa: E402
from ds4.core.weights import bind_weights  # noqa: E402
from ds4.engine import Engine  # noqa: E402
from seeds import SEED  # noqa: E402

WHY = f"(random inputs: DS4_TEST_SEED={SEED} repeats this run)"
PROMPT = [int(x) for x in np.random.default_rng(7).integers(0, 512, 48)]
LOGITS_TOL = 1e-4
OP_TOL = 1e-5  # one op on identical inputs: float32 rounding only
PIN_TOL = 1e-4  # continuous values where the pinned run meets the reference (~1e-6 measured)
NEAR_TIE = 1e-3  # the reference's top-2 logit gap that certifies a greedy divergence
TIE = 1e-4  # relative score gap that certifies a different top-k choice


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng([SEED, *key])


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def npy(x) -> np.ndarray:
    return np.array(x)


# ---- models ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mlx")
    return {ex: make_tiny(d / f"test-{ex}.gguf", preset="test", experts=ex, seed=1)
            for ex in ("q2", "q4", "q8")}


def open_mlx(path, numerics):
    return ds4.Engine.open(path, backend="mlx", numerics=numerics)  # compiled on Metal only


class Ops:
    """Both backends bound to the same model, for op-by-op comparisons."""

    cache: dict = {}

    @classmethod
    def of(cls, path, numerics) -> "Ops":
        key = (str(path), numerics)
        if key not in cls.cache:
            cls.cache[key] = cls(path, numerics)
        return cls.cache[key]

    def __init__(self, path, numerics):
        self.model = GGUFModel(path)
        self.cfg = cfg = self.model.config
        self.R, self.M = ReferenceBackend(cfg, numerics), MLXBackend(cfg, numerics)
        self.wr, self.wm = bind_weights(self.model, self.R.upload), bind_weights(self.model, self.M.upload)
        # the bounded paths of long prefills, forced small: queries scored 5 at a time, experts
        # decoded 3 at a time when a chunk uses them all
        self.Mb = MLXBackend(cfg, numerics, query_block=5,
                             expert_decode_bytes=3 * 4 * cfg.n_embd * cfg.n_ff_exp)
        # numerics="exact" twins on the same weights: the unrounded values behind a ds4 op
        self.R0, self.M0 = ReferenceBackend(cfg, "exact"), MLXBackend(cfg, "exact")
        self.layout = SessionLayout.create(cfg, 1024, 16)  # raw ring of 256 rows

    def states(self, il):
        shapes = layer_state_shapes(self.cfg, self.layout, il)
        return self.R.alloc_state(shapes, FILL), self.M.alloc_state(shapes, FILL)


@pytest.fixture(scope="module", params=["ds4", "exact"])
def ops(request, models):
    return Ops.of(models["q2"], request.param)


# ---- numerics: bit for bit ----------------------------------------------------------------------

def _awkward_floats(rng, n) -> np.ndarray:
    """Normal values over many binades, exact zeros, float32 subnormals and powers of two."""
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 3, n)
    x[rng.random(n) < 0.05] = 0.0
    sub = rng.random(n) < 0.05
    x[sub] = rng.uniform(-1, 1, sub.sum()) * 2.0 ** -127
    p2 = rng.random(n) < 0.05
    x[p2] = np.sign(rng.standard_normal(p2.sum())) * 2.0 ** rng.integers(-140, 10, p2.sum())
    return x.astype(np.float32)


def test_numerics_are_bit_identical():
    rng = rng_for(1)
    x = _awkward_floats(rng, 1 << 15)
    v = np.abs(x) + np.float32(1e-45)  # > 0
    assert np.array_equal(bits(mnx.pow2_ceil_log2(mx.array(v))), bits(nx._pow2_ceil_log2(v))), WHY
    assert np.array_equal(bits(mnx.f16_round(mx.array(x))), bits(nx.f16_round(x))), WHY
    e4 = np.clip(x, -448, 448)
    assert np.array_equal(bits(mnx.e4m3_round(mx.array(e4))), bits(nx.e4m3_round(e4))), WHY
    e2 = np.clip(x, -6, 6)
    assert np.array_equal(bits(mnx.e2m1_round(mx.array(e2))), bits(nx.e2m1_round(e2))), WHY
    rows = x[: 64 * 128].reshape(64, 128)
    assert np.array_equal(bits(mnx.hadamard(mx.array(rows))), bits(nx.hadamard(rows))), WHY
    assert np.array_equal(bits(mnx.indexer_qat(mx.array(rows))), bits(nx.indexer_qat(rows))), WHY
    assert np.array_equal(bits(mnx.fp8_kv_roundtrip(mx.array(rows), 64)),
                          bits(nx.fp8_kv_roundtrip(rows, 64))), WHY


@pytest.mark.parametrize("limit, floor", [(448.0, 1e-4), (6.0, 7.05e-38)])
def test_block_scale_without_division(limit, floor):
    """2^ceil(log2(amax / limit)) found by exact comparisons equals numpy's float32 quotient
    rounded up to a power of two, right at and a few ulps around every boundary."""
    rng = rng_for(4, int(limit))
    k = rng.integers(-125, 126, 1 << 16)
    with np.errstate(over="ignore"):
        edge = (np.float32(limit) * np.float32(2.0) ** k).astype(np.float32)
    near = (edge.view(np.int32) + rng.integers(-3, 4, edge.size)).view(np.float32)
    wide = (10.0 ** rng.uniform(-38, 38.5, 1 << 16)).astype(np.float32)
    amax = np.concatenate([near, wide, np.float32([floor, limit, 3.4e38])])
    amax = np.maximum(amax[np.isfinite(amax) & (amax > 0)], np.float32(floor))
    with np.errstate(over="ignore"):
        want = nx._pow2_ceil_log2(amax / np.float32(limit))
    assert np.array_equal(bits(mnx.pow2_scale(mx.array(amax), limit)), bits(want)), WHY


def test_numerics_ties_round_to_even():
    # exact midpoints between neighbouring E4M3 / E2M1 / f16 values, normal and subnormal
    k = np.arange(8, 16, dtype=np.float32)
    e4 = np.concatenate([(k + 0.5) * np.float32(2.0) ** e for e in range(-9, 6)]
                        + [(np.arange(0, 8) + 0.5) * np.float32(2.0 ** -9)]).astype(np.float32)
    e4 = e4[e4 <= 448]
    e4 = np.concatenate([e4, -e4])
    want = nx.e4m3_round(e4)
    assert (want != e4).all()  # every one a tie that had to move
    assert np.array_equal(bits(mnx.e4m3_round(mx.array(e4))), bits(want))
    e2 = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    e2 = np.concatenate([e2, -e2])
    assert np.array_equal(bits(mnx.e2m1_round(mx.array(e2))), bits(nx.e2m1_round(e2)))
    h = np.arange(1 << 10, dtype=np.uint16) | np.uint16(0x3C00)  # f16 values in [1, 2)
    mid = (h.view(np.float16).astype(np.float32) + np.float32(2.0 ** -11)).astype(np.float32)
    assert np.array_equal(bits(mnx.f16_round(mx.array(mid))), bits(nx.f16_round(mid)))
    # FP8 blocks whose amax makes the scale an exact power of two and whose values are ties
    rng = rng_for(2)
    blocks = rng.choice(e4[np.abs(e4) <= 448], (16, 128)).astype(np.float32)
    blocks[:, ::64] = 448.0 * np.float32(2.0) ** rng.integers(-8, 8, (16, 2))
    blocks *= np.float32(2.0) ** rng.integers(-20, 20, (16, 1))
    assert np.array_equal(bits(mnx.fp8_kv_roundtrip(mx.array(blocks), 128)),
                          bits(nx.fp8_kv_roundtrip(blocks, 128))), WHY


@pytest.mark.skipif(not (mx.metal.is_available() or os.environ.get("DS4_TEST_MLX_COMPILE")),
                    reason="mx.compile is the default on Metal only; on the CPU each fused kernel "
                           "is a C++ build (DS4_TEST_MLX_COMPILE=1 runs it anyway)")
def test_compiled_numerics_stay_bit_identical():
    """mx.compile (the default on Metal) must not change a rounding."""
    rows = _awkward_floats(rng_for(3), 8 * 128).reshape(8, 128)
    f = mx.compile(lambda x: mnx.f16_round(mnx.fp8_kv_roundtrip(x, 64)))
    assert np.array_equal(bits(f(mx.array(rows))), bits(nx.f16_round(nx.fp8_kv_roundtrip(rows, 64)))), WHY


# ---- weights: exact decoders, lossless transcoding, resident size --------------------------------

TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K,
         GGMLType.IQ2_XXS]


def _tensor(t, dims, rng, scale=1.0, name=None):
    raw = random_blocks(t, int(np.prod(dims)), rng, scale=scale)
    return Tensor(name or f"w{int(t)}-{'x'.join(map(str, dims))}", t, dims, raw)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_decoders_match_gguf_py(t):
    """Every format decodes (dense: casts; affine: mx.dequantize of the transcoded layout;
    blocks: MLX bit operations and table lookups) to gguf-py's values bit for bit, for a whole
    3-D expert tensor and for gathered experts."""
    rng = rng_for(10, int(t))
    tensor = _tensor(t, (512, 6, 5), rng)
    w = upload(tensor)
    assert w.form == {GGMLType.Q8_0: "affine", GGMLType.Q4_K: "affine", GGMLType.Q2_K: "blocks",
                      GGMLType.IQ2_XXS: "blocks"}.get(t, "dense")
    if t == GGMLType.BF16:  # gguf-py has no BF16 dequantizer; ours is a bit shift
        want = dequantize(tensor.raw, t)
    else:
        want = gguf.quants.dequantize(tensor.raw, gguf.GGMLQuantizationType(int(t)))
    want = np.asarray(want, dtype=np.float32).reshape(5, 6, 512)
    assert np.array_equal(bits(w.f32()), bits(want)), WHY
    pick = np.array([4, 0, 4])
    assert np.array_equal(bits(w.take(mx.array(pick)).f32()), bits(want[pick])), WHY
    assert w.nbytes <= 1.06 * tensor.n_bytes


def test_q8_0_with_huge_scales_stays_exact():
    """−128·d overflows f16 for |d| ≥ 512: those tensors keep float32 scales, still exact."""
    x = np.random.default_rng(0).standard_normal(64 * 32).astype(np.float32) * 1e5
    raw = encode(x, GGMLType.Q8_0)
    w = upload(Tensor("big", GGMLType.Q8_0, (64, 32), raw))
    assert w.scales.dtype == mx.float32
    assert np.array_equal(bits(w.f32()), bits(dequantize(raw, GGMLType.Q8_0).reshape(32, 64)))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_linear_every_format(ops, t):
    tensor = _tensor(t, (512, 48), rng_for(11, int(t)), scale=512 ** -0.5, name=f"lin{int(t)}")
    x = rng_for(12, int(t)).standard_normal((3, 512)).astype(np.float32)
    assert rel(npy(ops.M.linear(mx.array(x), ops.M.upload(tensor))), ops.R.linear(x, tensor)) <= OP_TOL, WHY


@pytest.mark.parametrize("experts", ["q2", "q4", "q8"])
def test_weights_stay_quantized(models, experts):
    eng = open_mlx(models[experts], "ds4")
    be, model = eng.backend, eng.model
    held = sum(a.nbytes for w in be.weights for a in w.arrays)
    assert held == be.resident_bytes
    assert held <= 1.15 * model.file_size, f"{held} bytes held for a {model.file_size}-byte GGUF"
    for w in be.weights:  # no quantized tensor was expanded to floats
        if w.type in (GGMLType.Q8_0, GGMLType.Q4_K):
            assert w.form == "affine" and w.data.dtype == mx.uint32
        elif w.type in (GGMLType.Q2_K, GGMLType.IQ2_XXS):
            assert w.form == "blocks" and w.data.dtype == mx.uint8


# ---- ops on random inputs ----------------------------------------------------------------------

def test_embed_hc_norms_rope(ops):
    R, M, cfg, L, Lm = ops.R, ops.M, ops.cfg, ops.wr.layers[2], ops.wm.layers[2]
    rng = rng_for(20)
    tokens = rng.integers(0, cfg.n_vocab, 5)
    assert np.array_equal(npy(M.embed(ops.wm.token_embd, tokens)), R.embed(ops.wr.token_embd, tokens))
    X = rng.standard_normal((5, cfg.n_hc, cfg.n_embd)).astype(np.float32)
    for got, want in zip(M.hc_pre(mx.array(X), Lm.hc_attn), R.hc_pre(X, L.hc_attn)):
        assert rel(npy(got), want) <= OP_TOL, WHY
    _, post, comb = R.hc_pre(X, L.hc_ffn)
    y = rng.standard_normal((5, cfg.n_embd)).astype(np.float32)
    got = M.hc_post(mx.array(y), mx.array(X), mx.array(post), mx.array(comb))
    assert rel(npy(got), R.hc_post(y, X, post, comb)) <= OP_TOL, WHY
    assert rel(npy(M.rms_norm(mx.array(y), Lm.attn_norm)), R.rms_norm(y, L.attn_norm)) <= OP_TOL, WHY
    assert rel(npy(M.rms_norm(mx.array(y))), R.rms_norm(y)) <= OP_TOL, WHY
    q = rng.standard_normal((5, cfg.n_head * cfg.head_dim)).astype(np.float32)
    qn = R.head_norm(q)
    assert rel(npy(M.head_norm(mx.array(q))), qn) <= OP_TOL, WHY
    p0 = int(rng.integers(0, 4000))
    for il in (0, 3):
        for inverse in (False, True):
            got = M.rope(mx.array(qn), p0, il, inverse)
            assert rel(npy(got), R.rope(qn, p0, il, inverse)) <= OP_TOL, WHY


def test_kv_store_ring(ops):
    """The same rows land in the same ring slots, rounded bit for bit (ring wrap included)."""
    st_r, st_m = ops.states(0)
    rng = rng_for(21)
    p = 0
    for n in (16, 16, 7, 16, 16, 1, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 9):
        kv = (rng.standard_normal((n, ops.cfg.head_dim)) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)
        ops.R.kv_store(st_r, kv, p)
        ops.M.kv_store(st_m, mx.array(kv), p)
        p += n
    assert p > st_r["raw"].shape[0]
    assert np.array_equal(bits(ops.M.state_to_numpy(st_m, "raw")), bits(st_r["raw"])), WHY


def _rounding(cfg, numerics, indexer):
    if numerics == "exact":
        return lambda x: x
    if indexer:
        return lambda x: nx.f16_round(nx.indexer_qat(x))
    return lambda x: nx.f16_round(nx.fp8_kv_roundtrip(x, cfg.n_nope))


def check_compressor_step(cfg, numerics, il, indexer, p0, n, before, after_r, unrounded_r,
                          after_m, unrounded_m) -> int:
    """Compare one compressor call; return the number of certified rounding flips.

    The frontier is continuous (close); the compressed rows are ds4-rounded: MLX's unrounded rows
    must match the reference's, and each side's rounded rows must be numpy's rounding of its own
    unrounded rows bit for bit, so any difference between the rounded rows is a value on the
    other side of a rounding boundary. Each such flip is certified on its own: the two values
    that were rounded there (after the indexer's Hadamard transform) agree within float32 error
    of the op (OP_TOL of the rows' largest value). A fixed cap on the number of flips per run
    would not certify anything more, and flips grow with the number of rounded values."""
    prefix = "index" if indexer else "comp"
    for name in (prefix + "_kv", prefix + "_score"):
        got, want = npy(after_m[name]), after_r[name]
        assert np.array_equal(np.isfinite(got), np.isfinite(want)), name
        fin = np.isfinite(want)
        if fin.any():
            assert rel(got[fin], want[fin]) <= PIN_TOL, (name, WHY)
    m = cfg.ratio(il)
    new = slice(p0 // m, (p0 + n) // m)
    rows_r, rows_m = after_r[prefix], npy(after_m[prefix])
    keep = np.ones(rows_r.shape[0], dtype=bool)
    keep[new] = False
    assert np.array_equal(rows_m[keep], npy(before[prefix])[keep])  # nothing else was written
    if new.start == new.stop:
        return 0
    u_r, u_m = unrounded_r[prefix][new], npy(unrounded_m[prefix])[new]
    assert rel(u_m, u_r) <= PIN_TOL, (prefix, WHY)
    rounding = _rounding(cfg, numerics, indexer)
    assert np.array_equal(bits(rows_m[new]), bits(rounding(u_m))), prefix
    assert np.array_equal(bits(rows_r[new]), bits(rounding(u_r))), prefix
    if numerics != "ds4":
        return 0
    flip = rows_m[new] != rows_r[new]
    if flip.any():
        t_r, t_m = (nx.hadamard(u_r), nx.hadamard(u_m)) if indexer else (u_r, u_m)
        gap = float(np.abs(t_m[flip] - t_r[flip]).max() / max(np.abs(t_r).max(), 1e-30))
        assert gap <= OP_TOL, (f"{prefix}: a rounding flip away from a near-tie ({gap:.2g})", WHY)
    return int(flip.sum())


@pytest.mark.parametrize("il, indexer", [(2, False), (2, True), (3, False)])
def test_compressor(ops, il, indexer):
    """Chunks of every size open, fill and close windows (several per chunk, across chunks)."""
    cfg = ops.cfg
    st_r, st_m = ops.states(il)
    w_r = ops.wr.layers[il].indexer.compressor if indexer else ops.wr.layers[il].compressor
    w_m = ops.wm.layers[il].indexer.compressor if indexer else ops.wm.layers[il].compressor
    rng = rng_for(22, il, indexer)
    p = 0
    for n in (1, 2, 5, 1, 3, 9, 16, 4, 7):
        a = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        before = dict(st_m)
        u_r = {k: v.copy() for k, v in st_r.items()}
        ops.R0.compressor(u_r, a, w_r, p, il, indexer)
        ops.R.compressor(st_r, a, w_r, p, il, indexer)
        u_m = dict(st_m)
        ops.M0.compressor(u_m, mx.array(a), w_m, p, il, indexer)
        ops.M.compressor(st_m, mx.array(a), w_m, p, il, indexer)
        check_compressor_step(cfg, ops.R.numerics, il, indexer, p, n, before, st_r, u_r, st_m, u_m)
        for k in st_m:  # continue from the same state
            ops.M.state_from_numpy(st_m, k, st_r[k])
        p += n


def index_scores(R, st, qr, a, w, p0, il) -> np.ndarray:
    """The reference indexer's scores [n, C] (its indexer_select, before the top-k)."""
    cfg = R.cfg
    n, m = qr.shape[0], cfg.ratio(il)
    pos = np.arange(p0, p0 + n)
    visible = (pos + 1) // m
    IH, ID = cfg.indexer_heads, cfg.indexer_head_dim
    iq = rope_tail(R.linear(qr, w.q_b).reshape(n, IH, ID), pos, R._freq[il], cfg.n_rot)
    if R.ds4_numerics:
        iq = nx.indexer_qat(iq)
    hw = R.linear(a, w.proj) / np.float32(np.sqrt(ID * IH))
    out = np.full((n, int(visible.max())), -np.inf, dtype=np.float32)
    for i in range(n):
        keys = st["index"][: visible[i]]
        out[i, : visible[i]] = hw[i] @ np.maximum(_matvecs(iq[i], keys), 0)
    return out


def check_topk_mask(got, want, scores, k) -> int:
    """Masks must agree except at certified near-ties of the reference's scores."""
    flips = 0
    for i in np.nonzero((got != want).any(axis=1))[0]:
        s = scores[i]
        kth = np.sort(s[np.isfinite(s)])[-k]
        swapped = s[got[i] != want[i]]
        assert np.abs(swapped - kth).max() <= TIE * np.abs(s[np.isfinite(s)]).max(), \
            f"row {i}: selections differ away from a tie {WHY}"
        flips += 1
    return flips


def test_indexer_select(ops):
    cfg, il = ops.cfg, 2
    L, Lm = ops.wr.layers[il], ops.wm.layers[il]
    st_r, st_m = ops.states(il)
    rng = rng_for(23)
    rows = rng.standard_normal(st_r["index"].shape).astype(np.float32)
    st_r["index"][:] = _rounding(cfg, ops.R.numerics, True)(rows)
    ops.M.state_from_numpy(st_m, "index", st_r["index"])
    for p0, n in ((0, 8), (10, 12), (30, 6), (63, 1), (100, 16)):
        qr = rng.standard_normal((n, cfg.q_lora_rank)).astype(np.float32)
        a = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
        want = ops.R.indexer_select(st_r, qr, a, L.indexer, p0, il)
        for M in (ops.M, ops.Mb):
            got = M.indexer_select(st_m, mx.array(qr), mx.array(a), Lm.indexer, p0, il)
            if want is None:
                assert got is None
                continue
            scores = index_scores(ops.R, st_r, qr, a, L.indexer, p0, il)
            assert check_topk_mask(npy(got), want, scores, cfg.indexer_top_k) <= 1, WHY


def test_topk_ties_go_to_the_lower_index():
    rng = rng_for(24)
    s = rng.integers(0, 5, (64, 40)).astype(np.float32)  # many exact ties
    order = np.argsort(-s, axis=1, kind="stable")
    assert np.array_equal(npy(topk_ids_stable(mx.array(s), 6)), order[:, :6])
    want = np.zeros_like(s, dtype=bool)
    np.put_along_axis(want, order[:, :7], True, axis=1)
    assert np.array_equal(npy(topk_mask_stable(mx.array(s), 7)), want)


@pytest.mark.parametrize("il", [0, 2, 3])
def test_attention(ops, il):
    """Sliding window over the ring (wrapping), all compressed rows (HCA) or a selection (CSA)."""
    cfg = ops.cfg
    st_r, st_m = ops.states(il)
    rng = rng_for(25, il)
    for name in st_r:
        st_r[name][:] = rng.standard_normal(st_r[name].shape).astype(np.float32)
        ops.M.state_from_numpy(st_m, name, st_r[name])
    sinks, sinks_m = ops.wr.layers[il].attn_sinks, ops.wm.layers[il].attn_sinks
    for p0, n in ((0, 5), (37, 1), (250, 12), (301, 16)):
        q = rng.standard_normal((n, cfg.n_head, cfg.head_dim)).astype(np.float32)
        C = (p0 + n) // cfg.ratio(il) if cfg.ratio(il) else 0
        sel = rng.random((n, C)) < 0.5 if cfg.ratio(il) == 4 else None
        want = ops.R.attention(q, st_r, sinks, p0, il, sel)
        for M in (ops.M, ops.Mb):
            got = M.attention(mx.array(q), st_m, sinks_m, p0, il, None if sel is None else mx.array(sel))
            assert rel(npy(got), want) <= OP_TOL, WHY


def test_grouped_output_and_head(ops):
    cfg, L, Lm = ops.cfg, ops.wr.layers[1], ops.wm.layers[1]
    rng = rng_for(26)
    o = rng.standard_normal((3, cfg.n_head, cfg.head_dim)).astype(np.float32)
    got = ops.M.grouped_output(mx.array(o), Lm.attn_output_a, Lm.attn_output_b)
    assert rel(npy(got), ops.R.grouped_output(o, L.attn_output_a, L.attn_output_b)) <= OP_TOL, WHY
    X = rng.standard_normal((3, cfg.n_hc, cfg.n_embd)).astype(np.float32)
    got = ops.M.output_logits(mx.array(X), ops.wm.output_hc, ops.wm.output_norm, ops.wm.output)
    want = ops.R.output_logits(X, ops.wr.output_hc, ops.wr.output_norm, ops.wr.output)
    assert got.shape == want.shape and rel(npy(got), want) <= OP_TOL, WHY


def router_scores(R, f, gate_inp, bias) -> np.ndarray:
    """The reference router's selection scores (its router, before the top-k)."""
    p = np.sqrt(_softplus(R.linear(f, gate_inp)))
    return p if bias is None else p + R._vector(bias)


def check_router(got_ids, want_ids, sel) -> int:
    flips = 0
    for i in np.nonzero((got_ids != want_ids).any(axis=1))[0]:
        gap = np.abs(sel[i, got_ids[i]] - sel[i, want_ids[i]]).max()
        assert gap <= TIE * np.abs(sel[i]).max(), f"row {i}: routing differs away from a tie {WHY}"
        flips += 1
    return flips


@pytest.mark.parametrize("il", [0, 4])  # hash routing, top-k routing
def test_router(ops, il):
    cfg, L, Lm = ops.cfg, ops.wr.layers[il], ops.wm.layers[il]
    rng = rng_for(27, il)
    f = rng.standard_normal((9, cfg.n_embd)).astype(np.float32)
    tokens = rng.integers(0, cfg.n_vocab, 9)
    ids_r, w_r = ops.R.router(f, L.ffn_gate_inp, L.exp_probs_b, L.tid2eid, tokens, il)
    ids_m, w_m = ops.M.router(mx.array(f), Lm.ffn_gate_inp, Lm.exp_probs_b, Lm.tid2eid, tokens, il)
    ids_m = npy(ids_m)
    if L.tid2eid is not None:
        assert np.array_equal(ids_m, ids_r)
    elif check_router(ids_m, ids_r, router_scores(ops.R, f, L.ffn_gate_inp, L.exp_probs_b)):
        return
    assert rel(npy(w_m), w_r) <= OP_TOL, WHY


@pytest.mark.parametrize("experts", ["q2", "q4", "q8"])
@pytest.mark.parametrize("n", [1, 3, 8])  # n·k below n_expert: gathered experts; above: all
def test_moe_and_shared_expert(models, experts, n):
    o = Ops.of(models[experts], "exact")
    cfg, il = o.cfg, 3
    L, Lm = o.wr.layers[il], o.wm.layers[il]
    rng = rng_for(28, n)
    f = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
    ids = np.stack([rng.permutation(cfg.n_expert)[: cfg.n_expert_used] for _ in range(n)])
    w = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    want = o.R.moe(f, ids, w, L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps, il)
    for M in (o.M, o.Mb):
        got = M.moe(mx.array(f), mx.array(ids.astype(np.uint32)), mx.array(w),
                    Lm.ffn_gate_exps, Lm.ffn_up_exps, Lm.ffn_down_exps, il)
        assert rel(npy(got), want) <= OP_TOL, WHY
    want = o.R.shared_expert(f, L.ffn_gate_shexp, L.ffn_up_shexp, L.ffn_down_shexp, il)
    got = o.M.shared_expert(mx.array(f), Lm.ffn_gate_shexp, Lm.ffn_up_shexp, Lm.ffn_down_shexp, il)
    assert rel(npy(got), want) <= OP_TOL, WHY


# ---- whole models ----------------------------------------------------------------------------------

class RecordingReference(ReferenceBackend):
    """The oracle, logging the results (and margins) of its discontinuous ops in call order."""

    def __init__(self, cfg, numerics):
        super().__init__(cfg, numerics)
        self.exact = ReferenceBackend(cfg, "exact")
        self.log: deque = deque()

    def kv_store(self, st, kv, p0):
        super().kv_store(st, kv, p0)
        self.log.append(("kv_store", kv.copy(), st["raw"].copy()))

    def compressor(self, st, a, w, p0, il, indexer):
        unrounded = {k: v.copy() for k, v in st.items()}
        self.exact.compressor(unrounded, a, w, p0, il, indexer)
        super().compressor(st, a, w, p0, il, indexer)
        self.log.append(("compressor", a.copy(), {k: v.copy() for k, v in st.items()}, unrounded))

    def indexer_select(self, st, qr, a, w, p0, il):
        mask = super().indexer_select(st, qr, a, w, p0, il)
        scores = None if mask is None else index_scores(self, st, qr, a, w, p0, il)
        self.log.append(("indexer_select", mask, scores))
        return mask

    def router(self, f, gate_inp, bias, tid2eid, tokens, il):
        ids, w = super().router(f, gate_inp, bias, tid2eid, tokens, il)
        sel = None if tid2eid is not None else router_scores(self, f, gate_inp, bias)
        self.log.append(("router", ids, w, sel))
        return ids, w


class PinnedMLX(MLXBackend):
    """MLX whose discontinuous ops are checked against the reference's log and then continue
    from the reference's result (see the module docstring); everything else is MLX's own."""

    def __init__(self, cfg, numerics, log):
        super().__init__(cfg, numerics)
        self.exact = MLXBackend(cfg, "exact")
        self.log = log
        self.flips: Counter = Counter()

    def _next(self, op):
        rec = self.log.popleft()
        assert rec[0] == op, f"the two runs called {rec[0]} / {op}: the graph diverged"
        return rec[1:]

    def kv_store(self, st, kv, p0):
        kv_r, raw_r = self._next("kv_store")
        kv = npy(kv)
        assert rel(kv, kv_r) <= PIN_TOL
        if self.ds4_numerics:  # count the roundings MLX's own rows would have flipped
            q = lambda x: nx.f16_round(nx.fp8_kv_roundtrip(x, self.cfg.n_nope))  # noqa: E731
            self.flips["rounding"] += int((q(kv) != q(kv_r)).sum())
        super().kv_store(st, mx.array(kv_r), p0)  # the same rows, rounded bit for bit
        assert np.array_equal(bits(npy(st["raw"])), bits(raw_r))

    def compressor(self, st, a, w, p0, il, indexer):
        a_r, after_r, unrounded_r = self._next("compressor")
        assert rel(npy(a), a_r) <= PIN_TOL
        before, unrounded = dict(st), dict(st)
        self.exact.compressor(unrounded, mx.array(a_r), w, p0, il, indexer)
        super().compressor(st, mx.array(a_r), w, p0, il, indexer)
        self.flips["rounding"] += check_compressor_step(
            self.cfg, self.numerics, il, indexer, p0, a_r.shape[0], before, after_r, unrounded_r,
            st, unrounded)
        for k in after_r:
            st[k] = mx.array(after_r[k])

    def indexer_select(self, st, qr, a, w, p0, il):
        mask_r, scores_r = self._next("indexer_select")
        mask = super().indexer_select(st, qr, a, w, p0, il)
        if mask_r is None:
            assert mask is None
            return None
        self.flips["indexer"] += check_topk_mask(npy(mask), mask_r, scores_r, self.cfg.indexer_top_k)
        return mx.array(mask_r)

    def router(self, f, gate_inp, bias, tid2eid, tokens, il):
        ids_r, w_r, sel_r = self._next("router")
        ids, w = super().router(f, gate_inp, bias, tid2eid, tokens, il)
        got = npy(ids)
        if sel_r is None:
            assert np.array_equal(got, ids_r)
        elif check_router(got, ids_r, sel_r):
            self.flips["router"] += 1
            return mx.array(ids_r.astype(np.uint32)), mx.array(w_r)
        assert rel(npy(w), w_r) <= PIN_TOL
        return ids, w


def engines(path, numerics):
    """(reference, mlx) engines: free-running in exact numerics, pinned in ds4 numerics."""
    if numerics == "exact":
        return ds4.Engine.open(path, numerics="exact"), open_mlx(path, "exact")
    model = GGUFModel(path)
    R = RecordingReference(model.config, numerics)
    M = PinnedMLX(model.config, numerics, R.log)
    layers = range(model.config.n_layer)
    return (Engine(model, R, bind_weights(model, R.upload), layers),
            Engine(model, M, bind_weights(model, M.upload), layers))


@pytest.mark.parametrize("numerics", ["exact", "ds4"])
@pytest.mark.parametrize("experts", ["q2", "q4", "q8"])
def test_model_logits_match_reference(models, experts, numerics):
    """48 tokens slide the raw window, close 12 ratio-4 and 6 ratio-8 windows and overflow the
    indexer's top-k: one-shot prefill, chunked prefill (edges inside and on windows) and decode."""
    ref, mlx = engines(models[experts], numerics)
    errs = {}
    for cap in (None, 5):
        r, m = ref.session(ctx=128, prefill_cap=cap), mlx.session(ctx=128, prefill_cap=cap)
        r.sync(PROMPT)
        m.sync(PROMPT)
        errs[f"prefill cap={cap}"] = rel(m.logits, r.logits)
    r, m = ref.session(ctx=128), mlx.session(ctx=128)
    r.sync(PROMPT[:24])
    m.sync(PROMPT[:24])
    worst = rel(m.logits, r.logits)
    for t in PROMPT[24:]:
        r.eval(t)
        m.eval(t)
        worst = max(worst, rel(m.logits, r.logits))
    errs["decode"] = worst
    print(f"{experts} {numerics}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()),
          dict(getattr(mlx.backend, "flips", {})))
    assert max(errs.values()) <= LOGITS_TOL, errs
    if numerics == "ds4":
        assert not ref.backend.log  # both runs made the same calls


@pytest.mark.parametrize("numerics", ["exact", "ds4"])
def test_64_greedy_tokens(models, numerics):
    ref, mlx = engines(models["q2"], numerics)
    r, m = ref.session(ctx=128), mlx.session(ctx=128)
    r.sync(PROMPT[:12])
    m.sync(PROMPT[:12])
    for i in range(64):
        a, b = int(np.argmax(r.logits)), int(np.argmax(m.logits))
        if a != b:
            top2 = np.sort(r.logits)[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"token {i}: {b} instead of {a} away from a near-tie"
            break
        r.eval(a)
        m.eval(a)


def test_state_round_trips_exactly(models):
    ref, mlx = ds4.Engine.open(models["q2"]), open_mlx(models["q2"], "ds4")
    m = mlx.session(ctx=128, prefill_cap=16)
    m.sync(PROMPT[:21])
    snap = m.snapshot()
    m2 = mlx.session(ctx=128, prefill_cap=16)
    m2.restore(snap)
    for il, st in snap.arrays.items():
        for name, a in st.items():
            assert a.dtype == np.float32
            assert np.array_equal(bits(mlx.backend.state_to_numpy(m2.states[il], name)), bits(a))
    m.eval(PROMPT[21])
    m2.eval(PROMPT[21])
    assert np.array_equal(m.logits, m2.logits)
    # a reference session's state loads into MLX unchanged (the KV handoff's building block)
    r = ref.session(ctx=128, prefill_cap=16)
    r.sync(PROMPT[:21])
    m3 = mlx.session(ctx=128, prefill_cap=16)
    m3.restore(r.snapshot())
    back = m3.snapshot()
    for il, st in r.snapshot().arrays.items():
        for name, a in st.items():
            assert np.array_equal(bits(back.arrays[il][name]), bits(a))


def test_decode_step_is_one_lazy_graph(models, monkeypatch, tmp_path):
    """Building a decode step evaluates nothing; its logits' graph reaches back through the
    router's argmaxes and the expert gathers of every layer (nothing went to the host and back);
    the step is evaluated once, together with the state it updated."""
    eng = open_mlx(models["q2"], "ds4")
    cfg, be = eng.config, eng.backend
    s = eng.session(ctx=128)
    s.sync(PROMPT[:30])
    evals, real_eval, real_async = [], mx.eval, mx.async_eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evals.append(len(a)), real_eval(*a))[1])
    monkeypatch.setattr(mx, "async_eval", lambda *a: (evals.append(len(a)), real_async(*a))[1])
    out = forward_chunk(be, eng.weights, s.states, np.array([PROMPT[30]]), 30)
    assert evals == []
    dot = tmp_path / "step.dot"
    mx.export_to_dot(str(dot), out)
    ops = Counter(re.findall(r'label ?= ?"(\w+)"', dot.read_text()))
    topk_layers = cfg.n_layer - cfg.n_hash_layer
    assert ops["ArgReduce"] == topk_layers * cfg.n_expert_used, ops  # the routers' argmaxes
    assert ops["Gather"] >= 3 * cfg.n_layer + 1, ops  # selected experts, embedding row
    assert ops["DynamicSliceUpdate"] >= cfg.n_layer, ops  # every layer's ring write
    be.to_numpy(out)
    assert len(evals) == 1 and evals[0] > 1  # the logits and the updated state, at once


# ---- backend choice and the CLI --------------------------------------------------------------------

def test_auto_backend_rule(monkeypatch):
    import ds4.backends as reg

    monkeypatch.setattr(reg, "_importable", lambda name: True)
    for cuda, metal, want in ((True, True, "triton"), (True, False, "triton"),
                              (False, True, "mlx"), (False, False, "reference")):
        monkeypatch.setattr(reg, "_cuda_gpu", lambda: cuda)
        monkeypatch.setattr(reg, "_metal_mlx", lambda: metal)
        assert resolve_backend("auto") == want
    assert resolve_backend("mlx") == "mlx"
    monkeypatch.undo()
    here = "mlx" if sys.platform == "darwin" and mx.metal.is_available() else None
    if here and not reg._cuda_gpu():
        assert resolve_backend("auto") == here
    assert backend_class("auto") is backend_class(resolve_backend("auto"))


def test_cli_generate_with_mlx(models):
    from typer.testing import CliRunner

    from cli.main import app

    def run(backend):
        args = ["generate", "-m", str(models["q2"]), "-p", "Hello there", "-n", "6", "--temp", "0",
                "--numerics", "exact", "--backend", backend]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        return r.stdout_bytes

    assert run("mlx") == run("reference")
    assert run("auto")


@pytest.mark.parametrize("numerics", ["ds4", "exact"])
def test_chunks_sharing_their_ffn_change_no_bit(models, numerics, monkeypatch):
    """Prefill chunks whose FFN sublayers run as one (prefill_ffn_rows, graph.forward_chunks)
    leave the logits and every state row as the chunks one after another do, bit for bit."""
    from ffn_groups import assert_same_bits, prefill_both_ways

    out = prefill_both_ways(open_mlx(models["q2"], numerics), PROMPT, 128, 16, 48, monkeypatch)
    assert_same_bits(out[48], out[0])
