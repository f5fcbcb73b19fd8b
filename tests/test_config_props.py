"""Randomized model configurations (issue #30): hypothesis draws valid DS4 configurations (layer
ratio patterns, windows, top-k, head / expert counts, dims, hash-layer counts, YaRN settings) at
bounded sizes and checks

* the reference against transformers' DeepseekV4ForCausalLM (float64, cached decode; the
  independent oracle of tests/test_parity_transformers.py) at every position;
* MLX against the reference at every position (exact numerics; ds4 numerics pinned, where the
  config allows them);
* Triton against the reference on a few small drawn configurations (the interpreter is slow).

Draws are derandomized (the same examples every run). A failure that hypothesis shrinks goes into
the FOUND list below as a regular parametrized case. Tolerances are those of
tests/test_type_matrix.py (the reference's own bound against float64, 1e-4; Triton's bf16-split
products on a GPU, 1e-3).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ds4
from ds4.core.config import CSA, HCA, SLIDING, ConfigError, ModelConfig
from ds4.core.layout import expected_tensors
from ds4.core.quants import GGMLType as T
from ds4.core.tiny import make_synthetic, role_of, synthetic_vocabulary

PARITY_RTOL = 1e-4
TRITON_RTOL = 1e-3
MAX_PROMPT = 40


@st.composite
def configs(draw, max_layer=4, max_dim=64, hca_ratios=(2, 3, 8, 16), min_window=1, max_window=8,
            compressed=False, max_expert=8, max_iter=20):
    """A valid ModelConfig at bounded sizes; one HCA ratio per model (transformers has one).
    compressed: the first layer CSA and the last HCA (so even the simplest draw has both)."""
    n_layer = draw(st.integers(2 if compressed else 1, max_layer))
    hca = draw(st.sampled_from(hca_ratios))
    ratios = draw(st.lists(st.sampled_from([0, 4, hca]), min_size=n_layer, max_size=n_layer))
    if compressed:
        ratios[0], ratios[-1] = 4, hca
    ratios = tuple(ratios)
    head_dim = draw(st.sampled_from([d for d in (16, 32, 48, 64, 80, 96, 128) if d <= 2 * max_dim]))
    idx_dim = draw(st.sampled_from([16, 32, 64]))
    n_rot = 2 * draw(st.integers(1, min(head_dim, idx_dim) // 2))
    n_head = draw(st.integers(1, 4))
    n_expert = draw(st.integers(2, max_expert))
    return ModelConfig(
        n_layer=n_layer,
        n_embd=draw(st.sampled_from([d for d in (16, 32, 48, 64) if d <= max_dim])),
        n_vocab=draw(st.integers(16, 96)),
        n_head=n_head, head_dim=head_dim, n_rot=n_rot,
        q_lora_rank=draw(st.sampled_from([8, 16, 32])),
        o_lora_rank=draw(st.sampled_from([8, 16, 32])),
        o_groups=draw(st.sampled_from([g for g in (1, 2, 4) if n_head % g == 0])),
        n_expert=n_expert, n_expert_used=draw(st.integers(1, min(4, n_expert))),
        n_ff_exp=draw(st.sampled_from([8, 16, 32])),
        n_hash_layer=draw(st.integers(0, n_layer)),
        sliding_window=draw(st.integers(min_window, max_window)),
        indexer_heads=draw(st.integers(1, 4)), indexer_head_dim=idx_dim,
        indexer_top_k=draw(st.integers(1, 4)),
        n_hc=draw(st.integers(1, 4)), hc_sinkhorn_iter=draw(st.integers(1, max_iter)),
        compress_ratios=ratios,
        swiglu_clamp=(draw(st.sampled_from([1.0, 4.0, 10.0])),) * n_layer,
        rope_freq_base=draw(st.sampled_from([10000.0, 50000.0])),
        compress_rope_freq_base=draw(st.sampled_from([10000.0, 160000.0])),
        rope_scale_factor=draw(st.sampled_from([1.0, 4.0, 16.0, 40.0])),
        rope_orig_ctx=draw(st.sampled_from([64, 4096, 65536])),
        yarn_beta_fast=draw(st.sampled_from([8.0, 32.0])),
        yarn_beta_slow=draw(st.sampled_from([1.0, 2.0])),
        expert_weights_scale=draw(st.sampled_from([1.0, 1.5, 2.5])),
        context_length=4096, name="ds4-props")


def prompt_for(cfg: ModelConfig, seed: int, cap: int = MAX_PROMPT) -> list[int]:
    """Long enough to slide the window, close two windows of every ratio and overflow the
    indexer's top-k on CSA layers (4·(top_k + 1) tokens give top_k + 1 rows), within cap."""
    ratios = [r for r in cfg.compress_ratios[: cfg.n_layer] if r]
    n = max([cfg.sliding_window + 2] + [2 * r for r in ratios]
            + ([4 * (cfg.indexer_top_k + 1)] if 4 in ratios else []))
    return [int(t) for t in np.random.default_rng(seed).integers(0, cfg.n_vocab, min(n, cap))]


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), "non-finite logits"
    return float(np.abs(got - want).max() / np.abs(want).max())


