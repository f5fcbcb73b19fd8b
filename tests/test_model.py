"""Opening DS4 GGUFs: metadata, layout validation, fingerprint, synthetic models.

Independent references: the tensor census of a shipped DS4 Flash file (spec §2.3), the metadata
key table of spec §1.2 read back with gguf-py's own reader, and hand-built broken files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from ds4.core.config import ModelConfig
from ds4.core.gguf_model import GGUFModel, ModelError
from ds4.core.gguf_write import write_gguf, write_sparse_gguf
from ds4.core.layout import expected_tensors
from ds4.core.quants import GGMLType as T
from ds4.core.quants import encode
from ds4.core.tiny import make_tiny, preset_config, preset_vocabulary


@pytest.fixture(scope="module")
def test_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "test.gguf"
    make_tiny(path, preset="test", seed=3)
    return path


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_flash_layout_matches_the_shipped_census():
    # spec §2.3: F16 359, F32 492 (40 exp_probs_b), Q8_0 345, I32 3, routed 129 -> 1328 tensors
    specs = expected_tensors(preset_config("flash"))
    assert len(specs) == 1328
    count = {}
    for s in specs.values():
        count[s.shipped] = count.get(s.shipped, 0) + 1
    assert count[T.F16] == 359 and count[T.F32] == 492 and count[T.Q8_0] == 345
    assert count[T.I32] == 3 and count[T.IQ2_XXS] + count[T.Q2_K] == 129
    assert sum(n.endswith("exp_probs_b.bias") for n in specs) == 40
    params = sum(int(np.prod(s.dims)) for s in specs.values())
    assert abs(params / 1e9 - 284.3) < 0.5  # spec §1.1: 284.3 B total parameters
    assert specs["blk.2.attn_compressor_ape.weight"].dims == (1024, 4)  # c·512, ratio
    assert specs["blk.3.attn_compressor_ape.weight"].dims == (512, 128)
    assert "blk.3.indexer.proj.weight" not in specs and "blk.1.attn_compressor_kv.weight" not in specs


def test_synthetic_model_has_every_tensor_with_the_real_type_mix(test_model):
    m = GGUFModel(test_model)
    cfg = m.config
    assert cfg.compress_ratios == (0, 0, 4, 8, 4) and cfg.n_hash_layer == 3
    assert set(m.tensors) == set(expected_tensors(cfg))
    t = m.tensors
    assert t["token_embd.weight"].type == T.F16 and t["output.weight"].type == T.Q8_0
    assert t["blk.0.ffn_gate_exps.weight"].type == T.IQ2_XXS
    assert t["blk.0.ffn_up_exps.weight"].type == T.IQ2_XXS
    assert t["blk.0.ffn_down_exps.weight"].type == T.Q2_K
    assert t["blk.2.attn_q_a.weight"].type == T.Q8_0 and t["blk.2.indexer.proj.weight"].type == T.F16
    assert t["blk.2.hc_attn_fn.weight"].type == T.F16 and t["blk.2.attn_norm.weight"].type == T.F32
    # hash layers route by token id, top-k layers carry the selection bias
    assert [f"blk.{i}.ffn_gate_tid2eid.weight" in t for i in range(5)] == [True] * 3 + [False] * 2
    assert [f"blk.{i}.exp_probs_b.bias" in t for i in range(5)] == [False] * 3 + [True] * 2
    assert [f"blk.{i}.indexer.attn_q_b.weight" in t for i in range(5)] == [False, False, True, False, True]
    assert [f"blk.{i}.attn_compressor_kv.weight" in t for i in range(5)] == [False, False, True, True, True]
    tid = t["blk.0.ffn_gate_tid2eid.weight"].values()  # [vocab, k] distinct experts per token
    assert tid.shape == (512, 2) and (tid[:, 0] != tid[:, 1]).all() and tid.max() < 8


def test_metadata_keys_and_gguf_types(test_model):
    """Read back with gguf-py: every key of spec §1.2 with ds4's accepted types."""
    f = GGUFReader(test_model).fields
    u32 = [GGUFValueType.UINT32]
    for key in ("block_count", "embedding_length", "vocab_size", "attention.head_count",
                "attention.head_count_kv", "attention.key_length", "attention.value_length",
                "rope.dimension_count", "attention.q_lora_rank", "attention.output_lora_rank",
                "attention.output_group_count", "expert_count", "expert_used_count",
                "expert_feed_forward_length", "expert_shared_count", "hash_layer_count",
                "attention.sliding_window", "attention.indexer.head_count",
                "attention.indexer.key_length", "attention.indexer.top_k", "hyper_connection.count",
                "hyper_connection.sinkhorn_iterations", "expert_group_count", "expert_group_used_count"):
        assert f["deepseek4." + key].types == u32, key
    for key in ("rope.freq_base", "rope.scaling.factor", "rope.scaling.yarn_beta_fast",
                "rope.scaling.yarn_beta_slow", "attention.compress_rope_freq_base",
                "expert_weights_scale", "attention.layer_norm_rms_epsilon", "hyper_connection.epsilon"):
        assert f["deepseek4." + key].types == [GGUFValueType.FLOAT32], key
    assert f["deepseek4.rope.scaling.original_context_length"].contents() == 65536
    assert f["deepseek4.attention.compress_ratios"].contents() == [0, 0, 4, 8, 4]
    assert f["deepseek4.swiglu_clamp_exp"].contents() == [10.0] * 5
    assert f["deepseek4.expert_weights_norm"].contents() is True
    assert f["deepseek4.rope.freq_base"].contents() == 10000.0
    assert f["deepseek4.attention.compress_rope_freq_base"].contents() == 160000.0
    assert abs(f["deepseek4.attention.layer_norm_rms_epsilon"].contents() - 1e-6) < 1e-12
    assert f["general.architecture"].contents() == "deepseek4"
    assert len(f["tokenizer.ggml.tokens"].contents()) == 512


