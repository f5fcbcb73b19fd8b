"""The Q8C chunk layout of Q8_0 rows on the Triton backend's device (ds4/backends/triton/layout.py),
against byte positions written out here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4.backends.triton.layout import Q8C, device_layout, q8_chunked, q8_chunks  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402


def _gguf_rows(rng, rows: int, K: int):
    """GGUF Q8_0 rows built block by block: (bytes, scales [rows, K/32] f16, quants [rows, K/32, 32])."""
    d = rng.uniform(0.01, 1, (rows, K // 32)).astype(np.float16)
    q = rng.integers(-128, 128, (rows, K // 32, 32)).astype(np.int8)
    out = bytearray()
    for r in range(rows):
        for u in range(K // 32):
            out += d[r, u].tobytes() + q[r, u].tobytes()  # f16 d, then int8 q[32]
    return np.frombuffer(bytes(out), np.uint8), d, q


def test_q8_chunks_byte_layout():
    rng = np.random.default_rng(0)
    rows, K = 3, 512
    raw, d, q = _gguf_rows(rng, rows, K)
    got = q8_chunks(torch.from_numpy(raw.copy()), K).numpy()
    assert got.size == raw.size == rows * K // 32 * 34
    rb = K // 32 * 34
    for r in range(rows):
        for u in range(K // 32):
            chunk = r * rb + (u // 8) * 272  # 8 blocks of 34 bytes per chunk
            b = u % 8
            # the chunk's 16 first bytes: its 8 scales, block order
            assert got[chunk + 2 * b: chunk + 2 * b + 2].tobytes() == d[r, u].tobytes()
            for v in range(32):
                w, j = v % 8, v // 8  # value v = 8j + w sits in byte j of the block's word w
                assert got[chunk + 16 + 32 * b + 4 * w + j] == int(q[r, u, v]) + 128, (r, u, v)


def test_which_tensors_are_chunked_and_bad_input():
    rng = np.random.default_rng(1)
    raw, _, _ = _gguf_rows(rng, 2, 256)
    t = torch.from_numpy(raw.copy())
    assert q8_chunked(T.Q8_0, 256) and not q8_chunked(T.Q8_0, 160) and not q8_chunked(T.Q2_K, 256)
    u8, kt = device_layout(T.Q8_0, 256, t)
    assert kt == Q8C and u8.numel() == t.numel()
    raw160, _, _ = _gguf_rows(rng, 2, 160)
    same, kt = device_layout(T.Q8_0, 160, torch.from_numpy(raw160.copy()))
    assert kt == int(T.Q8_0) and np.array_equal(same.numpy(), raw160)
    with pytest.raises(ValueError, match="multiple of 256, got 160"):
        q8_chunks(torch.from_numpy(raw160.copy()), 160)
    with pytest.raises(ValueError, match="rows of 272 bytes, got 271"):
        q8_chunks(t[:271], 256)
