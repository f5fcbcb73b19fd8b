"""GGUF weights as MLX arrays that stay quantized, and their exact decoders in MLX ops.

`upload` turns a GGUF tensor into a `Weight` in one of three forms, never through a lossy step:

* ``dense``  — F32 / F16 / BF16 / I32 kept in their own dtype (cast to float32 at use: exact).
* ``affine`` — MLX's quantized layout (group 32, unsigned quants packed little-endian in uint32,
  one float scale and bias per group), used where a GGUF format *is* that affine form exactly:
  Q8_0 (x = d·q = d·(q+128) − 128·d; 8 bits) and Q4_K (x = (d·sc)·q − dmin·m per 32 values;
  4 bits).
  Q8_0 keeps d and −128·d as f16 (both exact: a power-of-two multiple of an f16); Q4_K keeps its
  16-byte super-block header (d, dmin, packed 6-bit scales and mins) and computes the float32
  group scales d·sc and biases −dmin·m at use. d·sc has at most 11+6 significant bits and
  (d·sc)·q at most 21, so MLX's `scale·q + bias` rounds once, exactly where ggml's
  `(d·sc)·q − dmin·m` does: `mx.dequantize` equals gguf-py's dequantizer bit for bit (tested).
* ``blocks`` — the raw GGUF blocks as uint8 ``[..., rows, n_blocks, block_bytes]``, decoded at use
  by MLX bit operations and table lookups in ggml's order of float32 operations: IQ2_XXS (not
  affine), Q2_K (affine, but per 16 values; MLX groups are ≥ 32).

Memory: dense and blocks hold exactly the GGUF bytes, Q4_K too (128 bytes of nibbles + 16 of
header per 256 values), Q8_0 36 bytes per 34 (the extra f16 bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import mlx.core as mx

from ...core.gguf_model import Tensor
from ...core.quants import IQ2XXS_GRID, IQ2XXS_KSIGNS, QK_K, GGMLType, block_format

GROUP = 32  # MLX affine group size used for every transcoded format

# IQ2_XXS tables, as MLX arrays (the same values core.quants builds from gguf-py's grid)
_GRID = None
_KSIGNS = None


def _tables():
    global _GRID, _KSIGNS
    if _GRID is None:
        _GRID = mx.array(IQ2XXS_GRID)  # [256, 8] float32
        _KSIGNS = mx.array(IQ2XXS_KSIGNS)  # [128] uint8
    return _GRID, _KSIGNS


# ---------------------------------------------------------------------------------------------
# Block decoders in MLX ops: uint8 [..., n_blocks, block_bytes] -> float32 [..., n_blocks·values]


def _f16(b: mx.array) -> mx.array:
    """Two little-endian bytes [..., 2] -> float32 [..., 1]."""
    return mx.contiguous(b).view(mx.float16).astype(mx.float32)


def _u32(b: mx.array) -> mx.array:
    """Four little-endian bytes [..., 4] -> uint32 [..., 1]."""
    return mx.contiguous(b).view(mx.uint32)


def decode_q8_0(b: mx.array) -> mx.array:
    d = _f16(b[..., 0:2])
    q = b[..., 2:].view(mx.int8).astype(mx.float32)
    return (q * d).reshape(*b.shape[:-2], -1)


def decode_q2_k(b: mx.array) -> mx.array:
    # u8 scales[16] | u8 qs[64] | f16 d | f16 dmin (see core.quants._decode_q2_k)
    lead, nb = b.shape[:-2], b.shape[-2]
    sc, qs = b[..., :16], b[..., 16:80]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])  # [..., nb, 1]
    shifts = mx.array(np.array([0, 2, 4, 6], dtype=np.uint8))[:, None]
    q = (qs.reshape(*lead, nb, 2, 1, 32) >> shifts) & 3  # [..., nb, 2, 4, 32]
    q = q.reshape(*lead, nb, 16, 16).astype(mx.float32)
    dl = (d * (sc & 0xF).astype(mx.float32))[..., None]
    ml = (dmin * (sc >> 4).astype(mx.float32))[..., None]
    return (dl * q - ml).reshape(*lead, nb * QK_K)


def q4_k_scale_min(h: mx.array) -> tuple[mx.array, mx.array]:
    """Q4_K super-block header [..., 16] -> float32 group scales d·sc and biases −dmin·m,
    [..., 8] each."""
    d, dmin = _f16(h[..., 0:2]), _f16(h[..., 2:4])
    lo_sc, lo_m, nib = h[..., 4:8], h[..., 8:12], h[..., 12:16]
    sc = mx.concatenate([lo_sc & 63, (nib & 0xF) | ((lo_sc >> 6) << 4)], axis=-1)
    m = mx.concatenate([lo_m & 63, (nib >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return d * sc.astype(mx.float32), -(dmin * m.astype(mx.float32))


def decode_q4_k(b: mx.array) -> mx.array:
    # f16 d | f16 dmin | u8 scales[12] | u8 qs[128] (see core.quants._decode_q4_k)
    lead, nb = b.shape[:-2], b.shape[-2]
    scale, bias = q4_k_scale_min(b[..., :16])  # [..., nb, 8]
    shifts = mx.array(np.array([0, 4], dtype=np.uint8))[:, None]
    q = (b[..., 16:].reshape(*lead, nb, 4, 1, 32) >> shifts) & 0xF
    q = q.reshape(*lead, nb, 8, 32).astype(mx.float32)
    return (scale[..., None] * q + bias[..., None]).reshape(*lead, nb * QK_K)


def decode_iq2_xxs(b: mx.array) -> mx.array:
    # f16 d | 8 groups of two u32: 4 grid-index bytes, then 4×7-bit sign indices + 4-bit scale
    grid, ksigns = _tables()
    lead, nb = b.shape[:-2], b.shape[-2]
    d = _f16(b[..., 0:2])  # [..., nb, 1]
    words = b[..., 2:].reshape(*lead, nb, 8, 8)
    grid_idx = words[..., :4]  # [..., nb, 8, 4]
    aux = _u32(words[..., 4:8])[..., 0]  # [..., nb, 8]
    db = d * (0.5 + (aux >> 28).astype(mx.float32)) * 0.25
    shifts = mx.array(np.arange(0, 28, 7, dtype=np.uint32))
    sign_idx = (aux[..., None] >> shifts) & 0x7F  # [..., nb, 8, 4]
    bits = (ksigns[sign_idx][..., None] >> mx.array(np.arange(8, dtype=np.uint8))) & 1
    sign = mx.where(bits == 1, -1.0, 1.0).astype(mx.float32)  # [..., nb, 8, 4, 8]
    mag = grid[grid_idx]  # [..., nb, 8, 4, 8]
    return (db[..., None, None] * mag * sign).reshape(*lead, nb * QK_K)


DECODERS = {
    GGMLType.Q8_0: decode_q8_0,
    GGMLType.Q2_K: decode_q2_k,
    GGMLType.Q4_K: decode_q4_k,
    GGMLType.IQ2_XXS: decode_iq2_xxs,
}

_PLAIN = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.I32: np.int32}


# ---------------------------------------------------------------------------------------------
# Lossless re-layout into MLX's affine form (numpy, once at upload)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[..., n] values < 16 -> uint32 [..., n/8]: value j at bits 4·(j%8) of word j//8."""
    pairs = q.reshape(*q.shape[:-1], -1, 2)
    by = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return np.ascontiguousarray(by).view("<u4")


