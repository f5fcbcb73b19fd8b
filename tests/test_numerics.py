"""The ds4 numerics simulations of spec §3.10 (ds4/core/numerics.py) against hand-computed values.

Every expected value below is written out by hand from the format definitions:
* E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; normals 2^-6 .. 448, subnormals k·2^-9;
  so the spacing is 2^(e−3) in the binade [2^e, 2^(e+1)) and 2^-9 below 2^-6.
* E2M1: the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
* Both round to nearest, ties to the even code (the code whose last mantissa bit is 0).
* f16: 10 mantissa bits; spacing 2^-10 in [1, 2); max 65504; subnormals k·2^-24.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4.core import numerics as nx


def f32(*v) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def assert_exact(actual, expected) -> None:
    actual = np.asarray(actual)
    assert actual.dtype == np.float32
    np.testing.assert_array_equal(actual, np.asarray(expected, dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# E4M3FN rounding

E4M3_CASES = [
    # (input, expected) — representable values stay put
    (0.0, 0.0), (1.0, 1.0), (1.125, 1.125), (448.0, 448.0), (416.0, 416.0), (2.0 ** -6, 2.0 ** -6),
    (2.0 ** -9, 2.0 ** -9), (7 * 2.0 ** -9, 7 * 2.0 ** -9), (0.875, 0.875), (240.0, 240.0),
    # ties between two neighbours: the even code wins
    (1.0625, 1.0),           # 1 (m=000) | 1.125 (m=001)
    (1.1875, 1.25),          # 1.125 (m=001) | 1.25 (m=010)
    (1.9375, 2.0),           # 1.875 (m=111) | 2.0 (next binade, m=000)
    (400.0, 384.0),          # 384 (1.5·2^8, m=100) | 416 (m=101)
    (432.0, 448.0),          # 416 (m=101) | 448 (1.75·2^8, m=110)
    (17.0, 16.0),            # 16 (m=000) | 18 (m=001): spacing 2 in [16, 32)
    (19.0, 20.0),            # 18 (m=001) | 20 (m=010)
    (0.09375, 0.09375),      # 0.09375 = 1.5·2^-4, representable
    # subnormals (spacing 2^-9 = 0.001953125 below 2^-6)
    (2.0 ** -10, 0.0),       # 0 | 2^-9 (code 1): tie -> 0
    (3 * 2.0 ** -10, 2.0 ** -8),  # 2^-9 (code 1) | 2·2^-9 (code 2): tie -> 2^-8
    (5 * 2.0 ** -10, 2 * 2.0 ** -9),  # 2·2^-9 | 3·2^-9: tie -> even code 2
    (15 * 2.0 ** -10, 2.0 ** -6),  # 7·2^-9 (odd) | 8·2^-9 = 2^-6 (smallest normal)
    (0.4 * 2.0 ** -9, 0.0),  # below half the smallest subnormal
    (0.6 * 2.0 ** -9, 2.0 ** -9),
    (1.4 * 2.0 ** -9, 2.0 ** -9),
    # plain nearest
    (1.07, 1.125), (1.05, 1.0), (300.0, 288.0), (310.0, 320.0), (0.1, 0.1015625),
]


def test_e4m3_round_hand_values():
    x = f32(*[a for a, _ in E4M3_CASES])
    want = [b for _, b in E4M3_CASES]
    assert_exact(nx.e4m3_round(x), want)
    assert_exact(nx.e4m3_round(-x), [-b for b in want])  # sign-symmetric


def test_e4m3_round_is_idempotent_on_every_code():
    # all 126 positive finite E4M3FN values (exp field 0..15, mantissa 0..7, minus NaN 0x7F)
    codes = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN in E4M3FN
            codes.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    v = f32(*codes)
    assert v.max() == 448.0 and v[v > 0].min() == 2.0 ** -9
    assert_exact(nx.e4m3_round(v), v)
    # every midpoint between neighbours rounds to the neighbour with the even code
    mids = (v[:-1] + v[1:]) / 2
    even = np.where(np.arange(len(v) - 1) % 2 == 0, v[:-1], v[1:])
    assert_exact(nx.e4m3_round(mids), even)


# ---------------------------------------------------------------------------------------------
# E2M1 rounding


def test_e2m1_round_every_tie_and_sign():
    x = f32(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    want = f32(0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0)
    assert_exact(nx.e2m1_round(x), want)
    assert_exact(nx.e2m1_round(-x), -want)


def test_e2m1_round_grid_and_nearest():
    grid = f32(0, 0.5, 1, 1.5, 2, 3, 4, 6)
    assert_exact(nx.e2m1_round(grid), grid)
    assert_exact(nx.e2m1_round(-grid), -grid)
    x = f32(0.2, 0.3, 0.7, 0.8, 1.3, 1.8, 2.4, 2.6, 3.4, 3.6, 4.9, 5.1, 5.9)
    want = f32(0.0, 0.5, 0.5, 1.0, 1.5, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 6.0, 6.0)
    assert_exact(nx.e2m1_round(x), want)
    assert_exact(nx.e2m1_round(-x), -want)


# ---------------------------------------------------------------------------------------------
# FP8 K/V round trip: blocks of 64, scale = 2^ceil(log2(amax/448)), amax floored at 1e-4


def _row(n_nope: int, n_rot: int, fill: dict[int, float]) -> np.ndarray:
    r = np.zeros(n_nope + n_rot, dtype=np.float32)
    for i, v in fill.items():
        r[i] = v
    return r


def test_fp8_block_scale_one():
    # amax = 448 -> scale 2^ceil(log2 1) = 1: plain E4M3 rounding
    r = _row(64, 8, {0: 448.0, 1: 1.0625, 2: 1.1875, 3: -400.0, 4: 3 * 2.0 ** -10})
    out = nx.fp8_kv_roundtrip(r, 64)
    assert_exact(out, _row(64, 8, {0: 448.0, 1: 1.0, 2: 1.25, 3: -384.0, 4: 2.0 ** -8}))


def test_fp8_block_scale_just_above_448():
    # amax = 449 -> amax/448 > 1 -> scale 2: 449/2 = 224.5 -> 224 (spacing 16) -> 448;
    # 1/2 = 0.5 exact -> 1;  3/2 = 1.5 exact -> 3;  2.125/2 = 1.0625 tie -> 1 -> 2
    r = _row(64, 0, {0: 449.0, 1: 1.0, 2: 3.0, 3: 2.125})
    assert_exact(nx.fp8_kv_roundtrip(r, 64), _row(64, 0, {0: 448.0, 1: 1.0, 2: 3.0, 3: 2.0}))


def test_fp8_block_scale_power_of_two_boundary():
    # amax = 224 -> amax/448 = 0.5 exactly -> scale 2^-1 (not 2^0): 224/0.5 = 448 fits;
    # 1.0625/0.5 = 2.125 tie between 2 and 2.25 -> 2 -> 1.0
    r = _row(64, 0, {0: 224.0, 5: 1.0625})
    assert_exact(nx.fp8_kv_roundtrip(r, 64), _row(64, 0, {0: 224.0, 5: 1.0}))


def test_fp8_independent_blocks_and_untouched_rope_dims():
    # block 0: amax 448 (scale 1); block 1: amax 1 -> 1/448 = 2^-8.8 -> scale 2^-8:
    #   0.01/2^-8 = 2.56 -> 2.5 (spacing 0.25) -> 2.5·2^-8 = 0.009765625
    # rope dims (128..135) keep even values E4M3 cannot hold.
    rope = {128 + i: v for i, v in enumerate([1.0625, 1.1875, 1e-7, 449.0, -3.3, 0.1, 7.77, 2.0 ** -12])}
    r = _row(128, 8, {0: 448.0, 1: 0.01, 64: 1.0, 65: 0.01, **rope})
    # block 0's 0.01 with scale 1 is a subnormal: 0.01 = 5.12·2^-9 -> 5·2^-9
    want = _row(128, 8, {0: 448.0, 1: 5 * 2.0 ** -9, 64: 1.0, 65: 0.009765625, **rope})
    assert_exact(nx.fp8_kv_roundtrip(r, 128), want)


def test_fp8_amax_floor():
    # a block of tiny values: amax floored to 1e-4 -> 1e-4/448 = 2^-22.09 -> scale 2^-22;
    # 1e-6/2^-22 = 4.194 -> 4 (spacing 0.5) -> 2^-20;  3e-7/2^-22 = 1.258 -> 1.25 -> 1.25·2^-22
    r = _row(64, 0, {0: 1e-6, 1: -3e-7})
    assert_exact(nx.fp8_kv_roundtrip(r, 64), _row(64, 0, {0: 2.0 ** -20, 1: -1.25 * 2.0 ** -22}))
    # an all-zero block stays zero
    assert_exact(nx.fp8_kv_roundtrip(np.zeros((2, 64), np.float32), 64), np.zeros((2, 64)))


def test_fp8_leading_axes_and_input_untouched():
    rows = np.stack([_row(64, 4, {0: 449.0}), _row(64, 4, {0: 1.0625, 66: 1.0625})])
    before = rows.copy()
    out = nx.fp8_kv_roundtrip(rows[None], 64)
    assert out.shape == (1, 2, 68)
    # 1.0625 alone in its block: amax/448 = 2^-8.7 -> scale 2^-8; 1.0625·2^8 = 272 is the tie
    # between 256 (m=000) and 288 (m=001) in [256, 512) -> 256 -> 1.0. The rope dim 66 keeps 1.0625.
    assert_exact(out[0], np.stack([_row(64, 4, {0: 448.0}), _row(64, 4, {0: 1.0, 66: 1.0625})]))
    np.testing.assert_array_equal(rows, before)


# ---------------------------------------------------------------------------------------------
# Walsh–Hadamard


def sylvester(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def test_hadamard_small_vectors_by_hand():
    assert_exact(nx.hadamard(f32(3.0)), f32(3.0))
    np.testing.assert_allclose(nx.hadamard(f32(1, 2)), f32(3, -1) / np.sqrt(2), rtol=1e-7)
    # H4 = [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]] / 2
    assert_exact(nx.hadamard(f32(1, 2, 3, 4)), f32(5, -1, -2, 0))
    assert_exact(nx.hadamard(f32(1, 0, 0, 0)), f32(0.5, 0.5, 0.5, 0.5))
    assert_exact(nx.hadamard(f32(0, 1, 0, 0)), f32(0.5, -0.5, 0.5, -0.5))


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 128])
def test_hadamard_matches_sylvester_and_is_orthonormal(n):
    h = sylvester(n)
    np.testing.assert_array_equal(h @ h.T, n * np.eye(n))  # the test's own matrix is right
    x = np.random.default_rng(n).standard_normal((3, 2, n)).astype(np.float32)
    want = x.astype(np.float64) @ h.T / np.sqrt(n)
    np.testing.assert_allclose(nx.hadamard(x), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(nx.hadamard(nx.hadamard(x)), x, rtol=0, atol=1e-5)  # H·H = I
    # columns of the transform are the (normalised) Sylvester rows
    np.testing.assert_allclose(nx.hadamard(np.eye(n, dtype=np.float32)), h / np.sqrt(n), atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Indexer QAT: Hadamard, then E2M1 per 32-value block, scale 2^ceil(log2(amax/6))


def test_indexer_qat_on_a_hadamard_row():
    # x = row 5 of H128 (entries ±1) -> H·x/sqrt(128) = sqrt(128)·e5 = 11.3137…;
    # its block: amax/6 = 1.886 -> scale 2; 11.31/2 = 5.66 -> 6 -> 12. Other blocks are 0.
    x = sylvester(128)[5].astype(np.float32)
    want = np.zeros(128, np.float32)
    want[5] = 12.0
    assert_exact(nx.indexer_qat(x), want)


def test_indexer_fp4_block_scale(monkeypatch):
    # isolate the FP4 stage: with the Hadamard replaced by the identity, indexer_qat is the
    # pure per-32 round trip
    monkeypatch.setattr(nx, "hadamard", lambda x: np.array(x, dtype=np.float32))
    x = np.zeros(128, np.float32)
    # block 0: amax 6 -> scale 1 -> plain E2M1 (every tie)
    x[0:8] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, -3.5, 5]
    # block 1: amax 12 -> scale 2: 0.5->0.25->0; 1.5->0.75->1->2; 7->3.5->4->8; -12 stays
    x[32:36] = [-12, 0.5, 1.5, 7]
    # block 2: amax 6.5 -> 6.5/6 > 1 -> scale 2: 6.5->3.25->3->6; 1->0.5->1
    x[64:66] = [6.5, 1]
    # block 3: amax 3 -> 3/6 = 0.5 exactly -> scale 2^-1: 3->6->3; 0.3->0.6->0.5->0.25;
    #          0.375->0.75 tie->1->0.5
    x[96:99] = [3, 0.3, 0.375]
    want = np.zeros(128, np.float32)
    want[0:8] = [6, 0, 1, 1, 2, 2, -4, 4]
    want[32:36] = [-12, 0, 2, 8]
    want[64:66] = [6, 1]
    want[96:99] = [3, 0.25, 0.5]
    assert_exact(nx.indexer_qat(x), want)
    assert_exact(nx.indexer_qat(np.zeros((2, 64), np.float32)), np.zeros((2, 64)))  # amax floor


# ---------------------------------------------------------------------------------------------
# f16 rounding


def test_f16_round_hand_values():
    x = f32(1 + 2.0 ** -11,      # tie between 1 (even) and 1 + 2^-10 -> 1
            1 + 3 * 2.0 ** -11,  # tie between 1 + 2^-10 (odd) and 1 + 2^-9 -> 1 + 2^-9
            1 + 2.0 ** -10,      # representable
            1 + 1.1 * 2.0 ** -11,  # past the tie -> 1 + 2^-10
            2048 + 1,            # spacing 2 in [2048, 4096): tie -> 2048
            2048 + 3,            # tie -> 2052
            65504.0,             # max f16
            2.0 ** -24,          # smallest subnormal
            2.0 ** -25,          # tie with 0 -> 0
            3 * 2.0 ** -25)      # tie between 2^-24 (odd) and 2^-23 -> 2^-23
    want = f32(1, 1 + 2.0 ** -9, 1 + 2.0 ** -10, 1 + 2.0 ** -10, 2048, 2052, 65504,
               2.0 ** -24, 0, 2.0 ** -23)
    assert_exact(nx.f16_round(x), want)
    assert_exact(nx.f16_round(-x), -want)
    with np.errstate(over="ignore"):
        assert np.isinf(nx.f16_round(f32(65520.0))[0])  # halfway to 65536 overflows


# ---------------------------------------------------------------------------------------------
# The switch is live: numerics="ds4" vs "exact" on the test preset


@pytest.fixture(scope="module")
def test_model(tmp_path_factory):
    from ds4.core.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("numerics") / "test.gguf", preset="test")


def test_ds4_numerics_switch_changes_logits(test_model):
    import ds4

    prompt = np.random.default_rng(0).integers(2, 500, 40).tolist()
    out = {}
    for numerics in ("exact", "ds4"):
        eng = ds4.Engine.open(test_model, backend="reference", numerics=numerics)
        assert eng.numerics == numerics
        s = eng.session(ctx=128)
        s.sync(prompt)
        raw = eng.backend.state_to_numpy(s.states[0], "raw")[: len(prompt)]
        out[numerics] = (s.logits.copy(), raw, eng.config)

    (exact, raw_exact, cfg), (sim, raw_sim, _) = out["exact"], out["ds4"]
    assert np.isfinite(exact).all() and np.isfinite(sim).all()
    rel = np.abs(sim - exact).max() / np.abs(exact).max()
    assert rel > 1e-3, f"numerics='ds4' barely changes the logits (relative {rel:.1e})"
    assert rel < 0.5  # a simulation of rounding, not a different model

    # ds4 cache rows are f16 values already on the FP8 grid; exact ones are neither
    assert_exact(nx.f16_round(raw_sim), raw_sim)
    assert_exact(nx.fp8_kv_roundtrip(raw_sim, cfg.n_nope), raw_sim)
    assert not np.array_equal(nx.f16_round(raw_exact), raw_exact)
    assert not np.array_equal(nx.fp8_kv_roundtrip(raw_exact, cfg.n_nope), raw_exact)
