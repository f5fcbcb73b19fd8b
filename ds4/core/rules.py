"""The model's rules that every backend applies, each defined once here (issue #31 point 2).

Each rule is written against two module globals: `xp`, the array namespace (functions `exp`,
`maximum`, `where`, `sum`, `max`, `concatenate`, `arange`, `take_along_axis`, `broadcast_to`),
and `f32`, which makes a float32 scalar of that namespace. In this module they are numpy, so
the reference backend calls the rules directly. Another backend takes its own copy with
`bind(namespace, f32)`: the same functions, compiled from the same code, with `xp` and `f32`
bound to MLX or, for the Triton kernels, to `triton.language` (ds4/backends/triton/kernels/
rules.py, which passes `compile=triton.jit`). So every backend runs these lines, in the same
float32 operations in the same order.

The rules the Triton kernels call are therefore written in the subset a Triton kernel compiles:
operators, `xp` calls with `axis` / `keepdims` given as literals, `f32(...)` of scalars, and
`range` loops. `overlapping_lanes` and `mhc_split` gather and slice whole arrays and are for
the array backends; the kernels call the index rules they are built from.
"""

from __future__ import annotations

import types
from typing import Callable

import numpy as np

xp = np  # the array namespace of this copy of the rules (see bind)
f32 = np.float32  # a float32 scalar of that namespace

# §3.7: the routed experts' weights are normalised by max(Σ p, ROUTER_WEIGHT_FLOOR), so a token
# whose selected experts all score ~0 is not divided by zero (ds4's constant, ~2⁻¹⁴).
ROUTER_WEIGHT_FLOOR = 6.1035e-5

# the module constants a compiled copy sees as compile-time constants
CONSTANTS = ("ROUTER_WEIGHT_FLOOR",)


def sigmoid(x):
    """1 / (1 + e^−x), the form every backend evaluates."""
    return 1.0 / (1.0 + xp.exp(-x))


def router_scale(w, total, scale):
    """§3.7: a selected expert's score w -> w / max(total, floor) · scale, total = Σ of the
    token's selected scores."""
    return w / xp.maximum(total, f32(ROUTER_WEIGHT_FLOOR)) * f32(scale)


def router_weights(w, scale):
    """§3.7: the selected experts' scores [n, k] -> their weights (router_scale per row)."""
    return router_scale(w, xp.sum(w, axis=1, keepdims=True), scale)


def csa_candidate_position(w, r, ratio):
    """§3.5, CSA: the position of candidate r (0 .. 2·ratio − 1) of window w. Rows 0 .. ratio − 1
    are the previous window's positions, rows ratio .. 2·ratio − 1 this window's."""
    return ratio * w - ratio + r


def csa_candidate_lane(r, ratio, d):
    """§3.5, CSA (two lanes of width d): the first lane column candidate r is read at: lanes
    0 .. d − 1 for the previous window's rows, lanes d .. 2d − 1 for this window's."""
    return xp.where(r < ratio, 0, d)


def overlapping_lanes(prev, cur, d: int):
    """§3.5, CSA: the window pooled when it closes, from the previous and the current window's
    rows `prev`, `cur` [..., ratio, 2d] -> the candidates [..., 2·ratio, d]."""
    rows = xp.concatenate([prev, cur], axis=-2)
    ratio = prev.shape[-2]
    lane = csa_candidate_lane(xp.arange(2 * ratio), ratio, d)[:, None] + xp.arange(d)[None, :]
    return xp.take_along_axis(rows, xp.broadcast_to(lane, rows.shape[:-1] + (d,)), axis=-1)


def pool_shift(top):
    """§3.5: what the pooled scores are shifted by, their max per dimension; 0 for a dimension
    whose scores are all −∞ (no score yet), so that it pools to 0 rather than to NaN."""
    return xp.where(top == float("-inf"), 0.0, top)


def pool_weight(score, shift):
    """§3.5: a candidate's unnormalised softmax weight."""
    return xp.exp(score - shift)


def pool_finish(acc, den):
    """§3.5: Σ p·v / Σ p per dimension, and 0 where Σ p = 0."""
    ok = den > 0
    return xp.where(ok, acc / xp.where(ok, den, 1.0), 0.0)


