"""The model's rules that every backend applies, each defined once here (issue #31 point 2).

A rule is written against an array namespace `xp` (numpy, mlx.core: anything with `exp`,
`maximum`, `concatenate` and arrays with `sum` / `max`) and `f32`, the function that makes a
float32 scalar of that namespace, so that the reference (numpy) and MLX backends run the same
float32 operations in the same order. Triton kernels cannot call Python: they receive the
constants below as kernel arguments, and tests hold them to the backends that call these rules.
"""

from __future__ import annotations

import numpy as np

# §3.7: the routed experts' weights are normalised by max(Σ p, ROUTER_WEIGHT_FLOOR), so a token
# whose selected experts all score ~0 is not divided by zero (ds4's constant, ~2⁻¹⁴).
ROUTER_WEIGHT_FLOOR = 6.1035e-5

def sigmoid(x, xp=np):
    """1 / (1 + e^−x), the form every backend evaluates."""
    return 1.0 / (1.0 + xp.exp(-x))


def router_weights(w, scale: float, xp=np, f32=np.float32):
    """§3.7: the selected experts' scores [n, k] -> weights w_i / max(Σ w, floor) · scale."""
    w = w / xp.maximum(w.sum(axis=1, keepdims=True), f32(ROUTER_WEIGHT_FLOOR))
    return w * f32(scale)


def overlapping_lanes(prev, cur, d: int, xp=np):
    """§3.5, CSA (two lanes of width d): the window pooled when it closes is the previous
    window's rows with lanes 0..d−1 followed by the current window's rows with lanes d..2d−1.
    `prev`, `cur`: [..., ratio, 2d] -> [..., 2·ratio, d]."""
    return xp.concatenate([prev[..., :d], cur[..., d:]], axis=-2)


def softmax_pool(scores, values, axis: int, xp=np):
    """§3.5: the compressor's pooling, a softmax over the window's rows (`axis`) of `scores`,
    per dimension, applied to `values`; a dimension whose scores are all −∞ pools to 0."""
    top = scores.max(axis=axis, keepdims=True)
    p = xp.exp(scores - xp.where(xp.isfinite(top), top, 0.0))
    den = p.sum(axis=axis)
    ok = den > 0
    return xp.where(ok, (p * values).sum(axis=axis) / xp.where(ok, den, 1.0), 0.0)


def visible_compressed_rows(t, ratio: int):
    """§3.5 (used by §3.4 and §3.6): the query at position t sees compressed rows
    0 .. (t + 1) // ratio − 1, those of the windows that closed at or before t."""
    return (t + 1) // ratio


def mhc_pre_weights(mix, scale0, base, eps: float, xp=np, f32=np.float32):
    """§3.2 and §3.8: the collapse weights pre[i] = sigmoid(mix[i]·scale[0] + base[i]) + eps."""
    return sigmoid(mix * scale0 + base, xp) + f32(eps)


def mhc_post_weights(mix, scale1, base, xp=np):
    """§3.2: the expansion weights post[i] = 2·sigmoid(mix[HC+i]·scale[1] + base[HC+i])."""
    return 2 * sigmoid(mix * scale1 + base, xp)


def sinkhorn(c, iters: int, eps: float, xp=np, f32=np.float32):
    """§3.2: comb from its logits [..., HC, HC]: row softmax + eps, a column normalisation, then
    iters−1 row/column rounds."""
    e = f32(eps)
    c = xp.exp(c - c.max(axis=-1, keepdims=True))
    c = c / c.sum(axis=-1, keepdims=True) + e
    c = c / (c.sum(axis=-2, keepdims=True) + e)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + e)
        c = c / (c.sum(axis=-2, keepdims=True) + e)
    return c


def mhc_split(mix, scale, base, n_hc: int, iters: int, eps: float, xp=np, f32=np.float32):
    """§3.2: the mHC mixing projection [n, (2+HC)·HC] -> (pre [n, HC], post [n, HC],
    comb [n, HC, HC])."""
    HC = n_hc
    pre = mhc_pre_weights(mix[:, :HC], scale[0], base[:HC], eps, xp, f32)
    post = mhc_post_weights(mix[:, HC:2 * HC], scale[1], base[HC:2 * HC], xp)
    c = (mix[:, 2 * HC:] * scale[2] + base[2 * HC:]).reshape(-1, HC, HC)
    return pre, post, sinkhorn(c, iters, eps, xp, f32)
