"""Random valid GGUF blocks generated on the GPU, for full-size synthetic models.

`TritonBackend(..., synthetic=True)` calls `synthetic_bytes` instead of reading a tensor's bytes,
so a DS4 Flash-shaped GGUF whose data is a hole (`ds4.core.gguf_write.write_sparse_gguf`) runs
without an 81 GB file ever being written or read. Magnitudes follow `ds4.core.tiny`: norm weights
near 1, linear layers with unit-variance outputs for unit-RMS inputs, so activations stay O(1).
The quant fields are uniform random bytes (every bit pattern is valid in Q2_K, Q4_K, IQ2_XXS);
the f16 super-block scales get the distributions of `ds4.core.quants.random_blocks`, rescaled to
the wanted RMS with a factor measured on a small CPU sample of the same distribution.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np
import torch

from ...core.quants import FORMATS, GGMLType as T, row_bytes


@lru_cache(maxsize=None)
def _rms_of_random_blocks(t: int) -> float:
    f = FORMATS[T(t)]
    blocks = f.random(np.random.default_rng(0), 4096)
    return float(np.sqrt(np.mean(np.square(f.decode(blocks), dtype=np.float64))))


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _floats(values: torch.Tensor, t: T) -> torch.Tensor:
    if t == T.F32:
        return values.to(torch.float32).contiguous().view(torch.uint8).reshape(-1)
    if t == T.F16:
        return values.to(torch.float16).contiguous().view(torch.uint8).reshape(-1)
    if t == T.BF16:
        return values.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)
    raise ValueError(f"cannot write float values as {t.name}")


def _quant_blocks(t: T, n_values: int, scale: float, dev, g: torch.Generator) -> torch.Tensor:
    f = FORMATS[t]
    nb = n_values // f.block_values
    if t == T.Q8_0:
        q = torch.randint(-127, 128, (nb, 32), device=dev, generator=g, dtype=torch.int8)
        # uniform integers in [-127, 127] have RMS 73.6
        d = (torch.rand(nb, device=dev, generator=g) + 0.5) * (scale / 73.6 / 1.04)
        return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1).reshape(-1)
    blocks = torch.randint(0, 256, (nb, f.block_bytes), device=dev, generator=g, dtype=torch.uint8)
    factor = scale / _rms_of_random_blocks(int(t))
    d = (torch.rand(nb, device=dev, generator=g) + 0.5) * factor
    if t == T.Q2_K:
        dmin = d * (torch.rand(nb, device=dev, generator=g) + 1.0)
        blocks[:, 80:82] = _f16_bytes(d)
        blocks[:, 82:84] = _f16_bytes(dmin)
    elif t == T.Q4_K:
        dmin = d * (torch.rand(nb, device=dev, generator=g) * 3.0 + 6.0)
        blocks[:, 0:2] = _f16_bytes(d)
        blocks[:, 2:4] = _f16_bytes(dmin)
    elif t == T.IQ2_XXS:
        blocks[:, 0:2] = _f16_bytes(d)
    else:
        raise ValueError(f"no random blocks for {t.name}")
    return blocks.reshape(-1)


def tensor_generator(name: str, seed: int, dev) -> torch.Generator:
    """The generator of one tensor's bytes: seeded by the model seed and the tensor's name, so
    a tensor's bytes do not depend on which other tensors were made before it."""
    return torch.Generator(device=dev).manual_seed((seed << 32) ^ zlib.crc32(name.encode()))


def synthetic_bytes(name: str, ttype, dims: tuple[int, ...], cfg, dev, g: torch.Generator) -> torch.Tensor:
    """The bytes of one tensor (flat uint8 on `dev`), by the tensor's role (see ds4.core.tiny)."""
    t = T(int(ttype))
    n = int(np.prod(dims, dtype=np.int64))
    if t == T.I32:  # tid2eid: n_expert_used distinct experts for every token id
        rows = torch.argsort(torch.rand(dims[1], cfg.n_expert, device=dev, generator=g), dim=1)[:, : dims[0]]
        return rows.to(torch.int32).contiguous().view(torch.uint8).reshape(-1)

    def randn(k):
        return torch.randn(k, device=dev, generator=g)

    if name.endswith("norm.weight"):
        out = _floats(1.0 + 0.1 * randn(n), t)
    elif name.endswith(("hc_attn_scale.weight", "hc_ffn_scale.weight", "output_hc_scale.weight")):
        out = _floats(0.5 + 0.5 * torch.rand(n, device=dev, generator=g), t)
    elif name.endswith(("_base.weight", "exp_probs_b.bias")):
        out = _floats(0.1 * randn(n), t)
    elif name.endswith("attn_sinks.weight"):
        out = _floats(randn(n), t)
    elif name.endswith("compressor_ape.weight"):
        out = _floats(0.5 * randn(n), t)
    else:
        scale = 1.0 if name == "token_embd.weight" else 1.0 / float(np.sqrt(dims[0]))
        if t in (T.F32, T.F16, T.BF16):
            out = _floats(scale * randn(n), t)
        else:
            out = _quant_blocks(t, n, scale, dev, g)
    want = row_bytes(t, dims[0]) * (n // dims[0])
    assert out.numel() == want, (name, out.numel(), want)
    return out
