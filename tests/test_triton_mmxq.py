"""The int8 prefill path for Q8C linears (kernels/mmq.py: `xq_planes_kernel`, `matmul_xq_kernel`):
x in fixed point per 32-value block (2 terms: XQ's 16 bits, 3: 24 bits), one int8 tensor-core
product a term a block. Against the fixed point written out in numpy from its definition and
float64 products of the weights as gguf-py decodes them (quant_refs.py). Without a GPU under
TRITON_INTERPRET=1 (conftest.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytest.importorskip("gguf.quants")

from ds4.backends.triton.backend import TritonBackend  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.tiny import preset_config  # noqa: E402
from quant_refs import experts  # noqa: E402
from seeds import rng_for_test  # noqa: E402
from sm90 import ptx_sm90  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the largest q per block: 127·257 (XQ, kernels/decode.py) and 127·65793 (its 24-bit form, 3 terms)
Q_MAX = {2: 32639, 3: 8355711}
BLOCK = 32
# float32 accumulation of exact int32 block sums, against Σ|w|·|x| (as test_triton_mm16.py)
TOL = 2.0 ** -19


@pytest.fixture
def rng(request):
    return rng_for_test(request)  # seeds.py


@pytest.fixture(scope="module")
def trixq():
    be = TritonBackend(preset_config("test"), device=DEVICE, dot_precision="bf16x3")
    be.q8_xq = True  # whatever the tuning's default
    return be


def _fixed(x, terms):
    """Each row's 32-value blocks in fixed point, in float32 as written out here: (q [R, K] int64,
    s [R, K / 32] float32) with x ≈ s·q, q = ⌊x·(Q_MAX / amax) + ½⌋ within ±Q_MAX."""
    b = np.asarray(x, np.float32).reshape(x.shape[0], -1, BLOCK)
    amax = np.abs(b).max(axis=2)
    inv = np.where(amax > 0, np.float32(Q_MAX[terms]) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.floor(b * inv[:, :, None].astype(np.float32) + np.float32(0.5)).astype(np.int64)
    q = np.clip(q, -Q_MAX[terms], Q_MAX[terms])  # (amax·inv may round half a step over Q_MAX)
    return q.reshape(x.shape), (amax / np.float32(Q_MAX[terms])).astype(np.float32)


def _planes(be, x, terms):
    """xq_planes_kernel's planes of x read back byte by byte: q [R, K] in K order (byte p of a
    block holds value 8·(p % 4) + p // 4, the Q8C order; q = Σ_t 256^(terms−1−t)·plane_t) and the
    block scales."""
    be.xq_terms = terms
    xq, s = (be.to_numpy(a) for a in be._xq_planes(torch.from_numpy(x).to(be.dev)))
    assert xq.shape == (terms, *x.shape) and xq.dtype == np.int8
    q = np.zeros(x.shape, np.int64)
    for plane in xq:
        q = 256 * q + plane.astype(np.int64)
    p = np.arange(BLOCK)
    order = (p % 4) * 8 + p // 4  # the value at byte p
    inverse = np.argsort(order)
    return q.reshape(x.shape[0], -1, BLOCK)[:, :, inverse].reshape(x.shape), s


def _weights(be, K, N, rng):
    """Q8_0 rows N × K on the backend (Q8C there when K is whole chunks) and their float64 decode."""
    w, W = experts(be, T.Q8_0, K, N, 1, rng)
    return w, W[0]


def _rel_rows(got, want, scale):
    """The largest error of any output against its own error scale (Σ|w|·|x|)."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / np.maximum(scale, 1e-30)))


def _activations(rows, K, rng):
    """Rows over several orders of magnitude, one all zero, one with a value that dwarfs its block."""
    x = rng.standard_normal((rows, K)) * 10.0 ** rng.uniform(-3, 3, (rows, 1)) * 10.0 ** rng.uniform(-1, 1, (rows, K))
    x[0] = 0.0
    x[1, min(300, K - 1)] = 3.0e5
    return x.astype(np.float32)


