"""Parity with transformers' DeepseekV4ForCausalLM (spec §8.5), through ds4.core.convert.

A tiny random float64 transformers model with every layer kind (two sliding layers, CSA ratio 4
with an indexer whose top-k is smaller than the compressed rows the prompt produces, HCA), both
routings (hash and top-k), is converted to a DS4 GGUF (F32 tensors) and run by our engine with
numerics="exact". The reference is transformers' *cached token-by-token decode* in float64 (its
one-shot forward is not the reference, §8.5), with torch.topk made stable (lower index wins ties,
ds4's rule, §3.6): with few indexer heads, ReLU makes exact score ties common.

A matching engine lands around 1e-6 relative error in float32; a wrong detail of §3 lands around
1 (the indexer, mHC comb orientation, sinks, ... each move these logits by 0.3–0.7).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4", allow_module_level=True)

import ds4  # noqa: E402
from ds4.core.config import CSA, HCA, SLIDING  # noqa: E402
from ds4.core.convert import config_from_hf, convert_hf_state  # noqa: E402
from ds4.core.gguf_model import GGUFModel  # noqa: E402
from ds4.core.quants import GGMLType  # noqa: E402

MAX_REL = 1e-4

# Two configs: different widths, windows, ratios, hash counts, clamps and seeds.
CASES = {
    "A": dict(
        seed=0, n_prompt=48,
        hf=dict(vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5,
                num_attention_heads=4, head_dim=32, partial_rotary_factor=8 / 32, q_lora_rank=32,
                o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
                layer_types=[SLIDING, SLIDING, CSA, HCA, CSA],
                compress_rates={CSA: 4, HCA: 8},
                mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 3,
                sliding_window=8, index_n_heads=4, index_head_dim=16, index_topk=4)),
    "B": dict(
        seed=1, n_prompt=64,
        hf=dict(vocab_size=384, hidden_size=96, moe_intermediate_size=48, num_hidden_layers=6,
                num_attention_heads=8, head_dim=64, partial_rotary_factor=16 / 64, q_lora_rank=48,
                o_groups=4, o_lora_rank=24, n_routed_experts=16, num_experts_per_tok=3,
                layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, HCA],
                compress_rates={CSA: 4, HCA: 16},
                mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3,
                sliding_window=5, index_n_heads=8, index_head_dim=32, index_topk=6,
                swiglu_limit=1.0)),  # small enough that the SwiGLU clamps really clamp
}
# The Flash YaRN for compressed layers (factor 16, original context 65536, β 32/1): with these
# small rope widths it still blends some frequency pairs, so the YaRN ramp is exercised.
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
        "beta_fast": 32, "beta_slow": 1}


def _stable_topk(x, k, dim=-1, largest=True, sorted=True):
    idx = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((x.gather(dim, idx), idx))


@contextlib.contextmanager
def stable_topk():
    """ds4's tie rule (lower index first) for transformers' indexer and router top-k."""
    saved = torch.topk, torch.Tensor.topk
    torch.topk = torch.Tensor.topk = _stable_topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = saved


def _randomise(model, seed: int) -> None:
    """Every parameter and buffer random with an O(1)-activation magnitude, rounded to float32
    (so the F32 GGUF and the float64 model hold exactly the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    n_expert = model.config.n_routed_experts

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float64) * std

    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith("tid2eid"):  # k distinct experts per token id
                V, k = p.shape
                p.copy_(torch.argsort(torch.rand(V, n_expert, generator=g), dim=1)[:, :k])
                continue
            if name.endswith("norm.weight"):
                v = 1.0 + normal(p.shape, 0.1)
            elif name.endswith((".scale", "hc_scale")):
                v = 0.5 + 0.5 * torch.rand(p.shape, generator=g, dtype=torch.float64)
            elif name.endswith((".base", "hc_base", "e_score_correction_bias")):
                v = normal(p.shape, 0.1)
            elif name.endswith("sinks"):
                v = normal(p.shape, 1.0)
            elif name.endswith("position_bias"):
                v = normal(p.shape, 0.5)
            elif name == "model.embed_tokens.weight":
                v = normal(p.shape, 1.0)
            else:  # linear / expert weights [.., out, in]: unit-variance outputs
                v = normal(p.shape, p.shape[-1] ** -0.5)
            p.copy_(v.float().double())


