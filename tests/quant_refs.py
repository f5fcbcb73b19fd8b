"""Quantized weights for the Triton kernel tests, with their independent reference: random valid
GGUF blocks uploaded to a backend beside gguf-py's float64 decode of the same bytes."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GQT
from gguf import quants as gq

from ds4.core.gguf_model import Tensor
from ds4.core.quants import GGMLType as T
from ds4.core.quants import random_blocks


def experts(tri, ttype, K, N, NE, rng, terms=False):
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