def test_same_seed_same_bytes(tmp_path, test_model):
    again = tmp_path / "again.gguf"
    make_tiny(again, preset="test", seed=3)
    assert again.read_bytes() == test_model.read_bytes()
    other = tmp_path / "other.gguf"
    make_tiny(other, preset="test", seed=4)
    assert other.read_bytes() != test_model.read_bytes()


def test_fingerprint_is_sha256_of_directory_and_size(test_model):
    m = GGUFModel(test_model)
    data_offset = GGUFReader(test_model).data_offset
    raw = test_model.read_bytes()
    want = hashlib.sha256(raw[:data_offset] + struct.pack("<Q", len(raw))).digest()
    assert m.fingerprint == want
    assert m.fingerprint64 == int.from_bytes(want[:8], "little")


def test_full_size_model_opens_without_reading_weights(tmp_path):
    """An 81 GiB DS4 Flash layout (sparse file: real directory, data a hole) opens fast and
    without resident-memory growth beyond the directory."""
    cfg = preset_config("flash")
    path = write_sparse_gguf(tmp_path / "flash.gguf", cfg, {}, *preset_vocabulary("flash"))
    assert path.stat().st_size > 80 << 30
    rss0, t0 = _rss(), time.perf_counter()
    m = GGUFModel(path)
    elapsed, grown = time.perf_counter() - t0, _rss() - rss0
    assert m.config.n_layer == 43 and len(m.tensors) == 1328
    assert elapsed < 1.0, f"opening took {elapsed:.2f} s"
    assert grown < 64 << 20, f"resident memory grew by {grown >> 20} MiB"


# ---- validation: hand-broken files -------------------------------------------------------------

def _write_variant(path, cfg: ModelConfig, edit=None, drop=(), extra=None):
    """The test model's tensors with one edit: (name -> (type, dims, bytes)) changes."""
    tokens, merges = preset_vocabulary("test")
    rng = np.random.default_rng(0)
    data = {}
    for name, spec in expected_tensors(cfg).items():
        if name in drop:
            continue
        n = int(np.prod(spec.dims))
        if spec.shipped == T.I32:
            data[name] = (T.I32, spec.dims, encode(np.zeros(n, np.int32), T.I32))
        else:
            data[name] = (T.F32, spec.dims, encode(rng.standard_normal(n).astype(np.float32), T.F32))
    if edit:
        data.update(edit)
    if extra:
        data.update(extra)
    return write_gguf(path, cfg, data, tokens, merges)


def _f32(dims):
    return (T.F32, dims, encode(np.zeros(int(np.prod(dims)), np.float32), T.F32))


def test_float_everywhere_is_a_valid_layout(tmp_path):
    import dataclasses

    cfg = preset_config("test")
    got = GGUFModel(_write_variant(tmp_path / "ok.gguf", cfg)).config
    # the epsilons travel as float32, as ds4 stores them
    assert abs(got.rms_eps - 1e-6) < 1e-12 and abs(got.hc_eps - 1e-6) < 1e-12
    assert dataclasses.replace(got, rms_eps=cfg.rms_eps, hc_eps=cfg.hc_eps) == cfg