def write(cfg: ModelConfig, tmp, seed: int, float_type: T = T.F32):
    """Every role that takes float_type in it (the others hold F32 or I32 anyway)."""
    types = {role_of(name): float_type for name, spec in expected_tensors(cfg).items()
             if float_type in spec.types}
    return make_synthetic(tmp / f"props-{seed}.gguf", cfg, types, seed=seed)


def logits_every_position(eng, prompt):
    s = eng.session(ctx=64)
    out = []
    for t in prompt:
        s.eval(t)
        out.append(s.logits.copy())
    return out


# ---- reference vs transformers ------------------------------------------------------------------

def hf_config_dict(cfg: ModelConfig) -> dict:
    """transformers DeepseekV4Config arguments for a drawn config."""
    hca = next((r for r in cfg.compress_ratios if r and r != 4), 8)
    kinds = [SLIDING if r == 0 else CSA if r == 4 else HCA for r in cfg.compress_ratios]
    yarn = {"rope_type": "yarn", "factor": cfg.rope_scale_factor,
            "original_max_position_embeddings": cfg.rope_orig_ctx,
            "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow}
    return dict(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, moe_intermediate_size=cfg.n_ff_exp,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, head_dim=cfg.head_dim,
        partial_rotary_factor=cfg.n_rot / cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, n_routed_experts=cfg.n_expert,
        num_experts_per_tok=cfg.n_expert_used, layer_types=kinds,
        compress_rates={CSA: 4, HCA: hca},
        mlp_layer_types=["hash_moe"] * cfg.n_hash_layer + ["moe"] * (cfg.n_layer - cfg.n_hash_layer),
        sliding_window=cfg.sliding_window, index_n_heads=cfg.indexer_heads,
        index_head_dim=cfg.indexer_head_dim, index_topk=cfg.indexer_top_k,
        hc_mult=cfg.n_hc, hc_sinkhorn_iters=cfg.hc_sinkhorn_iter, swiglu_limit=cfg.swiglu_clamp[0],
        routed_scaling_factor=cfg.expert_weights_scale, rope_theta=cfg.rope_freq_base,
        compress_rope_theta=cfg.compress_rope_freq_base, max_position_embeddings=cfg.context_length,
        rope_parameters=yarn)


def check_reference_against_transformers(cfg: ModelConfig, tmp, seed: int):
    pytest.importorskip("transformers")
    tp = pytest.importorskip("test_parity_transformers")
    import torch
    import transformers

    from ds4.core.convert import config_from_hf, convert_hf_state

    hf = transformers.DeepseekV4Config(**hf_config_dict(cfg))
    hf._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(hf).double().eval()
    tp._randomise(model, seed)
    ours = config_from_hf(hf.to_dict())
    # the conversion is the drawn config (names and the context length aside)
    keep = ("name", "context_length")
    assert dataclasses.replace(ours, **{k: getattr(cfg, k) for k in keep}) == cfg, (ours, cfg)
    prompt = prompt_for(cfg, seed)
    want = list(tp._transformers_decode(model, prompt)[0])
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    path = convert_hf_state(state, hf.to_dict(), tmp / f"hf-{seed}.gguf",
                            *synthetic_vocabulary(cfg.n_vocab))
    got = logits_every_position(ds4.Engine.open(path, backend="reference", numerics="exact"), prompt)
    errs = [rel(g, w) for g, w in zip(got, want)]
    worst = int(np.argmax(errs))
    assert errs[worst] <= PARITY_RTOL, f"position {worst}: relative error {errs[worst]:.2e}"


HF_SETTINGS = settings(max_examples=8, derandomize=True, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))


# transformers' window cache keeps `full[-W + 1:]`, which for W = 1 is every row, so its
# windows start at 2; ds4's window of 1 is the current row alone (spec §1.1: incl. current)
@HF_SETTINGS
@given(cfg=configs(max_layer=3, max_dim=32, hca_ratios=(2, 8), min_window=2))
def test_reference_matches_transformers_on_drawn_configs(cfg, tmp_path_factory):
    check_reference_against_transformers(cfg, tmp_path_factory.mktemp("hf"), seed=1)


# ---- MLX vs reference ---------------------------------------------------------------------------

