"""The ds4 numerics simulations (spec §3.10) in MLX ops, bit-identical to ds4/core/numerics.py.

Every step is an exact float32 operation or one correctly rounded one, so the results match the
numpy definitions bit for bit (the tests hold us to that on random inputs, exact ties and
subnormals included):

* powers of two are built from exponent bits (never `log2`, which rounds at powers of two);
* no division at all: the block scale 2^ceil(log2(amax / limit)) is found by exact comparisons
  (`pow2_scale`), and dividing by a power of two is a multiplication by its exact inverse, so
  the results do not depend on how a device rounds a quotient (Metal's fast math may not);
* `mx.round` rounds halves to even like `np.round`;
* the Hadamard transform is the same butterfly sequence as numpy's, ending with the same
  float32 constant 1/sqrt(n).
"""

from __future__ import annotations

import numpy as np

import mlx.core as mx

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 64
FP4_BLOCK = 32

_MIN_NORMAL = float(np.finfo(np.float32).tiny)  # 2^-126
_TWO_64 = float(2.0 ** 64)
_TWO_M64 = float(2.0 ** -64)


def _biased_exponent(x: mx.array) -> mx.array:
    """The 8 exponent bits of float32 x, as int32 (0 for zero and subnormals)."""
    return ((x.view(mx.uint32) >> 23) & 0xFF).astype(mx.int32)


def _pow2(e: mx.array) -> mx.array:
    """2**e for integer e in the normal range [-126, 127], exactly."""
    return ((e + 127).astype(mx.uint32) << 23).view(mx.float32)


def pow2_ceil_log2(v: mx.array) -> mx.array:
    """2**ceil(log2(v)) for v > 0, exactly. Subnormals are scaled into the normal range by
    2^64 first (exact) and the power of two scaled back (exact: the result is ≥ 2^-149)."""
    tiny = v < _MIN_NORMAL
    w = mx.where(tiny, v * _TWO_64, v)
    bits = w.view(mx.uint32)
    e = ((bits >> 23) & 0xFF).astype(mx.int32) - 127  # w = 1.f · 2^e
    exact = (bits & 0x7FFFFF) == 0  # w is a power of two already
    r = _pow2(mx.where(exact, e, e + 1))
    return mx.where(tiny, r * _TWO_M64, r)


def pow2_scale(amax: mx.array, limit: float) -> mx.array:
    """2**ceil(log2(fl(amax / limit))) — numpy's block scale — for normal amax > 0, exactly.

    With P a power of two and the quotient normal,
    fl(amax/limit) ≤ P ⟺ amax/limit ≤ P·(1+2^-24) ⟺ amax ≤ limit·P (limit·P is a float and the next float above it lies further than
    limit·P·2^-24 away). With c = 2^ceil(log2 amax) and limit = m·2^e (m in [1, 2)), the answer
    is P1 = c·2^-(e+1) if limit·P1 ≥ amax, else 2·P1. Quotients below 2^-126 (only for amax
    under limit·2^-126) round on a fixed grid instead: those few divide."""
    e = int(np.frexp(np.float32(limit))[1]) - 1
    down = float(2.0 ** -(e + 1))
    # scale after rounding up small amax (a subnormal product would lose bits), before for huge
    # amax (2^ceil(log2 amax) may be 2^128)
    p1 = mx.where(amax < _TWO_64, pow2_ceil_log2(amax) * down, pow2_ceil_log2(amax * down))
    s = mx.where(p1 * limit >= amax, p1, p1 * 2.0)
    tiny = amax < limit * _MIN_NORMAL
    return mx.where(tiny, pow2_ceil_log2(mx.maximum(amax / limit, 1e-45)), s)


def _inverse_pow2(s: mx.array) -> mx.array:
    """1/s for a power of two s in [2^-126, 2^126], exactly."""
    return _pow2(127 - _biased_exponent(s))


def e4m3_round(x: mx.array) -> mx.array:
    """Round to the nearest E4M3FN value (ties to even); |x| ≤ 448. Three mantissa bits: the step
    of the binade [2^k, 2^(k+1)) is 2^(k−3); subnormals (below 2^-6) share 2^-9."""
    k = _biased_exponent(mx.abs(x)) - 127  # −127 for 0 and float32 subnormals
    j = mx.maximum(k - 3, -9)
    return mx.round(x * _pow2(-j)) * _pow2(j)


def e2m1_round(x: mx.array) -> mx.array:
    """Round to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (ties to even); |x| ≤ 6."""
    ax = mx.abs(x)
    step = mx.where(ax < 2, 0.5, mx.where(ax < 4, 1.0, 2.0)).astype(mx.float32)
    inv = mx.where(ax < 2, 2.0, mx.where(ax < 4, 1.0, 0.5)).astype(mx.float32)
    return mx.round(x * inv) * step


def fp8_kv_roundtrip(kv: mx.array, n_nope: int) -> mx.array:
    """FP8 simulation of dims [0, n_nope) of each row in blocks of 64 (§3.4 step 5)."""
    lead = kv.shape[:-1]
    blocks = kv[..., :n_nope].reshape(*lead, n_nope // FP8_BLOCK, FP8_BLOCK)
    amax = mx.maximum(mx.abs(blocks).max(axis=-1, keepdims=True), mx.array(1e-4, mx.float32))
    s = pow2_scale(amax, E4M3_MAX)
    q = e4m3_round(mx.clip(blocks * _inverse_pow2(s), -E4M3_MAX, E4M3_MAX)) * s
    return mx.concatenate([q.reshape(*lead, n_nope), kv[..., n_nope:]], axis=-1)


def hadamard(x: mx.array) -> mx.array:
    """Orthonormal Walsh–Hadamard transform over the last axis (power-of-two length)."""
    lead, n = x.shape[:-1], x.shape[-1]
    h = 1
    while h < n:  # butterflies: (a, b) -> (a + b, a − b) on pairs h apart
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = mx.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        h *= 2
    return x * mx.array(np.float32(1.0 / np.sqrt(n)))


def indexer_qat(x: mx.array) -> mx.array:
    """Hadamard, then an FP4-E2M1 round trip per 32-value block (§3.6)."""
    x = hadamard(x)
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, d // FP4_BLOCK, FP4_BLOCK)
    amax = mx.maximum(mx.abs(blocks).max(axis=-1, keepdims=True), mx.array(7.05e-38, mx.float32))
    s = pow2_scale(amax, E2M1_MAX)
    q = e2m1_round(mx.clip(blocks * _inverse_pow2(s), -E2M1_MAX, E2M1_MAX)) * s
    return q.reshape(*lead, d)


def f16_round(x: mx.array) -> mx.array:
    return x.astype(mx.float16).astype(mx.float32)
