"""Model hyperparameters read from (and written to) the `deepseek4.*` GGUF metadata.

Nothing here is sized from the real model's constants: every dimension comes from the file, and
the file is checked against the *structural* rules of DS4 (spec §1) rather than against 43 layers
of 4096. That is what lets the same engine run the 284B model and a 2 MB synthetic one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from gguf import GGUFValueType

ARCH = "deepseek4"


class ConfigError(ValueError):
    """A metadata key is missing, has the wrong GGUF type, or an inconsistent value."""


# Layer kinds, in the model's own vocabulary (transformers' `layer_types`).
SLIDING = "sliding_attention"  # ratio 0: raw window only
CSA = "compressed_sparse_attention"  # ratio 4: overlapping compressor + indexer top-k
HCA = "heavily_compressed_attention"  # any other ratio: one-lane compressor, all rows visible

CSA_RATIO = 4


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    head_dim: int
    n_rot: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_hash_layer: int
    sliding_window: int
    indexer_heads: int
    indexer_head_dim: int
    indexer_top_k: int
    n_hc: int
    hc_sinkhorn_iter: int
    compress_ratios: tuple[int, ...]
    swiglu_clamp: tuple[float, ...]
    rope_freq_base: float = 10000.0
    compress_rope_freq_base: float = 160000.0
    rope_scale_factor: float = 16.0
    rope_orig_ctx: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    expert_weights_scale: float = 1.5
    rms_eps: float = 1e-6
    hc_eps: float = 1e-6
    n_expert_shared: int = 1
    context_length: int = 1048576
    name: str = ""

    # ---- derived facts the graph and the state layout use -------------------------------------

    @property
    def n_nope(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def hc_mix(self) -> int:
        """Width of an mHC mixing projection: n_hc pre + n_hc post + n_hc² comb weights."""
        return (2 + self.n_hc) * self.n_hc

    def ratio(self, il: int) -> int:
        return self.compress_ratios[il]

    def layer_kind(self, il: int) -> str:
        r = self.compress_ratios[il]
        return SLIDING if r == 0 else CSA if r == CSA_RATIO else HCA

    def compressor_lanes(self, il: int) -> int:
        """c of spec §3.5: a CSA compressor carries two overlapping lanes, HCA one."""
        return 2 if self.compress_ratios[il] == CSA_RATIO else 1

    def is_hash_layer(self, il: int) -> bool:
        return il < self.n_hash_layer

    @property
    def min_ratio(self) -> int:
        nz = [r for r in self.compress_ratios[: self.n_layer] if r]
        return min(nz) if nz else 0

    def validate(self) -> None:
        """Structural rules every DS4-layout model obeys, whatever its size."""

        def need(ok: bool, key: str, expected: str, actual) -> None:
            if not ok:
                raise ConfigError(f"{ARCH}.{key}: expected {expected}, got {actual}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and f.name != "n_hash_layer":
                need(v > 0, _KEY_OF.get(f.name, f.name), "a positive integer", v)
        need(self.n_rot % 2 == 0 and self.n_rot <= self.head_dim, "rope.dimension_count",
             f"an even number ≤ key_length {self.head_dim}", self.n_rot)
        need(self.n_head % self.o_groups == 0, "attention.output_group_count",
             f"a divisor of head_count {self.n_head}", self.o_groups)
        need(self.n_expert_used <= self.n_expert, "expert_used_count",
             f"≤ expert_count {self.n_expert}", self.n_expert_used)
        need(0 <= self.n_hash_layer <= self.n_layer, "hash_layer_count",
             f"between 0 and block_count {self.n_layer}", self.n_hash_layer)
        need(self.n_expert_shared == 1, "expert_shared_count", "1", self.n_expert_shared)
        need(len(self.compress_ratios) >= self.n_layer, "attention.compress_ratios",
             f"at least block_count={self.n_layer} entries", len(self.compress_ratios))
        need(len(self.swiglu_clamp) >= self.n_layer, "swiglu_clamp_exp",
             f"at least block_count={self.n_layer} entries", len(self.swiglu_clamp))
        for il, r in enumerate(self.compress_ratios[: self.n_layer]):
            need(r == 0 or r >= 2, f"attention.compress_ratios[{il}]", "0 or a ratio ≥ 2", r)
        need(self.n_rot <= self.indexer_head_dim, "attention.indexer.key_length",
             f"≥ rope.dimension_count {self.n_rot} (the indexer RoPEs its last n_rot dims)",
             self.indexer_head_dim)

    def check_ds4_numerics(self) -> None:
        """The ds4 numerics simulations (spec §3.10) assume block-aligned dimensions."""
        if self.n_nope % 64:
            raise ConfigError(
                f"numerics='ds4' needs key_length − rope.dimension_count to be a multiple of 64 "
                f"(FP8 blocks), got {self.head_dim} − {self.n_rot} = {self.n_nope}; use numerics='exact'")
        d = self.indexer_head_dim
        if d % 32 or d & (d - 1):
            raise ConfigError(
                f"numerics='ds4' needs attention.indexer.key_length to be a power of two and a "
                f"multiple of 32 (Hadamard + FP4 blocks), got {d}; use numerics='exact'")

    # ---- metadata <-> config --------------------------------------------------------------------

    def to_metadata(self) -> list[tuple[str, GGUFValueType, object]]:
        """The (key, GGUF type, value) list a DS4 GGUF carries, in ds4's conventions."""
        u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
        out = [(f"{ARCH}.{key}", u32, getattr(self, attr)) for attr, key in _U32_KEYS]
        out += [
            (f"{ARCH}.expert_group_count", u32, 0),
            (f"{ARCH}.expert_group_used_count", u32, 0),
            (f"{ARCH}.attention.value_length", u32, self.head_dim),
            (f"{ARCH}.attention.head_count_kv", u32, 1),
            (f"{ARCH}.attention.compress_ratios", GGUFValueType.INT32, list(self.compress_ratios)),
            (f"{ARCH}.swiglu_clamp_exp", f32, list(self.swiglu_clamp)),
            (f"{ARCH}.rope.scaling.original_context_length", GGUFValueType.UINT64, self.rope_orig_ctx),
            (f"{ARCH}.context_length", u32, self.context_length),
            (f"{ARCH}.expert_weights_norm", GGUFValueType.BOOL, True),
        ]
        out += [(f"{ARCH}.{key}", f32, getattr(self, attr)) for attr, key in _FLOAT_KEYS]
        return out

    @classmethod
    def from_metadata(cls, fields: dict[str, tuple[list[GGUFValueType], object]]) -> "ModelConfig":
        """Build from {key: (gguf types, value)}; every problem names the key, expected and actual."""
        md = _Metadata(fields)
        arch = md.optional("general.architecture", (GGUFValueType.STRING,), ARCH)
        if arch != ARCH:
            raise ConfigError(f"general.architecture: expected '{ARCH}', got '{arch}'")
        kw = {attr: md.u32(f"{ARCH}.{key}") for attr, key in _U32_KEYS}
        for attr, key in _FLOAT_KEYS:
            kw[attr] = md.number(f"{ARCH}.{key}", default=_DEFAULTS.get(attr))
        kw["rope_orig_ctx"] = int(md.number(f"{ARCH}.rope.scaling.original_context_length",
                                            integer=True))
        kw["compress_ratios"] = tuple(int(v) for v in md.array(
            f"{ARCH}.attention.compress_ratios", (GGUFValueType.INT32, GGUFValueType.UINT32)))
        kw["swiglu_clamp"] = tuple(float(v) for v in md.array(
            f"{ARCH}.swiglu_clamp_exp", (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)))
        kw["context_length"] = md.optional_u32(f"{ARCH}.context_length", 1048576)
        kw["name"] = str(md.optional("general.name", (GGUFValueType.STRING,), ""))

        md.expect_u32(f"{ARCH}.attention.head_count_kv", 1)
        md.expect_u32(f"{ARCH}.attention.value_length", kw["head_dim"])
        for key in ("expert_group_count", "expert_group_used_count"):
            if md.has(f"{ARCH}.{key}"):
                md.expect_u32(f"{ARCH}.{key}", 0)
        norm = md.optional(f"{ARCH}.expert_weights_norm", (GGUFValueType.BOOL,), True)
        if norm is not True:
            raise ConfigError(f"{ARCH}.expert_weights_norm: expected true, got {norm}")
        # llama.cpp's converter names the router explicitly; 4 is sqrt-softplus.
        if md.has(f"{ARCH}.expert_gating_func"):
            md.expect_u32(f"{ARCH}.expert_gating_func", 4)
        cfg = cls(**kw)
        cfg.validate()
        return cfg


