"""ds4.core.quants against gguf-py (the independent reference) and hand-built blocks.

Decoded floats are compared bit for bit (as uint32): our decoders do ggml's float32 operations
in ggml's order, so no tolerance is needed, and a bitwise compare also catches -0.0 vs 0.0.
"""

import struct

import gguf.quants as gq
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQT
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.core import quants as q
from ds4.core.quants import GGMLType as T

FLOAT_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS]
ENCODABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.I32]
SEEDS = [0, 1, 2, 3, 4]


def reference(raw: np.ndarray, t: T) -> np.ndarray:
    if t == T.I32:  # gguf-py has no I32 dequantizer; it is a plain little-endian int32 array
        return np.frombuffer(raw.tobytes(), dtype="<i4")
    return np.asarray(gq.dequantize(raw, GQT(int(t))), dtype=np.float32).reshape(-1)


def assert_bitwise_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# decoders == gguf-py


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("t", FLOAT_TYPES + [T.I32], ids=lambda t: t.name)
def test_random_blocks_decode_like_gguf(t, seed):
    n_values = 4096
    raw = q.random_blocks(t, n_values, np.random.default_rng(seed))
    ours = q.dequantize(raw, t)
    assert ours.dtype == (np.int32 if t == T.I32 else np.float32)
    assert ours.shape == (n_values,)
    assert_bitwise_equal(ours, reference(raw, t))


@settings(max_examples=40, deadline=None)
@given(t=st.sampled_from(FLOAT_TYPES), seed=st.integers(0, 2**32 - 1), n_blocks=st.integers(1, 24))
def test_arbitrary_bytes_decode_like_gguf(t, seed, n_blocks):
    # Every byte pattern, scales included (inf/nan/subnormal f16 d), decodes identically.
    f = q.block_format(t)
    raw = np.random.default_rng(seed).integers(0, 256, n_blocks * f.block_bytes, dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 from random f16 scales
        assert_bitwise_equal(q.dequantize(raw, t), reference(raw, t))


def test_input_kinds_agree():
    raw = q.random_blocks(T.Q4_K, 512, np.random.default_rng(7))
    flat = q.dequantize(raw, T.Q4_K)
    for data in (raw.tobytes(), memoryview(raw.tobytes()), raw.reshape(4, -1)):
        np.testing.assert_array_equal(q.dequantize(data, T.Q4_K, 512), flat)


def test_iq2_xxs_tables_match_gguf():
    gq.IQ2_XXS.init_grid()
    np.testing.assert_array_equal(q.IQ2XXS_GRID, gq.IQ2_XXS.grid.reshape(256, 8))
    np.testing.assert_array_equal(q.IQ2XXS_KSIGNS, np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8))


# ---------------------------------------------------------------------------------------------
# encoders


def tricky_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32) * np.float32(0.05)
    x[:64] = (np.arange(64) - 32 + 0.5).astype(np.float32)  # amax 31.5 -> halves after scaling
    x[64:96] = 0.0  # an all-zero Q8_0 block (d = 0)
    x[96:128] = np.arange(-127, 129, 8)  # amax 127 -> exact .5 ties are impossible, exact ints
    return x


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16, T.Q8_0], ids=lambda t: t.name)
def test_encoders_match_gguf_bytes(t, seed):
    x = tricky_floats(np.random.default_rng(seed), 4096).reshape(4, 1024)
    ours = q.encode(x, t)
    assert ours.dtype == np.uint8 and ours.shape == (4, q.row_bytes(t, 1024))
    ref = np.ascontiguousarray(gq.quantize(x, GQT(int(t)))).view(np.uint8)
    np.testing.assert_array_equal(ours, ref)


def test_bf16_special_values_match_gguf():
    # nan payloads, infinities, the largest finite float (rounds to inf) and rounding ties
    bits = np.array([0x7FC00000, 0x7F800001, 0xFF800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF,
                     0x3F808000, 0x3F818000, 0x3F80FFFF, 0x80000000, 0x00000001], dtype=np.uint32)
    x = bits.view(np.float32)
    np.testing.assert_array_equal(q.quantize_bf16(x), gq.quantize(x, GQT.BF16).view(np.uint8))


def test_q8_0_rounds_half_away_from_zero():
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2], x[3] = 127.0, 2.5, -2.5, 0.49999997  # d = 1 exactly
    got = q.quantize_q8_0(x)[2:].view(np.int8)
    assert list(got[:4]) == [127, 3, -3, 0]


@pytest.mark.parametrize("t", ENCODABLE, ids=lambda t: t.name)
def test_encode_round_trip(t):
    rng = np.random.default_rng(11)
    if t == T.I32:
        x = rng.integers(-2**31, 2**31, 1024).astype(np.int32)
        np.testing.assert_array_equal(q.dequantize(q.encode(x, t), t), x)
        return
    x = (rng.standard_normal(1024) * 0.3).astype(np.float32)
    y = q.dequantize(q.encode(x, t), t)
    if t == T.Q8_0:
        # half a quant step, plus the f16 rounding of d (<= 2^-11 relative) times |q| <= 127
        d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
        bound = d * (0.5 + 127 * 2.0**-11) * 1.0001
        assert np.all(np.abs(y - x).reshape(-1, 32) <= bound)
    else:
        # half an ulp relative, plus half the smallest f16 subnormal (2^-24) for tiny values
        rel, floor = {T.F32: (0.0, 0.0), T.F16: (2.0**-11, 2.0**-25), T.BF16: (2.0**-8, 0.0)}[t]
        assert np.all(np.abs(y - x) <= rel * np.abs(x) + floor)


def test_encode_refuses_k_and_iq_types():
    for t in (T.Q2_K, T.Q4_K, T.IQ2_XXS):
        with pytest.raises(ValueError, match="cannot be encoded.*random_blocks"):
            q.encode(np.zeros(256, np.float32), t)


