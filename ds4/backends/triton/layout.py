"""How weights are laid out on the device: GGUF's bytes as they are, except Q8_0 rows whose
length is a multiple of 256, which are rearranged (not decoded) into 256-value chunks (Q8C),
IQ2_XXS tensors, whose blocks are split into two arrays (IQ2S, below), and Q2_K tensors, whose
blocks are split into three (Q2S, below). Q8C:

    chunk = f16 d[8] (16 bytes) | 256 bytes, block b's 32 at 32·b, quant q of value v as the
            byte q + 128 at 4·(v % 8) + v // 8

so byte j of the block's word w holds value 8j + w. A row keeps its 34·K/32 bytes and its place
in the tensor. Why: GGUF's 34-byte blocks align to 2 bytes, so a decoder either loads two quants
at a time or unpicks 16-byte segments that straddle blocks; in chunks every quant word is aligned,
a chunk's 64 words load as 16-byte vectors, a word's 4 values meet a contiguous slice of x
(values 8j..8j+7 of the block for byte j), and the biased bytes become floats with one byte
permute and one subtraction each (kernels._b2f), no sign handling.

IQ2S: an IQ2_XXS tensor's bytes become, in block order (GGUF's: row by row, K within a row),

    the 64 quant bytes of every block (block B's at 64·B), then the f16 scale d of every block
    (block B's at 64·NB + 2·B, NB blocks in the tensor)

so group g of block B (4 grid-index bytes, then the u32 of signs and scale) is the two 32-bit
words 16·B + 2·g and 16·B + 2·g + 1. Why: GGUF's 66-byte blocks keep the groups only 2-byte
aligned, so a decoder takes a group in four 2-byte loads (and the block scale in a fifth) that
a warp repeats for the same L1 sectors; split, a group is one aligned 8-byte load.
The u32 keeps its scale in bits 28-31, but its four 7-bit sign indices are interleaved: bit i of
grid entry e's index (GGUF: bit 7·e + i) is bit 4·i + e. Why: a decoder wants entry e's 8 signs
at one bit of each of 8 nibbles (the byte-permute selectors of its 8 levels); interleaved, one
shift and one mask put the 7 stored ones there and one multiply adds their parity (the 8th),
where GGUF's packing took a population count and three shift-mask steps per entry. A row
starts at block R·K/256 of both arrays; the kernels get the quant words and the scales as two
views (QWeight.f32 and QWeight.i16) and find a row's first block as its GGUF byte offset / 66.
Every IQ2_XXS row is whole blocks, so every IQ2_XXS tensor goes to the device this way (the
kernels' type id stays IQ2_XXS's).

Q2S: a Q2_K tensor's bytes become, in block order,

    the 64 quant bytes of every block (block B's at 64·B), then the 16 scale bytes of every block
    (at 64·NB + 16·B), then the f16 pair (d, dmin) of every block (at 80·NB + 4·B)

so the quants of a 128-value half h of block B are the eight aligned words 16·B + 8·h .. +7 (two
16-byte loads), its eight scales the bytes 16·B + 8·h .. +7 of the scale plane (one 8-byte load)
and the block's d and dmin one word. Why: GGUF's 84-byte blocks keep the quant bytes only 4-byte
aligned, so the routed down's decoder took 16 quant bytes in four word loads, each scale byte in
a load of its own and d, dmin in two more, requests that a warp repeated for the same L1 sectors.
Rows start at block R·K/256 of each plane; the kernels get the quant words, the scale bytes and
the (d, dmin) halfwords as three views (QWeight.f32, .b8, .i16) and find a row's first block as
its GGUF byte offset / 84. Every Q2_K row is whole blocks, so every Q2_K tensor goes to the
device this way (the kernels' type id stays Q2_K's).
"""

from __future__ import annotations

import torch

from ...core.quants import GGMLType
from .formats import KernelType

Q8C = int(KernelType.Q8C)  # the kernels' type id of this layout (beside the GGUF type ids they take for the others)


def q8_chunked(ttype: GGMLType, K: int) -> bool:
    """Whether a tensor of this type and row length goes to the device as Q8C chunks."""
    return int(ttype) == int(GGMLType.Q8_0) and K % 256 == 0


def kernel_type(ttype: GGMLType, K: int) -> int:
    """The kernels' type id of a tensor of this type and row length on the device."""
    return Q8C if q8_chunked(ttype, K) else int(ttype)