# attr -> key (under deepseek4.), all stored as UINT32
_U32_KEYS = (
    ("n_layer", "block_count"),
    ("n_embd", "embedding_length"),
    ("n_vocab", "vocab_size"),
    ("n_head", "attention.head_count"),
    ("head_dim", "attention.key_length"),
    ("n_rot", "rope.dimension_count"),
    ("q_lora_rank", "attention.q_lora_rank"),
    ("o_lora_rank", "attention.output_lora_rank"),
    ("o_groups", "attention.output_group_count"),
    ("n_expert", "expert_count"),
    ("n_expert_used", "expert_used_count"),
    ("n_ff_exp", "expert_feed_forward_length"),
    ("n_expert_shared", "expert_shared_count"),
    ("n_hash_layer", "hash_layer_count"),
    ("sliding_window", "attention.sliding_window"),
    ("indexer_heads", "attention.indexer.head_count"),
    ("indexer_head_dim", "attention.indexer.key_length"),
    ("indexer_top_k", "attention.indexer.top_k"),
    ("n_hc", "hyper_connection.count"),
    ("hc_sinkhorn_iter", "hyper_connection.sinkhorn_iterations"),
)
_FLOAT_KEYS = (
    ("rope_freq_base", "rope.freq_base"),
    ("rope_scale_factor", "rope.scaling.factor"),
    ("yarn_beta_fast", "rope.scaling.yarn_beta_fast"),
    ("yarn_beta_slow", "rope.scaling.yarn_beta_slow"),
    ("compress_rope_freq_base", "attention.compress_rope_freq_base"),
    ("expert_weights_scale", "expert_weights_scale"),
    ("rms_eps", "attention.layer_norm_rms_epsilon"),
    ("hc_eps", "hyper_connection.epsilon"),
)
# llama.cpp-made files leave out the yarn betas (it hard-codes 32/1); accept both conventions.
_DEFAULTS = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}
_KEY_OF = dict(_U32_KEYS)

