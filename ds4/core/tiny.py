"""Synthetic DS4-layout models: the embedded default, the test models and full-size shapes.

A synthetic model has every tensor and metadata key of a real DS4 Flash GGUF (spec §1.2, §2),
with the same block-format mix, at any size. Weights are random *valid* blocks scaled so that
activations stay O(1) through the whole forward pass; the vocabulary is the real DeepSeek V4 one
(or a small self-consistent subset for fast tests).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import numpy as np

from .config import ModelConfig
from .gguf_write import write_gguf
from .layout import TensorSpec, expected_tensors
from .quants import GGMLType as T
from .quants import block_format, encode, random_blocks

REAL_VOCAB_SIZE = 129280  # DeepSeek V4's vocabulary
MIN_SMALL_VOCAB = 300  # the smallest self-consistent byte-level vocabulary (tokenizer.small_vocabulary)
MIN_TINY_VOCAB = 5  # below MIN_SMALL_VOCAB: BOS, EOS, two byte symbols and their merge

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


def preset_config(preset: str, vocab_size: int | None = None, **sizes) -> ModelConfig:
    """A preset's config; `sizes` replace any ModelConfig field (n_layer without
    swiglu_clamp keeps the preset's clamp on every layer). Not validated here."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
    kw = dict(PRESETS[preset])
    vocab = kw.pop("vocab")
    n_vocab = vocab_size if vocab_size is not None else (REAL_VOCAB_SIZE if vocab == "real" else vocab)
    unknown = sorted(set(sizes) - {f.name for f in dataclasses.fields(ModelConfig)} - {"n_vocab"})
    if unknown:
        raise ValueError(f"sizes: unknown ModelConfig field(s) {', '.join(unknown)}")
    kw.update(sizes)
    kw.setdefault("n_vocab", n_vocab)
    kw.setdefault("swiglu_clamp", (10.0,) * kw["n_layer"])
    kw.setdefault("name", f"ds4-synthetic-{preset}")
    return ModelConfig(**kw)


def preset_vocabulary(preset: str) -> tuple[list[str], list[str]]:
    vocab = PRESETS[preset]["vocab"]
    return synthetic_vocabulary(REAL_VOCAB_SIZE if vocab == "real" else vocab)


def synthetic_vocabulary(n_tokens: int) -> tuple[list[str], list[str]]:
    """(tokens, merges) for a model of n_tokens ids: the real vocabulary at its own size, a
    self-consistent byte-level one from MIN_SMALL_VOCAB ids, and below that BOS, EOS, the first
    byte symbols and one merge of the first two (a GGUF cannot store an empty merge list):
    enough for the forward pass, whose token ids are just rows, but a tokenizer of it encodes
    only text made of those bytes."""
    from .tokenizer import BOS, EOS, _byte_chars, real_vocabulary, small_vocabulary

    if n_tokens == REAL_VOCAB_SIZE:
        return real_vocabulary()
    if n_tokens >= MIN_SMALL_VOCAB:
        return small_vocabulary(n_tokens)
    if n_tokens < MIN_TINY_VOCAB:
        raise ValueError(f"n_tokens: expected at least {MIN_TINY_VOCAB} (BOS, EOS, two byte "
                         f"symbols and their merge), got {n_tokens}")
    chars = _byte_chars()[: n_tokens - 3]
    return [BOS, EOS, *chars, chars[0] + chars[1]], [f"{chars[0]} {chars[1]}"]


def role_of(name: str) -> str:
    """A tensor's role, the same on every layer: 'blk.3.attn_q_a.weight' -> 'attn_q_a.weight'."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def tensor_types(cfg: ModelConfig, types: Mapping[str, T] | None = None) -> dict[str, T]:
    """Each tensor's block format: `types` names a tensor ('blk.2.attn_kv.weight') or a role
    ('attn_kv.weight', every layer's), the tensor's name winning; the rest keep the shipped
    type. Every choice is checked as the loader checks a file: a type the role accepts, whole
    blocks along dims[0], and routed gate/up of one type."""
    specs = expected_tensors(cfg)
    types = dict(types or {})
    roles = {role_of(n) for n in specs}
    unknown = sorted(k for k in types if k not in specs and k not in roles)
    if unknown:
        raise ValueError(f"types: {', '.join(unknown)}: expected a tensor name or role of this "
                         f"layout ({', '.join(sorted(roles))})")
    out = {}
    for name, spec in specs.items():
        ttype = T(types.get(name, types.get(role_of(name), spec.shipped)))
        if ttype not in spec.types:
            allowed = ", ".join(sorted(t.name for t in spec.types))
            raise ValueError(f"{name}: expected type one of {allowed}, got {ttype.name}")
        unit = block_format(ttype).block_values
        if spec.dims[0] % unit:
            raise ValueError(f"{name}: type {ttype.name} needs dims[0] a multiple of {unit}, "
                             f"got {spec.dims[0]}")
        out[name] = ttype
    for il in range(cfg.n_layer):
        g, u = (out[f"blk.{il}.ffn_{k}_exps.weight"] for k in ("gate", "up"))
        if g != u:
            raise ValueError(f"blk.{il}.ffn_up_exps.weight: expected the gate's type {g.name}, "
                             f"got {u.name}")
    return out


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
    gate_type, down_type = EXPERT_MIXES[experts]
    types = {"ffn_gate_exps.weight": gate_type, "ffn_up_exps.weight": gate_type,
             "ffn_down_exps.weight": down_type}
    return make_synthetic(path, cfg, types, seed, (tokens, merges), progress)


def make_synthetic(path: str | os.PathLike, cfg: ModelConfig, types: Mapping[str, T] | None = None,
                   seed: int = 0, vocabulary: tuple[list[str], list[str]] | None = None,
                   progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a synthetic DS4 GGUF of any valid config, with any accepted block format per tensor
    or role (tensor_types); the vocabulary defaults to synthetic_vocabulary(n_vocab). The same
    arguments give a byte-identical file."""
    cfg.validate()
    chosen = tensor_types(cfg, types)
    tokens, merges = vocabulary if vocabulary is not None else synthetic_vocabulary(cfg.n_vocab)
    specs = expected_tensors(cfg)
    data = {}
    for i, spec in enumerate(specs.values()):
        ttype = chosen[spec.name]
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

