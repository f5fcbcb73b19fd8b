"""Sizes that are not powers of two on the Triton backend, against the reference.

The kernels span a head, a pair of RoPE dims, a compressor window or an indexer key with
tl.arange, whose sizes must be powers of two: a head dim of 96 or 80, an indexer key of 48, a
compress ratio of 3 or 6, 3 heads or 6 experts run through padded ranges with the pad masked.
What the kernels cannot run (an odd head dim, a row length that is not a whole number of
32-value units) is refused when the model is opened, naming the dimension or the tensor.

Without a GPU the kernels run under TRITON_INTERPRET=1 on small models: three layers (sliding,
CSA with the indexer, HCA), a prompt that slides the window, closes windows of both ratios and
overflows the indexer's top-k, then decode steps.
"""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (conftest.py)

import ds4  # noqa: E402
from ds4.core.config import ConfigError  # noqa: E402
from ds4.core.gguf_model import ModelError  # noqa: E402
from ds4.core.layout import expected_tensors  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.tiny import make_synthetic, preset_config  # noqa: E402

# Exact numerics differ from the reference by float32 summation order only: the test preset's
# whole-model comparison (test_triton_model.LOGITS_RTOL) bounds it.
LOGITS_RTOL = 1e-3
# ds4 numerics also round K/V to FP8 and keep a discrete indexer top-k (test_triton_model.DS4_RTOL)
DS4_RTOL = 1e-2

# A small base: three layers of every kind, F16 experts (their rows need no 256-value blocks).
BASE = dict(n_layer=3, n_embd=128, n_head=4, head_dim=64, n_rot=32, q_lora_rank=64, o_lora_rank=32,
            o_groups=2, n_expert=4, n_expert_used=2, n_ff_exp=64, n_hash_layer=1, sliding_window=6,
            indexer_heads=2, indexer_head_dim=32, indexer_top_k=3, compress_ratios=(0, 4, 8))

CONFIGS = {
    # ds4 numerics: key length − rope = 64, one FP8 block
    "head_dim_96": (dict(head_dim=96, n_rot=32), "ds4"),
    "head_dim_80_ratio_3": (dict(head_dim=80, n_rot=16, compress_ratios=(0, 4, 3)), "exact"),
    "indexer_48_heads_3": (dict(indexer_head_dim=48, n_rot=16, n_head=3, o_groups=3, indexer_heads=3),
                           "exact"),
    "ratio_6_experts_6": (dict(compress_ratios=(0, 4, 6), n_expert=6, n_expert_used=3, n_ff_exp=96),
                          "exact"),
}


def write_model(path, overrides: dict, types: dict[str, T] | None = None, seed: int = 0):
    """A model of BASE + overrides with the test vocabulary; F16 routed experts unless `types`
    (roles to types, given where the role accepts the type) says otherwise."""
    cfg = preset_config("test", **{**BASE, **overrides}, name="sizes")
    chosen = {"ffn_gate_exps.weight": T.F16, "ffn_up_exps.weight": T.F16, "ffn_down_exps.weight": T.F16}
    for spec in expected_tensors(cfg).values():
        for suffix, t in (types or {}).items():
            if spec.name.endswith(suffix) and t in spec.types:
                chosen[spec.name] = t
    return make_synthetic(path, cfg, chosen, seed=seed)


def _rel(a, b):
    assert np.isfinite(a).all()
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sizes_that_are_not_powers_of_two_match_the_reference(tmp_path, name):
    overrides, numerics = CONFIGS[name]
    path = write_model(tmp_path / f"{name}.gguf", overrides)
    ref = ds4.Engine.open(path, backend="reference", numerics=numerics)
    tri = ds4.Engine.open(path, backend="triton", numerics=numerics, device=DEVICE)
    rtol = LOGITS_RTOL if numerics == "exact" else DS4_RTOL
    # 14 tokens: slide the 6-row window, close 3 ratio-4 windows (past the indexer's top-3) and
    # at least one window of the other ratio
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, ref.config.n_vocab, 14)]
    a, b = ref.session(ctx=32), tri.session(ctx=32)
    a.sync(prompt)
    b.sync(prompt)
    for _ in range(2):
        assert _rel(b.logits, a.logits) <= rtol
        t = int(np.argmax(a.logits))
        a.eval(t)
        b.eval(t)
    assert _rel(b.logits, a.logits) <= rtol


def test_an_odd_head_dim_is_refused_naming_it(tmp_path):
    path = write_model(tmp_path / "odd.gguf", dict(head_dim=65, n_rot=16), types={"weight": T.F16})
    ds4.Engine.open(path, backend="reference", numerics="exact")  # the core accepts it
    with pytest.raises(ConfigError, match=r"attention\.key_length.*even.*65"):
        ds4.Engine.open(path, backend="triton", numerics="exact", device=DEVICE)


def test_a_row_length_off_the_decode_unit_is_refused_naming_the_tensor(tmp_path):
    # n_embd 112: valid for F32 / F16 rows, not a whole number of the decoders' 32-value units
    path = write_model(tmp_path / "rows.gguf", dict(n_embd=112), types={"weight": T.F16})
    ds4.Engine.open(path, backend="reference", numerics="exact")
    with pytest.raises(ModelError, match=r"token_embd\.weight.*multiple of 32.*112"):
        ds4.Engine.open(path, backend="triton", numerics="exact", device=DEVICE)
