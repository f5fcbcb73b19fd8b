"""Tail RoPE frequencies: plain for sliding layers, YaRN-blended for compressed layers (spec §1.1)."""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def inv_freq(cfg: ModelConfig, compressed: bool) -> np.ndarray:
    """Per-pair angular frequency (n_rot/2 values, float32); θ_k = pos · inv_freq[k]."""
    dim = cfg.n_rot
    k = np.arange(dim // 2, dtype=np.float64)
    if not compressed:
        return (cfg.rope_freq_base ** (-2.0 * k / dim)).astype(np.float32)
    base = cfg.compress_rope_freq_base
    freq = base ** (-2.0 * k / dim)

    def correction_dim(rotations: float) -> float:
        # the pair index whose wavelength fits `rotations` times into the original context
        return dim * math.log(cfg.rope_orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((k - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
    # No magnitude (mscale) correction: ds4 and transformers both leave the amplitude at 1.
    return (freq * (keep + (1.0 - keep) / cfg.rope_scale_factor)).astype(np.float32)


def layer_inv_freq(cfg: ModelConfig, il: int) -> np.ndarray:
    return inv_freq(cfg, compressed=cfg.ratio(il) != 0)
