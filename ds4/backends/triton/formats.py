"""The Triton kernels' names for weight formats and for their matrix-vector decoders.

A kernel is specialised on its weight's `KernelType` (a `TYPE` constexpr): the GGUF type id for
the formats it decodes as GGUF stores them (or rearranged without a new id: IQ2S, Q2S), and Q8C
for Q8_0 rows stored as 256-value chunks (`ds4.backends.triton.layout`). The decode products of
the shipped formats can instead take a specialised `Decoder` (the same `TYPE` constexpr, chosen
per shape by `TritonBackend._mv_cfg`); the generic one decodes any `KernelType`.

Both are `IntEnum`s, so a member is the int the kernels compare against, a key equal to the int in
the tuning tables (`mv_types`, `mv_tune`, the per-shape JSON) and a constexpr where passed to a kernel.
"""

from __future__ import annotations

from enum import IntEnum

from ...core.quants import GGMLType

# The kernels' id of Q8_0 rows in 256-value chunks (layout.py), beside the GGUF ids.
Q8C_ID = 80
# The GGUF formats the kernels decode as GGUF stores them (or rearranged without a new id).
_GGUF_DECODED = ("F32", "F16", "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "BF16")

# A weight's format as the kernels see it: the GGML type ids (ds4.core.quants.GGMLType, the one
# table of them) and Q8C, Q8_0 rows in 256-value chunks (layout.py).
KernelType = IntEnum("KernelType", [(n, int(GGMLType[n])) for n in _GGUF_DECODED] + [("Q8C", Q8C_ID)])


class Decoder(IntEnum):
    """The specialised matrix-vector decoders (a kernel's TYPE in place of the KernelType).

    The three-digit numbers are the ids the tuning tables and the per-shape JSON store."""

    Q2_K_UNROLLED = 110  # Q2_K: the 64 values of a 16-byte run unrolled per tile element, float x
    Q2_K_XQ = 111  # Q2_K_UNROLLED on x in XQ form, integer products (the routed down)
    Q2S_HALVES_XQ = 113  # Q2_K in Q2S: 128-value halves on h in XQ form, slots summed per tile (routed down)
    IQ2_UNROLLED = 216  # IQ2_XXS: one row per thread, a 32-value group per tile element, looked-up bytes
    IQ2_GROUPS = 416  # IQ2_XXS in IQ2S: four rows per thread share each x load, levels as nibbles
    IQ2_GROUPS_SMEM = 417  # IQ2_GROUPS with its level lookups from a table in shared memory
    IQ2_GROUPS_XQ = 418  # IQ2_GROUPS_SMEM on x in XQ form, integer (dp4a) products (routed gate/up)
    Q8C_FLOAT = 308  # Q8C chunks on float x, R rows per thread
    Q8C_XQ8 = 309  # Q8C chunks on x in XQ8 form, integer products


# the float decoder that stands in for an integer one where x is not in XQ form
FLOAT_DECODER = {Decoder.IQ2_GROUPS_XQ: Decoder.IQ2_GROUPS_SMEM, Decoder.Q2_K_XQ: Decoder.Q2_K_UNROLLED,
                 Decoder.Q2S_HALVES_XQ: Decoder.Q2_K_UNROLLED, Decoder.Q8C_XQ8: Decoder.Q8C_FLOAT}
