"""The Triton backend's tuning: every launch configuration and path choice, in one frozen record.

`load_tuning` builds it from the defaults below, the measured per-shape decoder table
(`mv_shapes_h200.json`, written by `bench/triton/tune_paths.py --pick`) and the environment. The
measurements behind the defaults are in bench/triton/README.md. `TritonBackend` copies each
field onto itself (`backend.mv_types`, `backend.attn_f16`, ...), where tests and
`bench/triton/bench_full.py --set` change them per instance.

Environment overrides (read here and nowhere else):

==========================  ===================================================================
variable                    effect
==========================  ===================================================================
DS4_TRITON_DOT              prefill product precision: bf16x3 (default), f16, tf32x3, tf32 or ieee
                            (the backend's dot_precision argument wins)
DS4_TRITON_UNITS            units per K-step of the generic decoders (default 1)
DS4_TRITON_LANES            side streams of a decode step, 0 = none (default 6)
DS4_TRITON_FFN_ROWS         prompt rows whose FFN sublayers run together (default 8192; 0 = chunk
                            by chunk, the least GPU memory)
DS4_TRITON_MM               matrix-matrix tile "rows of x,rows of W,warps" (default 64,64,8)
DS4_TRITON_MOE              JSON {"gateup"|"down"|"shared": [rows of W, warps]}: grouped-expert tiles
DS4_TRITON_MOE16            "0": no integer fp16 prefill experts (default "1")
DS4_TRITON_MOE16_TILE       JSON {"gateup"|"down": [rows of W, K-step, warps, stages]}
DS4_TRITON_MV_PLAIN         "1": the generic block decoder for every decode product
DS4_TRITON_MV_TUNE          JSON {decoder: [K-step values, rows, warps(, K parts, rows per thread)]}
DS4_TRITON_MV_SHAPES        another per-shape decoder table (a JSON file), "" for none
==========================  ===================================================================
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from .formats import Decoder, KernelType

_D = Decoder
PRECISIONS = ("bf16x3", "f16", "tf32x3", "tf32", "ieee")
# the precisions whose Q8_0 / IQ2_XXS / Q2_K products run as exact integers on 16-bit tensor cores
INTEGER_PRECISIONS = ("bf16x3", "f16")
ONE_TERM = "f16"  # of those, the one that rounds x once to fp16
DEFAULT_MV_SHAPES = os.path.join(os.path.dirname(__file__), "mv_shapes_h200.json")
FP16_ATTN_SHARED = 135168  # shared memory (bytes) the fp16 prefill attention tile needs
MIN_K_STEP = 16  # the smallest K-step of a matrix-matrix tile: one fp16 tensor-core step


@dataclass(frozen=True)
class TritonTuning:
    # prefill products: "bf16x3" multiplies Q8_0 quants (exact integers) on bf16 tensor cores with
    # x split exactly in three bf16 terms, and the IQ2_XXS / Q2_K experts as exact integers on fp16
    # tensor cores (moe_int16), and F16 weights on x in two fp16 terms (f16_x2); other weights,
    # and every weight under "tf32x3" / "tf32" / "ieee", go through tl.dot at that precision on
    # float32-decoded tiles. "f16": the same integer paths with x rounded once to fp16 (one
    # product instead of three or two), and the Q8C and F16 linears as fp16 products of x and the
    # weights each rounded once (q8_f16w): what ds4 feeds its own GPU prefill, not
    # float32-accurate (numerics "ds4" only; spec §3.10)
    prec: str = "bf16x3"
    units_per_step: int = 1
    chain_block: int = 2048  # logits per program of greedy_next_kernel / sample_next_kernel
    # side streams of a decode step (lanes.py): the branches graph.py marks run beside the main
    # path; 0 runs every launch in order on one stream
    lanes: int = 6
    # matrix-matrix tile (prefill linears): rows of x, rows of W, warps; and the bf16x3 Q8_0 path's
    mm_tile: tuple = (64, 64, 8)
    mm_tile_q8: tuple = (64, 128, 4)
    # grouped-expert tiles (prefill MoE): rows of W per program and warps, BM = 64 assignments;
    # "shared": the shared expert's Q8_0 gate/up under bf16x3 (whole tokens, no grouping)
    moe_tile: Mapping = field(default_factory=lambda: {"gateup": (32, 8), "down": (64, 8), "shared": (128, 4)})
    # prefill experts in IQ2_XXS (gate/up) and Q2_K (down) under "bf16x3": exact integers on fp16
    # tensor cores (kernels_mm16.py). moe16_bm assignments per tile; per kernel: rows of W per
    # program (gate/up: of each, one product of twice the rows), K-step (a divisor of 256), warps,
    # pipeline stages (1: the pipeliner would stage the decoders' table lookups through shared
    # memory)
    moe_int16: bool = True
    moe16_bm: int = 64
    moe16_tile: Mapping = field(default_factory=lambda: {"gateup": (64, 128, 4, 1), "down": (64, 128, 4, 1)})
    # the Q2_K down of that path on int8 tensor cores instead (kernels_mm8.py: h in three int8
    # digit planes, or two (mm8_planes), sc·q one byte a value; "bf16x3" only) and its tile (rows
    # of W, K-step, warps, stages)
    moe_down_i8: bool = True
    mm8_planes: int = 3
    mm8_tile: tuple = (64, 128, 4, 1)
    # "f16" precision, Q8C and F16 linears: x in fp16 once per product (x16_kernel) and the Q8C
    # weights folded to fp16 as they load (matmul_f16w_kernel), one float32 accumulator over K.
    # Rows of x, rows of W, K-step (a divisor of 256), row tiles of x per W tile, warps, stages;
    # the layouts (kernel type ids) it takes
    q8_f16w: bool = True
    f16w_tile: tuple = (128, 128, 64, 8, 4, 3)
    f16w_types: tuple = (int(KernelType.Q8C), int(KernelType.F16))
    # "bf16x3", F16 linears: the same kernel on x in two fp16 terms (x16_kernel's hi and lo, 22
    # bits) against the weights as they are, two exact products a K-step, instead of tf32x3
    f16_x2: bool = True
    # "bf16x3", Q8C linears: each weight split once per product into two fp16 planes that hold it
    # exactly (q8c_hl_kernel, a transient copy), then the same kernel's products of the two terms
    # of x and of W (hl_products: three, or four with the low terms' product) as plain fp16 tiles
    # (no block scale inside the K loop), instead of matmul_kernel's three bf16 products and a
    # scale per 32-value block. hl_tile: the kernel's tile under bf16x3 (these and f16_x2's
    # products; as f16w_tile's), 8 warps for the partial sums. hl_fresh: the tensor cores sum
    # each K-step from zero and the kernel adds the partial sums in float32 (off: one accumulator
    # over K, which the tensor cores' truncating sums make less exact)
    q8_hl: bool = True
    hl_tile: tuple = (128, 128, 64, 8, 8, 3)
    hl_fresh: bool = True
    hl_products: int = 3  # (the low terms' product is under 2^-24 of |x|·|w|)
    hl_split_rows: int = 4  # Q8C rows per program of the split into planes (q8c_hl_kernel)
    # a prefill group's chunks (prefill_ffn_rows) share each layer's planes of its attention
    # weights, made once, instead of one split per chunk (at the Flash shapes up to five weights,
    # ~0.43 GB, held while the layer's chunks run)
    hl_keep: bool = True
    # the shared expert's Q8C gate/up in prefill as two such products on one split of x and the
    # SwiGLU, instead of the fused gate/up kernel's bf16x3 Q8_0 path
    shared_hl: bool = True
    # a prompt's chunks run their FFN sublayers together over up to this many rows
    # (graph.forward_chunks; 0: chunk by chunk): a 2048 chunk gives each routed expert 48
    # assignments on average, under three quarters of a 64-row tile
    prefill_ffn_rows: int = 8192
    topk_reg_max: int = 16384  # indexer rows that top-k keeps in registers
    # numerics "ds4": the indexer's compressed rows (Hadamard + FP4, then f16) and its QAT'd query
    # hold at most 3 significant bits, so both are exact in bfloat16: the rows are kept in
    # bfloat16 and the scores are one bf16 tensor-core product, reading half the bytes of
    # float32 rows and two tf32 products (off: float32 rows, as under numerics "exact")
    index_bf16: bool = True
    # numerics "ds4": the raw window's rows and the compressed attention rows are f16 values (FP8
    # simulated, then rounded to f16), so they are kept in float16: attention reads half the
    # bytes of float32 rows (off: float32 rows, as under numerics "exact")
    cache_f16: bool = True
    # one-query top-k (decode) from the key counts and buckets the scores kernel makes
    # (idx_score_kernel HIST, topk_one_kernel) instead of bisection passes in one program; the
    # keys a bucket keeps, rows and warps per top-k program
    topk_hist: bool = True
    topk_bucket: int = 256
    topk_rows: int = 1024
    topk_warps: int = 8
    # the indexer's scores kernel: rows a program (every program loads the query's heads whole)
    # and its warps
    idx_score_rows: int = 64
    idx_score_warps: int = 4
    # prefill attention (one program per query and head group): heads per program, rows per step,
    # warps, pipeline stages, for its products on fp16 tensor cores (attn_f16: ds4 numerics only,
    # whose cache rows are f16 values; decode's too) and on tf32 pairs. The fp16 tile needs
    # FP16_ATTN_SHARED bytes of shared memory at 512-value heads; GPUs with less take a smaller one
    attn_f16: bool = True
    attn_tile: tuple = (32, 32, 8, 2)
    attn_tile_tf32: tuple = (16, 16, 8, 3)
    # prefill attention: the query's per-head norm and tail RoPE applied as the kernel loads it
    # (attn_q_rope), and the output's inverse tail RoPE as it stores it (attn_o_rope), instead of
    # a rope_kernel launch each, a pass over n·H·D floats a layer
    attn_q_rope: bool = True
    attn_o_rope: bool = True
    # mHC mixing projections: (the chunk size from which a program takes several tokens, tokens
    # per program); tl.dot needs 16 rows on a GPU
    hc_mix_bt: tuple = (16, 64)
    # the KV row's RoPE stores it into the raw window itself (kv_store's FP8 and f16 rounding
    # included) instead of a store kernel reading it back
    fuse_kv_store: bool = True
    # decode: the mixing kernel of an mHC collapse computes the pending expand (hc_post) itself
    fuse_expand: bool = True
    # mHC: K parts of the mixing projections (at most, a tile of tokens: programs per token in
    # decode; fewer as the rows grow), the programs the parts aim at over all the rows (about one
    # an SM), their K-step in values (0: 32 for several tokens a program, up to 128 for one),
    # collapse values per finalize program, and whether a one-token finalize computes post and
    # comb (the Sinkhorn iterations) in a launch of its own, beside the sublayer, instead of
    # before it
    hc_mix_split: int = 128
    hc_mix_programs: int = 128
    hc_mix_step: int = 0
    hc_fin_be: int = 256
    hc_comb_beside: bool = True
    # one-token finalize: the comb tile stored and loaded again before the Sinkhorn iterations
    # (hc_finalize_kernel RELOAD), which halves the warp shuffles of each iteration
    hc_comb_reload: bool = True
    # decode steps in a layer with an indexer: the query's product waits for the indexer's scores
    # ("score") or its query RoPE ("rope"), or for neither ("none"): it fills every SM, and the
    # indexer's small kernels behind it (RoPE, scores, top-k) are the layer's critical chain
    query_waits_index: str = "rope"
    # decode steps: the products on XQ8 x (Q8C_XQ8: wq_b, wo_a, wo_b, the head) launch while the
    # kernel ahead of them on their stream still runs (programmatic dependent launch: that kernel,
    # named in pdl_dep, lets them from its start), load their first K-step's weights, then wait
    # for it before they read x (kernels._q8c_xq_rows PDL)
    pdl_xq: bool = True
    pdl_dep: tuple = ("rms", "combine", "xq")
    # decode products fuse a pending RMSNorm of x (every program normalises the x values it loads)
    # unless their programs together would read x this many times over or more; then x is
    # normalised once first
    norm_fuse_max: int = 1 << 22
    # decode attention merge: value pairs of a head per program (a power of two, at least 16 where
    # the merge also stores XQ8 blocks)
    combine_pairs: int = 32
    # decode RoPE: heads per program (few, so that a token's heads spread over many programs)
    rope_rows_decode: int = 2
    # prefill RoPE (a chunk's queries, unless attention applies it): rows (heads) per program
    # and warps
    rope_tile_prefill: tuple = (16, 4)
    attn_split_rows: int = 32  # decode attention: KV rows per program (attn_combine_kernel merges them)
    # decode attention: heads per program (a power of two, at least 16 for the tensor cores'
    # product); each head group reads every row once
    attn_decode_heads: int = 16
    # decode attention: at most this many programs per head group (longer histories take more
    # rows a program); 20 is what the 640 rows of a CSA layer's top-k and window make at 32 rows
    attn_max_splits: int = 20
    # decoder per layout in decode products (formats.Decoder); anything else (GGUF-layout Q8_0
    # included) takes the generic block decoder
    mv_types: Mapping = field(default_factory=lambda: {
        KernelType.Q8C: _D.Q8C_FLOAT, KernelType.IQ2_XXS: _D.IQ2_GROUPS_XQ, KernelType.Q2_K: _D.Q2S_HALVES_XQ})
    # IQ2_GROUPS_XQ issues each K-step's group loads one step ahead (kernels._iq2_group_rows PF)
    mv_prefetch: bool = True
    # decode: a Q8C product whose result the next one reads in XQ8 form stores that form too
    # (matvec_xq_kernel's XQOUT: wo_a for wo_b), instead of an xq_kernel launch between them
    xq_out: bool = True
    # matrix-vector tiling per decoder: (K-step values, rows per program, warps), from
    # bench/triton/tune_paths.py; a fourth value splits K in that many parts (_split_store), a
    # fifth is Q8C_FLOAT / Q8C_XQ8 / Q2S_HALVES_XQ's rows per thread
    mv_tune: Mapping = field(default_factory=lambda: {
        "default": (256, 8, 4), _D.Q8C_FLOAT: (1024, 4, 4, 1, 4), _D.Q8C_XQ8: (1024, 4, 4, 1, 4),
        _D.Q2_K_UNROLLED: (1024, 8, 4), _D.IQ2_UNROLLED: (512, 16, 4), _D.IQ2_GROUPS: (1024, 32, 4),
        _D.IQ2_GROUPS_SMEM: (1024, 32, 4), _D.IQ2_GROUPS_XQ: (1024, 32, 4), _D.Q2_K_XQ: (1024, 4, 2, 2),
        _D.Q2S_HALVES_XQ: (2048, 8, 2, 1, 2), KernelType.F16: (512, 4, 4)})
    # per-shape decoder choices, (kind, GGUF type, rows, K) -> (decoder, its tuning)
    mv_shapes: Mapping = field(default_factory=dict)


def load_tuning(interpret: bool, max_shared: int | None = None, dot_precision: str | None = None,
                env: Mapping[str, str] | None = None) -> TritonTuning:
    """The tuning for a backend: the defaults, the interpreter's small shapes (interpret), the
    smaller attention tile where max_shared (bytes, None: not a GPU) is under what the fp16 tile
    needs and fp16-path tiles whose pipelines fit in it (fit_stages), the per-shape table and the
    environment overrides (the module docstring's table)."""
    env = os.environ if env is None else env
    t = {}
    prec = dot_precision or env.get("DS4_TRITON_DOT") or "bf16x3"
    if prec not in PRECISIONS:
        raise ValueError(f"DS4_TRITON_DOT: expected one of {', '.join(PRECISIONS)}, got {prec!r}")
    t["prec"] = prec
    t["units_per_step"] = int(env.get("DS4_TRITON_UNITS", "1"))
    lanes = env.get("DS4_TRITON_LANES", "6")
    if not lanes.isdigit():
        raise ValueError(f"DS4_TRITON_LANES: expected a whole number of side streams (0 = none), got {lanes!r}")
    t["lanes"] = int(lanes)
    t["mm_tile"] = tuple(int(v) for v in env.get("DS4_TRITON_MM", "64,64,8").split(","))
    defaults = TritonTuning()
    ffn_rows = env.get("DS4_TRITON_FFN_ROWS", str(defaults.prefill_ffn_rows))
    if not ffn_rows.isdigit():
        raise ValueError(f"DS4_TRITON_FFN_ROWS: expected a whole number of prompt rows (0 = chunk by "
                         f"chunk), got {ffn_rows!r}")
    t["prefill_ffn_rows"] = int(ffn_rows)
    moe_tile = dict(defaults.moe_tile)
    moe_tile.update({k: tuple(v) for k, v in json.loads(env.get("DS4_TRITON_MOE", "{}")).items()})
    t["moe_tile"] = moe_tile
    t["moe_int16"] = env.get("DS4_TRITON_MOE16", "1") == "1"
    moe16_tile = dict(defaults.moe16_tile)
    moe16_tile.update({k: tuple(v) for k, v in json.loads(env.get("DS4_TRITON_MOE16_TILE", "{}")).items()})
    t["moe16_tile"] = moe16_tile
    if max_shared is not None and max_shared < FP16_ATTN_SHARED:
        t["attn_tile"] = (16, 16, 8, 2)
    if max_shared is not None:  # x's two terms and W's two planes (hl), x and W (f16w) a stage
        t["hl_tile"] = fit_stages(defaults.hl_tile, 2, 2, max_shared)
        t["f16w_tile"] = fit_stages(defaults.f16w_tile, 1, 1, max_shared)
    if env.get("DS4_TRITON_MV_PLAIN") == "1":
        t["mv_types"] = {}
    mv_tune = dict(defaults.mv_tune)
    mv_tune.update({int(k): tuple(v) for k, v in json.loads(env.get("DS4_TRITON_MV_TUNE", "{}")).items()})
    t["mv_tune"] = mv_tune
    table = env.get("DS4_TRITON_MV_SHAPES")
    if table is None:
        table = DEFAULT_MV_SHAPES
    elif table and not os.path.exists(table):
        raise ValueError(f"DS4_TRITON_MV_SHAPES: expected a JSON file or \"\", got {table!r} (no such file)")
    if interpret:  # few, large programs; the interpreter's tests use small shapes of their own
        t.update(moe_tile={"gateup": (64, 4), "down": (64, 4), "shared": (64, 4)}, topk_bucket=32, topk_rows=64,
                 idx_score_rows=128,
                 hc_mix_bt=(2, 16), hc_mix_split=1, hc_mix_step=1024, combine_pairs=16, rope_rows_decode=64,
                 f16w_tile=(32, 128, 64, 2, 4, 1),
                 hl_tile=(32, 128, 64, 2, 4, 1), hl_split_rows=64, mm8_tile=(256, 128, 4, 1),
                 moe16_tile={"gateup": (256, 128, 4, 1), "down": (256, 128, 4, 1)})
    elif table:
        t["mv_shapes"] = load_mv_shapes(table)
    return dataclasses.replace(defaults, **t)


def fit_stages(tile: tuple, planes_x: int, planes_w: int, max_shared: int) -> tuple:
    """A matmul_f16w_kernel tile (BM, BN, BK, GM, warps, stages) whose pipeline fits in max_shared
    bytes: a stage holds planes_x fp16 [BM, BK] tiles of x and planes_w [BN, BK] tiles of W.
    Fewer stages first (down to two, which still overlap a load with a product), then half the
    K-step (down to 16, one tensor-core step), then one stage."""
    BM, BN, BK, GM, warps, stages = tile
    while 2 * BK * (planes_x * BM + planes_w * BN) * stages > max_shared:
        if stages > 2:
            stages -= 1
        elif BK > MIN_K_STEP:
            BK //= 2
        elif stages > 1:
            stages = 1
        else:
            break  # (the compiler names what is missing)
    return (BM, BN, BK, GM, warps, stages)


def load_mv_shapes(path: str) -> dict[tuple, tuple]:
    """A per-shape decoder table: JSON {"kind,type,rows,K": [decoder, tuning...]}."""
    with open(path) as f:
        raw = json.load(f)
    return parse_mv_shapes(raw.get("shapes", raw), path)


def parse_mv_shapes(raw: dict, where: str) -> dict[tuple, tuple]:
    """{"kind,type,rows,K": [decoder, tuning...]} -> the backend's mv_shapes entries."""
    out = {}
    for key, val in raw.items():
        try:
            kind, ttype, n, k = key.split(",")
            if kind not in ("linear", "gateup", "down"):
                raise ValueError(kind)
            out[(kind, int(ttype), int(n), int(k))] = tuple(int(v) for v in val)
        except ValueError:
            raise ValueError(f"{where}: shape {key!r}: expected \"linear|gateup|down,type,rows,K\": "
                             f"[decoder, K-step, rows, warps(, K parts)], got {val!r}") from None
    return out
