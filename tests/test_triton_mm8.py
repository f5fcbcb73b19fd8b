"""The routed down on int8 tensor cores (kernels_mm8.py) against float64 products of the Q2_K
weights as gguf-py decodes them. Without a GPU they run under TRITON_INTERPRET=1 (conftest.py)
on small shapes; with one, compiled."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytest.importorskip("gguf.quants")

from ds4.backends.triton import kernels_mm8 as K8  # noqa: E402
from ds4.backends.triton.backend import TritonBackend, _cdiv  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.tiny import preset_config  # noqa: E402
from seeds import rng_for_test  # noqa: E402
from sm90 import compile_sm90  # noqa: E402
from triton_pair import several_tiles  # noqa: E402
from test_triton_mm16 import TOL, _activations, _experts, _moe_layer, _rel_rows, _schedule  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# per number of digit planes: the largest |q| (kernels_mm8.py, written out from its digits) and
# the divisor of the sub-block sums
Q_MAX = {3: 127 * (65536 + 256 + 1), 2: 127 * (256 + 1)}
G_SHIFT = {3: 4096.0, 2: 16.0}


@pytest.fixture
def rng(request):
    return rng_for_test(request)  # seeds.py


@pytest.fixture(scope="module")
def tri():
    be = several_tiles(TritonBackend(preset_config("test"), device=DEVICE, dot_precision="bf16x3"))
    be.moe_int16 = True
    be.moe_down_i8 = True
    return be


def _step(h, rows, F, planes):
    """Half the quantisation step of each value of h [rows, F]: max|h| of its 256-value chunk
    over 2·Q_MAX (q = round(h·s), s = Q_MAX / max|h|)."""
    cmax = np.abs(h.astype(np.float64)).reshape(rows, F // 256, 256).max(axis=2)
    return np.repeat(cmax, 256, axis=1) / (2.0 * Q_MAX[planes])


@pytest.mark.parametrize("planes", [3, 2])
def test_split8_digits_rebuild_h(tri, rng, planes):
    """The digits are int8 in [−128, 127], 65536·p2 + 256·p1 + p0 = q (two planes: 256·p1 + p0)
    with |q| ≤ Q_MAX, q·(1/s) is h to half a step of its chunk; the 16-value sums of q come back
    from hi + lo to 2^-22 (exactly with two planes); a zero row stays zero."""
    rows, F = 24, 512
    h = _activations(rows, F, rng)
    tri.mm8_planes = planes
    p0, p1, p2, xi, gh, gl = [t.cpu().numpy() for t in tri._split8(torch.from_numpy(h).to(tri.dev))]
    assert p0.dtype == p1.dtype == p2.dtype == np.int8
    q = 256 * p1.astype(np.int64) + p0.astype(np.int64)
    if planes == 3:
        q += 65536 * p2.astype(np.int64)
    assert np.abs(q).max() == Q_MAX[planes]  # each non-zero chunk's largest value takes the whole range
    back = q * np.repeat(xi.astype(np.float64), 256, axis=1)
    h64 = h.astype(np.float64)
    # half a step, and float32's rounding of h·s (2^-24 of X8_MAX < 2^23) and of s itself
    assert np.all(np.abs(back - h64) <= _step(h, rows, F, planes) * (1.0 + 1e-3) + 2.0 ** -22 * np.abs(h64))
    sums = q.reshape(rows, F // 16, 16).sum(axis=2)
    back_sums = (gh.astype(np.float64) + gl.astype(np.float64)) * G_SHIFT[planes]
    assert np.all(np.abs(back_sums - sums) <= (2.0 ** -22 if planes == 3 else 0.0) * np.abs(sums))
    assert not q[0].any() and not xi[0].any()


def test_split8_refuses_other_plane_counts(tri):
    tri.mm8_planes = 4
    with pytest.raises(ValueError, match=r"mm8_planes: expected one of \(3, 2\), got 4"):
        tri._split8(torch.zeros((2, 256), dtype=torch.float32, device=tri.dev))


def test_split8_keeps_tiny_chunks_finite(tri):
    """A chunk whose values are far below float32's normal range over Q_MAX still splits: its
    scale is capped at 2^126, so its digits rebuild it (to half a step of 2^-126) and zeros stay
    zero, where an unbounded scale overflowed to inf (zeros then became NaN)."""
    h = np.zeros((2, 256), np.float32)
    h[0, :2] = (1.0e-33, 3.3e-34)
    h[1, :3] = (-2.0e-38, 5.0e-39, 0.0)
    for planes in (3, 2):
        tri.mm8_planes = planes
        p0, p1, p2, xi, gh, gl = [t.cpu().numpy() for t in tri._split8(torch.from_numpy(h).to(tri.dev))]
        q = 256 * p1.astype(np.int64) + p0.astype(np.int64) + (65536 * p2.astype(np.int64) if planes == 3 else 0)
        back = q * np.repeat(xi.astype(np.float64), 256, axis=1)
        assert np.isfinite(xi).all() and np.all(xi > 0)
        assert np.all(np.abs(back - h.astype(np.float64)) <= 0.5 * 2.0 ** -126 * (1 + 1e-6)), planes
        assert not q[:, 3:].any()


@pytest.mark.parametrize("planes", [3, 2])
def test_down_q2k_int8(tri, rng, planes):
    """out[a] = down_e·h[a] for expert-sorted assignments, E not a multiple of the row block:
    the error stays within what rounding h to its chunk's step allows (Σ|w|·step) plus the fp16
    path's float32 bound on Σ|w|·|h|."""
    NE, F, E, n, k = 3, 512, 80, 30, 3
    down, D, Dm = _experts(tri, T.Q2_K, F, E, NE, rng, terms=True)
    h = _activations(n * k, F, rng)
    ids = np.stack([rng.choice(NE, k, replace=False) for _ in range(n)])
    order, T_, te, tr0, tend = _schedule(tri, ids, NE)
    hs = h[order]
    tri.mm8_planes = planes
    p0, p1, p2, hi, gh, gl = tri._split8(torch.from_numpy(hs).to(tri.dev))
    out = torch.zeros((n * k, E), dtype=torch.float32, device=tri.dev)
    BN, KS, warps, stages = tri.mm8_tile
    tri._launch(K8.moe_down_mm8_kernel, (T_, _cdiv(E, BN)), p0, hi, gh, gl, te, tr0, tend,
                down.f32.view(torch.int32), down.b8.view(torch.int32), down.i16, out, E, F, down.RB, E * down.RB, p0.numel(),
                BM=tri.moe16_bm, BN=BN, KS=KS, PLANES=planes, num_warps=warps, num_stages=stages)
    e = ids.reshape(-1)[order]
    h64 = hs.astype(np.float64)
    want = np.einsum("aek,ak->ae", D[e], h64)
    got = out.cpu().numpy().astype(np.float64)
    bound = np.einsum("aek,ak->ae", Dm[e], _step(hs, n * k, F, planes)) \
        + TOL * np.einsum("aek,ak->ae", Dm[e], np.abs(h64)).max(axis=1, keepdims=True)
    assert np.isfinite(got).all()
    assert np.all(np.abs(got - want) <= bound)
    # rows of ordinary range (past the zero row and the one with a huge element) against Σ|w|·|h|
    top = {3: 2.0 ** -14, 2: 2.0 ** -6}[planes]
    assert _rel_rows(got[2:], want[2:], np.einsum("aek,ak->ae", Dm[e], np.abs(h64))[2:]) < top


