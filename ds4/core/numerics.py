"""The ds4-specific numerics simulations of spec §3.10, in numpy.

ds4 reproduces the official DeepSeek graph's low-precision caches in float32: an FP8-E4M3 round
trip of the non-RoPE K/V dims, a Hadamard + FP4-E2M1 round trip of the indexer's queries and keys,
and f16 rounding of cache rows. These functions are the definition every backend is tested against.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 64
FP4_BLOCK = 32


def _pow2_ceil_log2(v: np.ndarray) -> np.ndarray:
    """2**ceil(log2(v)) for v > 0, exactly (frexp avoids log2's rounding at powers of two)."""
    m, e = np.frexp(v)
    return np.ldexp(np.ones_like(v), np.where(m == 0.5, e - 1, e))


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """Round to the nearest E4M3FN value (ties to even code); |x| must already be ≤ 448."""
    x = np.asarray(x, dtype=np.float32)
    ax = np.abs(x)
    _, e = np.frexp(ax)  # ax = m·2^e, m in [0.5, 1)  ⇒  the binade's exponent is e−1
    # 3 mantissa bits: step 2^(e−1−3); subnormals (below 2^-6) share the step 2^-9.
    step = np.ldexp(np.ones_like(ax), np.maximum(e - 4, -9))
    return (np.round(x / step) * step).astype(np.float32)


def e2m1_round(x: np.ndarray) -> np.ndarray:
    """Round to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (ties to even code); |x| ≤ 6."""
    x = np.asarray(x, dtype=np.float32)
    ax = np.abs(x)
    step = np.where(ax < 2, 0.5, np.where(ax < 4, 1.0, 2.0)).astype(np.float32)
    return (np.round(x / step) * step).astype(np.float32)


def fp8_kv_roundtrip(kv: np.ndarray, n_nope: int) -> np.ndarray:
    """FP8 simulation of dims [0, n_nope) of each row in blocks of 64 (§3.4 step 5)."""
    kv = np.array(kv, dtype=np.float32, copy=True)
    lead = kv.shape[:-1]
    blocks = kv[..., :n_nope].reshape(*lead, n_nope // FP8_BLOCK, FP8_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=-1, keepdims=True), np.float32(1e-4))
    s = _pow2_ceil_log2(amax / np.float32(E4M3_MAX)).astype(np.float32)
    q = e4m3_round(np.clip(blocks / s, -E4M3_MAX, E4M3_MAX)) * s
    kv[..., :n_nope] = q.reshape(*lead, n_nope)
    return kv


def hadamard(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh–Hadamard transform over the last axis (power-of-two length)."""
    x = np.array(x, dtype=np.float32, copy=True)
    n = x.shape[-1]
    h = 1
    while h < n:  # butterflies: (a, b) -> (a + b, a − b) on pairs h apart
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        x = y.reshape(*x.shape[:-1], n)
        h *= 2
    return x * np.float32(1.0 / np.sqrt(n))


def indexer_qat(x: np.ndarray) -> np.ndarray:
    """Hadamard, then an FP4-E2M1 round trip per 32-value block (§3.6)."""
    x = hadamard(x)
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, d // FP4_BLOCK, FP4_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=-1, keepdims=True), np.float32(7.05e-38))
    s = _pow2_ceil_log2(amax / np.float32(E2M1_MAX)).astype(np.float32)
    q = e2m1_round(np.clip(blocks / s, -E2M1_MAX, E2M1_MAX)) * s
    return q.reshape(*lead, d).astype(np.float32)


def f16_round(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
