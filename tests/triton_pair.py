"""The fixtures and helpers the Triton kernel tests share: the tiny test model, a (reference,
Triton) backend pair on it for each numerics mode, tensors on the Triton device, and layer states
filled alike on both. Without a GPU the kernels run under TRITON_INTERPRET=1 (conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds4.backends.reference.backend import ReferenceBackend
from ds4.backends.triton.backend import TritonBackend
from ds4.backends.triton.tuning import TritonTuning
from ds4.core import numerics as nx
from ds4.core.gguf_model import GGUFModel
from ds4.core.state import FILL, SessionLayout, layer_state_shapes
from ds4.core.tiny import make_tiny
from ds4.core.weights import bind_weights
from seeds import rng_for_test

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (conftest.py)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture
def rng(request):
    return rng_for_test(request)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tk") / "test.gguf"
    make_tiny(path, preset="test", seed=3)
    return GGUFModel(path)


@pytest.fixture(scope="module", params=["ds4", "exact"])
def pair(request, model):
    """(reference backend, its weights, triton backend, its weights)"""
    ref = ReferenceBackend(model.config, numerics=request.param)
    tri = TritonBackend(model.config, numerics=request.param, device=DEVICE)
    return ref, bind_weights(model, ref.upload), tri, bind_weights(model, tri.upload)


def _t(tri, x, dtype=torch.float32):
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype=dtype, device=tri.dev)


def _states(ref, tri, cfg, il, ctx=128, rng=None):
    """The same layer state on both backends, filled with random (f16-exact) values; the
    indexer's rows under numerics "ds4" as that numerics makes them (Hadamard + FP4, then f16)."""
    layout = SessionLayout.create(cfg, ctx)
    shapes = layer_state_shapes(cfg, layout, il)
    rs = ref.alloc_state(shapes, FILL)
    if rng is not None:
        for k, v in rs.items():
            if k.endswith("_score"):
                continue
            x = rng.standard_normal(v.shape).astype(np.float32)
            v[...] = nx.f16_round(nx.indexer_qat(x) if k == "index" and ref.ds4_numerics else x)
    ts = tri.alloc_state(shapes, FILL)
    for k in rs:
        tri.state_from_numpy(ts, k, rs[k])
    return rs, ts


# Tiles for the kernel tests' own small shapes in the interpreter: several programs along each
# side of a product, the last one ragged. The interpreter's tuning (tuning.load_tuning) takes one
# large tile instead, so that the whole-model tests run few programs; the routed experts' tiles
# are the GPU's. On a GPU the kernel tests keep the backend's own tiles.
SEVERAL_TILES = dict(f16w_tile=(16, 32, 64, 2, 4, 1), hl_tile=(16, 32, 64, 2, 4, 1),
                     hl_split_rows=TritonTuning.hl_split_rows, mm8_tile=TritonTuning.mm8_tile,
                     moe16_tile=TritonTuning().moe16_tile)


def several_tiles(be: TritonBackend) -> TritonBackend:
    """be with SEVERAL_TILES in the interpreter, as it is on a GPU."""
    if be.interpret:
        for name, tile in SEVERAL_TILES.items():
            setattr(be, name, tile)
    return be


def _cfg():
    """The test preset's config."""
    from ds4.core.tiny import preset_config

    return preset_config("test")


def _check_xq(words, scales, sums, x, perm=False):
    """The XQ form of x [n, K] (words [n, K/2] int32, scales [n, K/32], 16-value sums [n, K/16])
    read back byte by byte as the layout is written out here: per 32-value block 16 words, for
    each 8 values j the hi bytes of values 8j..8j+3, of 8j+4..8j+7, then their lo bytes;
    q = 256·hi + lo. perm (XQ8): for each pair of words 2p, 2p+1 the hi bytes of word w = values
    w, w+8, w+16, w+24 (byte j: value 8j + w), then their lo bytes. Against x rounded by hand: q
    within 1 of floor(x·32639/amax + 0.5) (the GPU's division may round the other way),
    s = amax / 32639, sums s·Σq per 16 values. Returns the x the form stands for, q·s."""
    n, Kd = x.shape
    b = x.reshape(n, Kd // 32, 32).astype(np.float32)
    amax = np.abs(b).max(axis=2)
    by = words.reshape(n, Kd // 32, 4, 4, 1).view(np.uint8).reshape(n, Kd // 32, 4, 4, 4)  # [.., j | p, word, byte]
    if perm:  # [.., p, e, byte j] of word w = 2p + e -> value 8j + w
        hi = by[:, :, :, 0:2].reshape(n, Kd // 32, 8, 4).transpose(0, 1, 3, 2).view(np.int8).astype(np.int64)
        lo = by[:, :, :, 2:4].reshape(n, Kd // 32, 8, 4).transpose(0, 1, 3, 2).view(np.int8).astype(np.int64)
    else:
        hi = np.concatenate([by[:, :, :, 0], by[:, :, :, 1]], axis=3).view(np.int8).astype(np.int64)
        lo = np.concatenate([by[:, :, :, 2], by[:, :, :, 3]], axis=3).view(np.int8).astype(np.int64)
    q = (256 * hi + lo).reshape(n, Kd // 32, 32)
    inv = np.where(amax > 0, np.float32(32639) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    want_q = np.floor(b * inv[:, :, None].astype(np.float32) + np.float32(0.5)).astype(np.int64)
    assert np.abs(q - want_q).max() <= 1 and (q != want_q).mean() < 0.01
    assert np.abs(q).max() <= 32639
    assert np.allclose(scales, amax / 32639, rtol=1e-6, atol=0)
    want_sums = q.reshape(n, Kd // 16, 16).sum(axis=2) * np.repeat(scales, 2, axis=1)
    assert np.allclose(sums, want_sums, rtol=1e-6, atol=1e-30)
    return (q * scales.astype(np.float64)[:, :, None]).reshape(n, Kd)