def _build(case: dict):
    cfg = transformers.DeepseekV4Config(**case["hf"], rope_parameters=dict(YARN))
    cfg._experts_implementation = "eager"  # the grouped_mm path has no float64
    torch.manual_seed(case["seed"])
    model = transformers.DeepseekV4ForCausalLM(cfg).double().eval()
    _randomise(model, case["seed"])
    return cfg, model


def _transformers_decode(model, prompt: list[int]):
    """Cached decode, one token per call, float64, ds4's top-k tie rule; also records the top-k
    routers' choices."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2].clone()))
             for layer in model.model.layers if not layer.mlp.is_hash]
    logits, cache = [], None
    threads = torch.get_num_threads()
    # Tiny ops: one thread is fastest, and on a busy machine more threads spin-wait (10-30x slower).
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), stable_topk():
            for pos, tok in enumerate(prompt):
                out = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]),
                            cache=cache, use_cache=True)
                cache = out.cache
                logits.append(out.logits[0, -1].numpy().copy())
    finally:
        torch.set_num_threads(threads)
        for h in hooks:
            h.remove()
    return np.stack(logits), (torch.cat(chosen) if chosen else None)  # (None: hash layers only)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    name = request.param
    spec = CASES[name]
    cfg, model = _build(spec)
    prompt = np.random.default_rng(spec["seed"] + 100).integers(2, cfg.vocab_size, spec["n_prompt"]).tolist()
    ref, routed = _transformers_decode(model, prompt)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    path = convert_hf_state(state, cfg.to_dict(), tmp_path_factory.mktemp(f"parity{name}") / "m.gguf")
    return dict(name=name, cfg=cfg, model=model, state=state, prompt=prompt, ref=ref,
                routed=routed, path=path)


def _rel(ref: np.ndarray, ours: np.ndarray) -> float:
    return float(np.abs(ours.astype(np.float64) - ref).max() / np.abs(ref).max())


def test_case_covers_every_layer_kind(case):
    """The prompt slides the raw window, closes several windows of every ratio, overflows the
    indexer's top-k; routing is hash and top-k, with top-k choosing varied experts."""
    cfg, n = case["cfg"], len(case["prompt"])
    ours = config_from_hf(cfg.to_dict())
    ratios = ours.compress_ratios
    assert ratios.count(0) == 2 and 4 in ratios and any(r not in (0, 4) for r in ratios)
    assert n > 3 * ours.sliding_window
    for r in set(ratios) - {0}:
        assert n // r >= 3, f"ratio {r}: only {n // r} windows close"
    assert n // 4 > 2 * ours.indexer_top_k  # CSA rows > top-k: the indexer really selects
    assert 0 < ours.n_hash_layer < ours.n_layer
    used = torch.unique(case["routed"]).numel()
    assert used > cfg.num_experts_per_tok + 2, f"top-k routing is degenerate ({used} experts used)"


def test_logits_match_transformers_cached_decode(case):
    eng = ds4.Engine.open(case["path"], backend="reference", numerics="exact")
    s = eng.session(ctx=256)
    ref = case["ref"]
    errs = []
    for pos, tok in enumerate(case["prompt"]):
        s.eval(tok)
        errs.append(_rel(ref[pos], s.logits))
        assert int(np.argmax(s.logits)) == int(np.argmax(ref[pos])), f"argmax differs at position {pos}"
    worst = int(np.argmax(errs))
    print(f"\n[{case['name']}] max relative error {max(errs):.2e} at position {worst}")
    assert max(errs) <= MAX_REL, f"position {worst}: relative error {errs[worst]:.2e}"

    # A one-shot prefill and a chunked one land on the same last-position logits.
    for cap in (None, 7):
        s2 = eng.session(ctx=256, prefill_cap=cap)
        s2.sync(case["prompt"])
        assert _rel(ref[-1], s2.logits) <= MAX_REL


# ---------------------------------------------------------------------------------------------
# the converter itself