@pytest.mark.parametrize("case, expect", [
    ("dims", "blk.1.attn_kv.weight: expected dims [256, 128], got [256, 64]"),
    ("type", "blk.1.attn_norm.weight: expected type one of F32, got F16"),
    ("missing", "blk.4.attn_sinks.weight: required tensor is missing"),
    ("unexpected", "blk.0.exp_probs_b.bias: unexpected tensor"),
])
def test_layout_errors_name_tensor_expected_and_actual(tmp_path, case, expect):
    cfg = preset_config("test")
    kw = {
        "dims": dict(edit={"blk.1.attn_kv.weight": _f32((256, 64))}),
        "type": dict(edit={"blk.1.attn_norm.weight": (T.F16, (256,), encode(np.ones(256, np.float32), T.F16))}),
        "missing": dict(drop=("blk.4.attn_sinks.weight",)),
        "unexpected": dict(extra={"blk.0.exp_probs_b.bias": _f32((8,))}),
    }[case]
    path = _write_variant(tmp_path / f"{case}.gguf", cfg, **kw)
    with pytest.raises(ModelError) as e:
        GGUFModel(path)
    assert expect in str(e.value)


def test_gate_and_up_experts_must_share_a_type(tmp_path):
    cfg = preset_config("test")
    dims = expected_tensors(cfg)["blk.3.ffn_up_exps.weight"].dims
    up = (T.F16, dims, encode(np.zeros(int(np.prod(dims)), np.float32), T.F16))
    path = _write_variant(tmp_path / "mix.gguf", cfg, edit={"blk.3.ffn_up_exps.weight": up})
    with pytest.raises(ModelError, match="blk.3.ffn_up_exps.weight: expected the gate's type F32, got F16"):
        GGUFModel(path)


def _metadata_variant(tmp_path, key, vtype, value):
    """Rewrite the test preset with one metadata key replaced (or removed when vtype is None)."""
    import dataclasses

    cfg = preset_config("test")
    orig = ModelConfig.to_metadata

    def patched(self):
        out = [(k, t, v) for k, t, v in orig(self) if k != key]
        return out + ([(key, vtype, value)] if vtype is not None else [])

    mp = pytest.MonkeyPatch()
    mp.setattr(ModelConfig, "to_metadata", patched)
    try:
        return _write_variant(tmp_path / "meta.gguf", dataclasses.replace(cfg))
    finally:
        mp.undo()


@pytest.mark.parametrize("key, vtype, value, expect", [
    ("deepseek4.block_count", GGUFValueType.INT32, 5,
     "deepseek4.block_count: expected GGUF type UINT32, got INT32"),
    ("deepseek4.attention.head_count_kv", GGUFValueType.UINT32, 2,
     "deepseek4.attention.head_count_kv: expected 1, got 2"),
    ("deepseek4.expert_count", None, None, "deepseek4.expert_count: required metadata key is missing"),
    ("deepseek4.expert_used_count", GGUFValueType.UINT32, 9,
     "deepseek4.expert_used_count: expected ≤ expert_count 8, got 9"),
    ("deepseek4.attention.compress_ratios", GGUFValueType.FLOAT32, [0.0, 0.0, 4.0, 8.0, 4.0],
     "deepseek4.attention.compress_ratios: expected ARRAY of INT32 or ARRAY of UINT32, got ARRAY of FLOAT32"),
    ("deepseek4.expert_group_count", GGUFValueType.UINT32, 4,
     "deepseek4.expert_group_count: expected 0, got 4"),
])
def test_metadata_errors_name_key_expected_and_actual(tmp_path, key, vtype, value, expect):
    path = _metadata_variant(tmp_path, key, vtype, value)
    with pytest.raises(ModelError) as e:
        GGUFModel(path)
    assert expect in str(e.value)


def test_llama_cpp_metadata_convention_is_accepted(tmp_path):
    """llama.cpp's files store original_context_length as u32 and omit the yarn betas."""
    path = _metadata_variant(tmp_path, "deepseek4.rope.scaling.original_context_length",
                             GGUFValueType.UINT32, 65536)
    assert GGUFModel(path).config.rope_orig_ctx == 65536


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF"):
        GGUFModel(bad)
    with pytest.raises(FileNotFoundError, match="model file not found"):
        GGUFModel(tmp_path / "absent.gguf")


# ---- the synthetic writer: any accepted type per tensor or role, any valid config -------------

