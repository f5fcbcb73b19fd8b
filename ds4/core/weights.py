"""The model's weights grouped the way the forward pass uses them.

`bind_weights` walks the GGUF tensor names once and hands each tensor to the backend's `upload`,
which decides how the weight lives (a memory-mapped view, a device buffer, an MLX array). The
graph then only sees these records, never names or bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .config import CSA, ModelConfig
from .gguf_model import GGUFModel, Tensor
from .tp_split import RankPart

Handle = Any  # whatever the backend's upload returned


@dataclass
class HyperConnection:
    fn: Handle
    scale: Handle
    base: Handle


@dataclass
class Compressor:
    ape: Handle
    kv: Handle
    gate: Handle
    norm: Handle


@dataclass
class Indexer:
    q_b: Handle
    proj: Handle
    compressor: Compressor


@dataclass
class LayerWeights:
    il: int
    hc_attn: HyperConnection
    hc_ffn: HyperConnection
    attn_norm: Handle
    attn_q_a: Handle
    attn_q_a_norm: Handle
    attn_q_b: Handle
    attn_kv: Handle
    attn_kv_a_norm: Handle
    attn_sinks: Handle
    attn_output_a: Handle
    attn_output_b: Handle
    compressor: Compressor | None
    indexer: Indexer | None
    ffn_norm: Handle
    ffn_gate_inp: Handle
    exp_probs_b: Handle | None  # top-k layers (None = zero bias)
    tid2eid: Handle | None  # hash layers
    ffn_gate_exps: Handle
    ffn_up_exps: Handle
    ffn_down_exps: Handle
    ffn_gate_shexp: Handle | None  # None on a tensor-parallel rank other than 0
    ffn_up_shexp: Handle | None
    ffn_down_shexp: Handle | None
    experts: range | None = None  # the routed experts held (a tensor-parallel rank); None = all


@dataclass
class ModelWeights:
    cfg: ModelConfig
    layers: dict[int, LayerWeights]
    token_embd: Handle | None = None
    output_hc: HyperConnection | None = None
    output_norm: Handle | None = None
    output: Handle | None = None


def bind_weights(model: GGUFModel, upload: Callable[[Tensor], Handle],
                 layers: range | None = None, embedding: bool = True, head: bool = True,
                 part: RankPart | None = None) -> ModelWeights:
    """Upload the tensors a node needs: its layer range, optionally the embedding and head, and
    of a tensor-parallel rank (`part`) only its part of each split tensor (core/tp_split.py)."""
    cfg = model.config
    layers = range(cfg.n_layer) if layers is None else layers

    def up(name: str) -> Handle | None:
        t = model.tensor(name)
        if part is None:
            return upload(t)
        return upload(part.slice(t, cfg)) if part.holds(name) else None

    def maybe(name: str) -> Handle | None:
        t = model.get(name)
        return None if t is None else upload(t)

    def hc(prefix: str) -> HyperConnection:
        return HyperConnection(up(prefix + "_fn.weight"), up(prefix + "_scale.weight"),
                               up(prefix + "_base.weight"))

    def compressor(prefix: str) -> Compressor:
        return Compressor(*(up(f"{prefix}_{k}.weight") for k in ("ape", "kv", "gate", "norm")))

    w = ModelWeights(cfg, {})
    if embedding:
        w.token_embd = up("token_embd.weight")
    if head:
        w.output_hc = HyperConnection(up("output_hc_fn.weight"), up("output_hc_scale.weight"),
                                      up("output_hc_base.weight"))
        w.output_norm = up("output_norm.weight")
        w.output = up("output.weight")
    for il in layers:
        p = f"blk.{il}."
        kind = cfg.layer_kind(il)
        w.layers[il] = LayerWeights(
            il=il,
            hc_attn=hc(p + "hc_attn"),
            hc_ffn=hc(p + "hc_ffn"),
            attn_norm=up(p + "attn_norm.weight"),
            attn_q_a=up(p + "attn_q_a.weight"),
            attn_q_a_norm=up(p + "attn_q_a_norm.weight"),
            attn_q_b=up(p + "attn_q_b.weight"),
            attn_kv=up(p + "attn_kv.weight"),
            attn_kv_a_norm=up(p + "attn_kv_a_norm.weight"),
            attn_sinks=up(p + "attn_sinks.weight"),
            attn_output_a=up(p + "attn_output_a.weight"),
            attn_output_b=up(p + "attn_output_b.weight"),
            compressor=compressor(p + "attn_compressor") if cfg.ratio(il) else None,
            indexer=Indexer(up(p + "indexer.attn_q_b.weight"), up(p + "indexer.proj.weight"),
                            compressor(p + "indexer_compressor")) if kind == CSA else None,
            ffn_norm=up(p + "ffn_norm.weight"),
            ffn_gate_inp=up(p + "ffn_gate_inp.weight"),
            exp_probs_b=None if cfg.is_hash_layer(il) else maybe(p + "exp_probs_b.bias"),
            tid2eid=up(p + "ffn_gate_tid2eid.weight") if cfg.is_hash_layer(il) else None,
            ffn_gate_exps=up(p + "ffn_gate_exps.weight"),
            ffn_up_exps=up(p + "ffn_up_exps.weight"),
            ffn_down_exps=up(p + "ffn_down_exps.weight"),
            ffn_gate_shexp=up(p + "ffn_gate_shexp.weight"),
            ffn_up_shexp=up(p + "ffn_up_shexp.weight"),
            ffn_down_shexp=up(p + "ffn_down_shexp.weight"),
            experts=None if part is None else part.experts,
        )
    return w