def q8_chunks(u8: torch.Tensor, K: int) -> torch.Tensor:
    """GGUF Q8_0 rows of K values (bytes, any number of rows) -> the same rows as Q8C chunks."""
    if K % 256:
        raise ValueError(f"Q8C chunks: expected a row length that is a multiple of 256, got {K}")
    rb = K // 32 * 34
    if u8.dtype != torch.uint8 or u8.numel() % rb:
        raise ValueError(f"Q8C chunks: expected uint8 rows of {rb} bytes, got {u8.numel()} {u8.dtype} values")
    b = u8.reshape(-1, K // 256, 8, 34)
    d = b[..., :2].reshape(b.shape[0], K // 256, 16)
    # quants [row, chunk, block, value j·8 + w] -> bytes [.., w, j]: byte 4w + j holds value 8j + w
    q = (b[..., 2:] ^ 0x80).reshape(b.shape[0], K // 256, 8, 4, 8).transpose(-1, -2)
    return torch.cat([d, q.reshape(b.shape[0], K // 256, 256)], dim=-1).reshape(-1)


IQ2_BLOCK = 66  # bytes of a GGUF IQ2_XXS block: f16 d, then 64 quant bytes (256 values)


IQ2_ENTRIES = 4  # grid entries (8 values each) of a 32-value group
IQ2_SIGN_BITS = 7  # stored signs of an entry (the 8th is their parity)
IQ2_SCALE_MASK = 0xF0000000  # the group's 4-bit scale in its u32
IQ2_CHUNK_WORDS = 1 << 24  # u32 words rearranged at a time (bounds the temporaries)


def _iq2_spread_table(device) -> torch.Tensor:
    """[128] int64: a 7-bit sign index with bit i moved to bit 4·i."""
    v = torch.arange(1 << IQ2_SIGN_BITS, dtype=torch.int64, device=device)
    return sum(((v >> i) & 1) << (4 * i) for i in range(IQ2_SIGN_BITS))


def iq2_interleave_signs(aux: torch.Tensor) -> torch.Tensor:
    """The u32 words of IQ2_XXS groups (int32, any shape) with their sign indices interleaved
    (bit 7·e + i -> 4·i + e, the scale bits kept): a new tensor."""
    a = aux.to(torch.int64) & 0xFFFFFFFF
    spread = _iq2_spread_table(aux.device)
    out = a & IQ2_SCALE_MASK
    for e in range(IQ2_ENTRIES):
        out |= spread[(a >> (IQ2_SIGN_BITS * e)) & ((1 << IQ2_SIGN_BITS) - 1)] << e
    return (out - ((out >> 31) << 32)).to(torch.int32)  # back to two's complement


def iq2_split(u8: torch.Tensor) -> torch.Tensor:
    """GGUF IQ2_XXS blocks (bytes, any number) -> IQ2S: every block's 64 quant bytes (each
    group's sign indices interleaved), then every block's f16 scale, in block order."""
    if u8.dtype != torch.uint8 or u8.numel() % IQ2_BLOCK:
        raise ValueError(f"IQ2S: expected uint8 IQ2_XXS blocks of {IQ2_BLOCK} bytes, got {u8.numel()} "
                         f"{u8.dtype} values")
    b = u8.reshape(-1, IQ2_BLOCK)
    out = torch.cat([b[:, 2:].reshape(-1), b[:, :2].reshape(-1)])
    aux = out[:b.shape[0] * (IQ2_BLOCK - 2)].view(torch.int32)[1::2]  # (grid word, u32) pairs
    for i in range(0, aux.numel(), IQ2_CHUNK_WORDS):
        aux[i:i + IQ2_CHUNK_WORDS] = iq2_interleave_signs(aux[i:i + IQ2_CHUNK_WORDS])
    return out


def iq2_views(u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An IQ2S tensor's (quant words int32, scales int16 holding f16 bits) as views of its bytes."""
    nq = u8.numel() // IQ2_BLOCK * 64
    return u8[:nq].view(torch.int32), u8[nq:].view(torch.int16)


Q2_BLOCK = 84  # bytes of a GGUF Q2_K block: scales[16], qs[64], f16 d, f16 dmin (256 values)


def q2_split(u8: torch.Tensor) -> torch.Tensor:
    """GGUF Q2_K blocks (bytes, any number) -> Q2S: every block's 64 quant bytes, then every
    block's 16 scale bytes, then every block's (d, dmin), in block order."""
    if u8.dtype != torch.uint8 or u8.numel() % Q2_BLOCK:
        raise ValueError(f"Q2S: expected uint8 Q2_K blocks of {Q2_BLOCK} bytes, got {u8.numel()} "
                         f"{u8.dtype} values")
    b = u8.reshape(-1, Q2_BLOCK)
    return torch.cat([b[:, 16:80].reshape(-1), b[:, :16].reshape(-1), b[:, 80:].reshape(-1)])


def q2_views(u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q2S tensor's (quant words int32, scale bytes uint8, (d, dmin) int16 holding f16 bits) as
    views of its bytes."""
    nb = u8.numel() // Q2_BLOCK
    return u8[:64 * nb].view(torch.int32), u8[64 * nb:80 * nb], u8[80 * nb:].view(torch.int16)


def device_layout(ttype: GGMLType, K: int, u8: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(bytes as the kernels read them, the kernels' type id: Q8C or the GGUF type)."""
    kt = kernel_type(ttype, K)
    if kt == Q8C:
        return q8_chunks(u8, K), kt
    if kt == int(GGMLType.IQ2_XXS):
        return iq2_split(u8), kt
    if kt == int(GGMLType.Q2_K):
        return q2_split(u8), kt
    return u8, kt