def _q4_k_nibbles(blocks: np.ndarray) -> np.ndarray:
    """Q4_K blocks [..., nb, 144] -> the 4-bit quants in value order, [..., nb·256] uint8."""
    qs = blocks[..., 16:]
    lead = qs.shape[:-1]
    q = (qs.reshape(*lead, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0xF
    return q.reshape(*lead[:-1], lead[-1] * QK_K)


@dataclass
class Weight:
    """An uploaded GGUF tensor. `shape` is the logical float shape (GGUF dims reversed:
    [n_expert, out, in], [out, in] or [n])."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    form: str  # "dense" | "affine" | "blocks"
    data: mx.array
    scales: mx.array | None = None  # affine Q8_0: f16 (or f32 where −128·d overflows f16)
    biases: mx.array | None = None
    header: mx.array | None = None  # affine Q4_K: uint8 [..., out, nb, 16]
    bits: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.data, self.scales, self.biases, self.header) if a is not None]

    # ---- views ------------------------------------------------------------------------------

    def _map(self, f, shape) -> "Weight":
        g = lambda a: None if a is None else f(a)  # noqa: E731
        return Weight(self.name, self.type, tuple(shape), self.form, f(self.data), g(self.scales),
                      g(self.biases), g(self.header), self.bits)

    def take(self, idx: mx.array) -> "Weight":
        """Entries `idx` (1-D) of the leading axis: experts of a 3-D tensor, rows of a matrix."""
        return self._map(lambda a: mx.take(a, idx, axis=0), (idx.size,) + self.shape[1:])

    def slice_rows(self, start: int, stop: int) -> "Weight":
        """Output rows [start, stop) of a 2-D weight."""
        return self._map(lambda a: a[start:stop], (stop - start,) + self.shape[1:])

    # ---- use ----------------------------------------------------------------------------------

    def affine_params(self) -> tuple[mx.array, mx.array]:
        """float32 (scales, biases) [..., out, in/32] of an affine weight."""
        if self.header is not None:
            s, b = q4_k_scale_min(self.header)  # [..., out, nb, 8]
            return s.reshape(*s.shape[:-2], -1), b.reshape(*b.shape[:-2], -1)
        return self.scales.astype(mx.float32), self.biases.astype(mx.float32)

    def f32(self) -> mx.array:
        """The float32 values (decoded), of `shape`."""
        if self.form == "dense":
            return self.data.astype(mx.float32)
        if self.form == "affine":
            s, b = self.affine_params()
            return mx.dequantize(self.data, s, b, group_size=GROUP, bits=self.bits)
        return DECODERS[self.type](self.data)

    def matmul(self, x: mx.array) -> mx.array:
        """x [..., in] @ W[out, in]ᵀ -> [..., out]."""
        if self.form == "affine":
            s, b = self.affine_params()
            return mx.quantized_matmul(x, self.data, s, b, transpose=True, group_size=GROUP,
                                       bits=self.bits)
        return x @ self.f32().T


def upload(t: Tensor) -> Weight:
    shape = tuple(reversed(t.dims))
    if t.type in _PLAIN:
        return Weight(t.name, t.type, shape, "dense", mx.array(t.values()))
    if t.type == GGMLType.BF16:
        u = t.raw.view("<u2").reshape(shape)
        return Weight(t.name, t.type, shape, "dense", mx.array(u).view(mx.bfloat16))
    fmt = block_format(t.type)
    nb = t.dims[0] // fmt.block_values
    blocks = t.raw.reshape(*shape[:-1], nb, fmt.block_bytes)
    if t.type == GGMLType.Q8_0:
        d = np.ascontiguousarray(blocks[..., :2]).view("<f2")[..., 0]  # [..., out, nb]
        with np.errstate(over="ignore"):
            bias = (d.astype(np.float32) * np.float32(-128)).astype(np.float16)
        if not np.array_equal(bias.astype(np.float32), d.astype(np.float32) * np.float32(-128)):
            # |d| ≥ 512 would overflow −128·d in f16: keep float32 scales (still exact)
            d, bias = d.astype(np.float32), d.astype(np.float32) * np.float32(-128)
        q = np.ascontiguousarray(blocks[..., 2:]) ^ np.uint8(0x80)  # int8 q -> q + 128
        packed = q.reshape(*shape[:-1], -1).view("<u4")
        return Weight(t.name, t.type, shape, "affine", mx.array(packed), mx.array(d),
                      mx.array(bias), bits=8)
    if t.type == GGMLType.Q4_K:
        header = np.ascontiguousarray(blocks[..., :16])
        rows = blocks.reshape(-1, nb, fmt.block_bytes)
        packed = np.empty((rows.shape[0], t.dims[0] // 8), dtype="<u4")
        step = max(1, (64 << 20) // t.row_bytes)  # re-pack 64 MiB of rows at a time
        for r in range(0, rows.shape[0], step):
            packed[r:r + step] = _pack_nibbles(_q4_k_nibbles(rows[r:r + step]))
        packed = packed.reshape(*shape[:-1], -1)
        return Weight(t.name, t.type, shape, "affine", mx.array(packed), header=mx.array(header),
                      bits=4)
    return Weight(t.name, t.type, shape, "blocks", mx.array(np.ascontiguousarray(blocks)))