@pytest.mark.parametrize("terms", [2, 3])
def test_xq_planes(trixq, rng, terms):
    """The planes against the fixed point written out by hand: q within 1 of the hand rounding
    (the GPU may fuse its multiply-add and round a tie the other way) at under 1 % of the values,
    the block's largest |q| at Q_MAX, the scales amax / Q_MAX."""
    x = _activations(6, 512, rng)
    q, s = _planes(trixq, x, terms)
    want_q, want_s = _fixed(x, terms)
    assert np.abs(q - want_q).max() <= 1 and (q != want_q).mean() < 0.01
    assert np.abs(q).max() == Q_MAX[terms]
    assert np.array_equal(s, want_s)


@pytest.mark.parametrize("terms", [2, 3])
def test_xq_linear(trixq, rng, terms):
    """Q8C prefill products on the int8 path equal the float64 product of x as its planes hold it
    (to float32 accumulation) and stay within the fixed point's half step of the exact product,
    amax / (2·Q_MAX) a value; with 2 terms they differ from it by more than float32 would (x
    really was rounded to 16 bits). Grouped rows read their own columns of x."""
    N, K, n = 40, 512, 19
    w, W = _weights(trixq, K, N, rng)
    x = _activations(n, K, rng)
    xt = torch.from_numpy(x).to(trixq.dev)
    q, s = _planes(trixq, x, terms)
    xr = (q.reshape(n, -1, BLOCK) * s[:, :, None].astype(np.float64)).reshape(n, K)
    trixq.ledger, trixq.flop_ledger = [], []
    got = trixq.to_numpy(trixq.linear(xt, w))
    assert [k for k, _ in trixq.ledger] == ["xq_planes_kernel", "matmul_xq_kernel"]
    assert trixq.flop_ledger == [("matmul_xq_kernel", 2 * n * N * K)]
    trixq.ledger = trixq.flop_ledger = None
    ax = np.abs(x.astype(np.float64))
    scale = ax @ np.abs(W).T
    assert _rel_rows(got, xr @ W.T, scale) < TOL
    exact = x.astype(np.float64) @ W.T
    if terms == 2:
        assert _rel_rows(got, exact, scale) > 4 * TOL
    half = np.repeat(ax.reshape(n, -1, BLOCK).max(axis=2) / (2 * Q_MAX[terms]), BLOCK, axis=1)
    assert np.all(np.abs(got - exact) <= 1.5 * half @ np.abs(W).T + TOL * scale)
    # two groups of 32 rows, each reading its own 256 columns of x
    wg, Wg = _weights(trixq, 256, 64, rng)
    got = trixq.to_numpy(trixq._linear(xt, wg, group_rows=32, group_stride=256))
    want = np.concatenate([xr[:, :256] @ Wg[:32].T, xr[:, 256:] @ Wg[32:].T], axis=1)
    scale = np.concatenate([ax[:, :256] @ np.abs(Wg[:32]).T, ax[:, 256:] @ np.abs(Wg[32:]).T], axis=1)
    assert _rel_rows(got, want, scale) < TOL


def test_xq_linear_only_takes_whole_chunks(trixq, rng):
    """Q8_0 rows that are not whole 256-value chunks stay on the bf16x3 path (matmul_kernel)."""
    w, W = _weights(trixq, 160, 24, rng)
    x = _activations(17, 160, rng)
    trixq.ledger = []
    got = trixq.to_numpy(trixq.linear(torch.from_numpy(x).to(trixq.dev), w))
    assert [k for k, _ in trixq.ledger] == ["matmul_kernel"]
    trixq.ledger = None
    assert _rel_rows(got, x.astype(np.float64) @ W.T, np.abs(x.astype(np.float64)) @ np.abs(W).T) < TOL


def test_xq_matmul_runs_on_int8_wgmma():
    """Compiled for sm_90, each block's products are int8 wgmma (s32 += s8·s8), one per term."""
    types = {"xq_ptr": "*i8", "wb": "*u8", "wh": "*i16"}
    cases = [("kernels.mmq", "matmul_xq_kernel", dict(TERMS=t, BM=128, BN=128, GM=4), types,
              dict(num_warps=8, num_stages=2)) for t in (2, 3)]
    for terms, ptx in zip((2, 3), ptx_sm90(cases)):
        # one m64 wgmma a term for each half of the 128 rows of x, per block
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8") == terms, terms
