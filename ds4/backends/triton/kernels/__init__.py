"""The Triton kernels of the DS4 forward pass.

Every kernel reads quantized weight blocks, as GGUF stores them or rearranged (Q8C chunks for
Q8_0, IQ2S for IQ2_XXS, Q2S for Q2_K, below): `_wtile` decodes a [rows, units, values-per-unit]
tile of F32/F16/BF16/Q8_0/Q8C/Q2_K/Q4_K/IQ2_XXS rows in registers, where a "unit" is the group of
values that shares one scale (a Q8_0 block, a Q2_K sub-block, one IQ2_XXS grid entry).
Matrix-vector kernels (decode) multiply that tile by the activation with FMAs; matrix-matrix
kernels (prefill) reshape it to [rows, K-block] for `tl.dot`. One path makes a dequantized copy:
a Q8C prefill product under bf16x3 first splits its weight into two fp16 planes (`q8c_hl_kernel`,
a buffer of that product only), so that its K loop is plain fp16 tiles.
Specialised decoders (`_mv_step`, `_q8c_rows`, `_iq2_group_rows`) serve the decode shapes of the
shipped formats, and Q8_0 prefill products run as exact integers on bf16 tensor cores
(`_dot_units`).

Positions never come from the host: kernels read the chunk's first position p0 from a device
scalar, so a decode step can be captured once in a CUDA graph and replayed. Kernels that depend
on the position (which compressor window closes, how many compressed rows a query sees) decide
it themselves, and programs with nothing to do exit.

A weight is passed as three views of its byte buffer: `wb` (uint8), `wh` (int16: f16 scales and
16-bit words, which sit at even offsets in every DS4 block format) and `wf` (float32 for F32, else
int32 words); for the split layouts below, views of their separate arrays (QWeight).

Three formats are rearranged at upload, not decoded (`ds4.backends.triton.layout`). IQ2_XXS blocks
are split into their quant words and their scales (layout IQ2S: a group is one aligned 8-byte
load, its sign indices interleaved for `_iq2_signs`; `_iq2_blk`); Q2_K blocks into their quant
words, scale bytes and (d, dmin) pairs (layout Q2S: half a block's quants are two aligned 16-byte
loads; `_q2_blk`). Q8_0 rows whose length is a multiple of 256 are stored as 256-value chunks
(layout Q8C): the chunk's 8 f16 scales (16 bytes), then its 256 quants as bytes q + 128, the 32 of
each block ordered so that byte j of the block's word w holds value 8j + w. The bytes of a row and
their count are the same (34 per 32 values); every quant word is 4-byte aligned and each chunk
16-byte aligned, where GGUF's 34-byte blocks only align to 2 bytes.

The kernels live in one module per op family: `common` (loads, conversions, the generic block
decoders), `decode` and `decode_rows` (the specialised decoders), `mmvq` (matrix-vector), `mmq`
(matrix-matrix), `moe`, `attention` (KV store, compressor, attention), `indexer` (scores,
top-k), `norm_rope` (embedding, norms, hyper-connections, RoPE) and `sampling`. This package re-exports the kernels
and the type constants, so `from ds4.backends.triton import kernels as K; K.matvec_kernel` works.
"""

from __future__ import annotations

from .common import (  # noqa: F401
    BF16,
    F16,
    F32,
    INTERPRET,
    IQ2_XXS,
    Q2_K,
    Q4_K,
    Q8C,
    Q8_0,
    UNIT,
)
from .decode import (  # noqa: F401
    XQ_MAX,
)
from .mmvq import (  # noqa: F401
    xq_kernel,
    matvec_xq_kernel,
    matvec_kernel,
)
from .mmq import (  # noqa: F401
    matmul_f16w_kernel,
    q8c_hl_kernel,
    matmul_kernel,
    x16_kernel,
)
from .moe import (  # noqa: F401
    moe_gateup_mv_kernel,
    moe_down_mv_kernel,
    moe_gateup_mm_kernel,
    moe_down_mm_kernel,
    moe_reduce_kernel,
    router_kernel,
)
from .norm_rope import (  # noqa: F401
    embed_kernel,
    rms_kernel,
    add_kernel,
    swiglu_kernel,
    hc_mix_kernel,
    hc_finalize_kernel,
    hc_post_kernel,
    rope_kernel,
)
from .attention import (  # noqa: F401
    kv_store_kernel,
    comp_pool_kernel,
    comp_update_kernel,
    attn_kernel,
    attn_combine_kernel,
)
from .indexer import (  # noqa: F401
    idx_score_kernel,
    topk_kernel,
    topk_one_kernel,
    TOPK_BUCKETS,
    TOPK_CHUNKS,
    TOPK_END,
    TOPK_START,
)
from .sampling import (  # noqa: F401
    greedy_next_kernel,
    sample_next_kernel,
)