def check_mlx(cfg: ModelConfig, tmp, seed: int, float_type: T):
    pytest.importorskip("mlx.core")
    from test_mlx_backend import engines as pinned_engines

    path = write(cfg, tmp, seed, float_type)
    prompt = prompt_for(cfg, seed)
    modes = ["exact"]
    try:
        cfg.check_ds4_numerics()
        modes.append("ds4")
    except ConfigError:
        pass
    for numerics in modes:
        ref, mlx = pinned_engines(path, numerics)
        want, got = logits_every_position(ref, prompt), logits_every_position(mlx, prompt)
        errs = [rel(g, w) for g, w in zip(got, want)]
        worst = int(np.argmax(errs))
        assert errs[worst] <= PARITY_RTOL, f"{numerics}: position {worst}: {errs[worst]:.2e}"
        r, m = ref.session(ctx=64), mlx.session(ctx=64)
        r.sync(prompt)
        m.sync(prompt)
        assert rel(m.logits, r.logits) <= PARITY_RTOL, f"{numerics}: one-shot prefill"


@settings(max_examples=20, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(cfg=configs(), float_type=st.sampled_from([T.F32, T.F16, T.BF16]))
def test_mlx_matches_reference_on_drawn_configs(cfg, float_type, tmp_path_factory):
    check_mlx(cfg, tmp_path_factory.mktemp("mlx"), seed=2, float_type=float_type)


# ---- Triton vs reference ------------------------------------------------------------------------

def check_triton(cfg: ModelConfig, tmp, seed: int, float_type: T):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = write(cfg, tmp, seed, float_type)
    prompt = prompt_for(cfg, seed, cap=16)
    ref = ds4.Engine.open(path, backend="reference", numerics="exact")
    try:
        tri = ds4.Engine.open(path, backend="triton", numerics="exact", device=device)
    except (ValueError, NotImplementedError) as e:  # a refusal must name the key or tensor
        assert "deepseek4." in str(e) or "weight" in str(e), f"triton refused without naming why: {e}"
        print(f"triton refuses {cfg}: {e}")
        return
    a, b = ref.session(ctx=64), tri.session(ctx=64)
    a.sync(prompt[:-2])
    b.sync(prompt[:-2])
    errs = {"prefill": rel(b.logits, a.logits)}
    for i, t in enumerate(prompt[-2:]):
        a.eval(t)
        b.eval(t)
        errs[f"decode{i}"] = rel(b.logits, a.logits)
    print(f"triton {float_type.name} {cfg}: {errs}")
    assert max(errs.values()) <= TRITON_RTOL, errs


def small_config(head_dim: int, n_rot: int) -> ModelConfig:
    """CSA (ratio 4, hash routing) then HCA (ratio 2, top-k routing), small everything."""
    return ModelConfig(
        n_layer=2, n_embd=32, n_vocab=32, n_head=2, head_dim=head_dim, n_rot=n_rot,
        q_lora_rank=16, o_lora_rank=16, o_groups=1, n_expert=4, n_expert_used=2, n_ff_exp=16,
        n_hash_layer=1, sliding_window=3, indexer_heads=2, indexer_head_dim=32, indexer_top_k=1,
        n_hc=2, hc_sinkhorn_iter=3, compress_ratios=(4, 2), swiglu_clamp=(10.0, 10.0),
        context_length=4096, name="ds4-props-small")


# the interpreter runs every program instance in Python: two small draws with CSA and HCA layers,
# not shrunk (a shrink step is a model run); FOUND below holds the cases found so far
@settings(max_examples=2, derandomize=True, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(cfg=configs(max_layer=2, max_dim=32, hca_ratios=(2, 8), max_window=4, compressed=True,
                   max_expert=4, max_iter=4),
       float_type=st.sampled_from([T.F16, T.F32]))
def test_triton_matches_reference_on_drawn_configs(cfg, float_type, tmp_path_factory):
    check_triton(cfg, tmp_path_factory.mktemp("tri"), seed=3, float_type=float_type)


# Configurations the draws found failing (shrunk by hand where hypothesis was not let shrink),
# kept as regular cases for every backend.
FOUND = {
    "head_dim80": (small_config(80, 16), T.F16),  # not a power of two (Triton: arange in rope)
    "head_dim96": (small_config(96, 32), T.F16),
    "all_f32": (small_config(64, 32), T.F32),  # every weight F32 (Triton: logits far off)
    # a ratio that is not a power of two (Triton: refused at the first compressor call, not at load)
    "hca_ratio3": (dataclasses.replace(small_config(64, 32), compress_ratios=(4, 3)), T.F16),
}


@pytest.mark.parametrize("case", sorted(FOUND))
def test_mlx_found_configs(case, tmp_path):
    cfg, float_type = FOUND[case]
    check_mlx(cfg, tmp_path, seed=4, float_type=float_type)


@pytest.mark.parametrize("case", sorted(FOUND))
def test_triton_found_configs(case, tmp_path):
    cfg, float_type = FOUND[case]
    check_triton(cfg, tmp_path, seed=3, float_type=float_type)