_NUMBER_TYPES = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.UINT32,
                 GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64)


@dataclass
class _Metadata:
    fields: dict[str, tuple[list[GGUFValueType], object]] = field(default_factory=dict)

    def has(self, key: str) -> bool:
        return key in self.fields

    def _get(self, key: str):
        if key not in self.fields:
            raise ConfigError(f"{key}: required metadata key is missing")
        return self.fields[key]

    def u32(self, key: str) -> int:
        types, value = self._get(key)
        if types != [GGUFValueType.UINT32]:
            raise ConfigError(f"{key}: expected GGUF type UINT32, got {_type_name(types)}")
        return int(value)

    def optional_u32(self, key: str, default: int) -> int:
        if key not in self.fields:
            return default
        types, value = self.fields[key]
        if len(types) != 1 or types[0] not in _NUMBER_TYPES:
            raise ConfigError(f"{key}: expected an integer, got {_type_name(types)}")
        return int(value)

    def expect_u32(self, key: str, expected: int) -> None:
        v = self.u32(key)
        if v != expected:
            raise ConfigError(f"{key}: expected {expected}, got {v}")

    def number(self, key: str, default=None, integer: bool = False) -> float:
        if key not in self.fields and default is not None:
            return default
        types, value = self._get(key)
        ok = _NUMBER_TYPES if not integer else (GGUFValueType.UINT32, GGUFValueType.UINT64)
        if len(types) != 1 or types[0] not in ok:
            raise ConfigError(
                f"{key}: expected one of {', '.join(t.name for t in ok)}, got {_type_name(types)}")
        v = float(value)
        if not math.isfinite(v):
            raise ConfigError(f"{key}: expected a finite number, got {v}")
        return v

    def array(self, key: str, element_types) -> list:
        types, value = self._get(key)
        if len(types) != 2 or types[0] != GGUFValueType.ARRAY or types[1] not in element_types:
            want = " or ".join(f"ARRAY of {t.name}" for t in element_types)
            raise ConfigError(f"{key}: expected {want}, got {_type_name(types)}")
        return list(value)

    def optional(self, key: str, types_ok, default):
        if key not in self.fields:
            return default
        types, value = self.fields[key]
        if len(types) != 1 or types[0] not in types_ok:
            raise ConfigError(
                f"{key}: expected {' or '.join(t.name for t in types_ok)}, got {_type_name(types)}")
        return value


def _type_name(types: list[GGUFValueType]) -> str:
    return " of ".join(t.name for t in types) if types else "nothing"