def _small_config(**sizes):
    base = dict(n_layer=2, n_embd=64, n_vocab=20, n_head=1, head_dim=64, n_rot=32, q_lora_rank=32,
                o_lora_rank=32, o_groups=1, n_expert=4, n_expert_used=2, n_ff_exp=64,
                n_hash_layer=1, sliding_window=2, indexer_heads=1, indexer_head_dim=32,
                indexer_top_k=1, n_hc=2, hc_sinkhorn_iter=3, compress_ratios=(4, 2),
                context_length=256)
    return preset_config("test", **{**base, **sizes})


DENSE_EXPERTS = {"ffn_gate_exps.weight": T.Q8_0, "ffn_up_exps.weight": T.Q8_0,
                 "ffn_down_exps.weight": T.F16}


def test_synthetic_types_by_role_and_by_tensor(tmp_path):
    """A role's type applies on every layer, a tensor's name wins over its role; read back with
    gguf-py's own reader."""
    from ds4.core.tiny import make_synthetic

    cfg = _small_config()
    types = {**DENSE_EXPERTS, "attn_kv.weight": T.BF16, "blk.1.attn_kv.weight": T.F32,
             "token_embd.weight": T.Q8_0, "attn_compressor_kv.weight": T.F32}
    path = make_synthetic(tmp_path / "m.gguf", cfg, types, seed=1)
    got = {t.name: T(int(t.tensor_type)) for t in GGUFReader(path).tensors}
    assert got["blk.0.attn_kv.weight"] == T.BF16 and got["blk.1.attn_kv.weight"] == T.F32
    assert got["token_embd.weight"] == T.Q8_0 and got["output.weight"] == T.Q8_0  # (shipped)
    assert got["blk.0.attn_compressor_kv.weight"] == got["blk.1.attn_compressor_kv.weight"] == T.F32
    assert got["blk.1.ffn_down_exps.weight"] == T.F16 and got["blk.0.ffn_up_exps.weight"] == T.Q8_0
    m = GGUFModel(path)
    # (the epsilons come back as their float32 roundings)
    assert m.config == dataclasses.replace(cfg, rms_eps=m.config.rms_eps, hc_eps=m.config.hc_eps)
    assert m.tensor("output.weight").dims == (64, 20)


@pytest.mark.parametrize("types, message", [
    ({"attn_bogus.weight": T.F16}, r"attn_bogus\.weight: expected a tensor name or role"),
    ({"attn_norm.weight": T.F16}, r"blk\.0\.attn_norm\.weight: expected type one of F32, got F16"),
    ({"ffn_down_exps.weight": T.Q2_K},
     r"blk\.0\.ffn_down_exps\.weight: type Q2_K needs dims\[0\] a multiple of 256, got 64"),
    ({"ffn_gate_exps.weight": T.F16, "ffn_up_exps.weight": T.F32},
     r"blk\.0\.ffn_up_exps\.weight: expected the gate's type F16, got F32"),
])
def test_synthetic_writer_refuses_what_the_loader_refuses(tmp_path, types, message):
    from ds4.core.tiny import make_synthetic

    with pytest.raises(ValueError, match=message):
        make_synthetic(tmp_path / "m.gguf", _small_config(), {**DENSE_EXPERTS, **types})
    assert not list(tmp_path.iterdir())  # nothing written


def test_synthetic_config_sizes_and_tiny_vocabulary(tmp_path):
    """Sizes the presets never use (head dim 80, 20 ids, one HCA ratio of 3) are written and run
    by the reference; the vocabulary below 300 ids has BOS, EOS, byte symbols and one merge."""
    import ds4
    from ds4.core.tiny import make_synthetic, role_of, synthetic_vocabulary

    cfg = _small_config(head_dim=80, n_rot=16, compress_ratios=(4, 3), n_vocab=20)
    every_f32 = {role_of(n): T.F32 for n in expected_tensors(cfg) if T.F32 in expected_tensors(cfg)[n].types}
    path = make_synthetic(tmp_path / "m.gguf", cfg, every_f32, seed=2)
    tokens, merges = GGUFModel(path).vocabulary
    assert (tokens, merges) == synthetic_vocabulary(20) and len(tokens) == 20 and len(merges) == 1
    s = ds4.Engine.open(path, backend="reference", numerics="exact").session(ctx=32)
    s.sync([1, 5, 19, 3, 7, 7, 2])
    assert s.logits.shape == (20,) and np.isfinite(s.logits).all()
    with pytest.raises(ValueError, match="sizes: unknown ModelConfig field"):
        preset_config("test", head_size=80)
