"""The Q8C chunk layout of Q8_0 rows, the IQ2S split of IQ2_XXS blocks and the Q2S split of Q2_K
blocks on the Triton backend's device (ds4/backends/triton/layout.py), against byte positions
written out here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4.backends.triton.layout import (Q8C, device_layout, iq2_split, iq2_views, q2_split, q2_views,  # noqa: E402
                                        q8_chunked, q8_chunks)
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


def _interleaved_by_hand(aux: int) -> int:
    """A group's u32 as IQ2S keeps it, bit by bit from the spec: the scale nibble (bits 28-31)
    stays; bit i of entry e's 7-bit sign index, GGUF bit 7·e + i, goes to bit 4·i + e."""
    out = aux & 0xF0000000
    for e in range(4):
        for i in range(7):
            if aux >> (7 * e + i) & 1:
                out |= 1 << (4 * i + e)
    return out


def test_iq2_split_byte_layout():
    """IQ2S: every block's 64 quant bytes in block order (each group's grid-index word as it is,
    its u32 with the sign indices interleaved), then every block's 2-byte scale."""
    rng = np.random.default_rng(2)
    nblk = 5
    d = rng.uniform(0.01, 1, nblk).astype(np.float16)
    qs = rng.integers(0, 256, (nblk, 64)).astype(np.uint8)
    raw = np.frombuffer(b"".join(d[b].tobytes() + qs[b].tobytes() for b in range(nblk)), np.uint8)  # GGUF: d | qs[64]
    got = iq2_split(torch.from_numpy(raw.copy())).numpy()
    assert got.size == raw.size == 66 * nblk
    for b in range(nblk):
        for g in range(8):
            assert got[64 * b + 8 * g: 64 * b + 8 * g + 4].tobytes() == qs[b, 8 * g: 8 * g + 4].tobytes()
            aux = int.from_bytes(qs[b, 8 * g + 4: 8 * g + 8].tobytes(), "little")
            want = _interleaved_by_hand(aux)
            assert int.from_bytes(got[64 * b + 8 * g + 4: 64 * b + 8 * g + 8].tobytes(), "little") == want, (b, g)
        assert got[64 * nblk + 2 * b: 64 * nblk + 2 * b + 2].tobytes() == d[b].tobytes()
    # one word by hand: entry 0's index 0b1000001 (bits 0, 6), entry 3's 0b0000001 (bit 21), scale 0xA
    assert _interleaved_by_hand(0xA0000000 | 0b1000001 | (1 << 21)) == 0xA0000000 | (1 << 0) | (1 << 24) | (1 << 3)
    words, scales = iq2_views(torch.from_numpy(got.copy()))
    assert words.dtype == torch.int32 and words.numel() == 16 * nblk
    assert scales.dtype == torch.int16 and scales.numel() == nblk
    # group g of block b: its grid-index word 16b + 2g is quant bytes 8g..8g+3, little-endian
    b, g = 3, 5
    assert int(words[16 * b + 2 * g]) & 0xFFFFFFFF == int.from_bytes(qs[b, 8 * g: 8 * g + 4].tobytes(), "little")
    assert scales[b:b + 1].numpy().view(np.float16)[0] == d[b]
    u8, kt = device_layout(T.IQ2_XXS, 256, torch.from_numpy(raw.copy()))
    assert kt == int(T.IQ2_XXS) and np.array_equal(u8.numpy(), got)
    with pytest.raises(ValueError, match="blocks of 66 bytes, got 65"):
        iq2_split(torch.from_numpy(raw[:65].copy()))


def test_q2_split_byte_layout():
    """Q2S: every block's 64 quant bytes in block order, then every block's 16 scale bytes, then
    every block's f16 d and dmin."""
    rng = np.random.default_rng(3)
    nblk = 5
    sc = rng.integers(0, 256, (nblk, 16)).astype(np.uint8)
    qs = rng.integers(0, 256, (nblk, 64)).astype(np.uint8)
    d = rng.uniform(0.01, 1, nblk).astype(np.float16)
    dmin = rng.uniform(0.01, 1, nblk).astype(np.float16)
    # GGUF: scales[16] | qs[64] | d | dmin
    raw = np.frombuffer(b"".join(sc[b].tobytes() + qs[b].tobytes() + d[b].tobytes() + dmin[b].tobytes()
                                 for b in range(nblk)), np.uint8)
    got = q2_split(torch.from_numpy(raw.copy())).numpy()
    assert got.size == raw.size == 84 * nblk
    for b in range(nblk):
        assert got[64 * b: 64 * b + 64].tobytes() == qs[b].tobytes()
        assert got[64 * nblk + 16 * b: 64 * nblk + 16 * b + 16].tobytes() == sc[b].tobytes()
        assert got[80 * nblk + 4 * b: 80 * nblk + 4 * b + 4].tobytes() == d[b].tobytes() + dmin[b].tobytes()
    words, scales, dd = q2_views(torch.from_numpy(got.copy()))
    assert words.dtype == torch.int32 and words.numel() == 16 * nblk
    assert scales.dtype == torch.uint8 and scales.numel() == 16 * nblk
    assert dd.dtype == torch.int16 and dd.numel() == 2 * nblk
    # half h of block b: quant words 16b + 8h .. +7, scale bytes 16b + 8h .. +7, d / dmin halfwords 2b, 2b + 1
    b, h = 3, 1
    assert int(words[16 * b + 8 * h + 5]) & 0xFFFFFFFF == int.from_bytes(qs[b, 32 * h + 20: 32 * h + 24].tobytes(),
                                                                          "little")
    assert scales[16 * b + 8 * h: 16 * b + 8 * h + 8].numpy().tobytes() == sc[b, 8 * h: 8 * h + 8].tobytes()
    assert dd[2 * b: 2 * b + 2].numpy().view(np.float16).tolist() == [d[b], dmin[b]]
    u8, kt = device_layout(T.Q2_K, 256, torch.from_numpy(raw.copy()))
    assert kt == int(T.Q2_K) and np.array_equal(u8.numpy(), got)
    with pytest.raises(ValueError, match="blocks of 84 bytes, got 83"):
        q2_split(torch.from_numpy(raw[:83].copy()))