# ---------------------------------------------------------------------------------------------
# random_blocks


@pytest.mark.parametrize("scale", [1e-3, 0.02, 1.0])
@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_random_blocks_magnitude(t, scale):
    for seed in SEEDS:
        raw = q.random_blocks(t, 2048, np.random.default_rng(seed), scale=scale)
        assert raw.dtype == np.uint8 and raw.shape == (q.row_bytes(t, 2048),)
        y = q.dequantize(raw, t)
        assert np.all(np.isfinite(y))
        rms = float(np.sqrt(np.mean(y.astype(np.float64) ** 2)))
        assert scale / 3 <= rms <= 3 * scale, (t.name, seed, rms)


def test_random_blocks_deterministic_and_varied():
    a = q.random_blocks(T.Q2_K, 1024, np.random.default_rng(5))
    b = q.random_blocks(T.Q2_K, 1024, np.random.default_rng(5))
    c = q.random_blocks(T.Q2_K, 1024, np.random.default_rng(6))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    d = a.reshape(-1, 84)[:, 80:82].copy().view("<f2")  # per-block d differs between blocks
    assert len(np.unique(d)) > 1


# ---------------------------------------------------------------------------------------------
# rows, sizes, errors


@pytest.mark.parametrize("t", FLOAT_TYPES + [T.I32], ids=lambda t: t.name)
def test_dequantize_rows(t):
    rows, cols = 3, 512
    raw = q.random_blocks(t, rows * cols, np.random.default_rng(3))
    out = q.dequantize_rows(raw.reshape(rows, -1), t, cols)
    assert out.shape == (rows, cols)
    np.testing.assert_array_equal(out, q.dequantize(raw, t).reshape(rows, cols))
    with pytest.raises(ValueError) as e:
        q.dequantize_rows(raw.reshape(rows, -1), t, 2 * cols)
    assert f"[rows, {q.row_bytes(t, 2 * cols)}]" in str(e.value)
    assert f"[{rows}, {q.row_bytes(t, cols)}]" in str(e.value)


def test_row_bytes():
    assert q.row_bytes(T.Q8_0, 4096) == 128 * 34
    assert q.row_bytes(T.Q2_K, 4096) == 16 * 84
    assert q.row_bytes(T.Q4_K, 256) == 144
    assert q.row_bytes(T.IQ2_XXS, 512) == 132
    assert q.row_bytes(T.F16, 7) == 14
    assert q.row_bytes(T.BF16, 3) == 6
    assert q.row_bytes(26, 6) == 24  # plain ints work as type ids
    for t, f in q.FORMATS.items():
        assert f.type == t and f.name == t.name


def test_row_bytes_rejects_partial_block():
    with pytest.raises(ValueError) as e:
        q.row_bytes(T.Q4_K, 300)
    assert "300" in str(e.value) and "256" in str(e.value) and "Q4_K" in str(e.value)


@pytest.mark.parametrize("bad", [2, 6, 99])
def test_unsupported_type_id(bad):
    for call in (lambda: q.block_format(bad), lambda: q.row_bytes(bad, 32),
                 lambda: q.dequantize(b"\0" * 34, bad)):
        with pytest.raises(ValueError, match=rf"unsupported GGML type id {bad}\b"):
            call()


def test_dequantize_rejects_wrong_length():
    raw = q.random_blocks(T.Q8_0, 64, np.random.default_rng(0))
    with pytest.raises(ValueError) as e:
        q.dequantize(raw[:-1], T.Q8_0)
    assert "67" in str(e.value) and "34" in str(e.value)
    with pytest.raises(ValueError) as e:
        q.dequantize(raw, T.Q8_0, n_values=96)
    assert "102" in str(e.value) and "68" in str(e.value)


# ---------------------------------------------------------------------------------------------
# hand-built blocks


def test_q8_0_hand_block():
    qs = list(range(-16, 16))
    raw = struct.pack("<e32b", 0.5, *qs)
    assert len(raw) == 34
    np.testing.assert_array_equal(q.dequantize(raw, T.Q8_0), np.array(qs, np.float32) * 0.5)


def test_q2_k_hand_block():
    # value v: sub-block v//16 (scale = low nibble, min = high nibble of scales[v//16]);
    # 2-bit quant at byte 32*(v//128) + v%32, bits 2*((v%128)//32).
    scales = [0] * 16
    scales[0] = 0x23  # scale 3, min 2
    scales[1] = 0x10  # scale 0, min 1
    scales[2] = 0x01
    scales[4] = 0x02
    scales[6] = 0x51  # scale 1, min 5
    scales[10] = 0x04
    qs = [0] * 64
    qs[0] = 0b11_10_01_00  # v=0 -> 0, v=32 -> 1, v=64 -> 2, v=96 -> 3
    qs[1] = 0b00_00_00_11  # v=1 -> 3
    qs[32] = 0b00_00_11_00  # v=160 -> 3
    raw = struct.pack("<16B64Bee", *scales, *qs, 1.0, 0.5)  # d = 1, dmin = 0.5
    assert len(raw) == 84

    want = np.zeros(256, np.float32)
    want[0:16] = -1.0  # 3*0 - 0.5*2
    want[1] = 8.0  # 3*3 - 0.5*2
    want[16:32] = -0.5  # 0 - 0.5*1
    want[32] = 1.0  # 1*1
    want[64] = 4.0  # 2*2
    want[96:112] = -2.5  # 1*0 - 0.5*5 ...
    want[96] = 0.5  # ... except q=3 at v=96
    want[160] = 12.0  # 4*3
    np.testing.assert_array_equal(q.dequantize(raw, T.Q2_K), want)
