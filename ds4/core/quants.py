"""GGUF block formats used by DS4: one table, one small decoder per format.

Every GGUF tensor is a run of fixed-size blocks; a block of ``block_bytes`` bytes holds
``block_values`` values (plain types are "blocks" of one value). The layouts are ggml's,
little-endian (spec ``ds4-model.md`` §2.1). Decoders take ``[n_blocks, block_bytes]`` uint8
and return ``[n_blocks, block_values]`` float32 with numpy ops over all blocks at once.

The arithmetic of each decoder follows ggml's order of float32 operations (for example
``(d * sc) * q - dmin * m`` for the K formats), so our values are bit-identical to ggml
and to ``gguf.quants.dequantize``; the tests hold us to that.

Only the plain types and Q8_0 can be encoded (DS4 writes nothing else). Test weights in the
K / IQ formats are built directly as random valid blocks by ``random_blocks``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# The IQ2_XXS magnitude grid is constant data; we take it from gguf-py instead of pasting
# 2 KiB of hex here. gguf-py stores each grid value as a 2-bit code into (8, 25, 43).
from gguf.quants import IQ2_XXS as _GGUF_IQ2_XXS

QK_K = 256  # values per K / IQ super-block


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q8_0 = 8
    Q2_K = 10
    Q4_K = 12
    IQ2_XXS = 16
    I32 = 26
    BF16 = 30


# ---------------------------------------------------------------------------------------------
# Small helpers


def _f16(b: np.ndarray) -> np.ndarray:
    """Two little-endian bytes per row -> float32 column [n, 1]."""
    return b.view("<f2").astype(np.float32)


def _iq2xxs_grid() -> np.ndarray:
    """[256, 8] float32 magnitudes, unpacked from gguf-py's 2-bit code table."""
    packed = np.frombuffer(bytes.fromhex(_GGUF_IQ2_XXS.grid_hex.decode()), dtype=np.uint8)
    codes = (packed[:, None] >> np.arange(0, 8, 2, dtype=np.uint8)) & 3  # low bits first
    levels = np.asarray(_GGUF_IQ2_XXS.grid_map, dtype=np.float32)
    return levels[codes.reshape(256, 8)]


def _ksigns() -> np.ndarray:
    """7-bit sign index -> 8 sign bits: the eighth bit makes the count of negatives even,
    which is why 7 stored bits are enough for 8 signs."""
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(axis=1) & 1
    return i | (parity.astype(np.uint8) << 7)


IQ2XXS_GRID = _iq2xxs_grid()
IQ2XXS_KSIGNS = _ksigns()


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: halves go away from zero (numpy's ``round`` goes to even).
    ``a - floor(a)`` is exact, unlike ``a + 0.5`` which can round up 0.49999997."""
    a = np.abs(v)
    f = np.floor(a)
    return np.copysign(f + (a - f >= 0.5), v)


# ---------------------------------------------------------------------------------------------
# Decoders: [n_blocks, block_bytes] uint8 -> [n_blocks, block_values]


def _decode_f32(b: np.ndarray) -> np.ndarray:
    return b.view("<f4").astype(np.float32, copy=False)


def _decode_f16(b: np.ndarray) -> np.ndarray:
    return _f16(b)


def _decode_bf16(b: np.ndarray) -> np.ndarray:
    # bf16 is the top half of a float32
    return (b.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _decode_i32(b: np.ndarray) -> np.ndarray:
    return b.view("<i4").astype(np.int32, copy=False)


def _decode_q8_0(b: np.ndarray) -> np.ndarray:
    # f16 d | int8 q[32]
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b[:, :2])


def _decode_q2_k(b: np.ndarray) -> np.ndarray:
    # u8 scales[16] | u8 qs[64] | f16 d | f16 dmin. Sixteen sub-blocks of 16 values; the
    # 2-bit quants of value v sit in byte 32*(v//128) + v%32 at bit 2*((v%128)//32).
    n = b.shape[0]
    sc, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = (qs.reshape(n, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3
    q = q.reshape(n, 16, 16).astype(np.float32)
    dl = (d * (sc & 0xF).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _q4_k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins. Bytes 0-3 / 4-7 hold scales / mins
    0-3 in their low 6 bits; sub-blocks 4-7 take their low 4 bits from the nibbles of bytes
    8-11 (scale low, min high) and their top 2 bits from the spare top bits of bytes 0-7."""
    lo_sc, lo_m, nib = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (nib & 0xF) | ((lo_sc >> 6) << 4)], axis=1)
    m = np.concatenate([lo_m & 63, (nib >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return sc, m


def _decode_q4_k(b: np.ndarray) -> np.ndarray:
    # f16 d | f16 dmin | u8 scales[12] | u8 qs[128]. Eight sub-blocks of 32; each 32-byte
    # chunk of qs holds sub-block 2c in its low nibbles and 2c+1 in its high nibbles.
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _q4_k_scale_min(b[:, 4:16])
    q = (b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0xF
    q = q.reshape(n, 8, 32).astype(np.float32)
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * m.astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n, QK_K)


def _decode_iq2_xxs(b: np.ndarray) -> np.ndarray:
    # f16 d | 8 groups of 32 values, each two u32: word 0 = four grid indices (one byte per
    # 8 values), word 1 = four 7-bit sign indices (bits 0..27) and a 4-bit scale (bits 28..31).
    n = b.shape[0]
    d = _f16(b[:, :2])  # [n, 1]
    grid_idx = b[:, 2:].reshape(n, 8, 8)[:, :, :4]  # the little-endian bytes of word 0
    aux = b[:, 2:].view("<u4")[:, 1::2]  # word 1 of each group, [n, 8]
    db = d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25)
    sign_idx = (aux[:, :, None] >> np.arange(0, 28, 7, dtype=np.uint32)) & 0x7F  # [n, 8, 4]
    sign_bits = (IQ2XXS_KSIGNS[sign_idx][..., None] >> np.arange(8, dtype=np.uint8)) & 1
    sign = np.where(sign_bits == 1, np.float32(-1), np.float32(1))  # [n, 8, 4, 8]
    mag = IQ2XXS_GRID[grid_idx]  # [n, 8, 4, 8]
    return (db[:, :, None, None] * mag * sign).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# Encoders (float array with last axis a whole number of blocks -> [..., row_bytes] uint8)


def quantize_f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype="<f4").view(np.uint8)


def quantize_f16(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).astype("<f2")).view(np.uint8)