def softmax_pool(scores, values, axis: int):
    """§3.5: the compressor's pooling, a softmax over the window's rows (`axis`) of `scores`,
    per dimension, applied to `values`; a dimension whose scores are all −∞ pools to 0."""
    p = pool_weight(scores, pool_shift(xp.max(scores, axis=axis, keepdims=True)))
    return pool_finish(xp.sum(p * values, axis=axis), xp.sum(p, axis=axis))


def visible_compressed_rows(t, ratio):
    """§3.5 (used by §3.4 and §3.6): the query at position t sees compressed rows
    0 .. (t + 1) // ratio − 1, those of the windows that closed at or before t."""
    return (t + 1) // ratio


def rope_rotate(a, b, cos, sin):
    """§1.1: a pair (a, b) of the rotated tail dims turned by the angle whose cos and sin are
    given (−sin turns it back)."""
    return a * cos - b * sin, a * sin + b * cos


def mhc_pre_weights(mix, scale0, base, eps):
    """§3.2 and §3.8: the collapse weights pre[i] = sigmoid(mix[i]·scale[0] + base[i]) + eps."""
    return sigmoid(mix * scale0 + base) + f32(eps)


def mhc_post_weights(mix, scale1, base):
    """§3.2: the expansion weights post[i] = 2·sigmoid(mix[HC+i]·scale[1] + base[HC+i])."""
    return 2.0 * sigmoid(mix * scale1 + base)


def sinkhorn(c, iters, eps):
    """§3.2: comb from its logits [..., HC, HC]: row softmax + eps, a column normalisation, then
    iters−1 row/column rounds."""
    e = f32(eps)
    c = xp.exp(c - xp.max(c, axis=-1, keepdims=True))
    c = c / xp.sum(c, axis=-1, keepdims=True) + e
    c = c / (xp.sum(c, axis=-2, keepdims=True) + e)
    for _ in range(iters - 1):
        c = c / (xp.sum(c, axis=-1, keepdims=True) + e)
        c = c / (xp.sum(c, axis=-2, keepdims=True) + e)
    return c


def mhc_split(mix, scale, base, n_hc: int, iters: int, eps: float):
    """§3.2: the mHC mixing projection [n, (2+HC)·HC] -> (pre [n, HC], post [n, HC],
    comb [n, HC, HC])."""
    HC = n_hc
    pre = mhc_pre_weights(mix[:, :HC], scale[0], base[:HC], eps)
    post = mhc_post_weights(mix[:, HC:2 * HC], scale[1], base[HC:2 * HC])
    c = (mix[:, 2 * HC:] * scale[2] + base[2 * HC:]).reshape(-1, HC, HC)
    return pre, post, sinkhorn(c, iters, eps)


RULES = ("sigmoid", "router_scale", "router_weights", "csa_candidate_position", "csa_candidate_lane",
         "overlapping_lanes", "pool_shift", "pool_weight", "pool_finish", "softmax_pool",
         "visible_compressed_rows", "rope_rotate", "mhc_pre_weights", "mhc_post_weights", "sinkhorn", "mhc_split")


def bind(namespace, make_f32: Callable, compile: Callable | None = None,
         constant: Callable | None = None, **extra) -> types.ModuleType:
    """A copy of these rules with `xp` = namespace and `f32` = make_f32: every function is this
    module's code (the same code object) with the copy's globals, so the rules call each other's
    copies. `compile` wraps each function (triton.jit); `constant` each CONSTANTS value
    (tl.constexpr); `extra` are further globals of the copy (Triton's interpreter looks for
    triton.language among a function's globals)."""
    copy = types.ModuleType(f"{__name__}[{getattr(namespace, '__name__', namespace)}]")
    g = copy.__dict__
    g.update({k: v for k, v in globals().items() if not k.startswith("__")})
    g.update(xp=namespace, f32=make_f32, **extra)
    for name in CONSTANTS:
        g[name] = constant(g[name]) if constant else g[name]
    for name in RULES:
        fn = globals()[name]
        bound = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__)
        bound.__doc__, bound.__module__, bound.__qualname__ = fn.__doc__, fn.__module__, fn.__qualname__
        g[name] = compile(bound) if compile else bound
    return copy