def test_convert_tensor_layout(case):
    cfg, state = case["cfg"], case["state"]
    m = GGUFModel(case["path"])
    c = m.config
    assert c.compress_ratios == tuple(0 if t == SLIDING else cfg.compress_rates[t] for t in cfg.layer_types)
    assert c.n_hash_layer == cfg.mlp_layer_types.count("hash_moe")
    assert c.n_rot == cfg.qk_rope_head_dim and c.head_dim == cfg.head_dim
    assert (c.rope_scale_factor, c.rope_orig_ctx, c.yarn_beta_fast, c.yarn_beta_slow) == (16.0, 65536, 32.0, 1.0)
    assert c.swiglu_clamp == (cfg.swiglu_limit,) * cfg.num_hidden_layers
    assert c.expert_weights_scale == cfg.routed_scaling_factor
    assert all(t.type in (GGMLType.F32, GGMLType.I32) for t in m.tensors.values())

    F = cfg.moe_intermediate_size
    gate_up = state["model.layers.3.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(m.tensor("blk.3.ffn_gate_exps.weight").values(), gate_up[:, :F])
    np.testing.assert_array_equal(m.tensor("blk.3.ffn_up_exps.weight").values(), gate_up[:, F:])
    assert m.tensor("blk.3.ffn_gate_exps.weight").dims == (cfg.hidden_size, F, cfg.n_routed_experts)
    tid = m.tensor("blk.0.ffn_gate_tid2eid.weight")
    assert tid.type == GGMLType.I32 and tid.dims == (cfg.num_experts_per_tok, cfg.vocab_size)
    np.testing.assert_array_equal(tid.values(), state["model.layers.0.mlp.gate.tid2eid"])
    q_b = m.tensor("blk.2.attn_q_b.weight")  # torch [out, in] -> GGUF dims [in, out], no transpose
    assert q_b.dims == (cfg.q_lora_rank, cfg.num_attention_heads * cfg.head_dim)
    np.testing.assert_array_equal(q_b.values(), state["model.layers.2.self_attn.q_b_proj.weight"])
    ape = m.tensor("blk.2.indexer_compressor_ape.weight")
    assert ape.dims == (2 * cfg.index_head_dim, 4)
    np.testing.assert_array_equal(ape.values(), state["model.layers.2.self_attn.compressor.indexer.position_bias"])


def test_convert_rejects_bad_state(case, tmp_path):
    state, hf = dict(case["state"]), case["cfg"].to_dict()
    out = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match=r"unknown state-dict key\(s\): model\.layers\.0\.mlp\.bogus"):
        convert_hf_state({**state, "model.layers.0.mlp.bogus": np.zeros(3)}, hf, out)
    missing = {k: v for k, v in state.items() if k != "model.layers.2.self_attn.compressor.indexer.kv_norm.weight"}
    with pytest.raises(ValueError, match=r"missing state-dict key\(s\): .*indexer\.kv_norm\.weight"):
        convert_hf_state(missing, hf, out)
    with pytest.raises(ValueError, match=r"lm_head\.weight: expected shape"):
        convert_hf_state({**state, "lm_head.weight": state["lm_head.weight"][:-1]}, hf, out)
    assert not out.exists()


def test_convert_rejects_what_ds4_cannot_express(case, tmp_path):
    hf = case["cfg"].to_dict()
    bad = [
        {"compress_rates": {CSA: 8, HCA: 16}},  # a DS4 GGUF marks CSA by ratio 4
        {"compress_rates": {CSA: 4, HCA: 4}},  # ... so HCA cannot use 4
        {"mlp_layer_types": ["moe", "hash_moe"] + hf["mlp_layer_types"][2:]},  # hash layers lead
        {"scoring_func": "softmax"},
        {"n_shared_experts": 2},
        {"rope_parameters": {"main": hf["rope_parameters"]["main"],
                             "compress": {**hf["rope_parameters"]["compress"], "attention_factor": 1.2}}},
    ]
    for change in bad:
        with pytest.raises(ValueError):
            convert_hf_state(case["state"], {**hf, **change}, tmp_path / "x.gguf")
