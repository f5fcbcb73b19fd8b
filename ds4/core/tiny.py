"""Synthetic DS4-layout models: the embedded default, the test models and full-size shapes.

A synthetic model has every tensor and metadata key of a real DS4 Flash GGUF (spec §1.2, §2),
with the same block-format mix, at any size. Weights are random *valid* blocks scaled so that
activations stay O(1) through the whole forward pass; the vocabulary is the real DeepSeek V4 one
(or a small self-consistent subset for fast tests).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import numpy as np

from .config import ModelConfig
from .gguf_write import write_gguf
from .layout import TensorSpec, expected_tensors
from .quants import GGMLType as T
from .quants import encode, random_blocks

# Real DS4 Flash: 43 layers, two sliding layers then CSA/HCA alternating (spec §1.1).
_FLASH_RATIOS = (0, 0) + tuple(4 if il % 2 == 0 else 128 for il in range(2, 43))

PRESETS: dict[str, dict] = {
    # The embedded default: real vocabulary and type mix, small everything else, 6 layers that
    # cover every layer kind (sliding, CSA with indexer, HCA) and both routings (hash, top-k).
    "tiny": dict(
        n_layer=6, n_embd=256, vocab="real", n_head=4, head_dim=128, n_rot=64, q_lora_rank=128,
        o_lora_rank=128, o_groups=2, n_expert=16, n_expert_used=4, n_ff_exp=256, n_hash_layer=3,
        sliding_window=32, indexer_heads=4, indexer_head_dim=128, indexer_top_k=16, n_hc=4,
        hc_sinkhorn_iter=20, compress_ratios=(0, 0, 4, 16, 4, 16), context_length=8192),
    # The test model: a small vocabulary and small windows, so short prompts slide the raw window,
    # close several compressor windows of every ratio and overflow the indexer's top-k.
    "test": dict(
        n_layer=5, n_embd=256, vocab=512, n_head=4, head_dim=128, n_rot=64, q_lora_rank=64,
        o_lora_rank=64, o_groups=2, n_expert=8, n_expert_used=2, n_ff_exp=256, n_hash_layer=3,
        sliding_window=8, indexer_heads=4, indexer_head_dim=128, indexer_top_k=4, n_hc=4,
        hc_sinkhorn_iter=20, compress_ratios=(0, 0, 4, 8, 4), context_length=4096),
    # The real DeepSeek V4 Flash shapes (for benchmarks; ~81 GB if written).
    "flash": dict(
        n_layer=43, n_embd=4096, vocab="real", n_head=64, head_dim=512, n_rot=64, q_lora_rank=1024,
        o_lora_rank=1024, o_groups=8, n_expert=256, n_expert_used=6, n_ff_exp=2048, n_hash_layer=3,
        sliding_window=128, indexer_heads=64, indexer_head_dim=128, indexer_top_k=512, n_hc=4,
        hc_sinkhorn_iter=20, compress_ratios=_FLASH_RATIOS, context_length=1048576),
}

# Routed-expert block formats for `--experts` (gate/up, down).
EXPERT_MIXES = {
    "q2": (T.IQ2_XXS, T.Q2_K),
    "q4": (T.Q4_K, T.Q4_K),
    "q8": (T.Q8_0, T.Q8_0),
    "f16": (T.F16, T.F16),
    "f32": (T.F32, T.F32),
}


def preset_config(preset: str, vocab_size: int | None = None) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
    kw = dict(PRESETS[preset])
    vocab = kw.pop("vocab")
    n_vocab = vocab_size if vocab_size is not None else (129280 if vocab == "real" else vocab)
    kw["swiglu_clamp"] = (10.0,) * kw["n_layer"]
    return ModelConfig(n_vocab=n_vocab, name=f"ds4-synthetic-{preset}", **kw)


def preset_vocabulary(preset: str) -> tuple[list[str], list[str]]:
    from .tokenizer import real_vocabulary, small_vocabulary

    vocab = PRESETS[preset]["vocab"]
    return real_vocabulary() if vocab == "real" else small_vocabulary(vocab)


def make_tiny(path: str | os.PathLike, preset: str = "tiny", experts: str = "q2", seed: int = 0,
              progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a synthetic DS4 GGUF; the same arguments give a byte-identical file."""
    if experts not in EXPERT_MIXES:
        raise ValueError(f"experts: expected one of {', '.join(EXPERT_MIXES)}, got {experts!r}")
    tokens, merges = preset_vocabulary(preset)
    # The seed and expert mix are in the name, so models that differ only in their random
    # weights still get different fingerprints (which cover metadata, not weight bytes).
    cfg = dataclasses.replace(preset_config(preset, vocab_size=len(tokens)),
                              name=f"ds4-synthetic-{preset}-{experts}-seed{seed}")
    cfg.validate()
    specs = expected_tensors(cfg)
    gate_type, down_type = EXPERT_MIXES[experts]
    data = {}
    for i, spec in enumerate(specs.values()):
        ttype = spec.shipped
        if spec.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            ttype = gate_type
        elif spec.name.endswith("ffn_down_exps.weight"):
            ttype = down_type
        rng = np.random.default_rng([seed, i])
        data[spec.name] = (ttype, spec.dims, synthetic_tensor(spec, ttype, cfg, rng))
        if progress:
            progress(i + 1, len(specs))
    return write_gguf(path, cfg, data, tokens, merges)


def synthetic_tensor(spec: TensorSpec, ttype: T, cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for one tensor, with a magnitude chosen by the tensor's role."""
    name, dims = spec.name, spec.dims
    n = int(np.prod(dims, dtype=np.int64))
    if ttype == T.I32:  # tid2eid: n_expert_used distinct experts for every token id
        rows = np.argsort(rng.random((dims[1], cfg.n_expert)), axis=1)[:, : dims[0]]
        return encode(rows.astype(np.int32).reshape(-1), T.I32)
    if name.endswith("norm.weight"):
        return encode((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32), ttype)
    if name.endswith(("hc_attn_scale.weight", "hc_ffn_scale.weight", "output_hc_scale.weight")):
        return encode((0.5 + 0.5 * rng.random(n)).astype(np.float32), ttype)
    if name.endswith(("_base.weight", "exp_probs_b.bias")):
        return encode((0.1 * rng.standard_normal(n)).astype(np.float32), ttype)
    if name.endswith("attn_sinks.weight"):
        return encode(rng.standard_normal(n).astype(np.float32), ttype)
    if name.endswith("compressor_ape.weight"):
        return encode((0.5 * rng.standard_normal(n)).astype(np.float32), ttype)
    # Linear layers: unit-variance outputs for unit-RMS inputs; the embedding rows are O(1).
    scale = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(dims[0])
    return random_blocks(ttype, n, rng, scale=float(scale))

