"""Convert a transformers DeepseekV4 checkpoint (state dict + config) into a DS4-layout GGUF.

The name table is spec §8.4. GGUF dims are the torch shapes reversed, so a linear layer's
`weight [out, in]` is written as is (dims `[in, out]`) with no transposition; the only reshapes are
the packed expert `gate_up_proj [E, 2F, H]` (gate = rows 0..F−1, up = rows F..2F−1 of every expert)
and the hash table `tid2eid` (int64 `[V, k]` -> I32 dims `[k, V]`). Every float tensor is written as
F32, so nothing is lost and the result can be compared against transformers (numerics="exact").

This module stays framework-free: the caller turns the torch state dict into numpy first, e.g.
`{k: v.detach().float().numpy() for k, v in model.state_dict().items()}` and passes
`model.config.to_dict()` as `hf_config`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from .config import CSA, CSA_RATIO, HCA, SLIDING, ModelConfig
from .gguf_write import write_gguf
from .layout import expected_tensors
from .quants import GGMLType as T
from .quants import encode

REAL_VOCAB = 129280

# transformers `layer_types` / `mlp_layer_types` vocabulary
_LAYER_TYPES = (SLIDING, CSA, HCA)
_HASH, _MOE = "hash_moe", "moe"
# legacy per-layer ratios of the Flash config.json (`compress_ratios`)
_LEGACY_RATIO_TYPE = {0: SLIDING, CSA_RATIO: CSA, 128: HCA}


# ---------------------------------------------------------------------------------------------
# config


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(f"hf_config: {msg}")


def _rope_params(hf: Mapping) -> tuple[dict, dict]:
    """(main, compress) rope parameter dicts, from the nested V4 form or the legacy flat keys."""
    rp = hf.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp["main"]), dict(rp["compress"])
    # legacy: rope_theta / compress_rope_theta plus a flat yarn dict (rope_scaling or rope_parameters)
    flat = {k: v for k, v in {**(hf.get("rope_scaling") or {}), **rp}.items()
            if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    compress = {**flat, "rope_theta": hf.get("compress_rope_theta", 160000.0)}
    compress.setdefault("rope_type", compress.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _layer_ratios(hf: Mapping, n_layer: int) -> tuple[int, ...]:
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("compress_ratios") is not None:
        legacy = list(hf["compress_ratios"])[:n_layer]
        bad = [r for r in legacy if r not in _LEGACY_RATIO_TYPE]
        _need(not bad, f"compress_ratios: expected entries in {sorted(_LEGACY_RATIO_TYPE)}, got {bad}")
        layer_types = [_LEGACY_RATIO_TYPE[r] for r in legacy]
    _need(layer_types is not None, "layer_types (or legacy compress_ratios) is required: "
          "transformers' default is the V4-Pro pattern, not Flash's")
    layer_types = list(layer_types)[:n_layer]
    _need(len(layer_types) == n_layer,
          f"layer_types: expected {n_layer} entries (num_hidden_layers), got {len(layer_types)}")
    bad = sorted({t for t in layer_types if t not in _LAYER_TYPES})
    _need(not bad, f"layer_types: expected entries in {_LAYER_TYPES}, got {bad}")
    rates = {CSA: CSA_RATIO, HCA: 128, **(hf.get("compress_rates") or {})}
    if hf.get("compress_rate_csa") is not None:
        rates[CSA] = hf["compress_rate_csa"]
    if hf.get("compress_rate_hca") is not None:
        rates[HCA] = hf["compress_rate_hca"]
    csa, hca = int(rates[CSA]), int(rates[HCA])
    # ds4 tells the layer kinds apart by ratio alone: 4 is CSA, any other nonzero ratio is HCA.
    if CSA in layer_types:
        _need(csa == CSA_RATIO, f"compress_rates[{CSA!r}]: expected {CSA_RATIO} "
              f"(a DS4 GGUF marks CSA layers by ratio 4), got {csa}")
    if HCA in layer_types:
        _need(hca >= 2 and hca != CSA_RATIO, f"compress_rates[{HCA!r}]: expected a ratio ≥ 2 "
              f"other than {CSA_RATIO} (ratio 4 means CSA in a DS4 GGUF), got {hca}")
    return tuple({SLIDING: 0, CSA: csa, HCA: hca}[t] for t in layer_types)


def _hash_layers(hf: Mapping, n_layer: int) -> int:
    mlp = hf.get("mlp_layer_types")
    if mlp is None:
        n = hf.get("num_hash_layers")
        return min(n_layer, 3 if n is None else int(n))
    mlp = list(mlp)[:n_layer]
    _need(len(mlp) == n_layer, f"mlp_layer_types: expected {n_layer} entries, got {len(mlp)}")
    bad = sorted({t for t in mlp if t not in (_HASH, _MOE)})
    _need(not bad, f"mlp_layer_types: expected entries in {(_HASH, _MOE)}, got {bad}")
    n_hash = next((i for i, t in enumerate(mlp) if t != _HASH), n_layer)
    late = [i for i, t in enumerate(mlp) if t == _HASH and i >= n_hash]
    _need(not late, f"mlp_layer_types: DS4 hash-routes a leading run of layers only; "
          f"'{_HASH}' after the first '{_MOE}' at layer(s) {late}")
    return n_hash


def config_from_hf(hf: Mapping, name: str = "") -> ModelConfig:
    """A ModelConfig from a transformers DeepseekV4Config dict (`config.to_dict()`)."""
    hf = dict(hf)
    if "model_type" in hf:
        _need(hf["model_type"] == "deepseek_v4",
              f"model_type: expected 'deepseek_v4', got {hf['model_type']!r}")

    def get(key, default=None, *aliases):
        for k in (key, *aliases):
            if hf.get(k) is not None:
                return hf[k]
        if default is None:
            raise ValueError(f"hf_config: {key} is required")
        return default

    # Features a DS4 GGUF cannot express.
    for key, want in (("num_key_value_heads", 1), ("n_shared_experts", 1),
                      ("scoring_func", "sqrtsoftplus"), ("norm_topk_prob", True),
                      ("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if key in hf and hf[key] is not None:
            _need(hf[key] == want, f"{key}: expected {want!r} (the only value DS4 supports), "
                  f"got {hf[key]!r}")
    for key in ("n_group", "topk_group"):
        _need(not hf.get(key), f"{key}: expert grouping is not part of DS4, got {hf.get(key)}")

    n_layer = int(get("num_hidden_layers"))
    head_dim = int(get("head_dim"))
    main, compress = _rope_params(hf)
    if hf.get("qk_rope_head_dim") is not None:
        n_rot = int(hf["qk_rope_head_dim"])
    else:
        prf = main.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 64 / 512
        n_rot = int(head_dim * prf)
    _need(main.get("rope_type", "default") == "default",
          f"rope_parameters['main']: expected plain RoPE (rope_type 'default'), got {main.get('rope_type')!r}")
    ctype = compress.get("rope_type", compress.get("type", "default"))
    _need(ctype in ("default", "yarn"),
          f"rope_parameters['compress']: expected rope_type 'yarn' or 'default', got {ctype!r}")
    max_pos = int(get("max_position_embeddings", 1048576))
    if ctype == "yarn":
        orig = int(compress["original_max_position_embeddings"])
        factor = float(compress.get("factor") or max_pos / orig)
        attn = compress.get("attention_factor")
        _need(attn is not None and math.isclose(float(attn), 1.0),
              f"rope_parameters['compress']: DS4 applies YaRN without an amplitude (mscale) "
              f"correction, so attention_factor must be 1.0, got {attn}")
        beta_fast = float(compress.get("beta_fast") or 32.0)
        beta_slow = float(compress.get("beta_slow") or 1.0)
    else:
        orig, factor, beta_fast, beta_slow = max_pos, 1.0, 32.0, 1.0

    cfg = ModelConfig(
        n_layer=n_layer,
        n_embd=int(get("hidden_size")),
        n_vocab=int(get("vocab_size")),
        n_head=int(get("num_attention_heads")),
        head_dim=head_dim,
        n_rot=n_rot,
        q_lora_rank=int(get("q_lora_rank")),
        o_lora_rank=int(get("o_lora_rank")),
        o_groups=int(get("o_groups")),
        n_expert=int(get("n_routed_experts", None, "num_local_experts")),
        n_expert_used=int(get("num_experts_per_tok")),
        n_ff_exp=int(get("moe_intermediate_size", None, "intermediate_size")),
        n_hash_layer=_hash_layers(hf, n_layer),
        sliding_window=int(get("sliding_window")),
        indexer_heads=int(get("index_n_heads")),
        indexer_head_dim=int(get("index_head_dim")),
        indexer_top_k=int(get("index_topk")),
        n_hc=int(get("hc_mult")),
        hc_sinkhorn_iter=int(get("hc_sinkhorn_iters")),
        compress_ratios=_layer_ratios(hf, n_layer),
        swiglu_clamp=(float(get("swiglu_limit")),) * n_layer,
        rope_freq_base=float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
        compress_rope_freq_base=float(compress.get("rope_theta", hf.get("compress_rope_theta", 160000.0))),
        rope_scale_factor=factor,
        rope_orig_ctx=orig,
        yarn_beta_fast=beta_fast,
        yarn_beta_slow=beta_slow,
        expert_weights_scale=float(get("routed_scaling_factor")),
        rms_eps=float(get("rms_norm_eps")),
        hc_eps=float(get("hc_eps")),
        context_length=max_pos,
        name=name or str(hf.get("_name_or_path") or "") or "ds4-converted",
    )
    try:
        cfg.validate()
    except ValueError as e:
        raise ValueError(f"hf_config: {e}") from e
    return cfg


# ---------------------------------------------------------------------------------------------
# tensors

# (transformers key, GGUF name, how to cut the GGUF tensor out of the transformers one)
_Slice = Callable[[np.ndarray], np.ndarray]


def _whole(x: np.ndarray) -> np.ndarray:
    return x


def _rows(lo_half: bool) -> _Slice:
    def cut(x: np.ndarray) -> np.ndarray:  # gate_up_proj [E, 2F, H] -> [E, F, H]
        f = x.shape[1] // 2
        return x[:, :f] if lo_half else x[:, f:]
    return cut


_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
    "model.hc_head.hc_fn": "output_hc_fn.weight",
    "model.hc_head.hc_base": "output_hc_base.weight",
    "model.hc_head.hc_scale": "output_hc_scale.weight",
}
_LAYER = {  # every layer: transformers suffix -> GGUF suffix
    "attn_hc.fn": "hc_attn_fn.weight",
    "attn_hc.base": "hc_attn_base.weight",
    "attn_hc.scale": "hc_attn_scale.weight",
    "ffn_hc.fn": "hc_ffn_fn.weight",
    "ffn_hc.base": "hc_ffn_base.weight",
    "ffn_hc.scale": "hc_ffn_scale.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_norm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_proj.weight": "attn_kv.weight",
    "self_attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.o_a_proj.weight": "attn_output_a.weight",
    "self_attn.o_b_proj.weight": "attn_output_b.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_COMPRESSOR = {  # ratio ≠ 0
    "self_attn.compressor.position_bias": "attn_compressor_ape.weight",
    "self_attn.compressor.kv_proj.weight": "attn_compressor_kv.weight",
    "self_attn.compressor.gate_proj.weight": "attn_compressor_gate.weight",
    "self_attn.compressor.kv_norm.weight": "attn_compressor_norm.weight",
}
_INDEXER = {  # ratio 4
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.attn_q_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.proj.weight",
    "self_attn.compressor.indexer.position_bias": "indexer_compressor_ape.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "indexer_compressor_kv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "indexer_compressor_gate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "indexer_compressor_norm.weight",
}


def tensor_plan(cfg: ModelConfig) -> dict[str, list[tuple[str, _Slice]]]:
    """transformers key -> the GGUF tensors cut from it (one, or two for gate_up_proj)."""
    plan: dict[str, list[tuple[str, _Slice]]] = {k: [(v, _whole)] for k, v in _GLOBAL.items()}
    for il in range(cfg.n_layer):
        hf, gg = f"model.layers.{il}.", f"blk.{il}."
        table = dict(_LAYER)
        if cfg.ratio(il):
            table.update(_COMPRESSOR)
        if cfg.layer_kind(il) == CSA:
            table.update(_INDEXER)
        table["mlp.gate.tid2eid" if cfg.is_hash_layer(il) else "mlp.gate.e_score_correction_bias"] = (
            "ffn_gate_tid2eid.weight" if cfg.is_hash_layer(il) else "exp_probs_b.bias")
        for k, v in table.items():
            plan[hf + k] = [(gg + v, _whole)]
        plan[hf + "mlp.experts.gate_up_proj"] = [(gg + "ffn_gate_exps.weight", _rows(True)),
                                                 (gg + "ffn_up_exps.weight", _rows(False))]
    return plan


def _torch_shape(gguf_dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(gguf_dims))


def convert_hf_state(state: Mapping[str, np.ndarray], hf_config: Mapping,
                     out_path: str | os.PathLike, tokens: list[str] | None = None,
                     merges: list[str] | None = None, name: str = "") -> Path:
    """Write `state` (transformers DeepseekV4ForCausalLM names, numpy arrays) as a DS4 GGUF.

    Floats become F32, `tid2eid` becomes I32. Without `tokens`, a model with the real vocabulary
    size gets the real DeepSeek V4 vocabulary and a smaller one a self-consistent byte-level
    vocabulary of exactly `vocab_size` ids (≥ 300). Any unknown, missing or mis-shaped key, or a
    config feature DS4 cannot express, raises ValueError naming it.
    """
    cfg = config_from_hf(hf_config, name)
    specs = expected_tensors(cfg)
    plan = tensor_plan(cfg)

    unknown = sorted(k for k in state if k not in plan)
    missing = sorted(k for k, outs in plan.items()
                     if k not in state and any(specs[g].required for g, _ in outs))
    problems = []
    if unknown:
        problems.append(f"unknown state-dict key(s): {', '.join(unknown)}")
    if missing:
        problems.append(f"missing state-dict key(s): {', '.join(missing)}")
    if problems:
        raise ValueError("; ".join(problems))

    tensors: dict[str, tuple[T, tuple[int, ...], np.ndarray]] = {}
    for key, outs in plan.items():
        if key not in state:
            continue  # an optional tensor (exp_probs_b: absent = zero bias)
        x = np.asarray(state[key])
        if len(outs) == 2:  # packed gate/up: [E, 2F, H]
            s = specs[outs[0][0]]
            want = (s.dims[2], 2 * s.dims[1], s.dims[0])
        else:
            want = _torch_shape(specs[outs[0][0]].dims)
        if x.shape != want:
            raise ValueError(f"{key}: expected shape {list(want)}, got {list(x.shape)}")
        for gname, cut in outs:
            spec = specs[gname]
            if spec.types == frozenset({T.I32}):
                tensors[gname] = (T.I32, spec.dims, _tid2eid(key, x, cfg))
            else:
                if not (np.issubdtype(x.dtype, np.floating)):
                    raise ValueError(f"{key}: expected a float array, got dtype {x.dtype}")
                v = np.ascontiguousarray(cut(x), dtype=np.float32)
                if not np.isfinite(v).all():
                    raise ValueError(f"{key}: contains non-finite values")
                tensors[gname] = (T.F32, spec.dims, encode(v.reshape(-1), T.F32))
    # write in layout order, so the same checkpoint always gives the same bytes
    tensors = {n: tensors[n] for n in specs if n in tensors}

    if tokens is None:
        from .tokenizer import real_vocabulary, small_vocabulary

        if cfg.n_vocab == REAL_VOCAB:
            tokens, merges = real_vocabulary()
        elif cfg.n_vocab >= 300:
            tokens, merges = small_vocabulary(cfg.n_vocab)
        else:
            raise ValueError(f"vocab_size {cfg.n_vocab}: pass tokens/merges (a generated "
                             f"vocabulary needs at least 300 ids)")
    tokens = list(tokens)
    if len(tokens) != cfg.n_vocab:
        raise ValueError(f"tokens: expected vocab_size={cfg.n_vocab} entries, got {len(tokens)}")
    return write_gguf(out_path, cfg, tensors, tokens, list(merges or []))


def _tid2eid(key: str, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """int64 [V, k] -> I32 bytes of GGUF dims [k, V] (same memory order: row = token id)."""
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"{key}: expected an integer array, got dtype {x.dtype}")
    if x.size and (x.min() < 0 or x.max() >= cfg.n_expert):
        raise ValueError(f"{key}: expert ids must lie in [0, {cfg.n_expert}), "
                         f"got [{x.min()}, {x.max()}]")
    return encode(np.ascontiguousarray(x, dtype=np.int32).reshape(-1), T.I32)
