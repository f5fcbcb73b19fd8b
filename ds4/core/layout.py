"""The DS4 tensor inventory (spec §2), derived from a ModelConfig.

One function says which tensors a model of a given config has, with their GGUF dims and the block
formats each may use. The GGUF loader validates files against it and `make-tiny` writes files from
it, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import CSA, ModelConfig
from .quants import GGMLType as T

# Which block formats a tensor role accepts. Shipped files use the first of each set; the
# float formats are accepted everywhere so a converted checkpoint (F32) loads unchanged.
FLOAT_ONLY = frozenset({T.F32})
DENSE = frozenset({T.F32, T.F16, T.BF16, T.Q8_0})
EXPERT = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q2_K, T.Q4_K, T.IQ2_XXS})
INDEX = frozenset({T.I32})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous axis
    types: frozenset
    shipped: T  # the type a real DS4 Flash q2 file uses (make-tiny's default mix)
    required: bool = True


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    specs: list[TensorSpec] = []

    def add(name, dims, types, shipped, required=True):
        specs.append(TensorSpec(name, tuple(int(d) for d in dims), types, shipped, required))

    E, V, HC = cfg.n_embd, cfg.n_vocab, cfg.n_hc
    add("token_embd.weight", (E, V), DENSE, T.F16)
    add("output_hc_fn.weight", (HC * E, HC), DENSE, T.F16)
    add("output_hc_base.weight", (HC,), FLOAT_ONLY, T.F32)
    add("output_hc_scale.weight", (1,), FLOAT_ONLY, T.F32)
    add("output_norm.weight", (E,), FLOAT_ONLY, T.F32)
    add("output.weight", (E, V), DENSE, T.Q8_0)

    D, IH, ID = cfg.head_dim, cfg.indexer_heads, cfg.indexer_head_dim
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        for sub in ("attn", "ffn"):
            add(p + f"hc_{sub}_fn.weight", (HC * E, cfg.hc_mix), DENSE, T.F16)
            add(p + f"hc_{sub}_scale.weight", (3,), FLOAT_ONLY, T.F32)
            add(p + f"hc_{sub}_base.weight", (cfg.hc_mix,), FLOAT_ONLY, T.F32)
        add(p + "attn_norm.weight", (E,), FLOAT_ONLY, T.F32)
        add(p + "attn_q_a.weight", (E, cfg.q_lora_rank), DENSE, T.Q8_0)
        add(p + "attn_q_a_norm.weight", (cfg.q_lora_rank,), FLOAT_ONLY, T.F32)
        add(p + "attn_q_b.weight", (cfg.q_lora_rank, cfg.n_head * D), DENSE, T.Q8_0)
        add(p + "attn_kv.weight", (E, D), DENSE, T.Q8_0)
        add(p + "attn_kv_a_norm.weight", (D,), FLOAT_ONLY, T.F32)
        add(p + "attn_sinks.weight", (cfg.n_head,), FLOAT_ONLY, T.F32)
        add(p + "attn_output_a.weight", (cfg.n_head * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank),
            DENSE, T.Q8_0)
        add(p + "attn_output_b.weight", (cfg.o_groups * cfg.o_lora_rank, E), DENSE, T.Q8_0)
        ratio = cfg.ratio(il)
        if ratio:
            w = cfg.compressor_lanes(il) * D
            add(p + "attn_compressor_ape.weight", (w, ratio), DENSE, T.F16)
            add(p + "attn_compressor_kv.weight", (E, w), DENSE, T.F16)
            add(p + "attn_compressor_gate.weight", (E, w), DENSE, T.F16)
            add(p + "attn_compressor_norm.weight", (D,), FLOAT_ONLY, T.F32)
        if cfg.layer_kind(il) == CSA:
            add(p + "indexer.attn_q_b.weight", (cfg.q_lora_rank, IH * ID), DENSE, T.F16)
            add(p + "indexer.proj.weight", (E, IH), DENSE, T.F16)
            add(p + "indexer_compressor_ape.weight", (2 * ID, ratio), DENSE, T.F16)
            add(p + "indexer_compressor_kv.weight", (E, 2 * ID), DENSE, T.F16)
            add(p + "indexer_compressor_gate.weight", (E, 2 * ID), DENSE, T.F16)
            add(p + "indexer_compressor_norm.weight", (ID,), FLOAT_ONLY, T.F32)
        add(p + "ffn_norm.weight", (E,), FLOAT_ONLY, T.F32)
        add(p + "ffn_gate_inp.weight", (E, cfg.n_expert), DENSE, T.F16)
        if cfg.is_hash_layer(il):
            add(p + "ffn_gate_tid2eid.weight", (cfg.n_expert_used, V), INDEX, T.I32)
        else:
            # Optional in ds4 (absent = zero bias); shipped files carry it on every top-k layer.
            add(p + "exp_probs_b.bias", (cfg.n_expert,), FLOAT_ONLY, T.F32, required=False)
        F = cfg.n_ff_exp
        add(p + "ffn_gate_exps.weight", (E, F, cfg.n_expert), EXPERT, T.IQ2_XXS)
        add(p + "ffn_up_exps.weight", (E, F, cfg.n_expert), EXPERT, T.IQ2_XXS)
        add(p + "ffn_down_exps.weight", (F, E, cfg.n_expert), EXPERT, T.Q2_K)
        add(p + "ffn_gate_shexp.weight", (E, F), DENSE, T.Q8_0)
        add(p + "ffn_up_shexp.weight", (E, F), DENSE, T.Q8_0)
        add(p + "ffn_down_shexp.weight", (F, E), DENSE, T.Q8_0)
    return {s.name: s for s in specs}
