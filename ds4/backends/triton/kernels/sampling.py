"""Sampling kernels: greedy argmax and min-p / temperature sampling."""

from __future__ import annotations

import triton
import triton.language as tl

from .mmvq import _split_last, _split_reset


@triton.jit
def greedy_next_kernel(logits_ptr, V, best_ptr, at_ptr, cnt_ptr, top_ptr, tok_ptr, pos_ptr, ring_ptr,
                       R: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr):
    """The token a decode step chooses greedily, without the host: the first index of the largest
    finite logit (sampling.argmax's rule; NaN and ±inf are never chosen). With sample_next_kernel
    after it, the last kernels of a captured decode step.

    Each of the grid's programs takes BLOCK logits and leaves its best (best, at); the last to
    arrive (a ticket in cnt) picks among the G of them. The token goes where the next replay of the
    step reads it (tok), into ring[p0 % R] for the host (pinned host memory on the GPU), and the
    position p0 advances by one; the largest logit goes to top for the sampler. With no finite
    logit ring gets -1 and tok 0, so that a step queued behind this one still reads a valid
    embedding row."""
    g = tl.program_id(0)
    o = g * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(logits_ptr + o, mask=o < V, other=float("-inf"))
    ok = (o < V) & (tl.abs(v) < float("inf"))  # (NaN fails the comparison)
    v = tl.where(ok, v, float("-inf"))
    top = tl.max(v, axis=0)
    tl.store(best_ptr + g, top)
    tl.store(at_ptr + g, tl.min(tl.where(ok & (v == top), o, V), axis=0))  # V: none here
    if _split_last(cnt_ptr, 0, G):
        j = tl.arange(0, G)
        tops = tl.load(best_ptr + j, cache_modifier=".cg")
        ats = tl.load(at_ptr + j, cache_modifier=".cg")
        top = tl.max(tops, axis=0)
        first = tl.min(tl.where((tops == top) & (ats < V), ats, V), axis=0)
        none = first >= V
        p0 = tl.load(pos_ptr)
        tl.store(ring_ptr + p0 % R, tl.where(none, -1, first))
        tl.store(tok_ptr, tl.where(none, 0, first))
        tl.store(top_ptr, top)
        tl.store(pos_ptr, p0 + 1)
        _split_reset(cnt_ptr, 0)


@triton.jit
def _min_p_weights(logits_ptr, o, V, top, temp, min_p):
    """ds4's default sampling path (sampling._sample_min_p) in float64: p = exp((l - l_max) / T),
    0 where the logit is not finite or p < min_p."""
    v = tl.load(logits_ptr + o, mask=o < V, other=0.0)
    ok = (o < V) & (tl.abs(v) < float("inf"))
    p = tl.exp((v.to(tl.float64) - top.to(tl.float64)) / temp)
    return tl.where(ok & (p >= min_p), p, 0.0)


@triton.jit
def sample_next_kernel(logits_ptr, V, mass_ptr, cnt_ptr, top_ptr, tok_ptr, pos_ptr, ring_ptr, draw_ptr,
                       R: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr):
    """The token a decode step draws on ds4's default sampling path, after greedy_next_kernel
    (which advanced the position to p0 + 1 and left the largest logit in top).

    draw[p0 % R] holds (T, min_p, U), copied in by the host ahead of the step, and T goes back to
    0 once the step has read it; T <= 0 keeps greedy's token. Otherwise, as
    sampling._sample_min_p does in float64: the kept weights p_i (min-p relative to the best,
    p_best = 1), r = U·Σp, and the first token in id order whose running sum reaches r. Each
    program sums its BLOCK weights; the last to arrive finds the block where the running sum of
    the G sums reaches r and scans it. The sums run in another order than numpy's cumsum, so a
    draw within ~1e-15 of a boundary between two tokens may pick the other one."""
    slot = (tl.load(pos_ptr) - 1) % R
    temp = tl.load(draw_ptr + 3 * slot)
    top = tl.load(top_ptr)
    g = tl.program_id(0)
    finite = tl.abs(top) < float("inf")
    if (temp > 0) & (g == 0) & (finite == 0):  # no token to draw: greedy's -1 stays
        tl.store(draw_ptr + 3 * slot, 0.0)
    if (temp > 0) & finite:
        min_p = tl.load(draw_ptr + 3 * slot + 1)
        p = _min_p_weights(logits_ptr, g * BLOCK + tl.arange(0, BLOCK), V, top, temp, min_p)
        tl.store(mass_ptr + g, tl.sum(p, axis=0))
        if _split_last(cnt_ptr, 0, G):
            j = tl.arange(0, G)
            mass = tl.load(mass_ptr + j, cache_modifier=".cg")
            run = tl.cumsum(mass, axis=0)
            r = tl.load(draw_ptr + 3 * slot + 2) * tl.sum(mass, axis=0)
            # the first block with weight whose running sum reaches r (the last block with
            # weight if rounding leaves r above them all)
            c = tl.min(tl.where((mass > 0) & (run >= r), j, G), axis=0)
            c = tl.where(c < G, c, tl.max(tl.where(mass > 0, j, 0), axis=0))
            before = tl.sum(tl.where(j < c, mass, 0.0), axis=0)
            o = c * BLOCK + tl.arange(0, BLOCK)
            p = _min_p_weights(logits_ptr, o, V, top, temp, min_p)
            cum = before + tl.cumsum(p, axis=0)
            pick = tl.min(tl.where((p > 0) & (cum >= r), o, V), axis=0)
            pick = tl.where(pick < V, pick, tl.max(tl.where(p > 0, o, 0), axis=0))
            tl.store(ring_ptr + slot, pick)
            tl.store(tok_ptr, pick)
            tl.store(draw_ptr + 3 * slot, 0.0)  # (every program has read T: it took its ticket after)
            _split_reset(cnt_ptr, 0)
