"""The model rules of ds4/core/rules.py, compiled for the kernels.

In a kernel, `rules.visible_compressed_rows(t, M)`, `rules.sinkhorn(c, ITERS, eps)`, ... are the
core's own functions compiled by `triton.jit`, with the array namespace bound to
`triton.language` through the wrappers below (the reductions take numpy's `keepdims`; Triton's
interpreter patches `tl.exp` and the rest while a kernel runs, so they are looked up then). The
reference and MLX backends run the same code, so a rule changed there changes here.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl

from ....core import rules as core_rules


@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _where(c, a, b):
    return tl.where(c, a, b)


@triton.jit
def _sum(x, axis: tl.constexpr, keepdims: tl.constexpr):
    return tl.sum(x, axis=axis, keep_dims=keepdims)


@triton.jit
def _max(x, axis: tl.constexpr, keepdims: tl.constexpr):
    return tl.max(x, axis=axis, keep_dims=keepdims)


@triton.jit
def _f32(x):
    return x


def _namespace() -> types.ModuleType:
    ns = types.ModuleType("triton.language (ds4 rules)")
    ns.exp, ns.maximum, ns.where, ns.sum, ns.max = _exp, _maximum, _where, _sum, _max
    return ns


rules = core_rules.bind(_namespace(), _f32, compile=triton.jit, constant=tl.constexpr, tl=tl)