@pytest.mark.parametrize("planes", [3, 2])
def test_moe_prefill_end_to_end_int8_down(tri, rng, planes):
    """backend.moe on the prefill branch with the int8 down against a float64 evaluation of the
    layer (activations of ordinary range: h's rounding to its chunk's step then stays within
    2^-14 of Σ|w|·|h| with three planes, 2^-8 with two)."""
    tri.mm8_planes = planes
    got, want, scale, ran = _moe_layer(tri, rng, NE=5, n=20)
    assert "moe_down_mm8_kernel" in ran and "split8_kernel" in ran and "moe_down_mm16_kernel" not in ran, ran
    assert _rel_rows(got, want, scale) < {3: 2.0 ** -14, 2: 2.0 ** -8}[planes]


# tiles of 128 assignments on 8 warps (moe16_bm 128), which a prompt's FFN groups can fill (an
# expert gets about 192 assignments at 8192 rows): not the default (slower on the H100, "What was
# tried" in bench/triton/README.md), but a setting the benchmarks' variants take
TILES_128 = dict(moe16_bm=128, moe16_tile={"gateup": (64, 128, 8, 1), "down": (64, 128, 8, 1)},
                 mm8_tile=(64, 128, 8, 1))


@pytest.mark.parametrize("down_i8", [True, False])
def test_moe_prefill_at_128_assignment_tiles(tri, rng, monkeypatch, down_i8):
    """backend.moe with 128-assignment tiles on 8 warps (the int8 down, and the fp16 one) against
    a float64 evaluation of the layer, each expert's 140 assignments in a full tile and a
    partial one."""
    for name, v in {**TILES_128, "moe_down_i8": down_i8, "mm8_planes": 3}.items():
        monkeypatch.setattr(tri, name, v)  # (tri is the module's: restored after the test)
    got, want, scale, ran = _moe_layer(tri, rng, NE=2, n=140)
    assert ("moe_down_mm8_kernel" in ran) == down_i8 and ("moe_down_mm16_kernel" in ran) != down_i8, ran
    assert _rel_rows(got, want, scale) < (2.0 ** -14 if down_i8 else TOL)


def test_int8_down_compiles_for_sm90_to_int8_wgmma():
    """The default tile compiles for sm_90 (loads aligned as a launch specialises them) to int8
    tensor-core products: in a K-step, the top two digit planes in one product of twice the rows
    and, with three planes, the lowest in one of its own; the fp16 ones of the min term come once
    per super-block."""
    from ds4.backends.triton.tuning import TritonTuning

    BN, KS, warps, stages = TritonTuning().mm8_tile
    types = {"p_ptr": "*i8", "gh_ptr": "*fp16", "gl_ptr": "*fp16",
             "tile_e_ptr": "*i32", "tile_r0_ptr": "*i32", "tile_end_ptr": "*i32", "ww": "*i32", "ws": "*i32",
             "wh": "*i16"}
    aligned = tuple(types) + ("xi_ptr", "out_ptr", "E", "F", "RB", "EXP_BYTES", "PSTRIDE")
    cases = [("kernels_mm8", "moe_down_mm8_kernel", dict(BM=64, BN=BN, KS=KS, PLANES=planes), types,
              dict(num_warps=warps, num_stages=stages), aligned) for planes in (3, 2)]
    for planes, (ptx, shared) in zip((3, 2), compile_sm90(cases)):
        s8 = re.findall(r"wgmma\.mma_async\S*\.s32\.s8\.s8", ptx)
        f16 = re.findall(r"wgmma\.mma_async\S*\.f16\.f16", ptx)
        # (per 32 values of K, 64 rows an instruction: 2·BM rows, and BM more with three planes)
        assert len(s8) == (3 if planes == 3 else 2) * (KS // 32) and len(f16) == 2, (planes, len(s8), len(f16))
        assert 0 < shared