def quantize_bf16(x) -> np.ndarray:
    """float32 -> bf16, round to nearest even; NaN stays NaN (quiet bit forced, since plain
    truncation of a NaN with only low mantissa bits set would give inf)."""
    n = np.ascontiguousarray(x, dtype="<f4").view(np.uint32)
    rounded = (n.astype(np.uint64) + 0x7FFF + ((n >> 16) & 1)) >> 16
    quiet_nan = (n >> 16) | 0x40
    out = np.where((n & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded)
    return out.astype("<u2").view(np.uint8)


def quantize_i32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype="<i4").view(np.uint8)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Blocks of 32: d = amax/127 (stored as f16), q = roundf(x * (1/d)). Like ggml, the
    quants use the float32 d, not the f16-rounded one, so the bytes match ggml/gguf-py."""
    x = np.asarray(x, dtype=np.float32)
    _check_whole_blocks(GGMLType.Q8_0, x.shape[-1] if x.ndim else 1)
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = _round_half_away(blocks * inv_d).astype(np.int8)
    out = np.concatenate([d.astype("<f2").view(np.uint8), q.view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


# ---------------------------------------------------------------------------------------------
# Random valid blocks for formats we cannot encode. Each builder returns [n_blocks, block_bytes]
# uint8 with random quant fields and per-block f16 scales of order 1 (0.5..1.5, so the d field
# varies across blocks); random_blocks then rescales the f16 scale fields to the asked RMS.


def _random_q2_k(rng: np.random.Generator, n: int) -> np.ndarray:
    d = rng.uniform(0.5, 1.5, n)
    # E[sc*q] = 7.5*1.5 and E[m] = 7.5, so dmin ~ 1.5 d centres the values on zero
    dmin = d * rng.uniform(1.0, 2.0, n)
    return np.concatenate([
        rng.integers(0, 256, (n, 16), dtype=np.uint8),  # scale | min << 4
        rng.integers(0, 256, (n, 64), dtype=np.uint8),  # 2-bit quants
        d.astype("<f2").view(np.uint8).reshape(n, 2),
        dmin.astype("<f2").view(np.uint8).reshape(n, 2),
    ], axis=1)


def _random_q4_k(rng: np.random.Generator, n: int) -> np.ndarray:
    d = rng.uniform(0.5, 1.5, n)
    dmin = d * rng.uniform(6.0, 9.0, n)  # mean q is 7.5, so dmin ~ 7.5 d centres the values
    return np.concatenate([
        d.astype("<f2").view(np.uint8).reshape(n, 2),
        dmin.astype("<f2").view(np.uint8).reshape(n, 2),
        rng.integers(0, 256, (n, 12), dtype=np.uint8),  # every bit pattern is a valid scale set
        rng.integers(0, 256, (n, 128), dtype=np.uint8),
    ], axis=1)


def _random_iq2_xxs(rng: np.random.Generator, n: int) -> np.ndarray:
    d = rng.uniform(0.5, 1.5, n)
    # all 256 grid indices, all 128 sign indices and all 16 scales are valid
    words = rng.integers(0, 2**32, (n, 8, 2), dtype=np.uint32).astype("<u4")
    return np.concatenate([
        d.astype("<f2").view(np.uint8).reshape(n, 2),
        words.view(np.uint8).reshape(n, 64),
    ], axis=1)


# ---------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class BlockFormat:
    type: GGMLType
    name: str
    block_values: int
    block_bytes: int
    decode: Callable[[np.ndarray], np.ndarray] = field(repr=False, compare=False, default=None)
    encode: Callable[[np.ndarray], np.ndarray] | None = field(repr=False, compare=False, default=None)
    # byte offsets of the f16 super-block scales (d, dmin): the fields random_blocks rescales
    scale_offsets: tuple[int, ...] = ()
    random: Callable[[np.random.Generator, int], np.ndarray] | None = field(
        repr=False, compare=False, default=None)


FORMATS: dict[GGMLType, BlockFormat] = {f.type: f for f in [
    BlockFormat(GGMLType.F32, "F32", 1, 4, _decode_f32, quantize_f32),
    BlockFormat(GGMLType.F16, "F16", 1, 2, _decode_f16, quantize_f16),
    BlockFormat(GGMLType.BF16, "BF16", 1, 2, _decode_bf16, quantize_bf16),
    BlockFormat(GGMLType.I32, "I32", 1, 4, _decode_i32, quantize_i32),
    BlockFormat(GGMLType.Q8_0, "Q8_0", 32, 34, _decode_q8_0, quantize_q8_0, (0,)),
    BlockFormat(GGMLType.Q2_K, "Q2_K", QK_K, 84, _decode_q2_k, None, (80, 82), _random_q2_k),
    BlockFormat(GGMLType.Q4_K, "Q4_K", QK_K, 144, _decode_q4_k, None, (0, 2), _random_q4_k),
    BlockFormat(GGMLType.IQ2_XXS, "IQ2_XXS", QK_K, 66, _decode_iq2_xxs, None, (0,), _random_iq2_xxs),
]}


def block_format(t) -> BlockFormat:
    try:
        return FORMATS[GGMLType(int(t))]
    except (ValueError, KeyError):
        supported = ", ".join(f"{f.name}={int(f.type)}" for f in FORMATS.values())
        raise ValueError(f"unsupported GGML type id {int(t)}; DS4 uses {supported}") from None


def _check_whole_blocks(t, n_values: int) -> BlockFormat:
    f = block_format(t)
    if n_values % f.block_values:
        raise ValueError(f"{f.name}: {n_values} values is not a whole number of "
                         f"{f.block_values}-value blocks")
    return f


def row_bytes(t, n_values: int) -> int:
    f = _check_whole_blocks(t, n_values)
    return n_values // f.block_values * f.block_bytes


# ---------------------------------------------------------------------------------------------
# Public decode / encode


def _as_bytes(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return np.frombuffer(data, dtype=np.uint8)


def dequantize(data, t, n_values: int | None = None) -> np.ndarray:
    """Whole blocks of type ``t`` -> flat float32 (int32 for I32). ``n_values``, when given,
    must match the byte length exactly. F32 and I32 come back as a view of ``data`` (no copy:
    these are memory-mapped weights), so copy before writing into the result."""
    f = block_format(t)
    raw = _as_bytes(data)
    if n_values is not None and raw.size != row_bytes(f.type, n_values):
        raise ValueError(f"{f.name}: {n_values} values need {row_bytes(f.type, n_values)} "
                         f"bytes, got {raw.size}")
    if raw.size % f.block_bytes:
        raise ValueError(f"{f.name}: {raw.size} bytes is not a whole number of "
                         f"{f.block_bytes}-byte blocks")
    return f.decode(raw.reshape(-1, f.block_bytes)).reshape(-1)


def dequantize_rows(data_2d_uint8: np.ndarray, t, n_cols: int) -> np.ndarray:
    """[rows, row_bytes(t, n_cols)] uint8 -> [rows, n_cols]."""
    rb = row_bytes(t, n_cols)
    a = np.asarray(data_2d_uint8)
    if a.ndim != 2 or a.shape[1] != rb:
        raise ValueError(f"{block_format(t).name}: rows of {n_cols} values need shape "
                         f"[rows, {rb}], got {list(a.shape)}")
    return dequantize(a, t).reshape(a.shape[0], n_cols)


def encode(x: np.ndarray, t) -> np.ndarray:
    """Encode ``x`` (last axis a whole number of blocks) -> uint8 [..., row_bytes]."""
    f = block_format(t)
    if f.encode is None:
        raise ValueError(f"{f.name} cannot be encoded here (no quantizer); "
                         f"use random_blocks for test data")
    x = np.atleast_1d(np.asarray(x))
    _check_whole_blocks(t, x.shape[-1])
    return f.encode(x).reshape(*x.shape[:-1], row_bytes(t, x.shape[-1]))


def random_blocks(t, n_values: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Valid random blocks (flat uint8) whose values have RMS about ``scale`` and are finite.
    I32 has no magnitude: it gives random non-negative ids below 2**16."""
    f = _check_whole_blocks(t, n_values)
    if f.type == GGMLType.I32:
        return quantize_i32(rng.integers(0, 2**16, n_values))
    if f.random is None:
        return encode((rng.standard_normal(n_values) * scale).astype(np.float32), f.type)
    blocks = f.random(rng, n_values // f.block_values)
    rms = float(np.sqrt(np.mean(np.square(f.decode(blocks), dtype=np.float64))))
    # every value is linear in (d, dmin) together, so one factor on both sets the RMS
    factor = scale / rms if rms > 0 else 0.0
    for off in f.scale_offsets:
        fld = blocks[:, off:off + 2]
        fld[:] = (_f16(fld) * np.float32(factor)).astype("<f2").view(np.uint8)
    return blocks.reshape(-1)
